"""Attention on CPU: torch_native and cpu_batched against dense attention, padding, the builder, the layer
through the compiler, the KV cache helpers, and backend selection."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from compile_runtime.backends.attention import (
    AttentionBackend,
    AttentionBackendError,
    get_attn_backend,
    load_backend,
    min_cg_support,
    use_attn_backend,
)
from compile_runtime.backends.attention.flashinfer_attn import FlashInferBackend
from compile_runtime.backends.attention.torch_native import TorchNativeBackend
from compile_runtime.backends.attention.triton_attn import TritonBackend

from compile_runtime.attention.selector import ENV_VAR
from compile_runtime.cpu.attention import CPUBatchedBackend

pytest.importorskip("hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import compile_runtime as cr
from compile_runtime.attention.kv_cache import (
    NULL_BLOCK_ID,
    allocate_kv_cache,
    bind_kv_cache,
    compute_slot_mapping,
)
from compile_runtime.attention.layer import Attention, attention_layers
from compile_runtime.attention.metadata import MetadataError
from compile_runtime.attention.spec import AttentionSpec
from testing.attention import PagedBatch, make_paged_batch

AttentionCGSupport = cr.AttentionCGSupport


# ---- helpers ---------------------------------------------------------------


def dense_reference(
    batch: PagedBatch,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention request by request over the full keys, in float64, [actual, H, D]."""
    starts = batch.query_start_loc_cpu.tolist()
    outs = []
    for i, (k, v) in enumerate(zip(batch.full_keys, batch.full_values, strict=True)):
        q = batch.query[starts[i] : starts[i + 1]].double()
        groups = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(groups, 1)
        v = v.double().repeat_interleave(groups, 1)
        seq_len, q_len = k.shape[0], q.shape[0]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window:
            visible &= k_pos > q_pos - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


def run_backend(
    name: str, batch: PagedBatch, spec: AttentionSpec, uniform_query_len: int = 1, **build_kwargs
):
    """Output and cache after one step of backend ``name`` on a copy of the batch's cache
    (``uniform_query_len``: the uniform decode's query tokens a request, as the runner sets)."""
    backend = load_backend(name)
    block_size = batch.kv_cache.shape[2]
    builder = backend.make_builder(spec, block_size, max_num_reqs=16, device="cpu")
    builder.uniform_decode_query_len = uniform_query_len
    metadata = builder.build(
        batch.query_start_loc_cpu,
        batch.seq_lens_cpu,
        batch.block_table,
        batch.slot_mapping.clone(),
        batch.num_actual_tokens,
        num_padded_tokens=batch.query.shape[0],
        **build_kwargs,
    )
    cache = batch.kv_cache.clone()
    out = torch.full_like(batch.query, float("nan"))
    backend.make_impl(spec).forward(batch.query, batch.key, batch.value, cache, metadata, out)
    return out, cache


@st.composite
def batch_shapes(draw, max_reqs: int = 8, max_ctx_blocks: int = 3, max_query: int = 40):
    """A mixed batch: decodes (query 1) and prefill chunks, with and without cached prefixes."""
    block_size = draw(st.sampled_from([16, 32]))
    num_reqs = draw(st.integers(1, max_reqs))
    ctx = st.integers(0, max_ctx_blocks * block_size)
    query = st.one_of(st.just(1), st.integers(1, max_query))
    return {
        "context_lens": draw(st.lists(ctx, min_size=num_reqs, max_size=num_reqs)),
        "query_lens": draw(st.lists(query, min_size=num_reqs, max_size=num_reqs)),
        "num_kv_heads": (kv := draw(st.sampled_from([1, 2]))),
        "num_heads": kv * draw(st.sampled_from([1, 2, 4])),
        "head_size": draw(st.sampled_from([64, 128])),
        "block_size": block_size,
        "num_padding": draw(st.integers(0, 3)),
        "seed": draw(st.integers(0, 2**16)),
    }


def spec_of(shape: dict, sliding_window: int | None = None) -> AttentionSpec:
    return AttentionSpec(
        shape["num_heads"],
        shape["num_kv_heads"],
        shape["head_size"],
        shape["head_size"] ** -0.5,
        sliding_window=sliding_window,
    )


# ---- CPU backends against dense attention ------------------------------------

CPU_BACKENDS = ["torch_native", "cpu_batched"]


@pytest.mark.parametrize("name", CPU_BACKENDS)
@settings(max_examples=60, deadline=None)
@given(shape=batch_shapes(), window=st.sampled_from([None, None, 1, 5, 16, 40]))
def test_cpu_backend_matches_dense_reference(name, shape, window):
    """Mixed decodes and prefill chunks over shuffled blocks, padded slots, sliding windows."""
    batch = make_paged_batch(**shape)
    spec = spec_of(shape, window)
    out, cache = run_backend(name, batch, spec)
    n = batch.num_actual_tokens
    ref = dense_reference(batch, spec.scale, window)
    assert (out[:n].double() - ref).abs().max() < 1e-5
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    assert torch.equal(cache[:, 1:], batch.expected_cache()[:, 1:])  # all but the null block


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_cpu_backend_sliding_window(name, window):
    batch = make_paged_batch(
        [9, 1, 30], [20, 47, 0], num_heads=4, num_kv_heads=2, head_size=64, block_size=16
    )
    spec = AttentionSpec(4, 2, 64, 0.125, sliding_window=window)
    out, _ = run_backend(name, batch, spec)
    assert (out.double() - dense_reference(batch, 0.125, window)).abs().max() < 1e-5


SOFT_CAP_CASES = [
    ("torch_native", False),
    ("cpu_batched", False),  # torch ops (explicit math: SDPA cannot cap)
    ("cpu_batched", True),  # the C decode kernel for the decodes, torch ops for the prefills
]


@pytest.mark.parametrize("name, kernel", SOFT_CAP_CASES)
@pytest.mark.parametrize("cap, window", [(0.5, None), (5.0, None), (2.0, 7)])
def test_cpu_backend_logits_soft_cap(monkeypatch, name, kernel, cap, window):
    """Gemma 2's cap on the scaled logits, in every CPU path, against the written-out math."""
    from compile_runtime.cpu import attention as cpu_batched
    from compile_runtime.cpu import decode_kernel as cpu_decode_kernel

    if kernel:
        assert cpu_decode_kernel.load_decode_kernel() is not None  # CI machines have a compiler
    else:
        monkeypatch.setattr(cpu_batched, "load_decode_kernel", lambda: None)
    batch = make_paged_batch(
        [1, 9, 1, 30], [70, 20, 3, 0], num_heads=8, num_kv_heads=2, head_size=64,
        block_size=16, num_padding=2, seed=5,
    )  # fmt: skip
    spec = AttentionSpec(8, 2, 64, 0.125, sliding_window=window, logits_soft_cap=cap)
    out, cache = run_backend(name, batch, spec)
    n = batch.num_actual_tokens
    ref = dense_reference(batch, 0.125, window, soft_cap=cap)
    assert (out[:n].double() - ref).abs().max() < 1e-5
    assert (ref - dense_reference(batch, 0.125, window)).abs().max() > 1e-2  # the cap matters
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    assert torch.equal(cache[:, 1:], batch.expected_cache()[:, 1:])


def test_cpu_batched_logits_soft_cap_half_precision():
    batch = make_paged_batch(
        [1, 5, 1], [30, 10, 3], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
        dtype=torch.bfloat16,
    )  # fmt: skip
    spec = AttentionSpec(4, 2, 64, 0.125, dtype=torch.bfloat16, logits_soft_cap=0.5)
    out, _ = run_backend("cpu_batched", batch, spec)
    assert out.dtype == torch.bfloat16
    assert (out.double() - dense_reference(batch, 0.125, soft_cap=0.5)).abs().max() < 2e-2


def test_spec_rejects_a_non_positive_soft_cap():
    with pytest.raises(ValueError, match="logits_soft_cap must be positive"):
        AttentionSpec(4, 2, 64, 0.125, logits_soft_cap=0.0)


@pytest.mark.parametrize(
    "query_lens, context_lens",
    [
        ([1, 1, 1, 1], [5, 40, 17, 0]),  # decodes only: one call, contiguous outputs
        ([7, 1, 1, 12, 1], [3, 30, 0, 16, 64]),  # decodes between prefills: scattered outputs
        ([16, 33], [0, 15]),  # prefills only, padded to the longest chunk
    ],
)
def test_cpu_batched_equals_torch_native(query_lens, context_lens):
    """The batched backend computes what the per-request reference computes."""
    batch = make_paged_batch(
        query_lens,
        context_lens,
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        num_padding=3,
        seed=7,
    )
    spec = AttentionSpec(8, 2, 64, 0.125)
    ref, ref_cache = run_backend("torch_native", batch, spec)
    out, cache = run_backend("cpu_batched", batch, spec)
    assert (out - ref).abs().max() < 1e-5
    assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_batched_half_precision(dtype):
    batch = make_paged_batch(
        [1, 5, 1],
        [30, 10, 3],
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        dtype=dtype,
    )
    spec = AttentionSpec(4, 2, 64, 0.125, dtype=dtype)
    out, _ = run_backend("cpu_batched", batch, spec)
    assert out.dtype == dtype
    assert (out.double() - dense_reference(batch, 0.125)).abs().max() < 2e-2


def test_cpu_batched_plans_once_per_step():
    """Planning happens in the builder: every layer of a step reuses one plan."""
    batch = make_paged_batch(
        [1, 1, 9], [20, 3, 0], num_heads=4, num_kv_heads=2, head_size=64, block_size=16
    )
    spec = AttentionSpec(4, 2, 64, 0.125)
    builder = CPUBatchedBackend.make_builder(spec, 16, max_num_reqs=8, device="cpu")
    metadata = builder.build(
        batch.query_start_loc_cpu,
        batch.seq_lens_cpu,
        batch.block_table,
        batch.slot_mapping.clone(),
        batch.num_actual_tokens,
    )
    plan = metadata.backend_state
    assert plan.decode.num_reqs == 2 and plan.prefill.num_reqs == 1
    assert plan.decode.out_tokens == slice(0, 2)
    assert plan.prefill.max_query_len == 9


def test_padded_tokens_never_change_request_blocks():
    batch = make_paged_batch(
        [3, 1, 6],
        [10, 33, 0],
        num_heads=2,
        num_kv_heads=1,
        head_size=64,
        block_size=16,
        num_padding=4,
    )
    n = batch.num_actual_tokens
    # Half the padding says "no slot", half points into the null block itself.
    batch.slot_mapping[n : n + 2] = -1
    batch.slot_mapping[n + 2 :] = torch.tensor([NULL_BLOCK_ID * 16 + 3, NULL_BLOCK_ID * 16 + 15])
    spec = AttentionSpec(2, 1, 64, 0.125)
    backend = load_backend("torch_native")
    builder = backend.make_builder(spec, 16, max_num_reqs=8, device="cpu")
    metadata = builder.build(
        batch.query_start_loc_cpu,
        batch.seq_lens_cpu,
        batch.block_table,
        batch.slot_mapping,
        n,
        num_padded_tokens=n + 4,
    )
    # The builder enforces "padding writes nowhere but the null block".
    assert batch.slot_mapping[n:].tolist() == [-1] * 4
    cache = batch.kv_cache.clone()
    out = torch.empty_like(batch.query)
    backend.make_impl(spec).forward(batch.query, batch.key, batch.value, cache, metadata, out)
    expected = batch.expected_cache()
    assert torch.equal(cache[:, 1:], expected[:, 1:])  # every block but the null block
    unpadded, _ = run_backend("torch_native", _without_padding(batch), spec)
    assert torch.equal(out[:n], unpadded)


def _without_padding(batch: PagedBatch) -> PagedBatch:
    n = batch.num_actual_tokens
    return PagedBatch(
        **{
            **batch.__dict__,
            "query": batch.query[:n],
            "key": batch.key[:n],
            "value": batch.value[:n],
            "slot_mapping": batch.slot_mapping[:n],
        }
    )


# ---- the metadata builder ------------------------------------------------------


def _build(builder, query_lens, seq_lens, **kwargs):
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    n = int(qsl[-1])
    table = torch.arange(1, 1 + 4 * len(seq_lens), dtype=torch.int32).view(len(seq_lens), 4)
    slots = torch.arange(kwargs.get("num_padded_tokens", n), dtype=torch.long)
    return builder.build(qsl, torch.tensor(seq_lens, dtype=torch.int32), table, slots, n, **kwargs)


def test_builder_detects_uniform_decode_and_pads_requests():
    builder = TorchNativeBackend.make_builder(AttentionSpec(2, 2, 64, 1.0), 16, 8, "cpu")
    decode = _build(builder, [1, 1, 1], [5, 17, 40], num_padded_tokens=4)
    assert decode.uniform_decode and decode.max_query_len == 1 and decode.max_seq_len == 40
    assert decode.slot_mapping.tolist() == [0, 1, 2, -1]
    mixed = _build(builder, [1, 7], [5, 7], num_reqs_padded=4)
    assert not mixed.uniform_decode and mixed.num_reqs == 2 and mixed.num_reqs_padded == 4
    assert mixed.query_start_loc.tolist() == [0, 1, 8, 8, 8]
    assert mixed.seq_lens.tolist() == [5, 7, 0, 0]
    assert mixed.query_start_loc_cpu.tolist() == [0, 1, 8]
    # FULL graphs: requests padded to a count fixed by the padded token count.
    graph = _build(builder, [1, 1], [3, 4], num_padded_tokens=4, for_cudagraph=True)
    assert graph.num_reqs_padded == 4


def test_builder_keeps_device_tensors_at_fixed_addresses():
    builder = TorchNativeBackend.make_builder(AttentionSpec(2, 2, 64, 1.0), 16, 8, "cpu")
    first = _build(builder, [1, 1], [3, 9])
    ptrs = [t.data_ptr() for t in (first.query_start_loc, first.seq_lens, first.block_table)]
    second = _build(builder, [4, 1, 2], [4, 30, 2])
    assert ptrs == [
        t.data_ptr() for t in (second.query_start_loc, second.seq_lens, second.block_table)
    ]
    assert second.block_table[:, :2].tolist() == [[1, 2], [5, 6], [9, 10]]


@pytest.mark.parametrize(
    "query_lens, seq_lens, kwargs, match",
    [
        ([2, 1], [1, 4], {}, "query_len <= seq_len"),
        ([1], [90], {}, "block_table has 4 columns"),
        ([1] * 3, [1] * 3, {"num_reqs_padded": 9}, "max_num_reqs"),
        ([1] * 3, [1] * 3, {"num_reqs_padded": 2}, "num_reqs_padded"),
    ],
)
def test_builder_rejects_inconsistent_steps(query_lens, seq_lens, kwargs, match):
    builder = TorchNativeBackend.make_builder(AttentionSpec(2, 2, 64, 1.0), 16, 8, "cpu")
    with pytest.raises(MetadataError, match=match):
        _build(builder, query_lens, seq_lens, **kwargs)


# ---- the KV cache helpers ------------------------------------------------------


def test_allocate_bind_and_share_kv_cache():
    layers = [Attention(4, 64, 0.125, 2, prefix=f"kv.{i}") for i in range(3)]
    names = [layer.layer_name for layer in layers]
    caches = allocate_kv_cache(layers, 5, 16, dtype=torch.float16, shared={names[2]: names[0]})
    assert caches[names[0]].shape == (2, 5, 16, 2, 64) and caches[names[0]].dtype == torch.float16
    assert caches[names[2]] is caches[names[0]] and caches[names[1]] is not caches[names[0]]
    assert not caches[names[1]].any()
    bind_kv_cache(layers, caches)
    assert layers[2].kv_cache is layers[0].kv_cache
    with pytest.raises(ValueError, match="null block"):
        allocate_kv_cache(layers, 1, 16)
    with pytest.raises(ValueError, match=r"expected \[2, num_blocks, block_size, 2, 64\]"):
        bind_kv_cache(layers[:1], {names[0]: torch.zeros(2, 5, 16, 4, 64)})


def test_compute_slot_mapping():
    table = torch.tensor([[3, 7, 0], [5, 0, 0]], dtype=torch.int32)
    slots = compute_slot_mapping(
        table, torch.tensor([0, 0, 0, 1]), torch.tensor([0, 15, 16, 2]), 16
    )
    assert slots.tolist() == [48, 63, 112, 82]


# ---- the layer ---------------------------------------------------------------


def _qkv(n: int, heads: int, kv_heads: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, heads * d, generator=g),
        torch.randn(n, kv_heads * d, generator=g),
        torch.randn(n, kv_heads * d, generator=g),
    )


@pytest.mark.parametrize("window, cap", [(None, None), (3, None), (None, 0.5), (3, 2.0)])
def test_layer_without_metadata_is_dense_causal_attention(window, cap):
    layer = Attention(
        4, 32, 0.2, num_kv_heads=2, prefix="dense", sliding_window=window, logits_soft_cap=cap
    )
    q, k, v = _qkv(9, 4, 2, 32)
    batch = make_paged_batch([9], [0], num_heads=4, num_kv_heads=2, head_size=32, block_size=16)
    batch.query = q.view(9, 4, 32)
    batch.full_keys, batch.full_values = [k.view(9, 2, 32)], [v.view(9, 2, 32)]
    ref = dense_reference(batch, 0.2, window, soft_cap=cap).reshape(9, -1)
    assert (layer(q, k, v).double() - ref).abs().max() < 1e-5  # no forward context
    with cr.set_forward_context(None):  # a dummy run
        assert (layer(q, k, v).double() - ref).abs().max() < 1e-5


def test_layer_with_metadata_needs_a_bound_cache():
    layer = Attention(2, 32, 0.2, prefix="unbound")
    builder = layer.attn_backend.make_builder(layer.spec, 16, 4, "cpu")
    with cr.set_forward_context(_build(builder, [3], [3])):
        with pytest.raises(RuntimeError, match="bind_kv_cache"):
            layer(*_qkv(3, 2, 2, 32))


def test_layer_names_are_the_prefixes_and_backend_is_held():
    a, b = Attention(2, 32, 0.2, prefix="same"), Attention(2, 32, 0.2, prefix="same")
    assert a.layer_name == b.layer_name == "same"  # one per model: no process-wide suffix
    assert a.attn_backend is CPUBatchedBackend and a.impl.spec == a.spec


def test_a_model_with_two_layers_of_one_name_is_an_error():
    from compile_runtime.attention.op import DuplicateLayerNameError, attention_layer_table

    model = nn.ModuleList(
        [Attention(2, 32, 0.2, prefix="dup"), Attention(2, 32, 0.2, prefix="dup")]
    )
    with pytest.raises(DuplicateLayerNameError, match=r"'0' and '1'.*both named 'dup'.*prefix"):
        attention_layer_table(model)
    assert list(attention_layer_table(nn.ModuleList([model[0]]))) == ["dup"]


def test_the_op_outside_a_model_forward_says_what_to_do():
    q, k, v = _qkv(3, 2, 2, 32)
    out = torch.empty(3, 64)
    with pytest.raises(LookupError, match="outside a model's forward"):
        torch.ops.compile_runtime.attention(q, k, v, out, "nowhere")


HIDDEN, HEADS, KV_HEADS, HEAD = 32, 4, 2, 16


@cr.compile
class TinyAttentionModel(nn.Module):
    def __init__(self, num_layers: int = 2):
        super().__init__()
        q, kv = HEADS * HEAD, KV_HEADS * HEAD
        self.sizes = [q, kv, kv]
        self.qkv = nn.ModuleList(nn.Linear(HIDDEN, q + 2 * kv) for _ in range(num_layers))
        self.attn = nn.ModuleList(
            Attention(HEADS, HEAD, HEAD**-0.5, KV_HEADS, prefix=f"tiny.{i}.attn")
            for i in range(num_layers)
        )
        self.out = nn.ModuleList(nn.Linear(q, HIDDEN) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for qkv, attn, out in zip(self.qkv, self.attn, self.out, strict=True):
            q, k, v = qkv(x).split(self.sizes, -1)
            x = x + out(attn(q, k, v))
        return x


def _build_tiny(config: cr.CompilationConfig) -> TinyAttentionModel:
    torch.manual_seed(0)
    with cr.set_compilation_config(config):
        return TinyAttentionModel().eval()


def test_compiled_model_with_paged_cache_matches_dense_per_request():
    """Two steps through the compiled, split model: prefills, then a decode next to a
    chunked prefill. Each request's outputs equal dense attention over its own tokens."""
    model = _build_tiny(cr.CompilationConfig(backend="eager"))
    dense = _build_tiny(cr.CompilationConfig(mode="NONE"))  # same weights, eager, no cache
    layers = attention_layers(model)
    bind_kv_cache(layers, allocate_kv_cache(layers, 8, 16))
    builder = layers[0].attn_backend.make_builder(layers[0].spec, 16, 4, "cpu")
    table = torch.tensor([[3, 5], [2, 6]], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    tokens = {0: torch.randn(6, HIDDEN, generator=g), 1: torch.randn(20, HIDDEN, generator=g)}
    steps = [{0: (0, 5), 1: (0, 3)}, {0: (5, 6), 1: (3, 20)}]  # request -> [start, end)

    counter = cr.compilation_counter
    outputs: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    with counter.expect(num_graphs_seen=1, num_piecewise_graphs_seen=5), torch.no_grad():
        for step in steps:
            x = torch.cat([tokens[r][s:e] for r, (s, e) in step.items()])
            lens = [e - s for s, e in step.values()]
            reqs = torch.repeat_interleave(torch.tensor(list(step)), torch.tensor(lens))
            pos = torch.cat([torch.arange(s, e) for s, e in step.values()])
            qsl = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
            seq_lens = torch.tensor([e for _, e in step.values()], dtype=torch.int32)
            slots = compute_slot_mapping(table, reqs, pos, 16)
            with cr.set_forward_context(builder.build(qsl, seq_lens, table, slots, len(x))):
                y = model(x)
            outputs[0].append(y[: lens[0]])
            outputs[1].append(y[lens[0] :])
    with torch.no_grad():
        for r in (0, 1):
            ref = dense(tokens[r])  # no forward context: dense causal attention
            assert (torch.cat(outputs[r]) - ref).abs().max() < 1e-5


# ---- backend selection ---------------------------------------------------------


def test_registry_picks_cpu_batched_on_cpu_and_obeys_names(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert get_attn_backend(device="cpu", dtype=torch.float32, head_size=64) is CPUBatchedBackend
    assert get_attn_backend("torch_native", device="cpu") is TorchNativeBackend
    with pytest.raises(AttentionBackendError, match="choose one of"):
        get_attn_backend("flash-attn")
    with pytest.raises(AttentionBackendError, match="dtypes"):
        get_attn_backend("torch_native", device="cpu", dtype=torch.int8)
    monkeypatch.setenv(ENV_VAR, "no-such-backend")
    with pytest.raises(AttentionBackendError, match="no-such-backend"):
        get_attn_backend(device="cpu")
    with use_attn_backend("torch_native"):  # the context manager beats the environment
        assert Attention(2, 32, 0.1, prefix="sel").attn_backend is TorchNativeBackend


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AttentionBackendError, match="TRITON_INTERPRET=1"):
        get_attn_backend("triton", device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_attn_backend("triton", device="cpu", dtype=torch.float32) is TritonBackend


def test_flashinfer_imports_anywhere_and_selecting_it_here_says_what_to_install():
    import compile_runtime.backends.attention.flashinfer_attn as fi

    with pytest.raises(AttentionBackendError) as err:
        get_attn_backend("flashinfer", device="cpu", dtype=torch.float16, head_size=128)
    if importlib.util.find_spec("flashinfer") is None:
        assert "pip install flashinfer-python" in str(err.value)
        with pytest.raises(AttentionBackendError, match="pip install flashinfer-python"):
            fi.import_flashinfer()
    else:
        assert "cuda" in str(err.value)
    with pytest.raises(AttentionBackendError, match="CUDA|flashinfer-python"):
        FlashInferBackend.make_builder(
            AttentionSpec(2, 2, 64, 1.0, dtype=torch.float16), 16, 4, "cpu"
        )


@pytest.mark.parametrize("layer", [{"sliding_window": 8}, {"logits_soft_cap": 50.0}])
def test_flashinfer_refuses_a_layer_planned_for_another_window_or_cap(layer):
    """The step's wrappers are planned with one spec's window and cap: another layer's would
    silently run with them (Gemma 2 alternates windows)."""
    from compile_runtime.backends.attention.flashinfer_attn import FlashInferState

    planned = AttentionSpec(4, 2, 64, 0.125, dtype=torch.float16)
    state = FlashInferState(None, 1, True, torch.float16, planned)
    impl = FlashInferBackend.make_impl(AttentionSpec(4, 2, 64, 0.125, dtype=torch.float16, **layer))
    q, kv = torch.zeros(1, 4, 64, dtype=torch.float16), torch.zeros(1, 2, 64, dtype=torch.float16)
    with pytest.raises(AttentionBackendError, match="its own builder"):
        impl.forward(q, kv, kv, None, SimpleNamespace(backend_state=state), torch.empty_like(q))


def test_backend_declarations_and_head_size_checks():
    class OnlyHead64(AttentionBackend):
        name = "only64"
        cg_support = AttentionCGSupport.ALWAYS
        supported_dtypes = frozenset({torch.float16})
        supported_devices = frozenset({"cpu"})
        supported_head_sizes = frozenset({64})

    assert OnlyHead64.unsupported_reason("cpu", torch.float16, 64) is None
    assert "head sizes [64]" in OnlyHead64.unsupported_reason("cpu", torch.float16, 80)
    assert "'cuda'" in OnlyHead64.unsupported_reason("cuda", torch.float16, 64)
    assert TorchNativeBackend.cg_support == AttentionCGSupport.NEVER
    assert TritonBackend.cg_support == AttentionCGSupport.ALWAYS
    assert FlashInferBackend.cg_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_min_cg_support_drives_config_resolution():
    assert min_cg_support([]) == AttentionCGSupport.ALWAYS
    assert min_cg_support([TritonBackend, FlashInferBackend]) == (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )
    assert min_cg_support([TritonBackend, TorchNativeBackend]) == AttentionCGSupport.NEVER
    config = cr.CompilationConfig(cudagraph_mode="FULL")

    def resolved(*backends):
        return config.resolve(min_cg_support(backends), cuda_available=True).cudagraph_mode

    assert resolved(TritonBackend) == cr.CUDAGraphMode.FULL
    assert resolved(FlashInferBackend) == cr.CUDAGraphMode.FULL_AND_PIECEWISE
    assert resolved(TorchNativeBackend) == cr.CUDAGraphMode.PIECEWISE


def test_attention_benchmark_smoke(tmp_path, monkeypatch):
    """benchmarks/attention.py runs end to end on CPU (eager torch_native; the rest say why not)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "attention.py"
    spec = importlib.util.spec_from_file_location("attention_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "attention.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--batch-sizes", "2", "--context", "40"]
    argv += ["--num-heads", "4", "--num-kv-heads", "2", "--head-size", "64", "--iters", "2"]
    records = bench.main(argv + ["--warmup", "1", "--out", str(out)])
    by_key = {(r["backend"], r.get("mode")): r for r in records}
    assert by_key[("torch_native", "eager")]["ms"] > 0
    assert "CUDA" in by_key[("torch_native", "graph")]["skipped"]
    assert "TRITON_INTERPRET" in by_key[("triton", None)]["skipped"]
    assert json.loads(out.read_text())["results"] == records


# (heads, KV heads, head size): each copy of the kernel specialised for a head shape
# (head size 64 with 1-4 query heads per KV head, 128 with 1, 2, 4), and the generic loop.
KERNEL_SHAPES = [(8, 2, 64), (9, 3, 64), (4, 2, 64), (2, 2, 64), (4, 4, 128), (4, 2, 128),
                 (8, 2, 128), (6, 3, 32), (10, 2, 64)]  # fmt: skip


@pytest.mark.parametrize("heads, kv_heads, head_size", KERNEL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_equals_torch_ops(monkeypatch, heads, kv_heads, head_size, dtype):
    """The C decode kernel (cache writes + decode attention) and the torch-op path agree;
    in bf16 the kernel sums in float32, so it is closer to the float64 reference."""
    from compile_runtime.cpu import attention as cpu_batched
    from compile_runtime.cpu import decode_kernel as cpu_decode_kernel

    assert cpu_decode_kernel.load_decode_kernel() is not None  # CI machines have a compiler
    batch = make_paged_batch(
        [1, 1, 6, 1], [70, 3, 10, 33], num_heads=heads, num_kv_heads=kv_heads,
        head_size=head_size, block_size=16, num_padding=2, seed=3, dtype=dtype,
    )  # fmt: skip
    scale = head_size**-0.5
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for window in (None, 7):  # 7: the visible keys start inside a block
        spec = AttentionSpec(heads, kv_heads, head_size, scale, sliding_window=window)
        with_kernel, cache_k = run_backend("cpu_batched", batch, spec)
        monkeypatch.setattr(cpu_batched, "load_decode_kernel", lambda: None)
        torch_ops, cache_t = run_backend("cpu_batched", batch, spec)
        monkeypatch.undo()
        assert with_kernel.dtype == dtype
        assert (with_kernel.float() - torch_ops.float()).abs().max() < tolerance
        assert torch.equal(cache_k[:, 1:], cache_t[:, 1:])
        ref = dense_reference(batch, scale, window)
        kernel_error = (with_kernel[: batch.num_actual_tokens].double() - ref).abs().max()
        assert kernel_error < tolerance
        if dtype == torch.bfloat16:  # rounding once at the end, not at every op
            ops_error = (torch_ops[: batch.num_actual_tokens].double() - ref).abs().max()
            assert kernel_error <= ops_error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_takes_speculative_verify_batches(monkeypatch, dtype):
    """1 + k query tokens a request (speculative decoding's verify step, the FULL graph's
    batch): the C kernel takes the whole uniform batch, each query seeing the keys up to its
    own position, and agrees with the torch path (SDPA, causal mask) and the reference."""
    from compile_runtime.cpu import attention as cpu_batched

    batch = make_paged_batch(
        [3, 3, 3], [70, 0, 14], num_heads=9, num_kv_heads=3, head_size=64, block_size=16,
        num_padding=3, seed=7, dtype=dtype,
    )  # fmt: skip
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for window in (None, 2, 7):
        spec = AttentionSpec(9, 3, 64, 0.125, sliding_window=window)
        with monkeypatch.context() as m:  # the kernel takes it all: no SDPA call
            m.setattr(cpu_batched.CPUBatchedImpl, "_prefill", None)
            with_kernel, cache_k = run_backend("cpu_batched", batch, spec, uniform_query_len=3)
        torch_ops, cache_t = run_backend("cpu_batched", batch, spec)  # 3 is a chunk here
        real = batch.num_actual_tokens
        assert (with_kernel[:real].float() - torch_ops[:real].float()).abs().max() < tolerance
        assert torch.equal(with_kernel[real:], torch.zeros_like(with_kernel[real:]))
        assert torch.equal(cache_k[:, 1:], cache_t[:, 1:])
        ref = dense_reference(batch, 0.125, window)
        assert (with_kernel[:real].double() - ref).abs().max() < tolerance


def test_cpu_decode_kernel_without_a_compiler_falls_back(monkeypatch, tmp_path):
    from compile_runtime.cpu import decode_kernel as cpu_decode_kernel

    cpu_decode_kernel.load_decode_kernel.cache_clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("COMPILE_RUNTIME_CACHE_DIR", str(tmp_path))
    try:
        assert cpu_decode_kernel.load_decode_kernel() is None
    finally:
        cpu_decode_kernel.load_decode_kernel.cache_clear()
    assert not any((tmp_path / ".cpu_kernels").glob("*.so"))


def test_cpu_decode_kernel_refuses_blocks_outside_the_cache():
    """The C kernel touches raw memory: a block id past the cache is an error, never a read."""
    batch = make_paged_batch([1, 1], [20, 5], num_heads=4, num_kv_heads=2, head_size=64,
                             block_size=16)  # fmt: skip
    batch.block_table[0, 0] = batch.kv_cache.shape[1] + 3
    with pytest.raises(MetadataError, match="does not belong to this cache"):
        run_backend("cpu_batched", batch, AttentionSpec(4, 2, 64, 0.125))


def test_cpu_batched_torch_path_ignores_garbage_past_a_request(monkeypatch):
    """Keys past a request's length are other requests' old data: inf there must not leak."""
    from compile_runtime.cpu import attention as cpu_batched

    monkeypatch.setattr(cpu_batched, "load_decode_kernel", lambda: None)
    batch = make_paged_batch([1, 1], [40, 3], num_heads=4, num_kv_heads=2, head_size=64,
                             block_size=16)  # fmt: skip
    short_block = int(batch.block_table[1, 0])
    batch.kv_cache[:, short_block, 8:] = float("inf")  # past request 1's 4 tokens
    out, _ = run_backend("cpu_batched", batch, AttentionSpec(4, 2, 64, 0.125))
    ref = dense_reference(batch, 0.125)
    assert torch.isfinite(out).all()
    assert (out[: batch.num_actual_tokens].double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("block_size", [8, 32, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_other_block_sizes(monkeypatch, block_size, dtype):
    """Scores are taken 16 keys at a time: blocks of fewer, more, and not a multiple of 16."""
    from compile_runtime.cpu import attention as cpu_batched
    from compile_runtime.cpu import decode_kernel as cpu_decode_kernel

    assert cpu_decode_kernel.load_decode_kernel() is not None
    batch = make_paged_batch(
        [1, 1, 1], [70, 3, 111], num_heads=9, num_kv_heads=3, head_size=64,
        block_size=block_size, seed=5, dtype=dtype,
    )  # fmt: skip
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for window, cap in ((None, None), (21, None), (None, 5.0)):
        spec = AttentionSpec(9, 3, 64, 0.125, sliding_window=window, logits_soft_cap=cap)
        with_kernel, _ = run_backend("cpu_batched", batch, spec)
        monkeypatch.setattr(cpu_batched, "load_decode_kernel", lambda: None)
        torch_ops, _ = run_backend("cpu_batched", batch, spec)
        monkeypatch.undo()
        assert (with_kernel.float() - torch_ops.float()).abs().max() < tolerance
