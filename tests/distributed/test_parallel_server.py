"""`shardlm serve -tp 2 / -pp 2 / -tp 2 -pp 2`: the OpenAI server over an engine core whose ranks
are worker processes."""

import os
import signal

import openai
import psutil
import pytest

from shardlm import LLM, SamplingParams
from tests.helpers import start_server, stop_server, wait_gone


def assert_server_answers_like_llm(url: str, path: str) -> None:
    """Completions equal the offline engine's; a streamed chat equals the same chat unstreamed."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    prompts = ["The capital of", "One two three"]
    ref = LLM(path, dtype="float32", kv_cache_memory="64MiB", max_model_len=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [r.outputs[0].text for r in ref]
    msgs = [{"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        full.choices[0].message.content


@pytest.mark.slow
def test_parallel_server_smoke(tiny_model_dir):
    """-tp 2 -pp 2 (both mechanisms at once; the worker death test below serves -tp 2 alone)."""
    path = tiny_model_dir("llama-gqa")
    proc, url = start_server(path, "-tp", "2", "-pp", "2")
    try:
        assert_server_answers_like_llm(url, path)
        # engine core + one worker per rank under the server
        assert len(psutil.Process(proc.pid).children(recursive=True)) >= 1 + 4
    finally:
        stop_server(proc)        # asserts that SIGTERM leaves no process behind


def test_tp2_server_worker_death_ends_the_server_naming_the_rank(tiny_model_dir):
    proc, url = start_server(tiny_model_dir("llama-gqa"), "-tp", "2", "--max-engine-restarts", "0")
    children = psutil.Process(proc.pid).children(recursive=True)
    try:
        workers = sorted((p for p in children if p.name().startswith("shardlm-rank")), key=lambda p: p.name())
        assert len(workers) == 2
        os.kill(workers[1].pid, signal.SIGKILL)      # while idle: noticed without any request
        assert proc.wait(timeout=15) != 0
        err = proc.stderr.read()
        assert "Worker rank 1" in err and "died" in err, err[-2000:]
        alive = wait_gone(children, 10)
        assert not alive, f"processes left: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
