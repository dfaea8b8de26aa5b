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

// paged_attention.c
KERNEL_API int paged_decode_attention(void *out, const void *q, int64_t q_stride, const void *k_cache,
                                      const void *v_cache, const int64_t *block_tables, const int64_t *context_lens,
                                      int B, int H, int Hkv, int D, int num_blocks, int block_size, int max_blocks,
                                      float scale, int dtype, float *lse);
KERNEL_API void rotary_cache_write(void *qkv, int64_t qkv_stride, const void *cos, const void *signed_sin,
                                   void *k_cache, void *v_cache, const int64_t *slot_mapping, int B, int H, int Hkv,
                                   int D, int num_blocks, int block_size, int dtype);
KERNEL_API void merge_attention_partials(const float *every, int N, int T, int Hall, int D, int first, int H,
                                         void *out, int dtype);
KERNEL_API int paged_decode_attention_qkv(void *out, void *qkv, int64_t qkv_stride, const void *cos,
                                          const void *signed_sin, void *k_cache, void *v_cache,
                                          const int64_t *slot_mapping, const int64_t *block_tables,
                                          const int64_t *context_lens, int B, int H, int Hkv, int D, int num_blocks,
                                          int block_size, int max_blocks, float scale, int dtype);

// skinny_matmul.c
KERNEL_API int skinny_matmul(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int M, int N,
                             int K, int dtype);

// blocked_matmul.c
KERNEL_API int blocked_vector_bits(void);
KERNEL_API int blocked_panel_width(void);
KERNEL_API int64_t blocked_packed_size(int N, int K, int dtype);
KERNEL_API void blocked_pack(const void *w, int N, int K, int dtype, void *out);
KERNEL_API int64_t blocked_int4_size(int N, int K, int group, int tb);
KERNEL_API void blocked_int4_pack(const int8_t *q, const void *scales, const void *mins, int N, int K, int group,
                                  int tb, uint8_t *out);
KERNEL_API int64_t blocked_int8_size(int N, int K, int group, int tb);
KERNEL_API void blocked_int8_pack(const int8_t *q, const void *scales, int N, int K, int group, int tb, uint8_t *out);
KERNEL_API void blocked_rows(const void *packed, const int64_t *index, int n, int K, int bits, int group, int tb,
                             int dtype, void *out);
KERNEL_API int blocked_set_bf16_dot(int on);
KERNEL_API int blocked_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y, int M,
                              int N, int K, int dtype);
KERNEL_API int blocked_int4_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y,
                                   int M, int N, int K, int group, int tb, int dtype);
KERNEL_API int blocked_int8_matmul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y,
                                   int M, int N, int K, int group, int tb, int dtype);

// llama_decode.c
KERNEL_API int llama_decode_layers(const int64_t *layers, int L, void *hidden, void *residual, int has_residual,
                                   const void *cos, const void *signed_sin, const int64_t *slot_mapping,
                                   const int64_t *block_tables, const int64_t *context_lens, int T, int E, int H,
                                   int Hkv, int D, int I, int num_blocks, int block_size, int max_blocks, float scale,
                                   float eps, int dtype, int kind, int group, int tb, void *scratch,
                                   int (*all_reduce)(void), const int64_t *lora, const int64_t *segments,
                                   int num_segments, int R, const int64_t *dcp);
