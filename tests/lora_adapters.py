"""LoRA adapters for tests, written as PEFT's save_pretrained writes them (adapter_config.json +
adapter_model.safetensors, random A and non-zero B), and the reference they are checked against:
the base model with the adapter merged into its weights (W + scaling * B A), for transformers."""

from __future__ import annotations

import json
import math
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _base_weights(base_dir: str) -> dict[str, torch.Tensor]:
    weights = {}
    for f in sorted(os.listdir(base_dir)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(base_dir, f)))
    return weights


def write_adapter(base_dir: str, out_dir, rank: int = 8, alpha: float = 16, seed: int = 0,
                  targets=ALL_TARGETS, rslora: bool = False, std: float = 0.1) -> str:
    """A random adapter for the model in base_dir, on `targets` of every layer."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(base_dir, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    base = _base_weights(base_dir)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in targets:
            out_features, in_features = base[f"model.layers.{layer}.{_BLOCK[module]}.{module}.weight"].shape
            key = f"base_model.model.model.layers.{layer}.{_BLOCK[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * std
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "use_rslora": rslora, "bias": "none", "base_model_name_or_path": str(base_dir),
              "task_type": "CAUSAL_LM", "lora_dropout": 0.0, "fan_in_fan_out": False}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return str(out_dir)


def merged_model(base_dir: str, adapter_dir: str, out_dir) -> str:
    """The base model with the adapter merged in: W + scaling * B A (a transformers directory)."""
    shutil.copytree(base_dir, out_dir, dirs_exist_ok=True)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    rank = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    lora = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    weights = _base_weights(base_dir)
    for key in lora:
        if key.endswith(".lora_A.weight"):
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
            a, b = lora[key].double(), lora[key.replace("lora_A", "lora_B")].double()
            weights[name] = (weights[name].double() + scaling * b @ a).to(weights[name].dtype)
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"):
            os.remove(os.path.join(out_dir, f))
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    return str(out_dir)
