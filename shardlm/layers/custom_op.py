"""An op with a portable forward (torch operators, any device) and, where shardlm's C kernels are
built, a CPU one, chosen once per op instance at its first call from its input's device (as
vLLM's CustomOp chooses per platform): the layers that use an op hold no device branches.

forward_cpu may still hand a call to forward_native, for a layout its kernel does not take (a
strided view, a dtype without a C code); it says which in its own first lines."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.kernels import fused_ops


class CustomOp(nn.Module):
    def forward(self, *args):
        impl = self.__dict__.get("_impl")
        if impl is None:
            impl = self.__dict__["_impl"] = self._choose(args[0].device)
        return impl(*args)

    def _choose(self, device: torch.device):
        return self.forward_cpu if device.type == "cpu" and fused_ops() is not None else self.forward_native

    def forward_native(self, *args):
        raise NotImplementedError

    def forward_cpu(self, *args):
        return self.forward_native(*args)
