"""The CPU thread count: free cores at start-up, split over ranks; explicit choices win."""

from __future__ import annotations

import pytest
import torch

from compile_runtime.cpu import threads as cpu_threads


def test_default_subtracts_busy_cores_and_splits_over_ranks(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 8)
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: 0)
    assert cpu_threads.default_num_threads() == 8
    assert cpu_threads.default_num_threads(ranks=2) == 4
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: 3)
    assert cpu_threads.default_num_threads() == 5
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: 20)  # never below one thread
    assert cpu_threads.default_num_threads(ranks=2) == 1


def test_busy_cores_takes_the_quietest_sample_less_this_thread(monkeypatch):
    samples = iter([5, 2, 3, 4, 6])
    monkeypatch.setattr(cpu_threads, "runnable_tasks", lambda: next(samples))
    monkeypatch.setattr(cpu_threads, "SAMPLE_INTERVAL_S", 0.0)
    assert cpu_threads.busy_cores() == 1
    monkeypatch.setattr(cpu_threads, "runnable_tasks", lambda: None)  # no /proc/stat
    assert cpu_threads.busy_cores() == 0


def test_explicit_choices_win(monkeypatch):
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: 0)
    assert cpu_threads.resolve_num_threads(3) == 3
    with pytest.raises(ValueError, match="at least 1"):
        cpu_threads.resolve_num_threads(0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads.resolve_num_threads(None) == torch.get_num_threads()


def test_the_engine_chooses_once_and_only_on_a_cpu(monkeypatch):
    from compile_runtime.config import RunnerConfig

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 8)
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: 2)
    config = cpu_threads.choose_num_threads(RunnerConfig(), "cpu", ranks=2)
    assert config.num_threads == 3
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: 0)  # a worker's view: unchanged
    assert cpu_threads.choose_num_threads(config, "cpu", ranks=2) is config
    assert config.num_threads == 3
    on_gpu = cpu_threads.choose_num_threads(RunnerConfig(), "cuda", ranks=1)
    assert on_gpu.num_threads is None


def test_a_runner_process_sets_the_chosen_count():
    from compile_runtime.config import RunnerConfig

    before = torch.get_num_threads()
    try:
        cpu_threads.set_num_threads(RunnerConfig(num_threads=1), torch.device("cpu"), 1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cores_are_counted_right_when_openmp_pins_its_threads():
    """With OMP_PROC_BIND set, the OpenMP runtime pins the importing thread to one
    core; counting its affinity mask would halve the threads on 2 cores."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from compile_runtime.cpu.threads import usable_cores\n"
        "print(usable_cores())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(OMP_PROC_BIND="close", OMP_PLACES="cores")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout.strip()) == len(os.sched_getaffinity(0))


def test_binding_switched_off_is_not_binding(monkeypatch):
    for name in cpu_threads.BINDING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not cpu_threads.openmp_binds_threads()
    monkeypatch.setenv("OMP_PROC_BIND", "false")
    assert not cpu_threads.openmp_binds_threads()
    monkeypatch.setenv("OMP_PROC_BIND", "spread")
    assert cpu_threads.openmp_binds_threads()
