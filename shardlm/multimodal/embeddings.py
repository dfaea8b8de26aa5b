"""A step's image embeddings, handed to the text model: rows of the step's tokens whose token
embedding an image's takes the place of. Set around the model's forward on the first pipeline
stage (worker/model_runner.py); a model that reads images merges them right after embedding its
tokens (models/llama.py: LlamaModel.forward)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm.multimodal.processing import as_tensor
from shardlm.utils import StepValue


@dataclass
class StepEmbeddings:
    rows: torch.Tensor       # [R] long: which of the step's (this rank's) tokens
    values: torch.Tensor     # [R, hidden]: their embeddings


_step = StepValue()
running = _step.running      # running(step_embeddings): set around the step's forward pass


def current() -> StepEmbeddings | None:
    return _step.value


def merge(hidden: torch.Tensor) -> torch.Tensor:
    """The token embeddings with this step's image embeddings in their rows."""
    given = _step.value
    if given is None:
        return hidden
    hidden = hidden.clone()
    hidden[given.rows] = given.values.to(hidden.dtype)
    return hidden


def of_step(batch, requests: dict, encoder, image_token: int | None, device: torch.device) -> StepEmbeddings | None:
    """The rows of this rank's tokens in `batch` (worker/step_builder.StepBatch) whose embeddings
    are given: image placeholders (their image's embeddings, in order) and prompt embeddings. An
    image is encoded the first time one of its placeholders is scheduled and kept until its last
    one is (a prompt split across steps reads it again; a request preempted before then has it
    encoded again). requests: the worker's RequestStates; encoder: the vision encoder (None for
    a text model, whose prompts may be embeddings)."""
    rows: list[int] = []
    values: list[torch.Tensor] = []
    offset = 0
    for c in batch.chunks:
        state = requests[c.req_id]
        end = c.start_pos + len(c.token_ids)
        for k, item in enumerate(state.mm_items or ()):
            first, last = max(c.start_pos, item.offset), min(end, item.offset + item.length)
            if first >= last:
                continue
            given = state.given_embeddings
            if k not in given:        # read or encoded once, dropped once its last position is scheduled
                given[k] = (as_tensor(item.tensors["embeds"]).to(device) if item.modality == "embeds"
                            else encoder.encode(item))
            if item.modality == "embeds":       # every position of the range: its own row of the tensor
                positions, done = list(range(first, last)), first - item.offset
            else:   # an image's n-th placeholder takes its n-th embedding (tokens between its tiles: their own)
                ids = state.prompt_token_ids
                positions = [p for p in range(first, last) if ids[p] == image_token]
                done = sum(1 for p in range(item.offset, first) if ids[p] == image_token)
            rows.extend(offset + p - c.start_pos for p in positions)
            values.append(given[k][done:done + len(positions)])
            if last == item.offset + item.length:
                del given[k]
        offset += len(c.token_ids)
    if not rows:
        return None
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    values_t = torch.cat(values) if len(values) > 1 else values[0]
    if batch.pcp is not None:       # prefill context parallel: this group's share of the step's tokens
        mine_of = torch.full((len(batch.input_ids),), -1, dtype=torch.long, device=device)
        mine_of[torch.tensor(batch.pcp.mine, dtype=torch.long, device=device)] = torch.arange(
            len(batch.pcp.mine), device=device)
        kept = mine_of[rows_t] >= 0
        if not bool(kept.any()):
            return None
        rows_t, values_t = mine_of[rows_t][kept], values_t[kept]
    return StepEmbeddings(rows_t, values_t)
