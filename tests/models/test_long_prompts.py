"""Prompts several times longer than the step's token budget (max_num_batched_tokens) are
prefilled over several steps, some of which sample nothing. On every layout they give
transformers' tokens and prompt logprobs: alone, beside running decodes, with n > 1, after a
prefix-cache hit that ends mid-prompt, and when preempted in the middle of their prefill."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardlm import LLM, SamplingParams

BUDGET = 32                      # tokens per step: the long prompts take 4-7 steps to prefill
ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, max_num_batched_tokens=BUDGET)
MAX_TOKENS = 8


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


LONG, LONGER, SHORT = _tokens(150, 1), _tokens(200, 2), _tokens(9, 3)
# shares LONG's first 100 tokens: a prefix-cache hit of 6 blocks (96 tokens) that ends mid-prompt
SHARED = LONG[:100] + _tokens(110, 4)
PROMPTS = {"long": LONG, "longer": LONGER, "short": SHORT, "shared": SHARED}
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def hf_long(tiny_model_dir, hf):
    """Per model: transformers' greedy tokens (and top-5 sets) for each prompt, and the logprob
    of every prompt token of LONGER given the ones before it."""
    cache = {}

    def get(name: str, path: str | None = None):
        """path: another copy of the model's weights (transformers runs that one)."""
        path = path or tiny_model_dir(name)
        if path not in cache:
            greedy = dict(zip(PROMPTS, hf.greedy(path, list(PROMPTS.values()), MAX_TOKENS)))
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            with torch.inference_mode():
                logits = model(torch.tensor([LONGER])).logits[0]
            lps = torch.log_softmax(logits.float(), dim=-1)
            prompt_lps = [lps[i, LONGER[i + 1]].item() for i in range(len(LONGER) - 1)]
            cache[path] = greedy, prompt_lps
        return cache[path]
    return get


def run_long_prompt_workload(llm: LLM) -> dict:
    """The long-prompt cases, each through `llm`; -> their outputs by name."""
    out = {}
    # alone: the first steps hold nothing but a partial prompt (nothing to sample)
    [out["alone"]] = llm.generate([{"prompt_token_ids": LONGER}], GREEDY, use_tqdm=False)
    # without logprobs: under TP the vocabulary shards' greedy path
    [out["plain"]] = llm.generate([{"prompt_token_ids": LONGER}], SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    # beside running decodes, with n = 2 and prompt logprobs of a prompt split across steps
    mixed = llm.generate([{"prompt_token_ids": p} for p in (SHORT, LONG, LONGER)],
                         [GREEDY, SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                 logprobs=5),
                          SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5,
                                         prompt_logprobs=2)], use_tqdm=False)
    out["short"], out["long"], out["longer"] = mixed
    # LONG's blocks are cached now: SHARED starts after its first 96 tokens
    [out["shared"]] = llm.generate([{"prompt_token_ids": SHARED}], GREEDY, use_tqdm=False)
    return out


def assert_long_prompts_match_hf(out: dict, reference, hf, label: str) -> None:
    greedy, prompt_lps = reference
    for name, prompt in (("alone", "longer"), ("short", "short"), ("long", "long"), ("longer", "longer"),
                         ("shared", "shared")):
        hf.assert_close([greedy[prompt]], [out[name]], f"{label} {name}")
    assert out["long"].outputs[0].token_ids == out["long"].outputs[1].token_ids   # n = 2, greedy
    assert out["plain"].outputs[0].token_ids == out["alone"].outputs[0].token_ids
    plp = out["longer"].prompt_logprobs
    assert len(plp) == len(LONGER) and plp[0] is None, f"{label}: {len(plp)} prompt logprobs"
    ours = [plp[i + 1][LONGER[i + 1]].logprob for i in range(len(LONGER) - 1)]
    assert ours == pytest.approx(prompt_lps, abs=2e-4), label
    assert all(len(pos) >= 2 for pos in plp[1:])     # the prompt token and the top-2


@pytest.mark.slow
def test_long_prompts_on_one_rank(tiny_model_dir, hf_long, hf):
    llm = LLM(tiny_model_dir("llama-gqa"), **ENGINE)
    out = run_long_prompt_workload(llm)
    assert_long_prompts_match_hf(out, hf_long("llama-gqa"), hf, "tp=1")
    assert out["shared"].num_cached_tokens == 96
    assert sum(llm.collective_rpc("fused_decode_steps")) > 0     # the one-call decode path ran too
    # the same tokens as a budget that takes every prompt in one step
    whole = LLM(tiny_model_dir("llama-gqa"), **{**ENGINE, "max_num_batched_tokens": 2048})
    again = run_long_prompt_workload(whole)
    for name in out:
        assert [c.token_ids for c in out[name].outputs] == [c.token_ids for c in again[name].outputs], name


def test_whole_prompts_and_bounded_chunks_give_transformers_tokens(tiny_model_dir, hf_long, hf):
    """--no-enable-chunked-prefill (each prompt in one step) and --long-prefill-token-threshold
    (chunks of at most 20 tokens, under a budget of 64)."""
    engine = {k: v for k, v in ENGINE.items() if k != "max_num_batched_tokens"}
    whole = LLM(tiny_model_dir("llama-gqa"), **engine, enable_chunked_prefill=False)
    assert_long_prompts_match_hf(run_long_prompt_workload(whole), hf_long("llama-gqa"), hf, "whole prompts")
    whole.shutdown()
    bounded = LLM(tiny_model_dir("llama-gqa"), **engine, max_num_batched_tokens=64, long_prefill_token_threshold=20)
    assert_long_prompts_match_hf(run_long_prompt_workload(bounded), hf_long("llama-gqa"), hf, "20-token chunks")
    bounded.shutdown()
    with pytest.raises(ValueError, match="is smaller than max_model_len"):
        LLM(tiny_model_dir("llama-gqa"), **ENGINE, enable_chunked_prefill=False)


def test_preempted_in_the_middle_of_its_prefill(tiny_model_dir, hf_long, hf):
    """A cache of 12 usable blocks (192 tokens): LONG (150 tokens) prefills 31 tokens a step beside
    another request's decodes until the cache runs out, is preempted part-way and recomputed; its
    prompt logprobs are still answered once per position."""
    # 2 layers x 2 kv heads x 16 dims x 4 bytes x 2 (K, V) x 16 tokens = 8 KiB per block
    llm = LLM(tiny_model_dir("llama-gqa"), **{**ENGINE, "kv_cache_memory": 8192 * 13, "max_model_len": 192})
    lp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, prompt_logprobs=1)
    long_decode = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, logprobs=5)
    decoding, long = llm.generate([{"prompt_token_ids": _tokens(60, 5)}, {"prompt_token_ids": LONG}],
                                  [long_decode, lp], use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    greedy, _ = hf_long("llama-gqa")
    hf.assert_close([greedy["long"]], [long], "preempted")
    assert len(long.prompt_logprobs) == len(LONG)
    alone = LLM(tiny_model_dir("llama-gqa"), **ENGINE).generate([{"prompt_token_ids": LONG}], lp, use_tqdm=False)[0]
    assert [p[t].logprob for p, t in zip(long.prompt_logprobs[1:], LONG[1:])] == pytest.approx(
        [p[t].logprob for p, t in zip(alone.prompt_logprobs[1:], LONG[1:])], abs=1e-5)
    assert long.outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(decoding.outputs[0].token_ids) == 100


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [
    ("llama-gqa", dict(tensor_parallel_size=2)),
    ("llama-gqa", dict(pipeline_parallel_size=2)),
    ("llama-gqa", dict(data_parallel_size=2)),
    ("mixtral", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("mixtral", dict(data_parallel_size=2, enable_expert_parallel=True)),
    ("llama-gqa", dict(quantization="int8")),
], ids=["tp2", "pp2", "dp2", "tp2-ep", "dp2-ep", "int8"])
def test_long_prompts_on_every_layout(name, layout, tiny_model_dir, hf_long, hf, tmp_path):
    """Against transformers. Under DP + EP the replica without work runs dummy steps beside the
    other's partial prompt chunks."""
    llm = LLM(tiny_model_dir(name), **ENGINE, **layout)
    try:
        out = run_long_prompt_workload(llm)
    finally:
        llm.shutdown()
    reference = hf_long(name)
    if layout.get("quantization") == "int8":
        # transformers runs the weights the engine holds: each linear's int8 round trip
        from tests.models.test_quantized import _round_trip_model
        reference = hf_long(name, _round_trip_model(tiny_model_dir(name), tmp_path, bits=8, group=-1))
    assert_long_prompts_match_hf(out, reference, hf, str(layout))


_ALONE: dict[tuple, list[int]] = {}


def _alone(path: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The greedy tokens of one prompt run by itself, in one step's budget."""
    key = (path, tuple(prompt), max_tokens)
    if key not in _ALONE:
        llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
        _ALONE[key] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    return _ALONE[key]


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.integers(4, 48), max_num_seqs=st.integers(1, 6), extra_blocks=st.integers(0, 14),
       arrivals=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 200), st.integers(1, 12),
                                   st.one_of(st.none(), st.integers(0, 20))), min_size=1, max_size=6))
def test_random_arrivals_on_the_real_engine(tiny_model_dir, budget, max_num_seqs, extra_blocks, arrivals):
    """The scheduler property test's claim on the real engine (tests/unit/test_scheduler_properties.py):
    random arrivals, budgets, cache sizes (down to one max_model_len: preemptions) and aborts; every
    request not aborted gets its tokens when run alone, and the cache is empty when idle."""
    path = tiny_model_dir("llama-gqa")
    llm = LLM(path, dtype="float32", kv_cache_memory=8192 * (17 + extra_blocks), max_model_len=256,
              max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    engine, finished = llm.engine, {}
    prompts = [(_tokens(length, seed), max_tokens, step, abort)
               for seed, (step, length, max_tokens, abort) in enumerate(arrivals)]
    step = 0
    while step <= 12 or engine.has_unfinished_requests():
        for i, (prompt, max_tokens, arrive, abort) in enumerate(prompts):
            if arrive == step:
                engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(
                    temperature=0, max_tokens=max_tokens, ignore_eos=True))
            if abort is not None and arrive + abort == step and f"r{i}" not in finished:
                engine.abort_request(f"r{i}")
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        step += 1
    for i, (prompt, max_tokens, _, abort) in enumerate(prompts):
        if abort is None or f"r{i}" in finished:
            assert finished[f"r{i}"] == _alone(path, prompt, max_tokens), f"r{i}"
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0
