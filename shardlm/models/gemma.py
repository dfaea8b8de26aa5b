"""Gemma 2 and Gemma 3 (text): a decoder of its own shape beside Llama's.

What differs from Llama: the RMSNorm scales by (1 + weight), in float32 before the cast; "sandwich"
norms around attention and the MLP (each branch's output is normed before the residual add); a
GELU-tanh gated MLP; embeddings scaled by sqrt(hidden_size) (rounded to the model dtype);
attention scaled by query_pre_attn_scalar ** -0.5, on layers that alternate between a sliding
window and full attention (config.layer_types). Gemma 2 soft-caps the attention scores and the
final logits (cap * tanh(x / cap)); Gemma 3 norms each q and k head instead, and gives its
sliding and full layers rotary embeddings of their own bases (rope_parameters by layer type).

Gemma3ForConditionalGeneration checkpoints (Gemma 3 4B, 12B, 27B) run as their text model; their
vision tower is not loaded, and the server refuses image parts in a message with a 400 that says so.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.distributed.parallel_state import get_pp_group
from shardlm.kv_cache_groups import sliding_window
from shardlm.layers.activation import GeluTanhAndMul
from shardlm.layers.attention import Attention
from shardlm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shardlm.layers.norm import Float32RMSNorm
from shardlm.layers.rotary import RotaryEmbedding
from shardlm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from shardlm.model_loader.weights import text_model_weights
from shardlm.models.llama import LlamaForCausalLM, LlamaVariant, PPMissingLayer


def GemmaRMSNorm(size: int, eps: float) -> Float32RMSNorm:
    """x / rms(x) * (1 + weight), in float32 and then cast (the weight stored as the checkpoint
    has it, around 0)."""
    return Float32RMSNorm(size, eps, offset=1.0)


class GemmaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation={config.hidden_activation!r} is not supported (Gemma: "
                             "gelu_pytorch_tanh).")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2, bias=False)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False)
        self.act = GeluTanhAndMul()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, qk_norm: bool):
        super().__init__()
        heads, kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads   # this rank's
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=bias)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, config.query_pre_attn_scalar ** -0.5,
                              sliding_window=sliding_window(config, layer_idx),
                              logit_softcap=getattr(config, "attn_logit_softcapping", None))
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, cos_sin, x, meta):
        qk_norm = self._qk_norm if self.q_norm is not None else None
        return self.o_proj(self.attn.forward_qkv(self.qkv_proj(x), cos_sin, meta, qk_norm))

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """[T, H + Hkv, D]: the norm over each q head and each k head."""
        H = self.num_heads
        return torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, qk_norm: bool):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_idx, qk_norm)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.sliding = self.self_attn.attn.sliding_window is not None

    def forward(self, cos_sin, hidden, meta):
        hidden = hidden + self.post_attention_layernorm(self.self_attn(cos_sin, self.input_layernorm(hidden), meta))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaModel(nn.Module):
    """This pipeline stage's layers [start, end), the embedding on the first stage and the final
    norm on the last; stages pass [hidden] on."""

    def __init__(self, config, max_position: int, dtype: torch.dtype, layer_range: tuple[int, int], qk_norm: bool,
                 rope_by_layer_type: bool):
        super().__init__()
        pp = get_pp_group()
        self.start, self.end = layer_range
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if pp.is_first_rank else None
        self.normalizer = torch.tensor(config.hidden_size ** 0.5, dtype=dtype).item()
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, qk_norm) if self.start <= i < self.end
                                    else PPMissingLayer() for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last_rank else None
        if rope_by_layer_type:      # Gemma 3: a base for the sliding layers, another for the full ones
            self.rotary = RotaryEmbedding(config, config.head_dim, max_position, dtype, "full_attention")
            self.sliding_rotary = RotaryEmbedding(config, config.head_dim, max_position, dtype, "sliding_attention")
        else:
            self.rotary = RotaryEmbedding(config, config.head_dim, max_position, dtype)
            self.sliding_rotary = self.rotary

    def forward(self, input_ids, positions, meta, intermediate: list[torch.Tensor] | None = None):
        hidden = self.embed_tokens(input_ids) * self.normalizer if intermediate is None else intermediate[0]
        full = self.rotary.lookup(positions)
        local = full if self.sliding_rotary is self.rotary else self.sliding_rotary.lookup(positions)
        for i in range(self.start, self.end):
            layer = self.layers[i]
            hidden = layer(local if layer.sliding else full, hidden, meta)
        return [hidden] if self.norm is None else self.norm(hidden)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: soft-capped attention scores and final logits, no q/k norms. The checkpoint's
    tensor names are Llama's (plus the two extra norms), so loading is LlamaForCausalLM's."""
    qk_norm = False
    rope_by_layer_type = False
    eagle3_target = False      # its layers are not LlamaModel's, whose inputs an EAGLE-3 head reads
    takes_embeddings = False   # (Gemma 2 scales given embeddings, Gemma 3 does not: not taken here)

    def __init__(self, config, max_position: int, dtype: torch.dtype, layer_range: tuple[int, int] | None = None):
        nn.Module.__init__(self)
        self.config = config
        self.variant = LlamaVariant()
        self.model = GemmaModel(config, max_position, dtype, layer_range or (0, config.num_hidden_layers),
                                self.qk_norm, self.rope_by_layer_type)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.finish_init(config, tied_by_default=True)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        if logits is None or self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text; Gemma 3 1B ships this way): q/k norms, rotary bases by layer type."""
    qk_norm = True
    rope_by_layer_type = True


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """A Gemma 3 4B/12B/27B checkpoint: its text model (built from config.text_config, which the
    engine resolves: models/registry.py), with the tensors of language_model.* read as the text
    model's and the vision tower's left out (for float and stored quantized weights alike)."""

    def checkpoint_tensors(self, weights):
        return super().checkpoint_tensors(text_model_weights(weights))
