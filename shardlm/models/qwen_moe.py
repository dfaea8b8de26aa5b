"""Qwen2-MoE and Qwen3-MoE: the Llama decoder with experts on the layers the config says
(`decoder_sparse_step`, `mlp_only_layers`) and a dense MLP on the others.

Qwen2-MoE adds a shared expert that every token uses, scaled by sigmoid(shared_expert_gate(x)),
and has q/k/v biases; Qwen3-MoE has no shared expert but an RMSNorm on each q and k head.
`norm_topk_prob` says whether the top-k routing weights are renormalised.
Checkpoint names: `mlp.gate` (the router), `mlp.experts.E.gate_proj/up_proj/down_proj`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from shardlm.layers.linear import Linear
from shardlm.layers.moe import FusedMoE, expert_checkpoint_name
from shardlm.models.llama import LlamaForCausalLM, LlamaMLP

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class QwenSparseMoE(nn.Module):
    def __init__(self, config, shared_expert: bool):
        super().__init__()
        self.gate = Linear(config.hidden_size, config.num_experts)        # the router, on every rank
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob))
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert:
            self.shared_expert = LlamaMLP(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1)

    def forward(self, x):
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    shared_expert = True

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        sparse = (config.num_experts > 0 and layer_idx not in (config.mlp_only_layers or [])
                  and (layer_idx + 1) % config.decoder_sparse_step == 0)
        return QwenSparseMoE(config, self.shared_expert) if sparse else LlamaMLP(config)

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        return (expert_checkpoint_name(name, _EXPERT, gate="gate_proj", up="up_proj")
                or super().map_checkpoint_name(name))


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qkv_bias = None          # from config.attention_bias (none in Qwen3)
    qk_norm = True
    shared_expert = False
