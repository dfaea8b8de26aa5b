"""A real `shardlm serve` on a free loopback port, used through the official openai client."""

import os
import re
import signal
import time

import httpx
import openai
import pytest

from shardlm import LLM, SamplingParams
from tests.helpers import engine_core_processes, metric, server_in_this_process, start_server, stop_server

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    path = tiny_model_dir("llama-gqa")
    with server_in_this_process(path, "--api-key", KEY) as (_, url):
        yield path, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0)


PROMPTS = ["The capital of", "One two three"]


@pytest.mark.slow
def test_completions_equal_offline_greedy(server, client):
    path, _ = server
    ref = LLM(path, dtype="float32", kv_cache_memory="64MiB", max_model_len=256).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    resp = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [r.outputs[0].text for r in ref]
    assert resp.usage.completion_tokens == 20
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert all(c.finish_reason == "length" for c in resp.choices)


def test_chat_stream_equals_non_stream(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 == full.usage.completion_tokens


def test_n_seed_logprobs_and_stop(client):
    a = client.completions.create(model="tiny", prompt="Seeds", max_tokens=8, n=2, temperature=1.0, seed=7)
    b = client.completions.create(model="tiny", prompt="Seeds", max_tokens=8, n=2, temperature=1.0, seed=7)
    assert len(a.choices) == 2 and [c.text for c in a.choices] == [c.text for c in b.choices]
    lp = client.completions.create(model="tiny", prompt="Seeds", max_tokens=4, temperature=0, logprobs=2)
    info = lp.choices[0].logprobs
    assert len(info.tokens) == 4 and all(x <= 0 for x in info.token_logprobs) and len(info.top_logprobs[0]) >= 2
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 3
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    full = client.completions.create(model="tiny", prompt="Stop", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = client.completions.create(model="tiny", prompt="Stop", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_echo_with_logprobs(client):
    tok_prompt = "Echo this"
    r = client.completions.create(model="tiny", prompt=tok_prompt, max_tokens=3, temperature=0, logprobs=1, echo=True,
                                  extra_body={"ignore_eos": True}).choices[0]
    assert r.text.startswith(tok_prompt)
    assert r.logprobs.token_logprobs[0] is None and r.logprobs.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in r.logprobs.token_logprobs[1:])
    assert "".join(r.logprobs.tokens) == r.text


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 10 ** 9], "stream": True}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400,
     "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "priority": 1}, 400, "priority"),   # fcfs here
    ("/v1/nothing", {}, 404, None),
])
def test_bad_input_gets_openai_errors(server, path, body, status, param):
    url = server[1]
    r = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["code"] == status and err["param"] == param
    if path == "/v1/completions" and body.get("max_tokens") == 300:
        assert "256" in err["message"] and "300" in err["message"]
    assert httpx.get(url + "/health").status_code == 200       # still serving


def test_malformed_json_and_api_key(server):
    url = server[1]
    r = httpx.post(url + "/v1/completions", content=b"{bad", headers={"Authorization": f"Bearer {KEY}",
                                                                      "content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/version").status_code == 200
    models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["id"] == "tiny"
    tok = httpx.post(url + "/tokenize", json={"prompt": "hello world"},
                     headers={"Authorization": f"Bearer {KEY}"}).json()
    text = httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]},
                      headers={"Authorization": f"Bearer {KEY}"}).json()["prompt"]
    assert tok["count"] == len(tok["tokens"]) and "hello world" in text


@pytest.mark.slow
def test_dead_engine_turns_health_503_and_ends_the_server(tiny_model_dir):
    proc, url = start_server(tiny_model_dir("llama-gqa"), "--max-engine-restarts", "0")
    engine = engine_core_processes(proc)
    assert engine, "the engine core runs in its own process"
    os.kill(engine[0].pid, signal.SIGKILL)
    deadline, seen_503 = time.time() + 10, False
    while time.time() < deadline and proc.poll() is None:
        try:
            seen_503 |= httpx.get(url + "/health", timeout=1).status_code == 503
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert proc.wait(timeout=20) != 0
    assert "died" in proc.stderr.read()
    assert seen_503


@pytest.mark.slow
def test_prompts_longer_than_the_step_budget(tiny_model_dir):
    """A prompt several times --max-num-batched-tokens is prefilled over several steps (some of
    which sample nothing), streamed or not, beside other requests; the server goes on serving."""
    import random
    path = tiny_model_dir("llama-gqa")
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (200, 150, 7)]
    ref = LLM(path, dtype="float32", kv_cache_memory="64MiB", max_model_len=256, max_num_batched_tokens=2048).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False)
    with server_in_this_process(path, "--max-num-batched-tokens", "32") as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        alone = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert alone.choices[0].text == ref[0].outputs[0].text and alone.usage.prompt_tokens == 200
        together = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(together.choices, key=lambda c: c.index)] == [r.outputs[0].text for r in ref]
        streamed = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=8, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == ref[1].outputs[0].text
        assert httpx.get(url + "/health").status_code == 200


# Loaded by every Python process of the server below (sitecustomize): a step holding token 31337 raises.
_FAULTY_STEP = """
from shardlm.worker.model_runner import ModelRunner
_execute = ModelRunner.execute_model
def _faulty(self, so):
    if any(31337 in c.token_ids for c in so.chunks):
        raise RuntimeError("injected fault")
    return _execute(self, so)
ModelRunner.execute_model = _faulty
"""


@pytest.mark.slow
def test_a_failing_step_names_its_requests_and_ends_the_server(tiny_model_dir, tmp_path):
    """With restarts off, an error inside a step stops the engine (as in vLLM): the request gets a
    503, /health turns 503, the log names the step's requests and the server exits with code 1 for
    its supervisor. (With restarts: test_self_healing.py.)"""
    (tmp_path / "sitecustomize.py").write_text(_FAULTY_STEP)
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    proc, url = start_server(tiny_model_dir("llama-gqa"), "--max-engine-restarts", "0", env={"PYTHONPATH": pythonpath})
    try:
        ok = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        bad = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 31337, 7], "max_tokens": 2},
                         timeout=30)
        assert bad.status_code == 503 and "injected fault" in bad.json()["error"]["message"]
        seen_503 = False
        while proc.poll() is None:
            try:
                seen_503 |= httpx.get(url + "/health", timeout=1).status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert proc.wait(timeout=20) == 1 and seen_503
        log = proc.stderr.read()
        assert re.search(r"A step failed \(RuntimeError: injected fault\); it held 1 request\(s\): "
                         r"cmpl-[0-9a-f]+-0 \(positions 0-2\)", log), log[-3000:]
        assert "The engine core stopped: RuntimeError: injected fault" in log
    finally:
        if proc.poll() is None:
            stop_server(proc)


def assert_concurrent_streams_equal_offline(url: str, path: str, api_key: str = "none", n: int = 64) -> None:
    """n streams at once equal the offline engine's greedy texts; the KV cache is free after."""
    import asyncio
    prompts = [f"Story number {i} begins" for i in range(n)]
    ref = LLM(path, dtype="float32", kv_cache_memory="64MiB", max_model_len=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)

    async def one(client, prompt):
        text = ""
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(main())
    assert texts == [r.outputs[0].text for r in ref]
    assert metric(url, "shardlm:num_requests_running") == 0
    assert metric(url, "shardlm:kv_cache_usage_perc") == 0.0
    assert metric(url, "shardlm:generation_tokens_total") >= n * 16


@pytest.mark.slow
def test_64_concurrent_streams_complete_correctly_and_free_the_cache(server):
    path, url = server
    assert_concurrent_streams_equal_offline(url, path, KEY)
    assert "shardlm:time_to_first_token_seconds_bucket" in httpx.get(url + "/metrics").text


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    url = server[1]
    aborted_before = metric(url, "shardlm:num_requests_aborted")
    body = {"model": "tiny", "prompt": "A long story", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]          # a few chunks, then the client goes away
    assert any(line.startswith("data: {") for line in got)
    deadline = time.time() + 10
    while time.time() < deadline and (metric(url, "shardlm:num_requests_running") != 0
                                      or metric(url, "shardlm:kv_cache_usage_perc") != 0.0):
        time.sleep(0.1)
    assert metric(url, "shardlm:num_requests_running") == 0
    assert metric(url, "shardlm:kv_cache_usage_perc") == 0.0
    assert metric(url, "shardlm:num_requests_aborted") == aborted_before + 1   # stopped, not run to the end


def test_a_bad_prompt_among_several_adds_none_of_them(server):
    """Input is checked once, by the engine's input processor, before any response starts:
    a bad second prompt leaves no first prompt running."""
    url = server[1]
    aborted_before = metric(url, "shardlm:num_requests_aborted")
    for stream in (False, True):
        body = {"model": "tiny", "prompt": [[5, 6, 7], [5, 10 ** 9]], "max_tokens": 200, "ignore_eos": True,
                "stream": stream}
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "outside the vocabulary" in r.json()["error"]["message"]
    deadline = time.time() + 10
    while time.time() < deadline and metric(url, "shardlm:num_requests_aborted") < aborted_before + 2:
        time.sleep(0.1)
    assert metric(url, "shardlm:num_requests_aborted") == aborted_before + 2   # the first prompt, twice
    assert metric(url, "shardlm:num_requests_running") == 0
    assert metric(url, "shardlm:kv_cache_usage_perc") == 0.0


@pytest.mark.slow
def test_bench_serve_reports_latencies(server):
    from shardlm.bench.serve import run_serve_bench
    r = run_serve_bench(server[1], None, KEY, concurrency=2, num_prompts=4, workload=None, output_len=8)
    assert r["model"] == "tiny" and r["completed"] == 4 and r["failed"] == 0
    assert r["output_tok_s"] > 0 and r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p99"] >= r["itl_ms"]["p50"] > 0
    bad = run_serve_bench(server[1], "tiny", "wrong-key", concurrency=1, num_prompts=2, workload=None, output_len=4)
    assert bad["completed"] == 0 and bad["failed"] == 2 and "401" in bad["errors"][0]
