/* SPDX-License-Identifier: MIT */
/* test_mappings.c — Megatron's region mappings, the tensor-parallel utilities
 * and broadcast_data (cpar.h §8).
 *
 * Every mapping runs forward and backward at group sizes 1, 2, 3 and 4, in
 * F32, F16, BF16 and I32, on tensors of rank 1 to 4 with odd sizes (uneven
 * split sizes with a zero-row rank where the mapping takes them; in place
 * where allowed), into outputs poisoned with NaN. Rank j's input of call c is
 * generated from seed (c, world rank of j), so every rank rebuilds its peers'
 * inputs and computes the expected output itself, single-rank, from the seed
 * code's definition (mappings.py). Data movement must be bit-exact; sums are
 * computed in fp32 in rank order and rounded once, as cpar defines them, so
 * they are bit-exact too. After every call the group's statistics must equal
 * the minimum of the collective the seed uses (cpar.h §5), and nothing else.
 */
#include "testutil.h"

#define MAX_RANKS 4
#define MAX_ND 4

static const cpar_dtype dtypes[] = {CPAR_F32, CPAR_F16, CPAR_BF16, CPAR_I32};
#define N_DTYPES ((int)(sizeof dtypes / sizeof dtypes[0]))

/* The per-rank piece of every test tensor: ranks 1 to 4, odd sizes. */
static const struct {
    int ndim;
    int64_t s[MAX_ND];
} bases[] = {{1, {7}}, {2, {3, 5}}, {3, {3, 1, 5}}, {4, {1, 3, 3, 5}}};
#define N_BASES ((int)(sizeof bases / sizeof bases[0]))

/* What a mapping direction computes (the reference implements these). */
typedef enum {
    P_COPY, P_ALL_REDUCE, P_SPLIT_LAST, P_GATHER_LAST, P_RS_LAST, P_SPLIT_FIRST, P_GATHER_FIRST, P_RS_FIRST,
    P_A2A, P_SP2HP, P_HP2SP
} prim;

typedef enum {
    M_COPY_TO_TP, M_REDUCE_FROM_TP, M_SCATTER_TO_TP, M_GATHER_FROM_TP, M_SCATTER_TO_SP, M_GATHER_FROM_SP,
    M_RS_TO_SP, M_AG_LAST, M_RS_LAST, M_A2A, M_SP2HP, M_HP2SP, N_MAPS
} map_id;

static const char *const map_names[N_MAPS] = {
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sp_region", "gather_from_sp_region", "reduce_scatter_to_sp_region",
    "all_gather_last_dim_from_tp_region", "reduce_scatter_last_dim_to_tp_region", "all_to_all",
    "all_to_all_sp2hp", "all_to_all_hp2sp",
};

enum { V_UNEVEN = 1, V_NO_TP_GRAD = 2 }; /* uneven split sizes; tp_output_grad = false */

typedef struct {
    map_id map;
    cpar_dir dir;
    int variant;
    prim p;
} mcase;

/* Grouped by mapping (the suite makes one test case per mapping). */
static const mcase cases[] = {
    {M_COPY_TO_TP, CPAR_FWD, 0, P_COPY},
    {M_COPY_TO_TP, CPAR_BWD, 0, P_ALL_REDUCE},
    {M_REDUCE_FROM_TP, CPAR_FWD, 0, P_ALL_REDUCE},
    {M_REDUCE_FROM_TP, CPAR_BWD, 0, P_COPY},
    {M_SCATTER_TO_TP, CPAR_FWD, 0, P_SPLIT_LAST},
    {M_SCATTER_TO_TP, CPAR_BWD, 0, P_GATHER_LAST},
    {M_GATHER_FROM_TP, CPAR_FWD, 0, P_GATHER_LAST},
    {M_GATHER_FROM_TP, CPAR_BWD, 0, P_SPLIT_LAST},
    {M_SCATTER_TO_SP, CPAR_FWD, 0, P_SPLIT_FIRST},
    {M_SCATTER_TO_SP, CPAR_BWD, 0, P_GATHER_FIRST},
    {M_GATHER_FROM_SP, CPAR_FWD, 0, P_GATHER_FIRST},
    {M_GATHER_FROM_SP, CPAR_FWD, V_UNEVEN, P_GATHER_FIRST},
    {M_GATHER_FROM_SP, CPAR_BWD, 0, P_RS_FIRST},
    {M_GATHER_FROM_SP, CPAR_BWD, V_UNEVEN, P_RS_FIRST},
    {M_GATHER_FROM_SP, CPAR_BWD, V_NO_TP_GRAD, P_SPLIT_FIRST},
    {M_GATHER_FROM_SP, CPAR_BWD, V_NO_TP_GRAD | V_UNEVEN, P_SPLIT_FIRST},
    {M_RS_TO_SP, CPAR_FWD, 0, P_RS_FIRST},
    {M_RS_TO_SP, CPAR_FWD, V_UNEVEN, P_RS_FIRST},
    {M_RS_TO_SP, CPAR_BWD, 0, P_GATHER_FIRST},
    {M_RS_TO_SP, CPAR_BWD, V_UNEVEN, P_GATHER_FIRST},
    {M_AG_LAST, CPAR_FWD, 0, P_GATHER_LAST},
    {M_AG_LAST, CPAR_BWD, 0, P_RS_LAST},
    {M_RS_LAST, CPAR_FWD, 0, P_RS_LAST},
    {M_RS_LAST, CPAR_BWD, 0, P_GATHER_LAST},
    {M_A2A, CPAR_FWD, 0, P_A2A},
    {M_A2A, CPAR_FWD, V_UNEVEN, P_A2A},
    {M_A2A, CPAR_BWD, 0, P_A2A},
    {M_A2A, CPAR_BWD, V_UNEVEN, P_A2A},
    {M_SP2HP, CPAR_FWD, 0, P_SP2HP},
    {M_SP2HP, CPAR_BWD, 0, P_HP2SP},
    {M_HP2SP, CPAR_FWD, 0, P_HP2SP},
    {M_HP2SP, CPAR_BWD, 0, P_SP2HP},
};
#define N_CASES ((int)(sizeof cases / sizeof cases[0]))

static uint64_t seed_of(int call, int world_rank) {
    return (uint64_t)call * 1000003u + (uint64_t)world_rank * 7919u + 17u;
}

static int64_t numel_of(int nd, const int64_t *s) {
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= s[i];
    return n;
}

static void free_tensor(cpar_ctx *ctx, cpar_tensor *t) { TU_OK(cpar_tensor_free(ctx, t)); }

/* Rows of rank j with uneven split sizes: 2, 0, 4, 5 (a zero-row rank). */
static int64_t uneven_rows(int j) { return j == 1 ? 0 : j + 2; }

/* Rows rank i sends rank j in the forward of the uneven all-to-all (zeros included). */
static int64_t a2a_rows(int i, int j) { return (i + 2 * j + 1) % 3; }

/* Shapes and split sizes of one call, for every rank of the group. */
typedef struct {
    int in_nd, out_nd;
    int64_t in[MAX_RANKS][MAX_ND], out[MAX_RANKS][MAX_ND];
    int64_t sizes[MAX_RANKS];               /* split_sizes of the first-dim mappings */
    int64_t send[MAX_RANKS][MAX_RANKS];     /* all-to-all: rows rank i sends rank j in this call */
    int64_t fwd_out[MAX_RANKS][MAX_RANKS];  /* all-to-all arguments of rank j: the forward's out_splits */
    int64_t fwd_in[MAX_RANKS][MAX_RANKS];   /* ... and in_splits */
    bool uneven;
} geom;

static void build_geom(const mcase *c, int b, int n, geom *G) {
    const int64_t *B = bases[b].s;
    int nd = bases[b].ndim, last = nd - 1;
    int64_t outer = numel_of(nd - 1, B), total = 0;
    memset(G, 0, sizeof *G);
    G->in_nd = G->out_nd = nd;
    G->uneven = c->variant & V_UNEVEN;
    for (int j = 0; j < n; j++) {
        memcpy(G->in[j], B, sizeof G->in[j]);
        memcpy(G->out[j], B, sizeof G->out[j]);
        G->sizes[j] = G->uneven ? uneven_rows(j) : B[0];
        total += G->sizes[j];
    }
    for (int j = 0; j < n; j++) {
        int64_t *in = G->in[j], *out = G->out[j];
        switch (c->p) {
        case P_COPY: case P_ALL_REDUCE: break;
        case P_SPLIT_LAST: case P_RS_LAST: in[last] *= n; break;
        case P_GATHER_LAST: out[last] *= n; break;
        case P_SPLIT_FIRST: case P_RS_FIRST: in[0] = total; out[0] = G->sizes[j]; break;
        case P_GATHER_FIRST: in[0] = G->sizes[j]; out[0] = total; break;
        case P_A2A: {
            int64_t rin = 0, rout = 0;
            for (int k = 0; k < n; k++) {
                int64_t f_jk = G->uneven ? a2a_rows(j, k) : B[0], f_kj = G->uneven ? a2a_rows(k, j) : B[0];
                G->fwd_in[j][k] = f_jk;  /* forward: j sends f(j,k) to k */
                G->fwd_out[j][k] = f_kj; /* forward: j receives f(k,j) from k */
                G->send[j][k] = c->dir == CPAR_FWD ? f_jk : f_kj; /* backward sends the gradient back */
                rin += G->send[j][k];
            }
            for (int k = 0; k < n; k++) rout += c->dir == CPAR_FWD ? (G->uneven ? a2a_rows(k, j) : B[0])
                                                                     : (G->uneven ? a2a_rows(j, k) : B[0]);
            in[0] = rin;
            out[0] = rout;
            break;
        }
        case P_SP2HP: /* [outer, n*w] -> [n*outer, w] */
            in[last] *= n;
            G->out_nd = 2;
            out[0] = n * outer;
            out[1] = B[last];
            memset(out + 2, 0, sizeof(int64_t) * (MAX_ND - 2));
            break;
        case P_HP2SP: /* [n*outer, h] -> B with last dim n*h */
            G->in_nd = 2;
            in[0] = n * outer;
            in[1] = B[last];
            memset(in + 2, 0, sizeof(int64_t) * (MAX_ND - 2));
            out[last] *= n;
            break;
        }
    }
}

/* want[k] = sum over ranks of x[j][at + k]: fp32 in rank order for floats, as cpar defines it. */
static void ref_sum(cpar_dtype dt, void *const *x, int n, int64_t at, void *want, int64_t k) {
    if (cpar_dtype_is_float(dt)) {
        float acc = (float)tu_get(x[0], dt, at);
        for (int j = 1; j < n; j++) acc += (float)tu_get(x[j], dt, at);
        tu_set(want, dt, k, acc);
    } else {
        double acc = 0;
        for (int j = 0; j < n; j++) acc += tu_get(x[j], dt, at);
        tu_set(want, dt, k, acc);
    }
}

static void ref_move(void *want, int64_t k, const void *src, int64_t at, size_t es) {
    memcpy((char *)want + (size_t)k * es, (const char *)src + (size_t)at * es, es);
}

/* What rank me's out must hold, from every rank's input x[j] (seed mappings.py). */
static void reference(const mcase *c, const geom *G, cpar_dtype dt, int n, int me, void *const *x, void *want) {
    size_t es = cpar_dtype_size(dt);
    const int64_t *in = G->in[me];
    int last = G->in_nd - 1;
    int64_t on = numel_of(G->out_nd, G->out[me]), cols = in[last], outer = numel_of(G->in_nd - 1, in);
    int64_t rowe = numel_of(G->in_nd - 1, in + 1), off = 0;
    for (int j = 0; j < me; j++) off += G->sizes[j];
    switch (c->p) {
    case P_COPY: memcpy(want, x[me], (size_t)on * es); break;
    case P_ALL_REDUCE:
        for (int64_t k = 0; k < on; k++) ref_sum(dt, x, n, k, want, k);
        break;
    case P_SPLIT_LAST: { /* columns [me*w, (me+1)*w) */
        int64_t w = cols / n;
        for (int64_t o = 0; o < outer; o++)
            for (int64_t q = 0; q < w; q++) ref_move(want, o * w + q, x[me], o * cols + me * w + q, es);
        break;
    }
    case P_GATHER_LAST: /* rank j's columns at [j*cols, (j+1)*cols) */
        for (int j = 0; j < n; j++)
            for (int64_t o = 0; o < outer; o++)
                for (int64_t q = 0; q < cols; q++) ref_move(want, o * n * cols + j * cols + q, x[j], o * cols + q, es);
        break;
    case P_RS_LAST: {
        int64_t w = cols / n;
        for (int64_t o = 0; o < outer; o++)
            for (int64_t q = 0; q < w; q++) ref_sum(dt, x, n, o * cols + me * w + q, want, o * w + q);
        break;
    }
    case P_SPLIT_FIRST: memcpy(want, (char *)x[me] + (size_t)(off * rowe) * es, (size_t)on * es); break;
    case P_GATHER_FIRST: {
        int64_t k = 0;
        for (int j = 0; j < n; j++)
            for (int64_t e = 0; e < G->in[j][0] * rowe; e++) ref_move(want, k++, x[j], e, es);
        break;
    }
    case P_RS_FIRST:
        for (int64_t k = 0; k < on; k++) ref_sum(dt, x, n, off * rowe + k, want, k);
        break;
    case P_A2A: { /* from each rank i in order: its rows addressed to me */
        int64_t k = 0;
        for (int i = 0; i < n; i++) {
            int64_t src = 0;
            for (int j = 0; j < me; j++) src += G->send[i][j];
            for (int64_t e = 0; e < G->send[i][me] * rowe; e++) ref_move(want, k++, x[i], src * rowe + e, es);
        }
        break;
    }
    case P_SP2HP: { /* out[i*R + t, q] = x[i][t, me*w + q] */
        int64_t w = cols / n, R = outer;
        for (int i = 0; i < n; i++)
            for (int64_t t = 0; t < R; t++)
                for (int64_t q = 0; q < w; q++) ref_move(want, (i * R + t) * w + q, x[i], t * cols + me * w + q, es);
        break;
    }
    case P_HP2SP: { /* out[t, i*h + q] = x[i][me*R + t, q] */
        int64_t h = cols, R = outer / n;
        for (int i = 0; i < n; i++)
            for (int64_t t = 0; t < R; t++)
                for (int64_t q = 0; q < h; q++) ref_move(want, t * n * h + i * h + q, x[i], (me * R + t) * h + q, es);
        break;
    }
    }
}

/* The statistics of g hold exactly `calls` calls of kind (or nothing when calls is 0). */
static void expect_stats(cpar_group *g, cpar_coll_kind kind, uint64_t calls, uint64_t sent, uint64_t recv,
                         const char *what) {
    cpar_comm_stats s;
    TU_OK(cpar_group_stats(g, &s));
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++) {
        cpar_comm_counter w = {0, 0, 0};
        if (calls && k == (int)kind) w = (cpar_comm_counter){calls, sent, recv};
        ck_assert_msg(s.kind[k].calls == w.calls && s.kind[k].bytes_sent == w.bytes_sent &&
                          s.kind[k].bytes_recv == w.bytes_recv,
                      "%s, rank %d of %d, %s counters: calls %llu sent %llu recv %llu, expected %llu %llu %llu", what,
                      cpar_group_rank(g), cpar_group_size(g), cpar_coll_kind_name((cpar_coll_kind)k),
                      (unsigned long long)s.kind[k].calls, (unsigned long long)s.kind[k].bytes_sent,
                      (unsigned long long)s.kind[k].bytes_recv, (unsigned long long)w.calls,
                      (unsigned long long)w.bytes_sent, (unsigned long long)w.bytes_recv);
    }
}

/* The collective the seed uses for prim p, at its minimum (cpar.h §5). */
static void expect_prim_stats(cpar_group *g, const mcase *c, const geom *G, cpar_dtype dt, const char *what) {
    int n = cpar_group_size(g), me = cpar_group_rank(g);
    uint64_t es = cpar_dtype_size(dt);
    uint64_t in_b = (uint64_t)numel_of(G->in_nd, G->in[me]) * es, out_b = (uint64_t)numel_of(G->out_nd, G->out[me]) * es;
    if (n == 1) { /* bypassed, as in the seed */
        expect_stats(g, CPAR_COLL_ALL_REDUCE, 0, 0, 0, what);
        return;
    }
    switch (c->p) {
    case P_COPY: case P_SPLIT_LAST: case P_SPLIT_FIRST: expect_stats(g, CPAR_COLL_ALL_REDUCE, 0, 0, 0, what); break;
    case P_ALL_REDUCE: {
        int64_t numel = numel_of(G->in_nd, G->in[me]);
        uint64_t share = (uint64_t)(numel / n + (me < numel % n)) * es, moved = (in_b - share) + (uint64_t)(n - 1) * share;
        expect_stats(g, CPAR_COLL_ALL_REDUCE, 1, moved, moved, what);
        break;
    }
    case P_GATHER_LAST: case P_GATHER_FIRST: /* receives (n-1)/n of the output */
        expect_stats(g, CPAR_COLL_ALL_GATHER, 1, in_b * (uint64_t)(n - 1), out_b - in_b, what);
        break;
    case P_RS_LAST: case P_RS_FIRST:
        expect_stats(g, CPAR_COLL_REDUCE_SCATTER, 1, in_b - out_b, out_b * (uint64_t)(n - 1), what);
        break;
    case P_A2A: {
        uint64_t row = (uint64_t)numel_of(G->in_nd - 1, G->in[me] + 1) * es, self = (uint64_t)G->send[me][me] * row;
        expect_stats(g, CPAR_COLL_ALL_TO_ALL, 1, in_b - self, out_b - self, what);
        break;
    }
    case P_SP2HP: case P_HP2SP:
        expect_stats(g, CPAR_COLL_ALL_TO_ALL, 1, in_b - in_b / (uint64_t)n, in_b - in_b / (uint64_t)n, what);
        break;
    }
}

/* Call mapping c with this rank's split arguments from G. */
static cpar_status call_map(const mcase *c, const geom *G, cpar_group *g, const cpar_tensor *in, cpar_tensor *out) {
    int me = cpar_group_rank(g);
    const int64_t *sizes = G->uneven ? G->sizes : NULL;
    switch (c->map) {
    case M_COPY_TO_TP: return cpar_copy_to_tp_region(g, in, out, c->dir);
    case M_REDUCE_FROM_TP: return cpar_reduce_from_tp_region(g, in, out, c->dir);
    case M_SCATTER_TO_TP: return cpar_scatter_to_tp_region(g, in, out, c->dir);
    case M_GATHER_FROM_TP: return cpar_gather_from_tp_region(g, in, out, c->dir);
    case M_SCATTER_TO_SP: return cpar_scatter_to_sp_region(g, in, out, c->dir);
    case M_GATHER_FROM_SP: return cpar_gather_from_sp_region(g, in, out, c->dir, !(c->variant & V_NO_TP_GRAD), sizes);
    case M_RS_TO_SP: return cpar_reduce_scatter_to_sp_region(g, in, out, c->dir, sizes);
    case M_AG_LAST: return cpar_all_gather_last_dim_from_tp_region(g, in, out, c->dir);
    case M_RS_LAST: return cpar_reduce_scatter_last_dim_to_tp_region(g, in, out, c->dir);
    case M_A2A:
        return cpar_all_to_all(g, in, out, c->dir, G->uneven ? G->fwd_out[me] : NULL, G->uneven ? G->fwd_in[me] : NULL);
    case M_SP2HP: return cpar_all_to_all_sp2hp(g, in, out, c->dir);
    case M_HP2SP: return cpar_all_to_all_hp2sp(g, in, out, c->dir);
    default: return CPAR_ERR_INVALID;
    }
}

static bool in_place_allowed(const mcase *c, int n) {
    return n == 1 || c->p == P_COPY || c->p == P_ALL_REDUCE || (c->p == P_A2A && !(c->variant & V_UNEVEN));
}

/* ---- every mapping against the reference ------------------------------------------ */

typedef struct {
    int first, count; /* cases[first .. first+count) */
    int tp;           /* 0: the world group; else the TP group of a grid with this tp */
} map_job;

static cpar_status rank_mappings(cpar_ctx *ctx, void *p) {
    const map_job *J = p;
    cpar_group *g = cpar_world_group(ctx);
    if (J->tp) {
        TU_OK(cpar_grid_init(ctx, &(cpar_grid_config){.tp = J->tp}));
        g = cpar_grid_group(ctx, CPAR_GROUP_TP);
    }
    int n = cpar_group_size(g), me = cpar_group_rank(g), call = 0;
    for (int ci = J->first; ci < J->first + J->count; ci++) {
        const mcase *c = &cases[ci];
        for (int d = 0; d < N_DTYPES; d++)
            for (int b = 0; b < N_BASES; b++)
                for (int ip = 0; ip < 2; ip++, call++) {
                    if (ip && !in_place_allowed(c, n)) continue;
                    cpar_dtype dt = dtypes[d];
                    geom G;
                    build_geom(c, b, n, &G);
                    void *x[MAX_RANKS];
                    for (int j = 0; j < n; j++)
                        x[j] = tu_random_host(dt, numel_of(G.in_nd, G.in[j]), seed_of(call, cpar_group_world_rank(g, j)));
                    cpar_tensor in = tu_upload(ctx, x[me], dt, G.in_nd, G.in[me]), out = in;
                    if (!ip) out = tu_alloc_poisoned(ctx, dt, G.out_nd, G.out[me]);
                    char what[160];
                    snprintf(what, sizeof what, "%s %s%s%s %s rank-%d%s", map_names[c->map],
                             c->dir == CPAR_FWD ? "fwd" : "bwd", c->variant & V_UNEVEN ? " uneven" : "",
                             c->variant & V_NO_TP_GRAD ? " !tp_output_grad" : "", cpar_dtype_name(dt), bases[b].ndim,
                             ip ? " in place" : "");
                    TU_OK(cpar_group_stats_reset(g));
                    cpar_status st = call_map(c, &G, g, &in, &out);
                    ck_assert_msg(st == CPAR_OK, "%s, rank %d of %d: %s: %s", what, me, n, cpar_status_string(st),
                                  cpar_thread_last_error());
                    expect_prim_stats(g, c, &G, dt, what);
                    if (!ip) { /* in place, out keeps in's shape (sp2hp at n = 1: [7] for [1,7]) */
                        ck_assert_int_eq(out.ndim, G.out_nd);
                        for (int k = 0; k < G.out_nd; k++) ck_assert_int_eq(out.shape[k], G.out[me][k]);
                    }
                    int64_t on = numel_of(G.out_nd, G.out[me]);
                    void *got = tu_download(ctx, &out);
                    void *want = malloc((size_t)(on > 0 ? on : 1) * cpar_dtype_size(dt));
                    reference(c, &G, dt, n, me, x, want);
                    int64_t bad = tu_bits_mismatch(got, want, dt, on);
                    ck_assert_msg(bad < 0, "%s, rank %d of %d: element %lld is %.9g, expected %.9g", what, me, n,
                                  (long long)bad, bad < 0 ? 0.0 : tu_get(got, dt, bad),
                                  bad < 0 ? 0.0 : tu_get(want, dt, bad));
                    free(got);
                    free(want);
                    for (int j = 0; j < n; j++) free(x[j]);
                    free_tensor(ctx, &in);
                    if (!ip) free_tensor(ctx, &out);
                }
    }
    return CPAR_OK;
}

/* Loop index: case group of one mapping x group size 1..4. */
static int map_first[N_MAPS], map_count[N_MAPS];

START_TEST(test_mapping) {
    int m = _i / 4, n = 1 + _i % 4;
    map_job J = {map_first[m], map_count[m], 0};
    TU_OK(tu_spawn(n, rank_mappings, &J));
}
END_TEST

/* The same on the TP groups of a grid (world 4, tp 2; world 6, tp 3): group
 * ranks, not world ranks, pick the slices, and two groups run side by side. */
START_TEST(test_mapping_subgroup) {
    int tp = 2 + _i % 2;
    map_job J = {0, N_CASES, tp};
    TU_OK(tu_spawn(2 * tp, rank_mappings, &J));
}
END_TEST

/* ---- sp2hp / hp2sp layout ----------------------------------------------------------- */

/* The seed's layout on a concrete example, tp 2: rank r holds tokens 2r, 2r+1
 * of [T=4, H=4] with value 10*token + column. sp2hp gives every rank all 4
 * tokens and its 2 columns; hp2sp brings them back. */
static cpar_status rank_sp2hp_example(cpar_ctx *ctx, void *p) {
    (void)p;
    cpar_group *g = cpar_world_group(ctx);
    int me = cpar_group_rank(g);
    float x[8];
    for (int t = 0; t < 2; t++)
        for (int h = 0; h < 4; h++) x[t * 4 + h] = (float)(10 * (2 * me + t) + h);
    static const float want[2][8] = {{0, 1, 10, 11, 20, 21, 30, 31}, {2, 3, 12, 13, 22, 23, 32, 33}};
    int64_t sp[] = {2, 4}, hp[] = {4, 2};
    cpar_tensor in = tu_upload(ctx, x, CPAR_F32, 2, sp), mid = tu_alloc_poisoned(ctx, CPAR_F32, 2, hp);
    cpar_tensor back = tu_alloc_poisoned(ctx, CPAR_F32, 2, sp), back2 = tu_alloc_poisoned(ctx, CPAR_F32, 2, sp);
    TU_OK(cpar_all_to_all_sp2hp(g, &in, &mid, CPAR_FWD));
    float *got = tu_download(ctx, &mid);
    TU_EXPECT_SAME(got, want[me], CPAR_F32, 8);
    free(got);
    TU_OK(cpar_all_to_all_hp2sp(g, &mid, &back, CPAR_FWD));
    TU_OK(cpar_all_to_all_sp2hp(g, &mid, &back2, CPAR_BWD));
    for (int k = 0; k < 2; k++) {
        got = tu_download(ctx, k ? &back2 : &back);
        TU_EXPECT_SAME(got, x, CPAR_F32, 8);
        free(got);
    }
    cpar_tensor *all[] = {&in, &mid, &back, &back2};
    for (int k = 0; k < 4; k++) free_tensor(ctx, all[k]);
    return CPAR_OK;
}

START_TEST(test_sp2hp_example) { TU_OK(tu_spawn(2, rank_sp2hp_example, NULL)); }
END_TEST

/* sp2hp then hp2sp is the identity on [s/n, b, h] activations (out of sp2hp
 * as [s*b, h/n], back as [s/n, b, h]), and hp2sp then sp2hp on [T, h/n]. */
static cpar_status rank_sp2hp_roundtrip(cpar_ctx *ctx, void *p) {
    (void)p;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), me = cpar_group_rank(g);
    for (int d = 0; d < N_DTYPES; d++) {
        cpar_dtype dt = dtypes[d];
        int64_t sp[] = {5, 3, 2 * n}, hp[] = {5 * 3 * n, 2};
        void *x = tu_random_host(dt, 30 * n, seed_of(900 + d, me));
        cpar_tensor a = tu_upload(ctx, x, dt, 3, sp), m = tu_alloc_poisoned(ctx, dt, 2, hp);
        cpar_tensor b = tu_alloc_poisoned(ctx, dt, 3, sp);
        TU_OK(cpar_all_to_all_sp2hp(g, &a, &m, CPAR_FWD));
        TU_OK(cpar_all_to_all_hp2sp(g, &m, &b, CPAR_FWD));
        void *got = tu_download(ctx, &b);
        TU_EXPECT_SAME(got, x, dt, 30 * n);
        free(got);
        /* The other way round: [T, h/n] -> [T/n, h] -> [T, h/n]. */
        void *y = tu_random_host(dt, 30 * n, seed_of(950 + d, me));
        cpar_tensor c = tu_upload(ctx, y, dt, 2, hp), e = tu_alloc_poisoned(ctx, dt, 2, hp);
        TU_OK(cpar_all_to_all_hp2sp(g, &c, &b, CPAR_FWD));
        TU_OK(cpar_all_to_all_hp2sp(g, &b, &e, CPAR_BWD));
        got = tu_download(ctx, &e);
        TU_EXPECT_SAME(got, y, dt, 30 * n);
        free(got);
        free(x);
        free(y);
        cpar_tensor *all[] = {&a, &m, &b, &c, &e};
        for (int k = 0; k < 5; k++) free_tensor(ctx, all[k]);
    }
    return CPAR_OK;
}

START_TEST(test_sp2hp_roundtrip) { TU_OK(tu_spawn(1 + _i, rank_sp2hp_roundtrip, NULL)); }
END_TEST

/* ---- utilities ---------------------------------------------------------------------- */

START_TEST(test_divide) {
    int64_t q = -1;
    TU_OK(cpar_divide(12, 4, &q));
    ck_assert_int_eq(q, 3);
    TU_OK(cpar_divide(0, 7, &q));
    ck_assert_int_eq(q, 0);
    TU_OK(cpar_divide(-12, 4, &q));
    ck_assert_int_eq(q, -3);
    TU_FAILS(cpar_divide(10, 4, &q), CPAR_ERR_INVALID, "cpar_divide: 10 is not divisible by 4");
    ck_assert_int_eq(q, -3); /* untouched */
    TU_FAILS(cpar_divide(10, 0, &q), CPAR_ERR_INVALID, "den");
    TU_FAILS(cpar_divide(10, 5, NULL), CPAR_ERR_INVALID, "out");
}
END_TEST

START_TEST(test_vocab_range) {
    int64_t f = -1, l = -1;
    for (int world = 1; world <= 4; world++)
        for (int r = 0; r < world; r++) {
            TU_OK(cpar_vocab_range(12 * 7, r, world, &f, &l));
            ck_assert_int_eq(f, r * (84 / world));
            ck_assert_int_eq(l, (r + 1) * (84 / world));
        }
    TU_OK(cpar_vocab_range(0, 1, 2, &f, &l));
    ck_assert(f == 0 && l == 0);
    TU_FAILS(cpar_vocab_range(10, 0, 4, &f, &l), CPAR_ERR_INVALID, "global_vocab 10 is not divisible by world 4");
    TU_FAILS(cpar_vocab_range(12, 4, 4, &f, &l), CPAR_ERR_INVALID, "rank");
    TU_MSG_HAS("0..3");
    TU_FAILS(cpar_vocab_range(12, -1, 4, &f, &l), CPAR_ERR_INVALID, "rank");
    TU_FAILS(cpar_vocab_range(12, 0, 0, &f, &l), CPAR_ERR_INVALID, "world");
    TU_FAILS(cpar_vocab_range(-4, 0, 2, &f, &l), CPAR_ERR_INVALID, "global_vocab");
    TU_FAILS(cpar_vocab_range(12, 0, 2, NULL, &l), CPAR_ERR_INVALID, "first");
    TU_FAILS(cpar_vocab_range(12, 0, 2, &f, NULL), CPAR_ERR_INVALID, "last");
}
END_TEST

START_TEST(test_pad_vocab_size) {
    int64_t v = -1;
    TU_OK(cpar_pad_vocab_size(50257, 128, 1, &v)); /* GPT-2 */
    ck_assert_int_eq(v, 50304);
    TU_OK(cpar_pad_vocab_size(50257, 128, 2, &v));
    ck_assert_int_eq(v, 50432);
    TU_OK(cpar_pad_vocab_size(50304, 128, 1, &v)); /* already a multiple */
    ck_assert_int_eq(v, 50304);
    TU_OK(cpar_pad_vocab_size(1, 1, 3, &v));
    ck_assert_int_eq(v, 3);
    TU_OK(cpar_pad_vocab_size(0, 128, 8, &v));
    ck_assert_int_eq(v, 0);
    TU_FAILS(cpar_pad_vocab_size(100, 0, 1, &v), CPAR_ERR_INVALID, "multiple");
    TU_FAILS(cpar_pad_vocab_size(100, 8, 0, &v), CPAR_ERR_INVALID, "tp");
    TU_FAILS(cpar_pad_vocab_size(-1, 8, 1, &v), CPAR_ERR_INVALID, "vocab");
    TU_FAILS(cpar_pad_vocab_size(100, 8, 1, NULL), CPAR_ERR_INVALID, "out");
    TU_FAILS(cpar_pad_vocab_size(INT64_MAX - 5, 1024, 1, &v), CPAR_ERR_INVALID, "overflow");
    TU_FAILS(cpar_pad_vocab_size(1, INT64_MAX / 2, 4, &v), CPAR_ERR_INVALID, "overflow");
}
END_TEST

/* Views on the context's device (simulated device memory on sim): checked by
 * copying them out with cpar functions (contiguous ones) or through the
 * stride (strided ones). */
static cpar_status rank_views(cpar_ctx *ctx, void *p) {
    (void)p;
    float x[72];
    for (int i = 0; i < 72; i++) x[i] = (float)i;
    int64_t s3[] = {3, 2, 12}, s1[] = {72}, s2[] = {12, 6};
    cpar_tensor t = tu_upload(ctx, x, CPAR_F32, 3, s3), v;
    int64_t stride = -1;
    float *all = tu_download(ctx, &t);
    /* Chunk 1 of 4 along the last dim: [3,2,3] at column 3, rows 12 apart. */
    TU_OK(cpar_split_last_dim_view(&t, 4, 1, &v, &stride));
    ck_assert_int_eq(stride, 12);
    ck_assert_int_eq(v.ndim, 3);
    ck_assert(v.shape[0] == 3 && v.shape[1] == 2 && v.shape[2] == 3);
    ck_assert(v.dtype == CPAR_F32 && v.device == t.device);
    ck_assert_ptr_eq(v.data, (float *)t.data + 3);
    for (int64_t o = 0; o < 6; o++) /* the view's elements through the stride */
        for (int64_t c = 0; c < 3; c++) ck_assert_float_eq(all[o * stride + 3 + c], (float)(o * 12 + 3 + c));
    TU_OK(cpar_split_last_dim_view(&t, 1, 0, &v, NULL)); /* n = 1: the whole tensor */
    ck_assert(v.data == t.data && v.shape[2] == 12);
    /* Outer dims multiplying to 1: a contiguous view any cpar function takes. */
    cpar_tensor flat = tu_upload(ctx, x, CPAR_F32, 1, s1);
    TU_OK(cpar_split_last_dim_view(&flat, 3, 2, &v, &stride));
    ck_assert(v.ndim == 1 && v.shape[0] == 24 && stride == 72);
    float *got = tu_download(ctx, &v);
    TU_EXPECT_SAME(got, x + 48, CPAR_F32, 24);
    free(got);
    /* First dim: [12,6] chunk 2 of 3 = rows 8..11. */
    cpar_tensor m = tu_upload(ctx, x, CPAR_F32, 2, s2);
    TU_OK(cpar_split_first_dim_view(&m, 3, 2, &v));
    ck_assert(v.ndim == 2 && v.shape[0] == 4 && v.shape[1] == 6);
    got = tu_download(ctx, &v);
    TU_EXPECT_SAME(got, x + 48, CPAR_F32, 24);
    free(got);
    /* Empty tensors: NULL data stays NULL. */
    int64_t s0[] = {0, 4};
    cpar_tensor e = cpar_tensor_make(NULL, CPAR_F16, 2, s0, cpar_device(ctx));
    TU_OK(cpar_split_last_dim_view(&e, 2, 1, &v, &stride));
    ck_assert(v.data == NULL && v.shape[1] == 2 && stride == 4);
    TU_OK(cpar_split_first_dim_view(&e, 3, 2, &v));
    ck_assert(v.data == NULL && v.shape[0] == 0);
    /* Bad input names the argument and the numbers. */
    TU_FAILS(cpar_split_last_dim_view(&t, 5, 0, &v, &stride), CPAR_ERR_INVALID, "last dim 12, not divisible by n = 5");
    TU_FAILS(cpar_split_last_dim_view(&t, 4, 4, &v, &stride), CPAR_ERR_INVALID, "i is 4, expected 0..3");
    TU_FAILS(cpar_split_last_dim_view(&t, 0, 0, &v, &stride), CPAR_ERR_INVALID, "n is 0");
    TU_FAILS(cpar_split_last_dim_view(NULL, 2, 0, &v, &stride), CPAR_ERR_INVALID, "t is NULL");
    TU_FAILS(cpar_split_last_dim_view(&t, 2, 0, NULL, &stride), CPAR_ERR_INVALID, "view");
    float one = 1;
    cpar_tensor sc = cpar_tensor_make(&one, CPAR_F32, 0, NULL, CPAR_HOST);
    TU_FAILS(cpar_split_last_dim_view(&sc, 1, 0, &v, &stride), CPAR_ERR_INVALID, "scalar");
    TU_FAILS(cpar_split_first_dim_view(&m, 5, 0, &v), CPAR_ERR_INVALID, "dim 0 12, not divisible by n = 5");
    TU_FAILS(cpar_split_first_dim_view(&m, 3, 3, &v), CPAR_ERR_INVALID, "i");
    TU_FAILS(cpar_split_first_dim_view(&m, -1, 0, &v), CPAR_ERR_INVALID, "n");
    TU_FAILS(cpar_split_first_dim_view(NULL, 1, 0, &v), CPAR_ERR_INVALID, "t");
    TU_FAILS(cpar_split_first_dim_view(&m, 1, 0, NULL), CPAR_ERR_INVALID, "view");
    TU_FAILS(cpar_split_first_dim_view(&sc, 1, 0, &v), CPAR_ERR_INVALID, "scalar");
    free(all);
    free_tensor(ctx, &t);
    free_tensor(ctx, &flat);
    free_tensor(ctx, &m);
    return CPAR_OK;
}

START_TEST(test_views) { TU_OK(tu_spawn(1, rank_views, NULL)); }
END_TEST

/* ---- broadcast_data ----------------------------------------------------------------- */

#define N_KEYS 6
static const char *const bkeys[N_KEYS] = {"tokens", "labels", "loss_mask", "empty", "scalar", "five_d"};
static const struct {
    int nd;
    int64_t s[CPAR_BROADCAST_MAX_DIMS];
} bshapes[N_KEYS] = {{2, {2, 9}}, {2, {2, 9}}, {1, {11}}, {3, {3, 0, 2}}, {0, {0}}, {5, {1, 2, 1, 3, 2}}};

static uint64_t bseed(int round, int key) { return 4242u + (uint64_t)round * 131u + (uint64_t)key; }

/* Rank 0's inputs: even keys in host memory, odd keys on the context's device. */
static void make_bcast_inputs(cpar_ctx *ctx, cpar_dtype dt, int round, void **host, cpar_tensor *in) {
    for (int i = 0; i < N_KEYS; i++) {
        int64_t ne = numel_of(bshapes[i].nd, bshapes[i].s);
        host[i] = tu_random_host(dt, ne, bseed(round, i));
        if (i % 2) in[i] = tu_upload(ctx, host[i], dt, bshapes[i].nd, bshapes[i].s);
        else in[i] = cpar_tensor_make(host[i], dt, bshapes[i].nd, bshapes[i].s, CPAR_HOST);
    }
}

static void free_bcast_inputs(cpar_ctx *ctx, void **host, cpar_tensor *in) {
    for (int i = 0; i < N_KEYS; i++) {
        if (i % 2) free_tensor(ctx, &in[i]);
        free(host[i]);
    }
}

/* Every rank checks its out[] against the keys' shapes and rank 0's values. */
static void check_bcast_outputs(cpar_ctx *ctx, cpar_dtype dt, int round, cpar_tensor *out) {
    for (int i = 0; i < N_KEYS; i++) {
        ck_assert_msg(out[i].ndim == bshapes[i].nd && out[i].dtype == dt && out[i].device == cpar_device(ctx),
                      "key %s: ndim %d dtype %s device %d", bkeys[i], out[i].ndim, cpar_dtype_name(out[i].dtype),
                      out[i].device);
        for (int d = 0; d < bshapes[i].nd; d++) ck_assert_int_eq(out[i].shape[d], bshapes[i].s[d]);
        int64_t ne = numel_of(bshapes[i].nd, bshapes[i].s);
        void *want = tu_random_host(dt, ne, bseed(round, i)), *got = tu_download(ctx, &out[i]);
        TU_EXPECT_SAME(got, want, dt, ne);
        free(want);
        free(got);
        free_tensor(ctx, &out[i]);
    }
}

static cpar_status rank_broadcast_data(cpar_ctx *ctx, void *p) {
    (void)p;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g), me = cpar_group_rank(g);
    static const cpar_dtype bdt[] = {CPAR_I64, CPAR_BF16, CPAR_I32};
    for (int round = 0; round < 3; round++) {
        cpar_dtype dt = bdt[round];
        void *host[N_KEYS];
        cpar_tensor in[N_KEYS], out[N_KEYS];
        if (me == 0) make_bcast_inputs(ctx, dt, round, host, in);
        TU_OK(cpar_group_stats_reset(g));
        TU_OK(cpar_broadcast_data(g, N_KEYS, bkeys, me == 0 ? in : NULL, dt, out));
        uint64_t data = 0;
        for (int i = 0; i < N_KEYS; i++) data += (uint64_t)numel_of(bshapes[i].nd, bshapes[i].s) * cpar_dtype_size(dt);
        uint64_t bytes = 8u * (2 + 5 * N_KEYS) + data; /* the shapes, then the data */
        if (me == 0) expect_stats(g, CPAR_COLL_BROADCAST, 2, bytes * (uint64_t)(n - 1), 0, "broadcast_data");
        else expect_stats(g, CPAR_COLL_BROADCAST, 2, 0, bytes, "broadcast_data");
        check_bcast_outputs(ctx, dt, round, out);
        if (me == 0) free_bcast_inputs(ctx, host, in);
    }
    /* No keys: nothing to do, no communication. */
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_broadcast_data(g, 0, NULL, NULL, CPAR_F32, NULL));
    expect_stats(g, CPAR_COLL_BROADCAST, 0, 0, 0, "broadcast_data of no keys");
    return CPAR_OK;
}

START_TEST(test_broadcast_data) { TU_OK(tu_spawn(1 + _i, rank_broadcast_data, NULL)); }
END_TEST

/* Rank 0 rejects its input: it returns CPAR_ERR_INVALID naming the key, the
 * others CPAR_ERR_PEER (instead of waiting for data that never comes); no
 * output is left allocated and the group keeps working. */
static cpar_status rank_broadcast_data_errors(cpar_ctx *ctx, void *p) {
    (void)p;
    cpar_group *g = cpar_world_group(ctx);
    int me = cpar_group_rank(g);
    cpar_dtype dt = CPAR_I64;
    void *host[N_KEYS];
    cpar_tensor in[N_KEYS], out[N_KEYS];
    if (me == 0) make_bcast_inputs(ctx, dt, 0, host, in);
    for (int k = 0; k < 3; k++) {
        cpar_tensor bad[N_KEYS];
        memcpy(bad, in, sizeof bad);
        int64_t six[] = {1, 1, 1, 1, 1, 18};
        const char *needle = k == 0 ? "labels" : k == 1 ? "loss_mask" : "in";
        if (me == 0 && k == 0) bad[1].dtype = CPAR_F32; /* labels: f32, expected i64 */
        if (me == 0 && k == 1) bad[2] = cpar_tensor_make(in[1].data, dt, 6, six, in[1].device);
        const cpar_tensor *arg = me != 0 ? NULL : k == 2 ? NULL : bad;
        for (int i = 0; i < N_KEYS; i++) out[i].data = (void *)&out; /* must come back NULL */
        cpar_status st = cpar_broadcast_data(g, N_KEYS, bkeys, arg, dt, out);
        if (me == 0) {
            ck_assert_msg(st == CPAR_ERR_INVALID, "case %d: rank 0 got %s: %s", k, cpar_status_string(st),
                          cpar_thread_last_error());
            TU_MSG_HAS(needle);
            if (k == 0) TU_MSG_HAS("f32");
            if (k == 1) TU_MSG_HAS("6 dims");
        } else {
            ck_assert_msg(st == CPAR_ERR_PEER, "case %d: rank %d got %s: %s", k, me, cpar_status_string(st),
                          cpar_thread_last_error());
            TU_MSG_HAS("rank 0");
            if (k < 2) TU_MSG_HAS(needle);
        }
        for (int i = 0; i < N_KEYS; i++) ck_assert_ptr_null(out[i].data);
    }
    TU_OK(cpar_broadcast_data(g, N_KEYS, bkeys, me == 0 ? in : NULL, dt, out));
    check_bcast_outputs(ctx, dt, 0, out);
    if (me == 0) free_bcast_inputs(ctx, host, in);
    return CPAR_OK;
}

START_TEST(test_broadcast_data_errors) { TU_OK(tu_spawn(1 + _i, rank_broadcast_data_errors, NULL)); }
END_TEST

/* ---- bad input ---------------------------------------------------------------------- */

enum { BAD_NULL, BAD_DIR, BAD_DTYPE, BAD_SHAPE, BAD_DIVISIBLE, BAD_SIZES, BAD_OVERLAP, BAD_DEVICE, BAD_BCAST,
       BAD_CASES };

static cpar_tensor on_device(const cpar_tensor *t, int device) {
    cpar_tensor u = *t;
    u.device = device;
    return u;
}

/* Elements [off, off + numel(shape)) of t as a tensor of that shape. */
static cpar_tensor sub(const cpar_tensor *t, int64_t off, int nd, const int64_t *shape) {
    return cpar_tensor_make((float *)t->data + off, t->dtype, nd, shape, t->device);
}

/* Every rank of a group of 3 makes the same bad calls; each is refused on the
 * spot (no communication) with a message naming the argument; nothing is
 * written and the group works afterwards. */
static cpar_status rank_bad_input(cpar_ctx *ctx, void *p) {
    int which = *(int *)p;
    cpar_group *g = cpar_world_group(ctx);
    int me = cpar_group_rank(g);
    ck_assert_int_eq(cpar_group_size(g), 3);
    int64_t s3x9[] = {3, 9}, s3x3[] = {3, 3}, s3x27[] = {3, 27}, s9x5[] = {9, 5}, s3x5[] = {3, 5}, s8x5[] = {8, 5};
    int64_t s3x10[] = {3, 10}, s7x5[] = {7, 5}, s9x3[] = {9, 3}, s200[] = {200};
    void *data = tu_random_host(CPAR_F32, 200, 77 + (uint64_t)me);
    cpar_tensor a = tu_upload(ctx, data, CPAR_F32, 2, s3x9);     /* [3,9] */
    cpar_tensor a10 = tu_upload(ctx, data, CPAR_F32, 2, s3x10);  /* [3,10] */
    cpar_tensor r9 = tu_upload(ctx, data, CPAR_F32, 2, s9x5);    /* [9,5] */
    cpar_tensor r3 = tu_upload(ctx, data, CPAR_F32, 2, s3x5);    /* [3,5] */
    cpar_tensor r7 = tu_upload(ctx, data, CPAR_F32, 2, s7x5);    /* [7,5] */
    cpar_tensor o3 = tu_alloc_poisoned(ctx, CPAR_F32, 2, s3x3), o9 = tu_alloc_poisoned(ctx, CPAR_F32, 2, s3x9);
    cpar_tensor o27 = tu_alloc_poisoned(ctx, CPAR_F32, 2, s3x27), p9 = tu_alloc_poisoned(ctx, CPAR_F32, 2, s9x5);
    cpar_tensor p3 = tu_alloc_poisoned(ctx, CPAR_F32, 2, s3x5), p8 = tu_alloc_poisoned(ctx, CPAR_F32, 2, s8x5);
    cpar_tensor q9 = tu_alloc_poisoned(ctx, CPAR_F32, 2, s9x3), h9 = tu_alloc_poisoned(ctx, CPAR_F16, 2, s3x9);
    cpar_tensor whole = tu_alloc_poisoned(ctx, CPAR_F32, 1, s200);
    float one = 1;
    cpar_tensor scalar = tu_upload(ctx, &one, CPAR_F32, 0, NULL);
    const cpar_dir F = CPAR_FWD, Bw = CPAR_BWD;
    int64_t neg[] = {3, -1, 7}, fours[] = {4, 4, 4}, twos[] = {2, 3, 3}, threes[] = {3, 3, 3};
    int64_t twelve[3], eight[3]; /* 3 rows from itself, 12 or 8 in all */
    for (int j = 0; j < 3; j++) {
        twelve[j] = j == (me + 1) % 3 ? 6 : 3;
        eight[j] = j == (me + 1) % 3 ? 2 : 3;
    }

    switch (which) {
    case BAD_NULL:
        TU_FAILS(cpar_copy_to_tp_region(NULL, &a, &o9, F), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_reduce_from_tp_region(NULL, &a, &o9, F), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_scatter_to_tp_region(NULL, &a, &o3, F), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_gather_from_tp_region(NULL, &a, &o27, F), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_scatter_to_sp_region(NULL, &r9, &p3, F), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_gather_from_sp_region(NULL, &r3, &p9, F, true, NULL), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_reduce_scatter_to_sp_region(NULL, &r9, &p3, F, NULL), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_all_gather_last_dim_from_tp_region(NULL, &a, &o27, F), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_reduce_scatter_last_dim_to_tp_region(NULL, &a, &o3, F), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_all_to_all(NULL, &r9, &p9, F, NULL, NULL), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_all_to_all_sp2hp(NULL, &a, &q9, F), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_all_to_all_hp2sp(NULL, &q9, &o9, F), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_copy_to_tp_region(g, NULL, &o9, F), CPAR_ERR_INVALID, "in is NULL");
        TU_FAILS(cpar_reduce_from_tp_region(g, &a, NULL, F), CPAR_ERR_INVALID, "out is NULL");
        TU_FAILS(cpar_scatter_to_tp_region(g, NULL, &o3, F), CPAR_ERR_INVALID, "in is NULL");
        TU_FAILS(cpar_gather_from_tp_region(g, &a, NULL, F), CPAR_ERR_INVALID, "out is NULL");
        TU_FAILS(cpar_scatter_to_sp_region(g, NULL, &p3, Bw), CPAR_ERR_INVALID, "in is NULL");
        TU_FAILS(cpar_gather_from_sp_region(g, &r3, NULL, F, true, NULL), CPAR_ERR_INVALID, "out is NULL");
        TU_FAILS(cpar_reduce_scatter_to_sp_region(g, NULL, &p3, F, NULL), CPAR_ERR_INVALID, "in is NULL");
        TU_FAILS(cpar_all_gather_last_dim_from_tp_region(g, &a, NULL, Bw), CPAR_ERR_INVALID, "out is NULL");
        TU_FAILS(cpar_reduce_scatter_last_dim_to_tp_region(g, NULL, &o3, F), CPAR_ERR_INVALID, "in is NULL");
        TU_FAILS(cpar_all_to_all(g, &r9, NULL, F, NULL, NULL), CPAR_ERR_INVALID, "out is NULL");
        TU_FAILS(cpar_all_to_all_sp2hp(g, NULL, &q9, F), CPAR_ERR_INVALID, "in is NULL");
        TU_FAILS(cpar_all_to_all_hp2sp(g, &q9, NULL, F), CPAR_ERR_INVALID, "out is NULL");
        break;
    case BAD_DIR:
        TU_FAILS(cpar_copy_to_tp_region(g, &a, &o9, (cpar_dir)2), CPAR_ERR_INVALID, "dir is 2");
        TU_FAILS(cpar_reduce_from_tp_region(g, &a, &o9, (cpar_dir)-1), CPAR_ERR_INVALID, "dir is -1");
        TU_FAILS(cpar_scatter_to_tp_region(g, &a, &o3, (cpar_dir)2), CPAR_ERR_INVALID, "dir");
        TU_FAILS(cpar_gather_from_tp_region(g, &a, &o27, (cpar_dir)2), CPAR_ERR_INVALID, "dir");
        TU_FAILS(cpar_scatter_to_sp_region(g, &r9, &p3, (cpar_dir)2), CPAR_ERR_INVALID, "dir");
        TU_FAILS(cpar_gather_from_sp_region(g, &r3, &p9, (cpar_dir)2, true, NULL), CPAR_ERR_INVALID, "dir");
        TU_FAILS(cpar_reduce_scatter_to_sp_region(g, &r9, &p3, (cpar_dir)2, NULL), CPAR_ERR_INVALID, "dir");
        TU_FAILS(cpar_all_gather_last_dim_from_tp_region(g, &a, &o27, (cpar_dir)2), CPAR_ERR_INVALID, "dir");
        TU_FAILS(cpar_reduce_scatter_last_dim_to_tp_region(g, &a, &o3, (cpar_dir)2), CPAR_ERR_INVALID, "dir");
        TU_FAILS(cpar_all_to_all(g, &r9, &p9, (cpar_dir)2, NULL, NULL), CPAR_ERR_INVALID, "dir");
        TU_FAILS(cpar_all_to_all_sp2hp(g, &a, &q9, (cpar_dir)2), CPAR_ERR_INVALID, "dir");
        TU_FAILS(cpar_all_to_all_hp2sp(g, &q9, &o9, (cpar_dir)2), CPAR_ERR_INVALID, "dir");
        break;
    case BAD_DTYPE: {
        TU_FAILS(cpar_copy_to_tp_region(g, &a, &h9, F), CPAR_ERR_INVALID, "out has dtype f16, expected f32");
        TU_FAILS(cpar_reduce_from_tp_region(g, &a, &h9, F), CPAR_ERR_INVALID, "out has dtype f16");
        TU_FAILS(cpar_gather_from_sp_region(g, &r3, &h9, F, true, NULL), CPAR_ERR_INVALID, "out has dtype f16");
        TU_FAILS(cpar_all_to_all(g, &a, &h9, F, threes, threes), CPAR_ERR_INVALID, "out has dtype f16");
        TU_FAILS(cpar_all_to_all_hp2sp(g, &a, &h9, Bw), CPAR_ERR_INVALID, "out has dtype f16");
        /* u8 moves but does not sum. */
        cpar_tensor u = tu_alloc_poisoned(ctx, CPAR_U8, 2, s3x9), u3 = tu_alloc_poisoned(ctx, CPAR_U8, 2, s3x3);
        TU_OK(cpar_copy_to_tp_region(g, &u, &u, F));
        TU_OK(cpar_scatter_to_tp_region(g, &u, &u3, F));
        TU_FAILS(cpar_copy_to_tp_region(g, &u, &u, Bw), CPAR_ERR_INVALID, "in has dtype u8");
        TU_FAILS(cpar_reduce_from_tp_region(g, &u, &u, F), CPAR_ERR_INVALID, "u8");
        TU_FAILS(cpar_reduce_scatter_last_dim_to_tp_region(g, &u, &u3, F), CPAR_ERR_INVALID, "u8");
        TU_FAILS(cpar_all_gather_last_dim_from_tp_region(g, &u, &u3, Bw), CPAR_ERR_INVALID, "u8");
        free_tensor(ctx, &u);
        free_tensor(ctx, &u3);
        break;
    }
    case BAD_SHAPE: /* the message gives the expected shape */
        TU_FAILS(cpar_copy_to_tp_region(g, &a, &o3, F), CPAR_ERR_INVALID, "out has shape [3,3], expected [3,9]");
        TU_FAILS(cpar_copy_to_tp_region(g, &a, &o3, Bw), CPAR_ERR_INVALID, "expected [3,9]");
        TU_FAILS(cpar_reduce_from_tp_region(g, &a, &o27, F), CPAR_ERR_INVALID, "expected [3,9]");
        TU_FAILS(cpar_scatter_to_tp_region(g, &a, &o9, F), CPAR_ERR_INVALID, "out has shape [3,9], expected [3,3]");
        TU_FAILS(cpar_scatter_to_tp_region(g, &o3, &o27, Bw), CPAR_ERR_INVALID, "expected [3,9]");
        TU_FAILS(cpar_gather_from_tp_region(g, &a, &o9, F), CPAR_ERR_INVALID, "expected [3,27]");
        TU_FAILS(cpar_gather_from_tp_region(g, &a, &o9, Bw), CPAR_ERR_INVALID, "expected [3,3]");
        TU_FAILS(cpar_scatter_to_sp_region(g, &r9, &p9, F), CPAR_ERR_INVALID, "expected [3,5]");
        TU_FAILS(cpar_scatter_to_sp_region(g, &r3, &p8, Bw), CPAR_ERR_INVALID, "expected [9,5]");
        TU_FAILS(cpar_gather_from_sp_region(g, &r3, &p8, F, true, NULL), CPAR_ERR_INVALID,
                 "out has shape [8,5], expected [9,5]");
        TU_FAILS(cpar_gather_from_sp_region(g, &r9, &p9, Bw, true, NULL), CPAR_ERR_INVALID, "expected [3,5]");
        TU_FAILS(cpar_gather_from_sp_region(g, &r9, &p9, Bw, false, NULL), CPAR_ERR_INVALID, "expected [3,5]");
        TU_FAILS(cpar_reduce_scatter_to_sp_region(g, &r9, &p9, F, NULL), CPAR_ERR_INVALID, "expected [3,5]");
        TU_FAILS(cpar_reduce_scatter_to_sp_region(g, &r3, &p8, Bw, NULL), CPAR_ERR_INVALID, "expected [9,5]");
        TU_FAILS(cpar_all_gather_last_dim_from_tp_region(g, &a, &o9, F), CPAR_ERR_INVALID, "expected [3,27]");
        TU_FAILS(cpar_all_gather_last_dim_from_tp_region(g, &a, &o9, Bw), CPAR_ERR_INVALID, "expected [3,3]");
        TU_FAILS(cpar_reduce_scatter_last_dim_to_tp_region(g, &a, &o27, F), CPAR_ERR_INVALID, "expected [3,3]");
        TU_FAILS(cpar_reduce_scatter_last_dim_to_tp_region(g, &a, &o3, Bw), CPAR_ERR_INVALID, "expected [3,27]");
        TU_FAILS(cpar_all_to_all(g, &r9, &p8, F, NULL, NULL), CPAR_ERR_INVALID, "expected [9,5]");
        TU_FAILS(cpar_all_to_all(g, &r9, &p3, F, twelve, NULL), CPAR_ERR_INVALID, "expected [12,5]");
        TU_FAILS(cpar_all_to_all_sp2hp(g, &a, &o9, F), CPAR_ERR_INVALID, "out has shape [3,9], expected [9,3]");
        TU_FAILS(cpar_all_to_all_sp2hp(g, &q9, &q9, Bw), CPAR_ERR_INVALID, "expected [3,9]");
        TU_FAILS(cpar_all_to_all_hp2sp(g, &q9, &q9, F), CPAR_ERR_INVALID, "expected [3,9]");
        TU_FAILS(cpar_all_to_all_hp2sp(g, &a, &o9, Bw), CPAR_ERR_INVALID, "expected [9,3]");
        TU_FAILS(cpar_copy_to_tp_region(g, &scalar, &scalar, F), CPAR_ERR_INVALID, "in is a scalar");
        TU_FAILS(cpar_all_to_all(g, &scalar, &scalar, F, NULL, NULL), CPAR_ERR_INVALID, "in is a scalar");
        TU_FAILS(cpar_all_to_all_sp2hp(g, &scalar, &o3, F), CPAR_ERR_INVALID, "in is a scalar");
        break;
    case BAD_DIVISIBLE: /* the message names the numbers */
        TU_FAILS(cpar_scatter_to_tp_region(g, &a10, &o3, F), CPAR_ERR_INVALID,
                 "in has last dim 10, not divisible by the group size 3");
        TU_FAILS(cpar_gather_from_tp_region(g, &a10, &o3, Bw), CPAR_ERR_INVALID, "last dim 10");
        TU_FAILS(cpar_reduce_scatter_last_dim_to_tp_region(g, &a10, &o3, F), CPAR_ERR_INVALID, "last dim 10");
        TU_FAILS(cpar_all_gather_last_dim_from_tp_region(g, &a10, &o3, Bw), CPAR_ERR_INVALID, "last dim 10");
        TU_FAILS(cpar_scatter_to_sp_region(g, &r7, &p3, F), CPAR_ERR_INVALID,
                 "in has 7 rows (dim 0), not divisible by the group size 3");
        TU_FAILS(cpar_gather_from_sp_region(g, &r7, &p3, Bw, true, NULL), CPAR_ERR_INVALID, "7 rows");
        TU_FAILS(cpar_gather_from_sp_region(g, &r7, &p3, Bw, false, NULL), CPAR_ERR_INVALID, "7 rows");
        TU_FAILS(cpar_reduce_scatter_to_sp_region(g, &r7, &p3, F, NULL), CPAR_ERR_INVALID, "7 rows");
        TU_FAILS(cpar_all_to_all(g, &r7, &p9, F, threes, NULL), CPAR_ERR_INVALID,
                 "in has 7 rows (dim 0), not divisible by the group size 3 (pass in_splits)");
        TU_FAILS(cpar_all_to_all(g, &r7, &p9, Bw, NULL, threes), CPAR_ERR_INVALID, "(pass out_splits)");
        TU_FAILS(cpar_all_to_all_sp2hp(g, &a10, &q9, F), CPAR_ERR_INVALID, "last dim 10 (the hidden size)");
        TU_FAILS(cpar_all_to_all_hp2sp(g, &a10, &q9, Bw), CPAR_ERR_INVALID, "last dim 10");
        TU_FAILS(cpar_all_to_all_hp2sp(g, &r7, &p3, F), CPAR_ERR_INVALID,
                 "in has 7 tokens (the product of all but the last dim), not divisible by the group size 3");
        TU_FAILS(cpar_all_to_all_sp2hp(g, &r7, &p3, Bw), CPAR_ERR_INVALID, "7 tokens");
        break;
    case BAD_SIZES: {
        int64_t self_bad[3] = {3, 3, 3};
        self_bad[me] = 2;          /* 2 rows from itself ... */
        self_bad[(me + 1) % 3] = 4; /* ... yet 9 in all */
        TU_FAILS(cpar_gather_from_sp_region(g, &r3, &p9, F, true, neg), CPAR_ERR_INVALID, "split_sizes[1] is -1");
        TU_FAILS(cpar_gather_from_sp_region(g, &r3, &p9, F, true, fours), CPAR_ERR_INVALID,
                 "in has 3 rows, expected split_sizes");
        TU_FAILS(cpar_gather_from_sp_region(g, &r9, &p3, Bw, true, fours), CPAR_ERR_INVALID,
                 "split_sizes add up to 12, expected in.shape[0] = 9");
        TU_FAILS(cpar_gather_from_sp_region(g, &r9, &p3, Bw, false, twos), CPAR_ERR_INVALID, "split_sizes add up to 8");
        TU_FAILS(cpar_reduce_scatter_to_sp_region(g, &r9, &p3, F, neg), CPAR_ERR_INVALID, "split_sizes[1] is -1");
        TU_FAILS(cpar_reduce_scatter_to_sp_region(g, &r9, &p3, F, twos), CPAR_ERR_INVALID, "split_sizes add up to 8");
        TU_FAILS(cpar_reduce_scatter_to_sp_region(g, &r3, &p9, Bw, fours), CPAR_ERR_INVALID, "split_sizes");
        TU_FAILS(cpar_all_to_all(g, &r9, &p9, F, threes, fours), CPAR_ERR_INVALID,
                 "in_splits add up to 12, expected in.shape[0] = 9");
        TU_FAILS(cpar_all_to_all(g, &r9, &p9, F, neg, threes), CPAR_ERR_INVALID, "out_splits[1] is -1");
        TU_FAILS(cpar_all_to_all(g, &r9, &p9, Bw, fours, threes), CPAR_ERR_INVALID, "out_splits add up to 12");
        TU_FAILS(cpar_all_to_all(g, &r9, &p9, F, self_bad, threes), CPAR_ERR_INVALID, "to this rank itself");
        TU_MSG_HAS("out_splits");
        TU_FAILS(cpar_all_to_all(g, &r9, &p9, Bw, threes, self_bad), CPAR_ERR_INVALID, "in_splits");
        break;
    }
    case BAD_OVERLAP: { /* views of one allocation */
        cpar_tensor w27 = sub(&whole, 0, 2, s3x9), w9 = sub(&whole, 18, 2, s3x3), w9b = sub(&whole, 1, 2, s3x9);
        TU_FAILS(cpar_scatter_to_tp_region(g, &w27, &w9, F), CPAR_ERR_INVALID, "out overlaps in");
        TU_FAILS(cpar_gather_from_tp_region(g, &w9, &w27, F), CPAR_ERR_INVALID, "out overlaps in");
        TU_FAILS(cpar_copy_to_tp_region(g, &w27, &w9b, F), CPAR_ERR_INVALID, "only out == in is allowed");
        TU_FAILS(cpar_copy_to_tp_region(g, &w27, &w9b, Bw), CPAR_ERR_INVALID, "overlaps");
        TU_FAILS(cpar_reduce_from_tp_region(g, &w27, &w9b, F), CPAR_ERR_INVALID, "overlaps");
        cpar_tensor wq = sub(&whole, 0, 2, s9x3), wr9 = sub(&whole, 0, 2, s9x5), wr3 = sub(&whole, 15, 2, s3x5);
        TU_FAILS(cpar_all_to_all_sp2hp(g, &w27, &wq, F), CPAR_ERR_INVALID, "out overlaps in");
        TU_FAILS(cpar_all_to_all_hp2sp(g, &wq, &w27, F), CPAR_ERR_INVALID, "out overlaps in");
        TU_FAILS(cpar_scatter_to_sp_region(g, &wr9, &wr3, F), CPAR_ERR_INVALID, "out overlaps in");
        TU_FAILS(cpar_reduce_scatter_to_sp_region(g, &wr9, &wr3, F, NULL), CPAR_ERR_INVALID, "out overlaps in");
        TU_FAILS(cpar_gather_from_sp_region(g, &wr3, &wr9, F, true, NULL), CPAR_ERR_INVALID, "out overlaps in");
        cpar_tensor wr8 = sub(&whole, 5, 2, s8x5);
        TU_FAILS(cpar_all_to_all(g, &wr9, &wr8, F, eight, NULL), CPAR_ERR_INVALID, "only out == in is allowed");
        break;
    }
    case BAD_DEVICE: { /* on a device that is not the context's */
        int here = cpar_device(ctx), wrong = here == CPAR_HOST ? 5 : CPAR_HOST;
        cpar_tensor wa = on_device(&a, wrong), wo = on_device(&o9, wrong), wq = on_device(&q9, wrong);
        TU_FAILS(cpar_copy_to_tp_region(g, &wa, &o9, F), CPAR_ERR_INVALID, "in is on");
        TU_FAILS(cpar_copy_to_tp_region(g, &a, &wo, F), CPAR_ERR_INVALID, "out is on");
        TU_FAILS(cpar_reduce_from_tp_region(g, &wa, &o9, Bw), CPAR_ERR_INVALID, "in is on");
        TU_FAILS(cpar_scatter_to_tp_region(g, &wa, &o3, F), CPAR_ERR_INVALID, "in is on");
        TU_FAILS(cpar_gather_from_tp_region(g, &a, &wo, Bw), CPAR_ERR_INVALID, "out is on");
        TU_FAILS(cpar_gather_from_sp_region(g, &wa, &o9, F, true, NULL), CPAR_ERR_INVALID, "in is on");
        TU_FAILS(cpar_all_to_all(g, &a, &wo, F, NULL, NULL), CPAR_ERR_INVALID, "out is on");
        TU_FAILS(cpar_all_to_all_sp2hp(g, &a, &wq, F), CPAR_ERR_INVALID, "out is on");
        TU_FAILS(cpar_all_to_all_hp2sp(g, &wq, &a, F), CPAR_ERR_INVALID, "in is on");
        break;
    }
    case BAD_BCAST: {
        cpar_tensor outs[2];
        const char *keys[] = {"a", NULL};
        TU_FAILS(cpar_broadcast_data(NULL, 1, bkeys, &a, CPAR_F32, outs), CPAR_ERR_INVALID, "group");
        TU_FAILS(cpar_broadcast_data(g, -1, bkeys, &a, CPAR_F32, outs), CPAR_ERR_INVALID, "nkeys is -1");
        TU_FAILS(cpar_broadcast_data(g, 1, NULL, &a, CPAR_F32, outs), CPAR_ERR_INVALID, "keys is NULL");
        TU_FAILS(cpar_broadcast_data(g, 2, keys, &a, CPAR_F32, outs), CPAR_ERR_INVALID, "keys[1] is NULL");
        TU_FAILS(cpar_broadcast_data(g, 1, bkeys, &a, CPAR_F32, NULL), CPAR_ERR_INVALID, "out is NULL");
        TU_FAILS(cpar_broadcast_data(g, 1, bkeys, &a, (cpar_dtype)99, outs), CPAR_ERR_INVALID, "dtype is 99");
        ck_assert_ptr_null(outs[0].data);
        break;
    }
    default: ck_abort_msg("no bad-input case %d", which);
    }

    /* Nothing was written, and the group still works. */
    cpar_tensor *outs[] = {&o3, &o9, &o27, &p9, &p3, &p8, &q9, &h9, &whole};
    for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++) {
        void *h = tu_download(ctx, outs[i]);
        for (int64_t e = 0; e < cpar_tensor_numel(outs[i]); e++)
            ck_assert_msg(isnan(tu_get(h, outs[i]->dtype, e)), "output %zu element %lld was written", i, (long long)e);
        free(h);
    }
    TU_OK(cpar_gather_from_tp_region(g, &a, &o27, F));
    float *got = tu_download(ctx, &o27);
    for (int j = 0; j < 3; j++) {
        float *xj = tu_random_host(CPAR_F32, 200, 77 + (uint64_t)j);
        for (int o = 0; o < 3; o++)
            for (int c = 0; c < 9; c++) ck_assert_float_eq(got[o * 27 + j * 9 + c], xj[o * 9 + c]);
        free(xj);
    }
    free(got);
    cpar_tensor *all[] = {&a, &a10, &r9, &r3, &r7, &o3, &o9, &o27, &p9, &p3, &p8, &q9, &h9, &whole, &scalar};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free_tensor(ctx, all[i]);
    free(data);
    return CPAR_OK;
}

START_TEST(test_bad_input) {
    int which = _i;
    TU_OK(tu_spawn(3, rank_bad_input, &which));
}
END_TEST

Suite *suite(void) {
    Suite *s = suite_create("mappings: region mappings, utilities, broadcast_data");
    for (int m = 0; m < N_MAPS; m++) map_first[m] = -1;
    for (int ci = 0; ci < N_CASES; ci++) {
        map_id m = cases[ci].map;
        if (map_first[m] < 0) map_first[m] = ci;
        map_count[m]++;
    }
    for (int m = 0; m < N_MAPS; m++) {
        TCase *tc = tcase_create(map_names[m]);
        tcase_add_loop_test(tc, test_mapping, 4 * m, 4 * m + 4); /* group sizes 1, 2, 3, 4 */
        tcase_set_timeout(tc, 120);
        suite_add_tcase(s, tc);
    }
    TCase *tc = tcase_create("subgroup");
    tcase_add_loop_test(tc, test_mapping_subgroup, 0, 2);
    tcase_set_timeout(tc, 240);
    suite_add_tcase(s, tc);
    tc = tcase_create("sp2hp");
    tcase_add_test(tc, test_sp2hp_example);
    tcase_add_loop_test(tc, test_sp2hp_roundtrip, 0, 4);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    tc = tcase_create("utilities");
    tcase_add_test(tc, test_divide);
    tcase_add_test(tc, test_vocab_range);
    tcase_add_test(tc, test_pad_vocab_size);
    tcase_add_test(tc, test_views);
    tcase_set_timeout(tc, 60);
    suite_add_tcase(s, tc);
    tc = tcase_create("broadcast_data");
    tcase_add_loop_test(tc, test_broadcast_data, 0, 4);
    tcase_add_loop_test(tc, test_broadcast_data_errors, 0, 4);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    tc = tcase_create("bad_input");
    tcase_add_loop_test(tc, test_bad_input, 0, BAD_CASES);
    tcase_set_timeout(tc, 60);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
