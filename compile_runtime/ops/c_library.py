"""Small C kernels for CPUs: compiled on first use for this CPU, cached, loaded with ctypes.

The runtime's hand-written CPU kernels (paged decode attention, the one-row GEMV)
are plain C with OpenMP: no torch headers, so a build takes about a second, not
the minute a torch extension takes. Each is compiled with the machine's C
compiler (``$CC``, else ``cc``/``gcc``: the one Inductor needs on a CPU anyway)
for this CPU (``-march=native``) and cached under the compile cache root in
``.cpu_kernels/`` by a digest of the source, the flags, the compiler and the CPU,
so later starts only load it. Every source gets ``PRELUDE`` first: the headers
and the helpers they share (bf16 conversions, ``sum16``). The library links the
OpenMP runtime already in
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

# Put before every kernel's source: the headers they use and the helpers they share.
PRELUDE = r"""
#define _GNU_SOURCE /* syscall() and aligned_alloc() under -std=c99 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* bfloat16 is the top half of a float32: widening is a shift; narrowing rounds to nearest
 * even, as torch does (NaN stays NaN). */
static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float f32_to_f32(float x) { return x; }

#if defined(__AVX512F__)
/* Element i of the result: the sum of the 16 elements of v[i]. */
static inline __m512 sum16(const __m512* v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)  /* 128-bit lanes 0-1: v[2i]'s halves summed; 2-3: v[2i+1]'s */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* lane l: four partial sums of v[4i + l] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * i], u[2 * i + 1]),
                             _mm512_unpackhi_ps(u[2 * i], u[2 * i + 1]));
    const __m512d a = _mm512_castps_pd(w[0]), b = _mm512_castps_pd(w[1]);
    /* element 4l + j: the sum of v[4j + l]; put it back in key order */
    const __m512 z = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, z);
}
#endif
"""

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
            f.write(PRELUDE + source)
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
        "\0".join([PRELUDE, source, " ".join(FLAGS), compiler, cpu_identity()]).encode()
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
