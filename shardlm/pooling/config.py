"""Which runner a checkpoint gets, and how a pooling model pools (vLLM's flags).

--runner auto|generate|pooling   auto: pooling for the architectures that only pool (BertModel,
                                 ...ForSequenceClassification), generate for the rest
--convert auto|none|embed|classify   run a generative checkpoint as an embedder (last token) or
                                 a classifier (its checkpoint's `score` matrix)
--pooler-config JSON             pooling_type, normalize, use_activation (over the model's defaults)

Where the settings come from, later ones winning: the model's defaults (encoders pool [CLS],
decoders their last token; embeddings normalized; one label -> sigmoid, several -> softmax),
the checkpoint's sentence-transformers files (modules.json: its Pooling module's mode, a
Normalize module; sentence_bert_config.json: max_seq_length), then --pooler-config.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from shardlm.config import json_object_flag

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL", "STEP")

# the tasks a model serves, by what it is
TASKS_OF = {"embed": ("embed", "token_embed", "score"), "classify": ("classify", "score", "token_classify")}

# sentence-transformers' Pooling modes -> ours
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}


@dataclass(frozen=True)
class PoolerConfig:
    task: str                        # what the model is: embed or classify
    pooling_type: str                # CLS, LAST, MEAN, ALL or STEP
    normalize: bool = True           # embeddings to unit length
    use_activation: bool = True      # classes: sigmoid (one label) or softmax (several)
    num_labels: int = 0              # classifiers
    matryoshka: bool = False         # `dimensions` may truncate the embeddings
    step_tag_id: int | None = None   # STEP: the token whose positions are pooled (None: every token)
    max_seq_length: int | None = None    # sentence-transformers' limit on a prompt

    @property
    def tasks(self) -> tuple[str, ...]:
        return TASKS_OF[self.task]

    @property
    def activation(self) -> str:
        return "sigmoid" if self.num_labels == 1 else "softmax"


def resolve_runner(architecture: str, runner: str, convert: str, pooling_only: bool) -> tuple[str, str | None]:
    """-> (generate or pooling, the conversion of a generative architecture or None).
    pooling_only: the architecture is one that only pools."""
    if runner not in RUNNERS:
        raise ValueError(f"--runner {runner!r}: use one of {', '.join(RUNNERS)}.")
    if convert not in CONVERTS:
        raise ValueError(f"--convert {convert!r}: use one of {', '.join(CONVERTS)}.")
    if convert in ("embed", "classify"):
        if runner == "generate":
            raise ValueError(f"--convert {convert} makes a pooling model: use --runner pooling (or auto).")
        if pooling_only:
            raise ValueError(f"{architecture} is a pooling model already: leave --convert out.")
        return "pooling", convert
    if runner == "auto":
        runner = "pooling" if pooling_only else "generate"
    if runner == "generate" and pooling_only:
        raise ValueError(f"{architecture} is a pooling model (embeddings or classes, no generation): serve it with "
                         "--runner pooling (or auto).")
    if runner == "pooling" and not pooling_only:
        if convert == "none":
            raise ValueError(f"{architecture} generates text: to pool with it, give --convert embed or classify.")
        return "pooling", "embed"
    return runner, None


def resolve_pooler_config(path: str, hf_config, model_class: type, flag: dict | str | None) -> PoolerConfig:
    task = model_class.pooling_task
    num_labels = getattr(hf_config, "num_labels", 1) if task == "classify" else 0
    values = {"pooling_type": model_class.default_pooling_type, "normalize": True, "use_activation": True}
    st = _sentence_transformers(path)
    values.update(st)
    max_seq_length = values.pop("max_seq_length", None)
    activation = (getattr(hf_config, "sentence_transformers", None) or {}).get("activation_fn", "")
    if activation.endswith("Identity"):      # a CrossEncoder saved to return raw logits
        values["use_activation"] = False
    given = json_object_flag(flag, "--pooler-config", '{"pooling_type": "MEAN", "normalize": false}') if flag else {}
    known = {"pooling_type", "normalize", "use_activation", "step_tag_id"}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"--pooler-config has unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}.")
    values.update(given)
    pooling_type = str(values["pooling_type"]).upper()
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling_type {values['pooling_type']!r}: use one of {', '.join(POOLING_TYPES)}.")
    if model_class.is_encoder is False and pooling_type == "CLS":
        raise ValueError("CLS pooling reads the first token, which in a decoder has seen nothing else: use LAST or "
                         "MEAN for a decoder model.")
    matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or getattr(hf_config, "matryoshka_dimensions", None))
    return PoolerConfig(task, pooling_type, bool(values["normalize"]), bool(values["use_activation"]), num_labels,
                        matryoshka, values.get("step_tag_id"), max_seq_length)


def classifier_from_token(hf_config, tokenizer_path: str, trust_remote_code: bool = False) -> None:
    """A causal LM as a classifier over some of its next-token logits (vLLM's classifier_from_token,
    Qwen3-Reranker's ["no", "yes"]): their LM head rows become the `score` matrix, one label per
    token; two tokens make one label, the second's logit less the first's, whose sigmoid is the
    softmax probability of the second (yes against no). Sets the token ids and num_labels."""
    from transformers import AutoTokenizer
    tokens = list(hf_config.classifier_from_token)
    tok = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    ids = []
    for t in tokens:
        encoded = tok.convert_tokens_to_ids(t)
        if encoded is None or encoded == tok.unk_token_id:
            pieces = tok(t, add_special_tokens=False).input_ids
            if len(pieces) != 1:
                raise ValueError(f"classifier_from_token: {t!r} is not one token of this tokenizer ({pieces}).")
            encoded = pieces[0]
        ids.append(encoded)
    hf_config.classifier_from_token_ids = ids
    hf_config.num_labels = 1 if len(ids) == 2 else len(ids)


def _sentence_transformers(path: str) -> dict:
    """What a checkpoint's sentence-transformers files say: pooling_type, normalize,
    max_seq_length (absent keys: nothing said)."""
    found: dict = {}
    bert_config = _read_json(os.path.join(path, "sentence_bert_config.json"))
    if bert_config.get("max_seq_length"):
        found["max_seq_length"] = int(bert_config["max_seq_length"])
    modules = _read_json(os.path.join(path, "modules.json"))
    if not isinstance(modules, list) or not modules:
        return found
    found["normalize"] = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling = _read_json(os.path.join(path, module.get("path", ""), "config.json"))
            modes = [ours for key, ours in _ST_MODES.items() if pooling.get(key)]
            other = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
            if other or len(modes) > 1:
                raise ValueError(f"The checkpoint's sentence-transformers Pooling uses {', '.join(other + modes)}; "
                                 "shardlm pools with one of CLS, MEAN or last token.")
            if modes:
                found["pooling_type"] = modes[0]
        elif kind == "Normalize":
            found["normalize"] = True
        elif kind not in ("Transformer", ""):
            raise ValueError(f"The checkpoint's sentence-transformers pipeline has a {kind} module, which shardlm "
                             "does not run: its embeddings would differ. Supported: Transformer, Pooling, Normalize.")
    return found


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
