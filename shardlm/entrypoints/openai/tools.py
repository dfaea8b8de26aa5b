"""Tool calling on /v1/chat/completions: what tool_choice asks of the output, the messages and
tools as the chat template takes them, and the tool calls read back from the output, whole or
as a stream.

tool_choice `required` and a named function are enforced by a structured-output constraint (a
JSON array of {"name", "parameters"} objects, or the function's parameter schema), so their
arguments always parse and match. `auto` lets the model write its own tool-call text, read by
the server's --tool-call-parser. `none` (and tools with no tool_choice where auto is not enabled)
leaves the output as content.
"""

from __future__ import annotations

import json
import uuid
from typing import NamedTuple

from shardlm.entrypoints.openai import harmony
from shardlm.entrypoints.openai.frontend_options import as_content_format
from shardlm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, OpenAIError
from shardlm.entrypoints.openai.tool_parsers import ToolCall, ToolParser
from shardlm.reasoning import ReasoningParser, ReasoningStream
from shardlm.sampling_params import StructuredOutputsParams

ARGUMENT_PIECE = 16       # characters of arguments per streamed delta where they are sent at the end


class AnswerShape(NamedTuple):
    """How a chat's answer is read, decided once per request: the tool mode (none, auto, required,
    named), the named function, the tool-call parser bound to the request's tools, the reasoning
    parser (None: no thinking to split off), and whether it is GPT-OSS's harmony."""
    mode: str
    function: str | None
    parser: ToolParser | None
    reasoning: ReasoningParser | None
    harmony: bool = False

    def message(self, text: str, role: str) -> dict:
        """A whole choice's message: content, tool calls and reasoning."""
        if self.harmony:
            return harmony_message(text, self.mode == "auto", role)
        return split_choice(text, self.mode, self.function, self.parser, self.reasoning, role)

    def stream(self):
        """What turns one streamed choice's text into deltas."""
        if self.harmony:
            return HarmonyChoiceStream(self.mode == "auto")
        return ChatChoiceStream(self.mode, self.function, self.parser, self.reasoning)


def tool_mode(req: ChatCompletionRequest, parser: ToolParser | None) -> tuple[str, str | None]:
    """(none | auto | required | named, the named function) after checking the request."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools and parser is not None else "none"
    if choice != "none" and not req.tools:
        raise OpenAIError(f"tool_choice {_show(choice)} needs tools.", 400, "tool_choice")
    if choice == "auto" and parser is None:
        raise OpenAIError('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                          "--tool-call-parser NAME; or send tool_choice \"required\" or a named function.", 400,
                          "tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in [t.function.name for t in req.tools]:
            raise OpenAIError(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                              "tools.", 400, "tool_choice")
        return "named", choice.function.name
    return choice, None


def _show(choice) -> str:
    return f'"{choice}"' if isinstance(choice, str) else f"function {choice.function.name!r}"


def constraint(req: ChatCompletionRequest, mode: str, name: str | None) -> StructuredOutputsParams | None:
    """The structured output that enforces a required or named tool choice."""
    if mode == "named":
        tool = next(t for t in req.tools if t.function.name == name)
        return StructuredOutputsParams(json=tool.function.parameters or {"type": "object"})
    if mode == "required":
        one_call = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                                 "parameters": t.function.parameters or
                                                                 {"type": "object"}},
                               "required": ["name", "parameters"], "additionalProperties": False}
                              for t in req.tools]}
        return StructuredOutputsParams(json={"type": "array", "items": one_call, "minItems": 1,
                                             **({"maxItems": 1} if req.parallel_tool_calls is False else {})})
    return None


def template_messages(messages: list[ChatMessage], content_format: str = "string",
                      image_placeholder: str | None = None) -> list[dict]:
    """The conversation as chat templates take it: content as a string or OpenAI's parts
    (frontend_options.as_content_format), arguments of earlier calls as objects."""
    rendered = []
    for m in messages:
        message = {"role": m.role, "content": as_content_format(m.template_parts(), content_format, image_placeholder)}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        rendered.append(message)
    return rendered


def _arguments_object(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise OpenAIError(f"A tool call's arguments in the history are not JSON: {text[:80]!r}.", 400,
                          "messages") from None


def template_tools(req) -> list[dict] | None:
    """A chat (or /tokenize) request's tools as the chat template takes them."""
    return [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None


def read_calls(mode: str, name: str | None, text: str, parser: ToolParser | None) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a whole output."""
    if mode == "named":
        return None, [ToolCall(name, text)]
    if mode == "required":
        try:
            return None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                          for c in json.loads(text)]
        except (json.JSONDecodeError, KeyError, TypeError):     # cut by max_tokens
            return text, []
    if mode == "auto":
        return parser.extract(text)
    return text, []


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def message_calls(calls: list[ToolCall]) -> list[dict]:
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


class ToolCallStream:
    """One choice's streamed deltas: content as it comes while it cannot be a tool call; a named
    function's arguments as they come; other tool calls when the output ends (id and name first,
    then the arguments in pieces)."""

    def __init__(self, mode: str, name: str | None, parser: ToolParser | None):
        self.mode, self.name, self.parser = mode, name, parser
        self.text, self.sent = "", 0
        self.called = False

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        if self.mode == "named":
            deltas = []
            if not self.called:
                self.called = True
                deltas.append({"tool_calls": [{"index": 0, "id": call_id(), "type": "function",
                                               "function": {"name": self.name, "arguments": ""}}]})
            if piece:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return deltas
        if self.mode == "none":
            return [{"content": piece}] if piece else []
        if self.mode == "required":
            return []
        end = self.parser.held_back(self.text)
        if end > self.sent and self.text[:end].strip():
            out, self.sent = self.text[self.sent:end], end
            return [{"content": out}]
        return []

    def finish(self) -> list[dict]:
        """The deltas at the end of the output."""
        if self.mode in ("named", "none"):
            return []
        content, calls = read_calls(self.mode, self.name, self.text, self.parser)
        deltas = []
        shown = self.text[:self.sent]
        if content is not None and content != shown and content.startswith(shown):
            deltas.append({"content": content[len(shown):]})
        elif not calls and len(self.text) > self.sent:      # no calls after all: the rest is content
            deltas.append({"content": self.text[self.sent:]})
        self.called = self.called or bool(calls)
        return deltas + call_deltas(calls)


def call_deltas(calls: list[ToolCall]) -> list[dict]:
    """Whole tool calls as OpenAI streams them: per call its id and name, then its arguments in
    pieces."""
    deltas = []
    for i, (call, item) in enumerate(zip(calls, message_calls(calls))):
        deltas.append({"tool_calls": [{"index": i, "id": item["id"], "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        for k in range(0, len(call.arguments), ARGUMENT_PIECE):
            deltas.append({"tool_calls": [{"index": i, "function": {
                "arguments": call.arguments[k:k + ARGUMENT_PIECE]}}]})
    return deltas


class ChatChoiceStream:
    """One streamed choice's deltas: its thinking as reasoning_content (with a reasoning parser),
    then the answer through ToolCallStream."""

    def __init__(self, mode: str, name: str | None, parser: ToolParser | None, reasoning: ReasoningParser | None):
        self.calls = ToolCallStream(mode, name, parser)
        self.reasoning = ReasoningStream(reasoning) if reasoning is not None else None

    @property
    def called(self) -> bool:
        return self.calls.called

    def feed(self, piece: str, final: bool) -> list[dict]:
        parts = self.reasoning.feed(piece, final) if self.reasoning is not None else [("content", piece)]
        deltas = []
        for kind, text in parts:
            deltas += [{"reasoning_content": text}] if kind == "reasoning" else self.calls.feed(text)
        return deltas + (self.calls.finish() if final else [])


def split_choice(text: str, mode: str, name: str | None, parser: ToolParser | None,
                 reasoning: ReasoningParser | None, role: str = "assistant") -> dict:
    """A whole choice's message: content, tool_calls and reasoning_content."""
    thinking, answer = reasoning.split(text) if reasoning is not None else (None, text)
    content, calls = read_calls(mode, name, answer or "", parser)
    message = {"role": role, "content": content if content or reasoning is None else None}
    if reasoning is not None:
        message["reasoning_content"] = thinking
    if calls:
        message["tool_calls"] = message_calls(calls)
    return message


def harmony_message(text: str, tools_on: bool, role: str = "assistant") -> dict:
    """A GPT-OSS choice's whole message, read as harmony (harmony.py); a call's arguments are
    content where tools are off."""
    reasoning, content, calls = harmony.read(text)
    if calls and not tools_on:
        content, calls = (content or "") + "".join(arguments for _, arguments in calls), []
    message = {"role": role, "content": content, "reasoning_content": reasoning}
    if calls:
        message["tool_calls"] = message_calls([ToolCall(*call) for call in calls])
    return message


class HarmonyChoiceStream:
    """One streamed GPT-OSS choice's deltas (ChatChoiceStream's interface): reasoning_content and
    content as they come, tool calls when the output ends."""

    def __init__(self, tools_on: bool):
        self.stream, self.tools_on, self.called = harmony.HarmonyStream(), tools_on, False

    def feed(self, piece: str, final: bool) -> list[dict]:
        deltas = [{"reasoning_content" if kind == "reasoning" else "content": text}
                  for kind, text in self.stream.feed(piece, final)]
        if final and self.stream.calls:
            if self.tools_on:
                self.called = True
                deltas += call_deltas([ToolCall(*call) for call in self.stream.calls])
            else:
                deltas += [{"content": arguments} for _, arguments in self.stream.calls]
        return deltas
