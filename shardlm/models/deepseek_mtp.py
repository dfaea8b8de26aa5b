"""DeepSeek-V3's multi-token-prediction (MTP) layer, as the draft of speculative method "mtp"
(vLLM's name; "deepseek_mtp" is accepted too).

The checkpoint stores it as one more decoder layer, model.layers.{num_hidden_layers}, with
enorm and hnorm (RMSNorms), eh_proj [H, 2H], a DeepSeek decoder block (latent attention and
experts), shared_head.norm and shared_head.head (an LM head), and optionally its own
embed_tokens (else the target's). At position p it reads the embedding of the token after p and
the target's final hidden state at p: eh_proj(cat(enorm(embedding), hnorm(hidden))) through the
block predicts the hidden state at p + 1, and shared_head the token after next. Further
proposals feed the layer its own output (vLLM's use of one MTP layer for k tokens). As vLLM does,
the embedding is zeroed at position 0.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.config import ModelConfig
from shardlm.layers.linear import default_weight_loader
from shardlm.layers.norm import RMSNorm
from shardlm.layers.rotary import RotaryEmbedding
from shardlm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from shardlm.model_loader.weights import built_in, iterate_weights
from shardlm.models.deepseek import MultiHeadLatentAttention, deepseek_checkpoint_name, deepseek_mlp
from shardlm.models.llama import LlamaDecoderLayer


def mtp_layers(model: ModelConfig) -> int:
    config = model.hf_config
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0) if model.architecture == "DeepseekV3ForCausalLM" \
        else 0


class SharedHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size)


class DeepseekMTP(nn.Module):
    def __init__(self, config, max_position: int, dtype: torch.dtype):
        super().__init__()
        self.layer_index = config.num_hidden_layers
        self.rotary = RotaryEmbedding(config, config.qk_rope_head_dim, max_position, dtype)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.block = LlamaDecoderLayer(config, deepseek_mlp(config, self.layer_index, v3=True),
                                       layer_idx=self.layer_index, attention=MultiHeadLatentAttention(config))
        self.shared_head = SharedHead(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, target_hidden: torch.Tensor):
        """-> the predicted hidden state at each position + 1 (before shared_head.norm)."""
        embedding = self.embed_tokens(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0)
        hidden = self.eh_proj(torch.cat([self.enorm(embedding), self.hnorm(target_hidden.to(embedding.dtype))], dim=-1))
        hidden, residual = self.block(self.rotary.lookup(positions), hidden, None, meta)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden))

    def load_weights(self, target_weights) -> None:
        """From the target's checkpoint: its layer num_hidden_layers, and the target's embedding
        where the layer has none."""
        params = dict(self.named_parameters())
        prefix = f"model.layers.{self.layer_index}."
        loaded, embedding = set(), None
        for name, tensor in target_weights:
            if name == "model.embed_tokens.weight":
                embedding = tensor
            if not name.startswith(prefix):
                continue
            name, shard = name[len(prefix):], None
            if not name.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")):
                name, shard = deepseek_checkpoint_name("block." + name)     # the block: as the target's layers
            if name not in params:
                raise ValueError(f"The checkpoint's MTP layer has a tensor {name!r} that shardlm's MTP layer does not "
                                 "know.")
            getattr(params[name], "weight_loader", default_weight_loader)(params[name], tensor, shard)
            loaded.add(name)
        if "embed_tokens.weight" not in loaded and embedding is not None:
            default_weight_loader(params["embed_tokens.weight"], embedding)
            loaded.add("embed_tokens.weight")
        missing = sorted(set(params) - loaded)
        if loaded <= {"embed_tokens.weight"}:
            raise ValueError(f"The checkpoint has no multi-token-prediction layer ({prefix}*): speculative method mtp "
                             "needs one. Use ngram, draft_model or eagle.")
        if missing:
            raise ValueError(f"The checkpoint's MTP layer lacks weights for: {', '.join(missing[:8])}.")
        for module in self.modules():
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()


def load_deepseek_mtp(target: ModelConfig, device: torch.device) -> DeepseekMTP:
    """The target's MTP layer, whole, in its dtype on `device` (call within parallel_state.alone())."""
    with built_in(target.dtype, device):
        model = DeepseekMTP(target.hf_config, target.max_model_len, target.dtype)
    model.load_weights(iterate_weights(target.model))
    return model
