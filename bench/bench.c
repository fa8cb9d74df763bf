/* bench.c — cpar's benchmarks (make bench).
 *
 * Collectives: for each operation, group size and message size, the median
 * time per call, the bytes each rank received (from cpar's communication
 * statistics) against the algorithm's minimum, and the bus bandwidth (the
 * nccl-tests definition: algbw * 2(n-1)/n for all-reduce, (n-1)/n for the
 * gathers and scatters) as a fraction of a ceiling measured in the same run:
 * single-thread memcpy on the host backend, device-to-device copy on GPUs.
 *
 * Environment: CPAR_BENCH_ITERS (default 10), CPAR_BENCH_MAX_MIB (default 16).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpar.h"

#define TRY(call)                                                                                            \
    do {                                                                                                     \
        cpar_status st_ = (call);                                                                            \
        if (st_ != CPAR_OK) return st_;                                                                      \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int env_int(const char *name, int dflt) {
    const char *v = getenv(name);
    return v && atoi(v) > 0 ? atoi(v) : dflt;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

enum { OP_ALL_REDUCE, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_ALL_TO_ALL, OP_BROADCAST, OP_COUNT };
static const char *const op_names[OP_COUNT] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                               "broadcast"};
static const cpar_coll_kind op_kinds[OP_COUNT] = {CPAR_COLL_ALL_REDUCE, CPAR_COLL_ALL_GATHER,
                                                   CPAR_COLL_REDUCE_SCATTER, CPAR_COLL_ALL_TO_ALL,
                                                   CPAR_COLL_BROADCAST};

typedef struct {
    int op, iters;
    size_t bytes;      /* message size: the full tensor of the operation */
    double seconds;    /* median per call, rank 0 */
    uint64_t recv;     /* bytes received per call by rank 0 */
} coll_case;

static cpar_status run_case(cpar_ctx *ctx, void *arg) {
    coll_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g);
    int64_t elems = (int64_t)(c->bytes / sizeof(float)) / n * n, part = elems / n;
    cpar_tensor full, shard;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &elems, &full));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &part, &shard));
    TRY(cpar_fill(ctx, &full, 1.0));
    TRY(cpar_fill(ctx, &shard, 1.0));
    cpar_tensor out;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &elems, &out));
    double *t = malloc(sizeof(double) * (size_t)c->iters);
    for (int it = -1; it < c->iters; it++) { /* iteration -1 warms up */
        TRY(cpar_barrier(g));
        if (it == 0) TRY(cpar_group_stats_reset(g));
        double t0 = now_s();
        switch (c->op) {
        case OP_ALL_REDUCE: TRY(cpar_all_reduce(g, &full, &full, CPAR_SUM)); break;
        case OP_ALL_GATHER: TRY(cpar_all_gather(g, &shard, &out, NULL)); break;
        case OP_REDUCE_SCATTER: TRY(cpar_reduce_scatter(g, &full, &shard, CPAR_SUM, NULL)); break;
        case OP_ALL_TO_ALL: TRY(cpar_all_to_all_single(g, &full, &out, NULL, NULL)); break;
        default: TRY(cpar_broadcast(g, &full, 0)); break;
        }
        TRY(cpar_sync(ctx));
        if (it >= 0) t[it] = now_s() - t0;
    }
    if (cpar_rank(ctx) == 0) {
        qsort(t, (size_t)c->iters, sizeof *t, cmp_double);
        c->seconds = t[c->iters / 2];
        cpar_comm_stats s;
        TRY(cpar_group_stats(g, &s));
        c->recv = s.kind[op_kinds[c->op]].bytes_recv / (uint64_t)c->iters;
    }
    free(t);
    TRY(cpar_tensor_free(ctx, &full));
    TRY(cpar_tensor_free(ctx, &shard));
    return cpar_tensor_free(ctx, &out);
}

/* Bytes rank 0 must receive at least, and the bus-bandwidth factor. */
static uint64_t min_recv(int op, int n, size_t bytes, double *bus_factor) {
    size_t part = bytes / (size_t)n;
    switch (op) {
    case OP_ALL_REDUCE: *bus_factor = 2.0 * (n - 1) / n; return (uint64_t)(bytes - part + (size_t)(n - 1) * part);
    case OP_BROADCAST: *bus_factor = 1.0; return 0; /* rank 0 is the root */
    default: *bus_factor = (double)(n - 1) / n; return (uint64_t)(bytes - part);
    }
}

typedef struct {
    size_t bytes;
    double gbps;
} copy_case;

/* The ceiling: one copy of bytes on the rank's device (median of 5). */
static cpar_status run_copy(cpar_ctx *ctx, void *arg) {
    copy_case *c = arg;
    int64_t elems = (int64_t)(c->bytes / sizeof(float));
    cpar_tensor a, b;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &elems, &a));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &elems, &b));
    TRY(cpar_fill(ctx, &a, 1.0));
    TRY(cpar_fill(ctx, &b, 2.0));
    double t[5];
    for (int it = -1; it < 5; it++) {
        TRY(cpar_sync(ctx));
        double t0 = now_s();
        TRY(cpar_tensor_copy(ctx, &a, &b));
        TRY(cpar_sync(ctx));
        if (it >= 0) t[it] = now_s() - t0;
    }
    qsort(t, 5, sizeof *t, cmp_double);
    c->gbps = (double)c->bytes / t[2] / 1e9;
    TRY(cpar_tensor_free(ctx, &a));
    return cpar_tensor_free(ctx, &b);
}

int main(void) {
    int iters = env_int("CPAR_BENCH_ITERS", 10), max_mib = env_int("CPAR_BENCH_MAX_MIB", 16);
    cpar_backend backend = cpar_backend_available(CPAR_BACKEND_NCCL) ? CPAR_BACKEND_NCCL : CPAR_BACKEND_HOST;
    int max_ranks = backend == CPAR_BACKEND_NCCL ? cpar_dev_count() : 4;
    if (max_ranks > 8) max_ranks = 8;

    copy_case ceiling = {.bytes = (size_t)max_mib << 20};
    cpar_status st = cpar_spawn(1, backend, run_copy, &ceiling);
    if (st != CPAR_OK) {
        fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
        return 1;
    }
    printf("cpar bench: %s backend, %d iterations per case, ceiling = %s copy of %d MiB: %.2f GB/s\n",
           cpar_backend_name(backend), iters, backend == CPAR_BACKEND_NCCL ? "device-to-device" : "memcpy", max_mib,
           ceiling.gbps);
    printf("\n%-15s %5s %9s %11s %12s %12s %9s %9s %8s\n", "collective", "ranks", "size", "time/call", "recv/rank",
           "minimum", "algbw", "busbw", "busbw/ceil");
    for (int op = 0; op < OP_COUNT; op++)
        for (int n = 2; n <= max_ranks; n *= 2)
            for (int mib = 1; mib <= max_mib; mib *= 4) {
                coll_case c = {.op = op, .iters = iters, .bytes = (size_t)mib << 20};
                st = cpar_spawn(n, backend, run_case, &c);
                if (st != CPAR_OK) {
                    fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
                    return 1;
                }
                double bus;
                size_t bytes = c.bytes / sizeof(float) / (size_t)n * (size_t)n * sizeof(float);
                uint64_t min = min_recv(op, n, bytes, &bus);
                double algbw = (double)bytes / c.seconds / 1e9;
                printf("%-15s %5d %6d MiB %9.3f ms %12llu %12llu %6.2f GB/s %6.2f GB/s %7.2f\n", op_names[op], n, mib,
                       c.seconds * 1e3, (unsigned long long)c.recv, (unsigned long long)min, algbw, algbw * bus,
                       algbw * bus / ceiling.gbps);
            }
    return 0;
}
