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
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from compile_runtime.attention.op import running_layers
from compile_runtime.compiler.decorator import (
    compiled_model,
    find_compiled_module,
    graph_factory_of,
    is_traced,
    trace_at_first_call,
)
from compile_runtime.compiler.piecewise import PiecewiseRuntime, runtime_size
from compile_runtime.compiler.split import Piece, is_splitting_node
from compile_runtime.config import CompilationConfig, CUDAGraphMode
from compile_runtime.forward_context import (
    BatchDescriptor,
    is_forward_context_available,
    set_forward_context,
)
from compile_runtime.graphs.wrapper import (
    CUDAGraphWrapper,
    cudagraph_capturing_enabled,
    graphs_available,
)
from compile_runtime.torch_internals import tree_map_only
from compile_runtime.verify.compare import (
    VerifyError,
    compare,
    tolerance_for,
    uninitialized_outputs,
)
from compile_runtime.verify.report import PieceCheck, VerifyReport

logger = logging.getLogger(__name__)


# ---- finding the compiled model -------------------------------------------------------


def _compiled_module(model: torch.nn.Module) -> torch.nn.Module:
    module = find_compiled_module(model)
    if module is None:
        raise VerifyError(
            f"{type(model).__name__} has no module compiled by @compile_runtime.compile (built "
            "with CompilationMode.NONE, or not decorated); build it under a CompilationConfig "
            "with mode PIECEWISE (or DYNAMO_TRACE_ONCE) to check it"
        )
    return module


def _layer_label(layer_name: str) -> str:
    numbers = re.findall(r"(?:^|\.)(\d+)(?=\.|$)", layer_name)
    return f"layer {numbers[0]}" if numbers else layer_name


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
        record = compiled_model(module)
        if record is not None and not isinstance(record.split_gm, torch.fx.GraphModule):
            raise VerifyError(
                f"{type(module).__name__} was started from a saved program, which runs without "
                "its FX graph; verify a model before its first call (verify_model traces it), "
                "or call compile_runtime.compiler.decorator.trace_at_first_call(model) first"
            )
        if record is None:
            raise VerifyError(
                f"{type(module).__name__} has no split graph (CompilationMode "
                f"{module.__dict__['_compile_runtime'].config.mode.name}); the verifier needs "
                "CompilationMode.PIECEWISE or DYNAMO_TRACE_ONCE"
            )
        self.module = module
        self.graph_factory = graph_factory_of(module)  # None: CUDA graphs
        self.config: CompilationConfig = record.config
        self.split_gm: torch.fx.GraphModule = record.split_gm
        self.pieces: dict[str, Piece] = {p.name: p for p in record.pieces}
        self.runtimes: dict[int, PiecewiseRuntime] = {r.index: r for r in record.runtimes}
        self.coverage = piece_coverage(record.pieces, record.splitting_ops)
        self.shared = {r.index: r.shared_with for r in record.result.pieces}
        self.atol, self.rtol = atol, rtol
        wrapped = any(
            isinstance(self.split_gm.__dict__.get(p.name), CUDAGraphWrapper) for p in record.pieces
        )
        if check_graphs is None:
            check_graphs = wrapped
            if wrapped:
                self.graphs = "piecewise graphs on: each compiled piece captured and replayed"
            elif not graphs_available(self.graph_factory):
                self.graphs = "off (no CUDA device)"
            else:
                self.graphs = (
                    f"off (cudagraph_mode {self.config.cudagraph_mode.name} captures no "
                    "piecewise graphs of this model)"
                )
        elif check_graphs:
            if not graphs_available(self.graph_factory):
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
            graph_factory=self.graph_factory,
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
    module = _compiled_module(model)
    tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
    num_tokens = tensors[0].shape[0] if tensors else 0
    dtype = next(
        (p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype()
    )
    default_atol, default_rtol = tolerance_for(dtype)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol

    captured: list[tuple] = []
    with torch.no_grad(), _step_context(num_tokens):
        if not is_traced(module):
            trace_at_first_call(module)  # the FX split graph is needed, not a saved program
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
        with running_layers(module):  # the split graph's attention finds the model's layers
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
