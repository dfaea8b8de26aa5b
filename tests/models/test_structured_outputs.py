"""Structured outputs: on a random-weight model, where only the constraint can make the output
valid, every JSON-schema output parses and validates, a choice is one of the choices, a regex
output matches, a grammar output parses; the same with n > 1, stop strings, min_tokens and
penalties; across preemption; and equal at tp=1, tp=2, pp=2 and dp=2 for the same seed. The
mask itself against a reference, and unconstrained rows untouched."""

import json
import re

import numpy as np
import pytest
import torch

from shardlm import LLM, SamplingParams
from shardlm.layers.sampler import MaskDisallowed, Sampler, SamplingBatch, TokenBitmask
from shardlm.sampling_params import StructuredOutputsParams

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["id", "ok", "color"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,5}-[0-9]{2}"
CHOICES = ["alpha", "beta gamma", "delta"]
GBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
PROMPTS = ["Write something.", "The answer is", "Tell me about the sea.", "JSON please:"]


def valid_json(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and set(value) == {"id", "ok", "color"} and type(value["id"]) is int
            and 0 <= value["id"] <= 999 and type(value["ok"]) is bool and value["color"] in ("red", "green", "blue"))


CONSTRAINTS = {
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), valid_json),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
    "grammar": (StructuredOutputsParams(grammar=GBNF), lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
}


def params(kind: str, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": 7, "max_tokens": 80, **kw},
                          structured_outputs=CONSTRAINTS[kind][0])


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(tiny_model_dir("llama-gqa"), **ENGINE)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_output_of_a_random_model_satisfies_its_constraint(llm, kind):
    outs = llm.generate(PROMPTS, params(kind, n=2), use_tqdm=False)
    for out in outs:
        for sample in out.outputs:
            assert sample.finish_reason == "stop", (kind, sample.text)
            assert CONSTRAINTS[kind][1](sample.text), (kind, sample.text)
    unconstrained = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=7, max_tokens=20), use_tqdm=False)
    assert not all(CONSTRAINTS[kind][1](o.outputs[0].text) for o in unconstrained), "the model alone is random"


def test_json_object_on_the_default_model(default_model_dir):
    """Any JSON object (unbounded: a random model would fill it until max_tokens); the real model closes it."""
    real = LLM(default_model_dir, dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
    try:
        outs = real.generate(["Give the user's name and age as JSON. Name: Ann, age: 31."],
                             SamplingParams(temperature=0, max_tokens=60,
                                            structured_outputs=StructuredOutputsParams(json_object=True)),
                             use_tqdm=False)
    finally:
        real.shutdown()
    assert isinstance(json.loads(outs[0].outputs[0].text), dict), outs[0].outputs[0].text


def test_constraints_hold_under_every_sampler_and_beside_unconstrained_requests(llm):
    samplers = [dict(temperature=0), dict(top_k=5), dict(top_p=0.5), dict(min_p=0.2),
                dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
                dict(logit_bias={"90": 50.0}), dict(min_tokens=3), dict(logprobs=3)]
    prompts, all_params = [], []
    for i, extra in enumerate(samplers):
        prompts += [PROMPTS[i % 4], PROMPTS[(i + 1) % 4]]
        all_params += [params("json", **extra), SamplingParams(temperature=1.0, seed=i, max_tokens=12)]
    outs = llm.generate(prompts, all_params, use_tqdm=False)
    for extra, constrained, free in zip(samplers, outs[::2], outs[1::2]):
        assert valid_json(constrained.outputs[0].text), (extra, constrained.outputs[0].text)
        assert len(free.outputs[0].token_ids) == 12, "an unconstrained neighbour runs as before"


def test_a_constrained_request_alone_equals_it_in_a_batch(llm):
    """Seeded sampling: the mask depends only on the request's own tokens."""
    alone = llm.generate(PROMPTS[:1], params("regex"), use_tqdm=False)[0].outputs[0].text
    batch = llm.generate(PROMPTS, [params("regex")] + [params("json")] * 3, use_tqdm=False)
    assert batch[0].outputs[0].text == alone


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                    dict(data_parallel_size=2)])
def test_constrained_outputs_are_the_same_on_every_layout(llm, tiny_model_dir, layout):
    kinds = ["json", "regex", "choice", "grammar"]
    sampled = [params(k) for k in kinds]
    greedy = [params(k, temperature=0) for k in kinds]      # tp=2: argmax on the vocabulary shards
    want = llm.generate(PROMPTS * 2, sampled + greedy, use_tqdm=False)
    other = LLM(tiny_model_dir("llama-gqa"), **ENGINE, **layout)
    try:
        got = other.generate(PROMPTS * 2, sampled + greedy, use_tqdm=False)
    finally:
        other.shutdown()
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert all(CONSTRAINTS[k][1](o.outputs[0].text) for k, o in zip(kinds * 2, got))


@pytest.mark.slow
def test_preempted_constrained_requests_recompute_to_the_same_output(tiny_model_dir, llm):
    """12 usable KV blocks: long constrained generations preempt each other; the matcher follows
    the tokens each request keeps, so outputs equal those of a roomy cache."""
    grammar = StructuredOutputsParams(regex="[a-z ]{150,160}")
    p = [SamplingParams(temperature=0, max_tokens=130, structured_outputs=grammar)] * 3
    prompts = [{"prompt_token_ids": list(range(100 + 50 * i, 150 + 50 * i))} for i in range(3)]
    small = LLM(tiny_model_dir("llama-gqa"), **{**ENGINE, "kv_cache_memory": 8192 * 13, "max_model_len": 192})
    try:
        outs = small.generate(prompts, p, use_tqdm=False)
        assert small.stats()["num_preemptions"] > 0
    finally:
        small.shutdown()
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in llm.generate(prompts, p, use_tqdm=False)]
    assert all(re.fullmatch("[a-z ]{150,160}", o.outputs[0].text) for o in outs)


def test_a_malformed_constraint_is_refused_at_once(llm):
    for bad, what in [(StructuredOutputsParams(regex="[a-"), "regex"),
                      (StructuredOutputsParams(json={"type": "nonsense"}), "json"),
                      (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar")]:
        with pytest.raises(ValueError, match=f"structured_outputs.{what} is invalid"):
            llm.generate(["x"], SamplingParams(structured_outputs=bad), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.choice is too large"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["y" * 1000] * 300)),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of json, regex"):
        StructuredOutputsParams(regex="a", choice=["a"])
    assert llm.generate(["x"], params("choice"), use_tqdm=False)[0].outputs[0].text in CHOICES, "still serving"


def test_the_bitmask_masks_exactly_the_disallowed_tokens_in_torch():
    check_mask("forward_native")


def test_the_bitmask_masks_exactly_the_disallowed_tokens_in_c(cpu_isa):
    """kernels/fused_ops.c: mask_disallowed, in every ISA variant this CPU runs."""
    check_mask("forward_cpu")


def check_mask(impl: str):
    """Rows 1 and 3 of 4 constrained over a 100-token vocabulary (4 words, bits past 100 unused);
    logits columns as a shard [start, end) sees them."""
    rng = np.random.default_rng(0)
    allowed = rng.random((2, 100)) < 0.3
    allowed[0, 32:64] = True                 # a whole word allowed
    words = np.zeros((2, 4), dtype=np.uint32)
    for r, t in zip(*allowed.nonzero()):
        words[r, t // 32] |= np.uint32(1 << (t % 32))
    for start, end in [(0, 100), (0, 50), (50, 100), (90, 128)]:
        logits = torch.randn(4, end - start)
        got = getattr(MaskDisallowed(), impl)(logits.clone(), TokenBitmask(torch.tensor([1, 3]), words.view(np.int32),
                                                                         start))
        want = logits.clone()
        for i, row in enumerate([1, 3]):
            for v in range(end - start):
                if not (start + v < 100 and allowed[i, start + v]):
                    want[row, v] = float("-inf")
        assert torch.equal(got, want), (impl, start, end)


def test_the_sampler_applies_the_mask_to_constrained_rows_only():
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    words = np.array([[1 << 3 | 1 << 17, 0]], dtype=np.int32)         # tokens 3 and 17
    allowed = TokenBitmask(torch.tensor([1]), words)
    batch = SamplingBatch(temperature=None, greedy=None, allowed=allowed)
    tokens, _ = Sampler()(logits, batch)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert tokens[1] == (3 if logits[1, 3] > logits[1, 17] else 17)
    hot = SamplingBatch(temperature=torch.full((3,), 5.0), greedy=torch.zeros(3, dtype=torch.bool),
                        allowed=allowed)
    assert all(Sampler()(logits, hot)[0][1] in (3, 17) for _ in range(50))


def test_the_mask_of_some_rows_is_numbered_from_zero():
    """What a request sampled alone (after its step's sampling failed) is constrained by."""
    words = np.arange(12, dtype=np.int32).reshape(3, 4)
    mask = TokenBitmask(torch.tensor([0, 2, 3]), words, first_token=7)
    one = mask.rows_between(2, 4)
    assert one.rows.tolist() == [0, 1] and np.array_equal(one.words, words[1:]) and one.first_token == 7
    assert mask.rows_between(1, 2) is None


def test_chunked_prefill_stop_strings_and_abort_while_compiling(tiny_model_dir):
    """A prompt prefilled over several steps (budget 32 tokens) is masked only where it samples;
    a stop string ends a constrained output like any other; a request aborted while its
    constraint compiles leaves the engine serving."""
    llm = LLM(tiny_model_dir("llama-gqa"), **{**ENGINE, "max_num_batched_tokens": 32})
    try:
        long_prompt = {"prompt_token_ids": list(range(300, 400))}
        out = llm.generate([long_prompt], params("regex"), use_tqdm=False)[0].outputs[0]
        assert CONSTRAINTS["regex"][1](out.text), out.text
        stopped = llm.generate(PROMPTS[:1], params("choice", stop=["eta"]), use_tqdm=False)[0].outputs[0]
        assert stopped.text in ("alpha", "delta") or (stopped.text == "b" and stopped.stop_reason == "eta"), stopped
        engine = llm.engine
        engine.add_request("gone", {"prompt_token_ids": [5, 6, 7]}, params("json"))
        engine.abort_request(["gone"])
        assert llm.generate(PROMPTS[:1], params("choice"), use_tqdm=False)[0].outputs[0].text in CHOICES
    finally:
        llm.shutdown()


FOUR_FIELDS = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                "member": {"type": "boolean"},
                                                "tier": {"enum": ["gold", "silver", "bronze"]}},
               "required": ["name", "age", "member", "tier"], "additionalProperties": False}


def _ended_as_json(outs) -> list[bool]:
    import jsonschema
    ok = []
    for sample in (s for o in outs for s in o.outputs):
        try:
            jsonschema.validate(json.loads(sample.text), FOUR_FIELDS)
            ok.append(sample.finish_reason == "stop")
        except (json.JSONDecodeError, jsonschema.ValidationError):
            ok.append(False)
    return ok


def _json_samples(engine, **constraint) -> list[bool]:
    sp = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=160,
                        structured_outputs=StructuredOutputsParams(json=FOUR_FIELDS, **constraint))
    return _ended_as_json(engine.generate(PROMPTS, sp, use_tqdm=False))


def test_json_whitespace_is_bounded_by_default_so_every_object_ends(llm):
    """A random model at temperature 1 pads with whitespace when it may (vLLM's default has the same
    failure): by default at most one space between items, so every output is the whole object."""
    assert all(_json_samples(llm)), "default options: every output valid JSON"
    assert all(_json_samples(llm, disable_any_whitespace=True))
    assert not all(_json_samples(llm, any_whitespace=True)), "any_whitespace restores the padding"
    with pytest.raises(ValueError, match="at most one of"):
        StructuredOutputsParams(json=FOUR_FIELDS, any_whitespace=True, whitespace_pattern=" ")


@pytest.mark.slow
def test_json_whitespace_is_bounded_at_tp2(tiny_model_dir):
    engine = LLM(tiny_model_dir("llama-gqa"), tensor_parallel_size=2, **ENGINE)
    try:
        assert all(_json_samples(engine))
    finally:
        engine.shutdown()
