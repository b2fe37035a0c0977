/* What paged_decode.c exports: each function's one declaration, which paged_decode.c is
 * checked against and ctypes is typed from (compile_runtime/ops/c_header.py). The arguments
 * are described in paged_decode.c, above DEFINE_PAGED_DECODE. */
#pragma once
#include <stdint.h>

void paged_decode_f32(const float* query, int64_t q_stride, const float* key,
                      int64_t key_stride, const float* value, int64_t value_stride,
                      const int64_t* slots, int64_t num_new_tokens, float* k_cache,
                      float* v_cache, const int32_t* block_table, int64_t bt_stride,
                      const int32_t* seq_lens, const int64_t* reqs, const int64_t* tokens,
                      float* out, int64_t out_stride, int64_t B, int64_t q_len, int64_t H,
                      int64_t KVH, int64_t D, int64_t bs, const float* params, int64_t window,
                      int64_t num_threads);
/* The same with the cache, queries, new keys and values and outputs in bfloat16 (uint16_t). */
void paged_decode_bf16(const uint16_t* query, int64_t q_stride, const uint16_t* key,
                       int64_t key_stride, const uint16_t* value, int64_t value_stride,
                       const int64_t* slots, int64_t num_new_tokens, uint16_t* k_cache,
                       uint16_t* v_cache, const int32_t* block_table, int64_t bt_stride,
                       const int32_t* seq_lens, const int64_t* reqs, const int64_t* tokens,
                       uint16_t* out, int64_t out_stride, int64_t B, int64_t q_len, int64_t H,
                       int64_t KVH, int64_t D, int64_t bs, const float* params, int64_t window,
                       int64_t num_threads);
