// The decode step of a pipeline stage's DeepSeek decoder layers in one C call, on CPU, for one
// tensor (or expert) parallel rank: latent attention (the q LoRA or a plain q_proj, the latent
// and its norm, the rotary parts, each head's query through its absorbed W_UK, the cache write,
// latent_attention.c, each head's output through W_UV, o_proj), then a dense MLP or the routed
// and shared experts -- the kernels of the layer-by-layer path, in its order (models/deepseek.py,
// layers/moe.py), so the same results bit for bit. Every linear is in blocked float panels.
//
// Two things call back into Python: the all-reduces (the groups' own, as in llama_decode.c) and
// the routing of each MoE layer (its GroupedTopK, expert load counts and EPLB copies run there,
// as in the layer path); the router's product and the experts run here.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "shardlm_kernels.h"

// The scratch of a step, each buffer [T, ...] in the model's dtype (heads-major where named so)
typedef struct {
    char *qa, *q, *kva, *lat, *pe, *qlat, *ql, *attn, *uvh, *ov, *gate_up, *act, *moe, *shared, *eout;
} buffers_t;

static int64_t widest_intermediate(const LatentDecodeModel *m) {
    int64_t I = m->intermediate;
    if (m->expert_intermediate > I) I = m->expert_intermediate;
    return m->shared_intermediate > I ? m->shared_intermediate : I;
}

KERNEL_API int64_t latent_decode_scratch_elements(const LatentDecodeModel *m, int32_t tokens) {
    const int64_t H = m->heads, R = m->latent_dim, P = m->rope_dim, QK = m->nope_dim + P, V = m->v_dim;
    const int64_t per_row = m->q_lora_rank + H * QK + (R + P) + R + (H + 1) * P + H * R + H * (R + P) + H * R
                            + 2 * H * V + 3 * widest_intermediate(m) + 3 * (int64_t)m->hidden_size;
    return tokens * per_row;
}

static buffers_t carve(const LatentDecodeModel *m, void *scratch, int64_t T) {
    const int64_t H = m->heads, R = m->latent_dim, P = m->rope_dim, QK = m->nope_dim + P, V = m->v_dim;
    const int64_t I = widest_intermediate(m), E = m->hidden_size, es = m->dtype == 0 ? 4 : 2;
    const int64_t sizes[15] = {m->q_lora_rank, H * QK, R + P, R, (H + 1) * P, H * R, H * (R + P), H * R, H * V, H * V,
                               2 * I, I, E, E, E};
    char *parts[15], *at = (char *)scratch;
    for (int i = 0; i < 15; i++) parts[i] = at, at += T * sizes[i] * es;
    return (buffers_t){parts[0], parts[1], parts[2], parts[3], parts[4], parts[5], parts[6], parts[7], parts[8],
                       parts[9], parts[10], parts[11], parts[12], parts[13], parts[14]};
}

// The latent attention of one layer, from the normed hidden rows into hidden (o_proj's output,
// all-reduced over the tensor parallel group)
static int latent_attention(const LatentDecodeModel *m, const LatentDecodeLayer *w, const LatentDecodeStep *st,
                            const buffers_t *b) {
    const int T = st->tokens, E = m->hidden_size, H = m->heads, R = m->latent_dim, P = m->rope_dim;
    const int N = m->nope_dim, QK = N + P, V = m->v_dim, dt = m->dtype, es = dt == 0 ? 4 : 2;
    if (m->q_lora_rank) {
        const int QL = m->q_lora_rank;
        if (blocked_matmul(st->hidden, E, w->q_a, NULL, b->qa, T, QL, E, dt)) return -1;
        add_rmsnorm(b->qa, QL, NULL, NULL, b->qa, w->q_a_norm, T, QL, m->eps, dt);
        if (blocked_matmul(b->qa, QL, w->q_b, NULL, b->q, T, H * QK, QL, dt)) return -1;
    } else if (blocked_matmul(st->hidden, E, w->q_b, NULL, b->q, T, H * QK, E, dt)) {    // q_proj (V2-Lite)
        return -1;
    }
    if (blocked_matmul(st->hidden, E, w->kv_a, NULL, b->kva, T, R + P, E, dt)) return -1;
    add_rmsnorm(b->kva, R + P, NULL, NULL, b->lat, w->kv_a_norm, T, R, m->eps, dt);
    // the rotary parts of each head's q and of the key, [T, H + 1, P], rotated together in place
    for (int t = 0; t < T; t++) {
        char *pe = b->pe + (int64_t)t * (H + 1) * P * es;
        for (int h = 0; h < H; h++) memcpy(pe + (int64_t)h * P * es, b->q + ((int64_t)t * H * QK + h * QK + N) * es, P * es);
        memcpy(pe + (int64_t)H * P * es, b->kva + ((int64_t)t * (R + P) + R) * es, P * es);
    }
    rotary(b->pe, (int64_t)(H + 1) * P, st->cos, st->signed_sin, T, H + 1, P, dt);
    // each head's q_nope through its W_UK ([H][T][R]); the queries [T, H, R + P]; the cache rows
    if (blocked_matmul_heads(b->q, (int64_t)H * QK, QK, w->w_uk, w->head_stride_uk, b->qlat, H, T, R, N, dt)) return -1;
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            char *q = b->ql + ((int64_t)t * H + h) * (R + P) * es;
            memcpy(q, b->qlat + ((int64_t)h * T + t) * R * es, R * es);
            memcpy(q + (int64_t)R * es, b->pe + ((int64_t)t * (H + 1) + h) * P * es, P * es);
        }
        if (st->slot_mapping[t] < 0) continue;
        char *row = (char *)w->cache + st->slot_mapping[t] * (R + P) * es;
        memcpy(row, b->lat + (int64_t)t * R * es, R * es);
        memcpy(row + (int64_t)R * es, b->pe + ((int64_t)t * (H + 1) + H) * P * es, P * es);
    }
    if (latent_decode_attention(b->attn, b->ql, (int64_t)H * (R + P), w->cache, st->block_tables, (int)st->max_blocks,
                                st->context_lens, T, H, R + P, R, m->block_size, m->scale, dt, KV_AS_DTYPE, w->k_scale,
                                NULL))
        return -1;
    if (blocked_matmul_heads(b->attn, (int64_t)H * R, R, w->w_uv, w->head_stride_uv, b->uvh, H, T, V, R, dt)) return -1;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++)
            memcpy(b->ov + ((int64_t)t * H + h) * V * es, b->uvh + ((int64_t)h * T + t) * V * es, V * es);
    if (blocked_matmul(b->ov, (int64_t)H * V, w->o, NULL, st->hidden, T, E, H * V, dt)) return -1;
    if (m->tp_size > 1 && st->all_reduce(st->hidden, (int64_t)T * E, 0)) return -2;
    return 0;
}

// out [T, E] = the MLP of inner size I over x [T, E] (gate_up, SiLU-and-mul, down), all-reduced
// over the tensor parallel group
static int mlp(const LatentDecodeModel *m, const LatentDecodeStep *st, const buffers_t *b, const void *gate_up,
               const void *down, int I, const void *x, void *out) {
    const int T = st->tokens, E = m->hidden_size, dt = m->dtype;
    if (blocked_matmul(x, E, gate_up, NULL, b->gate_up, T, 2 * I, E, dt)) return -1;
    silu_and_mul(b->gate_up, b->act, T, I, dt);
    if (blocked_matmul(b->act, I, down, NULL, out, T, E, I, dt)) return -1;
    if (m->tp_size > 1 && st->all_reduce(out, (int64_t)T * E, 0)) return -2;
    return 0;
}

// Layer l's routed experts (and shared ones) over hidden, into hidden. As layers/moe.py: the
// pairs on this rank by expert (an expert's rows in one product), each output row times its
// weight (both in dtype), summed per token in expert order in float32 and rounded once (as
// torch's index_add_ sums bfloat16 rows), the sums all-reduced over the experts' group; then the
// shared experts' output added.
static int experts(const LatentDecodeModel *m, const LatentDecodeLayer *w, const LatentDecodeStep *st,
                   const buffers_t *b, int l) {
    const int T = st->tokens, E = m->hidden_size, K = m->top_k, I = m->expert_intermediate, dt = m->dtype;
    const int es = dt == 0 ? 4 : 2;
    for (int64_t i = 0; i < (int64_t)T * E; i++) st->router_input[i] = load(st->hidden, i, dt);
    if (blocked_matmul(st->router_input, E, w->router, NULL, st->logits, T, m->num_experts, E, 0)) return -1;
    if (st->route(l)) return -2;
    // the (token, choice) pairs on this rank grouped by slot, in token order within a slot (the
    // layer path's stable sort), so each expert multiplies all its rows at once
    const int pairs = T * K;
    int slots_here = 0;
    for (int i = 0; i < pairs; i++) if (st->slots[i] + 1 > slots_here) slots_here = st->slots[i] + 1;
    int *first = (int *)calloc((size_t)slots_here + 1, sizeof(int)), *order = (int *)malloc(sizeof(int) * (pairs + 1));
    if (!first || !order) { free(first), free(order); return -1; }
    for (int i = 0; i < pairs; i++) if (st->slots[i] >= 0) first[st->slots[i] + 1]++;
    for (int e = 0; e < slots_here; e++) first[e + 1] += first[e];
    {
        int fill[slots_here + 1];
        memcpy(fill, first, sizeof(int) * (slots_here + 1));
        for (int i = 0; i < pairs; i++) if (st->slots[i] >= 0) order[fill[st->slots[i]]++] = i;
    }
    float *sums = st->router_input;            // read by the router's product, free now
    memset(sums, 0, sizeof(float) * T * E);
    char *xs = b->shared;                      // an expert's rows (the shared experts' output comes after)
    int rc = 0;
    for (int e = 0; e < slots_here; e++) {
        const int n = first[e + 1] - first[e];
        if (n == 0) continue;
        const int *pair = order + first[e];
        for (int r = 0; r < n; r++)
            memcpy(xs + (int64_t)r * E * es, (const char *)st->hidden + (int64_t)(pair[r] / K) * E * es, (size_t)E * es);
        rc = blocked_matmul(xs, E, (const char *)w->w13 + e * w->expert_stride_w13 * es, NULL, b->gate_up, n, 2 * I,
                            E, dt);
        if (rc) break;
        silu_and_mul(b->gate_up, b->act, n, I, dt);
        rc = blocked_matmul(b->act, I, (const char *)w->w2 + e * w->expert_stride_w2 * es, NULL, b->eout, n, E, I, dt);
        if (rc) break;
        // each row times its weight, stored before it is summed: two roundings, as torch's two
        // operators (in one loop -ffast-math would fuse them into one multiply-add)
        for (int r = 0; r < n; r++) {
            const float weight = round_to(st->weights[pair[r]], dt);
            char *row = b->eout + (int64_t)r * E * es;
            for (int d = 0; d < E; d++) store(row, d, load(row, d, dt) * weight, dt);
        }
        for (int r = 0; r < n; r++) {
            float *sum = sums + (int64_t)(pair[r] / K) * E;
            for (int d = 0; d < E; d++) sum[d] += load(b->eout, (int64_t)r * E + d, dt);
        }
    }
    free(first), free(order);
    if (rc) return rc;
    for (int64_t i = 0; i < (int64_t)T * E; i++) store(b->moe, i, sums[i], dt);
    if (m->expert_group_size > 1 && st->all_reduce(b->moe, (int64_t)T * E, 1)) return -2;
    if (!w->gate_up) {
        memcpy(st->hidden, b->moe, (size_t)T * E * es);
        return 0;
    }
    rc = mlp(m, st, b, w->gate_up, w->down, m->shared_intermediate, st->hidden, b->shared);
    if (rc) return rc;
    for (int64_t i = 0; i < (int64_t)T * E; i++) store(st->hidden, i, load(b->moe, i, dt) + load(b->shared, i, dt), dt);
    return 0;
}

// hidden, residual [T, E] in place, as llama_decode_layers
KERNEL_API int32_t latent_decode_layers(const LatentDecodeModel *m, const LatentDecodeLayer *layers,
                                        const LatentDecodeStep *st) {
    const int T = st->tokens, E = m->hidden_size, dt = m->dtype, es = dt == 0 ? 4 : 2;
    const buffers_t b = carve(m, st->scratch, T);
    void *hidden = st->hidden, *residual = st->residual;
    for (int l = 0; l < m->layers; l++) {
        const LatentDecodeLayer *w = &layers[l];
        if (l == 0 && !st->has_residual) {
            memcpy(residual, hidden, (size_t)T * E * es);
            add_rmsnorm(hidden, E, NULL, NULL, hidden, w->input_norm, T, E, m->eps, dt);
        } else {
            add_rmsnorm(hidden, E, residual, residual, hidden, w->input_norm, T, E, m->eps, dt);
        }
        int rc = latent_attention(m, w, st, &b);
        if (rc) return rc;
        add_rmsnorm(hidden, E, residual, residual, hidden, w->post_norm, T, E, m->eps, dt);
        rc = w->router ? experts(m, w, st, &b, l) : mlp(m, st, &b, w->gate_up, w->down, m->intermediate, hidden, hidden);
        if (rc) return rc;
    }
    return 0;
}
