"""The embedded default model (SmolLM2-135M-Instruct) in float32: shardlm's greedy outputs
equal transformers' token for token over 128 tokens, 8 prompts submitted as one batch."""

import json
import os

import pytest

from shardlm import LLM, SamplingParams
from shardlm.kernels import blocked_int4

PROMPTS = json.load(open(os.path.join(os.path.dirname(__file__), "..", "data", "default_model_prompts.json")))


@pytest.fixture(scope="module")
def reference(default_model_dir, hf):
    """transformers' greedy outputs (and top-5 sets) over 128 tokens, once for the module (the 8
    prompts in one padded batch: the same tokens as one at a time, in a quarter of the time)."""
    return hf.greedy(default_model_dir, [p["token_ids"] for p in PROMPTS["prompts"]], 128, batched=True)


@pytest.mark.slow
def test_default_model_matches_hf_token_for_token(reference, hf):
    prompts = [p["token_ids"] for p in PROMPTS["prompts"]]
    ref = reference
    llm = LLM(dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    exact = hf.assert_close(ref, outs, "default model")
    assert exact == 8, f"{exact}/8 prompts equal transformers token for token"
    assert all(o.outputs[0].text for o in outs)


def test_default_model_chat_is_coherent():
    llm = LLM(dtype="float32")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_default_model_from_its_q4_1_file(reference, hf):
    """--quantization gguf: the linears stay in the file's Q4_1 blocks, the tied embedding / LM
    head in its Q8_0 ones. In float32 it equals
    transformers on the float conversion (the blocked kernel widens each weight with one rounding,
    the conversion with two: near-ties may part); in bfloat16 it parts from it only at near-ties."""
    prompts = [p["token_ids"] for p in PROMPTS["prompts"]]
    ref = [(ids[:48], top[:48]) for ids, top in reference]      # greedy: the first 48 of the 128
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)
    exact = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, quantization="gguf")
        try:
            kernels = llm.collective_rpc("quantized_kernels")[0]
            if blocked_int4() is not None:      # AVX-512: 4-bit panels in both dtypes, the Q8_0 table in 8-bit ones
                assert kernels == {"blocked4": 120, "blocked8": 2}      # the embedding and its tied LM head
            else:
                assert kernels == ({"none": 120} if dtype == "float32" else {"int4pack": 120})
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
        exact[dtype] = hf.assert_close(ref, outs, f"Q4_1 {dtype}")
    assert exact["float32"] >= 7, exact
    print("prompts equal to transformers over 48 tokens:", exact)
