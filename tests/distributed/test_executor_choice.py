"""Which executor runs the ranks, and the placement rules of the Ray executor (no cluster)."""

import subprocess
import sys

import pytest
import torch

from shardlm.executor.ray_placement import (
    NodeInfo,
    check_placement,
    cuda_devices,
    forwarded_env,
    local_ranks,
    rank_order,
    split_among_replicas,
)
from shardlm.executor.selection import choose_backend

VERSIONS = {"shardlm": "0.1.0", "torch": "2.13.0", "ray": "2.60.0"}


def _node(node_id, ip="10.0.0.1", host="a", versions=VERSIONS, model=True, gpus=()):
    return NodeInfo(node_id, ip, host, 100, dict(versions), model, list(gpus))


@pytest.mark.slow
def test_default_backend_is_mp_on_one_node_and_the_mp_path_never_imports_ray(tiny_model_dir):
    assert choose_backend(1, torch.device("cpu")) == "uni"
    assert choose_backend(4, torch.device("cpu")) == "mp"
    code = ("import sys\nfrom shardlm import LLM\nif __name__ == '__main__':\n"
            f"    llm = LLM({tiny_model_dir('llama-gqa')!r}, dtype='float32', kv_cache_memory='64MiB', "
            "pipeline_parallel_size=2)\n"
            "    assert llm.engine.config.parallel.distributed_executor_backend == 'mp'\n"
            "    llm.generate([[1, 2, 3]], use_tqdm=False)\n    llm.shutdown()\n"
            "    assert 'ray' not in sys.modules, 'the mp path imported ray'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Distributed executor backend: mp (all 2 ranks fit on this node" in run.stderr


def test_ranks_start_on_the_driver_node_then_go_node_by_node():
    infos = [_node("B", "10.0.0.2"), _node("A"), _node("B", "10.0.0.2"), _node("A")]
    assert rank_order(infos, driver_node_id="A") == [1, 3, 0, 2]
    assert rank_order(infos, driver_node_id="B") == [0, 2, 1, 3]


def test_cpu_cores_are_shared_per_machine():
    assert local_ranks(["a", "a", "b", "a"]) == ([0, 1, 0, 2], [3, 3, 1, 3])


def test_replicas_take_bundles_driver_node_first_and_share_each_machines_cores():
    """-dp 2 x 2 ranks on the ray executor: bundles 0-3 on Ray nodes b1, A, A, b2 (A the driver's;
    b1 and b2 on one machine, b). Replica 0 gets A's two bundles, replica 1 b1's and b2's; the
    ranks on machine b count one another across its two Ray nodes."""
    split = split_among_replicas(["b1", "A", "A", "b2"], {"A": "a", "b1": "b", "b2": "b"}, driver_node="A",
                                 replicas=2)
    assert split == [([1, 2], [0, 1], [2, 2]), ([0, 3], [0, 1], [2, 2])]
    # a machine shared by both replicas: its cores split four ways
    assert split_among_replicas(["A"] * 4, {"A": "a"}, "A", 2) == [([0, 1], [0, 1], [4, 4]), ([2, 3], [2, 3], [4, 4])]


def test_each_cuda_rank_sees_its_nodes_gpus_and_picks_its_own():
    infos = [_node("A", gpus=["3"]), _node("A", gpus=["10"]), _node("A", gpus=["2"]), _node("B", gpus=["0"])]
    assert cuda_devices(infos) == [("2,3,10", 1), ("2,3,10", 2), ("2,3,10", 0), ("0", 0)]


def test_placement_errors_name_the_node():
    ok = [_node("A"), _node("A"), _node("B", "10.0.0.2", "b"), _node("B", "10.0.0.2", "b")]
    old = ok[:2] + [_node("B", "10.0.0.2", "b", {**VERSIONS, "torch": "2.5.0"})] + ok[3:]
    with pytest.raises(RuntimeError, match=r"Versions differ on node 10.0.0.2 \(b, Ray node B\): torch 2.5.0 there, "
                                           r"2.13.0 here"):
        check_placement(old, tp=2, pp=2, model_path="/m", driver_versions=VERSIONS, allow_cross_node_tp=False)
    missing = ok[:3] + [_node("B", "10.0.0.2", "b", model=False)]
    with pytest.raises(RuntimeError, match=r"model path /m does not exist on node 10.0.0.2"):
        check_placement(missing, tp=2, pp=2, model_path="/m", driver_versions=VERSIONS, allow_cross_node_tp=False)


def test_forwarded_environment(monkeypatch):
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    monkeypatch.setenv("SHARDLM_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("SHARDLM_HOST_IP", "10.0.0.1")     # per node: never forwarded
    monkeypatch.setenv("HF_TOKEN", "secret")
    monkeypatch.setattr("shardlm.envs.SHARDLM_FORWARD_ENV", "HF_TOKEN, ")
    env = forwarded_env()
    assert {"NCCL_IB_HCA": "mlx5", "GLOO_SOCKET_IFNAME": "eth1", "SHARDLM_LOG_LEVEL": "DEBUG",
            "HF_TOKEN": "secret"}.items() <= env.items()
    assert "SHARDLM_HOST_IP" not in env and "PATH" not in env
