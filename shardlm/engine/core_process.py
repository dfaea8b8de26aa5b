"""The engine core in its own process, and the client that talks to it.

Between them: two pipes carrying msgspec-encoded typed messages (never pickle): requests,
aborts and utility calls in; one message per step with that step's token deltas out. The
process owns the scheduler and the executor; tokenizing and detokenizing stay with the caller,
so the caller's event loop never waits on model work.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import msgspec

from shardlm.config import EngineArgs
from shardlm.engine.messages import EngineCoreOutput
from shardlm.logger import init_logger
from shardlm.sampling_params import SamplingParams

logger = init_logger(__name__)


# ---- messages ----
class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True):
    call_id: int
    method: str             # "stats" or "reset_prefix_cache"


class Shutdown(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    num_blocks: int


class StartupFailed(msgspec.Struct, tag=True):
    error: str


class Failed(msgspec.Struct, tag=True):
    """The engine core stopped on an error (a worker died, ...); it exits after sending this."""
    error: str


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[EngineCoreOutput]


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    result: dict


Inbound = AddRequest | AbortRequests | UtilityCall | Shutdown
Outbound = Ready | StartupFailed | Failed | StepOutputs | UtilityResult
_UTILITIES = {"stats": lambda core: core.stats(),
              "reset_prefix_cache": lambda core: {"reset": core.reset_prefix_cache()}}


class EngineDeadError(RuntimeError):
    """The engine core process is gone; requests in flight cannot finish."""


# ---- the process ----
def run_engine_core(engine_args: dict, requests: Connection, outputs: Connection) -> None:
    """Entry point of the engine core process."""
    from shardlm.engine.engine_core import EngineCore

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group; the parent decides
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(Inbound).decode
    try:
        core = EngineCore(EngineArgs(**engine_args).create_engine_config())
    except BaseException as e:   # report why, then exit: the parent raises it
        outputs.send_bytes(encode(StartupFailed(f"{type(e).__name__}: {e}")))
        return
    outputs.send_bytes(encode(Ready(core.config.cache.num_blocks)))
    worker_sentinels = core.executor.sentinels()
    try:
        while True:
            if not core.has_unfinished_requests():
                # idle: sleep until a request comes or a worker dies
                wait([requests, *worker_sentinels])
                core.executor.check_health()
            while requests.poll(0):
                msg = decode(requests.recv_bytes())
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, AddRequest):
                    core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.arrival_time)
                elif isinstance(msg, AbortRequests):
                    core.abort_requests(msg.request_ids)
                elif isinstance(msg, UtilityCall):
                    outputs.send_bytes(encode(UtilityResult(msg.call_id, _UTILITIES[msg.method](core))))
            if core.has_unfinished_requests():
                step_outputs = core.step()
                if step_outputs:
                    outputs.send_bytes(encode(StepOutputs(step_outputs)))
    except (EOFError, BrokenPipeError):   # the parent is gone
        return
    except Exception as e:
        logger.error("The engine core stopped: %s: %s", type(e).__name__, e)
        try:
            outputs.send_bytes(encode(Failed(f"{type(e).__name__}: {e}")))
        except (BrokenPipeError, OSError):
            pass
    finally:
        core.shutdown()


# ---- the client ----
class EngineCoreClient:
    """Starts the engine core process and speaks to it. Has EngineCore's request methods, so
    LLMEngine can drive either. Outputs arrive on a reader thread and go to `on_outputs`;
    if the process dies, `on_dead` is called with the reason."""

    def __init__(self, engine_args: EngineArgs, on_outputs: Callable[[list[EngineCoreOutput]], None],
                 on_utility: Callable[[int, dict], None], on_dead: Callable[[str], None]):
        ctx = multiprocessing.get_context("spawn")
        req_recv, self._req_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(Outbound).decode
        # not daemonic: it starts the worker processes itself; atexit stops it if nobody else did
        self.process = ctx.Process(target=run_engine_core, name="shardlm-engine-core",
                                   args=(dataclasses.asdict(engine_args), req_recv, out_send))
        self.process.start()
        req_recv.close()
        out_send.close()
        self._send_lock = threading.Lock()
        self._closing = False
        self.num_blocks = self._wait_ready()
        self._on_outputs, self._on_utility, self._on_dead = on_outputs, on_utility, on_dead
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
                if isinstance(msg, StepOutputs):
                    self._on_outputs(msg.outputs)
                    continue
                if isinstance(msg, UtilityResult):
                    self._on_utility(msg.call_id, msg.result)
                    continue
                if isinstance(msg, Failed):
                    self._on_dead(f"The engine core stopped: {msg.error}")
                    return
            if not self._closing:
                self.process.join(1)
                self._on_dead(f"The engine core process (pid {self.process.pid}) died "
                              f"(exit code {self.process.exitcode}).")
            return

    def _send(self, msg) -> None:
        data = self._encode(msg)
        with self._send_lock:
            try:
                self._req_send.send_bytes(data)
            except (BrokenPipeError, OSError) as e:
                raise EngineDeadError("The engine core process is gone.") from e

    # the EngineCore methods LLMEngine uses
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float) -> None:
        self._send(AddRequest(request_id, prompt_token_ids, params, arrival_time))

    def abort_requests(self, request_ids) -> None:
        if request_ids:
            self._send(AbortRequests(list(request_ids)))

    def call_utility(self, call_id: int, method: str) -> None:
        self._send(UtilityCall(call_id, method))

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
