"""The executor: how the engine core reaches its workers, wherever they run."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from shardlm.config import EngineConfig
from shardlm.engine.messages import ModelRunnerOutput, SchedulerOutput
from shardlm.logger import init_logger

logger = init_logger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker process is gone (or failed); the engine cannot continue."""


class Executor(ABC):
    def __init__(self, config: EngineConfig):
        self.config = config

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
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

    def check_health(self) -> None:
        """Raise WorkerDiedError if a worker is gone."""

    def sentinels(self) -> list:
        """Handles that become ready when a worker dies (for multiprocessing.connection.wait)."""
        return []

    def shutdown(self) -> None:
        pass

    @property
    def max_concurrent_batches(self) -> int:
        """Batches in flight: one per pipeline stage when the ranks run elsewhere."""
        return self.config.parallel.pipeline_parallel_size if self.runs_async else 1

    @property
    def runs_async(self) -> bool:
        """True when submitted steps run elsewhere while the engine core goes on."""
        return False


def get_executor_class(config: EngineConfig) -> type[Executor]:
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":
        from shardlm.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor
    if backend == "ray":
        from shardlm.executor.selection import require_ray
        require_ray()
        from shardlm.executor.ray_executor import RayExecutor
        return RayExecutor
    from shardlm.executor.uniproc import UniProcExecutor
    return UniProcExecutor
