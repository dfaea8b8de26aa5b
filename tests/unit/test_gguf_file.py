"""shardlm's one-pass GGUF reader against gguf's own GGUFReader, and the float weights it gives a
llama- and a qwen2-architecture file against transformers' GGUF loader, on a tiny file written here (float32
norms, a Q8_0 embedding, Q4_1 and Q8_0 linears, grouped-query q/k rows to un-permute)."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from shardlm.layers.quantization import dequantize
from shardlm.model_loader.gguf_file import GGUFFile
from shardlm.model_loader.gguf_weights import _decode_file, float_state_dict

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 96, 4, 2, 2, 64


def _write_tiny_llama(path, architecture="llama"):
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(VOCAB)])

    def add(name, shape, qtype):
        x = rng.standard_normal(shape).astype(np.float32)
        writer.add_tensor(name, x if qtype == Q.F32 else quants.quantize(x, qtype), raw_dtype=qtype)

    add("token_embd.weight", (VOCAB, HIDDEN), Q.Q8_0)
    add("output_norm.weight", (HIDDEN,), Q.F32)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), Q.F32)
        add(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN), Q.Q4_1)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN), Q.Q4_1)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN), Q.Q8_0)
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN), Q.Q4_1)
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), Q.Q4_1)
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), Q.Q4_1)
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return _write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_metadata_and_tensors_read_as_ggufs_own_reader_reads_them(tiny_gguf):
    ours, theirs = GGUFFile(str(tiny_gguf)), gguf.GGUFReader(str(tiny_gguf))
    fields = {name: field.contents() for name, field in theirs.fields.items() if not name.startswith("GGUF.")}
    assert ours.metadata == fields and ours.architecture == "llama"
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.type_name == tensor.tensor_type.name
        assert mine.shape == tuple(int(n) for n in reversed(tensor.shape))
        assert np.array_equal(mine.raw, np.asarray(tensor.data).view(np.uint8).reshape(mine.raw.shape)), tensor.name
        assert np.array_equal(mine.to_float32(), quants.dequantize(tensor.data, tensor.tensor_type).reshape(mine.shape))


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        GGUFFile(str(path))


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_weights_equal_transformers_gguf_loader_bit_for_bit(tmp_path, tiny_gguf, architecture):
    """llama's q/k rows come back from llama.cpp's permutation; qwen2's were never permuted (taking
    them back too scrambled every --quantization gguf Qwen file's attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path = tiny_gguf if architecture == "llama" else _write_tiny_llama(tmp_path / "q.gguf", architecture)
    folder, name = path.parent, path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    ours = float_state_dict(GGUFFile(str(path)), config)
    theirs = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).state_dict()
    theirs.pop("lm_head.weight")        # tied: the embedding's
    assert set(ours) == {k for k in theirs if not k.endswith(".bias")}      # (the tiny qwen2 has no biases)
    for key, value in ours.items():
        assert value.dtype == torch.float32 and torch.equal(theirs[key], value), key
    blocks = _decode_file(str(path), config)        # --quantization gguf's integers, rows as the floats'
    assert len(blocks) == 7 * 2 + 1                 # the 7 linears of 2 layers, the Q8_0 embedding
    for key, (q, scales, mins, _) in blocks.items():
        assert torch.equal(dequantize(q, scales, mins, torch.float32), theirs[key]), key


def test_another_architecture_or_an_unknown_tensor_goes_to_transformers(tmp_path, tiny_gguf):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert float_state_dict(GGUFFile(str(_write_tiny_llama(tmp_path / "g.gguf", "stablelm"))), config) is None
    file = GGUFFile(str(tiny_gguf))
    file.tensors["rope_freqs.weight"] = file.tensors["output_norm.weight"]
    assert float_state_dict(file, config) is None
