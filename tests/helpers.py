"""What many test modules share: a real `shardlm serve` started on a free loopback port and stopped
with nothing left running (or the same server in this process, quicker to start), and a figure
read from its /metrics."""

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil

# the hang guard of a server start: it returns as soon as the server is healthy or has exited
START_HANG_GUARD_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what every test server runs with: float32, a small KV cache, served as "tiny"
SERVE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "256",
               "--served-model-name", "tiny", "--uvicorn-log-level", "warning")


def start_server(model_dir, *extra, env=None, stderr=subprocess.PIPE, new_session=False):
    """`shardlm serve model_dir` in its own process -> (process, url). stderr: a pipe the test reads
    (proc.stderr), or a file for a server that logs much (a pipe nobody reads fills and blocks it).
    new_session: the server leads a process group of its own (for signals to the whole group)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "shardlm.entrypoints.cli", "serve", model_dir, "--port", str(port),
                             *SERVE_FLAGS, *extra],
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=new_session)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url)
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str) -> None:
    """Until the server `proc` at `url` answers /health; raises if it exits or hangs instead."""
    deadline = time.time() + START_HANG_GUARD_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-3000:] if proc.stderr else proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server neither became healthy nor exited in {START_HANG_GUARD_S} s")


class ServerThread:
    """What `shardlm serve model_dir *extra` serves, on a thread of this process: no interpreter to
    start, and its engine core comes from the tests' fork server. For what the server answers;
    what its process does (signals, exit status, children) needs start_server."""

    def __init__(self, model_dir, *extra, env: dict[str, str] | None = None):
        from shardlm.entrypoints.cli import build_parser
        from shardlm.entrypoints.cli.serve import server_options
        from shardlm.entrypoints.openai.server import make_server
        from shardlm.processes import adopt_environment
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        saved = dict(os.environ)
        adopt_environment({**saved, **(env or {})})       # for what the app reads as it is built
        try:
            ns = build_parser().parse_args(["serve", model_dir, "--port", str(port), *SERVE_FLAGS, *extra])
            self.server = make_server(**server_options(ns))
        finally:
            adopt_environment(saved)
        self.thread = threading.Thread(target=asyncio.run, args=(self.server.serve(),), daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server did not start: see its log above")
            time.sleep(0.05)

    def is_serving(self) -> bool:
        return self.thread.is_alive() and not self.server.should_exit

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server thread did not stop"


@contextlib.contextmanager
def server_in_this_process(model_dir, *extra, env=None):
    """ServerThread(...) for a with-block: -> (the ServerThread, url); stopped at its end."""
    server = ServerThread(model_dir, *extra, env=env)
    try:
        yield server, server.url
    finally:
        server.stop()


def stop_server(proc) -> None:
    """SIGTERM, then check that no child process is left."""
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    alive = wait_gone(children, 10)
    assert not alive, f"processes left after SIGTERM: {[p.pid for p in alive]}"


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of procs still running after up to `timeout` s. A zombie counts as gone: it has exited
    and waits only for init to reap it, which in a container can take seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def engine_core_processes(proc) -> list[psutil.Process]:
    """The engine core processes below a server process, oldest first (they name themselves)."""
    cores = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("shardlm-core")]
    return sorted(cores, key=lambda p: p.create_time())


def metric(url, name) -> float:
    """One figure of the server's Prometheus /metrics."""
    text = httpx.get(url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def labelled_metric(metrics: str, name: str, engine: str) -> float:
    """One replica's figure (engine="0", "1", ... or "all") in /metrics text."""
    for line in metrics.splitlines():
        if line.startswith(name + "{") and f'engine="{engine}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{engine={engine}}} not in /metrics")
