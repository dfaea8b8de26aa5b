"""`shardlm bench make-eagle MODEL DIR [--eagle3]`: a random EAGLE head for a Llama-family model,
in the checkpoint format vLLM reads, for tests and for timing speculative decoding's machinery
(random heads propose poorly; outputs stay exact):
  - EAGLE(-1): config.json of a one-layer Llama model of the target's sizes, fc.weight [H, 2H]
    and layers.0.*, no embedding or LM head (the target's are used);
  - EAGLE-3: fc.weight [H, 3H], midlayer.* (attention over 2H), norm.weight, lm_head.weight over
    a draft vocabulary of every other token, and d2t mapping it to the target's ids."""

from __future__ import annotations

import json
import os


def make_random_eagle(model_dir: str, out_dir, seed: int = 0, num_layers: int = 1, std: float = 0.05,
                      eagle3: bool = False) -> str:
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std
    if eagle3:
        from shardlm.models.eagle3 import default_aux_layers
        layers = config.num_hidden_layers
        aux = default_aux_layers(layers)
        if not all(0 <= i < layers for i in aux):       # a model too shallow for the default
            aux = (0, layers // 2, layers - 1)
        return _write(out_dir, _eagle3_tensors(rand, hidden, inter, heads, kv_heads, head_dim, config.vocab_size),
                      config, draft_vocab_size=config.vocab_size // 2, eagle_aux_hidden_state_layer_ids=list(aux))
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
    return _write(out_dir, tensors, config, num_hidden_layers=num_layers)


def _eagle3_tensors(rand, hidden, inter, heads, kv_heads, head_dim, vocab) -> dict:
    import torch
    p = "midlayer."
    draft_vocab = vocab // 2
    return {"fc.weight": rand(hidden, 3 * hidden), "norm.weight": torch.ones(hidden),
            "lm_head.weight": rand(draft_vocab, hidden) * 20,
            "d2t": torch.arange(draft_vocab, dtype=torch.long),        # draft id i is target id 2i
            p + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden), p + "hidden_norm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden)}


def _write(out_dir, tensors: dict, config, **overrides) -> str:
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    head = {k: v for k, v in config.to_dict().items() if k not in ("quantization_config",)}
    head.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
                 "tie_word_embeddings": False, **overrides})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(head, f, indent=1)
    return str(out_dir)
