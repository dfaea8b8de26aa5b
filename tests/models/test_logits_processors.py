"""Custom logits processors with vLLM v1's interface (--logits-processors, LLM(logits_processors=)):
the batch updates keep a processor's view of the batch right step after step, requests opt in by
extra_args and the others are untouched, on one rank and across TP and PP ranks."""

import random

import pytest
import torch

from shardlm import LLM, SamplingParams
from shardlm.engine.errors import RequestFailedError
from shardlm.engine.feature_rules import UnsupportedCombination
from shardlm.layers.sampler import Sampler, SamplingBatch
from shardlm.logits_processor import MoveDirectionality, load_logits_processors, move_entries
from shardlm.worker.logits_processors import batch_update
from tests.custom_logits_processors import CountingAdapter, RaisingProcessor, TargetTokenProcessor

TARGET = "tests.custom_logits_processors:TargetTokenProcessor"


def test_batch_updates_take_the_processor_view_to_each_step_order():
    """A processor that follows the updates as vLLM's do (removed, added, moved) holds row i's
    request at index i after every step; swaps are between held indices, one-way moves into free
    ones, additions into free ones, and the batch never has holes."""
    rng = random.Random(0)
    slots, view, live, next_id = [], {}, [], 0
    for step in range(300):
        live = [r for r in live if rng.random() > 0.2]            # some finish, or sit out a step
        while len(live) < rng.randint(1, 9):
            live.append(f"r{next_id}")
            next_id += 1
        rng.shuffle(live)
        update, slots = batch_update(slots, live, lambda r: (r, None, []))
        if update is None:
            assert [view[i] for i in range(len(live))] == live
            continue
        for i in update.removed:
            assert i in view
            del view[i]
        for i, params, _, _ in update.added:
            assert i not in view and i < update.batch_size
            view[i] = params
        for a, b, direction in update.moved:
            assert a in view and (b in view) == (direction is MoveDirectionality.SWAP), (step, update)
            move_entries(view, [(a, b, direction)])
        assert update.batch_size == len(live) and view == dict(enumerate(live)), (step, update)
    assert batch_update(slots, live, None) == (None, live)       # nothing changed: None


def test_processors_load_by_name_or_class_and_bad_ones_are_named():
    assert load_logits_processors([TARGET, CountingAdapter]) == [TargetTokenProcessor, CountingAdapter]
    assert load_logits_processors(["tests.custom_logits_processors.TargetTokenProcessor"]) == [TargetTokenProcessor]
    for name, match in [("tests.custom_logits_processors:NotAProcessor", "not a subclass"),
                        ("no_such_module_xyz:P", "failed to import"),
                        ("tests.custom_logits_processors:Missing", "has no Missing"), ("P", "package.module:Class")]:
        with pytest.raises(ValueError, match=match):
            load_logits_processors([name])


def test_sampler_runs_the_two_groups_at_their_places():
    """First processors change the argmax of greedy rows; after-temperature ones see the scaled
    logits of random rows only, once."""
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    seen = []

    class Ban2:
        def apply(self, x):
            x[:, 2] = float("-inf")
            return x

    class Only0:
        def apply(self, x):
            seen.append(x.clone())
            x[:, 1:] = float("-inf")
            return x

    greedy = SamplingBatch(None, None, processors_first=[Ban2()])
    assert Sampler()(logits, greedy)[0] == [1, 1] and logits[0, 2] == 2.0      # the caller's logits unchanged
    hot = SamplingBatch(torch.tensor([0.5, 1.0]), torch.tensor([True, False]), processors_after_temperature=[Only0()])
    assert Sampler()(logits, hot)[0] == [2, 0]
    assert len(seen) == 1 and torch.equal(seen[0][1], logits[1]) and torch.equal(seen[0][0], logits[0])


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="32MiB", max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [[5 + i, 17, 23 + 3 * i, 40 + i] for i in range(6)]


def _params():
    """Greedy requests: two with a target token, one counting up, three left alone; a mix of
    lengths so that requests finish and the batch moves."""
    extra = [{"target_token": 42}, None, {"count": True}, None, {"target_token": 7}, None]
    return [SamplingParams(max_tokens=12 if i % 2 else 6 + i, temperature=0, extra_args=x, ignore_eos=True)
            for i, x in enumerate(extra)]


def _check(outs, reference):
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == [42] * 6 and got[4] == [7] * 10, got
    assert got[2] == list(range(100, 108)), got[2]
    for i in (1, 3, 5):                        # no extra_args: what the engine writes without processors
        assert got[i] == reference[i][:len(got[i])], (i, got[i], reference[i])


def test_requests_opt_in_and_the_others_are_untouched(tiny_model_dir, reference):
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="32MiB", max_model_len=256,
              max_num_seqs=4, logits_processors=[TARGET, CountingAdapter])
    try:
        _check(llm.generate(PROMPTS, _params(), use_tqdm=False), reference)
        with pytest.raises(ValueError, match="target_token='x'"):       # validate_params refuses it up front
            llm.generate(PROMPTS[0], SamplingParams(extra_args={"target_token": "x"}), use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_processor_that_raises_fails_its_step_and_the_engine_goes_on(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="32MiB", max_model_len=256,
              logits_processors=[RaisingProcessor])
    try:
        with pytest.raises(RequestFailedError, match="logits processors RaisingProcessor .RuntimeError: boom"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=1.0, extra_args={"boom": True}),
                         use_tqdm=False)
        fine = llm.generate(PROMPTS[1], SamplingParams(max_tokens=4, temperature=1.0), use_tqdm=False)[0]
        assert len(fine.outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_processor_that_cannot_start_stops_the_engine_named(tp, tiny_model_dir):
    with pytest.raises(Exception, match="BrokenAtStart failed to start: RuntimeError: no such vocabulary file"):
        LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="32MiB", tensor_parallel_size=tp,
            logits_processors=["tests.custom_logits_processors:BrokenAtStart"])


def test_logits_processors_refuse_speculative_decoding(tiny_model_dir):
    with pytest.raises(UnsupportedCombination, match="--logits-processors with --speculative-config"):
        LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="32MiB", logits_processors=[TARGET],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                    dict(data_parallel_size=2)])
def test_logits_processors_on_parallel_layouts(layout, tiny_model_dir, reference):
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="32MiB", max_model_len=256,
              max_num_seqs=4, logits_processors=[TARGET, CountingAdapter], **layout)
    try:
        _check(llm.generate(PROMPTS, _params(), use_tqdm=False), reference)
    finally:
        llm.shutdown()
