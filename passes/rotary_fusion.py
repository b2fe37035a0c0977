"""Rotary embedding fusion: Q and K rotated by one in-place op.

The neox-style rotary of ``x`` ([tokens, heads, head_size]), as it reaches
the post-grad graph::

    x1, x2   = slice(x, -1, 0, half), slice(x, -1, half, end)
    cos, sin = unsqueeze(index(cos_cache, [positions]), 1), ... sin_cache ...
    out      = cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    out      = convert_element_type(out, x.dtype)      # when the cache is wider than x

Two such rotaries that read the same positions and caches (a layer's Q and
K) become one ``compile_runtime.rotary_embedding_(positions, q, k, cos_cache,
sin_cache)``, which rotates both in place. The graph is functional here, so
the op goes in as ``auto_functionalized`` and its results replace the two
``out`` nodes; the fix-functionalization pass, which runs last, turns it into
a true in-place call where nothing else reads the old q and k. An unpaired
rotary gets the op with ``key=None``.

Left alone: interleaved (GPT-J style) rotaries, a sign or an operand out of
place, slices that are not the two halves, angles from different positions,
and results that are not rounded to x's dtype (the op writes into x).
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
    dtype_of,
    erase_unused,
    insert_call,
    is_op,
    last_dim,
    latest,
    stable_topological_sort,
    sym_equal,
    tensor_val,
)

import compile_runtime.ops.fused as fused_ops
from compile_runtime.torch_internals import auto_functionalized


@dataclass
class RotarySite:
    out: torch.fx.Node
    x: torch.fx.Node
    positions: torch.fx.Node
    cos_cache: torch.fx.Node
    sin_cache: torch.fx.Node
    pattern: list[torch.fx.Node]


def _half_slice(node, x_half: int | None = None):
    """``(x, which)`` for ``slice(x, -1, 0, half)`` (which=0) or ``slice(x, -1, half, end)`` (1)."""
    if not is_op(node, aten.slice.Tensor):
        return None
    x = node.args[0]
    xv = tensor_val(x)
    if xv is None or xv.dim() != 3:
        return None
    args = list(node.args) + [None] * (5 - len(node.args))
    dim, start, end, step = args[1], args[2], args[3], args[4]
    if not last_dim(dim, 3) or (step or 1) != 1:
        return None
    size = xv.shape[-1]
    if not isinstance(size, int) or size % 2:
        return None
    half = size // 2
    if start in (0, None) and isinstance(end, int) and end == half:
        return x, 0
    if start == half and (end is None or (isinstance(end, int) and end >= size)):
        return x, 1
    return None


def _angles(node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(cache, positions)`` for ``unsqueeze(index(cache, [positions]), 1)``."""
    if not is_op(node, aten.unsqueeze.default) or node.args[1] not in (1, -2):
        return None
    index = node.args[0]
    if not is_op(index, aten.index.Tensor):
        return None
    cache, indices = index.args[0], index.args[1]
    if not isinstance(indices, (list, tuple)) or len(indices) != 1 or indices[0] is None:
        return None
    cv, pv = tensor_val(cache), tensor_val(indices[0])
    if cv is None or pv is None or cv.dim() != 2 or pv.dim() != 1:
        return None
    if pv.dtype not in (torch.int64, torch.int32):
        return None
    return cache, indices[0]


def _product(node, want_half: int):
    """``(x, angles_node)`` for ``mul(half_slice(x, want_half), angles)`` either way round."""
    if not is_op(node, aten.mul.Tensor):
        return None
    for a, b in commuted(node):
        s = _half_slice(a)
        if s is not None and s[1] == want_half and _angles(b) is not None:
            return s[0], b, a
    return None


def match_rotary(node: torch.fx.Node) -> RotarySite | None:
    """The rotary whose (possibly dtype-converted) output is ``node``."""
    out = node
    cat = node.args[0] if is_op(node, CONVERT) else node
    if not is_op(cat, aten.cat.default):
        return None
    tensors = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
        return None
    first, second = tensors
    if not (is_op(first, aten.sub.Tensor) and alpha_is_one(first)):
        return None
    if not (is_op(second, aten.add.Tensor) and alpha_is_one(second)):
        return None
    p = _product(first.args[0], 0)  # x1 * cos
    q = _product(first.args[1], 1)  # x2 * sin
    if p is None or q is None:
        return None
    x, cos_node, x1 = p
    if q[0] is not x:
        return None
    sin_node, x2 = q[1], q[2]
    for r_node, s_node in commuted(second):
        r = _product(r_node, 1)  # x2 * cos
        s = _product(s_node, 0)  # x1 * sin
        if r is None or s is None or r[0] is not x or s[0] is not x:
            continue
        if r[1] is not cos_node and _angles(r[1]) != _angles(cos_node):
            continue
        if s[1] is not sin_node and _angles(s[1]) != _angles(sin_node):
            continue
        break
    else:
        return None
    xv, ov = tensor_val(x), tensor_val(out)
    if xv is None or ov is None or not last_dim(dim, 3):
        return None
    if ov.dtype != xv.dtype or not sym_equal(tuple(ov.shape), tuple(xv.shape)):
        return None  # the op writes into x: the result must be x's shape and dtype
    cos_cache, positions = _angles(cos_node)
    sin_cache, sin_positions = _angles(sin_node)
    if sin_positions is not positions or dtype_of(cos_cache) != dtype_of(sin_cache):
        return None
    if not sym_equal(tensor_val(positions).shape[0], xv.shape[0]):
        return None
    half = xv.shape[-1] // 2
    for cache in (cos_cache, sin_cache):
        if not sym_equal(tensor_val(cache).shape[-1], half):
            return None
    nodes = [x1, x2, cos_node, sin_node, first.args[0], first.args[1], *second.args, first, second]
    nodes += [r[1], s[1], cat] + ([out] if out is not cat else [])
    return RotarySite(out, x, positions, cos_cache, sin_cache, nodes)


class RotaryFusionPass(GraphPass):
    name = "rotary_fusion"
    depends_on = (fused_ops,)

    def run(self, graph: torch.fx.Graph) -> int:
        sites: list[RotarySite] = []
        for node in graph.nodes:
            site = match_rotary(node)
            if site is not None:
                sites.append(site)
        groups: dict[tuple, list[RotarySite]] = {}
        for site in sites:
            groups.setdefault((site.positions, site.cos_cache, site.sin_cache), []).append(site)
        count = pairs = 0
        for group in groups.values():
            for i in range(0, len(group), 2):
                pair = group[i : i + 2]
                self._replace(graph, pair)
                count += len(pair)
                pairs += len(pair) == 2
        if count:
            stable_topological_sort(graph)
        self.last_counts = {"rotary_qk": pairs, "rotary_single": count - 2 * pairs}
        return count

    def _replace(self, graph: torch.fx.Graph, pair: list[RotarySite]) -> None:
        q = pair[0]
        k = pair[1] if len(pair) == 2 else None
        kwargs = {
            "positions": q.positions,
            "query": q.x,
            "key": k.x if k is not None else None,
            "cos_cache": q.cos_cache,
            "sin_cache": q.sin_cache,
        }
        inputs = [v for v in kwargs.values() if v is not None]
        node, items = insert_call(
            graph,
            auto_functionalized,
            (torch.ops.compile_runtime.rotary_embedding_.default,),
            kwargs,
            after=latest(graph, inputs),
            num_outputs=3,
        )
        q.out.replace_all_uses_with(items[1])
        if k is not None:
            k.out.replace_all_uses_with(items[2])
        dead = [*reversed(q.pattern)] + ([*reversed(k.pattern)] if k is not None else [])
        erase_unused(graph, dead)
        erase_unused(graph, [items[0]] + ([] if k is not None else [items[2]]))
