"""transformers reads a GGUF file's config and tokenizer from shardlm's one-pass reader
(gguf_metadata.metadata_from): every field it parses equals what gguf's own reader gives, for
the embedded default model (its 49k-token vocabulary) and for a file of every value type, and
a read of tensor data fails instead of running on something else."""

import gguf
import numpy as np
import pytest
from transformers.integrations.ggml import _gguf_parse_value

from shardlm.model_loader.default_model import gguf_path
from shardlm.model_loader.gguf_file import GGUFFile
from shardlm.model_loader.gguf_metadata import MetadataReader, metadata_from, readable
from tests.gguf_models import write_gguf


def _parsed(reader) -> dict:
    """Each field as transformers parses it (load_gguf_checkpoint's reading), and its types."""
    return {key: ([_gguf_parse_value(field.parts[i], field.types) for i in field.data], list(field.types))
            for key, field in reader.fields.items()}


def _every_value_type(path) -> str:
    """A GGUF file with one field of each scalar type, a string, arrays of numbers, booleans and
    strings, and one tensor."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for i, kind in enumerate(("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")):
        getattr(writer, f"add_{kind}")(f"test.{kind}", i + 1 if kind.startswith("u") else -(i + 1))
    writer.add_float32("test.float32", 0.1)
    writer.add_float64("test.float64", -2.5e-300)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "héllo ▁ wörld")
    writer.add_array("test.floats", [0.5, -1.25, 3e-8])
    writer.add_array("test.ints", [-3, 0, 7])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.strings", ["a", "", "ü̈"])
    writer.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("kind", ["default", "every-value-type"])
def test_every_field_parses_as_from_ggufs_reader(kind, tmp_path):
    path = gguf_path() if kind == "default" else _every_value_type(tmp_path / "types.gguf")
    file = GGUFFile(path)
    theirs, ours = gguf.GGUFReader(path), MetadataReader(file)
    assert readable(file)
    assert _parsed(ours) == _parsed(theirs)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    strings = "tokenizer.ggml.tokens" if kind == "default" else "test.strings"
    assert ours.fields[strings].contents() == theirs.fields[strings].contents()


def test_only_the_file_given_is_served_and_gguf_is_restored(tmp_path):
    one, other = write_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2"), _every_value_type(tmp_path / "types.gguf")
    real = gguf.GGUFReader
    with metadata_from(GGUFFile(one)):
        assert isinstance(gguf.GGUFReader(one), MetadataReader)
        assert isinstance(gguf.GGUFReader(other), real)
        with pytest.raises(AttributeError):         # tensors carry their names alone
            gguf.GGUFReader(one).tensors[0].data
    assert gguf.GGUFReader is real
