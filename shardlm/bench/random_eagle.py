"""`shardlm bench make-eagle MODEL DIR`: a random EAGLE head for a Llama-family model, in the
EAGLE(-1) checkpoint format vLLM reads (config.json of a one-layer Llama model of the target's
sizes, fc.weight and layers.0.*, no embedding or LM head: the target's are used), for tests and
for timing speculative decoding's machinery. Random heads propose poorly; outputs stay exact."""

from __future__ import annotations

import json
import os


def make_random_eagle(model_dir: str, out_dir, seed: int = 0, num_layers: int = 1, std: float = 0.05) -> str:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std
    tensors = {"fc.weight": rand(hidden, 2 * hidden)}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                        p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                        p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                        p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                        p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
                        p + "mlp.down_proj.weight": rand(hidden, inter),
                        p + "post_attention_layernorm.weight": torch.ones(hidden)})
        if i:
            tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    head = {k: v for k, v in config.to_dict().items() if k not in ("quantization_config",)}
    head.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=num_layers,
                tie_word_embeddings=False)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(head, f, indent=1)
    return str(out_dir)
