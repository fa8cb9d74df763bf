/* SPDX-License-Identifier: MIT */
/* test_rng.c — RNG, dropout and activation checkpointing (cpar.h §9).
 *
 * Philox4x32-10 against the Random123 known-answer vectors; random fills and
 * dropout against references computed here from cpar_philox4x32_10 (uniform
 * and dropout bit for bit; normal against a double-precision Box-Muller
 * within a few fp32 ulps); on the device backend the same state is drawn into
 * host memory (host reference loops) and device memory (the CUDA kernels on
 * the simulator) and the two must agree bit for bit. The tracker: Megatron's
 * seeds, duplicate names and seeds, fork/unfork nesting, snapshots.
 * Checkpointing: recomputation reproduces dropout masks bit for bit and
 * leaves the tracker as it was; 1-D chunk split/gather and
 * distribute/gather at group sizes 1, 2, 3, 4. Statistics: keep fraction,
 * scale, mean and std within a few sigma. Bad input names the argument. */
#include "testutil.h"

static const cpar_dtype float_dtypes[] = {CPAR_F32, CPAR_F16, CPAR_BF16};
#define N_FLOAT 3
static const int64_t sizes[] = {1, 7, 33, 1001};
#define N_SIZES ((int)(sizeof sizes / sizeof sizes[0]))

static const int group_sizes[] = {1, 2, 3, 4};
#define N_GROUPS 4

/* ---- plumbing ------------------------------------------------------------------ */

typedef void (*rank_test)(cpar_ctx *ctx, int param);
typedef struct {
    rank_test fn;
    int param;
} rank_job;

static cpar_status rank_run(cpar_ctx *ctx, void *p) {
    rank_job *j = p;
    j->fn(ctx, j->param);
    return CPAR_OK;
}

static void run_ranks(int nranks, rank_test fn, int param) {
    rank_job j = {fn, param};
    TU_OK(tu_spawn(nranks, rank_run, &j));
}

static bool on_device(const cpar_ctx *ctx) { return cpar_device(ctx) != CPAR_HOST; }

static void free_tensor(cpar_ctx *ctx, cpar_tensor *t) { TU_OK(cpar_tensor_free(ctx, t)); }

static cpar_tensor host_tensor(cpar_dtype dt, int64_t n) {
    void *p = malloc(n > 0 ? (size_t)n * cpar_dtype_size(dt) : 1);
    ck_assert_ptr_nonnull(p);
    memset(p, 0xff, n > 0 ? (size_t)n * cpar_dtype_size(dt) : 1);
    return cpar_tensor_make(p, dt, 1, &n, CPAR_HOST);
}

static cpar_rng_state cur_state(cpar_ctx *ctx) {
    cpar_rng_state s;
    TU_OK(cpar_rng_get_state(ctx, NULL, &s));
    return s;
}

static cpar_rng_state named_state(cpar_ctx *ctx, const char *name) {
    cpar_rng_state s;
    TU_OK(cpar_rng_get_state(ctx, name, &s));
    return s;
}

#define ASSERT_STATE(s, want_seed, want_offset)                                                              \
    ck_assert_msg((s).seed == (uint64_t)(want_seed) && (s).offset == (uint64_t)(want_offset),                \
                  "state (%llu, %llu), expected (%llu, %llu)", (unsigned long long)(s).seed,                  \
                  (unsigned long long)(s).offset, (unsigned long long)(want_seed),                            \
                  (unsigned long long)(want_offset))

/* Word i of a draw from (seed, offset), from the public block function. */
static uint32_t word(uint64_t seed, uint64_t offset, int64_t i) {
    uint32_t w[4];
    cpar_philox4x32_10(seed, offset + (uint64_t)(i / 4), w);
    return w[i % 4];
}

/* Draw one element (one block) into host memory. */
static void skip_block(cpar_ctx *ctx) {
    float v;
    cpar_tensor t = cpar_tensor_make(&v, CPAR_F32, 0, NULL, CPAR_HOST);
    TU_OK(cpar_rng_uniform(ctx, &t, 0.f, 1.f));
}

/* Snapshots are equal: current, count, and every name and state in order. */
static bool snap_equal(const cpar_rng_snapshot *a, const cpar_rng_snapshot *b) {
    if (a->current.seed != b->current.seed || a->current.offset != b->current.offset || a->count != b->count)
        return false;
    for (int i = 0; i < a->count; i++)
        if (strcmp(a->names[i], b->names[i]) || a->states[i].seed != b->states[i].seed ||
            a->states[i].offset != b->states[i].offset)
            return false;
    return true;
}

static float u01(uint32_t w) { return (float)(w >> 8) * 0x1p-24f; }

/* Draw into a tensor on where (CPAR_HOST or the device) and download it. */
enum { FILL_UNIFORM, FILL_NORMAL };
static void *draw(cpar_ctx *ctx, int kind, cpar_dtype dt, int64_t n, bool host, float a, float b) {
    cpar_tensor t = host ? host_tensor(dt, n) : tu_alloc_poisoned(ctx, dt, 1, &n);
    if (kind == FILL_UNIFORM) TU_OK(cpar_rng_uniform(ctx, &t, a, b));
    else TU_OK(cpar_rng_normal(ctx, &t, a, b));
    if (host) return t.data;
    void *got = tu_download(ctx, &t);
    free_tensor(ctx, &t);
    return got;
}

/* ---- Philox known answers ------------------------------------------------------------ */

START_TEST(test_philox_kat) {
    /* Random123 kat_vectors, philox4x32 10: counter words, key words, output words (word 0 first). */
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d, 0x41c83b0e, 0xa20bc7c6,
         0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09, 0x94fdcceb, 0x5001e420,
         0x24126ea1},
    };
    for (int k = 0; k < 3; k++) {
        uint32_t out[4];
        cpar_philox4x32_10_block(kat[k], kat[k] + 4, out);
        for (int e = 0; e < 4; e++)
            ck_assert_msg(out[e] == kat[k][6 + e], "vector %d word %d: %08x, expected %08x", k, e, out[e], kat[k][6 + e]);
    }
    /* The (seed, counter) form: counter {lo, hi, 0, 0}, key {lo, hi}. */
    uint32_t a[4], b[4];
    cpar_philox4x32_10(0, 0, a);
    for (int e = 0; e < 4; e++) ck_assert_uint_eq(a[e], kat[0][6 + e]);
    const uint64_t seed = 0x299f31d0a4093822ull, ctr = 0x85a308d3243f6a88ull;
    const uint32_t c4[4] = {(uint32_t)ctr, (uint32_t)(ctr >> 32), 0, 0}, k2[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    cpar_philox4x32_10(seed, ctr, a);
    cpar_philox4x32_10_block(c4, k2, b);
    for (int e = 0; e < 4; e++) ck_assert_uint_eq(a[e], b[e]);
    /* Consecutive counters differ (the stream moves). */
    cpar_philox4x32_10(seed, ctr + 1, b);
    ck_assert(memcmp(a, b, sizeof a) != 0);
}
END_TEST

/* ---- uniform ------------------------------------------------------------------------ */

static void uniform_case(cpar_ctx *ctx, int d) {
    cpar_dtype dt = float_dtypes[d];
    const float lo = -2.0f, hi = 3.0f;
    for (int k = 0; k < N_SIZES; k++) {
        int64_t n = sizes[k];
        uint64_t seed = 1234 + (uint64_t)k;
        TU_OK(cpar_rng_manual_seed(ctx, seed));
        /* Two draws in a row: the second starts ceil(n/4) blocks later. */
        void *got[2];
        for (int rep = 0; rep < 2; rep++) {
            got[rep] = draw(ctx, FILL_UNIFORM, dt, n, false, lo, hi);
            cpar_rng_state s = cur_state(ctx);
            ASSERT_STATE(s, seed, (uint64_t)(rep + 1) * (uint64_t)((n + 3) / 4));
        }
        for (int rep = 0; rep < 2; rep++) {
            void *want = tu_random_host(dt, n, 1);
            for (int64_t i = 0; i < n; i++) {
                float v = fmaf(u01(word(seed, (uint64_t)rep * (uint64_t)((n + 3) / 4), i)), hi - lo, lo);
                tu_set(want, dt, i, v < hi ? v : lo);
            }
            int64_t bad = tu_bits_mismatch(got[rep], want, dt, n);
            ck_assert_msg(bad < 0, "uniform %s n %lld draw %d element %lld: %.9g, expected %.9g", cpar_dtype_name(dt),
                          (long long)n, rep, (long long)bad, tu_get(got[rep], dt, bad < 0 ? 0 : bad),
                          tu_get(want, dt, bad < 0 ? 0 : bad));
            for (int64_t i = 0; i < n; i++) {
                double v = tu_get(got[rep], dt, i);
                ck_assert(v >= lo && (dt == CPAR_F32 ? v < hi : v <= hi));
            }
            free(want);
            free(got[rep]);
        }
        /* Host memory from the same state: the reference loops give the same bits. */
        if (on_device(ctx)) {
            cpar_rng_state s = {seed, 5};
            TU_OK(cpar_rng_set_state(ctx, NULL, &s));
            void *dev = draw(ctx, FILL_UNIFORM, dt, n, false, lo, hi);
            TU_OK(cpar_rng_set_state(ctx, NULL, &s));
            void *host = draw(ctx, FILL_UNIFORM, dt, n, true, lo, hi);
            TU_EXPECT_SAME(dev, host, dt, n);
            free(dev);
            free(host);
        }
    }
    /* A misaligned view (the scalar path of the kernel) gives the same values
     * as an aligned draw from the same state. */
    int64_t n = 37, n1 = n + 1;
    cpar_tensor whole = tu_alloc_poisoned(ctx, dt, 1, &n1);
    cpar_tensor view = cpar_tensor_make((char *)whole.data + cpar_dtype_size(dt), dt, 1, &n, whole.device);
    cpar_rng_state s = {99, 1};
    TU_OK(cpar_rng_set_state(ctx, NULL, &s));
    TU_OK(cpar_rng_uniform(ctx, &view, 0.0f, 1.0f));
    TU_OK(cpar_rng_set_state(ctx, NULL, &s));
    void *aligned = draw(ctx, FILL_UNIFORM, dt, n, false, 0.0f, 1.0f);
    void *all = tu_download(ctx, &whole);
    TU_EXPECT_SAME((char *)all + cpar_dtype_size(dt), aligned, dt, n);
    free(all);
    free(aligned);
    free_tensor(ctx, &whole);
    /* lo == hi gives lo everywhere; an empty tensor draws nothing. */
    TU_OK(cpar_rng_manual_seed(ctx, 5));
    void *flat = draw(ctx, FILL_UNIFORM, dt, 9, false, 0.5f, 0.5f);
    for (int64_t i = 0; i < 9; i++) ck_assert(tu_get(flat, dt, i) == 0.5);
    free(flat);
    int64_t zero = 0;
    cpar_tensor empty = cpar_tensor_make(NULL, dt, 1, &zero, cpar_device(ctx));
    cpar_rng_state before = cur_state(ctx);
    TU_OK(cpar_rng_uniform(ctx, &empty, 0.0f, 1.0f));
    cpar_rng_state after = cur_state(ctx);
    ASSERT_STATE(after, before.seed, before.offset);
}

START_TEST(test_uniform) { run_ranks(1, uniform_case, _i); }
END_TEST

/* ---- normal ----------------------------------------------------------------------------- */

/* Box-Muller in double from the same words. */
static double ref_normal(uint64_t seed, uint64_t offset, int64_t i) {
    int64_t e = i & ~(int64_t)1;
    double u1 = ((double)(word(seed, offset, e) >> 8) + 1.0) * 0x1p-24;
    double u2 = (double)(word(seed, offset, e + 1) >> 8) * 0x1p-24;
    double r = sqrt(-2.0 * log(u1)), t = 2.0 * 3.14159265358979323846 * u2;
    return (i & 1) ? r * sin(t) : r * cos(t);
}

static void normal_case(cpar_ctx *ctx, int d) {
    cpar_dtype dt = float_dtypes[d];
    const float mean = 0.25f, std = 1.5f;
    for (int k = 0; k < N_SIZES; k++) {
        int64_t n = sizes[k];
        uint64_t seed = 777 + (uint64_t)k;
        TU_OK(cpar_rng_manual_seed(ctx, seed));
        void *got = draw(ctx, FILL_NORMAL, dt, n, false, mean, std);
        ASSERT_STATE(cur_state(ctx), seed, (n + 3) / 4);
        double *want = malloc((size_t)n * sizeof *want);
        for (int64_t i = 0; i < n; i++) want[i] = mean + std * ref_normal(seed, 0, i);
        /* fp32 Box-Muller: a few ulps of the result (log < 1 ulp, sin/cos < 2). */
        char msg[256];
        double tol = dt == CPAR_F32 ? 4e-6 : tu_tol(dt);
        ck_assert_msg(tu_mismatch(got, dt, want, n, tol, msg, sizeof msg) < 0, "normal %s n %lld: %s",
                      cpar_dtype_name(dt), (long long)n, msg);
        free(want);
        free(got);
        if (on_device(ctx)) {
            cpar_rng_state s = {seed, 3};
            TU_OK(cpar_rng_set_state(ctx, NULL, &s));
            void *dev = draw(ctx, FILL_NORMAL, dt, n, false, mean, std);
            TU_OK(cpar_rng_set_state(ctx, NULL, &s));
            void *host = draw(ctx, FILL_NORMAL, dt, n, true, mean, std);
            TU_EXPECT_SAME(dev, host, dt, n);
            free(dev);
            free(host);
        }
    }
}

START_TEST(test_normal) { run_ranks(1, normal_case, _i); }
END_TEST

/* ---- statistics on 10^5 elements --------------------------------------------------------- */

#define STAT_N 100000

static void stats_case(cpar_ctx *ctx, int which) {
    TU_OK(cpar_rng_manual_seed(ctx, 2024 + (uint64_t)which));
    int64_t n = STAT_N;
    if (which == 0) { /* uniform [lo, hi): mean (lo+hi)/2, variance (hi-lo)^2/12 */
        float *v = draw(ctx, FILL_UNIFORM, CPAR_F32, n, false, -1.0f, 3.0f);
        double s = 0, s2 = 0, lo = 1e9, hi = -1e9;
        for (int64_t i = 0; i < n; i++) {
            s += v[i];
            s2 += (double)v[i] * v[i];
            lo = fmin(lo, v[i]);
            hi = fmax(hi, v[i]);
        }
        double mean = s / n, var = s2 / n - mean * mean, sd = sqrt(16.0 / 12.0);
        ck_assert_msg(fabs(mean - 1.0) < 5 * sd / sqrt((double)n), "uniform mean %g", mean);
        ck_assert_msg(fabs(var - 16.0 / 12.0) < 0.03, "uniform variance %g", var);
        ck_assert(lo >= -1.0 && lo < -0.99 && hi < 3.0 && hi > 2.99);
        free(v);
    } else { /* normal: mean and std; about 68.3% within one std */
        const float mean = -0.5f, std = 2.0f;
        float *v = draw(ctx, FILL_NORMAL, CPAR_F32, n, false, mean, std);
        double s = 0, s2 = 0;
        int64_t in1 = 0;
        for (int64_t i = 0; i < n; i++) {
            ck_assert(isfinite(v[i]));
            s += v[i];
            s2 += (double)v[i] * v[i];
            in1 += fabs(v[i] - mean) < std;
        }
        double m = s / n, sd = sqrt(s2 / n - m * m), frac = (double)in1 / n;
        ck_assert_msg(fabs(m - mean) < 5 * std / sqrt((double)n), "normal mean %g, expected %g", m, (double)mean);
        ck_assert_msg(fabs(sd - std) < 5 * std / sqrt(2.0 * n), "normal std %g, expected %g", sd, (double)std);
        ck_assert_msg(fabs(frac - 0.682689) < 5 * sqrt(0.2166 / n), "normal within 1 std: %g", frac);
        free(v);
    }
}

START_TEST(test_stats) { run_ranks(1, stats_case, _i); }
END_TEST

/* ---- dropout ---------------------------------------------------------------------------- */

/* Forward with a mask against the reference; backward with the mask and
 * by recomputation from the used state; in place; host vs device. */
static void dropout_case(cpar_ctx *ctx, int d) {
    cpar_dtype dt = float_dtypes[d];
    const float p = 0.3f, scale = 1.0f / (1.0f - p);
    for (int k = 0; k < N_SIZES; k++) {
        int64_t n = sizes[k];
        uint64_t seed = 4321 + (uint64_t)k;
        TU_OK(cpar_rng_manual_seed(ctx, seed));
        skip_block(ctx); /* scalar: advances by one block */
        void *xh = tu_random_host(dt, n, 10 + (uint64_t)k), *dyh = tu_random_host(dt, n, 20 + (uint64_t)k);
        cpar_tensor x = tu_upload(ctx, xh, dt, 1, &n), y = tu_alloc_poisoned(ctx, dt, 1, &n);
        cpar_tensor mask = tu_alloc_poisoned(ctx, CPAR_U8, 1, &n);
        cpar_rng_state used;
        TU_OK(cpar_dropout_forward(ctx, p, &x, &y, &mask, &used));
        ASSERT_STATE(used, seed, 1);
        ASSERT_STATE(cur_state(ctx), seed, 1 + (n + 3) / 4);
        /* Reference. */
        uint8_t *want_mask = malloc((size_t)n);
        void *want_y = tu_random_host(dt, n, 1), *want_dx = tu_random_host(dt, n, 1);
        for (int64_t i = 0; i < n; i++) {
            int keep = u01(word(seed, 1, i)) >= p;
            want_mask[i] = (uint8_t)keep;
            tu_set(want_y, dt, i, ((float)tu_get(xh, dt, i) * (float)keep) * scale);
            tu_set(want_dx, dt, i, ((float)tu_get(dyh, dt, i) * (float)keep) * scale);
        }
        void *got_y = tu_download(ctx, &y), *got_mask = tu_download(ctx, &mask);
        TU_EXPECT_SAME(got_mask, want_mask, CPAR_U8, n);
        TU_EXPECT_SAME(got_y, want_y, dt, n);
        /* Backward: with the mask, and regenerated from the state (no mask). */
        cpar_tensor dy = tu_upload(ctx, dyh, dt, 1, &n), dx1 = tu_alloc_poisoned(ctx, dt, 1, &n),
                    dx2 = tu_alloc_poisoned(ctx, dt, 1, &n);
        cpar_rng_state before = cur_state(ctx);
        TU_OK(cpar_dropout_backward(ctx, p, &dy, &dx1, &mask, NULL));
        TU_OK(cpar_dropout_backward(ctx, p, &dy, &dx2, NULL, &used));
        cpar_rng_state after = cur_state(ctx);
        ASSERT_STATE(after, before.seed, before.offset); /* backward draws nothing */
        void *g1 = tu_download(ctx, &dx1), *g2 = tu_download(ctx, &dx2);
        TU_EXPECT_SAME(g1, want_dx, dt, n);
        TU_EXPECT_SAME(g2, want_dx, dt, n);
        /* In place, no mask, from the same state: same y; in-place backward too. */
        TU_OK(cpar_rng_set_state(ctx, NULL, &used));
        TU_OK(cpar_dropout_forward(ctx, p, &x, &x, NULL, NULL));
        void *got_x = tu_download(ctx, &x);
        TU_EXPECT_SAME(got_x, want_y, dt, n);
        TU_OK(cpar_dropout_backward(ctx, p, &dy, &dy, NULL, &used));
        void *got_dy = tu_download(ctx, &dy);
        TU_EXPECT_SAME(got_dy, want_dx, dt, n);
        /* Host memory from the same state: same bits as the device. */
        if (on_device(ctx)) {
            cpar_tensor hx = cpar_tensor_make(xh, dt, 1, &n, CPAR_HOST), hy = host_tensor(dt, n),
                        hm = host_tensor(CPAR_U8, n);
            TU_OK(cpar_rng_set_state(ctx, NULL, &used));
            TU_OK(cpar_dropout_forward(ctx, p, &hx, &hy, &hm, NULL));
            TU_EXPECT_SAME(hy.data, got_y, dt, n);
            TU_EXPECT_SAME(hm.data, got_mask, CPAR_U8, n);
            free(hy.data);
            free(hm.data);
        }
        /* p == 0: a copy, mask all ones, nothing drawn. */
        cpar_rng_state s0 = cur_state(ctx), u0;
        cpar_tensor x2 = tu_upload(ctx, xh, dt, 1, &n);
        TU_OK(cpar_dropout_forward(ctx, 0.0f, &x2, &y, &mask, &u0));
        ASSERT_STATE(u0, s0.seed, s0.offset);
        ASSERT_STATE(cur_state(ctx), s0.seed, s0.offset);
        void *copy = tu_download(ctx, &y), *ones = tu_download(ctx, &mask);
        TU_EXPECT_SAME(copy, xh, dt, n);
        for (int64_t i = 0; i < n; i++) ck_assert_uint_eq(((uint8_t *)ones)[i], 1);
        free(copy);
        free(ones);
        free(got_x);
        free(got_dy);
        free(g1);
        free(g2);
        free(got_y);
        free(got_mask);
        free(want_mask);
        free(want_y);
        free(want_dx);
        free(xh);
        free(dyh);
        cpar_tensor *ts[] = {&x, &x2, &y, &mask, &dy, &dx1, &dx2};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) free_tensor(ctx, ts[i]);
    }
}

START_TEST(test_dropout) { run_ranks(1, dropout_case, _i); }
END_TEST

/* Keep fraction within 5 sigma of 1 - p on 10^5 elements; kept values are
 * x * 1/(1-p) exactly (x = 1), dropped ones 0; the mean is preserved. */
static const float stat_p[] = {0.1f, 0.5f, 0.9f};

static void dropout_stats_case(cpar_ctx *ctx, int k) {
    float p = stat_p[k];
    int64_t n = STAT_N;
    TU_OK(cpar_rng_manual_seed(ctx, 31337 + (uint64_t)k));
    float *ones = malloc((size_t)n * sizeof *ones);
    for (int64_t i = 0; i < n; i++) ones[i] = 1.0f;
    cpar_tensor x = tu_upload(ctx, ones, CPAR_F32, 1, &n), y = tu_alloc_poisoned(ctx, CPAR_F32, 1, &n);
    TU_OK(cpar_dropout_forward(ctx, p, &x, &y, NULL, NULL));
    float *got = tu_download(ctx, &y), scale = 1.0f / (1.0f - p);
    int64_t kept = 0;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) {
        ck_assert_msg(got[i] == 0.0f || got[i] == scale, "element %lld is %g, expected 0 or %g", (long long)i,
                      (double)got[i], (double)scale);
        kept += got[i] != 0.0f;
        sum += got[i];
    }
    double frac = (double)kept / n, sigma = sqrt((double)p * (1.0 - p) / n);
    ck_assert_msg(fabs(frac - (1.0 - p)) < 5 * sigma, "p %g: kept %g, expected %g +- %g", (double)p, frac, 1.0 - p,
                  5 * sigma);
    ck_assert_msg(fabs(sum / n - 1.0) < 5 * sigma * scale, "p %g: mean %g, expected 1", (double)p, sum / n);
    free(got);
    free(ones);
    free_tensor(ctx, &x);
    free_tensor(ctx, &y);
}

START_TEST(test_dropout_stats) { run_ranks(1, dropout_stats_case, _i); }
END_TEST

/* ---- tracker ------------------------------------------------------------------------------ */

static void tracker_seeds_case(cpar_ctx *ctx, int unused) {
    (void)unused;
    /* Before any seeding: torch's default seed, no named states. */
    cpar_rng_snapshot s;
    TU_OK(cpar_rng_get_states(ctx, &s));
    ASSERT_STATE(s.current, CPAR_RNG_DEFAULT_SEED, 0);
    ck_assert_int_eq(s.count, 0);

    skip_block(ctx);
    TU_OK(cpar_model_parallel_manual_seed(ctx, 1234, 3, 2, 1));
    TU_OK(cpar_rng_get_states(ctx, &s));
    ASSERT_STATE(s.current, 1234, 0);
    ck_assert_int_eq(s.count, 3);
    ck_assert_str_eq(s.names[0], CPAR_RNG_DATA_PARALLEL);
    ck_assert_str_eq(s.names[1], CPAR_RNG_MODEL_PARALLEL);
    ck_assert_str_eq(s.names[2], CPAR_RNG_EXPERT_PARALLEL);
    ck_assert_str_eq(CPAR_RNG_MODEL_PARALLEL, "model-parallel-rng");
    ASSERT_STATE(s.states[0], 1234, 0);
    ASSERT_STATE(s.states[1], 1234 + 2718 + 3, 0);
    ASSERT_STATE(s.states[2], 1234 + 1024 + 100 * 2 + 1, 0);
    /* Negative ranks: no grid -> tp 0; ep, etp -> 0. Calling again resets. */
    TU_OK(cpar_rng_add(ctx, "extra", 5));
    TU_OK(cpar_model_parallel_manual_seed(ctx, 10, -1, -1, -1));
    TU_OK(cpar_rng_get_states(ctx, &s));
    ck_assert_int_eq(s.count, 3);
    ASSERT_STATE(s.states[1], 10 + 2718, 0);
    ASSERT_STATE(s.states[2], 10 + 1024, 0);

    /* Duplicates: the seed first (as the seed checks it), then the name. */
    TU_FAILS(cpar_rng_add(ctx, "new", 10), CPAR_ERR_INVALID, "cpar_rng_add: seed 10 already exists");
    TU_FAILS(cpar_rng_add(ctx, CPAR_RNG_MODEL_PARALLEL, 11), CPAR_ERR_INVALID, "\"model-parallel-rng\" already exists");
    TU_FAILS(cpar_rng_add(ctx, CPAR_RNG_MODEL_PARALLEL, 10), CPAR_ERR_INVALID, "seed 10");
    TU_FAILS(cpar_rng_add(ctx, NULL, 11), CPAR_ERR_INVALID, "name is NULL");
    TU_FAILS(cpar_rng_add(ctx, "", 11), CPAR_ERR_INVALID, "name is empty");
    char long_name[CPAR_RNG_NAME_MAX + 1];
    memset(long_name, 'a', CPAR_RNG_NAME_MAX);
    long_name[CPAR_RNG_NAME_MAX] = 0;
    TU_FAILS(cpar_rng_add(ctx, long_name, 11), CPAR_ERR_INVALID, "longer than 63");
    long_name[CPAR_RNG_NAME_MAX - 1] = 0; /* 63 chars: fine */
    TU_OK(cpar_rng_add(ctx, long_name, 11));
    /* Seeds that collide inside model_parallel_manual_seed: 0 + 2718 + 0 == 0 + 1024 + 1600 + 94. */
    TU_FAILS(cpar_model_parallel_manual_seed(ctx, 0, 0, 16, 94), CPAR_ERR_INVALID, "seed 2718 already exists");
    TU_MSG_HAS("cpar_model_parallel_manual_seed");
    /* Capacity. */
    TU_OK(cpar_rng_reset(ctx));
    TU_OK(cpar_rng_get_states(ctx, &s));
    ck_assert_int_eq(s.count, 0);
    for (int i = 0; i < CPAR_RNG_MAX_STATES; i++) {
        char name[16];
        snprintf(name, sizeof name, "s%d", i);
        TU_OK(cpar_rng_add(ctx, name, 100 + (uint64_t)i));
    }
    TU_FAILS(cpar_rng_add(ctx, "one-more", 99), CPAR_ERR_INVALID, "16 states");
    /* The current state is untouched by add/reset. */
    ASSERT_STATE(cur_state(ctx), 0, 0);
}

START_TEST(test_tracker_seeds) { run_ranks(1, tracker_seeds_case, 0); }
END_TEST

/* With a grid, tp_rank < 0 takes the context's TP rank. */
static void tracker_grid_case(cpar_ctx *ctx, int tp) {
    TU_OK(cpar_grid_init(ctx, &(cpar_grid_config){.tp = tp}));
    TU_OK(cpar_model_parallel_manual_seed(ctx, 500, -1, -1, -1));
    int tp_rank = cpar_rank(ctx) % tp;
    ASSERT_STATE(named_state(ctx, CPAR_RNG_MODEL_PARALLEL), 500 + 2718 + tp_rank, 0);
    ASSERT_STATE(named_state(ctx, CPAR_RNG_DATA_PARALLEL), 500, 0);
    ASSERT_STATE(named_state(ctx, CPAR_RNG_EXPERT_PARALLEL), 500 + 1024, 0);
}

START_TEST(test_tracker_grid) { run_ranks(4, tracker_grid_case, _i == 0 ? 2 : 4); }
END_TEST

/* fork/unfork: the outer state comes back untouched, the named one advances. */
static void fork_case(cpar_ctx *ctx, int unused) {
    (void)unused;
    TU_OK(cpar_model_parallel_manual_seed(ctx, 42, 1, 0, 0));
    const uint64_t mp = 42 + 2718 + 1;
    skip_block(ctx); /* current: (42, 1) */
    int64_t n = 10;                                             /* 3 blocks */
    TU_OK(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
    ASSERT_STATE(cur_state(ctx), mp, 0);
    float *a = draw(ctx, FILL_UNIFORM, CPAR_F32, n, false, 0.f, 1.f);
    for (int64_t i = 0; i < n; i++) ck_assert(a[i] == u01(word(mp, 0, i))); /* drawn from the named state */
    TU_OK(cpar_rng_unfork(ctx));
    ASSERT_STATE(cur_state(ctx), 42, 1);
    ASSERT_STATE(named_state(ctx, CPAR_RNG_MODEL_PARALLEL), mp, 3);
    /* A second fork continues where the first stopped. */
    TU_OK(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
    float *b = draw(ctx, FILL_UNIFORM, CPAR_F32, n, false, 0.f, 1.f);
    for (int64_t i = 0; i < n; i++) ck_assert(b[i] == u01(word(mp, 3, i)));
    TU_OK(cpar_rng_unfork(ctx));
    ASSERT_STATE(named_state(ctx, CPAR_RNG_MODEL_PARALLEL), mp, 6);
    /* Nesting: model -> data -> back. */
    TU_OK(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
    skip_block(ctx); /* model: 7 */
    TU_OK(cpar_rng_fork(ctx, CPAR_RNG_DATA_PARALLEL));
    ASSERT_STATE(cur_state(ctx), 42, 0);
    free(draw(ctx, FILL_NORMAL, CPAR_F32, 8, false, 0.f, 1.f)); /* data: 2 */
    TU_OK(cpar_rng_unfork(ctx));
    ASSERT_STATE(cur_state(ctx), mp, 7);
    ASSERT_STATE(named_state(ctx, CPAR_RNG_DATA_PARALLEL), 42, 2);
    skip_block(ctx); /* model: 8 */
    TU_OK(cpar_rng_unfork(ctx));
    ASSERT_STATE(cur_state(ctx), 42, 1);
    ASSERT_STATE(named_state(ctx, CPAR_RNG_MODEL_PARALLEL), mp, 8);
    /* Megatron HEAD's double fork: a -> b -> a draws one sequence from a and
     * one from b, as single forks of each would. */
    {
        cpar_rng_state m0 = named_state(ctx, CPAR_RNG_MODEL_PARALLEL), d0 = named_state(ctx, CPAR_RNG_DATA_PARALLEL);
        float *x[3], *y[2];
        TU_OK(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
        x[0] = draw(ctx, FILL_UNIFORM, CPAR_F32, n, false, 0.f, 1.f);
        TU_OK(cpar_rng_fork(ctx, CPAR_RNG_DATA_PARALLEL));
        y[0] = draw(ctx, FILL_UNIFORM, CPAR_F32, n, false, 0.f, 1.f);
        TU_OK(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
        x[1] = draw(ctx, FILL_UNIFORM, CPAR_F32, n, false, 0.f, 1.f);
        TU_OK(cpar_rng_unfork(ctx));
        y[1] = draw(ctx, FILL_UNIFORM, CPAR_F32, n, false, 0.f, 1.f);
        TU_OK(cpar_rng_unfork(ctx));
        x[2] = draw(ctx, FILL_UNIFORM, CPAR_F32, n, false, 0.f, 1.f);
        TU_OK(cpar_rng_unfork(ctx));
        ASSERT_STATE(cur_state(ctx), 42, 1);
        for (int k = 0; k < 3; k++)
            for (int64_t i = 0; i < n; i++)
                ck_assert_msg(x[k][i] == u01(word(mp, m0.offset + 3 * (uint64_t)k, i)), "model draw %d, element %lld", k,
                              (long long)i);
        for (int k = 0; k < 2; k++)
            for (int64_t i = 0; i < n; i++)
                ck_assert_msg(y[k][i] == u01(word(d0.seed, d0.offset + 3 * (uint64_t)k, i)), "data draw %d, element %lld", k,
                              (long long)i);
        ASSERT_STATE(named_state(ctx, CPAR_RNG_MODEL_PARALLEL), mp, m0.offset + 9);
        ASSERT_STATE(named_state(ctx, CPAR_RNG_DATA_PARALLEL), d0.seed, d0.offset + 6);
        for (int k = 0; k < 3; k++) free(x[k]);
        for (int k = 0; k < 2; k++) free(y[k]);
    }
    /* Depth limit, unbalanced unfork, unknown name. */
    for (int i = 0; i < CPAR_RNG_MAX_FORK_DEPTH; i++) TU_OK(cpar_rng_fork(ctx, CPAR_RNG_EXPERT_PARALLEL));
    TU_FAILS(cpar_rng_fork(ctx, CPAR_RNG_EXPERT_PARALLEL), CPAR_ERR_INVALID, "8 forks are open");
    for (int i = 0; i < CPAR_RNG_MAX_FORK_DEPTH; i++) TU_OK(cpar_rng_unfork(ctx));
    ASSERT_STATE(cur_state(ctx), 42, 1);
    TU_FAILS(cpar_rng_unfork(ctx), CPAR_ERR_INVALID, "cpar_rng_unfork: no fork is open");
    TU_FAILS(cpar_rng_fork(ctx, "nope"), CPAR_ERR_INVALID, "\"nope\" is not a tracked RNG state");
    TU_FAILS(cpar_rng_fork(ctx, NULL), CPAR_ERR_INVALID, "name is NULL");
    /* A reset while forked: unfork stores the state back under its name. */
    TU_OK(cpar_rng_fork(ctx, CPAR_RNG_DATA_PARALLEL));
    TU_OK(cpar_rng_reset(ctx));
    skip_block(ctx);
    TU_OK(cpar_rng_unfork(ctx));
    ASSERT_STATE(named_state(ctx, CPAR_RNG_DATA_PARALLEL), 42, 9); /* 2, 6 more in the double fork, 1 here */
    ASSERT_STATE(cur_state(ctx), 42, 1);
    /* get_state/set_state of a named state. */
    cpar_rng_state s = {7, 70};
    TU_OK(cpar_rng_set_state(ctx, CPAR_RNG_DATA_PARALLEL, &s));
    ASSERT_STATE(named_state(ctx, CPAR_RNG_DATA_PARALLEL), 7, 70);
    TU_FAILS(cpar_rng_get_state(ctx, "nope", &s), CPAR_ERR_INVALID, "\"nope\"");
    TU_FAILS(cpar_rng_set_state(ctx, "nope", &s), CPAR_ERR_INVALID, "\"nope\"");
    TU_FAILS(cpar_rng_get_state(ctx, NULL, NULL), CPAR_ERR_INVALID, "out is NULL");
    TU_FAILS(cpar_rng_set_state(ctx, NULL, NULL), CPAR_ERR_INVALID, "state is NULL");
    free(a);
    free(b);
}

START_TEST(test_fork) { run_ranks(1, fork_case, 0); }
END_TEST

/* Snapshots restore every state; invalid snapshots are refused. */
static void snapshot_case(cpar_ctx *ctx, int unused) {
    (void)unused;
    TU_OK(cpar_model_parallel_manual_seed(ctx, 9, 0, 0, 0));
    cpar_rng_snapshot s0, s1, bad;
    TU_OK(cpar_rng_get_states(ctx, &s0));
    free(draw(ctx, FILL_UNIFORM, CPAR_F32, 40, false, 0.f, 1.f));
    TU_OK(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
    free(draw(ctx, FILL_UNIFORM, CPAR_F32, 40, false, 0.f, 1.f));
    TU_OK(cpar_rng_unfork(ctx));
    TU_OK(cpar_rng_get_states(ctx, &s1));
    ck_assert(!snap_equal(&s0, &s1));
    TU_OK(cpar_rng_set_states(ctx, &s0));
    TU_OK(cpar_rng_get_states(ctx, &s1));
    ck_assert(snap_equal(&s0, &s1));
    /* Same state, same numbers. */
    float *a = draw(ctx, FILL_NORMAL, CPAR_F32, 21, false, 0.f, 1.f);
    TU_OK(cpar_rng_set_states(ctx, &s0));
    float *b = draw(ctx, FILL_NORMAL, CPAR_F32, 21, false, 0.f, 1.f);
    ck_assert(memcmp(a, b, 21 * sizeof *a) == 0);
    free(a);
    free(b);
    /* Duplicate seeds are checked against the restored states. */
    cpar_rng_snapshot mid;
    TU_OK(cpar_rng_get_states(ctx, &mid));
    TU_FAILS(cpar_rng_add(ctx, "x", 9), CPAR_ERR_INVALID, "seed 9 already exists");
    bad = s0;
    bad.count = CPAR_RNG_MAX_STATES + 1;
    TU_FAILS(cpar_rng_set_states(ctx, &bad), CPAR_ERR_INVALID, "snapshot has count 17");
    bad = s0;
    bad.names[1][0] = 0;
    TU_FAILS(cpar_rng_set_states(ctx, &bad), CPAR_ERR_INVALID, "snapshot names[1] is empty");
    bad = s0;
    memset(bad.names[2], 'z', CPAR_RNG_NAME_MAX);
    TU_FAILS(cpar_rng_set_states(ctx, &bad), CPAR_ERR_INVALID, "not NUL-terminated");
    bad = s0;
    strcpy(bad.names[2], bad.names[0]);
    TU_FAILS(cpar_rng_set_states(ctx, &bad), CPAR_ERR_INVALID, "names[0] and names[2]");
    TU_FAILS(cpar_rng_set_states(ctx, NULL), CPAR_ERR_INVALID, "snapshot is NULL");
    TU_FAILS(cpar_rng_get_states(ctx, NULL), CPAR_ERR_INVALID, "out is NULL");
    TU_OK(cpar_rng_get_states(ctx, &s1));
    ck_assert(snap_equal(&mid, &s1)); /* failed calls changed nothing */
}

START_TEST(test_snapshot) { run_ranks(1, snapshot_case, 0); }
END_TEST

/* ---- checkpointing ---------------------------------------------------------------------------- */

/* The checkpointed block: dropout in the data-parallel region (current
 * state), then a forked model-parallel dropout and a normal draw. */
typedef struct {
    cpar_tensor x, y1, y2, z, m1, m2;
    int calls;
    cpar_status fail; /* returned after the work when set */
} block_arg;

static cpar_status block_fn(cpar_ctx *ctx, void *p) {
    block_arg *a = p;
    a->calls++;
    cpar_status st = cpar_dropout_forward(ctx, 0.4f, &a->x, &a->y1, &a->m1, NULL);
    if (st == CPAR_OK) st = cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL);
    if (st == CPAR_OK) st = cpar_dropout_forward(ctx, 0.2f, &a->y1, &a->y2, &a->m2, NULL);
    if (st == CPAR_OK) st = cpar_rng_normal(ctx, &a->z, 0.f, 1.f);
    if (st == CPAR_OK) st = cpar_rng_unfork(ctx);
    return st == CPAR_OK ? a->fail : st;
}

static void checkpoint_case(cpar_ctx *ctx, int d) {
    cpar_dtype dt = float_dtypes[d];
    int64_t shape[] = {5, 3, 7}, n = 105;
    void *xh = tu_random_host(dt, n, 77);
    block_arg a = {.x = tu_upload(ctx, xh, dt, 3, shape)};
    cpar_tensor *outs[] = {&a.y1, &a.y2, &a.z, &a.m1, &a.m2};
    for (int i = 0; i < 5; i++) *outs[i] = tu_alloc_poisoned(ctx, i < 3 ? dt : CPAR_U8, 3, shape);
    TU_OK(cpar_model_parallel_manual_seed(ctx, 2718, 0, 0, 0));
    free(draw(ctx, FILL_UNIFORM, dt, 5, false, 0.f, 1.f));

    cpar_checkpoint ck = {0};
    TU_OK(cpar_checkpoint_forward(ctx, &ck, block_fn, &a));
    void *first[5];
    for (int i = 0; i < 5; i++) first[i] = tu_download(ctx, outs[i]);
    /* Later layers draw more, and a fork is open when the backward recomputes. */
    free(draw(ctx, FILL_NORMAL, dt, 50, false, 0.f, 1.f));
    TU_OK(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
    free(draw(ctx, FILL_NORMAL, dt, 50, false, 0.f, 1.f));
    cpar_rng_snapshot before, after;
    TU_OK(cpar_rng_get_states(ctx, &before));
    /* CheckpointWithoutOutput: the outputs were released; refill fresh buffers. */
    for (int i = 0; i < 5; i++) {
        free_tensor(ctx, outs[i]);
        *outs[i] = tu_alloc_poisoned(ctx, i < 3 ? dt : CPAR_U8, 3, shape);
    }
    TU_OK(cpar_checkpoint_recompute(ctx, &ck, block_fn, &a));
    ck_assert_int_eq(a.calls, 2);
    for (int i = 0; i < 5; i++) {
        void *again = tu_download(ctx, outs[i]);
        TU_EXPECT_SAME(again, first[i], outs[i]->dtype, n);
        free(again);
    }
    TU_OK(cpar_rng_get_states(ctx, &after));
    ck_assert(snap_equal(&before, &after));
    /* The open fork survived: unfork stores into the model state. */
    TU_OK(cpar_rng_unfork(ctx));
    TU_FAILS(cpar_rng_unfork(ctx), CPAR_ERR_INVALID, "no fork is open");
    /* A failing fn: its status comes back and the tracker is restored. */
    TU_OK(cpar_rng_get_states(ctx, &before));
    a.fail = CPAR_ERR_UNSUPPORTED;
    ck_assert_int_eq(cpar_checkpoint_recompute(ctx, &ck, block_fn, &a), CPAR_ERR_UNSUPPORTED);
    TU_OK(cpar_rng_get_states(ctx, &after));
    ck_assert(snap_equal(&before, &after));
    TU_FAILS(cpar_rng_unfork(ctx), CPAR_ERR_INVALID, "no fork is open");
    TU_OK(cpar_checkpoint_release(ctx, &ck));
    /* Recompute before any forward; NULLs. */
    TU_FAILS(cpar_checkpoint_recompute(ctx, &ck, block_fn, &a), CPAR_ERR_INVALID, "cpar_checkpoint_forward first");
    TU_FAILS(cpar_checkpoint_forward(ctx, NULL, block_fn, &a), CPAR_ERR_INVALID, "ck is NULL");
    TU_FAILS(cpar_checkpoint_forward(ctx, &ck, NULL, &a), CPAR_ERR_INVALID, "fn is NULL");
    TU_FAILS(cpar_checkpoint_recompute(ctx, &ck, NULL, &a), CPAR_ERR_INVALID, "fn is NULL");
    TU_FAILS(cpar_checkpoint_forward(NULL, &ck, block_fn, &a), CPAR_ERR_INVALID, "ctx is NULL");
    for (int i = 0; i < 5; i++) {
        free(first[i]);
        free_tensor(ctx, outs[i]);
    }
    free_tensor(ctx, &a.x);
    free(xh);
}

START_TEST(test_checkpoint) { run_ranks(1, checkpoint_case, _i); }
END_TEST

/* A block run inside an open model-parallel fork that draws, then forks the
 * same name again: the recomputation must see that fork open too, or the
 * inner fork would restart from the stored state and draw differently. */
typedef struct {
    float *draws[2];
} refork_arg;

static cpar_status refork_fn(cpar_ctx *ctx, void *p) {
    refork_arg *a = p;
    for (int k = 0; k < 2; k++) free(a->draws[k]);
    a->draws[0] = draw(ctx, FILL_UNIFORM, CPAR_F32, 12, false, 0.f, 1.f);
    TU_OK(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
    a->draws[1] = draw(ctx, FILL_UNIFORM, CPAR_F32, 12, false, 0.f, 1.f);
    return cpar_rng_unfork(ctx);
}

static void checkpoint_refork_case(cpar_ctx *ctx, int unused) {
    (void)unused;
    TU_OK(cpar_model_parallel_manual_seed(ctx, 5, 0, 0, 0));
    refork_arg a = {{NULL, NULL}};
    cpar_checkpoint ck = {0};
    TU_OK(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
    TU_OK(cpar_checkpoint_forward(ctx, &ck, refork_fn, &a));
    float *first[2] = {a.draws[0], a.draws[1]};
    a.draws[0] = a.draws[1] = NULL;
    for (int64_t i = 0; i < 12; i++) ck_assert(first[1][i] != first[0][i]); /* one sequence, not a restart */
    TU_OK(cpar_rng_unfork(ctx));
    TU_OK(cpar_checkpoint_recompute(ctx, &ck, refork_fn, &a));
    for (int k = 0; k < 2; k++) {
        for (int64_t i = 0; i < 12; i++) ck_assert_msg(a.draws[k][i] == first[k][i], "draw %d element %lld", k, (long long)i);
        free(a.draws[k]);
        free(first[k]);
        a.draws[k] = NULL;
    }
    TU_FAILS(cpar_rng_unfork(ctx), CPAR_ERR_INVALID, "no fork is open"); /* the recorded fork closed again */
    ck.fork_depth = CPAR_RNG_MAX_FORK_DEPTH + 1; /* a checkpoint not made by cpar_checkpoint_forward */
    TU_FAILS(cpar_checkpoint_recompute(ctx, &ck, refork_fn, &a), CPAR_ERR_INVALID, "ck->fork_depth is 9, expected 0..8");
    TU_OK(cpar_checkpoint_release(ctx, &ck));
}

START_TEST(test_checkpoint_refork) { run_ranks(1, checkpoint_refork_case, 0); }
END_TEST

/* ---- 1-D chunks and distributed activations at group sizes 1..4 ------------------------------ */

static cpar_status nop_fn(cpar_ctx *ctx, void *arg) {
    (void)ctx;
    (void)arg;
    return CPAR_OK;
}

static void chunks_case(cpar_ctx *ctx, int size_index) {
    int r = cpar_rank(ctx);
    cpar_group *g = cpar_world_group(ctx);
    int size = cpar_group_size(g);
    ck_assert_int_eq(size, group_sizes[size_index]);
    static const int64_t shapes[][3] = {{2, 3, 4}, {6, 5, 2}, {12, 1, 1}};
    static const cpar_dtype dts[] = {CPAR_F32, CPAR_BF16, CPAR_I64};
    for (int k = 0; k < 3; k++) {
        cpar_dtype dt = dts[k];
        int64_t numel = shapes[k][0] * shapes[k][1] * shapes[k][2], m = numel / size;
        void *xh = tu_random_host(dt, numel, 500 + (uint64_t)k); /* the same on every rank */
        cpar_tensor x = tu_upload(ctx, xh, dt, 3, shapes[k]), chunk = tu_alloc_poisoned(ctx, dt, 1, &m);
        TU_OK(cpar_split_1d_chunk(g, &x, &chunk));
        void *got = tu_download(ctx, &chunk);
        TU_EXPECT_SAME(got, (char *)xh + (size_t)(r * m) * cpar_dtype_size(dt), dt, m);
        free(got);
        /* Gather into a tensor of another shape with the same numel. */
        int64_t flat[2] = {numel / 2, 2};
        cpar_tensor out = tu_alloc_poisoned(ctx, dt, 2, flat);
        TU_OK(cpar_gather_1d_chunks(g, &chunk, &out));
        got = tu_download(ctx, &out);
        TU_EXPECT_SAME(got, xh, dt, numel);
        free(got);

        /* distribute_saved_activations: keep the chunk, poison the activation, gather it back. */
        cpar_checkpoint ck = {0};
        TU_OK(cpar_checkpoint_forward(ctx, &ck, nop_fn, NULL));
        TU_OK(cpar_checkpoint_distribute(ctx, &ck, g, &x));
        void *saved_chunk = ck.chunk;
        cpar_tensor poison = tu_alloc_poisoned(ctx, dt, 3, shapes[k]);
        TU_OK(cpar_tensor_copy(ctx, &poison, &x));
        TU_FAILS(cpar_checkpoint_recompute(ctx, &ck, nop_fn, NULL), CPAR_ERR_INVALID, "still distributed");
        TU_OK(cpar_checkpoint_gather(ctx, &ck, g, &x));
        TU_OK(cpar_checkpoint_recompute(ctx, &ck, nop_fn, NULL));
        got = tu_download(ctx, &x);
        TU_EXPECT_SAME(got, xh, dt, numel);
        free(got);
        /* A second step reuses the buffer. */
        TU_OK(cpar_checkpoint_distribute(ctx, &ck, g, &x));
        ck_assert_ptr_eq(ck.chunk, saved_chunk);
        cpar_tensor other = tu_alloc_poisoned(ctx, dt == CPAR_F32 ? CPAR_I32 : CPAR_F32, 3, shapes[k]);
        TU_FAILS(cpar_checkpoint_gather(ctx, &ck, g, &other), CPAR_ERR_INVALID, "activation has dtype");
        free_tensor(ctx, &other);
        if (dt != CPAR_I64) {
            int64_t one = 1;
            cpar_tensor small = tu_alloc_poisoned(ctx, dt, 1, &one);
            TU_FAILS(cpar_checkpoint_gather(ctx, &ck, g, &small), CPAR_ERR_INVALID, "activation has 1 elements");
            free_tensor(ctx, &small);
        }
        TU_OK(cpar_checkpoint_gather(ctx, &ck, g, &x));
        TU_FAILS(cpar_checkpoint_gather(ctx, &ck, g, &x), CPAR_ERR_INVALID, "no distributed activation");
        TU_OK(cpar_checkpoint_release(ctx, &ck));
        ck_assert_ptr_null(ck.chunk);

        /* Bad sizes. */
        int64_t m1 = m + 1;
        cpar_tensor wrong = tu_alloc_poisoned(ctx, dt, 1, &m1);
        TU_FAILS(cpar_split_1d_chunk(g, &x, &wrong), CPAR_ERR_INVALID, "out has");
        TU_FAILS(cpar_gather_1d_chunks(g, &wrong, &out), CPAR_ERR_INVALID, "out has");
        if (size > 1) {
            int64_t odd = (int64_t)size * 3 + 1;
            cpar_tensor nd = tu_alloc_poisoned(ctx, dt, 1, &odd);
            TU_FAILS(cpar_split_1d_chunk(g, &nd, &chunk), CPAR_ERR_INVALID, "not divisible by the group size");
            TU_FAILS(cpar_checkpoint_distribute(ctx, &ck, g, &nd), CPAR_ERR_INVALID, "not divisible");
            free_tensor(ctx, &nd);
        }
        free_tensor(ctx, &wrong);
        free_tensor(ctx, &poison);
        free_tensor(ctx, &out);
        free_tensor(ctx, &chunk);
        free_tensor(ctx, &x);
        free(xh);
    }
}

START_TEST(test_chunks) { run_ranks(group_sizes[_i], chunks_case, _i); }
END_TEST

/* ---- bad input ------------------------------------------------------------------------------ */

static void bad_input_case(cpar_ctx *ctx, int unused) {
    (void)unused;
    int64_t n = 8, n9 = 9;
    cpar_tensor f = tu_alloc_poisoned(ctx, CPAR_F32, 1, &n), f2 = tu_alloc_poisoned(ctx, CPAR_F32, 1, &n),
                h = tu_alloc_poisoned(ctx, CPAR_F16, 1, &n), i32 = tu_alloc_poisoned(ctx, CPAR_I32, 1, &n),
                u8 = tu_alloc_poisoned(ctx, CPAR_U8, 1, &n), u9 = tu_alloc_poisoned(ctx, CPAR_U8, 1, &n9),
                f9 = tu_alloc_poisoned(ctx, CPAR_F32, 1, &n9);
    cpar_tensor nodata = cpar_tensor_make(NULL, CPAR_F32, 1, &n, cpar_device(ctx));
    cpar_tensor part = cpar_tensor_make((char *)f.data + 4, CPAR_F32, 1, &n, f.device); /* overlaps f */
    cpar_rng_state s = {1, 0};
    cpar_rng_state before = cur_state(ctx);

    TU_FAILS(cpar_rng_manual_seed(NULL, 1), CPAR_ERR_INVALID, "ctx is NULL");
    TU_FAILS(cpar_rng_reset(NULL), CPAR_ERR_INVALID, "ctx is NULL");
    TU_FAILS(cpar_rng_add(NULL, "a", 1), CPAR_ERR_INVALID, "ctx is NULL");
    TU_FAILS(cpar_rng_fork(NULL, "a"), CPAR_ERR_INVALID, "ctx is NULL");
    TU_FAILS(cpar_rng_unfork(NULL), CPAR_ERR_INVALID, "ctx is NULL");
    TU_FAILS(cpar_rng_get_states(NULL, NULL), CPAR_ERR_INVALID, "ctx is NULL");
    TU_FAILS(cpar_model_parallel_manual_seed(NULL, 1, 0, 0, 0), CPAR_ERR_INVALID, "ctx is NULL");

    /* Fills: tensor, dtype, ranges. */
    TU_FAILS(cpar_rng_uniform(ctx, NULL, 0.f, 1.f), CPAR_ERR_INVALID, "cpar_rng_uniform: t is NULL");
    TU_FAILS(cpar_rng_uniform(ctx, &i32, 0.f, 1.f), CPAR_ERR_INVALID, "t has dtype i32");
    TU_FAILS(cpar_rng_uniform(ctx, &nodata, 0.f, 1.f), CPAR_ERR_INVALID, "t has NULL data");
    TU_FAILS(cpar_rng_uniform(ctx, &f, 1.f, 0.f), CPAR_ERR_INVALID, "lo = 1, hi = 0");
    TU_FAILS(cpar_rng_uniform(ctx, &f, NAN, 0.f), CPAR_ERR_INVALID, "lo = nan");
    TU_FAILS(cpar_rng_uniform(ctx, &f, -3e38f, 3e38f), CPAR_ERR_INVALID, "hi - lo finite");
    TU_FAILS(cpar_rng_normal(ctx, &u8, 0.f, 1.f), CPAR_ERR_INVALID, "t has dtype u8");
    TU_FAILS(cpar_rng_normal(ctx, &f, 0.f, -1.f), CPAR_ERR_INVALID, "std is -1");
    TU_FAILS(cpar_rng_normal(ctx, &f, INFINITY, 1.f), CPAR_ERR_INVALID, "mean is inf");
    TU_FAILS(cpar_rng_normal(NULL, &f, 0.f, 1.f), CPAR_ERR_INVALID, "ctx is NULL");
    if (cpar_device(ctx) != CPAR_HOST) {
        cpar_tensor other = cpar_tensor_make(f.data, CPAR_F32, 1, &n, cpar_device(ctx) + 1);
        TU_FAILS(cpar_rng_uniform(ctx, &other, 0.f, 1.f), CPAR_ERR_INVALID, "t is on device 1");
    }

    /* Dropout. */
    TU_FAILS(cpar_dropout_forward(ctx, 1.0f, &f, &f2, NULL, NULL), CPAR_ERR_INVALID, "p is 1, expected 0 <= p < 1");
    TU_FAILS(cpar_dropout_forward(ctx, -0.1f, &f, &f2, NULL, NULL), CPAR_ERR_INVALID, "p is -0.1");
    TU_FAILS(cpar_dropout_forward(ctx, NAN, &f, &f2, NULL, NULL), CPAR_ERR_INVALID, "p is nan");
    TU_FAILS(cpar_dropout_forward(ctx, 0.5f, NULL, &f2, NULL, NULL), CPAR_ERR_INVALID, "x is NULL");
    TU_FAILS(cpar_dropout_forward(ctx, 0.5f, &f, NULL, NULL, NULL), CPAR_ERR_INVALID, "y is NULL");
    TU_FAILS(cpar_dropout_forward(ctx, 0.5f, &i32, &i32, NULL, NULL), CPAR_ERR_INVALID, "x has dtype i32");
    TU_FAILS(cpar_dropout_forward(ctx, 0.5f, &f, &h, NULL, NULL), CPAR_ERR_INVALID, "y has dtype f16, expected f32");
    TU_FAILS(cpar_dropout_forward(ctx, 0.5f, &f, &f9, NULL, NULL), CPAR_ERR_INVALID, "y has 9 elements, expected 8");
    TU_FAILS(cpar_dropout_forward(ctx, 0.5f, &f, &part, NULL, NULL), CPAR_ERR_INVALID, "y partially overlaps x");
    TU_FAILS(cpar_dropout_forward(ctx, 0.5f, &f, &f2, &f, NULL), CPAR_ERR_INVALID, "mask has dtype f32, expected u8");
    TU_FAILS(cpar_dropout_forward(ctx, 0.5f, &f, &f2, &u9, NULL), CPAR_ERR_INVALID, "mask has 9 elements");
    TU_FAILS(cpar_dropout_backward(ctx, 0.5f, &f, &f2, NULL, NULL), CPAR_ERR_INVALID, "mask and state are both NULL");
    TU_FAILS(cpar_dropout_backward(ctx, 2.0f, &f, &f2, &u8, &s), CPAR_ERR_INVALID, "p is 2");
    TU_FAILS(cpar_dropout_backward(ctx, 0.5f, NULL, &f2, &u8, &s), CPAR_ERR_INVALID, "dy is NULL");
    TU_FAILS(cpar_dropout_backward(ctx, 0.5f, &f, &h, &u8, &s), CPAR_ERR_INVALID, "dx has dtype f16");
    TU_FAILS(cpar_dropout_backward(ctx, 0.5f, &f, &f2, &u9, &s), CPAR_ERR_INVALID, "mask has 9");
    TU_FAILS(cpar_dropout_backward(NULL, 0.5f, &f, &f2, &u8, &s), CPAR_ERR_INVALID, "ctx is NULL");
    TU_OK(cpar_dropout_backward(ctx, 0.0f, &f, &f2, NULL, NULL)); /* p == 0 needs neither */

    /* Chunks. */
    cpar_group *g = cpar_world_group(ctx);
    TU_FAILS(cpar_split_1d_chunk(NULL, &f, &f2), CPAR_ERR_INVALID, "group is NULL");
    TU_FAILS(cpar_split_1d_chunk(g, NULL, &f2), CPAR_ERR_INVALID, "in is NULL");
    TU_FAILS(cpar_split_1d_chunk(g, &f, &h), CPAR_ERR_INVALID, "out has dtype f16");
    TU_FAILS(cpar_gather_1d_chunks(NULL, &f, &f2), CPAR_ERR_INVALID, "group is NULL");
    TU_FAILS(cpar_gather_1d_chunks(g, &f, NULL), CPAR_ERR_INVALID, "out is NULL");
    TU_FAILS(cpar_gather_1d_chunks(g, &f, &part), CPAR_ERR_INVALID, "out overlaps chunk");
    cpar_checkpoint ck = {0};
    TU_FAILS(cpar_checkpoint_distribute(ctx, &ck, NULL, &f), CPAR_ERR_INVALID, "g is NULL");
    TU_FAILS(cpar_checkpoint_distribute(ctx, NULL, g, &f), CPAR_ERR_INVALID, "ck is NULL");
    TU_FAILS(cpar_checkpoint_distribute(ctx, &ck, g, NULL), CPAR_ERR_INVALID, "activation is NULL");
    TU_FAILS(cpar_checkpoint_gather(ctx, &ck, g, &f), CPAR_ERR_INVALID, "no distributed activation");
    TU_FAILS(cpar_checkpoint_release(ctx, NULL), CPAR_ERR_INVALID, "ck is NULL");
    TU_OK(cpar_checkpoint_release(ctx, &ck));

    /* Nothing was drawn or written. */
    cpar_rng_state after = cur_state(ctx);
    ASSERT_STATE(after, before.seed, before.offset);
    cpar_tensor *outs[] = {&f, &f2, &h, &i32, &u8, &u9, &f9};
    for (size_t k = 0; k < sizeof outs / sizeof outs[0]; k++) {
        void *got = tu_download(ctx, outs[k]);
        if (outs[k] != &f2) /* f2 was written by the valid p == 0 backward */
            for (int64_t e = 0; e < cpar_tensor_numel(outs[k]); e++) {
                double v = tu_get(got, outs[k]->dtype, e);
                ck_assert(cpar_dtype_is_float(outs[k]->dtype) ? isnan(v) : v == (outs[k]->dtype == CPAR_U8 ? 255 : -1));
            }
        free(got);
        free_tensor(ctx, outs[k]);
    }
}

START_TEST(test_bad_input) { run_ranks(1, bad_input_case, 0); }
END_TEST

Suite *suite(void) {
    Suite *s = suite_create("rng: Philox, tracker, fills, dropout, checkpointing");
    const tu_loop loops[] = {
        {"philox_kat", test_philox_kat, 1},
        {"uniform", test_uniform, N_FLOAT},
        {"normal", test_normal, N_FLOAT},
        {"stats", test_stats, 2},
        {"dropout", test_dropout, N_FLOAT},
        {"dropout_stats", test_dropout_stats, 3},
        {"tracker_seeds", test_tracker_seeds, 1},
        {"tracker_grid", test_tracker_grid, 2},
        {"fork", test_fork, 1},
        {"snapshot", test_snapshot, 1},
        {"checkpoint", test_checkpoint, N_FLOAT},
        {"checkpoint_refork", test_checkpoint_refork, 1},
        {"chunks", test_chunks, N_GROUPS},
        {"bad_input", test_bad_input, 1},
    };
    tu_add_loops(s, loops, sizeof loops / sizeof loops[0], 120);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
