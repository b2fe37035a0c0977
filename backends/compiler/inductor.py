"""Inductor adaptor on Inductor's ``standalone_compile`` (``torch_internals.py``).

The general piece is compiled with the symbolic sizes of the Dynamo trace
(``from_tracing_context``); an exact size with example inputs of that size.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.fx
from compile_runtime.backends.compiler.base import CompiledPiece, CompilerAdaptor

from compile_runtime.counters import compilation_counter
from compile_runtime.torch_internals import (
    artifact_is_saveable,
    standalone_compile,
    standalone_load,
    standalone_save,
    trust_cpu_isa_flags,
)

logger = logging.getLogger(__name__)


def returns_tuple(graph: torch.fx.GraphModule) -> bool:
    (output,) = [n for n in graph.graph.nodes if n.op == "output"]
    return isinstance(output.args[0], (tuple, list))


def as_tuple_graph(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``graph`` whose single output is wrapped in a tuple (Inductor needs one)."""
    graph = copy.deepcopy(graph)
    (output,) = [n for n in graph.graph.nodes if n.op == "output"]
    output.args = ((output.args[0],),)
    graph.recompile()
    return graph


class _Unwrap:
    """Calls a compiled tuple-returning graph and returns its only element."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)[0]


class InductorAdaptor(CompilerAdaptor):
    name = "inductor"

    def __init__(self, config_patches: dict[str, Any] | None = None, pass_manager=None):
        # Kernels read the thread count when they run, so one compile serves every count
        # (the cache key leaves it out: compile_runtime/cache/key.py::thread_count_baked_in).
        self.config_patches = {"cpp.dynamic_threads": True, **(config_patches or {})}
        # A compile_runtime.passes.PassManager: its post-grad passes run on every piece.
        self.pass_manager = pass_manager
        self._warned_unsaveable = False

    def inductor_config(self, runtime_shape: int | None) -> dict[str, Any]:
        """The config patches for one compile, with the pass manager's post-grad pass."""
        patches = dict(self.config_patches)
        if self.pass_manager is not None:
            from compile_runtime.passes.post_grad import PostGradPass

            ours = PostGradPass(self.pass_manager, runtime_shape)
            theirs = patches.get("post_grad_custom_post_pass")
            if theirs is None:
                patches["post_grad_custom_post_pass"] = ours
            else:  # the user's own pass(es) run after ours
                theirs = list(theirs) if isinstance(theirs, (list, tuple)) else [theirs]
                patches["post_grad_custom_post_pass"] = [ours, *theirs]
        return patches

    def compile(
        self, graph: torch.fx.GraphModule, example_inputs: list[Any], runtime_shape: int | None
    ) -> CompiledPiece:
        single = not returns_tuple(graph)
        if single:
            graph = as_tuple_graph(graph)
        dynamic = "from_tracing_context" if runtime_shape is None else "from_example_inputs"
        artifact = standalone_compile(
            graph, example_inputs, dynamic, self.inductor_config(runtime_shape)
        )
        compilation_counter.num_inductor_compiles += 1
        fn = _Unwrap(artifact) if single else artifact
        return CompiledPiece(fn=fn, handle=(artifact, single))

    @property
    def can_save(self) -> bool:
        return True

    def save(self, piece: CompiledPiece, path: str) -> dict[str, Any] | None:
        """None when Inductor kept nothing to save (its caches are off): warns once."""
        artifact, single = piece.handle
        if not artifact_is_saveable(artifact):
            if not self._warned_unsaveable:
                self._warned_unsaveable = True
                cause = (
                    "inductor_compile_config sets fx_graph_cache=False, so Inductor keeps no "
                    "artifact to save"
                    if self.config_patches.get("fx_graph_cache") is False
                    else "Inductor kept no artifact to save for a piece (are its caches off, "
                    "e.g. TORCHINDUCTOR_FORCE_DISABLE_CACHES=1?)"
                )
                logger.warning(
                    "%s: compiled pieces are not put in the compile cache and compile again at "
                    "the next start. Leave Inductor's caches on to cache them, or set "
                    "disable_cache=true to silence this.",
                    cause,
                )
            return None
        standalone_save(artifact, path)
        return {"single_output": single}

    def load(self, path: str, meta: dict[str, Any]):
        with trust_cpu_isa_flags():
            artifact = standalone_load(path)
        return _Unwrap(artifact) if meta.get("single_output") else artifact
