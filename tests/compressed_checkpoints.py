"""compressed-tensors checkpoints of a tiny model, written by the compressed-tensors library itself
(as llm-compressor writes them), beside the float model of the weights that library's own
dequantization gives (the reference the engine must equal)."""

from __future__ import annotations

import os
import shutil

import torch

# name -> (weight bits, symmetric, strategy, group size, activations quantized too)
SCHEMES = {
    "w4a16": (4, True, "group", 32, False),
    "w4a16-asym": (4, False, "group", 32, False),
    "w4a16-channel": (4, True, "channel", None, False),
    "w8a16": (8, True, "channel", None, False),
    "w8a8": (8, True, "channel", None, True),
}


def quantization_config(name: str):
    """The compressed-tensors QuantizationConfig of scheme `name`, every Linear but lm_head."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
    )
    bits, symmetric, strategy, group, acts = SCHEMES[name]
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, dynamic=True, strategy="token") if acts else None
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                              quantization_status=QuantizationStatus.FROZEN)


def set_min_max_scales(model: torch.nn.Module) -> None:
    """Each quantized linear's scale and zero point from its weights' range (a min-max observer)."""
    from compressed_tensors.quantization.utils import calculate_qparams
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or not isinstance(module, torch.nn.Linear):
            continue
        args, w = scheme.weights, module.weight.data
        if args.strategy == "group":
            view = w.reshape(w.shape[0], -1, args.group_size)
            low, high = view.amin(-1), view.amax(-1)
        else:
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        scale, zero = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.to(module.weight_zero_point.dtype))


def write(src: str, root, name: str) -> tuple[str, str]:
    """(the compressed checkpoint, the float model of its dequantized weights) of scheme `name`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    apply_quantization_config(model, quantization_config(name), show_progress=False)
    set_min_max_scales(model)
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    references = dict(reference.named_modules())
    with torch.no_grad():
        for module_name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is not None and isinstance(module, torch.nn.Linear):
                zero = getattr(module, "weight_zero_point", None)
                references[module_name].weight.copy_(
                    fake_quantize(module.weight, module.weight_scale, zero, scheme.weights))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    dirs = []
    for kind, m in (("compressed", model), ("dequantized", reference)):
        dst = os.path.join(str(root), f"{name}-{kind}")
        m.save_pretrained(dst, safe_serialization=True)
        if kind == "compressed":
            compressor.update_config(dst)
        for extra in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if os.path.exists(os.path.join(src, extra)):
                shutil.copy(os.path.join(src, extra), dst)
        dirs.append(dst)
    return dirs[0], dirs[1]
