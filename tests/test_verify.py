"""The piece-by-piece verifier: a wrong compiled piece is caught at that piece, a right model passes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from compile_runtime.backends.compiler import CompiledPiece, EagerAdaptor
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils._pytree import tree_leaves

import compile_runtime as cr
import compile_runtime.compiler.graph_compiler as backend_module
from compile_runtime.cli.main import main
from compile_runtime.compiler.decorator import set_graph_factory
from compile_runtime.verify.compare import VerifyError, compare, tolerance_for
from compile_runtime.verify.model_dir import check_model_dir
from compile_runtime.verify.verifier import verify_model
from testing.transformer import build_transformer

# No piecewise graphs: these models stay on the CPU, and on a CUDA machine the pieces would
# otherwise be wrapped and "captured" with no GPU work in them.
EAGER = cr.CompilationConfig(backend="eager", disable_cache=True, cudagraph_mode="NONE")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def batch(n: int = 7, vocab: int = 128):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)), torch.arange(
        n
    )


def compiled(report):
    return [p for p in report.pieces if p.kind == "compiled"]


# ---- a deliberately wrong Inductor pass, registered only here ---------------------------


def _has(graph: torch.fx.Graph, op) -> bool:
    return any(n.op == "call_function" and n.target is op for n in graph.nodes)


class SwapSinCosInLayerPieces(CustomGraphPass):
    """Swaps sin and cos in pieces that have rotary but no embedding: the decoder-layer pieces."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        if _has(graph, aten.embedding.default):
            return
        for node in graph.nodes:
            if node.op == "call_function" and node.target is aten.sin.default:
                node.target = aten.cos.default
            elif node.op == "call_function" and node.target is aten.cos.default:
                node.target = aten.sin.default

    def uuid(self) -> str:
        return "test-verify-swap-sin-cos"


@pytest.mark.slow
def test_wrong_post_grad_pass_is_caught_at_the_first_piece_it_touches():
    config = cr.CompilationConfig(
        backend="inductor",
        disable_cache=True,
        inductor_compile_config={"post_grad_custom_post_pass": SwapSinCosInLayerPieces()},
    )
    model = build_transformer(config, num_layers=3)
    report = verify_model(model, *batch())
    assert not report.ok
    # Pieces: 0 embed+layer 0 qkv (untouched), 2 and 4 decoder layers (swapped; 4 reuses
    # 2's code), 6 last layer + norm (no rotary: untouched).
    assert report.first_failure.index == 2
    assert report.first_failure.covers == "layer 0 (after attention) .. layer 1 (before attention)"
    assert [(p.index, p.ok) for p in compiled(report)] == [
        (0, True),
        (2, False),
        (4, False),
        (6, True),
    ]
    assert report.end_to_end_max_abs > 1e-2
    assert "FIRST FAILURE: piece 2" in report.format()


@pytest.mark.slow
def test_correct_inductor_model_passes_within_float32_tolerance():
    model = build_transformer(cr.CompilationConfig(backend="inductor", disable_cache=True))
    report = verify_model(model.to(DEVICE), *(t.to(DEVICE) for t in batch()))
    assert report.ok, report.format()
    assert [p.kind for p in report.pieces] == ["compiled", "splitting op"] * 2 + ["compiled"]
    assert all(0 <= p.max_abs <= 1e-4 for p in compiled(report))
    assert report.end_to_end_max_abs < 1e-4
    assert (report.atol, report.rtol) == (1e-4, 1e-4)
    if CUDA:  # the default FULL_AND_PIECEWISE wraps every piece: replays are compared too
        assert report.graphs == "piecewise graphs on: each compiled piece captured and replayed"
        assert all(p.graph_ok and p.graph_max_abs <= 1e-4 for p in compiled(report))
    else:
        assert report.graphs == "off (no CUDA device)"
        assert all(p.graph_max_abs is None for p in compiled(report))


# ---- the eager adaptor, wrapped to go wrong (fast) ------------------------------------


class OffByOneAdaptor(EagerAdaptor):
    """Eager pieces, except pieces listed by index add 1 to their first output."""

    def __init__(self, bad: set[int]):
        self.bad = bad
        self.count = 0

    def compile(self, graph, example_inputs, runtime_shape):
        index, self.count = self.count, self.count + 1
        if index not in self.bad:
            return super().compile(graph, example_inputs, runtime_shape)

        def wrong(*args):
            out = graph(*args)
            first = out[0] if isinstance(out, tuple) else out
            first.add_(1.0)
            return out

        return CompiledPiece(fn=wrong, handle=None)


@pytest.fixture
def wrong_compile(monkeypatch):
    """Makes the n-th compiled (unique) piece of the next model wrong."""

    def make(*bad: int) -> None:
        adaptor = OffByOneAdaptor(set(bad))
        monkeypatch.setattr(backend_module, "make_adaptor", lambda *a, **k: adaptor)

    return make


def test_eager_model_passes_and_pieces_say_which_layers_they_cover():
    report = verify_model(build_transformer(EAGER, num_layers=2), *batch())
    assert report.ok and report.first_failure is None
    assert [p.max_abs for p in compiled(report)] == [0.0, 0.0, 0.0]
    assert [p.covers for p in report.pieces] == [
        "input .. layer 0 (before attention)",
        "layer 0 attention",
        "layer 0 (after attention) .. layer 1 (before attention)",
        "layer 1 attention",
        "layer 1 (after attention) .. output",
    ]
    assert "OK: all 3 compiled pieces within tolerance" in report.format()
    data = report.to_dict()
    assert data["ok"] and data["first_failure"] is None and len(data["pieces"]) == 5


def test_a_wrong_last_piece_is_the_first_failure(wrong_compile):
    wrong_compile(2)  # unique pieces: 0 (first), 1 (layer, shared), 2 (last)
    report = verify_model(build_transformer(EAGER, num_layers=3), *batch())
    assert [(p.index, p.ok) for p in compiled(report)] == [
        (0, True),
        (2, True),
        (4, True),
        (6, False),
    ]
    assert report.first_failure.index == 6
    assert report.first_failure.max_abs == pytest.approx(1.0, rel=1e-5)


def test_shared_layer_code_fails_at_its_first_use(wrong_compile):
    wrong_compile(1)
    report = verify_model(build_transformer(EAGER, num_layers=3), *batch())
    assert [p.index for p in compiled(report) if not p.ok] == [2, 4]
    assert report.pieces[4].shared_with == 2
    assert report.first_failure.index == 2


def test_tolerance_follows_the_model_dtype(model_dirs):
    report = check_model_dir(model_dirs("llama"), EAGER, dtype=torch.bfloat16)
    assert report.ok and report.dtype == "bfloat16"
    assert (report.atol, report.rtol) == tolerance_for(torch.bfloat16)
    assert tolerance_for(torch.bfloat16)[1] > tolerance_for(torch.float32)[1]
    strict = check_model_dir(model_dirs("llama"), EAGER, atol=0.0, rtol=0.0)
    assert (strict.atol, strict.rtol) == (0.0, 0.0) and strict.ok  # eager pieces are exact


def test_dynamo_trace_once_is_one_piece_covering_the_whole_model():
    config = EAGER.model_copy(update={"mode": cr.CompilationMode.DYNAMO_TRACE_ONCE})
    report = verify_model(build_transformer(config), *batch())
    assert [(p.kind, p.covers) for p in report.pieces] == [("compiled", "whole model")]
    assert report.ok


def test_models_without_a_split_graph_are_refused():
    with pytest.raises(VerifyError, match="CompilationMode"):
        verify_model(build_transformer(cr.CompilationConfig(mode="NONE")), *batch())


# ---- graph replay vs the same piece without a graph (CPU double) ----------------------


class RerunGraph:
    """Stands in for a CUDA graph: a replay reruns the captured work into the same outputs."""

    def __init__(self, bias: float):
        self.bias = bias

    def capture(self, fn, pool):
        self.fn = fn
        self.outputs = fn()
        return self.outputs

    def replay(self):
        for kept, new in zip(tree_leaves(self.outputs), tree_leaves(self.fn()), strict=True):
            kept.copy_(new + self.bias)


class RerunFactory:
    def __init__(self, bias: float = 0.0):
        self.bias = bias

    def new_graph(self):
        return RerunGraph(self.bias)

    def pool(self):
        return None


@pytest.mark.parametrize("bias, ok", [(0.0, True), (0.5, False)])
def test_graph_replays_are_compared_with_the_piece_without_a_graph(bias, ok):
    model = build_transformer(EAGER, num_layers=2)
    set_graph_factory(model, RerunFactory(bias))
    report = verify_model(model, *batch(), check_graphs=True)
    assert all(p.graph_max_abs is not None for p in compiled(report))
    assert report.ok is ok
    assert all(p.ok for p in compiled(report))  # without graphs every piece is right
    if not ok:
        assert report.first_failure.index == 0 and report.first_failure.graph_ok is False
        assert "graph replay differs" in report.format()


def test_compare_handles_nan_shape_and_structure():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert compare(a, a.clone()).max_abs == 0.0
    inf = torch.tensor([float("inf"), -float("inf"), 1.0])
    assert compare(inf, inf.clone()).max_abs == 0.0  # equal infinities agree
    assert math.isinf(compare(inf, torch.ones(3)).max_abs)
    assert math.isinf(compare(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])).max_abs)
    assert "shape" in compare(torch.zeros(2), torch.zeros(3)).note
    assert "outputs" in compare((torch.zeros(1),), (torch.zeros(1), torch.zeros(1))).note
    assert compare([torch.ones(2)], (torch.ones(2),)).max_abs == 0.0  # list vs tuple
    assert compare(torch.ones(2) * 2.5, torch.ones(2) * 2).max_rel == pytest.approx(0.25)


# ---- model directories and the CLI -------------------------------------------------------


def test_check_model_dir_llama_eager(model_dirs):
    report = check_model_dir(model_dirs("llama"), {"backend": "eager"}, num_tokens=9)
    assert report.ok and report.num_tokens == 9
    assert report.pieces[0].covers == "input .. layer 0 (before attention)"
    assert report.pieces[-1].covers.endswith(".. output")


def test_check_cli_prints_table_and_exits_by_result(model_dirs, capsys, wrong_compile):
    model = model_dirs("llama")
    argv = ["check", "--model", model, "-O", '{"backend": "eager", "disable_cache": true}']
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| piece |" in out and "OK: all" in out
    if CUDA:  # the model loads onto the GPU and its pieces are captured and replayed
        assert "CUDA graphs: piecewise graphs on" in out and f"on {DEVICE}" in out
    else:
        assert "CUDA graphs: off (no CUDA device)" in out and "on cpu" in out

    wrong_compile(0)
    assert main([*argv, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["first_failure"] == 0


def exit_status(argv: list[str]) -> int:
    """argparse exits; errors found after parsing come back as main's return value."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "--model", "/nonexistent/model"], "does not exist; pass a model directory"),
        (["check", "--model", "M", "--tokens", "0"], "--tokens"),
        (["check"], "--model"),
    ],
)
def test_check_cli_bad_arguments_exit_2(argv, message, capsys):
    assert exit_status(argv) == 2
    assert message in capsys.readouterr().err


def test_check_cli_refuses_an_uncompiled_model(model_dirs, capsys):
    assert exit_status(["check", "--model", model_dirs("llama"), "-O", '{"mode": "NONE"}']) == 2
    assert "CompilationMode" in capsys.readouterr().err
