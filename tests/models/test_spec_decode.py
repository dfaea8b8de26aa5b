"""Speculative decoding: greedy outputs equal those without it (n-gram proposals at tp=1, tp=2,
pp=2 and dp=2, across preemption, with logprobs, stop strings and structured outputs); a
proposer that knows the answer has every token accepted, a random one changes nothing; and
sampled outputs keep their distribution (chi-square against sampling without speculation)."""

import random

import numpy as np
import pytest
import torch

from shardlm import LLM, SamplingParams
from shardlm.bench.random_eagle import make_random_eagle
from shardlm.engine.arg_utils import EngineArgs
from shardlm.sampling_params import StructuredOutputsParams
from shardlm.spec_decode.proposer import Proposer

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# token-id prompts that repeat themselves: prompt lookup finds proposals from the start
PROMPTS = [{"prompt_token_ids": ([100 + 7 * i, 200, 300 + i, 400] * 6)[:20 + i]} for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def chi2_contingency_p(table) -> float:
    """p-value of Pearson's chi-square test that the rows of a contingency table share one distribution."""
    t = np.asarray(table, dtype=np.float64)
    expected = t.sum(axis=1, keepdims=True) * t.sum(axis=0, keepdims=True) / t.sum()
    stat = ((t - expected) ** 2 / expected).sum()
    df = (t.shape[0] - 1) * (t.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def stats(llm: LLM) -> dict:
    return llm.stats()


def tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def generate(path: str, speculative_config=None, prompts=PROMPTS, params=GREEDY, **engine):
    """(tokens of each output, the engine's stats) from an engine of its own."""
    llm = LLM(path, **{**ENGINE, **engine}, speculative_config=speculative_config)
    try:
        return tokens(llm.generate(prompts, params, use_tqdm=False)), stats(llm)
    finally:
        llm.shutdown()


def generate_with_proposer(llm: LLM, proposer, prompts, params):
    """(outputs, stats before, stats after) of a tp=1 engine whose proposer is swapped for `proposer`."""
    runner = runner_of(llm)
    own, runner.proposer = runner.proposer, proposer
    try:
        before = stats(llm)
        return llm.generate(prompts, params, use_tqdm=False), before, stats(llm)
    finally:
        runner.proposer = own


def runner_of(llm: LLM):
    """The model runner of a tp=1 engine whose core runs in this process."""
    return llm.engine.engine_core.engine_core.executor.worker.runner


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    engine = LLM(tiny_model_dir("llama-gqa"), **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def spec(tiny_model_dir):
    engine = LLM(tiny_model_dir("llama-gqa"), **ENGINE, speculative_config=NGRAM)
    yield engine
    engine.shutdown()


def test_ngram_greedy_outputs_equal_plain_decoding(plain, spec):
    before = stats(spec)
    got = spec.generate(PROMPTS, GREEDY, use_tqdm=False)
    after = stats(spec)
    assert tokens(got) == tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert drafted > 0 and 0 < accepted <= drafted      # proposals were verified, and some kept
    assert sum(after["spec_accepted_per_position"]) == after["spec_num_accepted_tokens"]


def test_logprobs_stop_strings_and_max_tokens_are_unchanged(plain, spec):
    params = [SamplingParams(temperature=0, max_tokens=40, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[400]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    want = plain.generate(PROMPTS[:3], params, use_tqdm=False)
    got = spec.generate(PROMPTS[:3], params, use_tqdm=False)
    for w, g in zip(want, got):
        a, b = w.outputs[0], g.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                         b.stop_reason)
    lp_want, lp_got = want[0].outputs[0].logprobs, got[0].outputs[0].logprobs
    assert len(lp_got) == len(want[0].outputs[0].token_ids)
    for w, g in zip(lp_want, lp_got):
        assert sorted(w) == sorted(g)
        assert all(abs(w[t].logprob - g[t].logprob) < 1e-4 for t in w)


def test_stop_string_inside_accepted_drafts_ends_the_output_there(plain, spec):
    text = plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[stop])
    want = plain.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    got = spec.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, "stop", stop)


@pytest.mark.parametrize("draft", ["the target itself", "a random model"])
def test_draft_model_greedy_outputs_equal_plain_decoding(plain, tiny_model_dir, draft):
    target = tiny_model_dir("llama-gqa")
    model = target if draft == "the target itself" else tiny_model_dir("llama-draft")
    got, s = generate(target, {"model": model, "num_speculative_tokens": 3})
    assert got == tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert s["spec_num_draft_tokens"] > 0
    if draft == "the target itself":        # it proposes what the target will choose
        assert s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"]
    else:
        assert s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]


@pytest.mark.parametrize("kind", ["eagle 1 layer", "eagle 2 layers", "eagle3"])
def test_eagle_head_greedy_outputs_equal_plain_decoding(plain, tiny_model_dir, tmp_path, kind):
    target = tiny_model_dir("llama-gqa")
    head = make_random_eagle(target, tmp_path / "eagle", num_layers=2 if "2" in kind else 1, eagle3=kind == "eagle3")
    method = "eagle3" if kind == "eagle3" else "eagle"
    got, s = generate(target, {"method": method, "model": head, "num_speculative_tokens": 3})
    assert got == tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert s["spec_num_drafts"] > 0 and s["spec_num_accepted_tokens"] <= s["spec_num_draft_tokens"]


class Oracle(Proposer):
    """Proposes the reference continuation (or random tokens when wrong=True)."""

    def __init__(self, answers: dict[tuple, list[int]], k: int, wrong: bool = False):
        self.answers, self.k, self.wrong = answers, k, wrong
        self.rng = random.Random(0)

    def propose(self, requests):
        return {r.req_id: self.one(r.prompt_token_ids, r.output_token_ids) for r in requests}

    def one(self, prompt, output):
        if self.wrong:
            return [self.rng.randrange(49152) for _ in range(self.k)]
        answer = self.answers[tuple(prompt)]
        return answer[len(output):len(output) + self.k]


# penalties, min_tokens and a bias: each verified position must see the proposals before it as output
PENALIZED = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3,
                           repetition_penalty=1.2, min_tokens=5, logit_bias={500: 2.0})


@pytest.mark.parametrize("params", [GREEDY, PENALIZED], ids=["greedy", "penalized"])
@pytest.mark.parametrize("wrong", [False, True], ids=["knows-the-answer", "random"])
def test_a_proposer_that_knows_the_answer_has_every_token_accepted(plain, spec, wrong, params):
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    answers = {tuple(p["prompt_token_ids"]): o.outputs[0].token_ids for p, o in zip(PROMPTS, want)}
    got, before, after = generate_with_proposer(spec, Oracle(answers, 4, wrong), PROMPTS, params)
    assert tokens(got) == tokens(want)
    drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert drafted > 0
    if wrong:
        assert accepted < drafted / 100
    else:           # all right: 5 tokens a step after the first (the last step's drafts capped by max_tokens)
        assert accepted == drafted
        assert after["spec_num_drafts"] - before["spec_num_drafts"] == len(PROMPTS) * -(-(48 - 1) // 5)


def test_structured_outputs_mask_every_verified_position(plain, spec):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
              "required": ["a", "b"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    prompts = ["Give me JSON.", "Another one:"]
    want = plain.generate(prompts, params, use_tqdm=False)
    answers = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in want}
    got, before, after = generate_with_proposer(spec, Oracle(answers, 4), prompts, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert after["spec_num_accepted_tokens"] > before["spec_num_accepted_tokens"]


@pytest.mark.slow
def test_sampled_outputs_keep_their_distribution(tiny_model_dir, plain):
    """Three tokens from four allowed ones, 1200 seeded requests per arm; proposals are random
    allowed tokens (right about a quarter of the time): the marginal of each position and the
    joint of the last two match those of plain sampling (chi-square, p > 0.001)."""
    allowed = [500, 501, 502, 503]
    n = 1200
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True, allowed_token_ids=allowed)
              for i in range(n)]
    prompt = {"prompt_token_ids": [500, 501, 502, 503, 500, 501]}
    engine = LLM(tiny_model_dir("llama-gqa"), **ENGINE, speculative_config={**NGRAM, "disable_by_batch_size": 0})

    class RandomAllowed(Oracle):
        def one(self, prompt, output):
            return [self.rng.choice(allowed) for _ in range(self.k)]
    try:
        runner_of(engine).proposer = RandomAllowed({}, 2)
        got = np.array(tokens(engine.generate([prompt] * n, params, use_tqdm=False)))
        spec_stats = stats(engine)
    finally:
        engine.shutdown()
    want = np.array(tokens(plain.generate([prompt] * n, [p.clone() for p in params], use_tqdm=False)))
    assert spec_stats["spec_num_accepted_tokens"] > 0.1 * spec_stats["spec_num_draft_tokens"]
    for pos in range(3):
        table = [[(x[:, pos] == t).sum() for t in allowed] for x in (want, got)]
        table = [[c for c, other in zip(row, zip(*table)) if sum(other) > 0] for row in table]
        assert chi2_contingency_p(table) > 0.001, (pos, table)
    joint = [[((x[:, 1] == a) & (x[:, 2] == b)).sum() for a in allowed for b in allowed] for x in (want, got)]
    keep = [j for j in range(16) if joint[0][j] + joint[1][j] >= 5]
    assert chi2_contingency_p([[row[j] for j in keep] for row in joint]) > 0.001


def method_config(method: str, tiny_model_dir, tmp_path) -> dict:
    if method == "ngram":
        return NGRAM
    if method == "draft_model":
        return {"model": tiny_model_dir("llama-draft"), "num_speculative_tokens": 3}
    head = make_random_eagle(tiny_model_dir("llama-gqa"), tmp_path / method, eagle3=method == "eagle3")
    return {"method": method, "model": head, "num_speculative_tokens": 3}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                    dict(data_parallel_size=2)], ids=["tp2", "pp2", "dp2"])
def test_outputs_are_the_same_on_every_layout(tiny_model_dir, plain, tmp_path, layout, method):
    want = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    got, s = generate(tiny_model_dir("llama-gqa"), method_config(method, tiny_model_dir, tmp_path), **layout)
    assert got == tokens(want)
    assert s["spec_num_drafts"] > 0 and s["spec_num_accepted_tokens"] <= s["spec_num_draft_tokens"]
    if method == "ngram":
        assert s["spec_num_accepted_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_preempted_speculating_requests_recompute_to_the_same_output(tiny_model_dir, plain, tmp_path, method):
    """13 KV blocks for three requests of ~180 tokens: proposals are dropped and requests
    preempted when the cache is short; outputs equal plain decoding with a roomy cache."""
    prompts = [{"prompt_token_ids": ([100 + i, 200, 300, 400 + i] * 13)[:50]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=130, ignore_eos=True)
    # a proposer's KV shares the budget: per block, the draft's one narrow layer or the head's one layer
    memory = (8192 + {"ngram": 0, "draft_model": 2048, "eagle": 4096}[method]) * 14
    small = LLM(tiny_model_dir("llama-gqa"), **{**ENGINE, "kv_cache_memory": memory, "max_model_len": 192},
                speculative_config=method_config(method, tiny_model_dir, tmp_path))
    try:
        got = small.generate(prompts, params, use_tqdm=False)
        s = stats(small)
    finally:
        small.shutdown()
    assert s["num_preemptions"] > 0 and s["spec_num_drafts"] > 0
    assert tokens(got) == tokens(plain.generate(prompts, params, use_tqdm=False))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                    dict(data_parallel_size=2, enable_expert_parallel=True)], ids=["tp2-ep", "dp2-ep"])
def test_ngram_on_a_moe_model_with_expert_parallel(tiny_model_dir, layout):
    path = tiny_model_dir("mixtral")
    got, s = generate(path, NGRAM, **layout)
    assert got == generate(path)[0]
    assert 0 < s["spec_num_accepted_tokens"] <= s["spec_num_draft_tokens"]


def test_ngram_with_lora_adapters(tiny_model_dir, tmp_path):
    """Proposals are verified by the request's adapter: outputs equal LoRA without speculation."""
    from shardlm import LoRARequest
    from tests.lora_adapters import write_adapter
    base = tiny_model_dir("llama-gqa")
    lora = LoRARequest("one", 1, write_adapter(base, tmp_path / "one", seed=3))
    requests = [lora, None, lora, None, lora, None]
    outs = {}
    for name, extra in (("plain", {}), ("spec", {"speculative_config": NGRAM})):
        llm = LLM(base, **ENGINE, enable_lora=True, **extra)
        try:
            outs[name] = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=requests))
            if extra:
                s = stats(llm)
        finally:
            llm.shutdown()
    assert outs["spec"] == outs["plain"]
    assert s["spec_num_accepted_tokens"] > 0


def test_seeded_sampling_is_reproducible_and_chunked_prefill_changes_nothing(plain, tiny_model_dir):
    """A seeded request gives the same tokens on every run with speculation on (whatever runs beside
    it), and a step budget of 16 tokens (prompts prefilled in chunks; proposals within the budget)
    leaves greedy outputs as they were."""
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=32, ignore_eos=True)
    small, s = generate(tiny_model_dir("llama-gqa"), NGRAM, max_num_batched_tokens=16)
    assert small == tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert s["spec_num_accepted_tokens"] > 0
    alone = generate(tiny_model_dir("llama-gqa"), NGRAM, prompts=PROMPTS[:1], params=seeded)[0]
    crowd = generate(tiny_model_dir("llama-gqa"), NGRAM, prompts=PROMPTS, params=[seeded] + [GREEDY] * 5)[0]
    assert crowd[0] == alone[0]


@pytest.mark.slow
def test_an_eagle3_head_on_a_decoder_it_cannot_read_is_refused(tiny_model_dir, tmp_path):
    head = make_random_eagle(tiny_model_dir("llama-gqa"), tmp_path / "e3", eagle3=True)     # hidden 64, as gemma3
    with pytest.raises(ValueError, match="EAGLE-3 head reads the inputs of a Llama-family decoder"):
        EngineArgs(tiny_model_dir("gemma3"), dtype="float32", kv_cache_memory="16MiB",
                   speculative_config={"method": "eagle3", "model": head}).create_engine_config()


CP_PROMPTS = [{"prompt_token_ids": p["prompt_token_ids"] * 3} for p in PROMPTS]     # 60-75 tokens: 3 blocks
_ONE_RANK: dict = {}        # method -> (its speculative config, one rank's tokens and stats)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, decode_context_parallel_size=2),
                                    dict(prefill_context_parallel_size=2)], ids=["tp2-dcp2", "pcp2"])
def test_a_proposer_with_a_model_under_context_parallel(tiny_model_dir, tmp_path, layout, method):
    """The target spreads each block's positions over the context parallel ranks; the proposer,
    on the rank that samples, holds them all. A draft that is the target itself then has every
    token accepted (its cache must hold what the target's does), and an EAGLE-3 head (reading the
    residual streams of every -pcp group's tokens) proposes what it proposes on one rank."""
    target = tiny_model_dir("llama-tied-llama3rope")
    if method not in _ONE_RANK:             # (the head is random: one per method, for both layouts)
        head = tmp_path / method
        spec = ({"model": target, "num_speculative_tokens": 3} if method == "draft_model" else
                {"method": method, "model": make_random_eagle(target, head, eagle3=True), "num_speculative_tokens": 3})
        _ONE_RANK[method] = spec, generate(target, spec, CP_PROMPTS)
    spec, (want, one_rank) = _ONE_RANK[method]
    got, s = generate(target, spec, CP_PROMPTS, **layout)
    assert got == want
    assert s["spec_num_draft_tokens"] > 0
    if method == "draft_model":
        assert s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"]
    else:
        assert s["spec_num_accepted_tokens"] == one_rank["spec_num_accepted_tokens"]
