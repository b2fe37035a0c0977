"""The graph compiler (our torch.compile backend): passes -> split at attention -> compile
each piece.

One instance per compiled model. Dynamo hands it the whole forward as one FX
graph; it returns the split graph with every static piece replaced by a
``PiecewiseRuntime`` (``piece_store.py`` loads or compiles them), in a CUDA
graph wrapper where piecewise graphs are on. The cache entry is opened here,
keyed by the graph before passes and the files the trace read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from compile_runtime.attention.op import default_splitting_ops
from compile_runtime.backends.compiler import make_adaptor
from compile_runtime.cache.entry import CacheEntry, open_entry
from compile_runtime.cache.key import key_factors, source_digests
from compile_runtime.cache.location import cache_root
from compile_runtime.compiler.capture_safety import warn_at_compile
from compile_runtime.compiler.graph_hash import piece_hash
from compile_runtime.compiler.piece_store import CompileResult, PieceCompiler
from compile_runtime.compiler.piecewise import PiecewiseRuntime
from compile_runtime.compiler.program_draft import DraftBuilder
from compile_runtime.compiler.split import (
    Piece,
    check_splitting_ops,
    direct_splitting_piece,
    placeholder_names,
    split_graph,
)
from compile_runtime.config import CompilationConfig, CompilationMode
from compile_runtime.counters import compilation_counter
from compile_runtime.distributed.parallel_state import pipeline_stage_name, rank, world_size
from compile_runtime.graphs.wrapper import GraphFactory, wrap_piece
from compile_runtime.passes.manager import PassManager
from compile_runtime.torch_internals import detect_fake_mode, traced_code

logger = logging.getLogger(__name__)


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
        # Given by program.py when the trace may be saved as a program: it keeps the draft.
        self.program_builder: DraftBuilder | None = None
        # Record the cache key factors and run eager, compiling nothing (cache explain --model).
        self.key_only = False
        # What piece wrappers capture with; None: CUDA graphs (decorator.set_graph_factory).
        self.graph_factory: GraphFactory | None = None

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
        fake_mode = detect_fake_mode(example_inputs)
        fake_args = [
            fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs
        ]
        if self.key_only:
            self.compute_key_factors(gm, fake_args)
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
        # What would break a CUDA graph, warned at compile when graphs are meant.
        warn_at_compile(
            self.model_tag, self.config, pieces, fake_args, self.graph_factory is not None
        )
        builder = self.program_builder if self.cache is not None else None
        if builder is not None:
            builder.start(gm, split_gm, pieces)
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

        compiler = PieceCompiler(
            split_gm,
            pieces,
            adaptor=self.adaptor,
            cache=self.cache,
            compile_sizes=self.config.compile_sizes,
            dedupe=self.config.dedupe_pieces,
        )
        with fake_mode:
            compiler.run(*fake_args)
        self.install(
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
            self.cache.commit(self.cache_summary(), self._readable_graph(split_gm))
            if builder is not None:
                builder.finish(compiler.runtimes, compiler.records, self.cache, self.traced_files)
            logger.info(
                "compile cache %s: %d pieces loaded, %d compiled (%s)",
                self.cache.key,
                self.cache.num_loaded,
                self.cache.num_compiled,
                self.cache.dir,
            )
        return split_gm

    def install(
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
                    graph_factory=self.graph_factory,
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

    def set_piece_loader(self, load: Callable[[], list[Piece]]) -> None:
        """After a warm start: how to get the pieces' FX graphs when first asked for."""
        self._load_pieces = load

    def _open_cache(self, gm: torch.fx.GraphModule, fake_args: list[Any]) -> CacheEntry | None:
        if self.config.disable_cache or not self.adaptor.can_save:
            return None
        factors = self.compute_key_factors(gm, fake_args)
        return open_entry(
            cache_root(self.config.cache_dir), factors, self.adaptor, self.model_tag, rank()
        )

    def compute_key_factors(self, gm: torch.fx.GraphModule, fake_args: list[Any]) -> dict[str, Any]:
        """The cache key factors of this trace (graph before passes, traced sources, ...)."""
        self.traced_files = sorted({code.co_filename for code in traced_code()})
        self.key_factors = key_factors(
            self.config,
            graph_hash=piece_hash(gm, fake_args),
            sources=source_digests(self.traced_files),
            pass_uuid=self.pass_manager.uuid(),
            device=_graph_device(fake_args),
            world_size=world_size(),
            pipeline_stage=pipeline_stage_name(),
        )
        return self.key_factors

    def cache_summary(self) -> dict[str, Any]:
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


def _graph_device(fake_args: list[Any]) -> torch.device | None:
    for value in fake_args:
        if isinstance(value, torch.Tensor):
            return value.device
    return None
