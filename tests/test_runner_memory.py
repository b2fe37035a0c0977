"""What a runner takes and gives back: KV sizing, the block pool's footprint, shutdown,
and the inputs of start-up capture (attention metadata only for FULL graphs)."""

from __future__ import annotations

import tracemalloc

import pytest

from compile_runtime.config import CUDAGraphMode
from compile_runtime.cudagraph.dispatcher import BatchDescriptor
from compile_runtime.engine.llm import LLM
from compile_runtime.executor.base import ExecutorError
from compile_runtime.runner.block_pool import BlockPool
from compile_runtime.runner.kv_sizing import (
    CudaMemory,
    cuda_kv_budget,
    most_blocks_needed,
)
from compile_runtime.runner.sampling_params import SamplingParams

EAGER = {"backend": "eager"}
GiB = 2**30
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_most_blocks_needed_rounds_each_request_up_and_adds_the_null_block():
    assert most_blocks_needed(max_num_seqs=4, max_model_len=100, block_size=16) == 4 * 7 + 1
    assert most_blocks_needed(max_num_seqs=1, max_model_len=16, block_size=16) == 2


def test_cuda_budget_is_this_engines_share_within_what_is_free():
    # 100 GiB device, 0.5 share: 50 - 2 (own peak) - 1 (graph pool estimate) = 47 GiB.
    memory = CudaMemory(total=100 * GiB, free=90 * GiB, own_peak=2 * GiB, activations=1 * GiB)
    assert cuda_kv_budget(memory, 0.5) == 47 * GiB
    # Another engine holds most of the device: only what is free (less the graph pool).
    crowded = CudaMemory(total=100 * GiB, free=10 * GiB, own_peak=2 * GiB, activations=1 * GiB)
    assert cuda_kv_budget(crowded, 0.9) == 9 * GiB
    # Nothing left is 0, not a negative budget.
    full = CudaMemory(total=100 * GiB, free=0, own_peak=2 * GiB, activations=1 * GiB)
    assert cuda_kv_budget(full, 0.9) == 0


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
        assert llm.scheduler.block_pool.num_usable == 16
        out = llm.generate([[1, 2, 3]] * 4, GREEDY, progress=False)
        assert all(len(o.token_ids) == 4 for o in out)


def test_shutdown_gives_back_the_kv_cache_and_refuses_more_work(model_dirs):
    llm = LLM(model_dirs("llama"), EAGER, device="cpu", max_model_len=64)
    first = llm.generate([[1, 2, 3]], GREEDY, progress=False)[0].token_ids
    llm.shutdown()
    llm.shutdown()  # twice is fine
    assert all(layer.kv_cache is None for layer in llm.runner.layers)
    with pytest.raises((ExecutorError, RuntimeError), match="shut down"):
        llm.generate([[1, 2, 3]], GREEDY, progress=False)
    # A second engine in the same process starts and gives the same tokens.
    with LLM(model_dirs("llama"), EAGER, device="cpu", max_model_len=64) as second:
        assert second.generate([[1, 2, 3]], GREEDY, progress=False)[0].token_ids == first


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


def test_piecewise_capture_runs_attention_without_metadata(runner):
    """A PIECEWISE graph does not hold attention: no graph metadata is built (FlashInfer would
    refuse it for a batch that is not a uniform decode)."""
    inputs = runner._capture_inputs(BatchDescriptor(96), CUDAGraphMode.PIECEWISE)
    assert inputs.attn_metadata is None
    assert inputs.args[0].shape[0] == 96


def test_full_capture_splits_tokens_past_max_model_len_over_requests(runner):
    inputs = runner._capture_inputs(BatchDescriptor(96), CUDAGraphMode.FULL)
    metadata = inputs.attn_metadata
    query_lens = metadata.query_lens_cpu
    assert int(query_lens.sum()) == 96
    assert int(query_lens.max()) <= 32  # max_model_len
    assert len(query_lens) == 3
    decode = runner._capture_inputs(
        BatchDescriptor(4, num_reqs=4, uniform=True), CUDAGraphMode.FULL
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
