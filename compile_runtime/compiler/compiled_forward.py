"""The compiled forward of one model instance: its first call traces (or loads the saved
program), every later call runs what that produced.

Later calls run the bytecode Dynamo made of the forward at the trace as a plain
function (no frame hook, cache lookup or stance switch), after checking that
every argument that may be None is None exactly when it was at the trace.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from compile_runtime.cache.location import CacheError
from compile_runtime.compiler import program
from compile_runtime.compiler.graph_compiler import GraphCompiler
from compile_runtime.compiler.program_draft import DraftBuilder
from compile_runtime.compiler.split import SplittingOpError
from compile_runtime.config import CompilationConfig, CompilationMode
from compile_runtime.counters import compilation_counter
from compile_runtime.torch_internals import (
    backed_size_oblivious,
    check_torch_version,
    dynamo_backend_failed,
    dynamo_mark_dynamic,
    dynamo_register_bytecode_hook,
    dynamo_unsupported,
)


class GraphBreakError(RuntimeError):
    """The model's forward cannot be traced as one graph."""


class TracedArgumentError(TypeError):
    """A call passes None where the trace saw a tensor, or the reverse."""


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
        check_torch_version()  # the first compile in a process checks (cached after)
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
        # False: trace at the first call even where a saved program exists (verify needs
        # the FX split graph, which a saved program does without).
        self.load_program = True
        if config.mode == CompilationMode.STOCK_TORCH_COMPILE:
            self.graph_compiler = None
            self.forward = model.forward
        else:
            self.graph_compiler = GraphCompiler(config, model_tag=self.model_name)
            self.forward = _private_forward(model)

    @functools.cached_property
    def compiled(self) -> Callable[..., Any]:
        """``torch.compile`` of the forward, made at the first trace: a start that runs a saved
        program never pays for it (~0.3 s)."""
        if self.graph_compiler is None:
            return torch.compile(self.forward, backend=self.config.backend)
        return torch.compile(
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

    @property
    def model(self) -> torch.nn.Module:
        return self.forward.__self__

    def load_saved_program(self, *args: Any, **kwargs: Any) -> bool:
        """Install the saved program for calls like this one, running nothing: True when
        there is one (the first call then traces nothing, at any size of the dynamic dims)."""
        if self.direct is not None or self.traced:
            return self.direct is not None
        if self.graph_compiler is None or not self.load_program:
            return False
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()  # the key sees every argument, passed or defaulted, as at a save
        plan = program.program_for_call(self, bound.arguments)
        direct = None if plan is None else program.load(self, plan[0])
        if direct is None:
            return False
        self.none_pattern = self._record_none_pattern(bound)
        self.direct, self.traced = direct, True
        return True

    def _first_call(self, *args: Any, **kwargs: Any) -> Any:
        if self.load_saved_program(*args, **kwargs):
            return self.direct(*args, **kwargs)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        self.none_pattern = self._record_none_pattern(bound)
        plan = program.program_for_call(self, bound.arguments)
        if plan is not None:
            self.graph_compiler.program_builder = DraftBuilder(self.model_name)
        for name, dims in self.dims.items():
            value = bound.arguments.get(name)
            if isinstance(value, torch.Tensor):
                for dim in [dims] if isinstance(dims, int) else dims:
                    dynamo_mark_dynamic(value, dim)
        hook = dynamo_register_bytecode_hook(self._keep_bytecode)
        try:
            # Sizes 0 and 1 would otherwise be specialised at the first trace.
            with backed_size_oblivious():
                out = self.compiled(*args, **kwargs)
        except dynamo_unsupported() as e:
            raise GraphBreakError(
                f"{self.model_name}.forward cannot be traced as one graph, which "
                f"CompilationMode.{self.config.mode.name} needs. Dynamo stopped at: {e}\n"
                "Move the offending code out of forward, make it a custom op, or run with "
                "CompilationMode.NONE / STOCK_TORCH_COMPILE."
            ) from None
        except dynamo_backend_failed() as e:
            if isinstance(e.inner_exception, (SplittingOpError, CacheError)):  # say only that
                raise e.inner_exception from None
            raise
        finally:
            hook.remove()
        self.traced = True
        if plan is not None:
            program.save(self, *plan, out)
        return out

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
