"""OLMo 2 (AI2): Llama's attention and MLP with the norms moved. Each layer norms the outputs of
attention and of the MLP before their residual add, and no inputs (post-norm); q and k are normed
over their whole width, all heads together, before the rotary embedding (under tensor parallel
the sum of squares is summed over the ranks: layers/norm.py ShardedRMSNorm). Norms multiply in
float32 before the cast, as transformers' Olmo2RMSNorm does."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.distributed.parallel_state import get_pp_group
from shardlm.kv_cache_groups import sliding_window
from shardlm.layers.attention import Attention
from shardlm.layers.linear import QKVParallelLinear, RowParallelLinear
from shardlm.layers.norm import Float32RMSNorm, ShardedRMSNorm
from shardlm.layers.rotary import RotaryEmbedding
from shardlm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from shardlm.models.llama import LlamaForCausalLM, LlamaMLP, LlamaVariant, PPMissingLayer
from shardlm.multimodal import embeddings as image_embeddings


class Olmo2Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias)
        proj = self.qkv_proj
        self.num_heads, self.num_kv_heads = proj.num_heads, proj.num_kv_heads      # this rank's
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=bias)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                              sliding_window=sliding_window(config, layer_idx))
        q, kv, eps = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, config.rms_norm_eps
        self.q_norm = ShardedRMSNorm(heads * self.head_dim, q, proj.tp_rank * q, eps)
        self.k_norm = ShardedRMSNorm(kv_heads * self.head_dim, kv, proj.tp_rank // proj.kv_replicas * kv, eps,
                                     replicas=proj.kv_replicas)

    def forward(self, cos_sin, x, meta):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * self.head_dim], dim=-1)
        qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        return self.o_proj(self.attn.forward_qkv(qkv, cos_sin, meta))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = Float32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Float32RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin, hidden, meta):
        hidden = hidden + self.post_attention_layernorm(self.self_attn(cos_sin, hidden, meta))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2Model(nn.Module):
    """This pipeline stage's layers [start, end), the embedding on the first stage and the final
    norm on the last; stages pass [hidden] on."""

    def __init__(self, config, max_position: int, dtype: torch.dtype, layer_range: tuple[int, int]):
        super().__init__()
        pp = get_pp_group()
        self.start, self.end = layer_range
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_position, dtype)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if pp.is_first_rank else None
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config, i) if self.start <= i < self.end else PPMissingLayer()
                                    for i in range(config.num_hidden_layers))
        self.norm = Float32RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last_rank else None

    def forward(self, input_ids, positions, meta, intermediate: list[torch.Tensor] | None = None):
        hidden = image_embeddings.merge(self.embed_tokens(input_ids)) if intermediate is None else intermediate[0]
        cos_sin = self.rotary.lookup(positions)
        for i in range(self.start, self.end):
            hidden = self.layers[i](cos_sin, hidden, meta)
        return [hidden] if self.norm is None else self.norm(hidden)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Checkpoint names are Llama's (with q_norm/k_norm and the two post-norms), so loading is
    LlamaForCausalLM's."""
    eagle3_target = False      # its layers are not LlamaModel's, whose inputs an EAGLE-3 head reads

    def __init__(self, config, max_position: int, dtype: torch.dtype, layer_range: tuple[int, int] | None = None):
        nn.Module.__init__(self)
        self.config = config
        self.variant = LlamaVariant()
        self.model = Olmo2Model(config, max_position, dtype, layer_range or (0, config.num_hidden_layers))
        self.finish_init(config)
