"""Where the cache lives: config.cache_dir, else $COMPILE_RUNTIME_CACHE_DIR, else ~/.cache."""

from __future__ import annotations

import os

ENV_VAR = "COMPILE_RUNTIME_CACHE_DIR"


class CacheError(ValueError):
    """A cache command cannot do what was asked (unknown key, incompatible import, ...)."""


def cache_root(cache_dir: str | None = None) -> str:
    if cache_dir:
        return os.path.abspath(os.path.expanduser(cache_dir))
    if os.environ.get(ENV_VAR):
        return os.path.abspath(os.path.expanduser(os.environ[ENV_VAR]))
    return os.path.join(os.path.expanduser("~"), ".cache", "compile_runtime")


def check_root(root: str) -> str:
    """``root``, or an error when it exists and is not a directory.

    Without this a start fails deep inside ``makedirs`` and ``cache list``
    mistakes the file for an empty cache.
    """
    if os.path.exists(root) and not os.path.isdir(root):
        raise CacheError(
            f"compile cache directory {root} is a file, not a directory; point cache_dir "
            f"(--cache-dir, ${ENV_VAR}) at a directory, or set disable_cache=true"
        )
    return root
