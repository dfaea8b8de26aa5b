"""Data parallel on one node: -dp 2 alone and with TP or PP inside each replica, offline and
behind the server. Every request's output equals the dp=1 engine's (and transformers'),
whichever replica served it; both replicas serve; the replicas' ranks form one DP x PP x TP
grid; a replica that dies fails only its own requests."""

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from shardlm import LLM, SamplingParams
from shardlm.engine.core_client import EngineDeadError
from tests.distributed.test_parallel_server import assert_server_answers_like_llm
from tests.helpers import engine_core_processes, free_port, labelled_metric, start_server, stop_server, wait_gone
from tests.models.test_tiny_models_vs_hf import PARAMS, _prompts
from tests.server.test_openai_server import assert_concurrent_streams_equal_offline

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)


@pytest.fixture(scope="module")
def dp1_outputs(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-gqa"), **ENGINE)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


def _routed(llm) -> list[int]:
    """Requests the client sent to each replica (the engine's public stats, as /metrics reports them)."""
    return [e["num_routed"] for e in llm.stats()["engines"]]


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_dp2_equals_dp1_and_hf(tp, pp, tiny_model_dir, references, hf, dp1_outputs):
    llm = LLM(tiny_model_dir("llama-gqa"), **ENGINE, data_parallel_size=2, tensor_parallel_size=tp,
              pipeline_parallel_size=pp)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        routed = _routed(llm)
        layout = llm.engine.collective_rpc("parallel_layout")
        sums = llm.engine.collective_rpc("dp_all_reduce", (1.0,))
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == dp1_outputs
    assert hf.assert_close(references("llama-gqa"), outs, f"dp=2 tp={tp} pp={pp}") >= 4
    assert routed == [3, 3], "both replicas served (6 prompts, least load, ties round-robin)"
    world = 2 * tp * pp
    assert [r["world_rank"] for r in layout] == list(range(world)), "replica-major world ranks"
    for r in layout:      # the DP group: the same (pp, tp) position in both replicas
        assert r["dp"] == [r["world_rank"] % (tp * pp), r["world_rank"] % (tp * pp) + tp * pp]
    assert sums == [2.0] * world, "an all-reduce over the DP group reaches both replicas"


@pytest.mark.slow
def test_n_samples_and_aborts_across_replicas(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-gqa"), **ENGINE, data_parallel_size=2)
    try:
        params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=8, ignore_eos=True)
        (out,) = llm.generate(["Hello there"], params, use_tqdm=False)
        assert len(out.outputs) == 4 and all(len(c.token_ids) == 8 for c in out.outputs)
        assert min(_routed(llm)) >= 1, "the samples spread over both"
        engine = llm.engine
        engine.add_request("long", "A long story", SamplingParams(max_tokens=400, ignore_eos=True))
        engine.step()
        engine.abort_request("long")
        assert not engine.has_unfinished_requests()
        assert engine.engine_core.balancer.in_flight == [0, 0]
        stats = engine.stats()
        assert stats["num_aborted"] == 1 and [e["engine"] for e in stats["engines"]] == [0, 1]
    finally:
        llm.shutdown()


def test_dp_options_this_version_does_not_run_are_clear_errors(tiny_model_dir):
    path = tiny_model_dir("llama-gqa")
    with pytest.raises(ValueError, match="give --data-parallel-address .* and --data-parallel-rpc-port"):
        LLM(path, **ENGINE, data_parallel_size=2, data_parallel_size_local=1)
    with pytest.raises(ValueError, match="data_parallel_backend='spark': use 'mp' or 'ray'"):
        LLM(path, **ENGINE, data_parallel_size=2, data_parallel_backend="spark")
    with pytest.raises(ValueError, match="Ray places the ranks of every replica from the one server"):
        LLM(path, **ENGINE, data_parallel_size=2, data_parallel_size_local=1, data_parallel_address="127.0.0.1",
            data_parallel_rpc_port=free_port(), distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="data_parallel_start_rank=2 must be within the 2 replicas"):
        LLM(path, **ENGINE, data_parallel_size=2, data_parallel_start_rank=2)


@pytest.mark.slow
def test_offline_replica_death_fails_the_call_naming_it(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-gqa"), **ENGINE, data_parallel_size=2)
    try:
        cores = llm.engine.engine_core.cores
        long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
        balancer = llm.engine.engine_core.balancer

        def kill_replica_1_while_it_serves():
            # a timer raced the replica: on a fast CPU it finished its share before the kill
            deadline = time.monotonic() + 60
            while balancer.in_flight[1] == 0 and time.monotonic() < deadline:
                time.sleep(0.002)
            os.kill(cores[1].process.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_replica_1_while_it_serves, daemon=True)
        killer.start()
        with pytest.raises(EngineDeadError, match=r"Data parallel replica 1 \(world rank 1\) process .* died"):
            llm.generate(["one", "two", "three", "four"], long, use_tqdm=False)
        killer.join()
        # the other replica serves on
        (out,) = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                              use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir):
    path = tiny_model_dir("llama-gqa")
    proc, url = start_server(path, "-dp", "2", "--max-replica-restarts", "0")     # restarts: test_self_healing.py
    children = psutil.Process(proc.pid).children(recursive=True)
    try:
        yield proc, url, path
    finally:
        stop_server(proc)
        alive = wait_gone(children, 10)
        assert not alive, f"processes left: {[p.pid for p in alive]}"


@pytest.mark.slow
def test_dp2_server_answers_like_the_offline_engine(dp_server):
    _, url, path = dp_server
    assert_server_answers_like_llm(url, path)
    assert_concurrent_streams_equal_offline(url, path)
    text = httpx.get(url + "/metrics").text
    routed = {e: labelled_metric(text, "shardlm:num_requests_routed", e) for e in ("0", "1", "all")}
    assert routed["0"] > 20 and routed["1"] > 20 and routed["0"] + routed["1"] == routed["all"], routed
    assert httpx.get(url + "/health").json() == {"status": "ok"}


@pytest.mark.slow
def test_a_dead_replica_fails_its_streams_and_the_other_serves_on(dp_server):
    """Last in the module: replica 1's engine core is killed while four streams run (two on each
    replica). Its two streams end with an error event naming it; the other two finish; /health
    says degraded; new requests are served by replica 0."""
    proc, url, _ = dp_server
    cores = engine_core_processes(proc)
    assert len(cores) == 2
    results, started = [None] * 4, threading.Barrier(5, timeout=30)

    def stream(i):
        body = {"model": "tiny", "prompt": f"Story {i}", "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True}
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 1:
                        started.wait()
        results[i] = lines

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait()
    cores[1].kill()
    for t in threads:
        t.join(60)
    errors = [json.loads(lines[-2][6:])["error"] for lines in results if '"error"' in lines[-2]]
    assert len(errors) == 2, [lines[-2:] for lines in results]
    assert all("Data parallel replica 1" in e["message"] and e["code"] == 503 for e in errors), errors
    assert all(lines[-1] == "data: [DONE]" for lines in results)
    finished = [lines for lines in results if '"error"' not in lines[-2]]
    assert all(json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length" for lines in finished)
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert "Data parallel replica 1" in health.json()["dead_replicas"]["1"]
    for _ in range(3):
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert proc.poll() is None


@pytest.mark.slow
def test_headless_node_joins_the_head_and_both_serve(tiny_model_dir, second_host):
    """Two nodes: the head (this host, told its address with SHARDLM_HOST_IP) runs the API server
    and replica 0; a headless `shardlm serve` on the second host (its own network namespace where
    the machine allows) runs replica 1 and joins it over TCP. Outputs equal the offline engine's
    and both replicas serve; stopping the head ends the headless node too."""
    import subprocess
    import sys

    path = tiny_model_dir("llama-gqa")
    rpc = free_port()
    common = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", second_host.head_ip,
              "--data-parallel-rpc-port", str(rpc)]
    node = subprocess.Popen(second_host.command(
        sys.executable, "-m", "shardlm.entrypoints.cli", "serve", path, "--dtype", "float32", "--kv-cache-memory",
        "64MiB", "--max-model-len", "256", *common, "--data-parallel-start-rank", "1", "--headless"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    node_children = []
    try:
        proc, url = start_server(path, *common, env={"SHARDLM_HOST_IP": second_host.head_ip})
        node_children = psutil.Process(node.pid).children(recursive=True)
        try:
            assert_server_answers_like_llm(url, path)
            assert_concurrent_streams_equal_offline(url, path, n=16)
            text = httpx.get(url + "/metrics").text
            assert labelled_metric(text, "shardlm:num_requests_routed", "1") >= 4
            assert labelled_metric(text, "shardlm:num_requests_routed", "0") >= 4
        finally:
            stop_server(proc)
        assert node.wait(timeout=30) == 0, node.stderr.read()[-3000:]
        assert f"Data parallel replica 1 joined from node {second_host.ip}" in proc.stderr.read()
    finally:
        if node.poll() is None:
            node.kill()
    alive = wait_gone(node_children, 10)
    assert not alive, f"processes left on the headless node: {[p.pid for p in alive]}"


@pytest.mark.slow
def test_a_head_without_its_remote_replicas_names_them(tiny_model_dir):
    env_before = dict(os.environ)
    with pytest.raises(TimeoutError, match=r"replica\(s\) 1 did not join within 3 s"):
        LLM(tiny_model_dir("llama-gqa"), **ENGINE, data_parallel_size=2, data_parallel_size_local=1,
            data_parallel_address="127.0.0.1", data_parallel_rpc_port=free_port(), distributed_init_timeout=3)
    assert dict(os.environ) == env_before, "the engine cores bind their collectives, not the caller's process"
