// The decode step of a pipeline stage's Llama decoder layers in one C call, on CPU, for one
// tensor parallel rank (of one or more): each layer is add + RMSNorm, the qkv product, rotary + cache write +
// attention, the output product, add + RMSNorm, the gate/up product, SiLU-and-mul and the down
// product -- the same kernels, in the same order, as the layer-by-layer path (so the same
// results, bit for bit), without the Python and operator dispatch between them, which at a few
// rows costs more than the arithmetic.
#include <stdint.h>
#include <string.h>

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

// hidden, residual [T, E] in place: on entry the stage's input (has_residual = 0: the first
// stage's embeddings, residual unset), on exit the last layer's output and the running residual.
// scratch: T * ((H + 2 Hkv) * D + H * D + 3 * I) elements. H, Hkv and I are this rank's.
// all_reduce (NULL with one tensor parallel rank): sums hidden over the ranks in place, after each
// row-parallel product (output and down; they have no bias then), as the layer-by-layer path does;
// nonzero if it failed.
// Returns -1 if a work buffer could not be allocated, -2 if an all-reduce failed.
KERNEL_API int llama_decode_layers(const int64_t *layers, int L, void *hidden, void *residual, int has_residual,
                        const void *cos, const void *signed_sin, const int64_t *slot_mapping,
                        const int64_t *block_tables, const int64_t *context_lens, int T, int E, int H, int Hkv,
                        int D, int I, int num_blocks, int block_size, int max_blocks, float scale, float eps,
                        int dtype, int kind, int group, int tb, void *scratch, int (*all_reduce)(void)) {
    const int esize = dtype == 0 ? 4 : 2, Q = (H + 2 * Hkv) * D;
    char *qkv = (char *)scratch, *attn = qkv + (int64_t)T * Q * esize, *gate_up = attn + (int64_t)T * H * D * esize;
    char *act = gate_up + (int64_t)T * 2 * I * esize;
    for (int l = 0; l < L; l++) {
        if (l == 0 && !has_residual) {
            memcpy(residual, hidden, (size_t)T * E * esize);
            add_rmsnorm(hidden, E, NULL, NULL, hidden, P(l, IN_NORM), T, E, eps, dtype);
        } else {
            add_rmsnorm(hidden, E, residual, residual, hidden, P(l, IN_NORM), T, E, eps, dtype);
        }
        if (matmul(kind, group, tb, hidden, E, P(l, QKV_W), P(l, QKV_B), qkv, T, Q, E, dtype)) return -1;
        if (paged_decode_attention_qkv(attn, qkv, Q, cos, signed_sin, P(l, K_CACHE), P(l, V_CACHE), slot_mapping,
                                       block_tables, context_lens, T, H, Hkv, D, num_blocks, block_size,
                                       max_blocks, scale, dtype))
            return -1;
        if (matmul(kind, group, tb, attn, H * D, P(l, O_W), P(l, O_B), hidden, T, E, H * D, dtype)) return -1;
        if (all_reduce && all_reduce()) return -2;
        add_rmsnorm(hidden, E, residual, residual, hidden, P(l, POST_NORM), T, E, eps, dtype);
        if (matmul(kind, group, tb, hidden, E, P(l, GATE_UP_W), P(l, GATE_UP_B), gate_up, T, 2 * I, E, dtype)) return -1;
        silu_and_mul(gate_up, act, T, I, dtype);
        if (matmul(kind, group, tb, act, I, P(l, DOWN_W), P(l, DOWN_B), hidden, T, E, I, dtype)) return -1;
        if (all_reduce && all_reduce()) return -2;
    }
    return 0;
}
