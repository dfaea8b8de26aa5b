"""The periodic log line of a busy engine core (vLLM's): throughput, queue, KV cache, prefix
cache, and speculative decoding's acceptance, every 10 seconds while there is work."""

from __future__ import annotations

import time

from shardlm.logger import init_logger
from shardlm.messages import EngineCoreOutput, SchedulerOutput
from shardlm.spec_decode.stats import SpecDecodingStats

logger = init_logger(__name__)


class StatLogger:
    INTERVAL_S = 10.0

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self._since = time.monotonic()
        self._prompt_tokens = self._generation_tokens = 0
        self._spec_before = SpecDecodingStats()

    def observe(self, so: SchedulerOutput, outputs: list[EngineCoreOutput]) -> None:
        # a chunk of the last known token (and its proposals) is a decode; the rest is prompt work
        self._prompt_tokens += sum(len(c.token_ids) for c in so.chunks
                                   if not (c.sample and len(c.token_ids) == 1 + c.num_draft_tokens))
        self._generation_tokens += sum(len(o.new_token_ids) for o in outputs)
        now = time.monotonic()
        if now - self._since >= self.INTERVAL_S:
            self._log(now - self._since)
            self._since, self._prompt_tokens, self._generation_tokens = now, 0, 0

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
