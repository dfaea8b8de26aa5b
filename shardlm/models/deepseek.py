"""DeepSeek-V2 and V3 (and V2-Lite, R1, and the models built on their blocks): multi-head latent
attention (MLA) and DeepSeek's mixture of experts, in the Llama decoder.

MLA: each token's keys and values come from one latent c (kv_lora_rank dims, after
kv_a_layernorm) and one rotary key k_pe (qk_rope_head_dim dims) shared by every head; kv_b_proj
expands c into each head's k_nope and v. The KV cache holds only [c, k_pe] per token: one
"KV head" of kv_lora_rank + qk_rope_head_dim dims, whose first kv_lora_rank dims are also the
values (Attention's value_dim). Attention runs in the latent space, the up-projections absorbed
(the DeepSeek-V2 paper, vLLM's MLA backend): each head's query becomes [q_nope W_UK, q_pe], whose
dot product with [c, k_pe] is q_nope . k_nope + q_pe . k_pe; the output, a mix of latents, goes
through W_UV to the head's value dims before o_proj. So every step, prefill too, reads the latent
cache alone. Tensor parallel splits the heads (q_b_proj, kv_b_proj, o_proj); the latent is the
same on every rank, which is what decode context parallel spreads: -dcp D (tp a multiple of D)
gives each of D ranks 1/D of every sequence's latent cache (context_parallel.py, unchanged).

DeepSeek lays the rotary dims out in interleaved pairs (V2 always; V3 where rope_interleave):
their rows of q and k are de-interleaved at load (a dot product does not change when q and k are
permuted alike), so the usual rotary embedding applies. YaRN: mscale_all_dim scales the softmax.

MoE: n_routed_experts routed by GroupedTopK (layers/moe.py: V2's softmax with greedy or
group-limited choice, V3's sigmoid with e_score_correction_bias and groups scored by their best
two), routed_scaling_factor, n_shared_experts as one MLP every token uses; dense MLPs on the first
first_k_dense_replace layers (and off the moe_layer_freq ones).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from shardlm import kernels
from shardlm.distributed.parallel_state import get_tp_group
from shardlm.kernels import DTYPE_CODES
from shardlm.layers.attention import Attention
from shardlm.layers.cpu_matmul import blocked, goes_into_panels, pack_blocked
from shardlm.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, load_slice
from shardlm.layers.moe import FusedMoE, GroupedTopK, expert_checkpoint_name
from shardlm.layers.norm import RMSNorm
from shardlm.layers.rotary import ApplyRotary
from shardlm.models.deepseek_cpu_decode import FusedLatentLayers
from shardlm.models.llama import LlamaForCausalLM, LlamaMLP

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def yarn_softmax_mscale(config) -> float:
    """YaRN's factor on the softmax scale: mscale(factor, mscale_all_dim) squared (1 without YaRN)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    all_dim, factor = params.get("mscale_all_dim", 0), params.get("factor", 1.0)
    if params.get("rope_type", params.get("type", "default")) == "default" or not all_dim or factor <= 1:
        return 1.0
    return (0.1 * all_dim * math.log(factor) + 1.0) ** 2


class LatentUpProjection(nn.Module):
    """kv_b_proj, never run as a linear: this rank's heads' W_UK [H, nope, r] and W_UV [H, r, v],
    taken apart once loaded, for the absorbed attention. On CPU, where the linears' weights go into
    the blocked kernel's panels, each head's W_UK^T and W_UV^T go there too (stacked [H, ...]) and
    both products run as one C call over the heads (kernels: blocked_matmul_heads)."""

    def __init__(self, kv_lora_rank: int, num_heads: int, nope_dim: int, v_dim: int):
        super().__init__()
        tp = get_tp_group()
        self.heads, self.nope, self.v, self.rank = num_heads // tp.world_size, nope_dim, v_dim, kv_lora_rank
        rows = self.heads * (nope_dim + v_dim)
        self.weight = nn.Parameter(torch.empty(rows, kv_lora_rank), requires_grad=False)
        self.weight.weight_loader = lambda param, loaded, shard_id=None: load_slice(
            param.data, loaded, 0, tp.rank_in_group * rows, rows)
        self.w_uk: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None
        self.uk_panels: torch.Tensor | None = None     # [H, packed W_UK[h]^T] (CPU panels)
        self.uv_panels: torch.Tensor | None = None     # [H, packed W_UV[h]^T]

    def process_weights_after_loading(self) -> None:
        per_head = self.weight.data.view(self.heads, self.nope + self.v, -1)
        self.w_uk = per_head[:, :self.nope].contiguous()                      # [H, nope, r]
        self.w_uv = per_head[:, self.nope:].transpose(1, 2).contiguous()      # [H, r, v]
        if goes_into_panels(self.weight.data) and kernels.blocked_matmul_heads() is not None:
            self.uk_panels = torch.stack([pack_blocked(self.w_uk[h].t()) for h in range(self.heads)])
            self.uv_panels = torch.stack([pack_blocked(self.w_uv[h].t()) for h in range(self.heads)])
            self.w_uk = self.w_uv = None

    def keys(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope] (a view of q) -> each head's latent query [H, T, r]."""
        if self.uk_panels is None:
            return torch.bmm(q_nope.transpose(0, 1), self.w_uk)
        return self._per_head(q_nope, self.uk_panels, self.rank)

    def values(self, out: torch.Tensor) -> torch.Tensor:
        """Each head's mix of latents [T, H, r] -> its values [H, T, v]."""
        if self.uv_panels is None:
            return torch.bmm(out.transpose(0, 1), self.w_uv)
        return self._per_head(out, self.uv_panels, self.v)

    def _per_head(self, x: torch.Tensor, panels: torch.Tensor, N: int) -> torch.Tensor:
        x = x if x.stride(2) == 1 else x.contiguous()
        T, H, K = x.shape
        y = torch.empty(H, T, N, dtype=x.dtype)
        if kernels.blocked_matmul_heads()(
                x.data_ptr(), x.stride(0), x.stride(1), panels.data_ptr(), panels.stride(0), y.data_ptr(), H, T, N, K,
                DTYPE_CODES[x.dtype]):
            raise MemoryError(f"the per-head products could not allocate their {T} x {K} work buffer")
        return y


class MultiHeadLatentAttention(nn.Module):
    fused_decode_layers = FusedLatentLayers      # the one-call CPU decode step of a stage of these layers

    def __init__(self, config):
        super().__init__()
        heads, tp = config.num_attention_heads, get_tp_group().world_size
        if heads % tp:
            raise ValueError(f"{heads} attention heads do not split over tensor parallel size {tp}.")
        self.num_heads = heads // tp
        self.nope, self.rope, self.v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        qk_dim, bias = self.nope + self.rope, bool(getattr(config, "attention_bias", False))
        self.q_lora = getattr(config, "q_lora_rank", None)
        if self.q_lora:
            self.q_a_proj = Linear(config.hidden_size, self.q_lora, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora, heads * qk_dim)
        else:                           # V2-Lite
            self.q_proj = ColumnParallelLinear(config.hidden_size, heads * qk_dim)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = LatentUpProjection(self.rank, heads, self.nope, self.v)
        self.o_proj = RowParallelLinear(heads * self.v, config.hidden_size, bias=bias)
        scale = qk_dim ** -0.5 * yarn_softmax_mscale(config)
        self.attn = Attention(self.num_heads, 1, self.rank + self.rope, scale, value_dim=self.rank)
        self.rotary = ApplyRotary()

    def forward(self, cos_sin, x, meta):
        T, H = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(T, H, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        pe = self.rotary(torch.cat([q_pe, k_pe.unsqueeze(1)], dim=1), cos_sin)     # [T, H + 1, rope]
        q_latent = self.kv_b_proj.keys(q_nope)                                      # [H, T, r]
        q = torch.cat([q_latent.transpose(0, 1), pe[:, :H]], dim=-1)                 # [T, H, r + rope]
        k = torch.cat([latent, pe[:, H]], dim=-1).unsqueeze(1)                       # [T, 1, r + rope]
        out = self.attn(q, k, None, meta).view(T, H, self.rank)                      # mixed latents
        out = self.kv_b_proj.values(out)                                             # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(T, H * self.v))


class DeepseekRouter(nn.Module):
    """mlp.gate: the router's weight and (V3) e_score_correction_bias, in float32 as DeepSeek keeps
    them; the logits in float32 (on CPU from the blocked kernel's float32 panels where float32
    weights go there)."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                     requires_grad=False) if correction_bias else None)
        self.num_experts, self.in_panels = num_experts, False

    def process_weights_after_loading(self) -> None:
        """The weight into panels in its place (as the linears' are), where float32 weights go there."""
        if goes_into_panels(self.weight.data):
            self.weight = nn.Parameter(pack_blocked(self.weight.data), requires_grad=False)
            self.in_panels = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_panels:
            return blocked(x.float(), self.weight, None, self.num_experts)
        return nn.functional.linear(x.float(), self.weight)


class DeepseekMoE(nn.Module):
    def __init__(self, config, v3: bool):
        super().__init__()
        num_experts = config.n_routed_experts
        method = getattr(config, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
        self.gate = DeepseekRouter(config.hidden_size, num_experts, correction_bias=method == "noaux_tc")
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size)
        grouped = method in ("noaux_tc", "group_limited_greedy")
        self.experts.routing = GroupedTopK(
            config.num_experts_per_tok, getattr(config, "scoring_func", None) or ("sigmoid" if v3 else "softmax"),
            (config.n_group or 1) if grouped else 1, (config.topk_group or 1) if grouped else 1,
            bool(config.norm_topk_prob), float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
            self.gate.e_score_correction_bias)
        shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = (LlamaMLP(config, intermediate_size=config.moe_intermediate_size * shared)
                               if shared else None)

    def forward(self, x):
        out = self.experts(x, self.gate(x)).to(x.dtype)
        return out + self.shared_experts(x) if self.shared_experts is not None else out


def deepseek_mlp(config, layer_idx: int, v3: bool) -> nn.Module:
    """Layer layer_idx's feed-forward block: experts from first_k_dense_replace on (every
    moe_layer_freq-th layer), a dense MLP before."""
    moe = (config.n_routed_experts and layer_idx >= (config.first_k_dense_replace or 0)
           and layer_idx % (getattr(config, "moe_layer_freq", 1) or 1) == 0)
    return DeepseekMoE(config, v3) if moe else LlamaMLP(config)


# q/k/v are not merged (latent attention); gate and up are, in the dense and shared MLPs
_STACKED = [(".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1)]


def deepseek_checkpoint_name(name: str) -> tuple[str, object]:
    """A DeepSeek checkpoint tensor's parameter and shard: experts into their layer's stacked w13 /
    w2, gate and up into gate_up_proj (the target's layers and the MTP layer's block alike)."""
    found = expert_checkpoint_name(name, _EXPERT, gate="gate_proj", up="up_proj")
    if found is not None:
        return found
    for merged, part, shard in _STACKED:
        if part in name:
            return name.replace(part, merged), shard
    return name, None


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    stacked_params = _STACKED
    v3 = False

    def make_attention(self, config, layer_idx: int) -> nn.Module:
        return MultiHeadLatentAttention(config)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return deepseek_mlp(config, layer_idx, self.v3)

    # its latent up-projection (kv_b_proj) is split into per-head float blocks, which weights taken
    # as stored (GGUF, GPTQ, AWQ) do not offer
    reads_quantized_checkpoints = False

    @property
    def interleaved_rope(self) -> bool:
        return True

    def checkpoint_tensors(self, weights):
        """The rotary rows of q (each head's last qk_rope_head_dim) and of kv_a_proj_with_mqa (its
        last ones) de-interleaved: pairs (0, 1), (2, 3), ... become (0, R/2), (1, R/2 + 1), ..."""
        c = self.config
        rope, qk_dim = c.qk_rope_head_dim, c.qk_nope_head_dim + c.qk_rope_head_dim
        order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        for name, tensor in weights:
            if self.interleaved_rope and re.search(r"\.self_attn\.(q_b_proj|q_proj|kv_a_proj_with_mqa)\.(weight|bias)$",
                                                   name):
                rows = tensor[:]
                width = rows.shape[0] if "kv_a_proj" in name else qk_dim
                per = rows.view(-1, width, *rows.shape[1:])
                rope_rows = per[:, width - rope:].index_select(1, order)
                tensor = torch.cat([per[:, :width - rope], rope_rows], dim=1).reshape(rows.shape)
            yield name, tensor

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        return deepseek_checkpoint_name(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    v3 = True

    @property
    def interleaved_rope(self) -> bool:
        return bool(getattr(self.config, "rope_interleave", True))
