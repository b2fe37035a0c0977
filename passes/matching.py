"""Small helpers for hand-written FX matching on ATen-level (post-grad) graphs.

The passes match by walking from a pattern's output node to its inputs and
checking every op, constant, dimension and dtype on the way; commutative ops
are tried both ways round. Shapes are compared symbolically and only count as
equal when they are equal for every value of the symbols (no guards added).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx

from compile_runtime.torch_internals import (
    OpOverload,
    OpOverloadPacket,
    detect_fake_mode,
    statically_known_true,
    tree_leaves,
)

aten = torch.ops.aten
prims = torch.ops.prims

CONVERT = prims.convert_element_type.default


def is_op(node: Any, *targets: OpOverload | OpOverloadPacket | Any) -> bool:
    """``node`` calls one of ``targets`` (an overload packet matches all its overloads)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    for target in targets:
        if node.target is target:
            return True
        if isinstance(target, OpOverloadPacket) and (
            getattr(node.target, "overloadpacket", None) is target
        ):
            return True
    return False


def val(node: Any) -> Any:
    """The fake value recorded for a node (post-grad ``val`` or Dynamo ``example_value``)."""
    if not isinstance(node, torch.fx.Node):
        return node
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


def tensor_val(node: Any) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def sym_equal(a: Any, b: Any) -> bool:
    """Equal for every value of the shape symbols (never adds a guard)."""
    if isinstance(a, (tuple, list, torch.Size)) or isinstance(b, (tuple, list, torch.Size)):
        if not (
            isinstance(a, (tuple, list, torch.Size)) and isinstance(b, (tuple, list, torch.Size))
        ):
            return False
        return len(a) == len(b) and all(sym_equal(x, y) for x, y in zip(a, b, strict=True))
    return statically_known_true(a == b)  # loads sympy


def same_shape(a: Any, b: Any) -> bool:
    ta, tb = tensor_val(a), tensor_val(b)
    return ta is not None and tb is not None and sym_equal(tuple(ta.shape), tuple(tb.shape))


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, strides, offset, dtype and device: the same view of memory."""
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and sym_equal(tuple(a.shape), tuple(b.shape))
        and sym_equal(tuple(a.stride()), tuple(b.stride()))
        and sym_equal(a.storage_offset(), b.storage_offset())
    )


def last_dim(dim: Any, ndim: int) -> bool:
    """``dim`` (an int, or a one-element list) names the last of ``ndim`` dimensions."""
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def number(arg: Any) -> float | None:
    """A Python number constant (not a node, not a bool), else None."""
    if isinstance(arg, bool) or not isinstance(arg, (int, float)):
        return None
    return float(arg)


def commuted(node: torch.fx.Node) -> list[tuple[Any, Any]]:
    """Both orders of a binary op's two operands."""
    a, b = node.args[0], node.args[1]
    return [(a, b), (b, a)]


def alpha_is_one(node: torch.fx.Node) -> bool:
    return node.kwargs.get("alpha", 1) == 1 and len(node.args) <= 2


def convert_to(node: Any, dtype: torch.dtype) -> Any:
    """The input of ``convert_element_type(x, dtype)``, or None if ``node`` is not that."""
    if is_op(node, CONVERT) and node.args[1] == dtype:
        return node.args[0]
    return None


def dtype_of(node: Any) -> torch.dtype | None:
    t = tensor_val(node)
    return t.dtype if t is not None else None


def fake_mode_of(graph: torch.fx.Graph):
    vals = [tensor_val(n) for n in graph.nodes]
    return detect_fake_mode([v for v in vals if v is not None])


def propagate_val(node: torch.fx.Node) -> None:
    """Record ``node``'s fake value by running its target on its inputs' fake values."""
    if node.op != "call_function":
        return
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), val)
    if node.target is operator.getitem:
        node.meta["val"] = args[0][args[1]] if args[0] is not None else None
        return
    mode = detect_fake_mode([a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)])
    if mode is None:
        return
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)


def position(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def latest(graph: torch.fx.Graph, nodes: Iterable[Any]) -> torch.fx.Node:
    """The node of ``nodes`` that comes last in ``graph`` (inputs that are not nodes ignored)."""
    order = position(graph)
    candidates = [n for n in nodes if isinstance(n, torch.fx.Node)]
    return max(candidates, key=order.__getitem__)


def insert_call(
    graph: torch.fx.Graph,
    target: Any,
    args: tuple,
    kwargs: dict | None = None,
    *,
    after: torch.fx.Node,
    num_outputs: int = 0,
) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """Insert ``target(*args, **kwargs)`` after ``after``, plus ``num_outputs`` getitems."""
    with graph.inserting_after(after):
        node = graph.call_function(target, args, kwargs or {})
    propagate_val(node)
    items = []
    cursor = node
    for i in range(num_outputs):
        with graph.inserting_after(cursor):
            item = graph.call_function(operator.getitem, (node, i))
        propagate_val(item)
        items.append(item)
        cursor = item
    return node, items


def erase_unused(graph: torch.fx.Graph, nodes: Sequence[torch.fx.Node]) -> int:
    """Erase the nodes of ``nodes`` that nothing uses any more (repeatedly); returns how many."""
    erased = 0
    changed = True
    alive = [n for n in dict.fromkeys(nodes) if n.graph is graph]
    while changed:
        changed = False
        for node in list(alive):
            if node.op == "call_function" and not node.users and not node.is_impure():
                alive.remove(node)
                graph.erase_node(node)
                erased += 1
                changed = True
    return erased


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Reorder as little as possible so that every node comes after its inputs."""
    placed: set[torch.fx.Node] = set()
    waiting: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    pending = list(reversed(graph.nodes))
    cursor: torch.fx.Node | None = None
    while pending:
        node = pending.pop()
        missing = [i for i in node.all_input_nodes if i not in placed]
        if missing:
            waiting.setdefault(missing[-1], []).append(node)
            continue
        placed.add(node)
        if cursor is not None and cursor.next is not node:
            cursor.append(node)
        cursor = node
        pending.extend(reversed(waiting.pop(node, [])))
    if waiting:
        raise RuntimeError("graph has a cycle after a pass rewrote it")
