"""`shardlm cluster head|worker|status|stop`: a Ray cluster for multi-node serving."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("cluster", help="start, inspect and stop a Ray cluster for multi-node serving")
    csub = p.add_subparsers(dest="cluster_kind", required=True)
    c = csub.add_parser("head", help="start the Ray head on this node")
    c.add_argument("--port", type=int, default=6379, help="the port workers join on")
    c2 = csub.add_parser("worker", help="join this node to the cluster at --address, checking versions and model")
    c2.add_argument("--address", required=True, help="HEAD_IP:PORT, the head's address (not this node's)")
    for c in (c, c2):
        c.add_argument("--model", default=None, help="model path that every node must have")
        c.add_argument("--num-cpus", type=int, default=None, help="CPUs this node offers (default: all)")
        c.add_argument("--num-gpus", type=int, default=None, help="GPUs this node offers (default: all)")
    c = csub.add_parser("status", help="the nodes: addresses, CPUs, GPUs, memory")
    c.add_argument("--address", default=None, help="HEAD:PORT (default: RAY_ADDRESS or the cluster of this node)")
    c.add_argument("--json", action="store_true", help="print JSON")
    csub.add_parser("stop", help="stop the Ray processes of this node")
    p.set_defaults(func=run)


def run(ns) -> None:
    import json

    from shardlm import cluster
    if ns.cluster_kind == "head":
        address, token_file = cluster.start_head(ns.port, ns.model, ns.num_cpus, ns.num_gpus)
        auth = (f"Ray's token authentication is on: copy {token_file} to the same path on every other node "
                "(or set RAY_AUTH_TOKEN there) first.\n" if token_file else "")
        print(f"Ray head started at {address} (this node: {cluster.host_ip()}).\n{auth}"
              f"On every other node: shardlm cluster worker --address {address}\n"
              "Then, on this node: shardlm serve MODEL --distributed-executor-backend ray "
              "-tp <GPUs per node> -pp <nodes>\n"
              "Check the nodes with: shardlm cluster status; shardlm env check --address " + address)
    elif ns.cluster_kind == "worker":
        record = cluster.start_worker(ns.address, ns.model, ns.num_cpus, ns.num_gpus)
        print(f"Joined the cluster at {ns.address} as {cluster.host_ip()}; versions match the head "
              f"({record.get('node', 'no shardlm record on the head')}).")
    elif ns.cluster_kind == "status":
        report = cluster.status(ns.address)
        print(json.dumps(report, indent=1) if ns.json else cluster.render_status(report))
    else:
        cluster.stop()
        print("Stopped the Ray processes of this node.")
