"""transformers reads a GGUF file's config and tokenizer from shardlm's one-pass reader
(gguf_metadata.metadata_from): every field it parses equals what gguf's own reader gives, a
Phi-3 file's float arrays and the embedded default model's 49k-token vocabulary included, and
a read of tensor data fails instead of running on something else."""

import gguf
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


@pytest.mark.parametrize("kind", ["default", "phi3"])
def test_every_field_parses_as_from_ggufs_reader(kind, tmp_path):
    path = gguf_path() if kind == "default" else write_gguf(tmp_path / "tiny-phi3.gguf", "phi3")
    file = GGUFFile(path)
    theirs, ours = gguf.GGUFReader(path), MetadataReader(file)
    assert readable(file)
    assert _parsed(ours) == _parsed(theirs)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert ours.fields["tokenizer.ggml.tokens"].contents(5) == theirs.fields["tokenizer.ggml.tokens"].contents(5)


def test_only_the_file_given_is_served_and_gguf_is_restored(tmp_path):
    one, other = (write_gguf(tmp_path / f"tiny-{k}.gguf", k) for k in ("qwen2", "gemma2"))
    real = gguf.GGUFReader
    with metadata_from(GGUFFile(one)):
        assert isinstance(gguf.GGUFReader(one), MetadataReader)
        assert isinstance(gguf.GGUFReader(other), real)
        with pytest.raises(AttributeError):         # tensors carry their names alone
            gguf.GGUFReader(one).tensors[0].data
    assert gguf.GGUFReader is real
