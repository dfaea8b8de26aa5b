"""`shardlm bench moe-layer`: the fused MoE layer alone on one rank, at the token counts of
decode and prefill steps, with its dispatch (tokens sorted by expert, one matmul per active
expert) against a grouped alternative (every expert's tokens padded to the busiest expert's
count, two batched matmuls for all experts at once). It also gives the bytes each layout's
collectives move per MoE layer for those tokens.

On CPU both are bound by reading the active experts' weights; the per-expert loop wins or ties
at every size measured (the padding costs more than the fewer calls save), so the layer uses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlm.distributed.parallel_state import single_rank
from shardlm.layers.moe import FusedMoE
from shardlm.utils import median_seconds


def grouped_dispatch(moe: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The alternative measured: one padded [E, most, H] batch and two bmm calls for all experts."""
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    tokens, experts = order // moe.top_k, flat[order]
    counts = torch.bincount(flat, minlength=moe.num_experts)
    slot = torch.arange(len(order)) - (torch.cumsum(counts, 0) - counts)[experts]
    padded = x.new_zeros(moe.num_experts, int(counts.max()), x.shape[1])
    padded[experts, slot] = x[tokens]
    gate_up = torch.bmm(padded, moe.w13.transpose(1, 2))
    act = F.silu(gate_up[..., :moe.inter]) * gate_up[..., moe.inter:]
    out = torch.bmm(act, moe.w2.transpose(1, 2))[experts, slot]
    return torch.zeros_like(x).index_add_(0, tokens, out * weights.flatten()[order].to(x.dtype).unsqueeze(1))


def _median_ms(fn, reps: int) -> float:
    return median_seconds(fn, reps, warmup=3) * 1000


def run_moe_layer_bench(num_experts: int = 8, top_k: int = 2, hidden: int = 512, intermediate: int = 1024,
                        token_counts=(1, 8, 32, 64, 256, 2048), dtype: str = "float32", threads: int = 1,
                        reps: int = 15, ranks: int = 2) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    with single_rank():
        moe = FusedMoE(num_experts, top_k, hidden, intermediate).to(dt)
    with torch.no_grad():
        moe.w13.normal_(0, 0.02)
        moe.w2.normal_(0, 0.02)
    rows = []
    for n in token_counts:
        x, logits = torch.randn(n, hidden, dtype=dt), torch.randn(n, num_experts)
        weights, ids = moe.route(logits)
        torch.testing.assert_close(grouped_dispatch(moe, x, weights, ids), moe._run_local_experts(x, weights, ids),
                                   rtol=1e-3, atol=1e-3)
        active = int((torch.bincount(ids.flatten(), minlength=num_experts) > 0).sum())
        with torch.inference_mode():
            loop = _median_ms(lambda: moe._run_local_experts(x, weights, ids), reps)
            grouped = _median_ms(lambda: grouped_dispatch(moe, x, weights, ids), reps)
        weight_bytes = active * 3 * hidden * intermediate * dt.itemsize
        size = dt.itemsize
        rows.append({"tokens": n, "active_experts": active, "per_expert_loop_ms": loop, "grouped_bmm_ms": grouped,
                     "weights_read_mb": weight_bytes / 1e6, "loop_gb_s": weight_bytes / loop / 1e6,
                     # bytes each rank sends per MoE layer (ranks = 2): TP and EP sum one [T, H] output;
                     # DP + EP first all-gathers every replica's [T, H + E] inputs (T tokens each)
                     "comm_bytes_tp_or_ep": n * hidden * size,
                     "comm_bytes_dp_ep": n * (hidden + num_experts) * size + ranks * n * hidden * size})
    return {"benchmark": "moe-layer", "num_experts": num_experts, "top_k": top_k, "hidden": hidden,
            "intermediate": intermediate, "dtype": dtype, "threads": threads, "rows": rows}


def report(result: dict) -> None:
    print(f"MoE layer ({result['num_experts']} experts, top-{result['top_k']}, hidden {result['hidden']}, expert "
          f"size {result['intermediate']}, {result['dtype']}, {result['threads']} thread(s)), median ms per call:")
    print(f"  {'tokens':>6} {'active':>6} {'loop ms':>8} {'grouped ms':>10} {'loop GB/s':>9} "
          f"{'comm KB TP/EP':>13} {'comm KB DP+EP':>13}")
    for r in result["rows"]:
        print(f"  {r['tokens']:>6} {r['active_experts']:>6} {r['per_expert_loop_ms']:>8.3f} "
              f"{r['grouped_bmm_ms']:>10.3f} {r['loop_gb_s']:>9.1f} {r['comm_bytes_tp_or_ep'] / 1e3:>13.1f} "
              f"{r['comm_bytes_dp_ep'] / 1e3:>13.1f}")
