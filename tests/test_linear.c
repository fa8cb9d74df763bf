/* SPDX-License-Identifier: MIT */
/* test_linear.c — tensor-parallel linear layers (cpar.h §11).
 *
 * Every case is compared with a single-rank fp64 reference computed here from
 * the same master weights (rounded to the layer's dtype), so a tp = p run
 * matching it at every p also matches the tp = 1 layers:
 *  - a two-layer MLP, column -> GeLU (in the test, fp64) -> row, at tp 1..4,
 *    with and without sequence parallelism, F32, BF16 and F16: output, input
 *    gradient, every rank's slice of the weight and bias gradients;
 *  - one layer per option at tp 1..4 (F32): bias on/off, gather_output,
 *    skip_bias_add, disable_grad_reduce, frozen (no weight or bias grad),
 *    stride 3, sequence parallelism (with gather_output too),
 *    input_is_parallel false; each also checks accumulation over
 *    two backward calls, zero_grad, and the communication statistics of
 *    forward and backward against the minimum;
 *  - finite differences of the MLP (host backend, F32, tp 1 and 2);
 *  - init_random reproducible under the model-parallel RNG fork;
 *  - the column backward's two-stream schedule (collectives on the comm
 *    stream, GEMMs on compute, joined by events): on the device backend its
 *    results are bit-identical to the sequential order recomputed here with
 *    the public collectives and cpar_dev_gemm, its statistics are those of
 *    the sequential order, and the public collectives still work (on
 *    compute) afterwards. The sim executes every stream at issue time, so
 *    the overlap itself (and a missing event wait) is not observable there;
 *    a stale or destroyed event handle is (the sim checks every handle);
 *  - bad arguments. */
#define _GNU_SOURCE /* setenv */
#define CPAR_INTERNAL /* calls device-layer functions (cpar.h §16) directly */
#include "testutil.h"

#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_TP 4

static double gelu(double v) { return 0.5 * v * (1.0 + erf(v / sqrt(2.0))); }
static double gelu_grad(double v) { return 0.5 * (1.0 + erf(v / sqrt(2.0))) + v * exp(-0.5 * v * v) / 2.5066282746310002; }

/* Global index of local index i (chunks of per, rank r of n takes r, r+n, ...). */
static int64_t gidx(int64_t i, int64_t per, int r, int n) { return ((int64_t)r + (i / per) * n) * per + i % per; }

/* n doubles rounded to dt. */
static double *rounded(const double *v, int64_t n, cpar_dtype dt) {
    double *o = malloc(sizeof(double) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) o[i] = tu_round(dt, v[i]);
    return o;
}

static double *random_doubles(int64_t n, double scale, uint64_t seed) {
    return tu_random_doubles(n, -scale, scale, seed);
}

/* random_doubles rounded to dt, without keeping (leaking) the unrounded copy. */
static double *random_rounded(int64_t n, double scale, uint64_t seed, cpar_dtype dt) {
    double *v = random_doubles(n, scale, seed), *o = rounded(v, n, dt);
    free(v);
    return o;
}

/* Upload rows [r0, r0+rows) and columns cols[0..nc) (NULL: all K) of a [*, K] double matrix as dt. */
static cpar_tensor upload_sub(cpar_ctx *ctx, const double *m, int64_t K, int64_t r0, int64_t rows, const int64_t *cols,
                              int64_t nc, cpar_dtype dt, int ndim, const int64_t *shape) {
    void *h = malloc((size_t)(rows * nc) * cpar_dtype_size(dt) + 1);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < nc; j++) tu_set(h, dt, i * nc + j, m[(r0 + i) * K + (cols ? cols[j] : j)]);
    cpar_tensor t = tu_upload(ctx, h, dt, ndim, shape);
    free(h);
    return t;
}

/* Expected values: the sub-matrix of a [*, K] double matrix, times scale. */
static double *sub(const double *m, int64_t K, int64_t r0, int64_t rows, const int64_t *cols, int64_t nc, double scale) {
    double *o = malloc(sizeof(double) * (size_t)(rows * nc + 1));
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < nc; j++) o[i * nc + j] = scale * m[(r0 + i) * K + (cols ? cols[j] : j)];
    return o;
}

static void expect_tensor(cpar_ctx *ctx, const cpar_tensor *t, const double *want, double tol, const char *what) {
    void *h = tu_download(ctx, t);
    char msg[256];
    int64_t i = tu_mismatch(h, t->dtype, want, cpar_tensor_numel(t), tol, msg, sizeof msg);
    ck_assert_msg(i < 0, "%s (rank %d): %s", what, cpar_rank(ctx), msg);
    free(h);
}

/* Y[T,N] = X[T,K] W[N,K]^T (+ b). */
static void ref_fwd(const double *X, const double *W, const double *b, int64_t T, int64_t K, int64_t N, double *Y) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t o = 0; o < N; o++) {
            double a = b ? b[o] : 0.0;
            for (int64_t k = 0; k < K; k++) a += X[t * K + k] * W[o * K + k];
            Y[t * N + o] = a;
        }
}
/* dX[T,K] = dY[T,N] W[N,K] over the output columns with mask[o] (NULL: all).
 * Each sum runs over o in order (rows of W read whole, not columns). */
static void ref_dgrad(const double *dY, const double *W, int64_t T, int64_t K, int64_t N, const bool *mask, double *dX) {
    for (int64_t t = 0; t < T; t++) {
        double *dx = dX + t * K;
        for (int64_t k = 0; k < K; k++) dx[k] = 0.0;
        for (int64_t o = 0; o < N; o++) {
            if (mask && !mask[o]) continue;
            const double dy = dY[t * N + o], *w = W + o * K;
            for (int64_t k = 0; k < K; k++) dx[k] += dy * w[k];
        }
    }
}
/* dW[N,K] = dY^T X, db[N] = sum dY. Each sum runs over t in order (rows of
 * X read whole, not columns). */
static void ref_wgrad(const double *dY, const double *X, int64_t T, int64_t K, int64_t N, double *dW, double *db) {
    for (int64_t i = 0; i < N * K; i++) dW[i] = 0.0;
    for (int64_t o = 0; o < N; o++) db[o] = 0.0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t o = 0; o < N; o++) {
            const double dy = dY[t * N + o], *x = X + t * K;
            double *dw = dW + o * K;
            db[o] += dy;
            for (int64_t k = 0; k < K; k++) dw[k] += dy * x[k];
        }
}

static uint64_t ag_bytes(uint64_t own, int n) { return own * (uint64_t)(n - 1); }
static uint64_t ar_bytes(uint64_t total, int n) { return 2 * total * (uint64_t)(n - 1) / (uint64_t)n; }

/* ==== the MLP ============================================================== */

typedef struct {
    int tp;
    bool sp;
    cpar_dtype dt;
    int64_t s, b, H, F, T;
    double *W1, *b1, *W2, *b2, *x, *g;                     /* masters (as dt holds them) */
    double *y1, *h, *y2, *dh, *dy1, *dx, *dW1, *db1, *dW2, *db2; /* reference */
    bool fd;                                               /* finite-difference run */
} mlp_case;

static void mlp_init(mlp_case *c, int tp, bool sp, cpar_dtype dt, uint64_t seed) {
    memset(c, 0, sizeof *c);
    c->tp = tp, c->sp = sp, c->dt = dt, c->s = 12, c->b = 2, c->H = 8, c->F = 24, c->T = c->s * c->b;
    int64_t T = c->T, H = c->H, F = c->F;
    double *w1 = random_doubles(F * H, 1.0 / sqrt((double)H), seed), *w2 = random_doubles(H * F, 1.0 / sqrt((double)F), seed + 1);
    double *bb1 = random_doubles(F, 0.5, seed + 2), *bb2 = random_doubles(H, 0.5, seed + 3);
    double *xx = random_doubles(T * H, 1.0, seed + 4), *gg = random_doubles(T * H, 1.0, seed + 5);
    c->W1 = rounded(w1, F * H, dt), c->W2 = rounded(w2, H * F, dt), c->b1 = rounded(bb1, F, dt);
    c->b2 = rounded(bb2, H, dt), c->x = rounded(xx, T * H, dt), c->g = rounded(gg, T * H, dt);
    free(w1), free(w2), free(bb1), free(bb2), free(xx), free(gg);
#define ALLOC(p, n) c->p = malloc(sizeof(double) * (size_t)(n))
    ALLOC(y1, T * F), ALLOC(h, T * F), ALLOC(y2, T * H), ALLOC(dh, T * F), ALLOC(dy1, T * F), ALLOC(dx, T * H);
    ALLOC(dW1, F * H), ALLOC(db1, F), ALLOC(dW2, H * F), ALLOC(db2, H);
#undef ALLOC
    ref_fwd(c->x, c->W1, c->b1, T, H, F, c->y1);
    for (int64_t i = 0; i < T * F; i++) c->h[i] = gelu(c->y1[i]);
    ref_fwd(c->h, c->W2, c->b2, T, F, H, c->y2);
    ref_dgrad(c->g, c->W2, T, F, H, NULL, c->dh);
    for (int64_t i = 0; i < T * F; i++) c->dy1[i] = c->dh[i] * gelu_grad(c->y1[i]);
    ref_dgrad(c->dy1, c->W1, T, H, F, NULL, c->dx);
    ref_wgrad(c->g, c->h, T, F, H, c->dW2, c->db2);
    ref_wgrad(c->dy1, c->x, T, H, F, c->dW1, c->db1);
}

static void mlp_free(mlp_case *c) {
    double *all[] = {c->W1, c->b1, c->W2, c->b2, c->x, c->g, c->y1, c->h, c->y2, c->dh, c->dy1, c->dx, c->dW1, c->db1, c->dW2, c->db2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

/* Column -> GeLU -> row forward; returns y2 (caller frees) and keeps h, gelu' for backward. */
typedef struct {
    cpar_linear *col, *row;
    cpar_tensor x, y1, h, y2, g, dh, dy1, dx;
    double *gp; /* gelu'(y1) local */
} mlp_state;

static void mlp_forward(cpar_ctx *ctx, mlp_case *c, mlp_state *m) {
    TU_OK(cpar_linear_forward(m->col, &m->x, &m->y1, NULL));
    void *hy = tu_download(ctx, &m->y1);
    int64_t n = cpar_tensor_numel(&m->y1);
    void *hh = malloc((size_t)n * cpar_dtype_size(c->dt));
    for (int64_t i = 0; i < n; i++) {
        double v = tu_get(hy, c->dt, i);
        tu_set(hh, c->dt, i, gelu(v));
        m->gp[i] = gelu_grad(v);
    }
    cpar_tensor hh_t = cpar_tensor_make(hh, c->dt, m->h.ndim, m->h.shape, CPAR_HOST);
    TU_OK(cpar_tensor_copy(ctx, &hh_t, &m->h));
    free(hy), free(hh);
    TU_OK(cpar_linear_forward(m->row, &m->h, &m->y2, NULL));
}

static void mlp_backward(cpar_ctx *ctx, mlp_case *c, mlp_state *m) {
    TU_OK(cpar_linear_backward(m->row, &m->g, &m->dh));
    void *hd = tu_download(ctx, &m->dh);
    int64_t n = cpar_tensor_numel(&m->dh);
    for (int64_t i = 0; i < n; i++) tu_set(hd, c->dt, i, tu_get(hd, c->dt, i) * m->gp[i]);
    cpar_tensor t = cpar_tensor_make(hd, c->dt, m->dy1.ndim, m->dy1.shape, CPAR_HOST);
    TU_OK(cpar_tensor_copy(ctx, &t, &m->dy1));
    free(hd);
    TU_OK(cpar_linear_backward(m->col, &m->dy1, &m->dx));
}

static void mlp_setup(cpar_ctx *ctx, mlp_case *c, mlp_state *m) {
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), r = cpar_group_rank(g);
    int64_t s = c->s, b = c->b, H = c->H, F = c->F, Fl = F / n, sl = c->sp ? s / n : s;
    cpar_linear_config cc = {.input_size = H, .output_size = F, .dtype = c->dt, .bias = true, .sequence_parallel = c->sp};
    cpar_linear_config rc = {.input_size = F, .output_size = H, .dtype = c->dt, .bias = true, .input_is_parallel = true,
                             .sequence_parallel = c->sp};
    TU_OK(cpar_column_parallel_linear_create(g, &cc, &m->col));
    TU_OK(cpar_row_parallel_linear_create(g, &rc, &m->row));
    float *w1 = tu_to_f32(c->W1, F * H), *w2 = tu_to_f32(c->W2, H * F), *b1 = tu_to_f32(c->b1, F), *b2 = tu_to_f32(c->b2, H);
    int64_t s1[2] = {F, H}, s2[2] = {H, F};
    cpar_tensor mw1 = cpar_tensor_make(w1, CPAR_F32, 2, s1, CPAR_HOST), mw2 = cpar_tensor_make(w2, CPAR_F32, 2, s2, CPAR_HOST);
    cpar_tensor mb1 = cpar_tensor_make(b1, CPAR_F32, 1, &F, CPAR_HOST), mb2 = cpar_tensor_make(b2, CPAR_F32, 1, &H, CPAR_HOST);
    TU_OK(cpar_linear_init_from_master(m->col, &mw1, &mb1));
    TU_OK(cpar_linear_init_from_master(m->row, &mw2, &mb2));
    free(w1), free(w2), free(b1), free(b2);
    int64_t xs[3] = {sl, b, H}, ys[3] = {s, b, Fl}, x0 = c->sp ? r * sl * b : 0;
    m->x = upload_sub(ctx, c->x, H, x0, sl * b, NULL, H, c->dt, 3, xs);
    m->g = upload_sub(ctx, c->g, H, x0, sl * b, NULL, H, c->dt, 3, xs);
    m->y1 = tu_alloc_poisoned(ctx, c->dt, 3, ys);
    m->h = tu_alloc_poisoned(ctx, c->dt, 3, ys);
    m->dh = tu_alloc_poisoned(ctx, c->dt, 3, ys);
    m->dy1 = tu_alloc_poisoned(ctx, c->dt, 3, ys);
    m->y2 = tu_alloc_poisoned(ctx, c->dt, 3, xs);
    m->dx = tu_alloc_poisoned(ctx, c->dt, 3, xs);
    m->gp = malloc(sizeof(double) * (size_t)(s * b * Fl));
}

static void mlp_teardown(cpar_ctx *ctx, mlp_state *m) {
    cpar_tensor *all[] = {&m->x, &m->y1, &m->h, &m->y2, &m->g, &m->dh, &m->dy1, &m->dx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_linear_destroy(m->col));
    TU_OK(cpar_linear_destroy(m->row));
    free(m->gp);
}

static cpar_status rank_mlp(cpar_ctx *ctx, void *arg) {
    mlp_case *c = arg;
    int n = cpar_world_size(ctx), r = cpar_rank(ctx);
    int64_t b = c->b, H = c->H, F = c->F, Fl = F / n, sl = c->sp ? c->s / n : c->s, T = c->T;
    int64_t x0 = c->sp ? r * sl * b : 0;
    mlp_state m;
    mlp_setup(ctx, c, &m);
    mlp_forward(ctx, c, &m);
    mlp_backward(ctx, c, &m);
    double tol = c->dt == CPAR_F32 ? 1e-5 : c->dt == CPAR_F16 ? 4e-3 : 1e-2;
    int64_t cols[64];
    for (int64_t j = 0; j < Fl; j++) cols[j] = r * Fl + j;
    double *w;
    w = sub(c->y2, H, x0, sl * b, NULL, H, 1.0), expect_tensor(ctx, &m.y2, w, tol, "y2"), free(w);
    w = sub(c->y1, F, 0, T, cols, Fl, 1.0), expect_tensor(ctx, &m.y1, w, tol, "y1"), free(w);
    w = sub(c->dx, H, x0, sl * b, NULL, H, 1.0), expect_tensor(ctx, &m.dx, w, tol, "dx"), free(w);
    cpar_tensor dW1 = cpar_linear_weight_grad(m.col), db1 = cpar_linear_bias_grad(m.col);
    cpar_tensor dW2 = cpar_linear_weight_grad(m.row), db2 = cpar_linear_bias_grad(m.row);
    double *d1 = sub(c->dW1, H, r * Fl, Fl, NULL, H, 1.0), *e1 = sub(c->db1, 1, r * Fl, Fl, NULL, 1, 1.0);
    double *d2 = sub(c->dW2, F, 0, H, cols, Fl, 1.0);
    /* sums over T tokens of dtype-rounded products */
    double gtol = c->dt == CPAR_F32 ? 1e-5 : c->dt == CPAR_F16 ? 8e-3 : 2e-2;
    expect_tensor(ctx, &dW1, d1, gtol, "dW1");
    expect_tensor(ctx, &db1, e1, gtol, "db1");
    expect_tensor(ctx, &dW2, d2, gtol, "dW2");
    expect_tensor(ctx, &db2, c->db2, gtol, "db2");
    free(d1), free(e1), free(d2);
    mlp_teardown(ctx, &m);
    return CPAR_OK;
}

/* _i = ((tp - 1) * 2 + sp) * 3 + dtype index */
static const cpar_dtype mlp_dtypes[3] = {CPAR_F32, CPAR_BF16, CPAR_F16};

START_TEST(test_mlp_matches_reference) {
    int tp = _i / 6 + 1;
    bool sp = (_i / 3) % 2;
    mlp_case c;
    mlp_init(&c, tp, sp, mlp_dtypes[_i % 3], 100 + (uint64_t)_i);
    TU_OK(tu_spawn(tp, rank_mlp, &c));
    mlp_free(&c);
}
END_TEST

/* ---- finite differences (host, F32): L = sum g * y2 ---- */

static double mlp_loss(cpar_ctx *ctx, mlp_case *c, mlp_state *m) {
    mlp_forward(ctx, c, m);
    float *y = tu_download(ctx, &m->y2);
    double L = 0.0;
    for (int64_t i = 0; i < c->T * c->H; i++) L += c->g[i] * y[i];
    free(y);
    return L;
}

static cpar_status rank_fd(cpar_ctx *ctx, void *arg) {
    mlp_case *c = arg;
    int n = cpar_world_size(ctx), r = cpar_rank(ctx);
    mlp_state m;
    mlp_setup(ctx, c, &m);
    mlp_forward(ctx, c, &m);
    mlp_backward(ctx, c, &m);
    float *dx = tu_download(ctx, &m.dx);
    cpar_tensor W1 = cpar_linear_weight(m.col), W2 = cpar_linear_weight(m.row);
    cpar_tensor dW1t = cpar_linear_weight_grad(m.col), dW2t = cpar_linear_weight_grad(m.row);
    float *dW1 = tu_download(ctx, &dW1t), *dW2 = tu_download(ctx, &dW2t);
    const float eps = 1e-2f;
    /* (tensor, index, analytic) probes, the same sequence on every rank */
    for (int probe = 0; probe < 9; probe++) {
        float *p;
        double an;
        int kind = probe % 3;
        int64_t idx = (probe * 37 + 5) % (kind == 0 ? c->T * c->H : kind == 1 ? cpar_tensor_numel(&W1) : cpar_tensor_numel(&W2));
        if (kind == 0) p = (float *)m.x.data + idx, an = dx[idx];
        else if (kind == 1) p = (float *)W1.data + idx, an = dW1[idx];
        else p = (float *)W2.data + idx, an = dW2[idx];
        bool mine = kind == 0 || (probe / 3) % n == r; /* a weight element: one rank perturbs its shard */
        float keep = *p;
        if (mine) *p = keep + eps;
        double Lp = mlp_loss(ctx, c, &m);
        if (mine) *p = keep - eps;
        double Lm = mlp_loss(ctx, c, &m);
        *p = keep;
        double fd = (Lp - Lm) / (2.0 * eps);
        if (mine) ck_assert_msg(fabs(fd - an) <= 2e-3 * (1.0 + fabs(an)), "tp %d rank %d probe %d: fd %.7g, analytic %.7g", n, r,
                      probe, fd, an);
    }
    free(dx), free(dW1), free(dW2);
    mlp_teardown(ctx, &m);
    return CPAR_OK;
}

START_TEST(test_mlp_finite_differences) {
    if (tu_backend() != CPAR_BACKEND_HOST) return; /* host pointers are poked directly */
    mlp_case c;
    mlp_init(&c, _i + 1, false, CPAR_F32, 300 + (uint64_t)_i);
    TU_OK(tu_spawn(_i + 1, rank_fd, &c));
    mlp_free(&c);
}
END_TEST

/* ==== one layer per option ==================================================== */

typedef struct {
    const char *name;
    bool row;
    cpar_linear_config cfg;
} opt_case;

static const opt_case opt_cases[] = {
    {"column", false, {.bias = true}},
    {"column no bias", false, {.bias = false}},
    {"column gather_output", false, {.bias = true, .gather_output = true}},
    {"column skip_bias_add", false, {.bias = true, .skip_bias_add = true}},
    {"column disable_grad_reduce", false, {.bias = true, .disable_grad_reduce = true}},
    {"column frozen", false, {.bias = true, .frozen = true}},
    {"column stride 3", false, {.bias = true, .stride = 3}},
    {"column stride 3 gather_output", false, {.bias = false, .stride = 3, .gather_output = true}},
    {"column sequence_parallel", false, {.bias = true, .sequence_parallel = true}},
    {"column sp disable_grad_reduce", false, {.bias = false, .sequence_parallel = true, .disable_grad_reduce = true}},
    {"column sp gather_output", false, {.bias = true, .sequence_parallel = true, .gather_output = true}},
    {"row", true, {.bias = true, .input_is_parallel = true}},
    {"row no bias", true, {.bias = false, .input_is_parallel = true}},
    {"row input not parallel", true, {.bias = true}},
    {"row skip_bias_add", true, {.bias = true, .input_is_parallel = true, .skip_bias_add = true}},
    {"row frozen", true, {.bias = true, .input_is_parallel = true, .frozen = true}},
    {"row stride 3", true, {.bias = true, .input_is_parallel = true, .stride = 3}},
    {"row sequence_parallel", true, {.bias = true, .input_is_parallel = true, .sequence_parallel = true}},
    {"row sp skip_bias_add frozen", true,
     {.bias = true, .input_is_parallel = true, .sequence_parallel = true, .skip_bias_add = true, .frozen = true}},
};
#define N_OPT (int)(sizeof opt_cases / sizeof opt_cases[0])

typedef struct {
    const opt_case *oc;
    int64_t s, b, K, N, T;
    double *W, *bias, *x, *dy, *y, *dx, *dW, *db;
} layer_case;

static cpar_status rank_opt(cpar_ctx *ctx, void *arg) {
    layer_case *c = arg;
    const opt_case *oc = c->oc;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), r = cpar_group_rank(g);
    cpar_linear_config cfg = oc->cfg;
    cfg.input_size = c->K, cfg.output_size = c->N;
    int stride = cfg.stride ? cfg.stride : 1;
    const bool sp = cfg.sequence_parallel, row = oc->row;
    const int64_t s = c->s, b = c->b, K = c->K, N = c->N, T = c->T;
    cpar_linear *l;
    TU_OK(row ? cpar_row_parallel_linear_create(g, &cfg, &l) : cpar_column_parallel_linear_create(g, &cfg, &l));
    float *mw = tu_to_f32(c->W, N * K), *mb = tu_to_f32(c->bias, N);
    int64_t ws[2] = {N, K};
    cpar_tensor tw = cpar_tensor_make(mw, CPAR_F32, 2, ws, CPAR_HOST), tb = cpar_tensor_make(mb, CPAR_F32, 1, &N, CPAR_HOST);
    TU_OK(cpar_linear_init_from_master(l, &tw, cfg.bias ? &tb : NULL));
    free(mw), free(mb);

    /* local index maps */
    int64_t Nl = row ? N : N / n, Kl = row ? K / n : K;
    int64_t ncols[64], kcols[64], all_n[64];
    for (int64_t i = 0; i < Nl; i++) ncols[i] = row ? i : gidx(i, Nl / stride, r, n);
    for (int64_t j = 0; j < Kl; j++) kcols[j] = row ? gidx(j, Kl / stride, r, n) : j;
    /* gathered output order: rank-major local columns */
    for (int j = 0; j < n && !row; j++)
        for (int64_t i = 0; i < Nl; i++) all_n[j * Nl + i] = gidx(i, Nl / stride, j, n);

    /* x */
    int64_t sx = sp && !row ? s / n : s, x0 = sp && !row ? r * sx * b : 0;
    bool xpar = row && cfg.input_is_parallel;
    int64_t xs[3] = {sx, b, xpar ? Kl : K};
    cpar_tensor x = upload_sub(ctx, c->x, K, x0, sx * b, xpar ? kcols : NULL, xs[2], CPAR_F32, 3, xs);
    /* y: column [s(*), b, Nl or N], row [s or s/n, b, N] */
    bool go = !row && cfg.gather_output;
    int64_t sy = sp && row ? s / n : s, y0 = sp && row ? r * sy * b : 0, ny = go ? N : Nl;
    const int64_t *ymap = go ? all_n : ncols;
    int64_t ys[3] = {sy, b, ny};
    cpar_tensor y = tu_alloc_poisoned(ctx, CPAR_F32, 3, ys);
    cpar_tensor bo = tu_alloc_poisoned(ctx, CPAR_F32, 1, &Nl);
    cpar_tensor dy = upload_sub(ctx, c->dy, N, y0, sy * b, ymap, ny, CPAR_F32, 3, ys);
    cpar_tensor dx = tu_alloc_poisoned(ctx, CPAR_F32, 3, xs);

    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_linear_forward(l, &x, &y, &bo));
    cpar_comm_stats st;
    TU_OK(cpar_group_stats(g, &st));
    const uint64_t es = 4;
    uint64_t want[CPAR_COLL_KIND_COUNT] = {0}, calls[CPAR_COLL_KIND_COUNT] = {0};
    if (n > 1) {
        if (!row && sp) want[CPAR_COLL_ALL_GATHER] += ag_bytes((uint64_t)(sx * b * K) * es, n), calls[CPAR_COLL_ALL_GATHER]++;
        if (go) want[CPAR_COLL_ALL_GATHER] += ag_bytes((uint64_t)(T * Nl) * es, n), calls[CPAR_COLL_ALL_GATHER]++;
        if (row && sp) want[CPAR_COLL_REDUCE_SCATTER] = (uint64_t)(T * N) * es * (uint64_t)(n - 1) / (uint64_t)n, calls[CPAR_COLL_REDUCE_SCATTER]++;
        if (row && !sp) want[CPAR_COLL_ALL_REDUCE] = ar_bytes((uint64_t)(T * N) * es, n), calls[CPAR_COLL_ALL_REDUCE]++;
    }
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++) {
        ck_assert_msg(st.kind[k].calls == calls[k] && st.kind[k].bytes_sent == want[k],
                      "%s tp %d forward %s: %llu calls / %llu bytes sent, expected %llu / %llu", oc->name, n,
                      cpar_coll_kind_name(k), (unsigned long long)st.kind[k].calls,
                      (unsigned long long)st.kind[k].bytes_sent, (unsigned long long)calls[k], (unsigned long long)want[k]);
    }
    /* y = x W^T (+ b unless skip) */
    double *yref = malloc(sizeof(double) * (size_t)(T * N));
    ref_fwd(c->x, c->W, cfg.bias && !cfg.skip_bias_add ? c->bias : NULL, T, K, N, yref);
    double *e = sub(yref, N, y0, sy * b, ymap, ny, 1.0);
    expect_tensor(ctx, &y, e, 1e-5, oc->name), free(e), free(yref);
    if (cfg.bias && cfg.skip_bias_add) {
        e = sub(c->bias, 1, 0, 1, ncols, Nl, 1.0);
        /* bias as [1, Nl] */
        double *be = malloc(sizeof(double) * (size_t)Nl);
        for (int64_t i = 0; i < Nl; i++) be[i] = c->bias[ncols[i]];
        expect_tensor(ctx, &bo, be, 0.0, "bias_out"), free(be), free(e);
    }

    /* backward twice: main grads accumulate */
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_linear_backward(l, &dy, &dx));
    TU_OK(cpar_group_stats(g, &st));
    memset(want, 0, sizeof want), memset(calls, 0, sizeof calls);
    if (n > 1) {
        if (!row && sp) {
            want[CPAR_COLL_ALL_GATHER] = ag_bytes((uint64_t)(sx * b * K) * es, n), calls[CPAR_COLL_ALL_GATHER] = !cfg.frozen;
            if (cfg.frozen) want[CPAR_COLL_ALL_GATHER] = 0;
            want[CPAR_COLL_REDUCE_SCATTER] = (uint64_t)(T * K) * es * (uint64_t)(n - 1) / (uint64_t)n, calls[CPAR_COLL_REDUCE_SCATTER] = 1;
        }
        if (!row && !sp && !cfg.disable_grad_reduce) want[CPAR_COLL_ALL_REDUCE] = ar_bytes((uint64_t)(T * K) * es, n), calls[CPAR_COLL_ALL_REDUCE] = 1;
        if (row && sp) want[CPAR_COLL_ALL_GATHER] = ag_bytes((uint64_t)(sy * b * N) * es, n), calls[CPAR_COLL_ALL_GATHER]++;
        if (row && !xpar) want[CPAR_COLL_ALL_GATHER] += ag_bytes((uint64_t)(T * Kl) * es, n), calls[CPAR_COLL_ALL_GATHER]++;
    }
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++)
        ck_assert_msg(st.kind[k].calls == calls[k] && st.kind[k].bytes_sent == want[k],
                      "%s tp %d backward %s: %llu calls / %llu bytes sent, expected %llu / %llu", oc->name, n,
                      cpar_coll_kind_name(k), (unsigned long long)st.kind[k].calls,
                      (unsigned long long)st.kind[k].bytes_sent, (unsigned long long)calls[k], (unsigned long long)want[k]);
    /* dx */
    bool partial = !row && !sp && cfg.disable_grad_reduce && n > 1;
    bool mask[256];
    for (int64_t o = 0; o < N; o++) mask[o] = !partial;
    for (int64_t i = 0; i < Nl && partial; i++) mask[ncols[i]] = true;
    double *dxref = malloc(sizeof(double) * (size_t)(T * K));
    ref_dgrad(c->dy, c->W, T, K, N, mask, dxref);
    e = sub(dxref, K, x0, sx * b, xpar ? kcols : NULL, xs[2], 1.0);
    expect_tensor(ctx, &dx, e, 1e-5, "dx"), free(e), free(dxref);

    TU_OK(cpar_linear_backward(l, &dy, NULL)); /* no dgrad: grads only */
    cpar_tensor dW = cpar_linear_weight_grad(l), db = cpar_linear_bias_grad(l);
    ck_assert(cfg.frozen ? dW.data == NULL : dW.data != NULL);
    ck_assert(cfg.bias && !cfg.frozen ? db.data != NULL : db.data == NULL); /* frozen: no bias grad either */
    for (int pass = 0; pass < 2; pass++) {
        double scale = pass ? 1.0 : 2.0;
        if (dW.data) {
            double *we = malloc(sizeof(double) * (size_t)(Nl * Kl));
            for (int64_t i = 0; i < Nl; i++)
                for (int64_t j = 0; j < Kl; j++) we[i * Kl + j] = scale * c->dW[ncols[i] * K + kcols[j]];
            expect_tensor(ctx, &dW, we, 1e-5, "dW"), free(we);
        }
        if (db.data) {
            double *be = malloc(sizeof(double) * (size_t)Nl);
            for (int64_t i = 0; i < Nl; i++) be[i] = scale * c->db[ncols[i]];
            expect_tensor(ctx, &db, be, 1e-5, "db"), free(be);
        }
        if (!pass) { /* zero_grad, then one more backward gives 1x */
            TU_OK(cpar_linear_zero_grad(l));
            if (dW.data) {
                double *z = calloc((size_t)(Nl * Kl), sizeof(double));
                expect_tensor(ctx, &dW, z, 0.0, "dW after zero_grad"), free(z);
            }
            TU_OK(cpar_linear_backward(l, &dy, NULL));
        }
    }
    cpar_tensor *all[] = {&x, &y, &bo, &dy, &dx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_linear_destroy(l));
    return CPAR_OK;
}

/* _i = option; every tp 1..4 */
START_TEST(test_options) {
    layer_case c = {.oc = &opt_cases[_i], .s = 12, .b = 2, .K = 36, .N = 36};
    c.T = c.s * c.b;
    c.W = random_doubles(c.N * c.K, 1.0 / 6.0, 500 + (uint64_t)_i);
    c.bias = random_doubles(c.N, 0.5, 600 + (uint64_t)_i);
    double *xx = random_doubles(c.T * c.K, 1.0, 700 + (uint64_t)_i), *dd = random_doubles(c.T * c.N, 1.0, 800 + (uint64_t)_i);
    c.x = rounded(xx, c.T * c.K, CPAR_F32), c.dy = rounded(dd, c.T * c.N, CPAR_F32);
    double *W = rounded(c.W, c.N * c.K, CPAR_F32), *bb = rounded(c.bias, c.N, CPAR_F32);
    free(c.W), free(c.bias), free(xx), free(dd);
    c.W = W, c.bias = bb;
    c.dW = malloc(sizeof(double) * (size_t)(c.N * c.K)), c.db = malloc(sizeof(double) * (size_t)c.N);
    ref_wgrad(c.dy, c.x, c.T, c.K, c.N, c.dW, c.db);
    for (int tp = 1; tp <= MAX_TP; tp++) TU_OK(tu_spawn(tp, rank_opt, &c));
    free(c.W), free(c.bias), free(c.x), free(c.dy), free(c.dW), free(c.db);
}
END_TEST

/* ==== init_random ============================================================ */

typedef struct {
    float *w[MAX_TP];
} rand_case;

static cpar_status rank_random(cpar_ctx *ctx, void *arg) {
    rand_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int r = cpar_group_rank(g);
    cpar_linear_config cfg = {.input_size = 16, .output_size = 8 * cpar_group_size(g), .bias = true};
    cpar_linear *l;
    TU_OK(cpar_column_parallel_linear_create(g, &cfg, &l));
    TU_FAILS(cpar_linear_init_random(l, 0.02f), CPAR_ERR_INVALID, "cpar_model_parallel_manual_seed");
    TU_OK(cpar_model_parallel_manual_seed(ctx, 1234, r, -1, -1));
    cpar_rng_state before, after;
    TU_OK(cpar_rng_get_state(ctx, NULL, &before));
    TU_OK(cpar_linear_init_random(l, 0.02f));
    TU_OK(cpar_rng_get_state(ctx, NULL, &after));
    ck_assert(before.seed == after.seed && before.offset == after.offset); /* drawn under the fork only */
    cpar_tensor w = cpar_linear_weight(l), bias = cpar_linear_bias(l);
    float *w1 = tu_download(ctx, &w), *b1 = tu_download(ctx, &bias);
    for (int64_t i = 0; i < 8; i++) ck_assert(b1[i] == 0.f);
    /* the same draws as a manual fork of the model-parallel state */
    TU_OK(cpar_model_parallel_manual_seed(ctx, 1234, r, -1, -1));
    cpar_tensor t;
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 2, w.shape, &t));
    TU_OK(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
    TU_OK(cpar_rng_normal(ctx, &t, 0.f, 0.02f));
    TU_OK(cpar_rng_unfork(ctx));
    float *w2 = tu_download(ctx, &t);
    TU_EXPECT_SAME(w1, w2, CPAR_F32, 8 * 16);
    /* reproducible */
    TU_OK(cpar_model_parallel_manual_seed(ctx, 1234, r, -1, -1));
    TU_OK(cpar_linear_init_random(l, 0.02f));
    float *w3 = tu_download(ctx, &w);
    TU_EXPECT_SAME(w1, w3, CPAR_F32, 8 * 16);
    double ss = 0;
    for (int i = 0; i < 128; i++) ss += (double)w1[i] * w1[i];
    ck_assert_msg(sqrt(ss / 128) > 0.01 && sqrt(ss / 128) < 0.04, "std %g", sqrt(ss / 128));
    c->w[r] = w1;
    free(b1), free(w2), free(w3);
    TU_OK(cpar_tensor_free(ctx, &t));
    TU_OK(cpar_linear_destroy(l));
    return CPAR_OK;
}

START_TEST(test_init_random) {
    rand_case c = {{0}};
    int tp = _i + 1;
    TU_OK(tu_spawn(tp, rank_random, &c));
    for (int r = 1; r < tp; r++) /* each TP rank draws from its own state */
        ck_assert_msg(memcmp(c.w[0], c.w[r], 8 * 16 * sizeof(float)) != 0, "rank %d drew rank 0's weights", r);
    for (int r = 0; r < tp; r++) free(c.w[r]);
}
END_TEST

/* ==== bad arguments ========================================================= */

static cpar_status rank_bad(cpar_ctx *ctx, void *arg) {
    (void)arg;
    cpar_group *g = cpar_world_group(ctx);
    cpar_linear *l = NULL;
    cpar_linear_config cfg = {.input_size = 16, .output_size = 8, .bias = true};
    TU_FAILS(cpar_column_parallel_linear_create(NULL, &cfg, &l), CPAR_ERR_INVALID, "group");
    TU_FAILS(cpar_column_parallel_linear_create(g, NULL, &l), CPAR_ERR_INVALID, "cfg");
    TU_FAILS(cpar_column_parallel_linear_create(g, &cfg, NULL), CPAR_ERR_INVALID, "out");
    cpar_linear_config bad = cfg;
    bad.output_size = 9;
    TU_FAILS(cpar_column_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID, "output_size 9 is not divisible by tp*stride = 2 (tp=2");
    bad = cfg, bad.stride = 3, bad.output_size = 8;
    TU_FAILS(cpar_column_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID, "tp*stride = 6");
    bad = cfg, bad.input_size = 15;
    TU_FAILS(cpar_row_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID, "input_size 15");
    bad = cfg, bad.sequence_parallel = true;
    TU_FAILS(cpar_row_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID, "input_is_parallel");
    bad = cfg, bad.dtype = CPAR_I32;
    TU_FAILS(cpar_column_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID, "dtype");
    bad = cfg, bad.input_size = 0;
    TU_FAILS(cpar_column_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID, "input_size");
    ck_assert_ptr_null(l);

    cpar_linear_config rc = {.input_size = 16, .output_size = 8, .bias = true, .input_is_parallel = true,
                             .skip_bias_add = true};
    TU_OK(cpar_row_parallel_linear_create(g, &rc, &l));
    int64_t xs[3] = {6, 2, 16}, xg[3] = {6, 2, 8}, ys[3] = {6, 2, 8}, yb[3] = {6, 2, 4}, bs[1] = {8};
    cpar_tensor xw = tu_alloc_poisoned(ctx, CPAR_F32, 3, xs), x = tu_alloc_poisoned(ctx, CPAR_F32, 3, xg);
    cpar_tensor x16 = tu_alloc_poisoned(ctx, CPAR_BF16, 3, xg);
    cpar_tensor y = tu_alloc_poisoned(ctx, CPAR_F32, 3, ys), yw = tu_alloc_poisoned(ctx, CPAR_F32, 3, yb);
    cpar_tensor bo = tu_alloc_poisoned(ctx, CPAR_F32, 1, bs);
    TU_OK(cpar_fill(ctx, &x, 0.5));
    TU_FAILS(cpar_linear_forward(l, &xw, &y, &bo), CPAR_ERR_INVALID,
             "cpar_linear_forward: x has shape [6,2,16], expected [*,*,8] (input_size/tp with tp=2)");
    TU_FAILS(cpar_linear_forward(l, &x, &yw, &bo), CPAR_ERR_INVALID, "y has shape [6,2,4], expected [6,2,8]");
    TU_FAILS(cpar_linear_forward(l, NULL, &y, &bo), CPAR_ERR_INVALID, "x is NULL");
    TU_FAILS(cpar_linear_forward(l, &x, NULL, &bo), CPAR_ERR_INVALID, "y is NULL");
    TU_FAILS(cpar_linear_forward(l, &x, &y, NULL), CPAR_ERR_INVALID, "bias_out is NULL");
    TU_FAILS(cpar_linear_forward(NULL, &x, &y, &bo), CPAR_ERR_INVALID, "l is NULL");
    TU_FAILS(cpar_linear_forward(l, &x16, &y, &bo), CPAR_ERR_INVALID, "x has dtype bf16, expected f32");
    TU_FAILS(cpar_linear_backward(l, &y, &x), CPAR_ERR_INVALID, "call cpar_linear_forward first");
    TU_OK(cpar_linear_forward(l, &x, &y, &bo));
    TU_FAILS(cpar_linear_backward(l, &yw, NULL), CPAR_ERR_INVALID, "dy has shape [6,2,4]");
    TU_FAILS(cpar_linear_backward(l, &y, &xw), CPAR_ERR_INVALID, "dx has shape [6,2,16]");
    TU_FAILS(cpar_linear_backward(l, &y, &x), CPAR_ERR_INVALID, "dx overlaps forward's x");
    float mw[8 * 16] = {0};
    int64_t mws[2] = {16, 8};
    cpar_tensor m = cpar_tensor_make(mw, CPAR_F32, 2, mws, CPAR_HOST);
    TU_FAILS(cpar_linear_init_from_master(l, &m, NULL), CPAR_ERR_INVALID, "master_weight has shape [16,8], expected [8,16]");
    if (cpar_device(ctx) != CPAR_HOST)
        TU_FAILS(cpar_linear_init_from_master(l, &x, NULL), CPAR_ERR_INVALID, "master_weight is on device");
    TU_OK(cpar_linear_destroy(l));

    /* column: x's feature dim is input_size; SP rows */
    cpar_linear_config cc = {.input_size = 8, .output_size = 8, .sequence_parallel = true};
    TU_OK(cpar_column_parallel_linear_create(g, &cc, &l));
    TU_FAILS(cpar_linear_forward(l, &xw, &y, NULL), CPAR_ERR_INVALID, "expected [*,*,8] (input_size with tp=2)");
    int64_t ysp[3] = {12, 2, 4};
    cpar_tensor ysp_t = tu_alloc_poisoned(ctx, CPAR_F32, 3, ysp);
    TU_FAILS(cpar_linear_forward(l, &x, &y, NULL), CPAR_ERR_INVALID, "expected [12,2,4]");
    TU_OK(cpar_linear_forward(l, &x, &ysp_t, NULL));
    TU_OK(cpar_linear_destroy(l));
    cpar_tensor *all[] = {&xw, &x, &x16, &y, &yw, &bo, &ysp_t};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    return CPAR_OK;
}

/* _i: 0 sequence parallel, 1 all-reduce of dx; tp 2 */
static cpar_status rank_overlap(cpar_ctx *ctx, void *arg) {
    const bool sp = *(const int *)arg == 0;
    cpar_group *g = cpar_world_group(ctx);
    const int n = cpar_group_size(g), r = cpar_group_rank(g);
    const int64_t s = 8, b = 2, K = 24, N = 16, Nl = N / n, T = s * b, sx = sp ? s / n : s, Tx = sx * b;
    cpar_linear_config cfg = {.input_size = K, .output_size = N, .dtype = CPAR_F32, .bias = true,
                              .sequence_parallel = sp};
    cpar_linear *l;
    TU_OK(cpar_column_parallel_linear_create(g, &cfg, &l));
    double *Wd = random_doubles(N * K, 0.2, 901), *xd = random_doubles(T * K, 1.0, 902);
    double *dyd = random_doubles(T * N, 1.0, 903);
    for (int64_t i = 0; i < N * K; i++) Wd[i] = (float)Wd[i];
    for (int64_t i = 0; i < T * K; i++) xd[i] = (float)xd[i];
    for (int64_t i = 0; i < T * N; i++) dyd[i] = (float)dyd[i];
    float *Wf = tu_to_f32(Wd, N * K);
    int64_t ws[2] = {N, K};
    cpar_tensor mw = cpar_tensor_make(Wf, CPAR_F32, 2, ws, CPAR_HOST);
    TU_OK(cpar_linear_init_from_master(l, &mw, NULL));
    int64_t xs[3] = {sx, b, K}, ys[3] = {s, b, Nl};
    int64_t ncols[16];
    for (int64_t i = 0; i < Nl; i++) ncols[i] = r * Nl + i;
    cpar_tensor x = upload_sub(ctx, xd, K, sp ? r * Tx : 0, Tx, NULL, K, CPAR_F32, 3, xs);
    cpar_tensor dy = upload_sub(ctx, dyd, N, 0, T, ncols, Nl, CPAR_F32, 3, ys);
    cpar_tensor y = tu_alloc_poisoned(ctx, CPAR_F32, 3, ys), dx = tu_alloc_poisoned(ctx, CPAR_F32, 3, xs);
    TU_OK(cpar_linear_forward(l, &x, &y, NULL));

    /* backward with dx: exactly the sequential order's collectives */
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_linear_backward(l, &dy, &dx));
    cpar_comm_stats st;
    TU_OK(cpar_group_stats(g, &st));
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++) {
        uint64_t want = k == CPAR_COLL_ALL_GATHER ? (uint64_t)sp
                        : k == CPAR_COLL_REDUCE_SCATTER ? (uint64_t)sp
                        : k == CPAR_COLL_ALL_REDUCE ? (uint64_t)!sp : 0;
        ck_assert_msg(st.kind[k].calls == want, "overlap %s: %s called %llu times, expected %llu", sp ? "sp" : "ar",
                      cpar_coll_kind_name(k), (unsigned long long)st.kind[k].calls, (unsigned long long)want);
    }
    /* against the fp64 reference */
    double *dxref = malloc(sizeof(double) * (size_t)(T * K)), *dwref = calloc((size_t)(N * K), sizeof(double));
    bool mask[16];
    for (int i = 0; i < 16; i++) mask[i] = true;
    ref_dgrad(dyd, Wd, T, K, N, mask, dxref);
    for (int64_t t = 0; t < T; t++)
        for (int64_t o = 0; o < N; o++)
            for (int64_t k = 0; k < K; k++) dwref[o * K + k] += dyd[t * N + o] * xd[t * K + k];
    expect_tensor(ctx, &dx, dxref + (sp ? r * Tx * K : 0), 1e-5, "overlap dx");
    cpar_tensor dW = cpar_linear_weight_grad(l), db = cpar_linear_bias_grad(l);
    expect_tensor(ctx, &dW, dwref + r * Nl * K, 1e-5, "overlap dW");
    float *dx1 = tu_download(ctx, &dx), *dw1 = tu_download(ctx, &dW), *db1 = tu_download(ctx, &db);

    /* the public collectives still run on compute, in order with it */
    int64_t one = 4;
    cpar_tensor v;
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 1, &one, &v));
    TU_OK(cpar_fill(ctx, &v, (double)(r + 1)));
    TU_OK(cpar_all_reduce(g, &v, &v, CPAR_SUM));
    TU_OK(cpar_axpby(ctx, 1.f, &v, 1.f, &v)); /* compute, after the collective */
    TU_OK(cpar_sync(ctx));
    double vwant[4];
    for (int i = 0; i < 4; i++) vwant[i] = 2.0 * n * (n + 1) / 2;
    expect_tensor(ctx, &v, vwant, 0.0, "all_reduce after backward");

    /* again, from zero grads: bit-identical (events re-recorded) */
    TU_OK(cpar_linear_zero_grad(l));
    TU_OK(cpar_linear_backward(l, &dy, &dx));
    float *dx2 = tu_download(ctx, &dx), *dw2 = tu_download(ctx, &dW), *db2 = tu_download(ctx, &db);
    ck_assert(!memcmp(dx1, dx2, (size_t)(Tx * K) * 4) && !memcmp(dw1, dw2, (size_t)(Nl * K) * 4) &&
              !memcmp(db1, db2, (size_t)Nl * 4));

    if (tu_on_device()) {
        /* the sequential order, recomputed with the same GEMM on compute-ordered
         * calls: gather x, dgrad, reduce dgrad, wgrad into zeros */
        cpar_dev_blas h;
        TU_OK(cpar_dev_blas_create(&h));
        int64_t gs[3] = {s, b, K}, wsz[2] = {Nl, K};
        cpar_tensor xg, dX, dWs, dxs;
        TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 3, gs, &xg));
        TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 3, gs, &dX));
        TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 2, wsz, &dWs));
        TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 3, xs, &dxs));
        TU_OK(cpar_fill(ctx, &dWs, 0.0));
        if (sp) TU_OK(cpar_all_gather(g, &x, &xg, NULL));
        else TU_OK(cpar_tensor_copy(ctx, &x, &xg));
        cpar_tensor w = cpar_linear_weight(l);
        /* The GEMMs go on the legacy stream, which cpar's (non-blocking)
         * streams are not ordered with: what cpar queued first, the GEMM's
         * result before cpar (or a peer) reads it. */
        TU_OK(cpar_sync(ctx));
        TU_OK(cpar_dev_gemm(h, NULL, 0, 0, (int)K, (int)T, (int)Nl, 1.f, w.data, CPAR_F32, (int)K, 0, dy.data,
                            (int)Nl, 0, 0.f, dX.data, CPAR_F32, (int)K, 0, 1));
        TU_OK(cpar_dev_sync());
        if (sp) TU_OK(cpar_reduce_scatter(g, &dX, &dxs, CPAR_SUM, NULL));
        else {
            TU_OK(cpar_all_reduce(g, &dX, &dX, CPAR_SUM));
            TU_OK(cpar_tensor_copy(ctx, &dX, &dxs));
        }
        TU_OK(cpar_sync(ctx));
        TU_OK(cpar_dev_gemm(h, NULL, 0, 1, (int)K, (int)Nl, (int)T, 1.f, xg.data, CPAR_F32, (int)K, 0, dy.data,
                            (int)Nl, 0, 1.f, dWs.data, CPAR_F32, (int)K, 0, 1));
        TU_OK(cpar_dev_sync());
        float *dx3 = tu_download(ctx, &dxs), *dw3 = tu_download(ctx, &dWs);
        ck_assert_msg(!memcmp(dx1, dx3, (size_t)(Tx * K) * 4), "overlap dx differs from the sequential order");
        ck_assert_msg(!memcmp(dw1, dw3, (size_t)(Nl * K) * 4), "overlap dW differs from the sequential order");
        free(dx3), free(dw3);
        cpar_tensor *tmp[] = {&xg, &dX, &dWs, &dxs};
        for (size_t i = 0; i < 4; i++) TU_OK(cpar_tensor_free(ctx, tmp[i]));
        TU_OK(cpar_dev_blas_destroy(h));
    }

    /* no dx: the gather alone (SP), nothing without SP. The input doubles
     * between forward and backward, so the weight gradient doubles only if
     * the wgrad GEMM reads backward's own gather of it (on comm) and not the
     * forward's bytes left in the same workspace. */
    TU_OK(cpar_linear_forward(l, &x, &y, NULL));
    TU_OK(cpar_axpby(ctx, 1.f, &x, 1.f, &x));
    TU_OK(cpar_linear_zero_grad(l));
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_linear_backward(l, &dy, NULL));
    TU_OK(cpar_group_stats(g, &st));
    ck_assert(st.kind[CPAR_COLL_ALL_GATHER].calls == (uint64_t)sp && st.kind[CPAR_COLL_REDUCE_SCATTER].calls == 0 &&
              st.kind[CPAR_COLL_ALL_REDUCE].calls == 0);
    for (int64_t i = 0; i < N * K; i++) dwref[i] *= 2;
    expect_tensor(ctx, &dW, dwref + r * Nl * K, 1e-5, "overlap dW without dx, doubled input");

    free(dx1), free(dw1), free(db1), free(dx2), free(dw2), free(db2);
    free(Wd), free(xd), free(dyd), free(Wf), free(dxref), free(dwref);
    cpar_tensor *all[] = {&x, &dy, &y, &dx, &v};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_linear_destroy(l));
    return CPAR_OK;
}

START_TEST(test_backward_overlap) {
    int v = _i;
    TU_OK(tu_spawn(2, rank_overlap, &v));
}
END_TEST

START_TEST(test_bad_args) { TU_OK(tu_spawn(2, rank_bad, NULL)); }
END_TEST

/* ==== the GEMM's blocking ======================================================
 * One rank, shapes that cross every blocking boundary of the host GEMM
 * (cpar.c §5: MC 144, KC 256, NC 3072, micro-tiles 16 x 6 or 8 x 4) and of
 * cuBLAS on devices: K = 300 (> KC, not a multiple of anything), N = 37 (edge
 * micro-tiles), T = 3100 tokens (> NC in the forward; > KC as the wgrad's
 * depth). Forward, dgrad, wgrad and the bias gradient against fp64. */

/* Live threads of this process named "cpar-gemm" (the pool's workers). */
static int count_workers(void) {
    DIR *d = opendir("/proc/self/task");
    ck_assert_ptr_nonnull(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char path[300], comm[32] = "", stat[256] = "";
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue; /* gone meanwhile */
        if (!fgets(comm, sizeof comm, f)) comm[0] = 0;
        fclose(f);
        snprintf(path, sizeof path, "/proc/self/task/%s/stat", e->d_name);
        f = fopen(path, "r");
        if (!f) continue;
        if (!fgets(stat, sizeof stat, f)) stat[0] = 0;
        fclose(f);
        const char *st = strrchr(stat, ')'); /* "tid (comm) S ...": S is the state */
        n += !strcmp(comm, "cpar-gemm\n") && st && st[1] == ' ' && st[2] != 'Z' && st[2] != 'X';
    }
    closedir(d);
    return n;
}

typedef struct {
    cpar_dtype dt;
    int k, n, t;  /* the layer's K, N and tokens; 0: 300, 37, 3100 */
    int threads;  /* 0: gemm_blocking (nothing kept); else CPAR_HOST_THREADS, and: */
    void *out[4]; /* y, dx, dW, db as downloaded */
    size_t bytes[4];
    int made;     /* worker threads after the forward */
} blocking_case;

/* A forked child runs the forward of layer l again into a poisoned y2: the
 * same bits as y (bytes of them) with threads - 1 workers of its own. */
static void expect_forked_forward(cpar_ctx *ctx, cpar_linear *l, const cpar_tensor *x, const cpar_tensor *y, size_t bytes,
                                  int threads) {
    fflush(NULL);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        cpar_tensor y2 = tu_alloc_poisoned(ctx, y->dtype, y->ndim, y->shape);
        bool ok = cpar_linear_forward(l, x, &y2, NULL) == CPAR_OK && !memcmp(y2.data, y->data, bytes) &&
                  count_workers() == threads - 1;
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "CPAR_HOST_THREADS=%d: a forked child's forward failed, differed or had the wrong threads", threads);
}

static cpar_status rank_blocking(cpar_ctx *ctx, void *arg) {
    blocking_case *c = arg;
    const cpar_dtype dt = c->dt;
    const int K = c->k ? c->k : 300, N = c->n ? c->n : 37, T = c->t ? c->t : 3100;
    cpar_linear_config cfg = {.input_size = K, .output_size = N, .dtype = dt, .bias = true};
    cpar_linear *l;
    TU_OK(cpar_column_parallel_linear_create(cpar_world_group(ctx), &cfg, &l));
    double *W = random_rounded(N * K, 1.0, 71, dt), *bias = random_rounded(N, 1.0, 72, dt);
    double *X = random_rounded(T * K, 1.0, 73, dt), *dY = random_rounded(T * N, 1.0, 74, dt);
    float *mw = tu_to_f32(W, N * K), *mb = tu_to_f32(bias, N);
    int64_t ws[2] = {N, K}, nb = N, xs[3] = {T, 1, K}, ys[3] = {T, 1, N};
    cpar_tensor tw = cpar_tensor_make(mw, CPAR_F32, 2, ws, CPAR_HOST), tb = cpar_tensor_make(mb, CPAR_F32, 1, &nb, CPAR_HOST);
    TU_OK(cpar_linear_init_from_master(l, &tw, &tb));
    cpar_tensor x = upload_sub(ctx, X, K, 0, T, NULL, K, dt, 3, xs), dy = upload_sub(ctx, dY, N, 0, T, NULL, N, dt, 3, ys);
    cpar_tensor y = tu_alloc_poisoned(ctx, dt, 3, ys), dx = tu_alloc_poisoned(ctx, dt, 3, xs);
    TU_OK(cpar_linear_zero_grad(l));
    if (c->threads) ck_assert_int_eq(count_workers(), 0); /* the pool is made at the first big product */
    TU_OK(cpar_linear_forward(l, &x, &y, NULL));
    c->made = count_workers();
    TU_OK(cpar_linear_backward(l, &dy, &dx));
    double *yref = malloc(sizeof(double) * T * N), *dxref = malloc(sizeof(double) * T * K);
    double *dwref = malloc(sizeof(double) * N * K), *dbref = malloc(sizeof(double) * N);
    ref_fwd(X, W, bias, T, K, N, yref);
    ref_dgrad(dY, W, T, K, N, NULL, dxref);
    ref_wgrad(dY, X, T, K, N, dwref, dbref);
    /* An fp32 sum of `depth` products of values in [-1, 1] drifts by about
     * eps * depth / 3 in absolute terms (its partial sums grow as sqrt(depth)
     * and so does the number of roundings); a wrong blocking errs by O(1). */
    const double y_tol = tu_tol(dt) + 6e-8 * K, dx_tol = tu_tol(dt) + 6e-8 * N, dw_tol = 6e-8 * T;
    expect_tensor(ctx, &y, yref, y_tol, "blocking: y");
    expect_tensor(ctx, &dx, dxref, dx_tol, "blocking: dx");
    cpar_tensor gw = cpar_linear_weight_grad(l), gb = cpar_linear_bias_grad(l);
    expect_tensor(ctx, &gw, dwref, dw_tol, "blocking: dW (fp32 main grad)");
    expect_tensor(ctx, &gb, dbref, dw_tol, "blocking: db");
    const cpar_tensor *outs[4] = {&y, &dx, &gw, &gb};
    for (int i = 0; i < 4 && c->threads; i++) c->out[i] = tu_download(ctx, outs[i]), c->bytes[i] = cpar_tensor_nbytes(outs[i]);
    if (c->threads > 1 && !tu_on_device()) /* the context's pool is its parent's: the child makes its own */
        expect_forked_forward(ctx, l, &x, &y, c->bytes[0], c->threads);
    cpar_tensor *ts[] = {&x, &dy, &y, &dx};
    for (int i = 0; i < 4; i++) TU_OK(cpar_tensor_free(ctx, ts[i]));
    TU_OK(cpar_linear_destroy(l));
    free(W), free(bias), free(X), free(dY), free(mw), free(mb), free(yref), free(dxref), free(dwref), free(dbref);
    return CPAR_OK;
}

/* Whether contexts take CPAR_HOST_GEMM=name here: CPAR_OK, or
 * CPAR_ERR_UNSUPPORTED (a kernel this CPU or build lacks, the message naming
 * it, checked). Leaves the variable set. */
static cpar_status probe_kernel(const char *name) {
    setenv("CPAR_HOST_GEMM", name, 1);
    cpar_init_config cfg = {.backend = tu_backend(), .timeout_ms = TU_TIMEOUT_MS};
    cpar_status st = cpar_spawn_with(1, &cfg, tu_rank_nothing, NULL);
    ck_assert_msg(st == CPAR_OK || (st == CPAR_ERR_UNSUPPORTED && strstr(cpar_thread_last_error(), "CPAR_HOST_GEMM") &&
                                    strstr(cpar_thread_last_error(), "has no")),
                  "CPAR_HOST_GEMM=%s: status %d, \"%s\"", name, st, cpar_thread_last_error());
    return st;
}

START_TEST(test_gemm_blocking) {
    /* F32 twice: the default path (a CBLAS when the build has one) and cpar's
     * own kernel (CPAR_HOST_GEMM=builtin, read when the context is made);
     * then each micro-kernel forced on the same inputs: the AMX, AVX512-BF16
     * and AVX2 ones on BF16, AVX-512 on F32 and F16, the portable C one on F32 and BF16 (a CPU
     * without one says so and skips it); last, AMX and AVX512-BF16 on K of
     * whole k tiles, where AMX reads x where it lies (the tokens' last
     * partial sliver packed): K 320 and 1088 (one block of k: y rounded
     * from each tile; AVX512-BF16: two, 1024 + 64), and AMX at K 4160,
     * above CPAR__GEMM_KC_WHOLE: five blocks into an fp32 copy of y */
    static const cpar_dtype dts[] = {CPAR_F32, CPAR_F32, CPAR_BF16, CPAR_F16, CPAR_BF16, CPAR_BF16, CPAR_BF16, CPAR_F32,
                                     CPAR_BF16, CPAR_F32, CPAR_F16, CPAR_BF16, CPAR_BF16, CPAR_BF16, CPAR_BF16};
    static const char *const force[] = {NULL, "builtin", NULL, NULL, "amx", "avx512bf16", "avx2", "c", "c",
                                        "avx512", "avx512", "amx", "amx", "avx512bf16", "amx"};
    static const int ks[] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 320, 1088, 1088, 4160};
    if (force[_i] && probe_kernel(force[_i]) != CPAR_OK) { /* this forked test's own environment */
        printf("gemm_blocking: CPAR_HOST_GEMM=%s skipped: %s\n", force[_i], cpar_thread_last_error());
        return;
    }
    blocking_case c = {.dt = dts[_i], .k = ks[_i], .n = ks[_i] ? 45 : 0, .t = ks[_i] ? 200 : 0};
    TU_OK(tu_spawn(1, rank_blocking, &c));
}
END_TEST

/* A bf16 y is its fp32 sums rounded once to nearest even, whichever
 * kernel and whether rounded from each micro-tile (AMX, one block of k) or
 * from an fp32 copy: integer data whose every sum is exact in fp32 (x in
 * {-1, 0, 1}, W integers in [-255, 255], |y| < 2^17) make each element of y
 * exactly cpar_f32_to_bf16 of the exact sum, bit for bit, and many of them
 * ties. _i: the kernel forced (default, amx, avx512bf16, c) and K (320:
 * whole k tiles, 300: not, 1088: one block of k for AMX, deeper than 1024;
 * 1100: not whole tiles, two blocks; 4160: above CPAR__GEMM_KC_WHOLE,
 * five blocks), N 45 and 200 tokens;
 * then N 1088 and 1100 tokens at K 480, where AMX packs op(A) 512 rows at a
 * time (x, 1 MB, outgrows half of L2: panels of 512, 512 and 64 rows) and
 * stores y (2.3 MB, above CPAR__GEMM_STREAM_BYTES) past the caches, and
 * N 352 at K 320: panels of 256 and 96 rows, the tokens' last 8 an edge
 * tile; last, the 1088 x 1100 case with CPAR_HOST_THREADS=2: each of the
 * pool's two chunks of y (1.1 and 1.2 MB, claimed by whichever thread is
 * free) is still stored past the caches and ends in its own sfence. */
typedef struct {
    int k, n, t;
} exact_case;

static uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static cpar_status rank_round_exact(cpar_ctx *ctx, void *arg) {
    const exact_case *c = arg;
    const int K = c->k, N = c->n, T = c->t;
    cpar_linear_config cfg = {.input_size = K, .output_size = N, .dtype = CPAR_BF16};
    cpar_linear *l;
    TU_OK(cpar_column_parallel_linear_create(cpar_world_group(ctx), &cfg, &l));
    float *w = malloc(sizeof(float) * (size_t)(N * K));
    double *x = malloc(sizeof(double) * (size_t)(T * K));
    uint64_t r = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < N * K; i++) r = r * 6364136223846793005ull + 1442695040888963407ull, w[i] = (float)((int)(r >> 33) % 256);
    for (int i = 0; i < T * K; i++) r = r * 6364136223846793005ull + 1442695040888963407ull, x[i] = (double)((int)(r >> 33) % 3 - 1);
    int64_t ws[2] = {N, K}, xs[2] = {T, K}, ys[2] = {T, N};
    cpar_tensor tw = cpar_tensor_make(w, CPAR_F32, 2, ws, CPAR_HOST);
    TU_OK(cpar_linear_init_from_master(l, &tw, NULL));
    cpar_tensor tx = upload_sub(ctx, x, K, 0, T, NULL, K, CPAR_BF16, 2, xs), y = tu_alloc_poisoned(ctx, CPAR_BF16, 2, ys);
    TU_OK(cpar_linear_forward(l, &tx, &y, NULL));
    uint16_t *hy = tu_download(ctx, &y);
    int ties = 0;
    for (int t = 0; t < T; t++)
        for (int n = 0; n < N; n++) {
            double e = 0;
            for (int k = 0; k < K; k++) e += x[t * K + k] * w[n * K + k];
            const uint16_t want = cpar_f32_to_bf16((float)e);
            ties += ((uint32_t)float_bits((float)e) & 0xffffu) == 0x8000u;
            ck_assert_msg(hy[t * N + n] == want, "K %d: y[%d, %d] = 0x%04x, expected 0x%04x (%.0f rounded to nearest even)", K,
                          t, n, hy[t * N + n], want, e);
        }
    ck_assert_msg(ties > 100, "K %d: only %d ties in y: the data no longer test the rounding", K, ties);
    free(hy), free(w), free(x);
    TU_OK(cpar_tensor_free(ctx, &tx));
    TU_OK(cpar_tensor_free(ctx, &y));
    return cpar_linear_destroy(l);
}

START_TEST(test_gemm_round_exact) {
    static const char *const force[] = {NULL, "amx", "amx", "amx", "avx512bf16", "c", "amx", "amx", "amx", "amx", "amx"};
    static const int ks[] = {320, 320, 300, 1088, 320, 320, 480, 320, 1100, 4160, 480};
    static const int ns[] = {45, 45, 45, 45, 45, 45, 1088, 352, 45, 45, 1088};
    if (force[_i] && probe_kernel(force[_i]) != CPAR_OK) {
        printf("gemm_round_exact: CPAR_HOST_GEMM=%s skipped: %s\n", force[_i], cpar_thread_last_error());
        return;
    }
    if (_i == 10) setenv("CPAR_HOST_THREADS", "2", 1); /* this forked test's own environment */
    exact_case c = {ks[_i], ns[_i], _i == 6 || _i == 10 ? 1100 : 200};
    TU_OK(tu_spawn(1, rank_round_exact, &c));
}
END_TEST

/* The AVX-512 and AVX2 kernels run the same FMAs in the same order: y, dx,
 * dW and db bit-identical (F32; F16, widened while packing). A CPU without
 * either says so and skips. _i: the dtype. */
START_TEST(test_gemm_kernels_agree) {
    static const char *names[4] = {"y", "dx", "dW", "db"};
    const cpar_dtype dt = _i ? CPAR_F16 : CPAR_F32;
    blocking_case c[2];
    static const char *const kernels[2] = {"avx2", "avx512"};
    for (int t = 0; t < 2; t++) {
        if (probe_kernel(kernels[t]) != CPAR_OK) {
            printf("gemm_kernels_agree skipped: %s\n", cpar_thread_last_error());
            for (int u = 0; u < t; u++)
                for (int i = 0; i < 4; i++) free(c[u].out[i]);
            return;
        }
        c[t] = (blocking_case){.dt = dt, .threads = 1};
        TU_OK(tu_spawn(1, rank_blocking, &c[t]));
    }
    for (int i = 0; i < 4; i++) {
        ck_assert_msg(c[1].bytes[i] == c[0].bytes[i] && !memcmp(c[1].out[i], c[0].out[i], c[0].bytes[i]),
                      "%s (%s): the AVX-512 kernel's bits differ from the AVX2 kernel's", names[i], cpar_dtype_name(dt));
        free(c[0].out[i]), free(c[1].out[i]);
    }
    unsetenv("CPAR_HOST_GEMM");
}
END_TEST

/* ==== issue 15: gradient dtypes, tied weights, runtime_gather_output, deferral ====
 * Shared data: M micro-batches (x_m [T, K], dy_m [T, N]) on one master weight
 * W [N, K] and bias [N], every value rounded to the layer's dtype, so the
 * fp64 reference sees exactly what the layer sees. */

#define MAX_MB 3

typedef struct {
    cpar_dtype dt;
    int64_t s, b, K, N, T;
    int M;
    double *W, *bias, *x[MAX_MB], *dy[MAX_MB];
    double *dW[MAX_MB], *db[MAX_MB]; /* per micro-batch reference gradients */
} mb_data;

static void mb_init(mb_data *d, cpar_dtype dt, int64_t K, int64_t N, int M, uint64_t seed) {
    memset(d, 0, sizeof *d);
    d->dt = dt, d->s = 12, d->b = 2, d->K = K, d->N = N, d->T = d->s * d->b, d->M = M;
    d->W = random_rounded(N * K, 1.0 / sqrt((double)K), seed, dt);
    d->bias = random_rounded(N, 0.5, seed + 1, dt);
    for (int m = 0; m < M; m++) {
        d->x[m] = random_rounded(d->T * K, 1.0, seed + 10 + (uint64_t)m, dt);
        d->dy[m] = random_rounded(d->T * N, 1.0, seed + 20 + (uint64_t)m, dt);
        d->dW[m] = malloc(sizeof(double) * (size_t)(N * K)), d->db[m] = malloc(sizeof(double) * (size_t)N);
        ref_wgrad(d->dy[m], d->x[m], d->T, K, N, d->dW[m], d->db[m]);
    }
}

static void mb_free(mb_data *d) {
    free(d->W), free(d->bias);
    for (int m = 0; m < d->M; m++) free(d->x[m]), free(d->dy[m]), free(d->dW[m]), free(d->db[m]);
}

static void mb_init_layer(cpar_linear *l, const mb_data *d, bool weight, bool bias) {
    float *mw = tu_to_f32(d->W, d->N * d->K), *mb = tu_to_f32(d->bias, d->N);
    int64_t ws[2] = {d->N, d->K};
    cpar_tensor tw = cpar_tensor_make(mw, CPAR_F32, 2, ws, CPAR_HOST), tb = cpar_tensor_make(mb, CPAR_F32, 1, &d->N, CPAR_HOST);
    TU_OK(cpar_linear_init_from_master(l, weight ? &tw : NULL, bias ? &tb : NULL));
    free(mw), free(mb);
}

/* Expected [Nl, Kl] slice (rows ncols, columns kcols) of scale * sum over
 * micro-batches [m0, m1) of dW_m, and [Nl] of db_m. */
static double *mb_dw(const mb_data *d, int m0, int m1, const int64_t *ncols, int64_t Nl, const int64_t *kcols, int64_t Kl) {
    double *o = calloc((size_t)(Nl * Kl + 1), sizeof(double));
    for (int m = m0; m < m1; m++)
        for (int64_t i = 0; i < Nl; i++)
            for (int64_t j = 0; j < Kl; j++) o[i * Kl + j] += d->dW[m][ncols[i] * d->K + (kcols ? kcols[j] : j)];
    return o;
}
static double *mb_db(const mb_data *d, int m0, int m1, const int64_t *ncols, int64_t Nl) {
    double *o = calloc((size_t)Nl + 1, sizeof(double));
    for (int m = m0; m < m1; m++)
        for (int64_t i = 0; i < Nl; i++) o[i] += d->db[m][ncols[i]];
    return o;
}

/* Activation tolerance of a dtype (a sum of dtype-rounded partial products). */
static double act_tol(cpar_dtype dt) { return dt == CPAR_F32 ? 1e-5 : dt == CPAR_F16 ? 4e-3 : 1.6e-2; }
/* Gradient tolerance of a grad dtype: the inputs are exact in it, so an F32
 * grad is an fp32 sum; a 16-bit grad is rounded once per accumulation. */
static double grad_tol(cpar_dtype gdt) { return gdt == CPAR_F32 ? 1e-5 : tu_tol(gdt); }

/* ---- gradient-accumulation fusion: fp32 / fp16 / bf16 main grads, or the param-dtype grad ---- */

typedef struct {
    const char *name;
    cpar_dtype dt;       /* the layer's dtype */
    bool unfused;        /* disable_gradient_accumulation_fusion */
    cpar_dtype mg;       /* main_grad_dtype */
    cpar_dtype want;     /* the gradients' dtype */
} grad_mode;

static const grad_mode grad_modes[] = {
    {"f32 fused (default)", CPAR_F32, false, CPAR_F32, CPAR_F32},
    {"bf16 fused, fp32 main grad", CPAR_BF16, false, CPAR_F32, CPAR_F32},
    {"bf16 fused, bf16 main grad", CPAR_BF16, false, CPAR_BF16, CPAR_BF16},
    {"f16 fused, f16 main grad", CPAR_F16, false, CPAR_F16, CPAR_F16},
    {"bf16 unfused: bf16 .grad", CPAR_BF16, true, CPAR_F32, CPAR_BF16},
    {"f16 unfused: f16 .grad", CPAR_F16, true, CPAR_F32, CPAR_F16},
    {"f32 unfused: f32 .grad", CPAR_F32, true, CPAR_F32, CPAR_F32},
};
#define N_GRAD_MODES (int)(sizeof grad_modes / sizeof grad_modes[0])

typedef struct {
    const grad_mode *gm;
    bool row;
    mb_data d;
} grad_case;

/* Column (sequence parallel) or row (input_is_parallel, sequence parallel),
 * with bias: forward, backward, and a second backward that accumulates. */
static cpar_status rank_grad_mode(cpar_ctx *ctx, void *arg) {
    const grad_case *c = arg;
    const grad_mode *gm = c->gm;
    const mb_data *d = &c->d;
    cpar_group *g = cpar_world_group(ctx);
    const int n = cpar_group_size(g), r = cpar_group_rank(g);
    const bool row = c->row;
    const int64_t s = d->s, b = d->b, K = d->K, N = d->N, T = d->T;
    const int64_t Nl = row ? N : N / n, Kl = row ? K / n : K, sl = s / n;
    cpar_linear_config cfg = {.input_size = K, .output_size = N, .dtype = gm->dt, .bias = true,
                              .sequence_parallel = true, .input_is_parallel = row,
                              .disable_gradient_accumulation_fusion = gm->unfused, .main_grad_dtype = gm->mg};
    cpar_linear *l;
    TU_OK(row ? cpar_row_parallel_linear_create(g, &cfg, &l) : cpar_column_parallel_linear_create(g, &cfg, &l));
    mb_init_layer(l, d, true, true);
    int64_t ncols[64], kcols[64];
    for (int64_t i = 0; i < Nl; i++) ncols[i] = row ? i : r * Nl + i;
    for (int64_t j = 0; j < Kl; j++) kcols[j] = row ? r * Kl + j : j;
    /* column: x [s/n, b, K] rows of rank r, y [s, b, Nl]; row: x [s, b, Kl], y [s/n, b, N] */
    const int64_t xr0 = row ? 0 : r * sl * b, xrows = row ? T : sl * b, yr0 = row ? r * sl * b : 0, yrows = row ? sl * b : T;
    int64_t xs[3] = {row ? s : sl, b, Kl}, ys[3] = {row ? sl : s, b, Nl};
    cpar_tensor x = upload_sub(ctx, d->x[0], K, xr0, xrows, kcols, Kl, gm->dt, 3, xs);
    cpar_tensor dy = upload_sub(ctx, d->dy[0], N, yr0, yrows, ncols, Nl, gm->dt, 3, ys);
    cpar_tensor y = tu_alloc_poisoned(ctx, gm->dt, 3, ys), dx = tu_alloc_poisoned(ctx, gm->dt, 3, xs);
    TU_OK(cpar_linear_forward(l, &x, &y, NULL));
    double *yref = malloc(sizeof(double) * (size_t)(T * N)), *dxref = malloc(sizeof(double) * (size_t)(T * K));
    ref_fwd(d->x[0], d->W, d->bias, T, K, N, yref);
    ref_dgrad(d->dy[0], d->W, T, K, N, NULL, dxref);
    double *e = sub(yref, N, yr0, yrows, ncols, Nl, 1.0);
    expect_tensor(ctx, &y, e, act_tol(gm->dt), gm->name), free(e);
    TU_OK(cpar_linear_backward(l, &dy, &dx));
    e = sub(dxref, K, xr0, xrows, kcols, Kl, 1.0);
    expect_tensor(ctx, &dx, e, act_tol(gm->dt), "dx"), free(e);
    cpar_tensor dW = cpar_linear_weight_grad(l), db = cpar_linear_bias_grad(l);
    ck_assert_msg(dW.dtype == gm->want && db.dtype == gm->want, "%s: grads have dtypes %s / %s, expected %s", gm->name,
                  cpar_dtype_name(dW.dtype), cpar_dtype_name(db.dtype), cpar_dtype_name(gm->want));
    double *we = mb_dw(d, 0, 1, ncols, Nl, kcols, Kl), *be = mb_db(d, 0, 1, ncols, Nl);
    expect_tensor(ctx, &dW, we, grad_tol(gm->want), "dW"), expect_tensor(ctx, &db, be, grad_tol(gm->want), "db");
    /* a second backward accumulates in the grad dtype */
    TU_OK(cpar_linear_backward(l, &dy, NULL));
    for (int64_t i = 0; i < Nl * Kl; i++) we[i] *= 2.0;
    for (int64_t i = 0; i < Nl; i++) be[i] *= 2.0;
    expect_tensor(ctx, &dW, we, grad_tol(gm->want), "dW twice"), expect_tensor(ctx, &db, be, grad_tol(gm->want), "db twice");
    TU_OK(cpar_linear_zero_grad(l));
    double *z = calloc((size_t)(Nl * Kl), sizeof(double));
    expect_tensor(ctx, &dW, z, 0.0, "dW after zero_grad"), free(z);
    free(we), free(be), free(yref), free(dxref);
    cpar_tensor *all[] = {&x, &dy, &y, &dx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_linear_destroy(l));
    return CPAR_OK;
}

/* _i = mode * 2 + row; every tp 1..4 */
START_TEST(test_grad_fusion) {
    grad_case c = {.gm = &grad_modes[_i / 2], .row = _i % 2};
    mb_init(&c.d, c.gm->dt, 24, 24, 1, 1100 + (uint64_t)_i);
    for (int tp = 1; tp <= MAX_TP; tp++) TU_OK(tu_spawn(tp, rank_grad_mode, &c));
    mb_free(&c.d);
}
END_TEST

/* ---- tied embeddings: the output layer runs on the embedding's weight ----
 * An embedding [V, H] and a column layer (H -> V, skip_weight_param_allocation)
 * given the embedding's weight and main grad; beside it a column layer with a
 * copy of the weight. The tied layer's y, dx and bias grad equal the copy's
 * bit for bit, and the embedding's main grad ends up holding its own lookup
 * gradient plus the output layer's weight gradient (against fp64). */

typedef struct {
    bool sp;
    mb_data d; /* K = H, N = V */
    int32_t *ids;
    double *dout; /* [b, s, H] embedding output gradient */
} tied_case;

static cpar_status rank_tied(cpar_ctx *ctx, void *arg) {
    const tied_case *c = arg;
    const mb_data *d = &c->d;
    cpar_group *g = cpar_world_group(ctx);
    const int n = cpar_group_size(g), r = cpar_group_rank(g);
    const int64_t s = d->s, b = d->b, K = d->K, N = d->N, T = d->T, Nl = N / n, sx = c->sp ? s / n : s;
    cpar_embedding_config ec = {.num_embeddings = N, .embedding_dim = K, .dtype = d->dt};
    cpar_embedding *emb;
    TU_OK(cpar_embedding_create(g, &ec, &emb));
    float *mw = tu_to_f32(d->W, N * K);
    int64_t ws[2] = {N, K};
    cpar_tensor tw = cpar_tensor_make(mw, CPAR_F32, 2, ws, CPAR_HOST);
    TU_OK(cpar_embedding_init_from_master(emb, &tw));
    free(mw);
    cpar_linear_config cfg = {.input_size = K, .output_size = N, .dtype = d->dt, .bias = true,
                              .sequence_parallel = c->sp, .skip_weight_param_allocation = true};
    cpar_linear *tied, *copy;
    TU_OK(cpar_column_parallel_linear_create(g, &cfg, &tied));
    cfg.skip_weight_param_allocation = false;
    TU_OK(cpar_column_parallel_linear_create(g, &cfg, &copy));
    mb_init_layer(tied, d, false, true); /* the bias only: there is no weight */
    mb_init_layer(copy, d, true, true);
    ck_assert(cpar_linear_weight(tied).data == NULL && cpar_linear_weight_grad(tied).data == NULL);
    cpar_tensor ew = cpar_embedding_weight(emb), eg = cpar_embedding_weight_grad(emb);
    int64_t ncols[64];
    for (int64_t i = 0; i < Nl; i++) ncols[i] = r * Nl + i;
    int64_t xs[3] = {sx, b, K}, ys[3] = {s, b, Nl}, es[3] = {b, s, K}, is[2] = {b, s};
    cpar_tensor x = upload_sub(ctx, d->x[0], K, c->sp ? r * sx * b : 0, sx * b, NULL, K, d->dt, 3, xs);
    cpar_tensor dy = upload_sub(ctx, d->dy[0], N, 0, T, ncols, Nl, d->dt, 3, ys);
    cpar_tensor dout = upload_sub(ctx, c->dout, K, 0, T, NULL, K, d->dt, 3, es);
    cpar_tensor ids = tu_upload(ctx, c->ids, CPAR_I32, 2, is);
    cpar_tensor yt = tu_alloc_poisoned(ctx, d->dt, 3, ys), yc = tu_alloc_poisoned(ctx, d->dt, 3, ys);
    cpar_tensor dxt = tu_alloc_poisoned(ctx, d->dt, 3, xs), dxc = tu_alloc_poisoned(ctx, d->dt, 3, xs);
    cpar_linear_forward_args args = {.weight = &ew, .weight_grad = &eg};
    TU_OK(cpar_linear_forward_ex(tied, &x, &yt, NULL, &args));
    TU_OK(cpar_linear_forward(copy, &x, &yc, NULL));
    double *yref = malloc(sizeof(double) * (size_t)(T * N));
    ref_fwd(d->x[0], d->W, d->bias, T, K, N, yref);
    double *e = sub(yref, N, 0, T, ncols, Nl, 1.0);
    expect_tensor(ctx, &yt, e, act_tol(d->dt), "tied y"), free(e), free(yref);
    void *h1 = tu_download(ctx, &yt), *h2 = tu_download(ctx, &yc);
    TU_EXPECT_SAME(h1, h2, d->dt, T * Nl);
    free(h1), free(h2);
    TU_OK(cpar_embedding_layer_backward(emb, &ids, &dout));
    TU_OK(cpar_linear_backward(tied, &dy, &dxt));
    TU_OK(cpar_linear_backward(copy, &dy, &dxc));
    h1 = tu_download(ctx, &dxt), h2 = tu_download(ctx, &dxc);
    TU_EXPECT_SAME(h1, h2, d->dt, sx * b * K);
    free(h1), free(h2);
    cpar_tensor dbt = cpar_linear_bias_grad(tied), dbc = cpar_linear_bias_grad(copy);
    h1 = tu_download(ctx, &dbt), h2 = tu_download(ctx, &dbc);
    TU_EXPECT_SAME(h1, h2, CPAR_F32, Nl);
    free(h1), free(h2);
    /* the embedding's main grad: its lookup gradient + the output layer's dW */
    double *want = mb_dw(d, 0, 1, ncols, Nl, NULL, K);
    for (int64_t t = 0; t < T; t++) {
        int64_t row = c->ids[t] - r * Nl; /* token t = (i, j) of ids [b, s] is dout row t */
        if (row >= 0 && row < Nl)
            for (int64_t k = 0; k < K; k++) want[row * K + k] += c->dout[t * K + k];
    }
    expect_tensor(ctx, &eg, want, 1e-5, "embedding main grad (lookup + tied output layer)"), free(want);
    cpar_tensor *all[] = {&x, &dy, &dout, &ids, &yt, &yc, &dxt, &dxc};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_linear_destroy(tied));
    TU_OK(cpar_linear_destroy(copy));
    TU_OK(cpar_embedding_destroy(emb));
    return CPAR_OK;
}

/* _i: 0 F32, 1 F32 sequence parallel, 2 BF16 sequence parallel; tp 1..4 */
START_TEST(test_tied_weight) {
    static const cpar_dtype dts[] = {CPAR_F32, CPAR_F32, CPAR_BF16};
    tied_case c = {.sp = _i > 0};
    mb_init(&c.d, dts[_i], 16, 24, 1, 1200 + (uint64_t)_i);
    uint64_t rs = 1300 + (uint64_t)_i;
    c.ids = malloc(sizeof(int32_t) * (size_t)c.d.T);
    for (int64_t t = 0; t < c.d.T; t++) c.ids[t] = (int32_t)(tu_next(&rs) % (uint64_t)c.d.N);
    c.dout = random_rounded(c.d.T * c.d.K, 1.0, 1400 + (uint64_t)_i, dts[_i]);
    for (int tp = 1; tp <= MAX_TP; tp++) TU_OK(tu_spawn(tp, rank_tied, &c));
    free(c.ids), free(c.dout);
    mb_free(&c.d);
}
END_TEST

/* ---- runtime_gather_output: overrides gather_output for one call ---- */

static cpar_status rank_runtime_gather(cpar_ctx *ctx, void *arg) {
    const mb_data *d = arg;
    cpar_group *g = cpar_world_group(ctx);
    const int n = cpar_group_size(g), r = cpar_group_rank(g);
    const int64_t s = d->s, b = d->b, K = d->K, N = d->N, T = d->T, Nl = N / n;
    int64_t ncols[64], all_n[64];
    for (int64_t i = 0; i < Nl; i++) ncols[i] = r * Nl + i;
    for (int64_t i = 0; i < N; i++) all_n[i] = i;
    double *yref = malloc(sizeof(double) * (size_t)(T * N)), *dxref = malloc(sizeof(double) * (size_t)(T * K));
    ref_fwd(d->x[0], d->W, NULL, T, K, N, yref);
    ref_dgrad(d->dy[0], d->W, T, K, N, NULL, dxref);
    int64_t xs[3] = {s, b, K};
    cpar_tensor x = upload_sub(ctx, d->x[0], K, 0, T, NULL, K, CPAR_F32, 3, xs);
    for (int layer_go = 0; layer_go < 2; layer_go++) {
        cpar_linear_config cfg = {.input_size = K, .output_size = N, .gather_output = layer_go};
        cpar_linear *l;
        TU_OK(cpar_column_parallel_linear_create(g, &cfg, &l));
        mb_init_layer(l, d, true, false);
        for (int rt = CPAR_RUNTIME_GATHER_NONE; rt <= CPAR_RUNTIME_GATHER_FALSE; rt++) {
            const bool go = rt == CPAR_RUNTIME_GATHER_NONE ? layer_go : rt == CPAR_RUNTIME_GATHER_TRUE;
            const int64_t ny = go ? N : Nl;
            int64_t ys[3] = {s, b, ny}, yother[3] = {s, b, go ? Nl : N};
            cpar_tensor y = tu_alloc_poisoned(ctx, CPAR_F32, 3, ys), dx = tu_alloc_poisoned(ctx, CPAR_F32, 3, xs);
            cpar_tensor dy = upload_sub(ctx, d->dy[0], N, 0, T, go ? all_n : ncols, ny, CPAR_F32, 3, ys);
            cpar_linear_forward_args args = {.runtime_gather_output = (cpar_runtime_gather)rt};
            if (n > 1) { /* the other mode's shape is refused */
                cpar_tensor yo = tu_alloc_poisoned(ctx, CPAR_F32, 3, yother);
                TU_FAILS(cpar_linear_forward_ex(l, &x, &yo, NULL, &args), CPAR_ERR_INVALID, "y has shape");
                TU_OK(cpar_tensor_free(ctx, &yo));
            }
            TU_OK(cpar_group_stats_reset(g));
            TU_OK(cpar_linear_forward_ex(l, &x, &y, NULL, &args));
            cpar_comm_stats st;
            TU_OK(cpar_group_stats(g, &st));
            const uint64_t gathers = go && n > 1;
            ck_assert_msg(st.kind[CPAR_COLL_ALL_GATHER].calls == gathers &&
                              st.kind[CPAR_COLL_ALL_GATHER].bytes_sent == gathers * ag_bytes((uint64_t)(T * Nl) * 4, n),
                          "layer gather_output %d, runtime %d, tp %d: %llu all-gathers", layer_go, rt, n,
                          (unsigned long long)st.kind[CPAR_COLL_ALL_GATHER].calls);
            double *e = sub(yref, N, 0, T, go ? all_n : ncols, ny, 1.0);
            expect_tensor(ctx, &y, e, 1e-5, "runtime_gather_output y"), free(e);
            TU_OK(cpar_linear_zero_grad(l));
            TU_OK(cpar_linear_backward(l, &dy, &dx)); /* dy shaped as this forward's y */
            expect_tensor(ctx, &dx, dxref, 1e-5, "runtime_gather_output dx");
            cpar_tensor dW = cpar_linear_weight_grad(l);
            double *we = mb_dw(d, 0, 1, ncols, Nl, NULL, K);
            expect_tensor(ctx, &dW, we, 1e-5, "runtime_gather_output dW"), free(we);
            cpar_tensor *tmp[] = {&y, &dx, &dy};
            for (int i = 0; i < 3; i++) TU_OK(cpar_tensor_free(ctx, tmp[i]));
        }
        TU_OK(cpar_linear_destroy(l));
    }
    TU_OK(cpar_tensor_free(ctx, &x));
    free(yref), free(dxref);
    return CPAR_OK;
}

START_TEST(test_runtime_gather_output) {
    mb_data d;
    mb_init(&d, CPAR_F32, 20, 24, 1, 1500);
    for (int tp = 1; tp <= MAX_TP; tp++) TU_OK(tu_spawn(tp, rank_runtime_gather, &d));
    mb_free(&d);
}
END_TEST

/* ---- defer_embedding_wgrad_compute / wgrad_deferral_limit and the drain ----
 * M = 3 micro-batches, one forward and one backward each, through a deferred
 * layer and a plain one. dx and the bias grad are computed at once; the
 * first min(M, limit) weight gradients wait (and with sequence parallelism
 * so does the all-gather of x), later ones are computed at once; the drain
 * computes the waiting ones (one all-gather each with sequence parallelism)
 * into the gradient their forward used. */

typedef struct {
    const char *name;
    int limit;
    bool sp, go, tied;
} defer_mode;

static const defer_mode defer_modes[] = {
    {"no limit", 0, false, false, false},
    {"no limit, sp", 0, true, false, false},
    {"limit 2 of 3, sp", 2, true, false, false},
    {"limit 1 of 3, gather_output", 1, false, true, false},
    {"no limit, sp, tied weight", 0, true, false, true},
    {"limit 3 of 3", 3, false, false, false},
};
#define N_DEFER_MODES (int)(sizeof defer_modes / sizeof defer_modes[0])

typedef struct {
    const defer_mode *dm;
    mb_data d;
} defer_case;

static cpar_status rank_defer(cpar_ctx *ctx, void *arg) {
    const defer_case *c = arg;
    const defer_mode *dm = c->dm;
    const mb_data *d = &c->d;
    cpar_group *g = cpar_world_group(ctx);
    const int n = cpar_group_size(g), r = cpar_group_rank(g), M = d->M;
    const int64_t s = d->s, b = d->b, K = d->K, N = d->N, T = d->T, Nl = N / n, sx = dm->sp ? s / n : s;
    const int deferred = dm->limit ? (dm->limit < M ? dm->limit : M) : M;
    cpar_linear_config cfg = {.input_size = K, .output_size = N, .bias = true, .sequence_parallel = dm->sp,
                              .gather_output = dm->go};
    cpar_linear *plain, *l;
    TU_OK(cpar_column_parallel_linear_create(g, &cfg, &plain));
    cfg.defer_embedding_wgrad_compute = true, cfg.wgrad_deferral_limit = dm->limit;
    cfg.skip_weight_param_allocation = dm->tied;
    TU_OK(cpar_column_parallel_linear_create(g, &cfg, &l));
    mb_init_layer(plain, d, true, true);
    mb_init_layer(l, d, !dm->tied, true);
    int64_t ncols[64], all_n[64], wsh[2] = {Nl, K};
    for (int64_t i = 0; i < Nl; i++) ncols[i] = r * Nl + i;
    for (int64_t i = 0; i < N; i++) all_n[i] = i;
    /* tied: the weight and its gradient live outside the layer */
    cpar_tensor tw = {0}, tg = {0};
    if (dm->tied) {
        tw = upload_sub(ctx, d->W, K, r * Nl, Nl, NULL, K, CPAR_F32, 2, wsh);
        TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 2, wsh, &tg));
        TU_OK(cpar_fill(ctx, &tg, 0.0));
    }
    cpar_linear_forward_args args = {.weight = dm->tied ? &tw : NULL, .weight_grad = dm->tied ? &tg : NULL};
    cpar_tensor dW = dm->tied ? tg : cpar_linear_weight_grad(l), db = cpar_linear_bias_grad(l);
    const int64_t ny = dm->go ? N : Nl;
    int64_t xs[3] = {sx, b, K}, ys[3] = {s, b, ny};
    cpar_tensor x[MAX_MB], dy[MAX_MB], y = tu_alloc_poisoned(ctx, CPAR_F32, 3, ys), dx = tu_alloc_poisoned(ctx, CPAR_F32, 3, xs);
    const uint64_t x_ag = ag_bytes((uint64_t)(sx * b * K) * 4, n);
    for (int m = 0; m < M; m++) { /* every deferred x and dy stays alive until the drain */
        x[m] = upload_sub(ctx, d->x[m], K, dm->sp ? r * sx * b : 0, sx * b, NULL, K, CPAR_F32, 3, xs);
        dy[m] = upload_sub(ctx, d->dy[m], N, 0, T, dm->go ? all_n : ncols, ny, CPAR_F32, 3, ys);
        TU_OK(cpar_linear_forward_ex(l, &x[m], &y, NULL, &args));
        double *yref = malloc(sizeof(double) * (size_t)(T * N)), *dxref = malloc(sizeof(double) * (size_t)(T * K));
        ref_fwd(d->x[m], d->W, d->bias, T, K, N, yref);
        ref_dgrad(d->dy[m], d->W, T, K, N, NULL, dxref);
        double *e = sub(yref, N, 0, T, dm->go ? all_n : ncols, ny, 1.0);
        expect_tensor(ctx, &y, e, 1e-5, "deferred y"), free(e);
        TU_OK(cpar_group_stats_reset(g));
        TU_OK(cpar_linear_backward(l, &dy[m], &dx));
        cpar_comm_stats st;
        TU_OK(cpar_group_stats(g, &st));
        const bool waits = m < deferred;
        const uint64_t gathers = dm->sp && n > 1 && !waits; /* x is gathered for a wgrad computed now only */
        ck_assert_msg(st.kind[CPAR_COLL_ALL_GATHER].calls == gathers &&
                          st.kind[CPAR_COLL_ALL_GATHER].bytes_sent == gathers * x_ag,
                      "%s tp %d micro-batch %d: backward made %llu all-gathers, expected %llu", dm->name, n, m,
                      (unsigned long long)st.kind[CPAR_COLL_ALL_GATHER].calls, (unsigned long long)gathers);
        e = sub(dxref, K, dm->sp ? r * sx * b : 0, sx * b, NULL, K, 1.0);
        expect_tensor(ctx, &dx, e, 1e-5, "deferred dx"), free(e), free(yref), free(dxref);
        int na, ng;
        TU_OK(cpar_linear_deferred(l, &na, &ng));
        const int want = m + 1 < deferred ? m + 1 : deferred;
        ck_assert_msg(na == want && ng == want, "%s: after micro-batch %d the lists hold %d / %d, expected %d", dm->name,
                      m, na, ng, want);
        /* the plain layer, for the bitwise comparison */
        TU_OK(cpar_linear_forward(plain, &x[m], &y, NULL));
        TU_OK(cpar_linear_backward(plain, &dy[m], &dx));
    }
    /* before the drain: the weight gradients of the micro-batches past the
     * limit only; the bias gradient of all of them */
    double *we = mb_dw(d, deferred, M, ncols, Nl, NULL, K), *be = mb_db(d, 0, M, ncols, Nl);
    expect_tensor(ctx, &dW, we, 1e-5, "dW before the drain"), free(we);
    expect_tensor(ctx, &db, be, 1e-5, "db before the drain"), free(be);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_linear_drain_wgrad(l));
    cpar_comm_stats st;
    TU_OK(cpar_group_stats(g, &st));
    const uint64_t gathers = dm->sp && n > 1 ? (uint64_t)deferred : 0;
    ck_assert_msg(st.kind[CPAR_COLL_ALL_GATHER].calls == gathers && st.kind[CPAR_COLL_ALL_GATHER].bytes_sent == gathers * x_ag,
                  "%s tp %d: the drain made %llu all-gathers (%llu bytes), expected %llu", dm->name, n,
                  (unsigned long long)st.kind[CPAR_COLL_ALL_GATHER].calls,
                  (unsigned long long)st.kind[CPAR_COLL_ALL_GATHER].bytes_sent, (unsigned long long)gathers);
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++)
        ck_assert(k == CPAR_COLL_ALL_GATHER || st.kind[k].calls == 0);
    int na, ng;
    TU_OK(cpar_linear_deferred(l, &na, &ng));
    ck_assert(na == 0 && ng == 0);
    we = mb_dw(d, 0, M, ncols, Nl, NULL, K);
    expect_tensor(ctx, &dW, we, 1e-5, "dW after the drain"), free(we);
    cpar_tensor pw = cpar_linear_weight_grad(plain);
    float *h1 = tu_download(ctx, &dW), *h2 = tu_download(ctx, &pw);
    if (deferred == M) /* the same GEMMs in the same order as the plain layer: bit for bit */
        TU_EXPECT_SAME(h1, h2, CPAR_F32, Nl * K);
    free(h1), free(h2);
    TU_OK(cpar_linear_drain_wgrad(l)); /* empty lists: nothing happens */
    we = mb_dw(d, 0, M, ncols, Nl, NULL, K);
    expect_tensor(ctx, &dW, we, 1e-5, "dW after a second drain"), free(we);
    /* the limit counts afresh after a drain */
    TU_OK(cpar_linear_forward_ex(l, &x[0], &y, NULL, &args));
    TU_OK(cpar_linear_backward(l, &dy[0], NULL));
    TU_OK(cpar_linear_deferred(l, &na, &ng));
    ck_assert(na == 1 && ng == 1);
    TU_OK(cpar_linear_drain_wgrad(l));
    for (int m = 0; m < M; m++) {
        TU_OK(cpar_tensor_free(ctx, &x[m]));
        TU_OK(cpar_tensor_free(ctx, &dy[m]));
    }
    cpar_tensor *tmp[] = {&y, &dx, &tw, &tg};
    for (int i = 0; i < (dm->tied ? 4 : 2); i++) TU_OK(cpar_tensor_free(ctx, tmp[i]));
    TU_OK(cpar_linear_destroy(l));
    TU_OK(cpar_linear_destroy(plain));
    return CPAR_OK;
}

START_TEST(test_wgrad_deferral) {
    defer_case c = {.dm = &defer_modes[_i]};
    mb_init(&c.d, CPAR_F32, 20, 24, MAX_MB, 1600 + (uint64_t)_i);
    for (int tp = 1; tp <= MAX_TP; tp++) TU_OK(tu_spawn(tp, rank_defer, &c));
    mb_free(&c.d);
}
END_TEST

/* ---- bad arguments of the options ---- */

static cpar_status rank_bad_options(cpar_ctx *ctx, void *arg) {
    (void)arg;
    cpar_group *g = cpar_world_group(ctx);
    cpar_linear *l = NULL;
    const cpar_linear_config cfg = {.input_size = 16, .output_size = 8, .bias = true};
    cpar_linear_config bad = cfg;
    bad.skip_weight_param_allocation = true;
    TU_FAILS(cpar_row_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID,
             "cpar_row_parallel_linear_create: cfg skip_weight_param_allocation is a ColumnParallelLinear option");
    bad = cfg, bad.defer_embedding_wgrad_compute = true;
    TU_FAILS(cpar_row_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID, "defer_embedding_wgrad_compute is a ColumnParallelLinear option");
    bad = cfg, bad.defer_embedding_wgrad_compute = true, bad.wgrad_deferral_limit = -1;
    TU_FAILS(cpar_column_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID, "wgrad_deferral_limit is -1, expected >= 0");
    bad = cfg, bad.wgrad_deferral_limit = 2;
    TU_FAILS(cpar_column_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID,
             "wgrad_deferral_limit is 2 but defer_embedding_wgrad_compute is false");
    bad = cfg, bad.defer_embedding_wgrad_compute = true, bad.disable_gradient_accumulation_fusion = true;
    TU_FAILS(cpar_column_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID,
             "defer_embedding_wgrad_compute requires gradient accumulation fusion");
    bad = cfg, bad.defer_embedding_wgrad_compute = true, bad.frozen = true;
    TU_FAILS(cpar_column_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID, "defer_embedding_wgrad_compute with frozen");
    bad = cfg, bad.main_grad_dtype = CPAR_BF16;
    TU_FAILS(cpar_column_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID,
             "main_grad_dtype is bf16, expected f32 or the layer's dtype f32");
    bad = cfg, bad.dtype = CPAR_BF16, bad.main_grad_dtype = CPAR_F16;
    TU_FAILS(cpar_row_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID, "main_grad_dtype is f16, expected f32 or the layer's dtype bf16");
    bad = cfg, bad.dtype = CPAR_BF16, bad.main_grad_dtype = CPAR_BF16, bad.disable_gradient_accumulation_fusion = true;
    TU_FAILS(cpar_column_parallel_linear_create(g, &bad, &l), CPAR_ERR_INVALID, "main_grad_dtype bf16 needs gradient accumulation fusion");
    ck_assert_ptr_null(l);

    /* a layer without a weight of its own */
    int64_t xs[3] = {6, 2, 16}, ys[3] = {6, 2, 4}, yg[3] = {6, 2, 8}, wsh[2] = {4, 16}, wbad[2] = {8, 16};
    cpar_tensor x = tu_alloc_poisoned(ctx, CPAR_F32, 3, xs), y = tu_alloc_poisoned(ctx, CPAR_F32, 3, ys);
    cpar_tensor yfull = tu_alloc_poisoned(ctx, CPAR_F32, 3, yg);
    cpar_tensor w = tu_alloc_poisoned(ctx, CPAR_F32, 2, wsh), wg = tu_alloc_poisoned(ctx, CPAR_F32, 2, wsh);
    cpar_tensor w8 = tu_alloc_poisoned(ctx, CPAR_F32, 2, wbad), w16 = tu_alloc_poisoned(ctx, CPAR_BF16, 2, wsh);
    TU_OK(cpar_fill(ctx, &x, 0.25));
    TU_OK(cpar_fill(ctx, &w, 0.5));
    TU_OK(cpar_fill(ctx, &wg, 0.0));
    bad = cfg, bad.skip_weight_param_allocation = true;
    TU_OK(cpar_column_parallel_linear_create(g, &bad, &l));
    float mw[8 * 16] = {0}, mb[8] = {0};
    int64_t mws[2] = {8, 16}, nb = 8;
    cpar_tensor m = cpar_tensor_make(mw, CPAR_F32, 2, mws, CPAR_HOST), mbt = cpar_tensor_make(mb, CPAR_F32, 1, &nb, CPAR_HOST);
    TU_FAILS(cpar_linear_init_from_master(l, &m, &mbt), CPAR_ERR_INVALID, "master_weight given but cfg skip_weight_param_allocation");
    TU_OK(cpar_linear_init_from_master(l, NULL, &mbt));
    TU_FAILS(cpar_linear_forward(l, &x, &y, NULL), CPAR_ERR_INVALID,
             "cpar_linear_forward: no weight was supplied and cfg skip_weight_param_allocation is true");
    cpar_linear_forward_args a = {.weight = &w8, .weight_grad = &wg};
    TU_FAILS(cpar_linear_forward_ex(l, &x, &y, NULL, &a), CPAR_ERR_INVALID,
             "cpar_linear_forward_ex: args->weight has shape [8,16], expected [4,16]");
    a.weight = &w16;
    TU_FAILS(cpar_linear_forward_ex(l, &x, &y, NULL, &a), CPAR_ERR_INVALID, "args->weight has dtype bf16, expected f32");
    a = (cpar_linear_forward_args){.weight = &w};
    TU_FAILS(cpar_linear_forward_ex(l, &x, &y, NULL, &a), CPAR_ERR_INVALID, "args->weight_grad is NULL");
    a.weight_grad = &w16;
    TU_FAILS(cpar_linear_forward_ex(l, &x, &y, NULL, &a), CPAR_ERR_INVALID, "args->weight_grad has dtype bf16, expected f32");
    a.weight_grad = &w;
    TU_FAILS(cpar_linear_forward_ex(l, &x, &y, NULL, &a), CPAR_ERR_INVALID, "args->weight_grad overlaps args->weight");
    a = (cpar_linear_forward_args){.weight = &w, .weight_grad = &wg, .runtime_gather_output = (cpar_runtime_gather)7};
    TU_FAILS(cpar_linear_forward_ex(l, &x, &y, NULL, &a), CPAR_ERR_INVALID, "args->runtime_gather_output is 7");
    a.runtime_gather_output = CPAR_RUNTIME_GATHER_TRUE;
    TU_FAILS(cpar_linear_forward_ex(l, &x, &y, NULL, &a), CPAR_ERR_INVALID, "y has shape [6,2,4], expected [6,2,8]");
    a.runtime_gather_output = CPAR_RUNTIME_GATHER_NONE;
    cpar_tensor yw = w;
    yw.ndim = 3, yw.shape[0] = 1, yw.shape[1] = 2, yw.shape[2] = 4; /* 8 floats inside w */
    cpar_tensor x2 = x;
    x2.shape[0] = 1;
    TU_FAILS(cpar_linear_forward_ex(l, &x2, &yw, NULL, &a), CPAR_ERR_INVALID, "y overlaps args->weight");
    TU_OK(cpar_linear_forward_ex(l, &x, &y, NULL, &a));
    TU_OK(cpar_linear_backward(l, &y, NULL));
    TU_FAILS(cpar_linear_drain_wgrad(l), CPAR_ERR_INVALID, "cfg defer_embedding_wgrad_compute is false: nothing is deferred");
    TU_OK(cpar_linear_destroy(l));

    /* a frozen layer given a weight takes no gradient buffer */
    bad = cfg, bad.frozen = true;
    TU_OK(cpar_column_parallel_linear_create(g, &bad, &l));
    a = (cpar_linear_forward_args){.weight_grad = &wg};
    TU_FAILS(cpar_linear_forward_ex(l, &x, &y, NULL, &a), CPAR_ERR_INVALID, "args->weight_grad is given without args->weight");
    a.weight = &w;
    TU_FAILS(cpar_linear_forward_ex(l, &x, &y, NULL, &a), CPAR_ERR_INVALID, "args->weight_grad is given but cfg frozen is true");
    a.weight_grad = NULL;
    TU_OK(cpar_linear_forward_ex(l, &x, &y, NULL, &a));
    TU_OK(cpar_linear_destroy(l));

    /* the row layer takes no per-call weight or gather */
    cpar_linear_config rc = {.input_size = 16, .output_size = 4, .input_is_parallel = true};
    TU_OK(cpar_row_parallel_linear_create(g, &rc, &l));
    int64_t rxs[3] = {6, 2, 8};
    cpar_tensor rx = tu_alloc_poisoned(ctx, CPAR_F32, 3, rxs);
    a = (cpar_linear_forward_args){.weight = &w, .weight_grad = &wg};
    TU_FAILS(cpar_linear_forward_ex(l, &rx, &y, NULL, &a), CPAR_ERR_INVALID, "args->weight is given but a row-parallel layer");
    a = (cpar_linear_forward_args){.runtime_gather_output = CPAR_RUNTIME_GATHER_FALSE};
    TU_FAILS(cpar_linear_forward_ex(l, &rx, &y, NULL, &a), CPAR_ERR_INVALID, "args->runtime_gather_output is given but a row-parallel");
    TU_OK(cpar_linear_destroy(l));

    /* deferral: the lists must pair one backward with each forward */
    bad = cfg, bad.output_size = 8, bad.defer_embedding_wgrad_compute = true;
    TU_OK(cpar_column_parallel_linear_create(g, &bad, &l));
    TU_OK(cpar_fill(ctx, &y, 1.0));
    TU_OK(cpar_linear_forward(l, &x, &y, NULL));
    TU_FAILS(cpar_linear_drain_wgrad(l), CPAR_ERR_INVALID, "1 activations but 0 grad outputs are deferred");
    TU_OK(cpar_linear_forward(l, &x, &y, NULL)); /* a second forward before the first backward */
    TU_FAILS(cpar_linear_backward(l, &y, NULL), CPAR_ERR_INVALID, "the deferral lists are out of step (2 activations, 0 grad outputs");
    int na = -1, ng = -1;
    TU_OK(cpar_linear_deferred(l, &na, NULL));
    TU_OK(cpar_linear_deferred(l, NULL, &ng));
    ck_assert(na == 2 && ng == 0);
    TU_FAILS(cpar_linear_deferred(NULL, &na, &ng), CPAR_ERR_INVALID, "cpar_linear_deferred: l is NULL");
    TU_FAILS(cpar_linear_drain_wgrad(NULL), CPAR_ERR_INVALID, "cpar_linear_drain_wgrad: l is NULL");
    TU_OK(cpar_linear_destroy(l));
    cpar_tensor *all[] = {&x, &y, &yfull, &w, &wg, &w8, &w16, &rx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    return CPAR_OK;
}

START_TEST(test_bad_options) { TU_OK(tu_spawn(2, rank_bad_options, NULL)); }
END_TEST

/* ==== CPAR_HOST_THREADS =======================================================
 * rank_blocking's layer (every product of 34M multiply-adds: above the
 * pool's threshold, split along n in the forward and along m in the wgrad,
 * K > KC, edge micro-tiles) with 1, 2 and 3 threads, F32 on cpar's own
 * kernel and BF16 (a 16-bit C): y, dx, dW and db bit-identical to 1 thread
 * (and right against fp64, as in gemm_blocking). On the host backend the
 * rank has exactly threads - 1 workers once it has run a product,
 * cpar_finalize joins them, and a forked child runs the same context's
 * forward with a pool of its own, with the same bits. Bad values of the
 * variable fail context creation with a line naming it. */

/* _i: 0 F32 (cpar's kernel), 1 BF16, 2 BF16 with K 320 (AMX: x read where
 * it lies, y rounded from each tile), 3 BF16 with K 1088 (AMX: all of k one
 * block, deeper than 1024; each thread's panel of op(B) only the tokens'
 * partial sliver) */
START_TEST(test_host_threads) {
    static const char *names[4] = {"y", "dx", "dW", "db"};
    setenv("CPAR_HOST_GEMM", "builtin", 1); /* this forked test's own environment */
    blocking_case c[3];
    for (int t = 0; t < 3; t++) {
        char v[8];
        snprintf(v, sizeof v, "%d", t + 1);
        setenv("CPAR_HOST_THREADS", v, 1); /* read when the context is made */
        c[t] = (blocking_case){.dt = _i ? CPAR_BF16 : CPAR_F32, .k = _i == 2 ? 320 : _i == 3 ? 1088 : 0, .threads = t + 1};
        TU_OK(tu_spawn(1, rank_blocking, &c[t]));
        /* joined by cpar_finalize; a joined thread may linger in /proc for a moment */
        for (int ms = 0; count_workers() > 0 && ms < 20000; ms += 10) usleep(10000);
        ck_assert_msg(count_workers() == 0, "CPAR_HOST_THREADS=%d: %d workers left after cpar_finalize", t + 1,
                      count_workers());
    }
    for (int t = 1; t < 3 && !tu_on_device(); t++) /* host products: the pool is there */
        ck_assert_msg(c[t].made == t, "CPAR_HOST_THREADS=%d: %d worker threads, expected %d", t + 1, c[t].made, t);
    for (int t = 1; t < 3; t++)
        for (int i = 0; i < 4; i++) {
            ck_assert_msg(c[t].bytes[i] == c[0].bytes[i] && !memcmp(c[t].out[i], c[0].out[i], c[0].bytes[i]),
                          "%s: CPAR_HOST_THREADS=%d is not bit-identical to 1 thread (%s)", names[i], t + 1,
                          cpar_dtype_name(c[t].dt));
        }
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < 4; i++) free(c[t].out[i]);
    unsetenv("CPAR_HOST_THREADS");
}
END_TEST

START_TEST(test_host_threads_bad) {
    static const char *bad[] = {"0", "-2", "abc", "2x", "257", " 2"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("CPAR_HOST_THREADS", bad[i], 1);
        cpar_init_config cfg = {.backend = tu_backend(), .timeout_ms = TU_TIMEOUT_MS};
        cpar_status st = cpar_spawn_with(2, &cfg, tu_rank_nothing, NULL);
        const char *msg = cpar_thread_last_error();
        ck_assert_msg(st == CPAR_ERR_INVALID && strstr(msg, "CPAR_HOST_THREADS") && strstr(msg, bad[i]),
                      "CPAR_HOST_THREADS=\"%s\": status %d, \"%s\", expected CPAR_ERR_INVALID naming it", bad[i], st, msg);
    }
    setenv("CPAR_HOST_THREADS", "", 1); /* empty: the default */
    TU_OK(tu_spawn(2, tu_rank_nothing, NULL));
    unsetenv("CPAR_HOST_THREADS");
    /* CPAR_HOST_GEMM: a name it does not know, or a kernel this CPU lacks */
    static const char *gbad[] = {"avx512f", "blas", "C", "avx2 "};
    for (size_t i = 0; i < sizeof gbad / sizeof gbad[0]; i++) {
        setenv("CPAR_HOST_GEMM", gbad[i], 1);
        cpar_init_config cfg = {.backend = tu_backend(), .timeout_ms = TU_TIMEOUT_MS};
        cpar_status st = cpar_spawn_with(1, &cfg, tu_rank_nothing, NULL);
        const char *msg = cpar_thread_last_error();
        ck_assert_msg(st == CPAR_ERR_INVALID && strstr(msg, "CPAR_HOST_GEMM") && strstr(msg, "expected auto, builtin"),
                      "CPAR_HOST_GEMM=\"%s\": status %d, \"%s\", expected CPAR_ERR_INVALID naming the choices", gbad[i],
                      st, msg);
    }
    /* the SIMD kernels: taken, or refused naming what is missing (probe_kernel checks); the rest everywhere */
    static const char *const kernels[] = {"amx", "avx512bf16", "avx512", "avx2", "c", "builtin", "auto"};
    for (int i = 0; i < 7; i++) {
        const cpar_status st = probe_kernel(kernels[i]);
        if (i >= 4) TU_OK(st);
    }
    unsetenv("CPAR_HOST_GEMM");
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("linear: column- and row-parallel linear layers");
    struct {
        const char *name;
        const TTest *test;
        int count;
    } loops[] = {
        {"mlp_reference", test_mlp_matches_reference, 24},
        {"mlp_finite_differences", test_mlp_finite_differences, 2},
        {"options", test_options, N_OPT},
        {"init_random", test_init_random, 3},
        {"backward_overlap", test_backward_overlap, 2},
        {"bad_args", test_bad_args, 1},
        {"gemm_blocking", test_gemm_blocking, 15},
        {"gemm_kernels_agree", test_gemm_kernels_agree, 2},
        {"gemm_round_exact", test_gemm_round_exact, 11},
        {"grad_fusion", test_grad_fusion, 2 * N_GRAD_MODES},
        {"tied_weight", test_tied_weight, 3},
        {"runtime_gather_output", test_runtime_gather_output, 1},
        {"wgrad_deferral", test_wgrad_deferral, N_DEFER_MODES},
        {"bad_options", test_bad_options, 1},
        {"host_threads", test_host_threads, 4},
        {"host_threads_bad", test_host_threads_bad, 1},
    };
    for (size_t i = 0; i < sizeof loops / sizeof loops[0]; i++) {
        TCase *tc = tcase_create(loops[i].name);
        tcase_add_loop_test(tc, loops[i].test, 0, loops[i].count);
        tcase_set_timeout(tc, 120);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return tu_run_suite(suite()); }
