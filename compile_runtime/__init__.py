"""compile_runtime: a compiler-centric runtime for PyTorch LLM inference."""

from __future__ import annotations

from compile_runtime.config import (
    AttentionCGSupport,
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    PassConfig,
    get_compilation_config,
    set_compilation_config,
)
from compile_runtime.counter import compilation_counter
from compile_runtime.decorator import GraphBreakError, compile, ignore_compile
from compile_runtime.dispatcher import BatchDescriptor, CudagraphDispatcher
from compile_runtime.forward_context import (
    ForwardContextError,
    get_forward_context,
    set_forward_context,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionCGSupport",
    "CompilationConfig",
    "CompilationMode",
    "CUDAGraphMode",
    "PassConfig",
    "BatchDescriptor",
    "CudagraphDispatcher",
    "ForwardContextError",
    "GraphBreakError",
    "get_forward_context",
    "set_forward_context",
    "compilation_counter",
    "compile",
    "ignore_compile",
    "get_compilation_config",
    "set_compilation_config",
    "__version__",
]
