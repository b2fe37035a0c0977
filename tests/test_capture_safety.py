"""Capture safety on the CPU: what would break a CUDA graph is found in the pieces' FX graphs.

Each small model holds one pattern that fails (or silently replays wrong) under CUDA
graphs; each must be flagged with its kind, and a clean model must not be. "Meant for
CUDA" is simulated by re-running a traced piece over FakeTensors on device cuda (they
need no GPU), with one tensor left on the CPU. The shipped models, native and through the
transformers adapter, must pass with no finding.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import compile_runtime as cr
from compile_runtime.attention.selector import load_backend
from compile_runtime.cli import check as verify_cli
from compile_runtime.cli.main import main
from compile_runtime.compiler import capture_safety as cs
from compile_runtime.compiler.decorator import compiled_model, set_graph_factory
from compile_runtime.config import AttentionCGSupport, CompilationConfig
from compile_runtime.verify.capture import (
    CaptureReport,
    check_capture,
    check_capture_model_dir,
    cudagraph_note,
)

EAGER = {"backend": "eager"}


def build(forward, *, config: dict | None = None, buffer: torch.Tensor | None = None):
    """A compiled toy model whose forward is ``forward(self, x)``."""

    @cr.compile
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.register_buffer("scale", torch.ones(8) if buffer is None else buffer)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return forward(self, x)

    with cr.set_compilation_config(CompilationConfig(**{**EAGER, **(config or {})})):
        return Toy()


def findings_of(forward) -> list[cs.Finding]:
    return check_capture(build(forward), torch.randn(5, 8)).findings


def kinds(findings: list[cs.Finding]) -> set[tuple[str, str]]:
    return {(f.kind, f.target) for f in findings}


def _mask_assign(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[y > 0] = 0.0
    return y


# ---- one pattern each ---------------------------------------------------------------

PATTERNS = {
    "item": (lambda s, x: s.lin(x) * x.sum().item(), cs.HOST_SYNC, "Tensor.item"),
    # Dynamo turns tolist into one item() per element.
    "tolist": (lambda s, x: x * x[0, :2].long().tolist()[0], cs.HOST_SYNC, "Tensor.item"),
    "nonzero": (lambda s, x: torch.nonzero(s.lin(x)), cs.DATA_SHAPE, "torch.nonzero"),
    "bool mask index": (lambda s, x: x[x > 0], cs.DATA_SHAPE, "operator.getitem"),
    "bool mask assign": (lambda s, x: _mask_assign(x), cs.HOST_SYNC, "operator.setitem"),
    "unique": (lambda s, x: torch.unique(x), cs.DATA_SHAPE, "torch.unique"),
    "repeat_interleave": (
        lambda s, x: torch.repeat_interleave(x, x[:, 0].long().abs(), dim=0),
        cs.DATA_SHAPE,
        "torch.repeat_interleave",
    ),
    "data-dependent alloc": (
        lambda s, x: torch.zeros(int(x.abs().sum()), device=x.device),
        cs.DATA_ALLOC,
        "torch.zeros",
    ),
    "default-device alloc": (lambda s, x: x + torch.zeros(8), cs.CPU_TENSOR, "torch.zeros"),
    "tensor from python data": (
        lambda s, x: x * torch.tensor([1.0, 2.0] * 4),
        cs.HOST_DATA,
        "torch.tensor",
    ),
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_each_pattern_is_flagged(name):
    forward, kind, target = PATTERNS[name]
    findings = findings_of(forward)
    assert (kind, target) in kinds(findings), findings
    found = next(f for f in findings if (f.kind, f.target) == (kind, target))
    assert found.piece == "submod_0" and found.node and found.why and found.fix


def test_data_dependent_alloc_also_names_its_host_sync():
    forward = PATTERNS["data-dependent alloc"][0]
    assert {f.kind for f in findings_of(forward)} == {cs.HOST_SYNC, cs.DATA_ALLOC}


@pytest.mark.parametrize(
    "forward, kind",
    [
        (lambda s, x: s.lin(x) if x.sum() > 0 else x, cs.DATA_BRANCH),  # Dynamo: graph break
        (lambda s, x: x * 2 if x.sum().item() > 0 else x, cs.DATA_BRANCH),  # guard on unbacked
        (lambda s, x: x * 2 if bool((x > 0).any()) else x, cs.DATA_BRANCH),
        (lambda s, x: x + len(x.sum(1).tolist()), cs.GRAPH_BREAK),  # float tolist: unsupported
    ],
    ids=["if tensor", "if item", "bool(tensor)", "float tolist"],
)
def test_a_trace_that_fails_is_a_finding(forward, kind):
    (finding,) = findings_of(forward)
    assert finding.kind == kind and finding.why and finding.fix


def test_a_clean_model_has_no_finding():
    report = check_capture(build(lambda s, x: (s.lin(x) * s.scale).relu()), torch.randn(5, 8))
    assert report.ok and report.findings == [] and report.pieces_checked == 1
    assert "OK: no finding" in report.format()


def test_an_aten_graph_is_read_the_same_way():
    """Graphs after decomposition (make_fx: aten ops, ``meta['val']``) hold the same hazards."""

    def forward(x):
        return torch.nonzero(x), x[x > 0], torch.zeros(x.long().sum().item())

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        gm = make_fx(forward, tracing_mode="symbolic")(torch.rand(4, 8))
    assert [(f.kind, f.target) for f in cs.check_graph(gm)] == [
        (cs.DATA_SHAPE, "aten.nonzero.default"),
        (cs.DATA_SHAPE, "aten.index.Tensor"),
        (cs.HOST_SYNC, "aten._local_scalar_dense.default"),
        (cs.DATA_ALLOC, "aten.zeros.default"),
    ]


# ---- CPU tensors in a region meant for CUDA -----------------------------------------


def as_cuda_piece(model: torch.nn.Module, keep_on_cpu: tuple[str, ...] = ()):
    """The model's traced piece with every value re-computed (in place) as a FakeTensor on
    cuda, except the placeholders named in ``keep_on_cpu`` (no GPU needed)."""
    (piece,) = [p for p in compiled_model(model).pieces if not p.is_splitting_op]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = []
    for node in piece.graph.graph.nodes:
        if node.op != "placeholder":
            continue
        value = cs.node_value(node)
        if not isinstance(value, torch.Tensor):
            args.append(8)  # the token count
            continue
        device = "cpu" if any(k in node.name for k in keep_on_cpu) else "cuda"
        with mode:
            args.append(torch.empty(tuple(int(d) for d in value.shape) or (), device=device))
    FakeTensorProp(piece.graph, mode).propagate(*args)
    return piece.graph


def traced(forward, x: torch.Tensor | None = None) -> torch.nn.Module:
    model = build(forward)
    check_capture(model, torch.randn(8, 8) if x is None else x)
    return model


class CopiesItsBuffer(torch.nn.Module):
    """A buffer left on the CPU, copied to the input's device on every call."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to(x.device)


def test_a_cpu_buffer_in_a_cuda_graph_is_flagged():
    # Dynamo drops .to(x.device) on a CPU run, so this graph is traced by torch.fx.
    gm = torch.fx.symbolic_trace(CopiesItsBuffer())
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        x = torch.empty(4, 8, device="cuda")
    FakeTensorProp(gm, mode).propagate(x)
    assert cs.graph_device(gm).type == "cuda"
    findings = cs.check_graph(gm)
    assert [(f.kind, f.node) for f in findings] == [(cs.CPU_TENSOR, "scale")]
    assert "CPU input, parameter, buffer or constant in a cuda graph" in findings[0].why
    assert cs.check_graph(gm, device="cpu") == []  # meant for the CPU: fine


def test_a_traced_piece_all_on_cuda_is_clean():
    model = traced(lambda s, x: (s.lin(x) * s.scale).relu())
    gm = as_cuda_piece(model)
    assert cs.graph_device(gm).type == "cuda" and cs.check_graph(gm) == []


def test_a_cpu_scalar_says_its_value_is_baked_in():
    model = build(lambda s, x: s.lin(x) * s.scale, buffer=torch.tensor(2.0))
    check_capture(model, torch.randn(8, 8))
    (finding,) = cs.check_graph(as_cuda_piece(model, keep_on_cpu=("scale",)))
    assert finding.kind == cs.CPU_TENSOR and "baked in" in finding.why


def test_a_copy_to_the_cpu_is_flagged_where_it_starts():
    model = traced(lambda s, x: (s.lin(x).cpu() * 2).sum())
    assert cs.check_graph(compiled_model(model).pieces[0].graph) == []  # on a CPU: fine
    findings = cs.check_graph(as_cuda_piece(model))
    assert [(f.kind, f.target) for f in findings] == [(cs.CPU_TENSOR, "Tensor.cpu")]
    assert "device->host" in findings[0].why  # the `* 2` and `sum` after it: not again


# ---- the compile-time hook and the mode -----------------------------------------------


class StandIn:
    """A graph factory standing in for CUDA: the compiler treats graphs as meant."""

    def new_graph(self):
        raise AssertionError("nothing is captured in these tests")

    def pool(self):
        return None


@pytest.mark.parametrize("cudagraph_mode, warned", [("PIECEWISE", True), ("NONE", False)])
def test_the_compiler_warns_when_graphs_are_meant(caplog, cudagraph_mode, warned):
    model = build(lambda s, x: s.lin(x) * x.sum().item(), config={"cudagraph_mode": cudagraph_mode})
    set_graph_factory(model, StandIn())
    with caplog.at_level(logging.WARNING, "compile_runtime.compiler.capture_safety"):
        with cr.set_forward_context(None, num_tokens=5), torch.no_grad():
            model(torch.randn(5, 8))
    lines = [r.getMessage() for r in caplog.records if "capture safety" in r.getMessage()]
    assert bool(lines) is warned
    if warned:
        assert "host-sync at item (Tensor.item)" in lines[0]


def test_no_warning_on_a_cpu_run_without_graphs(caplog):
    with caplog.at_level(logging.WARNING, "compile_runtime.compiler.capture_safety"):
        traced(lambda s, x: s.lin(x) * x.sum().item())
    assert not [r for r in caplog.records if "capture safety" in r.getMessage()]


def test_cudagraph_note_against_the_declared_support():
    never = load_backend("torch_native")
    assert never.cg_support == AttentionCGSupport.NEVER
    line, findings = cudagraph_note(CompilationConfig(), [never], attention_split=True)
    assert "FULL_AND_PIECEWISE -> PIECEWISE" in line and "torch_native (NEVER)" in line
    assert findings == []
    explicit = CompilationConfig(cudagraph_mode="FULL")
    line, (finding,) = cudagraph_note(explicit, [never], attention_split=False)
    assert finding.kind == cs.CUDAGRAPH_MODE and finding.fix.startswith("Set cudagraph_mode")


# ---- the shipped models and the CLI ---------------------------------------------------


@pytest.mark.parametrize(
    "arch, use_transformers",
    [
        ("llama", False),
        ("mistral", False),
        ("qwen2", False),
        ("qwen3", False),
        ("llama", True),
        ("gemma2", False),  # no native model: the adapter
    ],
)
def test_shipped_models_have_no_finding(model_dirs, arch, use_transformers):
    report = check_capture_model_dir(
        model_dirs(arch), EAGER, num_tokens=7, use_transformers=use_transformers
    )
    assert report.findings == [], report.format()
    assert report.pieces_checked == 3  # two layers: attention split out of three pieces
    assert report.model == (
        "TransformersBody" if use_transformers or arch == "gemma2" else "DecoderModel"
    )
    assert "-> PIECEWISE on CUDA" in report.cudagraphs


def test_cli_prints_the_report_and_exits_by_it(model_dirs, capsys, monkeypatch):
    argv = ["check", "--capture-safety", "--model", model_dirs("llama"), "-O", json.dumps(EAGER)]
    assert main([*argv, "--use-transformers"]) == 0
    assert "OK: no finding" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["findings"] == [] and data["pieces_checked"] == 3

    bad = CaptureReport("Toy", "cpu", "PIECEWISE", 1, "n/a")
    bad.findings.append(
        cs.Finding(cs.HOST_SYNC, "item", "Tensor.item", "a sync", "no sync", "submod_0")
    )
    monkeypatch.setattr(verify_cli, "check_capture_model_dir", lambda *a, **k: bad)
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "| submod_0 | item | host-sync | Tensor.item |" in out and "1 finding(s)" in out


def test_cli_refuses_an_uncompiled_model(model_dirs, capsys):
    argv = ["check", "--capture-safety", "--model", model_dirs("llama"), "-O", '{"mode": "NONE"}']
    assert main(argv) == 2
    assert "CompilationMode" in capsys.readouterr().err
