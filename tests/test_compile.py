"""The compiler with the eager adaptor: one trace, the split, dedup, dispatch, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import compile_runtime as cr
from compile_runtime.compiler.decorator import compiled_model
from compile_runtime.compiler.piecewise import PiecewiseRuntime
from testing.toy import ToyModel, build

counter = cr.compilation_counter
EAGER = cr.CompilationConfig(backend="eager")


def ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_layers", [1, 3, 5])
def test_one_trace_split_counts_and_bitwise_equal(num_layers):
    config = EAGER.model_copy(update={"compile_sizes": [4, 8]})
    ref = build(cr.CompilationConfig(mode="NONE"), num_layers=num_layers)
    model = build(config, num_layers=num_layers)
    # Unique pieces: the first piece (embedding + layer 0 qkv), the middle piece
    # shared by every layer boundary, and the last (final out + norm). With one
    # layer there is no middle piece.
    unique = 2 if num_layers == 1 else 3
    with counter.expect(
        num_graphs_seen=1,
        num_piecewise_graphs_seen=2 * num_layers + 1,
        num_piecewise_capturable_graphs_seen=num_layers + 1,
        num_backend_compilations=unique * (1 + 2),
        num_eager_compiles=unique * 3,
        num_inductor_compiles=0,
    ):
        out = model(ids(6))
    assert torch.equal(out, ref(ids(6)))


def test_twenty_token_counts_no_new_trace_or_compile():
    ref = build(cr.CompilationConfig(mode="NONE"))
    model = build(EAGER.model_copy(update={"compile_sizes": [4]}))
    model(ids(7))
    # Later calls run Dynamo's bytecode directly, bypassing torch.compile's frame hook.
    assert model._compile_runtime.direct is not None
    with counter.expect(num_graphs_seen=0, num_backend_compilations=0, num_eager_compiles=0):
        for n in [1, 2, 3, 4, 5, 8, 9, 13, 16, 17, 31, 32, 33, 50, 64, 100, 127, 128, 200, 257]:
            assert torch.equal(model(ids(n, seed=n)), ref(ids(n, seed=n))), n


def test_first_call_at_size_one_is_not_specialised():
    ref = build(cr.CompilationConfig(mode="NONE"))
    model = build(EAGER)
    model(ids(1))
    with counter.expect(num_graphs_seen=0):
        assert torch.equal(model(ids(9)), ref(ids(9)))


def test_piece_dispatch_uses_exact_size_callable():
    model = build(EAGER.model_copy(update={"compile_sizes": [4]}))
    model(ids(5))
    runtimes = compiled_model(model).runtimes
    assert len(runtimes) == 4 and all(isinstance(r, PiecewiseRuntime) for r in runtimes)
    first = runtimes[0]
    assert first.callable_for(4) is first.exact[4] and first.callable_for(5) is first.general
    # Layers share compiled code: the middle pieces point at the same callables.
    assert runtimes[1].general is runtimes[2].general
    assert runtimes[0].general is not runtimes[1].general


def test_dynamo_trace_once_does_not_split():
    model = build(cr.CompilationConfig(mode="DYNAMO_TRACE_ONCE", backend="eager"))
    with counter.expect(num_graphs_seen=1, num_piecewise_graphs_seen=1, num_backend_compilations=1):
        model(ids(5))
    with counter.expect(num_graphs_seen=0):
        model(ids(11))


def test_empty_splitting_ops_gives_one_piece():
    model = build(EAGER.model_copy(update={"splitting_ops": []}))
    with counter.expect(num_piecewise_graphs_seen=1, num_piecewise_capturable_graphs_seen=1):
        model(ids(5))


def test_mode_none_runs_eager_and_stock_keeps_guards():
    with counter.expect(num_models_seen=0, num_graphs_seen=0):
        model = build(cr.CompilationConfig(mode="NONE"))
        model(ids(3))
    assert model._compile_runtime is None
    ref = build(cr.CompilationConfig(mode="NONE"))
    stock = build(cr.CompilationConfig(mode="STOCK_TORCH_COMPILE", backend="eager"))
    with counter.expect(num_models_seen=0, num_graphs_seen=0):  # our backend is not involved
        for n in (3, 4, 5):
            assert torch.equal(stock(ids(n)), ref(ids(n)))


def test_ignored_subclass_and_enable_if_run_eager():
    @cr.ignore_compile
    class Plain(ToyModel):
        pass

    with cr.set_compilation_config(EAGER), counter.expect(num_models_seen=0, num_graphs_seen=0):
        model = Plain(num_layers=1)
        model(ids(3))
    assert model._compile_runtime is None

    @cr.compile(enable_if=lambda config: config.backend == "inductor")
    class OnlyInductor(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    with cr.set_compilation_config(EAGER), counter.expect(num_models_seen=0, num_graphs_seen=0):
        assert torch.equal(OnlyInductor()(torch.ones(3)), torch.full((3,), 2.0))


def test_config_is_the_one_active_at_construction():
    with cr.set_compilation_config(cr.CompilationConfig(mode="NONE")):
        model = ToyModel(num_layers=1)
    with cr.set_compilation_config(EAGER):
        with counter.expect(num_graphs_seen=0):
            model(ids(3))


def test_size_branch_is_baked_in_at_first_trace():
    """What trace-once costs: Python control flow on a size follows the first call."""

    @cr.compile
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 4:
                return x * 2
            return x * 3

    with cr.set_compilation_config(EAGER):
        model = Branchy()
    assert torch.equal(model(torch.ones(8)), torch.full((8,), 2.0))
    # Eager would take the other branch (x * 3) for 2 rows; the compiled model does not.
    assert torch.equal(model(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(Branchy.forward(model, torch.ones(2)), torch.full((2,), 3.0))


def test_graph_break_is_an_error_naming_the_break():
    @cr.compile
    class Breaks(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x + 1
            torch._dynamo.graph_break()
            return y * 2

    with cr.set_compilation_config(EAGER):
        model = Breaks()
    with pytest.raises(cr.GraphBreakError) as info:
        model(torch.ones(3))
    message = str(info.value)
    assert "Breaks.forward cannot be traced as one graph" in message
    assert "graph_break" in message and "test_compile.py" in message


def test_no_dynamic_dim_is_an_error():
    with pytest.raises(ValueError, match="has no dynamic dimension.*dynamic_arg_dims"):

        @cr.compile
        class NoTensors(nn.Module):
            def forward(self, x, scale: float):
                return x * scale

    with pytest.raises(ValueError, match=r"names \['ids'\]"):

        @cr.compile(dynamic_arg_dims={"ids": 0})
        class WrongName(nn.Module):
            def forward(self, input_ids):
                return input_ids

    with pytest.raises(TypeError, match="nn.Module"):
        cr.compile(object)


def test_dynamic_arg_dims_and_optional_tensors():
    @cr.compile(dynamic_arg_dims={"input_ids": 0, "positions": 0})
    class Two(nn.Module):
        def forward(self, input_ids, positions, bias=None):
            out = input_ids.float() + positions
            return out if bias is None else out + bias

    from compile_runtime.compiler.decorator import infer_dynamic_arg_dims

    class Annotated(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor | None = None, c: int = 0): ...

    assert infer_dynamic_arg_dims(Annotated) == {"a": 0, "b": 0}
    with cr.set_compilation_config(EAGER):
        model = Two()
    with counter.expect(num_graphs_seen=1):
        model(torch.arange(4), torch.arange(4))
    with counter.expect(num_graphs_seen=0):
        assert torch.equal(model(torch.arange(6), torch.arange(6)), 2 * torch.arange(6.0))


def test_debug_dump_writes_readable_split_graph(tmp_path):
    model = build(EAGER.model_copy(update={"debug_dump_path": str(tmp_path)}), num_layers=3)
    model(ids(3))
    text = (tmp_path / "computation_graph.py").read_text()
    assert "submod_0" in text and "compile_runtime.attention" in text
    assert "submod_4: hash" in text and "reuses piece 2" in text  # layer boundaries share code
