"""Per-step state that layers and the attention op read during one forward.

The runner sets it around each forward; nothing else carries per-step state
(attention metadata, the CUDA graph mode, the padded batch) into the graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from compile_runtime.config import CUDAGraphMode

# What one forward runs in (the others are configurations, resolved into these per batch).
RUNTIME_MODES = frozenset((CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL))


@dataclass(frozen=True)
class BatchDescriptor:
    """The key of one captured graph: what about a batch fixes its graph.

    New keys (a LoRA flag, ...) are added as fields with a default, so
    existing descriptors keep their meaning.
    """

    num_tokens: int
    num_reqs: int | None = None  # None: any number of requests
    uniform: bool = False  # a uniform decode batch (is_uniform_decode): the decode graphs
    # Some token of the batch runs a LoRA adapter: its graphs hold the LoRA calls, those of
    # the same batch without adapters do not (compile_runtime/cpu/lora.py).
    has_lora: bool = False

    def relaxed(self) -> BatchDescriptor:
        """The mixed-batch form: same token count, any requests, any query lengths."""
        return BatchDescriptor(self.num_tokens, has_lora=self.has_lora)


class ForwardContextError(RuntimeError):
    """The forward context was read outside a forward."""


@dataclass
class ForwardContext:
    # Attention metadata of this step: one object shared by all layers, or a
    # dict from layer name to metadata when layers differ (sliding window, ...).
    attn_metadata: Any
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None
    # Padded token count of this step (what the graphs see).
    num_tokens: int | None = None

    def metadata_for(self, layer_name: str) -> Any:
        if isinstance(self.attn_metadata, dict):
            return self.attn_metadata[layer_name]
        return self.attn_metadata


_stack: list[ForwardContext] = []


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: Any,
    *,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
    num_tokens: int | None = None,
) -> Iterator[ForwardContext]:
    if cudagraph_runtime_mode not in RUNTIME_MODES:
        raise ValueError(
            f"cudagraph_runtime_mode must be a runtime mode (NONE, PIECEWISE, FULL), got "
            f"{cudagraph_runtime_mode.name}; use mode.decode_mode() or mode.mixed_mode()"
        )
    if num_tokens is None and batch_descriptor is not None:
        num_tokens = batch_descriptor.num_tokens
    context = ForwardContext(attn_metadata, cudagraph_runtime_mode, batch_descriptor, num_tokens)
    _stack.append(context)
    try:
        yield context
    finally:
        _stack.pop()


def get_forward_context() -> ForwardContext:
    if not _stack:
        raise ForwardContextError(
            "no forward context: this is read during a model forward only; wrap the call in "
            "`with compile_runtime.set_forward_context(attn_metadata, ...)`"
        )
    return _stack[-1]


def is_forward_context_available() -> bool:
    return bool(_stack)


def current_forward_context() -> ForwardContext | None:
    """The forward context, or None outside a forward: one call where a step's hot path
    would make two (``is_forward_context_available``, then ``get_forward_context``)."""
    return _stack[-1] if _stack else None
