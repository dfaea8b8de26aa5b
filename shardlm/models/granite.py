"""IBM Granite 3.x."""

from __future__ import annotations

import dataclasses

from shardlm.models.llama import LlamaForCausalLM, LlamaVariant


class GraniteForCausalLM(LlamaForCausalLM):
    """IBM Granite 3.x: Llama with four multipliers from the config (attention scale, residual
    branches, embeddings, logits)."""

    def make_variant(self, config) -> LlamaVariant:
        return dataclasses.replace(super().make_variant(config), attention_scale=config.attention_multiplier,
                                   residual_multiplier=config.residual_multiplier,
                                   embedding_multiplier=config.embedding_multiplier,
                                   logits_scaling=config.logits_scaling)
