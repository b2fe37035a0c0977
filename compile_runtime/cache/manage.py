"""Inspect and manage the compile cache: what ``compile-runtime cache ...`` runs.

Each function returns plain data (the CLI prints it as a table or JSON). A
damaged entry is data too: it is listed with its problem, never an exception
that hides the rest of the cache.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from filelock import FileLock

from compile_runtime.cache import weight_file
from compile_runtime.cache.entry import (
    ARTIFACTS,
    FACTORS,
    GRAPH,
    INDEX,
    LOCK,
    QUARANTINE,
    DamagedEntryError,
    quarantine_dir,
    read_factors,
    read_index,
    read_meta,
    verify_record,
)
from compile_runtime.cache.files import file_sha256
from compile_runtime.cache.kernels import KERNELS
from compile_runtime.cache.key import diff_factors
from compile_runtime.cache.location import CacheError, check_root

FIX_HINT = "run `compile-runtime cache verify --fix` to move it aside"


@dataclass
class EntryInfo:
    key: str
    rank: str
    model_tag: str
    path: str
    created: float | None
    last_used: float | None
    hits: int
    size_bytes: int
    num_pieces: int  # unique compiled pieces
    num_shapes: int
    torch_version: str | None
    compile_seconds: float | None
    pieces: list[dict[str, Any]] = field(default_factory=list)
    artifacts: dict[str, dict[str, Any]] = field(default_factory=dict)
    kernels: dict[str, dict[str, Any]] = field(default_factory=dict)
    problem: str | None = None  # why its index.json or meta.json cannot be used
    key_problem: str | None = None  # why its key's key_factors.json cannot be used

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def key_dirs(root: str) -> list[str]:
    if not os.path.isdir(check_root(root)):
        return []
    return sorted(
        name
        for name in os.listdir(root)
        if name != QUARANTINE
        and os.path.isdir(os.path.join(root, name))
        and not name.startswith(".")
    )


def _subdirs(path: str) -> list[str]:
    return sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))


def _factors_or_problem(key_dir: str) -> tuple[dict[str, Any], str | None]:
    try:
        return read_factors(key_dir), None
    except DamagedEntryError as e:
        return {}, str(e)


def iter_entries(root: str, key: str | None = None) -> Iterator[EntryInfo]:
    for k in [key] if key else key_dirs(root):
        key_dir = os.path.join(root, k)
        factors, key_problem = _factors_or_problem(key_dir)
        for rank in (d for d in _subdirs(key_dir) if d.startswith("rank_")):
            for tag in _subdirs(os.path.join(key_dir, rank)):
                path = os.path.join(key_dir, rank, tag)
                if not os.path.exists(os.path.join(path, INDEX)):
                    continue
                info = _entry_info(k, rank, tag, path, factors)
                info.key_problem = key_problem
                yield info


def _entry_info(key, rank, tag, path, factors) -> EntryInfo:
    try:
        index, kernels = read_index(path)
        meta = read_meta(path)
    except DamagedEntryError as e:
        return EntryInfo(key, rank, tag, path, None, None, 0, 0, 0, 0, None, None, problem=str(e))
    unique = {r["artifact"]: r["bytes"] for r in index.values()}
    return EntryInfo(
        key=key,
        rank=rank,
        model_tag=tag,
        path=path,
        created=meta.get("created"),
        last_used=meta.get("last_used"),
        hits=meta.get("hits", 0),
        size_bytes=sum(unique.values()),
        num_pieces=len({k.split("/")[0] for k in index}),
        num_shapes=len({k.split("/")[1] for k in index}),
        torch_version=factors.get("versions", {}).get("torch"),
        compile_seconds=meta.get("compile_seconds"),
        pieces=meta.get("pieces", []),
        artifacts=index,
        kernels=kernels,
    )


def resolve_key(root: str, key: str) -> str:
    """A full key from a unique prefix."""
    matches = [k for k in key_dirs(root) if k.startswith(key)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise CacheError(
            f"no cache entry with key {key!r} in {root}; see `compile-runtime cache list`"
        )
    raise CacheError(f"key prefix {key!r} is ambiguous: {matches}")


def list_entries(root: str) -> list[EntryInfo]:
    return list(iter_entries(root))


def show(root: str, key: str) -> dict[str, Any]:
    key = resolve_key(root, key)
    key_dir = os.path.join(root, key)
    factors, factors_problem = _factors_or_problem(key_dir)
    return {
        "key": key,
        "path": key_dir,
        "factors": factors,
        "factors_problem": factors_problem,
        "entries": [
            {**e.to_json(), "graph": os.path.join(e.path, GRAPH)} for e in iter_entries(root, key)
        ],
    }


def explain(old_factors: dict[str, Any], new_factors: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    return diff_factors(old_factors, new_factors)


def factors_of(root: str, key: str) -> dict[str, Any]:
    key = resolve_key(root, key)
    try:
        return read_factors(os.path.join(root, key))
    except DamagedEntryError as e:
        raise CacheError(f"entry {key}: {e}; {FIX_HINT}") from None


def closest_entry(
    root: str, factors: dict[str, Any]
) -> tuple[str | None, list[tuple[str, Any, Any]]]:
    """The stored key whose factors differ least from ``factors`` (and the differences)."""
    best: tuple[str | None, list] = (None, [])
    for key in key_dirs(root):
        stored, problem = _factors_or_problem(os.path.join(root, key))
        if problem:
            continue
        diff = diff_factors(stored, factors)
        if best[0] is None or len(diff) < len(best[1]):
            best = (key, diff)
    return best


def verify(root: str, key: str | None = None, fix: bool = False) -> list[dict[str, Any]]:
    """Every entry's problems: damaged index/meta/key factors, missing or corrupt artifacts
    and kernels. ``fix`` moves bad entries to quarantine/ (a bad key_factors.json: the
    whole key, since no entry under it can be explained or exported)."""
    keys = [resolve_key(root, key)] if key else key_dirs(root)
    report = []
    for k in keys:
        key_dir = os.path.join(root, k)
        rows = []
        entries = list(iter_entries(root, k))
        key_problem = _factors_or_problem(key_dir)[1]
        # Without entries a missing file means rank 0 is still compiling.
        if key_problem and (entries or os.path.exists(os.path.join(key_dir, FACTORS))):
            rows.append({"key": k, "path": key_dir, "problems": [key_problem]})
        for info in entries:
            if info.problem:
                problems = [info.problem]
            else:
                problems = [p for r in info.artifacts.values() if (p := verify_record(key_dir, r))]
                problems += [
                    p for rel, r in info.kernels.items() if (p := _verify_kernel(key_dir, rel, r))
                ]
            rows.append({"key": k, "path": info.path, "problems": sorted(set(problems))})
        for row in rows:
            row["ok"] = not row["problems"]
        if fix and any(row["path"] == key_dir for row in rows):
            with FileLock(os.path.join(root, f".{k}.lock")):
                target = quarantine_dir(root, key_dir, rows[0]["problems"][0])
            for row in rows:  # every entry moved with its key
                rel = os.path.relpath(row["path"], key_dir)
                row["quarantined_to"] = os.path.normpath(os.path.join(target, rel))
        elif fix:
            for row in rows:
                if row["problems"]:
                    with FileLock(os.path.join(key_dir, LOCK)):
                        row["quarantined_to"] = quarantine_dir(
                            root, row["path"], "; ".join(row["problems"])
                        )
        report.extend(rows)
    return report


def _verify_kernel(key_dir: str, rel: str, record: dict[str, Any]) -> str | None:
    path = os.path.join(key_dir, KERNELS, rel)
    if not os.path.exists(path):
        return f"kernel {rel} is missing"
    if file_sha256(path) != record["sha256"]:
        return f"kernel {rel} fails its sha256 checksum"
    return None


def _remove_key(root: str, key: str) -> int:
    key_dir = os.path.join(root, key)
    size = _dir_size(key_dir)
    with FileLock(os.path.join(root, f".{key}.lock")):
        staging = os.path.join(root, f".removing-{key}-{os.getpid()}")
        os.replace(key_dir, staging)  # invisible at once, then deleted
        shutil.rmtree(staging)
    lock = os.path.join(root, f".{key}.lock")
    if os.path.exists(lock):
        os.unlink(lock)
    return size


def _dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def clear(root: str, key: str | None = None) -> list[str]:
    keys = [resolve_key(root, key)] if key else key_dirs(root)
    for k in keys:
        _remove_key(root, k)
    return keys


def _last_used(root: str, key: str) -> float:
    times = [e.last_used or e.created or 0.0 for e in iter_entries(root, key)]
    return max(times, default=os.path.getmtime(os.path.join(root, key)))


def prune(root: str, max_size: int | None = None, older_than: float | None = None) -> list[str]:
    """Remove entries not used for ``older_than`` seconds, then least recently used first
    until the cache is at most ``max_size`` bytes."""
    if max_size is None and older_than is None:
        raise CacheError("prune needs --max-size and/or --older-than")
    # (name, last used, bytes, remove): the entries, and the packed-weight files (last used:
    # their access time, which a start that maps one sets)
    items = [
        (k, _last_used(root, k), _dir_size(os.path.join(root, k)), partial(_remove_key, root, k))
        for k in key_dirs(root)
    ]
    for path, size, _ in weight_file.list_files(root):
        name = os.path.relpath(path, root)
        items.append((name, os.stat(path).st_atime, size, partial(os.unlink, path)))
    items.sort(key=lambda item: item[1])
    removed = []
    now = time.time()
    if older_than is not None:
        for item in list(items):
            if now - item[1] > older_than:
                item[3]()
                removed.append(item[0])
                items.remove(item)
    if max_size is not None:
        total = sum(item[2] for item in items)
        for name, _, size, remove in items:
            if total <= max_size:
                break
            remove()
            removed.append(name)
            total -= size
    return removed


__all__ = [
    "ARTIFACTS",
    "CacheError",
    "EntryInfo",
    "clear",
    "closest_entry",
    "explain",
    "factors_of",
    "list_entries",
    "prune",
    "show",
    "verify",
]
