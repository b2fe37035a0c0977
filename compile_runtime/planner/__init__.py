"""Capture sizes planned from a recorded workload (``compile-runtime plan-sizes``)."""

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
