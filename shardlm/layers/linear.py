"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

A checkpoint may store one matrix as several (q_proj, k_proj, v_proj; gate_proj, up_proj);
the merged layers here hold them as one matrix for one large matmul, and each parameter's
`weight_loader(param, tensor, shard_id)` copies a checkpoint tensor into its place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"Checkpoint tensor has shape {tuple(loaded.shape)}, "
                         f"the model expects {tuple(param.shape)}: the config does not match the weights.")
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        for p in self.parameters():
            p.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several output matrices stacked: shard_id k fills rows of output_sizes[k]."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.output_sizes = output_sizes

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            return default_weight_loader(param, loaded)
        start, size = self.offsets[shard_id], self.output_sizes[shard_id]
        default_weight_loader(param.data.narrow(0, start, size), loaded)


class QKVLinear(MergedLinear):
    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)

    def weight_loader(self, param, loaded, shard_id=None):
        super().weight_loader(param, loaded, self._SHARDS.get(shard_id, shard_id))
