"""The CPU attention backend: decode sequences through shardlm's C kernel
(kernels/paged_attention.c), which reads K and V straight from the paged cache (in the model's
dtype or FP8) with no gathered copy; prompt chunks through the tiled causal attention of
kernels/prefill_attention.c, which reads the cache too; latent attention's decode (every head
against one shared row per token) through kernels/latent_attention.c. A step of decodes only is one C call
per layer from the qkv projection: rotary embedding, cache write and attention (at one row
those are a dozen torch operators whose dispatch costs more than their work)."""

from __future__ import annotations

import torch

from shardlm import kernels
from shardlm.attention.torch_paged import AttentionBucket, TorchPagedAttention, gather
from shardlm.kernels import DTYPE_CODES, kv_format


class CpuKernelAttention(TorchPagedAttention):
    name = "cpu-kernel"

    def __init__(self, block_size: int, device: torch.device, kernel):
        """kernel: shardlm.kernels.paged_decode_attention() (float32 and bfloat16)."""
        super().__init__(block_size, device)
        self.kernel = kernel
        self.kernel_qkv = kernels.paged_decode_attention_qkv()
        self.prefill_kernel = kernels.paged_prefill_attention()
        self.latent_kernel = kernels.latent_decode_attention()

    def rotary_and_attend(self, layer, qkv: torch.Tensor, cos_sin, meta) -> torch.Tensor | None:
        cos, signed_sin = cos_sin if cos_sin is not None else (None, None)     # None: no rotary embedding
        cache = kv_format(layer.k_cache.dtype, qkv.dtype)
        if (self.shard is not None or len(meta.buckets) != 1 or not meta.buckets[0].in_order or qkv.stride(1) != 1
                or (cos is not None and cos.dtype != qkv.dtype) or not layer.plain or cache is None):
            return None
        b, T = meta.buckets[0], qkv.shape[0]
        out = torch.empty(T, layer.num_heads * layer.head_dim, dtype=qkv.dtype)
        Hkv, num_blocks, block_size, D = layer.k_cache.shape
        rope = (cos.data_ptr(), signed_sin.data_ptr()) if cos is not None else (None, None)
        rc = self.kernel_qkv(out.data_ptr(), qkv.data_ptr(), qkv.stride(0), *rope,
                             layer.k_cache.data_ptr(), layer.v_cache.data_ptr(), meta.slot_mapping.data_ptr(),
                             b.block_table.data_ptr(), b.context_lens.data_ptr(), T, layer.num_heads, Hkv, D,
                             num_blocks, block_size, b.block_table.shape[1], layer.scale, DTYPE_CODES[qkv.dtype],
                             cache, layer.k_scale, layer.v_scale)
        if rc != 0:
            raise MemoryError("paged attention kernel could not allocate its work buffers")
        return out

    def decode(self, layer, q: torch.Tensor, b: AttentionBucket, lse: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, D] -> [B, H, Dv]; lse: a float32 [B, H] that receives each head's log-sum-exp
        (decode_partial). Latent attention: its own kernel. A sliding window or soft-capped logits:
        the torch path."""
        cache = kv_format(layer.k_cache.dtype, q.dtype)
        if self._latent_applies(layer, q, cache):
            return self._latent_decode(layer, q, b, cache, lse)
        if not layer.plain or cache is None:
            return super().decode(layer, q, b)
        B, H, D = q.shape
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
        Hkv, num_blocks, block_size, _ = layer.k_cache.shape
        rc = self.kernel(out.data_ptr(), q.data_ptr(), q.stride(0), layer.k_cache.data_ptr(),
                         layer.v_cache.data_ptr(), b.block_table.data_ptr(), b.context_lens.data_ptr(),
                         B, H, Hkv, D, num_blocks, block_size, b.block_table.shape[1], layer.scale,
                         DTYPE_CODES[q.dtype], cache, layer.k_scale, layer.v_scale,
                         lse.data_ptr() if lse is not None else None)
        if rc != 0:
            raise MemoryError("paged attention kernel could not allocate its work buffers")
        return out

    def _latent_applies(self, layer, q: torch.Tensor, cache: int | None) -> bool:
        """Latent attention's values inside its one KV head's keys, and nothing else unusual."""
        return (layer.values_in_keys and self.latent_kernel is not None and cache is not None
                and layer.num_kv_heads == 1 and layer.sliding_window is None and layer.logit_softcap is None
                and layer.sinks is None and q.stride(2) == 1 and q.stride(1) == layer.head_dim)

    def _latent_decode(self, layer, q: torch.Tensor, b: AttentionBucket, cache: int,
                       lse: torch.Tensor | None) -> torch.Tensor:
        """Latent attention's decode (kernels/latent_attention.c): every head against the shared rows."""
        B, H, D = q.shape
        out = torch.empty(B, H, layer.v_head_dim, dtype=q.dtype)
        table, contexts = b.block_table, b.context_lens
        rc = self.latent_kernel(out.data_ptr(), q.data_ptr(), q.stride(0), layer.k_cache.data_ptr(), table.data_ptr(),
                                table.shape[1], contexts.data_ptr(), B, H, D, layer.v_head_dim, layer.k_cache.shape[2],
                                layer.scale, DTYPE_CODES[q.dtype], cache, layer.k_scale,
                                lse.data_ptr() if lse is not None else None)
        if rc != 0:
            raise MemoryError("latent attention kernel could not allocate its work buffers")
        return out

    def decode_partial(self, layer, q: torch.Tensor, b: AttentionBucket) -> tuple[torch.Tensor, torch.Tensor]:
        cache = kv_format(layer.k_cache.dtype, q.dtype)
        if cache is None or not (layer.plain or self._latent_applies(layer, q, cache)):
            return super().decode_partial(layer, q, b)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        return self.decode(layer, q, b, lse).float(), lse

    def prefill(self, layer, q: torch.Tensor, b: AttentionBucket) -> torch.Tensor:
        """Prompt chunks: shardlm's tiled causal attention (kernels/prefill_attention.c), which
        reads the paged cache and skips the key blocks above the diagonal. Windows, soft-caps and
        context parallel: the torch path."""
        out = self._tiled(layer, q, b)
        return super().prefill(layer, q, b) if out is None else out

    def prefill_partial(self, layer, q: torch.Tensor, b: AttentionBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The tiled attention with each query's log-sum-exp (layers with attention sinks); under
        context parallel, torch's CPU flash attention with a mask and its log-sum-exp (several
        times the float32 path's speed on long prompts)."""
        lse = torch.empty(b.token_index.numel(), layer.num_heads, dtype=torch.float32)
        out = self._tiled(layer, q, b, lse)
        if out is not None:
            return out.float(), lse
        if _flash_with_lse is None or layer.logit_softcap is not None or layer.values_in_keys:
            return super().prefill_partial(layer, q, b)
        kb, vb = gather(layer, b, q.dtype)                                 # [Hkv, B, K, D]
        qb = q[b.token_index].transpose(1, 2)                     # [B, Hq, Q, D]
        group = qb.shape[1] // layer.num_kv_heads
        kb, vb = (t.transpose(0, 1).repeat_interleave(group, dim=1) for t in (kb, vb))
        out, lse = _flash_with_lse(qb, kb, vb, 0.0, False, attn_mask=b.additive_mask(q.dtype, layer.sliding_window),
                                    scale=layer.scale)
        # a query none of whose keys are on this rank: zeros, and -inf (it reports 0)
        lse = lse.masked_fill(b.keyless, float("-inf"))                    # [B, Hq, Q]
        Hq, D = qb.shape[1], qb.shape[3]
        return out.transpose(1, 2).reshape(-1, Hq, D).float(), lse.transpose(1, 2).reshape(-1, Hq)

    def _tiled(self, layer, q: torch.Tensor, b: AttentionBucket, lse: torch.Tensor | None = None
               ) -> torch.Tensor | None:
        """The bucket's attention by the C kernel -> [B * Q, H, Dv] (lse: a float32 [B * Q, H] it
        fills), or None where the kernel does not apply."""
        cache = kv_format(layer.k_cache.dtype, q.dtype)
        if (self.prefill_kernel is None or cache is None or layer.sliding_window is not None
                or layer.logit_softcap is not None or b.shard is not None or b.key_offset is not None
                or q.stride(2) != 1 or q.stride(1) != layer.head_dim):
            return None
        B, width = b.token_index.shape
        out = q.new_empty(B * width, layer.num_heads, layer.v_head_dim)
        Hkv, num_blocks, block_size, D = layer.k_cache.shape
        token_index, starts = b.token_index.contiguous(), b.query_pos[:, 0].contiguous()
        contexts, table = b.context.contiguous(), b.block_table.contiguous()
        v_cache = None if layer.values_in_keys else layer.v_cache.data_ptr()
        rc = self.prefill_kernel(out.data_ptr(), q.data_ptr(), q.stride(0), token_index.data_ptr(), width,
                                 starts.data_ptr(), contexts.data_ptr(), layer.k_cache.data_ptr(), v_cache,
                                 table.data_ptr(), table.shape[1], B, layer.num_heads, Hkv, D, layer.v_head_dim,
                                 num_blocks, block_size, layer.scale, DTYPE_CODES[q.dtype], cache, layer.k_scale,
                                 layer.v_scale, lse.data_ptr() if lse is not None else None)
        if rc != 0:
            raise MemoryError("prefill attention kernel could not allocate its work buffers")
        return out


# torch's CPU flash attention with its log-sum-exp (an aten op without a public wrapper)
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
