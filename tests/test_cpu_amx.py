"""The AMX bf16 kernel of cpu_amx.py: F.linear's results, used by cpu_linear up to 64 rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compile_runtime.cpu import amx as cpu_amx
from compile_runtime.cpu import linear as cpu_linear

pytestmark = pytest.mark.skipif(
    not cpu_amx.amx_available(), reason="this CPU (or kernel) has no AMX-BF16 tiles"
)


def _close(out, x, weight, bias=None):
    ref = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 50, 64])
@pytest.mark.parametrize("out_features,in_features", [(32, 32), (96, 64), (576, 1536)])
def test_amx_equals_f_linear(rows, out_features, in_features):
    """Partial groups of 16 rows, one pass and two over the weight, a bias."""
    torch.manual_seed(rows)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    packed = cpu_amx.pack(weight)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    out = cpu_amx.amx_linear(x, packed, bias)
    assert out.shape == (rows, out_features) and _close(out, x, weight, bias)
    assert _close(cpu_amx.amx_linear(x, packed, None), x, weight)


def test_amx_reads_strided_rows_and_keeps_leading_dims():
    weight = torch.randn(64, 32, dtype=torch.bfloat16)
    packed = cpu_amx.pack(weight)
    wide = torch.randn(7, 80, dtype=torch.bfloat16)
    x = wide[:, 8:40]
    assert _close(cpu_amx.amx_linear(x, packed, None), x, weight)
    assert cpu_amx.amx_linear(torch.randn(1, 3, 32, dtype=torch.bfloat16), packed, None).shape == (
        1, 3, 64)  # fmt: skip


def test_amx_declines_what_it_was_not_written_for():
    assert cpu_amx.pack(torch.randn(48, 32, dtype=torch.bfloat16)) is None  # outputs % 32
    assert cpu_amx.pack(torch.randn(64, 40, dtype=torch.bfloat16)) is None  # inputs % 32
    assert cpu_amx.pack(torch.randn(64, 32)) is None  # float32
    packed = cpu_amx.pack(torch.randn(64, 32, dtype=torch.bfloat16))
    rows = cpu_amx.MAX_ROWS + 1
    assert cpu_amx.amx_linear(torch.randn(rows, 32, dtype=torch.bfloat16), packed, None) is None
    assert cpu_amx.amx_linear(torch.randn(2, 32), packed, None) is None


def test_cpu_linear_sends_decode_sized_bf16_calls_to_amx_and_never_a_stale_copy(monkeypatch):
    torch.manual_seed(0)
    weight = torch.randn(64, 32, dtype=torch.bfloat16)
    cpu_linear.pack_weight(weight)
    taken = []
    real = cpu_linear.amx_linear

    def counting(x, packed, bias):
        out = real(x, packed, bias)
        if out is not None:
            taken.append(x.shape[0])
        return out

    monkeypatch.setattr(cpu_linear, "amx_linear", counting)
    for rows in (1, 64, 65, 300):
        x = torch.randn(rows, 32, dtype=torch.bfloat16)
        assert _close(torch.ops.compile_runtime.cpu_linear(x, weight, None), x, weight)
    assert taken == [1, 64]
    with torch.no_grad():
        weight.mul_(-1)  # the packed copies are stale now
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert _close(torch.ops.compile_runtime.cpu_linear(x, weight, None), x, weight)
    assert taken == [1, 64]
