"""Prompt lookup: propose the tokens that followed the last earlier occurrence of the request's
final n tokens (n from prompt_lookup_max down to prompt_lookup_min), in its prompt or output.

Free to run (no model), and right often on input-grounded work: editing, summarizing, code,
answers quoting a passage. When nothing matches, nothing is proposed and the request decodes
one token as usual.
"""

from __future__ import annotations

import numpy as np

from shardlm.config import SpeculativeConfig
from shardlm.spec_decode.proposer import ProposalRequest, Proposer


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max
        self._tokens: dict[str, np.ndarray] = {}     # req_id -> its tokens (a growing buffer)
        self._lengths: dict[str, int] = {}

    def propose(self, requests: list[ProposalRequest]) -> dict[str, list[int]]:
        out = {}
        for r in requests:
            drafts = propose_ngram(self._history(r.req_id, r.prompt_token_ids, r.output_token_ids),
                                   self.n_min, self.n_max, min(self.k, r.num_wanted))
            if drafts:
                out[r.req_id] = drafts
        return out

    def forget(self, req_id: str) -> None:
        self._tokens.pop(req_id, None)
        self._lengths.pop(req_id, None)

    def _history(self, req_id: str, prompt: list[int], output: list[int]) -> np.ndarray:
        """The request's tokens as an array, appending only what is new since the last call."""
        total = len(prompt) + len(output)
        buf, have = self._tokens.get(req_id), self._lengths.get(req_id, 0)
        if buf is None or have < len(prompt):
            buf, have = np.empty(max(64, 2 * total), dtype=np.int64), 0
            buf[:len(prompt)] = prompt
            have = len(prompt)
        if total > len(buf):
            buf = np.concatenate([buf[:have], np.empty(total, dtype=np.int64)])
        buf[have:total] = output[have - len(prompt):]
        self._tokens[req_id], self._lengths[req_id] = buf, total
        return buf[:total]


def propose_ngram(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` (n_min <= length <= n_max) that occurred before; [] when none did.

    One pass finds where the last token occurred before (the candidates: an occurrence must end
    there and be followed by a token); then each candidate's match is extended backwards."""
    length = len(tokens)
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    if not ends.size:
        return []
    matched = np.ones(len(ends), dtype=np.int64)        # suffix tokens each candidate matches so far
    alive = np.ones(len(ends), dtype=bool)
    for d in range(1, min(n_max, length - 1)):
        before = ends - d
        alive &= before >= 0
        alive[alive] = tokens[before[alive]] == tokens[length - 1 - d]
        if not alive.any():
            break
        matched += alive
    best = matched.max()
    if best < n_min:
        return []
    follow = ends[np.flatnonzero(matched == best)[-1]] + 1
    return tokens[follow:follow + k].tolist()
