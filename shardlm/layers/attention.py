"""The attention layer: one per decoder layer. It holds that layer's slice of the paged KV
cache (bound by the model runner) and attends through the engine's attention backend
(shardlm/attention/), chosen once for the device and dtype. Under context parallel it gathers
the cp group's queries, has the backend attend over this rank's positions, and merges the
group's partial outputs (attention/context_parallel.py)."""

from __future__ import annotations

import re

import torch
from torch import nn

from shardlm.attention.backend import AttentionBackend, LastLayerRows, metadata_of
from shardlm.attention.context_parallel import gather_queries, merge_partials
from shardlm.distributed.parallel_state import get_cp_group, get_dcp_group
from shardlm.layers.linear import load_slice
from shardlm.layers.rotary import ApplyRotary


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None,
                 value_dim: int | None = None):
        """sliding_window: each query attends to itself and the window - 1 keys before it (None: all);
        logit_softcap: scores become cap * tanh(scores / cap) before the softmax (Gemma 2);
        value_dim: the values are the first value_dim dims of each key, and there is no V cache
        (multi-head latent attention: the cache holds the latent and its rotary part, models/deepseek.py)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.values_in_keys = value_dim is not None
        self.k_scale = self.v_scale = 1.0          # an FP8 KV cache's per-tensor scales (the checkpoint's, else 1)
        self.v_head_dim = value_dim or head_dim
        self.sliding_window, self.logit_softcap = sliding_window, logit_softcap
        self.sinks: nn.Parameter | None = None      # a learned logit per head beside the keys (GPT-OSS; add_sinks)
        self.k_cache: torch.Tensor | None = None   # layout: backend.kv_cache_shape(), bound by the runner
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.kv_group = 0                          # its KV cache group (kv_cache_groups.py) and the K/V
        self.kv_slot = 0                           # tensors it shares with one layer of each other group
        self.rotary = ApplyRotary()
        # context parallel: the ranks each holding a share of every sequence's KV (cp), those of
        # them in this TP group (dcp: they hold the same tokens, other heads)
        self.cp, self.dcp = get_cp_group(), get_dcp_group()

    def add_sinks(self, first_head: int) -> None:
        """A sink logit per head of this rank (heads first_head.. of the checkpoint's): the softmax
        runs over the keys and the sink, whose value is zero, so each query's output is scaled by
        sigmoid(lse - sink) (lse: the log-sum-exp of its scores)."""
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.sinks.weight_loader = lambda param, loaded, shard_id=None: load_slice(param, loaded, 0, first_head,
                                                                                   self.num_heads)

    @property
    def plain(self) -> bool:
        """Full attention without soft-capping, sinks or values inside the keys: what the C kernels compute."""
        return (self.sliding_window is None and self.logit_softcap is None and self.sinks is None
                and not self.values_in_keys)

    def cache_values_per_token(self) -> int:
        """Values this layer's KV cache holds per token: K and V, or (latent) K alone."""
        return self.num_kv_heads * self.head_dim * (1 if self.values_in_keys else 2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (v None where the values are inside the keys) -> [T, H * Dv]"""
        meta = metadata_of(self, meta)
        if self.cp.world_size == 1:
            if self.sinks is None:
                return self.backend.forward(self, q, k, v, meta)
            out, lse = self.backend.forward_partial(self, q, k, v, meta)      # scaled by its sink's share
            return (out * torch.sigmoid(lse - self.sinks.float()).unsqueeze(-1)).to(q.dtype).view(q.shape[0], -1)
        queries = gather_queries(q, self.cp, self.dcp.world_size, meta.pcp_counts)
        out, lse = self.backend.forward_partial(self, queries, k, v, meta)
        return merge_partials(out, lse, self.cp, self.num_heads, self.dcp.rank_in_group * self.num_heads, q.dtype,
                              meta.pcp_own, self.sinks)

    def forward_qkv(self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None, meta,
                    qk_norm=None) -> torch.Tensor:
        """From the fresh projection qkv [T, (H + 2 Hkv) * D] -> [T, H * D]: the rotary embedding
        on q and k (after qk_norm, a transform of [T, H + Hkv, D], where the model has one), K/V
        into the cache, attention. One fused call where the backend has it for this step.
        cos_sin None: a layer without a rotary embedding (NoPE)."""
        meta = metadata_of(self, meta)
        qkv = self._qk_normed(qkv, qk_norm)
        out = self.backend.rotary_and_attend(self, qkv, cos_sin, meta)
        if out is not None:
            return out
        return self.forward(*self._rotated(qkv, cos_sin), meta)

    def forward_qkv_rows(self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None, meta,
                         last: LastLayerRows, qk_norm=None) -> torch.Tensor | None:
        """forward_qkv for the rows last.rows alone -> [R, H * D]: every row's K/V into the cache
        (later steps read them), those rows' queries attended. None: no row (K/V cached only)."""
        q, k, v = self._rotated(self._qk_normed(qkv, qk_norm), cos_sin)
        self.backend.write_kv(self, k, v, metadata_of(self, meta))
        rows = last.rows
        return self.forward(q[rows], k[rows], v[rows], last.meta) if rows.numel() else None

    def _qk_normed(self, qkv: torch.Tensor, qk_norm) -> torch.Tensor:
        if qk_norm is None:
            return qkv
        T, H, Hkv, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = qkv.split([(H + Hkv) * D, Hkv * D], dim=-1)
        return torch.cat([qk_norm(qk.reshape(T, H + Hkv, D)).reshape(T, (H + Hkv) * D), v], dim=-1)

    def _rotated(self, qkv: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (H + 2 Hkv) * D] -> q [T, H, D], k and v [T, Hkv, D], the rotary embedding on q and k."""
        T, H, Hkv, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = qkv.split([(H + Hkv) * D, Hkv * D], dim=-1)
        qk = qk.view(T, H + Hkv, D)
        q, k = (qk if cos_sin is None else self.rotary(qk, cos_sin)).split([H, Hkv], dim=1)
        return q, k, v.view(T, Hkv, D)


# a checkpoint's FP8 KV cache scale for one layer: k_scale, v_scale or kv_scale (both), wherever under
# its self_attn the checkpoint puts it
KV_SCALE = re.compile(r"\.self_attn\.(?:[a-z_]+\.)?(k|v|kv)_scale$")


def take_kv_scale(attn: Attention, found: re.Match, tensor) -> None:
    """The scale KV_SCALE found in a checkpoint tensor's name onto the layer's attention."""
    value = float((tensor if isinstance(tensor, torch.Tensor) else tensor[...]).float().reshape(-1)[0])
    for which in ("k", "v") if found.group(1) == "kv" else (found.group(1),):
        setattr(attn, f"{which}_scale", value)
