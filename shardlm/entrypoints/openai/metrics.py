"""GET /metrics: Prometheus text with vLLM's metric names under the `shardlm:` prefix, so
existing dashboards map over by renaming the prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shardlm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.labels = {"model_name": model_name}
        self.running = Gauge("shardlm:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("shardlm:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge("shardlm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)", labels,
                              registry=r)
        self.prefix_hit_rate = Gauge("shardlm:prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens",
                                     labels, registry=r)
        self.prefix_queries = Gauge("shardlm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                    labels, registry=r)
        self.prefix_hits = Gauge("shardlm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels,
                                 registry=r)
        self.preemptions = Gauge("shardlm:num_preemptions", "Requests preempted so far", labels, registry=r)
        self.aborted = Gauge("shardlm:num_requests_aborted", "Requests aborted so far (client gone, stop string)",
                             labels, registry=r)
        self.prompt_tokens = Counter("shardlm:prompt_tokens", "Prompt tokens of finished requests", labels, registry=r)
        self.generation_tokens = Counter("shardlm:generation_tokens", "Generated tokens of finished requests", labels,
                                         registry=r)
        self.success = Counter("shardlm:request_success", "Finished requests", labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("shardlm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("shardlm:time_per_output_token_seconds", "Time per output token after the first",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("shardlm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)

    def observe_finished(self, out: RequestOutput) -> None:
        m, lab = out.metrics, self.labels
        self.prompt_tokens.labels(**lab).inc(len(out.prompt_token_ids))
        generated = sum(len(c.token_ids) for c in out.outputs)
        self.generation_tokens.labels(**lab).inc(generated)
        for c in out.outputs:
            self.success.labels(finished_reason=c.finish_reason or "abort", **lab).inc()
        if m is None or m.first_token_time is None or m.finished_time is None:
            return
        self.ttft.labels(**lab).observe(m.first_token_time - m.arrival_time)
        self.e2e.labels(**lab).observe(m.finished_time - m.arrival_time)
        longest = max((len(c.token_ids) for c in out.outputs), default=0)
        if longest > 1:
            self.tpot.labels(**lab).observe((m.finished_time - m.first_token_time) / (longest - 1))

    def render(self, stats: dict | None) -> bytes:
        lab = self.labels
        if stats:
            self.running.labels(**lab).set(stats["num_running"])
            self.waiting.labels(**lab).set(stats["num_waiting"])
            self.kv_usage.labels(**lab).set(stats["kv_cache_usage"])
            self.prefix_hit_rate.labels(**lab).set(stats["prefix_cache_hit_rate"])
            self.prefix_queries.labels(**lab).set(stats["prefix_cache_queries"])
            self.prefix_hits.labels(**lab).set(stats["prefix_cache_hits"])
            self.preemptions.labels(**lab).set(stats["num_preemptions"])
            self.aborted.labels(**lab).set(stats["num_aborted"])
        return generate_latest(self.registry)
