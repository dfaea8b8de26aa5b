// Blocked matmul on CPUs with AVX-512 or AVX2: y[M, N] = x[M, K] . w[N, K]^T (+ bias), with the weight
// repacked once at load into panels of NR output features: panel p holds, for each k in order,
// the NR weights w[p*NR .. p*NR+NR-1][k] side by side (bfloat16: two k's per 32-bit word).
//
// The product is then a broadcast-form GEMM: for up to MR rows of x at a time, each x[m][k] is
// broadcast and multiplied into NR/16 vectors of the panel, MR x NR/16 float32 accumulators in
// registers. A panel is one contiguous stream (the hardware prefetcher follows it) and each of
// its bytes feeds MR rows; the dot-product form of the skinny kernel instead reloads x for every
// four weight rows and sums each accumulator horizontally. At a few dozen rows this beats oneDNN
// on its own packed layout; at one row it streams at memory bandwidth, as the skinny kernel
// (figures: docs/ARCHITECTURE.md, "Measured choices").
//
// Every output is the sum over k in order, one FMA at a time: a row's result does not depend on
// how many rows are computed with it. bfloat16 weights and x are widened to float32 exactly.
//
// 4-bit weights (w = q * scale + min per group of input columns) have panels of their own: per
// 8 k's, a 32-bit word per output feature holds q[k + 2i] in bits 4i..4i+3 and q[k + 2i + 1] in
// bits 16+4i.., i = 0..3 (so a k pair comes out of a word with a shift and a mask, in lane);
// each group's words are followed by its NR scales and NR mins, so a panel is one stream. x is
// quantized to int16 per group and the integers multiplied as they are (int4_tile_q16): no weight
// is widened to float, so a decode step reads a quarter of the bytes of bfloat16 and does little
// arithmetic per byte, on AVX2 too.
//
// 8-bit weights (w = q * scale per group, symmetric: int8 and GGUF's Q8_0) likewise: per k, the
// NR integers side by side, each group's followed by its NR scales. Widened to float32 (q * scale,
// one rounding) or, for the dot product, converted to exact bfloat16 integers with the group's
// scale applied to its sum (int8_tile_dot): a tied LM head read from Q8_0 moves half the bytes of
// bfloat16.
//
// FP8 weights (e4m3fn, w = fp8 * scale per group) use the 8-bit panels as they are: each byte is
// widened by vf_fp8 to its value times 2^-8 (exact, and exact in bfloat16 too), and the tables
// hold scale * 2^8 (blocked_fp8_pack). Each group's sum over its k's is taken first and its scale
// applied to it (fp8_tile; the dot product's tile as for 8-bit integers), so a weight costs its
// widening and one FMA. A build without AVX2 or AVX-512 runs plain C loops (plain_fp8_panels).
//
// dtype 0 = float32, 1 = bfloat16 (x, w, bias and y all in it). x rows have stride x_stride.
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_common.h"
#include "simd16.h"

// The tiles are written with 16-lane vectors (simd16.h): one AVX-512 register or two AVX2 ones.
// AVX2 has 16 registers of 8 lanes, so its tiles hold fewer rows; the panel layout is the same.
#define NR 48            // output features per panel: three vectors
#if SIMD16_BITS == 256
#define MR 2             // x rows per register tile: 12 accumulator registers
#define MR4 1            // for 8-bit weights, whose widening needs more registers
#define MR4_FP8 1        // for FP8 weights: a partial and a total accumulator per vector
#else
#define MR 8             // x rows per register tile: 24 accumulators
#define MR4 6            // for 8-bit weights, whose widening needs more registers
#define MR4_FP8 4        // for FP8 weights: a partial and a total accumulator per vector
#endif
#define MR4_DOT 4        // for 8-bit weights with the dot product: a partial and a total accumulator per vector
#if SIMD16_BITS == 256
#define MR4_Q 2          // for 4-bit weights with integer x (measured: 1 row per tile is slower at 64 rows)
#else
#define MR4_Q 4          // 12 integer sums and 16 broadcast x pairs: within 32 registers (6 rows spilled)
#endif
#define NV (NR / 16)
#ifndef X_BLOCK_BYTES
#define X_BLOCK_BYTES (384 * 1024)   // rows of x run against every panel in turn: within any L2 here
#endif
#ifndef PF_BYTES
#define PF_BYTES 8192    // the first pass over a panel fetches this far ahead in the weight stream
#endif

// The vector width the tiles run at: 512 (AVX-512), 256 (AVX2) or 0 (this build has no kernel)
KERNEL_API int blocked_vector_bits(void) {
#if defined(HAVE_SIMD16)
    return SIMD16_BITS;
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

// Scales and mins ("tables") are float32 (tb = 4 bytes each) or, where the quantization made
// them float16 (GGUF's blocks), float16 (tb = 2): fewer bytes to read per weight.
// A 4-bit panel's group: [group / 8][NR] words, then [NR] scales and [NR] mins
static inline int64_t int4_group_bytes(int group, int tb) { return (int64_t)group / 2 * NR + 2 * NR * tb; }
static inline const uint32_t *int4_words(const uint8_t *panel, int group, int tb, int k8) {   // k8: a multiple of 8
    return (const uint32_t *)(panel + k8 / group * int4_group_bytes(group, tb)) + (int64_t)(k8 % group / 8) * NR;
}
static inline const uint8_t *int4_tables(const uint8_t *panel, int group, int tb, int g) {   // scales, then mins
    return panel + g * int4_group_bytes(group, tb) + (int64_t)group / 2 * NR;
}

// Bytes of a packed 4-bit weight [N, K] (group a multiple of 8): K / group groups per panel
KERNEL_API int64_t blocked_int4_size(int N, int K, int group, int tb) {
    const int64_t panels = (N + NR - 1) / NR;
    return panels * (K / group) * int4_group_bytes(group, tb);
}

// q [N, K] (0..15), scales and mins [N, K / group] (tb bytes each) -> the 4-bit panel layout above
KERNEL_API void blocked_int4_pack(const int8_t *q, const void *scales, const void *mins, int N, int K, int group,
                                  int tb, uint8_t *out) {
    const int panels = (N + NR - 1) / NR, groups = K / group;
    const int64_t panel_bytes = blocked_int4_size(NR, K, group, tb);
    #pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        uint8_t *o = out + p * panel_bytes;
        for (int j = 0; j < NR; j++) {
            const int n = p * NR + j;
            for (int k = 0; k < K; k += 8) {
                uint32_t word = 0;
                for (int i = 0; n < N && i < 4; i++)
                    word |= (uint32_t)(q[(int64_t)n * K + k + 2 * i] & 15) << 4 * i
                          | (uint32_t)(q[(int64_t)n * K + k + 2 * i + 1] & 15) << (16 + 4 * i);
                memcpy((uint8_t *)(int4_words(o, group, tb, k) + j), &word, 4);
            }
            for (int g = 0; g < groups; g++) {
                uint8_t *t = (uint8_t *)int4_tables(o, group, tb, g);
                memset(t + j * tb, 0, tb);
                memset(t + (NR + j) * tb, 0, tb);
                if (n >= N) continue;
                memcpy(t + j * tb, (const uint8_t *)scales + ((int64_t)n * groups + g) * tb, tb);
                memcpy(t + (NR + j) * tb, (const uint8_t *)mins + ((int64_t)n * groups + g) * tb, tb);
            }
        }
    }
}

// An 8-bit panel's group: [group][NR] int8, then [NR] scales
static inline int64_t int8_group_bytes(int group, int tb) { return (int64_t)group * NR + NR * tb; }
static inline const int8_t *int8_column(const uint8_t *panel, int group, int tb, int k) {      // the NR integers of k
    return (const int8_t *)(panel + k / group * int8_group_bytes(group, tb)) + (int64_t)(k % group) * NR;
}
static inline const uint8_t *int8_tables(const uint8_t *panel, int group, int tb, int g) {
    return panel + g * int8_group_bytes(group, tb) + (int64_t)group * NR;
}

// Bytes of a packed 8-bit weight [N, K] (group even, dividing K)
KERNEL_API int64_t blocked_int8_size(int N, int K, int group, int tb) {
    const int64_t panels = (N + NR - 1) / NR;
    return panels * (K / group) * int8_group_bytes(group, tb);
}

// q [N, K] (-128..127), scales [N, K / group] (tb bytes each) -> the 8-bit panel layout above
KERNEL_API void blocked_int8_pack(const int8_t *q, const void *scales, int N, int K, int group, int tb, uint8_t *out) {
    const int panels = (N + NR - 1) / NR, groups = K / group;
    const int64_t panel_bytes = blocked_int8_size(NR, K, group, tb);
    #pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        uint8_t *o = out + p * panel_bytes;
        for (int j = 0; j < NR; j++) {
            const int n = p * NR + j;
            for (int k = 0; k < K; k++) ((int8_t *)int8_column(o, group, tb, k))[j] = n < N ? q[(int64_t)n * K + k] : 0;
            for (int g = 0; g < groups; g++) {
                uint8_t *t = (uint8_t *)int8_tables(o, group, tb, g) + j * tb;
                memset(t, 0, tb);
                if (n < N) memcpy(t, (const uint8_t *)scales + ((int64_t)n * groups + g) * tb, tb);
            }
        }
    }
}

// FP8 (e4m3fn) bytes q [N, K] and their scales [N, K / group] (float32) -> the 8-bit panel layout,
// the tables holding scale * 2^8 (exact: a power of two), as the widened bytes are value * 2^-8.
// Returns -1 where its work buffer could not be allocated.
KERNEL_API int blocked_fp8_pack(const uint8_t *q, const float *scales, int N, int K, int group, uint8_t *out) {
    const int64_t count = (int64_t)N * (K / group);
    float *tables = (float *)malloc(sizeof(float) * (size_t)count);
    if (!tables) return -1;
    for (int64_t i = 0; i < count; i++) tables[i] = scales[i] * 256.f;
    blocked_int8_pack((const int8_t *)q, tables, N, K, group, 4, out);
    free(tables);
    return 0;
}


// An 8-bit panel's value of byte q as float32: int8 as it is, FP8 times 2^-8 (its tables hold scale * 2^8)
static inline float eight_bit_value(int8_t q, int fp8) { return fp8 ? fp8_scaled((uint8_t)q) : (float)q; }

// Rows index[0..n) of a weight [N, K] packed by blocked_pack (bits 0, in dtype) or by
// blocked_int8_pack / blocked_fp8_pack (bits 8: q * scale in float32, rounded to dtype), as out
// [n, K]: an embedding lookup in a tied LM head's table.
KERNEL_API void blocked_rows(const void *packed, const int64_t *index, int n, int K, int bits, int fp8, int group,
                             int tb, int dtype, void *out) {
    for (int i = 0; i < n; i++) {
        const int64_t panel = index[i] / NR, j = index[i] % NR;
        if (bits == 8) {
            const uint8_t *p = (const uint8_t *)packed + panel * blocked_int8_size(NR, K, group, tb);
            for (int k = 0; k < K; k++) {
                const uint8_t *scale = int8_tables(p, group, tb, k / group) + j * tb;
                float s;
                if (tb == 4) memcpy(&s, scale, 4);
                else { uint16_t h; memcpy(&h, scale, 2); s = f16_to_f32(h); }
                store(out, (int64_t)i * K + k, eight_bit_value(int8_column(p, group, tb, k)[j], fp8) * s, dtype);
            }
        } else if (dtype == 0) {
            for (int k = 0; k < K; k++) ((float *)out)[(int64_t)i * K + k] = ((const float *)packed)[(panel * K + k) * NR + j];
        } else {     // k pairs: panel p's words [Kp / 2][NR], k in the low half, k + 1 in the high
            const int64_t Kp = K + K % 2;
            for (int k = 0; k < K; k++)
                ((uint16_t *)out)[(int64_t)i * K + k] = ((const uint16_t *)packed)[((panel * (Kp / 2) + k / 2) * NR + j) * 2 + (k & 1)];
        }
    }
}

#if defined(HAVE_SIMD16)
// 16 table entries from j on (float32 or float16, tb bytes each) as float32
static inline __attribute__((always_inline)) vf16 load_table(const uint8_t *table, int j, int tb) {
    return tb == 4 ? vf_load((const float *)table + j) : vf_half((const uint16_t *)table + j);
}

// The next panel's bytes, asked for into L2 while this panel's later row tiles run from cache
// (only the first tile over a panel reads it from memory; without this the memory bus idles
// during the others): `lines` cache lines every AHEAD_SEGMENT values of k, from at until end.
typedef struct { const char *at, *end; int lines; } ahead_t;
#define AHEAD_SEGMENT 16

// A segment's asks: the next `lines` lines of the next panel, at most up to its end
static inline __attribute__((always_inline)) void ask_ahead(const char **at, const ahead_t *ahead) {
    if (*at >= ahead->end) return;
    for (int i = 0; i < ahead->lines; i++) _mm_prefetch(*at + 64 * i, _MM_HINT_T1);
    *at += 64 * ahead->lines;
}

// acc[m][v] = x rows m (NM of them, a constant: the accumulators stay in registers) . the panel's
// vector v of output features, over Kp (even for bfloat16) values of k. ahead (float32; NULL or
// not is a constant where it is called): asks for the next panel meanwhile, as panel_tile_dot.
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t x_stride, const void *panel, int Kp,
                                                       const int NM, int dtype, vf16 acc[MR][NV], int prefetch,
                                                       const ahead_t *ahead) {
    for (int m = 0; m < NM; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = vf_zero();
    if (dtype == 0) {
        const float *w = (const float *)panel;
        const char *at = ahead ? ahead->at : NULL;
        for (int k = 0; k < Kp; k++) {
            if (ahead && k % AHEAD_SEGMENT == 0) ask_ahead(&at, ahead);
            vf16 wv[NV];
            if (prefetch)
                for (int v = 0; v < NV; v++) _mm_prefetch((const char *)(w + (int64_t)k * NR + 16 * v) + PF_BYTES, _MM_HINT_T0);
            for (int v = 0; v < NV; v++) wv[v] = vf_load_kept(w + (int64_t)k * NR + 16 * v);   // once for NM rows
            for (int m = 0; m < NM; m++) {
                const vf16 xb = vf_set1(x[m * x_stride + k]);
                for (int v = 0; v < NV; v++) acc[m][v] = vf_fmadd(xb, wv[v], acc[m][v]);
            }
        }
    } else {
        // a 32-bit word holds k (low half) and k + 1 (high half): a shift or a mask widens each
        const uint32_t *w = (const uint32_t *)panel;
        const vi16 high = vi_set1((int)0xffff0000u);
        for (int k = 0; k < Kp; k += 2) {
            vf16 even[NV], odd[NV];
            if (prefetch)
                for (int v = 0; v < NV; v++) _mm_prefetch((const char *)(w + (int64_t)(k / 2) * NR + 16 * v) + PF_BYTES, _MM_HINT_T0);
            for (int v = 0; v < NV; v++) {
                const vi16 pair = vi_load(w + (int64_t)(k / 2) * NR + 16 * v);
                even[v] = vi_bits_f(vi_slli(pair, 16));
                odd[v] = vi_bits_f(vi_and(pair, high));
            }
            for (int m = 0; m < NM; m++) {
                const vf16 xe = vf_set1(x[m * x_stride + k]), xo = vf_set1(x[m * x_stride + k + 1]);
                for (int v = 0; v < NV; v++) acc[m][v] = vf_fmadd(xe, even[v], acc[m][v]);
                for (int v = 0; v < NV; v++) acc[m][v] = vf_fmadd(xo, odd[v], acc[m][v]);
            }
        }
    }
}
#if defined(__AVX512BF16__)
// acc[m][v] += NM rows m of x at the k pair (k, k + 1) . 16 features' pairs of bfloat16 weights w[v]
static inline __attribute__((always_inline)) void dot_step(const uint16_t *x, int64_t x_stride, int k, const int NM,
                                                     const __m512i w[NV], __m512 acc[][NV]) {
    for (int m = 0; m < NM; m++) {
        uint32_t pair;
        memcpy(&pair, x + m * x_stride + k, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, (__m512bh)w[v]);
    }
}

// panel_tile for bfloat16 x and weights with the CPU's bfloat16 dot product (vdpbf16ps): each
// instruction multiplies a k pair of x into a k pair of 16 features and adds both products to the
// float32 accumulators. Where it runs at the FMA rate (AMD Zen 4) that is twice the
// multiply-adds of widening to float32; where it runs at half that rate (Intel without AMX) it
// is no faster. kernels._bf16_dot_pays times both once per process and sets the choice.
// panel_dot_pair is its step over one k pair.
static inline __attribute__((always_inline)) void panel_dot_pair(const uint16_t *x, int64_t x_stride, const uint32_t *w,
                                                           int k, const int NM, __m512 acc[MR][NV], int prefetch) {
    __m512i wv[NV];
    if (prefetch)
        for (int v = 0; v < NV; v++) _mm_prefetch((const char *)(w + (int64_t)(k / 2) * NR + 16 * v) + PF_BYTES, _MM_HINT_T0);
    for (int v = 0; v < NV; v++) wv[v] = _mm512_loadu_si512(w + (int64_t)(k / 2) * NR + 16 * v);
    dot_step(x, x_stride, k, NM, wv, acc);
}

// with_ahead (a constant: two tiles are compiled) also asks for the next panel, in segments of k
// that each start with a few lines' asks (one ask per k step cost more than it saved)
static inline __attribute__((always_inline)) void panel_tile_dot(const uint16_t *x, int64_t x_stride, const uint32_t *w,
                                                           int Kp, const int NM, __m512 acc[MR][NV], int prefetch,
                                                           const int with_ahead, const ahead_t *ahead) {
    for (int m = 0; m < NM; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    if (!with_ahead) {
        for (int k = 0; k < Kp; k += 2) panel_dot_pair(x, x_stride, w, k, NM, acc, prefetch);
        return;
    }
    const char *at = ahead->at;
    for (int k0 = 0; k0 < Kp; k0 += AHEAD_SEGMENT) {
        ask_ahead(&at, ahead);
        const int k1 = k0 + AHEAD_SEGMENT < Kp ? k0 + AHEAD_SEGMENT : Kp;
        for (int k = k0; k < k1; k += 2) panel_dot_pair(x, x_stride, w, k, NM, acc, prefetch);
    }
}
#endif

// Asks for group g's bytes PF_BYTES ahead in the panel's stream (the first pass over a panel)
static inline __attribute__((always_inline)) void prefetch_int4_group(const uint8_t *panel, int group, int tb, int g) {
    const char *at = (const char *)panel + g * int4_group_bytes(group, tb) + PF_BYTES;
    for (int64_t off = 0; off < int4_group_bytes(group, tb); off += 64) _mm_prefetch(at + off, _MM_HINT_T0);
}

// x quantized for the integer 4-bit tile: per row, int16 values q = round(x / d) with
// d = max |x| / 32767 per group of k's, the groups' d, and their sums of x (float). 16 bits
// keep x's rounding error near float's (llama.cpp's 8-bit blocks part from the float product by
// tenths of a nat on the default model); a 4-bit weight times an int16 is still one integer
// multiply-add, and a group's sum stays far inside 32 bits (group * 15 * 32767).
typedef struct {
    const int16_t *q;
    const float *scale, *sum;
    int64_t stride, groups;    // per row: K values, K / group scales and sums
} qx_t;

// A 4-bit tile with integer activations: per group, the 4-bit integers times the int16 x summed
// in 32-bit integers (a k pair per multiply-add: the word's shift and mask give the pair in lane,
// as int16 halves), then
//   sum_k x[k] * (q[k] * scale + min) = scale * d * sum_k q[k] * qx[k] + min * sum_k x[k].
// A weight costs half a shift, half a mask and half a multiply-add: no widening to float, so
// batch-1 decode is not bound by arithmetic on AVX2.
static inline __attribute__((always_inline)) void int4_tile_q16(const qx_t *xq, int m0, const uint8_t *panel, int K,
        int group, int tb, const int NM, vf16 acc[MR][NV], int prefetch) {
    for (int m = 0; m < NM; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = vf_zero();
    const vi16 nibble_pair = vi_set1(0x000F000F);
    for (int g0 = 0, g = 0; g0 < K; g0 += group, g++) {
        if (prefetch) prefetch_int4_group(panel, group, tb, g);
        vi16 isum[MR4_Q][NV];
        for (int m = 0; m < NM; m++)
            for (int v = 0; v < NV; v++) isum[m][v] = vi_zero();
        for (int k8 = g0; k8 < g0 + group; k8 += 8) {
            const uint32_t *words = int4_words(panel, group, tb, k8);
            vi16 xb[MR4_Q][4];                   // x's pairs (k8 + 2i, k8 + 2i + 1), broadcast
            for (int m = 0; m < NM; m++)
                for (int i = 0; i < 4; i++) {
                    int32_t xp;
                    memcpy(&xp, xq->q + (m0 + m) * xq->stride + k8 + 2 * i, 4);
                    xb[m][i] = vi_set1(xp);
                }
            // one vector of features at a time: few registers live (AVX2 has 16)
            for (int v = 0; v < NV; v++) {
                const vi16 w = vi_load(words + 16 * v);
                for (int i = 0; i < 4; i++) {
                    const vi16 pair = vi_and(vi_srli(w, 4 * i), nibble_pair);
                    for (int m = 0; m < NM; m++) isum[m][v] = vi_dot_s16(isum[m][v], pair, xb[m][i]);
                }
            }
        }
        const uint8_t *tables = int4_tables(panel, group, tb, g);
        for (int v = 0; v < NV; v++) {
            const vf16 s = load_table(tables, 16 * v, tb), mn = load_table(tables, NR + 16 * v, tb);
            for (int m = 0; m < NM; m++) {
                const int64_t row = (m0 + m) * xq->groups + g;
                acc[m][v] = vf_fmadd(vf_mul(s, vf_set1(xq->scale[row])), vi_to_f(isum[m][v]), acc[m][v]);
                acc[m][v] = vf_fmadd(mn, vf_set1(xq->sum[row]), acc[m][v]);
            }
        }
    }
}

// x [M, K] (dtype, row stride x_stride) quantized into xq's buffers for int4_tile_q16: 16 values at
// a time where the group allows (sums in that order: a row's values do not depend on the batch)
static void quantize_x(const void *x, int64_t x_stride, int M, int K, int group, int dtype, const qx_t *xq) {
    for (int m = 0; m < M; m++)
        for (int g = 0; g < K / group; g++) {
            const int64_t at = m * x_stride + (int64_t)g * group;
            int16_t *q = (int16_t *)xq->q + m * xq->stride + (int64_t)g * group;
            const int vectors = group % 16 == 0;      // 16 values at a time
            float amax = 0.f, sum = 0.f;
            if (vectors) {
                vf16 vmax = vf_zero(), vsum = vf_zero();
                for (int k = 0; k < group; k += 16) {
                    const vf16 v = vf_load_as(x, at + k, dtype);
                    vmax = vf_max(vmax, vf_abs(v));
                    vsum = vf_add(vsum, v);
                }
                amax = vf_reduce_max(vmax), sum = vf_reduce_add(vsum);
            } else {
                for (int k = 0; k < group; k++) {
                    const float v = load(x, at + k, dtype);
                    amax = fmaxf(amax, fabsf(v));
                    sum += v;
                }
            }
            const float inv = amax > 0.f ? 32767.f / amax : 0.f;
            ((float *)xq->scale)[m * xq->groups + g] = amax / 32767.f;
            ((float *)xq->sum)[m * xq->groups + g] = sum;
            if (vectors)
                for (int k = 0; k < group; k += 16) vf_store_int16(q + k, vf_mul(vf_load_as(x, at + k, dtype), vf_set1(inv)));
            else
                for (int k = 0; k < group; k++) q[k] = (int16_t)lrintf(load(x, at + k, dtype) * inv);
        }
}

// 16 features' values of one k of an 8-bit panel, as float32: int8 as it is, FP8 times 2^-8
static inline __attribute__((always_inline)) vf16 int8_floats(const int8_t *column, const int fp8) {
    return fp8 ? vf_fp8((const uint8_t *)column) : vf_int8(column);
}

// The NR FP8 values of one k of an 8-bit panel, as float32 times 2^-8; on AVX-512 32 bytes at a
// time where it can (one sign extension, shift and mask for two vectors)
static inline __attribute__((always_inline)) void fp8_column(const int8_t *column, vf16 out[NV]) {
    int v = 0;
#if defined(__AVX512F__)
    for (; v + 2 <= NV; v += 2) {
        const __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(column + 16 * v)));
        const __m512i half = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16((short)0xBF80));
        out[v] = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
        out[v + 1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
    }
#endif
    for (; v < NV; v++) out[v] = vf_fp8((const uint8_t *)column + 16 * v);
}

// Asks for the bytes of an 8-bit panel's k pair PF_BYTES ahead in the stream (2 NR = 96 bytes:
// two lines 64 bytes apart cover each pair's), and at a group's end for its tables' bytes
static inline __attribute__((always_inline)) void prefetch_int8_pair(const int8_t *column) {
    _mm_prefetch((const char *)column + PF_BYTES, _MM_HINT_T0);
    _mm_prefetch((const char *)column + PF_BYTES + 64, _MM_HINT_T0);
}
static inline __attribute__((always_inline)) void prefetch_int8_tables(const uint8_t *tables, int tb) {
    for (int off = 0; off < NR * tb; off += 64) _mm_prefetch((const char *)tables + PF_BYTES + off, _MM_HINT_T0);
}

// panel_tile for an 8-bit panel: each k's weights widened to float32, w = q * scale (one
// rounding), then as panel_tile
static inline __attribute__((always_inline)) void int8_tile(const float *x, int64_t x_stride, const uint8_t *panel, int K,
                                                      int group, int tb, const int NM, vf16 acc[MR][NV], int prefetch) {
    for (int m = 0; m < NM; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = vf_zero();
    for (int g0 = 0, g = 0; g0 < K; g0 += group, g++) {
        const uint8_t *tables = int8_tables(panel, group, tb, g);
        vf16 s[NV];
        for (int v = 0; v < NV; v++) s[v] = load_table(tables, 16 * v, tb);
        for (int k = g0; k < g0 + group; k++) {
            const int8_t *column = int8_column(panel, group, tb, g0) + (int64_t)(k - g0) * NR;   // no division per k
            if (prefetch && k % 2 == 0) prefetch_int8_pair(column);
            vf16 w[NV];
            for (int v = 0; v < NV; v++) w[v] = vf_mul(int8_floats(column + 16 * v, 0), s[v]);
            for (int m = 0; m < NM; m++) {
                const vf16 xb = vf_set1(x[m * x_stride + k]);
                for (int v = 0; v < NV; v++) acc[m][v] = vf_fmadd(xb, w[v], acc[m][v]);
            }
        }
        if (prefetch) prefetch_int8_tables(tables, tb);
    }
}

// An 8-bit tile of FP8 bytes: per group, each k's bytes widened to value * 2^-8 (or read so
// widened from `wide`, [K][NR] float32: widen_int8_panel) and multiplied into a partial sum per
// row and vector, to which the group's scale * 2^8 is applied at the group's end (as the dot tile
// applies its scales): no multiply per weight, which at one row is a sixth of the work.
static inline __attribute__((always_inline)) void fp8_tile(const float *x, int64_t x_stride, const uint8_t *panel,
                                                     const float *wide, int K, int group, const int NM,
                                                     vf16 acc[MR][NV], int prefetch) {
    for (int m = 0; m < NM; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = vf_zero();
    for (int g0 = 0, g = 0; g0 < K; g0 += group, g++) {
        vf16 part[MR][NV];
        for (int m = 0; m < NM; m++)
            for (int v = 0; v < NV; v++) part[m][v] = vf_zero();
        const int8_t *first = int8_column(panel, group, 4, g0);
        for (int k = g0; k < g0 + group; k++) {
            vf16 w[NV];
            if (wide) {
                for (int v = 0; v < NV; v++) w[v] = vf_load(wide + (int64_t)k * NR + 16 * v);
            } else {
                const int8_t *column = first + (int64_t)(k - g0) * NR;
                if (prefetch && k % 2 == 0) prefetch_int8_pair(column);
                fp8_column(column, w);
            }
            for (int m = 0; m < NM; m++) {
                const vf16 xb = vf_set1(x[m * x_stride + k]);
                for (int v = 0; v < NV; v++) part[m][v] = vf_fmadd(xb, w[v], part[m][v]);
            }
        }
        const uint8_t *tables = int8_tables(panel, group, 4, g);
        if (prefetch) prefetch_int8_tables(tables, 4);
        for (int v = 0; v < NV; v++) {
            const vf16 s = vf_load((const float *)tables + 16 * v);
            for (int m = 0; m < NM; m++) acc[m][v] = vf_fmadd(s, part[m][v], acc[m][v]);
        }
    }
}
#if defined(__AVX512BF16__)
// k pair (k, k + 1) of 16 features of an 8-bit panel as bfloat16 pairs for the dot product. The
// integers (and FP8 values) are exact in bfloat16 (at most 8 significant bits), so the high half of their float32
// conversion is their bfloat16 value: lane j = (q[k], q[k + 1]).
static inline __attribute__((always_inline)) __m512i int8_pairs(const int8_t *column, const int fp8) {
    const __m512i even = _mm512_castps_si512(int8_floats(column, fp8));
    const __m512i odd = _mm512_castps_si512(int8_floats(column + NR, fp8));
    // even >> 16 | odd & 0xffff0000
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(even, 16), odd, _mm512_set1_epi32((int)0xffff0000u), 0xF8);
}

// An 8-bit tile for bfloat16 x with the CPU's bfloat16 dot product: per group,
// sum_k x[k] * q[k] * scale = scale * sum_k x[k] * q[k], the integers multiplied as they are.
// pairs: the panel's pairs converted once (widen_int8_panel), or NULL to convert them here.
static inline __attribute__((always_inline)) void int8_tile_dot(const uint16_t *x, int64_t x_stride, const uint8_t *panel,
        const uint32_t *pairs, int K, int group, int tb, const int NM, __m512 acc[MR][NV], int prefetch,
        const int fp8) {
    for (int m = 0; m < NM; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    for (int g0 = 0, g = 0; g0 < K; g0 += group, g++) {
        __m512 part[MR4_DOT][NV];
        for (int m = 0; m < NM; m++)
            for (int v = 0; v < NV; v++) part[m][v] = _mm512_setzero_ps();
        for (int k = g0; k < g0 + group; k += 2) {
            const int8_t *column = int8_column(panel, group, tb, g0) + (int64_t)(k - g0) * NR;   // no division per k
            if (prefetch) prefetch_int8_pair(column);
            __m512i w[NV];
            for (int v = 0; v < NV; v++)
                w[v] = pairs ? _mm512_loadu_si512(pairs + (int64_t)(k / 2) * NR + 16 * v)
                             : int8_pairs(column + 16 * v, fp8);
            dot_step(x, x_stride, k, NM, w, part);
        }
        const uint8_t *tables = int8_tables(panel, group, tb, g);
        if (prefetch) prefetch_int8_tables(tables, tb);
        for (int v = 0; v < NV; v++) {
            const __m512 s = load_table(tables, 16 * v, tb);
            for (int m = 0; m < NM; m++) acc[m][v] = _mm512_fmadd_ps(s, part[m][v], acc[m][v]);
        }
    }
}
#endif
#endif

// 1: bfloat16 products use the dot-product tiles, and bfloat16 prompt attention its pairs (set by
// blocked_set_bf16_dot, once per process, before the first product: every product then sums in
// the same order)
int shardlm_bf16_dot = 0;

#if defined(HAVE_SIMD16)

// An 8-bit panel widened as the 8-bit tiles widen it: float32 q * scale ([K][NR]; FP8: value *
// 2^-8, the scales applied by fp8_tile) or the dot tile's bfloat16 integer pairs ([K / 2][NR])
static void widen_int8_panel(const uint8_t *panel, int K, int group, int tb, int dot, int fp8, void *out) {
    for (int k = 0; k < K; k += 2)
        for (int v = 0; v < NV; v++) {
            const int8_t *column = int8_column(panel, group, tb, k) + 16 * v;
#if defined(__AVX512BF16__)
            if (dot) {
                _mm512_storeu_si512((uint32_t *)out + (int64_t)(k / 2) * NR + 16 * v, int8_pairs(column, fp8));
                continue;
            }
#endif
            const vf16 s = fp8 ? vf_set1(1.f) : load_table(int8_tables(panel, group, tb, k / group), 16 * v, tb);
            vf_store((float *)out + (int64_t)k * NR + 16 * v, vf_mul(int8_floats(column, fp8), s));
            vf_store((float *)out + (int64_t)(k + 1) * NR + 16 * v, vf_mul(int8_floats(column + NR, fp8), s));
        }
}

// The register tiles, by the panel they read and the x they take
enum {
    TILE_F32,       // float32 panel, float32 x
    TILE_F32_AHEAD, // the same, asking for the next panel meanwhile (ahead_t)
    TILE_BF16,      // bfloat16 panel widened to float32, float32 x
    TILE_DOT,       // bfloat16 panel, bfloat16 x, dot product
    TILE_DOT_AHEAD, // the same, asking for the next panel meanwhile (ahead_t)
    TILE_INT8,      // 8-bit panel widened to float32, float32 x
    TILE_INT8_DOT,  // 8-bit panel as bfloat16 integer pairs, bfloat16 x, dot product per group
    TILE_FP8,       // 8-bit panel of FP8 bytes widened to float32, float32 x, scales per group (fp8_tile)
    TILE_FP8_WIDE,  // the same, the panel's values widened once (widen_int8_panel)
    TILE_FP8_DOT,   // 8-bit panel of FP8 bytes as bfloat16 pairs, bfloat16 x, dot product per group
    TILE_INT4_Q16,  // 4-bit panel, x quantized to int16 per group (qx_t), integer dot product per group
};

// acc = `rows` rows of x (at most MR; MR4_Q for 4-bit tiles, MR4 / MR4_DOT for 8-bit ones) . one panel, by a
// tile of that constant row count (its accumulators stay in registers). widened: the 8-bit panel
// widened once (the dot tiles' pairs, TILE_FP8_WIDE's floats); xq and m0: the integer 4-bit
// tile's quantized x and the tile's first row in it.
static inline __attribute__((always_inline)) void panel_product(int kind, const void *x, int64_t xs, const void *panel,
        const void *widened, const qx_t *xq, int m0, int Kp, int group, int tb,
        int rows, vf16 acc[MR][NV], int prefetch, const ahead_t *ahead) {
#if MR == 2
#define ROWS(CALL) switch (rows) { case 1: CALL(1); break; default: CALL(MR); }
#else
#define ROWS(CALL) switch (rows) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(MR); }
#endif
#define F32(n) panel_tile((const float *)x, xs, panel, Kp, n, 0, acc, prefetch, NULL)
#define F32_AHEAD(n) panel_tile((const float *)x, xs, panel, Kp, n, 0, acc, prefetch, ahead)
#define BF16(n) panel_tile((const float *)x, xs, panel, Kp, n, 1, acc, prefetch, NULL)
#define DOT(n) panel_tile_dot((const uint16_t *)x, xs, (const uint32_t *)panel, Kp, n, acc, prefetch, 0, NULL)
#define DOT_AHEAD(n) panel_tile_dot((const uint16_t *)x, xs, (const uint32_t *)panel, Kp, n, acc, prefetch, 1, ahead)
#define INT4_Q16(n) int4_tile_q16(xq, m0, (const uint8_t *)panel, Kp, group, tb, n < MR4_Q ? n : MR4_Q, acc, prefetch)
#define INT8(n) int8_tile((const float *)x, xs, (const uint8_t *)panel, Kp, group, tb, n < MR4 ? n : MR4, acc, prefetch)
#define INT8_DOT(n) int8_tile_dot((const uint16_t *)x, xs, (const uint8_t *)panel, (const uint32_t *)widened, Kp, \
                                  group, tb, n < MR4_DOT ? n : MR4_DOT, acc, prefetch, 0)
#define FP8(n) fp8_tile((const float *)x, xs, (const uint8_t *)panel, NULL, Kp, group, n < MR4_FP8 ? n : MR4_FP8, acc, \
                        prefetch)
#define FP8_WIDE(n) fp8_tile((const float *)x, xs, (const uint8_t *)panel, (const float *)widened, Kp, group, n, acc, \
                             prefetch)
#define FP8_DOT(n) int8_tile_dot((const uint16_t *)x, xs, (const uint8_t *)panel, (const uint32_t *)widened, Kp, \
                                 group, tb, n < MR4_DOT ? n : MR4_DOT, acc, prefetch, 1)
    switch (kind) {
        case TILE_F32: ROWS(F32) break;
        case TILE_F32_AHEAD: ROWS(F32_AHEAD) break;
        case TILE_BF16: ROWS(BF16) break;
        case TILE_INT8: ROWS(INT8) break;
        case TILE_FP8: ROWS(FP8) break;
        case TILE_FP8_WIDE: ROWS(FP8_WIDE) break;
        case TILE_INT4_Q16: ROWS(INT4_Q16) break;
#if defined(__AVX512BF16__)
        case TILE_DOT: ROWS(DOT) break;
        case TILE_DOT_AHEAD: ROWS(DOT_AHEAD) break;
        case TILE_INT8_DOT: ROWS(INT8_DOT) break;
        case TILE_FP8_DOT: ROWS(FP8_DOT) break;
#endif
    }
#undef ROWS
#undef F32
#undef F32_AHEAD
#undef BF16
#undef DOT
#undef DOT_AHEAD
#undef INT8
#undef INT4_Q16
#undef INT8_DOT
#undef FP8
#undef FP8_WIDE
#undef FP8_DOT
}

// y[i..i+n) = r (+ bias[b..b+n)), rounded to dtype; n <= 16
static inline __attribute__((always_inline)) void store_outputs(void *y, int64_t i, vf16 r, const void *bias, int b,
                                                                int n, int dtype) {
#if defined(__AVX512F__)
    const __mmask16 mask = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    if (bias) r = _mm512_add_ps(r, load16(bias, b, mask, dtype));
    store16(y, i, r, mask, dtype);
#else
    float lanes[16];
    vf_store(lanes, r);
    for (int j = 0; j < n; j++) store(y, i + j, bias ? lanes[j] + load(bias, b + j, dtype) : lanes[j], dtype);
#endif
}

#if SIMD16_BITS == 256
// AVX2's float tiles of many rows take a third of a panel at a time (16 features, 2 registers)
// against 6 rows of x (float32 panels: 12 accumulators + 2 weights + the broadcast x, as BLIS's
// Haswell kernel) or 5 rows (bfloat16 panels: 10 accumulators + 2 even and 2 odd widened weights).
// The whole-panel tile of 2 rows needs 19 registers and spills (1.3x slower than oneDNN at 512
// rows on a Zen 1). The accumulators are named variables: GCC -O3 stores an array of them to the
// stack at every k. Each output still sums its k in order from zero, as panel_tile does: the same
// bits at any row count. `ahead` (float32; NULL or not is a constant where it is called): as
// panel_tile's.
#define MR_F32 6
#define MR_BF16 5
static inline __attribute__((always_inline)) void third_tile(const float *x, int64_t xs, const void *panel, int Kp,
                                                              const int NM, int third, int dtype, vf16 out[MR_F32],
                                                              int prefetch, const ahead_t *ahead) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0,
           b4 = a0, a5 = a0, b5 = a0, xb;
#define ROW(m, w0, w1, kk) if (NM > m) { xb = _mm256_broadcast_ss(x + m * xs + (kk)); \
                                         a##m = _mm256_fmadd_ps(xb, w0, a##m); b##m = _mm256_fmadd_ps(xb, w1, b##m); }
#define ROWS(w0, w1, kk) ROW(0, w0, w1, kk) ROW(1, w0, w1, kk) ROW(2, w0, w1, kk) ROW(3, w0, w1, kk) \
                         ROW(4, w0, w1, kk) ROW(5, w0, w1, kk)
    if (dtype == 0) {
        const float *w = (const float *)panel + 16 * third;
        const char *at = ahead ? ahead->at : NULL;
        for (int k = 0; k < Kp; k++) {
            if (ahead && k % AHEAD_SEGMENT == 0) ask_ahead(&at, ahead);
            if (prefetch) _mm_prefetch((const char *)(w + (int64_t)k * NR) + PF_BYTES, _MM_HINT_T0);
            const __m256 w0 = _mm256_loadu_ps(w + (int64_t)k * NR), w1 = _mm256_loadu_ps(w + (int64_t)k * NR + 8);
            ROWS(w0, w1, k)
        }
    } else {
        // a 32-bit word holds k (low half) and k + 1 (high half): a shift or a mask widens each
        const uint32_t *w = (const uint32_t *)panel + 16 * third;
        const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
        for (int k = 0; k < Kp; k += 2) {
            if (prefetch) _mm_prefetch((const char *)(w + (int64_t)(k / 2) * NR) + PF_BYTES, _MM_HINT_T0);
            const __m256i p0 = _mm256_loadu_si256((const __m256i *)(w + (int64_t)(k / 2) * NR));
            const __m256i p1 = _mm256_loadu_si256((const __m256i *)(w + (int64_t)(k / 2) * NR + 8));
            const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(p0, 16));
            const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(p1, 16));
            const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(p0, high));
            const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(p1, high));
            ROWS(e0, e1, k) ROWS(o0, o1, k + 1)
        }
    }
#undef ROWS
#undef ROW
    out[0] = (vf16){a0, b0}, out[1] = (vf16){a1, b1}, out[2] = (vf16){a2, b2};
    out[3] = (vf16){a3, b3}, out[4] = (vf16){a4, b4}, out[5] = (vf16){a5, b5};
}

// `rows` (up to MR_F32, or MR_BF16 for a bfloat16 panel) rows of x . one float panel, a third at a
// time, into y (+ bias)
static inline __attribute__((always_inline)) void third_tiles(const float *x, int64_t xs, const void *panel, int Kp,
        int rows, int dtype, int prefetch, const ahead_t *ahead, void *y, int64_t m0, int N, int n0, int width,
        const void *bias, int out_dtype) {
    for (int third = 0; third < 3 && 16 * third < width; third++) {
        vf16 acc[MR_F32];
        const ahead_t *asks = third == 0 ? ahead : NULL;      // the next panel: asked for in the first third
#define THIRD(n) third_tile(x, xs, panel, Kp, n, third, dtype, acc, prefetch, asks)
        if (dtype == 0) {
            switch (rows) { case 1: THIRD(1); break; case 2: THIRD(2); break; case 3: THIRD(3); break;
                            case 4: THIRD(4); break; case 5: THIRD(5); break; default: THIRD(MR_F32); }
        } else {
            switch (rows) { case 1: THIRD(1); break; case 2: THIRD(2); break; case 3: THIRD(3); break;
                            case 4: THIRD(4); break; default: THIRD(MR_BF16); }
        }
#undef THIRD
        const int col = 16 * third;
        for (int m = 0; m < rows; m++)
            store_outputs(y, (m0 + m) * N + n0 + col, acc[m], bias, n0 + col, width - col < 16 ? width - col : 16,
                          out_dtype);
    }
}
#endif

#if SHARDLM_AMX
// bfloat16 products of at least this many rows run on the AMX tiles (0: none; blocked_set_amx):
// over float panels, over 8-bit ones and over 4-bit ones
static int amx_min_rows = 0, amx_min_rows_8bit = 0, amx_min_rows_4bit = 0;
static int64_t amx_calls = 0;        // products run on the tiles (blocked_amx_calls)

// The tiles for the products (palette 1): tiles 0-2 the C blocks of a panel's three 16-feature
// vectors for 16 rows of x, tile 3 16 rows x 32 k of x, tiles 4-6 the panel's 16 k pairs x 16
// features: a bfloat16 panel is AMX's B layout already (a k pair per 32-bit word), rows NR words apart.

static void amx_configure(int rows) {
    tile_config_t c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 7; t++) c.rows[t] = t < 4 ? rows : 16, c.colsb[t] = 64;   // C and x: `rows` rows of 16 (or fewer)
    _tile_loadconfig(&c);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
}

// Tiles 0-2 += the configured rows of x at xk (32 columns, rows x_stride elements apart) . the
// panel's 16 k pairs at w (three vectors of 16 features; pairs NR words apart)
static inline void amx_step(const uint16_t *xk, int64_t x_stride, const uint32_t *w) {
    _tile_loadd(3, xk, x_stride * 2);
    _tile_loadd(4, w, NR * 4);
    _tile_loadd(5, w + 16, NR * 4);
    _tile_loadd(6, w + 32, NR * 4);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
}

// Tiles 0-2 (a panel's sums for the configured rows) into c, and zeroed for the next sums
static inline void amx_store_sums(float c[16][NR]) {
    _tile_stored(0, &c[0][0], NR * 4);
    _tile_stored(1, &c[0][16], NR * 4);
    _tile_stored(2, &c[0][32], NR * 4);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
}

// y = x . w^T for bfloat16 x (rows of unit column stride) and float panels of bfloat16 w, K a
// multiple of 32, on the AMX tiles: per panel and 16 rows of x, read in place, the sum over k in
// runs of 32. Each row's sums are independent of the other rows of its tile and of how many it
// has (tests/unit/test_amx.py), so a ragged last block is the last 16 rows, those of the block
// before computed again to the same bits, and fewer than 16 rows in all are a tile of that many.
static void amx_panels(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const void *bias, void *y, int M,
                       int N, int K) {
    const int panels = (N + NR - 1) / NR, blocks = (M + 15) / 16, tile_rows = M < 16 ? M : 16;
    const int64_t panel_elements = (int64_t)K * NR;
    #pragma omp parallel if (panels > 1 && (int64_t)N * K >= 65536)
    {
    amx_configure(tile_rows);
    float c[16][NR];
    #pragma omp for schedule(static)
    for (int p = 0; p < panels; p++) {
        const uint16_t *panel = packed + p * panel_elements;
        const int n0 = p * NR, width = N - n0 < NR ? N - n0 : NR;
        // the next panel asked for into L2 while this one runs from cache (as the vector tiles
        // do): its lines spread over the k steps of the row blocks after the first (of the only
        // one, where there is one)
        const char *ahead = p + 1 < panels ? (const char *)(panel + panel_elements) : NULL;
        const int64_t ahead_lines = panel_elements * 2 / 64;
        const int ahead_steps = (blocks > 1 ? blocks - 1 : 1) * (K / 32);
        const int per_step = (int)((ahead_lines + ahead_steps - 1) / ahead_steps);
        int64_t line = 0;
        for (int b = 0; b < blocks; b++) {
            const int first = b * 16, r0 = first + tile_rows > M ? M - tile_rows : first;   // the tile's rows
            const uint16_t *xb = x + (int64_t)r0 * x_stride;
            for (int k0 = 0; k0 < K; k0 += 32) {
                if (ahead && (b > 0 || blocks == 1))
                    for (int i = 0; i < per_step && line < ahead_lines; i++, line++)
                        __builtin_prefetch(ahead + line * 64, 0, 2);
                amx_step(xb + k0, x_stride, (const uint32_t *)(panel + (int64_t)k0 * NR));   // k pair k0 / 2
            }
            amx_store_sums(c);
            for (int m = first - r0; m < tile_rows; m++)       // the rows not stored by the block before
                for (int v = 0; v < NV && 16 * v < width; v++)
                    store_outputs(y, (int64_t)(r0 + m) * N + n0 + 16 * v, vf_load(&c[m][16 * v]), bias, n0 + 16 * v,
                                  width - 16 * v < 16 ? width - 16 * v : 16, 1);
        }
    }
    _tile_release();
    }
}

// A 4-bit panel's integers as bfloat16 pairs ([K / 2][NR] words, AMX's B layout; exact): per 8
// k's a word per feature holds the pair (k + 2i, k + 2i + 1) at bits 4i and 16 + 4i
static void widen_int4_panel(const uint8_t *panel, int K, int group, int tb, uint32_t *pairs) {
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F), low_half = _mm512_set1_epi32(0xFFFF);
    const __m512i high_half = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int k8 = 0; k8 < K; k8 += 8)
        for (int v = 0; v < NV; v++) {
            const __m512i words = _mm512_loadu_si512(int4_words(panel, group, tb, k8) + 16 * v);
            for (int i = 0; i < 4; i++) {
                const __m512i pair = _mm512_and_si512(_mm512_srli_epi32(words, 4 * i), nibbles);
                // each integer as float32, whose upper half is its bfloat16
                const __m512i even = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_and_si512(pair, low_half)));
                const __m512i odd = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srli_epi32(pair, 16)));
                _mm512_storeu_si512(pairs + (int64_t)(k8 / 2 + i) * NR + 16 * v,
                                    _mm512_or_si512(_mm512_srli_epi32(even, 16), _mm512_and_si512(odd, high_half)));
            }
        }
}

// The same over 8-bit panels (int8, or FP8 bytes) or 4-bit ones (bits), bfloat16 x, groups a
// multiple of 32 columns: each panel's integers turned once into bfloat16 pairs (exact; AMX's B
// layout: the dot tile's for 8 bits, widen_int8_panel), then per 16 rows and group the tiles' sum
// S = sum_k x[k] q[k], applied as the group's scale * S (8 bits, as the dot tile applies it), or,
// for w = q * scale + min, scale * S + min * the group's sum of x (float32, 16 values at a time;
// x is not quantized, as the 4-bit vector tiles quantize it, so their sums differ). Returns -1
// where a buffer could not be allocated.
static int amx_integer_panels(const uint16_t *x, int64_t x_stride, const uint8_t *packed, const void *bias, void *y,
                              int M, int N, int K, int bits, int fp8, int group, int tb) {
    const int panels = (N + NR - 1) / NR, blocks = (M + 15) / 16, tile_rows = M < 16 ? M : 16, groups = K / group;
    const int64_t panel_bytes = bits == 4 ? blocked_int4_size(NR, K, group, tb) : blocked_int8_size(NR, K, group, tb);
    float *x_sums = NULL;
    if (bits == 4) {
        x_sums = (float *)malloc(sizeof(float) * (size_t)M * groups);
        if (!x_sums) return -1;
        for (int m = 0; m < M; m++)
            for (int g = 0; g < groups; g++) {
                vf16 sum = vf_zero();
                for (int k = g * group; k < (g + 1) * group; k += 16) sum = vf_add(sum, vf_load_as(x, m * x_stride + k, 1));
                x_sums[m * groups + g] = vf_reduce_add(sum);
            }
    }
    int failed = 0;
    #pragma omp parallel if (panels > 1 && (int64_t)N * K >= 65536)
    {
    uint32_t *pairs = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(K / 2) * NR);
    if (!pairs) {
        #pragma omp atomic write
        failed = 1;
    }
    amx_configure(tile_rows);
    float part[16][NR], acc[16][NR];
    #pragma omp for schedule(static)
    for (int p = 0; p < panels; p++) {
        if (!pairs) continue;
        const uint8_t *panel = packed + p * panel_bytes;
        const int n0 = p * NR, width = N - n0 < NR ? N - n0 : NR;
        if (bits == 4) widen_int4_panel(panel, K, group, tb, pairs);
        else widen_int8_panel(panel, K, group, tb, 1, fp8, pairs);
        for (int b = 0; b < blocks; b++) {
            const int first = b * 16, r0 = first + tile_rows > M ? M - tile_rows : first;   // as amx_panels
            const uint16_t *xb = x + (int64_t)r0 * x_stride;
            for (int g0 = 0, g = 0; g0 < K; g0 += group, g++) {
                for (int k0 = g0; k0 < g0 + group; k0 += 32) amx_step(xb + k0, x_stride, pairs + (int64_t)(k0 / 2) * NR);
                amx_store_sums(part);
                const uint8_t *tables = bits == 4 ? int4_tables(panel, group, tb, g) : int8_tables(panel, group, tb, g);
                for (int v = 0; v < NV; v++) {
                    const __m512 scale = load_table(tables, 16 * v, tb);
                    const __m512 min = bits == 4 ? load_table(tables, NR + 16 * v, tb) : _mm512_setzero_ps();
                    for (int m = 0; m < tile_rows; m++) {
                        const __m512 sum = _mm512_loadu_ps(&part[m][16 * v]);
                        const __m512 before = g ? _mm512_loadu_ps(&acc[m][16 * v]) : _mm512_setzero_ps();
                        __m512 total = _mm512_fmadd_ps(scale, sum, before);
                        if (bits == 4) total = _mm512_fmadd_ps(min, _mm512_set1_ps(x_sums[(r0 + m) * groups + g]), total);
                        _mm512_storeu_ps(&acc[m][16 * v], total);
                    }
                }
            }
            for (int m = first - r0; m < tile_rows; m++)
                for (int v = 0; v < NV && 16 * v < width; v++)
                    store_outputs(y, (int64_t)(r0 + m) * N + n0 + 16 * v, vf_load(&acc[m][16 * v]), bias, n0 + 16 * v,
                                  width - 16 * v < 16 ? width - 16 * v : 16, 1);
        }
    }
    _tile_release();
    free(pairs);
    }
    free(x_sums);
    return failed ? -1 : 0;
}
#endif

// The product over all panels, for float panels (bits 0) or 4- or 8-bit ones (group: columns
// per scale, tb: bytes per table entry; fp8: 8-bit panels of FP8 bytes); parallel over panels.
// Returns -1 where a work buffer could not be allocated.
static int run_panels(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y, int M, int N,
                      int K, int bits, int fp8, int group, int tb, int dtype) {
#if SHARDLM_AMX
    if (amx_min_rows && M >= amx_min_rows && dtype == 1 && bits == 0 && K % 32 == 0) {
        __atomic_fetch_add(&amx_calls, 1, __ATOMIC_RELAXED);
        return amx_panels((const uint16_t *)x, x_stride, (const uint16_t *)packed, bias, y, M, N, K), 0;
    }
    const int integer_rows = bits == 8 ? amx_min_rows_8bit : bits == 4 ? amx_min_rows_4bit : 0;
    if (integer_rows && M >= integer_rows && dtype == 1 && group % 32 == 0) {
        __atomic_fetch_add(&amx_calls, 1, __ATOMIC_RELAXED);
        return amx_integer_panels((const uint16_t *)x, x_stride, (const uint8_t *)packed, bias, y, M, N, K, bits, fp8,
                                  group, tb);
    }
#endif
    const int panels = (N + NR - 1) / NR, Kp = dtype == 0 || bits ? K : K + K % 2;
    const int64_t panel_bytes = bits == 4 ? blocked_int4_size(NR, K, group, tb)
                              : bits == 8 ? blocked_int8_size(NR, K, group, tb)
                                                                            : (int64_t)Kp * NR * (dtype == 0 ? 4 : 2);
    const int dot = dtype == 1 && shardlm_bf16_dot;
    const int kind = bits == 4 ? TILE_INT4_Q16
                   : bits == 8 ? (fp8 ? (dot ? TILE_FP8_DOT : TILE_FP8) : (dot ? TILE_INT8_DOT : TILE_INT8))
                   : dot ? TILE_DOT : dtype == 0 ? TILE_F32 : TILE_BF16;
    // x as the tiles take it: bfloat16 for the dot product (an odd K's rows copied with a zero
    // after them, to make whole pairs), else float32 (bfloat16 widened once)
    const void *xt = x;
    int64_t xs = x_stride;
    const size_t x_size = dot ? sizeof(uint16_t) : sizeof(float);
    void *copy = NULL;
    if (dtype == 1 && bits != 4 && (!dot || Kp > K)) {
        copy = malloc(x_size * (size_t)M * (size_t)Kp);
        if (!copy) return -1;
        for (int m = 0; m < M; m++) {
            const uint16_t *row = (const uint16_t *)x + m * x_stride;
            if (dot) {
                memcpy((uint16_t *)copy + (int64_t)m * Kp, row, sizeof(uint16_t) * K);
                ((uint16_t *)copy)[(int64_t)m * Kp + K] = 0;
            } else {
                for (int k = 0; k < K; k++) ((float *)copy)[(int64_t)m * Kp + k] = bf16_to_f32(row[k]);
                if (Kp > K) ((float *)copy)[(int64_t)m * Kp + K] = 0.f;
            }
        }
        xt = copy, xs = Kp;
    }
    // the integer 4-bit tile's quantized x (per row: a row's values do not depend on the batch)
    const int groups = bits ? K / group : 0;
    qx_t xq = {NULL, NULL, NULL, K, groups};
    void *qx_buffer = NULL;
    if (kind == TILE_INT4_Q16) {
        qx_buffer = malloc((size_t)M * (sizeof(int16_t) * (size_t)K + 2 * sizeof(float) * (size_t)groups));
        if (!qx_buffer) { free(copy); return -1; }
        xq.scale = (const float *)qx_buffer;
        xq.sum = xq.scale + (int64_t)M * groups;
        xq.q = (const int16_t *)(xq.sum + (int64_t)M * groups);
        quantize_x(x, x_stride, M, K, group, dtype, &xq);
    }
    // quantized panels against more than one tile of rows: each panel widened once (the same values
    // as the quantized tile's, so the same sums), instead of widened again for every tile: float32
    // weights for the float tile, or the dot tile's integer pairs
    const int rows_q = bits == 4 ? MR4_Q : dot ? MR4_DOT : fp8 ? MR4_FP8 : MR4;
    const int widen_once = bits == 8 && M > rows_q;
#if SIMD16_BITS == 256
    const int thirds = !bits && M > 1;           // AVX2's float tiles of many rows (third_tile)
    const int step = thirds ? (dtype == 0 ? MR_F32 : MR_BF16) : bits && (dot || !widen_once) ? rows_q : MR;
#else
    const int thirds = 0, step = bits && (dot || !widen_once) ? rows_q : MR;
#endif
    const int wide_kind = dot ? kind : fp8 ? TILE_FP8_WIDE : TILE_F32;
    // float panels against many rows: the rows in blocks whose x stays in L2 (X_BLOCK_BYTES), every
    // panel run over one block before the next (else each panel streams all of x from memory again;
    // quantized tiles keep one block: their widened panel or quantized x is made once). The order
    // of a row's sums is unchanged.
    int block = M;
    if (!bits) {
        block = (int)(X_BLOCK_BYTES / ((int64_t)Kp * (int64_t)x_size)) / step * step;
        block = block < step ? step : block > M ? M : block;
    }
    // with 3 row tiles or more in a block, the tiles after the first share asking for the next
    // panel: a slice each, ahead_lines every AHEAD_SEGMENT k (with 2, one tile's asks come in bursts
    // that cost more than they save; ahead_lines 0: none)
    const int tiles = (block + step - 1) / step, segments = (Kp + AHEAD_SEGMENT - 1) / AHEAD_SEGMENT;
    const int64_t ahead_slice = tiles >= 3 ? (panel_bytes / (tiles - 1) + 63) / 64 * 64 : 0;
    const int ahead_lines = (int)((ahead_slice / 64 + segments - 1) / segments);
    int failed = 0;
    #pragma omp parallel if (panels > 1 && (int64_t)N * K >= 65536)
    {
    void *wide_panel = widen_once ? malloc((dot ? sizeof(uint16_t) : sizeof(float)) * (size_t)K * NR) : NULL;
    if (widen_once && !wide_panel) {
        #pragma omp atomic write
        failed = 1;
    }
    // each thread its own run of panels over every block in turn (no barrier between blocks)
    const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const int first = (int)((int64_t)panels * thread / threads), last = (int)((int64_t)panels * (thread + 1) / threads);
    for (int b0 = 0; b0 < M; b0 += block) {
    const int b1 = M - b0 < block ? M : b0 + block;
    for (int p = first; p < last; p++) {
        if (widen_once && !wide_panel) continue;
        const char *panel = (const char *)packed + p * panel_bytes;
        const int n0 = p * NR, width = N - n0 < NR ? N - n0 : NR;
        if (widen_once) widen_int8_panel((const uint8_t *)panel, K, group, tb, dot, fp8, wide_panel);
        const int pairs_only = widen_once && (dot || fp8);    // these tiles read the tables from the panel
        // the panel this thread runs next: the next one, or its first again for the next block
        const int next_p = p + 1 < last ? p + 1 : b1 < M ? first : -1;
        for (int m0 = b0; m0 < b1; m0 += step) {
            const int rows = b1 - m0 < step ? b1 - m0 : step, tile = (m0 - b0) / step;
            ahead_t ahead = {NULL, NULL, 0};
            int tile_kind = widen_once ? wide_kind : kind;
            if (ahead_lines && !widen_once && (tile_kind == TILE_DOT || tile_kind == TILE_F32) && tile >= 1 &&
                next_p >= 0 && next_p != p) {
                const char *next = (const char *)packed + next_p * panel_bytes;
                ahead.at = next + (tile - 1) * ahead_slice;
                ahead.end = ahead.at + ahead_slice < next + panel_bytes ? ahead.at + ahead_slice : next + panel_bytes;
                ahead.lines = ahead_lines;
                tile_kind = tile_kind == TILE_DOT ? TILE_DOT_AHEAD : TILE_F32_AHEAD;
            }
#if SIMD16_BITS == 256
            if (thirds) {
                third_tiles((const float *)xt + m0 * xs, xs, panel, Kp, rows, dtype,
                           m0 == b0, tile_kind == TILE_F32_AHEAD ? &ahead : NULL, y, m0, N, n0, width, bias, dtype);
                continue;
            }
#endif
            vf16 acc[MR][NV];
            panel_product(tile_kind, (const char *)xt + m0 * xs * (int64_t)x_size, xs,
                          widen_once && !pairs_only ? wide_panel : panel, pairs_only ? wide_panel : NULL,
                          &xq, m0, Kp, group, tb, rows, acc, m0 == b0 && !widen_once,
                          &ahead);
            for (int m = 0; m < rows; m++)
                for (int v = 0; v < NV && 16 * v < width; v++)
                    store_outputs(y, (int64_t)(m0 + m) * N + n0 + 16 * v, acc[m][v], bias, n0 + 16 * v,
                                  width - 16 * v < 16 ? width - 16 * v : 16, dtype);
        }
    }
    }
    free(wide_panel);
    }
    free(copy);
    free(qx_buffer);
    return failed ? -1 : 0;
}
#endif

// bfloat16 products on the AMX tiles from min_rows rows on over float panels whose K is a
// multiple of 32, from min_rows_8bit over 8-bit panels and from min_rows_4bit over 4-bit ones
// whose groups are (0: never). A row's result then depends on whether its product had that
// many rows, unless that is 1.
// Returns 1 if set, 0 in a build without AMX, -1 where the OS refuses this process the tiles'
// state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once).
KERNEL_API int blocked_set_amx(int min_rows, int min_rows_8bit, int min_rows_4bit) {
#if SHARDLM_AMX
    if (!amx_permitted()) return -1;
    amx_min_rows = min_rows > 0 ? min_rows : 0;
    amx_min_rows_8bit = min_rows_8bit > 0 ? min_rows_8bit : 0;
    amx_min_rows_4bit = min_rows_4bit > 0 ? min_rows_4bit : 0;
    return 1;
#else
    (void)min_rows, (void)min_rows_8bit, (void)min_rows_4bit;
    return 0;
#endif
}

// 1 where products can run on the AMX tiles, 0 in a build without them, -1 where the OS refuses
// this process the tiles' state; changes nothing
KERNEL_API int blocked_amx_usable(void) {
#if SHARDLM_AMX
    return amx_permitted() ? 1 : -1;
#else
    return 0;
#endif
}

// How many products have run on the AMX tiles in this process (0 in a build without them)
KERNEL_API int64_t blocked_amx_calls(void) {
#if SHARDLM_AMX
    return __atomic_load_n(&amx_calls, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

// bfloat16 products with the CPU's dot product (on = 1) or widened to float32 FMAs (0). Returns
// 1 if set, 0 in a build without AVX512_BF16 (widened, whatever on says).
KERNEL_API int blocked_set_bf16_dot(int on) {
#if defined(__AVX512BF16__)
    shardlm_bf16_dot = on != 0;
    return 1;
#else
    (void)on;
    return 0;
#endif
}

// y = x . w^T (+ bias) with w packed by blocked_pack. Returns 0; -1 where the work buffer could
// not be allocated; -2 in a build without AVX-512 or AVX2.
KERNEL_API int blocked_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y, int M,
                              int N, int K, int dtype) {
#if defined(HAVE_SIMD16)
    return run_panels(x, x_stride, packed, bias, y, M, N, K, 0, 0, 0, 0, dtype);
#else
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)dtype;
    return -2;
#endif
}

// A product per head: y[h] [M, N] = x's head h (its rows at x + h * x_head_stride, row stride
// x_stride) . w[h]^T, each w[h] packed by blocked_pack, w_head_stride elements apart (latent
// attention's absorbed up-projections). Returns as blocked_matmul does.
KERNEL_API int blocked_matmul_heads(const void *x, int64_t x_stride, int64_t x_head_stride, const void *packed,
                                    int64_t w_head_stride, void *y, int heads, int M, int N, int K, int dtype) {
    const int esize = dtype == 0 ? 4 : 2;
    for (int h = 0; h < heads; h++) {
        const int rc = blocked_matmul((const char *)x + h * x_head_stride * esize, x_stride,
                                      (const char *)packed + h * w_head_stride * esize, NULL,
                                      (char *)y + (int64_t)h * M * N * esize, M, N, K, dtype);
        if (rc) return rc;
    }
    return 0;
}

// The same with a 4-bit weight packed by blocked_int4_pack (group: input columns per scale, tb:
// bytes per scale and min).
KERNEL_API int blocked_int4_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y,
                                   int M, int N, int K, int group, int tb, int dtype) {
#if defined(HAVE_SIMD16)
    return run_panels(x, x_stride, packed, bias, y, M, N, K, 4, 0, group, tb, dtype);
#else
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)group, (void)tb;
    (void)dtype;
    return -2;
#endif
}

// The same with an 8-bit weight packed by blocked_int8_pack.
KERNEL_API int blocked_int8_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y,
                                   int M, int N, int K, int group, int tb, int dtype) {
#if defined(HAVE_SIMD16)
    return run_panels(x, x_stride, packed, bias, y, M, N, K, 8, 0, group, tb, dtype);
#else
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)group, (void)tb;
    (void)dtype;
    return -2;
#endif
}

#if !defined(HAVE_SIMD16)
// FP8 panels in plain C, for builds without AVX2 or AVX-512: per panel, x row and group, NR
// float32 partial sums over k in order, then the group's scales (as fp8_tile; the compiler
// vectorizes the loops over the panel's features)
static int plain_fp8_panels(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y, int M,
                            int N, int K, int group, int dtype) {
    const int panels = (N + NR - 1) / NR;
    const int64_t panel_bytes = blocked_int8_size(NR, K, group, 4);
    #pragma omp parallel for schedule(static) if (panels > 1 && (int64_t)N * K >= 65536)
    for (int p = 0; p < panels; p++) {
        const uint8_t *panel = (const uint8_t *)packed + p * panel_bytes;
        const int n0 = p * NR, width = N - n0 < NR ? N - n0 : NR;
        for (int m = 0; m < M; m++) {
            float acc[NR] = {0};
            for (int g = 0; g < K / group; g++) {
                float part[NR] = {0};
                const int8_t *first = int8_column(panel, group, 4, g * group);
                for (int k = g * group; k < (g + 1) * group; k++) {
                    const int8_t *column = first + (int64_t)(k - g * group) * NR;
                    const float xk = load(x, m * x_stride + k, dtype);
                    for (int j = 0; j < NR; j++) part[j] += xk * fp8_scaled((uint8_t)column[j]);
                }
                const float *scales = (const float *)int8_tables(panel, group, 4, g);
                for (int j = 0; j < NR; j++) acc[j] += scales[j] * part[j];
            }
            for (int j = 0; j < width; j++)
                store(y, (int64_t)m * N + n0 + j, bias ? acc[j] + load(bias, n0 + j, dtype) : acc[j], dtype);
        }
    }
    return 0;
}
#endif

// The same with an FP8 weight packed by blocked_fp8_pack (tb 4), in every build: plain C loops
// without AVX2 or AVX-512.
KERNEL_API int blocked_fp8_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y,
                                  int M, int N, int K, int group, int dtype) {
#if defined(HAVE_SIMD16)
    return run_panels(x, x_stride, packed, bias, y, M, N, K, 8, 1, group, 4, dtype);
#else
    return plain_fp8_panels(x, x_stride, packed, bias, y, M, N, K, group, dtype);
#endif
}
