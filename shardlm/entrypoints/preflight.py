"""`shardlm env check`: a preflight of this node that runs in seconds.

It reports what a distributed launch depends on (host address and interfaces, versions,
memory, devices, /dev/shm) and then proves the communication path: it starts `--ranks` local
processes through the same rendezvous and process groups the engine uses, runs an all-reduce
and a send/recv (gloo on CPU, NCCL on CUDA), checks the results, and measures latency and
bandwidth. Any failure says what to fix. Across the nodes of a Ray cluster (`--address`),
entrypoints/cluster_check.py runs the same measurement with one rank per node.
"""

from __future__ import annotations

import importlib.metadata
import json
import multiprocessing
import os
import platform
import shutil
import socket
import time

import psutil

from shardlm import envs
from shardlm.distributed.network import host_ip, reverse_lookup_seconds, slow_lookups


def node_facts() -> dict:
    import torch
    import transformers

    import shardlm
    address = host_ip()
    facts = {
        "hostname": socket.gethostname(), "host_ip": address, "reverse_lookup_s": reverse_lookup_seconds([address]),
        "interfaces": {name: [a.address for a in addrs if a.family == socket.AF_INET]
                       for name, addrs in psutil.net_if_addrs().items()},
        "versions": {"shardlm": shardlm.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "cpus": len(os.sched_getaffinity(0)),
        "memory_total": psutil.virtual_memory().total, "memory_available": psutil.virtual_memory().available,
        "dev_shm_free": shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0,
        "gpus": [],
    }
    try:
        facts["versions"]["ray"] = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        pass
    from shardlm import cpu_plan, kernels
    from shardlm.kernels import amx
    facts["cpu_kernels"] = {**kernels.describe(), "amx": amx.unavailable() or "usable"}
    kernels.blocked_vector_bits()          # makes the bfloat16 product choice, where there is one
    cpu_plan.record(isa=facts["cpu_kernels"]["variant"] if kernels.library() is not None else None,
                    kernel_library=facts["cpu_kernels"]["library"])
    facts["cpu_plan"] = json.loads(cpu_plan.current().to_json())
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            facts["gpus"].append({"index": i, "name": torch.cuda.get_device_name(i), "free": free, "total": total})
    return facts


def measure_collectives(rank: int, world: int, host: str, port: int, device: str, timeout_s: float = 60) -> dict:
    """Run on every rank: join through the engine's rendezvous, check an all-reduce and a
    send/recv (rank 0 -> 1) for correctness, and time them."""
    import torch
    import torch.distributed as dist

    from shardlm.distributed import parallel_state as ps
    backend = "nccl" if device == "cuda" else "gloo"
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    ps.init_distributed_environment(world, rank, host, port, backend, timeout_s=timeout_s)
    try:
        out = {"rank": rank}
        x = torch.full((4,), float(rank + 1), device=dev)
        dist.all_reduce(x)
        out["all_reduce_ok"] = bool((x == world * (world + 1) / 2).all())
        small = torch.ones(1024, device=dev)
        for _ in range(5):
            dist.all_reduce(small)
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(small)
        _sync(dev)
        out["all_reduce_latency_us"] = (time.perf_counter() - t0) / 20 * 1e6
        big = torch.ones(16 << 20, device=dev)          # 64 MiB of float32
        dist.all_reduce(big)
        _sync(dev)
        t0 = time.perf_counter()
        dist.all_reduce(big)
        _sync(dev)
        # ring all-reduce moves 2 (n - 1) / n of the buffer per rank
        out["all_reduce_GBps"] = big.numel() * 4 * 2 * (world - 1) / world / (time.perf_counter() - t0) / 1e9
        big.fill_(7.0)
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(big, dst=1)
            dist.recv(small, src=1)
            _sync(dev)
            out["send_recv_GBps"] = big.numel() * 4 / (time.perf_counter() - t0) / 1e9
        elif rank == 1:
            dist.recv(big, src=0)
            out["send_recv_ok"] = bool((big == 7.0).all())
            dist.send(small, dst=0)
        return out
    finally:
        ps.destroy_model_parallel()


def _rank_main(rank: int, world: int, host: str, port: int, device: str, results) -> None:
    try:
        if device == "cuda":
            import torch
            torch.cuda.set_device(rank)
        results.put(measure_collectives(rank, world, host, port, device))
    except Exception as e:       # reported by the parent with the rank
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def communication_check(ranks: int = 2, device: str = "cpu", timeout_s: float = 60) -> dict:
    """Start `ranks` local processes through the engine's rendezvous; collect what they measured."""
    from shardlm.distributed.parallel_state import host_store, wait_for_ranks
    host = host_ip()
    try:
        store = host_store(host, ranks, timeout_s)
    except ValueError as e:
        return {"error": str(e)}
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, ranks, host, store.port, device, results), daemon=True)
             for r in range(ranks)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    try:
        wait_for_ranks(store, ranks, timeout_s)
        per_rank = sorted((results.get(timeout=timeout_s) for _ in procs), key=lambda r: r["rank"])
    except Exception as e:
        per_rank = [{"rank": -1, "error": f"{type(e).__name__}: {e}"}]
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    out = {"ranks": ranks, "backend": "nccl" if device == "cuda" else "gloo", "address": f"{host}:{store.port}",
           "seconds": time.perf_counter() - t0}
    out.update(summarize(per_rank))
    return out


def summarize(per_rank: list[dict], name=lambda rank: f"rank {rank}") -> dict:
    """One verdict from every rank's measure_collectives result (or error)."""
    errors = [f"{name(r['rank'])}: {r['error']}" for r in per_rank if "error" in r]
    if errors:
        return {"error": "; ".join(errors)}
    out = {"all_reduce_ok": all(r["all_reduce_ok"] for r in per_rank),
           "send_recv_ok": per_rank[1].get("send_recv_ok", False),
           "all_reduce_latency_us": max(r["all_reduce_latency_us"] for r in per_rank),
           "all_reduce_GBps": min(r["all_reduce_GBps"] for r in per_rank),
           "send_recv_GBps": per_rank[0]["send_recv_GBps"]}
    if not (out["all_reduce_ok"] and out["send_recv_ok"]):
        out["error"] = ("a collective returned wrong values: check the interfaces "
                        "(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)")
    return out


def problems(facts: dict, comm: dict) -> list[str]:
    found = []
    if facts["dev_shm_free"] < (1 << 30):
        found.append(f"/dev/shm has {facts['dev_shm_free'] >> 20} MiB free; workers exchange data through it: "
                     "give it at least 1 GiB (docker: --shm-size 1g or --ipc host)")
    if facts["host_ip"].startswith("127.") and not envs.SHARDLM_HOST_IP:
        found.append("no outward interface found: this node can only run single-node layouts "
                     "(set SHARDLM_HOST_IP to its cluster address for multi-node)")
    found += slow_lookups(facts.get("reverse_lookup_s", {}))
    if "error" in comm:
        found.append(f"communication check failed: {comm['error']}")
    return found


def render(facts: dict, comm: dict, found: list[str]) -> str:
    gib = 1 << 30
    lines = [f"Node {facts['hostname']}: host IP {facts['host_ip']} (override with SHARDLM_HOST_IP)",
             "  interfaces: " + ", ".join(f"{n} {'/'.join(a)}" for n, a in facts["interfaces"].items() if a),
             "  versions: " + ", ".join(f"{k} {v}" for k, v in facts["versions"].items()),
             f"  CPUs {facts['cpus']}, memory {facts['memory_available'] / gib:.1f} of "
             f"{facts['memory_total'] / gib:.1f} GiB free, /dev/shm {facts['dev_shm_free'] / gib:.1f} GiB free",
             "  GPUs: " + (", ".join(f"{g['index']}: {g['name']} ({g['free'] / gib:.1f} of {g['total'] / gib:.1f} GiB "
                                     "free)" for g in facts["gpus"]) or "none")]
    if "cpu_kernels" in facts:
        ck = facts["cpu_kernels"]
        lines.append(f"  CPU kernels: {ck['variant']} (best on this CPU: {ck['best']}; SHARDLM_CPU_ISA={ck['cap']}; "
                     f"library {ck['library']}): "
                     + ", ".join(f"{name} {state}" for name, state in ck["kernels"].items())
                     + (f"; AMX tiles {'usable' if ck['amx'] == 'usable' else 'not used: ' + ck['amx']}"
                        if "amx" in ck else ""))
    if "cpu_plan" in facts:
        from shardlm.cpu_plan import CpuPlan
        lines += ["  " + line for line in CpuPlan(**facts["cpu_plan"]).describe().splitlines()]
    if "all_reduce_ok" in comm:
        lines.append(f"Communication ({comm['ranks']} local ranks, {comm['backend']}, rendezvous {comm['address']}, "
                     f"{comm['seconds']:.1f} s): all-reduce {'ok' if comm['all_reduce_ok'] else 'WRONG'}, "
                     f"latency {comm['all_reduce_latency_us']:.0f} us, {comm['all_reduce_GBps']:.2f} GB/s; "
                     f"send/recv {'ok' if comm['send_recv_ok'] else 'WRONG'}, {comm['send_recv_GBps']:.2f} GB/s")
    lines += [f"PROBLEM: {p}" for p in found] or ["All checks passed."]
    return "\n".join(lines)
