"""The cache key: a hash of named, readable factors.

Every factor that changes compiled code is here, and nothing that depends on
where things live (home, cache path, temp dirs): source files are named by
their module path, so a cache directory copied to another machine of the
same kind still hits. The factors are written next to the entry
(``key_factors.json``) so ``compile-runtime cache explain`` can say which
one changed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable
from typing import Any

import torch

from compile_runtime.config import CompilationConfig
from compile_runtime.device import resolve_device
from compile_runtime.platforms.select import platform_for
from compile_runtime.version import __version__

KEY_LENGTH = 20


def device_kind(device: torch.device | str | None = None, *, threads: bool = False) -> str:
    """``cuda:<capability>:<name>`` for a GPU, ``cpu:<ISA>`` otherwise (``cpu:<ISA>:<n>t``
    with ``threads``: when the compiled code has the thread count baked in)."""
    device = resolve_device(device)
    platform = platform_for(device)
    kind = platform.identity(device)
    return f"{kind}:{torch.get_num_threads()}t" if threads and platform.sets_threads else kind


def thread_count_baked_in(config: CompilationConfig) -> bool:
    """Whether compiled CPU code depends on the thread count at its compile.

    Our Inductor adaptor turns on ``cpp.dynamic_threads`` (its kernels ask OpenMP
    for the count when they run; no cost measured on the real model), so an entry
    written at one count loads at any other, and the default count, which follows
    how busy the machine is at start-up, never changes the key. Only a user who
    turns it off gets kernels with the count baked in, and the count in the key.
    """
    return (
        config.backend == "inductor"
        and config.inductor_compile_config.get("cpp.dynamic_threads", True) is False
    )


def versions() -> dict[str, str]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version, "compile_runtime": __version__}


@functools.lru_cache(maxsize=4096)
def _file_digest(path: str, mtime: float) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def portable_name(path: str) -> str:
    """``path`` as its package sees it (``pkg/sub/mod.py``): the same from any directory.

    Walks up while the directory is a package (has ``__init__.py``); a file
    outside any package is named by its file name.
    """
    path = os.path.abspath(path)
    parts = [os.path.basename(path)]
    directory = os.path.dirname(path)
    while os.path.exists(os.path.join(directory, "__init__.py")):
        parts.append(os.path.basename(directory))
        directory = os.path.dirname(directory)
    return "/".join(reversed(parts))


def source_digests(filenames: Iterable[str]) -> dict[str, str]:
    """Digest of every traced source file; torch's own files are covered by its version."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    out = {}
    for name in filenames:
        if not os.path.isfile(name) or name.startswith(torch_dir):
            continue
        out[portable_name(name)] = _file_digest(name, os.path.getmtime(name))
    return dict(sorted(out.items()))


def key_factors(
    config: CompilationConfig,
    *,
    graph_hash: str,
    sources: dict[str, str],
    pass_uuid: str,
    device: torch.device | str | None = None,
    world_size: int = 1,
    pipeline_stage: str = "0 of 1",
) -> dict[str, Any]:
    hashed = config.model_dump(mode="json", exclude=set(config.HASH_EXCLUDED_FIELDS))
    return {
        "config": hashed,
        "graph": graph_hash,
        "sources": sources,
        "versions": versions(),
        "device": device_kind(device, threads=thread_count_baked_in(config)),
        "passes": pass_uuid,
        "world_size": world_size,
        # A stage's graph holds its own layers; two stages with equal graphs still differ.
        "pipeline_stage": pipeline_stage,
    }


def compute_key(factors: dict[str, Any]) -> str:
    blob = json.dumps(factors, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:KEY_LENGTH]


def diff_factors(old: Any, new: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Every leaf where two factor trees differ: (dotted path, old value, new value)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            sub = f"{path}.{k}" if path else str(k)
            if k not in old:
                out.append((sub, None, new[k]))
            elif k not in new:
                out.append((sub, old[k], None))
            else:
                out.extend(diff_factors(old[k], new[k], sub))
        return out
    return [] if old == new else [(path, old, new)]
