"""Split a Dynamo FX graph at the splitting ops.

Every splitting-op call gets a piece of its own; the code between two calls
is one piece. ``getitem`` nodes stay with the node that produced the tuple so
tuple values never cross a piece boundary.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from compile_runtime.attention.op import (
    ATTENTION_OP_NAME,
    call_attention_layer,
    default_splitting_ops,
)
from compile_runtime.torch_internals import OpOverloadPacket, op_overload_name, op_qualified_name


@dataclass
class Piece:
    name: str  # attribute name of the submodule in the split graph ("submod_3")
    index: int
    graph: torch.fx.GraphModule
    is_splitting_op: bool


class SplittingOpError(ValueError):
    """A ``splitting_ops`` entry names no registered op."""


def op_name(node: torch.fx.Node) -> str | None:
    """``namespace::name`` of a call_function node's op, or None for plain Python callables."""
    return op_qualified_name(node.target)


def is_splitting_node(node: torch.fx.Node, splitting_ops: list[str]) -> bool:
    """Whether the node calls a splitting op, named ``ns::op`` or ``ns::op.overload``."""
    if node.op != "call_function":
        return False
    name = op_name(node)
    if name is None:
        return False
    if name in splitting_ops:
        return True
    overload = op_overload_name(node.target)  # None: a packet, any overload
    prefix = name + "."
    return any(
        entry.startswith(prefix) and overload in (None, entry[len(prefix) :])
        for entry in splitting_ops
    )


def _registered(name: str) -> bool:
    namespace, sep, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    if not (sep and namespace and op):
        return False
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
        if overload:
            getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return False
    return isinstance(packet, OpOverloadPacket)


def check_splitting_ops(splitting_ops: list[str]) -> None:
    """Every entry must name a registered op: a typo would leave attention inside the pieces.

    Checked when the graph is split, not when the config is made: a model's
    own custom ops may register after its config exists.
    """
    for name in splitting_ops:
        if _registered(name):
            continue
        namespace, _, rest = name.partition(".")
        guess = f"{namespace}::{rest}"  # "aten.mm" for "aten::mm"
        hint = f" (did you mean {guess!r}?)" if "::" not in name and _registered(guess) else ""
        raise SplittingOpError(
            f"splitting_ops entry {name!r} is not a registered op{hint}. Name ops as "
            "'namespace::op' or 'namespace::op.overload' (as in torch.ops.namespace.op) and "
            "register custom ops before the first forward. This package's splitting ops: "
            f"{default_splitting_ops()}; splitting_ops=None uses them."
        )


def split_graph(
    gm: torch.fx.GraphModule, splitting_ops: list[str]
) -> tuple[torch.fx.GraphModule, list[Piece]]:
    partition: dict[torch.fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            producer = node.args[0]
            if isinstance(producer, torch.fx.Node) and producer in partition:
                partition[node] = partition[producer]
                continue
        if is_splitting_node(node, splitting_ops):
            current += 1
            partition[node] = current
            current += 1
        else:
            partition[node] = current

    split_gm = split_module(gm, None, lambda n: partition[n], keep_original_order=True)

    splitting_ids = {
        pid for node, pid in partition.items() if is_splitting_node(node, splitting_ops)
    }
    pieces: list[Piece] = []
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        pid = int(node.target.rsplit("_", 1)[1])
        pieces.append(
            Piece(
                name=node.target,
                index=len(pieces),
                graph=getattr(split_gm, node.target),
                is_splitting_op=pid in splitting_ids,
            )
        )
    return split_gm, pieces


def placeholder_names(graph: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in graph.graph.nodes if n.op == "placeholder"]


def direct_splitting_graph(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a splitting-op piece whose attention op calls the layer's body directly."""
    graph = copy.deepcopy(graph)
    for node in graph.graph.nodes:
        if node.op == "call_function" and op_name(node) in (
            ATTENTION_OP_NAME,
            ATTENTION_OP_NAME + ".default",
        ):
            node.target = call_attention_layer
    graph.recompile()
    return graph


def direct_splitting_piece(graph: torch.fx.GraphModule) -> Callable[..., Any]:
    """A splitting-op piece as a plain function that calls the attention op's body directly.

    Skips ``nn.Module.__call__`` and the op's dispatch, which on a CPU decode step cost
    about as much as the attention itself. Other splitting ops keep their dispatch.
    """
    return direct_splitting_graph(graph).forward
