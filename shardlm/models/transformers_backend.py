"""The Transformers backend (--model-impl transformers, as vLLM's): a decoder architecture shardlm
has no model of its own for runs on Hugging Face's own modeling code, with shardlm's paged KV
cache, scheduler and sampler.

Transformers lets a model's attention modules call an attention function registered by name
(AttentionInterface). This one, "shardlm", hands each layer's queries, keys and values (after
the model's own rotary embedding) to a shardlm Attention layer, which writes K/V into the paged
cache and attends through the engine's backend, as the native models do. The whole step runs as
one sequence of all its tokens with their positions; no mask is built (the mask function returns
None), since the paged attention knows each token's sequence. So any architecture whose modeling
code goes through the attention interface (`_supports_attention_backend`) runs.

Its linear layers become shardlm's (as vLLM's backend does): those the model's tensor parallel plan
(`base_model_tp_plan`) marks colwise or rowwise are split across the tensor parallel ranks, the others
stay whole on every rank; so the CPU kernels' weight panels and --quantization apply as in shardlm's
own models. The LM head becomes a whole shardlm linear on every rank (a tied one holds a copy of the
embedding, which stays transformers' own, whole on every rank).

Pipeline parallel (as vLLM's backend): a stage keeps its own decoder layers; the others become
pass-throughs (their indices kept, since modeling code looks layers up by them), the embedding
of a later stage gives zeros and the first layer it holds takes the previous stage's hidden
states instead of what the model's forward made of them (so whatever it does between embedding
and layers, such as Gemma's scale, is not done twice); an earlier stage skips the final norms
and has no LM head. Context parallel needs shardlm's own decoder: refused (feature_rules.py).

As a pooling model (pooling/decoder.py: an embedder, or a ...ForSequenceClassification checkpoint of
a family it runs) it has no LM head either; its output is the final hidden states.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch
from torch import nn

from shardlm.distributed.parallel_state import get_tp_group
from shardlm.kv_cache_groups import sliding_window
from shardlm.layers.attention import KV_SCALE, Attention, take_kv_scale
from shardlm.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, default_weight_loader

NAME = "shardlm"
_step_meta = None          # the running step's attention metadata (one step at a time per process)


def can_run(architecture: str) -> bool:
    """Whether transformers has this architecture as a causal LM that uses the attention interface,
    or as a sequence classifier (a `score` matrix over the last token) of such a causal LM's family."""
    import transformers
    if architecture.endswith("ForSequenceClassification"):
        family = architecture.removesuffix("ForSequenceClassification")
        return any(can_run(family + suffix) for suffix in ("ForCausalLM", "LMHeadModel"))
    cls = getattr(transformers, architecture, None)
    return (isinstance(cls, type) and architecture.endswith(("ForCausalLM", "LMHeadModel"))
            and bool(getattr(cls, "_supports_attention_backend", False)))


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Transformers' attention interface: query [1, H, T, D], key/value [1, Hkv, T, D] ->
    ([1, T, H, D], no weights), through the shardlm Attention layer the module holds."""
    attn: Attention = module.shardlm_attn
    if scaling is not None:
        attn.scale = scaling
    tokens = query.shape[2]
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    out = attn(q, k, v, _step_meta)
    return out.view(1, tokens, attn.num_heads, attn.v_head_dim), None


def _register() -> None:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ValueError(f"The Transformers backend needs transformers' attention and mask interfaces (4.53 or "
                         f"later): {e}. Upgrade transformers.") from None
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, lambda *args, **kwargs: None)   # the paged attention masks itself


class TransformersForCausalLM(nn.Module):
    """shardlm's model interface (forward, compute_logits, load_weights) over a Hugging Face causal LM."""

    def __init__(self, config, max_position: int, dtype: torch.dtype, layer_range: tuple[int, int] | None = None):
        super().__init__()
        from transformers import AutoModelForCausalLM
        try:
            from transformers.initialization import no_init_weights
        except ImportError:         # transformers 4.x
            from transformers.modeling_utils import no_init_weights
        _register()
        self.config = config
        with no_init_weights():         # the checkpoint's weights replace them
            self.hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=NAME)
        self.hf.tie_weights()           # (skipped with the initialization)
        self.tp = get_tp_group()
        self.start, self.end = layer_range or (0, config.num_hidden_layers)
        self.is_last_stage = self.end == config.num_hidden_layers
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if heads % self.tp.world_size or kv_heads % self.tp.world_size:
            raise ValueError(f"Tensor parallel size {self.tp.world_size} must divide the attention heads ({heads}) "
                             f"and the KV heads ({kv_heads}) under --model-impl transformers.")
        self._use_shardlm_linears()
        self.elsewhere: tuple[str, ...] = ()        # names of what other pipeline stages hold
        self._received: torch.Tensor | None = None   # the previous stage's hidden states, during a step
        if (self.start, self.end) != (0, config.num_hidden_layers):
            self._keep_this_stage_only(dtype)
        self.num_attention_layers = 0
        for module in self.hf.modules():
            if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int):
                module.shardlm_attn = Attention(heads // self.tp.world_size, kv_heads // self.tp.world_size, head_dim,
                                                head_dim ** -0.5, sliding_window(config, module.layer_idx),
                                                logit_softcap=getattr(config, "attn_logit_softcapping", None))
                self.num_attention_layers += 1
        self.renames = _renames(self.hf)        # checkpoint names as transformers renames them on load
        if self.num_attention_layers != self.end - self.start:
            raise ValueError(f"{type(self.hf).__name__}: found {self.num_attention_layers} attention modules for "
                             f"{self.end - self.start} layers, so the Transformers backend cannot place its KV "
                             "cache.")

    def _keep_this_stage_only(self, dtype: torch.dtype) -> None:
        """Pipeline parallel: replace what other stages hold (see the module's docstring)."""
        base = self.hf.base_model
        prefix = self.hf.base_model_prefix
        found = [(name, m) for name, m in base.named_children()
                 if isinstance(m, nn.ModuleList) and len(m) == self.config.num_hidden_layers]
        if len(found) != 1:
            raise ValueError(f"{type(self.hf).__name__}: its decoder layers could not be found (one list of "
                             f"{self.config.num_hidden_layers} modules), so the Transformers backend cannot split it "
                             "into pipeline stages: leave out -pp.")
        layers_name, layers = found[0]
        elsewhere = [f"{prefix}.{layers_name}.{i}." for i in range(len(layers)) if not self.start <= i < self.end]
        for i in range(len(layers)):
            if not self.start <= i < self.end:
                layers[i] = _OnAnotherStage()
        if self.start > 0:
            embedding = self.hf.get_input_embeddings()
            elsewhere += [f"{prefix}.{n}." for n, m in base.named_children() if m is embedding]
            self.hf.set_input_embeddings(_Zeros(self.config.hidden_size, dtype))
            layers[self.start].register_forward_pre_hook(self._take_received, with_kwargs=True)
        if not self.is_last_stage:
            children = [n for n, _ in base.named_children()]
            for name in children[children.index(layers_name) + 1:]:      # the final norms come after the layers
                if "norm" in type(getattr(base, name)).__name__.lower():
                    elsewhere.append(f"{prefix}.{name}.")
                    setattr(base, name, nn.Identity())
        self.elsewhere = tuple(elsewhere)
        if not self.is_last_stage:
            self.drop_lm_head()

    def drop_lm_head(self) -> None:
        """No LM head: on an earlier pipeline stage, and in a pooling model (pooling/decoder.py), whose
        output is the final hidden states. Its checkpoint tensor is skipped as another stage's is."""
        if self.head_name is not None:
            self.elsewhere += (self.head_name,)
            self.hf.set_output_embeddings(nn.Identity())
            self.head_name = None
        self.tied_head = False

    def _take_received(self, module, args, kwargs):
        """The first layer of a later stage: the previous stage's hidden states as its input."""
        hidden = self._received[None]
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    def _use_shardlm_linears(self) -> None:
        """Every nn.Linear becomes shardlm's: column or row parallel as the model's tensor
        parallel plan says, else whole on every rank (the LM head: its weight loaded apart from
        the embedding's where they were tied)."""
        plan = getattr(self.config, "base_model_tp_plan", None) or {}
        prefix = self.hf.base_model_prefix
        head, embedding = self.hf.get_output_embeddings(), self.hf.get_input_embeddings()
        self.tied_head = head is not None and head.weight is embedding.weight
        self.embedding_name = next(n for n, p in self.hf.named_parameters() if p is embedding.weight)
        self.head_name: str | None = None
        self.linear_shapes: dict[str, tuple[int, int]] = {}     # each linear's (in, out), whole
        for name, module in list(self.hf.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            if module is head:
                self.head_name = name + ".weight"
            style = next((s for pattern, s in plan.items()
                          if fnmatch.fnmatchcase(name.removeprefix(prefix + "."), pattern)), None)
            bias = module.bias is not None
            if style == "colwise":
                new = ColumnParallelLinear(module.in_features, module.out_features, bias)
            elif style == "rowwise":
                new = RowParallelLinear(module.in_features, module.out_features, bias)
            elif self.tp.world_size > 1 and style is not None:
                raise ValueError(f"{name} is split '{style}' by the model's tensor parallel plan, which the "
                                 "Transformers backend does not do: leave out -tp.")
            else:
                new = Linear(module.in_features, module.out_features, bias)
            self.linear_shapes[name] = (module.in_features, module.out_features)
            parent, _, leaf = name.rpartition(".")
            setattr(self.hf.get_submodule(parent) if parent else self.hf, leaf, new)

    def lora_modules(self):
        """--enable-lora: the linears an adapter may target, named as the model names them (as PEFT
        does): each of this stage's but the LM head."""
        from shardlm.lora.peft import OwnModules
        head = self.hf.get_output_embeddings()
        linears = {name: m for name, m in self.hf.named_modules() if isinstance(m, Linear) and m is not head}
        return OwnModules(linears, {n: s for n, s in self.linear_shapes.items() if n in linears}, self.elsewhere)

    def forward(self, input_ids, positions, meta, intermediate=None):
        """-> the final hidden states, or on an earlier pipeline stage [its last layer's output]."""
        global _step_meta
        _step_meta, self._received = meta, intermediate[0] if intermediate else None
        try:
            out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            _step_meta = self._received = None
        hidden = out.last_hidden_state[0]
        return hidden if self.is_last_stage else [hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head and what the architectures' own heads do after it: a logit scale (Cohere),
        a divisor (Granite), a soft cap (Gemma 2). On the tensor parallel group's first rank (it
        samples); None on the others."""
        if self.tp.rank_in_group != 0:
            return None
        logits = self.hf.get_output_embeddings()(hidden)
        scale = getattr(self.hf, "logit_scale", None)
        if isinstance(scale, (int, float)) and scale != 1:
            logits = logits * scale
        divisor = getattr(self.config, "logits_scaling", None)
        if divisor:
            logits = logits / divisor
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # stored quantized weights (GPTQ, AWQ, compressed-tensors; model_loader/weights.py) find their
    # linears by module name: one checkpoint tensor each, none merged
    stacked_params = ()

    def _hf_name(self, name: str) -> str:
        """A checkpoint tensor's name in transformers' model (its renames applied)."""
        for rename in self.renames:
            name = rename(name)
        return name

    def checkpoint_tensors(self, weights):
        """Checkpoint tensors named as this module's linears: transformers' names, under hf."""
        for name, tensor in weights:
            yield f"hf.{self._hf_name(name)}", tensor

    def _on_this_stage(self, name: str) -> bool:
        """Whether a checkpoint tensor (or one named as checkpoint_tensors names it) is this stage's."""
        return not self._hf_name(name.removeprefix("hf.")).startswith(self.elsewhere)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.hf.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = self._hf_name(name)
            if name.endswith("rotary_emb.inv_freq") or (self.tied_head and name == self.head_name):
                continue                 # a buffer made at init; a tied head: loaded with the embedding
            if found := KV_SCALE.search(name):      # an FP8 KV cache's scale, for shardlm's attention
                if not name.startswith(self.elsewhere):
                    take_kv_scale(self.hf.get_submodule(name[:found.start()] + ".self_attn").shardlm_attn, found,
                                  tensor)
                continue
            # a tied head takes the embedding's table too (on the last stage, maybe without the embedding)
            names = [n for n in (name, self.head_name if self.tied_head and name == self.embedding_name else None)
                     if n is not None and n in params]
            if not names:
                if name.startswith(self.elsewhere):
                    continue             # another pipeline stage's
                raise ValueError(f"The checkpoint has a tensor {name!r} that transformers' {type(self.hf).__name__} "
                                 "does not have: is the config's architecture right for these weights?")
            for target in names:
                getattr(params[target], "weight_loader", default_weight_loader)(params[target], tensor)
                loaded.add(f"hf.{target}")
        return loaded


class _OnAnotherStage(nn.Module):
    """A decoder layer another pipeline stage holds: the hidden states pass through."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class _Zeros(nn.Module):
    """A later pipeline stage's embedding: its output is replaced (_take_received), so no table."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.hidden_size, self.dtype = hidden_size, dtype

    def forward(self, input_ids):
        return torch.zeros(*input_ids.shape, self.hidden_size, dtype=self.dtype, device=input_ids.device)


def _renames(model) -> list:
    """The checkpoint key renames transformers applies as it loads this model (e.g. GPT-NeoX's
    embed_out -> lm_head), each as a function of a name."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:         # an older transformers: checkpoints are named as the modules
        return []
    return [lambda name, t=t: t.rename_source_key(name)[0] for t in get_model_conversion_mapping(model)
            if not isinstance(t, WeightConverter)]
