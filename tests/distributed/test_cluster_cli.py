"""`shardlm cluster head/worker/status/stop` and `shardlm env check --address` on a two-node Ray
cluster started by those commands on this machine (real `ray start` processes)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.distributed.ray_cluster import own_ray_auth_token

ray = pytest.importorskip("ray")


def _cli(*args, check=True, timeout=120):
    run = subprocess.run([sys.executable, "-m", "shardlm.entrypoints.cli", *args], capture_output=True, text=True,
                         timeout=timeout)
    if check:
        assert run.returncode == 0, f"shardlm {' '.join(args)}:\n{run.stdout}\n{run.stderr[-3000:]}"
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    if ray.is_initialized():
        ray.shutdown()
    model = tiny_model_dir("llama-gqa")
    port = free_port()
    with own_ray_auth_token(tmp_path_factory.mktemp("ray-auth")) as token_file:
        yield from _start_cluster(model, port, token_file)


def _start_cluster(model, port, token_file):
    try:
        head = _cli("cluster", "head", "--port", str(port), "--num-cpus", "1", "--model", model)
        address = head.stdout.split("Ray head started at ")[1].split()[0]
        assert f"shardlm cluster worker --address {address}" in head.stdout
        assert f"token authentication is on: copy {token_file}" in head.stdout
        assert token_file.stat().st_mode & 0o777 == 0o600 and len(token_file.read_text()) == 64
        worker = _cli("cluster", "worker", "--address", address, "--num-cpus", "1")
        assert "versions match the head" in worker.stdout
        yield address, model
    finally:
        _cli("cluster", "stop", check=False)


_CONNECT = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='error'); "
            "print(len(ray.nodes())); ray.shutdown()")


@pytest.mark.slow
def test_cluster_refuses_a_client_without_its_token(cluster):
    address, _ = cluster
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    # each refused try is retried a second later, 20 times by default: 2 say the same
    wrong = subprocess.run([sys.executable, "-c", _CONNECT, address], capture_output=True, text=True, timeout=120,
                           env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64,
                                "RAY_NUM_REDIS_GET_RETRIES": "2"})
    assert wrong.returncode != 0 and "auth" in wrong.stderr.lower()
    token_path = os.environ["RAY_AUTH_TOKEN_PATH"]
    right = subprocess.run([sys.executable, "-c", _CONNECT, address], capture_output=True, text=True, timeout=120,
                           env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path})
    assert right.returncode == 0 and right.stdout.split()[-1] == "2", right.stderr[-2000:]


@pytest.mark.slow
def test_cluster_status_lists_both_nodes(cluster):
    address, _ = cluster
    report = json.loads(_cli("cluster", "status", "--address", address, "--json").stdout)
    nodes = report[1:]
    assert len(nodes) == 2 and [n["head"] for n in nodes] == [True, False]
    assert all(n["cpus"] == 1 and n["ip"] == address.split(":")[0] and n["memory"] > 0 for n in nodes)
    assert report[0]["head_record"]["versions"]["torch"]
    text = _cli("cluster", "status", "--address", address).stdout
    assert text.startswith("2 node(s) alive") and "head " in text and "worker " in text


@pytest.mark.slow
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


@pytest.mark.slow
def test_joining_node_that_differs_from_the_head_is_named(cluster):
    """The head's record says another torch and a model path this node lacks: the join fails,
    naming this node and both differences. (Last in the module: the node has joined meanwhile.)"""
    address, model = cluster
    tamper = ("import json, sys\n"
              "from shardlm.cluster import _RECORD_KEY, _connect\n"
              "ray = _connect(sys.argv[1])\n"
              "record = json.loads(ray.experimental.internal_kv._internal_kv_get(_RECORD_KEY))\n"
              "record['versions']['torch'] = '0.0.1'\n"
              "record['model'] = sys.argv[2]\n"
              "kv = ray.experimental.internal_kv\n"
              "kv._internal_kv_put(_RECORD_KEY, json.dumps(record).encode(), overwrite=True)\n"
              "ray.shutdown()\n")
    run = subprocess.run([sys.executable, "-c", tamper, address, model + "-elsewhere"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    run = _cli("cluster", "worker", "--address", address, "--num-cpus", "1", check=False)
    assert run.returncode != 0
    assert f"node {address.split(':')[0]} ({socket.gethostname()}) cannot serve with this cluster" in run.stderr
    assert "torch" in run.stderr and "0.0.1 on the head" in run.stderr
    assert f"model path {model}-elsewhere does not exist here" in run.stderr


def test_what_a_joining_node_differs_in_is_said_and_the_status_reads_plainly(tmp_path):
    """Without a cluster: a node whose versions or model path differ from the head's record gets
    each difference named, with what to do; the status table names each node's role and size."""
    from shardlm.cluster import join_problems, render_status
    record = {"node": "10.0.0.1", "versions": {"torch": "2.13.0", "shardlm": "0.1.0"}, "model": str(tmp_path)}
    assert join_problems(record, {"torch": "2.13.0", "shardlm": "0.1.0"}, None) == []
    problems = join_problems(record, {"torch": "2.5.0", "shardlm": "0.1.0"}, str(tmp_path / "elsewhere"))
    assert problems[0] == "torch 2.5.0 here, 2.13.0 on the head (10.0.0.1): install the same versions on every node"
    assert "elsewhere does not exist here: every node needs the model at the same path" in problems[1]
    node = {"ip": "10.0.0.2", "hostname": "n2", "node_id": "abcdef0123", "head": False, "cpus": 8.0, "gpus": 1.0,
            "gpu_type": "H100", "memory": 16 << 30, "object_store": 0}
    text = render_status([{"head_record": record}, node])
    assert text.splitlines()[0] == "1 node(s) alive; head runs torch 2.13.0, shardlm 0.1.0"
    assert "worker 10.0.0.2" in text and "8 CPU, 1 GPU (H100), memory 16.0 GiB, Ray node abcdef01" in text
