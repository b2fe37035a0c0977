"""Where the cache lives: config.cache_dir, else $COMPILE_RUNTIME_CACHE_DIR, else ~/.cache."""

from __future__ import annotations

import os

ENV_VAR = "COMPILE_RUNTIME_CACHE_DIR"


def cache_root(cache_dir: str | None = None) -> str:
    if cache_dir:
        return os.path.abspath(os.path.expanduser(cache_dir))
    if os.environ.get(ENV_VAR):
        return os.path.abspath(os.path.expanduser(os.environ[ENV_VAR]))
    return os.path.join(os.path.expanduser("~"), ".cache", "compile_runtime")
