"""Data parallel on Ray, two ways.

--data-parallel-backend ray: each replica's engine core runs in a Ray actor, placed with all of
its TP x PP ranks on one node (one placement-group bundle per replica, PACK), and joins the
client over TCP exactly as a headless node's engine core does (engine/dp_remote.py). Inside the
actor the replica's ranks run as processes of that node (the uni or mp executor).

--distributed-executor-backend ray: the engine cores run on this node and every rank of every
replica is a Ray actor (executor/ray_executor.py), so a replica may span nodes. The client makes
one placement group for all of them, which tells each replica where its ranks go and which
ranks of other replicas share a machine's cores.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid

from shardlm.config import EngineConfig, RayBundles
from shardlm.executor.ray_placement import (
    create_placement_group,
    describe_nodes,
    forwarded_env,
    split_among_replicas,
)
from shardlm.executor.selection import init_ray, require_ray
from shardlm.logger import init_logger

ray = require_ray()
logger = init_logger(__name__)


@ray.remote(max_restarts=0)
class EngineCoreActor:
    """One replica's engine core; run() returns when it ends (shut down by the client, or failed)."""

    def node(self) -> str:
        from shardlm.engine.dp_remote import node_name
        return node_name()

    def run(self, config: EngineConfig) -> int:
        from shardlm.engine.headless import run_remote_engine_core
        return run_remote_engine_core(config)


class RayReplicas:
    """The actors of every replica, in a placement group; they connect to `head` (host, port)."""

    def __init__(self, config: EngineConfig, head: tuple[str, int]):
        self._owns_ray_connection = init_ray(address=os.environ.get("RAY_ADDRESS"), logging_level="warning")
        self.pg, self.actors, self.replicas = None, [], []
        try:
            self._start(config, head)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig, head: tuple[str, int]) -> None:
        from ray.util.placement_group import placement_group
        par = config.parallel
        ranks, on_gpu = par.world_size, config.device.type == "cuda"
        bundle = {"CPU": float(ranks), **({"GPU": float(ranks)} if on_gpu else {})}
        self.pg = placement_group([dict(bundle) for _ in range(par.data_parallel_size)], strategy="PACK")
        deadline = time.monotonic() + par.distributed_init_timeout
        while not ray.wait([self.pg.ready()], timeout=min(10.0, max(0.1, deadline - time.monotonic())))[0]:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Ray could not place {par.data_parallel_size} data parallel replicas of {bundle} (all of a "
                    f"replica's ranks on one node) within {par.distributed_init_timeout:.0f} s. Nodes: "
                    f"{describe_nodes([n for n in ray.nodes() if n['Alive']])}. Lower -dp or -tp/-pp, or add nodes.")
            logger.info("Waiting for Ray to place %d replicas of %s ...", par.data_parallel_size, bundle)
        host, port = head
        # seen from inside, a replica that joins the client over TCP like a headless node's,
        # alone on its share of the node (its ranks split the bundle's CPUs between them)
        self.replicas = [dataclasses.replace(config, parallel=dataclasses.replace(
            par, data_parallel_backend="mp", data_parallel_rank=rank, data_parallel_start_rank=rank,
            data_parallel_size_local=1, data_parallel_address=host, data_parallel_rpc_port=port))
            for rank in range(par.data_parallel_size)]
        for rank in range(par.data_parallel_size):
            self.actors.append(self._actor(rank))
        nodes = ray.get([a.node.remote() for a in self.actors], timeout=par.distributed_init_timeout)
        for actor, replica in zip(self.actors, self.replicas):
            actor.run.remote(replica)        # runs until the engine core ends (one call at a time per actor)
        logger.info("Data parallel replicas on Ray: %s", "; ".join(f"{r}: node {n}" for r, n in enumerate(nodes)))

    def _actor(self, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        ranks = self.replicas[rank].parallel.world_size
        on_gpu = self.replicas[rank].device.type == "cuda"
        return EngineCoreActor.options(
            num_cpus=ranks, num_gpus=ranks if on_gpu else 0,
            runtime_env={"env_vars": {**forwarded_env(), "OMP_NUM_THREADS": str(ranks)}},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
        ).remote()

    def restart(self, rank: int) -> None:
        """Replica `rank`'s actor (dead, or alive with its engine core ended) replaced by a new one
        in the same bundle; it joins the client again as a headless node's replica does."""
        ray.kill(self.actors[rank], no_restart=True)
        self.actors[rank] = self._actor(rank)
        self.actors[rank].run.remote(self.replicas[rank])

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
        if self._owns_ray_connection and ray.is_initialized():
            ray.shutdown()


class ReplicaRanksOnRay:
    """-dp with the ray executor: one placement group for every replica's ranks; `bundles[k]`
    says where replica k's ranks go. Removed (with them) on shutdown."""

    def __init__(self, config: EngineConfig):
        par = config.parallel
        self._owns_ray_connection = init_ray(address=os.environ.get("RAY_ADDRESS"), logging_level="warning")
        self.pg = None
        try:
            name = f"shardlm-dp-{uuid.uuid4().hex[:12]}"
            ranks = par.data_parallel_size * par.world_size
            self.pg = create_placement_group(ray, ranks, config.device.type, par.distributed_init_timeout, name)
            placed = ray.util.placement_group_table(self.pg)["bundles_to_node_id"]
            nodes = {n["NodeID"]: n for n in ray.nodes()}
            bundle_nodes = [placed[i] for i in range(ranks)]
            context = ray.get_runtime_context()
            hosts = {node: nodes[node].get("NodeManagerHostname", node) for node in set(bundle_nodes)}
            self.bundles = [RayBundles(context.gcs_address, context.namespace, name, tuple(b), tuple(local),
                                       tuple(sizes))
                            for b, local, sizes in split_among_replicas(bundle_nodes, hosts, context.get_node_id(),
                                                                         par.data_parallel_size)]
        except BaseException:
            self.shutdown()
            raise
        logger.info("Data parallel ranks on Ray: %s", "; ".join(
            f"replica {k}: " + ", ".join(nodes[bundle_nodes[b]]["NodeManagerAddress"] for b in r.bundles)
            for k, r in enumerate(self.bundles)))

    def shutdown(self) -> None:
        if self.pg is not None and ray.is_initialized():
            ray.util.remove_placement_group(self.pg)
        self.pg = None
        if self._owns_ray_connection and ray.is_initialized():
            ray.shutdown()
