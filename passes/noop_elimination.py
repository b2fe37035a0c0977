"""No-op elimination: views, reshapes, slices and casts that change nothing, and chains of them.

Three rewrites, on ATen graphs (post-grad) and on the Dynamo graph (pre-split):

* an op from the view/cast list whose output has exactly its input's shape,
  strides, offset, dtype and device is replaced by its input;
* a reshape of a reshape (``view``/``reshape``/``_unsafe_view``) becomes one
  reshape of the first input, so that a chain which comes back to where it
  started is removed by the first rule;
* a slice of a slice along the same dimension (unit steps, constant bounds)
  becomes one slice, and a squeeze of the dimension an unsqueeze just added
  becomes the unsqueeze's input.

Inductor's own joint-graph passes already drop most reshape chains and
same-shape views before our post-grad pass sees the graph; what reaches it
is mostly identity expands, permutes, squeezes and as_strided calls, slice
chains and unsqueeze/squeeze pairs. On the Dynamo graph (pre-split) it drops
no-op ``.float()``/``.to()``/``.view()`` calls, a dozen or so per Llama layer.

It counts the nodes it removed.

Rewrites that would make a graph output alias a graph input (or another
output) where it did not before are skipped, as Inductor's own no-op removal
does: callers may rely on outputs being fresh.
"""

from __future__ import annotations

import sys

import torch
import torch.fx
from compile_runtime.passes.base import GraphPass, Phase
from compile_runtime.passes.matching import (
    CONVERT,
    aten,
    is_op,
    propagate_val,
    same_layout,
    tensor_val,
)

from compile_runtime.torch_internals import tree_leaves

# ATen ops that return their input, or a view of it, when nothing changes.
ATEN_NOOP_CANDIDATES = (
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.permute.default,
    aten.alias.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.as_strided.default,
    CONVERT,
    aten._to_copy.default,
)
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)

# Tensor methods / torch functions in a Dynamo graph that return self (or an
# identical view) when nothing changes.
DYNAMO_METHODS = frozenset(
    {"view", "reshape", "float", "half", "bfloat16", "to", "type_as", "contiguous", "expand"}
)
DYNAMO_FUNCTIONS = (torch.reshape,)

INT_MAX = sys.maxsize


def _is_candidate(node: torch.fx.Node) -> bool:
    if node.op == "call_function":
        return is_op(node, *ATEN_NOOP_CANDIDATES) or node.target in DYNAMO_FUNCTIONS
    if node.op == "call_method" and node.target in DYNAMO_METHODS:
        return not node.kwargs.get("copy", False) and "memory_format" not in node.kwargs
    return False


class NoOpEliminationPass(GraphPass):
    name = "noop_elimination"
    phases = frozenset({Phase.PRE_SPLIT, Phase.POST_GRAD})

    def run(self, graph: torch.fx.Graph) -> int:
        """Returns the number of nodes removed."""
        count = 0
        self._outputs, self._inputs = _outputs_and_inputs(graph)
        for node in list(graph.nodes):
            if node.graph is not graph:
                continue  # erased by an earlier rewrite
            inner = node.args[0] if node.args else None
            if self._collapse_chain(node) and not inner.users:
                graph.erase_node(inner)  # the chain's first link, now read by nobody
                count += 1
            if self._remove_identity(graph, node):
                count += 1
        return count

    # -- rule 1 -------------------------------------------------------------

    def _remove_identity(self, graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
        if not _is_candidate(node) or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return False
        src = node.args[0]
        out, inp = tensor_val(node), tensor_val(src)
        if out is None or inp is None or not same_layout(out, inp):
            return False
        if node in self._outputs and (src in self._outputs or src in self._inputs):
            return False
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        return True

    # -- rules 2 and 3 -------------------------------------------------------

    def _collapse_chain(self, node: torch.fx.Node) -> bool:
        if is_op(node, *RESHAPES) and is_op(node.args[0], *RESHAPES):
            inner = node.args[0]
            return self._retarget(node, aten.reshape.default, (inner.args[0], node.args[1]))
        if is_op(node, aten.squeeze.dim) and is_op(node.args[0], aten.unsqueeze.default):
            inner = node.args[0]
            x = tensor_val(inner.args[0])
            if x is not None and node.args[1] % (x.dim() + 1) == inner.args[1] % (x.dim() + 1):
                return self._retarget(node, aten.alias.default, (inner.args[0],))
            return False
        if is_op(node, aten.slice.Tensor) and is_op(node.args[0], aten.slice.Tensor):
            merged = _merge_slices(node.args[0], node)
            return merged is not None and self._retarget(node, aten.slice.Tensor, merged)
        return False

    def _retarget(self, node: torch.fx.Node, target, args: tuple) -> bool:
        """Point ``node`` at ``target(*args)`` if that computes the same view; else leave it."""
        before = tensor_val(node)
        old = (node.target, node.args, node.kwargs, node.meta.get("val"))
        node.target, node.args, node.kwargs = target, args, {}
        try:
            propagate_val(node)
            after = tensor_val(node)
            if before is not None and after is not None and same_layout(before, after):
                return True
        except Exception:  # a rewrite that does not type-check is skipped
            pass
        node.target, node.args, node.kwargs = old[0], old[1], old[2]
        node.meta["val"] = old[3]
        return False


def _merge_slices(inner: torch.fx.Node, outer: torch.fx.Node) -> tuple | None:
    """``slice(slice(x, d, a, b), d, c, e)`` as one ``slice(x, d, ...)``, when constant."""

    def parts(n: torch.fx.Node):
        args = list(n.args) + [None] * (5 - len(n.args))
        dim = n.kwargs.get("dim", args[1] if args[1] is not None else 0)
        start = n.kwargs.get("start", args[2])
        end = n.kwargs.get("end", args[3])
        step = n.kwargs.get("step", args[4] if args[4] is not None else 1)
        return dim, 0 if start is None else start, INT_MAX if end is None else end, step

    x = tensor_val(inner.args[0])
    if x is None:
        return None
    d1, a, b, s1 = parts(inner)
    d2, c, e, s2 = parts(outer)
    values = (d1, a, b, s1, d2, c, e, s2)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    if s1 != 1 or s2 != 1 or min(a, b, c, e) < 0:
        return None
    if d1 % x.dim() != d2 % x.dim():
        return None
    start = a + c
    end = b if e >= INT_MAX - a else min(b, a + e)
    return (inner.args[0], d1, start, end)


def _outputs_and_inputs(graph: torch.fx.Graph) -> tuple[set, set]:
    outputs: set[torch.fx.Node] = set()
    for node in graph.find_nodes(op="output"):
        for arg in tree_leaves(node.args):
            if isinstance(arg, torch.fx.Node):
                outputs.add(arg)
    return outputs, set(graph.find_nodes(op="placeholder"))
