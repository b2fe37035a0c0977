"""Standby worker processes: a restart runs the ranks in processes spawned and imported
ahead (executor/standby.py), gives the same greedy tokens, spawns the next standby set,
falls back to a fresh spawn when a standby died, and leaves no process behind."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.engine.llm import LLM
from compile_runtime.executor import ExecutorError
from compile_runtime.executor.standby import STANDBY_PROCESS_NAME
from compile_runtime.worker.worker import WORKER_PROCESS_PREFIX

PROMPTS = [[5, 6, 7], list(range(10, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
RUNNER = dict(max_num_seqs=4, max_num_batched_tokens=64)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def standby_pids(llm: LLM) -> list[int]:
    return [s.process.pid for s in llm._standby.idle]


def wait_named(pids: list[int], name: str) -> None:
    deadline = time.monotonic() + 60
    while not all(comm(p) == name for p in pids):
        assert time.monotonic() < deadline, f"{pids} never named {name}"
        time.sleep(0.05)


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"process {pid} is still alive"
            time.sleep(0.05)


@pytest.mark.slow
def test_a_restart_runs_every_rank_in_a_standby_process(model_dirs):
    llm = LLM(model_dirs("llama"), {"mode": "NONE"}, tensor_parallel_size=2,
              distributed_executor_backend="mp", **RUNNER)  # fmt: skip
    try:
        before = tokens(llm)
        assert [comm(p) for p in llm.executor.pids] == [
            f"{WORKER_PROCESS_PREFIX}0",
            f"{WORKER_PROCESS_PREFIX}1",
        ]
        llm.keep_standby_workers()
        ready = standby_pids(llm)
        assert len(ready) == 2
        wait_named(ready, STANDBY_PROCESS_NAME)
        old = llm.executor.pids
        os.kill(old[1], signal.SIGKILL)
        with pytest.raises(ExecutorError, match="rank 1 died"):
            tokens(llm)
        llm.restart_workers()
        assert llm.executor.pids == ready  # rank r in the r-th standby
        assert tokens(llm) == before
        assert len(set(standby_pids(llm)) - set(ready)) == 2 and llm._standby.spawned == 4
        llm.keep_standby_workers()  # a second call keeps the pool it has
        assert llm._standby.spawned == 4
        everything = [*old, *ready, *standby_pids(llm)]
    finally:
        llm.shutdown()
    assert_gone(everything)


@pytest.mark.slow
def test_a_dead_standby_is_replaced_by_a_fresh_spawn(model_dirs, caplog):
    llm = LLM(model_dirs("llama"), {"mode": "NONE"}, distributed_executor_backend="mp", **RUNNER)
    try:
        before = tokens(llm)
        llm.keep_standby_workers()
        (standby,) = standby_pids(llm)
        os.kill(standby, signal.SIGKILL)
        os.kill(llm.executor.pids[0], signal.SIGKILL)
        with pytest.raises(ExecutorError, match="rank 0 died"):
            tokens(llm)
        with caplog.at_level(logging.WARNING, "compile_runtime.executor.standby"):
            llm.restart_workers()
        assert "a standby worker process died" in caplog.text
        assert llm.executor.pids[0] != standby
        assert tokens(llm) == before
        assert len(standby_pids(llm)) == 1  # the pool is full again
    finally:
        llm.shutdown()


def test_no_standby_where_the_model_runs_in_this_process(model_dirs):
    with LLM(model_dirs("llama"), {"mode": "NONE"}, **RUNNER) as llm:
        llm.keep_standby_workers()
        assert llm._standby is None
