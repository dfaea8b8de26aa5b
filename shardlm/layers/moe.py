"""The fused mixture-of-experts layer the MoE models share.

Experts are stored stacked: `w13` [E_local, 2 x I', H] (gate and up, one matmul per expert)
and `w2` [E_local, H, I']. Two ways to spread them over ranks:

- tensor parallel (the default, as vLLM): every rank holds every expert, sliced: I' = I/tp;
  each rank computes its slice for every token and the TP all-reduce sums them.
- expert parallel (`--enable-expert-parallel`): whole experts (I' = I) are placed on the ranks
  of the EP group, DP x TP of this stage; rank r holds a contiguous run of experts, the first
  E % ep ranks one more (6 experts on 4 ranks: 2, 2, 1, 1). Each rank runs its experts for every
  token routed to them and an all-reduce over the EP group sums the ranks' parts. With data
  parallel the replicas' tokens are first all-gathered across the DP group (so each replica's
  ranks see every token), and after the all-reduce each replica keeps its own rows. That is why
  DP + EP replicas must run every step together (see `dp_token_counts`, core/wave.py).

Dispatch has no loop over tokens: the (token, expert) pairs this rank serves are sorted by
expert once per step, each active expert runs its tokens as one matmul, and the results are
weighted and summed back into their tokens with one index_add.

`expert_load` counts the tokens of this replica routed to each expert (the imbalance is what
EP is tuned for). With EPLB (`redundant_experts`, worker/expert_balancer.py) the EP group has
E + R slots, (E + R) / ep per rank, each holding a logical expert (`slot_expert`); a token goes
to one copy of its expert, chosen by its index, and `rebalance` moves experts between ranks
(layers/expert_placement.py says where).

Experts read from an FP8 checkpoint stay FP8 on CPU: the loaders note each rank's scales as they
place the rows (as the linears do), and after loading each expert's w13 and w2 go into FP8 panels
(layers/fp8.py), stacked as one uint8 tensor per matrix so that EPLB moves them as it moves floats.
With `--quantization int8|int4` the experts are quantized at load as the linears are (quantize),
into 8- or 4-bit panels stacked the same way; with `--quantization fp8*` into FP8 panels (as
vLLM's online FP8 quantizes experts too), their scales agreed over the TP ranks as the linears'.
Float experts on CPU go, where the linears' weights do, into the blocked kernel's panels
(layers/cpu_matmul.py), stacked the same way: at a decode step's few rows torch's product reads
an expert's weight several times slower than the panels stream it.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.distributed.parallel_state import expert_parallel_enabled, get_dp_group, get_ep_group, get_tp_group
from shardlm.layers.activation import silu_and_mul
from shardlm.layers.cpu_matmul import blocked, goes_into_panels, pack_blocked
from shardlm.layers.expert_placement import balancedness, default_placement, place_experts_hierarchical
from shardlm.layers.fp8 import SCHEMES as FP8_SCHEMES
from shardlm.layers.fp8 import Fp8LinearWeight, from_scales, note_scales, packed_bytes, packs, quantize_fp8
from shardlm.layers.linear import load_slice
from shardlm.layers.quantization import QuantizedWeight, check_group_size, quantize_rtn
from shardlm.logger import init_logger

logger = init_logger(__name__)

# tokens of each DP replica in the current step, when the replicas run their MoE layers together
_dp_token_counts: list[int] | None = None
# EPLB: a placement is applied where it raises a layer's balancedness (mean/max) by at least this
MIN_BALANCE_GAIN = 0.05
# EPLB: redundant expert slots of the MoE layers built within redundant_experts() (None: no EPLB)
_num_redundant: list[int | None] = [None]


_logged: set[str] = set()


def _log_once(message: str) -> None:
    """A message about every MoE layer alike, logged for the first."""
    if message not in _logged:
        _logged.add(message)
        logger.info("FusedMoE: %s", message)


@contextmanager
def redundant_experts(n: int | None):
    """MoE layers built within this block have physical slots with n redundant ones under expert
    parallel, for EPLB to place (None: EPLB off)."""
    _num_redundant[0] = n
    try:
        yield
    finally:
        _num_redundant[0] = None


def replicas_in_lock_step() -> bool:
    """Whether this step's MoE layers gather the data parallel replicas' tokens (dp_token_counts)."""
    return _dp_token_counts is not None


@contextmanager
def dp_token_counts(counts: list[int] | None):
    """Within this block the MoE layers gather the replicas' tokens (counts[r] rows from replica r)."""
    global _dp_token_counts
    _dp_token_counts = counts
    try:
        yield counts
    finally:
        _dp_token_counts = None


def local_experts(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """(first expert, count) held by rank ep_rank: contiguous runs, the first E % ep ranks one more."""
    base, extra = divmod(num_experts, ep_size)
    return ep_rank * base + min(ep_rank, extra), base + (ep_rank < extra)


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert's gate and up halves combine. silu: silu(gate) * up (Mixtral, Qwen). With
    limit (GPT-OSS): gate clamped to at most limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    alpha: float = 1.0
    limit: float | None = None

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, bias: bool = False, activation: ExpertActivation = ExpertActivation()):
        """bias: each expert's gate/up and down products have biases (GPT-OSS)."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.activation = activation
        self.hidden_size = hidden_size
        self.dp = get_dp_group()
        self.slot_expert: list[int] | None = None      # EPLB: the logical expert of each physical slot
        self.num_redundant = 0
        if expert_parallel_enabled():
            self.reduce_group = get_ep_group()
            if num_experts < self.reduce_group.world_size:
                raise ValueError(f"Expert parallel over {self.reduce_group.world_size} ranks needs at least as "
                                 f"many experts; this model has {num_experts}. Leave out --enable-expert-parallel "
                                 "(tensor parallel then slices every expert) or use fewer ranks.")
            self.first_expert, self.num_local = local_experts(num_experts, self.reduce_group.world_size,
                                                              self.reduce_group.rank_in_group)
            self.inter, self.slice_rank = intermediate_size, 0
            self._place_redundant(_num_redundant[0])
        else:
            tp = self.reduce_group = get_tp_group()
            if intermediate_size % tp.world_size:
                raise ValueError(f"The experts' intermediate size {intermediate_size} is not divisible by tensor "
                                 f"parallel size {tp.world_size}: use --enable-expert-parallel (whole experts per "
                                 "rank) or a tensor parallel size that divides it.")
            self.first_expert, self.num_local = 0, num_experts
            self.inter, self.slice_rank = intermediate_size // tp.world_size, tp.rank_in_group
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden_size, self.inter), requires_grad=False)
        self.w13.weight_loader = self._load_w13
        self.w2.weight_loader = self._load_w2
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(self.num_local, 2 * self.inter), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)
        self.expert_load = torch.zeros(num_experts, dtype=torch.int64, device="cpu")
        self.routing = None       # the model's own routing (GroupedTopK), in place of route's softmax top-k
        self.dtype = self.w13.dtype
        # an FP8 checkpoint's scales of w13 / w2 as this rank loads them ([E_local, rows, groups], NaN:
        # not from FP8), then each expert's FP8 or 8/4-bit weights (their panels rows of w13 / w2, uint8)
        self.fp8_scales: dict[str, torch.Tensor | None] = {"w13": None, "w2": None}
        self.quantized: dict[str, list[Fp8LinearWeight | QuantizedWeight]] | None = None
        self.panels: dict[str, int] | None = None    # float experts in blocked panels: each matrix's rows
        # a quantized checkpoint's expert matrices as take_quantized keeps them, until use_quantized
        self._taken: dict[tuple[str, int], dict[int, tuple]] = {}
        self._taken_bits: dict[str, int] = {}     # w13 / w2: a GGUF's Q4_K_M has 4-bit gate/up, 6-bit down

    # ---- EPLB: physical slots ----
    def _place_redundant(self, num_redundant: int | None) -> None:
        if num_redundant is None:
            return
        self.num_redundant = num_redundant
        ep = self.reduce_group.world_size
        if (self.num_experts + num_redundant) % ep:
            raise ValueError(f"EPLB: {self.num_experts} experts + {num_redundant} redundant slots do not divide over "
                             f"{ep} expert parallel ranks: choose num_redundant_experts so that the sum is a "
                             f"multiple of {ep}.")
        self.num_local = (self.num_experts + num_redundant) // ep
        self.first_expert = self.reduce_group.rank_in_group * self.num_local      # this rank's first slot
        self.set_placement(default_placement(self.num_experts, num_redundant))

    def set_placement(self, slot_expert: list[int]) -> None:
        """Which logical expert each physical slot holds; a token routed to expert e goes to copy
        (token index mod copies of e)."""
        self.slot_expert = list(slot_expert)
        copies = [[s for s, e in enumerate(slot_expert) if e == expert] for expert in range(self.num_experts)]
        width = max(len(c) for c in copies)
        self.copy_slots = torch.tensor([c + c[:1] * (width - len(c)) for c in copies])
        self.copy_count = torch.tensor([len(c) for c in copies])

    def local_expert_ids(self) -> list[int]:
        """The logical expert of each of this rank's slots."""
        if self.slot_expert is None:
            return list(range(self.first_expert, self.first_expert + self.num_local))
        return self.slot_expert[self.first_expert:self.first_expert + self.num_local]

    # ---- loading: shard_id = (expert, 0 for gate / 1 for up) for w13, expert for w2 ----
    def _local(self, expert: int) -> list[int]:
        """Where global `expert` sits in this rank's stack (several slots with EPLB's copies);
        none when another rank holds it (its tensor is then never read from disk)."""
        return [i for i, e in enumerate(self.local_expert_ids()) if e == expert]

    def _load_w13(self, param, loaded, shard_id) -> None:
        expert, half = shard_id
        for local in self._local(expert):
            load_slice(param.data[local].narrow(0, half * self.inter, self.inter), loaded, 0,
                       self.slice_rank * self.inter, self.inter)
            self._note_fp8_scales("w13", loaded, local, half * self.inter, range(
                self.slice_rank * self.inter, (self.slice_rank + 1) * self.inter), range(self.hidden_size))

    def _load_w2(self, param, loaded, shard_id) -> None:
        for local in self._local(shard_id):
            load_slice(param.data[local], loaded, 1, self.slice_rank * self.inter, self.inter)
            self._note_fp8_scales("w2", loaded, local, 0, range(self.hidden_size),
                                  range(self.slice_rank * self.inter, (self.slice_rank + 1) * self.inter))

    def _note_fp8_scales(self, which: str, loaded, local: int, row: int, rows: range, cols: range) -> None:
        """Where an FP8 checkpoint tensor filled rows [row, row + len(rows)) of local expert `local`'s
        `which` from its rows x cols: their scales (model_loader/fp8.py)."""
        table_of = getattr(loaded, "fp8_scale_table", None)
        if table_of is None:
            return
        self.fp8_scales[which] = note_scales(self.fp8_scales[which], (self.num_local, getattr(self, which).shape[1]),
                                             table_of(rows, cols), (local, slice(row, row + len(rows))))

    def process_weights_after_loading(self) -> None:
        """Experts loaded from FP8 tensors: into FP8 panels again, exactly (as Linear._keep_fp8), where
        every expert's rows came from FP8 and this device has the kernel; else they stay float."""
        scales = self.fp8_scales
        self.fp8_scales = {"w13": None, "w2": None}
        if self.quantized is not None:         # quantized at load (quantize)
            return
        if any(s is None or s.isnan().any() for s in scales.values()):
            self._pack_panels()
            return
        self._stack_fp8({which: [(from_scales(w[e], scales[which][e]), scales[which][e])
                                 for e in range(self.num_local)]
                         for which, w in (("w13", self.w13.data), ("w2", self.w2.data))})

    def _stack_fp8(self, parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Each matrix's per-expert FP8 (q, scales) into FP8 panels, stacked as one uint8 tensor;
        nothing (the experts stay float) where they do not go into panels on this device."""
        if not all(packs(q, sc, self.dtype) for experts in parts.values() for q, sc in experts[:1]):
            _log_once(f"the experts stay in {self.dtype} (FP8 experts run in panels, a CPU kernel)")
            return
        self.quantized = {}
        for which, experts in parts.items():
            q0, sc0 = experts[0]
            stack = torch.empty(self.num_local, packed_bytes(*q0.shape, q0.shape[1] // sc0.shape[1]),
                                dtype=torch.uint8)
            self.quantized[which] = [Fp8LinearWeight(q, sc, self.dtype, into=stack[e])
                                     for e, (q, sc) in enumerate(experts)]
            setattr(self, which, nn.Parameter(stack, requires_grad=False))

    def take_quantized(self, which: str, shard_id, part: tuple) -> None:
        """One expert matrix of a quantized checkpoint (GPTQ, AWQ, compressed-tensors): part = (q,
        scales, mins, bits) of gate / up ([I, H]) or down ([H, I]); each slot holding the expert
        keeps this rank's rows (gate, up) or columns (down: whole groups) until use_quantized."""
        q, scales, mins, bits = part
        expert = shard_id[0] if which == "w13" else shard_id
        if which == "w13":
            rows = slice(self.slice_rank * self.inter, (self.slice_rank + 1) * self.inter)
            mine = tuple(t[rows] for t in (q, scales, mins))
        else:
            group = q.shape[1] // scales.shape[1]
            start = self.slice_rank * self.inter
            groups = slice(start // group, (start + self.inter) // group)
            mine = (q[:, start:start + self.inter], scales[:, groups], mins[:, groups])
        self._taken_bits[which] = bits
        for local in self._local(expert):
            self._taken.setdefault((which, local), {})[shard_id[1] if which == "w13" else 0] = mine

    def use_quantized(self) -> bool:
        """After take_quantized: every local expert's w13 (gate rows, then up rows) and w2 from the
        checkpoint's integers, in the panels as quantize() puts them; False where none were taken."""
        taken, self._taken = self._taken, {}
        bits, self._taken_bits = self._taken_bits, {}
        if not taken:
            return False
        missing = [f"{which} of slot {local}" for which, halves in (("w13", (0, 1)), ("w2", (0,)))
                   for local in range(self.num_local) if set(halves) - set(taken.get((which, local), {}))]
        if missing:
            raise ValueError(f"{type(self).__name__}: the quantized checkpoint lacks {', '.join(missing[:4])} of "
                             "this layer's experts: an incomplete checkpoint, or experts quantized only in part.")
        self._stack({which: [[torch.cat([taken[which, local][h][i] for h in sorted(taken[which, local])])
                              for i in range(3)] for local in range(self.num_local)] for which in ("w13", "w2")},
                    bits)
        if self.quantized is None:
            widths = "/".join(map(str, sorted(set(bits.values()))))
            raise ValueError(f"{type(self).__name__}: this build has no {widths}-bit panels for the checkpoint's "
                             "quantized experts; run the float checkpoint.")
        return True

    def _stack(self, parts: dict[str, list], bits: dict[str, int]) -> None:
        """Each matrix's per-expert (q, scales, mins) of bits[which] bits into panels, stacked as one
        uint8 tensor (rows viewed by each expert's weight, so EPLB's moves rewrite them in place);
        nothing where a weight does not go into panels here."""
        quantized, stacks = {}, {}
        for which, experts in parts.items():
            weights = [QuantizedWeight(*qsm, bits[which], self.dtype, half_tables=False) for qsm in experts]
            if not all(w.blocked for w in weights):
                _log_once(f"the experts stay in {self.dtype} (no {bits[which]}-bit panels in this build)")
                return
            stacks[which] = torch.stack([w.packed for w in weights])
            for e, w in enumerate(weights):
                w.packed = stacks[which][e]
            quantized[which] = weights
        self.quantized = quantized
        for which, stack in stacks.items():
            setattr(self, which, nn.Parameter(stack, requires_grad=False))

    def quantize(self, config) -> None:
        """--quantization int8 | int4 | fp8_* at load, for the experts too (most of a MoE model's
        weights): each local expert's w13 and w2 (this rank's slice of them) into the linears' 8- or
        4-bit panels (FP8: _quantize_fp8), stacked as one uint8 tensor per matrix so that EPLB moves
        them as it moves floats. Under tensor parallel, int8's per-row scales of w2 span every rank's
        columns (as RowParallelLinear's). Where the panels do not apply (CUDA, a build without the
        kernels) the experts stay in the model's dtype."""
        if config.method not in ("int8", "int4", *FP8_SCHEMES) or self.num_local == 0 \
                or self.w13.device.type != "cpu":
            _log_once(f"the experts stay in {self.dtype} (their panels are CPU kernels)")
            return
        sliced = not expert_parallel_enabled() and self.reduce_group.world_size > 1
        if config.method in FP8_SCHEMES:
            return self._quantize_fp8(config.method, sliced)
        parts = {}
        for which in ("w13", "w2"):
            w = getattr(self, which).data
            group = check_group_size(config.method, config.group_size, w.shape[2], f"{type(self).__name__}.{which}")
            absmax = None
            if which == "w2" and sliced and config.bits == 8 and config.group_size == -1:
                absmax = self._row_absmax_over_ranks(w)
            parts[which] = [quantize_rtn(w[e], config.bits, group, None if absmax is None else absmax[e])
                            for e in range(self.num_local)]
        self._stack(parts, dict.fromkeys(parts, config.bits))

    def _row_absmax_over_ranks(self, w: torch.Tensor) -> torch.Tensor:
        """[E, rows]: each expert row's largest |w| over every TP rank's columns (w2 sliced by TP)."""
        return self.reduce_group.all_gather(w.float().abs().amax(2, keepdim=True), dim=2).amax(2)

    def _quantize_fp8(self, scheme: str, sliced: bool) -> None:
        """Each local expert's w13 and w2 to FP8 by round to nearest (layers/fp8.py). Sliced by TP,
        a per-tensor scale is the largest |w| of the whole expert matrix over the ranks, and w2's
        per-channel scales span every rank's columns, so that every layout has the same values."""
        parts = {}
        for which in ("w13", "w2"):
            w = getattr(self, which).data
            absmax = None
            if sliced and scheme == "fp8_per_tensor":
                absmax = self.reduce_group.all_gather(w.float().abs().amax((1, 2)).view(-1, 1), dim=1).amax(1)
            elif sliced and scheme == "fp8_per_channel" and which == "w2":
                absmax = self._row_absmax_over_ranks(w)
            parts[which] = [quantize_fp8(w[e], scheme, None if absmax is None else absmax[e])
                            for e in range(self.num_local)]
        self._stack_fp8(parts)

    def _pack_panels(self) -> None:
        """Float experts on CPU into the blocked kernel's panels, one flat row per expert."""
        if self.num_local == 0 or not goes_into_panels(self.w13.data[0]):
            return
        self.panels = {}
        for which in ("w13", "w2"):
            w = getattr(self, which).data
            self.panels[which] = w.shape[1]
            setattr(self, which, nn.Parameter(torch.stack([pack_blocked(w[e]) for e in range(self.num_local)]),
                                              requires_grad=False))

    def _product(self, which: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x . this rank's `which` (w13 or w2) of local expert `expert`, transposed."""
        if self.quantized is not None:
            return self.quantized[which][expert].matmul(x)
        if self.panels is not None:
            return blocked(x, getattr(self, which)[expert], None, self.panels[which])
        return x @ getattr(self, which)[expert].t()

    # ---- loading all experts from one stacked tensor (GPT-OSS: gate and up interleaved by column) ----
    def load_stacked(self, which: str, tensor: torch.Tensor) -> None:
        """which: gate_up [E, H, 2I] (gate at even columns, up at odd), gate_up_bias [E, 2I],
        down [E, I, H] or down_bias [E, H], as transformers' GptOssExperts holds them; this rank
        takes its experts and its slice of their intermediate dims."""
        rows = slice(self.slice_rank * self.inter, (self.slice_rank + 1) * self.inter)
        for local, expert in enumerate(self.local_expert_ids()):
            t = tensor[expert]
            if which == "gate_up":
                self.w13.data[local].copy_(torch.cat([t[:, 0::2].t()[rows], t[:, 1::2].t()[rows]]))
            elif which == "gate_up_bias":
                self.w13_bias.data[local].copy_(torch.cat([t[0::2][rows], t[1::2][rows]]))
            elif which == "down":
                self.w2.data[local].copy_(t.t()[:, rows])
            else:
                self.w2_bias.data[local].copy_(t)

    # ---- forward ----
    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax over the experts, top-k, optionally renormalised (or the model's own routing):
        (weights, expert ids), [T, k]."""
        if self.routing is not None:
            return self.routing(router_logits)
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        counts = _dp_token_counts
        own = slice(0, x.shape[0])
        if counts is not None:                 # DP + EP: every replica's tokens, this one's at `own`
            start = sum(counts[:self.dp.rank_in_group])
            own = slice(start, start + x.shape[0])
            x, router_logits = self._gather_replicas(x, router_logits, counts)
        if x.shape[0] == 0:                    # no replica has a token this step
            return x
        weights, ids = self.route_and_count(router_logits, own)
        out = self.reduce_group.all_reduce(self._run_local_experts(x, weights, ids))
        return out[own] if counts is not None else out

    def route_and_count(self, router_logits: torch.Tensor, own: slice = slice(None)
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """route(), with this replica's tokens (rows `own`) counted into expert_load."""
        weights, ids = self.route(router_logits)
        self.expert_load += torch.bincount(ids[own].flatten(), minlength=self.num_experts).cpu()
        return weights, ids

    def local_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Each (token, choice)'s expert ids [T, k] -> the local expert (slot) on this rank that serves
        it, or -1 where another rank does (with EPLB: the copy its token index picks)."""
        if self.slot_expert is None:
            local = ids - self.first_expert
        else:
            token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(ids)
            copies, slots = self.copy_count.to(ids.device), self.copy_slots.to(ids.device)
            local = slots[ids, token % copies[ids]] - self.first_expert
        return local.masked_fill((local < 0) | (local >= self.num_local), -1)

    def _run_local_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of the output: its experts (its slice of them under TP) for the
        tokens routed to them; zero rows for tokens that none of its experts serves."""
        local = self.local_slots(ids).flatten()
        pairs = (local >= 0).nonzero().squeeze(1)        # (token, expert) pairs here
        local = local[pairs]
        order = local.argsort(stable=True)               # grouped by expert
        pairs, local = pairs[order], local[order]
        tokens = pairs // self.top_k
        counts = torch.bincount(local, minlength=self.num_local).tolist()
        xs = x[tokens]
        results = torch.empty_like(xs)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            gate_up = self._product("w13", expert, xs[start:start + n])
            if self.w13_bias is not None:
                gate_up = gate_up + self.w13_bias[expert]
            out = self._product("w2", expert, self._activate(gate_up))
            if self.w2_bias is not None and self.slice_rank == 0:   # added once, not by every TP slice
                out = out + self.w2_bias[expert]
            results[start:start + n] = out
            start += n
        pair_weights = weights.flatten()[pairs].to(x.dtype).unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, tokens, results * pair_weights)

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The activation of [gate | up] rows: with the experts in panels (CPU), SiLU-and-mul in C
        (kernels/fused_ops.c, as the one-call decode step's experts run it)."""
        on_panels = self.panels is not None or self.quantized is not None
        if on_panels and self.activation.limit is None and gate_up.is_contiguous():
            return silu_and_mul(gate_up)
        return self.activation(gate_up[:, :self.inter], gate_up[:, self.inter:])

    def _gather_replicas(self, x: torch.Tensor, router_logits: torch.Tensor, counts: list[int]):
        """Every replica's tokens and router logits, replica by replica (one all-gather over the
        DP group; the rows are padded to the largest replica's count, then dropped)."""
        most = max(counts)
        if most == 0:
            return x, router_logits
        both = torch.cat([x, router_logits.to(x.dtype)], dim=1)
        both = F.pad(both, (0, 0, 0, most - x.shape[0]))
        gathered = self.dp.all_gather(both, dim=0)
        rows = torch.cat([torch.arange(r * most, r * most + n) for r, n in enumerate(counts)])
        gathered = gathered[rows.to(gathered.device)]
        return gathered[:, :self.hidden_size], gathered[:, self.hidden_size:]

    # ---- EPLB: moving experts ----
    def rebalance(self, load: list[float], num_nodes: int = 1) -> tuple[float, float]:
        """A new placement for these per-expert token counts (the same on every EP rank; whole
        expert groups per node where the EP group spans num_nodes nodes), the weights moved to it
        where it balances better by at least MIN_BALANCE_GAIN (a move costs a broadcast per expert
        moved). -> balancedness before and after."""
        ep = self.reduce_group.world_size
        groups = self.routing.n_group if self.routing is not None else 1
        new = place_experts_hierarchical(load, ep, self.num_redundant, groups, num_nodes)
        before, after = balancedness(load, self.slot_expert, ep), balancedness(load, new, ep)
        if after < before + MIN_BALANCE_GAIN:
            return before, before
        self._move_experts(new)
        self.set_placement(new)
        return before, after

    def _move_experts(self, new: list[int]) -> None:
        """Every expert a slot gains is broadcast over the EP group by a rank that holds it now
        (all broadcasts first, so no slot is overwritten before it is sent), then stored."""
        old, group, mine = self.slot_expert, self.reduce_group, slice(self.first_expert,
                                                                      self.first_expert + self.num_local)
        params = [p for p in (self.w13, self.w2, self.w13_bias, self.w2_bias) if p is not None]
        gained = sorted({e for e, was in zip(new, old) if e != was})
        wanted = {e for e, was in zip(new[mine], old[mine]) if e != was}
        staged = {}
        for expert in gained:
            holder = old.index(expert)
            src = holder // self.num_local
            bufs = [p.data[holder - self.first_expert].clone() if src == group.rank_in_group
                    else torch.empty_like(p.data[0]) for p in params]
            for buf in bufs:
                group.broadcast(buf, src)
            if expert in wanted:
                staged[expert] = bufs
        for local, (e, was) in enumerate(zip(new[mine], old[mine])):
            if e != was:
                for p, buf in zip(params, staged[e]):
                    p.data[local].copy_(buf)

    def dummy_forward(self) -> None:
        """This replica has no tokens but joins the others' step (DP + EP lock-step)."""
        empty = torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.w13.device)
        self(empty, torch.empty(0, self.num_experts, dtype=self.dtype, device=self.w13.device))


@dataclass
class GroupedTopK:
    """DeepSeek's routing: scores by softmax (V2) or sigmoid (V3) of the router logits; the experts in
    n_group groups, of which the topk_group best are kept (a group's score: its best expert's, or
    with a correction bias its best two's), top_k experts chosen among those (V3 chooses by score +
    bias, weighs by score); weights renormalised where asked, then scaled."""
    top_k: int
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = False
    scaling: float = 1.0
    correction_bias: torch.Tensor | None = None     # [E] float32, added for the choice only

    def __call__(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits.float()
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.correction_bias is None else scores + self.correction_bias
        if self.n_group > 1:
            grouped = choice.view(choice.shape[0], self.n_group, -1)
            group_scores = (grouped.topk(2, dim=-1)[0].sum(dim=-1) if self.correction_bias is not None
                            else grouped.amax(dim=-1))
            kept = torch.zeros_like(group_scores, dtype=torch.bool)
            kept.scatter_(1, group_scores.topk(self.topk_group, dim=-1)[1], True)
            choice = choice.masked_fill(~kept.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


def expert_checkpoint_name(name: str, pattern: re.Pattern, gate: str, up: str) -> tuple[str, object] | None:
    """A checkpoint's per-expert tensor (`pattern` captures the expert id and which matrix) as
    (stacked parameter, shard id) of this layer under `<layer>.mlp.experts`; None for other tensors."""
    found = pattern.search(name)
    if not found:
        return None
    expert, which, layer = int(found.group(1)), found.group(2), name[:found.start()]
    if which in (gate, up):
        return f"{layer}.mlp.experts.w13", (expert, 0 if which == gate else 1)
    return f"{layer}.mlp.experts.w2", expert
