"""The CPU thread count: free cores at start-up, split over ranks; explicit choices win."""

from __future__ import annotations

import pytest
import torch

from compile_runtime.runner import cpu_threads


def test_default_subtracts_busy_cores_and_splits_over_ranks(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 8)
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: 0)
    assert cpu_threads.default_num_threads() == 8
    assert cpu_threads.default_num_threads(tp_size=2) == 4
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: 3)
    assert cpu_threads.default_num_threads() == 5
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: 20)  # never below one thread
    assert cpu_threads.default_num_threads(tp_size=2) == 1


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
