"""Speculative decoding's parts: the config's checks, prompt lookup, the acceptance rule, the
counters, and the scheduler's side (KV slots for proposals, handed back when rejected; dropped
before preempting; capped by max_tokens, the budget and the request's lookahead)."""

import numpy as np
import pytest

from shardlm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from shardlm.core.request import Request
from shardlm.core.scheduler import SPEC_BACKOFF, Scheduler
from shardlm.messages import ModelRunnerOutput
from shardlm.sampling_params import SamplingParams
from shardlm.spec_decode.ngram import NgramProposer, propose_ngram
from shardlm.spec_decode.proposer import ProposalRequest
from shardlm.spec_decode.stats import SpecDecodingStats
from shardlm.spec_decode.verify import accepted_tokens

BS = 4


def test_config_defaults_and_refusals():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)       # vLLM's, when neither is given
    assert SpeculativeConfig.from_json({"prompt_lookup_max": 3}).prompt_lookup_min == 3
    assert SpeculativeConfig.from_json({}).disable_by_batch_size == SpeculativeConfig.DEFAULT_DISABLE_BY_BATCH_SIZE
    assert SpeculativeConfig(disable_by_batch_size=0).speculates(10_000)
    assert not SpeculativeConfig(disable_by_batch_size=4).speculates(4)
    for bad, words in [("{", "not JSON"), ('{"num_speculative_tokens": 0}', "from 1 to 16"),
                       ('{"method": "medusa"}', "use ngram"), ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}',
                                                              "above prompt_lookup_max"),
                       ('{"num_speculative_token": 3}', "unknown field"), ("[3]", "JSON object")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.from_json(bad)


def test_prompt_lookup_takes_the_longest_most_recent_match():
    t = np.array([1, 2, 3, 9, 5, 2, 3, 8, 7, 2, 3])
    assert propose_ngram(t, 1, 3, 2) == [8, 7]           # "2 3" last occurred before 8 7
    assert propose_ngram(np.array([5, 1, 2, 3, 4, 6, 2, 3, 7, 1, 2, 3]), 1, 3, 3) == [4, 6, 2]   # "1 2 3" beats "2 3"
    assert propose_ngram(t, 3, 3, 2) == []                # no earlier "9 2 3"... nor any 3-gram ending "2 3"
    assert propose_ngram(np.array([4, 4]), 1, 5, 3) == [4]
    assert propose_ngram(np.array([4]), 1, 5, 3) == []


def test_proposer_keeps_each_request_history_as_it_grows():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2))
    prompt = [10, 11, 12, 13]

    def propose(prompt, output):
        return p.propose([ProposalRequest("r", prompt, output, [], 2)]).get("r", [])
    assert propose(prompt, []) == []
    assert propose(prompt, [10]) == [11, 12]
    assert propose(prompt, [10, 11, 12, 13, 10] + list(range(200))) == []     # grown past its buffer
    p.forget("r")
    assert propose([1, 2, 1], []) == [2, 1]


def test_accepted_tokens():
    assert accepted_tokens([5], []) == [5]
    assert accepted_tokens([5, 6, 7], [5, 6]) == [5, 6, 7]         # all accepted, and one more
    assert accepted_tokens([5, 9, 7], [5, 6]) == [5, 9]            # the first miss is replaced
    assert accepted_tokens([4, 6, 7], [5, 6]) == [4]


def test_stats_add_up_and_subtract():
    s = SpecDecodingStats()
    s.observe(3, 2)
    s.observe(4, 0)
    assert s.as_dict() == {"spec_num_drafts": 2, "spec_num_draft_tokens": 7, "spec_num_accepted_tokens": 2,
                           "spec_accepted_per_position": [1, 1, 0, 0]}
    total = SpecDecodingStats.total([s, SpecDecodingStats(1, 2, 1, [1, 0])])
    assert total.as_dict()["spec_accepted_per_position"] == [2, 1, 0, 0]
    assert total.minus(s).as_dict() == {"spec_num_drafts": 1, "spec_num_draft_tokens": 2,
                                        "spec_num_accepted_tokens": 1, "spec_accepted_per_position": [1, 0, 0, 0]}
    assert "Mean acceptance length: 2.00" in total.describe(1.0)     # 3 accepted over 3 proposals


def scheduler(num_blocks=64, k=4, budget=64):
    return Scheduler(SchedulerConfig(8, budget, 1000), CacheConfig(block_size=BS, enable_prefix_caching=True),
                     num_blocks, speculative=SpeculativeConfig(num_speculative_tokens=k))


def req(rid, n_prompt, max_tokens=32, first=0):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=[99], max_model_len=1000, block_size=BS)


def run(s, tokens: dict, drafts: dict):
    so = s.schedule()
    return so, s.update(so, ModelRunnerOutput(tokens, draft_token_ids=drafts))


def test_proposals_take_kv_slots_and_rejected_ones_are_handed_back():
    s = scheduler()
    r = req("a", 6)
    s.add_request(r)
    so, _ = run(s, {"a": [50]}, {"a": [51, 52, 53]})        # prefill; proposals for the next step
    assert so.propose_drafts and r.spec_token_ids == [51, 52, 53]
    so = s.schedule()
    (c,) = so.chunks
    assert (c.token_ids, c.start_pos, c.num_draft_tokens, c.sample) == ([50, 51, 52, 53], 6, 3, True)
    assert len(c.block_tables[0]) == 3                             # positions 6..9 need a third block
    assert r.num_computed_tokens == 10
    out = s.update(so, ModelRunnerOutput({"a": [51, 60]}))  # 51 accepted, 52 rejected: 60 instead
    assert out[0].new_token_ids == [51, 60]
    assert r.output_token_ids == [50, 51, 60] and r.num_computed_tokens == 8      # positions 8, 9 recomputed
    assert r.spec_lookahead == 3                             # a miss: one fewer next time
    assert s.spec_stats.as_dict()["spec_accepted_per_position"] == [1, 0, 0]


def test_proposals_are_capped_by_max_tokens_budget_and_lookahead():
    s = scheduler(k=4, budget=3)
    r = req("a", 2, max_tokens=5)
    s.add_request(r)
    run(s, {"a": [50]}, {"a": [1, 2, 3, 4]})
    so = s.schedule()
    assert so.chunks[0].num_draft_tokens == 2                # budget 3: the last token and two proposals
    s.update(so, ModelRunnerOutput({"a": [1, 2, 3]}, draft_token_ids={"a": [4, 5, 6, 7]}))
    so = s.schedule()
    assert so.chunks[0].num_draft_tokens == 0                # 4 of 5 tokens made: no room for a proposal
    out = s.update(so, ModelRunnerOutput({"a": [4]}))
    assert out[0].finish_reason == "length"


def test_proposals_go_before_anyone_is_preempted():
    s = scheduler(num_blocks=5)                              # 4 usable blocks of 4 tokens
    a, b = req("a", 7), req("b", 7, first=100)
    s.add_request(a)
    s.add_request(b)
    run(s, {"a": [1], "b": [2]}, {"a": [5, 6, 7, 8], "b": [5, 6, 7, 8]})
    so = s.schedule()                                        # both at 8 tokens: room for their last only
    assert [c.num_draft_tokens for c in so.chunks] == [0, 0] and s.num_preemptions == 0


def test_a_request_whose_proposals_miss_backs_off_then_tries_again():
    s = scheduler(k=2)
    r = req("a", 4, max_tokens=100)
    s.add_request(r)
    run(s, {"a": [50]}, {"a": [1, 2]})
    lookaheads = []
    for _ in range(3):                                       # every proposal misses at once
        so = s.schedule()
        s.update(so, ModelRunnerOutput({"a": [9]}, draft_token_ids={"a": [1, 2]}))
        lookaheads.append(r.spec_lookahead)
    assert lookaheads == [1, 0, 0]
    so = s.schedule()
    assert so.propose_drafts == {}                           # backing off: none asked for
    s.update(so, ModelRunnerOutput({"a": [9]}))
    r.output_token_ids += [9] * SPEC_BACKOFF                 # (as if it decoded that long)
    r.all_token_ids += [9] * SPEC_BACKOFF
    r.num_computed_tokens += SPEC_BACKOFF
    assert s.schedule().propose_drafts == {"a": 1}           # one proposal again


def test_no_proposals_in_a_large_batch():
    s = Scheduler(SchedulerConfig(8, 64, 1000), CacheConfig(block_size=BS, enable_prefix_caching=True), 64,
                  speculative=SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=2))
    for i in range(2):
        s.add_request(req(str(i), 3, first=10 * i))
    so, _ = run(s, {"0": [1], "1": [1]}, {"0": [5], "1": [5]})
    assert not so.propose_drafts
    assert all(c.num_draft_tokens == 0 for c in s.schedule().chunks)


def test_target_step_pairs_each_position_with_the_token_after_it():
    from types import SimpleNamespace

    from shardlm.messages import ScheduledChunk
    from shardlm.spec_decode.proposer import TargetStep
    requests = {"p": SimpleNamespace(prompt_token_ids=[1, 2, 3, 4, 5, 6], output_token_ids=[]),
                "v": SimpleNamespace(prompt_token_ids=[7, 8], output_token_ids=[9, 10]),
                "d": SimpleNamespace(prompt_token_ids=[20], output_token_ids=[21])}
    chunks = [ScheduledChunk("p", [1, 2, 3], 0, [[1]], False),              # a prompt chunk: 4 comes next
              ScheduledChunk("v", [10, 11, 12, 13], 3, [[2]], True, 3),     # proposals 11 12 13
              ScheduledChunk("d", [21], 1, [[3]], True)]                    # a plain decode
    step = TargetStep(None, None, None, None, chunks, {"v": [11, 40], "d": [50]}, requests)
    next_ids, last_row = step.next_token_ids()
    # v kept 11, then sampled 40 where 12 was proposed: position 4 (row 4) is followed by 40
    assert next_ids == [2, 3, 4, 11, 40, 13, 40, 50]     # (rows past the last accepted: recomputed next step)
    assert last_row == {"v": 4, "d": 7}
