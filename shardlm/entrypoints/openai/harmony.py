"""GPT-OSS's harmony format, read out of an output's text as vLLM reads it for these models (the
chat API reads such a model's answers with it, tools.harmony_message / HarmonyChoiceStream: no
flag for reasoning; tool calls with `--enable-auto-tool-choice --tool-call-parser openai`).

A GPT-OSS answer is a run of messages, each `[<|start|>assistant]HEADER<|message|>BODY` ended by
<|end|>, <|call|> or <|return|> (the first message's <|start|>assistant is the prompt's last
tokens). The header holds `<|channel|>NAME` and, for a tool call, `to=functions.NAME` (before or
after the channel) and maybe `<|constrain|>json`. Bodies of the analysis channel are the
reasoning (`reasoning_content`); those of final, and commentary addressed to no one (a
preamble), the content; a call's body is its arguments. These markers are special tokens, so a
chat request to such a model is detokenized with them (skip_special_tokens false).
"""

from __future__ import annotations

import re

from shardlm.utils import cut_marker_length

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")     # what ends a body (a new message too)
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_MARKER = re.compile(r"<\|[a-z_]+\|>")


def is_harmony_model(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) == "gpt_oss"


class HarmonyStream:
    """One output's text in pieces -> [(kind, text)], kind "reasoning" or "content", as each
    message's body comes (a marker cut between pieces held back); tool calls in .calls, as
    (function name, arguments JSON text)."""

    def __init__(self):
        self.pending, self.in_body = "", False
        self.channel: str | None = None
        self.recipient: str | None = None
        self.arguments = ""
        self.calls: list[tuple[str, str]] = []

    def feed(self, piece: str, final: bool = False) -> list[tuple[str, str]]:
        self.pending += piece
        out: list[tuple[str, str]] = []
        while True:
            if not self.in_body:
                at = self.pending.find(MESSAGE)
                if at < 0:
                    if final and _MARKER.sub("", self.pending).strip():   # text outside any message
                        out.append(("content", _MARKER.sub("", self.pending)))
                    if final:
                        self.pending = ""
                    return out
                self._open(self.pending[:at])
                self.pending = self.pending[at + len(MESSAGE):]
                continue
            ends = [(i, m) for m in ENDS if (i := self.pending.find(m)) >= 0]
            if ends:
                at, marker = min(ends)
                self._body(self.pending[:at], out)
                self._close()
                self.pending = self.pending[at + (0 if marker == "<|start|>" else len(marker)):]
                continue
            keep = 0 if final else max(cut_marker_length(self.pending, m) for m in ENDS)
            self._body(self.pending[:len(self.pending) - keep], out)
            self.pending = self.pending[len(self.pending) - keep:]
            if final:
                self._close()
            return out

    def _open(self, header: str) -> None:
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else None
        self.recipient = recipient.group(1) if recipient else None
        self.in_body, self.arguments = True, ""

    def _body(self, text: str, out: list) -> None:
        if not text:
            return
        if self.recipient is not None:
            self.arguments += text
        elif self.channel == "analysis":
            out.append(("reasoning", text))
        else:
            out.append(("content", text))

    def _close(self) -> None:
        if self.in_body and self.recipient is not None:
            name = self.recipient.removeprefix("functions.")
            self.calls.append((name, self.arguments.strip() or "{}"))
        self.in_body, self.recipient = False, None


def read(text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(reasoning, content, tool calls) of a whole harmony output."""
    stream, parts = HarmonyStream(), {"reasoning": "", "content": ""}
    for kind, piece in stream.feed(text, final=True):
        parts[kind] += piece
    return parts["reasoning"] or None, parts["content"] or None, stream.calls
