"""Greedy outputs of tiny random-weight models equal Hugging Face transformers' (float32)."""

import random

import pytest

from shardlm import LLM, SamplingParams

MAX_TOKENS = 24


def _prompts(n=6, seed=1):
    rng = random.Random(seed)
    lengths = [3, 17, 40, 64, 95, 130][:n]
    return [[rng.randrange(100, 40000) for _ in range(L)] for L in lengths]


PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied-llama3rope", "qwen2-bias", "mistral", "mixtral",
                                  "qwen2-moe", "qwen3-moe", "qwen3", "granite", "smollm3", "mistral-window",
                                  "qwen2-window", "gemma2", "gemma3", "gemma3-multimodal", "phi3",
                                  "olmo2", "gpt-oss", "deepseek-v2", "deepseek-v2-lite", "deepseek-v3"])
def test_batch_matches_hf(name, tiny_model_dir, references, hf):
    llm = LLM(tiny_model_dir(name), dtype="float32", kv_cache_memory="64MiB")
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    exact = hf.assert_close(references(name), outs, name)
    assert exact >= 4, f"only {exact}/6 sequences equal HF exactly"


ENGINE_VARIANTS = {
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "small-prefill-chunks": dict(max_num_batched_tokens=16),
    "preemption": dict(kv_cache_memory=0, max_model_len=256),   # kv size set in the test
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_engine_variants_give_identical_outputs(variant, tiny_model_dir, references, hf):
    """Prefix caching, chunked prefill and preemption must not change any output."""
    path = tiny_model_dir("llama-gqa")
    kwargs = dict(ENGINE_VARIANTS[variant])
    if variant == "preemption":
        # 2 layers x 2 kv heads x 16 dims x 4 bytes x 2 (K, V) x 16 tokens = 8 KiB per block;
        # 20 blocks hold one 256-token request but not all six prompts with their outputs.
        kwargs["kv_cache_memory"] = 8192 * 21
    baseline = LLM(path, dtype="float32", kv_cache_memory="64MiB").generate(_prompts(), PARAMS, use_tqdm=False)
    llm = LLM(path, dtype="float32", **{"kv_cache_memory": "64MiB", **kwargs})
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    if variant == "preemption":
        assert llm.stats()["num_preemptions"] > 0
    hf.assert_close(references("llama-gqa"), outs, variant)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline]


@pytest.mark.parametrize("name", ["mistral-window", "gemma3"])
def test_a_sliding_window_holds_over_prefill_chunks_cached_prefixes_and_preemption(name, tiny_model_dir, references,
                                                                                   hf):
    """Chunks of 16 tokens (windows of 8: prompts up to 16 windows long), prompts whose first blocks
    are cached, and a KV cache too small for the batch give transformers' tokens, with the windowed
    layers' blocks freed behind their windows (kv_cache_groups.py) and kept (the hybrid manager
    off). Every model here holds 8 KiB a block id: 2 layers x 2 KV heads x 16 dims x 4 bytes x 2 x
    16 tokens (Gemma 3's 4 layers, 2 windowed, kept in two groups of 2; 16 KiB with the manager off)."""
    path = tiny_model_dir(name)
    llm = LLM(path, dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=16)
    for _ in range(2):          # the second pass reads its prompts' blocks from the prefix cache
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        assert hf.assert_close(references(name), outs, f"{name} chunked") >= 4
    assert llm.stats()["prefix_cache_hits"] > 0
    for hybrid in (True, False):
        per_block = 16384 if name == "gemma3" and not hybrid else 8192
        small = LLM(path, dtype="float32", kv_cache_memory=per_block * 21, max_model_len=256,
                    max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=not hybrid)
        outs = small.generate(_prompts(), PARAMS, use_tqdm=False)
        # 20 usable blocks: the six requests' full-attention positions need 33; windows alone, 2 each
        assert (small.stats()["num_preemptions"] > 0) == (name == "gemma3" or not hybrid)
        assert hf.assert_close(references(name), outs, f"{name} preempted, hybrid={hybrid}") >= 4


@pytest.mark.parametrize("max_model_len, lengths", [
    (128, (3, 17, 40, 64, 90, 100)),                                                        # short factors
    pytest.param(512, (130, 140, 160, 200, 250, 300), marks=pytest.mark.slow)])              # long factors
def test_longrope_ranges_and_a_partial_rotary_embedding_match_hf(max_model_len, lengths, tiny_model_dir, hf):
    """Phi-4-mini's shape: LongRoPE's factors are chosen once from max_model_len; transformers
    picks them by the sequence's length, so each range is compared with sequences that stay in it
    (within 128 positions, or past them from the prompt on). 12 of each head's 16 dims rotate."""
    path = tiny_model_dir("phi4-mini")
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]
    outs = LLM(path, dtype="float32", kv_cache_memory="64MiB", max_model_len=max_model_len).generate(
        prompts, PARAMS, use_tqdm=False)
    assert hf.assert_close(hf.greedy(path, prompts, MAX_TOKENS), outs, f"phi4-mini {max_model_len}") >= 4


def _to_mxfp4(weights):
    """transformers' float experts [E, C, R] -> (blocks [E, R, C / 32, 16], scales [E, R, C / 32]) and
    the float values they hold: each group of 32 scaled by a power of two into e2m1's range and
    rounded to its nearest value."""
    import torch

    from shardlm.models.gpt_oss import _FP4_VALUES
    rows = weights.transpose(1, 2)                                           # [E, R, C]
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    lut = torch.tensor(_FP4_VALUES)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1)                   # nearest e2m1 value
    values = lut[codes] * torch.exp2(exponent).unsqueeze(-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8), values.reshape(rows.shape).transpose(1, 2).contiguous()


@pytest.mark.slow
def test_mxfp4_experts_as_shipped_are_dequantized_at_load(tiny_model_dir, tmp_path, hf):
    """GPT-OSS ships its experts in MXFP4: a checkpoint of blocks and scales gives transformers'
    tokens on the float weights they stand for."""
    import shutil

    from safetensors.torch import load_file, save_file
    src = tiny_model_dir("gpt-oss")
    weights = load_file(f"{src}/model.safetensors")
    packed, floats = {}, {}
    for name, t in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, values = _to_mxfp4(t.float())
            packed[name + "_blocks"], packed[name + "_scales"], floats[name] = blocks, scales, values
        else:
            packed[name] = floats[name] = t
    for where, tensors in (("mxfp4", packed), ("float", floats)):
        shutil.copytree(src, tmp_path / where)
        save_file(tensors, str(tmp_path / where / "model.safetensors"), metadata={"format": "pt"})
    outs = LLM(str(tmp_path / "mxfp4"), dtype="float32", kv_cache_memory="64MiB").generate(
        _prompts(), PARAMS, use_tqdm=False)
    assert hf.assert_close(hf.greedy(str(tmp_path / "float"), _prompts(), MAX_TOKENS), outs, "mxfp4") >= 4


def test_prefix_cache_hits_keep_outputs(tiny_model_dir):
    path = tiny_model_dir("qwen2-bias")
    llm = LLM(path, dtype="float32", kv_cache_memory="64MiB")
    prompts = _prompts()
    shared = prompts[5][:100]
    with_prefix = [shared + p[:20] for p in prompts]
    first = llm.generate(with_prefix, PARAMS, use_tqdm=False)
    again = llm.generate(with_prefix, PARAMS, use_tqdm=False)
    assert all(o.num_cached_tokens >= 96 for o in again)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    cold = LLM(path, dtype="float32", enable_prefix_caching=False, kv_cache_memory="64MiB")
    ref = cold.generate(with_prefix, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ref] == [o.outputs[0].token_ids for o in first]


def test_sharded_checkpoint_loads_the_same(tiny_model_dir, tmp_path):
    """A checkpoint split over several safetensors files with an index loads like a single file."""
    import os
    import shutil

    import torch
    from transformers import AutoModelForCausalLM
    src = tiny_model_dir("qwen2-bias")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    for f in os.listdir(src):
        if f.startswith("tokenizer") or f.endswith(".jinja"):
            shutil.copy(os.path.join(src, f), tmp_path)
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = LLM(src, dtype="float32", kv_cache_memory="16MiB").generate(_prompts(3), sp, use_tqdm=False)
    b = LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB").generate(_prompts(3), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
