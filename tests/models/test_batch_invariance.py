"""--batch-invariant (the default) and --no-batch-invariant on CPU: by default a prompt's greedy
tokens do not depend on the requests it runs with, also where bfloat16 products run on the AMX
tiles from one row; without it, bfloat16 products of many rows run on the AMX tiles, and the
outputs stay within transformers' top 5. The AMX tests run on the CPU's tiles where it has them
and on their plain-C model (kernels/amx_emulated.h) wherever AVX512-BF16 is."""

import pytest
import torch

from shardlm import LLM, SamplingParams, cpu_plan
from shardlm.kernels import amx
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


def test_amx_for_many_rows_stays_within_transformers_top5(amx_variant, tiny_model_dir, hf, tmp_path):
    """--no-batch-invariant with the CPU plan's AMX from 8 rows (prefill and batched decode there)."""
    path = tiny_model_dir("llama-gqa")
    plan = tmp_path / "plan.json"
    plan.write_text(cpu_plan.CpuPlan(choices={"amx_rows": {amx.plan_key(k, False): 8 for k in amx.KINDS}}).to_json())
    reference = hf.greedy(path, _prompts(), MAX_TOKENS, dtype=torch.float32)
    cpu_plan.forget()
    llm = LLM(path, dtype="bfloat16", kv_cache_memory="32MiB", batch_invariant=False,
              distributed_executor_backend="uni", cpu_plan=str(plan))
    try:
        before = amx.calls()
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        assert amx.calls() > before
    finally:
        llm.shutdown()
        amx.off()          # this process's kernels (the engine ran in it)
        cpu_plan.forget()
    hf.assert_close(reference, outs, "bfloat16 on AMX tiles")


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_amx_at_every_row_count_keeps_batch_invariance(quantization, amx_variant, tiny_model_dir, tmp_path):
    """Where the CPU plan puts bfloat16 products on the AMX tiles from one row (under
    --batch-invariant: where one row costs no more there), a prompt's tokens and log-probabilities
    are the same alone and among others, and the one-call decode step equals the layer-by-layer
    path, bit for bit: for bfloat16 weights, 8-bit and 4-bit ones. On the plain-C model of the tiles where
    the CPU has none."""
    kind = {None: "bfloat16", "int8": "eight_bit", "int4": "four_bit"}[quantization]
    plan = tmp_path / "plan.json"
    choices = {"amx_rows": {amx.plan_key(k, True): int(k == kind) for k in amx.KINDS}}
    plan.write_text(cpu_plan.CpuPlan(choices=choices).to_json())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [(37 * i + 11 * j) % 30000 + 100 for i in range(20 + 9 * j)]} for j in range(3)]
    cpu_plan.forget()
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="bfloat16", kv_cache_memory="32MiB", enable_prefix_caching=False,
              distributed_executor_backend="uni", cpu_plan=str(plan), quantization=quantization,
              quantization_group_size={"int8": -1, "int4": 32}.get(quantization))
    tokens = lambda outs: [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]  # noqa: E731
    try:
        before = amx.calls()
        batched = tokens(llm.generate(prompts, params, use_tqdm=False))
        assert amx.calls() - before >= 12 * 7      # every decode step's products, at least, ran on the tiles
        assert [tokens(llm.generate([p], params, use_tqdm=False))[0] for p in prompts] == batched
        llm.collective_rpc("set_enforce_eager", (True,))
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == batched
    finally:
        llm.shutdown()
        amx.off()
        cpu_plan.forget()
