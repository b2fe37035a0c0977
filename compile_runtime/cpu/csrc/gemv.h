/* What gemv.c exports: each function's one declaration, which gemv.c is checked against and
 * ctypes is typed from (compile_runtime/ops/c_header.py). uint16_t holds bfloat16. */
#pragma once
#include <stdint.h>

/* y [M, N] = x [M, K] . w^T (+ bias [N], or NULL): x and y rows x_stride and y_stride apart,
 * w contiguous. Defined only where gemv_has_f32() / gemv_has_bf16() say so. */
void gemv_f32(const float* x, int64_t x_stride, const float* w, const float* bias, float* y,
              int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t num_threads);
void gemv_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w, const uint16_t* bias,
               uint16_t* y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
               int64_t num_threads);
int gemv_has_f32(void);
int gemv_has_bf16(void);
