"""A GGUF file's scalar metadata and tensor table, read in milliseconds.

``gguf.GGUFReader`` parses every metadata value into numpy views, the tokenizer's ~100k
strings included, at every start (seconds: the README's start-up figures). The weights
need only the scalars (architecture, head counts) and the tensor table, so this reads the
header with ``struct`` and steps over array values (a string array by its lengths alone).
The tensors it lists are what ``GGUFReader``'s are to ``GGUFTensor``: a name, the
``GGMLQuantizationType``, the dims as stored (innermost first) and ``data``, a view of the
read-only memory map shaped as ``GGUFReader`` shapes it.

Little-endian GGUF v2/v3 only; ``read_index`` returns None for anything else, and the
caller then uses ``GGUFReader``. A file cut short or malformed raises ``ValueError`` (or
``struct.error``), which the caller names as an unreadable GGUF file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# Metadata value types: their struct formats (scalars), 8 string, 9 array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass
class IndexedTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dims as stored, innermost first
    data: np.ndarray


@dataclass
class GGUFIndex:
    values: dict[str, Any]  # scalar metadata (strings decoded); arrays are left out
    tensors: list[IndexedTensor]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"a string of {n} bytes at offset {self.pos} runs past the file")
        text = bytes(self.buf[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def skip_string(self) -> None:
        self.pos += self.unpack("<Q")

    def value(self, kind: int) -> Any:
        """A metadata value; an array is stepped over and read as None."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind} at offset {self.pos}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[item]) * count
        else:
            for _ in range(count):
                self.value(item)
        if self.pos > len(self.buf):
            raise ValueError(f"an array of {count} values runs past the end of the file")
        return None


def read_index(path: str) -> GGUFIndex | None:
    """The file's scalar metadata and tensor table, or None (not little-endian v2/v3)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.memmap(path, mode="r")
    cursor = _Cursor(memoryview(data))
    if bytes(data[:4]) != _MAGIC:
        raise ValueError("no GGUF magic at the start")
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        return None  # another version, or a big-endian file: GGUFReader's
    num_tensors, num_values = cursor.unpack("<Q"), cursor.unpack("<Q")
    values = {}
    for _ in range(num_values):
        key = cursor.string()
        values[key] = cursor.value(cursor.unpack("<I"))
    table, names = [], set()
    for _ in range(num_tensors):
        name = cursor.string()
        if name in names:
            raise ValueError(f"tensor {name} is listed twice")
        names.add(name)
        dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
        table.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
    alignment = values.get("general.alignment") or _DEFAULT_ALIGNMENT
    start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in table:
        ggml_type = GGMLQuantizationType(kind)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        shape = tuple(reversed(dims))
        dtype = _PLAIN.get(ggml_type.name)
        if dtype is None:  # blocks: bytes, the innermost dim in bytes
            dtype, shape = np.uint8, (*shape[:-1], shape[-1] // block * type_size)
        count = int(np.prod(shape))
        begin = start + offset
        end = begin + count * np.dtype(dtype).itemsize
        if end > len(data):
            raise ValueError(f"tensor {name} ends at byte {end}, past the file's {len(data)}")
        view = data[begin:end].view(dtype).reshape(shape)
        tensors.append(IndexedTensor(name, ggml_type, np.array(dims, dtype=np.uint64), view))
    return GGUFIndex(values, tensors)


_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip
