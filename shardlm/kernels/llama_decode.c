// The decode step of a pipeline stage's Llama decoder layers in one C call, on CPU, for one
// tensor parallel rank (of one or more): each layer is add + RMSNorm, the qkv product, rotary + cache write +
// attention, the output product, add + RMSNorm, the gate/up product, SiLU-and-mul and the down
// product -- the same kernels, in the same order, as the layer-by-layer path (so the same
// results, bit for bit), without the Python and operator dispatch between them, which at a few
// rows costs more than the arithmetic.
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"
#include "shardlm_kernels.h"

// Per layer, the addresses of (in this order): input norm weight, qkv weight, qkv bias, o weight,
// o bias, post-attention norm weight, gate_up weight, gate_up bias, down weight, down bias,
// K cache, V cache. A bias address of 0 means none.
enum { IN_NORM, QKV_W, QKV_B, O_W, O_B, POST_NORM, GATE_UP_W, GATE_UP_B, DOWN_W, DOWN_B, K_CACHE, V_CACHE, NPTR };

// The product with a layer's weight: plain for the skinny kernel (kind 0), in blocked_matmul's
// float panels (1), its 4-bit ones (2) or its 8-bit ones (3; group: input columns per scale, 0 for
// one scale per row; tb: bytes per table entry).
static int matmul(int kind, int group, int tb, const void *x, int64_t x_stride, const void *w, const void *bias,
                  void *y, int M, int N, int K, int dtype) {
    if (group == 0) group = K;
    if (kind == 2) return blocked_int4_matmul(x, x_stride, w, bias, y, M, N, K, group, tb, dtype);
    if (kind == 3) return blocked_int8_matmul(x, x_stride, w, bias, y, M, N, K, group, tb, dtype);
    return kind == 1 ? blocked_matmul(x, x_stride, w, bias, y, M, N, K, dtype)
                     : skinny_matmul(x, x_stride, w, bias, y, M, N, K, dtype);
}

#define P(l, i) ((void *)(intptr_t)layers[(int64_t)(l) * NPTR + (i)])

// LoRA: the step's rows [start, end) of each segment run on one adapter; per segment and layer the
// addresses of its A and B for (in this order) qkv, o, gate_up, down, in blocked_matmul's float
// panels (0: the adapter leaves that linear alone).
enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, NLORA };
#define LA(g, l, i) ((void *)(intptr_t)lora[((int64_t)(g) * L + (l)) * 2 * NLORA + 2 * (i)])
#define LB(g, l, i) ((void *)(intptr_t)lora[((int64_t)(g) * L + (l)) * 2 * NLORA + 2 * (i) + 1])

// y [M, N] += B (A x) for rows x: A [w, K], B [N, w] in float panels; the delta is rounded to dtype
// and then added, as the layer-by-layer path does it (lora/layers.py: LoRASlots._add_one).
static int lora_add(const void *x, int64_t x_stride, const void *a, const void *b, void *y, int M, int N, int K,
                    int w, void *xa, void *delta, int dtype) {
    if (!a) return 0;
    if (blocked_matmul(x, x_stride, a, NULL, xa, M, w, K, dtype)) return -1;
    if (blocked_matmul(xa, w, b, NULL, delta, M, N, w, dtype)) return -1;
    for (int64_t i = 0; i < (int64_t)M * N; i++) store(y, i, load(y, i, dtype) + load(delta, i, dtype), dtype);
    return 0;
}

typedef struct {
    const int64_t *lora, *segments;
    int num_segments, L;
    void *xa, *delta;     // work buffers
    int dtype;
} LoraStep;

// Each segment's delta for linear `which` of layer l: rows of x [T, K] (row stride xs) into y [T, N].
static int lora_segments(const LoraStep *s, int l, int which, const void *x, int64_t xs, void *y, int N, int K,
                         int w) {
    const int esize = s->dtype == 0 ? 4 : 2, L = s->L;
    const int64_t *lora = s->lora;
    for (int g = 0; g < s->num_segments; g++) {
        const int64_t first = s->segments[2 * g], rows = s->segments[2 * g + 1] - first;
        if (lora_add((const char *)x + first * xs * esize, xs, LA(g, l, which), LB(g, l, which),
                     (char *)y + first * N * esize, (int)rows, N, K, w, s->xa, s->delta, s->dtype))
            return -1;
    }
    return 0;
}

// Decode context parallel: the values, in this order, of the DCP group's size and this rank's
// place in it; the exchange callback (phase 0: q_all <- every rank's q rows of qkv; phase 1:
// every <- every rank's send; nonzero if it failed); the addresses of q_all [T, N H D] and
// partial [T, N H D] (dtype), lse [T, N H], send [T, N H (D + 1)] and every [N, T, N H (D + 1)]
// (float32).
enum { DCP_SIZE, DCP_RANK, DCP_EXCHANGE, DCP_Q_ALL, DCP_PARTIAL, DCP_LSE, DCP_SEND, DCP_EVERY, DCP_N };
typedef int (*exchange_fn)(int phase);
#define DA(i) ((void *)(intptr_t)dcp[i])

// One layer's attention under decode context parallel, after rotary_cache_write: the group's
// query heads against this rank's share of each context, the partial outputs exchanged and
// merged into attn [T, H * D] (this rank's heads), as the layer-by-layer path does it
// (layers/attention.py). Returns -1 if a work buffer could not be allocated, -2 if an exchange failed.
static int dcp_attention(const int64_t *dcp, void *attn, void *k_cache, void *v_cache, const int64_t *block_tables,
                         const int64_t *context_lens, int T, int H, int Hkv, int D, int num_blocks, int block_size,
                         int max_blocks, float scale, int dtype) {
    const int N = (int)dcp[DCP_SIZE], Hall = N * H;
    const int64_t W = (int64_t)Hall * (D + 1);
    const exchange_fn exchange = (exchange_fn)DA(DCP_EXCHANGE);
    float *lse = DA(DCP_LSE), *send = DA(DCP_SEND);
    if (exchange(0)) return -2;
    if (paged_decode_attention(DA(DCP_PARTIAL), DA(DCP_Q_ALL), (int64_t)Hall * D, k_cache, v_cache, block_tables,
                               context_lens, T, Hall, Hkv, D, num_blocks, block_size, max_blocks, scale, dtype, lse))
        return -1;
    for (int t = 0; t < T; t++) {
        for (int64_t i = 0; i < (int64_t)Hall * D; i++) send[t * W + i] = load(DA(DCP_PARTIAL), t * (int64_t)Hall * D + i, dtype);
        memcpy(send + t * W + (int64_t)Hall * D, lse + (int64_t)t * Hall, sizeof(float) * Hall);
    }
    if (exchange(1)) return -2;
    merge_attention_partials(DA(DCP_EVERY), N, T, Hall, D, (int)dcp[DCP_RANK] * H, H, attn, dtype);
    return 0;
}

// hidden, residual [T, E] in place: on entry the stage's input (has_residual = 0: the first
// stage's embeddings, residual unset), on exit the last layer's output and the running residual.
// scratch: T * ((H + 2 Hkv) * D + H * D + 3 * I) elements. H, Hkv and I are this rank's.
// all_reduce (NULL with one tensor parallel rank): sums hidden over the ranks in place, after each
// row-parallel product (output and down; they have no bias then), as the layer-by-layer path does;
// nonzero if it failed.
// lora (NULL: none): the adapters' table (above) for the num_segments segments [start, end) in
// segments, of rank R (their shards' ranks, zero-padded); scratch then holds T * (3 R + max(Q, E,
// 2 I)) elements more.
// dcp (NULL: none): decode context parallel (above).
// Returns -1 if a work buffer could not be allocated, -2 if an all-reduce or exchange failed.
KERNEL_API int llama_decode_layers(const int64_t *layers, int L, void *hidden, void *residual, int has_residual,
                        const void *cos, const void *signed_sin, const int64_t *slot_mapping,
                        const int64_t *block_tables, const int64_t *context_lens, int T, int E, int H, int Hkv,
                        int D, int I, int num_blocks, int block_size, int max_blocks, float scale, float eps,
                        int dtype, int kind, int group, int tb, void *scratch, int (*all_reduce)(void),
                        const int64_t *lora, const int64_t *segments, int num_segments, int R, const int64_t *dcp) {
    const int esize = dtype == 0 ? 4 : 2, Q = (H + 2 * Hkv) * D;
    char *qkv = (char *)scratch, *attn = qkv + (int64_t)T * Q * esize, *gate_up = attn + (int64_t)T * H * D * esize;
    char *act = gate_up + (int64_t)T * 2 * I * esize;
    char *xa = act + (int64_t)T * I * esize, *delta = xa + (int64_t)T * 3 * R * esize;
    const LoraStep ls = {lora, segments, num_segments, L, xa, delta, dtype};
    for (int l = 0; l < L; l++) {
        if (l == 0 && !has_residual) {
            memcpy(residual, hidden, (size_t)T * E * esize);
            add_rmsnorm(hidden, E, NULL, NULL, hidden, P(l, IN_NORM), T, E, eps, dtype);
        } else {
            add_rmsnorm(hidden, E, residual, residual, hidden, P(l, IN_NORM), T, E, eps, dtype);
        }
        if (matmul(kind, group, tb, hidden, E, P(l, QKV_W), P(l, QKV_B), qkv, T, Q, E, dtype)) return -1;
        if (lora && lora_segments(&ls, l, LORA_QKV, hidden, E, qkv, Q, E, 3 * R)) return -1;
        if (dcp) {
            rotary_cache_write(qkv, Q, cos, signed_sin, P(l, K_CACHE), P(l, V_CACHE), slot_mapping, T, H, Hkv, D,
                               num_blocks, block_size, dtype);
            const int rc = dcp_attention(dcp, attn, P(l, K_CACHE), P(l, V_CACHE), block_tables, context_lens, T, H,
                                         Hkv, D, num_blocks, block_size, max_blocks, scale, dtype);
            if (rc) return rc;
        } else if (paged_decode_attention_qkv(attn, qkv, Q, cos, signed_sin, P(l, K_CACHE), P(l, V_CACHE),
                                              slot_mapping, block_tables, context_lens, T, H, Hkv, D, num_blocks,
                                              block_size, max_blocks, scale, dtype)) {
            return -1;
        }
        if (matmul(kind, group, tb, attn, H * D, P(l, O_W), P(l, O_B), hidden, T, E, H * D, dtype)) return -1;
        if (lora && lora_segments(&ls, l, LORA_O, attn, H * D, hidden, E, H * D, R)) return -1;
        if (all_reduce && all_reduce()) return -2;
        add_rmsnorm(hidden, E, residual, residual, hidden, P(l, POST_NORM), T, E, eps, dtype);
        if (matmul(kind, group, tb, hidden, E, P(l, GATE_UP_W), P(l, GATE_UP_B), gate_up, T, 2 * I, E, dtype)) return -1;
        if (lora && lora_segments(&ls, l, LORA_GATE_UP, hidden, E, gate_up, 2 * I, E, 2 * R)) return -1;
        silu_and_mul(gate_up, act, T, I, dtype);
        if (matmul(kind, group, tb, act, I, P(l, DOWN_W), P(l, DOWN_B), hidden, T, E, I, dtype)) return -1;
        if (lora && lora_segments(&ls, l, LORA_DOWN, act, I, hidden, E, I, R)) return -1;
        if (all_reduce && all_reduce()) return -2;
    }
    return 0;
}
