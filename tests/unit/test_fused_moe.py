"""The fused MoE layer equals a plain per-token computation of the same experts (softmax router,
top-k, renormalised weights), whether it holds every expert, a TP slice of each, or (expert
parallel) whole experts of its own, and with data parallel replicas whose tokens differ."""

import pytest
import torch
import torch.nn.functional as F

from shardlm.distributed import parallel_state as ps
from shardlm.layers.cpu_matmul import goes_into_panels
from shardlm.layers.moe import FusedMoE, dp_token_counts, local_experts
from tests.distributed.ranks import run_ranks

E, K, H, INTER = 6, 2, 32, 48


def _weights():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(E, INTER, H, generator=gen) / 6, torch.randn(E, INTER, H, generator=gen) / 6,
            torch.randn(E, H, INTER, generator=gen) / 7)


def _tokens(replica: int, n: int):
    gen = torch.Generator().manual_seed(100 + replica)
    x, logits = torch.randn(n, H, generator=gen), torch.randn(n, E, generator=gen)
    logits[:, 5] = -1e4                     # an expert no token picks
    return x, logits


def _reference(x, logits, w1, w3, w2, top_k):
    out = torch.zeros_like(x)
    probs = F.softmax(logits, dim=-1)
    for t in range(x.shape[0]):
        weights, ids = probs[t].topk(top_k)
        weights = weights / weights.sum()
        for w, e in zip(weights, ids):
            out[t] += w * (w2[e] @ (F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
    return out


def _loaded_moe():
    w1, w3, w2 = _weights()
    moe = FusedMoE(E, K, H, INTER)
    for e in range(E):                     # as from a checkpoint: expert e's w1, w3, w2
        moe.w13.weight_loader(moe.w13, w1[e], (e, 0))
        moe.w13.weight_loader(moe.w13, w3[e], (e, 1))
        moe.w2.weight_loader(moe.w2, w2[e], e)
    return moe


def test_fused_moe_equals_the_per_token_computation(one_rank):
    moe = _loaded_moe()
    x, logits = _tokens(0, 37)
    torch.testing.assert_close(moe(x, logits), _reference(x, logits, *_weights(), K), rtol=1e-5, atol=1e-5)
    assert moe.expert_load.sum().item() == 37 * K and moe.expert_load[5].item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_experts_in_the_blocked_panels_give_the_same_outputs(one_rank, dtype):
    """After loading, float experts go into the blocked kernel's panels where the linears' weights
    do (here on CPUs with AVX-512, or AVX2 for bfloat16): each expert's product then reads them,
    and one token's output does not depend on the other tokens of the step."""
    moe = _loaded_moe().to(dtype)
    x, logits = _tokens(0, 37)
    x = x.to(dtype)
    plain = moe(x, logits)
    moe.process_weights_after_loading()
    if not goes_into_panels(torch.empty(2, 2, dtype=dtype)):
        assert moe.panels is None
        pytest.skip(f"{dtype} weights stay plain on this CPU")
    assert moe.panels == {"w13": 2 * INTER, "w2": H} and moe.w13.dim() == 2
    packed = moe(x, logits)
    torch.testing.assert_close(packed, plain, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert torch.equal(moe(x[:1], logits[:1]), packed[:1])


@pytest.mark.parametrize("ep,expected", [(4, [(0, 2), (2, 2), (4, 1), (5, 1)]), (2, [(0, 3), (3, 3)]),
                                         (6, [(e, 1) for e in range(6)])])
def test_experts_are_spread_evenly_the_first_ranks_taking_the_remainder(ep, expected):
    assert [local_experts(E, ep, r) for r in range(ep)] == expected


def _rank(rank, world, port, dp, tp, ep, tokens_per_replica, results):
    ps.init_distributed_environment(world, rank, "127.0.0.1", port, "gloo", 60)
    ps.initialize_model_parallel(tp, 1, dp, rank=rank, backend="gloo", expert_parallel=ep)
    moe = _loaded_moe()
    replica = rank // tp
    outs = []
    for step, counts in enumerate(tokens_per_replica):       # one list of per-replica token counts a step
        x, logits = _tokens(replica * 10 + step, counts[replica])
        with dp_token_counts(counts if dp > 1 else None):
            outs.append(moe(x, logits) if counts[replica] else (moe.dummy_forward(), None)[1])
    results.put((rank, {"outs": [o.tolist() if o is not None else None for o in outs],
                        "held": moe.w13.shape[0], "load": moe.expert_load.tolist()}))
    ps.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp,ep", [(1, 2, False), (1, 2, True), (2, 2, True), (2, 1, True)],
                         ids=["tp2", "tp2-ep", "dp2-tp2-ep", "dp2-ep"])
def test_fused_moe_across_ranks_equals_one_rank(dp, tp, ep):
    """Steps where the replicas have different token counts, and one where a replica has none
    (it runs a dummy forward while the other's tokens still reach its experts)."""
    steps = [[5, 3], [1, 7], [0, 4], [6, 0]] if dp > 1 else [[5], [1], [9]]
    world = dp * tp
    got = run_ranks(_rank, world, dp, tp, ep, steps)
    w = _weights()
    for rank in range(world):
        replica = rank // tp
        for step, counts in enumerate(steps):
            out = got[rank]["outs"][step]
            if counts[replica] == 0:
                assert out is None
                continue
            x, logits = _tokens(replica * 10 + step, counts[replica])
            torch.testing.assert_close(torch.tensor(out), _reference(x, logits, *w, K), rtol=1e-5, atol=1e-5)
        # each replica counts its own tokens' routes
        assert sum(got[rank]["load"]) == sum(c[replica] for c in steps) * K
    held = [got[r]["held"] for r in range(world)]
    if ep:
        assert held == [n for _, n in (local_experts(E, world, r) for r in range(world))] and sum(held) == E
    else:
        assert held == [E] * world
