"""What the model runner asks of a proposer, and which one a config makes.

The rank that samples owns the proposer (made by selector.py). Every step it shows the proposer
the tokens the target computed (follow); after sampling, it asks for the next tokens of the
requests just sampled (propose). A proposer with a model keeps its own KV cache, in the
target's block layout (kv_cache_bytes_per_block, initialize_cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ProposalRequest:
    """A request just sampled: its tokens so far (the last one new) and its KV blocks."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    num_wanted: int                      # propose at most this many (its lookahead: at most k)

    @property
    def last_position(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - 1


@dataclass
class TargetStep:
    """What the target computed in a step, for a proposer to follow: the tokens, positions and
    attention metadata of every chunk, its final hidden states, and the new tokens of each request
    it sampled."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: object
    hidden: torch.Tensor                 # [tokens, hidden size]
    chunks: list                         # ScheduledChunk, in the tokens' order
    sampled: dict[str, list[int]]        # req_id -> its new tokens (accepted proposals, then one)
    requests: dict                       # req_id -> the runner's RequestState (prompt and output tokens)
    aux_hidden: torch.Tensor | None = None     # EAGLE-3: the target's residual streams at its aux layers

    def next_token_ids(self) -> tuple[list[int], dict[str, int]]:
        """-> the token after each of the step's tokens, and the row of each sampled request's last
        accepted position (the row whose next token is the newly sampled one). Rows past it, of
        rejected proposals, get the next proposal: the next step computes those positions again."""
        next_ids, last_row, row = [], {}, 0
        for c in self.chunks:
            following = list(c.token_ids[1:])
            new = self.sampled.get(c.req_id)
            if new:
                following.append(new[-1])
                last = len(c.token_ids) - 1 - c.num_draft_tokens + len(new) - 1
                following[last] = new[-1]
                last_row[c.req_id] = row + last
            else:                        # a prompt chunk that does not end the prompt
                state = self.requests[c.req_id]
                end = c.start_pos + len(c.token_ids) - len(state.prompt_token_ids)
                following.append(state.prompt_token_ids[end] if end < 0 else state.output_token_ids[end])
            next_ids.extend(following)
            row += len(c.token_ids)
        return next_ids, last_row


class Proposer:
    def follow(self, step: TargetStep) -> None:
        """The target just computed (and sampled) this step: keep up with it."""

    def propose(self, requests: list[ProposalRequest]) -> dict[str, list[int]]:
        """Up to k proposed tokens per request (requests left out: none)."""
        raise NotImplementedError

    def forget(self, req_id: str) -> None:
        """The request finished."""

    def kv_cache_bytes_per_block(self) -> int:
        return 0

    def initialize_cache(self, num_blocks: int) -> None:
        pass

    def release_cache(self) -> None:
        """Drop the KV cache (after CUDA memory profiling: it is made again at its real size)."""

    def weight_bytes(self) -> int:
        return 0
