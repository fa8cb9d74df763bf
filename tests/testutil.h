/* SPDX-License-Identifier: MIT */
/* testutil.h — helpers shared by cpar's Check suites.
 *
 * Every suite is built three times by `make test`: against the host-only
 * library (backend "host"), against the sim library (backend "sim": tensors
 * in simulated device memory, kernels from cpar_kernels.cu run on the CPU),
 * and against the nccl-sim library (backend "nccl": cpar.c compiled as for
 * GPUs, the NCCL backend over tests/ncclsim, kernels on the CPU). A test picks
 * its backend with tu_backend() and moves data with tu_upload / tu_download,
 * so the same test body runs on all three.
 *
 * Inside rank functions (threads started by cpar_spawn) ck_assert* may be
 * used: a failure ends the forked test process, which Check reports. */
#ifndef CPAR_TESTUTIL_H
#define CPAR_TESTUTIL_H

#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpar.h"
#include "suite.h" /* tu_run_suite */

#define TU_TIMEOUT_MS 20000 /* collective deadline inside tests */

/* ck_assert that a cpar call succeeded, printing the library's message. */
#define TU_OK(call)                                                                                          \
    do {                                                                                                     \
        cpar_status tu_st_ = (call);                                                                         \
        ck_assert_msg(tu_st_ == CPAR_OK, "%s -> %s: %s", #call, cpar_status_string(tu_st_),                  \
                      cpar_thread_last_error());                                                             \
    } while (0)

/* ck_assert_msg for loops over many elements: silent until cond fails
 * (a passing ck_assert costs a function call and a compare even when its
 * place is not recorded again: see tests/suite.h). */
#define TU_CHECK(cond, ...)                                                                                  \
    do {                                                                                                     \
        if (!(cond)) ck_abort_msg(__VA_ARGS__);                                                              \
    } while (0)

/* ck_assert that a call failed with status `want` and that the message
 * contains `needle` (the argument's name). */
#define TU_FAILS(call, want, needle)                                                                         \
    do {                                                                                                     \
        cpar_status tu_st_ = (call);                                                                         \
        ck_assert_msg(tu_st_ == (want), "%s -> %s, expected %s (%s)", #call, cpar_status_string(tu_st_),     \
                      cpar_status_string(want), cpar_thread_last_error());                                   \
        ck_assert_msg(strstr(cpar_thread_last_error(), (needle)) != NULL, "%s: message \"%s\" lacks \"%s\"", \
                      #call, cpar_thread_last_error(), (needle));                                            \
    } while (0)

/* The backend under test: $CPAR_TEST_BACKEND ("host", "device" or its old
 * name "sim", "nccl"), else the device backend in a sim build, the NCCL
 * backend where it is available (nccl-sim), and the host backend otherwise. */
static inline cpar_backend tu_backend(void) {
    const char *v = getenv("CPAR_TEST_BACKEND");
    if (v && *v && cpar_backend_parse(v) >= 0) return (cpar_backend)cpar_backend_parse(v);
    if (!cpar_backend_available(CPAR_BACKEND_NCCL) && cpar_backend_available(CPAR_BACKEND_DEVICE))
        return CPAR_BACKEND_DEVICE;
    return cpar_backend_available(CPAR_BACKEND_NCCL) ? CPAR_BACKEND_NCCL : CPAR_BACKEND_HOST;
}

/* Is the backend under test the NCCL backend (whose messages come partly
 * from NCCL, and which cannot see which peer a collective waits for)? */
static inline bool tu_is_nccl(void) { return tu_backend() == CPAR_BACKEND_NCCL; }

/* Do tensors live in (simulated) device memory, with the kernels of
 * cpar_kernels.cu? True on device and NCCL, false on host. */
static inline bool tu_on_device(void) { return tu_backend() != CPAR_BACKEND_HOST; }

/* cpar_spawn_with that proves it ran: it counts the ranks whose function
 * was called and fails the test unless all nranks were, so no test passes
 * because a backend silently ran nothing (its checks live in the ranks).
 * A job that fails may stop some ranks early, but every rank must start. */
typedef struct tu_counted {
    cpar_rank_fn fn;
    void *arg;
    int ran; /* updated atomically */
} tu_counted;

/* A rank that does nothing: for checking what cpar_init itself accepts. */
static inline cpar_status tu_rank_nothing(cpar_ctx *ctx, void *arg) {
    (void)ctx, (void)arg;
    return CPAR_OK;
}

static inline cpar_status tu_counted_rank(cpar_ctx *ctx, void *p) {
    tu_counted *c = (tu_counted *)p;
    __atomic_add_fetch(&c->ran, 1, __ATOMIC_SEQ_CST);
    return c->fn(ctx, c->arg);
}

static inline cpar_status tu_spawn_with(int nranks, const cpar_init_config *cfg, cpar_rank_fn fn, void *arg) {
    tu_counted c = {fn, arg, 0};
    cpar_status st = cpar_spawn_with(nranks, cfg, tu_counted_rank, &c);
    ck_assert_msg(c.ran == nranks, "cpar_spawn (%s backend) returned %s but called %d of %d rank functions",
                  cpar_backend_name(cfg->backend), cpar_status_string(st), c.ran, nranks);
    return st;
}

/* cpar_spawn on the backend under test with the test deadline. */
static inline cpar_status tu_spawn(int nranks, cpar_rank_fn fn, void *arg) {
    cpar_init_config cfg = {.backend = tu_backend(), .timeout_ms = TU_TIMEOUT_MS};
    return tu_spawn_with(nranks, &cfg, fn, arg);
}

/* splitmix64: a tiny deterministic generator for test data. */
static inline uint64_t tu_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1), never exactly zero. */
static inline double tu_uniform(uint64_t *s) {
    double u = (double)(tu_next(s) >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0;
    return u == 0.0 ? 0.5 : u;
}

/* Random values of dtype into host memory: floats in [-1, 1) (rounded to the
 * dtype), integers in [-1000, 1000) (u8: [1, 255]). */
static inline void tu_fill_random(void *p, cpar_dtype dt, int64_t n, uint64_t seed) {
    uint64_t s = seed * 0x2545f4914f6cdd1dull + 1;
    for (int64_t i = 0; i < n; i++) {
        double u = tu_uniform(&s);
        switch (dt) {
        case CPAR_F32: ((float *)p)[i] = (float)u; break;
        case CPAR_F16: ((uint16_t *)p)[i] = cpar_f32_to_f16((float)u); break;
        case CPAR_BF16: ((uint16_t *)p)[i] = cpar_f32_to_bf16((float)u); break;
        case CPAR_I32: ((int32_t *)p)[i] = (int32_t)(u * 1000.0); break;
        case CPAR_I64: ((int64_t *)p)[i] = (int64_t)(u * 1000.0) * 1000003; break;
        default: ((uint8_t *)p)[i] = (uint8_t)(1 + (tu_next(&s) % 255)); break;
        }
    }
}

/* Element i of host memory as double. */
static inline double tu_get(const void *p, cpar_dtype dt, int64_t i) {
    switch (dt) {
    case CPAR_F32: return ((const float *)p)[i];
    case CPAR_F16: return cpar_f16_to_f32(((const uint16_t *)p)[i]);
    case CPAR_BF16: return cpar_bf16_to_f32(((const uint16_t *)p)[i]);
    case CPAR_I32: return ((const int32_t *)p)[i];
    case CPAR_I64: return (double)((const int64_t *)p)[i];
    default: return ((const uint8_t *)p)[i];
    }
}

/* Store v (rounded to the dtype) as element i of host memory. */
static inline void tu_set(void *p, cpar_dtype dt, int64_t i, double v) {
    switch (dt) {
    case CPAR_F32: ((float *)p)[i] = (float)v; break;
    case CPAR_F16: ((uint16_t *)p)[i] = cpar_f32_to_f16((float)v); break;
    case CPAR_BF16: ((uint16_t *)p)[i] = cpar_f32_to_bf16((float)v); break;
    case CPAR_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case CPAR_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    default: ((uint8_t *)p)[i] = (uint8_t)v; break;
    }
}

/* Allocate a tensor on ctx's device holding a copy of host data. */
static inline cpar_tensor tu_upload(cpar_ctx *ctx, const void *host, cpar_dtype dt, int ndim, const int64_t *shape) {
    cpar_tensor t, h = cpar_tensor_make((void *)host, dt, ndim, shape, CPAR_HOST);
    TU_OK(cpar_tensor_alloc(ctx, dt, ndim, shape, &t));
    TU_OK(cpar_tensor_copy(ctx, &h, &t));
    return t;
}

/* Allocate a tensor on ctx's device filled with a poison pattern (0xFF bytes:
 * NaN for every float dtype, -1 for integers) so unwritten elements show. */
static inline cpar_tensor tu_alloc_poisoned(cpar_ctx *ctx, cpar_dtype dt, int ndim, const int64_t *shape) {
    cpar_tensor t;
    TU_OK(cpar_tensor_alloc(ctx, dt, ndim, shape, &t));
    size_t bytes = cpar_tensor_nbytes(&t);
    void *poison = malloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(poison);
    memset(poison, 0xff, bytes);
    cpar_tensor h = cpar_tensor_make(poison, dt, t.ndim, t.shape, CPAR_HOST);
    TU_OK(cpar_tensor_copy(ctx, &h, &t));
    free(poison);
    return t;
}

/* Copy a tensor (any device) into newly malloc'ed host memory. */
static inline void *tu_download(cpar_ctx *ctx, const cpar_tensor *t) {
    size_t bytes = cpar_tensor_nbytes(t);
    void *host = malloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(host);
    cpar_tensor h = cpar_tensor_make(host, t->dtype, t->ndim, t->shape, CPAR_HOST);
    TU_OK(cpar_tensor_copy(ctx, t, &h));
    return host;
}

/* Tolerance of a float dtype relative to the values' scale. */
static inline double tu_tol(cpar_dtype dt) {
    return dt == CPAR_F16 ? 2e-3 : dt == CPAR_BF16 ? 1.6e-2 : dt == CPAR_F32 ? 2e-6 : 0.0;
}

/* Compare n elements of got (host memory, dtype dt) with want (double): each
 * |got - want| <= tol * (1 + |want|), NaN in got always fails. Returns the
 * first failing index or -1; writes a message to msg. */
static inline int64_t tu_mismatch(const void *got, cpar_dtype dt, const double *want, int64_t n, double tol,
                                  char *msg, size_t cap) {
    for (int64_t i = 0; i < n; i++) {
        double g = tu_get(got, dt, i), w = want[i];
        if (isnan(g) || fabs(g - w) > tol * (1.0 + fabs(w))) {
            snprintf(msg, cap, "element %lld: got %.9g, expected %.9g (tol %.3g, dtype %s)", (long long)i, g, w, tol,
                     cpar_dtype_name(dt));
            return i;
        }
    }
    return -1;
}

#define TU_EXPECT_CLOSE(got, dt, want, n, tol)                                                               \
    do {                                                                                                     \
        char tu_msg_[256];                                                                                   \
        int64_t tu_i_ = tu_mismatch((got), (dt), (want), (n), (tol), tu_msg_, sizeof tu_msg_);               \
        ck_assert_msg(tu_i_ < 0, "%s", tu_msg_);                                                             \
    } while (0)

/* ck_assert that the last error message contains needle (a number, a name). */
#define TU_MSG_HAS(needle)                                                                                   \
    ck_assert_msg(strstr(cpar_thread_last_error(), (needle)) != NULL, "message \"%s\" lacks \"%s\"",         \
                  cpar_thread_last_error(), (needle))

/* n random elements of dtype dt (tu_fill_random) in new host memory. */
static inline void *tu_random_host(cpar_dtype dt, int64_t n, uint64_t seed) {
    void *p = malloc(n > 0 ? (size_t)n * cpar_dtype_size(dt) : 1);
    ck_assert_ptr_nonnull(p);
    tu_fill_random(p, dt, n, seed);
    return p;
}

/* n doubles uniform in [lo, hi) (tu_uniform's stream of seed) in new memory. */
static inline double *tu_random_doubles(int64_t n, double lo, double hi, uint64_t seed) {
    double *o = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    ck_assert_ptr_nonnull(o);
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 7;
    for (int64_t i = 0; i < n; i++) o[i] = lo + (hi - lo) * 0.5 * (tu_uniform(&s) + 1.0);
    return o;
}

/* n doubles as floats in new memory (host F32 master tensors). */
static inline float *tu_to_f32(const double *v, int64_t n) {
    float *o = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    ck_assert_ptr_nonnull(o);
    for (int64_t i = 0; i < n; i++) o[i] = (float)v[i];
    return o;
}

/* v as dtype dt holds it (rounded to nearest even for floats). */
static inline double tu_round(cpar_dtype dt, double v) {
    uint64_t buf = 0;
    tu_set(&buf, dt, 0, v);
    return tu_get(&buf, dt, 0);
}

/* First index where got and want (host memory, n elements of dt) differ
 * bitwise, a NaN matching any NaN for float dtypes; -1 when none. */
static inline int64_t tu_bits_mismatch(const void *got, const void *want, cpar_dtype dt, int64_t n) {
    size_t es = cpar_dtype_size(dt);
    for (int64_t i = 0; i < n; i++) {
        if (!memcmp((const char *)got + (size_t)i * es, (const char *)want + (size_t)i * es, es)) continue;
        if (cpar_dtype_is_float(dt) && isnan(tu_get(got, dt, i)) && isnan(tu_get(want, dt, i))) continue;
        return i;
    }
    return -1;
}

#define TU_EXPECT_SAME(got, want, dt, n)                                                                     \
    do {                                                                                                     \
        int64_t tu_i_ = tu_bits_mismatch((got), (want), (dt), (n));                                          \
        double tu_g_ = tu_i_ < 0 ? 0.0 : tu_get((got), (dt), tu_i_);                                         \
        double tu_w_ = tu_i_ < 0 ? 0.0 : tu_get((want), (dt), tu_i_);                                        \
        ck_assert_msg(tu_i_ < 0, "element %lld: got %.9g, expected %.9g (dtype %s)", (long long)tu_i_,       \
                      tu_g_, tu_w_, cpar_dtype_name(dt));                                                    \
    } while (0)

/* Attention dropout's keep decision for (bh, qpos, kpos) under state st and
 * probability p, written from cpar.h §12's definition on the public Philox
 * block (the library's own copies are cpar.c §18 and cpar_kernels.cu §16). */
static inline bool tu_attn_keep(cpar_rng_state st, double p, uint64_t bh, uint64_t qpos, uint64_t kpos) {
    const uint64_t c = st.offset + kpos / 4, sub = (bh + 1) * 4294967296ull + qpos;
    const uint32_t ctr[4] = {(uint32_t)c, (uint32_t)(c >> 32), (uint32_t)sub, (uint32_t)(sub >> 32)};
    const uint32_t key[2] = {(uint32_t)st.seed, (uint32_t)(st.seed >> 32)};
    uint32_t w[4];
    cpar_philox4x32_10_block(ctr, key, w);
    return (double)(w[kpos % 4] >> 8) / 16777216.0 >= p;
}

/* A table of loop tests: one test case per row, named, looped over
 * [0, count), with a common timeout. */
typedef struct tu_loop {
    const char *name;
    const TTest *test;
    int count;
} tu_loop;

static inline void tu_add_loops(Suite *s, const tu_loop *loops, size_t n, double timeout_s) {
    for (size_t i = 0; i < n; i++) {
        TCase *tc = tcase_create(loops[i].name);
        tcase_add_loop_test(tc, loops[i].test, 0, loops[i].count);
        tcase_set_timeout(tc, timeout_s);
        suite_add_tcase(s, tc);
    }
}

#endif /* CPAR_TESTUTIL_H */
