"""Configuration: what to compile, how, and which CUDA graphs to capture; the lowest layer
(it imports nothing else of this package). Every name is re-exported here.

* ``modes``: ``CompilationMode``, ``CUDAGraphMode``, ``AttentionCGSupport`` and
  ``resolve_cudagraph_mode``, the policy that downgrades a requested graph mode to what
  can run (``ResolvedModes``, ``CudagraphModeError``);
* ``compilation``: ``CompilationConfig`` (what the user sets, hashed into the cache key;
  frozen, ``replace`` makes a changed one, ``FrozenConfigError``), ``PassConfig``, the
  Inductor option check, the ``auto:FILE[:K]`` capture-size spec,
  ``parse_config``;
* ``active``: the config models constructed inside ``set_compilation_config`` use;
* ``engine``: ``RunnerConfig``, ``SpeculativeConfig``, ``EngineConfig`` and their
  one-line-per-field ``ConfigError``.
"""

from __future__ import annotations

from compile_runtime.config.active import get_compilation_config, set_compilation_config
from compile_runtime.config.compilation import (
    AUTO_PREFIX,
    AutoSpec,
    CompilationConfig,
    FrozenConfigError,
    PassConfig,
    check_inductor_options,
    parse_auto_spec,
    parse_config,
)
from compile_runtime.config.engine import (
    ENGINE_DTYPES,
    CheckedConfig,
    ConfigError,
    EngineConfig,
    RunnerConfig,
    SpeculativeConfig,
)
from compile_runtime.config.modes import (
    AttentionCGSupport,
    CompilationMode,
    CUDAGraphMode,
    CudagraphModeError,
    ResolvedModes,
    resolve_cudagraph_mode,
)

__all__ = [
    "AUTO_PREFIX",
    "ENGINE_DTYPES",
    "AttentionCGSupport",
    "AutoSpec",
    "CUDAGraphMode",
    "CheckedConfig",
    "CompilationConfig",
    "CompilationMode",
    "ConfigError",
    "CudagraphModeError",
    "EngineConfig",
    "FrozenConfigError",
    "PassConfig",
    "ResolvedModes",
    "RunnerConfig",
    "SpeculativeConfig",
    "check_inductor_options",
    "get_compilation_config",
    "parse_auto_spec",
    "parse_config",
    "resolve_cudagraph_mode",
    "set_compilation_config",
]
