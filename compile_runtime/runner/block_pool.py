"""The free list of KV-cache blocks.

Block 0 is the null block: padded slots of the block table point at it, so
it must never hold a real request's tokens and is never handed out.

Free block ids sit in a numpy ring (first freed, first reused) with a numpy
flag per block, so a pool of millions of blocks costs a few bytes per block,
not a Python object each.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

NULL_BLOCK_ID = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved as the null block), "
                f"got {num_blocks}"
            )
        self.num_blocks = num_blocks
        dtype = np.int32 if num_blocks < 2**31 else np.int64
        self._ring = np.arange(1, num_blocks, dtype=dtype)  # free ids from _head, _count of them
        self._head = 0
        self._count = num_blocks - 1
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._is_free[NULL_BLOCK_ID] = False

    @property
    def num_free(self) -> int:
        return self._count

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    def _ring_slots(self, start: int, n: int) -> np.ndarray | slice:
        """Positions ``start .. start + n`` of the ring, wrapping around its end."""
        size = len(self._ring)
        start %= size
        if start + n <= size:
            return slice(start, start + n)
        return np.arange(start, start + n) % size

    def allocate(self, n: int) -> list[int] | None:
        """n free blocks, or None (and nothing taken) when fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self._count:
            return None
        blocks = self._ring[self._ring_slots(self._head, n)]
        self._head = (self._head + n) % len(self._ring)
        self._count -= n
        self._is_free[blocks] = False
        return blocks.tolist()

    def free(self, blocks: Iterable[int]) -> None:
        ids = list(blocks)
        if not ids:
            return
        # Check everything first so a bad call leaves the pool unchanged.
        for b in ids:
            if not 0 < b < self.num_blocks:
                raise ValueError(f"block id {b} is not an allocatable block of this pool")
        array = np.asarray(ids, dtype=self._ring.dtype)
        already = array[self._is_free[array]]
        if already.size:
            raise ValueError(f"block {int(already[0])} is already free (double free)")
        if len(set(ids)) != len(ids):
            raise ValueError(f"the same block appears twice in {ids}")
        self._ring[self._ring_slots(self._head + self._count, len(ids))] = array
        self._count += len(ids)
        self._is_free[array] = True
