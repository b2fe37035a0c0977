"""The CUDA platform: Triton attention first (FULL graphs for every batch, no JIT nvcc),
then FlashInfer; NCCL; pinned staging copies; CUDA graphs; a KV budget from device memory."""

from __future__ import annotations

from compile_runtime.platforms.base import Platform

CUDA = Platform(
    name="cuda",
    attention_backends=("triton", "flashinfer", "torch_native"),
    distributed_backend="nccl",
    stages_inputs=True,
    pins_staging=True,
    graph_kind="cuda",
    profiles_memory=True,
    sets_threads=False,
    packs_weights=False,
    zeroes_lazily=False,
    serves_from_worker=False,
    builds_kernels_ahead=False,
    prefers_16bit=True,
)
