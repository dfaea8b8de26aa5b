"""`shardlm env check`: the single-node preflight reports the node and proves the collectives."""

import json
import os
import subprocess
import sys

import pytest


def _check(*args, env=None):
    return subprocess.run([sys.executable, "-m", "shardlm.entrypoints.cli", "env", "check", *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_env_check_reports_the_node_and_measures_collectives():
    run = _check("--json")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    node, comm = report["node"], report["communication"]
    assert node["host_ip"] and node["versions"]["torch"] and node["cpus"] >= 1 and node["dev_shm_free"] > 0
    assert comm["all_reduce_ok"] and comm["send_recv_ok"] and comm["backend"] == "gloo"
    assert comm["all_reduce_latency_us"] > 0 and comm["all_reduce_GBps"] > 0 and comm["send_recv_GBps"] > 0
    assert report["problems"] == []
    from shardlm import kernels
    assert node["cpu_kernels"]["variant"] in kernels.supported_isas()
    assert node["cpu_kernels"]["kernels"]["fused_ops"] == "ok"
    if "amx" not in kernels.supported_isas():
        assert node["cpu_kernels"]["amx"] == "this CPU has no AMX tiles"


@pytest.mark.slow
def test_env_check_says_which_kernel_variant_runs():
    run = _check(env={"SHARDLM_CPU_ISA": "portable"})
    assert "CPU kernels: portable (best on this CPU: " in run.stdout and "fused_ops ok" in run.stdout, run.stdout
    assert "AMX tiles " in run.stdout, run.stdout
    assert "blocked_matmul not in this variant" in run.stdout


def test_env_check_names_an_unusable_address():
    run = _check(env={"SHARDLM_HOST_IP": "203.0.113.7"})     # not an address of this machine
    assert run.returncode == 1
    assert "Cannot open a rendezvous port on 203.0.113.7" in run.stdout and "SHARDLM_HOST_IP" in run.stdout


def test_a_rendezvous_that_refuses_is_named_and_one_that_listens_is_not():
    """What a Ray rank checks before joining the driver's store: a port that refuses every try is
    named at once (the wrong address); a listening one is not."""
    import socket

    from shardlm.distributed.network import cannot_reach
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert cannot_reach("127.0.0.1", listening.getsockname()[1]) is None
    with socket.socket() as closed:            # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        why = cannot_reach("127.0.0.1", closed.getsockname()[1], pause_s=0.01)
    assert why is not None and why.startswith("ConnectionRefusedError"), why
