"""The server's listening sockets, bound before anything else starts (as vLLM does): a port
another server listens on, an address this machine does not have, or a --uds path in use,
fails at once with what to do, not after the model has loaded. uvicorn listens on them once the
engine is ready; until then a client's connection is refused, as before. (Two servers starting at once on one port
both bind, SO_REUSEADDR allowing it; the second fails as it starts to listen, as before.)"""

from __future__ import annotations

import errno
import os
import socket
import stat


def bind_sockets(host: str, port: int, uds: str | None = None) -> list[socket.socket]:
    """A socket bound to each address `host` resolves to (asyncio's rule: `localhost` gives
    127.0.0.1 and ::1), or to the Unix socket `uds`; else ValueError saying why."""
    if uds is not None:
        return [bind_unix_socket(uds)]
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an address of this machine, nor a name that resolves ({e.strerror}).") \
            from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # a restart need not wait for TIME_WAIT
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)   # IPv4 has its own socket
            try:
                sock.bind(address)
            except OSError as e:
                raise ValueError(_why_not(host, port, e)) from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bind_unix_socket(path: str) -> socket.socket:
    """--uds PATH: a socket file left by a server that is gone is replaced; one a server listens
    on, or a file that is not a socket, is not."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise ValueError(f"--uds {path}: a file that is not a socket is there: remove it, or give another path.")
        with socket.socket(socket.AF_UNIX) as probe:
            if probe.connect_ex(path) == 0:
                raise ValueError(f"--uds {path}: another server listens on it: stop it, or give another path.")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise ValueError(f"--uds {path}: cannot listen there: {e.strerror}.") from None
    os.chmod(path, 0o666)       # as uvicorn's own --uds: any local user may connect
    return sock


def _why_not(host: str, port: int, error: OSError) -> str:
    where = f"{host}:{port}"
    if error.errno == errno.EADDRINUSE:
        return f"{where} is in use (another server, or one still stopping?): stop it, or pass another --port."
    if error.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine; 0.0.0.0 listens on all of them."
    if error.errno == errno.EACCES:
        return f"{where}: not allowed to listen there (ports below 1024 need privileges): pass --port 1024 or above."
    return f"cannot listen on {where}: {error.strerror}."
