"""Incremental detokenization and stop strings.

Text is decoded from a short window of recent tokens: the window's text with and without
the newest tokens differ by exactly the new characters. While the newest tokens end in an
incomplete UTF-8 character (decoded as U+FFFD) nothing is emitted yet.
"""

from __future__ import annotations

# prompt tokens kept as left context, so the first output token decodes with its leading space
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], ends_with_stop_token: bool = False) -> str | None:
        """Add tokens; return the stop string if one now appears (the text is cut before it).
        ends_with_stop_token: the last one is the EOS or stop token id that ended the output, whose
        text is not shown (a special token kept, "</s>") unless include_stop_str_in_output, as in vLLM.
        Without a tokenizer (--skip-tokenizer-init) the text stays empty."""
        if self.tokenizer is None:
            return None
        if ends_with_stop_token and not self.include_stop:
            new_token_ids = new_token_ids[:-1]
        checked = len(self.output_text)
        for token in new_token_ids:
            self._ids.append(token)
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full = self._decode(self._ids[self._prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.output_text += full[len(prefix):]
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._find_stop(checked) if self.stop else None

    def _find_stop(self, checked: int) -> str | None:
        best = None
        for s in self.stop:
            # a match may start in the text seen before, so look back len(s) - 1 characters
            idx = self.output_text.find(s, max(0, checked - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.output_text = self.output_text[:idx + len(s) if self.include_stop else idx]
        return s

    def visible_text(self, finished: bool) -> str:
        """The text safe to show now: while running, hold back a tail that may begin a stop string."""
        if finished or not self.stop:
            return self.output_text
        text, hold = self.output_text, 0
        for s in self.stop:
            # the longest tail of the text that begins s: only where s's first character occurs
            tail = text[len(text) - min(len(s) - 1, len(text)):]
            i = tail.find(s[0])
            while i != -1 and len(tail) - i > hold:
                if s.startswith(tail[i:]):
                    hold = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return text[:len(text) - hold]
