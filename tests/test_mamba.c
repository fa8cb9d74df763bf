/* SPDX-License-Identifier: MIT */
/* test_mamba.c — Mamba all-to-all context parallelism (cpar.h §13).
 *
 * The load-balancing orders (the seed's cp = 3 example, inverse pairs up to
 * cp = 8); cp2hp / hp2cp against a reference built from every rank's input,
 * their round trips and byte counts ((cp-1)/cp of the tensor per call); the
 * object's derived sizes and the seed's divisibility errors (with the
 * numbers in the message); the full pipeline at cp 1, 2, 3, 4 with
 * ngroups > cp, == cp and < cp (group repetition R = 2 and 3): a random
 * in-projection output of the whole sequence and cp = 1 conv1d parameters,
 * sharded round-robin (rank r: chunks r and 2cp-1-r) -> pre_conv_ssm ->
 * conv1d on the rank's channels through the cp = 1 parameters ->
 * post_conv_ssm, forward and backward, against a single-rank fp64
 * computation on the full sequence (conv over every cp = 1 channel, split
 * back); parameter gradients summed over the ranks equal the cp = 1
 * gradients; parameter slices (get, view, accumulate); finite differences of
 * the conv1d backward; bad input for every public function. Packed batches
 * (THD, packed.h's packings: uneven documents from 2cp long, one long
 * document, padding): pre / post conv_ssm forward against the unsharded
 * packing in natural order, backward against the adjoint (B/C replicas
 * summed), one all-to-all each; one unpadded document = the unpacked call
 * bit for bit; the conv1d run per document on row views of pre's output
 * against a causal conv restarted at every document; bad packings name the
 * document. F32, F16, BF16 activations
 * (F32 or same-dtype parameters); host and device backends. */
#include "testutil.h"
#include "packed.h"

#define MAX_CP 4

/* ---- sharding (load balanced: rank r holds chunks r and 2P-1-r of 2P) ---- */

/* Global sequence index of local row t of rank r (sl = s/P local rows). */
static int64_t lb_global(int p, int r, int64_t sl, int64_t t) {
    int64_t c = sl / 2;
    return t < c ? r * c + t : (2 * (int64_t)p - 1 - r) * c + (t - c);
}

/* The rank and local row holding global row g. */
static void lb_owner(int p, int64_t sl, int64_t g, int *rank, int64_t *t) {
    int64_t c = sl / 2, q = g / c;
    if (q < p) *rank = (int)q, *t = g % c;
    else *rank = (int)(2 * p - 1 - q), *t = c + g % c;
}

/* ---- load-balancing orders --------------------------------------------------------------- */

/* in: 2P chunks of rows x 3 holding labels lab[k] */
static cpar_status rank_lb(cpar_ctx *ctx, void *arg) {
    (void)arg;
    for (int p = 1; p <= 8; p++) {
        int64_t rows = 2, n = 2 * p * rows * 3, shape[3] = {2 * p * rows, 1, 3};
        float *h = malloc(sizeof(float) * (size_t)n), *want = malloc(sizeof(float) * (size_t)n);
        for (int k = 0; k < 2 * p; k++) { /* in order 1, 2P, 2, 2P-1, ... (cp = 3: 1,6,2,5,3,4) */
            int lab = k % 2 == 0 ? k / 2 + 1 : 2 * p - k / 2;
            for (int64_t i = 0; i < rows * 3; i++) {
                h[k * rows * 3 + i] = (float)(lab * 100 + i);
                want[(lab - 1) * rows * 3 + i] = (float)(lab * 100 + i);
            }
        }
        if (p == 3) { /* the seed's example spelled out */
            const int seed_order[6] = {1, 6, 2, 5, 3, 4};
            for (int k = 0; k < 6; k++) ck_assert_int_eq((int)h[k * rows * 3] / 100, seed_order[k]);
        }
        cpar_tensor in = tu_upload(ctx, h, CPAR_F32, 3, shape), out = tu_alloc_poisoned(ctx, CPAR_F32, 3, shape);
        cpar_tensor back = tu_alloc_poisoned(ctx, CPAR_F32, 3, shape);
        TU_OK(cpar_undo_attention_load_balancing(ctx, p, &in, &out));
        float *got = tu_download(ctx, &out);
        TU_EXPECT_SAME(got, want, CPAR_F32, n);
        TU_OK(cpar_redo_attention_load_balancing(ctx, p, &out, &back));
        float *got2 = tu_download(ctx, &back);
        TU_EXPECT_SAME(got2, h, CPAR_F32, n);
        free(got), free(got2);
        /* random data in any dtype: redo then undo is the identity */
        int64_t rshape[2] = {4 * p, 5};
        void *r = tu_random_host(CPAR_BF16, 20 * p, 77 + (uint64_t)p);
        cpar_tensor a = tu_upload(ctx, r, CPAR_BF16, 2, rshape), b = tu_alloc_poisoned(ctx, CPAR_BF16, 2, rshape);
        cpar_tensor c = tu_alloc_poisoned(ctx, CPAR_BF16, 2, rshape);
        TU_OK(cpar_redo_attention_load_balancing(ctx, p, &a, &b));
        TU_OK(cpar_undo_attention_load_balancing(ctx, p, &b, &c));
        void *rc = tu_download(ctx, &c);
        TU_EXPECT_SAME(rc, r, CPAR_BF16, 20 * p);
        free(rc), free(r), free(h), free(want);
        cpar_tensor *all[] = {&in, &out, &back, &a, &b, &c};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    }
    return CPAR_OK;
}

START_TEST(test_lb_orders) { TU_OK(tu_spawn(1, rank_lb, NULL)); }
END_TEST

/* ---- cp2hp / hp2cp ---------------------------------------------------------------------- */

typedef struct {
    cpar_dtype dt;
} a2a_case;

static void expect_a2a_bytes(cpar_group *g, size_t nbytes) {
    cpar_comm_stats cs;
    int p = cpar_group_size(g);
    TU_OK(cpar_group_stats(g, &cs));
    ck_assert_uint_eq(cs.kind[CPAR_COLL_ALL_TO_ALL].calls, p > 1 ? 1 : 0);
    ck_assert_uint_eq(cs.kind[CPAR_COLL_ALL_TO_ALL].bytes_sent, (uint64_t)nbytes / (uint64_t)p * (uint64_t)(p - 1));
    ck_assert_uint_eq(cs.kind[CPAR_COLL_ALL_TO_ALL].bytes_recv, (uint64_t)nbytes / (uint64_t)p * (uint64_t)(p - 1));
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++)
        if (k != CPAR_COLL_ALL_TO_ALL) ck_assert_uint_eq(cs.kind[k].calls, 0);
    TU_OK(cpar_group_stats_reset(g));
}

static cpar_status rank_a2a(cpar_ctx *ctx, void *arg) {
    a2a_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int p = cpar_group_size(g), r = cpar_group_rank(g);
    int64_t sl = 3, b = 2, h = 3 * p, hp = h / p, n = sl * b * h;
    size_t es = cpar_dtype_size(c->dt);
    int64_t ishape[3] = {sl, b, h}, oshape[3] = {sl * p, b, hp};
    void *mine = tu_random_host(c->dt, n, 1000 + (uint64_t)r);
    /* reference: out[(i sl + t), bi, cc] = rank i's in[t, bi, r hp + cc] */
    void *want = malloc((size_t)n * es);
    for (int i = 0; i < p; i++) {
        void *theirs = tu_random_host(c->dt, n, 1000 + (uint64_t)i);
        for (int64_t t = 0; t < sl; t++)
            for (int64_t bi = 0; bi < b; bi++)
                memcpy((char *)want + (size_t)((((int64_t)i * sl + t) * b + bi) * hp) * es,
                       (char *)theirs + (size_t)((t * b + bi) * h + r * hp) * es, (size_t)hp * es);
        free(theirs);
    }
    cpar_tensor in = tu_upload(ctx, mine, c->dt, 3, ishape), out = tu_alloc_poisoned(ctx, c->dt, 3, oshape);
    cpar_tensor back = tu_alloc_poisoned(ctx, c->dt, 3, ishape), back2 = tu_alloc_poisoned(ctx, c->dt, 3, ishape);
    cpar_tensor out2 = tu_alloc_poisoned(ctx, c->dt, 3, oshape);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_all_to_all_cp2hp(g, &in, &out, CPAR_FWD));
    expect_a2a_bytes(g, cpar_tensor_nbytes(&in));
    void *got = tu_download(ctx, &out);
    TU_EXPECT_SAME(got, want, c->dt, n);
    TU_OK(cpar_all_to_all_hp2cp(g, &out, &back, CPAR_FWD)); /* the inverse */
    expect_a2a_bytes(g, cpar_tensor_nbytes(&out));
    void *gb = tu_download(ctx, &back);
    TU_EXPECT_SAME(gb, mine, c->dt, n);
    TU_OK(cpar_all_to_all_cp2hp(g, &out, &back2, CPAR_BWD)); /* backward of cp2hp = hp2cp */
    void *gb2 = tu_download(ctx, &back2);
    TU_EXPECT_SAME(gb2, mine, c->dt, n);
    TU_OK(cpar_all_to_all_hp2cp(g, &in, &out2, CPAR_BWD)); /* backward of hp2cp = cp2hp */
    void *go2 = tu_download(ctx, &out2);
    TU_EXPECT_SAME(go2, want, c->dt, n);
    free(mine), free(want), free(got), free(gb), free(gb2), free(go2);
    cpar_tensor *all[] = {&in, &out, &back, &back2, &out2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    return CPAR_OK;
}

/* _i = (cp - 1) * 3 + dtype (f32, bf16, i32: pure data movement) */
START_TEST(test_cp2hp_hp2cp) {
    static const cpar_dtype dts[3] = {CPAR_F32, CPAR_BF16, CPAR_I32};
    a2a_case c = {dts[_i % 3]};
    TU_OK(tu_spawn(_i / 3 + 1, rank_a2a, &c));
}
END_TEST

/* ---- configurations ------------------------------------------------------------------------ */

typedef struct {
    int64_t di, nh, ng, ds;
    int k;
    bool silu, bias, hdim;
} mcfg;

/* A: ng 2 (cp 2: R 1; cp 4: R 2); B: ng 1 (cp 2: R 2; cp 3: R 3), D with
 * head dim, no SiLU; C: ng 4 (cp 2: 2 groups per rank; cp 4: 1), no bias;
 * D: more groups than heads (16 over 4, the peer's test_forward (16, 4)):
 * cp 4 leaves 1 head and 4 groups per rank. */
static const mcfg cfgs[] = {
    {24, 12, 2, 3, 4, true, true, false},
    {18, 6, 1, 2, 3, false, true, true},
    {16, 8, 4, 2, 2, true, false, false},
    {8, 4, 16, 2, 4, true, true, false},
};
static const struct {
    int cfg, p;
} combos[] = {{0, 1}, {0, 2}, {0, 4}, {1, 1}, {1, 2}, {1, 3}, {2, 1}, {2, 2}, {2, 4}, {3, 2}, {3, 4}};
#define NCOMBOS ((int)(sizeof combos / sizeof combos[0]))

/* The derived sizes, computed here independently of the library. */
typedef struct {
    int p;
    int64_t R, ngc, dic, nhc, C, conv_dim, hin, w;
} derived;

static derived derive(const mcfg *f, int p) {
    derived d;
    d.p = p;
    d.R = f->ng < p ? p / f->ng : 1;
    d.ngc = f->ng < p ? 1 : f->ng / p;
    d.dic = f->di / p;
    d.nhc = f->nh / p;
    d.C = d.dic + 2 * d.ngc * f->ds;
    d.conv_dim = f->di + 2 * f->ng * f->ds;
    d.hin = 2 * f->di + 2 * f->ng * f->ds + f->nh;
    d.w = 2 * d.dic + 2 * d.ngc * f->ds + d.nhc;
    return d;
}

/* cp = 1 conv row of rank r's channel c. */
static int64_t row_of(const mcfg *f, const derived *d, int r, int64_t c) {
    if (c < d->dic) return r * d->dic + c;
    c -= d->dic;
    int64_t gw = d->ngc * f->ds, g0 = (r / d->R) * gw;
    if (c < gw) return f->di + g0 + c;
    return f->di + f->ng * f->ds + g0 + (c - gw);
}

/* In-projection column of rank r's pre_conv_ssm output column col. */
static int64_t pre_src_col(const mcfg *f, const derived *d, int r, int64_t col) {
    if (col < d->dic) return r * d->dic + col; /* z */
    col -= d->dic;
    if (col < d->C) return f->di + row_of(f, d, r, col); /* x | B | C: the conv channels */
    col -= d->C;
    return 2 * f->di + 2 * f->ng * f->ds + r * d->nhc + col; /* dt */
}

static cpar_mamba_cp_config to_config(const mcfg *f) {
    cpar_mamba_cp_config c = {.d_inner_local_tp = f->di, .nheads_local_tp = f->nh, .ngroups_local_tp = f->ng,
                              .d_state = f->ds, .d_conv = f->k, .D_has_hdim = f->hdim};
    return c;
}

/* ---- the pipeline ------------------------------------------------------------------------ */

typedef struct {
    mcfg f;
    derived d;
    cpar_dtype dt, pdt;
    int64_t s, b, sl;
    double *u;      /* [s, b, hin] in-projection output, as dt holds it */
    double *wv, *bv; /* [conv_dim, K], [conv_dim] as pdt holds them (bv 0 without bias) */
    double *y1;     /* [s, b, conv_dim] cp = 1 conv output */
    double *dyp[MAX_CP]; /* rank r's gradient of post's output [sl, b, p C] */
    double *gzdt;   /* [s, b, hin] gradient of z and dt (other columns unused) */
    double *du;     /* [s, b, hin] reference input gradient */
    double *dw_ref, *db_ref;
    float *dw_got[MAX_CP], *db_got[MAX_CP];
} pipe_case;

static double silu_d(double u) { return u / (1.0 + exp(-u)); }
static double dsilu_d(double u) {
    double sg = 1.0 / (1.0 + exp(-u));
    return sg * (1.0 + u * (1.0 - sg));
}

static double conv_u(const pipe_case *c, int64_t g, int64_t bi, int64_t row) {
    const mcfg *f = &c->f;
    double acc = c->bv[row];
    for (int j = 0; j < f->k; j++) {
        int64_t tt = g - (f->k - 1) + j;
        if (tt >= 0) acc += c->wv[row * f->k + j] * c->u[(tt * c->b + bi) * c->d.hin + f->di + row];
    }
    return acc;
}

static void pipe_reference(pipe_case *c) {
    const mcfg *f = &c->f;
    const derived *d = &c->d;
    int64_t s = c->s, b = c->b, cd = d->conv_dim, hin = d->hin, p = d->p, K = f->k;
    c->y1 = calloc((size_t)(s * b * cd), sizeof(double));
    double *dy1 = calloc((size_t)(s * b * cd), sizeof(double)), *du1 = calloc((size_t)(s * b * cd), sizeof(double));
    for (int64_t g = 0; g < s; g++)
        for (int64_t bi = 0; bi < b; bi++)
            for (int64_t row = 0; row < cd; row++) {
                double uu = conv_u(c, g, bi, row);
                c->y1[(g * b + bi) * cd + row] = f->silu ? silu_d(uu) : uu;
            }
    /* post's output on rank j, row t, column i C + cc is y1[lb(j, t), row_of(i, cc)]: its gradient lands there */
    for (int j = 0; j < p; j++)
        for (int64_t t = 0; t < c->sl; t++)
            for (int64_t bi = 0; bi < b; bi++)
                for (int i = 0; i < p; i++)
                    for (int64_t cc = 0; cc < d->C; cc++)
                        dy1[(lb_global((int)p, j, c->sl, t) * b + bi) * cd + row_of(f, d, i, cc)] +=
                            c->dyp[j][(t * b + bi) * p * d->C + i * d->C + cc];
    c->dw_ref = calloc((size_t)(cd * K), sizeof(double));
    c->db_ref = calloc((size_t)cd, sizeof(double));
    for (int64_t g = 0; g < s; g++)
        for (int64_t bi = 0; bi < b; bi++)
            for (int64_t row = 0; row < cd; row++) {
                double gg = dy1[(g * b + bi) * cd + row];
                double dd = f->silu ? gg * dsilu_d(conv_u(c, g, bi, row)) : gg;
                du1[(g * b + bi) * cd + row] = dd;
                c->db_ref[row] += dd;
                for (int j = 0; j < K; j++) {
                    int64_t tt = g - (K - 1) + j;
                    if (tt >= 0) c->dw_ref[row * K + j] += dd * c->u[(tt * b + bi) * hin + f->di + row];
                }
            }
    c->du = calloc((size_t)(s * b * hin), sizeof(double));
    for (int64_t g = 0; g < s; g++)
        for (int64_t bi = 0; bi < b; bi++)
            for (int64_t col = 0; col < hin; col++) {
                double v;
                if (col >= f->di && col < f->di + cd) {
                    int64_t row = col - f->di;
                    v = 0.0;
                    for (int j = 0; j < K; j++) {
                        int64_t tt = g + (K - 1) - j;
                        if (tt < s) v += c->wv[row * K + j] * du1[(tt * b + bi) * cd + row];
                    }
                } else {
                    v = c->gzdt[(g * b + bi) * hin + col];
                }
                c->du[(g * b + bi) * hin + col] = v;
            }
    free(dy1), free(du1);
}

static void pipe_init(pipe_case *c, const mcfg *f, int p, cpar_dtype dt, cpar_dtype pdt, uint64_t seed) {
    memset(c, 0, sizeof *c);
    c->f = *f, c->d = derive(f, p), c->dt = dt, c->pdt = pdt;
    c->s = 24, c->b = 2, c->sl = c->s / p;
    int64_t s = c->s, b = c->b, hin = c->d.hin, cd = c->d.conv_dim;
    uint64_t st = seed * 0x9e3779b97f4a7c15ull + 3;
    c->u = malloc(sizeof(double) * (size_t)(s * b * hin));
    c->gzdt = malloc(sizeof(double) * (size_t)(s * b * hin));
    for (int64_t i = 0; i < s * b * hin; i++) c->u[i] = tu_round(dt, tu_uniform(&st));
    for (int64_t i = 0; i < s * b * hin; i++) c->gzdt[i] = tu_round(dt, tu_uniform(&st));
    c->wv = malloc(sizeof(double) * (size_t)(cd * f->k));
    c->bv = malloc(sizeof(double) * (size_t)cd);
    for (int64_t i = 0; i < cd * f->k; i++) c->wv[i] = tu_round(pdt, 0.8 * tu_uniform(&st));
    for (int64_t i = 0; i < cd; i++) c->bv[i] = f->bias ? tu_round(pdt, 0.5 * tu_uniform(&st)) : 0.0;
    for (int r = 0; r < p; r++) {
        int64_t n = c->sl * b * p * c->d.C;
        c->dyp[r] = malloc(sizeof(double) * (size_t)n);
        for (int64_t i = 0; i < n; i++) c->dyp[r][i] = tu_round(dt, tu_uniform(&st));
    }
    pipe_reference(c);
}

static void pipe_free(pipe_case *c) {
    free(c->u), free(c->gzdt), free(c->wv), free(c->bv), free(c->y1), free(c->du), free(c->dw_ref), free(c->db_ref);
    for (int r = 0; r < MAX_CP; r++) free(c->dyp[r]), free(c->dw_got[r]), free(c->db_got[r]);
}

static void *to_host_dtype(const double *v, cpar_dtype dt, int64_t n) {
    void *h = malloc((size_t)(n > 0 ? n : 1) * cpar_dtype_size(dt));
    for (int64_t i = 0; i < n; i++) tu_set(h, dt, i, v[i]);
    return h;
}

static cpar_status rank_pipe(cpar_ctx *ctx, void *arg) {
    pipe_case *c = arg;
    const mcfg *f = &c->f;
    const derived *d = &c->d;
    cpar_group *g = cpar_world_group(ctx);
    int p = cpar_group_size(g), r = cpar_group_rank(g);
    ck_assert_int_eq(p, d->p);
    int64_t s = c->s, b = c->b, sl = c->sl, hin = d->hin, w = d->w, C = d->C, cd = d->conv_dim, K = f->k;
    cpar_dtype dt = c->dt;
    double tol = dt == CPAR_F32 ? 1e-5 : 2 * tu_tol(dt);

    cpar_mamba_cp *m;
    cpar_mamba_cp_config cfg = to_config(f);
    TU_OK(cpar_mamba_cp_create(g, &cfg, &m));
    ck_assert_int_eq(cpar_mamba_cp_conv1d_channels(m), C);

    /* this rank's shard of the in-projection output */
    double *in_v = malloc(sizeof(double) * (size_t)(sl * b * hin));
    for (int64_t t = 0; t < sl; t++)
        for (int64_t bi = 0; bi < b; bi++)
            for (int64_t col = 0; col < hin; col++)
                in_v[(t * b + bi) * hin + col] = c->u[(lb_global(p, r, sl, t) * b + bi) * hin + col];
    void *in_h = to_host_dtype(in_v, dt, sl * b * hin);
    int64_t ishape[3] = {sl, b, hin}, pshape[3] = {s, b, w}, yshape[3] = {s, b, C}, oshape[3] = {sl, b, p * C};
    cpar_tensor in = tu_upload(ctx, in_h, dt, 3, ishape), pre = tu_alloc_poisoned(ctx, dt, 3, pshape);

    /* pre_conv_ssm: exact data movement, one all-to-all of (cp-1)/cp of out */
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_mamba_cp_pre_conv_ssm(m, &in, &pre, CPAR_FWD));
    expect_a2a_bytes(g, cpar_tensor_nbytes(&pre));
    double *pre_want = malloc(sizeof(double) * (size_t)(s * b * w));
    for (int64_t gg = 0; gg < s; gg++)
        for (int64_t bi = 0; bi < b; bi++)
            for (int64_t col = 0; col < w; col++)
                pre_want[(gg * b + bi) * w + col] = c->u[(gg * b + bi) * hin + pre_src_col(f, d, r, col)];
    void *pre_got = tu_download(ctx, &pre);
    TU_EXPECT_CLOSE(pre_got, dt, pre_want, s * b * w, 0.0);

    /* conv1d on the xBC columns of pre, in place, with the cp = 1 parameters */
    int64_t wshape[2] = {cd, K};
    void *wh = to_host_dtype(c->wv, c->pdt, cd * K), *bh = to_host_dtype(c->bv, c->pdt, cd);
    cpar_tensor wt = tu_upload(ctx, wh, c->pdt, 2, wshape), bt = tu_upload(ctx, bh, c->pdt, 1, &cd);
    const cpar_tensor *biasp = f->bias ? &bt : NULL;
    cpar_tensor y = tu_alloc_poisoned(ctx, dt, 3, yshape);
    TU_OK(cpar_mamba_cp_conv1d_forward(m, &pre, d->dic, &wt, biasp, f->silu, &y));
    double *y_want = malloc(sizeof(double) * (size_t)(s * b * C));
    for (int64_t gg = 0; gg < s; gg++)
        for (int64_t bi = 0; bi < b; bi++)
            for (int64_t cc = 0; cc < C; cc++)
                y_want[(gg * b + bi) * C + cc] = c->y1[(gg * b + bi) * cd + row_of(f, d, r, cc)];
    void *y_got = tu_download(ctx, &y);
    TU_EXPECT_CLOSE(y_got, dt, y_want, s * b * C, tol);

    /* post_conv_ssm: back to the sequence shard, every rank's channels */
    cpar_tensor post = tu_alloc_poisoned(ctx, dt, 3, oshape);
    TU_OK(cpar_mamba_cp_post_conv_ssm(m, &y, &post, CPAR_FWD));
    expect_a2a_bytes(g, cpar_tensor_nbytes(&y));
    double *post_want = malloc(sizeof(double) * (size_t)(sl * b * p * C));
    for (int64_t t = 0; t < sl; t++)
        for (int64_t bi = 0; bi < b; bi++)
            for (int i = 0; i < p; i++)
                for (int64_t cc = 0; cc < C; cc++)
                    post_want[(t * b + bi) * p * C + i * C + cc] =
                        c->y1[(lb_global(p, r, sl, t) * b + bi) * cd + row_of(f, d, i, cc)];
    void *post_got = tu_download(ctx, &post);
    TU_EXPECT_CLOSE(post_got, dt, post_want, sl * b * p * C, tol);

    /* backward: post, conv1d (into cp = 1 shaped grads), pre */
    void *dpost_h = to_host_dtype(c->dyp[r], dt, sl * b * p * C);
    cpar_tensor dpost = tu_upload(ctx, dpost_h, dt, 3, oshape), dyc = tu_alloc_poisoned(ctx, dt, 3, yshape);
    TU_OK(cpar_mamba_cp_post_conv_ssm(m, &dpost, &dyc, CPAR_BWD));
    expect_a2a_bytes(g, cpar_tensor_nbytes(&dpost));
    double *dyc_want = malloc(sizeof(double) * (size_t)(s * b * C));
    for (int64_t gg = 0; gg < s; gg++) {
        int j;
        int64_t t;
        lb_owner(p, sl, gg, &j, &t);
        for (int64_t bi = 0; bi < b; bi++)
            for (int64_t cc = 0; cc < C; cc++)
                dyc_want[(gg * b + bi) * C + cc] = c->dyp[j][(t * b + bi) * p * C + r * C + cc];
    }
    void *dyc_got = tu_download(ctx, &dyc);
    TU_EXPECT_CLOSE(dyc_got, dt, dyc_want, s * b * C, 0.0);

    /* dpre: z and dt columns from the SSM stand-in's gradient, xBC left
     * poisoned (the conv backward writes exactly those) */
    void *dpre_h = malloc((size_t)(s * b * w) * cpar_dtype_size(dt));
    memset(dpre_h, 0xff, (size_t)(s * b * w) * cpar_dtype_size(dt));
    for (int64_t gg = 0; gg < s; gg++)
        for (int64_t bi = 0; bi < b; bi++)
            for (int64_t col = 0; col < w; col++)
                if (col < d->dic || col >= d->dic + C)
                    tu_set(dpre_h, dt, (gg * b + bi) * w + col,
                           c->gzdt[(gg * b + bi) * hin + pre_src_col(f, d, r, col)]);
    cpar_tensor dpre = tu_upload(ctx, dpre_h, dt, 3, pshape);
    float *g0 = malloc(sizeof(float) * (size_t)(cd * K));
    for (int64_t i = 0; i < cd * K; i++) g0[i] = 0.25f; /* the grads accumulate */
    cpar_tensor dw = tu_upload(ctx, g0, CPAR_F32, 2, wshape), db = tu_upload(ctx, g0, CPAR_F32, 1, &cd);
    TU_OK(cpar_mamba_cp_conv1d_backward(m, &pre, d->dic, &wt, biasp, f->silu, &dyc, &dpre, &dw, f->bias ? &db : NULL));
    cpar_tensor din = tu_alloc_poisoned(ctx, dt, 3, ishape);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_mamba_cp_pre_conv_ssm(m, &dpre, &din, CPAR_BWD));
    expect_a2a_bytes(g, cpar_tensor_nbytes(&dpre));
    double *din_want = malloc(sizeof(double) * (size_t)(sl * b * hin));
    for (int64_t t = 0; t < sl; t++)
        for (int64_t bi = 0; bi < b; bi++)
            for (int64_t col = 0; col < hin; col++)
                din_want[(t * b + bi) * hin + col] = c->du[(lb_global(p, r, sl, t) * b + bi) * hin + col];
    void *din_got = tu_download(ctx, &din);
    TU_EXPECT_CLOSE(din_got, dt, din_want, sl * b * hin, tol);
    c->dw_got[r] = tu_download(ctx, &dw);
    c->db_got[r] = tu_download(ctx, &db);

    free(in_v), free(in_h), free(pre_want), free(pre_got), free(wh), free(bh), free(y_want), free(y_got);
    free(post_want), free(post_got), free(dpost_h), free(dyc_want), free(dyc_got), free(dpre_h), free(g0);
    free(din_want), free(din_got);
    cpar_tensor *all[] = {&in, &pre, &wt, &bt, &y, &post, &dpost, &dyc, &dpre, &dw, &db, &din};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_mamba_cp_destroy(m));
    return CPAR_OK;
}

static void run_pipe(int combo, cpar_dtype dt, cpar_dtype pdt, uint64_t seed) {
    const mcfg *f = &cfgs[combos[combo].cfg];
    int p = combos[combo].p;
    pipe_case c;
    pipe_init(&c, f, p, dt, pdt, seed);
    TU_OK(tu_spawn(p, rank_pipe, &c));
    /* parameter gradients summed over the CP ranks = the cp = 1 gradients */
    int64_t cd = c.d.conv_dim, K = f->k;
    double *sw = calloc((size_t)(cd * K), sizeof(double)), *sb = calloc((size_t)cd, sizeof(double));
    for (int r = 0; r < p; r++) {
        for (int64_t i = 0; i < cd * K; i++) sw[i] += (double)c.dw_got[r][i] - 0.25;
        for (int64_t i = 0; i < cd; i++) sb[i] += (double)c.db_got[r][i] - 0.25;
    }
    float *swf = malloc(sizeof(float) * (size_t)(cd * K)), *sbf = malloc(sizeof(float) * (size_t)cd);
    for (int64_t i = 0; i < cd * K; i++) swf[i] = (float)sw[i];
    for (int64_t i = 0; i < cd; i++) sbf[i] = (float)sb[i];
    TU_EXPECT_CLOSE(swf, CPAR_F32, c.dw_ref, cd * K, 2e-5);
    if (f->bias) TU_EXPECT_CLOSE(sbf, CPAR_F32, c.db_ref, cd, 2e-5);
    else
        for (int64_t i = 0; i < cd; i++) ck_assert_msg(sbf[i] == 0.f, "dbias touched without a bias");
    free(sw), free(sb), free(swf), free(sbf);
    pipe_free(&c);
}

/* _i = combo * 3 + dtype: F32 (F32 params), F16 (F32 params), BF16 (BF16 params) */
START_TEST(test_pipeline) {
    int combo = _i / 3, k = _i % 3;
    static const cpar_dtype dts[3] = {CPAR_F32, CPAR_F16, CPAR_BF16}, pdts[3] = {CPAR_F32, CPAR_F32, CPAR_BF16};
    run_pipe(combo, dts[k], pdts[k], (uint64_t)(_i + 1));
}
END_TEST

/* ---- packed batches (THD) ----------------------------------------------------------------
 * pre / post conv_ssm per document: outside the mixer rank r holds chunks r
 * and 2cp-1-r of every document (cpar.h §12), inside every rank sees the
 * whole packing in natural order. The reference reads the unsharded packed
 * buffer through packed.h's owner_of (the global side); backward is the
 * adjoint (pre: every rank's gradient column summed into the in-projection
 * column it came from, so B/C replicas add up). */

typedef struct {
    mcfg f;
    derived d;
    packing q;
    cpar_dtype dt;
    int64_t s, b, sl, h; /* h: post's per-rank width */
    double *u;                /* [s, b, hin] the packed in-projection output */
    double *dpre[MAX_CP];     /* rank j's gradient of pre's output [s, b, w] */
    double *y[MAX_CP];        /* rank j's post input [s, b, h] */
    double *dpost[MAX_CP];    /* rank j's gradient of post's output [sl, b, p h] */
    int64_t *glob[MAX_CP];    /* rank j's local row -> global packed row */
    double *wv, *bv;          /* cp = 1 conv1d weight [conv_dim, K] and bias (F32 values) */
} pk_mamba;

static double *pk_random(int64_t n, cpar_dtype dt, uint64_t *st) {
    double *v = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) v[i] = tu_round(dt, tu_uniform(st));
    return v;
}

/* Upload rows [sl, b, width] of a global [s, b, width] array at rank r's rows. */
static void *pk_gather_rows(const pk_mamba *c, const double *v, int r, int64_t width) {
    int64_t rw = c->b * width;
    double *o = malloc(sizeof(double) * (size_t)(c->sl * rw));
    for (int64_t t = 0; t < c->sl; t++) memcpy(o + t * rw, v + c->glob[r][t] * rw, sizeof(double) * (size_t)rw);
    void *h = to_host_dtype(o, c->dt, c->sl * rw);
    free(o);
    return h;
}

static cpar_status rank_pk_mamba(cpar_ctx *ctx, void *arg) {
    pk_mamba *c = arg;
    const mcfg *f = &c->f;
    const derived *d = &c->d;
    cpar_group *g = cpar_world_group(ctx);
    int p = cpar_group_size(g), r = cpar_group_rank(g);
    int64_t s = c->s, b = c->b, sl = c->sl, hin = d->hin, w = d->w, h = c->h;
    cpar_dtype dt = c->dt;
    double tol = dt == CPAR_F32 ? 1e-6 : 2 * tu_tol(dt);
    cpar_packed_seqs seqs = seqs_of(&c->q);
    cpar_mamba_cp *m;
    cpar_mamba_cp_config cfg = to_config(f);
    TU_OK(cpar_mamba_cp_create(g, &cfg, &m));
    int64_t ishape[3] = {sl, b, hin}, pshape[3] = {s, b, w}, yshape[3] = {s, b, h}, oshape[3] = {sl, b, p * h};

    /* pre forward: this rank's columns of the whole packing, natural order */
    void *in_h = pk_gather_rows(c, c->u, r, hin);
    cpar_tensor in = tu_upload(ctx, in_h, dt, 3, ishape), pre = tu_alloc_poisoned(ctx, dt, 3, pshape);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_mamba_cp_pre_conv_ssm_packed(m, &seqs, &in, &pre, CPAR_FWD));
    expect_a2a_bytes(g, cpar_tensor_nbytes(&pre));
    double *want = malloc(sizeof(double) * (size_t)(s * b * (hin > w ? hin : w) + s * b * p * h));
    for (int64_t gg = 0; gg < s * b; gg++)
        for (int64_t col = 0; col < w; col++) want[gg * w + col] = c->u[gg * hin + pre_src_col(f, d, r, col)];
    void *got = tu_download(ctx, &pre);
    TU_EXPECT_CLOSE(got, dt, want, s * b * w, 0.0);
    free(got);
    if (c->q.n == 1 && !c->q.padded) { /* one unpadded document: the unpacked call, bit for bit */
        cpar_tensor pre2 = tu_alloc_poisoned(ctx, dt, 3, pshape);
        TU_OK(cpar_mamba_cp_pre_conv_ssm(m, &in, &pre2, CPAR_FWD));
        void *a = tu_download(ctx, &pre), *bb = tu_download(ctx, &pre2);
        TU_EXPECT_SAME(a, bb, dt, s * b * w);
        free(a), free(bb);
        TU_OK(cpar_tensor_free(ctx, &pre2));
    }

    /* the conv1d per document, on row views of pre (no token sees another
     * document's): against a causal conv restarted at every document start */
    const int32_t *cu = c->q.padded ? c->q.cu_pad : c->q.cu;
    int64_t C = d->C, cd = d->conv_dim, K = f->k, wsh[2] = {cd, K}, csh[3] = {s, b, C};
    float *wf = tu_to_f32(c->wv, cd * K), *bf = tu_to_f32(c->bv, cd);
    cpar_tensor wt = tu_upload(ctx, wf, CPAR_F32, 2, wsh), bt = tu_upload(ctx, bf, CPAR_F32, 1, &cd);
    cpar_tensor yc = tu_alloc_poisoned(ctx, dt, 3, csh);
    size_t es = cpar_dtype_size(dt);
    for (int i = 0; i < c->q.n; i++) {
        int64_t len = cu[i + 1] - cu[i], vx[3] = {len, b, w}, vy[3] = {len, b, C};
        if (!len) continue;
        cpar_tensor xv = cpar_tensor_make((char *)pre.data + (size_t)(cu[i] * b * w) * es, dt, 3, vx, pre.device);
        cpar_tensor yv = cpar_tensor_make((char *)yc.data + (size_t)(cu[i] * b * C) * es, dt, 3, vy, yc.device);
        TU_OK(cpar_mamba_cp_conv1d_forward(m, &xv, d->dic, &wt, &bt, f->silu, &yv));
    }
    double *yw = malloc(sizeof(double) * (size_t)(s * b * C));
    for (int i = 0; i < c->q.n; i++)
        for (int64_t gg = cu[i]; gg < cu[i + 1]; gg++)
            for (int64_t bi = 0; bi < b; bi++)
                for (int64_t cc = 0; cc < C; cc++) {
                    int64_t row = row_of(f, d, r, cc);
                    double acc = c->bv[row];
                    for (int j = 0; j < K; j++) {
                        int64_t tt = gg - (K - 1) + j;
                        if (tt >= cu[i]) acc += c->wv[row * K + j] * c->u[(tt * b + bi) * hin + f->di + row];
                    }
                    yw[(gg * b + bi) * C + cc] = f->silu ? silu_d(acc) : acc;
                }
    got = tu_download(ctx, &yc);
    TU_EXPECT_CLOSE(got, dt, yw, s * b * C, dt == CPAR_F32 ? 1e-5 : 2 * tu_tol(dt));
    free(got), free(yw), free(wf), free(bf);
    TU_OK(cpar_tensor_free(ctx, &wt));
    TU_OK(cpar_tensor_free(ctx, &bt));
    TU_OK(cpar_tensor_free(ctx, &yc));

    /* pre backward: the adjoint, every rank's gradient into its source column */
    void *dpre_h = to_host_dtype(c->dpre[r], dt, s * b * w);
    cpar_tensor dpre = tu_upload(ctx, dpre_h, dt, 3, pshape), din = tu_alloc_poisoned(ctx, dt, 3, ishape);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_mamba_cp_pre_conv_ssm_packed(m, &seqs, &dpre, &din, CPAR_BWD));
    expect_a2a_bytes(g, cpar_tensor_nbytes(&dpre));
    memset(want, 0, sizeof(double) * (size_t)(sl * b * hin));
    for (int64_t t = 0; t < sl; t++)
        for (int64_t bi = 0; bi < b; bi++)
            for (int j = 0; j < p; j++)
                for (int64_t col = 0; col < w; col++)
                    want[(t * b + bi) * hin + pre_src_col(f, d, j, col)] +=
                        c->dpre[j][(c->glob[r][t] * b + bi) * w + col];
    got = tu_download(ctx, &din);
    TU_EXPECT_CLOSE(got, dt, want, sl * b * hin, d->R > 1 ? tol : 0.0);
    free(got);

    /* post forward: every rank's columns at this rank's packed rows */
    void *y_h = to_host_dtype(c->y[r], dt, s * b * h);
    cpar_tensor y = tu_upload(ctx, y_h, dt, 3, yshape), post = tu_alloc_poisoned(ctx, dt, 3, oshape);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_mamba_cp_post_conv_ssm_packed(m, &seqs, &y, &post, CPAR_FWD));
    expect_a2a_bytes(g, cpar_tensor_nbytes(&y));
    for (int64_t t = 0; t < sl; t++)
        for (int64_t bi = 0; bi < b; bi++)
            for (int i = 0; i < p; i++)
                for (int64_t cc = 0; cc < h; cc++)
                    want[((t * b + bi) * p + i) * h + cc] = c->y[i][(c->glob[r][t] * b + bi) * h + cc];
    got = tu_download(ctx, &post);
    TU_EXPECT_CLOSE(got, dt, want, sl * b * p * h, 0.0);
    free(got);

    /* post backward: this rank's columns of every rank's gradient, natural order */
    void *dpost_h = to_host_dtype(c->dpost[r], dt, sl * b * p * h);
    cpar_tensor dpost = tu_upload(ctx, dpost_h, dt, 3, oshape), dy = tu_alloc_poisoned(ctx, dt, 3, yshape);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_mamba_cp_post_conv_ssm_packed(m, &seqs, &dpost, &dy, CPAR_BWD));
    expect_a2a_bytes(g, cpar_tensor_nbytes(&dpost));
    for (int64_t gg = 0; gg < s; gg++) {
        int own;
        int64_t t;
        owner_of(&c->q, p, gg, &own, &t);
        for (int64_t bi = 0; bi < b; bi++)
            for (int64_t cc = 0; cc < h; cc++)
                want[(gg * b + bi) * h + cc] = c->dpost[own][((t * b + bi) * p + r) * h + cc];
    }
    got = tu_download(ctx, &dy);
    TU_EXPECT_CLOSE(got, dt, want, s * b * h, 0.0);
    free(got);

    free(in_h), free(want), free(dpre_h), free(y_h), free(dpost_h);
    cpar_tensor *all[] = {&in, &pre, &dpre, &din, &y, &post, &dpost, &dy};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_mamba_cp_destroy(m));
    return CPAR_OK;
}

/* _i = (combo * N_PACKINGS + packing) * 2 + dtype (F32, BF16) */
START_TEST(test_packed_pre_post) {
    int combo = _i / 2 / N_PACKINGS, k = _i / 2 % N_PACKINGS;
    int p = combos[combo].p;
    pk_mamba c;
    memset(&c, 0, sizeof c);
    c.f = cfgs[combos[combo].cfg], c.d = derive(&c.f, p), c.dt = _i % 2 ? CPAR_BF16 : CPAR_F32;
    packing qs[N_PACKINGS];
    make_packings(p, qs);
    c.q = qs[k];
    c.s = total_of(&c.q), c.b = 2, c.sl = c.s / p, c.h = 3;
    uint64_t st = 4242 + (uint64_t)_i * 977;
    c.u = pk_random(c.s * c.b * c.d.hin, c.dt, &st);
    c.wv = pk_random(c.d.conv_dim * c.f.k, CPAR_F32, &st);
    c.bv = pk_random(c.d.conv_dim, CPAR_F32, &st);
    for (int j = 0; j < p; j++) {
        c.dpre[j] = pk_random(c.s * c.b * c.d.w, c.dt, &st);
        c.y[j] = pk_random(c.s * c.b * c.h, c.dt, &st);
        c.dpost[j] = pk_random(c.sl * c.b * p * c.h, c.dt, &st);
        c.glob[j] = malloc(sizeof(int64_t) * (size_t)(c.sl + 1));
    }
    for (int64_t gg = 0; gg < c.s; gg++) { /* the local -> global maps, from the owner of every packed row */
        int own;
        int64_t t;
        owner_of(&c.q, p, gg, &own, &t);
        c.glob[own][t] = gg;
    }
    TU_OK(tu_spawn(p, rank_pk_mamba, &c));
    free(c.u), free(c.wv), free(c.bv);
    for (int j = 0; j < p; j++) free(c.dpre[j]), free(c.y[j]), free(c.dpost[j]), free(c.glob[j]);
}
END_TEST

static cpar_status rank_pk_bad(cpar_ctx *ctx, void *arg) {
    (void)arg;
    cpar_group *g = cpar_world_group(ctx); /* cp = 2, cfgs[0]: documents divide by 4 */
    cpar_mamba_cp *m;
    cpar_mamba_cp_config cfg = to_config(&cfgs[0]);
    TU_OK(cpar_mamba_cp_create(g, &cfg, &m));
    derived d = derive(&cfgs[0], 2);
    int32_t cu[3] = {0, 4, 12}, odd[3] = {0, 6, 12}, real[3] = {0, 3, 9}, pad[3] = {0, 4, 16};
    cpar_packed_seqs ok = {.n_docs = 2, .cu_seqlens = cu}, bad = {.n_docs = 2, .cu_seqlens = odd};
    cpar_packed_seqs padded = {.n_docs = 2, .cu_seqlens = real, .cu_seqlens_padded = pad};
    int64_t is[3] = {6, 1, d.hin}, ps[3] = {12, 1, d.w}, ys[3] = {12, 1, 2}, os[3] = {6, 1, 4};
    cpar_tensor in = tu_alloc_poisoned(ctx, CPAR_F32, 3, is), pre = tu_alloc_poisoned(ctx, CPAR_F32, 3, ps);
    cpar_tensor y = tu_alloc_poisoned(ctx, CPAR_F32, 3, ys), post = tu_alloc_poisoned(ctx, CPAR_F32, 3, os);
    const char *pf = "cpar_mamba_cp_pre_conv_ssm_packed", *qf = "cpar_mamba_cp_post_conv_ssm_packed";
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm_packed(m, NULL, &in, &pre, CPAR_FWD), CPAR_ERR_INVALID, pf);
    TU_MSG_HAS("seqs is NULL");
    TU_FAILS(cpar_mamba_cp_post_conv_ssm_packed(m, NULL, &y, &post, CPAR_FWD), CPAR_ERR_INVALID, qf);
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm_packed(NULL, &ok, &in, &pre, CPAR_FWD), CPAR_ERR_INVALID, "m is NULL");
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm_packed(m, &bad, &in, &pre, CPAR_FWD), CPAR_ERR_INVALID,
             "document 0 has length 6 (cu_seqlens[1] - [0]), not divisible by 2*cp = 4");
    TU_FAILS(cpar_mamba_cp_post_conv_ssm_packed(m, &bad, &post, &y, CPAR_BWD), CPAR_ERR_INVALID, "document 0 has length 6");
    /* the tensors hold 12 rows, the padded packing 16 */
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm_packed(m, &padded, &in, &pre, CPAR_FWD), CPAR_ERR_INVALID,
             "in has 6 rows (s/cp), so s = 12, expected 16 (the packed length)");
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm_packed(m, &padded, &pre, &in, CPAR_BWD), CPAR_ERR_INVALID,
             "in has 12 rows (s), expected 16 (the packed length)");
    TU_FAILS(cpar_mamba_cp_post_conv_ssm_packed(m, &padded, &y, &post, CPAR_FWD), CPAR_ERR_INVALID,
             "in has 12 rows (s), expected 16");
    TU_FAILS(cpar_mamba_cp_post_conv_ssm_packed(m, &padded, &post, &y, CPAR_BWD), CPAR_ERR_INVALID,
             "in has 6 rows (s/cp), so s = 12, expected 16");
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm_packed(m, &ok, &in, &y, CPAR_FWD), CPAR_ERR_INVALID, "out has shape");
    /* still usable after the failures */
    TU_OK(cpar_mamba_cp_pre_conv_ssm_packed(m, &ok, &in, &pre, CPAR_FWD));
    TU_OK(cpar_mamba_cp_post_conv_ssm_packed(m, &ok, &y, &post, CPAR_FWD));
    cpar_tensor *all[] = {&in, &pre, &y, &post};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_mamba_cp_destroy(m));
    return CPAR_OK;
}

START_TEST(test_packed_bad_args) { TU_OK(tu_spawn(2, rank_pk_bad, NULL)); }
END_TEST

/* ---- object: derived sizes and the seed's divisibility errors ------------------------------ */

static cpar_status rank_create(cpar_ctx *ctx, void *arg) {
    (void)arg;
    cpar_group *g = cpar_world_group(ctx);
    int p = cpar_group_size(g), r = cpar_group_rank(g);
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++) {
        const mcfg *f = &cfgs[i];
        cpar_mamba_cp_config cfg = to_config(f);
        cpar_mamba_cp *m = NULL;
        bool ok = f->nh % p == 0 && (f->ng < p ? p % f->ng == 0 : f->ng % p == 0);
        if (p == 1) ok = true;
        if (!ok) {
            ck_assert_int_eq(cpar_mamba_cp_create(g, &cfg, &m), CPAR_ERR_INVALID);
            ck_assert_ptr_null(m);
            continue;
        }
        TU_OK(cpar_mamba_cp_create(g, &cfg, &m));
        derived d = derive(f, p);
        cpar_mamba_cp_info in;
        TU_OK(cpar_mamba_cp_get_info(m, &in));
        ck_assert_int_eq(in.cp_size, p);
        ck_assert_int_eq(in.cp_rank, r);
        ck_assert_int_eq(in.d_inner_local_tpcp, d.dic);
        ck_assert_int_eq(in.nheads_local_tpcp, d.nhc);
        ck_assert_int_eq(in.ngroups_local_tpcp, d.ngc);
        ck_assert_int_eq(in.group_repeat_count, d.R);
        ck_assert_int_eq(in.conv1d_channels, d.C);
        ck_assert_int_eq(in.conv_dim, d.conv_dim);
        ck_assert_int_eq(in.in_width, d.hin);
        ck_assert_int_eq(in.out_width, d.w);
        ck_assert_int_eq(in.d_conv, f->k);
        ck_assert_int_eq(in.vector_len, d.nhc);
        ck_assert_int_eq(in.D_len, f->hdim ? d.dic : d.nhc);
        TU_OK(cpar_mamba_cp_destroy(m));
    }
    cpar_mamba_cp_config dflt = {.d_inner_local_tp = 24, .nheads_local_tp = 12, .ngroups_local_tp = 12, .d_state = 2};
    cpar_mamba_cp *m;
    TU_OK(cpar_mamba_cp_create(g, &dflt, &m)); /* d_conv 0 -> 4 */
    cpar_mamba_cp_info in;
    TU_OK(cpar_mamba_cp_get_info(m, &in));
    ck_assert_int_eq(in.d_conv, 4);
    TU_OK(cpar_mamba_cp_destroy(m));
    /* the seed's checks, with the sizes in the message */
    cpar_mamba_cp_config bad = {.d_inner_local_tp = 12, .nheads_local_tp = 6, .ngroups_local_tp = 6, .d_state = 2};
    if (p == 4)
        TU_FAILS(cpar_mamba_cp_create(g, &bad, &m), CPAR_ERR_INVALID, "nheads_local_tp 6 is not divisible by cp_size 4");
    bad.ngroups_local_tp = 2;
    if (p == 3) { /* 6 heads divide, 2 groups do not divide 3 */
        TU_FAILS(cpar_mamba_cp_create(g, &bad, &m), CPAR_ERR_INVALID,
                 "cp_size 3 is not divisible by ngroups_local_tp 2");
        TU_MSG_HAS("cp_size must be evenly divisible by ngroups/tp_size");
    }
    bad.ngroups_local_tp = 3;
    if (p == 2) { /* 3 groups over 2 ranks */
        TU_FAILS(cpar_mamba_cp_create(g, &bad, &m), CPAR_ERR_INVALID,
                 "ngroups_local_tp 3 is not divisible by cp_size 2");
        TU_MSG_HAS("ngroups must be evenly divisible by tp_size * cp_size");
    }
    /* The seed's order: with 3 heads and 2 groups at cp 2 the heads are named first. */
    cpar_mamba_cp_config order = {.d_inner_local_tp = 6, .nheads_local_tp = 3, .ngroups_local_tp = 2, .d_state = 2};
    if (p == 2) {
        TU_FAILS(cpar_mamba_cp_create(g, &order, &m), CPAR_ERR_INVALID, "nheads_local_tp 3 is not divisible by cp_size 2");
        TU_MSG_HAS("nheads must be evenly divisible by tp_size * cp_size");
    }
    /* More groups than heads (the peer's test_forward (16, 4)): accepted, 4 groups and 1 head per rank at cp 4. */
    cpar_mamba_cp_config many = {.d_inner_local_tp = 8, .nheads_local_tp = 4, .ngroups_local_tp = 16, .d_state = 2};
    if (p == 1 || p == 2 || p == 4) {
        TU_OK(cpar_mamba_cp_create(g, &many, &m));
        TU_OK(cpar_mamba_cp_get_info(m, &in));
        ck_assert_int_eq(in.nheads_local_tpcp, 4 / p);
        ck_assert_int_eq(in.ngroups_local_tpcp, 16 / p);
        ck_assert_int_eq(in.group_repeat_count, 1);
        TU_OK(cpar_mamba_cp_destroy(m));
    }
    /* cpar's own rule, after the seed's: x and z are split over cp by channels. */
    cpar_mamba_cp_config odd = {.d_inner_local_tp = 14, .nheads_local_tp = 4, .ngroups_local_tp = 4, .d_state = 2};
    if (p == 4) {
        TU_FAILS(cpar_mamba_cp_create(g, &odd, &m), CPAR_ERR_INVALID, "d_inner_local_tp 14 is not divisible by cp_size 4");
    } else if (p != 3) { /* 14 channels split over 1 or 2 ranks */
        TU_OK(cpar_mamba_cp_create(g, &odd, &m));
        TU_OK(cpar_mamba_cp_destroy(m));
    }
    return CPAR_OK;
}

/* _i = cp - 1 */
START_TEST(test_create_and_divisibility) { TU_OK(tu_spawn(_i + 1, rank_create, NULL)); }
END_TEST

/* ---- parameter slices: get, view, accumulate ------------------------------------------------- */

typedef struct {
    int combo;
    double *acc_w[MAX_CP], *acc_b[MAX_CP], *acc_v[MAX_CP], *acc_d[MAX_CP];
} param_case;

static cpar_status rank_params(cpar_ctx *ctx, void *arg) {
    param_case *pc = arg;
    const mcfg *f = &cfgs[combos[pc->combo].cfg];
    cpar_group *g = cpar_world_group(ctx);
    int p = cpar_group_size(g), r = cpar_group_rank(g);
    derived d = derive(f, p);
    int64_t cd = d.conv_dim, K = f->k, C = d.C, nh = f->nh, dl = f->hdim ? f->di : f->nh, dlc = dl / p;
    cpar_mamba_cp *m;
    cpar_mamba_cp_config cfg = to_config(f);
    TU_OK(cpar_mamba_cp_create(g, &cfg, &m));
    /* cp = 1 parameters: value = 1000 row + tap, so a slice shows its rows */
    float *wh = malloc(sizeof(float) * (size_t)(cd * K)), *bh = malloc(sizeof(float) * (size_t)cd);
    float *vh = malloc(sizeof(float) * (size_t)nh), *dh = malloc(sizeof(float) * (size_t)dl);
    for (int64_t i = 0; i < cd * K; i++) wh[i] = (float)(1000 * (i / K) + i % K);
    for (int64_t i = 0; i < cd; i++) bh[i] = (float)(7 * i + 1);
    for (int64_t i = 0; i < nh; i++) vh[i] = (float)(3 * i + 2);
    for (int64_t i = 0; i < dl; i++) dh[i] = (float)(5 * i + 4);
    int64_t w3[3] = {cd, 1, K}, ws3[3] = {C, 1, K}, ws2[2] = {C, K};
    cpar_tensor W = tu_upload(ctx, wh, CPAR_F32, 3, w3), Bv = tu_upload(ctx, bh, CPAR_F32, 1, &cd);
    cpar_tensor V = tu_upload(ctx, vh, CPAR_F32, 1, &nh), D = tu_upload(ctx, dh, CPAR_F32, 1, &dl);
    cpar_tensor ow = tu_alloc_poisoned(ctx, CPAR_F32, 3, ws3), ob = tu_alloc_poisoned(ctx, CPAR_F32, 1, &C);
    cpar_tensor ov = tu_alloc_poisoned(ctx, CPAR_F32, 1, &d.nhc), oa = tu_alloc_poisoned(ctx, CPAR_F32, 1, &d.nhc);
    cpar_tensor od = tu_alloc_poisoned(ctx, CPAR_F32, 1, &dlc);
    TU_OK(cpar_mamba_cp_get_conv1d_weight(m, &W, &ow));
    TU_OK(cpar_mamba_cp_get_conv1d_bias(m, &Bv, &ob));
    TU_OK(cpar_mamba_cp_get_dt_bias(m, &V, &ov));
    TU_OK(cpar_mamba_cp_get_A_log(m, &V, &oa));
    TU_OK(cpar_mamba_cp_get_D(m, &D, &od));
    float *gw = tu_download(ctx, &ow), *gb = tu_download(ctx, &ob), *gv = tu_download(ctx, &ov);
    float *ga = tu_download(ctx, &oa), *gd = tu_download(ctx, &od);
    for (int64_t cc = 0; cc < C; cc++) {
        int64_t row = row_of(f, &d, r, cc);
        for (int64_t j = 0; j < K; j++) ck_assert_float_eq(gw[cc * K + j], wh[row * K + j]);
        ck_assert_float_eq(gb[cc], bh[row]);
    }
    for (int64_t i = 0; i < d.nhc; i++) {
        ck_assert_float_eq(gv[i], vh[r * d.nhc + i]);
        ck_assert_float_eq(ga[i], vh[r * d.nhc + i]);
    }
    for (int64_t i = 0; i < dlc; i++) ck_assert_float_eq(gd[i], dh[r * dlc + i]);
    /* views alias the same elements */
    cpar_tensor view;
    TU_OK(cpar_mamba_cp_vector_view(m, &D, f->hdim, &view));
    ck_assert_int_eq(view.shape[0], dlc);
    ck_assert_ptr_eq(view.data, (float *)D.data + r * dlc);
    TU_OK(cpar_mamba_cp_vector_view(m, &V, false, &view));
    ck_assert_ptr_eq(view.data, (float *)V.data + r * d.nhc);
    ck_assert_int_eq(view.shape[0], d.nhc);

    /* accumulate BF16 slice gradients (value 1 + rank) into cp = 1 F32 grads starting at 0.5 */
    uint16_t *sg = malloc(sizeof(uint16_t) * (size_t)(C * K));
    for (int64_t i = 0; i < C * K; i++) sg[i] = cpar_f32_to_bf16((float)(1 + r));
    float *half = malloc(sizeof(float) * (size_t)(cd * K));
    for (int64_t i = 0; i < cd * K; i++) half[i] = 0.5f;
    cpar_tensor gws = tu_upload(ctx, sg, CPAR_BF16, 2, ws2), gbs = tu_upload(ctx, sg, CPAR_BF16, 1, &C);
    cpar_tensor gvs = tu_upload(ctx, sg, CPAR_BF16, 1, &d.nhc), gds = tu_upload(ctx, sg, CPAR_BF16, 1, &dlc);
    int64_t w2[2] = {cd, K};
    cpar_tensor aw = tu_upload(ctx, half, CPAR_F32, 2, w2), ab = tu_upload(ctx, half, CPAR_F32, 1, &cd);
    cpar_tensor av = tu_upload(ctx, half, CPAR_F32, 1, &nh), ad = tu_upload(ctx, half, CPAR_F32, 1, &dl);
    TU_OK(cpar_mamba_cp_accumulate_conv1d_weight_grad(m, &gws, &aw));
    TU_OK(cpar_mamba_cp_accumulate_conv1d_bias_grad(m, &gbs, &ab));
    TU_OK(cpar_mamba_cp_accumulate_dt_bias_grad(m, &gvs, &av));
    TU_OK(cpar_mamba_cp_accumulate_A_log_grad(m, &gvs, &av)); /* dt_bias and A_log share the slice: twice */
    TU_OK(cpar_mamba_cp_accumulate_D_grad(m, &gds, &ad));
    float *rw = tu_download(ctx, &aw), *rb = tu_download(ctx, &ab);
    float *rv = tu_download(ctx, &av), *rd = tu_download(ctx, &ad);
    pc->acc_w[r] = malloc(sizeof(double) * (size_t)(cd * K));
    pc->acc_b[r] = malloc(sizeof(double) * (size_t)cd);
    pc->acc_v[r] = malloc(sizeof(double) * (size_t)nh);
    pc->acc_d[r] = malloc(sizeof(double) * (size_t)dl);
    for (int64_t i = 0; i < cd * K; i++) pc->acc_w[r][i] = rw[i] - 0.5;
    for (int64_t i = 0; i < cd; i++) pc->acc_b[r][i] = rb[i] - 0.5;
    for (int64_t i = 0; i < nh; i++) pc->acc_v[r][i] = rv[i] - 0.5;
    for (int64_t i = 0; i < dl; i++) pc->acc_d[r][i] = rd[i] - 0.5;
    free(wh), free(bh), free(vh), free(dh), free(gw), free(gb), free(gv), free(ga), free(gd), free(sg), free(half);
    free(rw), free(rb), free(rv), free(rd);
    cpar_tensor *all[] = {&W, &Bv, &V, &D, &ow, &ob, &ov, &oa, &od, &gws, &gbs, &gvs, &gds, &aw, &ab, &av, &ad};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_mamba_cp_destroy(m));
    return CPAR_OK;
}

/* _i = combo */
START_TEST(test_param_slices) {
    param_case pc;
    memset(&pc, 0, sizeof pc);
    pc.combo = _i;
    const mcfg *f = &cfgs[combos[_i].cfg];
    int p = combos[_i].p;
    derived d = derive(f, p);
    TU_OK(tu_spawn(p, rank_params, &pc));
    /* Summed over ranks: each cp = 1 row gets (1 + r) from every rank r whose
     * slice holds it (B/C rows of a repeated group from R ranks). */
    int64_t cd = d.conv_dim, K = f->k, dl = f->hdim ? f->di : f->nh;
    double *ww = calloc((size_t)(cd * K), sizeof(double)), *wb = calloc((size_t)cd, sizeof(double));
    double *wv = calloc((size_t)f->nh, sizeof(double)), *wd = calloc((size_t)dl, sizeof(double));
    for (int r = 0; r < p; r++) {
        for (int64_t cc = 0; cc < d.C; cc++) {
            int64_t row = row_of(f, &d, r, cc);
            for (int64_t j = 0; j < K; j++) ww[row * K + j] += 1 + r;
            wb[row] += 1 + r;
        }
        for (int64_t i = 0; i < d.nhc; i++) wv[r * d.nhc + i] += 2 * (1 + r);
        for (int64_t i = 0; i < dl / p; i++) wd[r * (dl / p) + i] += 1 + r;
    }
    for (int64_t i = 0; i < cd * K; i++) {
        double s = 0;
        for (int r = 0; r < p; r++) s += pc.acc_w[r][i];
        ck_assert_msg(s == ww[i], "weight grad element %lld: %g, expected %g", (long long)i, s, ww[i]);
    }
    for (int64_t i = 0; i < cd; i++) {
        double s = 0;
        for (int r = 0; r < p; r++) s += pc.acc_b[r][i];
        ck_assert_msg(s == wb[i], "bias grad element %lld: %g, expected %g", (long long)i, s, wb[i]);
    }
    for (int64_t i = 0; i < f->nh; i++) {
        double s = 0;
        for (int r = 0; r < p; r++) s += pc.acc_v[r][i];
        ck_assert_msg(s == wv[i], "dt_bias/A_log grad element %lld: %g, expected %g", (long long)i, s, wv[i]);
    }
    for (int64_t i = 0; i < dl; i++) {
        double s = 0;
        for (int r = 0; r < p; r++) s += pc.acc_d[r][i];
        ck_assert_msg(s == wd[i], "D grad element %lld: %g, expected %g", (long long)i, s, wd[i]);
    }
    free(ww), free(wb), free(wv), free(wd);
    for (int r = 0; r < MAX_CP; r++) free(pc.acc_w[r]), free(pc.acc_b[r]), free(pc.acc_v[r]), free(pc.acc_d[r]);
}
END_TEST

/* ---- finite differences of the conv1d backward ------------------------------------------------ */

typedef struct {
    int k;
    bool silu, bias;
} fd_case;

/* L = sum G * y (fp64) for the current x, weight, bias. */
static double fd_loss(cpar_ctx *ctx, cpar_mamba_cp *m, cpar_tensor *x, int64_t xc, cpar_tensor *wt, cpar_tensor *bt,
                      bool silu, cpar_tensor *y, const float *G) {
    TU_OK(cpar_mamba_cp_conv1d_forward(m, x, xc, wt, bt, silu, y));
    float *hy = tu_download(ctx, y);
    double L = 0;
    for (int64_t i = 0; i < cpar_tensor_numel(y); i++) L += (double)G[i] * hy[i];
    free(hy);
    return L;
}

/* Perturb element i of t (F32) by delta. */
static void fd_bump(cpar_ctx *ctx, cpar_tensor *t, int64_t i, float delta) {
    float *h = tu_download(ctx, t);
    h[i] += delta;
    cpar_tensor hh = cpar_tensor_make(h, CPAR_F32, t->ndim, t->shape, CPAR_HOST);
    TU_OK(cpar_tensor_copy(ctx, &hh, t));
    free(h);
}

static double fd_grad(cpar_ctx *ctx, cpar_mamba_cp *m, cpar_tensor *x, int64_t xc, cpar_tensor *wt, cpar_tensor *bt,
                      bool silu, cpar_tensor *y, const float *G, cpar_tensor *t, int64_t i) {
    const float h = 1e-2f;
    fd_bump(ctx, t, i, h);
    double lp = fd_loss(ctx, m, x, xc, wt, bt, silu, y, G);
    fd_bump(ctx, t, i, -2 * h);
    double lm = fd_loss(ctx, m, x, xc, wt, bt, silu, y, G);
    fd_bump(ctx, t, i, h);
    return (lp - lm) / (2.0 * (double)h);
}

static cpar_status rank_fd(cpar_ctx *ctx, void *arg) {
    fd_case *fc = arg;
    cpar_group *g = cpar_world_group(ctx);
    int p = cpar_group_size(g);
    /* cp = 2 when spawned so: the slice mapping is exercised too */
    cpar_mamba_cp_config cfg = {.d_inner_local_tp = 4, .nheads_local_tp = 2, .ngroups_local_tp = 1, .d_state = 2,
                                .d_conv = fc->k};
    cpar_mamba_cp *m;
    TU_OK(cpar_mamba_cp_create(g, &cfg, &m));
    int64_t C = cpar_mamba_cp_conv1d_channels(m), cd = 4 + 2 * 2, s = 5, b = 2, W = C + 3, xc = 1, K = fc->k;
    int64_t xs[3] = {s, b, W}, ys[3] = {s, b, C}, wsh[2] = {cd, K};
    float *hx = tu_random_host(CPAR_F32, s * b * W, 11), *hw = tu_random_host(CPAR_F32, cd * K, 12);
    float *hb = tu_random_host(CPAR_F32, cd, 13), *G = tu_random_host(CPAR_F32, s * b * C, 14);
    cpar_tensor x = tu_upload(ctx, hx, CPAR_F32, 3, xs), wt = tu_upload(ctx, hw, CPAR_F32, 2, wsh);
    cpar_tensor bt = tu_upload(ctx, hb, CPAR_F32, 1, &cd), y = tu_alloc_poisoned(ctx, CPAR_F32, 3, ys);
    cpar_tensor dy = tu_upload(ctx, G, CPAR_F32, 3, ys), dx = tu_alloc_poisoned(ctx, CPAR_F32, 3, xs);
    float *zero = calloc((size_t)(cd * K), sizeof(float));
    cpar_tensor dw = tu_upload(ctx, zero, CPAR_F32, 2, wsh), db = tu_upload(ctx, zero, CPAR_F32, 1, &cd);
    cpar_tensor *bp = fc->bias ? &bt : NULL;
    TU_OK(cpar_mamba_cp_conv1d_backward(m, &x, xc, &wt, bp, fc->silu, &dy, &dx, &dw, fc->bias ? &db : NULL));
    float *gdx = tu_download(ctx, &dx), *gdw = tu_download(ctx, &dw), *gdb = tu_download(ctx, &db);
    /* columns outside [xc, xc + C) of dx are not written */
    for (int64_t tok = 0; tok < s * b; tok++)
        for (int64_t col = 0; col < W; col++)
            if (col < xc || col >= xc + C)
                ck_assert_msg(isnan(gdx[tok * W + col]), "dx column %lld written", (long long)col);
    for (int64_t i = 0; i < s * b * W; i += 3) {
        if (i % W < xc || i % W >= xc + C) continue;
        double fd = fd_grad(ctx, m, &x, xc, &wt, bp, fc->silu, &y, G, &x, i);
        ck_assert_msg(fabs(fd - gdx[i]) <= 2e-3 * (1 + fabs(fd)), "dx[%lld]: %g, finite difference %g (cp %d)",
                      (long long)i, gdx[i], fd, p);
    }
    for (int64_t i = 0; i < cd * K; i++) { /* rows outside the slice get zero from both */
        double fd = fd_grad(ctx, m, &x, xc, &wt, bp, fc->silu, &y, G, &wt, i);
        ck_assert_msg(fabs(fd - gdw[i]) <= 2e-3 * (1 + fabs(fd)), "dweight[%lld]: %g, finite difference %g", (long long)i,
                      gdw[i], fd);
    }
    if (fc->bias)
        for (int64_t i = 0; i < cd; i++) {
            double fd = fd_grad(ctx, m, &x, xc, &wt, bp, fc->silu, &y, G, &bt, i);
            ck_assert_msg(fabs(fd - gdb[i]) <= 2e-3 * (1 + fabs(fd)), "dbias[%lld]: %g, finite difference %g",
                          (long long)i, gdb[i], fd);
        }
    free(hx), free(hw), free(hb), free(G), free(zero), free(gdx), free(gdw), free(gdb);
    cpar_tensor *all[] = {&x, &wt, &bt, &y, &dy, &dx, &dw, &db};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_mamba_cp_destroy(m));
    return CPAR_OK;
}

/* _i: K = 2 + _i % 3, silu = _i / 3 % 2, bias = _i < 6; cp 2 for odd _i */
START_TEST(test_conv1d_finite_differences) {
    fd_case fc = {2 + _i % 3, (_i / 3) % 2 == 1, _i < 6};
    TU_OK(tu_spawn(_i % 2 ? 2 : 1, rank_fd, &fc));
}
END_TEST

/* ---- conv1d at a larger size: several channel tiles and token splits ---------------------------
 * 201 tokens (the device backward splits the weight-gradient sums over
 * tokens), 40 or 72 channels (2-3 tiles of 32, the last partial), against an
 * fp64 reference; the weight gradient is bitwise reproducible. */

typedef struct {
    cpar_dtype dt;
} conv_case;

static cpar_status rank_conv_large(cpar_ctx *ctx, void *arg) {
    conv_case *cc = arg;
    cpar_group *g = cpar_world_group(ctx);
    int p = cpar_group_size(g), r = cpar_group_rank(g);
    const mcfg f = {64, 8, 1, 4, 4, true, true, false};
    derived d = derive(&f, p);
    cpar_mamba_cp_config cfg = to_config(&f);
    cpar_mamba_cp *m;
    TU_OK(cpar_mamba_cp_create(g, &cfg, &m));
    int64_t s = 67, b = 3, C = d.C, cd = d.conv_dim, K = f.k, n = s * b * C;
    cpar_dtype dt = cc->dt;
    int64_t xs[3] = {s, b, C}, wsh[2] = {cd, K};
    void *hx = tu_random_host(dt, n, 21), *hdy = tu_random_host(dt, n, 22);
    float *hw = tu_random_host(CPAR_F32, cd * K, 23), *hb = tu_random_host(CPAR_F32, cd, 24);
    cpar_tensor x = tu_upload(ctx, hx, dt, 3, xs), dy = tu_upload(ctx, hdy, dt, 3, xs);
    cpar_tensor wt = tu_upload(ctx, hw, CPAR_F32, 2, wsh), bt = tu_upload(ctx, hb, CPAR_F32, 1, &cd);
    cpar_tensor y = tu_alloc_poisoned(ctx, dt, 3, xs), dx = tu_alloc_poisoned(ctx, dt, 3, xs);
    float *zero = calloc((size_t)(cd * K), sizeof(float));
    cpar_tensor dw = tu_upload(ctx, zero, CPAR_F32, 2, wsh), db = tu_upload(ctx, zero, CPAR_F32, 1, &cd);
    cpar_tensor dw2 = tu_upload(ctx, zero, CPAR_F32, 2, wsh), db2 = tu_upload(ctx, zero, CPAR_F32, 1, &cd);
    TU_OK(cpar_mamba_cp_conv1d_forward(m, &x, 0, &wt, &bt, f.silu, &y));
    TU_OK(cpar_mamba_cp_conv1d_backward(m, &x, 0, &wt, &bt, f.silu, &dy, &dx, &dw, &db));
    TU_OK(cpar_mamba_cp_conv1d_backward(m, &x, 0, &wt, &bt, f.silu, &dy, &dx, &dw2, &db2));
    double *yr = malloc(sizeof(double) * (size_t)n), *dur = malloc(sizeof(double) * (size_t)n);
    double *dxr = malloc(sizeof(double) * (size_t)n), *dwr = calloc((size_t)(cd * K), sizeof(double));
    double *dbr = calloc((size_t)cd, sizeof(double));
    for (int64_t c = 0; c < C; c++) {
        int64_t row = row_of(&f, &d, r, c);
        for (int64_t t = 0; t < s; t++)
            for (int64_t bi = 0; bi < b; bi++) {
                double u = hb[row];
                for (int j = 0; j < K; j++) {
                    int64_t tt = t - (K - 1) + j;
                    if (tt >= 0) u += (double)hw[row * K + j] * tu_get(hx, dt, (tt * b + bi) * C + c);
                }
                int64_t i = (t * b + bi) * C + c;
                yr[i] = silu_d(u);
                dur[i] = tu_get(hdy, dt, i) * dsilu_d(u);
                dbr[row] += dur[i];
                for (int j = 0; j < K; j++) {
                    int64_t tt = t - (K - 1) + j;
                    if (tt >= 0) dwr[row * K + j] += dur[i] * tu_get(hx, dt, (tt * b + bi) * C + c);
                }
            }
        for (int64_t t = 0; t < s; t++)
            for (int64_t bi = 0; bi < b; bi++) {
                double v = 0;
                for (int j = 0; j < K; j++) {
                    int64_t tt = t + (K - 1) - j;
                    if (tt < s) v += (double)hw[row * K + j] * dur[(tt * b + bi) * C + c];
                }
                dxr[(t * b + bi) * C + c] = v;
            }
    }
    double tol = dt == CPAR_F32 ? 1e-5 : 2 * tu_tol(dt);
    void *gy = tu_download(ctx, &y), *gdx = tu_download(ctx, &dx);
    float *gdw = tu_download(ctx, &dw), *gdb = tu_download(ctx, &db), *gdw2 = tu_download(ctx, &dw2);
    float *gdb2 = tu_download(ctx, &db2);
    TU_EXPECT_CLOSE(gy, dt, yr, n, tol);
    TU_EXPECT_CLOSE(gdx, dt, dxr, n, tol);
    TU_EXPECT_CLOSE(gdw, CPAR_F32, dwr, cd * K, 2e-5);
    TU_EXPECT_CLOSE(gdb, CPAR_F32, dbr, cd, 2e-5);
    TU_EXPECT_SAME(gdw2, gdw, CPAR_F32, cd * K);
    TU_EXPECT_SAME(gdb2, gdb, CPAR_F32, cd);
    free(hx), free(hdy), free(hw), free(hb), free(zero), free(yr), free(dur), free(dxr), free(dwr), free(dbr);
    free(gy), free(gdx), free(gdw), free(gdb), free(gdw2), free(gdb2);
    cpar_tensor *all[] = {&x, &dy, &wt, &bt, &y, &dx, &dw, &db, &dw2, &db2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_mamba_cp_destroy(m));
    return CPAR_OK;
}

/* _i = (cp - 1) * 2 + (f32, bf16) */
START_TEST(test_conv1d_large) {
    conv_case cc = {_i % 2 ? CPAR_BF16 : CPAR_F32};
    TU_OK(tu_spawn(_i / 2 + 1, rank_conv_large, &cc));
}
END_TEST

/* ---- bad input ------------------------------------------------------------------------------ */

static cpar_status rank_bad(cpar_ctx *ctx, void *arg) {
    (void)arg;
    cpar_group *g = cpar_world_group(ctx);
    int p = cpar_group_size(g); /* 2 */
    cpar_mamba_cp_config cfg = {.d_inner_local_tp = 8, .nheads_local_tp = 4, .ngroups_local_tp = 1, .d_state = 2,
                                .d_conv = 3};
    cpar_mamba_cp *m = NULL;
    /* create */
    TU_FAILS(cpar_mamba_cp_create(NULL, &cfg, &m), CPAR_ERR_INVALID, "cpar_mamba_cp_create: group is NULL");
    TU_FAILS(cpar_mamba_cp_create(g, NULL, &m), CPAR_ERR_INVALID, "cfg is NULL");
    TU_FAILS(cpar_mamba_cp_create(g, &cfg, NULL), CPAR_ERR_INVALID, "out is NULL");
    cpar_mamba_cp_config b2 = cfg;
    b2.d_state = 0;
    TU_FAILS(cpar_mamba_cp_create(g, &b2, &m), CPAR_ERR_INVALID, "cfg->d_state is 0");
    b2 = cfg, b2.nheads_local_tp = -1;
    TU_FAILS(cpar_mamba_cp_create(g, &b2, &m), CPAR_ERR_INVALID, "cfg->nheads_local_tp is -1");
    b2 = cfg, b2.d_conv = 5;
    TU_FAILS(cpar_mamba_cp_create(g, &b2, &m), CPAR_ERR_INVALID, "cfg->d_conv is 5");
    b2 = cfg, b2.d_conv = 1;
    TU_FAILS(cpar_mamba_cp_create(g, &b2, &m), CPAR_ERR_INVALID, "cfg->d_conv is 1");
    ck_assert_ptr_null(m);
    TU_OK(cpar_mamba_cp_create(g, &cfg, &m));
    TU_FAILS(cpar_mamba_cp_get_info(NULL, NULL), CPAR_ERR_INVALID, "cpar_mamba_cp_get_info: m is NULL");
    TU_FAILS(cpar_mamba_cp_get_info(m, NULL), CPAR_ERR_INVALID, "out is NULL");
    ck_assert_int_eq(cpar_mamba_cp_conv1d_channels(NULL), 0);
    TU_OK(cpar_mamba_cp_destroy(NULL));
    cpar_mamba_cp_info in;
    TU_OK(cpar_mamba_cp_get_info(m, &in));
    int64_t sl = 4, s = sl * p, b = 1, C = in.conv1d_channels, K = 3, cd = in.conv_dim;

    /* pre / post */
    int64_t ish[3] = {sl, b, in.in_width}, osh[3] = {s, b, in.out_width}, bad_sh[3] = {sl, b, in.in_width + 1};
    int64_t odd_sh[3] = {3, b, in.in_width}, two[2] = {sl, in.in_width};
    cpar_tensor pin = tu_alloc_poisoned(ctx, CPAR_F32, 3, ish), pout = tu_alloc_poisoned(ctx, CPAR_F32, 3, osh);
    cpar_tensor pbad = tu_alloc_poisoned(ctx, CPAR_F32, 3, bad_sh), podd = tu_alloc_poisoned(ctx, CPAR_F32, 3, odd_sh);
    cpar_tensor p2d = tu_alloc_poisoned(ctx, CPAR_F32, 2, two), p16 = tu_alloc_poisoned(ctx, CPAR_F16, 3, osh);
    cpar_tensor pi32 = tu_alloc_poisoned(ctx, CPAR_I32, 3, osh), pin32 = tu_alloc_poisoned(ctx, CPAR_I32, 3, ish);
    static const char pre[] = "cpar_mamba_cp_pre_conv_ssm", post[] = "cpar_mamba_cp_post_conv_ssm";
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(NULL, &pin, &pout, CPAR_FWD), CPAR_ERR_INVALID,
             "cpar_mamba_cp_pre_conv_ssm: m is NULL");
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, NULL, &pout, CPAR_FWD), CPAR_ERR_INVALID, "in is NULL");
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, &pin, NULL, CPAR_FWD), CPAR_ERR_INVALID, "out is NULL");
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, &pin, &pout, (cpar_dir)7), CPAR_ERR_INVALID, "dir is 7");
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, &pbad, &pout, CPAR_FWD), CPAR_ERR_INVALID,
             "in has shape [4,1,25], expected [*, *, 24]");
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, &p2d, &pout, CPAR_FWD), CPAR_ERR_INVALID, pre);
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, &pin, &pbad, CPAR_FWD), CPAR_ERR_INVALID, "out has shape");
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, &pin, &p16, CPAR_FWD), CPAR_ERR_INVALID, "out has dtype f16");
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, &podd, &pout, CPAR_FWD), CPAR_ERR_INVALID,
             "s = 6 is not divisible by 2*cp = 4");
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, &pout, &pbad, CPAR_BWD), CPAR_ERR_INVALID, "out has shape");
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, &pi32, &pin32, CPAR_BWD), CPAR_ERR_INVALID,
             "sums the B/C replica"); /* R = 2 */
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, &pout, &pout, CPAR_BWD), CPAR_ERR_INVALID, "out has shape");
    cpar_tensor alias = pout;
    alias.shape[0] = sl, alias.shape[2] = in.in_width; /* fits inside pout */
    TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, &alias, &pout, CPAR_FWD), CPAR_ERR_INVALID, "overlaps");
    int64_t hs[3] = {s, b, 3}, hs_out[3] = {sl, b, 3 * p}, hodd[3] = {s, b, 5};
    cpar_tensor hin = tu_alloc_poisoned(ctx, CPAR_F32, 3, hs), hout = tu_alloc_poisoned(ctx, CPAR_F32, 3, hs_out);
    cpar_tensor hbad = tu_alloc_poisoned(ctx, CPAR_F32, 3, hodd);
    TU_FAILS(cpar_mamba_cp_post_conv_ssm(NULL, &hin, &hout, CPAR_FWD), CPAR_ERR_INVALID,
             "cpar_mamba_cp_post_conv_ssm: m is NULL");
    TU_FAILS(cpar_mamba_cp_post_conv_ssm(m, &hin, NULL, CPAR_FWD), CPAR_ERR_INVALID, "out is NULL");
    TU_FAILS(cpar_mamba_cp_post_conv_ssm(m, &hin, &hbad, CPAR_FWD), CPAR_ERR_INVALID, "out has shape [8,1,5]");
    TU_FAILS(cpar_mamba_cp_post_conv_ssm(m, &podd, &hout, CPAR_FWD), CPAR_ERR_INVALID,
             "in has 3 rows (s), not divisible by 2*cp = 4");
    TU_FAILS(cpar_mamba_cp_post_conv_ssm(m, &hbad, &hout, CPAR_BWD), CPAR_ERR_INVALID, "in has hidden size 5");
    TU_FAILS(cpar_mamba_cp_post_conv_ssm(m, &p2d, &hout, CPAR_FWD), CPAR_ERR_INVALID, post);
    TU_FAILS(cpar_mamba_cp_post_conv_ssm(m, &hin, &hout, (cpar_dir)-1), CPAR_ERR_INVALID, "dir is -1");

    /* cp2hp / hp2cp */
    int64_t ash[3] = {sl, b, 4}, aout[3] = {s, b, 2}, a3[3] = {sl, b, 3};
    cpar_tensor ain = tu_alloc_poisoned(ctx, CPAR_F32, 3, ash), aot = tu_alloc_poisoned(ctx, CPAR_F32, 3, aout);
    cpar_tensor a3t = tu_alloc_poisoned(ctx, CPAR_F32, 3, a3);
    TU_FAILS(cpar_all_to_all_cp2hp(NULL, &ain, &aot, CPAR_FWD), CPAR_ERR_INVALID,
             "cpar_all_to_all_cp2hp: group is NULL");
    TU_FAILS(cpar_all_to_all_cp2hp(g, &p2d, &aot, CPAR_FWD), CPAR_ERR_INVALID, "expected 3 dimensions");
    TU_FAILS(cpar_all_to_all_cp2hp(g, &a3t, &aot, CPAR_FWD), CPAR_ERR_INVALID,
             "hidden size 3 (dim 2), not divisible by the group size 2");
    TU_FAILS(cpar_all_to_all_cp2hp(g, &ain, &ain, CPAR_FWD), CPAR_ERR_INVALID,
             "out has shape [4,1,4], expected [8,1,2]");
    TU_FAILS(cpar_all_to_all_cp2hp(g, &ain, &aot, (cpar_dir)3), CPAR_ERR_INVALID, "dir is 3");
    TU_FAILS(cpar_all_to_all_cp2hp(g, &ain, &pi32, CPAR_FWD), CPAR_ERR_INVALID, "out has dtype i32");
    TU_FAILS(cpar_all_to_all_hp2cp(NULL, &aot, &ain, CPAR_FWD), CPAR_ERR_INVALID,
             "cpar_all_to_all_hp2cp: group is NULL");
    TU_FAILS(cpar_all_to_all_hp2cp(g, &podd, &ain, CPAR_FWD), CPAR_ERR_INVALID,
             "sequence length 3 (dim 0), not divisible by the group size 2");
    TU_FAILS(cpar_all_to_all_hp2cp(g, &aot, &aot, CPAR_FWD), CPAR_ERR_INVALID,
             "out has shape [8,1,2], expected [4,1,4]");
    TU_FAILS(cpar_all_to_all_hp2cp(g, &aot, NULL, CPAR_FWD), CPAR_ERR_INVALID, "out is NULL");
    TU_FAILS(cpar_all_to_all_hp2cp(g, &a3t, &aot, CPAR_BWD), CPAR_ERR_INVALID, "hidden size 3");

    /* undo / redo */
    static const char undo[] = "cpar_undo_attention_load_balancing", redo[] = "cpar_redo_attention_load_balancing";
    TU_FAILS(cpar_undo_attention_load_balancing(NULL, 2, &hin, &hin), CPAR_ERR_INVALID, "ctx is NULL");
    TU_FAILS(cpar_undo_attention_load_balancing(ctx, 0, &hin, &hbad), CPAR_ERR_INVALID, "cp_size is 0");
    TU_FAILS(cpar_undo_attention_load_balancing(ctx, 2, NULL, &hbad), CPAR_ERR_INVALID, "in is NULL");
    TU_FAILS(cpar_undo_attention_load_balancing(ctx, 2, &hin, NULL), CPAR_ERR_INVALID, "out is NULL");
    TU_FAILS(cpar_undo_attention_load_balancing(ctx, 3, &hin, &hbad), CPAR_ERR_INVALID,
             "out has shape [8,1,5], expected [8,1,3]");
    TU_FAILS(cpar_undo_attention_load_balancing(ctx, 3, &hin, &pi32), CPAR_ERR_INVALID, "out has dtype i32");
    cpar_tensor h2 = tu_alloc_poisoned(ctx, CPAR_F32, 3, hs);
    TU_FAILS(cpar_undo_attention_load_balancing(ctx, 3, &hin, &h2), CPAR_ERR_INVALID,
             "in has 8 rows (dim 0, the sequence), not divisible by 2*cp_size = 6");
    TU_FAILS(cpar_redo_attention_load_balancing(ctx, 5, &hin, &h2), CPAR_ERR_INVALID,
             "not divisible by 2*cp_size = 10");
    TU_FAILS(cpar_redo_attention_load_balancing(ctx, 2, &hin, &hin), CPAR_ERR_INVALID, "out overlaps in");
    TU_OK(cpar_redo_attention_load_balancing(ctx, 2, &hin, &h2));
    cpar_tensor scalar = hin;
    scalar.ndim = 0;
    TU_FAILS(cpar_redo_attention_load_balancing(ctx, 2, &scalar, &h2), CPAR_ERR_INVALID, redo);
    TU_FAILS(cpar_undo_attention_load_balancing(ctx, 2, &scalar, &h2), CPAR_ERR_INVALID, undo);

    /* parameters */
    int64_t wsh[2] = {cd, K}, wsl[2] = {C, K}, w1[3] = {cd, 2, K}, nh = 4, nhc = 2;
    cpar_tensor W = tu_alloc_poisoned(ctx, CPAR_F32, 2, wsh), Wl = tu_alloc_poisoned(ctx, CPAR_F32, 2, wsl);
    cpar_tensor Wb = tu_alloc_poisoned(ctx, CPAR_F32, 3, w1), Bb = tu_alloc_poisoned(ctx, CPAR_F32, 1, &cd);
    cpar_tensor Bl = tu_alloc_poisoned(ctx, CPAR_F32, 1, &C), V = tu_alloc_poisoned(ctx, CPAR_F32, 1, &nh);
    cpar_tensor Vl = tu_alloc_poisoned(ctx, CPAR_F32, 1, &nhc), V16 = tu_alloc_poisoned(ctx, CPAR_F16, 1, &nhc);
    cpar_tensor W16 = tu_alloc_poisoned(ctx, CPAR_F16, 2, wsh);
    TU_FAILS(cpar_mamba_cp_get_conv1d_weight(NULL, &W, &Wl), CPAR_ERR_INVALID,
             "cpar_mamba_cp_get_conv1d_weight: m is NULL");
    TU_FAILS(cpar_mamba_cp_get_conv1d_weight(m, NULL, &Wl), CPAR_ERR_INVALID, "param is NULL");
    TU_FAILS(cpar_mamba_cp_get_conv1d_weight(m, &Wb, &Wl), CPAR_ERR_INVALID, "param has shape [12,2,3]");
    TU_FAILS(cpar_mamba_cp_get_conv1d_weight(m, &W, &W), CPAR_ERR_INVALID, "out has shape [12,3], expected [8,3]");
    TU_FAILS(cpar_mamba_cp_get_conv1d_weight(m, &W16, &Wl), CPAR_ERR_INVALID, "out has dtype f32, expected f16");
    TU_FAILS(cpar_mamba_cp_get_conv1d_bias(m, &Bl, &Bl), CPAR_ERR_INVALID, "param has shape [8], expected [12]");
    TU_FAILS(cpar_mamba_cp_get_conv1d_bias(m, &Bb, NULL), CPAR_ERR_INVALID, "out is NULL");
    TU_FAILS(cpar_mamba_cp_get_dt_bias(m, &Vl, &Vl), CPAR_ERR_INVALID, "param has shape [2], expected [4]");
    TU_FAILS(cpar_mamba_cp_get_A_log(m, &V, &V), CPAR_ERR_INVALID, "out has shape [4], expected [2]");
    TU_FAILS(cpar_mamba_cp_get_D(m, &V, &V16), CPAR_ERR_INVALID, "out has dtype f16");
    TU_FAILS(cpar_mamba_cp_get_D(NULL, &V, &Vl), CPAR_ERR_INVALID, "cpar_mamba_cp_get_D: m is NULL");
    TU_FAILS(cpar_mamba_cp_vector_view(m, &V, true, &Vl), CPAR_ERR_INVALID, "param has shape [4], expected [8]");
    TU_FAILS(cpar_mamba_cp_vector_view(m, &V, false, NULL), CPAR_ERR_INVALID, "view is NULL");
    TU_FAILS(cpar_mamba_cp_vector_view(NULL, &V, false, &Vl), CPAR_ERR_INVALID, "cpar_mamba_cp_vector_view: m is NULL");
    TU_FAILS(cpar_mamba_cp_accumulate_conv1d_weight_grad(m, &Wl, &W16), CPAR_ERR_INVALID,
             "grad_cp1 has dtype f16, expected f32");
    TU_FAILS(cpar_mamba_cp_accumulate_conv1d_weight_grad(m, &pi32, &W), CPAR_ERR_INVALID, "grad has dtype i32");
    TU_FAILS(cpar_mamba_cp_accumulate_conv1d_weight_grad(m, &Wl, &Wb), CPAR_ERR_INVALID, "grad_cp1 has shape [12,2,3]");
    TU_FAILS(cpar_mamba_cp_accumulate_conv1d_bias_grad(m, &Bb, &Bb), CPAR_ERR_INVALID,
             "grad has shape [12], expected [8]");
    TU_FAILS(cpar_mamba_cp_accumulate_dt_bias_grad(m, &Vl, NULL), CPAR_ERR_INVALID, "grad_cp1 is NULL");
    TU_FAILS(cpar_mamba_cp_accumulate_A_log_grad(m, &V, &V), CPAR_ERR_INVALID, "grad has shape [4], expected [2]");
    TU_FAILS(cpar_mamba_cp_accumulate_D_grad(NULL, &Vl, &V), CPAR_ERR_INVALID,
             "cpar_mamba_cp_accumulate_D_grad: m is NULL");
    TU_FAILS(cpar_mamba_cp_accumulate_D_grad(m, &Vl, &Vl), CPAR_ERR_INVALID, "grad_cp1 has shape [2], expected [4]");
    if (cpar_device(ctx) != CPAR_HOST) { /* a host param with a device out */
        float hv[4] = {1, 2, 3, 4};
        cpar_tensor hv_t = cpar_tensor_make(hv, CPAR_F32, 1, &nh, CPAR_HOST);
        TU_FAILS(cpar_mamba_cp_get_dt_bias(m, &hv_t, &Vl), CPAR_ERR_INVALID, "out is on device");
        TU_FAILS(cpar_mamba_cp_pre_conv_ssm(m, &hv_t, &pout, CPAR_FWD), CPAR_ERR_INVALID, "in is on host");
    }

    /* conv1d */
    static const char cf[] = "cpar_mamba_cp_conv1d_forward", cb[] = "cpar_mamba_cp_conv1d_backward";
    int64_t xs[3] = {s, b, C}, xw[3] = {s, b, C + 2};
    cpar_tensor x = tu_alloc_poisoned(ctx, CPAR_F32, 3, xs), y = tu_alloc_poisoned(ctx, CPAR_F32, 3, xs);
    cpar_tensor xwide = tu_alloc_poisoned(ctx, CPAR_F32, 3, xw), y16 = tu_alloc_poisoned(ctx, CPAR_F16, 3, xs);
    cpar_tensor dwr = tu_alloc_poisoned(ctx, CPAR_F32, 2, wsh), dbr = tu_alloc_poisoned(ctx, CPAR_F32, 1, &cd);
    TU_FAILS(cpar_mamba_cp_conv1d_forward(NULL, &x, 0, &W, &Bb, true, &y), CPAR_ERR_INVALID,
             "cpar_mamba_cp_conv1d_forward: m is NULL");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, NULL, 0, &W, &Bb, true, &y), CPAR_ERR_INVALID, "x is NULL");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &x, 1, &W, &Bb, true, &y), CPAR_ERR_INVALID,
             "x_col is 1: channels [1, 9)");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &xwide, 3, &W, &Bb, true, &y), CPAR_ERR_INVALID, "x_col is 3");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &x, -1, &W, &Bb, true, &y), CPAR_ERR_INVALID, "x_col is -1");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &pin32, 0, &W, &Bb, true, &y), CPAR_ERR_INVALID, "x has dtype i32");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &p2d, 0, &W, &Bb, true, &y), CPAR_ERR_INVALID,
             "expected 3 dimensions [s, b, W]");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &x, 0, &Wl, &Bb, true, &y), CPAR_ERR_INVALID,
             "weight has shape [8,3], expected [12,3]");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &x, 0, NULL, &Bb, true, &y), CPAR_ERR_INVALID, "weight is NULL");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &x, 0, &W, &Bl, true, &y), CPAR_ERR_INVALID,
             "bias has shape [8], expected [12]");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &x, 0, &W16, &Bb, true, &y), CPAR_ERR_INVALID,
             "bias has dtype f32, expected f16");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &x, 0, &W, &Bb, true, &y16), CPAR_ERR_INVALID, "y has dtype f16");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &xwide, 0, &W, &Bb, true, &xwide), CPAR_ERR_INVALID,
             "y has shape [8,1,10], expected [8,1,8]");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &x, 0, &W, &Bb, true, &x), CPAR_ERR_INVALID, "y overlaps x");
    TU_FAILS(cpar_mamba_cp_conv1d_forward(m, &x, 0, &W, &Bb, true, NULL), CPAR_ERR_INVALID, cf);
    TU_FAILS(cpar_mamba_cp_conv1d_backward(NULL, &x, 0, &W, &Bb, true, &y, &xwide, &dwr, &dbr), CPAR_ERR_INVALID,
             "cpar_mamba_cp_conv1d_backward: m is NULL");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y, &xwide, &dwr, &dbr), CPAR_ERR_INVALID,
             "dx has shape [8,1,10], expected [8,1,8]");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y16, &y, &dwr, &dbr), CPAR_ERR_INVALID,
             "dy has dtype f16");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y, NULL, &dwr, &dbr), CPAR_ERR_INVALID,
             "dx is NULL");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y, &y16, &dwr, &dbr), CPAR_ERR_INVALID,
             "dx has dtype f16");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y, &y, &dwr, &dbr), CPAR_ERR_INVALID,
             "dx overlaps dy");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &xwide, &y, &dwr, &dbr), CPAR_ERR_INVALID,
             "dy has shape");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y, &xwide, &W16, &dbr), CPAR_ERR_INVALID, cb);
    cpar_tensor yy = tu_alloc_poisoned(ctx, CPAR_F32, 3, xs);
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y, &yy, &W16, &dbr), CPAR_ERR_INVALID,
             "dweight has dtype f16");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y, &yy, &Wl, &dbr), CPAR_ERR_INVALID,
             "dweight has shape [8,3]");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y, &yy, NULL, &dbr), CPAR_ERR_INVALID,
             "dweight is NULL");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y, &yy, &dwr, NULL), CPAR_ERR_INVALID,
             "dbias is NULL but bias is given");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, NULL, true, &y, &yy, &dwr, &dbr), CPAR_ERR_INVALID,
             "dbias is given but bias is NULL");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y, &yy, &dwr, &Bl), CPAR_ERR_INVALID,
             "dbias has shape [8]");
    TU_FAILS(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y, &x, &dwr, &dbr), CPAR_ERR_INVALID,
             "dx overlaps x");
    /* still usable */
    float *zeros = calloc((size_t)(s * b * (C + 2) + cd * K), sizeof(float));
    cpar_tensor hz = cpar_tensor_make(zeros, CPAR_F32, 3, xs, CPAR_HOST);
    cpar_tensor hw = cpar_tensor_make(zeros, CPAR_F32, 2, wsh, CPAR_HOST);
    cpar_tensor hb = cpar_tensor_make(zeros, CPAR_F32, 1, &cd, CPAR_HOST);
    TU_OK(cpar_tensor_copy(ctx, &hz, &x));
    TU_OK(cpar_tensor_copy(ctx, &hz, &y));
    TU_OK(cpar_tensor_copy(ctx, &hw, &W));
    TU_OK(cpar_tensor_copy(ctx, &hw, &dwr));
    TU_OK(cpar_tensor_copy(ctx, &hb, &Bb));
    TU_OK(cpar_tensor_copy(ctx, &hb, &dbr));
    TU_OK(cpar_mamba_cp_conv1d_forward(m, &x, 0, &W, &Bb, true, &y));
    TU_OK(cpar_mamba_cp_conv1d_backward(m, &x, 0, &W, &Bb, true, &y, &yy, &dwr, &dbr));
    free(zeros);
    cpar_tensor *all[] = {&pin, &pout, &pbad, &podd, &p2d, &p16, &pi32, &pin32, &hin, &hout, &hbad, &ain, &aot,
                          &a3t, &h2, &W, &Wl, &Wb, &Bb, &Bl, &V, &Vl, &V16, &W16, &x, &y, &xwide, &y16, &dwr, &dbr, &yy};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    TU_OK(cpar_mamba_cp_destroy(m));
    return CPAR_OK;
}

START_TEST(test_bad_args) { TU_OK(tu_spawn(2, rank_bad, NULL)); }
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("mamba: Mamba all-to-all context parallelism");
    const tu_loop loops[] = {
        {"lb_orders", test_lb_orders, 1},
        {"cp2hp_hp2cp", test_cp2hp_hp2cp, 12},
        {"create_and_divisibility", test_create_and_divisibility, 4},
        {"pipeline", test_pipeline, NCOMBOS * 3},
        {"param_slices", test_param_slices, NCOMBOS},
        {"conv1d_finite_differences", test_conv1d_finite_differences, 12},
        {"conv1d_large", test_conv1d_large, 4},
        {"bad_args", test_bad_args, 1},
        {"packed_pre_post", test_packed_pre_post, NCOMBOS * N_PACKINGS * 2},
        {"packed_bad_args", test_packed_bad_args, 1},
    };
    tu_add_loops(s, loops, sizeof loops / sizeof loops[0], 120);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
