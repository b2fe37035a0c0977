"""Ship Inductor's compiled C++ kernels (CPU) with a cache entry.

Inductor's saved artifacts hold the generated code but not the shared
libraries of its C++ kernels: loading one on a machine whose Inductor cache
is empty compiles every kernel again (seconds each on a small CPU). Inductor
looks a kernel up by a path that is relative to its cache directory and
derived from the kernel's source and flags, so we record which libraries a
process loads, keep copies in the entry (with checksums), and put them back
in place before loading the artifacts. GPU kernels need none of this: the
artifacts bundle them.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from compile_runtime import torch_internals
from compile_runtime.cache.files import file_sha256, write_atomic
from compile_runtime.torch_internals import record_inductor_library_loads

logger = logging.getLogger(__name__)

KERNELS = "kernels"
_loaded: set[str] = set()
_installed = False


def track_loaded_kernels() -> None:
    """Record every C++ kernel library Inductor loads in this process (idempotent)."""
    global _installed
    if _installed:
        return
    # Kernels, and the small libraries Inductor builds to probe the CPU's vector ISA.
    if not record_inductor_library_loads(lambda path: _loaded.add(os.path.abspath(path))):
        logger.debug("Inductor's loaders moved: compiled C++ kernels are not shipped")
        return
    _installed = True


def inductor_cache_dir() -> str:
    return os.path.abspath(torch_internals.inductor_cache_dir())


def collect(key_dir: str) -> dict[str, dict[str, Any]]:
    """Copy the kernels loaded so far into ``key_dir/kernels``; return their records."""
    root = inductor_cache_dir()
    records: dict[str, dict[str, Any]] = {}
    for path in sorted(_loaded):
        if not path.startswith(root + os.sep) or not os.path.exists(path):
            continue
        rel = os.path.relpath(path, root)
        target = os.path.join(key_dir, KERNELS, rel)
        if not os.path.exists(target):
            with open(path, "rb") as f:
                write_atomic(target, f.read())
        records[rel] = {"sha256": file_sha256(target), "bytes": os.path.getsize(target)}
    return records


def install(key_dir: str, records: dict[str, dict[str, Any]]) -> int:
    """Put the entry's kernels where Inductor looks for them; return how many were placed.

    A kernel that fails its checksum is skipped (Inductor then compiles it).
    """
    root = inductor_cache_dir()
    placed = 0
    for rel, record in records.items():
        target = os.path.join(root, rel)
        if os.path.exists(target):
            continue
        source = os.path.join(key_dir, KERNELS, rel)
        if not os.path.exists(source) or file_sha256(source) != record["sha256"]:
            logger.warning(
                "compile cache kernel %s is missing or damaged; Inductor will rebuild it", rel
            )
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.tmp-{os.getpid()}"
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
        placed += 1
    return placed
