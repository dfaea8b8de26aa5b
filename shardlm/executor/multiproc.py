"""The executor for ranks on this node: one process per rank.

Start-up: workers are forked when that is safe (this process runs one thread and has no CUDA
context), as vLLM does on CPU, so scripts written without an `if __name__ == "__main__":` guard
work; otherwise they come from a fork server (shardlm/processes.py). Nothing that starts a thread
(the rendezvous store, the watcher) exists before the workers do.

Control path, per step: the engine core encodes the scheduler output once (msgspec) and puts
it in a shared-memory broadcast queue that every worker reads; each worker runs the step (the
TP collectives run between workers, over gloo or NCCL); only the output rank answers, through
its own reply queue. collective_rpc goes the same way and every rank answers.

Failure path: a watcher thread waits on every worker's process sentinel. When one dies it
records which (and the error the worker reported, if any), then closes the queues, so a step
waiting on that worker raises WorkerDiedError at once instead of hanging. Workers die with the
engine core (PR_SET_PDEATHSIG) and are terminated on shutdown: no orphans.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from multiprocessing.connection import Connection, wait

import msgspec

from shardlm.config import EngineConfig
from shardlm.distributed.parallel_state import (
    connect_store,
    get_pp_group,
    host_store,
    listen_for_rendezvous,
    wait_for_ranks,
)
from shardlm.distributed.shm_queue import QueueClosed, ShmQueue
from shardlm.executor.base import Executor, WorkerDiedError
from shardlm.logger import init_logger, set_log_prefix
from shardlm.messages import (
    FromWorker,
    ModelRunnerOutput,
    Ready,
    RunStep,
    SchedulerOutput,
    Shutdown,
    StepResult,
    ToWorker,
    UtilityCall,
    UtilityResult,
)
from shardlm.processes import InParentEnvironment, imports_the_main_script, process_context, start_method
from shardlm.utils import die_with_parent, leave_stop_signals_to_the_parent, set_process_name

logger = init_logger(__name__)


class MultiprocExecutor(Executor):
    runs_async = True

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        par = config.parallel
        self.world_size, self.output_rank = par.world_size, par.output_rank
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FromWorker).decode
        self._ready = False
        self._early_step_results: deque[StepResult] = deque()
        self.start_method, why = start_method()
        logger.info("Starting %d worker processes with %s (%s)", self.world_size, self.start_method, why)
        ctx = process_context(self.start_method)
        t0 = time.perf_counter()
        # the rendezvous port is open now; its store (which runs a thread) starts after the workers.
        # Data parallel: every replica's ranks meet at the DP client's store instead.
        listener = None
        if par.data_parallel_master is not None:
            rendezvous = par.data_parallel_master
        else:
            listener = listen_for_rendezvous("127.0.0.1")
            rendezvous = ("127.0.0.1", listener.getsockname()[1])
        self.broadcast = ShmQueue(num_readers=self.world_size, ctx=ctx)
        self.replies = [ShmQueue(num_readers=1, ctx=ctx).attach_reader(0) for _ in range(self.world_size)]
        # pipeline stages on CPU pass hidden states through shared memory: rank r -> r + the ranks of a stage
        stage = self.world_size // par.pipeline_parallel_size
        self.stage_links = {r: ShmQueue(num_readers=1, slot_bytes=4 << 20, num_slots=4, ctx=ctx)
                            for r in range(self.world_size - stage)} if config.device.type == "cpu" else {}
        self.procs, self._errors = [], []
        for rank in range(self.world_size):
            err_recv, err_send = ctx.Pipe(duplex=False)
            links = (self.stage_links.get(rank), self.stage_links.get(rank - stage))
            proc = ctx.Process(target=InParentEnvironment(run_worker), name=f"shardlm-worker-{rank}", daemon=True,
                               args=(config, rank, rendezvous, self.broadcast,
                                     self.replies[rank], err_send, links))
            proc.start()
            err_send.close()
            self.procs.append(proc)
            self._errors.append(err_recv)
        # the rendezvous store lives here, on that loopback port, for as long as the workers do
        if listener is not None:
            self._store = host_store(rendezvous[0], self.world_size, par.distributed_init_timeout, listener)
        else:
            self._store = connect_store(*rendezvous, par.world_size_across_dp, par.distributed_init_timeout)
        self._start_watcher(self._watch_workers, "shardlm-worker-watch")
        self._shutdown_at_exit()
        try:
            wait_for_ranks(self._store, range(par.first_world_rank, par.first_world_rank + self.world_size),
                           par.distributed_init_timeout, alive=lambda: self._failure is None)
            for rank in range(self.world_size):
                self._receive(rank)          # Ready, or why it failed
            self._ready = True
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d worker processes ready in %.2f s (pids %s)", self.world_size, time.perf_counter() - t0,
                    ", ".join(str(p.pid) for p in self.procs))

    # ---- failure detection ----
    def _watch_workers(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        ready = wait(list(sentinels))
        if self._stopping:
            return
        dead = [sentinels[s] for s in ready]
        for rank in dead:
            self.procs[rank].join(1)
        # the worker that failed, not one that exited because the queues closed after it
        rank = next((r for r in dead if self.procs[r].exitcode != 0), dead[0])
        proc, error = self.procs[rank], ""
        if self._errors[rank].poll(0.5):
            try:
                error = f": {self._errors[rank].recv()}"
            except (EOFError, OSError):
                pass
        hint = ""
        if not error and not self._ready and imports_the_main_script(self.start_method):
            hint = (" If its log above mentions the 'bootstrapping phase', the script that starts shardlm needs an "
                    f"`if __name__ == \"__main__\":` guard (workers started with {self.start_method} import it).")
        self.record_failure(f"Worker rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}{error}. "
                            f"The engine cannot continue; the other workers are being stopped.{hint}")

    def _on_failure(self) -> None:
        for q in [self.broadcast, *self.replies, *self.stage_links.values()]:
            q.close()           # nobody waits on a dead peer
        self._stop_workers(grace_s=1.0)

    def check_health(self) -> None:
        if self._failure is None and not all(p.is_alive() for p in self.procs):
            self._watcher.join(5)       # it is writing down which rank and why
        super().check_health()

    def sentinels(self) -> list:
        return [p.sentinel for p in self.procs]

    # ---- talking to the workers ----
    def _send(self, msg) -> None:
        try:
            self.broadcast.put(self._encode(msg))
        except QueueClosed:
            raise WorkerDiedError(self._failure or "The workers have been shut down.") from None

    def _receive(self, rank: int, timeout: float | None = None):
        try:
            return self._decode(self.replies[rank].get(timeout))
        except QueueClosed:
            raise WorkerDiedError(self._failure or "The workers have been shut down.") from None
        except TimeoutError:
            raise WorkerDiedError(self.record_failure(self._describe_stuck(timeout))) from None

    def _describe_stuck(self, timeout: float) -> str:
        """Which ranks did not answer: the stopped ones (SIGSTOP, a debugger) if any, else all."""
        stopped = [r for r, p in enumerate(self.procs) if _process_state(p.pid) in ("T", "t")]
        pids = ", ".join(str(self.procs[r].pid) for r in stopped)
        who = (f"worker rank(s) {', '.join(map(str, stopped))} (pid {pids}) are stopped" if stopped
               else f"no rank of {self.world_size} answered (one may hang)")
        return (f"A step did not finish within {timeout:.0f} s (--execute-model-timeout): {who}. The engine cannot "
                "continue; the workers are being stopped.")

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self._send(UtilityCall(0, method, list(args)))
        answers = [self._receive_answer(rank) for rank in range(self.world_size)]    # every one, in order
        failed = [(rank, a.error) for rank, a in enumerate(answers) if a.error is not None]
        if failed:
            raise RuntimeError(f"{method} failed on rank {failed[0][0]}: {failed[0][1]}")
        return [a.value for a in answers]

    def _receive_answer(self, rank: int):
        """A utility call's answer; a step in flight may answer first on the output rank: its
        result is kept, in order, for whoever waits on that step."""
        while isinstance(msg := self._receive(rank), StepResult):
            self._early_step_results.append(msg)
        return msg

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output)()

    def execute_model_async(self, scheduler_output: SchedulerOutput):
        self._send(RunStep(scheduler_output))
        timeout = self._step_timeout()

        def wait() -> ModelRunnerOutput:
            if self._early_step_results:
                return self._early_step_results.popleft().output
            return self._receive(self.output_rank, timeout).output
        return wait

    def _shutdown(self) -> None:
        if self._failure is None:
            try:
                self.broadcast.put(self._encode(Shutdown()), timeout=2)
            except (QueueClosed, TimeoutError):
                pass
        # after a failure the others are not told to stop, and wait in a collective: no grace
        self._stop_workers(grace_s=5.0 if self._failure is None else 0.0)
        self._watcher.join(5)       # before the queues it may still close go away
        for q in [self.broadcast, *self.replies, *self.stage_links.values()]:
            q.destroy()
        for conn in self._errors:
            conn.close()
        self._store = None

    def _stop_workers(self, grace_s: float) -> None:
        """Let workers exit on their own for grace_s, then SIGKILL them (they ignore SIGTERM)."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


# ---- the worker process ----
def run_worker(config: EngineConfig, rank: int, rendezvous: tuple[str, int], broadcast: ShmQueue,
               reply: ShmQueue, error_pipe: Connection,
               stage_links: tuple[ShmQueue | None, ShmQueue | None] = (None, None)) -> None:
    """Entry point of a worker process: start up, then run what the broadcast queue says."""
    from shardlm.worker.worker import Worker

    die_with_parent()             # the engine core, however it dies
    set_process_name(f"shardlm-rank-{config.parallel.rank_offset + rank}")
    leave_stop_signals_to_the_parent()
    set_log_prefix(f"({config.parallel.describe_rank(rank)}) ")
    broadcast.attach_reader(rank)
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(ToWorker).decode
    worker = None
    try:
        to_next, from_previous = stage_links
        if from_previous is not None:
            from_previous.attach_reader(0)
        worker = Worker(config, rank, rendezvous)
        worker.init_device()
        if to_next is not None or from_previous is not None:
            get_pp_group().set_shm_links(to_next, from_previous)
        worker.load_model()
        reply.put(encode(Ready(rank)))
        answers_steps = rank == config.parallel.output_rank
        while True:
            msg = decode(broadcast.get())
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, RunStep):
                output = worker.execute_model(msg.scheduler_output)
                if answers_steps:
                    reply.put(encode(StepResult(output)))
            else:
                reply.put(encode(_answer(worker, msg)))
    except QueueClosed:       # the engine core closed the queues: another rank failed
        return
    except BaseException as e:
        logger.exception("Worker rank %d failed", rank)
        try:
            error_pipe.send(f"{type(e).__name__}: {e}")
        except OSError:
            pass
        sys.exit(1)
    finally:
        if worker is not None:
            worker.shutdown()
        for q in (broadcast, reply, *stage_links):
            if q is not None:
                q.destroy()


def _answer(worker, call: UtilityCall) -> UtilityResult:
    """A utility call's result, or why it failed (this rank goes on: the failure is the caller's)."""
    try:
        return UtilityResult(call.call_id, getattr(worker, call.method)(*call.args))
    except Exception as e:        # noqa: BLE001 - answered to the engine core
        return UtilityResult(call.call_id, None, error=f"{type(e).__name__}: {e}")


def _process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, D, T, ...), '?' if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"
