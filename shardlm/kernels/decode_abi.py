"""The one-call decode step's arguments (llama_decode_layers in kernels/llama_decode.c) as
ctypes structures: the mirror of the structs in shardlm_kernels.h, field for field and in the
same order. tests/unit/test_kernel_abi.py compiles the header and compares each field's name,
type, offset and size, so a field added, moved or retyped on one side only fails there.
"""

from __future__ import annotations

import ctypes

_P, _I32, _I64, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float

# the weight layouts the C step multiplies (DECODE_SKINNY ... in shardlm_kernels.h)
SKINNY, BLOCKED, BLOCKED_INT4, BLOCKED_INT8, BLOCKED_FP8 = 0, 1, 2, 3, 4

ALL_REDUCE_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int32)                 # decode_all_reduce_fn
EXCHANGE_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32)   # decode_exchange_fn


class LlamaDecodeModel(ctypes.Structure):
    _fields_ = [("layers", _I32), ("hidden_size", _I32), ("heads", _I32), ("kv_heads", _I32), ("head_dim", _I32),
                ("intermediate", _I32), ("num_blocks", _I32), ("block_size", _I32), ("scale", _F), ("eps", _F),
                ("residual_multiplier", _F),
                ("dtype", _I32), ("layout", _I32), ("group", _I32), ("table_bytes", _I32), ("kv_format", _I32)]


class LlamaDecodeLayer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("input_norm", "qkv_weight", "qkv_bias", "o_weight", "o_bias", "post_norm",
                                        "gate_up_weight", "gate_up_bias", "down_weight", "down_bias", "q_norm",
                                        "k_norm", "k_cache", "v_cache")] + [("rope", _I32), ("k_scale", _F),
                                                                            ("v_scale", _F)]


class LlamaDecodeStep(ctypes.Structure):
    _fields_ = [("hidden", _P), ("residual", _P), ("tokens", _I32), ("has_residual", _I32), ("cos", _P),
                ("signed_sin", _P), ("slot_mapping", _P), ("block_tables", _P), ("context_lens", _P),
                ("max_blocks", _I64), ("scratch", _P), ("all_reduce", ALL_REDUCE_CALLBACK)]


class LlamaDecodeLoraLayer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("qkv_a", "qkv_b", "o_a", "o_b", "gate_up_a", "gate_up_b", "down_a",
                                        "down_b")]


class LlamaDecodeLora(ctypes.Structure):
    _fields_ = [("panels", ctypes.POINTER(LlamaDecodeLoraLayer)), ("segments", _P), ("num_segments", _I32),
                ("rank", _I32)]


class LlamaDecodeContextParallel(ctypes.Structure):
    _fields_ = [("size", _I32), ("rank", _I32), ("exchange", EXCHANGE_CALLBACK), ("q_all", _P), ("partial", _P),
                ("lse", _P), ("send", _P), ("every", _P)]


# latent_decode_layers (kernels/latent_decode.c): DeepSeek's decoder layers

LATENT_REDUCE_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int32, _P, _I64, ctypes.c_int32)   # latent_reduce_fn
LATENT_ROUTE_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32)             # latent_route_fn


class LatentDecodeModel(ctypes.Structure):
    _fields_ = [(name, _I32) for name in ("layers", "hidden_size", "heads", "q_lora_rank", "nope_dim", "rope_dim",
                                          "latent_dim", "v_dim", "intermediate", "num_experts", "top_k",
                                          "expert_intermediate", "shared_intermediate", "block_size")] + [
        ("scale", _F), ("eps", _F), ("dtype", _I32), ("tp_size", _I32), ("expert_group_size", _I32)]


class LatentDecodeLayer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("input_norm", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "w_uk", "w_uv",
                                        "o", "post_norm", "gate_up", "down", "router", "w13", "w2")] + [
        (name, _I64) for name in ("head_stride_uk", "head_stride_uv", "expert_stride_w13", "expert_stride_w2")] + [
        ("cache", _P), ("k_scale", _F)]


class LatentDecodeStep(ctypes.Structure):
    _fields_ = [("hidden", _P), ("residual", _P), ("tokens", _I32), ("has_residual", _I32), ("cos", _P),
                ("signed_sin", _P), ("slot_mapping", _P), ("block_tables", _P), ("context_lens", _P),
                ("max_blocks", _I64), ("scratch", _P), ("router_input", _P), ("logits", _P), ("slots", _P),
                ("weights", _P), ("all_reduce", LATENT_REDUCE_CALLBACK), ("route", LATENT_ROUTE_CALLBACK)]


STRUCTS = (LlamaDecodeModel, LlamaDecodeLayer, LlamaDecodeStep, LlamaDecodeLoraLayer, LlamaDecodeLora,
           LlamaDecodeContextParallel, LatentDecodeModel, LatentDecodeLayer, LatentDecodeStep)

