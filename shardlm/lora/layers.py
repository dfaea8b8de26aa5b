"""A linear layer's LoRA slots on the device, and the grouped product that adds the adapters'
deltas to its output.

Each slot holds one adapter's A and B for this layer, as this rank's slice: a merged layer
(qkv_proj, gate_up_proj) has one A per shard stacked ([shards x max_rank, in]) and B
block-diagonal ([out, shards x max_rank]), so one adapter costs two matmuls however many of its
projections it targets. Ranks below max_rank are zero-padded.

Per step, the tokens of each adapter form a segment (the runner orders requests by adapter):
delta = (x[seg] A^T) B^T, added to out[seg] (Punica's and S-LoRA's segmented product). On CPU
each slot is also kept in the blocked kernel's panels and each segment is two blocked products
(in C, inside the one-call decode step, for decode steps); elsewhere all segments go through two
batched torch matmuls, over views where they are equally long, else over a padded gather, which
beat a torch matmul pair per segment by 2-3x and one dense matmul over every slot with a mask
(measured in docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import torch

from shardlm.layers.cpu_matmul import blocked, goes_into_panels, pack_blocked
from shardlm.lora import batch as lora_batch

# Segments of up to this many rows (decode steps) go through the blocked kernel, in C inside the
# one-call decode step, where torch's bfloat16 matmul costs ~15 us a call; longer ones (prefill)
# through torch's batched matmuls, twice as fast there (bench lora-layer, 4 adapters of 128 rows
# each: qkv 155 vs 328 us).
PANEL_MAX_ROWS = 64


class LoRASlots:
    changes = 0      # bumped whenever a slot of any layer changes (the one-call decode step caches on it)

    def __init__(self, layer, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.layer = layer
        self.max_rank = max_rank
        in_features, out_features = layer.lora_dims()
        width = layer.lora_num_shards() * max_rank
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_features, width, dtype=dtype, device=device)
        self.a_t, self.b_t = self.a.transpose(1, 2), self.b.transpose(1, 2)    # as the products read them
        # CPU: each slot's A and B also in the blocked kernel's panels, for one adapter's rows;
        # () where the slot's adapter leaves this layer alone (nothing to add), None where not packed
        self.panels = goes_into_panels(self.a[0])
        self.packed: list[tuple | None] = [()] * num_slots

    def nbytes(self) -> int:
        """The slots' memory: A and B, twice where they are kept in panels too (CPU)."""
        return (self.a.nbytes + self.b.nbytes) * (2 if self.panels else 1)

    def set(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's weights for this layer in `slot`: parts = {shard: (A, B)}, whole
        (this rank's slice is cut here); shards it does not target stay zero."""
        self.clear(slot)
        for shard, (a, b) in parts.items():
            a, b, out_offset = self.layer.lora_slice(shard, a, b)
            cols = slice(shard * self.max_rank, shard * self.max_rank + a.shape[0])
            self.a[slot, cols] = a.to(self.a.dtype)
            self.b[slot, out_offset:out_offset + b.shape[0], cols] = b.to(self.b.dtype)
        self.packed[slot] = (pack_blocked(self.a[slot]), pack_blocked(self.b[slot])) if self.panels else None
        LoRASlots.changes += 1

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.packed[slot] = ()
        LoRASlots.changes += 1

    def in_panels(self, batch: lora_batch.LoRABatch) -> bool:
        """Whether the step's segments go through the blocked kernel: every slot in its panels and
        no segment longer than PANEL_MAX_ROWS (the one-call decode step asks the same)."""
        return all(end - start <= PANEL_MAX_ROWS and self.packed[slot] is not None
                   for slot, start, end in batch.segments)

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += each token's adapter delta (tokens of the base model get none)."""
        batch = lora_batch.current()
        if batch is None:
            return out
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if self.in_panels(batch):
            for slot, start, end in batch.segments:
                if self.packed[slot]:      # () where this adapter leaves the layer alone
                    a, b = self.packed[slot]
                    out2[start:end] += blocked(blocked(x2[start:end], a, None, self.a.shape[1]), b, None,
                                               out2.shape[1])
            return out
        if batch.whole is not None:
            out2.addmm_(x2 @ self.a_t[batch.whole], self.b_t[batch.whole])
            return out
        a_t, b_t = (self.a_t, self.b_t) if batch.slot_ids is None else \
            (self.a_t[batch.slot_ids], self.b_t[batch.slot_ids])
        adapters = len(batch.segments)
        if batch.rows is None:          # equal segments covering the step: views, no copies
            xa = torch.bmm(x2.view(adapters, -1, x2.shape[1]), a_t)
            out2.view(adapters, -1, out2.shape[1]).baddbmm_(xa, b_t)
            return out
        delta = torch.bmm(torch.bmm(x2[batch.rows], a_t), b_t)
        for g, (_, start, end) in enumerate(batch.segments):
            out2[start:end] += delta[g, :end - start]
        return out
