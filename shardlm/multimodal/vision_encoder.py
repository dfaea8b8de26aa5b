"""A vision-language checkpoint's vision side on the workers of the first pipeline stage: the
checkpoint's own transformers model (LlavaModel, LlavaNextModel, Idefics3Model) built without its
text model, run by its own get_image_features (vision tower, projector or connector, LLaVA-NeXT's
tile packing); the text model is shardlm's. Its linears are shardlm's (the CPU kernels' panels: a
ViT-L/14-336 image took 8-11% less time than with torch's). Every TP rank of that stage holds it
whole and computes the images of its steps (a vision tower is small beside the text model)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardlm.config import MultiModalConfig
from shardlm.layers.linear import Linear
from shardlm.messages import MultiModalItem
from shardlm.model_loader.compressed_tensors import PACKED_SUFFIXES as COMPRESSED_SUFFIXES
from shardlm.model_loader.gptq_awq import PACKED_SUFFIXES as GPTQ_AWQ_SUFFIXES
from shardlm.multimodal.processing import as_tensor

# tensors of a linear stored quantized (FP8 weights are dequantized as they are read: model_loader/fp8.py)
STORED_QUANTIZED = GPTQ_AWQ_SUFFIXES + COMPRESSED_SUFFIXES

# architecture -> transformers' model class (the conditional generation model's .model), and the
# attribute its text model sits in
VISION_SIDES = {
    "LlavaForConditionalGeneration": ("LlavaModel", "language_model"),
    "LlavaNextForConditionalGeneration": ("LlavaNextModel", "language_model"),
    "Idefics3ForConditionalGeneration": ("Idefics3Model", "text_model"),
}


class VisionEncoder(nn.Module):
    def __init__(self, mm: MultiModalConfig):
        super().__init__()
        import transformers
        model_class, self.text_attribute = VISION_SIDES[mm.architecture]
        config = copy.deepcopy(mm.hf_config)
        _shrink_text_model(config.get_text_config())        # built, then dropped: the text model is shardlm's
        self.inner = getattr(transformers, model_class)(config)
        delattr(self.inner, self.text_attribute)
        for name, linear in list(self.inner.named_modules()):
            if isinstance(linear, nn.Linear):
                ours = Linear(linear.in_features, linear.out_features, linear.bias is not None)
                ours.load_state_dict(linear.state_dict())       # (random: what --load-format dummy keeps)
                parent, _, leaf = name.rpartition(".")
                setattr(self.inner.get_submodule(parent), leaf, ours)

    def vision_name(self, name: str) -> str | None:
        """A checkpoint tensor's name here, or None for the text model's (both layouts are seen:
        vision_tower.* and model.vision_tower.*)."""
        for candidate in (name.removeprefix("model."), name):
            top = candidate.split(".")[0]
            if top != self.text_attribute and hasattr(self.inner, top):
                return candidate
        return None

    def load_weights(self, weights) -> None:
        params = {**dict(self.inner.named_parameters()), **dict(self.inner.named_buffers())}
        loaded, stored_quantized = set(), []
        for name, tensor in weights:
            ours = self.vision_name(name)
            if ours is None or ours not in params:
                if ours is not None and ours.endswith(STORED_QUANTIZED):
                    stored_quantized.append(name)
                continue
            with torch.no_grad():
                params[ours].copy_(tensor if isinstance(tensor, torch.Tensor) else tensor[:])
            loaded.add(ours)
        missing = {n for n, _ in self.inner.named_parameters()} - loaded
        if missing and stored_quantized:
            raise ValueError(f"The checkpoint stores its vision side quantized ({stored_quantized[0]}): shardlm reads "
                             "the vision tower and projector in float (as GPTQ, AWQ and compressed-tensors tools "
                             "leave them by default) and the language model as stored. Quantize the language model "
                             "alone, or run the float checkpoint with --quantization int8 or int4.")
        if missing:
            raise ValueError(f"The checkpoint lacks vision weights: {', '.join(sorted(missing)[:8])}")

    def finish_loading(self) -> VisionEncoder:
        """The linears' weights laid out for the kernels, once loaded; -> self."""
        self.dtype = next(self.parameters()).dtype
        self.device = next(self.parameters()).device
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
        return self.eval()

    @torch.inference_mode()
    def encode(self, item: MultiModalItem) -> torch.Tensor:
        """One image's embeddings, [its placeholder tokens' count, text hidden size], in the order
        its placeholders take them."""
        inputs = {k: as_tensor(v).to(self.device) for k, v in item.tensors.items()}
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        features = self.inner.get_image_features(**inputs).pooler_output
        if isinstance(features, (list, tuple)):
            features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        return features.reshape(-1, features.shape[-1])


def _shrink_text_model(text_config) -> None:
    """A text config whose model costs nothing to build (no layers, a one-token vocabulary)."""
    text_config.num_hidden_layers = 0
    text_config.vocab_size = 1
    text_config.pad_token_id = None          # (inside a one-token vocabulary or none)
    if getattr(text_config, "layer_types", None) is not None:
        text_config.layer_types = []


def load_vision_encoder(model, device: torch.device) -> VisionEncoder:
    """The vision encoder of ModelConfig `model`, in its dtype, with the checkpoint's weights."""
    from shardlm.model_loader.weights import iterate_weights
    encoder = VisionEncoder(model.multimodal).to(dtype=model.dtype, device=device)
    if model.load_format != "dummy":
        encoder.load_weights(iterate_weights(model.model))
    return encoder.finish_loading()
