"""What a runner takes and gives back: KV sizing, the block pool's footprint, shutdown,
and the inputs of start-up capture (attention metadata only for FULL graphs)."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from compile_runtime.backends.attention import torch_native

from compile_runtime.attention import layer as attention_layer
from compile_runtime.attention.selector import ENV_VAR as ATTENTION_ENV
from compile_runtime.config import CUDAGraphMode, RunnerConfig
from compile_runtime.core.kv_blocks import BlockPool
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.engine.llm import LLM
from compile_runtime.executor.base import ExecutorError
from compile_runtime.forward_context import BatchDescriptor
from compile_runtime.worker import startup
from compile_runtime.worker.capture_inputs import capture_inputs
from compile_runtime.worker.kv_sizing import (
    CudaMemory,
    cuda_kv_budget,
    most_blocks_needed,
)
from compile_runtime.worker.step_inputs import (
    StepBuffers,
    StepInputs,
    pins_staging,
    profile_query_lens,
    staging_buffer,
)

EAGER = {"backend": "eager"}
GiB = 2**30
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_most_blocks_needed_rounds_each_request_up_and_adds_the_null_block():
    assert most_blocks_needed(max_num_seqs=4, max_model_len=100, block_size=16) == 4 * 7 + 1
    assert most_blocks_needed(max_num_seqs=1, max_model_len=16, block_size=16) == 2


def test_cuda_budget_is_this_engines_share_within_what_is_free():
    # 100 GiB device, 0.5 share, 2 GiB of weights + 1 GiB of activations: 50 - 3 = 47 GiB
    # (the activations once: they are in the own peak).
    memory = CudaMemory(total=100 * GiB, free=90 * GiB, own_peak=3 * GiB, activations=1 * GiB)
    assert cuda_kv_budget(memory, 0.5) == 47 * GiB
    # Another engine holds most of the device: what is free less the steps' activations.
    crowded = CudaMemory(total=100 * GiB, free=10 * GiB, own_peak=3 * GiB, activations=1 * GiB)
    assert cuda_kv_budget(crowded, 0.9) == 9 * GiB
    # Nothing left is 0, not a negative budget.
    full = CudaMemory(total=100 * GiB, free=0, own_peak=3 * GiB, activations=1 * GiB)
    assert cuda_kv_budget(full, 0.9) == 0


def test_cuda_blocks_subtract_the_profiles_activations_once(monkeypatch):
    """num_kv_blocks on a pretend 100 GiB device: 1 GiB held before this engine, 2 GiB of
    weights, a 3 GiB activation peak in the profile (freed since), 80 GiB free."""
    cuda = startup.torch.cuda
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(cuda, name, lambda *a: None)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device: (80 * GiB, 100 * GiB))
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device: (1 + 2 + 3) * GiB)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device: (1 + 2) * GiB)
    # 32 layers of 8 KV heads of 128 in fp16, 16-token blocks: 2 MiB a block.
    layers = [SimpleNamespace(num_kv_heads=8, head_size=128)] * 32
    config = RunnerConfig(
        max_num_seqs=256, max_model_len=8192, block_size=16, gpu_memory_utilization=0.5
    )
    blocks = startup.num_kv_blocks(config, layers, torch.float16, torch.device("cuda"), 1 * GiB)
    # 50 GiB share - (2 + 3) GiB own peak = 45 GiB (within 80 - 3 free): 23040 blocks; the
    # activations subtracted twice gave 42 GiB, 21504 blocks.
    assert blocks == 45 * GiB // (2 * 2**20) == 23040


def test_profile_query_lens_spread_the_tokens_over_the_requests():
    assert profile_query_lens(8192, 256).tolist() == [32] * 256
    assert profile_query_lens(10, 4).tolist() == [3, 3, 2, 2]
    assert profile_query_lens(3, 8).tolist() == [1, 1, 1]
    assert max(profile_query_lens(1000, 7)) == 143  # ceil(1000 / 7)


def test_profiling_forward_builds_no_mask_over_all_its_tokens(model_dirs, monkeypatch):
    """The first forward runs its tokens (up to max_num_tokens = 512) as max_num_seqs = 16
    requests through the paged backend (torch_native: one dense attention per request), never the
    metadata-less dense attention over all 512 as one sequence ([512, 512] mask)."""
    monkeypatch.setenv(ATTENTION_ENV, "torch_native")
    whole, per_request = [], []

    def recording(calls, real):
        def attention(query, key, *args, **kwargs):
            calls.append((query.shape[0], key.shape[0]))
            return real(query, key, *args, **kwargs)

        return attention

    monkeypatch.setattr(
        attention_layer,
        "dense_causal_attention",
        recording(whole, attention_layer.dense_causal_attention),
    )
    monkeypatch.setattr(
        torch_native,
        "dense_causal_attention",
        recording(per_request, torch_native.dense_causal_attention),
    )
    with LLM(
        model_dirs("llama"),
        EAGER,
        device="cpu",
        max_num_seqs=16,
        max_model_len=256,
        max_num_batched_tokens=512,
    ) as llm:
        assert llm.runner.max_num_tokens == 512
        assert whole == []
        layers = len(llm.runner.layers)
        # On a CPU the first forward is CPU_TRACE_TOKENS (256: 16 requests of 16), or a few
        # tokens when a saved program was found; on CUDA all 512 (16 requests of 32).
        n = llm.runner.startup.first_forward_tokens
        assert n <= 512 and whole == []
        assert per_request == [(int(q), int(q)) for q in profile_query_lens(n, 16)] * layers
        assert all(layer.kv_cache.shape[1] == llm.runner.num_blocks for layer in llm.runner.layers)
        out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_tiny_model_takes_only_the_blocks_it_can_use(model_dirs):
    with LLM(
        model_dirs("llama"),
        EAGER,
        device="cpu",
        max_num_seqs=4,
        max_model_len=64,
        block_size=16,
        kv_cache_bytes=8 * GiB,  # far more than 4 requests of 64 tokens need
    ) as llm:
        assert llm.runner.num_blocks == most_blocks_needed(4, 64, 16) == 17
        assert llm.core.scheduler.block_pool.num_usable == 16
        out = llm.generate([[1, 2, 3]] * 4, GREEDY, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_shutdown_gives_back_the_kv_cache_and_refuses_more_work(model_dirs):
    llm = LLM(model_dirs("llama"), EAGER, device="cpu", max_model_len=64)
    first = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    llm.shutdown()  # twice is fine
    assert all(layer.kv_cache is None for layer in llm.runner.layers)
    with pytest.raises((ExecutorError, RuntimeError), match="shut down"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    # A second engine in the same process starts and gives the same tokens.
    with LLM(model_dirs("llama"), EAGER, device="cpu", max_model_len=64) as second:
        assert second.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first


def test_block_pool_of_millions_costs_bytes_per_block_not_objects():
    n = 15_000_000
    tracemalloc.start()
    try:
        pool = BlockPool(n)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # numpy: 4 bytes (id in the free ring) + 4 (reference count) per block; a Python list of
    # ints is ~36 per block. Only blocks holding a cached prefix cost Python objects.
    assert peak < 9 * n
    assert pool.num_free == n - 1
    blocks = pool.allocate(3)
    assert blocks == [1, 2, 3]
    pool.free(blocks)
    assert pool.num_free == n - 1


def test_block_pool_reuses_first_freed_first_across_the_ring_end():
    pool = BlockPool(5)  # blocks 1..4
    assert pool.allocate(3) == [1, 2, 3]
    pool.free([2])
    assert pool.allocate(2) == [4, 2]  # 4 was free before 2 was freed
    pool.free([3, 1])
    assert pool.allocate(2) == [3, 1]  # the ring wrapped around its end
    assert pool.num_free == 0
    pool.free([1])
    with pytest.raises(ValueError, match="double free"):
        pool.free([2, 1])
    assert pool.num_free == 1  # the failed call freed nothing, block 2 included
    with pytest.raises(ValueError, match="not an allocatable block"):
        pool.free([0])
    with pytest.raises(ValueError, match="appears twice"):
        pool.free([2, 2])
    assert pool.allocate(1) == [1]


@pytest.fixture(scope="module")
def runner(model_dirs):
    with LLM(
        model_dirs("llama"),
        EAGER,
        device="cpu",
        max_num_seqs=4,
        max_model_len=32,
        max_num_batched_tokens=256,
    ) as llm:
        yield llm.runner


def runner_capture_inputs(runner, descriptor, mode):
    return capture_inputs(
        descriptor,
        mode,
        buffers=runner.buffers,
        block_table=runner.input_batch.block_table,
        groups=runner.metadata_groups,
        config=runner.config,
    )


def test_piecewise_capture_runs_attention_without_metadata(runner):
    """A PIECEWISE graph does not hold attention: no graph metadata is built (FlashInfer would
    refuse it for a batch that is not a uniform decode)."""
    inputs = runner_capture_inputs(runner, BatchDescriptor(96), CUDAGraphMode.PIECEWISE)
    assert inputs.attn_metadata is None
    assert inputs.args[0].shape[0] == 96


def test_full_capture_splits_tokens_past_max_model_len_over_requests(runner):
    inputs = runner_capture_inputs(runner, BatchDescriptor(96), CUDAGraphMode.FULL)
    metadata = inputs.attn_metadata
    query_lens = metadata.query_lens_cpu
    assert int(query_lens.sum()) == 96
    assert int(query_lens.max()) <= 32  # max_model_len
    assert len(query_lens) == 3
    decode = runner_capture_inputs(
        runner, BatchDescriptor(4, num_reqs=4, uniform=True), CUDAGraphMode.FULL
    ).attn_metadata
    assert decode.query_lens_cpu.tolist() == [1, 1, 1, 1]


def test_step_size_never_exceeds_what_the_requests_can_hold(runner):
    assert runner.max_num_tokens == 4 * 32  # max_num_seqs * max_model_len, not the 256 asked


def test_default_device_follows_the_pin_then_cuda_availability(monkeypatch):
    from compile_runtime import device as device_module

    monkeypatch.setattr(device_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(device_module.DEVICE_ENV, "cpu")
    assert device_module.default_device() == "cpu"  # pinned, even with CUDA present
    monkeypatch.delenv(device_module.DEVICE_ENV)
    assert device_module.default_device() == "cuda"
    monkeypatch.setenv(device_module.DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match="COMPILE_RUNTIME_DEVICE='tpu' is not a device"):
        device_module.default_device()


def test_engine_device_is_explicit_after_start(model_dirs):
    with LLM(model_dirs("llama"), EAGER, max_model_len=64) as llm:  # no device named
        assert llm.executor.config.device == "cpu"  # the suite's pin, written into the config
        assert llm.runner.device.type == "cpu"


# ---- host-to-device staging of the step's inputs ----------------------------------------


def fake_step(n: int) -> StepInputs:
    return StepInputs(
        req_ids=["a"],
        rows=np.array([0]),
        num_scheduled=np.array([n]),
        num_computed=np.array([0]),
        cu_num_scheduled=np.array([n]),
        token_ids=np.arange(100, 100 + n),
        positions=np.arange(n),
        slot_mapping=torch.arange(16, 16 + n),
        total=n,
        seq_lens=np.array([n]),
        block_table=torch.zeros((1, 1), dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
    )


def test_staging_is_pinned_for_cuda_only():
    assert pins_staging(torch.device("cuda")) and pins_staging("cuda:1")
    assert not pins_staging("cpu") and not pins_staging(torch.device("meta"))
    buffer = staging_buffer((2, 8), torch.int32, "cpu")
    assert buffer.shape == (2, 8) and buffer.dtype == torch.int32 and not buffer.is_pinned()


def test_cpu_step_buffers_are_their_own_staging():
    """On a CPU nothing is pinned and load writes the step buffers themselves (one copy);
    padded tokens are id 0 at position 0."""
    buffers = StepBuffers(16, torch.device("cpu"))
    own = (buffers.input_ids, buffers.positions, buffers.slot_mapping)
    assert all(host is buffer for host, buffer in zip(buffers.staging, own, strict=True))
    assert not any(t.is_pinned() for t in buffers.staging)
    buffers.input_ids.fill_(9)
    buffers.load(fake_step(5), num_padded=8)
    ids, positions = buffers.forward_args(8)
    assert ids.tolist() == [100, 101, 102, 103, 104, 0, 0, 0]
    assert positions.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert buffers.slot_mapping[:5].tolist() == [16, 17, 18, 19, 20]


@pytest.mark.cuda
def test_cuda_step_buffers_copy_from_pinned_staging():
    buffers = StepBuffers(16, torch.device("cuda"))
    assert all(host.is_pinned() and host.device.type == "cpu" for host in buffers.staging)
    assert staging_buffer(4, torch.long, "cuda").is_pinned()
    for n in (5, 3):  # the second step rewrites the staging after the first's copies
        buffers.load(fake_step(n), num_padded=8)
        ids, positions = buffers.forward_args(8)
        assert ids.is_cuda
        assert ids.tolist() == [*range(100, 100 + n)] + [0] * (8 - n)
        assert positions.tolist() == [*range(n)] + [0] * (8 - n)
        assert buffers.slot_mapping[:n].tolist() == [*range(16, 16 + n)]
