"""From logits to next tokens: penalties, temperature, top-k/top-p/min-p, seeded sampling,
and logprobs: of the raw model output, or (--logprobs-mode, as vLLM's) the raw logits, or the
logprobs or logits after every processor (constraints, biases, penalties, bans, temperature,
top-k/top-p/min-p), what the token was drawn from.

Random sampling inverts each row's cumulative distribution at one uniform draw, which draws
exactly from p (up to float64 rounding of the sums); a request with a seed draws its uniform
from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardlm.kernels import DTYPE_CODES, fused_ops
from shardlm.layers.custom_op import CustomOp
from shardlm.outputs import TokenLogprobs


@dataclass
class SamplingBatch:
    temperature: torch.Tensor | None          # [B], None when every row is greedy
    greedy: torch.Tensor | None               # [B] bool
    top_k: torch.Tensor | None = None         # [B] int, vocab size where unused
    top_p: torch.Tensor | None = None         # [B] float
    min_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] | None = None
    penalties: tuple | None = None            # (presence, frequency, repetition [B], prompt lists, output lists)
    banned: list[tuple[int, list[int]]] | None = None   # (row, token ids) not allowed yet (min_tokens)
    # (row, logit_bias {id: bias} or None, allowed_token_ids or None), rows that have either
    biases: list[tuple[int, dict[int, float] | None, list[int] | None]] | None = None
    logprobs_k: list[int | None] | None = None          # per row; None: not asked
    allowed: TokenBitmask | None = None       # structured outputs: the tokens constrained rows may take
    # custom logits processors (logits_processor.py): those that may change the argmax (run before the
    # penalties, on every row) and those that may not (after temperature, on the random rows' logits)
    processors_first: list | None = None
    processors_after_temperature: list | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of its raw logits (no penalties, bans, biases, constraints or logprobs)."""
        return (self.temperature is None and self.penalties is None and not self.banned and not self.biases
                and self.allowed is None and not self.processors_first
                and not (self.logprobs_k and any(k is not None for k in self.logprobs_k)))


class Sampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs"):
        self.argmax_rows = ArgmaxRows()
        self.logprobs_mode = logprobs_mode

    def values(self, logits: torch.Tensor) -> torch.Tensor:
        """What logprobs report of these logits (float32): the logits themselves in a *_logits
        mode, else their log-softmax."""
        logits = logits.float()
        return logits if self.logprobs_mode.endswith("_logits") else torch.log_softmax(logits, dim=-1)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch):
        """logits [B, V] -> (token ids [B] list, {row: TokenLogprobs})."""
        reported = None
        wanted = batch.logprobs_k and any(k is not None for k in batch.logprobs_k)
        if wanted and self.logprobs_mode.startswith("raw"):
            reported = self.values(logits)
        elif batch.plain_greedy:
            return self.argmax_rows(logits).tolist(), {}   # all greedy: no copy for penalties or bans needed
        logits = logits.float()
        if batch.allowed is not None:           # first: every other step sees only allowed tokens
            logits = apply_allowed(logits, batch.allowed)
        if batch.biases:
            logits = apply_biases(logits, batch.biases)
        if batch.processors_first:
            if not batch.biases and batch.allowed is None:
                logits = logits.clone()   # processors may write in place: never into the caller's logits
            for processor in batch.processors_first:
                logits = processor.apply(logits)
        if batch.penalties is not None:
            logits = apply_penalties(logits, *batch.penalties)
        if batch.banned:
            logits = logits.clone()   # never write into the caller's logits
            for row, ids in batch.banned:
                logits[row, ids] = float("-inf")
        sampled = self.argmax_rows(logits)
        scaled = scaled_and_filtered(logits, batch)     # what random rows draw from (once: processors run once)
        if batch.temperature is not None:
            sampled = torch.where(batch.greedy, sampled, sample_random(scaled, batch))
        tokens = sampled.tolist()
        if wanted and reported is None:
            reported = self.values(processed_logits(scaled, batch))
        logprobs = {}
        if reported is not None:
            for row, k in enumerate(batch.logprobs_k):
                if k is not None:
                    logprobs[row] = token_logprobs(reported[row], tokens[row], k)
        return tokens, logprobs


class ArgmaxRows(CustomOp):
    """torch.argmax(x, dim=-1) of a [T, V] tensor."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().argmax(dim=-1)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """One C call with the rows in parallel (torch's argmax runs on one thread, and on
        bfloat16 slowly)."""
        if x.dtype not in DTYPE_CODES or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
            return self.forward_native(x)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        fused_ops().argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], DTYPE_CODES[x.dtype], out.data_ptr())
        return out


def completing_bad_words(output: list[int], sequences: list[list[int]]) -> list[int]:
    """The tokens that would complete a bad word now: each sequence's last token where the output
    ends with the rest of it (a one-token word: always)."""
    return [seq[-1] for seq in sequences
            if len(seq) == 1 or (len(output) >= len(seq) - 1 and output[len(output) - len(seq) + 1:] == seq[:-1])]


def token_logprobs(row_logprobs: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    lp = row_logprobs[token]
    rank = int((row_logprobs > lp).sum()) + 1
    top = row_logprobs.topk(k) if k else None
    return TokenLogprobs(token, float(lp), rank, top.indices.tolist() if k else [],
                         top.values.tolist() if k else [])


@dataclass
class TokenBitmask:
    """Structured outputs' allowed tokens: rows of the batch and, per row, int32 words in which bit
    b of word w allows token 32w + b; the logits' column 0 is token first_token (a shard's start)."""
    rows: torch.Tensor          # [R] long
    words: np.ndarray           # [R, W] int32
    first_token: int = 0        # the logits' column 0 is this token (a vocabulary shard's start)

    def rows_between(self, start: int, end: int) -> TokenBitmask | None:
        """The mask of rows start..end-1 alone, numbered from 0 (None when none is constrained)."""
        keep = ((self.rows >= start) & (self.rows < end)).cpu().numpy()
        if not keep.any():
            return None
        return TokenBitmask(self.rows[torch.from_numpy(keep).to(self.rows.device)] - start, self.words[keep],
                            self.first_token)


class MaskDisallowed(CustomOp):
    """x[rows, v] = -inf for every token the bitmask does not allow, in place (x float32 [B, V])."""

    def forward_native(self, x: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
        V, R = x.shape[1], len(mask.rows)
        bits = np.unpackbits(mask.words.view(np.uint8), axis=1, bitorder="little").view(np.bool_)
        allowed = np.zeros((R, V), dtype=bool)
        have = max(0, min(mask.first_token + V, bits.shape[1]) - mask.first_token)
        allowed[:, :have] = bits[:, mask.first_token:mask.first_token + have]
        x[mask.rows] = x[mask.rows].masked_fill(~torch.from_numpy(allowed).to(x.device), float("-inf"))
        return x

    def forward_cpu(self, x: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
        """One C call, writing only where a word is not all allowed (the torch path unpacks every
        bit and gathers and scatters the rows: 10 ms for 64 rows of 49k tokens)."""
        if x.dtype != torch.float32 or x.stride(1) != 1:
            return self.forward_native(x, mask)
        rows = mask.rows.contiguous()
        words = np.ascontiguousarray(mask.words)
        fused_ops().mask_disallowed(x.data_ptr(), x.stride(0), rows.data_ptr(), len(rows), x.shape[1],
                                    words.ctypes.data, words.shape[1], mask.first_token)
        return x


_mask_disallowed = MaskDisallowed()


def apply_allowed(logits: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """float32 logits with -inf for every token a structured-output row does not allow (a new
    tensor: the caller's logits are not written)."""
    out = logits.float()
    return _mask_disallowed(out.clone() if out is logits else out, mask)


def apply_biases(logits: torch.Tensor, biases) -> torch.Tensor:
    """allowed_token_ids: every other token gets -inf; logit_bias: added to its token's logit
    (OpenAI's semantics, before penalties and temperature)."""
    logits = logits.clone()   # never write into the caller's logits
    for row, bias, allowed in biases:
        if allowed is not None:
            keep = torch.full_like(logits[row], float("-inf"))
            keep[torch.tensor(allowed, device=logits.device)] = 0.0
            logits[row] += keep
        if bias:
            ids = torch.tensor(list(bias), device=logits.device)
            logits[row].index_add_(0, ids, torch.tensor(list(bias.values()), device=logits.device,
                                                         dtype=logits.dtype))
    return logits


def apply_penalties(logits, presence, frequency, repetition, prompt_ids, output_ids):
    B, V = logits.shape
    out_counts = torch.zeros(B, V, device=logits.device)
    seen = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
    for row in range(B):
        if output_ids[row]:
            ids = torch.tensor(output_ids[row], device=logits.device)
            out_counts[row].index_add_(0, ids, torch.ones(len(ids), device=logits.device))
        if prompt_ids[row]:
            seen[row, prompt_ids[row]] = True
    seen |= out_counts > 0
    rep = repetition[:, None].expand(B, V)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * out_counts - presence[:, None] * (out_counts > 0)
    return logits


def scaled_and_filtered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature (1 for greedy rows), the argmax-invariant processors, and top-k/top-p applied:
    what random rows draw from."""
    if batch.temperature is None:         # every row greedy
        return logits
    temp = torch.where(batch.greedy, torch.ones_like(batch.temperature), batch.temperature)
    logits = logits / temp[:, None]
    for processor in batch.processors_after_temperature or ():
        logits = processor.apply(logits)
    if batch.top_k is not None or batch.top_p is not None:
        logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
    return logits


def _below_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    return probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values


def processed_logits(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits after every processor, min-p's cut as -inf (the processed logprobs modes);
    scaled: scaled_and_filtered's."""
    logits = scaled
    if batch.temperature is not None and batch.min_p is not None:
        logits = logits.masked_fill(_below_min_p(torch.softmax(logits, dim=-1), batch.min_p), float("-inf"))
    return logits


def sample_random(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """scaled: scaled_and_filtered's logits. Inverse transform sampling: a row's token is the
    first whose cumulative probability passes u x the row's total, u uniform in [0, 1). One random
    number a row, where the exponential race (argmax of p / Exp(1), vLLM's) draws one a token:
    at 64 rows of a 49,152-token vocabulary 3.5 ms instead of 63 on a 2-core Zen 4, and a seeded
    row 0.01 ms instead of 1. Sums in float64, so the last tokens' intervals keep their width."""
    probs = torch.softmax(scaled, dim=-1)
    if batch.min_p is not None:
        probs = torch.where(_below_min_p(probs, batch.min_p), 0.0, probs)
    cumulative = probs.to(torch.float64).cumsum(dim=-1)
    uniform = torch.rand(len(probs), 1, dtype=torch.float64, device=probs.device)
    for row, gen in (batch.generators or {}).items():
        uniform[row] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=gen)
    # right=True: the first token whose sum exceeds the target, so never one of probability 0; a
    # target is below the total (u <= 1 - 2^-53 takes at least half a unit in the last place off
    # it, and rounds down unless the total is a power of two, where the product is exact)
    tokens = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True).squeeze(1)
    # a row of infinite logits (a repetition penalty of 5e-324 divides by it) has no probabilities
    # to sum: it takes its largest logit, as the exponential race's argmax did
    no_sum = cumulative[:, -1].isnan()
    if no_sum.any():
        tokens = torch.where(no_sum, scaled.argmax(dim=-1), tokens)
    return tokens


def _top_k_top_p(logits, top_k, top_p):
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= torch.arange(V, device=logits.device)[None, :] >= top_k[:, None]
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
