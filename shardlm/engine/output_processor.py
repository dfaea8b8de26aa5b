"""Turns the engine core's token deltas into RequestOutputs: detokenizes, applies stop
strings, gathers the n samples of a request, and keeps per-request timings.

Each request says what its outputs hold (SamplingParams.output_kind): DELTA, the text and
tokens new since its last output (streaming: nothing is copied or re-sliced per step);
FINAL_ONLY, one whole output when it finishes; CUMULATIVE, everything so far at every step.
A request with a collector (AsyncLLM) gets its outputs put there; the others are returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from shardlm.engine.detokenizer import IncrementalDetokenizer
from shardlm.engine.errors import EngineDeadError, RequestFailedError
from shardlm.logger import init_logger
from shardlm.messages import EngineCoreOutput, PooledData, TokenLogprobs
from shardlm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from shardlm.pooling.params import PoolingParams
from shardlm.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


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
    # DELTA: how much of the text / tokens / logprobs went out already
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    last_token_time: float | None = None    # when its latest tokens came

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    collector: object | None = None     # AsyncLLM's RequestOutputCollector: has put(RequestOutput)
    pooling_params: PoolingParams | None = None     # a pooling request: one PoolingRequestOutput at its end
    pooled: PooledData | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]    # for requests without a collector
    reqs_to_abort: list[str]                # engine-core ids that hit a stop string
    failed: list[tuple[ParentRequest, Exception]] = field(default_factory=list)   # requests that failed: why


class OutputProcessor:
    def __init__(self, tokenizer, stream_interval: int = 1, log_outputs: bool = False, max_log_len: int | None = None):
        """stream_interval: a delta waits until it holds this many new tokens (but a sample's first
        and last); log_outputs: log each request's outputs as it finishes (at most max_log_len of each)."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.log_outputs, self.max_log_len = log_outputs, max_log_len
        self.parents: dict[str, ParentRequest] = {}
        self.samples: dict[str, SampleState] = {}   # engine-core request id -> sample
        self.on_finished: Callable[[RequestOutput], None] | None = None   # whole output, e.g. for metrics
        # each step that brings a sample new tokens: (its request's metrics, its new tokens, seconds
        # since its previous ones, None at its first); for the server's live token and latency series
        self.on_tokens: Callable[[RequestMetrics, int, float | None], None] | None = None

    def add_request(self, parent: ParentRequest, child_ids: list[str], child_params: list[SamplingParams]) -> None:
        self.parents[parent.request_id] = parent
        if parent.params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for i, (cid, sp) in enumerate(zip(child_ids, child_params)):
            detok = IncrementalDetokenizer(self.tokenizer if sp.detokenize else None, parent.prompt_token_ids,
                                           sp.skip_special_tokens,
                                           sp.stop, sp.include_stop_str_in_output)
            sample = SampleState(parent, i, detok, logprobs=[] if sp.logprobs is not None else None,
                                 cumulative_logprob=0.0 if sp.logprobs is not None else None)
            parent.samples.append(sample)
            parent.child_ids.append(cid)
            self.samples[cid] = sample

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def process(self, outputs: list[EngineCoreOutput], engine_index: int = 0) -> ProcessedOutputs:
        """engine_index: the data parallel replica these outputs come from."""
        now = time.time()
        changed: dict[str, ParentRequest] = {}
        touched: set[int] = set()       # id() of the samples this step changed (what a delta holds)
        to_abort: list[str] = []
        failed: list[tuple[ParentRequest, Exception]] = []
        for out in outputs:
            sample = self.samples.get(out.req_id)
            if sample is None:
                continue
            parent = sample.parent
            if out.error is not None:          # its replica died, or its own part failed: the whole request fails
                self._forget(parent)
                changed.pop(parent.request_id, None)
                to_abort.extend(cid for cid in parent.child_ids if cid != out.req_id)
                failed.append((parent, (RequestFailedError if out.error_kind == "request" else EngineDeadError)(
                    out.error)))
                continue
            if out.prompt_logprobs and parent.prompt_logprobs is not None and sample.index == 0:
                parent.prompt_logprobs.extend(self._convert_logprobs(lp, sample.detokenizer.tokenizer)
                                              for lp in out.prompt_logprobs)
            if out.scheduled_time is not None and parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time, parent.metrics.engine = out.scheduled_time, engine_index
            if out.execute_seconds:
                m = parent.metrics
                m.model_execute_time = (m.model_execute_time or 0.0) + out.execute_seconds
                m.model_forward_time = (m.model_forward_time or 0.0) + out.forward_seconds
            if out.pooled is not None:
                parent.pooled, sample.finish_reason = out.pooled, out.finish_reason
                parent.metrics.first_token_time = parent.metrics.last_token_time = now
            if out.new_token_ids:
                self._append(sample, out, now, to_abort)
            elif out.finish_reason is not None and sample.finish_reason is None:   # ended by the core, no token
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            touched.add(id(sample))
            changed[parent.request_id] = parent
        results = []
        for parent in changed.values():
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = now
                self._forget(parent)
                if self.on_finished is not None:
                    self.on_finished(self._whole_output(parent, True))
                if self.log_outputs:
                    self._log_outputs(parent)
            out = self._output_for(parent, finished, touched)
            if out is None:
                continue
            if parent.collector is not None:
                parent.collector.put(out)
            else:
                results.append(out)
        return ProcessedOutputs(results, to_abort, failed)

    def _append(self, sample: SampleState, out: EngineCoreOutput, now: float, to_abort: list[str]) -> None:
        parent = sample.parent
        m = parent.metrics
        if self.on_tokens is not None:
            gap = None if sample.last_token_time is None else now - sample.last_token_time
            self.on_tokens(m, len(out.new_token_ids), gap)
        sample.last_token_time = now
        if m.first_token_time is None:
            m.first_token_time = now
            parent.num_cached_tokens = m.num_cached_tokens = out.num_cached_tokens
        m.last_token_time = now
        sample.token_ids.extend(out.new_token_ids)
        if out.new_logprobs and sample.logprobs is not None:
            for lp in out.new_logprobs:
                sample.logprobs.append(self._convert_logprobs(lp, sample.detokenizer.tokenizer))
                sample.cumulative_logprob += lp.logprob
        stop_str = sample.detokenizer.update(out.new_token_ids, out.stop_token)
        if out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        elif stop_str is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop_str
            to_abort.append(out.req_id)

    @staticmethod
    def _convert_logprobs(lp: TokenLogprobs, tokenizer) -> PositionLogprobs:
        """tokenizer: the sample's (None: --skip-tokenizer-init or detokenize=False, no text)."""
        def text(token_id: int) -> str | None:
            return tokenizer.decode([token_id]) if tokenizer is not None else None
        entries = {lp.token_id: Logprob(lp.logprob, lp.rank, text(lp.token_id))}
        for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            if tid not in entries:
                entries[tid] = Logprob(val, rank, text(tid))
        return entries

    # ---- what goes out ----
    def _output_for(self, parent: ParentRequest, finished: bool, touched: set[int]):
        if parent.pooling_params is not None:
            return pooling_output(parent) if finished else None
        kind = parent.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            return self._whole_output(parent, True) if finished else None
        if kind == RequestOutputKind.CUMULATIVE:
            return self._whole_output(parent, finished)
        deltas = [d for s in parent.samples if id(s) in touched and (d := self._delta(s)) is not None]
        prompt_logprobs = None
        if parent.prompt_logprobs is not None and not parent.prompt_logprobs_sent and (deltas or finished):
            prompt_logprobs, parent.prompt_logprobs_sent = parent.prompt_logprobs, True
        if not deltas and not finished:
            return None
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, deltas, finished,
                             prompt_logprobs, parent.metrics, parent.num_cached_tokens)

    def _delta(self, s: SampleState) -> CompletionOutput | None:
        """What of sample s is new since its last delta; None if nothing is (and it did not finish)."""
        text = s.detokenizer.visible_text(s.finished)
        new_text, new_tokens = text[s.sent_chars:], s.token_ids[s.sent_tokens:]
        new_lps = s.logprobs[s.sent_logprobs:] if s.logprobs is not None else None
        if not new_text and not new_tokens and not s.finished:
            return None
        if not s.finished and s.sent_tokens and len(new_tokens) < self.stream_interval:
            return None         # --stream-interval: until enough have come
        s.sent_chars, s.sent_tokens = len(text), len(s.token_ids)
        s.sent_logprobs = len(s.logprobs) if s.logprobs is not None else 0
        return CompletionOutput(s.index, new_text, new_tokens, s.cumulative_logprob, new_lps, s.finish_reason,
                                s.stop_reason)

    def _whole_output(self, parent: ParentRequest, finished: bool) -> RequestOutput:
        completions = [
            CompletionOutput(s.index, s.detokenizer.visible_text(s.finished), list(s.token_ids),
                             s.cumulative_logprob, list(s.logprobs) if s.logprobs is not None else None,
                             s.finish_reason, s.stop_reason)
            for s in parent.samples]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions, finished,
                             parent.prompt_logprobs, parent.metrics, parent.num_cached_tokens)

    def _log_outputs(self, parent: ParentRequest) -> None:
        """--enable-log-outputs: vLLM's "Generated response" line, one per sample."""
        n = self.max_log_len
        for s in parent.samples:
            text, ids = s.detokenizer.visible_text(True), s.token_ids
            logger.info("Generated response %s%s: output: %r, output_token_ids: %s (%d), finish_reason: %s",
                        parent.request_id, f" (sample {s.index})" if len(parent.samples) > 1 else "",
                        text[:n] if n is not None else text, ids[:n] if n is not None else ids, len(ids),
                        s.finish_reason)

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


def pooling_output(parent: ParentRequest) -> PoolingRequestOutput:
    data = parent.pooled
    values = torch.from_numpy(np.frombuffer(data.data, dtype=np.float32).copy()).view(data.shape)
    return PoolingRequestOutput(parent.request_id, PoolingOutput(values), parent.prompt_token_ids, True, parent.prompt)
