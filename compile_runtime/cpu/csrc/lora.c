/* Batched LoRA for a CPU step (the punica idea: each token through its own adapter's
 * A then B, added to the base layer's output), one call per linear layer. Tokens without
 * an adapter (slot -1) cost nothing; a step with none returns before any work. The
 * shrink (x . A^T, r values per token and sub-layer) is done first into a scratch buffer,
 * then the expand adds B . h into y; both spread over the threads by flat index. */
#include "prelude.h"
#include "lora.h"

/* Work below this many multiply-adds runs on the calling thread. */
#define PARALLEL_WORK 32768
/* Output columns one expand task adds at a time (a float accumulator each). */
#define EXPAND_CHUNK 64

#define DEFINE_LORA_ADD(NAME, T, LOAD, STORE)                                                  \
    static inline float NAME##_dot(const T* w, const T* v, int64_t len) {                      \
        float acc = 0.0f;                                                                      \
        _Pragma("omp simd reduction(+ : acc)") for (int64_t i = 0; i < len; i++)               \
            acc += LOAD(w[i]) * LOAD(v[i]);                                                    \
        return acc;                                                                            \
    }                                                                                          \
    void NAME(const T* x, int64_t x_stride, T* y, int64_t y_stride, int64_t n,                 \
              const int32_t* token_slot, const T* a, const T* b, const int32_t* ranks,         \
              const int32_t* sub_of, int64_t num_subs, int64_t max_rank, int64_t in,           \
              int64_t out, int64_t num_threads) {                                              \
        int64_t active = 0;                                                                    \
        for (int64_t t = 0; t < n; t++) active += token_slot[t] >= 0;                          \
        if (!active) return;                                                                   \
        const int64_t per_token = num_subs * max_rank;                                         \
        float* h = (float*)malloc(sizeof(float) * (size_t)(n * per_token));                    \
        if (!h) abort();                                                                       \
        const int64_t shrink = n * per_token;                                                  \
        const int shrink_threads = active * per_token * in >= PARALLEL_WORK ? (int)num_threads : 1; \
        _Pragma("omp parallel for num_threads(shrink_threads) schedule(static)")               \
        for (int64_t i = 0; i < shrink; i++) {                                                 \
            const int64_t t = i / per_token, j = (i / max_rank) % num_subs, k = i % max_rank;  \
            const int32_t s = token_slot[t];                                                   \
            h[i] = (s >= 0 && k < ranks[s * num_subs + j])                                     \
                       ? NAME##_dot(a + ((s * num_subs + j) * max_rank + k) * in,              \
                                    x + t * x_stride, in)                                      \
                       : 0.0f;                                                                 \
        }                                                                                      \
        /* The expand: B is stored k-major ([slots, max_rank, out]), so each token adds         \
         * h[k] * B[k, cols] over contiguous columns, in chunks that stay inside one part. */   \
        int64_t chunk_start[out / EXPAND_CHUNK + num_subs + 1];                                 \
        int64_t chunk_part[out / EXPAND_CHUNK + num_subs + 1];                                  \
        int64_t chunks = 0;                                                                     \
        for (int64_t o = 0; o < out;) {                                                         \
            const int64_t j = sub_of[o];                                                        \
            int64_t end = o;                                                                    \
            while (end < out && end - o < EXPAND_CHUNK && sub_of[end] == j) end++;              \
            chunk_start[chunks] = o;                                                            \
            chunk_part[chunks++] = j;                                                           \
            o = end;                                                                            \
        }                                                                                       \
        chunk_start[chunks] = out;                                                              \
        const int64_t expand = n * chunks;                                                      \
        const int expand_threads = active * out * max_rank >= PARALLEL_WORK ? (int)num_threads : 1; \
        _Pragma("omp parallel for num_threads(expand_threads) schedule(static)")               \
        for (int64_t i = 0; i < expand; i++) {                                                 \
            const int64_t t = i / chunks, c = i % chunks;                                      \
            const int32_t s = token_slot[t];                                                   \
            if (s < 0) continue;                                                               \
            const int64_t j = chunk_part[c], c0 = chunk_start[c], len = chunk_start[c + 1] - c0; \
            const int32_t r = ranks[s * num_subs + j];                                         \
            if (!r) continue;                                                                  \
            const float* hj = h + t * per_token + j * max_rank;                                \
            float acc[EXPAND_CHUNK] = {0};                                                     \
            for (int32_t k = 0; k < r; k++) {                                                  \
                const float hk = hj[k];                                                        \
                const T* row = b + (s * max_rank + k) * out + c0;                              \
                _Pragma("omp simd") for (int64_t o = 0; o < len; o++) acc[o] += hk * LOAD(row[o]); \
            }                                                                                  \
            T* target = y + t * y_stride + c0;                                                 \
            for (int64_t o = 0; o < len; o++) target[o] = STORE(LOAD(target[o]) + acc[o]);    \
        }                                                                                      \
        free(h);                                                                               \
    }

DEFINE_LORA_ADD(lora_add_f32, float, f32_to_f32, f32_to_f32)
DEFINE_LORA_ADD(lora_add_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
