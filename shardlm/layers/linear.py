"""Linear layers split across the tensor parallel group (Megatron-LM), whose parameters know how
to load their own slice from the checkpoint.

- ColumnParallelLinear: each rank holds a slice of the output rows; no communication.
- MergedColumnParallelLinear: several column-parallel matrices stacked (gate_proj, up_proj).
- QKVParallelLinear: q, k, v by heads; KV heads are replicated when tp exceeds them.
- RowParallelLinear: each rank holds a slice of the input columns; the partial outputs are
  summed by an all-reduce, and the bias is added once, after it.

Each parameter's `weight_loader(param, loaded, shard_id)` copies its part of a checkpoint tensor.
`loaded` may be a safetensors slice: only the rows or columns this rank keeps are read from
disk, never the whole tensor. At tp=1 the layers are plain linears with no collectives.

On CPU, each weight's layout and kernels (shardlm's blocked kernel on AVX-512 CPUs; elsewhere
its skinny kernel for decode rows and oneDNN for the rest) are chosen after loading:
layers/cpu_matmul.py.

A weight loaded from an FP8 checkpoint tensor (model_loader/fp8.py) arrives dequantized, with the
scales of the rows and columns read (`fp8_scale_table`): the layer notes them per row and group
of columns as it places the rows, and after loading keeps the weight as FP8 again, exactly
(layers/fp8.py).
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.distributed.parallel_state import get_tp_group
from shardlm.layers.cpu_matmul import CpuMatmul, linear, prepare_weight
from shardlm.layers.fp8 import Fp8LinearWeight, from_scales, note_scales, quantize_fp8
from shardlm.layers.quantization import QuantizedWeight, check_group_size, quantize_rtn
from shardlm.logger import init_logger

logger = init_logger(__name__)


def checkpoint_shape(loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_checkpoint(loaded, dim: int | None = None, start: int = 0, size: int | None = None) -> torch.Tensor:
    """`loaded` (a tensor or a safetensors slice), or only [start, start + size) along `dim`."""
    if dim is None:
        return loaded if isinstance(loaded, torch.Tensor) else loaded[:]
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def default_weight_loader(param: torch.Tensor, loaded, shard_id=None) -> None:
    shape = checkpoint_shape(loaded)
    if tuple(param.shape) != shape:
        raise ValueError(f"Checkpoint tensor has shape {shape}, "
                         f"the model expects {tuple(param.shape)}: the config does not match the weights.")
    param.data.copy_(read_checkpoint(loaded))


def load_slice(param: torch.Tensor, loaded, dim: int, start: int, size: int) -> None:
    """Copy rows/columns [start, start + size) along `dim` of the checkpoint tensor into param."""
    full = checkpoint_shape(loaded)
    expected = tuple(param.shape[:dim]) + (full[dim],) + tuple(param.shape[dim + 1:])
    if full != expected or start + size > full[dim] or size != param.shape[dim]:
        raise ValueError(f"Checkpoint tensor has shape {full}; this rank expects {size} of dimension {dim} "
                         f"starting at {start} into {tuple(param.shape)}: the config does not match the weights.")
    param.data.copy_(read_checkpoint(loaded, dim, start, size))


class Linear(nn.Module):
    """A replicated linear (every rank holds all of it); the base of the parallel ones."""

    quant: QuantizedWeight | Fp8LinearWeight | None = None     # set by quantize(): the weight is then None
    cpu_matmul: CpuMatmul | None = None      # on CPU: the weight's layout and kernels (cpu_matmul.py)
    lora = None                              # with --enable-lora: this layer's adapter slots (lora/layers.py)
    # the FP8 checkpoint's scales of this rank's rows [out, in / group] (NaN: a row not from FP8)
    fp8_scales: torch.Tensor | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features     # this rank's
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        for p in self.parameters():
            p.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        default_weight_loader(param, loaded)
        self.note_fp8_scales(param, loaded, 0, self.out_features, 0, 0)

    def note_fp8_scales(self, param, loaded, row: int, rows: int, first_row: int, first_column: int) -> None:
        """Where `loaded`, an FP8 checkpoint tensor, filled rows [row, row + rows) of this rank's
        weight from its rows and columns from (first_row, first_column): note their scales."""
        table_of = getattr(loaded, "fp8_scale_table", None)
        if param is not self.weight or table_of is None:
            return
        table = table_of(range(first_row, first_row + rows), range(first_column, first_column + self.in_features))
        self.fp8_scales = note_scales(self.fp8_scales, (self.out_features,), table, slice(row, row + rows))

    def quantize(self, config, row_absmax: torch.Tensor | None = None) -> None:
        """Replace the loaded float weight by its weight-only quantized form (config: QuantizationConfig)."""
        w = self.weight.data
        if config.method.startswith("fp8"):
            self.quant = Fp8LinearWeight(*quantize_fp8(w, config.method, row_absmax), w.dtype)
            self.weight = None
            return
        group = check_group_size(config.method, config.group_size, w.shape[1], type(self).__name__)
        self.quant = QuantizedWeight(*quantize_rtn(w, config.bits, group, row_absmax), config.bits, w.dtype)
        self.weight = None

    def use_quantized(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int) -> None:
        """Take this rank's already-quantized weight (e.g. from a GGUF file) instead of the float one."""
        if tuple(q.shape) != tuple(self.weight.shape):
            raise ValueError(f"A quantized tensor of shape {tuple(q.shape)} for a weight of shape "
                             f"{tuple(self.weight.shape)}: the quantized file does not match the config.")
        # read on the CPU; kept where the activations are (on a GPU, C kernels must not see them)
        q, scales, mins = (t.to(self.weight.device) for t in (q, scales, mins))
        self.quant = QuantizedWeight(q, scales, mins, bits, self.weight.dtype)
        self.weight = None

    def process_weights_after_loading(self) -> None:
        if self.quant is None and self.fp8_scales is not None:
            self._keep_fp8()
        if self.quant is not None:
            return
        packed, self.cpu_matmul = prepare_weight(self.weight.data)
        if packed is not None:
            self.weight = nn.Parameter(packed, requires_grad=False)

    def _keep_fp8(self) -> None:
        """The weight loaded from FP8 tensors, FP8 again with their scales (exact: a float weight of
        8 or more significant bits holds q * scale closely enough to give q back); in float where
        some rows came from a float tensor or the groups do not suit the kernels."""
        scales, w, self.fp8_scales = self.fp8_scales, self.weight.data, None
        group = self.in_features // scales.shape[1]
        if scales.isnan().any() or group % 2:
            logger.info("%s keeps its FP8 checkpoint weight in %s (%s)", type(self).__name__, w.dtype,
                        f"groups of {group} columns" if group % 2 else "some of its rows are not FP8")
            return
        scales = scales.to(w.device)                # noted on the CPU as the checkpoint was read
        quant = Fp8LinearWeight(from_scales(w, scales), scales, w.dtype)
        self.quant, self.weight = quant, None

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.matmul(x, bias)
        return linear(x, self.weight, bias, self.cpu_matmul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_lora(x, self.product(x, self.bias))

    def with_lora(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out plus the step's adapter deltas, where this layer has adapters."""
        return out if self.lora is None else self.lora.add_to(x, out)

    # ---- LoRA: the shape of this rank's adapter slice (lora/layers.py) ----
    def lora_dims(self) -> tuple[int, int]:
        """(in, out) of this rank's part of the layer."""
        return self.in_features, self.out_features

    def lora_num_shards(self) -> int:
        return 1

    def lora_slice(self, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's (A, B) of a whole adapter's shard, and the first output row B writes."""
        return a, b, 0


class ColumnParallelLinear(Linear):
    """Output rows split across ranks: rank r holds rows [r * out/tp, (r + 1) * out/tp)."""

    def __init__(self, in_features: int, output_sizes: list[int] | int, bias: bool = False):
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        # (offset in this rank's weight, rows per rank, index of this rank's slice in the checkpoint)
        self.shards = self._shard_layout()
        super().__init__(in_features, sum(rows for _, rows, _ in self.shards), bias)

    def _shard_layout(self) -> list[tuple[int, int, int]]:
        layout, offset = [], 0
        for size in self.output_sizes:
            if size % self.tp_size:
                raise ValueError(f"output size {size} is not divisible by tensor parallel size {self.tp_size}")
            layout.append((offset, size // self.tp_size, self.tp_rank))
            offset += size // self.tp_size
        return layout

    def weight_loader(self, param, loaded, shard_id=None):
        shards = self.shards if shard_id is None else [self.shards[shard_id]]
        if shard_id is None and len(self.shards) > 1:   # a checkpoint that stores the merged matrix
            raise ValueError("a merged checkpoint tensor needs a shard id")
        offset, rows, index = shards[0]
        load_slice(param.data.narrow(0, offset, rows), loaded, 0, index * rows, rows)
        self.note_fp8_scales(param, loaded, offset, rows, index * rows, 0)


    def lora_num_shards(self) -> int:
        return len(self.shards)

    def lora_slice(self, shard, a, b):
        """Column parallel: B's rows of this rank (A is whole on every rank)."""
        offset, rows, index = self.shards[shard]
        return a, b[index * rows:(index + 1) * rows], offset

    def quantize(self, config, row_absmax: torch.Tensor | None = None) -> None:
        if config.method == "fp8_per_tensor" and self.tp_size > 1:     # the largest |w| over every rank's rows
            mine = self.weight.data.float().abs().amax().view(1, 1)
            row_absmax = get_tp_group().all_gather(mine, dim=1).amax()
        super().quantize(config, row_absmax)

    def take_quantized(self, parts: list[tuple]) -> None:
        """parts: (q, scales, mins, bits) of each checkpoint tensor, in shard order; this rank's rows."""
        mine = [tuple(t[index * rows:(index + 1) * rows] for t in part[:3])
                for (_, rows, index), part in zip(self.shards, parts)]
        self.use_quantized(*(torch.cat([m[i] for m in mine]) for i in range(3)), parts[0][3])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked (gate_proj and up_proj): shard_id k is the k-th."""


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections split by heads. With tp > num_kv_heads each KV head is replicated
    on tp / num_kv_heads ranks (as Megatron and vLLM do)."""

    _SHARD_IDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        tp = get_tp_group().world_size
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        super().__init__(hidden_size, [num_heads * head_dim, self.num_kv_heads * head_dim * tp,
                                       self.num_kv_heads * head_dim * tp], bias)

    def _shard_layout(self):
        q, k, v = super()._shard_layout()
        kv_index = self.tp_rank // self.kv_replicas
        return [q, (k[0], k[1], kv_index), (v[0], v[1], kv_index)]

    def weight_loader(self, param, loaded, shard_id=None):
        super().weight_loader(param, loaded, self._SHARD_IDS.get(shard_id, shard_id))


class RowParallelLinear(Linear):
    """Input columns split across ranks; partial outputs summed by an all-reduce, bias added after."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp = get_tp_group()
        if in_features % self.tp.world_size:
            raise ValueError(f"input size {in_features} is not divisible by tensor parallel size "
                             f"{self.tp.world_size}")
        super().__init__(in_features // self.tp.world_size, out_features, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:     # the bias: whole on every rank
            return default_weight_loader(param, loaded)
        cols = param.shape[1]
        load_slice(param, loaded, 1, self.tp.rank_in_group * cols, cols)
        self.note_fp8_scales(param, loaded, 0, self.out_features, 0, self.tp.rank_in_group * cols)

    def take_quantized(self, parts: list[tuple]) -> None:
        """parts: the one checkpoint tensor's (q, scales, mins, bits); this rank's columns (whole groups)."""
        q, scales, mins, bits = parts[0]
        cols, group = self.weight.shape[1], q.shape[1] // scales.shape[1]
        start, groups = self.tp.rank_in_group * cols, cols // group
        self.use_quantized(q[:, start:start + cols], *(t[:, start // group:start // group + groups]
                                                        for t in (scales, mins)), bits)

    def quantize(self, config, row_absmax: torch.Tensor | None = None) -> None:
        if config.method in ("fp8_per_tensor", "fp8_per_channel") and self.tp.world_size > 1:
            # the whole tensor's or row's largest |w|, over every rank's columns
            mine = self.weight.data.float().abs().amax(1, keepdim=True)
            every = self.tp.all_gather(mine, dim=1)
            return super().quantize(config, every.amax() if config.method == "fp8_per_tensor" else every.amax(1))
        if config.bits == 8 and config.group_size == -1 and self.tp.world_size > 1:
            # one scale per whole row, as at one rank: the largest |w| over every rank's columns
            mine = self.weight.data.float().abs().amax(1, keepdim=True)
            row_absmax = self.tp.all_gather(mine, dim=1).amax(1)
        super().quantize(config, row_absmax)

    def lora_slice(self, shard, a, b):
        """Row parallel: A's columns of this rank (B is whole); the all-reduce sums the partial deltas."""
        cols = a.shape[1] // self.tp.world_size
        return a[:, self.tp.rank_in_group * cols:(self.tp.rank_in_group + 1) * cols], b, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.with_lora(x, self.product(x, self.bias))
        out = self.tp.all_reduce(self.with_lora(x, self.product(x, None)))
        return out + self.bias if self.bias is not None else out
