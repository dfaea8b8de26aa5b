"""A StructuredOutputsParams as an llguidance grammar, and its check at the front end."""

from __future__ import annotations

import json

from shardlm.sampling_params import StructuredOutputsParams

BACKENDS = ("auto", "guidance")


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
        overrides = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None and not params.disable_any_whitespace:
            overrides = {"whitespace_pattern": params.whitespace_pattern}
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
    what = params.kinds()[0]
    try:
        grammar = to_grammar(params)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{what} is invalid: {e}") from None
    except Exception as e:      # llguidance raises its own errors for unparsable regexes and grammars
        raise ValueError(f"structured_outputs.{what} is invalid: {e}") from None
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"structured_outputs.{what} is invalid: {error}")
    return grammar
