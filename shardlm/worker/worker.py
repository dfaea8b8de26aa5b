"""One rank: its device, its model weights and KV cache, and the step it runs."""

from __future__ import annotations

import time

import torch

from shardlm.config import EngineConfig, format_bytes
from shardlm.engine.messages import ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput
from shardlm.logger import init_logger
from shardlm.sampling_params import SamplingParams
from shardlm.worker.cpu_tuning import keep_freed_memory_in_heap
from shardlm.worker.model_runner import ModelRunner

logger = init_logger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        self.device = config.device
        self.runner = ModelRunner(config, self.device)

    def init_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            keep_freed_memory_in_heap()
        torch.manual_seed(self.config.model.seed)

    def load_model(self) -> None:
        t0 = time.perf_counter()
        self.runner.load_model()
        logger.info("Model weights loaded: %s in %.2f s (dtype %s, device %s)",
                    format_bytes(self.runner.weight_bytes()), time.perf_counter() - t0,
                    str(self.config.model.dtype).replace("torch.", ""), self.device)

    def determine_num_blocks(self) -> int:
        """KV blocks this rank can hold: a fixed budget on CPU; on CUDA what is left of
        gpu_memory_utilization after the weights and a profiled peak of activations."""
        per_block = self.runner.kv_cache_bytes_per_block()
        if self.device.type != "cuda":
            return self.config.cache.kv_cache_memory // per_block
        budget = self._cuda_kv_budget()
        return max(budget, 0) // per_block

    def _cuda_kv_budget(self) -> int:
        sched = self.config.scheduler
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # profile the largest step: max_num_batched_tokens prompt tokens, logits for max_num_seqs rows
        bs = self.config.cache.block_size
        num_seqs = min(sched.max_num_seqs, sched.max_num_batched_tokens)
        per_seq = max(1, min(sched.max_num_batched_tokens // num_seqs, self.config.model.max_model_len - 1))
        num_blocks = num_seqs * (per_seq // bs + 2) + 1
        self.runner.initialize_cache(num_blocks)
        chunks, next_block = [], 1
        for i in range(num_seqs):
            n = per_seq // bs + 1
            chunks.append(ScheduledChunk(f"profile-{i}", [0] * per_seq, 0, list(range(next_block, next_block + n)), True))
            next_block += n
        new = [NewRequestData(c.req_id, c.token_ids, SamplingParams(temperature=0)) for c in chunks]
        self.runner.execute_model(SchedulerOutput(chunks, new))
        torch.cuda.synchronize()
        self.runner.execute_model(SchedulerOutput([], [], [c.req_id for c in chunks]))
        profile_cache = self.runner.kv_cache_bytes_per_block() * num_blocks
        peak = torch.cuda.max_memory_allocated(self.device) - profile_cache
        for attn in self.runner.attention_layers():
            attn.k_cache = attn.v_cache = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak - used_by_others
        logger.info("CUDA memory: total %s, weights + peak activations %s, other processes %s, "
                    "KV cache budget %s (gpu_memory_utilization=%.2f)", format_bytes(total), format_bytes(peak),
                    format_bytes(used_by_others), format_bytes(budget), self.config.cache.gpu_memory_utilization)
        return budget

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
