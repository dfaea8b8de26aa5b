"""Weight-only int8 / int4: round-to-nearest equals a reference written from the definition,
torch's int4 packing is understood (unpack inverts it), the blocked kernel's 4-bit panels hold
what was quantized, and the product through any kernel equals dequantize + float matmul within
the kernel's rounding."""

import pytest
import torch
import torch.nn.functional as F

from shardlm import kernels
from shardlm.layers import quantization
from shardlm.layers.quantization import (
    QuantizedWeight,
    dequantize,
    pack_int4,
    pack_nibbles,
    quantize_rtn,
    unpack_int4,
    unpack_nibbles,
)


def _reference_rtn(w: torch.Tensor, bits: int, group: int):
    """From the definition, in float64: int8 symmetric per group, int4 asymmetric per group."""
    n, k = w.shape
    g = w.double().view(n, k // group, group)
    if bits == 8:
        scale = (g.abs().amax(-1) / 127).float().double()
        q = torch.round(g / scale[..., None]).clamp(-127, 127)
        return q.view(n, k), scale, torch.zeros_like(scale)
    low = g.amin(-1).float().double()
    scale = ((g.amax(-1) - g.amin(-1)).float() / 15).double()
    q = torch.round((g - low[..., None]) / scale[..., None]).clamp(0, 15)
    return q.view(n, k), scale, low


def quantized_x(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the blocked 4-bit kernel quantizes it: int16 values round(x / d) with
    d = max |x| / 32767 per group of k's, computed in float32 as the C code does. Returns (q, d
    per k), both float64."""
    rows = x.float().reshape(x.shape[0], -1, group)
    amax = rows.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    q = torch.round(rows * inv)
    return q.reshape(x.shape).double(), (amax / 32767).expand_as(rows).reshape(x.shape).double()


def int4_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [M, K] . (q * scale + min)^T as the 4-bit kernel defines it, in float64: per group g,
    scale * d * sum_k q[k] * qx[k] + min * sum_k x[k] (x quantized, the min term on x as it is)."""
    (M, K), (N, G) = x.shape, scales.shape
    group = K // G
    qx, d = quantized_x(x, group)
    integer_part = torch.einsum("mgk,ngk->mng", (qx * d).view(M, G, group), q.double().view(N, G, group))
    x_sums = x.double().view(M, G, group).sum(-1)
    return (integer_part * scales.double()).sum(-1) + x_sums @ mins.double().t()


@pytest.mark.parametrize("bits, group", [(8, 64), (8, 256), (4, 32), (4, 128)])
def test_rtn_equals_the_reference_and_dequantizes_exactly(bits, group):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(bits + group))
    q, scales, mins = quantize_rtn(w, bits, group)
    ref_q, ref_scale, ref_min = _reference_rtn(w, bits, group)
    mismatched = (q.double() != ref_q).sum().item()
    assert mismatched <= 2, f"{mismatched} integers differ from the reference (float32 vs float64 rounding ties)"
    torch.testing.assert_close(scales.double(), ref_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(mins.double(), ref_min, rtol=1e-6, atol=0)
    deq = dequantize(q, scales, mins, torch.float32)
    expected = (q.float().view(96, -1, group) * scales[..., None] + mins[..., None]).view(96, 256)
    assert torch.equal(deq, expected)
    step = scales.max().item()
    assert (deq - w).abs().max().item() <= step / 2 + 1e-6      # round-to-nearest: half a step at most


@pytest.mark.parametrize("n", [16, 48, 64, 80, 208, 1536])
def test_int4_packing_is_understood(n):
    q = torch.randint(0, 16, (n, 96), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
    assert torch.equal(unpack_int4(pack_int4(q), n, 96), q)
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)


@pytest.mark.parametrize("bits, group", [(8, -1), (8, 64), (4, 8), (4, 32), (4, 128)])
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_equals_dequantize_then_matmul(bits, group, rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(192, 256, generator=gen) / 16
    x = torch.randn(rows, 512, generator=gen).to(dtype)[:, ::2]      # a strided view, as a q/k/v split gives
    qw = QuantizedWeight(*quantize_rtn(w, bits, 256 if group == -1 else group), bits, dtype)
    expected = F.linear(x.float(), qw.dequantized().float())
    got = qw.matmul(x)
    assert got.dtype == dtype and got.shape == (rows, 192)
    # bfloat16: within its rounding of the weights and the output (relative ~2^-8)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    if qw.kernel == "blocked4":
        # x quantized to int8 per block: the definition's value, and within half a step of x per
        # weight of the float product
        exact = int4_product(x, qw.integers(), qw.scales, qw.mins).float()
        torch.testing.assert_close(got.float(), exact, rtol=tol, atol=tol * 10)
        half_steps = quantized_x(x, qw.group)[1].float() / 2
        bound = half_steps @ qw.dequantized().float().abs().t()
        assert ((got.float() - expected).abs() <= bound * 1.01 + tol * expected.abs() + tol).all()
        return
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
    groups = 1 if group == -1 else 256 // group
    tables = 1 if qw.kernel == "blocked8" else 2          # float32 scales, and mins (not stored for symmetric panels)
    assert qw.weight_bytes() == w.numel() * bits // 8 + tables * 4 * 192 * groups


def test_packed_kernels_serve_bfloat16_models(monkeypatch):
    """Where torch's packed kernels are used: CPUs without AVX-512 (here: the blocked kernel switched off)."""
    monkeypatch.setattr(quantization, "blocked_int4", lambda: None)
    monkeypatch.setattr(quantization, "blocked_int8", lambda: None)
    w, bf16 = torch.randn(192, 256), torch.bfloat16
    assert QuantizedWeight(*quantize_rtn(w, 4, 32), 4, bf16).kernel == "int4pack"
    assert QuantizedWeight(*quantize_rtn(w, 8, 256), 8, bf16).kernel == "int8pack"
    assert QuantizedWeight(*quantize_rtn(w, 8, 64), 8, bf16).kernel is None         # int8 groups: dequantize
    assert QuantizedWeight(*quantize_rtn(w[:40], 4, 32), 4, bf16).kernel is None    # 40 rows: not /16
    assert QuantizedWeight(*quantize_rtn(w, 4, 32), 4, torch.float32).kernel is None   # float32: exact path


@pytest.mark.slow
@pytest.mark.parametrize("bits, n, k, group", [(4, 48, 64, 32), (4, 100, 256, 128), (4, 208, 96, 32),
                                               (8, 48, 64, 32), (8, 100, 256, 256), (8, 208, 96, 2)])
@pytest.mark.parametrize("float16_tables", [False, True])
def test_blocked_panels_hold_the_integers_scales_and_mins(bits, n, k, group, float16_tables, cpu_isa,
                                                          bf16_products):
    """On AVX-512 CPUs every 4-bit and symmetric 8-bit weight, float32 or bfloat16 model, goes
    into the blocked kernel's panels (scales and mins inside them, as float16 where they all are
    float16 values, as in GGUF files): read back, they are what was quantized. The product is the
    dequantized one (with the dot product too, which multiplies the integers and applies scale and
    min per group; 4-bit: with x quantized per block), and does not depend on how many rows are
    multiplied with a row: 3, 20 (8-bit: each panel widened once) or 1."""
    if kernels.blocked_int4() is None:
        pytest.skip(f"no blocked kernel in the {cpu_isa} variant (no compiler, or neither AVX2 nor AVX-512)")
    whole = quantize_rtn(torch.randn(n, 2 * k), bits, group)
    if float16_tables:
        whole = (whole[0], *(t.half().float() for t in whole[1:]))
    # the second half of the columns: a row-parallel rank's slice, not contiguous
    q, scales, mins = whole[0][:, k:], *(t[:, k // group:] for t in whole[1:])
    x = torch.randn(3, k)
    for dtype in (torch.float32, torch.bfloat16):
        qw = QuantizedWeight(q, scales, mins, bits, dtype)
        assert qw.kernel == f"blocked{bits}" and qw.table_bytes == (2 if float16_tables else 4)
        padded_rows, tables = -(-n // 48) * 48, 1 if bits == 8 else 2     # panels of 48 rows; scales (and mins)
        assert qw.weight_bytes() == padded_rows * (k * bits // 8 + k // group * tables * qw.table_bytes)
        rows = dequantize(q, scales, mins, dtype)[[n - 1, 0]][:, None]
        assert torch.equal(qw.rows(torch.tensor([[n - 1], [0]])), rows)       # an embedding lookup
        assert torch.equal(qw.integers(), q) and torch.equal(qw.scales, scales) and torch.equal(qw.mins, mins)
        expected = F.linear(x.to(dtype).float(), dequantize(q, scales, mins, torch.float32))
        if bits == 4:         # x quantized to int8 per block (test_product_equals_dequantize_then_matmul)
            expected = int4_product(x.to(dtype), q, scales, mins).float()
        torch.testing.assert_close(qw.matmul(x.to(dtype)).float(), expected, rtol=2e-2, atol=2e-2)
        # many rows widen each panel once, few widen it per tile: the same weights, the same sums
        many = torch.randn(20, k).to(dtype)
        assert torch.equal(qw.matmul(many)[7:10], qw.matmul(many[7:10]))
        assert torch.equal(qw.matmul(many)[11:12], qw.matmul(many[11:12]))


@pytest.mark.parametrize("n", [64, 80, 208])
def test_int4pack_dequantizes_in_c_exactly(n, monkeypatch):
    """dequantized() of torch's int4 layout (one C pass) equals the operators on the unpacked
    integers bit for bit: full 64-row blocks and the tail block."""
    monkeypatch.setattr(quantization, "blocked_int4", lambda: None)
    qw = QuantizedWeight(*quantize_rtn(torch.randn(n, 128), 4, 32), 4, torch.bfloat16, measure=False)
    assert qw.kernel == "int4pack"
    assert torch.equal(qw.dequantized(), dequantize(qw.integers(), qw.scales, qw.mins, torch.bfloat16))
