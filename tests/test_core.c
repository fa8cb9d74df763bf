/* SPDX-License-Identifier: MIT */
/* test_core.c — status codes and errors, the version, dtypes and fp16/bf16 bit patterns,
 * tensors, allocation and copies, pinned host memory, cpar_spawn and cpar_init_from_env input
 * checks, context accessors, and NULL contexts (cpar.h §1-3).
 *
 * Conversions are checked against known bit patterns and against an
 * independent reference written with double arithmetic (nearbyint in the
 * default round-to-nearest-even mode), exhaustively over all 65536 half and
 * bfloat16 patterns and at every tie between neighbours. */
#define _GNU_SOURCE /* setenv, unsetenv */
#include <time.h>
#include <pthread.h>
#include <unistd.h> /* getpid, gethostname, dup2 */

#include "testutil.h"

/* ---- status codes and errors --------------------------------------------- */

START_TEST(test_status_strings) {
    static const struct {
        cpar_status st;
        const char *name;
    } want[] = {
#define S(x) {x, #x}
        S(CPAR_OK),          S(CPAR_ERR_INVALID), S(CPAR_ERR_CUDA), S(CPAR_ERR_NCCL), S(CPAR_ERR_CUBLAS),
        S(CPAR_ERR_SYSTEM),  S(CPAR_ERR_TIMEOUT), S(CPAR_ERR_PEER), S(CPAR_ERR_OOM),  S(CPAR_ERR_UNSUPPORTED),
#undef S
    };
    ck_assert_int_eq(sizeof want / sizeof want[0], CPAR_STATUS_COUNT);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        ck_assert_str_eq(cpar_status_string(want[i].st), want[i].name);
    /* Out of range: never NULL, never one of the real names. */
    cpar_status bad[] = {CPAR_STATUS_COUNT, (cpar_status)-1, (cpar_status)1000};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *s = cpar_status_string(bad[i]);
        ck_assert_ptr_nonnull(s);
        for (size_t j = 0; j < sizeof want / sizeof want[0]; j++) ck_assert_str_ne(s, want[j].name);
    }
}
END_TEST

static void *thread_error_probe(void *arg) {
    (void)arg;
    /* A fresh thread has no error yet. */
    ck_assert_str_eq(cpar_thread_last_error(), "");
    ck_assert_str_eq(cpar_last_error(NULL), "");
    ck_assert_int_eq(cpar_set_timeout_ms(NULL, 5), CPAR_ERR_INVALID);
    ck_assert_ptr_nonnull(strstr(cpar_thread_last_error(), "cpar_set_timeout_ms"));
    return NULL;
}

/* The run-time version is the header's: a stale libcpar would differ. */
START_TEST(test_version) {
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", CPAR_VERSION_MAJOR, CPAR_VERSION_MINOR, CPAR_VERSION_PATCH);
    ck_assert_str_eq(cpar_version(), want);
    ck_assert_int_eq(cpar_version_code(), CPAR_VERSION_CODE);
    ck_assert_int_eq(CPAR_VERSION_CODE,
                     CPAR_VERSION_MAJOR * 10000 + CPAR_VERSION_MINOR * 100 + CPAR_VERSION_PATCH);
    ck_assert(CPAR_VERSION(0, 1, 0) < CPAR_VERSION(0, 1, 1) && CPAR_VERSION(0, 1, 99) < CPAR_VERSION(0, 2, 0));
}
END_TEST

START_TEST(test_thread_last_error) {
    /* The thread-local error is per thread: another thread's failure does not
     * show here, and cpar_last_error(NULL) is the same line. */
    TU_FAILS(cpar_sync(NULL), CPAR_ERR_INVALID, "cpar_sync");
    TU_MSG_HAS("ctx");
    ck_assert_str_eq(cpar_last_error(NULL), cpar_thread_last_error());
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, thread_error_probe, NULL), 0);
    ck_assert_int_eq(pthread_join(th, NULL), 0);
    ck_assert_ptr_nonnull(strstr(cpar_thread_last_error(), "cpar_sync"));
    ck_assert_ptr_null(strstr(cpar_thread_last_error(), "cpar_set_timeout_ms"));
}
END_TEST

typedef struct {
    char seen[2][512]; /* cpar_last_error(ctx) of each rank after rank 0 failed */
} ctx_error_arg;

static cpar_status rank_ctx_error(cpar_ctx *ctx, void *p) {
    ctx_error_arg *a = p;
    int r = cpar_rank(ctx);
    ck_assert_str_eq(cpar_last_error(ctx), "");
    if (r == 0) {
        TU_FAILS(cpar_set_timeout_ms(ctx, -3), CPAR_ERR_INVALID, "-3");
        ck_assert_str_eq(cpar_last_error(ctx), cpar_thread_last_error());
        /* A later success does not clear the line. */
        TU_OK(cpar_set_timeout_ms(ctx, TU_TIMEOUT_MS));
    }
    TU_OK(cpar_barrier(cpar_world_group(ctx)));
    snprintf(a->seen[r], sizeof a->seen[r], "%s", cpar_last_error(ctx));
    return CPAR_OK;
}

START_TEST(test_ctx_last_error) {
    ctx_error_arg a;
    memset(&a, 0, sizeof a);
    TU_OK(tu_spawn(2, rank_ctx_error, &a));
    ck_assert_ptr_nonnull(strstr(a.seen[0], "cpar_set_timeout_ms"));
    ck_assert_ptr_nonnull(strstr(a.seen[0], "-3"));
    ck_assert_str_eq(a.seen[1], ""); /* rank 1's context never failed */
}
END_TEST

/* ---- data types -------------------------------------------------------------- */

START_TEST(test_dtypes) {
    static const struct {
        cpar_dtype dt;
        size_t size;
        const char *name;
        bool is_float;
    } want[] = {
        {CPAR_F32, 4, "f32", true},  {CPAR_F16, 2, "f16", true},  {CPAR_BF16, 2, "bf16", true},
        {CPAR_I32, 4, "i32", false}, {CPAR_I64, 8, "i64", false}, {CPAR_U8, 1, "u8", false},
    };
    ck_assert_int_eq(sizeof want / sizeof want[0], CPAR_DTYPE_COUNT);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        ck_assert_uint_eq(cpar_dtype_size(want[i].dt), want[i].size);
        ck_assert_str_eq(cpar_dtype_name(want[i].dt), want[i].name);
        ck_assert(cpar_dtype_is_float(want[i].dt) == want[i].is_float);
    }
    cpar_dtype bad[] = {CPAR_DTYPE_COUNT, (cpar_dtype)-1, (cpar_dtype)99};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ck_assert_uint_eq(cpar_dtype_size(bad[i]), 0);
        ck_assert_str_eq(cpar_dtype_name(bad[i]), "?");
        ck_assert(!cpar_dtype_is_float(bad[i]));
    }
}
END_TEST

/* ---- fp16 / bf16 ---------------------------------------------------------------- */

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static bool f16_is_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu); }
static bool bf16_is_nan(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu); }

/* Independent decoders and encoders: exact double arithmetic, rounding by
 * nearbyint (round to nearest even). */
static double ref_f16_value(uint16_t h) {
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? INFINITY : ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -v : v;
}

static uint16_t ref_f32_to_f16(float f) {
    uint16_t sign = (f32_bits(f) >> 16) & 0x8000;
    double a = fabs((double)f);
    if (a >= 65520.0) return sign | 0x7c00; /* the midpoint above 65504 rounds to inf */
    if (a < 0x1p-14) return sign | (uint16_t)nearbyint(a * 0x1p24);
    int e;
    frexp(a, &e); /* a in [2^(e-1), 2^e) */
    double m = nearbyint(ldexp(a, 11 - e)); /* 11-bit significand in [1024, 2048] */
    return sign | (uint16_t)(((e - 1 + 15) << 10) + ((int)m - 1024));
}

static uint16_t ref_f32_to_bf16(float f) {
    uint16_t sign = (f32_bits(f) >> 16) & 0x8000;
    double a = fabs((double)f);
    if (a == 0.0) return sign;
    int e;
    frexp(a, &e);
    if (e < -125) e = -125; /* float subnormals: bf16 shares float's exponent range */
    double m = nearbyint(ldexp(a, 8 - e)); /* 8-bit significand */
    double r = ldexp(m, e - 8);
    if (r >= 0x1p128) return sign | 0x7f80;
    return sign | (uint16_t)(f32_bits((float)r) >> 16);
}

START_TEST(test_f16_known_patterns) {
    static const struct {
        float f;
        uint16_t h;
    } enc[] = {
        {1.0f, 0x3c00},
        {-2.5f, 0xc100},
        {65504.0f, 0x7bff},
        {65519.99f, 0x7bff},          /* just below the midpoint */
        {65520.0f, 0x7c00},           /* the midpoint rounds (to even) to inf */
        {1e6f, 0x7c00},
        {-1e6f, 0xfc00},
        {0x1p-24f, 0x0001},           /* smallest subnormal */
        {0x1p-25f, 0x0000},           /* tie between 0 and it: to even (0) */
        {0x1.8p-24f, 0x0002},         /* tie between 1 and 2 ulps: to even (2) */
        {0x1.000002p-25f, 0x0001},    /* just above the tie */
        {0x1p-14f, 0x0400},           /* smallest normal */
        {0x1.ffcp-15f, 0x0400},       /* tie between the largest subnormal and it: to even */
        {1.0f + 0x1p-11f, 0x3c00},    /* tie: to even (1.0) */
        {1.0f + 0x3p-11f, 0x3c02},    /* tie: to even (1 + 2^-9) */
        {1.0f + 0x1p-11f + 0x1p-20f, 0x3c01},
        {-0.0f, 0x8000},
        {0.0f, 0x0000},
        {1e-10f, 0x0000},
        {INFINITY, 0x7c00},
        {-INFINITY, 0xfc00},
    };
    for (size_t i = 0; i < sizeof enc / sizeof enc[0]; i++) {
        uint16_t got = cpar_f32_to_f16(enc[i].f);
        ck_assert_msg(got == enc[i].h, "f32_to_f16(%a) = 0x%04x, expected 0x%04x", (double)enc[i].f, got, enc[i].h);
    }
    uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7f802000u, 0xff800001u, 0x7fffffffu};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        uint16_t h = cpar_f32_to_f16(bits_f32(nans[i]));
        ck_assert_msg(f16_is_nan(h), "f32_to_f16(NaN 0x%08x) = 0x%04x, not a NaN", nans[i], h);
    }
    static const struct {
        uint16_t h;
        float f;
    } dec[] = {
        {0x3c00, 1.0f},     {0xc100, -2.5f},     {0x7bff, 65504.0f},  {0x0001, 0x1p-24f},
        {0x03ff, 0x1.ff8p-15f}, {0x0400, 0x1p-14f}, {0x7c00, INFINITY}, {0xfc00, -INFINITY},
        {0x3555, 0x1.554p-2f},
    };
    for (size_t i = 0; i < sizeof dec / sizeof dec[0]; i++) ck_assert(cpar_f16_to_f32(dec[i].h) == dec[i].f);
    ck_assert(signbit(cpar_f16_to_f32(0x8000)) && cpar_f16_to_f32(0x8000) == 0.0f);
    ck_assert(isnan(cpar_f16_to_f32(0x7e00)) && isnan(cpar_f16_to_f32(0x7c01)) && isnan(cpar_f16_to_f32(0xfe00)));
}
END_TEST

START_TEST(test_f16_exhaustive) {
    for (uint32_t h = 0; h < 0x10000u; h++) {
        float f = cpar_f16_to_f32((uint16_t)h);
        if (f16_is_nan((uint16_t)h)) {
            TU_CHECK(isnan(f), "f16_to_f32(0x%04x) = %g, expected NaN", h, (double)f);
            TU_CHECK(f16_is_nan(cpar_f32_to_f16(f)), "NaN 0x%04x did not stay NaN", h);
            continue;
        }
        TU_CHECK((double)f == ref_f16_value((uint16_t)h), "f16_to_f32(0x%04x) = %a, expected %a", h, (double)f,
                 ref_f16_value((uint16_t)h));
        TU_CHECK(cpar_f32_to_f16(f) == h, "round trip of 0x%04x gave 0x%04x", h, cpar_f32_to_f16(f));
        /* Ties with the next pattern up (same sign, finite): to the even one. */
        uint16_t lo = (uint16_t)h;
        if ((lo & 0x7fff) >= 0x7bff) continue;
        float a = f, b = cpar_f16_to_f32((uint16_t)(lo + 1));
        float mid = (float)(((double)a + (double)b) / 2); /* exact: 12 significant bits */
        uint16_t even = (lo & 1) ? (uint16_t)(lo + 1) : lo;
        TU_CHECK(cpar_f32_to_f16(mid) == even, "tie %a between 0x%04x and 0x%04x gave 0x%04x", (double)mid, lo,
                 lo + 1, cpar_f32_to_f16(mid));
        if (mid != 0.0f) {
            TU_CHECK(cpar_f32_to_f16(nextafterf(mid, a)) == lo, "below the tie above 0x%04x", lo);
            TU_CHECK(cpar_f32_to_f16(nextafterf(mid, b)) == (uint16_t)(lo + 1), "above the tie above 0x%04x", lo);
        }
    }
    /* The tie above the largest finite half rounds to infinity. */
    ck_assert_uint_eq(cpar_f32_to_f16(65520.0f), 0x7c00);
    ck_assert_uint_eq(cpar_f32_to_f16(-65520.0f), 0xfc00);
}
END_TEST

START_TEST(test_f16_random_vs_reference) {
    uint64_t s = 12345;
    for (int i = 0; i < 400000; i++) {
        uint32_t u = (uint32_t)tu_next(&s);
        if (i & 1) u = (u & 0x807fffffu) | ((uint32_t)(100 + (u >> 23) % 48) << 23); /* exponents around f16's range */
        float f = bits_f32(u);
        uint16_t got = cpar_f32_to_f16(f);
        if (isnan(f)) {
            TU_CHECK(f16_is_nan(got), "f32_to_f16(0x%08x) = 0x%04x, expected NaN", u, got);
            continue;
        }
        uint16_t want = ref_f32_to_f16(f);
        TU_CHECK(got == want, "f32_to_f16(%a = 0x%08x) = 0x%04x, expected 0x%04x", (double)f, u, got, want);
    }
}
END_TEST

START_TEST(test_bf16_known_patterns) {
    static const struct {
        uint32_t f;
        uint16_t b;
    } enc[] = {
        {0x3f800000u, 0x3f80}, /* 1.0 */
        {0xc0200000u, 0xc020}, /* -2.5 */
        {0x3f808000u, 0x3f80}, /* tie: to even */
        {0x3f818000u, 0x3f82}, /* tie: to even (up) */
        {0x3f808001u, 0x3f81}, /* above the tie */
        {0x3f817fffu, 0x3f81}, /* below the tie */
        {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds to inf */
        {0x7f7f7fffu, 0x7f7f},
        {0x7f800000u, 0x7f80}, /* inf */
        {0xff800000u, 0xff80}, /* -inf */
        {0x80000000u, 0x8000}, /* -0 */
        {0x00000001u, 0x0000}, /* smallest float subnormal */
        {0x00008000u, 0x0000}, /* subnormal tie: to even (0) */
        {0x00018000u, 0x0002}, /* subnormal tie: to even (2) */
    };
    for (size_t i = 0; i < sizeof enc / sizeof enc[0]; i++) {
        uint16_t got = cpar_f32_to_bf16(bits_f32(enc[i].f));
        ck_assert_msg(got == enc[i].b, "f32_to_bf16(0x%08x) = 0x%04x, expected 0x%04x", enc[i].f, got, enc[i].b);
    }
    /* NaN stays NaN, including payloads a plain round-and-truncate would turn into inf. */
    uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7f80ffffu, 0x7fffffffu};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        uint16_t b = cpar_f32_to_bf16(bits_f32(nans[i]));
        ck_assert_msg(bf16_is_nan(b), "f32_to_bf16(NaN 0x%08x) = 0x%04x, not a NaN", nans[i], b);
    }
    ck_assert(cpar_bf16_to_f32(0x3f80) == 1.0f);
    ck_assert(cpar_bf16_to_f32(0xc020) == -2.5f);
    ck_assert(cpar_bf16_to_f32(0x7f80) == INFINITY);
    ck_assert(isnan(cpar_bf16_to_f32(0x7fc0)) && isnan(cpar_bf16_to_f32(0x7f81)));
}
END_TEST

START_TEST(test_bf16_exhaustive) {
    for (uint32_t b = 0; b < 0x10000u; b++) {
        float f = cpar_bf16_to_f32((uint16_t)b);
        if (bf16_is_nan((uint16_t)b)) {
            TU_CHECK(isnan(f), "bf16_to_f32(0x%04x) = %g, expected NaN", b, (double)f);
            TU_CHECK(bf16_is_nan(cpar_f32_to_bf16(f)), "NaN 0x%04x did not stay NaN", b);
            continue;
        }
        TU_CHECK(f32_bits(f) == b << 16, "bf16_to_f32(0x%04x) has bits 0x%08x", b, f32_bits(f));
        TU_CHECK(cpar_f32_to_bf16(f) == b, "round trip of 0x%04x gave 0x%04x", b, cpar_f32_to_bf16(f));
        if ((b & 0x7fff) >= 0x7f80) continue; /* inf */
        uint16_t even = (b & 1) ? (uint16_t)(b + 1) : (uint16_t)b;
        TU_CHECK(cpar_f32_to_bf16(bits_f32(b << 16 | 0x8000u)) == even, "tie above 0x%04x", b);
        TU_CHECK(cpar_f32_to_bf16(bits_f32(b << 16 | 0x7fffu)) == b, "below the tie above 0x%04x", b);
        TU_CHECK(cpar_f32_to_bf16(bits_f32(b << 16 | 0x8001u)) == (uint16_t)(b + 1), "above the tie above 0x%04x", b);
    }
    uint64_t s = 777;
    for (int i = 0; i < 400000; i++) {
        uint32_t u = (uint32_t)tu_next(&s);
        float f = bits_f32(u);
        if (isnan(f)) continue;
        TU_CHECK(cpar_f32_to_bf16(f) == ref_f32_to_bf16(f), "f32_to_bf16(0x%08x) = 0x%04x, expected 0x%04x", u,
                 cpar_f32_to_bf16(f), ref_f32_to_bf16(f));
    }
}
END_TEST

/* ---- tensors ------------------------------------------------------------------- */

START_TEST(test_tensor_make) {
    float buf[24];
    int64_t shape[CPAR_MAX_DIMS] = {2, 3, 4, 5, 6, 7, 8, 9};
    cpar_tensor t = cpar_tensor_make(buf, CPAR_F16, 3, shape, 5);
    ck_assert_ptr_eq(t.data, buf);
    ck_assert_int_eq(t.dtype, CPAR_F16);
    ck_assert_int_eq(t.ndim, 3);
    ck_assert_int_eq(t.device, 5);
    for (int i = 0; i < 3; i++) ck_assert_int_eq(t.shape[i], shape[i]);
    ck_assert_int_eq(cpar_tensor_numel(&t), 24);
    ck_assert_uint_eq(cpar_tensor_nbytes(&t), 48);

    /* Every ndim with every dtype: numel is the product, nbytes numel * size. */
    for (int dt = 0; dt < CPAR_DTYPE_COUNT; dt++)
        for (int nd = 0; nd <= CPAR_MAX_DIMS; nd++) {
            cpar_tensor u = cpar_tensor_make(NULL, (cpar_dtype)dt, nd, shape, CPAR_HOST);
            int64_t n = 1;
            for (int i = 0; i < nd; i++) n *= shape[i];
            ck_assert_int_eq(u.ndim, nd);
            ck_assert_int_eq(u.device, CPAR_HOST);
            ck_assert_int_eq(cpar_tensor_numel(&u), n); /* ndim 0: a scalar, 1 element */
            ck_assert_uint_eq(cpar_tensor_nbytes(&u), (size_t)n * cpar_dtype_size((cpar_dtype)dt));
        }
    cpar_tensor scalar = cpar_tensor_make(buf, CPAR_I64, 0, NULL, CPAR_HOST);
    ck_assert_int_eq(cpar_tensor_numel(&scalar), 1);
    ck_assert_uint_eq(cpar_tensor_nbytes(&scalar), 8);

    int64_t zero[] = {4, 0, 3};
    cpar_tensor z = cpar_tensor_make(NULL, CPAR_F32, 3, zero, CPAR_HOST);
    ck_assert_int_eq(cpar_tensor_numel(&z), 0);
    ck_assert_uint_eq(cpar_tensor_nbytes(&z), 0);
}
END_TEST

/* Shapes of the round trips: a scalar, a zero-sized tensor, odd sizes. */
static const struct {
    int ndim;
    int64_t shape[4];
    int64_t reshape[4]; /* same numel, for a device-to-device reshaping copy */
    int re_ndim;
} rt_shapes[] = {
    {0, {0}, {1}, 1},
    {2, {0, 3}, {3, 0, 5}, 3},
    {3, {7, 3, 5}, {105}, 1},
    {1, {1000}, {8, 125}, 2},
    {4, {1, 33, 1, 3}, {99, 1}, 2},
};

static cpar_status rank_roundtrip(cpar_ctx *ctx, void *arg) {
    (void)arg;
    for (int dt = 0; dt < CPAR_DTYPE_COUNT; dt++)
        for (size_t k = 0; k < sizeof rt_shapes / sizeof rt_shapes[0]; k++) {
            int nd = rt_shapes[k].ndim;
            const int64_t *shape = rt_shapes[k].shape;
            cpar_tensor h = cpar_tensor_make(NULL, (cpar_dtype)dt, nd, shape, CPAR_HOST);
            int64_t n = cpar_tensor_numel(&h);
            void *src = tu_random_host((cpar_dtype)dt, n, 100 * dt + k);
            h.data = src;

            /* Host -> device: the tensor lives on the context's device. */
            cpar_tensor d;
            TU_OK(cpar_tensor_alloc(ctx, (cpar_dtype)dt, nd, shape, &d));
            ck_assert_int_eq(d.device, cpar_device(ctx));
            ck_assert_int_eq(d.dtype, dt);
            ck_assert_int_eq(d.ndim, nd);
            for (int i = 0; i < nd; i++) ck_assert_int_eq(d.shape[i], shape[i]);
            if (n > 0) ck_assert_ptr_nonnull(d.data);
            TU_OK(cpar_tensor_copy(ctx, &h, &d));

            /* Device -> device into another shape with the same numel. */
            cpar_tensor d2 = tu_alloc_poisoned(ctx, (cpar_dtype)dt, rt_shapes[k].re_ndim, rt_shapes[k].reshape);
            ck_assert_int_eq(cpar_tensor_numel(&d2), n);
            TU_OK(cpar_tensor_copy(ctx, &d, &d2));

            /* Device -> host, and host -> host. */
            void *back = tu_download(ctx, &d2);
            ck_assert_int_eq(memcmp(back, src, cpar_tensor_nbytes(&h)), 0);
            void *hh = malloc(cpar_tensor_nbytes(&h) + 1);
            memset(hh, 0xff, cpar_tensor_nbytes(&h) + 1);
            cpar_tensor h2 = cpar_tensor_make(hh, (cpar_dtype)dt, nd, shape, CPAR_HOST);
            TU_OK(cpar_tensor_copy(ctx, &h, &h2));
            ck_assert_int_eq(memcmp(hh, src, cpar_tensor_nbytes(&h)), 0);

            TU_OK(cpar_tensor_free(ctx, &d));
            ck_assert_ptr_null(d.data);
            TU_OK(cpar_tensor_free(ctx, &d)); /* NULL data is fine */
            TU_OK(cpar_tensor_free(ctx, &d2));
            free(src);
            free(back);
            free(hh);
        }
    return CPAR_OK;
}

START_TEST(test_alloc_copy_roundtrip) { TU_OK(tu_spawn(1, rank_roundtrip, NULL)); }
END_TEST

static cpar_status rank_alloc_copy_bad(cpar_ctx *ctx, void *arg) {
    (void)arg;
    int64_t shape[] = {3, 5}, neg[] = {3, -1}, big[] = {4, 5};
    cpar_tensor t;
    TU_FAILS(cpar_tensor_alloc(ctx, CPAR_F32, -1, shape, &t), CPAR_ERR_INVALID, "ndim");
    TU_FAILS(cpar_tensor_alloc(ctx, CPAR_F32, CPAR_MAX_DIMS + 1, shape, &t), CPAR_ERR_INVALID, "ndim");
    TU_FAILS(cpar_tensor_alloc(ctx, CPAR_F32, 2, NULL, &t), CPAR_ERR_INVALID, "shape");
    TU_FAILS(cpar_tensor_alloc(ctx, CPAR_F32, 2, neg, &t), CPAR_ERR_INVALID, "-1");
    TU_FAILS(cpar_tensor_alloc(ctx, CPAR_DTYPE_COUNT, 2, shape, &t), CPAR_ERR_INVALID, "dtype");
    TU_FAILS(cpar_tensor_alloc(ctx, CPAR_F32, 2, shape, NULL), CPAR_ERR_INVALID, "out");
    TU_FAILS(cpar_tensor_free(ctx, NULL), CPAR_ERR_INVALID, "t");

    float h[20];
    tu_fill_random(h, CPAR_F32, 20, 3);
    cpar_tensor hs = cpar_tensor_make(h, CPAR_F32, 2, shape, CPAR_HOST);
    cpar_tensor d = tu_alloc_poisoned(ctx, CPAR_F32, 2, shape);
    cpar_tensor d16 = tu_alloc_poisoned(ctx, CPAR_F16, 2, shape);
    cpar_tensor dbig = tu_alloc_poisoned(ctx, CPAR_F32, 2, big);
    TU_FAILS(cpar_tensor_copy(ctx, &hs, &d16), CPAR_ERR_INVALID, "dst");
    TU_MSG_HAS("f16");
    TU_FAILS(cpar_tensor_copy(ctx, &hs, &dbig), CPAR_ERR_INVALID, "dst");
    TU_MSG_HAS("20");
    TU_FAILS(cpar_tensor_copy(ctx, NULL, &d), CPAR_ERR_INVALID, "src");
    TU_FAILS(cpar_tensor_copy(ctx, &hs, NULL), CPAR_ERR_INVALID, "dst");
    /* A tensor on a device that is neither host nor the context's. */
    int foreign = cpar_device(ctx) == 5 ? 6 : 5;
    cpar_tensor fs = hs, fd = d;
    fs.device = foreign;
    fd.device = foreign;
    TU_FAILS(cpar_tensor_copy(ctx, &fs, &d), CPAR_ERR_INVALID, "src");
    TU_FAILS(cpar_tensor_copy(ctx, &hs, &fd), CPAR_ERR_INVALID, "dst");
    cpar_tensor nodata = hs;
    nodata.data = NULL;
    TU_FAILS(cpar_tensor_copy(ctx, &nodata, &d), CPAR_ERR_INVALID, "src");
    /* Nothing was written by the failed calls. */
    float *back = tu_download(ctx, &d);
    for (int i = 0; i < 15; i++) ck_assert(isnan(back[i]));
    free(back);
    TU_OK(cpar_tensor_free(ctx, &d));
    TU_OK(cpar_tensor_free(ctx, &d16));
    TU_OK(cpar_tensor_free(ctx, &dbig));
    return CPAR_OK;
}

START_TEST(test_alloc_copy_bad_input) { TU_OK(tu_spawn(1, rank_alloc_copy_bad, NULL)); }
END_TEST

/* ---- spawn, backends, accessors ------------------------------------------------- */

static cpar_status rank_never(cpar_ctx *ctx, void *arg) {
    (void)ctx;
    (void)arg;
    ck_abort_msg("a rank function ran although cpar_spawn had bad input");
    return CPAR_OK;
}

START_TEST(test_spawn_bad_input) {
    cpar_backend b = tu_backend();
    TU_FAILS(cpar_spawn(0, b, rank_never, NULL), CPAR_ERR_INVALID, "nranks");
    TU_FAILS(cpar_spawn(-1, b, rank_never, NULL), CPAR_ERR_INVALID, "nranks");
    TU_FAILS(cpar_spawn(257, b, rank_never, NULL), CPAR_ERR_INVALID, "nranks");
    TU_MSG_HAS("257");
    TU_FAILS(cpar_spawn(1, b, NULL, NULL), CPAR_ERR_INVALID, "fn");
    TU_FAILS(cpar_spawn(1, CPAR_BACKEND_COUNT, rank_never, NULL), CPAR_ERR_INVALID, "backend");
    TU_FAILS(cpar_spawn(1, (cpar_backend)-1, rank_never, NULL), CPAR_ERR_INVALID, "backend");
    cpar_init_config c = {.backend = b, .timeout_ms = -1};
    TU_FAILS(cpar_spawn_with(1, &c, rank_never, NULL), CPAR_ERR_INVALID, "timeout_ms");
    c.timeout_ms = TU_TIMEOUT_MS;
    TU_FAILS(cpar_spawn_with(0, &c, rank_never, NULL), CPAR_ERR_INVALID, "nranks");
}
END_TEST

START_TEST(test_backends) {
    ck_assert_str_eq(cpar_backend_name(CPAR_BACKEND_HOST), "host");
    ck_assert_str_eq(cpar_backend_name(CPAR_BACKEND_NCCL), "nccl");
    ck_assert_str_eq(cpar_backend_name(CPAR_BACKEND_DEVICE), "device");
    ck_assert_int_eq(cpar_backend_parse("Device"), CPAR_BACKEND_DEVICE);
    ck_assert_int_eq(cpar_backend_parse("sim"), CPAR_BACKEND_DEVICE); /* its old name */
    ck_assert_int_eq(cpar_backend_parse("NCCL"), CPAR_BACKEND_NCCL);
    ck_assert_int_eq(cpar_backend_parse("gpu"), -1);
    ck_assert_int_eq(cpar_backend_parse(NULL), -1);
    ck_assert_ptr_nonnull(cpar_backend_name(CPAR_BACKEND_COUNT));
    ck_assert(cpar_backend_available(CPAR_BACKEND_HOST));
    ck_assert(cpar_backend_available(tu_backend()));
    ck_assert(!cpar_backend_available(CPAR_BACKEND_COUNT));
    /* Every backend this build or machine cannot run is refused as unsupported. */
    int refused = 0;
    for (int b = 0; b < CPAR_BACKEND_COUNT; b++) {
        if (cpar_backend_available((cpar_backend)b)) continue;
        TU_FAILS(cpar_spawn(1, (cpar_backend)b, rank_never, NULL), CPAR_ERR_UNSUPPORTED,
                 cpar_backend_name((cpar_backend)b));
        refused++;
    }
    if (cpar_device_count() == 0) { /* no GPU here: NCCL cannot run */
        ck_assert(!cpar_backend_available(CPAR_BACKEND_NCCL));
        ck_assert_int_ge(refused, 1);
    }
}
END_TEST

/* Pinned host memory: a copy into it is complete on return (the stream is
 * waited for after the asynchronous copy), a copy from it once cpar_sync
 * returns, and a layer initialised from a pinned master has read it when the
 * call returns. Under the simulator's lazy schedule a missing wait leaves
 * the poison in place. */
static cpar_status rank_pinned(cpar_ctx *ctx, void *arg) {
    (void)arg;
    enum { N = 4099, V = 96, H = 8 }; /* V divisible by 1-4 ranks */
    int64_t shape[1] = {N}, mshape[2] = {V, H};
    float *a, *b, *m;
    TU_FAILS(cpar_pinned_alloc(ctx, 16, NULL), CPAR_ERR_INVALID, "cpar_pinned_alloc: out is NULL");
    TU_FAILS(cpar_pinned_alloc(NULL, 16, (void **)&a), CPAR_ERR_INVALID, "cpar_pinned_alloc: ctx is NULL");
    TU_FAILS(cpar_pinned_free(NULL, NULL), CPAR_ERR_INVALID, "cpar_pinned_free: ctx is NULL");
    TU_FAILS(cpar_pinned_alloc(ctx, (size_t)PTRDIFF_MAX + 1, (void **)&a), CPAR_ERR_INVALID, "bytes");
    TU_OK(cpar_pinned_alloc(ctx, 0, (void **)&a));
    ck_assert_ptr_null(a);
    TU_OK(cpar_pinned_alloc(ctx, N * sizeof(float), (void **)&a));
    TU_OK(cpar_pinned_alloc(ctx, N * sizeof(float), (void **)&b));
    TU_OK(cpar_pinned_alloc(ctx, V * H * sizeof(float), (void **)&m));
    ck_assert(a && b && m);
    uint64_t seed = 1000 + (uint64_t)cpar_rank(ctx);
    for (int i = 0; i < N; i++) a[i] = (float)tu_uniform(&seed);
    cpar_tensor ha = cpar_tensor_make(a, CPAR_F32, 1, shape, CPAR_HOST);
    cpar_tensor hb = cpar_tensor_make(b, CPAR_F32, 1, shape, CPAR_HOST);
    cpar_tensor d, d2;
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 1, shape, &d));
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 1, shape, &d2));
    TU_OK(cpar_tensor_copy(ctx, &ha, &d));
    TU_OK(cpar_sync(ctx)); /* the copy from pinned memory has read it */
    TU_OK(cpar_fill(ctx, &d2, 1.0));
    TU_OK(cpar_axpby(ctx, 2.f, &d, 1.f, &d2)); /* queued on the device: 2a + 1 */
    memset(b, 0xff, N * sizeof(float));
    TU_OK(cpar_tensor_copy(ctx, &d2, &hb));
    for (int i = 0; i < N; i++)
        ck_assert_msg(fabsf(b[i] - (2.f * a[i] + 1.f)) <= 1e-6f, "element %d: %g, expected %g", i, (double)b[i],
                      (double)(2.f * a[i] + 1.f));
    /* an embedding from a pinned master, the master overwritten at once */
    float *orig = malloc(V * H * sizeof(float));
    ck_assert_ptr_nonnull(orig);
    for (int i = 0; i < V * H; i++) orig[i] = m[i] = (float)tu_uniform(&seed);
    cpar_embedding_config cfg = {.num_embeddings = V, .embedding_dim = H, .dtype = CPAR_F32};
    cpar_embedding *e;
    TU_OK(cpar_embedding_create(cpar_world_group(ctx), &cfg, &e));
    cpar_tensor master = cpar_tensor_make(m, CPAR_F32, 2, mshape, CPAR_HOST);
    TU_OK(cpar_embedding_init_from_master(e, &master));
    memset(m, 0xff, V * H * sizeof(float));
    int64_t first, last;
    TU_OK(cpar_vocab_range(V, cpar_rank(ctx), cpar_world_size(ctx), &first, &last));
    cpar_tensor w = cpar_embedding_weight(e);
    float *hw = tu_download(ctx, &w);
    for (int64_t i = 0; i < (last - first) * H; i++)
        ck_assert_msg(hw[i] == orig[first * H + i], "weight element %lld: %g, expected %g", (long long)i,
                      (double)hw[i], (double)orig[first * H + i]);
    free(hw);
    free(orig);
    TU_OK(cpar_embedding_destroy(e));
    TU_OK(cpar_tensor_free(ctx, &d));
    TU_OK(cpar_tensor_free(ctx, &d2));
    TU_OK(cpar_pinned_free(ctx, a));
    TU_OK(cpar_pinned_free(ctx, b));
    TU_OK(cpar_pinned_free(ctx, m));
    TU_OK(cpar_pinned_free(ctx, NULL));
    return CPAR_OK;
}

START_TEST(test_pinned) { TU_OK(tu_spawn(1 + _i, rank_pinned, NULL)); }
END_TEST

/* The CUDA simulator's switches (tests/cudasim.h): absent from the host and
 * CUDA builds. */
void cudasim_set_peer_access(int on) __attribute__((weak));
void cudasim_set_compute_capability(int cc) __attribute__((weak));

/* GPUs below compute capability 8.0 (a T4, a V100) are not usable: the
 * device backend is unavailable and says why, not "no kernel image" at the
 * first launch. */
START_TEST(test_device_backend_below_sm80) {
    if (!cudasim_set_compute_capability || tu_backend() != CPAR_BACKEND_DEVICE) return;
    cudasim_set_compute_capability(75);
    const int n = cpar_device_count();
    const bool avail = cpar_backend_available(CPAR_BACKEND_DEVICE);
    const cpar_init_config cfg = {.backend = CPAR_BACKEND_DEVICE, .timeout_ms = TU_TIMEOUT_MS};
    const cpar_status st = cpar_spawn_with(2, &cfg, tu_rank_nothing, NULL);
    cudasim_set_compute_capability(0);
    ck_assert_int_eq(n, 0);
    ck_assert(!avail);
    ck_assert_msg(st == CPAR_ERR_UNSUPPORTED, "spawn on a 7.5 GPU gave %s", cpar_status_string(st));
    ck_assert_msg(strstr(cpar_thread_last_error(), "backend device is not available: no usable GPU (cpar_dev_count: "
                                                   "GPU 0 has compute capability 7.5; cpar's kernels need 8.0") != NULL,
                  "%s", cpar_thread_last_error());
    ck_assert_int_ge(cpar_device_count(), 1);
}
END_TEST

typedef struct {
    int device[4];
    int bad[4];   /* elements of the rank's results that differ from the sums */
    float got[4]; /* the first of them */
} placement_arg;

/* Records the rank's GPU; all-reduces (in place) 64 floats of (rank + 1)(i +
 * 1) and reduce-scatters n x 8 of the same (8 to each rank) into poisoned
 * output, then checks every element against the exact sums. */
static cpar_status rank_placement(cpar_ctx *ctx, void *p) {
    placement_arg *a = p;
    const int r = cpar_rank(ctx), n = cpar_world_size(ctx);
    const float ranks = (float)(n * (n + 1) / 2);
    a->device[r] = cpar_device(ctx);
    a->bad[r] = 0;
    float in[64 * 4], want[64 * 4];
    const int64_t all = 64, sc_in = 8 * n, sc_out = 8;
    for (int i = 0; i < 64 * 4; i++) in[i] = (float)((r + 1) * (i + 1));
    cpar_tensor t = tu_upload(ctx, in, CPAR_F32, 1, &all), s = tu_upload(ctx, in, CPAR_F32, 1, &sc_in), o;
    TU_OK(cpar_tensor_alloc(ctx, CPAR_F32, 1, &sc_out, &o));
    TU_OK(cpar_fill(ctx, &o, NAN));
    TU_OK(cpar_all_reduce(cpar_world_group(ctx), &t, &t, CPAR_SUM));
    TU_OK(cpar_reduce_scatter(cpar_world_group(ctx), &s, &o, CPAR_SUM, NULL));
    float *h = tu_download(ctx, &t), *hs = tu_download(ctx, &o);
    for (int i = 0; i < 64; i++) want[i] = ranks * (float)(i + 1);
    for (int i = 0; i < 64 + 8; i++) {
        const float got = i < 64 ? h[i] : hs[i - 64], w = i < 64 ? want[i] : ranks * (float)(8 * r + i - 64 + 1);
        if (got != w && a->bad[r]++ == 0) a->got[r] = got;
    }
    free(h);
    free(hs);
    TU_OK(cpar_tensor_free(ctx, &o));
    TU_OK(cpar_tensor_free(ctx, &s));
    return cpar_tensor_free(ctx, &t);
}

/* The device backend spreads its ranks over both GPUs (rank r on GPU r mod
 * 2) with or without peer access between them: consumer cards over PCIe
 * have none, and there the reductions copy the other GPU's slices in and
 * the results out (the simulator fails a kernel that touches the other
 * GPU's memory without access). Until 2026-12-07 every rank took GPU 0
 * there, and before that the start failed. 1-4 ranks. */
START_TEST(test_device_backend_without_peer_access) {
    if (!cudasim_set_peer_access || tu_backend() != CPAR_BACKEND_DEVICE || cpar_device_count() != 2) return;
    const int n = _i;
    for (int peer = 0; peer < 2; peer++) {
        placement_arg a;
        memset(&a, 0xFF, sizeof a);
        cudasim_set_peer_access(peer);
        const cpar_status st = tu_spawn(n, rank_placement, &a);
        cudasim_set_peer_access(1);
        TU_OK(st);
        for (int r = 0; r < n; r++) {
            ck_assert_msg(a.device[r] == r % 2, "%d ranks, peer access %d: rank %d on GPU %d", n, peer, r,
                          a.device[r]);
            ck_assert_msg(a.bad[r] == 0, "%d ranks, peer access %d: rank %d: %d elements wrong (first %g)", n, peer,
                          r, a.bad[r], a.got[r]);
        }
    }
}
END_TEST

typedef struct {
    int nranks;
    int seen[8]; /* ranks that ran */
} accessor_arg;

static cpar_status rank_accessors(cpar_ctx *ctx, void *p) {
    accessor_arg *a = p;
    int r = cpar_rank(ctx);
    ck_assert(r >= 0 && r < a->nranks);
    a->seen[r]++;
    ck_assert_int_eq(cpar_world_size(ctx), a->nranks);
    ck_assert_int_eq(cpar_ctx_backend(ctx), tu_backend());
    /* Host tensors on the host backend; device r on NCCL; r mod the GPUs on
     * the device backend, which shares them. */
    int want = tu_backend() == CPAR_BACKEND_HOST ? CPAR_HOST
             : tu_backend() == CPAR_BACKEND_DEVICE ? r % cpar_device_count() : r;
    ck_assert_int_eq(cpar_device(ctx), want);
    ck_assert_int_eq(cpar_timeout_ms(ctx), TU_TIMEOUT_MS);
    TU_FAILS(cpar_set_timeout_ms(ctx, 0), CPAR_ERR_INVALID, "ms");
    TU_FAILS(cpar_set_timeout_ms(ctx, -5), CPAR_ERR_INVALID, "ms");
    TU_MSG_HAS("-5");
    ck_assert_int_eq(cpar_timeout_ms(ctx), TU_TIMEOUT_MS); /* unchanged by the failures */
    TU_OK(cpar_set_timeout_ms(ctx, 12345));
    ck_assert_int_eq(cpar_timeout_ms(ctx), 12345);
    TU_OK(cpar_set_timeout_ms(ctx, TU_TIMEOUT_MS));
    cpar_group *w = cpar_world_group(ctx);
    ck_assert_ptr_nonnull(w);
    ck_assert_int_eq(cpar_group_size(w), a->nranks);
    ck_assert_int_eq(cpar_group_rank(w), r);
    ck_assert_ptr_eq(cpar_group_ctx(w), ctx);
    for (int i = 0; i < a->nranks; i++) ck_assert_int_eq(cpar_group_world_rank(w, i), i);
    ck_assert_int_eq(cpar_group_world_rank(w, a->nranks), -1);
    ck_assert_int_eq(cpar_group_world_rank(w, -1), -1);
    TU_OK(cpar_sync(ctx));
    return CPAR_OK;
}

START_TEST(test_accessors) {
    int sizes[] = {1, 3, 4};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        accessor_arg a = {.nranks = sizes[k]};
        TU_OK(tu_spawn(sizes[k], rank_accessors, &a));
        for (int r = 0; r < sizes[k]; r++) ck_assert_int_eq(a.seen[r], 1);
    }
    /* NULL context: the documented neutral values. */
    ck_assert_int_eq(cpar_rank(NULL), -1);
    ck_assert_int_eq(cpar_world_size(NULL), 0);
    ck_assert_int_eq(cpar_timeout_ms(NULL), 0);
    ck_assert_ptr_null(cpar_world_group(NULL));
    ck_assert_ptr_null(cpar_group_ctx(NULL));
}
END_TEST

/* Saved environment variables, restored at the end of a test. */
static const char *const launch_vars[] = {
    "RANK",         "WORLD_SIZE",    "LOCAL_RANK",    "LOCAL_WORLD_SIZE",      "MASTER_ADDR", "MASTER_PORT",
    "CPAR_STORE_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "CPAR_TIMEOUT_MS",
    "CPAR_BACKEND", "CPAR_JOB_TOKEN", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
};
#define N_LAUNCH_VARS (sizeof launch_vars / sizeof launch_vars[0])

typedef struct {
    char *saved[N_LAUNCH_VARS];
} env_save;

static void env_clear(env_save *s) {
    for (size_t i = 0; i < N_LAUNCH_VARS; i++) {
        const char *v = getenv(launch_vars[i]);
        s->saved[i] = v ? strdup(v) : NULL;
        unsetenv(launch_vars[i]);
    }
}

static void env_restore(env_save *s) {
    for (size_t i = 0; i < N_LAUNCH_VARS; i++) {
        if (s->saved[i]) setenv(launch_vars[i], s->saved[i], 1);
        else unsetenv(launch_vars[i]);
        free(s->saved[i]);
        s->saved[i] = NULL;
    }
}

static cpar_status rank_default_timeout(cpar_ctx *ctx, void *arg) {
    ck_assert_int_eq(cpar_timeout_ms(ctx), *(int *)arg);
    return CPAR_OK;
}

START_TEST(test_default_timeout) {
    env_save s;
    env_clear(&s);
    cpar_init_config c = {.backend = tu_backend()}; /* timeout 0: $CPAR_TIMEOUT_MS or 300000 */
    int want = 300000;
    TU_OK(tu_spawn_with(2, &c, rank_default_timeout, &want));
    setenv("CPAR_TIMEOUT_MS", "4321", 1);
    want = 4321;
    TU_OK(tu_spawn_with(2, &c, rank_default_timeout, &want));
    c.timeout_ms = 777; /* an explicit deadline wins */
    want = 777;
    TU_OK(tu_spawn_with(2, &c, rank_default_timeout, &want));
    env_restore(&s);
}
END_TEST

/* A single-rank world from cpar_init_from_env: every collective is local. */
static void single_rank_world(cpar_ctx *ctx, cpar_backend b) {
    ck_assert_int_eq(cpar_rank(ctx), 0);
    ck_assert_int_eq(cpar_world_size(ctx), 1);
    ck_assert_int_eq(cpar_ctx_backend(ctx), b);
    ck_assert_int_eq(cpar_timeout_ms(ctx), TU_TIMEOUT_MS);
    cpar_group *w = cpar_world_group(ctx);
    ck_assert_int_eq(cpar_group_size(w), 1);
    ck_assert_int_eq(cpar_group_rank(w), 0);
    int64_t shape[] = {5, 3};
    float *x = tu_random_host(CPAR_F32, 15, 42);
    cpar_tensor in = tu_upload(ctx, x, CPAR_F32, 2, shape);
    cpar_tensor out = tu_alloc_poisoned(ctx, CPAR_F32, 2, shape);
    cpar_reduce_op ops[] = {CPAR_SUM, CPAR_MAX, CPAR_MIN};
    for (int k = 0; k < 3; k++) {
        TU_OK(cpar_all_reduce(w, &in, &out, ops[k]));
        void *got = tu_download(ctx, &out);
        TU_EXPECT_SAME(got, x, CPAR_F32, 15);
        free(got);
    }
    TU_OK(cpar_fill(ctx, &out, 0.5));
    TU_OK(cpar_all_gather(w, &in, &out, NULL));
    TU_OK(cpar_fill(ctx, &out, 0.5));
    TU_OK(cpar_reduce_scatter(w, &in, &out, CPAR_SUM, NULL));
    TU_OK(cpar_fill(ctx, &out, 0.5));
    TU_OK(cpar_all_to_all_single(w, &in, &out, NULL, NULL));
    TU_OK(cpar_fill(ctx, &out, 0.5));
    TU_OK(cpar_ring_shift(w, &in, &out, 1));
    void *got = tu_download(ctx, &out);
    TU_EXPECT_SAME(got, x, CPAR_F32, 15);
    free(got);
    TU_OK(cpar_broadcast(w, &in, 0));
    TU_OK(cpar_barrier(w));
    TU_OK(cpar_sync(ctx));
    TU_OK(cpar_tensor_free(ctx, &in));
    TU_OK(cpar_tensor_free(ctx, &out));
    free(x);
}

START_TEST(test_init_from_env) {
    env_save s;
    env_clear(&s);
    cpar_backend backends[] = {CPAR_BACKEND_HOST, tu_backend()};
    for (int k = 0; k < (tu_backend() == CPAR_BACKEND_HOST ? 1 : 2); k++) {
        cpar_init_config c = {.backend = backends[k], .timeout_ms = TU_TIMEOUT_MS};
        cpar_ctx *ctx = (cpar_ctx *)&s; /* must be overwritten */
        TU_OK(cpar_init_from_env(&c, &ctx));
        ck_assert_ptr_nonnull(ctx);
        single_rank_world(ctx, backends[k]);
        TU_OK(cpar_finalize(ctx));

        /* A multi-rank launch cannot use the device backend, whose ranks are
         * threads. On host (ranks as processes) and NCCL it is a real job:
         * alone, rank 0 waits for rank 1 until the deadline, then fails
         * cleanly. */
        setenv("WORLD_SIZE", "2", 1);
        setenv("RANK", "0", 1);
        ctx = (cpar_ctx *)&s;
        if (backends[k] != CPAR_BACKEND_DEVICE) {
            /* started by hand without a job token: refused at once, no default */
            unsetenv("CPAR_JOB_TOKEN");
            const time_t t0 = time(NULL);
            TU_FAILS(cpar_init_from_env(&c, &ctx), CPAR_ERR_INVALID, "no job token");
            ck_assert_int_le(time(NULL) - t0, 1); /* at once: the deadline is TU_TIMEOUT_MS */
            ck_assert_ptr_null(ctx);
            setenv("CPAR_JOB_TOKEN", "init-from-env", 1);
            c.timeout_ms = 300;
            TU_FAILS(cpar_init_from_env(&c, &ctx), CPAR_ERR_TIMEOUT, "rank 1 of 2 missing");
            c.timeout_ms = TU_TIMEOUT_MS;
        } else {
            TU_FAILS(cpar_init_from_env(&c, &ctx), CPAR_ERR_UNSUPPORTED, "WORLD_SIZE");
        }
        ck_assert_ptr_null(ctx);
        /* The host backend's processes share memory: one node only. */
        if (backends[k] == CPAR_BACKEND_HOST) {
            setenv("LOCAL_WORLD_SIZE", "1", 1);
            TU_FAILS(cpar_init_from_env(&c, &ctx), CPAR_ERR_UNSUPPORTED, "single-node");
            ck_assert_ptr_null(ctx);
            unsetenv("LOCAL_WORLD_SIZE");
        }
        unsetenv("WORLD_SIZE");
        unsetenv("RANK");
    }
    TU_FAILS(cpar_init_from_env(NULL, NULL), CPAR_ERR_INVALID, "out");
    if (!cpar_backend_available(CPAR_BACKEND_NCCL)) { /* NULL cfg means NCCL: without a GPU, host */
        cpar_ctx *ctx = NULL;
        TU_OK(cpar_init_from_env(NULL, &ctx));
        ck_assert_int_eq(cpar_ctx_backend(ctx), CPAR_BACKEND_HOST);
        TU_OK(cpar_finalize(ctx));
    }
    /* CPAR_BACKEND overrides the program's backend, and must name one. */
    {
        cpar_init_config c = {.backend = tu_backend(), .timeout_ms = TU_TIMEOUT_MS};
        cpar_ctx *ctx = NULL;
        setenv("CPAR_BACKEND", "HOST", 1);
        TU_OK(cpar_init_from_env(&c, &ctx));
        ck_assert_int_eq(cpar_ctx_backend(ctx), CPAR_BACKEND_HOST);
        TU_OK(cpar_finalize(ctx));
        ctx = (cpar_ctx *)&s;
        setenv("CPAR_BACKEND", "gloo", 1);
        TU_FAILS(cpar_init_from_env(&c, &ctx), CPAR_ERR_INVALID, "CPAR_BACKEND is \"gloo\", expected host, nccl or device");
        ck_assert_ptr_null(ctx);
        unsetenv("CPAR_BACKEND");
    }
    env_restore(&s);
}
END_TEST

/* Every function that takes a context refuses a NULL one with a message. */
START_TEST(test_null_ctx) {
    float buf[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int64_t shape[] = {8}, half[] = {4};
    cpar_tensor a = cpar_tensor_make(buf, CPAR_F32, 1, shape, CPAR_HOST);
    float buf2[8];
    cpar_tensor b = cpar_tensor_make(buf2, CPAR_F32, 1, shape, CPAR_HOST);
    cpar_tensor p0 = cpar_tensor_make(buf2, CPAR_F32, 1, half, CPAR_HOST);
    cpar_tensor p1 = cpar_tensor_make(buf2 + 4, CPAR_F32, 1, half, CPAR_HOST);
    cpar_tensor *pieces[] = {&p0, &p1};
    cpar_tensor rows = cpar_tensor_make(buf2, CPAR_F32, 0, NULL, CPAR_HOST);
    cpar_tensor none = cpar_tensor_make(NULL, CPAR_F32, 1, shape, CPAR_HOST);
    cpar_grid_config g = {.tp = 1};
    cpar_tensor t;

    TU_FAILS(cpar_tensor_alloc(NULL, CPAR_F32, 1, shape, &t), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_tensor_copy(NULL, &a, &b), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_finalize(NULL), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_abort(NULL), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_sync(NULL), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_set_timeout_ms(NULL, 100), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_grid_init(NULL, &g), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_fill(NULL, &b, 1.0), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_cast(NULL, &a, &b), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_axpby(NULL, 1.0f, &a, 1.0f, &b), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_split(NULL, &a, 0, 2, pieces), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_concat(NULL, pieces, 2, 0, &a), CPAR_ERR_INVALID, "ctx");
    TU_FAILS(cpar_row_reduce(NULL, &a, CPAR_ROW_SUM, &rows), CPAR_ERR_INVALID, "ctx");
    ck_assert_ptr_null(cpar_world_group(NULL));
    for (int k = 0; k < CPAR_GROUP_KIND_COUNT; k++) {
        ck_assert_ptr_null(cpar_grid_group(NULL, (cpar_group_kind)k));
        ck_assert_int_eq(cpar_grid_size(NULL, (cpar_group_kind)k), 0);
        ck_assert_int_eq(cpar_grid_rank(NULL, (cpar_group_kind)k), -1);
    }
    /* The inputs were not touched. */
    for (int i = 0; i < 8; i++) ck_assert(buf[i] == (float)(i + 1));
    /* cpar_tensor_free too (NULL data would otherwise be fine). */
    TU_FAILS(cpar_tensor_free(NULL, &none), CPAR_ERR_INVALID, "ctx");
}
END_TEST

/* ---- logging: CPAR_LOG, CPAR_LOG_FILE ------------------------------------------------------------ */

static cpar_status log_rank(cpar_ctx *ctx, void *arg) {
    (void)arg;
    TU_OK(cpar_grid_init(ctx, &(cpar_grid_config){.tp = 2}));
    cpar_tensor bad = cpar_tensor_make(NULL, CPAR_F32, 1, (int64_t[]){-1}, cpar_device(ctx));
    ck_assert_int_eq(cpar_fill(ctx, &bad, 1.0), CPAR_ERR_INVALID); /* a debug line */
    return CPAR_OK;
}

static char *log_slurp(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    char *buf = calloc(1, 1 << 16);
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static int log_count(const char *text, const char *needle) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

/* CPAR_LOG=INFO (any case) with CPAR_LOG_FILE=DIR/log.%h.%p.%r: one file per
 * rank with one banner, the groups and the grid; at debug every line, error
 * lines included, carries its rank. */
START_TEST(test_log_info_files) {
    char dir[] = "/tmp/cpar_log_XXXXXX", pattern[64], path[160], host[64] = "", want[128];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    gethostname(host, sizeof host - 1);
    const char *levels[] = {"INFO", "Debug"};
    for (int l = 0; l < 2; l++) {
        /* a new pattern per job: the process keeps a file open while its pattern stays */
        snprintf(pattern, sizeof pattern, "%s/log%d.%%h.%%p.%%r", dir, l);
        setenv("CPAR_LOG_FILE", pattern, 1);
        setenv("CPAR_LOG", levels[l], 1);
        TU_OK(tu_spawn(2, log_rank, NULL));
        for (int r = 0; r < 2; r++) {
            snprintf(path, sizeof path, "%s/log%d.%s.%ld.%d", dir, l, host, (long)getpid(), r);
            char *text = log_slurp(path);
            ck_assert_msg(text != NULL, "no log file %s", path);
            snprintf(want, sizeof want, "cpar[%d] %s:%ld INFO cpar %s: rank %d of 2 (local %d", r, host,
                     (long)getpid(), cpar_version(), r, r);
            ck_assert_msg(log_count(text, want) == 1, "want one \"%s\" in %s:\n%s", want, path, text);
            ck_assert_msg(strstr(text, "timeout ") && strstr(text, "backend "), "%s", text);
            snprintf(want, sizeof want, "cpar[%d] %s:%ld INFO group: split", r, host, (long)getpid());
            ck_assert_msg(strstr(text, want), "no group line in %s:\n%s", path, text);
            ck_assert_msg(strstr(text, "INFO grid: tp 2 x cp 1"), "no grid line in %s:\n%s", path, text);
            snprintf(want, sizeof want, "cpar[%d] %s:%ld DEBUG CPAR_ERR_INVALID: cpar_fill:", r, host, (long)getpid());
            ck_assert_msg((strstr(text, want) != NULL) == (l == 1), "debug line at %s in %s:\n%s", levels[l], path,
                          text);
            ck_assert_msg(!strstr(text, "cpar[-1]") && !strstr(text, "cpar[-]"), "a line without its rank:\n%s", text);
            free(text);
            unlink(path);
        }
    }
    unsetenv("CPAR_LOG");
    unsetenv("CPAR_LOG_FILE");
    rmdir(dir);
}
END_TEST

/* CPAR_LOG=1 (not a level) is warned about once, on stderr, however many jobs run. */
START_TEST(test_log_bad_level) {
    char path[] = "/tmp/cpar_log_err_XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    setenv("CPAR_LOG", "1", 1);
    unsetenv("CPAR_LOG_FILE");
    TU_OK(tu_spawn(2, log_rank, NULL));
    TU_OK(tu_spawn(2, log_rank, NULL));
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    close(fd);
    unsetenv("CPAR_LOG");
    char *text = log_slurp(path);
    unlink(path);
    ck_assert_ptr_nonnull(text);
    ck_assert_msg(log_count(text, "CPAR_LOG=1 is not a level: use warn, info or debug") == 1, "%s", text);
    ck_assert_msg(!strstr(text, " INFO "), "info lines at CPAR_LOG=1:\n%s", text);
    free(text);
}
END_TEST

Suite *suite(void) {
    Suite *s = suite_create("core: status, dtypes, tensors, spawn and contexts");
    TCase *tc = tcase_create("errors");
    tcase_add_test(tc, test_status_strings);
    tcase_add_test(tc, test_version);
    tcase_add_test(tc, test_thread_last_error);
    tcase_add_test(tc, test_ctx_last_error);
    tcase_set_timeout(tc, 60);
    suite_add_tcase(s, tc);

    tc = tcase_create("dtypes");
    tcase_add_test(tc, test_dtypes);
    tcase_add_test(tc, test_f16_known_patterns);
    tcase_add_test(tc, test_f16_exhaustive);
    tcase_add_test(tc, test_f16_random_vs_reference);
    tcase_add_test(tc, test_bf16_known_patterns);
    tcase_add_test(tc, test_bf16_exhaustive);
    tcase_set_timeout(tc, 60);
    suite_add_tcase(s, tc);

    tc = tcase_create("tensors");
    tcase_add_test(tc, test_tensor_make);
    tcase_add_test(tc, test_alloc_copy_roundtrip);
    tcase_add_test(tc, test_alloc_copy_bad_input);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);

    tc = tcase_create("logging");
    tcase_add_test(tc, test_log_info_files);
    tcase_add_test(tc, test_log_bad_level);
    tcase_set_timeout(tc, 60);
    suite_add_tcase(s, tc);

    tc = tcase_create("contexts");
    tcase_add_test(tc, test_spawn_bad_input);
    tcase_add_test(tc, test_backends);
    tcase_add_loop_test(tc, test_pinned, 0, 4); /* 1-4 ranks: the embedding's vocabulary split */
    tcase_add_loop_test(tc, test_device_backend_without_peer_access, 1, 5); /* 1-4 ranks */
    tcase_add_test(tc, test_device_backend_below_sm80);
    tcase_add_test(tc, test_accessors);
    tcase_add_test(tc, test_default_timeout);
    tcase_add_test(tc, test_init_from_env);
    tcase_add_test(tc, test_null_ctx);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
