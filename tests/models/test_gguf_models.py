"""GGUF files as llama.cpp writes them, of the architectures shardlm maps itself (gguf_names.py),
given as the model: converted once into a Hugging Face directory (each expert's matrices on
their own; a Mixtral, written as `llama` with experts, gets a Mixtral config: transformers' reader
made it a dense Llama whose MLPs were random), which transformers runs as the reference; with
`--quantization gguf` the file's own blocks run, experts' too, on TP, EP and PP, and equal it.
A Qwen2 file's q/k rows stay as stored (they were wrongly un-permuted before)."""

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
    return {kind: write_gguf(folder / f"tiny-{kind}.gguf", kind) for kind in ("mixtral", "qwen3moe", "qwen2")}


def _converted(path: str) -> str:
    from shardlm.model_loader.default_model import converted_dir
    return converted_dir(path, os.path.basename(path)[:-5].lower())      # as LLM(path) converts it


def _run(path: str, **kw):
    llm = LLM(path, **ENGINE, **kw)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        experts = [kernel for rank in llm.collective_rpc("quantized_experts") for kernel in rank]
        return outs, experts
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("kind, architecture", [("mixtral", "MixtralForCausalLM"),
                                                ("qwen3moe", "Qwen3MoeForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_a_gguf_file_converts_to_its_architecture_and_runs_like_transformers(kind, architecture, gguf_files, hf):
    folder = _converted(gguf_files[kind])
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == [architecture]
    if kind != "qwen2":
        assert (config.get("num_local_experts") or config.get("num_experts")) == 4
    outs, _ = _run(gguf_files[kind])
    exact = hf.assert_close(hf.greedy(folder, _prompts(), MAX_TOKENS), outs, kind)
    assert exact >= 5, f"only {exact}/6 sequences equal HF exactly"


@pytest.mark.slow
@pytest.mark.parametrize("kind, layout", [
    ("mixtral", {}), ("mixtral", {"tensor_parallel_size": 2}),
    ("mixtral", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("qwen3moe", {"pipeline_parallel_size": 2}), ("qwen2", {})],
    ids=["mixtral", "mixtral-tp2", "mixtral-ep2", "qwen3moe-pp2", "qwen2"])
def test_gguf_blocks_experts_too_run_as_stored(kind, layout, gguf_files, hf):
    """Q8_0 blocks dequantize exactly to the converted floats; the products (integers times float
    activations) round otherwise, so a near-tie of a random model may go the other way."""
    outs, experts = _run(gguf_files[kind], quantization="gguf", **layout)
    if kind != "qwen2":
        assert experts and set(experts) == {"blocked8"}, experts
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
    outs, experts = _run(path, quantization="gguf", **layout)
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
