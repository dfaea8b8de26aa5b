"""A server that starts its dead engine again: real processes killed (SIGKILL) and frozen
(SIGSTOP) under load. What users see: the requests that had begun on the dead engine end with a
retriable 503 naming it; those still queued there are answered, exactly, by the new engine (or by a
live replica); the server serves again within a bound; past --max-engine-restarts it exits non-zero."""

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from shardlm import LLM, SamplingParams
from tests.helpers import engine_core_processes, labelled_metric, metric, start_server, stop_server, wait_gone

SERVED_AGAIN_WITHIN_S = 60     # a bound on kill -> serving again (a tiny model starts in a few seconds)
LONG = {"model": "tiny", "max_tokens": 250, "temperature": 0, "ignore_eos": True}
SHORT = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _reference(path: str, prompts: list[str]) -> list[str]:
    llm = LLM(path, dtype="float32", kv_cache_memory="64MiB", max_model_len=256)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].text for o in outs]
    finally:
        llm.shutdown()


def _workers(proc) -> list[psutil.Process]:
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("shardlm-rank")]
    return sorted(ranks, key=lambda p: p.name())


class Stream(threading.Thread):
    """A long streamed completion; `begun` is set at its first event; `lines` holds every line."""

    def __init__(self, url: str, prompt: str):
        super().__init__(daemon=True)
        self.url, self.prompt, self.lines, self.begun = url, prompt, [], threading.Event()
        self.start()

    def run(self):
        with httpx.stream("POST", self.url + "/v1/completions", json={**LONG, "prompt": self.prompt, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    self.lines.append(line)
                    self.begun.set()

    @property
    def error(self) -> dict | None:
        last = self.lines[-2] if len(self.lines) >= 2 else ""
        return json.loads(last[6:])["error"] if '"error"' in last else None


class Post(threading.Thread):
    """A short completion, not streamed: its response once it came."""

    def __init__(self, url: str, prompt: str):
        super().__init__(daemon=True)
        self.url, self.prompt, self.response = url, prompt, None
        self.start()

    def run(self):
        self.response = httpx.post(self.url + "/v1/completions", json={**SHORT, "prompt": self.prompt}, timeout=120)


def _wait_health(url: str, status: str, timeout: float) -> float:
    """Seconds until /health says `status` (a degraded one must name replica 1)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            health = httpx.get(url + "/health", timeout=2).json()
            if health.get("status") == status:
                if status == "degraded":
                    assert "Data parallel replica 1" in health["dead_replicas"]["1"], health
                return time.monotonic() - t0
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"/health never said {status!r} in {timeout} s")


def _fault_under_load(url: str, fault, queued_prompt: str) -> tuple[Stream, Post, float]:
    """One stream runs (--max-num-seqs 1) and one request waits behind it; `fault()` strikes.
    -> the stream, the queued request, and seconds from the fault to the queued one's answer."""
    stream = Stream(url, "A long story")
    assert stream.begun.wait(60)
    queued = Post(url, queued_prompt)
    deadline = time.monotonic() + 30
    while metric(url, "shardlm:num_requests_waiting") < 1:      # it is in the engine, behind the stream
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.05)
    t0 = time.monotonic()
    fault()
    queued.join(SERVED_AGAIN_WITHIN_S)
    served_after = time.monotonic() - t0
    stream.join(30)
    return stream, queued, served_after


@pytest.mark.slow
def test_a_killed_and_a_frozen_worker_restart_the_engine_and_queued_requests_survive(tiny_model_dir):
    path = tiny_model_dir("llama-gqa")
    prompts = ["The capital of France is", "One two three four"]
    ref = _reference(path, prompts)
    proc, url = start_server(path, "-tp", "2", "--max-num-seqs", "1", "--max-engine-restarts", "2",
                             "--execute-model-timeout", "3")
    try:
        # 1. kill -9 a tensor parallel worker while a stream runs and a request waits
        first = _workers(proc)
        stream, queued, took = _fault_under_load(url, lambda: os.kill(first[1].pid, signal.SIGKILL), prompts[0])
        assert stream.error is not None and stream.lines[-1] == "data: [DONE]", stream.lines[-2:]
        assert stream.error["code"] == 503 and "Worker rank 1" in stream.error["message"], stream.error
        assert "retry" in stream.error["message"].lower()
        assert queued.response.status_code == 200, queued.response.text
        assert queued.response.json()["choices"][0]["text"] == ref[0]       # re-queued, answered exactly
        assert took < SERVED_AGAIN_WITHIN_S
        print(f"kill -9 of a TP worker -> the queued request answered {took:.1f} s later")
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert metric(url, "shardlm:engine_restarts") == 1
        second = _workers(proc)
        assert len(second) == 2 and not {p.pid for p in second} & {p.pid for p in first}

        # 2. SIGSTOP a worker: the step timeout (3 s) names it, the engine starts again
        stream, queued, took = _fault_under_load(url, lambda: os.kill(second[0].pid, signal.SIGSTOP), prompts[1])
        assert stream.error is not None and stream.error["code"] == 503, stream.lines[-2:]
        assert "did not finish within 3 s (--execute-model-timeout)" in stream.error["message"], stream.error
        assert "rank(s) 0" in stream.error["message"], stream.error          # second[0]: shardlm-rank0
        assert queued.response.status_code == 200 and queued.response.json()["choices"][0]["text"] == ref[1]
        print(f"SIGSTOP of a TP worker -> the queued request answered {took:.1f} s later")
        assert not psutil.pid_exists(second[0].pid) or psutil.Process(second[0].pid).status() == psutil.STATUS_ZOMBIE
        assert metric(url, "shardlm:engine_restarts") == 2
        r = httpx.post(url + "/v1/completions", json={**SHORT, "prompt": prompts[0]}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref[0]

        # 3. past --max-engine-restarts 2: the server exits non-zero, naming the limit
        children = psutil.Process(proc.pid).children(recursive=True)
        os.kill(_workers(proc)[1].pid, signal.SIGKILL)
        assert proc.wait(timeout=30) != 0
        err = proc.stderr.read()
        assert "--max-engine-restarts" in err and "Worker rank 1" in err, err[-2000:]
        alive = wait_gone(children, 10)
        assert not alive, f"processes left: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            stop_server(proc)


@pytest.mark.slow
def test_a_killed_replica_starts_again_while_the_other_serves(tiny_model_dir):
    """-dp 2, one request running and one waiting on each replica; replica 1's engine core is
    killed: its running stream fails (503), its waiting request is answered by replica 0, /health
    says degraded, then ok once replica 1 is back, and replica 1 serves again."""
    path = tiny_model_dir("llama-gqa")
    proc, url = start_server(path, "-dp", "2", "--max-num-seqs", "1")
    children = psutil.Process(proc.pid).children(recursive=True)
    try:
        core1 = engine_core_processes(proc)[1]
        streams = [Stream(url, f"Story {i}") for i in range(4)]     # two run, one waits on each replica
        deadline = time.monotonic() + 60
        while sum(s.begun.is_set() for s in streams) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
        core1.kill()
        _wait_health(url, "degraded", 10)            # noticed at once; back within seconds
        back = _wait_health(url, "ok", SERVED_AGAIN_WITHIN_S)
        print(f"kill -9 of replica 1's engine core -> /health ok again {time.monotonic() - t0:.1f} s later")
        assert back < SERVED_AGAIN_WITHIN_S
        for s in streams:
            s.join(120)
        errors = [s.error for s in streams if s.error is not None]
        assert len(errors) == 1, [s.lines[-2:] for s in streams]     # the running one; the waiting one moved
        assert errors[0]["code"] == 503 and "Data parallel replica 1" in errors[0]["message"]
        finished = [s for s in streams if s.error is None]
        assert all(json.loads(s.lines[-2][6:])["choices"][0]["finish_reason"] == "length" for s in finished)
        routed_before = labelled_metric(httpx.get(url + "/metrics").text, "shardlm:num_requests_routed", "1")
        for _ in range(4):
            r = httpx.post(url + "/v1/completions", json={**SHORT, "prompt": "Hi"}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        text = httpx.get(url + "/metrics").text
        assert labelled_metric(text, "shardlm:num_requests_routed", "1") > routed_before, "replica 1 serves again"
        assert labelled_metric(text, "shardlm:engine_restarts", "1") == 1
        assert core1.pid not in {p.pid for p in engine_core_processes(proc)}
    finally:
        stop_server(proc)
    alive = wait_gone(children, 10)
    assert not alive, f"processes left: {[p.pid for p in alive]}"


@pytest.mark.slow
def test_a_failing_step_fails_its_request_alone_and_the_engine_starts_again(tiny_model_dir, tmp_path):
    """A step holding token 31337 raises (tests/server/test_openai_server.py's injected fault). The
    request in that step fails with 503 naming the fault and is not sent again (it would fail the
    next engine too); the request queued behind it is answered, exactly, by the new engine."""
    from tests.server.test_openai_server import _FAULTY_STEP
    (tmp_path / "sitecustomize.py").write_text(_FAULTY_STEP)
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    path = tiny_model_dir("llama-gqa")
    ref = _reference(path, ["One two three four"])
    proc, url = start_server(path, "--max-num-seqs", "1", env={"PYTHONPATH": pythonpath})
    try:
        holder = Stream(url, "A long story")         # holds the one running slot
        assert holder.begun.wait(60)
        bad = threading.Thread(target=lambda: results.update(
            bad=httpx.post(url + "/v1/completions", json={**SHORT, "prompt": [5, 31337, 7]}, timeout=120)))
        results: dict = {}
        bad.start()
        while metric(url, "shardlm:num_requests_waiting") < 1:
            time.sleep(0.02)
        good = Post(url, "One two three four")
        while metric(url, "shardlm:num_requests_waiting") < 2:
            time.sleep(0.02)
        bad.join(SERVED_AGAIN_WITHIN_S)
        good.join(SERVED_AGAIN_WITHIN_S)
        holder.join(60)
        assert holder.error is None            # it finished before the bad step ran
        r = results["bad"]
        assert r.status_code == 503 and "injected fault" in r.json()["error"]["message"], r.text
        assert r.headers["retry-after"] == "5"
        assert good.response.status_code == 200 and good.response.json()["choices"][0]["text"] == ref[0]
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert metric(url, "shardlm:engine_restarts") == 1
    finally:
        stop_server(proc)
    assert "A step failed (RuntimeError: injected fault)" in proc.stderr.read()


# Loaded by every Python process of the server below (sitecustomize): sampling a row that biases
# token 31337 raises, as a request's own broken sampling parameters would.
_FAULTY_SAMPLING = """
import shardlm.layers.sampler as sampler
_apply_biases = sampler.apply_biases
def _faulty(logits, biases):
    if any(bias and 31337 in bias for _, bias, _ in biases):
        raise RuntimeError("injected sampling fault")
    return _apply_biases(logits, biases)
sampler.apply_biases = _faulty
"""


@pytest.mark.slow
def test_a_fault_in_one_requests_sampling_fails_that_request_alone(tiny_model_dir, tmp_path):
    """The batched sampler raises for a step holding a stream and a request whose logit_bias is
    poisoned: each request is sampled alone, the poisoned one ends with a 500 naming the fault, the
    stream goes on to the end with exactly the tokens it has alone, and the engine never restarts."""
    (tmp_path / "sitecustomize.py").write_text(_FAULTY_SAMPLING)
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    proc, url = start_server(tiny_model_dir("llama-gqa"), env={"PYTHONPATH": pythonpath})
    try:
        stream = Stream(url, "A long story")
        assert stream.begun.wait(60)
        bad = httpx.post(url + "/v1/completions", json={**SHORT, "prompt": "One two", "logit_bias": {"31337": 1}},
                         timeout=60)
        assert metric(url, "shardlm:num_requests_running") == 1      # the stream was still running beside it
        stream.join(60)
        assert bad.status_code == 500, bad.text
        assert ("The request failed: sampling failed (RuntimeError: injected sampling fault)"
                in bad.json()["error"]["message"]), bad.text
        assert stream.error is None and stream.lines[-1] == "data: [DONE]"
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in stream.lines[:-1])
        alone = httpx.post(url + "/v1/completions", json={**LONG, "prompt": "A long story"}, timeout=60).json()
        assert streamed == alone["choices"][0]["text"]
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert metric(url, "shardlm:engine_restarts") == 0
    finally:
        stop_server(proc)
    assert "Sampling a step of 2 request(s) failed; sampling each alone" in proc.stderr.read()


@pytest.mark.slow
def test_a_headless_nodes_replica_starts_again_and_joins_the_head(tiny_model_dir, tmp_path):
    """Two "nodes" on this machine: the head (API server, replica 0) and a headless node
    (replica 1). Replica 1's engine core is killed: its node starts it again, it joins the head
    again, /health goes degraded -> ok, and it serves; stopping the head ends the node with 0."""
    import subprocess
    import sys

    from tests.helpers import free_port
    path = tiny_model_dir("llama-gqa")
    common = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", str(free_port())]
    node_log = tmp_path / "node.log"
    with open(node_log, "w") as log:
        node = subprocess.Popen([sys.executable, "-m", "shardlm.entrypoints.cli", "serve", path, "--dtype", "float32",
                                 "--kv-cache-memory", "64MiB", "--max-model-len", "256", *common,
                                 "--data-parallel-start-rank", "1", "--headless"],
                                stdout=subprocess.DEVNULL, stderr=log)
    try:
        proc, url = start_server(path, *common)
        try:
            core1 = engine_core_processes(node)
            assert len(core1) == 1
            t0 = time.monotonic()
            core1[0].kill()
            _wait_health(url, "degraded", 10)
            back = _wait_health(url, "ok", SERVED_AGAIN_WITHIN_S)
            print(f"kill -9 of a headless node's engine core -> /health ok again {time.monotonic() - t0:.1f} s later")
            routed_before = labelled_metric(httpx.get(url + "/metrics").text, "shardlm:num_requests_routed", "1")
            answers = [Post(url, f"Story {i}") for i in range(4)]
            for post in answers:
                post.join(60)
                assert post.response.status_code == 200 and post.response.json()["usage"]["completion_tokens"] == 8
            text = httpx.get(url + "/metrics").text
            assert labelled_metric(text, "shardlm:num_requests_routed", "1") > routed_before, "replica 1 serves"
            assert labelled_metric(text, "shardlm:engine_restarts", "1") == 1
            assert back < SERVED_AGAIN_WITHIN_S
            node_children = psutil.Process(node.pid).children(recursive=True)
        finally:
            stop_server(proc)
        assert node.wait(timeout=30) == 0, node_log.read_text()[-3000:]
    finally:
        if node.poll() is None:
            node.kill()
    assert "Data parallel replica 1 was killed by SIGKILL. Starting it again in 0 s" in node_log.read_text()
    alive = wait_gone(node_children, 10)
    assert not alive, f"processes left on the headless node: {[p.pid for p in alive]}"


def _health_until_ok_after(url: str, status: str, timeout: float) -> list[str]:
    """/health's statuses until it says ok after having said `status`."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while not (status in seen and seen[-1] == "ok"):
        assert time.monotonic() < deadline, f"/health said {seen[-5:]}"
        try:
            seen.append(httpx.get(url + "/health", timeout=2).json()["status"])
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("where,killed", [("local", ["replica 1"]), ("headless", ["the node's", "the head's"])],
                         ids=["local", "headless"])
def test_expert_parallel_replicas_start_again_together(where, killed, tiny_model_dir, tmp_path):
    """-dp 2 --enable-expert-parallel: the replicas run their MoE layers together, so when one
    dies the whole engine starts again, here or across a headless node (whose live replica the
    head shuts down for it to start again), and serves exactly again: after each of the kills,
    one after the other."""
    import subprocess
    import sys

    from tests.helpers import free_port
    path = tiny_model_dir("mixtral")
    ep = ["-dp", "2", "--enable-expert-parallel"]
    node, node_log = None, tmp_path / "node.log"
    if where == "headless":
        ep += ["--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
               "--data-parallel-rpc-port", str(free_port())]
        with open(node_log, "w") as log:
            node = subprocess.Popen([sys.executable, "-m", "shardlm.entrypoints.cli", "serve", path, "--dtype",
                                     "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "256", *ep,
                                     "--data-parallel-start-rank", "1", "--headless"],
                                    stdout=subprocess.DEVNULL, stderr=log)
    try:
        proc, url = start_server(path, *ep)
        try:
            before = httpx.post(url + "/v1/completions", json={**SHORT, "prompt": "One two"}, timeout=60).json()
            for restarts, victim_name in enumerate(killed, 1):
                victim = engine_core_processes(node if victim_name == "the node's" else proc)[-1]
                t0 = time.monotonic()
                victim.kill()
                _health_until_ok_after(url, "restarting", SERVED_AGAIN_WITHIN_S)
                print(f"kill -9 of an expert parallel replica ({where}, {victim_name}) -> /health ok again "
                      f"{time.monotonic() - t0:.1f} s later")
                after = httpx.post(url + "/v1/completions", json={**SHORT, "prompt": "One two"}, timeout=60).json()
                assert after["choices"][0]["text"] == before["choices"][0]["text"], victim_name
                assert labelled_metric(httpx.get(url + "/metrics").text, "shardlm:engine_restarts", "all") == restarts
        finally:
            stop_server(proc)
        if node is not None:
            assert node.wait(timeout=30) == 0, node_log.read_text()[-3000:]
            assert "the head starts the engine again; so does this node" in node_log.read_text()
    finally:
        if node is not None and node.poll() is None:
            node.kill()
