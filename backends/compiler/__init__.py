"""Compiler adaptors: turn an FX piece into a callable (``base``: the interface;
``inductor``: Inductor's standalone compile; ``eager``: the FX module as is)."""

from __future__ import annotations

from compile_runtime.backends.compiler.base import CompiledPiece, CompilerAdaptor
from compile_runtime.backends.compiler.eager import EagerAdaptor
from compile_runtime.backends.compiler.inductor import InductorAdaptor


def make_adaptor(name: str, inductor_config: dict | None = None) -> CompilerAdaptor:
    if name == "eager":
        return EagerAdaptor()
    if name == "inductor":
        return InductorAdaptor(inductor_config)
    raise ValueError(f"unknown compiler backend {name!r}; use 'inductor' or 'eager'")


__all__ = ["CompiledPiece", "CompilerAdaptor", "EagerAdaptor", "InductorAdaptor", "make_adaptor"]
