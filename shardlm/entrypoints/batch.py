"""`shardlm run-batch -i requests.jsonl -o results.jsonl`: OpenAI's batch file format, as vLLM's
run-batch takes it. Each input line is {"custom_id", "method": "POST", "url", "body"}; each output
line, in the input's order, is {"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}, where the body is exactly what the server's route answers (its error shape
included), or "response": null and an "error" for a line that is not a request.

The lines run through the server's own app in this process (httpx's ASGI transport: the same
validation, limits and answers as `shardlm serve`), many at once so the engine batches them.
Finished lines go to OUTPUT.partial as they come; a run started again with the same output skips
the lines already answered with 200 there or in OUTPUT, so an interrupted job resumes."""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import httpx

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/pooling", "/classify", "/score",
          "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")


def read_input(source: str) -> list[str]:
    """The batch file's lines (blank ones dropped): a path, or an http(s) URL to fetch."""
    if source.startswith(("http://", "https://")):
        response = httpx.get(source, timeout=60, follow_redirects=True)
        response.raise_for_status()
        text = response.text
    else:
        with open(source) as f:
            text = f.read()
    return [line for line in text.splitlines() if line.strip()]


def finished_lines(output: str, lines: list[str]) -> dict[int, dict]:
    """Results of an earlier run with this output (its finished file and its journal) that answered
    their line with 200, by line number: those lines are not run again."""
    done: dict[int, dict] = {}
    for path in (output, output + ".partial"):
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for number, line in enumerate(f):
                try:
                    result = json.loads(line)
                except json.JSONDecodeError:
                    continue        # a line cut by an interruption
                index = result.pop("_line", number)
                if (index < len(lines) and (result.get("response") or {}).get("status_code") == 200
                        and result.get("custom_id") == _custom_id(lines[index])):
                    done[index] = result
    return done


def _custom_id(line: str):
    try:
        return json.loads(line).get("custom_id")
    except (json.JSONDecodeError, AttributeError):
        return None


def _request(line: str) -> tuple[object, str, dict]:
    """(custom_id, url, body) of an input line; ValueError saying what is wrong with it."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"the line is not JSON: {e}") from None
    if not isinstance(item, dict):
        raise ValueError("the line is not a JSON object")
    custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    if method != "POST":
        raise ValueError(f"method must be POST, not {method!r}")
    if url not in ROUTES:
        raise ValueError(f"url {url!r} is not one run-batch serves: {', '.join(ROUTES)}")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object (the route's request)")
    if body.get("stream"):
        raise ValueError("a batch line cannot stream: leave out \"stream\"")
    return custom_id, url, body


async def run_batch(app, lines: list[str], output: str, concurrency: int = 256, progress: bool = True) -> dict:
    """Run `lines` through `app` (server.build_app's) and write the results to `output` in their order.
    -> counts: lines, skipped (answered by an earlier run), ok, failed."""
    from tqdm.auto import tqdm
    done = finished_lines(output, lines)
    results: dict[int, dict] = dict(done)
    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(lines), initial=len(done), desc="Batch lines", disable=not progress, dynamic_ncols=True)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://batch", timeout=None) as client:
        with open(output + ".partial", "a") as journal:
            async def one(index: int, line: str) -> None:
                async with gate:
                    results[index] = result = await _answer(client, line)
                journal.write(json.dumps({**result, "_line": index}) + "\n")
                journal.flush()
                bar.update(1)
            await asyncio.gather(*(one(i, line) for i, line in enumerate(lines) if i not in done))
    bar.close()
    tmp = output + ".tmp"
    with open(tmp, "w") as f:
        for i in range(len(lines)):
            f.write(json.dumps(results[i]) + "\n")
    os.replace(tmp, output)
    os.remove(output + ".partial")
    ok = sum(1 for r in results.values() if (r.get("response") or {}).get("status_code") == 200)
    return {"lines": len(lines), "skipped": len(done), "ok": ok, "failed": len(lines) - ok}


async def _answer(client: httpx.AsyncClient, line: str) -> dict:
    line_id = f"batch_req_{uuid.uuid4().hex}"
    try:
        custom_id, url, body = _request(line)
    except ValueError as e:
        return {"id": line_id, "custom_id": _custom_id(line) if isinstance(_custom_id(line), str) else None,
                "response": None, "error": {"code": "invalid_request", "message": str(e)}}
    response = await client.post(url, json=body)
    answer = response.json()
    return {"id": line_id, "custom_id": custom_id, "error": None,
            "response": {"status_code": response.status_code,
                         "request_id": answer.get("id") if isinstance(answer, dict) else None, "body": answer}}
