"""Counters of what the compiler and the graph wrappers did.

Tests assert on counts (traces, compilations, captures), never on time, so
they hold on any machine.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass
class CompilationCounter:
    num_models_seen: int = 0
    num_graphs_seen: int = 0
    num_piecewise_graphs_seen: int = 0
    num_piecewise_capturable_graphs_seen: int = 0
    num_backend_compilations: int = 0
    num_inductor_compiles: int = 0
    num_eager_compiles: int = 0
    num_cudagraph_captured: int = 0
    num_cache_hits: int = 0
    num_cache_misses: int = 0
    num_compiled_artifacts_saved: int = 0
    num_compiled_artifacts_loaded: int = 0
    num_programs_loaded: int = 0  # warm starts that ran a saved program: no trace, no compile
    num_weight_files_saved: int = 0  # packed-weight files written after a full load
    num_weight_files_mapped: int = 0  # starts whose weights were mapped from such a file

    def clone(self) -> CompilationCounter:
        return copy.deepcopy(self)

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that the block changes each named counter by exactly its delta."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(deltas) - names)
        if unknown:
            raise AttributeError(f"unknown counter(s) {unknown}; known: {sorted(names)}")
        before = self.clone()
        yield
        wrong = {
            name: (getattr(self, name) - getattr(before, name), want)
            for name, want in deltas.items()
            if getattr(self, name) - getattr(before, name) != want
        }
        if wrong:
            lines = ", ".join(
                f"{n}: changed by {got}, expected {want}" for n, (got, want) in wrong.items()
            )
            raise AssertionError(f"compilation_counter mismatch: {lines}")


compilation_counter = CompilationCounter()
