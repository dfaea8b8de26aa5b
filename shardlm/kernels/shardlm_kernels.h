// Every entry point of shardlm's CPU kernel library, declared once. Each kernel file includes
// this (through cpu_common.h), so the compiler checks each definition against its declaration;
// kernels/__init__.py holds the ctypes side, and a test checks the two agree.
#pragma once
#include <stdint.h>

// An entry point called from Python. Never inlined or specialized (noipa): every caller, Python
// or llama_decode.c, runs the one compiled body, so the fused path equals the layer-by-layer one
// bit for bit.
#define KERNEL_API __attribute__((noipa))

// fused_ops.c
KERNEL_API void add_rmsnorm(const void *x, int64_t x_stride, const void *residual, void *summed, void *out,
                            const void *weight, int T, int H, float eps, int dtype);
KERNEL_API void silu_and_mul(const void *x, void *out, int T, int I, int dtype);
KERNEL_API void rotary(void *x, int64_t x_stride, const void *cos, const void *signed_sin, int T, int heads, int D,
                       int dtype);
KERNEL_API void dequantize_int4pack(const uint8_t *packed, int N, int K, int block, int pairs, const float *scales,
                                    const float *mins, int group, void *out, int dtype);
KERNEL_API void argmax_rows(const void *x, int64_t x_stride, int T, int V, int dtype, int64_t *out);
KERNEL_API void mask_disallowed(float *x, int64_t x_stride, const int64_t *rows, int R, int V,
                                const int32_t *bitmask, int words, int first_token);

// paged_attention.c. kv_format: what the KV cache holds (FP8: times k_scale / v_scale).
enum { KV_AS_DTYPE, KV_FP8_E4M3, KV_FP8_E5M2 };
KERNEL_API int paged_decode_attention(void *out, const void *q, int64_t q_stride, const void *k_cache,
                                      const void *v_cache, const int64_t *block_tables, const int64_t *context_lens,
                                      int B, int H, int Hkv, int D, int num_blocks, int block_size, int max_blocks,
                                      float scale, int dtype, int kv_format, float k_scale, float v_scale, float *lse);
KERNEL_API void rotary_cache_write(void *qkv, int64_t qkv_stride, const void *cos, const void *signed_sin,
                                   void *k_cache, void *v_cache, const int64_t *slot_mapping, int B, int H, int Hkv,
                                   int D, int num_blocks, int block_size, int dtype, int kv_format, float k_scale,
                                   float v_scale);
KERNEL_API void merge_attention_partials(const float *every, int N, int T, int Hall, int D, int first, int H,
                                         void *out, int dtype);
KERNEL_API int paged_decode_attention_qkv(void *out, void *qkv, int64_t qkv_stride, const void *cos,
                                          const void *signed_sin, void *k_cache, void *v_cache,
                                          const int64_t *slot_mapping, const int64_t *block_tables,
                                          const int64_t *context_lens, int B, int H, int Hkv, int D, int num_blocks,
                                          int block_size, int max_blocks, float scale, int dtype, int kv_format,
                                          float k_scale, float v_scale);

// prefill_attention.c
KERNEL_API int paged_prefill_attention(void *out, const void *q, int64_t q_stride, const int64_t *token_index,
                                       int width, const int64_t *starts, const int64_t *contexts,
                                       const void *k_cache, const void *v_cache, const int64_t *block_tables,
                                       int max_blocks, int B, int H, int Hkv, int D, int Dv, int num_blocks,
                                       int block_size, float scale, int dtype, int kv_format, float k_scale,
                                       float v_scale, float *lse);

// latent_attention.c: decode attention of every query head against one shared cache row per
// token whose first Dv values are its value (multi-head latent attention)
KERNEL_API int latent_decode_attention(void *out, const void *q, int64_t q_stride, const void *cache,
                                       const int64_t *block_tables, int max_blocks, const int64_t *context_lens,
                                       int B, int H, int D, int Dv, int block_size, float scale, int dtype,
                                       int kv_format, float k_scale, float *lse);

// skinny_matmul.c
KERNEL_API int skinny_matmul(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int M, int N,
                             int K, int dtype);

// blocked_matmul.c
KERNEL_API int blocked_vector_bits(void);
KERNEL_API int blocked_panel_width(void);
KERNEL_API int64_t blocked_packed_size(int N, int K, int dtype);
KERNEL_API void blocked_pack(const void *w, int N, int K, int dtype, void *out);
KERNEL_API int blocked_matmul_heads(const void *x, int64_t x_stride, int64_t x_head_stride, const void *packed,
                                    int64_t w_head_stride, void *y, int heads, int M, int N, int K, int dtype);
KERNEL_API int64_t blocked_int4_size(int N, int K, int group, int tb);
KERNEL_API void blocked_int4_pack(const int8_t *q, const void *scales, const void *mins, int N, int K, int group,
                                  int tb, uint8_t *out);
KERNEL_API int64_t blocked_int8_size(int N, int K, int group, int tb);
KERNEL_API void blocked_int8_pack(const int8_t *q, const void *scales, int N, int K, int group, int tb, uint8_t *out);
KERNEL_API int blocked_fp8_pack(const uint8_t *q, const float *scales, int N, int K, int group, uint8_t *out);
KERNEL_API void blocked_rows(const void *packed, const int64_t *index, int n, int K, int bits, int fp8, int group,
                             int tb, int dtype, void *out);
KERNEL_API int blocked_set_bf16_dot(int on);
KERNEL_API int blocked_set_amx(int min_rows, int min_rows_8bit, int min_rows_4bit);
KERNEL_API int blocked_amx_usable(void);
KERNEL_API int64_t blocked_amx_calls(void);
KERNEL_API int blocked_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y, int M,
                              int N, int K, int dtype);
KERNEL_API int blocked_int4_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y,
                                   int M, int N, int K, int group, int tb, int dtype);
KERNEL_API int blocked_int8_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y,
                                   int M, int N, int K, int group, int tb, int dtype);
KERNEL_API int blocked_fp8_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y,
                                  int M, int N, int K, int group, int dtype);

// llama_decode.c: a stage's decoder layers in one call. Its arguments are these structs, each
// mirrored field for field by a ctypes.Structure in kernels/decode_abi.py (a test compares
// names, types, offsets and sizes). Integers are int32_t or int64_t, never plain int, so the
// two sides agree by construction.

// What stays the same from step to step: the stage's shape and how its weights are laid out.
typedef struct {
    int32_t layers;                     // decoder layers of this stage (the length of the weight table)
    int32_t hidden_size;                // E
    int32_t heads, kv_heads, head_dim;  // this rank's H, Hkv and D
    int32_t intermediate;               // this rank's I (the MLP's inner size)
    int32_t num_blocks, block_size;     // the KV cache's
    float scale, eps;                   // attention's softmax scale, the RMS norms' epsilon
    float residual_multiplier;          // each branch's output scaled before the residual add (1: Llama)
    int32_t dtype;                      // 0 float32, 1 bfloat16
    int32_t layout;                     // the linears' weights: DECODE_SKINNY ... DECODE_BLOCKED_FP8
    int32_t group;                      // 4-/8-bit, FP8: input columns per scale (0: one scale per row)
    int32_t table_bytes;                // 4-/8-bit: bytes per scale (4 float32, 2 float16)
    int32_t kv_format;                  // the KV cache's: KV_AS_DTYPE, KV_FP8_E4M3, KV_FP8_E5M2
} LlamaDecodeModel;

enum { DECODE_SKINNY, DECODE_BLOCKED, DECODE_BLOCKED_INT4, DECODE_BLOCKED_INT8, DECODE_BLOCKED_FP8 };

// One decoder layer's weights and KV cache. A bias of NULL means none; q_norm and k_norm, the
// weights [D] of an RMSNorm over each q and each k head before the rotary embedding (Qwen3), NULL
// where the model has none.
typedef struct {
    const void *input_norm, *qkv_weight, *qkv_bias, *o_weight, *o_bias;
    const void *post_norm, *gate_up_weight, *gate_up_bias, *down_weight, *down_bias;
    const void *q_norm, *k_norm;
    void *k_cache, *v_cache;
    int32_t rope;                       // 0: no rotary embedding in this layer (SmolLM3's NoPE layers)
    float k_scale, v_scale;             // an FP8 KV cache's scales (1: none)
} LlamaDecodeLayer;

// The tensor parallel all-reduce of hidden (in place), and decode context parallel's exchange
// (phase 0: q_all <- every rank's q rows; phase 1: every <- every rank's send): nonzero if it failed.
typedef int32_t (*decode_all_reduce_fn)(void);
typedef int32_t (*decode_exchange_fn)(int32_t phase);

// One decode step of `tokens` rows (one per sequence).
typedef struct {
    void *hidden, *residual;            // [T, E], in place: the stage's input, then its output
    int32_t tokens;                     // T
    int32_t has_residual;               // 0: the first stage (residual unset on entry)
    const void *cos, *signed_sin;       // [T, D / 2] each
    const int64_t *slot_mapping;        // [T]
    const int64_t *block_tables;        // [T, max_blocks]
    const int64_t *context_lens;        // [T]
    int64_t max_blocks;
    void *scratch;                      // llama_decode_scratch_elements(...) elements of dtype
    decode_all_reduce_fn all_reduce;    // NULL with one tensor parallel rank
} LlamaDecodeStep;

// A LoRA adapter's A and B panels (blocked_matmul's float layout) for one layer's four linears;
// NULL where the adapter leaves a linear alone.
typedef struct {
    const void *qkv_a, *qkv_b, *o_a, *o_b, *gate_up_a, *gate_up_b, *down_a, *down_b;
} LlamaDecodeLoraLayer;

// The step's rows [start, end) of each segment run on one adapter.
typedef struct {
    const LlamaDecodeLoraLayer *panels; // [segments][layers]
    const int64_t *segments;            // [segments][2]: start, end
    int32_t num_segments;
    int32_t rank;                       // the adapters' (largest) rank: their shards', zero-padded
} LlamaDecodeLora;

// Decode context parallel: this rank's place in its group and the buffers of the exchanges.
typedef struct {
    int32_t size, rank;
    decode_exchange_fn exchange;
    void *q_all, *partial;              // [T, size H D] (dtype)
    float *lse;                         // [T, size H]
    float *send;                        // [T, size H (D + 1)]
    float *every;                       // [size, T, size H (D + 1)]
} LlamaDecodeContextParallel;

// The scratch a step of `tokens` rows needs, in elements of the model's dtype (lora_rank 0: no LoRA).
KERNEL_API int64_t llama_decode_scratch_elements(const LlamaDecodeModel *model, int32_t tokens, int32_t lora_rank);
// lora, dcp: NULL for none. Returns -1 if a work buffer could not be allocated, -2 if an all-reduce
// or exchange failed.
KERNEL_API int32_t llama_decode_layers(const LlamaDecodeModel *model, const LlamaDecodeLayer *layers,
                                       const LlamaDecodeStep *step, const LlamaDecodeLora *lora,
                                       const LlamaDecodeContextParallel *dcp);

// latent_decode.c: a stage's DeepSeek decoder layers (latent attention; a dense MLP or routed
// and shared experts) in one call, every linear in blocked float panels. Mirrored in decode_abi.py.
typedef struct {
    int32_t layers, hidden_size;
    int32_t heads;                      // this rank's H
    int32_t q_lora_rank;                // 0: a plain q_proj (V2-Lite)
    int32_t nope_dim, rope_dim, latent_dim, v_dim;
    int32_t intermediate;               // the dense MLP's inner size on this rank
    int32_t num_experts, top_k;         // the router's experts (all of them), chosen per token
    int32_t expert_intermediate;        // a routed expert's inner size on this rank
    int32_t shared_intermediate;        // the shared experts' (0: none)
    int32_t block_size;
    float scale, eps;
    int32_t dtype;
    int32_t tp_size, expert_group_size; // the all-reduces run only over groups of more than one rank
} LatentDecodeModel;

// One layer. router NULL: a dense MLP in gate_up / down; else routed experts w13 / w2 (this
// rank's, each in panels, expert_stride elements apart) and the shared experts in gate_up / down
// (NULL: none). w_uk, w_uv: each head's absorbed up-projection in panels, head_stride apart.
typedef struct {
    const void *input_norm, *q_a, *q_a_norm, *q_b, *kv_a, *kv_a_norm, *w_uk, *w_uv, *o, *post_norm;
    const void *gate_up, *down, *router, *w13, *w2;
    int64_t head_stride_uk, head_stride_uv, expert_stride_w13, expert_stride_w2;
    void *cache;                        // [num_blocks, block_size, latent_dim + rope_dim]
    float k_scale;
} LatentDecodeLayer;

// All-reduce `elements` values at `buffer` in place over the tensor parallel group (group 0) or
// the experts' group (1); route: layer l's routing from the router logits (float32 [T, E]) into
// slots ([T, top_k] int32: this rank's expert, -1 none) and weights ([T, top_k] float32).
// Nonzero if it failed.
typedef int32_t (*latent_reduce_fn)(void *buffer, int64_t elements, int32_t group);
typedef int32_t (*latent_route_fn)(int32_t layer);

typedef struct {
    void *hidden, *residual;            // [T, E]; has_residual as LlamaDecodeStep's
    int32_t tokens, has_residual;
    const void *cos, *signed_sin;       // [T, rope_dim]
    const int64_t *slot_mapping, *block_tables, *context_lens;
    int64_t max_blocks;
    void *scratch;                      // latent_decode_scratch_elements(model, tokens) of dtype
    float *router_input, *logits;       // [T, E] and [T, num_experts] float32
    int32_t *slots;
    float *weights;
    latent_reduce_fn all_reduce;
    latent_route_fn route;
} LatentDecodeStep;

KERNEL_API int64_t latent_decode_scratch_elements(const LatentDecodeModel *model, int32_t tokens);
// Returns -1 if a work buffer could not be allocated, -2 if an all-reduce or the routing failed.
KERNEL_API int32_t latent_decode_layers(const LatentDecodeModel *model, const LatentDecodeLayer *layers,
                                        const LatentDecodeStep *step);
