"""`shardlm env check --address HEAD:PORT`: the preflight across the nodes of a Ray cluster.

One probe actor per node (no CPU or GPU reserved for the facts; one GPU per node for an NCCL
check) reports the node's facts, tries to reach the rendezvous port this process opens, then
joins a world of one rank per node for an all-reduce and a send/recv between the first two
nodes, through the same rendezvous and process groups as the engine. Every failure names the
node it happened on.
"""

from __future__ import annotations

import glob
import os
import socket
import time

from shardlm.executor.selection import require_ray

NCCL_LOG = "/tmp/shardlm-env-check-nccl.%h.%p.log"


class NodeProbe:
    """Lives on one node for the duration of the check."""

    def facts(self) -> dict:
        from shardlm.distributed.network import host_ip
        from shardlm.entrypoints.preflight import node_facts
        facts = node_facts()
        facts["host_ip"] = host_ip(require_ray())  # SHARDLM_HOST_IP, else Ray's view of this node
        return facts

    def lookups(self, addresses: list[str]) -> dict[str, float]:
        """Seconds this node's resolver takes to name each address (every node's, the head's too)."""
        from shardlm.distributed.network import reverse_lookup_seconds
        return reverse_lookup_seconds(addresses)

    def reach(self, host: str, port: int) -> str | None:
        """None if this node can open a connection to host:port, else why not."""
        from shardlm.distributed.network import connect_error
        e = connect_error(host, port)
        return None if e is None else f"{type(e).__name__}: {e}"

    def measure(self, rank: int, world: int, host: str, port: int, device: str, ip: str, timeout_s: float) -> dict:
        from shardlm.distributed.network import bind_collectives_to
        from shardlm.entrypoints.preflight import measure_collectives
        try:
            bind_collectives_to(ip, "nccl" if device == "cuda" else "gloo")
            out = measure_collectives(rank, world, host, port, device, timeout_s)
            out["transport"] = _nccl_transport() if device == "cuda" else "tcp (gloo)"
            return out
        except Exception as e:         # noqa: BLE001  (reported with the node's name)
            return {"rank": rank, "error": f"{type(e).__name__}: {e}"}


def _nccl_transport() -> str:
    """What NCCL chose, from its INFO log: 'NET/IB' (InfiniBand), 'NET/Socket' (TCP), P2P/SHM inside a node."""
    text = ""
    for path in glob.glob(NCCL_LOG.replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))):
        with open(path, errors="replace") as f:
            text += f.read()
    for marker in ("NET/IB/GDRDMA", "NET/IB", "NET/Socket", "P2P", "SHM"):
        if f"via {marker}" in text:
            return marker
    return "unknown (NCCL did not log it)"


def cluster_check(address: str | None, timeout_s: float = 60) -> dict:
    ray = require_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from shardlm.distributed.network import host_ip
    from shardlm.distributed.parallel_state import host_store
    from shardlm.entrypoints.preflight import problems as node_problems
    from shardlm.entrypoints.preflight import summarize

    t0 = time.perf_counter()
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", logging_level="error", log_to_driver=False)
    probes = []
    try:
        nodes = sorted((n for n in ray.nodes() if n["Alive"]),
                       key=lambda n: (not n["Resources"].get("node:__internal_head__"), n["NodeManagerAddress"]))
        on_gpu = all(n["Resources"].get("GPU", 0) >= 1 for n in nodes)
        device = "cuda" if on_gpu else "cpu"
        env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": NCCL_LOG} if on_gpu else {}
        probe_cls = ray.remote(NodeProbe)
        # one rank per node; a single-node cluster gets two, so there is something to measure
        placement = nodes if len(nodes) > 1 else nodes * 2
        probes = [probe_cls.options(num_cpus=0, num_gpus=1 if on_gpu else 0, runtime_env={"env_vars": env},
                                    scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
                                    ).remote() for n in placement]
        facts = ray.get([p.facts.remote() for p in probes], timeout=timeout_s)
        names = [f"node {f['host_ip']} ({f['hostname']})" for f in facts]
        lookups = ray.get([p.lookups.remote([f["host_ip"] for f in facts]) for p in probes], timeout=timeout_s)
        for f, n, seconds in zip(facts, placement, lookups):
            f["ray_node_id"], f["reverse_lookup_s"] = n["NodeID"], seconds
        found = []
        versions = facts[0]["versions"]
        for name, f in zip(names, facts):
            found += [f"{name}: {p}" for p in node_problems(f, {})]
            found += [f"{name}: {k} {f['versions'].get(k)} there, {v} on {names[0]}"
                      for k, v in versions.items() if f["versions"].get(k) != v]
        here = host_ip(ray)                        # the address `serve` would use here
        store = host_store(here, len(probes), timeout_s)
        unreachable = ray.get([p.reach.remote(here, store.port) for p in probes], timeout=timeout_s)
        found += [f"{name}: cannot reach the rendezvous port {here}:{store.port} ({why}); open the port range "
                  "between nodes or set SHARDLM_HOST_IP to an address the nodes share"
                  for name, why in zip(names, unreachable) if why]
        comm = {"ranks": len(probes), "backend": "nccl" if on_gpu else "gloo", "address": f"{here}:{store.port}"}
        if not any(unreachable):
            t1 = time.perf_counter()
            per_rank = ray.get([p.measure.remote(r, len(probes), here, store.port, device, facts[r]["host_ip"],
                                                 timeout_s) for r, p in enumerate(probes)], timeout=timeout_s + 30)
            comm.update(summarize(per_rank, name=lambda r: names[r]))
            comm["seconds"] = time.perf_counter() - t1
            comm["transport"] = per_rank[0].get("transport", "")
            if "error" in comm:
                found.append(f"communication check failed: {comm['error']}")
        unique = {f["ray_node_id"]: f for f in facts}
        return {"nodes": list(unique.values()), "communication": comm, "problems": found,
                "seconds": time.perf_counter() - t0}
    finally:
        for p in probes:
            ray.kill(p)
        ray.shutdown()


def render_cluster(report: dict) -> str:
    from shardlm.entrypoints.preflight import render
    lines = [f"{len(report['nodes'])} node(s):"]
    for facts in report["nodes"]:
        node_lines = render(facts, {}, []).splitlines()[:-1]         # the node part, without the verdict
        node_lines[0] = node_lines[0].replace(":", f" (Ray node {facts['ray_node_id'][:8]}):", 1)
        lines += node_lines
    comm = report["communication"]
    if "all_reduce_ok" in comm:
        lines.append(f"Across nodes ({comm['ranks']} ranks, one per node, {comm['backend']}, rendezvous "
                     f"{comm['address']} reachable from every node, {comm['seconds']:.1f} s): all-reduce "
                     f"{'ok' if comm['all_reduce_ok'] else 'WRONG'}, latency {comm['all_reduce_latency_us']:.0f} us, "
                     f"{comm['all_reduce_GBps']:.2f} GB/s; send/recv {'ok' if comm['send_recv_ok'] else 'WRONG'}, "
                     f"{comm['send_recv_GBps']:.2f} GB/s; transport {comm['transport']}")
    lines += [f"PROBLEM: {p}" for p in report["problems"]] or [f"All checks passed in {report['seconds']:.1f} s."]
    return "\n".join(lines)
