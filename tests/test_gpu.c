/* SPDX-License-Identifier: MIT */
/* test_gpu.c — the GPU suite: the NCCL backend and the CUDA kernels on real
 * GPUs (built in CUDA builds, against build/cuda/libcpar.a). `make test` also
 * runs the same bodies on nccl-sim (build/ncclsim/test_gpu: the same cpar.c
 * code path on simulated GPUs and the NCCL simulator), so every line here
 * has run before a GPU sees it. Every spawn counts the ranks whose function
 * ran (tu_spawn_with) and fails unless all did.
 *
 * With no GPU visible it prints one line saying so and exits 0 without
 * running Check. Otherwise it runs, on CPAR_BACKEND_NCCL, a 1-rank world and
 * an n-GPU single-process world (n = cpar_device_count(), at most 8), then
 * on CPAR_BACKEND_DEVICE worlds of 2 and 4 ranks sharing the GPUs: every
 * collective against a host reference computed in double, and the
 * element-wise ops on device tensors against the same ops on host tensors
 * (cpar's host reference kernels: fill, cast, axpby, row reduce, gelu,
 * rmsnorm forward and backward, split, concat, AdamW and the gradient norm),
 * and local attention (the
 * flash forward and backward kernels) against the host reference.
 *
 * CUDA is not fork-safe and Check forks a process per test, so this process
 * never touches CUDA itself: the GPU count comes from a child process, and
 * every CUDA/NCCL object is created inside a test. */
#define _GNU_SOURCE /* fork, waitpid, unsetenv */
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

#define MAX_GPUS 8
#define ROW 15 /* elements of a [rows, 3, 5] row */

static int n_gpus; /* set in main from the probe */

/* CPAR_GPU_SUITE=quick (set by tests/run.sh for nccl-sim, where kernels run
 * on the CPU): every test and every code path, on the smaller problem sizes
 * only. Real GPUs run everything. */
static bool quick(void) {
    const char *v = getenv("CPAR_GPU_SUITE");
    return v && !strcmp(v, "quick");
}

/* cpar_device_count() in a child process, so this one stays CUDA-free; -1 if the probe could not run. */
static int probe_gpu_count(void) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        int n = cpar_device_count();
        _exit(n > 100 ? 100 : n < 0 ? 0 : n);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
    return WEXITSTATUS(status);
}

static cpar_status gpu_spawn(int nranks, cpar_rank_fn fn, void *arg) {
    cpar_init_config c = {.backend = CPAR_BACKEND_NCCL, .timeout_ms = 120000};
    return tu_spawn_with(nranks, &c, fn, arg);
}

/* World sizes of the loop tests: one GPU, then all of them. */
static int world_of(int i) { return i == 0 ? 1 : n_gpus; }

static uint64_t seed_of(int call, int rank) { return (uint64_t)call * 1000003u + (uint64_t)rank * 7919u + 11u; }

static int mod(int a, int n) { return ((a % n) + n) % n; }

static int64_t *shape3(int64_t rows, int64_t *s) {
    s[0] = rows;
    s[1] = 3;
    s[2] = 5;
    return s;
}

static void free_tensor(cpar_ctx *ctx, cpar_tensor *t) { TU_OK(cpar_tensor_free(ctx, t)); }

/* NCCL reduces in its own order (and may round F16/BF16 partial sums), so
 * float sums get a bound that grows with the number of ranks. */
static double gpu_tol(cpar_dtype dt, cpar_reduce_op op, int n) {
    if (op != CPAR_SUM || !cpar_dtype_is_float(dt)) return 0.0;
    return dt == CPAR_F32 ? 1e-6 * n : tu_tol(dt) * n;
}

static double reduce2(cpar_reduce_op op, double a, double b) {
    return op == CPAR_SUM ? a + b : op == CPAR_MAX ? fmax(a, b) : fmin(a, b);
}

/* ---- collectives ------------------------------------------------------------------ */

static const cpar_dtype coll_dtypes[] = {CPAR_F32, CPAR_F16, CPAR_BF16, CPAR_I32, CPAR_I64, CPAR_U8};
#define N_COLL_DTYPES 6

static void gpu_all_reduce(cpar_ctx *ctx, cpar_group *g, int *call) {
    int n = cpar_group_size(g), me = cpar_group_rank(g);
    static const int64_t counts[] = {75, 4099};
    for (int d = 0; d < N_COLL_DTYPES; d++)
        for (int o = 0; o < CPAR_REDUCE_OP_COUNT; o++)
            for (int k = 0; k < 2; k++, (*call)++) {
                cpar_dtype dt = coll_dtypes[d];
                cpar_reduce_op op = (cpar_reduce_op)o;
                if (dt == CPAR_U8 && op == CPAR_SUM) continue;
                int64_t cnt = counts[k], shape[] = {cnt};
                void *x[MAX_GPUS];
                for (int r = 0; r < n; r++) x[r] = tu_random_host(dt, cnt, seed_of(*call, r));
                cpar_tensor in = tu_upload(ctx, x[me], dt, 1, shape), out = tu_alloc_poisoned(ctx, dt, 1, shape);
                TU_OK(cpar_all_reduce(g, &in, k ? &in : &out, op)); /* the long one in place */
                TU_OK(cpar_sync(ctx));
                double *want = malloc((size_t)cnt * sizeof *want);
                for (int64_t i = 0; i < cnt; i++) {
                    double acc = tu_get(x[0], dt, i);
                    for (int r = 1; r < n; r++) acc = reduce2(op, acc, tu_get(x[r], dt, i));
                    want[i] = tu_round(dt, acc);
                }
                void *got = tu_download(ctx, k ? &in : &out);
                char msg[256];
                ck_assert_msg(tu_mismatch(got, dt, want, cnt, gpu_tol(dt, op, n), msg, sizeof msg) < 0,
                              "all_reduce op %d %s n %d: %s", o, cpar_dtype_name(dt), n, msg);
                free(got);
                free(want);
                for (int r = 0; r < n; r++) free(x[r]);
                free_tensor(ctx, &in);
                free_tensor(ctx, &out);
            }
}

/* All-gather and reduce-scatter, equal (NULL sizes) and uneven with a zero-row rank. */
static void gpu_gather_scatter(cpar_ctx *ctx, cpar_group *g, int *call) {
    int n = cpar_group_size(g), me = cpar_group_rank(g);
    for (int d = 0; d < N_COLL_DTYPES; d++)
        for (int uneven = 0; uneven < 2; uneven++, (*call)++) {
            cpar_dtype dt = coll_dtypes[d];
            size_t es = cpar_dtype_size(dt);
            int64_t rows[MAX_GPUS], total = 0, off = 0, s[3];
            for (int r = 0; r < n; r++) {
                rows[r] = uneven ? (r == 1 ? 0 : r % 3 + 1) : 3;
                if (r < me) off += rows[r];
                total += rows[r];
            }
            /* all-gather of rows[r] rows from each rank */
            void *x[MAX_GPUS];
            for (int r = 0; r < n; r++) x[r] = tu_random_host(dt, total * ROW, seed_of(*call, r));
            cpar_tensor in = tu_upload(ctx, x[me], dt, 3, shape3(rows[me], s));
            cpar_tensor out = tu_alloc_poisoned(ctx, dt, 3, shape3(total, s));
            TU_OK(cpar_all_gather(g, &in, &out, uneven ? rows : NULL));
            char *want = malloc((size_t)(total * ROW) * es + 1), *at = want;
            for (int r = 0; r < n; r++) {
                memcpy(at, x[r], (size_t)(rows[r] * ROW) * es);
                at += rows[r] * ROW * (int64_t)es;
            }
            void *got = tu_download(ctx, &out);
            TU_EXPECT_SAME(got, want, dt, total * ROW);
            free(got);
            free(want);
            free_tensor(ctx, &in);
            free_tensor(ctx, &out);

            /* reduce-scatter of [total, 3, 5] into this rank's rows */
            cpar_reduce_op op = dt == CPAR_U8 ? CPAR_MAX : CPAR_SUM;
            in = tu_upload(ctx, x[me], dt, 3, shape3(total, s));
            out = tu_alloc_poisoned(ctx, dt, 3, shape3(rows[me], s));
            TU_OK(cpar_reduce_scatter(g, &in, &out, op, uneven ? rows : NULL));
            int64_t cnt = rows[me] * ROW;
            double *rwant = malloc((size_t)cnt * sizeof *rwant + 1);
            for (int64_t i = 0; i < cnt; i++) {
                double acc = tu_get(x[0], dt, off * ROW + i);
                for (int r = 1; r < n; r++) acc = reduce2(op, acc, tu_get(x[r], dt, off * ROW + i));
                rwant[i] = tu_round(dt, acc);
            }
            got = tu_download(ctx, &out);
            char msg[256];
            ck_assert_msg(tu_mismatch(got, dt, rwant, cnt, gpu_tol(dt, op, n), msg, sizeof msg) < 0,
                          "reduce_scatter %s n %d%s: %s", cpar_dtype_name(dt), n, uneven ? " uneven" : "", msg);
            free(got);
            free(rwant);
            for (int r = 0; r < n; r++) free(x[r]);
            free_tensor(ctx, &in);
            free_tensor(ctx, &out);
        }
}

static int64_t split_of(int i, int j, bool equal) { return equal ? 2 : (i + 2 * j + 1) % 3; }

static void gpu_all_to_all(cpar_ctx *ctx, cpar_group *g, int *call) {
    int n = cpar_group_size(g), me = cpar_group_rank(g);
    for (int d = 0; d < N_COLL_DTYPES; d++)
        for (int equal = 0; equal < 2; equal++, (*call)++) {
            cpar_dtype dt = coll_dtypes[d];
            size_t row = ROW * cpar_dtype_size(dt);
            int64_t in_rows[MAX_GPUS] = {0}, in_splits[MAX_GPUS], out_splits[MAX_GPUS], out_rows = 0, s[3];
            for (int i = 0; i < n; i++)
                for (int j = 0; j < n; j++) in_rows[i] += split_of(i, j, equal);
            for (int j = 0; j < n; j++) in_splits[j] = split_of(me, j, equal);
            for (int i = 0; i < n; i++) out_rows += out_splits[i] = split_of(i, me, equal);
            void *x[MAX_GPUS];
            for (int r = 0; r < n; r++) x[r] = tu_random_host(dt, in_rows[r] * ROW, seed_of(*call, r));
            cpar_tensor in = tu_upload(ctx, x[me], dt, 3, shape3(in_rows[me], s));
            cpar_tensor out = tu_alloc_poisoned(ctx, dt, 3, shape3(out_rows, s));
            TU_OK(cpar_all_to_all_single(g, &in, &out, equal ? NULL : out_splits, equal ? NULL : in_splits));
            char *want = malloc((size_t)out_rows * row + 1), *at = want;
            for (int i = 0; i < n; i++) {
                int64_t first = 0;
                for (int j = 0; j < me; j++) first += split_of(i, j, equal);
                memcpy(at, (char *)x[i] + first * (int64_t)row, (size_t)split_of(i, me, equal) * row);
                at += split_of(i, me, equal) * (int64_t)row;
            }
            void *got = tu_download(ctx, &out);
            TU_EXPECT_SAME(got, want, dt, out_rows * ROW);
            free(got);
            free(want);
            for (int r = 0; r < n; r++) free(x[r]);
            free_tensor(ctx, &in);
            free_tensor(ctx, &out);
        }
}

/* Broadcast from every root, then ring shifts and a send/recv exchange. */
static void gpu_broadcast_p2p(cpar_ctx *ctx, cpar_group *g, int *call) {
    int n = cpar_group_size(g), me = cpar_group_rank(g);
    int64_t s[3];
    for (int d = 0; d < N_COLL_DTYPES; d++) {
        cpar_dtype dt = coll_dtypes[d];
        for (int root = 0; root < n; root++, (*call)++) {
            void *x[MAX_GPUS];
            for (int r = 0; r < n; r++) x[r] = tu_random_host(dt, 7 * ROW, seed_of(*call, r));
            cpar_tensor buf = tu_upload(ctx, x[me], dt, 3, shape3(7, s));
            TU_OK(cpar_broadcast(g, &buf, root));
            void *got = tu_download(ctx, &buf);
            TU_EXPECT_SAME(got, x[root], dt, 7 * ROW);
            free(got);
            for (int r = 0; r < n; r++) free(x[r]);
            free_tensor(ctx, &buf);
        }
        static const int shifts[] = {1, -1, 2};
        for (int k = 0; k < 3; k++)
            for (int ring = 0; ring < 2; ring++, (*call)++) {
                int from = mod(me - shifts[k], n), to = mod(me + shifts[k], n);
                void *x[MAX_GPUS];
                for (int r = 0; r < n; r++) x[r] = tu_random_host(dt, 5 * ROW, seed_of(*call, r));
                cpar_tensor in = tu_upload(ctx, x[me], dt, 3, shape3(5, s));
                cpar_tensor out = tu_alloc_poisoned(ctx, dt, 3, s);
                if (ring) TU_OK(cpar_ring_shift(g, &in, &out, shifts[k]));
                else TU_OK(cpar_sendrecv(g, &in, to, &out, from));
                void *got = tu_download(ctx, &out);
                TU_EXPECT_SAME(got, x[from], dt, 5 * ROW);
                free(got);
                for (int r = 0; r < n; r++) free(x[r]);
                free_tensor(ctx, &in);
                free_tensor(ctx, &out);
            }
    }
    TU_OK(cpar_barrier(g));
}

typedef void (*coll_case)(cpar_ctx *ctx, cpar_group *g, int *call);

typedef struct {
    coll_case fn;
    cpar_backend backend;
} coll_run;

static cpar_status rank_coll(cpar_ctx *ctx, void *p) {
    const coll_run *run = p;
    ck_assert_int_eq(cpar_ctx_backend(ctx), run->backend);
    /* NCCL: GPU r; the device backend: the ranks share the GPUs, r mod n. */
    ck_assert_int_eq(cpar_device(ctx), run->backend == CPAR_BACKEND_NCCL ? cpar_rank(ctx) : cpar_rank(ctx) % n_gpus);
    int call = 0;
    run->fn(ctx, cpar_world_group(ctx), &call);
    /* The same on a sub-group: the ranks of each parity, reversed. */
    cpar_group *sub;
    TU_OK(cpar_group_split(cpar_world_group(ctx), cpar_rank(ctx) % 2, -cpar_rank(ctx), &sub));
    run->fn(ctx, sub, &call);
    TU_OK(cpar_group_destroy(sub));
    TU_OK(cpar_sync(ctx));
    return CPAR_OK;
}

/* Loop index i: NCCL on 1 rank, then on every GPU (when there are several);
 * then the device backend on 2 and 4 ranks sharing the GPUs (one GPU runs
 * the multi-rank paths too). */
static void run_coll(coll_case fn, int i, int nccl_worlds) {
    coll_run run = {fn, i < nccl_worlds ? CPAR_BACKEND_NCCL : CPAR_BACKEND_DEVICE};
    int world = i < nccl_worlds ? world_of(i) : i == nccl_worlds ? 2 : 4;
    cpar_init_config c = {.backend = run.backend, .timeout_ms = 120000};
    TU_OK(tu_spawn_with(world, &c, rank_coll, &run));
}
static int nccl_worlds(void) { return n_gpus > 1 ? 2 : 1; } /* 1 rank, then every GPU */

START_TEST(test_all_reduce) { run_coll(gpu_all_reduce, _i, nccl_worlds()); }
END_TEST
START_TEST(test_gather_scatter) { run_coll(gpu_gather_scatter, _i, nccl_worlds()); }
END_TEST
START_TEST(test_all_to_all) { run_coll(gpu_all_to_all, _i, nccl_worlds()); }
END_TEST
START_TEST(test_broadcast_p2p) { run_coll(gpu_broadcast_p2p, _i, nccl_worlds()); }
END_TEST

/* ---- element-wise ops: device kernels against the host reference ---------------------- */

static const cpar_dtype float_dtypes[] = {CPAR_F32, CPAR_F16, CPAR_BF16};
static const int64_t op_sizes[] = {1, 31, 33, 1000, 4097, 100003};
#define N_OP_SIZES (quick() ? 4 : (int)(sizeof op_sizes / sizeof op_sizes[0]))

/* The same op on a host copy and on a device copy of the data. */
typedef struct {
    cpar_tensor h, d;
    void *mem;
} pair;

static pair pair_upload(cpar_ctx *ctx, const void *x, cpar_dtype dt, int ndim, const int64_t *shape) {
    pair p;
    cpar_tensor probe = cpar_tensor_make(NULL, dt, ndim, shape, CPAR_HOST);
    size_t bytes = cpar_tensor_nbytes(&probe);
    p.mem = malloc(bytes + 1);
    memcpy(p.mem, x, bytes);
    p.h = cpar_tensor_make(p.mem, dt, ndim, shape, CPAR_HOST);
    p.d = tu_upload(ctx, x, dt, ndim, shape);
    return p;
}

static pair pair_poisoned(cpar_ctx *ctx, cpar_dtype dt, int ndim, const int64_t *shape) {
    pair p;
    cpar_tensor probe = cpar_tensor_make(NULL, dt, ndim, shape, CPAR_HOST);
    size_t bytes = cpar_tensor_nbytes(&probe);
    p.mem = malloc(bytes + 1);
    memset(p.mem, 0xff, bytes);
    p.h = cpar_tensor_make(p.mem, dt, ndim, shape, CPAR_HOST);
    p.d = tu_alloc_poisoned(ctx, dt, ndim, shape);
    return p;
}

/* Device result against host result: bit for bit, or within tol (relative). */
static void pair_check(cpar_ctx *ctx, pair *p, double tol, const char *what) {
    int64_t n = cpar_tensor_numel(&p->h);
    void *got = tu_download(ctx, &p->d);
    if (tol == 0.0) {
        int64_t bad = tu_bits_mismatch(got, p->mem, p->h.dtype, n);
        double g = bad < 0 ? 0 : tu_get(got, p->h.dtype, bad), h = bad < 0 ? 0 : tu_get(p->mem, p->h.dtype, bad);
        ck_assert_msg(bad < 0, "%s (%s, %lld elements): element %lld is %.9g on the GPU, %.9g on the host", what,
                      cpar_dtype_name(p->h.dtype), (long long)n, (long long)bad, g, h);
    } else {
        double *want = malloc((size_t)n * sizeof *want + 1);
        for (int64_t i = 0; i < n; i++) want[i] = tu_get(p->mem, p->h.dtype, i);
        char msg[256];
        ck_assert_msg(tu_mismatch(got, p->h.dtype, want, n, tol, msg, sizeof msg) < 0, "%s: %s", what, msg);
        free(want);
    }
    free(got);
}

static void pair_free(cpar_ctx *ctx, pair *p) {
    free_tensor(ctx, &p->d);
    free(p->mem);
}

static cpar_status rank_ops(cpar_ctx *ctx, void *unused) {
    (void)unused;
    for (int k = 0; k < N_OP_SIZES; k++) {
        int64_t n = op_sizes[k], shape[] = {n};
        /* fill, every dtype */
        for (int dt = 0; dt < CPAR_DTYPE_COUNT; dt++) {
            pair t = pair_poisoned(ctx, (cpar_dtype)dt, 1, shape);
            double v = cpar_dtype_is_float((cpar_dtype)dt) ? 0.1 : 77;
            TU_OK(cpar_fill(ctx, &t.h, v));
            TU_OK(cpar_fill(ctx, &t.d, v));
            pair_check(ctx, &t, 0.0, "fill");
            pair_free(ctx, &t);
        }
        for (int a = 0; a < 3; a++) {
            cpar_dtype dt = float_dtypes[a];
            void *x = tu_random_host(dt, n, 3 + k), *y = tu_random_host(dt, n, 30 + k);
            /* cast to every float dtype */
            for (int b = 0; b < 3; b++) {
                pair src = pair_upload(ctx, x, dt, 1, shape), dst = pair_poisoned(ctx, float_dtypes[b], 1, shape);
                TU_OK(cpar_cast(ctx, &src.h, &dst.h));
                TU_OK(cpar_cast(ctx, &src.d, &dst.d));
                pair_check(ctx, &dst, 0.0, "cast");
                pair_free(ctx, &src);
                pair_free(ctx, &dst);
            }
            /* axpby (the GPU may fuse a multiply-add) */
            pair px = pair_upload(ctx, x, dt, 1, shape), py = pair_upload(ctx, y, dt, 1, shape);
            TU_OK(cpar_axpby(ctx, 1.25f, &px.h, -0.5f, &py.h));
            TU_OK(cpar_axpby(ctx, 1.25f, &px.d, -0.5f, &py.d));
            pair_check(ctx, &py, tu_tol(dt), "axpby");
            pair_free(ctx, &py);
            py = pair_poisoned(ctx, dt, 1, shape); /* beta 0: y never read */
            TU_OK(cpar_axpby(ctx, -2.0f, &px.h, 0.0f, &py.h));
            TU_OK(cpar_axpby(ctx, -2.0f, &px.d, 0.0f, &py.d));
            pair_check(ctx, &py, 0.0, "axpby beta 0");
            pair_free(ctx, &px);
            pair_free(ctx, &py);
            /* row reduce of [rows, cols] with cols = n and 3 rows */
            int64_t rshape[] = {3, n}, oshape[] = {3};
            void *rx = tu_random_host(dt, 3 * n, 300 + k);
            for (int op = 0; op < 3; op++) {
                pair in = pair_upload(ctx, rx, dt, 2, rshape), out = pair_poisoned(ctx, CPAR_F32, 1, oshape);
                TU_OK(cpar_row_reduce(ctx, &in.h, (cpar_row_op)op, &out.h));
                TU_OK(cpar_row_reduce(ctx, &in.d, (cpar_row_op)op, &out.d));
                /* sums within fp32 accumulation error of about sqrt(n) terms of size 1 */
                pair_check(ctx, &out, op == CPAR_ROW_MAX ? 0.0 : 1e-5 * sqrt((double)n), "row_reduce");
                pair_free(ctx, &in);
                pair_free(ctx, &out);
            }
            free(rx);
            /* gelu forward and backward (the GPU's tanhf may differ by an ulp) */
            pair gx = pair_upload(ctx, x, dt, 1, shape), gdy = pair_upload(ctx, y, dt, 1, shape);
            pair gy = pair_poisoned(ctx, dt, 1, shape), gdx = pair_poisoned(ctx, dt, 1, shape);
            TU_OK(cpar_gelu_forward(ctx, &gx.h, &gy.h));
            TU_OK(cpar_gelu_forward(ctx, &gx.d, &gy.d));
            TU_OK(cpar_gelu_backward(ctx, &gx.h, &gdy.h, &gdx.h));
            TU_OK(cpar_gelu_backward(ctx, &gx.d, &gdy.d, &gdx.d));
            pair_check(ctx, &gy, tu_tol(dt), "gelu");
            pair_check(ctx, &gdx, tu_tol(dt), "gelu backward");
            pair_free(ctx, &gx), pair_free(ctx, &gdy), pair_free(ctx, &gy), pair_free(ctx, &gdx);
            /* rmsnorm forward and backward over rows of n (3 rows), weight x[0..n) */
            void *nx = tu_random_host(dt, 3 * n, 400 + k), *ndy = tu_random_host(dt, 3 * n, 500 + k);
            int64_t wshape[] = {n};
            pair nin = pair_upload(ctx, nx, dt, 2, rshape), nw = pair_upload(ctx, x, dt, 1, wshape);
            pair ng = pair_upload(ctx, ndy, dt, 2, rshape), nout = pair_poisoned(ctx, dt, 2, rshape);
            pair ndx = pair_poisoned(ctx, dt, 2, rshape), ndw = pair_poisoned(ctx, CPAR_F32, 1, wshape);
            TU_OK(cpar_fill(ctx, &ndw.h, 0.0));
            TU_OK(cpar_fill(ctx, &ndw.d, 0.0));
            TU_OK(cpar_rmsnorm_forward(ctx, &nin.h, &nw.h, 1e-5f, &nout.h));
            TU_OK(cpar_rmsnorm_forward(ctx, &nin.d, &nw.d, 1e-5f, &nout.d));
            TU_OK(cpar_rmsnorm_backward(ctx, &nin.h, &nw.h, 1e-5f, &ng.h, &ndx.h, &ndw.h));
            TU_OK(cpar_rmsnorm_backward(ctx, &nin.d, &nw.d, 1e-5f, &ng.d, &ndx.d, &ndw.d));
            pair_check(ctx, &nout, 2 * tu_tol(dt), "rmsnorm");
            pair_check(ctx, &ndx, 4 * tu_tol(dt), "rmsnorm backward dx");
            pair_check(ctx, &ndw, 1e-5 * sqrt((double)n) + tu_tol(dt), "rmsnorm backward dweight");
            pair *np[] = {&nin, &nw, &ng, &nout, &ndx, &ndw};
            for (size_t i = 0; i < sizeof np / sizeof np[0]; i++) pair_free(ctx, np[i]);
            free(nx);
            free(ndy);
            free(x);
            free(y);
        }
    }
    /* split and concat along every dim of a 4-D tensor, for every dtype */
    int64_t shape[] = {3, 5, 4, 7};
    for (int dt = 0; dt < CPAR_DTYPE_COUNT; dt++) {
        void *x = tu_random_host((cpar_dtype)dt, 420, 9);
        pair whole = pair_upload(ctx, x, (cpar_dtype)dt, 4, shape);
        for (int dim = 0; dim < 4; dim++) {
            int64_t len[3] = {1, 0, shape[dim] - 1};
            pair pieces[3];
            cpar_tensor *ph[3], *pd[3];
            for (int i = 0; i < 3; i++) {
                int64_t ps[4] = {3, 5, 4, 7};
                ps[dim] = len[i];
                pieces[i] = pair_poisoned(ctx, (cpar_dtype)dt, 4, ps);
                ph[i] = &pieces[i].h;
                pd[i] = &pieces[i].d;
            }
            TU_OK(cpar_split(ctx, &whole.h, dim, 3, ph));
            TU_OK(cpar_split(ctx, &whole.d, dim, 3, pd));
            for (int i = 0; i < 3; i++) pair_check(ctx, &pieces[i], 0.0, "split");
            pair back = pair_poisoned(ctx, (cpar_dtype)dt, 4, shape);
            TU_OK(cpar_concat(ctx, ph, 3, dim, &back.h));
            TU_OK(cpar_concat(ctx, pd, 3, dim, &back.d));
            pair_check(ctx, &back, 0.0, "concat");
            void *got = tu_download(ctx, &back.d);
            ck_assert(!memcmp(got, x, 420 * cpar_dtype_size((cpar_dtype)dt)));
            free(got);
            pair_free(ctx, &back);
            for (int i = 0; i < 3; i++) pair_free(ctx, &pieces[i]);
        }
        pair_free(ctx, &whole);
        free(x);
    }
    /* training: two AdamW steps (bf16 parameter) and the gradient norm, device against host */
    for (int k = 0; k < N_OP_SIZES; k++) {
        int64_t n = op_sizes[k], shape[] = {n};
        void *w0 = tu_random_host(CPAR_F32, n, 600 + k), *g0 = tu_random_host(CPAR_F32, n, 610 + k);
        void *m0 = tu_random_host(CPAR_F32, n, 620 + k);
        for (int64_t i = 0; i < n; i++) ((float *)m0)[i] *= 0.1f;
        pair w = pair_upload(ctx, w0, CPAR_F32, 1, shape), g = pair_upload(ctx, g0, CPAR_F32, 1, shape);
        pair m = pair_upload(ctx, m0, CPAR_F32, 1, shape), v = pair_upload(ctx, m0, CPAR_F32, 1, shape);
        pair p = pair_poisoned(ctx, CPAR_BF16, 1, shape);
        TU_OK(cpar_axpby(ctx, 0.f, &v.h, 0.f, &v.h)); /* v >= 0: start from zero */
        TU_OK(cpar_axpby(ctx, 0.f, &v.d, 0.f, &v.d));
        const cpar_adamw_config cfg = {.lr = 1e-2f, .weight_decay = 0.1f};
        for (int step = 1; step <= 2; step++) {
            TU_OK(cpar_adamw_step(ctx, &cfg, step, 0.75f, &g.h, &w.h, &m.h, &v.h, &p.h));
            TU_OK(cpar_adamw_step(ctx, &cfg, step, 0.75f, &g.d, &w.d, &m.d, &v.d, &p.d));
        }
        pair_check(ctx, &w, 1e-6, "adamw master");
        pair_check(ctx, &m, 1e-6, "adamw m");
        pair_check(ctx, &v, 1e-6, "adamw v");
        pair_check(ctx, &p, tu_tol(CPAR_BF16), "adamw param");
        const cpar_tensor *gd = &g.d;
        float norm_d, norm_h = 0.f;
        TU_OK(cpar_grad_norm(cpar_world_group(ctx), &gd, NULL, 1, &norm_d));
        for (int64_t i = 0; i < n; i++) norm_h += ((float *)g0)[i] * ((float *)g0)[i];
        norm_h = sqrtf(norm_h);
        ck_assert_msg(fabsf(norm_d - norm_h) <= 1e-5f * norm_h, "grad norm %.8g on the GPU, %.8g on the host (n %lld)",
                      norm_d, norm_h, (long long)n);
        pair *all[] = {&w, &g, &m, &v, &p};
        for (int i = 0; i < 5; i++) pair_free(ctx, all[i]);
        free(w0), free(g0), free(m0);
    }
    return CPAR_OK;
}

START_TEST(test_ops_device_vs_host) { TU_OK(gpu_spawn(1, rank_ops, NULL)); }
END_TEST

/* ---- local attention: the flash kernels against the host reference -------------------
 * The same 16-bit q, k, v, dout on the host (cpar.c's fp32 reference: host
 * tensors on a device context) and on the GPU (the flash forward and backward
 * kernels); each side's backward uses its own forward's out and lse. */

/* max|gpu - host| <= tol * max(max|host|, 1e-3) (NaN fails; -inf must match). */
static void attn_check(cpar_ctx *ctx, pair *p, double tol, const char *what, const char *cfg) {
    const int64_t n = cpar_tensor_numel(&p->h);
    void *got = tu_download(ctx, &p->d);
    double ref = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double w = tu_get(p->mem, p->h.dtype, i);
        if (isfinite(w)) ref = fmax(ref, fabs(w));
    }
    /* A gradient that cancels to rounding noise (one query seeing one key:
     * dS = P (dP - D) = 0 exactly in real arithmetic) has no scale of its own:
     * compare it on the scale of the inputs' products instead. */
    if (ref < 1e-3) ref = 1e-3;
    for (int64_t i = 0; i < n; i++) {
        const double g = tu_get(got, p->h.dtype, i), w = tu_get(p->mem, p->h.dtype, i);
        const bool ok = isinf(w) ? g == w : !isnan(g) && fabs(g - w) <= tol * ref;
        ck_assert_msg(ok, "attention %s %s: element %lld is %.8g on the GPU, %.8g on the host (tol %.3g x %.4g)", what,
                      cfg, (long long)i, g, w, tol, ref);
    }
    free(got);
}

static cpar_status rank_attention(cpar_ctx *ctx, void *unused) {
    (void)unused;
    static const struct {
        int64_t b, hq, hkv, sq, sk, d;
    } shapes[] = {
        {2, 4, 2, 300, 300, 128}, /* GQA, partial tiles */
        {1, 6, 2, 257, 513, 64},  /* sq < sk */
        {2, 3, 1, 129, 77, 40},   /* sq > sk, d an odd multiple of 8 */
        {1, 2, 2, 1, 200, 128},   /* one query */
    };
    static const cpar_dtype dts[] = {CPAR_F16, CPAR_BF16};
    int seed = 0;
    /* quick: the last two shapes (still GQA, partial tiles, sq != sk, one query) */
    for (size_t si = quick() ? 2 : 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int di = 0; di < 2; di++)
            for (int causal = 0; causal < 2; causal++, seed++) {
                const cpar_dtype dt = dts[di];
                const int64_t qs[4] = {shapes[si].b, shapes[si].hq, shapes[si].sq, shapes[si].d};
                const int64_t ks[4] = {shapes[si].b, shapes[si].hkv, shapes[si].sk, shapes[si].d};
                const int64_t nq = qs[0] * qs[1] * qs[2] * qs[3], nk = ks[0] * ks[1] * ks[2] * ks[3];
                char cfg[128];
                snprintf(cfg, sizeof cfg, "[b%lld hq%lld hkv%lld sq%lld sk%lld d%lld %s %s]", (long long)qs[0],
                         (long long)qs[1], (long long)ks[1], (long long)qs[2], (long long)ks[2], (long long)qs[3],
                         causal ? "causal" : "full", cpar_dtype_name(dt));
                void *hq = tu_random_host(dt, nq, 700 + seed), *hk = tu_random_host(dt, nk, 800 + seed);
                void *hv = tu_random_host(dt, nk, 900 + seed), *hdo = tu_random_host(dt, nq, 1000 + seed);
                pair q = pair_upload(ctx, hq, dt, 4, qs), k = pair_upload(ctx, hk, dt, 4, ks);
                pair v = pair_upload(ctx, hv, dt, 4, ks), dout = pair_upload(ctx, hdo, dt, 4, qs);
                pair out = pair_poisoned(ctx, dt, 4, qs), lse = pair_poisoned(ctx, CPAR_F32, 3, qs);
                pair dq = pair_poisoned(ctx, dt, 4, qs), dk = pair_poisoned(ctx, dt, 4, ks);
                pair dv = pair_poisoned(ctx, dt, 4, ks);
                TU_OK(cpar_attention_forward(ctx, &q.h, &k.h, &v.h, causal, 0.f, &out.h, &lse.h));
                TU_OK(cpar_attention_forward(ctx, &q.d, &k.d, &v.d, causal, 0.f, &out.d, &lse.d));
                TU_OK(cpar_sync(ctx));
                attn_check(ctx, &out, dt == CPAR_F16 ? 4e-3 : 2.5e-2, "out", cfg);
                attn_check(ctx, &lse, 2e-5, "lse", cfg);
                TU_OK(cpar_attention_backward(ctx, &q.h, &k.h, &v.h, &out.h, &dout.h, &lse.h, causal, 0.f, &dq.h,
                                              &dk.h, &dv.h));
                TU_OK(cpar_attention_backward(ctx, &q.d, &k.d, &v.d, &out.d, &dout.d, &lse.d, causal, 0.f, &dq.d,
                                              &dk.d, &dv.d));
                TU_OK(cpar_sync(ctx));
                const double gtol = dt == CPAR_F16 ? 1e-2 : 5e-2;
                attn_check(ctx, &dq, gtol, "dq", cfg);
                attn_check(ctx, &dk, gtol, "dk", cfg);
                attn_check(ctx, &dv, gtol, "dv", cfg);
                pair *all[] = {&q, &k, &v, &dout, &out, &lse, &dq, &dk, &dv};
                for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) pair_free(ctx, all[i]);
                free(hq), free(hk), free(hv), free(hdo);
            }
    return CPAR_OK;
}

START_TEST(test_attention_device_vs_host) { TU_OK(gpu_spawn(1, rank_attention, NULL)); }
END_TEST

/* cpar_init_from_env in a single process with no launch variables: a
 * 1-rank NCCL world on GPU 0. */
START_TEST(test_init_from_env_single) {
    static const char *const vars[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                                       "SLURM_NTASKS", "SLURM_LOCALID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]); /* this forked test's own env */
    char port[16]; /* keep clear of a torchrun or another job on the default ports */
    snprintf(port, sizeof port, "%d", 20000 + (int)(getpid() % 20000));
    setenv("CPAR_STORE_PORT", port, 1);
    cpar_init_config c = {.backend = CPAR_BACKEND_NCCL, .timeout_ms = 60000};
    cpar_ctx *ctx = NULL;
    TU_OK(cpar_init_from_env(&c, &ctx));
    ck_assert_int_eq(cpar_world_size(ctx), 1);
    ck_assert_int_eq(cpar_device(ctx), 0);
    int64_t shape[] = {9};
    float *x = tu_random_host(CPAR_F32, 9, 4);
    cpar_tensor t = tu_upload(ctx, x, CPAR_F32, 1, shape);
    TU_OK(cpar_all_reduce(cpar_world_group(ctx), &t, &t, CPAR_SUM));
    TU_OK(cpar_sync(ctx));
    void *got = tu_download(ctx, &t);
    TU_EXPECT_SAME(got, x, CPAR_F32, 9);
    free(got);
    free(x);
    free_tensor(ctx, &t);
    TU_OK(cpar_finalize(ctx));
}
END_TEST

Suite *suite(void) {
    Suite *s = suite_create("gpu: NCCL backend and CUDA kernels");
    TCase *tc = tcase_create("collectives");
    int worlds = nccl_worlds() + 2; /* NCCL, then the device backend on 2 and 4 ranks */
    tcase_add_loop_test(tc, test_all_reduce, 0, worlds);
    tcase_add_loop_test(tc, test_gather_scatter, 0, worlds);
    tcase_add_loop_test(tc, test_all_to_all, 0, worlds);
    tcase_add_loop_test(tc, test_broadcast_p2p, 0, worlds);
    tcase_set_timeout(tc, 300);
    suite_add_tcase(s, tc);
    tc = tcase_create("ops");
    tcase_add_test(tc, test_ops_device_vs_host);
    tcase_add_test(tc, test_init_from_env_single);
    tcase_add_test(tc, test_attention_device_vs_host);
    tcase_set_timeout(tc, 300);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    int n = probe_gpu_count();
    if (n < 0) {
        fprintf(stderr, "GPU suite: could not probe the GPUs (fork failed)\n");
        return EXIT_FAILURE;
    }
    if (n == 0) {
        printf("GPU suite skipped: no GPU visible (cudaGetDeviceCount found none)\n");
        return EXIT_SUCCESS;
    }
    n_gpus = n > MAX_GPUS ? MAX_GPUS : n;
    return tu_run_suite(suite());
}
