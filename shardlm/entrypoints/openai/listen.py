"""The server's listening sockets, bound before anything else starts (as vLLM does): a port
another server listens on, or an address this machine does not have, fails at once with what
to do, not after the model has loaded. uvicorn listens on them once the engine is ready; until
then a client's connection is refused, as before. (Two servers starting at once on one port
both bind, SO_REUSEADDR allowing it; the second fails as it starts to listen, as before.)"""

from __future__ import annotations

import errno
import socket


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """A socket bound to each address `host` resolves to (asyncio's rule: `localhost` gives
    127.0.0.1 and ::1), else ValueError saying why."""
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


def _why_not(host: str, port: int, error: OSError) -> str:
    where = f"{host}:{port}"
    if error.errno == errno.EADDRINUSE:
        return f"{where} is in use (another server, or one still stopping?): stop it, or pass another --port."
    if error.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine; 0.0.0.0 listens on all of them."
    if error.errno == errno.EACCES:
        return f"{where}: not allowed to listen there (ports below 1024 need privileges): pass --port 1024 or above."
    return f"cannot listen on {where}: {error.strerror}."
