"""The CPU attention backend: decode sequences through shardlm's C kernel
(kernels/paged_attention.c), which reads K and V straight from the paged cache with no
gathered copy; prefill chunks through the torch path."""

from __future__ import annotations

import torch

from shardlm.attention.torch_paged import AttentionBucket, TorchPagedAttention


class CpuKernelAttention(TorchPagedAttention):
    name = "cpu-kernel"

    def __init__(self, block_size: int, device: torch.device, kernel):
        """kernel: shardlm.kernels.paged_decode_attention() (float32 and bfloat16)."""
        super().__init__(block_size, device)
        self.kernel = kernel

    def decode(self, layer, q: torch.Tensor, b: AttentionBucket) -> torch.Tensor:
        B, H, D = q.shape
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
        Hkv, num_blocks, block_size, _ = layer.k_cache.shape
        rc = self.kernel(out.data_ptr(), q.data_ptr(), q.stride(0), layer.k_cache.data_ptr(),
                         layer.v_cache.data_ptr(), b.block_table.data_ptr(), b.context_lens.data_ptr(),
                         B, H, Hkv, D, num_blocks, block_size, b.block_table.shape[1], layer.scale,
                         0 if q.dtype == torch.float32 else 1)
        if rc != 0:
            raise MemoryError("paged attention kernel could not allocate its work buffers")
        return out
