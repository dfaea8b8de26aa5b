"""A model's shape from its config.json, and the parameter and KV cache sizes that follow.

Works on the plain config dict (no model code, no download): standard and grouped-query
attention (with q/k/v and o biases), DeepSeek's multi-head latent attention (MLA), dense
and mixture-of-experts MLPs, tied or untied LM heads. Counts match `sum(p.numel())` of the
transformers model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace

from shardlm.kv_cache_groups import sliding_window

_PRESETS_FILE = os.path.join(os.path.dirname(__file__), "presets.json")


def load_presets() -> dict[str, dict]:
    with open(_PRESETS_FILE) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


def load_config(model: str) -> tuple[str, dict]:
    """(name, config dict) from a preset name, a model directory, a config.json path or a GGUF file
    (its metadata: the model `shardlm serve FILE.gguf` runs)."""
    presets = load_presets()
    by_lower = {k.lower(): k for k in presets}
    key = by_lower.get(model.lower()) or by_lower.get(model.split("/")[-1].lower())
    if key:
        return key, presets[key]
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ValueError(f"{model!r} is neither a model directory, a config.json, a GGUF file, nor a preset. "
                         f"Presets: {', '.join(presets)}.")
    if path.endswith(".gguf"):
        from shardlm.model_loader.default_model import gguf_hf_config
        return os.path.basename(path)[:-len(".gguf")], gguf_hf_config(path).to_dict()
    with open(path) as f:
        cfg = json.load(f)
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or model, cfg


def vision_params(c: dict) -> int:
    """A vision-language config's vision tower (a ViT: CLIP, SigLIP, Idefics3's) and projector or
    connector, as transformers builds them (LLaVA, LLaVA-NeXT, Idefics3)."""
    v, text_hidden = c.get("vision_config") or {}, c["text_config"]["hidden_size"]
    if not v:
        return 0
    h, inter, layers = v.get("hidden_size", 1024), v.get("intermediate_size", 4096), v.get("num_hidden_layers", 24)
    patch, size = v.get("patch_size", 14), v.get("image_size", 336)
    clip = v.get("model_type", "clip_vision_model") == "clip_vision_model"
    positions = (size // patch) ** 2 + (1 if clip else 0)
    embeddings = 3 * patch * patch * h + h + positions * h      # the patch conv, its bias (CLIP: the CLS instead)
    norms = 2 * h * (2 if clip else 1)                   # CLIP: pre and post layer norms; SigLIP: post
    layer = 4 * (h * h + h) + 2 * h * inter + inter + h + 4 * h      # q, k, v, o; the MLP; two layer norms
    arch = (c.get("architectures") or [""])[0]
    if arch.startswith("Idefics3"):
        projector = h * c.get("scale_factor", 2) ** 2 * text_hidden
    else:       # LLaVA's two linears with biases (LLaVA-NeXT: and a newline embedding)
        bias = c.get("multimodal_projector_bias", True)
        projector = h * text_hidden + text_hidden * text_hidden + (2 * text_hidden if bias else 0)
        projector += text_hidden if arch.startswith("LlavaNext") else 0
    return embeddings + norms + layers * layer + projector


@dataclass
class ModelShape:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position: int
    qk_norm: bool = False             # Qwen3: an RMSNorm on every q and k head (one weight of head_dim each)
    num_experts: int = 0              # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0   # the shared expert(s) every token uses (0: none)
    shared_expert_gate: bool = False  # Qwen2-MoE: a sigmoid gate scales the shared expert
    first_dense_layers: int = 0       # DeepSeek: the first k layers are dense
    sparse_step: int = 1              # Qwen MoE: experts on every sparse_step-th layer ...
    dense_layers: tuple[int, ...] = ()    # ... except these (mlp_only_layers)
    q_lora_rank: int = 0              # MLA (DeepSeek); kv_lora_rank > 0 means MLA
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    windows: tuple[int | None, ...] = ()     # per layer: its sliding window (None: full attention)
    vision_params: int = 0            # a vision-language model's vision tower and projector (whole on stage 0)

    @classmethod
    def from_config(cls, name: str, c: dict) -> ModelShape:
        text = c.get("text_config")
        vision = vision_params(c) if isinstance(text, dict) else 0
        if isinstance(text, dict):   # multimodal wrappers keep the language model here
            c = {**c, **text}
        heads = c["num_attention_heads"]
        arch = (c.get("architectures") or [""])[0]
        experts = c.get("num_local_experts") or c.get("n_routed_experts") or c.get("num_experts") or 0
        expert_inter = (c.get("moe_intermediate_size") or c.get("intermediate_size", 0)) if experts else 0
        return cls(
            name=name, vocab=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"],
            heads=heads, kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate=c.get("intermediate_size", 0), tied=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bool(c.get("attention_bias", False)) or arch.startswith("Qwen2"),
            o_bias=bool(c.get("attention_bias", False)) and not arch.startswith("Qwen2"),
            mlp_bias=bool(c.get("mlp_bias", False)),
            max_position=c.get("max_position_embeddings") or 2048, qk_norm=arch.startswith("Qwen3"),
            num_experts=experts, experts_per_token=c.get("num_experts_per_tok", 0) if experts else 0,
            expert_intermediate=expert_inter,
            shared_expert_intermediate=(c.get("shared_expert_intermediate_size")
                                        or (c.get("n_shared_experts") or 0) * expert_inter) if experts else 0,
            shared_expert_gate=bool(experts and c.get("shared_expert_intermediate_size")),
            first_dense_layers=c.get("first_k_dense_replace", 0) if experts else 0,
            sparse_step=c.get("decoder_sparse_step") or 1, dense_layers=tuple(c.get("mlp_only_layers") or ()),
            q_lora_rank=c.get("q_lora_rank") or 0, kv_lora_rank=c.get("kv_lora_rank") or 0,
            qk_nope_dim=c.get("qk_nope_head_dim") or 0, qk_rope_dim=c.get("qk_rope_head_dim") or 0,
            v_head_dim=c.get("v_head_dim") or 0,
            windows=tuple(sliding_window(SimpleNamespace(**c), i) for i in range(c["num_hidden_layers"])),
            vision_params=vision)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    # ---- parameters of one layer, split by tensor parallel size tp ----
    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads are split when tp divides them, replicated (one per rank) when tp exceeds them."""
        return max(1, self.kv_heads // tp)

    def attention_params(self, tp: int = 1) -> int:
        h, hd = self.hidden, self.head_dim
        if self.is_mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.heads * qk // tp
                 if self.q_lora_rank else h * self.heads * qk // tp)
            kv = (h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_head_dim) // tp)
            return q + kv + self.heads * self.v_head_dim * h // tp
        q, kv = self.heads * hd // tp, self.kv_heads_per_rank(tp) * hd
        params = h * (q + 2 * kv) + q * h
        if self.qkv_bias:
            params += q + 2 * kv
        if self.o_bias:
            params += h
        if self.qk_norm:
            params += 2 * hd
        return params

    def dense_mlp_params(self, tp: int = 1) -> int:
        inter = self.intermediate // tp
        return 3 * self.hidden * inter + (2 * inter + self.hidden if self.mlp_bias else 0)

    def experts_per_rank(self, ep: int) -> int:
        """Expert parallel over ep ranks: the most experts one rank holds (the first E % ep ranks hold one more)."""
        return -(-self.num_experts // ep)

    def moe_params(self, tp: int = 1, ep: int = 0) -> int:
        """Routed experts sliced across the tp ranks, or with ep > 0 whole experts spread over ep
        ranks (the fullest rank counted); the shared expert is sliced by tp; the router and the
        shared expert's gate are on every rank."""
        expert = 3 * self.hidden * self.expert_intermediate
        routed = self.experts_per_rank(ep) * expert if ep else self.num_experts * expert // tp
        shared = 3 * self.hidden * self.shared_expert_intermediate // tp
        return routed + shared + self.hidden * self.num_experts + (self.hidden if self.shared_expert_gate else 0)

    def is_moe_layer(self, i: int) -> bool:
        return (self.is_moe and i >= self.first_dense_layers and i not in self.dense_layers
                and (i + 1) % self.sparse_step == 0)

    def layer_params(self, i: int, tp: int = 1, ep: int = 0) -> int:
        mlp = self.moe_params(tp, ep) if self.is_moe_layer(i) else self.dense_mlp_params(tp)
        return self.attention_params(tp) + mlp + 2 * self.hidden   # + two norms

    def embedding_params(self, tp: int = 1) -> int:
        padded = -(-self.vocab // tp) * tp    # vocab padded to a multiple of tp
        return padded * self.hidden // tp

    def total_params(self) -> int:
        lm_head = 0 if self.tied else self.vocab * self.hidden
        return (self.vocab * self.hidden + lm_head + self.hidden + self.vision_params
                + sum(self.layer_params(i) for i in range(self.layers)))

    def active_params(self) -> int:
        """Parameters used per token (MoE: only the routed experts)."""
        if not self.is_moe:
            return self.total_params()
        unused = (self.num_experts - self.experts_per_token) * 3 * self.hidden * self.expert_intermediate
        return self.total_params() - unused * sum(self.is_moe_layer(i) for i in range(self.layers))

    def lm_head_layers(self) -> float:
        """The LM head's work per token in decoder layers (active parameters: routed experts
        count as those a token uses): what a pipeline's last stage carries besides its layers."""
        layers = self.active_params() - self.total_params() + sum(self.layer_params(i) for i in range(self.layers))
        return self.vocab * self.hidden / (layers / self.layers)

    # ---- KV cache ----
    def kv_bytes_per_token(self, dtype_bytes: float, layers: float | None = None, tp: int = 1) -> float:
        """Standard attention: 2 (K and V) x layers x kv_heads x head_dim x bytes. MLA caches one
        compressed latent (kv_lora_rank + rope dims) per layer, the same on every TP rank."""
        layers = self.layers if layers is None else layers
        if self.is_mla:
            return layers * (self.kv_lora_rank + self.qk_rope_dim) * dtype_bytes
        return 2 * layers * self.kv_heads_per_rank(tp) * self.head_dim * dtype_bytes

    def kv_layers(self, start: int, end: int, max_model_len: int, block_size: int) -> float:
        """Layers start..end-1 in full-attention layers' worth of KV per token, for requests of
        max_model_len: a layer with a window of W keeps only the blocks its window spans
        (kv_cache_groups.py: cdiv(W - 1, block_size) + 1 of them while decoding)."""
        per_request = -(-max_model_len // block_size)
        return sum(1.0 if w is None else min(per_request, -(-(w - 1) // block_size) + 1) / per_request
                   for w in (self.windows or (None,) * self.layers)[start:end])

    def linear_params_share(self) -> float:
        """Share of the parameters in linear layers (what weight quantization compresses)."""
        total = self.total_params()
        other = (self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden * (2 * self.layers + 1)
                 + self.vision_params)          # (the vision tower is not quantized)
        return (total - other) / total

    def linear_inputs_per_rank(self, tp: int) -> dict[str, int]:
        """Input columns per rank of the quantizable (tensor parallel) linears: column-parallel ones
        take the whole hidden size; row-parallel ones a 1/tp slice."""
        inputs = {"q/k/v and gate/up projections": self.hidden, "o_proj": self.heads * self.head_dim // tp}
        if any(not self.is_moe_layer(i) for i in range(self.layers)) and self.intermediate:
            inputs["down_proj"] = self.intermediate // tp
        if self.shared_expert_intermediate:
            inputs["shared expert down_proj"] = self.shared_expert_intermediate // tp
        if self.is_moe:               # (sliced by tp unless expert parallel keeps them whole)
            inputs["expert down projections"] = self.expert_intermediate // tp
        return inputs

    # ---- tensor parallel validity ----
    def tp_problems(self, tp: int, expert_parallel: bool = False) -> list[str]:
        """Why tensor parallel size tp cannot split this model (empty: it can). Under expert
        parallel the experts are not sliced, so their size need not divide."""
        problems = []
        if self.heads % tp:
            problems.append(f"{self.heads} attention heads are not divisible by {tp}")
        if not self.is_mla and self.kv_heads % tp and tp % self.kv_heads:
            problems.append(f"{self.kv_heads} KV heads neither divide by {tp} nor divide it")
        has_dense = any(not self.is_moe_layer(i) for i in range(self.layers))
        if self.intermediate and has_dense and self.intermediate % tp:
            problems.append(f"the MLP size {self.intermediate} is not divisible by {tp}")
        if self.is_moe and not expert_parallel and self.expert_intermediate % tp:
            problems.append(f"the expert MLP size {self.expert_intermediate} is not divisible by {tp}")
        return problems

    def dcp_problems(self, tp: int, dcp: int) -> list[str]:
        """Why decode context parallel size dcp cannot run at tensor parallel size tp (empty: it
        can): its ranks must hold the same KV heads, i.e. tp replicates each KV head a multiple of
        dcp times. Latent attention (MLA) has one latent KV head, on every rank."""
        if dcp == 1:
            return []
        kv_heads = 1 if self.is_mla else self.kv_heads
        if tp % dcp or tp % (kv_heads * dcp):
            return [f"-dcp {dcp} needs tp to be a multiple of {kv_heads} KV heads x {dcp} (each KV head "
                    f"replicated on {dcp} ranks)"]
        return []

    def valid_dcp_sizes(self, tp: int) -> list[int]:
        return [n for n in range(1, tp + 1) if tp % n == 0 and not self.dcp_problems(tp, n)]

    def valid_tp_sizes(self, limit: int | None = None) -> list[int]:
        limit = limit or self.heads
        return [tp for tp in range(1, limit + 1) if not self.tp_problems(tp)]
