"""One-row linear layers on CPU: a GEMV that streams the weight at memory bandwidth.

A decode step at batch 1 multiplies one row by every weight of the model, so its
time is the time to read the weights. oneDNN's packed GEMM reached ~16.5 GB/s at
one row on 2 cores here (Xeon, AVX512-BF16), MKL's sgemv ~24 GB/s in float32 and
``F.linear`` in bf16 ~11.6 GB/s. This kernel reads each weight row once, four rows
at a time (four streams, four accumulators) with a software prefetch 8 KiB ahead,
and multiplies with AVX512-BF16 dot products (bf16 in, float32 sums) or AVX-512
FMAs (float32): all 30 layers plus the lm_head of SmolLM2-135M at one row took
10.9 ms in bf16 (24.6 GB/s; oneDNN 16.4 ms) and 20.9 ms in float32 (25.7 GB/s;
oneDNN 28.2, MKL 22.1). At two rows and more oneDNN's packed GEMM was faster
again (the weight is reused across rows), so only one-row calls come here
(``cpu_linear``). Built by ``ops/c_library.py``; a CPU without AVX-512 (or
AVX512-BF16, for bf16) or without a C compiler keeps the oneDNN path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif


#define ROWS 4         /* weight rows per pass: four independent streams and accumulators */
#define PREFETCH 8192  /* bytes ahead of each weight row: the hardware prefetcher alone
                          fell ~30% short of the memory bandwidth on short rows */

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

#if defined(__AVX512BF16__)
/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]): x [M, K] rows x_stride apart, w [N, K]
 * contiguous, y [M, N] rows y_stride apart. bias may be NULL. */
void gemv_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w, const uint16_t* bias,
               uint16_t* y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
               int64_t num_threads) {
    const int64_t blocks = (N + ROWS - 1) / ROWS;
    const int64_t tail = K % 32;
    const __mmask32 tail_mask = (__mmask32)((1ull << tail) - 1);
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * ROWS, rows = N - n0 < ROWS ? N - n0 : ROWS;
        const uint16_t* w0 = w + n0 * K;
        for (int64_t m = 0; m < M; m++) {
            const uint16_t* xm = x + m * x_stride;
            __m512 acc[ROWS];
            for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
            int64_t k = 0;
            if (rows == ROWS) {
                for (; k + 32 <= K; k += 32) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xm + k);
                    for (int r = 0; r < ROWS; r++) {
                        const uint16_t* wr = w0 + r * K + k;
                        _mm_prefetch((const char*)wr + PREFETCH, _MM_HINT_T0);
                        acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_loadu_si512(wr));
                    }
                }
            } else {
                for (; k + 32 <= K; k += 32) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xm + k);
                    for (int r = 0; r < rows; r++)
                        acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_loadu_si512(w0 + r * K + k));
                }
            }
            if (tail) {
                const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, xm + k);
                for (int r = 0; r < rows; r++)
                    acc[r] = _mm512_dpbf16_ps(
                        acc[r], xv, (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, w0 + r * K + k));
            }
            for (int r = 0; r < rows; r++) {
                float s = _mm512_reduce_add_ps(acc[r]);
                if (bias) s += bf16_to_f32(bias[n0 + r]);
                y[m * y_stride + n0 + r] = f32_to_bf16(s);
            }
        }
    }
}

int gemv_has_bf16(void) { return 1; }
#else
int gemv_has_bf16(void) { return 0; }
#endif

#if defined(__AVX512F__)
void gemv_f32(const float* x, int64_t x_stride, const float* w, const float* bias, float* y,
              int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t num_threads) {
    const int64_t blocks = (N + ROWS - 1) / ROWS;
    const int64_t tail = K % 16;
    const __mmask16 tail_mask = (__mmask16)((1u << tail) - 1);
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * ROWS, rows = N - n0 < ROWS ? N - n0 : ROWS;
        const float* w0 = w + n0 * K;
        for (int64_t m = 0; m < M; m++) {
            const float* xm = x + m * x_stride;
            __m512 acc[ROWS];
            for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
            int64_t k = 0;
            if (rows == ROWS) {
                for (; k + 16 <= K; k += 16) {
                    const __m512 xv = _mm512_loadu_ps(xm + k);
                    for (int r = 0; r < ROWS; r++) {
                        const float* wr = w0 + r * K + k;
                        _mm_prefetch((const char*)wr + PREFETCH, _MM_HINT_T0);
                        acc[r] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wr), acc[r]);
                    }
                }
            } else {
                for (; k + 16 <= K; k += 16) {
                    const __m512 xv = _mm512_loadu_ps(xm + k);
                    for (int r = 0; r < rows; r++)
                        acc[r] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w0 + r * K + k), acc[r]);
                }
            }
            if (tail) {
                const __m512 xv = _mm512_maskz_loadu_ps(tail_mask, xm + k);
                for (int r = 0; r < rows; r++)
                    acc[r] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tail_mask, w0 + r * K + k), acc[r]);
            }
            for (int r = 0; r < rows; r++) {
                float s = _mm512_reduce_add_ps(acc[r]);
                if (bias) s += bias[n0 + r];
                y[m * y_stride + n0 + r] = s;
            }
        }
    }
}
int gemv_has_f32(void) { return 1; }
#else
int gemv_has_f32(void) { return 0; }
#endif
"""

# Rows at which the GEMV is used: measured faster than oneDNN at one row only.
MAX_ROWS = 1


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, dict[torch.dtype, object]]:
    """The library and its kernel per dtype this CPU runs (empty without AVX-512)."""
    from compile_runtime.ops.c_library import load_c_library

    lib = load_c_library("gemv", SOURCE, "one-row CPU linear layers")
    if lib is None:
        return None, {}
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    kernels = {}
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        if getattr(lib, f"gemv_has_{name}")():
            fn = getattr(lib, f"gemv_{name}")
            fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64]
            fn.restype = None
            kernels[dtype] = fn
    return lib, kernels


def gemv_dtypes() -> frozenset[torch.dtype]:
    """The dtypes the GEMV runs in on this machine."""
    return frozenset(_library()[1])


def gemv_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for ``x`` of ``MAX_ROWS`` rows or fewer, by the GEMV;
    None when the kernel does not take these tensors (the caller runs its own path)."""
    kernel = _library()[1].get(weight.dtype)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (
        kernel is None
        or not 0 < rows <= MAX_ROWS
        or x.dtype != weight.dtype
        or x.stride(-1) != 1
        or not weight.is_contiguous()
        or (bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()))
    ):
        return None
    n, k = weight.shape
    flat = x if x.dim() == 2 else x.reshape(rows, k)
    out = torch.empty(rows, n, dtype=x.dtype)
    kernel(
        flat.data_ptr(), flat.stride(0), weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(), n, rows, n, k, torch.get_num_threads(),
    )  # fmt: skip
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
