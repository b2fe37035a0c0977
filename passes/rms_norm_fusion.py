"""RMSNorm fusion: plain RMSNorm, and a residual add followed by RMSNorm, as one op each.

The pattern, as it reaches the post-grad graph (``x32`` is ``x`` itself when
``x`` is float32, else ``convert_element_type(x, float32)``)::

    ms     = mean.dim(pow(x32, 2), [-1], keepdim=True)      # or mul(x32, x32)
    normed = mul(x32, rsqrt(add(ms, eps)))                  # eps a constant
    normed = convert_element_type(normed, x.dtype)          # only when x is not float32
    out    = mul(weight, normed)                            # weight 1-D, [hidden]

becomes ``compile_runtime.rms_norm(x, weight, eps)``. When ``x`` is itself
``add(a, b)`` of two same-shape tensors, or ``addmm(residual, m1, m2)`` (a
residual add Inductor folded into the matmul), the add goes into the op as
well: ``fused_add_rms_norm(a, b, weight, eps)`` returns the norm and the sum,
and the sum replaces the add for its other users.

Anything else is left alone: an epsilon that is not a constant or sits
outside the rsqrt, a mean over another dimension or without keepdim, a weight
that is not one value per hidden unit, a norm whose output is not rounded back
to the input dtype (its numerics differ from the op's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from compile_runtime.passes.base import GraphPass
from compile_runtime.passes.matching import (
    CONVERT,
    alpha_is_one,
    aten,
    commuted,
    convert_to,
    dtype_of,
    erase_unused,
    insert_call,
    is_op,
    last_dim,
    latest,
    number,
    same_shape,
    stable_topological_sort,
    sym_equal,
    tensor_val,
)

import compile_runtime.ops.fused as fused_ops


@dataclass
class RMSNormMatch:
    out: torch.fx.Node  # the final mul
    x: torch.fx.Node  # the norm's input, in its own dtype
    weight: torch.fx.Node
    eps: float
    pattern: list[torch.fx.Node]  # every node the op replaces, output last


def match_rms_norm(node: torch.fx.Node) -> RMSNormMatch | None:
    """The RMSNorm whose output is ``node``, or None."""
    if not is_op(node, aten.mul.Tensor):
        return None
    for weight, normed in commuted(node):
        m = _match_normed(normed)
        if m is None:
            continue
        x, eps, inner = m
        w, xv = tensor_val(weight), tensor_val(x)
        if w is None or xv is None or w.dim() != 1 or not sym_equal(w.shape[0], xv.shape[-1]):
            continue
        if not same_shape(node, x):
            continue
        return RMSNormMatch(node, x, weight, eps, [*inner, node])
    return None


def _match_normed(normed) -> tuple[torch.fx.Node, float, list[torch.fx.Node]] | None:
    """``(x, eps, nodes)`` if ``normed`` is x normalised by its RMS and rounded to x's dtype."""
    if is_op(normed, CONVERT):
        scaled, pattern = normed.args[0], [normed.args[0], normed]
    else:
        scaled, pattern = normed, [normed]
    if not is_op(scaled, aten.mul.Tensor) or dtype_of(scaled) != torch.float32:
        return None
    for x32, inv in commuted(scaled):
        if not is_op(inv, aten.rsqrt.default):
            continue
        add = inv.args[0]
        if not is_op(add, aten.add.Tensor) or not alpha_is_one(add):
            continue
        eps, mean = number(add.args[1]), add.args[0]
        if eps is None or not is_op(mean, aten.mean.dim) or not _is_mean_of_squares(mean, x32):
            continue
        x = convert_to(x32, torch.float32)
        upcast = [x32] if x is not None else []
        x = x if x is not None else x32
        if dtype_of(normed) != dtype_of(x):
            return None  # not rounded back to the input dtype: other numerics than the op's
        return x, eps, [*upcast, mean.args[0], mean, add, inv, *pattern]
    return None


def _is_mean_of_squares(mean: torch.fx.Node, x32) -> bool:
    xv = tensor_val(x32)
    if xv is None or xv.dtype != torch.float32:
        return False
    args = list(mean.args) + [None] * (3 - len(mean.args))
    dims, keepdim = args[1], mean.kwargs.get("keepdim", args[2])
    if keepdim is not True or mean.kwargs.get("dtype") is not None:
        return False
    if not last_dim(dims, xv.dim()):
        return False
    square = mean.args[0]
    if is_op(square, aten.pow.Tensor_Scalar):
        return square.args[0] is x32 and number(square.args[1]) == 2.0
    if is_op(square, aten.mul.Tensor):
        return square.args[0] is x32 and square.args[1] is x32
    return False


def _residual_add(x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(a, b)`` if ``x`` is an elementwise ``a + b`` of two tensors shaped like x."""
    if not is_op(x, aten.add.Tensor) or not alpha_is_one(x):
        return None
    a, b = x.args[0], x.args[1]
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return None
    if not (same_shape(a, x) and same_shape(b, x)):
        return None
    if not (dtype_of(a) == dtype_of(b) == dtype_of(x)):
        return None
    return a, b


def _residual_addmm(x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """``(residual, m1, m2)`` if ``x`` is ``addmm(residual, m1, m2)`` with a full residual."""
    if not is_op(x, aten.addmm.default) or len(x.args) != 3:
        return None
    if x.kwargs.get("beta", 1) != 1 or x.kwargs.get("alpha", 1) != 1:
        return None
    residual = x.args[0]
    if not isinstance(residual, torch.fx.Node) or not same_shape(residual, x):
        return None
    if dtype_of(residual) != dtype_of(x):
        return None
    return residual, x.args[1], x.args[2]


class RMSNormFusionPass(GraphPass):
    name = "rms_norm_fusion"
    depends_on = (fused_ops,)

    def __init__(self, token_range=None, fuse_residual_add: bool = True):
        super().__init__(token_range)
        self.fuse_residual_add = fuse_residual_add
        self.last_counts: dict[str, int] = {}

    def options(self):
        return {**super().options(), "fuse_residual_add": self.fuse_residual_add}

    def run(self, graph: torch.fx.Graph) -> int:
        counts = {"rms_norm": 0, "fused_add_rms_norm": 0}
        for node in list(graph.nodes):
            if node.graph is not graph:
                continue
            m = match_rms_norm(node)
            if m is None:
                continue
            kind = self._replace(graph, m)
            counts[kind] += 1
        if any(counts.values()):
            stable_topological_sort(graph)
        self.last_counts = counts
        return sum(counts.values())

    def _replace(self, graph: torch.fx.Graph, m: RMSNormMatch) -> str:
        x = m.x
        add = _residual_add(x) if self.fuse_residual_add else None
        addmm = _residual_addmm(x) if self.fuse_residual_add and add is None else None
        if add is not None or addmm is not None:
            if addmm is not None:
                residual, m1, m2 = addmm
                mm, _ = insert_call(graph, aten.mm.default, (m1, m2), after=latest(graph, [m1, m2]))
                a, b = mm, residual
            else:
                a, b = add
            inputs = (a, b, m.weight, m.eps)
            fused, (out, summed) = insert_call(
                graph,
                torch.ops.compile_runtime.fused_add_rms_norm.default,
                inputs,
                after=latest(graph, inputs),
                num_outputs=2,
            )
            m.out.replace_all_uses_with(out)
            x.replace_all_uses_with(summed)
            erase_unused(graph, [*reversed(m.pattern), x])
            return "fused_add_rms_norm"
        inputs = (x, m.weight, m.eps)
        op, _ = insert_call(
            graph, torch.ops.compile_runtime.rms_norm.default, inputs, after=latest(graph, inputs)
        )
        m.out.replace_all_uses_with(op)
        erase_unused(graph, list(reversed(m.pattern)))
        return "rms_norm"
