"""The engine core's side of structured outputs: a matcher per constrained request, compiled in
a background thread, advanced with the tokens the request keeps, and the bitmask of each step.

A request waits (without holding the others) until its matcher is compiled. Its matcher
follows exactly the request's output tokens, which preemption and recompute never drop, so it
needs no rollback. Grammars are cached by their specification; the tokenizer is read once.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache

import numpy as np

from shardlm.logger import init_logger
from shardlm.sampling_params import StructuredOutputsParams
from shardlm.structured_output.grammar import check
from shardlm.utils import cdiv

logger = init_logger(__name__)


@lru_cache(maxsize=256)
def _cached_grammar(spec: str) -> str:
    return check(StructuredOutputsParams(**json.loads(spec)))


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str, vocab_size: int):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.words = cdiv(vocab_size, 32)        # int32 words per bitmask row
        self._tokenizer = None                   # llguidance's view of the tokenizer, built once
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardlm-grammar")

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The request's matcher, compiled off the step loop."""
        return self._pool.submit(self._matcher, params)

    def _matcher(self, params: StructuredOutputsParams):
        import llguidance
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer
            hf = AutoTokenizer.from_pretrained(self.tokenizer_path)
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=max(self.vocab_size, len(hf)))
        spec = json.dumps({k: v for k, v in vars(params).items() if v is not None}, sort_keys=True)
        matcher = llguidance.LLMatcher(self._tokenizer, _cached_grammar(spec))
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def bitmask(self, matchers: list) -> bytes:
        """Rows of allowed tokens (bit t of row i: token t is allowed for matchers[i]), int32 words."""
        mask = np.zeros((len(matchers), self.words), dtype=np.int32)
        for i, matcher in enumerate(matchers):
            row = mask[i]
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return mask.tobytes()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def accept(matcher, token: int) -> str | None:
    """Advance the matcher by a token the request keeps. -> None, or why the request must end:
    'done' when the constraint is complete, or the matcher's error."""
    if not matcher.consume_token(token) or matcher.is_error():
        return matcher.get_error() or f"token {token} does not match the constraint"
    return "done" if matcher.is_stopped() else None
