"""Which tokens of a step run on which adapter slot. The model runner builds one LoRABatch per
step and sets it for the forward pass; each LoRA layer reads it (so model code passes nothing)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class LoRABatch:
    """groups: (slot, token indices) per adapter in the step; `whole` is the slot when every token
    of the step runs on one adapter (no gather needed), else None."""
    groups: list[tuple[int, torch.Tensor]]
    whole: int | None = None

    @classmethod
    def of_chunks(cls, slots: list[int], token_counts: list[int], device: torch.device) -> LoRABatch | None:
        """slots: each chunk's slot (-1: the base model), token_counts: each chunk's tokens, in
        the step's order. None when no token runs on an adapter."""
        if all(s < 0 for s in slots):
            return None
        if len(set(slots)) == 1:
            return cls([], whole=slots[0])
        rows: dict[int, list[int]] = {}
        start = 0
        for slot, n in zip(slots, token_counts):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(start, start + n))
            start += n
        return cls([(slot, torch.tensor(idx, dtype=torch.long, device=device)) for slot, idx in rows.items()])


_current: LoRABatch | None = None


@contextmanager
def running(batch: LoRABatch | None):
    """The step's batch, for the LoRA layers of the forward pass inside."""
    global _current
    previous, _current = _current, batch
    try:
        yield
    finally:
        _current = previous


def current() -> LoRABatch | None:
    return _current
