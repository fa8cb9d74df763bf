/* SPDX-License-Identifier: MIT */
/* tests/mp_prog.c — one rank of a multi-process job on the NCCL backend,
 * built against nccl-sim (build/ncclsim/mp_prog) and run by tests/test_mp.c
 * under cparrun or with torchrun's variables set by the test:
 *
 *   mp_prog [ok]     cpar_init_from_env -> TCP store -> ncclUniqueId -> NCCL
 *                    communicator -> a tp=2 x cp=2 grid; collectives on every
 *                    group and a sequence-parallel column -> row linear MLP
 *                    forward and backward, checked against a 1-rank fp64
 *                    reference; prints "rank R ok"
 *   mp_prog die K    rank K is killed (SIGKILL) while its peers are inside an
 *                    all-reduce; they must fail with a clear error
 *   mp_prog nostart K  rank K exits 0 before cpar_init_from_env; the others
 *                    must fail at the deadline naming it
 *   mp_prog badarg K rank K's all-reduce fails its own checks (it stays alive
 *                    for 5 s); the others must fail at once naming it, and
 *                    print how long their all-reduce took ("after N ms")
 *   mp_prog queued K the others queue an all-reduce without rank K and call
 *                    cpar_finalize, whose wait for it times out; rank K makes
 *                    the same call three deadlines late and must fail at once
 *                    with the timeout's own words, not NCCL's abort
 *   mp_prog abort K  rank K queues an all-reduce the others never join and
 *                    waits on it; they call cpar_abort: its wait must fail
 *                    naming "rank N aborted (cpar_abort)"
 *
 * Exit status: 0 when every check passed, 1 when a cpar call failed (its
 * message on stderr), 2 when a result was wrong. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* POSIX and Linux APIs under -std=c11, as in cpar.c */
#endif
#include "cpar.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define RANK_PROG "mp_prog"
#include "rank_prog.h"

/* A device tensor of shape holding host data (F32 from doubles, or I32). */
static int upload(cpar_ctx *ctx, const void *host, cpar_dtype dt, int ndim, const int64_t *shape, cpar_tensor *t) {
    TRY(cpar_tensor_alloc(ctx, dt, ndim, shape, t));
    cpar_tensor h = cpar_tensor_make((void *)host, dt, ndim, shape, CPAR_HOST);
    TRY(cpar_tensor_copy(ctx, &h, t));
    return 0;
}

static int download(cpar_ctx *ctx, const cpar_tensor *t, void *host) {
    cpar_tensor h = cpar_tensor_make(host, t->dtype, t->ndim, t->shape, CPAR_HOST);
    TRY(cpar_tensor_copy(ctx, t, &h));
    return 0;
}

/* ---- collectives on one group, checked exactly on integers ---------------- */

#define ROWS 3
#define COLS 5

/* Member m's element i (I32, distinct per member and call). */
static int32_t elem(int call, int m, int64_t i) { return (int32_t)(call * 10000 + m * 100 + (int32_t)i); }

static int check_group(cpar_ctx *ctx, cpar_group *g, int call) {
    int n = cpar_group_size(g), me = cpar_group_rank(g);
    int64_t row = COLS, mine[2] = {ROWS, COLS}, all[2] = {ROWS * n, COLS};
    int32_t x[ROWS * COLS * 8], got[ROWS * COLS * 8];
    for (int64_t i = 0; i < ROWS * COLS * n; i++) x[i] = elem(call, me, i);
    cpar_tensor in, out, big, small;
    if (upload(ctx, x, CPAR_I32, 2, mine, &in) || upload(ctx, x, CPAR_I32, 2, all, &big)) return 1;
    TRY(cpar_tensor_alloc(ctx, CPAR_I32, 2, all, &out));
    TRY(cpar_tensor_alloc(ctx, CPAR_I32, 2, mine, &small));
    /* all-reduce (sum) */
    TRY(cpar_all_reduce(g, &in, &small, CPAR_SUM));
    if (download(ctx, &small, got)) return 1;
    for (int64_t i = 0; i < ROWS * COLS; i++) {
        int64_t want = 0;
        for (int m = 0; m < n; m++) want += elem(call, m, i);
        CHECK(got[i] == want, "group call %d: all_reduce element %lld is %d, expected %lld", call, (long long)i,
              got[i], (long long)want);
    }
    /* all-gather */
    TRY(cpar_all_gather(g, &in, &out, NULL));
    if (download(ctx, &out, got)) return 1;
    for (int m = 0; m < n; m++)
        for (int64_t i = 0; i < ROWS * row; i++)
            CHECK(got[m * ROWS * row + i] == elem(call, m, i), "group call %d: all_gather from member %d", call, m);
    /* reduce-scatter: this member's rows of the sum */
    TRY(cpar_reduce_scatter(g, &big, &small, CPAR_SUM, NULL));
    if (download(ctx, &small, got)) return 1;
    for (int64_t i = 0; i < ROWS * row; i++) {
        int64_t want = 0;
        for (int m = 0; m < n; m++) want += elem(call, m, me * ROWS * row + i);
        CHECK(got[i] == want, "group call %d: reduce_scatter element %lld", call, (long long)i);
    }
    /* all-to-all: block j of member m goes to member j */
    TRY(cpar_all_to_all_single(g, &big, &out, NULL, NULL));
    if (download(ctx, &out, got)) return 1;
    for (int m = 0; m < n; m++)
        for (int64_t i = 0; i < ROWS * row; i++)
            CHECK(got[m * ROWS * row + i] == elem(call, m, me * ROWS * row + i), "group call %d: all_to_all", call);
    /* broadcast from the last member */
    TRY(cpar_tensor_copy(ctx, &in, &small));
    TRY(cpar_broadcast(g, &small, n - 1));
    if (download(ctx, &small, got)) return 1;
    for (int64_t i = 0; i < ROWS * row; i++) CHECK(got[i] == elem(call, n - 1, i), "group call %d: broadcast", call);
    /* ring shift by one */
    TRY(cpar_ring_shift(g, &in, &small, 1));
    if (download(ctx, &small, got)) return 1;
    for (int64_t i = 0; i < ROWS * row; i++)
        CHECK(got[i] == elem(call, (me + n - 1) % n, i), "group call %d: ring_shift", call);
    TRY(cpar_barrier(g));
    cpar_tensor *ts[] = {&in, &out, &big, &small};
    for (int i = 0; i < 4; i++) TRY(cpar_tensor_free(ctx, ts[i]));
    return 0;
}

/* ---- a sequence-parallel MLP over tp against a 1-rank fp64 reference ------- */

#define S 8
#define B 2
#define H 8
#define F 16

static int check_mlp(cpar_ctx *ctx) {
    cpar_group *tp = cpar_grid_group(ctx, CPAR_GROUP_TP);
    int t = cpar_group_size(tp), tr = cpar_group_rank(tp);
    int64_t sl = S / t, fl = F / t;
    /* the full problem, the same on every rank */
    static float w1[F * H], w2[H * F], x[S * B * H], dy[S * B * H];
    static double h1[S * B * F], y[S * B * H], dh[S * B * F], dx[S * B * H], dw1[F * H], dw2[H * F];
    for (int i = 0; i < F * H; i++) w1[i] = (float)(0.3 * value(1, i)), w2[i] = (float)(0.3 * value(2, i));
    for (int i = 0; i < S * B * H; i++) x[i] = (float)value(3, i), dy[i] = (float)value(4, i);
    for (int tok = 0; tok < S * B; tok++) {
        for (int f = 0; f < F; f++) {
            double a = 0;
            for (int k = 0; k < H; k++) a += (double)x[tok * H + k] * w1[f * H + k];
            h1[tok * F + f] = a;
        }
        for (int o = 0; o < H; o++) {
            double a = 0;
            for (int f = 0; f < F; f++) a += h1[tok * F + f] * w2[o * F + f];
            y[tok * H + o] = a;
        }
        for (int f = 0; f < F; f++) {
            double a = 0;
            for (int o = 0; o < H; o++) a += (double)dy[tok * H + o] * w2[o * F + f];
            dh[tok * F + f] = a;
        }
        for (int k = 0; k < H; k++) {
            double a = 0;
            for (int f = 0; f < F; f++) a += dh[tok * F + f] * w1[f * H + k];
            dx[tok * H + k] = a;
        }
    }
    for (int f = 0; f < F; f++)
        for (int k = 0; k < H; k++) {
            double a = 0, c = 0;
            for (int tok = 0; tok < S * B; tok++) a += dh[tok * F + f] * x[tok * H + k];
            dw1[f * H + k] = a;
            for (int tok = 0; tok < S * B; tok++) c += (double)dy[tok * H + k] * h1[tok * F + f];
            dw2[k * F + f] = c;
        }
    /* the parallel layers */
    cpar_linear *col, *row;
    cpar_linear_config cc = {.input_size = H, .output_size = F, .sequence_parallel = true};
    cpar_linear_config rc = {.input_size = F, .output_size = H, .input_is_parallel = true, .sequence_parallel = true};
    TRY(cpar_column_parallel_linear_create(tp, &cc, &col));
    TRY(cpar_row_parallel_linear_create(tp, &rc, &row));
    int64_t w1s[2] = {F, H}, w2s[2] = {H, F};
    cpar_tensor m1 = cpar_tensor_make(w1, CPAR_F32, 2, w1s, CPAR_HOST), m2 = cpar_tensor_make(w2, CPAR_F32, 2, w2s, CPAR_HOST);
    TRY(cpar_linear_init_from_master(col, &m1, NULL));
    TRY(cpar_linear_init_from_master(row, &m2, NULL));
    int64_t xs[3] = {sl, B, H}, hs[3] = {S, B, fl};
    cpar_tensor tx, tdy, th, ty, tdh, tdx;
    if (upload(ctx, x + tr * sl * B * H, CPAR_F32, 3, xs, &tx) || upload(ctx, dy + tr * sl * B * H, CPAR_F32, 3, xs, &tdy))
        return 1;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 3, hs, &th));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 3, hs, &tdh));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 3, xs, &ty));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 3, xs, &tdx));
    TRY(cpar_linear_forward(col, &tx, &th, NULL));
    TRY(cpar_linear_forward(row, &th, &ty, NULL));
    TRY(cpar_linear_backward(row, &tdy, &tdh));
    TRY(cpar_linear_backward(col, &tdh, &tdx));
    float got[S * B * F];
    const double tol = 1e-5;
    if (download(ctx, &ty, got)) return 1;
    for (int64_t i = 0; i < sl * B * H; i++)
        CHECK(fabs(got[i] - y[tr * sl * B * H + i]) <= tol, "mlp y[%lld] = %.8g, expected %.8g", (long long)i,
              got[i], y[tr * sl * B * H + i]);
    if (download(ctx, &tdx, got)) return 1;
    for (int64_t i = 0; i < sl * B * H; i++)
        CHECK(fabs(got[i] - dx[tr * sl * B * H + i]) <= tol, "mlp dx[%lld] = %.8g, expected %.8g", (long long)i,
              got[i], dx[tr * sl * B * H + i]);
    cpar_tensor g1 = cpar_linear_weight_grad(col), g2 = cpar_linear_weight_grad(row);
    if (download(ctx, &g1, got)) return 1; /* [F/t, H]: rows tr*fl.. of dw1 */
    for (int64_t i = 0; i < fl * H; i++)
        CHECK(fabs(got[i] - dw1[tr * fl * H + i]) <= tol, "mlp dw1[%lld] = %.8g, expected %.8g", (long long)i,
              got[i], dw1[tr * fl * H + i]);
    if (download(ctx, &g2, got)) return 1; /* [H, F/t]: columns tr*fl.. of dw2 */
    for (int64_t o = 0; o < H; o++)
        for (int64_t f = 0; f < fl; f++)
            CHECK(fabs(got[o * fl + f] - dw2[o * F + tr * fl + f]) <= tol, "mlp dw2[%lld,%lld]", (long long)o,
                  (long long)f);
    cpar_tensor *ts[] = {&tx, &tdy, &th, &ty, &tdh, &tdx};
    for (int i = 0; i < 6; i++) TRY(cpar_tensor_free(ctx, ts[i]));
    TRY(cpar_linear_destroy(col));
    TRY(cpar_linear_destroy(row));
    return 0;
}

static int job(const char *mode, int k) {
    cpar_init_config cfg = {.backend = CPAR_BACKEND_NCCL}; /* deadline: $CPAR_TIMEOUT_MS */
    cpar_ctx *ctx = NULL;
    TRY(cpar_init_from_env(&cfg, &ctx));
    int world = cpar_world_size(ctx);
    cpar_group *w = cpar_world_group(ctx);
    int64_t shape[1] = {64};
    float ones[64];
    for (int i = 0; i < 64; i++) ones[i] = 1.f;
    cpar_tensor t;
    if (upload(ctx, ones, CPAR_F32, 1, shape, &t)) return 1;
    TRY(cpar_all_reduce(w, &t, &t, CPAR_SUM)); /* a healthy start */
    if (!strcmp(mode, "badarg")) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        cpar_status st;
        if (rank == k) { /* an output one element short: refused by its own checks */
            int64_t short_shape[1] = {63};
            cpar_tensor s;
            TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, short_shape, &s));
            st = cpar_all_reduce(w, &t, &s, CPAR_SUM);
        } else {
            st = cpar_all_reduce(w, &t, &t, CPAR_SUM);
            if (st == CPAR_OK) st = cpar_sync(ctx);
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        long ms = (long)((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000);
        printf("rank %d: %s: %s (after %ld ms)\n", rank, cpar_status_string(st), cpar_last_error(ctx), ms);
        if (rank == k) {
            struct timespec ts = {5, 0}; /* alive: its peers must not need it to leave */
            nanosleep(&ts, NULL);
        }
        cpar_finalize(ctx);
        return st == CPAR_OK ? 2 : 1;
    }
    if (!strcmp(mode, "queued")) {
        TRY(cpar_sync(ctx)); /* the healthy start is done everywhere: nothing else is in flight */
        if (rank == k) {
            const char *env_ms = getenv("CPAR_TIMEOUT_MS");
            const long ms = 3 * (env_ms ? atol(env_ms) : 300000);
            struct timespec ts = {ms / 1000, ms % 1000 * 1000000L}; /* the peers' finalize has timed out by now */
            nanosleep(&ts, NULL);
        }
        cpar_status st = cpar_all_reduce(w, &t, &t, CPAR_SUM); /* the others': queued, rank K is not there */
        if (rank == k && st == CPAR_OK) st = cpar_sync(ctx);
        printf("rank %d: all_reduce: %s: %s\n", rank, cpar_status_string(st), st ? cpar_last_error(ctx) : "queued");
        cpar_finalize(ctx); /* the others': waits for the queued all-reduce until the deadline */
        return rank == k ? (st == CPAR_OK ? 2 : 1) : st == CPAR_OK ? 0 : 1;
    }
    if (!strcmp(mode, "abort")) {
        TRY(cpar_sync(ctx));
        cpar_status st = CPAR_OK;
        if (rank == k) { /* queued, then waited on: the others never join it */
            st = cpar_all_reduce(w, &t, &t, CPAR_SUM);
            if (st == CPAR_OK) st = cpar_sync(ctx);
            printf("rank %d: all_reduce: %s: %s\n", rank, cpar_status_string(st), st ? cpar_last_error(ctx) : "");
        } else {
            struct timespec ts = {0, 300 * 1000000L}; /* rank K is waiting on its all-reduce by now */
            nanosleep(&ts, NULL);
            TRY(cpar_abort(ctx));
        }
        cpar_finalize(ctx);
        return rank == k ? (st == CPAR_OK ? 2 : 1) : 0;
    }
    if (!strcmp(mode, "die")) {
        if (rank == k) {
            struct timespec ts = {0, 200 * 1000000L}; /* the peers are inside the next all-reduce by now */
            nanosleep(&ts, NULL);
            raise(SIGKILL);
        }
        cpar_status st = cpar_all_reduce(w, &t, &t, CPAR_SUM);
        /* on NCCL the call may return once enqueued (as ncclAllReduce does):
         * then its first wait fails */
        if (st == CPAR_OK) st = cpar_sync(ctx);
        fprintf(stderr, "mp_prog: rank %d: all_reduce after rank %d died -> %s: %s\n", rank, k,
                cpar_status_string(st), cpar_last_error(ctx));
        cpar_finalize(ctx);
        return st == CPAR_OK ? 2 : 1;
    }
    float got[64];
    if (download(ctx, &t, got)) return 1;
    CHECK(got[0] == (float)world && got[63] == (float)world, "all_reduce of ones gave %g", got[0]);
    TRY(cpar_tensor_free(ctx, &t));
    cpar_grid_config gc = {.tp = 2, .cp = world / 2};
    TRY(cpar_grid_init(ctx, &gc));
    static const cpar_group_kind kinds[] = {CPAR_GROUP_WORLD, CPAR_GROUP_TP, CPAR_GROUP_CP, CPAR_GROUP_DP,
                                            CPAR_GROUP_TP_CP};
    for (int i = 0; i < 5; i++) {
        int r = check_group(ctx, cpar_grid_group(ctx, kinds[i]), i);
        if (r) return r;
    }
    int r = check_mlp(ctx);
    if (r) return r;
    TRY(cpar_sync(ctx));
    TRY(cpar_finalize(ctx));
    printf("rank %d ok\n", rank);
    return 0;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "ok";
    int k = argc > 2 ? atoi(argv[2]) : -1;
    cpar_env env;
    cpar_status st = cpar_env_read(&env);
    if (st != CPAR_OK) {
        fprintf(stderr, "mp_prog: cpar_env_read: %s\n", cpar_thread_last_error());
        return 1;
    }
    rank = env.rank;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!strcmp(mode, "nostart") && rank == k) {
        printf("rank %d not starting\n", rank);
        return 0;
    }
    if (strcmp(mode, "ok") && strcmp(mode, "die") && strcmp(mode, "nostart") && strcmp(mode, "badarg") &&
        strcmp(mode, "queued") && strcmp(mode, "abort")) {
        fprintf(stderr, "mp_prog: unknown mode \"%s\" (ok, die K, nostart K, badarg K, queued K, abort K)\n", mode);
        return 1;
    }
    return job(mode, k);
}
