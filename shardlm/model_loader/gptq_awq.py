"""GPTQ and AWQ checkpoints: 4-bit linears read as they are stored (`quantization_config` in
config.json), as AutoGPTQ / GPTQModel and AutoAWQ write them.

A linear `X` of shape [N, K] (out, in) with groups of g input columns is stored as int32 words,
eight 4-bit values each, and float16 scales:

    GPTQ  X.qweight [K / 8, N]  word (i, n) holds q[n, 8i + j] at bits 4j (packed along the input)
          X.qzeros  [K / g, N / 8]  word (G, c) holds the zero of column 8c + j at bits 4j
          X.scales  [K / g, N], X.g_idx [K] (each input column's group)
          w = scale * (q - zero), where checkpoint_format "gptq" (v1) stores zero - 1
    AWQ   X.qweight [K, N / 8]  word (k, c) holds q[8c + AWQ_ORDER[j], k] at bits 4j
          X.qzeros  [K / g, N / 8] in the same order, X.scales [K / g, N]
          w = scale * (q - zero)

Each becomes the integers, scales and minimums of a `QuantizedWeight` (w = q * scale + min with
min = -zero * scale: exact in float32, as scales are float16 and q, zero < 17).
"""

from __future__ import annotations

import torch

from shardlm.config import QuantizationConfig
from shardlm.model_loader.compressed_tensors import integer_scheme, is_integer_checkpoint
from shardlm.model_loader.fp8 import block_size, fp8_method

PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # nibble j of a word holds output column AWQ_ORDER[j]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _as_dict(qc) -> dict:
    return qc if isinstance(qc, dict) else qc.to_dict()


def checkpoint_method(quantization_config) -> QuantizationConfig | None:
    """What runs for a checkpoint, from its config.json's quantization_config (None: a float
    checkpoint): "gptq" | "awq" | "fp8" | "compressed-tensors" (integer weights) and the group
    size; a clear error for what is not read. An FP8 checkpoint's group: its blocks' columns, or
    -1 for scales per tensor or channel (fp8.py)."""
    if not quantization_config:
        return None
    qc = _as_dict(quantization_config)
    if fp8_method(qc):
        block = block_size(qc)
        return QuantizationConfig("fp8", block[1] if block else -1)
    if is_integer_checkpoint(qc):
        return integer_scheme(qc)
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise ValueError(f"This checkpoint is quantized with {method or 'an unnamed method'!r}; shardlm reads FP8 "
                         "(fp8, fbgemm_fp8, compressed-tensors float), compressed-tensors integer (W4A16, W8A16, "
                         "W8A8), GPTQ and AWQ checkpoints (4-bit), GGUF files, or float checkpoints with "
                         "--quantization int8|int4.")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"This {method.upper()} checkpoint has {bits}-bit weights; shardlm reads 4-bit ones.")
    if method == "gptq" and qc.get("desc_act"):
        raise ValueError("This GPTQ checkpoint was quantized with desc_act (act-order): its groups are not "
                         "consecutive columns, which shardlm does not run yet. Use a checkpoint quantized with "
                         "desc_act=False.")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"This AWQ checkpoint is packed as {qc.get('version')!r}; shardlm reads the 'gemm' packing.")
    if method == "awq" and not qc.get("zero_point", True):
        raise ValueError("This AWQ checkpoint has no zero points; shardlm reads AWQ with zero points.")
    return QuantizationConfig(method, qc.get("group_size", qc.get("q_group_size", 128)))


def is_v1(quantization_config) -> bool:
    """GPTQ's original format, which stores each zero point minus one."""
    return _as_dict(quantization_config or {}).get("checkpoint_format", "gptq") == "gptq"


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> int32 [..., W, 8]: nibble j of each word (bits 4j)."""
    return (words.unsqueeze(-1) >> _SHIFTS) & 15


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, v1: bool = True):
    """(q int8 [N, K], scales, mins float32 [N, K / g])."""
    k8, n = qweight.shape
    q = _nibbles(qweight.t()).reshape(n, k8 * 8)           # word (i, n), nibble j: column 8i + j of row n
    zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1).t().float() + (1 if v1 else 0)
    s = scales.t().float()
    return q.to(torch.int8).contiguous(), s.contiguous(), (-zeros * s).contiguous()


_AWQ_COLUMNS = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])     # column j: its nibble


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor):
    """(q int8 [N, K], scales, mins float32 [N, K / g])."""
    def columns(words):   # [R, N / 8] -> [R, N] in output-column order
        return _nibbles(words)[..., _AWQ_COLUMNS].reshape(words.shape[0], -1)
    q = columns(qweight).t()
    s = scales.t().float()
    zeros = columns(qzeros).t().float()
    return q.to(torch.int8).contiguous(), s.contiguous(), (-zeros * s).contiguous()


class PackedLinears:
    """Collects a GPTQ/AWQ checkpoint's packed tensors while the float ones load, then decodes
    them per linear, by the Hugging Face name of the weight they replace."""

    def __init__(self, method: str, group: int, v1: bool):
        self.method, self.group, self.v1 = method, group, v1
        self.parts: dict[str, dict[str, torch.Tensor]] = {}

    def claims(self, name: str, tensor) -> bool:
        """Whether a checkpoint tensor is one of a packed linear's."""
        return name.endswith(PACKED_SUFFIXES)

    def take(self, name: str, tensor) -> None:
        """Keep one packed tensor (one that claims() took)."""
        prefix, _, kind = name.rpartition(".")
        self.parts.setdefault(prefix, {})[kind] = tensor if isinstance(tensor, torch.Tensor) else tensor[:]

    def decoded(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
        out = {}
        for prefix, parts in self.parts.items():
            missing = {"qweight", "qzeros", "scales"} - parts.keys()
            if missing:
                raise ValueError(f"{prefix} lacks {', '.join(sorted(missing))}: an incomplete {self.method.upper()} "
                                 "checkpoint.")
            if self.method == "gptq":
                q, s, m = unpack_gptq(parts["qweight"], parts["qzeros"], parts["scales"], self.v1)
                if "g_idx" in parts:
                    consecutive = torch.arange(q.shape[1]) // (q.shape[1] // s.shape[1])
                    if not torch.equal(parts["g_idx"].long(), consecutive):
                        raise ValueError(f"{prefix}.g_idx orders its groups by activation (act-order), which "
                                         "shardlm does not run yet. Use a checkpoint quantized with desc_act=False.")
            else:
                q, s, m = unpack_awq(parts["qweight"], parts["qzeros"], parts["scales"])
            out[f"{prefix}.weight"] = (q, s, m, 4)
        return out

