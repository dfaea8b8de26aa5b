"""The attention backend for this engine, chosen once from the device and dtype."""

from __future__ import annotations

import torch

from shardlm import kernels
from shardlm.attention.backend import AttentionBackend
from shardlm.config import EngineConfig
from shardlm.logger import init_logger

logger = init_logger(__name__)


def get_attention_backend(config: EngineConfig, device: torch.device,
                          block_size: int | None = None) -> AttentionBackend:
    """block_size: tokens per block of the cache it reads (default: the target's on each rank)."""
    block_size, dtype = block_size or config.cache.block_size, config.model.dtype
    if device.type == "cuda":
        from shardlm.attention.cuda import CudaAttention
        backend = CudaAttention(block_size, device, config.scheduler.max_num_seqs, config.model.max_model_len)
    else:
        kernel = kernels.paged_decode_attention() if dtype in (torch.float32, torch.bfloat16) else None
        if kernel is not None:
            from shardlm.attention.cpu_kernel import CpuKernelAttention
            backend = CpuKernelAttention(block_size, device, kernel)
        else:
            from shardlm.attention.torch_paged import TorchPagedAttention
            backend = TorchPagedAttention(block_size, device)
    logger.debug("Attention backend: %s", backend.name)
    return backend
