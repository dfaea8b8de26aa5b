"""Llama-family decoder (Llama 2/3/3.1, SmolLM2, TinyLlama, Mistral, Qwen2; the families that
change only a little of it subclass LlamaForCausalLM in a file of their own: qwen3.py, granite.py,
smollm3.py, phi3.py, and the MoE models).

Module names follow the Hugging Face checkpoints, except that q/k/v and gate/up are
merged into one matrix each (`qkv_proj`, `gate_up_proj`) for fewer, larger matmuls.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from shardlm.attention.backend import LastLayerRows
from shardlm.distributed.parallel_state import get_pp_group
from shardlm.kv_cache_groups import sliding_window
from shardlm.layers.activation import SiluAndMul
from shardlm.layers.attention import KV_SCALE, Attention, take_kv_scale
from shardlm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from shardlm.layers.norm import RMSNorm
from shardlm.layers.rotary import RotaryEmbedding, permute_partial_rotary, rotary_dim
from shardlm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from shardlm.lora import batch as lora_batch
from shardlm.models.llama_cpu_decode import FusedDecodeLayers
from shardlm.multimodal import embeddings as image_embeddings


@dataclass(frozen=True)
class LlamaVariant:
    """What a Llama-family architecture changes in the Llama decoder (the model class says, from
    its config: LlamaForCausalLM.variant)."""
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False                    # an RMSNorm over each head of q and of k before the rotary (Qwen3)
    attention_scale: float | None = None     # None: head_dim ** -0.5 (Granite: attention_multiplier)
    residual_multiplier: float = 1.0         # Granite: each branch's output scaled before the residual add
    embedding_multiplier: float = 1.0        # Granite: the embeddings scaled
    logits_scaling: float = 1.0              # Granite: the logits divided
    nope_layers: frozenset[int] = frozenset()    # layers without a rotary embedding (SmolLM3)
    sinks: bool = False                      # a learned attention sink logit per head (GPT-OSS)


class LlamaAttention(nn.Module):
    def __init__(self, config, variant: LlamaVariant, window: int | None = None):
        super().__init__()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, variant.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads   # this rank's
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=variant.o_bias)
        scale = variant.attention_scale or self.head_dim ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, sliding_window=window)
        if variant.sinks:
            self.attn.add_sinks(first_head=self.qkv_proj.tp_rank * self.num_heads)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if variant.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if variant.qk_norm else None

    def forward(self, cos_sin, x, meta, last: LastLayerRows | None = None):
        """last: only the rows last.rows go on (every row's K/V still cached) -> [R, hidden], None
        where there is no row."""
        qk_norm = self._qk_norm if self.q_norm is not None else None
        if last is None:
            return self.o_proj(self.attn.forward_qkv(self.qkv_proj(x), cos_sin, meta, qk_norm))
        out = self.attn.forward_qkv_rows(self.qkv_proj(x), cos_sin, meta, last, qk_norm)
        return self.o_proj(out) if out is not None else None

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """[T, H + Hkv, D]: an RMSNorm over each q head and each k head, as rows of D (one C call
        each on CPU, the one the one-call decode step makes)."""
        T, H, D = qk.shape[0], self.num_heads, self.head_dim
        q = self.q_norm(qk[:, :H].reshape(-1, D)).view(T, H, D)
        k = self.k_norm(qk[:, H:].reshape(-1, D)).view(T, qk.shape[1] - H, D)    # (T may be 0)
        return torch.cat([q, k], dim=1)


class LlamaMLP(nn.Module):
    def __init__(self, config, bias: bool = False, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2, bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only silu).")
        self.act = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, mlp: nn.Module, variant: LlamaVariant = LlamaVariant(), layer_idx: int = 0,
                 attention: nn.Module | None = None):
        """attention: the family's own attention block (None: LlamaAttention)."""
        super().__init__()
        self.self_attn = attention or LlamaAttention(config, variant, sliding_window(config, layer_idx))
        self.use_rope = layer_idx not in variant.nope_layers
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = variant.residual_multiplier

    def forward(self, cos_sin, hidden, residual, meta, last: LastLayerRows | None = None):
        """last: finish the rows last.rows alone, their attention, residual and MLP (the model's
        last layer, where only those rows' logits are read; finishes_rows)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        cos_sin = cos_sin if self.use_rope else None
        if last is None:
            hidden = self.self_attn(cos_sin, hidden, meta)
        else:
            hidden, residual = self.self_attn(cos_sin, hidden, meta, last), residual[last.rows]
            if hidden is None:      # no row is sampled: the layer has cached the step's K/V, nothing goes on
                return residual, residual
        hidden, residual = self.post_attention_layernorm(self._scaled(hidden), residual)
        return self._scaled(self.mlp(hidden)), residual

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        """A branch's output as the residual add takes it (the next norm adds it)."""
        return branch if self.residual_multiplier == 1.0 else branch * self.residual_multiplier


class PPMissingLayer(nn.Module):
    """Stands in for a layer that lives on another pipeline stage; it holds nothing."""


class LlamaModel(nn.Module):
    """This pipeline stage's share of the decoder: layers [start, end), the embedding on the
    first stage, the final norm on the last."""

    def __init__(self, config, max_position: int, dtype: torch.dtype, layer_range: tuple[int, int], make_mlp,
                 variant: LlamaVariant, make_attention=lambda i: None):
        super().__init__()
        pp = get_pp_group()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.start, self.end = layer_range
        self.rotary = RotaryEmbedding(config, head_dim, max_position, dtype)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if pp.is_first_rank else None
        self.embedding_multiplier = variant.embedding_multiplier
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, make_mlp(i), variant, i, make_attention(i))
                                    if self.start <= i < self.end else PPMissingLayer()
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last_rank else None
        self.fused_decode: FusedDecodeLayers | None = None     # the one-call decode step (prepare_fused_decode)
        # EAGLE-3: the layers whose input (hidden + residual) the last stage keeps in aux_hidden,
        # [tokens, len(aux_layers) * hidden]; earlier stages send theirs along
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def forward(self, input_ids, positions, meta, intermediate: list[torch.Tensor] | None = None):
        """First stage: from token ids; later stages: from the previous stage's [hidden, residual].
        Returns the final hidden states on the last stage, else [hidden, residual]."""
        if intermediate is None:
            hidden, residual, aux = self.embed_tokens(input_ids), None, []
            if self.embedding_multiplier != 1.0:
                hidden = hidden * self.embedding_multiplier
            hidden = image_embeddings.merge(hidden)     # a vision-language model's images (multimodal/)
        else:
            hidden, residual, *aux = intermediate
        cos_sin = self.rotary.lookup(positions)
        last = getattr(meta, "last_layer", None) if self.norm is not None else None
        fused = self.fused_decode if last is None else None
        done = fused(hidden, residual, cos_sin, meta, lora_batch.current()) if fused is not None else None
        if done is not None:
            hidden, residual = done
        else:
            for i in range(self.start, self.end):
                if i in self.aux_layers:        # (in layer order, as often as listed)
                    aux += [hidden if residual is None else hidden + residual] * self.aux_layers.count(i)
                finishing = {"last": last} if last is not None and i == self.end - 1 else {}
                hidden, residual = self.layers[i](cos_sin, hidden, residual, meta, **finishing)
        if self.norm is None:
            return [hidden, residual, *aux]
        if self.aux_layers:
            self.aux_hidden = torch.cat(aux, dim=-1)
        hidden, _ = self.norm(hidden, residual)
        return hidden


    @property
    def finishes_rows(self) -> bool:
        """Whether this stage's last layer can finish only some rows (LastLayerRows): the model's
        last layer is here, with Llama's attention."""
        last = self.layers[-1]
        return (self.norm is not None and self.end == len(self.layers) and isinstance(last, LlamaDecoderLayer)
                and isinstance(last.self_attn, LlamaAttention))

    def prepare_fused_decode(self, on: bool) -> str:
        """Builds (on) or drops the one-call decode step of this stage; called once its weights are
        final and its KV cache bound. -> how its decode steps run, for the CPU plan."""
        self.fused_decode = None
        if not on:
            return "layer by layer (--enforce-eager)"
        if self.aux_layers:
            return "layer by layer (an EAGLE-3 head reads the layers' inputs)"
        layers = self.layers[self.start:self.end]
        own_step = getattr(layers[0].self_attn, "fused_decode_layers", None) if len(layers) else None
        self.fused_decode, why = (own_step.build(self) if own_step is not None
                                  else FusedDecodeLayers.build(self, LlamaMLP))
        return "in one C call" if self.fused_decode is not None else f"layer by layer ({why})"


def prepare_fused_decode(model: nn.Module, on: bool) -> str:
    """LlamaModel.prepare_fused_decode for every Llama stage in `model` (a target or a draft) ->
    how their decode steps run."""
    paths = {m.prepare_fused_decode(on) for m in model.modules() if isinstance(m, LlamaModel)}
    return "; ".join(sorted(paths)) or "layer by layer (not a Llama-family model)"


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our parameter name, shard id)
    stacked_params = [(".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"),
                      (".qkv_proj.", ".v_proj.", "v"), (".gate_up_proj.", ".gate_proj.", 0),
                      (".gate_up_proj.", ".up_proj.", 1)]
    qkv_bias: bool | None = None   # None: from config.attention_bias
    qk_norm = False                # RMSNorm on each q and k head (Qwen3)
    takes_embeddings = True        # images' and prompt embeddings in place of tokens' (multimodal/embeddings.py)

    def __init__(self, config, max_position: int, dtype: torch.dtype, layer_range: tuple[int, int] | None = None):
        super().__init__()
        self.config = config
        self.variant = self.make_variant(config)
        self.model = LlamaModel(config, max_position, dtype, layer_range or (0, config.num_hidden_layers),
                                lambda i: self.make_mlp(config, i), self.variant,
                                lambda i: self.make_attention(config, i))
        self.finish_init(config)

    def finish_init(self, config, tied_by_default: bool = False) -> None:
        """What every family's model has beside its decoder (self.model): the head dims q/k are laid
        out by, and the LM head on the last stage (tied to the embedding where the config says)."""
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_dim = rotary_dim(config, self.head_dim)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", tied_by_default))
        self.lm_head = None
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.tie(self.model.embed_tokens)

    def make_variant(self, config) -> LlamaVariant:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return LlamaVariant(qkv_bias=attention_bias if self.qkv_bias is None else self.qkv_bias, o_bias=attention_bias,
                            qk_norm=self.qk_norm)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer `layer_idx` (MoE models: experts on some or all layers)."""
        return LlamaMLP(config, bias=getattr(config, "mlp_bias", False))

    def make_attention(self, config, layer_idx: int) -> nn.Module | None:
        """The attention block of layer `layer_idx`; None: LlamaAttention (DeepSeek: latent attention)."""
        return None

    def forward(self, input_ids, positions, meta, intermediate=None):
        return self.model(input_ids, positions, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Last pipeline stage only: logits on the tensor parallel group's first rank; None on the
        others."""
        logits = self.lm_head(hidden)
        scaling = self.variant.logits_scaling
        return logits if logits is None or scaling == 1.0 else logits / scaling

    # Whether GGUF / GPTQ / AWQ linears, which are taken as stored, may be laid out as this model
    # needs them: checkpoint_tensors moves, splits and renames whole rows of linear weights and no
    # more, which their integers and scales can follow (weights.take_quantized_linears).
    reads_quantized_checkpoints = True

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as Llama names them (a family that stores them otherwise
        renames or splits them here), q and k laid out for a partial rotary embedding. Linear
        weights have their rows moved only (see reads_quantized_checkpoints)."""
        for name, tensor in weights:
            if self.rotary_dim != self.head_dim and _ROTATED.search(name):
                tensor = permute_partial_rotary(tensor[:], self.head_dim, self.rotary_dim)    # read whole
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in self.checkpoint_tensors(weights):
            if "rotary_emb.inv_freq" in name:
                continue
            if found := KV_SCALE.search(name):
                if self._on_this_stage(name):
                    take_kv_scale(self.get_submodule(name[:found.start()] + ".self_attn").attn, found, tensor)
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if (name.startswith("model.embed_tokens.") and self.tie_word_embeddings and self.lm_head is not None
                    and self.model.embed_tokens is None):
                name = "lm_head.weight"     # a last stage without the embedding: its tied LM head
            if not self._on_this_stage(name):
                continue
            name, shard_id = self.map_checkpoint_name(name)
            if name not in params:
                raise ValueError(f"The checkpoint has a tensor {name!r} that {type(self).__name__} does not know: "
                                 "is the config's architecture right for these weights?")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.add(name)
        return loaded

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        """A checkpoint tensor's parameter here, and which part of it the tensor is (or None)."""
        for merged, part, sid in self.stacked_params:
            if part in name:
                return name.replace(part, merged), sid
        return name, None

    def _on_this_stage(self, name: str) -> bool:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer:
            return self.model.start <= int(layer.group(1)) < self.model.end
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        if name.startswith("model.norm."):
            return self.model.norm is not None
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def drop_lm_head(self) -> None:
        """A pooling model's: its final hidden states are the output (pooling/decoder.py)."""
        self.lm_head = None


# an FP8 KV cache's scales, wherever under a layer's self_attn they are stored
# the tensors whose rows are q or k head dims: projections, their biases, per-head norms
_ROTATED = re.compile(r"\.self_attn\.(q_proj|k_proj|q_norm|k_norm)\.(weight|bias)$")


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True     # Qwen2 has q/k/v biases, no o_proj bias
