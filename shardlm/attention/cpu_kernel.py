"""The CPU attention backend: decode sequences through shardlm's C kernel
(kernels/paged_attention.c), which reads K and V straight from the paged cache (in the model's
dtype or FP8) with no gathered copy; prefill chunks through the torch path. A step of decodes only is one C call
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
        """q [B, H, D] -> [B, H, D]; lse: a float32 [B, H] that receives each head's log-sum-exp
        (decode_partial). A sliding window or soft-capped logits: the torch path."""
        cache = kv_format(layer.k_cache.dtype, q.dtype)
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

    def decode_partial(self, layer, q: torch.Tensor, b: AttentionBucket) -> tuple[torch.Tensor, torch.Tensor]:
        if not layer.plain or kv_format(layer.k_cache.dtype, q.dtype) is None:
            return super().decode_partial(layer, q, b)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        return self.decode(layer, q, b, lse).float(), lse

    def prefill(self, layer, q: torch.Tensor, b: AttentionBucket) -> torch.Tensor:
        """Prompt chunks. A sequence's chunk of SPLIT_QUERIES queries or more (how long prompts
        arrive) attends to its cached prefix, which it sees whole, and to itself, causally, each by
        torch's CPU flash kernel without a mask (the causal one skips the blocks above the
        diagonal), merged by their log-sum-exps; shorter chunks go through the masked path
        together. Which way a sequence goes depends on it alone, so its outputs do not depend on
        the others in the step. Windows, soft-caps, context parallel: the masked path."""
        if _flash_with_lse is None or not layer.plain or b.shard is not None or b.key_offset is not None:
            return super().prefill(layer, q, b)
        starts, contexts = b.query_pos[:, 0].tolist(), b.context.tolist()
        long = [i for i, (start, ctx) in enumerate(zip(starts, contexts)) if ctx - start >= SPLIT_QUERIES]
        if not long:
            return super().prefill(layer, q, b)
        B, width = b.token_index.shape
        out = q.new_empty(B, width, layer.num_heads, layer.v_head_dim)
        short = [i for i in range(B) if i not in long]
        if short:
            out[short] = super().prefill(layer, q, _rows_of(b, short)).view(len(short), width, layer.num_heads, -1)
        kb, vb = gather(layer, _rows_of(b, long), q.dtype)                 # [Hkv, len(long), K, D]
        group = layer.num_heads // layer.num_kv_heads
        for j, i in enumerate(long):
            n, ctx = contexts[i] - starts[i], contexts[i]
            keys, values = (t[:, j, :ctx].repeat_interleave(group, dim=0).unsqueeze(0) for t in (kb, vb))
            out[i, :n] = _chunk_attention(q[b.token_index[i, :n]].transpose(0, 1).unsqueeze(0), keys, values,
                                          ctx - n, layer.scale)
        return out.view(B * width, layer.num_heads, -1)

    def prefill_partial(self, layer, q: torch.Tensor, b: AttentionBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's CPU flash attention, which returns the log-sum-exp beside the output (what
        scaled_dot_product_attention runs, without the LSE): several times the float32 path's
        speed on long prompts."""
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


# torch's CPU flash attention with its log-sum-exp (an aten op without a public wrapper)
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# a chunk of this many queries or more attends to its prefix and itself apart (prefill)
SPLIT_QUERIES = 64


def _rows_of(b: AttentionBucket, rows: list[int]) -> AttentionBucket:
    """The prompt bucket of b's sequences `rows` (no window table or context parallel shard)."""
    if len(rows) == b.token_index.shape[0]:
        return b
    index = torch.tensor(rows)
    return AttentionBucket(b.token_index[index], b.block_table[index], b.context_lens[index], False,
                           query_pos=b.query_pos[index], context=b.context[index], block_size=b.block_size)


def _chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int,
                     scale: float) -> torch.Tensor:
    """q [1, H, Q, D], keys and values [1, H, prefix + Q, D]: the queries at the last Q positions,
    each attending to the prefix and to the chunk up to itself. -> [Q, H, Dv] in q's dtype."""
    out, lse = _flash_with_lse(q, keys[:, :, prefix:], values[:, :, prefix:], 0.0, True, scale=scale)
    if prefix:
        before, before_lse = _flash_with_lse(q, keys[:, :, :prefix], values[:, :, :prefix], 0.0, False, scale=scale)
        top = torch.maximum(lse, before_lse)
        w_own, w_before = torch.exp(lse - top).unsqueeze(-1), torch.exp(before_lse - top).unsqueeze(-1)
        out = (out.float() * w_own + before.float() * w_before) / (w_own + w_before)
    return out[0].transpose(0, 1).to(q.dtype)
