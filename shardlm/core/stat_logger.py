"""The periodic log line of a busy engine core (vLLM's): throughput, queue, KV cache, prefix
cache, and speculative decoding's acceptance, every 10 seconds while there is work."""

from __future__ import annotations

import time

from shardlm.logger import init_logger
from shardlm.messages import EngineCoreOutput, SchedulerOutput
from shardlm.spec_decode.stats import SpecDecodingStats

logger = init_logger(__name__)


# tokens per step, the bounds of vLLM's vllm:iteration_tokens_total histogram
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StatLogger:
    INTERVAL_S = 10.0

    def __init__(self, scheduler, log: bool = True):
        self.scheduler, self.log = scheduler, log      # log False (--disable-log-stats): counters only
        self._since = time.monotonic()
        self._prompt_tokens = self._generation_tokens = 0
        self._spec_before = SpecDecodingStats()
        # since start (the server's vLLM counters): prompt and generated tokens, steps by their tokens
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self.iteration_buckets = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)      # the last: above every bound
        self.iteration_tokens_sum = 0

    def observe(self, so: SchedulerOutput, outputs: list[EngineCoreOutput]) -> None:
        # a chunk of the last known token (and its proposals) is a decode; the rest is prompt work
        prompt = sum(len(c.token_ids) for c in so.chunks
                     if not (c.sample and len(c.token_ids) == 1 + c.num_draft_tokens))
        generated = sum(len(o.new_token_ids) for o in outputs)
        self._prompt_tokens += prompt
        self._generation_tokens += generated
        self.prompt_tokens_total += prompt
        self.generation_tokens_total += generated
        step = prompt + generated
        self.iteration_buckets[next((i for i, b in enumerate(ITERATION_TOKEN_BUCKETS) if step <= b),
                                    len(ITERATION_TOKEN_BUCKETS))] += 1
        self.iteration_tokens_sum += step
        now = time.monotonic()
        if self.log and now - self._since >= self.INTERVAL_S:
            self._log(now - self._since)
            self._since, self._prompt_tokens, self._generation_tokens = now, 0, 0

    def totals(self) -> dict:
        """The counters since start, for stats(): tokens, and steps per bucket of their tokens."""
        return {"prompt_tokens": self.prompt_tokens_total, "generation_tokens": self.generation_tokens_total,
                "iteration_buckets": list(self.iteration_buckets), "iteration_tokens_sum": self.iteration_tokens_sum}

    def _log(self, seconds: float) -> None:
        s, kv = self.scheduler, self.scheduler.kv
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d "
                    "reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    self._prompt_tokens / seconds, self._generation_tokens / seconds, s.num_running, s.num_waiting,
                    100 * kv.usage(), 100 * kv.prefix_cache_hit_rate())
        if s.speculative is not None:
            spec = s.spec_stats
            logger.info("%s", spec.minus(self._spec_before).describe(seconds))
            self._spec_before = SpecDecodingStats.from_dict(spec.as_dict())
