"""The free list of KV-cache blocks.

Block 0 is the null block: padded slots of the block table point at it, so
it must never hold a real request's tokens and is never handed out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

NULL_BLOCK_ID = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved as the null block), "
                f"got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._is_free = [False] + [True] * (num_blocks - 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int] | None:
        """n free blocks, or None (and nothing taken) when fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        # Check everything first so a bad call leaves the pool unchanged.
        for b in blocks:
            if not 0 < b < self.num_blocks:
                raise ValueError(f"block id {b} is not an allocatable block of this pool")
            if self._is_free[b]:
                raise ValueError(f"block {b} is already free (double free)")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"the same block appears twice in {blocks}")
        for b in blocks:
            self._is_free[b] = True
            self._free.append(b)
