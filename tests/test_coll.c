/* SPDX-License-Identifier: MIT */
/* test_coll.c — the raw collectives, their communication statistics, group
 * split and destroy, and their argument checks (cpar.h §4-5).
 *
 * Every collective runs at group sizes 1, 2, 3, 4 and 8 for every dtype it
 * takes, on [rows, 3, 5] tensors with odd and per-rank row counts (a zero-row
 * rank included). Rank r's input of call c is generated from seed (c, r), so
 * each rank rebuilds every peer's input and computes the expected result
 * itself, in double, single-threaded. Sums of F16/BF16 are accumulated in
 * fp32 and rounded once by the library, so they must be within one unit in
 * the last place of the double sum of the dtype-rounded inputs rounded once;
 * F32 sums within n fp32 roundings; MAX/MIN, integers and data movement are
 * exact, and the host and device backends give every rank the same bits. After
 * every call the statistics must equal the formulas of cpar.h §5. */
#define _GNU_SOURCE /* sched_setaffinity: the pieces case binds its ranks to one processor */
#include <sched.h>
#include <stdatomic.h>

#include "testutil.h"

#define MAX_RANKS 8
#define ROW_ELEMS 15 /* a row of [rows, 3, 5] */
#define MAX_CALLS 256

static const int group_sizes[] = {1, 2, 3, 4, 8};
#define N_SIZES ((int)(sizeof group_sizes / sizeof group_sizes[0]))

static const cpar_dtype all_dtypes[] = {CPAR_F32, CPAR_F16, CPAR_BF16, CPAR_I32, CPAR_I64, CPAR_U8};
#define N_DTYPES ((int)(sizeof all_dtypes / sizeof all_dtypes[0]))
static const cpar_reduce_op all_ops[] = {CPAR_SUM, CPAR_MAX, CPAR_MIN};
static const char *const op_names[] = {"sum", "max", "min"};

/* Shared by the ranks of one job. */
typedef struct {
    uint64_t hash[MAX_CALLS][MAX_RANKS]; /* all-reduce results, to compare across ranks */
    int ncalls;
    atomic_int arrived; /* barrier test */
} coll_arg;

static uint64_t seed_of(int call, int rank) { return (uint64_t)call * 1000003u + (uint64_t)rank * 7919u + 11u; }

static uint64_t fnv1a(const void *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ull;
    return h;
}

static int mod(int a, int n) { return ((a % n) + n) % n; }

static int gcd(int a, int b) { return b ? gcd(b, a % b) : a; }

/* Rows of rank r in the uneven cases: 2, 0, 1, 3, 5, 2, 4, 1 (a zero-row rank). */
static int64_t uneven_rows(int r) { return r == 1 ? 0 : (2 * r + 1) % 5 + 1; }

/* Rows of rank r in the three layouts of all-gather and reduce-scatter:
 * equal (3), uneven with a zero, and large uneven ones (over 1000 elements). */
enum { ROWS_EQUAL, ROWS_UNEVEN, ROWS_LARGE, ROW_LAYOUTS };
static const char *const layout_names[] = {"equal", "uneven", "large"};
static int64_t layout_rows(int layout, int r) {
    return layout == ROWS_EQUAL ? 3 : layout == ROWS_UNEVEN ? uneven_rows(r) : 67 + 2 * r;
}

/* Row counts of the all-to-all with split arrays: rank i sends a2a_split(i, j)
 * rows to rank j (0, 1 or 2: zeros included). */
static int64_t a2a_split(int i, int j, bool equal) { return equal ? 2 : (i + 2 * j + 1) % 3; }

/* Every rank's input of one call (host memory): x[r] has rows[r] rows. */
static void gen_inputs(void **x, int n, cpar_dtype dt, const int64_t *rows, int call) {
    for (int r = 0; r < n; r++) x[r] = tu_random_host(dt, rows[r] * ROW_ELEMS, seed_of(call, r));
}

static void free_all(void **x, int n) {
    for (int r = 0; r < n; r++) free(x[r]);
}

static int64_t *shape3(int64_t rows, int64_t *s) {
    s[0] = rows;
    s[1] = 3;
    s[2] = 5;
    return s;
}

/* want[i] = op over ranks of x[r][off + i], as dtype dt holds the result. */
static void ref_reduce(cpar_dtype dt, cpar_reduce_op op, void *const *x, int n, int64_t off, int64_t count,
                       double *want) {
    for (int64_t i = 0; i < count; i++) {
        double acc = tu_get(x[0], dt, off + i);
        for (int r = 1; r < n; r++) {
            double v = tu_get(x[r], dt, off + i);
            acc = op == CPAR_SUM ? acc + v : op == CPAR_MAX ? fmax(acc, v) : fmin(acc, v);
        }
        want[i] = tu_round(dt, acc);
    }
}

/* How far a reduction may be from the reference w. F16/BF16 sums are
 * accumulated in fp32 and rounded once, so they are within one unit in the
 * last place of the dtype (the fp32 partial sums can only move a near-tie);
 * rounding every partial sum to the dtype would miss that by several. F32
 * sums carry up to n fp32 roundings. MAX, MIN and integers are exact. */
static double reduce_tol_at(cpar_dtype dt, cpar_reduce_op op, int n, double w) {
    if (op != CPAR_SUM || !cpar_dtype_is_float(dt)) return 0.0;
    if (dt == CPAR_F32) return 1e-6 * n * (1.0 + fabs(w));
    int e;
    frexp(w, &e); /* |w| in [2^(e-1), 2^e) */
    if (dt == CPAR_F16 && e < -13) e = -13; /* subnormal spacing 2^-24 */
    return ldexp(1.0, e - (dt == CPAR_F16 ? 11 : 8));
}

/* First element of got (host memory) outside reduce_tol_at of want, or -1. */
static int64_t reduce_mismatch(const void *got, cpar_dtype dt, cpar_reduce_op op, int n, const double *want,
                               int64_t count, char *msg, size_t cap) {
    for (int64_t i = 0; i < count; i++) {
        double g = tu_get(got, dt, i), tol = reduce_tol_at(dt, op, n, want[i]);
        if (isnan(g) || fabs(g - want[i]) > tol) {
            snprintf(msg, cap, "element %lld: got %.9g, expected %.9g (tol %.3g)", (long long)i, g, want[i], tol);
            return i;
        }
    }
    return -1;
}

/* Rank r's even share of count elements (the first count % n ranks get one more). */
static int64_t even_share(int64_t count, int n, int r) { return count / n + (r < count % n); }

/* The statistics of g hold exactly one kind's counters (cpar.h §5). */
static void expect_stats(cpar_group *g, cpar_coll_kind kind, uint64_t calls, uint64_t sent, uint64_t recv) {
    cpar_comm_stats s;
    TU_OK(cpar_group_stats(g, &s));
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++) {
        cpar_comm_counter w = {0, 0, 0};
        if (k == (int)kind) w = (cpar_comm_counter){calls, sent, recv};
        ck_assert_msg(s.kind[k].calls == w.calls && s.kind[k].bytes_sent == w.bytes_sent &&
                          s.kind[k].bytes_recv == w.bytes_recv,
                      "rank %d of %d, %s counters: calls %llu sent %llu recv %llu, expected %llu %llu %llu",
                      cpar_group_rank(g), cpar_group_size(g), cpar_coll_kind_name((cpar_coll_kind)k),
                      (unsigned long long)s.kind[k].calls, (unsigned long long)s.kind[k].bytes_sent,
                      (unsigned long long)s.kind[k].bytes_recv, (unsigned long long)w.calls,
                      (unsigned long long)w.bytes_sent, (unsigned long long)w.bytes_recv);
    }
}

static void free_tensor(cpar_ctx *ctx, cpar_tensor *t) { TU_OK(cpar_tensor_free(ctx, t)); }

/* Data movement is exact: got and want (host memory) hold the same bits. */
static void expect_same(const void *got, const void *want, cpar_dtype dt, int64_t n, const char *what,
                        cpar_group *g) {
    int64_t bad = tu_bits_mismatch(got, want, dt, n);
    double gv = bad < 0 ? 0 : tu_get(got, dt, bad), wv = bad < 0 ? 0 : tu_get(want, dt, bad);
    ck_assert_msg(bad < 0, "%s %s, rank %d of %d: element %lld is %.9g, expected %.9g", what, cpar_dtype_name(dt),
                  cpar_group_rank(g), cpar_group_size(g), (long long)bad, gv, wv);
}

/* ---- all-reduce ---------------------------------------------------------------- */

static const struct {
    int ndim;
    int64_t shape[3];
} ar_shapes[] = {{3, {5, 3, 5}}, {1, {37}}, {0, {0}}, {1, {4099}}}; /* 4099: several blocks */
#define N_AR_SHAPES ((int)(sizeof ar_shapes / sizeof ar_shapes[0]))

static cpar_status rank_all_reduce(cpar_ctx *ctx, void *p) {
    coll_arg *a = p;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), me = cpar_group_rank(g), call = 0;
    for (int d = 0; d < N_DTYPES; d++)
        for (int o = 0; o < 3; o++) {
            cpar_dtype dt = all_dtypes[d];
            cpar_reduce_op op = all_ops[o];
            if (dt == CPAR_U8 && op == CPAR_SUM) continue; /* u8: MAX and MIN only */
            /* Each shape out of place, then the first one in place (out == in). */
            for (int k = 0; k <= N_AR_SHAPES; k++, call++) {
                bool in_place = k == N_AR_SHAPES;
                int nd = ar_shapes[in_place ? 0 : k].ndim;
                const int64_t *shape = ar_shapes[in_place ? 0 : k].shape;
                cpar_tensor probe = cpar_tensor_make(NULL, dt, nd, shape, CPAR_HOST);
                int64_t numel = cpar_tensor_numel(&probe);
                void *x[MAX_RANKS];
                for (int r = 0; r < n; r++) x[r] = tu_random_host(dt, numel, seed_of(call, r));
                cpar_tensor in = tu_upload(ctx, x[me], dt, nd, shape), out = in;
                if (!in_place) out = tu_alloc_poisoned(ctx, dt, nd, shape);
                TU_OK(cpar_group_stats_reset(g));
                TU_OK(cpar_all_reduce(g, &in, &out, op));

                uint64_t es = cpar_dtype_size(dt), N = (uint64_t)numel * es;
                uint64_t c = (uint64_t)even_share(numel, n, me) * es;
                uint64_t moved = n > 1 ? (N - c) + (uint64_t)(n - 1) * c : 0;
                expect_stats(g, CPAR_COLL_ALL_REDUCE, 1, moved, moved);

                void *got = tu_download(ctx, &out);
                double *want = malloc((size_t)numel * sizeof *want);
                ref_reduce(dt, op, x, n, 0, numel, want);
                char msg[256];
                ck_assert_msg(reduce_mismatch(got, dt, op, n, want, numel, msg, sizeof msg) < 0,
                              "all_reduce %s %s ndim %d%s, rank %d of %d: %s", op_names[o], cpar_dtype_name(dt), nd,
                              in_place ? " in place" : "", me, n, msg);
                ck_assert_int_lt(call, MAX_CALLS);
                a->hash[call][me] = fnv1a(got, (size_t)N);
                free(got);
                free(want);
                free_all(x, n);
                free_tensor(ctx, &in);
                if (!in_place) free_tensor(ctx, &out);
            }
        }
    if (me == 0) a->ncalls = call; /* every rank makes the same calls; one writes the count */
    return CPAR_OK;
}

START_TEST(test_all_reduce) {
    int n = group_sizes[_i];
    coll_arg *a = calloc(1, sizeof *a);
    TU_OK(tu_spawn(n, rank_all_reduce, a));
    /* Host and sim reduce in rank order: every rank holds the same bits. */
    for (int c = 0; c < a->ncalls; c++)
        for (int r = 1; r < n; r++)
            ck_assert_msg(a->hash[c][r] == a->hash[c][0], "all_reduce call %d: rank %d differs from rank 0", c, r);
    free(a);
}
END_TEST

/* ---- all-gather ------------------------------------------------------------------ */

static cpar_status rank_all_gather(cpar_ctx *ctx, void *p) {
    (void)p;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), me = cpar_group_rank(g), call = 0;
    for (int d = 0; d < N_DTYPES; d++)
        for (int layout = 0; layout < ROW_LAYOUTS; layout++, call++) {
            cpar_dtype dt = all_dtypes[d];
            bool uneven = layout != ROWS_EQUAL;
            int64_t rows[MAX_RANKS], total = 0, s[3];
            for (int r = 0; r < n; r++) total += rows[r] = layout_rows(layout, r);
            void *x[MAX_RANKS];
            gen_inputs(x, n, dt, rows, call);
            cpar_tensor in = tu_upload(ctx, x[me], dt, 3, shape3(rows[me], s));
            cpar_tensor out = tu_alloc_poisoned(ctx, dt, 3, shape3(total, s));
            TU_OK(cpar_group_stats_reset(g));
            TU_OK(cpar_all_gather(g, &in, &out, uneven ? rows : NULL));

            uint64_t es = cpar_dtype_size(dt), own = (uint64_t)rows[me] * ROW_ELEMS * es;
            expect_stats(g, CPAR_COLL_ALL_GATHER, 1, own * (uint64_t)(n - 1), (uint64_t)total * ROW_ELEMS * es - own);

            char *want = malloc((size_t)(total * ROW_ELEMS) * es + 1), *at = want;
            for (int r = 0; r < n; r++) {
                memcpy(at, x[r], (size_t)(rows[r] * ROW_ELEMS) * es);
                at += rows[r] * ROW_ELEMS * (int64_t)es;
            }
            void *got = tu_download(ctx, &out);
            char what[48];
            snprintf(what, sizeof what, "all_gather %s", layout_names[layout]);
            expect_same(got, want, dt, total * ROW_ELEMS, what, g);
            free(got);
            free(want);
            free_all(x, n);
            free_tensor(ctx, &in);
            free_tensor(ctx, &out);
        }
    return CPAR_OK;
}

START_TEST(test_all_gather) { TU_OK(tu_spawn(group_sizes[_i], rank_all_gather, NULL)); }
END_TEST

/* ---- reduce-scatter ------------------------------------------------------------------ */

static cpar_status rank_reduce_scatter(cpar_ctx *ctx, void *p) {
    (void)p;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), me = cpar_group_rank(g), call = 0;
    for (int d = 0; d < N_DTYPES; d++)
        for (int o = 0; o < 3; o++)
            for (int layout = 0; layout < ROW_LAYOUTS; layout++, call++) {
                cpar_dtype dt = all_dtypes[d];
                cpar_reduce_op op = all_ops[o];
                bool uneven = layout != ROWS_EQUAL;
                if (dt == CPAR_U8 && op == CPAR_SUM) continue;
                int64_t sizes[MAX_RANKS], total = 0, off = 0, s[3];
                for (int r = 0; r < n; r++) {
                    sizes[r] = layout_rows(layout, r);
                    if (r < me) off += sizes[r];
                    total += sizes[r];
                }
                int64_t in_rows[MAX_RANKS];
                for (int r = 0; r < n; r++) in_rows[r] = total;
                void *x[MAX_RANKS];
                gen_inputs(x, n, dt, in_rows, call);
                cpar_tensor in = tu_upload(ctx, x[me], dt, 3, shape3(total, s));
                cpar_tensor out = tu_alloc_poisoned(ctx, dt, 3, shape3(sizes[me], s));
                TU_OK(cpar_group_stats_reset(g));
                TU_OK(cpar_reduce_scatter(g, &in, &out, op, uneven ? sizes : NULL));

                uint64_t es = cpar_dtype_size(dt), N = (uint64_t)total * ROW_ELEMS * es;
                uint64_t own = (uint64_t)sizes[me] * ROW_ELEMS * es;
                expect_stats(g, CPAR_COLL_REDUCE_SCATTER, 1, N - own, own * (uint64_t)(n - 1));

                int64_t count = sizes[me] * ROW_ELEMS;
                double *want = malloc((size_t)count * sizeof *want + 1);
                ref_reduce(dt, op, x, n, off * ROW_ELEMS, count, want);
                void *got = tu_download(ctx, &out);
                char msg[256];
                ck_assert_msg(reduce_mismatch(got, dt, op, n, want, count, msg, sizeof msg) < 0,
                              "reduce_scatter %s %s %s, rank %d of %d: %s", op_names[o], cpar_dtype_name(dt),
                              layout_names[layout], me, n, msg);
                free(got);
                free(want);
                free_all(x, n);
                free_tensor(ctx, &in);
                free_tensor(ctx, &out);
            }
    return CPAR_OK;
}

START_TEST(test_reduce_scatter) { TU_OK(tu_spawn(group_sizes[_i], rank_reduce_scatter, NULL)); }
END_TEST

/* ---- all-to-all ------------------------------------------------------------------------ */

static cpar_status rank_all_to_all(cpar_ctx *ctx, void *p) {
    (void)p;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), me = cpar_group_rank(g), call = 0;
    for (int d = 0; d < N_DTYPES; d++)
        for (int equal = 0; equal < 2; equal++, call++) {
            cpar_dtype dt = all_dtypes[d];
            int64_t in_rows[MAX_RANKS] = {0}, in_splits[MAX_RANKS], out_splits[MAX_RANKS], out_rows = 0, s[3];
            for (int i = 0; i < n; i++)
                for (int j = 0; j < n; j++) in_rows[i] += a2a_split(i, j, equal);
            for (int j = 0; j < n; j++) in_splits[j] = a2a_split(me, j, equal);
            for (int i = 0; i < n; i++) out_rows += out_splits[i] = a2a_split(i, me, equal);
            void *x[MAX_RANKS];
            gen_inputs(x, n, dt, in_rows, call);
            cpar_tensor in = tu_upload(ctx, x[me], dt, 3, shape3(in_rows[me], s));
            cpar_tensor out = tu_alloc_poisoned(ctx, dt, 3, shape3(out_rows, s));
            TU_OK(cpar_group_stats_reset(g));
            /* Equal splits: NULL arrays (dim 0 divided equally). */
            TU_OK(cpar_all_to_all_single(g, &in, &out, equal ? NULL : out_splits, equal ? NULL : in_splits));

            uint64_t row = ROW_ELEMS * cpar_dtype_size(dt), self = (uint64_t)a2a_split(me, me, equal);
            expect_stats(g, CPAR_COLL_ALL_TO_ALL, 1, ((uint64_t)in_rows[me] - self) * row,
                         ((uint64_t)out_rows - self) * row);

            /* From source i: its rows sum(split(i, j < me)) .. + split(i, me). */
            char *want = malloc((size_t)out_rows * row + 1), *at = want;
            for (int i = 0; i < n; i++) {
                int64_t first = 0;
                for (int j = 0; j < me; j++) first += a2a_split(i, j, equal);
                memcpy(at, (char *)x[i] + first * (int64_t)row, (size_t)a2a_split(i, me, equal) * row);
                at += a2a_split(i, me, equal) * (int64_t)row;
            }
            void *got = tu_download(ctx, &out);
            expect_same(got, want, dt, out_rows * ROW_ELEMS, equal ? "all_to_all equal" : "all_to_all splits", g);
            free(got);
            free(want);
            free_all(x, n);
            free_tensor(ctx, &in);
            free_tensor(ctx, &out);
        }
    return CPAR_OK;
}

START_TEST(test_all_to_all) { TU_OK(tu_spawn(group_sizes[_i], rank_all_to_all, NULL)); }
END_TEST

/* ---- broadcast ------------------------------------------------------------------------- */

static cpar_status rank_broadcast(cpar_ctx *ctx, void *p) {
    (void)p;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), me = cpar_group_rank(g), call = 0;
    for (int d = 0; d < N_DTYPES; d++)
        for (int root = 0; root < n; root++, call++) {
            cpar_dtype dt = all_dtypes[d];
            int64_t rows[MAX_RANKS], s[3];
            for (int r = 0; r < n; r++) rows[r] = 7;
            void *x[MAX_RANKS];
            gen_inputs(x, n, dt, rows, call);
            cpar_tensor buf = tu_upload(ctx, x[me], dt, 3, shape3(7, s));
            TU_OK(cpar_group_stats_reset(g));
            TU_OK(cpar_broadcast(g, &buf, root));
            uint64_t N = cpar_tensor_nbytes(&buf);
            if (me == root) expect_stats(g, CPAR_COLL_BROADCAST, 1, N * (uint64_t)(n - 1), 0);
            else expect_stats(g, CPAR_COLL_BROADCAST, 1, 0, N);
            void *got = tu_download(ctx, &buf);
            char what[48];
            snprintf(what, sizeof what, "broadcast from %d", root);
            expect_same(got, x[root], dt, 7 * ROW_ELEMS, what, g);
            free(got);
            free_all(x, n);
            free_tensor(ctx, &buf);
        }
    return CPAR_OK;
}

START_TEST(test_broadcast) { TU_OK(tu_spawn(group_sizes[_i], rank_broadcast, NULL)); }
END_TEST

/* ---- large collectives ---------------------------------------------------------------- */

/* Collectives whose group writes 16 MiB or more take the host backend's
 * streaming stores (cpar.c section 8): all of them again at that size, with
 * element counts that leave unaligned heads and tails (bf16 rows of odd
 * length). Ranks share their inputs through the job's argument instead of
 * regenerating each other's 16 MiB. */
#define BIG_BYTES ((int64_t)16 << 20)
typedef struct {
    void *x[MAX_RANKS];
} big_arg;

static void share_input(cpar_group *g, big_arg *a, void *mine) {
    a->x[cpar_group_rank(g)] = mine;
    TU_OK(cpar_barrier(g));
}

static cpar_status rank_large(cpar_ctx *ctx, void *p) {
    big_arg *a = p;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), me = cpar_group_rank(g);
    const cpar_dtype dts[] = {CPAR_F32, CPAR_BF16};
    for (int d = 0; d < 2; d++) {
        cpar_dtype dt = dts[d];
        size_t es = cpar_dtype_size(dt);
        /* 16 MiB + 37 elements, divisible by n for reduce-scatter: every kind streams */
        int64_t numel = (BIG_BYTES / (int64_t)es + 37) / n * n, part = numel / n;
        share_input(g, a, tu_random_host(dt, numel, seed_of(500 + d, me)));
        char msg[256];
        double *want = malloc((size_t)numel * sizeof *want);
        ref_reduce(dt, CPAR_SUM, a->x, n, 0, numel, want);
        /* all-reduce, out of place (streamed) and in place (cached) */
        for (int in_place = 0; in_place < 2; in_place++) {
            cpar_tensor in = tu_upload(ctx, a->x[me], dt, 1, &numel), out = in;
            if (!in_place) out = tu_alloc_poisoned(ctx, dt, 1, &numel);
            TU_OK(cpar_all_reduce(g, &in, &out, CPAR_SUM));
            void *got = tu_download(ctx, &out);
            ck_assert_msg(reduce_mismatch(got, dt, CPAR_SUM, n, want, numel, msg, sizeof msg) < 0,
                          "large all_reduce %s%s, rank %d of %d: %s", cpar_dtype_name(dt),
                          in_place ? " in place" : "", me, n, msg);
            free(got);
            free_tensor(ctx, &in);
            if (!in_place) free_tensor(ctx, &out);
        }
        /* reduce-scatter */
        {
            cpar_tensor in = tu_upload(ctx, a->x[me], dt, 1, &numel), out = tu_alloc_poisoned(ctx, dt, 1, &part);
            TU_OK(cpar_reduce_scatter(g, &in, &out, CPAR_SUM, NULL));
            void *got = tu_download(ctx, &out);
            ck_assert_msg(reduce_mismatch(got, dt, CPAR_SUM, n, want + me * part, part, msg, sizeof msg) < 0,
                          "large reduce_scatter %s, rank %d of %d: %s", cpar_dtype_name(dt), me, n, msg);
            free(got);
            free_tensor(ctx, &in);
            free_tensor(ctx, &out);
        }
        free(want);
        /* all-gather of each rank's first part + 3r elements (odd, uneven sizes) */
        {
            int64_t rows[MAX_RANKS], total = 0;
            for (int r = 0; r < n; r++) total += rows[r] = part + 3 * r;
            cpar_tensor in = tu_upload(ctx, a->x[me], dt, 1, &rows[me]), out = tu_alloc_poisoned(ctx, dt, 1, &total);
            TU_OK(cpar_all_gather(g, &in, &out, rows));
            char *want = malloc((size_t)total * es), *at = want;
            for (int r = 0; r < n; r++) {
                memcpy(at, a->x[r], (size_t)rows[r] * es);
                at += rows[r] * (int64_t)es;
            }
            void *got = tu_download(ctx, &out);
            expect_same(got, want, dt, total, "large all_gather", g);
            free(got);
            free(want);
            free_tensor(ctx, &in);
            free_tensor(ctx, &out);
        }
        /* all-to-all, equal splits */
        {
            cpar_tensor in = tu_upload(ctx, a->x[me], dt, 1, &numel), out = tu_alloc_poisoned(ctx, dt, 1, &numel);
            TU_OK(cpar_all_to_all_single(g, &in, &out, NULL, NULL));
            char *want = malloc((size_t)numel * es);
            for (int r = 0; r < n; r++)
                memcpy(want + (size_t)(r * part) * es, (char *)a->x[r] + (size_t)(me * part) * es, (size_t)part * es);
            void *got = tu_download(ctx, &out);
            expect_same(got, want, dt, numel, "large all_to_all", g);
            free(got);
            free(want);
            free_tensor(ctx, &in);
            free_tensor(ctx, &out);
        }
        /* broadcast from the last rank */
        {
            cpar_tensor buf = tu_upload(ctx, a->x[me], dt, 1, &numel);
            TU_OK(cpar_broadcast(g, &buf, n - 1));
            void *got = tu_download(ctx, &buf);
            expect_same(got, a->x[n - 1], dt, numel, "large broadcast", g);
            free(got);
            free_tensor(ctx, &buf);
        }
        TU_OK(cpar_barrier(g)); /* every rank is done reading the shared inputs */
        free(a->x[me]);
    }
    return CPAR_OK;
}

START_TEST(test_large) {
    int n = group_sizes[_i];
    /* Group sizes 2-4 on the host backend, whose streaming path this is (one
     * rank moves nothing; 8 ranks would take long). */
    if (n < 2 || n > 4 || tu_on_device()) return;
    big_arg a = {{NULL}};
    TU_OK(tu_spawn(n, rank_large, &a));
}
END_TEST

/* ---- large uneven collectives, ranks with and without a core each ------------------------- */

/* All-reduce, reduce-scatter, all-gather and all-to-all over hundreds of KiB
 * with uneven row counts (a zero included), so the members' parts and pairs
 * span many blocks and end off their edges; once as the machine runs the
 * ranks and once with every rank bound to one processor (every member's
 * share runs on the same core, preempted anywhere). */
static int64_t piece_rows(int r) { return r == 1 ? 0 : 1100 * (r + 1) + 7 * r; } /* x 15 elements */
static int64_t piece_split(int i, int j) { return (i + 2 * j + 1) % 3 * 700 + 3 * i + j; }

/* out holds want's bits; then want, in and out are freed. */
static void expect_moved(cpar_ctx *ctx, cpar_group *g, cpar_tensor *in, cpar_tensor *out, void *want, cpar_dtype dt,
                         int64_t count, const char *what) {
    void *got = tu_download(ctx, out);
    expect_same(got, want, dt, count, what, g);
    free(got);
    free(want);
    free_tensor(ctx, in);
    free_tensor(ctx, out);
}

static cpar_status rank_pieces(cpar_ctx *ctx, void *p) {
    (void)p;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), me = cpar_group_rank(g);
    static const struct {
        cpar_dtype dt;
        cpar_reduce_op op;
    } cases[] = {{CPAR_F32, CPAR_SUM}, {CPAR_BF16, CPAR_SUM}, {CPAR_I32, CPAR_MAX}};
    char msg[256];
    for (int c = 0; c < 3; c++) {
        cpar_dtype dt = cases[c].dt;
        cpar_reduce_op op = cases[c].op;
        size_t es = cpar_dtype_size(dt);
        int64_t sizes[MAX_RANKS], total = 0, off = 0, s[3], rows[MAX_RANKS];
        for (int r = 0; r < n; r++) {
            sizes[r] = piece_rows(r);
            if (r < me) off += sizes[r];
            total += sizes[r];
        }
        for (int r = 0; r < n; r++) rows[r] = total + 6000; /* the all-to-all sends up to 4 x 1412 rows */
        void *x[MAX_RANKS];
        gen_inputs(x, n, dt, rows, 900 + c);
        double *want = malloc((size_t)(total * ROW_ELEMS) * sizeof *want + 1);
        ref_reduce(dt, op, x, n, 0, total * ROW_ELEMS, want);
        /* all-reduce, in place */
        {
            cpar_tensor t = tu_upload(ctx, x[me], dt, 3, shape3(total, s));
            TU_OK(cpar_all_reduce(g, &t, &t, op));
            void *got = tu_download(ctx, &t);
            ck_assert_msg(reduce_mismatch(got, dt, op, n, want, total * ROW_ELEMS, msg, sizeof msg) < 0,
                          "pieces all_reduce %s, rank %d of %d: %s", cpar_dtype_name(dt), me, n, msg);
            free(got);
            free_tensor(ctx, &t);
        }
        /* reduce-scatter, uneven sizes */
        {
            cpar_tensor in = tu_upload(ctx, x[me], dt, 3, shape3(total, s));
            cpar_tensor out = tu_alloc_poisoned(ctx, dt, 3, shape3(sizes[me], s));
            TU_OK(cpar_reduce_scatter(g, &in, &out, op, sizes));
            void *got = tu_download(ctx, &out);
            ck_assert_msg(reduce_mismatch(got, dt, op, n, want + off * ROW_ELEMS, sizes[me] * ROW_ELEMS, msg,
                                          sizeof msg) < 0,
                          "pieces reduce_scatter %s, rank %d of %d: %s", cpar_dtype_name(dt), me, n, msg);
            free(got);
            free_tensor(ctx, &in);
            free_tensor(ctx, &out);
        }
        free(want);
        /* all-gather of the first sizes[r] rows of every rank's input */
        {
            cpar_tensor in = tu_upload(ctx, x[me], dt, 3, shape3(sizes[me], s));
            cpar_tensor out = tu_alloc_poisoned(ctx, dt, 3, shape3(total, s));
            TU_OK(cpar_all_gather(g, &in, &out, sizes));
            char *want_ag = malloc((size_t)(total * ROW_ELEMS) * es + 1), *at = want_ag;
            for (int r = 0; r < n; r++) {
                memcpy(at, x[r], (size_t)(sizes[r] * ROW_ELEMS) * es);
                at += sizes[r] * ROW_ELEMS * (int64_t)es;
            }
            expect_moved(ctx, g, &in, &out, want_ag, dt, total * ROW_ELEMS, "pieces all_gather");
        }
        /* all-to-all, uneven splits, from the first rows of every rank's input */
        {
            int64_t in_rows = 0, out_rows = 0, in_splits[MAX_RANKS], out_splits[MAX_RANKS];
            for (int j = 0; j < n; j++) in_rows += in_splits[j] = piece_split(me, j);
            for (int i = 0; i < n; i++) out_rows += out_splits[i] = piece_split(i, me);
            cpar_tensor in = tu_upload(ctx, x[me], dt, 3, shape3(in_rows, s));
            cpar_tensor out = tu_alloc_poisoned(ctx, dt, 3, shape3(out_rows, s));
            TU_OK(cpar_all_to_all_single(g, &in, &out, out_splits, in_splits));
            size_t row = ROW_ELEMS * es;
            char *want_a2a = malloc((size_t)out_rows * row + 1), *at = want_a2a;
            for (int i = 0; i < n; i++) {
                int64_t first = 0;
                for (int j = 0; j < me; j++) first += piece_split(i, j);
                memcpy(at, (char *)x[i] + (size_t)first * row, (size_t)piece_split(i, me) * row);
                at += (size_t)piece_split(i, me) * row;
            }
            expect_moved(ctx, g, &in, &out, want_a2a, dt, out_rows * ROW_ELEMS, "pieces all_to_all");
        }
        free_all(x, n);
    }
    return CPAR_OK;
}

START_TEST(test_pieces) {
    int n = group_sizes[_i];
    if (n < 2 || n > 4) return; /* 8 ranks on one processor would take long; 1 rank moves nothing */
    TU_OK(tu_spawn(n, rank_pieces, NULL));
    cpu_set_t all, one;
    ck_assert(sched_getaffinity(0, sizeof all, &all) == 0);
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &all)) {
            CPU_SET(c, &one);
            break;
        }
    ck_assert(sched_setaffinity(0, sizeof one, &one) == 0); /* the rank threads inherit it */
    cpar_status st = tu_spawn(n, rank_pieces, NULL);
    ck_assert(sched_setaffinity(0, sizeof all, &all) == 0);
    TU_OK(st);
}
END_TEST

/* ---- point to point -------------------------------------------------------------------- */

enum { P2P_SENDRECV, P2P_SEND_THEN_RECV, P2P_RING_SHIFT, P2P_MODES };
static const char *const p2p_names[] = {"sendrecv", "send+recv", "ring_shift"};
static const int shifts[] = {1, -1, 2};

/* Rows a rank sends: they differ between ranks (ring shift: 3 everywhere). */
static int64_t p2p_rows(int mode, int r) { return mode == P2P_RING_SHIFT ? 3 : (r + 2) % 3; }

static cpar_status rank_p2p(cpar_ctx *ctx, void *p) {
    (void)p;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), me = cpar_group_rank(g), call = 0;
    for (int mode = 0; mode < P2P_MODES; mode++)
        for (int k = 0; k < 3; k++)
            for (int d = 0; d < N_DTYPES; d++, call++) {
                cpar_dtype dt = all_dtypes[d];
                int shift = shifts[k], sh = mod(shift, n), to = mod(me + shift, n), from = mod(me - shift, n);
                /* Separate send and recv need a peer other than oneself. */
                if (mode == P2P_SEND_THEN_RECV && sh == 0) continue;
                int64_t rows[MAX_RANKS], s[3];
                for (int r = 0; r < n; r++) rows[r] = p2p_rows(mode, r);
                void *x[MAX_RANKS];
                gen_inputs(x, n, dt, rows, call);
                cpar_tensor send = tu_upload(ctx, x[me], dt, 3, shape3(rows[me], s));
                cpar_tensor recv = tu_alloc_poisoned(ctx, dt, 3, shape3(rows[from], s));
                TU_OK(cpar_group_stats_reset(g));
                uint64_t sb = cpar_tensor_nbytes(&send), rb = cpar_tensor_nbytes(&recv);
                if (mode == P2P_SENDRECV) {
                    TU_OK(cpar_sendrecv(g, &send, to, &recv, from));
                } else if (mode == P2P_RING_SHIFT) {
                    TU_OK(cpar_ring_shift(g, &send, &recv, shift));
                } else if (me < gcd(n, sh)) { /* the first rank of each cycle sends first */
                    TU_OK(cpar_send(g, &send, to));
                    TU_OK(cpar_recv(g, &recv, from));
                } else {
                    TU_OK(cpar_recv(g, &recv, from));
                    TU_OK(cpar_send(g, &send, to));
                }
                expect_stats(g, CPAR_COLL_SEND_RECV, mode == P2P_SEND_THEN_RECV ? 2 : 1, to == me ? 0 : sb,
                             from == me ? 0 : rb);
                void *got = tu_download(ctx, &recv);
                ck_assert_msg(tu_bits_mismatch(got, x[from], dt, rows[from] * ROW_ELEMS) < 0,
                              "%s shift %d %s: rank %d of %d did not receive rank %d's data", p2p_names[mode], shift,
                              cpar_dtype_name(dt), me, n, from);
                free(got);
                free_all(x, n);
                free_tensor(ctx, &send);
                free_tensor(ctx, &recv);
            }
    return CPAR_OK;
}

START_TEST(test_p2p) { TU_OK(tu_spawn(group_sizes[_i], rank_p2p, NULL)); }
END_TEST

/* ---- barrier ---------------------------------------------------------------------------- */

static cpar_status rank_barrier(cpar_ctx *ctx, void *p) {
    coll_arg *a = p;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g);
    TU_OK(cpar_group_stats_reset(g));
    for (int round = 1; round <= 3; round++) {
        atomic_fetch_add(&a->arrived, 1);
        TU_OK(cpar_barrier(g));
        /* Nobody leaves a barrier before everyone reached it. */
        ck_assert_int_ge(atomic_load(&a->arrived), n * round);
        TU_OK(cpar_barrier(g)); /* nobody starts the next round before this check */
    }
    expect_stats(g, CPAR_COLL_BARRIER, 6, 0, 0);
    return CPAR_OK;
}

START_TEST(test_barrier) {
    coll_arg *a = calloc(1, sizeof *a);
    TU_OK(tu_spawn(group_sizes[_i], rank_barrier, a));
    ck_assert_int_eq(atomic_load(&a->arrived), 3 * group_sizes[_i]);
    free(a);
}
END_TEST

/* cpar_sync is the host's one promise that queued work has run: on the
 * simulated devices (whose memory the host can address) the sum is read
 * straight from device memory after it, with no copy that would wait by
 * itself. Under the deferred stream modes a sync that waits for nothing
 * leaves the poison there. */
static cpar_status rank_sync_completes(cpar_ctx *ctx, void *p) {
    (void)p;
    cpar_group *w = cpar_world_group(ctx);
    int n = cpar_world_size(ctx), me = cpar_rank(ctx);
    int64_t shape[] = {7};
    int32_t x[7];
    for (int i = 0; i < 7; i++) x[i] = (me + 1) * (i + 2);
    cpar_tensor in = tu_upload(ctx, x, CPAR_I32, 1, shape), out = tu_alloc_poisoned(ctx, CPAR_I32, 1, shape);
    TU_OK(cpar_all_reduce(w, &in, &out, CPAR_SUM));
    TU_OK(cpar_sync(ctx));
    const int32_t *got = out.data;
    for (int i = 0; i < 7; i++) ck_assert_int_eq(got[i], n * (n + 1) / 2 * (i + 2));
    TU_OK(cpar_tensor_free(ctx, &in));
    TU_OK(cpar_tensor_free(ctx, &out));
    return CPAR_OK;
}

/* An allocation right after a collective, nothing synchronised: on a GPU
 * cudaMalloc takes a device-wide lock that can deadlock with NCCL kernels in
 * flight, so cpar waits for its streams first (the simulator refuses a
 * cudaMalloc with NCCL work queued on the device). */
static cpar_status rank_alloc_after_collective(cpar_ctx *ctx, void *p) {
    (void)p;
    int64_t shape[] = {5};
    int32_t x[5] = {1, 2, 3, 4, 5};
    cpar_tensor in = tu_upload(ctx, x, CPAR_I32, 1, shape), out = tu_alloc_poisoned(ctx, CPAR_I32, 1, shape), more;
    TU_OK(cpar_all_reduce(cpar_world_group(ctx), &in, &out, CPAR_SUM));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_I32, 1, shape, &more));
    TU_OK(cpar_tensor_free(ctx, &more));
    TU_OK(cpar_tensor_free(ctx, &in));
    TU_OK(cpar_tensor_free(ctx, &out));
    return CPAR_OK;
}

START_TEST(test_sync_completes) {
    if (!tu_on_device()) return; /* host tensors: nothing is queued */
    TU_OK(tu_spawn(group_sizes[_i], rank_sync_completes, NULL));
    TU_OK(tu_spawn(group_sizes[_i], rank_alloc_after_collective, NULL));
}
END_TEST

START_TEST(test_coll_kind_names) {
    static const char *const want[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                       "broadcast",  "send_recv",  "barrier"};
    ck_assert_int_eq(sizeof want / sizeof want[0], CPAR_COLL_KIND_COUNT);
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++) ck_assert_str_eq(cpar_coll_kind_name((cpar_coll_kind)k), want[k]);
    ck_assert_ptr_nonnull(cpar_coll_kind_name(CPAR_COLL_KIND_COUNT));
}
END_TEST

/* ---- group split ------------------------------------------------------------------------ */

/* g's members are the world ranks members[0..m) in group rank order: check
 * the accessors, then an all-reduce and an all-gather of the world rank. */
static void check_group(cpar_ctx *ctx, cpar_group *g, const int *members, int m) {
    int me = cpar_rank(ctx), pos = -1;
    for (int i = 0; i < m; i++)
        if (members[i] == me) pos = i;
    ck_assert_int_ge(pos, 0);
    ck_assert_ptr_nonnull(g);
    ck_assert_int_eq(cpar_group_size(g), m);
    ck_assert_int_eq(cpar_group_rank(g), pos);
    ck_assert_ptr_eq(cpar_group_ctx(g), ctx);
    for (int i = 0; i < m; i++) ck_assert_int_eq(cpar_group_world_rank(g, i), members[i]);
    ck_assert_int_eq(cpar_group_world_rank(g, m), -1);

    cpar_group *w = cpar_world_group(ctx);
    TU_OK(cpar_group_stats_reset(w));
    TU_OK(cpar_group_stats_reset(g));
    int64_t mine[2] = {me, 1}, two[] = {2}, one[] = {1}, all[] = {m}, sum = 0;
    for (int i = 0; i < m; i++) sum += members[i];
    cpar_tensor in = tu_upload(ctx, mine, CPAR_I64, 1, two), out = tu_alloc_poisoned(ctx, CPAR_I64, 1, two);
    TU_OK(cpar_all_reduce(g, &in, &out, CPAR_SUM));
    int64_t *got = tu_download(ctx, &out);
    ck_assert_int_eq(got[0], sum);
    ck_assert_int_eq(got[1], m);
    free(got);
    free_tensor(ctx, &in);
    free_tensor(ctx, &out);

    int32_t wr = me;
    cpar_tensor gin = tu_upload(ctx, &wr, CPAR_I32, 1, one), gout = tu_alloc_poisoned(ctx, CPAR_I32, 1, all);
    TU_OK(cpar_all_gather(g, &gin, &gout, NULL));
    int32_t *order = tu_download(ctx, &gout);
    for (int i = 0; i < m; i++) ck_assert_int_eq(order[i], members[i]);
    free(order);
    free_tensor(ctx, &gin);
    free_tensor(ctx, &gout);

    /* The traffic is counted on g, not on the world group. */
    cpar_comm_stats s;
    TU_OK(cpar_group_stats(g, &s));
    ck_assert_int_eq(s.kind[CPAR_COLL_ALL_REDUCE].calls, 1);
    ck_assert_int_eq(s.kind[CPAR_COLL_ALL_GATHER].calls, 1);
    if (g != w) expect_stats(w, CPAR_COLL_ALL_REDUCE, 0, 0, 0);
}

static cpar_status rank_split(cpar_ctx *ctx, void *p) {
    (void)p;
    cpar_group *w = cpar_world_group(ctx);
    int n = cpar_group_size(w), me = cpar_rank(ctx), members[MAX_RANKS], m;

    /* By parity, keyed by rank: {c, c+2, ...}. */
    cpar_group *par;
    TU_OK(cpar_group_split(w, me % 2, me, &par));
    m = 0;
    for (int r = me % 2; r < n; r += 2) members[m++] = r;
    check_group(ctx, par, members, m);

    /* One color, keys decreasing with the rank: the order reverses. */
    cpar_group *rev;
    TU_OK(cpar_group_split(w, 3, 100 - 7 * me, &rev));
    for (int i = 0; i < n; i++) members[i] = n - 1 - i;
    check_group(ctx, rev, members, n);

    /* A split of a split, by parity of the reversed rank. */
    cpar_group *nested;
    int rr = cpar_group_rank(rev);
    TU_OK(cpar_group_split(rev, rr % 2, rr, &nested));
    m = 0;
    for (int j = rr % 2; j < n; j += 2) members[m++] = n - 1 - j;
    check_group(ctx, nested, members, m);

    /* Rank 0 opts out with CPAR_SPLIT_NOCOLOR. */
    cpar_group *rest = (cpar_group *)w;
    TU_OK(cpar_group_split(w, me == 0 ? CPAR_SPLIT_NOCOLOR : 1, me, &rest));
    if (me == 0) {
        ck_assert_ptr_null(rest);
    } else {
        for (int i = 0; i < n - 1; i++) members[i] = i + 1;
        check_group(ctx, rest, members, n - 1);
    }

    TU_OK(cpar_group_destroy(nested));
    TU_OK(cpar_group_destroy(rev));
    TU_OK(cpar_group_destroy(par));
    if (rest) TU_OK(cpar_group_destroy(rest));
    /* The world group is unaffected. */
    for (int i = 0; i < n; i++) members[i] = i;
    check_group(ctx, w, members, n);

    /* Bad input: the same on every rank, so no rank waits for another. */
    cpar_group *out = (cpar_group *)w;
    TU_FAILS(cpar_group_split(NULL, 0, 0, &out), CPAR_ERR_INVALID, "group");
    TU_FAILS(cpar_group_split(w, -2, 0, &out), CPAR_ERR_INVALID, "color");
    TU_MSG_HAS("-2");
    TU_FAILS(cpar_group_split(w, 0, 0, NULL), CPAR_ERR_INVALID, "out");
    TU_FAILS(cpar_group_destroy(NULL), CPAR_ERR_INVALID, "group");
    return CPAR_OK;
}

START_TEST(test_split) { TU_OK(tu_spawn(group_sizes[_i], rank_split, NULL)); }
END_TEST

/* ---- bad input --------------------------------------------------------------------------- */

/* A view of t with another device, or another shape over the same data. */
static cpar_tensor on_device(const cpar_tensor *t, int device) {
    cpar_tensor v = *t;
    v.device = device;
    return v;
}

static cpar_tensor view(const cpar_tensor *t, int64_t elem_off, int ndim, const int64_t *shape) {
    return cpar_tensor_make((char *)t->data + elem_off * (int64_t)cpar_dtype_size(t->dtype), t->dtype, ndim, shape,
                            t->device);
}

/* The tensors of the bad-input tests (group of 3, F32 unless named h*). */
typedef struct {
    cpar_tensor a, b;     /* [3,3,5] */
    cpar_tensor a9, b9;   /* [9,3,5] */
    cpar_tensor a7, b8;   /* [7,3,5], [8,3,5] */
    cpar_tensor h3, h9;   /* F16 [3,3,5], [9,3,5] */
    cpar_tensor bx;       /* [3,3,4] */
    cpar_tensor bflat;    /* [45] */
    cpar_tensor whole;    /* [136]: views of it overlap */
    cpar_tensor scalar;   /* [] */
    float *data;
} bad_tensors;

enum { BAD_NULL_GROUP, BAD_NULL_TENSOR, BAD_DTYPE, BAD_SHAPE, BAD_SIZES, BAD_DIVISIBLE, BAD_OP_ROOT, BAD_PEER,
       BAD_OVERLAP, BAD_DEVICE, BAD_CASES };

/* Every rank makes the same bad calls, each refused on the spot with a
 * message that names the argument; nothing is written and the group still
 * works afterwards. One case per test, so one failure hides no other. */
static cpar_status rank_bad_input(cpar_ctx *ctx, void *p) {
    int which = *(int *)p;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), me = cpar_group_rank(g);
    ck_assert_int_eq(n, 3);
    bad_tensors T;
    int64_t s3[3], s9[3], s7[3], s8[3], sx[3] = {3, 3, 4}, flat[] = {45}, big[] = {9 * ROW_ELEMS + 1};
    T.data = tu_random_host(CPAR_F32, 9 * ROW_ELEMS, 5 + me);
    T.a = tu_upload(ctx, T.data, CPAR_F32, 3, shape3(3, s3));
    T.b = tu_alloc_poisoned(ctx, CPAR_F32, 3, s3);
    T.a9 = tu_upload(ctx, T.data, CPAR_F32, 3, shape3(9, s9));
    T.b9 = tu_alloc_poisoned(ctx, CPAR_F32, 3, s9);
    T.a7 = tu_upload(ctx, T.data, CPAR_F32, 3, shape3(7, s7));
    T.b8 = tu_alloc_poisoned(ctx, CPAR_F32, 3, shape3(8, s8));
    T.h3 = tu_alloc_poisoned(ctx, CPAR_F16, 3, s3);
    T.h9 = tu_alloc_poisoned(ctx, CPAR_F16, 3, s9);
    T.bx = tu_alloc_poisoned(ctx, CPAR_F32, 3, sx);
    T.bflat = tu_alloc_poisoned(ctx, CPAR_F32, 1, flat);
    T.whole = tu_alloc_poisoned(ctx, CPAR_F32, 1, big);
    float one = 1.0f;
    T.scalar = tu_upload(ctx, &one, CPAR_F32, 0, NULL);
    cpar_tensor *a = &T.a, *b = &T.b, *a9 = &T.a9, *b9 = &T.b9, *a7 = &T.a7, *b8 = &T.b8;
    cpar_comm_stats st;
    int64_t four[] = {4, 4, 4}, ones[] = {1, 1, 1}, neg[] = {3, -1, 7}, three[] = {3, 3, 3};

    switch (which) {
    case BAD_NULL_GROUP:
        TU_FAILS(cpar_all_reduce(NULL, a, b, CPAR_SUM), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_all_gather(NULL, a, b9, NULL), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_reduce_scatter(NULL, a9, b, CPAR_SUM, NULL), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_all_to_all_single(NULL, a9, b9, NULL, NULL), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_broadcast(NULL, a, 0), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_sendrecv(NULL, a, 1, b, 2), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_send(NULL, a, 1), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_recv(NULL, b, 1), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_ring_shift(NULL, a, b, 1), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_barrier(NULL), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_group_stats(NULL, &st), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_group_stats_reset(NULL), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_group_stats(g, NULL), CPAR_ERR_INVALID, "out");
        break;
    case BAD_NULL_TENSOR:
        TU_FAILS(cpar_all_reduce(g, NULL, b, CPAR_SUM), CPAR_ERR_INVALID, "in");
        TU_FAILS(cpar_all_reduce(g, a, NULL, CPAR_SUM), CPAR_ERR_INVALID, "out");
        TU_FAILS(cpar_all_gather(g, NULL, b9, NULL), CPAR_ERR_INVALID, "in");
        TU_FAILS(cpar_all_gather(g, a, NULL, NULL), CPAR_ERR_INVALID, "out");
        TU_FAILS(cpar_reduce_scatter(g, NULL, b, CPAR_SUM, NULL), CPAR_ERR_INVALID, "in");
        TU_FAILS(cpar_reduce_scatter(g, a9, NULL, CPAR_SUM, NULL), CPAR_ERR_INVALID, "out");
        TU_FAILS(cpar_all_to_all_single(g, NULL, b9, NULL, NULL), CPAR_ERR_INVALID, "in");
        TU_FAILS(cpar_all_to_all_single(g, a9, NULL, NULL, NULL), CPAR_ERR_INVALID, "out");
        TU_FAILS(cpar_broadcast(g, NULL, 0), CPAR_ERR_INVALID, "buf");
        TU_FAILS(cpar_sendrecv(g, NULL, 1, b, 2), CPAR_ERR_INVALID, "send");
        TU_FAILS(cpar_sendrecv(g, a, 1, NULL, 2), CPAR_ERR_INVALID, "recv");
        TU_FAILS(cpar_send(g, NULL, 1), CPAR_ERR_INVALID, "t");
        TU_FAILS(cpar_recv(g, NULL, 1), CPAR_ERR_INVALID, "t");
        TU_FAILS(cpar_ring_shift(g, NULL, b, 1), CPAR_ERR_INVALID, "in");
        TU_FAILS(cpar_ring_shift(g, a, NULL, 1), CPAR_ERR_INVALID, "out");
        break;
    case BAD_DTYPE: /* out's dtype differs from in's */
        TU_FAILS(cpar_all_reduce(g, a, &T.h3, CPAR_SUM), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("f16");
        TU_FAILS(cpar_all_gather(g, a, &T.h9, NULL), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("f16");
        TU_FAILS(cpar_reduce_scatter(g, a9, &T.h3, CPAR_SUM, NULL), CPAR_ERR_INVALID, "out");
        TU_FAILS(cpar_all_to_all_single(g, a9, &T.h9, NULL, NULL), CPAR_ERR_INVALID, "out");
        TU_FAILS(cpar_ring_shift(g, a, &T.h3, 1), CPAR_ERR_INVALID, "out");
        break;
    case BAD_SHAPE: /* the message gives the expected shape */
        TU_FAILS(cpar_all_reduce(g, a, &T.bx, CPAR_SUM), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("[3,3,5]");
        TU_FAILS(cpar_all_gather(g, a, b8, NULL), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("[9,3,5]");
        TU_FAILS(cpar_all_gather(g, a, &T.bflat, NULL), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("[9,3,5]");
        TU_FAILS(cpar_all_gather(g, a, b8, three), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("[9,3,5]");
        TU_FAILS(cpar_reduce_scatter(g, a9, &T.bx, CPAR_SUM, NULL), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("[3,3,5]");
        TU_FAILS(cpar_all_to_all_single(g, a9, &T.bx, NULL, NULL), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("[3,3,5]");
        TU_FAILS(cpar_all_to_all_single(g, a9, b8, NULL, NULL), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("8");
        TU_FAILS(cpar_ring_shift(g, a, &T.bx, 1), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("[3,3,5]");
        TU_FAILS(cpar_all_gather(g, &T.scalar, b9, NULL), CPAR_ERR_INVALID, "in");
        TU_FAILS(cpar_reduce_scatter(g, &T.scalar, b, CPAR_SUM, NULL), CPAR_ERR_INVALID, "in");
        break;
    case BAD_SIZES: /* split sizes that do not add up, or negative */
        TU_FAILS(cpar_all_gather(g, a, b9, four), CPAR_ERR_INVALID, "sizes");
        TU_FAILS(cpar_all_gather(g, a, b9, neg), CPAR_ERR_INVALID, "sizes");
        TU_MSG_HAS("-1");
        TU_FAILS(cpar_reduce_scatter(g, a9, b, CPAR_SUM, ones), CPAR_ERR_INVALID, "sizes");
        TU_FAILS(cpar_reduce_scatter(g, a9, b, CPAR_SUM, neg), CPAR_ERR_INVALID, "sizes");
        TU_FAILS(cpar_all_to_all_single(g, a9, b9, three, ones), CPAR_ERR_INVALID, "in_splits");
        TU_FAILS(cpar_all_to_all_single(g, a9, b9, four, three), CPAR_ERR_INVALID, "out_splits");
        TU_FAILS(cpar_all_to_all_single(g, a9, b9, three, neg), CPAR_ERR_INVALID, "in_splits");
        break;
    case BAD_DIVISIBLE: /* 7 rows over 3 ranks */
        TU_FAILS(cpar_reduce_scatter(g, a7, b, CPAR_SUM, NULL), CPAR_ERR_INVALID, "in");
        TU_MSG_HAS("7");
        TU_FAILS(cpar_all_to_all_single(g, a7, b9, NULL, NULL), CPAR_ERR_INVALID, "in");
        TU_MSG_HAS("7");
        break;
    case BAD_OP_ROOT:
        TU_FAILS(cpar_all_reduce(g, a, b, CPAR_REDUCE_OP_COUNT), CPAR_ERR_INVALID, "op");
        TU_FAILS(cpar_all_reduce(g, a, b, (cpar_reduce_op)-1), CPAR_ERR_INVALID, "op");
        TU_FAILS(cpar_reduce_scatter(g, a9, b, (cpar_reduce_op)7, NULL), CPAR_ERR_INVALID, "op");
        TU_FAILS(cpar_broadcast(g, a, 3), CPAR_ERR_INVALID, "root");
        TU_FAILS(cpar_broadcast(g, a, -1), CPAR_ERR_INVALID, "root");
        break;
    case BAD_PEER: /* the message names the peer argument */
        TU_FAILS(cpar_sendrecv(g, a, -2, b, 1), CPAR_ERR_INVALID, "send_to");
        TU_FAILS(cpar_recv(g, b, -1), CPAR_ERR_INVALID, "from");
        TU_FAILS(cpar_sendrecv(g, a, 3, b, 1), CPAR_ERR_INVALID, "send_to");
        TU_MSG_HAS("3");
        TU_FAILS(cpar_sendrecv(g, a, 1, b, 5), CPAR_ERR_INVALID, "recv_from");
        TU_MSG_HAS("5");
        TU_FAILS(cpar_send(g, a, 3), CPAR_ERR_INVALID, "to");
        TU_FAILS(cpar_recv(g, b, 4), CPAR_ERR_INVALID, "from");
        break;
    case BAD_OVERLAP: { /* views of one allocation */
        cpar_tensor lo = view(&T.whole, 0, 1, flat), hi = view(&T.whole, 1, 1, flat);
        TU_FAILS(cpar_all_reduce(g, &lo, &hi, CPAR_SUM), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("overlap");
        cpar_tensor gout = view(&T.whole, 0, 3, s9), gin = view(&T.whole, 2 * ROW_ELEMS, 3, s3);
        TU_FAILS(cpar_all_gather(g, &gin, &gout, NULL), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("overlap");
        TU_FAILS(cpar_reduce_scatter(g, &gout, &gin, CPAR_SUM, NULL), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("overlap");
        TU_FAILS(cpar_all_to_all_single(g, b9, b9, NULL, NULL), CPAR_ERR_INVALID, "out");
        TU_MSG_HAS("overlap");
        TU_FAILS(cpar_ring_shift(g, b, b, 1), CPAR_ERR_INVALID, "out");
        cpar_tensor s_lo = view(&T.whole, 0, 3, s3), s_hi = view(&T.whole, 7, 3, s3);
        TU_FAILS(cpar_sendrecv(g, &s_lo, 1, &s_hi, 2), CPAR_ERR_INVALID, "recv");
        TU_FAILS(cpar_sendrecv(g, b, mod(me + 1, 3), b, mod(me - 1, 3)), CPAR_ERR_INVALID, "recv");
        break;
    }
    case BAD_DEVICE: { /* on a device that is not the context's */
        int here = cpar_device(ctx), wrong[] = {here == CPAR_HOST ? 5 : CPAR_HOST, (here < 0 ? 0 : here) + 9};
        for (int k = 0; k < 2; k++) {
            cpar_tensor wa = on_device(a, wrong[k]), wb = on_device(b, wrong[k]);
            cpar_tensor wa9 = on_device(a9, wrong[k]), wb9 = on_device(b9, wrong[k]);
            TU_FAILS(cpar_all_reduce(g, &wa, b, CPAR_SUM), CPAR_ERR_INVALID, "in");
            TU_FAILS(cpar_all_reduce(g, a, &wb, CPAR_SUM), CPAR_ERR_INVALID, "out");
            TU_FAILS(cpar_all_gather(g, &wa, b9, NULL), CPAR_ERR_INVALID, "in");
            TU_FAILS(cpar_all_gather(g, a, &wb9, NULL), CPAR_ERR_INVALID, "out");
            TU_FAILS(cpar_reduce_scatter(g, &wa9, b, CPAR_SUM, NULL), CPAR_ERR_INVALID, "in");
            TU_FAILS(cpar_reduce_scatter(g, a9, &wb, CPAR_SUM, NULL), CPAR_ERR_INVALID, "out");
            TU_FAILS(cpar_all_to_all_single(g, &wa9, b9, NULL, NULL), CPAR_ERR_INVALID, "in");
            TU_FAILS(cpar_all_to_all_single(g, a9, &wb9, NULL, NULL), CPAR_ERR_INVALID, "out");
            TU_FAILS(cpar_broadcast(g, &wa, 0), CPAR_ERR_INVALID, "buf");
            TU_FAILS(cpar_sendrecv(g, &wa, 1, b, 2), CPAR_ERR_INVALID, "send");
            TU_FAILS(cpar_sendrecv(g, a, 1, &wb, 2), CPAR_ERR_INVALID, "recv");
            TU_FAILS(cpar_ring_shift(g, &wa, b, 1), CPAR_ERR_INVALID, "in");
            TU_FAILS(cpar_ring_shift(g, a, &wb, 1), CPAR_ERR_INVALID, "out");
        }
        break;
    }
    default: ck_abort_msg("no bad-input case %d", which);
    }

    /* Nothing was written, and the group still works. */
    cpar_tensor *outs[] = {b, b9, b8, &T.h3, &T.h9, &T.bx, &T.bflat, &T.whole};
    for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++) {
        void *h = tu_download(ctx, outs[i]);
        for (int64_t e = 0; e < cpar_tensor_numel(outs[i]); e++) ck_assert(isnan(tu_get(h, outs[i]->dtype, e)));
        free(h);
    }
    TU_OK(cpar_all_reduce(g, a, b, CPAR_MAX));
    float *got = tu_download(ctx, b);
    void *x[3];
    for (int r = 0; r < 3; r++) x[r] = tu_random_host(CPAR_F32, 9 * ROW_ELEMS, 5 + r);
    double want[3 * ROW_ELEMS];
    ref_reduce(CPAR_F32, CPAR_MAX, x, 3, 0, 3 * ROW_ELEMS, want);
    TU_EXPECT_CLOSE(got, CPAR_F32, want, 3 * ROW_ELEMS, 0.0);
    free(got);
    free_all(x, 3);
    cpar_tensor *all[] = {a, b, a9, b9, a7, b8, &T.h3, &T.h9, &T.bx, &T.bflat, &T.whole, &T.scalar};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free_tensor(ctx, all[i]);
    free(T.data);
    return CPAR_OK;
}

START_TEST(test_bad_input) {
    int which = _i;
    TU_OK(tu_spawn(3, rank_bad_input, &which));
}
END_TEST

Suite *suite(void) {
    Suite *s = suite_create("coll: collectives, statistics, group split");
    struct {
        const char *name;
        const TTest *test;
    } loops[] = {
        {"all_reduce", test_all_reduce}, {"all_gather", test_all_gather}, {"reduce_scatter", test_reduce_scatter},
        {"all_to_all", test_all_to_all}, {"broadcast", test_broadcast},   {"p2p", test_p2p},
        {"barrier", test_barrier},       {"split", test_split},             {"large", test_large},
        {"pieces", test_pieces},
        {"sync", test_sync_completes},
    };
    for (size_t i = 0; i < sizeof loops / sizeof loops[0]; i++) {
        TCase *tc = tcase_create(loops[i].name);
        tcase_add_loop_test(tc, loops[i].test, 0, N_SIZES); /* group sizes 1, 2, 3, 4, 8 */
        tcase_set_timeout(tc, 120);
        /* make test-tsan leaves it out (CK_EXCLUDE_TAGS): 16 MiB a rank takes 2 minutes there */
        if (loops[i].test == test_large) tcase_set_tags(tc, "large");
        suite_add_tcase(s, tc);
    }
    TCase *tc = tcase_create("bad_input");
    tcase_add_test(tc, test_coll_kind_names);
    tcase_add_loop_test(tc, test_bad_input, 0, BAD_CASES);
    tcase_set_timeout(tc, 60);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
