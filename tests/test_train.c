/* SPDX-License-Identifier: MIT */
/* tests/test_train.c — cpar.h §15 (AdamW, the global gradient norm and its
 * clipping, the coalesced gradient all-reduce) on the backend under test
 * (host loops; on sim and nccl-sim the fused AdamW kernel and the
 * deterministic sum of squares) against fp64 references. */
#include "testutil.h"

#define MAX_RANKS 8

/* ---- AdamW --------------------------------------------------------------------- */

typedef struct {
    cpar_dtype pdt; /* parameter dtype; F32 also runs param == master and param NULL */
    float wd, scale;
    int64_t n;
    int param_mode; /* 0: a separate param, 1: param == master, 2: param NULL */
} adamw_case;

/* Three steps of torch.optim.AdamW in fp64, state carried over. */
static void adamw_ref(double *w, double *m, double *v, const double *g, int64_t n, double lr, double b1, double b2,
                      double eps, double wd, double scale, int step) {
    const double bc1 = 1 - pow(b1, step), bc2 = 1 - pow(b2, step);
    for (int64_t i = 0; i < n; i++) {
        const double gi = g[i] * scale;
        w[i] *= 1 - lr * wd;
        m[i] = b1 * m[i] + (1 - b1) * gi;
        v[i] = b2 * v[i] + (1 - b2) * gi * gi;
        w[i] -= lr / bc1 * m[i] / (sqrt(v[i]) / sqrt(bc2) + eps);
    }
}

static cpar_status rank_adamw(cpar_ctx *ctx, void *arg) {
    const adamw_case *c = arg;
    const int64_t n = c->n;
    const cpar_adamw_config cfg = {.lr = 1e-2f, .beta1 = 0.8f, .beta2 = 0.99f, .eps = 1e-6f, .weight_decay = c->wd};
    double *w = tu_random_doubles(n, -1, 1, 1), *m = tu_random_doubles(n, -0.1, 0.1, 2);
    double *v = tu_random_doubles(n, 0.001, 0.01, 3); /* moments from earlier steps: never zero */
    float *wf = tu_to_f32(w, n), *mf = tu_to_f32(m, n), *vf = tu_to_f32(v, n);
    for (int64_t i = 0; i < n; i++) w[i] = wf[i], m[i] = mf[i], v[i] = vf[i]; /* the reference starts from the fp32 state */
    cpar_tensor tw = tu_upload(ctx, wf, CPAR_F32, 1, &n), tm = tu_upload(ctx, mf, CPAR_F32, 1, &n);
    cpar_tensor tv = tu_upload(ctx, vf, CPAR_F32, 1, &n);
    cpar_tensor tp = c->param_mode == 0 ? tu_alloc_poisoned(ctx, c->pdt, 1, &n) : c->param_mode == 1 ? tw : (cpar_tensor){0};
    for (int step = 1; step <= 3; step++) {
        double *g = tu_random_doubles(n, -1, 1, 10 + (uint64_t)step);
        float *gf = tu_to_f32(g, n);
        for (int64_t i = 0; i < n; i++) g[i] = gf[i];
        cpar_tensor tg = tu_upload(ctx, gf, CPAR_F32, 1, &n);
        TU_OK(cpar_adamw_step(ctx, &cfg, step, c->scale, &tg, &tw, &tm, &tv, c->param_mode == 2 ? NULL : &tp));
        adamw_ref(w, m, v, g, n, cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, c->scale, step);
        TU_OK(cpar_tensor_free(ctx, &tg));
        free(g), free(gf);
    }
    /* fp32 state after three steps: a few ulps of each quantity */
    void *got = tu_download(ctx, &tw);
    TU_EXPECT_CLOSE(got, CPAR_F32, w, n, 1e-5);
    free(got);
    got = tu_download(ctx, &tm);
    TU_EXPECT_CLOSE(got, CPAR_F32, m, n, 1e-5);
    free(got);
    got = tu_download(ctx, &tv);
    TU_EXPECT_CLOSE(got, CPAR_F32, v, n, 1e-5);
    free(got);
    if (c->param_mode == 0) { /* the parameter is the master rounded to its dtype */
        float *master = tu_download(ctx, &tw);
        double *want = malloc(sizeof(double) * (size_t)n);
        for (int64_t i = 0; i < n; i++) want[i] = tu_round(c->pdt, master[i]);
        got = tu_download(ctx, &tp);
        TU_EXPECT_CLOSE(got, c->pdt, want, n, 0.0);
        free(got), free(master), free(want);
        TU_OK(cpar_tensor_free(ctx, &tp));
    }
    TU_OK(cpar_tensor_free(ctx, &tw));
    TU_OK(cpar_tensor_free(ctx, &tm));
    TU_OK(cpar_tensor_free(ctx, &tv));
    free(w), free(m), free(v), free(wf), free(mf), free(vf);
    return CPAR_OK;
}

START_TEST(test_adamw) {
    /* _i: size x dtype/mode x (weight decay, scale) */
    static const int64_t sizes[] = {1, 1000, 4099};
    static const struct { cpar_dtype dt; int mode; } kinds[] = {
        {CPAR_F32, 0}, {CPAR_F16, 0}, {CPAR_BF16, 0}, {CPAR_F32, 1}, {CPAR_F32, 2}};
    adamw_case c = {.n = sizes[_i % 3], .pdt = kinds[(_i / 3) % 5].dt, .param_mode = kinds[(_i / 3) % 5].mode,
                    .wd = _i / 15 ? 0.1f : 0.f, .scale = _i / 15 ? 0.5f : 1.f};
    TU_OK(tu_spawn(1, rank_adamw, &c));
}
END_TEST

/* ---- the global norm and clipping ------------------------------------------------ */

/* The model: three tensors sharded over tp along their rows and two norm
 * weights replicated over tp. Row counts are multiples of 12 (tp 1..4). */
#define N_TENSORS 5
static const int64_t rows_of[N_TENSORS] = {24, 12, 36, 1, 1}, cols_of[N_TENSORS] = {5, 7, 3, 9, 4};
static bool duplicated(int i) { return i >= 3; }

typedef struct {
    int tp, cp, dp;
    double want;        /* fp64 norm of the full tensors */
    float max_ratio;    /* max_norm = ratio * want */
} norm_case;

/* Full tensor t's values (the same on every rank: after the data-parallel
 * reduction every dp and cp replica holds them). */
static double full_value(int t, int64_t i) {
    uint64_t s = (uint64_t)t * 1000003u + (uint64_t)i * 7919u + 5;
    return tu_uniform(&s);
}

static cpar_status rank_norm(cpar_ctx *ctx, void *arg) {
    norm_case *c = arg;
    cpar_grid_config gc = {.tp = c->tp, .cp = c->cp};
    TU_OK(cpar_grid_init(ctx, &gc));
    cpar_group *tp = cpar_grid_group(ctx, CPAR_GROUP_TP);
    const int n = cpar_group_size(tp), r = cpar_group_rank(tp);
    cpar_tensor g[N_TENSORS], *gp[N_TENSORS];
    bool dup[N_TENSORS];
    double *local[N_TENSORS];
    for (int t = 0; t < N_TENSORS; t++) {
        const int64_t rows = duplicated(t) ? rows_of[t] : rows_of[t] / n, s[2] = {rows, cols_of[t]};
        const int64_t r0 = duplicated(t) ? 0 : r * rows;
        local[t] = malloc(sizeof(double) * (size_t)(rows * cols_of[t]));
        float *h = malloc(sizeof(float) * (size_t)(rows * cols_of[t]));
        for (int64_t i = 0; i < rows * cols_of[t]; i++) h[i] = (float)full_value(t, r0 * cols_of[t] + i);
        g[t] = tu_upload(ctx, h, CPAR_F32, 2, s);
        gp[t] = &g[t];
        dup[t] = duplicated(t);
        for (int64_t i = 0; i < rows * cols_of[t]; i++) local[t][i] = h[i];
        free(h);
    }
    float norm = -1.f, coef = -1.f;
    TU_OK(cpar_grad_norm(tp, (const cpar_tensor *const *)gp, dup, N_TENSORS, &norm));
    ck_assert_msg(fabs(norm - c->want) <= 1e-5 * c->want, "tp %d cp %d dp %d: norm %.8g, expected %.8g", c->tp, c->cp,
                  c->dp, norm, c->want);
    /* clipping: scaled exactly when max_norm < norm, untouched otherwise */
    const float max_norm = (float)(c->max_ratio * c->want);
    TU_OK(cpar_clip_grad_norm(tp, gp, dup, N_TENSORS, max_norm, &norm, &coef));
    const bool clipped = c->max_ratio < 1.f;
    const double want_coef = clipped ? max_norm / (norm + 1e-6f) : 1.0;
    ck_assert_msg(fabs(coef - want_coef) <= 1e-6 * want_coef, "coef %.8g, expected %.8g", coef, want_coef);
    for (int t = 0; t < N_TENSORS; t++) {
        float *got = tu_download(ctx, &g[t]);
        for (int64_t i = 0; i < cpar_tensor_numel(&g[t]); i++) {
            const float want = clipped ? (float)local[t][i] * coef : (float)local[t][i];
            ck_assert_msg(got[i] == want, "tensor %d element %lld: %.9g, expected %.9g", t, (long long)i, got[i], want);
        }
        free(got);
        free(local[t]);
        TU_OK(cpar_tensor_free(ctx, &g[t]));
    }
    return CPAR_OK;
}

START_TEST(test_grad_norm) {
    static const int grids[][3] = {{1, 1, 1}, {2, 1, 1}, {3, 1, 1}, {4, 1, 1}, {1, 2, 1}, {1, 3, 1}, {1, 4, 1},
                                   {1, 1, 2}, {1, 1, 3}, {1, 1, 4}, {2, 2, 1}, {2, 1, 2}, {4, 2, 1}, {2, 2, 2},
                                   {1, 2, 4}, {3, 1, 2}};
    const int *gr = grids[_i / 2];
    norm_case c = {.tp = gr[0], .cp = gr[1], .dp = gr[2], .max_ratio = _i % 2 ? 0.5f : 2.f};
    double sum = 0.0; /* every full tensor once */
    for (int t = 0; t < N_TENSORS; t++)
        for (int64_t i = 0; i < rows_of[t] * cols_of[t]; i++) {
            const double v = (float)full_value(t, i);
            sum += v * v;
        }
    c.want = sqrt(sum);
    TU_OK(tu_spawn(c.tp * c.cp * c.dp, rank_norm, &c));
}
END_TEST

/* A NaN or inf gradient on one rank: every rank's norm is non-finite (the
 * tp all-reduce carries it), the call returns CPAR_OK with *coef 1 and no
 * gradient changes (the caller decides: skip the step or stop). */
static cpar_status rank_norm_nonfinite(cpar_ctx *ctx, void *arg) {
    const float bad = *(const float *)arg;
    cpar_group *w = cpar_world_group(ctx);
    const int r = cpar_rank(ctx);
    const int64_t s[1] = {5};
    float h[5] = {1.f, -2.f, 0.5f, 3.f, -0.25f};
    if (r == cpar_world_size(ctx) - 1) h[2] = bad;
    cpar_tensor g = tu_upload(ctx, h, CPAR_F32, 1, s), *gp = &g;
    float norm = 0.f, coef = -1.f;
    TU_OK(cpar_clip_grad_norm(w, &gp, NULL, 1, 1.f, &norm, &coef));
    ck_assert_msg(isnan(bad) ? isnan(norm) : isinf(norm), "rank %d: norm %g with a %g gradient", r, norm, bad);
    ck_assert_msg(coef == 1.f, "rank %d: coef %g, expected 1 (nothing scaled)", r, coef);
    float *got = tu_download(ctx, &g);
    TU_EXPECT_SAME(got, h, CPAR_F32, 5);
    free(got);
    TU_OK(cpar_tensor_free(ctx, &g));
    return CPAR_OK;
}

START_TEST(test_clip_nonfinite) {
    const float bad = _i % 2 ? INFINITY : NAN;
    TU_OK(tu_spawn(_i / 2 + 1, rank_norm_nonfinite, (void *)&bad));
}
END_TEST

/* ---- the coalesced all-reduce ---------------------------------------------------- */

#define N_GRADS 4
static const int64_t grad_sizes[N_GRADS] = {1, 7, 1000, 33};

typedef struct {
    bool average;
} reduce_case;

static cpar_status rank_reduce(cpar_ctx *ctx, void *arg) {
    const reduce_case *c = arg;
    cpar_group *w = cpar_world_group(ctx);
    const int n = cpar_group_size(w), me = cpar_group_rank(w);
    cpar_tensor g[N_GRADS], *gp[N_GRADS];
    int64_t total = 0;
    for (int t = 0; t < N_GRADS; t++) {
        float *h = tu_random_host(CPAR_F32, grad_sizes[t], 100 * (uint64_t)me + (uint64_t)t);
        g[t] = tu_upload(ctx, h, CPAR_F32, 1, &grad_sizes[t]);
        gp[t] = &g[t];
        total += grad_sizes[t];
        free(h);
    }
    TU_OK(cpar_group_stats_reset(w));
    TU_OK(cpar_grads_all_reduce(w, gp, N_GRADS, c->average));
    for (int t = 0; t < N_GRADS; t++) {
        double *want = calloc((size_t)grad_sizes[t], sizeof *want);
        for (int r = 0; r < n; r++) {
            float *x = tu_random_host(CPAR_F32, grad_sizes[t], 100 * (uint64_t)r + (uint64_t)t);
            for (int64_t i = 0; i < grad_sizes[t]; i++) want[i] += x[i];
            free(x);
        }
        for (int64_t i = 0; c->average && i < grad_sizes[t]; i++) want[i] /= n;
        void *got = tu_download(ctx, &g[t]);
        TU_EXPECT_CLOSE(got, CPAR_F32, want, grad_sizes[t], 4e-6 * n);
        free(got), free(want);
        TU_OK(cpar_tensor_free(ctx, &g[t]));
    }
    /* one all-reduce of every gradient's bytes, what cpar_all_reduce of them counts */
    cpar_comm_stats st;
    TU_OK(cpar_group_stats(w, &st));
    const int64_t share = total / n + (me < total % n), bytes = 4 * total;
    const uint64_t moved = n > 1 ? (uint64_t)(bytes - 4 * share) + (uint64_t)(n - 1) * 4 * (uint64_t)share : 0;
    ck_assert_int_eq(st.kind[CPAR_COLL_ALL_REDUCE].calls, 1);
    ck_assert_uint_eq(st.kind[CPAR_COLL_ALL_REDUCE].bytes_sent, moved);
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++)
        if (k != CPAR_COLL_ALL_REDUCE) ck_assert_int_eq(st.kind[k].calls, 0);
    return CPAR_OK;
}

START_TEST(test_grads_all_reduce) {
    reduce_case c = {.average = _i % 2};
    TU_OK(tu_spawn(_i / 2 + 1, rank_reduce, &c));
}
END_TEST

/* ---- bad arguments ---------------------------------------------------------------- */

static cpar_status rank_bad(cpar_ctx *ctx, void *arg) {
    (void)arg;
    const int64_t four = 4, five = 5;
    cpar_tensor a = tu_alloc_poisoned(ctx, CPAR_F32, 1, &four), b = tu_alloc_poisoned(ctx, CPAR_F32, 1, &four);
    cpar_tensor c = tu_alloc_poisoned(ctx, CPAR_F32, 1, &four), d = tu_alloc_poisoned(ctx, CPAR_F32, 1, &four);
    cpar_tensor h16 = tu_alloc_poisoned(ctx, CPAR_F16, 1, &four), e5 = tu_alloc_poisoned(ctx, CPAR_F32, 1, &five);
    cpar_tensor i32 = tu_alloc_poisoned(ctx, CPAR_I32, 1, &four);
    const cpar_adamw_config ok = {.lr = 1e-3f};
    TU_FAILS(cpar_adamw_step(NULL, &ok, 1, 1.f, &a, &b, &c, &d, NULL), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_adamw_step(ctx, NULL, 1, 1.f, &a, &b, &c, &d, NULL), CPAR_ERR_INVALID, "cfg");
    TU_FAILS(cpar_adamw_step(ctx, &ok, 0, 1.f, &a, &b, &c, &d, NULL), CPAR_ERR_INVALID, "step is 0");
    TU_FAILS(cpar_adamw_step(ctx, &ok, 1, NAN, &a, &b, &c, &d, NULL), CPAR_ERR_INVALID, "grad_scale");
    cpar_adamw_config bad = ok;
    bad.lr = -1.f;
    TU_FAILS(cpar_adamw_step(ctx, &bad, 1, 1.f, &a, &b, &c, &d, NULL), CPAR_ERR_INVALID, "cfg.lr is -1");
    bad = ok, bad.beta1 = 1.5f;
    TU_FAILS(cpar_adamw_step(ctx, &bad, 1, 1.f, &a, &b, &c, &d, NULL), CPAR_ERR_INVALID, "cfg.beta1 is 1.5");
    bad = ok, bad.beta2 = -0.5f;
    TU_FAILS(cpar_adamw_step(ctx, &bad, 1, 1.f, &a, &b, &c, &d, NULL), CPAR_ERR_INVALID, "cfg.beta2");
    bad = ok, bad.eps = -1.f;
    TU_FAILS(cpar_adamw_step(ctx, &bad, 1, 1.f, &a, &b, &c, &d, NULL), CPAR_ERR_INVALID, "cfg.eps");
    bad = ok, bad.weight_decay = -0.1f;
    TU_FAILS(cpar_adamw_step(ctx, &bad, 1, 1.f, &a, &b, &c, &d, NULL), CPAR_ERR_INVALID, "cfg.weight_decay");
    TU_FAILS(cpar_adamw_step(ctx, &ok, 1, 1.f, NULL, &b, &c, &d, NULL), CPAR_ERR_INVALID, "grad is NULL");
    TU_FAILS(cpar_adamw_step(ctx, &ok, 1, 1.f, &a, &b, NULL, &d, NULL), CPAR_ERR_INVALID, "m is NULL");
    TU_FAILS(cpar_adamw_step(ctx, &ok, 1, 1.f, &h16, &b, &c, &d, NULL), CPAR_ERR_INVALID, "grad has dtype f16");
    TU_FAILS(cpar_adamw_step(ctx, &ok, 1, 1.f, &a, &b, &c, &e5, NULL), CPAR_ERR_INVALID, "v has shape [5]");
    TU_FAILS(cpar_adamw_step(ctx, &ok, 1, 1.f, &a, &b, &c, &c, NULL), CPAR_ERR_INVALID, "v overlaps m");
    TU_FAILS(cpar_adamw_step(ctx, &ok, 1, 1.f, &a, &b, &c, &d, &i32), CPAR_ERR_INVALID, "param has dtype i32");
    TU_FAILS(cpar_adamw_step(ctx, &ok, 1, 1.f, &a, &b, &c, &d, &a), CPAR_ERR_INVALID, "param overlaps grad");
    cpar_group *w = cpar_world_group(ctx);
    cpar_tensor *gs[2] = {&a, &b}, *g16[1] = {&h16}, *gdup[2] = {&a, &a};
    float norm;
    TU_FAILS(cpar_grad_norm(NULL, (const cpar_tensor *const *)gs, NULL, 2, &norm), CPAR_ERR_INVALID, "group");
    TU_FAILS(cpar_grad_norm(w, (const cpar_tensor *const *)gs, NULL, 2, NULL), CPAR_ERR_INVALID, "norm is NULL");
    TU_FAILS(cpar_grad_norm(w, NULL, NULL, 2, &norm), CPAR_ERR_INVALID, "grads is NULL");
    TU_FAILS(cpar_grad_norm(w, (const cpar_tensor *const *)gs, NULL, -1, &norm), CPAR_ERR_INVALID, "n is -1");
    TU_FAILS(cpar_grad_norm(w, (const cpar_tensor *const *)g16, NULL, 1, &norm), CPAR_ERR_INVALID, "grads[0] has dtype f16");
    TU_FAILS(cpar_clip_grad_norm(w, gs, NULL, 2, 0.f, &norm, NULL), CPAR_ERR_INVALID, "max_norm is 0");
    TU_FAILS(cpar_grads_all_reduce(NULL, gs, 2, false), CPAR_ERR_INVALID, "group");
    TU_FAILS(cpar_grads_all_reduce(w, gdup, 2, false), CPAR_ERR_INVALID, "grads[1] overlaps grads[0]");
    TU_FAILS(cpar_grads_all_reduce(w, g16, 1, false), CPAR_ERR_INVALID, "grads[0] has dtype f16");
    TU_OK(cpar_grad_norm(w, NULL, NULL, 0, &norm)); /* nothing: norm 0 */
    ck_assert_float_eq(norm, 0.f);
    cpar_tensor *ts[] = {&a, &b, &c, &d, &h16, &e5, &i32};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) TU_OK(cpar_tensor_free(ctx, ts[i]));
    return CPAR_OK;
}

START_TEST(test_bad_args) { TU_OK(tu_spawn(1, rank_bad, NULL)); }
END_TEST

int main(void) {
    Suite *s = suite_create("train: AdamW, gradient norm and clipping, coalesced gradient all-reduce");
    const tu_loop loops[] = {
        {"adamw", test_adamw, 30},
        {"grad_norm", test_grad_norm, 32},
        {"clip_nonfinite", test_clip_nonfinite, 8},
        {"grads_all_reduce", test_grads_all_reduce, 8},
        {"bad_args", test_bad_args, 1},
    };
    tu_add_loops(s, loops, sizeof loops / sizeof loops[0], 120);
    return tu_run_suite(s);
}
