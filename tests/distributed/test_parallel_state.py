"""The rank grid, the rendezvous timeout, and the shared-memory collectives across processes."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shardlm.distributed import parallel_state as ps
from tests.distributed.ranks import run_ranks


@pytest.mark.parametrize("dp,pp,tp,expected", [
    (1, 1, 4, {"tp": [[0, 1, 2, 3]], "pp": [[0], [1], [2], [3]], "dp": [[0], [1], [2], [3]],
               "ep": [[0, 1, 2, 3]]}),
    (1, 2, 4, {"tp": [[0, 1, 2, 3], [4, 5, 6, 7]], "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
               "dp": [[r] for r in range(8)], "ep": [[0, 1, 2, 3], [4, 5, 6, 7]]}),
    # EP: every DP x TP rank of a stage, replica-major
    (2, 2, 2, {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
               "dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "ep": [[0, 1, 4, 5], [2, 3, 6, 7]]}),
    (2, 1, 2, {"tp": [[0, 1], [2, 3]], "pp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]], "ep": [[0, 1, 2, 3]]}),
    (1, 3, 1, {"tp": [[0], [1], [2]], "pp": [[0, 1, 2]], "dp": [[0], [1], [2]], "ep": [[0], [1], [2]]}),
])
def test_rank_grid(dp, pp, tp, expected):
    grid = ps.rank_grid(dp * pp * tp, tp, pp, dp)
    assert {kind: grid[kind] for kind in expected} == expected
    for kind in ("tp", "pp", "dp", "ep"):      # every rank in exactly one group of each kind
        assert sorted(r for g in grid[kind] for r in g) == list(range(dp * pp * tp))


def test_context_parallel_groups():
    """dp=1, pp=2, pcp=2, tp=4, dcp=2: ranks pp x pcp x tp. A DCP group is two adjacent TP ranks;
    a PCP group one TP rank in both TP groups of a stage; the cp group, pcp-major, every rank
    holding a share of the same KV heads."""
    grid = ps.rank_grid(16, tp=4, pp=2, dp=1, dcp=2, pcp=2)
    assert grid["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert grid["dcp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert grid["pcp"][:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid["cp"] == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    assert grid["pp"][:4] == [[0, 8], [1, 9], [2, 10], [3, 11]]
    for kind in ("tp", "pp", "dp", "ep", "dcp", "pcp", "cp"):
        assert sorted(r for g in grid[kind] for r in g) == list(range(16))


def test_rank_grid_rejects_a_wrong_world():
    with pytest.raises(ValueError, match="dp x pp x pcp x tp"):
        ps.rank_grid(6, 4)


def test_rendezvous_timeout_names_the_missing_ranks():
    store = ps.host_store("127.0.0.1", 3, timeout_s=5)
    client = dist.TCPStore("127.0.0.1", store.port, 3, is_master=False, timeout=timedelta(seconds=5))
    client.set("arrived/0", "1")
    client.set("arrived/2", "1")
    with pytest.raises(TimeoutError, match=r"rank\(s\) 1 of 3 did not join"):
        ps.wait_for_ranks(store, 3, timeout_s=0.5)


def _collectives(rank, world, port, results):
    ps.init_distributed_environment(world, rank, "127.0.0.1", port, "gloo", 60)
    ps.initialize_model_parallel(world, rank=rank, backend="gloo")
    tp = ps.get_tp_group()
    assert tp.shm is not None, "CPU ranks on one host use the shared-memory path"
    out = {}
    for name, dtype, numel in (("small_fp32", torch.float32, 768), ("small_bf16", torch.bfloat16, 768 * 5),
                               ("larger_than_a_slot", torch.float32, 3 << 20)):
        gen = torch.Generator().manual_seed(rank * 100 + numel)
        x = torch.randn(numel, generator=gen).to(dtype)
        out[name] = tp.all_reduce(x.clone())
        out[name + "_input"] = x
    g = tp.gather(torch.full((2, 3), float(rank)), dst=0, dim=-1)
    out["gather"] = g
    results.put((rank, {k: (v.tolist() if v is not None else None) for k, v in out.items()}))
    ps.destroy_model_parallel()


@pytest.mark.slow
def test_shared_memory_all_reduce_and_gather_across_processes():
    world = 3
    got = run_ranks(_collectives, world)
    for name in ("small_fp32", "small_bf16", "larger_than_a_slot"):
        # bit-identical on every rank (TP ranks must never drift apart)
        assert got[0][name] == got[1][name] == got[2][name]
        dtype = torch.bfloat16 if "bf16" in name else torch.float32
        expected = sum(torch.tensor(got[r][name + "_input"], dtype=torch.float32) for r in range(world))
        torch.testing.assert_close(torch.tensor(got[0][name], dtype=torch.float32), expected.to(dtype).float(),
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    assert got[0]["gather"] == [[0.0] * 3 + [1.0] * 3 + [2.0] * 3] * 2
    assert got[1]["gather"] is None and got[2]["gather"] is None
