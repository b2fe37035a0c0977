"""One cache entry: the compiled pieces of one model (tag) on one rank under one key.

Layout under the cache root::

    <key>/key_factors.json              the readable factors the key hashes
    <key>/artifacts/<sha256>.bin        content-addressed artifacts, shared
    <key>/rank_<r>/<tag>/index.json     (piece hash, shape, compiler) -> artifact
    <key>/rank_<r>/<tag>/meta.json      created, last used, hits, compile seconds
    <key>/rank_<r>/<tag>/computation_graph.py
    quarantine/                         entries found corrupt, moved aside

Writes go to a temporary name, are flushed, then renamed, and the index is
merged under a file lock: an entry is visible only when complete, and any
number of processes starting together end with one good entry. Every
artifact carries its sha256; a missing, truncated or foreign artifact, or an
index.json or meta.json that does not parse into what we wrote, is found on
start, its entry moved to ``quarantine/`` with one warning, and the pieces
compiled again. A damaged key_factors.json is written again from the factors
of the start that finds it (they are what the key hashes), and the readable
graph is rewritten by every start: neither is needed to load a piece.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from filelock import FileLock, Timeout

from compile_runtime.backends.compiler import CompiledPiece, CompilerAdaptor
from compile_runtime.cache.files import file_sha256, read_json, write_atomic, write_json
from compile_runtime.cache.kernels import collect as collect_kernels
from compile_runtime.cache.kernels import install as install_kernels
from compile_runtime.cache.kernels import track_loaded_kernels
from compile_runtime.cache.key import compute_key
from compile_runtime.cache.location import check_root
from compile_runtime.counters import compilation_counter

logger = logging.getLogger(__name__)

INDEX = "index.json"
META = "meta.json"
FACTORS = "key_factors.json"
GRAPH = "computation_graph.py"
ARTIFACTS = "artifacts"
QUARANTINE = "quarantine"
LOCK = ".lock"
RANK0_LOCK = ".rank_0-compiling.lock"
RANK_WAIT_SECONDS = 900


def shape_name(shape: int | None) -> str:
    return "general" if shape is None else str(shape)


def index_key(piece_hash: str, shape: int | None, compiler: str) -> str:
    return f"{piece_hash}/{shape_name(shape)}/{compiler}"


class DamagedEntryError(ValueError):
    """A file of a cache entry is missing, does not parse, or does not hold what we wrote."""


_NUMBER = (int, float)
ARTIFACT_FIELDS: dict[str, Any] = {"artifact": str, "sha256": str, "bytes": int, "meta": dict}
META_FIELDS: dict[str, Any] = {
    "created": _NUMBER,
    "last_used": _NUMBER,
    "hits": int,
    "compile_seconds": _NUMBER,
    "pieces": list,
    "shapes": list,
}


def _check_fields(obj: Any, fields: dict[str, Any], what: str, required: bool) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is not a JSON object")
    for name, kind in fields.items():
        if name not in obj:
            if required:
                raise ValueError(f"{what} has no {name!r}")
        elif not isinstance(obj[name], kind):
            raise ValueError(f"{what} has {name}={obj[name]!r}")


def _check_index(data: Any) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    _check_fields(data, {"artifacts": dict, "kernels": dict}, "it", required=False)
    if "artifacts" not in data:
        raise ValueError("it has no 'artifacts'")
    for key, record in data["artifacts"].items():
        if key.count("/") != 2:
            raise ValueError(f"index key {key!r} is not piece_hash/shape/compiler")
        _check_fields(record, ARTIFACT_FIELDS, f"record {key}", required=True)
        parts = os.path.normpath(record["artifact"]).split(os.sep)
        if len(parts) != 2 or parts[0] != ARTIFACTS:
            raise ValueError(f"record {key} points outside {ARTIFACTS}/: {record['artifact']!r}")
    kernels = data.get("kernels", {})
    for rel, record in kernels.items():
        _check_fields(record, {"sha256": str}, f"kernel record {rel}", required=True)
    return data["artifacts"], kernels


def _check_meta(data: Any) -> dict[str, Any]:
    _check_fields(data, META_FIELDS, "it", required=False)
    for piece in data.get("pieces", []):
        _check_fields(piece, {"hash": str, "pieces": list}, "a piece group", required=True)
    return data


def _read_checked(path: str, check: Callable[[Any], Any]) -> Any:
    name = os.path.basename(path)
    if not os.path.exists(path):
        raise DamagedEntryError(f"{name} is missing")
    try:
        return check(read_json(path))
    except (ValueError, OSError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise DamagedEntryError(f"{name} is damaged ({e})") from None


def read_index(entry_dir: str) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The artifact and kernel records of an entry (DamagedEntryError if unusable)."""
    return _read_checked(os.path.join(entry_dir, INDEX), _check_index)


def read_meta(entry_dir: str) -> dict[str, Any]:
    """An entry's meta.json ({} when there is none; DamagedEntryError if unusable)."""
    path = os.path.join(entry_dir, META)
    return _read_checked(path, _check_meta) if os.path.exists(path) else {}


def read_factors(key_dir: str) -> dict[str, Any]:
    """The key factors of a key directory, checked against the key they hash to."""
    key = os.path.basename(os.path.normpath(key_dir))

    def check(data: Any) -> dict[str, Any]:
        _check_fields(data, {"versions": dict, "device": str}, "it", required=True)
        if not isinstance(data["versions"].get("torch"), str):
            raise ValueError("it names no torch version")
        if compute_key(data) != key:
            raise ValueError(f"it hashes to {compute_key(data)}, not to its key {key}")
        return data

    return _read_checked(os.path.join(key_dir, FACTORS), check)


def verify_record(key_dir: str, record: dict[str, Any]) -> str | None:
    """Why the artifact of ``record`` cannot be trusted, or None when it checks out."""
    path = os.path.join(key_dir, record["artifact"])
    if not os.path.exists(path):
        return f"artifact {record['artifact']} is missing"
    size = os.path.getsize(path)
    if size != record["bytes"]:
        return f"artifact {record['artifact']} has {size} bytes, expected {record['bytes']}"
    if file_sha256(path) != record["sha256"]:
        return f"artifact {record['artifact']} fails its sha256 checksum"
    return None


def quarantine_dir(root: str, entry_dir: str, reason: str) -> str:
    """Move ``entry_dir`` aside under ``root/quarantine`` (never deleted) and return where."""
    rel = os.path.relpath(entry_dir, root).replace(os.sep, "-")
    target = os.path.join(
        root, QUARANTINE, f"{rel}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    )
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.move(entry_dir, target)
    with open(os.path.join(target, "REASON"), "w") as f:
        f.write(reason + "\n")
    return target


class CacheEntry:
    def __init__(
        self,
        root: str,
        key: str,
        factors: dict[str, Any],
        adaptor: CompilerAdaptor,
        model_tag: str,
        rank: int = 0,
    ):
        self.root = root
        self.key = key
        self.factors = factors
        self.adaptor = adaptor
        self.model_tag = model_tag
        self.key_dir = os.path.join(root, key)
        self.dir = os.path.join(self.key_dir, f"rank_{rank}", model_tag)
        self.index: dict[str, dict[str, Any]] = {}
        self.kernels: dict[str, dict[str, Any]] = {}
        self.ships_kernels = adaptor.name == "inductor" and factors.get("device", "").startswith(
            "cpu"
        )
        if self.ships_kernels:
            track_loaded_kernels()
        if os.path.exists(os.path.join(self.dir, INDEX)):
            try:
                self.index, self.kernels = read_index(self.dir)
                read_meta(self.dir)  # commit() updates it: damage means the entry is suspect
            except DamagedEntryError as e:
                self._quarantine(str(e))
        if self.kernels:
            install_kernels(self.key_dir, self.kernels)
        self.new_index: dict[str, dict[str, Any]] = {}
        self.num_loaded = 0
        self.num_compiled = 0
        # Ranks compile the same pieces wherever the artifact does not depend on
        # the rank: on a cold start rank 0 compiles while holding a lock, and the
        # other ranks wait for it and then take what rank 0 stored.
        self.other_ranks: dict[str, dict[str, Any]] = {}
        self._rank0_lock: FileLock | None = None
        if not self.index:
            os.makedirs(self.key_dir, exist_ok=True)
            lock = FileLock(os.path.join(self.key_dir, RANK0_LOCK))
            if rank == 0:
                lock.acquire()
                self._rank0_lock = lock
            else:
                try:
                    with lock.acquire(timeout=RANK_WAIT_SECONDS):
                        pass
                except Timeout:
                    logger.warning(
                        "rank %d: rank 0 still compiling after %d s", rank, RANK_WAIT_SECONDS
                    )
                self.other_ranks = self._read_other_ranks(rank)

    def _read_other_ranks(self, rank: int) -> dict[str, dict[str, Any]]:
        records: dict[str, dict[str, Any]] = {}
        for name in sorted(os.listdir(self.key_dir)):
            entry_dir = os.path.join(self.key_dir, name, self.model_tag)
            if name.startswith("rank_") and name != f"rank_{rank}":
                try:
                    records.update(read_index(entry_dir)[0])
                except DamagedEntryError:  # missing or damaged: that rank's pieces compile here
                    continue
        return records

    def release(self) -> None:
        """Let waiting ranks go on (after commit, or when compiling failed)."""
        if self._rank0_lock is not None:
            self._rank0_lock.release()
            self._rank0_lock = None

    def has(self, piece_hash: str, shape: int | None) -> bool:
        """Whether a whole artifact for this piece and shape is here (nothing is loaded)."""
        key = index_key(piece_hash, shape, self.adaptor.name)
        record = self.index.get(key) or self.other_ranks.get(key)
        return record is not None and verify_record(self.key_dir, record) is None

    def load(self, piece_hash: str, shape: int | None) -> Callable[..., Any] | None:
        """The saved callable for this piece and shape, or None (a miss)."""
        key = index_key(piece_hash, shape, self.adaptor.name)
        record = self.index.get(key)
        if record is None:
            record = self.other_ranks.get(key)
            if record is None or verify_record(self.key_dir, record) is not None:
                compilation_counter.num_cache_misses += 1
                return None
        problem = verify_record(self.key_dir, record)
        fn = None
        if problem is None:
            try:
                fn = self.adaptor.load(
                    os.path.join(self.key_dir, record["artifact"]), record["meta"]
                )
            except Exception as e:  # a foreign or damaged file that passed the checksum
                problem = f"artifact {record['artifact']} does not load ({type(e).__name__}: {e})"
        if problem is not None:
            self._quarantine(problem, bad_artifact=record["artifact"])
            compilation_counter.num_cache_misses += 1
            return None
        self.new_index[key] = record
        self.num_loaded += 1
        compilation_counter.num_cache_hits += 1
        compilation_counter.num_compiled_artifacts_loaded += 1
        return fn

    def store(
        self, piece_hash: str, shape: int | None, piece: CompiledPiece, seconds: float
    ) -> None:
        """Save a freshly compiled piece (content-addressed, atomically)."""
        artifacts = os.path.join(self.key_dir, ARTIFACTS)
        os.makedirs(artifacts, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=artifacts, prefix=".tmp-")
        os.close(fd)
        try:
            meta = self.adaptor.save(piece, tmp)
            if meta is None:  # the adaptor kept nothing to save (it said why): compile next time
                return
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            digest = file_sha256(tmp)
            size = os.path.getsize(tmp)
            name = os.path.join(ARTIFACTS, f"{digest}.bin")
            os.replace(tmp, os.path.join(self.key_dir, name))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self.new_index[index_key(piece_hash, shape, self.adaptor.name)] = {
            "artifact": name,
            "sha256": digest,
            "bytes": size,
            "meta": meta,
            "compile_seconds": round(seconds, 3),
        }
        self.num_compiled += 1
        compilation_counter.num_compiled_artifacts_saved += 1

    def commit(self, summary: dict[str, Any], graph_code: str) -> None:
        """Publish the index, meta and readable graph (merged under the key's lock)."""
        if not self.new_index and not os.path.exists(os.path.join(self.dir, INDEX)):
            self.release()  # nothing was saved (see store): an empty entry would only mislead
            return
        os.makedirs(self.dir, exist_ok=True)
        with FileLock(os.path.join(self.key_dir, LOCK)):
            self._write_factors()
            index_path = os.path.join(self.dir, INDEX)
            merged = dict(self.new_index)
            if os.path.exists(index_path):  # another process finished first: keep its records
                try:
                    for k, record in read_index(self.dir)[0].items():
                        if k not in merged and verify_record(self.key_dir, record) is None:
                            merged[k] = record
                except DamagedEntryError:
                    pass
            kernels = collect_kernels(self.key_dir) if self.ships_kernels else {}
            kernels = {**self.kernels, **kernels}
            if merged != self.index or kernels != self.kernels or not os.path.exists(index_path):
                write_json(index_path, {"version": 1, "artifacts": merged, "kernels": kernels})
            try:
                meta = read_meta(self.dir)
            except DamagedEntryError:  # damaged since this start checked it: begin it again
                meta = {}
            now = time.time()
            meta.setdefault("created", now)
            meta.setdefault("compile_seconds", summary.get("seconds", 0.0))
            meta["last_used"] = now
            meta["hits"] = meta.get("hits", 0) + (
                1 if self.num_loaded and not self.num_compiled else 0
            )
            meta.update({k: v for k, v in summary.items() if k != "seconds"})
            meta["model_tag"] = self.model_tag
            write_json(os.path.join(self.dir, META), meta)
            write_atomic(os.path.join(self.dir, GRAPH), graph_code.encode())
        self.release()

    def _write_factors(self) -> None:
        """Write key_factors.json when it is missing, or again when it is damaged."""
        path = os.path.join(self.key_dir, FACTORS)
        if os.path.exists(path):
            try:
                read_factors(self.key_dir)
                return
            except DamagedEntryError as e:
                logger.warning(
                    "compile cache %s: %s; writing it again from this start's factors",
                    self.key_dir,
                    str(e),  # not the exception: its traceback would keep the model alive
                )
        write_json(path, self.factors)

    def _quarantine(self, reason: str, bad_artifact: str | None = None) -> None:
        if os.path.isdir(self.dir):
            target = quarantine_dir(self.root, self.dir, reason)
            if bad_artifact and os.path.exists(os.path.join(self.key_dir, bad_artifact)):
                shutil.move(
                    os.path.join(self.key_dir, bad_artifact),
                    os.path.join(target, os.path.basename(bad_artifact)),
                )
            logger.warning(
                "compile cache entry %s is damaged: %s; moved it to %s and compiling again",
                self.dir,
                reason,
                target,
            )
        self.index = {}


def open_entry(
    cache_dir: str,
    factors: dict[str, Any],
    adaptor: CompilerAdaptor,
    model_tag: str,
    rank: int = 0,
) -> CacheEntry:
    check_root(cache_dir)
    return CacheEntry(cache_dir, compute_key(factors), factors, adaptor, model_tag, rank)
