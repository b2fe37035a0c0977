"""Move one cache entry between machines: ``export`` writes it to a .tar(.gz|.zst) archive,
``import_archive`` installs one after checking its checksums and that it fits this machine."""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile

from filelock import FileLock

from compile_runtime.cache.entry import LOCK, DamagedEntryError, read_factors
from compile_runtime.cache.key import device_kind, versions
from compile_runtime.cache.location import CacheError
from compile_runtime.cache.manage import key_dirs, resolve_key, verify


def _tar_mode(path: str, write: bool) -> str:
    if path.endswith((".tar.gz", ".tgz")):
        return "w:gz" if write else "r:gz"
    if path.endswith(".tar.zst"):
        raise CacheError(
            f"{path}: .tar.zst needs the zstandard module, which this Python lacks "
            "(pip install zstandard); use a .tar.gz name instead"
        )
    if path.endswith(".tar"):
        return "w" if write else "r"
    raise CacheError(f"{path}: export to a .tar.gz or .tar file")


def _zstd_open(path: str, write: bool):
    import zstandard

    if write:
        return zstandard.ZstdCompressor().stream_writer(open(path, "wb"))
    return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"))


def export(root: str, key: str, out: str) -> str:
    key = resolve_key(root, key)
    bad = [r for r in verify(root, key) if not r["ok"]]
    if bad:
        raise CacheError(f"entry {key} fails verification ({bad[0]['problems']}); fix it first")
    if out.endswith(".tar.zst"):
        try:
            stream = _zstd_open(out, write=True)
        except ImportError:
            _tar_mode(out, write=True)  # raises the install hint
        with stream, tarfile.open(fileobj=stream, mode="w|") as tar:
            tar.add(os.path.join(root, key), arcname=key, filter=_skip_locks)
        return key
    with tarfile.open(out, _tar_mode(out, write=True)) as tar:
        tar.add(os.path.join(root, key), arcname=key, filter=_skip_locks)
    return key


def _skip_locks(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if os.path.basename(info.name) in (LOCK,) or "/.tmp-" in info.name else info


def import_archive(root: str, archive: str) -> str:
    """Install an exported entry after checking its checksums and that it fits this machine."""
    if not os.path.exists(archive):
        raise CacheError(f"{archive} does not exist")
    os.makedirs(root, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".import-") as tmp:
        try:
            _extract(archive, tmp)
        except (tarfile.TarError, EOFError, OSError) as e:
            raise CacheError(f"{archive} is not a readable cache archive ({e})") from None
        keys = key_dirs(tmp)
        if len(keys) != 1:
            raise CacheError(f"{archive} holds {len(keys)} entries; expected one exported entry")
        key = keys[0]
        try:
            factors = read_factors(os.path.join(tmp, key))
        except DamagedEntryError as e:
            raise CacheError(f"{archive} is not a usable cache entry: {e}") from None
        problems = [p for r in verify(tmp, key) for p in r["problems"]]
        if problems:
            raise CacheError(f"{archive} is damaged: {problems}")
        here = {"torch": versions()["torch"], "device": device_kind()}
        there = {"torch": factors["versions"]["torch"], "device": factors["device"]}
        if here != there:
            raise CacheError(
                f"{archive} was built for torch {there['torch']} on {there['device']}; this "
                f"machine has torch {here['torch']} on {here['device']}, so it would never hit"
            )
        target = os.path.join(root, key)
        with FileLock(os.path.join(root, f".{key}.lock")):
            if os.path.exists(target):
                _merge_into(os.path.join(tmp, key), target)
            else:
                os.replace(os.path.join(tmp, key), target)
        return key


def _extract(archive: str, into: str) -> None:
    if archive.endswith(".tar.zst"):
        try:
            stream = _zstd_open(archive, write=False)
        except ImportError:
            _tar_mode(archive, write=False)  # raises the install hint
        with stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            tar.extractall(into, filter="data")
    else:
        with tarfile.open(archive, _tar_mode(archive, write=False)) as tar:
            tar.extractall(into, filter="data")


def _merge_into(src: str, dst: str) -> None:
    """Add what ``src`` has and ``dst`` lacks (artifacts and entries), never overwriting."""
    for d, _, files in os.walk(src):
        rel = os.path.relpath(d, src)
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for f in files:
            target = os.path.join(dst, rel, f)
            if not os.path.exists(target):
                shutil.copy2(os.path.join(d, f), target)
