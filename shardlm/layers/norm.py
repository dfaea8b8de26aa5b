"""RMSNorms. Llama's, with the residual add fused into the call, computed in float32 as HF does. On CPU,
rows of hidden states go through one C call (kernels/fused_ops.c) instead of nine operators."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.distributed.parallel_state import get_tp_group
from shardlm.kernels import DTYPE_CODES, fused_ops
from shardlm.layers.custom_op import CustomOp
from shardlm.layers.linear import load_slice


class RMSNorm(CustomOp):
    """norm(x) without residual; with one, (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Rows in one C call (kernels/fused_ops.c) instead of nine operators."""
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in DTYPE_CODES or self.weight.dtype != x.dtype:
            return self.forward_native(x, residual)
        T, H = x.shape
        out = torch.empty(T, H, dtype=x.dtype)
        summed = None
        if residual is not None:
            residual = residual.contiguous()
            summed = torch.empty(T, H, dtype=x.dtype)
        fused_ops().add_rmsnorm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                                None if summed is None else summed.data_ptr(), out.data_ptr(),
                                self.weight.data_ptr(), T, H, self.eps, DTYPE_CODES[x.dtype])
        return out if residual is None else (out, summed)


class Float32RMSNorm(nn.Module):
    """(offset + weight) * x / rms(x), all in float32 and then cast: Gemma's norm (offset 1, its
    weights stored around 0) and OLMo 2's (offset 0); Llama's casts before the product instead."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (self.offset + self.weight.float())).to(x.dtype)


class ShardedRMSNorm(Float32RMSNorm):
    """A Float32RMSNorm over a width that tensor parallel splits by heads (OLMo 2's q and k norms
    span all heads): this rank's rows [first, first + size) of the weight, and its sum of squares
    summed over the tensor parallel group. Heads held by `replicas` ranks each (KV heads when tp
    exceeds them) are counted once."""

    def __init__(self, full_size: int, size: int, first: int, eps: float, replicas: int = 1):
        super().__init__(size, eps)
        self.full_size, self.first, self.replicas = full_size, first, replicas
        self.tp = get_tp_group()
        self.weight.weight_loader = self._load

    def _load(self, param, loaded, shard_id=None):
        load_slice(param, loaded, 0, self.first, param.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / self.replicas
        x32 = x32 * torch.rsqrt(squares / self.full_size + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)
