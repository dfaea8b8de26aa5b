"""methods "eagle", "eagle3" and "mtp": an EAGLE head (models/eagle.py, models/eagle3.py) or
DeepSeek-V3's multi-token-prediction layer (models/deepseek_mtp.py, EAGLE's shape) proposes from
the target's hidden states.

follow runs the head over every position the target computed this step, each with the token
after it (the newly sampled token after the last accepted position) and the target's hidden
state there (EAGLE-3: its residual streams at three layers, mixed by the head's fc); the head's
output at each request's last accepted position gives its first proposal. Then k - 1 greedy
steps of the head alone, each fed its own previous hidden state.
"""

from __future__ import annotations

import torch

from shardlm.config import EngineConfig
from shardlm.distributed.parallel_state import alone
from shardlm.models.deepseek_mtp import load_deepseek_mtp
from shardlm.models.eagle import load_eagle
from shardlm.models.eagle3 import aux_layers_of, load_eagle3
from shardlm.spec_decode.draft_model import ModelProposer
from shardlm.spec_decode.proposer import ProposalRequest, TargetStep


class EagleProposer(ModelProposer):
    def __init__(self, config: EngineConfig, device: torch.device, attn_backend):
        spec = config.speculative
        with alone():
            if spec.method == "mtp":
                model = load_deepseek_mtp(config.model, device)
            elif spec.method == "eagle3":
                aux = aux_layers_of(spec.draft_model_config.hf_config, config.model.num_layers)
                model = load_eagle3(spec.draft_model_config, config.model, len(aux), device)
            else:
                model = load_eagle(spec.draft_model_config, config.model, device)
        super().__init__(config, device, attn_backend, model)
        self.eagle3 = spec.method == "eagle3"
        self._hidden: torch.Tensor | None = None          # what the head's next step reads, per position
        self._first: torch.Tensor | None = None           # the head's choice at each position
        self._last_row: dict[str, int] = {}                # req_id -> its last accepted position's row

    def follow(self, step: TargetStep) -> None:
        next_ids, self._last_row = step.next_token_ids()
        rows = torch.tensor(list(self._last_row.values()), dtype=torch.long, device=self.device)
        with alone():
            target_hidden = self.model.combine(step.aux_hidden) if self.eagle3 else step.hidden
            self._hidden, tokens = self._step(torch.tensor(next_ids, device=self.device), step.positions,
                                              self.metadata(step), target_hidden, rows)
        self._first = dict(zip(self._last_row, tokens.tolist()))

    def propose(self, requests: list[ProposalRequest]) -> dict[str, list[int]]:
        rows = self._rows(requests)
        if not rows:
            return {}
        hidden = self._hidden[torch.tensor([self._last_row[r.req_id] for r in rows], device=self.device)]
        first = torch.tensor([self._first[r.req_id] for r in rows], device=self.device)
        steps = max(r.num_wanted for r in rows) - 1
        drafts = torch.stack([first, *self._decode(rows, first, hidden, steps)], dim=1).tolist()
        return {r.req_id: d[:r.num_wanted] for r, d in zip(rows, drafts)}

    def _step(self, tokens, positions, meta, hidden, rows=None):
        """rows: score only these rows (follow: the requests' last accepted positions)."""
        if rows is not None and not len(rows):
            hidden = self.model(tokens, positions, meta, hidden)
            return (hidden[1] if self.eagle3 else hidden), tokens[:0]
        if self.eagle3:
            normed, hidden = self.model(tokens, positions, meta, hidden)
            scored = normed if rows is None else normed[rows]
            return hidden, self.model.target_tokens(scored)
        hidden = self.model(tokens, positions, meta, hidden)
        scored = hidden if rows is None else hidden[rows]
        return hidden, self.model.compute_logits(scored).argmax(dim=-1)
