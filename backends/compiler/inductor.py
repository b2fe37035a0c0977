"""Inductor adaptor on ``torch._inductor.standalone_compile``.

The general piece is compiled with the symbolic sizes of the Dynamo trace
(``from_tracing_context``); an exact size with example inputs of that size.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.fx
from compile_runtime.backends.compiler.base import CompiledPiece, CompilerAdaptor

from compile_runtime.counters import compilation_counter

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
        from torch._inductor import standalone_compile

        single = not returns_tuple(graph)
        if single:
            graph = as_tuple_graph(graph)
        dynamic = "from_tracing_context" if runtime_shape is None else "from_example_inputs"
        artifact = standalone_compile(
            graph,
            example_inputs,
            dynamic_shapes=dynamic,
            options={"config_patches": self.inductor_config(runtime_shape)},
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
        if not getattr(artifact, "is_saveable", lambda: True)():
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
        artifact.save(path=path, format="binary")
        return {"single_output": single}

    def load(self, path: str, meta: dict[str, Any]):
        with trust_cpu_isa_flags():
            artifact = torch._inductor.CompiledArtifact.load(path=path, format="binary")
        return _Unwrap(artifact) if meta.get("single_output") else artifact


@contextlib.contextmanager
def trust_cpu_isa_flags() -> Iterator[None]:
    """Skip Inductor's CPU-ISA probe while loading saved kernels.

    Loading a CPU artifact asks which vector ISA to use only to find its kernel's
    file; the probe behind the answer builds and dlopens a test program per ISA in
    child processes (a large part of a warm start). The kernels are built
    already, for this CPU capability (part of the cache key), so the CPU's own
    flags answer. A compile later in the process probes as usual: the list
    computed here is dropped.
    """
    from torch._inductor import config, cpu_vec_isa

    if config.cpp.vec_isa_ok is not None:  # the user decided
        yield
        return
    probed = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize > 0
    # AVX-512's bf16 and VNNI checks build and dlopen a program each even then, after the
    # CPU's flag said yes (~70 ms each): the flag answers.
    trusted = mock.patch.object(cpu_vec_isa.VecISA, "check_build", lambda self, code: True)
    try:
        with config.patch({"cpp.vec_isa_ok": True}), trusted:
            yield
    finally:
        if not probed:
            cpu_vec_isa.valid_vec_isa_list.cache_clear()
