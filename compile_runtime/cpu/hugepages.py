"""Weights in huge pages: parameters moved together into one mapping advised for 2 MiB pages.

A decode step at batch 1 streams every weight once, front to back. In 4 KiB pages
that is a TLB miss every 4 KiB (24,000 for SmolLM2's 96 MB of Q4_1 weights, every
token), and the weights sit in whatever pages the loader's allocations got. Moved
into one anonymous mapping that Linux backs with transparent huge pages
(``madvise(MADV_HUGEPAGE)``: the ``madvise`` and ``always`` settings of
``/sys/kernel/mm/transparent_hugepage/enabled``), the same kernel on the same bytes
runs faster (the README's "Quantized weights" gives the linears' times before and
after). Elsewhere (not Linux, THP off) the
mapping is ordinary memory and nothing is lost but the copy.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
from collections.abc import Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each weight starts on a cache line


def _whole_storage(p: torch.Tensor) -> bool:
    """``p`` is its storage, all of it: moving it breaks no other tensor's sharing."""
    return (
        p.is_contiguous()
        and p.storage_offset() == 0
        and p.untyped_storage().nbytes() == p.numel() * p.element_size()
    )


_held_back = False


@contextlib.contextmanager
def moves_held_back() -> Iterator[None]:
    """Inside, ``move_into_hugepages`` moves nothing: for weights that are written to a
    packed-weight file and then mapped from it, with the same advice (``models/
    mapped_weights.py``), the copy would be thrown away."""
    global _held_back
    previous, _held_back = _held_back, True
    try:
        yield
    finally:
        _held_back = previous


def move_into_hugepages(params: list[nn.Parameter]) -> int:
    """Move the parameters' data into one huge-page mapping (``param.data`` swapped, values
    unchanged); returns the bytes moved, 0 where huge pages cannot be asked for (or moves
    are held back). The mapping lives as long as any of the moved tensors."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    params = [p for p in {id(p): p for p in params}.values() if _whole_storage(p)]
    if advice is None or not params or _held_back:
        return 0
    sizes = [-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in params]
    mapping = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(advice)
    arena = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    offset = -arena.data_ptr() % HUGE_PAGE  # the first weight on a huge page's boundary
    with torch.no_grad():
        for p, size in zip(params, sizes, strict=True):
            nbytes = p.numel() * p.element_size()
            moved = arena[offset : offset + nbytes].view(p.dtype).view(p.shape)
            moved.copy_(p.data)
            p.data = moved
            offset += size
    logger.info("moved %d weights (%.1f MB) into huge pages", len(params), sum(sizes) / 1e6)
    return sum(sizes)
