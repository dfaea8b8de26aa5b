"""Hybrid and external load balancing (--data-parallel-hybrid-lb, --data-parallel-rank) with expert
parallel replicas: each server runs its own replicas and balances its own requests, while their
MoE layers step together across the servers (engine/dp_front_ends.py). Outputs equal one rank's
whichever server is busy (an idle server's replica joins the other's waves); a server that goes
away ends the others' engines, naming it; a server that comes back makes them serve again."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from shardlm import LLM, SamplingParams
from shardlm.engine.core_client import EngineDeadError
from tests.helpers import SERVE_FLAGS, free_port, start_server, stop_server

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=256)
PROMPTS = ["Once upon a time", "The capital of France is", "1 2 3 4", "Hello, my name is"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _servers_engines(path: str, port: int) -> list[LLM]:
    """The engines of two servers, one replica each (vLLM's external load balancing), started
    together: their ranks meet in one world. Each pinned to its own core, as on one node."""
    llms, errors = [None, None], []

    def start(rank):
        try:
            llms[rank] = LLM(path, **ENGINE, data_parallel_size=2, data_parallel_rank=rank,
                             enable_expert_parallel=True, data_parallel_rpc_port=port, cpu_threads_bind=str(rank),
                             distributed_init_timeout=60)
        except BaseException as e:       # noqa: BLE001 - raised below
            errors.append(e)
    threads = [threading.Thread(target=start, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for llm in llms:
            if llm is not None:
                llm.shutdown()
        raise errors[0]
    return llms


@pytest.mark.slow
def test_two_servers_replicas_step_together_and_equal_one_rank(tiny_model_dir):
    path = tiny_model_dir("mixtral")
    one = LLM(path, **ENGINE)
    try:
        expected = _token_ids(one.generate(PROMPTS, PARAMS, use_tqdm=False))
    finally:
        one.shutdown()
    head, other = _servers_engines(path, free_port())
    try:
        # the other server has no requests: its replica joins the head's waves, relayed
        assert _token_ids(head.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected
        assert _token_ids(other.generate(PROMPTS[::-1], PARAMS, use_tqdm=False)) == expected[::-1]
        both = [None, None]

        def run(k, llm, prompts):
            both[k] = _token_ids(llm.generate(prompts, PARAMS, use_tqdm=False))
        threads = [threading.Thread(target=run, args=(0, head, PROMPTS[:2])),
                   threading.Thread(target=run, args=(1, other, PROMPTS[2:]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert both == [expected[:2], expected[2:]]
        other.shutdown()
        deadline = time.monotonic() + 15
        while head.engine.engine_core.dead_reason is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(EngineDeadError, match=r"server of data parallel replica\(s\) 1 on .* went away"):
            head.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    finally:
        other.shutdown()
        head.shutdown()


@pytest.mark.slow
def test_hybrid_servers_start_again_when_one_comes_back(tiny_model_dir):
    """Two `shardlm serve --data-parallel-hybrid-lb` (one replica each): both answer; the second
    killed, the head's engine starts again (meanwhile a request gets 503 naming the lost server)
    and serves once a new second server has joined."""
    path = tiny_model_dir("mixtral")
    rpc = free_port()
    flags = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-hybrid-lb", "--enable-expert-parallel",
             "--data-parallel-rpc-port", str(rpc), "--max-model-len", "256"]

    def second_server():
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "shardlm.entrypoints.cli", "serve", path, "--port", str(port),
                                 *SERVE_FLAGS, *flags, "--data-parallel-start-rank", "1", "--cpu-threads-bind", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        return proc, f"http://127.0.0.1:{port}"

    def answer(url):
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    second, second_url = second_server()
    head = None
    try:
        head, head_url = start_server(path, *flags, "--cpu-threads-bind", "0", stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(second_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        text = answer(head_url)
        assert answer(second_url) == text
        os.killpg(second.pid, signal.SIGKILL)
        second.wait(10)
        time.sleep(1)
        r = httpx.post(head_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and "replica(s) 1 on" in r.json()["error"]["message"], r.text
        second, second_url = second_server()
        deadline = time.monotonic() + 120          # the head's engine starts again once the second has joined
        while time.monotonic() < deadline:
            r = httpx.post(head_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0},
                           timeout=120)
            if r.status_code != 503:
                break
            time.sleep(0.5)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
        assert answer(second_url) == text
    finally:
        if head is not None:
            stop_server(head)
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGTERM)
            try:
                second.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(second.pid, signal.SIGKILL)
