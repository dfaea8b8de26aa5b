"""Proposers with a model of their own: a draft model (method "draft_model") and an EAGLE head
(method "eagle"). Both propose greedily, so the draft distribution is one-hot, which is what
spec_decode/verify.py's rule needs to stay exact.

The proposer's model runs whole on the rank that samples (parallel_state.alone(): its own
one-rank groups, so it never joins the target's collectives), with a KV cache of its own in the
target's block layout: the same block ids and slots. It computes every position the target
computes (follow), so its cache holds whatever the target's holds, through chunked prefill,
prefix-cache hits and preemption, with no bookkeeping of its own. Under context parallel the
target spreads a block id's positions over its ranks; the proposer, on one rank, holds them all
(blocks of kv_block_tokens) and attends with an unsharded backend and metadata of its own.

To propose, it decodes from each request's newest position. Those positions are not the
request's yet (the next step verifies them), so it writes them into scratch blocks of its own
cache: the request's block table up to the block of the newest token, then scratch blocks, the
first a copy of that partly filled block.
"""

from __future__ import annotations

import torch

from shardlm.attention.selector import get_attention_backend
from shardlm.config import EngineConfig
from shardlm.distributed.parallel_state import alone
from shardlm.layers.attention import Attention
from shardlm.logger import init_logger
from shardlm.model_loader.weights import load_model
from shardlm.models.llama import prepare_fused_decode
from shardlm.models.registry import get_model_class
from shardlm.spec_decode.proposer import ProposalRequest, Proposer, TargetStep
from shardlm.utils import cdiv

logger = init_logger(__name__)


class ModelProposer(Proposer):
    def __init__(self, config: EngineConfig, device: torch.device, attn_backend, model: torch.nn.Module):
        self.k = config.speculative.num_speculative_tokens
        self.device = device
        self.block_size = config.kv_block_tokens        # a block id's tokens on every context parallel rank
        self.own_layout = attn_backend.shard is not None
        self.backend = (get_attention_backend(config, device, self.block_size) if self.own_layout
                        else attn_backend)
        self.max_model_len = config.model.max_model_len
        self.max_rows = config.scheduler.max_num_seqs
        self.dtype = config.model.dtype
        self.enforce_eager = config.model.enforce_eager
        self.model = model
        self.attention = [m for m in model.modules() if isinstance(m, Attention)]
        # scratch blocks per request: the newest token's block (a copy) and what k more positions need
        self.scratch_per_row = cdiv(self.block_size - 1 + self.k, self.block_size)
        logger.info("Speculative decoding: %s %s (%d layers) proposes %d tokens a step", config.speculative.method,
                    config.speculative.draft_model_config.model, len(self.attention), self.k)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def kv_cache_bytes_per_block(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(self.block_size * a.cache_values_per_token() * size for a in self.attention)

    def initialize_cache(self, num_blocks: int) -> None:
        """num_blocks: the target's; the scratch blocks come after them."""
        self.first_scratch = num_blocks
        total = num_blocks + self.max_rows * self.scratch_per_row
        for attn in self.attention:
            shape = self.backend.kv_cache_shape(total, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = (attn.k_cache[..., :attn.v_head_dim] if attn.values_in_keys      # latent attention
                            else torch.zeros(shape, dtype=self.dtype, device=self.device))
            attn.backend = self.backend
        with alone():           # the draft's own decode steps in one C call too, where they apply (CPU)
            prepare_fused_decode(self.model, not self.enforce_eager)

    def release_cache(self) -> None:
        for attn in self.attention:
            attn.k_cache = attn.v_cache = None

    def metadata(self, step: TargetStep):
        """The attention metadata of the step the proposer follows: the target's, or under context
        parallel (whose metadata lays each sequence over ranks) its own, of whole blocks."""
        if not self.own_layout:
            return step.meta
        return self.backend.build_metadata([len(c.token_ids) for c in step.chunks],
                                           [c.start_pos for c in step.chunks],
                                           [c.block_tables[0] for c in step.chunks])

    def _rows(self, requests: list[ProposalRequest]) -> list[ProposalRequest]:
        # a request this close to max_model_len gets none: its proposals could not all be verified
        return [r for r in requests if r.last_position + r.num_wanted < self.max_model_len][:self.max_rows]

    def _decode(self, rows: list[ProposalRequest], tokens: torch.Tensor, hidden: torch.Tensor | None,
                steps: int) -> list[torch.Tensor]:
        """`steps` greedy decode steps of every row from its newest position on (row i's input
        there: tokens[i], and hidden[i] for an EAGLE head), in scratch blocks. -> the tokens chosen
        at each step, [rows] each."""
        if steps == 0:
            return []
        tables, copy_from, copy_to = [], [], []
        for i, r in enumerate(rows):
            first = r.last_position // self.block_size
            scratch = list(range(self.first_scratch + i * self.scratch_per_row,
                                 self.first_scratch + (i + 1) * self.scratch_per_row))
            tables.append(r.block_ids[:first] + scratch)
            if r.last_position % self.block_size:          # the block holds earlier positions too
                copy_from.append(r.block_ids[first])
                copy_to.append(scratch[0])
        if copy_from:
            src = torch.tensor(copy_from, device=self.device)
            dst = torch.tensor(copy_to, device=self.device)
            for attn in self.attention:
                self.backend.copy_blocks(attn.k_cache, src, dst)
                if not attn.values_in_keys:
                    self.backend.copy_blocks(attn.v_cache, src, dst)
        chosen = []
        with alone():
            for j in range(steps):
                positions = [r.last_position + j for r in rows]
                meta = self.backend.build_metadata([1] * len(rows), positions, tables)
                hidden, tokens = self._step(tokens, torch.tensor(positions, device=self.device), meta, hidden)
                chosen.append(tokens)
        return chosen

    def _step(self, tokens, positions, meta, hidden) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One decode step of the proposer's model -> (the hidden state its next step reads, if any;
        the token it chooses at each row)."""
        raise NotImplementedError


class DraftModelProposer(ModelProposer):
    """A smaller model of the target's tokenizer: it prefills and decodes what the target does,
    then decodes k tokens of its own from each request's newest token."""

    def __init__(self, config: EngineConfig, device: torch.device, attn_backend):
        with alone():
            draft = config.speculative.draft_model_config
            model = load_model(get_model_class(draft.architecture, None, draft.model_impl), draft, device)
        super().__init__(config, device, attn_backend, model)

    def follow(self, step: TargetStep) -> None:
        with alone():
            self.model(step.input_ids, step.positions, self.metadata(step))

    def propose(self, requests: list[ProposalRequest]) -> dict[str, list[int]]:
        rows = self._rows(requests)
        if not rows:
            return {}
        tokens = torch.tensor([r.output_token_ids[-1] for r in rows], device=self.device)
        drafts = torch.stack(self._decode(rows, tokens, None, max(r.num_wanted for r in rows)), dim=1).tolist()
        return {r.req_id: d[:r.num_wanted] for r, d in zip(rows, drafts)}

    def _step(self, tokens, positions, meta, hidden):
        return None, self.model.compute_logits(self.model(tokens, positions, meta)).argmax(dim=-1)
