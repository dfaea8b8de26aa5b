"""GGUF's Q8_0 / Q4_0 / Q4_1 blocks and Q4_K / Q5_K / Q6_K super-blocks decoded into integers,
scales and minimums dequantize to exactly what gguf's own numpy dequantizer gives; the embedded
default model's Q4_1 linears, un-permuted, and its Q8_0 token embedding equal its float
conversion bit for bit, and so does their cached copy."""

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from shardlm.kernels import blocked_int4
from shardlm.layers.quantization import QuantizedWeight, dequantize
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


@pytest.mark.parametrize("type_name, bits, group", [("Q4_K", 4, 32), ("Q5_K", 8, 32), ("Q6_K", 8, 16)])
def test_k_quant_blocks_dequantize_like_ggufs_own_dequantizer(type_name, bits, group):
    """K-quant super-blocks of random bytes (gguf-py cannot quantize to them), with finite
    float16 super-block scales."""
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    rng = np.random.default_rng(1)
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[type_name]
    raw = rng.integers(0, 256, (24, 3, size), dtype=np.uint8)
    halves = (rng.standard_normal((24, 3, 2)) * 0.01).astype(np.float16).view(np.uint8).reshape(24, 3, 2, 2)
    if type_name == "Q6_K":
        raw[..., 208:210] = halves[:, :, 0]
    else:
        raw[..., 0:2], raw[..., 2:4] = halves[:, :, 0], halves[:, :, 1]
    raw = raw.reshape(24, -1)
    q, scales, mins, got_bits = decode_blocks(raw, type_name)
    assert got_bits == bits and q.shape == (24, 768) and scales.shape == (24, 768 // group)
    ours = dequantize(q, scales, mins, torch.float32).numpy()
    assert np.array_equal(ours, quants.dequantize(raw, qtype))
    # Q4_K runs on the 4-bit panels, Q6_K (symmetric) on the 8-bit ones, Q5_K is dequantized per product
    qw = QuantizedWeight(q, scales, mins, bits, torch.bfloat16, measure=False)
    if blocked_int4() is not None:
        assert qw.kernel == {"Q4_K": "blocked4", "Q5_K": None, "Q6_K": "blocked8"}[type_name]
    x = torch.randn(3, 768).to(torch.bfloat16)
    expected = x.float() @ torch.from_numpy(ours).t()
    torch.testing.assert_close(qw.matmul(x).float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_conversion_finished_by_another_process_is_kept(tmp_path):
    """Two processes converting one GGUF at once (DP replicas, a test beside `bench make-model`):
    the later one keeps the copy already there, which a reader may be using, and leaves no
    temporary directory behind."""
    from shardlm.model_loader.default_model import _NEEDED, convert_gguf, gguf_path
    out = tmp_path / "model"
    out.mkdir()
    for name in (*_NEEDED, "theirs"):
        (out / name).write_text("{}")
    convert_gguf(gguf_path(), str(out))
    assert (out / "theirs").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
