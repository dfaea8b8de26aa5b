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

Under decode context parallel (context_parallel.py) a rank writes only the positions it owns
(the others go to a sink slot no table reads), its context lengths count its own positions,
masks compare the global positions of its keys, and forward_partial returns each query's
partial output over those keys with its log-sum-exp, for the exact merge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from shardlm.attention.backend import AttentionBackend, LastLayerRows
from shardlm.attention.context_parallel import ContextShard


@dataclass
class AttentionBucket:
    token_index: torch.Tensor   # [B, Q] rows of the step's tokens (padding repeats a valid row)
    block_table: torch.Tensor   # [B, N] blocks of each sequence's context (padding: null block)
    context_lens: torch.Tensor  # [B] int64: tokens of context after this step (this rank's, under context parallel)
    is_decode: bool
    out_rows: torch.Tensor | None = None   # valid entries of token_index.flatten() (None: all)
    whole_step: bool = False               # token_index.flatten() is the step's rows 0..T-1 (no padding)
    # what the masks are made of, on first use (the CPU decode kernel needs none)
    query_pos: torch.Tensor | None = None  # [B, Q] position of each query (CPU)
    context: torch.Tensor | None = None    # [B] context_lens on CPU
    block_size: int = 0
    shard: ContextShard | None = None      # context parallel: the positions this rank holds
    key_offset: torch.Tensor | None = None  # [B] position of each sequence's first key column (None: 0)
    _additive: dict = field(default_factory=dict, repr=False)

    _windowed: dict = field(default_factory=dict, repr=False)

    @property
    def in_order(self) -> bool:
        """A decode bucket whose outputs are the step's rows 0..T-1, in order (a pure decode step)."""
        return self.is_decode and self.whole_step

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, Q, N * block_size]: True where a query may attend."""
        width = self.block_table.shape[1] * self.block_size
        kj = torch.arange(width)
        mask = ((self._key_pos[:, None, :] <= self.query_pos[:, :, None])
                & (kj[None, None, :] < self.context[:, None, None]))
        return mask.unsqueeze(1).to(self.block_table.device)

    @cached_property
    def _key_pos(self) -> torch.Tensor:
        """[B or 1, K]: the position of each key column (context parallel: the global positions
        this rank holds; a window group's table: from its first block kept)."""
        width = self.block_table.shape[1] * self.block_size
        pos = torch.arange(width) if self.shard is None else self.shard.positions(width)
        return pos[None, :] if self.key_offset is None else self.key_offset[:, None] + pos[None, :]

    def mask_for(self, window: int | None) -> torch.Tensor:
        """mask, where a sliding window of `window` keys (the query's own and the window - 1 before
        it, as transformers counts) also masks the older keys. Made once a step per window."""
        if window is None:
            return self.mask
        if window not in self._windowed:
            recent = self._key_pos[:, None, :] > self.query_pos[:, :, None] - window
            self._windowed[window] = self.mask & recent.unsqueeze(1).to(self.mask.device)
        return self._windowed[window]

    @cached_property
    def masked_out(self) -> torch.Tensor:
        """~mask, shaped [1, B, 1, N * block_size] (decode)."""
        return self.masked_out_for(None)

    def masked_out_for(self, window: int | None) -> torch.Tensor:
        return ~self.mask_for(window).view(1, self.block_table.shape[0], 1, -1)

    def additive_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """mask_for(window) as 0 / -inf in dtype, for kernels that take a bias (made once a step, not
        per layer)."""
        if (dtype, window) not in self._additive:
            mask = self.mask_for(window)
            self._additive[dtype, window] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                ~mask, float("-inf"))
        return self._additive[dtype, window]

    @cached_property
    def keyless(self) -> torch.Tensor:
        """[B, 1, Q]: queries with no key on this rank (context parallel: zeros and an LSE of -inf)."""
        return ~self.mask.any(dim=-1)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token's K/V
    buckets: list[AttentionBucket]
    pcp_counts: list[int] | None = None   # prefill context parallel: each PCP group's tokens this step
    pcp_own: slice | None = None          # ... and this group's among the gathered queries
    last_layer: LastLayerRows | None = None   # the rows the model's last layer finishes (None: all)


@dataclass
class ContextParallelStep:
    """What a prefill context parallel rank attends with besides the step's sequences: the row
    of each sequence's queries among the gathered ones, the (position, block table) of each
    token it computes (whose K/V it writes), and each PCP group's token count."""
    query_rows: list[list[int]]
    writes: list[tuple[int, list[int]]]
    pcp_counts: list[int]
    pcp_rank: int

    @property
    def own(self) -> slice:
        """This group's rows among the gathered queries."""
        first = sum(self.pcp_counts[:self.pcp_rank])
        return slice(first, first + self.pcp_counts[self.pcp_rank])


def build_attention_metadata(query_lens: list[int], start_positions: list[int], block_tables: list[list[int]],
                             block_size: int, device: torch.device, shard: ContextShard | None = None,
                             sink_slot: int = 0, pcp: ContextParallelStep | None = None,
                             prompt: list[bool] | None = None) -> AttentionMetadata:
    """shard: this rank's positions under context parallel (None: all); the positions of other
    ranks map to sink_slot. pcp: under prefill context parallel, where the queries are and which
    tokens' K/V this rank computed (None: the step's tokens, in order, are its queries and K/V).
    prompt: which sequences are attended as prompt chunks (None: those of several queries)."""
    offsets, t = [], 0
    for qlen in query_lens:
        offsets.append(t)
        t += qlen
    if pcp is not None:
        slot_mapping = [shard.slot(table, pos, sink_slot) for pos, table in pcp.writes]
    else:
        slot_mapping = []
        for qlen, start, table in zip(query_lens, start_positions, block_tables):
            if shard is None:
                slot_mapping.extend(table[pos // block_size] * block_size + pos % block_size
                                    for pos in range(start, start + qlen))
            else:
                slot_mapping.extend(shard.slot(table, pos, sink_slot) for pos in range(start, start + qlen))
    query_rows = pcp.query_rows if pcp is not None else None
    if prompt is None:
        prompt = [q > 1 for q in query_lens]
    decodes = [i for i, chunk in enumerate(prompt) if not chunk]
    prefills = [i for i, chunk in enumerate(prompt) if chunk]
    buckets = [_bucket(rows, query_lens, start_positions, block_tables, offsets, block_size, device, is_decode,
                       shard, query_rows) for rows, is_decode in ((decodes, True), (prefills, False)) if rows]
    return AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long, device=device), buckets,
                             *((pcp.pcp_counts, pcp.own) if pcp is not None else ()))


def _bucket(rows, query_lens, starts, tables, offsets, block_size, device, is_decode: bool, shard=None,
            query_rows: list[list[int]] | None = None) -> AttentionBucket:
    """query_rows: each sequence's rows in q (None: offsets[i] on, in order)."""
    qlens = torch.tensor([query_lens[i] for i in rows])
    start = torch.tensor([starts[i] for i in rows])
    ctx = start + qlens
    if shard is not None:
        ctx = torch.tensor([shard.local_len(n) for n in ctx.tolist()])
    max_q = int(qlens.max())
    # a sliding-window group's table begins with the null blocks its window has left (block 0 is
    # never a sequence's own first block): those columns are dropped, the keys start later
    skipped = [_leading_nulls(tables[i]) for i in rows]
    key_offset = None
    if any(skipped):
        tables = {i: tables[i][n:] for i, n in zip(rows, skipped)}
        key_offset = torch.tensor(skipped) * block_size
        ctx = ctx - key_offset
    max_blocks = max(len(tables[i]) for i in rows)
    table = torch.tensor([tables[i] + [0] * (max_blocks - len(tables[i])) for i in rows])

    qi = torch.arange(max_q)
    if query_rows is None:      # padding repeats a sequence's last row
        token_index = torch.tensor([offsets[i] for i in rows])[:, None] + torch.minimum(qi[None, :], qlens[:, None] - 1)
    else:
        token_index = torch.tensor([query_rows[i] + query_rows[i][-1:] * (max_q - len(query_rows[i])) for i in rows])
    out_rows = None
    if max_q > 1 and bool((qlens != max_q).any()):
        out_rows = (qi[None, :] < qlens[:, None]).flatten().nonzero().squeeze(1).to(device)
    whole_step = query_rows is None and len(rows) == len(query_lens) and out_rows is None
    return AttentionBucket(token_index.to(device), table.to(device), ctx.to(device), is_decode, out_rows, whole_step,
                           query_pos=start[:, None] + qi[None, :], context=ctx, block_size=block_size, shard=shard,
                           key_offset=key_offset)


def _leading_nulls(table: list[int]) -> int:
    n = 0
    while n < len(table) and table[n] == 0:
        n += 1
    return n


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def build_metadata(self, query_lens, start_positions, block_tables, pcp=None) -> AttentionMetadata:
        return build_attention_metadata(query_lens, start_positions, block_tables, self.block_size, self.device,
                                        self.shard, self.sink_slot, pcp)

    def build_rows_metadata(self, start_positions, block_tables, prompt) -> AttentionMetadata | None:
        if self.shard is not None:
            return None
        return build_attention_metadata([1] * len(start_positions), start_positions, block_tables, self.block_size,
                                        self.device, prompt=prompt)

    def forward(self, layer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        T = q.shape[0]
        self.write_kv(layer, k, v, meta)
        if len(meta.buckets) == 1 and meta.buckets[0].in_order:   # a pure decode step
            return self.decode(layer, q, meta.buckets[0]).view(T, -1)
        if len(meta.buckets) == 1 and meta.buckets[0].whole_step:   # prompts alike in length: no scatter
            return self.prefill(layer, q, meta.buckets[0]).reshape(T, -1)
        out = q.new_empty(T, layer.num_heads, layer.v_head_dim)
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

    def write_kv(self, layer, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        write_slots(layer.k_cache, meta.slot_mapping, k, layer.k_scale)
        if not layer.values_in_keys:
            write_slots(layer.v_cache, meta.slot_mapping, v, layer.v_scale)

    def forward_partial(self, layer, q, k, v, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Context parallel: k, v of this step written where this rank owns them; q [T, Hq, D]
        (the cp group's gathered queries) attended over this rank's positions.
        -> (partial output [T, Hq, D] float32, log-sum-exp [T, Hq] float32)"""
        self.write_kv(layer, k, v, meta)
        T, Hq = q.shape[:2]
        out = q.new_empty(T, Hq, layer.v_head_dim, dtype=torch.float32)
        lse = q.new_empty(T, Hq, dtype=torch.float32)
        for b in meta.buckets:
            if b.is_decode:
                ob, lb = self.decode_partial(layer, q[b.token_index[:, 0]], b)
            else:
                ob, lb = self.prefill_partial(layer, q, b)
            rows = b.token_index.flatten()
            if b.out_rows is not None:
                ob, lb, rows = ob[b.out_rows], lb[b.out_rows], rows[b.out_rows]
            out[rows], lse[rows] = ob, lb
        return out, lse

    def decode_partial(self, layer, q: torch.Tensor, b: AttentionBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Hq, D] -> (out [B, Hq, D] float32, lse [B, Hq])"""
        return decode_attention(layer, q, *gather(layer, b, q.dtype), b.masked_out_for(layer.sliding_window),
                                with_lse=True)

    def prefill_partial(self, layer, q: torch.Tensor, b: AttentionBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """q: the step's [T, Hq, D] -> (out [B * Q, Hq, D] float32, lse [B * Q, Hq])"""
        return prefill_partial(layer, q, b)

    def prefill(self, layer, q: torch.Tensor, b: AttentionBucket) -> torch.Tensor:
        """Sequences of several queries each: gathered context, one scaled_dot_product_attention
        (with logit soft-capping, which it lacks: the scores computed here, in float32)."""
        if layer.logit_softcap is not None:
            return prefill_partial(layer, q, b)[0].to(q.dtype)
        kb, vb = gather(layer, b, q.dtype)
        qb = q[b.token_index].transpose(1, 2)               # [B, H, Q, D]
        kb, vb = kb.transpose(0, 1), vb.transpose(0, 1)     # [B, Hkv, K, D]
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=b.mask_for(layer.sliding_window), scale=layer.scale,
                                            enable_gqa=layer.num_heads != layer.num_kv_heads)
        return ob.transpose(1, 2).reshape(-1, layer.num_heads, layer.v_head_dim)

    def decode(self, layer, q: torch.Tensor, b: AttentionBucket) -> torch.Tensor:
        """One query per sequence. q: [B, H, D] (rows may be strided) -> [B, H, D]"""
        return decode_attention(layer, q, *gather(layer, b, q.dtype), b.masked_out_for(layer.sliding_window))


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: float = 1.0) -> None:
    """rows [T, Hkv, D] into the cache's slots (a cache of another dtype, FP8: divided by its scale
    and converted; torch's index_copy has no FP8 kernel, so its bytes are copied)."""
    flat = cache.view(cache.shape[0], -1, cache.shape[-1])
    rows = rows.transpose(0, 1)
    if cache.dtype == rows.dtype:
        flat.index_copy_(1, slots, rows)
    else:
        stored = (rows if scale == 1.0 else rows / scale).to(cache.dtype)
        flat.view(torch.uint8).index_copy_(1, slots, stored.view(torch.uint8))


def widened(cache_rows: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if cache_rows.dtype == dtype:
        return cache_rows
    rows = cache_rows.to(dtype)
    return rows if scale == 1.0 else rows * scale


def gather(layer, b: AttentionBucket, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucket's K and V, [Hkv, B, K, D] and [Hkv, B, K, Dv] in dtype (an FP8 cache widened):
    whole blocks, in block-table order."""
    B, blocks = b.block_table.shape[0], b.block_table.flatten()
    kb = widened(layer.k_cache.index_select(1, blocks).view(layer.num_kv_heads, B, -1, layer.head_dim), dtype,
                  layer.k_scale)
    if layer.values_in_keys:
        return kb, kb[..., :layer.v_head_dim]
    vb = widened(layer.v_cache.index_select(1, blocks).view(layer.num_kv_heads, B, -1, layer.head_dim), dtype,
                  layer.v_scale)
    return kb, vb


def decode_attention(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     masked_out: torch.Tensor, with_lse: bool = False):
    """One query per sequence. q: [B, H, D]; k: [Hkv, B, K, D], v: [Hkv, B, K, Dv]; masked_out [1, B, 1, K]
    -> [B, H, Dv]; with_lse: -> (out [B, H, Dv] float32, log-sum-exp [B, H]), zeros and -inf where
    nothing is unmasked."""
    Hkv, B, K, D = k.shape
    H, Dv = q.shape[1], v.shape[-1]
    group = H // Hkv
    # query heads grouped by their KV head, batched over (KV head, sequence); scaled in the copy
    qg = torch.empty(Hkv, B, group, D, dtype=q.dtype, device=q.device)
    torch.mul(q.view(B, Hkv, group, D).transpose(0, 1), layer.scale, out=qg)
    scores = softcapped(layer, torch.bmm(qg.view(Hkv * B, group, D), k.view(Hkv * B, K, D).transpose(1, 2)).float())
    scores = scores.view(Hkv, B, group, K).masked_fill_(masked_out, float("-inf"))
    if with_lse:
        probs, lse = _softmax_lse(scores)
        out = torch.bmm(probs.view(Hkv * B, group, K), v.reshape(Hkv * B, K, Dv).float())
        return (out.view(Hkv, B, group, Dv).transpose(0, 1).reshape(B, H, Dv),
                lse.transpose(0, 1).reshape(B, H))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(Hkv * B, group, K)
    out = torch.bmm(probs, v.reshape(Hkv * B, K, Dv))                   # [Hkv * B, G, Dv]
    return out.view(Hkv, B, group, Dv).transpose(0, 1).reshape(B, H, Dv)


def softcapped(layer, scores: torch.Tensor) -> torch.Tensor:
    """Scaled scores soft-capped where the layer caps them (Gemma 2: cap * tanh(scores / cap))."""
    cap = layer.logit_softcap
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _softmax_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax and log-sum-exp over the last dim of float32 scores; a row of -inf only gives
    zeros and -inf (a context parallel rank that holds none of a query's context yet)."""
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    return probs, lse


# queries per piece of a partial prefill: its float32 scores stay within ~256 MiB
_PARTIAL_SCORE_BYTES = 256 << 20


def prefill_partial(layer, q: torch.Tensor, b: AttentionBucket) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt chunks with the scores at hand (under context parallel, and where logits are
    soft-capped): attention with its log-sum-exp, in float32, a piece of the queries at a time.
    q: the step's [T, Hq, D]. -> ([B * Q, Hq, D], [B * Q, Hq])"""
    kb, vb = gather(layer, b, q.dtype)                                # [Hkv, B, K, D], [Hkv, B, K, Dv]
    Hkv, B, K, D = kb.shape
    Dv = vb.shape[-1]
    qb = q[b.token_index]                                    # [B, Q, Hq, D]
    Q, Hq = qb.shape[1], qb.shape[2]
    group = Hq // Hkv
    kf = kb.float().transpose(0, 1).unsqueeze(2)             # [B, Hkv, 1, K, D]
    vf = vb.float().transpose(0, 1).unsqueeze(2)
    out = torch.empty(B, Q, Hq, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Q, Hq, dtype=torch.float32, device=q.device)
    step = max(1, _PARTIAL_SCORE_BYTES // (4 * B * Hq * K))
    for q0 in range(0, Q, step):
        qs = qb[:, q0:q0 + step].float() * layer.scale      # [B, q, Hq, D]
        n = qs.shape[1]
        qs = qs.view(B, n, Hkv, group, D).permute(0, 2, 3, 1, 4)           # [B, Hkv, G, q, D]
        scores = softcapped(layer, qs @ kf.transpose(-1, -2))              # [B, Hkv, G, q, K]
        scores.masked_fill_(~b.mask_for(layer.sliding_window)[:, :, q0:q0 + n].unsqueeze(1), float("-inf"))
        probs, piece_lse = _softmax_lse(scores)
        out[:, q0:q0 + n] = (probs @ vf).permute(0, 3, 1, 2, 4).reshape(B, n, Hq, Dv)
        lse[:, q0:q0 + n] = piece_lse.permute(0, 3, 1, 2).reshape(B, n, Hq)
    return out.view(B * Q, Hq, Dv), lse.view(B * Q, Hq)
