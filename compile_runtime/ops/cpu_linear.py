"""Linear layers on CPU with weights packed once for oneDNN.

``F.linear`` on CPU calls MKL's sgemm, which lays the weight out for its
micro-kernels again on every call. oneDNN with the weight reordered once into
its blocked layout was faster at every row count the runtime runs, measured in whole
decode steps whose weights stream from memory (an isolated benchmark of a few weights
that stay in cache shows the plain call ahead at 1-2 rows; the README's "On a CPU" says
which kernel runs where). So ``cpu_linear`` uses the packed weight whenever there is one.

Each linear layer's weight is processed once after loading
(``process_weights_after_loading``, driven over a model by ``pack_linear_weights`` and, after
a reload, ``repack_linear_weights``) and the result recorded in ``packed_weights.py``: the
graph sees the ordinary weight, and ``torch.ops.compile_runtime.cpu_linear`` (opaque to
Dynamo and Inductor) finds the record at run time (that file says why not on the layer). A
weight without a current record (changed in place since, or never processed) runs through
``F.linear``. Which kernel runs a call (the GEMV of ``cpu_gemv.py``, which streams the
plain weight; the AMX kernel of ``cpu_amx.py``, from a third copy in its own tile layout;
oneDNN; ``F.linear``) is ``linear_kernels.py``'s choice for the weight and the row count:
measured on this CPU by ``kernel_tuning.py``, or the built-in rule. The cost is memory: one more copy
of every packed weight (two in bf16 with AMX). A quantized weight (``uint8`` blocks of
GGUF's Q8_0, Q4_0 or Q4_1, ``cpu_quant_formats.py``) has no copy: processing rearranges its
bytes in place into the int8 kernel's layout (``cpu_quant_gemm.py``), which reads them.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from compile_runtime.ops.cpu_amx import pack as pack_for_amx
from compile_runtime.ops.cpu_gemv import gemv_dtypes
from compile_runtime.ops.cpu_quant_gemm import kernel_available, pack_for_kernel, quant_linear
from compile_runtime.ops.hugepages import move_into_hugepages
from compile_runtime.ops.linear_kernels import float_linear
from compile_runtime.ops.packed_weights import PackedWeight, lookup, record

logger = logging.getLogger(__name__)

OP_NAME = "compile_runtime::cpu_linear"
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def cpu_linear_impl(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if weight.dtype == torch.uint8:  # quantized (ops/cpu_quant_formats.py): no packed copy
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
    """A quantized weight (``uint8`` blocks, ``ops/cpu_quant_formats.py``): ``cpu_linear``
    runs it through the int8 kernel of ``cpu_quant_gemm.py``."""
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.uint8


def can_pack(weight: torch.Tensor) -> bool:
    return (
        isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def _gemv_reads(weight: torch.Tensor) -> bool:
    return (
        isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in gemv_dtypes()
    )


def packed_copies(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """oneDNN's blocked copy of a float ``weight`` and the AMX kernel's (None without AMX)."""
    with torch.no_grad():
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)
        return onednn, pack_for_amx(weight.detach())


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """Make (or refresh) the packed copies of a float ``weight`` and record them."""
    onednn, amx = packed_copies(weight)
    return record(weight, onednn=onednn, amx=amx)


def process_weights_after_loading(module: nn.Module) -> PackedWeight | None:
    """Process one linear layer's loaded weight for the kernels that run it: a float weight
    oneDNN takes gets its packed copies (made afresh: it may have been written through
    ``.data``), one only the GEMV reads a record without copies (both with the kernels
    the layer's measured kernels, if any), a quantized one is rearranged in place (once).
    Returns the record (``packed_weights.py``), or None for a weight run as it is."""
    weight = module.weight
    if is_quantized(weight):
        return pack_for_kernel(weight)
    if not (can_pack(weight) or _gemv_reads(weight)):
        return None
    entry = pack_weight(weight) if can_pack(weight) else record(weight)
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
    return sum(1 for w in weights if can_pack(w))


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
    logger.info("packed %d linear weights for oneDNN (CPU)", count)
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
