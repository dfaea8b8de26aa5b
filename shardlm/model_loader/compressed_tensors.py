"""compressed-tensors checkpoints with integer weights (llm-compressor's W4A16, W8A16 and W8A8
releases, such as RedHatAI's `-quantized.w4a16` and `-quantized.w8a8`), read as they are stored.

config.json's quantization_config says `quant_method: "compressed-tensors"` and, per config group,
the weights' scheme: `num_bits` 4 or 8, `type: "int"`, `symmetric`, `strategy` (tensor, channel
or group, with `group_size`). A linear `X` of shape [N, K] (out, in) is stored as

    pack-quantized   X.weight_packed int32 [N, K * bits / 32]: value k of row n at bit (k * bits) % 32
                     of word (k * bits) // 32, as q + 2^(bits - 1) (q signed)
                     X.weight_zero_point (asymmetric) int32 [N * bits / 32, groups], packed the same
                     way along the output rows; X.weight_shape [N, K]
    int-quantized    X.weight int8 [N, K] (q as it is), zero points (if any) int8 [N, groups]
    (naive-quantized)
    both             X.weight_scale [N, groups] (or [N, 1], or one number), in the checkpoint's dtype

and w = (q - zero) * scale. Each becomes the integers, scales and minimums of a `QuantizedWeight`
(4-bit: q + 8 in 0..15 and min = -(zero + 8) * scale; 8-bit: symmetric int8 as stored). The
activations are not quantized, whatever `input_activations` says (W8A8): they stay in the model's
dtype, as in every weight-quantized product of shardlm, so W8A8's outputs are those of its
dequantized weights. FP8 (`type: "float"`) checkpoints of this format are read by fp8.py.
"""

from __future__ import annotations

import torch

from shardlm.config import QuantizationConfig
from shardlm.logger import init_logger

logger = init_logger(__name__)

METHOD = "compressed-tensors"
PACKED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx",
                   ".input_scale", ".input_zero_point")
_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


def _weight_schemes(qc: dict) -> list[dict]:
    return [group.get("weights") or {} for group in (qc.get("config_groups") or {}).values()]


def is_integer_checkpoint(qc: dict) -> bool:
    """A compressed-tensors quantization_config whose weights are integers (FP8 is fp8.py's)."""
    return str(qc.get("quant_method", "")).lower() == METHOD and any(
        w.get("type", "int") == "int" for w in _weight_schemes(qc))


def integer_scheme(qc: dict) -> QuantizationConfig:
    """What runs for an integer compressed-tensors checkpoint (group -1: a scale per row), or a
    clear error for the schemes shardlm does not read."""
    formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()}
    unread = sorted(str(f) for f in formats - {None, *_FORMATS})
    if unread:
        raise ValueError(f"This compressed-tensors checkpoint is stored as {', '.join(unread)}; shardlm reads its "
                         f"integer formats {', '.join(_FORMATS)} and FP8 (float-quantized).")
    if qc.get("sparsity_config") and (qc["sparsity_config"].get("format") not in (None, "dense")):
        raise ValueError("This compressed-tensors checkpoint has sparse weights (2:4 or bitmask), which shardlm does "
                         "not read. Use a dense quantized checkpoint.")
    schemes = [w for w in _weight_schemes(qc) if w]
    keys = ("num_bits", "type", "symmetric", "strategy", "group_size")
    if len({tuple(w.get(k) for k in keys) for w in schemes}) != 1:
        raise ValueError("This compressed-tensors checkpoint quantizes its layers with different schemes "
                         f"({'; '.join(str({k: w.get(k) for k in keys}) for w in schemes)}); shardlm reads one "
                         "integer scheme for every quantized linear.")
    w = schemes[0]
    bits, symmetric, strategy = w.get("num_bits"), w.get("symmetric", True), w.get("strategy", "tensor")
    if w.get("type", "int") != "int" or bits not in (4, 8):
        raise ValueError(f"This compressed-tensors checkpoint has {bits}-bit {w.get('type')} weights; shardlm reads "
                         "4- and 8-bit integers and FP8.")
    if bits == 8 and not symmetric:
        raise ValueError("This compressed-tensors checkpoint has asymmetric 8-bit weights (zero points); shardlm "
                         "reads symmetric 8-bit and 4-bit either way.")
    if strategy not in ("tensor", "channel", "group"):
        raise ValueError(f"This compressed-tensors checkpoint scales its integer weights per {strategy}; shardlm "
                         "reads scales per tensor, channel or group.")
    group = int(w.get("group_size") or -1) if strategy == "group" else -1
    if group != -1 and group % 8:
        raise ValueError(f"This compressed-tensors checkpoint has groups of {group} columns; shardlm reads groups "
                         "of a multiple of 8.")
    return QuantizationConfig(METHOD, group, weight_bits=bits)


def unpack_int32(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [R, W] packed along its last dimension as above -> the signed integers int8 [R, count]
    (bits 4 or 8 divide a word: no value straddles two)."""
    if words.shape[1] * (32 // bits) < count:
        raise ValueError(f"A packed tensor of {words.shape[1]} words a row cannot hold {count} {bits}-bit values: "
                         "the checkpoint does not match its weight_shape.")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)      # the shift is arithmetic: masked after
    return (values.reshape(words.shape[0], -1)[:, :count] - (1 << (bits - 1))).to(torch.int8)


def _row_tables(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A weight scale (or zero point) as [rows, groups]: one number per tensor becomes one a row."""
    scale = scale.reshape(1, 1) if scale.dim() == 0 or scale.numel() == 1 else scale
    return scale.reshape(scale.shape[0], -1).expand(rows, -1) if scale.shape[0] == 1 else scale


def decode(prefix: str, parts: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, ...]:
    """One linear's stored tensors (by suffix without the dot) -> (q, scales, mins, bits)."""
    if "weight_packed" in parts:
        if "weight_shape" not in parts:
            raise ValueError(f"{prefix} lacks weight_shape: an incomplete compressed-tensors checkpoint.")
        rows, cols = (int(n) for n in parts["weight_shape"].tolist())
        q = unpack_int32(parts["weight_packed"], bits, cols)
        zero = parts.get("weight_zero_point")
        if zero is not None:                           # packed along the rows: unpacked as the transpose's
            zero = unpack_int32(zero.t().contiguous(), bits, rows).t()
    elif "weight" in parts:
        q, zero = parts["weight"].to(torch.int8), parts.get("weight_zero_point")
        rows = q.shape[0]
    else:
        raise ValueError(f"{prefix} has a weight_scale but no weight_packed or int8 weight: an incomplete "
                         "compressed-tensors checkpoint.")
    if "weight_scale" not in parts:
        raise ValueError(f"{prefix} lacks weight_scale: an incomplete compressed-tensors checkpoint.")
    scales = _row_tables(parts["weight_scale"].float(), rows).contiguous()
    zero = torch.zeros_like(scales) if zero is None else _row_tables(zero.float(), rows)
    if "weight_g_idx" in parts:
        group = q.shape[1] // scales.shape[1]
        if not torch.equal(parts["weight_g_idx"].long(), torch.arange(q.shape[1]) // group):
            raise ValueError(f"{prefix}.weight_g_idx orders its groups by activation (actorder 'group'), which "
                             "shardlm does not run yet. Use a checkpoint quantized with actorder 'weight' or none.")
    if bits == 4:
        return (q + 8).contiguous(), scales, (-(zero + 8) * scales).contiguous(), 4
    if zero.any():
        raise ValueError(f"{prefix} has 8-bit zero points; shardlm reads symmetric 8-bit weights.")
    return q.contiguous(), scales, torch.zeros_like(scales), 8


class CompressedLinears:
    """Collects a compressed-tensors checkpoint's integer linears while the float tensors load,
    then decodes them per linear, by the Hugging Face name of the weight they replace."""

    def __init__(self, config: QuantizationConfig, quantization_config):
        """quantization_config: the checkpoint's (a dict, or transformers' config object)."""
        self.bits = config.weight_bits
        self.parts: dict[str, dict[str, torch.Tensor]] = {}
        qc = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
        schemes = qc.get("config_groups") or {}
        if any(g.get("input_activations") for g in schemes.values()):
            logger.info("compressed-tensors: the checkpoint's activation quantization is not applied: activations "
                        "stay in the model's dtype (its weights run as stored)")

    def claims(self, name: str, tensor) -> bool:
        """Whether a checkpoint tensor belongs to an integer linear (an int8 `.weight` does too)."""
        if name.endswith(PACKED_SUFFIXES):
            return True
        return name.endswith(".weight") and _dtype_name(tensor) in ("I8", "torch.int8")

    def take(self, name: str, tensor) -> None:
        prefix, _, kind = name.rpartition(".")
        self.parts.setdefault(prefix, {})[kind] = tensor if isinstance(tensor, torch.Tensor) else tensor[:]

    def decoded(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
        return {f"{prefix}.weight": decode(prefix, parts, self.bits) for prefix, parts in self.parts.items()
                if parts.keys() - {"input_scale", "input_zero_point"}}


def _dtype_name(tensor) -> str:
    return str(tensor.dtype) if isinstance(tensor, torch.Tensor) else tensor.get_dtype()
