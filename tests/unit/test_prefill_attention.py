"""The tiled causal attention for prompt chunks (kernels/prefill_attention.c): equal to attention in
float64 over the keys each query may see, for chunks after a cached prefix, GQA, head sizes 64,
80 and 128, latent attention's values inside the keys and FP8 caches, with each query's
log-sum-exp; in every ISA variant this CPU runs (native: the AMX tiles where the CPU has them),
bfloat16 with and without the CPU's bfloat16 dot product, and on the AMX tiles (the CPU's, or
their plain-C model on CPUs with AVX512-BF16);
and a query's output the same bits however the prompt is chunked and whatever the thread count."""

import pytest
import torch

from shardlm import kernels
from shardlm.kernels import DTYPE_CODES, kv_format

BS = 16
# (query heads, KV heads, head size, value size, values inside the keys)
LAYOUTS = [(8, 2, 64, 64, False), (4, 4, 128, 128, False), (6, 1, 80, 80, False), (16, 1, 96, 64, True)]
# (first position, context after the chunk) per sequence: whole prompts, chunks after a prefix,
# short ones, a chunk of one
def layout_id(layout):
    return "H{}-Hkv{}-D{}-Dv{}".format(*layout)


SEQUENCES = [(0, 100), (37, 300), (0, 5), (64, 130), (250, 251)]


class PagedCase:
    """Random caches of `dtype` (or FP8 with a scale) holding each sequence's context in shuffled
    blocks, and random queries."""

    def __init__(self, dtype, layout, sequences, cache_dtype=None, seed=0):
        self.H, self.Hkv, self.D, self.Dv, self.latent = layout
        self.dtype, self.sequences = dtype, sequences
        g = torch.Generator().manual_seed(seed)
        counts = [-(-ctx // BS) for _, ctx in sequences]
        self.num_blocks = sum(counts) + 2
        order = (torch.randperm(self.num_blocks - 1, generator=g) + 1).tolist()
        self.tables = [order[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(counts))]
        width = max(len(t) for t in self.tables)
        self.table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables])
        shape = (self.Hkv, self.num_blocks, BS, self.D)
        self.scale_kv = 0.05 if cache_dtype is not None else 1.0
        stored = cache_dtype or dtype
        self.k_cache = (torch.randn(shape, generator=g) / self.scale_kv).to(stored)
        self.v_cache = None if self.latent else (torch.randn(shape, generator=g) / self.scale_kv).to(stored)
        self.qlens = [ctx - start for start, ctx in sequences]
        self.q = torch.randn(sum(self.qlens), self.H, self.D, generator=g).to(dtype)
        self.width = max(self.qlens)
        offsets = [sum(self.qlens[:i]) for i in range(len(sequences))]
        self.offsets = offsets
        self.token_index = torch.tensor([[o + min(i, n - 1) for i in range(self.width)]
                                         for o, n in zip(offsets, self.qlens)])

    def run(self):
        """-> (out [B * width, H, Dv], lse [B * width, H]) from the kernel."""
        B = len(self.sequences)
        out = torch.zeros(B * self.width, self.H, self.Dv, dtype=self.dtype)
        lse = torch.zeros(B * self.width, self.H)
        starts = torch.tensor([s for s, _ in self.sequences])
        contexts = torch.tensor([c for _, c in self.sequences])
        rc = kernels.paged_prefill_attention()(
            out.data_ptr(), self.q.data_ptr(), self.q.stride(0), self.token_index.data_ptr(), self.width,
            starts.data_ptr(), contexts.data_ptr(), self.k_cache.data_ptr(),
            None if self.v_cache is None else self.v_cache.data_ptr(), self.table.data_ptr(), self.table.shape[1], B,
            self.H, self.Hkv, self.D, self.Dv, self.num_blocks, BS, self.D ** -0.5, DTYPE_CODES[self.dtype],
            kv_format(self.k_cache.dtype, self.dtype), self.scale_kv, self.scale_kv, lse.data_ptr())
        assert rc == 0
        return out, lse

    def keys_values(self, b):
        """Sequence b's context: keys [ctx, Hkv, D] and values [ctx, Hkv, Dv], float64."""
        ctx = self.sequences[b][1]
        slots = [self.tables[b][p // BS] * BS + p % BS for p in range(ctx)]
        widen = lambda cache: cache.view(self.Hkv, -1, self.D)[:, slots].transpose(0, 1).double() * self.scale_kv  # noqa: E731
        keys = widen(self.k_cache)
        return keys, keys[..., :self.Dv] if self.latent else widen(self.v_cache)

    def reference(self, b):
        """Sequence b's queries attending causally, in float64 -> (out [Q, H, Dv], lse [Q, H])."""
        start, ctx = self.sequences[b]
        keys, values = self.keys_values(b)
        G = self.H // self.Hkv
        q = self.q[self.offsets[b]:self.offsets[b] + ctx - start].double()
        scores = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(G, 1)) * self.D ** -0.5
        hidden = torch.arange(ctx)[None, None, :] > (start + torch.arange(ctx - start))[None, :, None]
        scores = scores.masked_fill(hidden, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values.repeat_interleave(G, 1))
        return out, torch.logsumexp(scores, -1).transpose(0, 1)

    def rows(self, b):
        return slice(b * self.width, b * self.width + self.qlens[b])


def check_equals_float64_attention(dtype, layout):
    case = PagedCase(dtype, layout, SEQUENCES)
    out, lse = case.run()
    # bfloat16: the output's own rounding (2^-8 relative), and the weights in bfloat16 (AMX, dot product)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(len(SEQUENCES)):
        ref, ref_lse = case.reference(b)
        torch.testing.assert_close(out[case.rows(b)].double(), ref, atol=tol, rtol=0)
        torch.testing.assert_close(lse[case.rows(b)].double(), ref_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiled_attention_equals_float64_attention(cpu_isa, dtype, layout, bf16_products):
    check_equals_float64_attention(dtype, layout)


@pytest.mark.parametrize("layout", [*LAYOUTS, (8, 1, 96, 80, True)], ids=layout_id)
def test_amx_tiles_equal_float64_attention(amx_variant, layout):
    """bfloat16 on the AMX tiles (the layouts whose head sizes they take: D a multiple of 32; Dv 80
    runs the values' 16-wide tail)."""
    check_equals_float64_attention(torch.bfloat16, layout)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_caches_are_widened_and_scaled(cpu_isa, cache_dtype):
    case = PagedCase(torch.bfloat16, LAYOUTS[0], SEQUENCES[:3], cache_dtype=cache_dtype)
    out, lse = case.run()
    for b in range(3):
        ref, ref_lse = case.reference(b)
        torch.testing.assert_close(out[case.rows(b)].double(), ref, atol=2e-2, rtol=0)
        torch.testing.assert_close(lse[case.rows(b)].double(), ref_lse, atol=1e-4, rtol=1e-5)


def check_same_bits_however_chunked(dtype):
    """A 300-token prompt at once, or as chunks of 70, 100 and 130 after their prefixes; and with
    one thread or all."""
    whole = PagedCase(dtype, LAYOUTS[0], [(0, 300)])
    out, lse = whole.run()
    chunked = PagedCase(dtype, LAYOUTS[0], [(0, 70), (70, 170), (170, 300)])
    chunked.k_cache, chunked.tables, chunked.table, chunked.num_blocks = (whole.k_cache, whole.tables * 3,
                                                                          whole.table.repeat(3, 1), whole.num_blocks)
    chunked.v_cache, chunked.q = whole.v_cache, whole.q
    pieces, piece_lse = chunked.run()
    got = torch.cat([pieces[chunked.rows(b)] for b in range(3)])
    got_lse = torch.cat([piece_lse[chunked.rows(b)] for b in range(3)])
    assert torch.equal(got, out) and torch.equal(got_lse, lse)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread, one_thread_lse = whole.run()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, out) and torch.equal(one_thread_lse, lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_query_has_the_same_bits_however_the_prompt_is_chunked(cpu_isa, dtype, bf16_products):
    check_same_bits_however_chunked(dtype)


def test_on_amx_tiles_a_query_has_the_same_bits_however_the_prompt_is_chunked(amx_variant):
    check_same_bits_however_chunked(torch.bfloat16)
