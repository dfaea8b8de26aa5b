"""Data parallel across nodes, headless: replicas on other nodes join the API server's node.

    head: shardlm serve MODEL -dp 4 --data-parallel-size-local 2
              --data-parallel-address 10.0.0.1 --data-parallel-rpc-port 13345
    node: shardlm serve MODEL -dp 4 --data-parallel-size-local 2 --data-parallel-start-rank 2
              --data-parallel-address 10.0.0.1 --data-parallel-rpc-port 13345 --headless

The head's client (core_client.MPClient) listens on ADDRESS:RPC_PORT (that address only). Each
engine-core process of a headless node connects there and says which replica it is and what it
runs (JoinRequest); the head compares that with its own and answers with the address of the
rendezvous store every rank joins (JoinAccepted), or why not (JoinRefused). From then on the
socket carries the same msgspec messages as the pipes of a local engine core (never pickle):
requests in, outputs out. The socket closing is the other side's death.
"""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing.connection import Connection

import msgspec

from shardlm.config import EngineConfig
from shardlm.logger import init_logger
from shardlm.messages import JoinAccepted, JoinRefused, JoinRequest

logger = init_logger(__name__)

_join_decoder = msgspec.msgpack.Decoder(JoinRequest)
_reply_decoder = msgspec.msgpack.Decoder(JoinAccepted | JoinRefused)
_encode = msgspec.msgpack.Encoder().encode


def fingerprint(config: EngineConfig) -> dict[str, str]:
    """What every replica must agree on to serve as one model."""
    import torch

    from shardlm.version import __version__
    m, par, c = config.model, config.parallel, config.cache
    return {"shardlm": __version__, "torch": torch.__version__.split("+")[0],
            "architecture": m.architecture, "layers": str(m.num_layers), "vocab": str(m.vocab_size),
            "dtype": str(m.dtype).replace("torch.", ""), "max_model_len": str(m.max_model_len),
            "block_size": str(c.block_size), "kv_block_tokens": str(config.kv_block_tokens),
            "tensor_parallel_size": str(par.tensor_parallel_size),
            "pipeline_parallel_size": str(par.pipeline_parallel_size),
            "data_parallel_size": str(par.data_parallel_size), "device": config.device.type,
            "data_parallel_hybrid_lb": str(par.data_parallel_hybrid_lb)}


def node_name() -> str:
    from shardlm.distributed.network import host_ip
    return f"{host_ip()} ({socket.gethostname()})"


# ---- head side ----
class JoinListener:
    """The head's door for remote replicas: a listening socket on ADDRESS:RPC_PORT."""

    def __init__(self, host: str, port: int):
        try:
            self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as e:
            raise ValueError(f"Cannot listen on --data-parallel-address {host} --data-parallel-rpc-port {port} "
                             f"({e.strerror}): give an address of this node and a free port.") from None

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()[:2]

    def accept_replicas(self, expected: list[int], ours: dict[str, str], store: tuple[str, int],
                        timeout_s: float) -> dict[int, Connection]:
        """Wait for a connection from each replica in `expected`; check and welcome each. Raises
        naming the replicas that did not join in time."""
        joined: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout_s
        while len(joined) < len(expected):
            left = deadline - time.monotonic()
            if left <= 0:
                for conn in joined.values():
                    conn.close()
                missing = [r for r in expected if r not in joined]
                raise TimeoutError(
                    f"Data parallel replica(s) {', '.join(map(str, missing))} did not join within {timeout_s:.0f} s. "
                    f"Start them on their nodes with `shardlm serve MODEL ... --headless` (the same -dp, "
                    f"--data-parallel-address {store[0]} --data-parallel-rpc-port {self.sock.getsockname()[1]}, "
                    "their --data-parallel-start-rank and --data-parallel-size-local), check that those nodes "
                    "reach this address, or raise --distributed-init-timeout.")
            arrived = self.next_join(min(left, 1.0))
            if arrived is None:
                continue
            conn, join = arrived
            problem = join_problem(join, expected, joined, ours)
            if problem:
                refuse(conn, problem)
                raise RuntimeError(f"Data parallel replica {join.dp_rank} from node {join.node} cannot join: "
                                   f"{problem}")
            conn.send_bytes(_encode(JoinAccepted(*store)))
            joined[join.dp_rank] = conn
            logger.info("Data parallel replica %d joined from node %s", join.dp_rank, join.node)
        return joined

    def next_join(self, timeout_s: float) -> tuple[Connection, JoinRequest] | None:
        """The next replica that connects and says who it is, within timeout_s (None: none did).
        A connection that is not a replica is logged and closed."""
        self.sock.settimeout(timeout_s)
        try:
            client, peer = self.sock.accept()
        except (TimeoutError, OSError):
            return None
        client.settimeout(None)
        conn = Connection(client.detach())
        try:
            if not conn.poll(30.0):
                raise ValueError("it sent nothing")
            return conn, _join_decoder.decode(conn.recv_bytes(1 << 16))
        except (ValueError, EOFError, OSError, msgspec.DecodeError) as e:
            logger.warning("A connection from %s to the data parallel port is not a replica (%s); closed.",
                           peer[0], e)
            conn.close()
            return None

    def close(self) -> None:
        self.sock.close()


def refuse(conn: Connection, why: str) -> None:
    try:
        conn.send_bytes(_encode(JoinRefused(why)))
    except OSError:
        pass
    conn.close()


class RejoinDoor:
    """After start-up the head's port stays open for replicas of other nodes that start again (a
    headless node's `shardlm serve --headless` restarts its dead engine cores; the head recreates
    a Ray actor). One thread accepts them and parks each until the head's restart of that replica
    takes it (wait), at most PARK_S seconds. A replica joining again runs in a world of its own:
    the others' DP groups still count its old ranks, which no collective of independent replicas uses."""

    PARK_S = 60.0

    def __init__(self, listener: JoinListener, ranks: list[int], ours: dict[str, str]):
        self.listener, self.ranks, self.ours = listener, ranks, ours
        self._parked: dict[int, tuple[Connection, str, float]] = {}    # rank -> (conn, node, arrival)
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="shardlm-dp-rejoin", daemon=True)
        self._thread.start()

    def wait(self, rank: int, timeout_s: float) -> Connection:
        """Replica `rank`'s new connection, welcomed into a world of its own; TimeoutError when it
        did not join again within timeout_s."""
        with self._cond:
            if not self._cond.wait_for(lambda: rank in self._parked or self._closed, timeout_s) or self._closed:
                raise TimeoutError(f"it did not join the head again within {timeout_s:.0f} s (its node restarts it: "
                                   "`shardlm serve ... --headless` there supervises its replicas; if that node is "
                                   "gone, start it again with the same flags)")
            conn, node, _ = self._parked.pop(rank)
        conn.send_bytes(_encode(JoinAccepted("", 0, own_world=True)))
        logger.info("Data parallel replica %d joined again from node %s", rank, node)
        return conn

    def _accept(self) -> None:
        while not self._closed:
            arrived = self.listener.next_join(1.0)
            with self._cond:
                now = time.monotonic()
                for rank, (conn, _, t) in list(self._parked.items()):
                    if now - t > self.PARK_S:
                        del self._parked[rank]
                        refuse(conn, f"the head does not wait for replica {rank} (it serves, or its restarts "
                                     "ran out: --max-replica-restarts)")
                if arrived is None:
                    continue
                conn, join = arrived
                problem = join_problem(join, self.ranks, {}, self.ours)
                if problem:
                    refuse(conn, problem)
                    continue
                if join.dp_rank in self._parked:          # an older try of the same replica
                    refuse(self._parked[join.dp_rank][0], "a newer connection of this replica came")
                self._parked[join.dp_rank] = (conn, join.node, now)
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for conn, _, _ in self._parked.values():
                conn.close()            # no answer: a replica tries again (the engine may be starting again)
            self._parked.clear()
            self._cond.notify_all()
        self._thread.join(2.0)
        self.listener.close()


def join_problem(join: JoinRequest, expected: list[int], joined, ours: dict[str, str]) -> str | None:
    """Why the head cannot take `join` (its replicas from join.dp_rank on), or None."""
    ranks = join.ranks
    if join.replicas < 1 or any(r not in expected for r in ranks):
        return (f"replica(s) {replica_span(ranks)} are not ones this head waits for ({', '.join(map(str, expected))}): "
                "check --data-parallel-start-rank and --data-parallel-size-local on that node")
    if any(r in joined for r in ranks):
        return (f"replica(s) {replica_span(ranks)} have already joined (two nodes with the same "
                "--data-parallel-start-rank?)")
    differs = [f"{k} {join.fingerprint.get(k)} there, {v} here" for k, v in ours.items()
               if join.fingerprint.get(k) != v]
    if differs:
        return "it runs something else: " + "; ".join(differs) + " (start every node with the same model and flags)"
    return None


def replica_span(ranks: range) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


# ---- headless node side ----
def join_head(config: EngineConfig, timeout_s: float, replicas: int = 1) -> tuple[Connection, tuple[str, int] | None]:
    """Connect to the head (retrying until it listens), say who we are (replica
    data_parallel_rank, or `replicas` of them from there on); returns the connection and the
    rendezvous store's address (None: a replica joining again, in a world of its own)."""
    par = config.parallel
    address = (par.data_parallel_address, par.data_parallel_rpc_port)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=5)
            sock.settimeout(None)
            conn = Connection(sock.detach())
            conn.send_bytes(_encode(JoinRequest(par.data_parallel_rank, node_name(), fingerprint(config), replicas)))
            if not conn.poll(max(1.0, deadline - time.monotonic())):
                reply = None
                break
            reply = _reply_decoder.decode(conn.recv_bytes())
            break
        except (OSError, EOFError) as e:    # not listening yet, or closed before answering (restarting)
            if time.monotonic() > deadline:
                raise TimeoutError(f"Cannot reach the head at {address[0]}:{address[1]} (--data-parallel-address/"
                                   f"--data-parallel-rpc-port) within {timeout_s:.0f} s: "
                                   f"{getattr(e, 'strerror', None) or e or 'it closed the connection'}. Start the "
                                   "head first, and check the address from this node.") from None
            time.sleep(0.5)
    if reply is None:
        conn.close()
        raise TimeoutError(f"The head at {address[0]}:{address[1]} did not answer within {timeout_s:.0f} s.")
    if isinstance(reply, JoinRefused):
        raise RuntimeError(f"The head refused data parallel replica {par.data_parallel_rank}: {reply.reason}")
    return conn, None if reply.own_world else (reply.store_host, reply.store_port)
