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

import signal
import socket
import time
from multiprocessing.connection import Connection

import msgspec

from shardlm.config import EngineConfig
from shardlm.logger import init_logger
from shardlm.messages import JoinAccepted, JoinRefused, JoinRequest
from shardlm.processes import InParentEnvironment, clean_process_context

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
            "data_parallel_size": str(par.data_parallel_size), "device": config.device.type}


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
            self.sock.settimeout(min(left, 1.0))
            try:
                client, peer = self.sock.accept()
            except TimeoutError:
                continue
            client.settimeout(None)
            conn = Connection(client.detach())
            try:
                if not conn.poll(min(max(left, 1.0), 30.0)):
                    raise ValueError("it sent nothing")
                join = _join_decoder.decode(conn.recv_bytes(1 << 16))
            except (ValueError, EOFError, OSError, msgspec.DecodeError) as e:
                logger.warning("A connection from %s to the data parallel port is not a replica (%s); closed.",
                               peer[0], e)
                conn.close()
                continue
            problem = _join_problem(join, expected, joined, ours)
            if problem:
                conn.send_bytes(_encode(JoinRefused(problem)))
                conn.close()
                raise RuntimeError(f"Data parallel replica {join.dp_rank} from node {join.node} cannot join: "
                                   f"{problem}")
            conn.send_bytes(_encode(JoinAccepted(*store)))
            joined[join.dp_rank] = conn
            logger.info("Data parallel replica %d joined from node %s", join.dp_rank, join.node)
        return joined

    def close(self) -> None:
        self.sock.close()


def _join_problem(join: JoinRequest, expected: list[int], joined: dict, ours: dict[str, str]) -> str | None:
    if join.dp_rank not in expected:
        return (f"replica {join.dp_rank} is not one this head waits for ({', '.join(map(str, expected))}): "
                "check --data-parallel-start-rank and --data-parallel-size-local on that node")
    if join.dp_rank in joined:
        return f"replica {join.dp_rank} has already joined (two nodes with the same --data-parallel-start-rank?)"
    differs = [f"{k} {join.fingerprint.get(k)} there, {v} here" for k, v in ours.items()
               if join.fingerprint.get(k) != v]
    if differs:
        return "it runs something else: " + "; ".join(differs) + " (start every node with the same model and flags)"
    return None


# ---- headless node side ----
def join_head(config: EngineConfig, timeout_s: float) -> tuple[Connection, tuple[str, int]]:
    """Connect to the head (retrying until it listens), say who we are; returns the connection
    and the rendezvous store's address."""
    par = config.parallel
    address = (par.data_parallel_address, par.data_parallel_rpc_port)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=5)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Cannot reach the head at {address[0]}:{address[1]} (--data-parallel-address/"
                                   f"--data-parallel-rpc-port) within {timeout_s:.0f} s: {e.strerror or e}. Start "
                                   "the head first, and check the address from this node.") from None
            time.sleep(0.5)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    conn.send_bytes(_encode(JoinRequest(par.data_parallel_rank, node_name(), fingerprint(config))))
    if not conn.poll(timeout_s):
        raise TimeoutError(f"The head at {address[0]}:{address[1]} did not answer within {timeout_s:.0f} s.")
    reply = _reply_decoder.decode(conn.recv_bytes())
    if isinstance(reply, JoinRefused):
        raise RuntimeError(f"The head refused data parallel replica {par.data_parallel_rank}: {reply.reason}")
    return conn, (reply.store_host, reply.store_port)


def run_remote_engine_core(config: EngineConfig) -> None:
    """A headless node's engine-core process: join the head, then serve it over the socket."""
    import dataclasses

    from shardlm.distributed.network import host_ip
    from shardlm.engine.core_process import run_engine_core
    conn, store = join_head(config, config.parallel.distributed_init_timeout)
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_master=store))
    run_engine_core(config, conn, conn, node_address=host_ip())     # the DP groups cross nodes


def run_headless(config: EngineConfig) -> int:
    """`shardlm serve ... --headless`: this node's replicas, each an engine-core process joined to
    the head; returns when they have all ended (the head shut them down, or they failed)."""
    from shardlm.engine.dp import replica_configs
    par = config.parallel
    ctx = clean_process_context()
    replicas = replica_configs(config, None)
    procs = [ctx.Process(target=InParentEnvironment(run_remote_engine_core), args=(c,), name=f"shardlm-engine-core-{k}")
             for k, c in enumerate(replicas)]
    logger.info("Headless: starting data parallel replica(s) %s, joining the head at %s:%d",
                ", ".join(str(c.parallel.data_parallel_rank) for c in replicas),
                par.data_parallel_address, par.data_parallel_rpc_port)
    for p in procs:
        p.start()

    def stop(*_):
        for p in procs:
            if p.is_alive():
                p.terminate()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    failed = 0
    for p in procs:
        p.join()
        failed |= p.exitcode != 0
    stop()
    return 1 if failed else 0
