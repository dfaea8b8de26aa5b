"""Score and rerank: how a query and its documents become pooling requests, and their results a
score. A cross-encoder (a classifier) reads each pair as one prompt (the tokenizer's pair form:
`[CLS] query [SEP] document [SEP]`, the document's tokens in segment 1) and its class
probability is the score; an embedder embeds each text once and scores a pair by the cosine of
the two embeddings. Shared by LLM.score and the server's /score and /rerank."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def score_pairs(data_1, data_2) -> list[tuple]:
    """One text against N (1 -> N) or N against N (pairwise) -> the (first, second) pairs."""
    first = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
    second = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
    if not first or not second:
        raise ValueError("Scoring needs at least one text on each side.")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise ValueError(f"Scoring pairs one text with N, or N texts with N: got {len(first)} and {len(second)}.")
    return list(zip(first, second))


def cross_encoder_prompt(tokenizer, first, second, truncate_to: int | None = None) -> dict:
    """One (query, document) pair as a cross-encoder prompt: token ids and their segments.
    truncate_to: at most this many tokens (the longer text is cut first)."""
    if not isinstance(first, str) or not isinstance(second, str):
        raise ValueError("A cross-encoder scores pairs of texts: give strings, not token ids.")
    cut = {"truncation": "longest_first", "max_length": truncate_to} if truncate_to else {}
    encoded = tokenizer(first, second, **cut)
    prompt = {"prompt_token_ids": list(encoded.input_ids)}
    if encoded.get("token_type_ids") is not None:
        prompt["token_type_ids"] = list(encoded["token_type_ids"])
    return prompt


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()
