"""Expert parallel replicas behind several API servers (vLLM's hybrid and external load balancing).

    node 0: shardlm serve MODEL -dp 4 --data-parallel-size-local 2 --data-parallel-hybrid-lb
                --enable-expert-parallel --data-parallel-address 10.0.0.1 --data-parallel-rpc-port 13345
    node 1: the same with --data-parallel-start-rank 2
    (external: a server a replica, `--data-parallel-rank R`: one local replica from R)

Each server balances its own requests over its own replicas; a load balancer in front spreads
them over the servers. Replicas of a dense model never meet, so such a server runs its replicas
on their own (engine/arg_utils.py). Expert parallel replicas run their MoE layers in lock-step
(core/wave.py), so their servers are tied: the server of replica 0, the head, listens on
ADDRESS:RPC_PORT; each other server connects there, says which replicas it runs and what model
(a JoinRequest, checked as a headless node's: dp_remote.py) and gets the address of the store
where every replica's ranks meet. The connection then carries the waves: a wave that one
server's replica starts reaches every other server's replicas through the head (StartWave).

A world (one store, every server's replicas) lasts until one of its replicas or servers dies:
the head then closes every connection, and each server's engine ends, to start again within
--max-engine-restarts (the head with a new store, the others joining it again).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec

from shardlm.config import EngineConfig
from shardlm.distributed.network import host_ip
from shardlm.distributed.parallel_state import host_store
from shardlm.engine.dp_remote import JoinListener, fingerprint, join_head, join_problem, refuse, replica_span
from shardlm.logger import init_logger
from shardlm.messages import JoinAccepted, JoinRequest, StartWave

logger = init_logger(__name__)

_encode = msgspec.msgpack.Encoder().encode
_wave_decoder = msgspec.msgpack.Decoder(StartWave)

OnWave = Callable[[int], None]           # another server's replica started wave n
OnLost = Callable[[str], None]           # the world broke: why


def front_ends_of(config: EngineConfig) -> FrontEnds | None:
    """The link to the other servers of this deployment, for a server of expert parallel replicas
    under hybrid or external load balancing; None otherwise."""
    par = config.parallel
    if not (par.data_parallel_hybrid_lb and config.dp_lockstep):
        return None
    return HeadFrontEnd(config) if par.data_parallel_start_rank == 0 else PeerFrontEnd(config)


class _Link:
    """A connection to another server, in one world; its reader thread hands waves on."""

    def __init__(self, conn: Connection, ranks: range, node: str, world: int):
        self.conn, self.ranks, self.node, self.world = conn, ranks, node, world
        self.send_lock = threading.Lock()
        self.gone = threading.Event()        # its reader saw it close, and said so

    def send(self, number: int) -> None:
        try:
            with self.send_lock:
                self.conn.send_bytes(_encode(StartWave(number)))
        except (OSError, TypeError):
            pass                # closed: its reader reports the loss

    def read(self, on_wave: OnWave, on_eof: Callable[[_Link], None]) -> None:
        threading.Thread(target=self._read, args=(on_wave, on_eof), name="shardlm-dp-front-end",
                         daemon=True).start()

    def _read(self, on_wave: OnWave, on_eof: Callable[[_Link], None]) -> None:
        try:
            while True:
                on_wave(_wave_decoder.decode(self.conn.recv_bytes()).number)
        except (EOFError, OSError, TypeError, msgspec.DecodeError):    # (TypeError: closed here meanwhile)
            on_eof(self)
            self.gone.set()

    def close(self) -> None:
        """Close it for both sides: shut down first, as a close alone neither wakes this side's
        reader (blocked in recv) nor tells the other side while that read holds the socket."""
        try:
            with socket.fromfd(self.conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass                # closed already
        self.conn.close()


class FrontEnds:
    """This server's side of the link between the servers of one deployment. on_lost(reason): the
    world broke (set by the client). Waves go to the cores of the world joined last, from when
    they are ready (serve_waves); one that comes earlier waits for them."""

    node_address: str        # the address this server's replicas bind their collectives to

    def __init__(self):
        self.on_lost: OnLost = lambda reason: None
        self._deliver: OnWave | None = None
        self._pending: int | None = None
        self._wave_lock = threading.Lock()

    def new_world(self) -> tuple[str, int]:
        """Leave the world there was (if any) and join the next: the store its ranks meet at."""
        raise NotImplementedError

    def serve_waves(self, deliver: OnWave) -> None:
        """The new world's cores are ready: waves started elsewhere go to deliver(number)."""
        with self._wave_lock:
            self._deliver, pending, self._pending = deliver, self._pending, None
            if pending is not None:
                deliver(pending)

    def _wave_arrived(self, number: int) -> None:
        with self._wave_lock:
            if self._deliver is None:
                self._pending = number if self._pending is None else max(self._pending, number)
            else:
                self._deliver(number)

    def _leave_world(self) -> None:
        with self._wave_lock:
            self._deliver = self._pending = None

    def send_wave(self, number: int) -> None:
        """One of this server's replicas started wave `number`: the others' replicas join it."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class HeadFrontEnd(FrontEnds):
    """The server of replica 0: it hosts each world's store and relays the waves."""

    REJOIN_S = 1.0        # how long a join waits for the connection of the same replicas to close

    def __init__(self, config: EngineConfig):
        super().__init__()
        par = config.parallel
        self.config, self.host = config, par.data_parallel_address
        self.node_address = self.host
        self.ours = fingerprint(config)
        self.others = [r for r in range(par.data_parallel_size) if r not in par.local_dp_ranks]
        self.listener = JoinListener(self.host, par.data_parallel_rpc_port)
        self._lock = threading.Lock()
        self._world = 0                       # the world's number; 0: none yet
        self._store = None                    # its store (None: between worlds)
        self._links: list[_Link] = []         # the other servers in this world
        self._parked: list[tuple[Connection, JoinRequest]] = []   # joins waiting for the next world
        self._closed = False
        threading.Thread(target=self._accept, name="shardlm-dp-head", daemon=True).start()

    def new_world(self) -> tuple[str, int]:
        par = self.config.parallel
        self._leave_world()
        with self._lock:
            self._world += 1
            for link in self._links:
                link.close()              # the others' engines end, and join the new world
            self._links = []
            self._store = host_store(self.host, par.world_size_across_dp, par.distributed_init_timeout)
            parked, self._parked = self._parked, []
            for conn, join in parked:
                self._welcome(conn, join)
            return self.host, self._store.port

    def send_wave(self, number: int, but: _Link | None = None) -> None:
        with self._lock:
            links = [link for link in self._links if link is not but]
        for link in links:
            link.send(number)

    def _accept(self) -> None:
        while not self._closed:
            arrived = self.listener.next_join(1.0)
            if arrived is None:
                continue
            conn, join = arrived
            with self._lock:
                holders = [link for link in self._links if set(link.ranks) & set(join.ranks)]
            for link in holders:     # a server that starts again closed its old connection before joining
                link.gone.wait(self.REJOIN_S)
            with self._lock:
                taken = [r for link in self._links for r in link.ranks]
                taken += [r for _, parked in self._parked for r in parked.ranks]
                problem = join_problem(join, self.others, taken, self.ours)
                if problem:
                    refuse(conn, problem)
                elif self._store is None:
                    self._parked.append((conn, join))       # answered with the next world's store
                else:
                    self._welcome(conn, join)

    def _welcome(self, conn: Connection, join: JoinRequest) -> None:
        conn.send_bytes(_encode(JoinAccepted(self.host, self._store.port)))
        link = _Link(conn, join.ranks, join.node, self._world)
        self._links.append(link)
        logger.info("The server of data parallel replica(s) %s joined from node %s", replica_span(link.ranks),
                    join.node)
        link.read(lambda n: self._relay(n, link), self._lost)

    def _relay(self, number: int, source: _Link) -> None:
        self._wave_arrived(number)
        self.send_wave(number, but=source)

    def _lost(self, link: _Link) -> None:
        with self._lock:
            if link.world != self._world or link not in self._links or self._closed:
                return            # a world already left
            self._break(link, f"The server of data parallel replica(s) {replica_span(link.ranks)} on {link.node} went "
                              "away.")

    def _break(self, link: _Link, reason: str) -> None:
        """(Holding the lock.) The world cannot step on without `link`'s replicas."""
        self._links.remove(link)
        link.close()
        self._store = None
        threading.Thread(target=self.on_lost, args=(f"{reason} Expert parallel replicas run every step together, "
                                                    "so this server's cannot go on without them.",),
                         daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for link in self._links:
                link.close()
            for conn, _ in self._parked:
                conn.close()
            self._links, self._parked, self._store = [], [], None
        self.listener.close()


class PeerFrontEnd(FrontEnds):
    """A server of replicas other than 0: it joins the head's world, and joins again after a restart."""

    def __init__(self, config: EngineConfig):
        super().__init__()
        par = config.parallel
        self.config = config
        self.head = f"{par.data_parallel_address}:{par.data_parallel_rpc_port}"
        loopback = par.data_parallel_address in ("127.0.0.1", "localhost", "::1")
        self.node_address = "127.0.0.1" if loopback else host_ip()
        self._link: _Link | None = None
        self._closed = False

    def new_world(self) -> tuple[str, int]:
        par = self.config.parallel
        self._leave_world()
        old, self._link = self._link, None
        if old is not None:
            old.close()
        first = dataclasses.replace(self.config, parallel=dataclasses.replace(
            par, data_parallel_rank=par.data_parallel_start_rank))
        conn, store = join_head(first, par.distributed_init_timeout, replicas=par.data_parallel_size_local)
        self._link = _Link(conn, par.local_dp_ranks, self.head, 0)
        self._link.read(self._wave_arrived, self._lost)
        return store

    def send_wave(self, number: int) -> None:
        if self._link is not None:
            self._link.send(number)

    def _lost(self, link: _Link) -> None:
        if link is self._link and not self._closed:
            self._link = None
            self.on_lost(f"The head server (of data parallel replica 0, {self.head}) left the world this server's "
                         "replicas stepped in: it stopped, or its replicas started again. Expert parallel replicas "
                         "run every step together, so this server's cannot go on without them.")

    def close(self) -> None:
        self._closed = True
        if self._link is not None:
            self._link.close()
