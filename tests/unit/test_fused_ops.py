"""kernels/fused_ops.c: residual add + RMSNorm and SiLU-and-mul in one C call each equal the torch
operators they replace: bit for bit in bfloat16 (they round where the operators round), within a
float32 ulp or two in float32 (a sum in another order)."""

import pytest
import torch
import torch.nn.functional as F

from shardlm.kernels import fused_ops
from shardlm.layers.activation import SiluAndMul
from shardlm.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(fused_ops() is None, reason="no C compiler")


def _close(got, expected, dtype):
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=3e-7, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7])
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
def test_silu_and_mul_equals_the_operators(dtype):
    x = (4 * torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(0))).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    _close(SiluAndMul()(x), F.silu(gate) * up, dtype)
