import torch
import torch.nn.functional as F
from torch import nn

from shardlm.kernels import DTYPE_CODES, fused_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input is [gate | up] along the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous() and x.dtype in DTYPE_CODES
                and fused_ops() is not None):      # one C call instead of three operators
            out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
            fused_ops().silu_and_mul(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1] // 2, DTYPE_CODES[x.dtype])
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
