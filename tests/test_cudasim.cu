/* SPDX-License-Identifier: MIT */
/* tests/test_cudasim.cu — conformance suite for tests/cudasim.h.
 *
 * Build (the sim build's flags):
 *   g++ -std=c++17 -O1 -g -Wall -Wextra -DCPAR_SIM -I. -x c++ tests/test_cudasim.cu \
 *       -o build/sim/test_cudasim $(pkg-config --cflags --libs check)
 *
 * Every kernel below is run under the forward, reverse and two shuffle
 * schedules, on outputs poisoned before the launch, and compared with a host
 * reference written next to it. Sections:
 *   1. helpers            5. shared memory       9. fp16 / bf16
 *   2. barriers           6. atomics            10. cuBLAS GEMM
 *   3. missing barriers   7. grid shapes        11. runtime
 *   4. warp intrinsics    8. failures, configs  12. host threads, schedules, timing
 */
#include "tests/cudasim.h"
#include "tests/suite.h"

#include <check.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <csignal>
#include <thread>
#include <vector>

/* ==== 1. helpers ========================================================== */

struct Schedule {
    cudasim_schedule s;
    unsigned long long seed;
    const char *name;
};
static const Schedule kSchedules[] = {
    {CUDASIM_SCHED_FORWARD, 0, "forward"},
    {CUDASIM_SCHED_REVERSE, 0, "reverse"},
    {CUDASIM_SCHED_SHUFFLE, 1, "shuffle:1"},
    {CUDASIM_SCHED_SHUFFLE, 0xC0FFEEull, "shuffle:0xC0FFEE"},
    {CUDASIM_SCHED_WARPS, 0, "warps"},
};

#define CK_CUDA(call)                                                                                       \
    do {                                                                                                    \
        cudaError_t e_ = (call);                                                                            \
        if (e_ != cudaSuccess)                                                                               \
            ck_abort_msg("%s -> %s (%s)", #call, cudaGetErrorName(e_), cudasim_last_message());              \
    } while (0)

/* For assertions inside loops: Check's macros cost a pipe write each (fork
 * mode), so only call into Check when the condition fails. */
#define EXPECT(cond, ...)                                   \
    do {                                                    \
        if (!(cond)) ck_assert_msg((cond), __VA_ARGS__);    \
    } while (0)
#define EXPECT_EQ(a, b) EXPECT((a) == (b), "%s == %s: %lld vs %lld", #a, #b, (long long)(a), (long long)(b))

/* After a launch that must have succeeded. */
#define CK_LAUNCHED(sched)                                                                                   \
    do {                                                                                                     \
        cudaError_t e_ = cudaGetLastError();                                                                 \
        if (e_ != cudaSuccess)                                                                               \
            ck_abort_msg("[%s] launch -> %s (%s)", (sched).name, cudaGetErrorName(e_), cudasim_last_message()); \
    } while (0)

template <class T> static T *dev_alloc(size_t n) {
    T *p = nullptr;
    CK_CUDA(cudaMalloc(&p, n * sizeof(T) + (n == 0)));
    return p;
}
template <class T> static void to_dev(T *d, const std::vector<T> &h) {
    CK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}
template <class T> static std::vector<T> from_dev(const T *d, size_t n) {
    std::vector<T> h(n);
    CK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}
/* Outputs are poisoned (0xFF bytes: NaN for floats, -1 for ints) before every launch. */
static void poison(void *d, size_t bytes) { CK_CUDA(cudaMemset(d, 0xFF, bytes)); }

static unsigned long long g_lcg = 12345;
static float frand() { /* uniform in [-1, 1) */
    g_lcg = g_lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((g_lcg >> 40) & 0xFFFFFF) / 8388608.0f - 1.0f;
}

static unsigned f2u(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
static float u2f(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ==== 2. barriers ========================================================= */

/* out[b*B + t] = in[b*B + B-1-t] through static shared memory.
 * Launch: grid = n/B, block = B <= 256. */
__global__ void reverse_static(const float *in, float *out) {
    __shared__ float buf[256];
    unsigned t = threadIdx.x, base = blockIdx.x * blockDim.x;
    buf[t] = in[base + t];
    __syncthreads();
    out[base + t] = buf[blockDim.x - 1 - t];
}

/* Same through dynamic shared memory (smem = B floats); any B <= 1024. */
__global__ void reverse_dynamic(const float *in, float *out) {
    CPAR_DYN_SMEM(float, buf);
    unsigned t = threadIdx.x, base = blockIdx.x * blockDim.x;
    buf[t] = in[base + t];
    __syncthreads();
    out[base + t] = buf[blockDim.x - 1 - t];
}

/* out[block] = sum of in[block*B .. +B) (zero past n); tree reduction in shared
 * memory. Launch: block = B (power of two <= 512), grid = ceil(n/B). */
__global__ void block_sum(const float *in, float *out, int n) {
    __shared__ float s[512];
    unsigned t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
    s[t] = i < (unsigned)n ? in[i] : 0.0f;
    __syncthreads();
    for (unsigned stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (t < stride) s[t] += s[t + stride];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

/* out[block*3 + {0,1,2}] = __syncthreads_count / _and / _or of pred(t). */
__global__ void barrier_votes(int *out, int modulo) {
    int pred = (int)(threadIdx.x % modulo) == 0;
    int c = __syncthreads_count(pred);
    int a = __syncthreads_and(pred);
    int o = __syncthreads_or(pred);
    if (threadIdx.x == 0) {
        out[blockIdx.x * 3 + 0] = c;
        out[blockIdx.x * 3 + 1] = a;
        out[blockIdx.x * 3 + 2] = o;
    }
}

START_TEST(test_barrier_reverse) {
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        for (unsigned B : {32u, 100u, 256u}) {
            unsigned nb = 7, n = nb * B;
            std::vector<float> h(n);
            for (unsigned i = 0; i < n; i++) h[i] = (float)i;
            float *in = dev_alloc<float>(n), *out = dev_alloc<float>(n);
            to_dev(in, h);
            poison(out, n * 4);
            CPAR_LAUNCH(reverse_static, nb, B, 0, 0)(in, out);
            CK_LAUNCHED(sc);
            std::vector<float> r = from_dev(out, n);
            for (unsigned i = 0; i < n; i++)
                EXPECT(r[i] == h[i / B * B + B - 1 - i % B], "[%s] static B=%u out[%u]=%g", sc.name, B, i, r[i]);
            poison(out, n * 4);
            CPAR_LAUNCH(reverse_dynamic, nb, B, B * sizeof(float), 0)(in, out);
            CK_LAUNCHED(sc);
            r = from_dev(out, n);
            for (unsigned i = 0; i < n; i++)
                EXPECT(r[i] == h[i / B * B + B - 1 - i % B], "[%s] dynamic B=%u out[%u]=%g", sc.name, B, i, r[i]);
            CK_CUDA(cudaFree(in));
            CK_CUDA(cudaFree(out));
        }
    }
}
END_TEST

START_TEST(test_barrier_tree_reduction) {
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        for (unsigned B : {64u, 512u}) {
            int n = (int)(9 * B - 37);
            unsigned nb = (n + B - 1) / B;
            std::vector<float> h(n);
            for (int i = 0; i < n; i++) h[i] = (float)((i * 37) % 101 - 50); /* integers: sums are exact */
            float *in = dev_alloc<float>(n), *out = dev_alloc<float>(nb);
            to_dev(in, h);
            poison(out, nb * 4);
            CPAR_LAUNCH(block_sum, nb, B, 0, 0)(in, out, n);
            CK_LAUNCHED(sc);
            std::vector<float> r = from_dev(out, nb);
            for (unsigned b = 0; b < nb; b++) {
                double ref = 0;
                for (unsigned i = b * B; i < (b + 1) * B && i < (unsigned)n; i++) ref += h[i];
                EXPECT(r[b] == ref, "[%s] B=%u block %u: %g, expected %g", sc.name, B, b, r[b], ref);
            }
            CK_CUDA(cudaFree(in));
            CK_CUDA(cudaFree(out));
        }
        int *votes = dev_alloc<int>(6);
        poison(votes, 24);
        CPAR_LAUNCH(barrier_votes, 2, 96, 0, 0)(votes, 3);
        CK_LAUNCHED(sc);
        std::vector<int> v = from_dev(votes, 6);
        ck_assert_int_eq(v[0], 32);
        ck_assert_int_eq(v[1], 0);
        ck_assert_int_eq(v[2], 1);
        CPAR_LAUNCH(barrier_votes, 2, 96, 0, 0)(votes, 1);
        CK_LAUNCHED(sc);
        v = from_dev(votes, 6);
        ck_assert_int_eq(v[3], 96);
        ck_assert_int_eq(v[4], 1);
        ck_assert_int_eq(v[5], 1);
        CK_CUDA(cudaFree(votes));
    }
}
END_TEST

/* ==== 3. missing barriers ================================================= */
/* The simulator must be able to catch these: each is wrong under at least
 * one of the forward/reverse schedules (and right with the barrier). */

/* out[t] = in[t + shift] via shared memory, within a block (no wrap: threads
 * whose source falls outside the block copy their own element). */
template <bool kBarrier>
__global__ void shift_through_smem(const int *in, int *out, int shift) {
    CPAR_DYN_SMEM(int, s);
    int t = (int)threadIdx.x, n = (int)blockDim.x, base = (int)(blockIdx.x * blockDim.x);
    s[t] = in[base + t];
    if (kBarrier) __syncthreads();
    int src = t + shift;
    out[base + t] = s[(src >= 0 && src < n) ? src : t];
}

/* Legacy warp-synchronous reduction: lane 0 gets the warp's sum only if every
 * step is separated by __syncwarp (kSync) — without it, wrong on Volta+. */
template <bool kSync>
__global__ void warp_smem_sum(const int *in, int *out) {
    __shared__ int s[32];
    unsigned l = threadIdx.x;
    s[l] = in[l];
    if (kSync) __syncwarp();
    for (unsigned off = 16; off > 0; off >>= 1) {
        int v = l < off ? s[l + off] : 0;
        if (kSync) __syncwarp();
        if (l < off) s[l] += v;
        if (kSync) __syncwarp();
    }
    if (l == 0) *out = s[0];
}

/* Each warp writes its slots, meets a warp collective, then reads the other
 * warp's slots: without the barrier the warps stay in step under passes
 * (forward, reverse), so only a schedule that lets one warp run ahead
 * (warps) sees the other's slots unwritten. The shape of a double buffer
 * refilled one barrier too early. */
template <bool kBarrier>
__global__ void read_after_collective(const int *in, int *out) {
    CPAR_DYN_SMEM(int, s); /* dynamic: poisoned per block (static shared memory keeps the last launch's) */
    const int t = (int)threadIdx.x;
    s[t] = in[t];
    const int v = __shfl_xor_sync(0xffffffffu, in[t], 1);
    if (kBarrier) __syncthreads();
    out[t] = s[(t + 32) % 64] + (v - in[t ^ 1]); /* v - in[t ^ 1] == 0: the shuffle is used */
}

static bool run_read_after_collective(bool barrier) {
    std::vector<int> h(64);
    for (int i = 0; i < 64; i++) h[i] = 7 * i + 3;
    int *in = dev_alloc<int>(64), *out = dev_alloc<int>(64);
    to_dev(in, h);
    poison(out, 64 * 4);
    if (barrier) CPAR_LAUNCH(read_after_collective<true>, 1, 64, 64 * 4, 0)(in, out);
    else CPAR_LAUNCH(read_after_collective<false>, 1, 64, 64 * 4, 0)(in, out);
    CK_CUDA(cudaGetLastError());
    std::vector<int> r = from_dev(out, 64);
    bool right = true;
    for (int i = 0; i < 64; i++) right = right && r[i] == h[(i + 32) % 64];
    CK_CUDA(cudaFree(in));
    CK_CUDA(cudaFree(out));
    return right;
}

static bool run_shift(bool barrier, int shift, const Schedule &sc) {
    const unsigned B = 64, nb = 3, n = B * nb;
    std::vector<int> h(n);
    for (unsigned i = 0; i < n; i++) h[i] = (int)(1000 + i);
    int *in = dev_alloc<int>(n), *out = dev_alloc<int>(n);
    to_dev(in, h);
    poison(out, n * 4);
    if (barrier) CPAR_LAUNCH(shift_through_smem<true>, nb, B, B * 4, 0)(in, out, shift);
    else CPAR_LAUNCH(shift_through_smem<false>, nb, B, B * 4, 0)(in, out, shift);
    CK_LAUNCHED(sc);
    std::vector<int> r = from_dev(out, n);
    bool right = true;
    for (unsigned i = 0; i < n; i++) {
        int t = (int)(i % B), src = t + shift;
        int expect = h[i - t + ((src >= 0 && src < (int)B) ? src : t)];
        right = right && r[i] == expect;
    }
    CK_CUDA(cudaFree(in));
    CK_CUDA(cudaFree(out));
    return right;
}

START_TEST(test_missing_barrier_is_caught) {
    /* With the barrier: right under every schedule. */
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        ck_assert_msg(run_shift(true, +1, sc), "[%s] shift +1 with barrier wrong", sc.name);
        ck_assert_msg(run_shift(true, -1, sc), "[%s] shift -1 with barrier wrong", sc.name);
    }
    /* Without: reading a higher thread's slot is caught by forward, a lower
     * one's by reverse; each pattern by at least one of the two. */
    const Schedule &fwd = kSchedules[0], &rev = kSchedules[1];
    cudasim_set_schedule(fwd.s, fwd.seed);
    bool fwd_up = run_shift(false, +1, fwd), fwd_down = run_shift(false, -1, fwd);
    cudasim_set_schedule(rev.s, rev.seed);
    bool rev_up = run_shift(false, +1, rev), rev_down = run_shift(false, -1, rev);
    ck_assert_msg(!fwd_up, "forward schedule missed a read of a higher thread's unsynchronised write");
    ck_assert_msg(!rev_down, "reverse schedule missed a read of a lower thread's unsynchronised write");
    ck_assert_msg(!(fwd_up && rev_up) && !(fwd_down && rev_down), "a missing barrier went unnoticed");
    /* Shuffle catches both directions too (over a couple of seeds). */
    bool shuffle_caught_up = false, shuffle_caught_down = false;
    for (unsigned long long seed = 1; seed <= 4; seed++) {
        Schedule sh = {CUDASIM_SCHED_SHUFFLE, seed, "shuffle"};
        cudasim_set_schedule(sh.s, sh.seed);
        shuffle_caught_up = shuffle_caught_up || !run_shift(false, +1, sh);
        shuffle_caught_down = shuffle_caught_down || !run_shift(false, -1, sh);
    }
    ck_assert(shuffle_caught_up && shuffle_caught_down);
    /* A race across a warp collective: right with the barrier under every
     * schedule; without it forward and reverse keep the warps in step and
     * miss it, warps catches it. */
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        ck_assert_msg(run_read_after_collective(true), "[%s] read after collective with barrier wrong", sc.name);
    }
    cudasim_set_schedule(CUDASIM_SCHED_FORWARD, 0);
    ck_assert_msg(run_read_after_collective(false), "forward no longer keeps warps in step (update this test)");
    cudasim_set_schedule(CUDASIM_SCHED_REVERSE, 0);
    ck_assert_msg(run_read_after_collective(false), "reverse no longer keeps warps in step (update this test)");
    cudasim_set_schedule(CUDASIM_SCHED_WARPS, 0);
    ck_assert_msg(!run_read_after_collective(false), "warps schedule missed a race across a warp collective");

    /* Warp-synchronous code without __syncwarp. */
    std::vector<int> h(32);
    for (int i = 0; i < 32; i++) h[i] = i * i - 7;
    int ref = 0;
    for (int v : h) ref += v;
    int *in = dev_alloc<int>(32), *out = dev_alloc<int>(1);
    to_dev(in, h);
    bool caught = false;
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        poison(out, 4);
        CPAR_LAUNCH(warp_smem_sum<true>, 1, 32, 0, 0)(in, out);
        CK_LAUNCHED(sc);
        ck_assert_msg(from_dev(out, 1)[0] == ref, "[%s] warp sum with __syncwarp wrong", sc.name);
        poison(out, 4);
        CPAR_LAUNCH(warp_smem_sum<false>, 1, 32, 0, 0)(in, out);
        CK_LAUNCHED(sc);
        caught = caught || from_dev(out, 1)[0] != ref;
    }
    ck_assert_msg(caught, "warp-synchronous reduction without __syncwarp went unnoticed");
    CK_CUDA(cudaFree(in));
    CK_CUDA(cudaFree(out));
}
END_TEST

/* ==== 4. warp intrinsics ================================================== */

enum ShflVariant { SV_IDX, SV_UP, SV_DOWN, SV_XOR };

/* Each thread shuffles its value (int, float, double, 64-bit and __half
 * payloads) with one variant/argument/width. Launch: any block, 1-D. */
__global__ void shfl_kernel(int variant, int arg, int width, const int *in, int *oi, float *of, double *od,
                            unsigned long long *ou, float *oh) {
    unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
    int v = in[g];
    float f = (float)v * 0.25f;
    double d = (double)v * 1e-3 + 1e9;
    unsigned long long u = ((unsigned long long)(unsigned)v << 32) | (unsigned)(v * 7);
    __half hv = __float2half((float)(v % 1000));
    const unsigned full = 0xffffffffu;
    switch (variant) {
    case SV_IDX:
        oi[g] = __shfl_sync(full, v, arg, width);
        of[g] = __shfl_sync(full, f, arg, width);
        od[g] = __shfl_sync(full, d, arg, width);
        ou[g] = __shfl_sync(full, u, arg, width);
        oh[g] = __half2float(__shfl_sync(full, hv, arg, width));
        break;
    case SV_UP:
        oi[g] = __shfl_up_sync(full, v, (unsigned)arg, width);
        of[g] = __shfl_up_sync(full, f, (unsigned)arg, width);
        od[g] = __shfl_up_sync(full, d, (unsigned)arg, width);
        ou[g] = __shfl_up_sync(full, u, (unsigned)arg, width);
        oh[g] = __half2float(__shfl_up_sync(full, hv, (unsigned)arg, width));
        break;
    case SV_DOWN:
        oi[g] = __shfl_down_sync(full, v, (unsigned)arg, width);
        of[g] = __shfl_down_sync(full, f, (unsigned)arg, width);
        od[g] = __shfl_down_sync(full, d, (unsigned)arg, width);
        ou[g] = __shfl_down_sync(full, u, (unsigned)arg, width);
        oh[g] = __half2float(__shfl_down_sync(full, hv, (unsigned)arg, width));
        break;
    default:
        oi[g] = __shfl_xor_sync(full, v, arg, width);
        of[g] = __shfl_xor_sync(full, f, arg, width);
        od[g] = __shfl_xor_sync(full, d, arg, width);
        ou[g] = __shfl_xor_sync(full, u, arg, width);
        oh[g] = __half2float(__shfl_xor_sync(full, hv, arg, width));
        break;
    }
}

/* The CUDA programming guide's description of each variant, per lane. */
static int shfl_source(int variant, int lane, int arg, int width) {
    int seg = lane / width * width;
    switch (variant) {
    case SV_IDX: return seg + arg % width;
    case SV_UP: return lane % width >= arg ? lane - arg : lane;
    case SV_DOWN: return lane % width + arg < width ? lane + arg : lane;
    default: { /* xor: may read earlier segments, later ones give the own value */
        int j = lane ^ arg;
        return j < seg + width ? j : lane;
    }
    }
}

START_TEST(test_warp_shuffles) {
    const unsigned B = 64, nb = 2, n = B * nb;
    std::vector<int> h(n);
    for (unsigned i = 0; i < n; i++) h[i] = (int)(i * 17 + 3);
    int *in = dev_alloc<int>(n), *oi = dev_alloc<int>(n);
    float *of = dev_alloc<float>(n), *oh = dev_alloc<float>(n);
    double *od = dev_alloc<double>(n);
    unsigned long long *ou = dev_alloc<unsigned long long>(n);
    to_dev(in, h);
    struct Case { int variant, arg; };
    const Case cases[] = {{SV_IDX, 0}, {SV_IDX, 3}, {SV_IDX, 31}, {SV_IDX, 17}, {SV_UP, 1}, {SV_UP, 2},
                          {SV_UP, 5},  {SV_DOWN, 1}, {SV_DOWN, 4}, {SV_DOWN, 7}, {SV_XOR, 1}, {SV_XOR, 2},
                          {SV_XOR, 5}, {SV_XOR, 16}, {SV_XOR, 31}};
    int checked = 0;
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        for (int width : {32, 16, 8, 4, 2}) {
            for (const Case &c : cases) {
                poison(oi, n * 4);
                poison(of, n * 4);
                poison(oh, n * 4);
                poison(od, n * 8);
                poison(ou, n * 8);
                CPAR_LAUNCH(shfl_kernel, nb, B, 0, 0)(c.variant, c.arg, width, in, oi, of, od, ou, oh);
                CK_LAUNCHED(sc);
                std::vector<int> ri = from_dev(oi, n);
                std::vector<float> rf = from_dev(of, n), rh = from_dev(oh, n);
                std::vector<double> rd = from_dev(od, n);
                std::vector<unsigned long long> ru = from_dev(ou, n);
                for (unsigned g = 0; g < n; g++) {
                    int lane = (int)(g % 32);
                    int src = (int)(g - lane) + shfl_source(c.variant, lane, c.arg, width);
                    int v = h[src];
                    EXPECT(ri[g] == v, "[%s] variant %d arg %d width %d thread %u: %d, expected %d (lane %d)", sc.name,
                           c.variant, c.arg, width, g, ri[g], v, src % 32);
                    EXPECT(rf[g] == (float)v * 0.25f, "float payload, thread %u", g);
                    EXPECT(rd[g] == (double)v * 1e-3 + 1e9, "double payload, thread %u", g);
                    EXPECT(ru[g] == (((unsigned long long)(unsigned)v << 32) | (unsigned)(v * 7)), "u64, thread %u", g);
                    EXPECT(rh[g] == (float)(v % 1000), "__half payload, thread %u", g);
                    checked++;
                }
            }
        }
    }
    ck_assert_int_gt(checked, 1000);
    CK_CUDA(cudaFree(in));
    CK_CUDA(cudaFree(oi));
    CK_CUDA(cudaFree(of));
    CK_CUDA(cudaFree(oh));
    CK_CUDA(cudaFree(od));
    CK_CUDA(cudaFree(ou));
}
END_TEST

/* Partial masks: only the named lanes call.
 *  out[4g+0]: lanes 0..15, __shfl_down_sync(0x0000ffff, v, 1)   (lane 15 undefined)
 *  out[4g+1]: even lanes, __shfl_sync(0x55555555, v, 6)          (broadcast of lane 6)
 *  out[4g+2]: lanes 8..23, __shfl_xor_sync(0x00ffff00, v, 4, 8)
 *  out[4g+3]: a warp reduction in a 48-thread block with the full mask
 *             (lanes 48..63 do not exist and are ignored). */
__global__ void shfl_partial(const int *in, int *out) {
    unsigned g = threadIdx.x, lane = g % 32;
    int v = in[g];
    if (lane < 16) out[4 * g + 0] = __shfl_down_sync(0x0000ffffu, v, 1);
    if (lane % 2 == 0) out[4 * g + 1] = __shfl_sync(0x55555555u, v, 6);
    if (lane >= 8 && lane < 24) out[4 * g + 2] = __shfl_xor_sync(0x00ffff00u, v, 4, 8);
    int s = v;
    for (int off = 8; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off, 16);
    out[4 * g + 3] = s;
}

/* Votes, matches and reductions.
 *  r[8g+0] __ballot_sync(full, lane%3==0)   r[8g+1] __any_sync(full, lane==g0)
 *  r[8g+2] __all_sync(full, v>0)            r[8g+3] __ballot_sync(0x0f0f0f0f, lane&1) (named lanes)
 *  r[8g+4] __all_sync(0x0f0f0f0f, lane&1==0 || lane>=8)   r[8g+5] __activemask()
 *  r[8g+6] __match_any_sync(full, lane/4)   r[8g+7] __reduce_add_sync(full, lane) */
__global__ void vote_kernel(const int *in, unsigned *r, int g0) {
    unsigned g = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % 32;
    const unsigned full = 0xffffffffu;
    int v = in[g];
    r[8 * g + 0] = __ballot_sync(full, lane % 3 == 0);
    r[8 * g + 1] = (unsigned)__any_sync(full, (int)lane == g0);
    r[8 * g + 2] = (unsigned)__all_sync(full, v > 0);
    if ((0x0f0f0f0fu >> lane) & 1u) {
        r[8 * g + 3] = __ballot_sync(0x0f0f0f0fu, lane & 1u);
        r[8 * g + 4] = (unsigned)__all_sync(0x0f0f0f0fu, (lane & 1u) == 0 || lane >= 8);
    }
    r[8 * g + 5] = __activemask();
    r[8 * g + 6] = __match_any_sync(full, lane / 4);
    r[8 * g + 7] = __reduce_add_sync(full, lane);
}

START_TEST(test_warp_partial_masks_and_votes) {
    const unsigned n = 48;
    std::vector<int> h(n);
    for (unsigned i = 0; i < n; i++) h[i] = (int)(i * 3 + 1);
    int *in = dev_alloc<int>(64), *out = dev_alloc<int>(4 * n);
    to_dev(in, h);
    unsigned *r = dev_alloc<unsigned>(8 * 64);
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        poison(out, 16 * n);
        CPAR_LAUNCH(shfl_partial, 1, n, 0, 0)(in, out);
        CK_LAUNCHED(sc);
        std::vector<int> o = from_dev(out, 4 * n);
        for (unsigned g = 0; g < n; g++) {
            unsigned lane = g % 32, w = g - lane;
            if (lane < 15) EXPECT_EQ(o[4 * g + 0], h[g + 1]);
            if (lane % 2 == 0) EXPECT_EQ(o[4 * g + 1], h[w + 6]);
            if (lane >= 8 && lane < 24) EXPECT_EQ(o[4 * g + 2], h[g ^ 4]);
            if (lane < 8 || lane >= 24) EXPECT_EQ(o[4 * g + 2], -1); /* untouched */
            int seg = 0;
            for (unsigned j = g / 16 * 16; j < g / 16 * 16 + 16; j++) seg += h[j];
            EXPECT(o[4 * g + 3] == seg, "[%s] thread %u: segment sum %d, expected %d", sc.name, g, o[4 * g + 3], seg);
        }
        /* votes: two blocks of 64 (two full warps each) and one of 40 (a partial warp) */
        for (unsigned B : {64u, 40u}) {
            std::vector<int> hv(64);
            for (unsigned i = 0; i < 64; i++) hv[i] = (i == 37) ? -5 : (int)i + 1; /* warp 1 has one v <= 0 */
            to_dev(in, hv);
            poison(r, 8 * 64 * 4);
            CPAR_LAUNCH(vote_kernel, 1, B, 0, 0)(in, r, 5);
            CK_LAUNCHED(sc);
            std::vector<unsigned> rr = from_dev(r, 8 * 64);
            for (unsigned g = 0; g < B; g++) {
                unsigned lane = g % 32, w = g / 32;
                unsigned exist = (w == B / 32 && B % 32) ? (1u << (B % 32)) - 1u : 0xffffffffu;
                unsigned ballot3 = 0;
                for (unsigned l = 0; l < 32; l++)
                    if (((exist >> l) & 1u) && l % 3 == 0) ballot3 |= 1u << l;
                EXPECT(rr[8 * g + 0] == ballot3, "[%s] B=%u g=%u ballot %08x expected %08x", sc.name, B, g,
                       rr[8 * g + 0], ballot3);
                EXPECT_EQ(rr[8 * g + 1], 1u);
                bool all_pos = true;
                for (unsigned l = 0; l < 32; l++)
                    if ((exist >> l) & 1u) all_pos = all_pos && hv[w * 32 + l] > 0;
                EXPECT_EQ(rr[8 * g + 2], all_pos ? 1u : 0u);
                if ((0x0f0f0f0fu >> lane) & 1u) {
                    unsigned named = 0x0f0f0f0fu & exist;
                    EXPECT_EQ(rr[8 * g + 3], named & 0xaaaaaaaau);
                    EXPECT_EQ(rr[8 * g + 4], (named & 0xaaaaaaaau & 0xffu) ? 0u : 1u);
                } else {
                    EXPECT_EQ(rr[8 * g + 3], 0xffffffffu);
                }
                EXPECT_EQ(rr[8 * g + 5], exist);
                EXPECT_EQ(rr[8 * g + 6], (0xfu << (lane / 4 * 4)) & exist);
                unsigned lsum = 0;
                for (unsigned l = 0; l < 32; l++)
                    if ((exist >> l) & 1u) lsum += l;
                EXPECT_EQ(rr[8 * g + 7], lsum);
            }
        }
        to_dev(in, h);
    }
    CK_CUDA(cudaFree(in));
    CK_CUDA(cudaFree(out));
    CK_CUDA(cudaFree(r));
}
END_TEST

/* A block-wide sum in the usual two-level form (warp shuffles, one value per
 * warp through shared memory, a final warp reduction). Launch: 1-D, B % 32 == 0. */
__device__ float warp_reduce_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}
__global__ void block_sum_shfl(const float *in, float *out) {
    __shared__ float partial[32];
    unsigned t = threadIdx.x, lane = t % 32, warp = t / 32, nw = blockDim.x / 32;
    float v = warp_reduce_sum(in[blockIdx.x * blockDim.x + t]);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nw ? partial[lane] : 0.0f;
        v = warp_reduce_sum(v);
        if (lane == 0) out[blockIdx.x] = v;
    }
}

START_TEST(test_warp_block_reduction) {
    const unsigned B = 1024, nb = 5, n = B * nb;
    std::vector<float> h(n);
    for (unsigned i = 0; i < n; i++) h[i] = (float)((int)(i % 29) - 14);
    float *in = dev_alloc<float>(n), *out = dev_alloc<float>(nb);
    to_dev(in, h);
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        poison(out, nb * 4);
        CPAR_LAUNCH(block_sum_shfl, nb, B, 0, 0)(in, out);
        CK_LAUNCHED(sc);
        std::vector<float> r = from_dev(out, nb);
        for (unsigned b = 0; b < nb; b++) {
            double ref = 0;
            for (unsigned i = 0; i < B; i++) ref += h[b * B + i];
            EXPECT(r[b] == ref, "[%s] block %u: %g expected %g", sc.name, b, r[b], ref);
        }
    }
    CK_CUDA(cudaFree(in));
    CK_CUDA(cudaFree(out));
}
END_TEST

/* cudasim_warp_call: each lane publishes a pointer to its locals; the last
 * lane of the mask to arrive runs the function once for all of them. Here
 * each lane gets the sum of the named lanes' values plus its own rank among
 * them, and the function counts its calls and the null (unnamed) args. */
static void expect_launch_failure(const Schedule &sc, const char *what, const char *needle1, const char *needle2);
static void expect_good_launch_after_failure(const Schedule &sc, int *buf);
struct WarpCallLane {
    int v, out;
    int *calls; /* [0]: calls, [1]: args that were null, [2]: calls whose mask differed */
    unsigned mask;
};
static void warp_call_sum(void *const args[32], unsigned mask) {
    int sum = 0, *calls = nullptr, nulls = 0;
    bool mask_ok = true;
    for (int l = 0; l < 32; l++) {
        WarpCallLane *a = (WarpCallLane *)args[l];
        if (!a) {
            nulls++;
            continue;
        }
        sum += a->v;
        calls = a->calls;
        mask_ok = mask_ok && a->mask == mask;
    }
    int rank = 0;
    for (int l = 0; l < 32; l++)
        if (args[l]) ((WarpCallLane *)args[l])->out = sum + rank++;
    calls[0]++; /* one host thread runs the block: no race */
    calls[1] += nulls;
    calls[2] += !mask_ok;
}
static void warp_call_other(void *const args[32], unsigned) { (void)args; }
/* Lanes 0-15 call with mask 0x0000ffff, lanes 16-31 with 0xffff0000 (two
 * calls per warp), then the whole warp with the full mask; after each, the
 * lane writes its result. variant 1: lane 0 first calls another function
 * with the same mask. */
__global__ void warp_call_kernel(const int *in, int *out, int *calls, int variant) {
    unsigned g = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % 32;
    WarpCallLane me = {in[g], -1, calls, lane < 16 ? 0x0000ffffu : 0xffff0000u};
    if (variant == 1 && lane == 0) cudasim_warp_call(me.mask, warp_call_other, &me, "warp_call_other");
    cudasim_warp_call(me.mask, warp_call_sum, &me, "warp_call_sum");
    out[2 * g] = me.out;
    me.mask = 0xffffffffu;
    cudasim_warp_call(me.mask, warp_call_sum, &me, "warp_call_sum");
    out[2 * g + 1] = me.out;
}

START_TEST(test_warp_call) {
    const unsigned nb = 3, B = 64, n = nb * B;
    std::vector<int> h(n);
    for (unsigned i = 0; i < n; i++) h[i] = (int)(i * 7 % 23) - 11;
    int *in = dev_alloc<int>(n), *out = dev_alloc<int>(2 * n), *calls = dev_alloc<int>(3);
    to_dev(in, h);
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        poison(out, 2 * n * 4);
        CK_CUDA(cudaMemset(calls, 0, 3 * 4));
        CPAR_LAUNCH(warp_call_kernel, nb, B, 0, 0)(in, out, calls, 0);
        CK_LAUNCHED(sc);
        std::vector<int> o = from_dev(out, 2 * n), c = from_dev(calls, 3);
        for (unsigned g = 0; g < n; g++) {
            unsigned lane = g % 32, w = g - lane, half = w + lane / 16 * 16;
            int s16 = 0, s32 = 0;
            for (unsigned l = 0; l < 32; l++) s32 += h[w + l];
            for (unsigned l = 0; l < 16; l++) s16 += h[half + l];
            EXPECT(o[2 * g] == s16 + (int)(lane % 16), "[%s] thread %u, half-warp call: %d, expected %d", sc.name,
                   g, o[2 * g], s16 + (int)(lane % 16));
            EXPECT(o[2 * g + 1] == s32 + (int)lane, "[%s] thread %u, full-warp call: %d, expected %d", sc.name, g,
                   o[2 * g + 1], s32 + (int)lane);
        }
        const int warps = (int)(n / 32);
        EXPECT(c[0] == 3 * warps, "[%s] %d calls, expected %d (one per completion)", sc.name, c[0], 3 * warps);
        EXPECT(c[1] == 2 * 16 * warps, "[%s] %d null args, expected %d (the lanes outside each half mask)", sc.name,
               c[1], 2 * 16 * warps);
        EXPECT_EQ(c[2], 0);

        /* another function, same mask, in one lane: the lanes never gather, a launch failure naming both */
        CPAR_LAUNCH(warp_call_kernel, 1, 32, 0, 0)(in, out, calls, 1);
        expect_launch_failure(sc, "two functions", "warp_call_other", "warp_call_sum");
        expect_good_launch_after_failure(sc, out);
    }
    /* host code: a warp of one */
    int host_calls[3] = {0, 0, 0};
    WarpCallLane me = {5, -1, host_calls, 1u};
    cudasim_warp_call(1u, warp_call_sum, &me, "warp_call_sum");
    EXPECT(me.out == 5 && host_calls[0] == 1 && host_calls[1] == 31 && host_calls[2] == 0,
           "host call: out %d, %d calls, %d null args, %d mask mismatches", me.out, host_calls[0], host_calls[1],
           host_calls[2]);
    CK_CUDA(cudaFree(in));
    CK_CUDA(cudaFree(out));
    CK_CUDA(cudaFree(calls));
}
END_TEST

/* ==== 5. shared memory ==================================================== */

/* Checks that the block's dynamic shared memory is 16-byte aligned and fully
 * poisoned (0xFF) at block start, then that writes by one thread are seen by
 * another after __syncthreads. Counts violations into bad[0..2]. */
__global__ void smem_probe(size_t bytes, int *bad) {
    CPAR_DYN_SMEM(unsigned char, s);
    CPAR_DYN_SMEM(float4, s4);
    unsigned t = threadIdx.x, nt = blockDim.x;
    if (t == 0 && ((uintptr_t)s4 % 16) != 0) atomicAdd(&bad[2], 1);
    int bp = 0, bd = 0;
    for (size_t i = t; i < bytes; i += nt) bp += s[i] != 0xFF;
    __syncthreads();
    for (size_t i = t; i < bytes; i += nt) s[i] = (unsigned char)(i * 7 + blockIdx.x);
    __syncthreads();
    for (size_t i = nt - 1 - t; i < bytes; i += nt) bd += s[i] != (unsigned char)(i * 7 + blockIdx.x);
    atomicAdd(&bad[0], bp);
    atomicAdd(&bad[1], bd);
}

START_TEST(test_dynamic_shared_memory) {
    int *bad = dev_alloc<int>(3);
    const size_t sizes[] = {0, 4, 1024, 48 * 1024, 48 * 1024 + 4, 64 * 1024, 100 * 1024, 227 * 1024};
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        CK_CUDA(cudaFuncSetAttribute(smem_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
        for (size_t bytes : sizes) {
            CK_CUDA(cudaMemset(bad, 0, 12));
            CPAR_LAUNCH(smem_probe, 3, 256, bytes, 0)(bytes, bad);
            CK_LAUNCHED(sc);
            std::vector<int> b = from_dev(bad, 3);
            ck_assert_msg(b[0] == 0, "[%s] %zu bytes: %d bytes not poisoned at block start", sc.name, bytes, b[0]);
            ck_assert_msg(b[1] == 0, "[%s] %zu bytes: %d bytes not seen after the barrier", sc.name, bytes, b[1]);
            ck_assert_int_eq(b[2], 0);
        }
        /* Above 48 KiB needs the opt-in, as on a GPU; the cap is 227 KiB. */
        CK_CUDA(cudaFuncSetAttribute(smem_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
        CK_CUDA(cudaMemset(bad, 0, 12));
        CPAR_LAUNCH(smem_probe, 1, 32, 64 * 1024 + 16, 0)(64 * 1024 + 16, bad);
        ck_assert_int_eq(cudaGetLastError(), cudaErrorInvalidValue);
        ck_assert_ptr_nonnull(strstr(cudasim_last_message(), "cudaFuncSetAttribute"));
        ck_assert_int_eq(cudaFuncSetAttribute(smem_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 * 1024),
                         cudaErrorInvalidValue);
        ck_assert_int_eq(cudaGetLastError(), cudaErrorInvalidValue);
        CPAR_LAUNCH(smem_probe, 1, 32, 228 * 1024, 0)(228 * 1024, bad);
        ck_assert_int_eq(cudaGetLastError(), cudaErrorInvalidValue);
        CPAR_LAUNCH(reverse_dynamic, 1, 32, 48 * 1024 + 4, 0)(nullptr, nullptr); /* no opt-in at all */
        ck_assert_int_eq(cudaGetLastError(), cudaErrorInvalidValue);
    }
    /* A GPU of 99 KiB a block (sm_86, sm_89, sm_120): the attribute says
     * so, and the opt-in and a launch above it fail; at it they work. */
    int optin = 0, per_sm = 0;
    CK_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    ck_assert_int_eq(optin, 227 * 1024);
    cudasim_set_smem_optin(99 * 1024);
    CK_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    CK_CUDA(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    ck_assert_int_eq(optin, 99 * 1024);
    ck_assert_int_eq(per_sm, 100 * 1024);
    ck_assert_int_eq(cudaFuncSetAttribute(smem_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 99 * 1024 + 16),
                     cudaErrorInvalidValue);
    ck_assert_int_eq(cudaGetLastError(), cudaErrorInvalidValue);
    CPAR_LAUNCH(smem_probe, 1, 32, 100 * 1024, 0)(100 * 1024, bad); /* the 227 KiB opt-in from above */
    ck_assert_int_eq(cudaGetLastError(), cudaErrorInvalidValue);
    CK_CUDA(cudaFuncSetAttribute(smem_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 99 * 1024));
    CK_CUDA(cudaMemset(bad, 0, 12));
    CPAR_LAUNCH(smem_probe, 1, 128, 99 * 1024, 0)(99 * 1024, bad);
    CK_CUDA(cudaDeviceSynchronize());
    std::vector<int> b = from_dev(bad, 3);
    ck_assert_int_eq(b[0] + b[1] + b[2], 0);
    cudasim_set_smem_optin(0);
    CK_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    ck_assert_int_eq(optin, 227 * 1024);
    CK_CUDA(cudaFree(bad));
}
END_TEST

/* Asynchronous copies (CUDA's pipeline primitives, cp.async) land at the
 * latest moment PTX allows. 64 threads; per thread t, out[k * 64 + t]:
 *  0: s[t] after wait_prior(1) with two groups in flight: group 1 landed
 *  1: s[64 + t], group 2, at the same point: still poison (-1)
 *  2: s[t'] of the neighbour t' = t ^ 1 after wait_prior(0) and a barrier
 *  3: s[128 + t] after its commit and a barrier, but no wait: poison
 *  4: s[192 + t] after wait_prior(0) without a commit: poison
 *  5, 6: a 16-byte copy with zfill 4 into s[256 + 4t .. +3]: the element
 *     after the wait, the zero-filled last one (t's first and fourth int). */
__global__ void pipeline_copies(const int *in, int *out) {
    CPAR_DYN_SMEM(int, s);
    const int t = (int)threadIdx.x;
    __pipeline_memcpy_async(&s[t], &in[t], 4);
    __pipeline_commit();
    __pipeline_memcpy_async(&s[64 + t], &in[64 + t], 4);
    __pipeline_commit();
    __pipeline_wait_prior(1);
    out[t] = s[t];
    out[64 + t] = s[64 + t];
    __pipeline_wait_prior(0);
    __syncthreads();
    out[128 + t] = s[t ^ 1] + s[64 + (t ^ 1)] - in[64 + (t ^ 1)]; /* both groups visible to the neighbour */
    __pipeline_memcpy_async(&s[128 + t], &in[t], 4);
    __pipeline_commit();
    __syncthreads();
    out[192 + t] = s[128 + t];
    __pipeline_memcpy_async(&s[192 + t], &in[t], 4);
    __pipeline_wait_prior(0);
    out[256 + t] = s[192 + t];
    __pipeline_commit();
    __pipeline_memcpy_async(&s[256 + 4 * t], &in[4 * (t % 16)], 16, 4);
    __pipeline_commit();
    __pipeline_wait_prior(0);
    out[320 + t] = s[256 + 4 * t];
    out[384 + t] = s[256 + 4 * t + 3];
}

/* A 16-byte copy from an address that is only 4-byte aligned. */
__global__ void pipeline_misaligned(const int *in) {
    CPAR_DYN_SMEM(int, s);
    __pipeline_memcpy_async(&s[4 * threadIdx.x], &in[1], 16);
    __pipeline_commit();
    __pipeline_wait_prior(0);
}

/* Two copies of one thread over the same bytes, the first not waited for
 * (wait: between them). */
__global__ void pipeline_overlap(const int *in, bool wait) {
    CPAR_DYN_SMEM(int, s);
    const int t = (int)threadIdx.x;
    __pipeline_memcpy_async(&s[4 * t], &in[0], 16);
    __pipeline_commit();
    if (wait) __pipeline_wait_prior(0);
    __pipeline_memcpy_async(&s[4 * t + 2], &in[4], 8);
    __pipeline_commit();
    __pipeline_wait_prior(0);
}

START_TEST(test_pipeline_copies) {
    std::vector<int> h(128);
    for (int i = 0; i < 128; i++) h[i] = 11 * i + 5;
    int *in = dev_alloc<int>(128), *out = dev_alloc<int>(7 * 64);
    to_dev(in, h);
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        poison(out, 7 * 64 * 4);
        CPAR_LAUNCH(pipeline_copies, 1, 64, 512 * 4, 0)(in, out);
        CK_LAUNCHED(sc);
        std::vector<int> r = from_dev(out, 7 * 64);
        for (int t = 0; t < 64; t++) {
            EXPECT(r[t] == h[t], "[%s] t %d: group 1 after wait_prior(1): %d, expected %d", sc.name, t, r[t], h[t]);
            EXPECT(r[64 + t] == -1, "[%s] t %d: group 2 landed before its wait (%d)", sc.name, t, r[64 + t]);
            EXPECT(r[128 + t] == h[t ^ 1], "[%s] t %d: the neighbour's copies after wait and barrier: %d", sc.name, t,
                   r[128 + t]);
            EXPECT(r[192 + t] == -1, "[%s] t %d: a barrier landed a copy (%d)", sc.name, t, r[192 + t]);
            EXPECT(r[256 + t] == -1, "[%s] t %d: wait_prior(0) landed an uncommitted copy (%d)", sc.name, t,
                   r[256 + t]);
            EXPECT(r[320 + t] == h[4 * (t % 16)], "[%s] t %d: 16-byte copy: %d", sc.name, t, r[320 + t]);
            EXPECT(r[384 + t] == 0, "[%s] t %d: zfill left %d", sc.name, t, r[384 + t]);
        }
    }
    CPAR_LAUNCH(pipeline_misaligned, 1, 4, 64, 0)(in);
    ck_assert_int_eq(cudaGetLastError(), cudaErrorLaunchFailure);
    ck_assert_ptr_nonnull(strstr(cudasim_last_message(), "__pipeline_memcpy_async"));
    CPAR_LAUNCH(pipeline_overlap, 1, 8, 128, 0)(in, true);
    CK_CUDA(cudaGetLastError());
    CPAR_LAUNCH(pipeline_overlap, 1, 8, 128, 0)(in, false);
    ck_assert_int_eq(cudaGetLastError(), cudaErrorLaunchFailure);
    ck_assert_ptr_nonnull(strstr(cudasim_last_message(), "still in flight"));
    CK_CUDA(cudaFree(in));
    CK_CUDA(cudaFree(out));
}
END_TEST

/* Static __shared__ memory is per host thread and shared by the block. */
__global__ void static_smem_sum(int *out) {
    __shared__ int total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    atomicAdd(&total, (int)threadIdx.x);
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = total;
}

START_TEST(test_static_shared_memory) {
    int *out = dev_alloc<int>(4);
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        poison(out, 16);
        CPAR_LAUNCH(static_smem_sum, 4, 200, 0, 0)(out);
        CK_LAUNCHED(sc);
        std::vector<int> r = from_dev(out, 4);
        for (int b = 0; b < 4; b++) EXPECT_EQ(r[b], 199 * 200 / 2);
    }
    CK_CUDA(cudaFree(out));
}
END_TEST

/* ==== 6. atomics ========================================================== */

struct Counters {
    int i;
    unsigned u;
    unsigned long long ull;
    float f;
    double d;
    int imax, imin;
    unsigned umax, umin;
    unsigned cas_count;
    int exch;
    int sub;
    unsigned bits;
    unsigned inc;
    unsigned long long llmax;
};

/* Every thread of every block hits the same counters; tickets[g] = the value
 * an atomicAdd returned, so the tickets must be a permutation of 0..N-1. */
__global__ void atomics_kernel(Counters *c, unsigned *tickets) {
    unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
    tickets[g] = atomicAdd(&c->u, 1u);
    atomicAdd(&c->i, 2);
    atomicAdd(&c->ull, 1ull << 33);
    atomicAdd(&c->f, 1.0f);
    atomicAdd(&c->d, 0.5);
    atomicMax(&c->imax, (int)g);
    atomicMin(&c->imin, -(int)g);
    atomicMax(&c->umax, g * 3u);
    atomicMin(&c->umin, g + 5u);
    unsigned old = c->cas_count, assumed;
    do {
        assumed = old;
        old = atomicCAS(&c->cas_count, assumed, assumed + 1u);
    } while (old != assumed);
    atomicExch(&c->exch, (int)g);
    atomicSub(&c->sub, 3);
    atomicOr(&c->bits, 1u << (g % 32));
    atomicInc(&c->inc, 9u);
    atomicMax(&c->llmax, (unsigned long long)g << 20);
}

START_TEST(test_atomics_contention) {
    const unsigned nb = 48, B = 256, n = nb * B;
    Counters *c = dev_alloc<Counters>(1);
    unsigned *tickets = dev_alloc<unsigned>(n);
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        Counters h0;
        memset(&h0, 0, sizeof h0);
        h0.imax = -1;
        h0.umin = 0xffffffffu;
        h0.exch = -1;
        CK_CUDA(cudaMemcpy(c, &h0, sizeof h0, cudaMemcpyHostToDevice));
        poison(tickets, n * 4);
        CPAR_LAUNCH(atomics_kernel, nb, B, 0, 0)(c, tickets);
        CK_LAUNCHED(sc);
        Counters r = from_dev(c, 1)[0];
        ck_assert_uint_eq(r.u, n);
        ck_assert_int_eq(r.i, 2 * (int)n);
        ck_assert(r.ull == (unsigned long long)n << 33);
        ck_assert(r.f == (float)n);
        ck_assert(r.d == 0.5 * n);
        ck_assert_int_eq(r.imax, (int)n - 1);
        ck_assert_int_eq(r.imin, -((int)n - 1));
        ck_assert_uint_eq(r.umax, (n - 1) * 3u);
        ck_assert_uint_eq(r.umin, 5u);
        ck_assert_uint_eq(r.cas_count, n);
        ck_assert(r.exch >= 0 && r.exch < (int)n);
        ck_assert_int_eq(r.sub, -3 * (int)n);
        ck_assert_uint_eq(r.bits, 0xffffffffu);
        ck_assert_uint_eq(r.inc, n % 10);
        ck_assert(r.llmax == (unsigned long long)(n - 1) << 20);
        std::vector<unsigned> t = from_dev(tickets, n);
        std::sort(t.begin(), t.end());
        for (unsigned i = 0; i < n; i++) EXPECT_EQ(t[i], i);
    }
    CK_CUDA(cudaFree(c));
    CK_CUDA(cudaFree(tickets));
}
END_TEST

/* ==== 7. grid shapes ====================================================== */

/* Every thread writes its coordinates at its global linear index:
 * out[idx] = {bx, by, bz, tx, ty, tz}; dims[] gets gridDim and blockDim. */
__global__ void coords_kernel(unsigned *out, unsigned *dims) {
    unsigned bl = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    unsigned tl = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    unsigned idx = bl * (blockDim.x * blockDim.y * blockDim.z) + tl;
    unsigned *o = out + 6 * (size_t)idx;
    o[0] = blockIdx.x;
    o[1] = blockIdx.y;
    o[2] = blockIdx.z;
    o[3] = threadIdx.x;
    o[4] = threadIdx.y;
    o[5] = threadIdx.z;
    if (idx == 0) {
        dims[0] = gridDim.x;
        dims[1] = gridDim.y;
        dims[2] = gridDim.z;
        dims[3] = blockDim.x;
        dims[4] = blockDim.y;
        dims[5] = blockDim.z;
    }
}

START_TEST(test_grid_shapes) {
    struct Shape { dim3 g, b; };
    const Shape shapes[] = {
        {dim3(1000), dim3(32)},          /* many more blocks than threads */
        {dim3(3000), dim3(1)},           /* single-thread blocks */
        {dim3(5, 3), dim3(16, 4)},       /* 2-D */
        {dim3(3, 2, 4), dim3(4, 3, 2)},  /* 3-D */
        {dim3(1, 1, 7), dim3(1, 1, 64)}, /* z limits */
        {dim3(2), dim3(1024)},           /* the largest block */
    };
    unsigned *dims = dev_alloc<unsigned>(6);
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        for (const Shape &s : shapes) {
            unsigned nblocks = s.g.x * s.g.y * s.g.z, nthr = s.b.x * s.b.y * s.b.z, n = nblocks * nthr;
            unsigned *out = dev_alloc<unsigned>(6 * (size_t)n);
            poison(out, 24 * (size_t)n);
            poison(dims, 24);
            CPAR_LAUNCH(coords_kernel, s.g, s.b, 0, 0)(out, dims);
            CK_LAUNCHED(sc);
            std::vector<unsigned> r = from_dev(out, 6 * (size_t)n), d = from_dev(dims, 6);
            ck_assert(d[0] == s.g.x && d[1] == s.g.y && d[2] == s.g.z);
            ck_assert(d[3] == s.b.x && d[4] == s.b.y && d[5] == s.b.z);
            unsigned idx = 0;
            for (unsigned bz = 0; bz < s.g.z; bz++)
                for (unsigned by = 0; by < s.g.y; by++)
                    for (unsigned bx = 0; bx < s.g.x; bx++)
                        for (unsigned tz = 0; tz < s.b.z; tz++)
                            for (unsigned ty = 0; ty < s.b.y; ty++)
                                for (unsigned tx = 0; tx < s.b.x; tx++, idx++) {
                                    const unsigned *o = &r[6 * (size_t)idx];
                                    EXPECT(o[0] == bx && o[1] == by && o[2] == bz && o[3] == tx &&
                                                      o[4] == ty && o[5] == tz,
                                                  "[%s] grid (%u,%u,%u) block (%u,%u,%u): index %u holds (%u,%u,%u)"
                                                  "(%u,%u,%u)",
                                                  sc.name, s.g.x, s.g.y, s.g.z, s.b.x, s.b.y, s.b.z, idx, o[0], o[1],
                                                  o[2], o[3], o[4], o[5]);
                                }
            CK_CUDA(cudaFree(out));
        }
    }
    CK_CUDA(cudaFree(dims));
}
END_TEST

/* ==== 8. failures and launch configurations =============================== */

/* Threads >= k return before a __syncthreads the others reach. */
__global__ void early_return_barrier(int *out, unsigned k) {
    if (threadIdx.x >= k) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}
/* Lanes >= k exit, the rest shuffle with the full mask. */
__global__ void early_return_shfl(int *out, unsigned k) {
    if (threadIdx.x >= k) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
/* Lane 0 names lanes 0-1, every other lane the whole warp: neither group can
 * ever gather its lanes. */
__global__ void mismatched_masks(int *out) {
    unsigned lane = threadIdx.x % 32;
    out[threadIdx.x] = __shfl_xor_sync(lane == 0 ? 0x3u : 0xffffffffu, (int)lane, 1);
}
/* Lanes 0..15 use mask 0xffff and complete; lanes 16..31 name lanes 0..15 with
 * the full mask after those exited. */
__global__ void masks_after_exit(int *out) {
    unsigned lane = threadIdx.x % 32;
    out[threadIdx.x] = __shfl_xor_sync(lane < 16 ? 0x0000ffffu : 0xffffffffu, (int)lane, 1);
}
/* The mask does not name the caller. */
__global__ void mask_without_caller(int *out) { out[threadIdx.x] = (int)__ballot_sync(0x1u, 1); }
/* Half the warp waits at __syncwarp, the other half at __syncthreads. */
__global__ void warp_vs_block(int *out) {
    if (threadIdx.x < 16) __syncwarp();
    else __syncthreads();
    out[threadIdx.x] = 2;
}
__global__ void trapping(int *out) {
    out[threadIdx.x] = 3;
    if (blockIdx.x == 1 && threadIdx.x == 5) __trap();
}
__global__ void fill_kernel(int *out, int value) { out[blockIdx.x * blockDim.x + threadIdx.x] = value; }

static void expect_good_launch_after_failure(const Schedule &sc, int *buf) {
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    poison(buf, 256 * 4);
    CPAR_LAUNCH(fill_kernel, 4, 64, 0, 0)(buf, 42);
    CK_LAUNCHED(sc);
    std::vector<int> r = from_dev(buf, 256);
    for (int v : r) EXPECT_EQ(v, 42);
    ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
}

static void expect_launch_failure(const Schedule &sc, const char *what, const char *needle1, const char *needle2) {
    ck_assert_int_eq(cudaPeekAtLastError(), cudaErrorLaunchFailure); /* peek keeps it */
    const char *m = cudasim_last_message();
    ck_assert_msg(strstr(m, needle1) && strstr(m, needle2), "[%s] %s: message \"%s\" lacks \"%s\"/\"%s\"", sc.name,
                  what, m, needle1, needle2);
    ck_assert_int_eq(cudaGetLastError(), cudaErrorLaunchFailure);
}

START_TEST(test_failures_are_reported) {
    int *buf = dev_alloc<int>(256);
    static bool printed = false;
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        CPAR_LAUNCH(early_return_barrier, 2, 128, 0, 0)(buf, 100);
        expect_launch_failure(sc, "skipped barrier", "__syncthreads", "exited");
        if (!printed) printf("    sample failure message: %s\n", cudasim_last_message());
        printed = true;
        expect_good_launch_after_failure(sc, buf);

        /* a kernel fault is also returned, once, by the next synchronize */
        CPAR_LAUNCH(early_return_barrier, 1, 64, 0, 0)(buf, 1);
        ck_assert_int_eq(cudaDeviceSynchronize(), cudaErrorLaunchFailure);
        ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
        ck_assert_int_eq(cudaGetLastError(), cudaErrorLaunchFailure);
        expect_good_launch_after_failure(sc, buf);

        CPAR_LAUNCH(early_return_shfl, 1, 32, 0, 0)(buf, 20);
        expect_launch_failure(sc, "exited lane", "__shfl_xor_sync", "exited");
        expect_good_launch_after_failure(sc, buf);

        CPAR_LAUNCH(mismatched_masks, 1, 64, 0, 0)(buf);
        expect_launch_failure(sc, "mismatched masks", "same mask", "__shfl_xor_sync");
        expect_good_launch_after_failure(sc, buf);

        CPAR_LAUNCH(masks_after_exit, 1, 32, 0, 0)(buf);
        expect_launch_failure(sc, "masks after exit", "mask 0xffffffff", "exited");
        expect_good_launch_after_failure(sc, buf);

        CPAR_LAUNCH(mask_without_caller, 1, 32, 0, 0)(buf);
        expect_launch_failure(sc, "mask without caller", "__ballot_sync", "does not name");
        expect_good_launch_after_failure(sc, buf);

        CPAR_LAUNCH(warp_vs_block, 1, 32, 0, 0)(buf);
        expect_launch_failure(sc, "warp vs block", "__syncwarp", "__syncthreads");
        expect_good_launch_after_failure(sc, buf);

        CPAR_LAUNCH(trapping, 3, 32, 0, 0)(buf);
        expect_launch_failure(sc, "trap", "__trap", "block (1,0,0)");
        expect_good_launch_after_failure(sc, buf);
    }
    CK_CUDA(cudaFree(buf));
}
END_TEST

START_TEST(test_invalid_launch_configs) {
    int *buf = dev_alloc<int>(256);
    struct Bad { dim3 g, b; size_t smem; cudaError_t expect; };
    const Bad bad[] = {
        {dim3(1), dim3(0), 0, cudaErrorInvalidConfiguration},
        {dim3(1), dim3(1025), 0, cudaErrorInvalidConfiguration},
        {dim3(1), dim3(1024, 2), 0, cudaErrorInvalidConfiguration},
        {dim3(1), dim3(1, 1, 65), 0, cudaErrorInvalidConfiguration},
        {dim3(1), dim3(2048), 0, cudaErrorInvalidConfiguration},
        {dim3(0), dim3(32), 0, cudaErrorInvalidConfiguration},
        {dim3(1, 65536), dim3(32), 0, cudaErrorInvalidConfiguration},
        {dim3(1, 1, 0), dim3(32), 0, cudaErrorInvalidConfiguration},
        {dim3(1), dim3(32), 300 * 1024, cudaErrorInvalidValue},
    };
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        for (const Bad &c : bad) {
            poison(buf, 64 * 4);
            CPAR_LAUNCH(fill_kernel, c.g, c.b, c.smem, 0)(buf, 7);
            ck_assert_int_eq(cudaPeekAtLastError(), c.expect);
            ck_assert_int_eq(cudaGetLastError(), c.expect);
            ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
            ck_assert_ptr_nonnull(strstr(cudasim_last_message(), "fill_kernel"));
            std::vector<int> r = from_dev(buf, 64);
            for (int v : r) EXPECT_EQ(v, -1); /* the kernel never ran */
        }
        /* a destroyed stream */
        cudaStream_t s;
        CK_CUDA(cudaStreamCreate(&s));
        CK_CUDA(cudaStreamDestroy(s));
        CPAR_LAUNCH(fill_kernel, 1, 32, 0, s)(buf, 7);
        ck_assert_int_eq(cudaGetLastError(), cudaErrorInvalidResourceHandle);
        /* the maximum legal grid in y/z still launches (tiny blocks) */
        int *big = dev_alloc<int>(65535);
        CPAR_LAUNCH(fill_kernel, dim3(1, 65535), 1, 0, 0)(big, 1);
        CK_LAUNCHED(sc);
        CK_CUDA(cudaFree(big));
        expect_good_launch_after_failure(sc, buf);
    }
    /* injected: the second launch from now fails at issue and never runs;
     * the first and the third run */
    poison(buf, 64 * 4);
    cudasim_fail_launch(2);
    CPAR_LAUNCH(fill_kernel, 1, 32, 0, 0)(buf, 3);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    CPAR_LAUNCH(fill_kernel, 1, 32, 0, 0)(buf + 32, 4);
    ck_assert_int_eq(cudaGetLastError(), cudaErrorLaunchOutOfResources);
    ck_assert_ptr_nonnull(strstr(cudasim_last_message(), "cudasim_fail_launch"));
    std::vector<int> r = from_dev(buf, 64);
    for (int i = 0; i < 64; i++) EXPECT_EQ(r[i], i < 32 ? 3 : -1);
    CPAR_LAUNCH(fill_kernel, 1, 32, 0, 0)(buf + 32, 5);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert_int_eq(from_dev(buf, 64)[40], 5);
    cudasim_fail_launch(1);
    cudasim_fail_launch(0); /* disarmed */
    CPAR_LAUNCH(fill_kernel, 1, 32, 0, 0)(buf, 6);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    CK_CUDA(cudaFree(buf));
}
END_TEST

/* ==== 9. fp16 / bf16 ====================================================== */

struct F2H { unsigned in; unsigned short out; };
/* float bits -> half bits (CUDA's __float2half_rn: nearest even, overflow to
 * inf, NaN -> 0x7fff) */
static const F2H kF2H[] = {
    {0x00000000, 0x0000}, {0x80000000, 0x8000}, {0x3f800000, 0x3c00}, {0xc0000000, 0xc000},
    {0x477fe000, 0x7bff}, /* 65504 = max half */
    {0x477fefff, 0x7bff}, /* just below the tie with 65536 */
    {0x477ff000, 0x7c00}, /* 65520: tie, rounds to even = inf */
    {0x4e6e6b28, 0x7c00}, /* 1e9 */
    {0xce6e6b28, 0xfc00}, {0x7f800000, 0x7c00}, {0xff800000, 0xfc00},
    {0x7fc00000, 0x7fff}, {0xffc00001, 0x7fff}, {0x7f800001, 0x7fff}, /* NaNs */
    {0x3f801000, 0x3c00}, /* 1 + 2^-11: tie -> even */
    {0x3f803000, 0x3c02}, /* 1 + 3*2^-11: tie -> even (up) */
    {0x3f801001, 0x3c01}, /* just above the tie */
    {0x3f800fff, 0x3c00}, /* just below */
    {0x3dcccccd, 0x2e66}, /* 0.1 */
    {0x38800000, 0x0400}, /* 2^-14: smallest normal */
    {0x387fc000, 0x03ff}, /* largest subnormal */
    {0x387fe000, 0x0400}, /* halfway between them: even = 0x400 */
    {0x33800000, 0x0001}, /* 2^-24: smallest subnormal */
    {0x33000000, 0x0000}, /* 2^-25: tie with 0 -> even = 0 */
    {0x33000001, 0x0001}, /* just above */
    {0x33400000, 0x0001}, /* 1.5 * 2^-25 */
    {0x33c00000, 0x0002}, /* 3 * 2^-25: tie between 1 and 2 -> 2 */
    {0x34200000, 0x0002}, /* 5 * 2^-25: tie between 2 and 3 -> 2 */
    {0xb3c00000, 0x8002}, {0x322bcc77, 0x0000}, /* 1e-8 */
    {0x00000001, 0x0000}, /* float subnormal */
};
struct H2F { unsigned short in; unsigned out; };
static const H2F kH2F[] = {
    {0x0000, 0x00000000}, {0x8000, 0x80000000}, {0x0001, 0x33800000}, {0x03ff, 0x387fc000},
    {0x0400, 0x38800000}, {0x3c00, 0x3f800000}, {0x3555, 0x3eaaa000}, {0x7bff, 0x477fe000},
    {0x7c00, 0x7f800000}, {0xfc00, 0xff800000}, {0x7e00, 0x7fffffff}, {0xfe01, 0x7fffffff},
    {0x8001, 0xb3800000}, {0xc000, 0xc0000000},
};
static const F2H kF2B[] = {
    {0x3f800000, 0x3f80}, {0x80000000, 0x8000}, {0x3f808000, 0x3f80}, /* tie -> even */
    {0x3f818000, 0x3f82},                                             /* tie -> even (up) */
    {0x3f808001, 0x3f81}, {0x3f807fff, 0x3f80}, {0x7f7fffff, 0x7f80}, /* FLT_MAX -> inf */
    {0xff7fffff, 0xff80}, {0x7f7f7fff, 0x7f7f}, {0x7f800000, 0x7f80}, {0xff800000, 0xff80},
    {0x7fc00000, 0x7fff}, {0xffc00001, 0x7fff}, {0x7f800001, 0x7fff}, /* NaN -> canonical */
    {0x00000001, 0x0000}, {0x00018000, 0x0002}, {0x00008000, 0x0000}, {0x80010000, 0x8001},
    {0x3dcccccd, 0x3dcd}, /* 0.1 */
};

/* Converts in a kernel: o16[i] = f16(in[i]), ob[i] = bf16(in[i]), back[i] = f32(h[i]). */
__global__ void convert_kernel(const float *in, unsigned short *o16, unsigned short *ob, const unsigned short *h,
                               float *back, int n) {
    int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    o16[i] = __half_as_ushort(__float2half_rn(in[i]));
    ob[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
    back[i] = __half2float(__ushort_as_half(h[i]));
}

START_TEST(test_fp16_bf16_conversions) {
    for (const F2H &c : kF2H) {
        unsigned short got = __half_as_ushort(__float2half(u2f(c.in)));
        ck_assert_msg(got == c.out, "f16(0x%08x) = 0x%04x, expected 0x%04x", c.in, got, c.out);
        ck_assert_uint_eq(__half_as_ushort(__float2half_rn(u2f(c.in))), c.out);
        ck_assert_uint_eq(__half_as_ushort(__half(u2f(c.in))), c.out);
    }
    for (const H2F &c : kH2F) {
        unsigned got = f2u(__half2float(__ushort_as_half(c.in)));
        ck_assert_msg(got == c.out, "f32(half 0x%04x) = 0x%08x, expected 0x%08x", c.in, got, c.out);
    }
    for (const F2H &c : kF2B) {
        unsigned short got = __bfloat16_as_ushort(__float2bfloat16(u2f(c.in)));
        ck_assert_msg(got == c.out, "bf16(0x%08x) = 0x%04x, expected 0x%04x", c.in, got, c.out);
        ck_assert_uint_eq(__bfloat16_as_ushort(__float2bfloat16_rn(u2f(c.in))), c.out);
    }
    /* every half and bf16 pattern survives a round trip (NaNs become 0x7fff) */
    for (unsigned b = 0; b < 65536; b++) {
        unsigned short h = (unsigned short)b;
        bool nan16 = (h & 0x7c00) == 0x7c00 && (h & 0x3ff), nanb = (h & 0x7f80) == 0x7f80 && (h & 0x7f);
        EXPECT_EQ(__half_as_ushort(__float2half(__half2float(__ushort_as_half(h)))), nan16 ? 0x7fffu : b);
        EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16(__bfloat162float(__ushort_as_bfloat16(h)))), nanb ? 0x7fffu : b);
        EXPECT_EQ(f2u(__bfloat162float(__ushort_as_bfloat16(h))), b << 16);
    }
    /* float -> half/bf16 agree with an independent once-rounding reference
     * (frexp/nearbyint on doubles) over a spread of 2^22 float patterns */
    for (unsigned long long i = 0; i < (1ull << 32); i += 1021) {
        float f = u2f((unsigned)i);
        EXPECT(__half_as_ushort(__float2half(f)) == cudasim::detail::f64_to_small_bits(f, 10, 5), "f16(0x%08llx)", i);
        EXPECT(__bfloat16_as_ushort(__float2bfloat16(f)) == cudasim::detail::f64_to_small_bits(f, 7, 8),
               "bf16(0x%08llx)", i);
    }
    /* doubles round once: 1 + 2^-11 + 2^-40 is above the tie (a float would lose 2^-40) */
    ck_assert_uint_eq(__half_as_ushort(__double2half(1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40))), 0x3c01);
    ck_assert_uint_eq(__half_as_ushort(__float2half((float)(1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40)))),
                      0x3c00);
    ck_assert_uint_eq(__bfloat16_as_ushort(__double2bfloat16(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40))),
                      0x3f81);
    /* pairs, arithmetic, integer conversions */
    float2 p = __half22float2(__floats2half2_rn(1.5f, -65504.0f));
    ck_assert(p.x == 1.5f && p.y == -65504.0f);
    float2 q = __bfloat1622float2(__floats2bfloat162_rn(3.0f, 0.5f));
    ck_assert(q.x == 3.0f && q.y == 0.5f);
    ck_assert(__half2float(__half(1.0f) + __half(2.0f)) == 3.0f);
    ck_assert(__half2float(__hadd(__float2half(2048.0f), __float2half(1.0f))) == 2048.0f); /* rounds to half */
    ck_assert(__bfloat162float(__hmul(__float2bfloat16(3.0f), __float2bfloat16(0.5f))) == 1.5f);
    ck_assert_int_eq((int)__half(-7.75f), -7);
    ck_assert(__half2float(__half(3)) == 3.0f);
    ck_assert(__hisnan(__ushort_as_half(0x7e00)) && !__hisnan(__half(1.0f)));
    ck_assert_uint_eq(sizeof(__half), 2);
    ck_assert_uint_eq(sizeof(__nv_bfloat16), 2);
    ck_assert_uint_eq(sizeof(__half2), 4);
    ck_assert_uint_eq(alignof(float4), 16);
    ck_assert_uint_eq(alignof(float2), 8);

    /* the same conversions inside a kernel */
    const int n = (int)(sizeof kF2H / sizeof kF2H[0]);
    std::vector<float> in(n);
    std::vector<unsigned short> hs(n);
    for (int i = 0; i < n; i++) {
        in[i] = u2f(kF2H[i].in);
        hs[i] = kF2H[i].out;
    }
    float *din = dev_alloc<float>(n), *dback = dev_alloc<float>(n);
    unsigned short *d16 = dev_alloc<unsigned short>(n), *db = dev_alloc<unsigned short>(n),
                   *dh = dev_alloc<unsigned short>(n);
    to_dev(din, in);
    to_dev(dh, hs);
    for (const Schedule &sc : kSchedules) {
        cudasim_set_schedule(sc.s, sc.seed);
        poison(d16, 2 * n);
        poison(db, 2 * n);
        poison(dback, 4 * n);
        CPAR_LAUNCH(convert_kernel, 2, 32, 0, 0)(din, d16, db, dh, dback, n);
        CK_LAUNCHED(sc);
        std::vector<unsigned short> r16 = from_dev(d16, n), rb = from_dev(db, n);
        std::vector<float> rback = from_dev(dback, n);
        for (int i = 0; i < n; i++) {
            EXPECT_EQ(r16[i], kF2H[i].out);
            EXPECT_EQ(rb[i], __bfloat16_as_ushort(__float2bfloat16(in[i])));
            float expect = __half2float(__ushort_as_half(hs[i]));
            EXPECT(f2u(rback[i]) == f2u(expect) || (std::isnan(rback[i]) && std::isnan(expect)), "back[%d]", i);
        }
    }
    CK_CUDA(cudaFree(din));
    CK_CUDA(cudaFree(dback));
    CK_CUDA(cudaFree(d16));
    CK_CUDA(cudaFree(db));
    CK_CUDA(cudaFree(dh));
}
END_TEST

/* ==== 10. cuBLAS GEMM ===================================================== */

static size_t esize(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }
static void put(std::vector<unsigned char> &buf, cudaDataType_t t, size_t i, float v) {
    if (t == CUDA_R_32F) memcpy(&buf[4 * i], &v, 4);
    else {
        unsigned short b = t == CUDA_R_16F ? __half_as_ushort(__float2half(v)) : __bfloat16_as_ushort(__float2bfloat16(v));
        memcpy(&buf[2 * i], &b, 2);
    }
}
static float get(const std::vector<unsigned char> &buf, cudaDataType_t t, size_t i) {
    if (t == CUDA_R_32F) {
        float v;
        memcpy(&v, &buf[4 * i], 4);
        return v;
    }
    unsigned short b;
    memcpy(&b, &buf[2 * i], 2);
    return t == CUDA_R_16F ? __half2float(__ushort_as_half(b)) : __bfloat162float(__ushort_as_bfloat16(b));
}
static float tf32(float x) { /* nearest, ties away: cvt.rna.tf32.f32 */
    unsigned u = f2u(x);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
    return u2f(u);
}

struct GemmCase {
    cublasOperation_t ta, tb;
    int m, n, k, batch;
    float alpha, beta;
    cudaDataType_t ab, c;
    cublasComputeType_t compute;
    bool tf32_math; /* handle in CUBLAS_TF32_TENSOR_OP_MATH */
};

/* Runs one case on device buffers with padded leading dimensions and loose
 * batch strides, and compares with an fp64 reference, including that the
 * padding of C was not touched. */
static void run_gemm_case(cublasHandle_t h, const GemmCase &g) {
    bool ta = g.ta != CUBLAS_OP_N, tb = g.tb != CUBLAS_OP_N;
    int arows = ta ? g.k : g.m, acols = ta ? g.m : g.k, brows = tb ? g.n : g.k, bcols = tb ? g.k : g.n;
    int lda = arows + 3, ldb = brows + 1, ldc = g.m + 2;
    long long sa = (long long)lda * acols + 5, sb = (long long)ldb * bcols + 7, scs = (long long)ldc * g.n + 3;
    size_t na = (size_t)sa * g.batch, nb = (size_t)sb * g.batch, nc = (size_t)scs * g.batch;
    std::vector<unsigned char> A(na * esize(g.ab)), B(nb * esize(g.ab)), C(nc * esize(g.c));
    for (size_t i = 0; i < na; i++) put(A, g.ab, i, g.alpha == 0 ? NAN : frand());
    for (size_t i = 0; i < nb; i++) put(B, g.ab, i, g.alpha == 0 ? NAN : frand());
    for (size_t i = 0; i < nc; i++) put(C, g.c, i, g.beta == 0 ? NAN : frand()); /* beta 0: C must not be read */
    void *dA = dev_alloc<unsigned char>(A.size()), *dB = dev_alloc<unsigned char>(B.size()),
         *dC = dev_alloc<unsigned char>(C.size());
    CK_CUDA(cudaMemcpy(dA, A.data(), A.size(), cudaMemcpyHostToDevice));
    CK_CUDA(cudaMemcpy(dB, B.data(), B.size(), cudaMemcpyHostToDevice));
    CK_CUDA(cudaMemcpy(dC, C.data(), C.size(), cudaMemcpyHostToDevice));
    ck_assert_int_eq(cublasSetMathMode(h, g.tf32_math ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH),
                     CUBLAS_STATUS_SUCCESS);
    cublasStatus_t st;
    if (g.batch == 1 && g.ab == CUDA_R_32F && g.c == CUDA_R_32F && g.compute == CUBLAS_COMPUTE_32F && g.k % 2)
        st = cublasSgemm(h, g.ta, g.tb, g.m, g.n, g.k, &g.alpha, (const float *)dA, lda, (const float *)dB, ldb,
                         &g.beta, (float *)dC, ldc);
    else if (g.batch == 1)
        st = cublasGemmEx(h, g.ta, g.tb, g.m, g.n, g.k, &g.alpha, dA, g.ab, lda, dB, g.ab, ldb, &g.beta, dC, g.c, ldc,
                          g.compute, CUBLAS_GEMM_DEFAULT);
    else
        st = cublasGemmStridedBatchedEx(h, g.ta, g.tb, g.m, g.n, g.k, &g.alpha, dA, g.ab, lda, sa, dB, g.ab, ldb, sb,
                                        &g.beta, dC, g.c, ldc, scs, g.batch, g.compute, CUBLAS_GEMM_DEFAULT_TENSOR_OP);
    ck_assert_msg(st == CUBLAS_STATUS_SUCCESS, "gemm -> %s (%s)", cublasGetStatusName(st), cudasim_last_message());
    std::vector<unsigned char> R(C.size());
    CK_CUDA(cudaMemcpy(R.data(), dC, R.size(), cudaMemcpyDeviceToHost));
    bool tf = g.compute == CUBLAS_COMPUTE_32F_FAST_TF32 || (g.tf32_math && g.ab == CUDA_R_32F);
    double eps_out = g.c == CUDA_R_32F ? std::ldexp(1.0, -23) : g.c == CUDA_R_16F ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
    for (int b = 0; b < g.batch; b++) {
        for (long long ci = 0; ci < scs; ci++) {
            size_t at = (size_t)(b * scs + ci);
            int i = (int)(ci % ldc), j = (int)(ci / ldc);
            if (i >= g.m || j >= g.n) { /* padding and gaps between batches: untouched */
                EXPECT(f2u(get(R, g.c, at)) == f2u(get(C, g.c, at)) ||
                           (std::isnan(get(R, g.c, at)) && std::isnan(get(C, g.c, at))),
                       "C padding at %zu was written", at);
                continue;
            }
            double acc = 0, mag = 0;
            if (g.alpha != 0)
                for (int p = 0; p < g.k; p++) {
                    double a = get(A, g.ab, (size_t)(b * sa) + (ta ? p + (size_t)i * lda : i + (size_t)p * lda));
                    double bb = get(B, g.ab, (size_t)(b * sb) + (tb ? j + (size_t)p * ldb : p + (size_t)j * ldb));
                    if (tf) {
                        a = tf32((float)a);
                        bb = tf32((float)bb);
                    }
                    acc += a * bb;
                    mag += std::fabs(a * bb);
                }
            double cold = g.beta != 0 ? get(C, g.c, at) : 0.0;
            double ref = g.alpha * acc + g.beta * cold;
            double got = get(R, g.c, at);
            double tol = 2.0 * (g.k + 2) * std::ldexp(1.0, -24) * (std::fabs(g.alpha) * mag + std::fabs(g.beta * cold)) +
                         eps_out * std::fabs(ref) + 1e-30;
            EXPECT(std::fabs(got - ref) <= tol,
                          "gemm ta=%d tb=%d m=%d n=%d k=%d batch=%d alpha=%g beta=%g ab=%d c=%d compute=%d: "
                          "C[%d](%d,%d) = %.9g, expected %.9g (tol %.3g)",
                          g.ta, g.tb, g.m, g.n, g.k, g.batch, g.alpha, g.beta, g.ab, g.c, g.compute, b, i, j, got, ref,
                          tol);
        }
    }
    CK_CUDA(cudaFree(dA));
    CK_CUDA(cudaFree(dB));
    CK_CUDA(cudaFree(dC));
}

START_TEST(test_gemm_semantics) {
    cublasHandle_t h;
    ck_assert_int_eq(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
    cudaStream_t s;
    CK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    ck_assert_int_eq(cublasSetStream(h, s), CUBLAS_STATUS_SUCCESS);
    struct Types { cudaDataType_t ab, c; };
    const Types types[] = {{CUDA_R_32F, CUDA_R_32F}, {CUDA_R_16F, CUDA_R_16F}, {CUDA_R_16F, CUDA_R_32F},
                           {CUDA_R_16BF, CUDA_R_16BF}, {CUDA_R_16BF, CUDA_R_32F}};
    const cublasOperation_t ops[] = {CUBLAS_OP_N, CUBLAS_OP_T};
    struct AB { float alpha, beta; };
    const AB abs_[] = {{1.0f, 0.0f}, {0.5f, -1.5f}, {0.0f, 2.0f}};
    struct Dims { int m, n, k; };
    const Dims dims[] = {{7, 5, 9}, {33, 17, 64}, {1, 1, 1}, {4, 3, 0}};
    int cases = 0;
    for (const Types &t : types)
        for (cublasOperation_t ta : ops)
            for (cublasOperation_t tb : ops)
                for (const AB &ab : abs_)
                    for (const Dims &d : dims)
                        for (int batch : {1, 3}) {
                            run_gemm_case(h, GemmCase{ta, tb, d.m, d.n, d.k, batch, ab.alpha, ab.beta, t.ab, t.c,
                                                      CUBLAS_COMPUTE_32F, false});
                            cases++;
                        }
    /* TF32: the compute type, or the handle's math mode with fp32 data */
    for (cublasOperation_t ta : ops) {
        run_gemm_case(h, GemmCase{ta, CUBLAS_OP_N, 19, 11, 40, 2, 1.0f, 0.5f, CUDA_R_32F, CUDA_R_32F,
                                  CUBLAS_COMPUTE_32F_FAST_TF32, false});
        run_gemm_case(h, GemmCase{ta, CUBLAS_OP_T, 19, 11, 40, 1, 1.0f, 0.0f, CUDA_R_32F, CUDA_R_32F,
                                  CUBLAS_COMPUTE_32F, true});
        run_gemm_case(h, GemmCase{ta, CUBLAS_OP_T, 9, 4, 16, 1, 2.0f, 0.0f, CUDA_R_16BF, CUDA_R_16BF,
                                  CUBLAS_COMPUTE_32F, true}); /* TF32 mode does not affect 16-bit inputs */
        cases += 3;
    }
    ck_assert_int_gt(cases, 400);

    /* TF32 really loses bits: 1 + 2^-12 squared */
    {
        float one = 1.0f + std::ldexp(1.0f, -12), zero = 0.0f, alpha = 1.0f;
        float *dx = dev_alloc<float>(1), *dy = dev_alloc<float>(1);
        CK_CUDA(cudaMemcpy(dx, &one, 4, cudaMemcpyHostToDevice));
        ck_assert_int_eq(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &alpha, dx, CUDA_R_32F, 1, dx, CUDA_R_32F,
                                      1, &zero, dy, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT),
                         CUBLAS_STATUS_SUCCESS);
        ck_assert(from_dev(dy, 1)[0] == 1.0f);
        ck_assert_int_eq(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &alpha, dx, CUDA_R_32F, 1, dx, CUDA_R_32F,
                                      1, &zero, dy, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
                         CUBLAS_STATUS_SUCCESS);
        ck_assert(from_dev(dy, 1)[0] == one * one);
        CK_CUDA(cudaFree(dx));
        CK_CUDA(cudaFree(dy));
    }

    /* argument validation */
    float alpha = 1.0f, beta = 0.0f;
    float *dA = dev_alloc<float>(256), *dB = dev_alloc<float>(256), *dC = dev_alloc<float>(256);
    auto gemm = [&](cublasHandle_t hh, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, int lda,
                    int ldb, int ldc, cudaDataType_t at, cudaDataType_t bt, cudaDataType_t ct,
                    cublasComputeType_t comp, const void *A = nullptr) {
        return cublasGemmEx(hh, ta, tb, m, n, k, &alpha, A ? A : dA, at, lda, dB, bt, ldb, &beta, dC, ct, ldc, comp,
                            CUBLAS_GEMM_DEFAULT);
    };
    const cudaDataType_t F = CUDA_R_32F, H = CUDA_R_16F, BF = CUDA_R_16BF;
    const cublasComputeType_t C32 = CUBLAS_COMPUTE_32F;
    const cublasOperation_t N = CUBLAS_OP_N, T = CUBLAS_OP_T;
    ck_assert_int_eq(gemm(h, N, N, 4, 4, 4, 4, 4, 4, F, F, F, C32), CUBLAS_STATUS_SUCCESS);
    ck_assert_int_eq(gemm(h, N, N, 4, 4, 4, 3, 4, 4, F, F, F, C32), CUBLAS_STATUS_INVALID_VALUE); /* lda < m */
    ck_assert_int_eq(gemm(h, T, N, 8, 2, 4, 4, 4, 8, F, F, F, C32), CUBLAS_STATUS_SUCCESS);       /* lda >= k */
    ck_assert_int_eq(gemm(h, T, N, 8, 2, 4, 3, 4, 8, F, F, F, C32), CUBLAS_STATUS_INVALID_VALUE); /* lda < k */
    ck_assert_int_eq(gemm(h, N, N, 4, 4, 5, 4, 4, 4, F, F, F, C32), CUBLAS_STATUS_INVALID_VALUE); /* ldb < k */
    ck_assert_int_eq(gemm(h, N, T, 4, 5, 4, 4, 4, 4, F, F, F, C32), CUBLAS_STATUS_INVALID_VALUE); /* ldb < n */
    ck_assert_int_eq(gemm(h, N, N, 4, 4, 4, 4, 4, 3, F, F, F, C32), CUBLAS_STATUS_INVALID_VALUE); /* ldc < m */
    ck_assert_int_eq(gemm(h, N, N, -1, 4, 4, 4, 4, 4, F, F, F, C32), CUBLAS_STATUS_INVALID_VALUE);
    ck_assert_int_eq(gemm(h, N, N, 0, 4, 4, 1, 4, 1, F, F, F, C32), CUBLAS_STATUS_SUCCESS); /* max(1, 0) */
    ck_assert_int_eq(gemm(h, N, N, 0, 4, 4, 0, 4, 1, F, F, F, C32), CUBLAS_STATUS_INVALID_VALUE);
    ck_assert_int_eq(gemm(h, (cublasOperation_t)3, N, 4, 4, 4, 4, 4, 4, F, F, F, C32), CUBLAS_STATUS_INVALID_VALUE);
    ck_assert_int_eq(gemm(h, N, N, 4, 4, 4, 4, 4, 4, H, BF, F, C32), CUBLAS_STATUS_NOT_SUPPORTED);
    ck_assert_int_eq(gemm(h, N, N, 4, 4, 4, 4, 4, 4, BF, BF, H, C32), CUBLAS_STATUS_NOT_SUPPORTED);
    ck_assert_int_eq(gemm(h, N, N, 4, 4, 4, 4, 4, 4, F, F, H, C32), CUBLAS_STATUS_NOT_SUPPORTED);
    ck_assert_int_eq(gemm(h, N, N, 4, 4, 4, 4, 4, 4, F, F, F, CUBLAS_COMPUTE_64F), CUBLAS_STATUS_NOT_SUPPORTED);
    ck_assert_int_eq(gemm(h, N, N, 4, 4, 4, 4, 4, 4, H, H, H, CUBLAS_COMPUTE_32F_FAST_TF32),
                     CUBLAS_STATUS_NOT_SUPPORTED);
    ck_assert_int_eq(gemm(nullptr, N, N, 4, 4, 4, 4, 4, 4, F, F, F, C32), CUBLAS_STATUS_NOT_INITIALIZED);
    /* A in host memory, or running past its allocation: an illegal address on a GPU */
    std::vector<float> host_a(16, 1.0f);
    ck_assert_int_eq(gemm(h, N, N, 4, 4, 4, 4, 4, 4, F, F, F, C32, host_a.data()), CUBLAS_STATUS_EXECUTION_FAILED);
    ck_assert_ptr_nonnull(strstr(cudasim_last_message(), "not device memory"));
    ck_assert_int_eq(cudaGetLastError(), cudaErrorIllegalAddress);
    ck_assert_int_eq(gemm(h, N, N, 4, 4, 4, 4, 4, 4, F, F, F, C32, dA + 250), CUBLAS_STATUS_EXECUTION_FAILED);
    ck_assert_int_eq(cudaGetLastError(), cudaErrorIllegalAddress);
    CK_CUDA(cudaFree(dA));
    CK_CUDA(cudaFree(dB));
    CK_CUDA(cudaFree(dC));
    ck_assert_str_eq(cublasGetStatusName(CUBLAS_STATUS_INVALID_VALUE), "CUBLAS_STATUS_INVALID_VALUE");
    ck_assert_ptr_nonnull(cublasGetStatusString(CUBLAS_STATUS_NOT_SUPPORTED));
    ck_assert_int_eq(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
    ck_assert_int_eq(cublasDestroy(h), CUBLAS_STATUS_NOT_INITIALIZED);
    CK_CUDA(cudaStreamDestroy(s));
}
END_TEST

/* ==== 11. runtime ========================================================= */

#ifdef CUDASIM_ASAN
extern "C" int __asan_address_is_poisoned(void const volatile *addr);
/* Counts into bad the dynamic shared bytes below size that are poisoned and
 * those at size (the first past it) that are not. */
__global__ void smem_bounds(int *bad, int size) {
    CPAR_DYN_SMEM(unsigned char, s);
    if (threadIdx.x == 0) {
        for (int i = 0; i < size; i++) *bad += __asan_address_is_poisoned(s + i);
        *bad += !__asan_address_is_poisoned(s + size) + !__asan_address_is_poisoned(s + 1000);
    }
}
#endif
__global__ void write_past_end(unsigned char *p, int n) {
    if (threadIdx.x == 0) p[n] = 1; /* one byte past a cudaMalloc(n) */
}

START_TEST(test_runtime_memory) {
    /* fresh memory: 256-aligned and poisoned */
    for (size_t bytes : {1ul, 100ul, 4096ul, 1000003ul}) {
        unsigned char *p = nullptr;
        CK_CUDA(cudaMalloc(&p, bytes));
        ck_assert_uint_eq((uintptr_t)p % 256, 0);
        std::vector<unsigned char> h = from_dev(p, bytes);
        for (unsigned char c : h) EXPECT_EQ(c, 0xFF);
        CK_CUDA(cudaFree(p));
    }
    void *z = (void *)1;
    CK_CUDA(cudaMalloc(&z, 0));
    ck_assert_ptr_null(z);
    CK_CUDA(cudaFree(nullptr));

    int *d = dev_alloc<int>(64);
    std::vector<int> h(65, 5);
    ck_assert_int_eq(cudaMemcpy(d, h.data(), 65 * 4, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    ck_assert_ptr_nonnull(strstr(cudasim_last_message(), "past the end"));
    ck_assert_int_eq(cudaGetLastError(), cudaErrorInvalidValue);
    ck_assert_int_eq(cudaMemcpy(h.data(), h.data() + 1, 4, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    ck_assert_ptr_nonnull(strstr(cudasim_last_message(), "not device memory"));
    ck_assert_int_eq(cudaMemcpy(d + 1, d, 63 * 4, cudaMemcpyDeviceToDevice), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(d, h.data(), 4, (cudaMemcpyKind)7), cudaErrorInvalidMemcpyDirection);
    ck_assert_int_eq(cudaMemset(d + 60, 0, 5 * 4), cudaErrorInvalidValue);
    ck_assert_int_eq(cudaMemcpy(h.data(), d, 64 * 4, cudaMemcpyDefault), cudaSuccess);
    ck_assert_int_eq(cudaFree(d + 1), cudaErrorInvalidValue);
    ck_assert_ptr_nonnull(strstr(cudasim_last_message(), "inside an allocation"));
    CK_CUDA(cudaFree(d));
    ck_assert_int_eq(cudaFree(d), cudaErrorInvalidValue); /* double free */
    cudaGetLastError();

    /* pitched copies: a 3 x 5-byte block between pitches 8 and 16 */
    unsigned char *p2 = dev_alloc<unsigned char>(48);
    std::vector<unsigned char> src(24), back(48, 0);
    for (int i = 0; i < 24; i++) src[i] = (unsigned char)i;
    CK_CUDA(cudaMemset(p2, 0, 48));
    CK_CUDA(cudaMemcpy2DAsync(p2, 16, src.data(), 8, 5, 3, cudaMemcpyHostToDevice, 0));
    CK_CUDA(cudaMemcpy(back.data(), p2, 48, cudaMemcpyDeviceToHost));
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 16; c++) EXPECT_EQ(back[16 * r + c], c < 5 ? src[8 * r + c] : 0);
    ck_assert_int_eq(cudaMemcpy2DAsync(p2, 4, src.data(), 8, 5, 3, cudaMemcpyHostToDevice, 0),
                     cudaErrorInvalidPitchValue);
    ck_assert_int_eq(cudaMemcpy2DAsync(p2, 16, src.data(), 8, 5, 4, cudaMemcpyHostToDevice, 0),
                     cudaErrorInvalidValue); /* 4th row past the end */
    cudaGetLastError();
    CK_CUDA(cudaFree(p2));

    unsigned char *q = dev_alloc<unsigned char>(100);
#ifndef CUDASIM_ASAN
    /* out-of-bounds kernel writes land in guard bytes and are reported */
    CPAR_LAUNCH(write_past_end, 1, 32, 0, 0)(q, 100);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert_int_eq(cudasim_check_memory(), 1);
    ck_assert_ptr_nonnull(strstr(cudasim_last_message(), "past its end"));
    ck_assert_int_eq(cudaFree(q), cudaErrorIllegalAddress);
    ck_assert_int_eq(cudaGetLastError(), cudaErrorIllegalAddress);
#else
    /* under AddressSanitizer the guard bytes are poisoned, so such a write
     * (or read) is reported where it happens; the guard checks read them
     * unpoisoned and poison them again */
    (void)write_past_end;
    for (int pass = 0; pass < 2; pass++) {
        ck_assert(!__asan_address_is_poisoned(q) && !__asan_address_is_poisoned(q + 99));
        ck_assert(__asan_address_is_poisoned(q - 1) && __asan_address_is_poisoned(q - 256));
        ck_assert(__asan_address_is_poisoned(q + 100) && __asan_address_is_poisoned(q + 511));
        ck_assert_int_eq(cudasim_check_memory(), 0);
    }
    CK_CUDA(cudaFree(q));
    /* and the shared memory past a launch's dynamic size */
    int *bad = dev_alloc<int>(1);
    CK_CUDA(cudaMemset(bad, 0, 4));
    CPAR_LAUNCH(smem_bounds, 1, 32, 100, 0)(bad, 100);
    CK_LAUNCHED(kSchedules[0]);
    ck_assert_int_eq(from_dev(bad, 1)[0], 0);
    CK_CUDA(cudaFree(bad));
#endif
    ck_assert_int_eq(cudasim_check_memory(), 0);

    /* pinned host memory and the memory limit */
    float *pinned = nullptr;
    CK_CUDA(cudaMallocHost(&pinned, 64));
    ck_assert_int_eq(cudaFree(pinned), cudaErrorInvalidValue);
    CK_CUDA(cudaFreeHost(pinned));
    cudaGetLastError();
    size_t before = cudasim_bytes_in_use(-1);
    cudasim_set_memory_limit(1 << 20);
    void *big = nullptr, *ok = nullptr;
    ck_assert_int_eq(cudaMalloc(&big, 2 << 20), cudaErrorMemoryAllocation);
    ck_assert_ptr_null(big);
    ck_assert_int_eq(cudaGetLastError(), cudaErrorMemoryAllocation);
    CK_CUDA(cudaMalloc(&ok, 1000));
    size_t fr = 0, tot = 0;
    CK_CUDA(cudaMemGetInfo(&fr, &tot));
    ck_assert_uint_eq(tot, 1 << 20);
    ck_assert_uint_le(fr, (1 << 20) - 1000);
    ck_assert_uint_eq(cudasim_bytes_in_use(-1), before + 1000);
    CK_CUDA(cudaFree(ok));
    cudasim_set_memory_limit(0);
}
END_TEST

START_TEST(test_runtime_devices_streams_events) {
    int n = 0;
    cudasim_set_device_count(8);
    CK_CUDA(cudaGetDeviceCount(&n));
    ck_assert_int_eq(n, 8);
    CK_CUDA(cudaSetDevice(3));
    int dev = -1;
    CK_CUDA(cudaGetDevice(&dev));
    ck_assert_int_eq(dev, 3);
    ck_assert_int_eq(cudaSetDevice(8), cudaErrorInvalidDevice);
    ck_assert_int_eq(cudaGetLastError(), cudaErrorInvalidDevice);
    int sms = 0;
    CK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    ck_assert_int_gt(sms, 0);
    cudasim_set_device_count(0); /* "no GPU": an error, never a crash */
    ck_assert_int_eq(cudaGetDeviceCount(&n), cudaErrorNoDevice);
    ck_assert_int_eq(n, 0);
    void *p = (void *)1;
    ck_assert_int_eq(cudaMalloc(&p, 16), cudaErrorNoDevice);
    cudaGetLastError();
    cudasim_set_device_count(8);
    CK_CUDA(cudaSetDevice(0));

    cudaStream_t s1, s2;
    CK_CUDA(cudaStreamCreate(&s1));
    CK_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t e0, e1, e2;
    CK_CUDA(cudaEventCreate(&e0));
    CK_CUDA(cudaEventCreate(&e1));
    CK_CUDA(cudaEventCreateWithFlags(&e2, cudaEventDisableTiming));
    float ms = -1;
    ck_assert_int_eq(cudaEventElapsedTime(&ms, e0, e1), cudaErrorInvalidResourceHandle); /* never recorded */
    ck_assert_int_eq(cudaGetLastError(), cudaErrorInvalidResourceHandle);
    CK_CUDA(cudaEventRecord(e0, s1));
    int *d = dev_alloc<int>(1024);
    std::vector<int> h(1024, 9), r(1024, 0);
    CK_CUDA(cudaMemcpyAsync(d, h.data(), 4096, cudaMemcpyHostToDevice, s1));
    CK_CUDA(cudaEventRecord(e2, s1));
    CK_CUDA(cudaStreamWaitEvent(s2, e2, 0));
    CPAR_LAUNCH(fill_kernel, 4, 256, 0, s2)(d, 11);
    CK_CUDA(cudaGetLastError());
    CK_CUDA(cudaMemsetAsync(d, 0, 4, s2));
    CK_CUDA(cudaMemcpyAsync(r.data(), d, 4096, cudaMemcpyDeviceToHost, s2));
    CK_CUDA(cudaEventRecord(e1, s2));
    CK_CUDA(cudaStreamSynchronize(s2));
    CK_CUDA(cudaEventSynchronize(e1));
    ck_assert_int_eq(cudaEventQuery(e1), cudaSuccess);
    ck_assert_int_eq(cudaStreamQuery(s1), cudaSuccess);
    ck_assert_int_eq(r[0], 0);
    for (int i = 1; i < 1024; i++) EXPECT_EQ(r[i], 11);
    CK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    ck_assert(ms >= 0.0f);
    ck_assert_int_eq(cudaEventElapsedTime(&ms, e0, e2), cudaErrorInvalidResourceHandle); /* timing disabled */
    CK_CUDA(cudaDeviceSynchronize());
    CK_CUDA(cudaEventDestroy(e0));
    CK_CUDA(cudaEventDestroy(e1));
    CK_CUDA(cudaEventDestroy(e2));
    ck_assert_int_eq(cudaEventDestroy(e2), cudaErrorInvalidResourceHandle);
    CK_CUDA(cudaStreamDestroy(s1));
    CK_CUDA(cudaStreamDestroy(s2));
    ck_assert_int_eq(cudaMemcpyAsync(d, h.data(), 4, cudaMemcpyHostToDevice, s1), cudaErrorInvalidResourceHandle);
    ck_assert_int_eq(cudaStreamSynchronize(s2), cudaErrorInvalidResourceHandle);
    cudaGetLastError();
    CK_CUDA(cudaMemcpyAsync(d, h.data(), 4, cudaMemcpyHostToDevice, cudaStreamPerThread));
    CK_CUDA(cudaFree(d));

    ck_assert_str_eq(cudaGetErrorName(cudaErrorLaunchFailure), "cudaErrorLaunchFailure");
    ck_assert_str_eq(cudaGetErrorString(cudaSuccess), "no error");
    ck_assert_str_eq(cudaGetErrorString(cudaErrorInvalidConfiguration), "invalid configuration argument");
    ck_assert_str_eq(cudaGetErrorString(cudaErrorMemoryAllocation), "out of memory");
}
END_TEST

/* ==== 12. host threads, schedules, timing ================================= */

#if defined(__SANITIZE_THREAD__)
static const int kRankIters = 8; /* a fiber switch costs ~2 us under TSan */
#else
static const int kRankIters = 40;
#endif

/* Two host threads (two simulated ranks) launch at the same time, each with
 * its own schedule, device and data; results must not mix. */
static void rank_worker(int rank, std::atomic<int> *go, std::atomic<int> *errors, std::string *why) {
    auto bad = [&](const char *what) {
        if (errors->fetch_add(1) == 0) *why = std::string("rank ") + std::to_string(rank) + ": " + what + " (" +
                                              cudasim_last_message() + ")";
    };
    cudasim_set_schedule(rank == 0 ? CUDASIM_SCHED_FORWARD : CUDASIM_SCHED_SHUFFLE, 100 + rank);
    if (cudaSetDevice(rank) != cudaSuccess) return bad("cudaSetDevice");
    const unsigned B = 256, nb = 6, n = B * nb;
    float *in = nullptr, *out = nullptr, *sums = nullptr;
    if (cudaMalloc(&in, n * 4) || cudaMalloc(&out, n * 4) || cudaMalloc(&sums, nb * 4)) return bad("cudaMalloc");
    go->fetch_add(1);
    while (go->load() < 2) std::this_thread::yield();
    for (int it = 0; it < kRankIters; it++) {
        std::vector<float> h(n);
        for (unsigned i = 0; i < n; i++) h[i] = (float)((int)((i * (rank + 3) + it) % 53) - 26);
        cudaMemcpy(in, h.data(), n * 4, cudaMemcpyHostToDevice);
        cudaMemset(out, 0xFF, n * 4);
        CPAR_LAUNCH(reverse_static, nb, B, 0, 0)(in, out);
        CPAR_LAUNCH(block_sum_shfl, nb, B, 0, 0)(in, sums);
        if (cudaGetLastError() != cudaSuccess) return bad("launch");
        std::vector<float> r(n), s(nb);
        cudaMemcpy(r.data(), out, n * 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(s.data(), sums, nb * 4, cudaMemcpyDeviceToHost);
        for (unsigned i = 0; i < n; i++)
            if (r[i] != h[i / B * B + B - 1 - i % B]) return bad("reverse result");
        for (unsigned b = 0; b < nb; b++) {
            double ref = 0;
            for (unsigned i = 0; i < B; i++) ref += h[b * B + i];
            if (s[b] != ref) return bad("sum result");
        }
        if (rank == 1 && it % 10 == 0) { /* this rank's failures stay on this rank */
            CPAR_LAUNCH(early_return_barrier, 1, 64, 0, 0)((int *)out, 3);
            if (cudaGetLastError() != cudaErrorLaunchFailure) return bad("expected a launch failure");
        }
    }
    int dev = -1;
    cudaGetDevice(&dev);
    if (dev != rank) bad("device changed");
    if (cudaGetLastError() != cudaSuccess) bad("stray error");
    cudaFree(in);
    cudaFree(out);
    cudaFree(sums);
}

START_TEST(test_two_host_threads) {
    std::atomic<int> go{0}, errors{0};
    std::string why0, why1;
    std::thread t0(rank_worker, 0, &go, &errors, &why0), t1(rank_worker, 1, &go, &errors, &why1);
    t0.join();
    t1.join();
    ck_assert_msg(errors.load() == 0, "%s%s", why0.c_str(), why1.c_str());
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess); /* the main thread saw none of it */
}
END_TEST

#ifndef CUDASIM_ASAN
/* The guard page below every fiber stack, in a pool that a finished host
 * thread left to the next one (tests/cudasim.h's stack cache): a kernel
 * thread that overflows its stack faults (SIGSEGV) instead of writing into
 * its neighbour's. Not under AddressSanitizer, which reports the overflow
 * itself and exits. */
__device__ int stack_eater(int n) { /* a 1 KiB frame per level; the sum keeps it from being a loop */
    volatile char buf[1024];
    buf[n % 1024] = (char)n;
    return n ? stack_eater(n - 1) + buf[n % 1024] : 0;
}
__global__ void stack_address(uintptr_t *out) {
    volatile char c = 0;
    out[threadIdx.x] = (uintptr_t)&c + (uintptr_t)c;
}
/* about 100 KiB: past the 64 KiB stack and its guard page, and not past the
 * stack below (so without the guard page it would not fault at all) */
__global__ void stack_overflow(int *out) { out[threadIdx.x] = stack_eater(96); }

START_TEST(test_stack_guard_on_reused_pool) {
    uintptr_t *addr = dev_alloc<uintptr_t>(1);
    int *out = dev_alloc<int>(1);
    uintptr_t first = 0, second = 0;
    std::thread t0([&] { /* its stacks go to the cache when it ends */
        CPAR_LAUNCH(stack_address, 1, 1, 0, 0)(addr);
        cudaMemcpy(&first, addr, sizeof first, cudaMemcpyDeviceToHost);
    });
    t0.join();
    std::thread t1([&] {
        CPAR_LAUNCH(stack_address, 1, 1, 0, 0)(addr);
        cudaMemcpy(&second, addr, sizeof second, cudaMemcpyDeviceToHost);
        if (second == first && first != 0) CPAR_LAUNCH(stack_overflow, 1, 1, 0, 0)(out); /* faults here */
    });
    t1.join();
    ck_abort_msg(second == first ? "the stack overflow did not fault (stack at %p)"
                                 : "the second host thread got a new stack pool (%p, then %p)",
                 (void *)first, (void *)second);
}
END_TEST
#endif

/* order[t] = the position at which thread t ran its first instruction;
 * blocks[b] = the position at which block b started. */
__global__ void order_probe(unsigned *order, unsigned *blocks, unsigned *counter) {
    order[blockIdx.x * blockDim.x + threadIdx.x] = atomicAdd(&counter[0], 1u);
    if (threadIdx.x == 0) blocks[blockIdx.x] = atomicAdd(&counter[1], 1u);
}

static std::vector<unsigned> probe_order(std::vector<unsigned> *blocks_out) {
    const unsigned B = 64, nb = 8;
    unsigned *order = dev_alloc<unsigned>(B * nb), *blocks = dev_alloc<unsigned>(nb), *cnt = dev_alloc<unsigned>(2);
    CK_CUDA(cudaMemset(cnt, 0, 8));
    CPAR_LAUNCH(order_probe, nb, B, 0, 0)(order, blocks, cnt);
    CK_CUDA(cudaGetLastError());
    std::vector<unsigned> o = from_dev(order, B * nb);
    if (blocks_out) *blocks_out = from_dev(blocks, nb);
    CK_CUDA(cudaFree(order));
    CK_CUDA(cudaFree(blocks));
    CK_CUDA(cudaFree(cnt));
    return o;
}

static void read_env_schedule(const char *value, cudasim_schedule *s, unsigned long long *seed) {
    setenv("CUDASIM_SCHEDULE", value, 1);
    std::thread t([&] { *s = cudasim_get_schedule(seed); }); /* a new host thread reads the variable */
    t.join();
    unsetenv("CUDASIM_SCHEDULE");
}

START_TEST(test_schedules) {
    std::vector<unsigned> blocks;
    cudasim_set_schedule(CUDASIM_SCHED_FORWARD, 0);
    std::vector<unsigned> f = probe_order(&blocks);
    for (unsigned i = 0; i < f.size(); i++) EXPECT_EQ(f[i], i);
    for (unsigned b = 0; b < blocks.size(); b++) EXPECT_EQ(blocks[b], b);
    cudasim_set_schedule(CUDASIM_SCHED_REVERSE, 0);
    std::vector<unsigned> r = probe_order(&blocks);
    for (unsigned i = 0; i < r.size(); i++) EXPECT_EQ(r[i], r.size() - 1 - i);
    for (unsigned b = 0; b < blocks.size(); b++) EXPECT_EQ(blocks[b], blocks.size() - 1 - b);
    cudasim_set_schedule(CUDASIM_SCHED_SHUFFLE, 7);
    std::vector<unsigned> s7 = probe_order(nullptr);
    cudasim_set_schedule(CUDASIM_SCHED_SHUFFLE, 7);
    ck_assert(probe_order(nullptr) == s7); /* same seed, same order */
    cudasim_set_schedule(CUDASIM_SCHED_SHUFFLE, 8);
    ck_assert(probe_order(nullptr) != s7);
    ck_assert(s7 != f && s7 != r);
    std::vector<unsigned> sorted = s7;
    std::sort(sorted.begin(), sorted.end());
    for (unsigned i = 0; i < sorted.size(); i++) EXPECT_EQ(sorted[i], i);

    cudasim_schedule s;
    unsigned long long seed = 0;
    read_env_schedule("reverse", &s, &seed);
    ck_assert_int_eq(s, CUDASIM_SCHED_REVERSE);
    read_env_schedule("shuffle:42", &s, &seed);
    ck_assert_int_eq(s, CUDASIM_SCHED_SHUFFLE);
    ck_assert_uint_eq(seed, 42);
    read_env_schedule("shuffle", &s, &seed);
    ck_assert_int_eq(s, CUDASIM_SCHED_SHUFFLE);
    {   /* ignored, with a one-line warning on stderr (kept out of the test log) */
        fflush(stderr);
        int saved = dup(2), devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 2);
        read_env_schedule("sideways", &s, &seed);
        dup2(saved, 2);
        close(devnull);
        close(saved);
    }
    ck_assert_int_eq(s, CUDASIM_SCHED_FORWARD);
    ck_assert_str_eq(cudasim_schedule_name(CUDASIM_SCHED_REVERSE), "reverse");
    read_env_schedule("warps", &s, &seed);
    ck_assert_int_eq(s, CUDASIM_SCHED_WARPS);
    ck_assert_str_eq(cudasim_schedule_name(CUDASIM_SCHED_WARPS), "warps");
    cudasim_set_schedule(CUDASIM_SCHED_WARPS, 0); /* no switch before the probe's write: forward's order */
    std::vector<unsigned> w = probe_order(&blocks);
    for (unsigned i = 0; i < w.size(); i++) EXPECT_EQ(w[i], i);
    for (unsigned b = 0; b < blocks.size(); b++) EXPECT_EQ(blocks[b], b);
}
END_TEST

/* Many barriers, no work: measures the cost of a fiber switch. */
__global__ void barrier_storm(int iters, int *out) {
    int acc = 0;
    for (int i = 0; i < iters; i++) {
        acc += (int)threadIdx.x;
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = acc;
}
/* Many shuffles. */
__global__ void shuffle_storm(int iters, float *out) {
    float v = (float)threadIdx.x;
    for (int i = 0; i < iters; i++) v = __shfl_xor_sync(0xffffffffu, v, i & 31) + 1.0f;
    out[threadIdx.x] = v;
}

START_TEST(test_timing_report) {
    cudasim_set_schedule(CUDASIM_SCHED_FORWARD, 0);
    int *o = dev_alloc<int>(1);
    float *of = dev_alloc<float>(256);
    /* warm up (stacks mapped) and size the runs to ~0.25 s each, so that
     * sanitizer builds (~100x slower switches) stay quick */
    auto w0 = std::chrono::steady_clock::now();
    CPAR_LAUNCH(barrier_storm, 1, 256, 0, 0)(50, o);
    double per_iter = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count() / 50;
    int iters = (int)std::min(2000.0, std::max(10.0, 0.25 / 4 / (per_iter + 1e-9)));
    unsigned long long s0 = cudasim_switch_count();
    auto t0 = std::chrono::steady_clock::now();
    CPAR_LAUNCH(barrier_storm, 4, 256, 0, 0)(iters, o);
    auto t1 = std::chrono::steady_clock::now();
    unsigned long long s1 = cudasim_switch_count();
    CPAR_LAUNCH(shuffle_storm, 4, 256, 0, 0)(iters, of);
    auto t2 = std::chrono::steady_clock::now();
    unsigned long long s2 = cudasim_switch_count();
    CK_CUDA(cudaGetLastError());
    double a = std::chrono::duration<double>(t1 - t0).count(), b = std::chrono::duration<double>(t2 - t1).count();
    printf("    cudasim timing (not asserted): __syncthreads: %.1f M fiber switches/s (%.1f ns per switch); "
           "__shfl_xor_sync: %.1f M switches/s (%.1f ns per switch, incl. the exchange)\n",
           (s1 - s0) / a / 1e6, a * 1e9 / (s1 - s0), (s2 - s1) / b / 1e6, b * 1e9 / (s2 - s1));
    CK_CUDA(cudaFree(o));
    CK_CUDA(cudaFree(of));
}
END_TEST

/* ---- streams as queues (tests/cudasim.h section 9) -------------------------------- */

__global__ void fill_int(int *p, int n, int v) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v;
}
__global__ void add_one(const int *in, int *out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = in[i] + 1;
}

/* Every element of h equals v? */
static bool all_eq(const std::vector<int> &h, int v) {
    for (int x : h)
        if (x != v) return false;
    return true;
}

/* Sets a stream mode for one test and restores eager (this suite's default) after it. */
struct StreamsMode {
    explicit StreamsMode(cudasim_streams m, unsigned long long seed = 0) { cudasim_set_streams(m, seed); }
    ~StreamsMode() { cudasim_set_streams(CUDASIM_STREAMS_EAGER, 0); }
};

/* Lazy: queued work has not run until something forces it; pinned memory
 * shows the old bytes before the synchronisation; a query answers NotReady
 * once, then the work has run. */
START_TEST(test_streams_lazy_defers) {
    StreamsMode mode(CUDASIM_STREAMS_LAZY);
    const int n = 1000;
    int *d = dev_alloc<int>(n), *pinned = nullptr;
    CK_CUDA(cudaMallocHost(&pinned, n * sizeof(int)));
    for (int i = 0; i < n; i++) pinned[i] = -7;
    cudaStream_t s;
    CK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CPAR_LAUNCH(fill_int, 4, 64, 0, s)(d, n, 42);
    CK_CUDA(cudaGetLastError());
    CK_CUDA(cudaMemcpyAsync(pinned, d, n * sizeof(int), cudaMemcpyDeviceToHost, s));
    std::vector<int> seen(pinned, pinned + n);
    ck_assert_msg(all_eq(seen, -7), "lazy: the queued copy into pinned memory ran before any synchronisation");
    ck_assert_int_eq(cudaStreamQuery(s), cudaErrorNotReady);
    ck_assert_int_eq(cudaGetLastError(), cudaErrorNotReady);
    ck_assert_int_eq(cudaStreamQuery(s), cudaSuccess); /* the query ran it */
    seen.assign(pinned, pinned + n);
    ck_assert_msg(all_eq(seen, 42), "after the stream finished, pinned memory holds %d", seen[0]);
    /* A copy into pageable memory returns once it has landed. */
    CPAR_LAUNCH(fill_int, 4, 64, 0, s)(d, n, 43);
    std::vector<int> h(n, 0);
    CK_CUDA(cudaMemcpyAsync(h.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost, s));
    ck_assert_msg(all_eq(h, 43), "a copy into pageable memory returned before landing");
    /* A kernel fault is the stream's, reported by the synchronisation. */
    CPAR_LAUNCH(early_return_barrier, 1, 64, 0, s)(d, 3);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert_int_eq(cudaStreamSynchronize(s), cudaErrorLaunchFailure);
    ck_assert_int_eq(cudaGetLastError(), cudaErrorLaunchFailure);
    ck_assert_int_eq(cudaStreamSynchronize(s), cudaSuccess); /* reported once */
    CK_CUDA(cudaStreamDestroy(s));
    CK_CUDA(cudaFreeHost(pinned));
    CK_CUDA(cudaFree(d));
}
END_TEST

/* Two streams: the consumer reads the producer's output only when it waits
 * for an event recorded after the producer; without the wait, lazy shows
 * the old value, as a GPU may. */
static std::vector<int> producer_consumer(cudasim_streams m, unsigned long long seed, bool wait) {
    StreamsMode mode(m, seed);
    const int n = 256;
    int *x = dev_alloc<int>(n), *y = dev_alloc<int>(n);
    to_dev(x, std::vector<int>(n, 1));
    cudaStream_t a, b;
    cudaEvent_t ev;
    CK_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    CK_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    CK_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    for (int step = 0; step < 8; step++) {
        CPAR_LAUNCH(fill_int, 2, 64, 0, a)(x, n, 10 * (step + 1));
        CK_CUDA(cudaEventRecord(ev, a));
        if (wait) CK_CUDA(cudaStreamWaitEvent(b, ev, 0));
        CPAR_LAUNCH(add_one, 2, 64, 0, b)(x, y, n);
        CK_CUDA(cudaStreamSynchronize(b));
    }
    std::vector<int> out = from_dev(y, n);
    CK_CUDA(cudaStreamSynchronize(a));
    CK_CUDA(cudaEventDestroy(ev));
    CK_CUDA(cudaStreamDestroy(a));
    CK_CUDA(cudaStreamDestroy(b));
    CK_CUDA(cudaFree(x));
    CK_CUDA(cudaFree(y));
    return out;
}

START_TEST(test_streams_missing_wait_is_caught) {
    ck_assert_msg(all_eq(producer_consumer(CUDASIM_STREAMS_EAGER, 0, false), 81), "eager without the wait");
    ck_assert_msg(all_eq(producer_consumer(CUDASIM_STREAMS_LAZY, 0, true), 81), "lazy with the wait");
    std::vector<int> stale = producer_consumer(CUDASIM_STREAMS_LAZY, 0, false);
    ck_assert_msg(!all_eq(stale, 81), "lazy without the wait read the producer's output");
    for (unsigned long long seed = 1; seed <= 8; seed++)
        ck_assert_msg(all_eq(producer_consumer(CUDASIM_STREAMS_RANDOM, seed, true), 81), "random:%llu with the wait",
                      seed);
    int caught = 0;
    for (unsigned long long seed = 1; seed <= 16; seed++)
        caught += !all_eq(producer_consumer(CUDASIM_STREAMS_RANDOM, seed, false), 81);
    ck_assert_msg(caught > 0, "random: no seed of 16 showed the missing wait");
}
END_TEST

/* The legacy default stream waits for blocking streams' work (and they for
 * it), not for non-blocking streams': a synchronous cudaMemcpy after a
 * kernel on a non-blocking stream reads the old bytes under lazy. */
START_TEST(test_streams_legacy_rules) {
    StreamsMode mode(CUDASIM_STREAMS_LAZY);
    const int n = 128;
    int *x = dev_alloc<int>(n);
    to_dev(x, std::vector<int>(n, 5));
    cudaStream_t blocking, nonblocking;
    CK_CUDA(cudaStreamCreate(&blocking));
    CK_CUDA(cudaStreamCreateWithFlags(&nonblocking, cudaStreamNonBlocking));
    CPAR_LAUNCH(fill_int, 2, 64, 0, blocking)(x, n, 6);
    ck_assert_msg(all_eq(from_dev(x, n), 6), "the legacy stream did not wait for a blocking stream");
    CPAR_LAUNCH(fill_int, 2, 64, 0, nonblocking)(x, n, 7);
    ck_assert_msg(all_eq(from_dev(x, n), 6), "the legacy stream waited for a non-blocking stream");
    CK_CUDA(cudaStreamSynchronize(nonblocking));
    ck_assert_msg(all_eq(from_dev(x, n), 7), "after its synchronisation");
    /* Work on a blocking stream waits for the legacy stream's. */
    CK_CUDA(cudaMemsetAsync(x, 0, n * sizeof(int), 0));
    CPAR_LAUNCH(add_one, 2, 64, 0, blocking)(x, x, n);
    CK_CUDA(cudaStreamSynchronize(blocking));
    ck_assert_msg(all_eq(from_dev(x, n), 1), "a blocking stream did not wait for the legacy stream");
    /* cudaFree runs the queued work of its device first. */
    int *tmp = dev_alloc<int>(n);
    CPAR_LAUNCH(fill_int, 2, 64, 0, nonblocking)(tmp, n, 9);
    CK_CUDA(cudaFree(tmp));
    CK_CUDA(cudaStreamQuery(nonblocking));
    CK_CUDA(cudaStreamDestroy(blocking));
    CK_CUDA(cudaStreamDestroy(nonblocking));
    CK_CUDA(cudaFree(x));
}
END_TEST

/* random: a query copies an operation's `ready` and calls it unlocked, so
 * another thread's progress may run the operation in between. The simulator
 * does so itself half the time (the NCCL simulator's `ready` once used a
 * staging the run had freed): over 16 seeds both orders occur. */
START_TEST(test_streams_query_gap) {
    int gap = 0, before = 0;
    for (unsigned long long seed = 1; seed <= 16; seed++) {
        StreamsMode mode(CUDASIM_STREAMS_RANDOM, seed);
        cudaStream_t s;
        CK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        auto ran = std::make_shared<int>(0), seen = std::make_shared<int>(-1);
        cudasim::detail::enqueue(s, "test: an operation with a ready check", [ran] { *ran = 1; }, {}, false,
                                 [ran, seen] {
                                     if (*seen < 0) *seen = *ran;
                                     return true;
                                 });
        int polls = 0;
        while (cudaStreamQuery(s) == cudaErrorNotReady && polls < 100) polls++;
        (void)cudaGetLastError();
        ck_assert_msg(*ran == 1, "random:%llu: the operation never ran (%d polls)", seed, polls);
        gap += *seen == 1;
        before += *seen == 0;
        CK_CUDA(cudaStreamDestroy(s));
    }
    ck_assert_msg(gap > 0, "random: no seed of 16 ran the operation between a query's copy of ready and its call");
    ck_assert_msg(before > 0, "random: no seed of 16 called ready before the operation ran");
}
END_TEST

static TCase *make_tcase(Suite *s, const char *name) {
    TCase *tc = tcase_create(name);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    return tc;
}

int main(void) {
    /* These tests state eager semantics (a launch's fault at cudaGetLastError
     * after it); the streams case switches modes itself. */
    cudasim_set_streams(CUDASIM_STREAMS_EAGER, 0);
    Suite *s = suite_create("cudasim");
    TCase *tc = make_tcase(s, "barriers");
    tcase_add_test(tc, test_barrier_reverse);
    tcase_add_test(tc, test_barrier_tree_reduction);
    tcase_add_test(tc, test_missing_barrier_is_caught);
    tc = make_tcase(s, "warp");
    tcase_add_test(tc, test_warp_shuffles);
    tcase_add_test(tc, test_warp_partial_masks_and_votes);
    tcase_add_test(tc, test_warp_block_reduction);
    tcase_add_test(tc, test_warp_call);
    tc = make_tcase(s, "shared_memory");
    tcase_add_test(tc, test_dynamic_shared_memory);
    tcase_add_test(tc, test_pipeline_copies);
    tcase_add_test(tc, test_static_shared_memory);
    tc = make_tcase(s, "atomics_grid");
    tcase_add_test(tc, test_atomics_contention);
    tcase_add_test(tc, test_grid_shapes);
    tc = make_tcase(s, "failures");
    tcase_add_test(tc, test_failures_are_reported);
    tcase_add_test(tc, test_invalid_launch_configs);
    tc = make_tcase(s, "fp16_bf16");
    tcase_add_test(tc, test_fp16_bf16_conversions);
    tc = make_tcase(s, "gemm");
    tcase_add_test(tc, test_gemm_semantics);
    tc = make_tcase(s, "runtime");
    tcase_add_test(tc, test_runtime_memory);
    tcase_add_test(tc, test_runtime_devices_streams_events);
    tc = make_tcase(s, "threads_schedules");
    tcase_add_test(tc, test_two_host_threads);
#ifndef CUDASIM_ASAN
    tcase_add_test_raise_signal(tc, test_stack_guard_on_reused_pool, SIGSEGV);
#endif
    tcase_add_test(tc, test_schedules);
    tc = make_tcase(s, "streams");
    tcase_add_test(tc, test_streams_lazy_defers);
    tcase_add_test(tc, test_streams_missing_wait_is_caught);
    tcase_add_test(tc, test_streams_legacy_rules);
    tcase_add_test(tc, test_streams_query_gap);
    tc = make_tcase(s, "timing");
    tcase_add_test(tc, test_timing_report);

    return tu_run_suite(s);
}
