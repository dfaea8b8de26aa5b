"""--dtype auto on CPU: float32 checkpoints stay float32, float16 ones become float32, bfloat16 ones
take whichever of bfloat16 and float32 the kernels measure faster here. An explicit dtype is obeyed."""

import logging

import pytest
import torch

from shardlm.engine.arg_utils import resolve_dtype
from shardlm.layers import cpu_dtype
from shardlm.layers.cpu_dtype import DECODE_BATCH, DtypeMeasurement

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def timings(one_row: tuple[float, float], batch: tuple[float, float]) -> DtypeMeasurement:
    """float32 and bfloat16 milliseconds at 1 row and at a decode batch."""
    return DtypeMeasurement({(torch.float32, 1): one_row[0], (torch.bfloat16, 1): one_row[1],
                             (torch.float32, DECODE_BATCH): batch[0], (torch.bfloat16, DECODE_BATCH): batch[1]})


def auto_logged(*args, **kwargs):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("shardlm").addHandler(handler)
    try:
        return resolve_dtype("auto", *args, **kwargs), [r.getMessage() for r in records]
    finally:
        logging.getLogger("shardlm").removeHandler(handler)


@pytest.mark.parametrize("measured, expected", [
    (timings((1.7, 0.9), (3.0, 1.5)), torch.bfloat16),     # native bfloat16 (Zen 5): faster at both
    (timings((1.7, 0.9), (9.1, 8.9)), torch.bfloat16),     # AVX2 only: half the bytes at 1 row, a tie at 16
    (timings((1.0, 1.0), (1.0, 1.05)), torch.bfloat16),    # within the margin: the checkpoint's dtype
    (timings((1.0, 1.3), (1.0, 2.7)), torch.float32),      # bfloat16 widened by torch ops (no kernels)
])
def test_auto_on_cpu_takes_the_measured_faster_dtype_for_bfloat16_checkpoints(measured, expected):
    chosen, messages = auto_logged(torch.bfloat16, CPU, (576, 1536), measured)
    assert chosen == expected
    assert any("--dtype auto: " + str(expected).replace("torch.", "") in m and "ms" in m for m in messages), messages


@pytest.mark.parametrize("checkpoint", [torch.float32, None, torch.float16])
def test_auto_on_cpu_keeps_float32_and_widens_float16(checkpoint):
    never = DtypeMeasurement({})     # not consulted: any lookup would raise
    chosen, messages = auto_logged(checkpoint, CPU, (576, 1536), never)
    assert chosen == torch.float32
    assert (checkpoint == torch.float16) == any("float16" in m for m in messages)


def test_the_measurement_times_both_dtypes_through_the_model_path():
    measured = cpu_dtype.measure(128, 256)
    assert set(measured.ms) == {(d, r) for d in (torch.float32, torch.bfloat16) for r in (1, DECODE_BATCH)}
    assert all(ms > 0 for ms in measured.ms.values())
    assert cpu_dtype.measure(128, 256) is measured          # once per shape in a process
    assert resolve_dtype("auto", torch.bfloat16, CPU, (128, 256)) in (torch.float32, torch.bfloat16)


def test_explicit_dtype_is_obeyed_and_cuda_keeps_the_checkpoints():
    assert resolve_dtype("bfloat16", torch.float32, CPU) == torch.bfloat16
    assert resolve_dtype("float32", torch.bfloat16, CPU) == torch.float32
    assert resolve_dtype("auto", torch.bfloat16, CUDA) == torch.bfloat16
    assert resolve_dtype("auto", torch.float16, CUDA) == torch.float16
