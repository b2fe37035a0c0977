"""Linear layers with quantized weights on CPU: int8 dot products on the quantized bytes.

``y = x W^T (+ b)`` with W in Q8_0, Q4_0 or Q4_1 (``cpu_quant_formats.py``). As
llama.cpp does, each row of x is first quantized to int8 per block of 32 (``d =
max|x| / 127``, float16; ``q = round(x / d)``, to nearest even), so a block of the
product is one exact integer dot product times two scales: ``d_w * d_x * sum(q_w *
q_x)`` (plus ``m_w * d_x * sum(q_x)`` for Q4_1, minus the offset of the unsigned
weights for Q8_0 and Q4_0, folded into the integer sum's start value).

The weight's layout puts element ``4k..4k+3`` of 16 blocks side by side, so a
64-byte load and one AVX512-VNNI ``vpdpbusd`` advance 16 blocks by 4 elements,
each block in its own int32 lane: 8 of them make 16 block sums, converted and
multiplied by 16 scales at once (one float16 load, one multiply, one FMA per 16
blocks). Q4 weights are unpacked in registers (two ANDs and a shift per 64 bytes).
The tile is 4 weight rows by up to 4 rows of x; rows of the weight are shared out
over the threads (OpenMP), each thread reading its rows front to back with a
software prefetch 4 KiB ahead; more rows of x reuse the weight rows from L1. The
kernel is memory-bound at one row: the weight bytes of a token are read once.
Needs AVX512-VNNI and a C compiler; else ``quant_linear`` dequantizes the weight
and calls ``F.linear`` (correct, slow).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from compile_runtime.ops.cpu_quant_formats import Q4_0, Q4_1, Q8_0, dequantize, format_of

FORMAT_IDS = {Q8_0: 0, Q4_0: 1, Q4_1: 2}
_FORMAT_BY_BYTES = {f.block_bytes: i for f, i in FORMAT_IDS.items()}
_X_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's bf16 flag

SOURCE = r"""
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
#define PF 4096  /* bytes ahead in the weight stream */
enum { Q80 = 0, Q40 = 1, Q41 = 2 };

static inline float fp16_round(float f) { return _cvtsh_ss(_cvtss_sh(f, 0)); }

/* One row of x (f32 or bf16) quantized per block of 32: interleaved int8 (chunk k of a
 * group of G blocks: element 4k..4k+3 of each block), d (float16-rounded), the integer
 * sums' start value (minus the weights' offset times sum(q)) and, for Q4_1, d * sum(q)
 * (float16-rounded, as llama.cpp's Q8_1 stores it). */
static void quantize_row(const void* x, int bf16, int64_t K, int fmt, int8_t* xq, float* dx,
                         int32_t* start, float* sx) {
    const int64_t nb = K / 32;
    for (int64_t b = 0; b < nb; b++) {
        __m512 v0, v1;
        if (bf16) {
            const uint16_t* p = (const uint16_t*)x + b * 32;
            v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
            v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + 16))), 16));
        } else {
            const float* p = (const float*)x + b * 32;
            v0 = _mm512_loadu_ps(p);
            v1 = _mm512_loadu_ps(p + 16);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.f;
        const float id = amax != 0.f ? 127.f / amax : 0.f;
        const __m512 vid = _mm512_set1_ps(id);
        const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        int8_t q[32];
        _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(q1));
        const int64_t g0 = b / 16 * 16, G = nb - g0 < 16 ? nb - g0 : 16, l = b - g0;
        int8_t* dst = xq + g0 * 32 + 4 * l;
        for (int k = 0; k < 8; k++) memcpy(dst + 4 * G * k, q + 4 * k, 4);
        dx[b] = fp16_round(d);
        start[b] = fmt == Q80 ? -128 * sum : fmt == Q40 ? -8 * sum : 0;
        sx[b] = fmt == Q41 ? fp16_round(d * (float)sum) : 0.f;
    }
}

/* One group of G blocks (16, or fewer at a row's end) of R weight rows (1 or 4) times MR
 * rows of x (1..4), added to acc[i * 4 + r]. */
static inline __attribute__((always_inline)) void qgroup(
        const uint8_t* w0, int64_t rb, const int FMT, const int8_t* xq, const float* dx,
        const int32_t* xs, const float* sx, int64_t K, int64_t nb, int64_t b0, const int G,
        const int R, const int MR, const int pf, __m512* acc) {
    const int64_t sb = FMT == Q41 ? 4 * nb : 2 * nb;   /* scale bytes of a row */
    const int64_t qg = FMT == Q80 ? 512 : 256;          /* quant bytes of a full group */
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __mmask16 bm = (__mmask16)((1u << G) - 1);
    const __mmask64 cm = G == 16 ? ~0ull : (1ull << (4 * G)) - 1;
    const int cs = 4 * G;                               /* bytes of a chunk */
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++) {
        const uint8_t* row = w0 + r * rb;
        const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, row + 2 * b0));
        __m512 mw = _mm512_setzero_ps();
        if (FMT == Q41) mw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, row + 2 * nb + 2 * b0));
        const uint8_t* q = row + sb + qg * (b0 / 16);
        __m512i wc[8];
        if (FMT == Q80) {
            _Pragma("GCC unroll 8")
            for (int k = 0; k < 8; k++) {
                if (pf) _mm_prefetch((const char*)(q + cs * k) + PF, _MM_HINT_T0);
                wc[k] = _mm512_maskz_loadu_epi8(cm, q + cs * k);
            }
        } else {
            _Pragma("GCC unroll 4")
            for (int j = 0; j < 4; j++) {
                if (pf) _mm_prefetch((const char*)(q + cs * j) + PF, _MM_HINT_T0);
                const __m512i p = _mm512_maskz_loadu_epi8(cm, q + cs * j);
                wc[2 * j] = _mm512_and_si512(p, low);
                wc[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
            }
        }
        _Pragma("GCC unroll 4")
        for (int i = 0; i < MR; i++) {
            const int8_t* xg = xq + i * K + b0 * 32;
            __m512i t = _mm512_maskz_loadu_epi32(bm, xs + i * nb + b0);
            _Pragma("GCC unroll 8")
            for (int k = 0; k < 8; k++)
                t = _mm512_dpbusd_epi32(t, wc[k], _mm512_maskz_loadu_epi8(cm, xg + cs * k));
            const __m512 s = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(bm, dx + i * nb + b0));
            acc[i * 4 + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc[i * 4 + r]);
            if (FMT == Q41)
                acc[i * 4 + r] = _mm512_fmadd_ps(mw, _mm512_maskz_loadu_ps(bm, sx + i * nb + b0), acc[i * 4 + r]);
        }
    }
}

/* R weight rows times MR rows of x, every row of nb = K / 32 blocks: res[i * 4 + r]. Full
 * groups take the unmasked path (G a constant 16); the last, shorter one the masked. */
static inline __attribute__((always_inline)) void qtile(
        const uint8_t* w0, int64_t rb, const int FMT, const int8_t* xq, const float* dx,
        const int32_t* xs, const float* sx, int64_t K, int64_t nb, const int R, const int MR,
        const int pf, float* res) {
    __m512 acc[16];
    _Pragma("GCC unroll 16")
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t b0 = 0;
    for (; b0 + 16 <= nb; b0 += 16)
        qgroup(w0, rb, FMT, xq, dx, xs, sx, K, nb, b0, 16, R, MR, pf, acc);
    if (b0 < nb) qgroup(w0, rb, FMT, xq, dx, xs, sx, K, nb, b0, (int)(nb - b0), R, MR, pf, acc);
    __m512 out[16];
    _Pragma("GCC unroll 16")
    for (int i = 0; i < 16; i++) out[i] = acc[i];
    _mm512_storeu_ps(res, sum16(out));
}

#define DEFINE_TILES(NAME, FMT)                                                               \
static void NAME(const uint8_t* w0, int64_t rb, const int8_t* xq, const float* dx,           \
                 const int32_t* xs, const float* sx, int64_t K, int64_t nb, int R, int MR,    \
                 int pf, float* res) {                                                        \
    if (R == 4) switch (MR) {                                                                 \
        case 1: qtile(w0, rb, FMT, xq, dx, xs, sx, K, nb, 4, 1, pf, res); break;              \
        case 2: qtile(w0, rb, FMT, xq, dx, xs, sx, K, nb, 4, 2, pf, res); break;              \
        case 3: qtile(w0, rb, FMT, xq, dx, xs, sx, K, nb, 4, 3, pf, res); break;              \
        default: qtile(w0, rb, FMT, xq, dx, xs, sx, K, nb, 4, 4, pf, res); break;             \
    } else switch (MR) {                                                                      \
        case 1: qtile(w0, rb, FMT, xq, dx, xs, sx, K, nb, 1, 1, pf, res); break;              \
        case 2: qtile(w0, rb, FMT, xq, dx, xs, sx, K, nb, 1, 2, pf, res); break;              \
        case 3: qtile(w0, rb, FMT, xq, dx, xs, sx, K, nb, 1, 3, pf, res); break;              \
        default: qtile(w0, rb, FMT, xq, dx, xs, sx, K, nb, 1, 4, pf, res); break;             \
    }                                                                                         \
}
DEFINE_TILES(tiles_q80, Q80)
DEFINE_TILES(tiles_q40, Q40)
DEFINE_TILES(tiles_q41, Q41)

typedef void (*tiles_fn)(const uint8_t*, int64_t, const int8_t*, const float*, const int32_t*,
                         const float*, int64_t, int64_t, int, int, int, float*);

/* y [M, N] (rows y_stride apart, x's dtype) = x [M, K] (rows x_stride apart) times the
 * quantized w [N, K / 32 blocks] (our layout) (+ bias [N], x's dtype, or NULL). */
void qgemm(const void* x, int64_t x_stride, int bf16, const uint8_t* w, int fmt,
           const void* bias, void* y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
           int64_t num_threads) {
    const int64_t nb = K / 32, esize = bf16 ? 2 : 4;
    const int64_t rb = nb * (fmt == Q80 ? 34 : fmt == Q40 ? 18 : 20);
    /* x's quantized rows: one buffer per calling thread, grown when a call needs more */
    static __thread char* buf = NULL;
    static __thread int64_t buf_size = 0;
    const int64_t need = M * K + 3 * M * nb * 4 + 256;
    if (need > buf_size) {
        free(buf);
        buf_size = need * 2;
        buf = (char*)malloc(buf_size);
    }
    int8_t* xq = (int8_t*)buf;
    float* dx = (float*)(buf + ((M * K + 63) & ~63));
    int32_t* xs = (int32_t*)(dx + M * nb);
    float* sx = (float*)(xs + M * nb);
    const tiles_fn tiles = fmt == Q80 ? tiles_q80 : fmt == Q40 ? tiles_q40 : tiles_q41;
    const int64_t blocks = (N + 3) / 4;
    #pragma omp parallel num_threads(num_threads)
    {
        /* one parallel region a call: x quantized (rows shared out), a barrier, the tiles */
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row((const char*)x + m * x_stride * esize, bf16, K, fmt, xq + m * K,
                         dx + m * nb, xs + m * nb, sx + m * nb);
        #pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t n0 = blk * 4;
            const int R = N - n0 >= 4 ? 4 : 1;
            const int64_t nr = N - n0 >= 4 ? 4 : N - n0;
            for (int64_t n = n0; n < n0 + nr; n += R) {
                for (int64_t m0 = 0; m0 < M; m0 += 4) {
                    const int mr = M - m0 < 4 ? (int)(M - m0) : 4;
                    float res[16];
                    tiles(w + n * rb, rb, xq + m0 * K, dx + m0 * nb, xs + m0 * nb,
                          sx + m0 * nb, K, nb, R, mr, m0 == 0, res);
                    for (int i = 0; i < mr; i++)
                        for (int r = 0; r < R; r++) {
                            float s = res[i * 4 + r];
                            const int64_t o = (m0 + i) * y_stride + n + r;
                            if (bf16) {
                                if (bias) s += bf16_to_f32(((const uint16_t*)bias)[n + r]);
                                ((uint16_t*)y)[o] = f32_to_bf16(s);
                            } else {
                                if (bias) s += ((const float*)bias)[n + r];
                                ((float*)y)[o] = s;
                            }
                        }
                }
            }
        }
    }
}
int qgemm_available(void) { return 1; }
#else
int qgemm_available(void) { return 0; }
#endif
"""


@functools.cache
def _kernel():
    """The ``qgemm`` function of the built library, or None (no compiler, no AVX512-VNNI)."""
    from compile_runtime.ops.c_library import load_c_library

    lib = load_c_library("qgemm", SOURCE, "quantized CPU linear layers")
    if lib is None or not lib.qgemm_available():
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn = lib.qgemm
    fn.argtypes = [ptr, i64, i32, ptr, i32, ptr, ptr, i64, i64, i64, i64, i64]
    fn.restype = None
    return fn


def kernel_available() -> bool:
    return _kernel() is not None


def quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, dequantize(weight), bias)`` for a quantized ``weight`` (our layout),
    by the int8 kernel (x quantized per block of 32, as llama.cpp does); any row count."""
    n, nb, block_bytes = weight.shape  # the lean path first: this runs ~120 times a token
    fmt_id = _FORMAT_BY_BYTES.get(block_bytes)
    kernel = _kernel()
    dtype = x.dtype
    k = nb * 32
    if (
        kernel is None
        or fmt_id is None
        or weight.dtype != torch.uint8
        or dtype not in _X_DTYPES
        or x.shape[-1] != k
        or not weight.is_contiguous()
    ):
        if format_of(weight) is None:
            raise ValueError(f"not a quantized weight: {weight.dtype} {tuple(weight.shape)}")
        return F.linear(x, dequantize(weight, dtype), bias)
    two_d = x.dim() == 2
    flat = x if two_d else x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        bias = bias.to(dtype).contiguous()
    out = torch.empty(rows, n, dtype=dtype)
    if rows:
        kernel(
            flat.data_ptr(), flat.stride(0), _X_DTYPES[dtype], weight.data_ptr(), fmt_id,
            None if bias is None else bias.data_ptr(), out.data_ptr(), n, rows, n, k,
            torch.get_num_threads(),
        )  # fmt: skip
    return out if two_d else out.view(*x.shape[:-1], n)
