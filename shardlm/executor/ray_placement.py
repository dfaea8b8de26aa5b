"""Where the ranks of a Ray executor run: the placement group, the rank order, and the checks
that turn the usual multi-node mistakes into an error naming the node.

One bundle per rank (one GPU each on CUDA, one Ray CPU each on CPU), PACK strategy, the first
bundle on the driver's node. Ranks are then numbered driver's node first, node by node, so a
TP group (consecutive ranks) shares a node and PP stages cross nodes.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
from dataclasses import dataclass

from shardlm import envs
from shardlm.distributed.parallel_state import rank_grid
from shardlm.logger import init_logger

logger = init_logger(__name__)

# set where `serve` runs, needed by every worker on every node; SHARDLM_HOST_IP is per node
FORWARDED_PREFIXES = ("NCCL_", "GLOO_", "SHARDLM_")
NOT_FORWARDED = {"SHARDLM_HOST_IP"}


def forwarded_env() -> dict[str, str]:
    """NCCL_*, GLOO_*, SHARDLM_* and the variables named in SHARDLM_FORWARD_ENV, from this process."""
    listed = {name.strip() for name in envs.SHARDLM_FORWARD_ENV.split(",") if name.strip()}
    return {k: v for k, v in os.environ.items()
            if (k.startswith(FORWARDED_PREFIXES) or k in listed) and k not in NOT_FORWARDED}


def node_versions() -> dict[str, str]:
    """What every node must run alike: checked when a node joins and when `serve` starts."""
    import torch

    from shardlm.version import __version__
    return {"shardlm": __version__, "torch": torch.__version__, "ray": importlib.metadata.version("ray"),
            "python": platform.python_version()}


@dataclass
class NodeInfo:
    """What a worker actor reports about the node it landed on."""
    node_id: str
    ip: str                 # SHARDLM_HOST_IP of that node, else Ray's address for it
    hostname: str
    pid: int
    versions: dict[str, str]
    model_path_exists: bool
    gpu_ids: list[str]      # the GPUs Ray gave this rank's actor (none on CPU)

    def describe(self) -> str:
        return f"node {self.ip} ({self.hostname}, Ray node {self.node_id[:8]})"


def bundle_resources(device_type: str) -> dict[str, float]:
    return {"GPU": 1.0, "CPU": 1.0} if device_type == "cuda" else {"CPU": 1.0}


def create_placement_group(ray, world_size: int, device_type: str, timeout_s: float, name: str = ""):
    """A placement group of one bundle per rank, or an error that lists what the cluster has."""
    from ray.util.placement_group import placement_group

    bundle = bundle_resources(device_type)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    kind = "GPU" if device_type == "cuda" else "CPU"
    available = sum(n["Resources"].get(kind, 0) for n in nodes)
    if available < world_size:
        raise ValueError(f"The Ray cluster has {available:g} {kind}(s) but {world_size} ranks need one each. Nodes: "
                         f"{describe_nodes(nodes)}. Add nodes (`shardlm cluster worker --address HEAD:PORT`) or lower "
                         "the parallel sizes.")
    bundles = [dict(bundle) for _ in range(world_size)]
    driver_ip = ray.util.get_node_ip_address()
    driver_node = next((n for n in nodes if n["NodeManagerAddress"] == driver_ip), None)
    if driver_node is not None and driver_node["Resources"].get(kind, 0) >= 1:
        bundles[0][f"node:{driver_ip}"] = 0.001           # the first rank on the driver's node
    pg = placement_group(bundles, strategy="PACK", name=name)
    deadline = time.monotonic() + timeout_s
    while not ray.wait([pg.ready()], timeout=min(10.0, max(0.1, deadline - time.monotonic())))[0]:
        if time.monotonic() > deadline:
            ray.util.remove_placement_group(pg)
            raise TimeoutError(f"Ray could not place {world_size} bundles of {bundle} within {timeout_s:.0f} s "
                               f"(other jobs may hold them). Nodes: {describe_nodes(nodes)}. `ray status` shows "
                               "what is in use.")
        logger.info("Waiting for Ray to place %d bundles of %s ...", world_size, bundle)
    return pg


def describe_nodes(nodes: list[dict]) -> str:
    return "; ".join(f"{n['NodeManagerAddress']} ({n.get('NodeManagerHostname', '?')}): "
                     f"{n['Resources'].get('CPU', 0):g} CPU, {n['Resources'].get('GPU', 0):g} GPU" for n in nodes)


def rank_order(infos: list[NodeInfo], driver_node_id: str) -> list[int]:
    """Bundle indices in rank order: the driver's node first, then node by node."""
    return sorted(range(len(infos)), key=lambda i: (infos[i].node_id != driver_node_id, infos[i].ip,
                                                    infos[i].node_id, i))


def local_ranks(hosts: list[str]) -> tuple[list[int], list[int]]:
    """For each rank, its index among the ranks on the same machine, and how many share it
    (CPU cores are shared per machine, whatever Ray calls a node)."""
    local, seen = [], {}
    for h in hosts:
        local.append(seen.get(h, 0))
        seen[h] = seen.get(h, 0) + 1
    return local, [seen[h] for h in hosts]


def split_among_replicas(bundle_nodes: list[str], node_hosts: dict[str, str], driver_node: str,
                         replicas: int) -> list[tuple[list[int], list[int], list[int]]]:
    """-dp with the ray executor: one placement group holds every replica's ranks (bundle i on
    node bundle_nodes[i]). Per replica: its bundles in rank order, and for each of its ranks the
    index and count of all replicas' ranks on that machine (who shares the cores). Bundles go
    driver's node first, node by node, so a replica's TP group (consecutive ranks) shares a node
    where one can hold it."""
    order = sorted(range(len(bundle_nodes)), key=lambda i: (bundle_nodes[i] != driver_node, bundle_nodes[i], i))
    local, sizes = local_ranks([node_hosts[bundle_nodes[i]] for i in order])
    world = len(order) // replicas
    return [(order[k * world:(k + 1) * world], local[k * world:(k + 1) * world], sizes[k * world:(k + 1) * world])
            for k in range(replicas)]


def cuda_devices(infos: list[NodeInfo]) -> list[tuple[str, int]]:
    """Per rank: CUDA_VISIBLE_DEVICES listing every GPU our ranks hold on its node, and the index
    of its own among them. Ray shows each actor only its own GPU; NCCL needs to see its peers'
    to use peer-to-peer copies inside a node."""
    on_node: dict[str, set[str]] = {}
    for info in infos:
        on_node.setdefault(info.node_id, set()).update(info.gpu_ids)
    out = []
    for info in infos:
        ids = sorted(on_node[info.node_id], key=lambda g: (len(g), g))      # "2" before "10"
        out.append((",".join(ids), ids.index(info.gpu_ids[0])))
    return out


def check_placement(infos: list[NodeInfo], tp: int, pp: int, model_path: str, driver_versions: dict[str, str],
                    allow_cross_node_tp: bool) -> None:
    """infos in rank order. Refuse what would fail or crawl, naming the node."""
    for info in infos:
        differing = {k: (v, info.versions.get(k)) for k, v in driver_versions.items() if info.versions.get(k) != v}
        if differing:
            what = ", ".join(f"{k} {theirs} there, {ours} here" for k, (ours, theirs) in differing.items())
            raise RuntimeError(f"Versions differ on {info.describe()}: {what}. Install the same versions on every "
                               "node (pip install -c constraints.txt 'shardlm[ray]').")
        if not info.model_path_exists:
            raise RuntimeError(f"The model path {model_path} does not exist on {info.describe()}: every node needs the "
                               "model at the same path (copy it there, or use a shared filesystem), or a hub id "
                               "that node can fetch (see its log for why it could not).")
    for group in rank_grid(len(infos), tp, pp, pcp=len(infos) // (tp * pp))["tp"]:
        nodes = {infos[r].node_id for r in group}
        if len(nodes) > 1 and not allow_cross_node_tp:
            per_node = min(sum(1 for i in infos if i.node_id == n) for n in {i.node_id for i in infos})
            spread = ", ".join(sorted({infos[r].describe() for r in group}))
            raise ValueError(f"The tensor parallel group of ranks {group[0]}-{group[-1]} would span {len(nodes)} "
                             f"nodes ({spread}): every layer would do two all-reduces over the network. Use "
                             f"tensor parallel = ranks per node ({per_node} here) and pipeline parallel = nodes, or "
                             "pass --allow-cross-node-tp to run it anyway.")
