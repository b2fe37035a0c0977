"""bf16 linear layers of up to 64 rows on CPU with AMX tiles, the weight streamed once.

A decode step of a batch of 5-64 requests reads every weight once and multiplies it
by a few dozen rows: too many rows for the GEMV (``cpu_gemv.py``: compute-bound past
four), too few for oneDNN's GEMM to reach the memory bandwidth. This kernel keeps
each weight in AMX's own layout (1 KiB tiles of 16 outputs x 32 inputs, the inputs
of an output block one tile after another), a copy made once at load (``pack``, next
to oneDNN's), and multiplies 32 outputs at a time by up to 32 rows of x per pass
(four accumulator tiles), prefetching the weight 8 KiB ahead in the first pass;
later passes (rows 33-64) find it in cache. It beats oneDNN on SmolLM2-135M's
weights up to 64 rows and not past it, so ``MAX_ROWS`` is 64 (the README's "On a
CPU"). Needs a CPU with AMX-BF16 and a Linux that grants tile
state (``arch_prctl``); else ``amx_available()`` is False and nothing changes.
Shapes: outputs a multiple of 32, inputs of 32. The C is ``csrc/amx_linear.c``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from compile_runtime.cpu.native_function import NativeFunction

if TYPE_CHECKING:
    from compile_runtime.cpu.c_library import CLibrary

MAX_ROWS = 64  # beyond, oneDNN's GEMM is as fast and needs no second pass over the weight


@functools.cache
def _library() -> CLibrary | None:
    """The library, on a CPU with AMX that Linux lets this process use; else None."""
    from compile_runtime.cpu.c_library import load_c_library

    lib = load_c_library("amx_linear", "AMX bf16 linear layers")
    if lib is None or not lib.function("amx_enable")():
        return None
    return lib


@functools.cache
def _linear_kernel() -> NativeFunction:
    return _library().native("amx_linear_bf16")


def amx_available() -> bool:
    return _library() is not None


def can_pack(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and out_features % 32 == 0
        and in_features % 32 == 0
        and amx_available()
    )


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [N, K] in the kernel's tile layout (a plain tensor of the same size), or
    None when the kernel cannot take it."""
    if not can_pack(weight):
        return None
    packed = torch.empty_like(weight)
    _library().function("amx_pack_bf16")(weight.data_ptr(), packed.data_ptr(), *weight.shape)
    return packed


def amx_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` from ``pack(weight)``, for x of at most ``MAX_ROWS``
    bf16 rows; None when it does not take these tensors."""
    n, k = packed.shape
    rows = x.numel() // k if k else 0
    if (
        not 0 < rows <= MAX_ROWS
        or x.dtype != torch.bfloat16
        or x.stride(-1) != 1
        or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))
    ):
        return None
    flat = x if x.dim() == 2 else x.reshape(rows, k)
    out = torch.empty(rows, n, dtype=x.dtype)
    _linear_kernel()(
        flat.data_ptr(), flat.stride(0), packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(), n, rows, n, k, torch.get_num_threads(),
    )  # fmt: skip
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
