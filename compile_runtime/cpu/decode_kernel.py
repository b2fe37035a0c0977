"""A paged decode-attention kernel in C for CPUs, compiled on first use.

Decode attention with torch ops must first gather each request's keys and
values out of their blocks into one padded tensor (``index_select``), then run
SDPA over the copy: the cached keys and values cross memory twice, and the
gather alone was a large part of the attention time. This kernel reads
the blocks in place through the block table: per (request, KV head), one pass
for the scores of every query head sharing that KV head (so grouped-query
attention reads each key once), a softmax, one pass over the values. It also
writes the step's new keys and values into their slots first, so a layer's
decode is one call. The common head shapes (head size 64 or 128, 1-4 query
heads per KV head) get copies with both sizes known at compile time: their
loops unroll into whole vector registers and the value accumulators stay in
registers, faster than the generic loop with bit-identical results. On top of that the
scores are taken 16 keys at a time (one reduction for 16 dot products), the
softmax's exp is vectorised, and each next block is prefetched (blocks lie
anywhere in the cache): on SmolLM2's shape a layer's decode then takes about the
time to read its keys and values from memory (the README's "On a CPU").

The C is ``compile_runtime/cpu/csrc/paged_decode.c``, built and cached by
``compile_runtime/cpu/c_library.py`` (OpenMP over (request, KV head) on torch's own OpenMP runtime).
Without a compiler, or if the build fails, ``load_decode_kernel()`` returns None once
with a warning and the backend computes the same thing with torch ops.

float32 (``paged_decode_f32``) and bfloat16 (``paged_decode_bf16``: the cache, queries
and outputs in bf16, scores, softmax and sums in float32) from one body; float16 takes
the torch path.
"""

from __future__ import annotations

import functools

from compile_runtime.cpu.c_library import load_c_library
from compile_runtime.cpu.native_function import NativeFunction


@functools.cache
def load_decode_kernel() -> dict[str, NativeFunction] | None:
    """The compiled kernels by element type ("f32", "bf16"), or None (with one warning) if
    they cannot be built here."""
    lib = load_c_library("paged_decode", "CPU decode attention")
    if lib is None:
        return None
    return {name: lib.native(f"paged_decode_{name}") for name in ("f32", "bf16")}
