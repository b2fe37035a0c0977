"""The saved program's one owner: whether a call may use one, loading it, keeping and saving it.

A compiled forward asks here at its first call (``program_for_call``): the
program key of the call, then ``load`` (a warm start: the pieces come from
their cache entry and go in place with no trace and no compile). On a miss it
traces; the graph compiler then hands the split graph to the ``DraftBuilder``
this module gave it, and once the first call returns ``save`` writes the
program beside the pieces. What a program holds on disk and how it is keyed
is ``saved_program.py``.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from compile_runtime.cache.entry import open_entry
from compile_runtime.cache.location import cache_root
from compile_runtime.compiler import saved_program
from compile_runtime.compiler.graph_compiler import GraphCompiler
from compile_runtime.compiler.piece_store import CompileResult, PieceRecord, load_pieces
from compile_runtime.config import CompilationConfig
from compile_runtime.counters import compilation_counter
from compile_runtime.distributed.parallel_state import pipeline_stage_name, rank, world_size

logger = logging.getLogger(__name__)


class CompiledForward(Protocol):
    """What this module reads of a compiled forward (``compiled_forward.py``)."""

    model: torch.nn.Module
    model_name: str
    config: CompilationConfig
    graph_compiler: GraphCompiler
    signature: inspect.Signature
    dims: Any
    none_pattern: Any


def program_for_call(
    forward: CompiledForward, arguments: dict[str, Any]
) -> tuple[str, dict[str, Any]] | None:
    """(key, factors) of this first call's program, or None where programs do not apply."""
    compiler = forward.graph_compiler
    if forward.config.disable_cache or not compiler.adaptor.can_save or compiler.key_only:
        return None
    device = next((v.device for v in arguments.values() if isinstance(v, torch.Tensor)), None)
    try:
        factors = saved_program.program_factors(
            forward.model,
            forward.config,
            arguments,
            forward.dims,
            pass_uuid=compiler.pass_manager.uuid(),
            device=device,
            world_size=world_size(),
            pipeline_stage=pipeline_stage_name(),
        )
    except saved_program.NotSaveable as e:
        logger.info("%s: no saved program (%s); it traces at every start", forward.model_name, e)
        return None
    return saved_program.program_key(factors), factors


def load(forward: CompiledForward, key: str) -> Callable[..., Any] | None:
    """The saved program of ``key`` installed in the forward's graph compiler, as the
    function a call runs; None (nothing installed) on a miss."""
    program = saved_program.find(
        cache_root(forward.config.cache_dir), key, rank(), forward.model_name
    )
    if program is None or not _install(forward, program):
        return None
    model = forward.model
    self_name = next(iter(inspect.signature(type(model).forward).parameters))
    gather = saved_program.make_gather(program.record["inputs"], self_name, model)
    run_graph = forward.graph_compiler.split_gm.forward  # the saved program's split graph
    signature = forward.signature
    names = list(signature.parameters)
    single = program.record["output"] == "single"

    def run_program(*args: Any, **kwargs: Any) -> Any:
        if not kwargs and len(args) == len(names):
            arguments = dict(zip(names, args, strict=True))
        else:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
        out = run_graph(*gather(arguments))
        return out[0] if single else tuple(out)

    return run_program


def _install(forward: CompiledForward, program: saved_program.SavedProgram) -> bool:
    """Put a saved program's pieces in place from its cache entry: no trace, no compile."""
    start = time.perf_counter()
    compiler, record = forward.graph_compiler, program.record
    cache = open_entry(
        cache_root(forward.config.cache_dir),
        record["entry_factors"],
        compiler.adaptor,
        compiler.model_tag,
        rank(),
    )
    try:
        index_of = {r["name"]: r["index"] for r in record["records"]}
        runtimes = load_pieces(cache, record["pieces"], index_of, compiler.model_tag)
        if runtimes is None:
            return False
        code = program.code
        compiler.install(
            code.split_module(),
            [(r["name"], r["index"], r["is_splitting_op"]) for r in record["records"]],
            runtimes,
            code.splitting_functions(),
            code.arg_names,
        )
        compiler.set_piece_loader(code.pieces)
        compiler.key_factors = record["entry_factors"]
        compiler.result = CompileResult(
            pieces=[PieceRecord(**r) for r in record["records"]],
            unique_pieces=len({r.piece_hash for r in runtimes.values()}),
            compile_sizes=list(forward.config.compile_sizes),
            seconds=time.perf_counter() - start,
        )
        cache.commit(compiler.cache_summary(), code.readable())
    finally:
        cache.release()
    compilation_counter.num_programs_loaded += 1
    logger.info(
        "loaded %s's saved program: %d pieces, %d compiled artifacts, no trace, %.2f s",
        compiler.model_tag,
        len(record["records"]),
        cache.num_loaded,
        compiler.result.seconds,
    )
    return True


def save(forward: CompiledForward, key: str, factors: dict[str, Any], out: Any) -> None:
    """Write the program of the first call beside its pieces (a reason it cannot is logged)."""
    builder = forward.graph_compiler.program_builder
    if builder is None or builder.draft is None:
        return
    try:
        saved_program.save(builder.draft, key, factors, out, forward.none_pattern)
    except saved_program.NotSaveable as e:
        logger.info("%s: no saved program (%s); it traces at every start", forward.model_name, e)
    except OSError as e:
        logger.warning("%s: could not save the traced program (%s)", forward.model_name, e)
