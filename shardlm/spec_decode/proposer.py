"""What the model runner asks of a proposer, and which one a config makes.

The rank that samples owns the proposer. Every step it shows the proposer the tokens the
target computed (follow); after sampling, it asks for the next tokens of the requests just
sampled (propose). A proposer with a model keeps its own KV cache, in the target's block
layout (kv_cache_bytes_per_block, initialize_cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm.config import EngineConfig


@dataclass
class ProposalRequest:
    """A request just sampled: its tokens so far (the last one new) and its KV blocks."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]

    @property
    def last_position(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - 1


class Proposer:
    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        """The target just computed these tokens (its attention metadata): keep up with it."""

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


def make_proposer(config: EngineConfig, device: torch.device, attn_backend) -> Proposer | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from shardlm.spec_decode.ngram import NgramProposer
        return NgramProposer(spec)
    from shardlm.spec_decode.draft_model import DraftModelProposer
    return DraftModelProposer(config, device, attn_backend)
