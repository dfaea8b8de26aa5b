// Helpers shared by shardlm's CPU kernels: bfloat16 conversions, dtype-generic loads and stores
// (dtype 0 = float32, 1 = bfloat16), and the rotary embedding of one row of heads.
#pragma once
#include <stdint.h>
#include <string.h>

// An entry point called from Python. Never inlined or specialized (noipa), also where one kernel
// file includes another (llama_decode.c): compiled into another context, fast-math could order
// its sums differently, and the fused path would no longer equal the layer-by-layer one bit for bit.
#define KERNEL_API __attribute__((noipa))

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

static inline float load(const void *p, int64_t i, int dtype) {
    return dtype == 0 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline float round_to(float v, int dtype) { return dtype == 0 ? v : bf16_to_f32(f32_to_bf16(v)); }

static inline void store(void *p, int64_t i, float v, int dtype) {
    if (dtype == 0) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = f32_to_bf16(v);
}

// Rotary embedding (neox style) in place on `heads` contiguous heads of D values starting at
// x: x = dtype(x * cos) + rotate_half(x) * signed_sin, where cos and signed_sin are this
// token's rows of D. Rounds where torch's operators round.
static inline void rotary_heads(void *x, const void *cos, const void *signed_sin, int heads, int D, int dtype) {
    const int half = D / 2;
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
