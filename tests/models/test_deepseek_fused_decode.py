"""The one-call decode step of a stage's DeepSeek layers (models/deepseek_cpu_decode.py): the same
tokens and log-probabilities, bit for bit, as the layer-by-layer path, for V3 (q LoRA, sigmoid
routing over groups, a dense first layer, a shared expert), V2 (softmax, group-limited) and
V2-Lite (a plain q_proj), under tensor and expert parallel (the C loop calls back for both
groups' all-reduces) and with EPLB moving experts between steps; and it is really taken."""

import pytest
import torch

from shardlm import LLM, kernels
from shardlm.layers.cpu_matmul import goes_into_panels
from tests.models.test_fused_decode import _both_paths

pytestmark = pytest.mark.skipif(kernels.latent_decode_layers() is None, reason="no C compiler")


def _needs_panels(dtype: str) -> None:
    """The model's weights, and the routers' float32 ones, in the blocked panels (float32: AVX-512 only)."""
    for kind in {dtype, "float32"}:
        if not goes_into_panels(torch.empty(2, 2, dtype=getattr(torch, kind))):
            pytest.skip(f"{kind} weights are not in the blocked panels on this CPU (float32: AVX-512 only)")


@pytest.mark.parametrize("name, dtype", [("deepseek-v3", "float32"), ("deepseek-v3", "bfloat16"),
                                         ("deepseek-v2", "float32"), ("deepseek-v2-lite", "bfloat16")])
def test_fused_deepseek_decode_equals_the_layer_by_layer_path(name, dtype, tiny_model_dir):
    _needs_panels(dtype)
    results = _both_paths(LLM(tiny_model_dir(name), dtype=dtype, kv_cache_memory="64MiB",
                              enable_prefix_caching=False, distributed_executor_backend="uni"))
    assert results[True] == results[False]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"enable_expert_parallel": True},
                                   {"enable_expert_parallel": True, "enable_eplb": True,
                                    "eplb_config": {"step_interval": 4, "window_size": 4,
                                                    "num_redundant_experts": 2}}],
                         ids=["tp2", "tp2-ep", "tp2-ep-eplb"])
def test_fused_deepseek_decode_under_tensor_and_expert_parallel(extra, tiny_model_dir):
    _needs_panels("float32")
    results = _both_paths(LLM(tiny_model_dir("deepseek-v3"), dtype="float32", tensor_parallel_size=2,
                              kv_cache_memory="64MiB", enable_prefix_caching=False, **extra))
    assert results[True] == results[False]
