"""The fused MoE layer equals a plain per-token computation of the same experts (softmax router,
top-k, renormalised weights), and its loader places each expert's slices where they belong."""

import torch
import torch.nn.functional as F

from shardlm.layers.moe import FusedMoE


def _reference(x, logits, w1, w3, w2, top_k):
    out = torch.zeros_like(x)
    probs = F.softmax(logits, dim=-1)
    for t in range(x.shape[0]):
        weights, ids = probs[t].topk(top_k)
        weights = weights / weights.sum()
        for w, e in zip(weights, ids):
            out[t] += w * (w2[e] @ (F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
    return out


def test_fused_moe_equals_the_per_token_computation():
    torch.manual_seed(0)
    E, k, H, inter, T = 6, 2, 32, 48, 37
    w1, w3, w2 = torch.randn(E, inter, H) / 6, torch.randn(E, inter, H) / 6, torch.randn(E, H, inter) / 7
    moe = FusedMoE(E, k, H, inter)
    for e in range(E):                     # as from a checkpoint: expert e's w1, w3, w2
        moe.w13.weight_loader(moe.w13, w1[e], (e, 0))
        moe.w13.weight_loader(moe.w13, w3[e], (e, 1))
        moe.w2.weight_loader(moe.w2, w2[e], e)
    x, logits = torch.randn(T, H), torch.randn(T, E)
    logits[:, 5] = -1e4                     # an expert no token picks
    torch.testing.assert_close(moe(x, logits), _reference(x, logits, w1, w3, w2, k), rtol=1e-5, atol=1e-5)
