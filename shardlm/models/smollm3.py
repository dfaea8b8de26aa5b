"""SmolLM3 (Hugging Face)."""

from __future__ import annotations

import dataclasses

from shardlm.models.llama import LlamaForCausalLM, LlamaVariant


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama with no rotary embedding on every fourth layer (config.no_rope_layers[i] is 0
    there; with use_sliding_window, those layers attend within a window)."""

    def make_variant(self, config) -> LlamaVariant:
        nope = frozenset(i for i, rope in enumerate(config.no_rope_layers) if not rope)
        return dataclasses.replace(super().make_variant(config), nope_layers=nope)
