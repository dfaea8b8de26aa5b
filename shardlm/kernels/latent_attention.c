// Decode attention for multi-head latent attention (DeepSeek's MLA, absorbed), on CPU.
//
// Every query head of a sequence attends to the same cache rows: one row of D values per token
// (the latent, then the rotary key), whose first Dv values are also its value. So the work is a
// product of all H query rows with each cache row, not a KV head per query group: a sequence's
// context is cut into at most MAX_SPLITS splits of at least MIN_SPLIT keys (so the partial sums'
// memory stays bounded), each split one task (all heads against its keys, CHUNK
// keys at a time with an online softmax), and the splits' partial sums merged in order. The splits
// depend on the context length alone, so a row's output does not depend on the thread count or on
// the other sequences of the step.
//
// On CPUs with AVX512-BF16 and a bfloat16 cache (when the blocked products use the dot product:
// shardlm_bf16_dot), the scores and the value sums take bfloat16 pairs (vdpbf16ps) straight from
// the cache rows: scores as 4 heads x 4 keys of dot products summed across lanes, values from two
// keys' rows interleaved in registers; the weights go into the value sums in bfloat16, as the
// prompt kernel's (prefill_attention.c) do. Elsewhere rows are widened to float32.
//
// Layouts: q [B, H, D] (row stride q_stride elements between sequences), out [B, H, Dv]; the
// cache [num_blocks, block_size, D] (one KV head); block_tables [B, max_blocks], context_lens [B]
// (int64); lse [B, H] float32 or NULL. A context of 0 gives zeros and -inf, as
// paged_decode_attention does.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "paged_cache.h"

#define CHUNK 64      // keys per online-softmax step
#define MIN_SPLIT 256 // keys per task, at least (a multiple of CHUNK)
#define MAX_SPLITS 8  // tasks per sequence, at most
#define HP 8          // heads are padded to a multiple of HP

typedef struct {
    const void *cache;
    const int64_t *table;
    int block_size, D, Dv, H, cdt;
    float scale2, mult;          // scale2: the scores' scale times log2 e; mult: the cache's multiplier
} latent_t;

// A thread's buffers: scores / weights s [Hp][CHUNK], weights in bfloat16 p [Hp][CHUNK], the
// queries (bfloat16 [Hp][D] or float32), widened rows kr [CHUNK][D] (float32 path)
typedef struct {
    float *s, *qf, *kr;
    uint16_t *p, *qb;
} work_t;

static inline const char *cache_row(const latent_t *a, int64_t t) {
    return (const char *)a->cache + (a->table[t / a->block_size] * a->block_size + t % a->block_size) * (int64_t)a->D
                                        * cache_esize(a->cdt);
}

// Scores s[h][0..n) -> weights 2^(s * scale2 - m) (0 from key n on), each head's running maximum
// m and sum l updated; alpha[h]: the factor its earlier sums are rescaled by
static void chunk_weights(const latent_t *a, float *s, int n, float *m, float *l, float *alpha) {
    for (int h = 0; h < a->H; h++) {
        float *row = s + h * CHUNK, top = -INFINITY, sum = 0.f;
        for (int j = 0; j < n; j++) top = fmaxf(top, row[j]);
        const float m_new = fmaxf(m[h], top * a->scale2);
        alpha[h] = exp2f(m[h] - m_new);                  // m = -inf at first: 0 (o and l are 0)
        m[h] = m_new;
        int j = 0;
#if defined(HAVE_SIMD16)
        const vf16 vscale = vf_set1(a->scale2), vm = vf_set1(m_new);
        vf16 sums = vf_zero();
        for (; j + 16 <= n; j += 16) {
            const vf16 e = exp2_nonpositive(vf_sub(vf_mul(vf_load(row + j), vscale), vm));
            vf_store(row + j, e);
            sums = vf_add(sums, e);
        }
        sum = vf_reduce_add(sums);
#endif
        for (; j < n; j++) sum += row[j] = exp2f(row[j] * a->scale2 - m_new);
        for (; j < CHUNK; j++) row[j] = 0.f;
        l[h] = l[h] * alpha[h] + sum;
    }
}

#if defined(__AVX512BF16__)
// s[h][j] = q[h] . rows[j] for heads h0..h0 + 4 and keys j0..j0 + 4 (bfloat16 pairs, D values)
static inline void pair_scores4x4(const uint16_t *q, int D, const uint16_t *const *rows, int h0, int j0, float *s) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32) {
        const __mmask32 mask = D - d >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << (D - d)) - 1;
        __m512bh k[4], x[4];
        for (int i = 0; i < 4; i++) k[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[j0 + i] + d);
        for (int i = 0; i < 4; i++) x[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, q + (int64_t)(h0 + i) * D + d);
        for (int h = 0; h < 4; h++)
            for (int j = 0; j < 4; j++) acc[h * 4 + j] = _mm512_dpbf16_ps(acc[h * 4 + j], x[h], k[j]);
    }
    float sums[16];
    _mm512_storeu_ps(sums, reduce16(acc));
    for (int h = 0; h < 4; h++)
        for (int j = 0; j < 4; j++) s[(h0 + h) * CHUNK + j0 + j] = sums[h * 4 + j];
}

// o[h][..Dv] = o[h] * alpha[h] + sum over the chunk's keys of p[h][j] rows[j][..Dv], for Hp heads
// (p: bfloat16 weights, 0 past the keys): two keys' values interleaved into pairs in registers
static void pair_values(const uint16_t *const *rows, const uint16_t *p, const float *alpha, int Hp, int Dv,
                        float *o) {
    __m512i lo_idx, hi_idx;
    {
        uint16_t lo[32], hi[32];
        for (int i = 0; i < 16; i++) lo[2 * i] = i, lo[2 * i + 1] = 32 + i, hi[2 * i] = 16 + i, hi[2 * i + 1] = 48 + i;
        lo_idx = _mm512_loadu_si512(lo), hi_idx = _mm512_loadu_si512(hi);
    }
    for (int d = 0; d < Dv; d += 32) {
        const int two = Dv - d >= 32;             // else 16 values left (Dv is a multiple of 16)
        const __mmask32 mask = two ? ~(__mmask32)0 : 0xffff;
        for (int h0 = 0; h0 < Hp; h0 += HP) {
            __m512 acc[HP][2];
            for (int h = 0; h < HP; h++) {
                const __m512 scale = _mm512_set1_ps(alpha[h0 + h]);
                float *oh = o + (int64_t)(h0 + h) * Dv + d;
                acc[h][0] = _mm512_mul_ps(_mm512_loadu_ps(oh), scale);
                acc[h][1] = two ? _mm512_mul_ps(_mm512_loadu_ps(oh + 16), scale) : _mm512_setzero_ps();
            }
            for (int j = 0; j < CHUNK; j += 2) {
                const __m512i a = _mm512_maskz_loadu_epi16(mask, rows[j] + d), b = _mm512_maskz_loadu_epi16(mask, rows[j + 1] + d);
                const __m512bh lo = (__m512bh)_mm512_permutex2var_epi16(a, lo_idx, b);
                const __m512bh hi = (__m512bh)_mm512_permutex2var_epi16(a, hi_idx, b);
                for (int h = 0; h < HP; h++) {
                    int32_t pair;
                    memcpy(&pair, p + (h0 + h) * CHUNK + j, sizeof(pair));
                    const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
                    acc[h][0] = _mm512_dpbf16_ps(acc[h][0], lo, w);
                    acc[h][1] = _mm512_dpbf16_ps(acc[h][1], hi, w);
                }
            }
            for (int h = 0; h < HP; h++) {
                float *oh = o + (int64_t)(h0 + h) * Dv + d;
                _mm512_storeu_ps(oh, acc[h][0]);
                if (two) _mm512_storeu_ps(oh + 16, acc[h][1]);
            }
        }
    }
}

// The keys from..to of one sequence in bfloat16 pairs: o, m, l updated for every head
static void pair_split(const latent_t *a, const uint16_t *q, int64_t from, int64_t to, float *o, float *m, float *l,
                       work_t *w) {
    const int H = a->H, Hp = (H + HP - 1) / HP * HP;
    const uint16_t *rows[CHUNK];
    float alpha[Hp];
    for (int h = 0; h < Hp; h++) memcpy(w->qb + (int64_t)h * a->D, q + (int64_t)(h < H ? h : H - 1) * a->D, 2 * a->D);
    for (int64_t t0 = from; t0 < to; t0 += CHUNK) {
        const int n = to - t0 < CHUNK ? (int)(to - t0) : CHUNK;
        for (int j = 0; j < CHUNK; j++) rows[j] = (const uint16_t *)cache_row(a, t0 + (j < n ? j : n - 1));
        const int scored = (n + 3) / 4 * 4;
        for (int h0 = 0; h0 < H; h0 += 4)
            for (int j0 = 0; j0 < scored; j0 += 4) pair_scores4x4(w->qb, a->D, rows, h0, j0, w->s);
        chunk_weights(a, w->s, n, m, l, alpha);
        for (int h = 0; h < Hp; h++) {
            uint16_t *ph = w->p + h * CHUNK;
            if (h >= H) { memset(ph, 0, sizeof(uint16_t) * CHUNK); alpha[h] = 0.f; continue; }
            const float *sh = w->s + h * CHUNK;
            for (int j = 0; j < CHUNK; j += 32)
                _mm512_storeu_si512(ph + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sh + j + 16),
                                                                        _mm512_loadu_ps(sh + j)));
        }
        pair_values(rows, w->p, alpha, Hp, a->Dv, o);
    }
}
#endif

// The keys from..to of one sequence, rows widened to float32 (qf: the queries, Hp rows of D16 =
// D rounded up to 16, zero past D): o, m, l updated for every head
static void float_split(const latent_t *a, const float *qf, int64_t from, int64_t to, float *o, float *m, float *l,
                        work_t *w) {
    const int H = a->H, Hp = (H + HP - 1) / HP * HP, D = a->D, D16 = (D + 15) / 16 * 16, Dv = a->Dv;
    float alpha[Hp];
    for (int h = H; h < Hp; h++) alpha[h] = 0.f;
    for (int64_t t0 = from; t0 < to; t0 += CHUNK) {
        const int n = to - t0 < CHUNK ? (int)(to - t0) : CHUNK, scored = (n + 3) / 4 * 4;
        for (int j = 0; j < scored; j++) {
            float *row = w->kr + (int64_t)j * D16;
            memset(row + D, 0, sizeof(float) * (D16 - D));
            if (j >= n) { memset(row, 0, sizeof(float) * D); continue; }
            load_row(cache_row(a, t0 + j), 0, D, a->cdt, row);
            if (a->mult != 1.f) for (int d = 0; d < D; d++) row[d] *= a->mult;
        }
        for (int h0 = 0; h0 < H; h0 += 4)
            for (int j0 = 0; j0 < scored; j0 += 4) {
                const float *x = qf + (int64_t)h0 * D16, *k = w->kr + (int64_t)j0 * D16;
#if defined(HAVE_SIMD16)
                vf16 acc[16];
                for (int i = 0; i < 16; i++) acc[i] = vf_zero();
                for (int d = 0; d < D16; d += 16)
                    for (int h = 0; h < 4; h++) {
                        const vf16 xh = vf_load(x + (int64_t)h * D16 + d);
                        for (int j = 0; j < 4; j++) acc[h * 4 + j] = vf_fmadd(xh, vf_load(k + (int64_t)j * D16 + d), acc[h * 4 + j]);
                    }
                for (int i = 0; i < 16; i++) w->s[(h0 + i / 4) * CHUNK + j0 + i % 4] = vf_reduce_add(acc[i]);
#else
                for (int h = 0; h < 4; h++)
                    for (int j = 0; j < 4; j++) {
                        float dot = 0.f;
                        for (int d = 0; d < D; d++) dot += x[(int64_t)h * D16 + d] * k[(int64_t)j * D16 + d];
                        w->s[(h0 + h) * CHUNK + j0 + j] = dot;
                    }
#endif
            }
        chunk_weights(a, w->s, n, m, l, alpha);
        for (int h = H; h < Hp; h++) memset(w->s + h * CHUNK, 0, sizeof(float) * CHUNK);
        int d0 = 0;
#if defined(HAVE_SIMD16)
        for (; d0 + 16 <= Dv; d0 += 16)
            for (int h0 = 0; h0 < Hp; h0 += HP) {
                vf16 acc[HP];
                for (int h = 0; h < HP; h++) acc[h] = vf_mul(vf_load(o + (int64_t)(h0 + h) * Dv + d0), vf_set1(alpha[h0 + h]));
                for (int j = 0; j < n; j++) {
                    const vf16 v = vf_load(w->kr + (int64_t)j * D16 + d0);
                    for (int h = 0; h < HP; h++) acc[h] = vf_fmadd(vf_set1(w->s[(h0 + h) * CHUNK + j]), v, acc[h]);
                }
                for (int h = 0; h < HP; h++) vf_store(o + (int64_t)(h0 + h) * Dv + d0, acc[h]);
            }
#endif
        for (int h = 0; h < H; h++)
            for (int d = d0; d < Dv; d++) {
                float acc = o[(int64_t)h * Dv + d] * alpha[h];
                for (int j = 0; j < n; j++) acc += w->s[h * CHUNK + j] * w->kr[(int64_t)j * D16 + d];
                o[(int64_t)h * Dv + d] = acc;
            }
    }
}

// The keys of each of a context's splits: a function of its length alone
static inline int64_t split_keys(int64_t ctx) {
    const int64_t even = (ctx + MAX_SPLITS - 1) / MAX_SPLITS;
    return even <= MIN_SPLIT ? MIN_SPLIT : (even + CHUNK - 1) / CHUNK * CHUNK;
}

KERNEL_API int latent_decode_attention(void *out, const void *q, int64_t q_stride, const void *cache,
                                       const int64_t *block_tables, int max_blocks, const int64_t *context_lens,
                                       int B, int H, int D, int Dv, int block_size, float scale,
                                       int dtype, int kv_format, float k_scale, float *lse) {
    const int cdt = cache_type(kv_format, dtype), Hp = (H + HP - 1) / HP * HP, D16 = (D + 15) / 16 * 16;
    int pairs = 0;
#if defined(__AVX512BF16__)
    pairs = dtype == 1 && cdt == 1 && Dv % 16 == 0 && shardlm_bf16_dot;
#endif
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (B + 1));   // each sequence's first task
    if (!first) return -1;
    first[0] = 0;
    for (int b = 0; b < B; b++) first[b + 1] = first[b] + (context_lens[b] + split_keys(context_lens[b]) - 1)
                                                          / split_keys(context_lens[b]);
    const int64_t tasks = first[B], part = (int64_t)Hp * (Dv + 2);     // a task's o [Hp][Dv], m [Hp], l [Hp]
    float *parts = (float *)malloc(sizeof(float) * (size_t)(tasks > 0 ? tasks : 1) * part);
    if (!parts) { free(first); return -1; }
    int failed = 0;
    #pragma omp parallel
    {
        work_t w;
        w.s = (float *)malloc(sizeof(float) * Hp * CHUNK);
        w.p = (uint16_t *)malloc(sizeof(uint16_t) * Hp * CHUNK);
        w.qb = (uint16_t *)malloc(sizeof(uint16_t) * Hp * D);
        w.qf = (float *)malloc(sizeof(float) * Hp * D16);
        w.kr = (float *)malloc(sizeof(float) * CHUNK * D16);
        const int ok = w.s && w.p && w.qb && w.qf && w.kr;
        if (!ok) {
            #pragma omp atomic write
            failed = 1;
        }
        int last_b = -1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!ok) continue;
            int b = 0;
            while (first[b + 1] <= task) b++;
            const latent_t a = {cache, block_tables + (int64_t)b * max_blocks, block_size, D, Dv, H, cdt,
                                scale * (float)M_LOG2E, cache_multiplier(cdt, k_scale)};
            const int64_t ctx = context_lens[b], split = split_keys(ctx), from = (task - first[b]) * split;
            const int64_t to = from + split < ctx ? from + split : ctx;
            float *o = parts + task * part, *m = o + (int64_t)Hp * Dv, *l = m + Hp;
            memset(o, 0, sizeof(float) * Hp * Dv);
            for (int h = 0; h < Hp; h++) m[h] = -INFINITY, l[h] = 0.f;
            const char *qs = (const char *)q + (int64_t)b * q_stride * (dtype ? 2 : 4);
#if defined(__AVX512BF16__)
            if (pairs) { pair_split(&a, (const uint16_t *)qs, from, to, o, m, l, &w); continue; }
#endif
            if (b != last_b) {        // the queries widened, padded with zeros (dims) and copies (heads)
                for (int h = 0; h < Hp; h++) {
                    float *row = w.qf + (int64_t)h * D16;
                    load_row(qs, h < H ? h : H - 1, D, dtype, row);
                    memset(row + D, 0, sizeof(float) * (D16 - D));
                }
                last_b = b;
            }
            float_split(&a, w.qf, from, to, o, m, l, &w);
        }
        free(w.s), free(w.p), free(w.qb), free(w.qf), free(w.kr);
    }
    if (!failed) {
        // each (sequence, head): the splits' sums rescaled to their common maximum, in split order
        #pragma omp parallel for schedule(static)
        for (int64_t bh = 0; bh < (int64_t)B * H; bh++) {
            const int b = (int)(bh / H), h = (int)(bh % H);
            float top = -INFINITY, total = 0.f, acc[Dv];
            for (int64_t t = first[b]; t < first[b + 1]; t++) top = fmaxf(top, parts[t * part + (int64_t)Hp * Dv + h]);
            memset(acc, 0, sizeof(float) * Dv);
            for (int64_t t = first[b]; t < first[b + 1]; t++) {
                const float *o = parts + t * part, *m = o + (int64_t)Hp * Dv, *l = m + Hp;
                const float f = exp2f(m[h] - top);
                total += l[h] * f;
                for (int d = 0; d < Dv; d++) acc[d] += o[(int64_t)h * Dv + d] * f;
            }
            const float inv = total > 0.f ? 1.f / total : 0.f;
            for (int d = 0; d < Dv; d++) store(out, bh * Dv + d, acc[d] * inv, dtype);
            if (lse) lse[bh] = total > 0.f ? (top + log2f(total)) * (float)M_LN2 : -INFINITY;
        }
    }
    free(parts), free(first);
    return failed ? -1 : 0;
}
