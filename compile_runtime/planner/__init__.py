"""Capture sizes planned from a recorded workload (``compile-runtime plan-sizes``).

One list of capture sizes serves both kinds of graph (the dispatcher pads
uniform decode steps and mixed steps with the same sizes), so plans are made
over the union of the recorded decode and mixed histograms. Steps above the
largest size (``--max-size``, default 512) are not planned for: they run
without a graph and are reported as uncovered.

``workload`` (the recorded step-size histogram), ``sizes`` (the exact dynamic program that
picks the sizes), ``capture_sizes`` (a config's capture sizes resolved at start-up,
``"auto:FILE"`` included); ``compile-runtime plan-sizes`` is in ``compile_runtime/cli/``.
"""

from __future__ import annotations

from compile_runtime.planner.sizes import (
    LadderCost,
    PlanReport,
    default_ladder_with_k,
    ladder_cost,
    plan_report,
    plan_sizes,
)
from compile_runtime.planner.workload import Workload, WorkloadError, load_workload

__all__ = [
    "LadderCost",
    "PlanReport",
    "Workload",
    "WorkloadError",
    "default_ladder_with_k",
    "ladder_cost",
    "load_workload",
    "plan_report",
    "plan_sizes",
]
