"""Turns the engine core's token deltas into RequestOutputs: detokenizes, applies stop
strings, gathers the n samples of a request, and keeps per-request timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shardlm.engine.detokenizer import IncrementalDetokenizer
from shardlm.engine.messages import EngineCoreOutput, TokenLogprobs
from shardlm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from shardlm.sampling_params import SamplingParams


@dataclass
class SampleState:
    """One of a request's n samples (one engine-core request)."""
    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[SampleState] = field(default_factory=list)
    child_ids: list[str] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.samples: dict[str, SampleState] = {}   # engine-core request id -> sample

    def add_request(self, parent: ParentRequest, child_ids: list[str], child_params: list[SamplingParams]) -> None:
        self.parents[parent.request_id] = parent
        if parent.params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for i, (cid, sp) in enumerate(zip(child_ids, child_params)):
            detok = IncrementalDetokenizer(self.tokenizer, parent.prompt_token_ids, sp.skip_special_tokens,
                                           sp.stop, sp.include_stop_str_in_output)
            sample = SampleState(parent, i, detok, logprobs=[] if sp.logprobs is not None else None,
                                 cumulative_logprob=0.0 if sp.logprobs is not None else None)
            parent.samples.append(sample)
            parent.child_ids.append(cid)
            self.samples[cid] = sample

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def process(self, outputs: list[EngineCoreOutput], final_only: bool = False
                ) -> tuple[list[RequestOutput], list[str]]:
        """-> (RequestOutputs of the requests that changed, engine-core ids to abort for stop strings)."""
        now = time.time()
        changed: dict[str, ParentRequest] = {}
        to_abort: list[str] = []
        for out in outputs:
            sample = self.samples.get(out.req_id)
            if sample is None:
                continue
            parent = sample.parent
            if out.prompt_logprobs and parent.prompt_logprobs is not None and sample.index == 0:
                parent.prompt_logprobs.extend(self._convert_logprobs(lp) for lp in out.prompt_logprobs)
            if out.new_token_ids:
                self._append(sample, out, now, to_abort)
            changed[parent.request_id] = parent
        results = []
        for parent in changed.values():
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = now
                self._forget(parent)
            if finished or not final_only:
                results.append(self._request_output(parent, finished))
        return results, to_abort

    def _append(self, sample: SampleState, out: EngineCoreOutput, now: float, to_abort: list[str]) -> None:
        parent = sample.parent
        m = parent.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            parent.num_cached_tokens = m.num_cached_tokens = out.num_cached_tokens
        m.last_token_time = now
        sample.token_ids.extend(out.new_token_ids)
        if out.new_logprobs and sample.logprobs is not None:
            for lp in out.new_logprobs:
                sample.logprobs.append(self._convert_logprobs(lp))
                sample.cumulative_logprob += lp.logprob
        stop_str = sample.detokenizer.update(out.new_token_ids)
        if out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        elif stop_str is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop_str
            to_abort.append(out.req_id)

    def _convert_logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        entries = {lp.token_id: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([lp.token_id]))}
        for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            if tid not in entries:
                entries[tid] = Logprob(val, rank, self.tokenizer.decode([tid]))
        return entries

    def _request_output(self, parent: ParentRequest, finished: bool) -> RequestOutput:
        completions = [
            CompletionOutput(s.index, s.detokenizer.visible_text(s.finish_reason is not None), list(s.token_ids),
                             s.cumulative_logprob, list(s.logprobs) if s.logprobs is not None else None,
                             s.finish_reason, s.stop_reason)
            for s in parent.samples]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions, finished,
                             parent.prompt_logprobs, parent.metrics, parent.num_cached_tokens)

    def _forget(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for cid in parent.child_ids:
            self.samples.pop(cid, None)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its engine-core ids."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        self._forget(parent)
        return list(parent.child_ids)
