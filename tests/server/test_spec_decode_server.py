"""Speculative decoding in the server: --speculative-config, completions (streamed and not) equal
to the offline engine's without speculation, the spec_decode_* series in /metrics, and a bad
config refused before start-up with the reason."""

import subprocess
import sys

import httpx
import openai
import pytest

from shardlm import LLM, SamplingParams
from tests.helpers import labelled_metric, server_in_this_process

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
# token ids that repeat themselves: the random model's continuations repeat too, so lookups find proposals
PROMPTS = [[100, 200, 300, 400] * 5, [107, 200, 301, 400] * 5 + [107]]


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir):
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--speculative-config", NGRAM) as (_, url):
        yield url


def test_completions_equal_plain_decoding_and_metrics_count_proposals(spec_server, tiny_model_dir):
    client = openai.OpenAI(base_url=spec_server + "/v1", api_key="none", max_retries=0)
    resp = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(resp.choices, key=lambda c: c.index)]
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == texts[0]
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="64MiB", max_model_len=256)
    try:
        want = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert texts == [o.outputs[0].text for o in want]
    metrics = httpx.get(spec_server + "/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("shardlm:spec_decode") and 'engine="all"' in line and "position" not in line}
    assert values["shardlm:spec_decode_num_drafts"] > 0
    assert 0 < values["shardlm:spec_decode_num_accepted_tokens"] <= values["shardlm:spec_decode_num_draft_tokens"]
    assert 'shardlm:spec_decode_num_accepted_tokens_per_pos{engine="all",model_name="tiny",position="0"}' in metrics
    # and under vLLM's names, per replica
    drafts = labelled_metric(metrics, "vllm:spec_decode_num_drafts_total", "0")
    assert drafts == values["shardlm:spec_decode_num_drafts"]
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"}' in metrics


@pytest.mark.slow
def test_a_bad_speculative_config_is_refused_with_the_reason(tiny_model_dir):
    proc = subprocess.run([sys.executable, "-m", "shardlm.entrypoints.cli", "serve", tiny_model_dir("llama-gqa"),
                           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "num_speculative_tokens=99 must be an integer from 1 to 16" in proc.stderr
