"""Requests that used to crash or wedge the server each get a 4xx in OpenAI's shape, and the
server answers a normal request the same way afterwards; a client that leaves a non-streaming
request aborts it; a stream whose engine dies ends with an error event and [DONE]; and a
property-based fuzz of request bodies never gets a 5xx."""

import json
import os
import signal
import time

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import engine_core_processes, metric, server_in_this_process, start_server, stop_server, wait_gone

VOCAB = 49152          # the tiny models' vocabulary
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _c(**kw):
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **kw}


def _chat(**kw):
    return {"model": "tiny", "messages": MSG, "max_tokens": 2, **kw}


# (name, path, body (dict, or raw bytes), status, param)
CASES = [
    ("stop id outside vocab, min_tokens", CMPL, _c(min_tokens=1, stop_token_ids=[VOCAB]), 400, "stop_token_ids"),
    ("stop id outside vocab, streamed", CMPL, _c(stop_token_ids=[VOCAB], stream=True), 400, "stop_token_ids"),
    ("stop id above int64", CMPL, _c(stop_token_ids=[2**64]), 400, "stop_token_ids"),
    ("top_k above int64", CMPL, _c(temperature=1, top_k=2**63), 400, "top_k"),
    ("top_k above vocab", CMPL, _c(temperature=1, top_k=VOCAB + 1), 400, "top_k"),
    ("lone surrogate prompt", CMPL, b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    ("lone surrogate chat", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages"),
    ("seed 2**64", CMPL, _c(seed=2**64), 400, "seed"),
    ("seed negative", CMPL, _c(seed=-1), 400, "seed"),
    ("temperature NaN", CMPL, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("temperature Infinity", CMPL, b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', 400,
     "temperature"),
    ("repetition_penalty -Infinity", CHAT,
     b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": -Infinity}', 400,
     "repetition_penalty"),
    ("top_p NaN", CMPL, b'{"model": "tiny", "prompt": "hi", "top_p": NaN}', 400, "top_p"),
    ("logit_bias id outside vocab", CMPL, _c(logit_bias={str(VOCAB): 1}), 400, "logit_bias"),
    ("logit_bias value 1000", CMPL, _c(logit_bias={"5": 1000}), 400, "logit_bias"),
    ("logit_bias key not an id", CMPL, _c(logit_bias={"five": 1}), 400, "logit_bias"),
    ("allowed_token_ids outside vocab", CHAT, _chat(allowed_token_ids=[10**12]), 400, "allowed_token_ids"),
    ("n 100000", CMPL, _c(n=100000), 400, "n"),
    ("an image part", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]),
     400, None),
    ("10000 prompts", CMPL, _c(prompt=["hi"] * 10000), 400, "prompt"),
    ("prompt id -1", CMPL, _c(prompt=[5, -1]), 400, "prompt"),
    ("prompt id 10**30", CMPL, _c(prompt=[5, 10**30]), 400, "prompt"),
    ("max_tokens negative", CMPL, _c(max_tokens=-5), 400, "max_tokens"),
    ("max_tokens 10**30", CMPL, _c(max_tokens=10**30), 400, "max_tokens"),
    ("min_tokens 10**30", CMPL, _c(max_tokens=None, min_tokens=10**30), 400, "min_tokens"),
    ("best_of not implemented", CMPL, _c(best_of=2), 400, "best_of"),
    ("response_format of an unknown type", CHAT, _chat(response_format={"type": "yaml"}), 400,
     "response_format.type"),
    ("json_schema without a schema", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {}}), 400,
     "response_format"),
    ("a regex that does not parse", CMPL, _c(guided_regex="[a-"), 400, "structured_outputs"),
    ("a JSON schema of an unknown type", CMPL, _c(structured_outputs={"json": {"type": "nonsense"}}), 400,
     "structured_outputs"),
    ("two constraints at once", CMPL, _c(guided_regex="a+", guided_choice=["a"]), 400, "guided_regex"),
    ("an empty choice list", CMPL, _c(guided_choice=[]), 400, "guided_choice"),
    ("a backend that is not here", CMPL, _c(guided_regex="a+", guided_decoding_backend="outlines"), 400,
     "guided_decoding_backend"),
    ("100 stop strings", CMPL, _c(stop=[f"s{i}" for i in range(100)]), 400, "stop"),
    ("a 10000-character stop string", CMPL, _c(stop=["x" * 10000]), 400, "stop"),
    ("temperature of the wrong type", CMPL, _c(temperature="hot"), 400, "temperature"),
    ("unknown role", CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role"),
    ("frequency_penalty 3", CMPL, _c(frequency_penalty=3), 400, "frequency_penalty"),
    ("logprobs 100", CMPL, _c(logprobs=100), 400, "logprobs"),
    ("top_logprobs without logprobs", CHAT, _chat(top_logprobs=3), 400, "top_logprobs"),
    ("deeply nested prompt", CMPL, b'{"model": "tiny", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400,
     None),
    ("invalid UTF-8 body", CMPL, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    ("20 MB body", CMPL, json.dumps(_c(prompt="x " * (10 << 20))).encode(), 413, None),
    ("not JSON", CMPL, b"{bad", 400, None),
    ("messages not a list", CHAT, _chat(messages="hi"), 400, "messages"),
    ("tokenize an empty conversation", "/tokenize", {"messages": []}, 400, "messages"),
    ("tokenize a lone surrogate", "/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages"),
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with server_in_this_process(tiny_model_dir("llama-gqa")) as served:
        yield served


def _greedy(url) -> str:
    r = httpx.post(url + CMPL, json=_c(prompt="The capital of", max_tokens=12, temperature=0, ignore_eos=True),
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow
def test_hostile_requests_get_4xx_and_the_server_keeps_serving(server):
    served, url = server
    before = _greedy(url)
    failures = []
    for name, path, body, status, param in CASES:
        t0 = time.perf_counter()
        if isinstance(body, bytes):
            r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        else:
            r = httpx.post(url + path, json=body, timeout=30)
        took = time.perf_counter() - t0
        try:
            err = r.json()["error"]
            ok = r.status_code == status and err["code"] == status and err["message"] and \
                (param is None or err["param"] == param) and took < 5
        except (ValueError, KeyError, TypeError):
            ok, err = False, r.text[:200]
        if not ok:
            failures.append(f"{name}: {r.status_code} in {took:.1f} s: {err}")
        assert served.is_serving(), f"the server died on: {name}"
        assert _greedy(url) == before, f"a normal request changed after: {name}"
    assert not failures, "\n".join(failures)
    assert len(CASES) >= 30
    assert metric(url, "shardlm:num_requests_running") == 0


def test_logit_bias_and_allowed_token_ids_steer_greedy_output(server):
    url = server[1]
    plain = httpx.post(url + CMPL, json=_c(prompt=[5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True,
                                           logprobs=0)).json()["choices"][0]
    r = httpx.post(url + "/tokenize", json={"prompt": "x", "add_special_tokens": False}).json()
    forced = r["tokens"][0]
    biased = httpx.post(url + CMPL, json=_c(prompt=[5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True,
                                            logit_bias={str(forced): 100})).json()["choices"][0]
    assert biased["text"] == "x" * 4 and plain["text"] != biased["text"]
    allowed = httpx.post(url + CHAT, json=_chat(max_tokens=6, temperature=1.0, seed=3,
                                                allowed_token_ids=[forced])).json()["choices"][0]
    assert allowed["message"]["content"] == "x" * 6


def test_a_client_that_leaves_a_non_streaming_request_aborts_it(server):
    url = server[1]
    body = _c(prompt="A long story", max_tokens=200, ignore_eos=True)
    start = time.perf_counter()
    httpx.post(url + CMPL, json=body, timeout=30).raise_for_status()
    whole = time.perf_counter() - start         # the client leaves a quarter of the way through
    aborted = metric(url, "shardlm:num_requests_aborted")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + CMPL, json=body, timeout=whole / 4)
    deadline = time.time() + 10
    while time.time() < deadline and metric(url, "shardlm:num_requests_aborted") < aborted + 1:
        time.sleep(0.1)
    assert metric(url, "shardlm:num_requests_aborted") == aborted + 1
    assert metric(url, "shardlm:num_requests_running") == 0
    assert metric(url, "shardlm:kv_cache_usage_perc") == 0.0


@pytest.mark.slow
def test_a_client_that_leaves_a_stream_before_reading_it_aborts_it(server):
    """Requests go out on raw sockets, each closed without reading a byte as soon as the engine
    has it (its stream's generator may never have started): each is aborted, none is left running."""
    import json
    import socket
    url = server[1]
    aborted = metric(url, "shardlm:num_requests_aborted")
    routed = metric(url, "shardlm:num_requests_routed")
    host, port = url.split("//")[1].split(":")
    body = json.dumps(_c(prompt="A long story", max_tokens=200, ignore_eos=True, stream=True)).encode()
    added = 0
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.time() + 30
            while metric(url, "shardlm:num_requests_routed") - routed == added and time.time() < deadline:
                time.sleep(0.01)
        added = metric(url, "shardlm:num_requests_routed") - routed
    deadline = time.time() + 10
    while time.time() < deadline and metric(url, "shardlm:num_requests_aborted") < aborted + added:
        time.sleep(0.1)
    assert added >= 1, "no request reached the engine: the test shows nothing"
    assert metric(url, "shardlm:num_requests_aborted") == aborted + added
    assert metric(url, "shardlm:num_requests_running") == 0
    assert metric(url, "shardlm:kv_cache_usage_perc") == 0.0


def _engine_process(proc) -> psutil.Process:
    return engine_core_processes(proc)[0]


def _stream_then_signal(url, after_lines: int, pid: int, sig) -> tuple[dict, list[str]]:
    """Stream a long completion, send `sig` to `pid` after `after_lines` events; -> (the error event
    before the last line, every line)."""
    body = _c(prompt="A long story", max_tokens=250, ignore_eos=True, stream=True)
    lines = []
    with httpx.stream("POST", url + CMPL, json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == after_lines:
                os.kill(pid, sig)
    return json.loads(lines[-2].removeprefix("data: "))["error"], lines


@pytest.mark.slow
def test_a_stream_whose_engine_dies_ends_with_an_error_event_and_done(tiny_model_dir):
    proc, url = start_server(tiny_model_dir("llama-gqa"))
    try:
        error, lines = _stream_then_signal(url, 3, _engine_process(proc).pid, signal.SIGKILL)
        assert lines[-1] == "data: [DONE]"
        assert error["code"] == 503 and "engine core" in error["message"]
    finally:
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        alive = wait_gone(children, 10)
        assert not alive


@pytest.mark.slow
def test_a_full_queue_answers_429_with_retry_after_and_keeps_serving(tiny_model_dir):
    import asyncio
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--max-num-waiting", "8", "--max-num-seqs", "2") as (
            server, url):
        async def one(client):      # two run at a time, 50 steps each: 60 fill the queue however fast we are
            return await client.post(url + CMPL, json=_c(max_tokens=50, ignore_eos=True), timeout=300)

        async def main():
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=60)) as client:
                return await asyncio.gather(*(one(client) for _ in range(60)))

        responses = asyncio.run(main())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429} and codes.count(200) >= 8 and codes.count(429) > 0, codes
        busy = next(r for r in responses if r.status_code == 429)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["code"] == 429
        assert _greedy(url)


def test_a_full_engine_answers_503_to_send_the_request_elsewhere(tiny_model_dir):
    """--max-num-queued-reqs 2 (vLLM's): with two requests in the engine, running or waiting, a
    third gets 503 with Retry-After; they finish, and the next one is served."""
    import threading
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--max-num-queued-reqs", "2",
                                "--max-num-seqs", "1") as (_, url):
        answers = []
        busy = [threading.Thread(target=lambda: answers.append(httpx.post(
            url + CMPL, json=_c(max_tokens=250, ignore_eos=True), timeout=120).status_code)) for _ in range(2)]
        for t in busy:
            t.start()
        deadline = time.time() + 60         # one runs, the other waits (--max-num-seqs 1)
        while metric(url, "shardlm:num_requests_waiting") < 1 and time.time() < deadline:
            time.sleep(0.01)
        full = httpx.post(url + CMPL, json=_c())
        for t in busy:
            t.join(120)
        assert full.status_code == 503 and full.headers["retry-after"] == "1", full.text
        assert "--max-num-queued-reqs 2" in full.json()["error"]["message"]
        assert answers == [200, 200] and httpx.post(url + CMPL, json=_c()).status_code == 200


FIELDS = ["model", "prompt", "messages", "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
          "min_tokens", "stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "logprobs", "top_logprobs",
          "echo", "stream", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
          "include_stop_str_in_output", "skip_special_tokens", "stream_options", "best_of", "user", "suffix"]

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70), st.sampled_from([0, 1, 2, 5, 49151, 49152, 2**63, -1]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 1e308, -1e-300]),
    st.text(max_size=20), st.sampled_from(["\ud800", "tiny", "", "x" * 300]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=8)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    proc, url = start_server(tiny_model_dir("llama-gqa"), "--max-n", "4", "--max-prompts", "4")
    yield proc, url
    stop_server(proc)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=bodies, chat=st.booleans())
def test_no_request_body_gets_a_5xx(fuzz_server, body, chat):
    """Property-based fuzz of the request bodies (bounded in count, loopback only): whatever a
    client sends, the server answers below 500 and keeps serving."""
    proc, url = fuzz_server
    body.setdefault("model", "tiny")
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8                    # keep the valid ones short
    body.setdefault("max_tokens", 4)
    try:
        r = httpx.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=60)
    except ValueError:                            # httpx cannot even encode it (NaN in JSON is fine, this is not)
        return
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.json()["error"]["code"] == r.status_code
    assert proc.poll() is None
