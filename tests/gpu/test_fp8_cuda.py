"""FP8 on one CUDA device: weights with one scale per row multiplied by torch._scaled_mm (the
activations quantized per token) on GPUs with FP8, others dequantized per product; an FP8
checkpoint gives its dequantized model's tokens; the FP8 KV cache stays within the float cache's
top 5."""

import pytest
import torch
import torch.nn.functional as F

from shardlm import LLM, SamplingParams
from shardlm.layers.fp8 import Fp8LinearWeight, dequantize_fp8, quantize_fp8
from tests.models.test_fp8_checkpoints import _fp8_linears, fp8_checkpoints  # noqa: F401 (a fixture)
from tests.models.test_tiny_models_vs_hf import PARAMS, _prompts

CUDA = torch.device("cuda")
HAS_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("scheme", ["fp8_per_channel", "fp8_per_block"])
def test_fp8_product_on_cuda_is_the_dequantized_one(scheme):
    torch.manual_seed(0)
    w = torch.randn(256, 512, device=CUDA) / 16
    q, scales = quantize_fp8(w, scheme)
    weight = Fp8LinearWeight(q, scales, torch.bfloat16)
    per_row = scheme == "fp8_per_channel"
    assert weight.kernel == ("scaled_mm" if per_row and HAS_FP8 else None)
    x = torch.randn(7, 512, device=CUDA).to(torch.bfloat16)
    bias = torch.randn(256, device=CUDA).to(torch.bfloat16)
    want = F.linear(x.float(), dequantize_fp8(q, scales, torch.float32), bias.float())
    got = weight.matmul(x, bias).float()
    # the activations' per-token FP8 (3 mantissa bits) costs a few percent of each output's norm
    assert (got - want).norm() / want.norm() < (0.05 if weight.kernel == "scaled_mm" else 0.01)


def test_fp8_checkpoint_on_cuda_gives_its_dequantized_models_tokens(fp8_checkpoints):  # noqa: F811
    fp8_dir, float_dir = fp8_checkpoints["fp8-block"]
    tokens = {}
    for path in (fp8_dir, float_dir):
        llm = LLM(path, dtype="float32", device="cuda", gpu_memory_utilization=0.3)
        try:
            tokens[path] = [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)]
            if path == fp8_dir:
                assert _fp8_linears(llm) == (8, 8)
        finally:
            llm.shutdown()
    assert tokens[fp8_dir] == tokens[float_dir]


def test_online_fp8_and_an_fp8_kv_cache_on_cuda_stay_in_the_top5(tiny_model_dir):
    """bfloat16, --quantization fp8 (scaled_mm where the GPU has FP8) and --kv-cache-dtype fp8: each
    greedy token up to the first difference is within the plain run's top 5."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    runs = {}
    for name, kw in (("plain", {}), ("fp8", {"quantization": "fp8"}), ("kv", {"kv_cache_dtype": "fp8"})):
        llm = LLM(tiny_model_dir("llama-gqa"), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, **kw)
        try:
            runs[name] = llm.generate(_prompts(), params, use_tqdm=False)
            if name == "fp8":
                kernels = llm.collective_rpc("quantized_kernels")[0]
                assert kernels == ({"scaled_mm": 8} if HAS_FP8 else {"none": 8}), kernels
        finally:
            llm.shutdown()
    for name in ("fp8", "kv"):
        for r, o in zip(runs["plain"], runs[name]):
            for i, token in enumerate(o.outputs[0].token_ids):
                assert token in r.outputs[0].logprobs[i], f"{name} position {i}"
                if token != r.outputs[0].token_ids[i]:
                    break
