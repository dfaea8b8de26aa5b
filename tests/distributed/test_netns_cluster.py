"""Two Ray nodes with their own IP addresses: the second node runs in its own network namespace,
joined to this one by a veth pair (10.213.N.1 here, 10.213.N.2 there). The head is told its
address with SHARDLM_HOST_IP, the way a node with several networks is; the other node finds
its own. Everything goes through the commands users run: `shardlm cluster head|worker|status`,
`shardlm env check --address`, and the engine with the ray executor, pp=2, one stage per node.
Needs root and `ip netns` (skipped elsewhere); takes about a minute."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import httpx
import pytest

from tests.distributed.ray_cluster import own_ray_auth_token

pytest.importorskip("ray")

SUBNET = f"10.213.{os.getpid() % 200 + 1}"
# A command here ends on an event of its own (a failure it names, the engine's own
# distributed_init_timeout, a server's shutdown); this only stops a hang, and is not how long
# anything is expected to take on a busy machine.
HANG_GUARD_S = 900
HEAD_IP, NODE_IP = f"{SUBNET}.1", f"{SUBNET}.2"
NS, HOST_IF, NODE_IF = f"shardlm-{os.getpid()}", f"shl{os.getpid() % 100000}h", f"shl{os.getpid() % 100000}n"


def _sh(*cmd, check=True):
    run = subprocess.run(cmd, capture_output=True, text=True)
    if check and run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {run.stderr}")
    return run


def _cli(*args, netns=False, env=None, timeout=HANG_GUARD_S):
    cmd = [sys.executable, "-m", "shardlm.entrypoints.cli", *args]
    if netns:
        cmd = ["ip", "netns", "exec", NS, *cmd]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert run.returncode == 0, f"shardlm {' '.join(args)}:\n{run.stdout}\n{run.stderr[-3000:]}"
    return run.stdout


def test_the_second_hosts_network_is_one_the_kernel_accepts():
    """Interface names fit the kernel's 15 characters, and the two addresses share one /24 (the
    veth pair is the route between the hosts), for any pid the test runs under."""
    assert len(HOST_IF) <= 15 and len(NODE_IF) <= 15 and HOST_IF != NODE_IF
    assert HEAD_IP.rsplit(".", 1)[0] == NODE_IP.rsplit(".", 1)[0] and HEAD_IP != NODE_IP
    assert 1 <= int(SUBNET.split(".")[2]) <= 254


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    with own_ray_auth_token(tmp_path_factory.mktemp("ray-auth")):
        yield from _two_hosts()


def _two_hosts():
    if os.geteuid() != 0 or not shutil.which("ip") or _sh("ip", "netns", "add", NS, check=False).returncode != 0:
        pytest.skip("needs root and `ip netns` to give the second node its own network")
    try:
        try:
            _sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NODE_IF)
            _sh("ip", "link", "set", NODE_IF, "netns", NS)
            _sh("ip", "addr", "add", f"{HEAD_IP}/24", "dev", HOST_IF)
            _sh("ip", "link", "set", HOST_IF, "up")
            for cmd in (["ip", "addr", "add", f"{NODE_IP}/24", "dev", NODE_IF], ["ip", "link", "set", NODE_IF, "up"],
                        ["ip", "link", "set", "lo", "up"], ["ip", "route", "add", "default", "via", HEAD_IP]):
                _sh("ip", "netns", "exec", NS, *cmd)
        except RuntimeError as e:
            pytest.skip(f"this machine cannot build the veth pair: {e}")
        port = 20000 + os.getpid() % 20000
        head = _cli("cluster", "head", "--port", str(port), "--num-cpus", "1", env={"SHARDLM_HOST_IP": HEAD_IP})
        assert f"Ray head started at {HEAD_IP}:{port}" in head
        joined = _cli("cluster", "worker", "--address", f"{HEAD_IP}:{port}", "--num-cpus", "1", netns=True)
        assert f"as {NODE_IP}; versions match" in joined
        yield f"{HEAD_IP}:{port}"
    finally:
        _sh(sys.executable, "-m", "shardlm.entrypoints.cli", "cluster", "stop", check=False)  # both: one machine
        _sh("ip", "netns", "del", NS, check=False)                                         # and its veth pair


@pytest.mark.slow
def test_status_and_env_check_see_both_addresses(two_hosts):
    env = {"SHARDLM_HOST_IP": HEAD_IP}
    nodes = json.loads(_cli("cluster", "status", "--address", two_hosts, "--json", env=env))[1:]
    assert [n["ip"] for n in nodes] == [HEAD_IP, NODE_IP]
    report = json.loads(_cli("env", "check", "--address", two_hosts, "--json", env=env))
    assert sorted(n["host_ip"] for n in report["nodes"]) == [HEAD_IP, NODE_IP]
    comm = report["communication"]
    assert comm["address"].startswith(HEAD_IP + ":") and comm["all_reduce_ok"] and comm["send_recv_ok"]
    assert report["problems"] == []


@pytest.mark.slow
def test_pp2_across_the_two_hosts_equals_one_rank(two_hosts, tiny_model_dir):
    from shardlm import LLM, SamplingParams
    prompts, params = ["Hello there", [5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one_rank = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="64MiB")
    try:
        want = [o.outputs[0].token_ids for o in one_rank.generate(
            [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    finally:
        one_rank.shutdown()
    script = textwrap.dedent(f"""
        import json
        from shardlm import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({tiny_model_dir("llama-gqa")!r}, dtype="float32", kv_cache_memory="64MiB",
                      pipeline_parallel_size=2, distributed_executor_backend="ray")
            outs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
            out = {{"ray": [o.outputs[0].token_ids for o in outs],
                    "ips": [i.ip for i in llm.engine.engine_core.engine_core.executor.infos],
                    "gloo": llm.collective_rpc("environment", (["GLOO_SOCKET_IFNAME"],))}}
            llm.shutdown()
            print(json.dumps(out))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S,
                         env={**os.environ, "RAY_ADDRESS": two_hosts, "SHARDLM_HOST_IP": HEAD_IP})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["ips"] == [HEAD_IP, NODE_IP], "one stage per host, rank 0 on the driver's"
    assert [e["GLOO_SOCKET_IFNAME"] for e in out["gloo"]] == [HOST_IF, NODE_IF], "gloo bound to each node's address"
    assert out["ray"] == want


@pytest.mark.slow
def test_a_rendezvous_address_the_other_node_cannot_reach_is_named(two_hosts, tiny_model_dir):
    """The classic mistake: the driver picks an address (here its outward one, or loopback)
    that the other node has no route to. env check says so, naming the node; the engine
    fails at once, naming rank and node and what to set, instead of waiting out its init timeout."""
    from shardlm.distributed.network import host_ip
    wrong = host_ip()                     # not on the veth subnet; the other node has no route once
    _sh("ip", "netns", "exec", NS, "ip", "route", "del", "default")         # its default route is gone
    try:
        env = {**os.environ, "SHARDLM_HOST_IP": wrong}
        run = subprocess.run([sys.executable, "-m", "shardlm.entrypoints.cli", "env", "check", "--address",
                              two_hosts], capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
        assert run.returncode == 1, run.stdout + run.stderr[-2000:]
        assert f"PROBLEM: node {NODE_IP} " in run.stdout and f"cannot reach the rendezvous port {wrong}:" in \
            run.stdout
        script = textwrap.dedent(f"""
            from shardlm import LLM
            if __name__ == "__main__":
                LLM({tiny_model_dir("llama-gqa")!r}, dtype="float32", kv_cache_memory="64MiB",
                    pipeline_parallel_size=2, distributed_executor_backend="ray", distributed_init_timeout=15)
        """)
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S,
                             env={**env, "RAY_ADDRESS": two_hosts})
        assert run.returncode != 0
        # the rank finds its connection refused or unrouted before joining: named at once, with the fix
        assert re.search(rf"rank 1 on node {re.escape(NODE_IP)}.*cannot reach the rendezvous at {re.escape(wrong)}:",
                         run.stderr), run.stderr[-3000:]
        assert "SHARDLM_HOST_IP" in run.stderr
    finally:
        _sh("ip", "netns", "exec", NS, "ip", "route", "add", "default", "via", HEAD_IP, check=False)


@pytest.mark.slow
def test_headless_data_parallel_replica_in_the_other_namespace(two_hosts, tiny_model_dir):
    """The head (this namespace, HEAD_IP) runs the API server and replica 0; a headless node in
    the other namespace runs replica 1 and joins over the veth pair. Both serve, equal to dp=1."""
    from tests.distributed.test_parallel_server import assert_server_answers_like_llm
    from tests.helpers import free_port, labelled_metric, start_server, stop_server
    path = tiny_model_dir("llama-gqa")
    rpc = free_port()
    common = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", HEAD_IP,
              "--data-parallel-rpc-port", str(rpc)]
    node = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, "-m", "shardlm.entrypoints.cli", "serve", path,
                             "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "256", *common,
                             "--data-parallel-start-rank", "1", "--headless"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        proc, url = start_server(path, *common, env={"SHARDLM_HOST_IP": HEAD_IP})
        try:
            assert_server_answers_like_llm(url, path)
            routed = labelled_metric(httpx.get(url + "/metrics").text, "shardlm:num_requests_routed", "1")
            assert routed >= 1, "replica 1 (the other namespace) served"
        finally:
            stop_server(proc)
        assert node.wait(timeout=HANG_GUARD_S) == 0, node.stderr.read()[-3000:]
        assert f"Data parallel replica 1 joined from node {NODE_IP}" in proc.stderr.read()
    finally:
        if node.poll() is None:
            node.kill()
