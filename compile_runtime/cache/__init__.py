"""The persistent compile cache: a second start loads compiled pieces instead of compiling."""

from compile_runtime.cache.entry import CacheEntry, open_entry
from compile_runtime.cache.key import compute_key, key_factors
from compile_runtime.cache.location import cache_root

__all__ = ["CacheEntry", "cache_root", "compute_key", "key_factors", "open_entry"]
