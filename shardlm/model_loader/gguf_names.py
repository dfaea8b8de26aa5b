"""A GGUF file in Hugging Face's terms: which checkpoint tensor each of its tensors holds, and the
config it describes, for the architectures shardlm reads itself (llama, with or without experts,
qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3, phi3). Other architectures go through
transformers' GGUF loader.

llama.cpp's converter writes a layer's expert matrices as one tensor [experts, rows, columns]
(`blk.L.ffn_gate_exps` ...), which holds one checkpoint tensor per expert. Mixtral is written as
the `llama` architecture with `llama.expert_count`; transformers reads it as a dense Llama (the
experts dropped), so its config is made a Mixtral one here. It permutes the q and k rows of the
`llama` architecture alone (its rotary layout), which are put back in the Hugging Face order.

Gemma's norms scale by (1 + weight); llama.cpp stores them with the 1 added (ggml's norm scales by
the weight), which is taken off again. Its norms around the MLP are named otherwise than Llama's.
Phi-3 keeps its fused q/k/v (`attn_qkv`) and gate/up (`ffn_up`, twice the feed-forward rows) as the
checkpoint does. Where transformers' config reading leaves something out that llama.cpp runs by
(experts, soft-caps, Gemma's attention scale, Phi-3's partial rotary and LongRoPE factors, which
the file holds as tensors), complete_config puts it back.
"""

from __future__ import annotations

import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3")
_TABLES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
           "output_norm.weight": "model.norm.weight"}
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
           "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_OTHERS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
           "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
           "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# where an architecture names a module otherwise
_BY_ARCHITECTURE = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
_BY_ARCHITECTURE["gemma3"] = _BY_ARCHITECTURE["gemma2"]
# tensors of no checkpoint weight: Phi-3's LongRoPE factors, which complete_config reads
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
EXPERT_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# every module a linear weight may be read from: LINEARS', Phi-3's fused q/k/v (its fused gate/up
# is ffn_up, as others' up), and the experts'
QUANTIZED_MODULES = (*LINEARS, "attn_qkv", *EXPERT_MATRICES)
# per architecture: the router's name, and expert E's gate, up and down matrices
_MOE = {"llama": ("block_sparse_moe.gate", "block_sparse_moe.experts.{}.", ("w1", "w3", "w2")),
        "qwen2moe": ("mlp.gate", "mlp.experts.{}.", ("gate_proj", "up_proj", "down_proj")),
        "qwen3moe": ("mlp.gate", "mlp.experts.{}.", ("gate_proj", "up_proj", "down_proj"))}


def checkpoint_names(architecture: str, name: str, experts: int) -> list[str] | None:
    """The Hugging Face tensors a GGUF tensor holds: one, or one per expert (its first dimension);
    None where it is not one this mapping knows."""
    if architecture not in ARCHITECTURES:
        return None
    if name in _CONFIG_TENSORS:
        return []
    if name in _TABLES:
        return [_TABLES[name]]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[3] not in ("weight", "bias"):
        return None
    prefix, module, kind = f"model.layers.{parts[1]}.", parts[2], parts[3]
    moe = _MOE.get(architecture)
    if module in EXPERT_MATRICES and moe is not None:
        matrix = moe[2][EXPERT_MATRICES.index(module)]
        return [f"{prefix}{moe[1].format(e)}{matrix}.{kind}" for e in range(experts)]
    if module == "ffn_gate_inp" and moe is not None:
        return [f"{prefix}{moe[0]}.{kind}"]
    known = _BY_ARCHITECTURE.get(architecture, {}).get(module) or LINEARS.get(module) or _OTHERS.get(module)
    return None if known is None else [f"{prefix}{known}.{kind}"]


def qk_row_order(architecture: str, module: str, rows: int, hf_config) -> torch.Tensor | None:
    """For each Hugging Face row of a q or k projection, its GGUF row (llama's rows only are
    permuted: llama.cpp stores row (head, half, i) of a head's [2, head_dim / 2] at (head, i, half));
    None where the rows are in order."""
    if architecture != "llama" or module not in ("attn_q", "attn_k"):
        return None
    heads = hf_config.num_attention_heads
    if module == "attn_k":
        heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def stored_value(architecture: str, name: str, values: torch.Tensor) -> torch.Tensor:
    """A tensor's checkpoint value from the one stored (Gemma's norms have 1 added in the file)."""
    if architecture.startswith("gemma") and name.endswith("norm.weight"):
        return values - 1
    return values


def expert_count(hf_config) -> int:
    return getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0


def complete_config(file, hf_config):
    """The config of a GGUF file (a GGUFFile), completed where transformers' reader leaves out what
    llama.cpp runs the file by; hf_config otherwise."""
    metadata = file.metadata
    arch = metadata.get("general.architecture")
    config = moe_config(metadata, hf_config)

    def key(name: str):
        return metadata.get(f"{arch}.{name}")
    if arch == "gemma2":
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if key(cap) is not None:
                setattr(config, cap, float(key(cap)))
    if arch in ("gemma2", "gemma3"):
        # llama.cpp scales scores by head_dim ** -0.5, and the 27B models by (hidden / heads) ** -0.5
        largest = config.num_hidden_layers == {"gemma2": 46, "gemma3": 62}[arch]
        config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads if largest
                                        else config.head_dim)
    if arch == "gemma3" and key("rope.scaling.type") == "linear":     # its full-attention layers alone
        config.rope_parameters["full_attention"] = {**config.rope_parameters["full_attention"],
                                                    "rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    if arch == "phi3":
        rope, head_dim = dict(config.rope_parameters), config.hidden_size // config.num_attention_heads
        if key("rope.dimension_count"):
            rope["partial_rotary_factor"] = key("rope.dimension_count") / head_dim
        long, short = (file.tensors.get(f"rope_factors_{which}.weight") for which in ("long", "short"))
        if long is not None and short is not None:
            original = key("rope.scaling.original_context_length")
            rope.update(rope_type="longrope", long_factor=[float(v) for v in long.to_float32()],
                        short_factor=[float(v) for v in short.to_float32()], original_max_position_embeddings=original)
            config.original_max_position_embeddings = original
        config.rope_parameters = rope
    return config


def moe_config(metadata: dict, hf_config):
    """The config of a GGUF file with experts, completed from its metadata where transformers'
    reader leaves it out (Mixtral's experts, the Qwen MoEs' expert sizes); hf_config otherwise."""
    arch = metadata.get("general.architecture")
    experts = metadata.get(f"{arch}.expert_count")
    if not experts:
        return hf_config
    if arch == "llama":
        from transformers import MixtralConfig
        fields = {k: v for k, v in hf_config.to_dict().items() if k not in ("model_type", "architectures")}
        config = MixtralConfig(**fields, num_local_experts=experts,
                               num_experts_per_tok=metadata[f"{arch}.expert_used_count"])
        config.architectures = ["MixtralForCausalLM"]
        return config
    if f"{arch}.expert_feed_forward_length" in metadata:
        hf_config.moe_intermediate_size = metadata[f"{arch}.expert_feed_forward_length"]
    if f"{arch}.expert_shared_feed_forward_length" in metadata:
        hf_config.shared_expert_intermediate_size = metadata[f"{arch}.expert_shared_feed_forward_length"]
    return hf_config
