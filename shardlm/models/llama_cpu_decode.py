"""A decode step of a Llama stage's decoder layers in one C call (kernels/llama_decode.c).

At a few rows a decoder layer is a dozen small kernels, and on CPU the Python and operator
dispatch between them (slower still once each step's weight reads have flushed the caches)
costs about as much as the norms, rotary and attention themselves. This runs the same kernels,
in the same order, from C: the results are bit for bit those of the layer-by-layer path.

It applies where every piece has its CPU kernel: one tensor parallel rank, float32 or
bfloat16, plain Llama layers (dense MLP, no q/k norm) whose linears all use the skinny kernel
at the step's rows, the CPU attention backend, and a step of decodes only. Anything else takes
the layer-by-layer path.
"""

from __future__ import annotations

import torch

from shardlm import kernels
from shardlm.distributed.parallel_state import get_tp_group
from shardlm.kernels import DTYPE_CODES


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class FusedDecodeLayers:
    def __init__(self, layers: list, kernel):
        self.layers, self.kernel = layers, kernel
        first = layers[0]
        attn = first.self_attn
        self.dtype = first.input_layernorm.weight.dtype
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden_size = first.input_layernorm.weight.shape[0]
        self.inter = first.mlp.down_proj.cpu_matmul.in_features
        self.eps, self.scale = first.input_layernorm.eps, attn.attn.scale
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        plans = [m.cpu_matmul for m in linears]
        self.blocked = plans[0].blocked          # all blocked, or all plain (build checks)
        self.max_rows = 1 << 30 if self.blocked else min(p.skinny_rows for p in plans)
        self._table: torch.Tensor | None = None
        self._cache_address = None

    @classmethod
    def build(cls, model) -> FusedDecodeLayers | None:
        """For a LlamaModel stage, or None where the fused path does not apply to it."""
        from shardlm.models.llama import LlamaMLP

        layers = list(model.layers[model.start:model.end])
        if not layers or get_tp_group().world_size != 1:
            return None
        first_plan = layers[0].self_attn.qkv_proj.cpu_matmul
        for layer in layers:
            attn = layer.self_attn
            if (first_plan is None or type(layer.mlp) is not LlamaMLP or attn.q_norm is not None
                    or getattr(attn.attn.backend, "kernel_qkv", None) is None      # the CPU backend only
                    or layer.input_layernorm.weight.dtype not in DTYPE_CODES
                    or any(m.quant is not None or m.cpu_matmul is None
                           or m.cpu_matmul.blocked != first_plan.blocked
                           or not (m.cpu_matmul.blocked or m.cpu_matmul.skinny_rows >= 1)
                           or m.weight.dtype != layer.input_layernorm.weight.dtype
                           for m in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))):
                return None
        kernel = kernels.llama_decode_layers()
        return None if kernel is None else cls(layers, kernel)

    def _layer_table(self) -> torch.Tensor:
        """The weight and cache addresses of every layer (rebuilt if the caches were reallocated)."""
        caches = self.layers[0].self_attn.attn.k_cache.data_ptr()
        if self._table is None or caches != self._cache_address:
            rows = []
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                rows.append([_address(t) for t in (
                    layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
                    attn.o_proj.bias, layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
                    mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias, attn.attn.k_cache,
                    attn.attn.v_cache)])
            self._table, self._cache_address = torch.tensor(rows, dtype=torch.int64), caches
        return self._table

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin, meta):
        """(hidden, residual) after every layer of the stage, or None where this step does not apply."""
        cos, signed_sin = cos_sin
        T = hidden.shape[0]
        if (T > self.max_rows or len(meta.buckets) != 1 or not meta.buckets[0].in_order
                or hidden.dtype != self.dtype or cos.dtype != self.dtype or not hidden.is_contiguous()
                or (residual is not None and not residual.is_contiguous())):
            return None
        has_residual = residual is not None
        if not has_residual:
            residual = torch.empty_like(hidden)
        H, Hkv, D, inter = self.heads, self.kv_heads, self.head_dim, self.inter
        scratch = torch.empty(T * ((H + 2 * Hkv) * D + H * D + 3 * inter), dtype=self.dtype)
        b = meta.buckets[0]
        k_cache = self.layers[0].self_attn.attn.k_cache
        rc = self.kernel(self._layer_table().data_ptr(), len(self.layers), hidden.data_ptr(), residual.data_ptr(),
                         int(has_residual), cos.data_ptr(), signed_sin.data_ptr(), meta.slot_mapping.data_ptr(),
                         b.block_table.data_ptr(), b.context_lens.data_ptr(), T, self.hidden_size, H, Hkv, D, inter,
                         k_cache.shape[1], k_cache.shape[2], b.block_table.shape[1], self.scale, self.eps,
                         DTYPE_CODES[self.dtype], int(self.blocked), scratch.data_ptr())
        if rc != 0:
            raise MemoryError("the fused decode kernels could not allocate their work buffers")
        return hidden, residual
