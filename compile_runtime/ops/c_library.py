"""Small C kernels for CPUs: compiled on first use for this CPU, cached, loaded with ctypes.

The runtime's hand-written CPU kernels (paged decode attention, the one-row GEMV)
are plain C with OpenMP: no torch headers, so a build takes about a second, not
the minute a torch extension takes. Each is compiled with the machine's C
compiler (``$CC``, else ``cc``/``gcc``: the one Inductor needs on a CPU anyway)
for this CPU (``-march=native``) and cached under the compile cache root in
``.cpu_kernels/`` by a digest of the source, the flags, the compiler and the CPU,
so later starts only load it. The library links the OpenMP runtime already in
the process (torch's libgomp), so its threads are torch's threads. Without a
compiler, or if a build fails, ``load_c_library`` returns None with one warning
and the caller computes the same thing with torch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

from compile_runtime.cache.location import cache_root

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c99"]
FLAGS += ["-Werror=implicit-function-declaration"]  # a missing header must not mean a wrong call


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


def _build(compiler: str, source: str, path: str) -> None:
    """Compile ``source`` into ``path`` atomically (a temp file in the same folder, then rename)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, lib = os.path.join(tmp, "kernel.c"), os.path.join(tmp, "kernel.so")
        with open(src, "w") as f:
            f.write(source)
        subprocess.run(
            [compiler, *FLAGS, src, "-o", lib, "-lm"], check=True, capture_output=True, text=True
        )
        os.replace(lib, path)


def load_c_library(name: str, source: str, what: str) -> ctypes.CDLL | None:
    """``source`` built (once per source, compiler and CPU) and loaded; None with a warning
    naming ``what`` falls back to torch ops when it cannot be built here."""
    compiler = c_compiler()
    if compiler is None:
        logger.warning("no C compiler (cc/gcc, or $CC): %s uses torch ops", what)
        return None
    digest = hashlib.sha256(
        "\0".join([source, " ".join(FLAGS), compiler, cpu_identity()]).encode()
    ).hexdigest()[:24]
    path = os.path.join(cache_root(), ".cpu_kernels", f"{name}_{digest}.so")
    try:
        if not os.path.exists(path):
            _build(compiler, source, path)
        return ctypes.CDLL(path)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("%s: C kernel not built (%s); using torch ops", what, detail.strip()[:500])
        return None
