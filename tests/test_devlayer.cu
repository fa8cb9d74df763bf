/* SPDX-License-Identifier: MIT */
/* test_devlayer.cu — the device layer (cpar.h §16) against host references.
 *
 * Built by the sim build only (g++ -DCPAR_SIM -x c++ with tests/cudasim.h,
 * linked with cpar_kernels.cu and nothing else): every kernel runs through its
 * cpar_dev_* entry point on simulated device memory and is compared with a
 * plain fp64 reference computed here. Inputs are random (fixed seed, never
 * zero), sizes odd (1, 31, 33, 1000, 4097, never a block multiple), pointers
 * both 16-byte aligned and misaligned (vector and scalar paths), every dtype
 * each kernel takes, outputs poisoned with 0xFF bytes (NaN for every float
 * dtype) and surrounded by guard bytes that must stay untouched. The whole
 * suite runs once per simulator schedule.
 *
 * Contents
 *   1. Harness: device buffers with guards, random numbers, dtype codecs
 *   2. Runtime wrappers: memory, streams, events, errors
 *   3. Fill
 *   4. Cast
 *   5. axpby
 *   6. Reduce into
 *   7. Pitched 2-D copy
 *   8. Row reduce
 *   9. Grid-stride loops (sizes past the capped grid)
 *  10. GEMM
 *  11. Suite
 */
#define CPAR_INTERNAL /* drives the device layer (cpar.h §16) directly */
#include "cpar.h"
#include "tests/cudasim.h"
#include "tests/suite.h"

#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== 1. Harness ========================================================= */

#define CK_OK(call)                                                                                                    \
    do {                                                                                                               \
        cpar_status st_ = (call);                                                                                      \
        ck_assert_msg(st_ == CPAR_OK, "%s -> %d: %s", #call, (int)st_, cpar_dev_last_error());                         \
    } while (0)

/* ck_assert_msg for inner loops: Check records every passing assertion (a
 * write to its pipe), which would dominate the run time here. */
#define REQUIRE(cond, ...)                                                                                             \
    do {                                                                                                               \
        if (!(cond)) ck_abort_msg(__VA_ARGS__);                                                                        \
    } while (0)

/* call fails with want and its message mentions every listed word. */
static void expect_fail(cpar_status got, cpar_status want, const char *what, const char *const *words) {
    ck_assert_msg(got == want, "%s -> %d, expected %d (%s)", what, (int)got, (int)want, cpar_dev_last_error());
    for (; *words; words++)
        ck_assert_msg(strstr(cpar_dev_last_error(), *words) != NULL, "%s: message \"%s\" does not mention \"%s\"", what,
                      cpar_dev_last_error(), *words);
}
#define EXPECT_FAIL(call, want, ...)                                                                                   \
    do {                                                                                                               \
        static const char *const words_[] = {__VA_ARGS__, NULL};                                                       \
        expect_fail((call), (want), #call, words_);                                                                    \
    } while (0)

static const int64_t SIZES[] = {1, 31, 33, 1000, 4097};

static const cpar_dtype FLOATS[] = {CPAR_F32, CPAR_F16, CPAR_BF16};
static const cpar_dtype ALL_DTYPES[] = {CPAR_F32, CPAR_F16, CPAR_BF16, CPAR_I32, CPAR_I64, CPAR_U8};

static size_t dt_size(cpar_dtype dt) {
    return dt == CPAR_U8 ? 1 : dt == CPAR_F16 || dt == CPAR_BF16 ? 2 : dt == CPAR_I64 ? 8 : 4;
}
static const char *dt_name(cpar_dtype dt) {
    static const char *const names[] = {"f32", "f16", "bf16", "i32", "i64", "u8"};
    return names[dt];
}

/* A device allocation of `bytes` payload starting `offset` bytes past a 16-byte
 * boundary, with GUARD bytes of 0xFF on each side; the whole of it is
 * poisoned with 0xFF. h mirrors the whole allocation on the host. */
enum { GUARD = 64 };
typedef struct {
    unsigned char *base; /* device */
    unsigned char *p;    /* device payload */
    unsigned char *h;    /* host copy of the whole allocation after dbuf_fetch */
    size_t bytes, offset, total;
} dbuf;

static dbuf dbuf_new(size_t bytes, size_t offset) {
    dbuf b;
    b.bytes = bytes;
    b.offset = offset;
    b.total = bytes + offset + 2 * GUARD;
    CK_OK(cpar_dev_malloc((void **)&b.base, b.total));
    CK_OK(cpar_dev_memset(b.base, 0xFF, b.total, NULL));
    b.p = b.base + GUARD + offset;
    b.h = (unsigned char *)malloc(b.total);
    return b;
}

static void dbuf_put(dbuf *b, const void *h) { CK_OK(cpar_dev_memcpy(b->p, h, b->bytes, CPAR_COPY_H2D, NULL)); }

/* Download everything, check the guards, return the host view of the payload. */
static const unsigned char *dbuf_fetch(dbuf *b, const char *what) {
    CK_OK(cpar_dev_memcpy(b->h, b->base, b->total, CPAR_COPY_D2H, NULL));
    CK_OK(cpar_dev_stream_sync(NULL));
    for (size_t i = 0; i < b->total; i++) {
        if (i >= GUARD + b->offset && i < GUARD + b->offset + b->bytes) continue;
        REQUIRE(b->h[i] == 0xFF, "%s: byte %zd outside the output was written", what,
                (ptrdiff_t)i - (ptrdiff_t)(GUARD + b->offset));
    }
    return b->h + GUARD + b->offset;
}

static void dbuf_free(dbuf *b) {
    CK_OK(cpar_dev_free(b->base));
    free(b->h);
}

/* xorshift64*, fixed seed per test. */
static uint64_t rng_state;
static uint64_t rng_u64(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1DULL;
}
static double rng_unit(void) { return (double)(rng_u64() >> 11) * 0x1.0p-53; }
/* Magnitude in [lo, hi], random sign: never zero. */
static double rng_nonzero(double lo, double hi) { return (rng_u64() & 1 ? -1 : 1) * (lo + (hi - lo) * rng_unit()); }

/* Independent host codecs (round to nearest even), so the kernels are not
 * checked against the simulator's own conversions. */
static uint16_t f32_to_f16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax > 0x7f800000) return (uint16_t)(sign | 0x7e00);
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* >= 65520 rounds to inf */
    if (ax < 0x38800000) {                                  /* below 2^-14: subnormal (unit 2^-24) */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
    }
    const uint32_t e = ax - 0x38000000, r = e >> 13, rem = e & 0x1fff;
    return (uint16_t)(sign | (r + (rem > 0x1000 || (rem == 0x1000 && (r & 1)))));
}
static double f16_bits_to_f64(uint16_t h) {
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double s = h & 0x8000 ? -1 : 1;
    if (e == 0) return s * ldexp(m, -24);
    if (e == 31) return m ? NAN : s * INFINITY;
    return s * ldexp(1024 + m, e - 25);
}
static uint16_t f32_to_bf16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}
static double bf16_bits_to_f64(uint16_t b) {
    const uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* Element i of a host array of dtype dt, as a double. */
static double get(const void *p, cpar_dtype dt, int64_t i) {
    switch (dt) {
    case CPAR_F32: return ((const float *)p)[i];
    case CPAR_F16: return f16_bits_to_f64(((const uint16_t *)p)[i]);
    case CPAR_BF16: return bf16_bits_to_f64(((const uint16_t *)p)[i]);
    case CPAR_I32: return ((const int32_t *)p)[i];
    case CPAR_I64: return (double)((const int64_t *)p)[i];
    default: return ((const uint8_t *)p)[i];
    }
}
/* Store v rounded to dt (floats through fp32, as the kernels do). */
static void put(void *p, cpar_dtype dt, int64_t i, double v) {
    switch (dt) {
    case CPAR_F32: ((float *)p)[i] = (float)v; break;
    case CPAR_F16: ((uint16_t *)p)[i] = f32_to_f16_bits((float)v); break;
    case CPAR_BF16: ((uint16_t *)p)[i] = f32_to_bf16_bits((float)v); break;
    case CPAR_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case CPAR_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    default: ((uint8_t *)p)[i] = (uint8_t)v; break;
    }
}
/* Equal values, or both NaN. */
static bool same(double a, double b) { return a == b || (isnan(a) && isnan(b)); }

/* Unit roundoff-based bound for one rounding to dt (with a factor 2 margin). */
static double dt_eps(cpar_dtype dt) { return dt == CPAR_F16 ? 0x1.0p-10 : dt == CPAR_BF16 ? 0x1.0p-7 : 0x1.0p-22; }

/* ==== 2. Runtime wrappers ================================================ */

START_TEST(test_runtime) {
    const int devices = cpar_dev_count();
    ck_assert_int_ge(devices, 1);
    CK_OK(cpar_dev_set(0));
    EXPECT_FAIL(cpar_dev_set(-1), CPAR_ERR_INVALID, "cpar_dev_set", "device = -1");

    void *p = (void *)1;
    CK_OK(cpar_dev_malloc(&p, 0));
    ck_assert_ptr_null(p);
    EXPECT_FAIL(cpar_dev_malloc(NULL, 16), CPAR_ERR_INVALID, "cpar_dev_malloc", "p is NULL");
    EXPECT_FAIL(cpar_dev_malloc(&p, (size_t)1 << 62), CPAR_ERR_OOM,
                "cpar_dev_malloc: cudaMalloc(4611686018427387904 bytes) failed");
    ck_assert_ptr_null(p);
    /* A failure must not linger in CUDA's last-error slot, where the next
     * kernel's launch check would report it as its own. */
    float *f;
    CK_OK(cpar_dev_malloc((void **)&f, 64));
    CK_OK(cpar_dev_fill(f, CPAR_F32, 16, 1.0, NULL));

    /* No device: a count of 0 with the reason kept, and no error left behind
     * for the next launch. */
    cudasim_set_device_count(0);
    ck_assert_int_eq(cpar_dev_count(), 0);
    ck_assert_msg(strstr(cpar_dev_last_error(), "cpar_dev_count: cudaGetDeviceCount failed") != NULL, "%s",
                  cpar_dev_last_error());
    cudasim_set_device_count(devices);
    CK_OK(cpar_dev_fill(f, CPAR_F32, 16, 1.0, NULL));

    /* A GPU below sm_80 (a T4: 7.5) is not usable: a count of 0 with the
     * reason, where its first kernel would fail with "no kernel image". */
    cudasim_set_compute_capability(75);
    ck_assert_int_eq(cpar_dev_count(), 0);
    ck_assert_msg(strstr(cpar_dev_last_error(), "cpar_dev_count: GPU 0 has compute capability 7.5; cpar's kernels "
                                                "need 8.0 or newer") != NULL,
                  "%s", cpar_dev_last_error());
    cudasim_set_compute_capability(80);
    ck_assert_int_eq(cpar_dev_count(), devices);
    cudasim_set_compute_capability(0);

    /* Peer access: to itself a no-op, twice fine (CUDA's "already enabled"
     * not left for the next launch check); between GPUs without it
     * (consumer cards over PCIe) CPAR_ERR_UNSUPPORTED naming the pair. */
    EXPECT_FAIL(cpar_dev_peer_access(-1), CPAR_ERR_INVALID, "cpar_dev_peer_access", "peer = -1");
    CK_OK(cpar_dev_peer_access(0));
    bool can = false;
    EXPECT_FAIL(cpar_dev_peer_query(0, 0, NULL), CPAR_ERR_INVALID, "cpar_dev_peer_query", "can is NULL");
    EXPECT_FAIL(cpar_dev_peer_query(-1, 0, &can), CPAR_ERR_INVALID, "cpar_dev_peer_query", "device = -1");
    EXPECT_FAIL(cpar_dev_peer_query(0, -2, &can), CPAR_ERR_INVALID, "cpar_dev_peer_query", "peer = -2");
    CK_OK(cpar_dev_peer_query(0, 0, &can));
    ck_assert(can);
    if (devices >= 2) {
        CK_OK(cpar_dev_peer_query(1, 0, &can));
        ck_assert(can);
        cudasim_set_peer_access(0);
        CK_OK(cpar_dev_peer_query(1, 0, &can));
        ck_assert(!can);
        cudasim_set_peer_access(1);
        CK_OK(cpar_dev_peer_access(1));
        CK_OK(cpar_dev_peer_access(1));
        CK_OK(cpar_dev_fill(f, CPAR_F32, 16, 1.0, NULL));
        cudasim_set_peer_access(0);
        EXPECT_FAIL(cpar_dev_peer_access(1), CPAR_ERR_UNSUPPORTED,
                    "cpar_dev_peer_access: GPU 0 cannot access the memory of GPU 1 (no peer access)");
        cudasim_set_peer_access(1);
        CK_OK(cpar_dev_fill(f, CPAR_F32, 16, 1.0, NULL));

        /* A kernel on GPU 0 given GPU 1's memory faults unless GPU 0 enabled
         * peer access to it (the simulator checks kernels' pointer
         * arguments): the device backend's reductions between GPUs without
         * it stage through copies. */
        void *g1 = NULL;
        CK_OK(cpar_dev_set(1));
        CK_OK(cpar_dev_malloc(&g1, 64));
        CK_OK(cpar_dev_set(0));
        cudasim_set_peer_access(1); /* GPUs that have it; the pairs enabled above forgotten */
        EXPECT_FAIL(cpar_dev_fill(g1, CPAR_F32, 16, 1.0, NULL), CPAR_ERR_CUDA, "cpar_dev_fill", "illegal memory access");
        CK_OK(cpar_dev_peer_access(1));
        CK_OK(cpar_dev_fill(g1, CPAR_F32, 16, 1.0, NULL));
        CK_OK(cpar_dev_sync());
        CK_OK(cpar_dev_set(1));
        CK_OK(cpar_dev_free(g1));
        CK_OK(cpar_dev_set(0));
    }
    CK_OK(cpar_dev_free(f));
    CK_OK(cpar_dev_free(NULL));

    /* memset + memcpy round trip on two streams ordered by an event. */
    enum { N = 1000 };
    unsigned char h[N], back[N];
    for (int i = 0; i < N; i++) h[i] = (unsigned char)(i * 7 + 1);
    cpar_dev_stream s1, s2;
    cpar_dev_event ev;
    CK_OK(cpar_dev_stream_create(&s1));
    CK_OK(cpar_dev_stream_create(&s2));
    CK_OK(cpar_dev_event_create(&ev));
    void *a, *b;
    CK_OK(cpar_dev_malloc(&a, N));
    CK_OK(cpar_dev_malloc(&b, N));
    CK_OK(cpar_dev_memcpy(a, h, N, CPAR_COPY_H2D, s1));
    CK_OK(cpar_dev_memset((char *)a + 10, 0xAB, 20, s1));
    CK_OK(cpar_dev_event_record(ev, s1));
    CK_OK(cpar_dev_stream_wait_event(s2, ev));
    CK_OK(cpar_dev_memcpy(b, a, N, CPAR_COPY_D2D, s2));
    CK_OK(cpar_dev_memcpy(back, b, N, CPAR_COPY_D2H, s2));
    CK_OK(cpar_dev_stream_sync(s2));
    bool done = false;
    CK_OK(cpar_dev_stream_query(s2, &done));
    ck_assert(done);
    CK_OK(cpar_dev_event_sync(ev));
    CK_OK(cpar_dev_sync());
    for (int i = 0; i < N; i++) REQUIRE(back[i] == (i >= 10 && i < 30 ? 0xAB : h[i]), "memcpy round trip: byte %d", i);
    unsigned char hh[N];
    CK_OK(cpar_dev_memcpy(hh, h, N, CPAR_COPY_H2H, NULL));
    ck_assert_int_eq(memcmp(hh, h, N), 0);

    EXPECT_FAIL(cpar_dev_memcpy(NULL, h, 4, CPAR_COPY_H2D, NULL), CPAR_ERR_INVALID, "cpar_dev_memcpy", "dst is NULL");
    EXPECT_FAIL(cpar_dev_memset(NULL, 0, 4, NULL), CPAR_ERR_INVALID, "cpar_dev_memset", "p is NULL");
    EXPECT_FAIL(cpar_dev_stream_query(s1, NULL), CPAR_ERR_INVALID, "done is NULL");
    EXPECT_FAIL(cpar_dev_event_record(NULL, s1), CPAR_ERR_INVALID, "e is NULL");
    CK_OK(cpar_dev_memcpy(NULL, NULL, 0, CPAR_COPY_D2D, NULL));
    CK_OK(cpar_dev_memset(NULL, 0, 0, NULL));

    /* cpar's streams are non-blocking: they neither wait for the legacy NULL
     * stream's work nor hold it up, so a caller that hands cpar data made
     * there synchronises first. The lazy stream mode shows the difference. */
    unsigned long long seed = 0;
    cudasim_streams mode = cudasim_get_streams(&seed);
    cudasim_set_streams(CUDASIM_STREAMS_LAZY, 0);
    float hv[4];
    CK_OK(cpar_dev_fill(a, CPAR_F32, 4, 1.0, NULL));
    CK_OK(cpar_dev_sync());
    CK_OK(cpar_dev_fill(a, CPAR_F32, 4, 2.0, NULL)); /* legacy stream: not run yet */
    CK_OK(cpar_dev_memcpy(b, a, 16, CPAR_COPY_D2D, s1));
    CK_OK(cpar_dev_memcpy(hv, b, 16, CPAR_COPY_D2H, s1));
    CK_OK(cpar_dev_stream_sync(s1));
    REQUIRE(hv[0] == 1.0f, "a cpar stream waited for the legacy stream (got %g): it is blocking", hv[0]);
    CK_OK(cpar_dev_sync());
    CK_OK(cpar_dev_memcpy(b, a, 16, CPAR_COPY_D2D, s1));
    CK_OK(cpar_dev_memcpy(hv, b, 16, CPAR_COPY_D2H, s1));
    CK_OK(cpar_dev_stream_sync(s1));
    REQUIRE(hv[0] == 2.0f, "after the synchronisation: %g", hv[0]);
    cudasim_set_streams(mode, seed);

    CK_OK(cpar_dev_free(a));
    CK_OK(cpar_dev_free(b));
    CK_OK(cpar_dev_event_destroy(ev));
    CK_OK(cpar_dev_stream_destroy(s1));
    CK_OK(cpar_dev_stream_destroy(s2));
    CK_OK(cpar_dev_stream_destroy(NULL));
    CK_OK(cpar_dev_event_destroy(NULL));
}
END_TEST

/* ==== 3. Fill ============================================================ */

/* p[0..n) = value at a byte offset off from 16-byte alignment. */
static void check_fill(cpar_dtype dt, int64_t n, size_t off, double value) {
    const size_t es = dt_size(dt);
    unsigned char want[8];
    put(want, dt, 0, dt <= CPAR_BF16 ? value : trunc(value));
    dbuf b = dbuf_new((size_t)n * es, off);
    CK_OK(cpar_dev_fill(b.p, dt, n, value, NULL));
    const unsigned char *got = dbuf_fetch(&b, "fill");
    for (int64_t i = 0; i < n; i++)
        REQUIRE(memcmp(got + i * es, want, es) == 0, "fill %s n=%lld off=%zu value=%g: element %lld differs",
                dt_name(dt), (long long)n, off, value, (long long)i);
    dbuf_free(&b);
}

START_TEST(test_fill) {
    /* Values that round in every float dtype (65519 -> 65504 in f16, 1e-6 is
     * an f16 subnormal); integers truncated toward zero. */
    const double fvals[] = {1.2345678901234, -65519.0, 1e-6, -INFINITY};
    for (cpar_dtype dt : ALL_DTYPES)
        for (int64_t n : SIZES)
            for (size_t off = 0; off <= dt_size(dt); off += dt_size(dt)) /* 16-byte aligned, then not */
                check_fill(dt, n, off, dt <= CPAR_BF16 ? fvals[(n + off) % 4] : dt == CPAR_U8 ? 200.5 : -123456.75);
    CK_OK(cpar_dev_fill(NULL, CPAR_F32, 0, 1.0, NULL));
    EXPECT_FAIL(cpar_dev_fill(NULL, CPAR_F32, -1, 1.0, NULL), CPAR_ERR_INVALID, "cpar_dev_fill", "n = -1");
    EXPECT_FAIL(cpar_dev_fill(NULL, CPAR_F32, 5, 1.0, NULL), CPAR_ERR_INVALID, "p is NULL");
    void *p;
    CK_OK(cpar_dev_malloc(&p, 64));
    EXPECT_FAIL(cpar_dev_fill(p, CPAR_I32, 4, 3e9, NULL), CPAR_ERR_INVALID, "not representable in i32");
    EXPECT_FAIL(cpar_dev_fill(p, CPAR_I64, 4, NAN, NULL), CPAR_ERR_INVALID, "i64");
    EXPECT_FAIL(cpar_dev_fill(p, CPAR_U8, 4, 256, NULL), CPAR_ERR_INVALID, "u8");
    EXPECT_FAIL(cpar_dev_fill(p, (cpar_dtype)7, 4, 0, NULL), CPAR_ERR_INVALID, "dtype 7");
    CK_OK(cpar_dev_free(p));
}
END_TEST

/* ==== 4. Cast ============================================================ */

/* Random values spanning every float dtype's range, plus the edge cases. */
static double cast_input(int64_t i) {
    static const double special[] = {INFINITY, -INFINITY, NAN, 65519.0, 65520.0, 3e38, 1e-7, -3e-8, 1.00048828125};
    if (i % 97 < 9) return special[i % 97];
    return rng_nonzero(1e-3, 1e3);
}

/* dst = cast(src), src shifted by mis elements (scalar path when that breaks
 * 16-byte alignment); exact against the host codecs. */
static void check_cast(cpar_dtype sd, cpar_dtype dd, int64_t n, int mis) {
    unsigned char *h = (unsigned char *)malloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) put(h, sd, i, cast_input(i));
    dbuf src = dbuf_new((size_t)n * dt_size(sd), mis * dt_size(sd)), dst = dbuf_new((size_t)n * dt_size(dd), 0);
    dbuf_put(&src, h);
    CK_OK(cpar_dev_cast(dst.p, dd, src.p, sd, n, NULL));
    const unsigned char *got = dbuf_fetch(&dst, "cast");
    unsigned char want[4];
    for (int64_t i = 0; i < n; i++) {
        put(want, dd, 0, get(h, sd, i));
        REQUIRE(same(get(got, dd, i), get(want, dd, 0)), "cast %s->%s n=%lld mis=%d: [%lld] = %g, want %g", dt_name(sd),
                dt_name(dd), (long long)n, mis, (long long)i, get(got, dd, i), get(want, dd, 0));
    }
    dbuf_free(&src);
    dbuf_free(&dst);
    free(h);
}

START_TEST(test_cast) {
    rng_state = 0x5EED0001;
    for (cpar_dtype sd : FLOATS)
        for (cpar_dtype dd : FLOATS)
            for (int64_t n : SIZES)
                for (int mis = 0; mis < 2; mis++) check_cast(sd, dd, n, mis);
    /* Equal non-float dtypes are a copy. */
    for (cpar_dtype dt : {CPAR_I32, CPAR_I64, CPAR_U8}) {
        const int64_t n = 33;
        unsigned char h[33 * 8];
        for (size_t i = 0; i < sizeof h; i++) h[i] = (unsigned char)rng_u64();
        dbuf src = dbuf_new(n * dt_size(dt), 0), dst = dbuf_new(n * dt_size(dt), 0);
        dbuf_put(&src, h);
        CK_OK(cpar_dev_cast(dst.p, dt, src.p, dt, n, NULL));
        ck_assert_int_eq(memcmp(dbuf_fetch(&dst, "cast copy"), h, n * dt_size(dt)), 0);
        dbuf_free(&src);
        dbuf_free(&dst);
    }
    void *p;
    CK_OK(cpar_dev_malloc(&p, 64));
    EXPECT_FAIL(cpar_dev_cast(p, CPAR_I32, p, CPAR_F32, 4, NULL), CPAR_ERR_INVALID, "cpar_dev_cast", "f32", "i32");
    EXPECT_FAIL(cpar_dev_cast(p, CPAR_F16, p, CPAR_U8, 4, NULL), CPAR_ERR_INVALID, "u8", "f16");
    EXPECT_FAIL(cpar_dev_cast(p, CPAR_F16, NULL, CPAR_F32, 4, NULL), CPAR_ERR_INVALID, "src is NULL");
    EXPECT_FAIL(cpar_dev_cast(p, CPAR_F16, p, CPAR_F32, -3, NULL), CPAR_ERR_INVALID, "n = -3");
    CK_OK(cpar_dev_free(p));
}
END_TEST

/* ==== 5. axpby =========================================================== */

/* y = alpha x + beta y with x shifted by mis elements. beta == 0 leaves y
 * NaN (its 0xFF poison) before the call: it must not be read. */
static void check_axpby(cpar_dtype dt, int64_t n, float alpha, float beta, int mis) {
    const size_t es = dt_size(dt), bytes = (size_t)n * es;
    unsigned char *hx = (unsigned char *)malloc(bytes), *hy = (unsigned char *)malloc(bytes);
    for (int64_t i = 0; i < n; i++) {
        put(hx, dt, i, rng_nonzero(0.01, 10));
        put(hy, dt, i, rng_nonzero(0.01, 10));
    }
    dbuf x = dbuf_new(bytes, mis * es), y = dbuf_new(bytes, 0);
    dbuf_put(&x, hx);
    if (beta != 0) dbuf_put(&y, hy);
    CK_OK(cpar_dev_axpby(alpha, x.p, beta, y.p, dt, n, NULL));
    const unsigned char *got = dbuf_fetch(&y, "axpby");
    for (int64_t i = 0; i < n; i++) {
        const double ax = alpha * get(hx, dt, i), by = beta == 0 ? 0 : beta * get(hy, dt, i);
        REQUIRE(fabs(get(got, dt, i) - (ax + by)) <= dt_eps(dt) * (fabs(ax) + fabs(by)),
                "axpby %s n=%lld a=%g b=%g mis=%d: [%lld] = %g, want %g", dt_name(dt), (long long)n, alpha, beta, mis,
                (long long)i, get(got, dt, i), ax + by);
    }
    dbuf_free(&x);
    dbuf_free(&y);
    free(hx);
    free(hy);
}

START_TEST(test_axpby) {
    rng_state = 0x5EED0002;
    const float coef[][2] = {{1.5f, -0.75f}, {2.0f, 0.0f}, {-1.0f, 1.0f}, {0.3f, 2.5f}};
    for (cpar_dtype dt : FLOATS)
        for (int64_t n : SIZES)
            for (int c = 0; c < 4; c++)
                for (int mis = 0; mis < 2; mis++) check_axpby(dt, n, coef[c][0], coef[c][1], mis);
    EXPECT_FAIL(cpar_dev_axpby(1, NULL, 1, NULL, CPAR_I32, 4, NULL), CPAR_ERR_INVALID, "cpar_dev_axpby", "x is NULL");
    void *p;
    CK_OK(cpar_dev_malloc(&p, 64));
    EXPECT_FAIL(cpar_dev_axpby(1, p, 1, p, CPAR_I32, 4, NULL), CPAR_ERR_INVALID, "dtype i32");
    CK_OK(cpar_dev_axpby(1, NULL, 1, NULL, CPAR_F32, 0, NULL));
    CK_OK(cpar_dev_free(p));
}
END_TEST

/* ==== 6. Reduce into ===================================================== */

/* Integers of any dtype as int64; random integers cover the full range of the
 * dtype (so sums overflow and must wrap), u8 never zero. */
static int64_t get_int(const void *p, cpar_dtype dt, int64_t i) {
    return dt == CPAR_I32   ? ((const int32_t *)p)[i]
           : dt == CPAR_I64 ? ((const int64_t *)p)[i]
                            : ((const uint8_t *)p)[i];
}
static void put_int(void *p, cpar_dtype dt, int64_t i, uint64_t v) {
    if (dt == CPAR_I32)
        ((int32_t *)p)[i] = (int32_t)(uint32_t)v;
    else if (dt == CPAR_I64)
        ((int64_t *)p)[i] = (int64_t)v;
    else
        ((uint8_t *)p)[i] = (uint8_t)v;
}
static uint64_t rand_int(cpar_dtype dt, int64_t i) {
    if (i % 7 == 0) return dt == CPAR_I32 ? INT32_MAX : dt == CPAR_I64 ? INT64_MAX : 255;
    return dt == CPAR_U8 ? 1 + rng_u64() % 255 : rng_u64();
}

/* acc = op(acc, src), acc shifted by mis elements. Floats: NaN at some
 * positions of each operand (fmaxf semantics: a NaN operand loses) and exact
 * comparison (one fp32 rounding of an exact double sum); integers: exact with
 * wrap-around sums. */
static void check_reduce_into(cpar_dtype sd, cpar_reduce_op op, int64_t n, int mis) {
    const bool isf = sd <= CPAR_BF16;
    const cpar_dtype ad = isf ? CPAR_F32 : sd;
    const size_t ses = dt_size(sd), aes = dt_size(ad);
    unsigned char *hs = (unsigned char *)malloc(n * ses), *ha = (unsigned char *)malloc(n * aes);
    for (int64_t i = 0; i < n; i++) {
        if (isf) {
            put(hs, sd, i, i % 13 == 0 ? NAN : rng_nonzero(0.01, 100));
            put(ha, ad, i, i % 11 == 0 ? NAN : rng_nonzero(0.01, 100));
        } else {
            put_int(hs, sd, i, rand_int(sd, i));
            put_int(ha, ad, i, rand_int(ad, i + 3));
        }
    }
    dbuf acc = dbuf_new(n * aes, mis * aes), src = dbuf_new(n * ses, 0);
    dbuf_put(&acc, ha);
    dbuf_put(&src, hs);
    CK_OK(cpar_dev_reduce_into(acc.p, src.p, sd, n, op, NULL));
    const unsigned char *got = dbuf_fetch(&acc, "reduce_into");
    for (int64_t i = 0; i < n; i++) {
        if (isf) {
            const double a = get(ha, ad, i), b = get(hs, sd, i);
            const double want = op == CPAR_SUM ? (float)(a + b) : op == CPAR_MAX ? fmax(a, b) : fmin(a, b);
            REQUIRE(same(get(got, ad, i), want), "reduce_into %s op=%d n=%lld mis=%d: [%lld] = %g, want %g",
                    dt_name(sd), (int)op, (long long)n, mis, (long long)i, get(got, ad, i), want);
        } else {
            const int64_t a = get_int(ha, ad, i), b = get_int(hs, sd, i);
            unsigned char want[8];
            put_int(want, ad, 0,
                    op == CPAR_SUM   ? (uint64_t)a + (uint64_t)b
                    : op == CPAR_MAX ? (a > b ? a : b)
                                     : (a < b ? a : b));
            REQUIRE(get_int(got, ad, i) == get_int(want, ad, 0),
                    "reduce_into %s op=%d n=%lld mis=%d: [%lld] = %lld, want %lld", dt_name(sd), (int)op, (long long)n,
                    mis, (long long)i, (long long)get_int(got, ad, i), (long long)get_int(want, ad, 0));
        }
    }
    dbuf_free(&acc);
    dbuf_free(&src);
    free(hs);
    free(ha);
}

START_TEST(test_reduce_into) {
    rng_state = 0x5EED0003;
    for (cpar_dtype sd : ALL_DTYPES)
        for (int op = 0; op < CPAR_REDUCE_OP_COUNT; op++)
            for (int64_t n : SIZES)
                for (int mis = 0; mis < 2; mis++) check_reduce_into(sd, (cpar_reduce_op)op, n, mis);
    void *p;
    CK_OK(cpar_dev_malloc(&p, 64));
    EXPECT_FAIL(cpar_dev_reduce_into(p, p, CPAR_F32, 4, (cpar_reduce_op)3, NULL), CPAR_ERR_INVALID,
                "cpar_dev_reduce_into", "op = 3");
    EXPECT_FAIL(cpar_dev_reduce_into(p, p, (cpar_dtype)6, 4, CPAR_SUM, NULL), CPAR_ERR_INVALID, "dtype 6");
    EXPECT_FAIL(cpar_dev_reduce_into(NULL, p, CPAR_F32, 4, CPAR_SUM, NULL), CPAR_ERR_INVALID, "acc is NULL");
    CK_OK(cpar_dev_free(p));
}
END_TEST

/* ==== 7. Pitched 2-D copy ================================================ */

/* Copy rows x row_bytes from a src_pitch layout to a dst_pitch layout; the
 * bytes between rows of dst (its padding) must stay untouched. */
static void check_copy_2d(cpar_copy_kind kind, size_t rows, size_t row_bytes, size_t src_pitch, size_t dst_pitch,
                          size_t src_off, size_t dst_off) {
    const size_t src_bytes = (rows - 1) * src_pitch + row_bytes, dst_bytes = (rows - 1) * dst_pitch + row_bytes;
    unsigned char *h = (unsigned char *)malloc(src_bytes);
    for (size_t i = 0; i < src_bytes; i++) h[i] = (unsigned char)(rng_u64() % 255); /* never 0xFF */
    const bool dev_src = kind == CPAR_COPY_D2H || kind == CPAR_COPY_D2D;
    const bool dev_dst = kind == CPAR_COPY_H2D || kind == CPAR_COPY_D2D;
    dbuf src = dbuf_new(src_bytes, src_off), dst = dbuf_new(dst_bytes, dst_off);
    dbuf_put(&src, h);
    /* Host-side ends live in the host mirrors, same offsets and guards. */
    unsigned char *hsrc = src.h + GUARD + src_off, *hdst = dst.h + GUARD + dst_off;
    if (!dev_src) memcpy(hsrc, h, src_bytes);
    if (!dev_dst) memset(dst.h, 0xFF, dst.total);
    CK_OK(cpar_dev_copy_2d(dev_dst ? dst.p : hdst, dst_pitch, dev_src ? src.p : hsrc, src_pitch, row_bytes, rows, kind,
                           NULL));
    CK_OK(cpar_dev_stream_sync(NULL));
    if (dev_dst) {
        dbuf_fetch(&dst, "copy_2d");
    } else {
        for (size_t i = 0; i < dst.total; i++)
            if (i < GUARD + dst_off || i >= GUARD + dst_off + dst_bytes)
                REQUIRE(dst.h[i] == 0xFF, "copy_2d: host byte %zu outside the output was written", i);
    }
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < dst_pitch && r * dst_pitch + c < dst_bytes; c++) {
            const unsigned char want = c < row_bytes ? h[r * src_pitch + c] : 0xFF;
            REQUIRE(hdst[r * dst_pitch + c] == want,
                    "copy_2d kind=%d rows=%zu row_bytes=%zu pitches %zu/%zu offs %zu/%zu: byte (%zu,%zu) = %d, want %d",
                    (int)kind, rows, row_bytes, src_pitch, dst_pitch, src_off, dst_off, r, c, hdst[r * dst_pitch + c],
                    want);
        }
    dbuf_free(&src);
    dbuf_free(&dst);
    free(h);
}

START_TEST(test_copy_2d) {
    rng_state = 0x5EED0004;
    /* D2D: each word width (16, 8, 4, 2, 1) through pointers, pitches and row length. */
    const size_t rows_list[] = {1, 3, 33, 1000};
    for (size_t rows : rows_list) {
        check_copy_2d(CPAR_COPY_D2D, rows, 48, 64, 80, 0, 0);       /* 16-byte words */
        check_copy_2d(CPAR_COPY_D2D, rows, 40, 48, 56, 8, 0);       /* 8 */
        check_copy_2d(CPAR_COPY_D2D, rows, 100, 100, 132, 0, 4);    /* 4 */
        check_copy_2d(CPAR_COPY_D2D, rows, 30, 34, 30, 2, 6);       /* 2 */
        check_copy_2d(CPAR_COPY_D2D, rows, 31, 33, 35, 1, 3);       /* 1 */
        check_copy_2d(CPAR_COPY_D2D, rows, 4097, 4097, 4097, 1, 0); /* contiguous */
        check_copy_2d(CPAR_COPY_D2D, rows, 4112, 8208, 4112, 0, 0); /* long rows, 257 words */
        check_copy_2d(CPAR_COPY_D2D, rows, 1, 7, 3, 0, 0);          /* one-byte rows */
        /* Aligned pointers and pitches: the row length alone limits the word. */
        check_copy_2d(CPAR_COPY_D2D, rows, 24, 32, 48, 0, 0); /* 8 */
        check_copy_2d(CPAR_COPY_D2D, rows, 20, 32, 48, 0, 0); /* 4 */
        check_copy_2d(CPAR_COPY_D2D, rows, 18, 32, 48, 0, 0); /* 2 */
        check_copy_2d(CPAR_COPY_D2D, rows, 17, 32, 48, 0, 0); /* 1 */
    }
    for (cpar_copy_kind kind : {CPAR_COPY_H2D, CPAR_COPY_D2H, CPAR_COPY_H2H}) {
        check_copy_2d(kind, 33, 100, 132, 100, 0, 4);
        check_copy_2d(kind, 31, 31, 31, 31, 1, 3);
        check_copy_2d(kind, 1, 1000, 0, 0, 0, 0);
    }
    void *p;
    CK_OK(cpar_dev_malloc(&p, 4096));
    EXPECT_FAIL(cpar_dev_copy_2d(p, 8, p, 32, 16, 4, CPAR_COPY_D2D, NULL), CPAR_ERR_INVALID, "cpar_dev_copy_2d",
                "dst_pitch = 8");
    EXPECT_FAIL(cpar_dev_copy_2d(p, 32, p, 8, 16, 4, CPAR_COPY_D2D, NULL), CPAR_ERR_INVALID, "src_pitch = 8");
    EXPECT_FAIL(cpar_dev_copy_2d(p, 32, NULL, 32, 16, 4, CPAR_COPY_D2D, NULL), CPAR_ERR_INVALID, "src is NULL");
    CK_OK(cpar_dev_copy_2d(NULL, 0, NULL, 0, 0, 5, CPAR_COPY_D2D, NULL));
    CK_OK(cpar_dev_free(p));
}
END_TEST

/* ==== 8. Row reduce ====================================================== */

/* fp64 reference with the kernel's documented semantics: MAX ignores NaN
 * (fmax from -inf); LSE is NaN with any NaN, +inf with any +inf, -inf when
 * every element is -inf. */
static double ref_row(const void *in, cpar_dtype dt, int64_t r, int64_t cols, cpar_row_op op, double *scale) {
    double sum = 0, abs_sum = 0, m = -INFINITY;
    bool nan = false;
    for (int64_t c = 0; c < cols; c++) {
        const double x = get(in, dt, r * cols + c);
        sum += x;
        abs_sum += fabs(x);
        m = fmax(m, x);
        nan |= isnan(x) != 0;
    }
    if (op == CPAR_ROW_SUM) {
        *scale = abs_sum;
        return sum;
    }
    if (op == CPAR_ROW_MAX || m == -INFINITY || m == INFINITY) {
        *scale = 0;
        return op == CPAR_ROW_LOGSUMEXP && nan ? NAN : m;
    }
    double s = 0;
    for (int64_t c = 0; c < cols; c++) s += exp(get(in, dt, r * cols + c) - m);
    const double lse = m + log(s);
    *scale = 1 + fabs(lse);
    return lse;
}

/* out[r] = op(in[r, :]) with in shifted by mis elements. Rows (when there
 * are several) cycle through five kinds: random, all -inf, one +inf, -inf
 * mixed in, one NaN. */
static void check_row_reduce(cpar_dtype dt, cpar_row_op op, int64_t rows, int64_t cols, int mis) {
    const size_t es = dt_size(dt);
    unsigned char *h = (unsigned char *)malloc(rows * cols * es);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            double x = rng_nonzero(0.01, 8);
            const int kind = rows > 1 ? (int)(r % 5) : 0;
            if (kind == 1) x = -INFINITY;
            if (kind == 2 && c == cols / 2) x = INFINITY;
            if (kind == 3 && c % 3 == 0) x = -INFINITY;
            if (kind == 4 && c == cols - 1) x = NAN;
            put(h, dt, r * cols + c, x);
        }
    dbuf in = dbuf_new(rows * cols * es, mis * es), out = dbuf_new(rows * 4, 0);
    dbuf_put(&in, h);
    CK_OK(cpar_dev_row_reduce((float *)out.p, in.p, dt, rows, cols, op, NULL));
    const float *got = (const float *)dbuf_fetch(&out, "row_reduce");
    for (int64_t r = 0; r < rows; r++) {
        double scale;
        const double want = ref_row(h, dt, r, cols, op, &scale);
        REQUIRE(same(got[r], want) || fabs(got[r] - want) <= 1e-5 * scale,
                "row_reduce %s op=%d %lldx%lld mis=%d: row %lld = %.9g, want %.9g", dt_name(dt), (int)op,
                (long long)rows, (long long)cols, mis, (long long)r, got[r], want);
    }
    dbuf_free(&in);
    dbuf_free(&out);
    free(h);
}

START_TEST(test_row_reduce) {
    rng_state = 0x5EED0005;
    /* Up to 1024 columns a warp takes a row, beyond a block. */
    const int64_t rows_list[] = {1, 3, 33}, cols_list[] = {1, 31, 33, 1000, 1024, 1025, 4097, 4104};
    for (cpar_dtype dt : FLOATS)
        for (int op = 0; op < 3; op++)
            for (int64_t rows : rows_list)
                for (int64_t cols : cols_list)
                    for (int mis = 0; mis < 2; mis++) check_row_reduce(dt, (cpar_row_op)op, rows, cols, mis);
    /* cols == 0: the identities. */
    dbuf out = dbuf_new(3 * 4, 0);
    const float want0[] = {0.0f, -INFINITY, -INFINITY};
    for (int opi = 0; opi < 3; opi++) {
        CK_OK(cpar_dev_row_reduce((float *)out.p, NULL, CPAR_F32, 3, 0, (cpar_row_op)opi, NULL));
        const float *got = (const float *)dbuf_fetch(&out, "row_reduce cols=0");
        for (int r = 0; r < 3; r++) ck_assert(got[r] == want0[opi]);
    }
    dbuf_free(&out);
    void *p;
    CK_OK(cpar_dev_malloc(&p, 64));
    EXPECT_FAIL(cpar_dev_row_reduce((float *)p, p, CPAR_I32, 2, 2, CPAR_ROW_SUM, NULL), CPAR_ERR_INVALID,
                "cpar_dev_row_reduce", "dtype i32");
    EXPECT_FAIL(cpar_dev_row_reduce((float *)p, p, CPAR_F32, 2, -2, CPAR_ROW_SUM, NULL), CPAR_ERR_INVALID, "cols = -2");
    EXPECT_FAIL(cpar_dev_row_reduce(NULL, p, CPAR_F32, 2, 2, CPAR_ROW_SUM, NULL), CPAR_ERR_INVALID, "out is NULL");
    EXPECT_FAIL(cpar_dev_row_reduce((float *)p, p, CPAR_F32, 2, 2, (cpar_row_op)3, NULL), CPAR_ERR_INVALID, "op = 3");
    CK_OK(cpar_dev_free(p));
}
END_TEST

/* ==== 9. Grid-stride loops ================================================
 * Grids are capped at 4096 blocks, so only sizes past the cap make a thread
 * take a second trip round its loop: for each kernel, one case past it. */

START_TEST(test_grid_stride) {
    rng_state = 0x5EED0008;
    const int64_t big = (1 << 22) + 5; /* > 4096 blocks x 256 threads x 4 floats */
    check_fill(CPAR_F32, big, 0, 0.1);
    check_fill(CPAR_F32, (1 << 20) + 3, 4, -2.5); /* scalar path: > 4096 x 256 */
    check_cast(CPAR_F32, CPAR_BF16, big, 0);
    check_axpby(CPAR_F16, (1 << 20) + 3, 1.5f, -0.75f, 1);
    check_reduce_into(CPAR_F32, CPAR_SUM, big, 0);
    check_copy_2d(CPAR_COPY_D2D, (1 << 20) + 3, 2, 4, 6, 0, 0); /* 1-word rows: rows wrap */
    check_copy_2d(CPAR_COPY_D2D, 2, (16 << 20) + 48, (16 << 20) + 64, (16 << 20) + 80, 0, 0); /* columns wrap */
    check_row_reduce(CPAR_F32, CPAR_ROW_LOGSUMEXP, 4099, 1025, 0); /* block per row: > 4096 rows */
    check_row_reduce(CPAR_BF16, CPAR_ROW_LOGSUMEXP, 32771, 33, 0); /* warp per row: > 4096 x 8 rows */
}
END_TEST

/* ==== 10. GEMM =========================================================== */

/* Naive column-major fp64 GEMM of one batch entry, with cuBLAS's argument
 * semantics; C is read only when beta != 0. Returns the error scale of each
 * element in scale (|alpha| sum |a||b| + |beta||c|). */
static void ref_gemm(int ta, int tb, int m, int n, int k, double alpha, const void *A, int lda, const void *B, int ldb,
                     double beta, const void *C, int ldc, cpar_dtype abt, cpar_dtype ct, double *out, double *scale) {
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double acc = 0, mag = 0;
            for (int l = 0; l < k; l++) {
                const double a = get(A, abt, ta ? l + (int64_t)i * lda : i + (int64_t)l * lda);
                const double b = get(B, abt, tb ? j + (int64_t)l * ldb : l + (int64_t)j * ldb);
                acc += a * b;
                mag += fabs(a * b);
            }
            const double c = beta == 0 ? 0 : get(C, ct, i + (int64_t)j * ldc);
            out[i + j * m] = alpha * acc + beta * c;
            scale[i + j * m] = fabs(alpha) * mag + fabs(beta * c);
        }
}

static void check_gemm(cpar_dev_blas h, cpar_dtype abt, cpar_dtype ct, int ta, int tb, int m, int n, int k, float alpha,
                       float beta, int batch) {
    /* Leading dimensions padded by 3 and batch strides by 5 elements: the padding must stay untouched. */
    const int lda = (ta ? k : m) + 3, ldb = (tb ? n : k) + 3, ldc = m + 3;
    const int64_t sa = (int64_t)lda * (ta ? m : k) + 5, sb = (int64_t)ldb * (tb ? k : n) + 5, sc = (int64_t)ldc * n + 5;
    const size_t abs_ = dt_size(abt), cs = dt_size(ct);
    const int64_t na = sa * batch, nb = sb * batch, nc = sc * batch;
    unsigned char *hA = (unsigned char *)malloc(na * abs_), *hB = (unsigned char *)malloc(nb * abs_),
                  *hC = (unsigned char *)malloc(nc * cs);
    for (int64_t i = 0; i < na; i++) put(hA, abt, i, rng_nonzero(0.1, 2));
    for (int64_t i = 0; i < nb; i++) put(hB, abt, i, rng_nonzero(0.1, 2));
    memset(hC, 0xFF, nc * cs); /* NaN everywhere; real values inside the matrices when beta != 0 */
    if (beta != 0)
        for (int bi = 0; bi < batch; bi++)
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) put(hC, ct, bi * sc + i + (int64_t)j * ldc, rng_nonzero(0.1, 2));
    dbuf A = dbuf_new(na * abs_, 0), B = dbuf_new(nb * abs_, 0), C = dbuf_new(nc * cs, 0);
    dbuf_put(&A, hA);
    dbuf_put(&B, hB);
    dbuf_put(&C, hC);
    CK_OK(
        cpar_dev_gemm(h, NULL, ta, tb, m, n, k, alpha, A.p, abt, lda, sa, B.p, ldb, sb, beta, C.p, ct, ldc, sc, batch));
    const unsigned char *got = dbuf_fetch(&C, "gemm");
    double *want = (double *)malloc(sizeof(double) * m * n), *scale = (double *)malloc(sizeof(double) * m * n);
    /* fp32 accumulation over k terms, then one rounding to C's dtype. */
    const double tol = k * 0x1.0p-23 + dt_eps(ct);
    for (int bi = 0; bi < batch; bi++) {
        ref_gemm(ta, tb, m, n, k, alpha, hA + bi * sa * abs_, lda, hB + bi * sb * abs_, ldb, beta, hC + bi * sc * cs,
                 ldc, abt, ct, want, scale);
        for (int64_t i = 0; i < sc && bi * sc + i < nc; i++) {
            const int64_t row = i % ldc, col = i / ldc;
            const double g = get(got, ct, bi * sc + i);
            if (row >= m || col >= n) { /* padding: untouched */
                REQUIRE(same(g, get(hC, ct, bi * sc + i)), "gemm wrote padding at batch %d offset %lld", bi,
                        (long long)i);
                continue;
            }
            const double w = want[row + col * m];
            REQUIRE(fabs(g - w) <= tol * scale[row + col * m],
                    "gemm %s->%s %c%c m=%d n=%d k=%d a=%g b=%g batch %d/%d: C(%lld,%lld) = %.9g, want %.9g",
                    dt_name(abt), dt_name(ct), ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, beta, bi, batch,
                    (long long)row, (long long)col, g, w);
        }
    }
    dbuf_free(&A);
    dbuf_free(&B);
    dbuf_free(&C);
    free(hA);
    free(hB);
    free(hC);
    free(want);
    free(scale);
}

START_TEST(test_gemm) {
    rng_state = 0x5EED0006;
    cpar_dev_blas h;
    CK_OK(cpar_dev_blas_create(&h));
    const int shapes[][3] = {{1, 1, 1}, {33, 17, 31}, {5, 64, 100}, {7, 5, 0}}; /* k = 0: C = beta * C */
    const float coef[][2] = {{1, 0}, {0.5f, -1.25f}, {-2, 1}};
    for (cpar_dtype abt : FLOATS)
        for (int same_c = abt != CPAR_F32; same_c < 2; same_c++) /* C in f32, and in A/B's dtype */
            for (int t = 0; t < 4; t++)
                for (int s = 0; s < 4; s++)
                    for (int c = 0; c < 3; c++)
                        for (int batch : {1, 3}) {
                            const cpar_dtype ct = same_c ? abt : CPAR_F32;
                            check_gemm(h, abt, ct, t & 1, t >> 1, shapes[s][0], shapes[s][1], shapes[s][2], coef[c][0],
                                       coef[c][1], batch);
                        }
    CK_OK(cpar_dev_blas_destroy(h));
}
END_TEST

START_TEST(test_gemm_edges) {
    rng_state = 0x5EED0007;
    cpar_dev_blas h;
    CK_OK(cpar_dev_blas_create(&h));
    float *C;
    CK_OK(cpar_dev_malloc((void **)&C, 64 * sizeof(float)));
    /* k == 0: C = beta * C; A and B are never read, so they may be NULL. */
    float hc[12], back[12];
    for (int i = 0; i < 12; i++) hc[i] = (float)rng_nonzero(0.5, 2);
    CK_OK(cpar_dev_memcpy(C, hc, sizeof hc, CPAR_COPY_H2D, NULL));
    CK_OK(cpar_dev_gemm(h, NULL, 0, 0, 3, 4, 0, 1.0f, NULL, CPAR_F32, 3, 0, NULL, 1, 0, 2.0f, C, CPAR_F32, 3, 0, 1));
    CK_OK(cpar_dev_memcpy(back, C, sizeof back, CPAR_COPY_D2H, NULL));
    CK_OK(cpar_dev_stream_sync(NULL));
    for (int i = 0; i < 12; i++) ck_assert(back[i] == 2 * hc[i]);
    /* Empty products are no-ops, even with NULL operands. */
    CK_OK(cpar_dev_gemm(h, NULL, 0, 0, 0, 4, 5, 1, NULL, CPAR_F32, 1, 0, NULL, 5, 0, 0, NULL, CPAR_F32, 1, 0, 1));
    CK_OK(cpar_dev_gemm(h, NULL, 0, 0, 3, 4, 5, 1, NULL, CPAR_F32, 3, 0, NULL, 5, 0, 0, NULL, CPAR_F32, 3, 0, 0));

    /* Bad arguments name the argument. */
    const void *A = C, *B = C;
#define GEMM(ta, tb, m, n, k, abt, lda, sa, ldb, ct, ldc, batch)                                                       \
    cpar_dev_gemm(h, NULL, ta, tb, m, n, k, 1.0f, A, abt, lda, sa, B, ldb, 0, 0.0f, C, ct, ldc, 0, batch)
    EXPECT_FAIL(GEMM(0, 0, -1, 2, 2, CPAR_F32, 2, 0, 2, CPAR_F32, 2, 1), CPAR_ERR_INVALID, "cpar_dev_gemm", "m = -1");
    EXPECT_FAIL(GEMM(0, 0, 2, 2, -3, CPAR_F32, 2, 0, 2, CPAR_F32, 2, 1), CPAR_ERR_INVALID, "k = -3");
    EXPECT_FAIL(GEMM(0, 0, 2, 2, 2, CPAR_F32, 2, 0, 2, CPAR_F32, 2, -1), CPAR_ERR_INVALID, "batch = -1");
    EXPECT_FAIL(GEMM(0, 0, 4, 2, 3, CPAR_F32, 3, 0, 3, CPAR_F32, 4, 1), CPAR_ERR_INVALID, "lda = 3", ">= 4");
    EXPECT_FAIL(GEMM(1, 0, 4, 2, 3, CPAR_F32, 2, 0, 3, CPAR_F32, 4, 1), CPAR_ERR_INVALID, "lda = 2", ">= 3");
    EXPECT_FAIL(GEMM(0, 0, 4, 2, 3, CPAR_F32, 4, 0, 2, CPAR_F32, 4, 1), CPAR_ERR_INVALID, "ldb = 2", ">= 3");
    EXPECT_FAIL(GEMM(0, 1, 4, 5, 3, CPAR_F32, 4, 0, 3, CPAR_F32, 4, 1), CPAR_ERR_INVALID, "ldb = 3", ">= 5");
    EXPECT_FAIL(GEMM(0, 0, 4, 2, 3, CPAR_F32, 4, 0, 3, CPAR_F32, 3, 1), CPAR_ERR_INVALID, "ldc = 3", ">= 4");
    EXPECT_FAIL(GEMM(0, 0, 2, 2, 2, CPAR_F32, 2, -8, 2, CPAR_F32, 2, 2), CPAR_ERR_INVALID, "stride_a = -8");
    EXPECT_FAIL(GEMM(0, 0, 2, 2, 2, CPAR_F32, 2, 0, 2, CPAR_F16, 2, 1), CPAR_ERR_INVALID, "A/B f32", "C f16");
    EXPECT_FAIL(GEMM(0, 0, 2, 2, 2, CPAR_BF16, 2, 0, 2, CPAR_F16, 2, 1), CPAR_ERR_INVALID, "A/B bf16", "C f16");
    EXPECT_FAIL(GEMM(0, 0, 2, 2, 2, CPAR_I32, 2, 0, 2, CPAR_I32, 2, 1), CPAR_ERR_INVALID, "A/B i32");
    A = NULL;
    EXPECT_FAIL(GEMM(0, 0, 2, 2, 2, CPAR_F32, 2, 0, 2, CPAR_F32, 2, 1), CPAR_ERR_INVALID, "A is NULL");
#undef GEMM
    EXPECT_FAIL(cpar_dev_gemm(NULL, NULL, 0, 0, 2, 2, 2, 1, C, CPAR_F32, 2, 0, C, 2, 0, 0, C, CPAR_F32, 2, 0, 1),
                CPAR_ERR_INVALID, "h is NULL");
    EXPECT_FAIL(cpar_dev_blas_create(NULL), CPAR_ERR_INVALID, "cpar_dev_blas_create", "h is NULL");
    CK_OK(cpar_dev_free(C));
    CK_OK(cpar_dev_blas_destroy(h));
}
END_TEST

/* ==== 11. Suite ========================================================== */

/* ---- the argument checks of the later sections' entry points ----------------------
 * Their kernels are tested against host references by the backend suites
 * (ops: gelu; inference: rmsnorm; mamba: conv1d and replica sums); here each
 * entry point must refuse bad arguments with a line naming them, and accept
 * empty work without touching its pointers. */
START_TEST(test_entry_point_args) {
    void *p;
    CK_OK(cpar_dev_malloc(&p, 4096));
    float *f = (float *)p;
    EXPECT_FAIL(cpar_dev_gelu(NULL, NULL, p, CPAR_F32, 4, NULL), CPAR_ERR_INVALID, "cpar_dev_gelu", "x is NULL");
    EXPECT_FAIL(cpar_dev_gelu(p, NULL, NULL, CPAR_F32, 4, NULL), CPAR_ERR_INVALID, "out is NULL");
    EXPECT_FAIL(cpar_dev_gelu(p, NULL, p, CPAR_I32, 4, NULL), CPAR_ERR_INVALID, "dtype i32");
    EXPECT_FAIL(cpar_dev_gelu(p, NULL, p, CPAR_F32, -1, NULL), CPAR_ERR_INVALID, "n = -1");
    CK_OK(cpar_dev_gelu(NULL, NULL, NULL, CPAR_F32, 0, NULL));

    EXPECT_FAIL(cpar_dev_rmsnorm(NULL, NULL, p, CPAR_F32, 2, 4, 1e-5f, p, NULL), CPAR_ERR_INVALID, "cpar_dev_rmsnorm",
                "x is NULL");
    EXPECT_FAIL(cpar_dev_rmsnorm(p, NULL, NULL, CPAR_F32, 2, 4, 1e-5f, p, NULL), CPAR_ERR_INVALID, "weight is NULL");
    EXPECT_FAIL(cpar_dev_rmsnorm(p, NULL, p, CPAR_F32, 2, 4, 1e-5f, NULL, NULL), CPAR_ERR_INVALID, "y is NULL");
    EXPECT_FAIL(cpar_dev_rmsnorm(p, NULL, p, CPAR_U8, 2, 4, 1e-5f, p, NULL), CPAR_ERR_INVALID, "dtype u8");
    EXPECT_FAIL(cpar_dev_rmsnorm(p, NULL, p, CPAR_F32, 2, 4, -1.f, p, NULL), CPAR_ERR_INVALID, "eps = -1");
    EXPECT_FAIL(cpar_dev_rmsnorm(p, NULL, p, CPAR_F32, -2, 4, 1e-5f, p, NULL), CPAR_ERR_INVALID, "rows = -2");
    CK_OK(cpar_dev_rmsnorm(NULL, NULL, NULL, CPAR_F32, 0, 4, 1e-5f, NULL, NULL));

    EXPECT_FAIL(cpar_dev_rmsnorm_backward(p, p, NULL, CPAR_F32, 2, 4, 1e-5f, p, NULL, f + 512, NULL), CPAR_ERR_INVALID,
                "cpar_dev_rmsnorm_backward", "dy is NULL");
    EXPECT_FAIL(cpar_dev_rmsnorm_backward(p, p, p, CPAR_F32, 2, 4, 1e-5f, p, NULL, NULL, NULL), CPAR_ERR_INVALID,
                "scratch is NULL");
    EXPECT_FAIL(cpar_dev_rmsnorm_backward(p, p, p, CPAR_I64, 2, 4, 1e-5f, p, NULL, f + 512, NULL), CPAR_ERR_INVALID,
                "dtype i64");
    EXPECT_FAIL(cpar_dev_rmsnorm_backward(p, p, p, CPAR_F32, 2, -4, 1e-5f, p, NULL, f + 512, NULL), CPAR_ERR_INVALID,
                "h = -4");
    CK_OK(cpar_dev_rmsnorm_backward(NULL, NULL, NULL, CPAR_F32, 3, 0, 1e-5f, NULL, NULL, NULL, NULL));
    REQUIRE(cpar_dev_rmsnorm_backward_scratch_bytes(0, 4) >= sizeof(float), "rmsnorm scratch for no rows");
    REQUIRE(cpar_dev_rmsnorm_backward_scratch_bytes(1000, 8) == (2 * 1000 + 63 * 8) * sizeof(float),
            "rmsnorm scratch: 2 floats a row, then 63 chunks of 16 rows (the last partial) x 8 columns");

    /* the deterministic embedding gradient's scratch (the sort keys) */
    EXPECT_FAIL(cpar_dev_embedding_grad(p, CPAR_F32, p, CPAR_I32, 1, 4, 2, 0, 3, false, f, true, NULL, NULL),
                CPAR_ERR_INVALID, "cpar_dev_embedding_grad", "scratch is NULL");
    EXPECT_FAIL(cpar_dev_embedding_grad(p, CPAR_F32, p, CPAR_I32, 1, 4, 2, 0, 3, false, f, true, (char *)p + 4, NULL),
                CPAR_ERR_INVALID, "scratch", "8-byte alignment");
    EXPECT_FAIL(cpar_dev_embedding_grad(p, CPAR_F32, p, CPAR_I32, 1 << 16, 1 << 16, 2, 0, 3, false, f, true, p, NULL),
                CPAR_ERR_INVALID, "4294967296 tokens", "< 2^31");
    CK_OK(cpar_dev_embedding_grad(NULL, CPAR_F32, NULL, CPAR_I32, 0, 4, 2, 0, 3, false, NULL, true, NULL, NULL));
    REQUIRE(cpar_dev_embedding_grad_scratch_bytes(0) == 0 && cpar_dev_embedding_grad_scratch_bytes(5) == 64,
            "embedding scratch: 0 for no tokens, 8 bytes per key padded to a power of two");

    float *q = (float *)p;
    EXPECT_FAIL(cpar_dev_adamw(NULL, q, q, q, NULL, CPAR_F32, 4, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.f, 0.1f, 0.01f, 1.f, NULL),
                CPAR_ERR_INVALID, "cpar_dev_adamw", "master is NULL");
    EXPECT_FAIL(cpar_dev_adamw(q, q, q, NULL, NULL, CPAR_F32, 4, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.f, 0.1f, 0.01f, 1.f, NULL),
                CPAR_ERR_INVALID, "grad is NULL");
    EXPECT_FAIL(cpar_dev_adamw(q, q, q, q, p, CPAR_I32, 4, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.f, 0.1f, 0.01f, 1.f, NULL),
                CPAR_ERR_INVALID, "param dtype i32");
    EXPECT_FAIL(cpar_dev_adamw(q, q, q, q, NULL, CPAR_F32, -1, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.f, 0.1f, 0.01f, 1.f, NULL),
                CPAR_ERR_INVALID, "n = -1");
    EXPECT_FAIL(cpar_dev_adamw(q, q, q, q, NULL, CPAR_F32, 4, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.f, 0.f, 0.01f, 1.f, NULL),
                CPAR_ERR_INVALID, "bias corrections");
    CK_OK(cpar_dev_adamw(NULL, NULL, NULL, NULL, NULL, CPAR_F32, 0, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.f, 0.1f, 0.01f, 1.f, NULL));
    EXPECT_FAIL(cpar_dev_sum_squares(NULL, 4, q, q + 64, NULL), CPAR_ERR_INVALID, "cpar_dev_sum_squares", "x is NULL");
    EXPECT_FAIL(cpar_dev_sum_squares(q, 4, NULL, q + 64, NULL), CPAR_ERR_INVALID, "out is NULL");
    EXPECT_FAIL(cpar_dev_sum_squares(q, 4, q + 8, NULL, NULL), CPAR_ERR_INVALID, "scratch is NULL");
    EXPECT_FAIL(cpar_dev_sum_squares(q, -4, q + 8, q + 64, NULL), CPAR_ERR_INVALID, "n = -4");
    ck_assert_uint_eq(cpar_dev_sum_squares_scratch(0), 0);
    ck_assert_uint_ge(cpar_dev_sum_squares_scratch(1000000), sizeof(float));

    const cpar_dev_conv_rows rows = {{4, 0, 0}, {0, 0, 0}}, bad_rows = {{3, 0, 0}, {0, 0, 0}};
    EXPECT_FAIL(cpar_dev_mamba_conv1d_forward(p, 4, CPAR_F32, p, NULL, CPAR_F32, rows, 2, 1, 4, 5, false, p, NULL),
                CPAR_ERR_INVALID, "cpar_dev_mamba_conv1d_forward", "k = 5");
    EXPECT_FAIL(cpar_dev_mamba_conv1d_forward(p, 3, CPAR_F32, p, NULL, CPAR_F32, rows, 2, 1, 4, 3, false, p, NULL),
                CPAR_ERR_INVALID, "x_pitch = 3");
    EXPECT_FAIL(cpar_dev_mamba_conv1d_forward(p, 4, CPAR_F32, p, NULL, CPAR_F32, bad_rows, 2, 1, 4, 3, false, p, NULL),
                CPAR_ERR_INVALID, "row segments");
    EXPECT_FAIL(cpar_dev_mamba_conv1d_forward(p, 4, CPAR_I32, p, NULL, CPAR_F32, rows, 2, 1, 4, 3, false, p, NULL),
                CPAR_ERR_INVALID, "i32");
    EXPECT_FAIL(cpar_dev_mamba_conv1d_forward(NULL, 4, CPAR_F32, p, NULL, CPAR_F32, rows, 2, 1, 4, 3, false, p, NULL),
                CPAR_ERR_INVALID, "x is NULL");
    EXPECT_FAIL(cpar_dev_mamba_conv1d_backward(p, 4, CPAR_F32, p, NULL, CPAR_F32, rows, 2, 1, 4, 3, false, p, p, f + 512,
                                               0, f + 256, NULL, NULL),
                CPAR_ERR_INVALID, "cpar_dev_mamba_conv1d_backward", "nsplit = 0");
    CK_OK(cpar_dev_mamba_conv1d_forward(NULL, 0, CPAR_F32, NULL, NULL, CPAR_F32, cpar_dev_conv_rows{}, 0, 1, 0, 3,
                                        false, NULL, NULL));
    EXPECT_FAIL(cpar_dev_mamba_sum_replicas(NULL, 1, 1, p, 1, 1, 1, 1, 1, 1, 1, CPAR_F32, NULL), CPAR_ERR_INVALID,
                "cpar_dev_mamba_sum_replicas", "dst is NULL");
    EXPECT_FAIL(cpar_dev_mamba_sum_replicas(p, 1, 1, p, 1, 1, 1, -1, 1, 1, 1, CPAR_F32, NULL), CPAR_ERR_INVALID,
                "groups = -1");
    EXPECT_FAIL(cpar_dev_mamba_sum_replicas(p, 1, 1, p, 1, 1, 1, 1, 1, 1, 1, CPAR_U8, NULL), CPAR_ERR_INVALID,
                "dtype u8");
    CK_OK(cpar_dev_free(p));
}
END_TEST

/* Every case runs under each simulator schedule (the order in which fibers
 * and blocks resume): a missing barrier gives a wrong answer under one. The
 * grid-stride case is about trip counts, not interleavings, and costs ~8 s a
 * run, so it runs under the first schedule only. */
/* The deterministic embedding gradient's sort (cpar_kernels.cu §14): after
 * the call, the scratch holds the keys (id - first) << 32 | token of the
 * owned tokens in ascending order, then ~0 padding; dweight rows are the
 * fp32 sums in token order (bitwise). Token counts across one and several
 * shared-memory sort blocks (1024 keys). */
static void check_emb_sort(int64_t b, int64_t s, int64_t first, int64_t v_local, int64_t H) {
    const int64_t n = b * s;
    int64_t npow = 1;
    while (npow < n) npow *= 2;
    REQUIRE(cpar_dev_embedding_grad_scratch_bytes(n) == (size_t)npow * 8, "scratch bytes for %lld tokens", (long long)n);
    int32_t *ids = (int32_t *)malloc((size_t)n * 4);
    float *dout = (float *)malloc((size_t)(n * H) * 4), *dw0 = (float *)malloc((size_t)(v_local * H) * 4);
    for (int64_t t = 0; t < n; t++) ids[t] = (int32_t)(rng_u64() % (uint64_t)(v_local + v_local / 3 + 1)); /* some not owned */
    for (int64_t i = 0; i < n * H; i++) dout[i] = (float)rng_nonzero(0.5, 2.0);
    for (int64_t i = 0; i < v_local * H; i++) dw0[i] = (float)rng_nonzero(0.5, 2.0);
    for (int64_t t = 0; t < n; t++) ids[t] += (int32_t)first;
    dbuf did = dbuf_new((size_t)n * 4, 0), dd = dbuf_new((size_t)(n * H) * 4, 0), dw = dbuf_new((size_t)(v_local * H) * 4, 0);
    dbuf keys = dbuf_new((size_t)npow * 8, 0);
    dbuf_put(&did, ids), dbuf_put(&dd, dout), dbuf_put(&dw, dw0);
    CK_OK(cpar_dev_embedding_grad(dd.p, CPAR_F32, did.p, CPAR_I32, b, s, H, first, v_local, false, (float *)dw.p, true,
                                  keys.p, NULL));
    const uint64_t *k = (const uint64_t *)dbuf_fetch(&keys, "sort keys");
    int64_t owned = 0;
    for (int64_t t = 0; t < n; t++) owned += ids[t] - first < v_local;
    for (int64_t i = 0; i < npow; i++) {
        if (i < owned) {
            REQUIRE(k[i] != ~0ull && (i == 0 || k[i - 1] < k[i]), "%lld tokens: key %lld not ascending", (long long)n,
                    (long long)i);
            REQUIRE(ids[k[i] & 0xffffffffu] - first == (int64_t)(k[i] >> 32), "%lld tokens: key %lld names the wrong row",
                    (long long)n, (long long)i);
        } else {
            REQUIRE(k[i] == ~0ull, "%lld tokens: key %lld is not padding", (long long)n, (long long)i);
        }
    }
    float *want = (float *)malloc((size_t)(v_local * H) * 4);
    memcpy(want, dw0, (size_t)(v_local * H) * 4);
    for (int64_t t = 0; t < n; t++)
        if (ids[t] - first < v_local)
            for (int64_t h = 0; h < H; h++) want[(ids[t] - first) * H + h] += dout[t * H + h]; /* token order, fp32 */
    const float *got = (const float *)dbuf_fetch(&dw, "dweight");
    for (int64_t i = 0; i < v_local * H; i++)
        REQUIRE(got[i] == want[i], "%lld tokens: dweight[%lld] = %.9g, expected %.9g (the sum in token order)",
                (long long)n, (long long)i, got[i], want[i]);
    dbuf_free(&did), dbuf_free(&dd), dbuf_free(&dw), dbuf_free(&keys);
    free(ids), free(dout), free(dw0), free(want);
}

START_TEST(test_embedding_sort) {
    rng_state = 0x5eed5eedull;
    check_emb_sort(1, 1, 0, 3, 2);
    check_emb_sort(1, 7, 5, 4, 3);
    check_emb_sort(2, 512, 100, 60, 2);   /* exactly one block of 1024 keys */
    check_emb_sort(3, 1001, 7, 300, 2);   /* 3003 tokens: 4 blocks and global merge steps */
    check_emb_sort(1, 5000, 0, 9, 1);     /* long runs of each id */
}
END_TEST

static void schedule_forward(void) { cudasim_set_schedule(CUDASIM_SCHED_FORWARD, 0); }
static void schedule_reverse(void) { cudasim_set_schedule(CUDASIM_SCHED_REVERSE, 0); }
static void schedule_shuffle(void) { cudasim_set_schedule(CUDASIM_SCHED_SHUFFLE, 20240611); }

static Suite *devlayer_suite(void) {
    static const struct {
        const char *name;
        void (*set)(void);
    } schedules[] = {{"forward", schedule_forward}, {"reverse", schedule_reverse}, {"shuffle", schedule_shuffle}};
    static const struct {
        const char *name;
        const TTest *test;
        bool every_schedule;
    } cases[] = {{"runtime", test_runtime, true},
                 {"fill", test_fill, true},
                 {"cast", test_cast, true},
                 {"axpby", test_axpby, true},
                 {"reduce_into", test_reduce_into, true},
                 {"copy_2d", test_copy_2d, true},
                 {"row_reduce", test_row_reduce, true},
                 {"grid_stride", test_grid_stride, false},
                 {"gemm", test_gemm, true},
                 {"gemm_edges", test_gemm_edges, true},
                 {"entry_point_args", test_entry_point_args, false},
                 {"embedding_sort", test_embedding_sort, false}};
    enum { NSCHED = sizeof schedules / sizeof schedules[0], NCASES = sizeof cases / sizeof cases[0] };
    static char names[NSCHED][NCASES][40];
    Suite *s = suite_create("devlayer");
    for (int i = 0; i < NSCHED; i++)
        for (int j = 0; j < NCASES; j++) {
            if (i > 0 && !cases[j].every_schedule) continue;
            snprintf(names[i][j], sizeof names[i][j], "%s/%s", cases[j].name, schedules[i].name);
            TCase *tc = tcase_create(names[i][j]);
            tcase_set_timeout(tc, 120); /* the simulator runs every thread of every block on the CPU */
            tcase_add_checked_fixture(tc, schedules[i].set, NULL);
            tcase_add_test(tc, cases[j].test);
            suite_add_tcase(s, tc);
        }
    return s;
}

int main(void) {
    return tu_run_suite(devlayer_suite());
}
