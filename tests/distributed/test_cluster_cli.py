"""`shardlm cluster head/worker/status/stop` and `shardlm env check --address` on a two-node Ray
cluster started by those commands on this machine (real `ray start` processes)."""

import json
import os
import socket
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")


def _cli(*args, check=True, timeout=120):
    run = subprocess.run([sys.executable, "-m", "shardlm.entrypoints.cli", *args], capture_output=True, text=True,
                         timeout=timeout)
    if check:
        assert run.returncode == 0, f"shardlm {' '.join(args)}:\n{run.stdout}\n{run.stderr[-3000:]}"
    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    if ray.is_initialized():
        ray.shutdown()
    model = tiny_model_dir("llama-gqa")
    port = _free_port()
    try:
        head = _cli("cluster", "head", "--port", str(port), "--num-cpus", "1", "--model", model)
        address = head.stdout.split("Ray head started at ")[1].split()[0]
        assert f"shardlm cluster worker --address {address}" in head.stdout
        worker = _cli("cluster", "worker", "--address", address, "--num-cpus", "1")
        assert "versions match the head" in worker.stdout
        yield address, model
    finally:
        _cli("cluster", "stop", check=False)


def test_cluster_status_lists_both_nodes(cluster):
    address, _ = cluster
    report = json.loads(_cli("cluster", "status", "--address", address, "--json").stdout)
    nodes = report[1:]
    assert len(nodes) == 2 and [n["head"] for n in nodes] == [True, False]
    assert all(n["cpus"] == 1 and n["ip"] == address.split(":")[0] and n["memory"] > 0 for n in nodes)
    assert report[0]["head_record"]["versions"]["torch"]
    text = _cli("cluster", "status", "--address", address).stdout
    assert text.startswith("2 node(s) alive") and "head " in text and "worker " in text


def test_env_check_across_the_nodes(cluster):
    address, _ = cluster
    run = _cli("env", "check", "--address", address, "--json")
    report = json.loads(run.stdout)
    assert len(report["nodes"]) == 2 and len({n["ray_node_id"] for n in report["nodes"]}) == 2
    comm = report["communication"]
    assert comm["ranks"] == 2 and comm["backend"] == "gloo" and comm["all_reduce_ok"] and comm["send_recv_ok"]
    assert comm["all_reduce_GBps"] > 0 and comm["send_recv_GBps"] > 0
    assert report["problems"] == []
    text = _cli("env", "check", "--address", address).stdout
    assert text.startswith("2 node(s):") and "Across nodes (2 ranks, one per node, gloo" in text


def test_joining_node_that_differs_from_the_head_is_named(cluster):
    """The head's record says another torch and a model path this node lacks: the join fails,
    naming this node and both differences. (Last in the module: the node has joined meanwhile.)"""
    address, model = cluster
    env_mode = os.environ.get("RAY_AUTH_MODE")
    from shardlm.executor.selection import require_ray
    require_ray()
    ray.init(address=address, logging_level="error")
    try:
        key = b"shardlm/head"
        record = json.loads(ray.experimental.internal_kv._internal_kv_get(key))
        record["versions"]["torch"] = "0.0.1"
        record["model"] = model + "-elsewhere"
        ray.experimental.internal_kv._internal_kv_put(key, json.dumps(record).encode(), overwrite=True)
    finally:
        ray.shutdown()
        if env_mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
    run = _cli("cluster", "worker", "--address", address, "--num-cpus", "1", check=False)
    assert run.returncode != 0
    assert f"node {address.split(':')[0]} ({socket.gethostname()}) cannot serve with this cluster" in run.stderr
    assert "torch" in run.stderr and "0.0.1 on the head" in run.stderr
    assert f"model path {model}-elsewhere does not exist here" in run.stderr
