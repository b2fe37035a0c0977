"""Linear layers with quantized weights on CPU: int8 dot products on the quantized bytes.

``y = x W^T (+ b)`` with W in Q8_0, Q4_0 or Q4_1 (``cpu_quant_formats.py``). As
llama.cpp does, each row of x is first quantized to int8 per block of 32 (``d =
max|x| / 127``, float16; ``q = round(x / d)``, to nearest even), so a block of the
product is one exact integer dot product times two scales: ``d_w * d_x * sum(q_w *
q_x)`` (plus ``m_w * d_x * sum(q_x)`` for Q4_1, minus the offset of the unsigned
weights for Q8_0 and Q4_0, folded into the integer sum's start value).

The kernel reads the packed layout (``pack_rows``: rows in groups of 16, block by
block): one 64-byte load of 16 rows' elements ``4k..4k+3`` and one AVX512-VNNI
``vpdpbusd`` with those 4 bytes of x broadcast advance 16 rows at once, each row's
block sum in its own int32 lane; the 16 rows' scales come in one float16 load, so
a block costs 8 loads, 8 ``vpdpbusd`` (two chains of 4) and one multiply-add for 16
rows, with no horizontal sums and no lanes left empty at any K (the per-row layout
before this wasted 14 of 32 lanes at K = 576, where SmolLM2's linears mostly are).
Q4 weights are unpacked in registers (an AND and a shift per 64 bytes). Groups of
rows are shared out over the threads (OpenMP), each reading its groups front to back
with a software prefetch 2 KiB ahead; up to 4 rows of x share each group's loads.
Up to 4 rows of x are quantized before the parallel region (one barrier less).
Faster than the per-row kernel on both formats (the README's "Quantized weights" gives
the times and ``benchmarks/quantized.py`` the end-to-end speed). ``qrows`` dequantizes rows of
a packed table (the tied embedding). The C is ``csrc/qgemm.c`` (with the body for the
CPU's instructions: ``qgemm_avx512.h``, ``qgemm_avx2.h``).

On a CPU with AVX2 but not AVX512-VNNI (AMD Zen 3, Intel before Ice Lake) the same
layout is read 8 rows a register with ``vpmaddubsw`` and ``vpmaddwd`` (``qgemm_avx2.h``
says why the sums stay exact). Without either, or without a C compiler, the loader
dequantizes the weights once (``models/registry.py``); a weight that is not packed
still runs here, through its dequantized floats (correct, slow).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from compile_runtime.cpu.native_function import NativeFunction
from compile_runtime.cpu.packed_weights import PackedWeight, lookup
from compile_runtime.cpu.packed_weights import _by_address as _records
from compile_runtime.cpu.quant_formats import (
    Q4_0,
    Q4_1,
    Q8_0,
    dequantize,
    format_of,
    pack_rows,
)
from compile_runtime.torch_internals import tensor_version

if TYPE_CHECKING:
    from compile_runtime.cpu.c_library import CLibrary

FORMAT_IDS = {Q8_0: 0, Q4_0: 1, Q4_1: 2}
_FORMAT_BY_BYTES = {f.block_bytes: i for f, i in FORMAT_IDS.items()}
_X_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's bf16 flag


@functools.cache
def _library() -> CLibrary | None:
    """The built library, or None (no compiler, no AVX512-VNNI or AVX2)."""
    from compile_runtime.cpu.c_library import load_c_library

    lib = load_c_library("qgemm", "quantized CPU linear layers")
    if lib is None or not lib.function("qgemm_available")():
        return None
    return lib


@functools.cache
def _kernel() -> NativeFunction | None:
    lib = _library()
    return None if lib is None else lib.native("qgemm")


@functools.cache
def _rows_kernel() -> NativeFunction | None:
    lib = _library()
    return None if lib is None else lib.native("qrows")


def kernel_available() -> bool:
    return _library() is not None


def pack_for_kernel(weight: nn.Parameter) -> PackedWeight | None:
    """Put a quantized weight in the kernel's layout (in place, once) when the kernel is
    here to read it; its record, or None."""
    if not kernel_available() or not weight.is_contiguous():
        return None
    return pack_rows(weight)


def quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, dequantize(weight), bias)`` for a quantized ``weight``: by the int8
    kernel (x quantized per block of 32, as llama.cpp does; any row count) when the weight
    is packed (``pack_for_kernel``), else through the dequantized weight."""
    n, nb, block_bytes = weight.shape
    fmt_id = _FORMAT_BY_BYTES.get(block_bytes)
    kernel = _kernel()
    dtype = x.dtype
    k = nb * 32
    if (
        kernel is None
        or fmt_id is None
        or weight.dtype != torch.uint8
        or dtype not in _X_DTYPES
        or x.shape[-1] != k
        or lookup(weight) is None  # not in the kernel's layout (pack_rows)
    ):
        if format_of(weight) is None:
            raise ValueError(f"not a quantized weight: {weight.dtype} {tuple(weight.shape)}")
        return F.linear(x, dequantize(weight, dtype), bias)
    two_d = x.dim() == 2
    flat = x if two_d else x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        bias = bias.to(dtype).contiguous()
    out = torch.empty(rows, n, dtype=dtype)
    if rows:
        kernel(
            flat.data_ptr(), flat.stride(0), _X_DTYPES[dtype], weight.data_ptr(), fmt_id,
            None if bias is None else bias.data_ptr(), out.data_ptr(), n, rows, n, k,
            torch.get_num_threads(),
        )  # fmt: skip
    return out if two_d else out.view(*x.shape[:-1], n)


class ResolvedQuantLinear(NamedTuple):
    """What ``quant_linear``'s kernel path needs of one packed weight, found once
    (``resolve_quant_linear``) for a layer called every step (the LM head)."""

    weight: torch.Tensor
    entry: PackedWeight  # lookup(weight) when resolved
    kernel: NativeFunction
    fmt_id: int
    n: int
    k: int


def resolve_quant_linear(weight: torch.Tensor) -> ResolvedQuantLinear | None:
    """``quant_linear``'s kernel path for the parameter ``weight``, resolved; None when it
    would not take it (no kernel, not a packed quantized weight)."""
    kernel = _kernel()
    if kernel is None or weight.dtype != torch.uint8 or weight.dim() != 3:
        return None
    n, nb, block_bytes = weight.shape
    fmt_id = _FORMAT_BY_BYTES.get(block_bytes)
    entry = lookup(weight)
    if fmt_id is None or entry is None or entry.weight() is not weight:
        return None
    return ResolvedQuantLinear(weight, entry, kernel, fmt_id, n, nb * 32)


def run_resolved(plan: ResolvedQuantLinear, x: torch.Tensor) -> torch.Tensor | None:
    """``quant_linear(x, plan.weight, None)`` for a 2-D ``x`` with unit stride, by the same
    kernel call, without finding it again; None (the caller takes ``quant_linear``) unless
    the plan still holds: the weight's record is what ``lookup`` gives (at its address,
    its version unmoved: a weight changed in place is noticed)."""
    weight, entry, dtype = plan.weight, plan.entry, x.dtype
    if (
        dtype not in _X_DTYPES
        or x.dim() != 2
        or x.shape[1] != plan.k
        or x.stride(-1) != 1
        or _records.get(weight.data_ptr()) is not entry
        or tensor_version(weight) != entry.version
    ):
        return None
    rows, n = x.shape[0], plan.n
    out = torch.empty(rows, n, dtype=dtype)
    if rows:
        plan.kernel(
            x.data_ptr(), x.stride(0), _X_DTYPES[dtype], weight.data_ptr(), plan.fmt_id,
            None, out.data_ptr(), n, rows, n, plan.k, torch.get_num_threads(),
        )  # fmt: skip
    return out


def quant_rows(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (any shape) of a quantized table, dequantized to ``dtype``: [*ids, K]."""
    n, nb, block_bytes = weight.shape
    rows = _rows_kernel()
    flat = ids.reshape(-1)
    packed = lookup(weight) is not None  # the kernel's layout (pack_rows)
    if rows is None or dtype not in _X_DTYPES or not packed:
        if packed:  # a packed row is spread over its group: dequantize the table
            return dequantize(weight, dtype)[flat].view(*ids.shape, -1)
        return dequantize(weight.index_select(0, flat), dtype).view(*ids.shape, -1)
    flat = flat.to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), nb * 32, dtype=dtype)
    bad = rows(
        weight.data_ptr(), _FORMAT_BY_BYTES[block_bytes], n, nb * 32, flat.data_ptr(),
        flat.numel(), out.data_ptr(), _X_DTYPES[dtype],
    )  # fmt: skip
    if bad:  # checked in C, before any row is written: no host sync on the ids
        raise IndexError(f"{bad} token id(s) out of range: the table has {n} rows")
    return out.view(*ids.shape, -1)
