"""Graph capture: every graph the dispatcher lists at start-up, or each on first use.

Capturing at start-up (``capture``: largest size first, all graphs in one memory pool)
means serving never pays for a capture, and the memory the graphs take is known before
the KV cache is sized: what CUDA graphs need. A CPU graph records native calls while the
step runs for real and its memory is small, so it can be captured when a size is first
used (``LazyCapture``): a start then captures nothing, and sizes never used cost nothing.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from compile_runtime.config import CUDAGraphMode
from compile_runtime.counters import compilation_counter
from compile_runtime.cpu.graph import GraphCaptureUnsupported, dry_captures
from compile_runtime.forward_context import BatchDescriptor, set_forward_context
from compile_runtime.graphs.dispatcher import CudagraphDispatcher
from compile_runtime.graphs.wrapper import CUDAGraphCaptureError, cudagraph_capturing_enabled
from compile_runtime.platforms.cuda import CUDA

logger = logging.getLogger(__name__)


@dataclass
class CaptureInputs:
    """One forward's inputs for a descriptor; ``make_inputs`` may also return a bare args tuple."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    attn_metadata: Any = None


@dataclass
class CaptureReport:
    num_descriptors: dict[str, int] = field(default_factory=dict)  # by runtime mode name
    num_graphs: dict[str, int] = field(default_factory=dict)  # one per wrapper per descriptor
    seconds: dict[str, float] = field(default_factory=dict)
    memory_bytes: int | None = None  # memory the graphs took (CUDA pool, or CPU graphs' own)
    kind: str = "CUDA"  # or "CPU": the graphs are recorded native calls
    sizes: dict[str, list[int]] = field(default_factory=dict)  # captured token counts by mode
    # Descriptors whose capture was refused, with the reason: they run unreplayed.
    failed: dict[str, str] = field(default_factory=dict)
    on_first_use: bool = False  # captured as sizes are first used (LazyCapture), not at start-up

    def summary(self) -> str:
        parts = [
            f"{mode}: {self.num_graphs[mode]} graphs for {self.num_descriptors[mode]} sizes "
            f"({_ranges(self.sizes.get(mode, []))}) in {self.seconds[mode]:.2f} s"
            for mode in self.num_graphs
        ]
        memory = "" if self.memory_bytes is None else f", pool {self.memory_bytes / 2**20:.1f} MiB"
        failed = ""
        if self.failed:
            first = next(iter(self.failed.items()))
            failed = (
                f"; {len(self.failed)} not captured (run unreplayed), e.g. {first[0]}: {first[1]}"
            )
        return f"captured {self.kind} graphs: " + ("; ".join(parts) or "none") + memory + failed

    def sizes_line(self) -> str:
        """Which sizes each mode captured, and how many were refused: for the start-up line."""
        if self.on_first_use:
            return f"{self.kind} graphs captured on first use"
        parts = [f"{self.kind} {mode} {_ranges(sizes)}" for mode, sizes in self.sizes.items()]
        if self.failed:
            parts.append(f"{len(self.failed)} sizes not captured")
        return "; ".join(parts) or f"no {self.kind} graphs"


def _ranges(sizes: list[int]) -> str:
    ordered = sorted(sizes)
    if len(ordered) <= 4:
        return ", ".join(map(str, ordered))
    return f"{ordered[0]}, {ordered[1]}, ..., {ordered[-1]}"


def _as_inputs(value: CaptureInputs | tuple[Any, ...] | Any) -> CaptureInputs:
    if isinstance(value, CaptureInputs):
        return value
    return CaptureInputs(args=value if isinstance(value, tuple) else (value,))


def capture(
    model: Callable[..., Any],
    make_inputs: Callable[[BatchDescriptor, CUDAGraphMode], CaptureInputs | tuple[Any, ...]],
    dispatcher: CudagraphDispatcher,
    *,
    progress: bool = True,
    graph_pool: Any = None,
    forward_for: Callable[[CUDAGraphMode, BatchDescriptor], Callable[..., Any]] | None = None,
) -> CaptureReport:
    """Capture every ``(mode, descriptor)`` of ``dispatcher.capture_descriptors()``.

    ``make_inputs(descriptor, mode)`` gives the forward's inputs padded to
    ``descriptor.num_tokens``, in the persistent buffers serving will use. The
    mode says whether attention is inside the graph: attention metadata built
    for a graph is needed only under FULL (under PIECEWISE attention runs
    between the graphs, and a backend may refuse graph metadata for a batch
    that is not a uniform decode).
    ``model`` is what serving calls: the FULL wrapper when FULL graphs are on;
    ``forward_for(mode, descriptor)``, when given, names what each graph's steps call
    instead (the runner's decode graphs run on through the LM head).
    ``graph_pool``: the CPU graphs' pool (``cpu_graph.CPUGraphPool``) when they are CPU
    graphs; they are then captured dry (``cpu_graph.dry_captures``: recorded, not run).
    A descriptor whose capture is refused (``GraphCaptureUnsupported``) is taken out of the
    dispatcher, named in the report and in one log line; its batches run unreplayed.
    """
    descriptors = dispatcher.capture_descriptors()
    report = CaptureReport(kind="CUDA" if graph_pool is None else "CPU")
    if not descriptors:
        logger.info("no CUDA graphs to capture (cudagraph mode %s)", dispatcher.mode.name)
        return report
    # CUDA graphs on a CUDA device (not a test double on a CPU); CPU graphs never start CUDA.
    cuda = graph_pool is None and CUDA.available()

    pool_before = graph_pool.nbytes if graph_pool is not None else 0
    # Trace, compile and warm up outside any graph, at the largest size.
    largest_mode, largest = max(descriptors, key=lambda md: md[1].num_tokens)
    inputs = _as_inputs(make_inputs(largest, largest_mode))
    with set_forward_context(inputs.attn_metadata, num_tokens=largest.num_tokens):
        model(*inputs.args, **inputs.kwargs)

    stream_ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info()[0]
        # One side stream for warm-ups, eager pieces and captures alike (the
        # default stream cannot capture).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        stream_ctx = torch.cuda.stream(stream)
    # Objects alive now stay alive: freezing them keeps the collector from
    # walking them during every capture.
    gc.collect()
    gc.freeze()
    dry = contextlib.nullcontext() if graph_pool is None else dry_captures()
    try:
        with cudagraph_capturing_enabled(), stream_ctx, dry:
            for mode, descriptor in tqdm(
                descriptors,
                desc=f"Capturing {report.kind} graphs",
                unit="graph",
                disable=not progress,
            ):
                try:
                    forward = forward_for(mode, descriptor) if forward_for else model
                    _capture_one(forward, make_inputs, mode, descriptor, report, cuda)
                except GraphCaptureUnsupported as e:
                    seen = str(e) in report.failed.values()  # one warning per reason
                    report.failed[f"{mode.name} {descriptor}"] = str(e)
                    dispatcher.discard(mode, descriptor)
                    logger.log(
                        logging.INFO if seen else logging.WARNING,
                        "%s graph for %s not captured, its batches run unreplayed: %s",
                        mode.name,
                        descriptor,
                        e,
                    )
    finally:
        gc.unfreeze()
    if cuda:
        torch.cuda.synchronize()
        report.memory_bytes = free_before - torch.cuda.mem_get_info()[0]
    elif graph_pool is not None:  # the pool is the process's: another engine's graphs too
        report.memory_bytes = graph_pool.nbytes - pool_before
    logger.info(report.summary())
    return report


def _capture_one(
    model: Callable[..., Any],
    make_inputs: Callable[[BatchDescriptor, CUDAGraphMode], Any],
    mode: CUDAGraphMode,
    descriptor: BatchDescriptor,
    report: CaptureReport,
    cuda: bool,
) -> None:
    inputs = _as_inputs(make_inputs(descriptor, mode))
    before = compilation_counter.num_cudagraph_captured
    start = time.perf_counter()
    with set_forward_context(
        inputs.attn_metadata, cudagraph_runtime_mode=mode, batch_descriptor=descriptor
    ):
        model(*inputs.args, **inputs.kwargs)
    if cuda:
        torch.cuda.synchronize()
    captured = compilation_counter.num_cudagraph_captured - before
    if captured == 0:
        hint = (
            "wrap the model with compile_runtime.graphs.wrap_full_model"
            if mode == CUDAGraphMode.FULL
            else "pieces are wrapped when the model is compiled with CompilationMode.PIECEWISE "
            "and a cudagraph_mode with PIECEWISE graphs, on a machine with CUDA"
        )
        raise CUDAGraphCaptureError(
            f"no {mode.name} graph was captured for {descriptor}: the model has no {mode.name} "
            f"CUDAGraphWrapper ({hint}), or this descriptor was captured already"
        )
    name = mode.name
    report.num_descriptors[name] = report.num_descriptors.get(name, 0) + 1
    report.num_graphs[name] = report.num_graphs.get(name, 0) + captured
    report.sizes.setdefault(name, []).append(descriptor.num_tokens)
    report.seconds[name] = report.seconds.get(name, 0.0) + time.perf_counter() - start


class LazyCapture:
    """Graphs captured on first use, one ``(mode, descriptor)`` at a time: a size's first
    step runs unreplayed (it warms up every lazy path, which a capture would refuse), its
    second is captured while it runs, later ones replay. A refused capture takes the
    descriptor out of the dispatcher (one warning per reason) and the step runs unreplayed.
    ``report`` adds up what was captured so far."""

    FIRST_USE = "first use of this size (its graph is captured at the next)"
    REFUSED = "its graph's capture was refused"

    def __init__(self, dispatcher: CudagraphDispatcher, kind: str = "CPU"):
        self.dispatcher = dispatcher
        self.report = CaptureReport(kind=kind, on_first_use=True)
        self._seen: set[tuple[CUDAGraphMode, BatchDescriptor]] = set()
        self.captured: set[tuple[CUDAGraphMode, BatchDescriptor]] = set()  # replay from now

    def run(
        self,
        mode: CUDAGraphMode,
        descriptor: BatchDescriptor,
        forward: Callable[[CUDAGraphMode], Any],
        unreplayed: Counter[str],
        reason: str | None = None,
    ) -> tuple[Any, CUDAGraphMode, str | None]:
        """``forward(mode)`` (the step under that runtime mode), capturing on the way: the
        output, the mode it ran in and why it ran unreplayed (``reason``, the dispatcher's, if
        it was not this; each such step counted in ``unreplayed``)."""
        key = (mode, descriptor)
        if mode == CUDAGraphMode.NONE or key in self.captured:
            return forward(mode), mode, reason
        if key not in self._seen:
            self._seen.add(key)
            unreplayed[self.FIRST_USE] += 1
            return forward(CUDAGraphMode.NONE), CUDAGraphMode.NONE, self.FIRST_USE
        before = compilation_counter.num_cudagraph_captured
        start = time.perf_counter()
        try:
            with cudagraph_capturing_enabled():
                out = forward(mode)
        except GraphCaptureUnsupported as e:
            seen = str(e) in self.report.failed.values()
            self.report.failed[f"{mode.name} {descriptor}"] = str(e)
            self.dispatcher.discard(mode, descriptor)
            logger.log(
                logging.INFO if seen else logging.WARNING,
                "%s graph for %s not captured, its batches run unreplayed: %s",
                mode.name,
                descriptor,
                e,
            )
            unreplayed[self.REFUSED] += 1
            return forward(CUDAGraphMode.NONE), CUDAGraphMode.NONE, self.REFUSED
        self.captured.add(key)
        name = mode.name
        report = self.report
        report.num_descriptors[name] = report.num_descriptors.get(name, 0) + 1
        captured = compilation_counter.num_cudagraph_captured - before
        report.num_graphs[name] = report.num_graphs.get(name, 0) + captured
        report.sizes.setdefault(name, []).append(descriptor.num_tokens)
        report.seconds[name] = report.seconds.get(name, 0.0) + time.perf_counter() - start
        return out, mode, reason
