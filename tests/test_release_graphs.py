"""``LLM.shutdown`` gives back every graph: the FULL ones and the piecewise ones (one
wrapper per compiled piece), and with them the CPU graph pool's memory."""

from __future__ import annotations

import gc

import pytest

import compile_runtime as cr
from compile_runtime.compiler.decorator import compiled_model
from compile_runtime.cpu.graph import CPU_GRAPHS, cpu_graphs_available
from compile_runtime.graphs.wrapper import CUDAGraphWrapper

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_graphs_available(), reason="needs a C compiler"),
]


def graph_wrappers(llm: cr.LLM) -> tuple[list[CUDAGraphWrapper], list[CUDAGraphWrapper]]:
    """(the FULL graphs' wrappers, the pieces' wrappers) of the engine's model."""
    runner = llm.executor.driver_runner
    pieces = []
    for module in runner.model.modules():
        compiled = compiled_model(module)
        if compiled is not None:
            values = compiled.split_gm.__dict__.values()
            pieces += [v for v in values if isinstance(v, CUDAGraphWrapper)]
    return runner.cudagraph_plan.wrappers(), pieces


def test_shutdown_frees_full_and_piecewise_graphs(model_dirs):
    gc.collect()
    before = CPU_GRAPHS.pool().nbytes
    llm = cr.LLM(
        model_dirs("llama"),
        {"backend": "inductor", "compile_sizes": [], "cudagraph_mode": "FULL_AND_PIECEWISE"},
        dtype="float32",
        quantization="none",
        max_num_seqs=4,
        max_model_len=128,
        kv_cache_bytes=16 * 2**20,
    )
    params = cr.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for _ in range(2):  # graphs are captured at a size's second step (on first use)
        llm.generate([[5, 6, 7, 8, 9], [11, 12, 13]], params, use_tqdm=False)
    full, pieces = graph_wrappers(llm)
    assert full and pieces, "FULL_AND_PIECEWISE on a CPU: FULL decode graphs and pieces"
    assert any(w.entries for w in full) and any(w.entries for w in pieces)
    held = CPU_GRAPHS.pool().nbytes
    assert held > before
    llm.shutdown()
    assert not any(w.entries for w in full + pieces)
    gc.collect()
    assert CPU_GRAPHS.pool().nbytes < held
    assert CPU_GRAPHS.pool().nbytes <= before
