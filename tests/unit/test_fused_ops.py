"""kernels/fused_ops.c: residual add + RMSNorm and SiLU-and-mul in one C call each equal the torch
operators they replace: bit for bit in bfloat16 (they round where the operators round), within a
float32 ulp or two in float32 (a sum in another order)."""

import pytest
import torch
import torch.nn.functional as F

from shardlm.kernels import fused_ops
from shardlm.layers.activation import SiluAndMul
from shardlm.layers.norm import RMSNorm


@pytest.fixture(autouse=True)
def every_variant(cpu_isa):
    """Each test runs in every ISA variant of the kernels this CPU can run."""
    if fused_ops() is None:
        pytest.skip("no C compiler")
    return cpu_isa


def _close(got, expected, dtype):
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=3e-7, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 100])                       # 100 rows: in parallel
def test_add_rmsnorm_equals_the_operators(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=gen).to(dtype)
    wide = torch.randn(rows, 1000, generator=gen).to(dtype)
    x, residual = wide[:, 100:676], torch.randn(rows, 576, generator=gen).to(dtype)   # x: a strided view
    out, summed = norm(x, residual)
    assert torch.equal(summed, x + residual)
    _close(out, norm._norm(x + residual), dtype)
    _close(norm(x), norm._norm(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(5, 1536), (64, 1537)])    # 64 rows: in parallel; 1537: a tail
def test_silu_and_mul_equals_the_operators(dtype, rows, inter):
    x = (4 * torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(0))).to(dtype)
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 0.0])   # exp's edges
    gate, up = x.chunk(2, dim=-1)
    got, expected = SiluAndMul()(x), F.silu(gate) * up
    assert torch.equal(got.isnan(), expected.isnan())
    _close(got.nan_to_num(), expected.nan_to_num(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_equals_the_operators(dtype):
    from types import SimpleNamespace

    from shardlm.layers.rotary import ApplyRotary, RotaryEmbedding
    rope = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 64, 512, dtype)
    cos_sin = rope.lookup(torch.tensor([0, 5, 300]))
    qkv = (3 * torch.randn(3, (9 + 3 + 3) * 64, generator=torch.Generator().manual_seed(0))).to(dtype)
    qk = qkv[:, :12 * 64].view(3, 12, 64)                  # q and k heads of a qkv output, as the model has them
    cos, signed_sin = cos_sin
    half = 32
    expected = torch.addcmul(qk * cos, torch.cat((qk[..., half:], qk[..., :half]), dim=-1), signed_sin)
    v_before = qkv[:, 12 * 64:].clone()
    rotated = ApplyRotary()(qk, cos_sin)
    assert rotated.data_ptr() == qk.data_ptr()               # in place
    _close(rotated, expected, dtype)
    assert torch.equal(qkv[:, 12 * 64:], v_before)           # v untouched


def test_each_op_chooses_its_forward_once_and_falls_back_without_kernels(monkeypatch):
    """An op takes its CPU forward where the C kernels are built, the portable one where they are
    not, and keeps its choice; both give the same result."""
    from shardlm.layers import custom_op
    from shardlm.layers.activation import SiluAndMul
    x = torch.randn(4, 32)
    with_kernels, without = SiluAndMul(), SiluAndMul()
    expected = with_kernels(x)
    assert with_kernels._impl.__func__ is SiluAndMul.forward_cpu
    monkeypatch.setattr(custom_op, "fused_ops", lambda: None)
    torch.testing.assert_close(without(x), expected)
    assert without._impl.__func__ is SiluAndMul.forward_native
    assert with_kernels(x) is not None and with_kernels._impl.__func__ is SiluAndMul.forward_cpu   # chosen once
