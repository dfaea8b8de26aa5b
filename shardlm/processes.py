"""How shardlm starts its own processes (engine cores, workers).

fork where it is safe: fork copies only the calling thread, so a thread that holds a lock at
that moment (a Python thread, OpenMP's pool once torch ran ops, a CUDA context) would leave the
child waiting forever. Otherwise from a fork server: a clean process, started once, that imports
torch, transformers and shardlm and then forks each new process, so that no process imports them
again (about 5 s of CPU each with spawn, the fallback where there is no fork server).

A fork server's children inherit its environment, taken when it started; `InParentEnvironment`
gives each the environment of the process that asked for it instead."""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import threading
from multiprocessing.context import BaseContext

from shardlm import envs
from shardlm.utils import os_thread_count

# what the fork server imports before its first fork: startup first (it imports torch, then counts
# its threads, as fork-safety checks in the children need); type_validators is what every model
# config of transformers 5 imports, ~1.5 s of it (torch.distributed.tensor), which each child
# unpickling its config would pay again (a name that does not import is skipped)
FORK_SERVER_PRELOAD = ["shardlm.startup", "transformers", "transformers.utils.type_validators",
                       "shardlm.core.engine_core", "shardlm.worker.worker", "shardlm.fork_server_setup"]
METHODS = ("fork", "forkserver", "spawn")


def start_method(allow_fork: bool = True) -> tuple[str, str]:
    """fork, forkserver or spawn, and why (SHARDLM_WORKER_MULTIPROC_METHOD overrides)."""
    forced = envs.SHARDLM_WORKER_MULTIPROC_METHOD
    if forced:
        if forced not in METHODS:
            raise ValueError(f"SHARDLM_WORKER_MULTIPROC_METHOD={forced!r}: use fork, forkserver or spawn.")
        return forced, "SHARDLM_WORKER_MULTIPROC_METHOD"
    unsafe = why_fork_is_unsafe() if allow_fork else "a process that serves clients is started clean"
    if unsafe is None:
        return "fork", "no thread or CUDA context besides torch's own"
    if "forkserver" in multiprocessing.get_all_start_methods():
        return "forkserver", unsafe
    return "spawn", unsafe


def why_fork_is_unsafe() -> str | None:
    """None when this process runs no more threads than right after importing torch (whose BLAS
    pool is fork-safe) and has no CUDA context; else the reason."""
    import torch

    from shardlm import startup
    if torch.cuda.is_initialized():
        return "CUDA is initialized in this process"
    threads, baseline = os_thread_count(), startup.THREADS_AT_IMPORT
    if threads < 0 or baseline < 0:
        return "this process's threads cannot be counted"
    if threads > baseline or threading.active_count() > 1:
        return f"this process runs {threads - baseline} more thread(s) than after importing torch"
    return None


def process_context(method: str) -> BaseContext:
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return ctx


def clean_process_context() -> BaseContext:
    """Where a process that serves clients (an engine core) comes from: never fork, which would
    copy this process's state into it; the fork server, else spawn."""
    return process_context(start_method(allow_fork=False)[0])


def start_fork_server_early() -> None:
    """Start the fork server now, where processes will come from it, so that its imports overlap
    this process's own start-up work (a server's config, tokenizer and app)."""
    if clean_process_context().get_start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()


def imports_the_main_script(method: str) -> bool:
    """spawn and the fork server's children import the script that started shardlm (which then
    needs an `if __name__ == "__main__":` guard); fork's do not."""
    return method != "fork"


class InParentEnvironment:
    """A process target that runs in the environment of the process that created it."""

    def __init__(self, target):
        self.target = target
        self.environ = dict(os.environ)

    def __call__(self, *args, **kwargs):
        adopt_environment(self.environ)
        return self.target(*args, **kwargs)


def adopt_environment(environ: dict[str, str]) -> None:
    """Make `environ` this process's, and redo what shardlm read from it at import."""
    if environ == dict(os.environ):
        return
    os.environ.clear()
    os.environ.update(environ)
    importlib.reload(envs)       # its readers look values up as envs.NAME, so they see the new ones
    logging.getLogger("shardlm").setLevel(envs.SHARDLM_LOG_LEVEL.upper())
    kernels = sys.modules.get("shardlm.kernels")
    if kernels is not None and kernels.isa_cap() != envs.SHARDLM_CPU_ISA:
        kernels.use_isa(envs.SHARDLM_CPU_ISA)
