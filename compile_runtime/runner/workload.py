"""The step-size histogram of a run: what the capture-size planner learns from.

Recording is one dict increment per step; ``save`` writes JSON that
``compile-runtime plan-sizes --workload FILE`` reads.
"""

from __future__ import annotations

import json
from collections import Counter


class WorkloadRecorder:
    def __init__(self) -> None:
        self.mixed: Counter[int] = Counter()  # token count -> steps (prefill or mixed)
        self.decode: Counter[int] = Counter()  # token count -> steps (uniform decode)

    def record(self, num_tokens: int, uniform_decode: bool) -> None:
        (self.decode if uniform_decode else self.mixed)[num_tokens] += 1

    @property
    def num_steps(self) -> int:
        return sum(self.mixed.values()) + sum(self.decode.values())

    def to_dict(self) -> dict:
        return {
            "version": 1,
            "mixed": {str(k): v for k, v in sorted(self.mixed.items())},
            "decode": {str(k): v for k, v in sorted(self.decode.items())},
        }

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
