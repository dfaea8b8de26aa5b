// Helpers shared by shardlm's CPU kernels: bfloat16 conversions, dtype-generic loads and stores
// (dtype 0 = float32, 1 = bfloat16), and the rotary embedding of one row of heads.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
// SHARDLM_AMX: this build has the AMX code paths: the CPU's tiles, or the test-only plain-C model
// of them (amx_emulated.h)
#if defined(__AMX_BF16__) && !defined(SHARDLM_EMULATE_AMX)
#define SHARDLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(SHARDLM_EMULATE_AMX) && defined(__AVX512BF16__)
#define SHARDLM_AMX 1
#else
#define SHARDLM_AMX 0
#endif
#if SHARDLM_AMX
// AMX's tile configuration (palette 1): rows and bytes per row of each of the 8 tiles
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;
#endif

#include "shardlm_kernels.h"
#include "simd16.h"

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                           // round to nearest even
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    const int exponent = h >> 10 & 31, mantissa = h & 1023;
    const float magnitude = exponent == 0 ? ldexpf((float)mantissa, -24)
                          : exponent == 31 ? (mantissa ? NAN : INFINITY) : ldexpf((float)(mantissa | 1024), exponent - 25);
    return h & 0x8000 ? -magnitude : magnitude;
}

// A float16 FP8 e5m2 byte's value (e5m2 is float16's high byte)
static inline float e5m2_value(uint8_t b) { return f16_to_f32((uint16_t)((uint16_t)b << 8)); }

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// float32 -> FP8 as torch converts: to nearest even; e4m3fn saturates (464 and above, infinity
// included, become 448; NaN stays NaN); e5m2 goes to infinity past its largest value. Subnormals
// by a float addition that lets the FPU round (its bits are used, so fast-math keeps it).
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t bits = f32_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t out;
    if (bits > 0x7f800000u) {
        out = 0x7f;
    } else if (bits >= 0x43e80000u) {        // 464
        out = 0x7e;
    } else if (bits < 121u << 23) {
        out = (uint8_t)(f32_bits(bits_f32(bits) + bits_f32(141u << 23)) - (141u << 23));
    } else {
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + (bits >> 20 & 1);
        out = (uint8_t)(bits >> 20);
    }
    return out | (uint8_t)(sign >> 24);
}

static inline uint8_t f32_to_e5m2(float f) {
    uint32_t bits = f32_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t out;
    if (bits >= 143u << 23) {
        out = bits > 255u << 23 ? 0x7f : 0x7c;
    } else if (bits < 113u << 23) {
        out = (uint8_t)(f32_bits(bits_f32(bits) + bits_f32(134u << 23)) - (134u << 23));
    } else {
        bits += ((uint32_t)(15 - 127) << 23) + 0xFFFFFu + (bits >> 21 & 1);
        out = (uint8_t)(bits >> 21);
    }
    return out | (uint8_t)(sign >> 24);
}

// An FP8 (e4m3fn) byte's value times 2^-8, as vf_fp8 widens it (its NaN codes are not weights)
static inline float fp8_scaled(uint8_t b) {
    const uint32_t exponent = b >> 3 & 15, mantissa = b & 7;
    if (!exponent) return (b & 0x80 ? -1.f : 1.f) * (float)mantissa * 0x1p-17f;     // subnormal
    const uint32_t u = (uint32_t)(b & 0x80) << 24 | (exponent + 112) << 23 | mantissa << 20;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float load(const void *p, int64_t i, int dtype) {
    return dtype == 0 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline float round_to(float v, int dtype) { return dtype == 0 ? v : bf16_to_f32(f32_to_bf16(v)); }

static inline void store(void *p, int64_t i, float v, int dtype) {
    if (dtype == 0) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = f32_to_bf16(v);
}

#if defined(__AVX512F__)
// 16 values (those in mask m) from element i of a float32 or bfloat16 array, as float32
static inline __m512 load16(const void *p, int64_t i, __mmask16 m, int dtype) {
    if (dtype == 0) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i)), 16));
}

// v rounded to dtype (bfloat16: to nearest even, NaN kept NaN, as f32_to_bf16), as float32 bits
// in the high half of each lane
static inline __m512i round16_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                   _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

// round_to() for 16 values
static inline __m512 round16(__m512 v, int dtype) {
    return dtype == 0 ? v : _mm512_castsi512_ps(round16_bits(v));
}

// lane i = the sum of v[i]'s 16 lanes, for 16 vectors at once (a transposing tree of adds)
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 s[8], t[4], u[2];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    const __m512 w = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u[0]), _mm512_castps_pd(u[1]))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u[0]), _mm512_castps_pd(u[1]))));
    // lane 4j + k holds v[4k + j]
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), w);
}

// store() for the 16 values in mask m, at element i
static inline void store16(void *p, int64_t i, __m512 v, __mmask16 m, int dtype) {
    if (dtype == 0) _mm512_mask_storeu_ps((float *)p + i, m, v);
    else _mm256_mask_storeu_epi16((uint16_t *)p + i, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round16_bits(v), 16)));
}
#endif

// Rotary embedding (neox style) in place on `heads` contiguous heads of D values starting at
// x: x = dtype(x * cos) + rotate_half(x) * signed_sin, where cos and signed_sin are this
// token's rows of D. Rounds where torch's operators round.
static inline void rotary_heads(void *x, const void *cos, const void *signed_sin, int heads, int D, int dtype) {
    const int half = D / 2;
#if defined(__AVX512F__)
    if (half % 16 == 0) {   // 16 lanes at a time, the same arithmetic
        for (int h = 0; h < heads; h++) {
            const int64_t base = (int64_t)h * D;
            for (int c = 0; c < half; c += 16) {
                const __m512 lo = load16(x, base + c, 0xffff, dtype), hi = load16(x, base + half + c, 0xffff, dtype);
                const __m512 out_lo = _mm512_fmadd_ps(hi, load16(signed_sin, c, 0xffff, dtype),
                                                      round16(_mm512_mul_ps(lo, load16(cos, c, 0xffff, dtype)), dtype));
                const __m512 out_hi = _mm512_fmadd_ps(lo, load16(signed_sin, half + c, 0xffff, dtype),
                                                      round16(_mm512_mul_ps(hi, load16(cos, half + c, 0xffff, dtype)), dtype));
                store16(x, base + c, out_lo, 0xffff, dtype);
                store16(x, base + half + c, out_hi, 0xffff, dtype);
            }
        }
        return;
    }
#endif
    for (int h = 0; h < heads; h++) {
        const int64_t base = (int64_t)h * D;
        float v[D];
        for (int d = 0; d < D; d++) v[d] = load(x, base + d, dtype);
        for (int d = 0; d < D; d++) {
            float rotated = v[d < half ? d + half : d - half];
            float c = load(cos, d, dtype), s = load(signed_sin, d, dtype);
            store(x, base + d, round_to(v[d] * c, dtype) + rotated * s, dtype);
        }
    }
}

// 1: bfloat16 products with the CPU's bfloat16 dot product (blocked_matmul.c: blocked_set_bf16_dot)
extern int shardlm_bf16_dot;

#if SHARDLM_AMX && defined(SHARDLM_EMULATE_AMX)
#include "amx_emulated.h"
static inline int amx_permitted(void) { return 1; }
#elif SHARDLM_AMX
// Whether the OS lets this process use the AMX tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA; asked once per kernel file, and granted for the whole process)
static inline int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
}

#endif
