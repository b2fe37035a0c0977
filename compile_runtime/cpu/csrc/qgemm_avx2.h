/* The quantized GEMM's body for CPUs with AVX2 but not AVX512-VNNI (AMD Zen 3, Intel before
 * Ice Lake; included by qgemm.c after the prelude): the layout and arithmetic of
 * qgemm_avx512.h 8 rows a register, so a group of 16 rows is two halves.
 *
 * AVX2 has no vpdpbusd: vpmaddubsw multiplies unsigned by signed bytes into saturating int16
 * pairs, then vpmaddwd sums pairs to int32. Q4's nibbles (0..15) times x (|q| <= 127) stay
 * below 2^15 even summed over a whole block, so a block takes one vpmaddwd. Q8_0's stored
 * bytes are the quants plus 128: flipped back to signed, the pair sums go through |w|
 * (0..128, unsigned) times x with w's sign (|x| <= 127), at most 2 * 128 * 127 < 2^15, so
 * nothing saturates and the sums are exact, as with VNNI. */
#define PF 2048
enum { Q80 = 0, Q40 = 1, Q41 = 2 };
static const int BLOCK_BYTES[3] = {34, 18, 20};

static inline float fp16_round(float f) { return _cvtsh_ss(_cvtss_sh(f, 0)); }

static inline __m256 load8(const void* x, int bf16, int64_t i) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)x + i))), 16));
    return _mm256_loadu_ps((const float*)x + i);
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* As the AVX512 version, but Q8_0's start value is 0: its weights are made signed. */
static void quantize_row(const void* x, int bf16, int64_t K, int fmt, int8_t* xq, float* dx,
                         int32_t* start, float* sx) {
    const int64_t nb = K / 32;
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = load8(x, bf16, b * 32 + 8 * j);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
        }
        const float amax = hmax8(m);
        const float d = amax / 127.f;
        const __m256 vid = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
        __m256i q[4];  /* rounded to nearest even (the default rounding mode) */
        for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vid));
        const int32_t sum = hsum8(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                                   _mm256_add_epi32(q[2], q[3])));
        /* the packs interleave 128-bit lanes: dwords come out as q0 q1 q2 q3 per half */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                 _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i*)(xq + b * 32), _mm256_permutevar8x32_epi32(bytes, order));
        dx[b] = fp16_round(d);
        start[b] = fmt == Q40 ? -8 * sum : 0;
        sx[b] = fmt == Q41 ? fp16_round(d * (float)sum) : 0.f;
    }
}

/* 8 floats to bfloat16, rounded to nearest even as torch does (NaN stays NaN). */
static inline __m128i f32x8_to_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i top = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(
        _mm256_set1_epi32(0x7fff), _mm256_and_si256(top, _mm256_set1_epi32(1)))), 16);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)),
                           _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* 8 float16 values at p (n of them, 1..8; the rest 0) as floats. */
static inline __m256 load_halves(const uint8_t* p, int n) {
    if (n >= 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    uint16_t t[8] = {0};
    memcpy(t, p, 2 * n);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)t));
}

/* Lanes 0..n-1 set (n may be <= 0 or >= 8). */
static inline __m256i lane_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* 32 bytes of quants: 8 rows' dwords of one chunk (only the rows in ``mask`` unless full). */
static inline __m256i chunk(const uint8_t* p, int full, __m256i mask) {
    return full ? _mm256_loadu_si256((const __m256i*)p) : _mm256_maskload_epi32((const int*)p, mask);
}

/* One group of r (1..16) weight rows times MR (1..4) rows of quantized x: acc[2i + h]
 * lane l = row 8h + l's sum for x row i. A row's 4 bytes of a chunk are one dword, so a
 * group with fewer than 16 rows loads its chunks with dword masks. */
static inline __attribute__((always_inline)) void qgroup(
        const uint8_t* gw, const int FMT, const int r, const int64_t nb, const int8_t* xq,
        const float* dx, const int32_t* xs, const float* sx, const int64_t K, const int MR,
        const int pf, __m256* acc) {
    const int64_t qb = FMT == Q80 ? 32 * r : 16 * r;
    const uint8_t* scales = gw;
    const uint8_t* mins = gw + 2 * nb * r;
    const uint8_t* quants = gw + (FMT == Q41 ? 4 : 2) * nb * r;
    const int full = r == 16, halves = r > 8 ? 2 : 1;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const __m256i lm[2] = {lane_mask(r), lane_mask(r - 8)};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* q = quants + b * qb;
        if (pf)
            for (int64_t o = 0; o < qb; o += 64) _mm_prefetch((const char*)q + PF + o, _MM_HINT_T0);
        for (int h = 0; h < halves; h++) {
            const int n = r - 8 * h;
            const __m256 dw = load_halves(scales + 2 * (r * b + 8 * h), n);
            const __m256 mw = FMT == Q41 ? load_halves(mins + 2 * (r * b + 8 * h), n)
                                         : _mm256_setzero_ps();
            const uint8_t* qh = q + 32 * h;
            _Pragma("GCC unroll 4")
            for (int i = 0; i < MR; i++) {
                const int8_t* xb = xq + i * K + b * 32;
                int32_t x4[8];
                memcpy(x4, xb, 32);
                __m256i t;
                if (FMT == Q80) {
                    __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();
                    _Pragma("GCC unroll 8")
                    for (int k = 0; k < 8; k += 2) {
                        const __m256i w0 = _mm256_xor_si256(chunk(qh + 4 * r * k, full, lm[h]), flip);
                        const __m256i w1 = _mm256_xor_si256(chunk(qh + 4 * r * (k + 1), full, lm[h]), flip);
                        t0 = _mm256_add_epi32(t0, _mm256_madd_epi16(_mm256_maddubs_epi16(
                            _mm256_abs_epi8(w0), _mm256_sign_epi8(_mm256_set1_epi32(x4[k]), w0)), ones));
                        t1 = _mm256_add_epi32(t1, _mm256_madd_epi16(_mm256_maddubs_epi16(
                            _mm256_abs_epi8(w1), _mm256_sign_epi8(_mm256_set1_epi32(x4[k + 1]), w1)), ones));
                    }
                    t = _mm256_add_epi32(t0, t1);
                } else {
                    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                    _Pragma("GCC unroll 4")
                    for (int j = 0; j < 4; j++) {
                        const __m256i packed = chunk(qh + 4 * r * j, full, lm[h]);
                        s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(
                            _mm256_and_si256(packed, low), _mm256_set1_epi32(x4[2 * j])));
                        s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(
                            _mm256_and_si256(_mm256_srli_epi16(packed, 4), low),
                            _mm256_set1_epi32(x4[2 * j + 1])));
                    }
                    t = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones),
                                         _mm256_set1_epi32(xs[i * nb + b]));
                }
                const __m256 s = _mm256_mul_ps(dw, _mm256_set1_ps(dx[i * nb + b]));
                __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), s, acc[2 * i + h]);
                if (FMT == Q41) a = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[i * nb + b]), a);
                acc[2 * i + h] = a;
            }
        }
    }
}

#define DEFINE_GROUP(NAME, FMT)                                                               \
static void NAME(const uint8_t* gw, int r, int64_t nb, const int8_t* xq, const float* dx,    \
                 const int32_t* xs, const float* sx, int64_t K, int MR, int pf, __m256* acc) { \
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
                         const int32_t*, const float*, int64_t, int, int, __m256*);

/* n (1..8) floats of v to y (bf16 or f32) at element o. */
static inline void store8(void* y, int bf16, int64_t o, __m256 v, int n) {
    if (bf16) {
        const __m128i h = f32x8_to_bf16(v);
        if (n >= 8) _mm_storeu_si128((__m128i*)((uint16_t*)y + o), h);
        else { uint16_t t[8]; _mm_storeu_si128((__m128i*)t, h); memcpy((uint16_t*)y + o, t, 2 * n); }
    } else if (n >= 8) {
        _mm256_storeu_ps((float*)y + o, v);
    } else {
        _mm256_maskstore_ps((float*)y + o, lane_mask(n), v);
    }
}

/* n (1..8) bias values (bf16 or f32) from element o, the rest 0. */
static inline __m256 load_bias8(const void* bias, int bf16, int64_t o, int n) {
    if (bf16) {
        uint16_t t[8] = {0};
        memcpy(t, (const uint16_t*)bias + o, 2 * (n < 8 ? n : 8));
        return load8(t, 1, 0);
    }
    return n >= 8 ? _mm256_loadu_ps((const float*)bias + o)
                  : _mm256_maskload_ps((const float*)bias + o, lane_mask(n));
}

/* As the AVX512 qgemm. */
void qgemm(const void* x, int64_t x_stride, int bf16, const uint8_t* w, int fmt,
           const void* bias, void* y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
           int64_t num_threads) {
    const int64_t nb = K / 32, esize = bf16 ? 2 : 4, bb = BLOCK_BYTES[fmt];
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
    const int few = M <= 4;
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
            const uint8_t* gw = w + n0 * nb * bb;
            __m256 bv[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            if (bias)
                for (int h = 0; h < 2 && 8 * h < r; h++)
                    bv[h] = load_bias8(bias, bf16, n0 + 8 * h, r - 8 * h);
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int mr = M - m0 < 4 ? (int)(M - m0) : 4;
                __m256 acc[8];
                for (int i = 0; i < 8; i++) acc[i] = bv[i % 2];
                group(gw, r, nb, xq + m0 * K, dx + m0 * nb, xs + m0 * nb, sx + m0 * nb, K, mr,
                      m0 == 0, acc);
                for (int i = 0; i < mr; i++)
                    for (int h = 0; h < 2 && 8 * h < r; h++)
                        store8(y, bf16, (m0 + i) * y_stride + n0 + 8 * h, acc[2 * i + h], r - 8 * h);
            }
        }
    }
}
