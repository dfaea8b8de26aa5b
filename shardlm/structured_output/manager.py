"""The engine core's side of structured outputs: a matcher per constrained request, compiled in
a background thread, advanced with the tokens the request keeps, and the bitmask of each step.

A request waits (without holding the others) until its matcher is compiled. Its matcher
follows exactly the request's output tokens, which preemption and recompute never drop, so it
needs no rollback. Grammars are cached by their specification; the tokenizer is read once.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from shardlm.logger import init_logger
from shardlm.reasoning import get_reasoning_parser
from shardlm.structured_output.grammar import GrammarCompiler
from shardlm.utils import cdiv

logger = init_logger(__name__)


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str, vocab_size: int, reasoning_parser: str | None = None,
                 trust_remote_code: bool = False, reasoning_parser_plugin: str | None = None):
        """reasoning_parser: a reasoning model's (shardlm/reasoning.py; its plugin file, if any):
        constraints then apply from the end of its thinking on."""
        self.words = cdiv(vocab_size, 32)        # int32 words per bitmask row
        self.compiler = GrammarCompiler(tokenizer_path, vocab_size, trust_remote_code)
        self.reasoning = get_reasoning_parser(reasoning_parser, reasoning_parser_plugin) if reasoning_parser else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardlm-grammar")

    def compile(self, request) -> Future:
        """The request's matcher, compiled off the step loop (with its thinking_end_ids set first)."""
        return self._pool.submit(self._prepare, request)

    def _prepare(self, request):
        """request: a core Request (its sampling_params, prompt_token_ids, thinking_end_ids)."""
        matcher = self.compiler.matcher(request.sampling_params.structured_outputs)
        if self.reasoning is not None:
            tok = self.compiler.hf_tokenizer()
            start, end = (tok.encode(m, add_special_tokens=False) for m in (self.reasoning.start, self.reasoning.end))
            if not thinking_closed(request.prompt_token_ids, start, end):
                request.thinking_end_ids = end
        return matcher

    def bitmask(self, matchers: list[tuple]) -> bytes:
        """Rows of allowed tokens, int32 words (bit t: token t allowed): for each (matcher, drafts),
        one row at its current state and one after each proposed token (speculative decoding; the
        scheduler kept only drafts the matcher allows), which it then takes back."""
        mask = np.zeros((sum(1 + len(drafts) for _, drafts in matchers), self.words), dtype=np.int32)
        i = 0
        for matcher, drafts in matchers:
            for j in range(len(drafts) + 1):
                row = mask[i]
                matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
                i += 1
                if j < len(drafts):
                    matcher.consume_token(drafts[j])
            if drafts:
                matcher.rollback(len(drafts))
        return mask.tobytes()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def thinking_closed(prompt: list[int], start: list[int], end: list[int]) -> bool:
    """The prompt closes the thinking it opens, or ends by closing it (a template with thinking
    turned off: Qwen3's empty <think></think>, DeepSeek-V3.1's bare </think>)."""
    def last(seq: list[int], before: int) -> int:
        for i in range(before - len(seq), -1, -1):
            if prompt[i:i + len(seq)] == seq:
                return i
        return -1
    opened = last(start, len(prompt))
    return prompt[len(prompt) - len(end):] == end or (opened >= 0 and last(end, len(prompt)) > opened)


def accept(matcher, token: int) -> str | None:
    """Advance the matcher by a token the request keeps. -> None, or why the request must end:
    'done' when the constraint is complete, or the matcher's error."""
    if not matcher.consume_token(token) or matcher.is_error():
        return matcher.get_error() or f"token {token} does not match the constraint"
    return "done" if matcher.is_stopped() else None
