"""Eager adaptor: the piece runs as its FX GraphModule. Fast to build, for tests and debugging."""

from __future__ import annotations

from typing import Any

import torch.fx
from compile_runtime.backends.compiler.base import CompiledPiece, CompilerAdaptor

from compile_runtime.counters import compilation_counter


class EagerAdaptor(CompilerAdaptor):
    name = "eager"

    def compile(
        self, graph: torch.fx.GraphModule, example_inputs: list[Any], runtime_shape: int | None
    ) -> CompiledPiece:
        compilation_counter.num_eager_compiles += 1
        return CompiledPiece(fn=graph, handle=None)
