"""GGUF's Q8_0 / Q4_0 / Q4_1 blocks decoded into integers, scales and minimums dequantize to
exactly what gguf's own numpy dequantizer gives; the embedded default model's Q4_1 linears,
un-permuted, and its Q8_0 token embedding equal its float conversion bit for bit, and so does
their cached copy."""

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from shardlm.layers.quantization import dequantize
from shardlm.model_loader.gguf_weights import _decode_file, decode_blocks, read_linears


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_dequantize_like_ggufs_own_dequantizer(type_name):
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    x = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32) * 3
    raw = quants.quantize(x, qtype)
    q, scales, mins, bits = decode_blocks(raw, type_name)
    assert bits == (8 if type_name == "Q8_0" else 4) and q.shape == (48, 256) and scales.shape == (48, 8)
    ours = dequantize(q, scales, mins, torch.float32).numpy()
    assert np.array_equal(ours, quants.dequantize(raw, qtype))


def test_default_models_q4_1_linears_equal_its_float_conversion(default_model_dir):
    import os

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from shardlm.model_loader.default_model import gguf_path
    config = AutoConfig.from_pretrained(default_model_dir)
    linears = _decode_file(gguf_path(), config)
    floats = load_file(os.path.join(default_model_dir, "model.safetensors"))
    assert len(linears) == 30 * 7 + 1           # and the tied embedding / LM head table
    for name, (q, scales, mins, bits) in linears.items():
        assert bits == (8 if name == "model.embed_tokens.weight" else 4), name
        assert torch.equal(dequantize(q, scales, mins, torch.float32), floats[name]), name
    cached = read_linears(gguf_path(), config)          # the decoded copy in the cache directory
    read_linears(gguf_path(), config)
    assert cached.keys() == linears.keys()
    for name, parts in linears.items():
        assert all(torch.equal(a, b) for a, b in zip(parts[:3], cached[name][:3])) and parts[3] == cached[name][3]
