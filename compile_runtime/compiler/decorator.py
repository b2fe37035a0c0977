"""``@compile_runtime.compile``: trace a model's forward once, then never again.

How "once" is enforced: the forward goes through ``torch.compile`` with
``fullgraph=True`` (a graph break is an error, never a silent eager fallback),
the token-count dims marked dynamic, and a guard filter that drops every
guard. After the first call there is nothing left for Dynamo to check: later
calls run the bytecode Dynamo produced at the first trace directly, as a plain
Python function (it gathers the graph inputs and calls the compiled graph),
so Dynamo's frame hook, cache lookup and stance switch are skipped (about
0.5 ms per call on a CPU decode step). Should that bytecode not be captured,
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
import logging
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.fx.experimental._config as fx_config

from compile_runtime.attention.op import running_layers
from compile_runtime.cache.location import CacheError, cache_root
from compile_runtime.compiler import graph_compiler as graph_compiler_module
from compile_runtime.compiler import saved_program
from compile_runtime.compiler.graph_compiler import CompileResult, GraphCompiler
from compile_runtime.compiler.piecewise import PiecewiseRuntime
from compile_runtime.compiler.split import Piece, SplittingOpError
from compile_runtime.config import CompilationConfig, CompilationMode, get_compilation_config
from compile_runtime.counters import compilation_counter
from compile_runtime.passes.manager import PassManager

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=type)

IGNORE_ATTR = "_compile_runtime_ignore"


class GraphBreakError(RuntimeError):
    """The model's forward cannot be traced as one graph."""


class TracedArgumentError(TypeError):
    """A call passes None where the trace saw a tensor, or the reverse."""


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


def _graph_compilers(model: torch.nn.Module) -> list[GraphCompiler]:
    """The graph compilers of ``model``'s traced (or program-loaded) compiled forwards."""
    return [
        compiled.graph_compiler
        for module in model.modules()
        if (compiled := module.__dict__.get("_compile_runtime")) is not None
        and getattr(compiled, "graph_compiler", None) is not None
        and compiled.graph_compiler.split_gm is not None
    ]


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


def _private_forward(model: torch.nn.Module) -> Callable[..., Any]:
    """``model.forward`` bound over a private copy of its code object.

    Dynamo keeps its cache on the code object. Sharing one across instances
    would pile every instance's entry on one list (and hit the recompile
    limit after eight models of a class); a copy gives each instance a cache
    of exactly one entry that dies with it.
    """
    fn = type(model).forward
    copy = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return types.MethodType(copy, model)


class CompiledForward:
    """The compiled forward of one model instance."""

    def __init__(self, model: torch.nn.Module, config: CompilationConfig, dims: dict[str, Any]):
        compilation_counter.num_models_seen += 1
        self.config = config
        self.dims = dims
        self.signature = inspect.signature(model.forward)
        self.model_name = type(model).__name__
        self.traced = False
        self.direct: Callable[..., Any] | None = None  # Dynamo's bytecode, after the trace
        # (name, position, default, was None at the trace) of every argument that was None
        # or a tensor at the trace: the trace took its None-or-not branch for good.
        self.none_pattern: tuple[tuple[str, int, Any, bool], ...] = ()
        if config.mode == CompilationMode.STOCK_TORCH_COMPILE:
            self.graph_compiler = None
            self.compiled = torch.compile(model.forward, backend=config.backend)
        else:
            self.graph_compiler = GraphCompiler(config, model_tag=self.model_name)
            self.forward = _private_forward(model)
            self.compiled = torch.compile(
                self.forward,
                backend=self.graph_compiler,
                fullgraph=True,
                dynamic=False,
                options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},
            )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.graph_compiler is None:  # stock torch.compile: Dynamo decides
            return self.compiled(*args, **kwargs)
        if self.direct is None and not self.traced:
            return self._first_call(*args, **kwargs)
        num_args = len(args)
        for name, position, default, was_none in self.none_pattern:
            value = args[position] if position < num_args else kwargs.get(name, default)
            if (value is None) is not was_none:
                self._raise_none_pattern_changed(args, kwargs)
        if self.direct is not None:
            return self.direct(*args, **kwargs)
        with torch.compiler.set_stance("fail_on_recompile"):
            return self.compiled(*args, **kwargs)

    def _first_call(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        self.none_pattern = self._record_none_pattern(bound)
        program = self._program_factors(bound.arguments)
        if program is not None and saved_program.loading_allowed() and self._load_program(*program):
            return self.direct(*args, **kwargs)
        self.graph_compiler.want_program = program is not None
        for name, dims in self.dims.items():
            value = bound.arguments.get(name)
            if isinstance(value, torch.Tensor):
                for dim in [dims] if isinstance(dims, int) else dims:
                    torch._dynamo.mark_dynamic(value, dim)
        hook = torch._dynamo.convert_frame.register_bytecode_hook(self._keep_bytecode)
        try:
            # Sizes 0 and 1 would otherwise be specialised at the first trace.
            with fx_config.patch(backed_size_oblivious=True):
                out = self.compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            raise GraphBreakError(
                f"{self.model_name}.forward cannot be traced as one graph, which "
                f"CompilationMode.{self.config.mode.name} needs. Dynamo stopped at: {e}\n"
                "Move the offending code out of forward, make it a custom op, or run with "
                "CompilationMode.NONE / STOCK_TORCH_COMPILE."
            ) from None
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if isinstance(e.inner_exception, (SplittingOpError, CacheError)):  # say only that
                raise e.inner_exception from None
            raise
        finally:
            hook.remove()
        self.traced = True
        if program is not None and self.graph_compiler.program_draft is not None:
            self._save_program(*program, out)
        return out

    # ---- the saved program: a warm start that neither traces nor compiles ---------------------

    def _program_factors(self, arguments: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """(key, factors) of this call's program, or None where programs do not apply."""
        compiler = self.graph_compiler
        if (
            self.config.disable_cache
            or not compiler.adaptor.can_save
            or graph_compiler_module.is_key_only_tracing()
        ):
            return None
        device = next((v.device for v in arguments.values() if isinstance(v, torch.Tensor)), None)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        try:
            factors = saved_program.program_factors(
                self.forward.__self__,
                self.config,
                arguments,
                self.dims,
                pass_uuid=compiler.pass_manager.uuid(),
                device=device,
                world_size=torch.distributed.get_world_size() if distributed else 1,
            )
        except saved_program.NotSaveable as e:
            logger.info("%s: no saved program (%s); it traces at every start", self.model_name, e)
            return None
        return saved_program.program_key(factors), factors

    def _rank(self) -> int:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        return torch.distributed.get_rank() if distributed else 0

    def _load_program(self, key: str, factors: dict[str, Any]) -> bool:
        root = cache_root(self.config.cache_dir)
        program = saved_program.find(root, key, self._rank(), self.model_name)
        if program is None or not self.graph_compiler.load_program(program):
            return False
        model = self.forward.__self__
        self_name = next(iter(inspect.signature(type(model).forward).parameters))
        gather = saved_program.make_gather(program.record["inputs"], self_name, model)
        run_graph = self.graph_compiler.split_gm.forward  # the saved program's split graph
        names = list(self.signature.parameters)
        signature = self.signature
        single = program.record["output"] == "single"

        def run_program(*args: Any, **kwargs: Any) -> Any:
            if not kwargs and len(args) == len(names):
                arguments = dict(zip(names, args, strict=True))
            else:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                arguments = bound.arguments
            out = run_graph(*gather(arguments))
            return out[0] if single else tuple(out)

        self.direct = run_program
        self.traced = True
        return True

    def _save_program(self, key: str, factors: dict[str, Any], out: Any) -> None:
        try:
            saved_program.save(
                self.graph_compiler.program_draft, key, factors, out, self.none_pattern
            )
        except saved_program.NotSaveable as e:
            logger.info("%s: no saved program (%s); it traces at every start", self.model_name, e)
        except OSError as e:
            logger.warning("%s: could not save the traced program (%s)", self.model_name, e)

    def _record_none_pattern(
        self, bound: inspect.BoundArguments
    ) -> tuple[tuple[str, int, Any, bool], ...]:
        """Which arguments were None and which were tensors at the trace (checked every call)."""
        bound.apply_defaults()
        pattern = []
        for position, (name, param) in enumerate(self.signature.parameters.items()):
            value = bound.arguments.get(name)
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or not (
                value is None or isinstance(value, torch.Tensor)
            ):
                continue
            if param.kind == param.KEYWORD_ONLY:
                position = sys.maxsize  # never in args
            pattern.append((name, position, param.default, value is None))
        return tuple(pattern)

    def _raise_none_pattern_changed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        bound = self.signature.bind(*args, **kwargs)  # a missing argument: Python's TypeError
        bound.apply_defaults()
        for name, _, _, was_none in self.none_pattern:
            value = bound.arguments[name]
            if (value is None) is not was_none:
                then = "None" if was_none else "a tensor"
                now = "None" if value is None else f"a {type(value).__name__}"
                raise TracedArgumentError(
                    f"{self.model_name}.forward was traced with {name} as {then}, but this call "
                    f"passes {now}. The one trace serves every call, so whether {name} is None "
                    f"was fixed at the trace. Pass {name} as {then} on every call to this model "
                    "instance; for the other case build a second instance (it traces its own), "
                    "or run with CompilationMode.NONE / STOCK_TORCH_COMPILE."
                )

    def _keep_bytecode(self, code: types.CodeType, new_code: types.CodeType) -> None:
        """Bytecode hook: keep what Dynamo made of our private forward as a callable."""
        fn = self.forward.__func__
        if code is fn.__code__:
            direct = types.FunctionType(
                new_code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
            )
            direct.__kwdefaults__ = fn.__kwdefaults__
            self.direct = types.MethodType(direct, self.forward.__self__)
