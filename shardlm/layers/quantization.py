"""Weight-only quantized linear weights: int8 and int4, in groups along the input dimension.

A weight [N, K] is stored as integers q with one (scale, min) per row and group of `group`
consecutive input columns: w = q * scale + min. int8 is symmetric (q in -127..127, min 0); int4
is asymmetric (q in 0..15). Activations stay in the model's dtype; only the weights shrink (4x
and 8x against float32), which is what batch-1 decode on CPU is bound by.

In a bfloat16 model the product picks its kernel by the number of rows M of x, per weight
shape, from a measurement at load (`kernel_max_rows`): torch's packed CPU kernels
(`_weight_int8pack_mm`, one scale per row; `_weight_int4pack_mm_for_cpu`) multiply decode rows
fastest (int4: up to a few hundred rows); past that, dequantize (one C pass for torch's int4
layout, kernels/fused_ops.c) + the float matmul is used.
Those kernels run in bfloat16 only (their float32 paths are 10x slower), so a float32 model
dequantizes for every product: exact, smaller in memory, not faster. Round-to-nearest
quantization happens at load (`quantize_rtn`), after each rank loaded its float slice; a row's
int8 scale spans the whole row across tensor parallel ranks (`row_absmax`), so every layout
quantizes to the same integers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlm import cpu_plan
from shardlm.kernels import DTYPE_CODES, blocked_int4, blocked_int8, blocked_panel_width, fused_ops
from shardlm.layers.cpu_matmul import on_rows, panel_rows, rows_kernel_wins
from shardlm.logger import init_logger

logger = init_logger(__name__)

METHODS = {"int8": 8, "int4": 4}
DEFAULT_GROUP_SIZE = {"int8": -1, "int4": 128}       # -1: one group per row (per-channel)
KERNEL_GROUP_SIZES = (32, 64, 128, 256)                # what torch's int4 CPU kernel takes


def check_group_size(method: str, group_size: int, in_features: int, where: str) -> int:
    """The group size for a weight with in_features columns (-1: all of them); a helpful error if
    it does not divide them."""
    if group_size == -1:
        return in_features
    if in_features % group_size:
        raise ValueError(f"{where}: {in_features} input columns are not divisible by the {method} group size "
                         f"{group_size}. Use a group size that divides every layer's inputs per rank (the "
                         "tensor parallel sizes for which it does are listed at start-up).")
    return group_size


def quantize_rtn(weight: torch.Tensor, bits: int, group: int, row_absmax: torch.Tensor | None = None):
    """Round-to-nearest: (q, scales, mins), q int8 [N, K] (int4: values 0..15), scales and mins
    float32 [N, K / group]. row_absmax: int8 per-row scale over the whole row (all TP slices)."""
    n, k = weight.shape
    w = weight.float().view(n, k // group, group)
    if bits == 8:
        absmax = w.abs().amax(-1) if row_absmax is None else row_absmax.float().view(n, 1)
        scales = (absmax / 127).clamp(min=1e-12)
        q = torch.round(w / scales.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return q.view(n, k), scales.contiguous(), torch.zeros_like(scales)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((w - low.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp(0, 15).to(torch.int8)
    return q.view(n, k), scales.contiguous(), low.contiguous()


def dequantize(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = q.shape
    groups = scales.shape[1]
    w = q.view(n, groups, k // groups).float() * scales.unsqueeze(-1) + mins.unsqueeze(-1)
    return w.view(n, k).to(dtype)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int4 values [N, K] -> [N, K / 2] bytes, even columns in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=2).view(packed.shape[0], -1).to(torch.int8)


# ---- torch's int4 CPU layout ----
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)


# torch's int4 CPU layouts (they follow the capability its kernels dispatch to, ATEN_CPU_CAPABILITY):
# (rows per block, how a column's bytes hold a block's rows) for AVX-512, AVX2 and plain C
INT4_LAYOUTS = ((64, "halves"), (32, "halves"), (32, "pairs"))


def unpack_int4(packed: torch.Tensor, n: int, k: int, layout: tuple[int, str] | None = None) -> torch.Tensor:
    """q [n, k] (int8, 0..15) from `_convert_weight_to_int4pack_for_cpu`'s layout (torch 2.x):
    blocks of `block` rows, column after column; a column's block / 2 bytes hold the block's
    first half of rows in their low nibbles and the second half in their high ones ("halves"),
    or rows (2j, 2j + 1) in byte j ("pairs"); the last n % block rows are one block of pairs.
    layout: (block, kind), this torch's (int4_layout()) unless given."""
    block, kind = int4_layout() if layout is None else layout
    flat = packed.view(-1)
    full = n // block * block
    parts = []
    if full:
        v = flat[:full * k // 2].view(n // block, k, block // 2)
        nibbles = [v & 15, v >> 4]
        rows = torch.cat(nibbles, dim=2) if kind == "halves" else torch.stack(nibbles, dim=3).view(n // block, k, block)
        parts.append(rows.transpose(1, 2).reshape(full, k))
    if n > full:
        v = flat[full * k // 2:].view(k, (n - full) // 2)
        parts.append(torch.stack([v & 15, v >> 4], dim=2).reshape(k, n - full).t())
    return torch.cat(parts).to(torch.int8)


_int4_layout: list[tuple[int, str] | None] = []


def int4_layout() -> tuple[int, str] | None:
    """This torch's int4 layout (one of INT4_LAYOUTS), found once by packing a test matrix; None
    if none fits."""
    if not _int4_layout:
        found = None
        try:
            q = torch.randint(0, 16, (80, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
            packed = pack_int4(q)
            found = next((lay for lay in INT4_LAYOUTS if torch.equal(unpack_int4(packed, 80, 64, lay), q)), None)
        except (RuntimeError, AttributeError):
            pass
        _int4_layout.append(found)
    return _int4_layout[0]


def int4_layout_understood() -> bool:
    """unpack_int4 inverts this torch's pack_int4 (else no int4 kernel of torch's is used)."""
    return int4_layout() is not None


def _exact_in_float16(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.half().float(), t))


class QuantizedWeight:
    """One linear layer's quantized weight, and its product with activations."""

    table_bytes = 4     # of a scale or min in blocked panels: 2 where all are float16 values (GGUF's)

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, dtype: torch.dtype,
                 measure: bool = True, half_tables: bool = True):
        """half_tables: scales and mins that are all float16 values are stored as float16 (False:
        float32 always, so that every expert of a stack packs to the same size)."""
        self.out_features, self.in_features = q.shape
        self.bits, self.group = bits, self.in_features // scales.shape[1]
        self.half_tables = half_tables
        self.dtype = dtype                                  # of activations and outputs
        self._scales, self._mins = scales.float().contiguous(), mins.float().contiguous()   # as the kernels read them
        self.kernel = self._kernel_format(q)
        # the integers, stored once: in blocked panels, which hold the scales and mins too; else
        # int8 as they are, int4 two per byte (a torch kernel's layout, or plain)
        self.q = q if bits == 8 and not self.blocked else None
        if bits == 4 and self.kernel is None:
            self.packed = pack_nibbles(q)
        if self.blocked:
            self._scales = self._mins = None
        # measure=False: the owner measures against its own alternative (the LM head's float weight)
        self.kernel_max_rows = self._measure() if self.kernel in ("int4pack", "int8pack") and measure else 0

    @property
    def blocked(self) -> bool:
        """In blocked_matmul's 4- or 8-bit panels (every product, any rows, uses them)."""
        return self.kernel in ("blocked4", "blocked8")

    def _kernel_format(self, q: torch.Tensor) -> str | None:
        blocked = self._pack_blocked(q)
        if blocked is not None:
            return blocked
        # torch's packed kernels multiply in bfloat16: a float32 model dequantizes instead (exact)
        if q.device.type != "cpu" or self.dtype != torch.bfloat16 or self.out_features % 16:
            return None
        if self.bits == 8 and self.group == self.in_features and not self._mins.any():
            self._int8_scales = self._scales.view(-1).to(torch.bfloat16)
            return "int8pack"
        if self.bits == 4 and self.group in KERNEL_GROUP_SIZES and int4_layout_understood():
            self.packed = pack_int4(q)
            # the kernel computes (q - 8) * scale + zero: zero = min + 8 * scale
            self._scales_and_zeros = torch.stack([self._scales.t(), (self._mins + 8 * self._scales).t()],
                                                 dim=-1).to(torch.bfloat16).contiguous()
            return "int4pack"
        return None

    def _pack_blocked(self, q: torch.Tensor) -> str | None:
        """Packs q into blocked_matmul's panels where they apply: 4-bit groups a multiple of 8,
        symmetric 8-bit groups of an even size. Scales and mins that are all float16 values (a
        GGUF file's) are stored as float16: a 4-bit weight in groups of 32 then reads 0.625
        bytes instead of 0.75."""
        if q.device.type != "cpu" or self.dtype not in DTYPE_CODES:
            return None
        if self.bits == 4 and self.group % 8 == 0 and blocked_int4() is not None:
            size, pack, _ = blocked_int4()
            tables = [self._scales, self._mins]
        elif self.bits == 8 and self.group % 2 == 0 and blocked_int8() is not None and not self._mins.any():
            size, pack, _ = blocked_int8()
            tables = [self._scales]
        else:
            return None
        if self.half_tables and all(_exact_in_float16(t) for t in tables):
            self.table_bytes, tables = 2, [t.half() for t in tables]     # held while C reads them
        self.packed = torch.empty(size(self.out_features, self.in_features, self.group, self.table_bytes),
                                  dtype=torch.uint8)
        q = q.contiguous()       # held while C reads it (a slice of a rank's columns is not)
        pack(q.data_ptr(), *(t.data_ptr() for t in tables), self.out_features, self.in_features, self.group,
             self.table_bytes, self.packed.data_ptr())
        return f"blocked{self.bits}"

    def _table_view(self, raw: torch.Tensor) -> torch.Tensor:
        """Bytes of a panel's scales or mins as their float dtype."""
        return raw.view(torch.float16 if self.table_bytes == 2 else torch.float32)

    def _panels(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The blocked panels, unpacked: (q [N, K] int8, scales, mins [N, K / group] float32)."""
        width, K, G, group = blocked_panel_width()(), self.in_features, self.in_features // self.group, self.group
        tb = self.table_bytes
        if self.bits == 8:     # per panel and group: [group][width] int8, then the group's scales
            groups = self.packed.view(-1, G, group * width + width * tb)
            q = groups[..., :group * width].contiguous().view(torch.int8).view(-1, G, group, width)
            q = q.permute(0, 3, 1, 2).reshape(-1, K)[:self.out_features]
            scales = self._table_view(groups[..., group * width:].contiguous()).view(-1, G, width)
            scales = scales.permute(0, 2, 1).reshape(-1, G)[:self.out_features].float().contiguous()
            return q, scales, torch.zeros_like(scales)
        # per panel and group: per 8 k's a 32-bit word per feature (q[k + 2i] at bits 4i,
        # q[k + 2i + 1] at bits 16 + 4i), then the group's scales and mins
        groups = self.packed.view(-1, G, group // 2 * width + 2 * width * tb)
        words = groups[..., :group // 2 * width].contiguous().view(torch.int32).view(-1, G, group // 8, width)
        shifts = torch.tensor([[4 * i, 16 + 4 * i] for i in range(4)], dtype=torch.int32).view(-1)   # k order
        q = ((words.unsqueeze(-1) >> shifts) & 15).permute(0, 3, 1, 2, 4).reshape(-1, K)
        tables = self._table_view(groups[..., group // 2 * width:].contiguous()).view(-1, G, 2, width)
        scales, mins = (tables[:, :, i].permute(0, 2, 1).reshape(-1, G)[:self.out_features] for i in range(2))
        return q[:self.out_features].to(torch.int8), scales.float().contiguous(), mins.float().contiguous()

    @property
    def scales(self) -> torch.Tensor:
        return self._panels()[1] if self._scales is None else self._scales

    @property
    def mins(self) -> torch.Tensor:
        return self._panels()[2] if self._mins is None else self._mins

    def weight_bytes(self) -> int:
        stored = self.packed if self.q is None else self.q
        tables = 0 if self.blocked else 2 * self._scales.numel() * 4   # the panels hold their own
        return stored.numel() * stored.element_size() + tables

    def integers(self) -> torch.Tensor:
        if self.q is not None:
            return self.q
        if self.kernel == "int4pack":
            return unpack_int4(self.packed, self.out_features, self.in_features)
        if self.blocked:
            return self._panels()[0]
        return unpack_nibbles(self.packed)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (any shape) of the weight, dequantized: [*index.shape, K] (an embedding
        lookup in a quantized table); read straight from 8-bit panels."""
        if self.kernel == "blocked8":
            return panel_rows(self.packed, index, self.in_features, self.dtype, 8, self.group, self.table_bytes)
        flat = index.reshape(-1)
        q, scales, mins = self.integers()[flat], self.scales[flat], self.mins[flat]
        w = q.float().view(len(flat), -1, self.group) * scales.unsqueeze(-1) + mins.unsqueeze(-1)
        return w.reshape(*index.shape, self.in_features).to(self.dtype)

    def dequantized(self) -> torch.Tensor:
        lib = fused_ops()
        if self.kernel == "int4pack" and lib is not None:      # one pass in C instead of ~8 operators
            out = torch.empty(self.out_features, self.in_features, dtype=self.dtype)
            block, kind = int4_layout()
            lib.dequantize_int4pack(self.packed.data_ptr(), self.out_features, self.in_features, block,
                                    int(kind == "pairs"),
                                    self._scales.data_ptr(), self._mins.data_ptr(), self.group, out.data_ptr(),
                                    DTYPE_CODES[self.dtype])
            return out
        return dequantize(self.integers(), self.scales, self.mins, self.dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.blocked:
            return self._blocked(x, bias)
        rows = x.numel() // self.in_features
        out = self._kernel(x) if rows <= self.kernel_max_rows else F.linear(x, self.dequantized())
        return out if bias is None else out + bias

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xb = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()     # the kernels ignore strides
        if self.kernel == "int8pack":
            out = torch._weight_int8pack_mm(xb, self.q, self._int8_scales)
        else:
            out = torch._weight_int4pack_mm_for_cpu(xb, self.packed, self.group, self._scales_and_zeros)
        return out.to(self.dtype).view(*shape[:-1], self.out_features)

    def _blocked(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        product = (blocked_int4() if self.bits == 4 else blocked_int8())[2]
        return on_rows(x, self.out_features, bias, lambda rows, out, b: product(
            rows.data_ptr(), rows.stride(0), self.packed.data_ptr(), b, out.data_ptr(), rows.shape[0],
            self.out_features, self.in_features, self.group, self.table_bytes, DTYPE_CODES[x.dtype]))

    def _measure(self) -> int:
        """The most rows for which the packed kernel beats dequantize + matmul on this shape (a CPU
        plan's choice, measured once per shape)."""
        def measure() -> tuple[int, str]:
            rows = rows_kernel_wins(self._kernel, lambda x: F.linear(x, self.dequantized()), self.in_features,
                                    self.dtype)
            return rows, "timed against dequantize + matmul"
        key = (f"{self.kernel} [{self.out_features}, {self.in_features}] group {self.group} "
               f"{str(self.dtype).removeprefix('torch.')}")
        return cpu_plan.choose("quantized_rows", key, measure)
