"""CudagraphDispatcher: keys, padding, mode choice, configuration errors."""

from __future__ import annotations

import pytest

import compile_runtime as cr
from compile_runtime.graphs.dispatcher import (
    BatchDescriptor,
    CudagraphDispatcher,
    is_uniform_decode,
    padding_table,
)
from compile_runtime.planner.sizes import default_capture_sizes

M = cr.CUDAGraphMode
NONE, PW, FULL = M.NONE, M.PIECEWISE, M.FULL
BD = BatchDescriptor


def brute_force_pad(n: int, sizes: list[int]) -> int | None:
    bigger = [s for s in sizes if s >= n]
    return min(bigger) if bigger else None


def dispatcher(sizes, mode=M.PIECEWISE, q=1, max_num_reqs=None, **config) -> CudagraphDispatcher:
    cfg = cr.CompilationConfig(cudagraph_capture_sizes=sizes, **config)
    d = CudagraphDispatcher(cfg, max_num_reqs=max_num_reqs)
    d.initialize_keys(mode, q)
    return d


@pytest.mark.parametrize(
    "sizes", [[1, 2, 4, 8], [3, 5, 16], [7], default_capture_sizes(512), list(range(1, 40))]
)
def test_padding_every_count_matches_brute_force(sizes):
    d = dispatcher(sizes)
    for n in range(1, max(sizes) + 2):
        want = brute_force_pad(n, sizes)
        mode, desc = d.dispatch(n)
        if want is None:
            assert (mode, desc) == (NONE, BD(n)), n
        else:
            assert (mode, desc) == (PW, BD(want)), n
        assert d.padded_size(n) == want


def test_padding_table_is_indexed_by_token_count():
    assert padding_table([2, 5]) == (0, 2, 2, 5, 5, 5)
    assert padding_table([]) == (0,)


def test_dispatch_returns_precomputed_descriptors():
    d = dispatcher([1, 2, 4, 8])
    assert d.dispatch(3)[1] is d.dispatch(4)[1]


def test_before_keys_exist_everything_is_none_and_exact():
    d = CudagraphDispatcher(cr.CompilationConfig(cudagraph_capture_sizes=[1, 2, 4]))
    assert d.dispatch(3) == (NONE, BD(3))
    assert d.dispatch(2, uniform_decode=True) == (NONE, BD(2))
    assert d.capture_descriptors() == []


def test_capture_sizes_bounded_by_max_num_tokens():
    cfg = cr.CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8, 16])
    d = CudagraphDispatcher(cfg, max_num_tokens=6)
    d.initialize_keys(PW)
    assert d.dispatch(5) == (NONE, BD(5))
    assert d.dispatch(3) == (PW, BD(4))


def test_full_and_piecewise_uniform_decode_keys():
    d = dispatcher([1, 2, 4, 8], M.FULL_AND_PIECEWISE)
    assert d.keys[FULL] == [BD(s, s, uniform=True) for s in [1, 2, 4, 8]]
    assert d.keys[PW] == [BD(s) for s in [1, 2, 4, 8]]
    assert d.dispatch(3, uniform_decode=True) == (FULL, BD(4, 4, uniform=True))
    assert d.dispatch(3) == (PW, BD(4))
    assert d.dispatch(9, uniform_decode=True) == (NONE, BD(9))


def test_uniform_decode_with_longer_queries():
    d = dispatcher([1, 2, 4, 6, 8], M.FULL_AND_PIECEWISE, q=4)
    # Decode graphs hold whole requests of 4 tokens (1 + 3 drafts): the capture sizes are
    # request counts there, so every decode size is a multiple of 4.
    assert d.keys[FULL] == [BD(4 * r, r, True) for r in [1, 2, 4, 6, 8]]
    assert d.keys[PW] == [BD(s) for s in [1, 2, 4, 6, 8]]
    for n, want in [(4, 4), (8, 8), (12, 16), (16, 16), (28, 32)]:
        assert d.dispatch(n, uniform_decode=True) == (FULL, BD(want, want // 4, True))
    assert d.dispatch(12) == (NONE, BD(12))  # mixed: past the largest piecewise size
    with pytest.raises(ValueError, match="multiple of 4"):
        d.dispatch(6, uniform_decode=True)


def test_max_num_reqs_bounds_decode_keys_and_larger_decodes_go_mixed():
    d = dispatcher([1, 2, 4, 8], M.FULL_AND_PIECEWISE, max_num_reqs=2)
    assert d.keys[FULL] == [BD(1, 1, True), BD(2, 2, True)]
    assert d.dispatch(4, uniform_decode=True) == (PW, BD(4))


def test_full_decode_only_mixed_batches_run_without_graphs():
    d = dispatcher([1, 2, 4, 8], M.FULL_DECODE_ONLY)
    assert d.keys[PW] == []
    assert d.dispatch(3, uniform_decode=True) == (FULL, BD(4, 4, True))
    assert d.dispatch(3) == (NONE, BD(3))


def test_full_mode_has_one_set_of_keys_for_every_batch():
    d = dispatcher([1, 2, 4, 8], M.FULL)
    assert d.keys == {PW: [], FULL: [BD(s) for s in [1, 2, 4, 8]]}
    assert d.dispatch(3, uniform_decode=True) == (FULL, BD(4))
    assert d.dispatch(3) == (FULL, BD(4))


def test_none_mode_has_no_keys():
    d = dispatcher([1, 2, 4, 8], M.NONE)
    assert d.capture_descriptors() == []
    assert d.dispatch(3, uniform_decode=True) == (NONE, BD(3))


def test_invalid_modes():
    d = dispatcher([1, 2, 4, 8], M.FULL_AND_PIECEWISE)
    assert d.dispatch(3, uniform_decode=True, invalid_modes={FULL}) == (PW, BD(4))
    assert d.dispatch(3, uniform_decode=True, invalid_modes={FULL, PW}) == (NONE, BD(3))
    assert d.dispatch(3, invalid_modes={PW}) == (NONE, BD(3))
    assert d.dispatch(3, uniform_decode=True, invalid_modes={PW}) == (FULL, BD(4, 4, True))


def test_capture_descriptors_piecewise_then_full_largest_first():
    d = dispatcher([1, 4, 2, 8], M.FULL_AND_PIECEWISE, q=2)
    assert d.capture_descriptors() == [
        (PW, BD(8)),
        (PW, BD(4)),
        (PW, BD(2)),
        (PW, BD(1)),
        (FULL, BD(16, 8, True)),
        (FULL, BD(8, 4, True)),
        (FULL, BD(4, 2, True)),
        (FULL, BD(2, 1, True)),
    ]


def test_initialize_keys_accepts_resolved_modes():
    cfg = cr.CompilationConfig(cudagraph_capture_sizes=[1, 2])
    resolved = cfg.resolve(cr.AttentionCGSupport.UNIFORM_BATCH, cuda_available=True)
    d = CudagraphDispatcher(cfg)
    d.initialize_keys(resolved)
    assert d.mode == M.FULL_AND_PIECEWISE
    assert d.dispatch(2, uniform_decode=True) == (FULL, BD(2, 2, True))


def test_batch_descriptor_is_hashable_and_relaxes():
    desc = BD(8, 8, uniform=True)
    assert {desc: 1}[BD(8, 8, True)] == 1
    assert desc.relaxed() == BD(8) == BD(8, None, False)
    assert desc.relaxed() != desc


def test_compile_size_that_would_be_padded_is_an_error():
    with pytest.raises(ValueError) as info:
        dispatcher([1, 2, 4, 8], compile_sizes=[3])
    message = str(info.value)
    assert "compile_sizes contains 3" in message and "padded to the CUDA graph size 4" in message
    assert "cudagraph_capture_sizes" in message


def test_compile_sizes_on_a_capture_size_or_beyond_the_largest_are_fine():
    d = dispatcher([1, 2, 4, 8], compile_sizes=[4, 8, 100])
    assert d.dispatch(4) == (PW, BD(4))


def test_compile_size_check_needs_padded_mixed_batches():
    # Mixed batches run unpadded under FULL_DECODE_ONLY, and nothing is padded under NONE.
    dispatcher([1, 2, 4, 8], M.FULL_DECODE_ONLY, compile_sizes=[3])
    dispatcher([1, 2, 4, 8], M.NONE, compile_sizes=[3])
    with pytest.raises(ValueError, match="compile_sizes contains 3"):
        dispatcher([1, 2, 4, 8], M.FULL_AND_PIECEWISE, compile_sizes=[3])


def test_bad_uniform_decode_query_len():
    d = CudagraphDispatcher(cr.CompilationConfig())
    with pytest.raises(ValueError, match="uniform_decode_query_len"):
        d.initialize_keys(PW, 0)


def test_uniform_decode_is_every_request_at_the_decode_query_length():
    assert is_uniform_decode([1, 1, 1]) and is_uniform_decode([4, 4], query_len=4)
    assert not is_uniform_decode([1, 2]) and not is_uniform_decode([1, 1], query_len=4)
    assert not is_uniform_decode([])  # no request: nothing to decode


def test_lora_keys_come_in_pairs_and_dispatch_by_the_flag():
    """With LoRA enabled every graph key exists with and without adapters; a batch's
    has_lora picks its form, same padding; discarding a size drops both forms."""
    d = CudagraphDispatcher(
        cr.CompilationConfig(cudagraph_capture_sizes=[1, 2, 4]), max_num_tokens=8, max_num_reqs=8
    )
    d.initialize_keys(M.FULL_AND_PIECEWISE, lora=True)
    assert sorted((k.num_tokens, k.has_lora) for k in d.keys[FULL]) == [
        (s, lora) for s in (1, 2, 4) for lora in (False, True)
    ]
    with_lora = BD(4, 4, uniform=True, has_lora=True)
    assert d.dispatch(3, uniform_decode=True, has_lora=True) == (FULL, with_lora)
    assert d.dispatch(3, uniform_decode=True) == (FULL, BD(4, 4, uniform=True))
    assert d.dispatch(3, has_lora=True) == (PW, BD(4, has_lora=True))
    d.discard(FULL, BD(4, 4, uniform=True, has_lora=True))
    assert all(k.num_tokens != 4 for k in d.keys[FULL])
    plain = CudagraphDispatcher(
        cr.CompilationConfig(cudagraph_capture_sizes=[1, 2]), max_num_tokens=8
    )
    plain.initialize_keys(M.PIECEWISE)
    with pytest.raises(ValueError, match="lora=True"):
        plain.dispatch(2, has_lora=True)
