"""Run a function on `world` gloo rank processes (from shardlm's fork server) that rendezvous at
a store hosted here; collect what each puts on its result queue, keyed by rank."""

from shardlm.distributed import parallel_state as ps
from shardlm.processes import InParentEnvironment, process_context


def run_ranks(target, world: int, *args, timeout: float = 120) -> dict:
    """target(rank, world, store_port, *args, results) puts (rank, value) on results."""
    ctx = process_context("forkserver")
    store = ps.host_store("127.0.0.1", world, 60)
    results = ctx.Queue()
    procs = [ctx.Process(target=InParentEnvironment(target), args=(r, world, store.port, *args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return got
