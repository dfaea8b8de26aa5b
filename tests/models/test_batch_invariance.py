"""--batch-invariant (the default) and --no-batch-invariant on CPU: by default a prompt's greedy
tokens do not depend on the requests it runs with; without it, bfloat16 products of many rows run
on the AMX tiles where the CPU has them, and the outputs stay within transformers' top 5."""

import pytest
import torch

from shardlm import LLM, SamplingParams, kernels
from tests.models.test_tiny_models_vs_hf import MAX_TOKENS, PARAMS, _prompts


def test_a_prompts_tokens_do_not_depend_on_its_batch(tiny_model_dir):
    """Bit for bit: tokens and log-probabilities of a short prompt and of a long one (whose chunk
    takes the unmasked prefill attention) alone and among others."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    long = {"prompt_token_ids": [(37 * i) % 30000 + 100 for i in range(150)]}
    prompts = [*_prompts(), long]
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="bfloat16", kv_cache_memory="32MiB", enable_prefix_caching=False)
    try:
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in (prompts[2], long)]
        batched = llm.generate(prompts * 3, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for one, among in zip(alone, (batched[2].outputs[0], batched[-1].outputs[0])):
        assert one.token_ids == among.token_ids and one.logprobs == among.logprobs


@pytest.mark.skipif("amx" not in kernels.supported_isas(), reason="this CPU has no AMX tiles")
def test_amx_for_many_rows_stays_within_transformers_top5(tiny_model_dir, hf):
    path = tiny_model_dir("llama-gqa")
    reference = hf.greedy(path, _prompts(), MAX_TOKENS, dtype=torch.float32)
    llm = LLM(path, dtype="bfloat16", kv_cache_memory="32MiB", batch_invariant=False,
              distributed_executor_backend="uni")
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
        kernels.use_amx(0)          # this process's kernels (the engine ran in it)
    hf.assert_close(reference, outs, "bfloat16 on AMX tiles")
