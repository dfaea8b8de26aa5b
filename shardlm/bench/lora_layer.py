"""`shardlm bench lora-layer`: the LoRA delta of one layer for a step of several adapters, by each
way of computing it, on one layer's shapes. shardlm's LoRA layers (lora/layers.py) use the one
that measured fastest ("batched"); the others are kept here to measure against:

    per-adapter  a matmul pair per adapter's rows (gathered), added back by index
    dense        one matmul pair over every slot, other adapters' columns masked to zero
    batched      the adapters' rows as one [adapters, rows, in] batch, two batched matmuls
    blocked      per adapter's rows (contiguous), two products of shardlm's blocked kernel (CPU
                 with the kernel for this dtype; what the one-call decode step runs in C)
"""

from __future__ import annotations

from shardlm.utils import median_seconds


def run_lora_layer_bench(in_features: int, out_features: int, shards: int, rank: int, adapters: int,
                         tokens: list[int], dtype_name: str, reps: int = 200) -> dict:
    import torch
    dtype = getattr(torch, dtype_name)
    width = shards * rank
    g = torch.Generator().manual_seed(0)
    a = torch.randn(adapters, width, in_features, generator=g).to(dtype)
    b = torch.randn(adapters, out_features, width, generator=g).to(dtype)
    a_all = a.reshape(adapters * width, in_features)
    from shardlm.layers.cpu_matmul import blocked, goes_into_panels, pack_blocked
    panels = [(pack_blocked(a[s]), pack_blocked(b[s])) for s in range(adapters)] if goes_into_panels(a[0]) else None
    b_all = b.permute(1, 0, 2).reshape(out_features, adapters * width).contiguous()
    results = {}
    for n in tokens:
        per = n // adapters
        x = torch.randn(per * adapters, in_features, generator=g).to(dtype)
        out = torch.zeros(per * adapters, out_features, dtype=dtype)
        slot = torch.arange(per * adapters) % adapters          # requests of the adapters interleaved
        rows = [(slot == s).nonzero().squeeze(1) for s in range(adapters)]
        mask = torch.zeros(per * adapters, adapters * width, dtype=dtype)
        for s, r in enumerate(rows):
            mask[r, s * width:(s + 1) * width] = 1

        def per_adapter():
            for s, r in enumerate(rows):
                out.index_add_(0, r, (x.index_select(0, r) @ a[s].t()) @ b[s].t())

        def dense():
            out.addmm_((x @ a_all.t()) * mask, b_all.t())

        def batched():        # rows ordered by adapter (the runner's order): views
            xa = torch.bmm(x.view(adapters, per, in_features), a.transpose(1, 2))
            out.view(adapters, per, out_features).baddbmm_(xa, b.transpose(1, 2))

        ways = [("per-adapter", per_adapter), ("dense", dense), ("batched", batched)]
        if panels:
            def blocked_each():
                for s in range(adapters):
                    rows_s = slice(s * per, (s + 1) * per)
                    out[rows_s].add_(blocked(blocked(x[rows_s], panels[s][0], None, width), panels[s][1], None,
                                             out_features))
            ways.append(("blocked", blocked_each))
        results[n] = {name: median_seconds(fn, reps, warmup=10) * 1e6 for name, fn in ways}
    return {"benchmark": "lora-layer", "in_features": in_features, "out_features": out_features, "shards": shards,
            "rank": rank, "adapters": adapters, "dtype": dtype_name, "microseconds": results}


def report(result: dict) -> None:
    print(f"LoRA delta of one layer [{result['out_features']}, {result['in_features']}] ({result['shards']} "
          f"shard(s)), {result['adapters']} adapters of rank {result['rank']}, {result['dtype']}, median us:")
    for n, row in result["microseconds"].items():
        print(f"  {n:5d} tokens: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()))
