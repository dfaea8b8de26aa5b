"""FP8 linear weights (layers/fp8.py): quantization equals its definition, every e4m3 value is
widened exactly by the kernels of every ISA variant, the panels hold what was quantized, the
product equals the dequantized weight's and does not depend on the rows it is computed with, and
an FP8 checkpoint's scales are read per row and group where a tensor parallel slice cuts a block."""

import pytest
import torch
import torch.nn.functional as F

from shardlm.layers.fp8 import (
    FP8_MAX,
    SCHEMES,
    Fp8LinearWeight,
    block_columns,
    dequantize_fp8,
    from_scales,
    quantize_fp8,
)
from shardlm.model_loader.fp8 import Fp8Weight

# every float8_e4m3fn byte but the two NaN codes
ALL_CODES = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)


def _reference(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales from the definition (largest |w| / 448 over the row, tensor or 128 x 128 block),
    per row and group of columns."""
    n, k = w.shape
    if scheme == "fp8_per_tensor":
        return (w.abs().amax() / FP8_MAX).expand(n, 1)
    if scheme == "fp8_per_channel":
        return w.abs().amax(1, keepdim=True) / FP8_MAX
    cols = block_columns(k)
    scales = torch.empty(n, k // cols)
    for r in range(0, n, 128):
        for c in range(0, k, cols):
            scales[r:r + 128, c // cols] = w[r:r + 128, c:c + cols].abs().amax() / FP8_MAX
    return scales


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantization_follows_the_definition(scheme):
    w = torch.randn(200, 320) * torch.linspace(0.01, 3, 320)
    q, scales = quantize_fp8(w, scheme)
    torch.testing.assert_close(scales, _reference(w, scheme), rtol=0, atol=0)
    assert q.dtype == torch.float8_e4m3fn and scales.shape[1] == (320 // block_columns(320)
                                                                  if scheme == "fp8_per_block" else 1)
    expanded = scales.repeat_interleave(320 // scales.shape[1], 1)
    assert torch.equal(q, (w / expanded).to(torch.float8_e4m3fn))
    # dequantized and rounded to bfloat16, the weight quantizes back to the same bytes
    assert torch.equal(from_scales(dequantize_fp8(q, scales, torch.bfloat16), scales).view(torch.uint8),
                       q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_fp8_value_is_widened_exactly(dtype, cpu_isa, bf16_products):
    """Each e4m3 byte (subnormals, both zeros, 448) times a one-hot x: its value times the scale."""
    n = len(ALL_CODES)
    q = torch.stack([ALL_CODES, torch.zeros(n, dtype=torch.uint8)], dim=1).view(torch.float8_e4m3fn)
    scales = torch.full((n, 1), 0.5)
    weight = Fp8LinearWeight(q, scales, dtype)
    assert weight.kernel == "fp8"
    got = weight.matmul(torch.tensor([[1.0, 0.0]], dtype=dtype))[0]
    assert torch.equal(got.float(), (q[:, 0].float() * 0.5).to(dtype).float())


@pytest.mark.parametrize("n, k, scheme", [(48, 64, "fp8_per_channel"), (100, 256, "fp8_per_block"),
                                          (208, 96, "fp8_per_tensor"), (50, 384, "fp8_per_block")])
def test_panels_hold_the_values_and_multiply_as_dequantized(n, k, scheme, cpu_isa, bf16_products):
    torch.manual_seed(n)
    whole = torch.randn(n, 2 * k)
    q, scales = quantize_fp8(whole, scheme)
    groups = scales.shape[1]
    # the second half of the columns: a row-parallel rank's slice, not contiguous
    q, scales = q[:, k:], scales[:, groups // 2:] if groups > 1 else scales
    x = torch.randn(3, k)
    for dtype in (torch.float32, torch.bfloat16):
        weight = Fp8LinearWeight(q, scales, dtype)
        assert weight.kernel == "fp8"
        got_q, got_scales = weight.values()
        assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_scales, scales)
        padded_rows = -(-n // 48) * 48                                     # panels of 48 rows
        assert weight.weight_bytes() == padded_rows * (k + 4 * scales.shape[1])
        expected = F.linear(x.to(dtype).float(), dequantize_fp8(q, scales, torch.float32))
        tol = 1e-4 if dtype == torch.float32 else 2e-2     # float32: sums of k terms in another order
        torch.testing.assert_close(weight.matmul(x.to(dtype)).float(), expected, rtol=tol, atol=tol)
        bias = torch.randn(n).to(dtype)
        with_bias = weight.matmul(x.to(dtype), bias).float()
        torch.testing.assert_close(with_bias, (weight.matmul(x.to(dtype)) + bias).float(), rtol=tol, atol=tol)
        # many rows widen each panel once, few widen it per tile: the same values, the same sums
        many = torch.randn(20, k).to(dtype)
        assert torch.equal(weight.matmul(many)[7:10], weight.matmul(many[7:10]))
        assert torch.equal(weight.matmul(many)[11:12], weight.matmul(many[11:12]))


class _Slice:
    """A safetensors slice stand-in: a tensor indexed as a slice is."""

    def __init__(self, t):
        self.t = t

    def get_shape(self):
        return list(self.t.shape)

    def get_dtype(self):
        return "F8_E4M3"

    def __getitem__(self, index):
        return self.t[index]


def test_checkpoint_scales_follow_a_slice_that_cuts_a_block():
    """Blocks of 48 x 48 over [96, 128]: a slice of columns 40..104 (a rank's) reads groups of
    gcd(48, 40, 64) = 8 columns, each with its own block's scale; rows likewise."""
    q = torch.randn(96, 128).to(torch.float8_e4m3fn)
    block_scales = torch.rand(2, 3) + 0.5
    weight = Fp8Weight(_Slice(q), block_scales, (48, 48))
    table = weight.fp8_scale_table(range(30, 70), range(40, 104))
    assert table.shape == (40, 8)
    for i, row in enumerate(range(30, 70)):
        for g, col in enumerate(range(40, 104, 8)):
            assert table[i, g] == block_scales[row // 48, col // 48]
    # the float values of the slice are those scales' product
    values = weight[30:70, 40:104]
    torch.testing.assert_close(values, q[30:70, 40:104].float() * table.repeat_interleave(8, 1), rtol=0, atol=0)
    per_channel = Fp8Weight(_Slice(q), torch.rand(96, 1), None)
    assert torch.equal(per_channel.fp8_scale_table(range(10, 20), range(0, 64)), per_channel.scale[10:20])
    per_tensor = Fp8Weight(_Slice(q), torch.tensor([0.25]), None)
    assert torch.equal(per_tensor.fp8_scale_table(range(0, 4), range(64, 128)), torch.full((4, 1), 0.25))
