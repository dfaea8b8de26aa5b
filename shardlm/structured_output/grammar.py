"""A StructuredOutputsParams as an llguidance grammar, and the compiler of per-request matchers.

Limits (a constraint beyond them is refused with what to do, a 400 at the server): its
specification (schema, regex, grammar or choices) at most MAX_CONSTRAINT_BYTES as JSON text; and
llguidance's own bounds on the work of compiling it and of each step's mask (LLParserLimits'
defaults: lexer fuel 1,000,000 to compile, 200,000 per token, grammars of 500,000 symbols), which
keep a pathological schema from stalling the engine.
"""

from __future__ import annotations

import json
import threading
from functools import lru_cache

from shardlm.sampling_params import BOUNDED_JSON_WHITESPACE, StructuredOutputsParams

BACKENDS = ("auto", "guidance")
MAX_CONSTRAINT_BYTES = 256 << 10


def _llguidance():
    try:
        import llguidance
    except ImportError as e:     # a dependency of shardlm: only a broken install lacks it
        raise RuntimeError("Structured outputs need the llguidance package: pip install llguidance") from e
    return llguidance


def to_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for these constraints; ValueError where one is malformed."""
    matcher = _llguidance().LLMatcher
    if params.json is not None or params.json_object:
        schema = {"type": "object"} if params.json_object else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"The JSON schema is not valid JSON: {e}.") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("The JSON schema must be a JSON object.")
        if params.disable_any_whitespace:
            overrides = {"whitespace_flexible": False}
        elif params.any_whitespace:
            overrides = {"whitespace_flexible": True}
        else:       # bounded: a model at any temperature ends the object (OpenAI's strict outputs are compact)
            overrides = {"whitespace_pattern": params.whitespace_pattern or BOUNDED_JSON_WHITESPACE}
        if params.disable_additional_properties and isinstance(schema, dict):
            schema = {**schema, "additionalProperties": False}
        return matcher.grammar_from_json_schema(schema, overrides=overrides)
    if params.regex is not None:
        return matcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        alternatives = " | ".join(json.dumps(c) for c in params.choice)     # Lark string literals
        return matcher.grammar_from_lark(f"start: {alternatives}")
    from llguidance.gbnf_to_lark import any_to_lark  # GBNF / EBNF (llama.cpp's, vLLM's xgrammar's) too
    return matcher.grammar_from_lark(any_to_lark(params.grammar))


def check(params: StructuredOutputsParams) -> str:
    """The grammar, or ValueError naming what is wrong with the constraint (a 400 at the server)."""
    return _cached_grammar(_spec(params))


def _spec(params: StructuredOutputsParams) -> str:
    """The constraint as canonical JSON text: the cache key, and what the size limit counts."""
    spec = json.dumps({k: v for k, v in vars(params).items() if v is not None}, sort_keys=True)
    if len(spec) > MAX_CONSTRAINT_BYTES:
        raise ValueError(f"structured_outputs.{params.kinds()[0]} is too large: {len(spec)} bytes as JSON, more than "
                         f"the {MAX_CONSTRAINT_BYTES} this server compiles. Send a smaller schema or grammar.")
    return spec


@lru_cache(maxsize=256)
def _cached_grammar(spec: str) -> str:
    params = StructuredOutputsParams(**json.loads(spec))
    what = params.kinds()[0]
    try:
        grammar = to_grammar(params)
    except Exception as e:      # ValueError, and llguidance's own errors for unparsable regexes and grammars
        raise ValueError(f"structured_outputs.{what} is invalid: {e}") from None
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"structured_outputs.{what} is invalid: {error}")
    return grammar


class GrammarCompiler:
    """Per-request matchers over one tokenizer (read into llguidance once, at the first use)."""

    def __init__(self, tokenizer, vocab_size: int, trust_remote_code: bool = False):
        """tokenizer: a Hugging Face tokenizer, or the path to load one from."""
        self._hf, self.vocab_size, self.trust_remote_code = tokenizer, vocab_size, trust_remote_code
        self._tokenizer = None
        self._lock = threading.Lock()

    def hf_tokenizer(self):
        with self._lock:
            if isinstance(self._hf, str):
                from transformers import AutoTokenizer
                self._hf = AutoTokenizer.from_pretrained(self._hf, trust_remote_code=self.trust_remote_code)
            return self._hf

    def _llg_tokenizer(self):
        hf = self.hf_tokenizer()
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=max(self.vocab_size, len(hf)))
            return self._tokenizer

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher at the constraint's start; ValueError naming the problem."""
        grammar = check(params)
        matcher = _llguidance().LLMatcher(self._llg_tokenizer(), grammar)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kinds()[0]} cannot be used: {matcher.get_error()}")
        return matcher
