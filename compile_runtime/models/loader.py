"""Load Hugging Face safetensors checkpoints into our native models.

Our models fuse projections (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``); a model declares how checkpoint names map onto its
parameters with ``stacked_params`` (fused target, checkpoint part, shard).
Every parameter must be filled exactly once and every checkpoint tensor
must land somewhere: anything else is an error that names the tensor.

Under tensor parallelism a parameter holds one rank's slice; it says which
with a ``tp_shard(shard_id) -> (dim, start, length) | None`` attribute (set
by the layers in ``compile_runtime.distributed``), and only that slice is
read from the file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from compile_runtime.cpu.linear import repack_linear_weights
from compile_runtime.cpu.packed_weights import forget
from compile_runtime.cpu.quant_formats import (
    BLOCK,
    Q8_0,
    QuantFormat,
    format_of,
    quantize_q8_0,
    quantized_shape,
)
from compile_runtime.models.gguf import GGUFTensor, gguf_file_in, gguf_tensors, release_readers

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


class WeightLoadingError(ValueError):
    """A checkpoint does not match the model: a missing, unexpected or misshapen tensor."""


class ModelFileError(ValueError):
    """A model directory's JSON file is not what it must be (the message names file and field)."""


def read_json_object(path: str) -> dict:
    """``path``'s JSON object; a damaged file (not JSON, not an object, nested past Python's
    recursion limit) is one ``ModelFileError`` naming it, not a traceback from the parser."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        problem = "nested too deeply" if isinstance(e, RecursionError) else f"not JSON ({e})"
        raise ModelFileError(
            f"{path}: {problem}; restore the file from the model's source"
        ) from None
    if not isinstance(value, dict):
        raise ModelFileError(
            f"{path}: holds a JSON {type(value).__name__}, not an object; restore the file "
            "from the model's source"
        )
    return value


class NativeUnsupported(NotImplementedError):
    """A native model cannot run this config exactly as transformers does (the reason says why).

    Raised by a native model's constructor before any weight is read, so that
    ``load_model`` can run the checkpoint through the transformers adapter instead.
    """


@dataclass(frozen=True)
class StackedParam:
    """Checkpoint tensors named ``*.{part}.*`` fill one shard of the fused ``*.{fused}.*``."""

    fused: str
    part: str
    shard: str | int


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFileError(f"{index}: no weight_map object; save the model again")
        files = set(weight_map.values())
        for name in files:  # file names beside the index: never a path out of the directory
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".."):
                raise ModelFileError(
                    f"{index}: weight_map names {name!r}, not a file in {model_dir}; save the "
                    "model again"
                )
        return [os.path.join(model_dir, name) for name in sorted(files)]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {model_dir}; save the model with safetensors "
            "(model.save_pretrained(dir, safe_serialization=True))"
        )
    return [os.path.join(model_dir, f) for f in files]


def iterate_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in iterate_checkpoint(model_dir):
        yield name, tensor.read()


class CheckpointTensor:
    """A tensor in an open safetensors file, read whole or in one slice along one dim."""

    def __init__(self, name: str, handle: Any):
        self.name = name
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def read(self) -> torch.Tensor:
        return self._slice[:]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows ``[start, start + length)`` along ``dim``; only those bytes are read."""
        if dim >= len(self.shape) or start + length > self.shape[dim]:
            raise WeightLoadingError(
                f"checkpoint tensor {self.name!r} has shape {self.shape}; this rank needs "
                f"[{start}, {start + length}) along dim {dim}. Does config.json match the weights?"
            )
        return self._slice[(slice(None),) * dim + (slice(start, start + length),)]


def iterate_checkpoint(model_dir: str) -> Iterator[tuple[str, CheckpointTensor | GGUFTensor]]:
    """Every tensor of the checkpoint, lazily: nothing is read until asked for.

    A directory made for a GGUF file (``models/gguf.py``) reads the tensors of that file.
    """
    gguf_path = gguf_file_in(model_dir)
    if gguf_path is not None:
        yield from gguf_tensors(gguf_path)
        return
    for path in safetensors_files(model_dir):
        try:
            handle = safe_open(path, framework="pt")
        except SafetensorError as e:
            raise WeightLoadingError(
                f"{path} is not a readable safetensors file ({e}); it may be truncated: "
                "download or save it again"
            ) from None
        with handle as f:
            for name in f.keys():
                yield name, CheckpointTensor(name, f)


class FusedShards:
    """How a fused parameter splits into checkpoint parts along dim 0."""

    def __init__(self, sizes: dict[str | int, int]):
        self.offsets: dict[str | int, tuple[int, int]] = {}
        start = 0
        for shard, size in sizes.items():
            self.offsets[shard] = (start, size)
            start += size


def _leaf(param_name: str) -> str:
    """``model.layers.0.self_attn.qkv_proj.weight`` -> ``qkv_proj``."""
    parts = param_name.split(".")
    return parts[-2] if len(parts) >= 2 else parts[0]


def load_weights(
    model: nn.Module,
    model_dir: str,
    stacked_params: list[StackedParam],
    fused_shards: dict[str, FusedShards],
    ignore: tuple[str, ...] = (),
    holds: Callable[[str], bool] | None = None,
) -> None:
    """Fill every parameter of ``model`` from the checkpoint in ``model_dir``.

    ``fused_shards`` maps a fused parameter's module name (``qkv_proj``) to
    its shard layout; checkpoint names containing any of ``ignore`` are
    skipped (rotary caches, a tied ``lm_head.weight``), and so are those
    ``holds`` says another pipeline stage loads.
    """
    params = dict(model.named_parameters())
    filled: dict[str, set] = {name: set() for name in params}
    for ckpt_name, tensor in iterate_checkpoint(model_dir):
        if any(s in ckpt_name for s in ignore) or (holds is not None and not holds(ckpt_name)):
            continue
        target, shard = ckpt_name, None
        for sp in stacked_params:
            if f".{sp.part}." in ckpt_name:
                target, shard = ckpt_name.replace(f".{sp.part}.", f".{sp.fused}."), sp.shard
                break
        if target not in params:
            raise WeightLoadingError(
                f"checkpoint tensor {ckpt_name!r} has no place in {type(model).__name__} "
                f"(looked for parameter {target!r}); is the model directory for this architecture?"
            )
        param = params[target]
        dst = param.data
        if shard is not None:
            start, size = fused_shards[_leaf(target)].offsets[shard]
            dst = dst.narrow(0, start, size)
        region = param.tp_shard(shard) if hasattr(param, "tp_shard") else None
        fmt = format_of(dst)
        if fmt is not None:  # quantized blocks: read as blocks, or a float tensor quantized
            if region is not None:
                dim, start, length = region
                length = length // BLOCK if dim == 1 else min(length, dst.shape[0])
                dst = dst.narrow(dim, 0, length)
            _copy(dst, _read_quantized(tensor, fmt, region, ckpt_name), ckpt_name)
        elif region is None:
            _copy(dst, tensor.read(), ckpt_name)
        else:  # this rank's slice only; a padded last slice fills the leading rows of dst
            dim, start, length = region
            _copy(
                dst.narrow(dim, 0, min(length, dst.shape[dim])), tensor.narrow(*region), ckpt_name
            )
        filled[target].add(shard)

    missing = []
    for name, shards in filled.items():
        layout = fused_shards.get(_leaf(name))
        expected = set(layout.offsets) if layout else {None}
        if shards != expected:
            lacking = sorted(map(str, expected - shards))
            missing.append(f"{name} (parts {lacking})" if layout else name)
    if missing:
        raise WeightLoadingError(
            f"checkpoint in {model_dir} is missing tensors for: {', '.join(missing)}"
        )
    repack_linear_weights(model)  # the writes above went through .data: no version bump
    release_readers()


def _read_quantized(
    tensor: CheckpointTensor | GGUFTensor, fmt: QuantFormat, region: tuple | None, name: str
) -> torch.Tensor:
    """``tensor`` (or its ``region``) as ``fmt`` blocks: a GGUF tensor of that type as stored,
    a float tensor quantized to Q8_0 (``quantization="int8"``)."""
    if isinstance(tensor, GGUFTensor) and tensor.quant_format is fmt:
        return tensor.read_quantized(*(region or ()))
    if fmt is not Q8_0:
        raise WeightLoadingError(f"checkpoint tensor {name!r} cannot be made {fmt.name}")
    if region is not None and region[0] == 1 and (region[1] % BLOCK or region[2] % BLOCK):
        raise WeightLoadingError(
            f"{name}: this rank's inputs [{region[1]}, {region[1] + region[2]}) are not whole "
            f"blocks of {BLOCK}; int8 weights need tensor_parallel_size to split them so"
        )
    return quantize_q8_0(tensor.read() if region is None else tensor.narrow(*region))


QUANTIZATIONS = ("auto", "gguf", "none", "int8")


def quantization_plan(
    model_dir: str,
    quantization: str,
    candidates: set[str],
    stacked_params: list[StackedParam],
    tied: bool,
) -> dict[str, QuantFormat]:
    """Which of the ``candidates`` (parameter names: linear weights, the embedding table)
    load quantized, and in which format.

    "gguf": a parameter whose every checkpoint part the file stores in one of Q8_0, Q4_0,
    Q4_1 keeps that format; the others dequantize, named in one log line. "int8": every
    linear weight of a float checkpoint becomes Q8_0 (per block of 32, as llama.cpp
    quantizes), the embedding table too when the LM head shares it. "none": nothing.
    """
    if quantization == "none":
        return {}
    if quantization == "int8":
        embed = "model.embed_tokens.weight"
        return {n: Q8_0 for n in sorted(candidates) if n != embed or tied}
    if quantization != "gguf":
        raise ValueError(f"quantization={quantization!r} is not one of {QUANTIZATIONS}")
    parts: dict[str, set] = {}
    kept_out: list[str] = []
    for ckpt_name, tensor in iterate_checkpoint(model_dir):
        target = ckpt_name
        for sp in stacked_params:
            if f".{sp.part}." in ckpt_name:
                target = ckpt_name.replace(f".{sp.part}.", f".{sp.fused}.")
                break
        if target in candidates:
            fmt = tensor.quant_format if isinstance(tensor, GGUFTensor) else None
            parts.setdefault(target, set()).add(fmt)
            if fmt is None:
                kept_out.append(f"{ckpt_name} ({getattr(tensor, 'type_name', 'float')})")
    plan = {}
    for target, formats in sorted(parts.items()):
        if len(formats) == 1 and None not in formats:
            plan[target] = formats.pop()
        elif None not in formats:
            kept_out.append(f"{target} (parts in {sorted(f.name for f in formats)})")
    if kept_out:
        logger.info(
            "GGUF: %d weights dequantized (types without a kernel, or fused parts of "
            "different types): %s",
            len(kept_out),
            ", ".join(kept_out),
        )
    return plan


def quantize_parameters(model: nn.Module, plan: dict[str, QuantFormat]) -> None:
    """Replace each planned weight with an empty ``uint8`` parameter of its format's blocks
    (``tp_shard`` kept), for ``load_weights`` to fill."""
    modules = dict(model.named_modules())
    for param_name, fmt in plan.items():
        module = modules[param_name.removesuffix(".weight")]
        old = module.weight
        new = nn.Parameter(
            torch.empty(quantized_shape(*old.shape, fmt), dtype=torch.uint8),
            requires_grad=False,
        )
        if hasattr(old, "tp_shard"):
            new.tp_shard = old.tp_shard  # type: ignore[attr-defined]
        module.weight = new
        if hasattr(module, "use_packed_weight"):
            module.use_packed_weight = True  # cpu_linear runs the int8 kernel


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    forget(dst)  # written through .data: its layer is processed again after loading
    if dst.shape != src.shape:
        raise WeightLoadingError(
            f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, the model expects "
            f"{tuple(dst.shape)}; does config.json match the weights?"
        )
    dst.copy_(src.to(dst.dtype))
