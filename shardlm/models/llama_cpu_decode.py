"""A decode step of a Llama stage's decoder layers in one C call (kernels/llama_decode.c).

At a few rows a decoder layer is a dozen small kernels, and on CPU the Python and operator
dispatch between them (slower still once each step's weight reads have flushed the caches)
costs about as much as the norms, rotary and attention themselves. This runs the same kernels,
in the same order, from C: the results are bit for bit those of the layer-by-layer path.

Under tensor parallel the C loop calls back into Python for the all-reduce after each
row-parallel product (the group's own all_reduce, the one the layer-by-layer path uses: the
same sums), so a rank's layers still run without Python between their kernels (the callbacks
cost a few percent of a step). Under decode context parallel it calls back twice per layer's
attention: to gather the group's query heads and to exchange the partial outputs, which the C
merge kernel combines as the layer path's does.

With LoRA adapters the step runs here too: after each linear the C loop adds each adapter's
delta to its segment of rows (the slot's A and B in the blocked kernel's panels), as the layer
path does.

It applies where every piece has its CPU kernel: float32 or bfloat16, plain Llama layers
(dense MLP, no q/k norm, and under TP no bias on the row-parallel linears) whose linears all
have one layout the C kernels read (the blocked kernel's float, 4-, 8-bit or FP8 panels at any rows;
plain weights on the skinny kernel up to the rows it was measured for), the CPU attention
backend, and a step of decodes only; not with enforce_eager. Anything else takes the
layer-by-layer path.
"""

from __future__ import annotations

import functools

import torch

from shardlm import kernels
from shardlm.distributed.parallel_state import get_tp_group
from shardlm.kernels import DTYPE_CODES, kv_format
from shardlm.kernels import decode_abi as abi
from shardlm.kernels.decode_abi import BLOCKED, BLOCKED_FP8, BLOCKED_INT4, BLOCKED_INT8, SKINNY
from shardlm.lora.batch import LoRABatch
from shardlm.lora.layers import PANEL_MAX_ROWS, LoRASlots


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def c_callback(method):
    """A method the C loop calls back: 0 when it returns, 1 when it raises, the exception (a dead
    or hung peer) kept in self.callback_error for __call__ to raise, since an exception cannot
    cross the C frames."""
    @functools.wraps(method)
    def call(self, *args) -> int:
        try:
            method(self, *args)
            return 0
        except BaseException as e:      # noqa: BLE001 (raised again by __call__)
            self.callback_error = e
            return 1
    return call


def all_reduce_in_place(group, x: torch.Tensor) -> None:
    out = group.all_reduce(x)
    if out is not x:
        x.copy_(out)


_QUANTIZED = {"blocked4": BLOCKED_INT4, "blocked8": BLOCKED_INT8, "fp8": BLOCKED_FP8}


def _layout(linear) -> tuple[int, int, int] | None:
    """(layout, group, bytes per scale) of a linear's weight where the C path has its kernel, else None."""
    if linear.quant is not None:
        kind, quant = _QUANTIZED.get(linear.quant.kernel), linear.quant
        group = 0 if quant.group == quant.in_features else quant.group      # 0: one group per row (per channel)
        return None if kind is None else (kind, group, quant.table_bytes)
    plan = linear.cpu_matmul
    if plan is None:
        return None
    if plan.blocked:
        return BLOCKED, 0, 0
    return (SKINNY, 0, 0) if plan.skinny_rows >= 1 else None


def _panel_addresses(linear, slot: int) -> list[int]:
    """A LoRA slot's A and B panels of a linear, or zeros where the adapter leaves it alone."""
    packed = () if linear.lora is None else linear.lora.packed[slot]
    return [_address(packed[0]), _address(packed[1])] if packed else [0, 0]


def _weight(linear) -> torch.Tensor:
    return linear.quant.packed if linear.quant is not None else linear.weight


def _misfit(layer, layout: tuple[int, int, int], dense_mlp: type) -> str | None:
    """Why the C path cannot run this decoder layer, or None: it runs a dense MLP on the CPU
    attention backend, every linear's weight in `layout` (float weights in the
    norms' dtype)."""
    attn = layer.self_attn
    if type(layer.mlp) is not dense_mlp:
        return f"its MLP is a {type(layer.mlp).__name__}"
    if getattr(attn.attn.backend, "kernel_qkv", None) is None:
        return "not the CPU kernels' attention backend"
    if not attn.attn.plain:
        return "attention the C kernels do not compute (a window, a soft-cap, sinks or latent values)"
    if attn.attn.k_cache is not None and kv_format(attn.attn.k_cache.dtype, layer.input_layernorm.weight.dtype) is None:
        return f"a KV cache of {attn.attn.k_cache.dtype}"
    if layer.input_layernorm.weight.dtype not in DTYPE_CODES:
        return f"dtype {layer.input_layernorm.weight.dtype}"
    linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    if get_tp_group().world_size > 1 and (attn.o_proj.bias is not None or layer.mlp.down_proj.bias is not None):
        # a row-parallel bias is added after the all-reduce, which the C loop does not do
        return "a row-parallel bias under tensor parallel"
    if not all(_layout(m) == layout and (m.quant is not None or m.weight.dtype == layer.input_layernorm.weight.dtype)
               for m in linears):
        return "its linears' weights are not all in one layout the C kernels read"
    return None


def _in_features(linear) -> int:
    return linear.quant.in_features if linear.quant is not None else linear.cpu_matmul.in_features


class FusedDecodeLayers:
    def __init__(self, layers: list, kernel):
        self.layers = layers
        self.scratch_elements, self.kernel = kernel
        first = layers[0]
        attn = first.self_attn
        self.dtype = first.input_layernorm.weight.dtype
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        layout, group, table_bytes = _layout(linears[0])     # the same for all (build checks)
        self.max_rows = min(m.cpu_matmul.skinny_rows for m in linears) if layout == SKINNY else 1 << 30
        # the cache's size is filled in by _layer_table (the cache is made after the model)
        self.shape = abi.LlamaDecodeModel(
            layers=len(layers), hidden_size=first.input_layernorm.weight.shape[0], heads=self.heads,
            kv_heads=self.kv_heads, head_dim=self.head_dim, intermediate=_in_features(first.mlp.down_proj),
            scale=attn.attn.scale, eps=first.input_layernorm.eps, residual_multiplier=first.residual_multiplier,
            dtype=DTYPE_CODES[self.dtype], layout=layout, group=group, table_bytes=table_bytes)
        self._table = None
        self._cache_address = None
        self._lora_cache: dict[tuple[int, ...], tuple] = {}     # slots of a step -> (LoRASlots.changes, tables)
        self.steps = 0          # decode steps taken here (Worker.fused_decode_steps)
        self.tp = get_tp_group()
        self._reduced: torch.Tensor | None = None      # the step's hidden, which the all-reduce sums in place
        self.callback_error: BaseException | None = None
        # kept as an attribute: C holds only its address
        self._all_reduce = (abi.ALL_REDUCE_CALLBACK(self._reduce_in_place) if self.tp.world_size > 1
                            else abi.ALL_REDUCE_CALLBACK())
        self.dcp = attn.attn.dcp
        self._exchange = abi.EXCHANGE_CALLBACK(self._exchange_in_place) if self.dcp.world_size > 1 else None
        self._exchanged: tuple[torch.Tensor, ...] = ()     # the step's q rows, q_all, send, every (DCP)
        self._dcp_buffers: tuple[torch.Tensor, ...] = ()
        self._lora_segments: torch.Tensor | None = None

    @classmethod
    def build(cls, model, dense_mlp: type) -> tuple[FusedDecodeLayers | None, str]:
        """(the one-call step of a LlamaModel stage whose dense MLPs are of class `dense_mlp`, or
        None where it does not apply; why not)."""
        layers = list(model.layers[model.start:model.end])
        if not layers:
            return None, "no decoder layers on this stage"
        attn = layers[0].self_attn.attn
        if attn.cp.world_size != attn.dcp.world_size:    # PCP: each group its own tokens
            return None, "prefill context parallel"
        if not hasattr(layers[0].self_attn, "qkv_proj"):
            return None, f"its attention is a {type(layers[0].self_attn).__name__}"
        layout = _layout(layers[0].self_attn.qkv_proj)
        why = "the weights' layout has no C kernel" if layout is None else next(
            (w for w in (_misfit(layer, layout, dense_mlp) for layer in layers) if w), None)
        if why is not None:
            return None, why
        kernel = kernels.llama_decode_layers()
        return (None, "the kernel library is not built") if kernel is None else (cls(layers, kernel), "")

    @c_callback
    def _reduce_in_place(self) -> None:
        """The C loop's all-reduce of the step's hidden rows."""
        all_reduce_in_place(self.tp, self._reduced)

    @c_callback
    def _exchange_in_place(self, phase: int) -> None:
        """Decode context parallel, from the C loop: phase 0 gathers the group's q rows into q_all,
        phase 1 every rank's partial outputs and log-sum-exps into every (the all-gathers of the
        layer path, layers/attention.py)."""
        q_rows, q_all, send, every = self._exchanged
        if phase == 0:
            q_all.copy_(self.dcp.all_gather(q_rows, dim=1))
        else:
            every.copy_(self.dcp.all_gather(send.unsqueeze(0), dim=0))

    def _dcp_hooks(self, scratch: torch.Tensor, T: int) -> abi.LlamaDecodeContextParallel:
        """The C loop's decode context parallel exchange and buffers for a step of T rows."""
        N, H, Hkv, D = self.dcp.world_size, self.heads, self.kv_heads, self.head_dim
        q_rows = scratch[:T * (H + 2 * Hkv) * D].view(T, -1)[:, :H * D]     # the scratch starts with qkv
        q_all, partial = (torch.empty(T, N * H * D, dtype=self.dtype) for _ in range(2))
        lse = torch.empty(T, N * H, dtype=torch.float32)
        send = torch.empty(T, N * H * (D + 1), dtype=torch.float32)
        every = torch.empty(N, T, N * H * (D + 1), dtype=torch.float32)
        self._exchanged = (q_rows, q_all, send, every)
        self._dcp_buffers = (partial, lse)          # alive until the call returns: C holds their addresses
        return abi.LlamaDecodeContextParallel(N, self.dcp.rank_in_group, self._exchange,
                                              *(t.data_ptr() for t in (q_all, partial, lse, send, every)))

    def _layer_table(self):
        """The weights and caches of every layer (rebuilt if the caches were reallocated)."""
        k_cache = self.layers[0].self_attn.attn.k_cache
        if self._table is None or k_cache.data_ptr() != self._cache_address:
            rows = []
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                rows.append(abi.LlamaDecodeLayer(*(_address(t) for t in (
                    layer.input_layernorm.weight, _weight(attn.qkv_proj), attn.qkv_proj.bias, _weight(attn.o_proj),
                    attn.o_proj.bias, layer.post_attention_layernorm.weight, _weight(mlp.gate_up_proj),
                    mlp.gate_up_proj.bias, _weight(mlp.down_proj), mlp.down_proj.bias,
                    *(norm.weight if norm is not None else None for norm in (attn.q_norm, attn.k_norm)),
                    attn.attn.k_cache, attn.attn.v_cache)), rope=int(layer.use_rope),
                    k_scale=attn.attn.k_scale, v_scale=attn.attn.v_scale))
            self._table, self._cache_address = (abi.LlamaDecodeLayer * len(rows))(*rows), k_cache.data_ptr()
            self.shape.num_blocks, self.shape.block_size = k_cache.shape[1], k_cache.shape[2]
            self.shape.kv_format = kv_format(k_cache.dtype, self.dtype)
        return self._table

    def _lora_tables(self, lora: LoRABatch) -> abi.LlamaDecodeLora | None:
        """The step's LoRA segments: their rows, and per segment and layer its slot's A and B panels
        of qkv, o, gate_up and down (NULL where the adapter leaves a linear alone). None where the
        layer path would not use the panels (it then runs). The panels are kept per order of slots
        until a slot changes."""
        if any(end - start > PANEL_MAX_ROWS for _, start, end in lora.segments):
            return None
        slots = tuple(slot for slot, _, _ in lora.segments)
        cached = self._lora_cache.get(slots)
        if cached is None or cached[0] != LoRASlots.changes:
            cached = self._lora_cache[slots] = (LoRASlots.changes, self._lora_panels(slots))
        if cached[1] is None:
            return None
        panels, rank = cached[1]
        segments = torch.tensor([[start, end] for _, start, end in lora.segments], dtype=torch.int64)
        self._lora_segments = segments          # alive until the call returns: C holds its address
        return abi.LlamaDecodeLora(panels, segments.data_ptr(), len(lora.segments), rank)

    def _lora_panels(self, slots: tuple[int, ...]):
        """(the [slots][layers] panel table, the adapters' rank), or None where a slot is not in panels."""
        linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                   for layer in self.layers]
        adapted = [m.lora for row in linears for m in row if m.lora is not None]
        if any(s.packed[slot] is None for s in adapted for slot in slots):      # not in panels
            return None
        rows = [abi.LlamaDecodeLoraLayer(*(address for m in row for address in _panel_addresses(m, slot)))
                for slot in slots for row in linears]
        return (abi.LlamaDecodeLoraLayer * len(rows))(*rows), adapted[0].max_rank if adapted else 0

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin, meta,
                 lora: LoRABatch | None = None):
        """(hidden, residual) after every layer of the stage, or None where this step does not apply.
        lora: which rows run on which LoRA slot (None: all on the base model)."""
        cos, signed_sin = cos_sin
        T = hidden.shape[0]
        if (T > self.max_rows or len(meta.buckets) != 1 or not meta.buckets[0].in_order
                or hidden.dtype != self.dtype or cos.dtype != self.dtype or not hidden.is_contiguous()
                or (residual is not None and not residual.is_contiguous())):
            return None
        adapters = None if lora is None else self._lora_tables(lora)
        if lora is not None and adapters is None:
            return None
        has_residual = residual is not None
        if not has_residual:
            residual = torch.empty_like(hidden)
        layers = self._layer_table()
        scratch = torch.empty(self.scratch_elements(self.shape, T, adapters.rank if adapters else 0), dtype=self.dtype)
        b = meta.buckets[0]
        step = abi.LlamaDecodeStep(
            hidden=hidden.data_ptr(), residual=residual.data_ptr(), tokens=T, has_residual=int(has_residual),
            cos=cos.data_ptr(), signed_sin=signed_sin.data_ptr(), slot_mapping=meta.slot_mapping.data_ptr(),
            block_tables=b.block_table.data_ptr(), context_lens=b.context_lens.data_ptr(),
            max_blocks=b.block_table.shape[1], scratch=scratch.data_ptr(), all_reduce=self._all_reduce)
        self._reduced, self.callback_error = hidden, None
        dcp = self._dcp_hooks(scratch, T) if self._exchange is not None else None
        rc = self.kernel(self.shape, layers, step, adapters, dcp)
        self._reduced, self._exchanged, self._dcp_buffers, self._lora_segments = None, (), (), None
        if rc == -2:
            raise self.callback_error
        if rc != 0:
            raise MemoryError("the fused decode kernels could not allocate their work buffers")
        self.steps += 1
        return hidden, residual
