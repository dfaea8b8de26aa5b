"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's names): where a reasoning model's thinking
ends and its answer begins, for the server (which returns the thinking as `reasoning_content`)
and for the engine core (a structured-output constraint applies to the answer only).

- deepseek_r1: the chat template opens <think> in the prompt; the output is thinking up to
  </think>, then the answer. An output that never closes it is all thinking.
- qwen3: the model writes <think>...</think> itself (or the template closes an empty one in the
  prompt when thinking is off); an output without </think> is all answer.
- deepseek_v3 (DeepSeek-V3.1): as deepseek_r1 where thinking is on; off, the template closes it.
A prompt that ends by closing the thinking (closed_by) is answered with no thinking, whatever the
parser: the server reads such an answer as all content.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.utils import cut_marker_length


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    unclosed_is_reasoning: bool       # an output with no end marker: all thinking (else all answer)
    start: str = "<think>"
    end: str = "</think>"
    thinking: bool = True             # False: the prompt closed the thinking (closed_by), the output is answer

    def closed_by(self, prompt: str) -> bool:
        """Whether the prompt ends by closing the thinking: a chat template with thinking turned off
        (DeepSeek-V3.1's `<｜Assistant｜></think>`, Qwen3's empty `<think>\n\n</think>`)."""
        return prompt.rstrip().endswith(self.end)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None for an empty part."""
        if not self.thinking:
            return None, text or None
        stripped = text.lstrip()
        opened = stripped.startswith(self.start)
        body = stripped[len(self.start):] if opened else text
        if self.end in body:
            reasoning, _, content = body.partition(self.end)
        elif opened or self.unclosed_is_reasoning:
            reasoning, content = body, ""
        else:
            reasoning, content = "", text
        return reasoning or None, content or None


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", unclosed_is_reasoning=True),
                     "qwen3": ReasoningParser("qwen3", unclosed_is_reasoning=False),
                     # DeepSeek-V3.1 (hybrid): as deepseek_r1; with thinking off its template closes it in the
                     # prompt, which the server sees (closed_by), as vLLM's reads chat_template_kwargs.thinking
                     "deepseek_v3": ReasoningParser("deepseek_v3", unclosed_is_reasoning=True)}


def register_reasoning_parser(parser: ReasoningParser) -> ReasoningParser:
    """For a --reasoning-parser-plugin file: `parser` answers to --reasoning-parser parser.name."""
    if not isinstance(parser, ReasoningParser):
        raise TypeError(f"{parser!r} is not a ReasoningParser (shardlm.reasoning).")
    REASONING_PARSERS[parser.name] = parser
    return parser


def get_reasoning_parser(name: str, plugin: str | None = None) -> ReasoningParser:
    """plugin: a --reasoning-parser-plugin file, imported first in this process (the server's and
    the engine core's: both read the parser)."""
    if plugin:
        from shardlm.plugins import load_plugin
        load_plugin(plugin, "--reasoning-parser-plugin")
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {', '.join(REASONING_PARSERS)}"
                         f"{'' if plugin else ' (a --reasoning-parser-plugin file may register more)'}.")
    return REASONING_PARSERS[name]


class ReasoningStream:
    """One choice's streamed text split as it comes: ('reasoning', piece) until the end marker,
    then ('content', piece); a marker cut between pieces is held back until it is whole."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text, self.sent = "", 0
        self.in_reasoning: bool | None = None       # undecided until the output's start is seen

    def feed(self, piece: str, final: bool = False) -> list[tuple[str, str]]:
        self.text += piece
        p, out = self.parser, []
        if self.in_reasoning is None and not p.thinking:
            self.in_reasoning = False
        if self.in_reasoning is None:
            body = self.text.lstrip()
            if not final and (not body or (p.start.startswith(body) and body != p.start)):
                return out                       # could still be the start marker
            if body.startswith(p.start):
                self.in_reasoning, self.sent = True, len(self.text) - len(body) + len(p.start)
            else:
                self.in_reasoning = p.unclosed_is_reasoning
        if self.in_reasoning:
            end = self.text.find(p.end, self.sent)
            if end < 0:
                keep = 0 if final else cut_marker_length(self.text, p.end)
                upto = len(self.text) - keep
                if upto > self.sent:
                    out.append(("reasoning", self.text[self.sent:upto]))
                    self.sent = upto
                return out
            if end > self.sent:
                out.append(("reasoning", self.text[self.sent:end]))
            self.in_reasoning, self.sent = False, end + len(p.end)
        if len(self.text) > self.sent:
            out.append(("content", self.text[self.sent:]))
            self.sent = len(self.text)
        return out
