"""Embedding lookups in a quantized table: only the looked-up rows are dequantized.

``torch.ops.compile_runtime.quant_embedding(ids, weight, dtype)`` is ``F.embedding(ids,
dequantize(weight))`` in ``dtype`` for a quantized table (``cpu_quant_formats.py``), as
opaque to Dynamo and Inductor as ``cpu_linear``: the graph holds the op, the table
stays in its bytes (the tied LM head reads the same bytes through ``cpu_linear``).
"""

from __future__ import annotations

import torch

from compile_runtime.cpu.quant_gemm import quant_rows

OP_NAME = "compile_runtime::quant_embedding"


def quant_embedding_impl(
    ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return quant_rows(weight, ids, dtype)


_lib = torch.library.Library("compile_runtime", "FRAGMENT")
_lib.define("quant_embedding(Tensor ids, Tensor weight, ScalarType dtype) -> Tensor")
_lib.impl("quant_embedding", quant_embedding_impl, "CPU")


@torch.library.register_fake(OP_NAME)
def _quant_embedding_fake(ids, weight, dtype):
    return weight.new_empty(*ids.shape, weight.shape[1] * 32, dtype=dtype)


def quant_embedding(ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``ids`` of the quantized table ``weight``, dequantized to ``dtype``."""
    return torch.ops.compile_runtime.quant_embedding(ids, weight, dtype)
