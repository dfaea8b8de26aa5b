"""A two-node Ray cluster built the way users build one: `shardlm cluster head` here, `shardlm
cluster worker` on the second host (its own network namespace and address where the machine
allows it: see second_host.py). The head is told its address with SHARDLM_HOST_IP, the way a node
with several networks is; the other node finds its own. Then `shardlm cluster status`, `shardlm
env check --address`, the engine with the ray executor (one pipeline stage per node), and what a
node that cannot join or reach the rendezvous is told."""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.distributed.ray_cluster import own_ray_auth_token
from tests.distributed.second_host import HOST_IF, NODE_IF, SUBNET

ray = pytest.importorskip("ray")

# A command here ends on an event of its own (a failure it names, the engine's own
# distributed_init_timeout); this only stops a hang, and is not how long anything is expected to take.
HANG_GUARD_S = 900


def _cli(*args, where=(), env=None, check=True):
    run = subprocess.run([*where, sys.executable, "-m", "shardlm.entrypoints.cli", *args], capture_output=True,
                         text=True, timeout=HANG_GUARD_S, env={**os.environ, **(env or {})})
    if check:
        assert run.returncode == 0, f"shardlm {' '.join(args)}:\n{run.stdout}\n{run.stderr[-3000:]}"
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_the_second_hosts_network_is_one_the_kernel_accepts():
    """Interface names fit the kernel's 15 characters, and the two addresses share one /24 (the
    veth pair is the route between the hosts), for any pid the test runs under."""
    assert len(HOST_IF) <= 15 and len(NODE_IF) <= 15 and HOST_IF != NODE_IF
    assert 1 <= int(SUBNET.split(".")[2]) <= 254


@pytest.fixture(scope="module")
def cluster(second_host, tiny_model_dir, tmp_path_factory):
    """(address, model, the environment a client on the head uses)."""
    if ray.is_initialized():
        ray.shutdown()
    model = tiny_model_dir("llama-gqa")
    with own_ray_auth_token(tmp_path_factory.mktemp("ray-auth")) as token_file:
        yield from _start_cluster(second_host, model, token_file)


def _start_cluster(host, model, token_file):
    env = {"SHARDLM_HOST_IP": host.head_ip}
    try:
        head = _cli("cluster", "head", "--port", str(free_port()), "--num-cpus", "1", "--model", model, env=env)
        address = head.stdout.split("Ray head started at ")[1].split()[0]
        assert address.split(":")[0] == host.head_ip
        assert f"shardlm cluster worker --address {address}" in head.stdout
        assert f"token authentication is on: copy {token_file}" in head.stdout
        assert token_file.stat().st_mode & 0o777 == 0o600 and len(token_file.read_text()) == 64
        joined = _cli("cluster", "worker", "--address", address, "--num-cpus", "1", where=host.prefix)
        assert f"as {host.ip}; versions match the head" in joined.stdout
        yield address, model, env
    finally:
        _cli("cluster", "stop", check=False)       # both nodes' Ray processes: one machine


_CONNECT = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='error'); "
            "print(len(ray.nodes())); ray.shutdown()")


@pytest.mark.slow
def test_cluster_refuses_a_client_without_its_token(cluster):
    address, _, _ = cluster
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
def test_status_and_env_check_see_both_nodes(cluster, second_host):
    from shardlm.cluster import render_status
    from shardlm.entrypoints.cluster_check import render_cluster
    address, _, env = cluster
    report = json.loads(_cli("cluster", "status", "--address", address, "--json", env=env).stdout)
    nodes = report[1:]
    assert [n["head"] for n in nodes] == [True, False]
    assert [n["ip"] for n in nodes] == [second_host.head_ip, second_host.ip]
    assert all(n["cpus"] == 1 and n["memory"] > 0 for n in nodes)
    assert report[0]["head_record"]["versions"]["torch"]
    text = render_status(report)          # what the command prints without --json
    assert text.startswith("2 node(s) alive") and "head " in text and "worker " in text

    # the second host's name server takes each query and never answers: env check names the wait
    with second_host.name_server_that_does_not_answer() if second_host.separate else contextlib.nullcontext():
        check = _cli("env", "check", "--address", address, "--json", env=env, check=False)
    assert check.returncode == (1 if second_host.separate else 0), check.stderr[-2000:]       # 1: problems found
    report = json.loads(check.stdout)
    assert len({n["ray_node_id"] for n in report["nodes"]}) == 2
    assert sorted(n["host_ip"] for n in report["nodes"]) == sorted([second_host.head_ip, second_host.ip])
    comm = report["communication"]
    assert comm["ranks"] == 2 and comm["backend"] == "gloo" and comm["all_reduce_ok"] and comm["send_recv_ok"]
    assert comm["address"].startswith(second_host.head_ip + ":")
    assert comm["all_reduce_GBps"] > 0 and comm["send_recv_GBps"] > 0
    if not second_host.separate:
        assert report["problems"] == []
        return
    assert len(report["problems"]) == 2, report["problems"]          # the second host naming each node
    for problem, ip in zip(report["problems"], sorted([second_host.head_ip, second_host.ip])):
        assert re.match(rf"node {re.escape(second_host.ip)} \(.+\): naming {re.escape(ip)} \(a reverse DNS lookup\) "
                        r"took [12]\.\d s\. torch looks up the name of each peer", problem), problem
    text = render_cluster(report)
    assert text.startswith("2 node(s):") and "Across nodes (2 ranks, one per node, gloo" in text


@pytest.mark.slow
def test_pp2_and_dp2_across_the_two_hosts_equal_one_rank(cluster, second_host, tiny_model_dir):
    """Ray places one rank per host: -pp 2's two stages, then -dp 2's two replicas (the ray
    executor; their engine cores run in the client's process tree, their ranks form one DP group)."""
    from shardlm import LLM, SamplingParams
    address, model, env = cluster
    prompts, params = ["Hello there", [5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one_rank = LLM(model, dtype="float32", kv_cache_memory="64MiB")
    try:
        want = [o.outputs[0].token_ids for o in one_rank.generate(
            [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    finally:
        one_rank.shutdown()
    script = textwrap.dedent(f"""
        import json, signal
        from shardlm import LLM, SamplingParams
        if __name__ == "__main__":
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            llm = LLM({model!r}, dtype="float32", kv_cache_memory="64MiB",
                      pipeline_parallel_size=2, distributed_executor_backend="ray")
            outs = llm.generate({prompts!r}, params, use_tqdm=False)
            out = {{"ray": [o.outputs[0].token_ids for o in outs],
                    "ips": [i.ip for i in llm.engine.engine_core.engine_core.executor.infos],
                    "gloo": llm.collective_rpc("environment", (["GLOO_SOCKET_IFNAME"],))}}
            llm.shutdown()
            def drain(signum, frame): ...
            signal.signal(signal.SIGTERM, drain)      # a server's drain handler outlives ray.init
            llm = LLM({model!r}, dtype="float32", kv_cache_memory="64MiB",
                      data_parallel_size=2, distributed_executor_backend="ray")
            out["sigterm_kept"] = signal.getsignal(signal.SIGTERM) is drain
            out["dp"] = [o.outputs[0].token_ids for o in llm.generate({prompts!r} * 2, params, use_tqdm=False)]
            out["dp_layout"] = llm.collective_rpc("parallel_layout")
            llm.shutdown()
            print(json.dumps(out))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S,
                         env={**os.environ, **env, "RAY_ADDRESS": address})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["ips"] == [second_host.head_ip, second_host.ip], "one stage per host, rank 0 on the driver's"
    gloo = [e["GLOO_SOCKET_IFNAME"] for e in out["gloo"]]
    assert all(gloo), "gloo bound to the interface of each node's address"
    if second_host.separate:
        assert gloo == [HOST_IF, NODE_IF]
    assert out["ray"] == want
    assert out["dp"] == want * 2 and out["sigterm_kept"]
    assert [(r["world_rank"], r["dp"]) for r in out["dp_layout"]] == [(0, [0, 1]), (1, [0, 1])]
    assert f"Data parallel ranks on Ray: replica 0: {second_host.head_ip}; replica 1: {second_host.ip}" in run.stderr


@pytest.mark.slow
def test_a_rendezvous_address_the_other_node_cannot_reach_is_named(cluster, second_host, tiny_model_dir):
    """The classic mistake: the driver picks an address (here its outward one, or loopback)
    that the other node has no route to. env check says so, naming the node; the engine
    fails at once, naming rank and node and what to set, instead of waiting out its init timeout."""
    if not second_host.separate:
        pytest.skip(f"needs a second host with its own network: {second_host.why_not_separate}")
    from shardlm.distributed.network import host_ip
    address, model, _ = cluster
    wrong = host_ip()                     # not on the veth subnet; the other node has no route once
    env = {**os.environ, "SHARDLM_HOST_IP": wrong}
    with second_host.without_route():    # its default route is gone
        run = subprocess.run([sys.executable, "-m", "shardlm.entrypoints.cli", "env", "check", "--address", address],
                             capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
        assert run.returncode == 1, run.stdout + run.stderr[-2000:]
        assert f"PROBLEM: node {second_host.ip} " in run.stdout
        assert f"cannot reach the rendezvous port {wrong}:" in run.stdout
        script = textwrap.dedent(f"""
            from shardlm import LLM
            if __name__ == "__main__":
                LLM({model!r}, dtype="float32", kv_cache_memory="64MiB",
                    pipeline_parallel_size=2, distributed_executor_backend="ray", distributed_init_timeout=15)
        """)
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S,
                             env={**env, "RAY_ADDRESS": address})
    assert run.returncode != 0
    # the rank finds its connection refused or unrouted before joining: named at once, with the fix
    assert re.search(rf"rank 1 on node {re.escape(second_host.ip)}.*cannot reach the rendezvous at "
                     rf"{re.escape(wrong)}:", run.stderr), run.stderr[-3000:]
    assert "SHARDLM_HOST_IP" in run.stderr


@pytest.mark.slow
def test_joining_node_that_differs_from_the_head_is_named(cluster):
    """The head's record says another torch and a model path this node lacks: the join fails,
    naming this node and both differences. (Last in the module: the record stays changed.)"""
    address, model, env = cluster
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
                         text=True, timeout=120, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-2000:]
    run = _cli("cluster", "worker", "--address", address, "--num-cpus", "1", env=env, check=False)
    assert run.returncode != 0
    assert f"node {env['SHARDLM_HOST_IP']} ({socket.gethostname()}) cannot serve with this cluster" in run.stderr
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
