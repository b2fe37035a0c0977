"""How many CPU threads the engine uses, chosen once at start-up.

On a CPU every op of a step is an OpenMP parallel region whose threads wait
for each other at its end. When another process keeps a core busy, one of our
threads is regularly descheduled and every region waits a scheduler slice for
it: on 2 cores with both busy, a decode step slows down far more with 2
threads than with 1 (benchmarks/vs_transformers.py --cotenancy; the README's
"Sharing the cores"). So the default counts the cores
this process may use, subtracts those other processes keep busy right now,
and splits the rest between tensor-parallel ranks.

``LLM(num_threads=N)`` or ``OMP_NUM_THREADS`` overrides it. This file is the
one owner of the count: ``choose_num_threads`` decides it once per engine, in
the driver before any worker starts (starting workers would count each other
as busy cores), into the frozen config's ``num_threads``, so every rank gets the same;
``set_num_threads`` sets it in each process that runs a runner, before the
first compile (a runner built directly, with no count chosen, decides it there).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from compile_runtime.config import RunnerConfig
from compile_runtime.platforms.select import platform_for

logger = logging.getLogger(__name__)

SAMPLES = 5
SAMPLE_INTERVAL_S = 0.002


BINDING_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def openmp_binds_threads() -> bool:
    """Whether the user asked the OpenMP runtime to pin its threads (its env variables)."""
    for name in BINDING_VARIABLES:
        value = os.environ.get(name, "").strip().lower()
        if value and value not in ("false", "disabled", "none"):
            return True
    return False


def usable_cores() -> int:
    """Cores this process may use.

    When the OpenMP runtime pins its threads, it has already pinned this (its
    initial) thread to one place by the time torch is imported, so the affinity
    mask shows one core; the runtime's own default thread count was taken from
    the mask before that, and is the count to trust then.
    """
    if openmp_binds_threads():
        return max(1, torch.get_num_threads())
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def runnable_tasks() -> int | None:
    """Tasks running or ready to run on the whole machine now (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def busy_cores() -> int:
    """Cores other processes keep busy: the fewest runnable tasks over a few samples,
    less this thread (our own idle OpenMP workers may still be spinning at the first)."""
    counts = []
    for i in range(SAMPLES):
        if i:
            time.sleep(SAMPLE_INTERVAL_S)
        n = runnable_tasks()
        if n is None:
            return 0
        counts.append(n)
    return max(0, min(counts) - 1)


def default_num_threads(ranks: int = 1) -> int:
    """Threads per rank: free cores split over the ranks, at least 1; OMP_NUM_THREADS wins."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = usable_cores()
    busy = min(busy_cores(), cores - 1)
    threads = max(1, (cores - busy) // ranks)
    logger.info(
        "CPU threads per rank: %d (%d cores, %d busy with other work, %d rank(s)); "
        "set LLM(num_threads=...) or OMP_NUM_THREADS to choose",
        threads,
        cores,
        busy,
        ranks,
    )
    return threads


def resolve_num_threads(requested: int | None, ranks: int = 1) -> int:
    if requested is None:
        return default_num_threads(ranks)
    if requested < 1:
        raise ValueError(f"num_threads must be at least 1, got {requested}")
    return requested


def choose_num_threads(
    config: RunnerConfig, device: torch.device | str, ranks: int
) -> RunnerConfig:
    """``config`` with ``num_threads`` decided for a CPU engine (an explicit count is checked)."""
    if not platform_for(device).sets_threads:
        return config
    chosen = resolve_num_threads(config.num_threads, ranks)
    if chosen == config.num_threads:
        return config
    return config.model_copy(update={"num_threads": chosen})


def set_num_threads(config: RunnerConfig, device: torch.device, ranks: int) -> None:
    """Set this process's count to the engine's, on a CPU (choosing it if none was chosen,
    for one of ``ranks`` processes sharing the cores)."""
    if platform_for(device).sets_threads:
        torch.set_num_threads(resolve_num_threads(config.num_threads, ranks))
