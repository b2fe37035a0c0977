"""Untrusted model files, damaged at random: every reader gives one error line naming the file.

GGUF files (header counts, lengths, value types, tensor tables, truncation), safetensors
headers, and a model directory's JSON files. Each property runs all its examples in a forked
child with at most 2 GiB more address space than this process and a time limit, so a crash in
C, a hang or a huge allocation fails the test instead of taking pytest down.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import struct
import traceback

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compile_runtime.models import gguf as gguf_files
from compile_runtime.models.gguf import GGUFError, gguf_tensors, release_readers
from compile_runtime.models.loader import ModelFileError, WeightLoadingError, iterate_checkpoint
from compile_runtime.models.registry import read_hf_config
from compile_runtime.models.tokenizer import eos_token_ids, load_tokenizer


def examples(n: int) -> settings:
    """``n`` examples, the same every run (a failure reproduces), no time limit per example."""
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )


TIME_LIMIT_S = 120


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def isolated(prop) -> None:
    """Run ``prop`` in a forked child under the memory and time limits; its failure, or its
    death by a signal, fails the test with the child's traceback or exit code."""
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)

    def child() -> None:
        limit = _vm_bytes() + (2 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            prop()
            writer.send(None)
        except BaseException:
            writer.send(traceback.format_exc())

    process = ctx.Process(target=child)
    process.start()
    process.join(TIME_LIMIT_S)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail(f"{prop.__name__} hung: still running after {TIME_LIMIT_S} s")
    assert process.exitcode == 0, f"{prop.__name__}: the child died (exit {process.exitcode})"
    assert reader.poll(), f"{prop.__name__}: the child sent no result"
    error = reader.recv()
    assert error is None, error


def expect_clean(read, error_type: type, path: str) -> None:
    """``read()`` succeeds (a harmless change), or raises ``error_type`` in one line naming
    ``path``; any other exception propagates and fails the property."""
    try:
        read()
    except error_type as e:
        message = str(e)
        assert "\n" not in message, f"a multi-line error: {message!r}"
        assert path in message, f"the error does not name {path}: {message!r}"


# ---- GGUF ----------------------------------------------------------------------------------


def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def build_gguf() -> tuple[bytes, dict[str, tuple[int, str]]]:
    """A small llama GGUF v3 file (F32, F16, Q8_0, Q4_0 tensors, string and float arrays), and
    where each header field lies: name -> (offset, struct format)."""
    import gguf

    q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    tensors = [
        ("blk.0.attn_q.weight", q.F32, rng.standard_normal((4, 8)).astype(np.float32)),
        ("blk.0.attn_k.weight", q.F16, rng.standard_normal((2, 8)).astype(np.float16)),
        ("blk.0.attn_v.weight", q.Q8_0, gguf.quants.quantize(rng.standard_normal((4, 64)), q.Q8_0)),
        ("blk.0.ffn_up.weight", q.Q4_0, gguf.quants.quantize(rng.standard_normal((2, 32)), q.Q4_0)),
    ]
    metadata = [
        ("general.architecture", 8, "llama"),
        ("llama.attention.head_count", 4, 2),
        ("llama.attention.head_count_kv", 4, 1),
        ("general.alignment", 4, 32),
        ("tokenizer.ggml.tokens", 9, (8, ["a", "bb", "ccc"])),
        ("tokenizer.ggml.scores", 9, (6, [0.5, 0.25, 0.125])),
    ]
    out, fields = bytearray(b"GGUF"), {}

    def put(name: str | None, fmt: str, value) -> None:
        if name:
            fields[name] = (len(out), fmt)
        out.extend(struct.pack(fmt, value))

    def put_string(name: str, text: str) -> None:
        fields[name] = (len(out), "<Q")
        out.extend(_gguf_string(text))

    put("version", "<I", 3)
    put("tensor count", "<Q", len(tensors))
    put("metadata count", "<Q", len(metadata))
    for key, kind, value in metadata:
        put_string(f"{key} key length", key)
        put(f"{key} value type", "<I", kind)
        if kind == 8:
            put_string(f"{key} length", value)
        elif kind == 4:
            put(f"{key} value", "<I", value)
        else:
            item, items = value
            put(f"{key} item type", "<I", item)
            put(f"{key} array length", "<Q", len(items))
            for i, v in enumerate(items):
                put_string(f"{key}[{i}] length", v) if item == 8 else put(None, "<f", v)
    offset, blobs = 0, []
    for name, kind, data in tensors:
        put_string(f"{name} name length", name)
        shape = list(data.shape)
        if data.dtype == np.uint8:  # quantized blocks: the row length in values, not bytes
            block, size = gguf.GGML_QUANT_SIZES[kind]
            shape[-1] = shape[-1] // size * block
        put(f"{name} n_dims", "<I", len(shape))
        for i, dim in enumerate(reversed(shape)):
            put(f"{name} dim {i}", "<Q", dim)
        put(f"{name} type", "<I", int(kind))
        put(f"{name} offset", "<Q", offset)
        blob = data.tobytes() + b"\0" * (-data.nbytes % 32)
        blobs.append(blob)
        offset += len(blob)
    out.extend(b"\0" * (-len(out) % 32))
    for blob in blobs:
        out.extend(blob)
    return bytes(out), fields


def read_gguf_everything(path: str) -> None:
    """What the engine does with a GGUF file: its header through GGUFReader (the model
    directory), then every tensor through the index, dequantized and in kept blocks."""
    release_readers()
    gguf_files._reader(path)
    for _, tensor in gguf_tensors(path):
        tensor.read()
        if tensor.quant_format is not None:
            tensor.read_quantized()


@pytest.fixture(scope="module")
def gguf_file():
    raw, fields = build_gguf()
    return raw, fields


BIG = [0, 1, 2, 3, 7, 31, 33, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1]
HUGE = [2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


def test_the_synthetic_gguf_file_reads(tmp_path, gguf_file):
    path = str(tmp_path / "m.gguf")
    with open(path, "wb") as f:
        f.write(gguf_file[0])
    read_gguf_everything(path)
    got = {name: t.read().shape for name, t in gguf_tensors(path)}
    assert got["model.layers.0.mlp.up_proj.weight"] == (2, 32)


def test_gguf_header_fields_set_to_any_value(tmp_path, gguf_file):
    """Counts, lengths, value types, dims, tensor types, offsets, alignment: each set to an
    edge value, a huge one or any other."""
    raw, fields = gguf_file
    path = str(tmp_path / "field.gguf")

    @examples(400)
    @given(
        st.sampled_from(sorted(fields)),
        st.one_of(st.sampled_from(BIG + HUGE), st.integers(0, 2**64 - 1)),
    )
    def prop(field, value):
        offset, fmt = fields[field]
        data = bytearray(raw)
        struct.pack_into(fmt, data, offset, value % (1 << (8 * struct.calcsize(fmt))))
        with open(path, "wb") as f:
            f.write(data)
        expect_clean(lambda: read_gguf_everything(path), GGUFError, path)

    isolated(prop)


def test_gguf_cut_short_anywhere(tmp_path, gguf_file):
    raw, _ = gguf_file
    path = str(tmp_path / "cut.gguf")

    @examples(150)
    @given(st.integers(0, len(raw) - 1))
    def prop(length):
        with open(path, "wb") as f:
            f.write(raw[:length])
        expect_clean(lambda: read_gguf_everything(path), GGUFError, path)

    isolated(prop)


def test_gguf_bytes_overwritten_at_random(tmp_path, gguf_file):
    raw, _ = gguf_file
    path = str(tmp_path / "bytes.gguf")

    @examples(250)
    @given(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.binary(min_size=1, max_size=8))))
    def prop(writes):
        data = bytearray(raw)
        for offset, chunk in writes:
            data[offset : offset + len(chunk)] = chunk
        with open(path, "wb") as f:
            f.write(data)
        expect_clean(lambda: read_gguf_everything(path), GGUFError, path)

    isolated(prop)


def test_gguf_arrays_nested_past_any_sense_are_an_error(tmp_path, gguf_file):
    """An array of arrays 5000 deep: a clear error, not Python's recursion limit."""
    raw, fields = gguf_file
    start, _ = fields["tokenizer.ggml.tokens item type"]
    nested = b"".join(struct.pack("<IQ", 9, 1) for _ in range(5000)) + struct.pack("<IQ", 0, 0)
    path = str(tmp_path / "deep.gguf")
    with open(path, "wb") as f:
        f.write(raw[:start] + nested + raw[start:])
    with pytest.raises(GGUFError, match=r"deep\.gguf.*tokenizer\.ggml\.tokens.*nested deeper"):
        read_gguf_everything(path)


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("tensor count", 2**63, "tensor count.*claims more than"),
        ("metadata count", 2**40, "metadata count.*claims more than"),
        ("general.architecture length", 2**64 - 1, "general.architecture.*claims more than"),
        ("tokenizer.ggml.tokens array length", 2**62, "tokenizer.ggml.tokens.*claims more"),
        ("tokenizer.ggml.scores item type", 77, "tokenizer.ggml.scores.*unknown item type 77"),
        ("general.alignment value", 0, "general.alignment is 0"),
        ("blk.0.attn_k.weight n_dims", 9, "blk.0.attn_k.weight has 9 dimensions"),
        ("blk.0.attn_k.weight dim 1", 2**62, "blk.0.attn_k.weight.*past the file"),
        ("blk.0.ffn_up.weight dim 0", 2**63 + 1, "blk.0.ffn_up.weight.*not whole blocks"),
        ("blk.0.ffn_up.weight dim 1", 2**61, "blk.0.ffn_up.weight.*past the file"),
        ("blk.0.attn_v.weight type", 99, "blk.0.attn_v.weight has unknown type 99"),
        ("blk.0.attn_q.weight offset", 2**63, "blk.0.attn_q.weight.*past the file"),
        ("llama.attention.head_count value", 3, "blk.0.attn_q.weight has 4 rows.*3 attention"),
    ],
)
def test_each_damaged_gguf_field_is_named(tmp_path, gguf_file, field, value, named):
    raw, fields = gguf_file
    offset, fmt = fields[field]
    data = bytearray(raw)
    struct.pack_into(fmt, data, offset, value)
    path = str(tmp_path / "named.gguf")
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(GGUFError, match=named):
        read_gguf_everything(path)


# ---- safetensors ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def safetensors_bytes() -> bytes:
    import torch
    from safetensors.torch import save

    return save({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.float16)})


def _read_checkpoint(model_dir: str) -> None:
    for _, tensor in iterate_checkpoint(model_dir):
        tensor.read()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


def test_safetensors_headers_damaged_any_way(tmp_path, safetensors_bytes):
    """The 8-byte length, the JSON header (replaced, a field changed, cut), the data cut."""
    raw = safetensors_bytes
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    path = str(tmp_path / "model.safetensors")

    def entry_changed(name, key, value):
        return {**header, name: {**header[name], key: value}}

    headers = st.one_of(
        json_values.map(lambda v: json.dumps(v).encode()),
        st.builds(
            entry_changed,
            st.sampled_from(["a", "b"]),
            st.sampled_from(["dtype", "shape", "data_offsets"]),
            json_values | st.lists(st.integers(-1, 2**64), max_size=3),
        ).map(lambda h: json.dumps(h).encode()),
        st.integers(0, n).map(lambda cut: raw[8 : 8 + cut]),
    )

    @examples(200)
    @given(headers, st.one_of(st.none(), st.sampled_from(HUGE), st.integers(0, 2**64 - 1)),
           st.integers(0, len(body)))  # fmt: skip
    def prop(new_header, length, body_length):
        size = len(new_header) if length is None else length
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", size) + new_header + body[:body_length])
        expect_clean(lambda: _read_checkpoint(str(tmp_path)), WeightLoadingError, path)

    isolated(prop)


def test_a_weight_map_naming_a_path_outside_the_directory(tmp_path, safetensors_bytes):
    (tmp_path / "model.safetensors").write_bytes(safetensors_bytes)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    with pytest.raises(ModelFileError, match="weight_map names '../../etc/passwd'"):
        _read_checkpoint(str(tmp_path))


# ---- a model directory's JSON files --------------------------------------------------------


def _copy_dir(src: str, dst: str) -> str:
    """``src``'s files as links, but its JSON files as copies (the property rewrites them)."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        link = os.path.join(dst, name)
        if name.endswith(".json"):
            shutil.copy(os.path.join(src, name), link)
        elif not os.path.exists(link):
            os.symlink(os.path.join(src, name), link)
    return dst


def _read_model_dir(model_dir: str) -> None:
    """What the engine reads of a model directory before any tensor: config, tokenizer, EOS."""
    config = read_hf_config(model_dir)
    eos_token_ids(model_dir, config, load_tokenizer(model_dir, config))


CONFIG_FIELDS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "eos_token_id",
    "rms_norm_eps",
    "model_type",
    "rope_theta",
    "tie_word_embeddings",
]
field_values = st.one_of(
    json_values,
    st.sampled_from([-1, 0, 10**12, 2**31, 2**63, 1e12, "x", [], {}]),
)


@pytest.mark.parametrize(
    "file, fields",
    [
        ("config.json", CONFIG_FIELDS),
        ("generation_config.json", ["eos_token_id", "bos_token_id", "max_length"]),
        ("tokenizer_config.json", ["eos_token", "model_max_length", "tokenizer_class"]),
        ("tokenizer.json", ["model", "added_tokens", "pre_tokenizer", "decoder"]),
    ],
)
def test_model_dir_json_fields_of_any_value(model_dirs, tmp_path, file, fields):
    model_dir = _copy_dir(model_dirs("llama"), str(tmp_path / "m"))
    path = os.path.join(model_dir, file)
    with open(path) as f:
        original = json.load(f)

    @examples(40)
    @given(st.sampled_from(fields), field_values)
    def prop(field, value):
        with open(path, "w") as f:
            json.dump({**original, field: value}, f)
        expect_clean(lambda: _read_model_dir(model_dir), ModelFileError, model_dir)

    isolated(prop)


@pytest.mark.parametrize(
    "file", ["config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"]
)
def test_model_dir_json_text_damaged(model_dirs, tmp_path, file):
    """The file cut anywhere, replaced by any JSON value, or nested 100000 deep."""
    model_dir = _copy_dir(model_dirs("llama"), str(tmp_path / "m"))
    path = os.path.join(model_dir, file)
    with open(path) as f:
        original = f.read()
    texts = st.one_of(
        st.integers(0, len(original) - 1).map(lambda cut: original[:cut]),
        json_values.map(json.dumps),
        st.just('{"a": ' + "[" * 100000 + "]" * 100000 + "}"),
    )

    @examples(25)
    @given(texts)
    def prop(text):
        with open(path, "w") as f:
            f.write(text)
        expect_clean(lambda: _read_model_dir(model_dir), ModelFileError, path)

    isolated(prop)


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("num_hidden_layers", "x", "num_hidden_layers"),
        ("vocab_size", -1, "vocab_size is -1"),
        ("hidden_size", 1e12, "hidden_size"),
        ("hidden_size", 10**12, "hidden_size=1000000000000.*does not belong to these weights"),
        ("max_position_embeddings", 10**15, "max_position_embeddings is 10{15}"),
    ],
)
def test_config_sizes_are_checked_before_any_tensor(model_dirs, tmp_path, field, value, named):
    model_dir = _copy_dir(model_dirs("llama"), str(tmp_path / "m"))
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, field: value}, f)
    with pytest.raises(ModelFileError, match=f"config.json: .*{named}"):
        read_hf_config(model_dir)
