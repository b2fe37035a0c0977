"""CUDAGraphWrapper and start-up capture on CPU, with a recording double for the graph."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._pytree import tree_leaves

import compile_runtime as cr
from compile_runtime.compiler.decorator import compiled_model, set_graph_factory
from compile_runtime.graphs.capture import CaptureInputs, capture
from compile_runtime.graphs.wrapper import (
    CUDAGraphAddressError,
    CUDAGraphCaptureError,
    CUDAGraphWrapper,
    cudagraph_capturing_enabled,
    is_cudagraph_capturing_enabled,
    piecewise_cudagraphs_enabled,
    weak_ref_tensor,
    wrap_full_model,
)
from testing.toy import build

M = cr.CUDAGraphMode
BD = cr.BatchDescriptor
counter = cr.compilation_counter
REAL_GC_COLLECT = gc.collect
REAL_EMPTY_CACHE = torch.cuda.empty_cache


class RecordingGraph:
    def __init__(self, factory: RecordingFactory):
        self.factory = factory
        self.replays = 0

    def capture(self, fn, pool):
        assert pool is self.factory.the_pool
        self.factory.events.append("capture")
        self.factory.gc_suppressed.append(
            gc.collect is not REAL_GC_COLLECT and torch.cuda.empty_cache is not REAL_EMPTY_CACHE
        )
        outputs = fn()
        if self.factory.pool_keeps_outputs:
            # A real pool keeps captured memory allocated; this list stands in for it.
            self.factory.pool_memory.append(outputs)
        return outputs

    def replay(self):
        self.factory.events.append("replay")
        self.replays += 1


class RecordingFactory:
    """Records captures and replays; a replay runs nothing."""

    def __init__(self, pool_keeps_outputs: bool = True):
        self.the_pool = object()
        self.pool_keeps_outputs = pool_keeps_outputs
        self.pool_memory: list = []
        self.graphs: list[RecordingGraph] = []
        self.events: list[str] = []
        self.gc_suppressed: list[bool] = []

    def new_graph(self) -> RecordingGraph:
        self.graphs.append(RecordingGraph(self))
        return self.graphs[-1]

    def pool(self):
        return self.the_pool


class Counting:
    """A runnable that counts its calls and returns a fresh tensor."""

    def __init__(self, scale: float = 2.0):
        self.calls = 0
        self.scale = scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.scale


@pytest.fixture
def factory():
    return RecordingFactory()


def step(mode, desc):
    return cr.set_forward_context(None, cudagraph_runtime_mode=mode, batch_descriptor=desc)


def test_capture_once_then_replay_without_calling_the_runnable(factory):
    fn = Counting()
    wrapper = CUDAGraphWrapper(fn, M.PIECEWISE, num_warmups=2, graph_factory=factory)
    x = torch.ones(4)
    with counter.expect(num_cudagraph_captured=1), cudagraph_capturing_enabled():
        with step(M.PIECEWISE, BD(4)):
            first = wrapper(x)
    # Two warm-up runs, then the captured run; capture is followed by one replay.
    assert fn.calls == 3 and factory.events == ["capture", "replay"]
    assert torch.equal(first, x * 2)
    with counter.expect(num_cudagraph_captured=0), step(M.PIECEWISE, BD(4)):
        again = wrapper(x)
    assert fn.calls == 3 and factory.events[-1] == "replay" and wrapper.num_replays == 1
    assert again is first  # the captured output buffer, refreshed by the replay


def test_each_descriptor_gets_its_own_graph(factory):
    wrapper = CUDAGraphWrapper(Counting(), M.FULL, num_warmups=0, graph_factory=factory)
    with cudagraph_capturing_enabled(), counter.expect(num_cudagraph_captured=2):
        for desc in [BD(4), BD(4, 4, uniform=True), BD(4)]:
            with step(M.FULL, desc):
                wrapper(torch.ones(4))
    assert len(wrapper.entries) == 2 and len(factory.graphs) == 2
    assert factory.graphs[0].replays == 2  # after its capture, then the third call


@pytest.mark.parametrize("mode", [M.NONE, M.FULL])
def test_other_modes_call_through(factory, mode):
    fn = Counting()
    wrapper = CUDAGraphWrapper(fn, M.PIECEWISE, graph_factory=factory)
    with cudagraph_capturing_enabled(), counter.expect(num_cudagraph_captured=0):
        with step(mode, BD(4)):
            wrapper(torch.ones(4))
        wrapper(torch.ones(4))  # no forward context at all
    assert fn.calls == 2 and factory.events == []


def test_capture_outside_start_up_raises_naming_the_descriptor(factory):
    fn = Counting()
    wrapper = CUDAGraphWrapper(fn, M.PIECEWISE, graph_factory=factory)
    assert not is_cudagraph_capturing_enabled()
    with pytest.raises(CUDAGraphCaptureError, match=r"BatchDescriptor\(num_tokens=3"):
        with step(M.PIECEWISE, BD(3)):
            wrapper(torch.ones(3))
    assert fn.calls == 0 and factory.events == []


def test_same_mode_without_descriptor_is_an_error(factory):
    wrapper = CUDAGraphWrapper(Counting(), M.FULL, graph_factory=factory)
    with cudagraph_capturing_enabled(), pytest.raises(CUDAGraphCaptureError, match="no batch"):
        with step(M.FULL, None):
            wrapper(torch.ones(3))


def test_runtime_mode_must_be_a_graph_mode():
    with pytest.raises(ValueError, match="PIECEWISE or FULL"):
        CUDAGraphWrapper(Counting(), M.NONE)


class TwoPieces:
    """A stand-in for a split graph: two PIECEWISE-wrapped pieces and eager work between."""

    def __init__(self, factory):
        self.first, self.second = Counting(2.0), Counting(3.0)
        self.piece0 = CUDAGraphWrapper(
            self.first, M.PIECEWISE, num_warmups=0, is_last_piece=False, graph_factory=factory
        )
        self.piece1 = CUDAGraphWrapper(
            self.second, M.PIECEWISE, num_warmups=0, is_first_piece=False, graph_factory=factory
        )
        self.entered = 0

    def __call__(self, x):
        self.entered += 1
        return self.piece1(self.piece0(x) + 1)


def test_full_over_piecewise(factory):
    model = TwoPieces(factory)
    full = CUDAGraphWrapper(model, M.FULL, num_warmups=1, graph_factory=factory)
    x = torch.ones(4)
    with cudagraph_capturing_enabled():
        with counter.expect(num_cudagraph_captured=2), step(M.PIECEWISE, BD(4)):
            out_pw = full(x)  # FULL calls through; each piece captures
        with counter.expect(num_cudagraph_captured=1), step(M.FULL, BD(4, 4, True)):
            out_full = full(x)  # pieces call through inside the FULL capture
    assert torch.equal(out_pw, (x * 2 + 1) * 3) and torch.equal(out_full, out_pw)
    assert len(model.piece0.entries) == len(model.piece1.entries) == 1
    calls = (model.entered, model.first.calls, model.second.calls)
    with counter.expect(num_cudagraph_captured=0), step(M.FULL, BD(4, 4, True)):
        full(x)
    assert (model.entered, model.first.calls, model.second.calls) == calls
    assert full.num_replays == 1 and model.piece0.num_replays == 0
    with step(M.PIECEWISE, BD(4)):
        full(x)
    assert model.entered == calls[0] + 1  # the split graph runs, its pieces replay
    assert (model.first.calls, model.second.calls) == calls[1:]
    assert model.piece0.num_replays == model.piece1.num_replays == 1


def test_only_the_first_piece_pays_for_gc_and_empty_cache(factory):
    model = TwoPieces(factory)
    with cudagraph_capturing_enabled(), step(M.PIECEWISE, BD(4)):
        model(torch.ones(4))
    assert factory.gc_suppressed == [False, True]
    assert gc.collect is REAL_GC_COLLECT and torch.cuda.empty_cache is REAL_EMPTY_CACHE


def test_outputs_of_all_but_the_last_piece_are_weak():
    factory = RecordingFactory(pool_keeps_outputs=False)
    middle = CUDAGraphWrapper(
        Counting(), M.PIECEWISE, num_warmups=0, is_last_piece=False, graph_factory=factory
    )
    last = CUDAGraphWrapper(Counting(), M.PIECEWISE, num_warmups=0, graph_factory=factory)
    refs = []
    with cudagraph_capturing_enabled(), step(M.PIECEWISE, BD(4)):
        for wrapper in (middle, last):
            out = wrapper(torch.ones(4))
            refs.append((weakref.ref(out), out.data_ptr()))
            del out
    (middle_ref, middle_ptr), (last_ref, last_ptr) = refs
    assert middle_ref() is None  # the wrapper does not keep it alive...
    assert middle.entries[BD(4)].outputs.data_ptr() == middle_ptr  # ...but still views it
    assert last_ref() is last.entries[BD(4)].outputs
    assert last.entries[BD(4)].outputs.data_ptr() == last_ptr


def test_weak_ref_tensor_views_the_same_memory():
    base = torch.arange(12.0)
    view = base[2:].view(2, 5)[:, 1:]
    alias = weak_ref_tensor(view)
    assert alias.data_ptr() == view.data_ptr() and torch.equal(alias, view)
    assert alias.stride() == view.stride()
    base.add_(1)
    assert torch.equal(alias, view)


def test_debug_mode_checks_input_addresses(factory):
    wrapper = CUDAGraphWrapper(
        Counting(), M.PIECEWISE, num_warmups=0, debug=True, graph_factory=factory
    )
    buffer = torch.ones(8)
    with cudagraph_capturing_enabled(), step(M.PIECEWISE, BD(4)):
        wrapper(buffer[:4])
    with step(M.PIECEWISE, BD(4)):
        wrapper(buffer[:4])  # same address: fine
        with pytest.raises(CUDAGraphAddressError, match="input 'x'"):
            wrapper(torch.ones(4))


def test_debug_mode_names_positional_arguments_it_cannot_name(factory):
    wrapper = CUDAGraphWrapper(
        lambda *args: args[0] + 1, M.FULL, num_warmups=0, debug=True, graph_factory=factory
    )
    buffer = torch.ones(8)
    with cudagraph_capturing_enabled(), step(M.FULL, BD(4)):
        wrapper(buffer[:4], buffer[4:])
    with step(M.FULL, BD(4)), pytest.raises(CUDAGraphAddressError, match="'argument 1'"):
        wrapper(buffer[:4], torch.ones(4))


def test_without_debug_addresses_are_trusted(factory):
    wrapper = CUDAGraphWrapper(
        Counting(), M.PIECEWISE, num_warmups=0, debug=False, graph_factory=factory
    )
    with cudagraph_capturing_enabled(), step(M.PIECEWISE, BD(4)):
        wrapper(torch.ones(4))
    with step(M.PIECEWISE, BD(4)):
        wrapper(torch.ones(4))
    assert wrapper.num_replays == 1


def test_wrapper_shows_the_model_attributes(factory):
    model = torch.nn.Linear(2, 2)
    full = wrap_full_model(model, cr.CompilationConfig(cudagraph_num_warmups=3))
    assert full.weight is model.weight and full.num_warmups == 3
    assert full.runtime_mode == M.FULL


# ---- the compiler's pieces, wrapped and captured at start-up ----------------

SIZES = [1, 2, 4]


def piecewise_config(**kw) -> cr.CompilationConfig:
    return cr.CompilationConfig(
        backend="eager", cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=SIZES, **kw
    )


def make_dispatcher(config, mode):
    d = cr.CudagraphDispatcher(config)
    d.initialize_keys(mode)
    return d


def build_with(factory, config, **kwargs):
    """A toy model whose piecewise graphs are the factory's (a CPU stand-in for CUDA)."""
    model = build(config, **kwargs)
    set_graph_factory(model, factory)
    return model


def pieces_of(model):
    split_gm = compiled_model(model).split_gm
    return [v for v in split_gm.__dict__.values() if isinstance(v, CUDAGraphWrapper)]


def test_backend_wraps_pieces_only_where_graphs_can_run():
    """Without CUDA (and no stand-in factory) pieces stay plain; with CUDA each static piece is
    wrapped (the wrappers only act when the forward context says PIECEWISE)."""
    cuda = torch.cuda.is_available()
    config = piecewise_config()
    assert piecewise_cudagraphs_enabled(config) is cuda
    model = build(config, num_layers=3)
    model(torch.arange(3))
    assert len(pieces_of(model)) == (3 + 1 if cuda else 0)


@pytest.mark.parametrize("num_layers", [1, 3])
def test_piecewise_start_up_capture_and_replay(factory, num_layers):
    config = piecewise_config()
    ref = build(cr.CompilationConfig(mode="NONE"), num_layers=num_layers)
    model = build_with(factory, config, num_layers=num_layers)
    buffer = torch.zeros(max(SIZES), dtype=torch.long)  # persistent input buffer
    dispatcher = make_dispatcher(config, M.PIECEWISE)
    with counter.expect(num_cudagraph_captured=(num_layers + 1) * len(SIZES)):
        report = capture(
            model, lambda d, _mode: (buffer[: d.num_tokens],), dispatcher, progress=False
        )
    pieces = pieces_of(model)
    assert len(pieces) == num_layers + 1
    assert [(p.is_first_piece, p.is_last_piece) for p in pieces] == [
        (i == 0, i == num_layers) for i in range(num_layers + 1)
    ]
    assert all(set(p.entries) == {BD(s) for s in SIZES} for p in pieces)
    assert report.num_graphs == {"PIECEWISE": (num_layers + 1) * len(SIZES)}
    assert report.num_descriptors == {"PIECEWISE": len(SIZES)} and report.memory_bytes is None

    # Serving: the recording double replays the capture-time outputs, so feed
    # the same values the capture saw (zeros) and check nothing runs eagerly.
    with counter.expect(num_cudagraph_captured=0):
        for n in [1, 2, 3, 4]:
            mode, desc = dispatcher.dispatch(n)
            assert mode == M.PIECEWISE
            with cr.set_forward_context(None, cudagraph_runtime_mode=mode, batch_descriptor=desc):
                out = model(buffer[: desc.num_tokens])
            assert torch.equal(out, ref(torch.zeros(desc.num_tokens, dtype=torch.long)))
    assert [p.num_replays for p in pieces] == [4] * (num_layers + 1)
    # Beyond the largest size the pieces run their compiled code.
    mode, desc = dispatcher.dispatch(7)
    assert mode == M.NONE
    ids = torch.arange(7)
    with cr.set_forward_context(None, cudagraph_runtime_mode=mode, batch_descriptor=desc):
        assert torch.equal(model(ids), ref(ids))


def test_piecewise_capture_accepts_capture_inputs(factory):
    config = piecewise_config()
    model = build_with(factory, config, num_layers=1)
    buffer = torch.zeros(4, dtype=torch.long)
    seen = []

    def make_inputs(desc, _mode):
        seen.append(desc)
        return CaptureInputs(kwargs={"input_ids": buffer[: desc.num_tokens]}, attn_metadata="m")

    capture(model, make_inputs, make_dispatcher(config, M.PIECEWISE), progress=False)
    # The compile/warm-up run at the largest size, then every size largest first.
    assert seen == [BD(4), BD(4), BD(2), BD(1)]


def test_full_and_piecewise_capture(factory):
    config = piecewise_config().model_copy(update={"cudagraph_mode": M.FULL_AND_PIECEWISE})
    model = build_with(factory, config, num_layers=2)
    full = wrap_full_model(model, config, factory)
    buffer = torch.zeros(4, dtype=torch.long)
    dispatcher = make_dispatcher(config, M.FULL_AND_PIECEWISE)
    with counter.expect(num_cudagraph_captured=3 * len(SIZES) + len(SIZES)):
        report = capture(
            full, lambda d, _mode: (buffer[: d.num_tokens],), dispatcher, progress=False
        )
    assert report.num_graphs == {"PIECEWISE": 3 * len(SIZES), "FULL": len(SIZES)}
    pieces = pieces_of(model)
    with cr.set_forward_context(
        None, cudagraph_runtime_mode=M.FULL, batch_descriptor=BD(2, 2, True)
    ):
        full(buffer[:2])
    assert full.num_replays == 1 and all(p.num_replays == 0 for p in pieces)
    mode, desc = dispatcher.dispatch(3)
    with cr.set_forward_context(None, cudagraph_runtime_mode=mode, batch_descriptor=desc):
        full(buffer[:4])
    assert full.num_replays == 1 and all(p.num_replays == 1 for p in pieces)


def test_capture_without_a_full_wrapper_is_an_error(factory):
    config = piecewise_config().model_copy(update={"cudagraph_mode": M.FULL})
    model = build_with(factory, config, num_layers=1)
    buffer = torch.zeros(4, dtype=torch.long)
    frozen = gc.get_freeze_count()
    with pytest.raises(CUDAGraphCaptureError, match="wrap_full_model"):
        capture(model, lambda d, _mode: (buffer[: d.num_tokens],), make_dispatcher(config, M.FULL))
    assert not is_cudagraph_capturing_enabled() and gc.get_freeze_count() == frozen


def test_nothing_to_capture(factory):
    model = build_with(factory, piecewise_config(), num_layers=1)
    dispatcher = make_dispatcher(piecewise_config(), M.NONE)
    with counter.expect(num_cudagraph_captured=0):
        report = capture(
            model, lambda d, _mode: (torch.zeros(d.num_tokens, dtype=torch.long),), dispatcher
        )
    assert report.num_graphs == {} and "none" in report.summary()


class RecomputingGraph:
    """Stands in for a real graph: replay recomputes into the captured output tensors."""

    def capture(self, fn, pool):
        self.fn, self.outputs = fn, fn()
        return self.outputs

    def replay(self):
        for dst, src in zip(tree_leaves(self.outputs), tree_leaves(self.fn()), strict=True):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


class RecomputingFactory:
    def new_graph(self) -> RecomputingGraph:
        return RecomputingGraph()

    def pool(self):
        return None


@torch.no_grad()
def test_served_outputs_equal_eager_with_graph_semantics():
    """New values in the persistent buffer flow through FULL and PIECEWISE replays."""
    factory = RecomputingFactory()
    config = piecewise_config().model_copy(update={"cudagraph_mode": M.FULL_AND_PIECEWISE})
    ref = build(cr.CompilationConfig(mode="NONE"), num_layers=2)
    model = build_with(factory, config, num_layers=2)
    full = wrap_full_model(model, config, factory)
    buffer = torch.zeros(4, dtype=torch.long)
    dispatcher = make_dispatcher(config, M.FULL_AND_PIECEWISE)
    capture(full, lambda d, _mode: (buffer[: d.num_tokens],), dispatcher, progress=False)
    modes = set()
    with counter.expect(num_cudagraph_captured=0):
        for n in [1, 2, 3, 4]:
            for uniform in (True, False):
                mode, desc = dispatcher.dispatch(n, uniform)
                modes.add(mode)
                buffer.copy_(torch.randint(0, 64, (4,)))
                with cr.set_forward_context(
                    None, cudagraph_runtime_mode=mode, batch_descriptor=desc
                ):
                    out = full(buffer[: desc.num_tokens])
                assert torch.equal(out, ref(buffer[: desc.num_tokens])), (n, uniform)
    assert modes == {M.FULL, M.PIECEWISE}
