"""transformers' reading of a GGUF file's config and tokenizer, fed by shardlm's one-pass reader.

transformers maps a GGUF file's metadata to a Hugging Face config and tokenizer (its tables, its
tokenizer converters: kept, they are the reference), but reads the file through gguf's
`GGUFReader`, which makes a numpy view of every part of every field: 5 s for a 49k-token
vocabulary on each call, and a conversion makes two (config, tokenizer). Within
`metadata_from(file)` transformers gets the same fields from a `GGUFFile` instead, in a fraction
of that. Only the metadata is served: the tensors carry their names alone (what transformers
reads of them without `return_tensors`), so a weight read would fail at once, not run on
something else.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import NamedTuple

import numpy as np

from shardlm.model_loader.gguf_file import GGUFFile

_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
_swap = threading.RLock()      # one swap at a time; re-entered by a nested read


class TensorName(NamedTuple):
    name: str


class MetadataReader:
    """What transformers reads of a `gguf.GGUFReader` for a config or tokenizer: `fields` (each
    value's parts and their types, as gguf lays them out) and the tensors' names."""

    def __init__(self, file: GGUFFile):
        from gguf import GGUFValueType, ReaderField
        # gguf's reader lists the header's counts first, as fields
        header = {"GGUF.version": (file.version, 4), "GGUF.tensor_count": (len(file.tensors), 10),
                  "GGUF.kv_count": (len(file.metadata), 10)}
        self.fields = {key: ReaderField(0, key, [_part(value, t)], [0], [GGUFValueType(t)])
                       for key, (value, t) in header.items()}
        for key, value in file.metadata.items():
            types = file.value_types[key]
            parts = [_part(v, types[-1]) for v in value] if types[0] == _ARRAY else [_part(value, types[0])]
            self.fields[key] = ReaderField(0, key, parts, list(range(len(parts))),
                                           [GGUFValueType(t) for t in types])
        self.tensors = [TensorName(name) for name in file.tensors]


def _part(value, value_type: int) -> np.ndarray:
    if value_type == _STRING:
        return np.frombuffer(value.encode("utf-8"), dtype=np.uint8)
    return np.array([value], dtype=_NUMPY[value_type])


def readable(file: GGUFFile) -> bool:
    """Whether MetadataReader holds every field (it leaves arrays of arrays to gguf's reader)."""
    return all(types[0] != _ARRAY or types[1] != _ARRAY for types in file.value_types.values())


@contextlib.contextmanager
def metadata_from(file: GGUFFile):
    """Within it, transformers' reading of `file` (AutoConfig / AutoTokenizer with gguf_file=)
    takes the metadata from `file`; any other GGUF file is read by gguf's reader, as before."""
    import gguf
    if not readable(file):
        yield
        return
    gguf_reader = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        if os.path.exists(path) and os.path.samefile(path, file.path):
            return MetadataReader(file)
        return gguf_reader(path, *args, **kwargs)

    with _swap:
        gguf.GGUFReader = reader
        try:
            yield
        finally:
            gguf.GGUFReader = gguf_reader
