"""compressed-tensors checkpoints with integer weights (W4A16, W8A16, W8A8), written by the
compressed-tensors library: detected from config.json (no flag), each rank takes its part of the
stored integers, and the engine equals transformers on the library's dequantized weights (and on
the compressed checkpoint itself, which transformers decompresses with that library), at one
rank, tp=2, pp=2 and dp=2, in float32 and bfloat16."""

import pytest

from shardlm import LLM
from tests.compressed_checkpoints import write
from tests.models.test_tiny_models_vs_hf import MAX_TOKENS, PARAMS, _prompts

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory, hf):
    """scheme -> (compressed dir, dequantized float dir, transformers' tokens on the latter)."""
    pytest.importorskip("compressed_tensors")
    cache = {}

    def get(scheme: str):
        if scheme not in cache:
            compressed, dequantized = write(tiny_model_dir("llama-gqa"), tmp_path_factory.mktemp(scheme), scheme)
            cache[scheme] = compressed, dequantized, hf.greedy(dequantized, _prompts(), MAX_TOKENS)
        return cache[scheme]
    return get


def _generate(model_dir: str, **engine):
    llm = LLM(model_dir, **{**ENGINE, **engine})
    try:
        kernels = llm.collective_rpc("quantized_kernels")
        return llm.engine.config.model.quantization, kernels, llm.generate(_prompts(), PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("scheme, layout, kernel", [
    ("w4a16", {}, "blocked4"), ("w4a16-asym", {"tensor_parallel_size": 2}, "blocked4"),
    ("w4a16-channel", {"pipeline_parallel_size": 2}, "blocked4"), ("w8a16", {}, "blocked8"),
    ("w8a8", {"data_parallel_size": 2}, "blocked8")],
    ids=["w4a16", "w4a16-asym-tp2", "w4a16-channel-pp2", "w8a16", "w8a8-dp2"])
def test_compressed_checkpoints_equal_hf_on_their_dequantized_weights(scheme, layout, kernel, checkpoints, hf):
    compressed, _, reference = checkpoints(scheme)
    quant, kernels, outs = _generate(compressed, **layout)
    assert (quant.method, quant.bits) == ("compressed-tensors", int(scheme[1]))
    assert quant.group_size == (32 if scheme.startswith("w4a16") and "channel" not in scheme else -1)
    # q/k/v, o, gate/up and down of both layers hold the stored integers, on every tensor parallel
    # rank of every replica
    assert kernels and all(set(k) == {kernel} for k in kernels)
    copies = layout.get("tensor_parallel_size", 1) * layout.get("data_parallel_size", 1)
    assert sum(sum(k.values()) for k in kernels) == 8 * copies
    exact = hf.assert_close(reference, outs, f"{scheme} {layout}")
    assert exact >= 4, f"only {exact}/6 sequences equal HF exactly"


@pytest.mark.slow
def test_transformers_reading_the_compressed_checkpoint_gives_the_same_tokens(checkpoints, hf):
    """The reference above is the library's dequantization; transformers decompressing the
    checkpoint itself (through compressed-tensors) gives those tokens, and so does the engine."""
    compressed, _, reference = checkpoints("w4a16")
    assert [ids for ids, _ in hf.greedy(compressed, _prompts(), MAX_TOKENS)] == [ids for ids, _ in reference]


@pytest.mark.slow
def test_a_bfloat16_model_runs_the_stored_integers_too(checkpoints, hf):
    compressed, dequantized, _ = checkpoints("w4a16")
    import torch
    _, kernels, outs = _generate(compressed, dtype="bfloat16")
    assert kernels == [{"blocked4": 8}]
    hf.assert_close(hf.greedy(dequantized, _prompts(), MAX_TOKENS, dtype=torch.bfloat16), outs, "w4a16 bfloat16")


def test_compressed_checkpoints_refuse_other_quantization_flags(checkpoints, tiny_model_dir):
    compressed, _, _ = checkpoints("w8a8")
    with pytest.raises(ValueError, match="COMPRESSED-TENSORS-quantized .one scale a row.*leave out --quantization"):
        LLM(compressed, **ENGINE, quantization="int4")
    with pytest.raises(ValueError, match="has no quantization_config"):
        LLM(tiny_model_dir("llama-gqa"), **ENGINE, quantization="compressed-tensors")
