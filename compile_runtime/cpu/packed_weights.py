"""Processed weights: what a linear layer's weight became after loading, one record per weight.

A layer's weight is processed once after loading
(``cpu_linear.process_weights_after_loading``): a float32 weight gets oneDNN's blocked copy,
a bf16 one with AMX the AMX kernel's copy; a quantized weight's bytes are rearranged in place into the int8 kernel's layout. Every
reader finds the result here with ``lookup``: ``cpu_linear`` and the quantized kernels,
the tied embedding reading the LM head's bytes, ``dequantize``.

Not kept on the layer and handed to the op by its forward (as vLLM keeps them), because
oneDNN's copy is an MKLDNN tensor, which has no storage, and the CPU graph wrapper takes the
address of every tensor a captured piece is given, at every replay; because the note that a
quantized weight's bytes are rearranged is needed wherever those bytes are read (the tied
embedding, ``dequantize``), not only by the layer's forward; and because a layer's weight
can move (``param.data = ...``), which the record must notice. So the graph holds the
ordinary weight, and the op finds the record by the weight's address.

One rule says a record is current (``lookup``): the tensor asked about is the processed
parameter, still at that address, or a view of it laid out as it was then, and its version
has not moved. A weight changed in place (its version moved) runs unprocessed, never
stale. Writes through ``param.data`` (as loaders do) move no version: a loader calls
``forget`` before writing and processes the layers again after. A record lasts as long as
its parameter.
"""

from __future__ import annotations

import weakref

import torch

from compile_runtime.torch_internals import tensor_version


class PackedWeight:
    """One weight's processed forms, and the parameter's layout and version when made."""

    __slots__ = ("amx", "built_in", "kernels", "onednn", "shape", "stride", "version", "weight")

    def __init__(
        self,
        weight: weakref.ref,
        like: torch.Tensor,
        onednn: torch.Tensor | None,
        amx: torch.Tensor | None,
    ) -> None:
        self.weight = weight  # the parameter processed
        self.shape = like.shape
        self.stride = like.stride()
        self.version = tensor_version(like)
        self.onednn = onednn  # oneDNN's blocked copy (float weights)
        self.amx = amx  # the AMX kernel's tile copy (bf16, cpu_amx.py)
        # A float weight's kernel per row bucket, measured here (cpu_linear.py); None:
        # the built-in choice.
        self.kernels: tuple[str, ...] | None = None
        # Rows -> the built-in choice, worked out at a row count's first call (cpu_linear.py).
        self.built_in: dict[int, str] = {}


_by_address: dict[int, PackedWeight] = {}


def lookup(weight: torch.Tensor) -> PackedWeight | None:
    """The record of ``weight``, or None unless it is certainly current: ``weight`` is the
    parameter processed (then at this address), or a view of it laid out as it was (same
    address, shape and strides), and the version has not moved since."""
    address = weight.data_ptr()
    entry = _by_address.get(address)
    if entry is None:
        return None
    original = entry.weight()
    if original is not weight and (  # a view: checked field by field (the op gets the parameter)
        original is None
        or original.data_ptr() != address
        or weight.shape != entry.shape
        or weight.stride() != entry.stride
    ):
        return None
    return entry if tensor_version(weight) == entry.version else None


def record(
    weight: torch.Tensor,
    *,
    onednn: torch.Tensor | None = None,
    amx: torch.Tensor | None = None,
) -> PackedWeight:
    """Note ``weight``'s processed forms (replacing any earlier record at its address). A
    quantized weight's record has no copy: it says the bytes are in the kernel's layout."""
    address = weight.data_ptr()

    def drop(ref: weakref.ref) -> None:  # the parameter is gone: so is its record
        entry = _by_address.get(address)
        if entry is not None and entry.weight is ref:
            del _by_address[address]

    entry = PackedWeight(weakref.ref(weight, drop), weight, onednn, amx)
    _by_address[address] = entry
    return entry


def forget(weight: torch.Tensor) -> None:
    """``weight`` (or a slice of it) is about to be written through ``.data``: every record of
    a parameter on its storage is dropped, the layer processed again after loading."""
    storage = weight.untyped_storage().data_ptr()
    for address, entry in list(_by_address.items()):
        original = entry.weight()
        if original is None or original.untyped_storage().data_ptr() == storage:
            _by_address.pop(address, None)
