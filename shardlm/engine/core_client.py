"""How a front end (LLMEngine, AsyncLLM) talks to an engine core: one interface, as in vLLM v1.

    EngineCoreClient            the interface: add_request, abort_requests, get_output(_async),
                                call_utility(_async), shutdown; num_blocks once started
      InprocClient              the engine core in this process (LLM: no process hop)
      MPClient                  the engine core in its own process, behind two pipes
        SyncMPClient            get_output() blocks
        AsyncMPClient           get_output_async() awaits, on the caller's event loop

A data-parallel front end is one more implementation (several engine cores behind one client).
In the multiprocess clients a reader thread drains the output pipe at once (so neither side
ever blocks on a full pipe) and hands each message on: outputs to a queue, utility results to
the waiting caller, the core's death to everything that waits.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import multiprocessing
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any

import msgspec

from shardlm.config import EngineConfig
from shardlm.engine.core_process import call_utility, check_utility, run_engine_core
from shardlm.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    Failed,
    FromEngineCore,
    Ready,
    Shutdown,
    StartupFailed,
    UtilityCall,
    UtilityResult,
)


class EngineDeadError(RuntimeError):
    """The engine core is gone; requests in flight cannot finish."""


class EngineCoreClient(ABC):
    num_blocks: int      # KV cache blocks of the engine core, known once it started

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> None: ...

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (sync clients)."""
        raise NotImplementedError(f"{type(self).__name__} is an asyncio client: use get_output_async().")

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs (asyncio clients)."""
        raise NotImplementedError(f"{type(self).__name__} is a sync client: use get_output().")

    def call_utility(self, method: str, *args) -> Any:
        """Run one of core_process.UTILITY_METHODS on the engine core; its result."""
        raise NotImplementedError(f"{type(self).__name__} is an asyncio client: use call_utility_async().")

    async def call_utility_async(self, method: str, *args) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is a sync client: use call_utility().")

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The engine core in this process: get_output() runs one step."""

    def __init__(self, config: EngineConfig):
        from shardlm.engine.engine_core import EngineCore
        self.engine_core = EngineCore(config)
        self.num_blocks = self.engine_core.num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.engine_core.abort_requests(list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args) -> Any:
        return call_utility(self.engine_core, method, args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class MPClient(EngineCoreClient):
    """Starts the engine core process and speaks to it; subclasses say how its messages reach
    the caller (_deliver, _fail)."""

    def __init__(self, config: EngineConfig):
        ctx = multiprocessing.get_context("spawn")
        req_recv, self._req_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FromEngineCore).decode
        # not daemonic: it starts the worker processes itself; atexit stops it if nobody else did
        self.process = ctx.Process(target=run_engine_core, name="shardlm-engine-core",
                                   args=(config, req_recv, out_send))
        self.process.start()
        req_recv.close()
        out_send.close()
        self._send_lock = threading.Lock()
        self._closing = False
        self.dead_reason: str | None = None
        self._call_ids = itertools.count()
        self.num_blocks = self._wait_ready()
        self._reader = threading.Thread(target=self._read_outputs, name="shardlm-core-outputs", daemon=True)
        self._reader.start()
        atexit.register(self.shutdown)

    def _wait_ready(self) -> int:
        ready = wait([self._out_recv, self.process.sentinel])
        if self._out_recv in ready:
            try:
                msg = self._decode(self._out_recv.recv_bytes())
            except EOFError:
                msg = None
            if isinstance(msg, Ready):
                return msg.num_blocks
            if isinstance(msg, StartupFailed):
                self.process.join(5)
                raise RuntimeError(f"The engine core failed to start: {msg.error}")
        self.process.join(5)
        raise EngineDeadError(f"The engine core process exited during start-up (exit code {self.process.exitcode}).")

    def _read_outputs(self) -> None:
        while True:
            ready = wait([self._out_recv, self.process.sentinel])
            if self._out_recv in ready:
                try:
                    msg = self._decode(self._out_recv.recv_bytes())
                except (EOFError, OSError):
                    msg = None
                if isinstance(msg, (EngineCoreOutputs, UtilityResult)):
                    self._deliver(msg)
                    continue
                if isinstance(msg, Failed):
                    self._die(f"The engine core stopped: {msg.error}")
                    return
            if not self._closing:
                self.process.join(1)
                self._die(f"The engine core process (pid {self.process.pid}) died (exit code {self.process.exitcode}).")
            return

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self._fail(EngineDeadError(reason))

    @abstractmethod
    def _deliver(self, msg: EngineCoreOutputs | UtilityResult) -> None:
        """Hand a message to the caller (called on the reader thread)."""

    @abstractmethod
    def _fail(self, error: EngineDeadError) -> None:
        """Fail everything that waits on the engine core (called on the reader thread)."""

    def _send(self, msg) -> None:
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        data = self._encode(msg)
        with self._send_lock:
            try:
                self._req_send.send_bytes(data)
            except (BrokenPipeError, OSError) as e:
                raise EngineDeadError(self.dead_reason or "The engine core process is gone.") from e

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        if request_ids and not self._closing:
            self._send(AbortRequests(request_ids))

    def _call(self, future, method: str, args: tuple):
        """Send a utility call; `future` (kept in self._pending) gets its result or the core's death."""
        check_utility(method)
        call_id = next(self._call_ids)
        self._pending[call_id] = future
        try:
            self._send(UtilityCall(call_id, method, list(args)))
        except EngineDeadError:
            self._pending.pop(call_id, None)
            raise
        return future

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        atexit.unregister(self.shutdown)
        self._closing = True
        if self.process.is_alive():
            try:
                self._send(Shutdown())
            except EngineDeadError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._req_send.close()
        self._reader.join(5)
        self._out_recv.close()


class SyncMPClient(MPClient):
    def __init__(self, config: EngineConfig):
        self._outputs: queue.Queue = queue.Queue()
        self._pending: dict[int, Future] = {}
        super().__init__(config)

    def _deliver(self, msg) -> None:
        if isinstance(msg, UtilityResult):
            future = self._pending.pop(msg.call_id, None)
            if future is not None:
                future.set_result(msg.value)
        else:
            self._outputs.put(msg)

    def _fail(self, error: EngineDeadError) -> None:
        self._outputs.put(error)
        for future in self._pending.values():
            future.set_exception(error)
        self._pending.clear()

    def get_output(self) -> EngineCoreOutputs:
        out = self._outputs.get()
        if isinstance(out, BaseException):
            self._outputs.put(out)     # every later call fails the same way
            raise out
        return out

    def call_utility(self, method: str, *args) -> Any:
        return self._call(Future(), method, args).result()


class AsyncMPClient(MPClient):
    """Outputs reach the caller's event loop through one asyncio queue (not one per request)."""

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop or asyncio.get_event_loop()
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._pending: dict[int, asyncio.Future] = {}
        super().__init__(config)

    def _deliver(self, msg) -> None:
        self.loop.call_soon_threadsafe(self._on_message, msg)

    def _fail(self, error: EngineDeadError) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._on_message, error)

    def _on_message(self, msg) -> None:
        if isinstance(msg, UtilityResult):
            future = self._pending.pop(msg.call_id, None)
            if future is not None and not future.done():
                future.set_result(msg.value)
            return
        if isinstance(msg, EngineDeadError):
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(msg)
            self._pending.clear()
        self._outputs.put_nowait(msg)

    async def get_output_async(self) -> EngineCoreOutputs:
        out = await self._outputs.get()
        if isinstance(out, BaseException):
            self._outputs.put_nowait(out)
            raise out
        return out

    async def call_utility_async(self, method: str, *args) -> Any:
        return await self._call(self.loop.create_future(), method, args)


def make_client(config: EngineConfig, multiprocess: bool, asyncio_mode: bool = False,
                loop: asyncio.AbstractEventLoop | None = None) -> EngineCoreClient:
    if asyncio_mode:
        return AsyncMPClient(config, loop)
    return SyncMPClient(config) if multiprocess else InprocClient(config)
