"""Real CUDA graphs of the toy model: PIECEWISE, FULL, and FULL_AND_PIECEWISE."""

from __future__ import annotations

import pytest
import torch

import compile_runtime as cr
from compile_runtime.compiler.decorator import compiled_model
from compile_runtime.graphs.capture import capture
from compile_runtime.graphs.wrapper import (
    CUDAGraphAddressError,
    CUDAGraphWrapper,
    wrap_full_model,
)
from testing.toy import build

pytestmark = pytest.mark.cuda

M = cr.CUDAGraphMode
BD = cr.BatchDescriptor
counter = cr.compilation_counter
SIZES = [1, 2, 4, 8]
LAYERS = 3


def config(mode: M) -> cr.CompilationConfig:
    return cr.CompilationConfig(backend="eager", cudagraph_mode=mode, cudagraph_capture_sizes=SIZES)


def models(mode: M):
    """(eager reference, compiled model) with the same weights, on the GPU."""
    ref = build(cr.CompilationConfig(mode="NONE"), num_layers=LAYERS).cuda()
    model = build(config(mode), num_layers=LAYERS).cuda()
    return ref, model


def dispatcher_for(mode: M) -> cr.CudagraphDispatcher:
    d = cr.CudagraphDispatcher(config(mode))
    d.initialize_keys(mode)
    return d


def piece_wrappers(model) -> list[CUDAGraphWrapper]:
    split_gm = compiled_model(model).split_gm
    return [v for v in split_gm.__dict__.values() if isinstance(v, CUDAGraphWrapper)]


def serve(model, ref, dispatcher, buffer, n: int, uniform_decode: bool = False):
    """One step as the runner does it: dispatch, copy into the persistent buffer, run."""
    mode, desc = dispatcher.dispatch(n, uniform_decode)
    ids = torch.randint(0, 64, (n,), device="cuda")
    buffer[:n].copy_(ids)
    buffer[n : desc.num_tokens].zero_()  # padding tokens
    with cr.set_forward_context(None, cudagraph_runtime_mode=mode, batch_descriptor=desc):
        out = model(buffer[: desc.num_tokens])
    # The toy model is per token, so the padded rows do not change the real ones.
    torch.testing.assert_close(out[:n], ref(ids), rtol=1e-5, atol=1e-5)
    return mode, desc


@torch.no_grad()
def test_piecewise_graphs_one_per_piece_per_size():
    ref, model = models(M.PIECEWISE)
    dispatcher = dispatcher_for(M.PIECEWISE)
    buffer = torch.zeros(max(SIZES), dtype=torch.long, device="cuda")
    with counter.expect(num_cudagraph_captured=(LAYERS + 1) * len(SIZES)):
        report = capture(
            model, lambda d, _mode: (buffer[: d.num_tokens],), dispatcher, progress=False
        )
    assert report.num_graphs == {"PIECEWISE": (LAYERS + 1) * len(SIZES)}
    assert report.memory_bytes is not None
    pieces = piece_wrappers(model)
    assert len(pieces) == LAYERS + 1
    with counter.expect(num_cudagraph_captured=0):
        for n in range(1, max(SIZES) + 1):
            assert serve(model, ref, dispatcher, buffer, n)[0] == M.PIECEWISE
    assert all(p.num_replays == max(SIZES) for p in pieces)
    big = torch.zeros(20, dtype=torch.long, device="cuda")
    assert serve(model, ref, dispatcher, big, 20)[0] == M.NONE


@torch.no_grad()
def test_full_graphs_of_the_whole_model():
    ref, model = models(M.FULL)
    full = wrap_full_model(model, config(M.FULL))
    dispatcher = dispatcher_for(M.FULL)
    buffer = torch.zeros(max(SIZES), dtype=torch.long, device="cuda")
    with counter.expect(num_cudagraph_captured=len(SIZES)):
        capture(full, lambda d, _mode: (buffer[: d.num_tokens],), dispatcher, progress=False)
    # FULL wraps the pieces too (it becomes FULL_AND_PIECEWISE against decode-only attention),
    # but the dispatcher never says PIECEWISE here: no piece holds a graph.
    assert all(len(p.entries) == 0 for p in piece_wrappers(model))
    with counter.expect(num_cudagraph_captured=0):
        for n in range(1, max(SIZES) + 1):
            assert serve(full, ref, dispatcher, buffer, n)[0] == M.FULL
    assert full.num_replays == max(SIZES)
    assert all(p.num_replays == 0 and not p.entries for p in piece_wrappers(model))


@torch.no_grad()
def test_full_and_piecewise_decode_takes_full_mixed_takes_piecewise():
    ref, model = models(M.FULL_AND_PIECEWISE)
    full = wrap_full_model(model, config(M.FULL_AND_PIECEWISE))
    dispatcher = dispatcher_for(M.FULL_AND_PIECEWISE)
    buffer = torch.zeros(max(SIZES), dtype=torch.long, device="cuda")
    with counter.expect(num_cudagraph_captured=(LAYERS + 1) * len(SIZES) + len(SIZES)):
        report = capture(
            full, lambda d, _mode: (buffer[: d.num_tokens],), dispatcher, progress=False
        )
    assert report.num_descriptors == {"PIECEWISE": len(SIZES), "FULL": len(SIZES)}
    pieces = piece_wrappers(model)

    mode, desc = serve(full, ref, dispatcher, buffer, 3, uniform_decode=True)
    assert (mode, desc) == (M.FULL, BD(4, 4, uniform=True))
    assert full.num_replays == 1 and all(p.num_replays == 0 for p in pieces)

    mode, desc = serve(full, ref, dispatcher, buffer, 3)
    assert (mode, desc) == (M.PIECEWISE, BD(4))
    assert full.num_replays == 1 and all(p.num_replays == 1 for p in pieces)


@torch.no_grad()
def test_debug_mode_catches_a_moved_input():
    _, model = models(M.FULL)
    full = CUDAGraphWrapper(model, M.FULL, debug=True)
    dispatcher = dispatcher_for(M.FULL)
    buffer = torch.zeros(max(SIZES), dtype=torch.long, device="cuda")
    capture(full, lambda d, _mode: (buffer[: d.num_tokens],), dispatcher, progress=False)
    with cr.set_forward_context(None, cudagraph_runtime_mode=M.FULL, batch_descriptor=BD(4)):
        full(buffer[:4])
        with pytest.raises(CUDAGraphAddressError, match="input_ids"):
            full(buffer[:4].clone())
