"""Context parallel: each sequence's KV cache spread over N ranks by position.

Decode context parallel (-dcp D): adjacent ranks of one tensor parallel group that hold the same
KV heads (tp replicates KV heads when it exceeds them) each store a share of the positions.
Prefill context parallel (-pcp P): P tensor parallel groups per stage, each computing the
tokens whose positions fall to it (a long prompt's prefill split P ways) and keeping their KV.
Together the N = P x D ranks holding one KV head's positions form the cp group; rank r of it
(pcp rank r // D, dcp rank r % D) stores the positions whose interleave-sized run falls to it:

    owner(p) = (p // I) % N          (I: --dcp-kv-cache-interleave-size, default 1)

One block id covers N * block_size positions (a "virtual block": what the scheduler, prefix
hashes and capacity count); on every rank the same block id holds that rank's block_size of
them, in position order. So a sequence's local keys are a prefix of its block table, read by
the unchanged paged kernels with a local context length.

At attention each rank gathers the cp group's queries (the DCP ranks' heads, the PCP ranks'
tokens), attends over its own positions and returns a partial output with its log-sum-exp per
head; the partials merge exactly:

    out = sum_r exp(lse_r - lse) * out_r,    lse = log sum_r exp(lse_r)

A rank with no position of a sequence yet returns zeros and lse = -inf (weight 0). No K/V
moves between ranks: a token's K/V is computed by its PCP group and stored by its owner there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm import kernels


@dataclass(frozen=True)
class ContextShard:
    """This rank's share of every sequence's positions."""
    size: int           # N: ranks of the cp group (dcp x pcp)
    rank: int           # this rank in it (pcp rank x dcp + dcp rank)
    interleave: int     # I: consecutive positions on one rank
    block_size: int     # positions per block id on one rank
    dcp: int = 1        # ranks of the cp group in one TP group (the rest are other PCP groups)

    def owns(self, pos: int) -> bool:
        return (pos // self.interleave) % self.size == self.rank

    def pcp_owner(self, pos: int) -> int:
        """The prefill context parallel group that computes position pos."""
        return (pos // self.interleave) % self.size // self.dcp

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


def gather_queries(q: torch.Tensor, group, dcp: int, counts: list[int] | None) -> torch.Tensor:
    """The step's queries of every cp rank, [sum(counts), dcp * H, D]: PCP group by PCP group
    (its tokens), each token with the DCP ranks' heads side by side. q: this rank's [T, H, D];
    counts: the tokens of each PCP group (None: one group, every rank has the step's tokens)."""
    T, H, D = q.shape
    if counts is None:
        return group.all_gather(q, dim=1)
    padded = q.new_zeros(max(counts), H * D)
    padded[:T] = q.reshape(T, H * D)
    every = group.all_gather(padded.unsqueeze(0), dim=0).view(len(counts), dcp, -1, H * D).transpose(1, 2)
    return torch.cat([every[p, :n] for p, n in enumerate(counts)]).view(-1, dcp * H, D)


def merge_partials(out: torch.Tensor, lse: torch.Tensor, group, num_heads: int, first: int, dtype: torch.dtype,
                   rows: slice | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's heads of the exact attention output, from every cp rank's partial.

    out: [T, Hall, D] float32 (attention of the gathered queries over this rank's positions),
    lse: [T, Hall] float32. One all-gather carries both; each rank then merges its own
    num_heads heads (from head `first`) of its own rows (None: all). -> [rows, num_heads * D]
    in dtype. On CPU the C kernel merges (the one the one-call decode step uses, so both paths
    give the same bits). sinks: a logit per head of this rank (GPT-OSS), which the softmax runs
    over beside the keys with a value of zero: one more partial, of output 0 and log-sum-exp
    its logit."""
    T, heads, D = out.shape
    packed = torch.cat([out.reshape(T, heads * D), lse], dim=1)
    every = group.all_gather(packed.unsqueeze(0), dim=0)                  # [N, T, heads * (D + 1)]
    if rows is not None:
        every = every[:, rows].contiguous()
        T = every.shape[1]
    kernel = kernels.merge_attention_partials() if every.device.type == "cpu" and sinks is None else None
    if kernel is not None and dtype in kernels.DTYPE_CODES:
        merged = torch.empty(T, num_heads * D, dtype=dtype)
        kernel(every.data_ptr(), group.world_size, T, heads, D, first, num_heads, merged.data_ptr(),
               kernels.DTYPE_CODES[dtype])
        return merged
    outs = every[:, :, :heads * D].view(group.world_size, T, heads, D)[:, :, first:first + num_heads]
    lses = every[:, :, heads * D:][:, :, first:first + num_heads]
    if sinks is not None:
        outs = torch.cat([outs, outs.new_zeros(1, *outs.shape[1:])])
        lses = torch.cat([lses, sinks.float().expand(1, T, num_heads)])
    return merge(outs, lses).to(dtype).view(T, num_heads * D)      # (T may be 0: a group without tokens)


def merge(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs [N, T, H, D], lses [N, T, H] -> [T, H, D]: the partials weighted by their share of
    the softmax mass. A query sees at least its own position, so some lse is finite."""
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total)                                      # -inf -> 0
    return (outs * weights.unsqueeze(-1)).sum(dim=0)
