"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) and checking it
against the base model: every error says what is wrong with the adapter.

PEFT names a weight base_model.model.model.layers.{i}.{self_attn|mlp}.{q_proj|...}.lora_{A|B}.weight
(a vision-language model's: its text model's prefix before layers.);
A is [r, in], B is [out, r], and the layer computes W x + scaling * B A x with scaling = lora_alpha / r
(lora_alpha / sqrt(r) with rsLoRA; rank_pattern and alpha_pattern override r and alpha per module).
shardlm merges q/k/v into qkv_proj and gate/up into gate_up_proj: each becomes one shard of those.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from shardlm.layers.rotary import permute_partial_rotary, rotary_dim
from shardlm.model_loader.weights import text_model_name

# PEFT's module name -> (shardlm's module under the decoder layer, shard of it; None: every shard, a
# fused module of the checkpoint, as Phi-3's qkv_proj and gate_up_proj, whose B is split by rows)
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", 0),
           "qkv_proj": ("self_attn.qkv_proj", None), "gate_up_proj": ("mlp.gate_up_proj", None)}
_WEIGHT = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_ANY_WEIGHT = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_VISION_SIDE = re.compile(r"vision_tower|vision_model|multi_modal_projector|\.connector\.")


def _text_model_key(key: str) -> str:
    """A vision-language model's adapter names its text model's modules under that model's own
    prefix (language_model.model., model.language_model., model.text_model.): as the text model's."""
    text = text_model_name(key.removeprefix("base_model.model."))     # None: a text model's name already
    return key if text is None else "base_model.model." + text


@dataclass
class LoRAAdapter:
    """An adapter's weights on the CPU in float32: the model's module name -> {shard: (A [r, in],
    B [out, r])}, B already multiplied by the module's scaling."""
    name: str
    rank: int                      # the largest of its modules' ranks
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for parts in self.weights.values() for a, b in parts.values())


def target_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in, out) of each PEFT target module in the base model, whole (before tensor parallel)."""
    c = hf_config
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    hidden, inter = c.hidden_size, getattr(c, "intermediate_size", None)
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim), "v_proj": (hidden, kv * head_dim),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden), "qkv_proj": (hidden, (heads + 2 * kv) * head_dim),
            "gate_up_proj": (hidden, 2 * inter)}


@dataclass(frozen=True)
class OwnModules:
    """A model whose linears are its checkpoint's own modules (the Transformers backend): an
    adapter's weight names its module as the model does."""
    linears: dict[str, torch.nn.Module]      # the module name -> the linear adapters may target, on this rank
    shapes: dict[str, tuple[int, int]]       # the module name -> its (in, out), whole
    elsewhere: tuple[str, ...] = ()          # name prefixes of other pipeline stages' modules


def own_modules_of(hf_config) -> OwnModules:
    """The linears of transformers' model for hf_config (built on the meta device: no memory) and
    their shapes, where no model of shardlm's is at hand (the front end checking an adapter)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    head = model.get_output_embeddings()
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    return OwnModules({}, {name: (m.in_features, m.out_features) for name, m in linears.items()})


def front_end_check(request, model_config, max_lora_rank: int) -> LoRAAdapter:
    """The adapter a request names, read and checked as the workers will (the front end's check)."""
    own = own_modules_of(model_config.hf_config) if model_config.model_impl == "transformers" else None
    return read_lora_request(request, model_config.hf_config, max_lora_rank, model_config.download_dir, own)


def read_lora_request(request, hf_config, max_lora_rank: int, download_dir: str | None = None,
                      own_modules: OwnModules | None = None) -> LoRAAdapter:
    """The adapter a LoRARequest names: its directory, or its hub id fetched (into download_dir)."""
    from shardlm.model_loader import hub
    path = hub.local_path(request.lora_path, download_dir=download_dir, require_config=False)
    if own_modules is not None:
        return read_adapter_of_own_modules(request.lora_name, path, own_modules, max_lora_rank)
    return read_adapter(request.lora_name, path, hf_config, max_lora_rank)


def read_adapter_of_own_modules(name: str, path: str, modules: OwnModules, max_lora_rank: int) -> LoRAAdapter:
    """The adapter in directory `path` for a model of OwnModules: each weight on the module it
    names (one shard, rows as the checkpoint's); ValueError with what to do where it cannot be served."""
    config = _read_config(name, path)
    settings = _Settings.of(name, config)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(name, path).items():
        m = _ANY_WEIGHT.match(key)
        module = m.group(1) if m else None
        if module is not None and module.startswith(modules.elsewhere):
            continue                                    # another pipeline stage's
        if module not in modules.shapes:
            some = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in modules.shapes}))
            raise ValueError(f"LoRA adapter {name!r} has a weight shardlm cannot apply: {key!r}. It serves LoRA on "
                             f"the model's linear layers ({some}), not on embeddings, the LM head or extra trained "
                             "modules (modules_to_save).")
        found.setdefault(module, {})[m.group(2)] = tensor
    weights = {}
    for module, pair in sorted(found.items()):
        a, b = _checked_pair(name, module, pair, modules.shapes[module], max_lora_rank, config)
        weights[module] = {0: (a.contiguous(), (b * settings.scaling(module)).contiguous())}
    if not weights and not modules.elsewhere:
        raise ValueError(f"LoRA adapter {name!r} holds no LoRA weights in {WEIGHTS_FILE}.")
    return LoRAAdapter(name, max((a.shape[0] for parts in weights.values() for a, _ in parts.values()), default=0),
                       weights)


@dataclass(frozen=True)
class _Settings:
    """adapter_config.json's rank and scaling: lora_alpha / r (/ sqrt(r) with rsLoRA), per module
    where rank_pattern or alpha_pattern name it."""
    rank: int
    alpha: float | None
    rslora: bool
    ranks: dict
    alphas: dict

    @classmethod
    def of(cls, name: str, config: dict) -> _Settings:
        rank = config.get("r")
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA adapter {name!r}: adapter_config.json has r={rank!r}; it must be a positive "
                             "integer.")
        return cls(rank, config.get("lora_alpha"), bool(config.get("use_rslora")), config.get("rank_pattern") or {},
                   config.get("alpha_pattern") or {})

    def scaling(self, module: str) -> float:
        r = _pattern_value(self.ranks, module, self.rank)
        alpha = _pattern_value(self.alphas, module, self.alpha if self.alpha is not None else r)
        return alpha / (math.sqrt(r) if self.rslora else r)


def _checked_pair(name: str, module: str, pair: dict[str, torch.Tensor], shape: tuple[int, int], max_lora_rank: int,
                  config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A module's (A, B) in float32, checked against its (in, out) in the base model."""
    if set(pair) != {"A", "B"}:
        raise ValueError(f"LoRA adapter {name!r}: {module} has lora_{'A' if 'B' in pair else 'B'} missing; the file "
                         "is incomplete.")
    a, b = pair["A"].float(), pair["B"].float()
    in_features, out_features = shape
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                         "which do not form a product B A; the file is corrupt.")
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise ValueError(f"LoRA adapter {name!r}: {module} is {b.shape[0]} x {a.shape[1]} in the adapter but "
                         f"{out_features} x {in_features} in the base model: the adapter was trained for another "
                         f"base model{_base_of(config)}.")
    if a.shape[0] > max_lora_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {a.shape[0]} ({module}), above max_lora_rank="
                         f"{max_lora_rank}: start the engine with --max-lora-rank {_next_rank(a.shape[0])} or more.")
    return a, b


def read_adapter(name: str, path: str, hf_config, max_lora_rank: int) -> LoRAAdapter:
    """The adapter in directory `path`, checked against the base model's config; ValueError with
    what to do where it cannot be served."""
    config = _read_config(name, path)
    settings = _Settings.of(name, config)
    tensors = _read_tensors(name, path)
    shapes, layers = target_shapes(hf_config), hf_config.num_hidden_layers
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    rot = rotary_dim(hf_config, head_dim)
    moe = bool(getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None))
    found: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _WEIGHT.match(_text_model_key(key))
        if m is None and _VISION_SIDE.search(key):
            raise ValueError(f"LoRA adapter {name!r} has a weight on the vision side of the model: {key!r}. shardlm "
                             "applies adapters to a vision-language model's text model, not to its vision tower or "
                             "projector.")
        if m is None:
            raise ValueError(f"LoRA adapter {name!r} has a weight shardlm cannot apply: {key!r}. shardlm serves LoRA "
                             f"on the attention and MLP projections ({', '.join(TARGETS)}), not on embeddings, the LM "
                             "head or extra trained modules (modules_to_save).")
        layer, block, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in TARGETS or TARGETS[module][0].split(".")[0] != block:
            model = (getattr(hf_config, "architectures", None) or ["the base model"])[0]
            raise ValueError(f"LoRA adapter {name!r} targets {block}.{module}, which does not exist in {model}: its "
                             f"projections are {', '.join(TARGETS)}.")
        if moe and block == "mlp":
            raise ValueError(f"LoRA adapter {name!r} targets the MLP of a mixture-of-experts model: shardlm applies "
                             "LoRA to its attention projections only.")
        if layer >= layers:
            raise ValueError(f"LoRA adapter {name!r} has weights for layer {layer}, but the base model has {layers} "
                             "layers: it was trained for another base model.")
        found.setdefault((layer, block, module), {})[which] = tensor
    if not found:
        raise ValueError(f"LoRA adapter {name!r} holds no LoRA weights in {WEIGHTS_FILE}.")
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    largest = 0
    for (layer, block, module), pair in sorted(found.items()):
        full = f"model.layers.{layer}.{block}.{module}"
        a, b = _checked_pair(name, full, pair, shapes[module], max_lora_rank, config)
        target, shard = TARGETS[module]
        parts = weights.setdefault(f"model.layers.{layer}.{target}", {})
        for shard, part, rows in _shards(module, shard, b * settings.scaling(full), shapes):
            if part in ("q_proj", "k_proj"):      # the base model's q and k rows, as laid out at load
                rows = permute_partial_rotary(rows, head_dim, rot)
            parts[shard] = (a.contiguous(), rows.contiguous())
        largest = max(largest, a.shape[0])
    return LoRAAdapter(name, largest, weights)


def _shards(module: str, shard: int | None, b: torch.Tensor, shapes: dict):
    """(shard, the unfused module it stands for, its rows of B): one, or a fused module's B split
    as the base model's fused weight is split at load (A is the same for each)."""
    if shard is not None:
        return [(shard, module, b)]
    parts = ("q_proj", "k_proj", "v_proj") if module == "qkv_proj" else ("gate_proj", "up_proj")
    return [(i, part, rows) for i, (part, rows) in enumerate(zip(parts, b.split([shapes[p][1] for p in parts])))]


def _read_config(name: str, path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {name!r}: {path!r} has no {CONFIG_FILE}; give the directory PEFT's "
                         "save_pretrained wrote (adapter_config.json + adapter_model.safetensors), or its hub id.")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {file}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {file} is not a JSON object.")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"LoRA adapter {name!r} is a PEFT {kind} adapter; shardlm serves LORA adapters.")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {name!r} is a DoRA adapter (use_dora), which shardlm does not serve.")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise ValueError(f"LoRA adapter {name!r} trains biases (bias={config.get('bias')!r}); shardlm serves "
                         "adapters with bias='none'.")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {name!r} has fan_in_fan_out=true (GPT-2 style Conv1D), which shardlm's "
                         "models do not have.")
    return config


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        hint = " (it has adapter_model.bin: save it with safe_serialization=True)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise ValueError(f"LoRA adapter {name!r}: {path!r} has no {WEIGHTS_FILE}{hint}.")
    from safetensors.torch import load_file
    try:
        return load_file(file)
    except Exception as e:       # safetensors raises its own error types for a damaged file
        raise ValueError(f"LoRA adapter {name!r}: {file} cannot be read ({type(e).__name__}: {e}); the file is "
                         "corrupt or not safetensors.") from None


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the end of the
    module's name (as a regular expression)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _base_of(config: dict) -> str:
    base = config.get("base_model_name_or_path")
    return f" ({base})" if base else ""


def _next_rank(rank: int) -> int:
    """vLLM's allowed --max-lora-rank values are powers of two from 8; the smallest that holds `rank`."""
    return max(8, 1 << (rank - 1).bit_length())
