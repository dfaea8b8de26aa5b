"""Context parallel in worker processes, decode (-dcp) and prefill (-pcp): long prompts give
transformers' tokens and those of the layout without it, with chunked prefill, prefix-cache
hits, preemption, pipeline and data parallel, n-gram speculation; the KV cache holds N times
the tokens in the same memory per rank; every size that cannot work is refused up front, naming
the ones that can."""

import functools
import random

import pytest

from shardlm import LLM, SamplingParams
from shardlm.engine.arg_utils import EngineArgs

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def _long_prompts(lengths=(300, 181, 47, 260), seed=3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]


def _run(path, prompts, params=GREEDY, **kwargs):
    llm = LLM(path, dtype="float32", **{"kv_cache_memory": "16MiB", "max_model_len": 512, **kwargs})
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, llm.stats()
    finally:
        llm.shutdown()


@functools.cache
def _reference(path: str, prompts: tuple, **layout) -> list[list[int]]:
    """The tokens of a layout without context parallel (computed once per module run)."""
    return _ids(_run(path, [list(p) for p in prompts], **layout)[0])


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", [
    ("llama-tied-llama3rope", dict(tensor_parallel_size=2, decode_context_parallel_size=2)),
    ("llama-gqa", dict(tensor_parallel_size=4, decode_context_parallel_size=2, dcp_kv_cache_interleave_size=2)),
    ("llama-tied-llama3rope", dict(tensor_parallel_size=2, decode_context_parallel_size=2,
                                   prefill_context_parallel_size=2, dcp_kv_cache_interleave_size=4)),
    # a sliding window of 8 keys, compared by global position on each rank's share
    ("mistral-window", dict(tensor_parallel_size=4, decode_context_parallel_size=2, prefill_context_parallel_size=2)),
    # attention sinks (a logit per head beside the keys, merged as one more partial), windows, experts
    ("gpt-oss", dict(prefill_context_parallel_size=2)),
    ("gpt-oss", dict(tensor_parallel_size=4, decode_context_parallel_size=2)),
])
def test_context_parallel_matches_hf_on_long_prompts(name, layout, tiny_model_dir, hf):
    """One KV head at tp=2; two KV heads at tp=4 (each replicated on a DCP pair); both kinds
    (each sequence's KV over 4 ranks; -pcp alone is in the tests below and on Ray)."""
    path = tiny_model_dir(name)
    prompts = _long_prompts()
    outs, stats = _run(path, prompts, **layout)
    exact = hf.assert_close(hf.greedy(path, prompts, MAX_TOKENS), outs, f"{name} {layout}")
    assert exact >= 3, f"only {exact}/4 sequences equal HF exactly"


@pytest.mark.slow
@pytest.mark.parametrize("base,cp", [(dict(tensor_parallel_size=2), dict(decode_context_parallel_size=2)),
                                     (dict(), dict(prefill_context_parallel_size=2))])
def test_context_parallel_with_chunked_prefill_prefix_hits_and_preemption(base, cp, tiny_model_dir):
    """At the same KV memory per rank as the layout without it: twice the tokens, and its tokens."""
    path = tiny_model_dir("llama-tied-llama3rope")
    prompts = _long_prompts()
    shared = [prompts[0][:200] + p[:30] for p in prompts]       # prefix-cache hits on the second pass
    # 4 KiB per block per rank: 20 usable blocks of 16 tokens without context parallel, of 32 with
    small = dict(kv_cache_memory=4096 * 21, max_num_batched_tokens=64, max_model_len=320, **base)
    want, plain = _run(path, prompts + shared, **small)
    llm = LLM(path, dtype="float32", dcp_kv_cache_interleave_size=4, **small, **cp)
    try:
        got = llm.generate(prompts + shared, GREEDY, use_tqdm=False)
        again = llm.generate(shared, GREEDY, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert stats["kv_cache_tokens"] == 2 * plain["kv_cache_tokens"] == 2 * 20 * 16
    assert stats["num_preemptions"] > 0
    assert _ids(got) == _ids(want)
    assert _ids(again) == _ids(want)[len(prompts):]
    assert all(o.num_cached_tokens >= 192 for o in again)       # 6 blocks of 32 of the 200 shared


@pytest.mark.slow
@pytest.mark.parametrize("base,layout", [
    (dict(tensor_parallel_size=2), dict(decode_context_parallel_size=2, pipeline_parallel_size=2)),
    (dict(tensor_parallel_size=2), dict(decode_context_parallel_size=2, data_parallel_size=2)),
    (dict(), dict(prefill_context_parallel_size=2, pipeline_parallel_size=2)),
])
def test_context_parallel_with_pipeline_or_data_parallel_and_ngram(base, layout, tiny_model_dir):
    path = tiny_model_dir("llama-tied-llama3rope")
    # two random prompts, two that repeat themselves (the n-gram lookup finds proposals)
    prompts = _long_prompts()[:2] + [([100 + 7 * i, 200, 300 + i, 400] * 80)[:250 + 9 * i] for i in range(2)]
    want = _reference(path, tuple(map(tuple, prompts)), **base)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    got, stats = _run(path, prompts, speculative_config=ngram, **base, **layout)
    assert _ids(got) == want
    assert stats["spec_num_draft_tokens"] > 0


@pytest.mark.parametrize("name", ["qwen3", pytest.param("gpt-oss", marks=pytest.mark.slow),
                                  pytest.param("gemma3-12-layers", marks=pytest.mark.slow)])
def test_a_group_without_a_token_in_a_step_runs_it_empty(name, tiny_model_dir):
    """One request decoding alone under -pcp 2: each decode token belongs to one group and the
    other computes none. Models with per-head q/k norms (Qwen3, Gemma 3) or attention sinks
    (GPT-OSS) shaped that empty step by -1 and crashed; each now gives the tokens of one group."""
    path = tiny_model_dir(name)
    prompt = [[100, 200, 300]]
    want = _ids(_run(path, prompt)[0])
    assert _ids(_run(path, prompt, prefill_context_parallel_size=2)[0]) == want


@pytest.mark.parametrize("kwargs,message", [
    (dict(tensor_parallel_size=2, decode_context_parallel_size=3), r"must divide tensor_parallel_size=2.*-dcp can "
                                                                   r"be 1, 2"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2, model="llama-gqa"),
     r"2 KV heads: decode context parallel size 2 cannot run at tensor parallel size 2.*-dcp can be 1\b"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2, dcp_kv_cache_interleave_size=3),
     r"dcp_kv_cache_interleave_size=3 must divide block_size=16"),
])
def test_sizes_that_cannot_work_are_refused_naming_those_that_can(kwargs, message, tiny_model_dir):
    kwargs = {"model": "llama-tied-llama3rope", **kwargs}
    kwargs["model"] = tiny_model_dir(kwargs["model"])
    with pytest.raises(ValueError, match=message):
        EngineArgs(dtype="float32", kv_cache_memory="16MiB", **kwargs).create_engine_config()
