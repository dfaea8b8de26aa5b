"""The executor for ranks on several nodes: one Ray actor per rank, in one placement group.

Each actor runs the same Worker as the mp executor. Steps travel as msgspec bytes in Ray actor
calls (an actor runs the calls of one caller in order, so pipeline batches stay ordered); the
tensors between ranks go over torch.distributed (gloo / NCCL), bound to each node's address.

Failure path: every actor also runs `watch`, a call that never returns, in its own
concurrency group. Its result resolves only when the actor dies, so waiting on it beside each
step's results turns a dead rank, wherever it ran, into WorkerDiedError at once, naming the
rank and node; a watcher thread does the same while the engine is idle. On shutdown the
actors are killed and the placement group removed: nothing of ours stays in `ray status`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket
import threading
import time

import msgspec

from shardlm.config import EngineConfig
from shardlm.distributed.network import bind_collectives_to, cannot_reach, host_ip
from shardlm.distributed.parallel_state import host_store, missing_ranks
from shardlm.executor.base import Executor, WorkerDiedError
from shardlm.executor.ray_placement import (
    NodeInfo,
    check_placement,
    create_placement_group,
    cuda_devices,
    forwarded_env,
    local_ranks,
    node_versions,
    rank_order,
)
from shardlm.executor.selection import init_ray, require_ray
from shardlm.logger import init_logger, set_log_prefix
from shardlm.messages import ModelRunnerOutput, SchedulerOutput
from shardlm.model_loader.hub import model_on_this_node

ray = require_ray()

logger = init_logger(__name__)

_INLINE_BYTES = 64 << 10     # larger step payloads go through Ray's object store once, not once per rank


@ray.remote(concurrency_groups={"monitor": 1}, max_restarts=0)
class RayWorker:
    """One rank, in a Ray actor: a thin shell around Worker."""

    def __init__(self):
        self.worker = None
        self.output_encoder = msgspec.msgpack.Encoder()
        self.step_decoder = msgspec.msgpack.Decoder(SchedulerOutput)

    def node_info(self, model_path: str, hub_source=None) -> NodeInfo:
        """This node's facts; a hub model missing here is fetched into this node's cache first."""
        try:
            self.model_path = model_on_this_node(model_path, hub_source)
        except ValueError as e:
            logger.error("%s", e)
            self.model_path = None
        return NodeInfo(ray.get_runtime_context().get_node_id(), host_ip(ray), socket.gethostname(), os.getpid(),
                        node_versions(), self.model_path is not None, [str(g) for g in ray.get_gpu_ids()])

    def start(self, config: EngineConfig, rank: int, local_rank: int, local_world_size: int,
              rendezvous: tuple[str, int], ip: str, visible_gpus: str | None = None) -> None:
        from shardlm.worker.worker import Worker

        if visible_gpus is not None:        # before CUDA starts in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus
        set_log_prefix(f"({config.parallel.describe_rank(rank)}) ")
        # the driver's store listens before any rank starts: a refusal or a missing route is the
        # classic wrong address, named now instead of after --distributed-init-timeout
        why = cannot_reach(*rendezvous)
        if why is not None:
            raise RuntimeError(f"this node ({ip}) cannot reach the rendezvous at {rendezvous[0]}:{rendezvous[1]} "
                               f"({why}). Set SHARDLM_HOST_IP on the driver's node to an address every node "
                               "reaches; `shardlm env check --address HEAD:PORT` tests it.")
        backend = "nccl" if config.device.type == "cuda" else "gloo"
        chosen = bind_collectives_to(ip, backend)
        if chosen:
            logger.info("Collectives bound to %s", ", ".join(f"{k}={v}" for k, v in chosen.items()))
        self.answers_steps = rank == config.parallel.output_rank
        if getattr(self, "model_path", None) not in (None, config.model.model):     # fetched on this node
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, model=self.model_path))
        self.worker = Worker(config, rank, rendezvous, local_rank, local_world_size)
        self.worker.init_device()
        self.worker.load_model()

    def execute(self, payload: bytes) -> bytes | None:
        output = self.worker.execute_model(self.step_decoder.decode(payload))
        return self.output_encoder.encode(output) if self.answers_steps else None

    def call(self, method: str, args: tuple):
        return getattr(self.worker, method)(*args)

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    @ray.method(concurrency_group="monitor")
    def watch(self) -> None:
        """Never returns: its result resolves (as an error) only when this actor dies."""
        threading.Event().wait()


class RayExecutor(Executor):
    runs_async = True

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        par = config.parallel
        self.world_size, self.output_rank = par.world_size, par.output_rank
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode_output = msgspec.msgpack.Decoder(ModelRunnerOutput).decode
        self.actors, self.infos, self._watch_refs, self.pg = [], [], [], None
        self._death_recv, self._death_send = multiprocessing.Pipe(duplex=False)
        t0 = time.perf_counter()
        # a -dp replica: the cluster its client placed it in; else RAY_ADDRESS or a cluster started
        # on this node (`shardlm cluster head`, `ray start`); else Ray starts a local one
        shared = par.ray_bundles
        self._owns_ray_connection = init_ray(address=shared.address if shared else os.environ.get("RAY_ADDRESS"),
                                             namespace=shared.namespace if shared else None, logging_level="warning")
        t_connect = time.perf_counter() - t0
        self._shutdown_at_exit()
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise
        logger.info("Ray executor: %d actors on %d node(s) ready in %.1f s (Ray connect %.1f s); ranks: %s",
                    self.world_size, len({i.node_id for i in self.infos}), time.perf_counter() - t0, t_connect,
                    "; ".join(f"{r}: {i.ip} pid {i.pid}" for r, i in enumerate(self.infos)))

    def _start(self, config: EngineConfig) -> None:
        par = config.parallel
        env = forwarded_env()
        if env:
            logger.info("Forwarding to the workers on every node: %s", ", ".join(sorted(env)))
        shared = par.ray_bundles            # -dp: the client placed every replica's ranks (engine/dp_ray.py)
        if shared is None:
            self.pg = create_placement_group(ray, self.world_size, config.device.type, par.distributed_init_timeout)
            pg, bundles = self.pg, range(self.world_size)
        else:
            pg, bundles = ray.util.get_placement_group(shared.group), shared.bundles
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        on_gpu = config.device.type == "cuda"
        actors = [RayWorker.options(
            num_cpus=1, num_gpus=1 if on_gpu else 0, runtime_env={"env_vars": env} if env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
        ).remote() for b in bundles]
        self.actors = actors            # killed on shutdown even if start-up stops here
        infos = ray.get([a.node_info.remote(config.model.model, config.model.hub_source) for a in actors],
                        timeout=par.distributed_init_timeout)
        order = (rank_order(infos, ray.get_runtime_context().get_node_id()) if shared is None
                 else range(self.world_size))        # the client ordered them
        self.actors, self.infos = [actors[i] for i in order], [infos[i] for i in order]
        self._watch_refs = [a.watch.remote() for a in self.actors]
        self._start_watcher(self._watch_workers, "shardlm-ray-watch")
        check_placement(self.infos, par.tensor_parallel_size, par.pipeline_parallel_size, config.model.model,
                        node_versions(), par.allow_cross_node_tp)
        store = None
        if par.data_parallel_master is not None:        # the replicas' world: the DP client's store
            rendezvous = par.data_parallel_master
        else:
            driver_ip = host_ip(ray)
            store = host_store(driver_ip, self.world_size, par.distributed_init_timeout)
            rendezvous = (driver_ip, store.port)
        local, local_sizes = (local_ranks([i.hostname for i in self.infos]) if shared is None
                              else (shared.local_ranks, shared.local_sizes))
        visible = [None] * self.world_size
        if on_gpu:          # the local rank picks the device: its own GPU among its node's
            visible, local = zip(*cuda_devices(self.infos))
        starts = [a.start.remote(config, r, local[r], local_sizes[r], rendezvous, self.infos[r].ip,
                                 visible[r]) for r, a in enumerate(self.actors)]
        deadline = time.monotonic() + par.distributed_init_timeout
        try:
            self._gather(starts, deadline=deadline)
        except TimeoutError:
            timeout = par.distributed_init_timeout
            if store is None:       # the DP client holds the store: which of ours did not finish starting
                late = [r for r, ref in enumerate(starts) if not ray.wait([ref], timeout=0)[0]]
                raise TimeoutError(
                    f"Distributed init timed out after {timeout:.0f} s: rank(s) "
                    + ", ".join(f"{r} on {self.infos[r].describe()}" for r in late)
                    + f" did not finish starting. Every replica's ranks meet at {rendezvous[0]}:{rendezvous[1]} (a "
                    "replica that failed says why in its own error) and then load the model; raise "
                    "--distributed-init-timeout if it is only slow.") from None
            missing = missing_ranks(store, self.world_size)
            if not missing:
                raise TimeoutError(f"Every rank joined, but loading the model did not finish within {timeout:.0f} s: "
                                   "raise --distributed-init-timeout.") from None
            raise TimeoutError(
                f"Distributed init timed out after {timeout:.0f} s: rank(s) "
                + ", ".join(f"{r} on {self.infos[r].describe()}" for r in missing)
                + f" did not join the rendezvous at {rendezvous[0]}:{rendezvous[1]}. Check that those nodes reach that "
                "address (`shardlm env check --address HEAD:PORT`), or raise --distributed-init-timeout.") from None
        self._store = store

    # ---- failure detection ----
    def _describe_rank(self, rank: int) -> str:
        info = self.infos[rank]
        return f"Worker rank {rank} on {info.describe()}, pid {info.pid}"

    def _record_death(self, rank: int, error: BaseException) -> str:
        if self._failure is not None:
            return self._failure
        cause = getattr(error, "cause", None)          # RayTaskError: the worker's own exception
        if isinstance(cause, BaseException):
            what = f"failed: {type(cause).__name__}: {_first_line(cause)}"
        else:
            what = f"died ({type(error).__name__}: {_first_line(error)})"
        return self.record_failure(f"{self._describe_rank(rank)} {what}. The engine cannot continue; the other "
                                   "workers are being stopped.")

    def _on_failure(self) -> None:
        self._death_send.send_bytes(b"x")      # wakes an idle engine core (our sentinel)
        self._kill_actors()

    def _watch_workers(self) -> None:
        while not self._stopping and self._failure is None:
            try:
                ready, _ = ray.wait(self._watch_refs, num_returns=1, timeout=1.0)
            except Exception:              # noqa: BLE001  (Ray shut down under us)
                return
            if ready and not self._stopping:
                rank = self._watch_refs.index(ready[0])
                try:
                    ray.get(ready[0])
                except Exception as e:     # noqa: BLE001  (the actor's death, as Ray reports it)
                    self._record_death(rank, e)

    def sentinels(self) -> list:
        return [self._death_recv]

    # ---- talking to the workers ----
    def _gather(self, refs: list, deadline: float | None = None) -> list:
        """Every rank's result of one call, in rank order; WorkerDiedError as soon as any rank fails
        or dies (a rank stuck waiting on a dead peer never answers)."""
        self.check_health()
        results, pending = [None] * len(refs), {ref: rank for rank, ref in enumerate(refs)}
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait([*pending, *self._watch_refs], num_returns=1, timeout=timeout)
            if not ready:
                raise TimeoutError
            ref = ready[0]
            rank = pending.pop(ref, None)
            try:
                value = ray.get(ref)
            except Exception as e:         # noqa: BLE001  (a failed call or a dead actor)
                raise WorkerDiedError(self._record_death(self._watch_refs.index(ref) if rank is None else rank, e)) \
                    from None
            if rank is not None:
                results[rank] = value
        return results

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return self._gather([a.call.remote(method, args) for a in self.actors])

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output)()

    def execute_model_async(self, scheduler_output: SchedulerOutput):
        self.check_health()
        payload = self._encode(scheduler_output)
        if len(payload) > _INLINE_BYTES:
            payload = ray.put(payload)
        refs = [a.execute.remote(payload) for a in self.actors]
        timeout = self._step_timeout()
        return lambda: self._decode_output(self._wait_step(refs, timeout)[self.output_rank])

    def _wait_step(self, refs: list, timeout: float | None) -> list:
        try:
            return self._gather(refs, None if timeout is None else time.monotonic() + timeout)
        except TimeoutError:
            late = [r for r, ref in enumerate(refs) if not ray.wait([ref], timeout=0)[0]]
            raise WorkerDiedError(self.record_failure(
                f"A step did not finish within {timeout:.0f} s (--execute-model-timeout): "
                + "; ".join(self._describe_rank(r) for r in late) + " did not answer. The engine cannot continue; "
                "the workers are being stopped.")) from None

    # ---- shutdown ----
    def _kill_actors(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    def _shutdown(self) -> None:
        if not ray.is_initialized():
            return
        if self._failure is None and self.actors:
            ray.wait([a.stop.remote() for a in self.actors], num_returns=len(self.actors), timeout=5)
        self._kill_actors()
        if self._watcher is not None:
            self._watcher.join(2)
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
        if self._owns_ray_connection:
            ray.shutdown()
        self._death_send.close()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
