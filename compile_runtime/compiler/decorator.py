"""``@compile_runtime.compile``: trace a model's forward once, then never again.

How "once" is enforced: the forward goes through ``torch.compile`` with
``fullgraph=True`` (a graph break is an error, never a silent eager fallback),
the token-count dims marked dynamic, and a guard filter that drops every
guard. After the first call there is nothing left for Dynamo to check: later
calls run the bytecode Dynamo produced at the first trace directly, as a plain
Python function (it gathers the graph inputs and calls the compiled graph),
so Dynamo's frame hook, cache lookup and stance switch are skipped (a cost a
CPU decode step would feel). Should that bytecode not be captured,
calls go through ``torch.compile`` under a ``fail_on_recompile`` stance,
which turns any attempt to trace again into an error.

What it costs: whatever Python decided during the first trace is baked in.
A branch such as ``if x.shape[0] > 4`` takes the side the first call took,
for every later size too (tests/test_compile.py shows it). Model code must
keep shape-dependent control flow out of ``forward`` (put it in the runner,
or in a custom op). The same goes for an argument that may be None: the
branch on ``x is None`` is baked in too, so every call must pass each such
argument as the first call did (None, or a tensor); a call that does not is
an error naming the argument (``TracedArgumentError``), never an answer
computed without it.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from compile_runtime.attention.op import running_layers
from compile_runtime.compiler.compiled_forward import CompiledForward
from compile_runtime.compiler.graph_compiler import GraphCompiler
from compile_runtime.compiler.piece_store import CompileResult
from compile_runtime.compiler.piecewise import PiecewiseRuntime
from compile_runtime.compiler.split import Piece
from compile_runtime.config import CompilationConfig, CompilationMode, get_compilation_config
from compile_runtime.graphs.wrapper import GraphFactory
from compile_runtime.passes.manager import PassManager

M = TypeVar("M", bound=type)

IGNORE_ATTR = "_compile_runtime_ignore"


def ignore_compile(cls: M) -> M:
    """Mark a subclass of a compiled model to run eager."""
    setattr(cls, IGNORE_ATTR, True)
    return cls


def _is_tensor_annotation(annotation: Any) -> bool:
    if annotation is torch.Tensor:
        return True
    args = typing.get_args(annotation)
    return (
        bool(args) and torch.Tensor in args and all(a in (torch.Tensor, type(None)) for a in args)
    )


def infer_dynamic_arg_dims(cls: type) -> dict[str, int]:
    """Dim 0 of every forward argument annotated ``Tensor`` or ``Optional[Tensor]``."""
    hints = typing.get_type_hints(cls.forward)
    return {
        name: 0
        for name in inspect.signature(cls.forward).parameters
        if name != "self" and _is_tensor_annotation(hints.get(name))
    }


def compile(
    cls: M | None = None,
    *,
    dynamic_arg_dims: dict[str, int | list[int]] | None = None,
    enable_if: Callable[[CompilationConfig], bool] | None = None,
) -> M | Callable[[M], M]:
    """Decorate an ``nn.Module`` subclass so instances compile per the active config."""

    def decorate(cls: M) -> M:
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise TypeError(f"@compile_runtime.compile decorates nn.Module subclasses, got {cls!r}")
        dims = dynamic_arg_dims if dynamic_arg_dims is not None else infer_dynamic_arg_dims(cls)
        params = inspect.signature(cls.forward).parameters
        unknown = [name for name in dims if name not in params]
        if unknown:
            raise ValueError(
                f"dynamic_arg_dims names {unknown}, which {cls.__name__}.forward does not take "
                f"(its arguments: {[p for p in params if p != 'self']})"
            )
        if not dims:
            raise ValueError(
                f"{cls.__name__}.forward has no dynamic dimension: annotate the token-count "
                "arguments as torch.Tensor (dim 0 becomes dynamic) or pass "
                "dynamic_arg_dims={'input_ids': 0, ...} to @compile_runtime.compile"
            )
        original_init = cls.__init__
        original_call = cls.__call__

        @functools.wraps(original_init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            config = get_compilation_config()
            enabled = (
                config.mode != CompilationMode.NONE
                and not getattr(type(self), IGNORE_ATTR, False)
                and (enable_if is None or enable_if(config))
            )
            self.__dict__["_compile_runtime"] = (
                CompiledForward(self, config, dims) if enabled else None
            )

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with running_layers(self):  # the attention op finds this model's layers
                compiled = self.__dict__.get("_compile_runtime")
                if compiled is None:
                    return original_call(self, *args, **kwargs)
                return compiled(*args, **kwargs)

        cls.__init__ = __init__
        cls.__call__ = __call__
        return cls

    return decorate(cls) if cls is not None else decorate


@dataclass(frozen=True)
class CompiledModel:
    """What compiling one model produced: the contract for readers outside the compiler
    (``verify``, benchmarks, tests), so that none of them reaches into the compiler."""

    config: CompilationConfig
    split_gm: torch.fx.GraphModule  # the split graph; its static pieces replaced
    pieces: list[Piece]  # every piece with its FX graph before compilation
    runtimes: list[PiecewiseRuntime]  # one per static piece, in order
    result: CompileResult  # what happened to each piece, and how long it took
    splitting_ops: list[str]
    pass_manager: PassManager


def compiled_model(module: torch.nn.Module) -> CompiledModel | None:
    """The compile record of ``module`` (decorated with ``@compile`` and traced), else None."""
    compiled = module.__dict__.get("_compile_runtime")
    graph_compiler = getattr(compiled, "graph_compiler", None)
    if graph_compiler is None or graph_compiler.split_gm is None:
        return None
    return CompiledModel(
        config=graph_compiler.config,
        split_gm=graph_compiler.split_gm,
        pieces=graph_compiler.pieces,
        runtimes=graph_compiler.runtimes,
        result=graph_compiler.result,
        splitting_ops=graph_compiler.splitting_ops,
        pass_manager=graph_compiler.pass_manager,
    )


def find_compiled_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model`` or the first submodule that ``@compile`` compiles; None if there is none."""
    return next((m for m in model.modules() if m.__dict__.get("_compile_runtime")), None)


def is_traced(module: torch.nn.Module) -> bool:
    """Whether ``module``'s compiled forward has run (and so traced) at least once."""
    return bool(getattr(module.__dict__.get("_compile_runtime"), "traced", False))


def _compiled_forwards(model: torch.nn.Module) -> list[CompiledForward]:
    """The compiled forwards in ``model`` that run our graph compiler."""
    return [
        compiled
        for module in model.modules()
        if (compiled := module.__dict__.get("_compile_runtime")) is not None
        and getattr(compiled, "graph_compiler", None) is not None
    ]


def _graph_compilers(model: torch.nn.Module) -> list[GraphCompiler]:
    """The graph compilers of ``model``'s traced (or program-loaded) compiled forwards."""
    return [
        c.graph_compiler for c in _compiled_forwards(model) if c.graph_compiler.split_gm is not None
    ]


def trace_key_factors(model: torch.nn.Module, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """Call ``model`` once to get the cache key factors of its compiled forwards, compiling
    nothing (their graphs run eager): ``compile-runtime cache explain --model``."""
    forwards = [c for c in _compiled_forwards(model) if not c.traced]
    for compiled in forwards:
        compiled.graph_compiler.key_only = True
    model(*args, **kwargs)
    return [c.graph_compiler.key_factors for c in forwards if c.graph_compiler.key_factors]


def load_saved_program(model: torch.nn.Module, *args: Any, **kwargs: Any) -> bool:
    """Install the saved program of ``model``'s compiled forward for calls like this one,
    running nothing: True when it has one (its first call then traces nothing)."""
    compiled = model.__dict__.get("_compile_runtime")
    return compiled is not None and compiled.load_saved_program(*args, **kwargs)


def trace_at_first_call(model: torch.nn.Module) -> None:
    """Make ``model``'s compiled forwards trace at their first call, loading no saved
    program: for what walks the FX split graph (``verify``), which a program does without."""
    for compiled in _compiled_forwards(model):
        compiled.load_program = False


def set_graph_factory(model: torch.nn.Module, factory: GraphFactory | None) -> None:
    """Capture ``model``'s piecewise graphs with ``factory`` (None: CUDA graphs); before its
    first call, which wraps the pieces. CPU tests put a graph double in CUDA's place."""
    for compiled in _compiled_forwards(model):
        if compiled.traced:
            raise RuntimeError(
                f"{type(model).__name__} has run already; set its graph factory before the "
                "first call, which wraps its pieces"
            )
        compiled.graph_compiler.graph_factory = factory


def graph_factory_of(model: torch.nn.Module) -> GraphFactory | None:
    """The graph factory ``model``'s pieces were given (None: CUDA graphs)."""
    return next((c.graph_compiler.graph_factory for c in _compiled_forwards(model)), None)


def backend_seconds(model: torch.nn.Module) -> float:
    """Seconds our backend spent on ``model``: compiling (or loading) its pieces."""
    return sum(c.result.seconds for c in _graph_compilers(model))


def attention_split(model: torch.nn.Module) -> bool | None:
    """Whether a compiled forward in ``model`` was split at a splitting op.

    What ``CompilationConfig.resolve(attention_split=...)`` needs once the
    model is traced: piecewise CUDA graphs are only safe when the split really
    took attention out of the pieces. None when nothing in ``model`` is traced.
    """
    splits = [any(p.is_splitting_op for p in c.result.pieces) for c in _graph_compilers(model)]
    return any(splits) if splits else None
