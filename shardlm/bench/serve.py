"""`shardlm bench serve`: load an OpenAI-compatible server (shardlm, vLLM, ...) with streaming
completions at a fixed concurrency; report throughput, time to first token and inter-token
latency percentiles, and failures."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx

from shardlm.bench.workload import _TASKS, _TOPICS


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    latency: float = 0.0
    error: str = ""


def _prompts(workload: str | None, n: int) -> tuple[list, int]:
    if workload:
        with open(workload) as f:
            data = json.load(f)
        prompts = [p.get("token_ids") or p["text"] for p in data["prompts"]]
        out_len = data.get("output_len", 128)
    else:
        prompts = [task.format(topic) for topic in _TOPICS for task in _TASKS]
        out_len = 128
    return (prompts * (n // len(prompts) + 1))[:n], out_len


async def _one(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> RequestResult:
    res, start = RequestResult(), time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - start
    return res


def _latency_summary(values: list[float], ms) -> dict:
    return {f"p{p}": ms(_pct(values, p)) for p in (50, 90, 99)} | {
        "mean": ms(statistics.mean(values)) if values else None}


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def _run(base_url, model, api_key, concurrency, num_prompts, workload, output_len) -> dict:
    prompts, default_len = _prompts(workload, num_prompts)
    output_len = output_len or default_len
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        if model is None:
            model = (await client.get(base_url + "/v1/models", headers=headers)).json()["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)

        async def limited(prompt):
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            async with sem:
                return await _one(client, base_url + "/v1/completions", body, headers)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = lambda v: None if v is None else v * 1000   # noqa: E731
    return {"benchmark": "serve", "base_url": base_url, "model": model, "concurrency": concurrency,
            "num_prompts": len(prompts), "output_len": output_len, "duration_s": duration,
            "completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:5],
            "request_throughput": len(ok) / duration, "output_tok_s": out_tokens / duration,
            "total_tok_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
            "ttft_ms": _latency_summary(ttfts, ms), "itl_ms": _latency_summary(itls, ms)}


def run_serve_bench(base_url: str, model: str | None, api_key: str | None, concurrency: int, num_prompts: int,
                    workload: str | None, output_len: int | None) -> dict:
    return asyncio.run(_run(base_url.rstrip("/"), model, api_key, concurrency, num_prompts, workload, output_len))


def report(r: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=1))
        return
    f = lambda v: "-" if v is None else f"{v:.1f}"   # noqa: E731
    print(f"Serving benchmark: {r['base_url']} model {r['model']}, concurrency {r['concurrency']}, "
          f"{r['num_prompts']} prompts x {r['output_len']} tokens\n"
          f"  completed {r['completed']}, failed {r['failed']} in {r['duration_s']:.1f} s"
          + (f" (errors: {'; '.join(r['errors'])})" if r["errors"] else "") + "\n"
          f"  requests/s: {r['request_throughput']:.2f}   output tokens/s: {r['output_tok_s']:.1f}   "
          f"total tokens/s: {r['total_tok_s']:.1f}\n"
          f"  time to first token ms: p50 {f(r['ttft_ms']['p50'])}  p90 {f(r['ttft_ms']['p90'])}  "
          f"p99 {f(r['ttft_ms']['p99'])}\n"
          f"  inter-token latency ms: p50 {f(r['itl_ms']['p50'])}  p90 {f(r['itl_ms']['p90'])}  "
          f"p99 {f(r['itl_ms']['p99'])}")
