"""kernels/skinny_matmul.c (decode rows times a plain row-major weight) equals the product in
float64 rounded once: in each ISA variant this CPU can run (AVX-512's path and the portable
one), for row counts that fill and do not fill its tiles, a K with a tail, a bias and
strided rows. A row's result does not depend on the other rows computed with it. And a
Linear's product is the same whichever kernel the load-time measurement picked."""


import pytest
import torch
import torch.nn.functional as F

from shardlm import kernels
from shardlm.layers import cpu_matmul


@pytest.fixture
def builds(cpu_isa):
    """The kernel as built for each ISA variant this CPU can run."""
    if kernels.skinny_matmul() is None:
        pytest.skip("no C compiler")
    return {cpu_isa: kernels.skinny_matmul()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 64, 576), (3, 30, 100), (6, 13, 47), (9, 128, 1536), (37, 50, 100)])
def test_skinny_matmul_equals_the_exact_product(builds, dtype, M, N, K):
    gen = torch.Generator().manual_seed(M * N + K)
    wide = torch.randn(M, K + 40, generator=gen).to(dtype)
    x = wide[:, 8:8 + K]                                      # rows with a stride of their own
    w, bias = torch.randn(N, K, generator=gen).to(dtype), torch.randn(N, generator=gen).to(dtype)
    exact = (x.double() @ w.double().t() + bias.double()).to(dtype)
    for name, fn in builds.items():
        y = torch.empty(M, N, dtype=dtype)
        code = 0 if dtype == torch.float32 else 1
        fn(x.data_ptr(), x.stride(0), w.data_ptr(), bias.data_ptr(), y.data_ptr(), M, N, K, code)
        if dtype == torch.bfloat16:
            # float32 sums round once more: within one bfloat16 step of the exact product
            assert ((y.float() - exact.float()).abs() <= exact.float().abs() / 128 + 1e-2).all(), name
        else:
            torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-4, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_batch(builds, dtype):
    gen = torch.Generator().manual_seed(7)
    M, N, K = 64, 45, 200
    x, w = torch.randn(M, K, generator=gen).to(dtype), torch.randn(N, K, generator=gen).to(dtype)
    code = 0 if dtype == torch.float32 else 1
    for name, fn in builds.items():
        whole = torch.empty(M, N, dtype=dtype)
        fn(x.data_ptr(), K, w.data_ptr(), None, whole.data_ptr(), M, N, K, code)
        for start, rows in ((0, 1), (5, 1), (13, 3), (40, 24)):
            part = torch.empty(rows, N, dtype=dtype)
            fn(x[start].data_ptr(), K, w.data_ptr(), None, part.data_ptr(), rows, N, K, code)
            assert torch.equal(part, whole[start:start + rows]), (name, start, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_is_the_same_product_for_every_row_count(dtype):
    """The plain-weight path (CPUs without AVX-512): skinny kernel up to the measured rows, oneDNN past them."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(200, 96, generator=gen).to(dtype), torch.randn(200, generator=gen).to(dtype)
    rows_measured = cpu_matmul.skinny_max_rows(w)
    weight = w if rows_measured else (cpu_matmul.onednn_pack(w) if cpu_matmul.onednn_pack(w) is not None else w)
    plan = cpu_matmul.CpuMatmul(200, 96, skinny_rows=rows_measured)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for rows in (1, 4, 5, 70):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        got = cpu_matmul.linear(x, weight, b, plan)
        torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=tol, rtol=tol)
    forced = cpu_matmul.linear(x[:1], w, b, cpu_matmul.CpuMatmul(200, 96, skinny_rows=1))   # the skinny kernel itself
    torch.testing.assert_close(forced.float(), F.linear(x[:1], w, b).float(), atol=tol, rtol=tol)
