/* SPDX-License-Identifier: MIT */
/* test_inference.c — inference layers (cpar.h §14): RMSNorm (and its backward),
 * InferenceLayerNormColumnParallelLinear, InferenceRowParallelLinear and the
 * fused reduce-scatter + add + RMSNorm + all-gather.
 *
 * Every result is compared with an fp64 reference computed here on one rank
 * from the same rounded inputs and master weights, so a tp = p run that
 * matches it at p = 1..4 also matches the tp = 1 layers:
 *  - cpar_rmsnorm_forward on the backend's tensors (the kernel on "sim", in
 *    the forward, reverse and a shuffled fiber schedule) and on host tensors,
 *    F32/F16/BF16, hidden sizes below, at and past the 256-thread block and
 *    not multiples of 32, in place and out of place, outputs poisoned;
 *  - cpar_rmsnorm_backward the same way and on shapes for each device path
 *    (dx in place over dy too, without dweight, then dweight accumulated
 *    over two calls), and against central differences of the forward;
 *  - a column -> row -> (fused rs + add + norm + ag) -> column (skip norm
 *    and all-gather) chain at tp 1..4, F32 and BF16: every intermediate
 *    (y1, y2, the updated residual, the normed all-gathered activation, y3)
 *    against the reference, and the communication statistics of each call
 *    against the minimum;
 *  - cpar_inference_rs_add_rmsnorm_ag on its own at tp 1..4;
 *  - bad arguments for every public function of the section. */
#define _GNU_SOURCE /* setenv */
#include "testutil.h"

#define MAX_TP 4

/* v rounded to dt, in place. */
static void round_all(double *v, int64_t n, cpar_dtype dt) {
    for (int64_t i = 0; i < n; i++) v[i] = tu_round(dt, v[i]);
}

/* Upload rows [r0, r0 + rows) and columns [c0, c0 + nc) of a [*, K] matrix as dt with the given shape. */
static cpar_tensor upload_block(cpar_ctx *ctx, const double *m, int64_t K, int64_t r0, int64_t rows, int64_t c0,
                                int64_t nc, cpar_dtype dt, int ndim, const int64_t *shape) {
    void *h = malloc((size_t)(rows * nc) * cpar_dtype_size(dt) + 1);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < nc; j++) tu_set(h, dt, i * nc + j, m[(r0 + i) * K + c0 + j]);
    cpar_tensor t = tu_upload(ctx, h, dt, ndim, shape);
    free(h);
    return t;
}

/* Compare t with rows [r0, r0 + rows), columns [c0, c0 + nc) of a [*, K] reference. */
static void expect_block(cpar_ctx *ctx, const cpar_tensor *t, const double *m, int64_t K, int64_t r0, int64_t rows,
                         int64_t c0, int64_t nc, double tol, const char *what) {
    double *want = malloc(sizeof(double) * (size_t)(rows * nc + 1));
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < nc; j++) want[i * nc + j] = m[(r0 + i) * K + c0 + j];
    ck_assert_int_eq(cpar_tensor_numel(t), rows * nc);
    void *h = tu_download(ctx, t);
    char msg[256];
    int64_t i = tu_mismatch(h, t->dtype, want, rows * nc, tol, msg, sizeof msg);
    ck_assert_msg(i < 0, "%s (rank %d of %d): %s", what, cpar_rank(ctx), cpar_world_size(ctx), msg);
    free(h);
    free(want);
}

/* ---- fp64 references ------------------------------------------------------------- */

/* y[T, h] = x / sqrt(mean(x^2) + eps) * w. */
static void ref_rmsnorm(const double *x, const double *w, int64_t T, int64_t h, double eps, double *y) {
    for (int64_t t = 0; t < T; t++) {
        double ss = 0.0;
        for (int64_t j = 0; j < h; j++) ss += x[t * h + j] * x[t * h + j];
        const double inv = 1.0 / sqrt(ss / (double)h + eps);
        for (int64_t j = 0; j < h; j++) y[t * h + j] = x[t * h + j] * inv * w[j];
    }
}

/* Y[T, N] = X[T, K] W[N, K]^T. */
static void ref_matmul_t(const double *X, const double *W, int64_t T, int64_t K, int64_t N, double *Y) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t o = 0; o < N; o++) {
            double a = 0.0;
            for (int64_t k = 0; k < K; k++) a += X[t * K + k] * W[o * K + k];
            Y[t * N + o] = a;
        }
}

/* Received bytes of this call's collectives on g, all kinds. */
static uint64_t recv_bytes(cpar_group *g) {
    cpar_comm_stats st;
    TU_OK(cpar_group_stats(g, &st));
    uint64_t r = 0;
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++) r += st.kind[k].bytes_recv;
    return r;
}

/* ==== RMSNorm ========================================================================= */

typedef struct {
    int64_t rows, h;
    cpar_dtype dt;
    bool host, in_place;
    float eps;
    uint64_t seed;
} norm_case;

static cpar_status rank_norm(cpar_ctx *ctx, void *arg) {
    const norm_case *c = arg;
    const int64_t n = c->rows * c->h, xs[2] = {c->rows, c->h};
    double *x = tu_random_doubles(n, -3.0, 3.0, c->seed), *w = tu_random_doubles(c->h, 0.5, 1.5, c->seed + 1);
    round_all(x, n, c->dt), round_all(w, c->h, c->dt);
    double *want = malloc(sizeof(double) * (size_t)(n + 1));
    ref_rmsnorm(x, w, c->rows, c->h, c->eps, want);
    void *hx = malloc((size_t)n * cpar_dtype_size(c->dt) + 1), *hw = malloc((size_t)c->h * cpar_dtype_size(c->dt));
    for (int64_t i = 0; i < n; i++) tu_set(hx, c->dt, i, x[i]);
    for (int64_t i = 0; i < c->h; i++) tu_set(hw, c->dt, i, w[i]);
    cpar_tensor tx, tw, ty;
    void *hy = NULL;
    if (c->host) {
        hy = malloc((size_t)n * cpar_dtype_size(c->dt) + 1);
        memset(hy, 0xff, (size_t)n * cpar_dtype_size(c->dt));
        tx = cpar_tensor_make(hx, c->dt, 2, xs, CPAR_HOST);
        tw = cpar_tensor_make(hw, c->dt, 1, &c->h, CPAR_HOST);
        ty = c->in_place ? tx : cpar_tensor_make(hy, c->dt, 2, xs, CPAR_HOST);
    } else {
        tx = tu_upload(ctx, hx, c->dt, 2, xs);
        tw = tu_upload(ctx, hw, c->dt, 1, &c->h);
        ty = c->in_place ? tx : tu_alloc_poisoned(ctx, c->dt, 2, xs);
    }
    TU_OK(cpar_rmsnorm_forward(ctx, &tx, &tw, c->eps, &ty));
    TU_OK(cpar_sync(ctx));
    expect_block(ctx, &ty, want, c->h, 0, c->rows, 0, c->h, 2 * tu_tol(c->dt), "rmsnorm y");
    if (!c->in_place) { /* x is read only */
        void *back = tu_download(ctx, &tx);
        TU_EXPECT_SAME(back, hx, c->dt, n);
        free(back);
    }
    if (!c->host) {
        TU_OK(cpar_tensor_free(ctx, &tx));
        TU_OK(cpar_tensor_free(ctx, &tw));
        if (!c->in_place) TU_OK(cpar_tensor_free(ctx, &ty));
    }
    free(x), free(w), free(want), free(hx), free(hw), free(hy);
    return CPAR_OK;
}

static const cpar_dtype fdtypes[] = {CPAR_F32, CPAR_F16, CPAR_BF16};
/* {4099, 40} has more rows than the kernel's 4096-block grid: blocks loop
 * over rows; {3, 4096} is the widest row the host keeps widened (CPAR__ROW),
 * {2, 4103} one past it, which the host re-widens per block */
static const int64_t norm_shapes[][2] = {{1, 7}, {5, 33}, {3, 256}, {4, 1000}, {9, 96}, {4099, 40}, {3, 4096}, {2, 4103}};
#define N_NORM_SHAPES 8

/* _i = (shape * 3 + dtype) * 3 + schedule; the last schedule also runs on host tensors and in place. */
START_TEST(test_rmsnorm) {
    static const char *const sched[3] = {"forward", "reverse", "shuffle:11"};
    const int sh = _i / 9, d = (_i / 3) % 3, s = _i % 3;
    setenv("CUDASIM_SCHEDULE", sched[s], 1);
    norm_case c = {.rows = norm_shapes[sh][0], .h = norm_shapes[sh][1], .dt = fdtypes[d], .eps = 1e-5f,
                   .seed = 10 + (uint64_t)_i};
    TU_OK(tu_spawn(1, rank_norm, &c));
    if (s == 2) {
        c.in_place = true, c.eps = 0.25f;
        TU_OK(tu_spawn(1, rank_norm, &c));
        c.host = true, c.in_place = false;
        TU_OK(tu_spawn(1, rank_norm, &c));
    }
}
END_TEST

/* ---- RMSNorm backward ------------------------------------------------------------------ */

/* dx = inv w dy - x inv^3 sum(dy w x)/h; dw = sum_rows dy x inv. */
static void ref_rmsnorm_backward(const double *x, const double *w, const double *dy, int64_t T, int64_t h, double eps,
                                 double *dx, double *dw) {
    for (int64_t j = 0; j < h; j++) dw[j] = 0.0;
    for (int64_t t = 0; t < T; t++) {
        double ss = 0.0, c = 0.0;
        for (int64_t j = 0; j < h; j++) ss += x[t * h + j] * x[t * h + j], c += dy[t * h + j] * w[j] * x[t * h + j];
        const double inv = 1.0 / sqrt(ss / (double)h + eps);
        for (int64_t j = 0; j < h; j++) {
            dx[t * h + j] = inv * w[j] * dy[t * h + j] - x[t * h + j] * inv * inv * inv * c / (double)h;
            dw[j] += dy[t * h + j] * x[t * h + j] * inv;
        }
    }
}

static cpar_status rank_norm_bwd(cpar_ctx *ctx, void *arg) {
    const norm_case *c = arg;
    const cpar_dtype dt = c->dt;
    const int64_t n = c->rows * c->h, xs[2] = {c->rows, c->h};
    double *x = tu_random_doubles(n, -3.0, 3.0, c->seed), *w = tu_random_doubles(c->h, 0.5, 1.5, c->seed + 1);
    double *dy = tu_random_doubles(n, -1.0, 1.0, c->seed + 2), *dw0 = tu_random_doubles(c->h, -1.0, 1.0, c->seed + 3);
    round_all(x, n, dt), round_all(w, c->h, dt), round_all(dy, n, dt), round_all(dw0, c->h, CPAR_F32);
    double *wdx = malloc(sizeof(double) * (size_t)n), *wdw = malloc(sizeof(double) * (size_t)c->h);
    ref_rmsnorm_backward(x, w, dy, c->rows, c->h, c->eps, wdx, wdw);
    for (int64_t j = 0; j < c->h; j++) wdw[j] = dw0[j] + 2 * wdw[j]; /* two calls accumulate */
    void *hx = malloc((size_t)n * cpar_dtype_size(dt)), *hw = malloc((size_t)c->h * cpar_dtype_size(dt));
    void *hdy = malloc((size_t)n * cpar_dtype_size(dt));
    float *hdw = malloc(sizeof(float) * (size_t)c->h);
    for (int64_t i = 0; i < n; i++) tu_set(hx, dt, i, x[i]), tu_set(hdy, dt, i, dy[i]);
    for (int64_t j = 0; j < c->h; j++) tu_set(hw, dt, j, w[j]), hdw[j] = (float)dw0[j];
    cpar_tensor tx = tu_upload(ctx, hx, dt, 2, xs), tw = tu_upload(ctx, hw, dt, 1, &c->h);
    cpar_tensor tdy = tu_upload(ctx, hdy, dt, 2, xs), tdw = tu_upload(ctx, hdw, CPAR_F32, 1, &c->h);
    cpar_tensor tdx = c->in_place ? tdy : tu_alloc_poisoned(ctx, dt, 2, xs);
    cpar_tensor hdy_t = cpar_tensor_make(hdy, dt, 2, xs, CPAR_HOST);
    /* without dweight, then twice with it (dy restored after each in-place call) */
    TU_OK(cpar_rmsnorm_backward(ctx, &tx, &tw, c->eps, &tdy, &tdx, NULL));
    expect_block(ctx, &tdx, wdx, c->h, 0, c->rows, 0, c->h, 4 * tu_tol(dt), "rmsnorm backward dx (no dweight)");
    if (c->in_place) TU_OK(cpar_tensor_copy(ctx, &hdy_t, &tdy));
    else TU_OK(cpar_fill(ctx, &tdx, NAN));
    TU_OK(cpar_rmsnorm_backward(ctx, &tx, &tw, c->eps, &tdy, &tdx, &tdw));
    expect_block(ctx, &tdx, wdx, c->h, 0, c->rows, 0, c->h, 4 * tu_tol(dt), "rmsnorm backward dx");
    if (c->in_place) TU_OK(cpar_tensor_copy(ctx, &hdy_t, &tdy));
    TU_OK(cpar_rmsnorm_backward(ctx, &tx, &tw, c->eps, &tdy, &tdx, &tdw));
    TU_OK(cpar_sync(ctx));
    expect_block(ctx, &tdw, wdw, c->h, 0, 1, 0, c->h, dt == CPAR_F32 ? 1e-5 * (double)c->rows : 4 * tu_tol(dt),
                 "rmsnorm backward dweight");
    cpar_tensor *ts[] = {&tx, &tw, &tdy, &tdw};
    for (int i = 0; i < 4; i++) TU_OK(cpar_tensor_free(ctx, ts[i]));
    if (!c->in_place) TU_OK(cpar_tensor_free(ctx, &tdx));
    free(x), free(w), free(dy), free(dw0), free(wdx), free(wdw), free(hx), free(hw), free(hdy), free(hdw);
    return CPAR_OK;
}

/* The forward's shapes, then rows for each of the device backward's paths
 * (packs of 16 bytes per thread, cpar_kernels.cu §19): {37, 999} unaligned,
 * 4 per thread; {40, 2056} 2 (bf16, f16) and 4 (f32) per thread over three
 * dweight chunks of 16 rows, the last short; {2, 16384} 8 per thread (bf16,
 * f16) and three passes (f32); {2, 4103} (above) three unaligned passes. */
static const int64_t norm_bwd_shapes[][2] = {{1, 7},     {5, 33},   {3, 256},  {4, 1000}, {9, 96},   {4099, 40},
                                             {3, 4096},  {2, 4103}, {37, 999}, {40, 2056}, {2, 16384}};
#define N_NORM_BWD_SHAPES 11

/* _i = (shape * 3 + dtype) * 2 + schedule (forward, shuffled); the second schedule writes dx over dy. */
START_TEST(test_rmsnorm_backward) {
    static const char *const sched[2] = {"forward", "shuffle:5"};
    const int sh = _i / 6, d = (_i / 2) % 3, s = _i % 2;
    setenv("CUDASIM_SCHEDULE", sched[s], 1);
    norm_case c = {.rows = norm_bwd_shapes[sh][0], .h = norm_bwd_shapes[sh][1], .dt = fdtypes[d], .eps = 1e-5f,
                   .in_place = s == 1, .seed = 900 + (uint64_t)_i};
    if (c.rows > 1000) c.rows = 1000; /* the row count past the grid is the forward's case */
    TU_OK(tu_spawn(1, rank_norm_bwd, &c));
}
END_TEST

/* L = sum(g * rmsnorm(x, w)) with fixed g: dL/dx and dL/dw from the backward
 * against central differences of the forward (F32, the backend's tensors). */
static cpar_status rank_norm_fd(cpar_ctx *ctx, void *unused) {
    (void)unused;
    enum { R = 3, Hd = 5 };
    const int64_t xs[2] = {R, Hd}, hs = Hd;
    float x[R * Hd], w[Hd], g[R * Hd], dw[Hd] = {0};
    uint64_t s = 42;
    for (int i = 0; i < R * Hd; i++) x[i] = (float)tu_uniform(&s) * 2.f, g[i] = (float)tu_uniform(&s);
    for (int j = 0; j < Hd; j++) w[j] = 1.f + 0.5f * (float)tu_uniform(&s);
    const float eps = 1e-3f, h = 1e-2f;
    cpar_tensor tx = tu_upload(ctx, x, CPAR_F32, 2, xs), tw = tu_upload(ctx, w, CPAR_F32, 1, &hs);
    cpar_tensor tg = tu_upload(ctx, g, CPAR_F32, 2, xs), tdx = tu_alloc_poisoned(ctx, CPAR_F32, 2, xs);
    cpar_tensor tdw = tu_upload(ctx, dw, CPAR_F32, 1, &hs), ty = tu_alloc_poisoned(ctx, CPAR_F32, 2, xs);
    TU_OK(cpar_rmsnorm_backward(ctx, &tx, &tw, eps, &tg, &tdx, &tdw));
    float *gx = tu_download(ctx, &tdx), *gw = tu_download(ctx, &tdw);
    /* L at a perturbed input: forward on the backend, the weighted sum here */
    for (int which = 0; which < R * Hd + Hd; which++) {
        double Lpm[2];
        for (int sign = 0; sign < 2; sign++) {
            float xp[R * Hd], wp[Hd];
            memcpy(xp, x, sizeof xp), memcpy(wp, w, sizeof wp);
            float *p = which < R * Hd ? &xp[which] : &wp[which - R * Hd];
            *p += sign ? -h : h;
            cpar_tensor hx = cpar_tensor_make(xp, CPAR_F32, 2, xs, CPAR_HOST), hw = cpar_tensor_make(wp, CPAR_F32, 1, &hs, CPAR_HOST);
            TU_OK(cpar_tensor_copy(ctx, &hx, &tx));
            TU_OK(cpar_tensor_copy(ctx, &hw, &tw));
            TU_OK(cpar_rmsnorm_forward(ctx, &tx, &tw, eps, &ty));
            float *y = tu_download(ctx, &ty);
            double L = 0.0;
            for (int i = 0; i < R * Hd; i++) L += (double)g[i] * (double)y[i];
            Lpm[sign] = L;
            free(y);
        }
        const double fd = (Lpm[0] - Lpm[1]) / (2.0 * (double)h);
        const double an = which < R * Hd ? gx[which] : gw[which - R * Hd];
        ck_assert_msg(fabs(fd - an) < 2e-3 * (1.0 + fabs(fd)), "parameter %d: backward %g, differences %g", which, an, fd);
    }
    free(gx), free(gw);
    cpar_tensor *ts[] = {&tx, &tw, &tg, &tdx, &tdw, &ty};
    for (int i = 0; i < 6; i++) TU_OK(cpar_tensor_free(ctx, ts[i]));
    return CPAR_OK;
}

START_TEST(test_rmsnorm_finite_differences) { TU_OK(tu_spawn(1, rank_norm_fd, NULL)); }
END_TEST

/* ==== the layers ======================================================================== */

/* One model: x [S, B, H] -> column (norm1, W1 [O, H]) -> y1 [S, B, O/tp]
 * -> row (W2 [H, O]) -> y2 [S/tp, B, H]; then the same row layer fused with
 * the next norm (norm2) and a residual R -> residual', normed [S, B, H] ->
 * column with skip_norm_and_all_gather (W3 [P, H]) -> y3 [S, B, P/tp]. */
enum { S = 12, B = 2, H = 40, O = 24, P = 12 };
#define EPS 1e-5

typedef struct {
    cpar_dtype dt;
    uint64_t seed;
    /* inputs (rounded to dt) and the fp64 reference of every stage */
    double *x, *R, *W1, *W2, *W3, *n1, *n2;
    double *xn, *y1, *y2, *res, *normed, *y3;
} chain_case;

static void chain_init(chain_case *c, cpar_dtype dt, uint64_t seed) {
    memset(c, 0, sizeof *c);
    c->dt = dt, c->seed = seed;
    const int64_t T = S * B;
    c->x = tu_random_doubles(T * H, -2.0, 2.0, seed);
    c->R = tu_random_doubles(T * H, -1.0, 1.0, seed + 1);
    c->W1 = tu_random_doubles(O * H, -0.3, 0.3, seed + 2);
    c->W2 = tu_random_doubles(H * O, -0.3, 0.3, seed + 3);
    c->W3 = tu_random_doubles(P * H, -0.3, 0.3, seed + 4);
    c->n1 = tu_random_doubles(H, 0.5, 1.5, seed + 5);
    c->n2 = tu_random_doubles(H, 0.5, 1.5, seed + 6);
    round_all(c->x, T * H, dt), round_all(c->R, T * H, dt), round_all(c->n1, H, dt), round_all(c->n2, H, dt);
    round_all(c->W1, O * H, dt), round_all(c->W2, H * O, dt), round_all(c->W3, P * H, dt);
    c->xn = malloc(sizeof(double) * T * H), c->y1 = malloc(sizeof(double) * T * O);
    c->y2 = malloc(sizeof(double) * T * H), c->res = malloc(sizeof(double) * T * H);
    c->normed = malloc(sizeof(double) * T * H), c->y3 = malloc(sizeof(double) * T * P);
    ref_rmsnorm(c->x, c->n1, T, H, EPS, c->xn);
    ref_matmul_t(c->xn, c->W1, T, H, O, c->y1);
    ref_matmul_t(c->y1, c->W2, T, O, H, c->y2);
    for (int64_t i = 0; i < T * H; i++) c->res[i] = c->R[i] + c->y2[i];
    ref_rmsnorm(c->res, c->n2, T, H, EPS, c->normed);
    ref_matmul_t(c->normed, c->W3, T, H, P, c->y3);
}

static void chain_free(chain_case *c) {
    double *all[] = {c->x, c->R, c->W1, c->W2, c->W3, c->n1, c->n2, c->xn, c->y1, c->y2, c->res, c->normed, c->y3};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

static cpar_inference_linear *make_layer(cpar_group *tp, bool row, int64_t in, int64_t out, cpar_dtype dt,
                                         const double *W, const double *norm) {
    cpar_inference_linear_config cfg = {.input_size = in, .output_size = out, .dtype = dt};
    cpar_inference_linear *l;
    TU_OK(row ? cpar_inference_row_create(tp, &cfg, &l) : cpar_inference_column_create(tp, &cfg, &l));
    float *mw = tu_to_f32(W, in * out), *mn = norm ? tu_to_f32(norm, in) : NULL;
    const int64_t ws[2] = {out, in};
    cpar_tensor tw = cpar_tensor_make(mw, CPAR_F32, 2, ws, CPAR_HOST), tn = cpar_tensor_make(mn, CPAR_F32, 1, &in, CPAR_HOST);
    TU_OK(cpar_inference_init_from_master(l, &tw, norm ? &tn : NULL));
    free(mw), free(mn);
    return l;
}

static cpar_status rank_chain(cpar_ctx *ctx, void *arg) {
    const chain_case *c = arg;
    cpar_group *tp = cpar_world_group(ctx);
    const int n = cpar_group_size(tp), r = cpar_group_rank(tp);
    const cpar_dtype dt = c->dt;
    const int64_t Sl = S / n, es = (int64_t)cpar_dtype_size(dt);
    const double tol = dt == CPAR_F32 ? 1e-5 : 3 * tu_tol(dt);
    cpar_inference_linear *l1 = make_layer(tp, false, H, O, dt, c->W1, c->n1);
    cpar_inference_linear *l2 = make_layer(tp, true, O, H, dt, c->W2, NULL);
    cpar_inference_linear *l3 = make_layer(tp, false, H, P, dt, c->W3, NULL);
    TU_OK(cpar_inference_set_skip_norm_and_all_gather(l3, true));
    /* the norm weight of the fused step, a tensor of its own */
    void *hn2 = malloc((size_t)H * (size_t)es);
    for (int64_t j = 0; j < H; j++) tu_set(hn2, dt, j, c->n2[j]);
    cpar_tensor n2 = tu_upload(ctx, hn2, dt, 1, (const int64_t[]){H});
    free(hn2);

    /* column: x [S/tp, B, H] -> y1 [S, B, O/tp] */
    const int64_t xs[3] = {Sl, B, H}, y1s[3] = {S, B, O / n};
    cpar_tensor x = upload_block(ctx, c->x, H, r * Sl * B, Sl * B, 0, H, dt, 3, xs);
    cpar_tensor y1 = tu_alloc_poisoned(ctx, dt, 3, y1s);
    TU_OK(cpar_group_stats_reset(tp));
    TU_OK(cpar_inference_forward(l1, &x, &y1));
    ck_assert_uint_eq(recv_bytes(tp), (uint64_t)((S - Sl) * B * H * es)); /* all-gather of the normed x */
    expect_block(ctx, &y1, c->y1, O, 0, S * B, r * (O / n), O / n, tol, "column y1");

    /* row: y1 -> y2 [S/tp, B, H] */
    const int64_t y2s[3] = {Sl, B, H}, fulls[3] = {S, B, H};
    cpar_tensor y2 = tu_alloc_poisoned(ctx, dt, 3, y2s);
    TU_OK(cpar_group_stats_reset(tp));
    TU_OK(cpar_inference_forward(l2, &y1, &y2));
    ck_assert_uint_eq(recv_bytes(tp), (uint64_t)(Sl * B * H * es * (n - 1))); /* reduce-scatter */
    expect_block(ctx, &y2, c->y2, H, r * Sl * B, Sl * B, 0, H, tol, "row y2");

    /* row fused with the next norm: residual += rs(y1 W2^T), normed = ag(norm(residual)) */
    cpar_tensor res = upload_block(ctx, c->R, H, r * Sl * B, Sl * B, 0, H, dt, 3, y2s);
    cpar_tensor normed = tu_alloc_poisoned(ctx, dt, 3, fulls);
    TU_OK(cpar_group_stats_reset(tp));
    TU_OK(cpar_inference_row_forward_fused(l2, &y1, &res, &n2, 0.f, &normed));
    ck_assert_uint_eq(recv_bytes(tp), (uint64_t)(2 * Sl * B * H * es * (n - 1))); /* rs + ag */
    expect_block(ctx, &res, c->res, H, r * Sl * B, Sl * B, 0, H, tol, "fused residual");
    expect_block(ctx, &normed, c->normed, H, 0, S * B, 0, H, tol, "fused normed");

    /* column with skip_norm_and_all_gather: normed -> y3 [S, B, P/tp], no communication */
    const int64_t y3s[3] = {S, B, P / n};
    cpar_tensor y3 = tu_alloc_poisoned(ctx, dt, 3, y3s);
    TU_OK(cpar_group_stats_reset(tp));
    TU_OK(cpar_inference_forward(l3, &normed, &y3));
    ck_assert_uint_eq(recv_bytes(tp), 0);
    expect_block(ctx, &y3, c->y3, P, 0, S * B, r * (P / n), P / n, 2 * tol, "skip-norm column y3");

    /* the weights' views hold this rank's slices */
    cpar_tensor w1 = cpar_inference_weight(l1), nw = cpar_inference_norm_weight(l1);
    expect_block(ctx, &w1, c->W1, H, r * (O / n), O / n, 0, H, 0.0, "column weight slice");
    expect_block(ctx, &nw, c->n1, H, 0, 1, 0, H, 0.0, "norm weight");
    ck_assert_ptr_null(cpar_inference_norm_weight(l2).data);

    cpar_tensor *ts[] = {&n2, &x, &y1, &y2, &res, &normed, &y3};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) TU_OK(cpar_tensor_free(ctx, ts[i]));
    TU_OK(cpar_inference_destroy(l1));
    TU_OK(cpar_inference_destroy(l2));
    TU_OK(cpar_inference_destroy(l3));
    return CPAR_OK;
}

/* _i = (tp - 1) * 2 + dtype (F32, BF16). */
START_TEST(test_chain) {
    chain_case c;
    chain_init(&c, _i % 2 ? CPAR_BF16 : CPAR_F32, 100 + (uint64_t)_i);
    TU_OK(tu_spawn(_i / 2 + 1, rank_chain, &c));
    chain_free(&c);
}
END_TEST

/* ---- the fused collective on its own ------------------------------------------------------ */

typedef struct {
    cpar_dtype dt;
    int64_t s, b, h;
    double *partial; /* [n][s*b*h]: rank r's partial sums */
    double *R, *w, *res, *out;
} rs_case;

static cpar_status rank_rs(cpar_ctx *ctx, void *arg) {
    const rs_case *c = arg;
    cpar_group *tp = cpar_world_group(ctx);
    const int n = cpar_group_size(tp), r = cpar_group_rank(tp);
    const int64_t T = c->s * c->b, Tl = T / n, full[3] = {c->s, c->b, c->h}, loc[3] = {c->s / n, c->b, c->h};
    cpar_tensor part = upload_block(ctx, c->partial + (size_t)r * (size_t)(T * c->h), c->h, 0, T, 0, c->h, c->dt, 3, full);
    cpar_tensor res = upload_block(ctx, c->R, c->h, r * Tl, Tl, 0, c->h, c->dt, 3, loc);
    cpar_tensor w = upload_block(ctx, c->w, c->h, 0, 1, 0, c->h, c->dt, 1, &c->h);
    cpar_tensor out = tu_alloc_poisoned(ctx, c->dt, 3, full);
    TU_OK(cpar_group_stats_reset(tp));
    TU_OK(cpar_inference_rs_add_rmsnorm_ag(tp, &part, &res, &w, 1e-5f, &out));
    const uint64_t es = cpar_dtype_size(c->dt);
    cpar_comm_stats st;
    TU_OK(cpar_group_stats(tp, &st));
    ck_assert_uint_eq(st.kind[CPAR_COLL_REDUCE_SCATTER].bytes_recv, (uint64_t)(Tl * c->h) * es * (uint64_t)(n - 1));
    ck_assert_uint_eq(st.kind[CPAR_COLL_ALL_GATHER].bytes_recv, (uint64_t)((T - Tl) * c->h) * es);
    const double tol = c->dt == CPAR_F32 ? 1e-5 : 3 * tu_tol(c->dt);
    expect_block(ctx, &res, c->res, c->h, r * Tl, Tl, 0, c->h, tol, "rs_add_rmsnorm_ag residual");
    expect_block(ctx, &out, c->out, c->h, 0, T, 0, c->h, tol, "rs_add_rmsnorm_ag out");
    cpar_tensor *ts[] = {&part, &res, &w, &out};
    for (size_t i = 0; i < 4; i++) TU_OK(cpar_tensor_free(ctx, ts[i]));
    return CPAR_OK;
}

/* _i = (tp - 1) * 3 + dtype. */
START_TEST(test_rs_add_rmsnorm_ag) {
    const int n = _i / 3 + 1;
    rs_case c = {.dt = fdtypes[_i % 3], .s = 12, .b = 3, .h = 300};
    const int64_t T = c.s * c.b, N = T * c.h;
    c.partial = tu_random_doubles(n * N, -1.0, 1.0, 500 + (uint64_t)_i);
    c.R = tu_random_doubles(N, -1.0, 1.0, 600 + (uint64_t)_i);
    c.w = tu_random_doubles(c.h, 0.5, 1.5, 700 + (uint64_t)_i);
    round_all(c.partial, n * N, c.dt), round_all(c.R, N, c.dt), round_all(c.w, c.h, c.dt);
    c.res = malloc(sizeof(double) * (size_t)N), c.out = malloc(sizeof(double) * (size_t)N);
    for (int64_t i = 0; i < N; i++) {
        double sum = 0.0;
        for (int q = 0; q < n; q++) sum += c.partial[(size_t)q * (size_t)N + (size_t)i];
        /* the device rounds the reduce-scatter's sum and then the residual add to the dtype */
        c.res[i] = tu_round(c.dt, c.R[i] + tu_round(c.dt, sum));
    }
    ref_rmsnorm(c.res, c.w, T, c.h, 1e-5, c.out);
    TU_OK(tu_spawn(n, rank_rs, &c));
    free(c.partial), free(c.R), free(c.w), free(c.res), free(c.out);
}
END_TEST

/* ==== bad arguments ========================================================================= */

static cpar_status rank_bad(cpar_ctx *ctx, void *unused) {
    (void)unused;
    cpar_group *tp = cpar_world_group(ctx); /* 2 ranks */
    const cpar_inference_linear_config cfg = {.input_size = 8, .output_size = 6};
    cpar_inference_linear *col, *row, *l;

    /* creation */
    TU_FAILS(cpar_inference_column_create(NULL, &cfg, &l), CPAR_ERR_INVALID, "tp");
    TU_FAILS(cpar_inference_column_create(tp, NULL, &l), CPAR_ERR_INVALID, "cfg");
    TU_FAILS(cpar_inference_row_create(tp, &cfg, NULL), CPAR_ERR_INVALID, "out");
    cpar_inference_linear_config c2 = cfg;
    c2.output_size = 7;
    TU_FAILS(cpar_inference_column_create(tp, &c2, &l), CPAR_ERR_INVALID, "output_size 7");
    c2 = cfg, c2.input_size = 9;
    TU_FAILS(cpar_inference_row_create(tp, &c2, &l), CPAR_ERR_INVALID, "input_size 9");
    c2 = cfg, c2.input_size = 0;
    TU_FAILS(cpar_inference_row_create(tp, &c2, &l), CPAR_ERR_INVALID, "input_size 0");
    c2 = cfg, c2.dtype = CPAR_I32;
    TU_FAILS(cpar_inference_column_create(tp, &c2, &l), CPAR_ERR_INVALID, "dtype");
    c2 = cfg, c2.eps = -1.f;
    TU_FAILS(cpar_inference_column_create(tp, &c2, &l), CPAR_ERR_INVALID, "eps");
    TU_OK(cpar_inference_column_create(tp, &cfg, &col));
    TU_OK(cpar_inference_row_create(tp, &cfg, &row));
    TU_OK(cpar_inference_destroy(NULL));

    /* init */
    float mw[48] = {0}, mn[8] = {0};
    const int64_t ws[2] = {6, 8}, bad_ws[2] = {8, 6}, ns = 8;
    cpar_tensor tw = cpar_tensor_make(mw, CPAR_F32, 2, ws, CPAR_HOST), tn = cpar_tensor_make(mn, CPAR_F32, 1, &ns, CPAR_HOST);
    cpar_tensor tw_bad = cpar_tensor_make(mw, CPAR_F32, 2, bad_ws, CPAR_HOST);
    TU_FAILS(cpar_inference_init_from_master(NULL, &tw, NULL), CPAR_ERR_INVALID, "l");
    TU_FAILS(cpar_inference_init_from_master(col, NULL, NULL), CPAR_ERR_INVALID, "master_weight");
    TU_FAILS(cpar_inference_init_from_master(col, &tw_bad, NULL), CPAR_ERR_INVALID, "master_weight has shape [8,6]");
    TU_FAILS(cpar_inference_init_from_master(row, &tw, &tn), CPAR_ERR_INVALID, "master_norm_weight");
    cpar_tensor tn_bad = cpar_tensor_make(mn, CPAR_F32, 1, (const int64_t[]){6}, CPAR_HOST);
    TU_FAILS(cpar_inference_init_from_master(col, &tw, &tn_bad), CPAR_ERR_INVALID, "master_norm_weight");
    TU_OK(cpar_inference_init_from_master(col, &tw, &tn));
    TU_FAILS(cpar_inference_set_skip_norm_and_all_gather(row, true), CPAR_ERR_INVALID, "row layer");
    TU_FAILS(cpar_inference_set_skip_norm_and_all_gather(NULL, true), CPAR_ERR_INVALID, "l");

    /* forward: column x [s/tp, b, 8] -> y [s, b, 3]; row x [s, b, 4] -> y [s/2, b, 6] */
    cpar_tensor x, y, xr, yr, x16, yodd;
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 3, (const int64_t[]){2, 1, 8}, &x));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 3, (const int64_t[]){4, 1, 3}, &y));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 3, (const int64_t[]){4, 1, 4}, &xr));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 3, (const int64_t[]){2, 1, 6}, &yr));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F16, 3, (const int64_t[]){2, 1, 8}, &x16));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 3, (const int64_t[]){3, 1, 4}, &yodd));
    TU_OK(cpar_fill(ctx, &x, 0.5));
    TU_OK(cpar_fill(ctx, &xr, 0.5));
    TU_FAILS(cpar_inference_forward(NULL, &x, &y), CPAR_ERR_INVALID, "l");
    TU_FAILS(cpar_inference_forward(col, NULL, &y), CPAR_ERR_INVALID, "x");
    TU_FAILS(cpar_inference_forward(col, &x, NULL), CPAR_ERR_INVALID, "y");
    TU_FAILS(cpar_inference_forward(col, &x16, &y), CPAR_ERR_INVALID, "x has dtype f16");
    TU_FAILS(cpar_inference_forward(col, &xr, &y), CPAR_ERR_INVALID, "x has shape [4,1,4]");
    TU_FAILS(cpar_inference_forward(col, &x, &yr), CPAR_ERR_INVALID, "y has shape [2,1,6]");
    TU_FAILS(cpar_inference_forward(col, &x, &x), CPAR_ERR_INVALID, "y");
    TU_FAILS(cpar_inference_forward(row, &x, &yr), CPAR_ERR_INVALID, "x has shape [2,1,8], expected [2,1,4]");
    TU_FAILS(cpar_inference_forward(row, &xr, &y), CPAR_ERR_INVALID, "y has shape [4,1,3]");
    TU_FAILS(cpar_inference_forward(row, &yodd, &yr), CPAR_ERR_INVALID, "3 rows along dim 0, not divisible by tp=2");
    cpar_tensor x1d = cpar_tensor_make(x.data, CPAR_F32, 1, (const int64_t[]){8}, x.device);
    TU_FAILS(cpar_inference_forward(col, &x1d, &y), CPAR_ERR_INVALID, "ndim 1");
    TU_OK(cpar_inference_forward(col, &x, &y));
    TU_OK(cpar_inference_forward(row, &xr, &yr));

    /* fused */
    cpar_tensor res, normed, nw, nw_bad;
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 3, (const int64_t[]){2, 1, 6}, &res));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 3, (const int64_t[]){4, 1, 6}, &normed));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 1, (const int64_t[]){6}, &nw));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 1, (const int64_t[]){8}, &nw_bad));
    TU_OK(cpar_fill(ctx, &res, 0.0));
    TU_OK(cpar_fill(ctx, &nw, 1.0));
    TU_FAILS(cpar_inference_row_forward_fused(col, &x, &res, &nw, 0.f, &normed), CPAR_ERR_INVALID, "column layer");
    TU_FAILS(cpar_inference_row_forward_fused(row, &xr, NULL, &nw, 0.f, &normed), CPAR_ERR_INVALID, "residual");
    TU_FAILS(cpar_inference_row_forward_fused(row, &xr, &res, NULL, 0.f, &normed), CPAR_ERR_INVALID,
             "next_norm_weight");
    TU_FAILS(cpar_inference_row_forward_fused(row, &xr, &res, &nw_bad, 0.f, &normed), CPAR_ERR_INVALID,
             "next_norm_weight has shape [8]");
    TU_FAILS(cpar_inference_row_forward_fused(row, &xr, &res, &nw, 0.f, &yr), CPAR_ERR_INVALID,
             "normed has shape [2,1,6]");
    TU_FAILS(cpar_inference_row_forward_fused(row, &xr, &normed, &nw, 0.f, &normed), CPAR_ERR_INVALID,
             "residual has shape [4,1,6]");
    TU_FAILS(cpar_inference_row_forward_fused(row, &xr, &res, &nw, NAN, &normed), CPAR_ERR_INVALID, "eps");
    cpar_tensor res_alias = normed; /* residual inside normed */
    res_alias.shape[0] = 2;
    TU_FAILS(cpar_inference_row_forward_fused(row, &xr, &res_alias, &nw, 0.f, &normed), CPAR_ERR_INVALID,
             "overlaps");
    TU_OK(cpar_inference_row_forward_fused(row, &xr, &res, &nw, 0.f, &normed));

    /* the fused collective */
    cpar_tensor part;
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 3, (const int64_t[]){4, 1, 6}, &part));
    TU_OK(cpar_fill(ctx, &part, 0.25));
    TU_FAILS(cpar_inference_rs_add_rmsnorm_ag(NULL, &part, &res, &nw, 1e-5f, &normed), CPAR_ERR_INVALID, "tp");
    TU_FAILS(cpar_inference_rs_add_rmsnorm_ag(tp, NULL, &res, &nw, 1e-5f, &normed), CPAR_ERR_INVALID, "partial");
    TU_FAILS(cpar_inference_rs_add_rmsnorm_ag(tp, &part, &res, &nw, -1.f, &normed), CPAR_ERR_INVALID, "eps");
    TU_FAILS(cpar_inference_rs_add_rmsnorm_ag(tp, &part, &res, &nw_bad, 1e-5f, &normed), CPAR_ERR_INVALID,
             "weight has shape [8]");
    TU_FAILS(cpar_inference_rs_add_rmsnorm_ag(tp, &part, &res, &nw, 1e-5f, &part), CPAR_ERR_INVALID, "overlaps");
    TU_FAILS(cpar_inference_rs_add_rmsnorm_ag(tp, &part, &yr, &nw, 1e-5f, &res), CPAR_ERR_INVALID,
             "out has shape [2,1,6]");
    cpar_tensor part_odd = part;
    part_odd.shape[0] = 3;
    TU_FAILS(cpar_inference_rs_add_rmsnorm_ag(tp, &part_odd, &res, &nw, 1e-5f, &normed), CPAR_ERR_INVALID,
             "not divisible by tp=2");
    TU_OK(cpar_inference_rs_add_rmsnorm_ag(tp, &part, &res, &nw, 1e-5f, &normed));

    /* rmsnorm */
    cpar_tensor y8;
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 3, (const int64_t[]){2, 1, 8}, &y8));
    cpar_tensor w8 = cpar_inference_norm_weight(col);
    TU_FAILS(cpar_rmsnorm_forward(NULL, &x, &w8, 1e-5f, &y8), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_rmsnorm_forward(ctx, NULL, &w8, 1e-5f, &y8), CPAR_ERR_INVALID, "x");
    TU_FAILS(cpar_rmsnorm_forward(ctx, &x, &nw, 1e-5f, &y8), CPAR_ERR_INVALID, "weight has shape [6]");
    TU_FAILS(cpar_rmsnorm_forward(ctx, &x, &w8, 1e-5f, &y), CPAR_ERR_INVALID, "y has shape [4,1,3]");
    TU_FAILS(cpar_rmsnorm_forward(ctx, &x, &w8, -2.f, &y8), CPAR_ERR_INVALID, "eps");
    TU_FAILS(cpar_rmsnorm_forward(ctx, &x16, &w8, 1e-5f, &y8), CPAR_ERR_INVALID, "weight has dtype f32");
    cpar_tensor yshift = x; /* overlapping x without being x */
    yshift.data = (char *)x.data + sizeof(float);
    yshift.shape[0] = 1;
    cpar_tensor xshort = x;
    xshort.shape[0] = 1;
    TU_FAILS(cpar_rmsnorm_forward(ctx, &xshort, &w8, 1e-5f, &yshift), CPAR_ERR_INVALID, "overlaps");
    cpar_tensor ti = x;
    ti.dtype = CPAR_I32;
    TU_FAILS(cpar_rmsnorm_forward(ctx, &ti, &w8, 1e-5f, &y8), CPAR_ERR_INVALID, "x has dtype i32");
    TU_OK(cpar_rmsnorm_forward(ctx, &x, &w8, 1e-5f, &y8));
    cpar_tensor dw8, dw16;
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 1, (const int64_t[]){8}, &dw8));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F16, 1, (const int64_t[]){8}, &dw16));
    TU_OK(cpar_fill(ctx, &dw8, 0.0));
    TU_FAILS(cpar_rmsnorm_backward(NULL, &x, &w8, 1e-5f, &y8, &y8, &dw8), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_rmsnorm_backward(ctx, &x, &w8, 1e-5f, NULL, &y8, &dw8), CPAR_ERR_INVALID, "dy");
    TU_FAILS(cpar_rmsnorm_backward(ctx, &x, &w8, 1e-5f, &y8, NULL, &dw8), CPAR_ERR_INVALID, "dx");
    TU_FAILS(cpar_rmsnorm_backward(ctx, &x, &w8, 1e-5f, &y, &y8, &dw8), CPAR_ERR_INVALID, "dy has shape [4,1,3]");
    TU_FAILS(cpar_rmsnorm_backward(ctx, &x, &w8, 1e-5f, &y8, &y8, &dw16), CPAR_ERR_INVALID, "dweight has dtype f16");
    TU_FAILS(cpar_rmsnorm_backward(ctx, &x, &w8, 1e-5f, &y8, &y8, &nw), CPAR_ERR_INVALID, "dweight has shape [6]");
    TU_FAILS(cpar_rmsnorm_backward(ctx, &x, &w8, 1e-5f, &y8, &x, &dw8), CPAR_ERR_INVALID, "dx overlaps x");
    TU_FAILS(cpar_rmsnorm_backward(ctx, &x, &w8, -1.f, &y8, &y8, &dw8), CPAR_ERR_INVALID, "eps");
    TU_FAILS(cpar_rmsnorm_backward(ctx, &x, &nw, 1e-5f, &y8, &y8, &dw8), CPAR_ERR_INVALID, "weight has shape [6]");
    TU_OK(cpar_rmsnorm_backward(ctx, &x, &w8, 1e-5f, &y8, &y8, &dw8));
    TU_OK(cpar_rmsnorm_backward(ctx, &x, &w8, 1e-5f, &y8, &y8, NULL));
    TU_OK(cpar_tensor_free(ctx, &dw8));
    TU_OK(cpar_tensor_free(ctx, &dw16));

    cpar_tensor *ts[] = {&x, &y, &xr, &yr, &x16, &yodd, &res, &normed, &nw, &nw_bad, &part, &y8};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) TU_OK(cpar_tensor_free(ctx, ts[i]));
    TU_OK(cpar_inference_destroy(col));
    TU_OK(cpar_inference_destroy(row));
    return CPAR_OK;
}

START_TEST(test_bad_args) { TU_OK(tu_spawn(2, rank_bad, NULL)); }
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("inference: RMSNorm and the inference column/row-parallel layers");
    const tu_loop loops[] = {
        {"rmsnorm", test_rmsnorm, N_NORM_SHAPES * 9},
        {"rmsnorm_backward", test_rmsnorm_backward, N_NORM_BWD_SHAPES * 6},
        {"rmsnorm_finite_differences", test_rmsnorm_finite_differences, 1},
        {"chain", test_chain, 2 * MAX_TP},
        {"rs_add_rmsnorm_ag", test_rs_add_rmsnorm_ag, 3 * MAX_TP},
        {"bad_args", test_bad_args, 1},
    };
    tu_add_loops(s, loops, sizeof loops / sizeof loops[0], 120);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
