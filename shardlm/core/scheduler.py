"""Continuous batching: which requests run this step, and how many tokens each.

Every step has a token budget (max_num_batched_tokens). Running requests go first, oldest
first: a decode takes one token, an unfinished prompt the next chunk of it (chunked
prefill; a chunk at most long_prefill_token_threshold; without chunked prefill a prompt runs
whole or waits). Waiting requests then fill what is left, first come first served (or, with
--scheduling-policy priority, by their priority, a lower value first, then arrival), each
starting after its longest cached prefix. When the KV cache runs out, the newest running
request (priority: the lowest-priority one, the newest among equals) is preempted: its blocks
are freed and it is recomputed later from its tokens so far, which changes no output.

With pipeline parallel the engine core keeps several batches in flight. A request is in at
most one of them: until its batch's tokens come back (update), the scheduler leaves it out,
and it is never preempted (its blocks are in use). A request short of blocks while every newer
one is in flight waits for them to come back rather than preempt itself (which would let the
newer ones push it back over and over).

Speculative decoding: a decode that has proposed tokens (Request.spec_token_ids) takes 1 + k
positions and KV slots; update keeps the accepted ones and hands the rest back. When the KV
cache is short, a request's proposals go before any request is preempted. Each request gets at
most its own lookahead of proposals (Request.spec_lookahead): up 2 after a proposal accepted
whole, down 1 after one that was not (transformers' assisted-generation heuristic); a miss at
lookahead 1 stops its proposals for SPEC_BACKOFF tokens, after which one is tried again. So a
request whose proposals keep missing costs almost nothing, and big batches none (the config's
disable_by_batch_size).
"""

from __future__ import annotations

import time
from collections import deque

from shardlm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from shardlm.core.kv_cache_manager import ONE_GROUP, KVCacheManager
from shardlm.core.request import Request, RequestStatus
from shardlm.kv_cache_groups import KVCacheGroups
from shardlm.logger import init_logger
from shardlm.messages import EngineCoreOutput, ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput
from shardlm.spec_decode.stats import SpecDecodingStats
from shardlm.structured_output.manager import accept

logger = init_logger(__name__)

SPEC_BACKOFF = 16      # tokens a request decodes without proposals after one missed at lookahead 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 pipeline_depth: int = 1, max_loras: int = 0, speculative: SpeculativeConfig | None = None,
                 kv_groups: KVCacheGroups = ONE_GROUP):
        """pipeline_depth: batches in flight at once (the number of pipeline stages); max_loras:
        LoRA adapters the running requests may use at once (0: LoRA is off); speculative: whether
        (and when) proposed tokens are verified; kv_groups: the KV cache groups (EngineConfig.kv_groups)."""
        self.config = config
        self.speculative = speculative
        self.spec_stats = SpecDecodingStats()
        self.max_loras = max_loras
        self.pipeline_depth = pipeline_depth
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, kv_groups)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._known_to_workers: set[str] = set()
        self._finished_since_last_step: list[str] = []
        self.in_flight: set[str] = set()        # requests in a batch whose output is pending
        self.num_preemptions = 0
        self.num_aborted = 0
        self.failed_outputs: list[EngineCoreOutput] = []     # requests ended by the core itself, to report
        self._next_seq = 0

    # ---- requests in and out ----
    def add_request(self, request: Request) -> None:
        if self.speculative is not None:
            request.spec_lookahead = self.speculative.num_speculative_tokens
        self.requests[request.request_id] = request
        request.seq = self._next_seq        # ties of arrival time keep the order requests came in
        self._next_seq += 1
        self._enqueue(request)

    def finish_requests(self, req_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self.num_aborted += status == RequestStatus.FINISHED_ABORTED
            self._free(request)

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._known_to_workers:
            self._known_to_workers.discard(request.request_id)
            self._finished_since_last_step.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        new_requests: list[NewRequestData] = []

        # with P batches in flight, each takes about 1/P of the requests, so every stage has work
        seq_cap = -(-(len(self.running) + len(self.waiting)) // self.pipeline_depth)
        num_preempted_before = self.num_preemptions
        speculate = self._speculating()
        i = 0
        while i < len(self.running) and budget > 0 and len(chunks) < seq_cap:
            request = self.running[i]
            if request.request_id in self.in_flight:
                i += 1
                continue
            num_new = self.config.prompt_tokens_now(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:         # without chunked prefill, what is left of the budget is too little
                i += 1
                continue
            drafts = self._drafts(request, budget, speculate)
            while not self.kv.allocate_slots(request, num_new + len(drafts)):
                if drafts:                  # proposals go first
                    drafts = []
                    continue
                victim = self._preemptable()
                # everything else is in flight, or everything that ranks below it: wait for it
                # (preempting itself for a lower one in flight, it would give way to it over and over)
                if victim is None or (victim is request and self._last_to_run() is not request):
                    i += 1
                    break
                self.running.remove(victim)
                self._preempt(victim)
                if victim is request:
                    break
            else:
                chunks.append(self._chunk(request, num_new, drafts))
                budget -= num_new + len(drafts)
                i += 1

        # after a preemption the cache is full: admit nobody new this step
        admit = self.num_preemptions == num_preempted_before
        skipped = 0         # requests at the head of the queue that wait (constraint compiling, adapter limit)
        adapters = self.running_adapters() if self.max_loras else set()
        while (admit and skipped < len(self.waiting) and budget > 0
               and len(self.running) < self.config.max_num_seqs and len(chunks) < seq_cap):
            request = self.waiting[skipped]
            if request.waiting_for_grammar or (      # the requests behind it go first
                    request.lora_int_id and request.lora_int_id not in adapters and len(adapters) >= self.max_loras):
                skipped += 1
                continue
            if request.grammar is not None and request.grammar.exception() is not None:
                self._fail_grammar(request)
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = self.config.prompt_tokens_now(request.num_tokens - num_hit, budget,
                                                     whole=request.pooling_params is not None)
            if num_new == 0:        # a prompt that runs whole (pooled, or chunked prefill off) waits for room
                break
            if not self.kv.allocate_slots(request, num_new, hit_blocks):
                break
            del self.waiting[skipped]            # the head, but for requests still compiling
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:
                request.scheduled_time = time.time()
            self.running.append(request)
            if request.lora_int_id:
                adapters.add(request.lora_int_id)
            if request.request_id not in self._known_to_workers:
                self._known_to_workers.add(request.request_id)
                new_requests.append(NewRequestData(request.request_id, request.prompt_token_ids,
                                                   request.sampling_params, request.lora_request,
                                                   request.pooling_params, request.token_type_ids,
                                                   request.mm_items))
            chunks.append(self._chunk(request, num_new))
            budget -= num_new

        finished = []
        if chunks:    # otherwise nothing is sent to the workers: keep them for the next batch
            finished, self._finished_since_last_step = self._finished_since_last_step, []
        self.in_flight.update(c.req_id for c in chunks)
        return SchedulerOutput(chunks, new_requests, finished, propose_drafts=self._proposals_wanted(chunks))

    def _proposals_wanted(self, chunks: list[ScheduledChunk]) -> dict[str, int]:
        """How many tokens to propose after this step for each request it samples: its lookahead,
        while a next step would verify them (proposals cost the sampling rank time)."""
        if not self._speculating():
            return {}
        wanted = {}
        for c in chunks:
            request = self.requests[c.req_id]
            if request.spec_lookahead == 0 and request.num_output_tokens >= request.spec_resume_at:
                request.spec_lookahead = 1          # backed off long enough: try again
            if c.sample and request.spec_lookahead:
                wanted[c.req_id] = request.spec_lookahead
        return wanted

    def running_adapters(self) -> set[int]:
        """The LoRA adapters of the running requests: at most max_loras (each holds a device slot)."""
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def lora_stats(self) -> dict:
        """vLLM's lora_requests_info: the adapters of running and of waiting requests, by name."""
        if not self.max_loras:
            return {}
        def names(requests):
            return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
        return {"max_lora": self.max_loras, "running_lora_adapters": names(self.running),
                "waiting_lora_adapters": names(self.waiting)}

    def _fail_grammar(self, request: Request) -> None:
        """Its constraint did not compile here (the front end checks it first, so rarely): it ends
        as aborted, with the reason in the log."""
        logger.error("Request %s: its structured-output constraint failed to compile: %s", request.request_id,
                     request.grammar.exception())
        self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._free(request)
        self.failed_outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=request.status.value,
                                                    error=f"its structured-output constraint could not be set up here: "
                                                          f"{request.grammar.exception()}", error_kind="request"))

    def _rank(self, request: Request) -> tuple:
        """Where a request stands: lower runs first (fcfs: arrival; priority: its priority, then arrival)."""
        arrival = (request.arrival_time, request.seq)
        return (request.priority, *arrival) if self.config.scheduling_policy == "priority" else arrival

    def _last_to_run(self) -> Request:
        """The running request preempted first when nothing is in flight (fcfs: the newest)."""
        return self.running[-1] if self.config.scheduling_policy == "fcfs" else max(self.running, key=self._rank)

    def _preemptable(self) -> Request | None:
        """The running request to preempt: the last to run of those not in flight."""
        candidates = [r for r in self.running if r.request_id not in self.in_flight]
        if not candidates:
            return None
        return candidates[-1] if self.config.scheduling_policy == "fcfs" else max(candidates, key=self._rank)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: fcfs at the back (a preempted request at the front); priority in
        rank order, a preempted request by its own rank (its arrival is older than the new ones')."""
        if self.config.scheduling_policy == "fcfs":
            if front:
                self.waiting.appendleft(request)
            else:
                self.waiting.append(request)
            return
        rank = self._rank(request)
        at = next((i for i, r in enumerate(self.waiting) if self._rank(r) > rank), len(self.waiting))
        self.waiting.insert(at, request)

    def _speculating(self) -> bool:
        """Proposals are made and verified while the running batch is below disable_by_batch_size."""
        return self.speculative is not None and self.speculative.speculates(len(self.running))

    def _drafts(self, request: Request, budget: int, speculate: bool) -> list[int]:
        """The proposed tokens this decode verifies: within the step's budget and the request's
        max_tokens, and (structured outputs) only those its constraint allows. Used once."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not speculate or not drafts or request.num_tokens - request.num_computed_tokens != 1:
            return []
        drafts = drafts[:max(0, min(request.spec_lookahead, budget - 1,
                                    request.max_tokens - request.num_output_tokens - 1))]
        if drafts and request.grammar is not None:
            if request.thinking_end_ids is not None:    # the constraint starts at a token not yet known
                return []
            drafts = drafts[:request.grammar.result().validate_tokens(drafts)]
        return drafts

    def _adapt_lookahead(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        if num_accepted == num_drafts:
            request.spec_lookahead = min(self.speculative.num_speculative_tokens, request.spec_lookahead + 2)
        elif num_accepted == 0 and request.spec_lookahead <= 1:
            request.spec_lookahead, request.spec_resume_at = 0, request.num_output_tokens + SPEC_BACKOFF
        else:
            request.spec_lookahead = max(1, request.spec_lookahead - 1)

    def _chunk(self, request: Request, num_new: int, drafts: list[int] = ()) -> ScheduledChunk:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new
        sample = request.num_computed_tokens == request.num_tokens
        request.num_computed_tokens += len(drafts)      # until update tells how many were right
        return ScheduledChunk(request.request_id, request.all_token_ids[start:start + num_new] + list(drafts), start,
                              self.kv.block_ids(request.request_id), sample, len(drafts))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)
        if self.num_preemptions == 1 or self.num_preemptions % 100 == 0:
            logger.warning("Request %s was preempted (recomputed later) because the KV cache is full; "
                           "total preemptions: %d. Give the KV cache more memory or lower max_num_seqs "
                           "for better throughput.", request.request_id, self.num_preemptions)

    def _pooled(self, request: Request, result: ModelRunnerOutput) -> EngineCoreOutput:
        """A pooling request ends with its step: its result, or an error if the step gave none."""
        pooled = result.pooled.get(request.request_id)
        request.status = RequestStatus.FINISHED_STOPPED
        self.running.remove(request)
        self._free(request)
        if pooled is None:
            return EngineCoreOutput(request.request_id, [], finish_reason=RequestStatus.FINISHED_ABORTED.value,
                                    error="the model returned no pooled result", error_kind="request")
        return EngineCoreOutput(request.request_id, [], finish_reason=request.status.value, pooled=pooled)

    @staticmethod
    def _advance_grammar(request: Request, token: int) -> None:
        ends = request.thinking_end_ids
        if ends is not None:         # still thinking: the constraint starts after the end marker
            if request.output_token_ids[-len(ends):] == ends:
                request.thinking_end_ids = None
            return
        why = accept(request.grammar.result(), token)
        if why is not None:
            if why != "done":        # the mask allowed only matching tokens: a bug if reached
                logger.error("Request %s: its output left its structured-output constraint (%s); it ends here.",
                             request.request_id, why)
            request.grammar_done = True

    def update(self, scheduler_output: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        # the step's requests, looked up before the update frees those that finish
        stepped = {c.req_id: self.requests.get(c.req_id) for c in scheduler_output.chunks}
        outputs = self._update(scheduler_output, result)
        for out in outputs:         # a request's first output says when it was first scheduled
            request = stepped.get(out.req_id)
            if request is not None and not request.scheduled_time_sent:
                out.scheduled_time, request.scheduled_time_sent = request.scheduled_time, True
            if request is not None and out.finish_reason is not None:     # and its last, its step times
                out.execute_seconds, out.forward_seconds = request.execute_seconds, request.forward_seconds
        return outputs

    def add_step_times(self, so: SchedulerOutput, execute: float, forward: float) -> None:
        """--collect-detailed-traces: a step's times, added to each of its requests'."""
        for chunk in so.chunks:
            request = self.requests.get(chunk.req_id)
            if request is not None:
                request.execute_seconds += execute
                request.forward_seconds += forward

    def _update(self, scheduler_output: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        for chunk in scheduler_output.chunks:
            self.in_flight.discard(chunk.req_id)
            request = self.requests.get(chunk.req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if (why := result.failed.get(chunk.req_id)) is not None:    # its own fault: it ends, the rest go on
                logger.error("Request %s failed: %s", chunk.req_id, why)
                self.finish_requests([chunk.req_id])
                outputs.append(EngineCoreOutput(chunk.req_id, [], finish_reason=RequestStatus.FINISHED_ABORTED.value,
                                                error=why, error_kind="request"))
                continue
            if request.pooling_params is not None:
                outputs.append(self._pooled(request, result))
                continue
            prompt_lp = result.prompt_logprobs.get(chunk.req_id)
            tokens = result.sampled.get(chunk.req_id) if chunk.sample else None
            if not tokens:
                if prompt_lp:
                    outputs.append(EngineCoreOutput(chunk.req_id, [], prompt_logprobs=prompt_lp))
                continue
            if chunk.num_draft_tokens:
                # positions past the accepted drafts are recomputed: their KV slots are written again
                num_accepted = len(tokens) - 1
                request.num_computed_tokens -= chunk.num_draft_tokens - num_accepted
                self.spec_stats.observe(chunk.num_draft_tokens, num_accepted)
                self._adapt_lookahead(request, chunk.num_draft_tokens, num_accepted)
            out = EngineCoreOutput(chunk.req_id, [], None, prompt_lp, num_cached_tokens=request.num_cached_tokens)
            for token in tokens:
                request.append_output_token(token)
                out.new_token_ids.append(token)
                if request.grammar is not None:
                    self._advance_grammar(request, token)
                if request.check_stop():
                    out.finish_reason, out.stop_reason = request.status.value, request.stop_reason
                    out.stop_token = request.ended_by_stop_token
                    self.running.remove(request)
                    self._free(request)
                    break
            lps = result.logprobs.get(chunk.req_id)
            if lps:
                out.new_logprobs = lps[:len(out.new_token_ids)]
            if out.finish_reason is None:
                request.spec_token_ids = result.draft_token_ids.get(chunk.req_id, [])
            outputs.append(out)
        return outputs
