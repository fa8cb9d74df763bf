/* SPDX-License-Identifier: MIT */
/* test_mma.cu — the tensor-core wrappers (mma.sync m16n8k16, ldmatrix)
 * against plain matrix products.
 *
 * Sim build only. This file includes cpar_kernels.cu itself (the wrappers are
 * internal static device functions) and is linked with nothing else from
 * cpar. Each case stages random 16-bit tiles in shared memory, loads the
 * operands with ldmatrix exactly as the flash-attention kernels do (A from a
 * row-major tile; B either from a [n][k] tile, the q·kᵀ pattern, or from a
 * [k][n] tile with .trans, the p·v pattern), multiplies with
 * cpar__mma_m16n8k16 on top of a random accumulator, and checks each lane's
 * fragment against the fp64 product. The fragments are also written back
 * through the documented C layout, so a layout mistake in either the
 * emulation or the test shows up. Every case runs in three fiber schedules. */
#define CPAR_KERNELS_ATTENTION_ONLY /* this suite needs §1-4 and 15 only */
#define CPAR_KERNELS_MMA_ONLY
/* the sections left out are the callers of some of §2-4's static helpers */
#pragma GCC diagnostic ignored "-Wunused-function"
#include "cpar_kernels.cu"
#include "tests/suite.h"

#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { M = 16, N = 8, K = 16 };

/* One warp: D = A·B + C. a: [M][K] row-major. b: [N][K] (b_nk) or [K][N]. */
template <typename T>
__global__ void mma_tile_kernel(const T *a, const T *b, bool b_nk, bool x4_b, const float *c, float *d) {
    __shared__ __align__(16) T sa[M * K];
    __shared__ __align__(16) T sb[2 * M * K];
    const int lane = (int)threadIdx.x, g = lane >> 2, t = lane & 3;
    for (int i = lane; i < M * K; i += 32) sa[i] = a[i];
    const int nb = x4_b ? 2 * N * K : N * K;
    for (int i = lane; i < nb; i += 32) sb[i] = b[i];
    __syncthreads();

    uint32_t af[4];
    cpar__ldmatrix_x4(af, &sa[(lane & 15) * K + 8 * (lane >> 4)]);
    uint32_t bf[4];
    if (b_nk && !x4_b) { /* [n][k]: rows are n; matrices k 0..7 and 8..15 */
        cpar__ldmatrix_x2(bf, &sb[(lane & 7) * K + 8 * ((lane >> 3) & 1)]);
    } else if (!b_nk && !x4_b) { /* [k][n]: rows are k, transposed */
        cpar__ldmatrix_x2_trans(bf, &sb[(lane & 15) * N]);
    } else if (b_nk) { /* x4 over [2N][K]: two n-blocks of 8 at once */
        cpar__ldmatrix_x4(bf, &sb[((lane & 7) + 8 * (lane >> 4)) * K + 8 * ((lane >> 3) & 1)]);
    } else { /* x4.trans over [K][2N] */
        cpar__ldmatrix_x4_trans(bf, &sb[(lane & 15) * 2 * N + 8 * (lane >> 4)]);
    }
    for (int blk = 0; blk < (x4_b ? 2 : 1); blk++) {
        float cf[4], df[4];
        for (int i = 0; i < 4; i++) cf[i] = c[(blk * 32 + lane) * 4 + i];
        cpar__mma_m16n8k16<T>(df, af, &bf[2 * blk], cf);
        for (int i = 0; i < 4; i++) { /* C layout: row g (+8 for i >= 2), col 2t + (i & 1) */
            const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
            d[blk * M * N + row * N + col] = df[i];
        }
    }
}

static double urand(unsigned *s) {
    *s = *s * 1664525u + 1013904223u;
    return ((*s >> 8) / 16777216.0) * 2.0 - 1.0;
}

template <typename T> static void run_case(const char *name, bool b_nk, bool x4_b, unsigned seed) {
    const int nblk = x4_b ? 2 : 1;
    T *a, *b;
    float *c, *d;
    ck_assert_int_eq(cudaMalloc(&a, sizeof(T) * M * K), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&b, sizeof(T) * nblk * N * K), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&c, sizeof(float) * nblk * 32 * 4), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&d, sizeof(float) * nblk * M * N), cudaSuccess);
    double fa[M * K], fb[2 * N * K];
    for (int i = 0; i < M * K; i++) {
        a[i] = cpar__narrow<T>((float)urand(&seed));
        fa[i] = cpar__widen(a[i]);
    }
    for (int i = 0; i < nblk * N * K; i++) {
        b[i] = cpar__narrow<T>((float)urand(&seed));
        fb[i] = cpar__widen(b[i]);
    }
    for (int i = 0; i < nblk * 32 * 4; i++) c[i] = (float)urand(&seed);
    for (int i = 0; i < nblk * M * N; i++) d[i] = NAN;

    CPAR_LAUNCH(mma_tile_kernel<T>, 1, 32, 0, 0)(a, b, b_nk, x4_b, c, d);
    ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);

    for (int blk = 0; blk < nblk; blk++)
        for (int row = 0; row < M; row++)
            for (int col = 0; col < N; col++) {
                /* which lane and register hold (row, col) in the C layout */
                const int lane = 4 * (row & 7) + col / 2, reg = 2 * (row >> 3) + (col & 1);
                double want = c[(blk * 32 + lane) * 4 + reg];
                for (int k = 0; k < K; k++) {
                    const int n = blk * N + col; /* column in the 2N-wide x4 layouts */
                    const double bv = b_nk ? fb[n * K + k] : fb[k * nblk * N + n];
                    want += fa[row * K + k] * bv;
                }
                const double got = d[blk * M * N + row * N + col];
                ck_assert_msg(fabs(got - want) <= 1e-5 * (1.0 + fabs(want)),
                              "%s b_%s %s: D[%d][%d] of block %d = %.7g, expected %.7g", name,
                              b_nk ? "nk" : "kn", x4_b ? "x4" : "x2", row, col, blk, got, want);
            }
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    cudaFree(d);
}

static const cudasim_schedule schedules[] = {CUDASIM_SCHED_FORWARD, CUDASIM_SCHED_REVERSE, CUDASIM_SCHED_SHUFFLE};

START_TEST(mma_f16) {
    cudasim_set_schedule(schedules[_i], 77);
    for (int v = 0; v < 4; v++) run_case<__half>("f16", v & 1, v >> 1, 1234u + v);
}
END_TEST

START_TEST(mma_bf16) {
    cudasim_set_schedule(schedules[_i], 78);
    for (int v = 0; v < 4; v++) run_case<__nv_bfloat16>("bf16", v & 1, v >> 1, 4321u + v);
}
END_TEST

/* The pack helpers put the lower element in the low half, as the fragments need. */
START_TEST(pack_order) {
    const uint32_t h = cpar__pack2<__half>(1.0f, -2.0f);
    ck_assert_uint_eq(h & 0xffffu, 0x3c00u);
    ck_assert_uint_eq(h >> 16, 0xc000u);
    ck_assert(cpar__unpack<__half>(h, 0) == 1.0f && cpar__unpack<__half>(h, 1) == -2.0f);
    const uint32_t b = cpar__pack2<__nv_bfloat16>(1.0f, -2.0f);
    ck_assert_uint_eq(b & 0xffffu, 0x3f80u);
    ck_assert_uint_eq(b >> 16, 0xc000u);
    ck_assert(cpar__unpack<__nv_bfloat16>(b, 0) == 1.0f && cpar__unpack<__nv_bfloat16>(b, 1) == -2.0f);
}
END_TEST

/* ldmatrix's row addresses must be 16-byte aligned (a GPU faults otherwise):
 * rows `shift` elements off; x2 ignores lanes 16-31, so theirs may be off. */
__global__ void ldmatrix_rows_kernel(int shift, int x2_upper_shift, uint32_t *out) {
    __shared__ __align__(16) uint16_t sm[32 * 16 + 8];
    const int lane = (int)threadIdx.x;
    for (int i = lane; i < 32 * 16 + 8; i += 32) sm[i] = (uint16_t)i;
    __syncthreads();
    uint32_t r[4] = {0, 0, 0, 0};
    if (x2_upper_shift) cpar__ldmatrix_x2(r, &sm[(lane & 15) * 16 + (lane >= 16 ? x2_upper_shift : 0)]);
    else cpar__ldmatrix_x4(r, &sm[lane * 16 + shift]);
    out[lane] = r[0] ^ r[1] ^ r[2] ^ r[3];
}

START_TEST(ldmatrix_alignment) {
    uint32_t *out;
    ck_assert_int_eq(cudaMalloc(&out, 32 * sizeof(uint32_t)), cudaSuccess);
    const struct { int shift, x2_upper; bool ok; } cases[] = {{0, 0, true}, {8, 0, true}, {4, 0, false},
                                                              {1, 0, false}, {0, 3, true}};
    for (const auto &c : cases) {
        CPAR_LAUNCH(ldmatrix_rows_kernel, 1, 32, 0, 0)(c.shift, c.x2_upper, out);
        /* the synchronisation runs it where streams are lazy (CUDASIM_STREAMS) */
        const cudaError_t sync = cudaDeviceSynchronize(), last = cudaGetLastError();
        const cudaError_t e = sync != cudaSuccess ? sync : last;
        ck_assert_msg((e == cudaSuccess) == c.ok, "ldmatrix rows shifted by %d (x2 upper lanes %d): %s (%s)", c.shift,
                      c.x2_upper, cudaGetErrorName(e), cudasim_last_message());
        if (!c.ok) ck_assert_ptr_nonnull(strstr(cudasim_last_message(), "__trap"));
    }
    cudaFree(out);
}
END_TEST

int main(void) {
    Suite *s = suite_create("mma: tensor-core wrappers (mma.sync m16n8k16, ldmatrix) in the simulator");
    TCase *tc = tcase_create("mma");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, mma_f16, 0, 3);
    tcase_add_loop_test(tc, mma_bf16, 0, 3);
    tcase_add_test(tc, pack_order);
    tcase_add_test(tc, ldmatrix_alignment);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
