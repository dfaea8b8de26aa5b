"""--kv-cache-dtype fp8: the cache stores one byte a value (twice bfloat16's tokens in the same
memory), written and read through the FP8 conversion; greedy outputs stay within the unquantized
cache's top-5 (FP8 keeps 3 mantissa bits: near-ties may flip)."""

import pytest
import torch

from shardlm import LLM, SamplingParams
from shardlm.attention.torch_paged import AttentionBucket, gather, write_slots
from tests.models.test_tiny_models_vs_hf import _prompts


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_a_written_slot_reads_back_as_its_fp8_value(scale):
    """Written divided by the layer's scale into FP8, read back widened and multiplied by it."""
    cache = torch.zeros(2, 4, 16, 8, dtype=torch.float8_e4m3fn)          # [Hkv, blocks, block, D]
    rows = torch.randn(3, 2, 8) * 4                                     # [T, Hkv, D]
    write_slots(cache, torch.tensor([17, 18, 40]), rows, scale)

    class Layer:
        k_cache = v_cache = cache
        num_kv_heads, head_dim, v_head_dim, values_in_keys = 2, 8, 8, False
        k_scale = v_scale = scale
    bucket = AttentionBucket(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[1, 2]]), torch.tensor([32]), True)
    keys, _ = gather(Layer, bucket, torch.float32)                      # blocks 1 and 2: slots 16..47
    assert keys.dtype == torch.float32
    want = ((rows / scale).to(torch.float8_e4m3fn).float() * scale).transpose(0, 1)
    assert torch.equal(keys[:, 0, [1, 2, 24]], want)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_holds_twice_the_tokens_and_stays_in_the_top5(kv_dtype, tiny_model_dir):
    path = tiny_model_dir("llama-gqa")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    runs = {}
    for kv in ("auto", kv_dtype):
        llm = LLM(path, dtype="bfloat16", kv_cache_memory="8MiB", kv_cache_dtype=kv)
        runs[kv] = (llm.generate(_prompts(), params, use_tqdm=False), llm.stats()["kv_cache_tokens"])
        llm.shutdown()
    (ref, plain), (outs, packed) = runs["auto"], runs[kv_dtype]
    assert abs(packed - 2 * plain) <= 16 * 2                          # within a block either side
    for r, o in zip(ref, outs):
        for i, token in enumerate(o.outputs[0].token_ids):
            assert token in r.outputs[0].logprobs[i], f"position {i}: {token} not in the top-5"
            if token != r.outputs[0].token_ids[i]:
                break                                                 # the rest follows another prefix


def test_an_unknown_kv_cache_dtype_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'.*fp8"):
        LLM(tiny_model_dir("llama-gqa"), kv_cache_dtype="int4")
