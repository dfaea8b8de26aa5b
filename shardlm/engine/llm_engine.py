"""The engine as a synchronous caller (the offline LLM) uses it: prompts in, RequestOutputs out.

    InputProcessor -> EngineCoreClient (in this process by default) -> OutputProcessor
"""

from __future__ import annotations

import time

from shardlm.config import EngineConfig
from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.core_client import EngineCoreClient, make_client
from shardlm.engine.output_processor import OutputProcessor
from shardlm.engine.processor import SLEEPING, InputProcessor, load_tokenizer
from shardlm.logger import init_logger
from shardlm.lora.request import LoRARequest
from shardlm.outputs import RequestOutput
from shardlm.pooling.params import PoolingParams
from shardlm.sampling_params import SamplingParams

logger = init_logger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, multiprocess_mode: bool = False):
        """multiprocess_mode: run the engine core in its own process (SyncMPClient) instead of
        in this one (InprocClient); always so with data parallel (one process per replica)."""
        t0 = time.perf_counter()
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core: EngineCoreClient = make_client(
            config, multiprocess=multiprocess_mode or config.parallel.data_parallel_size > 1)
        self.sleeping = False
        # the other requests' outputs of a step that raised one request's failure: the next step's
        self._held_outputs: list[RequestOutput] = []
        logger.info("Engine started in %.2f s (model %s)", time.perf_counter() - t0, config.model.model)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess_mode: bool = False) -> LLMEngine:
        return cls(args.create_engine_config(), multiprocess_mode)

    @property
    def num_blocks(self) -> int:
        return self.engine_core.num_blocks

    def default_sampling_params(self) -> SamplingParams:
        return self.processor.default_sampling_params()

    def add_request(self, request_id: str, prompt, params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> None:
        """prompt: a string, a list of token ids, or {"prompt": ..., "prompt_token_ids": ...};
        priority: with --scheduling-policy priority, lower runs first."""
        if self.sleeping:
            raise ValueError(SLEEPING)
        parent, requests = self.processor.process(request_id, prompt, params, arrival_time, lora_request, priority)
        self.output_processor.add_request(parent, [r.request_id for r in requests], [r.params for r in requests])
        for r in requests:
            self.engine_core.add_request(r)

    def abort_request(self, request_ids) -> None:
        for rid in ([request_ids] if isinstance(request_ids, str) else request_ids):
            self.engine_core.abort_requests(self.output_processor.abort(rid))

    def has_unfinished_requests(self) -> bool:
        return bool(self._held_outputs) or self.output_processor.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of the requests it changed (as each request's output_kind says).
        Requests that hit a stop string are aborted in the core. Where a request failed, its error
        is raised and the step's other outputs come from the next call."""
        if self._held_outputs:
            held, self._held_outputs = self._held_outputs, []
            return held
        core_outputs = self.engine_core.get_output()
        processed = self.output_processor.process(core_outputs.outputs, core_outputs.engine_index)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        if processed.failed:              # its replica died under it (EngineDeadError), or its own part failed
            self._held_outputs = processed.request_outputs
            raise processed.failed[0][1]
        return processed.request_outputs

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Call `method` on every worker; one result per rank."""
        return self.engine_core.call_utility("collective_rpc", method, list(args))

    # ---- LoRA adapters: read ahead of use, dropped, listed (on every worker) ----
    def add_lora(self, lora_request: LoRARequest) -> bool:
        self.processor.check_lora(lora_request)
        return all(self.collective_rpc("add_lora", (lora_request,)))

    def remove_lora(self, lora_id: int) -> bool:
        return any(self.collective_rpc("remove_lora", (lora_id,)))

    def list_loras(self) -> set[int]:
        return set(self.collective_rpc("list_loras")[0])

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.call_utility("reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        self.engine_core.call_utility("sleep", level)
        self.sleeping = True

    def wake_up(self) -> None:
        self.engine_core.call_utility("wake_up")
        self.sleeping = False

    def stats(self) -> dict:
        return self.engine_core.call_utility("stats")

    def shutdown(self) -> None:
        self.engine_core.shutdown()
