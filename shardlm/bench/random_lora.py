"""`shardlm bench make-lora MODEL DIR`: a random LoRA adapter for a model, in PEFT's format
(adapter_config.json + adapter_model.safetensors), for benchmarks and tests of LoRA serving:
random A and non-zero B on the chosen projections of every layer."""

from __future__ import annotations

import json
import os

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")     # Phi-3's modules
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "qkv_proj": "self_attn", "gate_up_proj": "mlp"}


def make_random_lora(model_dir: str, out_dir, rank: int = 16, alpha: float | None = None, seed: int = 0,
                     targets=ALL_TARGETS, rslora: bool = False, std: float = 0.1) -> str:
    """An adapter for the (local, Hugging Face) model in model_dir; alpha defaults to 2 x rank."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from shardlm.lora.peft import target_shapes
    config = AutoConfig.from_pretrained(model_dir)
    if set(targets) <= set(BLOCK):          # a Llama-shaped model's projections
        # a vision-language model's adapter trains its text model, named as transformers names it
        prefix = "base_model.model.model." + ("language_model." if hasattr(config, "text_config") else "")
        config = getattr(config, "text_config", config)
        shapes = target_shapes(config)
        modules = {f"{prefix}layers.{layer}.{BLOCK[module]}.{module}": shapes[module]
                   for layer in range(config.num_hidden_layers) for module in targets}
    else:
        modules = {f"base_model.model.{name}": shape for name, shape in _linears_named(config, targets).items()}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, (in_features, out_features) in modules.items():
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * std
        tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * std
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
                   "target_modules": list(targets), "use_rslora": rslora, "bias": "none",
                   "base_model_name_or_path": str(model_dir), "task_type": "CAUSAL_LM", "lora_dropout": 0.0,
                   "fan_in_fan_out": False}, f, indent=1)
    return str(out_dir)


def _linears_named(config, targets) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear of transformers' model for `config` whose last name is one of
    `targets` (any architecture: GPT-NeoX's query_key_value, dense, ...), by module name."""
    from shardlm.lora.peft import own_modules_of
    shapes = own_modules_of(config).shapes
    found = {name: shape for name, shape in shapes.items() if name.rsplit(".", 1)[-1] in targets}
    if not found:
        names = sorted({name.rsplit(".", 1)[-1] for name in shapes})
        raise ValueError(f"No linear of {config.architectures} is named {', '.join(targets)}; its linears are "
                         f"{', '.join(names)}.")
    return found
