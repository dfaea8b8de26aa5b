// Skinny matmul on CPU: y[M, N] = x[M, K] . w[N, K]^T (+ bias) for the few rows M of a decode
// step, with the weight in its plain row-major layout.
//
// Decode steps are bound by reading the weight once; oneDNN's GEMM pays a fixed cost per call
// and, at one row, reads float32 weights well below memory bandwidth. Here each thread streams
// its own contiguous slice of weight rows once, four rows at a time against up to four rows
// of x, in float32 accumulators (bfloat16 pairs via vdpbf16ps where the CPU has AVX512_BF16).
//
// dtype 0 = float32, 1 = bfloat16 (x, w, bias and y all in it). x rows have stride x_stride.
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

#define WR 4   // weight rows per tile
#define XR 4   // activation rows per tile
#ifndef PF_TILES
#define PF_TILES 2
#endif

#if defined(__AVX512F__)
// acc[m][r] = dot(x row m, w row r) over K, for NX x rows (a constant, so that the WR x NX
// accumulators stay in registers) and WR weight rows w[r] (a short tile repeats its last row).
static inline __attribute__((always_inline)) void tile(const void *x, int64_t x_stride, const void *const w[WR],
                                                       int K, const int NX, int dtype, float acc[XR][WR],
                                                       const char *prefetch) {
    __m512 a[XR][WR];
    for (int m = 0; m < NX; m++)
        for (int r = 0; r < WR; r++) a[m][r] = _mm512_setzero_ps();
    if (dtype == 0) {
        const float *xf = (const float *)x;
        for (int k = 0; k < K; k += 16) {
            const __mmask16 mask = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
            __m512 wv[WR];
            if (prefetch) for (int r = 0; r < WR; r++) _mm_prefetch(prefetch + (k / 16 * WR + r) * 64, _MM_HINT_T0);
            for (int r = 0; r < WR; r++) wv[r] = _mm512_maskz_loadu_ps(mask, (const float *)w[r] + k);
            for (int m = 0; m < NX; m++) {
                const __m512 xv = _mm512_maskz_loadu_ps(mask, xf + m * x_stride + k);
                for (int r = 0; r < WR; r++) a[m][r] = _mm512_fmadd_ps(wv[r], xv, a[m][r]);
            }
        }
    } else {
        const uint16_t *xh = (const uint16_t *)x;
        for (int k = 0; k < K; k += 32) {
            const __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
#if defined(__AVX512BF16__)
            __m512i wv[WR];
            if (prefetch) for (int r = 0; r < WR; r++) _mm_prefetch(prefetch + (k / 32 * WR + r) * 64, _MM_HINT_T0);
            for (int r = 0; r < WR; r++) wv[r] = _mm512_maskz_loadu_epi16(mask, (const uint16_t *)w[r] + k);
            for (int m = 0; m < NX; m++) {
                const __m512i xv = _mm512_maskz_loadu_epi16(mask, xh + m * x_stride + k);
                for (int r = 0; r < WR; r++) a[m][r] = _mm512_dpbf16_ps(a[m][r], (__m512bh)wv[r], (__m512bh)xv);
            }
#else
            // no bfloat16 instructions: widen to float32 (exact), two halves of 16
            for (int half = 0; half < 2; half++) {
                const __mmask16 hm = (__mmask16)(mask >> (16 * half));
                __m512 wv[WR];
                for (int r = 0; r < WR; r++) {
                    const __m256i h = _mm256_maskz_loadu_epi16(hm, (const uint16_t *)w[r] + k + 16 * half);
                    wv[r] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                }
                for (int m = 0; m < NX; m++) {
                    const __m256i h = _mm256_maskz_loadu_epi16(hm, xh + m * x_stride + k + 16 * half);
                    const __m512 xv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                    for (int r = 0; r < WR; r++) a[m][r] = _mm512_fmadd_ps(wv[r], xv, a[m][r]);
                }
            }
#endif
        }
    }
    for (int m = 0; m < NX; m++)
        for (int r = 0; r < WR; r++) acc[m][r] = _mm512_reduce_add_ps(a[m][r]);
}
#else
// portable path: the compiler vectorizes the inner loop for whatever the CPU has
static void tile(const void *x, int64_t x_stride, const void *const w[WR], int K, const int NX, int dtype,
                 float acc[XR][WR], const char *prefetch) {
    (void)prefetch;
    for (int m = 0; m < NX; m++)
        for (int r = 0; r < WR; r++) {
            float s = 0.f;
            if (dtype == 0) {
                const float *xm = (const float *)x + m * x_stride, *wr = (const float *)w[r];
                #pragma omp simd reduction(+:s)
                for (int k = 0; k < K; k++) s += xm[k] * wr[k];
            } else {
                const uint16_t *xm = (const uint16_t *)x + m * x_stride, *wr = (const uint16_t *)w[r];
                #pragma omp simd reduction(+:s)
                for (int k = 0; k < K; k++) s += bf16_to_f32(xm[k]) * bf16_to_f32(wr[k]);
            }
            acc[m][r] = s;
        }
}
#endif

KERNEL_API void skinny_matmul(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int M, int N, int K,
                   int dtype) {
    const int esize = dtype == 0 ? 4 : 2;
    const int blocks = (N + WR - 1) / WR;
    #pragma omp parallel for schedule(static) if (blocks > 1 && (int64_t)N * K >= 65536)
    for (int blk = 0; blk < blocks; blk++) {
        const int n0 = blk * WR, nw = N - n0 < WR ? N - n0 : WR;
        const void *rows[WR];
        for (int r = 0; r < WR; r++) rows[r] = (const char *)w + (int64_t)(n0 + (r < nw ? r : nw - 1)) * K * esize;
        for (int m0 = 0; m0 < M; m0 += XR) {
            const int nx = M - m0 < XR ? M - m0 : XR;
            const void *xm = (const char *)x + m0 * x_stride * esize;
            float acc[XR][WR];
            // the first pass over this tile's weight rows fetches the tile PF_TILES ahead
            const char *pf = m0 == 0 && blk + PF_TILES < blocks ? (const char *)w + (int64_t)(n0 + PF_TILES * WR) * K * esize : NULL;
            switch (nx) {     // constant row counts: the accumulators stay in registers
                case 1: tile(xm, x_stride, rows, K, 1, dtype, acc, pf); break;
                case 2: tile(xm, x_stride, rows, K, 2, dtype, acc, pf); break;
                case 3: tile(xm, x_stride, rows, K, 3, dtype, acc, pf); break;
                default: tile(xm, x_stride, rows, K, 4, dtype, acc, pf); break;
            }
            for (int m = 0; m < nx; m++)
                for (int r = 0; r < nw; r++) {
                    const int64_t o = (int64_t)(m0 + m) * N + n0 + r;
                    float v = acc[m][r];
                    if (dtype == 0) {
                        if (bias) v += ((const float *)bias)[n0 + r];
                        ((float *)y)[o] = v;
                    } else {
                        if (bias) v += bf16_to_f32(((const uint16_t *)bias)[n0 + r]);
                        ((uint16_t *)y)[o] = f32_to_bf16(v);
                    }
                }
        }
    }
}
