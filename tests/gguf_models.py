"""Tiny GGUF files written as llama.cpp's converter lays them out, with the embedded default
model's tokenizer (its tokenizer.* metadata copied): a dense Llama, a Mixtral (architecture
`llama` with experts), a Qwen2 (q/k/v biases, rows not permuted), a Qwen3-MoE (q/k norms,
experts), a Gemma 2 (norms stored plus 1, soft-caps other than transformers' defaults), a Gemma 3
(q/k norms, linear rope scaling) and a Phi-3 (fused q/k/v and gate/up, a partial rotary embedding
with LongRoPE factors as tensors). Expert matrices are single [experts, rows, columns] tensors
(`ffn_gate_exps`, ...).
K-quants (which gguf-py reads but does not write) are random blocks of small scales, in files
whose widths are whole 256-column super-blocks."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

HIDDEN, FFN, EXPERT_FFN, HEADS, KV_HEADS, EXPERTS, USED = 64, 128, 64, 4, 2, 4, 2   # head size: HIDDEN / HEADS
PHI3_ROTARY = 12        # of each head's 16 dims (Phi-4-mini rotates 0.75 of its heads too)


# K-quant blocks: bytes per 256 columns, and where the float16 scales sit (offset: the d's)
_K_BLOCKS = {Q.Q4_K: (144, (0, 2)), Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}


def _random_k_blocks(rng, shape, qtype) -> np.ndarray:
    """Random super-blocks of a K-quant: random quants and sub-block scales, float16 d (and dmin)
    small enough that the weights stay near 0.1."""
    size, scales = _K_BLOCKS[qtype]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // 256, size), dtype=np.uint8)
    for offset in scales:
        d = rng.uniform(2e-4, 5e-4, blocks.shape[:-1]).astype(np.float16)
        blocks[..., offset:offset + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    return blocks.reshape(*shape[:-1], -1)


def write_gguf(path, kind: str, layers: int = 2, qtype=Q.Q8_0, seed: int = 0, expert_qtype=None,
               tokenizer: bool = True) -> str:
    """kind: llama, mixtral, qwen2, qwen3moe, gemma2, gemma3 or phi3; linears in qtype, experts in
    expert_qtype (default: qtype; Q4_K experts take Q6_K for their down projections, as llama.cpp's Q4_K_M does). A
    K-quant makes the model 256 wide (one super-block). tokenizer=False: the weights alone (no
    tokenizer.* metadata, whose 49,152 strings gguf's own reader takes seconds to parse)."""
    expert_qtype = expert_qtype or qtype
    widths = (256, 256, 256) if {qtype, expert_qtype} & set(_K_BLOCKS) else (HIDDEN, FFN, EXPERT_FFN)
    return _write(path, kind, layers, qtype, seed, expert_qtype, tokenizer, *widths)


def _write(path, kind, layers, qtype, seed, expert_qtype, tokenizer, hidden, ffn_size, expert_ffn) -> str:
    from shardlm.model_loader.default_model import gguf_path
    from shardlm.model_loader.gguf_file import GGUFFile
    arch = {"mixtral": "llama"}.get(kind, kind)
    rng = np.random.default_rng(seed)
    head_dim = hidden // HEADS
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn_size)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if kind in ("mixtral", "qwen3moe"):
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(USED)
    if kind == "qwen3moe":
        writer.add_expert_feed_forward_length(expert_ffn)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if kind.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(8)        # shorter than the prompts: the sliding layers slide
    if kind == "gemma2":
        writer.add_attn_logit_softcapping(5.0)
        writer.add_final_logit_softcapping(3.0)
    if kind == "gemma3":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(8.0)
    if kind == "phi3":
        writer.add_rope_dimension_count(PHI3_ROTARY)
        writer.add_rope_scaling_orig_ctx_len(256)       # of its 512 positions
    source = GGUFFile(gguf_path()).metadata
    for key, value in source.items():
        if not (tokenizer and key.startswith("tokenizer.")):
            continue
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, value)
    vocab = len(source["tokenizer.ggml.tokens"])
    writer.add_vocab_size(vocab)

    def add(name, shape, kind_of=qtype, scale=0.15):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if kind_of == Q.F32:
            x = 1 + x if name.endswith("norm.weight") else x
            writer.add_tensor(name, x, raw_dtype=Q.F32)
        elif kind_of in _K_BLOCKS:
            writer.add_tensor(name, _random_k_blocks(rng, shape, kind_of), raw_dtype=kind_of)
        else:
            writer.add_tensor(name, quants.quantize(x, kind_of), raw_dtype=kind_of)

    # Gemma multiplies its embeddings by sqrt(hidden) and reads its logits from them: smaller ones
    # keep its random outputs from repeating one token
    add("token_embd.weight", (vocab, hidden), Q.Q8_0, 0.05 if kind.startswith("gemma") else 1.0)
    add("output_norm.weight", (hidden,), Q.F32)
    if not kind.startswith("gemma"):        # Gemma's head is its embedding: llama.cpp writes none
        add("output.weight", (vocab, hidden), Q.Q8_0)
    if kind == "phi3":
        for which in ("long", "short"):
            writer.add_tensor(f"rope_factors_{which}.weight",
                              rng.uniform(1.0, 4.0, PHI3_ROTARY // 2).astype(np.float32), raw_dtype=Q.F32)
    for i in range(layers):
        blk = f"blk.{i}."
        add(blk + "attn_norm.weight", (hidden,), Q.F32)
        add(blk + "ffn_norm.weight", (hidden,), Q.F32)
        if kind.startswith("gemma"):
            add(blk + "post_attention_norm.weight", (hidden,), Q.F32)
            add(blk + "post_ffw_norm.weight", (hidden,), Q.F32)
        if kind == "phi3":
            add(blk + "attn_qkv.weight", ((HEADS + 2 * KV_HEADS) * head_dim, hidden))
        else:
            add(blk + "attn_q.weight", (HEADS * head_dim, hidden))
            add(blk + "attn_k.weight", (KV_HEADS * head_dim, hidden))
            add(blk + "attn_v.weight", (KV_HEADS * head_dim, hidden))
        add(blk + "attn_output.weight", (hidden, HEADS * head_dim))
        if kind == "qwen2":
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                add(blk + f"attn_{proj}.bias", (rows * head_dim,), Q.F32)
        if kind in ("qwen3moe", "gemma3"):
            add(blk + "attn_q_norm.weight", (head_dim,), Q.F32)
            add(blk + "attn_k_norm.weight", (head_dim,), Q.F32)
        if kind in ("mixtral", "qwen3moe"):
            ffn = ffn_size if kind == "mixtral" else expert_ffn
            add(blk + "ffn_gate_inp.weight", (EXPERTS, hidden), Q.F32, 1.0)
            add(blk + "ffn_gate_exps.weight", (EXPERTS, ffn, hidden), expert_qtype)
            add(blk + "ffn_up_exps.weight", (EXPERTS, ffn, hidden), expert_qtype)
            down = Q.Q6_K if expert_qtype == Q.Q4_K else expert_qtype
            add(blk + "ffn_down_exps.weight", (EXPERTS, hidden, ffn), down)
        elif kind == "phi3":        # gate and up as one tensor, gate first
            add(blk + "ffn_up.weight", (2 * ffn_size, hidden))
            add(blk + "ffn_down.weight", (hidden, ffn_size))
        else:
            add(blk + "ffn_gate.weight", (ffn_size, hidden))
            add(blk + "ffn_up.weight", (ffn_size, hidden))
            add(blk + "ffn_down.weight", (hidden, ffn_size))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
