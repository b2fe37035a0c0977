"""Choosing an attention backend: by name, or the first that fits the device.

Backend modules are imported only when looked at, so an optional dependency
(FlashInfer, Triton) that is missing costs nothing until it is asked for.

Order of precedence for the name: the ``name`` argument, then an enclosing
``use_attn_backend(name)`` block, then the ``COMPILE_RUNTIME_ATTENTION_BACKEND``
environment variable, then automatic choice. Automatic choice on CUDA prefers
``triton`` (ships with CUDA torch, no just-in-time nvcc, FULL graphs for every
batch), then ``flashinfer``, then ``torch_native``; on CPU it is
``cpu_batched`` (one SDPA call per layer for the whole batch), with
``torch_native`` as the readable reference (Triton on CPU is the interpreter:
tests only).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterable, Iterator

import torch

from compile_runtime.attention.backend import AttentionBackend, AttentionBackendError
from compile_runtime.config import AttentionCGSupport
from compile_runtime.platforms.select import platform_for

logger = logging.getLogger(__name__)

ENV_VAR = "COMPILE_RUNTIME_ATTENTION_BACKEND"

_BACKENDS: dict[str, tuple[str, str]] = {
    "torch_native": ("compile_runtime.backends.attention.torch_native", "TorchNativeBackend"),
    "cpu_batched": ("compile_runtime.cpu.attention", "CPUBatchedBackend"),
    "triton": ("compile_runtime.backends.attention.triton_attn", "TritonBackend"),
    "flashinfer": ("compile_runtime.backends.attention.flashinfer_attn", "FlashInferBackend"),
}
_selected: list[str] = []


def backend_names() -> list[str]:
    return list(_BACKENDS)


def load_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under ``name`` (imports its module)."""
    if name not in _BACKENDS:
        raise AttentionBackendError(
            f"unknown attention backend {name!r}; choose one of {backend_names()}"
        )
    module, attr = _BACKENDS[name]
    return getattr(importlib.import_module(module), attr)


@contextlib.contextmanager
def use_attn_backend(name: str) -> Iterator[None]:
    """Attention layers constructed inside this block use backend ``name``."""
    load_backend(name)  # fail early on a typo
    _selected.append(name)
    try:
        yield
    finally:
        _selected.pop()


def get_attn_backend(
    name: str | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    head_size: int | None = None,
) -> type[AttentionBackend]:
    """The backend class to use for this device, dtype and head size.

    A backend asked for by name that cannot run here is an error saying why
    (and what to install); it never silently falls back to another.
    """
    device = torch.device(device) if device is not None else torch.get_default_device()
    if name is None:
        name = _selected[-1] if _selected else os.environ.get(ENV_VAR) or None
    if name is not None:
        backend = load_backend(name)
        reason = backend.unsupported_reason(device, dtype, head_size)
        if reason:
            raise AttentionBackendError(f"attention backend {name!r} cannot run here: {reason}")
        return backend
    reasons = []
    for candidate in platform_for(device).attention_backends:
        backend = load_backend(candidate)
        reason = backend.unsupported_reason(device, dtype, head_size)
        if reason is None:
            logger.debug("attention backend for %s/%s: %s", device, dtype, candidate)
            return backend
        reasons.append(f"{candidate}: {reason}")
    raise AttentionBackendError(
        f"no attention backend runs on {device} with dtype {dtype} and head size {head_size}: "
        + "; ".join(reasons)
    )


def min_cg_support(backends: Iterable[type[AttentionBackend]]) -> AttentionCGSupport:
    """The CUDA graph support every backend in use has (ALWAYS when there are none)."""
    return min((b.graph_support() for b in backends), default=AttentionCGSupport.ALWAYS)
