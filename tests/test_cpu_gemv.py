"""The few-row GEMV of cpu_gemv.py: F.linear's results, and only for what it was written for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compile_runtime.cpu import gemv as cpu_gemv
from compile_runtime.cpu import linear as cpu_linear

# Tolerances: float32 sums in another order; bf16 outputs are rounded once to bf16.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def _needs(dtype):
    if dtype not in cpu_gemv.gemv_dtypes():
        pytest.skip(f"this CPU has no GEMV kernel for {dtype} (needs AVX-512 / AVX512-BF16)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", [(7, 45), (13, 100), (960, 576), (5, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 17])
def test_gemv_equals_f_linear(dtype, out_features, in_features, with_bias, rows):
    """Weight rows not a multiple of four, inputs not a multiple of the vector width, a
    bias, several rows of x (one tile of four, a partial one)."""
    _needs(dtype)
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features, dtype=dtype)
    bias = torch.randn(out_features, dtype=dtype) if with_bias else None
    x = torch.randn(rows, in_features, dtype=dtype)
    out = cpu_gemv.gemv_linear(x, weight, bias)
    assert out is not None and out.shape == (rows, out_features) and out.dtype == dtype
    ref = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    scale = ref.abs().max().item()
    assert (out.float() - ref).abs().max().item() <= TOLERANCE[dtype] * scale


def test_gemv_keeps_leading_dims_and_reads_strided_rows():
    _needs(torch.float32)
    torch.manual_seed(0)
    weight = torch.randn(24, 32)
    wide = torch.randn(5, 64)
    x = wide[:, :32]  # rows 64 apart: a view into a wider buffer
    out = cpu_gemv.gemv_linear(x, weight, None)
    assert (out - F.linear(x, weight)).abs().max() < 1e-4
    out3 = cpu_gemv.gemv_linear(torch.randn(1, 1, 32), weight, None)
    assert out3.shape == (1, 1, 24)


def test_gemv_declines_what_it_was_not_written_for():
    """None, so the caller runs its own path: mixed dtypes, a strided weight, a float16
    weight, no rows."""
    _needs(torch.float32)
    weight = torch.randn(16, 32)
    assert cpu_gemv.gemv_linear(torch.randn(0, 32), weight, None) is None
    assert cpu_gemv.gemv_linear(torch.randn(1, 32, dtype=torch.bfloat16), weight, None) is None
    assert cpu_gemv.gemv_linear(torch.randn(1, 16), torch.randn(32, 16).t(), None) is None
    assert cpu_gemv.gemv_linear(torch.randn(1, 32).half(), weight.half(), None) is None
    assert cpu_gemv.gemv_linear(torch.randn(1, 32), weight, torch.randn(16).double()) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_linear_sends_a_few_rows_to_the_gemv_and_more_rows_to_onednn(monkeypatch, dtype):
    _needs(dtype)
    torch.manual_seed(0)
    weight = torch.randn(64, 48, dtype=dtype)  # 48 inputs: not the AMX kernel's (cpu_amx.py)
    if cpu_linear.can_pack(weight):  # oneDNN's bf16 needs AVX-512 (else torch's own linear)
        cpu_linear.pack_weight(weight)
    calls = []
    real = cpu_linear.gemv_linear

    def counting(x, w, b):
        out = real(x, w, b)
        if out is not None:
            calls.append(x.shape[0])
        return out

    monkeypatch.setattr(cpu_linear, "gemv_linear", counting)
    most = cpu_gemv.MAX_ROWS[dtype]  # every count for bf16 where oneDNN has no bf16
    sizes = [1, most, most + 1, 64] if most < 64 else [1, 8, 64]
    for rows in sizes:
        x = torch.randn(rows, 48, dtype=dtype)
        out = torch.ops.compile_runtime.cpu_linear(x, weight, None)
        ref = F.linear(x.float(), weight.float())
        assert (out.float() - ref).abs().max() <= TOLERANCE[dtype] * ref.abs().max()
    assert calls == [r for r in sizes if r <= most]  # the built-in choice: up to MAX_ROWS


def test_without_a_compiler_there_is_no_gemv_and_linear_still_works(monkeypatch, tmp_path):
    cpu_gemv._kernels.cache_clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("COMPILE_RUNTIME_CACHE_DIR", str(tmp_path))
    try:
        assert cpu_gemv.gemv_dtypes() == frozenset()
        weight, x = torch.randn(8, 16), torch.randn(1, 16)
        assert cpu_gemv.gemv_linear(x, weight, None) is None
        out = torch.ops.compile_runtime.cpu_linear(x, weight, None)
        assert (out - F.linear(x, weight)).abs().max() < 1e-5
    finally:
        cpu_gemv._kernels.cache_clear()
    assert not any((tmp_path / ".cpu_kernels").glob("*.so"))
