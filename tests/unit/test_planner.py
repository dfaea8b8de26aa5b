"""`shardlm plan`: parameter counts, KV sizes, per-rank memory and the recommendations of the
worked examples users know; the start-up check refuses impossible launches fast."""

import json
import os
import re
import shlex

import pytest

from shardlm.planner import Hardware, ModelShape, Workload, evaluate, load_config, load_presets, recommend
from shardlm.planner.layer_placement import pp_layer_partition
from shardlm.planner.plan import GiB


def shape(name):
    return ModelShape.from_config(*load_config(name))


@pytest.mark.parametrize("name, published", [("Llama-3.1-8B", 8.03e9), ("Llama-3.1-70B", 70.6e9),
                                             ("Llama-3.1-405B", 405.9e9), ("Mixtral-8x7B", 46.7e9),
                                             ("Qwen2.5-7B", 7.62e9), ("Qwen2.5-72B", 72.7e9), ("DeepSeek-V3", 671e9)])
def test_preset_parameter_counts_match_published_sizes(name, published):
    assert abs(shape(name).total_params() - published) / published < 0.01


def _tiny_cases():
    import transformers as T
    common = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2)
    return [
        (T.LlamaForCausalLM, T.LlamaConfig(**common, tie_word_embeddings=True)),
        (T.LlamaForCausalLM, T.LlamaConfig(**common, attention_bias=True, mlp_bias=True)),
        (T.Qwen2ForCausalLM, T.Qwen2Config(**common, tie_word_embeddings=False)),
        (T.MistralForCausalLM, T.MistralConfig(**common)),
        (T.MixtralForCausalLM, T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)),
        (T.DeepseekV3ForCausalLM, T.DeepseekV3Config(**{**common, "num_hidden_layers": 4, "num_key_value_heads": 4},
                                                      moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                                      num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=24,
                                                      kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                                      v_head_dim=8, n_group=2, topk_group=1)),
        # a shared expert with its gate, experts on every second layer
        (T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig(**common, num_experts=6, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                  decoder_sparse_step=2)),
        # dense layers named by mlp_only_layers, q/k norms
        (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(**common, num_experts=6, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, mlp_only_layers=[0], head_dim=16)),
    ]


@pytest.mark.parametrize("index", range(8))
def test_parameter_count_is_exact_for_transformers_models(index):
    cls, cfg = _tiny_cases()[index]
    model = cls(cfg)
    d = cfg.to_dict()
    d["architectures"] = [cls.__name__]
    assert ModelShape.from_config("tiny", d).total_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["llava", "llava-next", "idefics3"])
def test_vision_language_counts_are_exact_and_the_vision_side_sits_on_the_first_stage(tiny_model_dir, family):
    import torch
    import transformers
    path = tiny_model_dir(family)
    _, cfg = load_config(path)
    with torch.device("meta"):
        model = getattr(transformers, cfg["architectures"][0])(transformers.AutoConfig.from_pretrained(path))
    s = ModelShape.from_config(family, cfg)
    # the checkpoint's whole model: the text model (its LM head untied) and the vision side
    assert s.total_params() == sum(p.numel() for p in model.parameters())
    assert s.vision_params > 40_000
    w = Workload(max_model_len=256)
    hw = Hardware("cpu", 2, 1, 1 * GiB)
    plan = evaluate(s, 1, 2, hw, w)
    assert "vision" in plan.stages[0]["holds"][0] and not any("vision" in h for h in plan.stages[1]["holds"])


def test_kv_bytes_per_token_by_hand():
    s = shape("Llama-3.1-70B")
    assert s.kv_bytes_per_token(2) == 2 * 80 * 8 * 128 * 2              # 327,680 bytes
    assert s.kv_bytes_per_token(2, tp=4) == 2 * 80 * 2 * 128 * 2         # KV heads split
    assert s.kv_bytes_per_token(2, tp=16) == 2 * 80 * 1 * 128 * 2        # replicated past 8 KV heads
    assert shape("DeepSeek-V3").kv_bytes_per_token(2) == 61 * (512 + 64) * 2   # MLA latent


def test_sliding_window_layers_count_the_window_they_keep():
    """Gemma 3 27B's shape: 10 full layers, 52 with windows of 1,024; at max_model_len 32,768 a
    windowed layer keeps 65 of a request's 2,048 blocks, so a GPU holds 5.3x the tokens."""
    from transformers import Gemma3TextConfig
    d = Gemma3TextConfig(vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                         num_attention_heads=32, num_key_value_heads=16, head_dim=128, sliding_window=1024,
                         max_position_embeddings=131072).to_dict()
    s = ModelShape.from_config("gemma-3-27b", {**d, "architectures": ["Gemma3ForCausalLM"]})
    assert s.windows.count(None) == 10 and set(s.windows) == {None, 1024}
    assert s.kv_layers(0, 62, 32768, 16) == pytest.approx(10 + 52 * 65 / 2048)
    assert s.kv_layers(0, 62, 1024, 16) == 62              # the window covers every request
    hw = Hardware("gpu", 1, 1, 141 * GiB)
    kept, every = (evaluate(s, 1, 1, hw, Workload(max_model_len=32768, hybrid_kv_cache=h)) for h in (True, False))
    assert kept.kv_tokens / every.kv_tokens == pytest.approx(62 / (10 + 52 * 65 / 2048), rel=0.01)


def test_per_rank_weights_follow_the_split():
    s = shape("Llama-3.1-70B")
    hw = Hardware("gpu", 8, 1, 80 * GiB)
    one, tp4 = evaluate(s, 1, 1, hw, Workload()), evaluate(s, 4, 1, hw, Workload())
    assert abs(tp4.weights_per_device * 4 / one.weights_per_device - 1) < 0.01
    pp2 = evaluate(s, 1, 2, hw, Workload())
    first, last = pp2.stages
    assert first["holds"] == ["embed"] and last["holds"] == ["norm", "lm_head"]
    # the LM head (128256 x 8192) weighs 1.23 of its layers: one layer fewer on the last stage
    assert first["layers"] == [0, 40] and last["layers"] == [41, 79]


def test_pp_layer_partition():
    assert pp_layer_partition(30, 2) == [(0, 15), (15, 30)]
    assert pp_layer_partition(10, 3) == [(0, 4), (4, 7), (7, 10)]     # remainder away from the last stage
    assert pp_layer_partition(30, 2, [16, 14]) == [(0, 16), (16, 30)]
    with pytest.raises(ValueError, match="summing to 30"):
        pp_layer_partition(30, 2, [16, 13])


def test_the_default_split_counts_the_lm_head_as_layers():
    """The last stage runs the LM head for every token: as many layers fewer as it weighs."""
    assert pp_layer_partition(12, 2, head_layers=6.0) == [(0, 9), (9, 12)]
    assert pp_layer_partition(12, 2, explicit=[6, 6], head_layers=6.0) == [(0, 6), (6, 12)]  # asked for
    assert pp_layer_partition(5, 2, head_layers=80.0) == [(0, 4), (4, 5)]     # at least one layer each
    assert abs(shape("Llama-3.1-70B").lm_head_layers() - 1.23) < 0.01
    s = shape("Llama-3.1-70B")
    assert [b - a for a, b in pp_layer_partition(s.layers, 4, head_layers=s.lm_head_layers())] == [21, 20, 20, 19]
    # an MoE layer weighs the experts a token uses: Mixtral's head is a third of a layer, too
    # little to move one
    m = shape("Mixtral-8x7B")
    assert 0.3 < m.lm_head_layers() < 0.4
    assert pp_layer_partition(m.layers, 4, head_layers=m.lm_head_layers()) == pp_layer_partition(m.layers, 4)


def _rec(name, gpn, nodes, mem=80, **w):
    return recommend(shape(name), Hardware("gpu", gpn, nodes, mem * GiB), Workload(**w))


def test_70b_on_four_80gb_gpus_is_tp4_and_tp2_is_tight():
    r = _rec("Llama-3.1-70B", 4, 1)
    assert (r.plan.tp, r.plan.pp) == (4, 1) and r.command.endswith("-tp 4 --max-model-len 8192")
    tp2 = next(a for a in r.alternatives if (a.tp, a.pp) == (2, 1))
    assert tp2.status == "tight"


def test_405b_on_two_nodes_is_tp8_pp2_never_tp_across_nodes():
    r = _rec("Llama-3.1-405B", 8, 2)
    assert (r.plan.tp, r.plan.pp) == (8, 2) and "-tp 8 -pp 2" in r.command
    assert any("never spans nodes" in x for x in r.reasons)
    assert all(a.tp <= 8 for a in r.alternatives)


def test_8b_on_one_gpu_needs_no_parallelism():
    r = _rec("Llama-3.1-8B", 1, 1)
    assert (r.plan.tp, r.plan.pp) == (1, 1) and "no parallelism" in r.reasons[0]


def test_70b_on_three_gpus_explains_tp3_and_offers_pp3_or_tp2_4():
    r = _rec("Llama-3.1-70B", 3, 1)
    text = " ".join(r.reasons + r.notes)
    assert "64 attention heads are not divisible by 3" in text and "1, 2, 4, 8" in text
    assert (r.plan.tp, r.plan.pp) == (1, 3)
    assert any((a.tp, a.pp) == (2, 1) and a.status != "no" for a in r.alternatives)


def test_moe_plans_show_experts_per_rank_under_tp_and_ep_with_commands():
    """Mixtral-8x7B (8 experts of 3 x 4096 x 14336, 32 layers) in bfloat16 on 8 x 80 GB: TP=2 slices every
    expert in two (44 GiB... per rank: 8 x 0.35 GiB x 32 / 2); EP=2 holds 4 whole experts; DP x EP over all 8
    GPUs holds one."""
    r = _rec("Mixtral-8x7B", 8, 1)
    assert (r.plan.tp, r.plan.pp) == (2, 1)
    expert_gib = 3 * 4096 * 14336 * 2 * 32 / GiB          # one expert in every layer
    text = " ".join(r.notes)
    assert f"({8 * expert_gib / 2:.2f} GiB of experts per rank)" in text
    assert f"at most 4 ({4 * expert_gib:.2f} GiB per rank)" in text
    assert f"at most 1 per rank, {expert_gib:.2f} GiB" in text
    assert "shardlm serve Mixtral-8x7B -tp 2 --enable-expert-parallel" in text
    assert "shardlm serve Mixtral-8x7B -tp 2 -dp 4 --enable-expert-parallel" in text


def test_dp_ep_note_with_pipeline_stages_spreads_each_stage_over_its_ranks():
    """TP=2 PP=2 with room for 2 replicas: a stage's 8 experts over its 4 DP x TP ranks (2 each,
    16 layers per stage), and the command keeps -pp."""
    from shardlm.planner.plan import _expert_parallel_notes
    s, hw, w = shape("Mixtral-8x7B"), Hardware("gpu", 8, 1, 80 * GiB), Workload()
    text = " ".join(_expert_parallel_notes(s, evaluate(s, 2, 2, hw, w), 2, hw, w, "Mixtral-8x7B"))
    expert_gib = 3 * 4096 * 14336 * 2 * 16 / GiB          # one expert in every layer of a stage
    assert f"over the 4 ranks of its stage: at most 2 per rank, {2 * expert_gib:.2f} GiB" in text
    assert "shardlm serve Mixtral-8x7B -tp 2 -pp 2 -dp 2 --enable-expert-parallel" in text


def test_expert_parallel_lifts_the_expert_size_divisibility():
    s = shape("Mixtral-8x7B")
    s.expert_intermediate = 14335
    assert any("expert MLP size" in p for p in s.tp_problems(2))
    assert not s.tp_problems(2, expert_parallel=True)


@pytest.mark.parametrize("name", list(load_presets()))
@pytest.mark.parametrize("gpus, nodes", [(1, 1), (4, 1), (8, 1), (8, 2), (3, 1)])
def test_every_printed_command_is_accepted_by_the_cli(name, gpus, nodes):
    """Every command and flag `plan` prints parses with the real argument parser."""
    from shardlm.entrypoints.cli import build_parser

    r = _rec(name, gpus, nodes)
    parser = build_parser()
    if r.command is not None:
        ns = parser.parse_args(shlex.split(r.command)[1:])
        assert ns.command == "serve"
    for note in r.notes:            # whole commands in the notes too (data parallel, expert parallel)
        for command in re.findall(r"shardlm serve [^`:]*?--max-model-len \d+", note):
            ns = parser.parse_args(shlex.split(command)[1:])
            assert ns.command == "serve" and (ns.data_parallel_size > 1 or ns.enable_expert_parallel
                                              or ns.decode_context_parallel_size > 1)
    serve_flags = {o for a in parser._subparsers._group_actions[0].choices["serve"]._actions for o in a.option_strings}
    for text in r.reasons + r.notes:
        for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", text):
            assert flag in serve_flags, f"{name}: `{flag}` in {text!r} is not a serve flag"


def test_decode_context_parallel_where_tp_replicates_kv_heads_and_contexts_are_long():
    """A 70B with 2 KV heads at TP=4 holds every sequence's KV on both ranks of each KV head:
    -dcp 2 spreads it, twice the tokens in the same memory; at short contexts it is not offered."""
    s = shape("Llama-3.1-70B")
    s.kv_heads = 2
    hw, w = Hardware("gpu", 4, 1, 80 * GiB), Workload(max_model_len=32768)
    tp4, dcp2 = evaluate(s, 4, 1, hw, w), evaluate(s, 4, 1, hw, w, dcp=2)
    assert dcp2.label == "TP=4 DCP=2" and abs(dcp2.kv_tokens / tp4.kv_tokens - 2) < 0.01
    assert s.valid_dcp_sizes(4) == [1, 2] and s.valid_dcp_sizes(8) == [1, 2, 4]
    assert evaluate(s, 4, 1, hw, w, dcp=4).status == "no"            # 4 ranks, 2 KV heads: two pairs
    r = recommend(s, hw, w, "Llama-3.1-70B")
    note = next(n for n in r.notes if "Decode context parallel" in n)
    assert f"{dcp2.kv_tokens} KV tokens instead of {tp4.kv_tokens}" in note
    assert "shardlm serve Llama-3.1-70B -tp 4 -dcp 2 --max-model-len 32768" in note
    assert not any("Decode context parallel" in n for n in recommend(s, hw, Workload(max_model_len=8192)).notes)


def test_deepseek_latent_cache_spread_by_dcp():
    """The latent is the same on every TP rank: plan suggests -dcp, and with -dcp 8 every split
    holds 8x the tokens (or says why it cannot run it)."""
    hw = Hardware("gpu", 8, 2, 141 * GiB)
    plain = recommend(shape("DeepSeek-V3"), hw, Workload(max_model_len=32768))
    assert any("Latent attention keeps one latent KV cache" in n and "-dcp 8" in n for n in plain.notes)
    spread = recommend(shape("DeepSeek-V3"), hw, Workload(max_model_len=32768, dcp=8), "DeepSeek-V3")
    assert (spread.plan.tp, spread.plan.pp, spread.plan.dcp) == (8, 2, 8) and "-tp 8 -pp 2 -dcp 8" in spread.command
    assert spread.plan.kv_tokens == pytest.approx(8 * plain.plan.kv_tokens, rel=0.001)


def test_nothing_fits_suggests_quantization():
    r = _rec("DeepSeek-V3", 8, 2)
    assert r.plan is None and any("8-bit" in x for x in r.reasons)


def test_fp8_checkpoints_plan_at_one_byte_a_weight(capsys):
    """The guide's Llama-3.1-405B-FP8 (fbgemm_fp8, read from its config.json) fits one node of 8 x
    80 GiB at TP=8, which bfloat16 does not; --kv-cache-dtype fp8 doubles its KV tokens there;
    DeepSeek-V3 as published (FP8 blocks of 128) counts a float32 scale per 128 weights."""
    from shardlm.entrypoints.cli import main
    runs = {}
    for model, extra in (("Llama-3.1-405B-FP8", []), ("Llama-3.1-405B", []),
                         ("Llama-3.1-405B-FP8", ["--kv-cache-dtype", "fp8"]), ("DeepSeek-V3", []),
                         ("Llama-3.1-70B", ["--quantization", "fp8_per_channel"])):
        main(["plan", model, "--gpus-per-node", "8", "--gpu-memory", "80GiB", "--json", *extra])
        runs[model, tuple(extra)] = json.loads(capsys.readouterr().out)
    fp8 = runs["Llama-3.1-405B-FP8", ()]
    assert fp8["plan"]["tp"] == 8 and fp8["plan"]["pp"] == 1 and runs["Llama-3.1-405B", ()]["plan"] is None
    assert fp8["workload"]["quantization_bits"] == pytest.approx(8 + 32 / 16384)
    kv8 = runs["Llama-3.1-405B-FP8", ("--kv-cache-dtype", "fp8")]["plan"]["kv_tokens"]
    assert kv8 == pytest.approx(2 * fp8["plan"]["kv_tokens"], rel=0.01)
    assert runs["DeepSeek-V3", ()]["workload"]["quantization_bits"] == pytest.approx(8.25)
    assert runs["Llama-3.1-70B", ("--quantization", "fp8_per_channel")]["workload"]["quantization_bits"] == \
        pytest.approx(8 + 32 / 8192)


def test_plan_command_json(capsys):
    from shardlm.entrypoints.cli import main
    main(["plan", "Llama-3.1-70B", "--gpus-per-node", "4", "--gpu-memory", "80GiB", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert d["plan"]["tp"] == 4 and d["command"].startswith("shardlm serve Llama-3.1-70B -tp 4")
    main(["plan", "Llama-3.1-70B", "--gpus-per-node", "4", "--gpu-memory", "80GiB"])
    out = capsys.readouterr().out
    assert "Recommended: TP=4" in out and "rule of thumb" in out and "Alternatives:" in out


def test_startup_check_refuses_an_impossible_model_fast(tmp_path):
    from shardlm import LLM
    cfg = dict(load_presets()["Llama-3.1-70B"], model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"cannot run as single device here: .*GiB.*shardlm plan"):
        LLM(str(tmp_path), device="cpu")     # the directory has no weights: refused before loading any
    assert not os.path.exists(tmp_path / "model.safetensors")
