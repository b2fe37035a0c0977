"""Compiled pieces by (piece hash, size): loaded from the cache entry, or compiled and stored.

The cold start runs the split graph on fake inputs and, for each static piece,
loads or compiles its callables (``PieceCompiler``); the warm start of a saved
program loads them from its piece table (``load_pieces``). Both go through
``load_or_compile``, so a piece is found, compiled and stored by one rule.
Structurally identical pieces (every transformer layer) share one hash and so
one set of callables.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from compile_runtime.backends.compiler import CompilerAdaptor
from compile_runtime.cache.entry import CacheEntry
from compile_runtime.compiler.graph_hash import piece_hash
from compile_runtime.compiler.piecewise import PiecewiseRuntime, find_size_locator
from compile_runtime.compiler.split import Piece
from compile_runtime.counters import compilation_counter
from compile_runtime.torch_internals import unset_fake_temporarily

logger = logging.getLogger(__name__)


@dataclass
class PieceRecord:
    """What the compiler did for one piece (for logs, dumps and the cache)."""

    index: int
    name: str
    is_splitting_op: bool
    piece_hash: str | None = None
    shared_with: int | None = None  # index of the piece whose compiled code this one reuses
    compile_seconds: float = 0.0


@dataclass
class CompileResult:
    pieces: list[PieceRecord] = field(default_factory=list)
    unique_pieces: int = 0
    compile_sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0


def _concrete_int(value: Any, size: int) -> int:
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr.xreplace({s: size for s in expr.free_symbols}))
    return int(value)


def concrete_inputs(example_inputs: list[Any], size: int) -> list[Any]:
    """Real example inputs with every symbolic size replaced by ``size``."""
    out = []
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            out.append(_concrete_int(value, size))
        elif isinstance(value, torch.Tensor):
            shape = [_concrete_int(s, size) for s in value.shape]
            stride = [_concrete_int(s, size) for s in value.stride()]
            out.append(
                torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device).zero_()
            )
        else:
            out.append(value)
    return out


def load_or_compile(
    cache: CacheEntry | None,
    adaptor: CompilerAdaptor,
    graph: torch.fx.GraphModule,
    fake_args: list[Any],
    key: str,
    size: int | None,
) -> Callable[..., Any]:
    """The callable of piece ``key`` at ``size`` (None: the general one): from the cache,
    else compiled (for ``size`` on real inputs of that size) and stored."""
    if cache is not None:
        loaded = cache.load(key, size)
        if loaded is not None:
            return loaded
    start = time.perf_counter()
    if size is None:
        compiled = adaptor.compile(graph, fake_args, None)
    else:
        with unset_fake_temporarily():
            compiled = adaptor.compile(graph, concrete_inputs(fake_args, size), size)
    compilation_counter.num_backend_compilations += 1
    if cache is not None:
        with unset_fake_temporarily():
            cache.store(key, size, compiled, time.perf_counter() - start)
    return compiled.fn


class PieceCompiler(torch.fx.Interpreter):
    """Runs the split graph on fake inputs, loading or compiling each static piece on the way."""

    def __init__(
        self,
        split_gm: torch.fx.GraphModule,
        pieces: list[Piece],
        *,
        adaptor: CompilerAdaptor,
        cache: CacheEntry | None,
        compile_sizes: list[int],
        dedupe: bool,
    ):
        super().__init__(split_gm)
        self.pieces = {p.name: p for p in pieces}
        self.adaptor, self.cache = adaptor, cache
        self.compile_sizes, self.dedupe = compile_sizes, dedupe
        self.compiled: dict[str, tuple[int, dict[int | None, Callable[..., Any]]]] = {}
        self.runtimes: dict[str, PiecewiseRuntime] = {}
        self.records: list[PieceRecord] = []

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        output = super().call_module(target, args, kwargs)
        piece = self.pieces[target]
        record = PieceRecord(piece.index, piece.name, piece.is_splitting_op)
        self.records.append(record)
        if piece.is_splitting_op:
            return output

        args_list = list(args)
        record.piece_hash = key = piece_hash(piece.graph, args_list)
        if not self.dedupe:
            key = f"{key}:{piece.index}"
        if key in self.compiled:
            record.shared_with, by_size = self.compiled[key]
        else:
            start = time.perf_counter()
            by_size = {
                size: load_or_compile(
                    self.cache, self.adaptor, piece.graph, args_list, record.piece_hash, size
                )
                for size in self._sizes(piece, args_list)
            }
            record.compile_seconds = time.perf_counter() - start
            self.compiled[key] = (piece.index, by_size)
            logger.info(
                "compiled piece %d (%s, hash %s) for %d size(s) in %.2f s",
                piece.index,
                self.adaptor.name,
                key,
                len(by_size),
                record.compile_seconds,
            )
        self.runtimes[target] = PiecewiseRuntime(
            index=piece.index,
            general=by_size[None],
            exact={s: fn for s, fn in by_size.items() if s is not None},
            locator=find_size_locator(args_list),
            piece_hash=key,
        )
        return output

    def _sizes(self, piece: Piece, fake_args: list[Any]) -> list[int | None]:
        """The general size (None) and, where the piece has a symbolic size, each compile size."""
        if find_size_locator(fake_args) is not None:
            return [None, *self.compile_sizes]
        if self.compile_sizes:
            logger.info("piece %d has no symbolic size: compile_sizes do not apply", piece.index)
        return [None]


def load_pieces(
    cache: CacheEntry, table: list[dict[str, Any]], index_of: dict[str, int], model_tag: str
) -> dict[str, PiecewiseRuntime] | None:
    """Every static piece of a saved program's piece table from ``cache``, compiling
    nothing; None (logged) when one is missing or does not load."""
    missing = [e["hash"] for e in table for size in e["sizes"] if not cache.has(e["hash"], size)]
    if missing:  # checked first, so that a miss loads nothing it then loads again
        logger.info(
            "%s: saved program not used (piece %s is not in the cache); tracing again",
            model_tag,
            missing[0],
        )
        return None
    loaded: dict[str, dict[int | None, Callable[..., Any]]] = {}
    runtimes: dict[str, PiecewiseRuntime] = {}
    for entry in table:
        key = entry["hash"]
        if key not in loaded:
            by_size = {size: cache.load(key, size) for size in entry["sizes"]}
            if any(fn is None for fn in by_size.values()):
                # The entry said why (damaged, quarantined) when it was the cause.
                logger.info(
                    "%s: saved program not used (piece %s is not in the cache); tracing again",
                    model_tag,
                    key,
                )
                return None
            loaded[key] = by_size
        by_size = loaded[key]
        runtimes[entry["name"]] = PiecewiseRuntime(
            index=index_of[entry["name"]],
            general=by_size[None],
            exact={s: fn for s, fn in by_size.items() if s is not None},
            locator=tuple(entry["locator"]) if entry["locator"] else None,
            piece_hash=key,
        )
    return runtimes
