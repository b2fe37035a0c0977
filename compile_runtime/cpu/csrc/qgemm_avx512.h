/* The quantized GEMM's body for CPUs with AVX512-VNNI (included by qgemm.c after the
 * prelude; compile_runtime/ops/cpu_quant_gemm.py says what it computes and why the layout is
 * so): vpdpbusd on 16 rows' 4-byte chunks at once. */
#define PF 2048  /* bytes ahead in a thread's weight stream */
enum { Q80 = 0, Q40 = 1, Q41 = 2 };
static const int BLOCK_BYTES[3] = {34, 18, 20};

static inline float fp16_round(float f) { return _cvtsh_ss(_cvtss_sh(f, 0)); }

/* One row of x (f32 or bf16) quantized per block of 32, as llama.cpp does: int8 in order,
 * d (float16-rounded), the integer sums' start value (minus the weights' offset times
 * sum(q)) and, for Q4_1, d * sum(q) (float16-rounded, as llama.cpp's Q8_1 stores it). */
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
        _mm_storeu_si128((__m128i*)(xq + b * 32), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(xq + b * 32 + 16), _mm512_cvtsepi32_epi8(q1));
        dx[b] = fp16_round(d);
        start[b] = fmt == Q80 ? -128 * sum : fmt == Q40 ? -8 * sum : 0;
        sx[b] = fmt == Q41 ? fp16_round(d * (float)sum) : 0.f;
    }
}

/* 16 floats to bfloat16, rounded to nearest even as torch does (NaN stays NaN). */
static inline __m256i f32x16_to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i top = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(
        _mm512_set1_epi32(0x7fff), _mm512_and_si512(top, _mm512_set1_epi32(1)))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* One group of r (1..16) weight rows (packed layout: the group's scales, then its quants
 * block by block) times MR (1..4) rows of quantized x: acc[i] lane l = row l's sum for x
 * row i. */
static inline __attribute__((always_inline)) void qgroup(
        const uint8_t* gw, const int FMT, const int r, const int64_t nb, const int8_t* xq,
        const float* dx, const int32_t* xs, const float* sx, const int64_t K, const int MR,
        const int pf, __m512* acc) {
    const int64_t qb = FMT == Q80 ? 32 * r : 16 * r;   /* quant bytes of a block */
    const uint8_t* scales = gw;
    const uint8_t* mins = gw + 2 * nb * r;              /* Q4_1 */
    const uint8_t* quants = gw + (FMT == Q41 ? 4 : 2) * nb * r;
    const __mmask16 rm = (__mmask16)((1u << r) - 1);
    const __mmask64 cm = r == 16 ? ~0ull : (1ull << (4 * r)) - 1;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* q = quants + b * qb;
        if (pf)
            for (int64_t o = 0; o < qb; o += 64) _mm_prefetch((const char*)q + PF + o, _MM_HINT_T0);
        const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(rm, scales + 2 * r * b));
        __m512 mw = _mm512_setzero_ps();
        if (FMT == Q41) mw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(rm, mins + 2 * r * b));
        __m512i wc[8];
        if (FMT == Q80) {
            _Pragma("GCC unroll 8")
            for (int k = 0; k < 8; k++) wc[k] = _mm512_maskz_loadu_epi8(cm, q + 4 * r * k);
        } else {
            _Pragma("GCC unroll 4")
            for (int j = 0; j < 4; j++) {
                const __m512i packed = _mm512_maskz_loadu_epi8(cm, q + 4 * r * j);
                wc[2 * j] = _mm512_and_si512(packed, low);
                wc[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            }
        }
        _Pragma("GCC unroll 4")
        for (int i = 0; i < MR; i++) {
            const int8_t* xb = xq + i * K + b * 32;
            /* two chains of four, so one block's sum waits on four multiplies, not eight */
            __m512i t0 = _mm512_set1_epi32(xs[i * nb + b]), t1 = _mm512_setzero_si512();
            _Pragma("GCC unroll 4")
            for (int k = 0; k < 8; k += 2) {
                t0 = _mm512_dpbusd_epi32(t0, wc[k], _mm512_broadcastd_epi32(_mm_loadu_si32(xb + 4 * k)));
                t1 = _mm512_dpbusd_epi32(t1, wc[k + 1], _mm512_broadcastd_epi32(_mm_loadu_si32(xb + 4 * k + 4)));
            }
            const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(dx[i * nb + b]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(t0, t1)), s, acc[i]);
            if (FMT == Q41) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[i * nb + b]), acc[i]);
        }
    }
}

#define DEFINE_GROUP(NAME, FMT)                                                               \
static void NAME(const uint8_t* gw, int r, int64_t nb, const int8_t* xq, const float* dx,    \
                 const int32_t* xs, const float* sx, int64_t K, int MR, int pf, __m512* acc) { \
    switch (MR) {                                                                             \
        case 1: qgroup(gw, FMT, r, nb, xq, dx, xs, sx, K, 1, pf, acc); break;                 \
        case 2: qgroup(gw, FMT, r, nb, xq, dx, xs, sx, K, 2, pf, acc); break;                 \
        case 3: qgroup(gw, FMT, r, nb, xq, dx, xs, sx, K, 3, pf, acc); break;                 \
        default: qgroup(gw, FMT, r, nb, xq, dx, xs, sx, K, 4, pf, acc); break;                \
    }                                                                                         \
}
DEFINE_GROUP(group_q80, Q80)
DEFINE_GROUP(group_q40, Q40)
DEFINE_GROUP(group_q41, Q41)

typedef void (*group_fn)(const uint8_t*, int, int64_t, const int8_t*, const float*,
                         const int32_t*, const float*, int64_t, int, int, __m512*);

/* y [M, N] (rows y_stride apart, x's dtype) = x [M, K] (rows x_stride apart) times the
 * packed quantized w [N, K / 32 blocks] (+ bias [N], x's dtype, or NULL). */
void qgemm(const void* x, int64_t x_stride, int bf16, const uint8_t* w, int fmt,
           const void* bias, void* y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
           int64_t num_threads) {
    const int64_t nb = K / 32, esize = bf16 ? 2 : 4, bb = BLOCK_BYTES[fmt];
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
    const group_fn group = fmt == Q80 ? group_q80 : fmt == Q40 ? group_q40 : group_q41;
    const int64_t groups = (N + 15) / 16;
    const int few = M <= 4;  /* a few rows of x: quantized here, one barrier less */
    if (few)
        for (int64_t m = 0; m < M; m++)
            quantize_row((const char*)x + m * x_stride * esize, bf16, K, fmt, xq + m * K,
                         dx + m * nb, xs + m * nb, sx + m * nb);
    #pragma omp parallel num_threads(num_threads)
    {
        if (!few) {
            #pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++)
                quantize_row((const char*)x + m * x_stride * esize, bf16, K, fmt, xq + m * K,
                             dx + m * nb, xs + m * nb, sx + m * nb);
        }
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * 16;
            const int r = N - n0 < 16 ? (int)(N - n0) : 16;
            const __mmask16 rm = (__mmask16)((1u << r) - 1);
            const uint8_t* gw = w + n0 * nb * bb;
            __m512 bv = _mm512_setzero_ps();
            if (bias)
                bv = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                _mm256_maskz_loadu_epi16(rm, (const uint16_t*)bias + n0)), 16))
                          : _mm512_maskz_loadu_ps(rm, (const float*)bias + n0);
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int mr = M - m0 < 4 ? (int)(M - m0) : 4;
                __m512 acc[4] = {bv, bv, bv, bv};
                group(gw, r, nb, xq + m0 * K, dx + m0 * nb, xs + m0 * nb, sx + m0 * nb, K, mr,
                      m0 == 0, acc);
                for (int i = 0; i < mr; i++) {
                    const int64_t o = (m0 + i) * y_stride + n0;
                    if (bf16) _mm256_mask_storeu_epi16((uint16_t*)y + o, rm, f32x16_to_bf16(acc[i]));
                    else _mm512_mask_storeu_ps((float*)y + o, rm, acc[i]);
                }
            }
        }
    }
}
