"""The graph pass interface: where a pass runs, which token counts it serves, its identity.

A pass rewrites an FX graph in place and returns how many matches it
replaced. Its ``uuid()`` hashes the source of the files that define it and
its options, so editing a pass or changing an option changes the key of every
compiled artifact it touched (Inductor's FX graph cache and ours).
"""

from __future__ import annotations

import abc
import enum
import hashlib
import inspect
import json
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

import torch.fx
from compile_runtime.passes import matching


class Phase(enum.Enum):
    """Where a pass runs."""

    PRE_SPLIT = "pre_split"  # once, on the whole Dynamo graph before it is split
    POST_GRAD = "post_grad"  # on every compiled piece, as Inductor's post-grad custom pass


@dataclass(frozen=True)
class TokenRange:
    """The token counts a pass may be applied for: ``min_tokens <= n <= max_tokens``.

    A graph compiled for the general (symbolic) size serves every token count,
    so a pass with a bounded range never runs on it, only on graphs compiled
    for an exact size inside the range.
    """

    min_tokens: int = 1
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.min_tokens < 1 or (
            self.max_tokens is not None and self.max_tokens < self.min_tokens
        ):
            raise ValueError(
                f"TokenRange({self.min_tokens}, {self.max_tokens}) is empty; need "
                "1 <= min_tokens <= max_tokens (max_tokens None = unbounded)"
            )

    @property
    def unbounded(self) -> bool:
        return self.min_tokens == 1 and self.max_tokens is None

    def contains(self, runtime_shape: int | None) -> bool:
        if runtime_shape is None:
            return self.unbounded
        return self.min_tokens <= runtime_shape and (
            self.max_tokens is None or runtime_shape <= self.max_tokens
        )


def source_hash(*objects: Any) -> str:
    """Hash of the source files defining ``objects`` (classes, functions or modules)."""
    hasher = hashlib.sha256()
    files = []
    for obj in objects:
        module = obj if inspect.ismodule(obj) else sys.modules[obj.__module__]
        path = inspect.getsourcefile(module)
        if path not in files:
            files.append(path)
    for path in files:
        with open(path, "rb") as f:
            hasher.update(f.read())
    return hasher.hexdigest()


class GraphPass(abc.ABC):
    """One rewrite of an FX graph. Subclasses set ``name`` and implement ``run``."""

    name: ClassVar[str]
    phases: ClassVar[frozenset[Phase]] = frozenset({Phase.POST_GRAD})
    # Modules besides the subclass's own whose source decides what it does
    # (matching helpers, the ops it inserts); base.py and matching.py always count.
    depends_on: ClassVar[tuple[Any, ...]] = ()

    def __init__(self, token_range: TokenRange | None = None):
        self.token_range = token_range or TokenRange()

    @abc.abstractmethod
    def run(self, graph: torch.fx.Graph) -> int:
        """Rewrite ``graph`` in place; return the number of matches replaced."""

    def applies_to(self, runtime_shape: int | None) -> bool:
        return self.token_range.contains(runtime_shape)

    def options(self) -> dict[str, Any]:
        """Everything besides the source that changes what the pass does."""
        return {"token_range": [self.token_range.min_tokens, self.token_range.max_tokens]}

    def uuid(self) -> str:
        mro = type(self).__mro__
        own = [mro[0], *(c for c in mro[1:] if c.__module__.startswith("compile_runtime."))]
        src = source_hash(*own, matching, *self.depends_on)
        blob = json.dumps(
            {"pass": self.name, "source": src, "options": self.options()}, sort_keys=True
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options()})"
