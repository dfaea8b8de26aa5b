"""SamplingParams: how to pick each next token and when to stop. Validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


class RequestOutputKind(IntEnum):
    """What each RequestOutput of a request holds (vLLM's names)."""
    CUMULATIVE = 0      # everything so far, every step
    DELTA = 1           # only what is new since the last output (streaming)
    FINAL_ONLY = 2      # one output, when the request finishes


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
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.greedy:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate(self):
        def bad(name, value, rule):
            raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {rule}.")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, "it must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", self.temperature, "it must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "it must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "it must be a positive integer, or 0 / -1 for all tokens")
        if not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "it must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, getattr(self, name), "it must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "it must be > 0 (1 means no penalty)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "it must be an integer >= 1, or None for no limit")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "it must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"it must not exceed max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, v, f"it must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", self.seed, "it must be an integer or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", self.stop, "it must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "it must be a list of token ids (integers >= 0)")

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


_FIELDS = [f.name for f in fields(SamplingParams)]
_dataclass_init = SamplingParams.__init__


def _checked_init(self, *args, **kwargs):
    unknown = sorted(set(kwargs) - set(_FIELDS))
    if unknown:
        raise TypeError(f"SamplingParams got unknown parameter(s) {', '.join(unknown)}; "
                        f"valid parameters are: {', '.join(_FIELDS)}.")
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _checked_init
