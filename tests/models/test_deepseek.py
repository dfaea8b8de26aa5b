"""DeepSeek-V2/V3 (models/deepseek.py): the KV cache holds the latent alone; the latent cache holds
over chunked prefill, prefix-cache hits and preemption, and decode context parallel spreads it;
the MTP layer drafts. (Outputs against transformers on every layout: test_tiny_models_vs_hf,
tests/distributed.)"""

import pytest
import torch

from shardlm import LLM
from shardlm.layers.cpu_matmul import goes_into_panels
from tests.models.test_tiny_models_vs_hf import PARAMS, _prompts

# the tiny V3: 3 layers, 4 heads; latent 16 + rotary 8 dims; k_nope 16, v 16 per head
LATENT, HEADS, QK, V, LAYERS = 16 + 8, 4, 16 + 8, 16, 3


def test_the_cache_holds_the_latent_not_each_heads_keys_and_values(tiny_model_dir):
    """float32, 16-token blocks: 3 layers x 24 values x 4 bytes = 288 bytes a token, where plain
    multi-head K/V would take 3 x 4 heads x (24 + 16) x 4 = 1,920 (6.7x)."""
    memory = 4 << 20
    llm = LLM(tiny_model_dir("deepseek-v3"), dtype="float32", kv_cache_memory=memory)
    per_token = LAYERS * LATENT * 4
    assert llm.stats()["kv_cache_tokens"] == (memory // (16 * per_token) - 1) * 16
    assert LAYERS * HEADS * (QK + V) * 4 / per_token == pytest.approx(6.67, abs=0.01)
    llm.shutdown()


def test_chunks_cached_prefixes_and_preemption_give_transformers_tokens(tiny_model_dir, references, hf):
    """Chunks of 16 tokens, a second pass from the prefix cache, then a cache of 20 blocks (one
    256-token request, not six); decode steps in one C call where the CPU's panels take float32."""
    path = tiny_model_dir("deepseek-v3")
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=16)
    for _ in range(2):
        assert hf.assert_close(references("deepseek-v3"), llm.generate(_prompts(), PARAMS, use_tqdm=False),
                               "deepseek-v3 chunked") >= 4
    assert llm.stats()["prefix_cache_hits"] > 0
    llm.shutdown()
    small = LLM(path, dtype="float32", kv_cache_memory=16 * LAYERS * LATENT * 4 * 21, max_model_len=256)
    outs = small.generate(_prompts(), PARAMS, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    assert hf.assert_close(references("deepseek-v3"), outs, "deepseek-v3 preempted") >= 4
    if goes_into_panels(torch.empty(2, 2)):          # decode steps in one C call (deepseek_cpu_decode.py)
        assert sum(small.collective_rpc("fused_decode_steps")) > 0
    small.shutdown()


@pytest.mark.slow
def test_decode_context_parallel_spreads_the_latent_cache(tiny_model_dir, references, hf):
    """The latent is the same on every tensor parallel rank: -dcp 2 at -tp 2 holds twice the
    tokens in the same memory per rank, and transformers' tokens."""
    path = tiny_model_dir("deepseek-v3")
    tokens = {}
    for dcp in (1, 2):
        llm = LLM(path, dtype="float32", kv_cache_memory="4MiB", tensor_parallel_size=2,
                  decode_context_parallel_size=dcp)
        try:
            outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
            tokens[dcp] = llm.stats()["kv_cache_tokens"]
        finally:
            llm.shutdown()
        assert hf.assert_close(references("deepseek-v3"), outs, f"deepseek-v3 tp=2 dcp={dcp}") >= 4
    assert tokens[2] == 2 * tokens[1]


def test_the_mtp_layer_proposes_and_greedy_outputs_stay_exact(tiny_model_dir):
    """Speculative method mtp (and vLLM's older name deepseek_mtp) drafts with the checkpoint's own
    multi-token-prediction layer: the same tokens as without it, with proposals verified."""
    path = tiny_model_dir("deepseek-v3-mtp")
    plain = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    want = [o.outputs[0].token_ids for o in plain.generate(_prompts(), PARAMS, use_tqdm=False)]
    plain.shutdown()
    for method in ("mtp", "deepseek_mtp"):
        llm = LLM(path, dtype="float32", kv_cache_memory="16MiB",
                  speculative_config={"method": method, "num_speculative_tokens": 2})
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        stats = llm.stats()
        llm.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == want
        assert stats["spec_num_drafts"] > 0         # (a random layer: its proposals are rarely right)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, decode_context_parallel_size=2)], ids=["tp2-dcp2"])
def test_the_mtp_layer_under_context_parallel(layout, tiny_model_dir):
    """The latent KV cache spread over the decode context parallel ranks, the MTP layer's own
    whole on the rank that samples: the same tokens as on one rank, with proposals verified (a
    random layer's are rarely right: test_spec_decode's draft that is its target checks the
    cache at -dcp and -pcp, and its EAGLE-3 head the -pcp gather)."""
    path = tiny_model_dir("deepseek-v3-mtp")
    engine = dict(dtype="float32", kv_cache_memory="16MiB", speculative_config={"method": "mtp",
                                                                                 "num_speculative_tokens": 2})
    got, stats = {}, {}
    for name, extra in (("one rank", {}), ("cp", layout)):
        llm = LLM(path, **engine, **extra)
        try:
            got[name] = [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)]
            stats[name] = llm.stats()
        finally:
            llm.shutdown()
    assert got["cp"] == got["one rank"]
    assert stats["cp"]["spec_num_drafts"] > 0


def test_mtp_without_the_layer_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="no multi-token-prediction layer"):
        LLM(tiny_model_dir("deepseek-v3"), dtype="float32", kv_cache_memory="16MiB",
            speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="needs a model with multi-token-prediction layers"):
        LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB",
            speculative_config={"method": "mtp"})
