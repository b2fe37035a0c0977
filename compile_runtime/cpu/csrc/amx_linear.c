/* The AMX bf16 linear layers of compile_runtime/ops/cpu_amx.py (which says what they are
 * for; the README's "On a CPU" what they measured). */
#include "prelude.h"
#include "amx_linear.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define PREFETCH 8192  /* bytes ahead in each weight stream, as in the GEMV */

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands out AMX's tile state only to a process that asks for it. */
int amx_enable(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }


/* w [N, K] -> packed [N/16][K/32][16 pairs][16 n][2]: each (n block, k block) one 1 KiB
 * AMX B tile, the k blocks of an n block one after another. N % 16 == 0, K % 32 == 0. */
void amx_pack_bf16(const uint16_t* w, uint16_t* packed, int64_t N, int64_t K) {
    const int64_t kb = K / 32;
    #pragma omp parallel for schedule(static)  /* at load: every bf16 weight of the model */
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t b = 0; b < kb; b++) {
            uint16_t* tile = packed + (nb * kb + b) * 512;
            for (int r = 0; r < 16; r++)
                for (int n = 0; n < 16; n++)
                    for (int j = 0; j < 2; j++)
                        tile[r * 32 + n * 2 + j] = w[(nb * 16 + n) * K + b * 32 + 2 * r + j];
        }
}

/* y [M, N] = x [M, K] . w^T (+ bias); x rows x_stride apart; packed from amx_pack_bf16.
 * M <= 64: up to four groups of 16 rows of x, each with its own accumulator tiles, so every
 * weight tile is read from memory once and used by every group at once. */
#define PF(p) for (int l = 0; l < 16; l++) _mm_prefetch((const char*)(p) + PREFETCH + l * 64, _MM_HINT_T0)

/* 16 floats to bf16, rounding to nearest even exactly as f32_to_bf16 does (NaN stays NaN). */
static inline __m256i narrow16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

/* rows x 32 float results (row stride ld) plus bias, to bf16 y[., n0 : n0 + 32]. */
static void store_tile_rows(const float* c, int64_t ld, int64_t rows, const uint16_t* bias,
                            int64_t n0, uint16_t* y, int64_t y_stride) {
    __m512 b[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    if (bias)
        for (int h = 0; h < 2; h++)
            b[h] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n0 + 16 * h))), 16));
    for (int64_t i = 0; i < rows; i++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_si256((__m256i*)(y + i * y_stride + n0 + 16 * h),
                                narrow16(_mm512_add_ps(_mm512_loadu_ps(c + i * ld + 16 * h), b[h])));
}

void amx_linear_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                     const uint16_t* bias, uint16_t* y, int64_t y_stride, int64_t M, int64_t N,
                     int64_t K, int64_t num_threads) {
    const int64_t kb = K / 32, mg = (M + 15) / 16, groups = N / 32;
    uint16_t* xp = (uint16_t*)aligned_alloc(64, (size_t)(mg * 16 * K * 2 + 64));
    for (int64_t m = 0; m < mg * 16; m++) {
        if (m < M) memcpy(xp + m * K, x + m * x_stride, K * 2);
        else memset(xp + m * K, 0, K * 2);
    }
    const int64_t as = K * 2;  /* A tile row stride, bytes */
    #pragma omp parallel num_threads(num_threads)
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof(cfg));
        cfg.palette_id = 1;
        for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
        _tile_loadconfig(&cfg);
        float c[32 * 32] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * 32;
            const uint16_t* b0 = packed + (n0 / 16) * kb * 512;
            const uint16_t* b1 = b0 + kb * 512;
            for (int64_t m0 = 0; m0 < mg; m0 += 2) {
                const uint16_t* a = xp + m0 * 16 * K;
                const int first = m0 == 0, two = mg - m0 >= 2;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t b = 0; b < kb; b++) {
                    if (first) { PF(b0 + b * 512); PF(b1 + b * 512); }
                    _tile_loadd(5, b0 + b * 512, 64); _tile_loadd(6, b1 + b * 512, 64);
                    _tile_loadd(4, a + b * 32, as);
                    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6);
                    if (two) {
                        _tile_loadd(7, a + 16 * K + b * 32, as);
                        _tile_dpbf16ps(2, 7, 5); _tile_dpbf16ps(3, 7, 6);
                    }
                }
                _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128);
                _tile_stored(2, c + 16 * 32, 128); _tile_stored(3, c + 16 * 32 + 16, 128);
                const int64_t rows = M - m0 * 16 < 32 ? M - m0 * 16 : 32;
                store_tile_rows(c, 32, rows, bias, n0, y + m0 * 16 * y_stride, y_stride);
            }
        }
        _tile_release();
    }
    free(xp);
}

#else
int amx_enable(void) { return 0; }
void amx_pack_bf16(const uint16_t* w, uint16_t* packed, int64_t N, int64_t K) {}
void amx_linear_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                     const uint16_t* bias, uint16_t* y, int64_t y_stride, int64_t M, int64_t N,
                     int64_t K, int64_t num_threads) {}
#endif
