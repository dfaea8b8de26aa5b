"""Sliding-window layers keep only their window (kv_cache_groups.py): the capacity that buys, and
outputs unchanged by it on a model with several groups."""

import random

from shardlm import LLM, SamplingParams


def test_a_gemma3_shaped_model_holds_five_times_the_tokens_of_full_attention(tiny_model_dir):
    """KV tokens per GiB at max_model_len 4096, 12 layers (windows of 64 on five of every six),
    against the same model with full attention everywhere. A block id holds 2 layers (the full
    ones) and a request of 4096 tokens holds 256 of the full group's and 5 of each of the five
    window groups': 281 x 2 layer-blocks, against 256 x 12."""
    gib = 64 << 20
    per_gib = {}
    for name in ("gemma3-12-layers", "gemma3-12-layers-full"):
        llm = LLM(tiny_model_dir(name), dtype="float32", kv_cache_memory=gib, max_model_len=4096)
        per_gib[name] = llm.stats()["kv_cache_tokens"] / (gib / (1 << 30))
        llm.shutdown()
    ratio = per_gib["gemma3-12-layers"] / per_gib["gemma3-12-layers-full"]
    assert 5.3 < ratio < 5.6, per_gib          # 256 * 12 / (281 * 2) = 5.47


def test_six_groups_give_the_tokens_of_one(tiny_model_dir):
    """Prompts up to 8 windows long, in chunks of 48 (crossing window and block boundaries), a
    second pass from the prefix cache, and a cache small enough to preempt: the same greedy
    tokens as with every position kept (which test_tiny_models_vs_hf checks against transformers)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (20, 70, 200, 333, 500)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    path = tiny_model_dir("gemma3-12-layers")
    kept = LLM(path, dtype="float32", kv_cache_memory="64MiB", max_model_len=1024,
               disable_hybrid_kv_cache_manager=True).generate(prompts, params, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in kept]
    grouped = LLM(path, dtype="float32", kv_cache_memory="64MiB", max_model_len=1024, max_num_batched_tokens=48)
    for _ in range(2):
        outs = grouped.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert grouped.stats()["prefix_cache_hits"] > 0
    # 8 KiB a block id; 105 usable: one request of 1024 tokens in chunks of 48 (64 blocks, and 8 for
    # each window group: 63 positions before a chunk and its 48 span 8), not all five
    small = LLM(path, dtype="float32", kv_cache_memory=8192 * 106, max_model_len=1024, max_num_batched_tokens=48)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
