"""Starting dead engine cores again (the server's --max-engine-restarts and
--max-replica-restarts): when, how often, and how long to wait before each try. What becomes of
their requests, and how new cores are taken in, is the client's (core_client.MPClient).

A unit that dies again and again (a bad GPU, a model that crashes on some input) must not spin:
each restart inside the window waits twice as long as the one before (0 s for the first, then 1,
2, 4 ... s, at most MAX_DELAY_S), and past the limit the unit stays dead (a replica) or the
server exits non-zero (the engine), as it would without restarts. Restarts older than the window
no longer count, so a server that loses a process once a day never runs out.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from shardlm.logger import init_logger
from shardlm.messages import Shutdown

if TYPE_CHECKING:
    from shardlm.engine.core_client import MPClient

logger = init_logger(__name__)

WINDOW_S = 3600.0
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
DEFAULT_MAX_RESTARTS = 3        # per hour: a few crashes come back, a crash loop stops


@dataclass
class RestartPolicy:
    """max_engine_restarts: the whole engine (a one-replica server, or expert parallel replicas,
    which step together); max_replica_restarts: each data parallel replica on its own."""
    max_engine_restarts: int = DEFAULT_MAX_RESTARTS
    max_replica_restarts: int = DEFAULT_MAX_RESTARTS
    window_s: float = WINDOW_S


@dataclass
class RestartBudget:
    """The restarts of one unit within the last window_s seconds."""
    limit: int
    window_s: float = WINDOW_S
    times: list[float] = field(default_factory=list)
    total: int = 0                   # restarts ever (the /metrics counter)

    def next_delay(self, now: float | None = None) -> float | None:
        """Seconds to wait before the next restart, or None when the limit is reached."""
        now = time.monotonic() if now is None else now
        self.times = [t for t in self.times if now - t < self.window_s]
        if len(self.times) >= self.limit:
            return None
        return 0.0 if not self.times else min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (len(self.times) - 1))

    def spend(self, now: float | None = None) -> None:
        self.times.append(time.monotonic() if now is None else now)
        self.total += 1


class Restarter:
    """Starts an MPClient's dead cores again: the whole engine when it has one replica or its
    replicas step together (DP + EP lock-step), else the dead replica alone while the others
    serve. Reader threads report deaths; each restart runs on a thread of its own."""

    def __init__(self, client: MPClient, policy: RestartPolicy):
        self.client, self.policy = client, policy
        self.engine_budget = RestartBudget(policy.max_engine_restarts, policy.window_s)
        self.replica_budgets = [RestartBudget(policy.max_replica_restarts, policy.window_s) for _ in client.cores]
        self._lock = threading.Lock()
        self._replicas_restarting: set[int] = set()

    def counts(self) -> dict[str, int]:
        """Restarts so far: of the whole engine ("engine") and of each replica (its DP rank)."""
        ranks = [core.config.parallel.data_parallel_rank for core in self.client.cores]
        return {"engine": self.engine_budget.total, **{str(r): b.total for r, b in zip(ranks, self.replica_budgets)}}

    def on_death(self, index: int, reason: str) -> None:
        client = self.client
        if client.cores[index].config.dp_lockstep or len(client.cores) == 1:
            self._engine_died(reason)
        else:
            self._replica_died(index, reason)

    # ---- the whole engine ----
    def _engine_died(self, reason: str) -> None:
        client = self.client
        with self._lock:
            if client.restarting or client.dead_reason:
                return            # another replica of the same engine reported first
            client.restarting = reason
        delay = self.engine_budget.next_delay()
        if delay is None:
            return self._give_up(reason, "--max-engine-restarts", self.policy.max_engine_restarts)
        client.hand_back_all(reason)
        logger.warning("%s Starting the engine again in %.0f s; requests that had no answer yet wait for it.",
                       reason, delay)
        threading.Thread(target=self._relaunch, args=(delay, reason), name="shardlm-engine-restart",
                         daemon=True).start()

    def _relaunch(self, delay: float, reason: str) -> None:
        client, t0, old = self.client, time.monotonic(), self.client.launched
        shutdown = msgspec.msgpack.encode(Shutdown(restart=True))     # (a headless node starts its cores again)
        while True:
            time.sleep(delay)
            old.stop(shutdown, timeout=1.0)
            if client.closing:
                return
            self.engine_budget.spend()
            try:
                launched = type(old)(client.config, client.front_ends)   # as the client began with
                break
            except Exception as e:           # it failed to start: counts as a restart
                reason = f"{reason} Starting it again failed: {e}"
                delay = self.engine_budget.next_delay()
                if delay is None:
                    return self._give_up(reason, "--max-engine-restarts", self.policy.max_engine_restarts)
        if client.closing:
            return launched.stop(shutdown, timeout=1.0)
        client.adopt(launched, reason)
        logger.info("The engine serves again, %.1f s after it died (restart %d in the last hour, at most %d).",
                    time.monotonic() - t0, len(self.engine_budget.times), self.policy.max_engine_restarts)

    # ---- one data parallel replica ----
    def _replica_died(self, index: int, reason: str) -> None:
        self.client.hand_back_replica(index, reason)
        delay = self.replica_budgets[index].next_delay()
        if delay is None:
            return self._give_up(reason, "--max-replica-restarts", self.policy.max_replica_restarts, index)
        self._replicas_restarting.add(index)
        logger.warning("%s Starting it again in %.0f s; the other replicas serve meanwhile.", reason, delay)
        threading.Thread(target=self._relaunch_replica, args=(index, delay, reason),
                         name=f"shardlm-replica-restart-{index}", daemon=True).start()

    def _relaunch_replica(self, index: int, delay: float, reason: str) -> None:
        client, t0, budget = self.client, time.monotonic(), self.replica_budgets[index]
        while True:
            time.sleep(delay)
            if client.closing:
                return
            budget.spend()
            try:
                core = client.launched.restart_replica(index)
                break
            except Exception as e:
                reason = f"{reason} Starting it again failed: {e}"
                delay = budget.next_delay()
                if delay is None:
                    return self._give_up(reason, "--max-replica-restarts", self.policy.max_replica_restarts, index)
        if client.closing:
            return core.shutdown(msgspec.msgpack.encode(Shutdown()), timeout=1.0)
        client.adopt_replica(index)
        self._replicas_restarting.discard(index)
        logger.info("%s serves again, %.1f s after it died (restart %d in the last hour, at most %d).",
                    core.name, time.monotonic() - t0, len(budget.times), self.policy.max_replica_restarts)

    def _give_up(self, reason: str, flag: str, limit: int, index: int | None = None) -> None:
        """Past the limit: the replica stays dead (while others serve or will), else the engine dies."""
        why = f"{reason} Not started again: {limit} restart(s) in the last hour is the limit ({flag})."
        if index is not None:
            logger.error("%s", why)
            self._replicas_restarting.discard(index)
            if len(self.client.balancer.dead) < len(self.client.cores) or self._replicas_restarting:
                return
            why = "Every data parallel replica has died; the last: " + why
        self.client.die(why)
