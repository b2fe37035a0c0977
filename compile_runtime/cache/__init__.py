"""The persistent compile cache: a second start loads compiled pieces instead of compiling.

``key`` (the hash of named, readable factors), ``location`` (where the cache lives),
``entry`` (one model's compiled pieces on one rank under one key), ``files`` (crash-safe
writes and checksums), ``kernels`` (Inductor's compiled C++ kernels shipped with an entry), ``weight_file``
(packed-weight files: a model's processed weights, mapped at later starts);
``manage`` (inspect and manage the cache) and ``archive`` (export/import an entry between
machines); ``compile-runtime cache ...`` is in ``compile_runtime/cli/cache.py``.
"""

from compile_runtime.cache.entry import CacheEntry, open_entry
from compile_runtime.cache.key import compute_key, key_factors
from compile_runtime.cache.location import cache_root

__all__ = ["CacheEntry", "cache_root", "compute_key", "key_factors", "open_entry"]
