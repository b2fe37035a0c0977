"""A C function of ours that a CPU graph can record: called as usual, noted while capturing.

Every C kernel a forward calls (GEMV, AMX, quantized GEMM, embedding rows, paged decode
attention) is a ``NativeFunction``: a ctypes function plus its address. Outside capture a
call is the ctypes call and one global read more. While a CPU graph captures
(``compile_runtime/cpu/graph.py``), each call is also handed to the recorder with its
arguments, which the graph later replays from its C loop without Python; a dry capture
(start-up's, whose outputs nobody reads) records the call without running it.

A recordable function takes only integer-class arguments (pointers, ``int64_t`` and
narrower ints): the replay loop passes every argument in an integer register or stack
slot. A float argument (``ctypes.c_float``/``c_double``) is refused when the function is
declared, so a kernel that needs one takes a pointer to it instead.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Protocol

_FLOAT_TYPES = (ctypes.c_float, ctypes.c_double, ctypes.c_longdouble)


class CallRecorder(Protocol):
    def record_native(self, function: NativeFunction, args: tuple[Any, ...]) -> bool:
        """Note the call; True: also run it (False: a dry capture, which only records)."""


_recorder: CallRecorder | None = None


def set_native_recorder(recorder: CallRecorder | None) -> CallRecorder | None:
    """Make ``recorder`` receive every ``NativeFunction`` call; returns the previous one."""
    global _recorder
    previous, _recorder = _recorder, recorder
    return previous


class NativeFunction:
    """``lib.name`` with ``argtypes``; calls go to C, and to the recorder while one is set."""

    __slots__ = ("address", "argtypes", "fn", "name")

    def __init__(self, lib: ctypes.CDLL, name: str, argtypes: Sequence[Any], restype: Any = None):
        floats = [i for i, t in enumerate(argtypes) if t in _FLOAT_TYPES]
        if floats:
            raise TypeError(
                f"{name}: argument(s) {floats} are floating point; a recordable C function takes "
                "integers and pointers only (pass a pointer to the value instead)"
            )
        fn = getattr(lib, name)
        fn.argtypes = list(argtypes)
        fn.restype = restype
        self.fn = fn
        self.name = name
        self.argtypes = tuple(argtypes)
        self.address = ctypes.cast(fn, ctypes.c_void_p).value

    def __call__(self, *args: Any) -> Any:
        if _recorder is not None and not _recorder.record_native(self, args):
            return None if self.fn.restype is None else 0  # not run: nothing to report
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"NativeFunction({self.name})"
