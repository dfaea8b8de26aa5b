"""The executor: how the engine core reaches its workers, wherever they run."""

from __future__ import annotations

from abc import ABC, abstractmethod

from shardlm.config import EngineConfig
from shardlm.engine.messages import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig):
        self.config = config

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """Call `method` on every worker; one result per rank."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the output rank's result."""

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None:
        pass

    @property
    def max_concurrent_batches(self) -> int:
        return 1


def get_executor_class(config: EngineConfig) -> type[Executor]:
    from shardlm.executor.uniproc import UniProcExecutor
    return UniProcExecutor
