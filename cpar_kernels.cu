/* cpar_kernels.cu — everything in cpar that touches a GPU.
 *
 * The device layer of cpar.h §7 (cpar_dev_*: memory, copies, streams, events,
 * cuBLAS GEMMs) and every CUDA kernel with its launcher. cpar.c reaches the GPU
 * only through these C-linkage functions and never includes a CUDA header.
 *
 * Two builds of this one file:
 *   nvcc -std=c++17 -O3 -gencode arch=compute_80,code=sm_80 ... -c cpar_kernels.cu
 *   g++  -std=c++17 -DCPAR_SIM -I. -x c++ -c cpar_kernels.cu   (tests/cudasim.h:
 *        the same kernels run on the CPU, threads of a block as fibers)
 * so kernels use only what the simulator models: launches go through
 * CPAR_LAUNCH, dynamic shared memory through CPAR_DYN_SMEM, no inline PTX.
 *
 * Conventions: every function returns cpar_status and, on failure, leaves one
 * line in a thread-local buffer (cpar_dev_last_error) naming the cpar_dev
 * function, the failing call or argument, and the reason. Zero-sized work is a
 * successful no-op. Kernels use grid-stride loops with 64-bit indices (any n
 * works with a capped grid) and 16-byte vector accesses only when every
 * pointer involved is aligned, checked at run time, with a scalar fallback.
 *
 * Contents
 *    1. Includes and launch macros
 *    2. Errors
 *    3. Devices, memory, streams and events (thin runtime wrappers)
 *    4. Kernel toolkit: element types, vector packs, launch geometry
 *    5. Fill
 *    6. Cast
 *    7. axpby
 *    8. Reduce into (the local step of reductions over device memory)
 *    9. Pitched 2-D copy (split, concat, all-to-all packing)
 *   10. Row reduce (sum, max, log-sum-exp over the last dimension)
 *   11. GEMM (cuBLAS; k == 0 by a kernel of ours)
 */

/* ==== 1. Includes and launch macros =======================================
 * Under nvcc the two macros are plain CUDA; the simulator defines its own. */

#ifdef CPAR_SIM
#include "tests/cudasim.h"
#else
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define CPAR_LAUNCH(kernel, grid, block, smem_bytes, stream) kernel<<<(grid), (block), (smem_bytes), (stream)>>>
#define CPAR_DYN_SMEM(type, name)                                                                                      \
    extern __shared__ __align__(16) unsigned char cpar_dyn_smem_[];                                                    \
    type *name = reinterpret_cast<type *>(cpar_dyn_smem_)
#endif

#include "cpar.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <type_traits>

/* ==== 2. Errors ============================================================
 * One thread-local line per thread. CUDA failures become CPAR_ERR_OOM
 * (cudaErrorMemoryAllocation) or CPAR_ERR_CUDA, cuBLAS failures
 * CPAR_ERR_CUBLAS, argument checks CPAR_ERR_INVALID. Defines the CPAR__TRY_*
 * macros used by every later section; they name the public function through
 * __func__, so they are only used inside the cpar_dev_* functions. */

static thread_local char cpar__dev_msg[512];

const char *cpar_dev_last_error(void) { return cpar__dev_msg; }

__attribute__((format(printf, 2, 3))) static cpar_status cpar__dev_fail(cpar_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cpar__dev_msg, sizeof cpar__dev_msg, fmt, ap);
    va_end(ap);
    return st;
}

/* "func: <call> failed: <cudaGetErrorString>". Also clears the runtime's
 * last-error slot: otherwise the launch check of the next kernel
 * (cudaGetLastError) would report this stale failure as its own. */
__attribute__((format(printf, 3, 4))) static cpar_status cpar__cuda_fail(cudaError_t e, const char *func,
                                                                         const char *call_fmt, ...) {
    char call[256];
    va_list ap;
    va_start(ap, call_fmt);
    vsnprintf(call, sizeof call, call_fmt, ap);
    va_end(ap);
    (void)cudaGetLastError();
    return cpar__dev_fail(e == cudaErrorMemoryAllocation ? CPAR_ERR_OOM : CPAR_ERR_CUDA, "%s: %s failed: %s", func,
                          call, cudaGetErrorString(e));
}

/* CPAR__TRY_CUDA(cudaMalloc(&p, n), "cudaMalloc(%zu bytes)", n): return on failure. */
#define CPAR__TRY_CUDA(call, ...)                                                                                      \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess) return cpar__cuda_fail(e_, __func__, __VA_ARGS__);                                      \
    } while (0)

#define CPAR__TRY_CUBLAS(call, what)                                                                                   \
    do {                                                                                                               \
        cublasStatus_t s_ = (call);                                                                                    \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                                               \
            return cpar__dev_fail(CPAR_ERR_CUBLAS, "%s: %s failed: %s", __func__, what, cublasGetStatusString(s_));    \
    } while (0)

#define CPAR__INVALID(fmt, ...) cpar__dev_fail(CPAR_ERR_INVALID, "%s: " fmt, __func__, __VA_ARGS__)

/* A NULL pointer is an error only when there is something to touch. */
#define CPAR__CHECK_PTR(p, nonempty)                                                                                   \
    do {                                                                                                               \
        if ((p) == NULL && (nonempty)) return CPAR__INVALID("%s is NULL", #p);                                         \
    } while (0)

#define CPAR__CHECK_COUNT(n)                                                                                           \
    do {                                                                                                               \
        if ((n) < 0) return CPAR__INVALID("%s = %lld, expected >= 0", #n, (long long)(n));                             \
    } while (0)

/* cpar.c's dtype helpers are not linked into every user of this file (the sim
 * test links only this file), so the device layer keeps its own copy. */
static const char *cpar__dtype_name(cpar_dtype dt) {
    static const char *const names[CPAR_DTYPE_COUNT] = {"f32", "f16", "bf16", "i32", "i64", "u8"};
    return (unsigned)dt < CPAR_DTYPE_COUNT ? names[dt] : "?";
}

static size_t cpar__dtype_size(cpar_dtype dt) {
    static const size_t sizes[CPAR_DTYPE_COUNT] = {4, 2, 2, 4, 8, 1};
    return (unsigned)dt < CPAR_DTYPE_COUNT ? sizes[dt] : 0;
}

static bool cpar__is_float(cpar_dtype dt) { return dt == CPAR_F32 || dt == CPAR_F16 || dt == CPAR_BF16; }

/* ==== 3. Devices, memory, streams and events ===============================
 * Thin wrappers over the CUDA runtime. Opaque cpar handles are the CUDA
 * handles themselves. Uses: 2. */

static cudaStream_t cpar__stream(cpar_dev_stream s) { return reinterpret_cast<cudaStream_t>(s); }
static cudaEvent_t cpar__event(cpar_dev_event e) { return reinterpret_cast<cudaEvent_t>(e); }

/* Never fails: with no driver or no device cudaGetDeviceCount returns an error,
 * which means "no GPU". The reason stays in cpar_dev_last_error() so a caller
 * can say why the GPU was skipped. */
int cpar_dev_count(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cpar__cuda_fail(e, __func__, "cudaGetDeviceCount");
        return 0;
    }
    return n;
}

cpar_status cpar_dev_set(int device) {
    if (device < 0) return CPAR__INVALID("device = %d, expected >= 0", device);
    CPAR__TRY_CUDA(cudaSetDevice(device), "cudaSetDevice(%d)", device);
    return CPAR_OK;
}

cpar_status cpar_dev_malloc(void **p, size_t bytes) {
    CPAR__CHECK_PTR(p, true);
    *p = NULL;
    if (bytes == 0) return CPAR_OK;
    CPAR__TRY_CUDA(cudaMalloc(p, bytes), "cudaMalloc(%zu bytes)", bytes);
    return CPAR_OK;
}

cpar_status cpar_dev_free(void *p) {
    CPAR__TRY_CUDA(cudaFree(p), "cudaFree(%p)", p);
    return CPAR_OK;
}

cpar_status cpar_dev_memset(void *p, int byte, size_t bytes, cpar_dev_stream s) {
    CPAR__CHECK_PTR(p, bytes > 0);
    if (bytes == 0) return CPAR_OK;
    CPAR__TRY_CUDA(cudaMemsetAsync(p, byte, bytes, cpar__stream(s)), "cudaMemsetAsync(%zu bytes)", bytes);
    return CPAR_OK;
}

/* CUDA's kind and its name for messages; false for a value outside the enum
 * (C callers can pass any int). */
static bool cpar__memcpy_kind(cpar_copy_kind kind, cudaMemcpyKind *out, const char **name) {
    switch (kind) {
    case CPAR_COPY_H2D: *out = cudaMemcpyHostToDevice, *name = "host to device"; return true;
    case CPAR_COPY_D2H: *out = cudaMemcpyDeviceToHost, *name = "device to host"; return true;
    case CPAR_COPY_D2D: *out = cudaMemcpyDeviceToDevice, *name = "device to device"; return true;
    case CPAR_COPY_H2H: *out = cudaMemcpyHostToHost, *name = "host to host"; return true;
    }
    return false;
}

cpar_status cpar_dev_memcpy(void *dst, const void *src, size_t bytes, cpar_copy_kind kind, cpar_dev_stream s) {
    cudaMemcpyKind k;
    const char *kname;
    if (!cpar__memcpy_kind(kind, &k, &kname)) return CPAR__INVALID("kind = %d, expected a cpar_copy_kind", (int)kind);
    CPAR__CHECK_PTR(dst, bytes > 0);
    CPAR__CHECK_PTR(src, bytes > 0);
    if (bytes == 0) return CPAR_OK;
    CPAR__TRY_CUDA(cudaMemcpyAsync(dst, src, bytes, k, cpar__stream(s)), "cudaMemcpyAsync(%zu bytes, %s)", bytes,
                   kname);
    return CPAR_OK;
}

cpar_status cpar_dev_sync(void) {
    CPAR__TRY_CUDA(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    return CPAR_OK;
}

/* Streams are created blocking (cudaStreamCreate), so work that a caller puts
 * on the legacy NULL stream stays ordered with them. */
cpar_status cpar_dev_stream_create(cpar_dev_stream *s) {
    CPAR__CHECK_PTR(s, true);
    cudaStream_t cs = NULL;
    CPAR__TRY_CUDA(cudaStreamCreate(&cs), "cudaStreamCreate");
    *s = reinterpret_cast<cpar_dev_stream>(cs);
    return CPAR_OK;
}

/* NULL (the legacy stream) is not destroyed, as free(NULL). */
cpar_status cpar_dev_stream_destroy(cpar_dev_stream s) {
    if (s == NULL) return CPAR_OK;
    CPAR__TRY_CUDA(cudaStreamDestroy(cpar__stream(s)), "cudaStreamDestroy");
    return CPAR_OK;
}

cpar_status cpar_dev_stream_sync(cpar_dev_stream s) {
    CPAR__TRY_CUDA(cudaStreamSynchronize(cpar__stream(s)), "cudaStreamSynchronize");
    return CPAR_OK;
}

/* cudaErrorNotReady is an answer, not a failure; it is cleared from the
 * last-error slot (as PyTorch does) so no later launch check reports it. */
cpar_status cpar_dev_stream_query(cpar_dev_stream s, bool *done) {
    CPAR__CHECK_PTR(done, true);
    cudaError_t e = cudaStreamQuery(cpar__stream(s));
    *done = e == cudaSuccess;
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return CPAR_OK;
    }
    CPAR__TRY_CUDA(e, "cudaStreamQuery");
    return CPAR_OK;
}

/* Events only order streams, so timing is disabled (cheaper record and wait). */
cpar_status cpar_dev_event_create(cpar_dev_event *e) {
    CPAR__CHECK_PTR(e, true);
    cudaEvent_t ce = NULL;
    CPAR__TRY_CUDA(cudaEventCreateWithFlags(&ce, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    *e = reinterpret_cast<cpar_dev_event>(ce);
    return CPAR_OK;
}

cpar_status cpar_dev_event_destroy(cpar_dev_event e) {
    if (e == NULL) return CPAR_OK;
    CPAR__TRY_CUDA(cudaEventDestroy(cpar__event(e)), "cudaEventDestroy");
    return CPAR_OK;
}

cpar_status cpar_dev_event_record(cpar_dev_event e, cpar_dev_stream s) {
    CPAR__CHECK_PTR(e, true);
    CPAR__TRY_CUDA(cudaEventRecord(cpar__event(e), cpar__stream(s)), "cudaEventRecord");
    return CPAR_OK;
}

cpar_status cpar_dev_stream_wait_event(cpar_dev_stream s, cpar_dev_event e) {
    CPAR__CHECK_PTR(e, true);
    CPAR__TRY_CUDA(cudaStreamWaitEvent(cpar__stream(s), cpar__event(e), 0), "cudaStreamWaitEvent");
    return CPAR_OK;
}

cpar_status cpar_dev_event_sync(cpar_dev_event e) {
    CPAR__CHECK_PTR(e, true);
    CPAR__TRY_CUDA(cudaEventSynchronize(cpar__event(e)), "cudaEventSynchronize");
    return CPAR_OK;
}

/* ==== 4. Kernel toolkit =====================================================
 * Element conversions (all float math is fp32), aligned vector packs, the
 * grid-stride thread index and the launch geometry shared by sections 5-10. */

static __device__ __forceinline__ float cpar__widen(float v) { return v; }
static __device__ __forceinline__ float cpar__widen(__half v) { return __half2float(v); }
static __device__ __forceinline__ float cpar__widen(__nv_bfloat16 v) { return __bfloat162float(v); }
static __device__ __forceinline__ int32_t cpar__widen(int32_t v) { return v; }
static __device__ __forceinline__ int64_t cpar__widen(int64_t v) { return v; }
static __device__ __forceinline__ uint8_t cpar__widen(uint8_t v) { return v; }

/* fp32 -> T, round to nearest even (NaN stays NaN, overflow gives inf). */
template <typename T> static __device__ __forceinline__ T cpar__narrow(float v);
template <> __device__ __forceinline__ float cpar__narrow<float>(float v) { return v; }
template <> __device__ __forceinline__ __half cpar__narrow<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 cpar__narrow<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

/* V consecutive elements moved as one aligned access (V * sizeof(T) <= 16,
 * a power of two): 16-byte packs become single 128-bit loads and stores. */
template <typename T, int V> struct alignas(sizeof(T) * V) cpar__pack { T v[V]; };

template <int V, typename T> static __device__ __forceinline__ cpar__pack<T, V> cpar__load(const T *p) {
    return *reinterpret_cast<const cpar__pack<T, V> *>(p);
}

template <int V, typename T> static __device__ __forceinline__ void cpar__store(T *p, const cpar__pack<T, V> &v) {
    *reinterpret_cast<cpar__pack<T, V> *>(p) = v;
}

/* Elements of T in one 16-byte pack. */
template <typename T> static constexpr int cpar__vec16 = 16 / (int)sizeof(T);

static __device__ __forceinline__ int64_t cpar__thread_id(void) {
    return (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
}

static __device__ __forceinline__ int64_t cpar__thread_count(void) { return (int64_t)gridDim.x * blockDim.x; }

/* Element-wise kernels run 256-thread blocks over a grid capped at 4096 blocks
 * (about 4 waves of 8 resident blocks on a 132-SM H100): enough to saturate
 * memory bandwidth, and the grid-stride loops take care of the rest. */
static constexpr int CPAR__BLOCK = 256, CPAR__MAX_GRID = 4096;

static unsigned cpar__grid(int64_t items, int64_t per_block) {
    int64_t g = (items + per_block - 1) / per_block;
    return (unsigned)(g < CPAR__MAX_GRID ? g : CPAR__MAX_GRID);
}

/* Launch shape of a 2-D grid-stride loop over width x height (x contiguous):
 * 256-thread blocks with blockDim.x the power of two >= width (at most 256),
 * so short rows still fill every thread, and at most CPAR__MAX_GRID blocks. */
struct cpar__shape {
    dim3 grid, block;
};

static cpar__shape cpar__shape_2d(int64_t width, int64_t height) {
    unsigned tx = 1;
    while (tx < CPAR__BLOCK && (int64_t)tx < width) tx *= 2;
    const unsigned ty = CPAR__BLOCK / tx, gx = cpar__grid(width, tx);
    unsigned gy = cpar__grid(height, ty);
    if (gy > CPAR__MAX_GRID / gx) gy = CPAR__MAX_GRID / gx;
    return {dim3(gx, gy), dim3(tx, ty)};
}

/* True when every pointer is aligned to `bytes` (a power of two). */
static bool cpar__aligned(size_t bytes, const void *a, const void *b = NULL) {
    return (((uintptr_t)a | (uintptr_t)b) & (bytes - 1)) == 0;
}

/* Calls f(T{}) with T the C++ type of a float dtype (validated by the caller). */
template <typename F> static cudaError_t cpar__with_float_type(cpar_dtype dt, F &&f) {
    switch (dt) {
    case CPAR_F16: return f(__half());
    case CPAR_BF16: return f(__nv_bfloat16());
    default: return f(float());
    }
}

/* ==== 5. Fill ===============================================================
 * p[i] = value for i < n, any dtype. The host converts value once into the
 * element's bit pattern (floats: double -> fp32 -> dtype with round to nearest
 * even, as PyTorch's fill_ does; integers: truncation toward zero, with
 * out-of-range values rejected), so one kernel per element size serves all
 * dtypes. Uses: 2, 4. */

/* p: [n] elements of W (an unsigned word holding the element's bits).
 * Launch: 1-D grid-stride, 256 threads, V words per thread step (V * sizeof(W)
 * = 16 when p is 16-byte aligned, else V = 1). Moves n * sizeof(W) bytes. */
template <typename W, int V> static __global__ void cpar__fill_kernel(W *__restrict__ p, W bits, int64_t n) {
    const int64_t nv = n / V, step = cpar__thread_count();
    cpar__pack<W, V> pack;
    for (int e = 0; e < V; e++) pack.v[e] = bits;
    for (int64_t j = cpar__thread_id(); j < nv; j += step) cpar__store<V>(p + j * V, pack);
    for (int64_t i = nv * V + cpar__thread_id(); i < n; i += step) p[i] = bits;
}

template <typename W> static cudaError_t cpar__launch_fill(void *p, uint64_t bits, int64_t n, cudaStream_t s) {
    constexpr int V = cpar__vec16<W>;
    W *q = static_cast<W *>(p);
    if (cpar__aligned(16, p)) {
        auto kernel = cpar__fill_kernel<W, V>;
        CPAR_LAUNCH(kernel, cpar__grid(n, (int64_t)CPAR__BLOCK * V), CPAR__BLOCK, 0, s)(q, (W)bits, n);
    } else {
        auto kernel = cpar__fill_kernel<W, 1>;
        CPAR_LAUNCH(kernel, cpar__grid(n, CPAR__BLOCK), CPAR__BLOCK, 0, s)(q, (W)bits, n);
    }
    return cudaGetLastError();
}

/* The bits of a 2- or 4-byte value, zero-extended. */
template <typename T> static uint64_t cpar__bits(T v) {
    typename std::conditional<sizeof(T) == 2, uint16_t, uint32_t>::type u;
    static_assert(sizeof u == sizeof v, "2- or 4-byte values only");
    memcpy(&u, &v, sizeof u);
    return u;
}

cpar_status cpar_dev_fill(void *p, cpar_dtype dt, int64_t n, double value, cpar_dev_stream s) {
    CPAR__CHECK_COUNT(n);
    CPAR__CHECK_PTR(p, n > 0);
    uint64_t bits = 0;
    bool in_range = true;
    switch (dt) {
    case CPAR_F32: bits = cpar__bits((float)value); break;
    case CPAR_F16: bits = cpar__bits(__float2half_rn((float)value)); break;
    case CPAR_BF16: bits = cpar__bits(__float2bfloat16_rn((float)value)); break;
    /* The range tests are false for NaN, so NaN is rejected too. */
    case CPAR_I32:
        in_range = value > -2147483649.0 && value < 2147483648.0;
        bits = in_range ? (uint32_t)(int32_t)value : 0;
        break;
    case CPAR_I64:
        in_range = value >= -9223372036854775808.0 && value < 9223372036854775808.0;
        bits = in_range ? (uint64_t)(int64_t)value : 0;
        break;
    case CPAR_U8:
        in_range = value > -1.0 && value < 256.0;
        bits = in_range ? (uint8_t)value : 0;
        break;
    default: return CPAR__INVALID("dtype %d is not a cpar_dtype", (int)dt);
    }
    if (!in_range) return CPAR__INVALID("value %g is not representable in %s", value, cpar__dtype_name(dt));
    if (n == 0) return CPAR_OK;
    cudaStream_t cs = cpar__stream(s);
    cudaError_t e;
    switch (cpar__dtype_size(dt)) {
    case 1: e = cpar__launch_fill<uint8_t>(p, bits, n, cs); break;
    case 2: e = cpar__launch_fill<uint16_t>(p, bits, n, cs); break;
    case 4: e = cpar__launch_fill<uint32_t>(p, bits, n, cs); break;
    default: e = cpar__launch_fill<uint64_t>(p, bits, n, cs); break;
    }
    CPAR__TRY_CUDA(e, "fill kernel launch (%s, n = %lld)", cpar__dtype_name(dt), (long long)n);
    return CPAR_OK;
}

/* ==== 6. Cast ===============================================================
 * dst = src converted between F32, F16 and BF16 (via fp32: widening is exact,
 * narrowing rounds to nearest even). Equal dtypes (any) are a D2D memcpy, or
 * nothing when dst == src; otherwise dst and src must not overlap.
 * Uses: 2, 3, 4. */

/* dst: [n] To, src: [n] Ti. Launch: 1-D grid-stride, 256 threads, V elements
 * per thread step (V = 16 / max element size when both pointers allow it).
 * Moves n * (sizeof(Ti) + sizeof(To)) bytes. */
template <typename Ti, typename To, int V>
static __global__ void cpar__cast_kernel(To *__restrict__ dst, const Ti *__restrict__ src, int64_t n) {
    const int64_t nv = n / V, step = cpar__thread_count();
    for (int64_t j = cpar__thread_id(); j < nv; j += step) {
        const cpar__pack<Ti, V> a = cpar__load<V>(src + j * V);
        cpar__pack<To, V> b;
        for (int e = 0; e < V; e++) b.v[e] = cpar__narrow<To>(cpar__widen(a.v[e]));
        cpar__store<V>(dst + j * V, b);
    }
    for (int64_t i = nv * V + cpar__thread_id(); i < n; i += step) dst[i] = cpar__narrow<To>(cpar__widen(src[i]));
}

template <typename Ti, typename To>
static cudaError_t cpar__launch_cast(void *dst, const void *src, int64_t n, cudaStream_t s) {
    constexpr int V = cpar__vec16<Ti> < cpar__vec16<To> ? cpar__vec16<Ti> : cpar__vec16<To>;
    To *d = static_cast<To *>(dst);
    const Ti *x = static_cast<const Ti *>(src);
    if (cpar__aligned(sizeof(Ti) * V, src) && cpar__aligned(sizeof(To) * V, dst)) {
        auto kernel = cpar__cast_kernel<Ti, To, V>;
        CPAR_LAUNCH(kernel, cpar__grid(n, (int64_t)CPAR__BLOCK * V), CPAR__BLOCK, 0, s)(d, x, n);
    } else {
        auto kernel = cpar__cast_kernel<Ti, To, 1>;
        CPAR_LAUNCH(kernel, cpar__grid(n, CPAR__BLOCK), CPAR__BLOCK, 0, s)(d, x, n);
    }
    return cudaGetLastError();
}

cpar_status cpar_dev_cast(void *dst, cpar_dtype dst_dt, const void *src, cpar_dtype src_dt, int64_t n,
                          cpar_dev_stream s) {
    CPAR__CHECK_COUNT(n);
    CPAR__CHECK_PTR(dst, n > 0);
    CPAR__CHECK_PTR(src, n > 0);
    const bool same = src_dt == dst_dt && cpar__dtype_size(src_dt) > 0;
    if (!same && !(cpar__is_float(src_dt) && cpar__is_float(dst_dt)))
        return CPAR__INVALID("cannot cast %s to %s (float dtypes f32, f16, bf16 in any pair, or equal dtypes)",
                             cpar__dtype_name(src_dt), cpar__dtype_name(dst_dt));
    if (n == 0) return CPAR_OK;
    const size_t bytes = (size_t)n * cpar__dtype_size(src_dt);
    if (same) {
        if (dst == src) return CPAR_OK;
        CPAR__TRY_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cpar__stream(s)),
                       "cudaMemcpyAsync(%zu bytes, device to device)", bytes);
        return CPAR_OK;
    }
    cudaError_t e = cpar__with_float_type(src_dt, [&](auto ti) {
        return cpar__with_float_type(dst_dt, [&](auto to) {
            return cpar__launch_cast<decltype(ti), decltype(to)>(dst, src, n, cpar__stream(s));
        });
    });
    CPAR__TRY_CUDA(e, "cast kernel launch (%s -> %s, n = %lld)", cpar__dtype_name(src_dt), cpar__dtype_name(dst_dt),
                   (long long)n);
    return CPAR_OK;
}

/* ==== 7. axpby ==============================================================
 * y = alpha * x + beta * y in fp32 for F32/F16/BF16. beta == 0 never reads y
 * (BLAS convention: y may be uninitialised or hold NaN). x may equal y (an
 * in-place scale: each element is read before it is written, by the same
 * thread), so the pointers are not __restrict__. Computed as
 * fmaf(beta, y, alpha * x), so the GPU and the simulator agree bit for bit.
 * Uses: 2, 4. */

template <typename T> static __device__ __forceinline__ T cpar__axpby1(float alpha, T x, float beta, const T *y) {
    const float ax = alpha * cpar__widen(x);
    return cpar__narrow<T>(beta == 0.f ? ax : fmaf(beta, cpar__widen(*y), ax));
}

/* x, y: [n] T. Launch: 1-D grid-stride, 256 threads, V = 16 / sizeof(T)
 * elements per thread step when x and y are 16-byte aligned, else 1.
 * Moves 3 * n * sizeof(T) bytes (2 * n * sizeof(T) when beta == 0). */
template <typename T, int V>
static __global__ void cpar__axpby_kernel(float alpha, const T *x, float beta, T *y, int64_t n) {
    const int64_t nv = n / V, step = cpar__thread_count();
    for (int64_t j = cpar__thread_id(); j < nv; j += step) {
        const cpar__pack<T, V> a = cpar__load<V>(x + j * V);
        cpar__pack<T, V> b;
        if (beta != 0.f) b = cpar__load<V>(y + j * V);
        for (int e = 0; e < V; e++) b.v[e] = cpar__axpby1(alpha, a.v[e], beta, &b.v[e]);
        cpar__store<V>(y + j * V, b);
    }
    for (int64_t i = nv * V + cpar__thread_id(); i < n; i += step) y[i] = cpar__axpby1(alpha, x[i], beta, &y[i]);
}

template <typename T>
static cudaError_t cpar__launch_axpby(float alpha, const void *x, float beta, void *y, int64_t n, cudaStream_t s) {
    constexpr int V = cpar__vec16<T>;
    const T *xs = static_cast<const T *>(x);
    T *ys = static_cast<T *>(y);
    if (cpar__aligned(16, x, y)) {
        auto kernel = cpar__axpby_kernel<T, V>;
        CPAR_LAUNCH(kernel, cpar__grid(n, (int64_t)CPAR__BLOCK * V), CPAR__BLOCK, 0, s)(alpha, xs, beta, ys, n);
    } else {
        auto kernel = cpar__axpby_kernel<T, 1>;
        CPAR_LAUNCH(kernel, cpar__grid(n, CPAR__BLOCK), CPAR__BLOCK, 0, s)(alpha, xs, beta, ys, n);
    }
    return cudaGetLastError();
}

cpar_status cpar_dev_axpby(float alpha, const void *x, float beta, void *y, cpar_dtype dt, int64_t n,
                           cpar_dev_stream s) {
    CPAR__CHECK_COUNT(n);
    CPAR__CHECK_PTR(x, n > 0);
    CPAR__CHECK_PTR(y, n > 0);
    if (!cpar__is_float(dt)) return CPAR__INVALID("dtype %s, expected f32, f16 or bf16", cpar__dtype_name(dt));
    if (n == 0) return CPAR_OK;
    cudaError_t e = cpar__with_float_type(
        dt, [&](auto t) { return cpar__launch_axpby<decltype(t)>(alpha, x, beta, y, n, cpar__stream(s)); });
    CPAR__TRY_CUDA(e, "axpby kernel launch (%s, n = %lld)", cpar__dtype_name(dt), (long long)n);
    return CPAR_OK;
}

/* ==== 8. Reduce into ========================================================
 * acc = op(acc, src) element-wise: the local step of a reduction over device
 * memory (cpar.c folds the ranks' buffers into one accumulator with it, in
 * rank order). Float sources accumulate into an F32 acc; I32/I64/U8 into acc
 * of the same dtype. acc and src must not overlap.
 * Semantics, chosen to match NCCL's ncclMax/ncclMin (fmaxf/fminf):
 *   - MAX/MIN on floats ignore a NaN operand when the other is a number
 *     (C's fmaxf: NaN only when both are NaN). PyTorch's max propagates NaN;
 *     NCCL, which the GPU backend uses, does not, and all backends must agree.
 *   - integer SUM wraps around (two's complement, as NCCL), never UB; U8
 *     takes all three ops (cpar.c only asks it for MAX and MIN).
 * Uses: 2, 4. */

template <cpar_reduce_op OP, typename A> static __device__ __forceinline__ A cpar__combine(A a, A b) {
    if constexpr (OP == CPAR_SUM) {
        if constexpr (std::is_integral<A>::value)
            return (A)((typename std::make_unsigned<A>::type)a + (typename std::make_unsigned<A>::type)b);
        else
            return a + b;
    } else if constexpr (std::is_integral<A>::value) {
        return OP == CPAR_MAX ? (a > b ? a : b) : (a < b ? a : b);
    } else {
        return OP == CPAR_MAX ? fmaxf(a, b) : fminf(a, b);
    }
}

/* acc: [n] A (float for float sources), src: [n] S. Launch: 1-D grid-stride,
 * 256 threads, V = 16 / sizeof(A) elements per thread step when acc is
 * 16-byte aligned and src V * sizeof(S)-aligned, else 1.
 * Moves n * (2 * sizeof(A) + sizeof(S)) bytes. */
template <typename S, typename A, cpar_reduce_op OP, int V>
static __global__ void cpar__reduce_into_kernel(A *__restrict__ acc, const S *__restrict__ src, int64_t n) {
    const int64_t nv = n / V, step = cpar__thread_count();
    for (int64_t j = cpar__thread_id(); j < nv; j += step) {
        const cpar__pack<S, V> b = cpar__load<V>(src + j * V);
        cpar__pack<A, V> a = cpar__load<V>(acc + j * V);
        for (int e = 0; e < V; e++) a.v[e] = cpar__combine<OP>(a.v[e], (A)cpar__widen(b.v[e]));
        cpar__store<V>(acc + j * V, a);
    }
    for (int64_t i = nv * V + cpar__thread_id(); i < n; i += step)
        acc[i] = cpar__combine<OP>(acc[i], (A)cpar__widen(src[i]));
}

template <typename S, typename A, cpar_reduce_op OP>
static cudaError_t cpar__launch_reduce_into(void *acc, const void *src, int64_t n, cudaStream_t s) {
    constexpr int V = cpar__vec16<A>;
    A *a = static_cast<A *>(acc);
    const S *x = static_cast<const S *>(src);
    if (cpar__aligned(16, acc) && cpar__aligned(sizeof(S) * V, src)) {
        auto kernel = cpar__reduce_into_kernel<S, A, OP, V>;
        CPAR_LAUNCH(kernel, cpar__grid(n, (int64_t)CPAR__BLOCK * V), CPAR__BLOCK, 0, s)(a, x, n);
    } else {
        auto kernel = cpar__reduce_into_kernel<S, A, OP, 1>;
        CPAR_LAUNCH(kernel, cpar__grid(n, CPAR__BLOCK), CPAR__BLOCK, 0, s)(a, x, n);
    }
    return cudaGetLastError();
}

template <typename S, typename A>
static cudaError_t cpar__launch_reduce_into(void *acc, const void *src, int64_t n, cpar_reduce_op op, cudaStream_t s) {
    switch (op) {
    case CPAR_MAX: return cpar__launch_reduce_into<S, A, CPAR_MAX>(acc, src, n, s);
    case CPAR_MIN: return cpar__launch_reduce_into<S, A, CPAR_MIN>(acc, src, n, s);
    default: return cpar__launch_reduce_into<S, A, CPAR_SUM>(acc, src, n, s);
    }
}

cpar_status cpar_dev_reduce_into(void *acc, const void *src, cpar_dtype src_dt, int64_t n, cpar_reduce_op op,
                                 cpar_dev_stream s) {
    CPAR__CHECK_COUNT(n);
    CPAR__CHECK_PTR(acc, n > 0);
    CPAR__CHECK_PTR(src, n > 0);
    if ((unsigned)op >= CPAR_REDUCE_OP_COUNT) return CPAR__INVALID("op = %d, expected a cpar_reduce_op", (int)op);
    if (cpar__dtype_size(src_dt) == 0) return CPAR__INVALID("dtype %d is not a cpar_dtype", (int)src_dt);
    if (n == 0) return CPAR_OK;
    cudaStream_t cs = cpar__stream(s);
    cudaError_t e;
    if (src_dt == CPAR_I32)
        e = cpar__launch_reduce_into<int32_t, int32_t>(acc, src, n, op, cs);
    else if (src_dt == CPAR_I64)
        e = cpar__launch_reduce_into<int64_t, int64_t>(acc, src, n, op, cs);
    else if (src_dt == CPAR_U8)
        e = cpar__launch_reduce_into<uint8_t, uint8_t>(acc, src, n, op, cs);
    else
        e = cpar__with_float_type(
            src_dt, [&](auto t) { return cpar__launch_reduce_into<decltype(t), float>(acc, src, n, op, cs); });
    CPAR__TRY_CUDA(e, "reduce_into kernel launch (%s, n = %lld)", cpar__dtype_name(src_dt), (long long)n);
    return CPAR_OK;
}

/* ==== 9. Pitched 2-D copy ===================================================
 * rows rows of row_bytes bytes, row r at src + r * src_pitch going to
 * dst + r * dst_pitch. Contiguous copies (pitches == row_bytes, or one row)
 * are a single cudaMemcpyAsync; other kinds touching the host use
 * cudaMemcpy2DAsync; pitched D2D runs the kernel below, which moves the widest
 * word that every row start allows. dst and src must not overlap (as for
 * cudaMemcpy2D). Uses: 2, 3, 4. */

/* Word types by size. cpar_dev_copy_2d picks the widest (<= 16 bytes) that
 * divides both pointers, both pitches and the row length, so every access is
 * aligned. */
template <int W> struct cpar__word_of;
template <> struct cpar__word_of<1> { typedef uint8_t type; };
template <> struct cpar__word_of<2> { typedef uint16_t type; };
template <> struct cpar__word_of<4> { typedef uint32_t type; };
template <> struct cpar__word_of<8> { typedef uint64_t type; };
template <> struct cpar__word_of<16> { typedef cpar__pack<uint64_t, 2> type; };

/* dst: rows x dst_pitch words, src: rows x src_pitch words (pitches in words),
 * copies the first words_per_row of each row. Launch: cpar__shape_2d over
 * words_per_row x rows, grid-stride in both. Moves 2 * rows * words_per_row *
 * sizeof(W) bytes. */
template <typename W>
static __global__ void cpar__copy_2d_kernel(W *__restrict__ dst, int64_t dst_pitch, const W *__restrict__ src,
                                            int64_t src_pitch, int64_t words_per_row, int64_t rows) {
    const int64_t c0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t r = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += (int64_t)gridDim.y * blockDim.y)
        for (int64_t c = c0; c < words_per_row; c += (int64_t)gridDim.x * blockDim.x)
            dst[r * dst_pitch + c] = src[r * src_pitch + c];
}

template <int W>
static cudaError_t cpar__launch_copy_2d(void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                                        size_t row_bytes, size_t rows, cudaStream_t s) {
    typedef typename cpar__word_of<W>::type word;
    word *d = static_cast<word *>(dst);
    const word *x = static_cast<const word *>(src);
    const int64_t dp = (int64_t)(dst_pitch / W), sp = (int64_t)(src_pitch / W);
    const int64_t wpr = (int64_t)(row_bytes / W), nrows = (int64_t)rows;
    const cpar__shape sh = cpar__shape_2d(wpr, nrows);
    auto kernel = cpar__copy_2d_kernel<word>;
    CPAR_LAUNCH(kernel, sh.grid, sh.block, 0, s)(d, dp, x, sp, wpr, nrows);
    return cudaGetLastError();
}

cpar_status cpar_dev_copy_2d(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t row_bytes,
                             size_t rows, cpar_copy_kind kind, cpar_dev_stream s) {
    cudaMemcpyKind k;
    const char *kname;
    if (!cpar__memcpy_kind(kind, &k, &kname)) return CPAR__INVALID("kind = %d, expected a cpar_copy_kind", (int)kind);
    const bool nonempty = row_bytes > 0 && rows > 0;
    CPAR__CHECK_PTR(dst, nonempty);
    CPAR__CHECK_PTR(src, nonempty);
    if (!nonempty) return CPAR_OK;
    if (rows == 1) dst_pitch = src_pitch = row_bytes; /* pitches are never used for one row */
    if (dst_pitch < row_bytes)
        return CPAR__INVALID("dst_pitch = %zu, expected >= row_bytes = %zu", dst_pitch, row_bytes);
    if (src_pitch < row_bytes)
        return CPAR__INVALID("src_pitch = %zu, expected >= row_bytes = %zu", src_pitch, row_bytes);
    cudaStream_t cs = cpar__stream(s);
    if (dst_pitch == row_bytes && src_pitch == row_bytes) {
        CPAR__TRY_CUDA(cudaMemcpyAsync(dst, src, rows * row_bytes, k, cs), "cudaMemcpyAsync(%zu bytes, %s)",
                       rows * row_bytes, kname);
        return CPAR_OK;
    }
    if (kind != CPAR_COPY_D2D) {
        CPAR__TRY_CUDA(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, k, cs),
                       "cudaMemcpy2DAsync(%zu rows of %zu bytes, dst_pitch %zu, src_pitch %zu, %s)", rows, row_bytes,
                       dst_pitch, src_pitch, kname);
        return CPAR_OK;
    }
    const size_t common = (uintptr_t)dst | (uintptr_t)src | dst_pitch | src_pitch | row_bytes | 16;
    cudaError_t e;
    switch (common & (~common + 1)) { /* lowest set bit: the widest common word */
    case 1: e = cpar__launch_copy_2d<1>(dst, dst_pitch, src, src_pitch, row_bytes, rows, cs); break;
    case 2: e = cpar__launch_copy_2d<2>(dst, dst_pitch, src, src_pitch, row_bytes, rows, cs); break;
    case 4: e = cpar__launch_copy_2d<4>(dst, dst_pitch, src, src_pitch, row_bytes, rows, cs); break;
    case 8: e = cpar__launch_copy_2d<8>(dst, dst_pitch, src, src_pitch, row_bytes, rows, cs); break;
    default: e = cpar__launch_copy_2d<16>(dst, dst_pitch, src, src_pitch, row_bytes, rows, cs); break;
    }
    CPAR__TRY_CUDA(e, "copy_2d kernel launch (%zu rows of %zu bytes)", rows, row_bytes);
    return CPAR_OK;
}

/* ==== 10. Row reduce ========================================================
 * out[r] = sum, max or log-sum-exp of in[r, 0..cols) in fp32. One state
 * (m, s) serves all three: SUM uses s; MAX uses m = fmaxf fold from -inf, so
 * NaN elements are ignored as in section 8 (an all-NaN row gives -inf); LSE
 * keeps m = running max and s = sum exp(x - m), rescaled when m grows (online
 * softmax), so nothing overflows. An exp is only taken of a difference of
 * unequal values; equal values count exp(0) = 1. That keeps infinities free
 * of inf - inf: an all -inf row gives -inf + log(cols) = -inf, a row holding
 * +inf gives +inf, and a NaN element makes s, hence the LSE, NaN. cols == 0
 * gives the identities 0, -inf, -inf. Uses: 2, 4. */

struct cpar__row_state {
    float m, s;
};

template <cpar_row_op OP> static __device__ __forceinline__ void cpar__row_push(cpar__row_state &a, float x) {
    if constexpr (OP == CPAR_ROW_SUM) {
        a.s += x;
    } else if constexpr (OP == CPAR_ROW_MAX) {
        a.m = fmaxf(a.m, x);
    } else if (x > a.m) {
        a.s = a.s * expf(a.m - x) + 1.f;
        a.m = x;
    } else {
        a.s += x == a.m ? 1.f : expf(x - a.m);
    }
}

/* exp(a - m) for a <= m, exactly 1 when equal (including infinities). */
static __device__ __forceinline__ float cpar__exp_below(float a, float m) { return a == m ? 1.f : expf(a - m); }

template <cpar_row_op OP>
static __device__ __forceinline__ cpar__row_state cpar__row_merge(cpar__row_state a, cpar__row_state b) {
    if constexpr (OP == CPAR_ROW_SUM) {
        return {a.m, a.s + b.s};
    } else if constexpr (OP == CPAR_ROW_MAX) {
        return {fmaxf(a.m, b.m), a.s};
    } else {
        const float m = fmaxf(a.m, b.m);
        return {m, a.s * cpar__exp_below(a.m, m) + b.s * cpar__exp_below(b.m, m)};
    }
}

template <cpar_row_op OP> static __device__ __forceinline__ float cpar__row_result(cpar__row_state a) {
    if constexpr (OP == CPAR_ROW_SUM)
        return a.s;
    else if constexpr (OP == CPAR_ROW_MAX)
        return a.m;
    else
        return a.m + logf(a.s);
}

/* Butterfly over the 32 lanes: every lane ends with the warp's state. */
template <cpar_row_op OP> static __device__ __forceinline__ cpar__row_state cpar__row_warp_reduce(cpar__row_state a) {
    for (int off = 16; off > 0; off /= 2) {
        cpar__row_state b = {__shfl_xor_sync(0xffffffffu, a.m, off), __shfl_xor_sync(0xffffffffu, a.s, off)};
        a = cpar__row_merge<OP>(a, b);
    }
    return a;
}

/* Folds this thread's share of one row: packs first, first + stride, ... */
template <cpar_row_op OP, int V, typename T>
static __device__ __forceinline__ cpar__row_state cpar__row_fold(const T *row, int64_t cols, int64_t first,
                                                                 int64_t stride) {
    cpar__row_state a = {-INFINITY, 0.f};
    for (int64_t j = first; j < cols / V; j += stride) {
        const cpar__pack<T, V> p = cpar__load<V>(row + j * V);
        for (int e = 0; e < V; e++) cpar__row_push<OP>(a, cpar__widen(p.v[e]));
    }
    return a;
}

/* Short rows (cols <= CPAR__ROW_WARP_MAX): one warp per row.
 * in: [rows, cols] T row-major, out: [rows] f32. Launch: 256-thread blocks,
 * 8 rows per block step, grid-stride over rows; V = 16 / sizeof(T) elements
 * per load when in is 16-byte aligned and cols % V == 0 (so is every row),
 * else 1. Moves rows * (cols * sizeof(T) + 4) bytes. */
static constexpr int CPAR__ROW_WARP_MAX = 1024, CPAR__ROW_BLOCK = 512;

template <typename T, cpar_row_op OP, int V>
static __global__ void cpar__row_reduce_warp_kernel(float *__restrict__ out, const T *__restrict__ in, int64_t rows,
                                                    int64_t cols) {
    const int lane = threadIdx.x % 32, warps_per_block = blockDim.x / 32;
    for (int64_t r = (int64_t)blockIdx.x * warps_per_block + threadIdx.x / 32; r < rows;
         r += (int64_t)gridDim.x * warps_per_block) {
        cpar__row_state a = cpar__row_fold<OP, V>(in + r * cols, cols, lane, 32);
        a = cpar__row_warp_reduce<OP>(a);
        if (lane == 0) out[r] = cpar__row_result<OP>(a);
    }
}

/* Long rows: one 512-thread block per row (grid-stride over rows), warp
 * butterflies, then warp 0 merges the 16 warp states through shared memory.
 * Layout, vector width and bytes moved as the warp kernel. */
template <typename T, cpar_row_op OP, int V>
static __global__ void cpar__row_reduce_block_kernel(float *__restrict__ out, const T *__restrict__ in, int64_t rows,
                                                     int64_t cols) {
    __shared__ cpar__row_state warp_state[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        cpar__row_state a = cpar__row_fold<OP, V>(in + r * cols, cols, threadIdx.x, blockDim.x);
        a = cpar__row_warp_reduce<OP>(a);
        if (lane == 0) warp_state[warp] = a;
        __syncthreads();
        if (warp == 0) {
            a = lane < nwarps ? warp_state[lane] : cpar__row_state{-INFINITY, 0.f};
            a = cpar__row_warp_reduce<OP>(a);
            if (lane == 0) out[r] = cpar__row_result<OP>(a);
        }
        __syncthreads(); /* warp_state is rewritten for the next row */
    }
}

template <typename T, cpar_row_op OP, int V>
static cudaError_t cpar__launch_row_reduce_v(float *out, const T *in, int64_t rows, int64_t cols, cudaStream_t s) {
    if (cols <= CPAR__ROW_WARP_MAX) {
        auto kernel = cpar__row_reduce_warp_kernel<T, OP, V>;
        CPAR_LAUNCH(kernel, cpar__grid(rows, CPAR__BLOCK / 32), CPAR__BLOCK, 0, s)(out, in, rows, cols);
    } else {
        auto kernel = cpar__row_reduce_block_kernel<T, OP, V>;
        CPAR_LAUNCH(kernel, cpar__grid(rows, 1), CPAR__ROW_BLOCK, 0, s)(out, in, rows, cols);
    }
    return cudaGetLastError();
}

template <typename T, cpar_row_op OP>
static cudaError_t cpar__launch_row_reduce(float *out, const void *in, int64_t rows, int64_t cols, cudaStream_t s) {
    constexpr int V = cpar__vec16<T>;
    const T *x = static_cast<const T *>(in);
    if (cpar__aligned(16, in) && cols % V == 0) return cpar__launch_row_reduce_v<T, OP, V>(out, x, rows, cols, s);
    return cpar__launch_row_reduce_v<T, OP, 1>(out, x, rows, cols, s);
}

cpar_status cpar_dev_row_reduce(float *out, const void *in, cpar_dtype dt, int64_t rows, int64_t cols, cpar_row_op op,
                                cpar_dev_stream s) {
    CPAR__CHECK_COUNT(rows);
    CPAR__CHECK_COUNT(cols);
    CPAR__CHECK_PTR(out, rows > 0);
    CPAR__CHECK_PTR(in, rows > 0 && cols > 0);
    if (!cpar__is_float(dt)) return CPAR__INVALID("dtype %s, expected f32, f16 or bf16", cpar__dtype_name(dt));
    if (op != CPAR_ROW_SUM && op != CPAR_ROW_MAX && op != CPAR_ROW_LOGSUMEXP)
        return CPAR__INVALID("op = %d, expected a cpar_row_op", (int)op);
    if (rows == 0) return CPAR_OK;
    cudaStream_t cs = cpar__stream(s);
    cudaError_t e = cpar__with_float_type(dt, [&](auto t) {
        typedef decltype(t) T;
        switch (op) {
        case CPAR_ROW_MAX: return cpar__launch_row_reduce<T, CPAR_ROW_MAX>(out, in, rows, cols, cs);
        case CPAR_ROW_LOGSUMEXP: return cpar__launch_row_reduce<T, CPAR_ROW_LOGSUMEXP>(out, in, rows, cols, cs);
        default: return cpar__launch_row_reduce<T, CPAR_ROW_SUM>(out, in, rows, cols, cs);
        }
    });
    CPAR__TRY_CUDA(e, "row_reduce kernel launch (%s, %lld x %lld)", cpar__dtype_name(dt), (long long)rows,
                   (long long)cols);
    return CPAR_OK;
}

/* ==== 11. GEMM ==============================================================
 * cublasGemmStridedBatchedEx with CUBLAS_COMPUTE_32F, column-major, arguments
 * checked as cuBLAS would (so a mistake names the argument instead of
 * surfacing as CUBLAS_STATUS_INVALID_VALUE). k == 0 (C = beta * C) runs a
 * small kernel of ours. Uses: 2, 4. */

static cublasHandle_t cpar__blas(cpar_dev_blas h) { return reinterpret_cast<cublasHandle_t>(h); }

/* Default math: no TF32, so fp32 GEMMs are true fp32 and match a host
 * reference. Reduced-precision split-K reductions are disallowed as well, so
 * F16/BF16 outputs are accumulated in fp32 end to end, as cpar.h promises
 * (PyTorch allows them by default; we trade a few shapes' speed for that). */
cpar_status cpar_dev_blas_create(cpar_dev_blas *h) {
    CPAR__CHECK_PTR(h, true);
    cublasHandle_t handle = NULL;
    CPAR__TRY_CUBLAS(cublasCreate(&handle), "cublasCreate");
    cublasStatus_t st = cublasSetMathMode(
        handle, (cublasMath_t)(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    if (st != CUBLAS_STATUS_SUCCESS) {
        cublasDestroy(handle);
        return cpar__dev_fail(CPAR_ERR_CUBLAS, "%s: cublasSetMathMode failed: %s", __func__, cublasGetStatusString(st));
    }
    *h = reinterpret_cast<cpar_dev_blas>(handle);
    return CPAR_OK;
}

cpar_status cpar_dev_blas_destroy(cpar_dev_blas h) {
    if (h == NULL) return CPAR_OK;
    CPAR__TRY_CUBLAS(cublasDestroy(cpar__blas(h)), "cublasDestroy");
    return CPAR_OK;
}

/* C_i = beta * C_i for i < batch: the whole GEMM when k == 0, done here so the
 * result does not depend on how a cuBLAS version treats k == 0. C: batch of
 * m x n, column-major (ldc), stride_c apart; cols = n * batch. beta == 0
 * writes zeros without reading C (BLAS). Launch: cpar__shape_2d over m x cols.
 * Moves up to 2 * m * cols * sizeof(T) bytes. */
template <typename T>
static __global__ void cpar__scale_matrices_kernel(T *C, int64_t m, int64_t n, int64_t ldc, int64_t stride_c,
                                                   int64_t cols, float beta) {
    const int64_t r0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t q = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; q < cols; q += (int64_t)gridDim.y * blockDim.y) {
        T *col = C + q / n * stride_c + q % n * ldc;
        for (int64_t r = r0; r < m; r += (int64_t)gridDim.x * blockDim.x)
            col[r] = cpar__narrow<T>(beta == 0.f ? 0.f : beta * cpar__widen(col[r]));
    }
}

template <typename T>
static cudaError_t cpar__launch_scale_matrices(void *C, int m, int n, int ldc, int64_t stride_c, int batch, float beta,
                                               cudaStream_t s) {
    const int64_t cols = (int64_t)n * batch;
    const cpar__shape sh = cpar__shape_2d(m, cols);
    auto kernel = cpar__scale_matrices_kernel<T>;
    CPAR_LAUNCH(kernel, sh.grid, sh.block, 0, s)(static_cast<T *>(C), m, n, ldc, stride_c, cols, beta);
    return cudaGetLastError();
}

static cudaDataType cpar__cuda_dtype(cpar_dtype dt) {
    return dt == CPAR_F16 ? CUDA_R_16F : dt == CPAR_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

cpar_status cpar_dev_gemm(cpar_dev_blas h, cpar_dev_stream s, int transa, int transb, int m, int n, int k, float alpha,
                          const void *A, cpar_dtype ab_dtype, int lda, int64_t stride_a, const void *B, int ldb,
                          int64_t stride_b, float beta, void *C, cpar_dtype c_dtype, int ldc, int64_t stride_c,
                          int batch) {
    CPAR__CHECK_PTR(h, true);
    if (!cpar__is_float(ab_dtype) || (c_dtype != CPAR_F32 && c_dtype != ab_dtype))
        return CPAR__INVALID("unsupported dtypes A/B %s, C %s (A/B: f32, f16 or bf16; C: f32 or A/B's dtype)",
                             cpar__dtype_name(ab_dtype), cpar__dtype_name(c_dtype));
    CPAR__CHECK_COUNT(m);
    CPAR__CHECK_COUNT(n);
    CPAR__CHECK_COUNT(k);
    CPAR__CHECK_COUNT(batch);
    /* Leading dimensions are the row counts of the matrices as stored. */
    const int a_rows = transa ? k : m, b_rows = transb ? n : k;
    if (lda < (a_rows > 1 ? a_rows : 1))
        return CPAR__INVALID("lda = %d, expected >= %d (rows of A as stored: %s)", lda, a_rows > 1 ? a_rows : 1,
                             transa ? "k, A transposed" : "m");
    if (ldb < (b_rows > 1 ? b_rows : 1))
        return CPAR__INVALID("ldb = %d, expected >= %d (rows of B as stored: %s)", ldb, b_rows > 1 ? b_rows : 1,
                             transb ? "n, B transposed" : "k");
    if (ldc < (m > 1 ? m : 1)) return CPAR__INVALID("ldc = %d, expected >= %d (m)", ldc, m > 1 ? m : 1);
    CPAR__CHECK_COUNT(stride_a);
    CPAR__CHECK_COUNT(stride_b);
    CPAR__CHECK_COUNT(stride_c);
    if (m == 0 || n == 0 || batch == 0) return CPAR_OK;
    CPAR__CHECK_PTR(A, k > 0);
    CPAR__CHECK_PTR(B, k > 0);
    CPAR__CHECK_PTR(C, true);
    if (k == 0) {
        if (beta == 1.f) return CPAR_OK;
        cudaError_t e = cpar__with_float_type(c_dtype, [&](auto t) {
            return cpar__launch_scale_matrices<decltype(t)>(C, m, n, ldc, stride_c, batch, beta, cpar__stream(s));
        });
        CPAR__TRY_CUDA(e, "scale kernel launch (k = 0: C = beta * C, %s)", cpar__dtype_name(c_dtype));
        return CPAR_OK;
    }
    cublasHandle_t handle = cpar__blas(h);
    CPAR__TRY_CUBLAS(cublasSetStream(handle, cpar__stream(s)), "cublasSetStream");
    const cudaDataType ab = cpar__cuda_dtype(ab_dtype), c = cpar__cuda_dtype(c_dtype);
    cublasStatus_t st = cublasGemmStridedBatchedEx(
        handle, transa ? CUBLAS_OP_T : CUBLAS_OP_N, transb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha, A, ab, lda,
        stride_a, B, ab, ldb, stride_b, &beta, C, c, ldc, stride_c, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS)
        return cpar__dev_fail(CPAR_ERR_CUBLAS,
                              "%s: cublasGemmStridedBatchedEx(%s%s, m=%d n=%d k=%d batch=%d, A/B %s, C %s) failed: %s",
                              __func__, transa ? "T" : "N", transb ? "T" : "N", m, n, k, batch,
                              cpar__dtype_name(ab_dtype), cpar__dtype_name(c_dtype), cublasGetStatusString(st));
    return CPAR_OK;
}

/* ==== RNG and dropout kernels (issue 4, in progress) ===================== */
#include "wip/rng_kernels.cu"

/* ==== Embedding and cross-entropy kernels (issue 4, in progress) ========= */
#include "wip/xent_kernels.cu"
