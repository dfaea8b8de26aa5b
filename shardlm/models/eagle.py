"""An EAGLE draft head for Llama-family targets, from an EAGLE(-1) checkpoint as vLLM loads one:
a config.json of a Llama model (usually one layer) and tensors fc.weight [H, 2H] and
layers.N.* (with or without a "model." prefix), optionally embed_tokens.weight.

At position p it reads the embedding of the token after p and the target's final hidden state
at p, mixes them with fc, and runs its decoder layers (the first without its input norm) to
predict the target's hidden state at p + 1; the target's LM head turns that into the token after
next. The embedding and LM head are the target's (read from the target's checkpoint where the
head has none), whole on this rank.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.config import ModelConfig
from shardlm.layers.linear import default_weight_loader
from shardlm.layers.rotary import RotaryEmbedding
from shardlm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from shardlm.model_loader.weights import built_in, iterate_weights
from shardlm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaVariant


def load_eagle(head: ModelConfig, target: ModelConfig, device: torch.device) -> EagleLlama:
    """The EAGLE head of `head.model`, in the target's dtype, on `device` (whole: call within
    parallel_state.alone())."""
    with built_in(target.dtype, device):
        model = EagleLlama(head.hf_config, target.max_model_len, target.dtype)
    model.load_weights(iterate_weights(head.model), iterate_weights(target.model))
    return model


def load_head_tensors(params: dict, weights, kind: str, special=None) -> set[str]:
    """An EAGLE head's checkpoint tensors into its parameters (q/k/v and gate/up into the merged
    qkv_proj and gate_up_proj, as in the target) -> the names loaded. special(name, tensor): True
    when it took the tensor itself."""
    loaded = set()
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name or (special is not None and special(name, tensor)):
            continue
        shard = None
        for merged, part, shard_id in LlamaForCausalLM.stacked_params:
            if part in name:
                name, shard = name.replace(part, merged), shard_id
                break
        if name not in params:
            raise ValueError(f"The checkpoint has a tensor {name!r} that an {kind} head does not have: is it an "
                             f"{kind} head of a Llama-family model?")
        getattr(params[name], "weight_loader", default_weight_loader)(params[name], tensor, shard)
        loaded.add(name)
    return loaded


class EagleLlama(nn.Module):
    def __init__(self, config, max_position: int, dtype: torch.dtype):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_position, dtype)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.fc = nn.Linear(2 * hidden, hidden, bias=bool(getattr(config, "eagle_fc_bias", False)))
        bias = bool(getattr(config, "attention_bias", False))
        variant = LlamaVariant(qkv_bias=bias, o_bias=bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, LlamaMLP(config), variant)
                                    for _ in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()      # EAGLE: its input is not normalized
        self.lm_head = ParallelLMHead(config.vocab_size, hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, target_hidden: torch.Tensor):
        """input_ids: the token after each position; target_hidden: the target's (or this head's
        previous) hidden state at each position -> the predicted hidden state of the next."""
        hidden = self.fc(torch.cat([self.embed_tokens(input_ids), target_hidden.to(self.fc.weight.dtype)], dim=-1))
        cos_sin = self.rotary.lookup(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(cos_sin, hidden, residual, meta)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, head_weights, target_weights) -> None:
        """head_weights: the EAGLE checkpoint's tensors; target_weights: the target's, for the
        embedding and LM head the head lacks."""
        params = dict(self.named_parameters())
        loaded = load_head_tensors(params, head_weights, "EAGLE(-1)")
        embedding = lm_head = None
        for name, tensor in target_weights:
            if name == "model.embed_tokens.weight":
                embedding = tensor
            elif name == "lm_head.weight":
                lm_head = tensor
        for name, tensor in (("embed_tokens.weight", embedding),
                             ("lm_head.weight", lm_head if lm_head is not None else embedding)):
            if name not in loaded and tensor is not None:
                getattr(params[name], "weight_loader", default_weight_loader)(params[name], tensor, None)
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"The EAGLE head lacks weights for: {', '.join(missing[:8])}.")
