"""Paged attention over a KV cache laid out as slots: [num_blocks * block_size, kv_heads, head_dim].

One forward step runs every scheduled token at once. Tokens are grouped into two buckets,
decodes (one query each) and prefill chunks (many queries each); per bucket, the keys and
values of every sequence's context are gathered through its block table into a padded
[batch, context, heads, dim] tensor and one scaled_dot_product_attention call does the rest.
Padding reads the null block (block 0), never stale memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionBucket:
    token_index: torch.Tensor   # [B, Q] rows of the step's tokens (padding repeats a valid row)
    kv_slots: torch.Tensor      # [B, K] cache slots of each sequence's context (padding: null slot)
    mask: torch.Tensor          # [B, 1, Q, K] True where a query may attend
    out_rows: torch.Tensor | None = None   # valid entries of token_index.flatten() (None: all)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token's K/V
    buckets: list[AttentionBucket]


def build_attention_metadata(query_lens: list[int], start_positions: list[int], block_tables: list[list[int]],
                             block_size: int, device: torch.device) -> AttentionMetadata:
    offsets, slot_mapping, t = [], [], 0
    for qlen, start, table in zip(query_lens, start_positions, block_tables):
        offsets.append(t)
        t += qlen
        for pos in range(start, start + qlen):
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    prefills = [i for i, q in enumerate(query_lens) if q > 1]
    buckets = [_bucket(rows, query_lens, start_positions, block_tables, offsets, block_size, device)
               for rows in (decodes, prefills) if rows]
    return AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long, device=device), buckets)


def _bucket(rows, query_lens, starts, tables, offsets, block_size, device) -> AttentionBucket:
    qlens = torch.tensor([query_lens[i] for i in rows])
    start = torch.tensor([starts[i] for i in rows])
    ctx = start + qlens
    max_q, max_k = int(qlens.max()), int(ctx.max())
    max_blocks = max(len(tables[i]) for i in rows)
    table = torch.tensor([tables[i] + [0] * (max_blocks - len(tables[i])) for i in rows])

    qi = torch.arange(max_q)
    token_index = torch.tensor([offsets[i] for i in rows])[:, None] + torch.minimum(qi[None, :], qlens[:, None] - 1)
    kj = torch.arange(max_k)
    blocks = table.gather(1, (kj // block_size).clamp(max=max_blocks - 1).expand(len(rows), -1))
    kv_slots = torch.where(kj[None, :] < ctx[:, None], blocks * block_size + kj % block_size, 0)
    q_pos = start[:, None] + qi[None, :]                                   # [B, Q]
    mask = (kj[None, None, :] <= q_pos[:, :, None]) & (kj[None, None, :] < ctx[:, None, None])
    out_rows = None
    if max_q > 1 and bool((qlens != max_q).any()):
        out_rows = (qi[None, :] < qlens[:, None]).flatten().nonzero().squeeze(1).to(device)
    return AttentionBucket(token_index.to(device), kv_slots.to(device), mask.unsqueeze(1).to(device), out_rows)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache: torch.Tensor | None = None   # bound by the model runner
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]"""
        T = q.shape[0]
        self.k_cache.index_copy_(0, meta.slot_mapping, k)
        self.v_cache.index_copy_(0, meta.slot_mapping, v)
        out = q.new_empty(T, self.num_heads, self.head_dim)
        for b in meta.buckets:
            qb = q[b.token_index].transpose(1, 2)               # [B, H, Q, D]
            kb = self.k_cache[b.kv_slots].transpose(1, 2)       # [B, Hkv, K, D]
            vb = self.v_cache[b.kv_slots].transpose(1, 2)
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=b.mask, scale=self.scale,
                                                enable_gqa=self.num_heads != self.num_kv_heads)
            ob = ob.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
            rows = b.token_index.flatten()
            if b.out_rows is not None:
                ob, rows = ob[b.out_rows], rows[b.out_rows]
            out[rows] = ob
        return out.view(T, -1)
