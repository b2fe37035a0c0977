/* Paged decode attention for compile_runtime/backends/attention/cpu_decode_kernel.py
 * (which says what it is for; the README's "On a CPU" what it measured). */
#include "prelude.h"
#include "paged_decode.h"

/* Scores of up to 16 consecutive keys of one block (key j at k + j * row) against one
 * query of D elements: out[j] = scale * dot(q, key j) for j < c. The AVX-512 versions keep
 * one vector of partial sums per key and reduce the 16 vectors together (sum16): a
 * quarter of the shuffles of reducing each key on its own, which is what bound the plain
 * loop. bf16 multiplies bf16 pairs into float32 sums with AVX512-BF16 (exact products,
 * the query needs no widening). Other head sizes, and CPUs without these, take the plain
 * loop. */
static inline void qk_plain_f32(const float* k, int64_t row, int c, const float* q,
                                int64_t D, float scale, float* out) {
    for (int j = 0; j < c; j++) {
        float dot = 0.f;
        _Pragma("omp simd reduction(+:dot)")
        for (int64_t d = 0; d < D; d++) dot += q[d] * k[j * row + d];
        out[j] = dot * scale;
    }
}
static inline void qk_plain_bf16(const uint16_t* k, int64_t row, int c, const uint16_t* q,
                                 int64_t D, float scale, float* out) {
    for (int j = 0; j < c; j++) {
        float dot = 0.f;
        _Pragma("omp simd reduction(+:dot)")
        for (int64_t d = 0; d < D; d++) dot += bf16_to_f32(q[d]) * bf16_to_f32(k[j * row + d]);
        out[j] = dot * scale;
    }
}

#if defined(__AVX512F__)
static inline void qk_f32(const float* k, int64_t row, int c, const float* q, int64_t D,
                          float scale, float* out) {
    if (D % 16 != 0 || D > 256) { qk_plain_f32(k, row, c, q, D, scale, out); return; }
    __m512 acc[16];
    for (int j = 0; j < 16; j++) {
        acc[j] = _mm512_setzero_ps();
        if (j >= c) continue;
        for (int64_t d = 0; d < D; d += 16)
            acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + j * row + d), acc[j]);
    }
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << c) - 1), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* Element i of the result: the sum of the 8 elements of v[i] (three rounds of hadd). */
static inline __m256 sum8(const __m256* v) {
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* The AVX-512 version's scheme with 8-float vectors: 8 keys a reduction. */
static inline void qk_f32(const float* k, int64_t row, int c, const float* q, int64_t D,
                          float scale, float* out) {
    if (D % 8 != 0 || D > 256) { qk_plain_f32(k, row, c, q, D, scale, out); return; }
    for (int j0 = 0; j0 < c; j0 += 8) {
        const int m = c - j0 < 8 ? c - j0 : 8;
        __m256 acc[8];
        for (int j = 0; j < 8; j++) {
            acc[j] = _mm256_setzero_ps();
            if (j >= m) continue;
            for (int64_t d = 0; d < D; d += 8)
                acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + (j0 + j) * row + d), acc[j]);
        }
        float s[8];
        _mm256_storeu_ps(s, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
        memcpy(out + j0, s, sizeof(float) * m);
    }
}
#else
#define qk_f32 qk_plain_f32
#endif

#if defined(__AVX512BF16__)
static inline void qk_bf16(const uint16_t* k, int64_t row, int c, const uint16_t* q,
                           int64_t D, float scale, float* out) {
    if (D % 32 != 0 || D > 256) { qk_plain_bf16(k, row, c, q, D, scale, out); return; }
    __m512 acc[16];
    for (int j = 0; j < 16; j++) {
        acc[j] = _mm512_setzero_ps();
        if (j >= c) continue;
        for (int64_t d = 0; d < D; d += 32)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(q + d),
                                      (__m512bh)_mm512_loadu_si512(k + j * row + d));
    }
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << c) - 1), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}
#else
#define qk_bf16 qk_plain_bf16
#endif

#if defined(__AVX512F__)
/* e^x for x <= 0 (the softmax's shifted scores): x = n ln2 + r with |r| <= ln2 / 2, e^r by
 * Cephes' expf polynomial (about 1 ulp), times 2^n by scalef (which also underflows to 0
 * gracefully). The scalar expf call per score was a quarter of the kernel's time. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(y, n);
}

static void softmax_rows(float* s, int64_t G, int64_t n) {
    for (int64_t g = 0; g < G; g++) {
        float* r = s + g * n;
        __m512 vm = _mm512_set1_ps(-INFINITY);
        int64_t t = 0;
        for (; t + 16 <= n; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(r + t));
        float m = _mm512_reduce_max_ps(vm);
        for (; t < n; t++) m = r[t] > m ? r[t] : m;
        const __m512 vmax = _mm512_set1_ps(m);
        __m512 vsum = _mm512_setzero_ps();
        for (t = 0; t < n; t += 16) {
            const __mmask16 k = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
            const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, r + t), vmax));
            _mm512_mask_storeu_ps(r + t, k, e);
            vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(k, e));
        }
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
        for (t = 0; t < n; t += 16) {
            const __mmask16 k = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
            _mm512_mask_storeu_ps(r + t, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, r + t), inv));
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The AVX-512 exp with 8-float vectors; 2^n is built in the exponent bits (n >= -126 after
 * the clamp, so it never goes subnormal). */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static void softmax_rows(float* s, int64_t G, int64_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t g = 0; g < G; g++) {
        float* r = s + g * n;
        __m256 vm = _mm256_set1_ps(-INFINITY);
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(r + t));
        float lane[8];
        _mm256_storeu_ps(lane, vm);
        float m = lane[0];
        for (int i = 1; i < 8; i++) m = lane[i] > m ? lane[i] : m;
        for (; t < n; t++) m = r[t] > m ? r[t] : m;
        const __m256 vmax = _mm256_set1_ps(m);
        __m256 vsum = _mm256_setzero_ps();
        for (t = 0; t < n; t += 8) {
            const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - t < 8 ? n - t : 8)), lanes);
            const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(r + t, k), vmax)),
                                           _mm256_castsi256_ps(k));
            _mm256_maskstore_ps(r + t, k, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        _mm256_storeu_ps(lane, vsum);
        float sum = 0.f;
        for (int i = 0; i < 8; i++) sum += lane[i];
        const __m256 inv = _mm256_set1_ps(1.f / sum);
        for (t = 0; t < n; t += 8) {
            const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - t < 8 ? n - t : 8)), lanes);
            _mm256_maskstore_ps(r + t, k, _mm256_mul_ps(_mm256_maskload_ps(r + t, k), inv));
        }
    }
}
#else
static void softmax_rows(float* s, int64_t G, int64_t n) {
    for (int64_t g = 0; g < G; g++) {
        float* r = s + g * n;
        float m = r[0];
        for (int64_t t = 1; t < n; t++) m = r[t] > m ? r[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < n; t++) { r[t] = expf(r[t] - m); sum += r[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; t++) r[t] *= inv;
    }
}
#endif


/* One (request, KV head) with GG query heads of size DD: compile-time constants in the
 * specialised copies, so the loops over them unroll into whole vector registers and the
 * value accumulators stay in registers. Keys are walked block by block (no division per
 * key), 16 at a time for the scores (QK: qk_f32 or qk_bf16); cache elements widen to
 * float32 through WIDEN; scores and sums are float32 whatever the cache holds. */
/* The next block's rows of this KV head, asked for while this block is worked on: blocks
 * lie anywhere in the cache, so the hardware prefetcher cannot see them coming. */
#define PREFETCH_BLOCK(base, DD)                                                             \
    for (int64_t pj = 0; pj < bs; pj++)                                                      \
        for (int64_t off = 0; off < (DD) * (int64_t)sizeof(T); off += 64)                    \
            __builtin_prefetch((const char*)((base) + pj * row) + off);

#define ATTEND_ONE(GG, DD, WIDEN)                                                            \
    {                                                                                        \
        int64_t t = 0;                                                                       \
        for (int64_t blk = lo / bs, j0 = lo % bs; t < n; blk++, j0 = 0) {                    \
            const T* kb = k_cache + blocks[blk] * bs * row + kh * (DD);                      \
            if (t + bs < n) PREFETCH_BLOCK(k_cache + blocks[blk + 1] * bs * row + kh * (DD), (DD)); \
            for (int64_t j = j0; j < bs && t < n;) {                                         \
                int64_t c = bs - j < n - t ? bs - j : n - t;                                 \
                c = c < 16 ? c : 16;                                                         \
                for (int64_t g = 0; g < (GG); g++)                                           \
                    QK(kb + j * row, row, (int)c, q + g * (DD), (DD), scale, scores + g * n + t); \
                j += c;                                                                      \
                t += c;                                                                      \
            }                                                                                \
        }                                                                                    \
        if (softcap > 0.f)                                                                   \
            for (int64_t i = 0; i < (GG) * n; i++) scores[i] = softcap * tanhf(scores[i] / softcap); \
        softmax_rows(scores, (GG), n);                                                       \
        float a[(GG) * (DD)];                                                                \
        memset(a, 0, sizeof(a));                                                             \
        t = 0;                                                                               \
        for (int64_t blk = lo / bs, j0 = lo % bs; t < n; blk++, j0 = 0) {                    \
            const T* vb = v_cache + blocks[blk] * bs * row + kh * (DD);                      \
            if (t + bs < n) PREFETCH_BLOCK(v_cache + blocks[blk + 1] * bs * row + kh * (DD), (DD)); \
            for (int64_t j = j0; j < bs && t < n; j++, t++) {                                \
                const T* v = vb + j * row;                                                   \
                for (int64_t g = 0; g < (GG); g++) {                                         \
                    const float p = scores[g * n + t];                                       \
                    _Pragma("omp simd")                                                      \
                    for (int64_t d = 0; d < (DD); d++) a[g * (DD) + d] += p * WIDEN(v[d]);   \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int64_t i = 0; i < (GG) * (DD); i++) o[i] = NARROW(a[i]);                       \
    }

/*
 * query  [tokens, H, D] with row stride q_stride; query b is row tokens[b] (tokens NULL:
 *        row b).
 * caches [num_blocks, bs, KVH, D] contiguous. Query b belongs to request reqs[b] of the step
 * (reqs NULL: request b / q_len): that request's seq_lens[r] keys lie in the blocks of row
 * r of block_table (int32, rows bt_stride apart). q_len: the query tokens of each request
 * when reqs is NULL (a uniform batch: 1 for decodes, 1 + k under speculative decoding),
 * the newest q_len positions of the request, each seeing the keys up to its own position;
 * with reqs, 1 (each query is its request's newest token). A query that sees no key (a
 * padded request, of length 0) gets zeros.
 * out    [tokens, H, D] with row stride out_stride.
 * params [2]: scale, softcap (a pointer, so that every argument is an integer or a pointer
 * and a CPU graph can replay the call). Query head h attends with KV head h / (H / KVH).
 * softcap > 0: scaled scores become softcap * tanh(score / softcap) (Gemma 2). window > 0:
 * only the last `window` keys are visible. num_threads: torch's count, passed in so that an
 * OpenMP runtime other than torch's would still use it. Requests differ in length, so
 * (request, KV head) pairs are handed out dynamically, four at a time when there are
 * plenty (one at a time otherwise: at batch 1 a chunk of four was all three of
 * SmolLM2's pairs, on one thread).
 * One body, two element types: paged_decode_f32 (float) and paged_decode_bf16 (uint16_t
 * holding bfloat16).
 */
#define DEFINE_PAGED_DECODE(NAME)                                                            \
void NAME(const T* query, int64_t q_stride, const T* key, int64_t key_stride,               \
          const T* value, int64_t value_stride, const int64_t* slots,                       \
          int64_t num_new_tokens, T* k_cache, T* v_cache, const int32_t* block_table,       \
          int64_t bt_stride, const int32_t* seq_lens, const int64_t* reqs,                  \
          const int64_t* tokens, T* out, int64_t out_stride, int64_t B, int64_t q_len,      \
          int64_t H, int64_t KVH, int64_t D, int64_t bs, const float* params,               \
          int64_t window, int64_t num_threads) {                                            \
    const int64_t G = H / KVH, row = KVH * D;                                                \
    const float scale = params[0], softcap = params[1];                                      \
    for (int64_t t = 0; t < num_new_tokens; t++) { /* the step's keys/values; slot < 0:   \
                                                      the null block */                     \
        const int64_t s = slots[t] < 0 ? 0 : slots[t];                                       \
        memcpy(k_cache + s * row, key + t * key_stride, row * sizeof(T));                    \
        memcpy(v_cache + s * row, value + t * value_stride, row * sizeof(T));                \
    }                                                                                        \
    const int chunk = B * KVH >= 8 * num_threads ? 4 : 1;                                  \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, chunk) num_threads(num_threads)") \
    for (int64_t b = 0; b < B; b++) {                                                        \
        for (int64_t kh = 0; kh < KVH; kh++) {                                               \
            const int64_t r = reqs ? reqs[b] : b / q_len;                                    \
            /* a request's earlier queries see fewer keys: causal among its q_len */          \
            const int64_t S = seq_lens[r] - (reqs ? 0 : q_len - 1 - b % q_len);              \
            const int64_t lo = (window > 0 && S > window) ? S - window : 0;                  \
            const int64_t n = S - lo;                                                        \
            const int64_t tok = tokens ? tokens[b] : b;                                      \
            const T* q = query + tok * q_stride + kh * G * D;                                \
            T* o = out + tok * out_stride + kh * G * D;                                      \
            if (n <= 0) {                                                                    \
                for (int64_t i = 0; i < G * D; i++) o[i] = NARROW(0.f);                      \
                continue;                                                                    \
            }                                                                                \
            float* scores = (float*)malloc(sizeof(float) * G * n);                           \
            const int32_t* blocks = block_table + r * bt_stride;                             \
            if (D == 64 && G == 1) ATTEND_ONE(1, 64, WIDEN_T)                                \
            else if (D == 64 && G == 2) ATTEND_ONE(2, 64, WIDEN_T)                           \
            else if (D == 64 && G == 3) ATTEND_ONE(3, 64, WIDEN_T)                           \
            else if (D == 64 && G == 4) ATTEND_ONE(4, 64, WIDEN_T)                           \
            else if (D == 128 && G == 1) ATTEND_ONE(1, 128, WIDEN_T)                         \
            else if (D == 128 && G == 2) ATTEND_ONE(2, 128, WIDEN_T)                         \
            else if (D == 128 && G == 4) ATTEND_ONE(4, 128, WIDEN_T)                         \
            else ATTEND_ONE(G, D, WIDEN_T)                                                   \
            free(scores);                                                                    \
        }                                                                                    \
    }                                                                                        \
}

#define T float
#define WIDEN_T f32_to_f32
#define NARROW f32_to_f32
#define QK qk_f32
DEFINE_PAGED_DECODE(paged_decode_f32)
#undef T
#undef WIDEN_T
#undef NARROW
#undef QK

#define T uint16_t
#define WIDEN_T bf16_to_f32
#define NARROW f32_to_bf16
#define QK qk_bf16
DEFINE_PAGED_DECODE(paged_decode_bf16)
#undef T
#undef WIDEN_T
#undef NARROW
#undef QK
