"""Which float dtype runs a model faster on this CPU, measured with the kernels that will run it.

Whether bfloat16 beats float32 depends on the CPU, the ISA variant in use and the row count: at
one row a product streams the weight, and bfloat16 reads half the bytes; at many rows it is
compute, where bfloat16 wins only with native instructions (avx512_bf16, AMX). On a Zen 5 under
the AVX2 cap, bfloat16 takes 0.53x float32's time at 1 row but 1.6x at 128 rows. A serving engine
spends its time in decode steps (one step per output token; a prompt's tokens share one), so
the choice is made on decode-sized products: 1 row and a batch of DECODE_BATCH rows, weighed
alike (geometric mean), through the same prepare_weight/linear path the model's layers take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardlm.layers import cpu_matmul
from shardlm.utils import median_seconds_side_by_side

DECODE_BATCH = 16
SWEEP_BYTES = 64 << 20    # float32 weights swept per product: more than a CPU's last-level cache,
#                           so that, as in a model's step, the weights come from memory
MAX_COPIES = 64


@dataclass(frozen=True)
class DtypeMeasurement:
    """Milliseconds per sweep of one layer-shaped product, by dtype and rows."""
    ms: dict[tuple[torch.dtype, int], float]

    def speedup(self, rows: int) -> float:
        """float32's time over bfloat16's at `rows` (above 1: bfloat16 is faster)."""
        return self.ms[(torch.float32, rows)] / self.ms[(torch.bfloat16, rows)]

    def bfloat16_speedup(self) -> float:
        return math.sqrt(self.speedup(1) * self.speedup(DECODE_BATCH))

    def describe(self) -> str:
        return ", ".join(f"{rows} row{'s' if rows > 1 else ''} float32 {self.ms[(torch.float32, rows)]:.2f} ms / "
                         f"bfloat16 {self.ms[(torch.bfloat16, rows)]:.2f} ms" for rows in (1, DECODE_BATCH))


_measured: dict[tuple, DtypeMeasurement] = {}


def measure(in_features: int, out_features: int) -> DtypeMeasurement:
    """Times a product of a model's MLP shape in float32 and bfloat16 (about half a second),
    once per shape and ISA variant in a process."""
    from shardlm import kernels
    key = (in_features, out_features, kernels.active_isa())
    if key not in _measured:
        # a large model's weight is cut to SWEEP_BYTES by rows (its per-row work is unchanged)
        out_features = max(64, min(out_features, SWEEP_BYTES // (in_features * 4) // 64 * 64))
        copies = max(1, min(MAX_COPIES, math.ceil(SWEEP_BYTES / (in_features * out_features * 4))))
        ms = {}
        for rows in (1, DECODE_BATCH):
            fp32, bf16 = (_sweep(in_features, out_features, dtype, rows, copies)
                          for dtype in (torch.float32, torch.bfloat16))
            ms[(torch.float32, rows)], ms[(torch.bfloat16, rows)] = (1e3 * t for t in
                                                                     median_seconds_side_by_side(fp32, bf16, 5))
        _measured[key] = DtypeMeasurement(ms)
    return _measured[key]


def _sweep(in_features: int, out_features: int, dtype: torch.dtype, rows: int, copies: int):
    """A call that multiplies x by `copies` weights, each prepared as a model's linear is."""
    generator = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(copies):
        w = torch.randn(out_features, in_features, generator=generator).to(dtype)
        kept, plan = cpu_matmul.prepare_weight(w)
        weights.append((w if kept is None else kept, plan))
    x = torch.randn(rows, in_features, generator=generator).to(dtype)

    def run():
        for w, plan in weights:
            cpu_matmul.linear(x, w, None, plan)
    return run
