"""The server binds its port before anything else: a port in use, or an address this machine does
not have, is a plain error at once (exit 2), before any engine starts."""

import socket
import subprocess
import sys

import pytest

from shardlm.entrypoints.openai.listen import bind_sockets
from tests.helpers import SERVE_FLAGS, free_port


def test_a_free_port_is_bound_on_each_address_of_the_host():
    port = free_port()
    sockets = bind_sockets("localhost", port)
    try:
        assert sockets and {s.getsockname()[1] for s in sockets} == {port}
        for s in sockets:
            s.listen()            # as uvicorn does once the engine is ready
        with pytest.raises(ValueError, match=f"localhost:{port} is in use .*pass another --port"):
            bind_sockets("localhost", port)
    finally:
        for s in sockets:
            s.close()
    for s in bind_sockets("127.0.0.1", port):      # closed: free again
        s.close()


@pytest.mark.parametrize("host, why", [("203.0.113.7", "not an address of this machine; 0.0.0.0"),
                                       ("no-such-host.invalid", "not an address of this machine, nor a name")])
def test_an_address_this_machine_lacks_is_named(host, why):
    with pytest.raises(ValueError, match=f"--host {host}: {why}"):
        bind_sockets(host, free_port())


def test_serve_on_a_port_in_use_fails_before_the_engine_starts(tiny_model_dir):
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        run = subprocess.run([sys.executable, "-m", "shardlm.entrypoints.cli", "serve", tiny_model_dir("llama-gqa"),
                              "--port", str(port), *SERVE_FLAGS], capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"shardlm: error: 127.0.0.1:{port} is in use" in run.stderr
    assert "Model weights loaded" not in run.stderr and "Traceback" not in run.stderr
