import torch
import torch.nn.functional as F

from shardlm.kernels import DTYPE_CODES, fused_ops
from shardlm.layers.custom_op import CustomOp


class GeluTanhAndMul(torch.nn.Module):
    """gelu_tanh(gate) * up (Gemma's gated MLP), where the input is [gate | up] along the last
    dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class SiluAndMul(CustomOp):
    """silu(gate) * up, where the input is [gate | up] along the last dimension."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not x.is_contiguous() or x.dtype not in DTYPE_CODES:
            return self.forward_native(x)
        return silu_and_mul(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[gate | up] rows [T, 2I] (contiguous, float32 or bfloat16, on CPU) -> silu(gate) * up in one
    C call instead of three operators."""
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    fused_ops().silu_and_mul(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1] // 2, DTYPE_CODES[x.dtype])
    return out
