/* The quantized GEMM of compile_runtime/ops/cpu_quant_gemm.py (which says what it computes
 * and why the layout is so): its body for AVX512-VNNI or AVX2, and qrows. */
#include "prelude.h"
#include "qgemm.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
#include "qgemm_avx512.h"
#define QGEMM_ISA 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "qgemm_avx2.h"
#define QGEMM_ISA 2
#endif

#if defined(QGEMM_ISA)
/* Rows ids[0..n) of a packed quantized table w [N, K / 32 blocks], dequantized: out [n, K]
 * (bf16 or f32), each value d * q (Q4_1: d * q + m) in float32 as dequantize computes it.
 * Returns how many ids are outside [0, N); then nothing is written. */
int64_t qrows(const uint8_t* w, int fmt, int64_t N, int64_t K, const int64_t* ids, int64_t n,
              void* out, int bf16) {
    const int64_t nb = K / 32, bb = BLOCK_BYTES[fmt], sb = fmt == Q41 ? 4 : 2;
    int64_t bad = 0;
    for (int64_t t = 0; t < n; t++) bad += ids[t] < 0 || ids[t] >= N;
    if (bad) return bad;
    for (int64_t t = 0; t < n; t++) {
        const int64_t row = ids[t], n0 = row / 16 * 16, l = row - n0;
        const int64_t r = N - n0 < 16 ? N - n0 : 16;
        const uint8_t* gw = w + n0 * nb * bb;
        const uint8_t* quants = gw + sb * nb * r;
        for (int64_t b = 0; b < nb; b++) {
            uint16_t h;
            memcpy(&h, gw + 2 * (b * r + l), 2);
            const float d = _cvtsh_ss(h);
            float m = 0.f;
            if (fmt == Q41) { memcpy(&h, gw + 2 * nb * r + 2 * (b * r + l), 2); m = _cvtsh_ss(h); }
            const uint8_t* q = quants + b * r * (fmt == Q80 ? 32 : 16);
            for (int e = 0; e < 32; e++) {
                const int k = e / 4, i = e % 4;
                float v;
                if (fmt == Q80) {
                    v = d * (float)((int)q[4 * r * k + 4 * l + i] - 128);
                } else {
                    const uint8_t byte = q[4 * r * (k / 2) + 4 * l + i];
                    const int nib = k % 2 ? byte >> 4 : byte & 0x0F;
                    v = fmt == Q40 ? d * (float)(nib - 8) : d * (float)nib + m;
                }
                const int64_t o = t * K + b * 32 + e;
                if (bf16) ((uint16_t*)out)[o] = f32_to_bf16(v);
                else ((float*)out)[o] = v;
            }
        }
    }
    return 0;
}
int qgemm_available(void) { return QGEMM_ISA; }
#else
int qgemm_available(void) { return 0; }
#endif
