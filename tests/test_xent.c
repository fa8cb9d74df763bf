/* SPDX-License-Identifier: MIT */
/* test_xent.c — vocabulary-parallel cross entropy (cpar.h §10).
 *
 * Every case builds one set of random global logits [N, V] and targets that
 * land in every rank's vocabulary slice; rank r of a tp-rank job gets columns
 * [r V/tp, (r+1) V/tp). Loss, stats and dlogits are compared with a
 * single-rank fp64 reference over the full vocabulary (from the same
 * dtype-rounded values), at tp 1..4, label smoothing 0 and 0.1, F32/F16/BF16
 * logits, I32/I64 targets, short rows (warp kernel) and a long one (block
 * kernel), aligned (vectorised) and odd vocab slices. Row 1 holds one huge
 * logit, so its other probabilities underflow in fp32: the loss stays finite.
 * Also: loss bitwise identical on every rank, the all-reduce byte counts,
 * in-place backward, finite differences of the backward, bad input.
 *
 * The embedding: forward (all-reduce and reduce-scatter modes) against the
 * global table lookup, backward against an fp64 scatter-add into a non-zero
 * main grad, deterministic and atomic, at tp 1..4; the deterministic mode is
 * bitwise reproducible across two runs. The cpar_embedding layer at tp 1..4
 * (init_from_master) equals the tp = 1 layer (forward output, gathered main
 * grad), both output modes; main-grad accumulation and zero_grad;
 * init_random under the model-parallel fork (reproducible, distinct per TP
 * rank); a vocabulary not divisible by tp; bad arguments. */
#include "testutil.h"

#define MAX_TP 4
#define HUGE_LOGIT 200.0

typedef struct {
    int tp;
    cpar_dtype dt, tdt;
    float alpha;
    int64_t rows, vocab; /* vocab: global, divisible by tp */
    bool in_place;
    double *z;           /* [rows, vocab], values as dt holds them */
    int64_t *t;          /* [rows] */
    double *dloss;       /* [rows] */
    double *loss_ref, *lse_ref, *dz_ref;
    float *loss_by_rank[MAX_TP];
} xent_case;

static void reference(xent_case *c) {
    int64_t V = c->vocab;
    double s = c->alpha > 0.f ? (double)c->alpha * (double)V / (double)(V - 1) : 0.0;
    for (int64_t r = 0; r < c->rows; r++) {
        const double *z = c->z + r * V;
        double m = -INFINITY, sum = 0.0, zsum = 0.0;
        for (int64_t j = 0; j < V; j++) m = fmax(m, z[j]);
        for (int64_t j = 0; j < V; j++) sum += exp(z[j] - m), zsum += z[j];
        double lse = m + log(sum), nll = lse - z[c->t[r]];
        c->lse_ref[r] = lse;
        c->loss_ref[r] = (1.0 - s) * nll - s * (zsum / (double)V - lse);
        for (int64_t j = 0; j < V; j++)
            c->dz_ref[r * V + j] = (exp(z[j] - lse) - s / (double)V - (j == c->t[r] ? 1.0 - s : 0.0)) * c->dloss[r];
    }
}

static void case_init(xent_case *c, int tp, cpar_dtype dt, cpar_dtype tdt, float alpha, int64_t rows, int64_t vocab,
                      uint64_t seed) {
    memset(c, 0, sizeof *c);
    c->tp = tp, c->dt = dt, c->tdt = tdt, c->alpha = alpha, c->rows = rows, c->vocab = vocab;
    c->z = malloc(sizeof(double) * (size_t)(rows * vocab));
    c->t = malloc(sizeof(int64_t) * (size_t)rows);
    c->dloss = malloc(sizeof(double) * (size_t)rows);
    c->loss_ref = malloc(sizeof(double) * (size_t)rows);
    c->lse_ref = malloc(sizeof(double) * (size_t)rows);
    c->dz_ref = malloc(sizeof(double) * (size_t)(rows * vocab));
    uint64_t st = seed * 0x9e3779b97f4a7c15ull + 7;
    int64_t vl = vocab / tp;
    for (int64_t i = 0; i < rows * vocab; i++) c->z[i] = tu_round(dt, 4.0 * tu_uniform(&st));
    for (int64_t r = 0; r < rows; r++) {
        c->t[r] = (r % tp) * vl + (int64_t)(tu_next(&st) % (uint64_t)vl); /* every rank's range */
        c->dloss[r] = (double)(float)(0.5 + 0.5 * tu_uniform(&st));
    }
    if (rows > 1) c->z[1 * vocab + (c->t[1] + vl / 2 + 1) % vocab] = HUGE_LOGIT; /* not the target */
    if (rows > 2 && alpha == 0.f) /* a masked vocabulary (-inf): every third logit and each rank's first 16 */
        for (int64_t j = 0; j < vocab; j++)
            if (j != c->t[2] && (j % 3 == 0 || j % vl < 16)) c->z[2 * vocab + j] = -INFINITY;
    reference(c);
}

static void case_free(xent_case *c) {
    free(c->z), free(c->t), free(c->dloss), free(c->loss_ref), free(c->lse_ref), free(c->dz_ref);
    for (int r = 0; r < MAX_TP; r++) free(c->loss_by_rank[r]);
}

/* Expected all-reduce bytes (cpar.h §5) of n floats over p ranks at rank r. */
static uint64_t allreduce_bytes(int64_t n, int p, int r) {
    if (p == 1) return 0;
    int64_t base = n / p, rem = n % p, c = base + (r < rem ? 1 : 0);
    return (uint64_t)((n - c) + (int64_t)(p - 1) * c) * 4u;
}

static cpar_status rank_xent(cpar_ctx *ctx, void *arg) {
    xent_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int r = cpar_group_rank(g), p = cpar_group_size(g);
    int64_t vl = c->vocab / p, N = c->rows;
    /* logits [N/3, 3, vl] ([s, b, v/tp]) when N divides by 3, else [N, vl] */
    int ndim = N % 3 == 0 ? 2 : 1;
    int64_t tshape[2] = {N % 3 == 0 ? N / 3 : N, 3}, zshape[3] = {tshape[0], 3, vl}, sshape[3] = {tshape[0], 3, 2};
    if (ndim == 1) zshape[1] = vl, sshape[1] = 2;
    void *hz = malloc((size_t)(N * vl) * cpar_dtype_size(c->dt));
    void *ht = malloc((size_t)N * cpar_dtype_size(c->tdt));
    float *hdl = malloc(sizeof(float) * (size_t)N);
    for (int64_t i = 0; i < N; i++) {
        for (int64_t j = 0; j < vl; j++) tu_set(hz, c->dt, i * vl + j, c->z[i * c->vocab + r * vl + j]);
        tu_set(ht, c->tdt, i, (double)c->t[i]);
        hdl[i] = (float)c->dloss[i];
    }
    cpar_tensor z = tu_upload(ctx, hz, c->dt, ndim + 1, zshape);
    cpar_tensor t = tu_upload(ctx, ht, c->tdt, ndim, tshape);
    cpar_tensor dl = tu_upload(ctx, hdl, CPAR_F32, ndim, tshape);
    cpar_tensor loss = tu_alloc_poisoned(ctx, CPAR_F32, ndim, tshape);
    cpar_tensor stats = tu_alloc_poisoned(ctx, CPAR_F32, ndim + 1, sshape);

    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t, c->alpha, &loss, &stats));
    cpar_comm_stats cs;
    TU_OK(cpar_group_stats(g, &cs));
    int k = c->alpha > 0.f ? 3 : 2;
    uint64_t want = allreduce_bytes(N, p, r) + allreduce_bytes(k * N, p, r);
    ck_assert_uint_eq(cs.kind[CPAR_COLL_ALL_REDUCE].calls, 2);
    ck_assert_uint_eq(cs.kind[CPAR_COLL_ALL_REDUCE].bytes_sent, want);
    for (int kk = 0; kk < CPAR_COLL_KIND_COUNT; kk++)
        if (kk != CPAR_COLL_ALL_REDUCE) ck_assert_uint_eq(cs.kind[kk].calls, 0);

    float *hl = tu_download(ctx, &loss), *hs = tu_download(ctx, &stats);
    for (int64_t i = 0; i < N; i++) ck_assert_msg(isfinite(hl[i]), "row %lld: loss %g", (long long)i, hl[i]);
    TU_EXPECT_CLOSE(hl, CPAR_F32, c->loss_ref, N, 2e-6);
    double *lse2 = malloc(sizeof(double) * (size_t)N);
    float *lse_got = malloc(sizeof(float) * (size_t)N);
    for (int64_t i = 0; i < N; i++) lse2[i] = c->lse_ref[i], lse_got[i] = hs[2 * i + 1];
    TU_EXPECT_CLOSE(lse_got, CPAR_F32, lse2, N, 4e-7);
    c->loss_by_rank[r] = hl;

    cpar_tensor dz = c->in_place ? z : tu_alloc_poisoned(ctx, c->dt, ndim + 1, zshape);
    TU_OK(cpar_vocab_parallel_cross_entropy_backward(g, &z, &t, c->alpha, &stats, &dl, &dz));
    void *hdz = tu_download(ctx, &dz);
    double *want_dz = malloc(sizeof(double) * (size_t)(N * vl));
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < vl; j++) want_dz[i * vl + j] = c->dz_ref[i * c->vocab + r * vl + j];
    double tol = c->dt == CPAR_F32 ? 1e-6 : tu_tol(c->dt);
    TU_EXPECT_CLOSE(hdz, c->dt, want_dz, N * vl, tol);

    free(hz), free(ht), free(hdl), free(hs), free(lse2), free(lse_got), free(hdz), free(want_dz);
    if (!c->in_place) TU_OK(cpar_tensor_free(ctx, &dz));
    TU_OK(cpar_tensor_free(ctx, &z));
    TU_OK(cpar_tensor_free(ctx, &t));
    TU_OK(cpar_tensor_free(ctx, &dl));
    TU_OK(cpar_tensor_free(ctx, &loss));
    TU_OK(cpar_tensor_free(ctx, &stats));
    return CPAR_OK;
}

static void run_case(int tp, cpar_dtype dt, cpar_dtype tdt, float alpha, int64_t rows, int64_t vl, bool in_place,
                     uint64_t seed) {
    xent_case c;
    case_init(&c, tp, dt, tdt, alpha, rows, vl * tp, seed);
    c.in_place = in_place;
    TU_OK(tu_spawn(tp, rank_xent, &c));
    for (int r = 1; r < tp; r++) /* the loss is the same on every rank, bit for bit */
        ck_assert_msg(!memcmp(c.loss_by_rank[0], c.loss_by_rank[r], sizeof(float) * (size_t)rows),
                      "tp %d: loss on rank %d differs from rank 0", tp, r);
    case_free(&c);
}

static const cpar_dtype float_dtypes[] = {CPAR_F32, CPAR_F16, CPAR_BF16};

/* _i = (tp - 1) * 3 + dtype */
START_TEST(test_xent_matches_reference) {
    int tp = _i / 3 + 1;
    cpar_dtype dt = float_dtypes[_i % 3];
    for (int a = 0; a < 2; a++)
        for (int ti = 0; ti < 2; ti++)
            for (int v = 0; v < 2; v++)
                run_case(tp, dt, ti ? CPAR_I64 : CPAR_I32, a ? 0.1f : 0.f, 15, v ? 16 : 13, false,
                         (uint64_t)(_i * 8 + a * 4 + ti * 2 + v));
}
END_TEST

START_TEST(test_xent_long_rows_and_in_place) {
    run_case(2, CPAR_F32, CPAR_I64, 0.1f, 4, 1100, false, 101); /* block kernel */
    run_case(1, CPAR_BF16, CPAR_I32, 0.f, 3, 1027, false, 102);
    for (int tp = 1; tp <= 3; tp++) {
        run_case(tp, CPAR_F32, CPAR_I64, 0.1f, 6, 13, true, 103 + (uint64_t)tp);
        run_case(tp, CPAR_F16, CPAR_I32, 0.f, 6, 16, true, 110 + (uint64_t)tp);
    }
}
END_TEST

/* ---- finite differences: dL/dz for L = sum_r dloss_r loss_r ---------------------------- */

static double fd_loss(cpar_ctx *ctx, cpar_group *g, cpar_tensor *z, cpar_tensor *t, float alpha, cpar_tensor *loss,
                      cpar_tensor *stats, const double *dloss) {
    TU_OK(cpar_vocab_parallel_cross_entropy_forward(g, z, t, alpha, loss, stats));
    float *hl = tu_download(ctx, loss);
    double L = 0.0;
    for (int64_t i = 0; i < loss->shape[0]; i++) L += dloss[i] * hl[i];
    free(hl);
    return L;
}

static cpar_status rank_fd(cpar_ctx *ctx, void *arg) {
    xent_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int r = cpar_group_rank(g), p = cpar_group_size(g);
    int64_t vl = c->vocab / p, N = c->rows, zshape[2] = {N, vl}, sshape[2] = {N, 2};
    float *hz = malloc(sizeof(float) * (size_t)(N * vl)), *hdl = malloc(sizeof(float) * (size_t)N);
    int64_t *ht = malloc(sizeof(int64_t) * (size_t)N);
    for (int64_t i = 0; i < N; i++) {
        for (int64_t j = 0; j < vl; j++) hz[i * vl + j] = (float)c->z[i * c->vocab + r * vl + j];
        ht[i] = c->t[i], hdl[i] = (float)c->dloss[i];
    }
    cpar_tensor z = tu_upload(ctx, hz, CPAR_F32, 2, zshape), t = tu_upload(ctx, ht, CPAR_I64, 1, &N);
    cpar_tensor dl = tu_upload(ctx, hdl, CPAR_F32, 1, &N);
    cpar_tensor loss = tu_alloc_poisoned(ctx, CPAR_F32, 1, &N), stats = tu_alloc_poisoned(ctx, CPAR_F32, 2, sshape);
    cpar_tensor dz = tu_alloc_poisoned(ctx, CPAR_F32, 2, zshape);
    TU_OK(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t, c->alpha, &loss, &stats));
    TU_OK(cpar_vocab_parallel_cross_entropy_backward(g, &z, &t, c->alpha, &stats, &dl, &dz));
    float *hdz = tu_download(ctx, &dz);
    const float eps = 1e-2f;
    for (int64_t i = 0; i < N; i++)
        for (int64_t jg = 0; jg < c->vocab; jg++) { /* every rank walks every global element */
            int owner = (int)(jg / vl);
            int64_t idx = i * vl + jg % vl;
            float orig = hz[idx];
            double L[2];
            for (int sgn = 0; sgn < 2; sgn++) {
                if (owner == r) {
                    hz[idx] = orig + (sgn ? -eps : eps);
                    cpar_tensor h = cpar_tensor_make(hz, CPAR_F32, 2, zshape, CPAR_HOST);
                    TU_OK(cpar_tensor_copy(ctx, &h, &z));
                }
                L[sgn] = fd_loss(ctx, g, &z, &t, c->alpha, &loss, &stats, c->dloss);
                if (owner == r) {
                    hz[idx] = orig;
                    cpar_tensor h = cpar_tensor_make(hz, CPAR_F32, 2, zshape, CPAR_HOST);
                    TU_OK(cpar_tensor_copy(ctx, &h, &z));
                }
            }
            if (owner != r) continue;
            double fd = (L[0] - L[1]) / (2.0 * eps), an = hdz[idx];
            ck_assert_msg(fabs(fd - an) <= 2e-3 * (1.0 + fabs(an)), "d loss / d z[%lld,%lld]: analytic %g, fd %g",
                          (long long)i, (long long)jg, an, fd);
        }
    free(hz), free(hdl), free(ht), free(hdz);
    TU_OK(cpar_tensor_free(ctx, &z));
    TU_OK(cpar_tensor_free(ctx, &t));
    TU_OK(cpar_tensor_free(ctx, &dl));
    TU_OK(cpar_tensor_free(ctx, &loss));
    TU_OK(cpar_tensor_free(ctx, &stats));
    TU_OK(cpar_tensor_free(ctx, &dz));
    return CPAR_OK;
}

START_TEST(test_xent_finite_differences) {
    for (int a = 0; a < 2; a++) {
        int tp = _i + 1;
        xent_case c;
        case_init(&c, tp, CPAR_F32, CPAR_I64, a ? 0.1f : 0.f, 3, 3 * tp, 200 + (uint64_t)(_i * 2 + a));
        for (int64_t i = 0; i < 3 * 3 * tp; i++) c.z[i] = fmin(c.z[i], 4.0); /* no huge logit: keep fd well scaled */
        TU_OK(tu_spawn(tp, rank_fd, &c));
        case_free(&c);
    }
}
END_TEST

/* ---- out-of-range targets -------------------------------------------------------------- */

static cpar_status rank_bad_target(cpar_ctx *ctx, void *arg) {
    (void)arg;
    cpar_group *g = cpar_world_group(ctx);
    int p = cpar_group_size(g);
    int64_t N = 3, vl = 5, zshape[2] = {N, vl}, sshape[2] = {N, 2};
    float hz[15];
    for (int i = 0; i < 15; i++) hz[i] = 0.1f * (float)i;
    int32_t ht[3] = {1, (int32_t)(vl * p), 2}; /* row 1: == V, out of range */
    cpar_tensor z = tu_upload(ctx, hz, CPAR_F32, 2, zshape), t = tu_upload(ctx, ht, CPAR_I32, 1, &N);
    cpar_tensor loss = tu_alloc_poisoned(ctx, CPAR_F32, 1, &N), stats = tu_alloc_poisoned(ctx, CPAR_F32, 2, sshape);
    if (cpar_device(ctx) == CPAR_HOST) {
        TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t, 0.f, &loss, &stats), CPAR_ERR_INVALID, "target[1]");
        ht[1] = -1;
        cpar_tensor h = cpar_tensor_make(ht, CPAR_I32, 1, &N, CPAR_HOST);
        TU_OK(cpar_tensor_copy(ctx, &h, &t));
        TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t, 0.1f, &loss, &stats), CPAR_ERR_INVALID, "target");
    } else { /* device: documented NaN for that token, the others unaffected */
        TU_OK(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t, 0.f, &loss, &stats));
        float *hl = tu_download(ctx, &loss);
        ck_assert(isfinite(hl[0]) && isnan(hl[1]) && isfinite(hl[2]));
        float dlh[3] = {1, 1, 1};
        cpar_tensor dl = tu_upload(ctx, dlh, CPAR_F32, 1, &N), dz = tu_alloc_poisoned(ctx, CPAR_F32, 2, zshape);
        TU_OK(cpar_vocab_parallel_cross_entropy_backward(g, &z, &t, 0.f, &stats, &dl, &dz));
        float *hdz = tu_download(ctx, &dz);
        for (int64_t j = 0; j < vl; j++) ck_assert(isfinite(hdz[j]) && isnan(hdz[vl + j]) && isfinite(hdz[2 * vl + j]));
        free(hl), free(hdz);
        TU_OK(cpar_tensor_free(ctx, &dl));
        TU_OK(cpar_tensor_free(ctx, &dz));
    }
    TU_OK(cpar_tensor_free(ctx, &z));
    TU_OK(cpar_tensor_free(ctx, &t));
    TU_OK(cpar_tensor_free(ctx, &loss));
    TU_OK(cpar_tensor_free(ctx, &stats));
    return CPAR_OK;
}

START_TEST(test_xent_target_out_of_range) { TU_OK(tu_spawn(_i + 1, rank_bad_target, NULL)); }
END_TEST

/* ---- bad arguments --------------------------------------------------------------------- */

static cpar_status rank_bad_args(cpar_ctx *ctx, void *arg) {
    (void)arg;
    static const char fwd[] = "cpar_vocab_parallel_cross_entropy_forward";
    static const char bwd[] = "cpar_vocab_parallel_cross_entropy_backward";
    cpar_group *g = cpar_world_group(ctx);
    int64_t N = 4, V = 6, zshape[2] = {N, V}, sshape[2] = {N, 2}, bad_s[2] = {N, 3}, bad_n = 5;
    cpar_tensor z = tu_alloc_poisoned(ctx, CPAR_F32, 2, zshape), zi = tu_alloc_poisoned(ctx, CPAR_I32, 2, zshape);
    int64_t ht[4] = {0, 1, 2, 3};
    cpar_tensor t = tu_upload(ctx, ht, CPAR_I64, 1, &N), tf = tu_alloc_poisoned(ctx, CPAR_F32, 1, &N);
    cpar_tensor t5 = tu_alloc_poisoned(ctx, CPAR_I64, 1, &bad_n);
    cpar_tensor loss = tu_alloc_poisoned(ctx, CPAR_F32, 1, &N), loss5 = tu_alloc_poisoned(ctx, CPAR_F32, 1, &bad_n);
    cpar_tensor stats = tu_alloc_poisoned(ctx, CPAR_F32, 2, sshape), stats3 = tu_alloc_poisoned(ctx, CPAR_F32, 2, bad_s);
    cpar_tensor dz16 = tu_alloc_poisoned(ctx, CPAR_F16, 2, zshape), dz = tu_alloc_poisoned(ctx, CPAR_F32, 2, zshape);
    cpar_tensor dl = tu_alloc_poisoned(ctx, CPAR_F32, 1, &N);

    TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(NULL, &z, &t, 0.f, &loss, &stats), CPAR_ERR_INVALID, fwd);
    TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, NULL, &t, 0.f, &loss, &stats), CPAR_ERR_INVALID, "logits is NULL");
    TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, &zi, &t, 0.f, &loss, &stats), CPAR_ERR_INVALID, "logits");
    TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, &z, &tf, 0.f, &loss, &stats), CPAR_ERR_INVALID, "target has dtype f32");
    TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t5, 0.f, &loss, &stats), CPAR_ERR_INVALID, "target has shape [5]");
    TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t, 0.f, &loss5, &stats), CPAR_ERR_INVALID, "loss has shape");
    TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t, 0.f, &loss, &stats3), CPAR_ERR_INVALID, "stats has shape");
    TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t, 0.f, &loss, NULL), CPAR_ERR_INVALID, "stats is NULL");
    TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t, 1.f, &loss, &stats), CPAR_ERR_INVALID, "label_smoothing");
    TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t, -0.1f, &loss, &stats), CPAR_ERR_INVALID, "label_smoothing");
    TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t, NAN, &loss, &stats), CPAR_ERR_INVALID, "label_smoothing");
    if (cpar_device(ctx) != CPAR_HOST) {
        float hz[24] = {0};
        cpar_tensor zh = cpar_tensor_make(hz, CPAR_F32, 2, zshape, CPAR_HOST);
        TU_FAILS(cpar_vocab_parallel_cross_entropy_forward(g, &zh, &t, 0.f, &loss, &stats), CPAR_ERR_INVALID, "logits is on host");
    }
    TU_OK(cpar_fill(ctx, &z, 0.5));
    TU_OK(cpar_vocab_parallel_cross_entropy_forward(g, &z, &t, 0.f, &loss, &stats));
    TU_FAILS(cpar_vocab_parallel_cross_entropy_backward(g, &z, &t, 0.f, &stats, &dl, &dz16), CPAR_ERR_INVALID, "dlogits has dtype f16");
    TU_FAILS(cpar_vocab_parallel_cross_entropy_backward(g, &z, &t, 0.f, &stats3, &dl, &dz), CPAR_ERR_INVALID, "stats has shape");
    TU_FAILS(cpar_vocab_parallel_cross_entropy_backward(g, &z, &t, 0.f, &stats, &loss5, &dz), CPAR_ERR_INVALID, "dloss has shape");
    TU_FAILS(cpar_vocab_parallel_cross_entropy_backward(g, &z, &t, 0.f, &stats, NULL, &dz), CPAR_ERR_INVALID, bwd);
    TU_FAILS(cpar_vocab_parallel_cross_entropy_backward(g, &z, &t, 2.f, &stats, &dl, &dz), CPAR_ERR_INVALID, "label_smoothing");
    cpar_tensor *all[] = {&z, &zi, &t, &tf, &t5, &loss, &loss5, &stats, &stats3, &dz16, &dz, &dl};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    return CPAR_OK;
}

START_TEST(test_xent_bad_args) { TU_OK(tu_spawn(1, rank_bad_args, NULL)); }
END_TEST

/* ---- vocabulary-parallel embedding ---------------------------------------------------- */

typedef struct {
    int tp;
    cpar_dtype dt, idt;
    bool rs, deterministic;
    int64_t b, s, H, V;
    double *W, *G, *dW0; /* W [V, H] in dt; G: dout [b, s, H] (or [s, b, H] when rs); dW0 [V, H] */
    int64_t *ids;        /* [b, s] */
} emb_case;

static cpar_status rank_emb(cpar_ctx *ctx, void *arg) {
    emb_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int r = cpar_group_rank(g), p = cpar_group_size(g);
    int64_t vl = c->V / p, b = c->b, s = c->s, H = c->H, sl = c->rs ? s / p : s;
    int64_t wshape[2] = {vl, H}, ishape[2] = {b, s};
    int64_t oshape[3] = {b, s, H};
    if (c->rs) oshape[0] = sl, oshape[1] = b;
    int64_t on = oshape[0] * oshape[1] * H;
    void *hw = malloc((size_t)(vl * H) * cpar_dtype_size(c->dt)), *hi = malloc((size_t)(b * s) * 8);
    void *hg = malloc((size_t)on * cpar_dtype_size(c->dt));
    float *hdw = malloc(sizeof(float) * (size_t)(vl * H));
    double *want_out = malloc(sizeof(double) * (size_t)on), *want_dw = malloc(sizeof(double) * (size_t)(vl * H));
    for (int64_t i = 0; i < vl * H; i++) {
        tu_set(hw, c->dt, i, c->W[r * vl * H + i]);
        hdw[i] = (float)c->dW0[r * vl * H + i];
        want_dw[i] = hdw[i];
    }
    for (int64_t i = 0; i < b * s; i++) tu_set(hi, c->idt, i, (double)c->ids[i]);
    for (int64_t i = 0; i < b; i++)
        for (int64_t j = 0; j < s; j++) {
            int64_t id = c->ids[i * s + j];
            int64_t grow = c->rs ? j * b + i : i * s + j; /* row in the global dout */
            bool mine = !c->rs || j / sl == r;
            int64_t orow = c->rs ? (j % sl) * b + i : grow;
            for (int64_t h = 0; h < H; h++) {
                if (mine) {
                    want_out[orow * H + h] = c->W[id * H + h];
                    tu_set(hg, c->dt, orow * H + h, c->G[grow * H + h]);
                }
                if (id / vl == r) want_dw[(id - r * vl) * H + h] += c->G[grow * H + h];
            }
        }
    cpar_tensor w = tu_upload(ctx, hw, c->dt, 2, wshape), ids = tu_upload(ctx, hi, c->idt, 2, ishape);
    cpar_tensor out = tu_alloc_poisoned(ctx, c->dt, 3, oshape), dout = tu_upload(ctx, hg, c->dt, 3, oshape);
    TU_OK(cpar_embedding_forward(g, &w, &ids, &out, c->rs));
    void *got = tu_download(ctx, &out);
    TU_EXPECT_CLOSE(got, c->dt, want_out, on, 0.0); /* one non-zero term: exact */
    float *first = NULL;
    for (int rep = 0; rep < 2; rep++) {
        cpar_tensor dw = tu_upload(ctx, hdw, CPAR_F32, 2, wshape);
        TU_OK(cpar_embedding_backward(g, &ids, &dout, c->rs, &dw, c->deterministic));
        float *gw = tu_download(ctx, &dw);
        TU_EXPECT_CLOSE(gw, CPAR_F32, want_dw, vl * H, 1e-5);
        if (!rep) first = gw;
        else {
            if (c->deterministic) TU_EXPECT_SAME(gw, first, CPAR_F32, vl * H);
            free(gw);
        }
        TU_OK(cpar_tensor_free(ctx, &dw));
    }
    free(first), free(got), free(hw), free(hi), free(hg), free(hdw), free(want_out), free(want_dw);
    TU_OK(cpar_tensor_free(ctx, &w));
    TU_OK(cpar_tensor_free(ctx, &ids));
    TU_OK(cpar_tensor_free(ctx, &out));
    TU_OK(cpar_tensor_free(ctx, &dout));
    return CPAR_OK;
}

/* One case: b x s tokens of a vocabulary of V, ids drawn with repeats. */
static void emb_run(int tp, cpar_dtype dt, int m, int64_t b, int64_t s, int64_t H, int64_t V, uint64_t st) {
    {
        emb_case c = {.tp = tp, .dt = dt, .idt = (m & 1) ? CPAR_I64 : CPAR_I32, .rs = (m & 2) != 0,
                      .deterministic = (m & 4) != 0, .b = b, .s = s, .H = H, .V = V};
        c.W = malloc(sizeof(double) * (size_t)(c.V * c.H));
        c.G = malloc(sizeof(double) * (size_t)(c.b * c.s * c.H));
        c.dW0 = malloc(sizeof(double) * (size_t)(c.V * c.H));
        c.ids = malloc(sizeof(int64_t) * (size_t)(c.b * c.s));
        for (int64_t i = 0; i < c.V * c.H; i++) c.W[i] = tu_round(c.dt, tu_uniform(&st)), c.dW0[i] = (float)tu_uniform(&st);
        for (int64_t i = 0; i < c.b * c.s * c.H; i++) c.G[i] = tu_round(c.dt, tu_uniform(&st));
        for (int64_t i = 0; i < c.b * c.s; i++) c.ids[i] = (int64_t)(tu_next(&st) % (uint64_t)c.V); /* repeats */
        c.ids[0] = 0, c.ids[1] = c.V - 1, c.ids[2] = c.V - 1;
        TU_OK(tu_spawn(tp, rank_emb, &c));
        free(c.W), free(c.G), free(c.dW0), free(c.ids);
    }
}

/* _i = (tp - 1) * 3 + dtype; both modes, both index types, deterministic and atomic. */
START_TEST(test_embedding_matches_reference) {
    int tp = _i / 3 + 1;
    for (int m = 0; m < 8; m++)
        emb_run(tp, float_dtypes[_i % 3], m, 2, 12, 5, 3 * tp, (uint64_t)(_i * 8 + m) * 0x9e3779b97f4a7c15ull + 3);
}
END_TEST

/* Enough tokens (2,112: keys padded to 4,096) for the device's deterministic
 * gradient to sort across several shared-memory blocks with global merge
 * steps between them, and long runs of one id. _i = tp - 1 (1, 2);
 * deterministic, both modes and index types. */
START_TEST(test_embedding_many_tokens) {
    const int tp = _i + 1;
    for (int m = 4; m < 8; m++)
        emb_run(tp, float_dtypes[(m + _i) % 3], m, 2, 1056, 3, 40 * tp, (uint64_t)(100 + _i * 8 + m) * 0x9e3779b97f4a7c15ull);
}
END_TEST

static cpar_status rank_emb_bad(cpar_ctx *ctx, void *arg) {
    (void)arg;
    cpar_group *g = cpar_world_group(ctx);
    int64_t wshape[2] = {4, 3}, ishape[2] = {2, 5}, oshape[3] = {2, 5, 3}, rshape[3] = {2, 2, 3};
    int64_t hi[10] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1};
    cpar_tensor w = tu_alloc_poisoned(ctx, CPAR_F32, 2, wshape), ids = tu_upload(ctx, hi, CPAR_I64, 2, ishape);
    cpar_tensor idsf = tu_alloc_poisoned(ctx, CPAR_F32, 2, ishape), out = tu_alloc_poisoned(ctx, CPAR_F32, 3, oshape);
    cpar_tensor out16 = tu_alloc_poisoned(ctx, CPAR_F16, 3, oshape), outr = tu_alloc_poisoned(ctx, CPAR_F32, 3, rshape);
    cpar_tensor dw16 = tu_alloc_poisoned(ctx, CPAR_F16, 2, wshape), dw = tu_alloc_poisoned(ctx, CPAR_F32, 2, wshape);
    TU_FAILS(cpar_embedding_forward(NULL, &w, &ids, &out, false), CPAR_ERR_INVALID, "cpar_embedding_forward");
    TU_FAILS(cpar_embedding_forward(g, &w, &idsf, &out, false), CPAR_ERR_INVALID, "ids has dtype f32");
    TU_FAILS(cpar_embedding_forward(g, &w, &ids, &out16, false), CPAR_ERR_INVALID, "out has dtype f16");
    TU_FAILS(cpar_embedding_forward(g, &w, &ids, &outr, false), CPAR_ERR_INVALID, "out has shape");
    TU_FAILS(cpar_embedding_forward(g, NULL, &ids, &out, false), CPAR_ERR_INVALID, "weight is NULL");
    TU_FAILS(cpar_embedding_backward(g, &ids, &out, false, &dw16, true), CPAR_ERR_INVALID, "dweight has dtype f16");
    TU_FAILS(cpar_embedding_backward(g, &ids, &outr, false, &dw, true), CPAR_ERR_INVALID, "dout has shape");
    if (cpar_group_size(g) == 2) { /* s = 5 is not divisible by tp = 2 */
        TU_FAILS(cpar_embedding_forward(g, &w, &ids, &outr, true), CPAR_ERR_INVALID, "s = 5");
        TU_FAILS(cpar_embedding_backward(g, &ids, &outr, true, &dw, false), CPAR_ERR_INVALID, "tensor-parallel size 2");
    }
    if (cpar_device(ctx) == CPAR_HOST) {
        hi[3] = 4 * cpar_group_size(g);
        cpar_tensor bad = tu_upload(ctx, hi, CPAR_I64, 2, ishape);
        TU_FAILS(cpar_embedding_forward(g, &w, &bad, &out, false), CPAR_ERR_INVALID, "ids[3]");
        TU_OK(cpar_tensor_free(ctx, &bad));
    }
    cpar_tensor *all[] = {&w, &ids, &idsf, &out, &out16, &outr, &dw16, &dw};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    return CPAR_OK;
}

START_TEST(test_embedding_bad_args) { TU_OK(tu_spawn(_i + 1, rank_emb_bad, NULL)); }
END_TEST

/* ---- the embedding layer (cpar_embedding) ------------------------------------------------ */

#define LE_B 2
#define LE_S 12 /* divisible by every tp of 1..4 (reduce_scatter_embeddings) */
#define LE_H 3
#define LE_V 12

typedef struct {
    cpar_dtype dt;
    bool rs, deterministic;
    float master[LE_V * LE_H]; /* [V, H] */
    int64_t ids[LE_B * LE_S];  /* [b, s] */
    double dout[LE_B * LE_S * LE_H]; /* global dout in dt: [b, s, H], or [s, b, H] when rs */
    /* global forward output (as dout's layout), one copy per rank so no two
     * ranks write the same element: rank r fills all of out[r] (its rows of
     * it when rs) */
    double out[4][LE_B * LE_S * LE_H];
    double dw[LE_V * LE_H];          /* gathered main grad after one backward */
} le_case;

/* Forward + backward of a layer built from c->master; each rank stores its
 * output rows and main-grad rows into the case's global arrays. */
static cpar_status rank_layer(cpar_ctx *ctx, void *arg) {
    le_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int r = cpar_group_rank(g), p = cpar_group_size(g);
    cpar_embedding_config cfg = {.num_embeddings = LE_V, .embedding_dim = LE_H, .dtype = c->dt,
                                 .reduce_scatter_embeddings = c->rs, .deterministic = c->deterministic};
    cpar_embedding *e;
    TU_OK(cpar_embedding_create(g, &cfg, &e));
    int64_t mshape[2] = {LE_V, LE_H}, ishape[2] = {LE_B, LE_S}, vl = LE_V / p, sl = c->rs ? LE_S / p : LE_S;
    int64_t first, last;
    TU_OK(cpar_vocab_range(LE_V, r, p, &first, &last));
    cpar_tensor w = cpar_embedding_weight(e), dw = cpar_embedding_weight_grad(e);
    ck_assert(w.ndim == 2 && w.shape[0] == vl && w.shape[1] == LE_H && w.dtype == c->dt && w.device == cpar_device(ctx));
    ck_assert(dw.ndim == 2 && dw.shape[0] == vl && dw.shape[1] == LE_H && dw.dtype == CPAR_F32);
    float *z = tu_download(ctx, &dw); /* created with a zero main grad */
    for (int64_t i = 0; i < vl * LE_H; i++) ck_assert(z[i] == 0.f);
    free(z);
    cpar_tensor master = cpar_tensor_make(c->master, CPAR_F32, 2, mshape, CPAR_HOST);
    TU_OK(cpar_embedding_init_from_master(e, &master));
    void *hw = tu_download(ctx, &w);
    for (int64_t i = 0; i < vl * LE_H; i++)
        ck_assert(tu_get(hw, c->dt, i) == tu_round(c->dt, c->master[first * LE_H + i]));
    free(hw);

    int64_t oshape[3] = {LE_B, LE_S, LE_H};
    if (c->rs) oshape[0] = sl, oshape[1] = LE_B;
    int64_t on = oshape[0] * oshape[1] * LE_H, off = c->rs ? (int64_t)r * on : 0; /* rows of the global layout */
    cpar_tensor ids = tu_upload(ctx, c->ids, CPAR_I64, 2, ishape);
    cpar_tensor out = tu_alloc_poisoned(ctx, c->dt, 3, oshape);
    TU_OK(cpar_embedding_layer_forward(e, &ids, &out));
    void *ho = tu_download(ctx, &out);
    for (int64_t i = 0; i < on; i++) c->out[r][off + i] = tu_get(ho, c->dt, i);
    void *hg = malloc((size_t)on * cpar_dtype_size(c->dt));
    for (int64_t i = 0; i < on; i++) tu_set(hg, c->dt, i, c->dout[off + i]);
    cpar_tensor dout = tu_upload(ctx, hg, c->dt, 3, oshape);
    /* accumulates: twice = 2x once; zero_grad clears; once more = the gradient */
    TU_OK(cpar_embedding_layer_backward(e, &ids, &dout));
    float *g1 = tu_download(ctx, &dw);
    TU_OK(cpar_embedding_layer_backward(e, &ids, &dout));
    float *g2 = tu_download(ctx, &dw);
    double *twice = malloc(sizeof(double) * (size_t)(vl * LE_H));
    for (int64_t i = 0; i < vl * LE_H; i++) twice[i] = 2.0 * (double)g1[i];
    TU_EXPECT_CLOSE(g2, CPAR_F32, twice, vl * LE_H, 1e-6);
    TU_OK(cpar_embedding_zero_grad(e));
    float *g0 = tu_download(ctx, &dw);
    for (int64_t i = 0; i < vl * LE_H; i++) ck_assert(g0[i] == 0.f);
    TU_OK(cpar_embedding_layer_backward(e, &ids, &dout));
    float *g3 = tu_download(ctx, &dw);
    if (c->deterministic || cpar_device(ctx) == CPAR_HOST) TU_EXPECT_SAME(g3, g1, CPAR_F32, vl * LE_H);
    for (int64_t i = 0; i < vl * LE_H; i++) c->dw[first * LE_H + i] = g3[i];
    free(ho), free(hg), free(g0), free(g1), free(g2), free(g3), free(twice);
    TU_OK(cpar_tensor_free(ctx, &ids));
    TU_OK(cpar_tensor_free(ctx, &out));
    TU_OK(cpar_tensor_free(ctx, &dout));
    TU_OK(cpar_embedding_destroy(e));
    return CPAR_OK;
}

/* _i = tp - 1: the layer at tp equals the tp = 1 layer (forward output and the
 * gathered main grad), both output modes, deterministic and atomic, F32/BF16. */
START_TEST(test_embedding_layer_matches_tp1) {
    int tp = _i + 1;
    for (int m = 0; m < 8; m++) {
        le_case ref, c;
        memset(&ref, 0, sizeof ref);
        ref.dt = (m & 4) ? CPAR_BF16 : CPAR_F32, ref.rs = (m & 1) != 0, ref.deterministic = (m & 2) != 0;
        uint64_t st = (uint64_t)(_i * 8 + m) * 0x9e3779b97f4a7c15ull + 11;
        for (int64_t i = 0; i < LE_V * LE_H; i++) ref.master[i] = (float)(2.0 * tu_uniform(&st) - 1.0);
        for (int64_t i = 0; i < LE_B * LE_S; i++) ref.ids[i] = (int64_t)(tu_next(&st) % LE_V); /* repeats */
        ref.ids[0] = 0, ref.ids[1] = LE_V - 1, ref.ids[2] = LE_V - 1;
        for (int64_t i = 0; i < LE_B * LE_S * LE_H; i++) ref.dout[i] = tu_round(ref.dt, tu_uniform(&st));
        c = ref;
        TU_OK(tu_spawn(1, rank_layer, &ref));
        TU_OK(tu_spawn(tp, rank_layer, &c));
        const int64_t N = LE_B * LE_S * LE_H;
        for (int r = 0; r < tp; r++) /* one non-zero term per element: exact */
            for (int64_t i = ref.rs ? r * (N / tp) : 0; i < (ref.rs ? (r + 1) * (N / tp) : N); i++)
                ck_assert_msg(c.out[r][i] == ref.out[0][i], "tp %d mode %d: rank %d's out[%lld] %g, tp=1 %g", tp, m,
                              r, (long long)i, c.out[r][i], ref.out[0][i]);
        for (int64_t i = 0; i < LE_V * LE_H; i++)
            ck_assert_msg(fabs(c.dw[i] - ref.dw[i]) <= 1e-5 * (1.0 + fabs(ref.dw[i])),
                          "tp %d mode %d: dw[%lld] %g, tp=1 %g", tp, m, (long long)i, c.dw[i], ref.dw[i]);
        /* and the tp = 1 layer is the table lookup */
        for (int64_t i = 0; i < LE_B; i++)
            for (int64_t j = 0; j < LE_S; j++) {
                int64_t row = ref.rs ? j * LE_B + i : i * LE_S + j, id = ref.ids[i * LE_S + j];
                for (int64_t h = 0; h < LE_H; h++)
                    ck_assert(ref.out[0][row * LE_H + h] == tu_round(ref.dt, ref.master[id * LE_H + h]));
            }
    }
}
END_TEST

typedef struct {
    float *w[MAX_TP];
} le_rand_case;

static cpar_status rank_layer_random(cpar_ctx *ctx, void *arg) {
    le_rand_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int r = cpar_group_rank(g), p = cpar_group_size(g);
    const int64_t V = 8 * p, H = 16, n = 8 * H;
    cpar_embedding_config cfg = {.num_embeddings = V, .embedding_dim = H};
    cpar_embedding *e;
    TU_OK(cpar_embedding_create(g, &cfg, &e));
    TU_FAILS(cpar_embedding_init_random(e, 0.02f), CPAR_ERR_INVALID, "cpar_model_parallel_manual_seed");
    TU_FAILS(cpar_embedding_init_random(e, -1.f), CPAR_ERR_INVALID, "std");
    TU_FAILS(cpar_embedding_init_random(e, NAN), CPAR_ERR_INVALID, "std");
    TU_OK(cpar_model_parallel_manual_seed(ctx, 1234, r, -1, -1));
    cpar_rng_state before, after;
    TU_OK(cpar_rng_get_state(ctx, NULL, &before));
    TU_OK(cpar_embedding_init_random(e, 0.02f));
    TU_OK(cpar_rng_get_state(ctx, NULL, &after));
    ck_assert(before.seed == after.seed && before.offset == after.offset); /* drawn under the fork only */
    cpar_tensor w = cpar_embedding_weight(e);
    float *w1 = tu_download(ctx, &w);
    /* the same draws as a manual fork of the model-parallel state */
    TU_OK(cpar_model_parallel_manual_seed(ctx, 1234, r, -1, -1));
    cpar_tensor t;
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 2, w.shape, &t));
    TU_OK(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
    TU_OK(cpar_rng_normal(ctx, &t, 0.f, 0.02f));
    TU_OK(cpar_rng_unfork(ctx));
    float *w2 = tu_download(ctx, &t);
    TU_EXPECT_SAME(w1, w2, CPAR_F32, n);
    /* reproducible for a fixed seed */
    TU_OK(cpar_model_parallel_manual_seed(ctx, 1234, r, -1, -1));
    TU_OK(cpar_embedding_init_random(e, 0.02f));
    float *w3 = tu_download(ctx, &w);
    TU_EXPECT_SAME(w1, w3, CPAR_F32, n);
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)w1[i] * w1[i];
    ck_assert_msg(sqrt(ss / (double)n) > 0.01 && sqrt(ss / (double)n) < 0.04, "std %g", sqrt(ss / (double)n));
    c->w[r] = w1;
    free(w2), free(w3);
    TU_OK(cpar_tensor_free(ctx, &t));
    TU_OK(cpar_embedding_destroy(e));
    return CPAR_OK;
}

/* _i = tp - 2 */
START_TEST(test_embedding_layer_init_random) {
    int tp = _i + 2;
    le_rand_case c;
    memset(&c, 0, sizeof c);
    TU_OK(tu_spawn(tp, rank_layer_random, &c));
    for (int r = 1; r < tp; r++)
        ck_assert_msg(memcmp(c.w[0], c.w[r], sizeof(float) * 8 * 16), "tp %d: rank %d drew rank 0's weight", tp, r);
    for (int r = 0; r < tp; r++) free(c.w[r]);
}
END_TEST

static cpar_status rank_layer_bad(cpar_ctx *ctx, void *arg) {
    (void)arg;
    static const char cr[] = "cpar_embedding_create";
    cpar_group *g = cpar_world_group(ctx);
    int p = cpar_group_size(g);
    cpar_embedding *e = (cpar_embedding *)&e;
    cpar_embedding_config cfg = {.num_embeddings = 4 * p, .embedding_dim = 3};
    /* the vocabulary is not divisible by tp */
    cpar_embedding_config odd = cfg;
    odd.num_embeddings = 4 * p + 1;
    char want[96];
    snprintf(want, sizeof want, "num_embeddings %d is not divisible by the tensor-parallel size %d", 4 * p + 1, p);
    if (p > 1) { /* every vocabulary divides by tp = 1 */
        TU_FAILS(cpar_embedding_create(g, &odd, &e), CPAR_ERR_INVALID, want);
        ck_assert(e == NULL);
        TU_FAILS(cpar_embedding_create(g, &odd, &e), CPAR_ERR_INVALID, "cpar_pad_vocab_size");
    }
    cpar_embedding_config bad = cfg;
    bad.embedding_dim = 0;
    TU_FAILS(cpar_embedding_create(g, &bad, &e), CPAR_ERR_INVALID, "embedding_dim 0");
    bad = cfg, bad.num_embeddings = -4;
    TU_FAILS(cpar_embedding_create(g, &bad, &e), CPAR_ERR_INVALID, "num_embeddings -4");
    bad = cfg, bad.dtype = CPAR_I32;
    TU_FAILS(cpar_embedding_create(g, &bad, &e), CPAR_ERR_INVALID, "cfg dtype is i32");
    TU_FAILS(cpar_embedding_create(NULL, &cfg, &e), CPAR_ERR_INVALID, cr);
    TU_FAILS(cpar_embedding_create(g, NULL, &e), CPAR_ERR_INVALID, "cpar_embedding_create: cfg is NULL");
    TU_FAILS(cpar_embedding_create(g, &cfg, NULL), CPAR_ERR_INVALID, "cpar_embedding_create: out is NULL");
    TU_OK(cpar_embedding_destroy(NULL));
    ck_assert(cpar_embedding_weight(NULL).data == NULL && cpar_embedding_weight_grad(NULL).data == NULL);

    TU_OK(cpar_embedding_create(g, &cfg, &e));
    int64_t ishape[2] = {2, 5}, oshape[3] = {2, 5, 3}, rshape[3] = {2, 2, 3}, mshape[2] = {4 * p, 3}, m2[2] = {4, 3};
    int64_t hi[10] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1};
    float hm[4 * MAX_TP * 3] = {0};
    cpar_tensor ids = tu_upload(ctx, hi, CPAR_I64, 2, ishape), idsf = tu_alloc_poisoned(ctx, CPAR_F32, 2, ishape);
    cpar_tensor out = tu_alloc_poisoned(ctx, CPAR_F32, 3, oshape), out16 = tu_alloc_poisoned(ctx, CPAR_F16, 3, oshape);
    cpar_tensor outr = tu_alloc_poisoned(ctx, CPAR_F32, 3, rshape);
    cpar_tensor master = cpar_tensor_make(hm, CPAR_F32, 2, mshape, CPAR_HOST);
    cpar_tensor master_small = cpar_tensor_make(hm, CPAR_F32, 2, m2, CPAR_HOST);
    cpar_tensor master16 = cpar_tensor_make(hm, CPAR_F16, 2, mshape, CPAR_HOST);
    static const char fwd[] = "cpar_embedding_layer_forward", bwd[] = "cpar_embedding_layer_backward";
    TU_FAILS(cpar_embedding_layer_forward(NULL, &ids, &out), CPAR_ERR_INVALID, "cpar_embedding_layer_forward: e is NULL");
    TU_FAILS(cpar_embedding_layer_forward(e, NULL, &out), CPAR_ERR_INVALID, "cpar_embedding_layer_forward: ids is NULL");
    TU_FAILS(cpar_embedding_layer_forward(e, &idsf, &out), CPAR_ERR_INVALID, "ids has dtype f32");
    TU_FAILS(cpar_embedding_layer_forward(e, &ids, &out16), CPAR_ERR_INVALID, "out has dtype f16");
    TU_FAILS(cpar_embedding_layer_forward(e, &ids, &outr), CPAR_ERR_INVALID, fwd);
    TU_FAILS(cpar_embedding_layer_forward(e, &ids, NULL), CPAR_ERR_INVALID, "out is NULL");
    TU_FAILS(cpar_embedding_layer_backward(NULL, &ids, &out), CPAR_ERR_INVALID, "cpar_embedding_layer_backward: e is NULL");
    TU_FAILS(cpar_embedding_layer_backward(e, &ids, &outr), CPAR_ERR_INVALID, "cpar_embedding_layer_backward: dout has shape");
    TU_FAILS(cpar_embedding_layer_backward(e, &idsf, &out), CPAR_ERR_INVALID, bwd);
    TU_FAILS(cpar_embedding_layer_backward(e, &ids, NULL), CPAR_ERR_INVALID, "dout is NULL");
    TU_FAILS(cpar_embedding_init_from_master(NULL, &master), CPAR_ERR_INVALID, "cpar_embedding_init_from_master: e is NULL");
    TU_FAILS(cpar_embedding_init_from_master(e, NULL), CPAR_ERR_INVALID, "master is NULL");
    TU_FAILS(cpar_embedding_init_from_master(e, &master16), CPAR_ERR_INVALID, "master has dtype f16");
    if (p > 1) TU_FAILS(cpar_embedding_init_from_master(e, &master_small), CPAR_ERR_INVALID, "master has shape [4,3]");
    TU_FAILS(cpar_embedding_init_random(NULL, 0.02f), CPAR_ERR_INVALID, "cpar_embedding_init_random: e is NULL");
    TU_FAILS(cpar_embedding_zero_grad(NULL), CPAR_ERR_INVALID, "cpar_embedding_zero_grad");
    if (cpar_device(ctx) != CPAR_HOST) { /* the master lives on the host */
        cpar_tensor md = tu_upload(ctx, hm, CPAR_F32, 2, mshape);
        TU_FAILS(cpar_embedding_init_from_master(e, &md), CPAR_ERR_INVALID, "master is on");
        TU_OK(cpar_tensor_free(ctx, &md));
    }
    if (p == 2) { /* s = 5 is not divisible by tp = 2 */
        cpar_embedding *ers;
        cpar_embedding_config rcfg = cfg;
        rcfg.reduce_scatter_embeddings = true;
        TU_OK(cpar_embedding_create(g, &rcfg, &ers));
        TU_FAILS(cpar_embedding_layer_forward(ers, &ids, &outr), CPAR_ERR_INVALID, "s = 5");
        TU_OK(cpar_embedding_destroy(ers));
    }
    if (cpar_device(ctx) == CPAR_HOST) {
        hi[3] = 4 * p;
        cpar_tensor badids = tu_upload(ctx, hi, CPAR_I64, 2, ishape);
        TU_FAILS(cpar_embedding_layer_forward(e, &badids, &out), CPAR_ERR_INVALID, "ids[3]");
        TU_OK(cpar_tensor_free(ctx, &badids));
    }
    /* still usable after the failures */
    TU_OK(cpar_embedding_init_from_master(e, &master));
    TU_OK(cpar_embedding_layer_forward(e, &ids, &out));
    TU_OK(cpar_embedding_layer_backward(e, &ids, &out));
    cpar_tensor *all[] = {&ids, &idsf, &out, &out16, &outr};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_embedding_destroy(e));
    return CPAR_OK;
}

/* _i = tp - 1 */
START_TEST(test_embedding_layer_bad_args) { TU_OK(tu_spawn(_i + 1, rank_layer_bad, NULL)); }
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("xent: vocab-parallel cross entropy and embedding");
    const tu_loop loops[] = {
        {"xent_reference", test_xent_matches_reference, 12},
        {"xent_long_rows_in_place", test_xent_long_rows_and_in_place, 1},
        {"xent_finite_differences", test_xent_finite_differences, 4},
        {"xent_target_out_of_range", test_xent_target_out_of_range, 4},
        {"xent_bad_args", test_xent_bad_args, 1},
        {"embedding_reference", test_embedding_matches_reference, 12},
        {"embedding_bad_args", test_embedding_bad_args, 2},
        {"embedding_many_tokens", test_embedding_many_tokens, 2},
        {"embedding_layer_tp1", test_embedding_layer_matches_tp1, 4},
        {"embedding_layer_init_random", test_embedding_layer_init_random, 3},
        {"embedding_layer_bad_args", test_embedding_layer_bad_args, 3},
    };
    tu_add_loops(s, loops, sizeof loops / sizeof loops[0], 120);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
