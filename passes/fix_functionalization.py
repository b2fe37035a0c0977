"""Fix functionalization: turn ``auto_functionalized`` calls back into in-place calls.

AOT autograd functionalizes a custom op that mutates its arguments (the
attention op when it is not a split point, the in-place rotary op the rotary
fusion inserts): the graph calls ``auto_functionalized(op, ...)``, which means
"clone the mutated arguments, run the op on the clones, return them". Inductor
avoids the clone only when it can prove it safe, and otherwise copies whole
buffers. This pass, the last in the pipeline, calls the op on the original
tensors directly and points every reader of the "new" values at them, when:

* every mutated tensor is (a view of) a buffer the graph itself allocated,
  not a graph input or constant;
* nothing else reads that buffer (or any view overlapping the mutated view)
  after the op: readers of other halves of a ``split`` do not overlap.

Both forms of the higher-order op are handled (v1: mutated arguments passed
directly; v2: bases plus view descriptions). Where the conditions fail the
node is left to Inductor, which is always correct.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx
from compile_runtime.passes.base import GraphPass
from compile_runtime.passes.matching import aten, erase_unused, is_op, position, propagate_val

from compile_runtime.torch_internals import auto_functionalized, auto_functionalized_v2, op_schema

# Ops whose output shares its input's storage (input is args[0]).
VIEW_OPS = (
    aten.view.default,
    aten.reshape.default,  # may copy; counting it as a view is the conservative side
    aten._unsafe_view.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.unsqueeze.default,
    aten.squeeze,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.expand.default,
    aten.as_strided.default,
    aten.alias.default,
    aten.diagonal.default,
    aten.view_as_real.default,
    aten.view_as_complex.default,
    aten.unfold.default,
)
# Ops returning several views, each read through getitem.
MULTI_VIEW_OPS = (
    aten.split_with_sizes.default,
    aten.split.Tensor,
    aten.unbind.int,
    aten.chunk.default,
)
# Of those, the ones whose outputs do not overlap one another.
DISJOINT_MULTI_VIEW_OPS = (aten.split_with_sizes.default, aten.split.Tensor, aten.unbind.int)


def _is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _parent_view(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor ``node`` is a view of, or None if it is not a view."""
    if is_op(node, *VIEW_OPS, *MULTI_VIEW_OPS) and isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    if _is_getitem(node) and is_op(node.args[0], *MULTI_VIEW_OPS):
        return node.args[0]
    return None


def _storage_root(node: torch.fx.Node) -> tuple[torch.fx.Node, dict[torch.fx.Node, int]]:
    """The node that owns ``node``'s storage, and for each multi-view op on the way the
    index of the output taken."""
    taken: dict[torch.fx.Node, int] = {}
    while True:
        parent = _parent_view(node)
        if parent is None:
            return node, taken
        if _is_getitem(node):
            taken[parent] = node.args[1]
            node = parent
            continue
        node = parent


def _overlapping_views(root: torch.fx.Node, taken: dict[torch.fx.Node, int]) -> set[torch.fx.Node]:
    """Every view of ``root`` that may overlap the view reached through ``taken``."""
    seen: set[torch.fx.Node] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if _is_getitem(user) and is_op(node, *DISJOINT_MULTI_VIEW_OPS) and node in taken:
                if user.args[1] != taken[node]:
                    continue  # another part of a split: does not overlap
            if _parent_view(user) is node:
                stack.append(user)
    return seen


def safe_to_mutate(
    graph: torch.fx.Graph, target: torch.fx.Node, at: torch.fx.Node, order: dict
) -> bool:
    """Whether ``target`` may be mutated in place at node ``at``."""
    root, taken = _storage_root(target)
    if root.op != "call_function" or _is_getitem(root) and root.args[0] is at:
        return False  # a graph input, a constant, or an output of the op itself
    views = _overlapping_views(root, taken)
    for view in views:
        for user in view.users:
            if user is at or user in views:
                continue
            if order[user] > order[at]:
                return False  # reads the buffer after the op would have changed it
    return True


def _mutable_args(op) -> list[torch.Argument]:
    return [
        a for a in op_schema(op).arguments if a.alias_info is not None and a.alias_info.is_write
    ]


def _num_outputs(op) -> int:
    return max(1, len(op_schema(op).returns))


class FixFunctionalizationPass(GraphPass):
    name = "fix_functionalization"

    def run(self, graph: torch.fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if is_op(node, auto_functionalized):
                count += self._fix(graph, node, self._v1_args(node))
            elif is_op(node, auto_functionalized_v2):
                count += self._fix(graph, node, self._v2_args(graph, node))
        return count

    # Each returns (op, kwargs for the in-place call, mutated tensors in output order,
    # nodes created for it) or None when the node is not one this pass rewrites.

    def _v1_args(self, node: torch.fx.Node):
        op = node.args[0]
        mutable = _mutable_args(op)
        if any(not isinstance(a.type, torch.TensorType | torch.OptionalType) for a in mutable):
            return None
        if any(
            isinstance(a.type, torch.OptionalType)
            and not isinstance(a.type.getElementType(), torch.TensorType)
            for a in mutable
        ):
            return None  # tensor lists
        kwargs = {
            a.name: node.kwargs[a.name] for a in op_schema(op).arguments if a.name in node.kwargs
        }
        return op, kwargs, [kwargs.get(a.name) for a in mutable], []

    def _v2_args(self, graph: torch.fx.Graph, node: torch.fx.Node):
        op = node.args[0]
        bases = list(node.kwargs["_all_bases"])
        kwargs, created = {}, []
        for a in op_schema(op).arguments:
            if a.name in node.kwargs:
                kwargs[a.name] = node.kwargs[a.name]
        for a in _mutable_args(op):
            prefix = f"_{a.name}"
            if f"{prefix}_base_index" not in node.kwargs:
                return None  # tensor lists
            index = node.kwargs[f"{prefix}_base_index"]
            if index is None:
                kwargs[a.name] = None
                continue
            base = bases[index]
            with graph.inserting_before(node):
                if f"{prefix}_alias" in node.kwargs:
                    view = graph.call_function(aten.alias.default, (base,))
                elif f"{prefix}_storage_offset" in node.kwargs:
                    view = graph.call_function(
                        aten.as_strided.default,
                        (
                            base,
                            node.kwargs[f"{prefix}_size"],
                            node.kwargs[f"{prefix}_stride"],
                            node.kwargs[f"{prefix}_storage_offset"],
                        ),
                    )
                elif f"{prefix}_slice_dim" in node.kwargs:
                    view = graph.call_function(
                        aten.slice.Tensor,
                        (
                            base,
                            node.kwargs[f"{prefix}_slice_dim"],
                            node.kwargs[f"{prefix}_slice_start"],
                            node.kwargs[f"{prefix}_slice_end"],
                        ),
                    )
                else:
                    view = base
            if view is not base:
                propagate_val(view)
                created.append(view)
            kwargs[a.name] = view
        return op, kwargs, bases, created

    def _fix(self, graph: torch.fx.Graph, node: torch.fx.Node, parsed) -> int:
        if parsed is None:
            return 0
        op, kwargs, mutated, created = parsed
        order = position(graph)
        targets = [m for m in mutated if m is not None]
        if not all(safe_to_mutate(graph, t, node, order) for t in _unique(targets)):
            erase_unused(graph, created)
            return 0
        with graph.inserting_before(node):
            call = graph.call_function(op, (), kwargs)
        try:
            propagate_val(call)
        except Exception:  # the value is only informative; Inductor recomputes it
            call.meta.pop("val", None)
        n_out, returns = _num_outputs(op), len(op_schema(op).returns)
        for user in list(node.users):
            if not _is_getitem(user):
                raise RuntimeError(f"unexpected use of {node.name}: {user.format_node()}")
            idx = user.args[1]
            if idx >= n_out:  # the new value of a mutated tensor: the tensor itself now
                user.replace_all_uses_with(mutated[idx - n_out])
            elif returns == 1:
                user.replace_all_uses_with(call)
            elif returns > 1:
                user.args = (call, idx)
                continue
            elif user.users:
                raise RuntimeError(f"{op} returns nothing but {user.name} is read")
            graph.erase_node(user)
        graph.erase_node(node)
        return 1


def _unique(nodes: Iterable[torch.fx.Node]) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []
    for n in nodes:
        if n not in out:
            out.append(n)
    return out
