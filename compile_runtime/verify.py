"""Which compiled piece made the output wrong: a piece-by-piece verifier.

``verify_model(model, input_ids, positions)`` runs one batch through a
model compiled with ``@compile_runtime.compile`` and then walks its split
graph: every static piece is called twice with the same inputs, once as the
compiled piece (``PiecewiseRuntime``: Inductor's code, our post-grad passes,
shared code of identical layers) and once as the piece's own FX graph before
compilation, run eagerly. The compiled outputs flow on to the next piece, so
each piece is judged on the inputs the compiled model really gives it, and
an error is pinned to the first piece that makes one (it is not smeared over
every later piece). Splitting ops (attention) run as they are.

With piecewise CUDA graphs (or ``check_graphs=True``), each compiled piece is
also captured in a graph of its own and the replayed output compared with
the same piece run without a graph.

What it cannot see: changes made before the split (the pre-split graph
passes, Dynamo's trace itself), because the eager reference of a piece is
the graph those already produced. The end-to-end line compares the compiled
model's output with the split graph run with every piece eager.

``check_model_dir`` does the same for a model directory (``compile-runtime
check``). The batch is one dense causal step over ``num_tokens`` tokens (no
KV cache), unless the caller is already inside a forward context.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map_only

from compile_runtime.compiler.piecewise import PiecewiseRuntime, runtime_size
from compile_runtime.compiler.split import Piece, is_splitting_node
from compile_runtime.config import CompilationConfig, CUDAGraphMode
from compile_runtime.cudagraph.dispatcher import BatchDescriptor
from compile_runtime.cudagraph.wrapper import (
    CUDAGraphWrapper,
    cudagraph_capturing_enabled,
    graphs_available,
)
from compile_runtime.forward_context import is_forward_context_available, set_forward_context
from compile_runtime.table import format_table

logger = logging.getLogger(__name__)

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


# ---- the report ---------------------------------------------------------------------------


@dataclass
class PieceCheck:
    index: int
    name: str
    kind: str  # "compiled" or "splitting op"
    covers: str  # which layers, e.g. "layer 0 (after attention) .. layer 1 (before attention)"
    shared_with: int | None = None  # the piece whose compiled code this one reuses
    max_abs: float | None = None  # compiled vs eager (None for splitting ops)
    max_rel: float | None = None
    ok: bool | None = None
    note: str = ""
    graph_max_abs: float | None = None  # graph replay vs the same piece without a graph
    graph_ok: bool | None = None

    @property
    def failed(self) -> bool:
        return self.ok is False or self.graph_ok is False


@dataclass
class VerifyReport:
    model: str
    num_tokens: int
    dtype: str
    device: str
    backend: str
    atol: float
    rtol: float
    pieces: list[PieceCheck] = field(default_factory=list)
    graphs: str = "off"  # what the graph comparison did, in words
    end_to_end_max_abs: float | None = None  # compiled model vs every piece eager
    end_to_end_max_rel: float | None = None

    @property
    def first_failure(self) -> PieceCheck | None:
        return next((p for p in self.pieces if p.failed), None)

    @property
    def ok(self) -> bool:
        return self.first_failure is None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        first = self.first_failure
        data["first_failure"] = None if first is None else first.index
        data["ok"] = self.ok
        return data

    def format(self) -> str:
        lines = [
            f"check {self.model}: {self.num_tokens} tokens, {self.dtype} on {self.device}, "
            f"{self.backend} backend; a piece passes when max|compiled - eager| <= "
            f"{self.atol:g} + {self.rtol:g} * max|eager|",
            "",
        ]
        rows = []
        for p in self.pieces:
            kind = p.kind if p.shared_with is None else f"compiled (code of {p.shared_with})"
            if p.ok is None:
                result = "ran as is"
            else:
                result = "ok" if p.ok else "FAIL"
                if p.note:
                    result += f": {p.note}"
            graph = "-"
            if p.graph_max_abs is not None:
                graph = f"{p.graph_max_abs:.3g} " + ("ok" if p.graph_ok else "FAIL")
            rows.append(
                [
                    p.index,
                    kind,
                    p.covers,
                    "-" if p.max_abs is None else f"{p.max_abs:.3g}",
                    "-" if p.max_rel is None else f"{p.max_rel:.3g}",
                    result,
                    graph,
                ]
            )
        headers = [
            "piece",
            "kind",
            "covers",
            "max abs err",
            "max rel err",
            "result",
            "graph replay",
        ]
        lines.append(format_table(headers, rows))
        lines.append("")
        if self.end_to_end_max_abs is not None:
            lines.append(
                f"end to end (compiled model vs every piece eager): max abs "
                f"{self.end_to_end_max_abs:.3g}, max rel {self.end_to_end_max_rel:.3g}"
            )
        lines.append(f"CUDA graphs: {self.graphs}")
        first = self.first_failure
        compiled = sum(p.kind == "compiled" for p in self.pieces)
        if first is None:
            lines.append(f"OK: all {compiled} compiled pieces within tolerance")
        else:
            what = (
                "graph replay differs" if first.ok is not False else "compiled differs from eager"
            )
            lines.append(f"FIRST FAILURE: piece {first.index} ({first.covers}): {what}")
        return "\n".join(lines)


# ---- finding the compiled model -------------------------------------------------------


def find_compiled_module(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` or the first submodule that ``@compile_runtime.compile`` compiles."""
    for module in model.modules():
        compiled = module.__dict__.get("_compile_runtime")
        if compiled is not None:
            return module
    raise VerifyError(
        f"{type(model).__name__} has no module compiled by @compile_runtime.compile (built with "
        "CompilationMode.NONE, or not decorated); build it under a CompilationConfig with "
        "mode PIECEWISE (or DYNAMO_TRACE_ONCE) to check it"
    )


def _layer_label(layer_name: str) -> str:
    base = layer_name.split("#")[0]
    numbers = re.findall(r"(?:^|\.)(\d+)(?=\.|$)", base)
    return f"layer {numbers[0]}" if numbers else base


def _splitting_layer(piece: Piece, splitting_ops: list[str]) -> str:
    """The layer label of a splitting-op piece (from the op's string argument)."""
    for node in piece.graph.graph.nodes:
        if is_splitting_node(node, splitting_ops):
            for arg in [*node.args, *node.kwargs.values()]:
                if isinstance(arg, str):
                    return _layer_label(arg)
            return str(node.target)
    return piece.name


def piece_coverage(pieces: list[Piece], splitting_ops: list[str]) -> dict[int, str]:
    """What each piece covers, from the layers of the splitting ops around it."""
    labels = {p.index: _splitting_layer(p, splitting_ops) for p in pieces if p.is_splitting_op}
    order = sorted(pieces, key=lambda p: p.index)
    out: dict[int, str] = {}
    for pos, piece in enumerate(order):
        if piece.is_splitting_op:
            out[piece.index] = f"{labels[piece.index]} attention"
            continue
        before = next((labels[p.index] for p in reversed(order[:pos]) if p.is_splitting_op), None)
        after = next((labels[p.index] for p in order[pos + 1 :] if p.is_splitting_op), None)
        start = "input" if before is None else f"{before} (after attention)"
        end = "output" if after is None else f"{after} (before attention)"
        out[piece.index] = "whole model" if before is after is None else f"{start} .. {end}"
    return out


# ---- running the split graph ------------------------------------------------------------


def _clone(value: Any) -> Any:
    """A copy of every non-parameter tensor with the same strides (pieces may write inputs)."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter):
            return t
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return out.copy_(t)

    return tree_map_only(torch.Tensor, copy, value)


class _PieceChecker(torch.fx.Interpreter):
    """Runs the split graph with compiled pieces, checking each one against its eager graph."""

    def __init__(self, verifier: _Verifier, eager_only: bool = False):
        super().__init__(verifier.split_gm)
        self.v = verifier
        self.eager_only = eager_only
        self.checks: list[PieceCheck] = []

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        piece = self.v.pieces.get(target)
        if piece is None:  # not one of ours: run it
            return super().call_module(target, args, kwargs)
        if piece.is_splitting_op:
            out = piece.graph(*args, **kwargs)
            if not self.eager_only:
                self.checks.append(self.v.new_check(piece, "splitting op"))
            return out
        if self.eager_only:
            return piece.graph(*args, **kwargs)
        runtime = self.v.runtimes[piece.index]
        check = self.v.new_check(piece, "compiled")
        reference_args = _clone(args)
        graph_args = _clone(args) if self.v.check_graphs else None
        with torch.no_grad():
            out = runtime(*args)
            expected = piece.graph(*reference_args)
        skip = uninitialized_outputs(piece.graph)
        diff = compare(out, expected, skip)
        check.max_abs, check.max_rel = diff.max_abs, diff.max_rel
        check.ok = diff.within(self.v.atol, self.v.rtol)
        check.note = diff.note
        if graph_args is not None:
            self.v.check_graph(check, runtime, graph_args, out, skip)
        self.checks.append(check)
        return out


class _Verifier:
    def __init__(
        self,
        module: torch.nn.Module,
        atol: float | None,
        rtol: float | None,
        check_graphs: bool | None,
    ):
        compiled = module.__dict__["_compile_runtime"]
        backend = getattr(compiled, "backend", None)
        if backend is None or backend.split_gm is None:
            raise VerifyError(
                f"{type(module).__name__} has no split graph (CompilationMode "
                f"{compiled.config.mode.name}); the verifier needs CompilationMode.PIECEWISE "
                "or DYNAMO_TRACE_ONCE"
            )
        self.module = module
        self.config: CompilationConfig = backend.config
        self.backend = backend
        self.split_gm: torch.fx.GraphModule = backend.split_gm
        self.pieces: dict[str, Piece] = {p.name: p for p in backend.pieces}
        self.runtimes: dict[int, PiecewiseRuntime] = {r.index: r for r in backend.runtimes}
        self.coverage = piece_coverage(backend.pieces, backend.splitting_ops)
        self.shared = {r.index: r.shared_with for r in backend.result.pieces}
        self.atol, self.rtol = atol, rtol
        wrapped = any(
            isinstance(self.split_gm.__dict__.get(p.name), CUDAGraphWrapper) for p in backend.pieces
        )
        if check_graphs is None:
            check_graphs = wrapped
            if wrapped:
                self.graphs = "piecewise graphs on: each compiled piece captured and replayed"
            elif not graphs_available():
                self.graphs = "off (no CUDA device)"
            else:
                self.graphs = (
                    f"off (cudagraph_mode {self.config.cudagraph_mode.name} captures no "
                    "piecewise graphs of this model)"
                )
        elif check_graphs:
            if not graphs_available():
                raise VerifyError("check_graphs=True needs CUDA (or a graph factory standing in)")
            self.graphs = "each compiled piece captured and replayed (asked for)"
        else:
            self.graphs = "off (not asked for)"
        self.check_graphs = check_graphs

    def new_check(self, piece: Piece, kind: str) -> PieceCheck:
        return PieceCheck(
            index=piece.index,
            name=piece.name,
            kind=kind,
            covers=self.coverage.get(piece.index, piece.name),
            shared_with=self.shared.get(piece.index),
        )

    def check_graph(
        self,
        check: PieceCheck,
        runtime: PiecewiseRuntime,
        args: tuple,
        expected: Any,
        skip: frozenset[int],
    ) -> None:
        """Capture the piece in a graph of its own, replay it, compare with no graph."""
        num_tokens = runtime_size(args, runtime.locator) if runtime.locator else 0
        wrapper = CUDAGraphWrapper(
            runtime,
            CUDAGraphMode.PIECEWISE,
            num_warmups=1,
            name=f"verify piece {check.index}",
        )
        descriptor = BatchDescriptor(num_tokens)
        with (
            torch.no_grad(),
            cudagraph_capturing_enabled(),
            set_forward_context(
                None,
                cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
                batch_descriptor=descriptor,
                num_tokens=num_tokens,
            ),
        ):
            wrapper(*args)  # capture (and one replay)
            replayed = wrapper(*args)  # a replay alone
        diff = compare(replayed, expected, skip)
        check.graph_max_abs = diff.max_abs
        check.graph_ok = diff.within(self.atol, self.rtol)
        if diff.note:
            check.note = (check.note + "; " if check.note else "") + f"graph: {diff.note}"


@contextlib.contextmanager
def _step_context(num_tokens: int) -> Iterator[None]:
    if is_forward_context_available():
        yield
        return
    with set_forward_context(None, num_tokens=num_tokens):
        yield


def verify_model(
    model: torch.nn.Module,
    *args: Any,
    atol: float | None = None,
    rtol: float | None = None,
    check_graphs: bool | None = None,
    **kwargs: Any,
) -> VerifyReport:
    """Check every compiled piece of ``model`` on the batch ``args`` (e.g. input_ids, positions).

    ``model`` is a module built with ``@compile_runtime.compile`` (or one that
    holds it, like ``CausalLM``); it is compiled by the first call if it was
    not yet. Tolerances default per dtype (``DEFAULT_TOLERANCES``, by the
    dtype of the first floating-point parameter). ``check_graphs`` None: compare graph
    replays when the model's pieces are in piecewise CUDA graphs.
    """
    module = find_compiled_module(model)
    tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
    num_tokens = tensors[0].shape[0] if tensors else 0
    dtype = next(
        (p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype()
    )
    default_atol, default_rtol = tolerance_for(dtype)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol

    compiled = module.__dict__["_compile_runtime"]
    captured: list[tuple] = []
    with torch.no_grad(), _step_context(num_tokens):
        if getattr(compiled, "traced", False) is False:
            module(*args, **kwargs)  # the first call traces and compiles
        verifier = _Verifier(module, atol, rtol, check_graphs)
        hook = verifier.split_gm.register_forward_pre_hook(
            lambda _mod, inputs: captured.append(_clone(inputs))
        )
        try:
            real_out = module(*args, **kwargs)
        finally:
            hook.remove()
        if not captured:
            raise VerifyError("the compiled forward did not call its split graph")
        graph_inputs = captured[-1]
        checker = _PieceChecker(verifier)
        checker.run(*_clone(graph_inputs))
        eager_out = _PieceChecker(verifier, eager_only=True).run(*_clone(graph_inputs))

    report = VerifyReport(
        model=type(module).__name__,
        num_tokens=int(num_tokens),
        dtype=str(dtype).removeprefix("torch."),
        device=str(tensors[0].device) if tensors else "cpu",
        backend=verifier.config.backend,
        atol=atol,
        rtol=rtol,
        pieces=checker.checks,
        graphs=verifier.graphs,
    )
    end_to_end = compare(_unwrap_single(real_out), _unwrap_single(eager_out))
    report.end_to_end_max_abs, report.end_to_end_max_rel = end_to_end.max_abs, end_to_end.max_rel
    first = report.first_failure
    if first is not None:
        logger.warning(
            "verify %s: first failing piece %d (%s)", report.model, first.index, first.covers
        )
    return report


def _unwrap_single(value: Any) -> Any:
    while isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    return value


def check_model_dir(
    model_dir: str,
    config: CompilationConfig | dict | str | None = None,
    *,
    num_tokens: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    seed: int = 0,
    atol: float | None = None,
    rtol: float | None = None,
    check_graphs: bool | None = None,
    use_transformers: bool = False,
) -> VerifyReport:
    """Load ``model_dir`` under ``config`` and verify it on ``num_tokens`` random tokens."""
    from compile_runtime.config import parse_config
    from compile_runtime.models.registry import load_model

    config = parse_config(config)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(
            f"{model_dir!r} is not a model directory (no config.json); pass a directory with "
            "config.json and safetensors weights"
        )
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available")
    model = load_model(
        model_dir, config, dtype=dtype, device=device, use_transformers=use_transformers
    )
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 100)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (num_tokens,), generator=generator).to(device)
    positions = torch.arange(num_tokens, device=device)
    forward = model.model if hasattr(model, "model") else model
    return verify_model(
        forward, input_ids, positions, atol=atol, rtol=rtol, check_graphs=check_graphs
    )
