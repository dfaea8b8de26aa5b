"""The CPU attention backend: decode sequences through shardlm's C kernel
(kernels/paged_attention.c), which reads K and V straight from the paged cache with no
gathered copy; prefill chunks through the torch path. A step of decodes only is one C call
per layer from the qkv projection: rotary embedding, cache write and attention (at one row
those are a dozen torch operators whose dispatch costs more than their work)."""

from __future__ import annotations

import torch

from shardlm import kernels
from shardlm.attention.torch_paged import AttentionBucket, TorchPagedAttention
from shardlm.kernels import DTYPE_CODES


class CpuKernelAttention(TorchPagedAttention):
    name = "cpu-kernel"

    def __init__(self, block_size: int, device: torch.device, kernel):
        """kernel: shardlm.kernels.paged_decode_attention() (float32 and bfloat16)."""
        super().__init__(block_size, device)
        self.kernel = kernel
        self.kernel_qkv = kernels.paged_decode_attention_qkv()

    def rotary_and_attend(self, layer, qkv: torch.Tensor, cos_sin, meta) -> torch.Tensor | None:
        cos, signed_sin = cos_sin
        if (self.shard is not None or len(meta.buckets) != 1 or not meta.buckets[0].in_order or qkv.stride(1) != 1
                or cos.dtype != qkv.dtype):
            return None
        b, T = meta.buckets[0], qkv.shape[0]
        out = torch.empty(T, layer.num_heads * layer.head_dim, dtype=qkv.dtype)
        Hkv, num_blocks, block_size, D = layer.k_cache.shape
        rc = self.kernel_qkv(out.data_ptr(), qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), signed_sin.data_ptr(),
                             layer.k_cache.data_ptr(), layer.v_cache.data_ptr(), meta.slot_mapping.data_ptr(),
                             b.block_table.data_ptr(), b.context_lens.data_ptr(), T, layer.num_heads, Hkv, D,
                             num_blocks, block_size, b.block_table.shape[1], layer.scale, DTYPE_CODES[qkv.dtype])
        if rc != 0:
            raise MemoryError("paged attention kernel could not allocate its work buffers")
        return out

    def decode(self, layer, q: torch.Tensor, b: AttentionBucket, lse: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, D] -> [B, H, D]; lse: a float32 [B, H] that receives each head's log-sum-exp."""
        B, H, D = q.shape
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
        Hkv, num_blocks, block_size, _ = layer.k_cache.shape
        rc = self.kernel(out.data_ptr(), q.data_ptr(), q.stride(0), layer.k_cache.data_ptr(),
                         layer.v_cache.data_ptr(), b.block_table.data_ptr(), b.context_lens.data_ptr(),
                         B, H, Hkv, D, num_blocks, block_size, b.block_table.shape[1], layer.scale,
                         DTYPE_CODES[q.dtype], lse.data_ptr() if lse is not None else None)
        if rc != 0:
            raise MemoryError("paged attention kernel could not allocate its work buffers")
        return out

    def decode_partial(self, layer, q: torch.Tensor, b: AttentionBucket) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        return self.decode(layer, q, b, lse).float(), lse
