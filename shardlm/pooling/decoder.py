"""Decoder models as embedders and classifiers: the family's decoder unchanged (causal attention,
paged KV cache, tensor parallel), without the LM head; the pooler reads the final hidden states
(the last token's, by default).

    as_embedding_model(cls)      --convert embed: e.g. Qwen3-Embedding, GTE-Qwen2 (checkpoints of a
                                 ...ForCausalLM; their LM head is not loaded)
    as_classification_model(cls) ...ForSequenceClassification checkpoints (a `score` matrix over
                                 the hidden states: rerankers such as mxbai-rerank, reward models)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def _on_this_stage(model, name: str, base) -> bool:
    """Without an LM head the final norm still belongs to the last stage (the base class ties
    the two)."""
    if name.startswith("model.norm."):
        return model.model.norm is not None
    return base(name)


def as_embedding_model(cls: type) -> type:
    class EmbeddingModel(cls):
        is_encoder = False
        pooling_task = "embed"
        default_pooling_type = "LAST"

        def __init__(self, config, max_position, dtype, layer_range=None):
            super().__init__(config, max_position, dtype, layer_range)
            self.lm_head = None

        def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
            return pooled

        def _on_this_stage(self, name: str) -> bool:
            return _on_this_stage(self, name, super()._on_this_stage)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return super().load_weights((n, t) for n, t in weights if not n.startswith(("lm_head.", "score.")))

    EmbeddingModel.__name__ = EmbeddingModel.__qualname__ = f"{cls.__name__.removesuffix('ForCausalLM')}EmbeddingModel"
    return EmbeddingModel


def as_classification_model(cls: type) -> type:
    class ClassificationModel(cls):
        is_encoder = False
        pooling_task = "classify"
        default_pooling_type = "LAST"

        def __init__(self, config, max_position, dtype, layer_range=None):
            super().__init__(config, max_position, dtype, layer_range)
            self.lm_head = None
            self.score = nn.Linear(config.hidden_size, getattr(config, "num_labels", 1), bias=False)

        def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
            return self.score(pooled.to(self.score.weight.dtype))

        def _on_this_stage(self, name: str) -> bool:
            return _on_this_stage(self, name, super()._on_this_stage)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            loaded = set()

            def decoder_tensors():
                for name, tensor in weights:
                    if name.startswith("score."):
                        self.score.weight.data.copy_(tensor[:] if not isinstance(tensor, torch.Tensor) else tensor)
                        loaded.add("score.weight")
                    elif not name.startswith("lm_head."):
                        yield name, tensor
            return super().load_weights(decoder_tensors()) | loaded

    ClassificationModel.__name__ = ClassificationModel.__qualname__ = \
        f"{cls.__name__.removesuffix('ForCausalLM')}ForSequenceClassification"
    return ClassificationModel
