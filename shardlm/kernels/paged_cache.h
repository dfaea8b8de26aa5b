// Reading a paged KV cache's rows, whatever it holds: the model's dtype (float32 or bfloat16)
// or FP8 bytes with a scale (kv_format). Shared by the decode (paged_attention.c) and prompt
// (prefill_attention.c) attention kernels.
#pragma once
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

// What a cache holds ("cdt"): 0 float32, 1 bfloat16 (as dtype), 2 FP8 e4m3fn, 3 FP8 e5m2
enum { CACHE_E4M3 = 2, CACHE_E5M2 = 3 };
static inline int cache_type(int kv_format, int dtype) { return kv_format == KV_AS_DTYPE ? dtype : 1 + kv_format; }
static inline int cache_esize(int cdt) { return cdt == 0 ? 4 : cdt == 1 ? 2 : 1; }

// What a cache's widened values are multiplied by: 1, or its scale (an e4m3 byte widens to its
// value times 2^-8: vf_fp8, fp8_scaled)
static inline float cache_multiplier(int cdt, float scale) {
    return cdt == CACHE_E4M3 ? scale * 256.f : cdt == CACHE_E5M2 ? scale : 1.f;
}

#if defined(HAVE_SIMD16)
// 16 cache values from element i, widened to float32
static inline __attribute__((always_inline)) vf16 cache16(const void *cache, int64_t i, int cdt) {
    if (cdt == CACHE_E4M3) return vf_fp8((const uint8_t *)cache + i);
    if (cdt == CACHE_E5M2) return vf_e5m2((const uint8_t *)cache + i);
    return vf_load_as(cache, i, cdt);
}
#endif

// row of D values -> float32 (dtype: a cache type, cdt)
static inline void load_row(const void *base, int64_t index, int D, int dtype, float *dst) {
    if (dtype >= CACHE_E4M3) {
        const uint8_t *src = (const uint8_t *)base + index * D;
        for (int d = 0; d < D; d++) dst[d] = dtype == CACHE_E4M3 ? fp8_scaled(src[d]) : e5m2_value(src[d]);
    } else if (dtype == 0) {
        memcpy(dst, (const float *)base + index * D, sizeof(float) * D);
    } else {
        const uint16_t *src = (const uint16_t *)base + index * D;
        uint32_t *d32 = (uint32_t *)dst;
        #pragma omp simd
        for (int d = 0; d < D; d++) d32[d] = (uint32_t)src[d] << 16;
    }
}

// cache row `index` as float32: in place for a float32 cache, else widened into buf
static inline const float *row_f32(const void *base, int64_t index, int D, int dtype, float *buf) {
    if (dtype == 0) return (const float *)base + index * D;
    load_row(base, index, D, dtype, buf);
    return buf;
}
