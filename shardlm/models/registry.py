"""Hugging Face architecture name -> shardlm model class."""

from __future__ import annotations

from shardlm.models.llama import (
    GraniteForCausalLM,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    SmolLM3ForCausalLM,
)
from shardlm.models.mixtral import MixtralForCausalLM
from shardlm.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
}


def resolve_architecture(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return arch
    raise ValueError(f"Model architecture(s) {archs or '(none in config.json)'} are not supported. "
                     f"Supported architectures: {', '.join(sorted(MODEL_REGISTRY))}.")


def get_model_class(architecture: str):
    return MODEL_REGISTRY[architecture]
