"""Build a model and fill it from a Hugging Face directory of safetensors files."""

from __future__ import annotations

import bisect
import glob
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from safetensors import safe_open

from shardlm.config import ModelConfig
from shardlm.model_loader.compressed_tensors import CompressedLinears
from shardlm.model_loader.fp8 import dequantized, fp8_method
from shardlm.model_loader.gptq_awq import PackedLinears, is_v1


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors files; shardlm loads safetensors checkpoints "
                         "(convert .bin weights with transformers' save_pretrained(safe_serialization=True)); "
                         "--load-format dummy runs it on random weights.")
    return files


def iterate_weights(model_dir: str) -> Iterator[tuple[str, object]]:
    """(name, lazy tensor): a safetensors slice, read from disk only where a weight loader
    indexes it, so each tensor parallel rank reads just its own part; an FP8 checkpoint's
    weights dequantized as they are read (fp8.py)."""
    weights, qc = _safetensors_slices(model_dir), _quantization_config(model_dir)
    if fp8_method(qc):
        return dequantized(weights, qc, safetensors_files(model_dir))
    return weights


def _safetensors_slices(model_dir: str) -> Iterator[tuple[str, object]]:
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def _quantization_config(model_dir: str) -> dict | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f).get("quantization_config")
    except OSError:
        return None


@contextmanager
def built_in(dtype: torch.dtype, device: torch.device):
    """Modules made within this block have their parameters in dtype on device."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def quantize_linears(model: torch.nn.Module, config) -> None:
    """Quantize the tensor parallel linears (attention and MLP projections) and the experts of MoE
    layers; embeddings, the LM head and routers keep the model's dtype. Every rank visits them in the same order
    (a row-parallel int8 layer agrees on its rows' scales with its TP peers)."""
    from shardlm.layers.linear import ColumnParallelLinear, RowParallelLinear
    from shardlm.layers.moe import FusedMoE
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, FusedMoE)):
            module.quantize(config)


def take_quantized_linears(model: torch.nn.Module, tensors: dict[str, tuple]) -> set[str]:
    """Each tensor parallel linear takes its rank's part of the already-quantized weights
    (`tensors`: (q, scales, mins, bits) by Hugging Face weight name, from a GGUF file or a
    GPTQ/AWQ/compressed-tensors checkpoint); a float weight loaded before is dropped. A vocabulary
    table (embedding, LM head; a tied head shares its embedding's) is offered its tensor and keeps
    it where it has a kernel for it, else keeps the float table loaded before. MoE experts take
    theirs (FusedMoE.take_quantized). -> the parameters filled so (the experts' stacks)."""
    from shardlm.layers.linear import ColumnParallelLinear, RowParallelLinear
    from shardlm.layers.moe import FusedMoE
    from shardlm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    tensors = _laid_out_by_the_model(model, tensors)
    taken = _take_quantized_experts(model, tensors)
    for name, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding):
            tied = isinstance(module, ParallelLMHead) and getattr(model, "tie_word_embeddings", False)
            table = "lm_head.weight" if isinstance(module, ParallelLMHead) and not tied else "model.embed_tokens.weight"
            if table in tensors:
                if tied and module.tied_to is not None:     # its embedding came first in named_modules
                    module.share_tied_table()
                else:
                    module.take_quantized([tensors[table]])
                taken.add(table)
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            prefix, _, leaf = name.rpartition(".")
            # a merged matrix (qkv_proj, gate_up_proj) takes its checkpoint tensors in shard order
            parts = [part.strip(".") for merged, part, _ in model.stacked_params if merged.strip(".") == leaf]
            names = [f"{prefix}.{part}.weight" for part in parts or [leaf]]
            if all(n in tensors for n in names):
                module.take_quantized([tensors[n] for n in names])
                taken.update(names)
    left = sorted(n for n in set(tensors) - taken if _stage_filter(model)(n))
    if left:
        raise ValueError(f"The checkpoint has quantized weights shardlm runs in float only: {', '.join(left[:4])}"
                         f"{' ...' if len(left) > 4 else ''} (quantized are the attention, MLP and expert "
                         "projections; not embeddings or the LM head).")
    return {f"{name}.{which}" for name, module in model.named_modules() if isinstance(module, FusedMoE)
            and module.use_quantized() for which in ("w13", "w2")}


def _laid_out_by_the_model(model: torch.nn.Module, tensors: dict[str, tuple]) -> dict[str, tuple]:
    """Quantized weights renamed, split and reordered as the model's checkpoint_tensors does float
    ones (Phi-3's fused q/k/v and gate/up, rows of a partial rotary embedding). That moves whole
    rows only (a model whose map does more reads no quantized checkpoints), so it is run on each
    tensor's row numbers, and every row's integers, scales and minimums follow their number."""
    if not hasattr(model, "checkpoint_tensors"):
        return tensors
    names, starts, numbered, start = list(tensors), [], [], 0
    for name in names:
        rows = tensors[name][0].shape[0]
        starts.append(start)
        numbered.append((name, torch.arange(start, start + rows).unsqueeze(1)))
        start += rows
    out = {}
    for name, rows in model.checkpoint_tensors(numbered):
        rows = rows.reshape(-1)
        i = bisect.bisect_right(starts, int(rows[0])) - 1
        q, scales, mins, bits = tensors[names[i]]
        local = rows - starts[i]
        if torch.equal(local, torch.arange(int(local[0]), int(local[0]) + len(local))):
            local = slice(int(local[0]), int(local[0]) + len(local))     # in order: a view, no copy
        out[name] = (q[local], scales[local], mins[local], bits)
    return out


def _take_quantized_experts(model: torch.nn.Module, tensors: dict[str, tuple]) -> set[str]:
    """Hands each expert matrix among `tensors` to its FusedMoE (by the model's map_checkpoint_name);
    -> the names taken."""
    from shardlm.layers.moe import FusedMoE
    taken = set()
    for name, part in tensors.items():
        mapped, shard_id = model.map_checkpoint_name(name) if hasattr(model, "map_checkpoint_name") else (name, None)
        owner, _, which = mapped.rpartition(".")
        if which not in ("w13", "w2") or shard_id is None or not _stage_filter(model)(name):
            continue
        module = model.get_submodule(owner)
        if isinstance(module, FusedMoE):
            module.take_quantized(which, shard_id, part)
            taken.add(name)
    return taken


def text_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as its text model's, or None for the vision side.
    Both layouts are seen: language_model.model.layers... and model.language_model.layers..."""
    for prefix, text in (("language_model.model.", "model."), ("model.language_model.", "model."),
                         ("model.text_model.", "model."),
                         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return text + name[len(prefix):]
    return None


def text_model_weights(weights: Iterator[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """A multimodal checkpoint's text model tensors, named as the text model's."""
    for name, tensor in weights:
        text = text_model_name(name)
        if text is not None:
            yield text, tensor


def _stage_filter(model: torch.nn.Module):
    """Whether a checkpoint tensor belongs to this pipeline stage's part of the model."""
    return getattr(model, "_on_this_stage", lambda name: True)


def _float_weights(weights: Iterator[tuple[str, object]], packed: PackedLinears | CompressedLinears,
                   on_stage) -> Iterator:
    for name, tensor in weights:
        if packed.claims(name, tensor):
            if on_stage(name):
                packed.take(name, tensor)
        else:
            yield name, tensor


def fill_with_random_weights(model: torch.nn.Module, seed: int) -> set[str]:
    """--load-format dummy: every parameter uniform in [-1e-3, 1e-3] (vLLM's range), the same on every
    run; -> their names, as load_weights returns those it loaded."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        values = torch.empty(param.shape, dtype=torch.float32).uniform_(-1e-3, 1e-3, generator=generator)
        param.data.copy_(values)
    return {name for name, _ in model.named_parameters()}


def load_model(cls: type, model_config: ModelConfig, device: torch.device,
               layer_range: tuple[int, int] | None = None) -> torch.nn.Module:
    """The model of class `cls` (models/registry.py picks it: this package sits below the models,
    which read their weights with it), or with layer_range the part a pipeline stage holds: those
    layers, plus the embedding on the first stage and norm + LM head on the last."""
    with built_in(model_config.dtype, device):
        model = cls(model_config.hf_config, model_config.max_model_len, model_config.dtype, layer_range)
    quant = model_config.quantization
    if quant is not None and quant.method in ("gguf", "gptq", "awq", "compressed-tensors") and not getattr(
            model, "reads_quantized_checkpoints", True):
        raise ValueError(f"{model_config.architecture} reshapes some of its linear weights at load (DeepSeek: the "
                         f"latent up-projection into per-head blocks), which {quant.method.upper()} weights taken as "
                         "stored cannot follow: run the float checkpoint (with --quantization int8 or int4 to "
                         "quantize it at load).")
    packed, stored = None, getattr(model_config.hf_config, "quantization_config", None)
    if quant is not None and quant.method in ("gptq", "awq"):
        packed = PackedLinears(quant.method, quant.group_size, is_v1(stored))
    elif quant is not None and quant.method == "compressed-tensors":
        packed = CompressedLinears(quant, stored)
    if model_config.load_format == "dummy":
        loaded = fill_with_random_weights(model, model_config.seed)
    else:
        weights = iterate_weights(model_config.model)
        if model_config.multimodal is not None:     # its images' side: multimodal/vision_encoder.py
            weights = text_model_weights(weights)
        if packed is not None:     # the packed linears are collected aside, the rest loads as usual
            weights = _float_weights(weights, packed, _stage_filter(model))
        loaded = model.load_weights(weights)
    if packed is not None:
        loaded |= take_quantized_linears(model, packed.decoded())
    elif quant is not None and quant.method == "gguf":
        from shardlm.model_loader.gguf_weights import read_linears
        loaded |= take_quantized_linears(model, read_linears(quant.source, model_config.hf_config))
    elif quant is not None and quant.at_load:
        quantize_linears(model, quant)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"The checkpoint in {model_config.model} lacks weights for: {', '.join(sorted(missing)[:8])}"
                         f"{' ...' if len(missing) > 8 else ''}")
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return model.eval()
