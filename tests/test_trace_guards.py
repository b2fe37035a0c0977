"""What one trace cannot see: None-or-tensor arguments, and splitting ops that split nothing."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import compile_runtime as cr
from compile_runtime.compiler.compiled_forward import TracedArgumentError
from compile_runtime.compiler.decorator import attention_split, compiled_model, set_graph_factory
from compile_runtime.compiler.split import SplittingOpError
from compile_runtime.config import CudagraphModeError
from compile_runtime.graphs.wrapper import CUDAGraphWrapper
from testing.toy import build

counter = cr.compilation_counter
EAGER = cr.CompilationConfig(backend="eager")
S, M = cr.AttentionCGSupport, cr.CUDAGraphMode


@cr.compile
class WithBias(nn.Module):
    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = x * 2
        if bias is not None:
            out = out + bias
        if scale is not None:
            out = out * scale
        return out


def with_bias() -> WithBias:
    with cr.set_compilation_config(EAGER):
        return WithBias()


X, B = torch.ones(3), torch.full((3,), 10.0)


@pytest.mark.parametrize(
    "later",
    [lambda m: m(X, B), lambda m: m(X, bias=B), lambda m: m(x=X, bias=B)],
    ids=["positional", "keyword", "all-keyword"],
)
def test_none_at_trace_then_tensor_is_an_error_naming_the_argument(later):
    model = with_bias()
    assert torch.equal(model(X), 2 * X)
    with pytest.raises(TracedArgumentError, match="traced with bias as None, but this call passes"):
        later(model)  # without the check: 2 * X, the bias silently dropped


@pytest.mark.parametrize(
    "later",
    [lambda m: m(X), lambda m: m(X, None), lambda m: m(x=X, bias=None)],
    ids=["omitted", "positional", "keyword"],
)
def test_tensor_at_trace_then_none_is_an_error_naming_the_argument(later):
    model = with_bias()
    assert torch.equal(model(X, bias=B), 2 * X + B)
    with pytest.raises(TracedArgumentError, match="traced with bias as a tensor, but this call"):
        later(model)


def test_keyword_only_argument_is_checked_too():
    model = with_bias()
    model(X, scale=B)
    with pytest.raises(TracedArgumentError, match="traced with scale as a tensor"):
        model(X)


def test_same_pattern_positional_or_keyword_runs_the_trace():
    model = with_bias()
    model(X, bias=B)
    with counter.expect(num_graphs_seen=0):
        for n in (1, 5, 8):
            x, b = torch.arange(n, dtype=torch.float), torch.ones(n)
            expected = WithBias.forward(model, x, b)
            assert torch.equal(model(x, b), expected)
            assert torch.equal(model(x=x, bias=b), expected)
    with pytest.raises(TypeError, match="required positional argument: 'x'"):
        model(bias=B)  # a missing argument stays Python's own error


@pytest.mark.parametrize(
    "name, hint",
    [
        ("compile_runtime.attention", "did you mean 'compile_runtime::attention'"),
        ("aten::no_such_op", "register custom ops before the first forward"),
        ("compile_runtime::attention.no_such_overload", "namespace::op.overload"),
    ],
)
def test_unknown_splitting_op_is_an_error_naming_it(name, hint):
    model = build(EAGER.model_copy(update={"splitting_ops": [name]}), num_layers=1)
    with pytest.raises(SplittingOpError) as info:
        model(torch.arange(3))
    message = str(info.value)
    assert repr(name) in message and hint in message
    assert "['compile_runtime::attention']" in message  # the known splitting ops


def test_overload_qualified_splitting_op_splits():
    model = build(
        EAGER.model_copy(update={"splitting_ops": ["compile_runtime::attention.default"]})
    )
    with counter.expect(num_piecewise_graphs_seen=7, num_piecewise_capturable_graphs_seen=4):
        model(torch.arange(3))
    assert attention_split(model) is True


def test_splitting_op_matching_nothing_gets_no_piecewise_graphs(caplog):
    config = EAGER.model_copy(update={"splitting_ops": ["aten::mm"]})  # never in a Dynamo graph
    ref = build(cr.CompilationConfig(mode="NONE"))
    model = build(config)
    split = build(EAGER.model_copy(update={"splitting_ops": None}))
    for m in (model, split):  # graphs "available": the backend would wrap pieces
        set_graph_factory(m, object())
    assert attention_split(model) is None  # not traced yet
    with caplog.at_level(logging.WARNING, logger="compile_runtime.compiler.graph_compiler"):
        with counter.expect(num_piecewise_graphs_seen=1):
            assert torch.equal(model(torch.arange(5)), ref(torch.arange(5)))
    split(torch.arange(5))
    assert "splitting_ops ['aten::mm'] match no op in the graph" in caplog.text

    # The one piece holds attention: it is never wrapped for a piecewise graph.
    wrapped = [
        v
        for m in (model, split)
        for v in compiled_model(m).split_gm.__dict__.values()
        if isinstance(v, CUDAGraphWrapper)
    ]
    assert len(wrapped) == 4  # the split model's 4 static pieces, none of the unsplit one

    # Resolution from what the split produced: no PIECEWISE anywhere for the unsplit model.
    def resolve(cfg, support, model):
        return cfg.resolve(support, attention_split=attention_split(model), cuda_available=True)

    assert attention_split(model) is False and attention_split(split) is True
    assert resolve(config, S.ALWAYS, model).cudagraph_mode == M.FULL
    assert resolve(config, S.ALWAYS, split).cudagraph_mode == M.FULL_AND_PIECEWISE
    assert resolve(config, S.UNIFORM_BATCH, model).cudagraph_mode == M.FULL_DECODE_ONLY
    assert resolve(config, S.NEVER, split).cudagraph_mode == M.PIECEWISE
    assert resolve(config, S.NEVER, model).cudagraph_mode == M.NONE  # default mode: downgraded
    explicit = cr.CompilationConfig(
        backend="eager", splitting_ops=["aten::mm"], cudagraph_mode="PIECEWISE"
    )
    with pytest.raises(CudagraphModeError, match="no splitting-op pieces"):
        resolve(explicit, S.NEVER, model)


@pytest.mark.cuda
def test_runner_resolves_cudagraph_mode_from_the_split(model_dirs):
    """The runner resolves the mode once, after the trace: the split decides."""
    from compile_runtime.config import RunnerConfig
    from compile_runtime.models.registry import read_hf_config
    from compile_runtime.worker.kv_sizing import size_runner_config
    from compile_runtime.worker.model_runner import ModelRunner

    config = cr.CompilationConfig(
        backend="eager", splitting_ops=["aten::mm"], cudagraph_mode="PIECEWISE"
    )
    sizes = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64)  # a runner decides none
    sizes = size_runner_config(sizes, read_hf_config(model_dirs("llama")), torch.float32, "cuda")
    runner = ModelRunner(model_dirs("llama"), config, sizes, capture_sizes=None)
    assert runner.cudagraph_plan is None  # resolved once, after the first forward shows the split
    with pytest.raises(CudagraphModeError, match="no splitting-op pieces"):
        runner.initialize()
