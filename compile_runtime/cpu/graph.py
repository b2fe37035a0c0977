"""CPU graphs: a step's native calls recorded once per size, then replayed from a C loop.

On a CPU a compiled step is a sequence of C calls (Inductor's kernels, our GEMV, AMX,
quantized GEMM, embedding rows and paged decode attention) with Python around them: the
Inductor/AOT wrappers, the split graph, ``cpu_linear``'s dispatch, the attention layer.
``CPUGraph`` is the ``CapturedGraph`` of ``wrapper.py`` for the CPU: ``capture`` runs the
step once with every native call recorded (function address and integer arguments), and
``replay`` hands the whole list to ``graph_replay`` (``csrc/graph_replay.c``) in one
ctypes call. The wrapper, dispatcher and start-up capture are the CUDA ones.

What is recorded, and what refuses capture (``GraphCaptureUnsupported``, naming the op:
that size then runs unreplayed, never a silent wrong answer):

* Inductor kernels: every ``kernel`` of a compiled module in Inductor's code cache is
  swapped for a recording proxy while capturing (its C symbol, loaded with ctypes, is what
  replays). Tensor arguments become their addresses, ints stay ints; anything else refuses.
* Our kernels: every ``NativeFunction`` call (``compile_runtime/cpu/native_function.py``).
* Every other op goes through a dispatch mode: ops that only allocate or make views pass
  (their results are kept alive by the graph); ``cpu_linear`` and ``quant_embedding`` run
  their bodies under the same mode, so their inner ops are checked too; oneDNN's packed
  linear (float linears above the GEMV's rows) and plain matmuls become a C callback into
  torch whose result is copied where the capture's was; so is tensor parallelism's in-place
  all-reduce and its wait (every rank replays its collectives in its capture's order), and
  a dtype conversion that copies (a quantized LM head widening bf16 activations); any
  other op that computes (an add, ``.item()``) refuses.

Memory: every tensor a recorded call touches, and every tensor made while capturing, is
kept by the graph, so replays write where the capture wrote and nothing else can be given
that memory. As a CUDA graph pool is, the memory is shared between sizes (``CPUGraphPool``,
``cpu_graph_pool.py``): a step replays one size's graphs and consumes their outputs before
the next step, so a buffer of one size may lie on a storage another size's capture made,
as long as no two buffers of one size share a storage. Inputs are read at the addresses
they had at capture: the wrapper checks them before every replay
(``CPUGraphFactory.checks_addresses``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from compile_runtime.cpu.graph_ops import (
    ALLOCATING,
    CALLED_BACK,
    MAYBE_NO_COMPUTE,
    NO_COMPUTE,
)
from compile_runtime.cpu.graph_pool import CPUGraphPool, capturing_step
from compile_runtime.cpu.native_function import NativeFunction, set_native_recorder
from compile_runtime.torch_internals import (
    INDUCTOR_CPU_ALLOCATOR,
    TorchDispatchMode,
    inductor_generated_modules,
    is_inductor_cpp_kernel,
    op_schema,
)

logger = logging.getLogger(__name__)


class GraphCaptureUnsupported(RuntimeError):
    """A step cannot be captured into a CPU graph: it makes a call the replay cannot repeat."""


@functools.cache
def _op_bodies() -> dict[str, Callable[..., Any]]:
    """Our custom ops whose bodies call NativeFunctions: run under the recording mode."""
    from compile_runtime.cpu.linear import OP_NAME as LINEAR
    from compile_runtime.cpu.linear import cpu_linear_impl
    from compile_runtime.cpu.lora import OP_NAME as LORA
    from compile_runtime.cpu.lora import lora_add_impl
    from compile_runtime.cpu.quant_embedding import OP_NAME as EMBEDDING
    from compile_runtime.cpu.quant_embedding import quant_embedding_impl

    return {LINEAR: cpu_linear_impl, EMBEDDING: quant_embedding_impl, LORA: lora_add_impl}


@functools.cache
def _replay_library() -> tuple[ctypes._CFuncPtr, int] | None:
    """``graph_replay`` and its argument limit, or None (no C compiler here)."""
    from compile_runtime.cpu.c_library import load_c_library

    lib = load_c_library("graph_replay", "CPU graph replay")
    if lib is None:
        return None
    return lib.function("graph_replay"), lib.function("graph_max_args")()


def cpu_graphs_available() -> bool:
    """Whether this machine can replay CPU graphs (the replay loop builds here)."""
    return _replay_library() is not None


_CALLBACK_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int64)

_dry_captures = False


@contextmanager
def dry_captures() -> Iterator[None]:
    """CPU captures in this block record their native calls without running them: for
    start-up's, whose dummy steps nobody reads (running them was most of its time). Their
    outputs are garbage, as a CUDA capture's are before its first replay."""
    global _dry_captures
    previous, _dry_captures = _dry_captures, True
    try:
        yield
    finally:
        _dry_captures = previous


def asks_for_cpu_graphs(config: Any) -> bool:
    """Whether ``config`` has what CPU graphs need: graphs asked for, pieces compiled by
    Inductor (eager pieces are torch ops, which a replay cannot repeat: every capture would
    be refused). The engine decides the graph sizes from it, before any rank starts."""
    from compile_runtime.config import CompilationMode, CUDAGraphMode

    return (
        config.cudagraph_mode != CUDAGraphMode.NONE
        and config.mode != CompilationMode.NONE
        and config.backend == "inductor"
    )


def records_cpu_graphs(config: Any) -> bool:
    """Whether a model compiled with ``config`` gets CPU graphs: ``asks_for_cpu_graphs``, and
    the replay loop built here."""
    from compile_runtime.config import CompilationMode, CUDAGraphMode

    if config.cudagraph_mode == CUDAGraphMode.NONE or not cpu_graphs_available():
        return False
    if not asks_for_cpu_graphs(config):
        logger.info(
            "no CPU graphs: they replay Inductor's kernels, and this model runs %s",
            "uncompiled" if config.mode == CompilationMode.NONE else "eager pieces",
        )
        return False
    return True


@functools.cache
def _c_symbol(path: str) -> int:
    """The address of the C ``kernel`` an Inductor module's Python binding calls."""
    return ctypes.cast(ctypes.CDLL(path).kernel, ctypes.c_void_p).value


class _Recorder:
    """The native calls of one capture, in order, and every tensor they may touch."""

    def __init__(self, max_args: int, pool: CPUGraphPool | None, owner: Any) -> None:
        self.max_args = max_args
        self.calls: list[tuple[int, list[int], str]] = []  # (address, arguments, name)
        self.kept: dict[int, torch.Tensor] = {}  # by id: alive as long as the graph
        self.callbacks: list[Any] = []  # the C callbacks into torch (kept: the loop calls them)
        self.callback_failures: list[BaseException] = []
        self.pool = pool
        self.owner = owner  # the step the capture is of: (mode, batch descriptor)
        self.dry = _dry_captures  # record the native calls without running them

    def keep(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.kept[id(value)] = value
        elif isinstance(value, (tuple, list)):
            for v in value:
                self.keep(v)

    def made(self, value: Any) -> Any:
        """What an allocation returned, its tensors moved into the pool."""
        if self.pool is None:
            return value
        if isinstance(value, torch.Tensor):
            return self.pool.share(value, self.owner)
        if isinstance(value, (tuple, list)):
            return type(value)(self.made(v) for v in value)
        return value

    def _add(self, address: int, args: list[int], name: str) -> None:
        if len(args) > self.max_args:
            raise GraphCaptureUnsupported(
                f"{name} takes {len(args)} arguments; the replay loop passes at most "
                f"{self.max_args}"
            )
        self.calls.append((address, args, name))

    def record_native(self, function: NativeFunction, args: tuple[Any, ...]) -> bool:
        values = []
        for i, a in enumerate(args):
            if a is None:
                values.append(0)
            elif isinstance(a, (int, np.integer)):
                values.append(int(a))
            else:
                raise GraphCaptureUnsupported(
                    f"{function.name}: argument {i} is a {type(a).__name__}, not an int or a "
                    "pointer"
                )
        self._add(function.address, values, function.name)
        return not self.dry

    def call_back(self, func: Any, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        """A replay calls ``func`` again through a C callback and copies its result into
        ``out`` (the tensor the later calls were recorded reading)."""
        self.keep(args)
        failures = self.callback_failures

        def again(_: int) -> None:
            try:
                result = func(*args, **kwargs)
                if result is not out:  # an in-place op (the all-reduce) returns ``out`` itself
                    out.copy_(result)
            except BaseException as e:  # noqa: BLE001 - raised after the replay, not lost
                failures.append(e)

        callback = _CALLBACK_TYPE(again)
        self.callbacks.append(callback)
        self._add(ctypes.cast(callback, ctypes.c_void_p).value, [0], f"callback {func}")

    def allocation_proxy(self, allocate: Callable[..., torch.Tensor]) -> Callable[..., Any]:
        def call(*args: Any) -> torch.Tensor:
            out = self.made(allocate(*args))
            self.keep(out)
            return out

        return call

    def inductor_proxy(self, builtin: Any) -> Callable[..., Any]:
        path = builtin.__self__.__file__
        name = f"Inductor kernel {os.path.basename(path)}"

        def call(*args: Any) -> Any:
            values = []
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    self.keep(a)
                    values.append(a.data_ptr())
                elif isinstance(a, int):
                    values.append(a)
                else:
                    raise GraphCaptureUnsupported(
                        f"{name}: argument {i} is a {type(a).__name__}; the replay passes "
                        "tensors and ints only"
                    )
            self._add(_c_symbol(path), values, name)
            return None if self.dry else builtin(*args)

        return call


class _RecordingMode(TorchDispatchMode):
    """Lets through ops that allocate or view (keeping what they make), runs our custom ops'
    bodies under itself, and refuses every other op."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_schema(func).name
        body = _op_bodies().get(name)
        if body is not None:
            with self:
                out = body(*args, **kwargs)
        elif name in ALLOCATING:
            out = self.recorder.made(func(*args, **kwargs))
        elif name in NO_COMPUTE:
            out = func(*args, **kwargs)
        elif name in MAYBE_NO_COMPUTE:
            out = func(*args, **kwargs)
            if out is not args[0]:  # a copy (a dtype widened): the replay calls it back
                self.recorder.call_back(func, args, kwargs, out)
        elif name in CALLED_BACK:
            out = func(*args, **kwargs)
            self.recorder.call_back(func, args, kwargs, out)
        else:
            raise GraphCaptureUnsupported(
                f"{func} computes in torch, not through a recorded native call, so a replay "
                "would skip it"
            )
        self.recorder.keep(out)
        return out


@contextmanager
def _recording(recorder: _Recorder) -> Iterator[None]:
    """Every native call of the block goes to ``recorder``; every patch undone after."""
    swapped = []
    for module in inductor_generated_modules():
        for name, value in list(vars(module).items()):
            if is_inductor_cpp_kernel(value):
                swapped.append((module, name, value))
                setattr(module, name, recorder.inductor_proxy(value))
            elif name == INDUCTOR_CPU_ALLOCATOR:  # Inductor's allocations: counted as the pool's
                swapped.append((module, name, value))
                setattr(module, name, recorder.allocation_proxy(value))
    previous = set_native_recorder(recorder)
    try:
        with _RecordingMode(recorder):
            yield
    finally:
        set_native_recorder(previous)
        for module, name, value in swapped:
            setattr(module, name, value)


class CPUGraph:
    """One captured step: its native calls as three arrays, replayed by one C call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int], str]] = []
        self.kept: list[torch.Tensor] = []
        self.callbacks: list[Any] = []
        self._failures: list[BaseException] = []
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._replay_args: tuple[int, int, int, int] | None = None

    def capture(self, fn: Callable[[], Any], pool: Any) -> Any:
        library = _replay_library()
        if library is None:
            raise GraphCaptureUnsupported("no C compiler here to build the replay loop")
        recorder = _Recorder(library[1], pool, capturing_step())
        with _recording(recorder):
            outputs = fn()
        recorder.keep(outputs)
        self.calls = recorder.calls
        self.kept = list(recorder.kept.values())
        self.callbacks = recorder.callbacks
        self._failures = recorder.callback_failures
        fns = np.array([address for address, _, _ in self.calls], dtype=np.uint64)
        nargs = np.array([len(args) for _, args, _ in self.calls], dtype=np.int64)
        flat = np.array([a for _, args, _ in self.calls for a in args], dtype=np.int64)
        self._arrays = (fns, nargs, flat)  # alive as long as the graph: the loop reads them
        self._replay_args = (fns.ctypes.data, nargs.ctypes.data, flat.ctypes.data, len(fns))
        return outputs

    def replay(self) -> None:
        done = _replay_library()[0](*self._replay_args)
        if done != len(self.calls):  # pragma: no cover - the recorder checks the limit first
            raise RuntimeError(f"CPU graph replay stopped at call {done} of {len(self.calls)}")
        if self._failures:  # a callback into torch failed: this replay's outputs are wrong
            error = self._failures.pop()
            self._failures.clear()
            raise RuntimeError(f"a CPU graph's callback into torch failed: {error}") from error


class CPUGraphFactory:
    """The ``GraphFactory`` of CPU graphs (``wrapper.py``)."""

    # A CPU capture runs the step (a CUDA capture only records it): no replay after it.
    capture_runs_work = True
    # Replays read inputs where the capture found them: checked before every replay.
    checks_addresses = True

    def __init__(self) -> None:
        self._pool = CPUGraphPool()

    def new_graph(self) -> CPUGraph:
        return CPUGraph()

    def pool(self) -> CPUGraphPool:
        return self._pool


CPU_GRAPHS = CPUGraphFactory()
