"""How a front end (LLMEngine, AsyncLLM) talks to an engine core: one interface, as in vLLM v1.

    EngineCoreClient            the interface: add_request, abort_requests, get_output(_async),
                                call_utility(_async), shutdown; num_blocks once started
      InprocClient              the engine core in this process (LLM: no process hop)
      MPClient                  the engine core in its own process (CoreProcess), behind two
                                pipes; with data parallel, one per replica (engine/dp.py)
        SyncMPClient            get_output() blocks
        AsyncMPClient           get_output_async() awaits, on the caller's event loop

The multiprocess clients start their cores through launcher.py and reach each through its
channel (core_channel.py), whose reader thread drains its output pipe at once (so neither side
ever blocks on a full pipe) and hands each message on: outputs to one queue, utility results to
the waiting caller, a core's death to everything that waits on it. With data parallel, the
routing of requests to replicas is the LoadBalancer's (dp.py).

With a RestartPolicy (the server's), a dead core is started again (restarts.py): a data parallel
replica on its own while the others serve, else the whole engine. Requests that had an answer
from the dead core fail (their callers retry); those that had none are sent again, to a live
replica or to the new engine once it is ready, so a queued request never sees the fault.
Adapters loaded at run time are loaded again first.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import msgspec

from shardlm.config import EngineConfig
from shardlm.engine.core_process import call_utility, check_utility
from shardlm.engine.dp import LoadBalancer, combine_utility
from shardlm.engine.dp_front_ends import front_ends_of
from shardlm.engine.errors import EngineDeadError, RequestFailedError  # noqa: F401 - the callers' errors
from shardlm.engine.launcher import LaunchedCores
from shardlm.engine.restarts import Restarter, RestartPolicy
from shardlm.logger import init_logger
from shardlm.lora.request import LoRARequest
from shardlm.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    UtilityCall,
    UtilityResult,
    WaveStarted,
)

logger = init_logger(__name__)


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
        from shardlm.core.engine_core import EngineCore
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


class _Gather:
    """A utility call sent to several engine cores: the caller's future gets the combined answer."""

    def __init__(self, future, method: str, engines: list[int]):
        self.future, self.method = future, method
        self.waiting = set(engines)
        self.results: dict[int, Any] = {}


class MPClient(EngineCoreClient):
    """Starts the engine core process (or one per data parallel replica: engine/dp.py) and
    speaks to them; subclasses say how their messages reach the caller (_deliver, _fail).
    With replicas, each request goes to the one the LoadBalancer picks, aborts follow it, and
    utility calls go to every live replica (their answers combined)."""

    def __init__(self, config: EngineConfig, restarts: RestartPolicy | None = None):
        """restarts: start dead cores again, as it says (None: a dead engine stays dead)."""
        self.config = config
        self._encode = msgspec.msgpack.Encoder().encode
        self._closing = False
        self.dead_reason: str | None = None
        self._call_ids = itertools.count()
        self._gathers: dict[int, tuple[_Gather, int]] = {}     # call id -> (its gather, replica)
        self._state_lock = threading.Lock()
        self.front_ends = front_ends_of(config)     # other servers' replicas step with ours
        try:
            self.launched = LaunchedCores(config, self.front_ends)
        except BaseException:
            if self.front_ends is not None:
                self.front_ends.close()
            raise
        self.cores = self.launched.cores
        self.num_blocks_per_engine = self.launched.num_blocks
        self.num_blocks = self.num_blocks_per_engine[0]
        self.balancer = LoadBalancer(len(self.cores), config.kv_block_tokens)
        self.restarter = Restarter(self, restarts) if restarts is not None else None
        self.restarting: str | None = None       # the whole engine is starting again, after this
        self._unanswered: dict[str, EngineCoreRequest] = {}   # sent, nothing back yet: sent again if its core dies
        self._requeued: dict[str, EngineCoreRequest] = {}     # waiting for a core to come back
        self.adapters: dict[int, LoRARequest] = {}            # loaded at run time: loaded again on a new core
        for core in self.cores:
            core.start_reader(self._on_core_message, self._on_core_death)
        if self.front_ends is not None:       # (a world lost while starting fails the launch itself)
            self.front_ends.on_lost = self._on_world_lost
        atexit.register(self.shutdown)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def process(self):
        """The engine core process (the first replica's with data parallel)."""
        return self.cores[0].process

    @property
    def num_running(self) -> int:
        return self.balancer.num_running

    # ---- from the engine cores (reader threads) ----
    def _on_core_message(self, index: int, msg: EngineCoreOutputs | UtilityResult | WaveStarted) -> None:
        if isinstance(msg, WaveStarted):        # DP + EP lock-step: every replica joins (core/wave.py)
            self.launched.start_wave(msg.number, but=index)
            if self.front_ends is not None:      # and the other servers' replicas
                self.front_ends.send_wave(msg.number)
            return
        if isinstance(msg, EngineCoreOutputs):
            self.balancer.on_outputs(index, msg)
            if self._unanswered:
                for out in msg.outputs:
                    self._unanswered.pop(out.req_id, None)
        self._deliver(msg)

    def _on_core_death(self, index: int, reason: str) -> None:
        if self._closing:
            return
        if self.restarter is not None:
            self.restarter.on_death(index, reason)
            return
        live = [c.index for c in self.cores if c.dead_reason is None]
        if live and self.cores[index].config.dp_lockstep:
            # the replicas run their MoE layers together: the others cannot step without it
            return self._end_lockstep(f"{reason} Expert parallel replicas run every step together, so the engine "
                                      "cannot go on without it.")
        if not live:
            self.die(reason if len(self.cores) == 1 else
                      "Every data parallel replica has died; the last: " + reason)
            return
        lost = self.balancer.mark_dead(index, reason)
        logger.warning("%s Its %d requests in flight fail; the server goes on with replica(s) %s.", reason,
                       len(lost), ", ".join(str(self.cores[k].config.parallel.data_parallel_rank) for k in live))
        self._fail_calls(self._take_gathers([index]), EngineDeadError(reason))
        if lost:
            self._deliver(EngineCoreOutputs([EngineCoreOutput(rid, [], error=reason) for rid in lost]))

    def _on_world_lost(self, reason: str) -> None:
        """Another server of our lock-step replicas' world is gone (dp_front_ends.py)."""
        if self._closing:
            return
        if self.restarter is not None:
            self.restarter.on_death(0, reason)
        else:
            self._end_lockstep(reason)

    def _end_lockstep(self, reason: str) -> None:
        """Lock-step replicas cannot step without one of theirs: dead, the live ones shut down."""
        self.die(reason)
        for core in self.cores:
            if core.dead_reason is None:
                core.closing = True
                threading.Thread(target=core.shutdown, args=(self._encode(Shutdown()), 1.0), daemon=True).start()

    def die(self, reason: str) -> None:
        """Dead for good: every waiting caller gets EngineDeadError(reason)."""
        self.restarting = None
        self._requeued.clear()
        self.dead_reason = reason
        self._fail(EngineDeadError(reason))

    # ---- restarts: when, the Restarter (restarts.py); what becomes of the requests and cores, here ----
    def hand_back_all(self, reason: str) -> None:
        """The engine stopped as a whole: every core is done; its requests handed back."""
        for core in self.cores:
            core.closing = True   # the others stop as well: no more deaths to report
        self._fail_calls(self._take_gathers(range(len(self.cores))), EngineDeadError(reason))
        self._hand_back(self.balancer.forget(list(self.balancer.owner)), reason)

    def hand_back_replica(self, index: int, reason: str) -> None:
        """Replica `index` died: out of routing, its requests handed back."""
        lost = self.balancer.mark_dead(index, reason)
        self._fail_calls(self._take_gathers([index]), EngineDeadError(reason))
        self._hand_back({index: lost}, reason)

    def adopt(self, launched: LaunchedCores, reason: str) -> None:
        """The engine's new cores, ready: they take the waiting requests."""
        # a request sent to a lock-step replica as the engine began to restart (it still took
        # messages then) was not handed back with the others
        self._hand_back(self.balancer.forget(list(self.balancer.owner)), reason)
        self.launched, self.cores = launched, launched.cores
        self._serve_again(range(len(self.cores)))
        self.restarting = None
        self._send_requeued()

    def adopt_replica(self, index: int) -> None:
        """Replica `index`, started again and ready (already in self.cores), takes requests."""
        self._serve_again([index])
        self._send_requeued()

    def _serve_again(self, indices) -> None:
        for k in indices:
            self.cores[k].start_reader(self._on_core_message, self._on_core_death)
            self._reload_adapters(k)
        self.balancer.revive(indices)

    def _take_gathers(self, indices) -> list[_Gather]:
        """The utility calls waiting on these cores, no longer waited for."""
        indices = set(indices)
        with self._state_lock:
            ids = [cid for cid, (_, k) in self._gathers.items() if k in indices]
            return list({id(g): g for g in (self._gathers.pop(cid)[0] for cid in ids)}.values())

    def _hand_back(self, lost: dict[int, list[str]], reason: str) -> None:
        """Requests of dead cores: those with an answer fail (their callers retry), and so do those
        in a step that failed (one may be what made it fail: sent again, it could fail the next
        engine too); the others go to a live replica, or wait for a core to come back."""
        begun = f"{reason} The request had begun there and cannot go on: retry it."
        suspect = f"{reason} The request was in the step that failed, so it is not sent again (it may be the cause)."
        failed = []
        for index, ids in lost.items():
            suspects = self.cores[index].in_failed_steps
            for rid in ids:
                request = self._unanswered.pop(rid, None)
                if request is None or rid in suspects:
                    failed.append(EngineCoreOutput(rid, [], error=begun if request is None else suspect))
                else:
                    self._requeued[rid] = request
        if failed:
            self._deliver(EngineCoreOutputs(failed))
        if self.unavailable is None:
            self._send_requeued()

    def _send_requeued(self) -> None:
        while self._requeued and self.unavailable is None:
            rid = next(iter(self._requeued))          # in the order they came
            request = self._requeued.pop(rid)
            try:
                self.add_request(request)
            except EngineDeadError:
                self._requeued[rid] = request      # its new core died too: it waits for the next
                return

    def _reload_adapters(self, index: int) -> None:
        """The adapters loaded at run time, ahead of any request (the pipe keeps the order; no
        one waits for the answer, call id -1)."""
        for lora in list(self.adapters.values()):
            self.cores[index].send(self._encode(UtilityCall(-1, "collective_rpc", ["add_lora", [lora]])))

    @abstractmethod
    def _deliver(self, msg: EngineCoreOutputs | UtilityResult) -> None:
        """Hand a message to the caller (called on a reader thread)."""

    @abstractmethod
    def _fail(self, error: EngineDeadError) -> None:
        """Fail everything that waits on the engine core (called on a reader thread)."""

    def _fail_calls(self, gathers: list[_Gather], error: EngineDeadError) -> None:
        """Fail these utility calls (on the caller's side: see the subclasses)."""

    # ---- to the engine cores ----
    def _send(self, index: int, msg) -> None:
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        self.cores[index].send(self._encode(msg))

    @property
    def unavailable(self) -> str | None:
        """Why no core can take a request now (the engine or every replica is starting again)."""
        if self.dead_reason or self.restarting:
            return self.dead_reason or f"The engine is restarting after a fault ({self.restarting})."
        if len(self.balancer.dead) == len(self.cores):
            return "Every data parallel replica is restarting after a fault."
        return None

    def add_request(self, request: EngineCoreRequest) -> None:
        if (why := self.unavailable) is not None:
            raise EngineDeadError(why + (" Retry shortly." if self.dead_reason is None else ""))
        index = self.balancer.assign(request.request_id, request.prompt_token_ids)
        if self.restarter is not None:
            self._unanswered[request.request_id] = request
        try:
            self._send(index, request)
        except EngineDeadError:
            self.balancer.forget([request.request_id])
            self._unanswered.pop(request.request_id, None)
            raise

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        if self._closing:
            return
        request_ids = list(request_ids)
        for rid in request_ids:
            self._unanswered.pop(rid, None)
            self._requeued.pop(rid, None)
        for index, ids in self.balancer.forget(request_ids).items():
            if self.cores[index].dead_reason is None:
                self._send(index, AbortRequests(ids))

    def _resolve(self, msg: UtilityResult) -> None:
        """A replica's answer to a utility call; the caller's future gets the combined answer
        once every replica asked has answered (called where the future may be completed)."""
        with self._state_lock:
            gather, index = self._gathers.pop(msg.call_id, (None, None))
            if gather is None:
                return
            if msg.error is not None:        # the call failed there; the engine goes on
                if not gather.future.done():
                    gather.future.set_exception(RuntimeError(msg.error))
                return
            gather.results[index] = msg.value
            gather.waiting.discard(index)
            if gather.waiting:
                return
        value = combine_utility(gather.method, gather.results)
        if gather.method == "stats":       # what the balancer sent where
            for e in value["engines"]:
                e["num_routed"] = self.balancer.assigned_total[e["engine"]]
            value["num_routed"] = sum(self.balancer.assigned_total)
        if not gather.future.done():
            gather.future.set_result(value)

    def _call(self, future, method: str, args: tuple):
        """Send a utility call to every live engine core; `future` gets the combined answer or
        the error that stopped it."""
        check_utility(method)
        if (why := self.unavailable) is not None:
            raise EngineDeadError(why)
        live = [c.index for c in self.cores if c.dead_reason is None and c.index not in self.balancer.dead]
        gather = _Gather(future, method, live)
        sent = []
        with self._state_lock:
            for index in live:
                call_id = next(self._call_ids)
                self._gathers[call_id] = (gather, index)
                sent.append((call_id, index))
        try:
            for call_id, index in sent:
                self._send(index, UtilityCall(call_id, method, list(args)))
        except EngineDeadError:
            with self._state_lock:
                for call_id, _ in sent:
                    self._gathers.pop(call_id, None)
            raise
        return future

    def _pending_futures(self) -> list:
        with self._state_lock:
            futures = {id(g): g.future for g, _ in self._gathers.values()}
            self._gathers.clear()
        return list(futures.values())

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        atexit.unregister(self.shutdown)
        self._closing = True
        if self.front_ends is not None:
            self.front_ends.close()
        self._stop_cores(timeout)

    def _stop_cores(self, timeout: float) -> None:
        self.launched.stop(self._encode(Shutdown()), timeout)


class SyncMPClient(MPClient):
    def __init__(self, config: EngineConfig):
        self._outputs: queue.Queue = queue.Queue()
        super().__init__(config)

    def _deliver(self, msg) -> None:
        if isinstance(msg, UtilityResult):
            self._resolve(msg)
        else:
            self._outputs.put(msg)

    def _fail(self, error: EngineDeadError) -> None:
        self._outputs.put(error)
        _fail_futures(self._pending_futures(), error)

    def _fail_calls(self, gathers: list[_Gather], error: EngineDeadError) -> None:
        _fail_futures([g.future for g in gathers], error)

    def get_output(self) -> EngineCoreOutputs:
        out = self._outputs.get()
        if isinstance(out, BaseException):
            self._outputs.put(out)     # every later call fails the same way
            raise out
        return out

    def call_utility(self, method: str, *args) -> Any:
        return self._call(Future(), method, args).result()


class AsyncMPClient(MPClient):
    """Outputs reach the caller's event loop through one asyncio queue (not one per request);
    futures are completed on that loop."""

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop | None = None,
                 restarts: RestartPolicy | None = None):
        self.loop = loop or asyncio.get_event_loop()
        self._outputs: asyncio.Queue = asyncio.Queue()
        super().__init__(config, restarts)

    def _deliver(self, msg) -> None:
        self.loop.call_soon_threadsafe(self._on_message, msg)

    def _fail(self, error: EngineDeadError) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._on_message, error)

    def _fail_calls(self, gathers: list[_Gather], error: EngineDeadError) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(_fail_futures, [g.future for g in gathers], error)

    def _on_message(self, msg) -> None:
        if isinstance(msg, UtilityResult):
            self._resolve(msg)
            return
        if isinstance(msg, EngineDeadError):
            _fail_futures(self._pending_futures(), msg)
        self._outputs.put_nowait(msg)

    async def get_output_async(self) -> EngineCoreOutputs:
        out = await self._outputs.get()
        if isinstance(out, BaseException):
            self._outputs.put_nowait(out)
            raise out
        return out

    async def call_utility_async(self, method: str, *args) -> Any:
        return await self._call(self.loop.create_future(), method, args)


def _fail_futures(futures, error: BaseException) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(error)


def make_client(config: EngineConfig, multiprocess: bool, asyncio_mode: bool = False,
                loop: asyncio.AbstractEventLoop | None = None) -> EngineCoreClient:
    if asyncio_mode:
        return AsyncMPClient(config, loop)
    return SyncMPClient(config) if multiprocess else InprocClient(config)
