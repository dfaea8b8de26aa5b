"""The attention layer: one per decoder layer. It holds that layer's slice of the paged KV
cache (bound by the model runner) and attends through the engine's attention backend
(shardlm/attention/), chosen once for the device and dtype."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.attention.backend import AttentionBackend


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache: torch.Tensor | None = None   # layout: backend.kv_cache_shape(), bound by the runner
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]"""
        return self.backend.forward(self, q, k, v, meta)
