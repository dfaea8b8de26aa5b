"""Which address and interface this node uses for rendezvous and collectives.

A node with several networks (docker bridges, a management LAN, InfiniBand) has several
addresses; the wrong pick is the classic multi-node failure (a hang in process-group init).
shardlm uses one address per node: SHARDLM_HOST_IP where set, else the one Ray or the routing
table reports, and binds gloo and NCCL to the interface that owns it.
"""

from __future__ import annotations

import errno
import os
import socket
import time

import psutil

from shardlm import envs


def host_ip(ray=None) -> str:
    """This node's address: SHARDLM_HOST_IP if set; else, in a Ray cluster (`ray` given), the
    address Ray knows this node by; else the address of the interface that routes outward (no
    packet is sent); else loopback."""
    override = os.environ.get("SHARDLM_HOST_IP") or envs.SHARDLM_HOST_IP
    if override:
        return override
    if ray is not None:
        return ray.util.get_node_ip_address()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def cannot_reach(host: str, port: int, tries: int = 3, pause_s: float = 0.5) -> str | None:
    """Why this node cannot open a TCP connection to a rendezvous that is already listening at
    host:port, when waiting would not help: every try refused, or no route to the host. None if
    a try connects, or one times out (a slow or filtered network: the rendezvous's own timeout
    decides)."""
    why = None
    for attempt in range(tries):
        e = connect_error(host, port)
        if e is None or (not isinstance(e, ConnectionRefusedError)
                         and e.errno not in (errno.ENETUNREACH, errno.EHOSTUNREACH)):
            return None
        why = f"{type(e).__name__}: {e.strerror or e}"
        if attempt + 1 < tries:
            time.sleep(pause_s)
    return why


def connect_error(host: str, port: int, timeout_s: float = 3) -> OSError | None:
    """The error of one TCP connection from here to host:port (opened and closed), or None."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e


# torch's store looks up the name of each peer it connects to (for its log lines): a resolver
# that does not answer stalls every rank that long at start-up
SLOW_LOOKUP_S = 0.5


def reverse_lookup_seconds(addresses: list[str]) -> dict[str, float]:
    """How long this node's resolver takes to name each address (as torch's getnameinfo does),
    answered or not; the lookups run at once, so this takes the slowest one's time."""
    from concurrent.futures import ThreadPoolExecutor

    def timed(address: str) -> float:
        t0 = time.perf_counter()
        try:
            socket.getnameinfo((address, 0), socket.NI_NUMERICSERV)
        except OSError:           # no name (or no answer): what matters is how long it took to say so
            pass
        return time.perf_counter() - t0

    unique = sorted(set(addresses))
    with ThreadPoolExecutor(max_workers=max(1, len(unique))) as pool:
        return dict(zip(unique, pool.map(timed, unique)))


def slow_lookups(seconds: dict[str, float]) -> list[str]:
    """env check's problems for the lookups that took SLOW_LOOKUP_S or more."""
    return [f"naming {address} (a reverse DNS lookup) took {s:.1f} s. torch looks up the name of each "
            "peer as it connects, so every rank waits that long at start-up: give this node a name server that "
            "answers for the cluster's addresses, or list them in /etc/hosts"
            for address, s in sorted(seconds.items()) if s >= SLOW_LOOKUP_S]


def interface_of(ip: str) -> str | None:
    """The name of the network interface that holds `ip` on this node, or None."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)):
            return name
    return None


def bind_collectives_to(ip: str, backend: str) -> dict[str, str]:
    """Point gloo (and NCCL) at the interface of `ip`, unless the user chose one; returns what
    was set. Without it gloo binds to whatever the hostname resolves to (often 127.0.1.1)."""
    iface = interface_of(ip)
    if iface is None:
        raise ValueError(f"{ip} is not an address of this node ({socket.gethostname()}): set SHARDLM_HOST_IP "
                         "on this node to one of its own addresses (see `shardlm env check`).")
    chosen = {}
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if backend == "nccl" else ("GLOO_SOCKET_IFNAME",):
        if var not in os.environ:
            os.environ[var] = chosen[var] = iface
    return chosen
