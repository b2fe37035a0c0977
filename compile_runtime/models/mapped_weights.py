"""A native model's weights mapped from its packed-weight file (``cache/weight_file.py``).

``PackedWeightFile.for_model`` names the file a model's processed weights belong in. Its key
is everything the bytes depend on: the checkpoint files (path, size, modification time),
the model as built (every module's settings and every parameter's name, shape and dtype:
the dtype, tensor- and pipeline-parallel shards and LoRA layers show there), how it is
quantized, this CPU (model and flags) and which of our kernels run here, torch's version
and the file's layout version. A file made for any other key is never used.

``map_into`` gives the model its weights from the file: the quantization plan stored
with them, each parameter a view of the mapping, quantized weights noted as already in the
kernel's layout and AMX tile copies as already made, so ``pack_linear_weights`` only
makes what cannot be stored (oneDNN's blocked copies). ``save_and_map`` writes the file
after a full load (whose weights were not moved into huge pages: the file's mapping is)
and points the model at it, so the first process runs on the pages later ones share. A damaged or foreign file is rebuilt with one warning; a file that cannot be
written (a full disk) costs one warning and nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from compile_runtime.cache import weight_file
from compile_runtime.cache.weight_file import WeightFileError
from compile_runtime.compiler.saved_program import model_fingerprint
from compile_runtime.counters import compilation_counter
from compile_runtime.cpu.amx import amx_available
from compile_runtime.cpu.c_library import cpu_identity
from compile_runtime.cpu.packed_weights import forget, lookup, record
from compile_runtime.cpu.quant_formats import BY_NAME, QuantFormat
from compile_runtime.cpu.quant_gemm import kernel_available
from compile_runtime.distributed.parallel_state import (
    get_pp_rank,
    get_pp_world_size,
    get_tp_rank,
    get_tp_world_size,
)
from compile_runtime.models.gguf import gguf_file_in
from compile_runtime.models.loader import safetensors_files

logger = logging.getLogger(__name__)

PACKED = "packed"  # a quantized weight's bytes are in the int8 kernel's layout
AMX_SUFFIX = "#amx"  # the AMX kernel's tile copy of the weight of that name


def source_files(model_dir: str) -> list[str]:
    gguf = gguf_file_in(model_dir)
    return [gguf] if gguf is not None else safetensors_files(model_dir)


def _identity(path: str) -> list[Any]:
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


@dataclass(frozen=True)
class PackedWeightFile:
    path: str
    key: dict[str, Any]

    @classmethod
    def for_model(
        cls, model: nn.Module, model_dir: str, quantization: str, cache_root: str
    ) -> PackedWeightFile:
        """The file for ``model`` as built (before quantizing or loading) from ``model_dir``."""
        key = {
            "sources": [_identity(p) for p in source_files(model_dir)],
            "model": model_fingerprint(model),
            "quantization": quantization,
            "cpu": hashlib.sha256(cpu_identity().encode()).hexdigest()[:16],
            "kernels": {"quantized": kernel_available(), "amx": amx_available()},
            "torch": torch.__version__,
            "ranks": [get_tp_rank(), get_tp_world_size(), get_pp_rank(), get_pp_world_size()],
        }
        return cls(weight_file.file_path(cache_root, weight_file.key_digest(key)), key)

    def map_into(self, model: nn.Module) -> bool:
        """Fill ``model``'s parameters from the file; False (and the model untouched) when
        there is no usable file (a damaged or foreign one: one warning). A file of this key
        that does not fit the model (which the key rules out) is an error, never used."""
        if not os.path.exists(self.path):
            return False
        try:
            tensors = weight_file.open_mapped(self.path, self.key)
            plan = _plan_of(tensors)
        except (WeightFileError, KeyError, ValueError) as e:
            logger.warning("packed weights not used, the file is rebuilt: %s", e)
            return False
        if self.key["quantization"] != "none":
            model.apply_quantization(plan)
        params = dict(model.named_parameters())
        stored = {name for name in tensors if AMX_SUFFIX not in name}
        mismatch = sorted(
            name
            for name in stored | set(params)
            if name not in params
            or name not in tensors
            or tensors[name][0].shape != params[name].shape
            or tensors[name][0].dtype != params[name].dtype
        )
        if mismatch:  # cannot happen for a file of this key; never a wrong tensor if it does
            raise WeightFileError(f"{self.path}: does not fit the model: {', '.join(mismatch[:5])}")
        for name, param in params.items():
            param.data = tensors[name][0]
        for name, param in params.items():
            amx = tensors.get(name + AMX_SUFFIX)
            if PACKED in tensors[name][1] or amx is not None:
                record(param, amx=None if amx is None else amx[0])
        with contextlib.suppress(OSError):  # last used, for prune (a read-only cache: not)
            os.utime(self.path, ns=(time.time_ns(), os.stat(self.path).st_mtime_ns))
        compilation_counter.num_weight_files_mapped += 1
        logger.info("mapped %d weights from %s", len(params), self.path)
        return True

    def save_and_map(self, model: nn.Module, plan: dict[str, QuantFormat]) -> None:
        """``save``, then point the model's weights at the file (their loaded copies freed, the
        records kept): this process runs on the pages later starts map."""
        if not self.save(model, plan):
            return
        tensors = weight_file.open_mapped(self.path, self.key)
        for name, param in model.named_parameters():
            entry = lookup(param)
            forget(param)
            param.data = tensors[name][0]
            if entry is not None:
                amx = tensors.get(name + AMX_SUFFIX)
                moved = record(param, onednn=entry.onednn, amx=entry.amx if amx is None else amx[0])
                moved.kernels = entry.kernels

    def save(self, model: nn.Module, plan: dict[str, QuantFormat]) -> bool:
        """Write the model's processed weights (after ``pack_linear_weights``); a failure to
        write is a warning (False): the engine runs on from the weights it has."""
        items = []
        for name, param in model.named_parameters():
            entry = lookup(param)
            flags = [PACKED] if entry is not None and param.dtype == torch.uint8 else []
            flags += [f"format:{plan[name].name}"] if name in plan else []
            items.append((name, param.data, tuple(flags)))
            if entry is not None and entry.amx is not None:
                items.append((name + AMX_SUFFIX, entry.amx, ()))
        try:
            size = weight_file.write(self.path, self.key, items)
        except OSError as e:
            logger.warning(
                "packed weights not saved to %s (%s): the next start loads the checkpoint "
                "again; free disk space or set cache_dir",
                self.path,
                e,
            )
            return False
        compilation_counter.num_weight_files_saved += 1
        logger.info("saved packed weights (%.1f MB) to %s", size / 1e6, self.path)
        return True


def _plan_of(tensors: dict[str, tuple[torch.Tensor, tuple[str, ...]]]) -> dict[str, QuantFormat]:
    """The quantization plan stored with the weights (``format:NAME`` flags)."""
    plan = {}
    for name, (_, flags) in tensors.items():
        for flag in flags:
            if flag.startswith("format:"):
                plan[name] = BY_NAME[flag.removeprefix("format:")]
    return plan
