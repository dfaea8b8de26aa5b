"""AsyncLLM: the asyncio engine for servers. The engine core runs in its own process
(core_process.py); this side tokenizes, detokenizes and streams RequestOutputs per request.

    llm = AsyncLLM.from_engine_args(EngineArgs(model=...))
    async for out in llm.generate("Hello", SamplingParams(max_tokens=16), request_id="r1"):
        print(out.outputs[0].text)        # cumulative text so far; out.finished on the last one
    llm.shutdown()

Leaving the loop early (a client that disconnects) aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from shardlm.config import EngineArgs, EngineConfig
from shardlm.engine.core_process import EngineCoreClient, EngineDeadError
from shardlm.engine.llm_engine import LLMEngine
from shardlm.logger import init_logger
from shardlm.outputs import RequestOutput
from shardlm.sampling_params import SamplingParams

logger = init_logger(__name__)


class AsyncLLM:
    def __init__(self, engine_args: EngineArgs, loop: asyncio.AbstractEventLoop | None = None,
                 config: EngineConfig | None = None):
        # validated here (fast, with the start-up memory check) unless the caller already did;
        # the engine process resolves its own copy from the same arguments
        config = config or engine_args.create_engine_config()
        self.loop = loop or asyncio.get_event_loop()
        self._queues: dict[str, asyncio.Queue] = {}
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.dead_reason: str | None = None
        self.on_finished = None   # called with each finished RequestOutput (server metrics)
        self.core = EngineCoreClient(engine_args, self._outputs_from_thread, self._utility_from_thread,
                                     self._dead_from_thread)
        config.cache.num_blocks = self.core.num_blocks
        self.engine = LLMEngine(config, core=self.core)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args)

    @property
    def config(self):
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self.dead_reason is None

    # ---- requests ----
    async def generate(self, prompt: str | list[int] | dict, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._queues:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        text, token_ids = _split_prompt(prompt)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self.engine.add_request(request_id, text, token_ids, sampling_params)
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.dead_reason is None:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    # ---- utilities ----
    async def stats(self) -> dict:
        return await self._utility("stats")

    async def reset_prefix_cache(self) -> bool:
        return (await self._utility("reset_prefix_cache"))["reset"]

    async def _utility(self, method: str) -> dict:
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        future = self.loop.create_future()
        self._utility_futures[call_id] = future
        self.core.call_utility(call_id, method)
        return await future

    # ---- from the reader thread, onto the event loop ----
    def _outputs_from_thread(self, core_outputs) -> None:
        self.loop.call_soon_threadsafe(self._on_outputs, core_outputs)

    def _utility_from_thread(self, call_id: int, result: dict) -> None:
        self.loop.call_soon_threadsafe(self._on_utility, call_id, result)

    def _dead_from_thread(self, reason: str) -> None:
        self.loop.call_soon_threadsafe(self._on_dead, reason)

    def _on_outputs(self, core_outputs) -> None:
        for out in self.engine.process_core_outputs(core_outputs):
            if out.finished and self.on_finished is not None:
                self.on_finished(out)
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _on_utility(self, call_id: int, result: dict) -> None:
        future = self._utility_futures.pop(call_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def _on_dead(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("%s In-flight requests fail.", reason)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._utility_futures.clear()

    def shutdown(self) -> None:
        self.core.shutdown()


def _split_prompt(prompt) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return prompt.get("prompt"), list(ids) if ids is not None else None
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise TypeError(f"Cannot read prompt {prompt!r}: use a string, a list of token ids, or a dict.")
