"""`shardlm bench make-draft MODEL DIR --layers N`: a draft model made of a model's first N
layers, its final norm and its LM head (a self-speculative draft: no second model to train or
download; its proposals are as good as those layers' early answer)."""

from __future__ import annotations

import os
import re
import shutil


def make_truncated_draft(model_dir: str, out_dir, num_layers: int) -> str:
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from shardlm.model_loader.weights import safetensors_files
    config = AutoConfig.from_pretrained(model_dir)
    if not 1 <= num_layers < config.num_hidden_layers:
        raise ValueError(f"--layers {num_layers}: the model has {config.num_hidden_layers} layers; a draft keeps "
                         f"1 to {config.num_hidden_layers - 1} of them.")
    tensors = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                layer = re.match(r"model\.layers\.(\d+)\.", name)
                if layer is None or int(layer.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    config.num_hidden_layers = num_layers
    config.save_pretrained(out_dir)
    for name in os.listdir(model_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(os.path.join(model_dir, name), out_dir)
    return str(out_dir)
