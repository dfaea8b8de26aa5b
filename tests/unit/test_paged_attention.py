"""Paged attention: the CPU backend (compiled decode kernel) and the torch backend agree, and
both equal plain attention over the sequence's keys, whatever the block layout (the kernel in
every ISA variant this CPU can run)."""

import random
import sys

import pytest
import torch
import torch.nn.functional as F

from shardlm import kernels
from shardlm.attention.cpu_kernel import CpuKernelAttention
from shardlm.attention.torch_paged import TorchPagedAttention
from shardlm.layers.attention import Attention

pytestmark = pytest.mark.usefixtures("one_rank")   # they build layers outside an engine

H, HKV, D, BS, NB = 6, 2, 32, 16, 64


def _backend(use_kernel):
    if not use_kernel:
        return TorchPagedAttention(BS, torch.device("cpu"))
    kernel = kernels.paged_decode_attention()
    assert kernel is not None, "the C kernel must build where a compiler exists"
    return CpuKernelAttention(BS, torch.device("cpu"), kernel)


def _setup(dtype, lens, q_lens=None, use_kernel=False):
    torch.manual_seed(0)
    random.seed(0)
    attn = Attention(H, HKV, D, D ** -0.5)
    attn.backend = _backend(use_kernel)
    attn.k_cache = torch.randn(HKV, NB, BS, D, dtype=dtype)
    attn.v_cache = torch.randn(HKV, NB, BS, D, dtype=dtype)
    free = list(range(1, NB))
    random.shuffle(free)
    tables = []
    for n in lens:
        k = -(-n // BS)
        tables.append(free[:k])
        free = free[k:]
    q_lens = q_lens or [1] * len(lens)
    meta = attn.backend.build_metadata(q_lens, [n - q for n, q in zip(lens, q_lens)], tables)
    T = sum(q_lens)
    q = torch.randn(T, H, D, dtype=dtype)
    k, v = torch.randn(T, HKV, D, dtype=dtype), torch.randn(T, HKV, D, dtype=dtype)
    return attn, meta, tables, q, k, v


def _reference(attn, tables, lens, q_lens, q):
    """Plain causal attention per sequence, from the cache contents (after the step's writes)."""
    outs, t = [], 0
    for table, n, ql in zip(tables, lens, q_lens):
        keys = attn.k_cache[:, table].reshape(HKV, -1, D)[:, :n].float()
        vals = attn.v_cache[:, table].reshape(HKV, -1, D)[:, :n].float()
        qs = q[t:t + ql].float().transpose(0, 1)                        # [H, ql, D]
        mask = torch.arange(n)[None, :] <= torch.arange(n - ql, n)[:, None]
        o = F.scaled_dot_product_attention(qs, keys.repeat_interleave(H // HKV, 0), vals.repeat_interleave(H // HKV, 0),
                                           attn_mask=mask, scale=D ** -0.5)
        outs.append(o.transpose(0, 1).reshape(ql, H * D))
        t += ql
    return torch.cat(outs)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("head_size", [32, 64, 128])    # 64 and 128 have the kernel's vector path
def test_decode_matches_plain_attention(dtype, tol, use_kernel, head_size, monkeypatch, cpu_isa):
    monkeypatch.setattr(sys.modules[__name__], "D", head_size)
    lens = [1, 5, 16, 17, 40, 100]
    attn, meta, tables, q, k, v = _setup(dtype, lens, use_kernel=use_kernel)
    out = attn(q, k, v, meta)
    ref = _reference(attn, tables, lens, [1] * len(lens), q)
    assert (out.float() - ref).abs().max() < tol


def test_mixed_prefill_and_decode_step(cpu_isa):
    lens, q_lens = [20, 7, 50, 3], [1, 7, 13, 1]
    attn, meta, tables, q, k, v = _setup(torch.float32, lens, q_lens, use_kernel=True)
    out = attn(q, k, v, meta)
    assert (out - _reference(attn, tables, lens, q_lens, q)).abs().max() < 1e-5


@pytest.mark.slow
def test_loading_the_kernel_keeps_subnormal_numbers():
    """A fast-math link would turn on flush-to-zero for the whole process (torch included)."""
    import subprocess
    import sys
    code = ("from shardlm import kernels; assert kernels.paged_decode_attention() is not None; "
            "import torch; print(5e-324 * 1.0 > 0, bool(torch.tensor([1e-40]).mul(1.0).item() > 0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_step_equals_the_unfused_one(dtype, cpu_isa):
    """One C call per layer (rotary + cache write + attention) from the qkv projection: the same
    output and cache contents, bit for bit, as rotary, the cache write and the kernel one by one."""
    from shardlm.layers.rotary import ApplyRotary
    apply_rotary = ApplyRotary()

    lens = [1, 5, 16, 17, 40, 100]
    outs, caches = [], []
    for fused in (True, False):
        attn, meta, tables, q, k, v = _setup(dtype, lens, use_kernel=True)
        T = len(lens)
        qkv = torch.cat([q.view(T, -1), k.view(T, -1), v.view(T, -1)], dim=1)
        gen = torch.Generator().manual_seed(1)
        cos, signed_sin = (torch.randn(T, 1, D, generator=gen).to(dtype) for _ in range(2))
        if fused:
            out = attn.backend.rotary_and_attend(attn, qkv, (cos, signed_sin), meta)
            assert out is not None, "a step of decodes only takes the fused path"
        else:
            qk = apply_rotary(qkv[:, :(H + HKV) * D].reshape(T, H + HKV, D), (cos, signed_sin))
            out = attn(qk[:, :H], qk[:, H:], v, meta)
        outs.append(out)
        caches.append((attn.k_cache.clone(), attn.v_cache.clone()))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_a_step_with_a_prompt_chunk_is_not_fused():
    attn, meta, tables, q, k, v = _setup(torch.float32, [20, 7], [1, 7], use_kernel=True)
    qkv = torch.cat([q.view(8, -1), k.view(8, -1), v.view(8, -1)], dim=1)
    cos = torch.ones(8, 1, D)
    assert attn.backend.rotary_and_attend(attn, qkv, (cos, cos), meta) is None


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 0.3)])
def test_fp8_cache_writes_as_torch_and_decodes_as_the_widened_cache(cache_dtype, dtype, scales, cpu_isa):
    """An FP8 KV cache in the C kernels: the fused step writes the bytes torch's write_slots writes
    (divided by the layer's scale, rounded to nearest even; past the range e4m3 saturates and e5m2
    goes to infinity; subnormals), and the decode equals plain attention over the cache widened
    times its scales."""
    from shardlm.attention.torch_paged import write_slots
    lens = [1, 5, 16, 17, 40, 100]
    T = len(lens)
    results = {}
    for fused in (True, False):
        attn, meta, tables, q, k, v = _setup(dtype, lens, use_kernel=fused)
        attn.k_scale, attn.v_scale = scales
        for name in ("k_cache", "v_cache"):
            setattr(attn, name, (getattr(attn, name).float() / 4).to(cache_dtype))
        special = torch.tensor([1e-7, -3e-3, 500.0, -70000.0, 0.0, 2.0 ** -8, 1.0, -0.3])
        k = k.clone()
        k[0, 0, :8] = special.to(dtype)                     # out of range, subnormal, zero
        qkv = torch.cat([q.view(T, -1), k.view(T, -1), v.view(T, -1)], dim=1)
        if fused:
            out = attn.backend.rotary_and_attend(attn, qkv, None, meta)
            assert out is not None, "an FP8 cache takes the C kernels"
        else:
            write_slots(attn.k_cache, meta.slot_mapping, k, attn.k_scale)
            write_slots(attn.v_cache, meta.slot_mapping, v, attn.v_scale)
            out = None
        results[fused] = (out, attn.k_cache.view(torch.uint8).clone(), attn.v_cache.view(torch.uint8).clone())
        if fused:
            widened = Attention(H, HKV, D, D ** -0.5)
            widened.k_cache = attn.k_cache.float().nan_to_num(0.0, 0.0, 0.0) * scales[0]
            widened.v_cache = attn.v_cache.float() * scales[1]
            ref = _reference(widened, tables, lens, [1] * T, q)
    assert torch.equal(results[True][1], results[False][1]) and torch.equal(results[True][2], results[False][2])
    # the first sequence's one key holds the out-of-range values: compared above, not attended here
    out = results[True][0].float()
    assert (out[1:] - ref[1:]).abs().max() < (1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("prefixes, chunks", [([0], [70]), ([50], [64]), ([16, 0, 30], [100, 5, 80])])
def test_a_long_prompt_chunk_attends_to_its_prefix_and_causally_to_itself(dtype, tol, prefixes, chunks):
    """Chunks of 64 queries or more after their cached prefixes: the CPU backend's two flash calls
    each (the prefix whole, the chunk causally, merged by log-sum-exp), beside a short chunk on the
    masked path, equal plain causal attention."""
    lens = [p + c for p, c in zip(prefixes, chunks)]
    attn, meta, tables, q, k, v = _setup(dtype, lens, chunks, use_kernel=True)
    out = attn(q, k, v, meta)
    assert (out.float() - _reference(attn, tables, lens, chunks, q)).abs().max() < tol
