"""How a float weight is multiplied on CPU: the layout it is stored in and the kernel per call.

Two kernels, chosen per weight shape from a measurement at load:
- few rows (decode steps): shardlm's skinny kernel (kernels/skinny_matmul.c) on the plain
  row-major weight. oneDNN pays a fixed cost per call and reads float32 weights well below
  memory bandwidth at one row; the skinny kernel streams each weight row once (batch-1 decode
  of the default model: float32 31 -> 39 tok/s on a 2-core Xeon).
- more rows (prefill, large batches): oneDNN, on the same plain weight.
Where the skinny kernel never wins (or cannot be built), the weight is repacked once into
oneDNN's blocked layout instead (as torch.compile's CPU backend does): faster than the plain
weight at many rows (bfloat16 ~1.1x at 64 rows), and 2.5x faster than torch's default float32
GEMM on AMD CPUs (MKL does not use AVX-512 there). One layout is kept, never both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlm.kernels import DTYPE_CODES, skinny_matmul
from shardlm.logger import init_logger
from shardlm.utils import median_seconds_side_by_side

logger = init_logger(__name__)

SKINNY_ROW_SIZES = (1, 4, 16, 64)     # the row counts measured at load
_onednn_ok: dict[torch.dtype, bool] = {}
_skinny_rows: dict[tuple, int] = {}


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, skinny_rows: int = 0) -> torch.Tensor:
    """x . weight^T + bias, weight as prepare_weight left it; skinny_rows: what it measured."""
    if skinny_rows and x.dim() == 2 and x.shape[0] <= skinny_rows and x.stride(1) == 1:
        return skinny(x, weight, bias)
    if weight.is_mkldnn or (x.device.type == "cpu" and x.dtype in DTYPE_CODES and onednn_ok(x.dtype)):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def prepare_weight(weight: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """(the weight repacked for oneDNN, or None to keep it plain; the most rows for which the
    skinny kernel beats oneDNN on the plain weight, 0 for none)."""
    if weight.device.type != "cpu" or weight.dtype not in DTYPE_CODES:
        return None, 0
    rows = skinny_max_rows(weight)
    return (None if rows else onednn_pack(weight)), rows


def skinny_max_rows(weight: torch.Tensor) -> int:
    if skinny_matmul() is None or not weight.is_contiguous():
        return 0
    key = (tuple(weight.shape), weight.dtype)
    if key not in _skinny_rows:
        # near-ties go to the skinny kernel: the measurement runs with the weight in cache, where
        # oneDNN does best (in a model's step the weights come from memory, where the skinny
        # kernel streams faster: the float32 LM head, tied in cache, is 10% faster in a step),
        # and only skinny linears let a decode step run as one C call (llama_cpu_decode.py)
        _skinny_rows[key] = rows_kernel_wins(lambda x: skinny(x, weight, None), lambda x: linear(x, weight, None),
                                             weight.shape[1], weight.dtype, SKINNY_ROW_SIZES, tie=1.1, first_tie=1.25)
        logger.debug("Linear %s %s: skinny kernel up to %d rows", tuple(weight.shape), weight.dtype,
                     _skinny_rows[key])
    return _skinny_rows[key]


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
