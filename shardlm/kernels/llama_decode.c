// The decode step of a pipeline stage's Llama decoder layers in one C call, on CPU, for one
// tensor parallel rank (of one or more): each layer is add + RMSNorm, the qkv product (and q/k norms), rotary + cache write +
// attention, the output product, add + RMSNorm, the gate/up product, SiLU-and-mul and the down
// product -- the same kernels, in the same order, as the layer-by-layer path (so the same
// results, bit for bit), without the Python and operator dispatch between them, which at a few
// rows costs more than the arithmetic.
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"
#include "shardlm_kernels.h"

// The product with a layer's weight in the model's layout (shardlm_kernels.h).
static int matmul(const LlamaDecodeModel *m, const void *x, int64_t x_stride, const void *w, const void *bias,
                  void *y, int M, int N, int K) {
    const int group = m->group == 0 ? K : m->group, dtype = m->dtype;
    switch (m->layout) {
    case DECODE_BLOCKED_INT4: return blocked_int4_matmul(x, x_stride, w, bias, y, M, N, K, group, m->table_bytes, dtype);
    case DECODE_BLOCKED_INT8: return blocked_int8_matmul(x, x_stride, w, bias, y, M, N, K, group, m->table_bytes, dtype);
    case DECODE_BLOCKED_FP8: return blocked_fp8_matmul(x, x_stride, w, bias, y, M, N, K, group, dtype);
    case DECODE_BLOCKED: return blocked_matmul(x, x_stride, w, bias, y, M, N, K, dtype);
    default: return skinny_matmul(x, x_stride, w, bias, y, M, N, K, dtype);
    }
}

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
    const LlamaDecodeLora *lora;
    int layers, dtype;
    void *xa, *delta;     // work buffers
} LoraStep;

enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN };

// The A and B panels of one of a layer's linears.
static void lora_panels(const LlamaDecodeLoraLayer *p, int which, const void **a, const void **b) {
    switch (which) {
    case LORA_QKV: *a = p->qkv_a, *b = p->qkv_b; break;
    case LORA_O: *a = p->o_a, *b = p->o_b; break;
    case LORA_GATE_UP: *a = p->gate_up_a, *b = p->gate_up_b; break;
    default: *a = p->down_a, *b = p->down_b;
    }
}

// Each segment's delta for one linear of layer l: rows of x [T, K] (row stride xs) into y [T, N].
static int lora_segments(const LoraStep *s, int l, int which, const void *x, int64_t xs, void *y, int N, int K,
                         int w) {
    const int esize = s->dtype == 0 ? 4 : 2;
    for (int g = 0; g < s->lora->num_segments; g++) {
        const int64_t first = s->lora->segments[2 * g], rows = s->lora->segments[2 * g + 1] - first;
        const void *a, *b;
        lora_panels(&s->lora->panels[(int64_t)g * s->layers + l], which, &a, &b);
        if (lora_add((const char *)x + first * xs * esize, xs, a, b, (char *)y + first * N * esize, (int)rows,
                     N, K, w, s->xa, s->delta, s->dtype))
            return -1;
    }
    return 0;
}

// One layer's attention under decode context parallel, after rotary_cache_write: the group's
// query heads against this rank's share of each context, the partial outputs exchanged and
// merged into attn [T, H * D] (this rank's heads), as the layer-by-layer path does it
// (layers/attention.py). Returns -1 if a work buffer could not be allocated, -2 if an exchange failed.
static int dcp_attention(const LlamaDecodeContextParallel *cp, const LlamaDecodeModel *m, const LlamaDecodeStep *st,
                         const LlamaDecodeLayer *layer, void *attn) {
    const int N = cp->size, T = st->tokens, H = m->heads, D = m->head_dim, Hall = N * H;
    const int64_t W = (int64_t)Hall * (D + 1);
    if (cp->exchange(0)) return -2;
    if (paged_decode_attention(cp->partial, cp->q_all, (int64_t)Hall * D, layer->k_cache, layer->v_cache,
                               st->block_tables, st->context_lens, T, Hall, m->kv_heads, D, m->num_blocks,
                               m->block_size, (int)st->max_blocks, m->scale, m->dtype, m->kv_format, layer->k_scale,
                               layer->v_scale, cp->lse))
        return -1;
    for (int t = 0; t < T; t++) {
        for (int64_t i = 0; i < (int64_t)Hall * D; i++)
            cp->send[t * W + i] = load(cp->partial, t * (int64_t)Hall * D + i, m->dtype);
        memcpy(cp->send + t * W + (int64_t)Hall * D, cp->lse + (int64_t)t * Hall, sizeof(float) * Hall);
    }
    if (cp->exchange(1)) return -2;
    merge_attention_partials(cp->every, N, T, Hall, D, cp->rank * H, H, attn, m->dtype);
    return 0;
}

// A branch's output times the residual multiplier (Granite), rounded as torch's product is.
static void scale_branch(void *x, int64_t n, float multiplier, int dtype) {
    if (multiplier == 1.f) return;
    for (int64_t i = 0; i < n; i++) store(x, i, load(x, i, dtype) * multiplier, dtype);
}

// An RMSNorm over each q head and each k head of qkv [T, Q], in place (before the rotary embedding).
static void qk_norm(void *qkv, int Q, const LlamaDecodeLayer *w, int T, int H, int Hkv, int D, float eps, int dtype) {
    const int esize = dtype == 0 ? 4 : 2;
    for (int t = 0; t < T; t++) {
        char *q = (char *)qkv + (int64_t)t * Q * esize, *k = q + (int64_t)H * D * esize;
        add_rmsnorm(q, D, NULL, NULL, q, w->q_norm, H, D, eps, dtype);
        add_rmsnorm(k, D, NULL, NULL, k, w->k_norm, Hkv, D, eps, dtype);
    }
}

// Scratch, in order: qkv [T, Q], attn [T, H D], gate_up [T, 2 I], act [T, I]; with LoRA, xa
// [T, 3 R] and delta [T, max(Q, E, 2 I)].
KERNEL_API int64_t llama_decode_scratch_elements(const LlamaDecodeModel *m, int32_t tokens, int32_t lora_rank) {
    const int64_t Q = (int64_t)(m->heads + 2 * m->kv_heads) * m->head_dim, E = m->hidden_size, I = m->intermediate;
    int64_t per_row = Q + (int64_t)m->heads * m->head_dim + 3 * I;
    if (lora_rank > 0) {
        const int64_t widest = Q > E ? (Q > 2 * I ? Q : 2 * I) : (E > 2 * I ? E : 2 * I);
        per_row += 3 * (int64_t)lora_rank + widest;
    }
    return tokens * per_row;
}

// hidden, residual [T, E] in place: on entry the stage's input (has_residual = 0: the first
// stage's embeddings, residual unset), on exit the last layer's output and the running residual.
// all_reduce sums hidden over the tensor parallel ranks in place after each row-parallel product
// (output and down; they have no bias then), as the layer-by-layer path does.
KERNEL_API int32_t llama_decode_layers(const LlamaDecodeModel *m, const LlamaDecodeLayer *layers,
                                       const LlamaDecodeStep *st, const LlamaDecodeLora *lora,
                                       const LlamaDecodeContextParallel *dcp) {
    const int T = st->tokens, E = m->hidden_size, H = m->heads, Hkv = m->kv_heads, D = m->head_dim;
    const int I = m->intermediate, dtype = m->dtype, esize = dtype == 0 ? 4 : 2, Q = (H + 2 * Hkv) * D;
    const int R = lora ? lora->rank : 0;
    char *qkv = (char *)st->scratch, *attn = qkv + (int64_t)T * Q * esize, *gate_up = attn + (int64_t)T * H * D * esize;
    char *act = gate_up + (int64_t)T * 2 * I * esize;
    char *xa = act + (int64_t)T * I * esize, *delta = xa + (int64_t)T * 3 * R * esize;
    const LoraStep ls = {lora, m->layers, dtype, xa, delta};
    void *hidden = st->hidden, *residual = st->residual;
    for (int l = 0; l < m->layers; l++) {
        const LlamaDecodeLayer *w = &layers[l];
        if (l == 0 && !st->has_residual) {
            memcpy(residual, hidden, (size_t)T * E * esize);
            add_rmsnorm(hidden, E, NULL, NULL, hidden, w->input_norm, T, E, m->eps, dtype);
        } else {
            add_rmsnorm(hidden, E, residual, residual, hidden, w->input_norm, T, E, m->eps, dtype);
        }
        if (matmul(m, hidden, E, w->qkv_weight, w->qkv_bias, qkv, T, Q, E)) return -1;
        if (lora && lora_segments(&ls, l, LORA_QKV, hidden, E, qkv, Q, E, 3 * R)) return -1;
        if (w->q_norm) qk_norm(qkv, Q, w, T, H, Hkv, D, m->eps, dtype);
        const void *cos = w->rope ? st->cos : NULL;
        if (dcp) {
            rotary_cache_write(qkv, Q, cos, st->signed_sin, w->k_cache, w->v_cache, st->slot_mapping, T, H, Hkv, D,
                               m->num_blocks, m->block_size, dtype, m->kv_format, w->k_scale, w->v_scale);
            const int rc = dcp_attention(dcp, m, st, w, attn);
            if (rc) return rc;
        } else if (paged_decode_attention_qkv(attn, qkv, Q, cos, st->signed_sin, w->k_cache, w->v_cache,
                                              st->slot_mapping, st->block_tables, st->context_lens, T, H, Hkv, D,
                                              m->num_blocks, m->block_size, (int)st->max_blocks, m->scale, dtype,
                                              m->kv_format, w->k_scale, w->v_scale)) {
            return -1;
        }
        if (matmul(m, attn, H * D, w->o_weight, w->o_bias, hidden, T, E, H * D)) return -1;
        if (lora && lora_segments(&ls, l, LORA_O, attn, H * D, hidden, E, H * D, R)) return -1;
        if (st->all_reduce && st->all_reduce()) return -2;
        scale_branch(hidden, (int64_t)T * E, m->residual_multiplier, dtype);
        add_rmsnorm(hidden, E, residual, residual, hidden, w->post_norm, T, E, m->eps, dtype);
        if (matmul(m, hidden, E, w->gate_up_weight, w->gate_up_bias, gate_up, T, 2 * I, E)) return -1;
        if (lora && lora_segments(&ls, l, LORA_GATE_UP, hidden, E, gate_up, 2 * I, E, 2 * R)) return -1;
        silu_and_mul(gate_up, act, T, I, dtype);
        if (matmul(m, act, I, w->down_weight, w->down_bias, hidden, T, E, I)) return -1;
        if (lora && lora_segments(&ls, l, LORA_DOWN, act, I, hidden, E, I, R)) return -1;
        if (st->all_reduce && st->all_reduce()) return -2;
        scale_branch(hidden, (int64_t)T * E, m->residual_multiplier, dtype);
    }
    return 0;
}
