"""AsyncLLM: the asyncio engine for servers. The engine core runs in its own process behind an
AsyncMPClient; this side owns input processing (tokenize, validate once) and output
processing (detokenize, stop strings), and streams RequestOutputs per request.

    llm = AsyncLLM.from_engine_args(EngineArgs(model=...))
    params = SamplingParams(max_tokens=16, output_kind=RequestOutputKind.DELTA)
    async for out in llm.generate("Hello", params, request_id="r1"):
        print(out.outputs[0].text, end="")   # DELTA: the new text; CUMULATIVE (default): all so far
    llm.shutdown()

One output-handler task reads each step's outputs from the client, runs the output processor
and puts every request's output into that request's collector; a generate() loop waits on its
collector only. Leaving the loop early (a client that disconnects) aborts the request and
frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from shardlm import startup  # noqa: F401  (first of shardlm's: it counts the threads importing torch starts)
from shardlm.config import EngineConfig
from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.core_client import AsyncMPClient, EngineDeadError
from shardlm.engine.output_processor import OutputProcessor
from shardlm.engine.processor import SLEEPING, InputProcessor, load_tokenizer, split_prompt
from shardlm.engine.restarts import RestartPolicy
from shardlm.logger import init_logger
from shardlm.lora.request import LoRARequest
from shardlm.outputs import RequestOutput
from shardlm.pooling.params import PoolingParams
from shardlm.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


class RequestOutputCollector:
    """The outputs of one request not yet taken by its reader. A reader that falls behind gets
    the deltas it missed merged into one (DELTA), or only the newest output (the others)."""

    def __init__(self, kind: RequestOutputKind):
        self.kind = kind
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        if isinstance(self.output, RequestOutput) and isinstance(output, RequestOutput) \
                and self.kind == RequestOutputKind.DELTA:
            self.output.add(output)
        elif not isinstance(self.output, BaseException):
            self.output = output
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output


def log_request(request_id: str, prompt, request, lora_request: LoRARequest | None, max_len: int | None) -> None:
    """--enable-log-requests: the request as the engine takes it (vLLM's "Received request" line)."""
    text, _ = split_prompt(prompt)
    ids = request.prompt_token_ids
    logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s (%d), lora_request: %s.",
                request_id, text[:max_len] if text is not None and max_len is not None else text,
                request.pooling_params or request.params,
                ids[:max_len] if max_len is not None else ids, len(ids),
                lora_request.lora_name if lora_request else None)


class AsyncLLM:
    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop | None = None,
                 restarts: RestartPolicy | None = None):
        """restarts: start a dead engine core again (the server's policy); None: it stays dead."""
        t0 = time.perf_counter()
        self.config = config
        self.loop = loop or asyncio.get_event_loop()
        self.tokenizer = load_tokenizer(config.model)
        self.processor = InputProcessor(config, self.tokenizer)
        model = config.model
        self.output_processor = OutputProcessor(self.tokenizer, model.stream_interval, model.enable_log_outputs,
                                                model.max_log_len)
        self.engine_core = AsyncMPClient(config, self.loop, restarts)
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._output_handler: asyncio.Task | None = None
        self.sleeping = False            # sleep mode: requests are refused until wake_up
        logger.info("Engine started in %.2f s (model %s)", time.perf_counter() - t0, config.model.model)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args.create_engine_config())

    @property
    def num_blocks(self) -> int:
        return self.engine_core.num_blocks

    @property
    def dead_reason(self) -> str | None:
        return self.engine_core.dead_reason

    @property
    def dead_replicas(self) -> dict[int, str]:
        """Data parallel replicas that died while others serve on: replica -> why."""
        return {self.engine_core.cores[k].config.parallel.data_parallel_rank: why
                for k, why in self.engine_core.balancer.dead.items()}

    @property
    def is_running(self) -> bool:
        """False once the engine is dead for good (a restart in progress is not that)."""
        return self.dead_reason is None

    @property
    def unavailable(self) -> str | None:
        """Why no request can be taken now: dead, or (every replica) starting again."""
        return self.engine_core.unavailable

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far: of the whole engine ("engine") and of each data parallel replica (its rank)."""
        restarter = self.engine_core.restarter
        return restarter.counts() if restarter is not None else {}

    @property
    def on_finished(self) -> Callable[[RequestOutput], None] | None:
        """Called with each finished request's whole output (server metrics)."""
        return self.output_processor.on_finished

    @on_finished.setter
    def on_finished(self, hook: Callable[[RequestOutput], None] | None) -> None:
        self.output_processor.on_finished = hook

    def default_sampling_params(self) -> SamplingParams:
        return self.processor.default_sampling_params()

    @property
    def num_unfinished(self) -> int:
        """Engine-core requests added and not finished (each of a request's n samples is one)."""
        return len(self.output_processor.samples)

    @property
    def num_waiting(self) -> int:
        """Engine-core requests not yet running: those added and unfinished, less the running
        ones the engine cores last reported (an estimate that errs towards more)."""
        return max(0, self.num_unfinished - self.engine_core.num_running)

    # ---- requests ----
    def generate(self, prompt: str | list[int] | dict, sampling_params: SamplingParams | PoolingParams,
                 request_id: str, lora_request: LoRARequest | None = None,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Check the request and send it to the engine core now (bad input raises here, before a
        caller starts any response), then stream its outputs as the returned iterator is read.
        prompt: a string, a list of token ids, or {"prompt": ..., "prompt_token_ids": ...}.
        PoolingParams (a pooling model): one PoolingRequestOutput at the end.
        Closing the iterator early aborts the request (a caller that never reads it calls abort)."""
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        if self.sleeping:
            raise ValueError(SLEEPING)
        if request_id in self._collectors:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        parent, requests = self.processor.process(request_id, prompt, sampling_params, lora_request=lora_request,
                                                  priority=priority)
        if self.config.model.enable_log_requests:
            log_request(request_id, prompt, requests[0], lora_request, self.config.model.max_log_len)
        parent.collector = collector = RequestOutputCollector(parent.params.output_kind)
        self._collectors[request_id] = collector
        self.output_processor.add_request(parent, [r.request_id for r in requests], [r.params for r in requests])
        self._start_output_handler()
        try:
            for r in requests:
                self.engine_core.add_request(r)
        except BaseException:
            self._collectors.pop(request_id, None)
            self.output_processor.abort(request_id)
            raise
        return self._stream(request_id, collector)

    async def _stream(self, request_id: str, collector: RequestOutputCollector) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            self._collectors.pop(request_id, None)
            if not finished and self.dead_reason is None:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; a reader still waiting on it gets CancelledError."""
        collector = self._collectors.pop(request_id, None)
        if collector is not None:
            collector.put(asyncio.CancelledError(f"Request {request_id} was aborted."))
        self.engine_core.abort_requests(self.output_processor.abort(request_id))

    def _start_output_handler(self) -> None:
        if self._output_handler is None:
            self._output_handler = self.loop.create_task(self._handle_outputs())

    async def _handle_outputs(self) -> None:
        """Each step's outputs, through the output processor, into the requests' collectors."""
        try:
            while True:
                core_outputs = await self.engine_core.get_output_async()
                processed = self.output_processor.process(core_outputs.outputs, core_outputs.engine_index)
                if processed.reqs_to_abort:
                    self.engine_core.abort_requests(processed.reqs_to_abort)
                for parent, error in processed.failed:    # its replica died under it, or its own part failed
                    collector = self._collectors.pop(parent.request_id, None)
                    if collector is not None:
                        collector.put(error)
                # Let the streams read this step before the next: queued steps come back from
                # get_output_async without a pause, and a stream not yet woken would receive them
                # merged into one delta (as vLLM's handler, which yields between chunks).
                await asyncio.sleep(0)
        except EngineDeadError as e:
            logger.error("%s In-flight requests fail.", e)
            self._fail_requests(e)
        except Exception as e:       # a bug here must not leave requests waiting forever
            logger.exception("Output processing failed")
            self._fail_requests(RuntimeError(f"Output processing failed: {type(e).__name__}: {e}"))

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with `error` (their callers raise it) and abort them in the engine."""
        request_ids = list(self._collectors)
        self._fail_requests(error)
        for request_id in request_ids:
            self.abort(request_id)

    def _fail_requests(self, error: BaseException) -> None:
        for collector in self._collectors.values():
            collector.put(error)

    # ---- utilities ----
    async def stats(self) -> dict:
        return await self.engine_core.call_utility_async("stats")

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.call_utility_async("reset_prefix_cache")

    async def sleep(self, level: int = 1) -> None:
        await self.engine_core.call_utility_async("sleep", level)
        self.sleeping = True

    async def wake_up(self) -> None:
        await self.engine_core.call_utility_async("wake_up")
        self.sleeping = False

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check the adapter and read it on every worker, ahead of its first request."""
        await asyncio.to_thread(self.processor.check_lora, lora_request)
        added = all(await self.collective_rpc("add_lora", (lora_request,)))
        if added:
            self.engine_core.adapters[lora_request.lora_int_id] = lora_request    # for a restarted core
        return added

    async def remove_lora(self, lora_id: int) -> bool:
        self.engine_core.adapters.pop(lora_id, None)
        return any(await self.collective_rpc("remove_lora", (lora_id,)))

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return await self.engine_core.call_utility_async("collective_rpc", method, list(args))

    def shutdown(self) -> None:
        if self._output_handler is not None and not self.loop.is_closed():
            self._output_handler.cancel()
        self.engine_core.shutdown()
