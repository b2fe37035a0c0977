"""SiLU-and-multiply fusion (the SwiGLU gate) as one op.

``silu(gate) * up``, where gate and up are the two halves of one tensor ``t``
(``split_with_sizes(t, [d, d], -1)``, ``chunk(t, 2, -1)`` or two slices of the
last dimension),
becomes ``compile_runtime.silu_and_mul(t)``. The silu may reach the post-grad
graph as ``aten.silu``, as ``x * sigmoid(x)`` or decomposed as
``x / (1 + exp(-x))``; for a low-precision gate it is computed in float32 and
rounded back to the gate's dtype before the multiply, as ``F.silu`` does.

Left alone: silu applied to the second half (the op gates with the first),
halves of different tensors or of unequal size, a product whose other factor
is not the matching half, an activation result kept in float32.
"""

from __future__ import annotations

import operator
import sys

import torch
import torch.fx
from compile_runtime.passes.base import GraphPass
from compile_runtime.passes.matching import (
    CONVERT,
    aten,
    commuted,
    convert_to,
    dtype_of,
    erase_unused,
    insert_call,
    is_op,
    last_dim,
    number,
    stable_topological_sort,
    sym_equal,
    tensor_val,
)

import compile_runtime.ops.fused as fused_ops


def _silu_input(node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """``(g, nodes)`` if ``node`` is ``silu(g)`` computed the way F.silu computes it."""
    if is_op(node, CONVERT):
        act, pattern = node.args[0], [node.args[0], node]
    else:
        act, pattern = node, [node]
    g32 = None
    if is_op(act, aten.silu.default):
        g32 = act.args[0]
    elif is_op(act, aten.mul.Tensor):
        for a, b in commuted(act):
            if is_op(b, aten.sigmoid.default) and b.args[0] is a:
                g32, pattern = a, [b, *pattern]
                break
    elif is_op(act, aten.div.Tensor):
        num, den = act.args[0], act.args[1]
        if is_op(den, aten.add.Tensor) and len(den.args) == 2 and not den.kwargs:
            for e, one in commuted(den):
                if number(one) == 1.0 and is_op(e, aten.exp.default):
                    neg = e.args[0]
                    if is_op(neg, aten.neg.default) and neg.args[0] is num:
                        g32, pattern = num, [neg, e, den, *pattern]
                    break
    if not isinstance(g32, torch.fx.Node):
        return None
    g = convert_to(g32, torch.float32)
    if g is not None:
        pattern = [g32, *pattern]
    else:
        g = g32
    if dtype_of(node) != dtype_of(g):
        return None  # activation not rounded back to the gate's dtype: other numerics
    return g, pattern


def _is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _halves(gate, up) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """``(t, nodes)`` if gate is the first and up the second half of t's last dimension."""
    if _is_getitem(gate) and _is_getitem(up):
        split = gate.args[0]
        if not (up.args[0] is split and gate.args[1] == 0 and up.args[1] == 1):
            return None
        if not is_op(split, aten.split_with_sizes.default, aten.split.Tensor):
            return None
        t, sizes = split.args[0], split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        tv = tensor_val(t)
        if tv is None or not last_dim(dim, tv.dim()):
            return None
        if is_op(split, aten.split.Tensor):  # chunk(2): one split size for every part
            sizes = [sizes, sizes] if not isinstance(sizes, (list, tuple)) else sizes
        if len(sizes) == 2 and sym_equal(sizes[0], sizes[1]):
            if sym_equal(2 * sizes[0], tv.shape[-1]):
                return t, [gate, up, split]
        return None
    if is_op(gate, aten.slice.Tensor) and is_op(up, aten.slice.Tensor):
        t = gate.args[0]
        tv = tensor_val(t)
        if tv is None or up.args[0] is not t:
            return None
        g = list(gate.args) + [None] * (5 - len(gate.args))
        u = list(up.args) + [None] * (5 - len(up.args))
        if not (last_dim(g[1], tv.dim()) and last_dim(u[1], tv.dim())):
            return None
        if (g[4] or 1) != 1 or (u[4] or 1) != 1:
            return None
        d = g[3]
        if g[2] not in (0, None) or d is None or not sym_equal(2 * d, tv.shape[-1]):
            return None
        end_ok = u[3] is None or (isinstance(u[3], int) and u[3] >= sys.maxsize)
        if not sym_equal(u[2], d) or not (end_ok or sym_equal(u[3], tv.shape[-1])):
            return None
        return t, [gate, up]
    return None


class SiluMulFusionPass(GraphPass):
    name = "silu_mul_fusion"
    depends_on = (fused_ops,)

    def run(self, graph: torch.fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if node.graph is not graph or not is_op(node, aten.mul.Tensor):
                continue
            for act, up in commuted(node):
                s = _silu_input(act)
                if s is None or not isinstance(up, torch.fx.Node):
                    continue
                gate, pattern = s
                h = _halves(gate, up)
                if h is None or dtype_of(up) != dtype_of(gate):
                    continue
                t, halves = h
                op, _ = insert_call(
                    graph, torch.ops.compile_runtime.silu_and_mul.default, (t,), after=t
                )
                node.replace_all_uses_with(op)
                erase_unused(graph, [node, *reversed(pattern), *halves])
                count += 1
                break
        if count:
            stable_topological_sort(graph)
        self.last_counts = {"silu_and_mul": count}
        return count
