"""Bidirectional encoders: BERT (all-MiniLM, BGE, E5, ...) and RoBERTa / XLM-RoBERTa (BGE-M3, the
BGE rerankers), as embedders (…Model) and cross-encoders (…ForSequenceClassification).

Every token attends to every token of its own prompt, so an encoder keeps no KV cache: each
step computes whole prompts (the scheduler never splits a pooling request) and attends within
each one. Linears are tensor parallel as in the decoders (q/k/v and the MLP's first matrix by
columns, the output projections by rows); heads split across ranks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, default_weight_loader
from shardlm.layers.vocab_parallel_embedding import VocabParallelEmbedding


@dataclass
class EncoderBatch:
    """What an encoder step reads in place of attention metadata: each prompt's length (the
    step's tokens are the prompts one after another) and every token's segment (0: first
    text, 1: the second of a pair)."""
    seq_lens: list[int]
    token_type_ids: torch.Tensor


_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class EncoderSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, heads, bias=True)
        self.num_heads = self.qkv_proj.num_heads        # this rank's
        self.out_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias=True)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        H, D = self.num_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split(H * D, dim=-1)
        out = torch.empty_like(q)
        start = 0
        # each prompt attends to itself only, both ways (so its result does not depend on the
        # others in the step); 4-d, which torch's flash kernel takes (3-d goes to its math path: 2x slower)
        for n in batch.seq_lens:
            heads = [t[start:start + n].view(1, n, H, D).transpose(1, 2) for t in (q, k, v)]
            out[start:start + n] = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(n, H * D)
            start += n
        return self.norm(self.out_proj(out) + x)


class EncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = EncoderSelfAttention(config)
        self.intermediate = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.output = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        act = getattr(config, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act={act!r} is not supported by the encoder (use one of "
                             f"{', '.join(_ACTIVATIONS)}).")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.norm(self.output(self.act(self.intermediate(x))) + x)


class EncoderEmbeddings(nn.Module):
    def __init__(self, config, position_offset: int):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(1, getattr(config, "type_vocab_size", 1)), config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids, positions, token_type_ids):
        if self.token_type_embeddings.num_embeddings == 1:     # RoBERTa: one segment whatever the tokenizer says
            token_type_ids = torch.zeros_like(token_type_ids)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
             + self.token_type_embeddings(token_type_ids))
        return self.norm(x)


class BertModel(nn.Module):
    """The encoder (an embedder: its hidden states go to the pooler as they are)."""
    is_encoder = True
    pooling_task = "embed"
    default_pooling_type = "CLS"
    prefix = "bert."                  # a classifier checkpoint's name for the encoder
    position_offset = 0               # RoBERTa: positions start after the padding id

    def __init__(self, config, max_position: int, dtype: torch.dtype, layer_range=None):
        super().__init__()
        self.config = config
        if getattr(config, "position_embedding_type", "absolute") not in ("absolute", None):
            raise ValueError(f"position_embedding_type={config.position_embedding_type!r} is not supported "
                             "(only absolute position embeddings).")
        self.embeddings = EncoderEmbeddings(config, self.position_offset_of(config))
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.lm_head = None

    def position_offset_of(self, config) -> int:
        return self.position_offset

    def forward(self, input_ids, positions, batch: EncoderBatch, intermediate=None):
        x = self.embeddings(input_ids, positions, batch.token_type_ids)
        for layer in self.layers:
            x = layer(x, batch)
        return x

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """The pooled hidden states -> the model's output (an embedder: as they are)."""
        return pooled

    # ---- weights ----
    _RENAMES = [(r"\.attention\.self\.(query|key|value)\.", r".attention.qkv_proj.\1."),
                (r"\.attention\.output\.dense\.", ".attention.out_proj."),
                (r"\.attention\.output\.LayerNorm\.", ".attention.norm."),
                (r"\.intermediate\.dense\.", ".intermediate."),
                (r"\.output\.dense\.", ".output."), (r"\.output\.LayerNorm\.", ".norm."),
                (r"^embeddings\.LayerNorm\.", "embeddings.norm."), (r"^encoder\.layer\.", "layers.")]
    _QKV = {"query": "q", "key": "k", "value": "v"}

    def map_checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's parameter here (None: not one this model uses)."""
        for prefix in (self.prefix, "model."):
            name = name.removeprefix(prefix)
        if name.startswith("pooler.") and not hasattr(self, "pooler"):
            return None
        if name.endswith("position_ids"):
            return None
        for pattern, repl in self._RENAMES:
            name = re.sub(pattern, repl, name)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for checkpoint_name, tensor in weights:
            name = self.map_checkpoint_name(checkpoint_name)
            if name is None:
                continue
            shard_id = None
            qkv = re.search(r"\.qkv_proj\.(query|key|value)\.", name)
            if qkv:
                shard_id = self._QKV[qkv.group(1)]
                name = name.replace(f".{qkv.group(1)}.", ".")
            if name not in params:
                raise ValueError(f"The checkpoint has a tensor {checkpoint_name!r} that {type(self).__name__} does "
                                 "not know: is the config's architecture right for these weights?")
            param = params[name]
            getattr(param, "weight_loader", _replicated)(param, tensor, shard_id)
            loaded.add(name)
        return loaded


def _replicated(param, tensor, shard_id=None):
    default_weight_loader(param, tensor)


class BertForSequenceClassification(BertModel):
    """A cross-encoder or classifier: the [CLS] state -> dense + tanh (BERT's pooler) -> the classes."""
    pooling_task = "classify"

    def __init__(self, config, max_position: int, dtype: torch.dtype, layer_range=None):
        super().__init__(config, max_position, dtype, layer_range)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def map_checkpoint_name(self, name: str) -> str | None:
        if name.startswith(("classifier.", f"{self.prefix}pooler.")):
            return name.removeprefix(self.prefix).replace("pooler.dense.", "pooler.")
        return super().map_checkpoint_name(name)

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(pooled)))


class XLMRobertaModel(BertModel):
    """RoBERTa's positions start after its padding id (pad_token_id + 1)."""
    prefix = "roberta."

    def position_offset_of(self, config) -> int:
        return (config.pad_token_id if config.pad_token_id is not None else 1) + 1


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """RoBERTa's classification head: the <s> state -> dense + tanh -> out_proj (the BGE rerankers)."""
    pooling_task = "classify"

    def __init__(self, config, max_position: int, dtype: torch.dtype, layer_range=None):
        super().__init__(config, max_position, dtype, layer_range)
        self.classifier = nn.ModuleDict({"dense": nn.Linear(config.hidden_size, config.hidden_size),
                                         "out_proj": nn.Linear(config.hidden_size, config.num_labels)})

    def map_checkpoint_name(self, name: str) -> str | None:
        if name.startswith("classifier."):
            return name
        return super().map_checkpoint_name(name)

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier["out_proj"](torch.tanh(self.classifier["dense"](pooled)))


def encoder_max_positions(config) -> int:
    """Positions an encoder covers (RoBERTa's first pad_token_id + 1 are not positions)."""
    n = config.max_position_embeddings
    if getattr(config, "model_type", "") in ("roberta", "xlm-roberta"):
        n -= (config.pad_token_id if config.pad_token_id is not None else 1) + 1
    return n
