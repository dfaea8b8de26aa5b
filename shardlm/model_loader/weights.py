"""Build a model and fill it from a Hugging Face directory of safetensors files."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from shardlm.config import ModelConfig
from shardlm.models.registry import get_model_class


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors files; shardlm loads safetensors checkpoints "
                         "(convert .bin weights with transformers' save_pretrained(safe_serialization=True)).")
    return files


def iterate_weights(model_dir: str) -> Iterator[tuple[str, object]]:
    """(name, lazy tensor): a safetensors slice, read from disk only where a weight loader
    indexes it, so each tensor parallel rank reads just its own part."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def quantize_linears(model: torch.nn.Module, config) -> None:
    """Quantize the tensor parallel linears (attention and MLP projections); embeddings, the LM
    head, routers and experts keep the model's dtype. Every rank visits them in the same order
    (a row-parallel int8 layer agrees on its rows' scales with its TP peers)."""
    from shardlm.layers.linear import ColumnParallelLinear, RowParallelLinear
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.quantize(config)


def take_gguf_linears(model: torch.nn.Module, path: str, hf_config) -> None:
    """Each tensor parallel linear takes its rank's part of the GGUF file's quantized tensors (the
    float weights loaded from the converted directory are dropped)."""
    from shardlm.layers.linear import ColumnParallelLinear, RowParallelLinear
    from shardlm.model_loader.gguf_weights import read_linears
    tensors = read_linears(path, hf_config)
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            prefix, _, leaf = name.rpartition(".")
            # a merged matrix (qkv_proj, gate_up_proj) takes its checkpoint tensors in shard order
            parts = [part.strip(".") for merged, part, _ in model.stacked_params if merged.strip(".") == leaf]
            module.take_quantized([tensors[f"{prefix}.{part}.weight"] for part in parts or [leaf]])


def load_model(model_config: ModelConfig, device: torch.device,
               layer_range: tuple[int, int] | None = None) -> torch.nn.Module:
    """The model, or with layer_range the part a pipeline stage holds: those layers, plus the
    embedding on the first stage and norm + LM head on the last."""
    cls = get_model_class(model_config.architecture)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            model = cls(model_config.hf_config, model_config.max_model_len, model_config.dtype, layer_range)
    finally:
        torch.set_default_dtype(old_dtype)
    loaded = model.load_weights(iterate_weights(model_config.model))
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"The checkpoint in {model_config.model} lacks weights for: {', '.join(sorted(missing)[:8])}"
                         f"{' ...' if len(missing) > 8 else ''}")
    if model_config.quantization is not None and model_config.quantization.method == "gguf":
        take_gguf_linears(model, model_config.quantization.source, model_config.hf_config)
    elif model_config.quantization is not None:
        quantize_linears(model, model_config.quantization)
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return model.eval()
