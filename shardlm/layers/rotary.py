"""Rotary position embedding (neox style, as Llama/Mistral/Qwen2 use), with HF's rope scaling.

A partial rotary embedding (partial_rotary_factor < 1: the first R of each head's D dims rotate,
pairing i with i + R/2) runs on full-width tables: the model lays each q and k head out so that
its rotary halves sit at [0, R/2) and [D/2, D/2 + R/2) (permute_partial_rotary, at load: a dot
product does not change when q and k are permuted alike), and the tables hold cos 1, sin 0 on the
other dims. So every path, the C kernels too, rotates D dims pairing i with i + D/2."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.kernels import DTYPE_CODES, fused_ops
from shardlm.layers.custom_op import CustomOp

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def _rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The config's rope parameters; with layer_type, those of that kind of layer (Gemma 3 keys
    them by "sliding_attention" and "full_attention")."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return dict(params[layer_type] if layer_type is not None else params)


def rotary_dim(hf_config, head_dim: int, layer_type: str | None = None) -> int:
    """R: the dims of each head that rotate (partial_rotary_factor x D; all of them by default)."""
    params = _rope_parameters(hf_config, layer_type)
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None)) or 1.0
    return int(head_dim * factor)


def compute_inv_freq(hf_config, head_dim: int, layer_type: str | None = None,
                     max_position: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [R / 2], the cos/sin scaling). LongRoPE takes its long factors when
    max_position (the engine's max_model_len) is past original_max_position_embeddings, else its
    short ones: chosen once, so every cached key was rotated alike (as vLLM does; transformers
    switches with the sequence's length)."""
    params = _rope_parameters(hf_config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(_STATIC_ROPE_TYPES)}.")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = rotary_dim(hf_config, head_dim, layer_type)
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    extra = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "longrope":
        extra["seq_len"] = max_position
    with torch.device("cpu"):       # whatever device the model is being built on
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(scaling)


def permute_partial_rotary(rows: torch.Tensor, head_dim: int, rot: int) -> torch.Tensor:
    """q or k projection rows (or biases, or a per-head norm's weight), heads of head_dim rows
    each, laid out for full-width tables: each head's rotary halves at [0, R/2) and
    [D/2, D/2 + R/2), its other dims between (module docstring)."""
    if rot == head_dim:
        return rows
    half, rest = rot // 2, (head_dim - rot) // 2
    order = torch.cat([torch.arange(0, half), torch.arange(rot, rot + rest), torch.arange(half, rot),
                       torch.arange(rot + rest, head_dim)])
    heads = rows.shape[0] // head_dim
    index = (torch.arange(heads)[:, None] * head_dim + order[None, :]).flatten()
    return rows.index_select(0, index)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_position: int, dtype: torch.dtype, layer_type: str | None = None):
        super().__init__()
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim, layer_type, max_position)
        t = torch.arange(max_position, dtype=torch.float32)       # on the device being built on (load_model's)
        inv_freq = inv_freq.to(t.device)                          # transformers' rope functions give CPU tensors
        freqs = torch.outer(t, inv_freq)
        # [max_position, D / 2] per half, in the model dtype (as HF casts them); dims past R / 2 do
        # not rotate (cos 1, sin 0). The first half of sin is negated so that
        # rotate_half(x) * sin == cat(x2, x1) * signed_sin.
        pad = head_dim // 2 - inv_freq.shape[0]
        cos = nn.functional.pad(freqs.cos() * scaling, (0, pad), value=1.0).to(dtype)
        sin = nn.functional.pad(freqs.sin() * scaling, (0, pad), value=0.0).to(dtype)
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("signed_sin", torch.cat((-sin, sin), dim=-1), persistent=False)

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
