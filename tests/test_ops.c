/* SPDX-License-Identifier: MIT */
/* test_ops.c — element-wise and layout operations (cpar.h §6): cpar_fill,
 * cpar_cast, cpar_axpby, cpar_split, cpar_concat, cpar_row_reduce and
 * cpar_gelu_forward / _backward (the latter also by finite differences).
 *
 * Each runs on the context's device (host memory on the host backend; the
 * CUDA kernels under the simulator on the device backend) at odd sizes, and is
 * compared with a reference computed here in double: bit for bit where the
 * result is one rounding of an exact value (fill, cast, max, data movement),
 * within a dtype-aware bound where fp32 arithmetic is involved. */
#include "testutil.h"

static const int64_t sizes[] = {1, 31, 33, 1000, 4097};
#define N_SIZES ((int)(sizeof sizes / sizeof sizes[0]))

static const cpar_dtype all_dtypes[] = {CPAR_F32, CPAR_F16, CPAR_BF16, CPAR_I32, CPAR_I64, CPAR_U8};
static const cpar_dtype float_dtypes[] = {CPAR_F32, CPAR_F16, CPAR_BF16};
#define N_ALL 6
#define N_FLOAT 3

/* Every op gets its context from a 1-rank job on the backend under test. */
typedef void (*op_test)(cpar_ctx *ctx, int param);
typedef struct {
    op_test fn;
    int param;
} op_job;

static cpar_status rank_op(cpar_ctx *ctx, void *p) {
    op_job *j = p;
    j->fn(ctx, j->param);
    return CPAR_OK;
}

static void run_op(op_test fn, int param) {
    op_job j = {fn, param};
    TU_OK(tu_spawn(1, rank_op, &j));
}

static void free_tensor(cpar_ctx *ctx, cpar_tensor *t) { TU_OK(cpar_tensor_free(ctx, t)); }

/* ---- fill ------------------------------------------------------------------------- */

static void fill_case(cpar_ctx *ctx, int d) {
    cpar_dtype dt = all_dtypes[d];
    /* Values each dtype holds exactly, one it must round, one out of f16's range. */
    double values[4];
    int nv = 0;
    if (cpar_dtype_is_float(dt)) {
        values[nv++] = -2.75;
        values[nv++] = 0.1;
        values[nv++] = 70000.0; /* f16: inf */
        values[nv++] = 3.0e-6;  /* f16: subnormal */
    } else {
        values[nv++] = dt == CPAR_U8 ? 200 : -123456;
        values[nv++] = dt == CPAR_I64 ? 1099511627779.0 : dt == CPAR_U8 ? 7 : 2147483647.0;
        values[nv++] = 0;
    }
    for (int k = 0; k < N_SIZES; k++)
        for (int v = 0; v < nv; v++) {
            int64_t n = sizes[k], shape[] = {n};
            cpar_tensor t = tu_alloc_poisoned(ctx, dt, 1, shape);
            TU_OK(cpar_fill(ctx, &t, values[v]));
            void *got = tu_download(ctx, &t), *want = tu_random_host(dt, n, 1);
            for (int64_t i = 0; i < n; i++) tu_set(want, dt, i, values[v]);
            ck_assert_msg(tu_bits_mismatch(got, want, dt, n) < 0, "fill %s [%lld] with %g: got %g", cpar_dtype_name(dt),
                          (long long)n, values[v], tu_get(got, dt, tu_bits_mismatch(got, want, dt, n)));
            free(got);
            free(want);
            free_tensor(ctx, &t);
        }
    /* A scalar and a zero-sized tensor. */
    int64_t none[] = {4, 0};
    cpar_tensor s = tu_alloc_poisoned(ctx, dt, 0, NULL), z = tu_alloc_poisoned(ctx, dt, 2, none);
    TU_OK(cpar_fill(ctx, &s, 5.0));
    TU_OK(cpar_fill(ctx, &z, 5.0));
    void *got = tu_download(ctx, &s);
    ck_assert(tu_get(got, dt, 0) == 5.0);
    free(got);
    free_tensor(ctx, &s);
    free_tensor(ctx, &z);
}

START_TEST(test_fill) { run_op(fill_case, _i); }
END_TEST

/* ---- cast --------------------------------------------------------------------------- */

/* Values a cast must get right besides random ones: infinities, NaN,
 * overflow and underflow of the narrower types, signed zero, subnormals,
 * and f16/bf16 ties. */
static const float special_values[] = {
    INFINITY, -INFINITY, NAN, 65504.0f, 65520.0f, -1e6f, 3e38f, 1e-40f, -0.0f, 0x1p-25f, 0x1.8p-24f,
    1.0f + 0x1p-11f, 1.0f + 0x3p-11f, 1.0f + 0x1p-8f, 1.0f + 0x3p-8f, 5.9604645e-08f, -3.0e-6f,
};
#define N_SPECIAL ((int64_t)(sizeof special_values / sizeof special_values[0]))

/* Loop index: (src, dst) over the float dtypes, then equal integer dtypes. */
#define N_CAST_PAIRS (N_FLOAT * N_FLOAT + 3)
static void cast_pair(int i, cpar_dtype *src, cpar_dtype *dst) {
    if (i < N_FLOAT * N_FLOAT) {
        *src = float_dtypes[i / N_FLOAT];
        *dst = float_dtypes[i % N_FLOAT];
    } else {
        static const cpar_dtype ints[] = {CPAR_I32, CPAR_I64, CPAR_U8};
        *src = *dst = ints[i - N_FLOAT * N_FLOAT];
    }
}

static void cast_case(cpar_ctx *ctx, int pair) {
    cpar_dtype sd, dd;
    cast_pair(pair, &sd, &dd);
    for (int k = 0; k < N_SIZES; k++) {
        int64_t n = sizes[k] + N_SPECIAL, shape[] = {3, n};
        void *x = tu_random_host(sd, 3 * n, 40 + (uint64_t)k);
        if (cpar_dtype_is_float(sd))
            for (int64_t i = 0; i < N_SPECIAL; i++) tu_set(x, sd, i, special_values[i]);
        cpar_tensor src = tu_upload(ctx, x, sd, 2, shape), dst = tu_alloc_poisoned(ctx, dd, 2, shape);
        TU_OK(cpar_cast(ctx, &src, &dst));
        /* One rounding of the exact source value (NaN stays NaN). */
        void *want = tu_random_host(dd, 3 * n, 2), *got = tu_download(ctx, &dst);
        for (int64_t i = 0; i < 3 * n; i++) tu_set(want, dd, i, tu_get(x, sd, i));
        int64_t bad = tu_bits_mismatch(got, want, dd, 3 * n);
        ck_assert_msg(bad < 0, "cast %s -> %s, n %lld: element %lld (%a) gave %a, expected %a", cpar_dtype_name(sd),
                      cpar_dtype_name(dd), (long long)n, (long long)bad, bad < 0 ? 0 : tu_get(x, sd, bad),
                      bad < 0 ? 0 : tu_get(got, dd, bad), bad < 0 ? 0 : tu_get(want, dd, bad));
        free(x);
        free(want);
        free(got);
        free_tensor(ctx, &src);
        free_tensor(ctx, &dst);
    }
}

START_TEST(test_cast) { run_op(cast_case, _i); }
END_TEST

/* Every 16-bit pattern widened, and 2^20 fp32 patterns narrowed, through
 * cpar_cast (the kernels' vector loops, full blocks and a tail), bit for bit
 * against the scalar cpar_f32_to_bf16 / _f16 and cpar_bf16_to_f32 / f16_to_f32
 * (which test_core checks against independent references). The fp32 patterns:
 * each high half 0..0xffff (every sign, exponent and leading mantissa: zeros,
 * subnormals, normals, inf, NaN payloads quiet and signalling) with the low
 * halves 0, 1 (a NaN whose payload is only there), 0x0fff, 0x1000 (f16
 * ties), 0x7fff, 0x8000 (bf16 ties), 0x8001, 0xffff, then 8 more lows from a
 * fixed hash. On the host backend NaN keeps its sign and the scalar
 * functions' payload; a device kernel need only give NaN (CUDA's
 * conversions canonicalise it). */
static void cast_bits_case(cpar_ctx *ctx, int half) {
    cpar_dtype h = half ? CPAR_F16 : CPAR_BF16;
    int64_t n16 = 65536 + 7, n32 = (int64_t)65536 * 16 + 5; /* + a tail after the full blocks */
    uint16_t *b = malloc((size_t)n16 * 2);
    uint32_t *u = malloc((size_t)n32 * 4);
    for (int64_t i = 0; i < n16; i++) b[i] = (uint16_t)(i * 40503u);
    static const uint32_t lows[8] = {0, 1, 0x0fff, 0x1000, 0x7fff, 0x8000, 0x8001, 0xffff};
    for (int64_t i = 0; i < n32; i++) {
        uint32_t hi = (uint32_t)(i >> 4) & 0xffffu, j = (uint32_t)(i & 15);
        u[i] = hi << 16 | (j < 8 ? lows[j] : ((uint32_t)i * 2654435761u) >> 16);
    }
    int64_t s16[] = {n16}, s32[] = {n32};
    cpar_tensor t16 = tu_upload(ctx, b, h, 1, s16), w32 = tu_alloc_poisoned(ctx, CPAR_F32, 1, s16);
    cpar_tensor t32 = tu_upload(ctx, u, CPAR_F32, 1, s32), n16t = tu_alloc_poisoned(ctx, h, 1, s32);
    TU_OK(cpar_cast(ctx, &t16, &w32));
    TU_OK(cpar_cast(ctx, &t32, &n16t));
    uint32_t *wide = tu_download(ctx, &w32);
    uint16_t *narrow = tu_download(ctx, &n16t);
    bool exact_nan = tu_backend() == CPAR_BACKEND_HOST;
    for (int64_t i = 0; i < n16; i++) {
        float want = half ? cpar_f16_to_f32(b[i]) : cpar_bf16_to_f32(b[i]), got;
        uint32_t wb;
        memcpy(&got, &wide[i], 4);
        memcpy(&wb, &want, 4);
        TU_CHECK(wide[i] == wb || (!exact_nan && isnan(got) && isnan(want)),
                 "%s 0x%04x -> f32 gave 0x%08x, expected 0x%08x", cpar_dtype_name(h), b[i], wide[i], wb);
    }
    for (int64_t i = 0; i < n32; i++) {
        float f;
        memcpy(&f, &u[i], 4);
        uint16_t want = half ? cpar_f32_to_f16(f) : cpar_f32_to_bf16(f);
        bool nan_ok = !exact_nan && isnan(f) && (half ? (narrow[i] & 0x7c00u) == 0x7c00u && (narrow[i] & 0x3ffu)
                                                      : (narrow[i] & 0x7f80u) == 0x7f80u && (narrow[i] & 0x7fu));
        TU_CHECK(narrow[i] == want || nan_ok, "f32 0x%08x -> %s gave 0x%04x, expected 0x%04x", u[i], cpar_dtype_name(h),
                 narrow[i], want);
    }
    free(b);
    free(u);
    free(wide);
    free(narrow);
    cpar_tensor *all[] = {&t16, &w32, &t32, &n16t};
    for (size_t k = 0; k < 4; k++) free_tensor(ctx, all[k]);
}

START_TEST(test_cast_bits) { run_op(cast_bits_case, _i); }
END_TEST

/* ---- axpby ---------------------------------------------------------------------------- */

static const float ab[][2] = {{1.5f, -0.5f}, {-0.75f, 0.0f}, {0.0f, 2.0f}, {1.0f, 1.0f}, {3.25f, -1.125f}};
#define N_AB ((int)(sizeof ab / sizeof ab[0]))

static void axpby_case(cpar_ctx *ctx, int d) {
    cpar_dtype dt = float_dtypes[d];
    for (int k = 0; k < N_SIZES; k++)
        for (int c = 0; c < N_AB; c++) {
            float alpha = ab[c][0], beta = ab[c][1];
            int64_t n = sizes[k], shape[] = {n, 1};
            void *x = tu_random_host(dt, n, 7 + (uint64_t)k), *y0 = tu_random_host(dt, n, 70 + (uint64_t)k);
            cpar_tensor tx = tu_upload(ctx, x, dt, 2, shape), ty;
            /* beta = 0: y is never read, so NaN there does no harm. */
            if (beta == 0.0f) ty = tu_alloc_poisoned(ctx, dt, 2, shape);
            else ty = tu_upload(ctx, y0, dt, 2, shape);
            TU_OK(cpar_axpby(ctx, alpha, &tx, beta, &ty));
            double *want = malloc((size_t)n * sizeof *want);
            for (int64_t i = 0; i < n; i++) {
                double v = (double)alpha * tu_get(x, dt, i);
                if (beta != 0.0f) v += (double)beta * tu_get(y0, dt, i);
                want[i] = tu_round(dt, v);
            }
            void *got = tu_download(ctx, &ty);
            char msg[256];
            ck_assert_msg(tu_mismatch(got, dt, want, n, tu_tol(dt), msg, sizeof msg) < 0,
                          "axpby %s n %lld alpha %g beta %g: %s", cpar_dtype_name(dt), (long long)n, alpha, beta, msg);
            free(x);
            free(y0);
            free(want);
            free(got);
            free_tensor(ctx, &tx);
            free_tensor(ctx, &ty);
        }
}

START_TEST(test_axpby) { run_op(axpby_case, _i); }
END_TEST

/* ---- GeLU ------------------------------------------------------------------------------ */

static double gelu_ref(double x) { return 0.5 * x * (1.0 + tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x))); }
static double gelu_grad_ref(double x) {
    const double t = tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x));
    return 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x) + 0.5 * (1.0 + t);
}

/* _i = dtype; every size; out of place (poisoned) and in place; x in [-4, 4). */
static void gelu_case(cpar_ctx *ctx, int d) {
    cpar_dtype dt = float_dtypes[d];
    for (int k = 0; k < N_SIZES; k++)
        for (int in_place = 0; in_place < 2; in_place++) {
            int64_t n = sizes[k], shape[] = {n};
            void *x = tu_random_host(dt, n, 11 + (uint64_t)k), *dy = tu_random_host(dt, n, 110 + (uint64_t)k);
            for (int64_t i = 0; i < n; i++) tu_set(x, dt, i, 4.0 * tu_get(x, dt, i));
            double *wy = malloc((size_t)n * sizeof *wy), *wdx = malloc((size_t)n * sizeof *wdx);
            for (int64_t i = 0; i < n; i++) {
                wy[i] = gelu_ref(tu_get(x, dt, i));
                wdx[i] = gelu_grad_ref(tu_get(x, dt, i)) * tu_get(dy, dt, i);
            }
            cpar_tensor tx = tu_upload(ctx, x, dt, 1, shape), tdy = tu_upload(ctx, dy, dt, 1, shape);
            cpar_tensor ty = in_place ? tu_upload(ctx, x, dt, 1, shape) : tu_alloc_poisoned(ctx, dt, 1, shape);
            cpar_tensor tdx = in_place ? tdy : tu_alloc_poisoned(ctx, dt, 1, shape);
            TU_OK(cpar_gelu_forward(ctx, in_place ? &ty : &tx, &ty));
            TU_OK(cpar_gelu_backward(ctx, &tx, &tdy, &tdx));
            void *gy = tu_download(ctx, &ty), *gdx = tu_download(ctx, &tdx);
            char msg[256];
            const double tol = dt == CPAR_F32 ? 1e-6 : 2 * tu_tol(dt);
            ck_assert_msg(tu_mismatch(gy, dt, wy, n, tol, msg, sizeof msg) < 0, "gelu %s n %lld: %s",
                          cpar_dtype_name(dt), (long long)n, msg);
            ck_assert_msg(tu_mismatch(gdx, dt, wdx, n, tol, msg, sizeof msg) < 0, "gelu backward %s n %lld: %s",
                          cpar_dtype_name(dt), (long long)n, msg);
            free(x), free(dy), free(wy), free(wdx), free(gy), free(gdx);
            free_tensor(ctx, &tx), free_tensor(ctx, &tdy), free_tensor(ctx, &ty);
            if (!in_place) free_tensor(ctx, &tdx);
        }
}

START_TEST(test_gelu) { run_op(gelu_case, _i); }
END_TEST

/* The library's backward against central differences of the library's
 * forward (F32 on the backend's tensors), and the fp64 reference's gradient
 * against differences of the fp64 reference. */
static void gelu_fd_case(cpar_ctx *ctx, int unused) {
    (void)unused;
    static const float xs[] = {-3.1f, -1.0f, -0.2f, 0.0f, 0.37f, 1.5f, 2.9f};
    enum { N = sizeof xs / sizeof xs[0] };
    const float h = 1e-2f;
    float plus[N], minus[N], ones[N];
    for (int i = 0; i < N; i++) plus[i] = xs[i] + h, minus[i] = xs[i] - h, ones[i] = 1.f;
    const int64_t shape[1] = {N};
    cpar_tensor tp = tu_upload(ctx, plus, CPAR_F32, 1, shape), tm = tu_upload(ctx, minus, CPAR_F32, 1, shape);
    cpar_tensor tx = tu_upload(ctx, xs, CPAR_F32, 1, shape), tdy = tu_upload(ctx, ones, CPAR_F32, 1, shape);
    cpar_tensor tg = tu_alloc_poisoned(ctx, CPAR_F32, 1, shape);
    TU_OK(cpar_gelu_forward(ctx, &tp, &tp));
    TU_OK(cpar_gelu_forward(ctx, &tm, &tm));
    TU_OK(cpar_gelu_backward(ctx, &tx, &tdy, &tg));
    float *fp = tu_download(ctx, &tp), *fm = tu_download(ctx, &tm), *g = tu_download(ctx, &tg);
    for (int i = 0; i < N; i++) {
        const double fd = ((double)fp[i] - (double)fm[i]) / (2.0 * (double)h);
        ck_assert_msg(fabs(fd - g[i]) < 1e-3, "gelu'(%g): backward %g, differences %g", (double)xs[i], (double)g[i], fd);
        const double x = xs[i], e = 1e-4, rfd = (gelu_ref(x + e) - gelu_ref(x - e)) / (2 * e);
        ck_assert_msg(fabs(rfd - gelu_grad_ref(x)) < 1e-7, "reference gelu'(%g): %g vs %g", x, gelu_grad_ref(x), rfd);
    }
    free(fp), free(fm), free(g);
    cpar_tensor *all[] = {&tp, &tm, &tx, &tdy, &tg};
    for (int i = 0; i < 5; i++) free_tensor(ctx, all[i]);
}

START_TEST(test_gelu_finite_differences) { run_op(gelu_fd_case, 0); }
END_TEST

/* gelu(xs) and gelu'(xs) (dy = 1) on the backend's F32 tensors, into new
 * host arrays *y and *g (outputs poisoned first). */
static void gelu_run_f32(cpar_ctx *ctx, const float *xs, int64_t n, float **y, float **g) {
    float *ones = malloc((size_t)n * sizeof *ones);
    for (int64_t i = 0; i < n; i++) ones[i] = 1.f;
    const int64_t shape[1] = {n};
    cpar_tensor tx = tu_upload(ctx, xs, CPAR_F32, 1, shape), tdy = tu_upload(ctx, ones, CPAR_F32, 1, shape);
    cpar_tensor ty = tu_alloc_poisoned(ctx, CPAR_F32, 1, shape), tg = tu_alloc_poisoned(ctx, CPAR_F32, 1, shape);
    TU_OK(cpar_gelu_forward(ctx, &tx, &ty));
    TU_OK(cpar_gelu_backward(ctx, &tx, &tdy, &tg));
    *y = tu_download(ctx, &ty), *g = tu_download(ctx, &tg);
    free(ones);
    free_tensor(ctx, &tx), free_tensor(ctx, &tdy), free_tensor(ctx, &ty), free_tensor(ctx, &tg);
}

/* Large and special inputs (F32), past the [-4, 4) of the random cases: where
 * tanh saturates (the host's exp clamps its argument at 43), infinities and NaN,
 * against the fp64 reference; NaN where the reference is NaN (gelu(-inf) is
 * -inf * 0). The backward skips +-1e30, where x * x overflows fp32 and the
 * formula gives 0 * inf as PyTorch's does. */
static void gelu_special_case(cpar_ctx *ctx, int unused) {
    (void)unused;
    const float xs[] = {NAN, INFINITY, -INFINITY, 6.f, -6.f, 9.f, -9.f, 9.2f, -9.2f, 20.f, -20.f, 1e30f, -1e30f};
    enum { N = sizeof xs / sizeof xs[0] };
    float *y, *g;
    gelu_run_f32(ctx, xs, N, &y, &g);
    for (int i = 0; i < N; i++) {
        const double x = xs[i], wy = gelu_ref(x), wg = gelu_grad_ref(x);
        ck_assert_msg(isnan(wy) ? isnan(y[i]) : (y[i] == wy || fabs(y[i] - wy) <= 1e-6 * (1.0 + fabs(wy))),
                      "gelu(%g) = %g, expected %g", x, (double)y[i], wy);
        if (fabs(x) < 1e29)
            ck_assert_msg(isnan(wg) ? isnan(g[i]) : (g[i] == wg || fabs(g[i] - wg) <= 1e-6 * (1.0 + fabs(wg))),
                          "gelu'(%g) = %g, expected %g", x, (double)g[i], wg);
    }
    free(y), free(g);
}

START_TEST(test_gelu_special) { run_op(gelu_special_case, 0); }
END_TEST

/* A dense sweep (F32): 2^20 evenly spaced x in [-12, 12), forward and
 * backward against the fp64 reference within 1e-6 (1 + |want|), the
 * tolerance of the random cases, everywhere: near 0, across the exp
 * polynomial's reduction boundaries and into saturation; and relatively,
 * wherever the result is above 1e-33. On the host it checks the exp
 * evaluation that the CPU's kernel twin uses (the portable build's suites
 * check the plain-C one); on sim and nccl-sim, the CUDA kernel's. */
static void gelu_dense_case(cpar_ctx *ctx, int unused) {
    (void)unused;
    enum { N = 1 << 20 };
    float *xs = malloc(N * sizeof *xs), *y, *g;
    for (int i = 0; i < N; i++) xs[i] = -12.f + 24.f * (float)i / (float)N;
    gelu_run_f32(ctx, xs, N, &y, &g);
    double worst_y = 0, worst_g = 0;
    int at_y = 0, at_g = 0;
    for (int i = 0; i < N; i++) {
        const double x = xs[i], wy = gelu_ref(x), wg = gelu_grad_ref(x);
        const double ey = fabs(y[i] - wy) / (1.0 + fabs(wy)), eg = fabs(g[i] - wg) / (1.0 + fabs(wg));
        if (!(ey <= worst_y)) worst_y = ey, at_y = i; /* NaN counts as worst */
        if (!(eg <= worst_g)) worst_g = eg, at_g = i;
    }
    ck_assert_msg(worst_y <= 1e-6, "gelu(%.9g) = %.9g, expected %.9g", (double)xs[at_y], (double)y[at_y],
                  gelu_ref(xs[at_y]));
    ck_assert_msg(worst_g <= 1e-6, "gelu'(%.9g) = %.9g, expected %.9g", (double)xs[at_g], (double)g[at_g],
                  gelu_grad_ref(xs[at_g]));
    /* Relative accuracy in the tail too, down to 1e-33, against the
     * sigmoid form in fp64 (0.5 (1 + tanh u) = 1/(1 + e^-2u), 1 - tanh^2 u =
     * 4 e^-2u / (1 + e^-2u)^2: the tanh form cancels to 0 past u = -19 even
     * in fp64). u's own rounding in fp32 moves e^-2u by 2|u| times it, hence
     * the bound's (1 + |u|). */
    for (int i = 0; i < N; i++) {
        const double x = xs[i], u = 0.7978845608028654 * x * (1.0 + 0.044715 * x * x), E = exp(-2.0 * u);
        const double h = 1.0 / (1.0 + E), wy = x * h;
        const double wg = h + 2.0 * x * E * h * h * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x);
        const double bound = 1e-6 * (1.0 + fabs(u));
        if (fabs(wy) >= 1e-33)
            TU_CHECK(fabs(y[i] - wy) <= bound * fabs(wy), "gelu(%.9g) = %.9g, expected %.9g (relative)", x,
                     (double)y[i], wy);
        if (fabs(wg) + h >= 1e-33)
            TU_CHECK(fabs(g[i] - wg) <= bound * (fabs(wg) + h), "gelu'(%.9g) = %.9g, expected %.9g (relative)", x,
                     (double)g[i], wg);
    }
    free(xs), free(y), free(g);
}

START_TEST(test_gelu_dense) { run_op(gelu_dense_case, 0); }
END_TEST

/* Every value of a 16-bit dtype (F16, BF16: all 65536 bit patterns, NaN and
 * infinities included), forward and backward with random dy, in place and
 * not: each output must have exactly the bits of the F32 call on the same
 * values, rounded, or be a NaN where that is one (CUDA's conversions give
 * one NaN for all) (the host computes 16-bit GeLU through a table made from
 * its F32 computation, one per dtype: both run in one process here, on
 * three ranks at once, which race to build it; the kernel widens and
 * rounds). The F32 results are checked against fp64 by the tests above. */
static bool nan16(uint16_t b, cpar_dtype dt) { return (b & 0x7fffu) > (dt == CPAR_F16 ? 0x7c00u : 0x7f80u); }

static void gelu_all16_dtype(cpar_ctx *ctx, int d) {
    const cpar_dtype dt = d ? CPAR_F16 : CPAR_BF16;
    enum { N = 1 << 16 };
    const int64_t shape[1] = {N};
    uint16_t *x16 = malloc(N * sizeof *x16), *dy16 = malloc(N * sizeof *dy16);
    float *xs = malloc(N * sizeof *xs), *dys = malloc(N * sizeof *dys);
    tu_fill_random(dy16, dt, N, 41 + (uint64_t)d);
    for (int i = 0; i < N; i++) { /* bit patterns in a scrambled order, so no block is all alike */
        x16[i] = (uint16_t)((uint32_t)i * 40503u);
        xs[i] = d ? cpar_f16_to_f32(x16[i]) : cpar_bf16_to_f32(x16[i]);
        dys[i] = d ? cpar_f16_to_f32(dy16[i]) : cpar_bf16_to_f32(dy16[i]);
    }
    cpar_tensor fx = tu_upload(ctx, xs, CPAR_F32, 1, shape), fdy = tu_upload(ctx, dys, CPAR_F32, 1, shape);
    cpar_tensor fy = tu_alloc_poisoned(ctx, CPAR_F32, 1, shape), fdx = tu_alloc_poisoned(ctx, CPAR_F32, 1, shape);
    TU_OK(cpar_gelu_forward(ctx, &fx, &fy));
    TU_OK(cpar_gelu_backward(ctx, &fx, &fdy, &fdx));
    float *wy = tu_download(ctx, &fy), *wdx = tu_download(ctx, &fdx);
    for (int in_place = 0; in_place < 2; in_place++) {
        cpar_tensor tx = tu_upload(ctx, x16, dt, 1, shape), tdy = tu_upload(ctx, dy16, dt, 1, shape);
        cpar_tensor ty = tu_alloc_poisoned(ctx, dt, 1, shape), tdx = tu_alloc_poisoned(ctx, dt, 1, shape);
        TU_OK(cpar_gelu_backward(ctx, &tx, &tdy, in_place ? &tdy : &tdx));
        TU_OK(cpar_gelu_forward(ctx, &tx, in_place ? &tx : &ty));
        uint16_t *gy = tu_download(ctx, in_place ? &tx : &ty), *gdx = tu_download(ctx, in_place ? &tdy : &tdx);
        for (int i = 0; i < N; i++) {
            const uint16_t ey = d ? cpar_f32_to_f16(wy[i]) : cpar_f32_to_bf16(wy[i]);
            const uint16_t edx = d ? cpar_f32_to_f16(wdx[i]) : cpar_f32_to_bf16(wdx[i]);
            TU_CHECK(gy[i] == ey || (nan16(ey, dt) && nan16(gy[i], dt)),
                     "%s gelu(0x%04x = %g) = 0x%04x, expected 0x%04x (in place %d)", cpar_dtype_name(dt), x16[i],
                     (double)xs[i], gy[i], ey, in_place);
            TU_CHECK(gdx[i] == edx || (nan16(edx, dt) && nan16(gdx[i], dt)),
                     "%s gelu'(0x%04x = %g) * %g = 0x%04x, expected 0x%04x (in place %d)", cpar_dtype_name(dt),
                     x16[i], (double)xs[i], (double)dys[i], gdx[i], edx, in_place);
        }
        free(gy), free(gdx);
        free_tensor(ctx, &tx), free_tensor(ctx, &tdy), free_tensor(ctx, &ty), free_tensor(ctx, &tdx);
    }
    free(x16), free(dy16), free(xs), free(dys), free(wy), free(wdx);
    free_tensor(ctx, &fx), free_tensor(ctx, &fdy), free_tensor(ctx, &fy), free_tensor(ctx, &fdx);
}

static void gelu_all16_case(cpar_ctx *ctx, int first) {
    gelu_all16_dtype(ctx, first);
    gelu_all16_dtype(ctx, !first);
}

START_TEST(test_gelu_all16) {
    op_job j = {gelu_all16_case, _i};
    TU_OK(tu_spawn(3, rank_op, &j));
}
END_TEST

static void gelu_bad_case(cpar_ctx *ctx, int unused) {
    (void)unused;
    cpar_tensor x, y, y16, yshort, xi;
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 1, (const int64_t[]){8}, &x));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 1, (const int64_t[]){8}, &y));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F16, 1, (const int64_t[]){8}, &y16));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 1, (const int64_t[]){7}, &yshort));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_I32, 1, (const int64_t[]){8}, &xi));
    TU_OK(cpar_fill(ctx, &x, 0.5));
    TU_OK(cpar_fill(ctx, &y, 1.0));
    TU_FAILS(cpar_gelu_forward(NULL, &x, &y), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_gelu_forward(ctx, NULL, &y), CPAR_ERR_INVALID, "x");
    TU_FAILS(cpar_gelu_forward(ctx, &x, NULL), CPAR_ERR_INVALID, "y");
    TU_FAILS(cpar_gelu_forward(ctx, &xi, &y), CPAR_ERR_INVALID, "x has dtype i32");
    TU_FAILS(cpar_gelu_forward(ctx, &x, &y16), CPAR_ERR_INVALID, "y has dtype f16");
    TU_FAILS(cpar_gelu_forward(ctx, &x, &yshort), CPAR_ERR_INVALID, "y has 7 elements");
    cpar_tensor shifted = x;
    shifted.data = (char *)x.data + sizeof(float);
    shifted.shape[0] = 7;
    cpar_tensor head = x; /* x's first 7 elements: overlaps shifted without being it */
    head.shape[0] = 7;
    TU_FAILS(cpar_gelu_forward(ctx, &head, &shifted), CPAR_ERR_INVALID, "overlaps");
    TU_FAILS(cpar_gelu_backward(ctx, &x, NULL, &y), CPAR_ERR_INVALID, "dy");
    TU_FAILS(cpar_gelu_backward(ctx, &x, &y, NULL), CPAR_ERR_INVALID, "dx");
    TU_FAILS(cpar_gelu_backward(ctx, &x, &yshort, &y), CPAR_ERR_INVALID, "dy has 7 elements");
    TU_FAILS(cpar_gelu_backward(ctx, &x, &y, &x), CPAR_ERR_INVALID, "dx is x");
    TU_OK(cpar_gelu_backward(ctx, &x, &y, &y));
    cpar_tensor *all[] = {&x, &y, &y16, &yshort, &xi};
    for (int i = 0; i < 5; i++) free_tensor(ctx, all[i]);
}

START_TEST(test_gelu_bad_input) { run_op(gelu_bad_case, 0); }
END_TEST

/* ---- split and concat ------------------------------------------------------------------- */

static const struct {
    int ndim;
    int64_t shape[4];
} sc_shapes[] = {{4, {3, 5, 4, 7}}, {3, {7, 1, 33}}, {2, {1, 1000}}};
#define N_SC_SHAPES ((int)(sizeof sc_shapes / sizeof sc_shapes[0]))

/* Piece sizes along a dimension of size D: uneven, with a zero-size piece. */
static int make_pieces(int64_t D, int64_t *len) {
    len[0] = (D + 1) / 3;
    len[1] = 0;
    len[2] = D - len[0] - 1 > 0 ? D - len[0] - 1 : 0;
    len[3] = D - len[0] - len[2];
    return 4;
}

/* Reference: piece p of whole along dim, whole viewed as [outer, D, inner]. */
static void ref_piece(const void *whole, void *piece, size_t es, int64_t outer, int64_t D, int64_t inner, int64_t off,
                      int64_t len) {
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < len; i++)
            memcpy((char *)piece + (size_t)((o * len + i) * inner) * es,
                   (const char *)whole + (size_t)((o * D + off + i) * inner) * es, (size_t)inner * es);
}

static void split_concat_case(cpar_ctx *ctx, int d) {
    cpar_dtype dt = all_dtypes[d];
    size_t es = cpar_dtype_size(dt);
    for (int k = 0; k < N_SC_SHAPES; k++) {
        int nd = sc_shapes[k].ndim;
        const int64_t *shape = sc_shapes[k].shape;
        int64_t numel = 1;
        for (int i = 0; i < nd; i++) numel *= shape[i];
        void *x = tu_random_host(dt, numel, 99 + (uint64_t)k);
        cpar_tensor whole = tu_upload(ctx, x, dt, nd, shape);
        /* Every dim, counted from the front and from the end. */
        for (int dim = -nd; dim < nd; dim++) {
            int ax = dim < 0 ? dim + nd : dim;
            int64_t D = shape[ax], outer = 1, inner = 1, len[4];
            for (int i = 0; i < ax; i++) outer *= shape[i];
            for (int i = ax + 1; i < nd; i++) inner *= shape[i];
            for (int whole_piece = 0; whole_piece < 2; whole_piece++) {
                int np = whole_piece ? 1 : make_pieces(D, len);
                if (whole_piece) len[0] = D;
                cpar_tensor pieces[4], *pp[4];
                for (int p = 0; p < np; p++) {
                    int64_t ps[4];
                    memcpy(ps, shape, sizeof ps);
                    ps[ax] = len[p];
                    pieces[p] = tu_alloc_poisoned(ctx, dt, nd, ps);
                    pp[p] = &pieces[p];
                }
                TU_OK(cpar_split(ctx, &whole, dim, np, pp));
                int64_t off = 0;
                for (int p = 0; p < np; p++) {
                    int64_t cnt = outer * len[p] * inner;
                    void *want = malloc((size_t)cnt * es + 1), *got = tu_download(ctx, &pieces[p]);
                    ref_piece(x, want, es, outer, D, inner, off, len[p]);
                    ck_assert_msg(cnt == 0 || !memcmp(got, want, (size_t)cnt * es),
                                  "split %s shape %d dim %d: piece %d of %d differs", cpar_dtype_name(dt), k, dim, p,
                                  np);
                    off += len[p];
                    free(want);
                    free(got);
                }
                /* And back: concat of the pieces is the whole. */
                cpar_tensor back = tu_alloc_poisoned(ctx, dt, nd, shape);
                TU_OK(cpar_concat(ctx, pp, np, dim, &back));
                void *got = tu_download(ctx, &back);
                ck_assert_msg(!memcmp(got, x, (size_t)numel * es), "concat %s shape %d dim %d (%d pieces) differs",
                              cpar_dtype_name(dt), k, dim, np);
                free(got);
                free_tensor(ctx, &back);
                for (int p = 0; p < np; p++) free_tensor(ctx, &pieces[p]);
            }
        }
        free(x);
        free_tensor(ctx, &whole);
    }
}

START_TEST(test_split_concat) { run_op(split_concat_case, _i); }
END_TEST

/* ---- row reduce ------------------------------------------------------------------------- */

static const int64_t row_cols[] = {1, 31, 33, 1000, 4097};
#define N_COLS ((int)(sizeof row_cols / sizeof row_cols[0]))
static const char *const row_op_names[] = {"sum", "max", "logsumexp"};

/* Loop index: input dtype x op. Rows: [2, 3, cols] -> [2, 3]; row 0 is all
 * -inf, row 1 is shifted by +100 (exp would overflow fp32 without the max
 * subtracted), the rest random. */
static void row_reduce_case(cpar_ctx *ctx, int i) {
    cpar_dtype dt = float_dtypes[i / 3];
    cpar_row_op op = (cpar_row_op)(i % 3);
    for (int k = 0; k < N_COLS; k++) {
        int64_t cols = row_cols[k], rows = 6, shape[] = {2, 3, cols}, oshape[] = {2, 3};
        void *x = tu_random_host(dt, rows * cols, 5 + (uint64_t)k);
        for (int64_t c = 0; c < cols; c++) {
            tu_set(x, dt, c, -INFINITY);
            tu_set(x, dt, cols + c, 100.0 + tu_get(x, dt, cols + c));
        }
        cpar_tensor in = tu_upload(ctx, x, dt, 3, shape), out = tu_alloc_poisoned(ctx, CPAR_F32, 2, oshape);
        TU_OK(cpar_row_reduce(ctx, &in, op, &out));
        float *got = tu_download(ctx, &out);
        for (int64_t r = 0; r < rows; r++) {
            double sum = 0, abs_sum = 0, mx = -INFINITY, lse = 0;
            for (int64_t c = 0; c < cols; c++) {
                double v = tu_get(x, dt, r * cols + c);
                sum += v;
                abs_sum += fabs(v);
                mx = fmax(mx, v);
            }
            if (mx == -INFINITY) {
                lse = -INFINITY;
            } else {
                for (int64_t c = 0; c < cols; c++) lse += exp(tu_get(x, dt, r * cols + c) - mx);
                lse = mx + log(lse);
            }
            double want = op == CPAR_ROW_SUM ? sum : op == CPAR_ROW_MAX ? mx : lse, g = got[r];
            /* fp32 accumulation: sums within a bound of the sum of |x|; the max is exact. */
            double tol = op == CPAR_ROW_SUM ? 2e-6 * (1 + abs_sum) : op == CPAR_ROW_MAX ? 0 : 1e-5 * (1 + fabs(want));
            if (isinf(want))
                ck_assert_msg(g == want, "row_reduce %s %s cols %lld row %lld: got %g, expected %g",
                              row_op_names[op], cpar_dtype_name(dt), (long long)cols, (long long)r, g, want);
            else
                ck_assert_msg(!isnan(g) && fabs(g - want) <= tol,
                              "row_reduce %s %s cols %lld row %lld: got %.9g, expected %.9g (tol %.3g)",
                              row_op_names[op], cpar_dtype_name(dt), (long long)cols, (long long)r, g, want, tol);
        }
        free(x);
        free(got);
        free_tensor(ctx, &in);
        free_tensor(ctx, &out);
    }
}

START_TEST(test_row_reduce) { run_op(row_reduce_case, _i); }
END_TEST

/* ---- bad input ---------------------------------------------------------------------------- */

static void bad_input_case(cpar_ctx *ctx, int unused) {
    (void)unused;
    int64_t s35[] = {3, 5}, s15[] = {15}, s34[] = {3, 4}, s3[] = {3}, s4[] = {4}, s2[] = {3, 2}, s1[] = {3, 1};
    float *data = tu_random_host(CPAR_F32, 15, 8);
    cpar_tensor f = tu_upload(ctx, data, CPAR_F32, 2, s35);  /* f32 [3,5] */
    cpar_tensor g = tu_alloc_poisoned(ctx, CPAR_F32, 2, s35); /* f32 [3,5] */
    cpar_tensor h = tu_alloc_poisoned(ctx, CPAR_F16, 2, s35); /* f16 [3,5] */
    cpar_tensor i32 = tu_alloc_poisoned(ctx, CPAR_I32, 2, s35);
    cpar_tensor u8 = tu_alloc_poisoned(ctx, CPAR_U8, 2, s35);
    cpar_tensor g34 = tu_alloc_poisoned(ctx, CPAR_F32, 2, s34);
    cpar_tensor flat = tu_alloc_poisoned(ctx, CPAR_F32, 1, s15);
    cpar_tensor r3 = tu_alloc_poisoned(ctx, CPAR_F32, 1, s3), r4 = tu_alloc_poisoned(ctx, CPAR_F32, 1, s4);
    cpar_tensor r3h = tu_alloc_poisoned(ctx, CPAR_F16, 1, s3);
    cpar_tensor p2 = tu_alloc_poisoned(ctx, CPAR_F32, 2, s2), p1 = tu_alloc_poisoned(ctx, CPAR_F32, 2, s1);
    cpar_tensor p2h = tu_alloc_poisoned(ctx, CPAR_F16, 2, s2);
    int foreign = cpar_device(ctx) == 5 ? 6 : 5;
    cpar_tensor ff = f;
    ff.device = foreign;

    /* fill */
    TU_FAILS(cpar_fill(ctx, NULL, 1.0), CPAR_ERR_INVALID, "t");
    TU_FAILS(cpar_fill(ctx, &ff, 1.0), CPAR_ERR_INVALID, "t");

    /* cast: float pairs only, same numel */
    TU_FAILS(cpar_cast(ctx, &f, &i32), CPAR_ERR_INVALID, "dst");
    TU_MSG_HAS("i32");
    TU_FAILS(cpar_cast(ctx, &i32, &f), CPAR_ERR_INVALID, "src");
    TU_FAILS(cpar_cast(ctx, &u8, &h), CPAR_ERR_INVALID, "src");
    TU_FAILS(cpar_cast(ctx, &f, &g34), CPAR_ERR_INVALID, "dst");
    TU_MSG_HAS("12");
    TU_FAILS(cpar_cast(ctx, NULL, &g), CPAR_ERR_INVALID, "src");
    TU_FAILS(cpar_cast(ctx, &f, NULL), CPAR_ERR_INVALID, "dst");
    TU_FAILS(cpar_cast(ctx, &ff, &g), CPAR_ERR_INVALID, "src");

    /* axpby: float dtypes, same dtype and numel */
    TU_FAILS(cpar_axpby(ctx, 1.0f, &f, 1.0f, &h), CPAR_ERR_INVALID, "y");
    TU_MSG_HAS("f16");
    TU_FAILS(cpar_axpby(ctx, 1.0f, &f, 1.0f, &g34), CPAR_ERR_INVALID, "y");
    TU_FAILS(cpar_axpby(ctx, 1.0f, &i32, 1.0f, &i32), CPAR_ERR_INVALID, "x");
    TU_FAILS(cpar_axpby(ctx, 1.0f, NULL, 1.0f, &g), CPAR_ERR_INVALID, "x");
    TU_FAILS(cpar_axpby(ctx, 1.0f, &f, 1.0f, NULL), CPAR_ERR_INVALID, "y");
    TU_FAILS(cpar_axpby(ctx, 1.0f, &f, 1.0f, &ff), CPAR_ERR_INVALID, "y");

    /* split / concat: f [3,5] into [3,2] + [3,1] (adds up to 3, not 5), bad dims */
    cpar_tensor *short_pieces[] = {&p2, &p1}, *mixed[] = {&p2, &p2h}, *wrong_rank[] = {&flat, &p2};
    cpar_tensor *ok_pieces[] = {&p2, &p2, &p1};
    TU_FAILS(cpar_split(ctx, &f, 1, 2, short_pieces), CPAR_ERR_INVALID, "out");
    TU_MSG_HAS("5");
    TU_FAILS(cpar_split(ctx, &f, 1, 2, mixed), CPAR_ERR_INVALID, "out[1]");
    TU_FAILS(cpar_split(ctx, &f, 1, 2, wrong_rank), CPAR_ERR_INVALID, "out[0]");
    TU_FAILS(cpar_split(ctx, &f, 0, 3, ok_pieces), CPAR_ERR_INVALID, "out[0]"); /* dim 0 is 3, not 3 x ... */
    TU_FAILS(cpar_split(ctx, &f, 2, 3, ok_pieces), CPAR_ERR_INVALID, "dim");
    TU_FAILS(cpar_split(ctx, &f, -3, 3, ok_pieces), CPAR_ERR_INVALID, "dim");
    TU_FAILS(cpar_split(ctx, &f, 1, 0, ok_pieces), CPAR_ERR_INVALID, "n is 0");
    TU_FAILS(cpar_split(ctx, &f, 1, 3, NULL), CPAR_ERR_INVALID, "out");
    TU_FAILS(cpar_split(ctx, NULL, 1, 3, ok_pieces), CPAR_ERR_INVALID, "in");
    TU_FAILS(cpar_concat(ctx, short_pieces, 2, 1, &g), CPAR_ERR_INVALID, "in");
    TU_FAILS(cpar_concat(ctx, mixed, 2, 1, &g), CPAR_ERR_INVALID, "in[1]");
    TU_FAILS(cpar_concat(ctx, ok_pieces, 3, 2, &g), CPAR_ERR_INVALID, "dim");
    TU_FAILS(cpar_concat(ctx, ok_pieces, 3, -3, &g), CPAR_ERR_INVALID, "dim");
    TU_FAILS(cpar_concat(ctx, ok_pieces, 3, 1, NULL), CPAR_ERR_INVALID, "out");
    TU_FAILS(cpar_concat(ctx, ok_pieces, 3, 1, &h), CPAR_ERR_INVALID, "in[0]");
    TU_FAILS(cpar_concat(ctx, ok_pieces, 3, 1, &ff), CPAR_ERR_INVALID, "out");

    /* row_reduce: float input, F32 out with one element per row */
    TU_FAILS(cpar_row_reduce(ctx, &i32, CPAR_ROW_SUM, &r3), CPAR_ERR_INVALID, "in");
    TU_MSG_HAS("i32");
    TU_FAILS(cpar_row_reduce(ctx, &u8, CPAR_ROW_MAX, &r3), CPAR_ERR_INVALID, "in");
    TU_FAILS(cpar_row_reduce(ctx, &f, CPAR_ROW_SUM, &r3h), CPAR_ERR_INVALID, "out");
    TU_MSG_HAS("f16");
    TU_FAILS(cpar_row_reduce(ctx, &f, CPAR_ROW_SUM, &r4), CPAR_ERR_INVALID, "out");
    TU_MSG_HAS("3");
    TU_FAILS(cpar_row_reduce(ctx, &f, (cpar_row_op)3, &r3), CPAR_ERR_INVALID, "op");
    TU_FAILS(cpar_row_reduce(ctx, &f, (cpar_row_op)-1, &r3), CPAR_ERR_INVALID, "op");
    TU_FAILS(cpar_row_reduce(ctx, NULL, CPAR_ROW_SUM, &r3), CPAR_ERR_INVALID, "in");
    TU_FAILS(cpar_row_reduce(ctx, &f, CPAR_ROW_SUM, NULL), CPAR_ERR_INVALID, "out");
    TU_FAILS(cpar_row_reduce(ctx, &ff, CPAR_ROW_SUM, &r3), CPAR_ERR_INVALID, "in");

    /* Nothing was written. */
    cpar_tensor *outs[] = {&g, &h, &i32, &u8, &g34, &flat, &r3, &r4, &r3h, &p2, &p1, &p2h};
    for (size_t k = 0; k < sizeof outs / sizeof outs[0]; k++) {
        void *got = tu_download(ctx, outs[k]);
        for (int64_t e = 0; e < cpar_tensor_numel(outs[k]); e++) {
            cpar_dtype dt = outs[k]->dtype;
            double v = tu_get(got, dt, e);
            ck_assert(cpar_dtype_is_float(dt) ? isnan(v) : v == (dt == CPAR_U8 ? 255 : -1));
        }
        free(got);
    }
    cpar_tensor *all[] = {&f, &g, &h, &i32, &u8, &g34, &flat, &r3, &r4, &r3h, &p2, &p1, &p2h};
    for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) free_tensor(ctx, all[k]);
    free(data);
}

START_TEST(test_bad_input) { run_op(bad_input_case, 0); }
END_TEST

Suite *suite(void) {
    Suite *s = suite_create("ops: fill, cast, axpby, split, concat, row_reduce, gelu");
    const tu_loop loops[] = {
        {"fill", test_fill, N_ALL},
        {"cast", test_cast, N_CAST_PAIRS},
        {"cast_bits", test_cast_bits, 2},
        {"axpby", test_axpby, N_FLOAT},
        {"split_concat", test_split_concat, N_ALL},
        {"row_reduce", test_row_reduce, N_FLOAT * 3},
        {"gelu", test_gelu, N_FLOAT},
        {"gelu_finite_differences", test_gelu_finite_differences, 1},
        {"gelu_special", test_gelu_special, 1},
        {"gelu_dense", test_gelu_dense, 1},
        {"gelu_all16", test_gelu_all16, 2},
        {"gelu_bad_input", test_gelu_bad_input, 1},
        {"bad_input", test_bad_input, 1},
    };
    tu_add_loops(s, loops, sizeof loops / sizeof loops[0], 120);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
