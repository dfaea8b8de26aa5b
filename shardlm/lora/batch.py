"""Which tokens of a step run on which adapter slot. The model runner orders a step's requests
by adapter, so each adapter's tokens are one contiguous segment; it builds one LoRABatch per step
and sets it for the forward pass, and each LoRA layer reads it (model code passes nothing)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm.utils import StepValue


@dataclass
class LoRABatch:
    """segments: (slot, first token, end) of each adapter of the step; tokens
    outside them run on the base model. For one batched matmul over the adapters, `rows` gathers
    each segment's tokens padded to the longest (with its own first token); None when the
    segments are equally long and cover the step, so the tokens are a [G, length] view as they
    are. `whole`: the slot when every token of the step runs on one adapter."""
    segments: list[tuple[int, int, int]]
    whole: int | None = None
    slot_ids: torch.Tensor | None = None       # [G]; None when they are all the slots, in order
    rows: torch.Tensor | None = None           # [G, longest segment]

    @classmethod
    def of_chunks(cls, slots: list[int], token_counts: list[int], num_slots: int,
                  device: torch.device) -> LoRABatch | None:
        """slots: each chunk's slot (-1: the base model), ordered so that equal slots are
        adjacent; token_counts: each chunk's tokens. None when no token runs on an adapter."""
        if all(s < 0 for s in slots):
            return None
        if len(set(slots)) == 1:
            return cls([(slots[0], 0, sum(token_counts))], whole=slots[0])
        segments: list[tuple[int, int, int]] = []
        start = 0
        for slot, n in zip(slots, token_counts):
            if slot >= 0:
                if segments and segments[-1][0] == slot and segments[-1][2] == start:
                    segments[-1] = (slot, segments[-1][1], start + n)
                else:
                    segments.append((slot, start, start + n))
            start += n
        order = [s for s, _, _ in segments]
        if len(set(order)) != len(order):
            raise ValueError(f"a step's chunks of one adapter must be adjacent (slots {slots})")
        batch = cls(segments)
        if order != list(range(num_slots)):
            batch.slot_ids = torch.tensor(order, dtype=torch.long, device=device)
        lengths = {e - s for _, s, e in segments}
        if len(lengths) > 1 or segments[0][1] != 0 or segments[-1][2] != start:
            longest = max(lengths)
            batch.rows = torch.tensor([[min(s + i, e - 1) for i in range(longest)] for _, s, e in segments],
                                      dtype=torch.long, device=device)
        return batch


_step = StepValue()
running = _step.running      # running(batch): the step's batch, for the LoRA layers of the forward pass inside


def current() -> LoRABatch | None:
    return _step.value
