"""LoRA adapters against transformers on the merged weights (W + scaling * B A), on every
parallel layout; base and adapter requests in one batch; adapters added and removed at run time;
the prefix cache kept apart per adapter; the max_loras bound; hub adapters; and the errors."""

import os
import shutil

import pytest
import torch

from shardlm import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import merged_model, write_adapter
from tests.models.test_hub_models import MAIN, add_snapshot
from tests.models.test_tiny_models_vs_hf import MAX_TOKENS, PARAMS, _prompts

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=256, enable_lora=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Two adapters of the llama model: all seven projections at rank 8, and q/v/down at rank 4 with
    rsLoRA; with transformers' greedy outputs on the base and on each merged model."""
    from tests import hf_reference as hf
    base = tiny_model_dir("llama-gqa")
    root = tmp_path_factory.mktemp("lora")
    one = write_adapter(base, root / "one", rank=8, seed=1)
    two = write_adapter(base, root / "two", rank=4, seed=2, targets=("q_proj", "v_proj", "down_proj"), rslora=True)
    models = {"base": base, "one": merged_model(base, one, root / "m1"), "two": merged_model(base, two, root / "m2")}
    refs = {name: hf.greedy(path, _prompts(), MAX_TOKENS) for name, path in models.items()}
    return base, {"one": LoRARequest("one", 1, one), "two": LoRARequest("two", 2, two)}, refs


def _check(hf, ref, outs, label):
    exact = hf.assert_close(ref, outs, label)
    assert exact >= 5, f"{label}: only {exact}/6 sequences equal transformers on the merged weights"


@pytest.mark.parametrize("layout", [{}, pytest.param({"tensor_parallel_size": 2}, marks=pytest.mark.slow),
                                    pytest.param({"pipeline_parallel_size": 2}, marks=pytest.mark.slow),
                                    pytest.param({"prefill_context_parallel_size": 2}, marks=pytest.mark.slow)],
                         ids=["tp1", "tp2", "pp2", "pcp2"])
def test_adapters_equal_transformers_on_merged_weights(layout, adapters, hf):
    """Each adapter alone, then base and both adapters mixed in one batch: each prompt gets what
    its own model gives (tp=2: A of row-parallel and B of column-parallel layers sliced per rank)."""
    if layout:
        pytest.importorskip("torch.distributed")
    base, loras, refs = adapters
    assert refs["one"][0][0] != refs["base"][0][0] or refs["one"][1][0] != refs["base"][1][0]   # adapters matter
    llm = LLM(base, max_loras=2, **ENGINE, **layout)
    try:
        alone = {name: llm.generate(_prompts(), PARAMS, use_tqdm=False, lora_request=loras.get(name))
                 for name in ("base", "one", "two")}
        for name in ("one", "two"):
            _check(hf, refs[name], alone[name], name)
        mix = [None, loras["one"], loras["two"], loras["one"], None, loras["two"]]
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False, lora_request=mix)
    finally:
        llm.shutdown()
    names = [lora.lora_name if lora else "base" for lora in mix]
    for i, name in enumerate(names):
        hf.assert_close([refs[name][i]], [outs[i]], f"mixed prompt {i}")
    # the mixed batch gives each prompt what its adapter (or the base model) gave it alone
    assert [o.outputs[0].token_ids for o in outs] == [alone[n][i].outputs[0].token_ids for i, n in enumerate(names)]


@pytest.mark.slow
def test_data_parallel_replicas_serve_adapters(adapters, hf):
    base, loras, refs = adapters
    llm = LLM(base, max_loras=2, data_parallel_size=2, **ENGINE)
    try:
        mix = [loras["one"], loras["two"]] * 3
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False, lora_request=mix)
        for i, lora in enumerate(mix):
            hf.assert_close([refs[lora.lora_name][i]], [outs[i]], f"dp prompt {i}")
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_an_attention_adapter_on_a_moe_model_with_expert_parallel(tiny_model_dir, tmp_path, hf):
    """Mixtral with whole experts per rank (EP over tp=2): the adapter's attention projections."""
    base = tiny_model_dir("mixtral")
    path = write_adapter(base, tmp_path / "a", rank=8, seed=3, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    ref = hf.greedy(merged_model(base, path, tmp_path / "m"), _prompts(), MAX_TOKENS)
    llm = LLM(base, tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    try:
        _check(hf, ref, llm.generate(_prompts(), PARAMS, use_tqdm=False, lora_request=LoRARequest("a", 1, path)),
               "mixtral ep")
    finally:
        llm.shutdown()


def test_max_loras_bounds_the_adapters_of_a_step(adapters, hf):
    """max_loras=1: requests of a second adapter wait until the first one's are done, and every
    request still gets its own model's tokens; the base model's requests are never held back."""
    base, loras, refs = adapters
    llm = LLM(base, max_loras=1, distributed_executor_backend="uni", **ENGINE)
    try:
        core = llm.engine.engine_core.engine_core
        seen = []
        schedule = core.scheduler.schedule

        def watched():
            out = schedule()
            seen.append(core.scheduler.running_adapters())
            return out
        core.scheduler.schedule = watched
        mix = [loras["one"], loras["two"], None, loras["two"], loras["one"], None]
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False, lora_request=mix)
        assert max(len(s) for s in seen) == 1 and {1} in seen and {2} in seen
        for i, lora in enumerate(mix):
            hf.assert_close([refs[lora.lora_name if lora else "base"][i]], [outs[i]], f"prompt {i}")
    finally:
        llm.shutdown()


def test_prefix_cache_is_never_shared_across_adapters(adapters):
    base, loras, _ = adapters
    prompt = _prompts()[5]        # 130 tokens: 8 full blocks
    params = SamplingParams(temperature=0, max_tokens=4)
    llm = LLM(base, max_loras=2, distributed_executor_backend="uni", **ENGINE)
    try:
        first = llm.generate([prompt], params, use_tqdm=False)[0]
        other = [llm.generate([prompt], params, use_tqdm=False, lora_request=loras[n])[0] for n in ("one", "two")]
        again = llm.generate([prompt], params, use_tqdm=False, lora_request=loras["one"])[0]
        base_again = llm.generate([prompt], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert first.num_cached_tokens == 0 and [o.num_cached_tokens for o in other] == [0, 0]
    assert again.num_cached_tokens == 128 and base_again.num_cached_tokens == 128
    assert again.outputs[0].token_ids == other[0].outputs[0].token_ids


def test_adapters_are_added_and_removed_at_run_time(adapters, hf):
    base, loras, refs = adapters
    llm = LLM(base, max_loras=1, max_cpu_loras=2, distributed_executor_backend="uni", **ENGINE)
    try:
        assert llm.list_loras() == set()
        assert llm.add_lora(loras["one"]) and llm.add_lora(loras["two"])
        assert llm.list_loras() == {1, 2}
        assert llm.remove_lora(1) and llm.list_loras() == {2}
        assert not llm.remove_lora(7)
        # removed from memory, not forgotten: a request naming it reads it again
        _check(hf, refs["one"], llm.generate(_prompts(), PARAMS, use_tqdm=False, lora_request=loras["one"]), "one")
        assert llm.list_loras() == {1, 2}
        # removed while its requests run (the server unloads it): they read it again and finish alike
        engine, done = llm.engine, {}
        for i, prompt in enumerate(_prompts()):
            engine.add_request(str(i), prompt, PARAMS, lora_request=loras["two"])
        for _ in range(3):
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        assert llm.remove_lora(2)
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        _check(hf, refs["two"], [done[str(i)] for i in range(6)], "two, removed mid-run")
    finally:
        llm.shutdown()


def test_an_adapter_from_the_hub_cache(adapters, tmp_path, monkeypatch, hf):
    """An adapter named by hub id, from a cache laid out as huggingface_hub lays it out (offline)."""
    base, loras, refs = adapters
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = loras["one"].lora_path
    add_snapshot(tmp_path / "hub", "acme/tiny-lora", MAIN, {f: os.path.join(src, f) for f in os.listdir(src)},
                 refs=("main",))
    llm = LLM(base, download_dir=str(tmp_path / "hub"), distributed_executor_backend="uni", **ENGINE)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False, lora_request=LoRARequest("hub", 1, "acme/tiny-lora"))
        _check(hf, refs["one"], outs, "hub adapter")
        with pytest.raises(ValueError, match="not in the hub cache"):
            llm.generate("Hi", PARAMS, use_tqdm=False, lora_request=LoRARequest("x", 2, "acme/missing-lora"))
    finally:
        llm.shutdown()


def _broken(kind: str, good: str, root) -> str:
    path = root / kind
    shutil.copytree(good, path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if kind == "corrupt":
        data = weights_file.read_bytes()
        weights_file.write_bytes(data[:len(data) // 3])
    elif kind == "unknown-target":
        from safetensors.torch import load_file, save_file
        tensors = load_file(weights_file)
        tensors["base_model.model.model.layers.0.self_attn.c_attn.lora_A.weight"] = torch.zeros(8, 64)
        save_file(tensors, weights_file)
    elif kind == "other-base":
        from safetensors.torch import load_file, save_file
        tensors = {k: torch.cat([v, v], dim=1) if "lora_A" in k else v for k, v in load_file(weights_file).items()}
        save_file(tensors, weights_file)
    elif kind == "no-config":
        config_file.unlink()
    return str(path)


@pytest.mark.parametrize("kind, message", [
    ("corrupt", "corrupt or not safetensors"),
    ("unknown-target", "targets self_attn.c_attn, which does not exist"),
    ("other-base", "trained for another base model"),
    ("no-config", "has no adapter_config.json"),
])
def test_a_bad_adapter_is_refused_and_the_engine_goes_on(kind, message, adapters, tmp_path):
    base, loras, _ = adapters
    llm = LLM(base, distributed_executor_backend="uni", **ENGINE)
    try:
        bad = LoRARequest("bad", 5, _broken(kind, loras["one"].lora_path, tmp_path))
        with pytest.raises(ValueError, match=message):
            llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False, lora_request=bad)
        assert len(llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False,
                                lora_request=loras["one"])[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_rank_and_settings_errors_say_what_to_do(adapters, tiny_model_dir, tmp_path):
    base, loras, _ = adapters
    big = write_adapter(base, tmp_path / "big", rank=32, seed=4, targets=("q_proj",))
    llm = LLM(base, distributed_executor_backend="uni", **ENGINE)      # max_lora_rank 16
    try:
        with pytest.raises(ValueError, match="above max_lora_rank=16: start the engine with --max-lora-rank 32"):
            llm.generate("Hi", use_tqdm=False, lora_request=LoRARequest("big", 3, big))
    finally:
        llm.shutdown()
    plain = LLM(base, **{**ENGINE, "enable_lora": False}, distributed_executor_backend="uni")
    try:
        with pytest.raises(ValueError, match="LoRA is off: start the engine with enable_lora=True"):
            plain.generate("Hi", use_tqdm=False, lora_request=loras["one"])
    finally:
        plain.shutdown()
    with pytest.raises(ValueError, match="lora_int_id=0 must be an integer >= 1"):
        LoRARequest("zero", 0, "/x")
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be at least max_loras=2"):
        LLM(base, max_loras=2, max_cpu_loras=1, **ENGINE)
    llm = LLM(tiny_model_dir("mixtral"), distributed_executor_backend="uni", **ENGINE)   # the same sizes
    try:
        with pytest.raises(ValueError, match="MLP of a mixture-of-experts model"):
            llm.generate("Hi", use_tqdm=False, lora_request=loras["one"])
    finally:
        llm.shutdown()


def test_bfloat16_adapters_part_from_transformers_only_among_its_top_tokens(adapters, hf):
    """In bfloat16 the separate delta rounds differently from merged weights: sequences may part,
    but only at near-ties: HF's token within 0.2 nats of ours in our own logprobs (bfloat16 logits
    of these magnitudes are 0.0625 apart; measured up to 0.094, with either LoRA product)."""
    base, loras, refs = adapters
    merged = os.path.join(os.path.dirname(loras["one"].lora_path), "m1")
    ref = hf.greedy(merged, _prompts(), MAX_TOKENS, dtype=torch.bfloat16)
    llm = LLM(base, **{**ENGINE, "dtype": "bfloat16"}, distributed_executor_backend="uni")
    try:      # 20 logprobs: at a bfloat16 tie several tokens share a logit, HF's may rank below 5th
        outs = llm.generate(_prompts(), PARAMS.clone(logprobs=20), use_tqdm=False, lora_request=loras["one"])
    finally:
        llm.shutdown()
    margins = hf.divergence_margins(ref, outs)
    assert max(margins, default=0) <= 0.2, margins


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2}], ids=["tp1", "tp2"])
def test_an_adapter_on_fused_modules_of_a_partial_rotary_model(layout, tiny_model_dir, tmp_path, hf):
    """Phi-3's adapters name its fused qkv_proj and gate_up_proj: B is split as the weights are, and
    its q and k rows laid out for the partial rotary embedding (12 of 16 dims) as the base's."""
    from shardlm.bench.random_lora import FUSED_TARGETS
    base = tiny_model_dir("phi3")
    adapter = write_adapter(base, tmp_path / "phi", rank=8, seed=3, targets=FUSED_TARGETS)
    ref = hf.greedy(merged_model(base, adapter, tmp_path / "merged"), _prompts(), MAX_TOKENS)
    llm = LLM(base, max_lora_rank=8, **ENGINE, **layout)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False, lora_request=LoRARequest("phi", 1, adapter))
    finally:
        llm.shutdown()
    _check(hf, ref, outs, f"phi3 adapter {layout}")


@pytest.mark.parametrize("layout", [{"distributed_executor_backend": "uni"},
                                    pytest.param({"tensor_parallel_size": 2}, marks=pytest.mark.slow)],
                         ids=["uni", "tp2"])
def test_an_adapter_that_can_no_longer_be_read_fails_its_requests_alone(layout, adapters, tmp_path):
    """The adapter's files vanish after it was checked: the request on it fails, naming it; a base
    request in the same step finishes exactly; the engine goes on (before, the engine stopped)."""
    from shardlm.engine.errors import RequestFailedError
    base, loras, _ = adapters
    gone = LoRARequest("gone", 9, str(shutil.copytree(loras["one"].lora_path, tmp_path / "gone")))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(base, **layout, **ENGINE)
    try:
        ref = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.add_lora(gone) and llm.remove_lora(9)     # checked, then out of memory: read again on use
        shutil.rmtree(gone.lora_path)
        engine, done = llm.engine, {}
        engine.add_request("base", "Hello", params)
        engine.add_request("adapted", "Hello", params, lora_request=gone)
        with pytest.raises(RequestFailedError, match="LoRA adapter 'gone' could not be read"):
            while engine.has_unfinished_requests():
                done.update((o.request_id, o) for o in engine.step() if o.finished)
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        assert list(done) == ["base"] and done["base"].outputs[0].token_ids == ref
        # a worker that cannot read an adapter it is asked to load answers so; it goes on too
        with pytest.raises((RuntimeError, ValueError), match="nowhere"):
            llm.collective_rpc("add_lora", (LoRARequest("nowhere", 10, str(tmp_path / "nowhere")),))
        assert llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids == ref
        adapted = llm.generate("Hello", params, use_tqdm=False, lora_request=loras["two"])
        assert len(adapted[0].outputs[0].token_ids) == 6
    finally:
        llm.shutdown()
