"""A real multi-node Ray cluster on this machine for tests: Ray's own cluster_utils, each node a
separate raylet with its own resources. Connected in this process for the tests' duration."""

from __future__ import annotations

import contextlib
import os
import time


@contextlib.contextmanager
def ray_cluster(nodes: int, cpus_per_node: int):
    """The cluster runs without Ray's token authentication, and so must every client of it: a
    process shardlm starts would otherwise switch to token mode wherever ~/.ray/auth_token
    exists (Ray >= 2.5x writes one at its first local `ray.init()`)."""
    with environment(RAY_AUTH_MODE="disabled"):
        yield from _cluster(nodes, cpus_per_node)


def _cluster(nodes: int, cpus_per_node: int):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus_per_node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def assert_nothing_left(timeout_s: float = 10.0) -> None:
    """What `ray status` would show after our shutdown: every resource free again, and every
    placement group removed."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        free, total = ray.available_resources(), ray.cluster_resources()
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        if free.get("CPU") == total.get("CPU") and not groups:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left in the cluster: {total.get('CPU', 0) - free.get('CPU', 0):g} CPUs in use, "
                                 f"placement groups {groups}")
        time.sleep(0.2)


@contextlib.contextmanager
def environment(**values: str | None):
    """These environment variables set (None: unset) for the duration, restored after."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        _set_environment(values)
        yield
    finally:
        _set_environment(saved)


def _set_environment(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def own_ray_auth_token(directory):
    """The token `shardlm cluster head` creates goes to `directory` instead of ~/.ray (which the
    other tests' local Ray clusters share): every command started meanwhile inherits the path.
    Yields the token file."""
    token_file = directory / "auth_token"
    with environment(RAY_AUTH_MODE=None, RAY_AUTH_TOKEN=None, RAY_AUTH_TOKEN_PATH=str(token_file)):
        yield token_file
