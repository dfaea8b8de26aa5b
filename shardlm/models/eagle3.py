"""An EAGLE-3 draft head for Llama-family targets, from its checkpoint as vLLM loads one: a Llama
config (with draft_vocab_size, optionally eagle_aux_hidden_state_layer_ids) and tensors
fc.weight [H, 3H], midlayer.* (its attention reads 2H), norm.weight, lm_head.weight
[draft vocab, H] and d2t (draft token id -> its offset to the target's id); the embedding is the
target's unless the head has one.

The target hands on its residual stream at three layers (aux_layers: the input of each, that
is hidden + residual there); fc mixes them into one hidden state per position. At position p the
head reads the embedding of the token after p (normalized) beside that hidden state (normalized),
and predicts the hidden state of p + 1; its LM head scores the draft vocabulary. Later steps feed
back the head's own hidden state before its final norm.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.config import ModelConfig
from shardlm.layers.linear import QKVParallelLinear, default_weight_loader
from shardlm.layers.norm import RMSNorm
from shardlm.layers.rotary import RotaryEmbedding
from shardlm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from shardlm.model_loader.weights import built_in, iterate_weights
from shardlm.models.eagle import load_head_tensors
from shardlm.models.llama import LlamaAttention, LlamaMLP, LlamaVariant


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers whose input EAGLE-3 reads when its config does not say (vLLM's choice)."""
    return (2, num_layers // 2, num_layers - 3)


def aux_layers_of(head_config, target_num_layers: int) -> tuple[int, ...]:
    ids = getattr(head_config, "eagle_aux_hidden_state_layer_ids", None)
    return tuple(ids) if ids else default_aux_layers(target_num_layers)


class Eagle3MidLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, LlamaVariant(qkv_bias=bias, o_bias=bias))
        a = self.self_attn
        a.qkv_proj = QKVParallelLinear(2 * hidden, a.head_dim, config.num_attention_heads,
                                       getattr(config, "num_key_value_heads", None) or config.num_attention_heads, bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(self, cos_sin, embeds, hidden, meta):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(cos_sin, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Llama(nn.Module):
    def __init__(self, config, num_aux: int, max_position: int, dtype: torch.dtype):
        super().__init__()
        hidden = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_position, dtype)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.midlayer = Eagle3MidLayer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = ParallelLMHead(draft_vocab, hidden)
        # draft id -> target id offset (d2t); zeros when the head scores the whole vocabulary
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's residual streams at the aux layers [T, num_aux * H] -> [T, H]."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, hidden: torch.Tensor):
        """-> (the normalized hidden state, for logits; the one before the norm, fed to the next step)."""
        cos_sin = self.rotary.lookup(positions)
        x, residual = self.midlayer(cos_sin, self.embed_tokens(input_ids), hidden, meta)
        return self.norm(x, residual)

    def target_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of the draft vocabulary, as target token ids."""
        draft = self.lm_head(hidden).argmax(dim=-1)
        return draft + self.d2t[draft]

    def load_weights(self, head_weights, target_weights) -> None:
        params = dict(self.named_parameters())

        def vocabulary_map(name, tensor) -> bool:
            if name == "d2t":
                self.d2t.copy_(tensor[:].to(torch.long))
            return name in ("d2t", "t2d")      # t2d (target -> draft) is d2t's inverse: not needed
        loaded = load_head_tensors(params, head_weights, "EAGLE-3", vocabulary_map)
        if "embed_tokens.weight" not in loaded:
            for name, tensor in target_weights:
                if name == "model.embed_tokens.weight":
                    param = params["embed_tokens.weight"]
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor, None)
                    loaded.add("embed_tokens.weight")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"The EAGLE-3 head lacks weights for: {', '.join(missing[:8])}.")


def load_eagle3(head: ModelConfig, target: ModelConfig, num_aux: int, device: torch.device) -> Eagle3Llama:
    """The EAGLE-3 head of `head.model`, in the target's dtype, whole on `device` (call within
    parallel_state.alone())."""
    with built_in(target.dtype, device):
        model = Eagle3Llama(head.hf_config, num_aux, target.max_model_len, target.dtype)
    model.load_weights(iterate_weights(head.model), iterate_weights(target.model))
    return model
