"""Token embedding and LM head split by vocabulary rows across the tensor parallel group.

The vocabulary is padded to a multiple of tp; rank r holds rows [r * V/tp, (r + 1) * V/tp).
Embedding: each rank looks up the ids in its range (zeros elsewhere) and an all-reduce sums the
parts. LM head: each rank computes the logits of its rows; they are gathered on the group's
first rank, which samples (the other ranks get None).

A GGUF model run in its own quantization (`--quantization gguf`) keeps a Q8_0 table as it is
(8-bit blocked panels): the LM head multiplies it directly, and an embedding lookup dequantizes
its rows (the float values the default float conversion computes, bit for bit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.distributed.parallel_state import get_tp_group
from shardlm.layers.cpu_matmul import CpuMatmul, blocked_rows, linear, prepare_weight
from shardlm.layers.linear import checkpoint_shape, read_checkpoint
from shardlm.layers.quantization import QuantizedWeight
from shardlm.layers.sampler import ArgmaxRows, apply_allowed


class VocabParallelEmbedding(nn.Module):
    # on CPU: the weight's layout (cpu_matmul.py); the embedding's own is plain, a tied LM head's
    # packed one is shared with it
    cpu_matmul: CpuMatmul | None = None
    quant: QuantizedWeight | None = None     # a quantized table (take_quantized): the weight is then None

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // self.tp.world_size)
        self.start = self.tp.rank_in_group * self.rows_per_rank
        self.end = self.start + self.rows_per_rank          # may pass vocab_size: padding rows
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        vocab, hidden = checkpoint_shape(loaded)
        if vocab != self.vocab_size or hidden != param.shape[1]:
            raise ValueError(f"Checkpoint embedding has shape {(vocab, hidden)}, the model expects "
                             f"{(self.vocab_size, param.shape[1])}: the config does not match the weights.")
        real = max(0, min(self.end, vocab) - self.start)
        param.data[real:].zero_()
        param.data[:real].copy_(read_checkpoint(loaded, 0, self.start, real))

    def take_quantized(self, parts: list[tuple]) -> None:
        """parts: [(q, scales, mins, bits)] of the whole table (from a GGUF file); this rank's rows
        are kept quantized where they go into 8-bit panels, whose rows a lookup reads directly
        (else the float table loaded before stays)."""
        q, scales, mins, bits = parts[0]
        if tuple(q.shape) != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"A quantized vocabulary table of shape {tuple(q.shape)}, the model expects "
                             f"{(self.vocab_size, self.weight.shape[1])}: the quantized file does not match the "
                             "config.")
        real = max(0, min(self.end, self.vocab_size) - self.start)

        def mine(t: torch.Tensor) -> torch.Tensor:     # this rank's rows, zero rows for the padding
            rows = torch.cat([t[self.start:self.start + real], t.new_zeros(self.rows_per_rank - real, t.shape[1])])
            return rows.to(self.weight.device)
        quant = QuantizedWeight(mine(q), mine(scales), mine(mins), bits, self.weight.dtype, measure=False)
        if quant.kernel == "blocked8":
            self.quant, self.weight = quant, None

    def _lookup(self, rows: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.rows(rows)
        if self.cpu_matmul is not None and self.cpu_matmul.blocked:
            return blocked_rows(self.weight, self.cpu_matmul, rows)
        return F.embedding(rows, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(input_ids)
        local = (input_ids >= self.start) & (input_ids < self.end)
        out = self._lookup((input_ids - self.start) * local)
        out.mul_(local.unsqueeze(-1).to(out.dtype))
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary; with tied embeddings it shares the embedding's weight slice."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.argmax_rows = ArgmaxRows()
        # the embedding this head is tied to (tie()). Set here, not as a class attribute: nn.Module
        # keeps a module attribute in its _modules, which a class-level default would shadow
        self.tied_to: VocabParallelEmbedding | None = None

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight, self.tied_to = embedding.weight, embedding

    def share_tied_table(self) -> None:
        """After the tied embedding was offered a quantized table: hold what it holds (one copy)."""
        if self.tied_to.quant is not None:
            self.quant, self.weight = self.tied_to.quant, None

    def process_weights_after_loading(self) -> None:
        if self.quant is not None:
            return
        packed, self.cpu_matmul = prepare_weight(self.weight.data)
        if self.tied_to is not None and packed is not None and not self.cpu_matmul.blocked:
            packed = None       # a oneDNN copy would be a second table: both read the plain one
        if packed is not None:
            self.weight = nn.Parameter(packed, requires_grad=False)
            if self.tied_to is not None and self.cpu_matmul.blocked:
                # the embedding looks its rows up in the packed weight: one copy of the table
                # (a second would push a small model's weights out of the last-level cache)
                self.tied_to.weight, self.tied_to.cpu_matmul = self.weight, self.cpu_matmul

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over this rank's vocabulary shard (its padding rows included)."""
        if self.quant is not None:
            return self.quant.matmul(hidden)
        return linear(hidden, self.weight, None, self.cpu_matmul)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full logits [T, vocab_size] on the group's first rank, None on the others."""
        logits = self.tp.gather(self._local_logits(hidden), dst=0, dim=-1)
        return logits[:, :self.vocab_size] if logits is not None else None

    def greedy(self, hidden: torch.Tensor, allowed=None) -> list[int] | None:
        """The argmax token of each row, on the group's first rank (None on the others): each rank
        sends only its rows' (max, index) instead of its [T, V/tp] logits. Equal to argmax of the
        full logits, ties included: the first maximum of the first rank that has it. allowed:
        structured outputs' bitmask for the shard starting at a token (a function of it), or None."""
        local = self._local_logits(hidden)[:, :max(0, min(self.end, self.vocab_size) - self.start)]
        if allowed is not None:
            local = apply_allowed(local, allowed(self.start))
        index = self.argmax_rows(local)
        best = local.gather(1, index[:, None])[:, 0].float()
        pairs = torch.stack([best, (index + self.start).float()], dim=1)     # ids < 2^24: exact in float32
        gathered = self.tp.gather(pairs, dst=0, dim=0)
        if gathered is None:
            return None
        per_rank = gathered.view(self.tp.world_size, -1, 2)
        winner = per_rank[..., 0].argmax(dim=0)                             # first rank with the maximum
        return per_rank[winner, torch.arange(per_rank.shape[1]), 1].long().tolist()
