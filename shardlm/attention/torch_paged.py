"""The torch attention backend: paged attention over a KV cache of blocks, head-major
[kv_heads, num_blocks, block_size, head_dim], with torch ops only (any device).

One forward step runs every scheduled token at once. Tokens are grouped into two buckets,
decodes (one query each) and prefill chunks (many queries each). Per bucket, the blocks of
every sequence are gathered through its block table into a padded [batch, context, heads,
dim] tensor (whole blocks with index_select: few large copies; head-major so that decode
attention is two plain batched matmuls over kv_heads x batch with no further copy), and
the bucket is attended in one go: decodes by those matmuls, prefills by
scaled_dot_product_attention (memory-efficient for long prompts). Masked positions get exactly
zero weight; padding reads the null block (block 0), and the cache starts zeroed, so no stale
memory is ever a NaN.

The CPU backend (cpu_kernel.py) replaces its decode bucket with a C kernel; the CUDA backend
(cuda.py) keeps its decode metadata in preallocated device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from shardlm.attention.backend import AttentionBackend


@dataclass
class AttentionBucket:
    token_index: torch.Tensor   # [B, Q] rows of the step's tokens (padding repeats a valid row)
    block_table: torch.Tensor   # [B, N] blocks of each sequence's context (padding: null block)
    context_lens: torch.Tensor  # [B] int64: tokens of context after this step
    is_decode: bool
    out_rows: torch.Tensor | None = None   # valid entries of token_index.flatten() (None: all)
    in_order: bool = False                 # the bucket's outputs are the step's rows 0..T-1, in order
    # what the masks are made of, on first use (the CPU decode kernel needs none)
    query_pos: torch.Tensor | None = None  # [B, Q] position of each query (CPU)
    context: torch.Tensor | None = None    # [B] context_lens on CPU
    block_size: int = 0

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, Q, N * block_size]: True where a query may attend."""
        kj = torch.arange(self.block_table.shape[1] * self.block_size)
        mask = (kj[None, None, :] <= self.query_pos[:, :, None]) & (kj[None, None, :] < self.context[:, None, None])
        return mask.unsqueeze(1).to(self.block_table.device)

    @cached_property
    def masked_out(self) -> torch.Tensor:
        """~mask, shaped [1, B, 1, N * block_size] (decode)."""
        return ~self.mask.view(1, self.block_table.shape[0], 1, -1)


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
    max_q = int(qlens.max())
    max_blocks = max(len(tables[i]) for i in rows)
    table = torch.tensor([tables[i] + [0] * (max_blocks - len(tables[i])) for i in rows])

    qi = torch.arange(max_q)
    token_index = torch.tensor([offsets[i] for i in rows])[:, None] + torch.minimum(qi[None, :], qlens[:, None] - 1)
    out_rows = None
    if max_q > 1 and bool((qlens != max_q).any()):
        out_rows = (qi[None, :] < qlens[:, None]).flatten().nonzero().squeeze(1).to(device)
    in_order = len(rows) == len(query_lens) and max_q == 1
    return AttentionBucket(token_index.to(device), table.to(device), ctx.to(device), max_q == 1, out_rows, in_order,
                           query_pos=start[:, None] + qi[None, :], context=ctx, block_size=block_size)


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def build_metadata(self, query_lens, start_positions, block_tables) -> AttentionMetadata:
        return build_attention_metadata(query_lens, start_positions, block_tables, self.block_size, self.device)

    def forward(self, layer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        T, Hkv, D = q.shape[0], layer.num_kv_heads, layer.head_dim
        layer.k_cache.view(Hkv, -1, D).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        layer.v_cache.view(Hkv, -1, D).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        if len(meta.buckets) == 1 and meta.buckets[0].in_order:   # a pure decode step
            return self.decode(layer, q, meta.buckets[0]).view(T, -1)
        out = q.new_empty(T, layer.num_heads, D)
        for b in meta.buckets:
            if b.is_decode:
                ob = self.decode(layer, q[b.token_index[:, 0]], b)
            else:
                ob = self.prefill(layer, q, b)
            rows = b.token_index.flatten()
            if b.out_rows is not None:
                ob, rows = ob[b.out_rows], rows[b.out_rows]
            out[rows] = ob
        return out.view(T, -1)

    def prefill(self, layer, q: torch.Tensor, b: AttentionBucket) -> torch.Tensor:
        """Sequences of several queries each: gathered context, one scaled_dot_product_attention."""
        kb, vb = gather(layer, b)
        qb = q[b.token_index].transpose(1, 2)               # [B, H, Q, D]
        kb, vb = kb.transpose(0, 1), vb.transpose(0, 1)     # [B, Hkv, K, D]
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=b.mask, scale=layer.scale,
                                            enable_gqa=layer.num_heads != layer.num_kv_heads)
        return ob.transpose(1, 2).reshape(-1, layer.num_heads, layer.head_dim)

    def decode(self, layer, q: torch.Tensor, b: AttentionBucket) -> torch.Tensor:
        """One query per sequence. q: [B, H, D] (rows may be strided) -> [B, H, D]"""
        return decode_attention(layer, q, *gather(layer, b), b.masked_out)


def gather(layer, b: AttentionBucket) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucket's K and V, [Hkv, B, K, D]: whole blocks, in block-table order."""
    B, blocks = b.block_table.shape[0], b.block_table.flatten()
    kb = layer.k_cache.index_select(1, blocks).view(layer.num_kv_heads, B, -1, layer.head_dim)
    vb = layer.v_cache.index_select(1, blocks).view(layer.num_kv_heads, B, -1, layer.head_dim)
    return kb, vb


def decode_attention(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     masked_out: torch.Tensor) -> torch.Tensor:
    """One query per sequence. q: [B, H, D]; k, v: [Hkv, B, K, D]; masked_out [1, B, 1, K] -> [B, H, D]"""
    Hkv, B, K, D = k.shape
    group = layer.num_heads // Hkv
    # query heads grouped by their KV head, batched over (KV head, sequence); scaled in the copy
    qg = torch.empty(Hkv, B, group, D, dtype=q.dtype, device=q.device)
    torch.mul(q.view(B, Hkv, group, D).transpose(0, 1), layer.scale, out=qg)
    scores = torch.bmm(qg.view(Hkv * B, group, D), k.view(Hkv * B, K, D).transpose(1, 2)).float()
    scores = scores.view(Hkv, B, group, K).masked_fill_(masked_out, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(Hkv * B, group, K)
    out = torch.bmm(probs, v.view(Hkv * B, K, D))                       # [Hkv * B, G, D]
    return out.view(Hkv, B, group, D).transpose(0, 1).reshape(B, layer.num_heads, D)
