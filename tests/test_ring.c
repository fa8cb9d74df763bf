/* SPDX-License-Identifier: MIT */
/* test_ring.c — ring attention and context-parallel sharding (cpar.h §12).
 *
 * Sharding: cpar_cp_shard places chunk r (sequential) or chunks r and
 * 2cp-1-r (load balancing, PyTorch's round-robin order) of any sequence
 * dimension on rank r, from host or device memory into host or device
 * memory; cpar_cp_unshard restores the whole tensor bit for bit, moving
 * exactly one all-gather of the shards. Identity for every cp 1..8 on the
 * host backend and 1..4 on the backend under test, several dtypes and
 * sequence dimensions (first, middle, last).
 *
 * Ring attention: each case builds the full random q, k, v, dout on the
 * host, computes the single-rank fp64 reference (forward out and lse,
 * backward dq, dk, dv, written here), shards with cpar_cp_shard, runs
 * forward and backward on every rank, unshards out, lse, dq, dk, dv with
 * cpar_cp_unshard and compares, at cp 1..4: causal with and without load
 * balancing, non-causal with both shardings, both rotation methods, GQA, a
 * custom scale, F32 (host), F16 and BF16 (host and sim). Every output is
 * poisoned first. Communication is asserted exactly per call: all-gather
 * rotation receives (cp-1)/cp of the global K and V, the ring rotation moves
 * cp-1 KV blocks, and backward adds cp ring shifts of the fp32 dK/dV
 * accumulators. Bad input for every argument of the four functions. */
#define CPAR_INTERNAL /* calls device-layer functions (cpar.h §16) directly */
#define _GNU_SOURCE /* setenv */

#include "testutil.h"

#include "packed.h"

#define MAX_CP 8

static cpar_status spawn_on(cpar_backend be, int n, cpar_rank_fn fn, void *arg) {
    cpar_init_config cfg = {.backend = be, .timeout_ms = TU_TIMEOUT_MS};
    return tu_spawn_with(n, &cfg, fn, arg);
}

/* ---- sharding ------------------------------------------------------------------------- */

typedef struct {
    cpar_dtype dt;
    int ndim, seq_dim; /* seq_dim as passed (may be negative) */
    int64_t shape[4];  /* full shape */
    bool lb;
    void *full;        /* host, random */
} shard_case;

/* Element index in full of element e of rank r's shard (layout [outer, S, inner]). */
static int64_t shard_source(const shard_case *c, int P, int r, int64_t e) {
    int sd = c->seq_dim < 0 ? c->seq_dim + c->ndim : c->seq_dim;
    int64_t inner = 1, S = c->shape[sd], L = S / P;
    for (int i = sd + 1; i < c->ndim; i++) inner *= c->shape[i];
    int64_t o = e / (L * inner), j = e / inner % L, in = e % inner, gj;
    if (c->lb) {
        int64_t ch = S / (2 * P), slot = j / ch, chunk = slot == 0 ? r : 2 * P - 1 - r;
        gj = chunk * ch + j % ch;
    } else {
        gj = r * L + j;
    }
    return (o * S + gj) * inner + in;
}

static cpar_status rank_shard(cpar_ctx *ctx, void *arg) {
    const shard_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int P = cpar_group_size(g), r = cpar_group_rank(g);
    int sd = c->seq_dim < 0 ? c->seq_dim + c->ndim : c->seq_dim;
    int64_t lshape[4];
    memcpy(lshape, c->shape, sizeof lshape);
    lshape[sd] /= P;
    size_t es = cpar_dtype_size(c->dt);
    cpar_tensor fh = cpar_tensor_make(c->full, c->dt, c->ndim, c->shape, CPAR_HOST);
    cpar_tensor fd = tu_upload(ctx, c->full, c->dt, c->ndim, c->shape);
    int64_t nl = 1;
    for (int i = 0; i < c->ndim; i++) nl *= lshape[i];

    /* host full -> device shard, and device full -> host shard */
    cpar_tensor ld = tu_alloc_poisoned(ctx, c->dt, c->ndim, lshape);
    TU_OK(cpar_cp_shard(g, &fh, c->seq_dim, c->lb, &ld));
    void *lh_mem = malloc((size_t)nl * es + 1);
    memset(lh_mem, 0xff, (size_t)nl * es);
    cpar_tensor lh = cpar_tensor_make(lh_mem, c->dt, c->ndim, lshape, CPAR_HOST);
    TU_OK(cpar_cp_shard(g, &fd, c->seq_dim, c->lb, &lh));
    void *got = tu_download(ctx, &ld);
    for (int64_t e = 0; e < nl; e++) {
        int64_t src = shard_source(c, P, r, e);
        ck_assert_msg(!memcmp((char *)got + e * es, (char *)c->full + src * es, es),
                      "cp %d rank %d: shard element %lld is not full element %lld", P, r, (long long)e, (long long)src);
    }
    ck_assert_msg(!memcmp(got, lh_mem, (size_t)nl * es), "cp %d rank %d: host and device shards differ", P, r);

    /* unshard: one all-gather of the shards, bit-exact identity */
    cpar_tensor back = tu_alloc_poisoned(ctx, c->dt, c->ndim, c->shape);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_cp_unshard(g, &ld, c->seq_dim, c->lb, &back));
    cpar_comm_stats cs;
    TU_OK(cpar_group_stats(g, &cs));
    uint64_t moved = (uint64_t)(P - 1) * (uint64_t)nl * es;
    ck_assert_uint_eq(cs.kind[CPAR_COLL_ALL_GATHER].calls, 1);
    ck_assert_uint_eq(cs.kind[CPAR_COLL_ALL_GATHER].bytes_sent, moved);
    ck_assert_uint_eq(cs.kind[CPAR_COLL_ALL_GATHER].bytes_recv, moved);
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++)
        if (k != CPAR_COLL_ALL_GATHER) ck_assert_uint_eq(cs.kind[k].calls, 0);
    void *whole = tu_download(ctx, &back);
    ck_assert_msg(!memcmp(whole, c->full, cpar_tensor_nbytes(&fh)), "cp %d rank %d: unshard(shard(x)) != x", P, r);

    free(got), free(whole), free(lh_mem);
    TU_OK(cpar_tensor_free(ctx, &fd));
    TU_OK(cpar_tensor_free(ctx, &ld));
    TU_OK(cpar_tensor_free(ctx, &back));
    return CPAR_OK;
}

static void run_shard(cpar_backend be, int P, cpar_dtype dt, int ndim, int seq_dim, const int64_t *shape, bool lb,
                      uint64_t seed) {
    shard_case c = {.dt = dt, .ndim = ndim, .seq_dim = seq_dim, .lb = lb};
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) c.shape[i] = shape[i], n *= shape[i];
    c.full = tu_random_host(dt, n, seed);
    TU_OK(spawn_on(be, P, rank_shard, &c));
    free(c.full);
}

/* Shapes with the sequence (length 6 cp, so chunks of 3 with load balancing)
 * at dim 2 ([b, h, s, d]), dim 0 ([s, b, h]; sequential takes the in-place
 * gather) and the last dim; both shardings. */
static void shard_cases(cpar_backend be, int P, uint64_t seed) {
    const int64_t S = 6 * P;
    const int64_t attn[4] = {2, 3, S, 5}, first[3] = {S, 2, 3}, last[2] = {3, S};
    const int64_t odd[3] = {3 * P, 2, 1}; /* sequential chunks of 3 rows */
    for (int lb = 0; lb < 2; lb++) {
        run_shard(be, P, CPAR_F32, 4, 2, attn, lb, seed + (uint64_t)lb);
        run_shard(be, P, CPAR_BF16, 4, -2, attn, lb, seed + 2 + (uint64_t)lb);
        run_shard(be, P, CPAR_I64, 3, 0, first, lb, seed + 4 + (uint64_t)lb);
        run_shard(be, P, CPAR_U8, 2, -1, last, lb, seed + 6 + (uint64_t)lb);
    }
    run_shard(be, P, CPAR_F16, 3, 0, odd, false, seed + 8);
}

/* _i = cp - 1: the seed's round-robin order is an identity after unshard for cp 1..8 (host backend) */
START_TEST(test_shard_roundtrip_host) { shard_cases(CPAR_BACKEND_HOST, _i + 1, 100 + 16 * (uint64_t)_i); }
END_TEST

/* _i = cp - 1, on the backend under test (the device backend in the sim build: device shards) */
START_TEST(test_shard_roundtrip_backend) { shard_cases(tu_backend(), _i + 1, 300 + 16 * (uint64_t)_i); }
END_TEST

/* ---- ring attention: the fp64 reference ----------------------------------------------------- */

typedef struct {
    int P;
    cpar_dtype dt;
    cpar_ring_attention_config cfg;
    int64_t b, hq, hkv, s, d; /* s: the global sequence length */
    double scale;             /* resolved */
    /* global inputs as dt holds them: host memory of dt, and as doubles */
    void *hq_, *hk_, *hv_, *hdo_;
    double *q, *k, *v, *dout;
    double *out, *lse, *dq, *dk, *dv; /* reference */
    const packing *pk;                /* packed sequences (cfg.packed = &seqs), or NULL */
    cpar_packed_seqs seqs;
} ring_case;

/* Full-sequence attention in fp64: out, lse, and the gradients for dout. */
static void ring_reference(ring_case *c) {
    const int64_t S = c->s, d = c->d, grp = c->hq / c->hkv;
    double *sc = malloc(sizeof(double) * (size_t)S), *p = malloc(sizeof(double) * (size_t)S);
    double *z = malloc(sizeof(double) * (size_t)S);
    memset(c->dq, 0, sizeof(double) * (size_t)(c->b * c->hq * S * d));
    memset(c->dk, 0, sizeof(double) * (size_t)(c->b * c->hkv * S * d));
    memset(c->dv, 0, sizeof(double) * (size_t)(c->b * c->hkv * S * d));
    for (int64_t bi = 0; bi < c->b; bi++)
        for (int64_t h = 0; h < c->hq; h++) {
            const int64_t bh = bi * c->hq + h, kh = bi * c->hkv + h / grp;
            const double *Q = c->q + bh * S * d, *K = c->k + kh * S * d, *V = c->v + kh * S * d;
            const double *DO = c->dout + bh * S * d;
            double *O = c->out + bh * S * d, *DQ = c->dq + bh * S * d, *DK = c->dk + kh * S * d,
                   *DV = c->dv + kh * S * d;
            for (int64_t i = 0; i < S; i++) {
                /* the keys row i sees: [j_lo, n); packed: its document's real rows (padding rows: none) */
                int64_t j_lo = 0, n = c->cfg.causal ? i + 1 : S;
                if (c->pk) {
                    const int32_t *cu = c->pk->padded ? c->pk->cu_pad : c->pk->cu;
                    int doc = 0;
                    while (i >= cu[doc + 1]) doc++;
                    const int64_t real = c->pk->cu[doc + 1] - c->pk->cu[doc];
                    j_lo = cu[doc];
                    n = i - j_lo >= real ? j_lo : c->cfg.causal ? i + 1 : j_lo + real;
                }
                for (int64_t e = 0; e < d; e++) O[i * d + e] = 0.0;
                if (n <= j_lo) {
                    c->lse[bh * S + i] = -INFINITY;
                    continue;
                }
                double m = -INFINITY, sum = 0.0;
                for (int64_t j = j_lo; j < n; j++) {
                    double t = 0.0;
                    for (int64_t e = 0; e < d; e++) t += Q[i * d + e] * K[j * d + e];
                    sc[j] = c->scale * t;
                    m = fmax(m, sc[j]);
                }
                for (int64_t j = j_lo; j < n; j++) sum += exp(sc[j] - m);
                const double L = m + log(sum);
                c->lse[bh * S + i] = L;
                for (int64_t j = j_lo; j < n; j++) { /* the dropout mask of global positions (i, j) */
                    const double pd = c->cfg.dropout_p;
                    z[j] = pd == 0.0 ? 1.0
                           : tu_attn_keep(c->cfg.dropout_state, pd, (uint64_t)bh, (uint64_t)i, (uint64_t)j)
                               ? 1.0 / (1.0 - pd)
                               : 0.0;
                    p[j] = exp(sc[j] - L);
                    for (int64_t e = 0; e < d; e++) O[i * d + e] += p[j] * z[j] * V[j * d + e];
                }
                double D = 0.0;
                for (int64_t e = 0; e < d; e++) D += DO[i * d + e] * O[i * d + e];
                for (int64_t j = j_lo; j < n; j++) {
                    double dp = 0.0;
                    for (int64_t e = 0; e < d; e++) dp += DO[i * d + e] * V[j * d + e];
                    const double ds = p[j] * (dp * z[j] - D) * c->scale;
                    for (int64_t e = 0; e < d; e++) {
                        DQ[i * d + e] += ds * K[j * d + e];
                        DK[j * d + e] += ds * Q[i * d + e];
                        DV[j * d + e] += p[j] * z[j] * DO[i * d + e];
                    }
                }
            }
        }
    free(sc), free(p), free(z);
}

/* n random values of dt (times amp, rounded to dt) into host memory and doubles. */
static void random_input(cpar_dtype dt, int64_t n, double amp, uint64_t seed, void **host, double **dbl) {
    *host = malloc((size_t)n * cpar_dtype_size(dt));
    *dbl = malloc(sizeof(double) * (size_t)n);
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 11;
    for (int64_t i = 0; i < n; i++) {
        tu_set(*host, dt, i, amp * tu_uniform(&s));
        (*dbl)[i] = tu_get(*host, dt, i);
    }
}

/* The all-to-all group size of comm type t at cp = P: a2a+p2p runs a = 2,
 * p = 2 at cp 4, and a = cp (through its own path) below. */
static int a2a_size_of(cpar_cp_comm_type t, int P) {
    return t == CPAR_CP_A2A ? P : t == CPAR_CP_A2A_P2P ? (P == 4 ? 2 : P) : 1;
}

/* hq = 2·A and hkv = hkv_per·A heads (A the all-to-all size: heads divide by it). */
static void ring_case_init_packed(ring_case *c, int P, cpar_dtype dt, bool causal, bool lb, cpar_cp_comm_type comm,
                                  int64_t b, int64_t hkv_per, int64_t s_local, int64_t d, float scale, float dropout_p,
                                  const packing *pk, uint64_t seed) {
    memset(c, 0, sizeof *c);
    c->P = P, c->dt = dt;
    const int A = a2a_size_of(comm, P);
    c->cfg = (cpar_ring_attention_config){.causal = causal, .load_balance = lb, .comm_type = comm,
                                          .a2a_size = comm == CPAR_CP_A2A_P2P ? A : 0, .scale = scale,
                                          .dropout_p = dropout_p, .dropout_state = {seed * 31 + 7, seed % 5}};
    if (pk) c->pk = pk, c->seqs = seqs_of(pk); /* each rank points its cfg.packed at seqs */
    c->b = b, c->hq = 2 * A, c->hkv = hkv_per * A, c->s = s_local * P, c->d = d;
    c->scale = scale > 0.f ? (double)scale : 1.0 / sqrt((double)d);
    const int64_t nq = c->b * c->hq * c->s * d, nkv = c->b * c->hkv * c->s * d;
    /* q scaled up so the softmax is far from uniform */
    random_input(dt, nq, 2.0, seed, &c->hq_, &c->q);
    random_input(dt, nkv, 2.0, seed + 1, &c->hk_, &c->k);
    random_input(dt, nkv, 1.0, seed + 2, &c->hv_, &c->v);
    random_input(dt, nq, 1.0, seed + 3, &c->hdo_, &c->dout);
    c->out = malloc(sizeof(double) * (size_t)nq);
    c->lse = malloc(sizeof(double) * (size_t)(c->b * c->hq * c->s));
    c->dq = malloc(sizeof(double) * (size_t)nq);
    c->dk = malloc(sizeof(double) * (size_t)nkv);
    c->dv = malloc(sizeof(double) * (size_t)nkv);
    ring_reference(c);
}

static void ring_case_init(ring_case *c, int P, cpar_dtype dt, bool causal, bool lb, cpar_cp_comm_type comm,
                           int64_t b, int64_t hkv_per, int64_t s_local, int64_t d, float scale, float dropout_p,
                           uint64_t seed) {
    ring_case_init_packed(c, P, dt, causal, lb, comm, b, hkv_per, s_local, d, scale, dropout_p, NULL, seed);
}

static void ring_case_free(ring_case *c) {
    free(c->hq_), free(c->hk_), free(c->hv_), free(c->hdo_);
    free(c->q), free(c->k), free(c->v), free(c->dout);
    free(c->out), free(c->lse), free(c->dq), free(c->dk), free(c->dv);
}

/* Every element within tol of the reference, relative to the tensor's
 * largest reference magnitude (at least 1); NaN always fails. */
static void expect_close(const char *what, const ring_case *c, const void *got, cpar_dtype dt, const double *want,
                         int64_t n, double tol) {
    double scale = 1.0;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(want[i]));
    for (int64_t i = 0; i < n; i++) {
        double g = tu_get(got, dt, i);
        ck_assert_msg(!isnan(g) && fabs(g - want[i]) <= tol * scale,
                      "%s, cp %d %s %s%s %s (a %d) hkv %lld: element %lld is %.9g, expected %.9g (tol %.3g x %.3g)",
                      what, c->P, cpar_dtype_name(c->dt), c->cfg.causal ? "causal" : "non-causal",
                      c->cfg.load_balance ? " load-balanced" : "", cpar_cp_comm_type_name(c->cfg.comm_type),
                      a2a_size_of(c->cfg.comm_type, c->P), (long long)c->hkv,
                      (long long)i, g, want[i], tol, scale);
    }
}

/* Tolerances: fp32 host path; 16-bit outputs are rounded to the dtype and the
 * device kernels round P and dS to it for the tensor-core products. */
static double out_tol(cpar_dtype dt) { return dt == CPAR_F32 ? 2e-5 : dt == CPAR_F16 ? 4e-3 : 3e-2; }
static double lse_tol(cpar_dtype dt) { return dt == CPAR_F32 ? 1e-5 : 1e-4; }

/* The statistics of one call (cp's, its hierarchical groups' included):
 * all-gather, send/recv and all-to-all (calls, bytes each way); nothing else. */
static void expect_stats(cpar_group *g, uint64_t ag_calls, uint64_t ag_bytes, uint64_t sr_calls, uint64_t sr_bytes,
                         uint64_t a2a_calls, uint64_t a2a_bytes) {
    cpar_comm_stats cs;
    TU_OK(cpar_group_stats(g, &cs));
    const int kinds[3] = {CPAR_COLL_ALL_GATHER, CPAR_COLL_SEND_RECV, CPAR_COLL_ALL_TO_ALL};
    const uint64_t calls[3] = {ag_calls, sr_calls, a2a_calls}, bytes[3] = {ag_bytes, sr_bytes, a2a_bytes};
    for (int i = 0; i < 3; i++) {
        ck_assert_msg(cs.kind[kinds[i]].calls == calls[i] && cs.kind[kinds[i]].bytes_sent == bytes[i] &&
                          cs.kind[kinds[i]].bytes_recv == bytes[i],
                      "%s: %llu calls, %llu bytes sent, %llu received; expected %llu calls and %llu bytes each way",
                      cpar_coll_kind_name((cpar_coll_kind)kinds[i]), (unsigned long long)cs.kind[kinds[i]].calls,
                      (unsigned long long)cs.kind[kinds[i]].bytes_sent,
                      (unsigned long long)cs.kind[kinds[i]].bytes_recv, (unsigned long long)calls[i],
                      (unsigned long long)bytes[i]);
    }
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++)
        if (k != kinds[0] && k != kinds[1] && k != kinds[2]) ck_assert_uint_eq(cs.kind[k].calls, 0);
}

/* The minimum traffic of one forward (or backward) call of comm type t at
 * cp = P, all-to-all size A, ring over p = P/A ranks: q (out, dout, dq like
 * it) of qb bytes, k (v, dk, dv) of kb bytes and kn elements, lse of lb. */
static void expect_call_stats(cpar_group *g, cpar_cp_comm_type t, int P, bool backward, uint64_t qb, uint64_t kb,
                              uint64_t kn, uint64_t lb) {
    const int A = a2a_size_of(t, P), p = P / A;
    const uint64_t p1 = (uint64_t)(p - 1), kvb = 2 * kb, acc = 2 * kn * sizeof(float);
    uint64_t ag_calls = 0, ag_bytes = 0, sr_calls = 0, sr_bytes = 0, a2a_calls = 0, a2a_bytes = 0;
    if (p > 1 && t == CPAR_CP_ALL_GATHER) ag_calls = 1, ag_bytes = p1 * kvb; /* (p-1)/p of K and V */
    else if (p > 1) sr_calls = p1, sr_bytes = p1 * kvb;                      /* p-1 KV blocks */
    if (backward && p > 1) sr_calls += (uint64_t)p, sr_bytes += (uint64_t)p * acc; /* the dK/dV accumulators */
    if (A > 1) { /* (A-1)/A of each tensor: q, k, v in, out and lse back; backward: + out, dout in, dq, dk, dv back */
        a2a_calls = backward ? 9 : 5;
        a2a_bytes = (backward ? 4 * qb + 4 * kb + lb : 2 * qb + 2 * kb + lb) / (uint64_t)A * (uint64_t)(A - 1);
    }
    expect_stats(g, ag_calls, ag_bytes, sr_calls, sr_bytes, a2a_calls, a2a_bytes);
}

/* Unshard a result and compare it with the reference. */
static void check_result(cpar_ctx *ctx, cpar_group *g, const ring_case *c, const char *what, const cpar_tensor *local,
                         int ndim, const int64_t *full_shape, const double *want, double tol) {
    cpar_tensor full = tu_alloc_poisoned(ctx, local->dtype, ndim, full_shape);
    TU_OK(cpar_cp_unshard(g, local, 2, c->cfg.load_balance, &full));
    void *h = tu_download(ctx, &full);
    expect_close(what, c, h, local->dtype, want, cpar_tensor_numel(&full), tol);
    free(h);
    TU_OK(cpar_tensor_free(ctx, &full));
}

static cpar_status rank_ring(cpar_ctx *ctx, void *arg) {
    const ring_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    const int P = cpar_group_size(g);
    const int64_t sl = c->s / P;
    const int64_t qf[4] = {c->b, c->hq, c->s, c->d}, kf[4] = {c->b, c->hkv, c->s, c->d}, lf[3] = {c->b, c->hq, c->s};
    const int64_t ql[4] = {c->b, c->hq, sl, c->d}, kl[4] = {c->b, c->hkv, sl, c->d}, ll[3] = {c->b, c->hq, sl};
    const bool lb = c->cfg.load_balance;
    cpar_tensor fq = cpar_tensor_make(c->hq_, c->dt, 4, qf, CPAR_HOST), fk = cpar_tensor_make(c->hk_, c->dt, 4, kf, CPAR_HOST);
    cpar_tensor fv = cpar_tensor_make(c->hv_, c->dt, 4, kf, CPAR_HOST), fdo = cpar_tensor_make(c->hdo_, c->dt, 4, qf, CPAR_HOST);
    cpar_tensor q = tu_alloc_poisoned(ctx, c->dt, 4, ql), k = tu_alloc_poisoned(ctx, c->dt, 4, kl);
    cpar_tensor v = tu_alloc_poisoned(ctx, c->dt, 4, kl), dout = tu_alloc_poisoned(ctx, c->dt, 4, ql);
    TU_OK(cpar_cp_shard(g, &fq, 2, lb, &q));
    TU_OK(cpar_cp_shard(g, &fk, 2, lb, &k));
    TU_OK(cpar_cp_shard(g, &fv, 2, lb, &v));
    TU_OK(cpar_cp_shard(g, &fdo, 2, lb, &dout));
    cpar_tensor out = tu_alloc_poisoned(ctx, c->dt, 4, ql), lse = tu_alloc_poisoned(ctx, CPAR_F32, 3, ll);
    cpar_tensor dq = tu_alloc_poisoned(ctx, c->dt, 4, ql), dk = tu_alloc_poisoned(ctx, c->dt, 4, kl);
    cpar_tensor dv = tu_alloc_poisoned(ctx, c->dt, 4, kl);

    const uint64_t qb = cpar_tensor_nbytes(&q), kb = cpar_tensor_nbytes(&k), kn = (uint64_t)cpar_tensor_numel(&k);
    const uint64_t lseb = cpar_tensor_nbytes(&lse);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_ring_attention_forward(g, &c->cfg, &q, &k, &v, &out, &lse));
    expect_call_stats(g, c->cfg.comm_type, P, false, qb, kb, kn, lseb);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_ring_attention_backward(g, &c->cfg, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv));
    expect_call_stats(g, c->cfg.comm_type, P, true, qb, kb, kn, lseb);

    const double to = out_tol(c->dt);
    check_result(ctx, g, c, "out", &out, 4, qf, c->out, to);
    check_result(ctx, g, c, "lse", &lse, 3, lf, c->lse, lse_tol(c->dt));
    check_result(ctx, g, c, "dq", &dq, 4, qf, c->dq, to);
    check_result(ctx, g, c, "dk", &dk, 4, kf, c->dk, to);
    check_result(ctx, g, c, "dv", &dv, 4, kf, c->dv, to);
    cpar_tensor *all[] = {&q, &k, &v, &dout, &out, &lse, &dq, &dk, &dv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    return CPAR_OK;
}

static bool on_device(void) { return tu_on_device(); } /* the kernels run: sim or nccl-sim */

/* Runs one configuration in every dtype the backend takes (F32 only on the
 * host path): F32 and BF16 with GQA (hkv = hq/2) and two batches, F16 with
 * hkv = hq and one batch on the sim (its time goes into kernel blocks); d 16
 * on devices, 5 and 8 on the host. */
static void run_ring_drop(int P, bool causal, bool lb, cpar_cp_comm_type comm, float scale, float dropout_p,
                         uint64_t seed) {
    const cpar_dtype dts[3] = {CPAR_F32, CPAR_F16, CPAR_BF16};
    for (int t = on_device() ? 1 : 0; t < 3; t++) {
        ring_case c;
        const int64_t d = on_device() ? 16 : t == 0 ? 5 : 8;
        const int64_t b = t == 1 && on_device() ? 1 : 2, hkv = t == 1 ? 2 : 1;
        ring_case_init(&c, P, dts[t], causal, lb, comm, b, hkv, 6, d, scale, dropout_p, seed + 8 * (uint64_t)t);
        TU_OK(tu_spawn(P, rank_ring, &c));
        ring_case_free(&c);
    }
}

static void run_ring(int P, bool causal, bool lb, cpar_cp_comm_type comm, float scale, uint64_t seed) {
    run_ring_drop(P, causal, lb, comm, scale, 0.f, seed);
}

static const cpar_cp_comm_type comms[4] = {CPAR_CP_ALL_GATHER, CPAR_CP_P2P, CPAR_CP_A2A, CPAR_CP_A2A_P2P};

/* ---- packed sequences (THD) ------------------------------------------------------------------
 * A packed batch (tests/packed.h: uneven documents with one exactly 2·cp
 * long, one long document, padded documents with an empty one) against the
 * per-document fp64 reference of the whole packing. The shards are built here
 * from the layout's definition (packed.h's owner_of: rank r holds chunks r
 * and 2cp-1-r of every document), and every rank compares its rows with the
 * reference rows they hold; padding rows must give out 0, lse -inf and zero
 * dq, dk, dv exactly. Communication as the plain ring's. */

/* rows: [b·h, S, d] -> this rank's [b·h, sl, d] by idx (dt elements). */
static void *gather_rows(const void *full, cpar_dtype dt, int64_t bh, int64_t S, int64_t sl, int64_t d,
                         const int64_t *idx) {
    const size_t es = cpar_dtype_size(dt), row = (size_t)d * es;
    char *out = malloc((size_t)(bh * sl) * row + 1);
    for (int64_t h = 0; h < bh; h++)
        for (int64_t l = 0; l < sl; l++)
            memcpy(out + (size_t)(h * sl + l) * row, (const char *)full + (size_t)(h * S + idx[l]) * row, row);
    return out;
}

/* got [bh, sl, d] (dt) against want [bh, S, d] at the rows idx; padding rows (lse_ref -inf) exactly 0. */
static void expect_rows(const ring_case *c, const char *what, const void *got, cpar_dtype dt, const double *want,
                        int64_t bh, int64_t hq_per, int64_t d, const int64_t *idx, double tol) {
    const int64_t S = c->s, sl = S / c->P;
    double scale = 1.0;
    for (int64_t i = 0; i < bh * S * d; i++) scale = fmax(scale, fabs(want[i]));
    for (int64_t h = 0; h < bh; h++)
        for (int64_t l = 0; l < sl; l++) {
            const bool pad = isinf(c->lse[(h * hq_per) * S + idx[l]]); /* row (of the first q head sharing h) */
            for (int64_t e = 0; e < d; e++) {
                const double g = tu_get(got, dt, (h * sl + l) * d + e), w = want[(h * S + idx[l]) * d + e];
                ck_assert_msg(pad ? g == 0.0 : !isnan(g) && fabs(g - w) <= tol * scale,
                              "%s, cp %d %s %s packing %s: head %lld global row %lld col %lld is %.9g, expected %.9g%s",
                              what, c->P, cpar_dtype_name(c->dt), c->cfg.causal ? "causal" : "non-causal", c->pk->name,
                              (long long)h, (long long)idx[l], (long long)e, g, w, pad ? " (padding: exactly 0)" : "");
            }
        }
}

static cpar_status rank_ring_packed(cpar_ctx *ctx, void *arg) {
    const ring_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    const int P = cpar_group_size(g), r = cpar_group_rank(g);
    const int64_t S = c->s, sl = S / P, d = c->d, bq = c->b * c->hq, bk = c->b * c->hkv;
    cpar_ring_attention_config cfg = c->cfg;
    cfg.packed = &c->seqs;
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)sl);
    for (int64_t row = 0; row < S; row++) {
        int o;
        int64_t l;
        owner_of(c->pk, P, row, &o, &l);
        if (o == r) idx[l] = row;
    }
    const int64_t ql[4] = {c->b, c->hq, sl, d}, kl[4] = {c->b, c->hkv, sl, d}, ll[3] = {c->b, c->hq, sl};
    void *hq = gather_rows(c->hq_, c->dt, bq, S, sl, d, idx), *hk = gather_rows(c->hk_, c->dt, bk, S, sl, d, idx);
    void *hv = gather_rows(c->hv_, c->dt, bk, S, sl, d, idx), *hdo = gather_rows(c->hdo_, c->dt, bq, S, sl, d, idx);
    cpar_tensor q = tu_upload(ctx, hq, c->dt, 4, ql), k = tu_upload(ctx, hk, c->dt, 4, kl);
    cpar_tensor v = tu_upload(ctx, hv, c->dt, 4, kl), dout = tu_upload(ctx, hdo, c->dt, 4, ql);
    cpar_tensor out = tu_alloc_poisoned(ctx, c->dt, 4, ql), lse = tu_alloc_poisoned(ctx, CPAR_F32, 3, ll);
    cpar_tensor dq = tu_alloc_poisoned(ctx, c->dt, 4, ql), dk = tu_alloc_poisoned(ctx, c->dt, 4, kl);
    cpar_tensor dv = tu_alloc_poisoned(ctx, c->dt, 4, kl);
    const uint64_t qb = cpar_tensor_nbytes(&q), kb = cpar_tensor_nbytes(&k), kn = (uint64_t)cpar_tensor_numel(&k);
    const uint64_t lb = cpar_tensor_nbytes(&lse);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_ring_attention_forward(g, &cfg, &q, &k, &v, &out, &lse));
    expect_call_stats(g, cfg.comm_type, P, false, qb, kb, kn, lb);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv));
    expect_call_stats(g, cfg.comm_type, P, true, qb, kb, kn, lb);
    void *ho = tu_download(ctx, &out), *hdq = tu_download(ctx, &dq), *hdk = tu_download(ctx, &dk);
    void *hdv = tu_download(ctx, &dv);
    float *hl = tu_download(ctx, &lse);
    const double to = out_tol(c->dt);
    for (int64_t h = 0; h < bq; h++)
        for (int64_t l = 0; l < sl; l++) {
            const double w = c->lse[h * S + idx[l]], got = hl[h * sl + l];
            ck_assert_msg(isinf(w) ? got == w : fabs(got - w) <= lse_tol(c->dt) * (1.0 + fabs(w)),
                          "lse, cp %d %s packing %s: head %lld global row %lld is %.9g, expected %.9g", P,
                          cpar_dtype_name(c->dt), c->pk->name, (long long)h, (long long)idx[l], got, w);
        }
    expect_rows(c, "out", ho, c->dt, c->out, bq, 1, d, idx, to);
    expect_rows(c, "dq", hdq, c->dt, c->dq, bq, 1, d, idx, to);
    expect_rows(c, "dk", hdk, c->dt, c->dk, bk, c->hq / c->hkv, d, idx, to);
    expect_rows(c, "dv", hdv, c->dt, c->dv, bk, c->hq / c->hkv, d, idx, to);
    free(ho), free(hdq), free(hdk), free(hdv), free(hl), free(hq), free(hk), free(hv), free(hdo), free(idx);
    cpar_tensor *all[] = {&q, &k, &v, &dout, &out, &lse, &dq, &dk, &dv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    return CPAR_OK;
}

/* _i = (cp - 1) * 4 + comm type: every packing of packed.h in the backend's
 * dtypes (F32 on the host path, F16 and BF16 on devices), causal and not
 * alternating; dropout on the padded packing. */
START_TEST(test_ring_packed) {
    const int P = _i / 4 + 1;
    const bool causal = (_i + _i / 4) % 2;
    packing pks[N_PACKINGS];
    const int np = make_packings(P, pks);
    const cpar_dtype dts[3] = {CPAR_F32, CPAR_F16, CPAR_BF16};
    for (int k = 0; k < np; k++)
        for (int t = on_device() ? 1 : 0; t < (on_device() ? 3 : 1); t++) {
            if (on_device() && t != 1 + (k + _i) % 2) continue; /* one 16-bit dtype per packing on the sim */
            ring_case c;
            const int64_t d = on_device() ? 16 : 8, hkv = k == 1 ? 1 : 2;
            ring_case_init_packed(&c, P, dts[t], causal, true, comms[_i % 4], 1, hkv, total_of(&pks[k]) / P, d,
                                  0.f, pks[k].padded ? 0.3f : 0.f, &pks[k], 5000 + 64 * (uint64_t)_i + 8 * (uint64_t)k);
            TU_OK(tu_spawn(P, rank_ring_packed, &c));
            ring_case_free(&c);
        }
}
END_TEST

/* Dropout: the mask of global positions and heads, so every cp, sharding
 * and comm type gives one-rank attention over the whole sequence with the
 * same state (the reference draws it at positions (i, j) of the whole
 * sequence and the global head). _i = (cp - 1) * 6 + kind * 2 + j, kind:
 * causal load-balanced, causal sequential, non-causal load-balanced; two
 * comm types per kind (j), together all four at each cp. */
START_TEST(test_ring_dropout) {
    const int P = _i / 6 + 1, kind = _i / 2 % 3, j = _i % 2;
    run_ring_drop(P, kind < 2, kind != 1, comms[(kind + P + 2 * j) % 4], 0.f, kind == 2 ? 0.5f : 0.3f,
                  4000 + 64 * (uint64_t)_i);
}
END_TEST

/* _i = (cp - 1) * 4 + comm type */
START_TEST(test_ring_causal_load_balanced) { run_ring(_i / 4 + 1, true, true, comms[_i % 4], 0.f, 1000 + 64 * (uint64_t)_i); }
END_TEST

START_TEST(test_ring_causal_sequential) { run_ring(_i / 4 + 1, true, false, comms[_i % 4], 0.f, 2000 + 64 * (uint64_t)_i); }
END_TEST

/* non-causal with both shardings (the round-robin one is an extension of the
 * seed, which refuses it) and a custom scale */
START_TEST(test_ring_non_causal) {
    run_ring(_i / 4 + 1, false, (_i + _i / 4) % 2 == 0, comms[_i % 4], 0.3f, 3000 + 64 * (uint64_t)_i);
}
END_TEST

/* CPAR_ATTN_DQ=atomic: each ring step's backward adds dq by atomics from the
 * dk/dv kernel; _i = (cp - 1) * 4 + comm type, causal load-balanced and
 * non-causal in turn. Device backends only (host tensors ignore it). */
START_TEST(test_ring_atomic_dq) {
    if (!on_device()) {
        printf("ring_atomic_dq: skipped on the host backend (a device kernel option)\n");
        return;
    }
    setenv("CPAR_ATTN_DQ", "atomic", 1); /* this forked test's own environment */
    run_ring(_i / 4 + 1, _i % 2 == 0, true, comms[_i % 4], 0.f, 5000 + 64 * (uint64_t)_i);
}
END_TEST

/* ---- a launch failing mid-ring ---------------------------------------------------------------- */

/* The CUDA simulator's fault injection (tests/cudasim.h): absent from the
 * host and CUDA builds, where the test has nothing to inject. */
void cudasim_fail_launch(int n) __attribute__((weak));

typedef struct {
    cpar_status st[4], free_st[4], again[4];
    char msg[4][512];
} midring_arg;

/* The ring's second block kernel fails at its launch (as one a GPU cannot
 * fit would), with the KV exchange for the next block queued on comm. The
 * call must leave comm joined into compute (cpar__ring_finish) so that the
 * caller's frees, which wait for compute only, come after that exchange: the
 * NCCL simulator refuses a cudaFree with NCCL work queued (on a GPU it would
 * wait for the exchange, and hang NCCL). A tensor is freed at once, before a
 * later call's own waits could join comm; the same call then runs clean. */
static cpar_status rank_ring_midway(cpar_ctx *ctx, void *arg) {
    midring_arg *a = arg;
    const int r = cpar_rank(ctx);
    cpar_group *g = cpar_world_group(ctx);
    const int64_t qs[4] = {1, 2, 8, 16}, ls[3] = {1, 2, 8};
    void *hq = tu_random_host(CPAR_BF16, 256, 70 + r), *hk = tu_random_host(CPAR_BF16, 256, 80 + r);
    void *hv = tu_random_host(CPAR_BF16, 256, 90 + r);
    cpar_tensor q = tu_upload(ctx, hq, CPAR_BF16, 4, qs), k = tu_upload(ctx, hk, CPAR_BF16, 4, qs);
    cpar_tensor v = tu_upload(ctx, hv, CPAR_BF16, 4, qs), out = tu_alloc_poisoned(ctx, CPAR_BF16, 4, qs);
    cpar_tensor lse = tu_alloc_poisoned(ctx, CPAR_F32, 3, ls), scratch = tu_alloc_poisoned(ctx, CPAR_F32, 3, ls);
    const cpar_ring_attention_config cfg = {.comm_type = CPAR_CP_P2P};
    TU_OK(cpar_sync(ctx));
    cudasim_fail_launch(2);
    a->st[r] = cpar_ring_attention_forward(g, &cfg, &q, &k, &v, &out, &lse);
    cudasim_fail_launch(0);
    snprintf(a->msg[r], sizeof a->msg[r], "%s", cpar_last_error(ctx));
    a->free_st[r] = cpar_tensor_free(ctx, &scratch); /* at once: before any later call joins comm */
    a->again[r] = cpar_ring_attention_forward(g, &cfg, &q, &k, &v, &out, &lse);
    if (a->again[r] == CPAR_OK) a->again[r] = cpar_sync(ctx);
    cpar_tensor *all[] = {&q, &k, &v, &out, &lse};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        cpar_status fs = cpar_tensor_free(ctx, all[i]);
        if (a->free_st[r] == CPAR_OK) a->free_st[r] = fs;
    }
    free(hq), free(hk), free(hv);
    return CPAR_OK;
}

START_TEST(test_ring_fails_midway) {
    if (!cudasim_fail_launch || !on_device()) return; /* a simulator build's device paths only */
    const int P = 3 + _i;
    midring_arg a = {0};
    TU_OK(tu_spawn(P, rank_ring_midway, &a));
    for (int r = 0; r < P; r++) {
        ck_assert_msg(a.st[r] == CPAR_ERR_CUDA && strstr(a.msg[r], "too many resources requested for launch"),
                      "cp %d, rank %d: the failed launch gave %s (%s)", P, r, cpar_status_string(a.st[r]), a.msg[r]);
        ck_assert_msg(a.again[r] == CPAR_OK, "cp %d, rank %d: the call after the failure gave %s", P, r,
                      cpar_status_string(a.again[r]));
        ck_assert_msg(a.free_st[r] == CPAR_OK, "cp %d, rank %d: freeing the tensors gave %s", P, r,
                      cpar_status_string(a.free_st[r]));
    }
}
END_TEST

/* ---- bad arguments -------------------------------------------------------------------------- */

static cpar_status rank_ring_bad(cpar_ctx *ctx, void *arg) {
    (void)arg;
    cpar_group *g = cpar_world_group(ctx);
    const int P = cpar_group_size(g);
    const bool dev = cpar_device(ctx) != CPAR_HOST;
    const cpar_dtype dt = dev ? CPAR_BF16 : CPAR_F32;
    const int64_t D = 8;
    const int64_t qs[4] = {1, 2, 4, D}, ks[4] = {1, 1, 4, D}, ls[3] = {1, 2, 4};
    const int64_t k3s[4] = {1, 3, 4, D}, kshort[4] = {1, 1, 3, D}, qodd[4] = {1, 2, 3, D}, ls3[3] = {1, 2, 3};
    const int64_t q2d[2] = {8, D}, qd[4] = {1, 2, 4, 12}, kd[4] = {1, 1, 4, 12}, bl[3] = {1, 2, 5};
    cpar_tensor q = tu_alloc_poisoned(ctx, dt, 4, qs), k = tu_alloc_poisoned(ctx, dt, 4, ks);
    cpar_tensor v = tu_alloc_poisoned(ctx, dt, 4, ks), out = tu_alloc_poisoned(ctx, dt, 4, qs);
    cpar_tensor lse = tu_alloc_poisoned(ctx, CPAR_F32, 3, ls), dout = tu_alloc_poisoned(ctx, dt, 4, qs);
    cpar_tensor dq = tu_alloc_poisoned(ctx, dt, 4, qs), dk = tu_alloc_poisoned(ctx, dt, 4, ks);
    cpar_tensor dv = tu_alloc_poisoned(ctx, dt, 4, ks);
    cpar_tensor k3 = tu_alloc_poisoned(ctx, dt, 4, k3s), kshrt = tu_alloc_poisoned(ctx, dt, 4, kshort);
    cpar_tensor qo = tu_alloc_poisoned(ctx, dt, 4, qodd), ko = tu_alloc_poisoned(ctx, dt, 4, qodd);
    cpar_tensor lo = tu_alloc_poisoned(ctx, CPAR_F32, 3, ls3), q2 = tu_alloc_poisoned(ctx, dt, 2, q2d);
    cpar_tensor qi = tu_alloc_poisoned(ctx, CPAR_I32, 4, qs), lseh = tu_alloc_poisoned(ctx, CPAR_BF16, 3, ls);
    cpar_tensor lbad = tu_alloc_poisoned(ctx, CPAR_F32, 3, bl), kf = tu_alloc_poisoned(ctx, CPAR_F16, 4, ks);
    cpar_tensor q12 = tu_alloc_poisoned(ctx, dt, 4, qd), k12 = tu_alloc_poisoned(ctx, dt, 4, kd);
    cpar_tensor qnull = q;
    qnull.data = NULL;
    /* a tensor on the wrong memory: host memory on a device context, a
     * device ordinal on the host backend (never dereferenced) */
    static float fake[64];
    cpar_tensor qwrong = cpar_tensor_make(fake, dt, 4, qs, dev ? CPAR_HOST : 0);
    cpar_tensor fwrong = cpar_tensor_make(fake, dt, 4, qs, dev ? 7 : 0); /* shard takes host memory too */
    cpar_tensor outwrong = cpar_tensor_make(fake, dt, 4, qs, dev ? CPAR_HOST : 0);
    cpar_tensor outf = tu_alloc_poisoned(ctx, CPAR_F16, 4, qs);
    cpar_ring_attention_config cfg = {.causal = true, .load_balance = true}, bad = cfg;
    const char *bwd = "cpar_ring_attention_backward";

    /* forward */
    TU_FAILS(cpar_ring_attention_forward(NULL, &cfg, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, "cp is NULL");
    TU_FAILS(cpar_ring_attention_forward(g, NULL, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, "cfg is NULL");
    bad.comm_type = (cpar_cp_comm_type)7;
    TU_FAILS(cpar_ring_attention_forward(g, &bad, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, "cfg->comm_type is 7");
    {   /* the all-to-all size and the heads it scatters */
        char want[256];
        bad = cfg, bad.comm_type = CPAR_CP_A2A_P2P;
        snprintf(want, sizeof want, "cfg->a2a_size is 0, expected a divisor of the cp size %d", P);
        TU_FAILS(cpar_ring_attention_forward(g, &bad, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, want);
        bad.a2a_size = P + 1;
        TU_FAILS(cpar_ring_attention_backward(g, &bad, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv),
                 CPAR_ERR_INVALID, "cfg->a2a_size is");
        bad = cfg, bad.a2a_size = 2;
        TU_FAILS(cpar_ring_attention_forward(g, &bad, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID,
                 "cfg->a2a_size is 2 with comm type all_gather, expected 0");
        bad = cfg, bad.comm_type = CPAR_CP_A2A;
        if (P > 1) { /* q's 2 heads, k's 1: kv heads < cp */
            snprintf(want, sizeof want, "q has 2 heads and k 1, expected both divisible by the all-to-all size %d (a2a "
                     "scatters the heads; with fewer KV heads repeat them to %d, or use p2p)", P, P);
            TU_FAILS(cpar_ring_attention_forward(g, &bad, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, want);
            TU_FAILS(cpar_ring_attention_backward(g, &bad, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv),
                     CPAR_ERR_INVALID, "expected both divisible by the all-to-all size");
        } else {
            TU_OK(cpar_ring_attention_forward(g, &bad, &q, &k, &v, &out, &lse));
        }
        if (P == 2) { /* even heads, odd load-balanced shards: the two chunks cannot be reordered */
            const int64_t q2s[4] = {1, 2, 3, D}, k2s[4] = {1, 2, 3, D};
            cpar_tensor q2o = tu_alloc_poisoned(ctx, dt, 4, q2s), k2o = tu_alloc_poisoned(ctx, dt, 4, k2s);
            cpar_ring_attention_config nc2 = {.load_balance = true, .comm_type = CPAR_CP_A2A};
            TU_FAILS(cpar_ring_attention_forward(g, &nc2, &q2o, &k2o, &k2o, &ko, &lo), CPAR_ERR_INVALID,
                     "s_local 3 and 3, expected even lengths (a2a reorders the two load-balanced chunks)");
            TU_OK(cpar_tensor_free(ctx, &q2o));
            TU_OK(cpar_tensor_free(ctx, &k2o));
        }
    }
    bad = cfg, bad.scale = -1.f;
    TU_FAILS(cpar_ring_attention_forward(g, &bad, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, "cfg->scale");
    bad.scale = INFINITY;
    TU_FAILS(cpar_ring_attention_forward(g, &bad, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, "cfg->scale");
    bad = cfg, bad.dropout_p = 1.f;
    TU_FAILS(cpar_ring_attention_forward(g, &bad, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID,
             "cpar_ring_attention_forward: cfg->dropout_p is 1, expected 0 <= p < 1");
    bad.dropout_p = -0.25f;
    TU_FAILS(cpar_ring_attention_forward(g, &bad, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, "cfg->dropout_p is -0.25");
    bad.dropout_p = NAN;
    TU_FAILS(cpar_ring_attention_backward(g, &bad, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv), CPAR_ERR_INVALID,
             "cfg->dropout_p is nan");
    {   /* packed sequences: load balancing, b = 1, the packed length, a valid packing */
        const int32_t one[2] = {0, 4 * P}, odd[3] = {0, 2 * P + 1, 4 * P}, longer[2] = {0, 8 * P};
        cpar_packed_seqs ps = {.n_docs = 1, .cu_seqlens = one};
        cpar_ring_attention_config pc = {.causal = true, .load_balance = false, .packed = &ps};
        TU_FAILS(cpar_ring_attention_forward(g, &pc, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID,
                 "cfg->packed needs cfg->load_balance");
        pc.load_balance = true;
        TU_OK(cpar_ring_attention_forward(g, &pc, &q, &k, &v, &out, &lse));
        ps.cu_seqlens = longer;
        TU_FAILS(cpar_ring_attention_forward(g, &pc, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID,
                 "q and k have s_local 4 and 4, expected 8");
        ps.cu_seqlens = odd, ps.n_docs = 2;
        TU_FAILS(cpar_ring_attention_backward(g, &pc, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv), CPAR_ERR_INVALID,
                 "not divisible by 2*cp");
        ps.n_docs = 0;
        TU_FAILS(cpar_ring_attention_forward(g, &pc, &q, &k, &v, &out, &lse), CPAR_ERR_INVALID, "seqs->n_docs is 0");
    }
    {   /* dropout's positions with load balancing need two equal chunks, also without causality */
        cpar_ring_attention_config ncd = {.load_balance = true, .dropout_p = 0.5f};
        TU_FAILS(cpar_ring_attention_forward(g, &ncd, &qo, &k, &v, &ko, &lo), CPAR_ERR_INVALID,
                 "s_local 3 and 4, expected even lengths");
    }
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, NULL, &k, &v, &out, &lse), CPAR_ERR_INVALID, "q is NULL");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &qnull, &k, &v, &out, &lse), CPAR_ERR_INVALID, "q has NULL data");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &qwrong, &k, &v, &out, &lse), CPAR_ERR_INVALID, "q is on");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &qi, &k, &v, &out, &lse), CPAR_ERR_INVALID, "q has dtype i32");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q2, &k, &v, &out, &lse), CPAR_ERR_INVALID, "q has shape [8,8]");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, NULL, &v, &out, &lse), CPAR_ERR_INVALID, "k is NULL");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &kf, &v, &out, &lse), CPAR_ERR_INVALID,
             dev ? "k has dtype f16, expected bf16" : "k has dtype f16, expected f32");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k3, &k3, &out, &lse), CPAR_ERR_INVALID, "k has 3 heads");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k12, &k12, &out, &lse), CPAR_ERR_INVALID, "k has shape [1,1,4,12]");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k, NULL, &out, &lse), CPAR_ERR_INVALID, "v is NULL");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k, &kshrt, &out, &lse), CPAR_ERR_INVALID, "v has shape [1,1,3,8]");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &kshrt, &kshrt, &out, &lse), CPAR_ERR_INVALID,
             "k has s_local 3, expected q's 4");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &qo, &ko, &ko, &out, &lse), CPAR_ERR_INVALID,
             "q has s_local = 3, expected an even length");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k, &v, NULL, &lse), CPAR_ERR_INVALID, "out is NULL");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &q2, &q2, &out, &lse), CPAR_ERR_INVALID, "k has shape [8,8]");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k, &q2, &out, &lse), CPAR_ERR_INVALID, "v has shape [8,8]");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k, &v, &outf, &lse), CPAR_ERR_INVALID, "out has dtype f16");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k, &v, &outwrong, &lse), CPAR_ERR_INVALID, "out is on");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k, &v, &dk, &lse), CPAR_ERR_INVALID, "out has shape [1,1,4,8]");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k, &v, &out, NULL), CPAR_ERR_INVALID, "lse is NULL");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k, &v, &out, &lbad), CPAR_ERR_INVALID, "lse has shape [1,2,5]");
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k, &v, &out, &lseh), CPAR_ERR_INVALID, "lse has dtype bf16");
    if (dev) {
        TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q12, &k12, &k12, &out, &lse), CPAR_ERR_INVALID,
                 "head dim d = 12, expected a multiple of 8");
        cpar_tensor q32 = tu_alloc_poisoned(ctx, CPAR_F32, 4, qs), k32 = tu_alloc_poisoned(ctx, CPAR_F32, 4, ks);
        TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q32, &k32, &k32, &out, &lse), CPAR_ERR_UNSUPPORTED,
                 "device attention takes f16 or bf16");
        TU_OK(cpar_tensor_free(ctx, &q32));
        TU_OK(cpar_tensor_free(ctx, &k32));
    }
    TU_FAILS(cpar_ring_attention_forward(g, &cfg, &q, &k, &v, &q, &lse), CPAR_ERR_INVALID, "out overlaps q");
    /* the non-causal ring takes unequal key shards and odd lengths */
    cpar_ring_attention_config nc = {.causal = false, .load_balance = true, .comm_type = CPAR_CP_P2P};
    TU_OK(cpar_ring_attention_forward(g, &nc, &qo, &k, &v, &ko, &lo));
    TU_OK(cpar_ring_attention_forward(g, &cfg, &q, &k, &v, &out, &lse));

    /* backward */
    TU_FAILS(cpar_ring_attention_backward(NULL, &cfg, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv), CPAR_ERR_INVALID, bwd);
    TU_FAILS(cpar_ring_attention_backward(g, NULL, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv), CPAR_ERR_INVALID, "cfg is NULL");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, NULL, &k, &v, &out, &dout, &lse, &dq, &dk, &dv), CPAR_ERR_INVALID, "q is NULL");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k3, &k3, &out, &dout, &lse, &dq, &dk, &dv), CPAR_ERR_INVALID, "k has 3 heads");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, NULL, &dout, &lse, &dq, &dk, &dv), CPAR_ERR_INVALID, "out is NULL");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &outf, &dout, &lse, &dq, &dk, &dv), CPAR_ERR_INVALID, "out has dtype f16");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dout, &lseh, &dq, &dk, &dv), CPAR_ERR_INVALID, "lse has dtype bf16");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dout, &lse, &outwrong, &dk, &dv), CPAR_ERR_INVALID, "dq is on");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dk, &lse, &dq, &dk, &dv), CPAR_ERR_INVALID, "dout has shape");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dout, &lbad, &dq, &dk, &dv), CPAR_ERR_INVALID, "lse has shape");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dout, &lse, NULL, &dk, &dv), CPAR_ERR_INVALID, "dq is NULL");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dout, &lse, &dk, &dk, &dv), CPAR_ERR_INVALID, "dq has shape");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dout, &lse, &dq, &kf, &dv), CPAR_ERR_INVALID, "dk has dtype f16");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &q), CPAR_ERR_INVALID, "dv has shape");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dout, &lse, &dq, &dk, NULL), CPAR_ERR_INVALID, "dv is NULL");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dk), CPAR_ERR_INVALID, "dk overlaps dv");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dout, &lse, &dout, &dk, &dv), CPAR_ERR_INVALID, "dq overlaps dout");
    TU_FAILS(cpar_ring_attention_backward(g, &cfg, &qo, &ko, &ko, &qo, &qo, &lo, &dq, &dk, &dv), CPAR_ERR_INVALID, "even length");
    TU_OK(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv));

    /* sharding: lengths 4 (and 4 * P) along dim 2 */
    const int64_t fs[4] = {1, 2, 4 * P, D}, fodd[4] = {1, 2, 2 * P + 1, D}, l5[4] = {1, 2, 5, D};
    cpar_tensor full = tu_alloc_poisoned(ctx, dt, 4, fs), fo = tu_alloc_poisoned(ctx, dt, 4, fodd);
    cpar_tensor l_5 = tu_alloc_poisoned(ctx, dt, 4, l5);
    const char *unshard = "cpar_cp_unshard";
    cpar_tensor lview = full; /* a shard-shaped view of full's memory */
    lview.shape[2] = 4;
    TU_FAILS(cpar_cp_shard(NULL, &full, 2, true, &q), CPAR_ERR_INVALID, "cp is NULL");
    TU_FAILS(cpar_cp_shard(g, NULL, 2, true, &q), CPAR_ERR_INVALID, "full is NULL");
    TU_FAILS(cpar_cp_shard(g, &full, 2, true, NULL), CPAR_ERR_INVALID, "local is NULL");
    TU_FAILS(cpar_cp_shard(g, &full, 4, true, &q), CPAR_ERR_INVALID, "seq_dim is 4, expected -4..3");
    TU_FAILS(cpar_cp_shard(g, &full, -5, true, &q), CPAR_ERR_INVALID, "seq_dim is -5");
    TU_FAILS(cpar_cp_shard(g, &full, 2, true, &kf), CPAR_ERR_INVALID, "local has dtype f16");
    TU_FAILS(cpar_cp_shard(g, &full, 2, true, &l_5), CPAR_ERR_INVALID, "local has shape [1,2,5,8]");
    TU_FAILS(cpar_cp_shard(g, &full, 2, true, &lview), CPAR_ERR_INVALID, "local overlaps full");
    TU_FAILS(cpar_cp_shard(g, &fwrong, 2, true, &q), CPAR_ERR_INVALID, "full is on device");
    TU_FAILS(cpar_cp_shard(g, &full, 2, true, &fwrong), CPAR_ERR_INVALID, "local is on device");
    if (P > 1) {
        char want[96];
        snprintf(want, sizeof want, "length %d along seq_dim 2, not divisible by %d (2 * cp", 2 * P + 1, 2 * P);
        TU_FAILS(cpar_cp_shard(g, &fo, 2, true, &q), CPAR_ERR_INVALID, want);
        snprintf(want, sizeof want, "not divisible by %d (cp chunks with cp = %d)", P, P);
        TU_FAILS(cpar_cp_shard(g, &fo, -2, false, &q), CPAR_ERR_INVALID, want);
    } else {
        TU_FAILS(cpar_cp_shard(g, &fo, 2, true, &qo), CPAR_ERR_INVALID, "length 3 along seq_dim 2, not divisible by 2");
    }
    TU_FAILS(cpar_cp_unshard(NULL, &q, 2, true, &full), CPAR_ERR_INVALID, unshard);
    TU_FAILS(cpar_cp_unshard(g, NULL, 2, true, &full), CPAR_ERR_INVALID, "local is NULL");
    TU_FAILS(cpar_cp_unshard(g, &q, 2, true, NULL), CPAR_ERR_INVALID, "full is NULL");
    TU_FAILS(cpar_cp_unshard(g, &q, 9, true, &full), CPAR_ERR_INVALID, "seq_dim is 9");
    TU_FAILS(cpar_cp_unshard(g, &kf, 2, true, &full), CPAR_ERR_INVALID, "local has dtype f16");
    TU_FAILS(cpar_cp_unshard(g, &l_5, 2, true, &full), CPAR_ERR_INVALID, "local has shape [1,2,5,8]");
    TU_FAILS(cpar_cp_unshard(g, &qwrong, 2, true, &full), CPAR_ERR_INVALID, "local is on");
    if (P > 1) TU_FAILS(cpar_cp_unshard(g, &q, 2, true, &fo), CPAR_ERR_INVALID, "not divisible by");
    if (dev) { /* unshard is a collective: host memory is refused, unlike in shard */
        void *hm = malloc(cpar_tensor_nbytes(&full));
        cpar_tensor fh = cpar_tensor_make(hm, dt, 4, fs, CPAR_HOST);
        TU_FAILS(cpar_cp_unshard(g, &q, 2, true, &fh), CPAR_ERR_INVALID, "full is on host");
        TU_OK(cpar_cp_shard(g, &fh, 2, true, &q));
        free(hm);
    }
    TU_OK(cpar_cp_shard(g, &full, 2, true, &q));
    TU_OK(cpar_cp_unshard(g, &q, 2, true, &full));
    cpar_tensor *all[] = {&q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv, &k3, &kshrt, &qo, &ko, &lo, &q2, &qi, &lseh,
                          &lbad, &kf, &q12, &k12, &full, &fo, &l_5, &outf};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    return CPAR_OK;
}

/* ---- the merge kernel (cpar_dev_ring_merge) on the sim ------------------------------------------- */

/* fp64 merge of (o, l) with (ob, lb): the softmax-weighted combination. */
static void merge_ref(double *o, double *l, const double *ob, double lb, int64_t d) {
    if (lb == -INFINITY) return;
    if (*l == -INFINITY) {
        for (int64_t c = 0; c < d; c++) o[c] = ob[c];
        *l = lb;
        return;
    }
    const double m = fmax(*l, lb), wa = exp(*l - m), wb = exp(lb - m);
    for (int64_t c = 0; c < d; c++) o[c] = (wa * o[c] + wb * ob[c]) / (wa + wb);
    *l = m + log(wa + wb);
}

/* nbh 3 slices of 5 rows of d = 37 (more than a warp's lanes) with padded
 * strides; lse pairs include -inf on either side, both sides, and far apart
 * (weights 0 and 1 in fp32). The padding must stay untouched. */
static cpar_status rank_merge(cpar_ctx *ctx, void *arg) {
    (void)arg;
    const int64_t nbh = 3, rows = 5, d = 37, o_bh = rows * d + 7, lse_bh = rows + 2;
    const int64_t no = nbh * o_bh, nl = nbh * lse_bh;
    float *o = malloc(sizeof(float) * (size_t)no), *ob = malloc(sizeof(float) * (size_t)no);
    float *l = malloc(sizeof(float) * (size_t)nl), *lb = malloc(sizeof(float) * (size_t)nl);
    double *wo = malloc(sizeof(double) * (size_t)no), *wl = malloc(sizeof(double) * (size_t)nl);
    uint64_t s = 77;
    for (int64_t i = 0; i < no; i++) o[i] = (float)tu_uniform(&s), ob[i] = (float)tu_uniform(&s), wo[i] = o[i];
    for (int64_t i = 0; i < nl; i++) {
        l[i] = (float)(3.0 * tu_uniform(&s)), lb[i] = (float)(3.0 * tu_uniform(&s));
        switch (i % 7) {
        case 1: lb[i] = -INFINITY; break;
        case 2: l[i] = -INFINITY; break;
        case 3: l[i] = lb[i] = -INFINITY; break;
        case 4: lb[i] = l[i] + 200.f; break;
        case 5: lb[i] = l[i] - 200.f; break;
        default: break;
        }
        wl[i] = l[i];
    }
    for (int64_t j = 0; j < nbh; j++)
        for (int64_t i = 0; i < rows; i++) {
            double ob64[37];
            for (int64_t c = 0; c < d; c++) ob64[c] = ob[j * o_bh + i * d + c];
            merge_ref(wo + j * o_bh + i * d, wl + j * lse_bh + i, ob64, lb[j * lse_bh + i], d);
        }
    const int64_t so[1] = {no}, sl[1] = {nl};
    cpar_tensor to = tu_upload(ctx, o, CPAR_F32, 1, so), tob = tu_upload(ctx, ob, CPAR_F32, 1, so);
    cpar_tensor tl = tu_upload(ctx, l, CPAR_F32, 1, sl), tlb = tu_upload(ctx, lb, CPAR_F32, 1, sl);
    /* On the legacy stream, not ordered with cpar's: the uploads first, the results after. */
    TU_OK(cpar_sync(ctx));
    TU_OK(cpar_dev_ring_merge(to.data, tl.data, tob.data, tlb.data, nbh, rows, d, o_bh, lse_bh, NULL));
    TU_OK(cpar_dev_sync());
    float *go = tu_download(ctx, &to), *gl = tu_download(ctx, &tl);
    for (int64_t i = 0; i < nl; i++)
        ck_assert_msg(gl[i] == (float)wl[i] || fabs(gl[i] - wl[i]) <= 1e-6 * (1.0 + fabs(wl[i])),
                      "lse %lld: got %.9g, expected %.9g", (long long)i, gl[i], wl[i]);
    for (int64_t i = 0; i < no; i++)
        ck_assert_msg(fabs(go[i] - wo[i]) <= 1e-6, "out %lld: got %.9g, expected %.9g", (long long)i, go[i], wo[i]);
    /* bad arguments of the device layer */
    ck_assert_int_eq(cpar_dev_ring_merge(to.data, tl.data, tob.data, tlb.data, -1, rows, d, o_bh, lse_bh, NULL),
                     CPAR_ERR_INVALID);
    ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "nbh"));
    ck_assert_int_eq(cpar_dev_ring_merge(to.data, NULL, tob.data, tlb.data, nbh, rows, d, o_bh, lse_bh, NULL),
                     CPAR_ERR_INVALID);
    ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "lse is NULL"));
    ck_assert_int_eq(cpar_dev_ring_merge(to.data, tl.data, tob.data, tlb.data, nbh, rows, d, rows * d - 1, lse_bh,
                                         NULL), CPAR_ERR_INVALID);
    ck_assert_ptr_nonnull(strstr(cpar_dev_last_error(), "o_bh"));
    TU_OK(cpar_dev_ring_merge(NULL, NULL, NULL, NULL, 0, rows, d, 0, 0, NULL)); /* empty: no-op */
    free(o), free(ob), free(l), free(lb), free(wo), free(wl), free(go), free(gl);
    cpar_tensor *all[] = {&to, &tob, &tl, &tlb};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    return CPAR_OK;
}

/* the host build has no device layer: the merge kernel runs in the device
 * builds only (its host twin runs in every host-backend ring case) */
START_TEST(test_ring_merge_kernel) {
    if (!on_device()) {
        ck_assert_int_eq(cpar_dev_ring_merge(NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0, NULL), CPAR_ERR_UNSUPPORTED);
        return;
    }
    TU_OK(tu_spawn(1, rank_merge, NULL));
}
END_TEST

/* _i = cp - 1 */
START_TEST(test_ring_bad_args) { TU_OK(tu_spawn(_i + 1, rank_ring_bad, NULL)); }
END_TEST

/* Megatron's names round-trip; anything else is refused naming the choices. */
START_TEST(test_cp_comm_names) {
    static const char *const names[] = {"all_gather", "p2p", "a2a", "a2a+p2p"};
    for (int t = 0; t < CPAR_CP_COMM_TYPE_COUNT; t++) {
        cpar_cp_comm_type got = (cpar_cp_comm_type)-1;
        TU_OK(cpar_cp_comm_type_parse(names[t], &got));
        ck_assert_int_eq(got, t);
        ck_assert_str_eq(cpar_cp_comm_type_name((cpar_cp_comm_type)t), names[t]);
    }
    ck_assert_str_eq(cpar_cp_comm_type_name(CPAR_CP_COMM_TYPE_COUNT), "?");
    ck_assert_str_eq(cpar_cp_comm_type_name((cpar_cp_comm_type)-3), "?");
    cpar_cp_comm_type t = CPAR_CP_P2P;
    TU_FAILS(cpar_cp_comm_type_parse("ring", &t), CPAR_ERR_INVALID,
             "cpar_cp_comm_type_parse: name is \"ring\", expected all_gather, p2p, a2a or a2a+p2p");
    TU_FAILS(cpar_cp_comm_type_parse("A2A", &t), CPAR_ERR_INVALID, "name is \"A2A\"");
    TU_FAILS(cpar_cp_comm_type_parse("", &t), CPAR_ERR_INVALID, "name is \"\"");
    ck_assert_int_eq(t, CPAR_CP_P2P); /* untouched on failure */
    TU_FAILS(cpar_cp_comm_type_parse(NULL, &t), CPAR_ERR_INVALID, "cpar_cp_comm_type_parse: name is NULL");
    TU_FAILS(cpar_cp_comm_type_parse("p2p", NULL), CPAR_ERR_INVALID, "cpar_cp_comm_type_parse: out is NULL");
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("ring: ring attention and context-parallel sharding");
    const tu_loop loops[] = {
        {"shard_roundtrip_host", test_shard_roundtrip_host, MAX_CP},
        {"shard_roundtrip_backend", test_shard_roundtrip_backend, 4},
        {"ring_causal_load_balanced", test_ring_causal_load_balanced, 16},
        {"ring_causal_sequential", test_ring_causal_sequential, 16},
        {"ring_non_causal", test_ring_non_causal, 16},
        {"ring_atomic_dq", test_ring_atomic_dq, 16},
        {"ring_dropout", test_ring_dropout, 24},
        {"ring_packed", test_ring_packed, 16},
        {"ring_merge_kernel", test_ring_merge_kernel, 1},
        {"ring_bad_args", test_ring_bad_args, 2},
        {"cp_comm_names", test_cp_comm_names, 1},
        {"ring_fails_midway", test_ring_fails_midway, 2},
    };
    tu_add_loops(s, loops, sizeof loops / sizeof loops[0], 240);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
