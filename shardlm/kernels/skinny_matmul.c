// Skinny matmul on CPU: y[M, N] = x[M, K] . w[N, K]^T (+ bias) for the rows M of a decode
// step (one to a few dozen), with the weight in its plain row-major layout.
//
// Decode steps are bound by reading the weight once; oneDNN's GEMM pays a fixed cost per call
// and, at one row, reads float32 weights well below memory bandwidth. Here each thread streams
// its own contiguous slice of weight rows once: tiles of six weight rows (kept in L1) against
// four x rows at a time, in float32 FMAs. At a few dozen rows, where the arithmetic counts, that
// beats oneDNN on the plain weight (and in bfloat16 also on its own packed layout, since oneDNN
// multiplies bfloat16 with vdpbf16ps, which runs at half the FMA rate on CPUs without AMX).
//
// Each output is summed in the same order whatever M is and wherever its row falls in a tile:
// a row's result does not depend on the batch it is in.
//
// dtype 0 = float32, 1 = bfloat16 (x, w, bias and y all in it). x rows have stride x_stride.
// Returns 0, or -1 where its work buffer could not be allocated.
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

#define WR 6   // weight rows per tile
#define XR 4   // activation rows per tile: 24 accumulators, 10 loads per 24 FMAs
#ifndef PF_TILES
#define PF_TILES 2
#endif

#if defined(__AVX512F__)
// The sums of 8 accumulators, each added up in the same order whichever slot it is in (so an
// output does not depend on which tile, or how many rows, it was computed with).
static inline __attribute__((always_inline)) void reduce8(const __m512 v[8], float out[8]) {
    __m512 s[4], t[2];
    for (int i = 0; i < 4; i++)   // halves: s[i] = [v[2i] 8 lanes | v[2i+1] 8 lanes]
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)   // quarters: t[i] = 4 lanes of each of v[4i .. 4i+3]
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
    __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(t[0], t[1]), _mm512_unpackhi_ps(t[0], t[1]));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));   // 128-bit lane j: [sum v[j], sum v[4+j], ...]
    float r[16];
    _mm512_storeu_ps(r, u);
    for (int j = 0; j < 4; j++) out[j] = r[4 * j], out[4 + j] = r[4 * j + 1];
}

// acc[m][r] = dot(x row m, w row r) over K, for NX float32 x rows (a constant, so that the
// WR x NX accumulators stay in registers) and WR weight rows w[r] (a short tile repeats its last
// row). bfloat16 weights are widened in registers (a shift or a mask per 32 values: each 32-bit
// word holds two of them) and multiplied in float32 FMAs, which this kind of CPU runs at twice the
// rate of vdpbf16ps; x was widened once per call in the matching order (evens, then odds).
static inline __attribute__((always_inline)) void tile(const void *xv_, int64_t x_stride, const void *const w[WR],
                                                       int K, const int NX, int dtype, float acc[XR][WR],
                                                       const char *prefetch) {
    const float *x = (const float *)xv_;
    __m512 a[XR][WR];
    for (int m = 0; m < NX; m++)
        for (int r = 0; r < WR; r++) a[m][r] = _mm512_setzero_ps();
    if (dtype == 0) {
        for (int k = 0; k < K; k += 16) {
            const __mmask16 mask = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
            __m512 wv[WR];
            if (prefetch) for (int r = 0; r < WR; r++) _mm_prefetch(prefetch + (k / 16 * WR + r) * 64, _MM_HINT_T0);
            for (int r = 0; r < WR; r++) wv[r] = _mm512_maskz_loadu_ps(mask, (const float *)w[r] + k);
            for (int m = 0; m < NX; m++) {
                const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * x_stride + k);
                for (int r = 0; r < WR; r++) a[m][r] = _mm512_fmadd_ps(wv[r], xv, a[m][r]);
            }
        }
    } else {
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
        for (int k = 0; k < K; k += 32) {
            const __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
            __m512i wv[WR];
            if (prefetch) for (int r = 0; r < WR; r++) _mm_prefetch(prefetch + (k / 32 * WR + r) * 64, _MM_HINT_T0);
            for (int r = 0; r < WR; r++) wv[r] = _mm512_maskz_loadu_epi16(mask, (const uint16_t *)w[r] + k);
            for (int odd = 0; odd < 2; odd++) {
                __m512 wf[WR];
                for (int r = 0; r < WR; r++)
                    wf[r] = _mm512_castsi512_ps(odd ? _mm512_and_si512(wv[r], high) : _mm512_slli_epi32(wv[r], 16));
                for (int m = 0; m < NX; m++) {
                    const __m512 xv = _mm512_loadu_ps(x + m * x_stride + k + 16 * odd);
                    for (int r = 0; r < WR; r++) a[m][r] = _mm512_fmadd_ps(wf[r], xv, a[m][r]);
                }
            }
        }
    }
    const __m512 *flat = &a[0][0];
    float *out = &acc[0][0];
    for (int i = 0; i < NX * WR; i += 8) {
        __m512 v[8];
        float sums[8];
        for (int j = 0; j < 8; j++) v[j] = i + j < NX * WR ? flat[i + j] : _mm512_setzero_ps();
        reduce8(v, sums);
        for (int j = 0; j < 8 && i + j < NX * WR; j++) out[i + j] = sums[j];
    }
}

// bfloat16 x [M, K] (row stride x_stride) -> float32 [M, Kp] (K rounded up to 32, zero-padded),
// each run of 32 as its 16 even then its 16 odd elements: the order tile() widens weights in
static void widen_rows(const uint16_t *x, int64_t x_stride, int M, int K, float *dst, int Kp) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int m = 0; m < M; m++)
        for (int k = 0; k < Kp; k += 32) {
            const __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : K > k ? (__mmask32)((1u << (K - k)) - 1) : 0;
            const __m512i v = _mm512_maskz_loadu_epi16(mask, x + m * x_stride + k);
            _mm512_storeu_ps(dst + (int64_t)m * Kp + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            _mm512_storeu_ps(dst + (int64_t)m * Kp + k + 16, _mm512_castsi512_ps(_mm512_and_si512(v, high)));
        }
}
#else
// portable path: the compiler vectorizes the inner loop for whatever the CPU has; compiled once
// (noipa: no copy specialized per row count), so that every output is summed the same way
__attribute__((noipa)) static void tile(const void *x, int64_t x_stride, const void *const w[WR], int K, const int NX, int dtype,
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

KERNEL_API int skinny_matmul(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int M, int N,
                             int K, int dtype) {
    const int esize = dtype == 0 ? 4 : 2;
    const int blocks = (N + WR - 1) / WR;
    const void *rows_x = x;        // what tile() reads: x itself, or x widened to float32
    int64_t rows_stride = x_stride, rows_esize = esize;
    float *widened = NULL;
#if defined(__AVX512F__)
    if (dtype == 1) {
        const int Kp = (K + 31) / 32 * 32;
        widened = (float *)malloc(sizeof(float) * (size_t)M * (size_t)Kp);
        if (!widened) return -1;
        widen_rows((const uint16_t *)x, x_stride, M, K, widened, Kp);
        rows_x = widened, rows_stride = Kp, rows_esize = 4;
    }
#endif
    #pragma omp parallel for schedule(static) if (blocks > 1 && (int64_t)N * K >= 65536)
    for (int blk = 0; blk < blocks; blk++) {
        const int n0 = blk * WR, nw = N - n0 < WR ? N - n0 : WR;
        const void *rows[WR];
        for (int r = 0; r < WR; r++) rows[r] = (const char *)w + (int64_t)(n0 + (r < nw ? r : nw - 1)) * K * esize;
        for (int m0 = 0; m0 < M; m0 += XR) {
            const int nx = M - m0 < XR ? M - m0 : XR;
            const void *xm = (const char *)rows_x + m0 * rows_stride * rows_esize;
            float acc[XR][WR];
            // the first pass over this tile's weight rows fetches the tile PF_TILES ahead
            const char *pf = m0 == 0 && blk + PF_TILES < blocks ? (const char *)w + (int64_t)(n0 + PF_TILES * WR) * K * esize : NULL;
            switch (nx) {     // constant row counts: the accumulators stay in registers
                case 1: tile(xm, rows_stride, rows, K, 1, dtype, acc, pf); break;
                case 2: tile(xm, rows_stride, rows, K, 2, dtype, acc, pf); break;
                case 3: tile(xm, rows_stride, rows, K, 3, dtype, acc, pf); break;
                default: tile(xm, rows_stride, rows, K, 4, dtype, acc, pf); break;
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
    free(widened);
    return 0;
}
