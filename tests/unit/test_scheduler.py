from shardlm.config import CacheConfig, SchedulerConfig
from shardlm.core.request import Request, RequestStatus
from shardlm.core.scheduler import Scheduler
from shardlm.messages import ModelRunnerOutput
from shardlm.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks=64, max_num_seqs=8, max_tokens=64, caching=True):
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens, 1000),
                     CacheConfig(block_size=BS, enable_prefix_caching=caching), num_blocks)


def req(rid, n_prompt, max_tokens=4, first=0, **sp):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, **sp),
                   eos_token_ids=[99], max_model_len=1000, block_size=BS)


def step(s, token=7):
    out = s.schedule()
    res = ModelRunnerOutput({c.req_id: [token] for c in out.chunks if c.sample})
    return out, s.update(out, res)


def test_continuous_batching_joins_and_leaves():
    s = make_scheduler()
    s.add_request(req("a", 5, max_tokens=2))
    out, _ = step(s)
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("a", 5)]
    s.add_request(req("b", 3, max_tokens=3, first=50))
    out, res = step(s)
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 3)]
    assert res[0].finish_reason == "length"       # a: 2 tokens
    out, _ = step(s)
    assert [c.req_id for c in out.chunks] == ["b"]
    assert out.finished_req_ids == ["a"]          # workers are told to drop a's state


def test_chunked_prefill_respects_token_budget_and_decodes_first():
    s = make_scheduler(max_tokens=8)
    s.add_request(req("a", 3, max_tokens=10))
    step(s)
    s.add_request(req("long", 20, first=100))
    out, _ = step(s)
    assert [(c.req_id, len(c.token_ids), c.sample) for c in out.chunks] == [("a", 1, True), ("long", 7, False)]
    out, _ = step(s)
    assert [(c.req_id, len(c.token_ids), c.start_pos) for c in out.chunks] == [("a", 1, 4), ("long", 7, 7)]
    out, _ = step(s)
    assert [(c.req_id, len(c.token_ids), c.sample) for c in out.chunks] == [("a", 1, True), ("long", 6, True)]


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 2, first=10 * i))
    out, _ = step(s)
    assert [c.req_id for c in out.chunks] == ["r0", "r1"] and s.num_waiting == 1


def test_preempts_newest_first_and_recomputes():
    s = make_scheduler(num_blocks=5, max_tokens=64)   # 4 usable blocks of 4 tokens
    s.add_request(req("old", 7, max_tokens=8))          # 15 tokens at most: fits the cache alone
    s.add_request(req("new", 7, max_tokens=8, first=50))
    step(s)                                            # 2 blocks each
    out, _ = step(s)                                   # both at 8 tokens: still 2 blocks each
    out, _ = step(s)                                   # token 9 needs a third block: "new" is preempted
    assert [c.req_id for c in out.chunks] == ["old"]
    new = s.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert s.num_preemptions == 1 and s.waiting[0] is new
    while "old" in s.requests:
        out, _ = step(s)
    out, _ = step(s)                                   # "new" resumes with all its tokens so far
    chunk = out.chunks[0]
    assert chunk.req_id == "new" and chunk.token_ids == new.all_token_ids[:len(chunk.token_ids)]


def test_stop_conditions():
    s = make_scheduler()
    s.add_request(req("eos", 2, max_tokens=10))
    _, res = step(s, token=99)
    assert res[0].finish_reason == "stop" and res[0].stop_reason is None
    s.add_request(req("ign", 2, max_tokens=2, ignore_eos=True, first=20))
    _, res = step(s, token=99)
    assert res[0].finish_reason is None
    s.add_request(req("stopid", 2, max_tokens=10, stop_token_ids=[5], first=40))
    _, res = step(s, token=5)
    assert [(r.req_id, r.finish_reason, r.stop_reason) for r in res] == [("ign", "length", None), ("stopid", "stop", 5)]
    s.add_request(req("min", 2, max_tokens=10, min_tokens=2, first=60))
    _, res = step(s, token=99)
    assert res[0].finish_reason is None              # eos before min_tokens does not stop
    _, res = step(s, token=99)
    assert res[0].finish_reason == "stop"


def test_abort_frees_blocks():
    s = make_scheduler(num_blocks=10)
    s.add_request(req("a", 9))
    step(s)
    assert s.kv.pool.num_free_blocks < 9
    s.finish_requests(["a"])
    assert s.kv.pool.num_free_blocks == 9 and not s.has_unfinished()


def test_shared_prefix_is_computed_once_in_the_same_step():
    s = make_scheduler()
    s.add_request(req("a", 9))
    s.add_request(req("b", 9))
    out, _ = step(s)
    assert [(c.req_id, c.start_pos, len(c.token_ids)) for c in out.chunks] == [("a", 0, 9), ("b", 8, 1)]
    assert out.chunks[0].block_tables[0][:2] == out.chunks[1].block_tables[0][:2]


def _pipelined(num_blocks=64, max_num_seqs=8, depth=2):
    return Scheduler(SchedulerConfig(max_num_seqs, 64, 1000), CacheConfig(block_size=BS), num_blocks,
                     pipeline_depth=depth)


def test_batches_in_flight_share_no_request_and_split_the_work():
    s = _pipelined()
    for i in range(4):
        s.add_request(req(f"r{i}", 3, max_tokens=5, first=10 * i))
    first, second = s.schedule(), s.schedule()
    a, b = {c.req_id for c in first.chunks}, {c.req_id for c in second.chunks}
    assert len(a) == len(b) == 2 and not a & b           # each batch about 1/depth of the requests
    assert not s.schedule().chunks                       # everyone is in flight
    s.update(first, ModelRunnerOutput({c.req_id: [7] for c in first.chunks}))
    third = s.schedule()
    assert {c.req_id for c in third.chunks} == a         # back once their tokens are in
    assert all(len(c.token_ids) == 1 for c in third.chunks)


def test_requests_in_flight_are_never_preempted():
    # 4 usable blocks of 4 tokens (block 0 is the null block): the two prompts fill them all
    s = _pipelined(num_blocks=5)
    s.add_request(req("old", 8, max_tokens=20))
    s.add_request(req("new", 8, max_tokens=20, first=50))
    first, second = s.schedule(), s.schedule()
    assert [c.req_id for c in first.chunks + second.chunks] == ["old", "new"]
    blocks_in_flight = s.kv.block_ids("new")
    s.update(first, ModelRunnerOutput({"old": [7]}))
    # "old" needs a fifth block; the newer request holding the rest ("new") is in flight: "old"
    # waits for it (yielding itself, it would give way to "new" over and over)
    out = s.schedule()
    assert not out.chunks and s.num_preemptions == 0
    assert s.requests["new"].status == RequestStatus.RUNNING and s.kv.block_ids("new") == blocks_in_flight
    # "new" back: now it is the one preempted, and "old" goes on
    s.update(second, ModelRunnerOutput({"new": [9]}))
    out = s.schedule()
    assert [c.req_id for c in out.chunks] == ["old"] and s.num_preemptions == 1
    assert s.requests["new"].status == RequestStatus.PREEMPTED


def test_finished_ids_wait_for_a_batch_that_carries_them():
    s = _pipelined()
    s.add_request(req("a", 3, max_tokens=1))
    s.add_request(req("b", 3, max_tokens=5, first=20))
    first, second = s.schedule(), s.schedule()
    s.update(first, ModelRunnerOutput({c.req_id: [7] for c in first.chunks}))     # a finishes
    done = first.chunks[0].req_id
    assert not s.schedule().chunks                # b is still in flight: nothing to send
    s.update(second, ModelRunnerOutput({c.req_id: [7] for c in second.chunks}))
    assert s.schedule().finished_req_ids == [done]


def make_priority_scheduler(num_blocks=64, max_num_seqs=8, max_tokens=64):
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens, 1000, scheduling_policy="priority"),
                     CacheConfig(block_size=BS, enable_prefix_caching=False), num_blocks)


def preq(rid, n_prompt, priority, arrival, max_tokens=4, first=0):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=[99], max_model_len=1000, block_size=BS, arrival_time=arrival, priority=priority)


def test_priority_admits_by_priority_then_arrival():
    s = make_priority_scheduler(max_num_seqs=1)
    s.add_request(preq("running", 3, 5, 0.0, max_tokens=2))
    step(s)                                       # the only seat is taken
    for rid, prio, t in (("low", 9, 1.0), ("mid", 5, 2.0), ("mid-later", 5, 3.0), ("high", -1, 4.0)):
        s.add_request(preq(rid, 3, prio, t, first=10 * len(rid)))
    order = []
    while s.has_unfinished():
        out, _ = step(s)
        order += [c.req_id for c in out.chunks if c.start_pos == 0]
    assert order == ["high", "mid", "mid-later", "low"]


def test_priority_preempts_the_lowest_priority_running_request():
    # 3 requests of 8 prompt tokens fill 6 of 7 usable blocks; their first decode needs a new block each
    s = make_priority_scheduler(num_blocks=8)
    for rid, prio, t in (("urgent", 0, 0.0), ("bulk", 7, 1.0), ("normal", 3, 2.0)):
        s.add_request(preq(rid, 8, prio, t, max_tokens=8, first=10 * len(rid)))
    step(s)
    out, _ = step(s)
    assert s.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["bulk"]          # not the newest ("normal"): the lowest priority
    assert sorted(c.req_id for c in out.chunks) == ["normal", "urgent"]


def test_fcfs_preempts_the_newest():
    s = make_scheduler(num_blocks=8, caching=False)
    for rid in ("urgent", "bulk", "normal"):
        s.add_request(req(rid, 8, max_tokens=8, first=10 * len(rid)))
    step(s)
    step(s)
    assert [r.request_id for r in s.waiting] == ["normal"]


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits_in_its_turn():
    s = Scheduler(SchedulerConfig(8, 24, 24, enable_chunked_prefill=False), CacheConfig(block_size=BS), 64)
    s.add_request(req("a", 10, max_tokens=5))
    step(s)
    s.add_request(req("long", 24, first=100))
    s.add_request(req("short", 2, first=200))
    out, _ = step(s)        # 23 tokens left after a's decode: "long" waits, and "short" behind it too
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("a", 1)]
    for _ in range(3):
        step(s)
    out, _ = step(s)        # a finished: the whole prompt, then the one behind it as the budget allows
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("long", 24)]
    out, _ = step(s)
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("long", 1), ("short", 2)]


def test_long_prefill_token_threshold_bounds_each_prompts_chunk():
    s = Scheduler(SchedulerConfig(8, 64, 1000, long_prefill_token_threshold=10), CacheConfig(block_size=BS), 64)
    s.add_request(req("a", 25))
    s.add_request(req("b", 7, first=100))
    out, _ = step(s)
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("a", 10), ("b", 7)]
    out, _ = step(s)
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("a", 10), ("b", 1)]
    out, _ = step(s)
    assert [(c.req_id, len(c.token_ids), c.sample) for c in out.chunks] == [("a", 5, True), ("b", 1, True)]


def test_chunking_settings_that_cannot_work_are_refused():
    import pytest
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) is smaller than max_model_len \(64\)"):
        SchedulerConfig(8, 16, 64, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="it needs chunked prefill"):
        SchedulerConfig(8, 64, 64, enable_chunked_prefill=False, long_prefill_token_threshold=8)
    with pytest.raises(ValueError, match="give a token count >= 0"):
        SchedulerConfig(8, 64, 64, long_prefill_token_threshold=-1)
