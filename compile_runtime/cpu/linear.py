"""Linear layers on CPU: each call run by the kernel chosen for its weight and row count.

``torch.ops.compile_runtime.cpu_linear`` (opaque to Dynamo and Inductor) runs a float weight
by one of four kernels:

* ``gemv``: ``cpu_gemv.py``, which streams the plain weight (fast while the rows are few);
* ``amx``: ``cpu_amx.py``, bf16 on a CPU with AMX, from its own tile copy (up to 64 rows);
* ``onednn``: oneDNN's GEMM on its blocked copy of the weight;
* ``linear``: ``F.linear`` (MKL's sgemm, which repacks the weight on every call, in float32;
  torch's own GEMM in bf16).

Which is fastest depends on the CPU, the thread count, the weight's shape and dtype and the
row count, so the choice is per weight and per row bucket (``ROW_BUCKETS``, powers of two:
a call of 3 rows is in the bucket of 4, any call past 128 rows in the last). A tuned weight
carries its choices in its record (``PackedWeight.kernels``, one name per bucket), measured on
this machine by ``kernel_tuning.py``; the layer keeps them too (``linear_kernels``), so a
weight processed again after a reload gets them back. An untuned one runs the built-in rule
(``built_in_kernel``), written from measurements on an AMX Xeon: AMX up to 64 rows, else the
GEMV up to ``cpu_gemv.MAX_ROWS``, else oneDNN, else ``F.linear``.

Each linear layer's weight is processed once after loading (``process_weights_after_loading``,
driven over a model by ``pack_linear_weights`` and, after a reload, ``repack_linear_weights``)
and the result recorded in ``packed_weights.py``: the graph sees the ordinary weight, and the
op finds the record at run time (that file says why not on the layer). A weight without a
current record (changed in place since, or never processed) runs without the copies. The
cost is memory: one more copy of every float32 weight (oneDNN's), and of a bf16 one with
AMX (the AMX kernel's; bf16 gets no oneDNN copy, ``packed_copies`` says why). A quantized
weight (``uint8`` blocks of GGUF's Q8_0, Q4_0 or Q4_1, ``cpu_quant_formats.py``) has one
kernel and no copy: processing rearranges its bytes in place into the int8 kernel's layout
(``cpu_quant_gemm.py``), which reads them.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from compile_runtime.cpu.amx import MAX_ROWS as MAX_AMX_ROWS
from compile_runtime.cpu.amx import amx_linear
from compile_runtime.cpu.amx import pack as pack_for_amx
from compile_runtime.cpu.gemv import MAX_ROWS as MAX_GEMV_ROWS
from compile_runtime.cpu.gemv import gemv_dtypes, gemv_linear
from compile_runtime.cpu.hugepages import move_into_hugepages
from compile_runtime.cpu.packed_weights import PackedWeight, lookup, record
from compile_runtime.cpu.quant_gemm import kernel_available, pack_for_kernel, quant_linear
from compile_runtime.torch_internals import (
    mkldnn_bf16_supported,
    mkldnn_linear,
    mkldnn_reorder_linear_weight,
)

logger = logging.getLogger(__name__)

OP_NAME = "compile_runtime::cpu_linear"
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

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
        out = mkldnn_linear(flat.contiguous(), entry.onednn, bias)
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
    if entry is None:
        name = built_in_kernel(entry, weight.dtype, rows)
    elif entry.kernels is not None:
        name = entry.kernels[bucket_index(rows)]
    else:  # the built-in choice, once per row count (its inputs are the record's own)
        name = entry.built_in.get(rows)
        if name is None:
            name = entry.built_in[rows] = built_in_kernel(entry, weight.dtype, rows)
    # The GEMV (a decode's common kernel) directly: a call less than through run_kernel.
    if name == "gemv":
        out = gemv_linear(x, weight, bias)
    else:
        out = run_kernel(name, x, weight, entry, bias)
    if out is None:
        out = run_kernel("onednn", x, weight, entry, bias)
    return out if out is not None else F.linear(x, weight, bias)


def cpu_linear_impl(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # Quantized (compile_runtime/cpu/quant_formats.py): no packed copy.
    if weight.dtype == torch.uint8:
        return quant_linear(x, weight, bias)
    return float_linear(x, weight, lookup(weight), bias)  # the kernel for the rows


# A plain library registration: its dispatch costs a few microseconds per call,
# several times less than torch.library.custom_op's Python wrapper.
_lib = torch.library.Library("compile_runtime", "FRAGMENT")
_lib.define("cpu_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.impl("cpu_linear", cpu_linear_impl, "CPU")


@torch.library.register_fake(OP_NAME)
def _cpu_linear_fake(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def is_quantized(weight: torch.Tensor | None) -> bool:
    """A quantized weight (``uint8`` blocks, ``compile_runtime/cpu/quant_formats.py``): ``cpu_linear``
    runs it through the int8 kernel of ``cpu_quant_gemm.py``."""
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.uint8


def can_pack(weight: torch.Tensor) -> bool:
    return (
        isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and (weight.dtype != torch.bfloat16 or mkldnn_bf16_supported())
    )


def _gemv_reads(weight: torch.Tensor) -> bool:
    return (
        isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in gemv_dtypes()
    )


def packed_copies(weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """oneDNN's blocked copy of a float32 ``weight`` and the AMX kernel's of a bf16 one (None
    without AMX); an AMX copy already recorded for it (mapped from a packed-weight file) is
    kept. A bf16 weight gets no oneDNN copy: it would double the model's memory, and above
    the GEMV's and AMX's rows ``F.linear`` (oneDNN on the plain weight) is close (a linear
    ~20% slower at 16-64 rows, faster at 256; SmolLM2 bf16 6-9% slower at batch 16 and on a
    mixed load, on a Zen 4), where for float32 MKL's sgemm is 2-3x slower than oneDNN's
    blocked copy."""
    entry = lookup(weight)
    with torch.no_grad():
        onednn = None
        if weight.dtype == torch.float32:
            onednn = mkldnn_reorder_linear_weight(weight.detach(), 32)
        if entry is not None and entry.amx is not None:
            return onednn, entry.amx
        return onednn, pack_for_amx(weight.detach())


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """Make (or refresh) the packed copies of a float ``weight`` and record them."""
    onednn, amx = packed_copies(weight)
    return record(weight, onednn=onednn, amx=amx)


def process_weights_after_loading(module: nn.Module) -> PackedWeight | None:
    """Process one linear layer's loaded weight for the kernels that run it: a float weight
    oneDNN takes gets its packed copies (made afresh: it may have been written through
    ``.data``), one only the GEMV reads gets a record without copies, and either carries the
    layer's measured kernels, if any; a quantized one is rearranged in place (once).
    Returns the record (``packed_weights.py``), or None for a weight run as it is."""
    weight = module.weight
    if is_quantized(weight):
        return pack_for_kernel(weight)
    if can_pack(weight):
        entry = pack_weight(weight)
    elif _gemv_reads(weight):
        entry = record(weight)
    else:
        return None
    entry.kernels = getattr(module, "linear_kernels", None)  # measured here (kernel_tuning.py)
    return entry


def _processed(weight: torch.Tensor | None) -> bool:
    """A weight ``cpu_linear`` runs by its own kernels: quantized, packed, or the GEMV's
    (bf16 without AVX512-BF16 or AMX, which oneDNN cannot take here)."""
    return is_quantized(weight) or can_pack(weight) or _gemv_reads(weight)


def _process_layers(layers: list[nn.Module]) -> int:
    """``process_weights_after_loading`` of each layer, each weight once; the weights
    first moved together into huge pages (``hugepages.py``: the step streams them), the
    AMX copies after. Moves come first: a record holds the weight's address. Returns how
    many float weights were packed."""
    weights = list({id(m.weight): m.weight for m in layers}.values())
    move_into_hugepages([w for w in weights if not is_quantized(w)])
    if kernel_available():  # not those in the kernel's layout already: moved then
        move_into_hugepages([w for w in weights if is_quantized(w) and lookup(w) is None])
    records: dict[int, PackedWeight | None] = {}
    for module in layers:
        if id(module.weight) not in records:
            records[id(module.weight)] = process_weights_after_loading(module)
    move_into_hugepages([r.amx for r in records.values() if r is not None and r.amx is not None])
    return sum(1 for w in weights if can_pack(w) and w.dtype == torch.float32)


def pack_linear_weights(model: nn.Module) -> int:
    """Process the weight of every module that has a ``use_packed_weight`` flag and a weight
    ``cpu_linear`` runs by its own kernels (``_processed``); set the flag.

    Call after the weights are loaded and before the first forward (the flag is
    read when the forward is traced). Returns how many float weights were packed.
    """
    layers = [
        m
        for m in model.modules()
        if hasattr(m, "use_packed_weight") and _processed(getattr(m, "weight", None))
    ]
    for module in layers:
        module.use_packed_weight = True
    count = _process_layers(layers)
    logger.info("packed %d float32 linear weights for oneDNN (CPU)", count)
    return count


def repack_linear_weights(model: nn.Module) -> None:
    """Process ``model``'s flagged layers again after their weights changed (a reload).

    Writes through ``param.data`` (as weight loaders do) do not move the version counter,
    so they cannot be detected: whoever writes weights that way must call this.
    """
    _process_layers(
        [
            m
            for m in model.modules()
            if getattr(m, "use_packed_weight", False) and _processed(m.weight)
        ]
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool
) -> torch.Tensor:
    """``F.linear``, through the packed weight when the layer's weight was packed."""
    if packed:
        return torch.ops.compile_runtime.cpu_linear(x, weight, bias)
    return F.linear(x, weight, bias)
