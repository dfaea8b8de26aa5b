"""oneDNN weight packing is used only where this CPU supports it for that dtype (bf16 needs
AVX-512 or AVX-NE-CONVERT); elsewhere the plain path runs, with the same results."""

import pytest
import torch
import torch.nn.functional as F

from shardlm.layers.cpu_matmul import linear, onednn_pack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_or_plain_linear_matches_torch(dtype):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype), torch.randn(7, 64, dtype=dtype)
    packed = onednn_pack(w)            # None where oneDNN cannot do this dtype here: never an error
    got = linear(x, packed if packed is not None else w, b)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=tol, rtol=tol)
