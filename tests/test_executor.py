"""Executors: tensor parallelism over worker processes and Ray actors, and their failures.

Every test here starts real worker processes (gloo over the loopback
interface), so they are marked slow; each start costs ~10 s of imports on 2
cores. TP=2 must give the greedy tokens of TP=1 exactly.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import signal
import threading
import time

import faulty_worker
import pytest

from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.distributed import TensorParallelConfigError
from compile_runtime.engine.llm import LLM
from compile_runtime.executor import WorkerDiedError, executor_class, multiproc

# Ray must use the loopback address only; read when ray is first imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

PROMPTS = [[5, 6, 7], list(range(10, 40)), [100], list(range(200, 217))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
RUNNER = dict(max_num_seqs=4, max_num_batched_tokens=64)

_tp1: dict[str, list[list[int]]] = {}


def tp1_tokens(model_dir: str) -> list[list[int]]:
    """Greedy tokens on one rank (eager; tests/test_generate.py ties them to transformers)."""
    if model_dir not in _tp1:
        llm = LLM(model_dir, {"mode": "NONE"}, **RUNNER)
        _tp1[model_dir] = [
            o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        ]
    return _tp1[model_dir]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]


@pytest.mark.slow
def test_tp2_inductor_matches_tp1_with_one_trace_per_rank(model_dirs, session_cache_dir):
    model_dir = model_dirs("llama")
    config = {"backend": "inductor", "lazy_capture": False}  # graphs counted at start-up
    llm = LLM(model_dir, config, tensor_parallel_size=2, **RUNNER)
    modes = []
    step = llm.core.step

    def spy():
        out = step()
        modes.append(out.runtime_mode)
        return out

    llm.core.step = spy
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        infos = llm.executor.workers_info
        pids = llm.executor.pids
    finally:
        llm.shutdown()
    assert_gone(pids)
    assert tokens == tp1_tokens(model_dir)
    # Each rank replays CPU graphs: the all-reduce is a recorded call back into torch, so
    # every size is captured on both ranks, and every step (prefill, then decode) ran in one.
    assert modes[0] == "PIECEWISE" and set(modes[1:]) == {"FULL"}
    layers = 2
    for info in infos:
        assert "CPU FULL 1, 2, 4" in info.startup.graph_sizes
        assert "not captured" not in info.startup.graph_sizes
        # One Dynamo trace per rank; the all-reduces stay inside pieces (only attention splits).
        assert info.counters["num_graphs_seen"] == 1
        assert info.counters["num_piecewise_graphs_seen"] == 2 * layers + 1
        assert info.counters["num_piecewise_capturable_graphs_seen"] == layers + 1
    # The traced graph is the same on both ranks: one key, one entry per rank under it.
    keys = [
        d
        for d in os.listdir(session_cache_dir)
        if os.path.exists(os.path.join(session_cache_dir, d, "rank_1"))
    ]
    assert len(keys) == 1
    key_dir = os.path.join(session_cache_dir, keys[0])
    assert os.path.isdir(os.path.join(key_dir, "rank_0"))
    with open(os.path.join(key_dir, "key_factors.json")) as f:
        assert json.load(f)["world_size"] == 2


# A budget of 8 tokens a step chunks the prompts (steps where nobody samples: the
# logits gather is empty); 14 blocks of 4 tokens cannot hold all four requests, so
# some are preempted and recomputed, on every rank alike.
CHUNKED = dict(
    max_num_seqs=4,
    max_num_batched_tokens=8,
    block_size=4,
    num_gpu_blocks_override=14,
    max_model_len=64,
)


# Speculative decoding: rank 0 verifies the drafts and broadcasts a variable number of
# tokens per request; every rank must append the same ones.
SPECULATIVE = {**CHUNKED, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, runner", [("qwen2", RUNNER), ("qwen3", CHUNKED), ("llama", SPECULATIVE)]
)
def test_tp2_piecewise_matches_tp1(model_dirs, arch, runner):
    model_dir = model_dirs(arch)
    with LLM(
        model_dir,
        {"backend": "eager"},
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        **runner,
    ) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        with pytest.raises(AttributeError, match="worker processes"):
            llm.runner  # noqa: B018
        assert llm.workload.num_steps == llm.last_stats.steps
        if runner is CHUNKED:
            assert llm.core.scheduler.num_preemptions > 0
            # Again: the prompts' blocks are in the prefix cache; every rank reads the same ones.
            again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            assert again == tokens and llm.last_stats.prefix_cache.hits > 0
        if runner is SPECULATIVE:
            assert llm.last_stats.spec_decode.num_draft_tokens > 0
        pids = llm.executor.pids
    assert_gone(pids)
    assert tokens == tp1_tokens(model_dir)


@pytest.mark.slow
def test_ray_tp2_matches_tp1(model_dirs):
    ray = pytest.importorskip("ray")
    model_dir = model_dirs("llama")
    expected = tp1_tokens(model_dir)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with LLM(
            model_dir,
            {"backend": "eager"},
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            **RUNNER,
        ) as llm:
            tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            assert sorted(i.rank for i in llm.executor.workers_info) == [0, 1]
    finally:
        ray.shutdown()
    assert tokens == expected


def _start_tp2(model_dir: str) -> LLM:
    return LLM(
        model_dir,
        {"mode": "NONE"},
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )


LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.mark.slow
def test_killed_worker_raises_naming_the_rank_and_leaves_no_process(model_dirs):
    llm = _start_tp2(model_dirs("llama"))
    pids = llm.executor.pids

    def kill_rank1_mid_generation():
        while llm.executor.num_steps < 3:
            time.sleep(0.001)
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_rank1_mid_generation, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 died: .*killed by signal SIGKILL") as e:
        llm.generate([[1, 2, 3]] * 4, LONG, use_tqdm=False)
    assert time.monotonic() - start < 60
    assert e.value.rank == 1
    assert 3 <= llm.executor.num_steps < 400  # it died mid-generation
    assert_gone(pids)
    killer.join()


@pytest.mark.slow
def test_exception_in_forward_raises_its_cause_and_stops_every_worker(model_dirs, monkeypatch):
    # Rank 1's runner raises in its 5th step's execute_model (tests/faulty_worker.py).
    fault = faulty_worker.Fault(rank=1, at_step=5, message="boom in forward")
    faulty = functools.partial(faulty_worker.worker_main, fault=fault)
    monkeypatch.setattr(multiproc, "worker_main", faulty)
    llm = _start_tp2(model_dirs("llama"))
    pids = llm.executor.pids
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 died: InjectedFault: boom in forward"):
        llm.generate([[1, 2, 3]] * 4, LONG, use_tqdm=False)
    assert time.monotonic() - start < 60
    assert llm.executor.num_steps == 4  # the steps before the faulty one went through
    assert_gone(pids)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_heads_not_divisible_by_ranks_is_rejected_before_any_worker_starts(model_dirs):
    before = multiprocessing.active_children()
    with pytest.raises(
        TensorParallelConfigError,
        match="num_attention_heads=4 is not divisible by tensor_parallel_size=3",
    ):
        LLM(model_dirs("llama"), {"mode": "NONE"}, tensor_parallel_size=3)
    assert multiprocessing.active_children() == before


def test_tensor_parallel_needs_a_native_model(model_dirs):
    with pytest.raises(TensorParallelConfigError, match="needs a native model"):
        LLM(model_dirs("olmo2"), {"mode": "NONE"}, tensor_parallel_size=2)


def test_ray_backend_without_ray_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'compile-runtime\[ray\]'"):
        executor_class("ray", 2)


def test_backend_choice():
    from compile_runtime.executor.multiproc import MultiprocExecutor
    from compile_runtime.executor.uniproc import UniProcExecutor

    assert executor_class(None, 1) is UniProcExecutor
    assert executor_class(None, 2) is MultiprocExecutor
    with pytest.raises(ValueError, match="need 'mp' or 'ray'"):
        executor_class("uni", 2)
    with pytest.raises(ValueError, match="not one of"):
        executor_class("threads", 2)
