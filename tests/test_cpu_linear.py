"""Linear layers with oneDNN-packed weights on CPU: same results, never a stale copy."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import compile_runtime as cr
from compile_runtime.cpu import linear as cpu_linear
from compile_runtime.cpu import packed_weights
from compile_runtime.cpu.packed_weights import lookup
from compile_runtime.distributed import ColumnParallelLinear, RowParallelLinear


@pytest.mark.parametrize("rows", [1, 3, 4, 17, 64])
def test_packed_linear_equals_f_linear(rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(rows, 64)
    cpu_linear.pack_weight(weight)
    out = torch.ops.compile_runtime.cpu_linear(x, weight, bias)
    assert out.shape == (rows, 96)
    assert (out - F.linear(x, weight, bias)).abs().max() < 1e-4


def test_a_weight_changed_after_packing_is_never_served_stale():
    torch.manual_seed(0)
    weight = torch.randn(32, 16)
    x = torch.randn(8, 16)
    cpu_linear.pack_weight(weight)
    assert lookup(weight) is not None
    with torch.no_grad():
        weight.mul_(2)  # bumps the version counter
    assert lookup(weight) is None
    out = torch.ops.compile_runtime.cpu_linear(x, weight, None)
    assert (out - F.linear(x, weight)).abs().max() < 1e-5
    cpu_linear.pack_weight(weight)  # packing again serves the new values
    assert lookup(weight) is not None


def test_pack_linear_weights_flags_layers_and_compiled_model_matches_eager():
    torch.manual_seed(0)

    @cr.compile
    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = ColumnParallelLinear(32, [64], bias=True, name="up")
            self.down = RowParallelLinear(64, 32, bias=False, name="down")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(F.silu(self.up(x)))

    with cr.set_compilation_config(cr.CompilationConfig(backend="eager")):
        model = Mlp()
    x = torch.randn(12, 32)
    with torch.no_grad():
        expected = F.linear(F.silu(F.linear(x, model.up.weight, model.up.bias)), model.down.weight)
    assert cpu_linear.pack_linear_weights(model) == 2
    assert model.up.use_packed_weight and model.down.use_packed_weight
    with torch.inference_mode():
        out = model(x)
    assert (out - expected).abs().max() < 1e-4


def test_packed_copy_follows_the_parameter_not_the_address():
    """A swapped storage or a transposed view at the same address never gets the packed copy."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(16, [16], bias=False, name="sq")
    cpu_linear.pack_linear_weights(layer)
    assert lookup(layer.weight) is not None
    assert lookup(layer.weight.t()) is None  # same pointer and shape, other strides
    old = layer.weight.data
    layer.weight.data = torch.randn(16, 16)
    assert lookup(old) is None  # the packed parameter no longer lives there


def test_one_record_per_weight_made_per_layer_and_dropped_with_the_parameter():
    """Float and quantized weights share the one registry: ``forget`` drops either before a
    loader writes through .data, and a record goes when its parameter does."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(32, [16], bias=False, name="f")
    entry = cpu_linear.process_weights_after_loading(layer)
    assert entry is lookup(layer.weight) and entry.onednn is not None
    packed_weights.forget(layer.weight.data[2:4])  # a slice of its rows about to be written
    assert lookup(layer.weight) is None
    cpu_linear.process_weights_after_loading(layer)
    address = layer.weight.data_ptr()
    assert address in packed_weights._by_address
    del layer, entry
    gc.collect()  # the parameter's tp_shard is a method of its layer: a cycle
    assert address not in packed_weights._by_address


def test_repack_after_writes_through_data():
    """Loaders write through .data (no version bump): repack_linear_weights refreshes."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(16, [32], bias=False, name="w")
    cpu_linear.pack_linear_weights(layer)
    layer.weight.data.copy_(torch.zeros(32, 16))
    cpu_linear.repack_linear_weights(layer)
    x = torch.randn(8, 16)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.zeros(8, 32))


def test_plain_argmax_is_not_cached_across_copies():
    p = cr.SamplingParams(temperature=0.0)
    assert p.plain_argmax
    assert not p.model_copy(update={"logprobs": 3}).plain_argmax
