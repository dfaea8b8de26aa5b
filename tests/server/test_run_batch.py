"""`shardlm run-batch`: an OpenAI batch file with good and bad lines -> one result per line, in
order, the good ones as the offline engine answers them, the bad ones with their error; run
again, the lines already answered are not run again."""

import json

import pytest

from shardlm import LLM, SamplingParams
from shardlm.entrypoints.cli import main
from tests.helpers import SERVE_FLAGS

PROMPTS = ["The capital of France is", "One, two, three,"]


def _line(custom_id, url, body, method="POST"):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _run(model, source, output, capsys):
    """The CLI's main, in this process (a new interpreter would add its imports, ~3.5 s a run)."""
    flags = [f for f in SERVE_FLAGS if f not in ("--uvicorn-log-level", "warning")]
    capsys.readouterr()
    main(["run-batch", "-i", str(source), "-o", str(output), "--no-progress", model, *flags])
    return capsys.readouterr().out, [json.loads(line) for line in open(output)]


@pytest.mark.slow
def test_run_batch_answers_each_line_in_order_and_resumes(tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("llama-gqa")
    ref = LLM(model, dtype="float32", max_model_len=256).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    lines = [
        _line("c0", "/v1/completions", {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                        "ignore_eos": True}),
        "this is not json",
        _line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        _line("bad-param", "/v1/completions", {"prompt": "x", "temperature": -1}),
        _line("nowhere", "/v1/nothing", {}),
        _line("stream", "/v1/completions", {"prompt": "x", "stream": True}),
        _line("get", "/v1/completions", {"prompt": "x"}, method="GET"),
        _line("c1", "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}),
    ]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    printed, results = _run(model, source, output, capsys)
    assert "8 lines: 3 answered 200, 5 failed" in printed
    assert [r["custom_id"] for r in results] == ["c0", None, "chat", "bad-param", "nowhere", "stream", "get", "c1"]
    for r, out in ((results[0], ref[0]), (results[7], ref[1])):
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert r["response"]["body"]["choices"][0]["text"] == out.outputs[0].text
        assert r["response"]["request_id"] == r["response"]["body"]["id"]
    assert results[2]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert results[1]["response"] is None and "not JSON" in results[1]["error"]["message"]
    assert results[3]["response"]["status_code"] == 400
    assert results[3]["response"]["body"]["error"]["param"] == "temperature"
    for r, words in ((results[4], "not one run-batch serves"), (results[5], "cannot stream"),
                     (results[6], "must be POST")):
        assert r["response"] is None and words in r["error"]["message"]
    # again with the same output: the answered lines are kept as they are (marked here), not run again
    results[0]["response"]["body"]["marker"] = "kept"
    output.write_text("".join(json.dumps(r) + "\n" for r in results))
    printed, again = _run(model, source, output, capsys)
    assert "3 answered by an earlier run" in printed
    assert again[0]["response"]["body"]["marker"] == "kept"
    assert [r["custom_id"] for r in again] == [r["custom_id"] for r in results]
    assert not (tmp_path / "out.jsonl.partial").exists()
