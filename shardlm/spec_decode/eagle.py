"""method "eagle": an EAGLE head (models/eagle.py) proposes from the target's hidden states.

follow runs the head over every position the target computed this step, each with the token
after it (the newly sampled token after the last accepted position) and the target's hidden
state there; the head's output at each request's last accepted position gives its first
proposal. Then k - 1 greedy steps of the head alone, each fed its own previous output.
"""

from __future__ import annotations

import torch

from shardlm.config import EngineConfig
from shardlm.distributed.parallel_state import alone
from shardlm.models.eagle import load_eagle
from shardlm.spec_decode.draft_model import ModelProposer
from shardlm.spec_decode.proposer import ProposalRequest, TargetStep


class EagleProposer(ModelProposer):
    def __init__(self, config: EngineConfig, device: torch.device, attn_backend):
        with alone():
            model = load_eagle(config.speculative.draft_model_config, config.model, device)
        super().__init__(config, device, attn_backend, model)
        self._hidden: torch.Tensor | None = None          # the head's output at this step's positions
        self._last_row: dict[str, int] = {}                # req_id -> its last accepted position's row

    def follow(self, step: TargetStep) -> None:
        next_ids, self._last_row = step.next_token_ids()
        with alone():
            self._hidden = self.model(torch.tensor(next_ids, device=self.device), step.positions, step.meta,
                                      step.hidden)

    def propose(self, requests: list[ProposalRequest]) -> dict[str, list[int]]:
        rows = self._rows(requests)
        if not rows:
            return {}
        hidden = self._hidden[torch.tensor([self._last_row[r.req_id] for r in rows], device=self.device)]
        with alone():
            first = self.model.compute_logits(hidden).argmax(dim=-1)
        steps = max(r.num_wanted for r in rows) - 1
        drafts = torch.stack([first, *self._decode(rows, first, hidden, steps)], dim=1).tolist()
        return {r.req_id: d[:r.num_wanted] for r, d in zip(rows, drafts)}

    def _forward(self, tokens, positions, meta, hidden):
        return self.model(tokens, positions, meta, hidden)
