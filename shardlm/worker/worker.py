"""One rank: its device, its model weights and KV cache, and the step it runs."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import resource
import time

import torch

from shardlm import cpu_plan, kernels
from shardlm.config import EngineConfig, format_bytes
from shardlm.distributed import parallel_state
from shardlm.logger import init_logger
from shardlm.lora.request import LoRARequest
from shardlm.messages import ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput
from shardlm.models.llama import LlamaModel
from shardlm.sampling_params import SamplingParams
from shardlm.worker.cpu_binding import apply_binding, binding_for_rank
from shardlm.worker.cpu_tuning import keep_freed_memory_in_heap
from shardlm.worker.model_runner import ModelRunner

logger = init_logger(__name__)


def give_back_free_heap() -> None:
    """glibc keeps freed heap memory for reuse (its mmap threshold grows past most tensors): hand
    it back to the system, so that freed tensors lower the RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):    # not glibc: its allocator decides
        pass


class Worker:
    """`rank`: this rank within its replica (0..tp*pp-1); its world rank adds the replica's
    offset. `rendezvous`: (host, port) of the TCP store (the executor's, or the DP client's for
    data parallel); None for a single rank. `local_rank` / `local_world_size`: this rank among
    those on its machine (default: every rank of this node's replicas), for sharing its CPU cores."""

    def __init__(self, config: EngineConfig, rank: int = 0, rendezvous: tuple[str, int] | None = None,
                 local_rank: int | None = None, local_world_size: int | None = None):
        self.config = config
        self.rank = rank
        self.rendezvous = rendezvous
        par = config.parallel
        self.local_rank = par.local_replica_index * par.world_size + rank if local_rank is None else local_rank
        self.local_world_size = (par.data_parallel_size_local * par.world_size if local_world_size is None
                                 else local_world_size)
        self.device = config.device
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self.local_rank % torch.cuda.device_count())
        cpu_plan.follow(config.model.cpu_plan)       # a spawned worker reads the file itself
        self.runner = ModelRunner(config, self.device)
        self.slept_blocks: int | None = None     # sleep mode: the KV blocks to allocate again at wake-up

    def init_device(self) -> None:
        par = self.config.parallel
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            keep_freed_memory_in_heap()
            apply_binding(binding_for_rank(par.cpu_threads_bind, self.local_world_size, self.local_rank))
        if par.world_size_across_dp > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            host, port = self.rendezvous
            world_rank = par.first_world_rank + self.rank
            parallel_state.init_distributed_environment(par.world_size_across_dp, world_rank, host, port, backend,
                                                        par.distributed_init_timeout)
            parallel_state.initialize_model_parallel(par.tensor_parallel_size, par.pipeline_parallel_size,
                                                     par.world_size_across_dp // par.world_size, rank=world_rank,
                                                     backend=backend,
                                                     timeout_s=par.execute_model_timeout,
                                                     expert_parallel=par.enable_expert_parallel,
                                                     dcp=par.decode_context_parallel_size,
                                                     pcp=par.prefill_context_parallel_size)
        else:
            parallel_state.initialize_model_parallel(1)
        torch.manual_seed(self.config.model.seed)

    def load_model(self) -> None:
        t0 = time.perf_counter()
        self.runner.load_model()
        # the weights and module tree live for the whole run: keep them out of the GC's scans,
        # whose pauses on one rank stall every other rank at the next collective
        gc.collect()
        gc.freeze()
        logger.info("Model weights loaded: %s%s in %.2f s (dtype %s, device %s)",
                    format_bytes(self.runner.weight_bytes()),
                    " on this rank" if self.config.parallel.world_size > 1 else "", time.perf_counter() - t0,
                    str(self.config.model.dtype).replace("torch.", ""), self.device)

    def determine_num_blocks(self) -> int:
        """KV blocks this rank can hold: a fixed budget on CPU; on CUDA what is left of
        gpu_memory_utilization after the weights and a profiled peak of activations."""
        per_block = self.runner.kv_cache_bytes_per_block()
        if per_block == 0:      # an encoder keeps no KV cache: block ids only count what each step holds
            sched = self.config.scheduler
            return sched.max_num_seqs * -(-sched.max_model_len // self.config.cache.block_size) + 1
        if self.device.type != "cuda":
            blocks = self.config.cache.kv_cache_memory // per_block
        else:
            blocks = max(self._cuda_kv_budget(), 0) // per_block
        if self.config.parallel.world_size > 1:
            logger.info("KV cache on this rank: %d blocks of %s", blocks, format_bytes(per_block))
        return blocks

    def weight_bytes(self) -> int:
        return self.runner.weight_bytes()

    def environment(self, names: list[str]) -> dict[str, str | None]:
        """These environment variables as this rank sees them (what reached it on its node)."""
        return {name: os.environ.get(name) for name in names}

    def parallel_layout(self) -> dict:
        """This rank's world rank and the world ranks of its TP, PP and DP groups."""
        return {"world_rank": parallel_state.get_world_group().rank,
                **{name: group().ranks for name, group in (("tp", parallel_state.get_tp_group),
                                                           ("pp", parallel_state.get_pp_group),
                                                           ("dp", parallel_state.get_dp_group))}}

    def dp_all_reduce(self, value: float) -> float:
        """The sum of `value` over this rank's DP group (every replica calls it at once): a check
        that the replicas' ranks form one grid."""
        return parallel_state.get_dp_group().all_reduce(torch.tensor([value], dtype=torch.float64)).item()

    def quantized_kernels(self) -> dict[str, int]:
        """How many quantized linears use each kernel ("none": dequantize + matmul)."""
        counts: dict[str, int] = {}
        for m in self.runner.model.modules():
            if getattr(m, "quant", None) is not None:
                counts[m.quant.kernel or "none"] = counts.get(m.quant.kernel or "none", 0) + 1
        return counts

    def quantized_experts(self) -> list[str]:
        """Per MoE layer of this rank, the kernel its experts run on ("float": not quantized; two
        kernels joined by + where gate/up and down differ, as a GGUF Q4_K_M's)."""
        from shardlm.layers.moe import FusedMoE
        return ["+".join(sorted({m.quantized[w][0].kernel for w in ("w13", "w2")})) if m.quantized else "float"
                for m in self.runner.model.modules() if isinstance(m, FusedMoE)]

    # ---- LoRA adapters (LLM.add_lora / remove_lora / list_loras) ----
    def add_lora(self, request: LoRARequest | dict) -> bool:
        """request: a LoRARequest, or its fields (as a utility call carries it between processes)."""
        return self.runner.lora.add_lora(request if isinstance(request, LoRARequest) else LoRARequest(**request))

    def remove_lora(self, lora_id: int) -> bool:
        return self.runner.lora.remove_lora(lora_id)

    def list_loras(self) -> list[int]:
        return self.runner.lora.list_loras()

    def set_enforce_eager(self, on: bool) -> None:
        self.runner.set_enforce_eager(on)

    def fused_decode_steps(self) -> int:
        """Decode steps this rank ran through the one-call path (models/llama_cpu_decode.py)."""
        stages = (m.fused_decode for m in self.runner.model.modules() if isinstance(m, LlamaModel))
        return sum(f.steps for f in stages if f is not None)

    def cuda_graph_steps(self) -> int:
        """Decode steps this rank replayed from CUDA graphs (worker/cuda_graphs.py)."""
        graphs = self.runner.cuda_graphs
        return graphs.steps if graphs is not None else 0

    def peak_rss_bytes(self) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def shutdown(self) -> None:
        parallel_state.destroy_model_parallel()
        # drop the weights and KV cache now, not when the LLM object goes: a process may start
        # another engine, whose memory profile would otherwise count this one's
        self.runner = None
        gc.unfreeze()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

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
            blocks = list(range(next_block, next_block + n))
            tables = [blocks] * self.config.kv_groups.num_groups        # every KV cache group: the same blocks
            chunks.append(ScheduledChunk(f"profile-{i}", [0] * per_seq, 0, tables, True))
            next_block += n
        new = [NewRequestData(c.req_id, c.token_ids, SamplingParams(temperature=0)) for c in chunks]
        self.runner.execute_model(SchedulerOutput(chunks, new))
        torch.cuda.synchronize()
        self.runner.execute_model(SchedulerOutput([], [], [c.req_id for c in chunks]))
        profile_cache = self.runner.kv_cache_bytes_per_block() * num_blocks
        peak = torch.cuda.max_memory_allocated(self.device) - profile_cache
        self.runner.release_cache()
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
        if self.device.type == "cpu":
            self._settle_cpu_plan()

    # ---- sleep mode (--enable-sleep-mode, as vLLM's: memory back while the engine idles) ----
    def sleep(self, level: int) -> None:
        """Level 1: the KV cache's memory is freed; level 2: the weights' too (read again at wake_up)."""
        if self.runner.num_blocks is not None:        # (not asleep already)
            self.slept_blocks = self.runner.num_blocks
            self.runner.release_cache()
        if level == 2 and self.runner.model is not None:
            self.runner.release_model()
            gc.unfreeze()       # load_model froze the module tree; its cycles are garbage now
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            give_back_free_heap()

    def wake_up(self) -> None:
        if self.runner.model is None:
            self.load_model()
        self.runner.initialize_cache(self.slept_blocks)

    def kv_cache_bytes(self) -> int:
        """Bytes this rank's KV cache holds now (0 while the engine sleeps)."""
        return sum(t.numel() * t.element_size() for pair in self.runner.kv_tensors() for t in pair)

    def _settle_cpu_plan(self) -> None:
        """Every CPU choice is made once the KV cache is bound: log the plan as one block (the first
        rank; the others at debug level) and write it where --cpu-plan names a file not there yet."""
        cpu_plan.record(isa=kernels.active_isa() if kernels.library() is not None else None,
                        kernel_library=kernels.describe()["library"],
                        dtype=str(self.config.model.dtype).removeprefix("torch."))
        plan = cpu_plan.current()
        first = self.rank == 0 and self.config.parallel.rank_offset == 0
        logger.log(logging.INFO if first else logging.DEBUG, "%s", plan.describe())
        written = cpu_plan.write_if_asked() if first else None
        if written:
            logger.info("CPU plan written to %s: --cpu-plan %s repeats these choices.", written, written)

    def cpu_plan(self) -> str:
        """This rank's CPU plan, as JSON (cpu_plan.py)."""
        return cpu_plan.current().to_json()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.runner.execute_model(scheduler_output)

    def execute_dummy_batch(self) -> int:
        return self.runner.execute_dummy()

    def eplb_state(self) -> dict | None:
        """EPLB's placements so far and the last balancedness (None: not balancing here)."""
        return self.runner.balancer.state() if self.runner.balancer is not None else None

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert so far, per MoE layer of this rank (its replica's tokens)."""
        return {layer: moe.expert_load.tolist() for layer, moe in self.runner.moe_layers().items()}
