/* Batched LoRA for a CPU step (the punica idea: each token through its own adapter's
 * A then B, added to the base layer's output), one call per linear layer. Tokens without
 * an adapter (slot -1) cost nothing; a step with none returns before any work. The
 * shrink (x . A^T, r values per token and sub-layer) is done first into a scratch buffer,
 * then the expand adds B . h into y; both spread over the threads by flat index. */
#include "prelude.h"
#include "lora.h"

/* Work below this many multiply-adds runs on the calling thread. */
#define PARALLEL_WORK 32768

#define DEFINE_LORA_ADD(NAME, T, LOAD, STORE)                                                  \
    static inline float NAME##_dot(const T* w, const T* v, int64_t len) {                      \
        float acc = 0.0f;                                                                      \
        _Pragma("omp simd reduction(+ : acc)") for (int64_t i = 0; i < len; i++)               \
            acc += LOAD(w[i]) * LOAD(v[i]);                                                    \
        return acc;                                                                            \
    }                                                                                          \
    static inline float NAME##_dot_h(const T* w, const float* h, int64_t len) {                \
        float acc = 0.0f;                                                                      \
        _Pragma("omp simd reduction(+ : acc)") for (int64_t i = 0; i < len; i++)               \
            acc += LOAD(w[i]) * h[i];                                                          \
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
        const int64_t expand = n * out;                                                        \
        const int expand_threads = active * out * max_rank >= PARALLEL_WORK ? (int)num_threads : 1; \
        _Pragma("omp parallel for num_threads(expand_threads) schedule(static)")               \
        for (int64_t i = 0; i < expand; i++) {                                                 \
            const int64_t t = i / out, o = i % out;                                            \
            const int32_t s = token_slot[t];                                                   \
            if (s < 0) continue;                                                               \
            const int64_t j = sub_of[o];                                                       \
            const int32_t r = ranks[s * num_subs + j];                                         \
            if (!r) continue;                                                                  \
            T* target = y + t * y_stride + o;                                                  \
            *target = STORE(LOAD(*target) +                                                    \
                            NAME##_dot_h(b + (s * out + o) * max_rank, h + t * per_token + j * max_rank, r)); \
        }                                                                                      \
        free(h);                                                                               \
    }

DEFINE_LORA_ADD(lora_add_f32, float, f32_to_f32, f32_to_f32)
DEFINE_LORA_ADD(lora_add_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
