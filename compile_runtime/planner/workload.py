"""The step-size histogram of a run: what the capture-size planner learns from.

The runner records one dict increment per step (``Workload.record``); ``save`` writes
the file that ``compile-runtime plan-sizes --workload FILE`` and
``cudagraph_capture_sizes="auto:FILE"`` read (``generate --record-workload``,
``LLM.save_workload``)::

    {"version": 1, "mixed": {"37": 2, ...}, "decode": {"1": 40, "4": 12, ...}}

``mixed`` counts steps with prefill tokens (or uneven query lengths),
``decode`` counts uniform decode steps; keys are token counts per step,
values are numbers of steps. A plain ``{"token count": steps}`` mapping is
accepted too (for hand-written histograms) and read as mixed steps.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

RECORD_HINT = (
    "record one with `compile-runtime generate --record-workload FILE ...` or "
    "`LLM.save_workload(FILE)`"
)


class WorkloadError(ValueError):
    """A workload file is missing or is not a step-size histogram."""


@dataclass
class Workload:
    """Steps per token count, for mixed steps and for uniform decode steps."""

    mixed: Counter[int] = field(default_factory=Counter)
    decode: Counter[int] = field(default_factory=Counter)
    path: str | None = None

    def combined(self) -> Counter[int]:
        """Both kinds together: what one list of capture sizes has to serve."""
        return self.mixed + self.decode

    def record(self, num_tokens: int, uniform_decode: bool) -> None:
        (self.decode if uniform_decode else self.mixed)[num_tokens] += 1

    def to_dict(self) -> dict:
        return {
            "version": 1,
            "mixed": {str(k): v for k, v in sorted(self.mixed.items())},
            "decode": {str(k): v for k, v in sorted(self.decode.items())},
        }

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @property
    def num_steps(self) -> int:
        return sum(self.mixed.values()) + sum(self.decode.values())

    @property
    def num_tokens(self) -> int:
        return sum(n * c for n, c in self.combined().items())

    @property
    def max_tokens(self) -> int:
        return max(self.combined(), default=0)

    @classmethod
    def from_histograms(
        cls, mixed: Mapping[int, int] | None = None, decode: Mapping[int, int] | None = None
    ) -> Workload:
        return cls(Counter(dict(mixed or {})), Counter(dict(decode or {})))


def _histogram(data: object, where: str) -> Counter[int]:
    if not isinstance(data, Mapping):
        raise WorkloadError(f"{where} is a {type(data).__name__}, expected an object")
    out: Counter[int] = Counter()
    for key, value in data.items():
        try:
            n = int(key)
        except (TypeError, ValueError):
            raise WorkloadError(f"{where} has key {key!r}, expected a token count") from None
        if n < 1:
            raise WorkloadError(f"{where} has token count {n}; token counts are >= 1")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise WorkloadError(
                f"{where}[{key!r}] is {value!r}, expected a number of steps (an integer >= 0)"
            )
        if value:
            out[n] += value
    return out


def parse_workload(data: object, path: str | None = None) -> Workload:
    """A ``Workload`` from the decoded JSON of a workload file."""
    name = path or "workload"
    if not isinstance(data, Mapping):
        raise WorkloadError(
            f"{name}: expected a JSON object with 'mixed' and 'decode' histograms, got "
            f"{type(data).__name__}; {RECORD_HINT}"
        )
    try:
        if "mixed" in data or "decode" in data:
            version = data.get("version", 1)
            if version != 1:
                raise WorkloadError(f"version {version!r} is not supported (this reads version 1)")
            mixed = _histogram(data.get("mixed", {}), "'mixed'")
            decode = _histogram(data.get("decode", {}), "'decode'")
        else:
            mixed, decode = _histogram(data, "the histogram"), Counter()
    except WorkloadError as e:
        raise WorkloadError(f"{name}: {e}; {RECORD_HINT}") from None
    workload = Workload(mixed, decode, path)
    if workload.num_steps == 0:
        raise WorkloadError(f"{name}: the histogram has no steps; {RECORD_HINT}")
    return workload


def load_workload(path: str | os.PathLike[str]) -> Workload:
    """Read a workload file; errors name the file and how to make a good one."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise WorkloadError(f"workload file {path!r} does not exist; {RECORD_HINT}") from None
    except OSError as e:
        raise WorkloadError(f"workload file {path!r} cannot be read ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkloadError(
            f"workload file {path!r} is not valid JSON ({e}); {RECORD_HINT}"
        ) from None
    return parse_workload(data, path)
