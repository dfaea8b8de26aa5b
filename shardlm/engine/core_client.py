"""How a front end (LLMEngine, AsyncLLM) talks to an engine core: one interface, as in vLLM v1.

    EngineCoreClient            the interface: add_request, abort_requests, get_output(_async),
                                call_utility(_async), shutdown; num_blocks once started
      InprocClient              the engine core in this process (LLM: no process hop)
      MPClient                  the engine core in its own process (CoreProcess), behind two
                                pipes; with data parallel, one per replica (engine/dp.py)
        SyncMPClient            get_output() blocks
        AsyncMPClient           get_output_async() awaits, on the caller's event loop

In the multiprocess clients a reader thread per engine core drains its output pipe at once (so
neither side ever blocks on a full pipe) and hands each message on: outputs to one queue,
utility results to the waiting caller, a core's death to everything that waits on it.
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
from shardlm.distributed.network import host_ip
from shardlm.distributed.parallel_state import host_store
from shardlm.engine.core_process import call_utility, check_utility, run_engine_core
from shardlm.engine.dp import LoadBalancer, combine_utility, replica_configs
from shardlm.engine.dp_remote import JoinListener, fingerprint
from shardlm.logger import init_logger
from shardlm.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Failed,
    FromEngineCore,
    Ready,
    Shutdown,
    StartupFailed,
    StartWave,
    UtilityCall,
    UtilityResult,
    WaveStarted,
)

logger = init_logger(__name__)


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


class CoreChannel:
    """One engine core as its client sees it: messages to it, messages from it, and its death.
    A reader thread hands each message to `on_message(index, msg)` and the death (a Failed
    message, the connection closing or the process exiting) to `on_death(index, reason)`."""

    def __init__(self, config: EngineConfig, index: int, send_conn, recv_conn, sentinels: list):
        self.index = index
        self.config = config
        self._send_conn, self._recv_conn, self._sentinels = send_conn, recv_conn, sentinels
        self._decode = msgspec.msgpack.Decoder(FromEngineCore).decode
        self._send_lock = threading.Lock()
        self.closing = False
        self.dead_reason: str | None = None
        self._reader: threading.Thread | None = None

    @property
    def name(self) -> str:
        par = self.config.parallel
        if par.data_parallel_size == 1:
            return "The engine core"
        first = par.rank_offset
        ranks = f"world rank {first}" if par.world_size == 1 else f"world ranks {first}-{first + par.world_size - 1}"
        return f"Data parallel replica {par.data_parallel_rank} ({ranks})"

    def _gone(self) -> str:
        """Why the channel ended without a Failed message."""
        raise NotImplementedError

    def wait_ready(self) -> int:
        """Its KV cache blocks once it started; raises why it did not."""
        ready = wait([self._recv_conn, *self._sentinels])
        if self._recv_conn in ready:
            try:
                msg = self._decode(self._recv_conn.recv_bytes())
            except (EOFError, OSError):
                msg = None
            if isinstance(msg, Ready):
                return msg.num_blocks
            if isinstance(msg, StartupFailed):
                raise RuntimeError(f"{self.name} failed to start: {msg.error}")
        raise EngineDeadError(f"{self.name} ended during start-up: {self._gone()}")

    def start_reader(self, on_message, on_death) -> None:
        self._reader = threading.Thread(target=self._read, args=(on_message, on_death),
                                        name=f"shardlm-core-outputs-{self.index}", daemon=True)
        self._reader.start()

    def _read(self, on_message, on_death) -> None:
        while True:
            ready = wait([self._recv_conn, *self._sentinels])
            if self._recv_conn in ready:
                try:
                    msg = self._decode(self._recv_conn.recv_bytes())
                except (EOFError, OSError):
                    msg = None
                if isinstance(msg, (EngineCoreOutputs, UtilityResult, WaveStarted)):
                    on_message(self.index, msg)
                    continue
                if isinstance(msg, Failed):
                    self.dead_reason = f"{self.name} stopped: {msg.error}"
                    on_death(self.index, self.dead_reason)
                    return
            if not self.closing:
                self.dead_reason = f"{self.name} {self._gone()}"
                on_death(self.index, self.dead_reason)
            return

    def send(self, data: bytes) -> None:
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        with self._send_lock:
            try:
                self._send_conn.send_bytes(data)
            except (BrokenPipeError, OSError) as e:
                raise EngineDeadError(self.dead_reason or f"{self.name} is gone.") from e

    def shutdown(self, shutdown_msg: bytes, timeout: float) -> None:
        self.closing = True
        try:
            self.send(shutdown_msg)
        except EngineDeadError:
            pass

    def _close(self) -> None:
        if self._reader is not None:
            self._reader.join(5)
        for conn in {id(c): c for c in (self._send_conn, self._recv_conn)}.values():
            conn.close()


class CoreProcess(CoreChannel):
    """An engine core in a process of this node, behind two pipes."""

    def __init__(self, config: EngineConfig, index: int, node_address: str | None = None):
        ctx = multiprocessing.get_context("spawn")
        req_recv, req_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        # not daemonic: it starts the worker processes itself; the client stops it
        self.process = ctx.Process(target=run_engine_core, name=f"shardlm-engine-core-{index}",
                                   args=(config, req_recv, out_send, node_address))
        self.process.start()
        req_recv.close()
        out_send.close()
        super().__init__(config, index, req_send, out_recv, [self.process.sentinel])

    def _gone(self) -> str:
        self.process.join(1)
        return f"process (pid {self.process.pid}) died (exit code {self.process.exitcode})."

    def shutdown(self, shutdown_msg: bytes, timeout: float) -> None:
        if self.process.is_alive():
            super().shutdown(shutdown_msg, timeout)
            self.process.join(timeout)
        self.closing = True
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._close()


class RemoteCore(CoreChannel):
    """An engine core on a headless node, behind the socket it joined through (dp_remote.py)."""

    def __init__(self, config: EngineConfig, index: int, conn):
        super().__init__(config, index, conn, conn, [])

    def _gone(self) -> str:
        return "closed its connection (its node or process is gone)."

    def shutdown(self, shutdown_msg: bytes, timeout: float) -> None:
        super().shutdown(shutdown_msg, timeout)
        # it exits after Shutdown; the reader sees the connection close
        if self._reader is not None:
            self._reader.join(timeout)
        self._close()


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

    def __init__(self, config: EngineConfig):
        self._encode = msgspec.msgpack.Encoder().encode
        self._closing = False
        self.dead_reason: str | None = None
        self._call_ids = itertools.count()
        self._gathers: dict[int, tuple[_Gather, int]] = {}     # call id -> (its gather, replica)
        self._state_lock = threading.Lock()
        par = config.parallel
        self._store, self._ray_replicas = None, None
        master, listener, node_address = None, None, None
        if par.data_parallel_size > 1:
            # every replica's ranks join one world through this store (the DP x PP x TP grid)
            # the Ray actors may be on other nodes: they reach this node by its address
            host = par.data_parallel_address or (host_ip() if par.data_parallel_backend == "ray" else "127.0.0.1")
            if par.data_parallel_size_local < par.data_parallel_size:
                listener = JoinListener(host, par.data_parallel_rpc_port or 0)   # before anything can join
                node_address = host        # our replicas' DP groups cross nodes: gloo/NCCL bind to it
            self._store = host_store(host, par.world_size_across_dp, par.distributed_init_timeout)
            master = (host, self._store.port)
        # all start before any is waited for: their ranks rendezvous together
        local = replica_configs(config, master) if par.data_parallel_size_local else []
        self.cores: list[CoreChannel] = [CoreProcess(c, k, node_address) for k, c in enumerate(local)]
        try:
            if par.data_parallel_backend == "ray" and par.data_parallel_size > 1:
                from shardlm.engine.dp_ray import RayReplicas
                self._ray_replicas = RayReplicas(config, listener.address)
            if listener is not None:
                self.cores += self._accept_remote(config, listener, master, local)
            self.num_blocks_per_engine = [core.wait_ready() for core in self.cores]
        except BaseException:
            self._stop_cores(timeout=5)
            raise
        finally:
            if listener is not None:
                listener.close()
        self.num_blocks = self.num_blocks_per_engine[0]
        self.balancer = LoadBalancer(len(self.cores), config.cache.block_size)
        for core in self.cores:
            core.start_reader(self._on_core_message, self._on_core_death)
        atexit.register(self.shutdown)

    @staticmethod
    def _accept_remote(config: EngineConfig, listener: JoinListener, master: tuple[str, int],
                       local: list[EngineConfig]) -> list[CoreChannel]:
        """The replicas of the other nodes, once each has joined (in replica order after ours)."""
        import dataclasses
        par = config.parallel
        ours = {c.parallel.data_parallel_rank for c in local}
        expected = [r for r in range(par.data_parallel_size) if r not in ours]
        joined = listener.accept_replicas(expected, fingerprint(config), master, par.distributed_init_timeout)
        return [RemoteCore(dataclasses.replace(config, parallel=dataclasses.replace(par, data_parallel_rank=r)),
                           len(local) + i, joined[r]) for i, r in enumerate(expected)]

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
            for core in self.cores:
                if core.index != index and core.dead_reason is None:
                    try:
                        core.send(self._encode(StartWave(msg.number)))
                    except EngineDeadError:
                        pass             # its death is reported by its reader
            return
        if isinstance(msg, EngineCoreOutputs):
            self.balancer.on_outputs(index, msg)
        self._deliver(msg)

    def _on_core_death(self, index: int, reason: str) -> None:
        live = [c.index for c in self.cores if c.dead_reason is None]
        if live and self.cores[index].config.dp_lockstep:
            # the replicas run their MoE layers together: the others cannot step without it
            self._die(f"{reason} Expert parallel replicas run every step together, so the engine cannot go on "
                      "without it.")
            for core in self.cores:
                if core.index != index and core.dead_reason is None:
                    core.closing = True
                    threading.Thread(target=core.shutdown, args=(self._encode(Shutdown()), 1.0), daemon=True).start()
            return
        if not live:
            self._die(reason if len(self.cores) == 1 else
                      "Every data parallel replica has died; the last: " + reason)
            return
        lost = self.balancer.mark_dead(index, reason)
        logger.warning("%s Its %d requests in flight fail; the server goes on with replica(s) %s.", reason,
                       len(lost), ", ".join(str(self.cores[k].config.parallel.data_parallel_rank) for k in live))
        with self._state_lock:
            broken_ids = [cid for cid, (_, k) in self._gathers.items() if k == index]
            broken = [self._gathers.pop(cid)[0] for cid in broken_ids]
        self._fail_calls(broken, EngineDeadError(reason))
        if lost:
            self._deliver(EngineCoreOutputs([EngineCoreOutput(rid, [], error=reason) for rid in lost]))

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self._fail(EngineDeadError(reason))

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

    def add_request(self, request: EngineCoreRequest) -> None:
        index = self.balancer.assign(request.request_id, request.prompt_token_ids)
        try:
            self._send(index, request)
        except EngineDeadError:
            self.balancer.forget([request.request_id])
            raise

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        if self._closing:
            return
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
        live = [c.index for c in self.cores if c.dead_reason is None]
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
        self._stop_cores(timeout)

    def _stop_cores(self, timeout: float) -> None:
        shutdown = self._encode(Shutdown())
        for core in self.cores:
            core.closing = True
        for core in self.cores:
            core.shutdown(shutdown, timeout)
        if self._ray_replicas is not None:
            self._ray_replicas.shutdown()
            self._ray_replicas = None
        self._store = None


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

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop or asyncio.get_event_loop()
        self._outputs: asyncio.Queue = asyncio.Queue()
        super().__init__(config)

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
