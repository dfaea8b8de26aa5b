"""GGUF files as llama.cpp writes them, of the architectures shardlm maps itself (gguf_names.py),
given as the model: converted once into a Hugging Face directory (each expert's matrices on
their own; a Mixtral, written as `llama` with experts, gets a Mixtral config: transformers' reader
made it a dense Llama whose MLPs were random), which transformers runs as the reference; with
`--quantization gguf` the file's own blocks run, experts' too, on TP, EP and PP, and equal it.
A Qwen2 file's q/k rows stay as stored (they were wrongly un-permuted before). Gemma 2, Gemma 3
and Phi-3 files are read as llama.cpp runs them: Gemma's norms less the 1 llama.cpp adds, its
soft-caps and attention scale, Phi-3's fused q/k/v and gate/up split as the float ones are, its
partial rotary embedding and LongRoPE factors."""

import json
import os

import pytest

from shardlm import LLM
from tests.gguf_models import write_gguf
from tests.models.test_tiny_models_vs_hf import MAX_TOKENS, PARAMS, _prompts

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-models")
    # Gemma 3 has 5 sliding layers to each full one
    return {kind: write_gguf(folder / f"tiny-{kind}.gguf", kind, layers=6 if kind == "gemma3" else 2)
            for kind in ("mixtral", "qwen3moe", "qwen2", "gemma2", "gemma3", "phi3")}


# Phi-3's LongRoPE takes its short factors within original_max_position_embeddings (256), as
# transformers does for these prompts (shardlm picks them once, by max_model_len)
LENGTHS = {"phi3": {"max_model_len": 256}}


def _converted(path: str) -> str:
    from shardlm.model_loader.default_model import converted_dir
    return converted_dir(path, os.path.basename(path)[:-5].lower())      # as LLM(path) converts it


def _run(path: str, **kw):
    llm = LLM(path, **{**ENGINE, **kw})
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        experts = [kernel for rank in llm.collective_rpc("quantized_experts") for kernel in rank]
        return outs, experts, llm.collective_rpc("quantized_kernels")
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("kind, architecture", [("mixtral", "MixtralForCausalLM"),
                                                ("qwen3moe", "Qwen3MoeForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                                ("gemma2", "Gemma2ForCausalLM"), ("gemma3", "Gemma3ForCausalLM"),
                                                ("phi3", "Phi3ForCausalLM")])
def test_a_gguf_file_converts_to_its_architecture_and_runs_like_transformers(kind, architecture, gguf_files, hf):
    folder = _converted(gguf_files[kind])
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == [architecture]
    if kind in ("mixtral", "qwen3moe"):
        assert (config.get("num_local_experts") or config.get("num_experts")) == 4
    outs, _, _ = _run(gguf_files[kind], **LENGTHS.get(kind, {}))
    exact = hf.assert_close(hf.greedy(folder, _prompts(), MAX_TOKENS), outs, kind)
    assert exact >= 5, f"only {exact}/6 sequences equal HF exactly"


@pytest.mark.slow
@pytest.mark.parametrize("kind, layout", [
    ("mixtral", {}), ("mixtral", {"tensor_parallel_size": 2}),
    ("mixtral", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("qwen3moe", {"pipeline_parallel_size": 2}), ("qwen2", {}), ("gemma2", {"pipeline_parallel_size": 2}),
    ("gemma3", {"tensor_parallel_size": 2}), ("phi3", {}), ("phi3", {"tensor_parallel_size": 2})],
    ids=["mixtral", "mixtral-tp2", "mixtral-ep2", "qwen3moe-pp2", "qwen2", "gemma2-pp2", "gemma3-tp2", "phi3",
         "phi3-tp2"])
def test_gguf_blocks_experts_too_run_as_stored(kind, layout, gguf_files, hf):
    """Q8_0 blocks dequantize exactly to the converted floats; the products (integers times float
    activations) round otherwise, so a near-tie of a random model may go the other way. Every
    linear of the dense models runs on the 8-bit panels (Phi-3's fused ones split as stored)."""
    outs, experts, kernels = _run(gguf_files[kind], quantization="gguf", **layout, **LENGTHS.get(kind, {}))
    if kind in ("mixtral", "qwen3moe"):
        assert experts and set(experts) == {"blocked8"}, experts
    else:       # q/k/v, o, gate/up and down of each layer a rank holds, and its Q8_0 vocabulary tables
        layers = (6 if kind == "gemma3" else 2) // layout.get("pipeline_parallel_size", 1)
        assert all(set(rank) == {"blocked8"} and rank["blocked8"] >= 4 * layers for rank in kernels), kernels
    exact = hf.assert_close(hf.greedy(_converted(gguf_files[kind]), _prompts(), MAX_TOKENS), outs, f"{kind} {layout}")
    assert exact >= 4, f"only {exact}/6 sequences equal HF exactly"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}],
                         ids=["one-rank", "ep2"])
def test_k_quant_experts_run_as_stored(layout, tmp_path_factory, hf):
    """A Mixtral whose experts are Q4_K (down projections Q6_K, as Q4_K_M files): the experts'
    blocks go to the 4- and 8-bit panels and the outputs equal transformers on the file's floats."""
    from gguf import GGMLQuantizationType as Q
    path = write_gguf(tmp_path_factory.mktemp("k-quants") / "tiny-mixtral-q4k.gguf", "mixtral", expert_qtype=Q.Q4_K)
    outs, experts, _ = _run(path, quantization="gguf", **layout)
    assert set(experts) == {"blocked4+blocked8"}, experts
    exact = hf.assert_close(hf.greedy(_converted(path), _prompts(), MAX_TOKENS), outs, f"Q4_K experts {layout}")
    assert exact >= 4, f"only {exact}/6 sequences equal HF exactly"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "qwen3moe"])
def test_shardlm_plan_reads_a_gguf_file_as_the_model_it_serves(kind, gguf_files):
    """`shardlm plan FILE.gguf` counts the parameters of the converted model, experts included
    (it read the file as JSON before and failed on its first binary byte)."""
    import math

    from safetensors import safe_open

    from shardlm.planner import ModelShape, load_config
    name, cfg = load_config(gguf_files[kind])
    shape = ModelShape.from_config(name, cfg)
    with safe_open(os.path.join(_converted(gguf_files[kind]), "model.safetensors"), "pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert name == f"tiny-{kind}" and shape.num_experts == 4
    assert shape.total_params() == stored


@pytest.mark.parametrize("kind", ["gemma3", "phi3"])
def test_the_float_reader_equals_transformers_gguf_reader(kind, tmp_path):
    """shardlm's one-pass reader gives the tensors transformers' GGUF loader gives (Gemma's norms
    less 1, Phi-3's fused tensors whole); the token embedding, which that loader returns scaled in
    Gemma's case, equals gguf's own dequantization of the file. (Gemma 2's names are Gemma 3's
    without the q/k norms; transformers' reading of a file takes seconds, so it is left out.)"""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from shardlm.model_loader.default_model import gguf_hf_config
    from shardlm.model_loader.gguf_file import GGUFFile
    from shardlm.model_loader.gguf_weights import float_state_dict
    path = write_gguf(tmp_path / f"tiny-{kind}.gguf", kind, layers=6 if kind == "gemma3" else 2, tokenizer=False)
    ours = float_state_dict(GGUFFile(path), gguf_hf_config(path))
    folder, name = os.path.split(path)
    theirs = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight" if kind.startswith("gemma") else ""}
    embedding = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    assert torch.equal(ours["model.embed_tokens.weight"],
                       torch.from_numpy(gguf.quants.dequantize(embedding.data, embedding.tensor_type)))
    differ = [n for n in ours if n != "model.embed_tokens.weight" and not torch.equal(ours[n], theirs[n])]
    assert not differ, differ


def test_the_config_is_completed_as_llama_cpp_runs_the_file(gguf_files):
    """What transformers' config reading leaves at its defaults and llama.cpp reads or derives:
    Gemma 2's soft-caps, Gemma's attention scale (head_dim ** -0.5 below 27B), Gemma 3's linear
    rope scaling of its full layers, Phi-3's partial rotary embedding and LongRoPE factors."""
    from shardlm.model_loader.default_model import gguf_hf_config
    gemma2, gemma3, phi3 = (gguf_hf_config(gguf_files[k]) for k in ("gemma2", "gemma3", "phi3"))
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (5.0, 3.0)
    assert gemma2.query_pre_attn_scalar == gemma3.query_pre_attn_scalar == 16
    assert gemma3.rope_parameters["full_attention"]["factor"] == 8.0
    assert gemma3.rope_parameters["sliding_attention"]["rope_type"] == "default"
    assert gemma3.layer_types.count("full_attention") == 1 and gemma3.sliding_window == 8
    rope = phi3.rope_parameters
    assert rope["partial_rotary_factor"] == 0.75 and rope["rope_type"] == "longrope"
    assert len(rope["long_factor"]) == len(rope["short_factor"]) == 6
    assert phi3.original_max_position_embeddings == 256 and phi3.max_position_embeddings == 512
