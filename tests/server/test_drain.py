"""Graceful drain: SIGTERM lets the requests in flight finish (up to --shutdown-timeout), refuses
new ones with 503 meanwhile, and the server exits 0; those still running at the deadline end
with a 503 that says why. SIGINT (Ctrl-C) stops at once."""

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from shardlm.entrypoints.openai.drain import DrainGate
from shardlm.entrypoints.openai.state import ServerState
from tests.helpers import start_server, wait_gone


def test_the_gate_counts_requests_and_refuses_new_ones_while_draining():
    state, seen = ServerState(), []

    async def app(scope, receive, send):
        seen.append(state.in_flight)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    gate = DrainGate(app, state=state, open_routes=("/health",))

    async def call(path):
        sent = []

        async def send(message):
            sent.append(message)
        await gate({"type": "http", "path": path, "headers": []}, None, send)
        return sent[0]["status"], dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent[1:])

    assert asyncio.run(call("/v1/completions"))[0] == 200 and seen == [1] and state.in_flight == 0
    state.draining = True
    status, headers, body = asyncio.run(call("/v1/completions"))
    assert status == 503 and headers[b"retry-after"] == b"5" and b"shutting down" in body
    assert seen == [1], "a refused request never reaches the app"
    assert asyncio.run(call("/health"))[0] == 200, "open routes still answer (health says draining itself)"


def _stream(url, body, events):
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                events.append(line)


def _stream_begun(url, body) -> tuple[threading.Thread, list[str]]:
    """A stream of `body` on a thread, once its first event came: (the thread, its events so far)."""
    events = []
    stream = threading.Thread(target=_stream, args=(url, body, events))
    stream.start()
    while not events:
        time.sleep(0.01)
    return stream, events


@pytest.mark.slow
def test_sigterm_finishes_the_stream_in_flight_refuses_new_requests_and_exits_0(tiny_model_dir):
    proc, url = start_server(tiny_model_dir("llama-gqa"), "--max-num-seqs", "1")
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    stream, events = _stream_begun(url, body)
    # behind it, one that waits for the only running slot: in flight too, so it is served
    queued = []
    waiting = threading.Thread(target=lambda: queued.append(httpx.post(url + "/v1/completions", json=body,
                                                                       timeout=60)))
    waiting.start()
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    health = refused = None
    while proc.poll() is None:        # until the server says it drains (or, wrongly, is gone)
        try:
            health = httpx.get(url + "/health", timeout=1)
            if health.status_code == 503:
                refused = httpx.post(url + "/v1/completions", json=body, timeout=5)
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.01)
    stream.join(60)
    waiting.join(60)
    assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
    assert refused is not None, "the server stopped before the requests in flight finished"
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    assert "shutting down" in refused.json()["error"]["message"]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    text = "".join(json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-1])
    assert queued[0].status_code == 200 and queued[0].json()["choices"][0]["text"] == text, \
        "both requests ran to the end, and alike"


@pytest.mark.slow
def test_a_sigterm_to_the_whole_process_group_drains_as_one_to_the_server(tiny_model_dir):
    """systemd's stop (KillMode=control-group) and `kill -- -PGID` signal every process at once:
    the engine core, its TP workers and the fork server leave it to the server, so the stream in
    flight finishes, nothing dies or starts again, and no process is left."""
    proc, url = start_server(tiny_model_dir("llama-gqa"), "--tensor-parallel-size", "2", new_session=True)
    children = psutil.Process(proc.pid).children(recursive=True)
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    stream, events = _stream_begun(url, body)
    os.killpg(proc.pid, signal.SIGTERM)
    stream.join(60)
    assert proc.wait(timeout=30) == 0
    log = proc.stderr.read()
    assert "died" not in log and "Traceback" not in log, log[-3000:]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    assert len(events) == 101, "every token of the stream in flight came"
    assert not wait_gone(children, 10)


@pytest.mark.slow
def test_requests_still_running_at_the_deadline_end_with_503_and_the_server_exits_0(tiny_model_dir):
    proc, url = start_server(tiny_model_dir("llama-gqa"), "--max-num-seqs", "1", "--shutdown-timeout", "0.5")
    body = {"model": "tiny", "prompt": "Count", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(httpx.post(url + "/v1/completions", json=body,
                                                                         timeout=60)))
               for _ in range(40)]        # one at a time, far more than 0.5 s of work
    for t in threads:
        t.start()
    while not answers:                    # one has finished: the rest are running or waiting
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert proc.wait(timeout=30) == 0
    assert len(answers) == 40, "every request was answered"
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 503} and 200 in codes, codes
    ended = [a.json()["error"]["message"] for a in answers if a.status_code == 503]
    assert any("shut down before this request finished (--shutdown-timeout 0.5 s)" in m for m in ended), ended


@pytest.mark.slow
def test_a_zero_timeout_stops_at_once_as_before(tiny_model_dir):
    proc, url = start_server(tiny_model_dir("llama-gqa"), "--shutdown-timeout", "0")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM, "not drained: the signal ends the process, as uvicorn does"


@pytest.mark.slow
def test_ctrl_c_stops_at_once_and_quietly_with_exit_status_130(tiny_model_dir):
    """SIGINT, as Ctrl-C sends it to the server (its engine processes ignore it, and go with it):
    no traceback, the shell's status for an interrupted command, no process left."""
    proc, url = start_server(tiny_model_dir("llama-gqa"))
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert "Traceback" not in proc.stderr.read()
    assert not wait_gone(children, 10)
