"""Capture safety: what in a piece would break a CUDA graph, found at compile time on any device.

A CUDA graph records kernels once and replays them with the same shapes, the same
addresses and no host in the loop. So a piece meant for capture must not wait for the
device (``.item()``, ``.tolist()``, ``bool(tensor)``: a sync, an error while capturing),
make a shape or an allocation size from tensor data (``nonzero``, a boolean mask, an
``.item()``-sized ``zeros``: the replay keeps the captured size), or read a CPU tensor
(its value is copied or baked in at capture, never read again). On a GPU those show as a
failed capture or, worse, a replay that is silently wrong; here they are read off the FX
graph of each static piece after the split: the ops by name, the data-dependent values by
their unbacked symbols (``node.meta['val']`` / Dynamo's ``'example_value'``), the CPU
tensors by device against the graph's device.

What never reaches a graph (with ``fullgraph=True`` a data-dependent branch or an
unsupported call stops Dynamo) is a finding of the model check, ``verify/capture.py``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx

from compile_runtime.config import CompilationConfig, CompilationMode, CUDAGraphMode
from compile_runtime.torch_internals import (
    free_unbacked_symbols,
    is_torch_op,
    op_bare_name,
    tree_flatten,
)

logger = logging.getLogger(__name__)

HOST_SYNC = "host-sync"
DATA_SHAPE = "data-dependent-shape"
DATA_ALLOC = "data-dependent-alloc"
CPU_TENSOR = "cpu-tensor"
HOST_DATA = "host-data"
GRAPH_BREAK = "graph-break"
DATA_BRANCH = "data-dependent-branch"
CUDAGRAPH_MODE = "cudagraph-mode"

_HOST_SYNC_OPS = frozenset(
    {"item", "tolist", "_local_scalar_dense", "is_nonzero", "__bool__", "__int__", "__float__",
     "__index__", "numpy", "equal", "allclose"}
)  # fmt: skip
_DATA_SHAPE_OPS = frozenset(
    {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "_unique",
     "_unique2", "unique_dim", "bincount"}
)  # fmt: skip
_FACTORY_OPS = frozenset(
    {"empty", "zeros", "ones", "full", "arange", "range", "linspace", "logspace", "eye", "rand",
     "randn", "randint", "randperm", "empty_strided", "empty_permuted", "new_empty",
     "new_zeros", "new_ones", "new_full", "new_empty_strided"}
)  # fmt: skip
_HOST_DATA_OPS = frozenset({"tensor", "as_tensor", "from_numpy", "lift_fresh_copy"})
_TRANSFER_OPS = frozenset({"cpu", "to", "_to_copy", "copy_", "pin_memory"})


@dataclass(frozen=True)
class Finding:
    """One thing that would break (or silently falsify) a CUDA graph, and how to fix it."""

    kind: str
    node: str  # the FX node's name ("" for a trace failure or the mode)
    target: str  # the op or method, readable
    why: str
    fix: str
    piece: str = ""  # the piece ("submod_0"), "" outside pieces

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


# ---- reading a node -----------------------------------------------------------------


def op_base_name(node: torch.fx.Node) -> str:
    """The op's bare name ("nonzero" for torch.nonzero, Tensor.nonzero, aten.nonzero.default)."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if node.op != "call_function":
        return ""
    if is_torch_op(target):
        return op_bare_name(target)
    return getattr(target, "__name__", "")


def describe_target(node: torch.fx.Node) -> str:
    """A readable name of what the node calls: ``Tensor.item``, ``torch.nonzero``, ..."""
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op in ("placeholder", "get_attr"):
        return f"{node.op} {target}"
    if is_torch_op(target):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", str(target))
    if module.startswith("torch") or target in (operator.getitem, operator.setitem):
        return f"{'torch' if module.startswith('torch') else 'operator'}.{name}"
    return name


def node_value(node: Any) -> Any:
    """What the trace computed for ``node``: a FakeTensor, a SymInt, a tuple, or None."""
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def _unbacked(value: Any) -> set[Any]:
    try:
        return free_unbacked_symbols(value)  # loads sympy
    except Exception:  # a value the symbol walk does not know (an opaque object)
        return set()


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]


def _node_args(node: torch.fx.Node) -> list[Any]:
    return tree_flatten((node.args, node.kwargs))[0]


def graph_device(gm: torch.fx.GraphModule) -> torch.device:
    """The device the graph computes on: the first non-CPU tensor input, else the CPU."""
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            for t in _tensors(node_value(node)):
                if t.device.type not in ("cpu", "meta"):
                    return t.device
    return torch.device("cpu")


# ---- the checks, one per kind ---------------------------------------------------------


Rule = tuple[str, str, str]  # (kind, why, fix)


def _host_sync(node: torch.fx.Node, name: str) -> Rule | None:
    if name in _HOST_SYNC_OPS:
        return (
            HOST_SYNC,
            "reads a tensor's value on the host: a device->host sync, which fails inside "
            "a capture (and a replay never re-reads it)",
            "keep the value on the device (tensor ops instead of Python numbers), or compute it "
            "in the runner before the forward and pass it in a persistent buffer",
        )
    if name in ("setitem", "index_put", "index_put_") and _has_bool_index(node):
        return (
            HOST_SYNC,
            "assigns through a boolean mask, which runs nonzero (a sync) to find the positions",
            "use torch.where(mask, value, x) or x.masked_fill_(mask, value)",
        )
    return None


def _has_bool_index(node: torch.fx.Node) -> bool:
    """Whether the indices (the second argument of getitem, setitem, index, index_put) hold
    a boolean mask."""
    indices = tree_flatten(node.args[1:2])[0]
    return any(t.dtype == torch.bool for i in indices for t in _tensors(node_value(i)))


def _data_shape(node: torch.fx.Node, name: str, new_unbacked: bool) -> Rule | None:
    repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    if (
        name in _DATA_SHAPE_OPS
        or (name in ("getitem", "index") and _has_bool_index(node))
        or (
            name == "repeat_interleave"
            and isinstance(repeats, torch.fx.Node)
            and node.kwargs.get("output_size") is None
        )
        or new_unbacked
    ):
        return (
            DATA_SHAPE,
            "its output shape depends on tensor data (an unbacked size): a graph replays the "
            "captured shape whatever the data",
            "use a fixed-size form (torch.where / masked_fill for a mask, nonzero_static with a "
            "bound, repeat_interleave(output_size=...)) or move it out of the forward",
        )
    return None


def _data_alloc(node: torch.fx.Node, name: str) -> Rule | None:
    if name not in _FACTORY_OPS:
        return None
    sizes = [node_value(a) for a in _node_args(node) if isinstance(a, torch.fx.Node)]
    shapes = [tuple(t.shape) for t in _tensors(node_value(node))]
    if any(_unbacked(v) for v in sizes) or _unbacked(shapes):
        return (
            DATA_ALLOC,
            "allocates with a size read from tensor data: the graph keeps the captured size",
            "allocate at a size the runner knows (the padded token count, a configured maximum) "
            "and mask the rest",
        )
    return None


def _cpu_tensor(
    node: torch.fx.Node, name: str, device: torch.device, seen_cpu: set[torch.fx.Node]
) -> Rule | None:
    """A CPU tensor where the graph runs elsewhere, reported where it starts (not downstream)."""
    if device.type == "cpu":
        return None
    out = _tensors(node_value(node))
    if node not in seen_cpu or any(i in seen_cpu for i in node.all_input_nodes):
        return None
    scalar = (
        " (a 0-dim CPU tensor is passed as a kernel argument: its value at capture is baked in)"
        if any(t.dim() == 0 for t in out)
        else ""
    )
    if node.op in ("placeholder", "get_attr"):
        why = f"a CPU input, parameter, buffer or constant in a {device.type} graph{scalar}"
        fix = f"create it on {device.type} (register_buffer at __init__ on the model's device)"
    elif name in _TRANSFER_OPS:
        why = "copies a tensor to the CPU: a device->host transfer, a sync inside the graph"
        fix = "keep the tensor on the device; do host work in the runner, outside the forward"
    else:
        why = f"produces a CPU tensor in a {device.type} graph{scalar}"
        fix = "pass device=<an input>.device, or make it a buffer on the model's device"
    return CPU_TENSOR, why, fix


def _default_device(node: torch.fx.Node, name: str) -> Rule | None:
    """A torch-level factory call without ``device=``: the CPU, unless a device context is on.

    Seen on any machine (the value's device is the CPU there either way); aten-level
    graphs always carry the device, so only Dynamo's torch-level calls are read.
    """
    target = node.target  # torch.zeros, not aten.zeros.default nor a Python builtin
    torch_level = (
        node.op == "call_function"
        and not is_torch_op(target)
        and (getattr(target, "__module__", None) or "").startswith("torch")
    )
    if not torch_level or "device" in node.kwargs:
        return None
    if name in _HOST_DATA_OPS:
        return (
            HOST_DATA,
            "builds a tensor from Python data on every call, on the default device (the CPU): "
            "a host copy that a graph freezes at capture",
            "register it as a buffer at __init__ (register_buffer(..., persistent=False)) on "
            "the model's device",
        )
    if name in _FACTORY_OPS and not name.startswith("new_"):
        return (
            CPU_TENSOR,
            "allocates on the default device, which is the CPU in a forward on the GPU",
            "pass device=<an input>.device (or use <input>.new_empty / torch.empty_like)",
        )
    return None


def check_graph(
    gm: torch.fx.GraphModule, device: torch.device | str | None = None, piece: str = ""
) -> list[Finding]:
    """Every capture hazard in ``gm``, one finding per node (the first rule that matches).

    ``device``: the device the graph is meant to run on (None: ``graph_device(gm)``); a CPU
    tensor is a finding only when it is not the CPU.
    """
    device = torch.device(device) if device is not None else graph_device(gm)
    findings: list[Finding] = []
    symbols: dict[torch.fx.Node, set[Any]] = {}
    seen_cpu: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        name = op_base_name(node)
        symbols[node] = own = _unbacked(node_value(node))
        inherited = set().union(*(symbols.get(i, set()) for i in node.all_input_nodes))
        new_unbacked = bool(own - inherited) and node.op not in ("placeholder", "get_attr")
        if any(t.device.type == "cpu" for t in _tensors(node_value(node))):
            seen_cpu.add(node)
        found = (
            _host_sync(node, name)
            or _data_alloc(node, name)
            or _data_shape(node, name, new_unbacked)
            or _default_device(node, name)
            or _cpu_tensor(node, name, device, seen_cpu)
        )
        if found is not None:
            kind, why, fix = found
            findings.append(Finding(kind, node.name, describe_target(node), why, fix, piece))
    return findings


def check_pieces(pieces: Iterable[Any], device: torch.device | str | None = None) -> list[Finding]:
    """``check_graph`` over every static piece (``split.Piece``; splitting ops are opaque)."""
    findings: list[Finding] = []
    for piece in pieces:
        if not piece.is_splitting_op:
            findings += check_graph(piece.graph, device, piece=piece.name)
    return findings


def capture_meant(config: CompilationConfig, device: torch.device, stand_in: bool) -> bool:
    """Whether this model's graphs may be captured: a cudagraph mode, a traced mode, and
    CUDA (or a graph factory standing in for it, ``stand_in``)."""
    traced = config.mode in (CompilationMode.PIECEWISE, CompilationMode.DYNAMO_TRACE_ONCE)
    on_gpu = device.type == "cuda"
    return traced and config.cudagraph_mode != CUDAGraphMode.NONE and (on_gpu or stand_in)


def warn_at_compile(
    model_tag: str,
    config: CompilationConfig,
    pieces: Sequence[Any],
    example_inputs: Sequence[Any],
    stand_in: bool = False,
) -> list[Finding]:
    """The graph compiler's hook, after the split: one warning per finding when graphs are
    meant. Advisory: a check that fails is logged (debug) and never stops the compile."""
    device = next(
        (t.device for t in _tensors(list(example_inputs)) if t.device.type != "cpu"),
        torch.device("cpu"),
    )
    if not capture_meant(config, device, stand_in):
        return []
    try:
        findings = check_pieces(pieces, device)
    except Exception:  # noqa: BLE001 - never let the advisory check break a compile
        logger.debug("%s: capture safety check failed", model_tag, exc_info=True)
        return []
    for f in findings:
        logger.warning(
            "%s: capture safety: %s %s at %s (%s): %s. Fix: %s",
            model_tag,
            f.piece,
            f.kind,
            f.node,
            f.target,
            f.why,
            f.fix,
        )
    return findings
