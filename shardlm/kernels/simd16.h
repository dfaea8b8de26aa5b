// 16 float32 (vf16) or int32 (vi16) lanes: one AVX-512 register, or a pair of AVX2 ones. The
// kernels written with these build for both; HAVE_SIMD16 says whether this build has either.
// Loads and stores are unaligned; shift counts are compile-time constants in the callers.
#pragma once
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define HAVE_SIMD16 1
#endif

#if defined(__AVX512F__)
#define SIMD16_BITS 512
typedef __m512 vf16;
typedef __m512i vi16;
#define INL static inline __attribute__((always_inline))
INL vf16 vf_zero(void) { return _mm512_setzero_ps(); }
INL vf16 vf_set1(float x) { return _mm512_set1_ps(x); }
INL vf16 vf_load(const float *p) { return _mm512_loadu_ps(p); }
// A load kept in its register: GCC would otherwise fold it into each FMA that reads it, loading
// it again for every row (a 512-bit load a multiply-add: what AMD Zen 4's one 512-bit load a
// cycle cannot feed)
INL vf16 vf_load_kept(const float *p) { vf16 v = _mm512_loadu_ps(p); __asm__("" : "+v"(v)); return v; }
INL void vf_store(float *p, vf16 v) { _mm512_storeu_ps(p, v); }
INL vf16 vf_add(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
INL vf16 vf_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
INL vf16 vf_sub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
INL vf16 vf_div(vf16 a, vf16 b) { return _mm512_div_ps(a, b); }
INL vf16 vf_fmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }
INL vi16 vi_load(const void *p) { return _mm512_loadu_si512(p); }
INL vi16 vi_set1(int x) { return _mm512_set1_epi32(x); }
INL vi16 vi_and(vi16 a, vi16 b) { return _mm512_and_si512(a, b); }
INL vi16 vi_srli(vi16 a, int n) { return _mm512_srli_epi32(a, n); }
INL vi16 vi_slli(vi16 a, int n) { return _mm512_slli_epi32(a, n); }
INL vf16 vi_to_f(vi16 a) { return _mm512_cvtepi32_ps(a); }
INL vf16 vi_bits_f(vi16 a) { return _mm512_castsi512_ps(a); }
// 16 float16 values as float32
INL vf16 vf_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
// 16 int8 values as float32
INL vf16 vf_int8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
// 16 FP8 (e4m3fn) values as float32, times 2^-8: each byte, sign-extended to 16 bits and shifted,
// is a float16 with the same sign, exponent bits and mantissa bits (float16's exponent bias is 8
// more than e4m3's, hence 2^-8; subnormals included), which the CPU widens exactly
INL vf16 vf_fp8(const uint8_t *p) {
    const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBF80)));
}
// 16 FP8 e5m2 values as float32 (exact: e5m2 is float16's high byte)
INL vf16 vf_e5m2(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
}
INL vi16 vi_zero(void) { return _mm512_setzero_si512(); }
// 16 bfloat16 values as float32
INL vf16 vf_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
INL vf16 vf_max(vf16 a, vf16 b) { return _mm512_max_ps(a, b); }
INL vf16 vf_abs(vf16 a) { return _mm512_abs_ps(a); }
INL float vf_reduce_max(vf16 a) { return _mm512_reduce_max_ps(a); }
INL float vf_reduce_add(vf16 a) { return _mm512_reduce_add_ps(a); }
// 16 floats rounded to the nearest integer (ties to even, as lrintf), stored as int16 (|a| < 2^15)
INL void vf_store_int16(int16_t *p, vf16 a) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(a)));
}
// acc + per 32-bit lane a[0] * b[0] + a[1] * b[1] of its two int16 halves (VNNI's vpdpwssd, else
// vpmaddwd and an add)
INL vi16 vi_dot_s16(vi16 acc, vi16 a, vi16 b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
// vf_exp's pieces: c - a * b; to the nearest integer; p * 2^n (n integral); lanes where x > limit
// set to infinity
INL vf16 vf_min(vf16 a, vf16 b) { return _mm512_min_ps(a, b); }
INL vf16 vf_fnmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fnmadd_ps(a, b, c); }
INL vf16 vf_round(vf16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
INL vf16 vf_scale2(vf16 p, vf16 n) { return _mm512_scalef_ps(p, n); }
INL vf16 vf_inf_above(vf16 v, vf16 x, float limit) {
    return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
}
#undef INL
#elif defined(HAVE_SIMD16)
#define SIMD16_BITS 256
typedef struct { __m256 lo, hi; } vf16;
typedef struct { __m256i lo, hi; } vi16;
#define INL static inline __attribute__((always_inline))
INL vf16 vf_zero(void) { return (vf16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
INL vf16 vf_set1(float x) { const __m256 b = _mm256_set1_ps(x); return (vf16){b, b}; }
INL vf16 vf_load(const float *p) { return (vf16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
INL vf16 vf_load_kept(const float *p) {
    vf16 v = vf_load(p);
    __asm__("" : "+x"(v.lo), "+x"(v.hi));
    return v;
}
INL void vf_store(float *p, vf16 v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
INL vf16 vf_add(vf16 a, vf16 b) { return (vf16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
INL vf16 vf_mul(vf16 a, vf16 b) { return (vf16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
INL vf16 vf_sub(vf16 a, vf16 b) { return (vf16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
INL vf16 vf_div(vf16 a, vf16 b) { return (vf16){_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
INL vf16 vf_fmadd(vf16 a, vf16 b, vf16 c) {
    return (vf16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
INL vi16 vi_load(const void *p) {
    return (vi16){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
INL vi16 vi_set1(int x) { const __m256i b = _mm256_set1_epi32(x); return (vi16){b, b}; }
INL vi16 vi_and(vi16 a, vi16 b) { return (vi16){_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
INL vi16 vi_srli(vi16 a, int n) { return (vi16){_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
INL vi16 vi_slli(vi16 a, int n) { return (vi16){_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
INL vf16 vi_to_f(vi16 a) { return (vf16){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
INL vf16 vi_bits_f(vi16 a) { return (vf16){_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
INL vf16 vf_half(const uint16_t *p) {
    return (vf16){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}
INL vf16 vf_int8(const int8_t *p) {
    return (vf16){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
                  _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))))};
}
INL __m256 fp8_8(const uint8_t *p) {
    const __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16((short)0xBF80)));
}
INL vf16 vf_fp8(const uint8_t *p) { return (vf16){fp8_8(p), fp8_8(p + 8)}; }
INL __m256 e5m2_8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
}
INL vf16 vf_e5m2(const uint8_t *p) { return (vf16){e5m2_8(p), e5m2_8(p + 8)}; }
INL vi16 vi_zero(void) { return (vi16){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
INL vf16 vf_bf16(const uint16_t *p) {
    const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8)));
    return (vf16){_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
INL vf16 vf_max(vf16 a, vf16 b) { return (vf16){_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
INL vf16 vf_abs(vf16 a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return (vf16){_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
INL float vf_reduce_max(vf16 a) {
    __m256 m = _mm256_max_ps(a.lo, a.hi);
    __m128 r = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_max_ss(r, _mm_movehdup_ps(r)));
}
INL float vf_reduce_add(vf16 a) {
    __m256 s = _mm256_add_ps(a.lo, a.hi);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
INL void vf_store_int16(int16_t *p, vf16 a) {
    // packs interleaves the halves per 128-bit lane: the permute puts them back in order
    const __m256i packed = _mm256_packs_epi32(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi));
    _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(packed, 0xD8));
}
INL __m256i dot8_s16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
INL vi16 vi_dot_s16(vi16 acc, vi16 a, vi16 b) {
    return (vi16){dot8_s16(acc.lo, a.lo, b.lo), dot8_s16(acc.hi, a.hi, b.hi)};
}
INL vf16 vf_min(vf16 a, vf16 b) { return (vf16){_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
INL vf16 vf_fnmadd(vf16 a, vf16 b, vf16 c) {
    return (vf16){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
INL vf16 vf_round(vf16 a) {
    return (vf16){_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                  _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// 2^n applied as two exact factors 2^(n/2), so that every n of vf_exp's clamped range
// (-126..128) is two normal numbers
INL __m256 scale2_8(__m256 p, __m256 n) {
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}
INL vf16 vf_scale2(vf16 p, vf16 n) { return (vf16){scale2_8(p.lo, n.lo), scale2_8(p.hi, n.hi)}; }
INL vf16 vf_inf_above(vf16 v, vf16 x, float limit) {
    const __m256 lim = _mm256_set1_ps(limit), inf = _mm256_set1_ps(INFINITY);
    return (vf16){_mm256_blendv_ps(v.lo, inf, _mm256_cmp_ps(x.lo, lim, _CMP_GT_OQ)),
                  _mm256_blendv_ps(v.hi, inf, _mm256_cmp_ps(x.hi, lim, _CMP_GT_OQ))};
}
#undef INL
#endif

#if defined(HAVE_SIMD16)
// e^x, within 2 ulp of expf (Cephes' polynomial after x = n ln2 + r, |r| <= ln2/2); past
// expf's range: 0 below, infinity above; NaN stays NaN (the operand order of min/max)
static inline __attribute__((always_inline)) vf16 vf_exp(vf16 x) {
    const vf16 c = vf_min(vf_set1(88.7f), vf_max(vf_set1(-87.3f), x));
    const vf16 n = vf_round(vf_mul(c, vf_set1(1.44269504f)));
    vf16 r = vf_fnmadd(n, vf_set1(0.693359375f), c);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vf16 p = vf_set1(1.9875691500e-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fmadd(p, vf_mul(r, r), vf_add(r, vf_set1(1.f)));
    return vf_inf_above(vf_scale2(p, n), x, 88.7f);
}

// 2^x for x <= 0 (below -126: 2^-126, which the callers zero where it stands for a masked key):
// x = n + f, |f| <= 1/2, 2^f by its Taylor polynomial of degree 6 (relative error ~1e-7), 2^n by
// scaling. Half vf_exp's operations: the attention kernels' softmax exponentials are most of their work.
static inline __attribute__((always_inline)) vf16 exp2_nonpositive(vf16 x) {
    x = vf_max(x, vf_set1(-126.f));
    const vf16 n = vf_round(x), f = vf_sub(x, n);
    vf16 p = vf_set1(1.5403530e-4f);
    p = vf_fmadd(p, f, vf_set1(1.3333558e-3f));
    p = vf_fmadd(p, f, vf_set1(9.6181291e-3f));
    p = vf_fmadd(p, f, vf_set1(5.5504109e-2f));
    p = vf_fmadd(p, f, vf_set1(2.4022651e-1f));
    p = vf_fmadd(p, f, vf_set1(6.9314718e-1f));
    p = vf_fmadd(p, f, vf_set1(1.f));
    return vf_scale2(p, n);
}
// 16 values of a float32 (dtype 0) or bfloat16 (1) array from element i, as float32
static inline __attribute__((always_inline)) vf16 vf_load_as(const void *p, int64_t i, int dtype) {
    return dtype == 0 ? vf_load((const float *)p + i) : vf_bf16((const uint16_t *)p + i);
}
#endif
