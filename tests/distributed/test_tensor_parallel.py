"""Tensor parallel across worker processes (mp executor, gloo + shared memory on CPU): outputs
equal transformers' and the single-process engine's, the weights split, the errors help, and a
dead worker fails the engine fast with no process left behind."""

import os

import psutil
import pytest

from shardlm import LLM, SamplingParams
from shardlm.executor.base import WorkerDiedError
from tests.distributed.worker_kill import assert_killed_rank_fails_fast
from tests.models.test_tiny_models_vs_hf import PARAMS, _prompts


def _workers(llm):
    return [psutil.Process(p.pid) for p in llm.engine.engine_core.engine_core.executor.procs]


@pytest.mark.slow
@pytest.mark.parametrize("name,tp", [("llama-gqa", 2), ("llama-gqa", 4), ("qwen2-bias", 2),
                                     ("llama-tied-llama3rope", 2), ("mixtral", 2), ("qwen2-moe", 2),
                                     ("qwen3-moe", 2), ("gemma3", 2),     # its window layers in KV cache groups
                                     ("deepseek-v2", 2),                  # latent attention, grouped routing
                                     ("olmo2", 4)])      # its k norm over KV heads held twice each
def test_tp_matches_hf(name, tp, tiny_model_dir, references, hf):
    """tp=4 on 2 KV heads replicates each KV head on two ranks."""
    llm = LLM(tiny_model_dir(name), dtype="float32", kv_cache_memory="64MiB", tensor_parallel_size=tp)
    try:
        assert llm.engine.config.parallel.distributed_executor_backend == "mp"
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        exact = hf.assert_close(references(name), outs, f"{name} tp={tp}")
        assert exact >= 4, f"only {exact}/6 sequences equal HF exactly"
    finally:
        workers = _workers(llm)
        llm.shutdown()
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_tp2_weights_are_half_per_rank(tiny_model_dir):
    path = tiny_model_dir("llama-gqa")
    one = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    full = one.collective_rpc("weight_bytes")[0]
    two = LLM(path, dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2)
    try:
        per_rank = two.collective_rpc("weight_bytes")
    finally:
        two.shutdown()
    assert len(per_rank) == 2
    for b in per_rank:       # everything is split but the norms
        assert abs(b - full / 2) / (full / 2) < 0.03, (per_rank, full)


@pytest.mark.slow
def test_tp2_with_prefix_cache_chunked_prefill_and_preemption_equals_tp1(tiny_model_dir):
    path = tiny_model_dir("llama-gqa")
    prompts = _prompts()
    shared = [prompts[5][:100] + p[:20] for p in prompts]     # prefix-cache hits on the second pass
    # 8 KiB per block at tp=1 (see the engine-core test), 4 KiB per rank at tp=2: 20 blocks
    small = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    base = LLM(path, kv_cache_memory=8192 * 21, **small)
    expected = [o.outputs[0].token_ids for o in base.generate(prompts + shared, PARAMS, use_tqdm=False)]
    llm = LLM(path, kv_cache_memory=4096 * 21, tensor_parallel_size=2, **small)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts + shared, PARAMS, use_tqdm=False)]
        again = llm.generate(shared, PARAMS, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert stats["num_preemptions"] > 0
    assert got == expected
    assert [o.outputs[0].token_ids for o in again] == expected[len(prompts):]
    assert any(o.num_cached_tokens >= 96 for o in again)


@pytest.mark.slow
def test_default_model_tp3_equals_tp1():
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "List three colours:"]
    ref = LLM(dtype="float32", kv_cache_memory="1GiB", max_model_len=1024).generate(prompts, sp, use_tqdm=False)
    llm = LLM(dtype="float32", kv_cache_memory="1GiB", max_model_len=1024, tensor_parallel_size=3)
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_invalid_tp_sizes_list_the_valid_ones(tiny_model_dir):
    with pytest.raises(ValueError, match=r"4 attention heads and 2 KV heads.*Valid tensor parallel sizes are 1, 2, 4"):
        LLM(tiny_model_dir("llama-gqa"), tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"9 attention heads and 3 KV heads.*Valid tensor parallel sizes are 1, 3"):
        LLM(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        LLM(tiny_model_dir("llama-gqa"), tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="one group per rank"):
        LLM(tiny_model_dir("llama-gqa"), tensor_parallel_size=2, cpu_threads_bind="0")


@pytest.mark.slow
def test_killed_worker_fails_generate_fast_and_leaves_no_process(tiny_model_dir):
    assert_killed_rank_fails_fast(tiny_model_dir("llama-gqa"), rank=1, tensor_parallel_size=2)



@pytest.mark.slow
def test_worker_start_up_error_reaches_the_caller(tiny_model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    src = tiny_model_dir("llama-gqa")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    weights = load_file(os.path.join(src, "model.safetensors"))
    weights.pop("model.layers.1.mlp.down_proj.weight")
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WorkerDiedError, match=r"rank \d .*lacks weights for: model.layers.1.mlp.down_proj.weight"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2)
