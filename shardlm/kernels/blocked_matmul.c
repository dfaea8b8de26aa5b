// Blocked matmul on CPUs with AVX-512: y[M, N] = x[M, K] . w[N, K]^T (+ bias), with the weight
// repacked once at load into panels of NR output features: panel p holds, for each k in order,
// the NR weights w[p*NR .. p*NR+NR-1][k] side by side (bfloat16: two k's per 32-bit word).
//
// The product is then a broadcast-form GEMM: for up to MR rows of x at a time, each x[m][k] is
// broadcast and multiplied into NR/16 vectors of the panel, MR x NR/16 float32 accumulators in
// registers. A panel is one contiguous stream (the hardware prefetcher follows it) and each of
// its bytes feeds MR rows; the dot-product form of the skinny kernel instead reloads x for every
// four weight rows and sums each accumulator horizontally. Measured on a 2-core Xeon (AVX-512
// BF16, no AMX), 64 rows: float32 1.05-1.25x oneDNN on its own packed layout, bfloat16 1.4-1.8x
// (oneDNN multiplies bfloat16 with vdpbf16ps, at half the FMA rate on this CPU); one row: at
// memory bandwidth, as the skinny kernel.
//
// Every output is the sum over k in order, one FMA at a time: a row's result does not depend on
// how many rows are computed with it. bfloat16 weights and x are widened to float32 exactly.
//
// 4-bit weights (w = q * scale + min per group of input columns) have panels of their own: per
// k pair, a byte per output feature holds q[k] (low nibble) and q[k + 1] (high), then the
// panel's scales and mins per group. They are widened to float32 in registers, so a decode step
// reads a quarter of the bytes of bfloat16.
//
// dtype 0 = float32, 1 = bfloat16 (x, w, bias and y all in it). x rows have stride x_stride.
#include <stdint.h>
#include <stdlib.h>

#include "cpu_common.h"

#define NR 48            // output features per panel: three vectors
#define MR 8             // x rows per register tile: 24 accumulators
#define MR4 6            // for 4-bit weights, whose widening needs 12 more registers
#define NV (NR / 16)
#ifndef PF_BYTES
#define PF_BYTES 8192    // the first pass over a panel fetches this far ahead in the weight stream
#endif

// 1 where this build has the kernel (AVX-512), 0 where it does not
KERNEL_API int blocked_supported(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

// NR, for code that reads the packed layout (an embedding lookup in a tied LM head's table)
KERNEL_API int blocked_panel_width(void) { return NR; }

// Elements of the packed weight of an [N, K] one: panels of NR rows (the last zero-padded),
// K rounded up to even for bfloat16's pairs.
KERNEL_API int64_t blocked_packed_size(int N, int K, int dtype) {
    const int64_t panels = (N + NR - 1) / NR, Kp = dtype == 0 ? K : (K + 1) / 2 * 2;
    return panels * Kp * NR;
}

// w [N, K] -> the panel layout above (out: blocked_packed_size elements)
KERNEL_API void blocked_pack(const void *w, int N, int K, int dtype, void *out) {
    const int panels = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        if (dtype == 0) {
            float *o = (float *)out + (int64_t)p * K * NR;
            for (int k = 0; k < K; k++)
                for (int j = 0; j < NR; j++) {
                    const int n = p * NR + j;
                    o[(int64_t)k * NR + j] = n < N ? ((const float *)w)[(int64_t)n * K + k] : 0.f;
                }
        } else {
            const int Kp = (K + 1) / 2 * 2;
            uint16_t *o = (uint16_t *)out + (int64_t)p * Kp * NR;
            for (int k = 0; k < Kp; k++)
                for (int j = 0; j < NR; j++) {
                    const int n = p * NR + j;
                    o[((int64_t)(k / 2) * NR + j) * 2 + (k & 1)] = n < N && k < K ? ((const uint16_t *)w)[(int64_t)n * K + k] : 0;
                }
        }
    }
}

// Bytes of a packed 4-bit weight [N, K] (K and group even): per panel, K / 2 * NR bytes of
// nibble pairs, then [K / group][NR] float32 scales and as many mins.
KERNEL_API int64_t blocked_int4_size(int N, int K, int group) {
    const int64_t panels = (N + NR - 1) / NR;
    return panels * ((int64_t)K / 2 * NR + 2 * (int64_t)(K / group) * NR * 4);
}

// q [N, K] (0..15), scales and mins [N, K / group] -> the 4-bit panel layout above
KERNEL_API void blocked_int4_pack(const int8_t *q, const float *scales, const float *mins, int N, int K, int group,
                                  uint8_t *out) {
    const int panels = (N + NR - 1) / NR, groups = K / group;
    const int64_t panel_bytes = blocked_int4_size(NR, K, group);
    #pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        uint8_t *o = out + p * panel_bytes;
        float *s = (float *)(o + (int64_t)K / 2 * NR), *m = s + (int64_t)groups * NR;
        for (int j = 0; j < NR; j++) {
            const int n = p * NR + j;
            for (int k = 0; k < K; k += 2)
                o[(int64_t)(k / 2) * NR + j] = n < N ? (uint8_t)((q[(int64_t)n * K + k] & 15) | (q[(int64_t)n * K + k + 1] & 15) << 4) : 0;
            for (int g = 0; g < groups; g++) {
                s[(int64_t)g * NR + j] = n < N ? scales[(int64_t)n * groups + g] : 0.f;
                m[(int64_t)g * NR + j] = n < N ? mins[(int64_t)n * groups + g] : 0.f;
            }
        }
    }
}

#if defined(__AVX512F__)
// acc[m][v] = x rows m (NM of them, a constant: the accumulators stay in registers) . the panel's
// vector v of output features, over Kp (even for bfloat16) values of k
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t x_stride, const void *panel, int Kp,
                                                       const int NM, int dtype, __m512 acc[MR][NV], int prefetch) {
    for (int m = 0; m < NM; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    if (dtype == 0) {
        const float *w = (const float *)panel;
        for (int k = 0; k < Kp; k++) {
            __m512 wv[NV];
            if (prefetch)
                for (int v = 0; v < NV; v++) _mm_prefetch((const char *)(w + (int64_t)k * NR + 16 * v) + PF_BYTES, _MM_HINT_T0);
            for (int v = 0; v < NV; v++) wv[v] = _mm512_loadu_ps(w + (int64_t)k * NR + 16 * v);
            for (int m = 0; m < NM; m++) {
                const __m512 xb = _mm512_set1_ps(x[m * x_stride + k]);
                for (int v = 0; v < NV; v++) acc[m][v] = _mm512_fmadd_ps(xb, wv[v], acc[m][v]);
            }
        }
    } else {
        // a 32-bit word holds k (low half) and k + 1 (high half): a shift or a mask widens each
        const uint32_t *w = (const uint32_t *)panel;
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
        for (int k = 0; k < Kp; k += 2) {
            __m512 even[NV], odd[NV];
            if (prefetch)
                for (int v = 0; v < NV; v++) _mm_prefetch((const char *)(w + (int64_t)(k / 2) * NR + 16 * v) + PF_BYTES, _MM_HINT_T0);
            for (int v = 0; v < NV; v++) {
                const __m512i pair = _mm512_loadu_si512(w + (int64_t)(k / 2) * NR + 16 * v);
                even[v] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
                odd[v] = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
            }
            for (int m = 0; m < NM; m++) {
                const __m512 xe = _mm512_set1_ps(x[m * x_stride + k]), xo = _mm512_set1_ps(x[m * x_stride + k + 1]);
                for (int v = 0; v < NV; v++) acc[m][v] = _mm512_fmadd_ps(xe, even[v], acc[m][v]);
                for (int v = 0; v < NV; v++) acc[m][v] = _mm512_fmadd_ps(xo, odd[v], acc[m][v]);
            }
        }
    }
}
#if defined(__AVX512BF16__)
// panel_tile for bfloat16 x and weights with the CPU's bfloat16 dot product (vdpbf16ps): each
// instruction multiplies a k pair of x into a k pair of 16 features and adds both products to the
// float32 accumulators. Where it runs at the FMA rate (AMD Zen 4) that is twice the
// multiply-adds of widening to float32; where it runs at half that rate (Intel without AMX) it
// is no faster. kernels._bf16_dot_pays times both once per process and sets the choice.
static inline __attribute__((always_inline)) void panel_tile_dot(const uint16_t *x, int64_t x_stride, const uint32_t *w,
                                                           int Kp, const int NM, __m512 acc[MR][NV], int prefetch) {
    for (int m = 0; m < NM; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    for (int k = 0; k < Kp; k += 2) {
        __m512i wv[NV];
        if (prefetch)
            for (int v = 0; v < NV; v++) _mm_prefetch((const char *)(w + (int64_t)(k / 2) * NR + 16 * v) + PF_BYTES, _MM_HINT_T0);
        for (int v = 0; v < NV; v++) wv[v] = _mm512_loadu_si512(w + (int64_t)(k / 2) * NR + 16 * v);
        for (int m = 0; m < NM; m++) {
            uint32_t pair;
            memcpy(&pair, x + m * x_stride + k, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int v = 0; v < NV; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, (__m512bh)wv[v]);
        }
    }
}
#endif

// 16 bytes of a 4-bit panel (features j .. j+15 at a k pair) as the float32 weights of k (low
// nibbles) and k + 1 (high): q * scale + min, rounded once
static inline __attribute__((always_inline)) void widen_int4_pair(const uint8_t *bytes, __m512 scale, __m512 min,
                                                            __m512 *even, __m512 *odd) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    *even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), scale, min);
    *odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), scale, min);
}

// panel_tile for a 4-bit panel: each k pair's NR bytes widened to two float32 vectors per 16
// features, w = q * scale + min (one rounding), then as panel_tile
static inline __attribute__((always_inline)) void int4_tile(const float *x, int64_t x_stride, const uint8_t *panel, int K,
                                                      int group, const int NM, __m512 acc[MR][NV], int prefetch) {
    const float *scales = (const float *)(panel + (int64_t)K / 2 * NR), *mins = scales + (int64_t)(K / group) * NR;
    for (int m = 0; m < NM; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    for (int g0 = 0; g0 < K; g0 += group) {
        __m512 s[NV], mn[NV];
        for (int v = 0; v < NV; v++) {
            s[v] = _mm512_loadu_ps(scales + (int64_t)(g0 / group) * NR + 16 * v);
            mn[v] = _mm512_loadu_ps(mins + (int64_t)(g0 / group) * NR + 16 * v);
        }
        for (int k = g0; k < g0 + group; k += 2) {
            const uint8_t *bytes = panel + (int64_t)(k / 2) * NR;
            if (prefetch) _mm_prefetch((const char *)bytes + PF_BYTES, _MM_HINT_T0);
            __m512 even[NV], odd[NV];
            for (int v = 0; v < NV; v++) widen_int4_pair(bytes + 16 * v, s[v], mn[v], &even[v], &odd[v]);
            for (int m = 0; m < NM; m++) {
                const __m512 xe = _mm512_set1_ps(x[m * x_stride + k]), xo = _mm512_set1_ps(x[m * x_stride + k + 1]);
                for (int v = 0; v < NV; v++) acc[m][v] = _mm512_fmadd_ps(xe, even[v], acc[m][v]);
                for (int v = 0; v < NV; v++) acc[m][v] = _mm512_fmadd_ps(xo, odd[v], acc[m][v]);
            }
        }
    }
}
#endif

#if defined(__AVX512F__)
// A 4-bit panel as a float32 one ([K][NR]): w = q * scale + min, rounded once, as int4_tile has it
static void widen_int4_panel(const uint8_t *panel, int K, int group, float *out) {
    const float *scales = (const float *)(panel + (int64_t)K / 2 * NR), *mins = scales + (int64_t)(K / group) * NR;
    for (int k = 0; k < K; k += 2)
        for (int v = 0; v < NV; v++) {
            const int64_t g = (int64_t)(k / group) * NR + 16 * v;
            __m512 even, odd;
            widen_int4_pair(panel + (int64_t)(k / 2) * NR + 16 * v, _mm512_loadu_ps(scales + g), _mm512_loadu_ps(mins + g),
                            &even, &odd);
            _mm512_storeu_ps(out + (int64_t)k * NR + 16 * v, even);
            _mm512_storeu_ps(out + (int64_t)(k + 1) * NR + 16 * v, odd);
        }
}

// 1: bfloat16 products use panel_tile_dot (set by blocked_set_bf16_dot, once per process,
// before the first product: every product then sums in the same order)
static int bf16_dot = 0;

// The product over all panels, for float panels (group 0) or 4-bit ones (group: columns per
// scale). x as float32 rows (bfloat16 widened once, a zero past an odd K); parallel over panels.
static int run_panels(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y, int M, int N,
                      int K, int group, int dtype) {
    const int panels = (N + NR - 1) / NR, Kp = dtype == 0 || group ? K : K + K % 2;
    const int64_t panel_bytes = group ? blocked_int4_size(NR, K, group) : (int64_t)Kp * NR * (dtype == 0 ? 4 : 2);
    const int mr = group ? MR4 : MR;
    const float *xf = (const float *)x;
    const uint16_t *xh = (const uint16_t *)x;     // bfloat16 x for the dot-product tile
    int64_t xs = x_stride;
    float *widened = NULL;
    uint16_t *padded = NULL;
    const int dot = dtype == 1 && !group && bf16_dot;
    if (dot && Kp > K) {    // an odd K: rows copied with a zero after them, to make whole pairs
        padded = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)M * (size_t)Kp);
        if (!padded) return -1;
        for (int m = 0; m < M; m++) {
            memcpy(padded + (int64_t)m * Kp, xh + m * x_stride, sizeof(uint16_t) * K);
            padded[(int64_t)m * Kp + K] = 0;
        }
        xh = padded, xs = Kp;
    } else if (dtype == 1 && !dot) {
        widened = (float *)malloc(sizeof(float) * (size_t)M * (size_t)Kp);
        if (!widened) return -1;
        for (int m = 0; m < M; m++) {
            for (int k = 0; k < K; k++) widened[(int64_t)m * Kp + k] = bf16_to_f32(((const uint16_t *)x)[m * x_stride + k]);
            if (Kp > K) widened[(int64_t)m * Kp + K] = 0.f;
        }
        xf = widened, xs = Kp;
    }
    // 4-bit panels against more than one tile of rows: each panel widened once into float32
    // (the same values, so the same sums) and multiplied by the float tile, instead of widened
    // again for every tile
    const int widen_once = group && M > MR4;
    int failed = 0;
    #pragma omp parallel if (panels > 1 && (int64_t)N * K >= 65536)
    {
    float *wide_panel = widen_once ? (float *)malloc(sizeof(float) * (size_t)K * NR) : NULL;
    if (widen_once && !wide_panel) {
        #pragma omp atomic write
        failed = 1;
    }
    #pragma omp for schedule(static)
    for (int p = 0; p < panels; p++) {
        if (widen_once && !wide_panel) continue;
        const char *panel = (const char *)packed + p * panel_bytes;
        const int n0 = p * NR, width = N - n0 < NR ? N - n0 : NR;
        if (widen_once) widen_int4_panel((const uint8_t *)panel, K, group, wide_panel);
        for (int m0 = 0; m0 < M; m0 += widen_once ? MR : mr) {
            const int step = widen_once ? MR : mr, rows = M - m0 < step ? M - m0 : step, first = m0 == 0;
            const float *xm = xf + m0 * xs;
            __m512 acc[MR][NV];
            if (dot) {
#if defined(__AVX512BF16__)
                const uint16_t *xr = xh + m0 * xs;
                const uint32_t *w = (const uint32_t *)panel;
                switch (rows) {
                    case 1: panel_tile_dot(xr, xs, w, Kp, 1, acc, first); break;
                    case 2: panel_tile_dot(xr, xs, w, Kp, 2, acc, first); break;
                    case 3: panel_tile_dot(xr, xs, w, Kp, 3, acc, first); break;
                    case 4: panel_tile_dot(xr, xs, w, Kp, 4, acc, first); break;
                    case 5: panel_tile_dot(xr, xs, w, Kp, 5, acc, first); break;
                    case 6: panel_tile_dot(xr, xs, w, Kp, 6, acc, first); break;
                    case 7: panel_tile_dot(xr, xs, w, Kp, 7, acc, first); break;
                    default: panel_tile_dot(xr, xs, w, Kp, MR, acc, first); break;
                }
#endif
            } else if (widen_once) {
                switch (rows) {     // float32 weights: dtype 0 (x is float32 already)
                    case 1: panel_tile(xm, xs, wide_panel, K, 1, 0, acc, 0); break;
                    case 2: panel_tile(xm, xs, wide_panel, K, 2, 0, acc, 0); break;
                    case 3: panel_tile(xm, xs, wide_panel, K, 3, 0, acc, 0); break;
                    case 4: panel_tile(xm, xs, wide_panel, K, 4, 0, acc, 0); break;
                    case 5: panel_tile(xm, xs, wide_panel, K, 5, 0, acc, 0); break;
                    case 6: panel_tile(xm, xs, wide_panel, K, 6, 0, acc, 0); break;
                    case 7: panel_tile(xm, xs, wide_panel, K, 7, 0, acc, 0); break;
                    default: panel_tile(xm, xs, wide_panel, K, MR, 0, acc, 0); break;
                }
            } else if (group) {
                const uint8_t *q = (const uint8_t *)panel;
                switch (rows) {     // constant row counts: the accumulators stay in registers
                    case 1: int4_tile(xm, xs, q, K, group, 1, acc, first); break;
                    case 2: int4_tile(xm, xs, q, K, group, 2, acc, first); break;
                    case 3: int4_tile(xm, xs, q, K, group, 3, acc, first); break;
                    case 4: int4_tile(xm, xs, q, K, group, 4, acc, first); break;
                    case 5: int4_tile(xm, xs, q, K, group, 5, acc, first); break;
                    default: int4_tile(xm, xs, q, K, group, MR4, acc, first); break;
                }
            } else {
                switch (rows) {
                    case 1: panel_tile(xm, xs, panel, Kp, 1, dtype, acc, first); break;
                    case 2: panel_tile(xm, xs, panel, Kp, 2, dtype, acc, first); break;
                    case 3: panel_tile(xm, xs, panel, Kp, 3, dtype, acc, first); break;
                    case 4: panel_tile(xm, xs, panel, Kp, 4, dtype, acc, first); break;
                    case 5: panel_tile(xm, xs, panel, Kp, 5, dtype, acc, first); break;
                    case 6: panel_tile(xm, xs, panel, Kp, 6, dtype, acc, first); break;
                    case 7: panel_tile(xm, xs, panel, Kp, 7, dtype, acc, first); break;
                    default: panel_tile(xm, xs, panel, Kp, MR, dtype, acc, first); break;
                }
            }
            for (int m = 0; m < rows; m++)
                for (int v = 0; v < NV && 16 * v < width; v++) {
                    const int c = 16 * v;
                    const __mmask16 mask = width - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (width - c)) - 1);
                    __m512 r = acc[m][v];
                    if (bias) r = _mm512_add_ps(r, load16(bias, n0 + c, mask, dtype));
                    store16(y, (int64_t)(m0 + m) * N + n0 + c, r, mask, dtype);
                }
        }
    }
    free(wide_panel);
    }
    free(widened);
    free(padded);
    return failed ? -1 : 0;
}
#endif

// bfloat16 products with the CPU's dot product (on = 1) or widened to float32 FMAs (0). Returns
// 1 if set, 0 in a build without AVX512_BF16 (widened, whatever on says).
KERNEL_API int blocked_set_bf16_dot(int on) {
#if defined(__AVX512BF16__)
    bf16_dot = on != 0;
    return 1;
#else
    (void)on;
    return 0;
#endif
}

// y = x . w^T (+ bias) with w packed by blocked_pack. Returns 0; -1 where the work buffer could
// not be allocated; -2 in a build without AVX-512.
KERNEL_API int blocked_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y, int M,
                              int N, int K, int dtype) {
#if defined(__AVX512F__)
    return run_panels(x, x_stride, packed, bias, y, M, N, K, 0, dtype);
#else
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)dtype;
    return -2;
#endif
}

// The same with a 4-bit weight packed by blocked_int4_pack (group: input columns per scale).
KERNEL_API int blocked_int4_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y,
                                   int M, int N, int K, int group, int dtype) {
#if defined(__AVX512F__)
    return run_panels(x, x_stride, packed, bias, y, M, N, K, group, dtype);
#else
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)group, (void)dtype;
    return -2;
#endif
}
