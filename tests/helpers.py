"""What many test modules share: a real `shardlm serve` started on a free loopback port and stopped
with nothing left running, and a figure read from its /metrics."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil

# the hang guard of a server start: it returns as soon as the server is healthy or has exited
START_HANG_GUARD_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, *extra, env=None):
    """`shardlm serve model_dir` (float32, a small KV cache, served as "tiny") -> (process, url)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "shardlm.entrypoints.cli", "serve", model_dir, "--port", str(port),
                             "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                             "--served-model-name", "tiny", "--uvicorn-log-level", "warning", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + START_HANG_GUARD_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server neither became healthy nor exited in {START_HANG_GUARD_S} s")


def stop_server(proc) -> None:
    """SIGTERM, then check that no child process is left."""
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"processes left after SIGTERM: {[p.pid for p in alive]}"


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
