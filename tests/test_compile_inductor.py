"""The compiler with Inductor: numerics, and compile work that does not grow with depth."""

from __future__ import annotations

import pytest
import torch

import compile_runtime as cr
from compile_runtime.compiler.decorator import compiled_model
from testing.toy import build
from testing.transformer import build_transformer

counter = cr.compilation_counter
# No compile cache: a hit left by an earlier test would stand in for the compiles counted here.
INDUCTOR = cr.CompilationConfig(backend="inductor", disable_cache=True)


def ids(n: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))


@pytest.mark.slow
def test_toy_model_inductor_counts_and_allclose():
    num_layers = 4
    ref = build(cr.CompilationConfig(mode="NONE"), num_layers=num_layers)
    model = build(INDUCTOR.model_copy(update={"compile_sizes": [4]}), num_layers=num_layers)
    with torch.no_grad():
        with counter.expect(
            num_graphs_seen=1,
            num_piecewise_graphs_seen=2 * num_layers + 1,
            num_piecewise_capturable_graphs_seen=num_layers + 1,
            num_backend_compilations=3 * 2,  # 3 unique pieces x (general + size 4)
            num_inductor_compiles=3 * 2,
        ):
            model(ids(6))
        with counter.expect(num_graphs_seen=0, num_inductor_compiles=0):
            for n in (1, 2, 3, 4, 5, 17, 33):
                torch.testing.assert_close(model(ids(n)), ref(ids(n)), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_inductor_compiles_do_not_grow_with_layers():
    with torch.no_grad():
        for num_layers in (2, 6):
            model = build(INDUCTOR, num_layers=num_layers, seed=num_layers)
            with counter.expect(
                num_inductor_compiles=3, num_piecewise_graphs_seen=2 * num_layers + 1
            ):
                model(ids(5))


@pytest.mark.slow
def test_tiny_transformer_inductor_matches_eager():
    ref = build_transformer(cr.CompilationConfig(mode="NONE"))
    model = build_transformer(INDUCTOR.model_copy(update={"compile_sizes": [8]}))
    with (
        torch.no_grad(),
        counter.expect(
            num_models_seen=0,  # counted when the model was built
            num_graphs_seen=1,  # one trace serves every size, 1 included
            num_backend_compilations=3 * 2,  # 3 unique pieces x (general + size 8)
            num_inductor_compiles=3 * 2,
            num_eager_compiles=0,
        ),
    ):
        for n in (8, 1, 3, 8, 16, 37):
            input_ids, positions = ids(n, 128), torch.arange(n)
            torch.testing.assert_close(
                model(input_ids, positions), ref(input_ids, positions), rtol=1e-4, atol=1e-4
            )
    assert compiled_model(model).result.unique_pieces == 3
