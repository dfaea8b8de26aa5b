"""The executor: how the engine core reaches its workers, wherever they run.

Subclasses say how to start ranks, send them a call and notice a death; this base keeps what
they share: the first failure on record (and WorkerDiedError from then on), the watcher
thread that notices deaths while the engine is idle, shutdown exactly once, at exit too.
"""

from __future__ import annotations

import atexit
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from shardlm.config import EngineConfig
from shardlm.logger import init_logger
from shardlm.messages import ModelRunnerOutput, SchedulerOutput

logger = init_logger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker process is gone (or failed); the engine cannot continue."""


class Executor(ABC):
    #: True when submitted steps run elsewhere while the engine core goes on
    runs_async: bool = False

    def __init__(self, config: EngineConfig):
        self.config = config
        self._failure: str | None = None
        self._stopping = False
        self._watcher: threading.Thread | None = None
        self._stepped = False

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Call `method` on every worker; one result per rank."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the output rank's result."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Start a step; returns a function that waits for its output. Outputs must be waited
        for in submission order. By default the step runs now."""
        output = self.execute_model(scheduler_output)
        return lambda: output

    def determine_num_blocks(self) -> int:
        """KV blocks every rank can hold: the minimum over ranks."""
        per_rank = self.collective_rpc("determine_num_blocks")
        if len(per_rank) > 1:
            logger.info("KV cache blocks per rank: %s; using the minimum, %d", per_rank, min(per_rank))
        return min(per_rank)

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    @property
    def max_concurrent_batches(self) -> int:
        """Batches in flight: one per pipeline stage when the ranks run elsewhere."""
        return self.config.parallel.pipeline_parallel_size if self.runs_async else 1

    def _step_timeout(self) -> float | None:
        """How long to wait for the step being submitted: no limit for the first (it warms up:
        allocations, kernels), --execute-model-timeout after it (a hung rank fails the engine)."""
        timeout = self.config.parallel.execute_model_timeout if self._stepped else None
        self._stepped = True
        return timeout

    # ---- failure: the first one is the one on record ----
    def record_failure(self, message: str) -> str:
        """Write down why the engine cannot go on (first failure wins), log it, and let the
        subclass stop the other ranks. Returns the message on record."""
        if self._failure is None:
            self._failure = message
            logger.error(message)
            self._on_failure()
        return self._failure

    def _on_failure(self) -> None:
        """Stop the other ranks and wake whoever waits on them (subclasses)."""

    def check_health(self) -> None:
        """Raise WorkerDiedError if a worker is gone."""
        if self._failure:
            raise WorkerDiedError(self._failure)

    def sentinels(self) -> list:
        """Handles that become ready when a worker dies (for multiprocessing.connection.wait)."""
        return []

    def _start_watcher(self, target: Callable[[], None], name: str) -> None:
        """A daemon thread that notices deaths while nothing waits on the workers."""
        self._watcher = threading.Thread(target=target, name=name, daemon=True)
        self._watcher.start()

    # ---- shutdown, exactly once ----
    def _shutdown_at_exit(self) -> None:
        """Before multiprocessing's own exit handler terminates daemonic workers under us."""
        atexit.register(self.shutdown)

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        self._shutdown()

    def _shutdown(self) -> None:
        """Stop the workers, join the watcher, release what they used (subclasses)."""
