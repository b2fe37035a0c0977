"""Crash-safe file writes and checksums for the cache."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any, BinaryIO


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[BinaryIO]:
    """``with atomic_file(path) as f:`` write ``f``; readers see the old file or the whole new
    one (written to a temporary file beside it, synced, renamed); an error leaves nothing."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one."""
    with atomic_file(path) as f:
        f.write(data)


def write_json(path: str, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)
