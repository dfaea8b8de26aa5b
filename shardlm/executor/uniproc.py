"""The executor for one rank in the engine core's own process."""

from __future__ import annotations

from shardlm.executor.base import Executor
from shardlm.messages import ModelRunnerOutput, SchedulerOutput
from shardlm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config):
        super().__init__(config)
        # data parallel: this replica's one rank joins the others at the DP client's store
        self.worker = Worker(config, rank=0, rendezvous=config.parallel.data_parallel_master)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method, args=()):
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def _shutdown(self) -> None:
        self.worker.shutdown()
