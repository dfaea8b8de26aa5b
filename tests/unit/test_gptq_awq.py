"""GPTQ and AWQ packed tensors: the loader's unpacking equals a scalar dequantization written from
the formats' descriptions, bit for bit; the writers below (used by the engine tests too) follow the
same descriptions."""

import numpy as np
import pytest
import torch

from shardlm.config import QuantizationConfig as QC
from shardlm.layers.quantization import dequantize
from shardlm.model_loader.gptq_awq import AWQ_ORDER, checkpoint_method, unpack_awq, unpack_gptq


def rtn_int4(w: torch.Tensor, group: int):
    """Asymmetric 4-bit round-to-nearest as GPTQ/AWQ store it: q, zero in 0..15, float16 scales
    ([N, K], [N, K / g], [N, K / g])."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((high - low) / 15).clamp(min=1e-6).half()
    zero = torch.round(-low / scale.float()).clamp(0, 15)
    q = torch.round(g / scale.float().unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15)
    return q.view(n, k).int(), zero.int(), scale


def _words(nibbles: np.ndarray) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 words, value j at bits 4j."""
    shifted = nibbles.astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))
    words = np.bitwise_or.reduce(shifted, axis=-1).astype(np.uint32)
    return torch.from_numpy(np.ascontiguousarray(words).view(np.int32))


def pack_gptq(q, zero, scale, v1: bool = True) -> dict[str, torch.Tensor]:
    """qweight [K/8, N]: word (i, n) holds q[n, 8i + j]; qzeros [K/g, N/8]: word (G, c) holds the
    zero of column 8c + j, minus one in v1 (masked to 4 bits, as AutoGPTQ's packing does)."""
    n, k = q.shape
    groups = zero.shape[1]
    stored = ((zero - 1) & 15) if v1 else zero
    return {"qweight": _words(q.t().numpy().reshape(k // 8, 8, n).transpose(0, 2, 1)),
            "qzeros": _words(stored.t().numpy().reshape(groups, n // 8, 8)),
            "scales": scale.t().contiguous(),
            "g_idx": torch.arange(k, dtype=torch.int32) // (k // groups)}


def pack_awq(q, zero, scale) -> dict[str, torch.Tensor]:
    """qweight [K, N/8]: nibble j of word (k, c) holds q[8c + AWQ_ORDER[j], k]; qzeros alike."""
    n, k = q.shape
    order = np.array(AWQ_ORDER)
    qk = q.t().numpy().reshape(k, n // 8, 8)[..., order]
    zk = zero.t().numpy().reshape(zero.shape[1], n // 8, 8)[..., order]
    return {"qweight": _words(qk), "qzeros": _words(zk), "scales": scale.t().contiguous()}


def _nibble(word: int, j: int) -> int:
    return (int(word) >> (4 * j)) & 15


def reference_gptq(t, group: int, v1: bool) -> torch.Tensor:
    """w[n, k] = scale[k // g, n] * (q - zero), element by element from the words."""
    qweight, qzeros, scales = t["qweight"].tolist(), t["qzeros"].tolist(), t["scales"].float()
    k, n = len(qweight) * 8, len(qweight[0])
    w = torch.empty(n, k)
    for row in range(n):
        for col in range(k):
            q = _nibble(qweight[col // 8][row], col % 8)
            zero = _nibble(qzeros[col // group][row // 8], row % 8) + (1 if v1 else 0)
            w[row, col] = scales[col // group, row] * (q - zero)
    return w


def reference_awq(t, group: int) -> torch.Tensor:
    qweight, qzeros, scales = t["qweight"].tolist(), t["qzeros"].tolist(), t["scales"].float()
    k, n = len(qweight), len(qweight[0]) * 8
    w = torch.empty(n, k)
    for row in range(n):
        j = AWQ_ORDER.index(row % 8)
        for col in range(k):
            q = _nibble(qweight[col][row // 8], j)
            zero = _nibble(qzeros[col // group][row // 8], j)
            w[row, col] = scales[col // group, row] * (q - zero)
    return w


@pytest.fixture
def quantized():
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    return rtn_int4(w, 32)


@pytest.mark.parametrize("v1", [True, False], ids=["gptq-v1", "gptq-v2"])
def test_gptq_unpacking_equals_the_reference(quantized, v1):
    tensors = pack_gptq(*quantized, v1=v1)
    q, s, m = unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], v1)
    assert torch.equal(q.int(), quantized[0])
    assert torch.equal(dequantize(q, s, m, torch.float32), reference_gptq(tensors, 32, v1))


def test_gptq_v1_zero_zero_overflows_as_the_formats_readers_do():
    # v1 stores zero 0 as -1, i.e. 15 in four bits: every reader (and this one) then takes zero 16
    q = torch.zeros(8, 32, dtype=torch.int32)
    zero, scale = torch.zeros(8, 1, dtype=torch.int32), torch.ones(8, 1, dtype=torch.float16)
    tensors = pack_gptq(q, zero, scale)
    _, s, m = unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], v1=True)
    assert torch.equal(m, torch.full_like(m, -16.0))


def test_awq_unpacking_equals_the_reference(quantized):
    tensors = pack_awq(*quantized)
    q, s, m = unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"])
    assert torch.equal(q.int(), quantized[0])
    assert torch.equal(dequantize(q, s, m, torch.float32), reference_awq(tensors, 32))


def test_checkpoint_configs_are_read_or_refused_clearly():
    assert checkpoint_method(None) is None
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    assert checkpoint_method(gptq) == QC("gptq", 128)
    assert checkpoint_method({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                              "version": "gemm"}) == QC("awq", 64)
    with pytest.raises(ValueError, match="desc_act"):
        checkpoint_method({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True})
    with pytest.raises(ValueError, match="8-bit weights; shardlm reads 4-bit"):
        checkpoint_method({"quant_method": "gptq", "bits": 8, "group_size": 128})
    assert checkpoint_method({"quant_method": "fp8", "weight_block_size": [128, 128]}) == QC("fp8", 128)   # FP8
    assert checkpoint_method({"quant_method": "fbgemm_fp8"}) == QC("fp8", -1)      # per channel: one group a row
    with pytest.raises(ValueError, match="'bitsandbytes'.*FP8.*compressed-tensors integer.*GPTQ and AWQ"):
        checkpoint_method({"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="'gemv'"):
        checkpoint_method({"quant_method": "awq", "bits": 4, "version": "gemv"})
