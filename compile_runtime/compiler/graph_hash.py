"""A canonical form of an FX piece, for finding structurally identical pieces.

Every transformer layer produces the same piece graph with its weights as
inputs; only names differ. The canonical form renames every node by position
and records each input's dtype, shape (symbols included), stride and device,
so two pieces with equal keys compute the same function of their inputs and
can share one compiled artifact.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.fx


def _describe_input(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"T({value.dtype},{tuple(str(s) for s in value.shape)},{tuple(str(s) for s in value.stride())},{value.device.type},{value.requires_grad})"
    if isinstance(value, torch.SymInt):
        return f"S({value})"
    return f"C({type(value).__name__}:{value!r})"


def canonical_form(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    names: dict[torch.fx.Node, str] = {}

    def rename(arg: Any) -> Any:
        return torch.fx.node.map_arg(arg, lambda n: names[n])

    lines = []
    inputs = iter(example_inputs)
    for node in gm.graph.nodes:
        names[node] = f"%{len(names)}"
        if node.op == "placeholder":
            lines.append(f"{names[node]} = input {_describe_input(next(inputs, None))}")
            continue
        target = node.target
        if node.op == "get_attr":
            # Constants are not inputs: their identity is part of the function.
            target = f"{target}@{id(getattr(gm, target, None))}"
        elif not isinstance(target, str):
            target = getattr(target, "__qualname__", None) or str(target)
            target = f"{getattr(node.target, '__module__', '')}.{target}"
        lines.append(
            f"{names[node]} = {node.op} {target} {rename(node.args)!r} {rename(node.kwargs)!r}"
        )
    return "\n".join(lines)


def piece_hash(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    return hashlib.sha256(canonical_form(gm, example_inputs).encode()).hexdigest()[:16]
