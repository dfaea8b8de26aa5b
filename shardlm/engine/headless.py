"""A headless node (`shardlm serve MODEL ... --headless`): this node's data parallel replicas,
each an engine-core process that joins the head over TCP (dp_remote.py), supervised.

A replica that dies (its process killed, one of its workers gone, a step that raised) starts
again and joins the head again, which takes it back in a world of its own (dp_remote.RejoinDoor),
within --max-replica-restarts an hour with restarts.py's back-off; past that it stays dead. One
that ends because the head shut it down or went away, or that could not join, is not started
again; the node exits once none is left (0, or 1 if one failed).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from multiprocessing.connection import wait

from shardlm.config import EngineConfig
from shardlm.engine.dp import replica_configs
from shardlm.engine.dp_remote import join_head
from shardlm.engine.restarts import RestartBudget
from shardlm.logger import init_logger
from shardlm.processes import InParentEnvironment, clean_process_context

logger = init_logger(__name__)

EXIT_ENDED = 0          # shut down by the head, or the head went away
EXIT_FAILED = 1         # a fault while serving: started again
EXIT_NOT_JOINED = 3     # the head could not be reached or refused it: not started again
EXIT_NOT_STARTED = 4    # it could not start (the head has the error): not started again
EXIT_RESTART = 5        # the head starts the whole engine again: started again at once


def run_remote_engine_core(config: EngineConfig) -> int:
    """A replica on another node than the head's (a headless node's process, a Ray actor): join
    the head, then serve it over the socket. -> one of the EXIT_ codes."""
    from shardlm.distributed.network import host_ip
    from shardlm.engine.core_process import ENDED, NOT_STARTED, RESTART, run_engine_core
    try:
        conn, store = join_head(config, config.parallel.distributed_init_timeout)
    except (TimeoutError, RuntimeError) as e:
        logger.error("Data parallel replica %d: %s", config.parallel.data_parallel_rank, e)
        return EXIT_NOT_JOINED
    par = dataclasses.replace(config.parallel, data_parallel_master=store, data_parallel_own_world=store is None)
    # the DP groups cross nodes: the collectives bind to this node's address
    how = run_engine_core(dataclasses.replace(config, parallel=par), conn, conn, node_address=host_ip())
    return {ENDED: EXIT_ENDED, RESTART: EXIT_RESTART, NOT_STARTED: EXIT_NOT_STARTED}.get(how, EXIT_FAILED)


def _engine_core_process(config: EngineConfig) -> None:
    sys.exit(run_remote_engine_core(config))


class HeadlessNode:
    """This node's replicas, each started again when it dies (within its budget)."""

    def __init__(self, config: EngineConfig, max_replica_restarts: int):
        self.replicas = replica_configs(config, None)
        self.budgets = [RestartBudget(max_replica_restarts) for _ in self.replicas]
        self.max_restarts = max_replica_restarts
        self._ctx = clean_process_context()
        self.procs = [self._start(k) for k in range(len(self.replicas))]
        self.due: dict[int, float] = {}          # replica index -> when it starts again
        self.stopping = self.failed = False

    def _start(self, k: int):
        proc = self._ctx.Process(target=InParentEnvironment(_engine_core_process), args=(self.replicas[k],),
                                 name=f"shardlm-engine-core-{k}")
        proc.start()
        return proc

    def rank(self, k: int) -> int:
        return self.replicas[k].parallel.data_parallel_rank

    def run(self) -> int:
        """Until every replica has ended for good. -> the node's exit code."""
        while not self.stopping and (self.due or any(p is not None for p in self.procs)):
            running = [p.sentinel for p in self.procs if p is not None]
            timeout = max(0.0, min(self.due.values()) - time.monotonic()) if self.due else None
            if running:
                wait(running, timeout)
            else:
                time.sleep(timeout)
            for k, proc in enumerate(self.procs):
                if proc is not None and not proc.is_alive() and not self.stopping:
                    self.procs[k] = None
                    self._ended(k, proc.exitcode)
            for k, when in list(self.due.items()):
                if when <= time.monotonic() and not self.stopping:
                    del self.due[k]
                    self.procs[k] = self._start(k)
        self.stop()
        return 1 if self.failed else 0

    def _ended(self, k: int, exitcode: int) -> None:
        if exitcode == EXIT_ENDED:
            logger.info("Data parallel replica %d ended (the head shut it down or went away).", self.rank(k))
            return
        if exitcode in (EXIT_NOT_JOINED, EXIT_NOT_STARTED):     # why was logged by the replica
            self.failed = True
            return
        if exitcode == EXIT_RESTART:          # the head counts the engine's restarts
            logger.info("Data parallel replica %d: the head starts the engine again; so does this node.",
                        self.rank(k))
            self.due[k] = time.monotonic()
            return
        how = (f"was killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else
               f"stopped on a fault (exit code {exitcode})")
        delay = self.budgets[k].next_delay()
        if delay is None:
            self.failed = True
            logger.error("Data parallel replica %d %s. Not started again: %d restart(s) in the last hour is the "
                         "limit (--max-replica-restarts).", self.rank(k), how, self.max_restarts)
            return
        logger.warning("Data parallel replica %d %s. Starting it again in %.0f s; it joins the head again.",
                       self.rank(k), how, delay)
        self.budgets[k].spend()
        self.due[k] = time.monotonic() + delay

    def stop(self, *_) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc is not None and proc.is_alive():
                proc.kill()           # it ignores SIGTERM (leave_stop_signals_to_the_parent)
        for proc in self.procs:
            if proc is not None:
                proc.join()


def run_headless(config: EngineConfig, max_replica_restarts: int) -> int:
    """`shardlm serve ... --headless`: returns when this node's replicas have all ended."""
    par = config.parallel
    node = HeadlessNode(config, max_replica_restarts)
    logger.info("Headless: started data parallel replica(s) %s, joining the head at %s:%d",
                ", ".join(str(c.parallel.data_parallel_rank) for c in node.replicas),
                par.data_parallel_address, par.data_parallel_rpc_port)
    signal.signal(signal.SIGTERM, node.stop)
    signal.signal(signal.SIGINT, node.stop)
    return node.run()
