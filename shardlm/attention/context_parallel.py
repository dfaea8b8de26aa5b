"""Decode context parallel (-dcp N): each sequence's KV cache spread over N ranks by position.

The N ranks of a DCP group are adjacent ranks of one tensor parallel group that hold the same
KV heads (tp replicates KV heads when it exceeds them). Instead of each storing every position,
rank r stores the positions whose interleave-sized chunk falls to it:

    owner(p) = (p // I) % N          (I: --dcp-kv-cache-interleave-size, default 1)

One block id covers N * block_size positions (a "virtual block": what the scheduler, prefix
hashes and capacity count); on every rank the same block id holds that rank's block_size of
them, in position order. So a sequence's local keys are a prefix of its block table, read by
the unchanged paged kernels with a local context length.

At attention each rank gathers the group's query heads, attends over its own positions and
returns a partial output with its log-sum-exp per head; the partials merge exactly:

    out = sum_r exp(lse_r - lse) * out_r,    lse = log sum_r exp(lse_r)

A rank with no position of a sequence yet returns zeros and lse = -inf (weight 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm import kernels


@dataclass(frozen=True)
class ContextShard:
    """This rank's share of every sequence's positions."""
    size: int           # N: ranks of the DCP group
    rank: int           # this rank in it
    interleave: int     # I: consecutive positions on one rank
    block_size: int     # positions per block id on one rank

    @property
    def virtual_block(self) -> int:
        return self.block_size * self.size

    def owns(self, pos: int) -> bool:
        return (pos // self.interleave) % self.size == self.rank

    def local_index(self, pos: int) -> int:
        """Where an owned position lies among this rank's positions of its sequence."""
        run, within = divmod(pos, self.interleave)
        return (run // self.size) * self.interleave + within

    def local_len(self, num_tokens: int) -> int:
        """How many of positions 0..num_tokens-1 this rank holds."""
        span = self.interleave * self.size
        full, rest = divmod(num_tokens, span)
        return full * self.interleave + min(max(rest - self.rank * self.interleave, 0), self.interleave)

    def slot(self, table: list[int], pos: int, sink: int) -> int:
        """The cache slot of position pos on this rank (`sink`, a slot no table reads, when
        another rank owns it)."""
        if not self.owns(pos):
            return sink
        i = self.local_index(pos)
        return table[i // self.block_size] * self.block_size + i % self.block_size

    def positions(self, num_local: int) -> torch.Tensor:
        """The positions of a sequence's first num_local local entries (key positions for masks)."""
        i = torch.arange(num_local)
        return (i // self.interleave) * self.interleave * self.size + self.rank * self.interleave + i % self.interleave


def merge_partials(out: torch.Tensor, lse: torch.Tensor, group, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's heads of the exact attention output, from every DCP rank's partial.

    out: [T, N * num_heads, D] float32 (attention of the group's query heads over this rank's
    positions), lse: [T, N * num_heads] float32. One all-gather carries both; each rank then
    merges its own num_heads heads. -> [T, num_heads * D] in dtype. On CPU the C kernel merges
    (the one the one-call decode step uses, so both paths give the same bits)."""
    T, heads, D = out.shape
    packed = torch.cat([out.reshape(T, heads * D), lse], dim=1)
    every = group.all_gather(packed.unsqueeze(0), dim=0)                  # [N, T, heads * (D + 1)]
    first = group.rank_in_group * num_heads
    kernel = kernels.merge_attention_partials() if every.device.type == "cpu" else None
    if kernel is not None and dtype in kernels.DTYPE_CODES:
        merged = torch.empty(T, num_heads * D, dtype=dtype)
        kernel(every.data_ptr(), group.world_size, T, heads, D, first, num_heads, merged.data_ptr(),
               kernels.DTYPE_CODES[dtype])
        return merged
    outs = every[:, :, :heads * D].view(-1, T, heads, D)[:, :, first:first + num_heads]
    lses = every[:, :, heads * D:][:, :, first:first + num_heads]
    return merge(outs, lses).to(dtype).view(T, -1)


def merge(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs [N, T, H, D], lses [N, T, H] -> [T, H, D]: the partials weighted by their share of
    the softmax mass. A query sees at least its own position, so some lse is finite."""
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total)                                      # -inf -> 0
    return (outs * weights.unsqueeze(-1)).sum(dim=0)
