"""GET /metrics: Prometheus text. vLLM's series under vLLM's own names (vllm_metrics.py: its
dashboards, router and autoscaling rules read them unchanged), and shardlm's under `shardlm:`:
vLLM's names with that prefix (the dashboards built on them), and what vLLM has no name for
(restarts, aborts, routing to replicas, expert load)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shardlm.entrypoints.openai.vllm_metrics import EngineSeries, RequestSeries
from shardlm.outputs import RequestMetrics, RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0)


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 8192, cache_info: dict[str, str] | None = None):
        """cache_info: the KV cache's settings, vllm:cache_config_info's labels."""
        self.registry = r = CollectorRegistry()
        self.vllm_requests = RequestSeries(model_name, max_model_len, r)
        self.vllm_engines = EngineSeries(model_name, cache_info or {}, r)
        labels = ["model_name"]
        self.labels = {"model_name": model_name}
        # engine-core gauges: one series per data parallel replica (engine="0", "1", ...) and their
        # total (engine="all", first, so a reader of the first series gets the total)
        per_engine = labels + ["engine"]
        self.engine_gauges = {
            "num_running": Gauge("shardlm:num_requests_running", "Requests in the running batch", per_engine,
                                 registry=r),
            "num_waiting": Gauge("shardlm:num_requests_waiting", "Requests waiting to be scheduled", per_engine,
                                 registry=r),
            "kv_cache_usage": Gauge("shardlm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)",
                                    per_engine, registry=r),
            "prefix_cache_hit_rate": Gauge("shardlm:prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens",
                                           per_engine, registry=r),
            "prefix_cache_queries": Gauge("shardlm:prefix_cache_queries",
                                          "Prompt tokens looked up in the prefix cache", per_engine, registry=r),
            "prefix_cache_hits": Gauge("shardlm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                       per_engine, registry=r),
            "num_preemptions": Gauge("shardlm:num_preemptions", "Requests preempted so far", per_engine, registry=r),
            "num_aborted": Gauge("shardlm:num_requests_aborted",
                                 "Requests aborted so far (client gone, stop string)", per_engine, registry=r),
            "num_routed": Gauge("shardlm:num_requests_routed",
                                "Engine-core requests the load balancer sent to this replica so far", per_engine,
                                registry=r),
        }
        self.expert_tokens = Gauge("shardlm:moe_expert_tokens",
                                   "MoE models: tokens routed to each expert so far, per MoE layer (an uneven "
                                   "spread is what expert parallel placement is tuned for)",
                                   per_engine + ["layer", "expert"], registry=r)
        # vLLM's lora_requests_info: one series, its labels the adapters in use, its value the time
        self.lora_info = Gauge("shardlm:lora_requests_info", "LoRA adapters of running and waiting requests",
                               ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        # speculative decoding (vLLM's spec_decode_* names): totals so far, per replica and in all
        self.spec_gauges = {
            "spec_num_drafts": Gauge("shardlm:spec_decode_num_drafts", "Speculative proposals verified",
                                     per_engine, registry=r),
            "spec_num_draft_tokens": Gauge("shardlm:spec_decode_num_draft_tokens", "Proposed tokens verified",
                                           per_engine, registry=r),
            "spec_num_accepted_tokens": Gauge("shardlm:spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                                              per_engine, registry=r),
        }
        self.spec_per_position = Gauge("shardlm:spec_decode_num_accepted_tokens_per_pos",
                                       "Proposed tokens accepted at each position of a proposal",
                                       per_engine + ["position"], registry=r)
        self.restarts = Gauge("shardlm:engine_restarts",
                              "Times the engine (engine=\"all\") or a data parallel replica was started again "
                              "after it died", per_engine, registry=r)
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

    def observe_tokens(self, m: RequestMetrics, num_new: int, gap: float | None) -> None:
        self.vllm_requests.observe_tokens(m, num_new, gap)

    def observe_finished(self, out: RequestOutput) -> None:
        if out.metrics is not None:
            self.vllm_requests.observe_finished(out)
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

    def render(self, stats: dict | None, restarts: dict[str, int] | None = None) -> bytes:
        """stats: the engine cores' combined stats (engine/dp.py combine_stats); restarts:
        AsyncLLM.restarts (None while the engine is down: the gauges keep their last values)."""
        for engine, n in (restarts or {}).items():
            self.restarts.labels(engine="all" if engine == "engine" else engine, **self.labels).set(n)
        if stats:
            self.vllm_engines.stats = stats
            for engine, values in [("all", stats), *((str(e["engine"]), e) for e in stats.get("engines", []))]:
                for key, gauge in self.engine_gauges.items():
                    gauge.labels(engine=engine, **self.labels).set(values[key])
                if "spec_num_drafts" in values:
                    for key, gauge in self.spec_gauges.items():
                        gauge.labels(engine=engine, **self.labels).set(values[key])
                    for position, n in enumerate(values["spec_accepted_per_position"]):
                        self.spec_per_position.labels(engine=engine, position=str(position), **self.labels).set(n)
                if engine == "all" and "max_lora" in values:
                    self.lora_info.clear()
                    self.lora_info.labels(str(values["max_lora"]), ",".join(values["running_lora_adapters"]),
                                          ",".join(values["waiting_lora_adapters"])).set_to_current_time()
                for layer, counts in values.get("expert_load", {}).items():
                    for expert, n in enumerate(counts):
                        self.expert_tokens.labels(engine=engine, layer=layer, expert=str(expert), **self.labels).set(n)
        return generate_latest(self.registry)
