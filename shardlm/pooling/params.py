"""PoolingParams: what a pooling request wants back (vLLM's names). Validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, replace

INT64_MAX = 2**63 - 1      # what a message carries (msgspec): larger ints are refused here, not there

# task -> what the result is
POOLING_TASKS = {
    "embed": "one vector per prompt",
    "classify": "class probabilities per prompt",
    "score": "a relevance score per (query, document) pair (a cross-encoder's classify)",
    "token_embed": "one vector per token",
    "token_classify": "class probabilities per token",
}


@dataclass
class PoolingParams:
    """task: embed, classify, score, token_embed or token_classify (None: the model's first).
    dimensions: keep the first n dims of an embedding (Matryoshka models only), before normalizing.
    normalize: embeddings to unit length (None: the model's default, True for most embedders).
    use_activation: softmax / sigmoid over class logits (None: on).
    truncate_prompt_tokens: keep this many tokens of a longer prompt (-1: max_model_len); without
    it a prompt longer than max_model_len is refused."""
    task: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"Unknown pooling task {self.task!r}: use one of {', '.join(POOLING_TASKS)}.")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or not 1 <= self.dimensions <= INT64_MAX):
            raise ValueError(f"dimensions={self.dimensions!r} must be a positive integer (at most 2^63 - 1).")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1) or t > INT64_MAX):
            raise ValueError(f"truncate_prompt_tokens={t!r} must be a positive integer (at most 2^63 - 1) or -1 "
                             "(max_model_len).")

    def clone(self, **changes) -> PoolingParams:
        return replace(self, **changes)
