"""Packed-weight files: a model's weights as its kernels read them, mapped instead of loaded.

The first load of a model reads its checkpoint, fuses, quantizes and rearranges every
weight for the CPU kernels; ``write`` then stores the result, one tensor after another, in a
file under the cache's ``.weights/`` folder. A later start maps that file (``open_mapped``):
no read, no rearranging, and the pages are the page cache's, shared by every process that
maps the same file (each sees them as shared, clean file pages).

Layout: ``MAGIC``, the header's length (8 bytes, little-endian), the header (JSON: the key
it was made for, the file's size, every tensor's name, dtype, shape, byte offset and
flags), the header's SHA-256 (32 bytes), then the tensors from the first 2 MiB boundary
(a huge page), each on a 4 KiB page. ``open_mapped`` checks the magic, the header's
checksum, the key and the size before it maps anything; a file that fails is
``WeightFileError`` (the caller rebuilds it), never a tensor of wrong bytes. The mapping
is private (copy-on-write): a weight written in place later (a reload) gets its own pages
and the file stays as it was.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from compile_runtime.cache.files import atomic_file

MAGIC = b"CRWEIGHTS\x00"
LAYOUT_VERSION = 1
HUGE_PAGE = 2 << 20  # the first tensor on a huge page's boundary
ALIGN = 4096  # each tensor on a page's
SUFFIX = ".crw"
FOLDER = ".weights"


class WeightFileError(ValueError):
    """A packed-weight file cannot be used (the message says why); rebuild it."""


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    flags: tuple[str, ...]


def weights_folder(cache_root: str) -> str:
    return os.path.join(cache_root, FOLDER)


def file_path(cache_root: str, key: str) -> str:
    return os.path.join(weights_folder(cache_root), key + SUFFIX)


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightFileError(f"unknown dtype {name!r}")
    return dtype


def _round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def write(
    path: str, key: dict[str, Any], tensors: Iterable[tuple[str, torch.Tensor, tuple[str, ...]]]
) -> int:
    """Write ``tensors`` (name, contiguous CPU tensor, flags) for ``key`` to ``path``,
    atomically (readers see no file or the whole one); its size in bytes. An ``OSError``
    (a full disk) leaves no partial file behind and is raised for the caller to report."""
    items = list(tensors)
    entries, offset = [], 0
    for name, t, flags in items:
        nbytes = t.numel() * t.element_size()
        entries.append(
            {
                "name": name,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": nbytes,
                "flags": list(flags),
            }
        )
        offset += _round_up(nbytes)
    data_bytes = offset

    def header_for(data_start: int) -> bytes:
        return json.dumps(
            {
                "version": LAYOUT_VERSION,
                "key": key,
                "data_start": data_start,
                "file_bytes": data_start + data_bytes,
                "tensors": entries,
            },
            sort_keys=True,
        ).encode()

    head = len(MAGIC) + 8 + 32
    data_start = _round_up(head + len(header_for(0)) + 64, HUGE_PAGE)  # + its own digits
    header = header_for(data_start)
    with atomic_file(path) as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        f.write(hashlib.sha256(header).digest())
        for (_, t, _), entry in zip(items, entries, strict=True):
            f.seek(data_start + entry["offset"])
            f.write(memoryview(t.detach().contiguous().view(torch.uint8).numpy()))
        f.truncate(data_start + data_bytes)
    return data_start + data_bytes


def read_header(path: str) -> dict[str, Any]:
    """The header of the file at ``path``, checked (magic, checksum, size); else
    ``WeightFileError`` naming the problem."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            start = f.read(len(MAGIC) + 8)
            if len(start) < len(MAGIC) + 8 or start[: len(MAGIC)] != MAGIC:
                raise WeightFileError(f"{path}: not a packed-weight file (no magic)")
            (length,) = struct.unpack("<Q", start[len(MAGIC) :])
            if length > min(size, 1 << 30):
                raise WeightFileError(f"{path}: header length {length} is past the file's end")
            header = f.read(length)
            digest = f.read(32)
    except OSError as e:
        raise WeightFileError(f"{path}: unreadable ({e})") from None
    if len(header) != length or hashlib.sha256(header).digest() != digest:
        raise WeightFileError(f"{path}: the header's checksum does not match (damaged)")
    info = json.loads(header)
    if info.get("version") != LAYOUT_VERSION:
        raise WeightFileError(f"{path}: layout version {info.get('version')}, not {LAYOUT_VERSION}")
    if info["file_bytes"] != size:
        raise WeightFileError(
            f"{path}: {size} bytes, the header says {info['file_bytes']} (truncated)"
        )
    return info


def open_mapped(path: str, key: dict[str, Any]) -> dict[str, tuple[torch.Tensor, tuple[str, ...]]]:
    """Every tensor of the file at ``path`` (name -> (tensor, flags)), the tensors views of one
    private mapping of the file advised for huge pages. ``WeightFileError`` when the file is
    damaged or was made for another key (another source file, model, dtype, CPU, version)."""
    info = read_header(path)
    if info["key"] != key:
        changed = sorted(k for k in set(key) | set(info["key"]) if key.get(k) != info["key"].get(k))
        raise WeightFileError(f"{path}: made for another {', '.join(changed)}")
    with open(path, "rb") as f:
        mapping = mmap.mmap(
            f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:
            pass  # a file system without large folios: ordinary pages
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    tensors = {}
    for e in info["tensors"]:
        stored = StoredTensor(
            e["name"], e["dtype"], tuple(e["shape"]), e["offset"], e["nbytes"], tuple(e["flags"])
        )
        begin = info["data_start"] + stored.offset
        view = whole[begin : begin + stored.nbytes].view(_dtype(stored.dtype))
        tensors[stored.name] = (view.view(stored.shape), stored.flags)
    return tensors


def list_files(cache_root: str) -> list[tuple[str, int, dict[str, Any] | str]]:
    """Each packed-weight file in the cache: (path, bytes, its header, or the problem)."""
    folder = weights_folder(cache_root)
    if not os.path.isdir(folder):
        return []
    found = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(SUFFIX):
            continue
        path = os.path.join(folder, name)
        try:
            header: dict[str, Any] | str = read_header(path)
        except WeightFileError as e:
            header = str(e)
        found.append((path, os.path.getsize(path), header))
    return found


def clear_files(cache_root: str) -> list[str]:
    """Remove every packed-weight file (and leftovers of interrupted writes); their paths.
    A process that has one mapped keeps its pages until it ends."""
    folder = weights_folder(cache_root)
    if not os.path.isdir(folder):
        return []
    removed = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            os.unlink(path)
            removed.append(path)
    return removed
