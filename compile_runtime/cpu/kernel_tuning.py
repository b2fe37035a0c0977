"""Which linear kernel is fastest for each weight shape and row count, measured on this CPU.

The four kernels of ``cpu_linear.py`` rank differently from one CPU to the next (where the
GEMV stops leading, whether MKL's ``F.linear`` or oneDNN leads at many rows: the README's
"On a CPU" gives measured tables). So at a model's first start on a machine, after its weights are processed
(``cpu_linear.pack_linear_weights``), ``tune_linear_kernels`` times every kernel that can
run each float weight shape (``cpu_linear.candidates``) at each row bucket, on the
model's own weights, going through all the weights of a shape in turn so they stream from
memory as they do in a step. Rounds alternate the kernels, the median of each is kept, and
the built-in choice stays unless another kernel beats it by ``MARGIN``. The table is saved
under the cache root (``.kernel_tuning/``), keyed by the CPU (``c_library.cpu_identity``:
model name and flags), the thread count, torch's version, the kernels' sources and the
shapes; a later start reads it and times nothing. A table that cannot be read, or is not
the one its name says, is ignored with one warning and measured again.

Bounded: ``BUDGET_S`` seconds at most, buckets from 1 row up (those left when the budget
runs out keep the built-in choice, and the table says so). A streaming kernel (GEMV, AMX)
that loses a bucket by ``DROP_RATIO``, or any kernel that loses by ``HOPELESS``, is not
timed at larger ones of the few-row buckets (the GEMV only falls further behind with more
rows); past ``STREAMED_ROWS`` the GEMMs are timed again, each shape on a slice of one of its
weights (arithmetic, not memory, decides there). Quantized weights have one kernel
(``cpu_quant_gemm.py``): nothing to choose. ``COMPILE_RUNTIME_KERNEL_TUNING=0`` or
``RunnerConfig.cpu_tune_kernels=False`` keeps the built-in choices (the same kernels on
every machine).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from compile_runtime.cache.files import write_atomic
from compile_runtime.cache.location import cache_root
from compile_runtime.cpu.c_library import cpu_identity, source_digest
from compile_runtime.cpu.linear import (
    KERNELS,
    ROW_BUCKETS,
    built_in_kernel,
    candidates,
    packed_copies,
    run_kernel,
    shape_name,
)
from compile_runtime.cpu.packed_weights import PackedWeight, lookup

logger = logging.getLogger(__name__)

VERSION = 1
ENV_VAR = "COMPILE_RUNTIME_KERNEL_TUNING"
FOLDER = ".kernel_tuning"
BUDGET_S = 4.0
MARGIN = 0.05  # another kernel replaces the built-in choice only when this much faster
DROP_RATIO = 1.5
HOPELESS = 3.0
STREAMING = ("gemv", "amx")  # past the memory bound their time grows with every row
STREAMED_ROWS = 32
STREAMED_BYTES = 64 << 20
SLICED_BYTES = 4 << 20
ROUNDS = 3


@dataclass
class ShapeChoice:
    """One weight shape's kernel per row bucket, and the median microseconds per call of
    each kernel timed (None where it was not)."""

    weights: int
    kernels: list[str]
    us: dict[str, list[float | None]] = field(default_factory=dict)


@dataclass
class TuningTable:
    key: str
    cpu: str  # the CPU's model name
    threads: int
    torch_version: str
    created: float
    seconds: float = 0.0  # the time the measurement took
    complete: bool = True  # False: the budget ran out (the rest keeps the built-in choice)
    timings: int = 0  # kernel passes timed (0 for a table read from the cache)
    buckets: list[int] = field(default_factory=lambda: list(ROW_BUCKETS))
    shapes: dict[str, ShapeChoice] = field(default_factory=dict)
    version: int = VERSION

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TuningTable:
        shapes = {name: ShapeChoice(**choice) for name, choice in data.pop("shapes").items()}
        return cls(**data, shapes=shapes)


def tuning_enabled(requested: bool = True) -> bool:
    return requested and os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off")


def _cpu_model_name() -> str:
    for line in cpu_identity().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def table_key(shapes: list[str]) -> str:
    """What the measurement depends on: the CPU, threads, torch, the kernels' code, shapes."""
    parts = [
        f"v{VERSION}",
        cpu_identity(),
        str(torch.get_num_threads()),
        torch.__version__,
        source_digest("gemv"),
        source_digest("amx_linear"),
        *sorted(shapes),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _float_layers(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The layers whose float weight ``cpu_linear`` runs, by the weight's shape name."""
    groups: dict[str, list[nn.Module]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "use_packed_weight", False) and weight.dtype != torch.uint8:
            groups.setdefault(shape_name(weight), []).append(module)
    return dict(sorted(groups.items()))


def _weights(layers: list[nn.Module]) -> list[nn.Parameter]:
    return list({id(m.weight): m.weight for m in layers}.values())


def _time_pass(name: str, x: torch.Tensor, pairs: list) -> float:
    """Seconds per weight of one pass of kernel ``name`` over ``pairs`` (weight, record)."""
    start = time.perf_counter()
    for weight, entry in pairs:
        run_kernel(name, x, weight, entry, None)
    return (time.perf_counter() - start) / len(pairs)


def _out_of_the_race(kernel: str, behind: float) -> bool:
    """Not timed at larger buckets: a streaming kernel ``behind`` (time / the fastest's) by
    ``DROP_RATIO`` (it only falls further behind with more rows), any kernel by ``HOPELESS``."""
    return behind > HOPELESS or (kernel in STREAMING and behind > DROP_RATIO)


def _choose(timed: dict[str, float], built_in: str) -> str:
    best = min(timed, key=timed.__getitem__)
    if built_in in timed and best != built_in and timed[best] > timed[built_in] * (1 - MARGIN):
        return built_in
    return best


def _streamed(weights: list[nn.Parameter]) -> list[tuple[nn.Parameter, PackedWeight | None]]:
    """The weights a few-row pass goes through: enough of the shape's (``STREAMED_BYTES``)
    that they come from memory, as in a step, not from the cache."""
    pairs, total = [], 0
    for weight in weights:
        if pairs and total >= STREAMED_BYTES:
            break
        pairs.append((weight, lookup(weight)))
        total += weight.numel() * weight.element_size()
    return pairs


def _sliced(weight: nn.Parameter) -> list[tuple[torch.Tensor, PackedWeight | None]]:
    """What a many-row pass times: the weight's first output rows (``SLICED_BYTES``; the
    arithmetic, not memory, decides there), with packed copies of their own (not recorded:
    the slice has the weight's address)."""
    entry = lookup(weight)
    n, k = weight.shape
    rows = max(64, SLICED_BYTES // (k * weight.element_size()) // 64 * 64)
    if rows >= n or entry is None:
        return [(weight, entry)]
    part = weight.detach()[:rows]
    onednn, amx = packed_copies(part) if entry.onednn is not None else (None, None)
    return [(part, PackedWeight(weakref.ref(part), part, onednn, amx))]


def _time_bucket(rows: int, pairs: list, names: list[str]) -> dict[str, float]:
    """Median seconds per weight of each kernel, in rounds that alternate their order."""
    weight = pairs[0][0]
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    for name in names:  # warm-up: outputs allocated, code paged in
        _time_pass(name, x, pairs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(_time_pass(name, x, pairs))
    return {name: statistics.median(times) for name, times in samples.items()}


def measure(groups: dict[str, list[nn.Parameter]], key: str, budget_s: float) -> TuningTable:
    """Time the candidate kernels of every shape at every bucket (module docstring)."""
    start = time.perf_counter()
    table = TuningTable(
        key, _cpu_model_name(), torch.get_num_threads(), torch.__version__, time.time()
    )
    dropped: dict[str, set[str]] = {name: set() for name in groups}
    for name, weights in groups.items():
        entry = lookup(weights[0])
        kernels = [built_in_kernel(entry, weights[0].dtype, rows) for rows in ROW_BUCKETS]
        table.shapes[name] = ShapeChoice(len(weights), kernels)
    with torch.no_grad():
        streamed = {name: _streamed(weights) for name, weights in groups.items()}
        sliced = {name: _sliced(weights[0]) for name, weights in groups.items()}
        for index, rows in enumerate(ROW_BUCKETS):
            for name in groups:
                if time.perf_counter() - start > budget_s:
                    table.complete = False
                    break
                if rows > STREAMED_ROWS >= ROW_BUCKETS[index - 1]:  # GEMMs back in the race
                    dropped[name] &= set(STREAMING)
                pairs = streamed[name] if rows <= STREAMED_ROWS else sliced[name]
                names = [k for k in candidates(*pairs[0], rows) if k not in dropped[name]]
                if len(names) < 2:
                    continue
                timed = _time_bucket(rows, pairs, names)
                table.timings += (ROUNDS + 1) * len(names)
                choice = table.shapes[name]
                choice.kernels[index] = _choose(timed, choice.kernels[index])
                for k, seconds in timed.items():
                    choice.us.setdefault(k, [None] * len(ROW_BUCKETS))[index] = seconds * 1e6
                    if _out_of_the_race(k, seconds / min(timed.values())):
                        dropped[name].add(k)
            if not table.complete:
                break
    table.seconds = time.perf_counter() - start
    return table


def _read(path: str, key: str, shapes: list[str]) -> TuningTable | None:
    """The table saved at ``path``, or None (a warning unless there is none)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            table = TuningTable.from_json(json.load(f))
        if table.version != VERSION or table.key != key or sorted(table.shapes) != sorted(shapes):
            raise ValueError("made for another CPU, thread count, kernel build or model")
        if any(len(c.kernels) != len(ROW_BUCKETS) for c in table.shapes.values()):
            raise ValueError("a shape's kernels do not match the row buckets")
        unknown = {k for c in table.shapes.values() for k in c.kernels} - set(KERNELS)
        if unknown:
            raise ValueError(f"unknown kernels {sorted(unknown)}")
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        logger.warning("ignoring the kernel tuning table %s (%s); measuring again", path, e)
        return None
    table.timings = 0
    return table


def apply(table: TuningTable, groups: dict[str, list[nn.Module]]) -> None:
    """Give each layer, and its weight's record, its shape's kernels (the layer keeps them
    for a reload: ``cpu_linear.process_weights_after_loading``)."""
    for name, layers in groups.items():
        kernels = tuple(table.shapes[name].kernels)
        for layer in layers:
            layer.linear_kernels = kernels
            entry: PackedWeight | None = lookup(layer.weight)
            if entry is not None:
                entry.kernels = kernels


def tune_linear_kernels(
    model: nn.Module,
    *,
    root: str | None = None,
    budget_s: float = BUDGET_S,
    remeasure: bool = False,
) -> TuningTable | None:
    """Choose the kernel of every float linear weight of ``model`` per row bucket: from the
    table saved for this CPU and these shapes, or measured now (``remeasure``: measured even
    when one is saved) and saved. None when the model has no float weight to choose for."""
    groups = _float_layers(model)
    if not groups:
        return None
    shapes = list(groups)
    key = table_key(shapes)
    path = os.path.join(cache_root(root), FOLDER, f"{key}.json")
    table = None if remeasure else _read(path, key, shapes)
    if table is None:
        logger.info("timing the CPU linear kernels for %d weight shapes (at most %.0f s)",
                    len(shapes), budget_s)  # fmt: skip
        table = measure({name: _weights(layers) for name, layers in groups.items()}, key, budget_s)
        write_atomic(path, json.dumps(table.to_json(), indent=1).encode())
        logger.info(
            "kernel tuning: %d timings in %.2f s%s; saved to %s", table.timings, table.seconds,
            "" if table.complete else " (budget spent: larger rows keep the built-in choice)",
            path,
        )  # fmt: skip
    apply(table, groups)
    return table


def list_tables(root: str) -> list[tuple[str, TuningTable | str]]:
    """Every saved table under ``root``: (path, the table or why it cannot be read)."""
    folder = os.path.join(root, FOLDER)
    found: list[tuple[str, TuningTable | str]] = []
    for file in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, file)
        try:
            with open(path) as f:
                found.append((path, TuningTable.from_json(json.load(f))))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            found.append((path, f"cannot be read: {e}"))
    return found
