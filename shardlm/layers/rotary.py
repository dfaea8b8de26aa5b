"""Rotary position embedding (neox style, as Llama/Mistral/Qwen2 use), with HF's rope scaling."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.kernels import DTYPE_CODES, fused_ops
from shardlm.layers.custom_op import CustomOp

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The config's rope parameters; with layer_type, those of that kind of layer (Gemma 3 keys
    them by "sliding_attention" and "full_attention")."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return dict(params[layer_type] if layer_type is not None else params)


def compute_inv_freq(hf_config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(hf_config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(_STATIC_ROPE_TYPES)}.")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    extra = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_position: int, dtype: torch.dtype, layer_type: str | None = None):
        super().__init__()
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim, layer_type)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # [max_position, head_dim] each, in the model dtype (as HF casts them); the first half of
        # sin is negated so that rotate_half(x) * sin == cat(x2, x1) * signed_sin
        sin = (emb.sin() * scaling).to(dtype)
        sin[:, :head_dim // 2].neg_()
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("signed_sin", sin, persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's positions, [T, 1, D]: computed once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


class ApplyRotary(CustomOp):
    """x: [T, heads, D] (q and k heads together), cos_sin from RotaryEmbedding.lookup -> rotated."""

    def forward_native(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, signed_sin = cos_sin
        half = x.shape[-1] // 2
        return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), signed_sin)

    def forward_cpu(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """In place, in one C call (x is a fresh projection output that nothing else reads)."""
        cos, signed_sin = cos_sin
        T, heads, D = x.shape
        if (x.stride(2) != 1 or x.stride(1) != D or x.dtype not in DTYPE_CODES or cos.dtype != x.dtype
                or not cos.is_contiguous() or not signed_sin.is_contiguous()):
            return self.forward_native(x, cos_sin)
        fused_ops().rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), T, heads, D,
                           DTYPE_CODES[x.dtype])
        return x
