"""Plain data passed between the engine core and the workers, and out of the engine core.

Kept to ints, floats, strings and lists so the executor can ship them to other processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent the first time a request is scheduled; the worker keeps it until the request ends."""
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


@dataclass
class ScheduledChunk:
    """One request's share of a step: compute `token_ids` at positions start_pos, start_pos+1, ..."""
    req_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool          # True when this chunk ends at the request's last known token


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the chosen token's, then the top-k (ids, logprobs)."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]                              # req_id -> next token id
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
