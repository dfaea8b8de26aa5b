"""Starting the engine cores a client speaks to (vLLM's engine/utils.py): one process on this
node; with data parallel, this node's replicas (processes), those of headless nodes (they join
over the network, dp_remote.py) and those placed on Ray nodes (actors, dp_ray.py), all of whose
ranks rendezvous in one DP x PP x TP world through one store."""

from __future__ import annotations

import dataclasses

import msgspec

from shardlm.config import EngineConfig
from shardlm.distributed.network import host_ip
from shardlm.distributed.parallel_state import host_store
from shardlm.engine.core_channel import CoreChannel, CoreProcess, RemoteCore
from shardlm.engine.dp import replica_configs
from shardlm.engine.dp_front_ends import FrontEnds
from shardlm.engine.dp_remote import JoinListener, RejoinDoor, fingerprint
from shardlm.engine.errors import EngineDeadError
from shardlm.messages import StartWave

_encode = msgspec.msgpack.Encoder().encode


class LaunchedCores:
    """The started engine cores, ready (num_blocks: each one's KV cache blocks), and what keeps
    their world together (the rendezvous store, the Ray replicas) until stop()."""

    def __init__(self, config: EngineConfig, front_ends: FrontEnds | None = None):
        """front_ends: this server's link to the other servers of its replicas' world (expert
        parallel replicas under hybrid load balancing: dp_front_ends.py)."""
        par = config.parallel
        self._store, self._ray_replicas, self._ray_ranks, self._door = None, None, None, None
        master, listener, node_address = None, None, None
        on_ray = par.data_parallel_size > 1 and "ray" in (par.data_parallel_backend, par.distributed_executor_backend)
        if front_ends is not None:       # the world is the deployment's, its store the head server's
            master, node_address = front_ends.new_world(), front_ends.node_address
        elif par.data_parallel_size > 1:
            # the Ray actors may be on other nodes: they reach this node by its address
            host = par.data_parallel_address or (host_ip() if on_ray else "127.0.0.1")
            if par.data_parallel_size_local < par.data_parallel_size:
                listener = JoinListener(host, par.data_parallel_rpc_port or 0)   # before anything can join
                node_address = host        # our replicas' DP groups cross nodes: gloo/NCCL bind to it
            self._store = host_store(host, par.world_size_across_dp, par.distributed_init_timeout)
            master = (host, self._store.port)
        bundles = None
        if par.data_parallel_size > 1 and par.distributed_executor_backend == "ray":
            from shardlm.engine.dp_ray import ReplicaRanksOnRay
            self._ray_ranks = ReplicaRanksOnRay(config)
            bundles = self._ray_ranks.bundles
        # all start before any is waited for: their ranks rendezvous together
        local = replica_configs(config, master, bundles) if par.data_parallel_size_local else []
        self.cores: list[CoreChannel] = [CoreProcess(c, k, node_address) for k, c in enumerate(local)]
        try:
            if par.data_parallel_backend == "ray" and par.data_parallel_size > 1 and not bundles:
                from shardlm.engine.dp_ray import RayReplicas
                self._ray_replicas = RayReplicas(config, listener.address)
            if listener is not None:
                self.cores += _accept_remote(config, listener, master, local)
            self.num_blocks = [core.wait_ready() for core in self.cores]
        except BaseException:
            if listener is not None:
                listener.close()
            self.stop(b"", timeout=5)
            raise
        if front_ends is not None:
            front_ends.serve_waves(self.start_wave)
        if listener is not None:      # open for the other nodes' replicas that start again
            remote = [c.config.parallel.data_parallel_rank for c in self.cores if isinstance(c, RemoteCore)]
            self._door = RejoinDoor(listener, remote, fingerprint(config))

    def start_wave(self, number: int, but: int | None = None) -> None:
        """Lock-step wave `number` began elsewhere: every (other) live replica joins it (core/wave.py)."""
        msg = _encode(StartWave(number))
        for core in self.cores:
            if core.index != but and core.dead_reason is None:
                try:
                    core.send(msg)
                except EngineDeadError:
                    pass             # its death is reported by its reader

    def restart_replica(self, k: int) -> CoreChannel:
        """Data parallel replica k, which died, started again and ready: a process of this node, a
        new Ray actor, or a headless node's replica its node started again (it joins the head's
        door). The others' DP groups still count its old ranks, so its ranks form a world of their
        own: for replicas that never step together (not DP + EP lock-step)."""
        old = self.cores[k]
        if isinstance(old, RemoteCore):
            rank = old.config.parallel.data_parallel_rank
            if self._ray_replicas is not None:
                self._ray_replicas.restart(rank)
            conn = self._door.wait(rank, old.config.parallel.distributed_init_timeout)
            core = RemoteCore(old.config, k, conn)
        else:
            par = dataclasses.replace(old.config.parallel, data_parallel_master=None, data_parallel_own_world=True)
            core = CoreProcess(dataclasses.replace(old.config, parallel=par), k)
        try:
            self.num_blocks[k] = core.wait_ready()
        except BaseException:
            core.shutdown(b"", timeout=1)
            raise
        old.shutdown(b"", timeout=1)        # ended already: reap it and close its pipes
        self.cores[k] = core
        return core

    def stop(self, shutdown_msg: bytes, timeout: float) -> None:
        """Ask every core to shut down (`shutdown_msg`), wait up to `timeout`, then end them."""
        for core in self.cores:
            core.closing = True
        for core in self.cores:
            core.shutdown(shutdown_msg, timeout)
        if self._door is not None:
            self._door.close()
            self._door = None
        if self._ray_replicas is not None:
            self._ray_replicas.shutdown()
            self._ray_replicas = None
        if self._ray_ranks is not None:
            self._ray_ranks.shutdown()
            self._ray_ranks = None
        self._store = None


def _accept_remote(config: EngineConfig, listener: JoinListener, master: tuple[str, int],
                   local: list[EngineConfig]) -> list[CoreChannel]:
    """The replicas of the other nodes, once each has joined (in replica order after ours)."""
    par = config.parallel
    ours = {c.parallel.data_parallel_rank for c in local}
    expected = [r for r in range(par.data_parallel_size) if r not in ours]
    joined = listener.accept_replicas(expected, fingerprint(config), master, par.distributed_init_timeout)
    return [RemoteCore(dataclasses.replace(config, parallel=dataclasses.replace(par, data_parallel_rank=r)),
                       len(local) + i, joined[r]) for i, r in enumerate(expected)]
