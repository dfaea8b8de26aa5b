"""What one step's batch looks like, built from the scheduler's chunks before the model runs (as
vLLM's input batch): the order the chunks run in (each LoRA adapter's tokens together), the
tokens and their positions, the attention layout (one decode query per verified position),
prefill context parallel's split of the tokens over groups, the rows whose logits are needed
(sampled positions, prompt logprobs), the sampling state of each of those rows and the rows a
grammar constrains. Each feature's part is one method, tested on its own without a model
(tests/unit/test_step_builder.py); the model runner turns the batch into tensors and metadata,
runs the model and samples.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field, replace

import torch

from shardlm.attention.torch_paged import ContextParallelStep
from shardlm.lora.batch import LoRABatch
from shardlm.messages import ScheduledChunk
from shardlm.pooling.params import PoolingParams
from shardlm.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the worker remembers of a request between steps."""
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    lora_int_id: int = 0                # its adapter (0: the base model)
    output_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs_done: int = 0       # prompt positions answered (a recompute after preemption skips them)
    pooling_params: PoolingParams | None = None     # a pooling request (pooling/pooler.py)
    token_type_ids: list[int] | None = None
    mm_items: list | None = None        # its images (messages.MultiModalItem)
    given_embeddings: dict[int, torch.Tensor] = field(default_factory=dict)   # item index -> its embeddings


@dataclass
class AttentionLayout:
    """Per attention query sequence: its query length, first position and block tables (one per
    KV cache group)."""
    query_lens: list[int]
    starts: list[int]
    tables: list[list[list[int]]]

    def tables_of(self, group: int) -> list[list[int]]:
        """Every sequence's block table in one KV cache group."""
        return [t[group] for t in self.tables]


@dataclass
class ContextParallelSplit:
    """Prefill context parallel: each group's tokens (indices into the step's), this group's, and
    this rank's attention layout of the gathered queries."""
    groups: list[list[int]]
    mine: list[int]
    step: ContextParallelStep


@dataclass
class LogitsRows:
    """The rows of the final hidden states whose logits are needed: each sampling chunk's last
    token and one per proposed token, then the prompt positions of requests that asked for prompt
    logprobs, as (request id, first prompt position, first row, count)."""
    rows: list[int]
    sample_chunks: list[ScheduledChunk]
    prompt_rows: list[tuple[str, int, int, int]]


@dataclass
class SampledRows:
    """The rows the sampler reads (each sampling chunk's last token and its proposed tokens), in
    step order, and their attention layout: one query each at its position. prompt[i]: query i
    ends a prompt chunk (attended as the chunk's queries are; else as a decode), so that a row
    attended alone has the numbers it has among the whole step's."""
    rows: list[int]
    attention: AttentionLayout
    prompt: list[bool]


@dataclass
class StepBatch:
    chunks: list[ScheduledChunk]            # in the order their tokens run
    lora: LoRABatch | None                  # which tokens run on which adapter slot (None: none)
    input_ids: list[int]                    # every token of the step (all PCP groups')
    positions: list[int]
    attention: AttentionLayout
    pcp: ContextParallelSplit | None = None

    @property
    def computed_ids(self) -> list[int]:
        """The tokens this rank's group computes (under prefill context parallel, its share)."""
        return self.input_ids if self.pcp is None else [self.input_ids[i] for i in self.pcp.mine]

    @property
    def computed_positions(self) -> list[int]:
        return self.positions if self.pcp is None else [self.positions[i] for i in self.pcp.mine]


class StepBuilder:
    def __init__(self, requests: dict[str, RequestState], lora_slots=None, max_loras: int = 0,
                 device: torch.device = torch.device("cpu"), pcp_size: int = 1, pcp_rank: int = 0, shard=None):
        """lora_slots: adapter ids -> their slots (LoRAManager.slots_of; None without LoRA); shard:
        the attention backend's ContextShard (which PCP group owns a position)."""
        self.requests = requests
        self.lora_slots, self.max_loras, self.device = lora_slots, max_loras, device
        self.pcp_size, self.pcp_rank, self.shard = pcp_size, pcp_rank, shard

    def build(self, chunks: list[ScheduledChunk]) -> StepBatch:
        chunks, slots = self.order_by_adapter(chunks)
        input_ids, positions, attention = self.token_layout(chunks)
        pcp = self.split_over_pcp_groups(positions, attention) if self.pcp_size > 1 else None
        return StepBatch(chunks, self.lora_batch(chunks, slots, pcp), input_ids, positions, attention, pcp)

    def order_by_adapter(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[int] | None]:
        """The chunks ordered by adapter id (the base model's first), so each adapter's tokens are
        one segment, and each chunk's slot (None: all on the base model). The order follows the
        requests alone, so every pipeline stage and context parallel group orders alike."""
        ids = [self.requests[c.req_id].lora_int_id for c in chunks] if self.lora_slots is not None else []
        if not any(ids):
            return chunks, None
        slots = self.lora_slots(ids)
        order = sorted(range(len(chunks)), key=ids.__getitem__)
        return [chunks[i] for i in order], [slots[i] for i in order]

    def lora_batch(self, chunks: list[ScheduledChunk], slots: list[int] | None,
                   pcp: ContextParallelSplit | None) -> LoRABatch | None:
        """Which of the tokens this rank computes run on which slot: the step's, or under prefill
        context parallel its group's (a subsequence in step order, so each adapter's tokens stay
        one segment)."""
        if slots is None:
            return None
        counts = [len(c.token_ids) for c in chunks]
        if pcp is not None:
            ends = list(itertools.accumulate(counts))
            counts = [bisect.bisect_left(pcp.mine, end) - bisect.bisect_left(pcp.mine, end - n)
                      for n, end in zip(counts, ends)]
            slots, counts = [s for s, n in zip(slots, counts) if n], [n for n in counts if n]
        return LoRABatch.of_chunks(slots, counts, self.max_loras, self.device)

    @staticmethod
    def token_layout(chunks: list[ScheduledChunk]) -> tuple[list[int], list[int], AttentionLayout]:
        """Token ids, positions and the attention layout of the step's tokens, in chunk order.

        A chunk with proposed tokens is attended as one decode per position (same block table,
        context up to that position): the kernels, and so the numbers, of decoding its tokens
        one by one, which keeps greedy outputs exact; and a step of decodes stays on the
        one-call CPU path (CUDA graphs on a GPU)."""
        input_ids, positions = [], []
        layout = AttentionLayout([], [], [])
        for c in chunks:
            n = len(c.token_ids)
            input_ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.start_pos + n))
            if c.num_draft_tokens:
                layout.query_lens.extend([1] * n)
                layout.starts.extend(range(c.start_pos, c.start_pos + n))
                layout.tables.extend([c.block_tables] * n)
            else:
                layout.query_lens.append(n)
                layout.starts.append(c.start_pos)
                layout.tables.append(c.block_tables)
        return input_ids, positions, layout

    def split_over_pcp_groups(self, positions: list[int], attention: AttentionLayout) -> ContextParallelSplit:
        """Prefill context parallel: which of the step's tokens each group computes (those whose
        positions its ranks own), and this rank's attention layout: the gathered queries are
        group by group, each group's tokens in step order."""
        groups: list[list[int]] = [[] for _ in range(self.pcp_size)]
        for i, pos in enumerate(positions):
            groups[self.shard.pcp_owner(pos)].append(i)
        row_of, row = [0] * len(positions), 0
        for tokens in groups:
            for i in tokens:
                row_of[i], row = row, row + 1
        query_rows, token_table, t = [], [], 0
        for qlen, table in zip(attention.query_lens, attention.tables_of(0)):     # one group under context parallel
            query_rows.append(row_of[t:t + qlen])
            token_table.extend([table] * qlen)
            t += qlen
        mine = groups[self.pcp_rank]
        step = ContextParallelStep(query_rows, [(positions[i], token_table[i]) for i in mine],
                                   [len(g) for g in groups], self.pcp_rank)
        return ContextParallelSplit(groups, mine, step)

    def logits_rows(self, chunks: list[ScheduledChunk]) -> LogitsRows:
        """The rows whose logits are needed. A prompt split across steps has its prompt logprobs
        answered chunk by chunk, each position once: the requests' prompt_logprobs_done advances."""
        sample_chunks, rows, end = [], [], 0
        prompt_rows: list[tuple[str, int, int, int]] = []
        for c in chunks:
            end += len(c.token_ids)
            if c.sample:              # its last token's row, and one per proposed token
                sample_chunks.append(c)
                rows.extend(range(end - 1 - c.num_draft_tokens, end))
        offset = 0
        for c in chunks:
            state = self.requests[c.req_id]
            if state.sampling_params.prompt_logprobs is not None:
                # the logits at position p score prompt token p + 1
                first = max(c.start_pos, state.prompt_logprobs_done)
                last = min(c.start_pos + len(c.token_ids), len(state.prompt_token_ids) - 1)
                if last > first:
                    prompt_rows.append((c.req_id, first, len(rows), last - first))
                    rows.extend(range(offset + first - c.start_pos, offset + last - c.start_pos))
                    state.prompt_logprobs_done = last
            offset += len(c.token_ids)
        return LogitsRows(rows, sample_chunks, prompt_rows)

    @staticmethod
    def sampled_rows(chunks: list[ScheduledChunk]) -> SampledRows:
        """The rows logits_rows gives for sampling (without prompt logprobs), each as a query of its
        own: the model's last layer can finish these alone (model_runner: _last_layer_rows)."""
        sampled = SampledRows([], AttentionLayout([], [], []), [])
        end = 0
        for c in chunks:
            n = len(c.token_ids)
            end += n
            if not c.sample:
                continue
            for row in range(end - 1 - c.num_draft_tokens, end):
                sampled.rows.append(row)
                sampled.attention.query_lens.append(1)
                sampled.attention.starts.append(c.start_pos + row - (end - n))
                sampled.attention.tables.append(c.block_tables)
                sampled.prompt.append(n > 1 and not c.num_draft_tokens)
        return sampled

    def sampling_states(self, sample_chunks: list[ScheduledChunk]) -> list[RequestState]:
        """One state per sampled row: a request's position j after its last known token has its
        first j proposed tokens as output history (penalties, min_tokens see them; without either,
        the sampler does not read it and the request's own state serves every row)."""
        rows = []
        for c in sample_chunks:
            state = self.requests[c.req_id]
            rows.append(state)
            drafts, sp = c.draft_token_ids, state.sampling_params
            if sp.uses_penalties or len(state.output_token_ids) < sp.min_tokens:
                rows.extend(replace(state, output_token_ids=state.output_token_ids + drafts[:j])
                            for j in range(1, len(drafts) + 1))
            else:
                rows.extend([state] * len(drafts))
        return rows

    @staticmethod
    def grammar_rows(grammar_req_ids: list[str], sample_chunks: list[ScheduledChunk]) -> list[int]:
        """Structured outputs: the sampled rows of the constrained requests, in the order of their
        bitmasks (each request's rows: 1 + its proposed tokens)."""
        first_row, row = {}, 0
        for c in sample_chunks:
            first_row[c.req_id] = (row, 1 + c.num_draft_tokens)
            row += 1 + c.num_draft_tokens
        return [first + j for r in grammar_req_ids for first, n in [first_row[r]] for j in range(n)]
