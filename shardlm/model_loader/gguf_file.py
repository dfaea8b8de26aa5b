"""A GGUF file read in one pass: its metadata, and each tensor as a view of the mapped file.

gguf's own `GGUFReader` makes a numpy view of every part of every metadata field, 245,000
for a 49k-token vocabulary: 3 s for the embedded default model, and converting that model
through transformers read it three times. This reader unpacks the same fields with `struct`
(a fraction of a second) and leaves the tensor data in the mapped file until it is decoded.
The layout (GGUF v2/v3): a header, key/value metadata, tensor descriptions, then the data,
aligned to `general.alignment` (32 bytes unless the file says otherwise).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass

import numpy as np

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str          # ggml's type: F32, F16, Q4_1, Q8_0, ...
    shape: tuple[int, ...]  # torch's order: [rows, columns] for a matrix (GGUF lists columns first)
    raw: np.ndarray         # uint8 [rows, bytes per row], a view of the file

    def to_float32(self) -> np.ndarray:
        """The tensor's values (dequantized as ggml does, by gguf's own decoders)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        values = dequantize(self.raw, GGMLQuantizationType[self.type_name])
        return values.astype(np.float32, copy=False).reshape(self.shape)


class GGUFFile:
    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        magic, version, n_tensors, n_fields = struct.unpack_from("<4sIQQ", self._buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF file of version 2 or 3 (magic {magic!r}, version {version}).")
        self.path, self.version = path, version
        self._pos = 24
        self.metadata: dict[str, object] = {}
        self.value_types: dict[str, tuple[int, ...]] = {}     # GGUF's type ids: (type,) or (array, item type)
        for _ in range(n_fields):
            key = self._string()
            value_type = self._unpack("<I")
            if value_type == _ARRAY:
                self.value_types[key] = (_ARRAY, struct.unpack_from("<I", self._buf, self._pos)[0])
            else:
                self.value_types[key] = (value_type,)
            self.metadata[key] = self._value(value_type)
        described = [(self._string(), self._dims(), self._unpack("<I"), self._unpack("<Q")) for _ in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, type_id, offset in described:
            self.tensors[name] = self._tensor(name, dims, type_id, start + offset)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def _tensor(self, name: str, dims: tuple[int, ...], type_id: int, offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        kind = GGMLQuantizationType(type_id)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        rows = math.prod(dims[1:])
        row_bytes = dims[0] // block * block_bytes
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=rows * row_bytes, offset=offset).reshape(rows, row_bytes)
        return GGUFTensor(name, kind.name, tuple(reversed(dims)), raw)

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        text = self._buf[self._pos:self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return text

    def _dims(self) -> tuple[int, ...]:
        n = self._unpack("<I")
        dims = struct.unpack_from(f"<{n}Q", self._buf, self._pos)
        self._pos += 8 * n
        return dims

    def _value(self, value_type: int):
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type in _SCALARS:       # numbers in one read
                fmt = f"<{count}{_SCALARS[item_type]}"
                items = list(struct.unpack_from(fmt, self._buf, self._pos))
                self._pos += struct.calcsize(fmt)
                return items
            return [self._value(item_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ValueError(f"GGUF metadata value of unknown type {value_type} at byte {self._pos}.")
        return self._unpack("<" + _SCALARS[value_type])
