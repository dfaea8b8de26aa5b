"""The custom logits processors on the rank that samples (logits_processor.py has their
interface): made once, told each step how the batch changed, and split into the two groups the
sampler runs at their two places."""

from __future__ import annotations

import torch

from shardlm.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality


def batch_update(slots: list[str | None], order: list[str], added_info) -> tuple[BatchUpdate | None, list[str]]:
    """The BatchUpdate that takes the processors' batch from `slots` (request ids by index) to
    `order` (this step's rows), as vLLM's persistent batch makes them: new requests fill free
    indices, requests past the new size move down into holes, then swaps put each in its row.
    added_info(req_id) -> (params, prompt ids, output ids) of a new request.
    -> (None where nothing changed, the new slots)."""
    n, wanted = len(order), set(order)
    cur = list(slots) + [None] * max(0, n - len(slots))
    removed = [i for i, r in enumerate(cur) if r is not None and r not in wanted]
    for i in removed:
        cur[i] = None
    holes = [i for i in range(n) if cur[i] is None]
    target = {r: i for i, r in enumerate(order)}
    added, moved = [], []
    present = {r for r in cur if r is not None}

    def take_hole(prefer: int) -> int:
        i = prefer if prefer in holes else holes[0]
        holes.remove(i)
        return i

    for r in order:
        if r not in present:
            i = take_hole(target[r])
            cur[i] = r
            added.append((i, *added_info(r)))
    for i in range(n, len(cur)):          # survivors past the new size: down into the holes
        if cur[i] is not None:
            j = take_hole(target[cur[i]])
            cur[j], cur[i] = cur[i], None
            moved.append((i, j, MoveDirectionality.UNIDIRECTIONAL))
    cur = cur[:n]
    for i in range(n):                    # every index now holds one of the step's requests
        if cur[i] != order[i]:
            j = cur.index(order[i])
            cur[i], cur[j] = cur[j], cur[i]
            moved.append((i, j, MoveDirectionality.SWAP))
    if not (removed or added or moved) and len(slots) == n:
        return None, cur
    return BatchUpdate(n, removed, added, moved), cur


class CustomLogitsProcessors:
    def __init__(self, classes: list[type[LogitsProcessor]], config, device: torch.device):
        self.processors = []
        for cls in classes:
            try:
                self.processors.append(cls(config, device, device.type == "cuda"))
            except Exception as e:      # noqa: BLE001 - whatever it raises, the user must see it named
                raise ValueError(f"Logits processor {cls.__module__}.{cls.__qualname__} failed to start: "
                                 f"{type(e).__name__}: {e}") from e
        self.slots: list[str | None] = []

    @property
    def names(self) -> str:
        return ", ".join(type(p).__name__ for p in self.processors)

    def prepare(self, req_ids: list[str], requests: dict) -> tuple[list, list]:
        """Tell every processor how the batch changed (row i: req_ids[i]) -> (the processors run
        first, on every row; those run after temperature, on random rows)."""
        def info(r):
            state = requests[r]
            return state.sampling_params, state.prompt_token_ids, state.output_token_ids
        update, self.slots = batch_update(self.slots, req_ids, info)
        for p in self.processors:
            p.update_state(update)
        invariant = [p.is_argmax_invariant() for p in self.processors]
        return ([p for p, inv in zip(self.processors, invariant) if not inv],
                [p for p, inv in zip(self.processors, invariant) if inv])
