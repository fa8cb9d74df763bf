/* SPDX-License-Identifier: MIT */
/* tests/hostmp_prog.c — one rank of a multi-process job on the host backend
 * (ranks are processes; collectives through shared memory), run by
 * tests/test_hostmp.c under cparrun or with torchrun's variables:
 *
 *   hostmp_prog coll      every collective on the world and on split groups
 *                         (uneven sizes and splits), each checked exactly
 *                         against the rank-order reduction a 1-rank
 *                         computation gives (the threaded backend's bits);
 *                         then disagreeing calls fail alike on every rank
 *   hostmp_prog ring      a tp x cp grid (tp 2 when the world is even, unless
 *                         HOSTMP_TP=1): ring
 *                         attention forward and backward on the cp groups
 *                         (all four comm types, load balanced) against
 *                         attention over the whole sequence on one rank
 *   hostmp_prog arena     random allocations and frees (HOSTMP_ALLOC=tensor:
 *                         the arena), each buffer's pattern intact until it
 *                         is freed; then an exact all-reduce
 *   hostmp_prog late K    rank K joins an all-reduce after its peers' deadline:
 *                         they time out naming it; it then sees their failure
 *   hostmp_prog die K     rank K is killed (SIGKILL) while its peers are in an
 *                         all-reduce: they fail at once, naming it
 *   hostmp_prog abort K   rank K calls cpar_abort while its peers are in an
 *                         all-reduce: they (and its own next call) fail naming it
 *   hostmp_prog badarg K  rank K's all-reduce fails its own checks (a short
 *                         out) and it stays alive: its peers fail at once
 *                         naming it and its message
 *
 * HOSTMP_ALLOC picks where the buffers live: heap (default; collectives
 * stage through the segment), tensor (cpar_tensor_alloc: the rank's arena,
 * read by the peers in place), mixed (tensor on even ranks only) or noarena1
 * (tensor everywhere, but rank 1 runs without an arena: CPAR_HOST_ARENA=0,
 * so no rank can map every peer's and everything stages).
 *
 * Prints "rank R ok" (coll, ring) or "rank R: <status>: <message>" (faults).
 * Exit status: 0 when every check passed, 1 when a cpar call failed
 * unexpectedly, 2 when a result was wrong. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "cpar.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define RANK_PROG "hostmp_prog"
#include "rank_prog.h"

static float fval(uint64_t seed, int64_t i) { return (float)value(seed, i); }

/* Where buffers come from (HOSTMP_ALLOC): "heap" (malloc: collectives stage
 * through the segment), "tensor" (cpar_tensor_alloc: large ones lie in the
 * rank's arena, which the peers read in place), "mixed" (tensor on even
 * ranks, heap on odd: the members disagree, so everything stages). */
static cpar_ctx *alloc_ctx;
static bool alloc_tensor;

static void *alloc(size_t bytes) {
    void *p = NULL;
    if (alloc_tensor) {
        int64_t shape[1] = {(int64_t)(bytes ? bytes : 1)};
        cpar_tensor t;
        if (cpar_tensor_alloc(alloc_ctx, CPAR_U8, 1, shape, &t) == CPAR_OK) p = t.data;
    } else {
        p = malloc(bytes ? bytes : 1);
    }
    if (!p) abort();
    memset(p, 0xA5, bytes); /* poison: an unwritten element fails the checks */
    return p;
}

static void release(void *p) {
    cpar_tensor t = cpar_tensor_make(p, CPAR_U8, 0, NULL, CPAR_HOST);
    if (alloc_tensor) cpar_tensor_free(alloc_ctx, &t);
    else free(p);
}

static cpar_tensor t1(void *data, cpar_dtype dt, int64_t n) {
    int64_t shape[1] = {n};
    return cpar_tensor_make(data, dt, 1, shape, CPAR_HOST);
}

static cpar_tensor t2(void *data, cpar_dtype dt, int64_t rows, int64_t cols) {
    int64_t shape[2] = {rows, cols};
    return cpar_tensor_make(data, dt, 2, shape, CPAR_HOST);
}

/* ---- collectives on one group, exact against rank-order references -------- */

static int check_group(cpar_ctx *ctx, cpar_group *g, uint64_t seed, int64_t big) {
    int n = cpar_group_size(g), r = cpar_group_rank(g);
    /* all-reduce, f32 sum, an element count no group size divides; the
     * expected value sums in rank order in fp32, as every backend does */
    int64_t counts[2] = {37 * n + 5, big};
    for (int c = 0; c < 2; c++) {
        int64_t N = counts[c];
        float *in = alloc((size_t)N * 4), *out = alloc((size_t)N * 4);
        for (int64_t i = 0; i < N; i++) in[i] = fval(seed + (uint64_t)r, i);
        cpar_tensor ti = t1(in, CPAR_F32, N), to = t1(out, CPAR_F32, N);
        TRY(cpar_all_reduce(g, &ti, &to, CPAR_SUM));
        for (int64_t i = 0; i < N; i++) {
            float acc = fval(seed, i);
            for (int m = 1; m < n; m++) acc += fval(seed + (uint64_t)m, i);
            CHECK(memcmp(&acc, &out[i], 4) == 0, "all_reduce f32 (%lld elements) [%lld] = %.9g, expected %.9g",
                  (long long)N, (long long)i, out[i], acc);
        }
        /* in place, max */
        TRY(cpar_all_reduce(g, &ti, &ti, CPAR_MAX));
        for (int64_t i = 0; i < N; i++) {
            float mx = fval(seed, i);
            for (int m = 1; m < n; m++) mx = fmaxf(mx, fval(seed + (uint64_t)m, i));
            CHECK(in[i] == mx, "all_reduce in place max [%lld] = %g, expected %g", (long long)i, in[i], mx);
        }
        release(in), release(out);
    }
    /* all-reduce, bf16 sum: fp32 accumulation in rank order, then one rounding */
    {
        int64_t N = 53 * n + 3;
        float *f = alloc((size_t)N * 4), *acc = alloc((size_t)N * 4);
        uint16_t *in = alloc((size_t)N * 2), *out = alloc((size_t)N * 2), *want = alloc((size_t)N * 2);
        uint16_t *peer = alloc((size_t)N * 2);
        cpar_tensor tf = t1(f, CPAR_F32, N), tp = t1(peer, CPAR_BF16, N), ta = t1(acc, CPAR_F32, N);
        for (int m = 0; m < n; m++) {
            for (int64_t i = 0; i < N; i++) f[i] = 4.0f * fval(seed + 100 + (uint64_t)m, i);
            TRY(cpar_cast(ctx, &tf, &tp));
            if (m == r) memcpy(in, peer, (size_t)N * 2);
            TRY(cpar_cast(ctx, &tp, &tf));
            for (int64_t i = 0; i < N; i++) acc[i] = m ? acc[i] + f[i] : f[i];
        }
        cpar_tensor tw = t1(want, CPAR_BF16, N);
        TRY(cpar_cast(ctx, &ta, &tw));
        cpar_tensor ti = t1(in, CPAR_BF16, N), to = t1(out, CPAR_BF16, N);
        TRY(cpar_all_reduce(g, &ti, &to, CPAR_SUM));
        CHECK(memcmp(out, want, (size_t)N * 2) == 0, "all_reduce bf16 differs from the rank-order fp32 sum");
        release(f), release(acc), release(in), release(out), release(want), release(peer);
    }
    /* all-gather with uneven sizes: rank m has m + 1 rows of 3 (and a share of big) */
    {
        int64_t sizes[256], total = 0, C = 3;
        for (int m = 0; m < n; m++) sizes[m] = m + 1 + big / (3 * (m + 1)), total += sizes[m];
        int32_t *in = alloc((size_t)sizes[r] * C * 4), *out = alloc((size_t)total * C * 4);
        for (int64_t i = 0; i < sizes[r] * C; i++) in[i] = r * 1000003 + (int32_t)i;
        cpar_tensor ti = t2(in, CPAR_I32, sizes[r], C), to = t2(out, CPAR_I32, total, C);
        TRY(cpar_all_gather(g, &ti, &to, sizes));
        int64_t k = 0;
        for (int m = 0; m < n; m++)
            for (int64_t i = 0; i < sizes[m] * C; i++, k++)
                CHECK(out[k] == m * 1000003 + (int32_t)i, "all_gather [%lld] = %d, expected %d", (long long)k, out[k],
                      m * 1000003 + (int32_t)i);
        release(in), release(out);
    }
    /* reduce-scatter with uneven sizes, f32 sum in rank order */
    {
        int64_t sizes[256], total = 0, off = 0, C = 5;
        for (int m = 0; m < n; m++) sizes[m] = (m * 7) % 4 + (m == 0 ? big / 5 : 0), total += sizes[m];
        for (int m = 0; m < r; m++) off += sizes[m];
        float *in = alloc((size_t)total * C * 4), *out = alloc((size_t)(sizes[r] ? sizes[r] : 1) * C * 4);
        for (int64_t i = 0; i < total * C; i++) in[i] = fval(seed + 200 + (uint64_t)r, i);
        cpar_tensor ti = t2(in, CPAR_F32, total, C), to = t2(out, CPAR_F32, sizes[r], C);
        TRY(cpar_reduce_scatter(g, &ti, &to, CPAR_SUM, sizes));
        for (int64_t i = 0; i < sizes[r] * C; i++) {
            float acc = fval(seed + 200, off * C + i);
            for (int m = 1; m < n; m++) acc += fval(seed + 200 + (uint64_t)m, off * C + i);
            CHECK(memcmp(&acc, &out[i], 4) == 0, "reduce_scatter [%lld] = %.9g, expected %.9g", (long long)i, out[i], acc);
        }
        release(in), release(out);
    }
    /* all-to-all with uneven splits: rank s sends (s + d) % 3 + (s == d) rows to d (and a share of big to
     * its successor) */
    {
        int64_t ins[256], outs[256], tin = 0, tout = 0, C = 2;
#define SPLIT(s, d) ((int64_t)(((s) + (d)) % 3 + ((s) == (d)) + ((d) == ((s) + 1) % n ? big / (2 * ((s) + 1)) : 0)))
        for (int d = 0; d < n; d++) ins[d] = SPLIT(r, d), tin += ins[d];
        for (int s = 0; s < n; s++) outs[s] = SPLIT(s, r), tout += outs[s];
        int64_t *in = alloc((size_t)tin * C * 8), *out = alloc((size_t)(tout ? tout : 1) * C * 8);
        int64_t k = 0;
        for (int d = 0; d < n; d++)
            for (int64_t i = 0; i < ins[d] * C; i++) in[k++] = ((int64_t)r << 40) + ((int64_t)d << 20) + i;
        cpar_tensor ti = t2(in, CPAR_I64, tin, C), to = t2(out, CPAR_I64, tout, C);
        TRY(cpar_all_to_all_single(g, &ti, &to, outs, ins));
        k = 0;
        for (int s = 0; s < n; s++)
            for (int64_t i = 0; i < outs[s] * C; i++, k++)
                CHECK(out[k] == ((int64_t)s << 40) + ((int64_t)r << 20) + i, "all_to_all [%lld] from rank %d",
                      (long long)k, s);
#undef SPLIT
        release(in), release(out);
    }
    /* broadcast from the last rank */
    {
        int64_t N = 11 + big;
        float *buf = alloc((size_t)N * 4);
        if (r == n - 1)
            for (int64_t i = 0; i < N; i++) buf[i] = fval(seed + 300, i);
        cpar_tensor tb = t1(buf, CPAR_F32, N);
        TRY(cpar_broadcast(g, &tb, n - 1));
        for (int64_t i = 0; i < N; i++) CHECK(buf[i] == fval(seed + 300, i), "broadcast [%lld]", (long long)i);
        release(buf);
    }
    /* ring shift by one, then by -1 (point-to-point through the mailboxes) */
    for (int shift = 1; shift >= -1; shift -= 2) {
        int64_t N = 17 + big;
        float *in = alloc((size_t)N * 4), *out = alloc((size_t)N * 4);
        for (int64_t i = 0; i < N; i++) in[i] = fval(seed + 400 + (uint64_t)r, i);
        cpar_tensor ti = t1(in, CPAR_F32, N), to = t1(out, CPAR_F32, N);
        TRY(cpar_ring_shift(g, &ti, &to, shift));
        int from = ((r - shift) % n + n) % n;
        for (int64_t i = 0; i < N; i++)
            CHECK(out[i] == fval(seed + 400 + (uint64_t)from, i), "ring_shift %d [%lld]", shift, (long long)i);
        release(in), release(out);
    }
    TRY(cpar_barrier(g));
    return 0;
}

/* Members that disagree all fail alike, with CPAR_ERR_INVALID naming both calls. */
static int check_mismatch(cpar_group *g) {
    int n = cpar_group_size(g), r = cpar_group_rank(g);
    if (n < 2) return 0;
    float in[8] = {0}, out[8];
    int64_t N = r == 1 ? 8 : 7;
    cpar_tensor ti = t1(in, CPAR_F32, N), to = t1(out, CPAR_F32, N);
    cpar_status st = cpar_all_reduce(g, &ti, &to, CPAR_SUM);
    CHECK(st == CPAR_ERR_INVALID && strstr(cpar_thread_last_error(), "disagree on the count"),
          "mismatched all_reduce gave %s: %s", cpar_status_string(st), cpar_thread_last_error());
    /* a receive of another size is refused by the receiver (rank 0), and its
     * sender (the last rank) hears of it */
    cpar_tensor ts = t1(in, CPAR_F32, 4), tr = t1(out, CPAR_F32, r == 0 ? 5 : 4);
    st = cpar_sendrecv(g, &ts, (r + 1) % n, &tr, (r - 1 + n) % n);
    if (r == 0 || r == n - 1)
        CHECK(st == CPAR_ERR_INVALID, "sendrecv of the wrong size gave %s: %s", cpar_status_string(st),
              cpar_thread_last_error());
    /* the same counts from different calls (issue 29): sp2hp forward on rank
     * 1, backward (its shapes swapped) on the others; T = H = n, so [1, n]
     * <-> [n, 1] on every rank */
    {
        float a[64], b[64];
        int64_t sp[2] = {1, n}, hp[2] = {n, 1};
        cpar_tensor x = cpar_tensor_make(a, CPAR_F32, 2, r == 1 ? sp : hp, CPAR_HOST);
        cpar_tensor y = cpar_tensor_make(b, CPAR_F32, 2, r == 1 ? hp : sp, CPAR_HOST);
        for (int i = 0; i < n; i++) a[i] = (float)i;
        st = n <= 64 ? cpar_all_to_all_sp2hp(g, &x, &y, r == 1 ? CPAR_FWD : CPAR_BWD) : CPAR_ERR_INVALID;
        CHECK(st == CPAR_ERR_INVALID && strstr(cpar_thread_last_error(), "disagree on the call") &&
                  strstr(cpar_thread_last_error(), "sp2hp(fwd, f32)") && strstr(cpar_thread_last_error(), "sp2hp(bwd, f32)"),
              "sp2hp forward against backward gave %s: %s", cpar_status_string(st), cpar_thread_last_error());
    }
    /* the group still works */
    ti = t1(in, CPAR_F32, 8), to = t1(out, CPAR_F32, 8);
    for (int i = 0; i < 8; i++) in[i] = (float)(r + i);
    TRY(cpar_all_reduce(g, &ti, &to, CPAR_SUM));
    for (int i = 0; i < 8; i++) CHECK(out[i] == (float)(n * (n - 1) / 2 + n * i), "all_reduce after a mismatch");
    return 0;
}

static int run_coll(cpar_ctx *ctx) {
    cpar_group *w = cpar_world_group(ctx);
    int n = cpar_world_size(ctx);
    const char *b = getenv("HOSTMP_BIG");
    int64_t big = b ? atoll(b) : 0;
    if (check_group(ctx, w, 1, big)) return 2;
    /* even and odd ranks, in reverse order within each */
    cpar_group *half = NULL, *none = NULL;
    TRY(cpar_group_split(w, rank % 2, -rank, &half));
    CHECK(cpar_group_size(half) == (n + 1 - rank % 2) / 2, "split size %d", cpar_group_size(half));
    CHECK(cpar_group_world_rank(half, 0) == n - 1 - ((n - 1) % 2 != rank % 2), "split order: first is world rank %d",
          cpar_group_world_rank(half, 0));
    if (check_group(ctx, half, 7, big / 3)) return 2;
    /* a split where only rank 0 stays out */
    TRY(cpar_group_split(w, rank == 0 ? CPAR_SPLIT_NOCOLOR : 0, rank, &none));
    CHECK((rank == 0) == (none == NULL), "NOCOLOR split");
    if (none && check_group(ctx, none, 11, 0)) return 2;
    /* a split of a split */
    if (cpar_group_size(half) > 1) {
        cpar_group *pair = NULL;
        TRY(cpar_group_split(half, cpar_group_rank(half) / 2, 0, &pair));
        if (check_group(ctx, pair, 13, 5)) return 2;
        TRY(cpar_group_destroy(pair));
    }
    if (check_mismatch(w)) return 2;
    if (none) TRY(cpar_group_destroy(none));
    TRY(cpar_group_destroy(half));
    cpar_comm_stats s;
    TRY(cpar_group_stats(w, &s));
    CHECK(s.kind[CPAR_COLL_ALL_REDUCE].calls >= 5, "stats count %llu all-reduces",
          (unsigned long long)s.kind[CPAR_COLL_ALL_REDUCE].calls);
    return 0;
}

/* ---- the arena under churn ------------------------------------------------- */

/* Random allocations (most in the arena, some on the heap) and frees in
 * random order, each buffer filled with its own pattern and checked before
 * it is freed: blocks that overlapped, or memory the arena handed out twice,
 * would break a pattern. Then a collective on buffers the churn left. */
static int run_arena(cpar_ctx *ctx) {
    enum { SLOTS = 48 };
    uint8_t *buf[SLOTS] = {0};
    size_t len[SLOTS] = {0};
    uint64_t tag[SLOTS] = {0}, z = 0x2545f4914f6cdd1dull + (uint64_t)rank;
    for (int it = 0; it < 4000; it++) {
        z ^= z << 13, z ^= z >> 7, z ^= z << 17;
        int k = (int)(z % SLOTS);
        if (buf[k]) {
            for (size_t i = 0; i < len[k]; i++)
                CHECK(buf[k][i] == (uint8_t)(tag[k] + i * 7), "buffer %d (%zu bytes) byte %zu was overwritten", k,
                      len[k], i);
            release(buf[k]);
            buf[k] = NULL;
            continue;
        }
        len[k] = (size_t)(z >> 20) % (z % 5 ? 300000 : 20000) + 1;
        buf[k] = alloc(len[k]);
        tag[k] = (uint64_t)it;
        for (size_t i = 0; i < len[k]; i++) buf[k][i] = (uint8_t)(tag[k] + i * 7);
    }
    /* every buffer still holds its pattern */
    for (int k = 0; k < SLOTS; k++)
        for (size_t i = 0; buf[k] && i < len[k]; i++)
            CHECK(buf[k][i] == (uint8_t)(tag[k] + i * 7), "buffer %d byte %zu was overwritten", k, i);
    /* an all-reduce on buffers allocated after the churn */
    int64_t N = 100003;
    float *in = alloc((size_t)N * 4), *out = alloc((size_t)N * 4);
    for (int64_t i = 0; i < N; i++) in[i] = fval(31 + (uint64_t)rank, i);
    cpar_tensor ti = t1(in, CPAR_F32, N), to = t1(out, CPAR_F32, N);
    TRY(cpar_all_reduce(cpar_world_group(ctx), &ti, &to, CPAR_SUM));
    for (int64_t i = 0; i < N; i++) {
        float acc = fval(31, i);
        for (int m = 1; m < cpar_world_size(ctx); m++) acc += fval(31 + (uint64_t)m, i);
        CHECK(memcmp(&acc, &out[i], 4) == 0, "all_reduce after the churn [%lld] = %.9g, expected %.9g", (long long)i,
              out[i], acc);
    }
    release(in), release(out);
    for (int k = 0; k < SLOTS; k++)
        if (buf[k]) release(buf[k]);
    return 0;
}

/* ---- ring attention on the cp groups against one rank ---------------------- */

static int run_ring(cpar_ctx *ctx) {
    int n = cpar_world_size(ctx);
    const char *tp = getenv("HOSTMP_TP"); /* tp 1 asked for: cp is the world */
    cpar_grid_config gc = {.tp = tp && !strcmp(tp, "1") ? 1 : n % 2 == 0 ? 2 : 1};
    gc.cp = n / gc.tp;
    TRY(cpar_grid_init(ctx, &gc));
    cpar_group *cp = cpar_grid_group(ctx, CPAR_GROUP_CP);
    int P = cpar_group_size(cp);
    const int64_t B = 1, Hh = 2 * P, S = 8 * P, D = 8; /* heads divisible by cp: the all-to-all schemes */
    int64_t full[4] = {B, Hh, S, D}, loc[4] = {B, Hh, S / P, D}, lfull[3] = {B, Hh, S}, lloc[3] = {B, Hh, S / P};
    size_t nf = (size_t)(B * Hh * S * D), nl = nf / (size_t)P;
    float *q = alloc(nf * 4), *k = alloc(nf * 4), *v = alloc(nf * 4), *o = alloc(nf * 4), *dout = alloc(nf * 4);
    float *lse = alloc(nf / (size_t)D * 4), *dq = alloc(nf * 4), *dk = alloc(nf * 4), *dv = alloc(nf * 4);
    for (size_t i = 0; i < nf; i++)
        q[i] = fval(21, (int64_t)i), k[i] = fval(22, (int64_t)i), v[i] = fval(23, (int64_t)i), dout[i] = fval(24, (int64_t)i);
    cpar_tensor Q = cpar_tensor_make(q, CPAR_F32, 4, full, CPAR_HOST), K = cpar_tensor_make(k, CPAR_F32, 4, full, CPAR_HOST);
    cpar_tensor V = cpar_tensor_make(v, CPAR_F32, 4, full, CPAR_HOST), O = cpar_tensor_make(o, CPAR_F32, 4, full, CPAR_HOST);
    cpar_tensor DO = cpar_tensor_make(dout, CPAR_F32, 4, full, CPAR_HOST);
    cpar_tensor L = cpar_tensor_make(lse, CPAR_F32, 3, lfull, CPAR_HOST);
    cpar_tensor DQ = cpar_tensor_make(dq, CPAR_F32, 4, full, CPAR_HOST), DK = cpar_tensor_make(dk, CPAR_F32, 4, full, CPAR_HOST);
    cpar_tensor DV = cpar_tensor_make(dv, CPAR_F32, 4, full, CPAR_HOST);
    TRY(cpar_attention_forward(ctx, &Q, &K, &V, true, 0.f, &O, &L));
    TRY(cpar_attention_backward(ctx, &Q, &K, &V, &O, &DO, &L, true, 0.f, &DQ, &DK, &DV));
    /* this rank's shards of inputs and references */
    cpar_tensor *fulls[] = {&Q, &K, &V, &DO, &O, &DQ, &DK, &DV};
    float *sh[8];
    cpar_tensor S8[8];
    for (int i = 0; i < 8; i++) {
        sh[i] = alloc(nl * 4);
        S8[i] = cpar_tensor_make(sh[i], CPAR_F32, 4, loc, CPAR_HOST);
        TRY(cpar_cp_shard(cp, fulls[i], 2, true, &S8[i]));
    }
    float *ro = alloc(nl * 4), *rl = alloc(nl / (size_t)D * 4), *rq = alloc(nl * 4), *rk = alloc(nl * 4), *rv = alloc(nl * 4);
    cpar_tensor RO = cpar_tensor_make(ro, CPAR_F32, 4, loc, CPAR_HOST), RL = cpar_tensor_make(rl, CPAR_F32, 3, lloc, CPAR_HOST);
    cpar_tensor RQ = cpar_tensor_make(rq, CPAR_F32, 4, loc, CPAR_HOST), RK = cpar_tensor_make(rk, CPAR_F32, 4, loc, CPAR_HOST);
    cpar_tensor RV = cpar_tensor_make(rv, CPAR_F32, 4, loc, CPAR_HOST);
    cpar_cp_comm_type how[4] = {CPAR_CP_P2P, CPAR_CP_ALL_GATHER, CPAR_CP_A2A, CPAR_CP_A2A_P2P};
    for (int h = 0; h < 4; h++) { /* a2a+p2p: inner groups of 2 where cp is even (split in this process job) */
        cpar_ring_attention_config rc = {.causal = true, .load_balance = true, .comm_type = how[h],
                                         .a2a_size = how[h] == CPAR_CP_A2A_P2P ? (P % 2 ? P : 2) : 0};
        TRY(cpar_ring_attention_forward(cp, &rc, &S8[0], &S8[1], &S8[2], &RO, &RL));
        TRY(cpar_ring_attention_backward(cp, &rc, &S8[0], &S8[1], &S8[2], &RO, &S8[3], &RL, &RQ, &RK, &RV));
        const float *got[4] = {ro, rq, rk, rv}, *want[4] = {sh[4], sh[5], sh[6], sh[7]};
        static const char *const names[4] = {"out", "dq", "dk", "dv"};
        for (int t = 0; t < 4; t++)
            for (size_t i = 0; i < nl; i++)
                CHECK(fabsf(got[t][i] - want[t][i]) <= 2e-5f * (1.f + fabsf(want[t][i])),
                      "ring attention (comm type %d) %s[%zu] = %.8g, one rank gives %.8g", h, names[t], i, got[t][i],
                      want[t][i]);
    }
    float *bufs[] = {q, k, v, o, dout, lse, dq, dk, dv, ro, rl, rq, rk, rv};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) release(bufs[i]);
    for (int i = 0; i < 8; i++) release(sh[i]);
    return 0;
}

/* ---- faults ---------------------------------------------------------------- */

static int run_fault(cpar_ctx *ctx, const char *mode, int k) {
    cpar_group *w = cpar_world_group(ctx);
    int64_t N = 64 << 10; /* big enough for the arena */
    float *in = alloc((size_t)N * 4), *out = alloc((size_t)N * 4);
    for (int64_t i = 0; i < N; i++) in[i] = (float)i;
    cpar_tensor ti = t1(in, CPAR_F32, N), to = t1(out, CPAR_F32, N);
    TRY(cpar_all_reduce(w, &ti, &to, CPAR_SUM)); /* everyone is up */
    if (rank == k && !strcmp(mode, "badarg")) { /* its own checks refuse the call; it stays alive */
        cpar_tensor short_out = t1(out, CPAR_F32, N - 1);
        cpar_status st = cpar_all_reduce(w, &ti, &short_out, CPAR_SUM);
        printf("rank %d: %s: %s\n", rank, cpar_status_string(st), st == CPAR_OK ? "" : cpar_thread_last_error());
        struct timespec ts = {5, 0};
        nanosleep(&ts, NULL);
        release(in), release(out);
        return st == CPAR_OK ? 0 : 1;
    }
    if (rank == k) {
        struct timespec ts = {0, 300 * 1000000L};
        if (strcmp(mode, "late")) nanosleep(&ts, NULL); /* the peers are inside the all-reduce by now */
        if (!strcmp(mode, "die")) raise(SIGKILL);
        if (!strcmp(mode, "abort")) TRY(cpar_abort(ctx));
        ts = (struct timespec){cpar_timeout_ms(ctx) / 1000 + 1, 0};
        if (!strcmp(mode, "late")) nanosleep(&ts, NULL);
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    cpar_status st = cpar_all_reduce(w, &ti, &to, CPAR_SUM);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const long ms = (long)(t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000;
    printf("rank %d: %s: %s (after %ld ms)\n", rank, cpar_status_string(st),
           st == CPAR_OK ? "" : cpar_thread_last_error(), ms);
    release(in), release(out);
    return st == CPAR_OK ? 0 : 1;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "coll";
    int k = argc > 2 ? atoi(argv[2]) : -1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *how = getenv("HOSTMP_ALLOC"), *r = getenv("RANK");
    if (how && !strcmp(how, "noarena1") && r && !strcmp(r, "1")) setenv("CPAR_HOST_ARENA", "0", 1);
    cpar_init_config cfg = {.backend = CPAR_BACKEND_HOST};
    cpar_ctx *ctx = NULL;
    TRY(cpar_init_from_env(&cfg, &ctx));
    rank = cpar_rank(ctx);
    alloc_ctx = ctx;
    alloc_tensor = how && (!strcmp(how, "tensor") || !strcmp(how, "noarena1") || (!strcmp(how, "mixed") && rank % 2 == 0));
    int rc;
    if (!strcmp(mode, "coll")) rc = run_coll(ctx);
    else if (!strcmp(mode, "ring")) rc = run_ring(ctx);
    else if (!strcmp(mode, "arena")) rc = run_arena(ctx);
    else if (!strcmp(mode, "late") || !strcmp(mode, "die") || !strcmp(mode, "abort") || !strcmp(mode, "badarg"))
        rc = run_fault(ctx, mode, k);
    else {
        fprintf(stderr, "hostmp_prog: unknown mode \"%s\" (coll, ring, arena, late K, die K, abort K, badarg K)\n", mode);
        rc = 2;
    }
    if (rc == 0 && (!strcmp(mode, "coll") || !strcmp(mode, "ring") || !strcmp(mode, "arena")))
        printf("rank %d ok\n", rank);
    TRY(cpar_finalize(ctx));
    return rc;
}
