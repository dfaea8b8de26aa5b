"""A step's image embeddings, handed to the text model: rows of the step's tokens whose token
embedding an image's takes the place of. Set around the model's forward on the first pipeline
stage (worker/model_runner.py); a model that reads images merges them right after embedding its
tokens (models/llama.py: LlamaModel.forward)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class StepEmbeddings:
    rows: torch.Tensor       # [R] long: which of the step's (this rank's) tokens
    values: torch.Tensor     # [R, hidden]: their embeddings


_current: StepEmbeddings | None = None


@contextlib.contextmanager
def running(step: StepEmbeddings | None):
    global _current
    _current, before = step, _current
    try:
        yield
    finally:
        _current = before


def merge(hidden: torch.Tensor) -> torch.Tensor:
    """The token embeddings with this step's image embeddings in their rows."""
    if _current is None:
        return hidden
    hidden = hidden.clone()
    hidden[_current.rows] = _current.values.to(hidden.dtype)
    return hidden


def of_step(batch, requests: dict, encoder, image_token: int, device: torch.device) -> StepEmbeddings | None:
    """The rows of this rank's tokens in `batch` (worker/step_builder.StepBatch) that are image
    placeholders, and their images' embeddings. An image is encoded the first time one of its
    placeholders is scheduled and kept until its last one is (a prompt split across steps reads
    it again; a request preempted before then has it encoded again). requests: the worker's
    RequestStates."""
    rows, values, offset = [], [], 0
    for c in batch.chunks:
        state = requests[c.req_id]
        end = c.start_pos + len(c.token_ids)
        for k, item in enumerate(state.mm_items or ()):
            first, last = max(c.start_pos, item.offset), min(end, item.offset + item.length)
            if first >= last:
                continue
            if k not in state.image_features:
                state.image_features[k] = encoder.encode(item)
            ids = state.prompt_token_ids
            # an image's n-th placeholder token takes its n-th embedding (tokens between its rows: their own)
            index = sum(1 for p in range(item.offset, first) if ids[p] == image_token)
            for p in range(first, last):
                if ids[p] == image_token:
                    rows.append(offset + p - c.start_pos)
                    values.append(state.image_features[k][index])
                    index += 1
            if last == item.offset + item.length:       # its last placeholder: no step reads it again
                del state.image_features[k]
        offset += len(c.token_ids)
    if batch.pcp is not None:       # prefill context parallel: this group's share of the step's tokens
        mine = {row: i for i, row in enumerate(batch.pcp.mine)}
        kept = [(mine[r], v) for r, v in zip(rows, values) if r in mine]
        rows, values = [r for r, _ in kept], [v for _, v in kept]
    if not rows:
        return None
    return StepEmbeddings(torch.tensor(rows, dtype=torch.long, device=device), torch.stack(values))
