"""FP8 checkpoints in the three formats that ship (model_loader/fp8.py), written here from a tiny
Llama's weights quantized by the test: loaded without a flag, their weights dequantized, they give
the tokens of the same model stored as those dequantized weights in float32 (and so transformers')
at tp=1, and at tp=2 with scale blocks straddling the shard boundary."""

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


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_an_fp8_checkpoint_gives_its_dequantized_models_tokens(fmt, fp8_checkpoints, hf):
    fp8_dir, float_dir = fp8_checkpoints[fmt]
    want = _tokens(float_dir)
    assert _tokens(fp8_dir) == want
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
def test_deepseek_in_fp8_with_expert_parallel(fp8_checkpoints):
    """DeepSeek-V3's own format (blocks of weight_scale_inv) on its latent projections and experts,
    experts placed whole on two ranks."""
    fp8_dir, float_dir = fp8_checkpoints["deepseek-v3"]
    assert _tokens(fp8_dir, tensor_parallel_size=2, enable_expert_parallel=True) == _tokens(float_dir)


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
