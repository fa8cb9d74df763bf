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
 *    stream, GEMMs on compute, joined by events): on the sim backend its
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
/* dX[T,K] = dY[T,N] W[N,K] over the output columns with mask[o] (NULL: all). */
static void ref_dgrad(const double *dY, const double *W, int64_t T, int64_t K, int64_t N, const bool *mask, double *dX) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            double a = 0.0;
            for (int64_t o = 0; o < N; o++)
                if (!mask || mask[o]) a += dY[t * N + o] * W[o * K + k];
            dX[t * K + k] = a;
        }
}
/* dW[N,K] = dY^T X, db[N] = sum dY. */
static void ref_wgrad(const double *dY, const double *X, int64_t T, int64_t K, int64_t N, double *dW, double *db) {
    for (int64_t o = 0; o < N; o++) {
        double s = 0.0;
        for (int64_t t = 0; t < T; t++) s += dY[t * N + o];
        db[o] = s;
        for (int64_t k = 0; k < K; k++) {
            double a = 0.0;
            for (int64_t t = 0; t < T; t++) a += dY[t * N + o] * X[t * K + k];
            dW[o * K + k] = a;
        }
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
        TU_OK(cpar_dev_gemm(h, NULL, 0, 0, (int)K, (int)T, (int)Nl, 1.f, w.data, CPAR_F32, (int)K, 0, dy.data,
                            (int)Nl, 0, 0.f, dX.data, CPAR_F32, (int)K, 0, 1));
        if (sp) TU_OK(cpar_reduce_scatter(g, &dX, &dxs, CPAR_SUM, NULL));
        else {
            TU_OK(cpar_all_reduce(g, &dX, &dX, CPAR_SUM));
            TU_OK(cpar_tensor_copy(ctx, &dX, &dxs));
        }
        TU_OK(cpar_dev_gemm(h, NULL, 0, 1, (int)K, (int)Nl, (int)T, 1.f, xg.data, CPAR_F32, (int)K, 0, dy.data,
                            (int)Nl, 0, 1.f, dWs.data, CPAR_F32, (int)K, 0, 1));
        TU_OK(cpar_sync(ctx));
        float *dx3 = tu_download(ctx, &dxs), *dw3 = tu_download(ctx, &dWs);
        ck_assert_msg(!memcmp(dx1, dx3, (size_t)(Tx * K) * 4), "overlap dx differs from the sequential order");
        ck_assert_msg(!memcmp(dw1, dw3, (size_t)(Nl * K) * 4), "overlap dW differs from the sequential order");
        free(dx3), free(dw3);
        cpar_tensor *tmp[] = {&xg, &dX, &dWs, &dxs};
        for (size_t i = 0; i < 4; i++) TU_OK(cpar_tensor_free(ctx, tmp[i]));
        TU_OK(cpar_dev_blas_destroy(h));
    }

    /* no dx: the gather alone (SP), nothing without SP */
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_linear_backward(l, &dy, NULL));
    TU_OK(cpar_group_stats(g, &st));
    ck_assert(st.kind[CPAR_COLL_ALL_GATHER].calls == (uint64_t)sp && st.kind[CPAR_COLL_REDUCE_SCATTER].calls == 0 &&
              st.kind[CPAR_COLL_ALL_REDUCE].calls == 0);

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

static cpar_status rank_blocking(cpar_ctx *ctx, void *arg) {
    const cpar_dtype dt = *(const cpar_dtype *)arg;
    enum { K = 300, N = 37, T = 3100 };
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
    TU_OK(cpar_linear_forward(l, &x, &y, NULL));
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
    cpar_tensor *ts[] = {&x, &dy, &y, &dx};
    for (int i = 0; i < 4; i++) TU_OK(cpar_tensor_free(ctx, ts[i]));
    TU_OK(cpar_linear_destroy(l));
    free(W), free(bias), free(X), free(dY), free(mw), free(mb), free(yref), free(dxref), free(dwref), free(dbref);
    return CPAR_OK;
}

START_TEST(test_gemm_blocking) {
    /* F32 twice: the default path (a CBLAS when the build has one) and cpar's
     * own kernel (CPAR_HOST_GEMM=builtin, read when the context is made) */
    static const cpar_dtype dts[] = {CPAR_F32, CPAR_F32, CPAR_BF16, CPAR_F16};
    if (_i == 1) setenv("CPAR_HOST_GEMM", "builtin", 1); /* this forked test's own environment */
    TU_OK(tu_spawn(1, rank_blocking, (void *)&dts[_i]));
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
        {"gemm_blocking", test_gemm_blocking, 4},
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
