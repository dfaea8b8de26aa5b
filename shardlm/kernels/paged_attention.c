// Paged attention for decode steps (one query per sequence), on CPU.
//
// Reads each sequence's keys and values straight from the paged KV cache through its block
// table, once, with float32 accumulation: no gathered copy of the context. Parallel over
// (sequence, KV head); the query heads sharing a KV head are done together (GQA), or one
// by one where there are fewer than two pairs per thread.
//
// Layouts: q [B, H, D] with row stride q_stride (elements between sequences), out [B, H, D]; k_cache, v_cache [Hkv, num_blocks, block_size, D];
// block_tables [B, max_blocks] (int64); context_lens [B] (int64). dtype 0 = float32, 1 = bfloat16.
// lse [B, H] float32, or NULL: each head's log-sum-exp of its scaled scores, for merging partial
// outputs over split contexts (decode context parallel). A context of 0 gives zeros and -inf.
//
// kv_format: the cache holds dtype values (KV_AS_DTYPE) or FP8 ones (KV_FP8_E4M3, KV_FP8_E5M2), a
// key being its byte's value times k_scale and a value times v_scale. The bytes are widened as
// they are read (vf_fp8, vf_e5m2) and the scales applied to the scores and to the weighted sum of
// the values, not to each row; rotary_cache_write divides by them and converts as torch does.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "paged_cache.h"

// out[b, first + g] = acc[g] for n query heads from head `first`, in the cache's dtype
static void write_out(void *out, const float *acc, int b, int H, int first, int n, int D, int dtype) {
    for (int g = 0; g < n; g++) {
        const int64_t o = ((int64_t)b * H + first + g) * D;
        if (dtype == 0) {
            memcpy((float *)out + o, acc + g * D, sizeof(float) * D);
        } else {
            uint16_t *dst = (uint16_t *)out + o;
            for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(acc[g * D + d]);
        }
    }
}

// the largest of s[0..n) (-inf for none)
static inline float max_of(const float *s, int64_t n) {
    int64_t t = 0;
    float top = -INFINITY;
#if defined(HAVE_SIMD16)
    if (n >= 16) {
        vf16 m = vf_load(s);
        for (t = 16; t + 16 <= n; t += 16) m = vf_max(m, vf_load(s + t));
        top = vf_reduce_max(m);
    }
#endif
    for (; t < n; t++) top = s[t] > top ? s[t] : top;
    return top;
}

// s[t] = e^(s[t] - top) for t < n (the exponentials 16 at a time where vectors exist); *total = their sum
static inline void softmax_weights(float *s, int64_t n, float top, float *total) {
    int64_t t = 0;
    float sum = 0.f;
#if defined(HAVE_SIMD16)
    vf16 sums = vf_zero();
    for (; t + 16 <= n; t += 16) {
        const vf16 e = vf_exp(vf_sub(vf_load(s + t), vf_set1(top)));
        vf_store(s + t, e);
        sums = vf_add(sums, e);
    }
    sum = vf_reduce_add(sums);
#endif
    for (; t < n; t++) { s[t] = expf(s[t] - top); sum += s[t]; }
    *total = sum;
}

#if defined(HAVE_SIMD16)
// The second half of a (sequence, KV head)'s attention for head sizes of NC * 16, once its G
// query heads' scaled scores are in scores (G x ctx): per head the softmax weights and their sum
// of the values, in registers, into out_acc (G x D); lse (or NULL) gets each head's log-sum-exp
static inline __attribute__((always_inline)) void weigh_values(const int NC, int G, float *scores, const void *v_cache,
        const int64_t *table, int64_t ctx, int64_t head_rows, int block_size, int cdt, float v_mult, float *out_acc,
        float *lse) {
    const int D = NC * 16;
    for (int g = 0; g < G; g++) {
        float *sg = scores + g * ctx, total;
        const float top = max_of(sg, ctx);
        softmax_weights(sg, ctx, top, &total);
        if (lse) lse[g] = top + logf(total);
        vf16 acc[8];                     // NC of them (a fixed size: a variable one would live in memory)
        for (int c = 0; c < NC; c++) acc[c] = vf_zero();
        for (int64_t blk = 0, t0 = 0; t0 < ctx; blk++, t0 += block_size) {
            const int64_t first = head_rows + table[blk] * block_size;
            const int n = ctx - t0 < block_size ? (int)(ctx - t0) : block_size;
            for (int i = 0; i < n; i++) {
                const vf16 p = vf_set1(sg[t0 + i]);
                for (int c = 0; c < NC; c++) acc[c] = vf_fmadd(p, cache16(v_cache, (first + i) * D + 16 * c, cdt), acc[c]);
            }
        }
        const vf16 inv = vf_set1(v_mult / total);
        for (int c = 0; c < NC; c++) vf_store(out_acc + g * D + 16 * c, vf_mul(acc[c], inv));
    }
}
#endif

#if defined(__AVX512F__)
// One (sequence, KV head) of decode attention for head sizes of NC * 16: the G query heads qf
// (float32, G x D) against the context's keys and values, 16 cache rows at a time.
static inline __attribute__((always_inline)) void attend_simd(const int NC, const float *qf, int G, const void *k_cache,
        const void *v_cache, const int64_t *table, int64_t ctx, int64_t head_rows, int block_size, float scale,
        int cdt, float v_mult, float *scores, float *out_acc, float *lse) {
    const int D = NC * 16;
    for (int64_t blk = 0, t0 = 0; t0 < ctx; blk++, t0 += block_size) {
        const int64_t first = head_rows + table[blk] * block_size;
        const int n = ctx - t0 < block_size ? (int)(ctx - t0) : block_size;
        for (int i0 = 0; i0 < n; i0 += 16) {
            const int rows = n - i0 < 16 ? n - i0 : 16;
            for (int g = 0; g < G; g++) {
                __m512 q[8], dots[16];
                for (int c = 0; c < NC; c++) q[c] = _mm512_loadu_ps(qf + g * D + 16 * c);
#if defined(__AVX512BF16__)
                if (cdt == 1) {     // bfloat16 q and keys: the CPU's dot product of (d, d + 1) pairs
                    __m512bh qp[4];
                    for (int c = 0; c < NC / 2; c++) qp[c] = _mm512_cvtne2ps_pbh(q[2 * c + 1], q[2 * c]);  // exact
                    for (int i = 0; i < 16; i++) {
                        dots[i] = _mm512_setzero_ps();
                        if (i < rows)
                            for (int c = 0; c < NC / 2; c++)
                                dots[i] = _mm512_dpbf16_ps(dots[i], qp[c], (__m512bh)_mm512_loadu_si512(
                                    (const uint16_t *)k_cache + (first + i0 + i) * D + 32 * c));
                    }
                } else
#endif
                for (int i = 0; i < 16; i++) {
                    dots[i] = _mm512_setzero_ps();
                    if (i < rows)
                        for (int c = 0; c < NC; c++)
                            dots[i] = _mm512_fmadd_ps(q[c], cache16(k_cache, (first + i0 + i) * D + 16 * c, cdt), dots[i]);
                }
                _mm512_mask_storeu_ps(scores + g * ctx + t0 + i0, (__mmask16)((1u << rows) - 1),
                                      _mm512_mul_ps(reduce16(dots), _mm512_set1_ps(scale)));
            }
        }
    }
    weigh_values(NC, G, scores, v_cache, table, ctx, head_rows, block_size, cdt, v_mult, out_acc, lse);
}
#endif

#if !defined(__AVX512F__) && defined(HAVE_SIMD16)
// attend_simd for AVX2 (16-lane vectors as register pairs), head sizes of NC * 16: each cache row
// widened once into registers; per query head its scores, a softmax 16 at a time, and the
// values summed in registers
static inline __attribute__((always_inline)) void attend_vf16(const int NC, const float *qf, int G, const void *k_cache,
        const void *v_cache, const int64_t *table, int64_t ctx, int64_t head_rows, int block_size, float scale,
        int cdt, float v_mult, float *scores, float *out_acc, float *lse) {
    const int D = NC * 16;
    for (int64_t blk = 0, t0 = 0; t0 < ctx; blk++, t0 += block_size) {
        const int64_t first = head_rows + table[blk] * block_size;
        const int n = ctx - t0 < block_size ? (int)(ctx - t0) : block_size;
        for (int i = 0; i < n; i++) {
            vf16 k[8];
            for (int c = 0; c < NC; c++) k[c] = cache16(k_cache, (first + i) * D + 16 * c, cdt);
            for (int g = 0; g < G; g++) {
                vf16 dot = vf_mul(vf_load(qf + g * D), k[0]);
                for (int c = 1; c < NC; c++) dot = vf_fmadd(vf_load(qf + g * D + 16 * c), k[c], dot);
                scores[g * ctx + t0 + i] = vf_reduce_add(dot) * scale;
            }
        }
    }
    weigh_values(NC, G, scores, v_cache, table, ctx, head_rows, block_size, cdt, v_mult, out_acc, lse);
}
#endif

// Asks for one (sequence, KV head)'s keys and values to be brought into L2 ahead of use. A
// sequence's blocks lie scattered through the cache, each too short a run for the hardware
// prefetcher, so they are asked for one task ahead. Inlined: as a call of its own, gcc found it
// free of effects and dropped it.
static inline __attribute__((always_inline)) void prefetch_task(const void *k_cache, const void *v_cache,
        const int64_t *table, int64_t ctx, int64_t head_rows, int block_size, int D, int cdt) {
    const int esize = cache_esize(cdt);
    for (int64_t blk = 0, t0 = 0; t0 < ctx; blk++, t0 += block_size) {
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        const int64_t first = (head_rows + table[blk] * block_size) * D * esize;
        for (int64_t off = 0; off < n * D * esize; off += 64) {
            __builtin_prefetch((const char *)k_cache + first + off, 0, 2);
            __builtin_prefetch((const char *)v_cache + first + off, 0, 2);
        }
    }
}

KERNEL_API int paged_decode_attention(void *out, const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens,
                           int B, int H, int Hkv, int D, int num_blocks, int block_size,
                           int max_blocks, float scale, int dtype, int kv_format, float k_scale, float v_scale,
                           float *lse) {
    const int G = H / Hkv, cdt = cache_type(kv_format, dtype);
    const float v_mult = cache_multiplier(cdt, v_scale);
    scale *= cache_multiplier(cdt, k_scale);     // the scores' scale: the keys' too
    int64_t max_ctx = 0;
    for (int b = 0; b < B; b++) if (context_lens[b] > max_ctx) max_ctx = context_lens[b];
    int failed = 0;
    // Fewer than two (sequence, KV head) pairs per thread (a decode of a sequence or two): a task
    // per query head instead, so that the threads share the work evenly. A query head's numbers
    // are its own whatever the split (its scores, softmax and sum touch no other head's).
    const int threads = omp_get_max_threads(), pairs = B * Hkv, parts = pairs >= 2 * threads ? 1 : G;
    const int tasks = pairs * parts, chunk = tasks >= 32 * threads ? 16 : 1;

    #pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * (size_t)(max_ctx > 0 ? max_ctx : 1));
        float *qf = (float *)malloc(sizeof(float) * (size_t)G * D);
        float *acc = (float *)malloc(sizeof(float) * (size_t)G * D);
        float *row = (float *)malloc(sizeof(float) * (size_t)D);
        if (!scores || !qf || !acc || !row) {
            #pragma omp atomic write
            failed = 1;
        }
        // in runs of tasks where there are many, so that the task after this one is mostly this
        // thread's next
        #pragma omp for schedule(dynamic, chunk)
        for (int task = 0; task < tasks; task++) {
            if (failed) continue;
            const int pair = task / parts, part = task % parts;
            const int b = pair / Hkv, h = pair % Hkv;
            // this task's query heads of KV head h: [g0, g0 + Gt)
            const int g0 = G * part / parts, Gt = G * (part + 1) / parts - g0;
            const int64_t ctx = context_lens[b];
            const int64_t *table = block_tables + (int64_t)b * max_blocks;
            if (part == 0 && pair + 1 < pairs) {
                const int nb = (pair + 1) / Hkv, nh = (pair + 1) % Hkv;
                prefetch_task(k_cache, v_cache, block_tables + (int64_t)nb * max_blocks, context_lens[nb],
                              (int64_t)nh * num_blocks * block_size, block_size, D, cdt);
            }
            float *head_lse = lse ? lse + (int64_t)b * H + h * G + g0 : NULL;
            if (ctx == 0) {     // a decode context parallel rank that holds none of this context yet
                memset(acc, 0, sizeof(float) * (size_t)Gt * D);
                for (int g = 0; g < Gt && head_lse; g++) head_lse[g] = -INFINITY;
                write_out(out, acc, b, H, h * G + g0, Gt, D, dtype);
                continue;
            }
            for (int g = 0; g < Gt; g++)
                load_row((const char *)q + (b * q_stride + (int64_t)(h * G + g0 + g) * D) * (dtype ? 2 : 4), 0, D, dtype, qf + g * D);
#if defined(__AVX512F__)
            // the common head sizes: scores, softmax and sum of values in registers
            if (D == 64 || D == 128) {
                const int64_t head_rows = (int64_t)h * num_blocks * block_size;
                if (D == 64) attend_simd(4, qf, Gt, k_cache, v_cache, table, ctx, head_rows, block_size, scale, cdt, v_mult,
                                         scores, acc, head_lse);
                else attend_simd(8, qf, Gt, k_cache, v_cache, table, ctx, head_rows, block_size, scale, cdt, v_mult,
                                 scores, acc, head_lse);
                write_out(out, acc, b, H, h * G + g0, Gt, D, dtype);
                continue;
            }
#elif defined(HAVE_SIMD16)
            if (D == 64 || D == 128) {
                const int64_t head_rows = (int64_t)h * num_blocks * block_size;
                if (D == 64) attend_vf16(4, qf, Gt, k_cache, v_cache, table, ctx, head_rows, block_size, scale, cdt, v_mult,
                                         scores, acc, head_lse);
                else attend_vf16(8, qf, Gt, k_cache, v_cache, table, ctx, head_rows, block_size, scale, cdt, v_mult,
                                 scores, acc, head_lse);
                write_out(out, acc, b, H, h * G + g0, Gt, D, dtype);
                continue;
            }
#endif

            // scores = q . k * scale, for every context position, block by block; float32 rows
            // are read in place, bfloat16 rows widened once for the task's heads
            for (int64_t blk = 0, t0 = 0; t0 < ctx; blk++, t0 += block_size) {
                const int64_t first = ((int64_t)h * num_blocks + table[blk]) * block_size;
                const int n = ctx - t0 < block_size ? (int)(ctx - t0) : block_size;
                for (int i = 0; i < n; i++) {
                    const float *kr = row_f32(k_cache, first + i, D, cdt, row);
                    for (int g = 0; g < Gt; g++) {
                        const float *qg = qf + g * D;
                        float s = 0.f;
                        #pragma omp simd reduction(+:s)
                        for (int d = 0; d < D; d++) s += qg[d] * kr[d];
                        scores[g * ctx + t0 + i] = s * scale;
                    }
                }
            }
            // softmax per query head
            for (int g = 0; g < Gt; g++) {
                float *s = scores + g * ctx, sum;
                const float m = max_of(s, ctx);
                softmax_weights(s, ctx, m, &sum);
                if (head_lse) head_lse[g] = m + logf(sum);
                const float inv = v_mult / sum;
                #pragma omp simd
                for (int64_t t = 0; t < ctx; t++) s[t] *= inv;
            }
            // out = probs . v
            memset(acc, 0, sizeof(float) * (size_t)Gt * D);
            for (int64_t blk = 0, t0 = 0; t0 < ctx; blk++, t0 += block_size) {
                const int64_t first = ((int64_t)h * num_blocks + table[blk]) * block_size;
                const int n = ctx - t0 < block_size ? (int)(ctx - t0) : block_size;
                for (int i = 0; i < n; i++) {
                    const float *vr = row_f32(v_cache, first + i, D, cdt, row);
                    for (int g = 0; g < Gt; g++) {
                        const float p = scores[g * ctx + t0 + i];
                        float *a = acc + g * D;
                        #pragma omp simd
                        for (int d = 0; d < D; d++) a[d] += p * vr[d];
                    }
                }
            }
            write_out(out, acc, b, H, h * G + g0, Gt, D, dtype);
        }
        free(scores); free(qf); free(acc); free(row);
    }
    return failed ? -1 : 0;
}

// A head's D values of k or v (dtype) into an FP8 cache row, as torch's write does it
// (attention/torch_paged.py: write_slots): divided by the scale (rounded to dtype), converted
static void write_fp8_row(uint8_t *dst, const void *src, int D, int dtype, int cdt, float scale) {
    for (int d = 0; d < D; d++) {
        float v = load(src, d, dtype);
        if (scale != 1.f) v = round_to(v / scale, dtype);
        dst[d] = cdt == CACHE_E4M3 ? f32_to_e4m3(v) : f32_to_e5m2(v);
    }
}

// The rotary embedding on the q and k heads of the fresh qkv projection [B, (H + 2 Hkv) * D]
// (row stride qkv_stride) in place (cos, signed_sin [B, D]; cos NULL: a layer without one), and k
// and v written to the cache at slot_mapping (an FP8 cache: divided by k_scale / v_scale).
KERNEL_API void rotary_cache_write(void *qkv, int64_t qkv_stride, const void *cos, const void *signed_sin,
                                   void *k_cache, void *v_cache, const int64_t *slot_mapping, int B, int H, int Hkv,
                                   int D, int num_blocks, int block_size, int dtype, int kv_format, float k_scale,
                                   float v_scale) {
    const int esize = dtype == 0 ? 4 : 2, cdt = cache_type(kv_format, dtype);
    const int64_t head_stride = (int64_t)num_blocks * block_size * D;    // elements between KV heads
    #pragma omp parallel for schedule(static) if (B >= 8)
    for (int b = 0; b < B; b++) {
        char *row = (char *)qkv + b * qkv_stride * esize;
        if (cos)
            rotary_heads(row, (const char *)cos + (int64_t)b * D * esize,
                         (const char *)signed_sin + (int64_t)b * D * esize, H + Hkv, D, dtype);
        const char *k = row + (int64_t)H * D * esize, *v = k + (int64_t)Hkv * D * esize;
        for (int h = 0; h < Hkv; h++) {
            const int64_t at = h * head_stride + slot_mapping[b] * D;
            if (cdt >= CACHE_E4M3) {
                write_fp8_row((uint8_t *)k_cache + at, k + (int64_t)h * D * esize, D, dtype, cdt, k_scale);
                write_fp8_row((uint8_t *)v_cache + at, v + (int64_t)h * D * esize, D, dtype, cdt, v_scale);
                continue;
            }
            memcpy((char *)k_cache + at * esize, k + (int64_t)h * D * esize, (size_t)D * esize);
            memcpy((char *)v_cache + at * esize, v + (int64_t)h * D * esize, (size_t)D * esize);
        }
    }
}

// A decode step from the fresh qkv projection in one call: rotary_cache_write, then
// paged_decode_attention over each sequence's context, which includes the new token.
KERNEL_API int paged_decode_attention_qkv(void *out, void *qkv, int64_t qkv_stride, const void *cos, const void *signed_sin,
                               void *k_cache, void *v_cache, const int64_t *slot_mapping,
                               const int64_t *block_tables, const int64_t *context_lens,
                               int B, int H, int Hkv, int D, int num_blocks, int block_size,
                               int max_blocks, float scale, int dtype, int kv_format, float k_scale, float v_scale) {
    rotary_cache_write(qkv, qkv_stride, cos, signed_sin, k_cache, v_cache, slot_mapping, B, H, Hkv, D, num_blocks,
                       block_size, dtype, kv_format, k_scale, v_scale);
    return paged_decode_attention(out, qkv, qkv_stride, k_cache, v_cache, block_tables, context_lens, B, H, Hkv,
                                  D, num_blocks, block_size, max_blocks, scale, dtype, kv_format, k_scale, v_scale, NULL);
}

// Decode context parallel's merge: every [N, T, Hall * (D + 1)] float32 holds each of the N
// ranks' partial attention outputs [T, Hall, D] followed by their log-sum-exps [T, Hall]; out
// [T, H, D] (dtype) receives heads first..first + H - 1 merged exactly:
//     out = sum_r exp(lse_r - m) out_r / sum_r exp(lse_r - m),  m = max_r lse_r
// (a rank without any of a query's context has lse -inf and weight 0).
KERNEL_API void merge_attention_partials(const float *every, int N, int T, int Hall, int D, int first, int H,
                                         void *out, int dtype) {
    const int64_t W = (int64_t)Hall * (D + 1);
    #pragma omp parallel for schedule(static) if ((int64_t)T * H * N * D >= 65536)
    for (int64_t th = 0; th < (int64_t)T * H; th++) {
        const int64_t t = th / H, h = first + th % H;
        float m = -INFINITY, total = 0.f, w[N];
        for (int r = 0; r < N; r++) {
            const float l = every[(r * (int64_t)T + t) * W + (int64_t)Hall * D + h];
            m = l > m ? l : m;
        }
        for (int r = 0; r < N; r++) {
            const float l = every[(r * (int64_t)T + t) * W + (int64_t)Hall * D + h];
            w[r] = l == -INFINITY ? 0.f : expf(l - m);
            total += w[r];
        }
        const float inv = 1.f / total;
        for (int d = 0; d < D; d++) {
            float acc = 0.f;
            for (int r = 0; r < N; r++) acc += w[r] * every[(r * (int64_t)T + t) * W + h * (int64_t)D + d];
            store(out, th * D + d, acc * inv, dtype);
        }
    }
}
