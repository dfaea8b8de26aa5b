"""`shardlm plan` output: a readable report, or JSON."""

from __future__ import annotations

import json

from shardlm.planner.layer_placement import describe_partition
from shardlm.planner.plan import GiB, Recommendation


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def render(r: Recommendation) -> str:
    hw, w = r.hardware, r.workload
    weights_fmt = f"{w.quantization_bits:.3g}-bit weights" if w.quantization_bits else w.dtype
    lines = [
        f"Model {r.model}: {r.params / 1e9:.2f}B parameters"
        + (f" ({r.active_params / 1e9:.2f}B active per token)" if r.active_params != r.params else ""),
        f"  weights at {weights_fmt}: {_gib(r.weights_bytes)} "
        f"(rule of thumb params x bytes x 1.2 = {_gib(r.rule_of_thumb_bytes)})",
        f"  KV cache per token: {r.kv_bytes_per_token / 1024:.1f} KiB; max_model_len {w.max_model_len}, "
        f"block size {w.block_size}",
        f"Hardware: {hw.nodes} node(s) x {hw.devices_per_node} {hw.kind.upper()}(s) x {_gib(hw.device_memory)}, "
        f"using {hw.utilization:.0%} ({_gib(hw.usable)}) of each",
        "",
    ]
    if r.plan:
        p = r.plan
        lines += [f"Recommended: {p.label}  ->  {r.command}",
                  f"  per device: weights {_gib(p.weights_per_device)}, activation/overhead reserve "
                  f"{_gib(p.reserve_per_device)}, KV cache {p.kv_blocks} blocks = {p.kv_tokens} tokens "
                  f"(max concurrency at {w.max_model_len}: {p.max_concurrency:.1f}x)"]
        if p.pp > 1:
            lines.append("  " + describe_partition([(st["layers"][0], st["layers"][1] + 1) for st in p.stages]))
    else:
        lines.append("Recommended: none of the layouts fits this hardware.")
    lines += [f"  - {x}" for x in r.reasons + r.notes]
    header = f"  {'split':<16}{'devices':>8}{'weights/dev':>13}{'KV tokens':>11}{'max conc.':>11}  fits?"
    lines += ["", "Alternatives:", header]
    for a in r.alternatives:
        lines.append(f"  {a.label:<16}{a.devices:>8}{_gib(a.weights_per_device):>13}{a.kv_tokens:>11}"
                     f"{a.max_concurrency:>10.1f}x  {a.status}" + (f" ({a.reason})" if a.status != "yes" else ""))
    return "\n".join(lines)


def to_json(r: Recommendation) -> str:
    return json.dumps(r.to_dict(), indent=1)
