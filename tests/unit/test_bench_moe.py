"""The MoE benchmark tools: `bench make-model --moe` writes a Mixtral the engine serves, whose
prompts spread over the experts; `bench moe-layer` compares the two dispatches on equal outputs."""

import json

from shardlm import LLM, SamplingParams
from shardlm.entrypoints.cli import main


def test_make_model_moe_writes_a_mixtral_the_engine_serves(tmp_path, capsys):
    out = tmp_path / "moe"
    main(["bench", "make-model", str(out), "--moe", "--hidden-size", "64", "--num-layers", "2", "--num-heads", "4",
          "--intermediate-size", "96", "--num-experts", "4"])
    assert "Mixtral (4 experts, 2 per token)" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["intermediate_size"] == 96
    llm = LLM(str(out), dtype="float32", kv_cache_memory="32MiB", max_model_len=256)
    try:
        (o,) = llm.generate(["The capital of France is a city on the river"], SamplingParams(max_tokens=4),
                            use_tqdm=False)
        load = llm.stats()["expert_load"]
    finally:
        llm.shutdown()
    assert len(o.outputs[0].token_ids) == 4
    # the prompt's tokens reach more than the top-2 experts (in the first layer: the last routes
    # only the rows it samples)
    assert sum(c > 0 for c in load["0"]) >= 3, load


def test_bench_moe_layer_reports_both_dispatches(capsys):
    main(["bench", "moe-layer", "--tokens", "1,16", "--hidden-size", "64", "--intermediate-size", "96", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in result["rows"]] == [1, 16]
    for r in result["rows"]:
        assert r["per_expert_loop_ms"] > 0 and r["grouped_bmm_ms"] > 0
        assert 1 <= r["active_experts"] <= 8
        assert r["comm_bytes_dp_ep"] > r["comm_bytes_tp_or_ep"] == r["tokens"] * 64 * 4
