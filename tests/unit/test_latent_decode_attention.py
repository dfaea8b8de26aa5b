"""Latent attention's decode kernel (kernels/latent_attention.c): every query head against one
shared cache row per token, its first Dv values the value. Equal to attention in float64 for
DeepSeek-V3's shape (16 heads, 512 + 64 dims), the tiny test model's (24 dims, 16 values) and
head counts and value sizes that are not whole vectors, over contexts of one key to several
splits, with each head's log-sum-exp and FP8 caches; in every ISA variant this CPU runs, bfloat16
with and without the CPU's bfloat16 dot product; and a sequence's output the same bits alone or
in a batch, and whatever the thread count."""

import pytest
import torch

from shardlm import kernels
from shardlm.kernels import DTYPE_CODES, kv_format
from tests.unit.test_prefill_attention import BS, PagedCase

# (query heads, KV heads, head size, value size, values inside the keys)
LAYOUTS = [(16, 1, 576, 512, True), (4, 1, 24, 16, True), (6, 1, 80, 48, True), (2, 1, 40, 32, True)]
CONTEXTS = [1, 5, 64, 300, 700, 1025, 2600]     # 2600: splits of more than 256 keys


def decode_case(dtype, layout, contexts, cache_dtype=None, seed=0) -> PagedCase:
    return PagedCase(dtype, layout, [(ctx - 1, ctx) for ctx in contexts], cache_dtype=cache_dtype, seed=seed)


def run(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [B, H, Dv], lse [B, H]) from the kernel."""
    B = len(case.sequences)
    out = torch.zeros(B, case.H, case.Dv, dtype=case.dtype)
    lse = torch.zeros(B, case.H)
    contexts = torch.tensor([c for _, c in case.sequences])
    rc = kernels.latent_decode_attention()(
        out.data_ptr(), case.q.data_ptr(), case.q.stride(0), case.k_cache.data_ptr(), case.table.data_ptr(),
        case.table.shape[1], contexts.data_ptr(), B, case.H, case.D, case.Dv, BS, case.D ** -0.5,
        DTYPE_CODES[case.dtype], kv_format(case.k_cache.dtype, case.dtype), case.scale_kv, lse.data_ptr())
    assert rc == 0
    return out, lse


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"H{x[0]}-D{x[2]}-Dv{x[3]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_latent_decode_equals_float64_attention(cpu_isa, dtype, layout, bf16_products):
    case = decode_case(dtype, layout, CONTEXTS)
    out, lse = run(case)
    # bfloat16: the output's own rounding (2^-8 relative), and the weights in bfloat16 (dot product)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(len(CONTEXTS)):
        ref, ref_lse = case.reference(b)
        torch.testing.assert_close(out[b].double(), ref[0], atol=tol, rtol=0)
        torch.testing.assert_close(lse[b].double(), ref_lse[0], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_latent_caches_are_widened_and_scaled(cpu_isa, cache_dtype):
    case = decode_case(torch.bfloat16, LAYOUTS[1], CONTEXTS[:4], cache_dtype=cache_dtype)
    out, lse = run(case)
    for b in range(4):
        ref, ref_lse = case.reference(b)
        torch.testing.assert_close(out[b].double(), ref[0], atol=2e-2, rtol=0)
        torch.testing.assert_close(lse[b].double(), ref_lse[0], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_sequence_has_the_same_bits_alone_in_a_batch_and_on_one_thread(cpu_isa, dtype, bf16_products):
    batch = decode_case(dtype, LAYOUTS[0], [700, 40, 1025])
    out, lse = run(batch)
    alone = decode_case(dtype, LAYOUTS[0], [700])
    alone.k_cache, alone.table, alone.q = batch.k_cache, batch.table[:1], batch.q[:1]
    one, one_lse = run(alone)
    assert torch.equal(one[0], out[0]) and torch.equal(one_lse[0], lse[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single, single_lse = run(batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, out) and torch.equal(single_lse, lse)


def test_an_empty_context_gives_zeros_and_minus_infinity():
    case = decode_case(torch.float32, LAYOUTS[1], [5])
    out = torch.full((1, case.H, case.Dv), 7.0)
    lse, empty = torch.zeros(1, case.H), torch.tensor([0])
    rc = kernels.latent_decode_attention()(
        out.data_ptr(), case.q.data_ptr(), case.q.stride(0), case.k_cache.data_ptr(), case.table.data_ptr(),
        case.table.shape[1], empty.data_ptr(), 1, case.H, case.D, case.Dv, BS, 1.0, 0, 0, 1.0,
        lse.data_ptr())
    assert rc == 0 and torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
