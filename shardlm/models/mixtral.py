"""Mixtral: the Llama decoder with a mixture of experts in place of the MLP (layers/moe.py).

Checkpoint names: `block_sparse_moe.gate` (the router) and `block_sparse_moe.experts.E.w1/w3/w2`
(gate, up, down of expert E), loaded into the stacked `mlp.experts.w13` / `mlp.experts.w2`.
"""

from __future__ import annotations

import re

from torch import nn

from shardlm.layers.linear import Linear
from shardlm.layers.moe import FusedMoE, expert_checkpoint_name
from shardlm.models.llama import LlamaForCausalLM

_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


class MixtralMoE(nn.Module):
    def __init__(self, config, bias: bool = False):
        super().__init__()
        self.gate = Linear(config.hidden_size, config.num_local_experts)       # the router, on every rank
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size, renormalize=True)

    def forward(self, x):
        return self.experts(x, self.gate(x))


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return MixtralMoE(config)

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        return (expert_checkpoint_name(name, _EXPERT, gate="w1", up="w3")
                or super().map_checkpoint_name(name.replace(".block_sparse_moe.gate.", ".mlp.gate.")))
