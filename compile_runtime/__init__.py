"""compile_runtime: a compiler-centric runtime for PyTorch LLM inference.

The command-line front ends live in the ``cli`` package, the one layer nothing else
imports. Top-level modules: ``table`` (plain-text tables for the CLI and benchmarks);
``device`` (the default device: CUDA if present, else the CPU); ``forward_context``
(per-step state layers read during a forward); ``counters`` (what the compiler and graph
wrappers did, for tests); ``version`` (the package version); ``torch_internals`` (every
use of PyTorch's private APIs, behind one fence, and the supported torch versions).
"""

from __future__ import annotations

from compile_runtime.attention.layer import Attention
from compile_runtime.compiler.compiled_forward import GraphBreakError, TracedArgumentError
from compile_runtime.compiler.decorator import compile, ignore_compile
from compile_runtime.compiler.split import SplittingOpError
from compile_runtime.config import (
    AttentionCGSupport,
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    PassConfig,
    get_compilation_config,
    set_compilation_config,
)
from compile_runtime.counters import compilation_counter
from compile_runtime.forward_context import (
    BatchDescriptor,
    ForwardContextError,
    get_forward_context,
    set_forward_context,
)
from compile_runtime.graphs.dispatcher import CudagraphDispatcher
from compile_runtime.version import __version__

# Generation pulls in transformers and the model code: imported on first use.
_LAZY = {
    "LLM": "compile_runtime.engine.llm",
    "RequestOutput": "compile_runtime.engine.outputs",
    "CompletionOutput": "compile_runtime.engine.outputs",
    "SamplingParams": "compile_runtime.core.sampling_params",
    "StepFailedError": "compile_runtime.engine.core",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'compile_runtime' has no attribute {name!r}")


__all__ = [
    "Attention",
    "AttentionCGSupport",
    "CompilationConfig",
    "CompilationMode",
    "CUDAGraphMode",
    "PassConfig",
    "BatchDescriptor",
    "CudagraphDispatcher",
    "ForwardContextError",
    "GraphBreakError",
    "TracedArgumentError",
    "SplittingOpError",
    "get_forward_context",
    "set_forward_context",
    "compilation_counter",
    "compile",
    "ignore_compile",
    "get_compilation_config",
    "set_compilation_config",
    "LLM",
    "RequestOutput",
    "CompletionOutput",
    "SamplingParams",
    "StepFailedError",
    "__version__",
]
