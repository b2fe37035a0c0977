"""Which CUDA graph a batch runs in, and how far it is padded.

The dispatcher is the single source of truth for which graphs exist: it
builds the keys once from the capture sizes, start-up capture asks it what to
capture, and every step asks it for ``(runtime mode, BatchDescriptor)``. The
graph wrappers then trust what the forward context says.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import replace

import numpy as np

from compile_runtime.config import CompilationConfig, CUDAGraphMode, ResolvedModes
from compile_runtime.forward_context import BatchDescriptor
from compile_runtime.planner.capture_sizes import resolve_capture_sizes

logger = logging.getLogger(__name__)

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


def is_uniform_decode(query_lens: Sequence[int] | np.ndarray, query_len: int = 1) -> bool:
    """Whether a batch is a uniform decode: at least one request, each running exactly
    ``query_len`` tokens (one decode token and ``query_len - 1`` drafts).

    The one definition: the runner asks it of every step (the decode graphs are captured
    for these batches, ``BatchDescriptor.uniform``), attention metadata of one-token decodes
    (both inline it, as ``n > 0 and (lens == query_len).all()``: a call less per step).
    """
    lens = np.asarray(query_lens)
    return lens.size > 0 and bool((lens == query_len).all())


def padding_table(sizes: Collection[int]) -> tuple[int, ...]:
    """``table[n]`` is the smallest size >= n (``table[0]`` is 0), for n up to max(sizes)."""
    table = [0] * (max(sizes) + 1) if sizes else [0]
    n = 0
    for size in sorted(sizes):
        while n <= size:
            table[n] = size if n else 0
            n += 1
    return tuple(table)


class CudagraphDispatcher:
    """Maps a batch to a runtime mode and a padded ``BatchDescriptor`` in O(1)."""

    def __init__(
        self,
        config: CompilationConfig,
        *,
        max_num_tokens: int | None = None,
        max_num_reqs: int | None = None,
        capture_sizes: Sequence[int] | None = None,
    ):
        """``capture_sizes``: as the engine decided them (``EngineConfig``); None: resolved
        here from ``config``."""
        self.config = config
        self.capture_sizes = (
            list(capture_sizes)
            if capture_sizes is not None
            else resolve_capture_sizes(config, max_num_tokens)
        )
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.mode = NONE
        self._mixed_mode = self._decode_mode = NONE  # the mode's two halves, read every step
        self.uniform_decode_query_len = 1
        self.keys: dict[CUDAGraphMode, list[BatchDescriptor]] = {PIECEWISE: [], FULL: []}
        self.keys_initialized = False
        # Padding tables and the descriptor of every padded size, per kind of batch.
        self._mixed_pad: tuple[int, ...] = (0,)
        self._decode_pad: tuple[int, ...] = (0,)
        self._mixed_desc: dict[int, BatchDescriptor] = {}
        self._decode_desc: dict[int, BatchDescriptor] = {}
        self.lora = False  # whether keys come in pairs, without and with LoRA adapters

    def initialize_keys(
        self,
        resolved_mode: CUDAGraphMode | ResolvedModes,
        uniform_decode_query_len: int = 1,
        lora: bool = False,
    ) -> None:
        """Build the graph keys for ``resolved_mode`` (after ``CompilationConfig.resolve``);
        with ``lora``, each key also in its ``has_lora`` form."""
        if isinstance(resolved_mode, ResolvedModes):
            resolved_mode = resolved_mode.cudagraph_mode
        if uniform_decode_query_len < 1:
            raise ValueError(
                f"uniform_decode_query_len must be >= 1, got {uniform_decode_query_len}"
            )
        self.mode = resolved_mode
        self.uniform_decode_query_len = q = uniform_decode_query_len
        mixed, decode = resolved_mode.mixed_mode(), resolved_mode.decode_mode()
        self._mixed_mode, self._decode_mode = mixed, decode

        mixed_sizes = self.capture_sizes if mixed != NONE else []
        decode_sizes: list[int] = []
        if decode != NONE and decode != mixed:
            # Decode graphs hold whole requests of q tokens each: the capture sizes, read as
            # request counts, times q (for q = 1, the capture sizes themselves).
            decode_sizes = [
                q * s
                for s in self.capture_sizes
                if (self.max_num_reqs is None or s <= self.max_num_reqs)
                and (self.max_num_tokens is None or q * s <= self.max_num_tokens)
            ]
        self._mixed_desc = {s: BatchDescriptor(s) for s in mixed_sizes}
        self._decode_desc = {s: BatchDescriptor(s, s // q, uniform=True) for s in decode_sizes}
        self._mixed_pad = padding_table(mixed_sizes)
        self._decode_pad = padding_table(decode_sizes)
        self.lora = lora
        self.keys = {PIECEWISE: [], FULL: []}
        if mixed != NONE:
            self.keys[mixed] += self._with_lora_forms(self._mixed_desc.values())
        if decode_sizes:
            self.keys[decode] += self._with_lora_forms(self._decode_desc.values())
        self.keys_initialized = True
        self._check_compile_sizes()
        logger.info(
            "cudagraph keys for %s: %d PIECEWISE, %d FULL (sizes up to %d)",
            resolved_mode.name,
            len(self.keys[PIECEWISE]),
            len(self.keys[FULL]),
            max(self.capture_sizes, default=0),
        )

    def _with_lora_forms(self, descriptors: Collection[BatchDescriptor]) -> list[BatchDescriptor]:
        if not self.lora:
            return list(descriptors)
        return [d for base in descriptors for d in (base, replace(base, has_lora=True))]

    def _check_compile_sizes(self) -> None:
        """Every compile size a mixed batch can have must survive padding.

        Otherwise a batch of that size is padded up and the exact-size code
        compiled for it never runs.
        """
        if self.mode.mixed_mode() == NONE:
            return
        table = self._mixed_pad
        for size in self.config.compile_sizes:
            if size < len(table) and table[size] != size:
                raise ValueError(
                    f"compile_sizes contains {size}, but batches of {size} tokens are padded to "
                    f"the CUDA graph size {table[size]}, so the code compiled for {size} would "
                    f"never run; add {size} to cudagraph_capture_sizes or remove it from "
                    "compile_sizes"
                )

    def padded_size(self, num_tokens: int, uniform_decode: bool = False) -> int | None:
        """The graph size ``num_tokens`` pads to, or None above the largest one."""
        table = self._decode_pad if uniform_decode else self._mixed_pad
        return table[num_tokens] if 0 < num_tokens < len(table) else None

    def dispatch(
        self,
        num_tokens: int,
        uniform_decode: bool = False,
        invalid_modes: Collection[CUDAGraphMode] = (),
        has_lora: bool = False,
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The runtime mode and padded descriptor for a batch of ``num_tokens``.

        A uniform decode batch takes its own (FULL) graph when one exists;
        anything else takes the mixed mode's graph; otherwise NONE with the
        exact count. ``invalid_modes`` rules modes out for this batch. ``has_lora``: some
        token runs an adapter (the descriptor says so, whatever the mode).
        """
        # One function, not two: every step dispatches.
        mode, descriptor = NONE, None
        if uniform_decode and num_tokens < len(self._decode_pad) and num_tokens > 0:
            if self._decode_mode not in invalid_modes:
                if num_tokens % self.uniform_decode_query_len:
                    raise ValueError(
                        f"a uniform decode batch has a multiple of {self.uniform_decode_query_len} "
                        f"tokens (uniform_decode_query_len), got {num_tokens}"
                    )
                mode = self._decode_mode
                descriptor = self._decode_desc[self._decode_pad[num_tokens]]
        if descriptor is None and 0 < num_tokens < len(self._mixed_pad):
            if self._mixed_mode not in invalid_modes:
                mode = self._mixed_mode
                descriptor = self._mixed_desc[self._mixed_pad[num_tokens]]
        if descriptor is None:
            mode, descriptor = NONE, BatchDescriptor(num_tokens)
        if has_lora:
            if not self.lora and mode != NONE:
                raise ValueError(
                    "a batch with LoRA adapters on a dispatcher built without LoRA keys; "
                    "initialize_keys(..., lora=True) when the engine enables LoRA"
                )
            descriptor = replace(descriptor, has_lora=True)
        return mode, descriptor

    def unreplayed_reason(self, num_tokens: int) -> str:
        """Why a batch of ``num_tokens`` that ``dispatch`` gave NONE runs without a graph."""
        largest = max((d.num_tokens for keys in self.keys.values() for d in keys), default=0)
        if num_tokens > largest:
            return "above the largest captured size"
        return "no captured graph for this kind of batch"

    def discard(self, mode: CUDAGraphMode, descriptor: BatchDescriptor) -> None:
        """Forget the ``mode`` graph of ``descriptor`` (its capture was refused): its batches
        pad to the next size of the same kind, or take the other mode, or run unreplayed."""
        if descriptor not in self.keys.get(mode, []):
            raise ValueError(f"no {mode.name} graph key {descriptor} to discard")
        # Both LoRA forms of a size go together: the padding tables are per size.
        for form in self._with_lora_forms([replace(descriptor, has_lora=False)]):
            if form in self.keys[mode]:
                self.keys[mode].remove(form)
        descriptor = replace(descriptor, has_lora=False)
        table = self._decode_desc if descriptor in self._decode_desc.values() else self._mixed_desc
        table.pop(descriptor.num_tokens, None)
        self._decode_pad = padding_table(self._decode_desc)
        self._mixed_pad = padding_table(self._mixed_desc)

    def capture_descriptors(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """What start-up must capture: PIECEWISE then FULL, each largest first."""
        return [
            (mode, desc)
            for mode in (PIECEWISE, FULL)
            for desc in sorted(self.keys[mode], key=lambda d: d.num_tokens, reverse=True)
        ]
