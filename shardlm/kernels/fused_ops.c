// Elementwise steps of a decoder layer fused into one pass each, on CPU: residual add + RMSNorm,
// SiLU-and-mul. In eager torch each is 3-9 operator calls; at decode (a few rows) their
// dispatch, not their arithmetic, is the cost.
//
// They round where torch's sequence of operators rounds (dtype 1 = bfloat16: every operator's
// result is a bfloat16), so a float32 model matches the operators up to the order of a sum.
#include <math.h>
#include <stdint.h>

#include "cpu_common.h"

// summed = x + residual (if residual), out = weight * dtype(summed / rms(summed)); rows of H.
// x_stride / out_stride: elements between rows (x may be a view). Rows in parallel where there
// are many (a prompt chunk).
KERNEL_API void add_rmsnorm(const void *x, int64_t x_stride, const void *residual, void *summed, void *out,
                 const void *weight, int T, int H, float eps, int dtype) {
    #pragma omp parallel for schedule(static) if ((int64_t)T * H >= 32768)
    for (int t = 0; t < T; t++) {
        float row[H];
        float squares = 0.f;
        for (int h = 0; h < H; h++) {
            float v = load(x, (int64_t)t * x_stride + h, dtype);
            if (residual) v = round_to(v + load(residual, (int64_t)t * H + h, dtype), dtype);
            row[h] = v;
            squares += v * v;
        }
        if (residual)
            for (int h = 0; h < H; h++) store(summed, (int64_t)t * H + h, row[h], dtype);
        const float inv = 1.f / sqrtf(squares / H + eps);
        for (int h = 0; h < H; h++)
            store(out, (int64_t)t * H + h, load(weight, h, dtype) * round_to(row[h] * inv, dtype), dtype);
    }
}

// out[t, i] = dtype(silu(gate)) * up, where x[t] = [gate (I) | up (I)]; rows in parallel where
// there are enough of them to pay for the threads' wake-up
KERNEL_API void silu_and_mul(const void *x, void *out, int T, int I, int dtype) {
    #pragma omp parallel for schedule(static) if ((int64_t)T * I >= 32768)
    for (int t = 0; t < T; t++) {
        const int64_t row = (int64_t)t * 2 * I;
#if defined(__AVX512F__)
        for (int i = 0; i < I; i += 16) {
            const __mmask16 m = I - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (I - i)) - 1);
            const __m512 g = load16(x, row + i, m, dtype), u = load16(x, row + I + i, m, dtype);
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), vf_exp(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            store16(out, (int64_t)t * I + i, _mm512_mul_ps(round16(silu, dtype), u), m, dtype);
        }
#else
        int i = 0;
#if defined(HAVE_SIMD16)
        for (; i + 16 <= I; i += 16) {     // AVX2: the exponentials 16 at a time, the rest per value
            const vf16 g = vf_load_as(x, row + i, dtype);
            float silu[16];
            vf_store(silu, vf_div(g, vf_add(vf_set1(1.f), vf_exp(vf_sub(vf_zero(), g)))));
            for (int j = 0; j < 16; j++)
                store(out, (int64_t)t * I + i + j, round_to(silu[j], dtype) * load(x, row + I + i + j, dtype), dtype);
        }
#endif
        for (; i < I; i++) {
            float g = load(x, row + i, dtype), u = load(x, row + I + i, dtype);
            store(out, (int64_t)t * I + i, round_to(g / (1.f + expf(-g)), dtype) * u, dtype);
        }
#endif
    }
}

// Rotary embedding in place on T rows of `heads` heads (row stride x_stride; heads contiguous
// within a row); cos and signed_sin are [T, D].
KERNEL_API void rotary(void *x, int64_t x_stride, const void *cos, const void *signed_sin, int T, int heads, int D,
            int dtype) {
    const int esize = dtype == 0 ? 4 : 2;
    #pragma omp parallel for schedule(static) if (T >= 8)
    for (int t = 0; t < T; t++)
        rotary_heads((char *)x + t * x_stride * esize, (const char *)cos + (int64_t)t * D * esize,
                     (const char *)signed_sin + (int64_t)t * D * esize, heads, D, dtype);
}

// Dequantize 4-bit weights stored in torch's CPU int4 layout (`_convert_weight_to_int4pack_for_cpu`,
// see layers/quantization.py: unpack_int4) into out [N, K] (dtype): w = q * scale + min per group.
// For the products past the packed kernel's rows; parallel over blocks of `block` rows. A
// column's block / 2 bytes hold the block's first half of rows in low nibbles and the second
// half in high ones, or (pairs = 1) rows 2j, 2j + 1 in byte j; the last N % block rows are pairs.
// No fused multiply-add: q * scale and + min round separately, as torch's operators do.
__attribute__((optimize("fp-contract=off")))
KERNEL_API void dequantize_int4pack(const uint8_t *packed, int N, int K, int block, int pairs, const float *scales,
                                    const float *mins, int group, void *out, int dtype) {
    const int full = N / block, groups = K / group, half = block / 2;
    #pragma omp parallel for schedule(static)
    for (int blk = 0; blk <= full; blk++) {
        const int rows = blk < full ? block : N - full * block;
        if (rows == 0) continue;
        const uint8_t *src = packed + (int64_t)blk * block * K / 2;
        for (int r = 0; r < rows; r++) {
            const int n = blk * block + r;
            const float *s = scales + (int64_t)n * groups, *m = mins + (int64_t)n * groups;
            for (int k = 0; k < K; k++) {
                int q;
                if (blk < full && !pairs) {
                    uint8_t byte = src[(int64_t)k * half + r % half];
                    q = r < half ? byte & 15 : byte >> 4;
                } else {
                    uint8_t byte = src[(int64_t)k * (rows / 2) + r / 2];
                    q = r % 2 ? byte >> 4 : byte & 15;
                }
                const int g = k / group;
                store(out, (int64_t)n * K + k, (float)q * s[g] + m[g], dtype);
            }
        }
    }
}

// out[t] = the index of row t's largest value (rows of V, row stride x_stride), as torch.argmax
// has it: the first of equal maxima, and the first NaN where a row has one. The greedy sampler's
// step; rows in parallel (one thread of torch's took 1.5-2 ms for 64 rows of a 49k vocabulary).
// Structured outputs: x[rows[r], v] = -inf for each token first_token + v that bitmask row r
// (words int32 words, bit t of the row: token t allowed) does not allow; x is float32, in place.
// A whole word of allowed tokens is skipped; most words of a constrained row allow none.
KERNEL_API void mask_disallowed(float *x, int64_t x_stride, const int64_t *rows, int R, int V,
                                const int32_t *bitmask, int words, int first_token) {
    #pragma omp parallel for schedule(static) if ((int64_t)R * V >= 262144)
    for (int r = 0; r < R; r++) {
        float *row = x + rows[r] * x_stride;
        const uint32_t *bits = (const uint32_t *)bitmask + (int64_t)r * words;
        for (int v = 0; v < V; v++) {
            const int t = first_token + v;
            const uint32_t word = t / 32 < words ? bits[t / 32] : 0;
            if (word == 0xffffffffu) {              // all 32 allowed: on to the next word
                v += 31 - t % 32;
                continue;
            }
            if (!((word >> (t % 32)) & 1u)) row[v] = -INFINITY;
        }
    }
}

KERNEL_API void argmax_rows(const void *x, int64_t x_stride, int T, int V, int dtype, int64_t *out) {
    #pragma omp parallel for schedule(static) if ((int64_t)T * V >= 262144)
    for (int t = 0; t < T; t++) {
        const int64_t row = (int64_t)t * x_stride;
        int64_t best = 0;
        float top = load(x, row, dtype);
        int v0 = 0;
#if defined(__AVX512F__)
        // per lane: the largest value and its first index; a NaN anywhere: the scalar search below
        __m512 lane_top = _mm512_set1_ps(-INFINITY);
        __m512i lane_index = _mm512_setzero_si512(), index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        __mmask16 nan = 0;
        for (; v0 + 16 <= V; v0 += 16, index = _mm512_add_epi32(index, _mm512_set1_epi32(16))) {
            const __m512 v = load16(x, row + v0, 0xffff, dtype);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 up = _mm512_cmp_ps_mask(v, lane_top, _CMP_GT_OQ);
            lane_top = _mm512_mask_mov_ps(lane_top, up, v);
            lane_index = _mm512_mask_mov_epi32(lane_index, up, index);
        }
        if (nan) {
            v0 = 0;
        } else if (v0 > 0) {
            const float m = _mm512_reduce_max_ps(lane_top);
            const __mmask16 at = _mm512_cmp_ps_mask(lane_top, _mm512_set1_ps(m), _CMP_EQ_OQ);
            best = _mm512_mask_reduce_min_epi32(at, lane_index);
            top = m;
        }
#endif
        for (int v = v0; v < V && !isnan(top); v++) {
            const float val = load(x, row + v, dtype);
            if (val > top || isnan(val)) top = val, best = v;
        }
        out[t] = best;
    }
}
