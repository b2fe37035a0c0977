/* What lora.c exports (compile_runtime/ops/c_header.py types ctypes from these lines).
 * uint16_t holds bfloat16.
 *
 * y[t, o] += B[s, :r, o] . (A[s, j, :r, :] . x[t])  for every token t whose adapter slot
 * s = token_slot[t] is >= 0, where j = sub_of[o] is the fused sub-layer output column o
 * belongs to (q/k/v, gate/up; 0 for a plain layer) and r = ranks[s * num_subs + j] (0: the
 * adapter leaves that sub-layer alone). A [slots, num_subs, max_rank, in] and B
 * [slots, max_rank, out] (B^T per slot) are contiguous; x and y rows are x_stride and
 * y_stride apart. */
#pragma once
#include <stdint.h>

void lora_add_f32(const float* x, int64_t x_stride, float* y, int64_t y_stride, int64_t n,
                  const int32_t* token_slot, const float* a, const float* b,
                  const int32_t* ranks, const int32_t* sub_of, int64_t num_subs,
                  int64_t max_rank, int64_t in, int64_t out, int64_t num_threads);
void lora_add_bf16(const uint16_t* x, int64_t x_stride, uint16_t* y, int64_t y_stride,
                   int64_t n, const int32_t* token_slot, const uint16_t* a, const uint16_t* b,
                   const int32_t* ranks, const int32_t* sub_of, int64_t num_subs,
                   int64_t max_rank, int64_t in, int64_t out, int64_t num_threads);
