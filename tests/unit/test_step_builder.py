"""The step builder (worker/step_builder.py), each feature's part of a step's batch on its own,
without a model: adapter order, token layout and verify rows, the prefill context parallel split,
the rows that need logits, sampling states and grammar rows."""

import torch

from shardlm.attention.context_parallel import ContextShard
from shardlm.messages import ScheduledChunk
from shardlm.sampling_params import SamplingParams
from shardlm.worker.step_builder import RequestState, StepBuilder


def _state(prompt_len=4, lora=0, **params) -> RequestState:
    return RequestState(list(range(100, 100 + prompt_len)), SamplingParams(**params), None, lora)


def test_chunks_run_grouped_by_adapter_the_base_model_first():
    requests = {"a": _state(lora=2), "b": _state(), "c": _state(lora=1), "d": _state(lora=2)}
    chunks = [ScheduledChunk(r, [1] * n, 0, [[1]], True) for r, n in zip("abcd", (3, 2, 4, 1))]
    builder = StepBuilder(requests, lora_slots=lambda ids: [{0: -1, 1: 0, 2: 1}[i] for i in ids], max_loras=2)
    ordered, slots = builder.order_by_adapter(chunks)
    assert [c.req_id for c in ordered] == ["b", "c", "a", "d"] and slots == [-1, 0, 1, 1]
    assert builder.build(chunks).lora.segments == [(0, 2, 6), (1, 6, 10)]          # (slot, first token, end)
    assert StepBuilder(requests).order_by_adapter(chunks) == (chunks, None)      # LoRA off: as scheduled


def test_a_prefill_context_parallel_group_runs_its_own_tokens_adapters():
    """Each group computes the tokens whose positions it owns: its adapter segments count those
    alone (a chunk with none of them has no segment there)."""
    requests = {"a": _state(lora=1), "b": _state(), "c": _state(lora=2)}
    # 2 groups, interleave 2: positions 0-1 group 0, 2-3 group 1, 4-5 group 0, ...
    chunks = [ScheduledChunk("a", [1] * 5, 0, [[1]], True), ScheduledChunk("b", [1] * 3, 0, [[2]], True),
              ScheduledChunk("c", [1], 2, [[3]], True)]
    shard = ContextShard(2, 1, 2, 16, 1)
    slots = lambda ids: [{0: -1, 1: 0, 2: 1}[i] for i in ids]       # noqa: E731
    segments = []
    for rank in (0, 1):
        batch = StepBuilder(requests, slots, 2, pcp_size=2, pcp_rank=rank, shard=shard).build(chunks)
        assert [c.req_id for c in batch.chunks] == ["b", "a", "c"]
        segments.append(batch.lora.segments)
    # b: positions 0-2 (group 0: 0, 1; group 1: 2); a: 0-4 (0, 1, 4; 2, 3); c: 2 (group 1)
    assert segments == [[(0, 2, 5)], [(0, 1, 3), (1, 3, 4)]]


def test_a_prompt_chunk_is_one_query_and_each_verified_position_a_decode():
    prompt = ScheduledChunk("p", [5, 6, 7], 0, [[1]], True)
    verify = ScheduledChunk("v", [8, 9, 10], 12, [[2, 3]], True, num_draft_tokens=2)
    ids, positions, layout = StepBuilder.token_layout([prompt, verify])
    assert ids == [5, 6, 7, 8, 9, 10] and positions == [0, 1, 2, 12, 13, 14]
    assert layout.query_lens == [3, 1, 1, 1] and layout.starts == [0, 12, 13, 14]
    assert layout.tables == [[[1]], [[2, 3]], [[2, 3]], [[2, 3]]]


def test_prefill_context_parallel_splits_tokens_by_the_group_owning_their_position():
    # 2 PCP groups, interleave 2: positions 0-1 group 0, 2-3 group 1, 4-5 group 0, ...
    shard = ContextShard(2, 1, 2, 16, 1)
    builder = StepBuilder({}, pcp_size=2, pcp_rank=1, shard=shard)
    batch_ids, positions, layout = StepBuilder.token_layout([ScheduledChunk("p", list(range(6)), 0, [[1]], True)])
    split = builder.split_over_pcp_groups(positions, layout)
    assert split.groups == [[0, 1, 4, 5], [2, 3]] and split.mine == [2, 3]
    assert split.step.query_rows == [[0, 1, 4, 5, 2, 3]]      # gathered group by group
    assert split.step.writes == [(2, [1]), (3, [1])] and split.step.pcp_counts == [4, 2]


def test_logits_rows_cover_sampled_positions_and_each_prompt_position_once():
    requests = {"s": _state(), "p": _state(prompt_len=10, prompt_logprobs=1)}
    builder = StepBuilder(requests)
    sample = ScheduledChunk("s", [1, 2, 3], 4, [[1]], True, num_draft_tokens=2)
    first_half = ScheduledChunk("p", list(range(6)), 0, [[2]], False)
    needed = builder.logits_rows([sample, first_half])
    assert needed.rows == [0, 1, 2, 3, 4, 5, 6, 7, 8] and needed.sample_chunks == [sample]
    assert needed.prompt_rows == [("p", 0, 3, 6)]
    rest = ScheduledChunk("p", list(range(6, 10)), 6, [[2]], True)
    again = builder.logits_rows([rest])
    # positions 6..8 score prompt tokens 7..9; the last position is the sampled one
    assert again.prompt_rows == [("p", 6, 1, 3)] and again.rows == [3, 0, 1, 2]
    assert requests["p"].prompt_logprobs_done == 9


def test_sampled_rows_are_one_query_each_a_prompt_chunks_last_attended_as_a_prompt():
    decode = ScheduledChunk("d", [9], 7, [[1]], True)
    unfinished = ScheduledChunk("u", list(range(5)), 0, [[2]], False)
    prompt_end = ScheduledChunk("p", list(range(4)), 16, [[3, 4]], True)
    verify = ScheduledChunk("v", [8, 9, 10], 12, [[5]], True, num_draft_tokens=2)
    sampled = StepBuilder.sampled_rows([decode, unfinished, prompt_end, verify])
    assert sampled.rows == [0, 9, 10, 11, 12]
    assert sampled.attention.query_lens == [1] * 5 and sampled.attention.starts == [7, 19, 12, 13, 14]
    assert sampled.attention.tables_of(0) == [[1], [3, 4], [5], [5], [5]]
    assert sampled.prompt == [False, True, False, False, False]
    assert StepBuilder.sampled_rows([unfinished]).rows == []


def test_each_verified_row_samples_with_the_history_it_follows():
    requests = {"pen": _state(presence_penalty=0.5), "plain": _state()}
    builder = StepBuilder(requests)
    chunks = [ScheduledChunk("pen", [7, 8, 9], 4, [[1]], True, num_draft_tokens=2),
              ScheduledChunk("plain", [3, 4], 4, [[2]], True, num_draft_tokens=1)]
    rows = builder.sampling_states(chunks)
    assert [r.output_token_ids for r in rows[:3]] == [[], [8], [8, 9]]
    assert rows[3] is requests["plain"] and rows[4] is requests["plain"]
    assert StepBuilder.grammar_rows(["plain"], chunks) == [3, 4]
    assert torch.tensor(StepBuilder.grammar_rows(["pen", "plain"], chunks)).tolist() == [0, 1, 2, 3, 4]
