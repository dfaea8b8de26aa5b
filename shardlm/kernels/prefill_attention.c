// Attention for prompt chunks (prefill) on CPU: tiled causal ("flash") attention over the paged
// KV cache.
//
// Each query attends to the keys at its position and before it: a cached prefix and the chunk up
// to itself. Keys are taken in blocks of BK; a block above the diagonal is never computed, and
// each query row keeps a running maximum, sum and weighted sum of values (the online softmax), so
// nothing proportional to chunk x context is ever made. Per sequence, each KV head's keys and
// values are first packed once from the paged cache (any cache dtype; FP8 widened and scaled)
// into the layout the tiles read: float32 panels for the vector tiles (AVX2, AVX-512, plain C),
// or, for a bfloat16 cache, bfloat16 pairs in the AMX tiles' layouts, which the AMX tiles and the
// AVX512-BF16 dot product (vdpbf16ps: twice the multiply-adds of float32 FMAs on AMD Zen 4, where
// the blocked products use it too) both read. Then tasks of (KV head, a block of query positions) run
// in parallel, the longest first. A task's rows are (query position, query head) pairs: the G
// query heads of a KV head share its keys (GQA, and latent attention's single KV head).
//
// The weights go into the value products in bfloat16 on the bfloat16 paths, as GPU flash attention
// does. A row's arithmetic depends on its own position alone (its key blocks start at key 0, BK apart,
// masked past its position), so its output does not depend on how the prompt was chunked, on the
// other sequences of the step or on the thread count.
//
// Layouts: q rows of H heads of D values, row r at element r * q_stride; token_index [B, width]:
// the q row of each sequence's queries (padding repeats the last); out [B * width, H, Dv] and lse
// [B * width, H] (float32, or NULL: not wanted) in that order, padding rows left unwritten;
// starts [B]: the position of each sequence's first query; contexts [B]: its tokens of context
// after the chunk (so contexts - starts queries). Caches as paged_decode_attention's; v_cache
// NULL: each key's first Dv values are its value (latent attention).
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "paged_cache.h"

#define BK 64              // keys per block
#define TASK_ROWS 64       // rows per task: TASK_ROWS / G query positions (at least one)
#if defined(__AVX512F__)
#define PR 4               // rows per vector tile
#define KV 4               // 16-key vectors per pass of the score tile
#define VV 4               // 16-value vectors per pass of the value tile
#elif defined(HAVE_SIMD16)
#define PR 2               // AVX2's 16 registers hold 2 rows x 2 vectors of two halves each
#define KV 2
#define VV 2
#else
#define PR 1
#endif

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *token_index, *table;
    int64_t q_stride, head_rows_per_kv, start, ctx, queries;
    int width, b, H, G, D, Dv, block_size, dtype, cdt;
    float scale2, k_mult, v_mult;       // scale2: the scores' scale times log2 e
    void *out;
    float *lse;
} seq_t;

// The work buffers of one thread, for tasks of up to `rows` rows
enum { FLOAT_TILES, BF16_DOT_TILES, AMX_TILES };     // what a call's tiles compute with

typedef struct {
    float *q, *o, *s, *m, *l;             // q: rows x D (bfloat16 tiles: bfloat16); o: rows x Dv; s: rows x BK scores
    uint16_t *p;                          // bfloat16 tiles: rows x BK weights in bfloat16
    int64_t *pos;                          // each row's position
} scratch_t;

// The cache row of key t of the KV head whose rows start at head_rows
static inline int64_t key_row(const seq_t *a, int64_t head_rows, int64_t t) {
    return head_rows + a->table[t / a->block_size] * a->block_size + t % a->block_size;
}

// Keys kb * BK.. of KV head h packed as float32: keys [BK / 16 panels][D][16], values [BK][Dv]
// (past the context: zeros, which the causal mask leaves unweighted)
static void pack_float_block(const seq_t *a, int h, int64_t kb, float *keys, float *values) {
    const int D = a->D, Dv = a->Dv;
    float row[D];
    for (int j = 0; j < BK; j++) {
        const int64_t t = kb * BK + j;
        float *panel = keys + (j / 16) * D * 16 + j % 16, *value = values + (int64_t)j * Dv;
        if (t >= a->ctx) {
            for (int d = 0; d < D; d++) panel[d * 16] = 0.f;
            memset(value, 0, sizeof(float) * Dv);
            continue;
        }
        const int64_t r = key_row(a, h * a->head_rows_per_kv, t);
        load_row(a->k_cache, r, D, a->cdt, row);
        for (int d = 0; d < D; d++) panel[d * 16] = row[d] * a->k_mult;
        if (a->v_cache) load_row(a->v_cache, r, D, a->cdt, row);
        for (int d = 0; d < Dv; d++) value[d] = row[d] * a->v_mult;
    }
}

#if defined(__AVX512BF16__)
// Keys kb * BK.. of KV head h of a bfloat16 cache in AMX's B layouts: keys [BK / 16][D / 2][16][2]
// (per 16 keys, a d pair per 32-bit word), values [BK / 2][Dv][2] (a key pair per word)
static void pack_pairs_block(const seq_t *a, int h, int64_t kb, uint16_t *keys, uint16_t *values) {
    const int D = a->D, Dv = a->Dv;
    for (int j = 0; j < BK; j++) {
        const int64_t t = kb * BK + j;
        uint16_t *key = keys + (j / 16) * D * 16 + (j % 16) * 2, *value = values + (j / 2) * Dv * 2 + j % 2;
        const uint16_t *row = t < a->ctx ? (const uint16_t *)a->k_cache + key_row(a, h * a->head_rows_per_kv, t) * D
                                         : NULL;
        for (int d = 0; d < D; d++) key[(d / 2) * 32 + d % 2] = row ? row[d] : 0;
        if (row && a->v_cache) row = (const uint16_t *)a->v_cache + key_row(a, h * a->head_rows_per_kv, t) * D;
        for (int d = 0; d < Dv; d++) value[d * 2] = row ? row[d] : 0;
    }
}
#endif

// n rows (at most 16) of a block of scores, row r at s + r * BK, the keys from key0 on, each row
// seeing the keys up to its position pos[r] -> their softmax weights 2^(score * scale2 - m) (0
// for a key past the row's position), each row's running maximum m and sum l updated (in base 2:
// scale2 = scale * log2 e); alpha[r]: the factor the row's earlier sums are rescaled by
static inline void block_weights(float *s, int n, const int64_t *pos, int64_t key0, float scale2, float *m, float *l,
                                 float *alpha) {
    float top[16], m_old[16], m_new[16];
    int hidden[16];                                  // each row's first key past its position
    for (int r = 0; r < n; r++) {
        float *row = s + r * BK;
        const int64_t visible = pos[r] + 1 - key0;
        hidden[r] = visible <= 0 ? 0 : visible < BK ? (int)visible : BK;
        for (int j = hidden[r]; j < BK; j++) row[j] = -INFINITY;
#if defined(HAVE_SIMD16)
        vf16 tops = vf_load(row);
        for (int j = 16; j < BK; j += 16) tops = vf_max(tops, vf_load(row + j));
        top[r] = vf_reduce_max(tops) * scale2;
#else
        top[r] = -INFINITY;
        for (int j = 0; j < BK; j++) top[r] = fmaxf(top[r], row[j] * scale2);
#endif
        m_old[r] = m[r];
        m_new[r] = m[r] = fmaxf(m[r], top[r]);      // finite: every row sees key 0 in its first block
    }
#if defined(HAVE_SIMD16)
    for (int r = n; r < 16; r++) m_old[r] = m_new[r] = 0.f;
    vf_store(alpha, exp2_nonpositive(vf_sub(vf_load(m_old), vf_load(m_new))));   // m_old = -inf: ~0 (o, l are 0)
#else
    for (int r = 0; r < n; r++) alpha[r] = exp2f(m_old[r] - m_new[r]);
#endif
    for (int r = 0; r < n; r++) {
        float *row = s + r * BK, sum = 0.f;
#if defined(HAVE_SIMD16)
        const vf16 vscale = vf_set1(scale2), vm = vf_set1(m_new[r]);
        vf16 sums = vf_zero();
        for (int j = 0; j < BK; j += 16) {
            const vf16 e = exp2_nonpositive(vf_sub(vf_mul(vf_load(row + j), vscale), vm));
            vf_store(row + j, e);
            sums = vf_add(sums, e);
        }
        sum = vf_reduce_add(sums);
#else
        for (int j = 0; j < BK; j++) { row[j] = exp2f(row[j] * scale2 - m_new[r]); sum += row[j]; }
#endif
        for (int j = hidden[r]; j < BK; j++) sum -= row[j], row[j] = 0.f;
        l[r] = l[r] * alpha[r] + sum;
    }
}

#if defined(HAVE_SIMD16)
// s[r][..] = rows q[r] . keys of the block's 16-key panels c0..c0 + KV (unscaled), PR rows
static inline __attribute__((always_inline)) void score_pass(const float *q, int D, const float *keys, int c0,
                                                            float *s) {
    vf16 acc[PR][KV];
    for (int r = 0; r < PR; r++)
        for (int c = 0; c < KV; c++) acc[r][c] = vf_zero();
    for (int d = 0; d < D; d++) {
        vf16 k[KV];
        for (int c = 0; c < KV; c++) k[c] = vf_load_kept(keys + (int64_t)(c0 + c) * D * 16 + d * 16);
        for (int r = 0; r < PR; r++) {
            const vf16 x = vf_set1(q[(int64_t)r * D + d]);
            for (int c = 0; c < KV; c++) acc[r][c] = vf_fmadd(x, k[c], acc[r][c]);
        }
    }
    for (int r = 0; r < PR; r++)
        for (int c = 0; c < KV; c++) vf_store(s + r * BK + 16 * (c0 + c), acc[r][c]);
}

// o[r][d0..d0 + 16 NV) = o[r] * alpha[r] + sum over the block's keys of s[r][j] * values[j], PR
// rows, NV <= VV (a constant where it is called; the arrays have a fixed size, so that the sums
// stay in registers)
static inline __attribute__((always_inline)) void value_pass(const int NV, const float *s, const float *alpha,
                                                            const float *values, int Dv, int d0, float *o) {
    vf16 acc[PR][VV];
    for (int r = 0; r < PR; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = vf_mul(vf_load(o + (int64_t)r * Dv + d0 + 16 * c), vf_set1(alpha[r]));
    for (int j = 0; j < BK; j++) {
        vf16 v[VV];
        for (int c = 0; c < NV; c++) v[c] = vf_load_kept(values + (int64_t)j * Dv + d0 + 16 * c);
        for (int r = 0; r < PR; r++) {
            const vf16 w = vf_set1(s[r * BK + j]);
            for (int c = 0; c < NV; c++) acc[r][c] = vf_fmadd(w, v[c], acc[r][c]);
        }
    }
    for (int r = 0; r < PR; r++)
        for (int c = 0; c < NV; c++) vf_store(o + (int64_t)r * Dv + d0 + 16 * c, acc[r][c]);
}
#endif

// PR rows (q, o, m, l from the tile's first row) against key block kb, in float32
static void float_tile(const seq_t *a, const float *keys, const float *values, int64_t kb, const int64_t *pos,
                       const float *q, float *o, float *m, float *l, float *s) {
    const int D = a->D, Dv = a->Dv;
    float alpha[16];
#if defined(HAVE_SIMD16)
    for (int c0 = 0; c0 < BK / 16; c0 += KV) score_pass(q, D, keys, c0, s);
#else
    for (int r = 0; r < PR; r++)
        for (int j = 0; j < BK; j++) {
            float dot = 0.f;
            for (int d = 0; d < D; d++) dot += q[(int64_t)r * D + d] * keys[(j / 16) * D * 16 + d * 16 + j % 16];
            s[r * BK + j] = dot;
        }
#endif
    block_weights(s, PR, pos, kb * BK, a->scale2, m, l, alpha);
    int d0 = 0;
#if defined(HAVE_SIMD16)
    for (; d0 + 16 * VV <= Dv; d0 += 16 * VV) value_pass(VV, s, alpha, values, Dv, d0, o);
    for (; d0 + 16 <= Dv; d0 += 16) value_pass(1, s, alpha, values, Dv, d0, o);
#endif
    for (int r = 0; r < PR; r++)
        for (int d = d0; d < Dv; d++) {
            float acc = o[(int64_t)r * Dv + d] * alpha[r];
            for (int j = 0; j < BK; j++) acc += s[r * BK + j] * values[(int64_t)j * Dv + d];
            o[(int64_t)r * Dv + d] = acc;
        }
}

#if defined(__AVX512BF16__)
// Row r's BK weights s[r] -> p[r] in bfloat16 (round to nearest even), for n rows
static inline void weights_to_bf16(const float *s, int n, uint16_t *p) {
    for (int r = 0; r < n; r++)
        for (int j = 0; j < BK; j += 32)
            _mm512_storeu_si512(p + r * BK + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + r * BK + j + 16),
                                                                             _mm512_loadu_ps(s + r * BK + j)));
}

// s[r][..] = rows q[r] (bfloat16) . the keys of the block's 16-key panels c0..c0 + KV (bfloat16
// pairs), PR rows: a d pair per multiply-add
static inline __attribute__((always_inline)) void pair_score_pass(const uint16_t *q, int D, const uint16_t *keys,
                                                                 int c0, float *s) {
    __m512 acc[PR][KV];
    for (int r = 0; r < PR; r++)
        for (int c = 0; c < KV; c++) acc[r][c] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 2) {
        __m512bh k[KV];
        for (int c = 0; c < KV; c++)
            k[c] = (__m512bh)_mm512_loadu_si512(keys + (int64_t)(c0 + c) * D * 16 + d * 16);
        for (int r = 0; r < PR; r++) {
            int32_t pair;
            memcpy(&pair, q + (int64_t)r * D + d, sizeof(pair));
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < KV; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, k[c]);
        }
    }
    for (int r = 0; r < PR; r++)
        for (int c = 0; c < KV; c++) _mm512_storeu_ps(s + r * BK + 16 * (c0 + c), acc[r][c]);
}

// o[r][d0..d0 + 16 NV) = o[r] * alpha[r] + the block's weights p[r] (bfloat16) . its values
// (bfloat16 pairs of keys), PR rows: a key pair per multiply-add
static inline __attribute__((always_inline)) void pair_value_pass(const int NV, const uint16_t *p, const float *alpha,
                                                                 const uint16_t *values, int Dv, int d0, float *o) {
    __m512 acc[PR][VV];
    for (int r = 0; r < PR; r++)
        for (int c = 0; c < NV; c++)
            acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)r * Dv + d0 + 16 * c), _mm512_set1_ps(alpha[r]));
    for (int j = 0; j < BK; j += 2) {
        __m512bh v[VV];
        for (int c = 0; c < NV; c++)
            v[c] = (__m512bh)_mm512_loadu_si512(values + (int64_t)(j / 2) * Dv * 2 + (d0 + 16 * c) * 2);
        for (int r = 0; r < PR; r++) {
            int32_t pair;
            memcpy(&pair, p + r * BK + j, sizeof(pair));
            const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < NV; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, v[c]);
        }
    }
    for (int r = 0; r < PR; r++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(o + (int64_t)r * Dv + d0 + 16 * c, acc[r][c]);
}

// PR rows (q in bfloat16) against key block kb with the bfloat16 dot product (Dv a multiple of 16)
static void pair_tile(const seq_t *a, const uint16_t *keys, const uint16_t *values, int64_t kb, const int64_t *pos,
                      const uint16_t *q, float *o, float *m, float *l, float *s, uint16_t *p) {
    const int D = a->D, Dv = a->Dv;
    float alpha[16];
    for (int c0 = 0; c0 < BK / 16; c0 += KV) pair_score_pass(q, D, keys, c0, s);
    block_weights(s, PR, pos, kb * BK, a->scale2, m, l, alpha);
    weights_to_bf16(s, PR, p);
    int d0 = 0;
    for (; d0 + 16 * VV <= Dv; d0 += 16 * VV) pair_value_pass(VV, p, alpha, values, Dv, d0, o);
    for (; d0 < Dv; d0 += 16) pair_value_pass(1, p, alpha, values, Dv, d0, o);
}
#endif

#if SHARDLM_AMX
static void amx_configure_prefill(void) {
    tile_config_t c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

// The scores of 16 rows (q in bfloat16) against key block kb on the AMX tiles, into s (16 x BK):
// 16 keys in each of tiles 0-3, q in tile 4, the keys in 5-7 in turn (a load need not wait for the
// product before it to finish reading its tile)
static void amx_scores(const uint16_t *q, const uint16_t *keys, int D, float *s) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k0 = 0; k0 < D; k0 += 32) {
        _tile_loadd(4, q + k0, D * 2);
        _tile_loadd(5, keys + k0 * 16, 64);
        _tile_loadd(6, keys + D * 16 + k0 * 16, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(7, keys + 2 * D * 16 + k0 * 16, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, keys + 3 * D * 16 + k0 * 16, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, s, BK * 4);
    _tile_stored(1, s + 16, BK * 4);
    _tile_stored(2, s + 32, BK * 4);
    _tile_stored(3, s + 48, BK * 4);
}

// 16 rows' scores s -> their weights in bfloat16 (p, 16 x BK), and their sums o rescaled
static void amx_weights(const seq_t *a, float *s, int64_t kb, const int64_t *pos, float *m, float *l, uint16_t *p,
                        float *o) {
    const int Dv = a->Dv;
    float alpha[16];
    block_weights(s, 16, pos, kb * BK, a->scale2, m, l, alpha);
    weights_to_bf16(s, 16, p);
    for (int r = 0; r < 16; r++) {
        if (alpha[r] != 1.f)
            for (int d = 0; d < Dv; d += 16)
                _mm512_storeu_ps(o + (int64_t)r * Dv + d, _mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)r * Dv + d),
                                                                        _mm512_set1_ps(alpha[r])));
    }
}

// o (16 x Dv) += p (16 x BK weights in bfloat16) . the block's values on the AMX tiles: p in tiles
// 6-7 (32 keys each), o 64 values at a time in tiles 0-3, the values in 4-5 in turn
static void amx_values(const uint16_t *p, const uint16_t *values, int Dv, float *o) {
    _tile_loadd(6, p, BK * 2);
    _tile_loadd(7, p + 32, BK * 2);
    const int64_t second = (int64_t)16 * Dv * 2;      // the pairs of keys 32..63
    int d = 0;
    for (; d + 64 <= Dv; d += 64) {
        _tile_loadd(0, o + d, Dv * 4);
        _tile_loadd(1, o + d + 16, Dv * 4);
        _tile_loadd(2, o + d + 32, Dv * 4);
        _tile_loadd(3, o + d + 48, Dv * 4);
        _tile_loadd(4, values + d * 2, Dv * 4);
        _tile_loadd(5, values + (d + 16) * 2, Dv * 4);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(1, 6, 5);
        _tile_loadd(4, values + (d + 32) * 2, Dv * 4);
        _tile_loadd(5, values + (d + 48) * 2, Dv * 4);
        _tile_dpbf16ps(2, 6, 4);
        _tile_dpbf16ps(3, 6, 5);
        _tile_loadd(4, values + second + d * 2, Dv * 4);
        _tile_loadd(5, values + second + (d + 16) * 2, Dv * 4);
        _tile_dpbf16ps(0, 7, 4);
        _tile_dpbf16ps(1, 7, 5);
        _tile_loadd(4, values + second + (d + 32) * 2, Dv * 4);
        _tile_loadd(5, values + second + (d + 48) * 2, Dv * 4);
        _tile_dpbf16ps(2, 7, 4);
        _tile_dpbf16ps(3, 7, 5);
        _tile_stored(0, o + d, Dv * 4);
        _tile_stored(1, o + d + 16, Dv * 4);
        _tile_stored(2, o + d + 32, Dv * 4);
        _tile_stored(3, o + d + 48, Dv * 4);
    }
    for (; d < Dv; d += 16) {
        _tile_loadd(0, o + d, Dv * 4);
        _tile_loadd(4, values + d * 2, Dv * 4);
        _tile_loadd(5, values + second + d * 2, Dv * 4);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(0, 7, 5);
        _tile_stored(0, o + d, Dv * 4);
    }
}
#endif

// Query positions i0..i0 + n of KV head h: rows (position, head of the group), padded to a whole
// number of tiles of `tile` rows by repeating the last; each tile against the key blocks up to its
// last position, block-major so a block's keys are read from cache by every tile in turn
static void attend_task(const seq_t *a, int h, int64_t i0, int n, const void *keys, const void *values, int tiles,
                        scratch_t *w) {
    const int G = a->G, D = a->D, Dv = a->Dv, tile = tiles == AMX_TILES ? 16 : PR;
    const int rows = n * G, padded = (rows + tile - 1) / tile * tile;
    for (int r = 0; r < padded; r++) {
        const int rr = r < rows ? r : rows - 1;
        const int64_t i = i0 + rr / G, head = (int64_t)h * G + rr % G;
        const char *src = (const char *)a->q + (a->token_index[(int64_t)a->b * a->width + i] * a->q_stride + head * D)
                                               * (a->dtype ? 2 : 4);
        w->pos[r] = a->start + i;
        if (tiles != FLOAT_TILES) memcpy((uint16_t *)w->q + (int64_t)r * D, src, sizeof(uint16_t) * D);
        else load_row(src, 0, D, a->dtype, w->q + (int64_t)r * D);
        w->m[r] = -INFINITY;
        w->l[r] = 0.f;
    }
    memset(w->o, 0, sizeof(float) * padded * Dv);
    const int64_t blocks = w->pos[padded - 1] / BK + 1;
    for (int64_t kb = 0; kb < blocks; kb++) {
        // the tiles with a row at or past the block's first key (the others: above the diagonal)
        int first = 0;
        while (kb * BK > w->pos[first + tile - 1]) first += tile;
#if SHARDLM_AMX
        if (tiles == AMX_TILES) {   // each phase over every tile, so that a tile's stores are done before it is read
            const uint16_t *kp = (const uint16_t *)keys + kb * BK * D, *vp = (const uint16_t *)values + kb * BK * Dv;
            for (int t = first; t < padded; t += 16)
                amx_scores((const uint16_t *)w->q + (int64_t)t * D, kp, D, w->s + t * BK);
            for (int t = first; t < padded; t += 16)
                amx_weights(a, w->s + t * BK, kb, w->pos + t, w->m + t, w->l + t, w->p + t * BK, w->o + (int64_t)t * Dv);
            for (int t = first; t < padded; t += 16) amx_values(w->p + t * BK, vp, Dv, w->o + (int64_t)t * Dv);
            continue;
        }
#endif
#if defined(__AVX512BF16__)
        if (tiles == BF16_DOT_TILES) {
            const uint16_t *kp = (const uint16_t *)keys + kb * BK * D, *vp = (const uint16_t *)values + kb * BK * Dv;
            for (int t = first; t < padded; t += tile)
                pair_tile(a, kp, vp, kb, w->pos + t, (const uint16_t *)w->q + (int64_t)t * D, w->o + (int64_t)t * Dv,
                          w->m + t, w->l + t, w->s, w->p);
            continue;
        }
#endif
        for (int t = first; t < padded; t += tile)
            float_tile(a, (const float *)keys + kb * BK * D, (const float *)values + kb * BK * Dv, kb, w->pos + t,
                       w->q + (int64_t)t * D, w->o + (int64_t)t * Dv, w->m + t, w->l + t, w->s);
    }
    for (int r = 0; r < rows; r++) {
        const int64_t i = i0 + r / G, head = (int64_t)h * G + r % G, out_row = (int64_t)a->b * a->width + i;
        const float inv = 1.f / w->l[r];
        for (int d = 0; d < Dv; d++)
            store(a->out, (out_row * a->H + head) * Dv + d, w->o[(int64_t)r * Dv + d] * inv, a->dtype);
        if (a->lse) a->lse[out_row * a->H + head] = (w->m[r] + log2f(w->l[r])) * (float)M_LN2;
    }
}

static int alloc_scratch(scratch_t *w, int rows, int D, int Dv) {
    w->q = (float *)malloc(sizeof(float) * rows * D);
    w->o = (float *)malloc(sizeof(float) * rows * Dv);
    w->s = (float *)malloc(sizeof(float) * rows * BK);
    w->p = (uint16_t *)malloc(sizeof(uint16_t) * rows * BK);
    w->m = (float *)malloc(sizeof(float) * rows * 2);
    w->pos = (int64_t *)malloc(sizeof(int64_t) * rows);
    w->l = w->m ? w->m + rows : NULL;
    return w->q && w->o && w->s && w->p && w->m && w->pos;
}

static void free_scratch(scratch_t *w) {
    free(w->q), free(w->o), free(w->s), free(w->p), free(w->m), free(w->pos);
}

KERNEL_API int paged_prefill_attention(void *out, const void *q, int64_t q_stride, const int64_t *token_index,
                                       int width, const int64_t *starts, const int64_t *contexts,
                                       const void *k_cache, const void *v_cache, const int64_t *block_tables,
                                       int max_blocks, int B, int H, int Hkv, int D, int Dv, int num_blocks,
                                       int block_size, float scale, int dtype, int kv_format, float k_scale,
                                       float v_scale, float *lse) {
    const int G = H / Hkv, cdt = cache_type(kv_format, dtype), positions = TASK_ROWS / G > 0 ? TASK_ROWS / G : 1;
    int tiles = FLOAT_TILES;
#if defined(__AVX512BF16__)
    if (dtype == 1 && cdt == 1 && D % 2 == 0 && Dv % 16 == 0 && shardlm_bf16_dot) tiles = BF16_DOT_TILES;
#endif
#if SHARDLM_AMX
    if (dtype == 1 && cdt == 1 && D % 32 == 0 && Dv % 16 == 0 && amx_permitted()) tiles = AMX_TILES;
#endif
    const size_t esize = tiles == FLOAT_TILES ? sizeof(float) : sizeof(uint16_t);
    int64_t max_ctx = 0;
    for (int b = 0; b < B; b++) if (contexts[b] > max_ctx) max_ctx = contexts[b];
    const int64_t max_blocks_of_keys = (max_ctx + BK - 1) / BK;
    // each KV head's packed keys, then its values
    char *packed = (char *)malloc(esize * (size_t)Hkv * (size_t)(max_blocks_of_keys * BK) * (size_t)(D + Dv));
    if (!packed) return -1;
    int failed = 0;
    for (int b = 0; b < B; b++) {
        const seq_t a = {q, k_cache, v_cache, token_index, block_tables + (int64_t)b * max_blocks, q_stride,
                         (int64_t)num_blocks * block_size, starts[b], contexts[b], contexts[b] - starts[b], width, b, H,
                         G, D, Dv, block_size, dtype, cdt, scale * (float)M_LOG2E, cache_multiplier(cdt, k_scale),
                         cache_multiplier(cdt, v_scale), out, lse};
        if (a.queries <= 0) continue;
        const int64_t key_blocks = (a.ctx + BK - 1) / BK, head_keys = key_blocks * BK * D;
        const int64_t head_bytes = esize * key_blocks * BK * (D + Dv);
        #pragma omp parallel for schedule(static)
        for (int64_t job = 0; job < Hkv * key_blocks; job++) {
            const int h = (int)(job / key_blocks);
            const int64_t kb = job % key_blocks;
            char *keys = packed + h * head_bytes, *values = keys + esize * head_keys;
#if defined(__AVX512BF16__)
            if (tiles != FLOAT_TILES) {
                pack_pairs_block(&a, h, kb, (uint16_t *)keys + kb * BK * D, (uint16_t *)values + kb * BK * Dv);
                continue;
            }
#endif
            pack_float_block(&a, h, kb, (float *)keys + kb * BK * D, (float *)values + kb * BK * Dv);
        }
        const int64_t query_blocks = (a.queries + positions - 1) / positions;
        #pragma omp parallel
        {
            scratch_t w;
            const int ok = alloc_scratch(&w, positions * G + 16, D, Dv);
            if (!ok) {
                #pragma omp atomic write
                failed = 1;
            }
#if SHARDLM_AMX
            if (tiles == AMX_TILES) amx_configure_prefill();
#endif
            // the latest positions (the most keys) first
            #pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < Hkv * query_blocks; task++) {
                if (!ok) continue;
                const int h = (int)(task % Hkv);
                const int64_t i0 = (query_blocks - 1 - task / Hkv) * positions;
                const int n = a.queries - i0 < positions ? (int)(a.queries - i0) : positions;
                const char *keys = packed + h * head_bytes;
                attend_task(&a, h, i0, n, keys, keys + esize * head_keys, tiles, &w);
            }
#if SHARDLM_AMX
            if (tiles == AMX_TILES) _tile_release();
#endif
            free_scratch(&w);
        }
        if (failed) break;
    }
    free(packed);
    return failed ? -1 : 0;
}
