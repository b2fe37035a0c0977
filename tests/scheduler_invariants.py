"""The scheduler's bookkeeping invariants, for tests to check after every step.

Nothing in the engine calls this: it walks every request and block, which a
step cannot afford, and exists so tests can catch a leaked or shared block at
the step that caused it.
"""

from __future__ import annotations

from collections import Counter

from compile_runtime.core.scheduler import Scheduler


def check_scheduler_invariants(scheduler: Scheduler) -> None:
    """Raise AssertionError unless blocks, references and the cache agree.

    Every block held is counted once per running request holding it; waiting
    requests hold none; a request's full computed blocks are in the cache under
    its own hashes (or were computed twice at once and stay plain); its other
    blocks, the partial last one above all, hold no hash and are never shared.
    """
    pool, block_size = scheduler.block_pool, scheduler.block_size
    holders: Counter[int] = Counter()
    for req in scheduler.running:
        rid = req.req_id
        assert len(set(req.block_ids)) == len(req.block_ids), f"{rid} holds a block twice"
        assert len(req.block_ids) * block_size >= req.num_computed_tokens
        full = req.num_computed_tokens // block_size
        assert req.num_cached_blocks == (full if scheduler.enable_prefix_caching else 0), rid
        for i, block in enumerate(req.block_ids):
            holders[block] += 1
            block_hash = pool.hash_of(block)
            if i < req.num_cached_blocks:
                assert block_hash in (None, req.block_hashes[i]), f"{rid}: block {i}'s hash"
            else:
                assert block_hash is None, f"{rid}: block {i} is cached but not computed"
    for block, n in holders.items():
        assert n == 1 or pool.hash_of(block) is not None, f"uncached block {block} shared"
    for req in scheduler.waiting:
        assert not req.block_ids and req.num_cached_blocks == 0
    pool.check_consistency(holders)
