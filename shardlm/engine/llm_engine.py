"""The engine as a caller uses it: prompts in, RequestOutputs out.

Tokenizes and validates requests, fans a request with n samples out into n engine-core
requests (with prefix caching they share the prompt's KV blocks), and runs the engine
core in this process.
"""

from __future__ import annotations

import time

from shardlm.config import EngineArgs, EngineConfig
from shardlm.engine.engine_core import EngineCore
from shardlm.engine.output_processor import OutputProcessor, ParentRequest
from shardlm.logger import init_logger
from shardlm.outputs import RequestMetrics, RequestOutput
from shardlm.sampling_params import SamplingParams

logger = init_logger(__name__)

# generation_config.json keys -> SamplingParams fields (used when the caller gives no params)
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    def __init__(self, config: EngineConfig, core=None):
        """`core`: the engine core to drive; by default one in this process (EngineCore). The
        server passes a client of an engine core in its own process (same methods)."""
        t0 = time.perf_counter()
        self.config = config
        self.tokenizer = load_tokenizer(config.model.tokenizer)
        self.core = core if core is not None else EngineCore(config)
        self.output_processor = OutputProcessor(self.tokenizer)
        logger.info("Engine started in %.2f s (model %s)", time.perf_counter() - t0, config.model.model)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def default_sampling_params(self) -> SamplingParams:
        gen = self.config.model.generation_defaults
        values = {field: gen[key] for key, field in _GENERATION_DEFAULTS.items() if gen.get(key) is not None}
        if gen.get("do_sample") is False:
            values["temperature"] = 0.0
        return SamplingParams(**values)

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams, arrival_time: float | None = None) -> None:
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise TypeError(f"A prompt must be a string or a list of token ids, not {type(prompt).__name__}.")
            prompt_token_ids = self.tokenize_prompt(prompt)
        self._validate(prompt_token_ids)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, not {type(params).__name__}.")
        arrival_time = arrival_time or time.time()
        parent = ParentRequest(request_id, prompt, list(prompt_token_ids), params, RequestMetrics(arrival_time))
        if params.n == 1:
            child_ids, child_params = [request_id], [params]
        else:
            child_ids = [f"{i}_{request_id}" for i in range(params.n)]
            child_params = [params.clone(n=1, seed=None if params.seed is None else params.seed + i)
                            for i in range(params.n)]
        self.output_processor.add_request(parent, child_ids, child_params)
        for cid, sp in zip(child_ids, child_params):
            self.core.add_request(cid, list(prompt_token_ids), sp, arrival_time)

    def _validate(self, ids: list[int]) -> None:
        max_len = self.config.model.max_model_len
        if not ids:
            raise ValueError("The prompt is empty: give at least one token.")
        if len(ids) >= max_len:
            raise ValueError(f"The prompt is {len(ids)} tokens long, but max_model_len={max_len} leaves no room "
                             f"for output: shorten the prompt below {max_len} tokens or raise max_model_len.")
        vocab = self.config.model.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id(s) {bad[:5]} are outside the vocabulary [0, {vocab}).")

    def abort_request(self, request_ids) -> None:
        for rid in ([request_ids] if isinstance(request_ids, str) else request_ids):
            self.core.abort_requests(self.output_processor.abort(rid))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        return self.process_core_outputs(self.core.step(), final_only)

    def process_core_outputs(self, core_outputs, final_only: bool = False) -> list[RequestOutput]:
        """Detokenize and gather the core's token deltas; requests that hit a stop string are
        aborted in the core."""
        outputs, to_abort = self.output_processor.process(core_outputs, final_only)
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()
