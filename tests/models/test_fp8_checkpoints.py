"""FP8 checkpoints in the three formats that ship (model_loader/fp8.py), written here from a tiny
Llama's weights quantized by the test: loaded without a flag, their linears kept in FP8 (one byte
a weight), they give the tokens of the same model stored as the dequantized weights in float32
(and so transformers') at tp=1, at tp=2 with scale blocks straddling the shard boundary, at pp=2
and at dp=2; and --quantization fp8_per_channel / fp8_per_tensor / fp8_per_block quantize a
float checkpoint at load, within the tolerance int8 is held to."""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardlm import LLM, SamplingParams
from tests.models.test_tiny_models_vs_hf import PARAMS, _prompts

# the linears (DeepSeek's latent projections and experts too), not the router (mlp.gate)
_LINEAR = re.compile(r"\.(self_attn\.\w+_proj\w*|mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)\.weight$")
FP8_MAX = 448.0
BLOCK = 48          # the tiny model's 64 and 128 rows: blocks of 48 straddle tp=2's shard boundaries

FORMATS = {
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]},
    "fbgemm": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                               "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}}}},
}


def _quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """-> (FP8 weight, its scale tensors by suffix, the dequantized float32 weight)."""
    if fmt == "fp8-block":
        rows, cols = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
        padded = torch.nn.functional.pad(w, (0, cols * BLOCK - w.shape[1], 0, rows * BLOCK - w.shape[0]))
        amax = padded.view(rows, BLOCK, cols, BLOCK).abs().amax(dim=(1, 3))
        scale = amax / FP8_MAX
        full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:w.shape[0], :w.shape[1]]
        suffix = "weight_scale_inv"
    elif fmt == "fbgemm":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full, suffix = scale, "weight_scale"
    else:
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
        full, suffix = scale, "weight_scale"
    q = (w / full).to(torch.float8_e4m3fn)
    extra = {suffix: scale.float()}
    if fmt == "compressed-tensors":
        extra["input_scale"] = torch.ones(1)          # a static activation scale: not used (weight-only)
    return q, extra, q.float() * full


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_model_dir, tmp_path_factory):
    """{format: (FP8 checkpoint, float32 checkpoint of its dequantized weights)} from llama-gqa, and
    "deepseek-v3" in the block format."""
    out = {fmt: _write(tiny_model_dir("llama-gqa"), fmt, tmp_path_factory) for fmt in FORMATS}
    out["deepseek-v3"] = _write(tiny_model_dir("deepseek-v3"), "fp8-block", tmp_path_factory)
    return out


def _write(src, fmt, tmp_path_factory):
    qc = FORMATS[fmt]
    fp8_dir, float_dir = (str(tmp_path_factory.mktemp(f"{fmt}-{kind}")) for kind in ("fp8", "float"))
    for d in (fp8_dir, float_dir):
        for f in os.listdir(src):
            if not f.endswith(".safetensors"):
                shutil.copy(os.path.join(src, f), d)
    tensors, quantized, floats = load_file(os.path.join(src, "model.safetensors")), {}, {}
    for name, t in tensors.items():
        if _LINEAR.search(name):
            q, scales, deq = _quantize(t.float(), fmt)
            quantized[name] = q
            quantized.update({name[:-len("weight")] + s: v for s, v in scales.items()})
            floats[name] = deq
        else:
            quantized[name] = floats[name] = t
        if fmt == "compressed-tensors" and name.endswith(".self_attn.k_proj.weight"):   # a KV cache scheme's scales
            layer = name[:-len("k_proj.weight")]
            quantized[layer + "k_scale"], quantized[layer + "v_scale"] = torch.tensor(0.05), torch.tensor(0.02)
    save_file(quantized, os.path.join(fp8_dir, "model.safetensors"), metadata={"format": "pt"})
    save_file(floats, os.path.join(float_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qc
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return fp8_dir, float_dir


def _tokens(path, **kw):
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


def _fp8_linears(llm) -> tuple[int, int]:
    """(linears in FP8, linears in all) of the model (tp=1: in this process)."""
    from shardlm.layers.fp8 import Fp8LinearWeight
    from shardlm.layers.linear import Linear
    linears = [m for m in llm.engine.engine_core.engine_core.executor.worker.runner.model.modules()
               if isinstance(m, Linear)]
    return sum(isinstance(m.quant, Fp8LinearWeight) for m in linears), len(linears)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_an_fp8_checkpoint_gives_its_dequantized_models_tokens(fmt, fp8_checkpoints, hf):
    fp8_dir, float_dir = fp8_checkpoints[fmt]
    want = _tokens(float_dir)
    llm = LLM(fp8_dir, dtype="float32", kv_cache_memory="16MiB")
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)] == want
        fp8, linears = _fp8_linears(llm)
        assert fp8 == linears == 2 * 4          # q/k/v, o, gate/up and down of both layers: one byte a weight
        fp8_bytes = llm.collective_rpc("weight_bytes")[0]
    finally:
        llm.shutdown()
    llm = LLM(float_dir, dtype="float32", kv_cache_memory="16MiB")
    try:
        # the linears' 2 x 49152 weights: 4 bytes each in float32, 1 (and their scales) in FP8
        assert llm.collective_rpc("weight_bytes")[0] - fp8_bytes > 0.7 * 3 * 2 * 49152
    finally:
        llm.shutdown()
    assert hf.assert_close(hf.greedy(float_dir, _prompts(), PARAMS.max_tokens),
                           LLM(fp8_dir, dtype="float32", kv_cache_memory="16MiB").generate(_prompts(), PARAMS,
                                                                                          use_tqdm=False),
                           fmt) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8-block", "fbgemm"])
def test_tensor_parallel_slices_the_scales_with_their_rows(fmt, fp8_checkpoints):
    fp8_dir, float_dir = fp8_checkpoints[fmt]
    assert _tokens(fp8_dir, tensor_parallel_size=2) == _tokens(float_dir)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"pipeline_parallel_size": 2}, {"data_parallel_size": 2}], ids=["pp2", "dp2"])
def test_fp8_checkpoint_on_other_layouts(layout, fp8_checkpoints):
    fp8_dir, float_dir = fp8_checkpoints["fp8-block"]
    assert _tokens(fp8_dir, **layout) == _tokens(float_dir)


def _fp8_round_trip(src: str, dst, scheme: str) -> str:
    """The HF model with each linear's weight as online FP8 quantization holds it: q/k/v and
    gate/up quantized as the one matrix the engine merges them into (per tensor: one scale, as
    vLLM's online FP8 has it; per block: blocks of its rows)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from shardlm.layers.fp8 import dequantize_fp8, quantize_fp8
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    merged = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up"}
    with torch.no_grad():
        groups = {}
        for name, m in model.named_modules():
            if re.search(r"\.(q|k|v|o|gate|up|down)_proj$", name):
                prefix, leaf = name.rsplit(".", 1)
                groups.setdefault((prefix, merged.get(leaf[:-len("_proj")], leaf)), []).append(m.weight)
        for weights in groups.values():
            whole = torch.cat(list(weights))
            rows = dequantize_fp8(*quantize_fp8(whole, scheme), torch.float32).split([w.shape[0] for w in weights])
            for w, r in zip(weights, rows):
                w.copy_(r)
        for name, param in model.named_parameters():      # stacked experts: gate_up [E, 2I, H], down [E, H, I]
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                for expert in param.data:
                    expert.copy_(dequantize_fp8(*quantize_fp8(expert, scheme), torch.float32))
    model.save_pretrained(dst, safe_serialization=True)
    for f in os.listdir(src):
        if f.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(src, f), dst)
    return str(dst)


@pytest.mark.parametrize("scheme, layout", [
    ("fp8_per_channel", {}), pytest.param("fp8_per_tensor", {}, marks=pytest.mark.slow),
    pytest.param("fp8_per_block", {}, marks=pytest.mark.slow),
    pytest.param("fp8_per_channel", {"tensor_parallel_size": 2}, marks=pytest.mark.slow)])
def test_online_fp8_equals_hf_on_the_round_tripped_weights(scheme, layout, tiny_model_dir, tmp_path, hf):
    """As --quantization int8 is held (tests/models/test_quantized.py): at least 4 of the 6 greedy
    sequences equal transformers' exactly on the same FP8 weights, the rest within its top-k. At
    tp=2 a row's per-channel scale spans every rank's columns, so it is tp=1's."""
    src = tiny_model_dir("llama-gqa")
    want = hf.greedy(_fp8_round_trip(src, tmp_path / scheme, scheme), _prompts(), PARAMS.max_tokens)
    alias = "fp8" if scheme == "fp8_per_channel" and not layout else scheme      # vLLM's alias
    llm = LLM(src, dtype="float32", kv_cache_memory="16MiB", quantization=alias, **layout)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        if not layout:
            assert _fp8_linears(llm) == (8, 8)
    finally:
        llm.shutdown()
    assert hf.assert_close(want, outs, f"{scheme} {layout}") >= 4


@pytest.mark.slow
@pytest.mark.parametrize("scheme, layout", [
    ("fp8_per_channel", {}), ("fp8_per_tensor", {"tensor_parallel_size": 2}),
    ("fp8_per_channel", {"tensor_parallel_size": 2}),
    ("fp8_per_tensor", {"tensor_parallel_size": 2, "enable_expert_parallel": True}), ("fp8_per_block", {}),
    ("fp8_per_channel", {"pipeline_parallel_size": 2})],
    ids=["channel", "tensor-tp2", "channel-tp2", "tensor-ep2", "block", "channel-pp2"])
def test_online_fp8_quantizes_the_experts_too(scheme, layout, tiny_model_dir, tmp_path, hf):
    """As vLLM's online FP8: a Mixtral's experts go to FP8 panels with the linears, and the engine
    equals transformers on the round-tripped weights; sliced by TP, an expert's per-tensor scale
    and its down projection's per-row scales span every rank's part, as at one rank (per-block
    blocks are of each rank's rows, so under TP they are not one rank's: one rank here)."""
    src = tiny_model_dir("mixtral")
    want = hf.greedy(_fp8_round_trip(src, tmp_path / scheme, scheme), _prompts(), PARAMS.max_tokens)
    llm = LLM(src, dtype="float32", kv_cache_memory="16MiB", quantization=scheme, **layout)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        experts = [kernel for rank in llm.collective_rpc("quantized_experts") for kernel in rank]
    finally:
        llm.shutdown()
    assert experts and set(experts) == {"fp8"}, experts
    assert hf.assert_close(want, outs, f"mixtral {scheme} {layout}") >= 4


@pytest.mark.slow
def test_lora_on_an_fp8_checkpoint_gives_the_dequantized_models_tokens(fp8_checkpoints, tmp_path):
    """A LoRA adapter's deltas add to the FP8 products as to float ones (at tp=2 too)."""
    from shardlm import LoRARequest
    from tests.lora_adapters import write_adapter
    fp8_dir, float_dir = fp8_checkpoints["fp8-block"]
    adapter = LoRARequest("a", 1, write_adapter(float_dir, tmp_path / "a", rank=8, seed=3))
    tokens = []
    for path, tp in ((fp8_dir, 1), (fp8_dir, 2), (float_dir, 1)):
        llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, tensor_parallel_size=tp)
        try:
            tokens.append([o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False,
                                                                        lora_request=adapter)])
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1] == tokens[2]


def test_fp8_flags_say_what_works(tiny_model_dir, fp8_checkpoints):
    with pytest.raises(ValueError, match="fp8_per_block sets its own scales"):
        LLM(tiny_model_dir("llama-gqa"), dtype="float32", quantization="fp8_per_block", quantization_group_size=64)
    with pytest.raises(ValueError, match="already FP8 and runs as it is stored"):
        LLM(fp8_checkpoints["fbgemm"][0], dtype="float32", quantization="fp8_per_tensor")


def test_deepseek_keeps_its_fp8_experts_and_linears_in_fp8(fp8_checkpoints):
    """DeepSeek-V3's own format (blocks of weight_scale_inv): its routed experts go into FP8 panels
    (a uint8 stack per matrix) and its linears stay FP8 but those whose rotary rows are reordered at
    load (q_b_proj, kv_a_proj_with_mqa: float); the tokens are the dequantized model's."""
    from shardlm.layers.moe import FusedMoE
    fp8_dir, float_dir = fp8_checkpoints["deepseek-v3"]
    llm = LLM(fp8_dir, dtype="float32", kv_cache_memory="16MiB")
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)] == \
            _tokens(float_dir)
        model = llm.engine.engine_core.engine_core.executor.worker.runner.model
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert experts and all(m.quantized is not None and m.w13.dtype == torch.uint8 for m in experts)
        fp8, linears = _fp8_linears(llm)
        assert fp8 >= linears // 2
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("eplb", [False, True], ids=["ep", "ep-eplb"])
def test_deepseek_in_fp8_with_expert_parallel(eplb, fp8_checkpoints):
    """Experts placed whole on two ranks; with EPLB rebalancing every 4 steps, FP8 experts move
    between ranks as their panels (and a copy of each hot one is kept)."""
    fp8_dir, float_dir = fp8_checkpoints["deepseek-v3"]
    balancing = dict(enable_eplb=True, eplb_config={"step_interval": 4, "window_size": 4,
                                                     "num_redundant_experts": 2}) if eplb else {}
    llm = LLM(fp8_dir, dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2, enable_expert_parallel=True,
              **balancing)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)] == \
            _tokens(float_dir)
        assert not eplb or llm.stats()["eplb"]["rebalances"] > 0
    finally:
        llm.shutdown()


def test_checkpoint_kv_scales_reach_an_fp8_kv_cache(fp8_checkpoints):
    """compressed-tensors' self_attn.k_scale / v_scale: each attention layer writes its FP8 cache
    divided by them; the tokens stay within the float cache's top 5."""
    fp8_dir, _ = fp8_checkpoints["compressed-tensors"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(fp8_dir, dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype=kv)
        runs[kv] = llm.generate(_prompts(), params, use_tqdm=False)
        layers = llm.engine.engine_core.engine_core.executor.worker.runner.attention_layers()   # tp=1: here
        assert all((a.k_scale, a.v_scale) == (pytest.approx(0.05), pytest.approx(0.02)) for a in layers)
        llm.shutdown()
    for r, o in zip(runs["auto"], runs["fp8"]):
        for i, token in enumerate(o.outputs[0].token_ids):
            assert token in r.outputs[0].logprobs[i]
            if token != r.outputs[0].token_ids[i]:
                break
