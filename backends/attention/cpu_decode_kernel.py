"""A paged decode-attention kernel in C for CPUs, compiled on first use.

Decode attention with torch ops must first gather each request's keys and
values out of their blocks into one padded tensor (``index_select``), then run
SDPA over the copy: the cached keys and values cross memory twice, and on 2
cores the gather alone was 40-50% of the attention time. This kernel reads
the blocks in place through the block table: per (request, KV head), one pass
for the scores of every query head sharing that KV head (so grouped-query
attention reads each key once), a softmax, one pass over the values. It also
writes the step's new keys and values into their slots first, so a layer's
decode is one call. The common head shapes (head size 64 or 128, 1-4 query
heads per KV head) get copies with both sizes known at compile time: their
loops unroll into whole vector registers and the value accumulators stay in
registers, 0.75x the time of the generic loop on SmolLM2's shape (64 requests
of ~215 keys, 9/3 heads of 64), with bit-identical results.

It is built and cached by ``ops/c_library.py`` (OpenMP over (request, KV head)
on torch's own OpenMP runtime). Without a compiler, or if the build fails,
``load_decode_kernel()`` returns None once with a warning and the backend
computes the same thing with torch ops.

float32 (``paged_decode_f32``) and bfloat16 (``paged_decode_bf16``: the cache, queries
and outputs in bf16, scores, softmax and sums in float32) from one body; float16 takes
the torch path.
"""

from __future__ import annotations

import ctypes
import functools

from compile_runtime.ops.c_library import load_c_library

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* One (request, KV head) with GG query heads of size DD: compile-time constants in the
 * specialised copies, so the loops over them unroll into whole vector registers and the
 * value accumulators stay in registers. Keys are walked block by block (no division per
 * key). qf: the G queries in float32; cache elements widen to float32 through WIDEN;
 * scores and sums are float32 whatever the cache holds. */
#define ATTEND_ONE(GG, DD, WIDEN)                                                            \
    {                                                                                        \
        int64_t t = 0;                                                                       \
        for (int64_t blk = lo / bs, j0 = lo % bs; t < n; blk++, j0 = 0) {                    \
            const T* kb = k_cache + blocks[blk] * bs * row + kh * (DD);                      \
            for (int64_t j = j0; j < bs && t < n; j++, t++) {                                \
                const T* k = kb + j * row;                                                   \
                for (int64_t g = 0; g < (GG); g++) {                                         \
                    const float* qg = qf + g * (DD);                                         \
                    float dot = 0.f;                                                         \
                    _Pragma("omp simd reduction(+:dot)")                                     \
                    for (int64_t d = 0; d < (DD); d++) dot += qg[d] * WIDEN(k[d]);           \
                    const float x = dot * scale;                                             \
                    scores[g * n + t] = softcap > 0.f ? softcap * tanhf(x / softcap) : x;    \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        softmax_rows(scores, (GG), n);                                                       \
        float a[(GG) * (DD)];                                                                \
        memset(a, 0, sizeof(a));                                                             \
        t = 0;                                                                               \
        for (int64_t blk = lo / bs, j0 = lo % bs; t < n; blk++, j0 = 0) {                    \
            const T* vb = v_cache + blocks[blk] * bs * row + kh * (DD);                      \
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
 * query  [tokens, H, D] with row stride q_stride; request b's query is row tokens[b].
 * caches [num_blocks, bs, KVH, D] contiguous; block_ids [B, nb]; seq_lens [B].
 * out    [tokens, H, D] with row stride out_stride.
 * Query head h attends with KV head h / (H / KVH). softcap > 0: scaled scores
 * become softcap * tanh(score / softcap) (Gemma 2). window > 0: only the last
 * `window` keys are visible. num_threads: torch's count, passed in so that an OpenMP
 * runtime other than torch's would still use it. Requests differ in length, so
 * (request, KV head) pairs are handed out dynamically, four at a time.
 * One body, two element types: paged_decode_f32 (float) and paged_decode_bf16 (uint16_t
 * holding bfloat16).
 */
#define DEFINE_PAGED_DECODE(NAME)                                                            \
void NAME(const T* query, int64_t q_stride, const T* key, int64_t key_stride,               \
          const T* value, int64_t value_stride, const int64_t* slots,                       \
          int64_t num_new_tokens, T* k_cache, T* v_cache, const int64_t* block_ids,         \
          int64_t nb, const int64_t* seq_lens, const int64_t* tokens, T* out,               \
          int64_t out_stride, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,     \
          float scale, float softcap, int64_t window, int64_t num_threads) {                \
    const int64_t G = H / KVH, row = KVH * D;                                                \
    for (int64_t t = 0; t < num_new_tokens; t++) { /* the step's keys/values; slot < 0:   \
                                                      the null block */                     \
        const int64_t s = slots[t] < 0 ? 0 : slots[t];                                       \
        memcpy(k_cache + s * row, key + t * key_stride, row * sizeof(T));                    \
        memcpy(v_cache + s * row, value + t * value_stride, row * sizeof(T));                \
    }                                                                                        \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 4) num_threads(num_threads)")   \
    for (int64_t b = 0; b < B; b++) {                                                        \
        for (int64_t kh = 0; kh < KVH; kh++) {                                               \
            const int64_t S = seq_lens[b];                                                   \
            const int64_t lo = (window > 0 && S > window) ? S - window : 0;                  \
            const int64_t n = S - lo;                                                        \
            float* scores = (float*)malloc(sizeof(float) * (G * n + G * D));                 \
            float* qf = scores + G * n;                                                      \
            const T* q = query + tokens[b] * q_stride + kh * G * D;                          \
            for (int64_t i = 0; i < G * D; i++) qf[i] = WIDEN_T(q[i]);                      \
            T* o = out + tokens[b] * out_stride + kh * G * D;                                \
            const int64_t* blocks = block_ids + b * nb;                                      \
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
DEFINE_PAGED_DECODE(paged_decode_f32)
#undef T
#undef WIDEN_T
#undef NARROW

#define T uint16_t
#define WIDEN_T bf16_to_f32
#define NARROW f32_to_bf16
DEFINE_PAGED_DECODE(paged_decode_bf16)
#undef T
#undef WIDEN_T
#undef NARROW
"""


@functools.cache
def load_decode_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (with one warning) if it cannot be built here."""
    lib = load_c_library("paged_decode", SOURCE, "CPU decode attention")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.paged_decode_f32, lib.paged_decode_bf16):
        fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr]
        fn.argtypes += [i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_float, i64, i64]
        fn.restype = None
    return lib
