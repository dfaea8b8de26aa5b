"""The engine core in its own process: the loop that serves an EngineCoreClient (core_client.py).

Two pipes carry msgspec-encoded messages (shardlm/messages.py, never pickle): requests, aborts
and utility calls in; one EngineCoreOutputs per step out. The process owns the scheduler and
the executor; tokenizing and detokenizing stay with the front end, so its event loop never
waits on model work. It receives the EngineConfig already resolved by the front end.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection, wait

import msgspec

from shardlm import startup  # noqa: F401  (first of shardlm's: it counts the threads importing torch starts)
from shardlm.config import EngineConfig
from shardlm.executor.base import WorkerDiedError
from shardlm.logger import init_logger
from shardlm.messages import (
    AbortRequests,
    EngineCoreRequest,
    Failed,
    Ready,
    Shutdown,
    StartupFailed,
    StartWave,
    ToEngineCore,
    UtilityCall,
    UtilityResult,
    WaveStarted,
)
from shardlm.utils import die_with_parent, leave_stop_signals_to_the_parent, set_process_name

logger = init_logger(__name__)

# how run_engine_core ended: shut down (or its client went away), shut down for the engine to start
# again, a fault in a step or a rank, a start that failed
ENDED, RESTART, FAULT, NOT_STARTED = "ended", "restart", "fault", "not started"

# what a client may call on the engine core (UtilityCall.method)
UTILITY_METHODS = ("stats", "reset_prefix_cache", "collective_rpc", "sleep", "wake_up", "is_sleeping")


def run_engine_core(config: EngineConfig, requests: Connection, outputs: Connection,
                    node_address: str | None = None) -> str:
    """Entry point of the engine core process. node_address: this node's address when the data
    parallel groups cross nodes (gloo/NCCL of this process and its workers bind to it).
    -> how it ended: ENDED, RESTART, FAULT or NOT_STARTED."""
    from shardlm.core.engine_core import EngineCore

    if multiprocessing.parent_process() is not None:
        die_with_parent()         # its client died (even during start-up): so does it, and its workers
        set_process_name(f"shardlm-core-{config.parallel.data_parallel_rank}")
    leave_stop_signals_to_the_parent()
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(ToEngineCore).decode
    try:
        if node_address is not None:
            from shardlm.distributed.network import bind_collectives_to
            bind_collectives_to(node_address, "nccl" if config.device.type == "cuda" else "gloo")
        core = EngineCore(config)
    except BaseException as e:   # report why, then exit: the parent raises it
        outputs.send_bytes(encode(StartupFailed(f"{type(e).__name__}: {e}")))
        return NOT_STARTED
    worker_sentinels = core.executor.sentinels()
    try:
        outputs.send_bytes(encode(Ready(num_blocks=core.num_blocks)))   # (its client may be gone already)
        while True:
            if not core.is_busy():
                # idle: sleep until a request comes or a worker dies
                wait([requests, *worker_sentinels])
                core.executor.check_health()
            while requests.poll(0):
                msg = decode(requests.recv_bytes())
                if isinstance(msg, Shutdown):
                    return RESTART if msg.restart else ENDED
                if isinstance(msg, EngineCoreRequest):
                    if (wave := core.add_request(msg)) is not None:
                        outputs.send_bytes(encode(WaveStarted(wave)))
                elif isinstance(msg, StartWave):
                    core.join_wave(msg.number)
                elif isinstance(msg, AbortRequests):
                    core.abort_requests(msg.request_ids)
                elif isinstance(msg, UtilityCall):
                    outputs.send_bytes(encode(answer_utility(core, msg)))
            if core.is_busy():
                step_outputs = core.step()
                if step_outputs.outputs:
                    outputs.send_bytes(encode(step_outputs))
    except (EOFError, ConnectionError):   # the parent (or the head of a headless replica) is gone
        return ENDED
    except Exception as e:
        # the traceback is for a bug report; the failed step's requests were logged just before
        logger.error("The engine core stopped: %s: %s", type(e).__name__, e, exc_info=True)
        try:
            outputs.send_bytes(encode(Failed(f"{type(e).__name__}: {e}", sorted(core.scheduler.in_flight))))
        except (BrokenPipeError, OSError):
            pass
        return FAULT
    finally:
        core.shutdown()


def check_utility(method: str) -> None:
    if method not in UTILITY_METHODS:
        raise ValueError(f"The engine core has no utility {method!r} (it has {', '.join(UTILITY_METHODS)}).")


def answer_utility(core, call: UtilityCall) -> UtilityResult:
    """A utility call's result, or why it failed: a call that fails (an adapter that cannot be read)
    is that caller's error, not the engine's."""
    try:
        return UtilityResult(call.call_id, call_utility(core, call.method, call.args))
    except WorkerDiedError:
        raise                     # a rank is gone: the engine cannot go on
    except Exception as e:        # noqa: BLE001 - answered to the caller
        logger.warning("Utility call %s failed: %s: %s", call.method, type(e).__name__, e)
        return UtilityResult(call.call_id, None, error=f"{type(e).__name__}: {e}")


def call_utility(core, method: str, args) -> object:
    """Run one of UTILITY_METHODS on an EngineCore (in this process or the engine-core process)."""
    check_utility(method)
    return getattr(core, method)(*args)
