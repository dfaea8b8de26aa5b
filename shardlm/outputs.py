"""What generate() returns: one RequestOutput per prompt, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None           # 1 = most likely token
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled/actual token plus the top-k).
PositionLogprobs = dict[int, Logprob]


class TokenLogprobs(msgspec.Struct):
    """One position's logprobs as the sampler sends them to the engine core (compact): the chosen
    token's, then the top-k (ids, logprobs). The output processor turns them into PositionLogprobs."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    engine: int = 0                         # the data parallel replica that ran it
    max_tokens_param: int | None = None     # what it asked for (the server's vLLM histograms)
    n_param: int = 1
    model_execute_time: float | None = None  # --collect-detailed-traces: its steps, on the engine core
    model_forward_time: float | None = None  # ... and in the answering worker's forward passes

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None      # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0

    def add(self, later: RequestOutput) -> None:
        """Append a later delta of the same request (a slow reader gets the deltas it missed as one)."""
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            prev = mine.get(c.index)
            if prev is None:
                self.outputs.append(c)
                mine[c.index] = c
                continue
            prev.text += c.text
            prev.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                prev.logprobs = (prev.logprobs or []) + c.logprobs
            prev.cumulative_logprob, prev.finish_reason, prev.stop_reason = \
                c.cumulative_logprob, c.finish_reason, c.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = later.finished
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        self.metrics, self.num_cached_tokens = later.metrics, later.num_cached_tokens


# ---- what the pooling methods return (LLM.encode, embed, classify, score; vLLM's names) ----
@dataclass
class PoolingOutput:
    data: object                      # a torch.Tensor: a vector, or one per token (token tasks)


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
