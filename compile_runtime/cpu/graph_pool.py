"""The memory of CPU graphs: one pool shared between the steps of different sizes.

A CUDA graph pool lets the captures of different sizes use the same memory, since only one
graph replays at a time. ``CPUGraphPool`` does that for CPU graphs (``cpu_graph.py``):
each buffer a capture allocates is moved onto a storage the pool already has, the
smallest that holds it and that no buffer of the same step lies on yet.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Any

import torch

from compile_runtime.torch_internals import disable_dispatch_modes


def capturing_step() -> Any:
    """Which step a capture is of: its mode and batch descriptor (None outside a forward)."""
    from compile_runtime.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    context = get_forward_context()
    return context.cudagraph_runtime_mode, context.batch_descriptor


class _Shared:
    """One storage of the pool and the steps that have a buffer on it. The pool holds it
    through the buffer first made on it (weakly): the graphs own the memory, and it goes
    when they do (an engine shut down)."""

    def __init__(self, tensor: torch.Tensor, owner: Any) -> None:
        self.anchor = weakref.ref(tensor)
        self.nbytes = tensor.untyped_storage().nbytes()
        self.owners = {owner}


class CPUGraphPool:
    """The memory the CPU graphs of one factory allocated, shared between steps of different
    sizes (as captures of one CUDA graph pool share it).

    Only one step's graphs replay at a time, and the runner consumes their outputs before the
    next step: so each storage may hold one buffer of every step (mode and batch descriptor),
    never two of the same step. Captures run largest first, so the smaller sizes' buffers
    mostly fit on storages the larger ones made."""

    def __init__(self) -> None:
        self._storages: list[_Shared] = []  # by size, smallest first
        self._sizes: list[int] = []
        # The step being captured, and the storages it has no buffer on yet (by size).
        self._owner: Any = None
        self._free: list[_Shared] = []
        self._free_sizes: list[int] = []

    def share(self, tensor: torch.Tensor, owner: Any) -> torch.Tensor:
        """``tensor``, just allocated by a capture of step ``owner``, on the smallest storage of
        the pool that holds it and has no buffer of ``owner`` yet (else on its own, added)."""
        need = tensor.untyped_storage().nbytes()
        if owner is not None:
            if owner != self._owner:
                self._start(owner)
            at = bisect.bisect_left(self._free_sizes, need)
            while at < len(self._free):
                shared = self._free.pop(at)
                self._free_sizes.pop(at)
                anchor = shared.anchor()
                if anchor is None:
                    continue
                shared.owners.add(owner)
                with disable_dispatch_modes():  # a view made here, not an op to record
                    view = torch.empty(0, dtype=tensor.dtype)
                    return view.set_(
                        anchor.untyped_storage(),
                        tensor.storage_offset(),
                        tensor.size(),
                        tensor.stride(),
                    )
        at = bisect.bisect_left(self._sizes, need)
        self._storages.insert(at, _Shared(tensor, owner))
        self._sizes.insert(at, need)
        return tensor

    def _start(self, owner: Any) -> None:
        """A capture of another step begins: what it may take is every live storage it has
        no buffer on (captures of one step run one after another)."""
        self._owner = owner
        self._drop_dead()
        self._free = [s for s in self._storages if owner not in s.owners]
        self._free_sizes = [s.nbytes for s in self._free]

    def _drop_dead(self) -> None:
        if any(s.anchor() is None for s in self._storages):
            self._storages = [s for s in self._storages if s.anchor() is not None]
            self._sizes = [s.nbytes for s in self._storages]

    @property
    def nbytes(self) -> int:
        """The memory of the live graphs (each storage once)."""
        self._drop_dead()
        return sum(self._sizes)
