"""Content addresses of full KV blocks, for automatic prefix caching.

The KV of a block depends on its own tokens and on every token before it, so
a full block is named by a hash of its token ids chained with its parent
block's hash: two requests get the same hash for block i exactly when their
first ``(i + 1) * block_size`` tokens are equal. The hash is a 128-bit BLAKE2b
digest, so an accidental collision (which would reuse the wrong KV, silently)
is out of reach. Nothing else changes a block's contents within one engine:
one model, one dtype, one block size; the root seed names the scheme so a
change of it never matches old hashes.

Only full blocks get a hash: the partial last block of a request is never
shared, since its remaining slots will be written by its owner. A joining request
takes the longest run of its full blocks already cached, short of its last token
(computing that token gives the logits of the next one); a running request's full
blocks enter the cache once a step has computed them.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from compile_runtime.core.block_pool import BlockPool
from compile_runtime.core.request import Request

ROOT_HASH = hashlib.blake2b(b"compile_runtime prefix cache v1", digest_size=16).digest()


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
    parent = hashes[-1] if hashes else ROOT_HASH
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


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache when requests were admitted, and found."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def since(self, earlier: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries - earlier.queries, self.hits - earlier.hits)
