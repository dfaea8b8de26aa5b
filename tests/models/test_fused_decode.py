"""The one-call decode path of a stage's Llama layers (models/llama_cpu_decode.py) gives the
same tokens and the same log-probabilities, bit for bit, as the layer-by-layer path; and it is
really taken on decode steps."""

import pytest

from shardlm import LLM, SamplingParams, kernels
from shardlm.models import llama_cpu_decode

pytestmark = pytest.mark.skipif(kernels.llama_decode_layers() is None, reason="no C compiler")

PROMPTS = [[101, 2054, 2003, 1037], [7592, 1010, 2088, 999, 102, 4000, 321] * 5]


@pytest.mark.parametrize("name, dtype, quantization, group", [
    ("llama-gqa", "float32", None, None), ("llama-gqa", "bfloat16", None, None), ("qwen2-bias", "float32", None, None),
    ("qwen2-bias", "bfloat16", None, None), ("qwen3", "bfloat16", None, None),       # q/k norms in the C step
    # the C step's residual multiplier, layers without rotary, partial rotary on full-width tables
    *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("qwen3", "float32", None, None), ("granite", "float32", None, None), ("granite", "bfloat16", None, None),
        ("smollm3", "bfloat16", None, None), ("phi3", "bfloat16", None, None))),
    ("qwen2-bias", "bfloat16", "int4", 32),      # 4-bit panels, where the blocked kernel is built
    ("llama-gqa", "bfloat16", "int8", -1),       # 8-bit panels, one scale per row (rows of 64 and 128 columns)
    ("llama-gqa", "bfloat16", "fp8", None),      # FP8 bytes in the 8-bit panels, one scale per row
    pytest.param("llama-gqa", "float32", "fp8_per_tensor", None, marks=pytest.mark.slow),
])
def test_fused_decode_equals_the_layer_by_layer_path(name, dtype, quantization, group, tiny_model_dir, monkeypatch):
    if quantization and quantization.startswith("int") and kernels.blocked_int4() is None:
        pytest.skip("quantized weights take the fused path only with the blocked kernel (AVX-512)")
    taken = []
    fused_call = llama_cpu_decode.FusedDecodeLayers.__call__

    def call(self, *args):
        out = fused_call(self, *args) if enabled else None
        taken.append(out is not None)
        return out

    monkeypatch.setattr(llama_cpu_decode.FusedDecodeLayers, "__call__", call)
    # no prefix caching: the second run must compute its prompts as the first did
    llm = LLM(tiny_model_dir(name), dtype=dtype, kv_cache_memory="64MiB", enable_prefix_caching=False,
              quantization=quantization, quantization_group_size=group)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    results = {}
    for enabled in (True, False):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        results[enabled] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        if enabled:
            assert sum(taken) >= 19, "decode steps should take the fused path"
    assert results[True] == results[False]


def _both_paths(llm, **generate) -> dict[bool, list]:
    """The same greedy run with the one-call path (True) and layer by layer (enforce_eager, False)
    in one engine: each sequence's tokens and log-probabilities; every rank takes the one-call
    path on at least 19 of the 20 decode steps, and none in the other run. Shuts the engine down."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    results = {}
    try:
        for fused in (True, False):
            llm.collective_rpc("set_enforce_eager", (not fused,))
            before = llm.collective_rpc("fused_decode_steps")
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, **generate)
            steps = [after - b for after, b in zip(llm.collective_rpc("fused_decode_steps"), before)]
            assert all(s >= 19 for s in steps) if fused else not any(steps), steps
            results[fused] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    finally:
        llm.shutdown()
    return results


@pytest.mark.parametrize("kv, dtype", [("fp8", "bfloat16"),
                                       pytest.param("fp8_e5m2", "float32", marks=pytest.mark.slow)])
def test_fused_decode_with_an_fp8_kv_cache_equals_the_layer_by_layer_path(kv, dtype, tiny_model_dir):
    """An FP8 KV cache: the one-call step writes and reads it with the same C kernels as the layer
    path's decode (paged_attention.c): the same tokens and log-probabilities, bit for bit."""
    results = _both_paths(LLM(tiny_model_dir("llama-gqa"), dtype=dtype, kv_cache_memory="64MiB",
                              enable_prefix_caching=False, kv_cache_dtype=kv, distributed_executor_backend="uni"))
    assert results[True] == results[False]


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype, dcp", [("llama-gqa", "float32", 1), ("qwen2-bias", "bfloat16", 1),
                                             ("llama-tied-llama3rope", "bfloat16", 2), ("qwen3", "bfloat16", 1)])
def test_fused_decode_under_tensor_parallel_equals_the_layer_by_layer_path(name, dtype, dcp, tiny_model_dir):
    """At tp=2 each rank's C loop calls back for the all-reduce after its row-parallel products
    (and under decode context parallel, for the query gather and the partials' exchange): the
    same tokens and log-probabilities, bit for bit, as the layer-by-layer path (enforce_eager,
    switched on in the same engine: where plain weights are multiplied, which kernel serves how
    many rows is measured at load, so two engines may choose differently); both ranks take it."""
    results = _both_paths(LLM(tiny_model_dir(name), dtype=dtype, tensor_parallel_size=2, kv_cache_memory="64MiB",
                              enable_prefix_caching=False, decode_context_parallel_size=dcp))
    assert results[True] == results[False]


@pytest.mark.parametrize("dtype, mix", [("float32", "one"), ("bfloat16", "one"), ("bfloat16", "two"),
                                        ("float32", "base+one")])
def test_fused_decode_with_lora_adapters_equals_the_layer_by_layer_path(dtype, mix, tiny_model_dir, tmp_path):
    """Steps with LoRA adapters take the one-call path too (each adapter's delta added to its
    rows in C, as lora/layers.py adds it): the same tokens and log-probabilities, bit for bit, with
    one adapter for every row, two adapters, or the base model and an adapter."""
    from shardlm import LoRARequest
    from tests.lora_adapters import write_adapter
    if kernels.blocked_matmul() is None or (dtype == "float32" and kernels.blocked_vector_bits() != 512):
        pytest.skip("LoRA slots go into the blocked kernel's panels only where it multiplies this dtype")
    path = tiny_model_dir("llama-gqa")
    a = LoRARequest("a", 1, write_adapter(path, tmp_path / "a", rank=8, seed=1))
    b = LoRARequest("b", 2, write_adapter(path, tmp_path / "b", rank=4, seed=2, targets=("q_proj", "down_proj")))
    lora = {"one": a, "two": [a, b], "base+one": [None, a]}[mix]
    results = _both_paths(LLM(path, dtype=dtype, kv_cache_memory="64MiB", enable_prefix_caching=False,
                              enable_lora=True, max_loras=2, distributed_executor_backend="uni"), lora_request=lora)
    assert results[True] == results[False]
