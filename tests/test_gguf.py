"""GGUF files in: names, layouts and errors, on files written here (the real one: test_real_model)."""

from __future__ import annotations

import numpy as np
import pytest

import compile_runtime as cr
from compile_runtime.models.gguf import (
    GGUFError,
    gguf_model_dir,
    gguf_tensors,
    hf_name,
    model_directory,
    unpermute_rotary,
)


def permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written from its description)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path, arch: str, tensors: dict[str, np.ndarray], heads: int = 2, kv: int = 1):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize(
    "gguf_name, expected",
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.11.attn_k.bias", "model.layers.11.self_attn.k_proj.bias"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.3.attn_k_norm.weight", "model.layers.3.self_attn.k_norm.weight"),
        ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
        ("blk.7.ffn_norm.weight", "model.layers.7.post_attention_layernorm.weight"),
    ],
)
def test_tensor_names_map_to_hugging_face_names(gguf_name, expected):
    assert hf_name(gguf_name) == expected


def test_an_unknown_tensor_is_an_error_naming_it():
    with pytest.raises(GGUFError, match="rope_freqs.weight"):
        hf_name("rope_freqs.weight")


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_undoes_llama_cpp_rotary_row_order(heads):
    w = np.arange(heads * 64 * 5, dtype=np.float32).reshape(heads * 64, 5)
    assert np.array_equal(unpermute_rotary(permute_like_llama_cpp(w, heads), heads), w)
    assert not np.array_equal(permute_like_llama_cpp(w, heads), w)


def test_llama_q_and_k_are_unpermuted_with_their_own_head_counts(tmp_path):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, 8)).astype(np.float32) for n in (8, 4, 4))
    path = write_gguf(
        tmp_path / "m.gguf",
        "llama",
        {
            "blk.0.attn_q.weight": permute_like_llama_cpp(q, 2),
            "blk.0.attn_k.weight": permute_like_llama_cpp(k, 1),
            "blk.0.attn_v.weight": v,
        },
    )
    got = {name: t.read().numpy() for name, t in gguf_tensors(path)}
    assert np.array_equal(got["model.layers.0.self_attn.q_proj.weight"], q)
    assert np.array_equal(got["model.layers.0.self_attn.k_proj.weight"], k)
    assert np.array_equal(got["model.layers.0.self_attn.v_proj.weight"], v)  # never permuted


def test_qwen2_rows_are_read_as_stored(tmp_path):
    q = np.arange(32, dtype=np.float32).reshape(4, 8)
    path = write_gguf(tmp_path / "q.gguf", "qwen2", {"blk.0.attn_q.weight": q})
    ((name, tensor),) = list(gguf_tensors(path))
    assert name == "model.layers.0.self_attn.q_proj.weight"
    assert np.array_equal(tensor.read().numpy(), q)
    assert tensor.shape == (4, 8)


def test_an_unsupported_architecture_is_a_clear_error(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 4))})
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported.*llama"):
        gguf_model_dir(path, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(GGUFError, match="gpt2"):
        cr.LLM(path)


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        gguf_model_dir(str(bad), cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / ".gguf").exists() or not any(
        p.name.startswith("broken") for p in (tmp_path / "cache" / ".gguf").iterdir()
    )


def test_model_names_that_are_neither_directory_nor_gguf(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="not a .gguf file"):
        model_directory(str(other))
    with pytest.raises(FileNotFoundError, match="does not exist.*gguf"):
        cr.LLM(str(tmp_path / "missing"))


def test_the_fast_index_reads_what_gguf_reader_reads(tmp_path):
    """gguf_index (the warm start's reader) against gguf's own, on every field kind and a
    quantized, a float and an integer tensor."""
    import gguf

    from compile_runtime.models.gguf_index import read_index

    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_head_count(2)
    writer.add_rope_freq_base(10000.5)
    writer.add_name("tiny")
    writer.add_token_list(["<s>", "a", "bb", "ccc"] * 50)
    writer.add_token_scores([0.5] * 200)
    q8 = gguf.quants.quantize(np.random.RandomState(0).randn(4, 64).astype(np.float32), 8)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", np.arange(24, dtype=np.float32).reshape(4, 6))
    writer.add_tensor("ids", np.arange(5, dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index, reader = read_index(path), gguf.GGUFReader(path)
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape.tolist() == theirs.shape.tolist()
        assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and not isinstance(field.contents(), list):
            assert index.values[key] == pytest.approx(field.contents()), key
    assert "tokenizer.ggml.tokens" in index.values  # an array: listed, not read


@pytest.mark.parametrize("keep", [3, 10, 40, 200, -100])
def test_a_truncated_file_is_one_gguf_error(tmp_path, keep):
    from compile_runtime.models.gguf import gguf_tensors

    whole = write_gguf(tmp_path / "w.gguf", "llama", {"token_embd.weight": np.ones((64, 8))})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(whole, "rb").read()[:keep])
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        list(gguf_tensors(str(cut)))
