/* SPDX-License-Identifier: MIT */
/* test_attn.c — local attention (cpar.h §12): cpar_attention_forward and
 * cpar_attention_backward on one rank.
 *
 * Every case draws random q, k, v, dout (rounded to the dtype), computes an
 * fp64 reference with a plain materialised softmax (below: scores, max, exp,
 * normalise, P·V; backward from the reference's own P), runs forward (out and
 * lse poisoned first) and backward (dq, dk, dv poisoned) with the forward's
 * out and lse, and compares by the normalised error max|got - want| /
 * max|want| with a dtype-aware bound. Shapes: causal and not, sq != sk both
 * ways, d 64, 128 and 40 (plus 5 and 13 on host tensors: any d there),
 * lengths that are not multiples of the 64-row tiles (1, 33, 45, 70, 77, 130),
 * GQA (hq = 4, hkv = 2 and hq = 3, hkv = 1), an explicit scale.
 * F32 runs on host tensors (also on the device backend: host tensors on a device
 * context take the host reference), F16 and BF16 on the backend's device (the
 * host reference on "host", the flash kernels on "sim"), each device case in
 * the forward, reverse and a shuffled fiber schedule (CUDASIM_SCHEDULE is
 * read by every new rank thread) so a missing barrier shows up (on host,
 * and on nccl-sim, whose kernels are sim's, one schedule per case in turn).
 * Also: row 0 of a causal block sees exactly key 0; no keys at all (sk = 0)
 * gives out 0 and lse -inf, zero gradients; empty batches are no-ops;
 * finite differences of the host backward; bad input for every argument.
 * Sim only: the device layer (cpar_dev_attention_fwd) on strided blocks as
 * the ring attention uses them, and its argument checks. */
#define _GNU_SOURCE /* setenv */
#define CPAR_INTERNAL /* calls device-layer functions (cpar.h §16) directly */
#include "testutil.h"

#include <stdbool.h>

typedef struct {
    int64_t b, hq, hkv, sq, sk, d;
    bool causal;
} attn_shape;

/* Device-capable shapes (d a multiple of 8 up to 128). */
static const attn_shape shapes[] = {
    {1, 2, 2, 33, 33, 64, true},    /* one partial tile each way */
    {2, 4, 2, 77, 45, 64, false},   /* GQA 2:1, sq > sk */
    {1, 3, 1, 45, 77, 40, true},    /* GQA 3:1, sq < sk, odd multiple of 8 */
    {1, 2, 1, 70, 1, 128, true},    /* a single key */
    {1, 1, 1, 1, 33, 128, false},   /* a single query */
    {1, 2, 2, 130, 130, 128, true}, /* three tiles: causal tile skipping */
    {1, 2, 1, 65, 129, 40, false},  /* one row past a tile, GQA */
    {1, 4, 2, 77, 90, 64, true},    /* causal with sk > sq and GQA */
    {1, 2, 1, 140, 270, 64, true},  /* d 64's 128-key tiles: three, the last partial; causal, GQA */
    {1, 1, 1, 130, 140, 64, false}, /* ... two query tiles against two key tiles, both partial */
};
#define N_SHAPES (int)(sizeof shapes / sizeof shapes[0])

/* Host-only extras: any d >= 1. */
static const attn_shape host_shapes[] = {
    {1, 2, 1, 9, 7, 5, true},
    {2, 1, 1, 6, 11, 13, false},
    {1, 1, 1, 300, 260, 24, true},  /* causal sq > sk over several tiles: the diagonal's strips, partial */
    {1, 2, 1, 200, 330, 16, true},  /* causal sq < sk: keys past every query's diagonal */
};
#define N_HOST_SHAPES (int)(sizeof host_shapes / sizeof host_shapes[0])

typedef struct {
    attn_shape s;
    cpar_dtype dt;
    float scale;   /* as passed: 0 = 1/sqrt(d) */
    bool host;     /* host tensors even on a device context */
    bool backward;
    uint64_t seed;
    float p;              /* dropout: 0 = none (the bool/float functions), else the _cfg ones */
    cpar_rng_state rng;   /* dropout's Philox state */
    const cpar_packed_seqs *packed; /* a THD batch (b = 1): the _cfg functions, per-document masks */
    /* inputs as dt holds them, and the fp64 reference */
    double *q, *k, *v, *dout;
    double *out, *lse, *dq, *dk, *dv;
} attn_case;

static int64_t nq_of(const attn_shape *s) { return s->b * s->hq * s->sq * s->d; }
static int64_t nkv_of(const attn_shape *s) { return s->b * s->hkv * s->sk * s->d; }

static double *dalloc(int64_t n) {
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    ck_assert_ptr_nonnull(p);
    return p;
}

static double scale_of(const attn_case *c) { return c->scale > 0.f ? (double)c->scale : 1.0 / sqrt((double)c->s.d); }

/* The fp64 reference: the whole score row materialised, softmax, P·V; and
 * the gradients from the same P: dP = dout vᵀ, dS = P (dP - rowsum(P dP)).
 * With dropout p the weights P are multiplied by Z (0 where tu_attn_keep
 * drops (bh, i, j), else 1 / (1 - p)) after the softmax: out = (P∘Z) v,
 * dv = (P∘Z)ᵀ dout, dS = P (dP∘Z - rowsum(P∘Z∘dP)). */
static void reference(attn_case *c) {
    const attn_shape *s = &c->s;
    const int64_t d = s->d, g = s->hq / s->hkv;
    const double scale = scale_of(c);
    double *p = dalloc(s->sk), *dp = dalloc(s->sk), *z = dalloc(s->sk);
    for (int64_t bi = 0; bi < s->b; bi++)
        for (int64_t hi = 0; hi < s->hq; hi++) {
            const int64_t bh = bi * s->hq + hi, kh = bi * s->hkv + hi / g;
            for (int64_t i = 0; i < s->sq; i++) {
                const double *qi = c->q + (bh * s->sq + i) * d, *doi = c->dout + (bh * s->sq + i) * d;
                double *oi = c->out + (bh * s->sq + i) * d, *dqi = c->dq + (bh * s->sq + i) * d;
                /* the keys row i sees: a prefix (top-left causal) or, packed, its document's real rows */
                int64_t j_lo = 0, n = s->causal ? (i + 1 < s->sk ? i + 1 : s->sk) : s->sk;
                if (c->packed) {
                    const int32_t *cu = c->packed->cu_seqlens_padded ? c->packed->cu_seqlens_padded : c->packed->cu_seqlens;
                    int doc = 0;
                    while (i >= cu[doc + 1]) doc++;
                    const int64_t real = c->packed->cu_seqlens[doc + 1] - c->packed->cu_seqlens[doc];
                    j_lo = cu[doc];
                    n = i - j_lo >= real ? j_lo : s->causal ? i + 1 : j_lo + real; /* padding rows see nothing */
                }
                if (n <= j_lo) {
                    c->lse[bh * s->sq + i] = -INFINITY;
                    continue;
                }
                double m = -INFINITY, sum = 0.0;
                for (int64_t j = j_lo; j < n; j++) {
                    const double *kj = c->k + (kh * s->sk + j) * d;
                    double acc = 0.0;
                    for (int64_t x = 0; x < d; x++) acc += qi[x] * kj[x];
                    p[j] = scale * acc;
                    m = fmax(m, p[j]);
                }
                for (int64_t j = j_lo; j < n; j++) sum += (p[j] = exp(p[j] - m));
                for (int64_t j = j_lo; j < n; j++) p[j] /= sum;
                c->lse[bh * s->sq + i] = m + log(sum);
                for (int64_t j = j_lo; j < n; j++)
                    z[j] = c->p == 0.f ? 1.0
                           : tu_attn_keep(c->rng, c->p, (uint64_t)bh, (uint64_t)i, (uint64_t)j) ? 1.0 / (1.0 - c->p)
                                                                                                 : 0.0;
                double D = 0.0;
                for (int64_t j = j_lo; j < n; j++) {
                    const double *vj = c->v + (kh * s->sk + j) * d;
                    double acc = 0.0;
                    for (int64_t x = 0; x < d; x++) oi[x] += p[j] * z[j] * vj[x], acc += doi[x] * vj[x];
                    dp[j] = acc * z[j];
                    D += p[j] * dp[j];
                }
                for (int64_t j = j_lo; j < n; j++) {
                    const double ds = p[j] * (dp[j] - D);
                    const double *kj = c->k + (kh * s->sk + j) * d;
                    double *dkj = c->dk + (kh * s->sk + j) * d, *dvj = c->dv + (kh * s->sk + j) * d;
                    for (int64_t x = 0; x < d; x++) {
                        dqi[x] += scale * ds * kj[x];
                        dkj[x] += scale * ds * qi[x];
                        dvj[x] += p[j] * z[j] * doi[x];
                    }
                }
            }
        }
    free(p), free(dp), free(z);
}

static void fill(double *x, int64_t n, cpar_dtype dt, uint64_t *st) {
    for (int64_t i = 0; i < n; i++) x[i] = tu_round(dt, tu_uniform(st));
}

static void case_init_drop(attn_case *c, const attn_shape *s, cpar_dtype dt, float scale, bool host, bool backward,
                           uint64_t seed, float p) {
    memset(c, 0, sizeof *c);
    c->s = *s, c->dt = dt, c->scale = scale, c->host = host, c->backward = backward, c->seed = seed;
    c->p = p, c->rng = (cpar_rng_state){0x9e3779b97f4a7c15ull ^ seed, 1000 + seed};
    const int64_t nq = nq_of(s), nkv = nkv_of(s);
    c->q = dalloc(nq), c->k = dalloc(nkv), c->v = dalloc(nkv), c->dout = dalloc(nq);
    c->out = dalloc(nq), c->lse = dalloc(s->b * s->hq * s->sq), c->dq = dalloc(nq), c->dk = dalloc(nkv);
    c->dv = dalloc(nkv);
    uint64_t st = seed * 0x9e3779b97f4a7c15ull + 3;
    fill(c->q, nq, dt, &st), fill(c->k, nkv, dt, &st), fill(c->v, nkv, dt, &st), fill(c->dout, nq, dt, &st);
    reference(c);
}

static void case_init(attn_case *c, const attn_shape *s, cpar_dtype dt, float scale, bool host, bool backward,
                      uint64_t seed) {
    case_init_drop(c, s, dt, scale, host, backward, seed, 0.f);
}

static void case_free(attn_case *c) {
    free(c->q), free(c->k), free(c->v), free(c->dout), free(c->out), free(c->lse), free(c->dq), free(c->dk);
    free(c->dv);
}

/* ---- tensors on the case's memory ----------------------------------------------------- */

/* host: malloc'ed host tensors; else the context's device (tu_upload). */
static cpar_tensor put(cpar_ctx *ctx, bool host, const double *x, cpar_dtype dt, int ndim, const int64_t *shape) {
    cpar_tensor h = cpar_tensor_make(NULL, dt, ndim, shape, CPAR_HOST);
    const int64_t n = cpar_tensor_numel(&h);
    h.data = malloc(n > 0 ? (size_t)n * cpar_dtype_size(dt) : 1);
    ck_assert_ptr_nonnull(h.data);
    if (x)
        for (int64_t i = 0; i < n; i++) tu_set(h.data, dt, i, x[i]);
    else
        memset(h.data, 0xff, (size_t)n * cpar_dtype_size(dt)); /* poison: NaN */
    if (host) return h;
    cpar_tensor t = tu_upload(ctx, h.data, dt, ndim, shape);
    free(h.data);
    return t;
}

static void drop(cpar_ctx *ctx, cpar_tensor *t) {
    if (t->device == CPAR_HOST) {
        free(t->data);
        t->data = NULL;
    } else {
        TU_OK(cpar_tensor_free(ctx, t));
    }
}

/* Host copy of any tensor (free it). */
static void *fetch(cpar_ctx *ctx, const cpar_tensor *t) { return tu_download(ctx, t); }

/* max|got - want| <= tol * max|want| (NaN always fails). */
static void expect_close(const attn_case *c, const char *what, const void *got, cpar_dtype dt, const double *want,
                         int64_t n, double tol) {
    double ref = 0.0;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(want[i])) ref = fmax(ref, fabs(want[i]));
    if (ref == 0.0) ref = 1.0;
    for (int64_t i = 0; i < n; i++) {
        const double g = tu_get(got, dt, i), w = want[i];
        const bool ok = isinf(w) ? g == w : !isnan(g) && fabs(g - w) <= tol * ref;
        ck_assert_msg(ok,
                      "%s [b%lld hq%lld hkv%lld sq%lld sk%lld d%lld %s %s%s]: element %lld got %.8g, expected %.8g "
                      "(tol %.3g x max %.4g)",
                      what, (long long)c->s.b, (long long)c->s.hq, (long long)c->s.hkv, (long long)c->s.sq,
                      (long long)c->s.sk, (long long)c->s.d, c->s.causal ? "causal" : "full", cpar_dtype_name(c->dt),
                      c->host ? " host" : "", (long long)i, g, w, tol, ref);
    }
}

static double out_tol(cpar_dtype dt) { return dt == CPAR_F32 ? 2e-6 : dt == CPAR_F16 ? 4e-3 : 2.5e-2; }
static double grad_tol(cpar_dtype dt) { return dt == CPAR_F32 ? 2e-5 : dt == CPAR_F16 ? 8e-3 : 4e-2; }
/* lse is fp32 from exact 16-bit inputs whatever the dtype. */
static double lse_tol(cpar_dtype dt) { return dt == CPAR_F32 ? 2e-6 : 2e-5; }

static cpar_status rank_case(cpar_ctx *ctx, void *arg) {
    attn_case *c = arg;
    const attn_shape *s = &c->s;
    const cpar_dtype dt = c->dt;
    const int64_t qs[4] = {s->b, s->hq, s->sq, s->d}, ks[4] = {s->b, s->hkv, s->sk, s->d};
    cpar_tensor q = put(ctx, c->host, c->q, dt, 4, qs), k = put(ctx, c->host, c->k, dt, 4, ks);
    cpar_tensor v = put(ctx, c->host, c->v, dt, 4, ks);
    cpar_tensor out = put(ctx, c->host, NULL, dt, 4, qs), lse = put(ctx, c->host, NULL, CPAR_F32, 3, qs);
    const cpar_attention_config cfg = {.causal = s->causal, .scale = c->scale, .dropout_p = c->p,
                                       .dropout_state = c->rng, .packed = c->packed};
    const bool with_cfg = c->p > 0.f || c->packed;
    if (with_cfg) TU_OK(cpar_attention_forward_cfg(ctx, &cfg, &q, &k, &v, &out, &lse));
    else TU_OK(cpar_attention_forward(ctx, &q, &k, &v, s->causal, c->scale, &out, &lse));
    void *ho = fetch(ctx, &out), *hl = fetch(ctx, &lse);
    expect_close(c, "out", ho, dt, c->out, nq_of(s), out_tol(dt));
    expect_close(c, "lse", hl, CPAR_F32, c->lse, s->b * s->hq * s->sq, lse_tol(dt) * 10.0);
    /* lse: also relative to each row's own magnitude */
    for (int64_t i = 0; i < s->b * s->hq * s->sq; i++)
        ck_assert_msg(isinf(c->lse[i]) ? ((float *)hl)[i] == c->lse[i]
                                       : fabs(((float *)hl)[i] - c->lse[i]) <= lse_tol(dt) * (1.0 + fabs(c->lse[i])),
                      "lse row %lld: got %.8g, expected %.8g (%s)", (long long)i, ((float *)hl)[i], c->lse[i],
                      cpar_dtype_name(dt));
    if (s->causal && s->sq > 0 && s->sk > 0 && c->p == 0.f && !c->packed) { /* row 0 sees exactly key 0: out = v_0, lse = scale q_0·k_0 */
        const int64_t g = s->hq / s->hkv;
        for (int64_t h = 0; h < s->hq; h++) {
            const double *q0 = c->q + h * s->sq * s->d, *k0 = c->k + (h / g) * s->sk * s->d;
            double dot = 0.0;
            for (int64_t x = 0; x < s->d; x++) dot += q0[x] * k0[x];
            ck_assert(fabs(((float *)hl)[h * s->sq] - scale_of(c) * dot) <= 1e-5 * (1.0 + fabs(scale_of(c) * dot)));
            for (int64_t x = 0; x < s->d; x++)
                ck_assert_msg(tu_get(ho, dt, h * s->sq * s->d + x) == c->v[(h / g) * s->sk * s->d + x],
                              "head %lld: out row 0 element %lld is not v row 0's", (long long)h, (long long)x);
        }
    }
    if (c->backward) {
        cpar_tensor dout = put(ctx, c->host, c->dout, dt, 4, qs), dq = put(ctx, c->host, NULL, dt, 4, qs);
        cpar_tensor dk = put(ctx, c->host, NULL, dt, 4, ks), dv = put(ctx, c->host, NULL, dt, 4, ks);
        if (with_cfg) TU_OK(cpar_attention_backward_cfg(ctx, &cfg, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv));
        else TU_OK(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, s->causal, c->scale, &dq, &dk, &dv));
        void *hdq = fetch(ctx, &dq), *hdk = fetch(ctx, &dk), *hdv = fetch(ctx, &dv);
        expect_close(c, "dq", hdq, dt, c->dq, nq_of(s), grad_tol(dt));
        if (c->packed) /* padding: rows with no key keep dq 0, keys nobody sees get dk = dv = 0, exactly */
            for (int64_t h = 0; h < s->hq; h++)
                for (int64_t i = 0; i < s->sq; i++)
                    for (int64_t x = 0; x < s->d; x++) {
                        const int64_t e = (h * s->sq + i) * s->d + x, ek = ((h / (s->hq / s->hkv)) * s->sk + i) * s->d + x;
                        if (isinf(c->lse[h * s->sq + i])) {
                            ck_assert_msg(tu_get(ho, dt, e) == 0.0 && tu_get(hdq, dt, e) == 0.0,
                                          "padding row %lld: out %g, dq %g, expected 0", (long long)i,
                                          tu_get(ho, dt, e), tu_get(hdq, dt, e));
                            ck_assert_msg(tu_get(hdk, dt, ek) == 0.0 && tu_get(hdv, dt, ek) == 0.0,
                                          "padding key %lld: dk %g, dv %g, expected 0", (long long)i,
                                          tu_get(hdk, dt, ek), tu_get(hdv, dt, ek));
                        }
                    }
        expect_close(c, "dk", hdk, dt, c->dk, nkv_of(s), grad_tol(dt));
        expect_close(c, "dv", hdv, dt, c->dv, nkv_of(s), grad_tol(dt));
        free(hdq), free(hdk), free(hdv);
        drop(ctx, &dout), drop(ctx, &dq), drop(ctx, &dk), drop(ctx, &dv);
    }
    free(ho), free(hl);
    drop(ctx, &q), drop(ctx, &k), drop(ctx, &v), drop(ctx, &out), drop(ctx, &lse);
    return CPAR_OK;
}

static void run(const attn_shape *s, cpar_dtype dt, float scale, bool host, bool backward, uint64_t seed) {
    attn_case c;
    case_init(&c, s, dt, scale, host, backward, seed);
    TU_OK(tu_spawn(1, rank_case, &c));
    case_free(&c);
}

/* The fiber schedule of the rank threads spawned after this call (sim). */
static void schedule(int which) {
    static const char *const names[3] = {"forward", "reverse", "shuffle:7"};
    setenv("CUDASIM_SCHEDULE", names[which], 1);
}

static const cpar_dtype dtypes16[] = {CPAR_F16, CPAR_BF16};

/* _i = shape; F32 on host tensors, forward and backward. */
START_TEST(test_attn_f32_host) {
    run(&shapes[_i], CPAR_F32, 0.f, true, true, 100 + (uint64_t)_i);
    if (_i < N_HOST_SHAPES) run(&host_shapes[_i], CPAR_F32, 0.f, true, true, 200 + (uint64_t)_i);
    if (_i == 2) run(&shapes[0], CPAR_F32, 0.3f, true, true, 300); /* explicit scale */
}
END_TEST

/* The forward cases' fiber schedules per shape and dtype: all three on sim.
 * On host the schedule means nothing (no fibers), and on nccl-sim the
 * kernels are the sim build's, which the sim suite runs in all three, with
 * nothing between them that NCCL does: one schedule in turn (as in the
 * backward cases) proves the path there. */
static int forward_schedules(void) { return tu_backend() == CPAR_BACKEND_DEVICE ? 3 : 1; }

/* _i = (shape * 2 + dtype) * forward_schedules() + k: F16/BF16 on the
 * backend's device, in schedule _i % 3 (k itself with three schedules). */
START_TEST(test_attn_forward) {
    const int per = forward_schedules(), sh = _i / (2 * per), d16 = (_i / per) % 2;
    schedule(_i % 3);
    run(&shapes[sh], dtypes16[d16], 0.f, false, false, 400 + (uint64_t)_i);
}
END_TEST

/* _i = shape * 2 + dtype, one schedule per case in turn (the backward
 * kernel's own suite, test_attn_bwd, runs every case in several). */
START_TEST(test_attn_backward) {
    const int sh = _i / 2, d16 = _i % 2;
    schedule(_i % 3);
    run(&shapes[sh], dtypes16[d16], 0.f, false, true, 500 + (uint64_t)_i);
}
END_TEST

/* A value of an environment switch that is neither of its words fails
 * cpar_init, naming it. */
static void bad_switch_fails(const char *name, const char *value) {
    setenv(name, value, 1); /* this forked test's own environment */
    cpar_init_config cfg = {.backend = tu_backend(), .timeout_ms = TU_TIMEOUT_MS};
    ck_assert_int_eq(cpar_spawn_with(1, &cfg, tu_rank_nothing, NULL), CPAR_ERR_INVALID);
    char want[96];
    snprintf(want, sizeof want, "%s=\"%s\", expected", name, value);
    ck_assert_msg(strstr(cpar_thread_last_error(), want), "%s", cpar_thread_last_error());
}

/* Case i of a switch's loop test: the shapes with name=on (the dtype
 * alternating) against the fp64 reference, then (i == N_SHAPES) the bad
 * value. */
static void run_switch(int i, const char *name, const char *on, const char *bad, bool backward, uint64_t seed) {
    if (i == N_SHAPES) {
        bad_switch_fails(name, bad);
        return;
    }
    setenv(name, on, 1); /* this forked test's own environment */
    schedule(i % 3);
    run(&shapes[i], dtypes16[i % 2], 0.f, false, backward, seed + (uint64_t)i);
}

/* CPAR_ATTN_DQ=atomic (dq from the dk/dv kernel by fp32 atomics on
 * devices; nothing changes on host tensors): _i = shape, the dtype
 * alternating, against the same reference as test_attn_backward. The last
 * case: a value that is neither atomic nor kernel fails cpar_init, naming
 * it. */
START_TEST(test_attn_backward_atomic_dq) { run_switch(_i, "CPAR_ATTN_DQ", "atomic", "atomics", true, 550); }
END_TEST

/* CPAR_ATTN_FWD_GRID=heads (the device forward's CTAs in batch·head order,
 * cpar_dev_attn's fwd_heads_first): _i = shape, the dtype alternating,
 * against the fp64 reference. The last case: a value that is neither tiles
 * nor heads fails cpar_init, naming it. */
START_TEST(test_attn_forward_heads_grid) { run_switch(_i, "CPAR_ATTN_FWD_GRID", "heads", "head", false, 560); }
END_TEST

/* 16-bit on host tensors (the host reference also on the device backend) and an explicit scale. */
START_TEST(test_attn_16bit_host_and_scale) {
    for (int d16 = 0; d16 < 2; d16++) {
        run(&shapes[1], dtypes16[d16], 0.f, true, true, 600 + (uint64_t)d16);
        run(&shapes[2], dtypes16[d16], 0.25f, false, true, 610 + (uint64_t)d16);
    }
}
END_TEST

/* ---- dropout -------------------------------------------------------------------------------
 * Forward and backward against the fp64 reference with the mask of
 * tu_attn_keep (cpar.h §12's definition, written in testutil.h on the
 * public Philox block). */

static void run_drop(const attn_shape *s, cpar_dtype dt, float scale, bool host, uint64_t seed, float p) {
    attn_case c;
    case_init_drop(&c, s, dt, scale, host, true, seed, p);
    TU_OK(tu_spawn(1, rank_case, &c));
    case_free(&c);
}

/* _i = shape: F32 on host tensors (p 0.25) and a 16-bit dtype on the backend's device (p 0.4). */
START_TEST(test_attn_dropout) {
    schedule(_i % 3);
    run_drop(&shapes[_i], CPAR_F32, 0.f, true, 700 + (uint64_t)_i, 0.25f);
    run_drop(&shapes[_i], dtypes16[_i % 2], _i == 1 ? 0.3f : 0.f, false, 720 + (uint64_t)_i, 0.4f);
    if (_i < N_HOST_SHAPES) run_drop(&host_shapes[_i], CPAR_F32, 0.f, true, 740 + (uint64_t)_i, 0.6f);
}
END_TEST

/* The mask itself: with v = the identity (v_j = e_j, sk <= d), out row i is
 * (P_i ∘ Z_i) / (1 - p), so its zeros are exactly the dropped (or hidden)
 * weights. q is small, so every P_ij is about 1/sk and never rounds to 0.
 * The zero pattern must be tu_attn_keep's on host tensors (F32) and on the
 * device (F16, BF16), and the values agree between them. */
enum { MK_HQ = 2, MK_SQ = 40, MK_SK = 48, MK_D = 64 };

typedef struct {
    bool causal;
    float p;
    cpar_rng_state rng;
    float host_out[MK_HQ * MK_SQ * MK_D]; /* the host tensors' result, for the device's comparison */
} mask_case;

static void mask_inputs(double *q, double *k, double *v) {
    uint64_t st = 77;
    for (int64_t i = 0; i < MK_HQ * MK_SQ * MK_D; i++) q[i] = tu_round(CPAR_BF16, 0.05 * tu_uniform(&st));
    for (int64_t i = 0; i < MK_SK * MK_D; i++) k[i] = tu_round(CPAR_BF16, tu_uniform(&st));
    for (int64_t j = 0; j < MK_SK; j++)
        for (int64_t x = 0; x < MK_D; x++) v[j * MK_D + x] = j == x;
}

static cpar_status rank_mask(cpar_ctx *ctx, void *arg) {
    mask_case *mc = arg;
    const int64_t qs[4] = {1, MK_HQ, MK_SQ, MK_D}, ks[4] = {1, 1, MK_SK, MK_D};
    double *q = dalloc(MK_HQ * MK_SQ * MK_D), *k = dalloc(MK_SK * MK_D), *v = dalloc(MK_SK * MK_D);
    mask_inputs(q, k, v);
    const cpar_attention_config cfg = {.causal = mc->causal, .dropout_p = mc->p, .dropout_state = mc->rng};
    const bool dev = cpar_device(ctx) != CPAR_HOST;
    for (int pass = 0; pass < (dev ? 3 : 1); pass++) { /* host F32, then device F16 and BF16 */
        const bool host = pass == 0;
        const cpar_dtype dt = pass == 0 ? CPAR_F32 : dtypes16[pass - 1];
        cpar_tensor tq = put(ctx, host, q, dt, 4, qs), tk = put(ctx, host, k, dt, 4, ks), tv = put(ctx, host, v, dt, 4, ks);
        cpar_tensor out = put(ctx, host, NULL, dt, 4, qs), lse = put(ctx, host, NULL, CPAR_F32, 3, qs);
        TU_OK(cpar_attention_forward_cfg(ctx, &cfg, &tq, &tk, &tv, &out, &lse));
        void *ho = fetch(ctx, &out);
        int64_t dropped = 0;
        for (int64_t h = 0; h < MK_HQ; h++)
            for (int64_t i = 0; i < MK_SQ; i++)
                for (int64_t x = 0; x < MK_D; x++) {
                    const int64_t e = (h * MK_SQ + i) * MK_D + x;
                    const double g = tu_get(ho, dt, e);
                    const bool seen = x < MK_SK && (!mc->causal || x <= i);
                    const bool keep = seen && tu_attn_keep(mc->rng, mc->p, (uint64_t)h, (uint64_t)i, (uint64_t)x);
                    dropped += seen && !keep;
                    ck_assert_msg(keep ? g > 0.0 : g == 0.0, "%s %s: weight (h %lld, q %lld, k %lld) is %g, expected %s",
                                  cpar_dtype_name(dt), host ? "host" : "device", (long long)h, (long long)i,
                                  (long long)x, g, keep ? "kept (> 0)" : "dropped (0)");
                    if (host) mc->host_out[e] = (float)g;
                    else
                        ck_assert_msg(fabs(g - mc->host_out[e]) <= 1e-2 * mc->host_out[e] + 1e-6,
                                      "%s device weight (h %lld, q %lld, k %lld) is %g, host %g", cpar_dtype_name(dt),
                                      (long long)h, (long long)i, (long long)x, g, (double)mc->host_out[e]);
                }
        ck_assert_msg(dropped > 0, "nothing was dropped at p = %g", (double)mc->p); /* the case can fail */
        free(ho);
        drop(ctx, &tq), drop(ctx, &tk), drop(ctx, &tv), drop(ctx, &out), drop(ctx, &lse);
    }
    free(q), free(k), free(v);
    return CPAR_OK;
}

/* _i = causal * 2 + state: two Philox states (seed and offset), so the mask moves with both */
START_TEST(test_attn_dropout_mask) {
    mask_case mc = {.causal = _i >= 2, .p = 0.3f};
    mc.rng = _i % 2 ? (cpar_rng_state){1234, 0} : (cpar_rng_state){CPAR_RNG_DEFAULT_SEED + 2718, 77};
    TU_OK(tu_spawn(1, rank_mask, &mc));
}
END_TEST

/* The kept fraction is 1 - p: 4 heads x 128 queries x 64 keys of host F32
 * attention with v = the identity, zeros counted, within 5 standard
 * deviations of p; and a different offset gives a different mask. */
static cpar_status rank_drop_stats(cpar_ctx *ctx, void *arg) {
    (void)arg;
    enum { H = 4, SQ = 128, SK = 64, D = 64 };
    const int64_t qs[4] = {1, H, SQ, D}, ks[4] = {1, 1, SK, D}, nq = H * SQ * D;
    double *q = dalloc(nq), *k = dalloc(SK * D), *v = dalloc(SK * D);
    uint64_t st = 5;
    for (int64_t i = 0; i < nq; i++) q[i] = 0.05 * tu_uniform(&st);
    for (int64_t i = 0; i < SK * D; i++) k[i] = tu_uniform(&st);
    for (int64_t j = 0; j < SK; j++) v[j * D + j] = 1.0;
    cpar_tensor tq = put(ctx, true, q, CPAR_F32, 4, qs), tk = put(ctx, true, k, CPAR_F32, 4, ks);
    cpar_tensor tv = put(ctx, true, v, CPAR_F32, 4, ks), out = put(ctx, true, NULL, CPAR_F32, 4, qs);
    cpar_tensor out2 = put(ctx, true, NULL, CPAR_F32, 4, qs), lse = put(ctx, true, NULL, CPAR_F32, 3, qs);
    const float ps[3] = {0.1f, 0.3f, 0.75f};
    for (int t = 0; t < 3; t++) {
        cpar_attention_config cfg = {.dropout_p = ps[t], .dropout_state = {42, 0}};
        TU_OK(cpar_attention_forward_cfg(ctx, &cfg, &tq, &tk, &tv, &out, &lse));
        cfg.dropout_state.offset = SK / 4; /* the next call's state (cpar_rng_reserve's advance) */
        TU_OK(cpar_attention_forward_cfg(ctx, &cfg, &tq, &tk, &tv, &out2, &lse));
        const float *o = out.data, *o2 = out2.data;
        int64_t zeros = 0, differ = 0;
        const int64_t n = (int64_t)H * SQ * SK;
        for (int64_t r = 0; r < H * SQ; r++)
            for (int64_t j = 0; j < SK; j++) {
                zeros += o[r * D + j] == 0.f;
                differ += (o[r * D + j] == 0.f) != (o2[r * D + j] == 0.f);
            }
        const double frac = (double)zeros / (double)n, p = ps[t], sd = sqrt(p * (1 - p) / (double)n);
        ck_assert_msg(fabs(frac - p) <= 5 * sd, "p = %g: dropped fraction %g, expected %g +- %g", p, frac, p, 5 * sd);
        /* two independent masks differ in 2p(1-p) of the weights */
        ck_assert_msg(fabs((double)differ / (double)n - 2 * p * (1 - p)) <= 10 * sd,
                      "p = %g: masks of offsets 0 and %d differ in %lld of %lld weights", p, SK / 4,
                      (long long)differ, (long long)n);
    }
    free(q), free(k), free(v);
    drop(ctx, &tq), drop(ctx, &tk), drop(ctx, &tv), drop(ctx, &out), drop(ctx, &out2), drop(ctx, &lse);
    return CPAR_OK;
}

START_TEST(test_attn_dropout_stats) { TU_OK(tu_spawn(1, rank_drop_stats, NULL)); }
END_TEST

/* p = 0 through the _cfg functions (any Philox state) gives the bool/float
 * functions' bits, forward and backward, on host tensors and the device. */
static cpar_status rank_p0(cpar_ctx *ctx, void *arg) {
    (void)arg;
    const attn_shape *s = &shapes[2];
    const bool dev = cpar_device(ctx) != CPAR_HOST;
    for (int pass = 0; pass < (dev ? 2 : 1); pass++) {
        const bool host = pass == 0;
        const cpar_dtype dt = host ? CPAR_F32 : CPAR_BF16;
        attn_case c;
        case_init(&c, s, dt, 0.f, host, true, 900 + (uint64_t)pass);
        const int64_t qs[4] = {s->b, s->hq, s->sq, s->d}, ks[4] = {s->b, s->hkv, s->sk, s->d};
        cpar_tensor q = put(ctx, host, c.q, dt, 4, qs), k = put(ctx, host, c.k, dt, 4, ks);
        cpar_tensor v = put(ctx, host, c.v, dt, 4, ks), dout = put(ctx, host, c.dout, dt, 4, qs);
        cpar_tensor t[2][5]; /* out, lse, dq, dk, dv of each path */
        for (int path = 0; path < 2; path++) {
            t[path][0] = put(ctx, host, NULL, dt, 4, qs), t[path][1] = put(ctx, host, NULL, CPAR_F32, 3, qs);
            t[path][2] = put(ctx, host, NULL, dt, 4, qs), t[path][3] = put(ctx, host, NULL, dt, 4, ks);
            t[path][4] = put(ctx, host, NULL, dt, 4, ks);
            cpar_tensor *r = t[path];
            if (path == 0) {
                TU_OK(cpar_attention_forward(ctx, &q, &k, &v, s->causal, 0.f, &r[0], &r[1]));
                TU_OK(cpar_attention_backward(ctx, &q, &k, &v, &r[0], &dout, &r[1], s->causal, 0.f, &r[2], &r[3], &r[4]));
            } else {
                const cpar_attention_config cfg = {.causal = s->causal, .dropout_state = {99, 12345}};
                TU_OK(cpar_attention_forward_cfg(ctx, &cfg, &q, &k, &v, &r[0], &r[1]));
                TU_OK(cpar_attention_backward_cfg(ctx, &cfg, &q, &k, &v, &r[0], &dout, &r[1], &r[2], &r[3], &r[4]));
            }
        }
        for (int e = 0; e < 5; e++) {
            void *a = fetch(ctx, &t[0][e]), *b = fetch(ctx, &t[1][e]);
            TU_EXPECT_SAME(b, a, t[0][e].dtype, cpar_tensor_numel(&t[0][e]));
            free(a), free(b);
            drop(ctx, &t[0][e]), drop(ctx, &t[1][e]);
        }
        drop(ctx, &q), drop(ctx, &k), drop(ctx, &v), drop(ctx, &dout);
        case_free(&c);
    }
    return CPAR_OK;
}

START_TEST(test_attn_dropout_p0) { TU_OK(tu_spawn(1, rank_p0, NULL)); }
END_TEST

/* cpar_rng_reserve: the state for a fused kernel, under Megatron's fork. */
static cpar_status rank_reserve(cpar_ctx *ctx, void *arg) {
    (void)arg;
    TU_OK(cpar_model_parallel_manual_seed(ctx, 1234, 0, 0, 0));
    cpar_rng_state before, st, mp, cur;
    TU_OK(cpar_rng_get_state(ctx, NULL, &before));
    TU_OK(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
    TU_OK(cpar_rng_reserve(ctx, 100, &st));
    TU_OK(cpar_rng_unfork(ctx));
    ck_assert_uint_eq(st.seed, 1234 + 2718);
    ck_assert_uint_eq(st.offset, 0);
    TU_OK(cpar_rng_get_state(ctx, CPAR_RNG_MODEL_PARALLEL, &mp));
    ck_assert_uint_eq(mp.offset, 100); /* the forked state advanced */
    TU_OK(cpar_rng_get_state(ctx, NULL, &cur));
    ck_assert(cur.seed == before.seed && cur.offset == before.offset); /* the default one did not */
    TU_OK(cpar_rng_reserve(ctx, 0, &st));
    ck_assert(st.seed == before.seed && st.offset == before.offset);
    TU_FAILS(cpar_rng_reserve(ctx, 1, NULL), CPAR_ERR_INVALID, "cpar_rng_reserve: used is NULL");
    TU_FAILS(cpar_rng_reserve(NULL, 1, &st), CPAR_ERR_INVALID, "ctx is NULL");
    return CPAR_OK;
}

START_TEST(test_attn_rng_reserve) { TU_OK(tu_spawn(1, rank_reserve, NULL)); }
END_TEST

/* ---- packed sequences (THD) -------------------------------------------------------------
 * One packed batch (b = 1) against the per-document fp64 reference: every
 * document attends only to itself (causal within it), padding rows get out
 * 0, lse -inf and zero gradients. Documents of any lengths (1, odd, an empty
 * one), with and without padding, a single long document; host F32 and the
 * backend's 16-bit dtypes; one case with dropout. The last packing spans three
 * of the host path's 128-row tiles: documents that cross tile edges, tiles
 * that hide every weight (skipped), and a last tile of one row whose only
 * visible weight is its own diagonal (row 256, key 256). */
static const int32_t pk_cu[6] = {0, 5, 22, 23, 56, 64}, pk_real[6] = {0, 3, 15, 15, 45, 52};
static const int32_t pk_one[2] = {0, 70}, pk_tiles[5] = {0, 100, 129, 250, 257};
static const cpar_packed_seqs packings[4] = {
    {.n_docs = 5, .cu_seqlens = pk_cu},                               /* uneven, no padding */
    {.n_docs = 5, .cu_seqlens = pk_real, .cu_seqlens_padded = pk_cu}, /* padded; document 2 empty */
    {.n_docs = 1, .cu_seqlens = pk_one},                              /* one long document */
    {.n_docs = 4, .cu_seqlens = pk_tiles},                            /* across host tiles */
};

static void run_packed(const cpar_packed_seqs *pk, bool causal, cpar_dtype dt, bool host, int64_t d, float p,
                       uint64_t seed) {
    const int32_t *cu = pk->cu_seqlens_padded ? pk->cu_seqlens_padded : pk->cu_seqlens;
    const attn_shape s = {1, 2, 1, cu[pk->n_docs], cu[pk->n_docs], d, causal};
    attn_case c;
    memset(&c, 0, sizeof c);
    c.packed = pk; /* before the reference */
    c.s = s, c.dt = dt, c.host = host, c.backward = true, c.seed = seed, c.p = p, c.rng = (cpar_rng_state){seed, 9};
    const int64_t nq = nq_of(&s), nkv = nkv_of(&s);
    c.q = dalloc(nq), c.k = dalloc(nkv), c.v = dalloc(nkv), c.dout = dalloc(nq);
    c.out = dalloc(nq), c.lse = dalloc(s.sq * s.hq), c.dq = dalloc(nq), c.dk = dalloc(nkv), c.dv = dalloc(nkv);
    uint64_t st = seed * 0x9e3779b97f4a7c15ull + 5;
    fill(c.q, nq, dt, &st), fill(c.k, nkv, dt, &st), fill(c.v, nkv, dt, &st), fill(c.dout, nq, dt, &st);
    reference(&c);
    TU_OK(tu_spawn(1, rank_case, &c));
    case_free(&c);
}

/* _i = packing * 2 + causal */
START_TEST(test_attn_packed) {
    const cpar_packed_seqs *pk = &packings[_i / 2];
    const bool causal = _i % 2;
    schedule(_i % 3);
    run_packed(pk, causal, CPAR_F32, true, 16, 0.f, 1100 + (uint64_t)_i);
    run_packed(pk, causal, dtypes16[_i % 2], false, 64, 0.f, 1120 + (uint64_t)_i);
    if (_i == 3) run_packed(pk, causal, CPAR_BF16, false, 40, 0.35f, 1140); /* dropout + padding */
    if (_i == 2) run_packed(pk, causal, CPAR_F32, true, 8, 0.5f, 1141);
}
END_TEST

static cpar_status rank_packed_bad(cpar_ctx *ctx, void *arg) {
    (void)arg;
    const cpar_dtype dt = cpar_device(ctx) != CPAR_HOST ? CPAR_BF16 : CPAR_F32;
    const int64_t qs[4] = {1, 2, 64, 16}, ks[4] = {1, 1, 64, 16}, q2[4] = {2, 2, 64, 16}, k2[4] = {2, 1, 64, 16};
    const int64_t q63[4] = {1, 2, 63, 16}, k63[4] = {1, 1, 63, 16};
    cpar_tensor q = put(ctx, false, NULL, dt, 4, qs), k = put(ctx, false, NULL, dt, 4, ks), out = put(ctx, false, NULL, dt, 4, qs);
    cpar_tensor lse = put(ctx, false, NULL, CPAR_F32, 3, qs);
    cpar_tensor qb = put(ctx, false, NULL, dt, 4, q2), kb = put(ctx, false, NULL, dt, 4, k2), ob = put(ctx, false, NULL, dt, 4, q2);
    cpar_tensor lb = put(ctx, false, NULL, CPAR_F32, 3, q2);
    cpar_tensor qs63 = put(ctx, false, NULL, dt, 4, q63), ks63 = put(ctx, false, NULL, dt, 4, k63);
    cpar_tensor os63 = put(ctx, false, NULL, dt, 4, q63), ls63 = put(ctx, false, NULL, CPAR_F32, 3, q63);
    cpar_attention_config cfg = {.causal = true, .packed = &packings[0]};
    static const char F[] = "cpar_attention_forward_cfg";
    TU_FAILS(cpar_attention_forward_cfg(ctx, &cfg, &qb, &kb, &kb, &ob, &lb), CPAR_ERR_INVALID,
             "q has batch 2, expected 1 with cfg->packed");
    TU_FAILS(cpar_attention_forward_cfg(ctx, &cfg, &qs63, &ks63, &ks63, &os63, &ls63), CPAR_ERR_INVALID,
             "q and k have lengths 63 and 63, expected 64 (the packed length");
    const int32_t bad0[3] = {1, 5, 64}, dec[3] = {0, 40, 30}, real_long[3] = {0, 10, 70}, cu2[3] = {0, 32, 64};
    cpar_packed_seqs bad = {.n_docs = 2, .cu_seqlens = bad0};
    cfg.packed = &bad;
    TU_FAILS(cpar_attention_forward_cfg(ctx, &cfg, &q, &k, &k, &out, &lse), CPAR_ERR_INVALID, "seqs->cu_seqlens[0] is 1");
    bad.cu_seqlens = dec;
    TU_FAILS(cpar_attention_forward_cfg(ctx, &cfg, &q, &k, &k, &out, &lse), CPAR_ERR_INVALID, "decreases at document 1");
    bad.cu_seqlens = real_long, bad.cu_seqlens_padded = cu2;
    TU_FAILS(cpar_attention_forward_cfg(ctx, &cfg, &q, &k, &k, &out, &lse), CPAR_ERR_INVALID,
             "document 1 has padded length 32");
    bad.n_docs = 0;
    TU_FAILS(cpar_attention_forward_cfg(ctx, &cfg, &q, &k, &k, &out, &lse), CPAR_ERR_INVALID, F);
    cpar_tensor *all[] = {&q, &k, &out, &lse, &qb, &kb, &ob, &lb, &qs63, &ks63, &os63, &ls63};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) drop(ctx, all[i]);
    return CPAR_OK;
}

START_TEST(test_attn_packed_bad_args) { TU_OK(tu_spawn(1, rank_packed_bad, NULL)); }
END_TEST

/* ---- no keys, empty batches ------------------------------------------------------------ */

static cpar_status rank_empty(cpar_ctx *ctx, void *arg) {
    const cpar_dtype dt = *(const cpar_dtype *)arg;
    const int64_t qs[4] = {2, 2, 5, 16}, ks[4] = {2, 1, 0, 16}, n = 2 * 2 * 5 * 16;
    cpar_tensor q = put(ctx, false, NULL, dt, 4, qs), k = put(ctx, false, NULL, dt, 4, ks);
    cpar_tensor v = put(ctx, false, NULL, dt, 4, ks);
    double *qv = dalloc(n);
    uint64_t st = 5;
    fill(qv, n, dt, &st);
    drop(ctx, &q);
    q = put(ctx, false, qv, dt, 4, qs);
    cpar_tensor out = put(ctx, false, NULL, dt, 4, qs), lse = put(ctx, false, NULL, CPAR_F32, 3, qs);
    for (int causal = 0; causal < 2; causal++) {
        TU_OK(cpar_attention_forward(ctx, &q, &k, &v, causal, 0.f, &out, &lse));
        void *ho = fetch(ctx, &out);
        float *hl = fetch(ctx, &lse);
        for (int64_t i = 0; i < n; i++) ck_assert(tu_get(ho, dt, i) == 0.0);
        for (int64_t i = 0; i < n / 16; i++) ck_assert(isinf(hl[i]) && hl[i] < 0);
        free(ho), free(hl);
        cpar_tensor dq = put(ctx, false, NULL, dt, 4, qs), dk = put(ctx, false, NULL, dt, 4, ks);
        cpar_tensor dv = put(ctx, false, NULL, dt, 4, ks);
        TU_OK(cpar_attention_backward(ctx, &q, &k, &v, &out, &out, &lse, causal, 0.f, &dq, &dk, &dv));
        void *hdq = fetch(ctx, &dq);
        for (int64_t i = 0; i < n; i++) ck_assert(tu_get(hdq, dt, i) == 0.0);
        free(hdq);
        drop(ctx, &dq), drop(ctx, &dk), drop(ctx, &dv);
    }
    /* b = 0: nothing to do */
    const int64_t q0s[4] = {0, 2, 5, 16}, k0s[4] = {0, 1, 3, 16};
    cpar_tensor q0 = cpar_tensor_make(NULL, dt, 4, q0s, q.device), k0 = cpar_tensor_make(NULL, dt, 4, k0s, q.device);
    cpar_tensor l0 = cpar_tensor_make(NULL, CPAR_F32, 3, q0s, q.device);
    TU_OK(cpar_attention_forward(ctx, &q0, &k0, &k0, true, 0.f, &q0, &l0));
    free(qv);
    drop(ctx, &q), drop(ctx, &k), drop(ctx, &v), drop(ctx, &out), drop(ctx, &lse);
    return CPAR_OK;
}

/* _i = dtype (F16, BF16) on the backend's device. */
START_TEST(test_attn_no_keys) { TU_OK(tu_spawn(1, rank_empty, (void *)&dtypes16[_i])); }
END_TEST

/* ---- finite differences of the host backward --------------------------------------------
 * L = sum(out ∘ w) in fp64 from the F32 forward; dL/dx by central differences
 * on a few elements of q, k and v against backward with dout = w. */

typedef struct {
    attn_shape s;
} fd_case;

static double fd_loss(cpar_ctx *ctx, cpar_tensor *q, cpar_tensor *k, cpar_tensor *v, bool causal, cpar_tensor *out,
                      cpar_tensor *lse, const float *w) {
    TU_OK(cpar_attention_forward(ctx, q, k, v, causal, 0.f, out, lse));
    const float *o = out->data;
    double L = 0.0;
    for (int64_t i = 0; i < cpar_tensor_numel(out); i++) L += (double)o[i] * (double)w[i];
    return L;
}

static cpar_status rank_fd(cpar_ctx *ctx, void *arg) {
    const fd_case *fc = arg;
    const attn_shape *s = &fc->s;
    const int64_t qs[4] = {s->b, s->hq, s->sq, s->d}, ks[4] = {s->b, s->hkv, s->sk, s->d};
    const int64_t nq = nq_of(s), nkv = nkv_of(s);
    double *x = dalloc(2 * nq + 2 * nkv);
    uint64_t st = 99 + (uint64_t)s->causal;
    fill(x, 2 * nq + 2 * nkv, CPAR_F32, &st);
    cpar_tensor q = put(ctx, true, x, CPAR_F32, 4, qs), k = put(ctx, true, x + nq, CPAR_F32, 4, ks);
    cpar_tensor v = put(ctx, true, x + nq + nkv, CPAR_F32, 4, ks);
    cpar_tensor w = put(ctx, true, x + nq + 2 * nkv, CPAR_F32, 4, qs);
    cpar_tensor out = put(ctx, true, NULL, CPAR_F32, 4, qs), lse = put(ctx, true, NULL, CPAR_F32, 3, qs);
    cpar_tensor dq = put(ctx, true, NULL, CPAR_F32, 4, qs), dk = put(ctx, true, NULL, CPAR_F32, 4, ks);
    cpar_tensor dv = put(ctx, true, NULL, CPAR_F32, 4, ks);
    fd_loss(ctx, &q, &k, &v, s->causal, &out, &lse, w.data);
    TU_OK(cpar_attention_backward(ctx, &q, &k, &v, &out, &w, &lse, s->causal, 0.f, &dq, &dk, &dv));
    cpar_tensor *vars[3] = {&q, &k, &v}, *grads[3] = {&dq, &dk, &dv};
    static const char *const names[3] = {"q", "k", "v"};
    const float h = 1e-2f;
    for (int t = 0; t < 3; t++) {
        const int64_t n = cpar_tensor_numel(vars[t]);
        for (int e = 0; e < 6; e++) {
            const int64_t i = (int64_t)(tu_next(&st) % (uint64_t)n);
            float *p = (float *)vars[t]->data + i;
            const float x0 = *p;
            *p = x0 + h;
            const double lp = fd_loss(ctx, &q, &k, &v, s->causal, &out, &lse, w.data);
            *p = x0 - h;
            const double lm = fd_loss(ctx, &q, &k, &v, s->causal, &out, &lse, w.data);
            *p = x0;
            const double fd = (lp - lm) / (2.0 * (double)h), an = ((float *)grads[t]->data)[i];
            ck_assert_msg(fabs(fd - an) <= 2e-3 * (1.0 + fabs(an)), "%s %s[%lld]: backward %.7g, finite difference %.7g",
                          s->causal ? "causal" : "full", names[t], (long long)i, an, fd);
        }
    }
    free(x);
    cpar_tensor *all[] = {&q, &k, &v, &w, &out, &lse, &dq, &dk, &dv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) drop(ctx, all[i]);
    return CPAR_OK;
}

/* _i = causal */
START_TEST(test_attn_finite_differences) {
    fd_case fc = {{1, 2, 1, 5, 7, 8, _i == 1}};
    TU_OK(tu_spawn(1, rank_fd, &fc));
    fd_case gqa = {{2, 3, 1, 6, 4, 5, _i == 1}}; /* sq > sk, odd d */
    TU_OK(tu_spawn(1, rank_fd, &gqa));
}
END_TEST

/* ---- the device layer on strided blocks (sim) ---------------------------------------------
 * cpar_dev_attention_fwd as the ring attention calls it: a sub-range of the
 * sequence is a pointer offset with the parent's (b,h) strides; out F32 or
 * 16-bit; rows outside the block stay poisoned. Also its argument checks. */

/* fp64 forward of one block on the full arrays (element (bh, i, c) at bh*x_bh + i*d + c). */
static void ref_block(const double *q, int64_t q_bh, const double *k, const double *v, int64_t kv_bh, int64_t bhq,
                      int64_t group, int64_t sq, int64_t sk, int64_t d, bool causal, double scale, double *out,
                      int64_t o_bh, double *lse, int64_t lse_bh) {
    double *p = dalloc(sk);
    for (int64_t bh = 0; bh < bhq; bh++)
        for (int64_t i = 0; i < sq; i++) {
            const int64_t n = causal ? (i + 1 < sk ? i + 1 : sk) : sk, kh = bh / group;
            double m = -INFINITY, sum = 0.0;
            for (int64_t j = 0; j < n; j++) {
                double acc = 0.0;
                for (int64_t x = 0; x < d; x++) acc += q[bh * q_bh + i * d + x] * k[kh * kv_bh + j * d + x];
                m = fmax(m, p[j] = scale * acc);
            }
            for (int64_t j = 0; j < n; j++) sum += (p[j] = exp(p[j] - m));
            for (int64_t x = 0; x < d; x++) {
                double acc = 0.0;
                for (int64_t j = 0; j < n; j++) acc += p[j] * v[kh * kv_bh + j * d + x];
                out[bh * o_bh + i * d + x] = acc / sum;
            }
            lse[bh * lse_bh + i] = m + log(sum);
        }
    free(p);
}

static cpar_status rank_dev_blocks(cpar_ctx *ctx, void *arg) {
    (void)arg;
    if (cpar_device(ctx) == CPAR_HOST) return CPAR_OK; /* a device-layer test */
    enum { B = 1, HQ = 4, HKV = 2, SQ = 80, SK = 100, D = 48 };
    const int64_t qs[4] = {B, HQ, SQ, D}, ks[4] = {B, HKV, SK, D}, nq = B * HQ * SQ * D, nk = B * HKV * SK * D;
    for (int dti = 0; dti < 2; dti++)
        for (int variant = 0; variant < 3; variant++) {
            const cpar_dtype dt = dtypes16[dti];
            /* variant 0: q rows [40, 80) against keys [0, 50), full, out F32;
             * variant 1: q rows [0, 40) against keys [0, 50), causal, out in dt;
             * variant 2: as 0 with q one element past a 16-byte boundary (the
             * kernel's element-wise staging path) */
            const int64_t r0 = variant == 1 ? 0 : 40, bsq = 40, bsk = 50, shift = variant == 2;
            const bool causal = variant == 1;
            const cpar_dtype odt = variant == 1 ? dt : CPAR_F32;
            uint64_t st = 4242 + (uint64_t)(dti * 2 + variant);
            double *hq0 = dalloc(nq + 1), *hk = dalloc(nk), *hv = dalloc(nk), *want = dalloc(nq), *wl = dalloc(B * HQ * SQ);
            double *hq = hq0 + shift;
            fill(hq0, nq + 1, dt, &st), fill(hk, nk, dt, &st), fill(hv, nk, dt, &st);
            const double scale = 0.2;
            ref_block(hq + r0 * D, SQ * D, hk, hv, SK * D, B * HQ, HQ / HKV, bsq, bsk, D, causal, scale, want + r0 * D,
                      SQ * D, wl + r0, SQ);
            const int64_t qflat = nq + 1;
            cpar_tensor q = put(ctx, false, hq0, dt, 1, &qflat), k = put(ctx, false, hk, dt, 4, ks);
            cpar_tensor v = put(ctx, false, hv, dt, 4, ks);
            cpar_tensor out = put(ctx, false, NULL, odt, 4, qs), lse = put(ctx, false, NULL, CPAR_F32, 3, qs);
            const size_t es = cpar_dtype_size(dt), oes = cpar_dtype_size(odt);
            cpar_dev_attn a = {.dt = dt, .b = B, .hq = HQ, .hkv = HKV, .sq = bsq, .sk = bsk, .d = D,
                               .q = (const char *)q.data + (size_t)(shift + r0 * D) * es, .k = k.data, .v = v.data,
                               .q_bh = SQ * D, .kv_bh = SK * D, .causal = causal, .scale = (float)scale};
            /* The kernel goes on the legacy stream, which cpar's (non-blocking)
             * streams are not ordered with: the uploads first, the results after. */
            TU_OK(cpar_sync(ctx));
            TU_OK(cpar_dev_attention_fwd(&a, (char *)out.data + (size_t)(r0 * D) * oes, odt, SQ * D,
                                         (float *)lse.data + r0, SQ, NULL));
            TU_OK(cpar_dev_sync());
            void *ho = fetch(ctx, &out);
            float *hl = fetch(ctx, &lse);
            const double tol = dt == CPAR_F16 ? 4e-3 : 2.5e-2;
            for (int64_t bh = 0; bh < B * HQ; bh++)
                for (int64_t i = 0; i < SQ; i++) {
                    const bool in = i >= r0 && i < r0 + bsq;
                    const float l = hl[bh * SQ + i];
                    ck_assert_msg(in ? fabs(l - wl[bh * SQ + i]) <= 2e-5 * (1.0 + fabs(wl[bh * SQ + i])) : isnan(l),
                                  "variant %d %s: lse (%lld, %lld) = %g, expected %g", variant, cpar_dtype_name(dt),
                                  (long long)bh, (long long)i, l, in ? wl[bh * SQ + i] : NAN);
                    for (int64_t x = 0; x < D; x++) {
                        const int64_t e = (bh * SQ + i) * D + x;
                        const double g = tu_get(ho, odt, e);
                        ck_assert_msg(in ? fabs(g - want[e]) <= tol : isnan(g),
                                      "variant %d %s: out (%lld, %lld, %lld) = %g, expected %g", variant,
                                      cpar_dtype_name(dt), (long long)bh, (long long)i, (long long)x, g,
                                      in ? want[e] : NAN);
                    }
                }
            free(ho), free(hl), free(hq0), free(hk), free(hv), free(want), free(wl);
            if (variant == 0 && dti == 0) { /* the device layer's own argument checks */
                cpar_dev_attn bad = a;
                float *lp = lse.data;
                ck_assert_int_eq(cpar_dev_attention_fwd(NULL, out.data, odt, SQ * D, lp, SQ, NULL), CPAR_ERR_INVALID);
                ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "a is NULL"));
                bad.dt = CPAR_F32;
                ck_assert_int_eq(cpar_dev_attention_fwd(&bad, out.data, odt, SQ * D, lp, SQ, NULL), CPAR_ERR_INVALID);
                ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "a->dt = f32"));
                bad = a, bad.d = 12;
                ck_assert_int_eq(cpar_dev_attention_fwd(&bad, out.data, odt, SQ * D, lp, SQ, NULL), CPAR_ERR_INVALID);
                ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "a->d = 12"));
                bad = a, bad.hkv = 3;
                ck_assert_int_eq(cpar_dev_attention_fwd(&bad, out.data, odt, SQ * D, lp, SQ, NULL), CPAR_ERR_INVALID);
                ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "a->hkv = 3"));
                bad = a, bad.scale = 0.f;
                ck_assert_int_eq(cpar_dev_attention_fwd(&bad, out.data, odt, SQ * D, lp, SQ, NULL), CPAR_ERR_INVALID);
                ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "a->scale"));
                bad = a, bad.dropout_p = 1.f;
                ck_assert_int_eq(cpar_dev_attention_fwd(&bad, out.data, odt, SQ * D, lp, SQ, NULL), CPAR_ERR_INVALID);
                ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "a->dropout_p = 1"));
                bad = a, bad.q_bh = 10;
                ck_assert_int_eq(cpar_dev_attention_fwd(&bad, out.data, odt, SQ * D, lp, SQ, NULL), CPAR_ERR_INVALID);
                ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "a->q_bh = 10"));
                bad = a, bad.sk = (int64_t)INT32_MAX - 127, bad.kv_bh = bad.sk * D; /* past the 128-key tiles' 32-bit indices */
                ck_assert_int_eq(cpar_dev_attention_fwd(&bad, out.data, odt, SQ * D, lp, SQ, NULL), CPAR_ERR_INVALID);
                ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "a->sk = 2147483520, expected < 2^31 - 128"));
                ck_assert_int_eq(cpar_dev_attention_fwd(&a, out.data, CPAR_I32, SQ * D, lp, SQ, NULL), CPAR_ERR_INVALID);
                ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "out_dt = i32"));
                ck_assert_int_eq(cpar_dev_attention_fwd(&a, out.data, odt, SQ * D, lp, 5, NULL), CPAR_ERR_INVALID);
                ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "lse_bh = 5"));
                ck_assert_int_eq(cpar_dev_attention_fwd(&a, NULL, odt, SQ * D, lp, SQ, NULL), CPAR_ERR_INVALID);
                ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "out is NULL"));
                bad = a, bad.sq = 0; /* nothing to do */
                TU_OK(cpar_dev_attention_fwd(&bad, NULL, odt, SQ * D, NULL, SQ, NULL));
            }
            drop(ctx, &q), drop(ctx, &k), drop(ctx, &v), drop(ctx, &out), drop(ctx, &lse);
        }
    return CPAR_OK;
}

/* _i = schedule */
START_TEST(test_attn_device_blocks) {
    schedule(_i);
    TU_OK(tu_spawn(1, rank_dev_blocks, NULL));
}
END_TEST

/* ---- bad input ---------------------------------------------------------------------------- */

static cpar_status rank_bad(cpar_ctx *ctx, void *arg) {
    (void)arg;
    const bool dev = cpar_device(ctx) != CPAR_HOST;
    const cpar_dtype dt = CPAR_BF16;
    const int64_t qs[4] = {2, 4, 5, 16}, ks[4] = {2, 2, 7, 16};
    const int64_t q3[3] = {2, 4, 5}, kb[4] = {1, 2, 7, 16}, kd[4] = {2, 2, 7, 8}, kh[4] = {2, 3, 7, 16};
    const int64_t k6[4] = {2, 2, 6, 16}, l4[3] = {2, 4, 4};
    cpar_tensor q = put(ctx, false, NULL, dt, 4, qs), k = put(ctx, false, NULL, dt, 4, ks);
    cpar_tensor v = put(ctx, false, NULL, dt, 4, ks), out = put(ctx, false, NULL, dt, 4, qs);
    cpar_tensor lse = put(ctx, false, NULL, CPAR_F32, 3, qs), dout = put(ctx, false, NULL, dt, 4, qs);
    cpar_tensor dq = put(ctx, false, NULL, dt, 4, qs), dk = put(ctx, false, NULL, dt, 4, ks);
    cpar_tensor dv = put(ctx, false, NULL, dt, 4, ks);
    /* reshaped and retyped views of the same memory (shape checks come first) */
    cpar_tensor q_3d = q, k_b = k, k_d = k, k_h = k, v_6 = v, out16 = out, lse4 = lse, lse16 = lse, k_f16 = k;
    q_3d.ndim = 3, memcpy(q_3d.shape, q3, sizeof q3);
    memcpy(k_b.shape, kb, sizeof kb), memcpy(k_d.shape, kd, sizeof kd), memcpy(k_h.shape, kh, sizeof kh);
    memcpy(v_6.shape, k6, sizeof k6), memcpy(lse4.shape, l4, sizeof l4);
    out16.dtype = CPAR_F16, lse16.dtype = CPAR_F16, k_f16.dtype = CPAR_F16;
    cpar_tensor q_i32 = q;
    q_i32.dtype = CPAR_I32, q_i32.shape[3] = 8;
    cpar_tensor nodata = q;
    nodata.data = NULL;
    static const char F[] = "cpar_attention_forward", B[] = "cpar_attention_backward";

    TU_FAILS(cpar_attention_forward(NULL, &q, &k, &v, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "ctx is NULL");
    TU_FAILS(cpar_attention_forward(ctx, NULL, &k, &v, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "q is NULL");
    TU_FAILS(cpar_attention_forward(ctx, &nodata, &k, &v, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "q has NULL data");
    TU_FAILS(cpar_attention_forward(ctx, &q, NULL, &v, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "k is NULL");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, NULL, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "v is NULL");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, 0.f, NULL, &lse), CPAR_ERR_INVALID, "out is NULL");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, 0.f, &out, NULL), CPAR_ERR_INVALID, "lse is NULL");
    TU_FAILS(cpar_attention_forward(ctx, &q_3d, &k, &v, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "q has shape [2,4,5]");
    TU_FAILS(cpar_attention_forward(ctx, &q_i32, &k, &v, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "q has dtype i32");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k_b, &v, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "k has shape [1,2,7,16]");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k_d, &v, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "k has shape [2,2,7,8]");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k_h, &v_6, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "v has shape");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k_f16, &v, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "k has dtype f16");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v_6, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "v has shape [2,2,6,16]");
    cpar_tensor v_h = v;
    memcpy(v_h.shape, kh, sizeof kh);
    TU_FAILS(cpar_attention_forward(ctx, &q, &k_h, &v_h, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "k has 3 heads");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, 0.f, &out16, &lse), CPAR_ERR_INVALID, "out has dtype f16");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, 0.f, &k, &lse), CPAR_ERR_INVALID, "out has shape");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, 0.f, &out, &lse16), CPAR_ERR_INVALID, "lse has dtype f16");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, 0.f, &out, &lse4), CPAR_ERR_INVALID, "lse has shape [2,4,4]");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, -1.f, &out, &lse), CPAR_ERR_INVALID, "scale is -1");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, NAN, &out, &lse), CPAR_ERR_INVALID, "scale is nan");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, INFINITY, &out, &lse), CPAR_ERR_INVALID, "scale is inf");
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, 0.f, &q, &lse), CPAR_ERR_INVALID, "out overlaps q");
    cpar_tensor lse_on_out = lse;
    lse_on_out.data = out.data;
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, 0.f, &out, &lse_on_out), CPAR_ERR_INVALID, "out overlaps lse");
    {
        const int64_t q0[4] = {2, 4, 5, 0}, k0[4] = {2, 2, 7, 0};
        cpar_tensor qz = cpar_tensor_make(NULL, dt, 4, q0, q.device), kz = cpar_tensor_make(NULL, dt, 4, k0, q.device);
        TU_FAILS(cpar_attention_forward(ctx, &qz, &kz, &kz, true, 0.f, &qz, &lse), CPAR_ERR_INVALID, "head dim d = 0");
    }
    if (dev) { /* devices: memory of one kind, 16-bit, d a multiple of 8 up to 128 */
        const int64_t hs[4] = {2, 2, 7, 16};
        cpar_tensor kh_host = put(ctx, true, NULL, dt, 4, hs), q_host = put(ctx, true, NULL, dt, 4, qs);
        TU_FAILS(cpar_attention_forward(ctx, &q, &kh_host, &v, true, 0.f, &out, &lse), CPAR_ERR_INVALID, "k is on host");
        TU_FAILS(cpar_attention_forward(ctx, &q_host, &k, &v, true, 0.f, &out, &lse), CPAR_ERR_INVALID,
                 "k is on device 0, expected host");
        TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, 0.f, &out, &q_host), CPAR_ERR_INVALID, "lse is on host");
        cpar_tensor other = q;
        other.device = 3;
        TU_FAILS(cpar_attention_forward(ctx, &other, &k, &v, true, 0.f, &out, &lse), CPAR_ERR_INVALID,
                 "q is on device 3");
        cpar_tensor q32 = q, k32 = k, v32 = v, o32 = out;
        const int64_t s32[4] = {2, 4, 5, 8}, k32s[4] = {2, 2, 7, 8};
        q32.dtype = k32.dtype = v32.dtype = o32.dtype = CPAR_F32;
        memcpy(q32.shape, s32, sizeof s32), memcpy(o32.shape, s32, sizeof s32);
        memcpy(k32.shape, k32s, sizeof k32s), memcpy(v32.shape, k32s, sizeof k32s);
        TU_FAILS(cpar_attention_forward(ctx, &q32, &k32, &v32, true, 0.f, &o32, &lse), CPAR_ERR_UNSUPPORTED,
                 "device attention takes f16 or bf16");
        cpar_tensor q12 = q, k12 = k, v12 = v, o12 = out;
        q12.shape[3] = k12.shape[3] = v12.shape[3] = o12.shape[3] = 12;
        TU_FAILS(cpar_attention_forward(ctx, &q12, &k12, &v12, true, 0.f, &o12, &lse), CPAR_ERR_INVALID,
                 "head dim d = 12, expected a multiple of 8 up to 128");
        cpar_tensor q136 = q, k136 = k, v136 = v, o136 = out;
        const int64_t big_q[4] = {1, 1, 1, 136}, big_k[4] = {1, 1, 1, 136}, big_l[3] = {1, 1, 1};
        memcpy(q136.shape, big_q, sizeof big_q), memcpy(o136.shape, big_q, sizeof big_q);
        memcpy(k136.shape, big_k, sizeof big_k), memcpy(v136.shape, big_k, sizeof big_k);
        o136.data = dv.data; /* 136 elements fit in dv's 448 */
        cpar_tensor l136 = lse;
        memcpy(l136.shape, big_l, sizeof big_l);
        TU_FAILS(cpar_attention_forward(ctx, &q136, &k136, &v136, false, 0.f, &o136, &l136), CPAR_ERR_INVALID,
                 "head dim d = 136");
        TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, true, 0.f, &dq, &kh_host, &dv),
                 CPAR_ERR_INVALID, "dk is on host");
        drop(ctx, &kh_host), drop(ctx, &q_host);
    }
    TU_FAILS(cpar_attention_backward(NULL, &q, &k, &v, &out, &dout, &lse, true, 0.f, &dq, &dk, &dv), CPAR_ERR_INVALID,
             "ctx is NULL");
    TU_FAILS(cpar_attention_backward(ctx, NULL, &k, &v, &out, &dout, &lse, true, 0.f, &dq, &dk, &dv), CPAR_ERR_INVALID,
             "q is NULL");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k_b, &v, &out, &dout, &lse, true, 0.f, &dq, &dk, &dv), CPAR_ERR_INVALID,
             "k has shape");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, NULL, &dout, &lse, true, 0.f, &dq, &dk, &dv), CPAR_ERR_INVALID,
             "out is NULL");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, NULL, &lse, true, 0.f, &dq, &dk, &dv), CPAR_ERR_INVALID,
             "dout is NULL");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &k, &lse, true, 0.f, &dq, &dk, &dv), CPAR_ERR_INVALID,
             "dout has shape");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out16, &dout, &lse, true, 0.f, &dq, &dk, &dv), CPAR_ERR_INVALID,
             "out has dtype f16");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, NULL, true, 0.f, &dq, &dk, &dv), CPAR_ERR_INVALID,
             "lse is NULL");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse4, true, 0.f, &dq, &dk, &dv), CPAR_ERR_INVALID,
             "lse has shape");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, true, -2.f, &dq, &dk, &dv), CPAR_ERR_INVALID,
             "scale is -2");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, true, 0.f, NULL, &dk, &dv), CPAR_ERR_INVALID,
             "dq is NULL");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, true, 0.f, &dq, NULL, &dv), CPAR_ERR_INVALID,
             "dk is NULL");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, true, 0.f, &dq, &dk, NULL), CPAR_ERR_INVALID,
             "dv is NULL");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, true, 0.f, &dk, &dk, &dv), CPAR_ERR_INVALID,
             "dq has shape");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, true, 0.f, &dq, &v_6, &dv), CPAR_ERR_INVALID,
             "dk has shape");
    cpar_tensor dv16 = dv;
    dv16.dtype = CPAR_F16;
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, true, 0.f, &dq, &dk, &dv16), CPAR_ERR_INVALID,
             "dv has dtype f16");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, true, 0.f, &dq, &dk, &dk), CPAR_ERR_INVALID,
             "dk overlaps dv");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, true, 0.f, &dq, &dk, &v), CPAR_ERR_INVALID,
             "dv overlaps v");
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, true, 0.f, &dout, &dk, &dv), CPAR_ERR_INVALID,
             "dq overlaps dout");
    { /* the _cfg forms: cfg itself and dropout_p (p = 1 is refused as cpar_dropout_forward refuses it) */
        static const char FC[] = "cpar_attention_forward_cfg", BC[] = "cpar_attention_backward_cfg";
        cpar_attention_config cfg = {.causal = true, .dropout_p = 0.1f};
        TU_FAILS(cpar_attention_forward_cfg(ctx, NULL, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID,
                 "cpar_attention_forward_cfg: cfg is NULL");
        TU_FAILS(cpar_attention_backward_cfg(ctx, NULL, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv),
                 CPAR_ERR_INVALID, "cpar_attention_backward_cfg: cfg is NULL");
        TU_FAILS(cpar_attention_forward_cfg(NULL, &cfg, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, "ctx is NULL");
        const float bad_p[4] = {1.f, -0.1f, NAN, 2.f};
        const char *const msg[4] = {"cfg->dropout_p is 1, expected 0 <= p < 1", "cfg->dropout_p is -0.1",
                                    "cfg->dropout_p is nan", "cfg->dropout_p is 2"};
        for (int i = 0; i < 4; i++) {
            cfg.dropout_p = bad_p[i];
            TU_FAILS(cpar_attention_forward_cfg(ctx, &cfg, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, msg[i]);
            TU_FAILS(cpar_attention_backward_cfg(ctx, &cfg, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv),
                     CPAR_ERR_INVALID, msg[i]);
        }
        cfg.dropout_p = 1.f;
        TU_FAILS(cpar_attention_forward_cfg(ctx, &cfg, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, FC);
        TU_FAILS(cpar_attention_backward_cfg(ctx, &cfg, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv),
                 CPAR_ERR_INVALID, BC);
        cfg.dropout_p = 0.f, cfg.scale = -3.f;
        TU_FAILS(cpar_attention_forward_cfg(ctx, &cfg, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, "cfg->scale is -3");
    }
    /* every message names the function */
    TU_FAILS(cpar_attention_forward(ctx, &q, &k, &v, true, -1.f, &out, &lse), CPAR_ERR_INVALID, F);
    TU_FAILS(cpar_attention_backward(ctx, &q, &k, &v, &out, &dout, &lse, true, -1.f, &dq, &dk, &dv), CPAR_ERR_INVALID, B);
    cpar_tensor *all[] = {&q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) drop(ctx, all[i]);
    return CPAR_OK;
}

START_TEST(test_attn_bad_args) { TU_OK(tu_spawn(1, rank_bad, NULL)); }
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("attn: local attention forward and backward");
    const tu_loop loops[] = {
        {"attn_f32_host", test_attn_f32_host, N_SHAPES},
        {"attn_forward", test_attn_forward, N_SHAPES * 2 * forward_schedules()},
        {"attn_backward", test_attn_backward, N_SHAPES * 2},
        {"attn_backward_atomic_dq", test_attn_backward_atomic_dq, N_SHAPES + 1},
        {"attn_forward_heads_grid", test_attn_forward_heads_grid, N_SHAPES + 1},
        {"attn_16bit_host_and_scale", test_attn_16bit_host_and_scale, 1},
        {"attn_no_keys", test_attn_no_keys, 2},
        {"attn_device_blocks", test_attn_device_blocks, 3},
        {"attn_finite_differences", test_attn_finite_differences, 2},
        {"attn_dropout", test_attn_dropout, N_SHAPES},
        {"attn_dropout_mask", test_attn_dropout_mask, 4},
        {"attn_dropout_stats", test_attn_dropout_stats, 1},
        {"attn_dropout_p0", test_attn_dropout_p0, 1},
        {"attn_rng_reserve", test_attn_rng_reserve, 1},
        {"attn_packed", test_attn_packed, 8},
        {"attn_packed_bad_args", test_attn_packed_bad_args, 1},
        {"attn_bad_args", test_attn_bad_args, 1},
    };
    tu_add_loops(s, loops, sizeof loops / sizeof loops[0], 120);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
