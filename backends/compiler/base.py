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

    @property
    def can_save(self) -> bool:
        """Whether compiled pieces persist (the compile cache is a no-op otherwise)."""
        return False

    def save(self, piece: CompiledPiece, path: str) -> dict[str, Any] | None:
        """Write ``piece`` to the file ``path``; return what ``load`` needs besides the file,
        or None when this piece cannot be saved (the cache skips it; it compiles next time)."""
        raise NotImplementedError(f"the {self.name} adaptor does not save artifacts")

    def load(self, path: str, meta: dict[str, Any]) -> Callable[..., Any]:
        """The callable saved at ``path`` (``meta`` is what ``save`` returned)."""
        raise NotImplementedError(f"the {self.name} adaptor does not load artifacts")
