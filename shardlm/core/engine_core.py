"""The engine core: owns the scheduler and the KV block table, drives the executor.

step() = schedule -> execute on the workers -> update requests with the sampled tokens.

With pipeline parallel (P stages) the core keeps up to P batches in flight: it schedules and
submits a new batch while earlier ones are still in the pipeline, and only then waits for the
oldest. Stage 0 runs batch k+1 while stage 1 runs batch k. With workers in other processes the
next batch is submitted as soon as the oldest one's tokens are in, before the caller
post-processes them, so the workers never wait on detokenization.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent import futures
from dataclasses import replace

from shardlm.config import EngineConfig, format_bytes
from shardlm.core.request import Request
from shardlm.core.scheduler import Scheduler
from shardlm.core.stat_logger import StatLogger
from shardlm.core.wave import Wave
from shardlm.executor.selection import executor_class
from shardlm.logger import init_logger
from shardlm.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerOutput
from shardlm.models.registry import get_model_class
from shardlm.planner.layer_placement import describe_partition, stage_layers
from shardlm.structured_output.manager import StructuredOutputManager

logger = init_logger(__name__)


def describe_step(scheduler_output: SchedulerOutput) -> str:
    """The requests of a step and the positions it computes for each, for the log."""
    chunks = scheduler_output.chunks
    shown = ", ".join(f"{c.req_id} (positions {c.start_pos}-{c.start_pos + len(c.token_ids) - 1})"
                      for c in chunks[:8])
    return f"{len(chunks)} request(s): {shown}" + (f" and {len(chunks) - 8} more" if len(chunks) > 8 else "")


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        t0 = time.perf_counter()
        self.executor = executor_class(config.parallel.distributed_executor_backend)(config)
        self.num_blocks = num_blocks = self._num_blocks()
        self._check_kv_capacity(num_blocks)
        self.executor.initialize_cache(num_blocks)
        self.max_in_flight = self.executor.max_concurrent_batches
        # the scheduler counts blocks of kv_block_tokens (a block id's tokens over every context parallel rank)
        self.scheduler = Scheduler(config.scheduler, replace(config.cache, block_size=config.kv_block_tokens),
                                   num_blocks, self.max_in_flight,
                                   config.lora.max_loras if config.lora is not None else 0, config.speculative,
                                   config.kv_groups)
        self.stat_logger = StatLogger(self.scheduler, log=not config.model.disable_log_stats)
        self.batch_queue: deque = deque()      # (scheduler output, wait for its result, when sent), oldest first
        self.wave = Wave() if config.dp_lockstep else None     # DP + EP: replicas step together
        self.structured_outputs: StructuredOutputManager | None = None     # made at the first constrained request
        self.sleeping = 0                   # sleep mode: the level it sleeps at (0: awake)
        par = config.parallel
        cp = "".join(f" {name}={n}" for name, n in (("DCP", par.decode_context_parallel_size),
                                                    ("PCP", par.prefill_context_parallel_size)) if n > 1)
        logger.info("Parallel layout: TP=%d PP=%d DP=%d%s, executor %s", par.tensor_parallel_size,
                    par.pipeline_parallel_size, par.data_parallel_size, cp, type(self.executor).__name__)
        if par.pipeline_parallel_size > 1:
            logger.info("PP %s; up to %d batches in flight", describe_partition(stage_layers(config.model, par)),
                        self.max_in_flight)
        if par.world_size > 1:
            weights = self.executor.collective_rpc("weight_bytes")
            per_stage = par.world_size // par.pipeline_parallel_size
            logger.info("Memory per rank: %s; KV cache %d blocks (%d tokens) on every rank", "; ".join(
                f"stage {s}: weights {', '.join(format_bytes(w) for w in weights[s * per_stage:(s + 1) * per_stage])}"
                for s in range(par.pipeline_parallel_size)), num_blocks, num_blocks * config.cache.block_size)
        logger.info("Engine core ready in %.2f s", time.perf_counter() - t0)

    def _num_blocks(self) -> int:
        """The KV cache blocks the memory gives (the same on every rank), or --num-gpu-blocks-override."""
        measured = self.executor.determine_num_blocks()
        override = self.config.cache.num_gpu_blocks_override
        if override is None:
            return measured
        logger.info("KV cache: %d blocks (--num-gpu-blocks-override) instead of the %d the memory gives", override,
                    measured)
        return override

    def _check_kv_capacity(self, num_blocks: int) -> None:
        bs, max_len = self.config.kv_block_tokens, self.config.model.max_model_len
        groups, chunk = self.config.kv_groups, self.config.scheduler.max_num_batched_tokens
        usable = max(num_blocks - 1, 0)   # block 0 is the null block
        needed = groups.blocks_held(max_len, bs, chunk)
        if usable < needed:
            raise ValueError(
                f"The KV cache has room for {groups.max_tokens(usable, bs, chunk)} tokens of one request "
                f"({usable} blocks of {bs}), fewer than one request of max_model_len={max_len} needs ({needed} "
                "blocks). Give it more memory (kv_cache_memory on CPU, gpu_memory_utilization on CUDA) "
                f"or lower max_model_len to at most {groups.max_tokens(usable, bs, chunk)}.")
        cp = self.config.parallel.context_parallel_size
        spread = f" ({self.config.cache.block_size} on each of {cp} context parallel ranks)" if cp > 1 else ""
        m = self.config.model
        if getattr(get_model_class(m.architecture, m.convert, m.model_impl), "is_encoder", False):
            logger.info("No KV cache (an encoder computes whole prompts): at most %d prompts a step",
                        self.config.scheduler.max_num_seqs)
        elif groups.windows == (None,):
            logger.info("KV cache: %d blocks x %d tokens%s = %d tokens; max concurrency at max_model_len %d: %.2fx",
                        usable, bs, spread, usable * bs, max_len, usable * bs / max_len)
        else:
            logger.info("KV cache: %d blocks x %d tokens, %s (sliding-window layers keep only their window); "
                        "max concurrency at max_model_len %d: %.2fx", usable, bs, groups.describe(), max_len,
                        usable / groups.blocks_held(max_len, bs))

    def add_request(self, req: EngineCoreRequest) -> int | None:
        """-> the lock-step wave this request started (the other replicas must join it), or None."""
        m = self.config.model
        request = Request(req.request_id, req.prompt_token_ids, req.params, m.eos_token_ids, m.max_model_len,
                          self.config.kv_block_tokens, req.arrival_time, req.lora_request, req.pooling_params,
                          req.token_type_ids, req.priority, req.cache_salt, req.mm_items)
        if req.params.structured_outputs is not None:
            try:
                if self.structured_outputs is None:
                    self.structured_outputs = StructuredOutputManager(m.tokenizer, m.vocab_size, m.reasoning_parser,
                                                                      m.trust_remote_code, m.reasoning_parser_plugin)
                request.grammar = self.structured_outputs.compile(request)
            except Exception as e:      # noqa: BLE001 - the constraints cannot be set up here: this request ends
                request.grammar = futures.Future()
                request.grammar.set_exception(e)
        self.scheduler.add_request(request)
        return self.wave.begin() if self.wave is not None else None

    def join_wave(self, number: int) -> None:
        if self.wave is not None:
            self.wave.join(number)

    def is_busy(self) -> bool:
        """Requests to run, or a lock-step wave the other replicas are in."""
        return self.scheduler.has_unfinished() or (self.wave is not None and self.wave.running)

    def abort_requests(self, req_ids) -> None:
        self.scheduler.finish_requests(req_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> EngineCoreOutputs:
        self._fill_pipeline()
        if not self.batch_queue:
            compiling = [r.grammar for r in self.scheduler.waiting if r.waiting_for_grammar]
            if compiling:               # nothing else to run: wait for a constraint to compile
                futures.wait(compiling, return_when=futures.FIRST_COMPLETED)
                return self._outputs([])
            if self.scheduler.has_unfinished():
                raise RuntimeError("The scheduler could not schedule any of the unfinished requests; "
                                   "this is a bug in shardlm, please report it.")
            if self.wave is not None and self.wave.running:
                self._dummy_step()
            return self._outputs([])
        scheduler_output, wait, started = self.batch_queue.popleft()
        try:
            result = wait()
        except Exception as e:
            self._log_failed_step(scheduler_output, e)
            raise
        if self.config.model.collect_detailed_traces:
            self.scheduler.add_step_times(scheduler_output, time.perf_counter() - started, result.forward_seconds)
        outputs = self.scheduler.update(scheduler_output, result)
        self.stat_logger.observe(scheduler_output, outputs)
        if self.executor.runs_async:
            # the workers start on the next batch while the caller detokenizes these outputs
            self._fill_pipeline()
        return self._outputs(outputs)

    @staticmethod
    def _log_failed_step(scheduler_output: SchedulerOutput, error: Exception) -> None:
        """The line a supervisor's log search finds: which requests were in the step that failed."""
        logger.error("A step failed (%s: %s); it held %s", type(error).__name__, error, describe_step(scheduler_output))

    def _dummy_step(self) -> None:
        """Join the other replicas' MoE layers with no tokens; when none had any, the wave ends."""
        tokens_across_replicas = self.executor.collective_rpc("execute_dummy_batch")[0]
        if tokens_across_replicas == 0:
            self.wave.finish()

    def _outputs(self, outputs) -> EngineCoreOutputs:
        if self.scheduler.failed_outputs:
            outputs, self.scheduler.failed_outputs = [*self.scheduler.failed_outputs, *outputs], []
        return EngineCoreOutputs(outputs, self.scheduler.num_waiting, self.scheduler.num_running,
                                 self.config.parallel.data_parallel_rank)

    def _fill_pipeline(self) -> None:
        """Submit batches until max_in_flight are pending or nothing more can be scheduled."""
        while len(self.batch_queue) < self.max_in_flight:
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.chunks:
                return
            self._attach_grammar_bitmask(scheduler_output)
            started = time.perf_counter()
            try:
                wait = self.executor.execute_model_async(scheduler_output)
            except Exception as e:       # the in-process executor runs the step right here
                self._log_failed_step(scheduler_output, e)
                raise
            self.batch_queue.append((scheduler_output, wait, started))

    def _attach_grammar_bitmask(self, so: SchedulerOutput) -> None:
        """The allowed tokens of each constrained request this step samples for."""
        if self.structured_outputs is None:
            return
        chunks = [(c, self.scheduler.requests[c.req_id]) for c in so.chunks if c.sample]
        rows = [(r.request_id, r.grammar.result(), c.draft_token_ids)
                for c, r in chunks if r.grammar is not None and r.thinking_end_ids is None]
        if rows:
            so.grammar_req_ids = [req_id for req_id, _, _ in rows]
            so.grammar_bitmask = self.structured_outputs.bitmask([(matcher, drafts) for _, matcher, drafts in rows])

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def stats(self) -> dict:
        return {"num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
                "kv_cache_usage": self.scheduler.kv.usage(),
                # the context it holds (block 0: the null block); with sliding-window groups, that of
                # as many requests of max_model_len as fit
                "kv_cache_tokens": self.config.kv_groups.tokens_held(self.num_blocks - 1, self.config.kv_block_tokens,
                                                                      self.config.model.max_model_len),
                "prefix_cache_hit_rate": self.scheduler.kv.prefix_cache_hit_rate(),
                "prefix_cache_queries": self.scheduler.kv.prefix_queries,
                "prefix_cache_hits": self.scheduler.kv.prefix_hits,
                "num_preemptions": self.scheduler.num_preemptions,
                "num_aborted": self.scheduler.num_aborted,
                **self.stat_logger.totals(),
                **self.scheduler.lora_stats(),
                **(self.scheduler.spec_stats.as_dict() if self.config.speculative is not None else {}),
                **({"expert_load": self.expert_load()} if self.config.model.num_experts else {}),
                **({"eplb": self.executor.collective_rpc("eplb_state")[0]} if self.config.parallel.enable_eplb else {})}

    def expert_load(self) -> dict[str, list[int]]:
        """Tokens of this replica routed to each expert so far, per MoE layer (from the first TP
        rank of every pipeline stage, each holding its own layers; summed over prefill context
        parallel groups, each routing its own tokens)."""
        per_rank = self.executor.collective_rpc("expert_load")
        load: dict[str, list[int]] = {}
        for rank in range(0, len(per_rank), self.config.parallel.tensor_parallel_size):
            for layer, counts in sorted(per_rank[rank].items()):
                load[str(layer)] = [a + b for a, b in zip(load.get(str(layer), [0] * len(counts)), counts)]
        return load

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return self.executor.collective_rpc(method, tuple(args))

    # ---- sleep mode (--enable-sleep-mode, as vLLM's) ----
    def sleep(self, level: int = 1) -> None:
        """Give the KV cache's memory back (level 1), and the weights' too (level 2), while no
        request runs; the cached prefixes are forgotten."""
        if not self.config.model.enable_sleep_mode:
            raise ValueError("Sleep mode is off: start the engine with --enable-sleep-mode (enable_sleep_mode=True).")
        if level not in (1, 2):
            raise ValueError(f"Sleep level {level!r}: give 1 (the KV cache) or 2 (the KV cache and the weights).")
        if self.scheduler.has_unfinished():
            raise ValueError("The engine has requests to finish: let them end (or abort them) before it sleeps.")
        self.scheduler.kv.reset_prefix_cache()
        self.executor.collective_rpc("sleep", (level,))
        self.sleeping = max(self.sleeping, level)
        logger.info("Sleeping (level %d): the KV cache%s freed", level, " and the weights" if level == 2 else "")

    def wake_up(self) -> None:
        if self.sleeping:
            t0 = time.perf_counter()
            self.executor.collective_rpc("wake_up")
            logger.info("Awake in %.2f s", time.perf_counter() - t0)
        self.sleeping = 0

    def is_sleeping(self) -> bool:
        return bool(self.sleeping)

    def shutdown(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs.shutdown()
        self.executor.shutdown()
