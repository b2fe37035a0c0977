"""Comparing a compiled output with the eager one: tolerances per dtype, the difference, and
which outputs to skip (left uninitialized by the graph).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from compile_runtime.torch_internals import tree_flatten

# (atol, rtol) per dtype: a piece passes when max|compiled - eager| <= atol + rtol * max|eager|.
# Compiled code reorders reductions and keeps fused intermediates in float32, so a
# piece of many ops differs from eager by a few units in the last place of its
# dtype (the Llama test model, Inductor on CPU: float32 ~1e-7, float16 ~1e-3,
# bfloat16 ~1e-2 relative to max|eager|); a wrong piece is off by O(1).
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-3, 1e-2),
    torch.bfloat16: (1e-2, 3e-2),
}


class VerifyError(ValueError):
    """The model cannot be verified (not compiled piecewise, no split graph, ...)."""


def tolerance_for(dtype: torch.dtype) -> tuple[float, float]:
    return DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])


# ---- comparing outputs --------------------------------------------------------------


@dataclass(frozen=True)
class Diff:
    max_abs: float  # max |actual - expected| over every tensor output
    scale: float  # max |expected|
    note: str = ""  # why the outputs cannot be compared, if they cannot

    @property
    def max_rel(self) -> float:
        return (
            self.max_abs / self.scale if self.scale > 0 else (0.0 if not self.max_abs else math.inf)
        )

    def within(self, atol: float, rtol: float) -> bool:
        return not self.note and self.max_abs <= atol + rtol * self.scale


def compare(actual: Any, expected: Any, skip: frozenset[int] = frozenset()) -> Diff:
    """Elementwise distance of two (nested) outputs; NaN (or inf) where the other has none is inf.

    ``skip``: positions (in flattened order) not to compare, e.g. uninitialized buffers.
    """
    got, want = _leaves(actual), _leaves(expected)
    if len(got) != len(want):
        return Diff(math.inf, 0.0, f"{len(got)} outputs vs {len(want)}")
    max_abs = scale = 0.0
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        if i in skip:
            continue
        if not isinstance(e, torch.Tensor):
            if a != e:
                return Diff(math.inf, scale, f"output {i}: {a!r} != {e!r}")
            continue
        if not isinstance(a, torch.Tensor) or a.shape != e.shape:
            shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
            return Diff(math.inf, scale, f"output {i}: shape {shape} vs {tuple(e.shape)}")
        if a.numel() == 0:
            continue
        a64, e64 = a.detach().to(torch.float64), e.detach().to(torch.float64)
        same = (a64 == e64) | (a64.isnan() & e64.isnan())  # equal infinities included
        diff = torch.where(same, 0.0, (a64 - e64).abs()).nan_to_num(nan=math.inf, posinf=math.inf)
        max_abs = max(max_abs, float(diff.max()))
        finite = e64[e64.isfinite()]
        if finite.numel():
            scale = max(scale, float(finite.abs().max()))
    return Diff(max_abs, scale)


def _leaves(value: Any) -> list[Any]:
    # Compiled code may return a list where the graph returns a tuple: same values.
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    return tree_flatten(value)[0] if isinstance(value, dict) else [value]


_UNINITIALIZED = re.compile(r"(^|[._])(empty|new_empty|empty_like|empty_strided)($|[._])")


def uninitialized_outputs(graph: torch.fx.GraphModule) -> frozenset[int]:
    """Output positions that are fresh ``empty`` buffers (e.g. attention's out-buffer).

    Their values are whatever memory held; a later piece (the splitting op)
    fills them, so comparing them would compare noise.
    """
    (output,) = graph.graph.find_nodes(op="output")
    values = output.args[0]
    values = list(values) if isinstance(values, (tuple, list)) else [values]
    skip = set()
    for i, node in enumerate(values):
        if isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method"):
            name = (
                node.target
                if isinstance(node.target, str)
                else getattr(node.target, "__name__", str(node.target))
            )
            if _UNINITIALIZED.search(str(name)):
                skip.add(i)
    return frozenset(skip)
