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
from shardlm.pooling.bert import (
    BertForSequenceClassification,
    BertModel,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)
from shardlm.pooling.decoder import as_classification_model, as_embedding_model

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


# architectures that only pool (the pooling runner's; pooling/): encoders, and decoder classifiers
POOLING_REGISTRY = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaModel": XLMRobertaModel,
    "RobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "XLMRobertaModel": XLMRobertaModel,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    **{f"{family}ForSequenceClassification": as_classification_model(MODEL_REGISTRY[f"{family}ForCausalLM"])
       for family in ("Llama", "Mistral", "Qwen2", "Qwen3")},
}


# --model-impl (vLLM's choices; vllm names shardlm's own models)
MODEL_IMPLS = ("auto", "shardlm", "vllm", "transformers")


def resolve_architecture(hf_config, model_impl: str = "auto") -> tuple[str, str]:
    """-> (the architecture, the implementation that runs it: "shardlm" or "transformers").
    auto: shardlm's own model where it has one, else transformers' (transformers_backend.py)."""
    from shardlm.models.transformers_backend import can_run
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"--model-impl {model_impl!r}: give {', '.join(MODEL_IMPLS)}.")
    archs = getattr(hf_config, "architectures", None) or []
    if model_impl != "transformers":
        for arch in archs:
            if arch in MODEL_REGISTRY or arch in POOLING_REGISTRY:
                return arch, "shardlm"
    if model_impl in ("auto", "transformers"):
        for arch in archs:
            if can_run(arch):
                return arch, "transformers"
    fallback = (" nor a causal LM transformers runs through its attention interface (--model-impl transformers)"
                if model_impl != "shardlm" and model_impl != "vllm" else "")
    raise ValueError(f"Model architecture(s) {archs or '(none in config.json)'} are not supported{fallback}. "
                     f"Supported architectures: {', '.join(sorted(MODEL_REGISTRY))}; pooling (embeddings, "
                     f"classes, scores): {', '.join(sorted(POOLING_REGISTRY))}; and, with the Transformers backend, "
                     "the other causal LMs of transformers whose attention goes through its interface.")


def is_pooling_architecture(architecture: str) -> bool:
    """Encoders and sequence classifiers (shardlm's, or a causal LM family's on the Transformers backend)."""
    return architecture in POOLING_REGISTRY or architecture.endswith("ForSequenceClassification")


# checkpoints of a multimodal model that run as their language model (config.text_config)
TEXT_MODEL_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration"}


def language_model_config(hf_config, architecture: str):
    """The config the model class is built from: a multimodal checkpoint's text_config (with its
    architecture named), else the config itself."""
    if architecture not in TEXT_MODEL_OF_MULTIMODAL:
        return hf_config
    return text_config_named(hf_config, architecture)


def text_config_named(checkpoint_config, architecture: str):
    """A multimodal checkpoint's text config, named as `architecture` (what the model class is built
    from), with the checkpoint's quantization_config (a GPTQ/AWQ/FP8 checkpoint's is at its top level)."""
    text = checkpoint_config.get_text_config()
    text.architectures = [architecture]
    stored = getattr(checkpoint_config, "quantization_config", None)
    if stored is not None and getattr(text, "quantization_config", None) is None:
        text.quantization_config = stored
    return text


_CONVERTED: dict[tuple[type, str], type] = {}


def get_model_class(architecture: str, convert: str | None = None, model_impl: str = "shardlm"):
    """convert: embed or classify, a generative architecture as a pooling model (--convert);
    model_impl: "transformers" for transformers' own modeling code (ModelConfig.model_impl)."""
    if model_impl == "transformers":
        from shardlm.models.transformers_backend import TransformersForCausalLM
        if is_pooling_architecture(architecture):     # on this backend: a causal LM family's classifier
            convert = "classify"
        return TransformersForCausalLM if convert is None else _converted(TransformersForCausalLM, convert)
    if architecture in POOLING_REGISTRY:
        return POOLING_REGISTRY[architecture]
    if convert is None:
        return MODEL_REGISTRY[architecture]
    return _converted(MODEL_REGISTRY[architecture], convert)


def _converted(cls: type, convert: str) -> type:
    """cls as an embedder or classifier: one class per pair (pickled and compared by identity)."""
    if (cls, convert) not in _CONVERTED:
        as_pooling = as_embedding_model if convert == "embed" else as_classification_model
        _CONVERTED[cls, convert] = as_pooling(cls)
    return _CONVERTED[cls, convert]
