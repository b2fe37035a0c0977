"""Pipeline parallelism: layers split into stages over worker processes (and Ray actors),
hidden states handed from stage to stage, the last stage sampling, one step per stage out
at once. Greedy tokens equal one process's, with mixed prompt lengths, prefix caching,
preemption, speculative decoding and tensor parallelism inside each stage."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import compile_runtime as cr
from compile_runtime.distributed import parallel_state as ps
from compile_runtime.distributed.pipeline import (
    PipelineConfigError,
    PipelineStage,
    stage_layer_counts,
)

PROMPTS = [[5, 6, 7], list(range(10, 40)), [100], list(range(200, 217)), [9] * 21, [33, 44]]
GREEDY = cr.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SIZES = dict(max_num_seqs=4, max_num_batched_tokens=8, block_size=4, max_model_len=64)


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def count_steps_out(llm) -> list[int]:
    """Spy on the executor: how many steps were out (sent, tokens not read) after each send."""
    executor, out, seen = llm.executor, [0], []
    execute, sample = executor.execute_model, executor.sample_tokens

    def execute_model(so):
        execute(so)
        out[0] += 1
        seen.append(out[0])

    def sample_tokens():
        result = sample()
        out[0] -= 1
        return result

    executor.execute_model, executor.sample_tokens = execute_model, sample_tokens
    return seen


# ---- the split ------------------------------------------------------------------------


def test_layers_split_evenly_with_the_extra_ones_first():
    assert stage_layer_counts(30, 2) == [15, 15]
    assert stage_layer_counts(30, 4) == [8, 8, 7, 7]
    assert stage_layer_counts(5, 1) == [5]
    assert stage_layer_counts(5, 2, (1, 4)) == [1, 4]


@pytest.mark.parametrize(
    "layers, stages, partition, message",
    [
        (2, 3, None, "more stages than the model's 2 layers"),
        (6, 2, (3, 2), "add up to the model's 6 layers"),
        (6, 2, (6, 0), "counts of at least 1"),
        (6, 2, (2, 2, 2), "needs 2 counts"),
    ],
)
def test_a_split_that_cannot_work_names_the_numbers(layers, stages, partition, message):
    with pytest.raises(PipelineConfigError, match=message):
        stage_layer_counts(layers, stages, partition)


def test_each_stage_holds_its_own_checkpoint_tensors():
    first, last = PipelineStage(0, 2, 0, 15), PipelineStage(1, 2, 15, 30, tied=True)
    names = ["model.embed_tokens.weight", "model.layers.3.mlp.down_proj.weight",
             "model.layers.15.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"]  # fmt: skip
    assert [first.holds_weight(n) for n in names] == [True, True, False, False, False]
    # The last stage reads the embedding too: its LM head shares the weights.
    assert [last.holds_weight(n) for n in names] == [True, False, True, True, True]
    assert not PipelineStage(1, 2, 15, 30).holds_weight(names[0])


@pytest.fixture
def as_stage(monkeypatch):
    """Build models as stage ``rank`` of ``size`` (one rank per stage, no process group)."""

    def set_stage(rank: int, size: int, partition=None) -> None:
        state = ps.ParallelState(rank, size, "gloo", None, "0", size, partition)
        monkeypatch.setattr(ps, "_state", state)

    return set_stage


def test_each_stage_builds_and_loads_only_its_layers(model_dirs, as_stage):
    from compile_runtime.models.registry import load_model

    model_dir = model_dirs("llama", num_hidden_layers=3)
    config = cr.CompilationConfig(mode="NONE")
    whole = load_model(model_dir, config)
    as_stage(0, 2, (2, 1))
    first = load_model(model_dir, config)
    as_stage(1, 2, (2, 1))
    last = load_model(model_dir, config)
    assert [len(m.attention_layers()) for m in (first, last)] == [2, 1]
    assert first.model.norm is None and first.lm_head is None
    assert last.model.norm is not None and last.lm_head is not None
    names = {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()}
    assert names == {n for n, _ in whole.named_parameters()}
    # The two stages compute what the whole model computes.
    import torch

    ids, positions = torch.tensor([3, 4, 5]), torch.arange(3)
    with torch.no_grad():
        hidden = first.model(ids, positions)
        assert torch.equal(last.model(ids, positions, hidden), whole.model(ids, positions))


def test_pipeline_refusals_name_the_fix(model_dirs):
    with pytest.raises(PipelineConfigError, match="more stages than the model's 2 layers"):
        cr.LLM(model_dirs("llama"), {"backend": "eager"}, pipeline_parallel_size=3, **SIZES)
    with pytest.raises(PipelineConfigError, match="enable_microbatching"):
        cr.LLM(model_dirs("llama"), {"backend": "eager"}, pipeline_parallel_size=2,
               enable_microbatching=True, **SIZES)  # fmt: skip
    with pytest.raises(ValueError, match="needs a native model"):
        cr.LLM(model_dirs("llama"), {"backend": "eager"}, pipeline_parallel_size=2,
               use_transformers=True, **SIZES)  # fmt: skip


def test_the_compile_cache_key_names_the_stage():
    from compile_runtime.cache.key import compute_key, key_factors

    config = cr.CompilationConfig()
    keys = {
        compute_key(
            key_factors(
                config,
                graph_hash="g",
                sources={},
                pass_uuid="p",
                world_size=2,
                pipeline_stage=stage,
            )
        )  # fmt: skip
        for stage in ("0 of 2", "1 of 2")
    }
    assert len(keys) == 2


# ---- whole engines ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(model_dirs):
    with cr.LLM(model_dirs("llama"), {"backend": "eager"}, **SIZES) as one:
        return _tokens(one)


@pytest.mark.slow
def test_two_stages_with_inductor_trace_once_each_and_overlap(model_dirs, reference):
    # 14 blocks of 4 tokens cannot hold three requests at full length: preemption.
    llm = cr.LLM(model_dirs("llama"), {"backend": "inductor", "lazy_capture": False},
                 pipeline_parallel_size=2,
                 num_gpu_blocks_override=14, **SIZES)  # fmt: skip
    try:
        pids = llm.executor.pids
        out = count_steps_out(llm)
        assert _tokens(llm) == reference
        assert max(out) == 2  # a second step went out before the first one's tokens came back
        assert llm.core.scheduler.num_preemptions > 0
        assert llm.core.num_blocks_in_use == 0
        for info in llm.executor.workers_info:
            assert info.counters["num_graphs_seen"] == 1  # one trace per stage
            assert "CPU PIECEWISE" in info.startup.graph_sizes
    finally:
        llm.shutdown()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_two_stages_with_prefix_caching_and_speculative_decoding(model_dirs, reference):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = cr.LLM(model_dirs("llama"), {"backend": "eager"}, pipeline_parallel_size=2,
                 speculative_config=spec, **SIZES)  # fmt: skip
    try:
        assert _tokens(llm) == reference
        assert llm.core.spec_decode_stats.num_draft_tokens > 0
        hits = llm.prefix_cache_stats.hits
        assert _tokens(llm, PROMPTS[1:2]) == reference[1:2]  # its prefix is cached now
        assert llm.prefix_cache_stats.hits > hits
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_two_stages_of_two_tensor_parallel_ranks(model_dirs, reference):
    llm = cr.LLM(model_dirs("llama"), {"backend": "eager"}, pipeline_parallel_size=2,
                 tensor_parallel_size=2, **SIZES)  # fmt: skip
    try:
        assert len(llm.executor.pids) == 4
        assert _tokens(llm) == reference
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_uneven_partition_over_ray(model_dirs):
    pytest.importorskip("ray")
    model_dir = model_dirs("llama", num_hidden_layers=3)
    with cr.LLM(model_dir, {"backend": "eager"}, **SIZES) as one:
        want = _tokens(one)
    llm = cr.LLM(model_dir, {"backend": "eager"}, pipeline_parallel_size=2,
                 pipeline_layer_partition=(1, 2), distributed_executor_backend="ray",
                 **SIZES)  # fmt: skip
    try:
        assert _tokens(llm) == want
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_two_node_ray_cluster_runs_tensor_parallel_inside_nodes_and_stages_across(
    model_dirs, reference
):
    """The README's two-machine recipe on one machine: a Ray cluster of a head that runs no
    workers and two "nodes" of 2 CPUs each (``ray start`` with separate resources, as
    Ray's own tests do); TP=2 x PP=2 puts each stage's two ranks on one node."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        llm = cr.LLM(model_dirs("llama"), {"backend": "eager"}, tensor_parallel_size=2,
                     pipeline_parallel_size=2, distributed_executor_backend="ray", **SIZES)  # fmt: skip
        try:
            assert _tokens(llm) == reference
            node = llm.executor.rank_nodes
        finally:
            llm.shutdown()
        assert node[0] == node[1] != node[2] == node[3]
        assert {node[0], node[2]} == {w.node_id for w in workers}
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
def test_a_stage_that_dies_fails_the_requests_naming_its_rank(model_dirs):
    from compile_runtime.executor import WorkerDiedError

    llm = cr.LLM(model_dirs("llama"), {"backend": "eager"}, pipeline_parallel_size=2, **SIZES)
    pids = llm.executor.pids

    def kill_the_last_stage():
        while llm.executor.num_steps < 3:
            time.sleep(0.001)
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_the_last_stage, daemon=True)
    killer.start()
    start = time.monotonic()
    long = cr.SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with pytest.raises(WorkerDiedError, match=r"rank 1 died: .*SIGKILL"):
        _tokens(llm, [[1, 2, 3]] * 4, long)
    assert time.monotonic() - start < 60  # the first stage, blocked handing over, is stopped
    killer.join()
    assert llm.core.num_blocks_in_use == 0 and not llm.core.has_unfinished()
    llm.shutdown()


@pytest.mark.slow
def test_served_by_two_stages(model_dirs, tmp_path):
    from serving import get, serve_like_offline, wait_for, worker_pids

    server = serve_like_offline(model_dirs("llama"), str(tmp_path), "--pipeline-parallel-size", "2")
    try:
        # The last stage dies while idle: seen at once (/health 503), both stages restarted.
        os.kill(max(worker_pids(server.proc.pid)), signal.SIGKILL)  # rank 1 started last
        wait_for(lambda: get(server.url + "/health")[0] == 503, 10, "/health 503")
        wait_for(lambda: get(server.url + "/health")[0] == 200, 180, "/health 200 again")
        assert "rank 1 died" in server.log() and len(worker_pids(server.proc.pid)) == 2
        status, body = server.post("/v1/completions", {"model": server.model, "prompt": "hi",
                                                        "max_tokens": 4})  # fmt: skip
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert server.metric("compile_runtime_worker_restarts_total") == 1
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_real_model_two_stages_give_one_process_tokens(backend):
    """SmolLM2 in float32: PP=2 (15 layers a stage) greedy tokens equal one process's, with
    mixed prompt lengths and a shared prefix, over worker processes and Ray actors."""
    if backend == "ray":
        pytest.importorskip("ray")
    from compile_runtime.models.smollm2 import smollm2_gguf

    prompts = [list(range(1000, 1000 + n)) for n in (7, 40, 3, 90, 25, 61)]
    prompts.append(prompts[3][:50] + [5, 6, 7])
    params = cr.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(dtype="float32", quantization="none", max_num_seqs=8)
    with cr.LLM(smollm2_gguf(), **options) as one:
        want = _tokens(one, prompts, params)
    with cr.LLM(smollm2_gguf(), pipeline_parallel_size=2, distributed_executor_backend=backend,
                **options) as two:  # fmt: skip
        assert _tokens(two, prompts, params) == want
