"""The compiler adaptor interface: an FX piece in, a callable out."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx


@dataclass
class CompiledPiece:
    fn: Callable[..., Any]
    handle: Any  # what save() writes; None when there is nothing to persist


class CompilerAdaptor(abc.ABC):
    name: str

    @abc.abstractmethod
    def compile(
        self, graph: torch.fx.GraphModule, example_inputs: list[Any], runtime_shape: int | None
    ) -> CompiledPiece:
        """Compile ``graph``; ``runtime_shape`` None means the symbolic (general) size."""

    def save(self, piece: CompiledPiece, path: str) -> None:  # noqa: B027 - optional
        """Persist ``piece.handle`` to ``path`` (a file)."""

    def load(self, path: str, graph: torch.fx.GraphModule) -> Callable[..., Any]:
        """The callable saved at ``path``; ``graph`` is the piece it was compiled from."""
        raise NotImplementedError(f"{self.name} adaptor cannot load artifacts")
