"""--quantization int8 / int4: the engine equals transformers running the same model with each
linear's weight replaced by its quantize-dequantize round trip (the integers the engine keeps),
at one rank, tp=2 and pp=2; weights shrink; bad group sizes fail at start-up naming valid TP sizes."""

import os

import pytest
import torch

from shardlm import LLM
from shardlm.kernels import blocked_int4
from shardlm.layers.quantization import dequantize, quantize_rtn
from tests.models.test_tiny_models_vs_hf import MAX_TOKENS, PARAMS, _prompts

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
             "w1", "w2", "w3",      # (Mixtral's experts)
             "qkv_proj", "gate_up_proj")      # (Phi-3's fused ones)


def _round_trip_model(src: str, dst, bits: int, group: int) -> str:
    """The HF model with every quantized linear's weight as the engine holds it (per-row int8
    scales span the whole row, as the engine makes them at any TP size)."""
    import shutil

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)

    def round_trip(w: torch.Tensor) -> None:          # [out, in]: per row, in groups of its columns
        q, scales, mins = quantize_rtn(w, bits, w.shape[1] if group == -1 else group)
        w.copy_(dequantize(q, scales, mins, torch.float32))
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in QUANTIZED:
                round_trip(module.weight)
        for name, param in model.named_parameters():      # stacked experts: gate_up [E, 2I, H], down [E, H, I]
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                for expert in param.data:
                    round_trip(expert)
    model.save_pretrained(dst, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(f"{src}/{f}"):
            shutil.copy(f"{src}/{f}", dst)
    return str(dst)


@pytest.fixture(scope="module")
def quantized_references(tiny_model_dir, tmp_path_factory, hf):
    cache = {}

    def get(method, group):
        if (method, group) not in cache:
            bits = 8 if method == "int8" else 4
            path = _round_trip_model(tiny_model_dir("llama-gqa"), tmp_path_factory.mktemp(method), bits, group)
            cache[method, group] = hf.greedy(path, _prompts(), MAX_TOKENS)
        return cache[method, group]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("method, group, layout", [
    ("int8", -1, {}), ("int4", 32, {}), ("int8", -1, {"tensor_parallel_size": 2}),
    ("int4", 32, {"tensor_parallel_size": 2}), ("int4", 32, {"pipeline_parallel_size": 2})],
    ids=["int8", "int4", "int8-tp2", "int4-tp2", "int4-pp2"])
def test_quantized_engine_equals_hf_on_the_round_tripped_weights(method, group, layout, tiny_model_dir,
                                                                quantized_references, hf):
    llm = LLM(tiny_model_dir("llama-gqa"), **ENGINE, quantization=method, quantization_group_size=group, **layout)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        quantized_bytes = llm.collective_rpc("weight_bytes")
    finally:
        llm.shutdown()
    exact = hf.assert_close(quantized_references(method, group), outs, f"{method} {layout}")
    assert exact >= 4, f"only {exact}/6 sequences equal HF exactly"
    assert len(quantized_bytes) == max(layout.values(), default=1)


@pytest.mark.slow
def _kernels_and_outputs(path: str, layout: dict):
    """(each rank's quantized kernels, the outputs for _prompts()) of an engine on this checkpoint."""
    llm = LLM(path, **ENGINE, **layout)
    try:
        return llm.collective_rpc("quantized_kernels"), llm.generate(_prompts(), PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("method, layout", [("awq", {"pipeline_parallel_size": 2})], ids=["awq-pp2"])
def test_a_multimodal_checkpoint_run_as_its_text_model_reads_its_packed_linears(method, layout, tiny_model_dir,
                                                                                tmp_path, hf):
    """A Gemma 3 4B+ checkpoint (Gemma3ForConditionalGeneration) runs as its text model. As GPTQ or
    AWQ (quantization_config at the top of config.json, tensors under language_model.) it used to
    load as float and fail on the first g_idx; its 16 linears now keep their packed weights (split
    over the stages) and the tokens are transformers' on the dequantized weights."""
    dirs = _packed_checkpoints(tiny_model_dir("gemma3-multimodal"), tmp_path, group=16,
                               quantizes=lambda name: "language_model" in name)
    kernels, outs = _kernels_and_outputs(dirs[method], layout)
    per_rank = [sum(k.values()) for k in kernels]
    assert sum(per_rank) == 16 and len(per_rank) == (2 if layout else 1)
    assert hf.assert_close(hf.greedy(dirs["dequantized"], _prompts(), MAX_TOKENS), outs, method) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("model, method, group, layout", [
    ("mixtral", "int4", 32, {}), ("mixtral", "int8", -1, {"tensor_parallel_size": 2}),
    ("mixtral", "int4", 32, {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("qwen3-moe", "int4", 32, {"pipeline_parallel_size": 2})],
    ids=["mixtral-int4", "mixtral-int8-tp2", "mixtral-int4-ep2", "qwen3-moe-int4-pp2"])
def test_experts_are_quantized_with_the_linears(model, method, group, layout, tiny_model_dir, tmp_path, hf):
    """--quantization also quantizes the experts (most of a MoE model): the engine equals transformers
    with every linear's and every expert's weight round-tripped, whole experts (EP) or sliced (TP);
    int8's per-row scales of a sliced down projection span the whole row, as at one rank."""
    src = tiny_model_dir(model)
    reference = hf.greedy(_round_trip_model(src, tmp_path / "rt", 8 if method == "int8" else 4, group), _prompts(),
                          MAX_TOKENS)
    llm = LLM(src, **ENGINE, quantization=method, quantization_group_size=group, **layout)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        quantized = llm.collective_rpc("quantized_experts")
    finally:
        llm.shutdown()
    layers = [kernel for rank in quantized for kernel in rank]     # each rank's MoE layers
    assert layers and set(layers) == {"blocked8" if method == "int8" else "blocked4"}
    exact = hf.assert_close(reference, outs, f"{model} {method} {layout}")
    assert exact >= 4, f"only {exact}/6 sequences equal HF exactly"


def test_quantized_weights_are_smaller(tiny_model_dir):
    path = tiny_model_dir("llama-gqa")
    sizes = {}
    for method in (None, "int8", "int4"):
        llm = LLM(path, **ENGINE, quantization=method, quantization_group_size=32 if method == "int4" else None)
        try:
            sizes[method] = llm.collective_rpc("weight_bytes")[0]
        finally:
            llm.shutdown()
    # the tiny model is mostly embeddings (49152 x 64, twice): the linears are 2 x 49152 params fewer
    linears = 2 * (4 * 64 * 64 + 3 * 64 * 128) + 2 * 2 * 64 * 32   # q, o + k, v (2 KV heads of 16) and the MLP
    assert sizes[None] - sizes["int8"] > 0.7 * linears * 3
    assert sizes[None] - sizes["int4"] > sizes[None] - sizes["int8"]


def test_bad_quantization_settings_say_what_works(tiny_model_dir):
    path = tiny_model_dir("llama-gqa")
    with pytest.raises(ValueError, match="int3.*use int8, int4, fp8_per_channel"):
        LLM(path, **ENGINE, quantization="int3")
    # o_proj and down_proj have 64 and 128 input columns: 32-column groups cannot split o_proj in 4
    with pytest.raises(ValueError, match=r"o_proj \(16 columns per rank\).*Valid tensor parallel sizes for this "
                                         r"group size: 1, 2;"):
        LLM(path, **ENGINE, quantization="int4", quantization_group_size=32, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="without a quantization method"):
        LLM(path, **ENGINE, quantization_group_size=32)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_bfloat16_packed_kernels_equal_hf_in_bfloat16(method, tiny_model_dir, tmp_path, hf):
    """bfloat16 runs the packed kernels (the blocked kernel's 8- and 4-bit panels on AVX-512 CPUs,
    else torch's) against transformers on the same integers."""
    group = -1 if method == "int8" else 32
    path = _round_trip_model(tiny_model_dir("llama-gqa"), tmp_path, 8 if method == "int8" else 4, group)
    blocked = blocked_int4() is not None
    # the blocked kernel widens weights to float32 in registers (transformers in bfloat16
    # rounds each dequantized weight to bfloat16): its reference is float32
    reference = hf.greedy(path, _prompts(), MAX_TOKENS, dtype=torch.float32 if blocked else torch.bfloat16)
    llm = LLM(tiny_model_dir("llama-gqa"), **{**ENGINE, "dtype": "bfloat16"}, quantization=method,
              quantization_group_size=group)
    try:
        kernels = llm.collective_rpc("quantized_kernels")[0]
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    expected = f"blocked{method[3:]}" if blocked else f"{method}pack"
    assert kernels == {expected: 4 * 2}          # qkv, o, gate_up, down of both layers
    # every sequence may part from HF only at a near-tie (each side's token in the other's top 5).
    # No count of exact sequences: in bfloat16 these tiny random models part within a few tokens even
    # unquantized (transformers in bfloat16 against itself in float32 too)
    hf.assert_close(reference, outs, f"{method} bfloat16")


@pytest.mark.slow
def test_a_gguf_file_as_the_model_serves_its_own_blocks(tmp_path):
    """A .gguf path is converted once (tokenizer, config, float weights) and `--quantization gguf`
    serves its linears as stored: the same tokens as the embedded default model from the same file."""
    import shutil

    from shardlm import SamplingParams
    from shardlm.model_loader.default_model import gguf_path
    copy = tmp_path / "smollm2-copy.gguf"
    shutil.copy(gguf_path(), copy)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outputs = []
    for model in (None, str(copy)):
        llm = LLM(model, dtype="float32", kv_cache_memory="64MiB", max_model_len=256, quantization="gguf")
        try:
            kernels = {"blocked4": 120, "blocked8": 2} if blocked_int4() else {"none": 120}   # blocked8: the Q8_0 table
            assert llm.collective_rpc("quantized_kernels")[0] == kernels
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_gguf_blocks_at_tp3_and_pp2_equal_one_rank(hf):
    """The default model from its GGUF file at tp=3 (its 9 heads and 3 KV heads split in 3; each
    rank its rows of the Q4_1 linears and of the Q8_0 vocabulary table) and pp=2 (the last
    stage's tied LM head takes the Q8_0 table itself) gives one rank's tokens: pp=2 exactly (the
    same sums), tp=3 parting only at near-ties (its row-parallel sums are split)."""
    from shardlm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    layouts = {"one": {}, "tp3": {"tensor_parallel_size": 3}, "pp2": {"pipeline_parallel_size": 2}}
    outputs = {}
    for name, layout in layouts.items():
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=256, quantization="gguf", **layout)
        try:
            if blocked_int4() is not None:
                ranks = llm.collective_rpc("quantized_kernels")
                if name == "pp2":       # stage 0 holds the embedding, stage 1 the LM head: one table each
                    assert [r["blocked8"] for r in ranks] == [1, 1] and sum(r["blocked4"] for r in ranks) == 120
                else:
                    assert ranks == [{"blocked4": 120, "blocked8": 2}] * len(ranks), name
            outputs[name] = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
    one = [(o.outputs[0].token_ids, [{t for t, lp in d.items() if lp.rank <= 5} for d in o.outputs[0].logprobs])
           for o in outputs["one"]]
    assert [o.outputs[0].token_ids for o in outputs["pp2"]] == [ids for ids, _ in one]
    assert hf.assert_close(one, outputs["tp3"], "gguf tp=3") >= 2


@pytest.mark.slow
def test_tied_embedding_and_lm_head_keep_one_table(tiny_model_dir):
    """A tied LM head and its embedding hold one vocabulary table: the float one (packed for the
    LM head's kernel, the embedding reading its rows from it) and the default model's Q8_0 one."""
    from transformers import AutoModelForCausalLM
    path = tiny_model_dir("llama-tied-llama3rope")       # mostly its 49152 x 64 table
    hf_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    llm = LLM(path, **ENGINE)
    try:
        assert llm.collective_rpc("weight_bytes")[0] < 1.2 * hf_bytes      # two tables: ~1.9x
    finally:
        llm.shutdown()
    llm = LLM(dtype="bfloat16", quantization="gguf")
    try:
        model = llm.engine.engine_core.engine_core.executor.worker.runner.model   # tp=1: in this process
        embed, head = model.model.embed_tokens, model.lm_head
        if blocked_int4() is not None:      # AVX-512: the Q8_0 table is kept in 8-bit panels
            assert embed.quant is not None and head.quant is embed.quant and head.weight is None
        else:
            assert head.weight is embed.weight
    finally:
        llm.shutdown()


def test_gguf_quantization_needs_a_gguf_model(tiny_model_dir):
    with pytest.raises(ValueError, match="give a .gguf file as the model"):
        LLM(tiny_model_dir("llama-gqa"), **ENGINE, quantization="gguf")


def _packed_checkpoints(src: str, root, group: int = 32, quantizes=lambda name: True) -> dict[str, str]:
    """The tiny model with its linears 4-bit quantized (those whose weight name `quantizes` takes),
    written three ways: as a GPTQ checkpoint, as an AWQ checkpoint, and as the float model of their
    dequantized weights (the reference); the tokenizer and processor files beside each."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.unit.test_gptq_awq import pack_awq, pack_gptq, rtn_int4
    tensors = load_file(f"{src}/model.safetensors")
    with open(f"{src}/config.json") as f:
        config = json.load(f)
    quant_configs = {"gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                              "sym": False, "checkpoint_format": "gptq"},
                     "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                             "version": "gemm"}}
    out = {name: {} for name in ("gptq", "awq", "dequantized")}
    for name, w in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rsplit(".", 1)[-1] not in QUANTIZED or not quantizes(name):
            for part in out.values():
                part[name] = w
            continue
        q, zero, scale = rtn_int4(w, group)
        out["dequantized"][name] = (scale.float().repeat_interleave(group, 1) *
                                    (q - zero.repeat_interleave(group, 1))).contiguous()
        for method, pack in (("gptq", pack_gptq), ("awq", pack_awq)):
            out[method].update({f"{prefix}.{k}": v for k, v in pack(q, zero, scale).items()})
    dirs = {}
    for name, weights in out.items():
        dst = root / name
        dst.mkdir()
        save_file(weights, str(dst / "model.safetensors"))
        with open(dst / "config.json", "w") as f:
            json.dump({**config, **({"quantization_config": quant_configs[name]} if name in quant_configs else {})}, f)
        for extra in os.listdir(src):
            if extra not in ("config.json", "model.safetensors") and os.path.isfile(f"{src}/{extra}"):
                shutil.copy(f"{src}/{extra}", dst)
        dirs[name] = str(dst)
    return dirs


@pytest.fixture(scope="module")
def packed_checkpoints(tiny_model_dir, tmp_path_factory, hf):
    dirs = _packed_checkpoints(tiny_model_dir("llama-gqa"), tmp_path_factory.mktemp("packed"))
    return dirs, hf.greedy(dirs["dequantized"], _prompts(), MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("method, layout", [("gptq", {}), ("gptq", {"tensor_parallel_size": 2}),
                                            ("awq", {"pipeline_parallel_size": 2})],
                         ids=["gptq", "gptq-tp2", "awq-pp2"])
def test_gptq_and_awq_checkpoints_run_as_stored(method, layout, packed_checkpoints, hf):
    """The packed checkpoint is detected from config.json (no flag), each rank takes its part of the
    4-bit linears, and the engine equals transformers on the dequantized float weights."""
    dirs, reference = packed_checkpoints
    llm = LLM(dirs[method], **ENGINE, **layout)
    try:
        assert llm.engine.config.model.quantization.method == method
        kernels = llm.collective_rpc("quantized_kernels")
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    assert sum(sum(k.values()) for k in kernels) == 8 * (2 if "tensor_parallel_size" in layout else 1)
    exact = hf.assert_close(reference, outs, f"{method} {layout}")
    assert exact >= 4, f"only {exact}/6 sequences equal HF exactly"


@pytest.mark.slow
@pytest.mark.parametrize("model, method, group, layout", [
    ("mixtral", "gptq", 32, {}), ("mixtral", "awq", 32, {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("qwen3-moe", "gptq", 16, {"tensor_parallel_size": 2}), ("qwen3-moe", "awq", 16, {"pipeline_parallel_size": 2})],
    ids=["mixtral-gptq", "mixtral-awq-ep2", "qwen3-moe-gptq-tp2", "qwen3-moe-awq-pp2"])
def test_quantized_experts_of_a_checkpoint_run_as_stored(model, method, group, layout, tiny_model_dir,
                                                         tmp_path, hf):
    """A GPTQ/AWQ MoE checkpoint (Mixtral-GPTQ, Qwen3-MoE-AWQ: experts quantized too) runs with
    its experts' integers in panels, sliced (TP) or whole (EP), and equals transformers on the
    dequantized weights."""
    dirs = _packed_checkpoints(tiny_model_dir(model), tmp_path, group)
    llm = LLM(dirs[method], **ENGINE, **layout)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        experts = [kernel for rank in llm.collective_rpc("quantized_experts") for kernel in rank]
    finally:
        llm.shutdown()
    assert experts and set(experts) == {"blocked4"}
    exact = hf.assert_close(hf.greedy(dirs["dequantized"], _prompts(), MAX_TOKENS), outs, f"{model} {method}")
    assert exact >= 4, f"only {exact}/6 sequences equal HF exactly"


@pytest.mark.slow
@pytest.mark.parametrize("method, layout", [("gptq", {}), ("awq", {"tensor_parallel_size": 2})],
                         ids=["gptq", "awq-tp2"])
def test_a_phi3_checkpoints_fused_packed_linears_split_as_its_float_ones(method, layout, tiny_model_dir, tmp_path,
                                                                        hf):
    """Phi-3 stores q/k/v and gate/up fused, and rotates 0.75 of each head: the packed integers
    and scales are split and their q/k rows reordered as the float checkpoint's (it was refused
    before), and the engine equals transformers on the dequantized weights."""
    dirs = _packed_checkpoints(tiny_model_dir("phi3"), tmp_path)
    kernels, outs = _kernels_and_outputs(dirs[method], layout)
    assert all(sum(k.values()) == 8 for k in kernels), kernels      # qkv, o, gate/up, down of 2 layers
    exact = hf.assert_close(hf.greedy(dirs["dequantized"], _prompts(), MAX_TOKENS), outs, f"phi3 {method}")
    assert exact >= 4, f"only {exact}/6 sequences equal HF exactly"


def test_a_deepseek_gptq_checkpoint_is_refused_with_what_to_run(tiny_model_dir, tmp_path):
    """DeepSeek's latent up-projection becomes per-head float blocks at load, which packed
    weights taken as stored do not give: refused, naming the float checkpoint."""
    dirs = _packed_checkpoints(tiny_model_dir("deepseek-v2-lite"), tmp_path)
    with pytest.raises(ValueError, match="latent up-projection.*run the float checkpoint"):
        LLM(dirs["gptq"], **ENGINE)


def test_packed_checkpoints_refuse_other_quantization_flags(packed_checkpoints, tiny_model_dir):
    dirs, _ = packed_checkpoints
    with pytest.raises(ValueError, match="GPTQ-quantized.*leave out --quantization"):
        LLM(dirs["gptq"], **ENGINE, quantization="int4")
    with pytest.raises(ValueError, match="has no quantization_config"):
        LLM(tiny_model_dir("llama-gqa"), **ENGINE, quantization="awq")
