"""Which checkpoints carry images, and how their text model is found (the engine runs that model
as any other; the vision side is vision_encoder.py's)."""

from __future__ import annotations

import json

from shardlm.config import MultiModalConfig, json_object_flag

# the vision-language architectures whose images are read (their text model is shardlm's own)
VISION_LANGUAGE = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                   "Idefics3ForConditionalGeneration")


def vision_language_architecture(checkpoint_config) -> str | None:
    archs = getattr(checkpoint_config, "architectures", None) or []
    return next((a for a in archs if a in VISION_LANGUAGE), None)


def text_architecture(checkpoint_config) -> str:
    """The text model's architecture: its config's, else transformers' causal LM for its model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    text = checkpoint_config.get_text_config()
    archs = getattr(text, "architectures", None) or []
    return archs[0] if archs else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text.model_type, text.model_type)


def parse_limits(flag: str | dict | None) -> dict[str, int]:
    """--limit-mm-per-prompt '{"image": 2}' -> {"image": 2}."""
    if flag is None or flag == "":
        return {}
    limits = json.loads(flag) if isinstance(flag, str) else dict(flag)
    if not isinstance(limits, dict) or any(not isinstance(v, int) or isinstance(v, bool) or v < 0
                                           for v in limits.values()):
        raise ValueError(f"--limit-mm-per-prompt {flag!r}: give a JSON object of counts, e.g. '{{\"image\": 2}}'.")
    unknown = set(limits) - {"image"}
    if unknown:
        raise ValueError(f"--limit-mm-per-prompt: {', '.join(sorted(unknown))} are not read here; images are "
                         "(\"image\").")
    return limits


def multimodal_config(checkpoint_config, limit_mm_per_prompt=None, allowed_local_media_path: str | None = None,
                      mm_processor_kwargs=None, allowed_media_domains=None) -> MultiModalConfig | None:
    """A vision-language checkpoint's MultiModalConfig, None for a text model."""
    architecture = vision_language_architecture(checkpoint_config)
    if architecture is None:
        if mm_processor_kwargs or limit_mm_per_prompt:
            raise ValueError("--mm-processor-kwargs and --limit-mm-per-prompt apply to vision-language models; this "
                             "one is a text model.")
        return None
    image_token = getattr(checkpoint_config, "image_token_index", None)
    if image_token is None:
        image_token = getattr(checkpoint_config, "image_token_id", None)
    return MultiModalConfig(architecture, checkpoint_config, int(image_token), parse_limits(limit_mm_per_prompt),
                            allowed_local_media_path, json_object_flag(mm_processor_kwargs, "--mm-processor-kwargs",
                                                                       '{"do_image_splitting": false}'),
                            _domains(allowed_media_domains))


def _domains(given) -> list[str] | None:
    """--allowed-media-domains a.com b.org (offline: a list, or one string) -> lower-case hosts."""
    if given is None:
        return None
    domains = [given] if isinstance(given, str) else list(given)
    return [d.strip().lower() for d in domains if d.strip()]
