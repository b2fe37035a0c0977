"""The kernels a float linear layer can run by on a CPU, by name, and which one runs a call.

``cpu_linear`` runs each call of a float weight by one of four kernels:

* ``gemv``: ``cpu_gemv.py``, which streams the plain weight (fast while the rows are few);
* ``amx``: ``cpu_amx.py``, bf16 on a CPU with AMX, from its own tile copy (up to 64 rows);
* ``onednn``: oneDNN's GEMM on its blocked copy of the weight;
* ``linear``: ``F.linear`` (MKL's sgemm in float32, torch's own GEMM in bf16).

Which is fastest depends on the CPU, the thread count, the weight's shape and dtype and the
row count, so the choice is per weight and per row bucket (``ROW_BUCKETS``, powers of two:
a call of 3 rows is in the bucket of 4, any call past 128 rows in the last). A tuned weight
carries its choices in its record (``PackedWeight.kernels``, one name per bucket), measured on
this machine by ``kernel_tuning.py``; an untuned one runs the built-in rule
(``built_in_kernel``), written from measurements on an AMX Xeon: AMX up to 64 rows, else the
GEMV up to ``cpu_gemv.MAX_ROWS``, else oneDNN, else ``F.linear``. The layer keeps its
weight's choices too (``linear_kernels``, set by the tuning), so a weight processed again
after a reload gets them back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compile_runtime.ops.cpu_amx import MAX_ROWS as MAX_AMX_ROWS
from compile_runtime.ops.cpu_amx import amx_linear
from compile_runtime.ops.cpu_gemv import MAX_ROWS as MAX_GEMV_ROWS
from compile_runtime.ops.cpu_gemv import gemv_dtypes, gemv_linear
from compile_runtime.ops.packed_weights import PackedWeight

KERNELS = ("gemv", "amx", "onednn", "linear")
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_LAST = len(ROW_BUCKETS) - 1


def bucket_index(rows: int) -> int:
    """The bucket of a call of ``rows`` rows: the smallest of ``ROW_BUCKETS`` at or above it."""
    return min(max(rows - 1, 0).bit_length(), _LAST)


def shape_name(weight: torch.Tensor) -> str:
    """What a choice is made for: the weight's dtype and shape, e.g. ``float32:960x576``."""
    return f"{str(weight.dtype).removeprefix('torch.')}:{'x'.join(map(str, weight.shape))}"


def candidates(weight: torch.Tensor, entry: PackedWeight | None, rows: int) -> tuple[str, ...]:
    """The kernels that can run ``weight`` (with its record ``entry``) at ``rows`` rows here."""
    names = []
    if entry is not None and entry.amx is not None and rows <= MAX_AMX_ROWS:
        names.append("amx")
    if weight.dtype in gemv_dtypes():
        names.append("gemv")
    if entry is not None and entry.onednn is not None:
        names.append("onednn")
    names.append("linear")
    return tuple(names)


def built_in_kernel(entry: PackedWeight | None, dtype: torch.dtype, rows: int) -> str:
    """The choice without a measurement (the module docstring says where it comes from)."""
    if entry is not None and entry.amx is not None and rows <= MAX_AMX_ROWS:
        return "amx"
    if rows <= MAX_GEMV_ROWS.get(dtype, 0) and dtype in gemv_dtypes():
        return "gemv"
    return "onednn" if entry is not None and entry.onednn is not None else "linear"


def run_kernel(
    name: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    entry: PackedWeight | None,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` by kernel ``name``; None when that kernel does not take
    these tensors (a strided input, a bias in another dtype, no copy for it)."""
    if name == "gemv":
        return gemv_linear(x, weight, bias)
    if name == "amx":
        return None if entry is None or entry.amx is None else amx_linear(x, entry.amx, bias)
    if name == "onednn":
        if entry is None or entry.onednn is None:
            return None
        two_d = x.dim() == 2  # the runtime's layers: [tokens, features]
        flat = x if two_d else x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(
            flat.contiguous(), entry.onednn, bias, "none", [], ""
        )
        return out if two_d else out.view(*x.shape[:-1], weight.shape[0])
    if name == "linear":
        return F.linear(x, weight, bias)
    raise ValueError(f"unknown linear kernel {name!r}; one of {', '.join(KERNELS)}")


def float_linear(
    x: torch.Tensor, weight: torch.Tensor, entry: PackedWeight | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a float weight, by the kernel chosen for its row
    count (tuned, else built in); oneDNN or ``F.linear`` when that one declines."""
    rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
    if entry is not None and entry.kernels is not None:
        name = entry.kernels[bucket_index(rows)]
    else:
        name = built_in_kernel(entry, weight.dtype, rows)
    out = run_kernel(name, x, weight, entry, bias)
    if out is None:
        out = run_kernel("onednn", x, weight, entry, bias)
    return out if out is not None else F.linear(x, weight, bias)
