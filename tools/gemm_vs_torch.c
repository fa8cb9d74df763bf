/* SPDX-License-Identifier: MIT */
/* tools/gemm_vs_torch.c — cpar's host bf16 linear forward as a shared
 * library that Python's ctypes can call between torch's calls
 * (tools/gemm_vs_torch.sh): one rank on the host backend, one layer
 * y = x wᵀ of a given shape, timed one call at a time. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cpar.h"

typedef struct {
    cpar_ctx *ctx;
    cpar_linear *layer;
    cpar_tensor x, y;
} gemm_vs_case;

/* A layer of n outputs from k inputs and x of t tokens (random), or NULL
 * after printing why. */
void *gemm_vs_make(long t, long k, long n) {
    gemm_vs_case *c = calloc(1, sizeof *c);
    const cpar_init_config cfg = {.backend = CPAR_BACKEND_HOST};
    const int64_t xs[2] = {t, k}, ys[2] = {t, n};
    const cpar_linear_config lc = {.input_size = k, .output_size = n, .dtype = CPAR_BF16};
    if (!c || cpar_init_from_env(&cfg, &c->ctx) != CPAR_OK || cpar_model_parallel_manual_seed(c->ctx, 1, 0, 0, 0) != CPAR_OK ||
        cpar_column_parallel_linear_create(cpar_world_group(c->ctx), &lc, &c->layer) != CPAR_OK ||
        cpar_linear_init_random(c->layer, 0.02f) != CPAR_OK || cpar_tensor_alloc(c->ctx, CPAR_BF16, 2, xs, &c->x) != CPAR_OK ||
        cpar_tensor_alloc(c->ctx, CPAR_BF16, 2, ys, &c->y) != CPAR_OK || cpar_rng_uniform(c->ctx, &c->x, -1.f, 1.f) != CPAR_OK) {
        fprintf(stderr, "gemm_vs_torch: %s\n", cpar_thread_last_error());
        return NULL;
    }
    return c;
}

/* One forward: its wall time in seconds, or -1 after printing why. */
double gemm_vs_call(void *p) {
    gemm_vs_case *c = p;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (cpar_linear_forward(c->layer, &c->x, &c->y, NULL) != CPAR_OK) {
        fprintf(stderr, "gemm_vs_torch: %s\n", cpar_thread_last_error());
        return -1.0;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}
