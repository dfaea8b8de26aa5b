"""`shardlm cluster head|worker|status|stop`: a Ray cluster for multi-node serving, started with
the options that avoid the usual trial and error (each node's own address, the environment
set where the node starts, versions and model path checked when a node joins).

The head records what it runs (shardlm, torch, Ray, Python versions, the model path if given)
in Ray's key-value store; a joining worker compares itself with that record and leaves again,
naming itself and what differs, rather than failing later inside `serve`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys

from shardlm.distributed.network import host_ip
from shardlm.executor.ray_placement import node_versions
from shardlm.executor.selection import ray_auth_token_path, require_ray

_RECORD_KEY = b"shardlm/head"


def _ray_cli() -> str:
    return shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")


def _ray_start(args: list[str]) -> None:
    require_ray()        # also sets the auth mode that `ray start` and our connection agree on
    run = subprocess.run([_ray_cli(), "start", *args], capture_output=True, text=True)
    if run.returncode != 0:
        hint = ""
        if "auth" in run.stderr.lower() and "token" in run.stderr.lower():
            hint = ("\nThe head requires Ray's auth token: copy ~/.ray/auth_token from the head to this node (or set "
                    "RAY_AUTH_TOKEN), or start the head with RAY_AUTH_MODE=disabled on a trusted network.")
        raise RuntimeError(f"`ray start {' '.join(args)}` failed on {_this_node()}:\n"
                           f"{run.stderr.strip()[-2000:]}{hint}")


def _resource_args(num_cpus: int | None, num_gpus: int | None) -> list[str]:
    out = ["--node-ip-address", host_ip(), "--disable-usage-stats"]
    if num_cpus is not None:
        out += ["--num-cpus", str(num_cpus)]
    if num_gpus is not None:
        out += ["--num-gpus", str(num_gpus)]
    return out


def _this_node() -> str:
    return f"node {host_ip()} ({socket.gethostname()})"


def ensure_auth_token() -> str | None:
    """Turn Ray's token authentication on for the cluster this process starts: reuse the token
    that exists (RAY_AUTH_TOKEN or the token file), else write a new one (owner-only) where
    Ray looks for it. Returns the token file to copy to the other nodes, or None where
    RAY_AUTH_MODE already decides (e.g. `disabled` on a trusted network) or the token comes
    from RAY_AUTH_TOKEN."""
    if os.environ.get("RAY_AUTH_MODE") or os.environ.get("RAY_AUTH_TOKEN"):
        return None
    path = ray_auth_token_path()
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_MODE"] = "token"      # for `ray start` and this process's connection
    return path


def start_head(port: int, model: str | None, num_cpus: int | None = None,
               num_gpus: int | None = None) -> tuple[str, str | None]:
    """Start the head node, with Ray's token authentication unless RAY_AUTH_MODE says
    otherwise. Returns its address HEAD:PORT and the token file the other nodes need."""
    if model and not os.path.exists(model):
        raise ValueError(f"The model path {model} does not exist on the head ({_this_node()}).")
    token_file = ensure_auth_token()
    _ray_start(["--head", "--port", str(port), "--include-dashboard=false", *_resource_args(num_cpus, num_gpus)])
    address = f"{host_ip()}:{port}"
    ray = _connect(address)
    try:
        record = {"node": _this_node(), "versions": node_versions(), "model": model}
        ray.experimental.internal_kv._internal_kv_put(_RECORD_KEY, json.dumps(record).encode(), overwrite=True)
    finally:
        ray.shutdown()
    return address, token_file


def start_worker(address: str, model: str | None = None, num_cpus: int | None = None,
                 num_gpus: int | None = None) -> dict:
    """Join the cluster at `address`, then check this node against the head's record; on a
    mismatch this node's Ray is stopped again and the error names it. Returns the record."""
    _ray_start(["--address", address, *_resource_args(num_cpus, num_gpus)])
    ray = _connect(address)
    try:
        raw = ray.experimental.internal_kv._internal_kv_get(_RECORD_KEY)
    finally:
        ray.shutdown()
    record = json.loads(raw) if raw else {}
    problems = join_problems(record, node_versions(), model)
    if problems:
        head_here = address.rsplit(":", 1)[0] == host_ip()
        if not head_here:          # `ray stop` stops every Ray process of this machine
            stop()
        raise RuntimeError(f"{_this_node()} cannot serve with this cluster: {'; '.join(problems)}."
                           + (" Its Ray node was stopped again." if not head_here else
                              " The head runs on this machine too, so nothing was stopped: `shardlm cluster stop`."))
    return record


def join_problems(record: dict, versions: dict[str, str], model: str | None) -> list[str]:
    """What differs between a joining node and the head's record."""
    found = [f"{name} {ours} here, {theirs} on the head ({record.get('node')})"
             for name, theirs in record.get("versions", {}).items() if (ours := versions.get(name)) != theirs]
    if found:
        found[-1] += ": install the same versions on every node"
    path = model or record.get("model")
    if path and not os.path.exists(path):
        found.append(f"the model path {path} does not exist here: every node needs the model at the same path")
    return found


def _connect(address: str | None):
    ray = require_ray()
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", logging_level="error",
             log_to_driver=False)
    return ray


def status(address: str | None = None) -> list[dict]:
    """The cluster's live nodes: address, host, CPUs, GPUs, memory."""
    ray = _connect(address)
    try:
        head = json.loads(ray.experimental.internal_kv._internal_kv_get(_RECORD_KEY) or b"{}")
        nodes = []
        for n in ray.nodes():
            if not n["Alive"]:
                continue
            res = n["Resources"]
            gpu_types = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
            nodes.append({"ip": n["NodeManagerAddress"], "hostname": n["NodeManagerHostname"],
                          "node_id": n["NodeID"], "head": bool(res.get("node:__internal_head__")),
                          "cpus": res.get("CPU", 0), "gpus": res.get("GPU", 0), "gpu_type": ",".join(gpu_types),
                          "memory": res.get("memory", 0), "object_store": res.get("object_store_memory", 0)})
        return [{"head_record": head}, *sorted(nodes, key=lambda n: (not n["head"], n["ip"], n["node_id"]))]
    finally:
        ray.shutdown()


def render_status(report: list[dict]) -> str:
    head, nodes = report[0]["head_record"], report[1:]
    gib = 1 << 30
    lines = [f"{len(nodes)} node(s) alive"
             + (f"; head runs {', '.join(f'{k} {v}' for k, v in head['versions'].items())}" if head else "")]
    for n in nodes:
        gpus = f"{n['gpus']:g} GPU" + (f" ({n['gpu_type']})" if n["gpu_type"] else "")
        lines.append(f"  {'head  ' if n['head'] else 'worker'} {n['ip']:<15} {n['hostname']:<20} {n['cpus']:g} CPU, "
                     f"{gpus}, memory {n['memory'] / gib:.1f} GiB, Ray node {n['node_id'][:8]}")
    return "\n".join(lines)


def stop() -> None:
    """Stop the Ray processes this machine runs (`ray stop`)."""
    subprocess.run([_ray_cli(), "stop"], capture_output=True, text=True)
