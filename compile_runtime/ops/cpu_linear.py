"""Linear layers on CPU with weights packed once for oneDNN.

``F.linear`` on CPU calls MKL's sgemm, which lays the weight out for its
micro-kernels again on every call. oneDNN with the weight reordered once into
its blocked layout is faster at every row count the runtime runs: measured in
the 33M Llama's decode steps on 2 cores (Sapphire Rapids, fp32), a step took
0.6x the time at 1 row (7.4 vs 12.2 ms), 0.4x at 2 rows, 0.44-0.57x at 16-32
rows. (An isolated benchmark of a few weights that stay in cache shows the plain
call ahead at 1-2 rows; with a whole model's weights streaming from memory it is
not.) So ``cpu_linear`` uses the packed weight whenever there is one.

The packed copy is an opaque MKLDNN tensor that Dynamo cannot trace, so it
lives in a side table keyed by the weight, not in the module: the graph sees
the ordinary weight and ``torch.ops.compile_runtime.cpu_linear`` (opaque to
Dynamo and Inductor) finds its packed twin at run time. A weight changed in
place after packing (its version counter moved) or not packed at all runs
through ``F.linear``. In bf16 on a CPU with AMX, up to 64 rows (decode steps) go to the
AMX kernel of ``cpu_amx.py``, from a third copy in its own tile layout; else a few
rows go to the GEMV of ``cpu_gemv.py``, which reads the plain weight. Both stream
the weight at the memory bandwidth, which oneDNN's GEMM does not at these sizes. Writes through ``param.data`` (as weight loaders do)
move no version counter: the loader re-packs after loading
(``repack_linear_weights``). The cost is memory: one more copy of every packed
weight (two in bf16 with AMX). A quantized weight (``uint8`` blocks of GGUF's Q8_0,
Q4_0 or Q4_1, ``cpu_quant_formats.py``) has no copy: packing rearranges its bytes in
place into the int8 kernel's layout (``cpu_quant_gemm.py``), which reads them.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from compile_runtime.ops.cpu_amx import MAX_ROWS as MAX_AMX_ROWS
from compile_runtime.ops.cpu_amx import amx_linear
from compile_runtime.ops.cpu_amx import pack as pack_for_amx
from compile_runtime.ops.cpu_gemv import MOST_ROWS as MAX_GEMV_ROWS
from compile_runtime.ops.cpu_gemv import gemv_dtypes, gemv_linear
from compile_runtime.ops.cpu_quant_gemm import pack_for_kernel, quant_linear
from compile_runtime.ops.hugepages import move_into_hugepages

logger = logging.getLogger(__name__)

OP_NAME = "compile_runtime::cpu_linear"
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class _Packed:
    weight: weakref.ref  # the parameter the copy was made from
    version: int
    packed: torch.Tensor
    amx: torch.Tensor | None = None  # the AMX kernel's copy (bf16 only, cpu_amx.py)


_packed: dict[int, _Packed] = {}  # by the weight's data pointer


def _lookup(weight: torch.Tensor) -> _Packed | None:
    """The packed copies of ``weight``, or None unless they are certainly current: same
    storage, shape and strides as the packed parameter now has, same version."""
    entry = _packed.get(weight.data_ptr())
    if entry is None:
        return None
    original = entry.weight()
    if (
        original is None
        or original.data_ptr() != weight.data_ptr()
        or original.shape != weight.shape
        or original.stride() != weight.stride()
        or entry.version != weight._version
    ):
        return None
    return entry


def cpu_linear_impl(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if weight.dtype == torch.uint8:  # quantized (ops/cpu_quant_formats.py): no packed copy
        return quant_linear(x, weight, bias)
    rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
    entry = _lookup(weight)
    if entry is not None and entry.amx is not None and rows <= MAX_AMX_ROWS:
        out = amx_linear(x, entry.amx, bias)
        if out is not None:
            return out
    if rows <= MAX_GEMV_ROWS:  # a few rows: the GEMV reads the plain weight, faster
        out = gemv_linear(x, weight, bias)
        if out is not None:
            return out
    if entry is None:
        return F.linear(x, weight, bias)
    two_d = x.dim() == 2  # the runtime's layers: [tokens, features]
    flat = x if two_d else x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), entry.packed, bias, "none", [], "")
    return out if two_d else out.view(*x.shape[:-1], weight.shape[0])


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


def pack_weight(weight: torch.Tensor) -> None:
    """Make (or refresh) the packed copy of ``weight``; dropped when ``weight`` is freed."""
    key = weight.data_ptr()
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)
        amx = pack_for_amx(weight.detach())
    _packed[key] = _Packed(
        weakref.ref(weight, lambda _: _packed.pop(key, None)), weight._version, packed, amx
    )


def _pack_floats(weights: list[torch.Tensor]) -> int:
    """Packed copies of float weights (each once), the weights and their AMX copies in
    huge pages (``hugepages.py``: the step streams them); returns how many. The weights
    move first: their copies are found by the weight's address."""
    weights = list({id(w): w for w in weights}.values())
    move_into_hugepages(weights)
    for weight in weights:
        pack_weight(weight)
    move_into_hugepages([a for a in (_packed[w.data_ptr()].amx for w in weights) if a is not None])
    return len(weights)


def pack_linear_weights(model: nn.Module) -> int:
    """Pack ``weight`` of every module that has a ``use_packed_weight`` flag; set the flag.

    Call after the weights are loaded and before the first forward (the flag is
    read when the forward is traced). Returns how many weights were packed. A float
    weight oneDNN cannot take in its dtype here (bf16 without AVX512-BF16 or AMX) is
    flagged too when the GEMV reads that dtype: ``cpu_linear`` then runs it by the GEMV,
    ``F.linear`` past the GEMV's rows.
    """
    quantized, floats, gemv_only = [], [], []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "use_packed_weight") and is_quantized(weight):
            quantized.append(weight)
            module.use_packed_weight = True
        elif hasattr(module, "use_packed_weight") and can_pack(weight):
            floats.append(weight)
            module.use_packed_weight = True
        elif hasattr(module, "use_packed_weight") and _gemv_reads(weight):
            gemv_only.append(weight)  # no oneDNN copy in this dtype here: the GEMV's alone
            module.use_packed_weight = True
    move_into_hugepages(list({id(w): w for w in gemv_only}.values()))
    count = _pack_floats(floats)
    pack_for_kernel(quantized)  # in place: the int8 kernel's layout, same bytes
    logger.info("packed %d linear weights for oneDNN (CPU)", count)
    return count


def repack_linear_weights(model: nn.Module) -> None:
    """Refresh the packed copies of ``model``'s packed layers after their weights changed.

    Writes through ``param.data`` (as weight loaders do) do not move the version counter,
    so they cannot be detected: whoever writes weights that way must call this.
    """
    quantized, floats = [], []
    for module in model.modules():
        if not getattr(module, "use_packed_weight", False):
            continue
        if is_quantized(module.weight):
            quantized.append(module.weight)
        elif can_pack(module.weight):  # not the GEMV-only weights: nothing to refresh
            floats.append(module.weight)
    _pack_floats(floats)
    pack_for_kernel(quantized)  # once: a packed weight is left as it is


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool
) -> torch.Tensor:
    """``F.linear``, through the packed weight when the layer's weight was packed."""
    if packed:
        return torch.ops.compile_runtime.cpu_linear(x, weight, bias)
    return F.linear(x, weight, bias)
