"""vLLM's Prometheus series, under vLLM's names, types, labels (model_name, engine: the data
parallel replica) and histogram buckets, so that vLLM's Grafana dashboard, its router and the
autoscaling rules written for it read a shardlm server unchanged. They are exported beside the
`shardlm:` series (metrics.py), which stay for the dashboards already built on them and for what
vLLM has no name for (restarts, aborts, routing, expert load).

Two sources: what each engine core counts (running and waiting requests, KV cache use, prefix
cache, preemptions, prompt and generated tokens, tokens per step) comes with its stats and is
exported as it stands (EngineSeries, a collector: counters are the engine's totals); what each
request lived through (latencies, token counts, its parameters) is observed in the API server as
its tokens arrive and when it finishes (RequestSeries)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from shardlm.core.stat_logger import ITERATION_TOKEN_BUCKETS
from shardlm.outputs import RequestMetrics, RequestOutput

LABELS = ["model_name", "engine"]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class RequestSeries:
    """What each request lived through, observed in the API server."""

    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry):
        self.model_name = model_name
        r, tokens = registry, buckets_1_2_5(max_model_len)

        def histogram(name, doc, buckets):
            return Histogram(f"vllm:{name}", doc, LABELS, buckets=buckets, registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_TIME_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               REQUEST_TIME_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_TIME_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_TIME_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                                REQUEST_TIME_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                           tokens)
        self.max_generation_tokens = histogram("request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.", tokens)
        self.max_tokens = histogram("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                    tokens)
        self.n = histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               LABELS + ["finished_reason"], registry=r)

    def _labels(self, m: RequestMetrics) -> dict:
        return {"model_name": self.model_name, "engine": str(m.engine)}

    def observe_tokens(self, m: RequestMetrics, num_new: int, gap: float | None) -> None:
        if gap is not None:
            self.itl.labels(**self._labels(m)).observe(gap)

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        lab = self._labels(m)
        generated = [len(c.token_ids) for c in out.outputs]
        for c in out.outputs:
            self.success.labels(finished_reason=c.finish_reason or "abort", **lab).inc()
        self.prompt_tokens.labels(**lab).observe(len(out.prompt_token_ids))
        self.generation_tokens.labels(**lab).observe(sum(generated))
        self.max_generation_tokens.labels(**lab).observe(max(generated, default=0))
        self.n.labels(**lab).observe(m.n_param)
        if m.max_tokens_param is not None:
            self.max_tokens.labels(**lab).observe(m.max_tokens_param)
        if m.finished_time is None or m.first_token_time is None:
            return
        self.ttft.labels(**lab).observe(m.first_token_time - m.arrival_time)
        self.e2e.labels(**lab).observe(m.finished_time - m.arrival_time)
        self.decode.labels(**lab).observe(m.finished_time - m.first_token_time)
        if max(generated, default=0) > 1:
            self.tpot.labels(**lab).observe((m.finished_time - m.first_token_time) / (max(generated) - 1))
        if m.first_scheduled_time is not None:
            scheduled = min(m.first_scheduled_time, m.first_token_time)   # (clocks of another node may lead)
            self.queue.labels(**lab).observe(max(0.0, scheduled - m.arrival_time))
            self.prefill.labels(**lab).observe(m.first_token_time - scheduled)
            self.inference.labels(**lab).observe(m.finished_time - scheduled)


class EngineSeries:
    """What the engine cores count, from their latest stats (a collector: read at each scrape)."""

    def __init__(self, model_name: str, cache_info: dict[str, str], registry: CollectorRegistry):
        self.model_name = model_name
        self.cache_info = cache_info
        self.stats: dict | None = None
        registry.register(self)

    def collect(self):
        engines = self._per_engine()
        gauges = {"num_requests_running": ("num_running", "Number of requests in model execution batches."),
                  "num_requests_waiting": ("num_waiting", "Number of requests waiting to be processed."),
                  "kv_cache_usage_perc": ("kv_cache_usage", "KV-cache usage. 1 means 100 percent usage.")}
        for name, (key, doc) in gauges.items():
            family = GaugeMetricFamily(f"vllm:{name}", doc, labels=LABELS)
            for engine, s in engines:
                family.add_metric([self.model_name, engine], s[key])
            yield family
        counters = {"prompt_tokens": ("prompt_tokens", "Number of prefill tokens processed."),
                    "generation_tokens": ("generation_tokens", "Number of generation tokens processed."),
                    "num_preemptions": ("num_preemptions", "Cumulative number of preemption from the engine."),
                    "prefix_cache_queries": ("prefix_cache_queries",
                                             "Prefix cache queries, in terms of number of queried tokens."),
                    "prefix_cache_hits": ("prefix_cache_hits",
                                          "Prefix cache hits, in terms of number of cached tokens.")}
        for name, (key, doc) in counters.items():
            family = CounterMetricFamily(f"vllm:{name}", doc, labels=LABELS)
            for engine, s in engines:
                family.add_metric([self.model_name, engine], s[key])
            yield family
        family = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                       labels=LABELS)
        for engine, s in engines:
            counts, seen = s["iteration_buckets"], 0
            buckets = []
            for bound, n in zip([*map(str, ITERATION_TOKEN_BUCKETS), "+Inf"], counts):
                seen += n
                buckets.append((bound, seen))
            family.add_metric([self.model_name, engine], buckets, s["iteration_tokens_sum"])
        yield family
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=[*self.cache_info, "engine"])
        for engine, _ in engines or [("0", None)]:
            info.add_metric([*self.cache_info.values(), engine], 1)
        yield info
        yield from self._speculative(engines)
        yield from self._lora()

    def _speculative(self, engines: list[tuple[str, dict]]):
        """Speculative decoding's counters, where it runs."""
        running = [(e, s) for e, s in engines if "spec_num_drafts" in s]
        if not running:
            return
        for name, key, doc in (("num_drafts", "spec_num_drafts", "Number of spec decoding drafts."),
                               ("num_draft_tokens", "spec_num_draft_tokens", "Number of draft tokens."),
                               ("num_accepted_tokens", "spec_num_accepted_tokens", "Number of accepted tokens.")):
            family = CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=LABELS)
            for engine, s in running:
                family.add_metric([self.model_name, engine], s[key])
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", labels=[*LABELS, "position"])
        for engine, s in running:
            for position, n in enumerate(s["spec_accepted_per_position"]):
                family.add_metric([self.model_name, engine, str(position)], n)
        yield family

    def _lora(self):
        """vLLM's lora_requests_info: the adapters of running and waiting requests, its value the time."""
        if not self.stats or "max_lora" not in self.stats:
            return
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        family.add_metric([str(self.stats["max_lora"]), ",".join(self.stats["waiting_lora_adapters"]),
                           ",".join(self.stats["running_lora_adapters"])], time.time())
        yield family

    def _per_engine(self) -> list[tuple[str, dict]]:
        if not self.stats:
            return []
        if "engines" in self.stats:
            return [(str(e["engine"]), e) for e in self.stats["engines"]]
        return [("0", self.stats)]
