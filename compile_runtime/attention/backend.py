"""What every attention backend declares and implements.

A backend is a class with class-level facts (name, CUDA graph support, the
dtypes, head sizes and devices it takes) plus two factories: the per-layer
implementation that computes attention, and the per-step metadata builder.
The registry reads the facts to choose one; the layer holds an instance of
its implementation. ``AttentionImpl.forward`` is the one place that writes the
step's keys/values into the cache and zeroes the output's padding rows; the
implementations only compute.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import torch

from compile_runtime.attention.kv_cache import write_kv_cache
from compile_runtime.attention.metadata import AttentionMetadata, AttentionMetadataBuilder
from compile_runtime.attention.spec import AttentionSpec
from compile_runtime.config import AttentionCGSupport


class AttentionBackendError(ValueError):
    """A backend was selected where it cannot run; the message says what to change."""


class AttentionImpl:
    """Computes one layer's attention for one step (called by the custom op).

    ``forward`` is the one owner of the padding contract; impls implement ``compute``
    (and, where needed, the ``check`` hook and the ``compute_writes_cache`` flag), never
    ``forward`` itself.
    """

    # True when ``compute`` writes the step's keys and values into the cache itself (a
    # kernel that writes them in the same pass as its attention); it must then write
    # exactly what ``write_kv_cache`` would, before anything reads the cache.
    compute_writes_cache: ClassVar[bool] = False

    def __init__(self, spec: AttentionSpec):
        self.spec = spec

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        output: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    ) -> None:
        """Write this step's keys/values into the cache, then attention into ``output``.

        The padding contract, for every backend: the tensors have the padded token count
        and the tokens past ``metadata.num_actual_tokens`` are padding. Every token with a
        slot is written there (``write_kv_cache``: padding slots are -1, the null block,
        so the write has one shape per padded size and can be captured). ``compute`` then
        writes the first rows of ``output`` and says how many; the rows after them are
        zeroed here. Inside a FULL CUDA graph ``num_actual_tokens`` is a host number frozen
        at capture, so there ``compute`` writes every row and returns the padded count
        (Triton's kernel zeroes the padding rows, FlashInfer's graph decode attends them to
        the null block); rows past the real tokens are never read.
        """
        self.check(query, metadata)
        if not self.compute_writes_cache:
            write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        rows = self.compute(query, key, value, kv_cache, metadata, output)
        if rows < output.shape[0]:
            output[rows:].zero_()

    def check(self, query: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Hook: raise ``AttentionBackendError`` for a step this impl cannot run, before
        anything is written. Default: every step runs."""

    def compute(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        output: torch.Tensor,
    ) -> int:
        """Attention of the step's queries over ``kv_cache`` (which holds this step's keys and
        values, unless ``compute_writes_cache``) into the first rows of ``output``; returns
        how many rows it wrote (``metadata.num_actual_tokens`` for most)."""
        raise NotImplementedError


class AttentionBackend:
    name: ClassVar[str]
    cg_support: ClassVar[AttentionCGSupport]
    supported_dtypes: ClassVar[frozenset[torch.dtype]]
    supported_devices: ClassVar[frozenset[str]]  # device types: "cpu", "cuda"
    supported_head_sizes: ClassVar[frozenset[int] | None] = None  # None = any
    impl_cls: ClassVar[type[AttentionImpl]]
    builder_cls: ClassVar[type[AttentionMetadataBuilder]] = AttentionMetadataBuilder

    @classmethod
    def graph_support(cls) -> AttentionCGSupport:
        """What the backend supports on this machine (``cg_support`` unless it depends on
        what builds here)."""
        return cls.cg_support

    @classmethod
    def missing_dependency(cls) -> str | None:
        """Why the backend cannot be used in this environment (what to install), or None."""
        return None

    @classmethod
    def unsupported_reason(
        cls,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        head_size: int | None = None,
    ) -> str | None:
        """Why the backend cannot take this device/dtype/head size, or None if it can."""
        missing = cls.missing_dependency()
        if missing:
            return missing
        if device is not None and torch.device(device).type not in cls.supported_devices:
            return f"runs on {sorted(cls.supported_devices)}, not {torch.device(device).type!r}"
        if dtype is not None and dtype not in cls.supported_dtypes:
            names = sorted(str(d).removeprefix("torch.") for d in cls.supported_dtypes)
            return f"takes dtypes {names}, not {str(dtype).removeprefix('torch.')}"
        if (
            head_size is not None
            and cls.supported_head_sizes is not None
            and head_size not in cls.supported_head_sizes
        ):
            return f"takes head sizes {sorted(cls.supported_head_sizes)}, not {head_size}"
        return None

    @classmethod
    def metadata_key(cls, spec: AttentionSpec) -> Hashable:
        """What of a layer's spec its step metadata depends on: layers with different keys get
        their own builder (FlashInfer plans window and soft cap into the step). Default: none."""
        return None

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> AttentionImpl:
        return cls.impl_cls(spec)

    @classmethod
    def make_builder(
        cls,
        spec: AttentionSpec,
        block_size: int,
        max_num_reqs: int,
        device: torch.device | str,
    ) -> AttentionMetadataBuilder:
        """The step's metadata builder for layers with this spec (one per group of layers)."""
        return cls.builder_cls(spec, block_size, max_num_reqs, device)
