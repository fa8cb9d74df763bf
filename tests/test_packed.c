/* SPDX-License-Identifier: MIT */
/* test_packed.c — context-parallel sharding of packed sequences (cpar.h §12,
 * THD: cpar_cp_shard_packed, cpar_cp_unshard_packed, cpar_cp_packed_indices).
 *
 * Packings of uneven documents at cp 1..4: lengths 2cp (the shortest a
 * document can be), 6cp, 4cp, 10cp; a single long document; real lengths
 * padded (cu_seqlens_padded) to the next multiple of 2cp, one padded beyond
 * it, one empty document; 300 documents, a third of them empty (more than
 * one device launch carries). The reference walks the GLOBAL rows: row g of
 * document i at offset o lies in chunk q = o / c (c = padded length / 2cp),
 * owned by rank q (q < cp) or 2cp-1-q in slot 1, at local row cu_padded[i]/cp
 * + slot c + o % c — the inverse of how the library walks. Every local row is
 * filled exactly once; the index maps of all ranks form a permutation of the
 * packed rows. Shards of random data (f32, bf16, i64, u8; the sequence at
 * dim 0, dim 2 of [b, h, t, d], the last dim after an outer dim) from host
 * and device wholes into poisoned device and host shards, bit for bit;
 * unshard restores the whole bit for bit with exactly one all-gather of
 * (cp-1)/cp of it and no other collective. Device-to-device shards and every
 * unshard run the reorder kernel (cpar_dev_packed_reorder) on the sim and
 * nccl-sim builds, host-side ones the pitched copies; the row sizes take
 * 1-, 8- and 16-byte words, and the padded packing has an empty document.
 * Bad input for every function, each message naming the argument (the
 * failing document by number). */
#include "testutil.h"

#include "packed.h"

/* ---- shard / unshard / indices ------------------------------------------------------------ */

typedef struct {
    packing q;
    cpar_dtype dt;
    int ndim, seq_dim; /* seq_dim as passed (may be negative) */
    int64_t shape[4];  /* full shape */
    void *full;        /* host, random */
    int64_t *idx[4];   /* each rank's index map, for the permutation check */
} pk_case;

static cpar_status rank_packed(cpar_ctx *ctx, void *arg) {
    pk_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int P = cpar_group_size(g), r = cpar_group_rank(g);
    int sd = c->seq_dim < 0 ? c->seq_dim + c->ndim : c->seq_dim;
    cpar_packed_seqs seqs = seqs_of(&c->q);
    int64_t S = c->shape[sd], L = S / P, outer = 1, inner = 1, lshape[4];
    for (int i = 0; i < sd; i++) outer *= c->shape[i];
    for (int i = sd + 1; i < c->ndim; i++) inner *= c->shape[i];
    memcpy(lshape, c->shape, sizeof lshape);
    lshape[sd] = L;
    size_t es = cpar_dtype_size(c->dt), nl = (size_t)(outer * L * inner);

    /* the reference shard, from the global rows this rank owns */
    char *want = malloc(nl * es + 1);
    int *filled = calloc((size_t)L + 1, sizeof(int));
    int64_t *want_idx = malloc(sizeof(int64_t) * (size_t)(L + 1));
    for (int64_t gr = 0; gr < S; gr++) {
        int own;
        int64_t l;
        owner_of(&c->q, P, gr, &own, &l);
        if (own != r) continue;
        ck_assert(l >= 0 && l < L);
        filled[l]++;
        want_idx[l] = gr;
        for (int64_t o = 0; o < outer; o++)
            memcpy(want + (size_t)((o * L + l) * inner) * es, (char *)c->full + (size_t)((o * S + gr) * inner) * es,
                   (size_t)inner * es);
    }
    for (int64_t l = 0; l < L; l++) ck_assert_msg(filled[l] == 1, "reference: local row %lld filled %d times", (long long)l, filled[l]);

    /* the index map */
    c->idx[r] = malloc(sizeof(int64_t) * (size_t)(L + 1));
    for (int64_t l = 0; l < L; l++) c->idx[r][l] = -7;
    TU_OK(cpar_cp_packed_indices(&seqs, P, r, c->idx[r], L));
    for (int64_t l = 0; l < L; l++)
        ck_assert_msg(c->idx[r][l] == want_idx[l], "%s cp %d rank %d: index of local row %lld is %lld, expected %lld",
                      c->q.name, P, r, (long long)l, (long long)c->idx[r][l], (long long)want_idx[l]);

    /* host whole -> poisoned device shard; device whole -> poisoned host shard */
    cpar_tensor fh = cpar_tensor_make(c->full, c->dt, c->ndim, c->shape, CPAR_HOST);
    cpar_tensor fd = tu_upload(ctx, c->full, c->dt, c->ndim, c->shape);
    cpar_tensor ld = tu_alloc_poisoned(ctx, c->dt, c->ndim, lshape);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_cp_shard_packed(g, &seqs, &fh, c->seq_dim, &ld));
    void *lh_mem = malloc(nl * es + 1);
    memset(lh_mem, 0xff, nl * es);
    cpar_tensor lh = cpar_tensor_make(lh_mem, c->dt, c->ndim, lshape, CPAR_HOST);
    TU_OK(cpar_cp_shard_packed(g, &seqs, &fd, c->seq_dim, &lh));
    cpar_comm_stats cs;
    TU_OK(cpar_group_stats(g, &cs));
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++) ck_assert_uint_eq(cs.kind[k].calls, 0); /* sharding is local */
    void *got = tu_download(ctx, &ld);
    TU_EXPECT_SAME(got, want, c->dt, (int64_t)nl);
    TU_EXPECT_SAME(lh_mem, want, c->dt, (int64_t)nl);

    /* unshard: one all-gather of the shards, bit-exact identity */
    cpar_tensor back = tu_alloc_poisoned(ctx, c->dt, c->ndim, c->shape);
    TU_OK(cpar_group_stats_reset(g));
    TU_OK(cpar_cp_unshard_packed(g, &seqs, &ld, c->seq_dim, &back));
    TU_OK(cpar_group_stats(g, &cs));
    uint64_t moved = (uint64_t)(P - 1) * (uint64_t)nl * es;
    ck_assert_uint_eq(cs.kind[CPAR_COLL_ALL_GATHER].calls, 1);
    ck_assert_uint_eq(cs.kind[CPAR_COLL_ALL_GATHER].bytes_sent, moved);
    ck_assert_uint_eq(cs.kind[CPAR_COLL_ALL_GATHER].bytes_recv, moved);
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++)
        if (k != CPAR_COLL_ALL_GATHER) ck_assert_uint_eq(cs.kind[k].calls, 0);
    void *whole = tu_download(ctx, &back);
    TU_EXPECT_SAME(whole, c->full, c->dt, (int64_t)cpar_tensor_numel(&fh));

    free(want), free(filled), free(want_idx), free(lh_mem), free(got), free(whole);
    TU_OK(cpar_tensor_free(ctx, &fd));
    TU_OK(cpar_tensor_free(ctx, &ld));
    TU_OK(cpar_tensor_free(ctx, &back));
    return CPAR_OK;
}

static void run_packed(const packing *q, int P, cpar_dtype dt, int ndim, int seq_dim, const int64_t *shape,
                       uint64_t seed) {
    pk_case c;
    memset(&c, 0, sizeof c);
    c.q = *q, c.dt = dt, c.ndim = ndim, c.seq_dim = seq_dim;
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) c.shape[i] = shape[i], n *= shape[i];
    c.full = tu_random_host(dt, n, seed);
    TU_OK(tu_spawn(P, rank_packed, &c));
    /* every packed row is some rank's local row exactly once */
    int sd = seq_dim < 0 ? seq_dim + ndim : seq_dim;
    int64_t S = shape[sd], L = S / P;
    int *seen = calloc((size_t)S + 1, sizeof(int));
    for (int r = 0; r < P; r++)
        for (int64_t l = 0; l < L; l++) {
            ck_assert(c.idx[r][l] >= 0 && c.idx[r][l] < S);
            seen[c.idx[r][l]]++;
        }
    for (int64_t gr = 0; gr < S; gr++) ck_assert_msg(seen[gr] == 1, "packed row %lld held %d times", (long long)gr, seen[gr]);
    for (int r = 0; r < P; r++) free(c.idx[r]);
    free(seen), free(c.full);
}

/* _i = (cp - 1) * N_PACKINGS + packing: four layouts each */
START_TEST(test_shard_unshard) {
    int P = _i / N_PACKINGS + 1;
    packing qs[N_PACKINGS];
    make_packings(P, qs);
    const packing *q = &qs[_i % N_PACKINGS];
    int64_t T = total_of(q);
    const int64_t thd[3] = {T, 3, 2}, bhtd[4] = {1, 2, T, 4}, flat[1] = {T}, last[2] = {2, T};
    uint64_t seed = 100 + (uint64_t)_i * 8;
    run_packed(q, P, CPAR_F32, 3, 0, thd, seed);
    run_packed(q, P, CPAR_BF16, 4, -2, bhtd, seed + 1);
    run_packed(q, P, CPAR_I64, 1, 0, flat, seed + 2);
    run_packed(q, P, CPAR_U8, 2, -1, last, seed + 3);
}
END_TEST

/* 300 documents (2cp, empty, 4cp long in turn): more than the 256 a device
 * reorder launch carries, so the kernel runs in two launches. _i = cp - 1. */
START_TEST(test_many_docs) {
    int P = _i + 1;
    packing q;
    memset(&q, 0, sizeof q);
    q.name = "many", q.n = 300, q.padded = false;
    for (int i = 0; i < q.n; i++) q.cu[i + 1] = q.cu[i] + (i % 3 == 0 ? 2 * P : i % 3 == 1 ? 0 : 4 * P);
    int64_t T = total_of(&q);
    const int64_t thd[2] = {T, 3}, last[2] = {2, T};
    run_packed(&q, P, CPAR_F32, 2, 0, thd, 900 + (uint64_t)_i);
    run_packed(&q, P, CPAR_U8, 2, -1, last, 950 + (uint64_t)_i);
}
END_TEST

/* A packing of one document is cpar_cp_shard's load balancing. */
static cpar_status rank_one_doc(cpar_ctx *ctx, void *arg) {
    (void)arg;
    cpar_group *g = cpar_world_group(ctx);
    int P = cpar_group_size(g);
    int64_t S = 6 * P, shape[3] = {2, S, 3}, lshape[3] = {2, S / P, 3};
    int32_t cu[2] = {0, (int32_t)S};
    cpar_packed_seqs seqs = {.n_docs = 1, .cu_seqlens = cu};
    void *h = tu_random_host(CPAR_F32, 2 * S * 3, 55);
    cpar_tensor full = tu_upload(ctx, h, CPAR_F32, 3, shape);
    cpar_tensor a = tu_alloc_poisoned(ctx, CPAR_F32, 3, lshape), b = tu_alloc_poisoned(ctx, CPAR_F32, 3, lshape);
    TU_OK(cpar_cp_shard(g, &full, 1, true, &a));
    TU_OK(cpar_cp_shard_packed(g, &seqs, &full, 1, &b));
    void *ga = tu_download(ctx, &a), *gb = tu_download(ctx, &b);
    TU_EXPECT_SAME(gb, ga, CPAR_F32, 2 * S / P * 3);
    free(ga), free(gb), free(h);
    TU_OK(cpar_tensor_free(ctx, &full));
    TU_OK(cpar_tensor_free(ctx, &a));
    TU_OK(cpar_tensor_free(ctx, &b));
    return CPAR_OK;
}

/* _i = cp - 1 */
START_TEST(test_one_doc_is_load_balancing) { TU_OK(tu_spawn(_i + 1, rank_one_doc, NULL)); }
END_TEST

/* ---- bad input ------------------------------------------------------------------------------ */

static cpar_status rank_bad(cpar_ctx *ctx, void *arg) {
    (void)arg;
    cpar_group *g = cpar_world_group(ctx); /* cp = 2: documents must divide by 4 */
    int32_t cu[4] = {0, 4, 12, 16}, pad[4] = {0, 4, 12, 16};
    cpar_packed_seqs ok = {.n_docs = 3, .cu_seqlens = cu};
    int64_t fs[2] = {16, 3}, ls[2] = {8, 3}, bs[2] = {7, 3}, ws[2] = {20, 3};
    cpar_tensor full = tu_alloc_poisoned(ctx, CPAR_F32, 2, fs), local = tu_alloc_poisoned(ctx, CPAR_F32, 2, ls);
    cpar_tensor badl = tu_alloc_poisoned(ctx, CPAR_F32, 2, bs), wide = tu_alloc_poisoned(ctx, CPAR_F32, 2, ws);
    cpar_tensor l16 = tu_alloc_poisoned(ctx, CPAR_F16, 2, ls);
    int64_t idx[8];

    TU_FAILS(cpar_cp_shard_packed(g, NULL, &full, 0, &local), CPAR_ERR_INVALID, "cpar_cp_shard_packed: seqs is NULL");
    TU_FAILS(cpar_cp_unshard_packed(g, NULL, &local, 0, &full), CPAR_ERR_INVALID, "cpar_cp_unshard_packed: seqs is NULL");
    TU_FAILS(cpar_cp_shard_packed(NULL, &ok, &full, 0, &local), CPAR_ERR_INVALID, "cp is NULL");
    cpar_packed_seqs s = ok;
    s.n_docs = 0;
    TU_FAILS(cpar_cp_shard_packed(g, &s, &full, 0, &local), CPAR_ERR_INVALID, "seqs->n_docs is 0, expected >= 1");
    s = ok, s.cu_seqlens = NULL;
    TU_FAILS(cpar_cp_unshard_packed(g, &s, &local, 0, &full), CPAR_ERR_INVALID, "seqs->cu_seqlens is NULL");
    int32_t off[4] = {4, 8, 12, 16};
    s = ok, s.cu_seqlens = off;
    TU_FAILS(cpar_cp_shard_packed(g, &s, &full, 0, &local), CPAR_ERR_INVALID, "seqs->cu_seqlens[0] is 4, expected 0");
    int32_t dec[4] = {0, 12, 8, 16};
    s = ok, s.cu_seqlens = dec;
    TU_FAILS(cpar_cp_shard_packed(g, &s, &full, 0, &local), CPAR_ERR_INVALID,
             "seqs->cu_seqlens decreases at document 1: cu_seqlens[2] = 8 < cu_seqlens[1] = 12");
    int32_t odd[4] = {0, 4, 10, 16}; /* document 1 has length 6 */
    s = ok, s.cu_seqlens = odd;
    TU_FAILS(cpar_cp_shard_packed(g, &s, &full, 0, &local), CPAR_ERR_INVALID,
             "document 1 has length 6 (cu_seqlens[2] - [1]), not divisible by 2*cp = 4");
    /* padding: real 2, 5, 4 in padded 4, 8, 4 */
    int32_t real[4] = {0, 2, 7, 11};
    s = ok, s.cu_seqlens = real, s.cu_seqlens_padded = pad;
    TU_OK(cpar_cp_shard_packed(g, &s, &full, 0, &local));
    int32_t short_pad[4] = {0, 4, 8, 16}; /* document 1: padded 4 < real 5 */
    s.cu_seqlens_padded = short_pad;
    TU_FAILS(cpar_cp_shard_packed(g, &s, &full, 0, &local), CPAR_ERR_INVALID,
             "document 1 has padded length 4 (cu_seqlens_padded[2] - [1]) < its length 5");
    int32_t pad_odd[4] = {0, 2, 8, 16}; /* padded document 0 of 2 */
    int32_t real2[4] = {0, 2, 7, 11};
    s.cu_seqlens = real2, s.cu_seqlens_padded = pad_odd;
    TU_FAILS(cpar_cp_shard_packed(g, &s, &full, 0, &local), CPAR_ERR_INVALID,
             "document 0 has padded length 2 (cu_seqlens_padded[1] - [0]), not divisible by 2*cp = 4");
    int32_t pad_dec[4] = {0, 8, 4, 16};
    s.cu_seqlens_padded = pad_dec;
    TU_FAILS(cpar_cp_shard_packed(g, &s, &full, 0, &local), CPAR_ERR_INVALID, "seqs->cu_seqlens_padded decreases at document 1");
    /* the tensor does not hold the packing */
    TU_FAILS(cpar_cp_shard_packed(g, &ok, &wide, 0, &local), CPAR_ERR_INVALID,
             "full has length 20 along seq_dim 0, expected 16 (the packed length, seqs->cu_seqlens[3])");
    TU_FAILS(cpar_cp_unshard_packed(g, &ok, &local, 0, &wide), CPAR_ERR_INVALID, "full has length 20 along seq_dim 0");
    TU_FAILS(cpar_cp_shard_packed(g, &ok, &full, 0, &badl), CPAR_ERR_INVALID, "local has shape [7,3]");
    TU_FAILS(cpar_cp_unshard_packed(g, &ok, &badl, 0, &full), CPAR_ERR_INVALID, "local has shape [7,3]");
    TU_FAILS(cpar_cp_shard_packed(g, &ok, &full, 2, &local), CPAR_ERR_INVALID, "seq_dim is 2");
    TU_FAILS(cpar_cp_shard_packed(g, &ok, &full, 0, &l16), CPAR_ERR_INVALID, "local has dtype f16");
    TU_FAILS(cpar_cp_shard_packed(g, &ok, &full, 0, &full), CPAR_ERR_INVALID, "local has shape");
    /* indices */
    TU_FAILS(cpar_cp_packed_indices(&ok, 0, 0, idx, 8), CPAR_ERR_INVALID, "cpar_cp_packed_indices: cp_size is 0");
    TU_FAILS(cpar_cp_packed_indices(&ok, 2, 2, idx, 8), CPAR_ERR_INVALID, "cp_rank is 2, expected 0..1");
    TU_FAILS(cpar_cp_packed_indices(&ok, 2, -1, idx, 8), CPAR_ERR_INVALID, "cp_rank is -1");
    TU_FAILS(cpar_cp_packed_indices(&ok, 2, 0, idx, 7), CPAR_ERR_INVALID, "n is 7, expected 8");
    TU_FAILS(cpar_cp_packed_indices(&ok, 2, 0, NULL, 8), CPAR_ERR_INVALID, "indices is NULL");
    TU_FAILS(cpar_cp_packed_indices(NULL, 2, 0, idx, 8), CPAR_ERR_INVALID, "seqs is NULL");
    TU_FAILS(cpar_cp_packed_indices(&ok, 3, 0, idx, 5), CPAR_ERR_INVALID, "document 0 has length 4 (cu_seqlens[1] - [0]), not divisible by 2*cp = 6");
    /* still usable after the failures */
    TU_OK(cpar_cp_shard_packed(g, &ok, &full, 0, &local));
    TU_OK(cpar_cp_unshard_packed(g, &ok, &local, 0, &full));
    TU_OK(cpar_cp_packed_indices(&ok, 2, 1, idx, 8));
    cpar_tensor *all[] = {&full, &local, &badl, &wide, &l16};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) TU_OK(cpar_tensor_free(ctx, all[i]));
    return CPAR_OK;
}

START_TEST(test_bad_args) { TU_OK(tu_spawn(2, rank_bad, NULL)); }
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("packed: context-parallel sharding of packed sequences (THD)");
    const tu_loop loops[] = {
        {"shard_unshard", test_shard_unshard, 4 * N_PACKINGS},
        {"many_docs", test_many_docs, 4},
        {"one_doc_is_load_balancing", test_one_doc_is_load_balancing, 4},
        {"bad_args", test_bad_args, 1},
    };
    tu_add_loops(s, loops, sizeof loops / sizeof loops[0], 120);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
