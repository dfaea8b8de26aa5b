"""`shardlm env check`: this node (or every node of a Ray cluster) ready for distributed serving."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("env", help="check this node for distributed serving")
    esub = p.add_subparsers(dest="env_kind", required=True)
    e = esub.add_parser("check", help="addresses, versions, memory, devices, /dev/shm, and a measured "
                        "all-reduce and send/recv between local ranks, in seconds")
    e.add_argument("--ranks", type=int, default=2, help="local processes in the communication check")
    e.add_argument("--address", default=None, help="HEAD:PORT of a Ray cluster ('auto': the cluster of this node): "
                   "check every node and the communication across them")
    e.add_argument("--cpu-plan", default=None, metavar="FILE", help="show the CPU plan a run with --cpu-plan FILE "
                   "follows (its choices are taken, not measured)")
    e.add_argument("--json", action="store_true", help="print JSON")
    e.set_defaults(func=run)


def run(ns) -> None:
    import json

    from shardlm.entrypoints.preflight import communication_check, node_facts, problems, render
    if ns.address:
        from shardlm.entrypoints.cluster_check import cluster_check, render_cluster
        report = cluster_check(ns.address)
        print(json.dumps(report, indent=1) if ns.json else render_cluster(report))
        sys.exit(1 if report["problems"] else 0)
    if ns.ranks < 2:
        raise ValueError("env check --ranks must be at least 2 (it measures communication between ranks).")
    from shardlm import cpu_plan
    cpu_plan.follow(ns.cpu_plan)
    facts = node_facts()
    device = "cuda" if len(facts["gpus"]) >= ns.ranks else "cpu"
    comm = communication_check(ns.ranks, device)
    found = problems(facts, comm)
    if ns.json:
        print(json.dumps({"node": facts, "communication": comm, "problems": found}, indent=1))
    else:
        print(render(facts, comm, found))
    if found:
        sys.exit(1)
