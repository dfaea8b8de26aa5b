"""A linear layer's LoRA slots on the device, and the grouped product that adds the adapters'
deltas to its output.

Each slot holds one adapter's A and B for this layer, as this rank's slice: a merged layer
(qkv_proj, gate_up_proj) has one A per shard stacked ([shards x max_rank, in]) and B
block-diagonal ([out, shards x max_rank]), so one adapter costs two matmuls however many of its
projections it targets. Ranks below max_rank are zero-padded.

Per step, the tokens of each adapter form a segment (the runner orders requests by adapter):
delta = (x[seg] A^T) B^T, added to out[seg] (Punica's and S-LoRA's segmented product). All
segments go through two batched matmuls, over views where they are equally long, else over a
padded gather: on CPU that beat a matmul pair per segment by 2-3x, and one dense matmul over every
slot with a mask too (measured in docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import torch

from shardlm.layers.cpu_matmul import blocked, prepare_weight
from shardlm.lora import batch as lora_batch

# up to this many adapters in a step, each one's rows go through the blocked kernel on their
# own; more go through torch's batched matmuls (bench lora-layer: 4 at 16 rows each, 76 vs 49 us)
MAX_SEGMENTS_ONE_BY_ONE = 2


class LoRASlots:
    def __init__(self, layer, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.layer = layer
        self.max_rank = max_rank
        in_features, out_features = layer.lora_dims()
        width = layer.lora_num_shards() * max_rank
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_features, width, dtype=dtype, device=device)
        self.a_t, self.b_t = self.a.transpose(1, 2), self.b.transpose(1, 2)    # as the products read them
        # CPU: each slot's A and B also in the blocked kernel's panels, for one adapter's rows
        self.packed: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots

    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def set(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's weights for this layer in `slot`: parts = {shard: (A, B)}, whole
        (this rank's slice is cut here); shards it does not target stay zero."""
        self.clear(slot)
        for shard, (a, b) in parts.items():
            a, b, out_offset = self.layer.lora_slice(shard, a, b)
            cols = slice(shard * self.max_rank, shard * self.max_rank + a.shape[0])
            self.a[slot, cols] = a.to(self.a.dtype)
            self.b[slot, out_offset:out_offset + b.shape[0], cols] = b.to(self.b.dtype)
        packed = [prepare_weight(w[slot]) for w in (self.a, self.b)]
        if all(plan is not None and plan.blocked for _, plan in packed):
            self.packed[slot] = (packed[0][0], packed[1][0])

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.packed[slot] = None

    def _add_one(self, slot: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += one adapter's delta for rows x: through the blocked kernel where the slot is
        packed (a third of torch's time at 1-16 rows: its bfloat16 matmul costs ~15 us a call)."""
        packed = self.packed[slot]
        if packed is None:
            out.addmm_(x @ self.a_t[slot], self.b_t[slot])
        else:
            out.add_(blocked(blocked(x, packed[0], None, self.a.shape[1]), packed[1], None, out.shape[1]))

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += each token's adapter delta (tokens of the base model get none)."""
        batch = lora_batch.current()
        if batch is None:
            return out
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if batch.whole is not None:
            self._add_one(batch.whole, x2, out2)
            return out
        if len(batch.segments) <= MAX_SEGMENTS_ONE_BY_ONE and self.packed[batch.segments[0][0]] is not None:
            for slot, start, end in batch.segments:
                self._add_one(slot, x2[start:end], out2[start:end])
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
