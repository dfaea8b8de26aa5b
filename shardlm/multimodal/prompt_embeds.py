"""Prompts given as embeddings (--enable-prompt-embeds, as vLLM's): a [tokens, hidden] tensor the
text model takes in place of its token embeddings. The engine schedules and caches such a prompt
as tokens (placeholder id 0, one per row); its one item carries the tensor to the first stage."""

from __future__ import annotations

import base64
import binascii
import io
import pickle

import torch

from shardlm.messages import MultiModalItem
from shardlm.multimodal.processing import as_tensor_data, content_hash

PLACEHOLDER_ID = 0       # what the engine sees in such a prompt's token ids


def checked(embeds, hidden_size: int) -> torch.Tensor:
    """embeds as [tokens, hidden]: a ValueError unless it is [tokens, hidden] (or [1, tokens,
    hidden]) of finite floating point values."""
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch tensor, not {type(embeds).__name__}.")
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[0] == 0 or embeds.shape[1] != hidden_size:
        raise ValueError(f"prompt_embeds has shape {tuple(embeds.shape)}: give [tokens, {hidden_size}] (the model's "
                         "hidden size), at least one token.")
    if not embeds.is_floating_point() or not bool(torch.isfinite(embeds).all()):
        raise ValueError("prompt_embeds must be finite floating point values.")
    return embeds


def prompt_embeds_item(embeds, hidden_size: int, dtype: torch.dtype) -> tuple[list[int], MultiModalItem]:
    """-> the prompt's placeholder token ids and its item (embeds: as checked() takes them)."""
    embeds = checked(embeds, hidden_size)
    data = {"embeds": as_tensor_data(embeds.detach().to("cpu", dtype))}
    return [PLACEHOLDER_ID] * embeds.shape[0], MultiModalItem("embeds", 0, embeds.shape[0], content_hash(data), data)


def decode_base64(value: str) -> torch.Tensor:
    """One of /v1/completions' prompt_embeds: base64 of torch.save(tensor), read without
    unpickling code (torch.load's weights_only)."""
    try:
        raw = base64.b64decode(value, validate=True)
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except (binascii.Error, ValueError, RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise ValueError(f"prompt_embeds: not base64 of a torch.save'd tensor ({type(e).__name__}).") from None
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"prompt_embeds: the saved object is a {type(tensor).__name__}, not a tensor.")
    return tensor
