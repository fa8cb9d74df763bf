/* SPDX-License-Identifier: MIT */
/* test_fuzz.c — an API fuzzer over the public functions (issue 13, items 4-5).
 *
 * A fixed seed drives a few thousand calls with random and extreme shapes,
 * dtypes, ndims, NULLs, devices, enum values, split sizes and group sizes,
 * on the host backend. Tensor arguments are either valid (small, backed by a
 * real buffer of exactly their size, random data) or deliberately broken
 * (ndim outside 0..CPAR_MAX_DIMS, a negative dim, dims whose product
 * overflows, NULL data, a bad dtype or device) with their data pointing at a
 * small real buffer, so a broken tensor the library accepts makes it read or
 * write out of bounds, which ASan (make test-sanitize) reports.
 *
 * Counted, and printed as one line per test:
 *   crashes            batches whose process died (signal, sanitizer report):
 *                      every batch runs in its own forked process;
 *   invalid accepted   calls given a clearly invalid argument (one of the
 *                      broken tensors, a NULL required pointer, an enum out of
 *                      range, a root or peer outside the group, split sizes
 *                      that are negative or overflow) that returned CPAR_OK;
 *   mismatch missed    collectives whose ranks disagree (dtype, count, op,
 *                      root, kind, sizes, a send/recv dtype) where some rank
 *                      did not return CPAR_ERR_INVALID;
 *   misreported        calls of the entries checked strictly (fz_expect: the
 *                      packed-sequence, RNG-reserve, per-call-weight and
 *                      deferred-wgrad APIs) whose one injected defect did not
 *                      give CPAR_ERR_INVALID with a message naming the
 *                      function, or whose valid arguments were refused or
 *                      gave a wrong result.
 * Each must be 0. Calls with valid but inconsistent arguments (wrong shapes)
 * may fail or succeed; they are there to reach deeper code. */
#define _GNU_SOURCE
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

#define FZ_SEED 0x13f00dull
#define FZ_BATCHES 24   /* forked processes per test */
#define FZ_MAX_T 8      /* tensors per call */

typedef struct fz_counts {
    long calls, ok, rejected, invalid_accepted, mismatch_missed, misreported;
    char first[256];     /* the first failure, for the message */
    char first_mis[256]; /* the first misreported call */
} fz_counts;

typedef struct fz {
    uint64_t s;
    fz_counts *c;
    cpar_ctx *ctx;
    int rank;
    cpar_tensor t[FZ_MAX_T];
    void *buf[FZ_MAX_T];
    bool bad[FZ_MAX_T]; /* deliberately broken */
    int nt;
} fz;

static uint64_t fz_u(fz *f, uint64_t n) { return n ? tu_next(&f->s) % n : 0; }
static bool fz_p(fz *f, int percent) { return (int)fz_u(f, 100) < percent; }

/* Extreme dims: each alone is a valid int64, together they overflow. */
static const int64_t fz_huge[] = {INT64_MAX, INT64_MAX / 2 + 1, (1ll << 62) + 1, 1ll << 32, 3037000500ll, 1ll << 40};

static void fz_reset(fz *f) {
    for (int i = 0; i < f->nt; i++) free(f->buf[i]);
    f->nt = 0;
}

/* A valid tensor of dt and shape (buffer of exactly its size, random data). */
static cpar_tensor *fz_valid(fz *f, cpar_dtype dt, int ndim, const int64_t *shape) {
    int i = f->nt++;
    ck_assert_int_lt(i, FZ_MAX_T);
    f->t[i] = cpar_tensor_make(NULL, dt, ndim, shape, CPAR_HOST);
    int64_t n = cpar_tensor_numel(&f->t[i]);
    if (n < 0 || n > 4096 || !cpar_dtype_size(dt)) { /* derived from a broken tensor: a small one instead */
        f->t[i] = cpar_tensor_make(NULL, cpar_dtype_size(dt) ? dt : CPAR_F32, 1, (int64_t[]){3}, CPAR_HOST);
        n = 3;
    }
    f->buf[i] = tu_random_host(dt, n, tu_next(&f->s));
    if (dt == CPAR_I32 || dt == CPAR_I64) /* ids and targets: small, mostly in range */
        for (int64_t k = 0; k < n; k++) tu_set(f->buf[i], dt, k, (double)fz_u(f, 8));
    f->t[i].data = n ? f->buf[i] : (fz_p(f, 50) ? NULL : f->buf[i]);
    f->bad[i] = false;
    return &f->t[i];
}

/* Break tensor i in one of the ways the library must refuse. */
static void fz_break(fz *f, cpar_tensor *t) {
    f->bad[t - f->t] = true;
    switch (fz_u(f, 7)) {
    case 0: t->dtype = (cpar_dtype)(fz_p(f, 50) ? CPAR_DTYPE_COUNT + (int)fz_u(f, 3) : -1 - (int)fz_u(f, 3)); break;
    case 1: t->ndim = fz_p(f, 50) ? CPAR_MAX_DIMS + 1 + (int)fz_u(f, 100000) : -1 - (int)fz_u(f, 5); break;
    case 2:
        if (t->ndim == 0) t->ndim = 1;
        t->shape[fz_u(f, (uint64_t)t->ndim)] = fz_p(f, 50) ? -1 : INT64_MIN;
        break;
    case 3: /* two or three huge dims (a zero dim does not excuse them) */
    case 4: {
        if (t->ndim < 2) t->ndim = 2 + (int)fz_u(f, 2);
        int a = (int)fz_u(f, (uint64_t)t->ndim), b = (a + 1 + (int)fz_u(f, (uint64_t)t->ndim - 1)) % t->ndim;
        t->shape[a] = fz_huge[fz_u(f, sizeof fz_huge / sizeof fz_huge[0])];
        t->shape[b] = fz_huge[fz_u(f, sizeof fz_huge / sizeof fz_huge[0])];
        if (t->shape[a] < 3037000500ll && t->shape[b] < 3037000500ll) t->shape[b] = INT64_MAX;
        break;
    }
    case 5:
        if (cpar_tensor_numel(t) == 0) {
            if (t->ndim == 0) t->ndim = 1;
            for (int d = 0; d < t->ndim; d++) t->shape[d] = 2;
        }
        t->data = NULL;
        break;
    default: t->device = 3 + (int)fz_u(f, 5); break; /* no such device on the host backend */
    }
}

/* A random valid shape: ndim 0..4, dims 0..6 (mostly >= 1). */
static int fz_shape(fz *f, int64_t *shape, int min_ndim) {
    int nd = min_ndim + (int)fz_u(f, (uint64_t)(5 - min_ndim));
    for (int d = 0; d < nd; d++) shape[d] = fz_p(f, 8) ? 0 : 1 + (int64_t)fz_u(f, 6);
    return nd;
}

static cpar_dtype fz_dtype(fz *f) { return (cpar_dtype)fz_u(f, CPAR_DTYPE_COUNT); }
static cpar_dtype fz_fdtype(fz *f) { return (cpar_dtype)fz_u(f, 3); }

/* A random tensor: like `like` (same dtype and shape) with probability
 * p_like, else random; broken with probability p_bad. */
static cpar_tensor *fz_tensor(fz *f, const cpar_tensor *like, int p_like, int p_bad, bool fl) {
    cpar_tensor *t;
    if (like && !f->bad[like - f->t] && fz_p(f, p_like)) t = fz_valid(f, like->dtype, like->ndim, like->shape);
    else {
        int64_t shape[CPAR_MAX_DIMS];
        int nd = fz_shape(f, shape, 0);
        t = fz_valid(f, fl && fz_p(f, 85) ? fz_fdtype(f) : fz_dtype(f), nd, shape);
    }
    if (fz_p(f, p_bad)) fz_break(f, t);
    return t;
}

static bool fz_any_bad(const fz *f) {
    for (int i = 0; i < f->nt; i++)
        if (f->bad[i]) return true;
    return false;
}

/* Account one call of `name`: invalid says an argument was clearly invalid. */
static void fz_note(fz *f, const char *name, bool invalid, cpar_status st) {
    fz_counts *c = f->c;
    c->calls++;
    if (st == CPAR_OK) c->ok++;
    else c->rejected++;
    if (getenv("CPAR_FUZZ_VERBOSE") && (invalid && st == CPAR_OK))
        fprintf(stderr, "fuzz: %s accepted an invalid argument (rank %d)\n", name, f->rank);
    if (invalid && st == CPAR_OK) {
        if (!c->invalid_accepted++)
            snprintf(c->first, sizeof c->first, "%s accepted an invalid argument (call %ld, rank %d)", name, c->calls,
                     f->rank);
    }
}

/* Account one call of an entry checked strictly: with `defect` (exactly one
 * injected) it must return CPAR_ERR_INVALID and its message must name fn;
 * without, it must succeed (and `wrong`, a result check, must be false).
 * fz_note still counts the call (the caller's, once per call). */
static void fz_expect(fz *f, const char *fn, bool defect, cpar_status st, bool wrong) {
    const char *msg = st == CPAR_OK ? "" : cpar_thread_last_error();
    if (getenv("CPAR_FUZZ_VERBOSE") && atoi(getenv("CPAR_FUZZ_VERBOSE")) > 2) /* coverage: every strict call */
        fprintf(stderr, "fuzz strict: %s %s -> %s%s\n", fn, defect ? "defect" : "valid", cpar_status_string(st),
                wrong ? " (wrong result)" : "");
    char why[160] = "";
    if (defect && st != CPAR_ERR_INVALID) snprintf(why, sizeof why, "returned %s for a defect", cpar_status_string(st));
    else if (defect && !strstr(msg, fn)) snprintf(why, sizeof why, "message \"%.100s\" does not name it", msg);
    else if (!defect && st != CPAR_OK) snprintf(why, sizeof why, "refused valid arguments: %.110s", msg);
    else if (!defect && wrong) snprintf(why, sizeof why, "gave a wrong result");
    if (why[0] && !f->c->misreported++)
        snprintf(f->c->first_mis, sizeof f->c->first_mis, "%s %s (call %ld, rank %d)", fn, why, f->c->calls, f->rank);
}

/* A packing of 1..4 documents valid for P ranks (P = 0: any lengths):
 * padded lengths multiples of 2P, real lengths within them, the padded
 * array given half the time. */
typedef struct fz_pack {
    int32_t cu[5], cup[5];
    cpar_packed_seqs s;
    int64_t total; /* the packed length */
} fz_pack;

static void fz_packing(fz *f, fz_pack *p, int P) {
    const int n = 1 + (int)fz_u(f, 4), unit = P > 0 ? 2 * P : 1;
    const bool padded = fz_u(f, 2);
    p->cu[0] = p->cup[0] = 0;
    for (int i = 1; i <= n; i++) {
        const int32_t len = unit * (fz_p(f, 15) ? 0 : 1 + (int32_t)fz_u(f, 2));
        p->cup[i] = p->cup[i - 1] + len;
        p->cu[i] = p->cu[i - 1] + (padded ? (int32_t)fz_u(f, (uint64_t)len + 1) : len);
    }
    p->s = (cpar_packed_seqs){.n_docs = n, .cu_seqlens = p->cu, .cu_seqlens_padded = padded ? p->cup : NULL};
    p->total = p->cup[n];
}

/* Exactly one defect the packing checks must refuse (P >= 1 ranks). */
static void fz_pack_defect(fz *f, fz_pack *p, int P) {
    const int n = p->s.n_docs;
    int32_t *len_of = p->s.cu_seqlens_padded ? p->cup : p->cu; /* the array that sets the lengths */
    switch (fz_u(f, 6)) {
    case 0: p->s.n_docs = fz_p(f, 50) ? 0 : -1 - (int)fz_u(f, 3); break;
    case 1: p->s.cu_seqlens = NULL; break;
    case 2: p->cu[0] = p->cup[0] = 1 + (int32_t)fz_u(f, 3); break;
    case 3: { /* a boundary below the one before it */
        const int i = 1 + (int)fz_u(f, (uint64_t)n);
        len_of[i] = len_of[i - 1] - 1 - (int32_t)fz_u(f, 3);
        break;
    }
    case 4: /* the last document's real length beyond its padded one */
        if (!p->s.cu_seqlens_padded) {
            memcpy(p->cup, p->cu, sizeof p->cup);
            p->s.cu_seqlens_padded = p->cup;
        }
        p->cu[n] = p->cu[n - 1] + (p->cup[n] - p->cup[n - 1]) + 1 + (int32_t)fz_u(f, 3);
        break;
    default: /* the last (padded) length not divisible by 2P */
        len_of[n] += 1 + (int32_t)fz_u(f, (uint64_t)(2 * P - 1));
        break;
    }
}

/* ---- functions without a context --------------------------------------------- */

static void fz_pure(fz *f) {
    static const int64_t edge[] = {0, 1, -1, 2, -2, 3, 7, INT64_MAX, INT64_MIN, INT64_MAX - 1, INT64_MIN + 1,
                                   1ll << 32, -(1ll << 32), 1ll << 62};
    const size_t ne = sizeof edge / sizeof edge[0];
    int64_t a = fz_p(f, 70) ? edge[fz_u(f, ne)] : (int64_t)tu_next(&f->s);
    int64_t b = fz_p(f, 70) ? edge[fz_u(f, ne)] : (int64_t)(tu_next(&f->s) % 9) - 4;
    int64_t q = 12345, first = 0, last = 0;
    switch (fz_u(f, 7)) {
    case 0: {
        cpar_status st = cpar_divide(a, b, &q);
        bool bad = b == 0 || (a == INT64_MIN && b == -1);
        fz_note(f, "cpar_divide", bad, st);
        if (st == CPAR_OK && (b == 0 || a % b || q != a / b)) fz_note(f, "cpar_divide (wrong quotient)", true, st);
        fz_note(f, "cpar_divide(out NULL)", true, cpar_divide(a, b, NULL));
        break;
    }
    case 1: {
        int world = (int)(fz_p(f, 80) ? 1 + (int)fz_u(f, 8) : (int)b), rank = (int)fz_u(f, 10) - 1;
        cpar_status st = cpar_vocab_range(a, rank, world, &first, &last);
        fz_note(f, "cpar_vocab_range", world < 1 || rank < 0 || rank >= world || a < 0, st);
        if (st == CPAR_OK && (first < 0 || last < first || last > a)) fz_note(f, "cpar_vocab_range (range)", true, st);
        break;
    }
    case 2: {
        int tp = (int)(fz_p(f, 50) ? b : (int64_t)(tu_next(&f->s) & 0x7fffffff));
        cpar_status st = cpar_pad_vocab_size(a, b, tp, &q);
        fz_note(f, "cpar_pad_vocab_size", a < 0 || b < 1 || tp < 1, st);
        if (st == CPAR_OK && (q < a || q % b)) fz_note(f, "cpar_pad_vocab_size (result)", true, st);
        break;
    }
    case 3: { /* numel / nbytes of broken tensors */
        cpar_tensor *t = fz_tensor(f, NULL, 0, 60, false);
        int64_t n = cpar_tensor_numel(t);
        size_t nb = cpar_tensor_nbytes(t);
        bool shape_bad = t->ndim < 0 || t->ndim > CPAR_MAX_DIMS;
        for (int d = 0; !shape_bad && d < t->ndim; d++) shape_bad = t->shape[d] < 0 || t->shape[d] >= 3037000500ll;
        if (shape_bad) fz_note(f, "cpar_tensor_numel (broken shape)", n != -1 || nb != 0, n == -1 ? CPAR_ERR_INVALID : CPAR_OK);
        else fz_note(f, "cpar_tensor_numel", false, CPAR_OK);
        if (n >= 0 && cpar_dtype_size(t->dtype) && nb != (size_t)n * cpar_dtype_size(t->dtype))
            fz_note(f, "cpar_tensor_nbytes (value)", true, CPAR_OK);
        break;
    }
    case 5: { /* the THD index map: every rank's, a permutation of the packing when valid */
        static const char fn[] = "cpar_cp_packed_indices";
        const int P = 1 + (int)fz_u(f, 4);
        fz_pack pk;
        fz_packing(f, &pk, P);
        const int64_t n = pk.total / P;
        int64_t *idx = malloc(((size_t)pk.total + 1) * sizeof *idx);
        uint8_t *hit = calloc((size_t)pk.total + 1, 1);
        int rank = (int)fz_u(f, (uint64_t)P), size = P;
        int64_t n_arg = n;
        int64_t *out = idx;
        const bool defect = fz_p(f, 40);
        if (defect) switch (fz_u(f, 5)) {
            case 0: fz_pack_defect(f, &pk, P); break;
            case 1: size = fz_p(f, 50) ? 0 : -1 - (int)fz_u(f, 3); break;
            case 2: rank = fz_p(f, 50) ? -1 : P + (int)fz_u(f, 3); break;
            case 3: n_arg = n + 1 + (int64_t)fz_u(f, 3); break;
            default:
                if (n == 0) n_arg = -1; /* NULL indices are fine for no rows: break n instead */
                else out = NULL;
                break;
            }
        bool wrong = false;
        for (int r = defect ? rank : 0; r < (defect ? rank + 1 : P); r++) {
            cpar_status st = cpar_cp_packed_indices(&pk.s, size, r, out, n_arg);
            if (st == CPAR_OK && !defect)
                for (int64_t l = 0; l < n; l++) {
                    if (idx[l] < 0 || idx[l] >= pk.total || hit[idx[l]]) wrong = true;
                    else hit[idx[l]] = 1;
                }
            fz_note(f, fn, defect, st);
            fz_expect(f, fn, defect, st, wrong);
        }
        free(idx);
        free(hit);
        break;
    }
    default: { /* the two view functions */
        cpar_tensor *t = fz_tensor(f, NULL, 0, 30, false), view;
        if (t->device != CPAR_HOST) t->device = CPAR_HOST, f->bad[t - f->t] = false; /* views take any device */
        int n = fz_p(f, 80) ? 1 + (int)fz_u(f, 4) : (int)b, i = (int)fz_u(f, 5) - 1;
        int64_t stride;
        bool inv = f->bad[t - f->t] || n < 1 || i < 0 || i >= n;
        if (fz_u(f, 2)) fz_note(f, "cpar_split_last_dim_view", inv, cpar_split_last_dim_view(t, n, i, &view, &stride));
        else fz_note(f, "cpar_split_first_dim_view", inv, cpar_split_first_dim_view(t, n, i, &view));
        fz_note(f, "cpar_split_first_dim_view(view NULL)", true, cpar_split_first_dim_view(t, 1, 0, NULL));
        break;
    }
    }
    fz_reset(f);
}

/* ---- one context: tensors, element-wise ops, RNG, attention, norms ----------- */

static void fz_local(fz *f) {
    cpar_ctx *ctx = f->ctx;
    int pb = 12; /* percent of tensors broken */
    cpar_status st;
    const char *name;
    bool extra_bad = false; /* a non-tensor argument is clearly invalid */
    switch (fz_u(f, 18)) {
    case 0: {
        name = "cpar_tensor_alloc";
        int64_t shape[CPAR_MAX_DIMS] = {0};
        int nd = fz_shape(f, shape, 0);
        cpar_dtype dt = fz_dtype(f);
        if (fz_p(f, 40)) { /* one clearly invalid part of the request */
            extra_bad = true;
            switch (fz_u(f, 4)) {
            case 0: nd = fz_u(f, 2) ? CPAR_MAX_DIMS + 1 + (int)fz_u(f, 1000) : -1 - (int)fz_u(f, 3); break;
            case 1: dt = (cpar_dtype)(CPAR_DTYPE_COUNT + (int)fz_u(f, 3)); break;
            case 2: if (nd == 0) nd = 1; shape[fz_u(f, (uint64_t)nd)] = -1 - (int64_t)fz_u(f, 3); break;
            default:
                if (nd < 2) nd = 2;
                shape[0] = fz_huge[fz_u(f, sizeof fz_huge / sizeof fz_huge[0])];
                shape[1] = INT64_MAX / 2 + (int64_t)fz_u(f, 4);
                break;
            }
        }
        cpar_tensor out;
        bool null_shape = nd > 0 && nd <= CPAR_MAX_DIMS && fz_p(f, 5);
        st = cpar_tensor_alloc(ctx, dt, nd, null_shape ? NULL : shape, &out);
        extra_bad = extra_bad || null_shape;
        if (st == CPAR_OK) {
            size_t nb = cpar_tensor_nbytes(&out);
            if (nb) memset(out.data, 0x5a, nb); /* ASan: the block really has nbytes */
            cpar_tensor_free(ctx, &out);
        }
        fz_note(f, "cpar_tensor_alloc(out NULL)", true, cpar_tensor_alloc(ctx, CPAR_F32, 0, shape, NULL));
        break;
    }
    case 1: {
        name = "cpar_tensor_copy";
        cpar_tensor *a = fz_tensor(f, NULL, 0, pb, false);
        cpar_tensor *b = fz_tensor(f, a, 60, pb, false);
        st = cpar_tensor_copy(ctx, a, b);
        break;
    }
    case 2: {
        name = "cpar_fill";
        static const double vals[] = {0.0, 1.5, -3.0, 1e30, -1e300, 65504.0, 1e-40};
        cpar_tensor *a = fz_tensor(f, NULL, 0, pb, false);
        st = cpar_fill(ctx, a, fz_p(f, 10) ? NAN : fz_p(f, 10) ? INFINITY : vals[fz_u(f, 7)]);
        break;
    }
    case 3: {
        name = "cpar_cast";
        cpar_tensor *a = fz_tensor(f, NULL, 0, pb, true);
        cpar_tensor *b = fz_tensor(f, a, 50, 0, true);
        cpar_dtype orig = b->dtype, want = fz_fdtype(f);
        if (fz_p(f, 50) && cpar_dtype_size(want) <= cpar_dtype_size(orig)) b->dtype = want; /* fits the buffer */
        if (fz_p(f, pb)) fz_break(f, b);
        st = cpar_cast(ctx, a, b);
        break;
    }
    case 4: {
        name = "cpar_axpby";
        cpar_tensor *x = fz_tensor(f, NULL, 0, pb, true), *y = fz_tensor(f, x, 70, pb, true);
        st = cpar_axpby(ctx, (float)tu_uniform(&f->s), x, fz_p(f, 10) ? NAN : 0.5f, y);
        break;
    }
    case 5:
    case 6: {
        bool split = fz_u(f, 2);
        name = split ? "cpar_split" : "cpar_concat";
        cpar_tensor *whole = fz_tensor(f, NULL, 0, pb, false);
        int n = fz_p(f, 90) ? 1 + (int)fz_u(f, 3) : (int)fz_u(f, 3) - 2;
        int dim = (int)fz_u(f, 11) - 5;
        cpar_tensor *parts[4] = {NULL, NULL, NULL, NULL};
        for (int i = 0; i < n && i < 3; i++) {
            cpar_tensor *p = fz_tensor(f, whole, 40, pb, false);
            if (!f->bad[p - f->t] && p->ndim && whole->ndim == p->ndim && fz_p(f, 50) && !f->bad[whole - f->t]) {
                /* a plausible piece: the whole's shape with dim shrunk (buffer big enough) */
                int d = ((dim % p->ndim) + p->ndim) % p->ndim;
                p->shape[d] = whole->shape[d] / (n > 0 ? n : 1);
            }
            parts[i] = fz_p(f, 3) ? NULL : p;
            extra_bad = extra_bad || !parts[i];
        }
        extra_bad = extra_bad || n < 1;
        st = split ? cpar_split(ctx, whole, dim, n, parts) : cpar_concat(ctx, parts, n, dim, whole);
        break;
    }
    case 7: {
        name = "cpar_row_reduce";
        cpar_tensor *in = fz_tensor(f, NULL, 0, pb, true);
        int64_t shape[CPAR_MAX_DIMS];
        int nd = in->ndim > 0 && in->ndim <= CPAR_MAX_DIMS && fz_p(f, 60) ? in->ndim - 1 : fz_shape(f, shape, 0);
        if (nd == in->ndim - 1) memcpy(shape, in->shape, sizeof shape);
        cpar_tensor *out = fz_valid(f, CPAR_F32, nd, shape);
        if (fz_p(f, pb)) fz_break(f, out);
        int op = fz_p(f, 90) ? (int)fz_u(f, 3) : 3 + (int)fz_u(f, 9);
        extra_bad = op > 2;
        st = cpar_row_reduce(ctx, in, (cpar_row_op)op, out);
        break;
    }
    case 8: {
        name = "cpar_gelu_forward";
        cpar_tensor *x = fz_tensor(f, NULL, 0, pb, true);
        st = cpar_gelu_forward(ctx, x, fz_p(f, 10) ? x : fz_tensor(f, x, 70, pb, true));
        break;
    }
    case 9: {
        name = "cpar_gelu_backward";
        cpar_tensor *x = fz_tensor(f, NULL, 0, pb, true), *dy = fz_tensor(f, x, 70, pb, true);
        cpar_tensor *dx = fz_tensor(f, x, 70, pb, true);
        st = cpar_gelu_backward(ctx, x, dy, dx);
        break;
    }
    case 10: {
        bool uni = fz_u(f, 2);
        name = uni ? "cpar_rng_uniform" : "cpar_rng_normal";
        cpar_tensor *t = fz_tensor(f, NULL, 0, pb, true);
        float a = fz_p(f, 10) ? NAN : (float)tu_uniform(&f->s), b = fz_p(f, 10) ? -1.0f : (float)tu_uniform(&f->s) + 1.5f;
        extra_bad = isnan(a) || (!uni && b < 0);
        st = uni ? cpar_rng_uniform(ctx, t, a, b) : cpar_rng_normal(ctx, t, a, b);
        break;
    }
    case 11:
    case 12: {
        bool fwd = fz_u(f, 2);
        name = fwd ? "cpar_dropout_forward" : "cpar_dropout_backward";
        cpar_tensor *x = fz_tensor(f, NULL, 0, pb, true), *y = fz_tensor(f, x, 70, pb, true);
        cpar_tensor *mask = fz_valid(f, CPAR_U8, x->ndim >= 0 && x->ndim <= CPAR_MAX_DIMS ? x->ndim : 0, x->shape);
        bool use_mask = !fwd || fz_p(f, 80);
        if (use_mask && fz_p(f, pb)) fz_break(f, mask);
        float p = fz_p(f, 85) ? (float)fz_u(f, 10) / 10.0f : fz_p(f, 50) ? NAN : 1.5f;
        extra_bad = !(p >= 0.0f && p < 1.0f);
        cpar_rng_state used;
        memset(&used, 0, sizeof used);
        st = fwd ? cpar_dropout_forward(ctx, p, x, y, use_mask ? mask : NULL, &used)
                 : cpar_dropout_backward(ctx, p, x, y, mask, &used);
        break;
    }
    case 13: {
        name = "cpar_attention_forward";
        int64_t qs[4] = {1 + (int64_t)fz_u(f, 2), 1 + (int64_t)fz_u(f, 2), 1 + (int64_t)fz_u(f, 4), 1 + (int64_t)fz_u(f, 4)};
        cpar_dtype dt = fz_fdtype(f);
        cpar_tensor *q = fz_valid(f, dt, 4, qs), *k = fz_valid(f, dt, 4, qs), *v = fz_valid(f, dt, 4, qs);
        cpar_tensor *out = fz_valid(f, dt, 4, qs), *lse = fz_valid(f, CPAR_F32, 3, qs);
        cpar_tensor *pick[5] = {q, k, v, out, lse};
        if (fz_p(f, 40)) fz_break(f, pick[fz_u(f, 5)]);
        float scale = fz_p(f, 80) ? 0.0f : fz_p(f, 50) ? -1.0f : NAN;
        extra_bad = scale != 0.0f;
        if (fz_p(f, 50)) {
            st = cpar_attention_forward(ctx, q, k, v, fz_u(f, 2), scale, out, lse);
            break;
        }
        /* The configuration form: dropout_p, and a packing whose length is
         * the tensors' sequence length unless one defect is injected. */
        name = "cpar_attention_forward_cfg";
        cpar_attention_config cfg = {.causal = fz_u(f, 2), .scale = scale};
        cfg.dropout_p = fz_p(f, 85) ? (float)fz_u(f, 10) / 10.0f : fz_p(f, 50) ? NAN : fz_p(f, 50) ? 1.0f : -0.5f;
        cfg.dropout_state.seed = tu_next(&f->s);
        extra_bad = extra_bad || !(cfg.dropout_p >= 0.0f && cfg.dropout_p < 1.0f);
        int32_t cu[4], cup[4];
        cpar_packed_seqs seqs = {.n_docs = 1 + (int)fz_u(f, 3), .cu_seqlens = cu};
        if (fz_p(f, 50) && !f->bad[q - f->t] && q->shape[0] == 1) { /* b = 1: the packing fills sq */
            const int64_t sq = q->shape[2];
            cu[0] = cup[0] = 0;
            for (int i = 1; i <= seqs.n_docs; i++) { /* padded boundaries ascending to sq; real lengths within */
                cup[i] = i == seqs.n_docs ? (int32_t)sq : cup[i - 1] + (int32_t)fz_u(f, (uint64_t)(sq - cup[i - 1] + 1));
                cu[i] = cu[i - 1] + (int32_t)fz_u(f, (uint64_t)(cup[i] - cup[i - 1] + 1));
            }
            if (fz_p(f, 50)) seqs.cu_seqlens_padded = cup;
            else
                for (int i = 0; i <= seqs.n_docs; i++) cu[i] = cup[i];
            if (fz_p(f, 25)) { /* one clearly invalid part of the packing */
                extra_bad = true;
                switch (fz_u(f, 4)) {
                case 0: seqs.n_docs = fz_p(f, 50) ? 0 : -1; break;
                case 1: seqs.cu_seqlens = NULL; break;
                case 2: cu[0] = cup[0] = 1; break;
                default: /* the packing's length is not the tensors' */
                    if (seqs.cu_seqlens_padded) cup[seqs.n_docs] += 1 + (int32_t)fz_u(f, 3);
                    else cu[seqs.n_docs] += 1 + (int32_t)fz_u(f, 3);
                    break;
                }
            }
            cfg.packed = &seqs;
        }
        st = cpar_attention_forward_cfg(ctx, fz_p(f, 3) ? (extra_bad = true, NULL) : &cfg, q, k, v, out, lse);
        break;
    }
    case 14:
    case 15: {
        bool fwd = fz_u(f, 2);
        name = fwd ? "cpar_rmsnorm_forward" : "cpar_rmsnorm_backward";
        cpar_tensor *x = fz_tensor(f, NULL, 0, pb, true);
        int64_t h = x->ndim > 0 && x->ndim <= CPAR_MAX_DIMS ? x->shape[x->ndim - 1] : 1;
        cpar_tensor *w = fz_valid(f, x->dtype >= 0 && x->dtype < 3 ? x->dtype : CPAR_F32, 1, &h);
        if (fz_p(f, pb)) fz_break(f, w);
        cpar_tensor *y = fz_tensor(f, x, 75, pb, true), *dx = fwd ? NULL : fz_tensor(f, x, 75, pb, true);
        cpar_tensor *dw = fz_valid(f, CPAR_F32, 1, &h);
        float eps = fz_p(f, 90) ? 1e-5f : fz_p(f, 50) ? -1.0f : NAN;
        extra_bad = eps != 1e-5f;
        st = fwd ? cpar_rmsnorm_forward(ctx, x, w, eps, y) : cpar_rmsnorm_backward(ctx, x, w, eps, y, dx, fz_p(f, 30) ? NULL : dw);
        break;
    }
    case 16: { /* the fused-kernel RNG handout: *used = current, offset += blocks, never wrapping */
        static const char fn[] = "cpar_rng_reserve";
        static const uint64_t edge[] = {0, 1, 2, 5, 1ull << 32, UINT64_MAX / 2, UINT64_MAX - 1, UINT64_MAX};
        name = fn;
        cpar_rng_state before, saved, used, after;
        memset(&used, 0, sizeof used);
        TU_OK(cpar_rng_get_state(ctx, NULL, &saved));
        before = saved;
        if (fz_p(f, 30)) { /* a state far along its stream */
            before.offset = UINT64_MAX - fz_u(f, 8);
            TU_OK(cpar_rng_set_state(ctx, NULL, &before));
        }
        uint64_t blocks = fz_p(f, 70) ? fz_u(f, 100) : edge[fz_u(f, 8)];
        const bool wraps = blocks > UINT64_MAX - before.offset;
        const int defect = wraps ? 3 : fz_p(f, 20) ? 1 + (int)fz_u(f, 2) : 0; /* 1 NULL used, 2 NULL ctx */
        st = cpar_rng_reserve(defect == 2 ? NULL : ctx, blocks, defect == 1 ? NULL : &used);
        TU_OK(cpar_rng_get_state(ctx, NULL, &after));
        /* valid: used is the old state and the offset moved by blocks; refused: nothing moved */
        const bool wrong = st == CPAR_OK ? memcmp(&used, &before, sizeof used) || after.seed != before.seed ||
                                               after.offset != before.offset + blocks
                                         : memcmp(&after, &before, sizeof after) != 0;
        fz_expect(f, fn, defect != 0, st, wrong);
        extra_bad = defect != 0;
        TU_OK(cpar_rng_set_state(ctx, NULL, &saved));
        break;
    }
    default: {
        bool undo = fz_u(f, 2);
        name = undo ? "cpar_undo_attention_load_balancing" : "cpar_redo_attention_load_balancing";
        cpar_tensor *in = fz_tensor(f, NULL, 0, pb, false), *out = fz_tensor(f, in, 70, pb, false);
        int cp = fz_p(f, 85) ? 1 + (int)fz_u(f, 3) : fz_p(f, 50) ? -(int)fz_u(f, 3) : INT32_MAX;
        extra_bad = cp < 1;
        st = undo ? cpar_undo_attention_load_balancing(ctx, cp, in, out) : cpar_redo_attention_load_balancing(ctx, cp, in, out);
        break;
    }
    }
    if (getenv("CPAR_FUZZ_VERBOSE") && atoi(getenv("CPAR_FUZZ_VERBOSE")) > 1) {
        fprintf(stderr, "fuzz: %s -> %s: %s\n", name, cpar_status_string(st), st ? cpar_thread_last_error() : "");
        for (int i = 0; i < f->nt; i++) {
            fprintf(stderr, "   t%d dtype %d ndim %d dev %d data %p bad %d [", i, f->t[i].dtype, f->t[i].ndim, f->t[i].device, f->t[i].data, f->bad[i]);
            for (int d = 0; d < CPAR_MAX_DIMS && d < f->t[i].ndim; d++) fprintf(stderr, "%lld,", (long long)f->t[i].shape[d]);
            fprintf(stderr, "]\n");
        }
    }
    fz_note(f, name, extra_bad || fz_any_bad(f), st);
    if (fz_p(f, 3)) { /* NULL context */
        cpar_tensor *t = fz_tensor(f, NULL, 0, 0, true);
        fz_note(f, "cpar_fill(NULL ctx)", true, cpar_fill(NULL, t, 1.0));
        fz_note(f, "cpar_tensor_copy(NULL ctx)", true, cpar_tensor_copy(NULL, t, t));
    }
    fz_reset(f);
}

static cpar_status rank_local(cpar_ctx *ctx, void *arg) {
    fz *f = arg;
    f->ctx = ctx;
    for (int i = 0; i < 300; i++) fz_local(f);
    return CPAR_OK;
}

/* ---- collectives on groups of 1-4 ranks, one cpar_spawn per call ---------------- */

enum { FZ_MISMATCH_NONE = -1 };

typedef struct fz_call {
    uint64_t seed;     /* every rank draws the same arguments from it */
    int n;             /* ranks */
    int diverge_rank;  /* this rank changes one field (mismatch), or -1 */
    int mismatch_kind; /* which field */
    fz_counts *c;
    cpar_status st[4];
    bool bad[4];       /* the rank's own arguments were clearly invalid */
    long mis[4];       /* the rank's misreported calls (fz_expect) */
    char first_mis[4][256];
    const char *name;
} fz_call;

/* Whether two tensors hold the same bytes (round trips of pure data movement). */
static bool fz_same(const cpar_tensor *a, const cpar_tensor *b) {
    const size_t n = cpar_tensor_nbytes(a);
    return n == cpar_tensor_nbytes(b) && (n == 0 || memcmp(a->data, b->data, n) == 0);
}

/* cpar_cp_shard_packed / cpar_cp_unshard_packed on the n ranks of g: valid
 * calls must round-trip (shard then unshard gives full back on every rank,
 * unshard then shard gives each rank its shard back). */
static cpar_status fz_cp_packed(fz *f, cpar_group *g, int n, bool shard, bool *defect) {
    const char *fn = shard ? "cpar_cp_shard_packed" : "cpar_cp_unshard_packed";
    fz_pack pk;
    fz_packing(f, &pk, n);
    const bool thd = fz_u(f, 2); /* THD [t, h] along dim 0, or [b, h, t, d] along dim 2 (or -2) */
    const int nd = thd ? 2 : 4, at = thd ? 0 : 2;
    int sd = thd ? 0 : fz_u(f, 2) ? 2 : -2;
    int64_t fs[4] = {1, 1 + (int64_t)fz_u(f, 2), 1 + (int64_t)fz_u(f, 2), 1 + (int64_t)fz_u(f, 3)}, ls[4];
    fs[at] = pk.total;
    memcpy(ls, fs, sizeof ls);
    ls[at] = pk.total / n;
    const cpar_dtype dt = fz_dtype(f);
    cpar_tensor *full = fz_valid(f, dt, nd, fs), *local = fz_valid(f, dt, nd, ls);
    const cpar_packed_seqs *seqs = &pk.s;
    *defect = fz_p(f, 40); /* the same draw on every rank: all refuse before communicating */
    if (*defect) switch (fz_u(f, 6)) {
        case 0: fz_pack_defect(f, &pk, n); break;
        case 1: seqs = NULL; break;
        case 2: sd = fz_p(f, 50) ? nd + (int)fz_u(f, 3) : -nd - 1 - (int)fz_u(f, 3); break;
        case 3: { /* the shard's sequence length is not the packing's / n */
            ls[at] += 1 + (int64_t)fz_u(f, 2);
            local = fz_valid(f, dt, nd, ls);
            break;
        }
        case 4: { /* the two tensors' dtypes differ */
            cpar_tensor *t = fz_valid(f, (cpar_dtype)((dt + 1 + fz_u(f, CPAR_DTYPE_COUNT - 1)) % CPAR_DTYPE_COUNT), nd,
                                      ls);
            local = t;
            break;
        }
        default: fz_break(f, fz_u(f, 2) ? full : local); break;
        }
    cpar_status st = shard ? cpar_cp_shard_packed(g, seqs, full, sd, local) : cpar_cp_unshard_packed(g, seqs, local, sd, full);
    if (st == CPAR_OK && !*defect) { /* the other direction into a fresh tensor */
        cpar_tensor *back = fz_valid(f, dt, nd, shard ? fs : ls);
        const cpar_status st2 = shard ? cpar_cp_unshard_packed(g, seqs, local, sd, back)
                                      : cpar_cp_shard_packed(g, seqs, full, sd, back);
        fz_expect(f, shard ? "cpar_cp_unshard_packed" : "cpar_cp_shard_packed", false, st2,
                  st2 == CPAR_OK && !fz_same(back, shard ? full : local));
    }
    fz_expect(f, fn, *defect, st, false);
    return st;
}

/* cpar_mamba_cp_pre/post_conv_ssm_packed on the n ranks of g, CPAR_FWD or
 * CPAR_BWD; valid calls must round-trip where the pair is pure data movement
 * (post always, pre without replicated groups). */
static cpar_status fz_mamba_packed(fz *f, cpar_group *g, int n, bool pre, bool *defect) {
    const char *fn = pre ? "cpar_mamba_cp_pre_conv_ssm_packed" : "cpar_mamba_cp_post_conv_ssm_packed";
    cpar_mamba_cp_config cfg = {.nheads_local_tp = n * (1 + (int64_t)fz_u(f, 2)), .d_state = 1 + (int64_t)fz_u(f, 2)};
    cfg.d_inner_local_tp = cfg.nheads_local_tp * (1 + (int64_t)fz_u(f, 2));
    cfg.ngroups_local_tp = fz_u(f, 2) ? 1 : n * (1 + (int64_t)fz_u(f, 2)); /* replicated (R = n) or split groups */
    cpar_mamba_cp *m = NULL;
    cpar_status st = cpar_mamba_cp_create(g, &cfg, &m);
    fz_expect(f, "cpar_mamba_cp_create", false, st, false);
    *defect = false;
    if (st != CPAR_OK) return st;
    cpar_mamba_cp_info in;
    TU_OK(cpar_mamba_cp_get_info(m, &in));
    fz_pack pk;
    fz_packing(f, &pk, n);
    const int64_t s = pk.total, b = 1 + (int64_t)fz_u(f, 2), h = 1 + (int64_t)fz_u(f, 3);
    const int64_t wide = pre ? in.out_width : h, narrow = pre ? in.in_width : n * h; /* [s, b, wide] <-> [s/n, b, narrow] */
    const cpar_dir dir = fz_u(f, 2) ? CPAR_FWD : CPAR_BWD;
    const bool to_whole = pre == (dir == CPAR_FWD); /* pre FWD and post BWD make the whole packing */
    int64_t ws[3] = {s, b, wide}, ns[3] = {s / n, b, narrow};
    const cpar_dtype dt = fz_fdtype(f);
    cpar_tensor *src = fz_valid(f, dt, 3, to_whole ? ns : ws), *dst = fz_valid(f, dt, 3, to_whole ? ws : ns);
    const cpar_packed_seqs *seqs = &pk.s;
    cpar_mamba_cp *mm = m;
    int d = (int)dir;
    *defect = fz_p(f, 40);
    if (*defect) switch (fz_u(f, 6)) {
        case 0: fz_pack_defect(f, &pk, n); break;
        case 1: seqs = NULL; break;
        case 2: mm = NULL; break;
        case 3: d = fz_p(f, 50) ? -1 : 2 + (int)fz_u(f, 5); break;
        case 4: { /* the output's last dim is not the mixer's */
            int64_t *shp = to_whole ? ws : ns;
            shp[2] += 1 + (int64_t)fz_u(f, 2);
            dst = fz_valid(f, dt, 3, shp);
            break;
        }
        default: fz_break(f, fz_u(f, 2) ? src : dst); break;
        }
    st = pre ? cpar_mamba_cp_pre_conv_ssm_packed(mm, seqs, src, dst, (cpar_dir)d)
             : cpar_mamba_cp_post_conv_ssm_packed(mm, seqs, src, dst, (cpar_dir)d);
    fz_expect(f, fn, *defect, st, false);
    if (st == CPAR_OK && !*defect && (!pre || in.group_repeat_count == 1)) {
        cpar_tensor *back = fz_valid(f, dt, 3, to_whole ? ns : ws);
        const cpar_dir inv = dir == CPAR_FWD ? CPAR_BWD : CPAR_FWD;
        const cpar_status st2 = pre ? cpar_mamba_cp_pre_conv_ssm_packed(m, seqs, dst, back, inv)
                                    : cpar_mamba_cp_post_conv_ssm_packed(m, seqs, dst, back, inv);
        fz_expect(f, fn, false, st2, st2 == CPAR_OK && !fz_same(back, src));
    }
    TU_OK(cpar_mamba_cp_destroy(m));
    return st;
}

/* A column layer over the n ranks of g through cpar_linear_forward_ex
 * (a supplied weight, runtime_gather_output), backward, cpar_linear_deferred
 * and cpar_linear_drain_wgrad, with at most one defect in one of those calls
 * (*name: the call that has it, or the forward). */
static cpar_status fz_linear(fz *f, cpar_group *g, int n, const char **name, bool *defect) {
    const int kind = fz_p(f, 50) ? -1 : (int)fz_u(f, 10);
    *defect = kind >= 0;
    const bool row = kind == 9; /* a row layer given column-only arguments */
    cpar_linear_config cfg = {.input_size = (row ? n : 1) * (1 + (int64_t)fz_u(f, 4)),
                              .output_size = n * (1 + (int64_t)fz_u(f, 3)),
                              .dtype = fz_fdtype(f),
                              .bias = fz_u(f, 2),
                              .skip_bias_add = fz_u(f, 2),
                              .gather_output = !row && fz_u(f, 2),
                              .input_is_parallel = row,
                              .skip_weight_param_allocation = !row && fz_p(f, 30),
                              .defer_embedding_wgrad_compute = kind == 7 || (!row && kind != 6 && fz_p(f, 50))};
    if (cfg.defer_embedding_wgrad_compute && kind != 7) cfg.wgrad_deferral_limit = (int)fz_u(f, 3);
    cpar_linear *l = NULL;
    *name = row ? "cpar_row_parallel_linear_create" : "cpar_column_parallel_linear_create";
    cpar_status st = row ? cpar_row_parallel_linear_create(g, &cfg, &l) : cpar_column_parallel_linear_create(g, &cfg, &l);
    fz_expect(f, *name, false, st, false);
    if (st != CPAR_OK) return st;
    const int64_t out_l = cfg.output_size / n, in_l = row ? cfg.input_size / n : cfg.input_size;
    cpar_tensor *mw = fz_valid(f, CPAR_F32, 2, (int64_t[]){cfg.output_size, cfg.input_size});
    cpar_tensor *mb = fz_valid(f, CPAR_F32, 1, &cfg.output_size);
    *name = "cpar_linear_init_from_master";
    st = cpar_linear_init_from_master(l, cfg.skip_weight_param_allocation ? NULL : mw, cfg.bias ? mb : NULL);
    fz_expect(f, *name, false, st, false);
    fz_reset(f);
    /* the per-call arguments: a weight of our own (required without one in the layer) */
    const bool supply = !row && (cfg.skip_weight_param_allocation || fz_p(f, 30) || kind == 2 || kind == 3);
    const int64_t T = 1 + (int64_t)fz_u(f, 3), B = 1 + (int64_t)fz_u(f, 2);
    cpar_linear_forward_args args = {.runtime_gather_output = row ? CPAR_RUNTIME_GATHER_TRUE
                                                                  : (cpar_runtime_gather)fz_u(f, 3)};
    int64_t wsh[2] = {out_l + (kind == 2), in_l};
    cpar_tensor *w = fz_valid(f, cfg.dtype, 2, wsh), *wg = fz_valid(f, CPAR_F32, 2, (int64_t[]){out_l, in_l});
    if (supply) args.weight = w, args.weight_grad = kind == 3 ? NULL : wg;
    if (kind == 4) args.weight = NULL, args.weight_grad = wg;
    if (kind == 1) args.runtime_gather_output = (cpar_runtime_gather)(3 + (int)fz_u(f, 5));
    const bool go = args.runtime_gather_output == CPAR_RUNTIME_GATHER_NONE
                        ? cfg.gather_output
                        : args.runtime_gather_output == CPAR_RUNTIME_GATHER_TRUE;
    const int64_t xs[3] = {T, B, in_l}, ys[3] = {T, B, row || go ? cfg.output_size : out_l};
    cpar_tensor *x = fz_valid(f, cfg.dtype, 3, xs), *y = fz_valid(f, cfg.dtype, 3, ys);
    cpar_tensor *bias_out = fz_valid(f, cfg.dtype, 1, &out_l);
    if (kind == 5) fz_break(f, x);
    *name = "cpar_linear_forward_ex";
    st = cpar_linear_forward_ex(kind == 0 ? NULL : l, x, y, bias_out, &args);
    const bool fwd_defect = (kind >= 0 && kind <= 5) || kind == 9;
    fz_expect(f, *name, fwd_defect, st, false);
    if (fwd_defect || st != CPAR_OK) goto done;
    if (kind != 7) { /* kind 7 drains with this forward's backward still to run */
        cpar_tensor *dy = fz_valid(f, cfg.dtype, 3, ys), *dx = fz_valid(f, cfg.dtype, 3, xs);
        *name = "cpar_linear_backward";
        st = cpar_linear_backward(l, dy, fz_p(f, 20) ? NULL : dx);
        fz_expect(f, *name, false, st, false);
        if (st != CPAR_OK) goto done;
    }
    int na = -1, ngr = -1;
    *name = "cpar_linear_deferred";
    st = cpar_linear_deferred(kind == 8 ? NULL : l, &na, fz_p(f, 20) ? NULL : &ngr);
    const int deferred = cfg.defer_embedding_wgrad_compute ? 1 : 0; /* any limit (0: none, else >= 1) keeps one */
    fz_expect(f, *name, kind == 8, st, st == CPAR_OK && (na != deferred || (ngr != -1 && ngr != (kind == 7 ? 0 : deferred))));
    if (kind == 8) goto done;
    if (cfg.defer_embedding_wgrad_compute || kind == 6) {
        *name = "cpar_linear_drain_wgrad";
        st = cpar_linear_drain_wgrad(l);
        na = ngr = -1;
        const bool emptied = cpar_linear_deferred(l, &na, &ngr) == CPAR_OK && na == 0 && ngr == 0;
        fz_expect(f, *name, kind == 6 || kind == 7, st, st == CPAR_OK && !emptied);
    }
done:
    TU_OK(cpar_linear_destroy(l));
    return st;
}

static cpar_status rank_coll(cpar_ctx *ctx, void *arg) {
    fz_call *call = arg;
    int r = cpar_rank(ctx), n = call->n;
    fz_counts local;
    memset(&local, 0, sizeof local);
    fz ff = {.s = call->seed, .c = &local, .ctx = ctx, .rank = r}, *f = &ff;
    cpar_group *g = cpar_world_group(ctx);
    bool mism = call->diverge_rank >= 0, me = call->diverge_rank == r;
    int pb = mism ? 0 : 10;
    bool extra_bad = false;
    cpar_status st = CPAR_OK;
    const char *name;
    int64_t sizes[4], rows[4];
    cpar_dtype dt = fz_fdtype(f);
    int64_t shape[CPAR_MAX_DIMS];
    int nd = fz_shape(f, shape, 1);
    int which = mism ? call->mismatch_kind : (int)fz_u(f, 19);
    int op = fz_p(f, 92) ? (int)fz_u(f, 3) : fz_p(f, 50) ? -1 : 3 + (int)fz_u(f, 5);
    switch (which) {
    case 0: {
        name = "cpar_all_reduce";
        if (mism && me) dt = (cpar_dtype)((dt + 1) % 3);
        int o = mism ? CPAR_SUM : op;
        if (mism && me && fz_u(f, 2)) o = CPAR_MAX, dt = (cpar_dtype)((dt + 2) % 3);
        cpar_tensor *in = fz_valid(f, dt, nd, shape), *out = fz_p(f, 20) ? in : fz_valid(f, dt, nd, shape);
        if (fz_p(f, pb)) fz_break(f, fz_u(f, 2) ? in : out);
        extra_bad = o < 0 || o > 2;
        st = cpar_all_reduce(g, in, out, (cpar_reduce_op)o);
        break;
    }
    case 1: {
        name = "cpar_all_gather";
        bool use_sizes = fz_u(f, 2);
        for (int i = 0; i < n; i++) sizes[i] = (int64_t)fz_u(f, 4);
        if (!mism && fz_p(f, 8)) sizes[fz_u(f, (uint64_t)n)] = fz_p(f, 50) ? -1 : INT64_MAX, extra_bad = use_sizes;
        if (mism && me) { if (use_sizes) sizes[(r + 1) % n] += 1; else shape[0] += 1; }
        int64_t in_shape[CPAR_MAX_DIMS], total = 0;
        memcpy(in_shape, shape, sizeof shape);
        if (use_sizes && sizes[r] >= 0 && sizes[r] < 100) in_shape[0] = sizes[r];
        for (int i = 0; i < n; i++) total += use_sizes ? (sizes[i] >= 0 && sizes[i] < 100 ? sizes[i] : 0) : in_shape[0];
        cpar_tensor *in = fz_valid(f, dt, nd, in_shape);
        in_shape[0] = total;
        cpar_tensor *out = fz_valid(f, dt, nd, in_shape);
        if (fz_p(f, pb)) fz_break(f, fz_u(f, 2) ? in : out);
        st = cpar_all_gather(g, in, out, use_sizes ? sizes : NULL);
        break;
    }
    case 2: {
        name = "cpar_reduce_scatter";
        for (int i = 0; i < n; i++) rows[i] = (int64_t)fz_u(f, 4);
        bool use_sizes = fz_u(f, 2);
        int64_t total = 0;
        for (int i = 0; i < n; i++) total += use_sizes ? rows[i] : shape[0];
        int64_t in_shape[CPAR_MAX_DIMS];
        memcpy(in_shape, shape, sizeof shape);
        in_shape[0] = total;
        cpar_tensor *in = fz_valid(f, dt, nd, in_shape);
        in_shape[0] = use_sizes ? rows[r] : total / n;
        cpar_tensor *out = fz_valid(f, dt, nd, in_shape);
        if (fz_p(f, pb)) fz_break(f, fz_u(f, 2) ? in : out);
        int o = mism ? (me ? CPAR_MAX : CPAR_SUM) : op;
        extra_bad = o < 0 || o > 2;
        st = cpar_reduce_scatter(g, in, out, (cpar_reduce_op)o, use_sizes ? rows : NULL);
        break;
    }
    case 3: {
        name = "cpar_all_to_all_single";
        int64_t in_s[4], out_s[4], ti = 0, to = 0;
        /* rank r sends in_s[j] = (r + 2j) % 3 rows to j; receives (i + 2r) % 3 from i */
        for (int j = 0; j < n; j++) in_s[j] = (r + 2 * j) % 3, out_s[j] = (j + 2 * r) % 3, ti += in_s[j], to += out_s[j];
        if (mism && me) in_s[0] += 1, ti += 1;
        if (!mism && fz_p(f, 8)) in_s[fz_u(f, (uint64_t)n)] = fz_p(f, 50) ? -2 : INT64_MAX - 1, extra_bad = true;
        int64_t a[CPAR_MAX_DIMS], b[CPAR_MAX_DIMS];
        memcpy(a, shape, sizeof a), memcpy(b, shape, sizeof b);
        a[0] = ti, b[0] = to;
        cpar_tensor *in = fz_valid(f, dt, nd, a), *out = fz_valid(f, dt, nd, b);
        if (fz_p(f, pb)) fz_break(f, fz_u(f, 2) ? in : out);
        st = cpar_all_to_all_single(g, in, out, out_s, in_s);
        break;
    }
    case 4: {
        name = "cpar_broadcast";
        int root = fz_p(f, 90) || mism ? (int)fz_u(f, (uint64_t)n) : fz_p(f, 50) ? -1 : n + (int)fz_u(f, 3);
        if (mism && me) root = (root + 1) % n;
        extra_bad = root < 0 || root >= n;
        cpar_tensor *buf = fz_valid(f, dt, nd, shape);
        if (fz_p(f, pb)) fz_break(f, buf);
        st = cpar_broadcast(g, buf, root);
        break;
    }
    case 5: {
        name = "cpar_ring_shift";
        if (mism && me) dt = (cpar_dtype)CPAR_I32, shape[0] = 1, nd = 1;
        if (mism && !me) dt = CPAR_F32, shape[0] = 1, nd = 1;
        cpar_tensor *in = fz_valid(f, dt, nd, shape), *out = fz_valid(f, dt, nd, shape);
        if (fz_p(f, pb)) fz_break(f, fz_u(f, 2) ? in : out);
        int shift = (int)fz_u(f, 7) - 3;
        st = cpar_ring_shift(g, in, out, mism ? 1 : shift);
        break;
    }
    case 6: {
        name = "cpar_sendrecv";
        int to = fz_p(f, 90) ? (r + 1) % n : fz_p(f, 50) ? n + (int)fz_u(f, 3) : -2 - (int)fz_u(f, 3);
        int from = to == (r + 1) % n ? (r + n - 1) % n : to;
        extra_bad = to >= n || to < -1;
        cpar_tensor *s = fz_valid(f, dt, nd, shape), *rv = fz_valid(f, dt, nd, shape);
        if (fz_p(f, pb)) fz_break(f, fz_u(f, 2) ? s : rv);
        st = cpar_sendrecv(g, s, to, rv, from);
        break;
    }
    case 7: {
        name = "cpar_group_split";
        /* mismatch: one rank splits while the others all-reduce (issue 13) */
        if (mism && me) {
            cpar_group *sub = NULL;
            st = cpar_group_split(g, 0, r, &sub);
            if (sub) cpar_group_destroy(sub);
        } else if (mism) {
            cpar_tensor *t = fz_valid(f, CPAR_F32, 1, (int64_t[]){3});
            st = cpar_all_reduce(g, t, t, CPAR_SUM);
        } else {
            int color = fz_p(f, 90) ? (int)fz_u(f, 3) : fz_p(f, 50) ? CPAR_SPLIT_NOCOLOR : -7;
            extra_bad = color < CPAR_SPLIT_NOCOLOR;
            cpar_group *sub = NULL;
            st = cpar_group_split(g, color, (int)fz_u(f, 5) - 2, fz_p(f, 5) ? NULL : &sub);
            if (st == CPAR_OK && sub) {
                cpar_tensor *t = fz_valid(f, CPAR_F32, 1, (int64_t[]){2});
                st = cpar_all_reduce(sub, t, t, CPAR_SUM);
                cpar_group_destroy(sub);
            }
        }
        break;
    }
    case 8: {
        name = "cpar_barrier";
        if (mism && me) {
            name = "cpar_all_gather";
            cpar_tensor *in = fz_valid(f, dt, nd, shape);
            int64_t o[CPAR_MAX_DIMS];
            memcpy(o, shape, sizeof o);
            o[0] *= n;
            st = cpar_all_gather(g, in, fz_valid(f, dt, nd, o), NULL);
        } else {
            extra_bad = !mism && fz_p(f, 3);
            st = cpar_barrier(extra_bad ? NULL : g);
        }
        break;
    }
    case 9:
    case 10: {
        static const char *const names[] = {"cpar_copy_to_tp_region", "cpar_reduce_from_tp_region",
                                            "cpar_scatter_to_tp_region", "cpar_gather_from_tp_region",
                                            "cpar_scatter_to_sp_region", "cpar_all_gather_last_dim_from_tp_region",
                                            "cpar_reduce_scatter_last_dim_to_tp_region", "cpar_all_to_all_sp2hp",
                                            "cpar_all_to_all_hp2sp", "cpar_gather_from_sp_region",
                                            "cpar_reduce_scatter_to_sp_region", "cpar_all_to_all"};
        int m = (int)fz_u(f, 12);
        name = names[m];
        cpar_tensor *in = fz_tensor(f, NULL, 0, pb, false), *out = fz_tensor(f, in, 40, pb, false);
        if (!f->bad[out - f->t] && out->ndim > 0 && fz_p(f, 50)) { /* a plausible scaled dim, buffer permitting */
            int d = fz_u(f, 2) ? 0 : out->ndim - 1;
            if (out->shape[d] % n == 0) out->shape[d] /= n;
        }
        int dir = fz_p(f, 92) ? (int)fz_u(f, 2) : fz_p(f, 50) ? -1 : 2 + (int)fz_u(f, 5);
        extra_bad = dir < 0 || dir > 1;
        for (int i = 0; i < n; i++) sizes[i] = (int64_t)fz_u(f, 3);
        const int64_t *sz = fz_u(f, 2) ? sizes : NULL;
        if (sz && fz_p(f, 8)) sizes[fz_u(f, (uint64_t)n)] = -3, extra_bad = true;
        switch (m) {
        case 0: st = cpar_copy_to_tp_region(g, in, out, (cpar_dir)dir); break;
        case 1: st = cpar_reduce_from_tp_region(g, in, out, (cpar_dir)dir); break;
        case 2: st = cpar_scatter_to_tp_region(g, in, out, (cpar_dir)dir); break;
        case 3: st = cpar_gather_from_tp_region(g, in, out, (cpar_dir)dir); break;
        case 4: st = cpar_scatter_to_sp_region(g, in, out, (cpar_dir)dir); break;
        case 5: st = cpar_all_gather_last_dim_from_tp_region(g, in, out, (cpar_dir)dir); break;
        case 6: st = cpar_reduce_scatter_last_dim_to_tp_region(g, in, out, (cpar_dir)dir); break;
        case 7: st = cpar_all_to_all_sp2hp(g, in, out, (cpar_dir)dir); break;
        case 8: st = cpar_all_to_all_hp2sp(g, in, out, (cpar_dir)dir); break;
        case 9: st = cpar_gather_from_sp_region(g, in, out, (cpar_dir)dir, fz_u(f, 2), sz); break;
        case 10: st = cpar_reduce_scatter_to_sp_region(g, in, out, (cpar_dir)dir, sz); break;
        default: st = cpar_all_to_all(g, in, out, (cpar_dir)dir, sz, fz_u(f, 2) ? sz : NULL); break;
        }
        /* a -3 split only matters where the splits are read: not in a
         * size-1 group's copy, not for the ops without sizes */
        if (sz && m < 9) extra_bad = dir < 0 || dir > 1;
        break;
    }
    case 11: {
        bool split = fz_u(f, 2);
        name = split ? "cpar_split_1d_chunk" : "cpar_gather_1d_chunks";
        cpar_tensor *in = fz_tensor(f, NULL, 0, pb, false), *out = fz_tensor(f, in, 30, pb, false);
        st = split ? cpar_split_1d_chunk(g, in, out) : cpar_gather_1d_chunks(g, in, out);
        break;
    }
    case 12: {
        bool shard = fz_u(f, 2);
        name = shard ? "cpar_cp_shard" : "cpar_cp_unshard";
        cpar_tensor *a = fz_tensor(f, NULL, 0, pb, false), *b = fz_tensor(f, a, 30, pb, false);
        int sd = fz_p(f, 90) ? (int)fz_u(f, 4) : fz_p(f, 50) ? -5 : 9;
        st = shard ? cpar_cp_shard(g, a, sd, fz_u(f, 2), b) : cpar_cp_unshard(g, a, sd, fz_u(f, 2), b);
        break;
    }
    case 13: {
        name = "cpar_vocab_parallel_cross_entropy_forward";
        int64_t ls[3] = {1 + (int64_t)fz_u(f, 3), 1 + (int64_t)fz_u(f, 2), 1 + (int64_t)fz_u(f, 5)};
        cpar_tensor *z = fz_valid(f, dt, 3, ls), *t = fz_valid(f, fz_u(f, 2) ? CPAR_I32 : CPAR_I64, 2, ls);
        cpar_tensor *loss = fz_valid(f, CPAR_F32, 2, ls);
        int64_t ss[3] = {ls[0], ls[1], 2};
        cpar_tensor *stats = fz_valid(f, CPAR_F32, 3, ss);
        cpar_tensor *pick[4] = {z, t, loss, stats};
        if (fz_p(f, pb * 3)) fz_break(f, pick[fz_u(f, 4)]);
        float alpha = fz_p(f, 90) ? 0.1f : NAN;
        extra_bad = isnan(alpha);
        st = cpar_vocab_parallel_cross_entropy_forward(g, z, t, alpha, loss, stats);
        break;
    }
    case 14: {
        name = "cpar_embedding_forward";
        int64_t ws[2] = {1 + (int64_t)fz_u(f, 8), 1 + (int64_t)fz_u(f, 4)}, is[2] = {1 + (int64_t)fz_u(f, 2), 1 + (int64_t)fz_u(f, 4)};
        int64_t os[3] = {is[0], is[1], ws[1]};
        bool rs = fz_u(f, 2);
        if (rs) os[0] = is[1] / n, os[1] = is[0];
        cpar_tensor *w = fz_valid(f, dt, 2, ws), *ids = fz_valid(f, fz_u(f, 2) ? CPAR_I32 : CPAR_I64, 2, is);
        cpar_tensor *out = fz_valid(f, dt, 3, os);
        cpar_tensor *pick[3] = {w, ids, out};
        if (fz_p(f, pb * 3)) fz_break(f, pick[fz_u(f, 3)]);
        st = cpar_embedding_forward(g, w, ids, out, rs);
        break;
    }
    case 16: {
        bool shard = fz_u(f, 2);
        name = shard ? "cpar_cp_shard_packed" : "cpar_cp_unshard_packed";
        st = fz_cp_packed(f, g, n, shard, &extra_bad);
        break;
    }
    case 17: {
        bool pre = fz_u(f, 2);
        name = pre ? "cpar_mamba_cp_pre_conv_ssm_packed" : "cpar_mamba_cp_post_conv_ssm_packed";
        st = fz_mamba_packed(f, g, n, pre, &extra_bad);
        break;
    }
    case 18: st = fz_linear(f, g, n, &name, &extra_bad); break;
    default: { /* 15 */
        bool ar = fz_u(f, 2);
        name = ar ? "cpar_grads_all_reduce" : "cpar_grad_norm";
        cpar_tensor *gr[3];
        int k = fz_p(f, 90) ? 1 + (int)fz_u(f, 3) : -1;
        for (int i = 0; i < 3; i++) {
            int64_t s2[CPAR_MAX_DIMS];
            int d2 = fz_shape(f, s2, 0);
            gr[i] = fz_valid(f, fz_p(f, 85) ? CPAR_F32 : fz_dtype(f), d2, s2);
            if (i < k && fz_p(f, pb)) fz_break(f, gr[i]); /* only the first k are read */
        }
        float norm = 0;
        extra_bad = k < 0;
        if (ar) st = cpar_grads_all_reduce(g, gr, k, fz_u(f, 2));
        else st = cpar_grad_norm(g, (const cpar_tensor *const *)gr, NULL, k, &norm);
        break;
    }
    }
    call->name = name;
    call->bad[r] = extra_bad || fz_any_bad(f);
    call->st[r] = st;
    call->mis[r] = local.misreported;
    memcpy(call->first_mis[r], local.first_mis, sizeof local.first_mis);
    fz_reset(f);
    return CPAR_OK;
}

static void fz_collectives(fz_counts *c, uint64_t seed, int calls, bool mismatches) {
    uint64_t s = seed;
    for (int i = 0; i < calls; i++) {
        fz_call call;
        memset(&call, 0, sizeof call);
        call.seed = tu_next(&s);
        call.n = 1 + (int)(tu_next(&s) % 4);
        call.diverge_rank = -1;
        call.c = c;
        call.name = NULL;
        static const int kinds[] = {0, 1, 2, 3, 4, 5, 7, 8};
        if (mismatches) {
            call.n = 2 + (int)(tu_next(&s) % 3);
            call.mismatch_kind = kinds[tu_next(&s) % (sizeof kinds / sizeof kinds[0])];
            if (call.mismatch_kind == 5) call.n = 2; /* both sides of the pair */
            call.diverge_rank = (int)(tu_next(&s) % (uint64_t)call.n);
        }
        for (int r = 0; r < 4; r++) call.st[r] = CPAR_OK;
        cpar_init_config cfg = {.backend = CPAR_BACKEND_HOST, .timeout_ms = 10000};
        cpar_spawn_with(call.n, &cfg, rank_coll, &call);
        if (!call.name) continue; /* a skipped draw */
        for (int r = 0; r < call.n; r++) {
            fz f = {.c = c, .rank = r};
            fz_note(&f, call.name, call.bad[r], call.st[r]);
            if (call.mis[r] && !c->misreported) memcpy(c->first_mis, call.first_mis[r], sizeof c->first_mis);
            c->misreported += call.mis[r];
            if (mismatches && call.st[r] != CPAR_ERR_INVALID && !c->mismatch_missed++)
                snprintf(c->first, sizeof c->first, "%s with rank %d diverging (kind %d, %d ranks): rank %d returned %s",
                         call.name, call.diverge_rank, call.mismatch_kind, call.n, r, cpar_status_string(call.st[r]));
        }
    }
}

/* ---- batches in forked processes ------------------------------------------------ */

typedef enum { FZ_PURE, FZ_LOCAL, FZ_COLL, FZ_MISMATCH } fz_family;

static void fz_batch(fz_family fam, uint64_t seed, fz_counts *c) {
    switch (fam) {
    case FZ_PURE: {
        fz f = {.s = seed, .c = c, .rank = -1};
        for (int i = 0; i < 400; i++) fz_pure(&f);
        break;
    }
    case FZ_LOCAL: {
        fz f = {.s = seed, .c = c, .rank = 0};
        cpar_init_config cfg = {.backend = CPAR_BACKEND_HOST, .timeout_ms = 10000};
        ck_assert_int_eq(cpar_spawn_with(1, &cfg, rank_local, &f), CPAR_OK);
        break;
    }
    case FZ_COLL: fz_collectives(c, seed, 120, false); break;
    default: fz_collectives(c, seed, 40, true); break;
    }
}

/* Run FZ_BATCHES batches of a family, each in a child process that writes its
 * counts into a pipe; a child that dies is a crash. */
static void fz_run(fz_family fam, const char *what) {
    fz_counts total;
    memset(&total, 0, sizeof total);
    long crashes = 0;
    char first_crash[128] = "";
    for (int b = 0; b < FZ_BATCHES; b++) {
        uint64_t seed = FZ_SEED * 31 + (uint64_t)fam * 1000003 + (uint64_t)b;
        int fd[2];
        ck_assert_int_eq(pipe(fd), 0);
        fflush(NULL);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
            close(fd[0]);
            fz_counts c;
            memset(&c, 0, sizeof c);
            fz_batch(fam, seed, &c);
            ssize_t w = write(fd[1], &c, sizeof c);
            _exit(w == (ssize_t)sizeof c ? 0 : 3);
        }
        close(fd[1]);
        fz_counts c;
        ssize_t got = read(fd[0], &c, sizeof c);
        close(fd[0]);
        int status = 0;
        waitpid(pid, &status, 0);
        if (got != (ssize_t)sizeof c || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            if (!crashes++)
                snprintf(first_crash, sizeof first_crash, "batch %d (seed %llu): %s %d", b, (unsigned long long)seed,
                         WIFSIGNALED(status) ? "signal" : "exit status",
                         WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
            continue;
        }
        total.calls += c.calls, total.ok += c.ok, total.rejected += c.rejected;
        if (c.invalid_accepted && !total.invalid_accepted) memcpy(total.first, c.first, sizeof c.first);
        if (c.mismatch_missed && !total.mismatch_missed && !total.invalid_accepted) memcpy(total.first, c.first, sizeof c.first);
        total.invalid_accepted += c.invalid_accepted;
        total.mismatch_missed += c.mismatch_missed;
        if (c.misreported && !total.misreported) memcpy(total.first_mis, c.first_mis, sizeof c.first_mis);
        total.misreported += c.misreported;
    }
    printf("fuzz %-11s %6ld calls: %6ld ok, %6ld rejected; %ld crashes, %ld invalid inputs accepted, %ld mismatches "
           "missed, %ld misreported\n", what, total.calls, total.ok, total.rejected, crashes, total.invalid_accepted,
           total.mismatch_missed, total.misreported);
    fflush(stdout);
    ck_assert_msg(crashes == 0, "fuzz %s: %ld crashed batches, first %s", what, crashes, first_crash);
    ck_assert_msg(total.invalid_accepted == 0, "fuzz %s: %ld invalid inputs accepted; first: %s", what,
                  total.invalid_accepted, total.first);
    ck_assert_msg(total.mismatch_missed == 0, "fuzz %s: %ld mismatches missed; first: %s", what, total.mismatch_missed,
                  total.first);
    ck_assert_msg(total.misreported == 0, "fuzz %s: %ld calls misreported; first: %s", what, total.misreported,
                  total.first_mis);
    ck_assert_int_gt(total.calls, 0);
}

/* ---- what the fuzzer found, pinned --------------------------------------------- */

/* cpar_rng_reserve wrapped the offset past 2^64 (later draws would reuse
 * the reserved blocks): now refused, and nothing advances. */
static cpar_status rank_reserve_wrap(cpar_ctx *ctx, void *arg) {
    (void)arg;
    cpar_rng_state far = {.seed = 7, .offset = UINT64_MAX - 3}, used, now;
    TU_OK(cpar_rng_set_state(ctx, NULL, &far));
    TU_FAILS(cpar_rng_reserve(ctx, 4, &used), CPAR_ERR_INVALID, "cpar_rng_reserve: blocks = 4, expected <= 3");
    TU_OK(cpar_rng_get_state(ctx, NULL, &now));
    ck_assert(now.seed == far.seed && now.offset == far.offset);
    TU_OK(cpar_rng_reserve(ctx, 3, &used)); /* up to the last block is fine */
    ck_assert(used.offset == far.offset);
    TU_OK(cpar_rng_get_state(ctx, NULL, &now));
    ck_assert(now.offset == UINT64_MAX);
    TU_OK(cpar_rng_reserve(ctx, 0, &used));
    TU_FAILS(cpar_rng_reserve(ctx, 1, &used), CPAR_ERR_INVALID, "would wrap past 2^64");
    return CPAR_OK;
}

START_TEST(test_fuzz_found) { TU_OK(tu_spawn(1, rank_reserve_wrap, NULL)); }
END_TEST

START_TEST(test_fuzz_pure) { fz_run(FZ_PURE, "pure"); }
END_TEST
START_TEST(test_fuzz_local) { fz_run(FZ_LOCAL, "local"); }
END_TEST
START_TEST(test_fuzz_collectives) { fz_run(FZ_COLL, "collectives"); }
END_TEST
START_TEST(test_fuzz_mismatch) { fz_run(FZ_MISMATCH, "mismatch"); }
END_TEST

int main(void) {
    Suite *s = suite_create("fuzz: random and extreme arguments over the public API");
    TCase *tc = tcase_create("fuzz");
    const char *only = getenv("CPAR_FUZZ_ONLY"); /* debugging: one family */
    if (!only) tcase_add_test(tc, test_fuzz_found);
    if (!only || !strcmp(only, "pure")) tcase_add_test(tc, test_fuzz_pure);
    if (!only || !strcmp(only, "local")) tcase_add_test(tc, test_fuzz_local);
    if (!only || !strcmp(only, "collectives")) tcase_add_test(tc, test_fuzz_collectives);
    if (!only || !strcmp(only, "mismatch")) tcase_add_test(tc, test_fuzz_mismatch);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
