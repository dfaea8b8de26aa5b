"""--dtype auto picks what the CPU runs fastest without losing precision; an explicit dtype is obeyed."""

import logging

import pytest
import torch

from shardlm.engine.arg_utils import resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ICE_LAKE = {"avx512f", "avx512bw", "avx512_vnni"}          # AVX-512 without bfloat16
SAPPHIRE_RAPIDS = ICE_LAKE | {"avx512_bf16", "amx_bf16"}
ZEN4 = {"avx512f", "avx512_bf16"}


@pytest.mark.parametrize("checkpoint, flags, expected", [
    (torch.bfloat16, ICE_LAKE, torch.float32),
    (torch.bfloat16, SAPPHIRE_RAPIDS, torch.bfloat16),
    (torch.bfloat16, ZEN4, torch.bfloat16),
    (torch.float16, SAPPHIRE_RAPIDS, torch.float32),    # float16 is CUDA only
    (torch.float32, ICE_LAKE, torch.float32),
    (None, ICE_LAKE, torch.float32),
])
def test_auto_on_cpu(checkpoint, flags, expected):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("shardlm").addHandler(handler)
    try:
        assert resolve_dtype("auto", checkpoint, CPU, flags) == expected
    finally:
        logging.getLogger("shardlm").removeHandler(handler)
    if checkpoint in (torch.bfloat16, torch.float16):    # the choice is logged with its reason
        assert any("--dtype auto" in r.getMessage() for r in records)


def test_explicit_dtype_is_obeyed_and_cuda_keeps_the_checkpoints():
    assert resolve_dtype("bfloat16", torch.float32, CPU, ICE_LAKE) == torch.bfloat16
    assert resolve_dtype("float32", torch.bfloat16, CPU, SAPPHIRE_RAPIDS) == torch.float32
    assert resolve_dtype("auto", torch.bfloat16, CUDA, set()) == torch.bfloat16
    assert resolve_dtype("auto", torch.float16, CUDA, set()) == torch.float16
