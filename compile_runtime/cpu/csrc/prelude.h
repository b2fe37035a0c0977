/* The start of every kernel library (compile_runtime/ops/c_library.py): the headers they use
 * and the helpers they share. Include it first: _GNU_SOURCE must come before any system
 * header. */
#pragma once
#define _GNU_SOURCE /* syscall() and aligned_alloc() under -std=c99 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__)
/* Element i of the result: the sum of the 16 elements of v[i]. */
static inline __m512 sum16(const __m512* v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)  /* 128-bit lanes 0-1: v[2i]'s halves summed; 2-3: v[2i+1]'s */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* lane l: four partial sums of v[4i + l] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * i], u[2 * i + 1]),
                             _mm512_unpackhi_ps(u[2 * i], u[2 * i + 1]));
    const __m512d a = _mm512_castps_pd(w[0]), b = _mm512_castps_pd(w[1]);
    /* element 4l + j: the sum of v[4j + l]; put it back in key order */
    const __m512 z = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, z);
}
#endif
