"""Tiny GGUF files written as llama.cpp's converter lays them out, with the embedded default
model's tokenizer (its tokenizer.* metadata copied): a dense Llama, a Mixtral (architecture
`llama` with experts), a Qwen2 (q/k/v biases, rows not permuted) and a Qwen3-MoE (q/k norms,
experts). Expert matrices are single [experts, rows, columns] tensors (`ffn_gate_exps`, ...)."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

HIDDEN, FFN, EXPERT_FFN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, USED = 64, 128, 64, 4, 2, 16, 4, 2


def write_gguf(path, kind: str, layers: int = 2, qtype=Q.Q8_0, seed: int = 0) -> str:
    """kind: llama, mixtral, qwen2 or qwen3moe; linears (experts too) in qtype."""
    from shardlm.model_loader.default_model import gguf_path
    from shardlm.model_loader.gguf_file import GGUFFile
    arch = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3moe": "qwen3moe"}[kind]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if kind in ("mixtral", "qwen3moe"):
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(USED)
    if kind == "qwen3moe":
        writer.add_expert_feed_forward_length(EXPERT_FFN)
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
    source = GGUFFile(gguf_path()).metadata
    for key, value in source.items():
        if not key.startswith("tokenizer."):
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
        else:
            writer.add_tensor(name, quants.quantize(x, kind_of), raw_dtype=kind_of)

    add("token_embd.weight", (vocab, HIDDEN), Q.Q8_0, 1.0)
    add("output_norm.weight", (HIDDEN,), Q.F32)
    add("output.weight", (vocab, HIDDEN), Q.Q8_0)
    for i in range(layers):
        blk = f"blk.{i}."
        add(blk + "attn_norm.weight", (HIDDEN,), Q.F32)
        add(blk + "ffn_norm.weight", (HIDDEN,), Q.F32)
        add(blk + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN))
        add(blk + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        add(blk + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        add(blk + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM))
        if kind == "qwen2":
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                add(blk + f"attn_{proj}.bias", (rows * HEAD_DIM,), Q.F32)
        if kind == "qwen3moe":
            add(blk + "attn_q_norm.weight", (HEAD_DIM,), Q.F32)
            add(blk + "attn_k_norm.weight", (HEAD_DIM,), Q.F32)
        if kind in ("mixtral", "qwen3moe"):
            ffn = FFN if kind == "mixtral" else EXPERT_FFN
            add(blk + "ffn_gate_inp.weight", (EXPERTS, HIDDEN), Q.F32, 1.0)
            add(blk + "ffn_gate_exps.weight", (EXPERTS, ffn, HIDDEN))
            add(blk + "ffn_up_exps.weight", (EXPERTS, ffn, HIDDEN))
            add(blk + "ffn_down_exps.weight", (EXPERTS, HIDDEN, ffn))
        else:
            add(blk + "ffn_gate.weight", (FFN, HIDDEN))
            add(blk + "ffn_up.weight", (FFN, HIDDEN))
            add(blk + "ffn_down.weight", (HIDDEN, FFN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
