"""The executor backends, in one registry: their names, the default choice as vLLM users know
it (uni for one rank; mp when every rank fits on this node and we are not inside a Ray
placement group; ray otherwise), and the class behind each name."""

from __future__ import annotations

import importlib
import os
import sys

import torch

from shardlm.logger import init_logger

logger = init_logger(__name__)

# name -> (module, class); imported only when chosen, so the mp path never imports ray
BACKENDS = {
    "uni": ("shardlm.executor.uniproc", "UniProcExecutor"),
    "mp": ("shardlm.executor.multiproc", "MultiprocExecutor"),
    "ray": ("shardlm.executor.ray_executor", "RayExecutor"),
}


def choose_backend(world_size: int, device: torch.device, requested: str | None = None) -> str:
    if requested is not None and requested not in BACKENDS:
        raise ValueError(f"distributed_executor_backend={requested!r}: use {', '.join(map(repr, BACKENDS))}.")
    if world_size == 1:
        return requested or "uni"
    if requested is not None:
        backend, why = requested, "requested with --distributed-executor-backend"
    elif _in_ray_placement_group():
        backend, why = "ray", "this process runs inside a Ray placement group"
    elif device.type == "cuda" and world_size > torch.cuda.device_count():
        backend, why = "ray", (f"{world_size} ranks need more GPUs than the {torch.cuda.device_count()} on this "
                               "node")
    else:
        backend, why = "mp", f"all {world_size} ranks fit on this node"
    if requested is None:
        why += "; choose with --distributed-executor-backend"
    logger.info("Distributed executor backend: %s (%s)", backend, why)
    if backend == "ray":
        require_ray()
    return backend


def executor_class(backend: str) -> type:
    """The Executor subclass registered under `backend`."""
    if backend == "ray":
        require_ray()
    module, name = BACKENDS[backend]
    return getattr(importlib.import_module(module), name)


def _in_ray_placement_group() -> bool:
    # only a process that Ray started (which has imported ray) can be in a placement group;
    # the mp path never imports ray itself
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and ray.util.get_current_placement_group() is not None


def require_ray():
    """Import ray, or say how to install it."""
    _use_ray_auth_token()
    try:
        import ray
    except ImportError:
        raise ImportError("The ray executor needs Ray, which is not installed: pip install 'shardlm[ray]' "
                          "(on every node), or use --distributed-executor-backend mp on one node.") from None
    return ray


def init_ray(**kwargs) -> bool:
    """ray.init unless this process is connected already; -> whether this call connected it (and
    so its caller disconnects). It keeps this process's SIGTERM and SIGINT handlers: Ray puts its
    own in (exit at once, after a C++ stack print), which would cut a server's drain short and
    make an engine core that leaves those signals to its parent die before its parent stops it."""
    import signal
    import threading

    ray = require_ray()
    if ray.is_initialized():
        return False
    if threading.current_thread() is not threading.main_thread():       # Ray touches no handler there
        ray.init(**kwargs)
        return True
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        ray.init(**kwargs)
    finally:
        for sig, handler in saved.items():
            if handler is not None:        # None: not set from Python, nothing to put back
                signal.signal(sig, handler)
    return True


def ray_auth_token_path() -> str:
    """Where Ray reads its token (and `cluster head` writes it)."""
    return os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")


def _use_ray_auth_token() -> None:
    """Clusters from `ray start` (Ray >= 2.5x) require the token in ~/.ray/auth_token, but a new
    process talks to them without it unless RAY_AUTH_MODE=token; a token-mode client still
    reaches clusters without authentication. Must run before ray is imported."""
    if "RAY_AUTH_MODE" in os.environ or "ray" in sys.modules:
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(ray_auth_token_path()):
        os.environ["RAY_AUTH_MODE"] = "token"
