/* What qgemm.c exports: each function's one declaration, which qgemm.c is checked against and
 * ctypes is typed from (compile_runtime/ops/c_header.py). fmt: 0 Q8_0, 1 Q4_0, 2 Q4_1; bf16:
 * 1 when x, bias, y and out hold bfloat16, 0 for float32. */
#pragma once
#include <stdint.h>

/* The instruction set the kernels were built for: 1 AVX512-VNNI, 2 AVX2, 0 none (then
 * qgemm and qrows are not defined). */
int qgemm_available(void);
/* y [M, N] (rows y_stride apart) = x [M, K] (rows x_stride apart) times the packed quantized
 * w [N, K / 32 blocks] (+ bias [N], or NULL). */
void qgemm(const void* x, int64_t x_stride, int bf16, const uint8_t* w, int fmt,
           const void* bias, void* y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
           int64_t num_threads);
/* Rows ids[0..n) of the packed table w [N, K / 32 blocks], dequantized into out [n, K];
 * returns how many ids are outside [0, N) (then nothing is written). */
int64_t qrows(const uint8_t* w, int fmt, int64_t N, int64_t K, const int64_t* ids, int64_t n,
              void* out, int bf16);
