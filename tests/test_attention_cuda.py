"""Attention backends on the GPU: triton and flashinfer against torch_native in
float16/bfloat16, and FULL CUDA graph replays of steps for each backend that claims them."""

from __future__ import annotations

import pytest
import torch
from compile_runtime.backends.attention import load_backend
from compile_runtime.backends.attention.torch_native import TorchNativeImpl

import compile_runtime as cr
from compile_runtime.attention.kv_cache import bind_kv_cache, compute_slot_mapping
from compile_runtime.attention.layer import Attention
from compile_runtime.attention.spec import AttentionSpec
from testing.attention import make_paged_batch

pytestmark = pytest.mark.cuda

TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 4e-2}


def backend_or_skip(name: str, dtype: torch.dtype, head_size: int):
    backend = load_backend(name)
    reason = backend.unsupported_reason("cuda", dtype, head_size)
    if reason:
        pytest.skip(f"{name}: {reason}")
    return backend


def float32_reference(query, key, value, kv_cache, metadata, spec) -> torch.Tensor:
    """torch_native in float32 on upcast copies (the cache copy is written, not the original)."""
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    cache = kv_cache.float()
    spec32 = AttentionSpec(spec.num_heads, spec.num_kv_heads, spec.head_size, spec.scale)
    TorchNativeImpl(spec32).forward(query.float(), key.float(), value.float(), cache, metadata, out)
    return out


SHAPES = {
    "mixed": ([7, 1, 33, 1, 2], [0, 40, 16, 3, 70]),
    "decode": ([1] * 6, [1, 15, 16, 17, 60, 120]),
    "prefill": ([50, 17], [0, 0]),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_backend_matches_torch_native_on_gpu(name, dtype, shape):
    backend = backend_or_skip(name, dtype, 128)
    query_lens, context_lens = SHAPES[shape]
    batch = make_paged_batch(
        query_lens,
        context_lens,
        num_heads=8,
        num_kv_heads=2,
        head_size=128,
        block_size=16,
        num_padding=3,
        dtype=dtype,
        device="cuda",
    )
    spec = AttentionSpec(8, 2, 128, 128**-0.5, dtype=dtype)
    builder = backend.make_builder(spec, 16, max_num_reqs=16, device="cuda")
    metadata = builder.build(
        batch.query_start_loc_cpu,
        batch.seq_lens_cpu,
        batch.block_table,
        batch.slot_mapping,
        batch.num_actual_tokens,
        num_padded_tokens=batch.query.shape[0],
    )
    ref = float32_reference(batch.query, batch.key, batch.value, batch.kv_cache, metadata, spec)
    cache = batch.kv_cache.clone()
    out = torch.empty_like(batch.query)
    backend.make_impl(spec).forward(batch.query, batch.key, batch.value, cache, metadata, out)
    n = batch.num_actual_tokens
    assert (out[:n].float() - ref[:n]).abs().max() < TOLERANCE[dtype]
    assert torch.equal(cache[:, 1:], batch.expected_cache()[:, 1:])  # all but the null block


DECODE_STEPS = [([1] * 8, [5, 16, 31, 1, 90, 33, 64, 7]), ([1] * 5, [17, 2, 47, 15, 100])]
MIXED_STEPS = [([3, 1, 1], [0, 20, 47]), ([1] * 8, [5, 16, 31, 1, 90, 33, 64, 7]), ([8], [40])]


@pytest.mark.parametrize(
    "name, steps",
    [("triton", DECODE_STEPS), ("triton", MIXED_STEPS), ("flashinfer", DECODE_STEPS)],
    ids=["triton-decode", "triton-mixed", "flashinfer-decode"],
)
def test_full_graph_replays_steps(name, steps):
    """Capture the layer (custom op, cache write, kernel) once at 8 padded tokens, then
    replay it for steps of other request counts and lengths: each replay equals torch_native."""
    dtype, heads, kv_heads, head, block_size, num_blocks, padded = (
        torch.float16,
        8,
        2,
        128,
        16,
        64,
        8,
    )
    backend = backend_or_skip(name, dtype, head)
    with torch.device("cuda"):
        layer = Attention(
            heads, head, head**-0.5, kv_heads, prefix=f"graph.{name}", backend=name, dtype=dtype
        )
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head, dtype=dtype, device="cuda")
    bind_kv_cache([layer], {layer.layer_name: cache})
    builder = backend.make_builder(layer.spec, block_size, max_num_reqs=16, device="cuda")
    q_buf = torch.zeros(padded, heads * head, dtype=dtype, device="cuda")
    k_buf = torch.zeros(padded, kv_heads * head, dtype=dtype, device="cuda")
    v_buf = torch.zeros_like(k_buf)
    slot_buf = torch.full((padded,), -1, dtype=torch.long, device="cuda")
    gen = torch.Generator().manual_seed(0)

    def prepare(query_lens, context_lens):
        seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
        table = torch.zeros(len(seq_lens), 8, dtype=torch.int32)
        free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        for i, s in enumerate(seq_lens):
            table[i, : -(-s // block_size)] = torch.tensor(
                [free.pop() for _ in range(-(-s // block_size))]
            )
        reqs = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(query_lens))
        pos = torch.cat(
            [torch.arange(c, c + q) for q, c in zip(query_lens, context_lens, strict=True)]
        )
        n = len(pos)
        slot_buf.fill_(-1)
        slot_buf[:n] = compute_slot_mapping(table, reqs, pos, block_size).cuda()
        for buf in (q_buf, k_buf, v_buf):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
        qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(query_lens).cumsum(0)
        metadata = builder.build(
            qsl,
            torch.tensor(seq_lens, dtype=torch.int32),
            table.cuda(),
            slot_buf,
            n,
            num_padded_tokens=padded,
            for_cudagraph=True,
        )
        return metadata, n

    metadata, _ = prepare(*steps[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), cr.set_forward_context(metadata):
        layer(q_buf, k_buf, v_buf)  # compile / JIT outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), cr.set_forward_context(metadata):
        out = layer(q_buf, k_buf, v_buf)

    for query_lens, context_lens in steps:
        metadata, n = prepare(query_lens, context_lens)
        shape = (padded, -1, head)
        ref = float32_reference(
            q_buf.view(shape), k_buf.view(shape), v_buf.view(shape), cache, metadata, layer.spec
        )
        before = cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert (out.view(shape)[:n].float() - ref[:n]).abs().max() < TOLERANCE[dtype]
        written = cache.view(2, -1, kv_heads, head)[:, slot_buf[:n]]
        assert torch.equal(written[0], k_buf.view(shape)[:n])
        assert torch.equal(written[1], v_buf.view(shape)[:n])
        untouched = torch.ones(num_blocks, dtype=torch.bool)
        untouched[0] = False
        untouched[slot_buf[:n].cpu() // block_size] = False
        assert torch.equal(cache[:, untouched], before[:, untouched])
