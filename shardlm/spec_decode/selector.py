"""Which proposer a speculative config makes (on the rank that samples)."""

from __future__ import annotations

import torch

from shardlm.config import EngineConfig
from shardlm.spec_decode.proposer import Proposer


def make_proposer(config: EngineConfig, device: torch.device, attn_backend) -> Proposer | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from shardlm.spec_decode.ngram import NgramProposer
        return NgramProposer(spec)
    if spec.method in ("eagle", "eagle3", "mtp"):
        from shardlm.spec_decode.eagle import EagleProposer
        return EagleProposer(config, device, attn_backend)
    from shardlm.spec_decode.draft_model import DraftModelProposer
    return DraftModelProposer(config, device, attn_backend)
