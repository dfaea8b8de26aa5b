"""`shardlm bench plot` reads shardlm's and peers.sh's result files, takes medians of repeated
results, and writes a PNG; `bench` prints a throughput result without expert counts."""

import json

import pytest

from shardlm.bench.offline import report
from shardlm.bench.plot import DECODE, W1, collect
from shardlm.entrypoints.cli import main


def _write(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(json.dumps(content))
    return str(path)


@pytest.fixture
def results(tmp_path):
    ours = {"engine": "shardlm", "dtype": "bfloat16", "quantization": None}
    return [
        _write(tmp_path, "w1.json", {**ours, "benchmark": "throughput", "output_tok_s": 300.0}),
        *[_write(tmp_path, f"lat{i}.json", {**ours, "benchmark": "latency", "batch_size": 1, "decode_tok_s": v})
          for i, v in enumerate((30.0, 40.0, 35.0))],
        _write(tmp_path, "gguf.json", {**ours, "quantization": "gguf", "benchmark": "latency", "batch_size": 1,
                                       "decode_tok_s": 70.0}),
        _write(tmp_path, "batch32.json", {**ours, "benchmark": "latency", "batch_size": 32, "decode_tok_s": 500.0}),
        _write(tmp_path, "vllm_bfloat16.json", {"engine": "vllm-cpu", "dtype": "bfloat16",
                                                "output_tok_s": {"median": 339.0},
                                                "latency": {"decode_tok_s_median": 42.0}}),
        _write(tmp_path, "llamacpp_q4_1.json", {"engine": "llama-cpp-python", "dtype": "Q4_1 (GGUF)",
                                                "output_tok_s": {"median": 101.0},
                                                "latency": {"decode_tok_s_median": 87.0}}),
    ]


def test_results_are_collected_by_engine_and_precision(results):
    table = collect(results)
    assert table[W1] == {("shardlm", "bfloat16"): 300.0, ("vLLM-CPU", "bfloat16"): 339.0,
                         ("llama.cpp (one prompt at a time)", "Q4_1 (gguf)"): 101.0}
    assert table[DECODE][("shardlm", "bfloat16")] == 35.0          # the median of three rounds
    assert table[DECODE][("shardlm", "Q4_1 (gguf)")] == 70.0       # beside llama.cpp's bar
    assert ("shardlm", "bfloat16") in table[DECODE] and len(table[DECODE]) == 4   # batch 32 is not batch-1 decode


def test_a_peer_run_without_the_throughput_part_gives_its_decode_only(tmp_path):
    table = collect([_write(tmp_path, "llamacpp.json", {"engine": "llama-cpp-python", "dtype": "Q4_1 (GGUF)",
                                                        "latency": {"decode_tok_s_median": 120.0}})])
    assert W1 not in table and table[DECODE] == {("llama.cpp (one prompt at a time)", "Q4_1 (gguf)"): 120.0}


def test_plot_writes_a_png(results, tmp_path, capsys):
    out = tmp_path / "bench.png"
    main(["bench", "plot", *results, "--out", str(out), "--title", "test CPU"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "vLLM-CPU / bfloat16 339.0" in capsys.readouterr().out


def test_a_file_of_something_else_is_refused(tmp_path):
    with pytest.raises(ValueError, match="Not a shardlm bench or peers.sh result"):
        collect([_write(tmp_path, "x.json", {"hello": 1})])


def test_throughput_report_prints(capsys):
    report({"benchmark": "throughput", "workload": "w", "num_prompts": 2, "prompt_tokens": 10, "output_tokens": 20,
            "dtype": "float32", "reps": 1, "output_tok_s": 12.5, "total_tok_s": 15.0, "startup_s": 1.0,
            "peak_rss_bytes": 1 << 30}, as_json=False)
    assert "output tokens/s: 12.5" in capsys.readouterr().out
    report({"benchmark": "throughput", "workload": "w", "num_prompts": 2, "prompt_tokens": 10, "output_tokens": 20,
            "dtype": "float32", "reps": 1, "output_tok_s": 12.5, "total_tok_s": 15.0, "startup_s": 1.0,
            "peak_rss_bytes": 1 << 30, "temperature": 1.0, "seeded": True}, as_json=False)
    assert "dtype float32, sampled at temperature 1, seeded, median" in capsys.readouterr().out


def test_throughput_sampling_gives_greedy_sampled_or_seeded_requests():
    from shardlm.bench.offline import Sampling
    assert Sampling().params(3, max_tokens=4).greedy
    sampled = Sampling(1.0).params(3, max_tokens=4)
    assert sampled.temperature == 1.0 and sampled.seed is None
    assert [p.seed for p in Sampling(0.7, seeded=True).params(3, max_tokens=4)] == [0, 1, 2]


def test_latency_over_each_prompt_reports_every_prompt(capsys):
    """`bench latency --each-prompt` (the long prompts' time to first token, one line each)."""
    per_prompt = [{"prompt_tokens": n, "time_to_first_token_s": t, "decode_step_ms": 16.0}
                  for n, t in ((2048, 2.14), (4096, 5.07), (8000, 15.56))]
    report({"benchmark": "latency", "batch_size": 1, "prompt_tokens": 4096, "output_tokens": 128, "dtype": "bfloat16",
            "reps": 2, "decode_step_ms": 16.0, "decode_tok_s": 62.5, "time_to_first_token_s": 5.07,
            "startup_to_first_token_s": 7.5, "startup_s": 4.6, "peak_rss_bytes": 1 << 30, "per_prompt": per_prompt},
           as_json=False)
    out = capsys.readouterr().out
    assert "2048 prompt tokens: time to first token 2140 ms" in out
    assert "8000 prompt tokens: time to first token 15560 ms" in out
