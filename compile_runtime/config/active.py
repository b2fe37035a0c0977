"""The active compilation config: the one models constructed inside ``set_compilation_config``
read (a stack, so blocks nest)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from compile_runtime.config.compilation import CompilationConfig

_active_config: list[CompilationConfig] = []


@contextlib.contextmanager
def set_compilation_config(config: CompilationConfig) -> Iterator[CompilationConfig]:
    """Models constructed inside this block use ``config``."""
    if not isinstance(config, CompilationConfig):
        raise TypeError(
            f"set_compilation_config expects a CompilationConfig, got {type(config).__name__}"
        )
    _active_config.append(config)
    try:
        yield config
    finally:
        _active_config.pop()


def get_compilation_config() -> CompilationConfig:
    """The active config, or the defaults when none is set."""
    return _active_config[-1] if _active_config else CompilationConfig()
