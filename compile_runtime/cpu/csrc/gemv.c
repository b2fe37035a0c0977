/* The GEMV of compile_runtime/ops/cpu_gemv.py (which says what it is for; the README's
 * "On a CPU" what it measured). */
#include "prelude.h"
#include "gemv.h"

#define ROWS 4         /* weight rows per tile: four streams from memory */
#define PREFETCH 8192  /* bytes ahead of each weight row: the hardware prefetcher alone
                          fell short of the memory bandwidth on short rows */

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]): x [M, K] rows x_stride apart, w [N, K]
 * contiguous, y [M, N] rows y_stride apart, bias NULL or [N]. A tile is 4 weight rows by
 * up to 4 rows of x: 16 vectors of partial sums, reduced together by sum16 (one pass of
 * shuffles for 16 outputs). The first group of x rows reads the weight rows from memory
 * (prefetching ahead); later groups find them in L1. */
/* The driver, one body for both element types: blocks of ROWS weight rows shared out over
 * the threads; in each, the rows of x four at a time (TILE with the count fixed, so its
 * loops unroll), the first group prefetching the weight; leftover weight rows (N % ROWS)
 * by plain dot products. */
#define DEFINE_GEMV(NAME, T, TILE, WIDEN, NARROW)                                           \
void NAME(const T* x, int64_t x_stride, const T* w, const T* bias, T* y, int64_t y_stride, \
          int64_t M, int64_t N, int64_t K, int64_t num_threads) {                           \
    const int64_t blocks = N / ROWS;                                                        \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                  \
    for (int64_t b = 0; b < blocks; b++) {                                                  \
        const int64_t n0 = b * ROWS;                                                        \
        const T* w0 = w + n0 * K;                                                           \
        for (int64_t m0 = 0; m0 < M; m0 += 4) {                                             \
            const int64_t mr = M - m0 < 4 ? M - m0 : 4;                                     \
            float res[16];                                                                  \
            const T* xm = x + m0 * x_stride;                                                \
            const int pf = m0 == 0;                                                         \
            switch (mr) {                                                                   \
                case 1: TILE(xm, x_stride, w0, K, 1, pf, res); break;                       \
                case 2: TILE(xm, x_stride, w0, K, 2, pf, res); break;                       \
                case 3: TILE(xm, x_stride, w0, K, 3, pf, res); break;                       \
                default: TILE(xm, x_stride, w0, K, 4, pf, res); break;                      \
            }                                                                               \
            for (int64_t i = 0; i < mr; i++)                                                \
                for (int r = 0; r < ROWS; r++) {                                            \
                    float s = res[i * ROWS + r];                                            \
                    if (bias) s += WIDEN(bias[n0 + r]);                                     \
                    y[(m0 + i) * y_stride + n0 + r] = NARROW(s);                            \
                }                                                                           \
        }                                                                                   \
    }                                                                                       \
    for (int64_t n = blocks * ROWS; n < N; n++)                                             \
        for (int64_t m = 0; m < M; m++) {                                                   \
            float s = bias ? WIDEN(bias[n]) : 0.f;                                          \
            for (int64_t k = 0; k < K; k++) s += WIDEN(x[m * x_stride + k]) * WIDEN(w[n * K + k]); \
            y[m * y_stride + n] = NARROW(s);                                                \
        }                                                                                   \
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* The 8-float tiles' reduction: for each of MR rows of x, its ROWS weight rows' sums (the
 * 8 partial sums of each by horizontal adds). */
static inline void sums8(const __m256* acc, const int MR, float* res) {
    for (int i = 0; i < MR; i++) {
        const __m256* a = acc + i * ROWS;
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        _mm_storeu_ps(res + i * ROWS, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    }
}
#endif

#if defined(__AVX512BF16__)
/* MR rows of x (1..4) times ROWS weight rows: acc[i * ROWS + r] */
static inline void tile_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w0, int64_t K,
                             const int MR, const int prefetch, float* res) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const int64_t tail = K % 32;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i wv[ROWS];
        for (int r = 0; r < ROWS; r++) {
            if (prefetch) _mm_prefetch((const char*)(w0 + r * K + k) + PREFETCH, _MM_HINT_T0);
            wv[r] = _mm512_loadu_si512(w0 + r * K + k);
        }
        for (int i = 0; i < MR; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * x_stride + k);
            for (int r = 0; r < ROWS; r++) acc[i * ROWS + r] = _mm512_dpbf16_ps(acc[i * ROWS + r], xv, (__m512bh)wv[r]);
        }
    }
    if (tail) {
        const __mmask32 m = (__mmask32)((1ull << tail) - 1);
        __m512i wv[ROWS];
        for (int r = 0; r < ROWS; r++) wv[r] = _mm512_maskz_loadu_epi16(m, w0 + r * K + k);
        for (int i = 0; i < MR; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * x_stride + k);
            for (int r = 0; r < ROWS; r++) acc[i * ROWS + r] = _mm512_dpbf16_ps(acc[i * ROWS + r], xv, (__m512bh)wv[r]);
        }
    }
    _mm512_storeu_ps(res, sum16(acc));
}

DEFINE_GEMV(gemv_bf16, uint16_t, tile_bf16, bf16_to_f32, f32_to_bf16)
int gemv_has_bf16(void) { return 1; }
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2 without AVX-512 (AMD Zen 3, Intel before Skylake-X; with AVX-512 but not its bf16,
 * oneDNN's bf16 stays, unmeasured against this): 8 bf16 widened to float32 by a shift, then
 * the float32 tile's FMAs. The weight is half float32's bytes, so a row of x takes about
 * half the time where reading the weight is the cost; torch's own bf16 linear has no fast
 * path on these CPUs. */
static inline __m256 bf16x8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

static inline __m256 bf16x8_tail(const uint16_t* p, int64_t n) {
    uint16_t part[8] = {0};
    memcpy(part, p, n * sizeof(uint16_t));
    return bf16x8(part);
}

static inline void tile_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w0, int64_t K,
                             const int MR, const int prefetch, float* res) {
    __m256 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm256_setzero_ps();
    const int64_t tail = K % 8;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[4];
        for (int i = 0; i < MR; i++) xv[i] = bf16x8(x + i * x_stride + k);
        for (int r = 0; r < ROWS; r++) {
            if (prefetch) _mm_prefetch((const char*)(w0 + r * K + k) + PREFETCH, _MM_HINT_T0);
            const __m256 wv = bf16x8(w0 + r * K + k);
            for (int i = 0; i < MR; i++) acc[i * ROWS + r] = _mm256_fmadd_ps(xv[i], wv, acc[i * ROWS + r]);
        }
    }
    if (tail) {
        __m256 xv[4];
        for (int i = 0; i < MR; i++) xv[i] = bf16x8_tail(x + i * x_stride + k, tail);
        for (int r = 0; r < ROWS; r++) {
            const __m256 wv = bf16x8_tail(w0 + r * K + k, tail);
            for (int i = 0; i < MR; i++) acc[i * ROWS + r] = _mm256_fmadd_ps(xv[i], wv, acc[i * ROWS + r]);
        }
    }
    sums8(acc, MR, res);
}

DEFINE_GEMV(gemv_bf16, uint16_t, tile_bf16, bf16_to_f32, f32_to_bf16)
int gemv_has_bf16(void) { return 1; }
#else
int gemv_has_bf16(void) { return 0; }
#endif

#if defined(__AVX512F__)
/* MR rows of x (1..4) times ROWS weight rows: acc[i * ROWS + r] */
static inline void tile_f32(const float* x, int64_t x_stride, const float* w0, int64_t K,
                             const int MR, const int prefetch, float* res) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const int64_t tail = K % 16;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[ROWS];
        for (int r = 0; r < ROWS; r++) {
            if (prefetch) _mm_prefetch((const char*)(w0 + r * K + k) + PREFETCH, _MM_HINT_T0);
            wv[r] = _mm512_loadu_ps(w0 + r * K + k);
        }
        for (int i = 0; i < MR; i++) {
            const __m512 xv = _mm512_loadu_ps(x + i * x_stride + k);
            for (int r = 0; r < ROWS; r++) acc[i * ROWS + r] = _mm512_fmadd_ps(xv, wv[r], acc[i * ROWS + r]);
        }
    }
    if (tail) {
        const __mmask16 m = (__mmask16)((1u << tail) - 1);
        __m512 wv[ROWS];
        for (int r = 0; r < ROWS; r++) wv[r] = _mm512_maskz_loadu_ps(m, w0 + r * K + k);
        for (int i = 0; i < MR; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * x_stride + k);
            for (int r = 0; r < ROWS; r++) acc[i * ROWS + r] = _mm512_fmadd_ps(xv, wv[r], acc[i * ROWS + r]);
        }
    }
    _mm512_storeu_ps(res, sum16(acc));
}

DEFINE_GEMV(gemv_f32, float, tile_f32, f32_to_f32, f32_to_f32)
int gemv_has_f32(void) { return 1; }
#elif defined(__AVX2__) && defined(__FMA__)
/* The same tile with 8-float vectors (AMD Zen, Intel before AVX-512). AVX2 has 16 vector
 * registers, not 32, and 4 rows of x by 4 weight rows spill sums to the stack: that costs
 * nothing while the weight streams from memory (the first group of x rows, ``stream_f32``),
 * but the later groups, which find the weight rows in L1 and are bound by arithmetic, take
 * 3 or 4 rows of x in two passes of at most 2 (``pass_f32``: 8 sums, 2 rows of x and a weight
 * vector in registers), the same sums in the same order. */
/* The last K % 8 inputs of a tile (masked loads) into its MR x ROWS sums. */
static inline void tail_f32(const float* x, int64_t x_stride, const float* w0, int64_t K,
                            int64_t k, int64_t tail, const int MR, __m256* acc) {
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)tail),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < ROWS; r++) {
        const __m256 wv = _mm256_maskload_ps(w0 + r * K + k, m);
        for (int i = 0; i < MR; i++)
            acc[i * ROWS + r] = _mm256_fmadd_ps(_mm256_maskload_ps(x + i * x_stride + k, m), wv, acc[i * ROWS + r]);
    }
}

static inline void pass_f32(const float* x, int64_t x_stride, const float* w0, int64_t K,
                            const int MR, const int prefetch, float* res) {
    __m256 acc[2 * ROWS];
    for (int i = 0; i < 2 * ROWS; i++) acc[i] = _mm256_setzero_ps();
    const int64_t tail = K % 8;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[2];
        for (int i = 0; i < MR; i++) xv[i] = _mm256_loadu_ps(x + i * x_stride + k);
        for (int r = 0; r < ROWS; r++) {
            if (prefetch) _mm_prefetch((const char*)(w0 + r * K + k) + PREFETCH, _MM_HINT_T0);
            const __m256 wv = _mm256_loadu_ps(w0 + r * K + k);
            for (int i = 0; i < MR; i++) acc[i * ROWS + r] = _mm256_fmadd_ps(xv[i], wv, acc[i * ROWS + r]);
        }
    }
    if (tail) tail_f32(x, x_stride, w0, K, k, tail, MR, acc);
    sums8(acc, MR, res);
}

static inline void stream_f32(const float* x, int64_t x_stride, const float* w0, int64_t K,
                             const int MR, const int prefetch, float* res) {
    __m256 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm256_setzero_ps();
    const int64_t tail = K % 8;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        for (int r = 0; r < ROWS; r++) {
            if (prefetch) _mm_prefetch((const char*)(w0 + r * K + k) + PREFETCH, _MM_HINT_T0);
            const __m256 wv = _mm256_loadu_ps(w0 + r * K + k);
            for (int i = 0; i < MR; i++)
                acc[i * ROWS + r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * x_stride + k), wv, acc[i * ROWS + r]);
        }
    }
    if (tail) tail_f32(x, x_stride, w0, K, k, tail, MR, acc);
    sums8(acc, MR, res);
}

static inline void tile_f32(const float* x, int64_t x_stride, const float* w0, int64_t K,
                             const int MR, const int prefetch, float* res) {
    if (MR <= 2 || prefetch) {
        stream_f32(x, x_stride, w0, K, MR, prefetch, res);
    } else {
        pass_f32(x, x_stride, w0, K, 2, prefetch, res);
        pass_f32(x + 2 * x_stride, x_stride, w0, K, MR - 2, 0, res + 2 * ROWS);
    }
}

DEFINE_GEMV(gemv_f32, float, tile_f32, f32_to_f32, f32_to_f32)
int gemv_has_f32(void) { return 1; }
#else
int gemv_has_f32(void) { return 0; }
#endif
