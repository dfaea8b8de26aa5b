"""Tool-call parsers for `--tool-choice auto` (`--tool-call-parser NAME`, vLLM's names): each reads
one model family's own tool-call text out of its output.

- hermes (Hermes, Qwen2.5/3): <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated;
- llama3_json (Llama 3.1+): {"name": ..., "parameters": {...}}, several joined by ';', optionally
  after <|python_tag|>;
- mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or [TOOL_CALLS]name[ARGS]{...};
- pythonic (Llama 3.2/4, ToolACE): [f(a=1, b="x"), g()].

Text before the tool calls is the message's content. Output that does not parse as tool calls is
content, as vLLM treats it.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from shardlm.utils import cut_marker_length


@dataclass
class ToolCall:
    name: str
    arguments: str        # JSON text


class ToolParser:
    marker: str = ""      # where tool calls begin, anywhere in the output ("" : at its start only)

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
    marker = "<tool_call>"

    def calls(self, section: str) -> list[ToolCall]:
        bodies = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", section, re.DOTALL)
        return [_call(json.loads(body)) for body in bodies if body.strip()] or _none()


class MistralParser(ToolParser):
    marker = "[TOOL_CALLS]"

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


class Llama3JsonParser(ToolParser):
    python_tag = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.python_tag) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def held_back(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self.python_tag.startswith(stripped) or self.start(text) is not None:
            return 0
        return len(text)

    def calls(self, section: str) -> list[ToolCall]:
        section = section.lstrip()
        if section.startswith(self.python_tag):
            section = section[len(self.python_tag):]
        return [_call(v, "parameters") for v in _json_values(section)] or _none()


class PythonicParser(ToolParser):
    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("[") else None

    def held_back(self, text: str) -> int:
        return 0 if not text.strip() or self.start(text) is not None else len(text)

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


def _none() -> list[ToolCall]:
    raise ValueError("no tool call")


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                        "mistral": MistralParser, "pythonic": PythonicParser}


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
