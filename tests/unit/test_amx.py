"""AMX tiles for bfloat16 products of many rows (--no-batch-invariant; kernels/blocked_matmul.c:
amx_panels): equal to the float product within bfloat16's rounding, each row's result the same
whatever other rows it is computed with at or above the threshold, and off by default. On the
CPU's tiles where it has them (else skipped), and on the plain-C model of them everywhere with
AVX512-BF16."""

import pytest
import torch
import torch.nn.functional as F

from shardlm import kernels
from shardlm.layers.cpu_matmul import linear, prepare_weight


@pytest.fixture
def amx(amx_variant):
    yield amx_variant
    kernels.use_amx(0)


@pytest.mark.parametrize("rows, n, k", [(8, 48, 64), (37, 100, 576), (300, 1536, 576), (16, 576, 1536)])
def test_amx_products_equal_the_float_product(rows, n, k, amx):
    torch.manual_seed(rows)
    w = (torch.randn(n, k) / 8).to(torch.bfloat16)
    x, bias = torch.randn(rows, 2 * k).to(torch.bfloat16)[:, ::2], torch.randn(n).to(torch.bfloat16)   # strided rows
    packed, plan = prepare_weight(w)
    assert plan.blocked
    kernels.use_amx(8)
    got = linear(x, packed, bias, plan)
    kernels.use_amx(0)
    vectors = linear(x, packed, bias, plan)
    want = F.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    if rows * n >= 300 * 1536:       # another summation order shows in some outputs: the AMX path ran
        assert not torch.equal(got, vectors)
    kernels.use_amx(8)
    assert torch.equal(linear(x[3:11], packed, bias, plan), got[3:11])      # 8 rows: the same sums


def test_amx_is_off_unless_asked(amx):
    """Batch invariance is the default: without use_amx, 64 rows and one row sum alike."""
    w = torch.randn(96, 64).to(torch.bfloat16)
    x = torch.randn(64, 64).to(torch.bfloat16)
    packed, plan = prepare_weight(w)
    assert torch.equal(linear(x, packed, None, plan)[5:6], linear(x[5:6], packed, None, plan))


def test_amx_rows_sum_alike_from_one_row_up(amx):
    """A row's AMX sums do not depend on the other rows of its tile nor on how many rows the tile
    has, down to one: AMX at every row count would keep --batch-invariant's promise (AMX sums in
    an order of its own, so AMX for many rows and the vector tiles for few cannot)."""
    torch.manual_seed(3)
    w = (torch.randn(1536, 576) / 8).to(torch.bfloat16)
    x = torch.randn(37, 576).to(torch.bfloat16)
    packed, plan = prepare_weight(w)
    kernels.use_amx(1)
    every = linear(x, packed, None, plan)
    for start, stop in ((0, 1), (20, 21), (3, 8), (16, 32), (5, 37)):
        assert torch.equal(linear(x[start:stop], packed, None, plan), every[start:stop]), (start, stop)
