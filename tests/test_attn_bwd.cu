/* SPDX-License-Identifier: MIT */
/* test_attn_bwd.cu — the flash-attention backward kernels (cpar_dev_attention_bwd,
 * cpar_kernels.cu §16) against an fp64 reference.
 *
 * Sim build only. Includes cpar_kernels.cu itself (like test_mma.cu) and
 * links nothing else from cpar. Each case draws random q, k, v, dout, runs an
 * fp64 forward (materialised softmax) for out and lse, and the fp64 backward
 * from the same out and lse: P = exp(scale·q kᵀ - lse), D = rowsum(dout∘out),
 * dS = P∘(dout vᵀ - D), dq = scale·dS k, dk = scale·dSᵀ q, dv = Pᵀ dout. The
 * kernel gets out and lse rounded to what it takes (out_dt, fp32) and must
 * add (+=) the gradients onto random nonzero fp32 dq/dk/dv. Inputs are exact
 * in their dtypes, so the error is the kernel's alone (P, dS and an F32 dout
 * rounded to 16 bits for the tensor cores, fp32 sums). Covered: d 64, 128, 40,
 * 8; odd sq, sk (1 ... 130), sq != sk; causal and not; GQA (4/2, 3/1); F16 and
 * BF16; out_dt F32 and 16-bit; (batch, head) strides longer than the slice
 * with the slice a sub-range of a longer sequence (ring attention's use),
 * also strides that misalign rows (scalar loads); a row with lse = -inf;
 * one attention computed as two key blocks with the full out/lse (the ring's
 * accumulation). Everything outside the slices, inputs included, holds 0xFF
 * bytes (NaN): a read there poisons the result, a write there is caught. Each
 * case runs in the forward and the reverse fiber schedule (some also
 * shuffled), so a missing barrier shows up as a wrong result.
 * AB_VERBOSE=1 in the environment prints every case's errors. */
#define CPAR_KERNELS_ATTENTION_ONLY /* this suite needs §1-4, 12, 15, 16 only */
#include "cpar_kernels.cu"
#include "tests/suite.h"

#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

/* ck_assert for inner loops (Check writes every passing assertion to a pipe). */
#define REQUIRE(cond, ...)                                                                                             \
    do {                                                                                                               \
        if (!(cond)) ck_abort_msg(__VA_ARGS__);                                                                        \
    } while (0)

static double urand(unsigned *s) {
    *s = *s * 1664525u + 1013904223u;
    return ((*s >> 8) / 16777216.0) * 2.0 - 1.0;
}

/* fp32 -> element of dt at p[i] and back (exact for the dtype's values). */
static void put(void *p, cpar_dtype dt, size_t i, double v) {
    switch (dt) {
    case CPAR_F16: static_cast<__half *>(p)[i] = cpar__narrow<__half>((float)v); break;
    case CPAR_BF16: static_cast<__nv_bfloat16 *>(p)[i] = cpar__narrow<__nv_bfloat16>((float)v); break;
    default: static_cast<float *>(p)[i] = (float)v; break;
    }
}
static double get(const void *p, cpar_dtype dt, size_t i) {
    switch (dt) {
    case CPAR_F16: return cpar__widen(static_cast<const __half *>(p)[i]);
    case CPAR_BF16: return cpar__widen(static_cast<const __nv_bfloat16 *>(p)[i]);
    default: return static_cast<const float *>(p)[i];
    }
}
/* A value as the dtype stores it. */
static double round_to(cpar_dtype dt, double v) {
    float f;
    put(&f, dt, 0, v);
    return get(&f, dt, 0);
}

/* Device buffer of n elements of dt, all bytes 0xFF (NaN in every float dtype). */
static void *dalloc(size_t n, cpar_dtype dt) {
    void *p = NULL;
    const size_t bytes = n * cpar__dtype_size(dt);
    ck_assert_int_eq(cudaMalloc(&p, bytes ? bytes : 1), cudaSuccess);
    memset(p, 0xFF, bytes);
    return p;
}
static bool is_poison(const float *p, size_t i) {
    uint32_t u;
    memcpy(&u, &p[i], 4);
    return u == 0xFFFFFFFFu;
}

struct Case {
    const char *name;
    cpar_dtype dt, out_dt;
    int b, hq, hkv, sq, sk, d;
    bool causal;
    int pad;        /* > 0: slices are sub-ranges of sequences pad rows longer */
    int misalign;   /* elements added to every (batch, head) stride */
    int ninf_row;   /* >= 0: this query row (of every head) gets lse = -inf, out = 0 */
    int split;      /* > 0: two calls, keys [0, split) and [split, sk), with the full out/lse */
    float scale;    /* 0: 1/sqrt(d) */
    float p;        /* dropout: 0 = none */
    bool adq = false; /* atomic_dq: dq from the dkdv kernel by atomics */
};

/* Per-tensor error: max |got - init - ref| / max |ref| (a NaN counts as
 * the worst: fmax would drop it, and the NaNs the simulator's cp.async
 * model leaves in a buffer read too early with it). */
struct Err {
    double worst = 0, ref_max = 0;
    void add(double got, double want) {
        const double e = fabs(got - want);
        if (!(e <= worst)) worst = e;
        ref_max = fmax(ref_max, fabs(want));
    }
    double rel() const { return worst / (ref_max > 0 ? ref_max : 1); }
};

static void run_case(const Case &c, unsigned seed) {
    const int64_t b = c.b, hq = c.hq, hkv = c.hkv, sq = c.sq, sk = c.sk, d = c.d, grp = hq / hkv;
    const double scale = c.scale > 0 ? c.scale : 1.0 / sqrt((double)d);
    /* slice geometry: rows [off, off + s) of a sequence of s + pad rows */
    const int64_t offq = c.pad / 2, offk = (c.pad + 1) / 2;
    const int64_t q_bh = (sq + c.pad) * d + c.misalign, kv_bh = (sk + c.pad) * d + c.misalign;
    const int64_t o_bh = q_bh, lse_bh = sq + c.pad + (c.misalign ? 1 : 0), dq_bh = q_bh, dkv_bh = kv_bh;

    void *q = dalloc(b * hq * q_bh, c.dt), *k = dalloc(b * hkv * kv_bh, c.dt), *v = dalloc(b * hkv * kv_bh, c.dt);
    void *out = dalloc(b * hq * o_bh, c.out_dt), *dout = dalloc(b * hq * o_bh, c.out_dt);
    float *lse = (float *)dalloc(b * hq * lse_bh, CPAR_F32), *dq = (float *)dalloc(b * hq * dq_bh, CPAR_F32);
    float *dk = (float *)dalloc(b * hkv * dkv_bh, CPAR_F32), *dv = (float *)dalloc(b * hkv * dkv_bh, CPAR_F32);
    /* element indices: in the device buffers (qi, ki, li) and in the dense host copies (flat_q, flat_k) */
    auto qi = [&](int64_t bi, int64_t h, int64_t i, int64_t x) {
        return (size_t)((bi * hq + h) * q_bh + (offq + i) * d + x);
    };
    auto ki = [&](int64_t bi, int64_t h, int64_t j, int64_t x) {
        return (size_t)((bi * hkv + h) * kv_bh + (offk + j) * d + x);
    };
    auto li = [&](int64_t bi, int64_t h, int64_t i) { return (size_t)((bi * hq + h) * lse_bh + offq + i); };

    /* inputs, exact in their dtypes; initial gradients (the += base) */
    std::vector<double> Q(b * hq * sq * d), K(b * hkv * sk * d), V(K.size()), dO(Q.size());
    std::vector<double> dq0(Q.size()), dk0(K.size()), dv0(K.size());
    auto flat_q = [&](int64_t bi, int64_t h, int64_t i, int64_t x) {
        return (size_t)(((bi * hq + h) * sq + i) * d + x);
    };
    auto flat_k = [&](int64_t bi, int64_t h, int64_t j, int64_t x) {
        return (size_t)(((bi * hkv + h) * sk + j) * d + x);
    };
    for (int64_t bi = 0; bi < b; bi++)
        for (int64_t h = 0; h < hq; h++)
            for (int64_t i = 0; i < sq; i++)
                for (int64_t x = 0; x < d; x++) {
                    const size_t f = flat_q(bi, h, i, x), m = qi(bi, h, i, x);
                    Q[f] = round_to(c.dt, 1.5 * urand(&seed));
                    put(q, c.dt, m, Q[f]);
                    dO[f] = round_to(c.out_dt, urand(&seed));
                    put(dout, c.out_dt, m, dO[f]);
                    dq0[f] = urand(&seed);
                    dq[m] = (float)dq0[f];
                }
    for (int64_t bi = 0; bi < b; bi++)
        for (int64_t h = 0; h < hkv; h++)
            for (int64_t j = 0; j < sk; j++)
                for (int64_t x = 0; x < d; x++) {
                    const size_t f = flat_k(bi, h, j, x), m = ki(bi, h, j, x);
                    K[f] = round_to(c.dt, 1.5 * urand(&seed));
                    put(k, c.dt, m, K[f]);
                    V[f] = round_to(c.dt, urand(&seed));
                    put(v, c.dt, m, V[f]);
                    dk0[f] = (float)urand(&seed);
                    dv0[f] = (float)urand(&seed);
                    dk[m] = (float)dk0[f];
                    dv[m] = (float)dv0[f];
                }

    /* fp64 forward and backward per (batch, q head) */
    std::vector<double> gq(Q.size(), 0.0), gk(K.size(), 0.0), gv(K.size(), 0.0), S(sk), P(sk), O(d), Z(sk);
    /* dropout's keep decision at (bh, query i, key j), positions = indices in
     * the whole attention (cpar.h §12's definition; only the Philox block
     * function is the kernel file's) */
    const cpar_rng_state rng = {0x1234567890abcdefull + seed, 3};
    auto keep = [&](int64_t bh, int64_t i, int64_t j) {
        const cpar__u4 w = cpar__philox4_sub(rng.seed, rng.offset + (uint64_t)j / 4,
                                             ((uint64_t)bh + 1) * 4294967296ull + (uint64_t)i);
        return (double)(w.w[j % 4] >> 8) / 16777216.0 >= (double)c.p ? 1.0 : 0.0;
    };
    for (int64_t bi = 0; bi < b; bi++)
        for (int64_t h = 0; h < hq; h++) {
            const int64_t hk = h / grp;
            for (int64_t i = 0; i < sq; i++) {
                double mx = -INFINITY;
                for (int64_t j = 0; j < sk; j++) {
                    double acc = 0;
                    for (int64_t x = 0; x < d; x++) acc += Q[flat_q(bi, h, i, x)] * K[flat_k(bi, hk, j, x)];
                    S[j] = (c.causal && j > i) ? -INFINITY : scale * acc;
                    mx = fmax(mx, S[j]);
                }
                double sum = 0;
                for (int64_t j = 0; j < sk; j++) sum += exp(S[j] - mx);
                double L = mx + log(sum);
                for (int64_t x = 0; x < d; x++) O[x] = 0;
                for (int64_t j = 0; j < sk; j++) {
                    P[j] = exp(S[j] - L);
                    Z[j] = c.p > 0 ? keep(bi * hq + h, i, j) / (1.0 - c.p) : 1.0;
                    for (int64_t x = 0; x < d; x++) O[x] += P[j] * Z[j] * V[flat_k(bi, hk, j, x)];
                }
                if (i == c.ninf_row) { /* the row sees no key (as a ring block may): no gradient */
                    L = -INFINITY;
                    for (int64_t j = 0; j < sk; j++) P[j] = 0;
                    for (int64_t x = 0; x < d; x++) O[x] = 0;
                }
                lse[li(bi, h, i)] = (float)L;
                double Dsum = 0;
                for (int64_t x = 0; x < d; x++) {
                    put(out, c.out_dt, qi(bi, h, i, x), O[x]);
                    Dsum += dO[flat_q(bi, h, i, x)] * O[x];
                }
                for (int64_t j = 0; j < sk; j++) {
                    if (P[j] == 0) continue;
                    double dp = 0;
                    for (int64_t x = 0; x < d; x++) dp += dO[flat_q(bi, h, i, x)] * V[flat_k(bi, hk, j, x)];
                    const double ds = P[j] * (dp * Z[j] - Dsum);
                    for (int64_t x = 0; x < d; x++) {
                        gq[flat_q(bi, h, i, x)] += scale * ds * K[flat_k(bi, hk, j, x)];
                        gk[flat_k(bi, hk, j, x)] += scale * ds * Q[flat_q(bi, h, i, x)];
                        gv[flat_k(bi, hk, j, x)] += P[j] * Z[j] * dO[flat_q(bi, h, i, x)];
                    }
                }
            }
        }

    /* the kernel, as one call or as two key blocks sharing out/lse */
    cpar_dev_attn a = {}; /* no dropout, positions = row indices */
    a.atomic_dq = c.adq;
    a.dt = c.dt;
    a.b = b;
    a.hq = hq;
    a.hkv = hkv;
    a.sq = sq;
    a.d = d;
    a.q_bh = q_bh;
    a.kv_bh = kv_bh;
    a.causal = c.causal;
    a.scale = (float)scale;
    a.dropout_p = c.p;
    a.rng = rng;
    a.q = static_cast<const char *>(q) + qi(0, 0, 0, 0) * cpar__dtype_size(c.dt);
    const size_t osz = cpar__dtype_size(c.out_dt);
    const char *outp = static_cast<const char *>(out) + qi(0, 0, 0, 0) * osz;
    const char *doutp = static_cast<const char *>(dout) + qi(0, 0, 0, 0) * osz;
    const int nblk = c.split > 0 ? 2 : 1;
    for (int blk = 0; blk < nblk; blk++) {
        const int64_t j0 = blk == 0 ? 0 : c.split, j1 = nblk == 1 || blk == 1 ? sk : c.split;
        a.sk = j1 - j0;
        a.kp = cpar_dev_attn_pos{}; /* the block's keys are keys j0.. of the whole attention */
        a.kp.off1 = j0;
        a.k = static_cast<const char *>(k) + ki(0, 0, j0, 0) * cpar__dtype_size(c.dt);
        a.v = static_cast<const char *>(v) + ki(0, 0, j0, 0) * cpar__dtype_size(c.dt);
        const size_t scratch_bytes = cpar_dev_attention_bwd_scratch_bytes(&a);
        /* Dsum and lse2 per query row, each (b, h) slice padded to 64 rows */
        ck_assert_uint_eq(scratch_bytes, 2 * (size_t)(b * hq * ((sq + 63) / 64 * 64)) * sizeof(float));
        void *scratch = dalloc(scratch_bytes, CPAR_U8);
        const cpar_status st = cpar_dev_attention_bwd(&a, outp, doutp, c.out_dt, o_bh, lse + li(0, 0, 0), lse_bh,
                                                      dq + qi(0, 0, 0, 0), dq_bh, dk + ki(0, 0, j0, 0),
                                                      dv + ki(0, 0, j0, 0), dkv_bh, scratch, NULL);
        ck_assert_msg(st == CPAR_OK, "%s: cpar_dev_attention_bwd -> %d: %s", c.name, (int)st, cpar_dev_last_error());
        ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
        cudaFree(scratch);
    }

    /* compare; untouched elements keep their poison */
    const bool bf = c.dt == CPAR_BF16 || c.out_dt == CPAR_BF16;
    const double tol = bf ? 2e-2 : 2.5e-3; /* about 5 units of roundoff; seen: <= 1.2 */

    /* the forward on the same (strided, perhaps misaligned) layout: out and
     * lse against the reference's (out holds O rounded to out_dt); a
     * misaligned stride takes the epilogue's element stores, else its
     * 16-byte stores through shared memory */
    if (nblk == 1 && c.ninf_row < 0) {
        a.sk = sk, a.kp = cpar_dev_attn_pos{};
        a.k = static_cast<const char *>(k) + ki(0, 0, 0, 0) * cpar__dtype_size(c.dt);
        a.v = static_cast<const char *>(v) + ki(0, 0, 0, 0) * cpar__dtype_size(c.dt);
        void *out2 = dalloc(b * hq * o_bh, c.out_dt);
        float *lse2 = (float *)dalloc(b * hq * lse_bh, CPAR_F32);
        ck_assert_int_eq(cpar_dev_attention_fwd(&a, static_cast<char *>(out2) + qi(0, 0, 0, 0) * osz, c.out_dt, o_bh,
                                                lse2 + li(0, 0, 0), lse_bh, NULL), CPAR_OK);
        ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
        Err eo;
        for (int64_t bi = 0; bi < b; bi++)
            for (int64_t h = 0; h < hq; h++)
                for (int64_t i = 0; i < sq; i++) {
                    const double wl = lse[li(bi, h, i)], gl = lse2[li(bi, h, i)];
                    REQUIRE(fabs(gl - wl) <= 1e-3 * (1 + fabs(wl)), "%s: forward lse row %lld is %g, expected %g", c.name,
                            (long long)i, gl, wl);
                    for (int64_t x = 0; x < d; x++)
                        eo.add(get(out2, c.out_dt, qi(bi, h, i, x)), get(out, c.out_dt, qi(bi, h, i, x)));
                }
        ck_assert_msg(eo.rel() <= tol, "%s: forward out relative max error %.3g, bound %.3g", c.name, eo.rel(), tol);
        size_t written = 0; /* nothing outside the slices */
        for (int64_t m = 0; m < b * hq * o_bh; m++) {
            const int64_t r = (m % o_bh) / d;
            if ((m % o_bh) >= (sq + c.pad) * d || r < offq || r >= offq + sq)
                written += c.out_dt == CPAR_F32 ? !is_poison((const float *)out2, m)
                                                : ((const uint16_t *)out2)[m] != 0xFFFF;
        }
        ck_assert_msg(written == 0, "%s: the forward wrote %zu elements outside the slices", c.name, written);
        /* the CTAs in batch·head order (fwd_heads_first): the same bits */
        void *out3 = dalloc(b * hq * o_bh, c.out_dt);
        float *lse3 = (float *)dalloc(b * hq * lse_bh, CPAR_F32);
        a.fwd_heads_first = true;
        ck_assert_int_eq(cpar_dev_attention_fwd(&a, static_cast<char *>(out3) + qi(0, 0, 0, 0) * osz, c.out_dt, o_bh,
                                                lse3 + li(0, 0, 0), lse_bh, NULL), CPAR_OK);
        a.fwd_heads_first = false;
        ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
        ck_assert_msg(memcmp(out2, out3, (size_t)(b * hq * o_bh) * osz) == 0 &&
                          memcmp(lse2, lse3, sizeof(float) * (size_t)(b * hq * lse_bh)) == 0,
                      "%s: the forward in batch·head order differs", c.name);
        void *fbufs[] = {out2, lse2, out3, lse3};
        for (void *fb : fbufs) ck_assert_int_eq(cudaFree(fb), cudaSuccess);
    }
    Err eq, ek, ev;
    for (int64_t bi = 0; bi < b; bi++)
        for (int64_t h = 0; h < hq; h++)
            for (int64_t i = 0; i < sq; i++)
                for (int64_t x = 0; x < d; x++) {
                    const size_t f = flat_q(bi, h, i, x), m = qi(bi, h, i, x);
                    eq.add((double)dq[m] - dq0[f], gq[f]);
                    if (i == c.ninf_row)
                        REQUIRE(dq[m] == (float)dq0[f], "%s: dq row %lld with lse = -inf changed: %g -> %g", c.name,
                                (long long)i, dq0[f], (double)dq[m]);
                }
    for (int64_t bi = 0; bi < b; bi++)
        for (int64_t h = 0; h < hkv; h++)
            for (int64_t j = 0; j < sk; j++)
                for (int64_t x = 0; x < d; x++) {
                    const size_t f = flat_k(bi, h, j, x), m = ki(bi, h, j, x);
                    ek.add((double)dk[m] - dk0[f], gk[f]);
                    ev.add((double)dv[m] - dv0[f], gv[f]);
                }
    const char *sched = cudasim_schedule_name(cudasim_get_schedule(NULL));
    if (getenv("AB_VERBOSE"))
        printf("%-40s %-8s dq %.3g dk %.3g dv %.3g (max |ref| %.3g %.3g %.3g)\n", c.name, sched, eq.rel(), ek.rel(),
               ev.rel(), eq.ref_max, ek.ref_max, ev.ref_max);
    ck_assert_msg(eq.rel() <= tol && ek.rel() <= tol && ev.rel() <= tol,
                  "%s (%s): relative max error dq %.3g, dk %.3g, dv %.3g; bound %.3g", c.name, sched, eq.rel(),
                  ek.rel(), ev.rel(), tol);
    size_t touched = 0;
    for (int64_t m = 0; m < b * hq * dq_bh; m++) {
        const int64_t r = (m % dq_bh) / d;
        if ((m % dq_bh) >= (sq + c.pad) * d || r < offq || r >= offq + sq) touched += !is_poison(dq, m);
    }
    for (int64_t m = 0; m < b * hkv * dkv_bh; m++) {
        const int64_t r = (m % dkv_bh) / d;
        if ((m % dkv_bh) >= (sk + c.pad) * d || r < offk || r >= offk + sk)
            touched += !is_poison(dk, m) + !is_poison(dv, m);
    }
    ck_assert_msg(touched == 0, "%s: %zu elements outside the slices were written", c.name, touched);
    void *bufs[] = {q, k, v, out, dout, lse, dq, dk, dv};
    for (void *p : bufs) ck_assert_int_eq(cudaFree(p), cudaSuccess);
    ck_assert_int_eq(cudasim_check_memory(), 0);
}

static const cpar_dtype F16 = CPAR_F16, BF16 = CPAR_BF16, F32 = CPAR_F32;

/*                 name                    dt    out_dt b hq hkv  sq   sk   d  causal pad mis ninf split scale p */
static const Case SHAPES[] = {
    {"d64 17x17",                          F16,  F16,  1, 1, 1,   17,  17, 64, false, 0, 0, -1, 0, 0, 0},
    {"d64 77x130 causal",                  BF16, BF16, 1, 1, 1,   77, 130, 64, true,  0, 0, -1, 0, 0, 0},
    {"d64 130x77 causal out f32",          F16,  F32,  1, 1, 1,  130,  77, 64, true,  0, 0, -1, 0, 0, 0},
    {"d40 77x77 out f32",                  BF16, F32,  1, 1, 1,   77,  77, 40, false, 0, 0, -1, 0, 0, 0},
    {"d8 1x1",                             F16,  F16,  1, 1, 1,    1,   1,  8, false, 0, 0, -1, 0, 0, 0},
    {"d64 1x130 causal",                   BF16, F32,  1, 1, 1,    1, 130, 64, true,  0, 0, -1, 0, 0, 0},
    {"d64 130x1 causal",                   F16,  F16,  1, 1, 1,  130,   1, 64, true,  0, 0, -1, 0, 0, 0},
};
static const Case WIDE[] = {
    {"d128 33x17",                         F16,  F16,  1, 1, 1,   33,  17, 128, false, 0, 0, -1, 0, 0, 0},
    {"d128 130x77 causal out f32",         BF16, F32,  1, 1, 1,  130,  77, 128, true,  0, 0, -1, 0, 0, 0},
    {"d128 17x77 causal",                  F16,  F16,  1, 1, 1,   17,  77, 128, true,  0, 0, -1, 0, 0, 0},
    {"gqa 4/2 d128 77x130 causal out f32", F16,  F32,  1, 4, 2,   77, 130, 128, true,  0, 0, -1, 0, 0, 0},
    {"d72 (tile 128) 40x9",                BF16, BF16, 1, 1, 1,   40,   9, 72, false, 0, 0, -1, 0, 0, 0},
};
static const Case GQA[] = {
    {"gqa 4/2 b2 d64 33x17 causal",        F16,  F32,  2, 4, 2,   33,  17, 64, true,  0, 0, -1, 0, 0, 0},
    {"gqa 3/1 d128 17x65",                 BF16, BF16, 1, 3, 1,   17,  65, 128, false, 0, 0, -1, 0, 0, 0},
    {"gqa 3/1 d40 20x31 causal scale .3",  F16,  F16,  1, 3, 1,   20,  31, 40, true,  0, 0, -1, 0, 0.3f, 0},
};
static const Case STRIDED[] = {
    {"strided d64 37x21 causal",           BF16, F32,  2, 2, 2,   37,  21, 64, true,  9, 0, -1, 0, 0, 0},
    {"strided misaligned d40 23x30",       F16,  F16,  1, 2, 1,   23,  30, 40, false, 5, 4,  -1, 0, 0, 0},
    {"strided misaligned d64 out f32",     F16,  F32,  1, 3, 1,   19,  26, 64, true,  2, 2,  -1, 0, 0, 0},
    {"strided misaligned d128 gqa 4/2",    BF16, BF16, 1, 4, 2,   19,  13, 128, true, 3, 4,  -1, 0, 0, 0},
    {"lse -inf row d64 20x30",             F16,  F32,  1, 2, 1,   20,  30, 64, false, 0, 0,  5, 0, 0, 0},
    {"lse -inf row d128 causal strided",   BF16, BF16, 1, 1, 1,   21,  21, 128, true, 4, 0, 0, 0, 0, 0},
    {"two key blocks d64 40x100",          BF16, F32,  1, 2, 1,   40, 100, 64, false, 0, 0, -1, 37, 0, 0},
    {"two key blocks d40 strided 30x70",   F16,  F16,  1, 1, 1,   30,  70, 40, false, 6, 0,  3, 64, 0, 0},
};

static const Case DROPOUT[] = {
    {"dropout d64 33x45 causal",           F16,  F16,  1, 2, 2,   33,  45, 64, true,  0, 0, -1, 0, 0, 0.3f},
    {"dropout gqa 4/2 d128 70x40 out f32", BF16, F32,  1, 4, 2,   70,  40, 128, false, 0, 0, -1, 0, 0, 0.5f},
    {"dropout strided misaligned d40",     F16,  F32,  2, 2, 1,   23,  30, 40, true,  5, 4, -1, 0, 0, 0.2f},
    {"dropout two key blocks d64 40x100",  BF16, F32,  1, 2, 1,   40, 100, 64, false, 0, 0, -1, 37, 0, 0.4f},
    {"dropout lse -inf row d64",           F16,  F16,  1, 1, 1,   20,  30, 64, false, 0, 0,  5, 0, 0, 0.3f},
};

/* atomic_dq: dq added by the dkdv kernel (d 64 and 128: one and two column
 * slices; a general d), every mask and layout above; an odd misalignment
 * leaves some heads' dq 4-byte aligned only (one-float atomics there),
 * in whole query tiles (one base pointer) and partial ones */
static const Case ATOMIC[] = {
    {"adq d64 77x130 causal",              BF16, BF16, 1, 1, 1,   77, 130, 64, true,  0, 0, -1, 0, 0, 0, true},
    {"adq d128 130x77 causal out f32",     F16,  F32,  1, 1, 1,  130,  77, 128, true, 0, 0, -1, 0, 0, 0, true},
    {"adq d40 77x77 out f32",              BF16, F32,  1, 1, 1,   77,  77, 40, false, 0, 0, -1, 0, 0, 0, true},
    {"adq d72 (tile 128) 40x9",            BF16, BF16, 1, 1, 1,   40,   9, 72, false, 0, 0, -1, 0, 0, 0, true},
    {"adq gqa 4/2 b2 d64 33x17 causal",    F16,  F32,  2, 4, 2,   33,  17, 64, true,  0, 0, -1, 0, 0, 0, true},
    {"adq strided misaligned d128 gqa 4/2", BF16, BF16, 1, 4, 2,  19,  13, 128, true, 3, 4,  -1, 0, 0, 0, true},
    {"adq strided odd misaligned d64",     F16,  F32,  1, 3, 1,   19,  26, 64, true,  2, 3,  -1, 0, 0, 0, true},
    {"adq strided odd misaligned d128 70x40", BF16, F32, 1, 2, 1,  70,  40, 128, false, 2, 3, -1, 0, 0, 0, true},
    {"adq misaligned d64 130x70 causal",   F16,  F16,  1, 3, 1,  130,  70, 64, true,  0, 1,  -1, 0, 0, 0, true},
    {"adq lse -inf row d64 20x30",         F16,  F32,  1, 2, 1,   20,  30, 64, false, 0, 0,  5, 0, 0, 0, true},
    {"adq two key blocks d64 40x100",      BF16, F32,  1, 2, 1,   40, 100, 64, false, 0, 0, -1, 37, 0, 0, true},
    {"adq dropout gqa 4/2 d128 70x40",     BF16, F32,  1, 4, 2,   70,  40, 128, false, 0, 0, -1, 0, 0, 0.5f, true},
    {"adq dropout d64 33x45 causal",       F16,  F16,  1, 2, 2,   33,  45, 64, true,  0, 0, -1, 0, 0, 0.3f, true},
};

/* A GPU whose blocks get 99 KB of shared memory (sm_86, sm_89, sm_120):
 * the d 128 kernels (104 and 111 KB) would not launch, so the lean ones run
 * (one Q buffer in dkdv, refilled after dK; one V buffer in dq, refilled
 * after dS). Several query steps and key tiles, so the refills are used;
 * the general kernel (dropout, d 96); atomic_dq (dkdv's Q refill then
 * precedes the atomic dq's work). */
static const Case LEAN[] = {
    {"lean d128 150x140",                  F16,  F16,  1, 1, 1,  150, 140, 128, false, 0, 0, -1, 0, 0, 0},
    {"lean d128 200x130 causal out f32",   BF16, F32,  1, 1, 1,  200, 130, 128, true,  0, 0, -1, 0, 0, 0},
    {"lean gqa 4/2 d128 77x130 causal",    F16,  F32,  1, 4, 2,   77, 130, 128, true,  0, 0, -1, 0, 0, 0},
    {"lean strided misaligned d128 gqa",   BF16, BF16, 1, 4, 2,   70,  93, 128, true,  3, 4, -1, 0, 0, 0},
    {"lean dropout gqa 4/2 d128 70x140",   BF16, F32,  1, 4, 2,   70, 140, 128, false, 0, 0, -1, 0, 0, 0.5f},
    {"lean d96 (tile 128) 90x70 causal",   F16,  F16,  1, 2, 1,   90,  70, 96, true,   0, 0, -1, 0, 0, 0},
    {"lean adq d128 130x77 causal",        F16,  F32,  1, 1, 1,  130,  77, 128, true,  0, 0, -1, 0, 0, 0, true},
    {"lean adq dropout gqa 4/2 d128",      BF16, F32,  1, 4, 2,   70, 140, 128, false, 0, 0, -1, 0, 0, 0.5f, true},
};

/* A GPU whose SM holds 164 KB of shared memory (sm_80, sm_87: A100, A30,
 * Orin): two of the d 128 kernels' CTAs (104 and 111 KB) would not fit one
 * SM, so the slim ones run (the lean buffers; one buffer for Pᵀ then dSᵀ in
 * dkdv; K and V swapping between two buffers in dq); the d 64 kernels
 * (76 KB at most) stay as they are, and the test checks that no launch
 * takes more than 81 KB. Several query steps and key tiles, so every
 * buffer is refilled and swapped; atomic_dq (its dq reads dSᵀ from the
 * buffer P left). */
static const Case SLIM[] = {
    {"slim d128 150x140",                  F16,  F16,  1, 1, 1,  150, 140, 128, false, 0, 0, -1, 0, 0, 0},
    {"slim d128 200x130 causal out f32",   BF16, F32,  1, 1, 1,  200, 130, 128, true,  0, 0, -1, 0, 0, 0},
    {"slim gqa 4/2 d128 77x200 causal",    F16,  F32,  1, 4, 2,   77, 200, 128, true,  0, 0, -1, 0, 0, 0},
    {"slim strided misaligned d128 gqa",   BF16, BF16, 1, 4, 2,   70,  93, 128, true,  3, 4, -1, 0, 0, 0},
    {"slim dropout gqa 4/2 d128 70x140",   BF16, F32,  1, 4, 2,   70, 140, 128, false, 0, 0, -1, 0, 0, 0.5f},
    {"slim d96 (tile 128) 90x200 causal",  F16,  F16,  1, 2, 1,   90, 200, 96, true,   0, 0, -1, 0, 0, 0},
    {"slim dropout d64 130x200",           BF16, F32,  1, 2, 1,  130, 200, 64, false, 0, 0, -1, 0, 0, 0.3f},
    {"slim adq d128 130x77 causal",        F16,  F32,  1, 1, 1,  130,  77, 128, true,  0, 0, -1, 0, 0, 0, true},
    {"slim adq dropout gqa 4/2 d128",      BF16, F32,  1, 4, 2,   70, 140, 128, false, 0, 0, -1, 0, 0, 0.5f, true},
    {"slim adq dropout d64 130x70",        F16,  F16,  1, 2, 2,  130,  70, 64, true,  0, 0, -1, 0, 0, 0.3f, true},
};

/* warps lets one warp run to its next barrier before the others start: a
 * barrier missing across the kernels' warp-collective mma's shows there
 * (forward, reverse and shuffle keep the warps in step between barriers) */
static const cudasim_schedule schedules[] = {CUDASIM_SCHED_FORWARD, CUDASIM_SCHED_REVERSE, CUDASIM_SCHED_WARPS,
                                             CUDASIM_SCHED_SHUFFLE};

template <size_t N> static void run_all(const Case (&cases)[N], int sched, unsigned seed) {
    cudasim_set_schedule(schedules[sched], 1000 + seed);
    for (size_t i = 0; i < N; i++) run_case(cases[i], seed + 17 * (unsigned)i);
}

START_TEST(shapes) { run_all(SHAPES, _i, 11); }
END_TEST
START_TEST(wide) { run_all(WIDE, _i, 23); }
END_TEST
START_TEST(gqa) {
    run_all(GQA, _i, 37);
    /* a CTA looping over several (batch, head) slices (grid y past CUDA's cap) */
    cpar__ab_grid_y_cap = 2;
    run_all(GQA, _i, 38);
    run_all(STRIDED, _i, 39);
    cpar__ab_grid_y_cap = 65535;
}
END_TEST
START_TEST(strided) { run_all(STRIDED, _i, 41); }
END_TEST
/* dropout: the forward's mask (positions of the whole attention: the second
 * key block's start at split) applied in both kernels */
START_TEST(dropout) { run_all(DROPOUT, _i, 53); }
END_TEST
START_TEST(atomic_dq) { run_all(ATOMIC, _i, 59); }
END_TEST
START_TEST(lean) {
    cudasim_set_compute_capability(86); /* an 8.x GPU, where the slim kernels do not fit two CTAs either */
    cudasim_set_smem_optin(99 * 1024);
    (void)cudasim_smem_high_water();
    run_all(LEAN, _i, 61);
    const size_t high = cudasim_smem_high_water(); /* the lean kernels (87-96 KB), not the slim ones */
    ck_assert_msg(high > 81 * 1024 && high <= 99 * 1024,
                  "the largest launch took %zu bytes of shared memory, expected 81-99 KB (the lean kernels)", high);
    cudasim_set_smem_optin(0);
    cudasim_set_compute_capability(0);
}
END_TEST
START_TEST(slim) {
    cudasim_set_compute_capability(80);
    cudasim_set_smem_optin(163 * 1024); /* 164 KB an SM */
    (void)cudasim_smem_high_water();
    run_all(SLIM, _i, 67);
    const size_t high = cudasim_smem_high_water();
    ck_assert_msg(high > 64 * 1024 && high <= 81 * 1024,
                  "the largest launch took %zu bytes of shared memory, expected 64-81 KB (two CTAs in 164 KB)", high);
    cudasim_set_smem_optin(0);
    cudasim_set_compute_capability(0);
}
END_TEST

/* Results do not depend on the schedule (no atomics, fixed summation
 * order), nor on the GPU's shared memory: the lean (99 KB a block) and slim
 * (164 KB an SM, compute capability 8.0) kernels give the default's bits.
 * Runs 0-3: the four schedules; 4: lean (compute capability 8.6); 5: slim. */
static void deterministic_case(const Case &c) {
    std::vector<float> first;
    for (int run = 0; run < 6; run++) {
        const int sched = run < 4 ? run : 0;
        cudasim_set_schedule(schedules[sched], 99);
        cudasim_set_smem_optin(run == 4 ? 99 * 1024 : run == 5 ? 163 * 1024 : 0);
        cudasim_set_compute_capability(run == 4 ? 86 : run == 5 ? 80 : 0);
        unsigned seed = 5;
        cpar_dev_attn a = {c.dt, c.b, c.hq, c.hkv, c.sq, c.sk, c.d, NULL, NULL, NULL, c.sq * c.d, c.sk * c.d,
                           c.causal, 0.125f, c.p, {7, 0}, {}, {}, 0, 0, false, false}; /* dropout where c.p > 0 */
        const size_t nq = c.b * c.hq * c.sq * c.d, nk = c.b * c.hkv * c.sk * c.d, nl = c.b * c.hq * c.sq;
        void *q = dalloc(nq, c.dt), *k = dalloc(nk, c.dt), *v = dalloc(nk, c.dt), *out = dalloc(nq, c.out_dt),
             *dout = dalloc(nq, c.out_dt);
        float *lse = (float *)dalloc(nl, F32), *g = (float *)dalloc(nq + 2 * nk, F32);
        void *scratch = dalloc(cpar_dev_attention_bwd_scratch_bytes(&a), CPAR_U8);
        for (size_t i = 0; i < nq; i++) {
            put(q, c.dt, i, urand(&seed));
            put(out, c.out_dt, i, 0.5 * urand(&seed));
            put(dout, c.out_dt, i, urand(&seed));
        }
        for (size_t i = 0; i < nk; i++) {
            put(k, c.dt, i, urand(&seed));
            put(v, c.dt, i, urand(&seed));
        }
        for (size_t i = 0; i < nl; i++) lse[i] = (float)(2.0 + urand(&seed));
        memset(g, 0, sizeof(float) * (nq + 2 * nk));
        a.q = q;
        a.k = k;
        a.v = v;
        ck_assert_int_eq(cpar_dev_attention_bwd(&a, out, dout, c.out_dt, c.sq * c.d, lse, c.sq, g, c.sq * c.d, g + nq,
                                                g + nq + nk, c.sk * c.d, scratch, NULL),
                         CPAR_OK);
        ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess); /* the host reads g next */
        if (run == 0) first.assign(g, g + nq + 2 * nk);
        else
            ck_assert_msg(memcmp(first.data(), g, sizeof(float) * (nq + 2 * nk)) == 0,
                          "%s: results differ in run %d (%s)", c.name, run,
                          run < 4 ? "another schedule" : run == 4 ? "lean kernels" : "slim kernels");
        void *bufs[] = {q, k, v, out, dout, lse, g, scratch};
        for (void *p : bufs) cudaFree(p);
    }
    cudasim_set_smem_optin(0);
    cudasim_set_compute_capability(0);
}

START_TEST(deterministic) {
    deterministic_case({"det d64 dropout", BF16, F32, 1, 2, 1, 70, 45, 64, true, 0, 0, -1, 0, 0, 0.3f});
    deterministic_case({"det d128 dropout", F16, F32, 1, 2, 1, 150, 140, 128, false, 0, 0, -1, 0, 0, 0.3f});
    deterministic_case({"det d128", BF16, F32, 1, 4, 2, 150, 140, 128, true, 0, 0, -1, 0, 0, 0});
}
END_TEST

/* Packed (THD) blocks skip the tiles that hide every weight (§16's
 * cpar__attn_tile_span). Two checks per case, a packing of documents with
 * padding over P ranks, the query block of rank rq against the key block
 * of rank rk (a ring step), causal or not, with and without dropout:
 *  1. the span is exact where it skips: every weight of every skipped
 *     (query tile, key tile) pair is hidden (cpar__attn_packed_sees per
 *     weight), for the forward and dq kernels' key tiles of each 64-query
 *     tile and the dkdv kernel's query tiles of each 64-key tile; and it
 *     does skip (fewer tiles than all, for these multi-document packings);
 *  2. forward (out, lse) and backward (dq, dk, dv added onto random values)
 *     are bit-identical with skipping on and off (cpar__attn_skip_hidden_tiles);
 *  3. with dq by atomics (atomic_dq), the same but dq, which is within
 *     rounding of the dq kernel's. */
struct PackedCase {
    cpar_dtype dt;
    int P, rq, rk, d;
    bool causal;
    float p;
    std::vector<int32_t> padded, real; /* document lengths */
    bool slices = false; /* 4 q heads over 2 kv heads, and a 4th run with one backward CTA for all slices */
};

static void packed_skip_case(const PackedCase &c, unsigned seed) {
    const int n_docs = (int)c.padded.size();
    std::vector<int32_t> cu(n_docs + 1, 0), cur(n_docs + 1, 0);
    for (int i = 0; i < n_docs; i++) cu[i + 1] = cu[i] + c.padded[i], cur[i + 1] = cur[i] + c.real[i];
    const int64_t n = cu[n_docs] / c.P, d = c.d, hq = c.slices ? 4 : 2, hkv = c.slices ? 2 : 1;
    cpar_dev_attn a = {c.dt, 1, hq, hkv, n, n, d, NULL, NULL, NULL, n * d, n * d, c.causal, 0.125f, c.p, {7, 3}, {}, {}, 0, 0, false, false};
    a.qp = {0, 0, 0, cu.data(), cur.data(), n_docs, c.P, c.rq};
    a.kp = a.qp;
    a.kp.rank = c.rk;

    /* 1. the spans, against every weight */
    int64_t visits = 0, all = 0;
    for (int side = 0; side < 3; side++) { /* forward (64-query tiles), dq (64), dkdv (64-key tiles over BR queries) */
        const bool key_tiles = side < 2;
        const int fts = 64, ts = key_tiles ? 64 : CPAR__AB_BRKV;
        for (int64_t f0 = 0; f0 < n; f0 += fts) {
            int64_t r0, r1;
            if (key_tiles)
                cpar__attn_visible<true>(a.qp, a.kp, true, c.causal, f0, fts, n, n, ts, &r0, &r1);
            else
                cpar__attn_visible<false>(a.kp, a.qp, true, c.causal, f0, fts, n, n, ts, &r0, &r1);
            REQUIRE(r0 % ts == 0 && r0 <= r1 && r1 <= n, "span [%lld, %lld) of tile %lld", (long long)r0,
                    (long long)r1, (long long)f0);
            for (int64_t t0 = 0; t0 < n; t0 += ts) {
                all++;
                const bool visited = t0 >= r0 && t0 < r1;
                visits += visited;
                if (visited) continue;
                for (int64_t x = f0; x < f0 + fts && x < n; x++)
                    for (int64_t y = t0; y < t0 + ts && y < n; y++) {
                        const int64_t i = key_tiles ? x : y, j = key_tiles ? y : x;
                        REQUIRE(!cpar__attn_packed_sees(a.qp, a.kp, c.causal, i, j),
                                "P %d ranks %d/%d%s: skipped a tile where query %lld sees key %lld", c.P, c.rq, c.rk,
                                c.causal ? " causal" : "", (long long)i, (long long)j);
                    }
            }
        }
    }
    REQUIRE(visits < all, "P %d ranks %d/%d: no tile skipped (%lld of %lld)", c.P, c.rq, c.rk, (long long)visits,
            (long long)all);

    /* 2. bit-identical results with skipping on and off */
    unsigned s = seed;
    void *q = dalloc(hq * n * d, c.dt), *k = dalloc(hkv * n * d, c.dt), *v = dalloc(hkv * n * d, c.dt);
    void *dout = dalloc(hq * n * d, F32);
    for (int64_t e = 0; e < hq * n * d; e++) put(q, c.dt, e, urand(&s)), put(dout, F32, e, urand(&s));
    for (int64_t e = 0; e < hkv * n * d; e++) put(k, c.dt, e, urand(&s)), put(v, c.dt, e, urand(&s));
    std::vector<float> init(hq * n * d + 2 * hkv * n * d);
    for (float &x : init) x = (float)urand(&s);
    a.q = q, a.k = k, a.v = v;
    std::vector<float> got[4];
    /* skipping on, off, on with dq by atomics, and on with each backward CTA
     * looping over every (batch, head) slice: a tile that sees no weight
     * still loads its own K, V (or Q, dO) once per slice */
    for (int mode = 0; mode < (c.slices ? 4 : 3); mode++) {
        cpar__attn_skip_hidden_tiles = mode != 1;
        a.atomic_dq = mode == 2;
        cpar__ab_grid_y_cap = mode == 3 ? 1 : 65535;
        float *out = (float *)dalloc(hq * n * d, F32), *lse = (float *)dalloc(hq * n, F32);
        float *g = (float *)dalloc(init.size(), F32);
        void *scratch = dalloc(cpar_dev_attention_bwd_scratch_bytes(&a) / 4, F32);
        memcpy(g, init.data(), sizeof(float) * init.size());
        ck_assert_int_eq(cpar_dev_attention_fwd(&a, out, F32, n * d, lse, n, NULL), CPAR_OK);
        ck_assert_int_eq(cpar_dev_attention_bwd(&a, out, dout, F32, n * d, lse, n, g, n * d, g + hq * n * d,
                                                g + (hq + hkv) * n * d, n * d, scratch, NULL),
                         CPAR_OK);
        ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
        got[mode].assign(out, out + hq * n * d);
        got[mode].insert(got[mode].end(), lse, lse + hq * n);
        got[mode].insert(got[mode].end(), g, g + init.size());
        void *bufs[] = {out, lse, g, scratch};
        for (void *b : bufs) cudaFree(b);
    }
    cpar__attn_skip_hidden_tiles = true;
    size_t seen = 0; /* the outputs are not all zero or poison: the comparison means something */
    for (size_t e = 0; e < got[0].size(); e++) seen += got[0][e] != 0.f && !is_poison(got[0].data(), e);
    REQUIRE(seen > got[0].size() / 4, "P %d ranks %d/%d: only %zu of %zu outputs set", c.P, c.rq, c.rk, seen,
            got[0].size());
    REQUIRE(memcmp(got[0].data(), got[1].data(), sizeof(float) * got[0].size()) == 0,
            "P %d ranks %d/%d%s p %g: results differ with tile skipping", c.P, c.rq, c.rk, c.causal ? " causal" : "",
            (double)c.p);
    REQUIRE(!c.slices || memcmp(got[0].data(), got[3].data(), sizeof(float) * got[0].size()) == 0,
            "P %d ranks %d/%d%s p %g: results differ with a backward CTA per several slices", c.P, c.rq, c.rk,
            c.causal ? " causal" : "", (double)c.p);
    /* dq by atomics: out, lse, dk and dv the same bits, dq within rounding of the dq kernel's */
    const size_t g0 = hq * n * d + hq * n, nq = hq * n * d;
    REQUIRE(memcmp(got[0].data(), got[2].data(), sizeof(float) * g0) == 0 &&
                memcmp(got[0].data() + g0 + nq, got[2].data() + g0 + nq, sizeof(float) * (init.size() - nq)) == 0,
            "P %d ranks %d/%d: dq by atomics changed out, lse, dk or dv", c.P, c.rq, c.rk);
    double inc = 0, diff = 0;
    for (size_t e = 0; e < nq; e++) {
        const double i = fabs((double)got[0][g0 + e] - init[e]), f = fabs((double)got[2][g0 + e] - got[0][g0 + e]);
        if (!(i <= inc)) inc = i; /* NaN counts as the largest */
        if (!(f <= diff)) diff = f;
    }
    REQUIRE(inc > 0 && diff <= (c.dt == BF16 ? 2e-2 : 2.5e-3) * inc,
            "P %d ranks %d/%d%s p %g: dq by atomics differs by %g (largest increment %g)", c.P, c.rq, c.rk,
            c.causal ? " causal" : "", (double)c.p, diff, inc);
    void *bufs[] = {q, k, v, dout};
    for (void *b : bufs) cudaFree(b);
}

START_TEST(packed_skip) {
    /* P = 1 local THD; P = 2 and 3 ring steps (own block, an earlier and a later rank's) */
    const PackedCase cases[] = {
        {F16, 1, 0, 0, 64, true, 0.f, {64, 100, 8, 120, 30}, {60, 100, 3, 117, 30}},
        {BF16, 1, 0, 0, 64, false, 0.2f, {40, 150, 2, 90}, {40, 149, 0, 90}},
        {F16, 2, 1, 1, 64, true, 0.f, {64, 200, 8, 120}, {60, 200, 5, 117}},
        {F16, 2, 0, 1, 64, true, 0.1f, {64, 200, 8, 120}, {64, 190, 8, 120}},
        {BF16, 2, 1, 0, 64, false, 0.f, {128, 0, 96, 180}, {100, 0, 96, 171}},
        {F16, 3, 2, 0, 64, true, 0.f, {96, 252, 12, 66}, {96, 250, 12, 60}},
        /* causal ring steps with key tiles no query sees (rank 1's queries,
         * positions 64-191, against rank 0's chunk 3, 192-255) and query
         * tiles that see no key (rank 0's chunk 0 against rank 1's keys):
         * backward CTAs without a step */
        {F16, 2, 1, 0, 64, true, 0.f, {256}, {256}, true},
        {BF16, 2, 0, 1, 64, true, 0.f, {256}, {256}, true},
    };
    const PackedCase &c = cases[_i];
    cudasim_set_schedule(_i % 2 ? CUDASIM_SCHED_REVERSE : CUDASIM_SCHED_FORWARD, 77);
    packed_skip_case(c, 500 + (unsigned)_i);
}
END_TEST

/* Bad arguments: CPAR_ERR_INVALID naming the argument; zero-sized work is a no-op. */
static void expect_invalid(cpar_status st, const char *what, const char *word) {
    ck_assert_msg(st == CPAR_ERR_INVALID, "%s -> %d, expected CPAR_ERR_INVALID (%s)", what, (int)st,
                  cpar_dev_last_error());
    ck_assert_msg(strstr(cpar_dev_last_error(), "cpar_dev_attention_bwd") != NULL &&
                      strstr(cpar_dev_last_error(), word) != NULL,
                  "%s: message \"%s\" does not name \"%s\"", what, cpar_dev_last_error(), word);
}

START_TEST(bad_args) {
    const int64_t sq = 5, sk = 7, d = 16;
    __half *q = (__half *)dalloc(2 * sq * d, F16), *kv = (__half *)dalloc(2 * sk * d, F16);
    __half *o = (__half *)dalloc(2 * sq * d, F16);
    float *lse = (float *)dalloc(2 * sq, F32), *g = (float *)dalloc(2 * sq * d + 4 * sk * d, F32);
    const cpar_dev_attn good = {F16, 1, 2, 1, sq, sk, d, q, kv, kv, sq * d, sk * d, false, 0.25f, 0.f, {0, 0}, {}, {}, 0, 0, false, false};
    void *scratch = dalloc(cpar_dev_attention_bwd_scratch_bytes(&good) / 4, F32);
    float *dq = g, *dk = g + 2 * sq * d, *dv = dk + sk * d;
#define CALL(a, ...) cpar_dev_attention_bwd(a, __VA_ARGS__, NULL)
#define GOOD_REST o, o, F16, sq * d, lse, sq, dq, sq * d, dk, dv, sk * d, scratch
    ck_assert_int_eq(CALL(&good, GOOD_REST), CPAR_OK);
    ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
    expect_invalid(CALL(NULL, GOOD_REST), "a NULL", "a is NULL");
    struct {
        const char *word;
        void (*edit)(cpar_dev_attn *);
    } edits[] = {
        {"a->dt", [](cpar_dev_attn *a) { a->dt = CPAR_F32; }},
        {"a->dt", [](cpar_dev_attn *a) { a->dt = CPAR_I32; }},
        {"b", [](cpar_dev_attn *a) { a->b = -1; }},
        {"sq", [](cpar_dev_attn *a) { a->sq = -2; }},
        {"sk", [](cpar_dev_attn *a) { a->sk = -1; }},
        {"a->hkv", [](cpar_dev_attn *a) { a->hkv = 0; }},
        {"a->hkv", [](cpar_dev_attn *a) { a->hq = 3; a->hkv = 2; }},
        {"a->d", [](cpar_dev_attn *a) { a->d = 12; }},
        {"a->d", [](cpar_dev_attn *a) { a->d = 136; }},
        {"a->scale", [](cpar_dev_attn *a) { a->scale = 0.f; }},
        {"a->scale", [](cpar_dev_attn *a) { a->scale = INFINITY; }},
        {"a->scale", [](cpar_dev_attn *a) { a->scale = NAN; }},
        {"a->dropout_p", [](cpar_dev_attn *a) { a->dropout_p = 1.f; }},
        {"a->dropout_p", [](cpar_dev_attn *a) { a->dropout_p = NAN; }},
        {"a->q", [](cpar_dev_attn *a) { a->q = NULL; }},
        {"a->k", [](cpar_dev_attn *a) { a->k = NULL; }},
        {"a->v", [](cpar_dev_attn *a) { a->v = NULL; }},
        {"a->q_bh", [](cpar_dev_attn *a) { a->q_bh = a->sq * a->d - 1; }},
        {"a->kv_bh", [](cpar_dev_attn *a) { a->kv_bh = 8; }},
    };
    for (const auto &ed : edits) {
        cpar_dev_attn a = good;
        ed.edit(&a);
        expect_invalid(CALL(&a, GOOD_REST), ed.word, ed.word);
    }
    expect_invalid(CALL(&good, o, o, CPAR_BF16, sq * d, lse, sq, dq, sq * d, dk, dv, sk * d, scratch), "out_dt",
                   "out_dt");
    expect_invalid(CALL(&good, NULL, o, F16, sq * d, lse, sq, dq, sq * d, dk, dv, sk * d, scratch), "out",
                   "out is NULL");
    expect_invalid(CALL(&good, o, NULL, F16, sq * d, lse, sq, dq, sq * d, dk, dv, sk * d, scratch), "dout", "dout");
    expect_invalid(CALL(&good, o, o, F16, sq * d, NULL, sq, dq, sq * d, dk, dv, sk * d, scratch), "lse", "lse");
    expect_invalid(CALL(&good, o, o, F16, sq * d, lse, sq, NULL, sq * d, dk, dv, sk * d, scratch), "dq", "dq");
    expect_invalid(CALL(&good, o, o, F16, sq * d, lse, sq, dq, sq * d, NULL, dv, sk * d, scratch), "dk", "dk");
    expect_invalid(CALL(&good, o, o, F16, sq * d, lse, sq, dq, sq * d, dk, NULL, sk * d, scratch), "dv", "dv");
    expect_invalid(CALL(&good, o, o, F16, sq * d, lse, sq, dq, sq * d, dk, dv, sk * d, NULL), "scratch", "scratch");
    expect_invalid(CALL(&good, o, o, F16, sq * d, lse, sq, dq, sq * d, dk, dv, sk * d, (char *)scratch + 2),
                   "scratch misaligned", "scratch");
    expect_invalid(CALL(&good, o, o, F16, 3, lse, sq, dq, sq * d, dk, dv, sk * d, scratch), "o_bh", "o_bh");
    expect_invalid(CALL(&good, o, o, F16, sq * d, lse, sq - 1, dq, sq * d, dk, dv, sk * d, scratch), "lse_bh",
                   "lse_bh");
    expect_invalid(CALL(&good, o, o, F16, sq * d, lse, sq, dq, 0, dk, dv, sk * d, scratch), "dq_bh", "dq_bh");
    expect_invalid(CALL(&good, o, o, F16, sq * d, lse, sq, dq, sq * d, dk, dv, sk * d - 8, scratch), "dkv_bh",
                   "dkv_bh");

    /* zero-sized work: no scratch, no pointers needed, nothing written */
    for (int z = 0; z < 5; z++) {
        cpar_dev_attn a = good;
        a.q = a.k = a.v = NULL;
        if (z == 0) a.b = 0;
        if (z == 1) a.sq = 0;
        if (z == 2) a.sk = 0;
        if (z == 3) a.hq = 0;
        if (z == 4) a.d = 0;
        ck_assert_uint_eq(cpar_dev_attention_bwd_scratch_bytes(&a), 0);
        ck_assert_msg(CALL(&a, NULL, NULL, F16, 0, NULL, 0, NULL, 0, NULL, NULL, 0, NULL) == CPAR_OK,
                      "zero-sized case %d: %s", z, cpar_dev_last_error());
    }
    ck_assert_uint_eq(cpar_dev_attention_bwd_scratch_bytes(NULL), 0);
    ck_assert_uint_eq(cpar_dev_attention_bwd_scratch_bytes(&good), 2 * (2 * ((sq + 63) / 64 * 64)) * sizeof(float));
#undef CALL
#undef GOOD_REST
    void *bufs[] = {q, kv, o, lse, g, scratch};
    for (void *p : bufs) cudaFree(p);
}
END_TEST

int main(void) {
    Suite *s = suite_create("attn_bwd: flash-attention backward kernels against an fp64 reference (simulator)");
    TCase *tc = tcase_create("attn_bwd");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, shapes, 0, 3);
    tcase_add_loop_test(tc, wide, 0, 3);
    tcase_add_loop_test(tc, gqa, 0, 4);
    tcase_add_loop_test(tc, strided, 0, 4);
    tcase_add_loop_test(tc, dropout, 0, 4);
    tcase_add_loop_test(tc, atomic_dq, 0, 4);
    tcase_add_loop_test(tc, lean, 0, 4);
    tcase_add_loop_test(tc, slim, 0, 4);
    tcase_add_test(tc, deterministic);
    tcase_add_loop_test(tc, packed_skip, 0, 8);
    tcase_add_test(tc, bad_args);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
