"""Every architecture on one CUDA device, in float32, against transformers (on the CPU, the
references every CPU test uses): sliding windows, soft-caps and attention sinks in the CUDA
backend, its graph-captured decode steps included."""

import pytest

from shardlm import LLM
from tests.models.test_tiny_models_vs_hf import PARAMS, _prompts

FAMILIES = ["qwen3", "granite", "smollm3", "mistral-window", "qwen2-window", "gemma2", "gemma3", "gemma3-multimodal",
            "gemma3-12-layers", "deepseek-v3", "deepseek-v2-lite",
            "phi3", "olmo2", "gpt-oss", "qwen3-moe"]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_matches_hf_on_cuda(name, tiny_model_dir, references, hf):
    llm = LLM(tiny_model_dir(name), dtype="float32", device="cuda", gpu_memory_utilization=0.3)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    assert hf.assert_close(references(name), outs, f"{name} on CUDA") >= 4
