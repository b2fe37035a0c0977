"""The CPU platform: batched attention over the paged cache, gloo, no staging copies, CPU
graphs of native calls, a KV budget from free RAM, our thread count and packed weights."""

from __future__ import annotations

from compile_runtime.platforms.base import Platform

CPU = Platform(
    name="cpu",
    # cpu_batched: the whole batch per layer; torch_native: the readable reference.
    attention_backends=("cpu_batched", "torch_native"),
    distributed_backend="gloo",
    stages_inputs=False,
    pins_staging=False,
    graph_kind="cpu",
    profiles_memory=False,
    sets_threads=True,
    packs_weights=True,
    zeroes_lazily=True,
    serves_from_worker=True,
    builds_kernels_ahead=True,
    prefers_16bit=False,
)
