"""Tool-call parsers for `--tool-choice auto` (`--tool-call-parser NAME`, vLLM's names): each reads
one model family's own tool-call text out of its output.

- hermes (Hermes, Qwen2.5/3, SmolLM3): <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated;
- llama3_json (Llama 3.1+): {"name": ..., "parameters": {...}}, several joined by ';', optionally
  after <|python_tag|>;
- mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or [TOOL_CALLS]name[ARGS]{...};
- pythonic (Llama 3.2/4, ToolACE): [f(a=1, b="x"), g()];
- deepseek_v3 (DeepSeek-V3-0324, R1-0528): <｜tool▁calls▁begin｜>, then per call
  <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME, a ```json block of the arguments, <｜tool▁call▁end｜>;
- deepseek_v31 (DeepSeek-V3.1): per call <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>;
- kimi_k2 (Kimi K2): <|tool_calls_section_begin|>, then per call
  <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>;
- granite (Granite 3.x): <|tool_call|> or <tool_call>, then [{"name": ..., "arguments": {...}}, ...];
- phi4_mini_json (Phi-4-mini): functools[{"name": ..., "arguments": {...}}, ...];
- qwen3_coder (Qwen3-Coder): <tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
  </tool_call>, repeated; glm45 (GLM-4.5): <tool_call>NAME<arg_key>KEY</arg_key><arg_value>value
  </arg_value>...</tool_call>, repeated. Their values are text, read as the request's tool schema
  types each parameter (a string stays text; other types are parsed as JSON);
- openai (GPT-OSS): harmony's messages to functions.NAME (harmony.py).

Text before the tool calls is the message's content. Output that does not parse as tool calls is
content, as vLLM treats it.
"""

from __future__ import annotations

import ast
import copy
import json
import re
from dataclasses import dataclass

from shardlm.entrypoints.openai import harmony
from shardlm.utils import cut_marker_length


@dataclass
class ToolCall:
    name: str
    arguments: str        # JSON text


class ToolParser:
    marker: str = ""      # where tool calls begin, anywhere in the output ("" : at its start only)
    syntax: tuple[str, ...] = ()      # the format's other fixed texts that a tokenizer may make tokens
    schemas: dict[str, dict] = {}     # the request's tools' parameter schemas by name (with_tools)

    def needs_special_tokens(self, tokenizer) -> bool:
        """Whether this tokenizer writes the format's marker or syntax as special tokens (Mistral's
        [TOOL_CALLS], Hermes-2-Pro's <tool_call>), which text decoded without special tokens loses:
        answers that may hold tool calls then keep them (vLLM's adjust_request does the same)."""
        for text in filter(None, (self.marker, *self.syntax)):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if text not in tokenizer.decode(ids, skip_special_tokens=True):
                return True
        return False

    def with_tools(self, tools) -> ToolParser:
        """This parser for one request, knowing its tools' parameter schemas (OpenAI tool objects
        or dicts), for the formats whose argument values are text to be typed."""
        bound = copy.copy(self)
        bound.schemas = {}
        for tool in tools or []:
            function = tool["function"] if isinstance(tool, dict) else tool.function
            name = function["name"] if isinstance(function, dict) else function.name
            params = function.get("parameters") if isinstance(function, dict) else function.parameters
            bound.schemas[name] = params or {}
        return bound

    def start(self, text: str) -> int | None:
        """Where the tool calls begin in text, or None if they do not (yet)."""
        i = text.find(self.marker)
        return None if i < 0 else i

    def held_back(self, text: str) -> int:
        """While streaming: where content must stop because a tool call may begin there."""
        start = self.start(text)
        if start is not None:
            return start
        return len(text) - cut_marker_length(text, self.marker)

    def calls(self, section: str) -> list[ToolCall]:
        """The tool calls written in section (from the marker on); ValueError if it does not parse."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole output."""
        start = self.start(text)
        if start is None:
            return text, []
        try:
            calls = self.calls(text[start:])
        except (ValueError, SyntaxError, TypeError, KeyError):
            return text, []
        content = text[:start]
        return (content if content.strip() else None), calls


def _call(obj: dict, args_key: str = "arguments") -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list:
    """The JSON values in text, one after another (separated by whitespace, ',' or ';')."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i == len(text):
            return values
        value, i = decoder.raw_decode(text, i)
        values.append(value)


class HermesParser(ToolParser):
    marker, syntax = "<tool_call>", ("</tool_call>",)

    def calls(self, section: str) -> list[ToolCall]:
        bodies = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", section, re.DOTALL)
        return [_call(json.loads(body)) for body in bodies if body.strip()] or _none()


class MistralParser(ToolParser):
    marker, syntax = "[TOOL_CALLS]", ("[ARGS]",)

    def calls(self, section: str) -> list[ToolCall]:
        rest = section[len(self.marker):]
        if "[ARGS]" in rest:        # newer tokenizers: name[ARGS]{...}, repeated after [TOOL_CALLS]
            calls = []
            for piece in rest.split(self.marker):
                name, _, args = piece.partition("[ARGS]")
                calls.append(ToolCall(name.strip(), json.dumps(json.loads(args), ensure_ascii=False)))
            return calls
        values = _json_values(rest)
        items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
        return [_call(v) for v in items] or _none()


class LeadingCallsParser(ToolParser):
    """A format whose calls are the whole output: it starts with one of `tags` or with `opening`."""
    tags: tuple[str, ...] = ()
    opening = "["

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.tags + (self.opening,)):
            return len(text) - len(stripped)
        return None

    def held_back(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or any(tag.startswith(stripped) for tag in self.tags) or self.start(text) is not None:
            return 0
        return len(text)


class Llama3JsonParser(LeadingCallsParser):
    python_tag = "<|python_tag|>"
    tags, opening = (python_tag,), "{"

    def calls(self, section: str) -> list[ToolCall]:
        section = section.lstrip()
        if section.startswith(self.python_tag):
            section = section[len(self.python_tag):]
        return [_call(v, "parameters") for v in _json_values(section)] or _none()


class PythonicParser(LeadingCallsParser):
    def calls(self, section: str) -> list[ToolCall]:
        tree = ast.parse(section.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ValueError("not a list of calls")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise ValueError("a tool call is name(keyword=value, ...)")
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return calls


class RegexCallsParser(ToolParser):
    """A format whose calls each match `call`, with groups name and args (JSON arguments)."""
    call: re.Pattern

    def calls(self, section: str) -> list[ToolCall]:
        return [_named(m["name"], json.loads(m["args"])) for m in self.call.finditer(section)] or _none()


class DeepSeekV3Parser(RegexCallsParser):
    marker = "<｜tool▁calls▁begin｜>"
    syntax = ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")
    call = re.compile(r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<args>.*?)\n```"
                      r"(?:<｜tool▁call▁end｜>|$)", re.DOTALL)


class DeepSeekV31Parser(RegexCallsParser):
    marker, syntax = "<｜tool▁calls▁begin｜>", DeepSeekV3Parser.syntax
    call = re.compile(r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<args>.*?)(?:<｜tool▁call▁end｜>|$)",
                      re.DOTALL)


class KimiK2Parser(RegexCallsParser):
    marker = "<|tool_calls_section_begin|>"
    syntax = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
    call = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?(?P<name>[^:<]+?)(?::\d+)?\s*"
                      r"<\|tool_call_argument_begin\|>(?P<args>.*?)(?:<\|tool_call_end\|>|$)", re.DOTALL)


class GraniteParser(LeadingCallsParser):
    tags = ("<|tool_call|>", "<tool_call>")

    def calls(self, section: str) -> list[ToolCall]:
        section = section.lstrip()
        for tag in self.tags:
            section = section.removeprefix(tag)
        values = _json_values(section)
        items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
        return [_call(v) for v in items] or _none()


class Phi4MiniJsonParser(ToolParser):
    marker = "functools["

    def calls(self, section: str) -> list[ToolCall]:
        values = _json_values(section[len(self.marker) - 1:])
        return [_call(v) for v in (values[0] if values and isinstance(values[0], list) else [])] or _none()


class Qwen3CoderParser(ToolParser):
    marker, syntax = "<tool_call>", ("</tool_call>",)
    call = re.compile(r"<tool_call>\s*<function=(?P<name>[^>\n]+)>(?P<body>.*?)(?:</function>|$)", re.DOTALL)
    parameter = re.compile(r"<parameter=(?P<key>[^>\n]+)>(?P<value>.*?)(?:</parameter>|(?=<parameter=)|$)",
                           re.DOTALL)

    def calls(self, section: str) -> list[ToolCall]:
        calls = []
        for m in self.call.finditer(section):
            name = m["name"].strip()
            values = {p["key"].strip(): _one_line_trimmed(p["value"]) for p in self.parameter.finditer(m["body"])}
            calls.append(_named(name, self.typed(name, values)))
        return calls or _none()

    def typed(self, function: str, values: dict[str, str]) -> dict:
        """Each parameter's text as the function's schema types it: text for strings (and for
        parameters the schema does not know), else its JSON (a Python literal as a fallback)."""
        properties = (self.schemas.get(function) or {}).get("properties") or {}
        return {key: _typed_value(text, properties.get(key)) for key, text in values.items()}


class Glm45Parser(Qwen3CoderParser):
    syntax = ("</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    call = re.compile(r"<tool_call>\s*(?P<name>[^<\n]+)(?P<body>.*?)(?:</tool_call>|$)", re.DOTALL)
    pair = re.compile(r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)(?:</arg_value>|$)", re.DOTALL)

    def calls(self, section: str) -> list[ToolCall]:
        calls = []
        for m in self.call.finditer(section):
            name = m["name"].strip()
            values = {p["key"].strip(): p["value"] for p in self.pair.finditer(m["body"])}
            calls.append(_named(name, self.typed(name, values)))
        return calls or _none()


def _one_line_trimmed(text: str) -> str:
    """A parameter's value as Qwen3-Coder writes it: on lines of its own (one newline each side)."""
    return text.removeprefix("\n").removesuffix("\n")


def _typed_value(text: str, schema: dict | None):
    if schema is None:
        return text
    types = schema.get("type")
    if types is None:        # an enum of strings is text; anything else is read as JSON
        enum = schema.get("enum")
        types = ["string"] if enum and all(isinstance(v, str) for v in enum) else []
    types = types if isinstance(types, list) else [types]
    if "string" in types:
        return text
    if "null" in types and text.strip().lower() in ("null", "none"):
        return None
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(text.strip())
        except (ValueError, SyntaxError):
            continue
    return text


class HarmonyToolParser(ToolParser):
    """openai (GPT-OSS): the calls of a harmony output (harmony.py). The server reads a GPT-OSS
    model's chats through harmony whatever the parser; naming this one turns tool calls on."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        _, content, calls = harmony.read(text)
        return content, [ToolCall(name, arguments) for name, arguments in calls]


def _named(name: str, arguments) -> ToolCall:
    name = name.strip()
    if not name:
        raise ValueError("a tool call without a name")
    return ToolCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def _none() -> list[ToolCall]:
    raise ValueError("no tool call")


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser, "pythonic": PythonicParser,
    "deepseek_v3": DeepSeekV3Parser, "deepseek_v31": DeepSeekV31Parser, "kimi_k2": KimiK2Parser,
    "granite": GraniteParser, "phi4_mini_json": Phi4MiniJsonParser, "qwen3_coder": Qwen3CoderParser,
    "glm45": Glm45Parser, "openai": HarmonyToolParser}


def register_tool_parser(*names: str):
    """A class decorator for a --tool-parser-plugin file: its ToolParser subclass answers to
    --tool-call-parser NAME for each of names (vLLM's ToolParserManager.register_module)."""
    def register(cls: type[ToolParser]) -> type[ToolParser]:
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise TypeError(f"{cls!r} is not a ToolParser subclass (shardlm.entrypoints.openai.tool_parsers).")
        for name in names:
            PARSERS[name] = cls
        return cls
    return register


def get_parser(name: str, plugin: str | None = None) -> ToolParser:
    """plugin: a --tool-parser-plugin file, imported first (it may register `name`)."""
    if plugin:
        from shardlm.plugins import load_plugin
        load_plugin(plugin, "--tool-parser-plugin")
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of {', '.join(PARSERS)}"
                         f"{'' if plugin else ' (a --tool-parser-plugin file may register more)'}.")
    return PARSERS[name]()
