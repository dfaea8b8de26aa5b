"""Custom logits processors that tests load by name into engines (worker processes import them
from here), written against vLLM v1's interface as a user would write them."""

import torch

from shardlm.logits_processor import AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, move_entries


class TargetTokenProcessor(LogitsProcessor):
    """vLLM's example: a request with extra_args {"target_token": t} can only write t."""

    @classmethod
    def validate_params(cls, sampling_params):
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and (isinstance(target, bool) or not isinstance(target, int) or target < 0):
            raise ValueError(f"target_token={target!r}: give a token id (a non-negative integer).")

    def __init__(self, vllm_config, device, is_pin_memory):
        self.vocab_size = vllm_config.model.vocab_size
        self.targets: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.targets.pop(index, None)
        for index, params, _, _ in batch_update.added:
            target = (params.extra_args or {}).get("target_token")
            if target is None:
                self.targets.pop(index, None)
            else:
                self.targets[index] = target
        move_entries(self.targets, batch_update.moved)
        assert all(i < batch_update.batch_size for i in self.targets), (self.targets, batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, target in self.targets.items():
            keep = logits[index, target].clone()
            logits[index] = float("-inf")
            logits[index, target] = keep
        return logits


def counting_up(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
    """Token 100 + (tokens written so far): reads the live list of the request's output."""
    out = torch.full_like(row, float("-inf"))
    out[100 + len(output_ids)] = 0.0
    return out


class CountingAdapter(AdapterLogitsProcessor):
    """Per-request processors through the adapter: extra_args {"count": true} writes 100, 101, ..."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        return counting_up if (params.extra_args or {}).get("count") else None


class RaisingProcessor(LogitsProcessor):
    """Raises in apply for a request with extra_args {"boom": true}."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.boom: set[int] = set()

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update):
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.boom.discard(index)
        for index, params, _, _ in batch_update.added:
            (self.boom.add if (params.extra_args or {}).get("boom") else self.boom.discard)(index)
        entries = dict.fromkeys(self.boom, True)
        move_entries(entries, batch_update.moved)
        self.boom = set(entries)

    def apply(self, logits):
        if self.boom:
            raise RuntimeError("boom")
        return logits


class BrokenAtStart(RaisingProcessor):
    def __init__(self, vllm_config, device, is_pin_memory):
        raise RuntimeError("no such vocabulary file")


class NotAProcessor:
    pass
