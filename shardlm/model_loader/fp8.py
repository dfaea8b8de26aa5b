"""FP8 checkpoints, read as they ship, dequantized at load into the model's dtype.

Three formats, told apart by config.json's quantization_config (no flag, as vLLM):
- `quant_method: "fp8"` (DeepSeek-V3, Qwen3-FP8): float8_e4m3fn weights; with `weight_block_size`
  a `weight_scale_inv` per block of [128, 128] (a multiplier, despite its name), else a per-tensor
  `weight_scale`; `ignored_layers` / `modules_to_not_convert` stay in float;
- `quant_method: "fbgemm_fp8"` (Meta's Llama-3.1-405B-FP8): a float32 `weight_scale` of [out, 1];
- `quant_method: "compressed-tensors"`, `format: "float-quantized"` (the -FP8 and -FP8-dynamic
  releases): `weight_scale` per tensor, per channel ([out, 1]) or per block (`block_structure`).
Every weight is its own scale's: q, k and v (or gate and up) with different per-tensor scales are
dequantized apart before the loaders merge them. Activation scales (`input_scale`) are not used:
the weights become float, the activations stay in the compute dtype, so outputs are the
dequantized model's. KV scales (`k_scale`, `v_scale`, the older `kv_scale`) pass on to the model,
which gives them to its attention layers for an FP8 KV cache (--kv-cache-dtype fp8). A weight is
read lazily, only the rows or columns a tensor parallel rank loads, with the scales of the blocks
those cover (a block may straddle a shard boundary).
The linears keep their weights FP8 in memory (one byte a weight): each notes the scales of the
rows and columns it read (`fp8_scale_table`) and quantizes its float weight back with them after
loading, exactly (layers/linear.py, layers/fp8.py), and so do MoE experts on CPU (layers/moe.py).
Other weights (embeddings, latent attention's up-projection, rows a model reorders at load) stay
in the model's dtype.
"""

from __future__ import annotations

import math

import torch
from safetensors import safe_open

FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
_UNUSED_SUFFIXES = (".input_scale", ".input_scale_ub", ".weight_zero_point")


def fp8_method(quantization_config) -> str | None:
    """The FP8 format of a checkpoint's quantization_config (None: not FP8)."""
    if not quantization_config:
        return None
    qc = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8"):
        return method
    if method == "compressed-tensors" and qc.get("format") in ("float-quantized", "naive-quantized") and any(
            (g.get("weights") or {}).get("type") == "float" for g in (qc.get("config_groups") or {}).values()):
        return method
    return None


def block_size(qc: dict) -> tuple[int, int] | None:
    """The [rows, columns] of a weight scale's block, where the quantization_config gives one."""
    if qc.get("weight_block_size"):
        return tuple(qc["weight_block_size"])
    for group in (qc.get("config_groups") or {}).values():
        structure = (group.get("weights") or {}).get("block_structure")
        if structure:
            return tuple(structure)
    return None


class Fp8Weight:
    """A lazy FP8 weight, sliced and dequantized as a safetensors slice is sliced and read."""

    def __init__(self, weight, scale: torch.Tensor, block: tuple[int, int] | None):
        self.weight, self.scale, self.block = weight, scale.float(), block

    def get_shape(self) -> list[int]:
        return self.weight.get_shape()

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index) -> torch.Tensor:
        shape = self.get_shape()
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (len(shape) - len(index))
        ranges = [range(*s.indices(n)) for s, n in zip(index, shape)]
        values = self.weight[index].float()
        return values * self._scale_for(ranges, shape)

    def fp8_scale_table(self, rows: range, cols: range) -> torch.Tensor:
        """The scales of rows x cols of the weight, one per row and group of columns, [len(rows),
        len(cols) / group]: a group is all the columns for a per-tensor or per-channel scale, else
        the block's columns, or fewer where the columns start or end inside a block (a tensor
        parallel slice): group = gcd(block columns, cols.start, len(cols))."""
        shape = self.get_shape()
        if self.scale.numel() == 1 or (self.scale.dim() == 2 and self.scale.shape[1] == 1):
            group = len(cols)
        else:
            block_cols = self.block[1] if self.block else math.ceil(shape[1] / self.scale.shape[1])
            group = math.gcd(block_cols, cols.start, len(cols))
        starts = range(cols.start, cols.stop, group)
        return self._scale_for([rows, starts], shape).expand(len(rows), len(starts)).contiguous()

    def _scale_for(self, ranges: list[range], shape: list[int]) -> torch.Tensor:
        s = self.scale
        if s.numel() == 1:                                  # per tensor
            return s.reshape(())
        if s.dim() == 2 and s.shape[1] == 1 and s.shape[0] == shape[0]:     # per output channel
            return s[ranges[0].start:ranges[0].stop]
        rows, cols = self.block or (math.ceil(shape[0] / s.shape[0]), math.ceil(shape[1] / s.shape[1]))
        r = torch.arange(ranges[0].start, ranges[0].stop, ranges[0].step) // rows
        c = torch.arange(ranges[1].start, ranges[1].stop, ranges[1].step) // cols
        return s[r][:, c]


def dequantized(weights, quantization_config: dict, files: list[str]):
    """The checkpoint's tensors (weights, from the safetensors `files`) with every FP8 weight as a
    lazy float one (its scale applied) and the scales themselves left out."""
    scales, block = {}, block_size(quantization_config)
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(_SCALE_SUFFIXES):
                    scales[name] = f.get_tensor(name)
    for name, tensor in weights:
        if name.endswith(_SCALE_SUFFIXES + _UNUSED_SUFFIXES):
            continue
        if name.endswith(".weight") and getattr(tensor, "get_dtype", lambda: "")() in FP8_DTYPES:
            base = name[:-len(".weight")]
            scale = scales.get(base + ".weight_scale_inv", scales.get(base + ".weight_scale"))
            if scale is None:
                raise ValueError(f"The FP8 weight {name} has no weight_scale or weight_scale_inv in the checkpoint.")
            tensor = Fp8Weight(tensor, scale, block)
        yield name, tensor
