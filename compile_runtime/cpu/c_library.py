"""Small C kernels for CPUs: compiled on first use for this CPU, cached, loaded with ctypes.

The runtime's hand-written CPU kernels (paged decode attention, the GEMV, the AMX and
quantized linear layers, the CPU graphs' replay loop) are plain C with OpenMP in ``compile_runtime/cpu/csrc/``: no torch
headers, so a build takes about a second, not the minute a torch extension takes. A
library ``name`` is ``csrc/<name>.c`` and the files it includes with quotes: its header
``<name>.h``, which declares each exported function once (the C is checked against it, and
ctypes is typed from it: ``c_header.py``), and usually ``prelude.h`` (the system headers
and the helpers the kernels share: bf16 conversions, ``sum16``). It is compiled with the
machine's C compiler (``$CC``, else ``cc``/``gcc``: the one Inductor needs on a CPU anyway)
for this CPU (``-march=native``) and cached under the compile cache root in
``.cpu_kernels/`` by a digest of every one of those files, the flags, the compiler and the
CPU, so editing a header rebuilds and later starts only load it. The library links the
OpenMP runtime already in the process (torch's libgomp), so its threads are torch's
threads. Without a compiler, or if a build fails, ``load_c_library`` returns None with one
warning and the caller computes the same thing with torch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from typing import Any

from compile_runtime.cache.location import cache_root
from compile_runtime.cpu.c_header import Declaration, parse_header
from compile_runtime.cpu.native_function import NativeFunction

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c99"]
FLAGS += ["-Werror=implicit-function-declaration"]  # a missing header must not mean a wrong call
FLAGS += ["-Werror=missing-prototypes"]  # every exported function is declared in its header
_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def cpu_identity() -> str:
    """What a binary built with -march=native depends on: the CPU model and its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def c_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


class CLibrary:
    """A built library and its header's declarations: its functions come typed from them."""

    def __init__(self, path: str, header: str, declarations: dict[str, Declaration]):
        self.path = path
        self.header = header
        self.declarations = declarations
        self.cdll = ctypes.CDLL(path)

    def _declared(self, name: str) -> Declaration:
        if name not in self.declarations:
            raise KeyError(f"{name} is not declared in {self.header}")
        return self.declarations[name]

    def native(self, name: str) -> NativeFunction:
        """``name`` for calls inside a forward: a ``NativeFunction``, which a CPU graph records."""
        declared = self._declared(name)
        return NativeFunction(self.cdll, name, declared.argtypes, declared.restype)

    def function(self, name: str) -> Any:
        """``name`` as a plain ctypes function, for calls outside a forward (set-up, probes)."""
        declared = self._declared(name)
        fn = getattr(self.cdll, name)
        fn.argtypes = list(declared.argtypes)
        fn.restype = declared.restype
        return fn


def _inputs(name: str, folder: str) -> dict[str, bytes]:
    """Every file a build of ``name`` reads from ``folder``, by name: ``<name>.c`` and what it
    includes with quotes, recursively (all in ``folder`` itself)."""
    inputs: dict[str, bytes] = {}
    pending = [f"{name}.c"]
    while pending:
        file = pending.pop()
        if file in inputs:
            continue
        if os.path.basename(file) != file:
            raise ValueError(f"{file!r}: a kernel includes only files next to it in {folder}")
        with open(os.path.join(folder, file), "rb") as f:
            inputs[file] = f.read()
        pending += [m.decode() for m in _LOCAL_INCLUDE.findall(inputs[file])]
    return inputs


def _sources_digest(inputs: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for file in sorted(inputs):
        digest.update(file.encode() + b"\0" + inputs[file] + b"\0")
    return digest.hexdigest()


def source_digest(name: str, folder: str = CSRC) -> str:
    """A digest of library ``name``'s sources (what a change of its kernels changes)."""
    return _sources_digest(_inputs(name, folder))


def _build(compiler: str, name: str, inputs: dict[str, bytes], path: str) -> None:
    """Compile ``inputs`` (the very bytes the digest covers) into ``path`` atomically: in a
    temp folder next to it, then renamed."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        for file, content in inputs.items():
            with open(os.path.join(tmp, file), "wb") as f:
                f.write(content)
        src, lib = os.path.join(tmp, f"{name}.c"), os.path.join(tmp, f"{name}.so")
        subprocess.run(
            [compiler, *FLAGS, src, "-o", lib, "-lm"], check=True, capture_output=True, text=True
        )
        os.replace(lib, path)


# The libraries every CPU engine loads (graph replay, quantized and one-row linears, decode
# attention): ``build_ahead`` starts them at an engine's start.
ENGINE_LIBRARIES = ("graph_replay", "qgemm", "gemv", "paged_decode")
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _library_path(name: str, inputs: dict[str, bytes], compiler: str) -> str:
    """Where library ``name`` built from ``inputs`` by ``compiler`` for this CPU lives."""
    digest = hashlib.sha256(_sources_digest(inputs).encode())
    digest.update("\0".join([" ".join(FLAGS), compiler, cpu_identity()]).encode())
    return os.path.join(cache_root(), ".cpu_kernels", f"{name}_{digest.hexdigest()[:24]}.so")


def _ensure_built(compiler: str, name: str, inputs: dict[str, bytes], path: str) -> None:
    """Build ``path`` unless it is there; a build under way in another thread is waited for."""
    with _locks_guard:
        lock = _locks.setdefault(path, threading.Lock())
    with lock:
        if not os.path.exists(path):
            _build(compiler, name, inputs, path)


def build_ahead(names: tuple[str, ...] = ENGINE_LIBRARIES, folder: str = CSRC) -> None:
    """Build those of ``names`` not built yet in a background thread: the compiler runs on
    another core while the start reads and compiles the model (an empty cache's start builds
    ~3 s of them); ``load_c_library`` waits for a build under way. Failures are left to the
    load, which warns."""
    compiler = c_compiler()
    if compiler is None:
        return

    def build_all() -> None:
        for name in names:
            try:
                inputs = _inputs(name, folder)
                _ensure_built(compiler, name, inputs, _library_path(name, inputs, compiler))
            except (OSError, ValueError, subprocess.CalledProcessError):
                continue

    threading.Thread(target=build_all, name="cr-build-kernels", daemon=True).start()


def load_c_library(name: str, what: str, folder: str = CSRC) -> CLibrary | None:
    """``<folder>/<name>.c`` built (once per content of its files, compiler and CPU) and loaded
    with the declarations of ``<name>.h``; None with a warning naming ``what`` (the caller
    falls back to torch ops) when it cannot be built here."""
    inputs = _inputs(name, folder)
    header = f"{name}.h"
    if header not in inputs:
        raise ValueError(f"{name}.c must include {header}, which declares what it exports")
    declarations = parse_header(inputs[header].decode(), os.path.join(folder, header))
    compiler = c_compiler()
    if compiler is None:
        logger.warning("no C compiler (cc/gcc, or $CC): %s uses torch ops", what)
        return None
    path = _library_path(name, inputs, compiler)
    try:
        _ensure_built(compiler, name, inputs, path)
        return CLibrary(path, os.path.join(folder, header), declarations)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("%s: C kernel not built (%s); using torch ops", what, detail.strip()[:500])
        return None
