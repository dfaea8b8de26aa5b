"""How often a dead engine core may be started again (the server's --max-engine-restarts and
--max-replica-restarts), and how long to wait before each try.

A unit that dies again and again (a bad GPU, a model that crashes on some input) must not spin:
each restart inside the window waits twice as long as the one before (0 s for the first, then 1,
2, 4 ... s, at most MAX_DELAY_S), and past the limit the unit stays dead (a replica) or the
server exits non-zero (the engine), as it would without restarts. Restarts older than the window
no longer count, so a server that loses a process once a day never runs out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
