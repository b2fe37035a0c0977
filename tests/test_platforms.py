"""The platform decides what differs by device; code asks it instead of testing the device."""

from __future__ import annotations

import pytest
import torch

from compile_runtime.attention.selector import get_attn_backend
from compile_runtime.distributed.parallel_state import default_backend
from compile_runtime.platforms.cpu import CPU
from compile_runtime.platforms.cuda import CUDA
from compile_runtime.platforms.select import platform_for
from compile_runtime.worker.step_inputs import StepBuffers


def test_each_device_has_its_platform():
    assert platform_for("cpu") is CPU
    assert platform_for(torch.device("cpu")) is CPU
    assert platform_for("cuda:1") is CUDA  # no CUDA needed to name its platform
    assert platform_for("meta").attention_backends == ("torch_native",)  # shapes, no data
    with pytest.raises(ValueError, match="no platform for device 'xpu'.*'cpu' or 'cuda"):
        platform_for("xpu")


def test_the_platforms_differ_where_the_devices_do():
    assert (CPU.distributed_backend, CUDA.distributed_backend) == ("gloo", "nccl")
    assert (CPU.graph_kind, CUDA.graph_kind) == ("cpu", "cuda")
    assert not CPU.stages_inputs and not CPU.pins_staging and CUDA.pins_staging
    assert CPU.sets_threads and CPU.packs_weights and not CUDA.packs_weights
    assert CUDA.profiles_memory and not CPU.profiles_memory
    assert CPU.zeroes_lazily and CPU.serves_from_worker and CPU.builds_kernels_ahead
    assert CUDA.prefers_16bit and not CPU.prefers_16bit
    assert CPU.memory_allocated(torch.device("cpu")) == 0
    assert CPU.step_event() is None
    assert CPU.identity(torch.device("cpu")).startswith("cpu:")
    assert CPU.missing_device(torch.device("cpu"), ranks=4) is None  # ranks share the CPU
    assert CPU.rank_device("cpu", 3) == "cpu"
    assert CUDA.rank_device("cuda", 3) == "cuda:3" and CUDA.rank_device("cuda:1", 3) == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_missing_gpu_is_named_with_the_build():
    why = CUDA.missing_device(torch.device("cuda"))
    assert why is not None and "CUDA is not available here" in why and torch.__version__ in why
    assert CUDA.device_count() == 0 and not CUDA.available()


def test_code_reads_the_platform():
    assert default_backend("cpu") == CPU.distributed_backend
    assert (
        get_attn_backend(device="cpu", dtype=torch.float32, head_size=64).name
        == (CPU.attention_backends[0])
    )
    buffers = StepBuffers(8, torch.device("cpu"))
    assert buffers.staging[0] is buffers.input_ids  # no staging copy on a CPU
