"""Hugging Face architecture name -> shardlm model class."""

from __future__ import annotations

from shardlm.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from shardlm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from shardlm.models.gpt_oss import GptOssForCausalLM
from shardlm.models.granite import GraniteForCausalLM
from shardlm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from shardlm.models.mixtral import MixtralForCausalLM
from shardlm.models.olmo2 import Olmo2ForCausalLM
from shardlm.models.phi3 import Phi3ForCausalLM
from shardlm.models.qwen3 import Qwen3ForCausalLM
from shardlm.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from shardlm.models.smollm3 import SmolLM3ForCausalLM

MODEL_REGISTRY = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "GptOssForCausalLM": GptOssForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
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


# checkpoints of a multimodal model that run as their language model (config.text_config)
TEXT_MODEL_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration"}


def language_model_config(hf_config, architecture: str):
    """The config the model class is built from: a multimodal checkpoint's text_config (with its
    architecture named), else the config itself."""
    if architecture not in TEXT_MODEL_OF_MULTIMODAL:
        return hf_config
    text = hf_config.get_text_config()
    text.architectures = [architecture]
    return text


def get_model_class(architecture: str):
    return MODEL_REGISTRY[architecture]
