"""CUDAGraphWrapper: capture a callable per BatchDescriptor, then replay it.

The same wrapper serves FULL graphs (around the whole model) and PIECEWISE
graphs (around each compiled piece). It never decides anything: the forward
context says which runtime mode and descriptor this step has (the dispatcher
set them), and the wrapper replays, captures, or calls straight through.

Capture is allowed only while capture is on (``cudagraph_capturing_enabled``): at
start-up, or for CPU graphs at a size's second step (``capture.LazyCapture``); a graph
missing at any other time is an error.

The graph implementation comes from a small factory, ``torch.cuda.CUDAGraph``
by default; a wrapper (and a compiled model, ``decorator.set_graph_factory``)
can be given another, so CPU tests can put a recording double in its place and
exercise every path of the wrapper.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol
from unittest import mock

import torch
import torch.fx

from compile_runtime.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    get_compilation_config,
)
from compile_runtime.counters import compilation_counter
from compile_runtime.forward_context import (
    BatchDescriptor,
    current_forward_context,
)
from compile_runtime.platforms.cuda import CUDA
from compile_runtime.torch_internals import storage_over, tree_map_only

logger = logging.getLogger(__name__)

DEBUG_ENV = "COMPILE_RUNTIME_CUDAGRAPH_DEBUG"


class CUDAGraphCaptureError(RuntimeError):
    """A graph is missing outside start-up capture, or the forward context is incomplete."""


class CUDAGraphAddressError(RuntimeError):
    """An input of a captured graph is at a different address than at capture (debug mode)."""


# ---- the graph implementation ---------------------------------------------


class CapturedGraph(Protocol):
    def capture(self, fn: Callable[[], Any], pool: Any) -> Any:
        """Record ``fn`` into this graph (allocating from ``pool``); return its outputs."""

    def replay(self) -> None: ...


class GraphFactory(Protocol):
    def new_graph(self) -> CapturedGraph: ...

    def pool(self) -> Any:
        """The one memory pool every graph from this factory allocates from."""


class TorchCUDAGraph:
    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], Any], pool: Any) -> Any:
        # Capture on the current stream (start-up capture sets a side stream) so
        # warm-ups, eager pieces and captures are ordered; the default stream
        # cannot capture, so there torch picks a side stream.
        stream = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream():
            stream = None
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class TorchCUDAGraphFactory:
    def __init__(self) -> None:
        self._pool: Any = None

    def new_graph(self) -> TorchCUDAGraph:
        return TorchCUDAGraph()

    def pool(self) -> Any:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool


CUDA_GRAPHS = TorchCUDAGraphFactory()  # the real graphs: one memory pool for all


def graphs_available(factory: GraphFactory | None = None) -> bool:
    """CUDA is there, or a substitute factory (a test double) stands in for it."""
    return factory is not None or CUDA.available()


# ---- start-up capture switch ----------------------------------------------

_capturing_enabled = False


def set_cudagraph_capturing_enabled(enabled: bool) -> None:
    global _capturing_enabled
    _capturing_enabled = enabled


def is_cudagraph_capturing_enabled() -> bool:
    return _capturing_enabled


@contextlib.contextmanager
def cudagraph_capturing_enabled(enabled: bool = True) -> Iterator[None]:
    """Allow wrappers to capture missing graphs inside this block (start-up only)."""
    previous = _capturing_enabled
    set_cudagraph_capturing_enabled(enabled)
    try:
        yield
    finally:
        set_cudagraph_capturing_enabled(previous)


# ---- weak references to graph outputs -------------------------------------


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s memory that does not keep that memory allocated.

    Graph outputs live in the shared pool; the pool keeps the memory, so a
    non-owning view stays valid while letting later captures reuse the block.
    """
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return tensor
    alias = storage_over(storage.data_ptr(), tensor.device, storage.nbytes())
    view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return view.set_(alias, tensor.storage_offset(), tensor.size(), tensor.stride())


def weak_ref_tensors(outputs: Any) -> Any:
    return tree_map_only(torch.Tensor, weak_ref_tensor, outputs)


# ---- the wrapper -----------------------------------------------------------


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _positional_names(fn: Callable[..., Any]) -> list[str]:
    if isinstance(fn, torch.nn.Module):
        fn = fn.forward
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    names = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return names


@dataclasses.dataclass
class _Entry:
    graph: CapturedGraph
    outputs: Any
    input_addresses: dict[str, int] | None  # debug mode only


class CUDAGraphWrapper:
    """Replays ``runnable`` from a CUDA graph when the forward context says ``runtime_mode``.

    ``is_first_piece`` / ``is_last_piece`` place a piece within one forward:
    only the first capture frees memory first (gc.collect, empty_cache), and
    only the last keeps its outputs as owning tensors (earlier outputs are
    consumed inside the forward, so the pool may reuse their blocks).
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime_mode: CUDAGraphMode,
        *,
        num_warmups: int = 1,
        is_first_piece: bool = True,
        is_last_piece: bool = True,
        debug: bool | None = None,
        name: str | None = None,
        arg_names: Sequence[str] | None = None,
        graph_factory: GraphFactory | None = None,
    ):
        if runtime_mode not in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            raise ValueError(
                f"CUDAGraphWrapper captures PIECEWISE or FULL graphs, got {runtime_mode.name}"
            )
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.num_warmups = num_warmups
        self.is_first_piece = is_first_piece
        self.is_last_piece = is_last_piece
        self.factory = graph_factory or CUDA_GRAPHS
        if debug is None:  # CPU graphs always check: a moved input would replay silently wrong
            debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
            debug = debug or getattr(self.factory, "checks_addresses", False)
        self.debug = debug
        self.name = name or getattr(runnable, "__name__", type(runnable).__name__)
        self.arg_names = list(arg_names) if arg_names is not None else _positional_names(runnable)
        self.entries: dict[BatchDescriptor, _Entry] = {}
        self.num_replays = 0

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes the wrapper lacks: let the model's show through.
        runnable = self.__dict__.get("runnable")
        if runnable is None:
            raise AttributeError(name)
        return getattr(runnable, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = current_forward_context()
        if context is None or context.cudagraph_runtime_mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        descriptor = context.batch_descriptor
        if descriptor not in self.entries:
            return self._capture(descriptor, args, kwargs)
        return self.replay(descriptor, args, kwargs)  # type: ignore[arg-type]

    def replay(
        self,
        descriptor: BatchDescriptor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """The outputs of ``descriptor``'s graph replayed on ``args``, or None when it has
        none captured. No forward context is needed: no Python runs inside a replay (the
        runner's captured steps call this directly)."""
        entry = self.entries.get(descriptor)
        if entry is None:
            return None
        captured = entry.input_addresses
        if captured is not None and self._addresses(args, kwargs or {}) != captured:
            self._check_addresses(descriptor, captured, args, kwargs or {})  # names the one moved
        entry.graph.replay()
        self.num_replays += 1
        return entry.outputs

    def _capture(
        self, descriptor: BatchDescriptor | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        mode = self.runtime_mode.name
        if descriptor is None:
            raise CUDAGraphCaptureError(
                f"{self.name}: the forward context says {mode} but has no batch_descriptor; "
                "pass the descriptor the dispatcher returned to set_forward_context"
            )
        if not _capturing_enabled:
            raise CUDAGraphCaptureError(
                f"{self.name}: no {mode} CUDA graph for {descriptor}, and capturing is off. "
                "Graphs are captured at start-up (compile_runtime.graphs.capture.capture) for the "
                "descriptors the dispatcher lists; a batch with another descriptor means the "
                "dispatcher and the captured graphs disagree"
            )
        # A CPU capture runs the step for real after start-up's first forward (or, captured on
        # first use, the size's own first step) has warmed every path up: warm-ups would only
        # double its time (anything lazy left refuses capture).
        warmups = 0 if getattr(self.factory, "capture_runs_work", False) else self.num_warmups
        for _ in range(warmups):
            self.runnable(*args, **kwargs)
        addresses = self._addresses(args, kwargs) if self.debug else None
        graph = self.factory.new_graph()
        with self._capture_hygiene():
            outputs = graph.capture(lambda: self.runnable(*args, **kwargs), self.factory.pool())
        # A CUDA capture records the work without running it: replay once so this call's
        # outputs hold real values (a CPU capture ran it).
        if not getattr(self.factory, "capture_runs_work", False):
            graph.replay()
        kept = outputs if self.is_last_piece else weak_ref_tensors(outputs)
        self.entries[descriptor] = _Entry(graph, kept, addresses)
        compilation_counter.num_cudagraph_captured += 1
        logger.debug("captured %s graph of %s for %s", mode, self.name, descriptor)
        return outputs

    @contextlib.contextmanager
    def _capture_hygiene(self) -> Iterator[None]:
        """Let only the first piece's capture pay for gc.collect and empty_cache."""
        if self.is_first_piece:
            yield
            return
        with mock.patch("gc.collect", _noop), mock.patch("torch.cuda.empty_cache", _noop):
            yield

    def _addresses(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, int]:
        # Loops, not comprehensions: every replay checks, and each comprehension is a frame.
        addresses = {}
        names = self.arg_names
        for i, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                addresses[names[i] if i < len(names) else f"argument {i}"] = value.data_ptr()
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                addresses[name] = value.data_ptr()
        return addresses

    def _check_addresses(
        self,
        descriptor: BatchDescriptor,
        captured: dict[str, int],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        now = self._addresses(args, kwargs)
        for name, address in captured.items():
            if now.get(name) != address:
                raise CUDAGraphAddressError(
                    f"{self.name}: input {name!r} is at {now.get(name)!r}, but the {descriptor} "
                    f"graph was captured reading it at {address:#x}; a graph reads fixed "
                    "addresses, so copy new values into the same (persistent) buffer instead "
                    "of passing a new tensor"
                )

    def __repr__(self) -> str:
        return (
            f"CUDAGraphWrapper({self.name}, {self.runtime_mode.name}, graphs={len(self.entries)})"
        )


# ---- integration helpers ----------------------------------------------------


def piecewise_cudagraphs_enabled(
    config: CompilationConfig, graph_factory: GraphFactory | None = None
) -> bool:
    """Whether the backend wraps pieces: the wrappers act only when the dispatcher says PIECEWISE.

    FULL counts too: resolved against attention that cannot hold a mixed batch, it becomes
    FULL_AND_PIECEWISE (``config/modes.py``), whose mixed batches replay the pieces."""
    mode = config.cudagraph_mode
    return (
        config.mode == CompilationMode.PIECEWISE
        and (mode.has_piecewise_cudagraphs() or mode == CUDAGraphMode.FULL)
        and graphs_available(graph_factory)
    )


def wrap_piece(
    runtime: Callable[..., Any],
    config: CompilationConfig,
    *,
    arg_names: list[str] | None = None,
    index: int,
    is_first: bool,
    is_last: bool,
    graph_factory: GraphFactory | None = None,
) -> Callable[..., Any]:
    """``runtime`` in a PIECEWISE wrapper when piecewise graphs are on, else as is
    (``arg_names``: the piece's input names, for error messages)."""
    if not piecewise_cudagraphs_enabled(config, graph_factory):
        return runtime
    return CUDAGraphWrapper(
        runtime,
        CUDAGraphMode.PIECEWISE,
        num_warmups=config.cudagraph_num_warmups,
        is_first_piece=is_first,
        is_last_piece=is_last,
        name=f"piece {index}",
        arg_names=arg_names,
        graph_factory=graph_factory,
    )


def wrap_full_model(
    model: Callable[..., Any],
    config: CompilationConfig | None = None,
    graph_factory: GraphFactory | None = None,
) -> CUDAGraphWrapper:
    """Wrap a whole (compiled) model for FULL graphs; the runner calls this after loading.

    FULL is not automatic in ``@compile``: only the runner knows whether the
    attention backends can run inside a graph. Call the returned wrapper
    exactly like the model; attributes not on the wrapper come from the model.
    When both FULL and PIECEWISE graphs are on, a FULL replay never enters the
    model, and a PIECEWISE step calls through to the model's wrapped pieces.
    """
    config = config or get_compilation_config()
    return CUDAGraphWrapper(
        model,
        CUDAGraphMode.FULL,
        num_warmups=config.cudagraph_num_warmups,
        name=f"{type(model).__name__} (FULL)",
        graph_factory=graph_factory,
    )
