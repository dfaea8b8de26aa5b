"""The Transformers backend (--model-impl, as vLLM's): architectures shardlm has no model of its
own for run on transformers' modeling code with shardlm's paged KV cache, scheduler, sampler and
linear layers, and give transformers' tokens, also split by tensor and pipeline parallel,
quantized at load or as stored (GPTQ, AWQ, FP8), with a draft model; what needs shardlm's own
decoder is refused, saying so."""

import pytest

from shardlm import LLM, SamplingParams
from shardlm.engine.arg_utils import EngineArgs

# two prompts in one step, a prompt over several steps (a budget of 16 tokens), and a prompt
# that starts from the first one's cached blocks
PROMPTS = [list(range(100, 140)), [5, 6, 7], list(range(100, 132)) + [7, 8, 9]]
ENGINE = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=128, max_num_batched_tokens=16)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("name", ["starcoder2", "cohere", "gpt-neox"])
def test_architectures_shardlm_lacks_give_transformers_tokens(name, tiny_model_dir, hf):
    llm = LLM(tiny_model_dir(name), **ENGINE)
    assert llm.engine.config.model.model_impl == "transformers", "auto: the Transformers backend"
    first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, use_tqdm=False)
    cached = llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert cached[0].num_cached_tokens == 32
    ref = hf.greedy(tiny_model_dir(name), PROMPTS, 8)
    assert hf.assert_close(ref, first + cached, name) == 3


def tokens(model_dir, **engine) -> list[list[int]]:
    llm = LLM(model_dir, **{**ENGINE, **engine})
    try:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                              use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name,quantization", [("llama-gqa", None), ("llama-gqa", "int8"), ("gemma2", None)],
                         ids=["llama", "llama-int8", "gemma2"])
def test_a_model_shardlm_has_runs_on_either_with_the_same_tokens(name, quantization, tiny_model_dir):
    """Its linears are shardlm's: int8 at load quantizes them as in shardlm's own Llama; Gemma 2's
    attention logit soft cap reaches shardlm's attention (it was left out)."""
    assert tokens(tiny_model_dir(name), model_impl="vllm", quantization=quantization) == \
        tokens(tiny_model_dir(name), model_impl="transformers", quantization=quantization)


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", [("gpt-neox", dict(pipeline_parallel_size=2, tensor_parallel_size=2)),
                                         ("granite", dict(pipeline_parallel_size=2)),
                                         ("llama-5-layers", dict(pipeline_parallel_size=3)),
                                         ("starcoder2", dict(prefill_context_parallel_size=2, tensor_parallel_size=2))],
                         ids=["gpt-neox-tp2-pp2", "granite-pp2", "llama-pp3", "starcoder2-tp2-pcp2"])
def test_pipeline_and_context_parallel_give_one_ranks_tokens(name, layout, tiny_model_dir):
    """Each stage keeps its layers (a middle one at pp3: neither embedding nor head); a later stage
    takes the previous one's hidden states in place of what the model's forward makes of its
    embedding (Granite multiplies it there: done twice, the tokens change). Tokens as on one rank
    (GPT-NeoX: its own names for embedding and final norm), and for models shardlm has, as its own.
    Prefill context parallel too: each group runs the model on the prompt positions it owns, and
    shardlm's attention, which transformers' attention calls, merges over the groups."""
    engine = dict(model_impl="transformers") if name in ("granite", "llama-5-layers") else {}
    want = tokens(tiny_model_dir(name), model_impl="vllm") if engine else tokens(tiny_model_dir(name))
    assert tokens(tiny_model_dir(name), **engine, **layout) == want


@pytest.mark.slow
def test_tensor_parallel_splits_its_linears_as_the_models_plan_says(tiny_model_dir):
    """With logprobs and plain greedy (shardlm's own models take the vocabulary shards' argmax)."""
    assert tokens(tiny_model_dir("cohere"), tensor_parallel_size=2) == tokens(tiny_model_dir("cohere"))
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(tiny_model_dir("cohere"), **ENGINE, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], plain,
                                                             use_tqdm=False)] == tokens(tiny_model_dir("cohere"))
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("method,layout", [("awq", dict(tensor_parallel_size=2)),
                                           ("gptq", dict(pipeline_parallel_size=2))], ids=["awq-tp2", "gptq-pp2"])
def test_a_packed_checkpoint_runs_as_stored(method, layout, tiny_model_dir, tmp_path, hf):
    """Cohere (not one of shardlm's own) as a 4-bit GPTQ or AWQ checkpoint: each of its 14 linears
    (per stage: 7) takes its packed weights as stored, and the tokens are transformers' on the
    dequantized weights."""
    from tests.models.test_quantized import _packed_checkpoints
    dirs = _packed_checkpoints(tiny_model_dir("cohere"), tmp_path, group=16)
    llm = LLM(dirs[method], **ENGINE, **layout)
    try:
        assert (llm.engine.config.model.model_impl, llm.engine.config.model.quantization.method) == (
            "transformers", method)
        kernels = llm.collective_rpc("quantized_kernels")
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    per_rank = [7, 7] if "pipeline_parallel_size" in layout else [14] * layout.get("tensor_parallel_size", 1)
    assert [sum(k.values()) for k in kernels] == per_rank
    assert hf.assert_close(hf.greedy(dirs["dequantized"], PROMPTS, 8), outs, method) == 3


class _Dirs:
    """tmp_path_factory's mktemp under one test's tmp_path."""
    def __init__(self, root):
        self.root = root

    def mktemp(self, name):
        (self.root / name).mkdir()
        return self.root / name


def test_an_fp8_checkpoint_and_its_kv_cache_scales(tiny_model_dir, tmp_path):
    """Cohere in compressed-tensors FP8 with k_scale / v_scale per layer: its linears in FP8, the
    scales on shardlm's attention layers, the dequantized model's tokens."""
    from tests.models.test_fp8_checkpoints import _write
    stored, dequantized = _write(tiny_model_dir("cohere"), "compressed-tensors", _Dirs(tmp_path))
    llm = LLM(stored, **ENGINE)
    try:
        assert llm.collective_rpc("quantized_kernels") == [{"fp8": 14}]
        layers = llm.engine.engine_core.engine_core.executor.worker.runner.attention_layers()   # tp=1: here
        assert all((a.k_scale, a.v_scale) == (pytest.approx(0.05), pytest.approx(0.02)) for a in layers)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                             use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == tokens(dequantized)


def test_lora_adapters_on_its_own_modules(tiny_model_dir, tmp_path, hf):
    """A GPT-NeoX adapter names transformers' modules (query_key_value, dense, ...): the base model
    and the adapter in one batch each give transformers' tokens, the adapter's on the merged
    weights, at tp2 x pp2 (each rank adapts its slice of its stage's linears; one rank is the
    simpler case of the same code)."""
    from shardlm import LoRARequest
    from tests.lora_adapters import merged_model, write_adapter
    base = tiny_model_dir("gpt-neox")
    adapter = write_adapter(base, tmp_path / "adapter", rank=8, seed=3,
                            targets=("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"))
    merged = merged_model(base, adapter, tmp_path / "merged")
    llm = LLM(base, **ENGINE, enable_lora=True, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        lora = LoRARequest("neox", 1, adapter)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2] * 2], GREEDY, use_tqdm=False,
                            lora_request=[None, None, lora, lora])
    finally:
        llm.shutdown()
    assert hf.assert_close(hf.greedy(base, PROMPTS[:2], 8), outs[:2], "base") == 2
    assert hf.assert_close(hf.greedy(merged, PROMPTS[:2], 8), outs[2:], "adapter") == 2
    assert [o.outputs[0].token_ids for o in outs[:2]] != [o.outputs[0].token_ids for o in outs[2:]]


def test_what_needs_shardlms_own_layers_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"\['Starcoder2ForCausalLM'\] are not supported"):
        EngineArgs(model=tiny_model_dir("starcoder2"), model_impl="shardlm").create_engine_config()
    with pytest.raises(ValueError, match="--model-impl transformers with -dcp or --enable-expert-parallel"):
        EngineArgs(model=tiny_model_dir("starcoder2"), tensor_parallel_size=2,
                   decode_context_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="an EAGLE head or MTP layer is not supported"):
        EngineArgs(model=tiny_model_dir("llama-gqa"), model_impl="transformers",
                   speculative_config={"method": "eagle", "model": tiny_model_dir("llama-gqa")}).create_engine_config()
    with pytest.raises(ValueError, match="--model-impl 'hf': give auto, shardlm, vllm, transformers"):
        EngineArgs(model=tiny_model_dir("cohere"), model_impl="hf").create_engine_config()


@pytest.mark.slow
def test_pooling_models_run_on_it(tiny_model_dir, pooling_model_dir):
    """A causal LM as an embedder (--runner pooling: its last token's final hidden state,
    normalized) and a ...ForSequenceClassification checkpoint of its family (a `score` matrix over
    the last token) give transformers' embeddings and classes; split by tp2 x pp2, one rank's."""
    import torch
    from transformers import AutoModel, AutoTokenizer, GPTNeoXForSequenceClassification
    texts = ["The cat sits on the mat.", "A man is playing a guitar in the park.", "Hi"]
    path, classifier = tiny_model_dir("gpt-neox"), pooling_model_dir("gpt-neox-classifier")
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        model = AutoModel.from_pretrained(path).eval()
        want = torch.stack([torch.nn.functional.normalize(model(**tok(t, return_tensors="pt")).last_hidden_state[0, -1],
                                                          dim=-1) for t in texts])
        model = GPTNeoXForSequenceClassification.from_pretrained(classifier).eval()
        classes = torch.stack([model(**tok(t, return_tensors="pt")).logits[0].softmax(-1) for t in texts])

    def embeddings(**layout):
        llm = LLM(path, runner="pooling", **ENGINE, **layout)
        try:
            assert llm.engine.config.model.model_impl == "transformers"
            return torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        finally:
            llm.shutdown()
    one_rank = embeddings()
    torch.testing.assert_close(one_rank, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(embeddings(tensor_parallel_size=2, pipeline_parallel_size=2), one_rank, atol=1e-5,
                               rtol=0)
    llm = LLM(classifier, **ENGINE)
    try:
        assert llm.engine.config.model.runner == "pooling"
        got = torch.tensor([o.outputs.probs for o in llm.classify(texts, use_tqdm=False)])
    finally:
        llm.shutdown()
    torch.testing.assert_close(got, classes, atol=1e-5, rtol=0)


def test_ngram_speculative_decoding_keeps_its_tokens(tiny_model_dir):
    """Proposed tokens are verified through transformers' modeling code as through shardlm's."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    repeated = [{"prompt_token_ids": [5, 6, 7, 8] * 3 + [5, 6, 7]}]
    outputs = []
    for spec in (None, ngram):
        llm = LLM(tiny_model_dir("cohere"), **{**ENGINE, "max_num_batched_tokens": 64}, speculative_config=spec)
        outputs.append(llm.generate(repeated, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].token_ids)
        if spec is not None:
            assert llm.stats()["spec_num_drafts"] > 0
        llm.shutdown()
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("target,draft", [("starcoder2", "starcoder2"), ("llama-gqa", "llama-draft")],
                         ids=["starcoder2-drafts-itself", "llama-on-transformers-llama-draft"])
def test_a_draft_model_proposes_for_it(target, draft, tiny_model_dir):
    """The draft runs on transformers' code too where shardlm lacks its architecture: a target that
    drafts for itself has every proposal accepted; a shardlm draft for a target on transformers'
    code keeps the target's tokens."""
    engine = dict(model_impl="transformers") if target == "llama-gqa" else {}
    spec = {"model": tiny_model_dir(draft), "num_speculative_tokens": 3}
    llm = LLM(tiny_model_dir(target), **ENGINE, **engine, speculative_config=spec)
    try:
        assert llm.engine.config.speculative.draft_model_config.model_impl == (
            "transformers" if draft == "starcoder2" else "shardlm")
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                             use_tqdm=False)]
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert got == tokens(tiny_model_dir(target), **engine)
    assert stats["spec_num_draft_tokens"] > 0
    if target == draft:
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
