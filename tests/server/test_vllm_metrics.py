"""/metrics under vLLM's names: every series vLLM 0.32 exports that applies here, with vLLM's type
and histogram bounds (parsed with prometheus_client's own parser), every metric that vLLM's example
Grafana dashboard and the autoscalers query (tests/data/vllm_dashboard_queries.txt) present with the
type its query needs, and values that add up for the requests sent."""

import os
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardlm.entrypoints.openai.vllm_metrics import ITL_BUCKETS, REQUEST_TIME_BUCKETS, TTFT_BUCKETS, buckets_1_2_5
from tests.helpers import server_in_this_process

QUERIES = os.path.join(os.path.dirname(__file__), "..", "data", "vllm_dashboard_queries.txt")
MAX_MODEL_LEN = 256        # the tests' servers (helpers.SERVE_FLAGS)
VLLM_SERIES = {
    "vllm:num_requests_running": ("gauge", None), "vllm:num_requests_waiting": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None), "vllm:cache_config_info": ("gauge", None),
    "vllm:prompt_tokens": ("counter", None), "vllm:generation_tokens": ("counter", None),
    "vllm:num_preemptions": ("counter", None), "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None), "vllm:request_success": ("counter", None),
    "vllm:iteration_tokens_total": ("histogram", (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)),
    "vllm:time_to_first_token_seconds": ("histogram", TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("histogram", ITL_BUCKETS),
    "vllm:request_time_per_output_token_seconds": ("histogram", ITL_BUCKETS),
    **{f"vllm:{name}": ("histogram", REQUEST_TIME_BUCKETS) for name in (
        "e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
        "request_prefill_time_seconds", "request_decode_time_seconds")},
    **{f"vllm:{name}": ("histogram", tuple(buckets_1_2_5(MAX_MODEL_LEN))) for name in (
        "request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
        "request_params_max_tokens")},
    "vllm:request_params_n": ("histogram", (1, 2, 5, 10, 20)),
}


@pytest.fixture(scope="module")
def scraped(tiny_model_dir):
    with server_in_this_process(tiny_model_dir("llama-gqa")) as (_, url):
        for prompt, n in (("The capital of", 1), ("One two three", 2), ("Hello", 1)):
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "n": n,
                                                          "temperature": 0.5, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200
        text = httpx.get(url + "/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _bounds(family) -> tuple:
    return tuple(sorted({float(s.labels["le"]) for s in family.samples
                         if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"}))


def _value(family, suffix: str = "", **labels) -> float:
    return sum(s.value for s in family.samples if s.name == family.name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_vllm_series_with_its_type_labels_and_buckets(scraped):
    for name, (kind, bounds) in VLLM_SERIES.items():
        assert name in scraped, name
        family = scraped[name]
        assert family.type == kind, (name, family.type)
        assert all(s.labels["engine"] == "0" for s in family.samples), name
        if name != "vllm:cache_config_info":          # (vLLM's labels it by the cache's settings alone)
            assert all(s.labels["model_name"] == "tiny" for s in family.samples), name
        if bounds is not None:
            assert _bounds(family) == tuple(map(float, bounds)), name


def test_every_dashboard_query_finds_its_metric(scraped):
    exposed = {s.name: f.type for f in scraped.values() for s in f.samples}
    for line in open(QUERIES):
        if line.startswith("#") or not line.strip():
            continue
        for name in re.findall(r"vllm:[a-z0-9_]+", line):
            assert name in exposed, f"{name} (queried by: {line.strip()})"
            if name.endswith("_bucket"):
                assert exposed[name] == "histogram", name


def test_the_values_add_up(scraped):
    assert _value(scraped["vllm:request_success"], "_total", finished_reason="length") == 4     # 1 + 2 + 1 samples
    assert _value(scraped["vllm:generation_tokens"], "_total") == 4 * 8
    assert _value(scraped["vllm:request_generation_tokens"], "_sum") == 4 * 8
    assert _value(scraped["vllm:request_params_n"], "_sum") == 1 + 2 + 1
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "time_to_first_token_seconds", "request_params_max_tokens"):
        assert _value(scraped[f"vllm:{name}"], "_count") == 3, name          # one per request
    assert _value(scraped["vllm:request_params_max_tokens"], "_sum") == 3 * 8
    assert _value(scraped["vllm:inter_token_latency_seconds"], "_count") == 4 * 7    # per sample: 7 gaps
    steps = _value(scraped["vllm:iteration_tokens_total"], "_count")
    assert steps >= 8 and _value(scraped["vllm:iteration_tokens_total"], "_sum") == \
        _value(scraped["vllm:prompt_tokens"], "_total") + 4 * 8
    assert _value(scraped["vllm:num_requests_running"]) == 0
