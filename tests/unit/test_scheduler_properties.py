"""Property-based scheduler test: random arrivals, prompts from 1 token to several step budgets,
budgets, max_num_seqs, pipeline depths, KV caches small enough to force preemption, shared
prefixes for the prefix cache, aborts, and KV cache groups of sliding-window layers
(kv_cache_groups.py) beside or instead of full attention.

The model is a stand-in that keeps its "KV cache" honest: each step writes every scheduled
token into the slot its block table names, then reads each request's whole context back
through the block table (of every group; a window group only what its window reaches), and its
next token is a hash of what it read. A wrong block table, a prefix-cache block shared with the
wrong content, a block held by two groups at once or a chunk scheduled twice changes the tokens
(or trips an assertion), so: every request that is not aborted must end with exactly the tokens
it gets when run alone; no step holds more tokens than the budget or more requests than
max_num_seqs; a window group holds no block its window has left; and once the engine is idle
every block is free again.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardlm.config import CacheConfig, SchedulerConfig
from shardlm.core.request import Request
from shardlm.core.scheduler import Scheduler
from shardlm.kv_cache_groups import KVCacheGroups, plan_kv_cache_groups
from shardlm.messages import ModelRunnerOutput, SchedulerOutput
from shardlm.sampling_params import SamplingParams
from shardlm.utils import cdiv

VOCAB, EOS = 64, 0


def next_token(context: list[int]) -> int:
    return hashlib.blake2b(bytes(str(context), "ascii"), digest_size=4).digest()[0] % VOCAB


def run_alone(prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens a request gets by itself: the model's tokens until EOS or max_tokens."""
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(next_token(prompt + out))
        if out[-1] == EOS:
            break
    return out


class CheckingModel:
    """Writes each scheduled token to its KV slot in every group, then reads every request's
    context back through each group's block table (a window group: the positions its window
    reaches from the chunk's first query); samples from what was read."""

    def __init__(self, num_blocks: int, block_size: int, groups: KVCacheGroups):
        self.bs, self.groups = block_size, groups
        self.slots = [None] * (num_blocks * block_size)      # one pool: a block id is one group's at a time
        self.context: dict[str, list[int]] = {}     # what each request's tokens are (the truth)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for c in so.chunks:
            assert c.token_ids, "an empty chunk"
            known = self.context[c.req_id]
            assert c.token_ids == known[c.start_pos:c.start_pos + len(c.token_ids)], "a chunk of the wrong tokens"
            assert len(c.block_tables) == self.groups.num_groups
            for table in c.block_tables:
                for i, token in enumerate(c.token_ids):
                    pos = c.start_pos + i
                    block = table[pos // self.bs]
                    assert block != 0, "a token written to the null block"
                    self.slots[block * self.bs + pos % self.bs] = token
        sampled = {}
        for c in so.chunks:     # every layer's K/V is written before attention reads it
            end = c.start_pos + len(c.token_ids)
            seen = {}
            for window, table in zip(self.groups.windows, c.block_tables):
                # the first query attends from its own position back over window - 1 keys
                first = 0 if window is None else max(0, c.start_pos - window + 1)
                seen.update((p, self.slots[table[p // self.bs] * self.bs + p % self.bs]) for p in range(first, end))
                held = sum(1 for b in table if b != 0)
                assert held == cdiv(end, self.bs) - first // self.bs, f"{c.req_id}: window {window}, {held} blocks"
            context = self.context[c.req_id]
            assert [seen[p] for p in sorted(seen)] == context[min(seen):end], f"{c.req_id}: other tokens in the cache"
            if c.sample:       # what a windowed model reads of the positions before is the truth's
                sampled[c.req_id] = [next_token(context[:min(seen)] + [seen[p] for p in sorted(seen)])]
        return ModelRunnerOutput(sampled)


@dataclass
class Arrival:
    step: int
    prompt: list[int]
    max_tokens: int | None       # None: the rest of the context
    abort_at: int | None     # the step at which the client aborts it (None: never)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([4, 16]))
    budget = draw(st.integers(1, 48))
    max_model_len = draw(st.integers(8, 160))
    window = draw(st.integers(1, 40))
    layers = draw(st.sampled_from([[None], [window, None, window, window, None, window], [window, window]]))
    groups = plan_kv_cache_groups(layers, max_model_len)
    # the engine refuses fewer (one full request)
    min_blocks = groups.blocks_held(max_model_len, block_size, budget) + 1
    num_blocks = draw(st.integers(min_blocks, min_blocks + 24))
    max_num_seqs = draw(st.integers(1, 8))
    depth = draw(st.integers(1, 3))                             # batches in flight (pipeline stages)
    prefix = draw(st.lists(st.integers(1, VOCAB - 1), min_size=40, max_size=40))
    arrivals = []
    for _ in range(draw(st.integers(1, 10))):
        length = draw(st.integers(1, min(max_model_len - 1, 3 * budget + 8)))
        shared = draw(st.integers(0, length))                   # a prefix other prompts may share
        prompt = prefix[:min(shared, 40)] + draw(st.lists(st.integers(1, VOCAB - 1), min_size=length,
                                                          max_size=length))
        prompt = prompt[:length]
        if arrivals and draw(st.integers(0, 3)) == 0:          # a repeat: its whole prompt may be cached
            prompt = draw(st.sampled_from(arrivals)).prompt
        step = draw(st.integers(0, 30))
        abort_at = draw(st.one_of(st.none(), st.integers(step, step + 40)))
        room = max_model_len - len(prompt)                      # max_tokens must fit (processor.check_max_tokens)
        arrivals.append(Arrival(step, prompt, draw(st.one_of(st.none(), st.integers(1, min(24, room)))), abort_at))
    return block_size, budget, max_model_len, num_blocks, max_num_seqs, depth, arrivals, groups


def simulate(block_size, budget, max_model_len, num_blocks, max_num_seqs, depth, arrivals, groups):
    """Runs the workload as the engine core does (up to `depth` batches in flight);
    -> ({request id: output tokens} of the requests that finished, the scheduler)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len),
                      CacheConfig(block_size=block_size, enable_prefix_caching=True), num_blocks, depth,
                      kv_groups=groups)
    model = CheckingModel(num_blocks, block_size, groups)
    requests: dict[str, Request] = {}
    finished: dict[str, list[int]] = {}
    in_flight: deque = deque()
    step = 0
    while step <= 40 or sched.has_unfinished() or in_flight:
        assert step < 20_000, "the engine did not finish the workload"
        for i, a in enumerate(arrivals):
            rid = f"r{i}"
            if a.step == step:
                requests[rid] = Request(rid, a.prompt, SamplingParams(max_tokens=a.max_tokens), [EOS],
                                        max_model_len, block_size)
                model.context[rid] = list(a.prompt)
                sched.add_request(requests[rid])
            if a.abort_at == step and rid in requests:
                sched.finish_requests([rid])
        while len(in_flight) < depth:
            so = sched.schedule()
            if not so.chunks:
                break
            assert so.num_tokens <= budget, f"a step of {so.num_tokens} tokens, budget {budget}"
            assert len(so.chunks) <= max_num_seqs
            assert len({c.req_id for c in so.chunks}) == len(so.chunks), "a request twice in one step"
            in_flight.append((so, model.execute(so)))
        if not in_flight:
            assert not sched.has_unfinished(), "unfinished requests, and nothing could be scheduled"
        else:
            so, result = in_flight.popleft()
            for out in sched.update(so, result):
                model.context[out.req_id].extend(out.new_token_ids)
                if out.finish_reason is not None:
                    finished[out.req_id] = requests[out.req_id].output_token_ids
        step += 1
    return finished, sched


@pytest.mark.parametrize("examples", [40, pytest.param(300, marks=pytest.mark.slow)])
def test_every_request_gets_its_own_tokens_within_the_budget(examples):
    """A few workloads in the quick tier, many in the full one."""
    settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(workloads())(check_every_request_gets_its_own_tokens_within_the_budget))()


def check_every_request_gets_its_own_tokens_within_the_budget(workload):
    block_size, budget, max_model_len, num_blocks, max_num_seqs, depth, arrivals, _ = workload
    finished, sched = simulate(*workload)
    for i, a in enumerate(arrivals):
        rid = f"r{i}"
        room = max_model_len - len(a.prompt) if a.max_tokens is None else a.max_tokens
        if a.abort_at is None:
            assert rid in finished, f"{rid} never finished"
        if rid in finished:
            assert finished[rid] == run_alone(a.prompt, room), f"{rid}: other tokens than alone"
    # idle again: no request holds a block, every block but the null block is free
    assert not sched.has_unfinished() and not sched.kv.req_blocks
    assert sched.kv.pool.num_free_blocks == num_blocks - 1


def test_an_older_request_does_not_give_way_to_a_newer_one_in_flight():
    """Found by the property test: two identical prompts that each need most of the cache, three
    batches in flight. The older one, short of a block while the newer was in flight, used to
    preempt itself; readmitted through the prefix cache, it then pushed the newer one to do the
    same, and neither ever finished. Now it waits for the newer one to come back and preempts it."""
    prompt = [28, 34, 12, 15, 16, 48, 49, 20, 23, 23, 38, 55, 44, 56, 42, 51, 32, 53, 7]
    arrivals = [Arrival(step, prompt, None, None) for step in (0, 0, 29, 25, 0, 0)]
    arrivals += [Arrival(17, [54, 15, 47, 22, 26, 40, 1, 1, 1, 1, 8], None, None), Arrival(0, prompt, None, None),
                 Arrival(0, prompt, None, None), Arrival(0, [5], None, None)]
    groups = plan_kv_cache_groups([36, None, 36, 36, None, 36], 139)
    check_every_request_gets_its_own_tokens_within_the_budget((16, 7, 139, 18, 4, 3, arrivals, groups))
