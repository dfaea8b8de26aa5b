"""FP8 linear weights: one byte a weight (float8_e4m3fn), a float32 scale per row and group of
input columns, w = fp8 * scale.

They come from an FP8 checkpoint, whose scales are per tensor, per output channel or per block
of [128, 128] (model_loader/fp8.py reads them; each rank keeps the scale of each of its rows and
groups, so a block that straddles a tensor parallel boundary and q/k/v merged from tensors with
different scales need nothing special), or from a float checkpoint quantized at load with
`--quantization fp8_per_channel | fp8_per_tensor | fp8_per_block` (vLLM's names; `fp8` is
per channel), by round to nearest.

On CPU the bytes go into blocked_matmul's 8-bit panels as they are and are widened inside the
product (kernels/blocked_matmul.c, every ISA variant; plain C loops without AVX2 or AVX-512): a
decode step reads half the bytes of bfloat16, and the product equals the dequantized weight's,
activations staying in the model's dtype. On CUDA GPUs with FP8 (compute capability 8.9 and up),
a weight with one scale per row is multiplied by torch._scaled_mm with the activations quantized
per token at run time, as vLLM does; elsewhere the weight is dequantized for each product.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardlm.kernels import DTYPE_CODES, blocked_fp8, blocked_panel_width
from shardlm.layers.cpu_matmul import on_rows

FP8_MAX = 448.0                      # the largest float8_e4m3fn value
BLOCK = 128                          # fp8_per_block's block: [128, 128], as DeepSeek-V3's checkpoints
SCHEMES = ("fp8_per_channel", "fp8_per_tensor", "fp8_per_block")
ALIASES = {"fp8": "fp8_per_channel"}


def block_columns(in_features: int) -> int:
    """fp8_per_block's columns per scale for a weight with in_features columns (this rank's):
    128, or the largest even divisor of it and 128 where 128 does not divide them."""
    return math.gcd(BLOCK, in_features)


def quantize_fp8(weight: torch.Tensor, scheme: str, absmax: torch.Tensor | None = None):
    """(q float8_e4m3fn [N, K], scales float32 [N, K / group]) by round to nearest.
    absmax: the per-channel rows' (or per-tensor) largest |w| over every tensor parallel rank,
    so that every layout quantizes to the same values."""
    n, k = weight.shape
    w = weight.float()
    if scheme == "fp8_per_block":
        cols = block_columns(k)
        blocks = F.pad(w.abs(), (0, 0, 0, -n % BLOCK)).view(-(-n // BLOCK), BLOCK, k // cols, cols)
        amax = blocks.amax(dim=(1, 3)).repeat_interleave(BLOCK, 0)[:n]           # [N, K / cols]
    elif scheme == "fp8_per_tensor":
        amax = (w.abs().amax() if absmax is None else absmax.float()).expand(n, 1)
    else:
        amax = w.abs().amax(1, keepdim=True) if absmax is None else absmax.float().view(n, 1)
    scales = (amax / FP8_MAX).clamp(min=1e-12).contiguous()
    return from_scales(w, scales), scales


def from_scales(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """weight / scale (scales [N, K / group]) rounded to float8_e4m3fn: exact where the weight is
    q * scale rounded to a float of 8 or more significant bits (an FP8 checkpoint's, dequantized)."""
    n, k = weight.shape
    w = weight.float().view(n, scales.shape[1], -1) / scales.unsqueeze(-1)
    return w.clamp(-FP8_MAX, FP8_MAX).view(n, k).to(torch.float8_e4m3fn)


def note_scales(scales: torch.Tensor | None, rows_shape: tuple[int, ...], table: torch.Tensor, at) -> torch.Tensor:
    """A loader's record of an FP8 checkpoint's scales, [*rows_shape, groups] (NaN: rows not read
    from FP8; made on the first table), with `table` [rows, groups] written at index `at`; all NaN
    where a table's groups differ from the first's (the weight then stays in float)."""
    if scales is None:
        scales = torch.full((*rows_shape, table.shape[1]), float("nan"))
    if table.shape[1] != scales.shape[-1]:
        scales.fill_(float("nan"))
    else:
        scales[at] = table
    return scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = q.shape
    return (q.float().view(n, scales.shape[1], -1) * scales.unsqueeze(-1)).view(n, k).to(dtype)


def packs(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether an FP8 weight goes into the blocked panels here (on CPU, with the kernel library)."""
    return (q.device.type == "cpu" and dtype in DTYPE_CODES and (q.shape[1] // scales.shape[1]) % 2 == 0
            and blocked_fp8() is not None)


def packed_bytes(out_features: int, in_features: int, group: int) -> int:
    return blocked_fp8()[0](out_features, in_features, group, 4)


def _has_fp8_matmul(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8LinearWeight:
    """One linear layer's FP8 weight and its product with activations (QuantizedWeight's interface)."""

    bits, table_bytes = 8, 4

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, into: torch.Tensor | None = None):
        """into: the uint8 tensor of packed_bytes(...) to pack the panels in (a row of an expert stack)."""
        self.out_features, self.in_features = q.shape
        self.group = self.in_features // scales.shape[1]
        self.dtype = dtype                                   # of activations and outputs
        self.kernel = None
        self.q, self._scales = q.contiguous(), scales.float().contiguous()
        if packs(q, scales, dtype):
            pack = blocked_fp8()[1]
            # every byte is written by the pack
            self.packed = torch.empty(packed_bytes(*q.shape, self.group), dtype=torch.uint8) if into is None else into
            if pack(self.q.view(torch.uint8).data_ptr(), self._scales.data_ptr(), self.out_features,
                    self.in_features, self.group, self.packed.data_ptr()):
                raise MemoryError(f"could not allocate the scales of an FP8 weight {tuple(q.shape)}")
            self.kernel, self.q, self._scales = "fp8", None, None
        elif (self.group == self.in_features and _has_fp8_matmul(q.device) and dtype == torch.bfloat16
              and self.in_features % 16 == 0 and self.out_features % 16 == 0):
            self.kernel = "scaled_mm"

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q float8_e4m3fn [N, K], scales float32 [N, K / group]), read back from the panels where
        they are packed: per panel and group, [group][width] bytes, then the width scales * 2^8."""
        if self.kernel != "fp8":
            return self.q, self._scales
        width, K, G, group = blocked_panel_width()(), self.in_features, self.in_features // self.group, self.group
        groups = self.packed.view(-1, G, group * width + width * 4)
        q = groups[..., :group * width].contiguous().view(-1, G, group, width)
        q = q.permute(0, 3, 1, 2).reshape(-1, K)[:self.out_features].contiguous().view(torch.float8_e4m3fn)
        scales = groups[..., group * width:].contiguous().view(torch.float32).view(-1, G, width)
        return q, scales.permute(0, 2, 1).reshape(-1, G)[:self.out_features] / 256

    def weight_bytes(self) -> int:
        if self.kernel == "fp8":
            return self.packed.numel()
        return self.q.numel() + self._scales.numel() * 4

    def dequantized(self) -> torch.Tensor:
        return dequantize_fp8(*self.values(), self.dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel == "fp8":
            return self._blocked(x, bias)
        if self.kernel == "scaled_mm":
            return self._scaled_mm(x, bias)
        return F.linear(x, self.dequantized(), bias)

    def _blocked(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return on_rows(x, self.out_features, bias, lambda rows, out, b: blocked_fp8()[2](
            rows.data_ptr(), rows.stride(0), self.packed.data_ptr(), b, out.data_ptr(), rows.shape[0],
            self.out_features, self.in_features, self.group, DTYPE_CODES[x.dtype]))

    def _scaled_mm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The GPU's FP8 product: x quantized per token (row) at run time, the weight's per-row scales."""
        rows = x.reshape(-1, self.in_features)
        x_scale = (rows.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq = (rows.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(xq, self.q.t(), scale_a=x_scale, scale_b=self._scales.view(1, -1),
                               bias=bias, out_dtype=self.dtype)
        return out.view(*x.shape[:-1], self.out_features)
