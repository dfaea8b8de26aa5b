"""kernels/blocked_matmul.c (the weight repacked into panels, used for every product on AVX-512
CPUs, and on AVX2 ones but for float32 with --no-batch-invariant), in every ISA variant of this
CPU that has it, equals the product in float64 rounded once, for row counts that fill and do not
fill its register tiles, output sizes that do not fill a panel, an odd K (bfloat16 packs k in
pairs), a bias and strided rows; a row's result
does not depend on the other rows computed with it; and a Linear prepared at load multiplies
through it."""

import pytest
import torch
import torch.nn.functional as F

from shardlm import cpu_plan, kernels
from shardlm.layers import cpu_matmul


@pytest.fixture(autouse=True)
def blocked_variant(cpu_isa):
    if kernels.blocked_matmul() is None:
        pytest.skip(f"no blocked kernel in the {cpu_isa} variant (no compiler, or neither AVX2 nor AVX-512)")
    return cpu_isa


def _product(x, w, bias):
    packed = cpu_matmul.pack_blocked(w)
    return cpu_matmul.blocked(x, packed, bias, w.shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 48, 576), (3, 30, 101), (8, 100, 64), (9, 97, 1537), (37, 200, 96)])
def test_blocked_matmul_equals_the_exact_product(dtype, M, N, K, bf16_products):
    gen = torch.Generator().manual_seed(M * N + K)
    wide = torch.randn(M, K + 40, generator=gen).to(dtype)
    x = wide[:, 8:8 + K]                                      # rows with a stride of their own
    w, bias = torch.randn(N, K, generator=gen).to(dtype), torch.randn(N, generator=gen).to(dtype)
    exact = (x.double() @ w.double().t() + bias.double()).to(dtype)
    got = _product(x, w, bias)
    if dtype == torch.bfloat16:
        # float32 sums round once more: within one bfloat16 step of the exact product
        assert ((got.float() - exact.float()).abs() <= exact.float().abs() / 128 + 1e-2).all()
    else:
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_batch(dtype, bf16_products):
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(64, 200, generator=gen).to(dtype), torch.randn(100, 200, generator=gen).to(dtype)
    whole = _product(x, w, None)
    for start, rows in ((0, 1), (5, 1), (13, 3), (40, 24)):
        assert torch.equal(_product(x[start:start + rows], w, None), whole[start:start + rows]), (start, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_run_in_blocks_with_the_same_sums(dtype, bf16_products):
    """Rows whose x outgrows L2 (K = 2000: blocks of 48 or 96 rows) go through every panel a
    block at a time, the tiles after a block's first asking for the next panel: the product is
    still exact, and each row's bits are those it has alone."""
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(150, 2000, generator=gen).to(dtype), torch.randn(245, 2000, generator=gen).to(dtype)
    whole = _product(x, w, None)
    exact = (x.double() @ w.double().t()).to(dtype)
    if dtype == torch.bfloat16:
        assert ((whole.float() - exact.float()).abs() <= exact.float().abs() / 128 + 5e-2).all()
    else:
        torch.testing.assert_close(whole, exact, rtol=1e-4, atol=1e-3)
    for start, rows in ((0, 1), (17, 1), (39, 2), (100, 50)):
        assert torch.equal(_product(x[start:start + rows], w, None), whole[start:start + rows]), (start, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prepared_linear_multiplies_through_the_blocked_kernel(dtype):
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(200, 96, generator=gen).to(dtype), torch.randn(200, generator=gen).to(dtype)
    packed, plan = cpu_matmul.prepare_weight(w)
    assert plan.blocked and packed is not None
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for shape in ((1, 96), (70, 96), (2, 3, 96)):
        x = torch.randn(*shape, generator=gen).to(dtype)
        got = cpu_matmul.linear(x, packed, b, plan)
        torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=tol, rtol=tol)


def test_float32_weights_leave_the_panels_on_avx2_only_without_batch_invariance(monkeypatch):
    """AVX2's float32 panels lose to oneDNN at many rows, whose sums depend on the row count."""
    w = torch.randn(200, 96)
    assert cpu_matmul.goes_into_panels(w) and cpu_matmul.goes_into_panels(w.bfloat16())
    monkeypatch.setattr(cpu_plan.current(), "batch_invariant", False)
    assert cpu_matmul.goes_into_panels(w) == (kernels.blocked_vector_bits() == 512)
    assert cpu_matmul.goes_into_panels(w.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [96, 97])
def test_rows_read_back_from_the_packed_layout(dtype, K):
    """A tied embedding looks its rows up in the LM head's packed table."""
    w = torch.randn(100, K, generator=torch.Generator().manual_seed(K)).to(dtype)
    packed, plan = cpu_matmul.pack_blocked(w), cpu_matmul.CpuMatmul(100, K, blocked=True)
    ids = torch.tensor([[0, 47, 48, 99], [5, 5, 98, 1]])
    assert torch.equal(cpu_matmul.blocked_rows(packed, plan, ids), w[ids])
