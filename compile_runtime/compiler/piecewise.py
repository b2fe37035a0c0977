"""Per-piece runtime: pick the exact-size callable for this token count, else the general one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Where a piece's token count is found among its inputs: (argument index,
# tensor dim), or (argument index, None) when the argument is the count itself.
SizeLocator = tuple[int, int | None]


def find_size_locator(example_inputs: list[Any]) -> SizeLocator | None:
    """The first input position that carries a bare symbolic size (the token count)."""
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.SymInt) and value.node.expr.is_Symbol:
            return (i, None)
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    return (i, d)
    return None


def runtime_size(args: tuple[Any, ...], locator: SizeLocator) -> int:
    i, dim = locator
    return int(args[i]) if dim is None else args[i].shape[dim]


class PiecewiseRuntime:
    """One compiled piece: dispatches on the runtime token count."""

    def __init__(
        self,
        index: int,
        general: Callable[..., Any],
        exact: dict[int, Callable[..., Any]],
        locator: SizeLocator | None,
        piece_hash: str,
    ):
        if exact and locator is None:
            raise ValueError(f"piece {index} has exact-size callables but no symbolic size input")
        self.index = index
        self.general = general
        self.exact = exact
        self.locator = locator
        self.piece_hash = piece_hash

    def callable_for(self, num_tokens: int) -> Callable[..., Any]:
        return self.exact.get(num_tokens, self.general)

    def __call__(self, *args: Any) -> Any:
        if self.exact:
            return self.exact.get(runtime_size(args, self.locator), self.general)(*args)
        return self.general(*args)

    def __repr__(self) -> str:
        return f"PiecewiseRuntime(index={self.index}, hash={self.piece_hash}, exact_sizes={sorted(self.exact)})"
