"""Quantized weights: GGUF Q8_0/Q4_0/Q4_1 blocks kept, the int8 kernel, int8 of
float checkpoints.

Tolerances: the kernel quantizes each row of x to int8 per block of 32, as llama.cpp does,
so against a reference that quantizes x the same way (``simulated``, exact integer sums in
float64) it agrees to float32 rounding (relative 1e-5 of the largest output); against the
float product of the dequantized weight it is off by the activations' rounding (2% of the
largest output, plain random data). Real model: greedy tokens of a short prompt equal a
dequantized-weights run for the first 16 tokens (they matched for 64 when measured).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from compile_runtime.cpu import quant_formats as qf
from compile_runtime.cpu.linear import cpu_linear_impl
from compile_runtime.cpu.packed_weights import forget
from compile_runtime.cpu.quant_embedding import quant_embedding
from compile_runtime.cpu.quant_gemm import kernel_available, quant_linear

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

TYPES = {
    qf.Q8_0: gguf.GGMLQuantizationType.Q8_0,
    qf.Q4_0: gguf.GGMLQuantizationType.Q4_0,
    qf.Q4_1: gguf.GGMLQuantizationType.Q4_1,
}
Q8_FILE = os.path.join(
    os.path.dirname(__file__), "..", "benchmarks/.peers/gguf/smollm2-135m-q8_0.gguf"
)


def _f16(a):
    return a.astype(np.float16).astype(np.float64)


def simulated(x: np.ndarray, blocks: np.ndarray, fmt) -> np.ndarray:
    """x [M, K] times GGUF blocks [N, ...], x quantized per 32 as llama.cpp does, exact sums."""
    m, k = x.shape
    nb = k // 32
    xb = x.reshape(m, nb, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    qx = np.rint(xb * inv).astype(np.int64)
    d = (amax / np.float32(127)).astype(np.float32)
    b = blocks.reshape(blocks.shape[0], nb, fmt.block_bytes)
    dw = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if fmt is qf.Q8_0:
        qw = b[:, :, 2:].view(np.int8).astype(np.int64)
    else:
        qs = b[:, :, fmt.scale_bytes :]
        qw = np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64) - (8 if fmt is qf.Q4_0 else 0)
    sums = np.einsum("mbk,nbk->mnb", qx, qw).astype(np.float64)
    out = (sums * dw[None] * _f16(d[..., 0])[:, None]).sum(-1)
    if fmt is qf.Q4_1:
        mw = b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        out += (mw[None] * _f16(d[..., 0] * qx.sum(-1))[:, None]).sum(-1)
    return out


def _weight(fmt, n, k, seed=0, packed=False):
    """GGUF blocks of a random [n, k] weight, and the weight in our row layout (or packed
    in place into the kernel's layout)."""
    rng = np.random.default_rng(seed)
    blocks = gguf_quantize(rng.standard_normal((n, k)).astype(np.float32), TYPES[fmt])
    w = torch.from_numpy(qf.from_gguf_blocks(blocks, fmt))
    if packed:
        qf.pack_rows(w)
    return blocks, w


@pytest.mark.parametrize("fmt", list(TYPES), ids=lambda f: f.name)
@pytest.mark.parametrize("k", [32, 544, 576])
@pytest.mark.parametrize("n", [5, 16, 37])  # a group of 16 rows, and groups with fewer
def test_both_layouts_dequantize_to_what_gguf_does(fmt, k, n):
    blocks, w = _weight(fmt, n, k)
    ref = gguf_dequantize(blocks, TYPES[fmt]).reshape(n, k)
    assert w.shape == (n, k // 32, fmt.block_bytes)  # the file's bytes, no more
    np.testing.assert_array_equal(qf.dequantize(w).numpy(), ref)
    before = w.clone()
    qf.pack_rows(w)
    assert qf.is_packed(w) and w.shape == before.shape
    assert n < 2 or not torch.equal(w, before)  # rearranged in place...
    np.testing.assert_array_equal(qf.dequantize(w).numpy(), ref)  # ...the same values
    qf.pack_rows(w)  # packing twice leaves it packed, not scrambled
    np.testing.assert_array_equal(qf.dequantize(w).numpy(), ref)


def test_a_weight_written_again_is_no_longer_taken_for_packed():
    blocks, w = _weight(qf.Q8_0, 16, 64, packed=True)
    rows = torch.from_numpy(qf.from_gguf_blocks(blocks, qf.Q8_0))
    w.copy_(rows)  # moves the version counter
    assert not qf.is_packed(w)
    _, w2 = _weight(qf.Q8_0, 16, 64, packed=True)
    forget(w2[4:8])  # a loader writing some rows through .data
    assert not qf.is_packed(w2)


def test_int8_quantization_of_floats_is_llama_cpps_q8_0():
    w = torch.randn(6, 96)
    ref = gguf_dequantize(gguf_quantize(w.numpy(), TYPES[qf.Q8_0]), TYPES[qf.Q8_0])
    np.testing.assert_array_equal(qf.dequantize(qf.quantize_q8_0(w)).numpy(), ref.reshape(6, 96))


@pytest.mark.skipif(not kernel_available(), reason="needs AVX512-VNNI or AVX2, and a C compiler")
@pytest.mark.parametrize("fmt", list(TYPES), ids=lambda f: f.name)
@pytest.mark.parametrize("k", [32, 544, 576])
@pytest.mark.parametrize("n", [1, 7, 33])  # groups of 16 rows and fewer
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
def test_kernel_matches_dequantized_matmul(fmt, k, n, rows):
    blocks, w = _weight(fmt, n, k, seed=rows, packed=True)
    rng = np.random.default_rng(100 + rows)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    y = quant_linear(torch.from_numpy(x), w, torch.from_numpy(bias)).numpy()
    exact = simulated(x, blocks, fmt) + bias
    dense = gguf_dequantize(blocks, TYPES[fmt]).reshape(n, k).astype(np.float64)
    plain = x.astype(np.float64) @ dense.T + bias
    assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()
    # Against the float product: within the worst case of x's rounding, half a step of
    # max|x| / 127 per element of each block.
    amax = np.repeat(np.abs(x).reshape(rows, -1, 32).max(-1), 32, axis=1)
    bound = (amax @ np.abs(dense).T) / 254 * 1.001 + 1e-4
    assert (np.abs(y - plain) <= bound).all()


@pytest.mark.skipif(not kernel_available(), reason="needs AVX512-VNNI or AVX2, and a C compiler")
@pytest.mark.parametrize("fmt", list(TYPES), ids=lambda f: f.name)
def test_kernel_in_bf16_and_through_cpu_linear(fmt):
    blocks, w = _weight(fmt, 9, 576, packed=True)
    x = torch.randn(3, 2, 576).bfloat16()  # 3-D input, bf16 in and out
    y = cpu_linear_impl(x, w, None)
    assert y.shape == (3, 2, 9) and y.dtype == torch.bfloat16
    exact = simulated(x.float().reshape(6, 576).numpy(), blocks, fmt)
    np.testing.assert_allclose(
        y.float().reshape(6, 9).numpy(), exact, rtol=1e-2, atol=1e-2 * np.abs(exact).max()
    )


def test_a_quantized_lm_head_gives_float32_logits_from_bf16_hidden_states():
    """bf16 logits tie greedy's top two often (8 mantissa bits); the kernel sums in float32."""
    from compile_runtime.distributed.vocab import ParallelLMHead

    head = ParallelLMHead(40, 64)
    _, w = _weight(qf.Q8_0, 40, 64, packed=kernel_available())
    head.weight = torch.nn.Parameter(w, requires_grad=False)
    head.use_packed_weight = True
    hidden = torch.randn(3, 64).bfloat16()
    logits = head.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, 40)
    torch.testing.assert_close(logits, quant_linear(hidden.float(), w, None), rtol=0, atol=0)


def test_an_unpacked_weight_runs_through_its_dequantized_floats():
    _, w = _weight(qf.Q4_1, 7, 64)
    x = torch.randn(3, 64)
    torch.testing.assert_close(quant_linear(x, w, None), x @ qf.dequantize(w).T)


@pytest.mark.parametrize("fmt", list(TYPES), ids=lambda f: f.name)
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_embedding_dequantizes_the_rows_looked_up(fmt, packed, dtype):
    _, w = _weight(fmt, 40, 64, packed=packed)  # 40 rows: two groups of 16 and one of 8
    ids = torch.tensor([[3, 0], [39, 3], [17, 32]])
    rows = quant_embedding(ids, w, dtype)
    assert rows.shape == (3, 2, 64) and rows.dtype == dtype
    torch.testing.assert_close(rows, qf.dequantize(w, dtype)[ids], rtol=0, atol=0)
    with pytest.raises(IndexError):
        quant_embedding(torch.tensor([40]), w, dtype)


# ---- the real model ------------------------------------------------------------------------


def _real(path: str, quantization: str, dtype=torch.float32):
    from compile_runtime.config import CompilationConfig
    from compile_runtime.models.gguf import model_directory
    from compile_runtime.models.registry import load_model

    config = CompilationConfig(backend="eager")
    return load_model(model_directory(path), config, dtype=dtype, quantization=quantization)


def _file_tensor_bytes(path: str) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # ties counted once


@pytest.fixture(scope="module")
def q4_1_file():
    from compile_runtime.models.smollm2 import smollm2_gguf

    try:
        return smollm2_gguf()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the real model is not here: {e}")


def test_real_q4_1_loads_quantized_within_the_files_bytes(q4_1_file):
    model = _real(q4_1_file, "gguf")
    layer = model.model.layers[0]
    assert qf.format_of(layer.self_attn.qkv_proj.weight) is qf.Q4_1
    assert qf.format_of(layer.mlp.down_proj.weight) is qf.Q4_1
    assert qf.format_of(model.model.embed_tokens.weight) is qf.Q8_0  # as the file has it
    assert (
        model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.use_packed_weight
    )
    assert _weight_bytes(model) <= 1.1 * _file_tensor_bytes(q4_1_file)
    # Rows unpermuted, parts fused in place: the blocks dequantize to the dequantized load.
    plain = _real(q4_1_file, "none")
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        ours = qf.dequantize(layer.get_submodule(name).weight)
        torch.testing.assert_close(
            ours, plain.model.layers[0].get_submodule(name).weight, rtol=0, atol=0
        )


def _greedy(path: str, quantization: str, n: int = 16, **options) -> list[int]:
    import compile_runtime as cr

    llm = cr.LLM(
        path,
        {"backend": "eager"},
        dtype="bfloat16",
        quantization=quantization,
        max_num_seqs=2,
        max_model_len=256,
        kv_cache_bytes=64 * 2**20,
        **options,
    )
    params = cr.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


@pytest.mark.skipif(not kernel_available(), reason="needs AVX512-VNNI or AVX2, and a C compiler")
@pytest.mark.parametrize("which", ["q4_1", "q8_0"])
def test_real_model_greedy_tokens_equal_the_dequantized_run(which, q4_1_file):
    path = q4_1_file if which == "q4_1" else Q8_FILE
    if not os.path.exists(path):
        pytest.skip(f"{path} is not here (benchmarks/peers/install.py makes it)")
    assert _greedy(path, "gguf") == _greedy(path, "none")


# ---- int8 of a float checkpoint, compiled pieces, the cache key ----------------------------


def _tiny_tokens(model_dir: str, backend: str, quantization: str) -> list[int]:
    import compile_runtime as cr

    llm = cr.LLM(
        model_dir,
        {"backend": backend, "compile_sizes": []},
        dtype="float32",
        quantization=quantization,
        max_num_seqs=2,
        max_model_len=64,
        kv_cache_bytes=8 * 2**20,
    )
    params = cr.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)
    model = llm.runner.model
    assert (qf.format_of(model.model.layers[0].mlp.down_proj.weight) is qf.Q8_0) == (
        quantization == "int8"
    )
    return list(out.outputs[0].token_ids)


@pytest.mark.skipif(not kernel_available(), reason="needs AVX512-VNNI or AVX2, and a C compiler")
def test_int8_runs_in_eager_and_inductor_pieces(model_dirs):
    model_dir = model_dirs("llama", tie_word_embeddings=True)
    eager = _tiny_tokens(model_dir, "eager", "int8")
    assert _tiny_tokens(model_dir, "inductor", "int8") == eager
    # int8 of random weights: close to float, not equal; the first tokens agree.
    assert _tiny_tokens(model_dir, "eager", "none")[:2] == eager[:2]


def test_cache_key_differs_between_quantized_and_dequantized(model_dirs):
    from compile_runtime.compiler.decorator import trace_key_factors
    from compile_runtime.compiler.saved_program import model_fingerprint
    from compile_runtime.config import CompilationConfig
    from compile_runtime.models.registry import load_model

    model_dir = model_dirs("llama", tie_word_embeddings=True)
    factors, prints = [], []
    for quantization in ("none", "int8"):
        model = load_model(model_dir, CompilationConfig(backend="eager"), quantization=quantization)
        prints.append(model_fingerprint(model))
        ids = torch.tensor([1, 2, 3])
        factors.append(trace_key_factors(model.model, ids, torch.arange(3)))
    assert prints[0] != prints[1]  # the saved program's key
    assert [f["graph"] for f in factors[0]] != [f["graph"] for f in factors[1]]  # the pieces'


def test_quantization_option_errors(model_dirs):
    from compile_runtime.models.registry import resolve_quantization

    model_dir = model_dirs("llama")
    with pytest.raises(ValueError, match="needs a GGUF file"):
        resolve_quantization("gguf", model_dir, torch.device("cpu"), True)
    with pytest.raises(ValueError, match="not one of"):
        resolve_quantization("q3", model_dir, torch.device("cpu"), True)
    assert resolve_quantization("auto", model_dir, torch.device("cpu"), True) == "none"
    assert resolve_quantization("int8", model_dir, torch.device("cuda"), True) == "none"


def test_a_cpu_without_the_kernel_dequantizes_at_load(model_dirs, q4_1_file, monkeypatch, caplog):
    """Not through the dequantized weight at every call (~50x slower): once, at load."""
    from compile_runtime.models import registry
    from compile_runtime.models.gguf import gguf_model_dir

    monkeypatch.setattr(registry, "quant_kernel_available", lambda: False)
    cpu = torch.device("cpu")
    with caplog.at_level("WARNING", logger=registry.__name__):
        assert registry.resolve_quantization("auto", gguf_model_dir(q4_1_file), cpu, True) == "none"
        assert registry.resolve_quantization("int8", model_dirs("llama"), cpu, True) == "none"
    assert caplog.text.count("no quantized kernel") == 2


def test_gguf_blocks_shard_by_rows_and_whole_blocks_of_inputs(q4_1_file):
    from compile_runtime.models.gguf import GGUFError, gguf_tensors

    tensors = dict(gguf_tensors(q4_1_file))
    down = tensors["model.layers.0.mlp.down_proj.weight"]  # [576, 1536]
    whole = qf.dequantize(down.read_quantized())
    torch.testing.assert_close(qf.dequantize(down.read_quantized(0, 64, 128)), whole[64:192])
    torch.testing.assert_close(qf.dequantize(down.read_quantized(1, 768, 768)), whole[:, 768:])
    with pytest.raises(GGUFError, match="whole blocks of 32"):
        down.read_quantized(1, 0, 48)  # tensor_parallel_size=32: 48 inputs a rank
    q = tensors["model.layers.0.self_attn.q_proj.weight"]  # rows unpermuted as blocks
    torch.testing.assert_close(qf.dequantize(q.read_quantized()), q.read(), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.skipif(not kernel_available(), reason="needs AVX512-VNNI or AVX2, and a C compiler")
def test_int8_tensor_parallel_matches_one_rank(model_dirs):
    import compile_runtime as cr

    model_dir = model_dirs("llama", tie_word_embeddings=True)
    params = cr.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 30))]
    tokens = []
    for tp in (1, 2):
        llm = cr.LLM(
            model_dir,
            {"mode": "NONE"},
            dtype="float32",
            quantization="int8",
            tensor_parallel_size=tp,
            max_num_seqs=2,
            max_num_batched_tokens=64,
        )
        try:
            tokens.append(
                [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            )
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1]
