// A plain-C model of the AMX tile instructions the kernels use, for the test-only variant
// amx_emulated (-DSHARDLM_EMULATE_AMX, built on avx512_bf16): the AMX code paths run, their
// tile configurations, loads, strides and stores checked, on CPUs without AMX, where the real
// instructions would fault. The sums are a model of the hardware's, not its bits: compare
// results within bfloat16's rounding. A shape the hardware would refuse (#UD) aborts with the
// reason, as does a configuration it would refuse (#GP). Slow: tests only, never installed.
#pragma once
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
// included by cpu_common.h, after immintrin.h (whose tile intrinsics it replaces), tile_config_t
// and bf16_to_f32

// each thread's tile registers, as each core has its own
static __thread struct {
    tile_config_t config;
    int configured;
    uint8_t data[8][16][64];
} amx_state;

static inline void amx_refuse(const char *what, int tile) {
    fprintf(stderr, "amx_emulated: %s (tile %d): the CPU would fault here\n", what, tile);
    abort();
}

static inline void amx_check_tile(int t) {
    if (!amx_state.configured) amx_refuse("a tile instruction before ldtilecfg", t);
    if (t < 0 || t > 7 || !amx_state.config.rows[t] || !amx_state.config.colsb[t]) amx_refuse("an unconfigured tile", t);
}

static inline void emulated_tile_loadconfig(const void *config) {
    memcpy(&amx_state.config, config, sizeof(tile_config_t));
    if (amx_state.config.palette != 1) amx_refuse("a palette other than 1", -1);
    if (amx_state.config.start_row) amx_refuse("a start row other than 0", -1);
    for (int i = 0; i < 14; i++)
        if (amx_state.config.reserved[i]) amx_refuse("a reserved byte of the configuration set", -1);
    for (int t = 8; t < 16; t++)
        if (amx_state.config.rows[t] || amx_state.config.colsb[t]) amx_refuse("a tile past the 8 of palette 1", t);
    for (int t = 0; t < 8; t++)
        if (amx_state.config.rows[t] > 16 || amx_state.config.colsb[t] > 64 || amx_state.config.colsb[t] % 4)
            amx_refuse("a tile of more than 16 rows or 64 bytes a row", t);
    memset(amx_state.data, 0, sizeof(amx_state.data));
    amx_state.configured = 1;
}

static inline void emulated_tile_release(void) {
    memset(&amx_state, 0, sizeof(amx_state));
}

// the configured rows of tile t from base, stride bytes apart; the rest of the tile zeroed
static inline void emulated_tile_loadd(int t, const void *base, int64_t stride) {
    amx_check_tile(t);
    memset(amx_state.data[t], 0, sizeof(amx_state.data[t]));
    for (int r = 0; r < amx_state.config.rows[t]; r++)
        memcpy(amx_state.data[t][r], (const char *)base + r * stride, amx_state.config.colsb[t]);
}

static inline void emulated_tile_stored(int t, void *base, int64_t stride) {
    amx_check_tile(t);
    for (int r = 0; r < amx_state.config.rows[t]; r++)
        memcpy((char *)base + r * stride, amx_state.data[t][r], amx_state.config.colsb[t]);
}

static inline void emulated_tile_zero(int t) {
    amx_check_tile(t);
    memset(amx_state.data[t], 0, sizeof(amx_state.data[t]));
}

static inline uint16_t emulated_half(const uint8_t *p) {     // a tile's bfloat16 at p (any alignment)
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

// c (float32, M x N) += a (bfloat16 pairs, M x K pairs) . b (K rows of N bfloat16 pairs): each
// output's K pairs of products summed in double, then added to it with one rounding, the model of
// a tile's sums that matched most of a Xeon's outputs (docs/USER_GUIDE.md, "CPU performance
// notes"); it differs from every vector tile's order, so a test can tell this path ran.
static inline void emulated_tile_dpbf16ps(int c, int a, int b) {
    amx_check_tile(c), amx_check_tile(a), amx_check_tile(b);
    const tile_config_t *cf = &amx_state.config;
    const int M = cf->rows[c], N = cf->colsb[c] / 4, K = cf->colsb[a] / 4;
    if (cf->rows[a] != M || cf->rows[b] != K || cf->colsb[b] != cf->colsb[c]) amx_refuse("tiles of mismatched shapes", c);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double sum = 0;
            for (int k = 0; k < K; k++)
                for (int i = 0; i < 2; i++)
                    sum += (double)bf16_to_f32(emulated_half(amx_state.data[a][m] + 4 * k + 2 * i)) *
                           bf16_to_f32(emulated_half(amx_state.data[b][k] + 4 * n + 2 * i));
            float cv;
            memcpy(&cv, &amx_state.data[c][m][4 * n], 4);
            cv = (float)((double)cv + sum);
            memcpy(&amx_state.data[c][m][4 * n], &cv, 4);
        }
}

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig emulated_tile_loadconfig
#define _tile_release emulated_tile_release
#define _tile_loadd emulated_tile_loadd
#define _tile_stored emulated_tile_stored
#define _tile_zero emulated_tile_zero
#define _tile_dpbf16ps emulated_tile_dpbf16ps
