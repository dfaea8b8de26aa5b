"""bfloat16 products on the AMX tiles (kernels/blocked_matmul.c: amx_panels over bfloat16 panels,
amx_integer_panels over int8, FP8 and 4-bit ones; kernels/amx.py): equal
to the float product within bfloat16's rounding, each row's result the same whatever other rows
it is computed with, from one row up, and whatever the thread count, and off unless asked. On the
CPU's tiles where it has them (else skipped), and on the plain-C model of them everywhere with
AVX512-BF16."""

import pytest
import torch
import torch.nn.functional as F

from shardlm import cpu_plan
from shardlm.kernels import amx
from shardlm.kernels.amx import AmxRows
from shardlm.layers.cpu_matmul import linear, prepare_weight
from shardlm.layers.fp8 import FP8_MAX, Fp8LinearWeight, dequantize_fp8, from_scales
from shardlm.layers.quantization import QuantizedWeight, dequantize, quantize_rtn


@pytest.fixture
def tiles(amx_variant):
    yield amx_variant
    amx.off()


@pytest.mark.parametrize("rows, n, k", [(8, 48, 64), (37, 100, 576), (300, 1536, 576), (16, 576, 1536)])
def test_amx_products_equal_the_float_product(rows, n, k, tiles):
    torch.manual_seed(rows)
    w = (torch.randn(n, k) / 8).to(torch.bfloat16)
    x, bias = torch.randn(rows, 2 * k).to(torch.bfloat16)[:, :k], torch.randn(n).to(torch.bfloat16)   # strided rows
    packed, plan = prepare_weight(w)
    assert plan.blocked
    amx.use(AmxRows(bfloat16=8))
    before = amx.calls()
    got = linear(x, packed, bias, plan)
    assert amx.calls() == before + 1
    want = F.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert torch.equal(linear(x[3:11], packed, bias, plan), got[3:11])      # 8 rows: the same sums


def eight_bit_weight(n, k, group, fp8, seed=0):
    """(an 8-bit weight in the panels of a bfloat16 model, its dequantized float32 values)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / 8
    if fp8:     # a scale per row and group, as an FP8 checkpoint's blocks give
        scales = (w.view(n, k // group, group).abs().amax(-1) / FP8_MAX).contiguous()
        q = from_scales(w, scales)
        return Fp8LinearWeight(q, scales, torch.bfloat16), dequantize_fp8(q, scales, torch.float32)
    q, scales, mins = quantize_rtn(w, 8, group)
    return QuantizedWeight(q, scales, mins, 8, torch.bfloat16), dequantize(q, scales, mins, torch.float32)


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("rows, n, k, group", [(1, 48, 64, 32), (37, 100, 576, 64), (20, 200, 256, 256)])
def test_8bit_products_on_amx_equal_the_dequantized_product(rows, n, k, group, fp8, tiles):
    """Groups of 32 columns, of 64, and one group a row; a ragged last block of rows."""
    weight, dequantized = eight_bit_weight(n, k, group, fp8)
    x = torch.randn(rows, k).to(torch.bfloat16)
    amx.use(AmxRows(eight_bit=1))
    before = amx.calls()
    got = weight.matmul(x)
    assert amx.calls() == before + 1
    torch.testing.assert_close(got.float(), F.linear(x.float(), dequantized), rtol=2e-2, atol=2e-2)
    for start, stop in ((0, 1), (rows - 1, rows), (2, 19)):
        if stop <= rows:
            assert torch.equal(weight.matmul(x[start:stop]), got[start:stop]), (start, stop)
    assert torch.equal(one_thread(lambda: weight.matmul(x)), got)


def one_thread(product):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return product()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("float16_tables", [False, True])
@pytest.mark.parametrize("rows, n, k, group", [(1, 48, 64, 32), (37, 100, 576, 64), (20, 200, 256, 256)])
def test_4bit_products_on_amx_equal_the_dequantized_product(rows, n, k, group, float16_tables, tiles):
    """4-bit weights (scale and min per group, as int4 and GGUF's Q4 blocks): on the tiles x is not
    quantized, so the product is the dequantized one to bfloat16's rounding; a row's bits the same
    alone, in any block and on one thread."""
    q, scales, mins = quantize_rtn(torch.randn(n, k) / 8, 4, group)
    if float16_tables:
        scales, mins = scales.half().float(), mins.half().float()
    weight = QuantizedWeight(q, scales, mins, 4, torch.bfloat16)
    assert weight.kernel == "blocked4"
    x = torch.randn(rows, k).to(torch.bfloat16)
    amx.use(AmxRows(four_bit=1))
    before = amx.calls()
    got = weight.matmul(x)
    assert amx.calls() == before + 1
    want = F.linear(x.float(), dequantize(q, scales, mins, torch.float32))
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    for start, stop in ((0, 1), (rows - 1, rows), (2, 19)):
        if stop <= rows:
            assert torch.equal(weight.matmul(x[start:stop]), got[start:stop]), (start, stop)
    assert torch.equal(one_thread(lambda: weight.matmul(x)), got)


def test_amx_is_off_unless_asked(tiles):
    """Batch invariance is the default: without amx.use, 64 rows and one row sum alike."""
    w = torch.randn(96, 64).to(torch.bfloat16)
    x = torch.randn(64, 64).to(torch.bfloat16)
    packed, plan = prepare_weight(w)
    before = amx.calls()
    assert torch.equal(linear(x, packed, None, plan)[5:6], linear(x[5:6], packed, None, plan))
    assert amx.calls() == before


def test_amx_rows_sum_alike_from_one_row_up(tiles):
    """A row's AMX sums do not depend on the other rows of its tile nor on how many rows the tile
    has, down to one: AMX at every row count keeps --batch-invariant's promise (AMX sums in an
    order of its own, so AMX for many rows and the vector tiles for few cannot)."""
    torch.manual_seed(3)
    w = (torch.randn(1536, 576) / 8).to(torch.bfloat16)
    x = torch.randn(37, 576).to(torch.bfloat16)
    packed, plan = prepare_weight(w)
    amx.use(AmxRows(bfloat16=1))
    every = linear(x, packed, None, plan)
    for start, stop in ((0, 1), (20, 21), (3, 8), (16, 32), (5, 37)):
        assert torch.equal(linear(x[start:stop], packed, None, plan), every[start:stop]), (start, stop)
    assert torch.equal(one_thread(lambda: linear(x, packed, None, plan)), every)      # panels over one thread


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_the_cpu_plan_times_each_kind_of_weight(batch_invariant, tiles, monkeypatch):
    """The start-up measurement runs (small weights here) and records its choice and evidence for
    both kinds of weight; the tiles are left off."""
    monkeypatch.setattr(amx, "ONE_ROW_WEIGHTS", {kind: (480, 256) for kind in amx.KINDS})
    monkeypatch.setattr(amx, "MANY_ROWS_WEIGHT", (96, 64))
    cpu_plan.forget()
    try:
        rows = amx.choose(batch_invariant)
        made = cpu_plan.current()
        for kind in amx.KINDS:
            key = amx.plan_key(kind, batch_invariant)
            assert made.choices["amx_rows"][key] == getattr(rows, kind)
            assert ("vector tiles' time" in made.evidence["amx_rows"][key]
                    or "not 1.2x faster" in made.evidence["amx_rows"][key])
            if batch_invariant:
                assert getattr(rows, kind) in (0, 1)
        before = amx.calls()
        packed, plan = prepare_weight(torch.randn(96, 64).to(torch.bfloat16))
        linear(torch.randn(64, 64).to(torch.bfloat16), packed, None, plan)
        assert amx.calls() == before
    finally:
        cpu_plan.forget()


def test_a_model_times_only_the_kinds_of_weight_it_has(tiles, monkeypatch):
    from shardlm.config import QuantizationConfig
    assert amx.kinds_of(None) == ("bfloat16",)
    assert amx.kinds_of(QuantizationConfig("int8", -1)) == ("bfloat16", "eight_bit")
    assert amx.kinds_of(QuantizationConfig("gptq", 128)) == ("bfloat16", "four_bit")
    assert amx.kinds_of(QuantizationConfig("gguf", 32)) == ("bfloat16", "eight_bit", "four_bit")
    timed = []
    monkeypatch.setattr(amx, "_one_row", lambda kind: (timed.append(kind), (1, "timed"))[1])
    cpu_plan.forget()
    try:
        assert amx.choose(True, amx.kinds_of(None)) == AmxRows(bfloat16=1)
    finally:
        cpu_plan.forget()
    assert timed == ["bfloat16"]


def test_the_choice_is_logged_by_kind(tiles):
    assert amx.describe(AmxRows(bfloat16=1, four_bit=1), True) == (
        "bfloat16 weights at every row count; 8-bit weights none (one row was slower there); 4-bit weights at "
        "every row count")
    assert amx.describe(AmxRows(bfloat16=16, eight_bit=8), False) == (
        "bfloat16 weights from 16 rows; 8-bit weights from 8 rows; 4-bit weights none (not faster here)")
    assert amx.plan_key("eight_bit", True).startswith("8-bit products (bfloat16 x), batch-invariant (")
