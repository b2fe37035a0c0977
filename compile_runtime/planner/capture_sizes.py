"""The capture sizes a config asks for, resolved once by the engine (``decide_capture_sizes``,
called by ``decide_engine_config``; the dispatcher gets them).

``cudagraph_capture_sizes`` is a list (used as is), None (the default ladder up to
``max_cudagraph_capture_size``, default 512) or ``"auto:FILE[:K]"``: a plan made here,
at start-up, from a recorded workload:

* ``FILE``: a workload histogram (``generate --record-workload FILE``,
  ``LLM.save_workload(FILE)``), relative to the working directory.
* ``K``: how many sizes. Default: as many as the default ladder spends to
  cover the largest step seen, so the plan costs the same number of graphs
  as the default would for this workload and pads less.
* The largest size is the largest step seen that is <= the cap: the smaller
  of ``max_cudagraph_capture_size`` (default 512, the default ladder's top)
  and the runner's tokens per step. Larger steps run without a graph.

The config keeps the spec string (hashable, serialisable; ``config/compilation.py`` only checks its
form). The file's contents change which graphs are captured, never compiled code, so the
compile cache key holds the spec string, not the file's contents.
"""

from __future__ import annotations

import logging
import os

from compile_runtime.config import CompilationConfig, parse_auto_spec
from compile_runtime.planner.sizes import (
    DEFAULT_MAX_CAPTURE_SIZE,
    default_capture_sizes,
    default_num_graphs,
    plan_report,
)
from compile_runtime.planner.workload import load_workload

logger = logging.getLogger(__name__)


def resolve_capture_sizes(
    config: CompilationConfig, max_num_tokens: int | None = None
) -> list[int]:
    """The CUDA graph sizes ``config`` asks for, bounded by the runner's tokens per step if known."""
    requested = config.cudagraph_capture_sizes
    if isinstance(requested, str):
        cap = config.max_cudagraph_capture_size or DEFAULT_MAX_CAPTURE_SIZE
        cap = min(cap, max_num_tokens) if max_num_tokens is not None else cap
        sizes = resolve_auto_sizes(requested, cap)
    elif requested is not None:
        sizes = list(requested)
    else:
        sizes = default_capture_sizes(config.max_cudagraph_capture_size or DEFAULT_MAX_CAPTURE_SIZE)
    if max_num_tokens is not None:
        sizes = [s for s in sizes if s <= max_num_tokens]
    return sizes


_resolved: dict[tuple, list[int]] = {}


def resolve_auto_sizes(spec: str, max_size: int | None) -> list[int]:
    """The capture sizes ``spec`` plans, capped at ``max_size``."""
    parsed = parse_auto_spec(spec)
    try:
        stat = os.stat(parsed.path)
        stamp: tuple = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        stamp = ()
    key = (spec, os.path.abspath(parsed.path), stamp, max_size)
    if key in _resolved:
        return list(_resolved[key])
    try:
        workload = load_workload(parsed.path)
    except ValueError as e:
        raise ValueError(
            f"cudagraph_capture_sizes={spec!r}: {e}; or set cudagraph_capture_sizes to a list "
            "of sizes (or None for the default ladder)"
        ) from None
    histogram = workload.combined()
    k = parsed.max_graphs or max(default_num_graphs(histogram, max_size), 1)
    report = plan_report(histogram, k, max_size)
    if not report.sizes:
        raise ValueError(
            f"cudagraph_capture_sizes={spec!r}: every step in {parsed.path!r} has more than "
            f"{max_size} tokens, so no graph size fits under the cap; raise "
            "max_cudagraph_capture_size or record a workload with smaller steps"
        )
    logger.info(
        "cudagraph_capture_sizes %s: %d sizes planned from %d steps, up to %d: %s; padding "
        "%.2f tokens/step (default ladder with %d sizes: %.2f); %d steps above %s run without "
        "a graph",
        spec,
        len(report.sizes),
        report.plan.num_steps,
        report.sizes[-1],
        report.sizes,
        report.plan.padded_per_step,
        report.default_same_k.num_sizes,
        report.default_same_k.padded_per_step,
        report.plan.uncovered_steps,
        report.sizes[-1],
    )
    _resolved[key] = list(report.sizes)
    return list(report.sizes)


# A CPU graph saves the Python around a step (a few ms), which matters for small batches;
# a large batch is its arithmetic, and every size costs captures at start-up and memory.
CPU_MAX_CAPTURE_SIZE = 64


def decide_capture_sizes(
    config: CompilationConfig, max_num_tokens: int, *, cpu_graphs: bool
) -> tuple[int, ...]:
    """The graph sizes every rank captures, decided once by the engine: ``config``'s (for CPU
    graphs the default ladder capped), bounded by the runner's tokens per step. An
    ``auto:FILE`` spec reads its file here, in the driver, not on every rank."""
    capped = cpu_capture_config(config) if cpu_graphs else config
    return tuple(resolve_capture_sizes(capped, max_num_tokens))


def cpu_capture_config(config: CompilationConfig) -> CompilationConfig:
    """``config`` with the default ladder capped at ``CPU_MAX_CAPTURE_SIZE`` for CPU graphs,
    unless it names its own sizes or cap."""
    if config.cudagraph_capture_sizes is not None or config.max_cudagraph_capture_size is not None:
        return config
    return config.replace(max_cudagraph_capture_size=CPU_MAX_CAPTURE_SIZE)
