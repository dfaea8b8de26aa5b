"""Hybrid load balancing (--data-parallel-hybrid-lb; --data-parallel-rank is its one-replica case)
with expert parallel replicas: each server runs its own replicas and balances its own requests,
while their MoE layers step together across the servers (engine/dp_front_ends.py). Answers equal
one rank's whichever server is busy (an idle server's replica joins the other's waves); a server
that goes away stops the other's engine, which names it, starts again and serves once a new
server has joined; a server whose engine waits for the head's world still stops on SIGTERM."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from shardlm import LLM, SamplingParams
from tests.helpers import SERVE_FLAGS, ServerThread, free_port, wait_healthy

PROMPTS = ["Once upon a time", "The capital of France is", "1 2 3 4", "Hello, my name is"]


def _completions(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": PROMPTS, "max_tokens": 12, "temperature": 0,
                                                     "ignore_eos": True}, timeout=120)


def _texts(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


@pytest.mark.slow
def test_hybrid_servers_step_together_and_start_again_when_one_comes_back(tiny_model_dir):
    path = tiny_model_dir("mixtral")
    one = LLM(path, dtype="float32", kv_cache_memory="64MiB", max_model_len=256)
    try:
        expected = [o.outputs[0].text for o in one.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    finally:
        one.shutdown()
    flags = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-hybrid-lb", "--enable-expert-parallel",
             "--data-parallel-rpc-port", str(free_port())]

    def second_server():
        """Replica 1's server, pinned to the second core (the head's to the first), as on one node."""
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "shardlm.entrypoints.cli", "serve", path, "--port", str(port),
                                 *SERVE_FLAGS, *flags, "--data-parallel-start-rank", "1", "--cpu-threads-bind", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        return proc, f"http://127.0.0.1:{port}"

    second, second_url = second_server()
    head = None
    try:
        # it joins the head as the head starts (in this process: its signals and exit are not tested
        # here); the head serves once both replicas are ready
        head = ServerThread(path, *flags, "--cpu-threads-bind", "0")
        head_url = head.url
        wait_healthy(second, second_url)
        assert _texts(_completions(second_url)) == expected       # the head's replica idle: it joins
        assert _texts(_completions(head_url)) == expected         # and the other way round
        os.killpg(second.pid, signal.SIGKILL)
        second.wait(10)
        time.sleep(1)
        r = _completions(head_url)
        assert r.status_code == 503 and "replica(s) 1 on" in r.json()["error"]["message"], r.text
        second, second_url = second_server()
        wait_healthy(second, second_url)
        deadline = time.monotonic() + 120          # the head's engine starts again once the second has joined
        while (r := _completions(head_url)).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _texts(r) == expected
        assert _texts(_completions(second_url)) == expected
        head.stop()
        head = None
        os.killpg(second.pid, signal.SIGTERM)      # (its engine waits to join the head's world again)
        assert second.wait(30) == 0
    finally:
        if head is not None:
            head.stop()
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGTERM)
            try:
                second.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(second.pid, signal.SIGKILL)
