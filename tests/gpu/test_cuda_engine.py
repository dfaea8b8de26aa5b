"""The engine on one CUDA device: outputs against transformers in bfloat16 and float16, the CUDA
attention backend against plain attention, the KV budget from gpu_memory_utilization, and the
server's smoke test."""

import random

import pytest
import torch
import torch.nn.functional as F

from shardlm import LLM, SamplingParams
from tests.distributed.test_parallel_server import assert_server_answers_like_llm
from tests.helpers import start_server, stop_server
from tests.models.test_tiny_models_vs_hf import MAX_TOKENS, PARAMS, _prompts

CUDA = torch.device("cuda")


# float32 must equal HF as on CPU; in 16-bit types kernels round differently (SDPA vs paged
# attention, fused vs plain norms), so sequences may part, but only where HF's token is within
# a hair of ours in our own logprobs
@pytest.mark.parametrize("dtype, min_exact, max_margin", [(torch.float32, 4, 1e-3), (torch.bfloat16, 0, 0.1),
                                                          (torch.float16, 0, 0.02)])
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias"])
def test_engine_matches_hf_on_cuda(name, dtype, min_exact, max_margin, tiny_model_dir, hf):
    path = tiny_model_dir(name)
    ref = hf.greedy(path, _prompts(), MAX_TOKENS, dtype=dtype, device="cuda")
    llm = LLM(path, dtype=str(dtype).removeprefix("torch."), device="cuda", gpu_memory_utilization=0.3)
    try:
        assert llm.engine.config.device.type == "cuda"
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    exact = hf.assert_close(ref, outs, f"{name} {dtype}")
    margins = hf.divergence_margins(ref, outs)
    print(f"{name} {dtype}: {exact}/6 exact, divergence margins {margins}")
    assert exact >= min_exact, f"only {exact}/6 sequences equal HF exactly in {dtype}"
    assert max(margins, default=0) <= max_margin, f"{dtype}: parted from HF at a margin of {max(margins)} nats"


def _plain_attention(k_cache, v_cache, tables, lens, q_lens, q, scale):
    """Causal attention per sequence from a head-major paged cache, in float32."""
    H, Hkv, D = q.shape[1], k_cache.shape[0], q.shape[2]
    outs, t = [], 0
    for table, n, ql in zip(tables, lens, q_lens):
        keys = k_cache[:, table].reshape(Hkv, -1, D)[:, :n].float()
        vals = v_cache[:, table].reshape(Hkv, -1, D)[:, :n].float()
        qs = q[t:t + ql].float().transpose(0, 1)
        mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - ql, n, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qs, keys.repeat_interleave(H // Hkv, 0),
                                           vals.repeat_interleave(H // Hkv, 0), attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1).reshape(ql, H * D))
        t += ql
    return torch.cat(outs)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("q_lens", [None, [1, 7, 13, 1, 1, 30]], ids=["decode", "mixed"])
def test_cuda_attention_backend_matches_plain_attention(dtype, tol, q_lens, one_rank):
    from shardlm.attention.cuda import CudaAttention, CudaDecodeMetadata
    from shardlm.layers.attention import Attention

    H, Hkv, D, BS, NB = 8, 2, 64, 16, 128
    torch.manual_seed(0)
    random.seed(0)
    lens = [1, 9, 40, 17, 100, 64]
    q_lens = q_lens or [1] * len(lens)
    attn = Attention(H, Hkv, D, D ** -0.5)
    attn.backend = backend = CudaAttention(BS, CUDA, max_num_seqs=8, max_model_len=512)
    attn.k_cache = torch.randn(backend.kv_cache_shape(NB, Hkv, D), dtype=dtype, device=CUDA)
    attn.v_cache = torch.randn(backend.kv_cache_shape(NB, Hkv, D), dtype=dtype, device=CUDA)
    free = list(range(1, NB))
    random.shuffle(free)
    tables = []
    for n in lens:
        tables.append(free[:-(-n // BS)])
        free = free[len(tables[-1]):]
    for step in range(2):          # twice: the preallocated buffers are reused
        meta = backend.build_metadata(q_lens, [n - q for n, q in zip(lens, q_lens)], tables)
        assert isinstance(meta, CudaDecodeMetadata) == all(q == 1 for q in q_lens)
        T = sum(q_lens)
        q = torch.randn(T, H, D, dtype=dtype, device=CUDA)
        k, v = (torch.randn(T, Hkv, D, dtype=dtype, device=CUDA) for _ in range(2))
        out = attn(q, k, v, meta)
        ref = _plain_attention(attn.k_cache, attn.v_cache, tables, lens, q_lens, q, D ** -0.5)
        assert (out.float() - ref).abs().max() < tol, f"step {step}"


def test_cuda_graphs_give_the_eager_tokens(tiny_model_dir):
    """Decode steps replayed from CUDA graphs give the eager path's tokens and log-probabilities:
    batches padded to buckets (6 sequences -> 8, then fewer as they finish at different lengths:
    8, 4, 2, 1) and contexts crossing block buckets (1 to 16 blocks); --enforce-eager (switched in
    the same engine) runs no graph."""
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", device="cuda", gpu_memory_utilization=0.3,
              enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=10 + 9 * i, ignore_eos=True, logprobs=3) for i in range(6)]
    results = {}
    try:
        for graphs in (True, False):
            llm.collective_rpc("set_enforce_eager", (not graphs,))
            before = llm.collective_rpc("cuda_graph_steps")[0]
            outs = llm.generate(_prompts(), params, use_tqdm=False)
            steps = llm.collective_rpc("cuda_graph_steps")[0] - before
            assert steps >= 50 if graphs else steps == 0, steps
            results[graphs] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    finally:
        llm.shutdown()
    for (ids, logprobs), (eager_ids, eager_logprobs) in zip(results[True], results[False]):
        assert ids == eager_ids
        for step, eager_step in zip(logprobs, eager_logprobs):
            assert step.keys() == eager_step.keys()
            assert all(abs(step[t].logprob - eager_step[t].logprob) < 1e-4 for t in step)


def test_kv_budget_follows_gpu_memory_utilization(tiny_model_dir):
    path = tiny_model_dir("llama-gqa")
    blocks = {}
    for util in (0.2, 0.4):
        llm = LLM(path, dtype="bfloat16", device="cuda", gpu_memory_utilization=util, max_model_len=256)
        try:
            blocks[util] = llm.engine.num_blocks
            out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 4
        finally:
            llm.shutdown()
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 2      # K and V, 2 layers, 16 tokens, 2 KV heads, head dim 16, bf16
    total = torch.cuda.mem_get_info()[1]
    expected = 0.2 * total / bytes_per_block
    assert abs((blocks[0.4] - blocks[0.2]) - expected) < 0.05 * expected, (blocks, expected)


def test_server_smoke_on_cuda(tiny_model_dir):
    path = tiny_model_dir("llama-gqa")
    proc, url = start_server(path, "--device", "cuda", "--gpu-memory-utilization", "0.3")
    try:
        assert_server_answers_like_llm(url, path)
    finally:
        stop_server(proc)


@pytest.mark.parametrize("model, quantization", [(None, "gguf"), ("llama-gqa", "int8"), ("llama-gqa", "int4")])
def test_quantized_layers_on_cuda_give_the_cpu_tokens(model, quantization, tiny_model_dir, hf):
    """Quantized linears on CUDA (the default model's GGUF blocks, int8 and int4 quantized at load):
    the weights go to the GPU with the model (never read there by a CPU kernel) and give the CPU's
    tokens, parting only at near-ties (the CPU's 4-bit products round activations to int16)."""
    path = None if model is None else tiny_model_dir(model)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(path, dtype="float32", device=device, quantization=quantization, max_model_len=256,
                  kv_cache_memory="64MiB", gpu_memory_utilization=0.3, distributed_executor_backend="uni")
        try:
            if device == "cuda":
                assert set(llm.collective_rpc("quantized_kernels")[0]) == {"none"}   # dequantize + matmul
            outputs[device] = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
    cpu = [(o.outputs[0].token_ids, hf.top5_sets(o.outputs[0])) for o in outputs["cpu"]]
    exact = hf.assert_close(cpu, outputs["cuda"], f"{quantization} on cuda")
    margins = hf.divergence_margins(cpu, outputs["cuda"])
    assert exact >= 2 and max(margins, default=0) <= 0.05, (exact, margins)


def test_lora_adapters_on_cuda(tiny_model_dir, tmp_path, hf):
    """Base and two adapters in one batch on the GPU (CUDA graphs off with LoRA): each prompt gets
    transformers' tokens on its own merged model, in float32."""
    from shardlm import LoRARequest
    from tests.lora_adapters import merged_model, write_adapter
    base = tiny_model_dir("llama-gqa")
    one = write_adapter(base, tmp_path / "one", rank=8, seed=1)
    two = write_adapter(base, tmp_path / "two", rank=4, seed=2, targets=("q_proj", "v_proj", "down_proj"))
    refs = {None: hf.greedy(base, _prompts(), MAX_TOKENS, device="cuda"),
            "one": hf.greedy(merged_model(base, one, tmp_path / "m1"), _prompts(), MAX_TOKENS, device="cuda"),
            "two": hf.greedy(merged_model(base, two, tmp_path / "m2"), _prompts(), MAX_TOKENS, device="cuda")}
    loras = {"one": LoRARequest("one", 1, one), "two": LoRARequest("two", 2, two)}
    mix = [None, "one", "two", "one", None, "two"]
    llm = LLM(base, dtype="float32", device="cuda", gpu_memory_utilization=0.3, enable_lora=True, max_loras=2)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False, lora_request=[loras.get(m) for m in mix])
    finally:
        llm.shutdown()
    exact = sum(hf.assert_close([refs[m][i]], [outs[i]], f"prompt {i} ({m})") for i, m in enumerate(mix))
    assert exact >= 5, f"only {exact}/6 sequences equal transformers on the merged weights"


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_speculative_decoding_on_cuda_keeps_greedy_outputs(method, tiny_model_dir, tmp_path):
    """Verified positions are decode rows (CUDA graphs apply); the draft model and EAGLE head run
    beside the target on the device: greedy outputs equal plain decoding's, in float32."""
    from shardlm.bench.random_eagle import make_random_eagle
    target = tiny_model_dir("llama-gqa")
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
            "draft_model": {"model": target, "num_speculative_tokens": 3},
            "eagle": {"method": "eagle", "model": make_random_eagle(target, tmp_path / "eagle"),
                      "num_speculative_tokens": 3},
            "eagle3": {"method": "eagle3", "model": make_random_eagle(target, tmp_path / "eagle3", eagle3=True),
                       "num_speculative_tokens": 3}}[method]
    prompts = [{"prompt_token_ids": ([100 + 7 * i, 200, 300 + i, 400] * 6)[:20 + i]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = {}
    for name, config in (("plain", None), ("spec", spec)):
        llm = LLM(target, dtype="float32", device="cuda", gpu_memory_utilization=0.3, speculative_config=config)
        try:
            outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if config:
                stats = llm.stats()
        finally:
            llm.shutdown()
    assert outs["spec"] == outs["plain"]
    assert stats["spec_num_drafts"] > 0
    if method == "draft_model":             # the target as its own draft: every proposal right
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_decode_context_parallel_partials_merge_to_whole_attention_on_cuda(dtype, tol, one_rank):
    """-dcp needs two GPUs for an engine; its attention half runs here: the CUDA backend's
    partial outputs and log-sum-exps of two simulated ranks merge to its whole attention."""
    from shardlm.attention.cuda import CudaAttention
    from tests.unit.test_context_parallel import BS, partial_attention_error
    make = lambda: CudaAttention(BS, CUDA, max_num_seqs=8, max_model_len=2048)   # noqa: E731
    assert partial_attention_error(make, 2, 1, dtype) < tol
