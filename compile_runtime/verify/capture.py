"""``check_capture``: would this model's CUDA graphs capture and replay right? Checked on any
device (``compile-runtime check --capture-safety``).

It traces the model once (a trace that fails, a graph break or a branch on a tensor
value, is a finding), reads every static piece with ``compiler/capture_safety.py``, and
says what cudagraph mode the attention backends' declared support leaves on a GPU. A
model directory is loaded without the CPU's packed linear weights, so its pieces are the
ones a GPU run traces.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from compile_runtime.attention.layer import attention_layers
from compile_runtime.compiler.capture_safety import (
    CUDAGRAPH_MODE,
    DATA_BRANCH,
    GRAPH_BREAK,
    Finding,
    check_pieces,
)
from compile_runtime.compiler.compiled_forward import GraphBreakError
from compile_runtime.compiler.decorator import (
    attention_split,
    compiled_model,
    find_compiled_module,
    is_traced,
    trace_at_first_call,
)
from compile_runtime.config import (
    AttentionCGSupport,
    CompilationConfig,
    CudagraphModeError,
    parse_config,
)
from compile_runtime.counters import compilation_counter
from compile_runtime.device import resolve_device
from compile_runtime.forward_context import is_forward_context_available, set_forward_context
from compile_runtime.models.registry import load_model
from compile_runtime.platforms.select import platform_for
from compile_runtime.table import format_table
from compile_runtime.torch_internals import trace_errors
from compile_runtime.verify.compare import VerifyError
from compile_runtime.verify.model_dir import require_model_dir

# What a failed trace raises: our graph-break error, Dynamo's own (a data-dependent guard
# is a UserError), and the shape checks' errors (a size the code made constant).
TRACE_ERRORS = (GraphBreakError, *trace_errors())


@dataclass
class CaptureReport:
    model: str
    device: str
    mode: str  # the CompilationMode
    pieces_checked: int = 0
    cudagraphs: str = ""  # the mode on a GPU against the attention backends, one line
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "mode": self.mode,
            "pieces_checked": self.pieces_checked,
            "cudagraphs": self.cudagraphs,
            "findings": [f.to_dict() for f in self.findings],
            "ok": self.ok,
        }

    def format(self) -> str:
        lines = [
            f"capture safety of {self.model} ({self.mode}, traced on {self.device}): "
            f"{self.pieces_checked} static piece(s) checked",
            f"CUDA graphs (attention backends as built on {self.device}): {self.cudagraphs}",
        ]
        if not platform_for(self.device).stages_inputs:  # every tensor is a host tensor
            lines.append(
                "CPU tensors are found by their device on a GPU only (--device cuda); here: "
                "allocations on the default device and tensors built from Python data"
            )
        if self.ok:
            lines.append("OK: no finding")
            return "\n".join(lines)
        rows = [
            [f.piece or "-", f.node or "-", f.kind, f.target, f.why, f.fix] for f in self.findings
        ]
        lines += ["", format_table(["piece", "node", "kind", "op", "why", "fix"], rows), ""]
        lines.append(f"{len(self.findings)} finding(s)")
        return "\n".join(lines)


def check_capture(
    model: torch.nn.Module, *args: Any, device: torch.device | str | None = None, **kwargs: Any
) -> CaptureReport:
    """Trace ``model`` on the batch ``args`` (if not traced yet) and check its pieces.

    ``model``: a module built with ``@compile_runtime.compile`` (or one that holds it);
    ``device``: the device its graphs are meant for (None: the device of the batch).
    """
    module = find_compiled_module(model)
    if module is None:
        raise VerifyError(
            f"{type(model).__name__} has no module compiled by @compile_runtime.compile (built "
            "with CompilationMode.NONE, or not decorated); build it under a CompilationConfig "
            "with mode PIECEWISE (or DYNAMO_TRACE_ONCE) to check it"
        )
    config: CompilationConfig = module.__dict__["_compile_runtime"].config
    tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    report = CaptureReport(type(module).__name__, str(device), config.mode.name)
    if not is_traced(module):
        trace_at_first_call(module)  # the FX pieces are needed, not a saved program
        before = compilation_counter.num_graphs_seen
        try:
            _first_call(module, tensors[0].shape[0] if tensors else 0, *args, **kwargs)
        except TRACE_ERRORS as e:
            report.findings.append(trace_finding(e))
            return report
        graphs = compilation_counter.num_graphs_seen - before
        if graphs > 1:
            report.findings.append(
                Finding(
                    GRAPH_BREAK,
                    "",
                    "torch.compile",
                    f"the forward reached the backend as {graphs} graphs (graph breaks)",
                    "run with fullgraph tracing (CompilationMode.PIECEWISE) to see where",
                )
            )
    record = compiled_model(module)
    if record is None:
        raise VerifyError(
            f"{type(module).__name__} has no split graph (CompilationMode {config.mode.name}); "
            "the capture check needs CompilationMode.PIECEWISE or DYNAMO_TRACE_ONCE"
        )
    report.pieces_checked = sum(not p.is_splitting_op for p in record.pieces)
    report.findings += check_pieces(record.pieces, device)
    backends = {layer.attn_backend for layer in attention_layers(module)}
    report.cudagraphs, mode_findings = cudagraph_note(
        config, backends, bool(attention_split(module))
    )
    report.findings += mode_findings
    return report


def trace_finding(error: BaseException) -> Finding:
    """A trace that failed (``GraphBreakError``, Dynamo's data-dependent guard) as a finding."""
    text = str(error).strip().split("Dynamo stopped at:")[-1].strip()  # our error's wrapping
    first = text.splitlines()[0] if text else type(error).__name__
    lowered = text.lower()
    if "data-dependent" in lowered or "data dependent" in lowered:
        return Finding(
            DATA_BRANCH,
            "",
            type(error).__name__,
            f"Python control flow on a tensor value cannot be one graph: {first}",
            "branch on the device (torch.where, masking) or decide in the runner and pass the "
            "result in; a torch._check(...) can tell the tracer a bound it cannot see",
        )
    return Finding(
        GRAPH_BREAK,
        "",
        type(error).__name__,
        "the forward cannot be traced as one graph for every token count, which FULL and "
        f"PIECEWISE capture need: {first}",
        "move the offending code out of forward, or make it a custom op",
    )


def cudagraph_note(
    config: CompilationConfig,
    backends: Iterable[Any],
    attention_split: bool,
    uniform_decode_query_len: int = 1,
) -> tuple[str, list[Finding]]:
    """The mode ``config`` resolves to on a GPU against the declared support of ``backends``
    (attention backend classes, each with ``name`` and ``cg_support``), as one line; a
    finding when an explicit request cannot run at all."""
    backends = sorted(set(backends), key=lambda b: b.name)
    support = min((b.cg_support for b in backends), default=AttentionCGSupport.ALWAYS)
    declared = ", ".join(f"{b.name} ({b.cg_support.name})" for b in backends) or "none"
    requested = config.cudagraph_mode
    try:
        resolved = config.resolve(
            support,
            attention_split=attention_split,
            uniform_decode_query_len=uniform_decode_query_len,
            cuda_available=True,
        ).cudagraph_mode
    except CudagraphModeError as e:
        why, _, fix = str(e).partition(". Set ")
        finding = Finding(CUDAGRAPH_MODE, "", requested.name, why, "Set " + fix)
        return f"cudagraph_mode {requested.name}: no graph can run ({declared})", [finding]
    line = f"cudagraph_mode {requested.name} -> {resolved.name} on CUDA; attention: {declared}"
    return line, []


def _first_call(module: torch.nn.Module, num_tokens: int, *args: Any, **kwargs: Any) -> None:
    with torch.no_grad():
        if is_forward_context_available():
            module(*args, **kwargs)
            return
        with set_forward_context(None, num_tokens=num_tokens):
            module(*args, **kwargs)


def check_capture_model_dir(
    model_dir: str,
    config: CompilationConfig | dict | str | None = None,
    *,
    num_tokens: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    use_transformers: bool = False,
) -> CaptureReport:
    """Load ``model_dir`` under ``config`` and check its capture safety on one batch."""
    config = parse_config(config)
    require_model_dir(model_dir)
    device = resolve_device(device)
    model = load_model(
        model_dir,
        config,
        dtype=dtype,
        device=device,
        use_transformers=use_transformers,
        cpu_pack_weights=False,  # the pieces a GPU run traces
    )
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 100)
    input_ids = torch.randint(0, vocab, (num_tokens,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(num_tokens, device=device)
    return check_capture(model.model, input_ids.to(device), positions, device=device)
