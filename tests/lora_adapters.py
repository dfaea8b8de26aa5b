"""LoRA adapters for tests (shardlm.bench.random_lora writes them as PEFT does: random A, non-zero
B), and the reference they are checked against: the base model with the adapter merged into its
weights (W + scaling * B A), for transformers."""

from __future__ import annotations

import json
import math
import os
import shutil

from safetensors.torch import load_file, save_file

from shardlm.bench.random_lora import ALL_TARGETS, make_random_lora
from shardlm.model_loader.weights import text_model_name


def write_adapter(base_dir: str, out_dir, rank: int = 8, alpha: float = 16, seed: int = 0,
                  targets=ALL_TARGETS, rslora: bool = False) -> str:
    """A random adapter for the model in base_dir, on `targets` of every layer."""
    return make_random_lora(base_dir, out_dir, rank, alpha, seed, targets, rslora)


def _base_weights(base_dir: str) -> dict:
    weights = {}
    for f in sorted(os.listdir(base_dir)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(base_dir, f)))
    return weights


def merged_model(base_dir: str, adapter_dir: str, out_dir) -> str:
    """The base model with the adapter merged in: W + scaling * B A (a transformers directory)."""
    shutil.copytree(base_dir, out_dir, dirs_exist_ok=True)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    rank = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    lora = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    weights = _base_weights(base_dir)
    # a vision-language checkpoint may name its text model in another layout than the adapter
    as_stored = {text_model_name(k) or k: k for k in weights}
    for key in lora:
        if key.endswith(".lora_A.weight"):
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
            name = as_stored[text_model_name(name) or name]
            a, b = lora[key].double(), lora[key.replace("lora_A", "lora_B")].double()
            weights[name] = (weights[name].double() + scaling * b @ a).to(weights[name].dtype)
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"):
            os.remove(os.path.join(out_dir, f))
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    return str(out_dir)
