"""The Ray executor on a real two-node Ray cluster (one CPU per node, so each pipeline stage
lands on its own node): outputs equal transformers' and the mp executor's; a TP group across
nodes is refused; a killed actor fails the engine fast, naming rank and node; the server runs
on it; nothing of ours is left in the cluster afterwards."""

import pytest

ray = pytest.importorskip("ray")

from shardlm import LLM  # noqa: E402
from tests.distributed.ray_cluster import assert_nothing_left, ray_cluster  # noqa: E402
from tests.distributed.worker_kill import kill_during_generation  # noqa: E402
from tests.models.test_tiny_models_vs_hf import PARAMS, _prompts  # noqa: E402

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(nodes=2, cpus_per_node=1) as c:
        yield c


def _generate(path, prompts=None, params=PARAMS, **kwargs):
    llm = LLM(path, **ENGINE, **kwargs)
    try:
        outs = llm.generate(prompts or _prompts(), params, use_tqdm=False)
        return outs, llm.engine.engine_core.engine_core.executor
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_pp2_one_stage_per_node_matches_hf_and_mp(cluster, tiny_model_dir, references, hf):
    path = tiny_model_dir("llama-gqa")
    outs, executor = _generate(path, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert type(executor).__name__ == "RayExecutor"
    nodes = [info.node_id for info in executor.infos]
    assert len(set(nodes)) == 2, "each stage on its own node"
    assert nodes[0] == ray.get_runtime_context().get_node_id(), "rank 0 on the driver's node"
    exact = hf.assert_close(references("llama-gqa"), outs, "ray pp=2")
    assert exact >= 4, f"only {exact}/6 sequences equal HF exactly"
    mp_outs, _ = _generate(path, pipeline_parallel_size=2, distributed_executor_backend="mp")
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in mp_outs]
    assert_nothing_left()


@pytest.mark.slow
def test_deepseek_stages_on_two_nodes_match_hf(cluster, tiny_model_dir, references, hf):
    """Latent attention and grouped experts, one pipeline stage per Ray node."""
    outs, _ = _generate(tiny_model_dir("deepseek-v3"), pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert hf.assert_close(references("deepseek-v3"), outs, "deepseek-v3 ray pp=2") >= 4
    assert_nothing_left()


@pytest.mark.slow
def test_tp_across_nodes_is_refused_unless_forced(cluster, tiny_model_dir, references, hf):
    path = tiny_model_dir("llama-gqa")
    with pytest.raises(ValueError, match=r"tensor parallel group of ranks 0-1 would span 2 nodes.*"
                                         r"--allow-cross-node-tp"):
        LLM(path, **ENGINE, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert_nothing_left()
    outs, _ = _generate(path, tensor_parallel_size=2, distributed_executor_backend="ray", allow_cross_node_tp=True)
    assert hf.assert_close(references("llama-gqa"), outs, "ray tp=2 across nodes") >= 4
    assert_nothing_left()


@pytest.mark.slow
def test_prefill_context_parallel_groups_on_two_nodes(cluster, tiny_model_dir, references, hf):
    """-pcp 2: each node computes the tokens of its positions and keeps their KV cache."""
    outs, executor = _generate(tiny_model_dir("llama-gqa"), prefill_context_parallel_size=2,
                               distributed_executor_backend="ray")
    assert len({info.node_id for info in executor.infos}) == 2
    assert hf.assert_close(references("llama-gqa"), outs, "ray pcp=2") >= 4
    assert_nothing_left()


@pytest.mark.slow
def test_environment_is_forwarded_to_every_node(cluster, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth-test")
    monkeypatch.setenv("SHARDLM_TEST_MARKER", "forwarded")
    monkeypatch.setenv("MY_SETTING", "listed")
    monkeypatch.setenv("SHARDLM_FORWARD_ENV", "MY_SETTING")
    monkeypatch.setenv("NOT_FORWARDED_VAR", "x")
    monkeypatch.setattr("shardlm.envs.SHARDLM_FORWARD_ENV", "MY_SETTING")
    llm = LLM(tiny_model_dir("llama-gqa"), **ENGINE, pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        seen = ray.get([a.call.remote("environment", (["NCCL_SOCKET_IFNAME", "SHARDLM_TEST_MARKER", "MY_SETTING",
                                                      "NOT_FORWARDED_VAR", "GLOO_SOCKET_IFNAME"],))
                        for a in llm.engine.engine_core.engine_core.executor.actors])
    finally:
        llm.shutdown()
    for env in seen:
        assert env["NCCL_SOCKET_IFNAME"] == "eth-test" and env["SHARDLM_TEST_MARKER"] == "forwarded"
        assert env["MY_SETTING"] == "listed" and env["NOT_FORWARDED_VAR"] is None
        assert env["GLOO_SOCKET_IFNAME"], "gloo bound to the interface of the node's address"


@pytest.mark.slow
def test_killed_actor_fails_the_engine_fast_naming_rank_and_node(cluster, tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-gqa"), **ENGINE, pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:          # shut down whatever happens: actors left behind would hold the cluster's CPUs from later tests
        victim = llm.engine.engine_core.engine_core.executor.infos[1]
        error = kill_during_generation(llm, victim.pid, r"Worker rank 1 on node .*Ray node .* died")
        assert victim.node_id[:8] in error and victim.ip in error
    finally:
        llm.shutdown()
    assert_nothing_left()


@pytest.mark.slow
def test_stopped_actor_fails_the_engine_within_the_step_timeout(cluster, tiny_model_dir):
    import contextlib
    import os
    import signal
    llm = LLM(tiny_model_dir("llama-gqa"), **ENGINE, pipeline_parallel_size=2, distributed_executor_backend="ray",
              execute_model_timeout=3)
    victim = llm.engine.engine_core.engine_core.executor.infos[1]
    try:
        error = kill_during_generation(llm, victim.pid, r"did not finish within 3 s \(--execute-model-timeout\)",
                                       sig=signal.SIGSTOP)
        # rank 1 is named (rank 0 may be too: stage 0 can wait on its send to the stopped stage)
        assert "Worker rank 1 on" in error and victim.ip in error, error
    finally:
        llm.shutdown()
        with contextlib.suppress(ProcessLookupError):     # a stopped process must not linger for Ray to reuse
            os.kill(victim.pid, signal.SIGKILL)
    assert_nothing_left()


@pytest.mark.slow
def test_server_on_two_ray_nodes_and_its_end_when_an_idle_actor_dies(cluster, tiny_model_dir):
    import psutil

    from tests.distributed.test_parallel_server import assert_server_answers_like_llm
    from tests.helpers import start_server, stop_server, wait_gone
    path = tiny_model_dir("llama-gqa")
    proc, url = start_server(path, "--distributed-executor-backend", "ray", "-pp", "2", "--max-engine-restarts", "0",
                             env={"RAY_ADDRESS": cluster.address})
    try:
        assert_server_answers_like_llm(url, path)
        assert ray.available_resources().get("CPU", 0) == 0, "both nodes' CPUs held by the server's ranks"
        children = psutil.Process(proc.pid).children(recursive=True)
        actors = [p for p in psutil.process_iter(["cmdline"])
                  if " ".join(p.info["cmdline"] or []).startswith("ray::RayWorker")]
        assert len(actors) == 2
        actors[0].kill()                     # while idle: noticed without any request
        assert proc.wait(timeout=15) != 0
        err = proc.stderr.read()
        assert "Worker rank" in err and "on node" in err and "died" in err, err[-2000:]
        alive = wait_gone(children, 10)
        assert not alive, f"processes left: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            stop_server(proc)
    assert_nothing_left()


@pytest.mark.slow
def test_data_parallel_replicas_on_two_ray_nodes(cluster, tiny_model_dir):
    """--data-parallel-backend ray: one replica per node (each node has one CPU), joined to this
    client over TCP; outputs equal dp=1's and both replicas serve; nothing is left afterwards."""
    path = tiny_model_dir("llama-gqa")
    ref, _ = _generate(path)
    llm = LLM(path, **ENGINE, data_parallel_size=2, data_parallel_backend="ray")
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        client = llm.engine.engine_core
        routed = [e["num_routed"] for e in client.call_utility("stats")["engines"]]
        assert type(client.cores[0]).__name__ == "RemoteCore" and routed == [3, 3]
        assert ray.available_resources().get("CPU", 0) == 0, "each replica holds its node's CPU"
        layout = llm.engine.collective_rpc("parallel_layout")
        assert [r["dp"] for r in layout] == [[0, 1], [0, 1]]
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert_nothing_left()


def test_default_backend_is_ray_inside_a_placement_group(cluster):
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=1)
    def chosen():
        import torch

        from shardlm.executor.selection import choose_backend
        return choose_backend(2, torch.device("cpu"))

    pg = placement_group([{"CPU": 1}])
    ray.get(pg.ready())
    try:
        assert ray.get(chosen.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg)).remote()) == "ray"
    finally:
        remove_placement_group(pg)
    assert_nothing_left()


@pytest.mark.slow
def test_a_killed_ray_replica_is_made_anew_and_serves_again(cluster, tiny_model_dir):
    """--data-parallel-backend ray, -dp 2 on the two nodes: one replica's actor is killed; the
    head makes a new actor in its bundle, which joins again, and /health goes degraded -> ok."""
    import time

    import httpx
    import psutil

    from tests.helpers import labelled_metric, start_server, stop_server
    proc, url = start_server(tiny_model_dir("llama-gqa"), "--data-parallel-backend", "ray", "-dp", "2",
                             env={"RAY_ADDRESS": cluster.address})
    try:
        actors = [p for p in psutil.process_iter(["cmdline"])
                  if " ".join(p.info["cmdline"] or []).startswith("ray::EngineCoreActor")]
        assert len(actors) == 2
        actors[0].kill()
        seen = []
        deadline = time.monotonic() + 90
        while not (seen and seen[-1] == "ok" and "degraded" in seen):
            assert time.monotonic() < deadline, f"/health said {seen[-5:]}"
            try:
                seen.append(httpx.get(url + "/health", timeout=2).json()["status"])
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        for i in range(4):
            r = httpx.post(url + "/v1/completions", json={"prompt": f"Story {i}", "max_tokens": 4}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        text = httpx.get(url + "/metrics").text
        assert sum(labelled_metric(text, "shardlm:engine_restarts", r) for r in ("0", "1")) == 1
        assert all(labelled_metric(text, "shardlm:num_requests_routed", r) >= 1 for r in ("0", "1"))
    finally:
        stop_server(proc)
    assert_nothing_left()
