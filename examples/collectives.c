/* SPDX-License-Identifier: MIT */
/* collectives.c — a tour of the raw collectives (make collectives).
 *
 * Four ranks (threads on the host backend, one GPU each through NCCL when
 * four GPUs are visible, else sharing the GPUs on the device backend) build
 * a tp=2 x cp=2 grid and run every collective on
 * every group with real data. Each rank checks every result against a value it
 * computes itself, and rank 0 prints what each group moved, summed over ranks,
 * next to the algorithm's minimum. Exit status 0 means every check passed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpar.h"

#define NRANKS 4
#define ROWS 6  /* rows per rank */
#define COLS 5

#define TRY(call)                                                                                            \
    do {                                                                                                     \
        cpar_status st_ = (call);                                                                            \
        if (st_ != CPAR_OK) return st_;                                                                      \
    } while (0)

static const cpar_group_kind kinds[] = {CPAR_GROUP_WORLD, CPAR_GROUP_TP, CPAR_GROUP_CP, CPAR_GROUP_DP,
                                        CPAR_GROUP_TP_CP};
static const char *const kind_names[] = {"world", "tp", "cp", "dp", "tp_cp"};
#define NKINDS (int)(sizeof kinds / sizeof kinds[0])

/* The value world rank w holds at element i: distinct and exact in fp32. */
static float value(int w, int i) { return (float)(w * 1000 + i); }

typedef struct {
    int failures;
    int size[NKINDS]; /* group size of each kind */
    cpar_comm_stats stats[NKINDS][NRANKS];
} demo_result;

static cpar_status check(cpar_ctx *ctx, demo_result *res, const char *what, const char *group, const float *got,
                         const float *want, int n) {
    for (int i = 0; i < n; i++)
        if (got[i] != want[i]) {
            fprintf(stderr, "rank %d: %s on %s: element %d is %g, expected %g\n", cpar_rank(ctx), what, group, i,
                    (double)got[i], (double)want[i]);
            res->failures++;
            return CPAR_OK;
        }
    return CPAR_OK;
}

/* Run the six collectives on g and check each result. */
static cpar_status exercise(cpar_ctx *ctx, demo_result *res, cpar_group *g, const char *name) {
    int n = cpar_group_size(g), me = cpar_group_rank(g), w = cpar_rank(ctx), count = ROWS * COLS;
    int64_t shape[2] = {ROWS, COLS}, gshape[2] = {(int64_t)ROWS * n, COLS}, one[2] = {ROWS / 2 * n, COLS};
    float *host = malloc(sizeof(float) * (size_t)count * (size_t)n), *want = malloc(sizeof(float) * (size_t)count * (size_t)n);
    float mine[ROWS * COLS];
    for (int i = 0; i < count; i++) mine[i] = value(w, i);
    cpar_tensor h_in = cpar_tensor_make(mine, CPAR_F32, 2, shape, CPAR_HOST), in, out, big;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 2, shape, &in));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 2, shape, &out));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 2, gshape, &big));
    TRY(cpar_tensor_copy(ctx, &h_in, &in));
    cpar_tensor h_out = cpar_tensor_make(host, CPAR_F32, 2, shape, CPAR_HOST);
    cpar_tensor h_big = cpar_tensor_make(host, CPAR_F32, 2, gshape, CPAR_HOST);

    /* all-reduce: the sum over the group's world ranks */
    TRY(cpar_all_reduce(g, &in, &out, CPAR_SUM));
    TRY(cpar_tensor_copy(ctx, &out, &h_out));
    for (int i = 0; i < count; i++) {
        want[i] = 0;
        for (int r = 0; r < n; r++) want[i] += value(cpar_group_world_rank(g, r), i);
    }
    TRY(check(ctx, res, "all_reduce", name, host, want, count));

    /* all-gather: every member's rows in group order */
    TRY(cpar_all_gather(g, &in, &big, NULL));
    TRY(cpar_tensor_copy(ctx, &big, &h_big));
    for (int r = 0; r < n; r++)
        for (int i = 0; i < count; i++) want[r * count + i] = value(cpar_group_world_rank(g, r), i);
    TRY(check(ctx, res, "all_gather", name, host, want, count * n));

    /* reduce-scatter of the gathered tensor: my rows of n times the gather */
    cpar_tensor rs;
    int64_t rs_shape[2] = {ROWS, COLS};
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 2, rs_shape, &rs));
    TRY(cpar_reduce_scatter(g, &big, &rs, CPAR_SUM, NULL));
    TRY(cpar_tensor_copy(ctx, &rs, &h_out));
    for (int i = 0; i < count; i++) want[i] = (float)n * value(cpar_group_world_rank(g, me), i);
    TRY(check(ctx, res, "reduce_scatter", name, host, want, count));

    /* all-to-all: ROWS/2 rows to every member (needs ROWS/2 * n rows) */
    cpar_tensor a_in, a_out;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 2, one, &a_in));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 2, one, &a_out));
    int half = ROWS / 2 * COLS;
    for (int r = 0; r < n; r++)
        for (int i = 0; i < half; i++) want[r * half + i] = value(w, r * 100 + i); /* block for member r */
    cpar_tensor h_a = cpar_tensor_make(want, CPAR_F32, 2, one, CPAR_HOST);
    TRY(cpar_tensor_copy(ctx, &h_a, &a_in));
    TRY(cpar_all_to_all_single(g, &a_in, &a_out, NULL, NULL));
    cpar_tensor h_ao = cpar_tensor_make(host, CPAR_F32, 2, one, CPAR_HOST);
    TRY(cpar_tensor_copy(ctx, &a_out, &h_ao));
    for (int r = 0; r < n; r++)
        for (int i = 0; i < half; i++) want[r * half + i] = value(cpar_group_world_rank(g, r), me * 100 + i);
    TRY(check(ctx, res, "all_to_all", name, host, want, half * n));

    /* broadcast from the last member */
    TRY(cpar_tensor_copy(ctx, &in, &out));
    TRY(cpar_broadcast(g, &out, n - 1));
    TRY(cpar_tensor_copy(ctx, &out, &h_out));
    for (int i = 0; i < count; i++) want[i] = value(cpar_group_world_rank(g, n - 1), i);
    TRY(check(ctx, res, "broadcast", name, host, want, count));

    /* ring shift to the next member */
    TRY(cpar_ring_shift(g, &in, &out, 1));
    TRY(cpar_tensor_copy(ctx, &out, &h_out));
    for (int i = 0; i < count; i++) want[i] = value(cpar_group_world_rank(g, (me + n - 1) % n), i);
    TRY(check(ctx, res, "ring_shift", name, host, want, count));

    TRY(cpar_barrier(g));
    cpar_tensor *ts[] = {&in, &out, &big, &rs, &a_in, &a_out};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) TRY(cpar_tensor_free(ctx, ts[i]));
    free(host);
    free(want);
    return CPAR_OK;
}

static cpar_status rank_main(cpar_ctx *ctx, void *arg) {
    demo_result *res = arg;
    TRY(cpar_grid_init(ctx, &(cpar_grid_config){.tp = 2, .cp = 2}));
    for (int k = 0; k < NKINDS; k++) {
        cpar_group *g = cpar_grid_group(ctx, kinds[k]);
        TRY(cpar_group_stats_reset(g));
        TRY(exercise(ctx, res, g, kind_names[k]));
        TRY(cpar_group_stats(g, &res->stats[k][cpar_rank(ctx)]));
        res->size[k] = cpar_group_size(g);
    }
    return cpar_sync(ctx);
}

int main(void) {
    cpar_backend backend = CPAR_BACKEND_HOST;
    int ngpu = cpar_device_count();
    if (cpar_backend_available(CPAR_BACKEND_NCCL) && ngpu > 0) /* fewer GPUs than ranks: they share them */
        backend = ngpu >= NRANKS ? CPAR_BACKEND_NCCL : CPAR_BACKEND_DEVICE;
    printf("cpar collectives: %d ranks on the %s backend (%d GPU%s visible), grid tp=2 x cp=2 x dp=1\n", NRANKS,
           cpar_backend_name(backend), ngpu, ngpu == 1 ? "" : "s");
    fflush(stdout);

    demo_result res;
    memset(&res, 0, sizeof res);
    cpar_status st = cpar_spawn(NRANKS, backend, rank_main, &res);
    if (st != CPAR_OK) {
        fprintf(stderr, "cpar collectives failed: %s: %s\n", cpar_status_string(st), cpar_thread_last_error());
        return 1;
    }

    printf("\nBytes moved per group kind, summed over ranks (minimum: what any algorithm must receive)\n");
    printf("%-7s %-15s %6s %14s %14s %14s\n", "group", "collective", "calls", "bytes sent", "bytes recv",
           "minimum");
    for (int k = 0; k < NKINDS; k++)
        for (int c = 0; c < CPAR_COLL_KIND_COUNT; c++) {
            cpar_comm_counter sum = {0, 0, 0};
            for (int r = 0; r < NRANKS; r++) {
                sum.calls += res.stats[k][r].kind[c].calls;
                sum.bytes_sent += res.stats[k][r].kind[c].bytes_sent;
                sum.bytes_recv += res.stats[k][r].kind[c].bytes_recv;
            }
            if (!sum.calls) continue;
            /* What the ranks must receive at least, summed over all groups of
             * this kind (NRANKS / n groups of n ranks). */
            int n = res.size[k], groups = NRANKS / n;
            uint64_t bytes = (uint64_t)ROWS * COLS * sizeof(float), min = 0;
            switch ((cpar_coll_kind)c) {
            case CPAR_COLL_ALL_REDUCE: min = (uint64_t)groups * 2 * (n - 1) * bytes; break;
            case CPAR_COLL_ALL_GATHER: min = (uint64_t)groups * n * (n - 1) * bytes; break;
            case CPAR_COLL_REDUCE_SCATTER: min = (uint64_t)groups * n * (n - 1) * bytes; break;
            case CPAR_COLL_ALL_TO_ALL: min = (uint64_t)groups * n * (n - 1) * bytes / 2; break;
            case CPAR_COLL_BROADCAST: min = (uint64_t)groups * (n - 1) * bytes; break;
            case CPAR_COLL_SEND_RECV: min = n > 1 ? (uint64_t)groups * n * bytes : 0; break;
            default: break;
            }
            printf("%-7s %-15s %6llu %14llu %14llu %14llu%s\n", kind_names[k], cpar_coll_kind_name((cpar_coll_kind)c),
                   (unsigned long long)sum.calls, (unsigned long long)sum.bytes_sent,
                   (unsigned long long)sum.bytes_recv, (unsigned long long)min,
                   c == CPAR_COLL_BARRIER ? "" : sum.bytes_recv == min ? "  = min" : "  != min");
            if (c != CPAR_COLL_BARRIER && sum.bytes_recv != min) res.failures++;
        }
    printf("\n%s: %d failed check%s\n", res.failures ? "FAILED" : "OK", res.failures, res.failures == 1 ? "" : "s");
    return res.failures ? 1 : 0;
}
