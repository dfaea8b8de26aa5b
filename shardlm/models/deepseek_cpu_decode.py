"""A decode step of a DeepSeek stage's decoder layers in one C call (kernels/latent_decode.c).

The same reason as models/llama_cpu_decode.py: at a decode step's few rows a layer is dozens of
small kernels, and DeepSeek's are more than Llama's (the q LoRA, the latent and its norm, the
rotary parts, two per-head products, the router and each chosen expert). The C loop runs the
layer path's kernels in its order, so its results are the layer path's bit for bit; it calls
back into Python for the all-reduces (tensor parallel, and the experts' group) and for each MoE
layer's routing: FusedMoE.route (GroupedTopK), the expert load counts and EPLB's choice of copy
run there, as in the layer path, and the C loop runs the chosen experts.

It applies where every product runs on the blocked kernel's float panels (float32 on AVX-512,
bfloat16 where the linears' weights go there; the router's float32 weight too), the KV cache
holds the model's dtype, on the CPU attention backend, for steps of decodes only, without LoRA,
context parallel, or data parallel replicas whose MoE layers run together (DP + EP); not with
enforce_eager. Anything else takes the layer-by-layer path.
"""

from __future__ import annotations

import ctypes

import torch

from shardlm import kernels
from shardlm.distributed.parallel_state import get_tp_group
from shardlm.kernels import DTYPE_CODES, kv_format
from shardlm.kernels import decode_abi as abi
from shardlm.layers import moe as moe_layer
from shardlm.models.llama_cpu_decode import all_reduce_in_place, c_callback


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _in_panels(linear) -> bool:
    plan = getattr(linear, "cpu_matmul", None)
    return linear.quant is None and plan is not None and plan.blocked and linear.bias is None


def _linears(layer) -> list:
    attn, mlp = layer.self_attn, layer.mlp
    found = [attn.q_a_proj, attn.q_b_proj] if attn.q_lora else [attn.q_proj]
    found += [attn.kv_a_proj_with_mqa, attn.o_proj]
    dense = getattr(mlp, "shared_experts", mlp)
    return found + ([dense.gate_up_proj, dense.down_proj] if dense is not None else [])


def _misfit(layer) -> str | None:
    """Why the C step cannot run this decoder layer, or None."""
    attn, mlp = layer.self_attn, layer.mlp
    if getattr(attn.attn.backend, "latent_kernel", None) is None:
        return "not the CPU kernels' attention backend"
    if attn.attn.dcp.world_size > 1 or attn.attn.cp.world_size > 1:
        return "context parallel"
    if attn.kv_b_proj.uk_panels is None or not all(_in_panels(m) for m in _linears(layer)):
        return "its weights are not all in the blocked kernel's float panels"
    if layer.residual_multiplier != 1.0 or not layer.use_rope:
        return "a residual multiplier or a layer without rotary embedding"
    experts = getattr(mlp, "experts", None)
    if experts is not None and (experts.panels is None or experts.w13_bias is not None or not mlp.gate.in_panels
                                or experts.activation.limit is not None):
        return "its experts or router are not in the blocked kernel's panels"
    return None


class FusedLatentLayers:
    def __init__(self, layers: list, kernel):
        self.layers = layers
        self.scratch_elements, self.kernel = kernel
        first = layers[0]
        attn = first.self_attn
        self.dtype = first.input_layernorm.weight.dtype
        self.moes = [getattr(layer.mlp, "experts", None) for layer in layers]
        moe = next((m for m in self.moes if m is not None), None)
        dense = next((layer.mlp for layer, m in zip(layers, self.moes) if m is None), None)
        shared = None if moe is None else next(layer.mlp.shared_experts for layer, m in zip(layers, self.moes)
                                               if m is not None)
        self.tp = get_tp_group()
        self.moe_group = None if moe is None else moe.reduce_group
        self.shape = abi.LatentDecodeModel(
            layers=len(layers), hidden_size=first.input_layernorm.weight.shape[0], heads=attn.num_heads,
            q_lora_rank=attn.q_lora or 0, nope_dim=attn.nope, rope_dim=attn.rope, latent_dim=attn.rank,
            v_dim=attn.v, intermediate=0 if dense is None else dense.down_proj.cpu_matmul.in_features,
            num_experts=0 if moe is None else moe.num_experts, top_k=0 if moe is None else moe.top_k,
            expert_intermediate=0 if moe is None else moe.inter,
            shared_intermediate=0 if shared is None else shared.down_proj.cpu_matmul.in_features,
            scale=attn.attn.scale, eps=first.input_layernorm.eps, dtype=DTYPE_CODES[self.dtype],
            tp_size=self.tp.world_size, expert_group_size=1 if moe is None else moe.reduce_group.world_size)
        self._table = None
        self._cache_address = None
        self.steps = 0
        self.callback_error: BaseException | None = None
        self._routing: tuple[torch.Tensor, ...] = ()     # the step's logits, slots, weights
        # kept as attributes: C holds only their addresses
        self._reduce = abi.LATENT_REDUCE_CALLBACK(self._reduce_in_place)
        self._route = abi.LATENT_ROUTE_CALLBACK(self._route_in_place)

    @classmethod
    def build(cls, model) -> tuple[FusedLatentLayers | None, str]:
        """(the one-call step of a stage of DeepSeek layers, or None where it does not apply; why not)."""
        layers = list(model.layers[model.start:model.end])
        if not layers:
            return None, "no decoder layers on this stage"
        why = next((w for w in map(_misfit, layers) if w), None)
        if why is not None:
            return None, why
        if any(layer.input_layernorm.weight.dtype != layers[0].input_layernorm.weight.dtype for layer in layers):
            return None, "layers of different dtypes"
        kernel = kernels.latent_decode_layers()
        return (None, "the kernel library is not built") if kernel is None else (cls(layers, kernel), "")

    @c_callback
    def _reduce_in_place(self, address: int, elements: int, group: int) -> None:
        """The C loop's all-reduce of `elements` values at `address` over the tensor parallel group (0)
        or the experts' (1)."""
        x = torch.frombuffer((ctypes.c_byte * (elements * self.dtype.itemsize)).from_address(address),
                             dtype=self.dtype)
        all_reduce_in_place(self.tp if group == 0 else self.moe_group, x)

    @c_callback
    def _route_in_place(self, layer: int) -> None:
        """Layer `layer`'s routing from the C loop: the layer path's (FusedMoE.route_and_count, and its
        choice of copies) on the step's router logits, into the slots and weights C reads."""
        moe = self.moes[layer]
        logits, slots, weights = self._routing
        chosen, ids = moe.route_and_count(logits)
        slots.copy_(moe.local_slots(ids))
        weights.copy_(chosen)

    def _layer_table(self):
        """The weights and caches of every layer (rebuilt if the caches were reallocated)."""
        cache = self.layers[0].self_attn.attn.k_cache
        if self._table is None or cache.data_ptr() != self._cache_address:
            rows = []
            for layer, moe in zip(self.layers, self.moes):
                attn, mlp = layer.self_attn, layer.mlp
                dense = mlp.shared_experts if moe is not None else mlp
                up = attn.kv_b_proj
                rows.append(abi.LatentDecodeLayer(
                    *(_address(t) for t in (
                        layer.input_layernorm.weight, attn.q_a_proj.weight if attn.q_lora else None,
                        attn.q_a_layernorm.weight if attn.q_lora else None,
                        (attn.q_b_proj if attn.q_lora else attn.q_proj).weight, attn.kv_a_proj_with_mqa.weight,
                        attn.kv_a_layernorm.weight, up.uk_panels, up.uv_panels, attn.o_proj.weight,
                        layer.post_attention_layernorm.weight, None if dense is None else dense.gate_up_proj.weight,
                        None if dense is None else dense.down_proj.weight, None if moe is None else mlp.gate.weight,
                        None if moe is None else moe.w13, None if moe is None else moe.w2)),
                    up.uk_panels.stride(0), up.uv_panels.stride(0), 0 if moe is None else moe.w13.stride(0),
                    0 if moe is None else moe.w2.stride(0), attn.attn.k_cache.data_ptr(), attn.attn.k_scale))
            self._table, self._cache_address = (abi.LatentDecodeLayer * len(rows))(*rows), cache.data_ptr()
            self.shape.block_size = cache.shape[2]
        return self._table

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin, meta, lora=None):
        """(hidden, residual) after every layer of the stage, or None where this step does not apply."""
        cos, signed_sin = cos_sin
        T = hidden.shape[0]
        cache = self.layers[0].self_attn.attn.k_cache
        if (lora is not None or len(meta.buckets) != 1 or not meta.buckets[0].in_order
                or moe_layer.replicas_in_lock_step() or hidden.dtype != self.dtype or cos.dtype != self.dtype
                or kv_format(cache.dtype, self.dtype) != 0 or not hidden.is_contiguous()
                or (residual is not None and not residual.is_contiguous())):
            return None
        has_residual = residual is not None
        if not has_residual:
            residual = torch.empty_like(hidden)
        layers = self._layer_table()
        scratch = torch.empty(self.scratch_elements(self.shape, T), dtype=self.dtype)
        E, experts, k = self.shape.hidden_size, self.shape.num_experts, self.shape.top_k
        router_input = torch.empty(T, E if experts else 0, dtype=torch.float32)
        self._routing = (torch.empty(T, experts, dtype=torch.float32), torch.empty(T, k, dtype=torch.int32),
                         torch.empty(T, k, dtype=torch.float32))
        b = meta.buckets[0]
        step = abi.LatentDecodeStep(
            hidden=hidden.data_ptr(), residual=residual.data_ptr(), tokens=T, has_residual=int(has_residual),
            cos=cos.data_ptr(), signed_sin=signed_sin.data_ptr(), slot_mapping=meta.slot_mapping.data_ptr(),
            block_tables=b.block_table.data_ptr(), context_lens=b.context_lens.data_ptr(),
            max_blocks=b.block_table.shape[1], scratch=scratch.data_ptr(), router_input=router_input.data_ptr(),
            logits=self._routing[0].data_ptr(), slots=self._routing[1].data_ptr(),
            weights=self._routing[2].data_ptr(), all_reduce=self._reduce, route=self._route)
        self.callback_error = None
        rc = self.kernel(self.shape, layers, step)
        self._routing = ()
        if rc == -2:
            raise self.callback_error
        if rc != 0:
            raise MemoryError("the fused decode kernels could not allocate their work buffers")
        self.steps += 1
        return hidden, residual
