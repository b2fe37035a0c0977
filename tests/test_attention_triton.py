"""The Triton backend against torch_native, on CPU in Triton's interpreter.

Triton decides whether to interpret when it is first imported, so an ordinary
pytest run (TRITON_INTERPRET unset, and other tests may already have imported
triton) cannot switch it on. ``test_triton_cases_in_interpreter`` therefore
re-runs this module in a subprocess with TRITON_INTERPRET=1; the cases run
there and skip here. ``TRITON_INTERPRET=1 pytest tests/test_attention_triton.py``
runs them directly.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from compile_runtime.backends.attention.triton_attn import interpreter_enabled

pytest.importorskip("hypothesis")
from hypothesis import given, settings
from test_attention import batch_shapes, dense_reference, run_backend, spec_of
from triton_interpreter import run_interpreted

from compile_runtime.attention.spec import AttentionSpec
from testing.attention import make_paged_batch

needs_interpreter = pytest.mark.skipif(
    not interpreter_enabled(), reason="runs in the TRITON_INTERPRET=1 subprocess"
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(interpreter_enabled(), reason="already running interpreted")
def test_triton_cases_in_interpreter():
    run_interpreted(__file__, skip_reason="runs in the TRITON_INTERPRET=1 subprocess")


def assert_matches_torch_native(batch, spec, **build_kwargs):
    out, cache = run_backend("triton", batch, spec, **build_kwargs)
    ref, ref_cache = run_backend("torch_native", batch, spec, **build_kwargs)
    n = batch.num_actual_tokens
    assert (out[:n] - ref[:n]).abs().max() < 1e-5
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))  # padded rows: zeros
    assert torch.equal(cache[:, 1:], ref_cache[:, 1:])
    assert torch.equal(cache[:, 1:], batch.expected_cache()[:, 1:])


@needs_interpreter
@settings(max_examples=25, deadline=None)
@given(shape=batch_shapes(max_reqs=4, max_ctx_blocks=2, max_query=20))
def test_triton_matches_torch_native_on_mixed_batches(shape):
    assert_matches_torch_native(make_paged_batch(**shape), spec_of(shape))


@needs_interpreter
@pytest.mark.parametrize("window", [1, 7, 20])
def test_triton_sliding_window(window):
    batch = make_paged_batch(
        [6, 1, 1], [12, 40, 0], num_heads=4, num_kv_heads=2, head_size=64, block_size=16
    )
    assert_matches_torch_native(batch, AttentionSpec(4, 2, 64, 0.125, sliding_window=window))


@needs_interpreter
def test_triton_with_padded_requests_as_in_a_full_graph():
    """Requests and tokens padded the way a FULL graph runs them: same answers."""
    batch = make_paged_batch(
        [1, 5, 1],
        [30, 2, 0],
        num_heads=2,
        num_kv_heads=2,
        head_size=64,
        block_size=32,
        num_padding=5,
    )
    spec = AttentionSpec(2, 2, 64, 0.125)
    assert_matches_torch_native(batch, spec, for_cudagraph=True)  # 12 padded -> 12 requests
    assert_matches_torch_native(batch, spec, num_reqs_padded=8)


@needs_interpreter
@pytest.mark.parametrize("cap, window", [(0.5, None), (2.0, 20)])
def test_triton_logits_soft_cap(cap, window):
    """The kernel's tanh cap on the scaled logits: equal to the written-out math."""
    batch = make_paged_batch(
        [6, 1, 1], [12, 40, 0], num_heads=4, num_kv_heads=2, head_size=64, block_size=16
    )
    spec = AttentionSpec(4, 2, 64, 0.125, sliding_window=window, logits_soft_cap=cap)
    assert_matches_torch_native(batch, spec)
    out, _ = run_backend("triton", batch, spec)
    ref = dense_reference(batch, 0.125, window, soft_cap=cap)
    assert (out[: batch.num_actual_tokens].double() - ref).abs().max() < 1e-5
    assert (ref - dense_reference(batch, 0.125, window)).abs().max() > 1e-2  # the cap matters
