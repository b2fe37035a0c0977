"""The KV-cache blocks (the engine core's block manager): who holds each one, which are free,
and which hold a known prefix (automatic prefix caching).

Block 0 is the null block: padded slots of the block table point at it, so
it must never hold a real request's tokens and is never handed out.

Every other block has a reference count: the requests holding it. A full
block can be shared by several requests (prefix caching), a partial one never.
A block whose count drops to 0 is free. Free blocks come in two kinds:

* blocks with no content worth keeping sit in a numpy ring (first freed,
  first reused), with a numpy reference count per block, so a pool of
  millions of empty blocks costs a few bytes per block, not a Python object;
* blocks that hold a cached prefix (a content hash, below)
  sit in an LRU, least recently freed first. They can be taken back by a
  request with the same prefix (``touch``) or, when no empty block is left,
  evicted and reused (``allocate``), least recently used first.

A block in use (count > 0) is never evicted, handed out or overwritten.

Content addresses. The KV of a block depends on its own tokens and on every token before it,
so a full block is named by a hash of its token ids chained with its parent block's hash: two
requests get the same hash for block i exactly when their first ``(i + 1) * block_size``
tokens are equal. The hash is a 128-bit BLAKE2b digest, so an accidental collision (which
would reuse the wrong KV, silently) is out of reach. Nothing else changes a block's contents
within one engine: one model, one dtype, one block size; the root seed names the scheme so a
change of it never matches old hashes. Only full blocks get a hash: the partial last block of
a request is never shared, since its remaining slots will be written by its owner. A joining
request takes the longest run of its full blocks already cached, short of its last token
(computing that token gives the logits of the next one); a running request's full blocks
enter the cache once a step has computed them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable

import numpy as np

from compile_runtime.core.request import Request

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
        self._ring = np.arange(1, num_blocks, dtype=dtype)  # empty free ids from _head
        self._head = 0
        self._count = num_blocks - 1
        self._refs = np.zeros(num_blocks, dtype=np.int32)
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: empty ones and evictable cached ones."""
        return self._count + len(self._cached_free)

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_cached(self) -> int:
        """Blocks holding a known prefix (in use or free)."""
        return len(self._hash_of)

    def _ring_slots(self, start: int, n: int) -> np.ndarray | slice:
        """Positions ``start .. start + n`` of the ring, wrapping around its end."""
        size = len(self._ring)
        start %= size
        if start + n <= size:
            return slice(start, start + n)
        return np.arange(start, start + n) % size

    def allocate(self, n: int) -> list[int] | None:
        """n blocks to write, or None (and nothing taken) when fewer than n are free.

        Empty blocks go first; then cached ones are evicted, least recently used first.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            return None
        from_ring = min(n, self._count)
        blocks = self._ring[self._ring_slots(self._head, from_ring)].tolist()
        self._head = (self._head + from_ring) % len(self._ring)
        self._count -= from_ring
        for _ in range(n - from_ring):
            block, _ = self._cached_free.popitem(last=False)
            self._forget(block)
            self.num_evictions += 1
            blocks.append(block)
        self._refs[blocks] = 1
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody holds becomes free.

        Cached blocks join the LRU in the order given: free a request's blocks
        last first, so its tail (the least shared part) is evicted first.
        """
        ids = list(blocks)
        if not ids:
            return
        # Check everything first so a bad call leaves the pool unchanged.
        for b in ids:
            if not 0 < b < self.num_blocks:
                raise ValueError(f"block id {b} is not an allocatable block of this pool")
        if len(set(ids)) != len(ids):
            raise ValueError(f"the same block appears twice in {ids}")
        array = np.asarray(ids, dtype=self._ring.dtype)
        unheld = array[self._refs[array] == 0]
        if unheld.size:
            raise ValueError(f"block {int(unheld[0])} is already free (double free)")
        self._refs[array] -= 1
        empty = []
        for b in array[self._refs[array] == 0].tolist():
            if b in self._hash_of:
                self._cached_free[b] = None
            else:
                empty.append(b)
        if empty:
            self._ring[self._ring_slots(self._head + self._count, len(empty))] = empty
            self._count += len(empty)

    # ---- prefix caching ---------------------------------------------------

    def find_cached(self, block_hashes: Iterable[bytes]) -> list[int]:
        """The blocks holding the longest run of ``block_hashes`` from the first (no refs taken)."""
        found = []
        for h in block_hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def num_free_after_touch(self, blocks: list[int]) -> int:
        """``num_free`` once ``blocks`` (cached, found by ``find_cached``) are taken."""
        return self.num_free - sum(1 for b in blocks if self._refs[b] == 0)

    def touch(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks found by ``find_cached`` (out of the LRU if free)."""
        for b in blocks:
            if b not in self._hash_of:
                raise ValueError(f"block {b} holds no cached prefix; only cached blocks are shared")
        for b in blocks:
            if self._refs[b] == 0:
                del self._cached_free[b]
        self._refs[blocks] += 1

    def cache(self, block: int, block_hash: bytes) -> None:
        """Record that a full block in use now holds the prefix ``block_hash``.

        When another block already holds it (two requests computed the same prefix
        at once), the first keeps it and this block stays plain.
        """
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is free; only a block in use can be cached")
        if block_hash in self._block_of:
            return
        if block in self._hash_of:
            raise ValueError(f"block {block} already holds a cached prefix")
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def _forget(self, block: int) -> None:
        del self._block_of[self._hash_of.pop(block)]

    def check_consistency(self, holders: Counter[int]) -> None:
        """Raise AssertionError unless the pool agrees with ``holders`` (block -> requests
        holding it): reference counts, the free ring and LRU, the hash maps (for tests)."""
        refs = np.zeros_like(self._refs)
        for b, n in holders.items():
            assert 0 < b < self.num_blocks, f"block {b} held but not allocatable"
            refs[b] = n
        bad = np.nonzero(refs != self._refs)[0]
        assert not bad.size, (
            f"block {int(bad[0])}: {int(self._refs[bad[0]])} references, "
            f"{int(refs[bad[0]])} holders"
        )
        ring = self._ring[self._ring_slots(self._head, self._count)].tolist()
        free = ring + list(self._cached_free)
        assert len(set(free)) == len(free), "a block is free twice"
        expected_free = set(np.nonzero(refs == 0)[0].tolist()) - {NULL_BLOCK_ID}
        assert set(free) == expected_free, "free blocks differ from unheld blocks"
        assert all(b not in self._hash_of for b in ring), "a cached block sits in the empty ring"
        assert all(b in self._hash_of for b in self._cached_free), "an empty block in the LRU"
        assert len(self._block_of) == len(self._hash_of)
        for b, h in self._hash_of.items():
            assert self._block_of[h] == b, f"hash maps disagree on block {b}"
        assert NULL_BLOCK_ID not in self._hash_of


ROOT_HASH = hashlib.blake2b(b"compile_runtime prefix cache v1", digest_size=16).digest()


def root_hash(request: Request) -> bytes:
    """The parent of a request's first block: the same for every request of the base model,
    its own per LoRA adapter (a block computed under one adapter holds that adapter's KV)."""
    if request.lora_request is None:
        return ROOT_HASH
    return hashlib.blake2b(ROOT_HASH + request.lora_request.cache_salt, digest_size=16).digest()


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """The content address of a full block with ``token_ids`` after the block ``parent``."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(request: Request, num_blocks: int, block_size: int) -> list[bytes]:
    """``request.block_hashes`` grown to cover its first ``num_blocks`` full blocks.

    Hashes are kept on the request (its tokens never change, only grow), so a
    prompt is hashed once, however often it waits, is preempted or restarts.
    """
    hashes = request.block_hashes
    if len(hashes) >= num_blocks:
        return hashes
    start = len(hashes) * block_size
    tokens = request.prompt_token_ids[start : num_blocks * block_size]
    if len(tokens) < (num_blocks - len(hashes)) * block_size:  # reaches into the outputs
        tokens = request.all_token_ids[start : num_blocks * block_size]
    parent = hashes[-1] if hashes else root_hash(request)
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[i : i + block_size])
        hashes.append(parent)
    return hashes


def find_cached_prefix(pool: BlockPool, request: Request, block_size: int) -> list[int]:
    """Cached blocks holding the longest prefix of the request's tokens, short of its last."""
    num_blocks = (request.num_tokens - 1) // block_size
    hashes = extend_block_hashes(request, num_blocks, block_size)
    return pool.find_cached(hashes[:num_blocks])


def cache_computed_blocks(pool: BlockPool, request: Request, block_size: int) -> None:
    """Put the request's full blocks that are computed by now into the cache."""
    num_full = request.num_computed_tokens // block_size
    if num_full <= request.num_cached_blocks:
        return
    hashes = extend_block_hashes(request, num_full, block_size)
    for i in range(request.num_cached_blocks, num_full):
        pool.cache(request.block_ids[i], hashes[i])
    request.num_cached_blocks = num_full
