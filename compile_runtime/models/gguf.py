"""GGUF files in: ``cr.LLM("model.gguf")`` runs a llama.cpp checkpoint.

A GGUF file holds everything a model directory does. Its config, tokenizer
and chat template are read once by transformers (which knows the GGUF keys)
and written to a small directory in the cache (``config.json``,
``generation_config.json``, tokenizer files, and a link to the file), so every
part of the engine that reads a model directory reads this one; nothing of
the weights is copied. The weights are read from the file itself with the
``gguf`` package and dequantized tensor by tensor when the loader asks
(``GGUFTensor.read``), to the model's dtype. The quantized blocks stay
available there (``raw``) for a later quantized path.

llama.cpp's converter renames every tensor and, for the Llama architecture,
interleaves the rows of q and k for its rotary layout; ``gguf_tensors``
undoes both, so the loader sees the Hugging Face names and layouts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from compile_runtime.cache.location import cache_root
from compile_runtime.cpu.quant_formats import BLOCK, QuantFormat, from_gguf_blocks
from compile_runtime.cpu.quant_formats import BY_NAME as QUANT_FORMATS
from compile_runtime.models.gguf_index import GGUFIndex, read_index

GGUF_LINK = "model.gguf"  # the file inside a materialized directory
SOURCE_FILE = "gguf_source.json"
# general.architecture -> whether q/k rows were permuted for llama.cpp's rotary layout.
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}

_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_NAME = re.compile(r"(\w+)\.(weight|bias)$")
# Token ids that end a turn, besides EOS (Llama 3's <|eot_id|>, <|eom_id|>).
_STOP_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


class GGUFError(ValueError):
    """A GGUF file this engine cannot run (the message names the architecture or tensor)."""


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    m = _LAYER_NAME.match(gguf_name)
    if m and m.group(2) in _LAYER_PARTS:
        return f"model.layers.{m.group(1)}.{_LAYER_PARTS[m.group(2)]}.{m.group(3)}"
    m = _TOP_NAME.match(gguf_name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.{m.group(2)}"
    raise GGUFError(
        f"GGUF tensor {gguf_name!r} has no counterpart in our models (known: token_embd, "
        f"output_norm, output and blk.N.{{{', '.join(sorted(_LAYER_PARTS))}}}); "
        "this file needs a feature we do not implement yet"
    )


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head it stores pairs (i, i + d/2) side by side."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _unreadable(path: str, e: BaseException, what: str = "") -> GGUFError:
    """One line for a damaged file: which file, what in it, and the fix."""
    detail = " ".join(str(e).split())[:300]  # a library's message may span lines
    return GGUFError(
        f"{path} is not a readable GGUF file: {what}{detail} ({type(e).__name__}); it is "
        "truncated or damaged: download or convert it again"
    )


def _reader(path: str):
    """``gguf.GGUFReader``, after ``read_index`` has checked the header (its errors name the
    field; GGUFReader's are numpy's own)."""
    try:
        import gguf
    except ImportError as e:
        raise GGUFError("reading GGUF files needs the gguf package: pip install gguf") from e
    try:
        read_index(path)
        return gguf.GGUFReader(path)
    except Exception as e:  # a truncated or foreign file: numpy/struct errors of all kinds
        raise _unreadable(path, e) from None


def _field(reader, key: str) -> Any:
    if isinstance(reader, GGUFIndex):
        return reader.values.get(key)
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def architecture(reader, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: "
            f"{sorted(ARCHITECTURES)}); convert the original checkpoint to safetensors and "
            "run the model directory, which the transformers adapter can run"
        )
    return arch


class GGUFTensor:
    """One tensor of a GGUF file under its Hugging Face name: dequantized on ``read``, or
    kept in its quantized blocks by ``read_quantized`` (Q8_0, Q4_0, Q4_1)."""

    def __init__(self, name: str, tensor: Any, rotary_heads: int | None, path: str):
        self.name = name
        self.raw = tensor  # gguf's ReaderTensor: quantized blocks, type, shape
        self.shape = tuple(int(d) for d in reversed(tensor.shape))
        self._rotary_heads = rotary_heads
        self._path = path
        if rotary_heads and self.shape[0] % (2 * rotary_heads):
            raise GGUFError(
                f"{path}: tensor {tensor.name} has {self.shape[0]} rows, not pairs for each of "
                f"its {rotary_heads} attention heads (the file's head count); the file is "
                "damaged: download or convert it again"
            )

    def _failed(self, e: Exception) -> GGUFError:
        what = f"tensor {self.raw.name} ({self.type_name}, shape {self.shape}): "
        return _unreadable(self._path, e, what)

    @property
    def type_name(self) -> str:
        """GGUF's name of the stored type: ``Q8_0``, ``Q4_1``, ``F32``, ``Q6_K``, ..."""
        return self.raw.tensor_type.name

    @property
    def quant_format(self) -> QuantFormat | None:
        """The format ``read_quantized`` keeps (a 2-D Q8_0/Q4_0/Q4_1 tensor), else None."""
        return QUANT_FORMATS.get(self.type_name) if len(self.shape) == 2 else None

    def read(self) -> torch.Tensor:
        from gguf.quants import dequantize

        try:  # numpy's errors on a table that GGUFReader let through (an empty dim, ...)
            w = dequantize(self.raw.data, self.raw.tensor_type).reshape(self.shape)
        except (ValueError, NotImplementedError) as e:
            raise self._failed(e) from None
        if self._rotary_heads:
            w = unpermute_rotary(w, self._rotary_heads)
        # A copy: float tensors come back as views of the read-only memory map.
        return torch.from_numpy(np.array(w, dtype=np.float32))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows ``[start, start + length)`` along ``dim`` (the whole tensor is dequantized)."""
        return self.read().narrow(dim, start, length).contiguous()

    def read_quantized(self, dim: int | None = None, start: int = 0, length: int = 0):
        """The quantized weight in the kernels' layout (``compile_runtime/cpu/quant_formats.py``),
        ``uint8`` [N, K / 32, block bytes]; with ``dim``, only ``[start, start + length)``
        along it: rows (dim 0), or inputs in whole blocks of 32 (dim 1)."""
        fmt = self.quant_format
        if fmt is None:
            raise GGUFError(f"{self.name} is {self.type_name}, not a kept quantized type")
        try:
            blocks = np.asarray(self.raw.data).reshape(self.shape[0], -1, fmt.block_bytes)
        except ValueError as e:
            raise self._failed(e) from None
        if self._rotary_heads:  # whole rows move: their blocks stay as they are
            blocks = unpermute_rotary(blocks, self._rotary_heads)
        if dim == 0:
            blocks = blocks[start : start + length]
        elif dim == 1:
            if start % BLOCK or length % BLOCK:
                raise GGUFError(
                    f"{self.name} ({fmt.name}): a slice of inputs [{start}, {start + length}) "
                    f"is not in whole blocks of {BLOCK}; use a tensor_parallel_size that "
                    f"splits {self.shape[1]} inputs into multiples of {BLOCK}, or "
                    'quantization="none"'
                )
            blocks = blocks[:, start // BLOCK : (start + length) // BLOCK]
        return torch.from_numpy(from_gguf_blocks(blocks, fmt))


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, size: int, mtime_ns: int):
    """The file's tensor table (``gguf_index``: milliseconds), or ``GGUFReader`` where that
    cannot read it (another version or byte order)."""
    try:
        index = read_index(path)
    except ImportError:
        return _reader(path)  # which names the missing package
    except (ValueError, OSError) as e:
        raise _unreadable(path, e) from None
    return index if index is not None else _reader(path)


def release_readers() -> None:
    """Drop the parsed files ``gguf_tensors`` keeps (and their memory maps): after loading."""
    _cached_reader.cache_clear()


def gguf_tensors(path: str) -> Iterator[tuple[str, GGUFTensor]]:
    """Every tensor of the file, renamed and laid out as the Hugging Face checkpoint has it.

    The parsed table is kept for the next call (the quantization plan and the weight loader
    both walk it)."""
    st = os.stat(path)
    reader = _cached_reader(os.path.realpath(path), st.st_size, st.st_mtime_ns)
    arch = architecture(reader, path)
    heads = _head_count(reader, path, f"{arch}.attention.head_count", None)
    kv_heads = _head_count(reader, path, f"{arch}.attention.head_count_kv", heads)
    for tensor in reader.tensors:
        try:
            name = hf_name(tensor.name)
        except GGUFError as e:  # which file holds it
            raise GGUFError(f"{path}: {e}") from None
        rotary_heads = None
        if ARCHITECTURES[arch] and name.endswith(("q_proj.weight", "q_proj.bias")):
            rotary_heads = heads
        elif ARCHITECTURES[arch] and name.endswith(("k_proj.weight", "k_proj.bias")):
            rotary_heads = kv_heads
        yield name, GGUFTensor(name, tensor, rotary_heads, path)


def _head_count(reader, path: str, key: str, default: int | None) -> int | None:
    """A head count of the file: a positive integer (it reshapes q and k), else an error."""
    value = _field(reader, key)
    if value is None or value == 0:
        return default
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise GGUFError(
            f"{path}: {key} is {value!r}, not a head count; the file is damaged: download or "
            "convert it again"
        )
    return int(value)


def gguf_file_in(model_dir: str) -> str | None:
    """The GGUF file of a directory made by ``gguf_model_dir``, or None."""
    path = os.path.join(model_dir, GGUF_LINK)
    return path if os.path.exists(path) else None


def _source_key(path: str) -> str:
    import transformers

    st = os.stat(path)
    what = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return hashlib.blake2b(what.encode(), digest_size=12).hexdigest()


def gguf_model_dir(path: str, cache_dir: str | None = None) -> str:
    """A model directory for the GGUF file at ``path``: made once, then found again.

    Keyed by the file's real path, size, modification time and the transformers
    version that read it; written to a temporary directory and renamed, so a
    crash never leaves a half-made directory under the key.
    """
    path = os.path.abspath(path)
    root = os.path.join(cache_root(cache_dir), ".gguf")
    target = os.path.join(root, f"{os.path.basename(path)[:-5]}-{_source_key(path)}")
    if os.path.isdir(target):  # found: no need to parse the file (seconds for a big vocab)
        return target
    try:  # the scalar metadata only: gguf's reader takes seconds over a 1B model's file
        reader = read_index(path)
    except Exception as e:  # a truncated or foreign file: numpy/struct errors of all kinds
        raise _unreadable(path, e) from None
    if reader is None:
        reader = _reader(path)  # not a little-endian v2/v3 file: gguf's reader says why
    architecture(reader, path)
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=".tmp-")
    try:
        try:
            _materialize(path, reader, tmp)
        except (ImportError, OSError):
            raise
        except Exception as e:  # transformers' reading of damaged metadata: errors of all kinds
            raise _unreadable(
                path, e, "transformers cannot read its config or tokenizer: "
            ) from None
        try:
            os.rename(tmp, target)
        except OSError:  # another process made it first: theirs is as good
            if not os.path.isdir(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _materialize(path: str, reader, out: str) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = os.path.split(path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.save_pretrained(out)
    stops = []
    for key in _STOP_KEYS:
        value = _field(reader, key)
        if value is not None and int(value) not in stops:
            stops.append(int(value))
    generation = GenerationConfig.from_model_config(config)
    if stops:
        generation.eos_token_id = stops if len(stops) > 1 else stops[0]
    generation.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    os.symlink(os.path.realpath(path), os.path.join(out, GGUF_LINK))
    with open(os.path.join(out, SOURCE_FILE), "w") as f:
        json.dump({"path": os.path.realpath(path), "size": os.path.getsize(path)}, f)


def model_directory(model: str) -> str:
    """The model directory for what a user names: a directory as is, a .gguf file through
    ``gguf_model_dir``."""
    if os.path.isdir(model):
        return model
    if is_gguf(model):
        return gguf_model_dir(model)
    if os.path.isfile(model):
        raise FileNotFoundError(
            f"model {model!r} is a file but not a .gguf file; pass a model directory "
            "(config.json + safetensors) or a GGUF file"
        )
    raise FileNotFoundError(
        f"model {model!r} does not exist; pass a model directory (config.json + safetensors) "
        "or a .gguf file"
    )
