"""How a float weight is multiplied on CPU: the layout it is stored in and the kernel per call.

On CPUs with AVX-512, every weight is repacked once at load into shardlm's panel layout and
every product, from one decode row to a whole prompt, runs kernels/blocked_matmul.c on it: a
broadcast-form GEMM that beats oneDNN on its own packed layout at a few dozen rows and streams
at memory bandwidth at one row (figures: docs/ARCHITECTURE.md, "Measured choices"). Its
results do not depend on the batch a row is in. On CPUs with AVX2 only, bfloat16 weights go into
the same panels (AVX2 tiles; oneDNN has no native bfloat16 there), and float32 ones unless
--no-batch-invariant (oneDNN is faster at many rows there, but its sums depend on the row count).

Elsewhere two kernels share the plain row-major weight, chosen per shape by measurement at load:
- few rows (decode steps): shardlm's skinny kernel (kernels/skinny_matmul.c). oneDNN pays a
  fixed cost per call and reads float32 weights well below memory bandwidth at one row.
- more rows (prefill, large batches): oneDNN.
Where the skinny kernel never wins (or cannot be built), the weight is repacked once into
oneDNN's blocked layout instead (as torch.compile's CPU backend does). One layout is kept, never
both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardlm import cpu_plan, kernels
from shardlm.kernels import DTYPE_CODES, blocked_matmul, blocked_pack, skinny_matmul
from shardlm.logger import init_logger
from shardlm.utils import median_seconds_side_by_side

logger = init_logger(__name__)

SKINNY_ROW_SIZES = (1, 4, 16, 64)     # the row counts measured at load
_onednn_ok: dict[torch.dtype, bool] = {}


@dataclass(frozen=True)
class CpuMatmul:
    """How one weight is multiplied on CPU, decided at load by prepare_weight."""
    out_features: int
    in_features: int
    blocked: bool = False     # the weight is in blocked_matmul's panel layout; every product uses it
    skinny_rows: int = 0      # else: products of up to this many rows use the skinny kernel


def onednn_ok(dtype: torch.dtype) -> bool:
    """oneDNN's path for this dtype works here (bf16 needs AVX-512 or AVX-NE-CONVERT); checked once."""
    if dtype not in _onednn_ok:
        _onednn_ok[dtype] = _onednn_self_test(dtype)
    return _onednn_ok[dtype]


def _onednn_self_test(dtype: torch.dtype) -> bool:
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        w, b, x = (torch.randn(48, 32, dtype=dtype), torch.randn(48, dtype=dtype), torch.randn(5, 32, dtype=dtype))
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return torch.allclose(got.float(), F.linear(x, w, b).float(), atol=tol, rtol=tol)
    except (RuntimeError, AttributeError):
        return False


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where that path is unavailable or disagrees."""
    if weight.device.type != "cpu" or weight.dtype not in DTYPE_CODES or not onednn_ok(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (rows with unit stride) . weight [N, K]^T + bias through the skinny kernel."""
    M, K = x.shape
    out = torch.empty(M, weight.shape[0], dtype=x.dtype)
    if skinny_matmul()(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                       out.data_ptr(), M, weight.shape[0], K, DTYPE_CODES[x.dtype]):
        raise MemoryError(f"skinny matmul could not allocate its {M} x {K} work buffer")
    return out


def on_rows(x: torch.Tensor, out_features: int, bias: torch.Tensor | None, product) -> torch.Tensor:
    """x [..., K] . W^T + bias by a C product over rows: product(rows, out, bias address) with rows
    [M, K] of unit column stride, out [M, out_features] and the bias in x's dtype (held while C
    reads them); it returns nonzero where its work buffer could not be allocated."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    if product(rows, out, None if bias is None else bias.data_ptr()):
        raise MemoryError(f"a CPU matmul could not allocate its {rows.shape[0]} x {rows.shape[1]} work buffer")
    return out.view(*x.shape[:-1], out_features)


def blocked(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] . W^T + bias, W packed by pack_blocked."""
    return on_rows(x, out_features, bias, lambda rows, out, b: blocked_matmul()(
        rows.data_ptr(), rows.stride(0), packed.data_ptr(), b, out.data_ptr(), rows.shape[0], out_features,
        rows.shape[1], DTYPE_CODES[x.dtype]))


def pack_blocked(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in blocked_matmul's panel layout (a flat tensor of its dtype)."""
    size, pack = blocked_pack()
    N, K = weight.shape
    code = DTYPE_CODES[weight.dtype]
    packed = torch.empty(size(N, K, code), dtype=weight.dtype)
    weight = weight.contiguous()     # held while C reads it
    pack(weight.data_ptr(), N, K, code, packed.data_ptr())
    return packed


def blocked_rows(packed: torch.Tensor, plan: CpuMatmul, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (any shape; ids checked by the caller) of a weight packed by pack_blocked, as
    [*index.shape, K]: an embedding lookup in a tied LM head's packed table."""
    return panel_rows(packed, index, plan.in_features, packed.dtype)


def panel_rows(packed: torch.Tensor, index: torch.Tensor, K: int, dtype: torch.dtype, bits: int = 0, group: int = 0,
               table_bytes: int = 0) -> torch.Tensor:
    """Rows of a weight in float (bits 0) or 8-bit blocked panels, as [*index.shape, K] of dtype."""
    flat = index.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), K, dtype=dtype)
    kernels.blocked_rows()(packed.data_ptr(), flat.data_ptr(), flat.numel(), K, bits, 0, group, table_bytes,
                           DTYPE_CODES[dtype], out.data_ptr())
    return out.view(*index.shape, K)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           plan: CpuMatmul | None = None) -> torch.Tensor:
    """x . weight^T + bias, weight as prepare_weight left it, plan what it decided."""
    if plan is not None and plan.blocked:
        return blocked(x, weight, bias, plan.out_features)
    if plan is not None and plan.skinny_rows and x.dim() == 2 and x.shape[0] <= plan.skinny_rows and x.stride(1) == 1:
        return skinny(x, weight, bias)
    if weight.is_mkldnn or (x.device.type == "cpu" and x.dtype in DTYPE_CODES and onednn_ok(x.dtype)):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def goes_into_panels(weight: torch.Tensor) -> bool:
    """Whether a float weight on CPU is multiplied from blocked_matmul's panels here. AVX-512's
    panels beat oneDNN from one row to a prompt. AVX2's do for bfloat16, which oneDNN widens
    without native instructions; for float32 at many rows oneDNN is faster (1.2-1.3x on a Zen 1),
    but its sums depend on the row count, and the skinny kernel's differ from it: float32 weights
    go into the panels too unless --no-batch-invariant."""
    return (weight.device.type == "cpu" and weight.dtype in DTYPE_CODES and weight.dim() == 2
            and blocked_matmul() is not None
            and (kernels.blocked_vector_bits() == 512 or weight.dtype == torch.bfloat16
                 or cpu_plan.current().batch_invariant))


def prepare_weight(weight: torch.Tensor) -> tuple[torch.Tensor | None, CpuMatmul | None]:
    """(the weight to keep in its place, or None to keep it as it is; how to multiply it), for a
    float weight on CPU; (None, None) elsewhere."""
    if weight.device.type != "cpu" or weight.dtype not in DTYPE_CODES or weight.dim() != 2:
        return None, None
    N, K = weight.shape
    if goes_into_panels(weight):
        return pack_blocked(weight), CpuMatmul(N, K, blocked=True)
    rows = skinny_max_rows(weight)
    return (None if rows else onednn_pack(weight)), CpuMatmul(N, K, skinny_rows=rows)


def skinny_max_rows(weight: torch.Tensor) -> int:
    """The most rows a product with this plain weight runs on the skinny kernel (a CPU plan's
    choice, measured once per shape and dtype)."""
    if skinny_matmul() is None or not weight.is_contiguous():
        return 0

    def measure() -> tuple[int, str]:
        # near-ties go to the skinny kernel: the measurement runs with the weight in cache, where
        # oneDNN does best (in a model's step the weights come from memory, where the skinny
        # kernel streams faster: the float32 LM head, tied in cache, is 10% faster in a step),
        # and only skinny linears let a decode step run as one C call (llama_cpu_decode.py)
        rows = rows_kernel_wins(lambda x: skinny(x, weight, None), lambda x: linear(x, weight, None),
                                weight.shape[1], weight.dtype, SKINNY_ROW_SIZES, tie=1.1, first_tie=1.25)
        return rows, f"timed against oneDNN at {', '.join(map(str, SKINNY_ROW_SIZES))} rows"
    N, K = weight.shape
    return cpu_plan.choose("skinny_rows", f"[{N}, {K}] {str(weight.dtype).removeprefix('torch.')}", measure)


def rows_kernel_wins(kernel, alternative, in_features: int, dtype: torch.dtype,
                     sizes: tuple[int, ...] = (1, 8, 64, 256), tie: float = 1.0, first_tie: float | None = None) -> int:
    """The most rows x (of `sizes`, until it first loses) for which kernel(x) is measured faster
    than alternative(x); at most `tie` times slower is a win too (`first_tie` at the first size)."""
    best = 0
    for rows in sizes:
        x = torch.randn(rows, in_features, dtype=dtype)
        mine, theirs = median_seconds_side_by_side(lambda: kernel(x), lambda: alternative(x), 7 if rows <= 16 else 5)
        if mine > (first_tie if rows == sizes[0] and first_tie is not None else tie) * theirs:
            break
        best = rows
    return best
