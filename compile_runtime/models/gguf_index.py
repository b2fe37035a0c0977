"""A GGUF file's scalar metadata and tensor table, read in milliseconds.

``gguf.GGUFReader`` parses every metadata value into numpy views, the tokenizer's ~100k
strings included, at every start (seconds: the README's start-up figures). The weights
need only the scalars (architecture, head counts) and the tensor table, so this reads the
header with ``struct`` and steps over array values (a string array by its lengths alone).
The tensors it lists are what ``GGUFReader``'s are to ``GGUFTensor``: a name, the
``GGMLQuantizationType``, the dims as stored (innermost first) and ``data``, a view of the
read-only memory map shaped as ``GGUFReader`` shapes it.

Little-endian GGUF v2/v3 only; ``read_index`` returns None for anything else, and the
caller then uses ``GGUFReader``. A file cut short or malformed raises ``ValueError`` naming
the field, which the caller names as an unreadable GGUF file. The file is untrusted: no
count, length or shape is believed before it is checked against the bytes the file has,
so a damaged one costs no allocation and no loop longer than the file.
"""

from __future__ import annotations

import math
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
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays: llama.cpp writes none; a deeper one is damage


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
    """Reads the header front to back; every read names what it reads (``what``), so a
    malformed file's error says which field is wrong, and no count or length is believed
    before it is checked against the bytes the file has left."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def fail(self, what: str, problem: str) -> ValueError:
        return ValueError(f"{what} at byte {self.pos}: {problem}")

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise self.fail(what, f"the file ends at byte {len(self.buf)} (cut short)")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def count(self, what: str, each: int) -> int:
        """A count (or length) of items of at least ``each`` bytes, checked against the file."""
        n = self.unpack("<Q", what)
        if n * each > len(self.buf) - self.pos:
            raise self.fail(what, f"{n} claims more than the {len(self.buf) - self.pos} bytes left")
        return n

    def string(self, what: str) -> str:
        n = self.count(f"the length of {what}", 1)
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        """A metadata value; an array is stepped over and read as None."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            raise self.fail(what, f"unknown value type {kind} (0-12)")
        if depth >= _MAX_NESTING:
            raise self.fail(what, f"arrays nested deeper than {_MAX_NESTING}")
        item = self.unpack("<I", f"the item type of {what}")
        if item not in _SCALARS and item not in (_STRING, _ARRAY):
            raise self.fail(what, f"unknown item type {item} (0-12)")
        each = struct.calcsize(_SCALARS[item]) if item in _SCALARS else 8
        count = self.count(f"the item count of {what}", each)
        if item in _SCALARS:
            self.pos += each * count
        else:
            for i in range(count):
                self.value(item, f"{what}[{i}]", depth + 1)
        return None


def read_index(path: str) -> GGUFIndex | None:
    """The file's scalar metadata and tensor table, or None (not little-endian v2/v3)."""
    data = np.memmap(path, mode="r")
    cursor = _Cursor(memoryview(data))
    if bytes(data[:4]) != _MAGIC:
        raise ValueError("no GGUF magic at the start")
    cursor.pos = 4
    version = cursor.unpack("<I", "the version")
    if version not in (2, 3):
        return None  # another version, or a big-endian file: GGUFReader's
    # Each tensor entry takes at least 24 bytes, each metadata entry at least 13.
    num_tensors = cursor.count("the tensor count", 24)
    num_values = cursor.count("the metadata count", 13)
    values = {}
    for i in range(num_values):
        key = cursor.string(f"metadata key #{i}")
        values[key] = cursor.value(
            cursor.unpack("<I", f"the type of {key!r}"), f"the value of {key!r}"
        )
    table, names = [], set()
    for i in range(num_tensors):
        name = cursor.string(f"the name of tensor #{i}")
        if name in names:
            raise ValueError(f"tensor {name} is listed twice")
        names.add(name)
        n_dims = cursor.unpack("<I", f"the dimension count of tensor {name}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions (GGUF allows 1 to 4)")
        dims = [cursor.unpack("<Q", f"dimension {d} of tensor {name}") for d in range(n_dims)]
        kind = cursor.unpack("<I", f"the type of tensor {name}")
        table.append((name, dims, kind, cursor.unpack("<Q", f"the offset of tensor {name}")))
    alignment = values.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment is {alignment!r}, not a power of two")
    start = -(-cursor.pos // alignment) * alignment
    return GGUFIndex(values, [_tensor(data, start, *entry) for entry in table])


def _tensor(data: np.ndarray, start: int, name: str, dims: list, kind: int, offset: int):
    """A view of one tensor's bytes, its type, shape and extent checked against the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        ggml_type = GGMLQuantizationType(kind)
    except ValueError:
        raise ValueError(f"tensor {name} has unknown type {kind}") from None
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    if dims[0] % block:
        raise ValueError(
            f"tensor {name} ({ggml_type.name}) has rows of {dims[0]} values, not whole "
            f"blocks of {block}"
        )
    shape = tuple(reversed(dims))
    dtype = _PLAIN.get(ggml_type.name)
    if dtype is None:  # blocks: bytes, the innermost dim in bytes
        dtype, shape = np.uint8, (*shape[:-1], shape[-1] // block * type_size)
    size = math.prod(shape) * np.dtype(dtype).itemsize  # Python ints: no overflow
    begin = start + offset
    if begin + size > len(data):
        raise ValueError(
            f"tensor {name} (shape {shape}, {ggml_type.name}) ends at byte {begin + size}, "
            f"past the file's {len(data)}"
        )
    view = data[begin : begin + size].view(dtype).reshape(shape)
    return IndexedTensor(name, ggml_type, np.array(dims, dtype=np.uint64), view)


_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip
