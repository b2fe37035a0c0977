"""The graph compiler (our torch.compile backend): passes -> split at attention -> compile
each piece.

One instance per compiled model. Dynamo hands it the whole forward as one FX
graph; it returns the split graph with every static piece replaced by a
``PiecewiseRuntime``. Structurally identical pieces (every transformer layer)
are compiled once and share the result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from compile_runtime.attention.op import default_splitting_ops
from compile_runtime.backends.compiler import make_adaptor
from compile_runtime.cache.entry import CacheEntry, open_entry
from compile_runtime.cache.key import key_factors, source_digests
from compile_runtime.cache.location import cache_root
from compile_runtime.compiler import saved_program
from compile_runtime.compiler.graph_hash import piece_hash
from compile_runtime.compiler.piecewise import PiecewiseRuntime, find_size_locator
from compile_runtime.compiler.split import (
    Piece,
    check_splitting_ops,
    direct_splitting_piece,
    placeholder_names,
    split_graph,
)
from compile_runtime.config import CompilationConfig, CompilationMode
from compile_runtime.counters import compilation_counter
from compile_runtime.cudagraph.wrapper import wrap_piece
from compile_runtime.passes.manager import PassManager

logger = logging.getLogger(__name__)


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


_key_only: list[bool] = []


@contextlib.contextmanager
def key_only_tracing() -> Iterator[list[dict[str, Any]]]:
    """Backends called inside record their cache key factors and run eager, compiling nothing.

    ``compile-runtime cache explain --model`` uses it to tell whether a model
    would hit without paying for a compile. Yields the list of factors seen.
    """
    seen: list[dict[str, Any]] = []
    _key_only.append(True)
    _key_only_seen.append(seen)
    try:
        yield seen
    finally:
        _key_only.pop()
        _key_only_seen.pop()


_key_only_seen: list[list[dict[str, Any]]] = []


def is_key_only_tracing() -> bool:
    return bool(_key_only)


class GraphCompiler:
    """The callable handed to ``torch.compile(backend=...)``: passes, split, compile each piece."""

    def __init__(self, config: CompilationConfig, model_tag: str = "model"):
        self.config = config
        self.model_tag = model_tag
        self.adaptor = make_adaptor(config.backend, config.inductor_compile_config)
        self.pass_manager = PassManager(config.pass_config, debug_dump_path=config.debug_dump_path)
        self.adaptor.pass_manager = self.pass_manager  # post-grad passes (Inductor only)
        self.split_gm: torch.fx.GraphModule | None = None
        self.result = CompileResult()
        self.runtimes: list[PiecewiseRuntime] = []
        self._pieces: list[Piece] = []  # every piece with its FX graph before compilation
        self._load_pieces: Callable[[], list[Piece]] | None = None
        self.cache: CacheEntry | None = None
        self.key_factors: dict[str, Any] | None = None
        self.traced_files: list[str] = []
        # Set by the compiled forward when the trace may be saved as a program; the draft
        # is what the cold start keeps of it (saved_program.py).
        self.want_program = False
        self.program_draft: saved_program.ProgramDraft | None = None

    @property
    def splitting_ops(self) -> list[str]:
        if self.config.mode != CompilationMode.PIECEWISE:
            return []
        if self.config.splitting_ops is None:
            return default_splitting_ops()
        return list(self.config.splitting_ops)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compilation_counter.num_graphs_seen += 1
        start = time.perf_counter()
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        fake_args = [
            fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs
        ]
        if _key_only:
            _key_only_seen[-1].append(self.compute_key_factors(gm, fake_args))
            return gm.forward
        self.cache = self._open_cache(gm, fake_args)
        try:
            return self._split_and_compile(gm, fake_mode, fake_args, start)
        finally:
            if self.cache is not None:
                self.cache.release()

    def _split_and_compile(
        self, gm: torch.fx.GraphModule, fake_mode: Any, fake_args: list[Any], start: float
    ) -> torch.fx.GraphModule:
        gm = self.pass_manager(gm)
        check_splitting_ops(self.splitting_ops)
        split_gm, pieces = split_graph(gm, self.splitting_ops)
        draft = self._start_draft(gm, split_gm, pieces)
        num_splitting = sum(p.is_splitting_op for p in pieces)
        if self.splitting_ops and not num_splitting:
            logger.log(
                logging.WARNING if self.config.splitting_ops is not None else logging.INFO,
                "%s: splitting_ops %s match no op in the graph, so it is one piece with any "
                "attention inside and gets no piecewise CUDA graphs (the model runner resolves "
                "cudagraph_mode without them; elsewhere pass attention_split="
                "compile_runtime.compiler.decorator.attention_split(model) to CompilationConfig.resolve)",
                self.model_tag,
                self.splitting_ops,
            )
        compilation_counter.num_piecewise_graphs_seen += len(pieces)
        compilation_counter.num_piecewise_capturable_graphs_seen += sum(
            not p.is_splitting_op for p in pieces
        )

        compiler = _PieceCompiler(split_gm, pieces, self)
        with fake_mode:
            compiler.run(*fake_args)
        self._install(
            split_gm,
            [(p.name, p.index, p.is_splitting_op) for p in pieces],
            compiler.runtimes,
            {p.name: direct_splitting_piece(p.graph) for p in pieces if p.is_splitting_op},
            {p.name: placeholder_names(p.graph) for p in pieces if not p.is_splitting_op},
        )
        self.pieces = pieces
        self.result = CompileResult(
            pieces=compiler.records,
            unique_pieces=len(compiler.compiled),
            compile_sizes=list(self.config.compile_sizes),
            seconds=time.perf_counter() - start,
        )
        logger.info(
            "compiled %s: %d pieces (%d splitting ops), %d unique, sizes [general%s], %.2f s",
            self.model_tag,
            len(pieces),
            num_splitting,
            self.result.unique_pieces,
            "".join(f", {s}" for s in self.config.compile_sizes),
            self.result.seconds,
        )
        if self.config.debug_dump_path:
            os.makedirs(self.config.debug_dump_path, exist_ok=True)
            with open(os.path.join(self.config.debug_dump_path, "computation_graph.py"), "w") as f:
                f.write(self._readable_graph(split_gm))
        if self.cache is not None:
            self.cache.commit(self._cache_summary(), self._readable_graph(split_gm))
            if draft is not None:
                self.program_draft = self._finish_draft(draft, compiler.runtimes, compiler.records)
            logger.info(
                "compile cache %s: %d pieces loaded, %d compiled (%s)",
                self.cache.key,
                self.cache.num_loaded,
                self.cache.num_compiled,
                self.cache.dir,
            )
        return split_gm

    def _install(
        self,
        split_module: Any,
        pieces: list[tuple[str, int, bool]],
        runtimes: dict[str, PiecewiseRuntime],
        splitting: dict[str, Callable[..., Any]],
        arg_names: dict[str, list[str]],
    ) -> None:
        """Put every piece's callable in place in the split graph (cold and warm start alike).

        ``pieces``: (name, index, is splitting op) in order; ``splitting``: the callable
        of each splitting piece; ``arg_names``: each static piece's input names.
        """
        num_splitting = sum(is_splitting for _, _, is_splitting in pieces)
        capturable = [(name, index) for name, index, is_splitting in pieces if not is_splitting]
        for name, fn in splitting.items():
            # An instance attribute wins over the submodule, which stays for printing.
            split_module.__dict__[name] = fn
        for i, (name, index) in enumerate(capturable):
            runtime = runtimes[name]
            if isinstance(split_module, torch.fx.GraphModule):
                # A compiled artifact is not an nn.Module: put it in place through __dict__.
                split_module._modules.pop(name)
            # Unsplit, the one piece may hold attention: never a piecewise graph of it.
            split_module.__dict__[name] = (
                wrap_piece(
                    runtime,
                    self.config,
                    arg_names=arg_names[name],
                    index=index,
                    is_first=i == 0,
                    is_last=i == len(capturable) - 1,
                )
                if num_splitting
                else runtime
            )
            self.runtimes.append(runtime)
        self.split_gm = split_module

    @property
    def pieces(self) -> list[Piece]:
        """Every piece with its FX graph (after a warm start, unpickled when first asked for)."""
        if self._load_pieces is not None:
            self._pieces, self._load_pieces = self._load_pieces(), None
        return self._pieces

    @pieces.setter
    def pieces(self, pieces: list[Piece]) -> None:
        self._pieces, self._load_pieces = pieces, None

    # ---- the saved program (compiler/saved_program.py) -------------------------------------

    def _start_draft(
        self, gm: torch.fx.GraphModule, split_gm: torch.fx.GraphModule, pieces: list[Piece]
    ) -> tuple[saved_program.ProgramCode, list[str], int] | None:
        """The program's code (taken before the pieces are replaced), the inputs' sources and
        the number of outputs; None when no program is wanted or it cannot be saved."""
        if not self.want_program or self.cache is None:
            return None
        try:
            inputs = saved_program.draft_inputs(gm)
            (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
            num_outputs = len(outputs) if isinstance(outputs, (tuple, list)) else 1
            return saved_program.program_code(split_gm, pieces), inputs, num_outputs
        except Exception as e:  # noqa: BLE001 - any reason only means: trace at every start
            logger.info("%s: the trace is not saved as a program (%s)", self.model_tag, e)
            return None

    def _finish_draft(
        self,
        draft: tuple[saved_program.ProgramCode, list[str], int],
        runtimes: dict[str, PiecewiseRuntime],
        records: list[PieceRecord],
    ) -> saved_program.ProgramDraft:
        code, inputs, num_outputs = draft
        table = [
            {
                "name": name,
                "hash": runtime.piece_hash,
                "locator": list(runtime.locator) if runtime.locator else None,
                "sizes": [None, *sorted(runtime.exact)],
            }
            for name, runtime in runtimes.items()
        ]
        return saved_program.ProgramDraft(
            code=code,
            inputs=inputs,
            num_outputs=num_outputs,
            pieces=table,
            records=[dataclasses.asdict(r) for r in records],
            entry_dir=self.cache.dir,
            entry_factors=self.cache.factors,
            sources={
                path: digest
                for path in self.traced_files
                for digest in source_digests([path]).values()
            },
        )

    def load_program(self, program: saved_program.SavedProgram) -> bool:
        """Install a saved program's pieces from its cache entry: no trace, no compile.

        False (and nothing installed) when an artifact is missing or does not load.
        """
        start = time.perf_counter()
        record = program.record
        rank = torch.distributed.get_rank() if _distributed() else 0
        cache = open_entry(
            cache_root(self.config.cache_dir),
            record["entry_factors"],
            self.adaptor,
            self.model_tag,
            rank,
        )
        try:
            missing = [
                e["hash"]
                for e in record["pieces"]
                for size in e["sizes"]
                if not cache.has(e["hash"], size)
            ]
            if missing:  # checked first, so that a miss loads nothing it then loads again
                logger.info(
                    "%s: saved program not used (piece %s is not in the cache); tracing again",
                    self.model_tag,
                    missing[0],
                )
                return False
            runtimes: dict[str, PiecewiseRuntime] = {}
            loaded: dict[str, dict[int | None, Callable[..., Any]]] = {}
            index_of = {r["name"]: r["index"] for r in record["records"]}
            for entry in record["pieces"]:
                key = entry["hash"]
                if key not in loaded:
                    by_size = {size: cache.load(key, size) for size in entry["sizes"]}
                    if any(fn is None for fn in by_size.values()):
                        # The entry said why (damaged, quarantined) when it was the cause.
                        logger.info(
                            "%s: saved program not used (piece %s is not in the cache); "
                            "tracing again",
                            self.model_tag,
                            key,
                        )
                        return False
                    loaded[key] = by_size
                by_size = loaded[key]
                runtimes[entry["name"]] = PiecewiseRuntime(
                    index=index_of[entry["name"]],
                    general=by_size[None],
                    exact={s: fn for s, fn in by_size.items() if s is not None},
                    locator=tuple(entry["locator"]) if entry["locator"] else None,
                    piece_hash=key,
                )
            code = program.code
            self._install(
                code.split_module(),
                [(r["name"], r["index"], r["is_splitting_op"]) for r in record["records"]],
                runtimes,
                code.splitting_functions(),
                code.arg_names,
            )
            self._load_pieces = code.pieces
            self.key_factors = record["entry_factors"]
            self.result = CompileResult(
                pieces=[PieceRecord(**r) for r in record["records"]],
                unique_pieces=len(loaded),
                compile_sizes=list(self.config.compile_sizes),
                seconds=time.perf_counter() - start,
            )
            cache.commit(self._cache_summary(), code.readable())
        finally:
            cache.release()
        compilation_counter.num_programs_loaded += 1
        logger.info(
            "loaded %s's saved program: %d pieces, %d compiled artifacts, no trace, %.2f s",
            self.model_tag,
            len(record["records"]),
            cache.num_loaded,
            self.result.seconds,
        )
        return True

    def _open_cache(self, gm: torch.fx.GraphModule, fake_args: list[Any]) -> CacheEntry | None:
        if self.config.disable_cache or not self.adaptor.can_save:
            return None
        factors = self.compute_key_factors(gm, fake_args)
        rank = torch.distributed.get_rank() if _distributed() else 0
        return open_entry(
            cache_root(self.config.cache_dir), factors, self.adaptor, self.model_tag, rank
        )

    def compute_key_factors(self, gm: torch.fx.GraphModule, fake_args: list[Any]) -> dict[str, Any]:
        """The cache key factors of this trace (graph before passes, traced sources, ...)."""
        context = torch._guards.TracingContext.try_get()
        traced = getattr(context, "traced_code", None) or []
        self.traced_files = sorted({code.co_filename for code in traced})
        world_size = torch.distributed.get_world_size() if _distributed() else 1
        self.key_factors = key_factors(
            self.config,
            graph_hash=piece_hash(gm, fake_args),
            sources=source_digests(self.traced_files),
            pass_uuid=self.pass_manager.uuid(),
            device=_graph_device(fake_args),
            world_size=world_size,
        )
        return self.key_factors

    def _cache_summary(self) -> dict[str, Any]:
        groups: dict[str, list[int]] = {}
        for r in self.result.pieces:
            if not r.is_splitting_op:
                groups.setdefault(r.piece_hash, []).append(r.index)
        return {
            "seconds": round(self.result.seconds, 3),
            "num_pieces": len(self.result.pieces),
            "shapes": ["general"] + [str(s) for s in self.config.compile_sizes],
            "pieces": [{"hash": h, "pieces": idx} for h, idx in groups.items()],
        }

    def _readable_graph(self, split_gm: torch.fx.GraphModule) -> str:
        header = [f"# Split graph of {self.model_tag}; pieces and the compiled code they share:"]
        for r in self.result.pieces:
            kind = "splitting op" if r.is_splitting_op else f"hash {r.piece_hash}"
            shared = f", reuses piece {r.shared_with}" if r.shared_with is not None else ""
            header.append(f"#   {r.name}: {kind}{shared}")
        return "\n".join(header) + "\n\n" + split_gm.print_readable(print_output=False)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _graph_device(fake_args: list[Any]) -> torch.device | None:
    for value in fake_args:
        if isinstance(value, torch.Tensor):
            return value.device
    return None


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split graph on fake inputs, compiling each static piece on the way."""

    def __init__(
        self, split_gm: torch.fx.GraphModule, pieces: list[Piece], compiler: GraphCompiler
    ):
        super().__init__(split_gm)
        self.pieces = {p.name: p for p in pieces}
        self.compiler = compiler
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
        if not self.compiler.config.dedupe_pieces:
            key = f"{key}:{piece.index}"
        if key in self.compiled:
            record.shared_with, by_size = self.compiled[key]
        else:
            start = time.perf_counter()
            by_size = self._compile(piece, args_list, record.piece_hash)
            record.compile_seconds = time.perf_counter() - start
            self.compiled[key] = (piece.index, by_size)
            logger.info(
                "compiled piece %d (%s, hash %s) for %d size(s) in %.2f s",
                piece.index,
                self.compiler.adaptor.name,
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

    def _compile(
        self, piece: Piece, fake_args: list[Any], key: str
    ) -> dict[int | None, Callable[..., Any]]:
        """The piece's callables: the general one and one per compile size."""
        sizes: list[int | None] = [None]
        if find_size_locator(fake_args) is not None:
            sizes += self.compiler.config.compile_sizes
        elif self.compiler.config.compile_sizes:
            logger.info("piece %d has no symbolic size: compile_sizes do not apply", piece.index)
        return {size: self._compile_size(piece, fake_args, key, size) for size in sizes}

    def _compile_size(
        self, piece: Piece, fake_args: list[Any], key: str, size: int | None
    ) -> Callable[..., Any]:
        cache = self.compiler.cache
        if cache is not None:
            loaded = cache.load(key, size)
            if loaded is not None:
                return loaded
        start = time.perf_counter()
        if size is None:
            compiled = self.compiler.adaptor.compile(piece.graph, fake_args, None)
        else:
            with unset_fake_temporarily():
                inputs = concrete_inputs(fake_args, size)
                compiled = self.compiler.adaptor.compile(piece.graph, inputs, size)
        compilation_counter.num_backend_compilations += 1
        if cache is not None:
            with unset_fake_temporarily():
                cache.store(key, size, compiled, time.perf_counter() - start)
        return compiled.fn
