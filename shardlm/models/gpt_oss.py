"""GPT-OSS (OpenAI's gpt-oss-20b and -120b): the Llama decoder with biases on q/k/v/o, a learned
attention sink per head, alternating sliding-window (128) and full layers, YaRN rotary, and a
mixture of experts in every layer: a router with a bias whose top-k logits are softmaxed, and
experts with biases whose gate and up (interleaved by column in the checkpoint) combine as
(clamp(up) + 1) * gate * sigmoid(1.702 * gate), the gate clamped at 7 (layers/moe.py).

Expert weights come as transformers stores them, stacked per layer (mlp.experts.gate_up_proj
[E, H, 2I], down_proj [E, I, H] and their biases), or as shipped, in MXFP4 (`*_blocks`: two 4-bit
e2m1 values a byte, `*_scales`: a power-of-two exponent per 32 values), which is dequantized at
load into the model's dtype (four times the memory of the 4-bit experts)."""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from shardlm.layers.linear import Linear
from shardlm.layers.moe import ExpertActivation, FusedMoE
from shardlm.models.llama import LlamaForCausalLM, LlamaVariant

# e2m1: the 16 values of a 4-bit code (the sign is its top bit)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [E, R, G, 16] uint8 (low nibble first), scales [E, R, G] uint8 (exponent + 127) ->
    [E, G * 32, R] float32: the layout of transformers' float expert tensors."""
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2).transpose(1, 2)


class GptOssMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.router = Linear(config.hidden_size, config.num_local_experts, bias=True)    # on every rank
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size, renormalize=True, bias=True,
                                activation=ExpertActivation(alpha=getattr(config, "swiglu_alpha", 1.702),
                                                            limit=getattr(config, "swiglu_limit", 7.0)))

    def forward(self, x):
        return self.experts(x, self.router(x))


class GptOssForCausalLM(LlamaForCausalLM):
    def make_variant(self, config) -> LlamaVariant:
        return dataclasses.replace(super().make_variant(config), sinks=True)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return GptOssMoE(config)

    def load_weights(self, weights) -> set[str]:
        """The stacked expert tensors (dequantized where MXFP4) go to each layer's FusedMoE; the
        rest loads as Llama's."""
        experts_loaded = set()

        def the_rest():
            for name, tensor in _dequantized(weights):
                found = _STACKED.match(name)
                if found is None:
                    yield name, tensor
                elif self._on_this_stage(name):
                    which = {"gate_up_proj": "gate_up", "down_proj": "down"}[found.group(2)] + (found.group(3) or "")
                    self.get_submodule(found.group(1)).load_stacked(which, tensor)
                    experts_loaded.add(f"{found.group(1)}.{_PARAM[which]}")

        return super().load_weights(the_rest()) | experts_loaded

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        return super().map_checkpoint_name(name.replace(".self_attn.sinks", ".self_attn.attn.sinks"))


_PARAM = {"gate_up": "w13", "gate_up_bias": "w13_bias", "down": "w2", "down_bias": "w2_bias"}


def _dequantized(weights):
    """MXFP4 pairs (*_blocks, *_scales) as one float tensor under the float name; the rest as is."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        found = _STACKED.match(name)
        if found is None or found.group(3) not in ("_blocks", "_scales"):
            yield name, tensor
            continue
        base = f"{found.group(1)}.{found.group(2)}"
        parts = pending.setdefault(base, {})
        parts[found.group(3)] = tensor[:]
        if len(parts) == 2:
            yield base, dequantize_mxfp4(parts["_blocks"], parts["_scales"])
            del pending[base]
    if pending:
        raise ValueError(f"MXFP4 experts without their blocks or scales: {', '.join(sorted(pending))}.")
