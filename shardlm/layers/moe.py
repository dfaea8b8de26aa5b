"""The fused mixture-of-experts layer the MoE models share.

Experts are stored stacked: `w13` [E, 2 x I/tp, H] (gate and up, one matmul per expert) and
`w2` [E, H, I/tp]. With tensor parallel every expert's intermediate dimension is split across
the TP ranks (as vLLM does by default); each rank computes its slice for every token and the
usual all-reduce sums them.

Dispatch has no loop over tokens: the (token, expert) pairs are sorted by expert once per step,
each active expert runs its tokens as one matmul, and the results are weighted and summed back
into their tokens with one index_add.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.distributed.parallel_state import get_tp_group
from shardlm.layers.linear import load_slice


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True):
        super().__init__()
        tp = get_tp_group()
        if intermediate_size % tp.world_size:
            raise ValueError(f"The experts' intermediate size {intermediate_size} is not divisible by tensor "
                             f"parallel size {tp.world_size}.")
        self.tp = tp
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.inter = intermediate_size // tp.world_size            # this rank's slice of every expert
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter), requires_grad=False)
        self.w13.weight_loader = self._load_w13
        self.w2.weight_loader = self._load_w2

    # ---- loading: shard_id = (expert, 0 for gate / 1 for up) for w13, expert for w2 ----
    def _load_w13(self, param, loaded, shard_id) -> None:
        expert, half = shard_id
        rank = self.tp.rank_in_group
        load_slice(param.data[expert].narrow(0, half * self.inter, self.inter), loaded, 0, rank * self.inter,
                   self.inter)

    def _load_w2(self, param, loaded, shard_id) -> None:
        load_slice(param.data[shard_id], loaded, 1, self.tp.rank_in_group * self.inter, self.inter)

    # ---- forward ----
    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax over the experts, top-k, optionally renormalised: (weights, expert ids), [T, k]."""
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(router_logits)
        flat = ids.flatten()
        order = flat.argsort(stable=True)             # (token, expert) pairs grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x[tokens]
        pair_weights = weights.flatten()[order].to(x.dtype).unsqueeze(1)
        results = torch.empty_like(xs)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            gate_up = xs[start:start + n] @ self.w13[expert].t()
            act = F.silu(gate_up[:, :self.inter]) * gate_up[:, self.inter:]
            results[start:start + n] = act @ self.w2[expert].t()
            start += n
        out = torch.zeros_like(x).index_add_(0, tokens, results * pair_weights)
        return self.tp.all_reduce(out)


def expert_checkpoint_name(name: str, pattern: re.Pattern, gate: str, up: str) -> tuple[str, object] | None:
    """A checkpoint's per-expert tensor (`pattern` captures the expert id and which matrix) as
    (stacked parameter, shard id) of this layer under `<layer>.mlp.experts`; None for other tensors."""
    found = pattern.search(name)
    if not found:
        return None
    expert, which, layer = int(found.group(1)), found.group(2), name[:found.start()]
    if which in (gate, up):
        return f"{layer}.mlp.experts.w13", (expert, 0 if which == gate else 1)
    return f"{layer}.mlp.experts.w2", expert
