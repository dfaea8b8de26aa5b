"""SamplingParams: how to pick each next token and when to stop. Validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import IntEnum

_GREEDY_EPS = 1e-5
DEFAULT_MAX_LOGPROBS = 20          # --max-logprobs' default (vLLM's): the engine checks a request against its own
# --logprobs-mode (vLLM's): what logprobs report, of the model's output or of what the token was drawn from
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
INT64_MAX = 2**63 - 1
MAX_LOGIT_BIAS = 100.0     # OpenAI's range for logit_bias values
BOUNDED_JSON_WHITESPACE = "[ ]?"     # the default JSON whitespace between items: '{"a": 1, "b": 2}' or compact


class RequestOutputKind(IntEnum):
    """What each RequestOutput of a request holds (vLLM's names)."""
    CUMULATIVE = 0      # everything so far, every step
    DELTA = 1           # only what is new since the last output (streaming)
    FINAL_ONLY = 2      # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM 0.32's names): exactly one of a JSON schema (`json`, a dict
    or its JSON text), a regular expression, a list of choices, a grammar (Lark, or GBNF/EBNF with
    `::=` rules) or any JSON object (`json_object=True`). The output always matches it."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON whitespace between items: by default at most one space (BOUNDED_JSON_WHITESPACE), so that no
    # model can pad an object with whitespace until max_tokens; disable_any_whitespace: none at all;
    # whitespace_pattern: this regex; any_whitespace: any amount (vLLM's xgrammar default)
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False  # JSON objects hold only the schema's properties
    whitespace_pattern: str | None = None        # JSON: the whitespace allowed between items (a regex)
    any_whitespace: bool = False

    def __post_init__(self):
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError("StructuredOutputsParams takes exactly one of json, regex, choice, grammar or "
                             f"json_object; got {', '.join(kinds) if kinds else 'none'}.")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"StructuredOutputsParams.choice={self.choice!r} is invalid: it must be a non-empty "
                             "list of strings.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string.")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("StructuredOutputsParams.json must be a JSON schema: a dict or its JSON text.")
        if self.choice is not None:
            self.choice = list(self.choice)
        options = [k for k in ("disable_any_whitespace", "any_whitespace") if getattr(self, k)]
        if len(options) + (self.whitespace_pattern is not None) > 1:
            raise ValueError("StructuredOutputsParams takes at most one of disable_any_whitespace, any_whitespace and "
                             "whitespace_pattern.")

    def kinds(self) -> list[str]:
        return [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None] + \
            (["json_object"] if self.json_object else [])


# generation_config.json keys -> the SamplingParams fields they give defaults to (for requests that
# leave them out; do_sample false means greedy)
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16         # None: until max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None         # top-k logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None     # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None     # sample only among these
    bad_words: list[str] | None = None             # words never generated (vLLM's): with or without a leading space
    bad_words_token_ids: list[list[int]] | None = None    # token sequences never generated (bad_words' go here too)
    detokenize: bool = True                         # False: token ids only (text stays empty), as vLLM's
    truncate_prompt_tokens: int | None = None       # keep the prompt's last k tokens (-1: as many as fit)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None    # constrain the output (shardlm/structured_output)
    extra_args: dict | None = None     # for custom logits processors (logits_processor.py), as vLLM's

    def __post_init__(self):
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {_token_key(k): v for k, v in dict(self.logit_bias).items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(seq) for seq in self.bad_words_token_ids]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.greedy:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate(self):
        def bad(name, value, rule):
            raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {rule}.")

        def number(name, lo=-math.inf, hi=math.inf, rule=""):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                bad(name, v, rule or f"it must be a finite number in [{lo}, {hi}]")

        def integer(name, lo, hi=INT64_MAX, rule="", optional=False):
            v = getattr(self, name)
            if v is None and optional:
                return
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                bad(name, v, rule or f"it must be an integer in [{lo}, {hi}]")

        integer("n", 1, rule="it must be an integer >= 1")
        number("temperature", 0, rule="it must be a finite number >= 0 (0 means greedy)")
        number("top_p", 0, 1, rule="it must be in (0, 1]")
        if self.top_p == 0:
            bad("top_p", self.top_p, "it must be in (0, 1]")
        integer("top_k", 0, rule="it must be a positive integer, or 0 / -1 for all tokens")
        number("min_p", 0, 1, rule="it must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            number(name, -2, 2, rule="it must be in [-2, 2]")
        number("repetition_penalty", 0, rule="it must be a finite number > 0 (1 means no penalty)")
        if self.repetition_penalty == 0:
            bad("repetition_penalty", 0, "it must be a finite number > 0 (1 means no penalty)")
        integer("max_tokens", 1, rule="it must be an integer >= 1, or None for no limit", optional=True)
        integer("min_tokens", 0, rule="it must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"it must not exceed max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            integer(name, 0, rule="it must be an integer >= 0 or None", optional=True)
        integer("seed", 0, rule=f"it must be an integer in [0, {INT64_MAX}] or None", optional=True)
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", self.stop, "it must be a non-empty string or a list of non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT64_MAX
               for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "it must be a list of token ids (integers >= 0)")
        if self.logit_bias is not None:
            for tid, bias in self.logit_bias.items():
                if tid < 0 or isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                        or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    bad("logit_bias", {tid: bias}, f"it maps token ids (integers >= 0) to biases in "
                        f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or any(isinstance(t, bool) or not isinstance(t, int)
                                                 or not 0 <= t <= INT64_MAX for t in self.allowed_token_ids):
                bad("allowed_token_ids", self.allowed_token_ids, "it must be a non-empty list of token ids "
                    "(integers >= 0), or None")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            integer("truncate_prompt_tokens", 1, rule="it must be an integer >= 1, -1 (as many as fit) or None",
                    optional=True)
        if self.stop and not self.detokenize:
            bad("stop", self.stop, "stop strings are found in the text, which detokenize=False leaves out")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words", self.bad_words, "it must be a list of non-empty strings")
        if self.extra_args is not None and not (isinstance(self.extra_args, dict)
                                                and all(isinstance(k, str) for k in self.extra_args)):
            bad("extra_args", self.extra_args, "it must be a dict with string keys (custom logits processors read it)")
        if self.bad_words_token_ids is not None and any(
                not seq or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT64_MAX for t in seq)
                for seq in self.bad_words_token_ids):
            bad("bad_words_token_ids", self.bad_words_token_ids, "it must be a list of non-empty lists of token ids")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Every token id and top_k within a model's vocabulary (the engine checks this per request)."""
        def outside(ids):
            return [t for t in ids if t >= vocab_size][:5]

        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or ())),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("bad_words_token_ids", [t for seq in self.bad_words_token_ids or [] for t in seq])):
            if outside(ids):
                raise ValueError(f"SamplingParams.{name} holds token id(s) {outside(ids)} outside the vocabulary "
                                 f"[0, {vocab_size}).")
        if self.top_k > vocab_size:
            raise ValueError(f"SamplingParams.top_k={self.top_k} is invalid: it must be at most the vocabulary "
                             f"size {vocab_size}, or 0 / -1 for all tokens.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)


def _token_key(key) -> int:
    """logit_bias keys: token ids, as ints or (from JSON) decimal strings."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    if isinstance(key, bool) or not isinstance(key, int):
        raise ValueError(f"SamplingParams.logit_bias key {key!r} is invalid: keys are token ids.")
    return key


_FIELDS = [f.name for f in fields(SamplingParams)]
_dataclass_init = SamplingParams.__init__


def _checked_init(self, *args, **kwargs):
    unknown = sorted(set(kwargs) - set(_FIELDS))
    if unknown:
        raise TypeError(f"SamplingParams got unknown parameter(s) {', '.join(unknown)}; "
                        f"valid parameters are: {', '.join(_FIELDS)}.")
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _checked_init
