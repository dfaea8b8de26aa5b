"""Decoder models as embedders and classifiers: the family's decoder unchanged (causal attention,
paged KV cache, tensor parallel), without the LM head; the pooler reads the final hidden states
(the last token's, by default). Any decoder with shardlm's model interface and a drop_lm_head():
shardlm's own (models/llama.py) and the Transformers backend's (models/transformers_backend.py).

    as_embedding_model(cls)      --convert embed: e.g. Qwen3-Embedding, GTE-Qwen2 (checkpoints of a
                                 ...ForCausalLM; their LM head is not loaded)
    as_classification_model(cls) ...ForSequenceClassification checkpoints (a `score` matrix over
                                 the hidden states: rerankers such as mxbai-rerank, reward models)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def _pooling_decoder(cls: type, task: str, name: str, make_score: bool) -> type:
    """cls without its LM head, pooling its final hidden states (the last token's by default);
    make_score: a `score` matrix [num_labels, hidden] read from the checkpoint as the head."""

    class PoolingDecoder(cls):
        is_encoder = False
        pooling_task = task
        default_pooling_type = "LAST"

        def __init__(self, config, max_position, dtype, layer_range=None):
            super().__init__(config, max_position, dtype, layer_range)
            self.drop_lm_head()
            self.score = nn.Linear(config.hidden_size, getattr(config, "num_labels", 1), bias=False) \
                if make_score else None

        def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
            return pooled if self.score is None else self.score(pooled.to(self.score.weight.dtype))

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            loaded, vocab_rows = set(), {}
            from_tokens = getattr(self.config, "classifier_from_token_ids", None) if self.score is not None else None

            def decoder_tensors():
                for tensor_name, tensor in weights:
                    if from_tokens and tensor_name in ("lm_head.weight", "model.embed_tokens.weight"):
                        vocab_rows[tensor_name] = _whole(tensor)[from_tokens]
                    if tensor_name.startswith("score.") and self.score is not None:
                        self.score.weight.data.copy_(_whole(tensor))
                        loaded.add("score.weight")
                    elif not tensor_name.startswith(("lm_head.", "score.")):
                        yield tensor_name, tensor
            loaded |= super().load_weights(decoder_tensors())
            if from_tokens:     # the LM head's rows of those tokens (a tied head: the embedding's)
                rows = vocab_rows.get("lm_head.weight", vocab_rows.get("model.embed_tokens.weight"))
                self.score.weight.data.copy_(rows[1:] - rows[:1] if len(from_tokens) == 2 else rows)
                loaded.add("score.weight")
            return loaded

    PoolingDecoder.__name__ = PoolingDecoder.__qualname__ = f"{cls.__name__.removesuffix('ForCausalLM')}{name}"
    return PoolingDecoder


def as_embedding_model(cls: type) -> type:
    return _pooling_decoder(cls, "embed", "EmbeddingModel", make_score=False)


def as_classification_model(cls: type) -> type:
    return _pooling_decoder(cls, "classify", "ForSequenceClassification", make_score=True)


def _whole(tensor) -> torch.Tensor:
    """A checkpoint tensor read whole (safetensors slices are read on indexing)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
