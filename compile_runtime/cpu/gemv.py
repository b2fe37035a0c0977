"""Linear layers of a few rows on CPU: a GEMV that streams the weight at memory bandwidth.

A decode step of a small batch multiplies a few rows by every weight of the model,
so its time is the time to read the weights, and oneDNN's packed GEMM, MKL's sgemv
and ``F.linear`` in bf16 read them below the memory bandwidth. This kernel
reads each weight row once, four rows at a time with a software prefetch 8 KiB
ahead, multiplies them by up to four rows of x at a time with AVX512-BF16 dot
products (bf16 in, float32 sums) or AVX-512 FMAs (float32), and reduces the
16 partial sums of a tile together, faster than all three on SmolLM2-135M's weights
(the README's "On a CPU"). With more rows the weight is reused and the GEMV becomes
bound by its arithmetic: past some row count oneDNN is faster again (where, the machine
decides: ``cpu_linear.py``). The C is
``csrc/gemv.c``, built by ``compile_runtime/cpu/c_library.py``. A CPU with AVX2 but not AVX-512 (AMD
Zen 3) runs both tiles with 8-float vectors (bf16 widened by a shift: half the bytes of
float32 to read); without AVX2, or without a C compiler, every dtype keeps the oneDNN path.
"""

from __future__ import annotations

import functools
import sys

import torch

from compile_runtime.cpu.native_function import NativeFunction
from compile_runtime.torch_internals import mkldnn_bf16_supported


# The built-in choice (cpu_linear.py; a tuned weight has its own, measured): rows up to
# which the GEMV beat oneDNN's packed GEMM on an AMX Xeon (all of SmolLM2's weights, 2 cores):
# in bf16 oneDNN's time is flat to 16 rows while the GEMV turns compute-bound past 4; in
# float32 the GEMV leads to 16 rows and is even at 32 (README, "On a CPU").
# Without oneDNN's bf16 (no AVX512-BF16 or AMX: AMD Zen 3) the other bf16 path is torch's
# own linear, which the AVX2 GEMV beats at every row count, by more the more rows:
# there the GEMV takes every bf16 linear.
def _most_bf16_rows() -> int:
    return 4 if mkldnn_bf16_supported() else sys.maxsize


MAX_ROWS = {torch.bfloat16: _most_bf16_rows(), torch.float32: 16}


@functools.cache
def _kernels() -> dict[torch.dtype, NativeFunction]:
    """The kernel per dtype this CPU runs (empty without AVX-512 or AVX2, or a compiler)."""
    from compile_runtime.cpu.c_library import load_c_library

    lib = load_c_library("gemv", "one-row CPU linear layers")
    if lib is None:
        return {}
    return {
        dtype: lib.native(f"gemv_{name}")
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "f32"))
        if lib.function(f"gemv_has_{name}")()
    }


def gemv_dtypes() -> frozenset[torch.dtype]:
    """The dtypes the GEMV runs in on this machine."""
    return frozenset(_kernels())


def gemv_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` by the GEMV (any row count; fast for a few); None when
    the kernel does not take these tensors (the caller runs its own path)."""
    kernel = _kernels().get(weight.dtype)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (
        kernel is None
        or rows == 0
        or x.dtype != weight.dtype
        or x.stride(-1) != 1
        or not weight.is_contiguous()
        or (bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()))
    ):
        return None
    n, k = weight.shape
    flat = x if x.dim() == 2 else x.reshape(rows, k)
    out = torch.empty(rows, n, dtype=x.dtype)
    kernel(
        flat.data_ptr(), flat.stride(0), weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(), n, rows, n, k, torch.get_num_threads(),
    )  # fmt: skip
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
