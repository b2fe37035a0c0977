/* What amx_linear.c exports: each function's one declaration, which amx_linear.c is checked
 * against and ctypes is typed from (compile_runtime/ops/c_header.py). uint16_t holds
 * bfloat16. Without AMX-BF16 the functions are empty and amx_enable() returns 0. */
#pragma once
#include <stdint.h>

/* 1 when Linux grants this process AMX's tile state, else 0. */
int amx_enable(void);
/* w [N, K] into AMX's tile layout (N % 16 == 0, K % 32 == 0). */
void amx_pack_bf16(const uint16_t* w, uint16_t* packed, int64_t N, int64_t K);
/* y [M, N] = x [M, K] . w^T (+ bias [N], or NULL) from amx_pack_bf16's packed w; M <= 64. */
void amx_linear_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                     const uint16_t* bias, uint16_t* y, int64_t y_stride, int64_t M, int64_t N,
                     int64_t K, int64_t num_threads);
