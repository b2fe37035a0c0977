"""CacheEntry without a compiler: ranks share rank-independent artifacts."""

from __future__ import annotations

import threading

from compile_runtime.backends.compiler.base import CompiledPiece, CompilerAdaptor

import compile_runtime as cr
from compile_runtime.cache.entry import CacheEntry


class BytesAdaptor(CompilerAdaptor):
    """Saves a piece's "code" (a number) as bytes; loading gives a function adding it."""

    name = "bytes"

    @property
    def can_save(self) -> bool:
        return True

    def compile(self, graph, example_inputs, runtime_shape):
        raise NotImplementedError

    def save(self, piece: CompiledPiece, path: str) -> dict:
        with open(path, "wb") as f:
            f.write(str(piece.handle).encode())
        return {}

    def load(self, path: str, meta: dict):
        with open(path) as f:
            value = int(f.read())
        return lambda x: x + value


FACTORS = {"device": "test", "world_size": 2}


def entry(root, rank: int) -> CacheEntry:
    return CacheEntry(str(root), "key", FACTORS, BytesAdaptor(), "Model", rank)


def test_other_rank_waits_for_rank_0_then_loads_its_artifacts(tmp_path):
    rank0 = entry(tmp_path, 0)  # cold: holds the compile lock
    opened = threading.Event()
    result = {}

    def start_rank1():
        result["entry"] = entry(tmp_path, 1)
        opened.set()

    thread = threading.Thread(target=start_rank1)
    thread.start()
    assert not opened.wait(0.5)  # blocked while rank 0 compiles
    rank0.store("piece", None, CompiledPiece(fn=None, handle=41), seconds=0.1)
    rank0.commit({"seconds": 0.1}, "# graph")
    thread.join(timeout=30)
    assert opened.is_set()
    before = cr.compilation_counter.clone()
    fn = result["entry"].load("piece", None)
    assert fn is not None and fn(1) == 42
    assert cr.compilation_counter.num_cache_hits - before.num_cache_hits == 1
    assert result["entry"].load("piece", 8) is None  # a shape rank 0 never compiled


def test_failed_compile_releases_the_lock(tmp_path):
    rank0 = entry(tmp_path, 0)
    rank0.release()  # what the backend does when compiling raises
    rank1 = entry(tmp_path, 1)  # does not block
    assert rank1.load("piece", None) is None
