"""`shardlm bench plot`: W1 throughput and batch-1 decode of shardlm and peer engines per
precision, side by side in one PNG (needs matplotlib: `pip install 'shardlm[plot]'`).

Reads JSON results: the output of `shardlm bench throughput|latency --json`, and the files
`../shared/bench/peers.sh` writes (vLLM: vllm_<dtype>.json; llama.cpp: llamacpp_q4_1.json).
Several results of one (benchmark, engine, precision), e.g. interleaved rounds, are reduced to
their median.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict

W1, DECODE = "W1 output tokens/s", "batch-1 decode tokens/s"


def _precision(result: dict) -> str:
    quant, dtype = result.get("quantization"), result.get("dtype", "?")
    if quant == "gguf":
        return "Q4_1 (gguf)"
    return f"{quant} ({dtype})" if quant else dtype


def points(result: dict) -> list[tuple[str, str, str, float]]:
    """(metric, engine, precision, value) of one result file's content."""
    engine = str(result.get("engine", ""))
    if engine == "shardlm":
        if result.get("benchmark") == "throughput":
            return [(W1, "shardlm", _precision(result), result["output_tok_s"])]
        if result.get("benchmark") == "latency" and result.get("batch_size") == 1:
            return [(DECODE, "shardlm", _precision(result), result["decode_tok_s"])]
        return []
    if engine.startswith("vllm") or engine.startswith("llama"):
        name = "vLLM-CPU" if engine.startswith("vllm") else "llama.cpp (one prompt at a time)"
        precision = "Q4_1 (gguf)" if engine.startswith("llama") else result["dtype"]
        out = []
        if "output_tok_s" in result:                  # absent from a run with --skip-seq
            out.append((W1, name, precision, result["output_tok_s"]["median"]))
        if "latency" in result:
            out.append((DECODE, name, precision, result["latency"]["decode_tok_s_median"]))
        return out
    raise ValueError(f"Not a shardlm bench or peers.sh result (engine {engine!r}): run `shardlm bench throughput|"
                     "latency --json` or ../shared/bench/peers.sh to make one.")


def collect(paths: list[str]) -> dict[str, dict[tuple[str, str], float]]:
    """metric -> (engine, precision) -> median value over the files."""
    values: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for path in paths:
        with open(path) as f:
            for metric, engine, precision, value in points(json.load(f)):
                values[metric, engine, precision].append(value)
    table: dict[str, dict[tuple[str, str], float]] = defaultdict(dict)
    for (metric, engine, precision), vals in values.items():
        table[metric][engine, precision] = statistics.median(vals)
    return table


def plot(paths: list[str], out: str, title: str | None = None) -> dict:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("shardlm bench plot needs matplotlib: pip install 'shardlm[plot]'") from None
    table = collect(paths)
    if not table:
        raise SystemExit("No throughput or batch-1 latency results in the files given.")
    metrics = [m for m in (W1, DECODE) if m in table]
    engines = sorted({e for m in metrics for e, _ in table[m]}, key=lambda e: (e != "shardlm", e))
    fig, axes = plt.subplots(1, len(metrics), figsize=(6.5 * len(metrics), 4.5), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        precisions = sorted({p for _, p in table[metric]})
        width = 0.8 / len(engines)
        for i, engine in enumerate(engines):
            xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(precisions))]
            ys = [table[metric].get((engine, p), 0.0) for p in precisions]
            bars = ax.bar(xs, ys, width, label=engine)
            ax.bar_label(bars, labels=[f"{y:.0f}" if y else "" for y in ys], fontsize=8)
        ax.set_xticks(range(len(precisions)), precisions, rotation=15, fontsize=8)
        ax.set_title(metric)
        ax.margins(y=0.12)          # room for the bars' labels
    # one legend for both panels, below them: inside a panel it covered bars and their labels
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(engines), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return {m: {f"{e} / {p}": v for (e, p), v in table[m].items()} for m in metrics}
