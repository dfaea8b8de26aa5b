"""The same memory math, run by LLM and serve before anything is loaded: an impossible layout
fails at once with the numbers and a split that works, instead of running out of memory later."""

from __future__ import annotations

import os

import psutil
import torch

from shardlm.config import EngineConfig
from shardlm.logger import init_logger
from shardlm.planner.hardware import detect_hardware
from shardlm.planner.layer_placement import stage_layers
from shardlm.planner.model_shape import ModelShape
from shardlm.planner.plan import GiB, Workload, evaluate, recommend

logger = init_logger(__name__)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def shape_of(m, name: str) -> ModelShape:
    """ModelConfig m's shape (a vision-language model's with its vision side)."""
    return ModelShape.from_config(name, (m.multimodal.hf_config if m.multimodal is not None else m.hf_config).to_dict())


def check_parallel_layout(config: EngineConfig) -> None:
    """Can this model be split this way on this machine? If not, say which splits work."""
    m, par = config.model, config.parallel
    shape = shape_of(m, os.path.basename(m.served_model_name.rstrip("/")))
    tp = par.tensor_parallel_size
    if par.enable_expert_parallel and not shape.is_moe:
        logger.warning("--enable-expert-parallel has no effect: %s has no mixture-of-experts layers.", shape.name)
    ep = tp * par.data_parallel_size        # expert parallel spans each stage's DP x TP ranks
    if par.enable_expert_parallel and shape.is_moe and shape.num_experts < ep:
        raise ValueError(f"Expert parallel over {ep} ranks (-dp x -tp) needs at least as many experts; this model has "
                         f"{shape.num_experts}. Leave out --enable-expert-parallel (tensor parallel then slices every "
                         "expert) or use fewer ranks.")
    problems = shape.tp_problems(tp, expert_parallel=par.enable_expert_parallel)
    if problems:
        valid = ", ".join(map(str, shape.valid_tp_sizes(limit=max(shape.heads, tp))))
        raise ValueError(f"{shape.name} has {shape.heads} attention heads and {shape.kv_heads} KV heads: "
                         f"tensor parallel size {tp} cannot split it ({'; '.join(problems)}). "
                         f"Valid tensor parallel sizes are {valid}.")
    _check_decode_context_parallel(config, shape)
    stage_layers(m, par)   # raises if impossible
    # FP8's groups split wherever a rank's columns start (layers/fp8.py)
    if m.quantization is not None and m.quantization.group_size != -1 and not m.quantization.method.startswith("fp8"):
        _check_quantization_groups(shape, tp, m.quantization)
    local_ranks = par.world_size * par.data_parallel_size_local
    if config.device.type == "cuda" and par.distributed_executor_backend != "ray" \
            and local_ranks > torch.cuda.device_count():
        layout = f"tensor x pipeline (x prefill context) parallel = {par.world_size} ranks"
        if par.data_parallel_size_local > 1:
            layout = f"{par.data_parallel_size_local} data parallel replicas of {par.world_size} rank(s)"
        raise ValueError(f"{layout} need {local_ranks} GPUs, but "
                         f"{torch.cuda.device_count()} are visible on this node (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Lower the parallel sizes, or use "
                         "--distributed-executor-backend ray across nodes.")


def _check_decode_context_parallel(config: EngineConfig, shape: ModelShape) -> None:
    par = config.parallel
    tp, dcp, interleave = par.tensor_parallel_size, par.decode_context_parallel_size, par.dcp_kv_cache_interleave_size
    if config.cache.block_size % interleave:
        raise ValueError(f"dcp_kv_cache_interleave_size={interleave} must divide block_size="
                         f"{config.cache.block_size}: a block holds whole runs of one rank's positions.")
    if dcp == 1:
        return
    problems = shape.dcp_problems(tp, dcp)
    if problems:
        kv_heads = "one latent KV head" if shape.is_mla else f"{shape.kv_heads} KV heads"
        raise ValueError(f"{shape.name} has {kv_heads}: decode context parallel size {dcp} cannot run "
                         f"at tensor parallel size {tp} ({problems[0]}). At -tp {tp}, -dcp can be "
                         f"{', '.join(map(str, shape.valid_dcp_sizes(tp)))}; -dcp pays where tp exceeds the KV heads.")


def _check_quantization_groups(shape: ModelShape, tp: int, quant) -> None:
    """Every quantized layer's input columns on a rank must hold whole groups (the seeds' "quantized
    models are limited to some TP sizes")."""
    def broken(t: int) -> list[str]:
        return [f"{name} ({cols} columns per rank)" for name, cols in shape.linear_inputs_per_rank(t).items()
                if cols % quant.group_size]
    bad = broken(tp)
    if bad:
        valid = [t for t in shape.valid_tp_sizes(limit=max(shape.heads, tp)) if not broken(t)]
        raise ValueError(f"{quant.method} with groups of {quant.group_size} columns cannot split {', '.join(bad)} at "
                         f"tensor parallel size {tp}. Valid tensor parallel sizes for this group size: "
                         f"{', '.join(map(str, valid)) or 'none'}; or choose --quantization-group-size to divide "
                         "them.")


def check_fits(config: EngineConfig) -> None:
    m, par = config.model, config.parallel
    shape = shape_of(m, m.served_model_name)
    quant = m.quantization
    workload = Workload(dtype=_DTYPE_NAMES[m.dtype], max_model_len=m.max_model_len,
                        quantization_bits=quant.effective_bits(shape.hidden) if quant else None,
                        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                        max_num_seqs=config.scheduler.max_num_seqs, block_size=config.cache.block_size,
                        hybrid_kv_cache=config.kv_groups.windows != (None,), kv_cache_dtype=config.cache.kv_cache_dtype)
    hw = detect_hardware(config.cache.gpu_memory_utilization)
    if config.device.type == "cpu":
        hw.device_memory, hw.utilization = psutil.virtual_memory().available, 1.0
    ep = par.tensor_parallel_size * par.data_parallel_size if par.enable_expert_parallel and shape.is_moe else 0
    plan = evaluate(shape, par.tensor_parallel_size, par.pipeline_parallel_size, hw, workload, ep=ep,
                    dcp=par.decode_context_parallel_size, pcp=par.prefill_context_parallel_size)
    if config.device.type == "cpu":
        # every rank of this node's replicas shares the machine's memory
        replicas = par.data_parallel_size_local
        needed = (plan.weights_per_device + plan.reserve_per_device) * replicas
        if needed > hw.device_memory:
            _fail(shape, plan.label, f"its weights ({plan.weights_per_device / GiB:.1f} GiB) and working memory "
                  f"({plan.reserve_per_device / GiB:.1f} GiB) need more than the {hw.device_memory / GiB:.1f} GiB "
                  "of memory available on this machine", recommend(shape, hw, workload, m.model))
        if needed + config.cache.kv_cache_memory * replicas > hw.device_memory:
            logger.warning("Weights (%.1f GiB) plus kv_cache_memory (%.1f GiB), times %d replica(s), exceed the %.1f "
                           "GiB of free memory: a full KV cache would swap or be killed; lower kv_cache_memory.",
                           plan.weights_per_device / GiB, config.cache.kv_cache_memory / GiB, replicas,
                           hw.device_memory / GiB)
        return
    if plan.status == "no":
        _fail(shape, plan.label, plan.reason, recommend(shape, hw, workload, m.model))


def _fail(shape: ModelShape, label: str, reason: str, rec) -> None:
    advice = f" Recommended: {rec.plan.label} ({rec.command})." if rec.plan else ""
    advice += " " + " ".join(rec.reasons[1:] if rec.plan else rec.reasons)
    raise ValueError(f"{shape.name} ({shape.total_params() / 1e9:.2f}B parameters) cannot run as {label} here: "
                     f"{reason}.{advice} `shardlm plan` shows the options.")
