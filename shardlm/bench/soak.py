"""`shardlm bench serve --duration 30m`: a soak. Closed-loop clients (each sends its next streaming
request when the last ends) ramp up to --concurrency, for --duration; every --interval the report
takes a row: requests done and failed, output tokens/s, TTFT and ITL p50/p99, the RSS of every
process of the server, and its preemptions (from /metrics). What a long run shows and a short one
hides: memory that grows, latency that drifts, failures that come with preemption (start the
server with a KV cache small for the concurrency to force it: --kv-cache-memory).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from shardlm.bench.serve import RequestResult, _one, _pct, _prompts


def parse_duration(text: str) -> float:
    """'30m', '90s', '1h' or seconds -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    text = text.strip().lower()
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
    except (ValueError, IndexError):
        raise ValueError(f"--duration {text!r}: give seconds or a number with s, m or h (e.g. 30m).") from None


@dataclass
class Window:
    """One interval of the soak: what finished in it, the most clients it had, and the server as it ended."""
    start_s: float
    clients: int = 0
    results: list[RequestResult] = field(default_factory=list)
    rss_mib: dict[str, float] = field(default_factory=dict)   # "name (pid)" -> MiB
    preemptions: float | None = None                           # so far, per /metrics


def server_processes(base_url: str, pid: int | None):
    """The server process (given, or the one listening on the URL's local port) and its children."""
    import psutil
    if pid is None:
        port = httpx.URL(base_url).port or 80
        listening = [c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
                     and c.laddr and c.laddr.port == port and c.pid]
        if not listening:
            return []
        pid = listening[0]
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _rss(base_url: str, pid: int | None) -> dict[str, float]:
    import psutil
    out = {}
    for p in server_processes(base_url, pid):
        try:
            out[f"{p.name()} ({p.pid})"] = p.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return out


async def _preemptions(client: httpx.AsyncClient, base_url: str, headers: dict) -> float | None:
    try:
        text = (await client.get(base_url + "/metrics", headers=headers)).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("shardlm:num_preemptions{") and 'engine="all"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


async def _soak(base_url, model, api_key, concurrency, duration_s, ramp_s, interval_s, workload, output_len,
                server_pid) -> dict:
    prompts, default_len = _prompts(workload, 1024)
    output_len = output_len or default_len
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        if model is None:
            model = (await client.get(base_url + "/v1/models", headers=headers)).json()["data"][0]["id"]
        t0 = time.perf_counter()
        deadline = t0 + duration_s
        windows = [Window(0.0)]
        active = [0]
        sent = [0]

        async def client_loop(k: int):
            await asyncio.sleep(ramp_s * k / concurrency)          # the ramp: clients join one by one
            active[0] += 1
            windows[-1].clients = max(windows[-1].clients, active[0])
            try:
                while time.perf_counter() < deadline:
                    prompt = prompts[sent[0] % len(prompts)]
                    sent[0] += 1
                    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
                    result = await _one(client, base_url + "/v1/completions", body, headers)
                    windows[-1].results.append(result)
            finally:
                active[0] -= 1

        async def sampler():
            while True:
                await asyncio.sleep(min(interval_s, max(0.0, deadline - time.perf_counter())))
                w = windows[-1]
                # the most clients it had (at the deadline the first to finish have left already)
                w.clients = max(w.clients, active[0])
                w.rss_mib = await asyncio.to_thread(_rss, base_url, server_pid)
                w.preemptions = await _preemptions(client, base_url, headers)
                if time.perf_counter() >= deadline:
                    return
                windows.append(Window(time.perf_counter() - t0, clients=active[0]))

        watch = asyncio.ensure_future(sampler())
        await asyncio.gather(*(client_loop(k) for k in range(concurrency)))
        await watch
        end = time.perf_counter() - t0
    return summarize(windows, end, base_url, model, concurrency, duration_s, ramp_s, output_len)


def summarize(windows: list[Window], end_s: float, base_url, model, concurrency, duration_s, ramp_s,
              output_len) -> dict:
    rows, previous = [], None
    for i, w in enumerate(windows):
        length = (windows[i + 1].start_s if i + 1 < len(windows) else end_s) - w.start_s
        ok = [r for r in w.results if r.ok]
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        itls = [x for r in ok for x in r.itls]
        ms = lambda v: None if v is None else round(v * 1000, 1)   # noqa: E731
        rows.append({"minute": round(w.start_s / 60, 2), "seconds": round(length, 1), "clients": w.clients,
                     "completed": len(ok), "failed": len(w.results) - len(ok),
                     "output_tok_s": round(sum(r.output_tokens for r in ok) / length, 1) if length > 0 else 0.0,
                     "ttft_ms_p50": ms(_pct(ttfts, 50)), "ttft_ms_p99": ms(_pct(ttfts, 99)),
                     "itl_ms_p50": ms(_pct(itls, 50)), "itl_ms_p99": ms(_pct(itls, 99)),
                     "rss_mib": {k: round(v, 1) for k, v in w.rss_mib.items()},
                     "rss_mib_total": round(sum(w.rss_mib.values()), 1),
                     "preemptions": None if w.preemptions is None or previous is None
                     else w.preemptions - previous})
        previous = w.preemptions if w.preemptions is not None else previous
    errors = sorted({r.error for w in windows for r in w.results if not r.ok})
    steady = [r for r in rows if r["minute"] * 60 >= ramp_s and r["rss_mib_total"]] or rows
    return {"benchmark": "soak", "base_url": base_url, "model": model, "concurrency": concurrency,
            "duration_s": duration_s, "ramp_s": ramp_s, "output_len": output_len,
            "completed": sum(r["completed"] for r in rows), "failed": sum(r["failed"] for r in rows),
            "errors": errors[:5], "preemptions": windows[-1].preemptions,
            "rss_growth_mib": round(steady[-1]["rss_mib_total"] - steady[0]["rss_mib_total"], 1) if steady else None,
            "windows": rows}


def run_soak(base_url: str, model: str | None, api_key: str | None, concurrency: int, duration: str, ramp: str,
             interval: str, workload: str | None, output_len: int | None, server_pid: int | None) -> dict:
    return asyncio.run(_soak(base_url.rstrip("/"), model, api_key, concurrency, parse_duration(duration),
                             parse_duration(ramp), parse_duration(interval), workload, output_len, server_pid))


def report(r: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=1))
        return
    f = lambda v: "-" if v is None else f"{v:.0f}"   # noqa: E731
    print(f"Soak: {r['base_url']} model {r['model']}, {r['concurrency']} clients (ramp {r['ramp_s']:.0f} s) for "
          f"{r['duration_s'] / 60:.1f} min, {r['output_len']} tokens per request\n"
          f"  completed {r['completed']}, failed {r['failed']}"
          + (f" (errors: {'; '.join(r['errors'])})" if r["errors"] else "")
          + f"; preemptions {f(r['preemptions'])}; RSS growth after the ramp {r['rss_growth_mib']} MiB")
    print(f"  {'min':>6} {'clients':>7} {'done':>5} {'fail':>4} {'out tok/s':>9} {'TTFT p50':>8} {'p99':>6} "
          f"{'ITL p50':>7} {'p99':>5} {'RSS MiB':>8} {'preempt':>7}")
    for w in r["windows"]:
        print(f"  {w['minute']:6.1f} {w['clients']:7d} {w['completed']:5d} {w['failed']:4d} {w['output_tok_s']:9.1f} "
              f"{f(w['ttft_ms_p50']):>8} {f(w['ttft_ms_p99']):>6} {f(w['itl_ms_p50']):>7} {f(w['itl_ms_p99']):>5} "
              f"{w['rss_mib_total']:8.0f} {f(w['preemptions']):>7}")


def plot(r: dict, out: str) -> None:
    """Throughput, p99 latencies and each process's RSS over time, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = r["windows"]
    minutes = [w["minute"] for w in rows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    axes[0].plot(minutes, [w["output_tok_s"] for w in rows], marker=".")
    axes[0].set_ylabel("output tokens/s")
    for key, label in (("ttft_ms_p99", "TTFT p99"), ("itl_ms_p99", "ITL p99"), ("ttft_ms_p50", "TTFT p50")):
        axes[1].plot(minutes, [w[key] for w in rows], marker=".", label=label)
    axes[1].set_ylabel("ms")
    axes[1].set_yscale("log")
    axes[1].legend()
    names = sorted({name for w in rows for name in w["rss_mib"]})
    for name in names:
        axes[2].plot(minutes, [w["rss_mib"].get(name) for w in rows], marker=".", label=name)
    axes[2].set_ylabel("RSS MiB")
    axes[2].set_xlabel("minutes")
    if names:
        axes[2].legend(fontsize=7)
    fig.suptitle(f"soak: {r['model']}, {r['concurrency']} clients, {r['completed']} requests, {r['failed']} failed")
    fig.tight_layout()
    fig.savefig(out)
