/* SPDX-License-Identifier: MIT */
/* cpar_kernels.cu — everything in cpar that touches a GPU.
 *
 * The device layer of cpar.h §16 (cpar_dev_*: memory, copies, streams, events,
 * cuBLAS GEMMs) and every CUDA kernel with its launcher. cpar.c reaches the GPU
 * only through these C-linkage functions and never includes a CUDA header.
 *
 * Two builds of this one file:
 *   nvcc -std=c++17 -O3 -gencode arch=compute_80,code=sm_80 ... -c cpar_kernels.cu
 *   g++  -std=c++17 -DCPAR_SIM -I. -x c++ -c cpar_kernels.cu   (tests/cudasim.h:
 *        the same kernels run on the CPU, threads of a block as fibers)
 * so kernels use only what the simulator models: launches go through
 * CPAR_LAUNCH, dynamic shared memory through CPAR_DYN_SMEM, and inline PTX
 * only inside the tensor-core wrappers of section 15, which the sim build
 * replaces with exact lane-level emulations.
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
 *    4. Kernel toolkit: element types, the SFU's 2^x, vector packs, launch geometry
 *    5. Fill
 *    6. Cast
 *    7. axpby
 *    8. Reduce into (the local step of reductions over device memory)
 *    9. Pitched 2-D copy (split, concat, all-to-all packing)
 *   10. Row reduce (sum, max, log-sum-exp over the last dimension)
 *   11. GEMM (cuBLAS; k == 0 by a kernel of ours)
 *   12. RNG: random fills and dropout
 *   13. Vocabulary-parallel cross entropy
 *   14. Vocabulary-parallel embedding
 *   15. Tensor-core wrappers: mma.sync m16n8k16, ldmatrix, cp.async
 *   16. Local attention: the flash forward and backward kernels
 *   17. Ring attention: the fp32 LSE merge
 *   18. Mamba context parallelism: group-replica sums, depthwise causal conv1d, packed (THD) reorder
 *   19. RMSNorm forward (with an optional fused residual add) and backward
 *   20. GeLU (tanh approximation) forward and backward
 *   21. Training: the fused AdamW step and a deterministic sum of squares
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

/* The white-box suites (tests/test_mma.cu, tests/test_attn_bwd.cu) include
 * this file to reach its static device functions. They define
 * CPAR_KERNELS_ATTENTION_ONLY, which leaves out every section the attention
 * kernels do not stand on (5-11, 13-14, 17-21): each such suite then
 * compiles in 25 s instead of 66 (g++ -O1 -g, 2026-11-28). test_mma also
 * defines CPAR_KERNELS_MMA_ONLY, which leaves out sections 12 and 16 too. */

#define CPAR_INTERNAL /* the device layer's declarations (cpar.h §16) */
#include "cpar.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <type_traits>

/* cpar.c built without -DCPAR_WITH_DEVICE defines host-only stubs of this
 * file's functions (weak) and this variable; linking both then fails on this
 * one name, which says what to change, instead of on every cpar_dev_*. */
extern "C" int cpar_link_error_cpar_c_built_without_CPAR_WITH_DEVICE;
int cpar_link_error_cpar_c_built_without_CPAR_WITH_DEVICE = 1;

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

static inline size_t cpar__dtype_size(cpar_dtype dt) {
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
/* CUDA's devices 0..n-1 up to the first below compute capability 8.0, whose
 * reason stays in cpar_dev_last_error(): the kernels need sm_80 (mma.sync on
 * bf16, cp.async), and a T4 or V100 would otherwise fail at its first launch
 * with "no kernel image is available". */
int cpar_dev_count(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cpar__cuda_fail(e, __func__, "cudaGetDeviceCount");
        return 0;
    }
    if (n == 0) cpar__dev_fail(CPAR_ERR_UNSUPPORTED, "%s: cudaGetDeviceCount found no GPU", __func__);
    for (int d = 0; d < n; d++) {
        int major = 0, minor = 0;
        if ((e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d)) != cudaSuccess ||
            (e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d)) != cudaSuccess) {
            cpar__cuda_fail(e, __func__, "cudaDeviceGetAttribute(compute capability, %d)", d);
            return d;
        }
        if (major < 8) {
            cpar__dev_fail(CPAR_ERR_UNSUPPORTED,
                           "%s: GPU %d has compute capability %d.%d; cpar's kernels need 8.0 or newer (A100, RTX 30xx "
                           "and later), so %d of the %d GPUs visible are usable", __func__, d, major, minor, d, n);
            return d;
        }
    }
    return n;
}

cpar_status cpar_dev_set(int device) {
    if (device < 0) return CPAR__INVALID("device = %d, expected >= 0", device);
    CPAR__TRY_CUDA(cudaSetDevice(device), "cudaSetDevice(%d)", device);
    return CPAR_OK;
}

/* Kernels on the current device may read and write peer's memory (the device
 * backend's reductions read every member's buffer in place). Enabling it
 * twice is fine; a pair without it is CPAR_ERR_UNSUPPORTED. */
cpar_status cpar_dev_peer_access(int peer) {
    int cur = 0, can = 0;
    if (peer < 0) return CPAR__INVALID("peer = %d, expected >= 0", peer);
    CPAR__TRY_CUDA(cudaGetDevice(&cur), "cudaGetDevice");
    if (peer == cur) return CPAR_OK;
    CPAR__TRY_CUDA(cudaDeviceCanAccessPeer(&can, cur, peer), "cudaDeviceCanAccessPeer(%d, %d)", cur, peer);
    if (!can)
        return cpar__dev_fail(CPAR_ERR_UNSUPPORTED, "%s: GPU %d cannot access the memory of GPU %d (no peer access)",
                              __func__, cur, peer);
    cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError(); /* not an error here: clear it */
        return CPAR_OK;
    }
    CPAR__TRY_CUDA(e, "cudaDeviceEnablePeerAccess(%d)", peer);
    return CPAR_OK;
}

cpar_status cpar_dev_peer_query(int device, int peer, bool *can) {
    CPAR__CHECK_PTR(can, true);
    *can = false;
    if (device < 0) return CPAR__INVALID("device = %d, expected >= 0", device);
    if (peer < 0) return CPAR__INVALID("peer = %d, expected >= 0", peer);
    if (peer == device) {
        *can = true;
        return CPAR_OK;
    }
    int c = 0;
    CPAR__TRY_CUDA(cudaDeviceCanAccessPeer(&c, device, peer), "cudaDeviceCanAccessPeer(%d, %d)", device, peer);
    *can = c != 0;
    return CPAR_OK;
}

cpar_status cpar_dev_malloc(void **p, size_t bytes) {
    CPAR__CHECK_PTR(p, true);
    *p = NULL;
    if (bytes == 0) return CPAR_OK;
    CPAR__TRY_CUDA(cudaMalloc(p, bytes), "cudaMalloc(%zu bytes)", bytes);
    return CPAR_OK;
}

cpar_status cpar_dev_host_alloc(void **p, size_t bytes) {
    CPAR__CHECK_PTR(p, true);
    *p = NULL;
    if (bytes == 0) return CPAR_OK;
    CPAR__TRY_CUDA(cudaMallocHost(p, bytes), "cudaMallocHost(%zu bytes)", bytes);
    return CPAR_OK;
}

cpar_status cpar_dev_host_free(void *p) {
    if (p) CPAR__TRY_CUDA(cudaFreeHost(p), "cudaFreeHost");
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
    /* Between two GPUs too (the device backend's peers): unified addressing
     * names the devices by the pointers. */
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

/* Streams are created non-blocking: work that the caller or a library puts
 * on the legacy NULL stream neither waits for cpar's streams nor holds them
 * up (a blocking stream would serialise with every such call). The price:
 * nothing orders cpar's work with the NULL stream's; a caller that hands
 * cpar data produced there synchronises first (cudaDeviceSynchronize, or
 * cudaStreamSynchronize(0)), as with any other stream. */
cpar_status cpar_dev_stream_create(cpar_dev_stream *s) {
    CPAR__CHECK_PTR(s, true);
    cudaStream_t cs = NULL;
    CPAR__TRY_CUDA(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
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
 * Element conversions (all float math is fp32), the SFU's 2^x (cpar__ex2:
 * sections 13, 16 and 20), aligned vector packs, the grid-stride thread
 * index and the launch geometry shared by sections 5-10. */

static __device__ __forceinline__ float cpar__widen(float v) { return v; }
static __device__ __forceinline__ float cpar__widen(__half v) { return __half2float(v); }
static __device__ __forceinline__ float cpar__widen(__nv_bfloat16 v) { return __bfloat162float(v); }
static __device__ __forceinline__ int32_t cpar__widen(int32_t v) { return v; }
static __device__ __forceinline__ int64_t cpar__widen(int64_t v) { return v; }
static __device__ __forceinline__ uint8_t cpar__widen(uint8_t v) { return v; }

/* 2^x by the SFU's approximation (flush-to-zero; ex2(-inf) = +0), the
 * softmax exponent of FlashAttention-2 and the cross entropy: one
 * MUFU.EX2, where exp2f adds a range reduction for denormal results a
 * softmax cannot tell from 0 (and expf a multiply and two more fixups).
 * The simulator rounds it exactly. */
#ifndef CPAR_SIM
static __device__ __forceinline__ float cpar__ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
#else
static __device__ __forceinline__ float cpar__ex2(float x) { return exp2f(x); }
#endif

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

/* Full unrolling keeps small arrays (packs, mma fragments) in registers
 * under nvcc; CPAR__ROLLED keeps a loop rolled. g++ (the sim build) does not
 * know the pragma. */
#ifndef CPAR__UNROLL
#ifdef CPAR_SIM
#define CPAR__UNROLL
#define CPAR__ROLLED
#else
#define CPAR__UNROLL _Pragma("unroll")
#define CPAR__ROLLED _Pragma("unroll 1")
#endif
#endif

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

static inline cpar__shape cpar__shape_2d(int64_t width, int64_t height) {
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

#ifndef CPAR_KERNELS_ATTENTION_ONLY /* sections 5-11 */

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

#endif /* sections 5-11 */

#ifndef CPAR_KERNELS_MMA_ONLY /* section 12 */

/* ==== 12. RNG: random fills and dropout ======================================
 * The device half of cpar.h §9 (the host half and its reference loops are
 * cpar.c §15): Philox4x32-10, the uniform/normal transforms and dropout.
 * Element i of a draw from state (seed, offset) is word i % 4 of the Philox
 * block with counter {lo32(c), hi32(c), 0, 0}, c = offset + i / 4, and key
 * {lo32(seed), hi32(seed)}; each thread owns whole blocks (4 consecutive
 * elements), grid-stride over blocks, so the numbers do not depend on the
 * launch shape.
 *
 * Bit equality with the host: the float transforms are written with
 * __fmul_rn/__fadd_rn/__fsub_rn/__fdiv_rn/__fsqrt_rn and explicit fmaf, which
 * nvcc never contracts or approximates, in exactly the order of cpar.c's
 * twins (cpar__rng_log, cpar__rng_sincos2pi, cpar__rng_normal4,
 * cpar__rng_scale_uniform); F16/BF16 outputs round to nearest even on both
 * sides. Keep the two copies identical when editing either.
 * Uses: 2 (errors), 4 (widen/narrow, packs, launch geometry). */

static constexpr uint32_t CPAR__PHILOX_M0 = 0xD2511F53u, CPAR__PHILOX_M1 = 0xCD9E8D57u;
static constexpr uint32_t CPAR__PHILOX_W0 = 0x9E3779B9u, CPAR__PHILOX_W1 = 0xBB67AE85u;
static constexpr float CPAR__RNG_2POW_M24 = 5.9604644775390625e-08f; /* 2^-24 */

struct cpar__u4 {
    uint32_t w[4];
};

/* The Philox4x32-10 block of counter {lo32(c), hi32(c), lo32(sub), hi32(sub)}
 * (curand's offset 4c of subsequence sub), key seed. */
static __device__ __forceinline__ cpar__u4 cpar__philox4_sub(uint64_t seed, uint64_t c, uint64_t sub) {
    uint32_t c0 = (uint32_t)c, c1 = (uint32_t)(c >> 32), c2 = (uint32_t)sub, c3 = (uint32_t)(sub >> 32);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        if (r) {
            k0 += CPAR__PHILOX_W0;
            k1 += CPAR__PHILOX_W1;
        }
        const uint32_t h0 = __umulhi(CPAR__PHILOX_M0, c0), l0 = CPAR__PHILOX_M0 * c0;
        const uint32_t h1 = __umulhi(CPAR__PHILOX_M1, c2), l1 = CPAR__PHILOX_M1 * c2;
        c0 = h1 ^ c1 ^ k0;
        c1 = l1;
        c2 = h0 ^ c3 ^ k1;
        c3 = l0;
    }
    return {{c0, c1, c2, c3}};
}

/* The Philox4x32-10 block of counter {lo32(c), hi32(c), 0, 0}, key seed. */
static __device__ __forceinline__ cpar__u4 cpar__philox4(uint64_t seed, uint64_t c) {
    return cpar__philox4_sub(seed, c, 0);
}

/* u in [0, 1): the top 24 bits of w times 2^-24 (exact). */
static __device__ __forceinline__ float cpar__rng_u01(uint32_t w) {
    return __fmul_rn((float)(w >> 8), CPAR__RNG_2POW_M24);
}

/* ln x for a normal float x > 0; twin of cpar.c's cpar__rng_log. */
static __device__ __forceinline__ float cpar__rng_log(float x) {
    uint32_t ix = __float_as_uint(x);
    int k = (int)(ix >> 23) - 127;
    ix &= 0x007fffffu;
    const uint32_t i = (ix + (0x95f64u << 3)) & 0x800000u;
    const float m = __uint_as_float(ix | (i ^ 0x3f800000u));
    k += (int)(i >> 23);
    const float f = __fsub_rn(m, 1.0f);
    const float s = __fdiv_rn(f, __fadd_rn(2.0f, f));
    const float z = __fmul_rn(s, s);
    const float w = __fmul_rn(z, z);
    const float t1 = __fmul_rn(w, fmaf(w, 2.4279078841e-01f, 4.0000972152e-01f));
    const float t2 = __fmul_rn(z, fmaf(w, 2.8498786688e-01f, 6.6666662693e-01f));
    const float r = __fadd_rn(t2, t1);
    const float hfsq = __fmul_rn(__fmul_rn(0.5f, f), f);
    const float dk = (float)k;
    const float inner = fmaf(dk, 9.0580006145e-06f, __fmul_rn(s, __fadd_rn(hfsq, r)));
    return fmaf(dk, 6.9313812256e-01f, -__fsub_rn(__fsub_rn(hfsq, inner), f));
}

/* sin and cos of x in [0, pi/4]; twin of cpar__rng_sincos_poly. */
static __device__ __forceinline__ void cpar__rng_sincos_poly(float x, float *sn, float *cs) {
    const float z = __fmul_rn(x, x);
    const float ps = fmaf(fmaf(-1.9515295891e-4f, z, 8.3321608736e-3f), z, -1.6666654611e-1f);
    *sn = fmaf(__fmul_rn(z, ps), x, x);
    const float pc = fmaf(fmaf(2.443315711809948e-5f, z, -1.388731625493765e-3f), z, 4.166664568298827e-2f);
    *cs = fmaf(__fmul_rn(z, pc), z, fmaf(-0.5f, z, 1.0f));
}

/* sin and cos of 2 pi j / 2^24 for a 24-bit j; twin of cpar__rng_sincos2pi. */
static __device__ __forceinline__ void cpar__rng_sincos2pi(uint32_t j, float *sn, float *cs) {
    const uint32_t o = j >> 21, r = j & 0x1fffffu;
    const float x = __fmul_rn((float)((o & 1u) ? 0x200000u - r : r), 0.785398163397448309616f * 4.76837158203125e-07f);
    float s, c;
    cpar__rng_sincos_poly(x, &s, &c);
    switch (o) {
    case 0: *sn = s, *cs = c; break;
    case 1: *sn = c, *cs = s; break;
    case 2: *sn = c, *cs = -s; break;
    case 3: *sn = s, *cs = -c; break;
    case 4: *sn = -s, *cs = -c; break;
    case 5: *sn = -c, *cs = -s; break;
    case 6: *sn = -c, *cs = s; break;
    default: *sn = -s, *cs = c; break;
    }
}

/* The four standard normals of one block; twin of cpar__rng_normal4. */
static __device__ __forceinline__ void cpar__rng_normal4(const cpar__u4 &w, float z[4]) {
    for (int p = 0; p < 2; p++) {
        const float u1 = __fmul_rn((float)((w.w[2 * p] >> 8) + 1u), CPAR__RNG_2POW_M24);
        const float r = __fsqrt_rn(__fmul_rn(-2.0f, cpar__rng_log(u1)));
        float sn, cs;
        cpar__rng_sincos2pi(w.w[2 * p + 1] >> 8, &sn, &cs);
        z[2 * p] = __fmul_rn(r, cs);
        z[2 * p + 1] = __fmul_rn(r, sn);
    }
}

/* lo + (hi - lo) * u, kept below hi; twin of cpar__rng_scale_uniform. */
static __device__ __forceinline__ float cpar__rng_scale_uniform(uint32_t w, float lo, float hi) {
    const float v = fmaf(cpar__rng_u01(w), __fsub_rn(hi, lo), lo);
    return v < hi ? v : lo;
}

/* Store the elements i0..i0+3 (those below n) of one block: one aligned
 * 4-element pack when VEC and the block is whole, else one by one. */
template <bool VEC, typename T>
static __device__ __forceinline__ void cpar__rng_store4(T *p, int64_t i0, int64_t n, const float v[4]) {
    if (VEC && i0 + 4 <= n) {
        cpar__pack<T, 4> pk;
        for (int e = 0; e < 4; e++) pk.v[e] = cpar__narrow<T>(v[e]);
        cpar__store<4>(p + i0, pk);
    } else {
        for (int e = 0; e < 4 && i0 + e < n; e++) p[i0 + e] = cpar__narrow<T>(v[e]);
    }
}

/* p: [n] T (F32/F16/BF16). MODE 0: uniform in [a, b) (lo, hi); MODE 1:
 * normal with mean a and std b. Launch: 1-D grid-stride over ceil(n/4)
 * blocks, 256 threads, one Philox block per thread step; VEC when p is
 * aligned to 4 elements. Moves n * sizeof(T) bytes. */
template <typename T, int MODE, bool VEC>
static __global__ void cpar__rng_fill_kernel(T *__restrict__ p, int64_t n, uint64_t seed, uint64_t offset, float a,
                                             float b) {
    const int64_t blocks = (n + 3) / 4, step = cpar__thread_count();
    for (int64_t g = cpar__thread_id(); g < blocks; g += step) {
        const cpar__u4 w = cpar__philox4(seed, offset + (uint64_t)g);
        float v[4];
        if (MODE == 0) {
            for (int e = 0; e < 4; e++) v[e] = cpar__rng_scale_uniform(w.w[e], a, b);
        } else {
            cpar__rng_normal4(w, v);
            for (int e = 0; e < 4; e++) v[e] = fmaf(v[e], b, a);
        }
        cpar__rng_store4<VEC>(p, g * 4, n, v);
    }
}

template <typename T, int MODE>
static cudaError_t cpar__launch_rng_fill(void *p, int64_t n, uint64_t seed, uint64_t offset, float a, float b,
                                         cudaStream_t s) {
    T *q = static_cast<T *>(p);
    const unsigned grid = cpar__grid((n + 3) / 4, CPAR__BLOCK);
    if (cpar__aligned(4 * sizeof(T), p)) {
        auto kernel = cpar__rng_fill_kernel<T, MODE, true>;
        CPAR_LAUNCH(kernel, grid, CPAR__BLOCK, 0, s)(q, n, seed, offset, a, b);
    } else {
        auto kernel = cpar__rng_fill_kernel<T, MODE, false>;
        CPAR_LAUNCH(kernel, grid, CPAR__BLOCK, 0, s)(q, n, seed, offset, a, b);
    }
    return cudaGetLastError();
}

cpar_status cpar_dev_rng_uniform(void *p, cpar_dtype dt, int64_t n, uint64_t seed, uint64_t offset, float lo,
                                 float hi, cpar_dev_stream s) {
    CPAR__CHECK_COUNT(n);
    CPAR__CHECK_PTR(p, n > 0);
    if (!cpar__is_float(dt)) return CPAR__INVALID("dtype %s, expected f32, f16 or bf16", cpar__dtype_name(dt));
    if (!(lo <= hi)) return CPAR__INVALID("lo = %g > hi = %g", (double)lo, (double)hi);
    if (n == 0) return CPAR_OK;
    cudaError_t e = cpar__with_float_type(dt, [&](auto t) {
        return cpar__launch_rng_fill<decltype(t), 0>(p, n, seed, offset, lo, hi, cpar__stream(s));
    });
    CPAR__TRY_CUDA(e, "rng uniform kernel launch (%s, n = %lld)", cpar__dtype_name(dt), (long long)n);
    return CPAR_OK;
}

cpar_status cpar_dev_rng_normal(void *p, cpar_dtype dt, int64_t n, uint64_t seed, uint64_t offset, float mean,
                                float std, cpar_dev_stream s) {
    CPAR__CHECK_COUNT(n);
    CPAR__CHECK_PTR(p, n > 0);
    if (!cpar__is_float(dt)) return CPAR__INVALID("dtype %s, expected f32, f16 or bf16", cpar__dtype_name(dt));
    if (!(std >= 0.f)) return CPAR__INVALID("std = %g, expected >= 0", (double)std);
    if (n == 0) return CPAR_OK;
    cudaError_t e = cpar__with_float_type(dt, [&](auto t) {
        return cpar__launch_rng_fill<decltype(t), 1>(p, n, seed, offset, mean, std, cpar__stream(s));
    });
    CPAR__TRY_CUDA(e, "rng normal kernel launch (%s, n = %lld)", cpar__dtype_name(dt), (long long)n);
    return CPAR_OK;
}

/* out = (in * keep) * scale for n elements of T; keep = mask_in[i] != 0 when
 * mask_in (backward from a stored mask), else u_i >= p from the Philox block
 * (forward, or backward by recomputation); mask_out (may be NULL) = keep.
 * in may equal out (in place: each element is read before it is written, by
 * the same thread), so neither is __restrict__. Launch: 1-D grid-stride over
 * ceil(n/4) blocks, 256 threads; VEC when in and out are aligned to 4
 * elements and the masks to 4 bytes. Moves n * (2 * sizeof(T) + 1) bytes
 * with a mask, n * 2 * sizeof(T) without. */
template <typename T, bool VEC>
static __global__ void cpar__dropout_kernel(const T *in, T *out, const uint8_t *__restrict__ mask_in,
                                            uint8_t *__restrict__ mask_out, int64_t n, float p, float scale,
                                            uint64_t seed, uint64_t offset) {
    const int64_t blocks = (n + 3) / 4, step = cpar__thread_count();
    for (int64_t g = cpar__thread_id(); g < blocks; g += step) {
        const int64_t i0 = g * 4;
        const bool whole = VEC && i0 + 4 <= n;
        float x[4] = {0.f, 0.f, 0.f, 0.f};
        uint8_t keep[4] = {0, 0, 0, 0};
        if (whole) {
            const cpar__pack<T, 4> pk = cpar__load<4>(in + i0);
            for (int e = 0; e < 4; e++) x[e] = cpar__widen(pk.v[e]);
        } else {
            for (int e = 0; e < 4 && i0 + e < n; e++) x[e] = cpar__widen(in[i0 + e]);
        }
        if (mask_in) {
            if (whole) {
                const cpar__pack<uint8_t, 4> mk = cpar__load<4>(mask_in + i0);
                for (int e = 0; e < 4; e++) keep[e] = mk.v[e] != 0;
            } else {
                for (int e = 0; e < 4 && i0 + e < n; e++) keep[e] = mask_in[i0 + e] != 0;
            }
        } else {
            const cpar__u4 w = cpar__philox4(seed, offset + (uint64_t)g);
            for (int e = 0; e < 4; e++) keep[e] = cpar__rng_u01(w.w[e]) >= p;
        }
        float v[4];
        for (int e = 0; e < 4; e++) v[e] = __fmul_rn(__fmul_rn(x[e], (float)keep[e]), scale);
        cpar__rng_store4<VEC>(out, i0, n, v);
        if (mask_out) {
            if (whole) {
                cpar__pack<uint8_t, 4> mk;
                for (int e = 0; e < 4; e++) mk.v[e] = keep[e];
                cpar__store<4>(mask_out + i0, mk);
            } else {
                for (int e = 0; e < 4 && i0 + e < n; e++) mask_out[i0 + e] = keep[e];
            }
        }
    }
}

template <typename T>
static cudaError_t cpar__launch_dropout(const void *in, void *out, const uint8_t *mask_in, uint8_t *mask_out,
                                        int64_t n, float p, float scale, uint64_t seed, uint64_t offset,
                                        cudaStream_t s) {
    const T *x = static_cast<const T *>(in);
    T *y = static_cast<T *>(out);
    const unsigned grid = cpar__grid((n + 3) / 4, CPAR__BLOCK);
    if (cpar__aligned(4 * sizeof(T), in, out) && cpar__aligned(4, mask_in, mask_out)) {
        auto kernel = cpar__dropout_kernel<T, true>;
        CPAR_LAUNCH(kernel, grid, CPAR__BLOCK, 0, s)(x, y, mask_in, mask_out, n, p, scale, seed, offset);
    } else {
        auto kernel = cpar__dropout_kernel<T, false>;
        CPAR_LAUNCH(kernel, grid, CPAR__BLOCK, 0, s)(x, y, mask_in, mask_out, n, p, scale, seed, offset);
    }
    return cudaGetLastError();
}

static cpar_status cpar__dropout_dev(const char *func, const void *in, void *out, const uint8_t *mask_in,
                                     uint8_t *mask_out, cpar_dtype dt, int64_t n, float p, float scale,
                                     uint64_t seed, uint64_t offset, cpar_dev_stream s) {
    if (n < 0) return cpar__dev_fail(CPAR_ERR_INVALID, "%s: n = %lld, expected >= 0", func, (long long)n);
    if (n > 0 && (!in || !out))
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: %s is NULL", func, in ? "the output" : "the input");
    if (!cpar__is_float(dt))
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: dtype %s, expected f32, f16 or bf16", func, cpar__dtype_name(dt));
    if (!(p >= 0.f && p < 1.f)) return cpar__dev_fail(CPAR_ERR_INVALID, "%s: p = %g, expected 0 <= p < 1", func, (double)p);
    if (n == 0) return CPAR_OK;
    cudaError_t e = cpar__with_float_type(dt, [&](auto t) {
        return cpar__launch_dropout<decltype(t)>(in, out, mask_in, mask_out, n, p, scale, seed, offset,
                                                 cpar__stream(s));
    });
    if (e != cudaSuccess)
        return cpar__cuda_fail(e, func, "dropout kernel launch (%s, n = %lld)", cpar__dtype_name(dt), (long long)n);
    return CPAR_OK;
}

cpar_status cpar_dev_dropout_forward(const void *x, void *y, uint8_t *mask, cpar_dtype dt, int64_t n, float p,
                                     float scale, uint64_t seed, uint64_t offset, cpar_dev_stream s) {
    return cpar__dropout_dev(__func__, x, y, NULL, mask, dt, n, p, scale, seed, offset, s);
}

cpar_status cpar_dev_dropout_backward(const void *dy, void *dx, const uint8_t *mask, cpar_dtype dt, int64_t n,
                                      float p, float scale, uint64_t seed, uint64_t offset, cpar_dev_stream s) {
    return cpar__dropout_dev(__func__, dy, dx, mask, NULL, dt, n, p, scale, seed, offset, s);
}

#endif /* section 12 */

#ifndef CPAR_KERNELS_ATTENTION_ONLY /* sections 13-14 */

/* ==== 13. Vocabulary-parallel cross entropy =================================
 * The device half of cpar.h §10 (host half and reference loops: cpar.c §16).
 * Forward is three launches around two all-reduces: xent_local reads the
 * logits once (online softmax: local max and exp-sum in one pass, plus the
 * target's logit and the logit sum), xent_rescale moves the exp-sum to the
 * global max after the MAX all-reduce, xent_finalize forms loss and stats
 * after the SUM all-reduce. Backward is one element-wise pass. Log-
 * probabilities are z - lse, never log(softmax). A target outside [0, vocab)
 * gives NaN (loss and dlogits row), see cpar.h §10.
 * Uses: 2 (errors), 4 (widen/narrow, packs, launch geometry), 10 (the online
 * log-sum-exp state: cpar__row_push/merge/warp_reduce). */

template <typename I> static __device__ __forceinline__ int64_t cpar__xent_target(const I *t, int64_t r) {
    return (int64_t)t[r];
}

/* Butterfly sum over the 32 lanes: every lane ends with the total. */
static __device__ __forceinline__ float cpar__xent_warp_sum(float v) {
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* The local pass over one row: logit state (m, s) and the logit sum. */
struct cpar__xent_acc {
    cpar__row_state a;
    float zsum;
};

/* A pack of V logits at a time: its maximum first, the state moved to it
 * at most once, then one exponent per logit, 2^((z - m) log2 e) on the SFU
 * (cpar__ex2): about six instructions per logit where a row_push per logit
 * (a compare, a branch and an expf each) took twelve, which bound the bf16
 * forward at 0.39 of the copy bandwidth on an H200. A pack whose maximum
 * is infinite (a +inf, or nothing but -inf and NaN: z - m would be NaN for
 * an infinity equal to m) takes the row_push path, which counts each logit
 * equal to m as exactly 1. */
template <int V, bool SMOOTH, typename T>
static __device__ __forceinline__ cpar__xent_acc cpar__xent_fold(const T *row, int64_t cols, int64_t first_pack,
                                                                 int64_t stride) {
    constexpr float log2e = 1.4426950408889634f;
    cpar__xent_acc acc = {{-INFINITY, 0.f}, 0.f};
    for (int64_t j = first_pack; j < cols / V; j += stride) {
        const cpar__pack<T, V> p = cpar__load<V>(row + j * V);
        float z[V], pm = -INFINITY;
CPAR__UNROLL
        for (int e = 0; e < V; e++) {
            z[e] = cpar__widen(p.v[e]);
            pm = fmaxf(pm, z[e]); /* NaN is skipped here and carried by the sum below */
            if (SMOOTH) acc.zsum += z[e];
        }
        if (isinf(pm)) { /* +inf, or every logit -inf or NaN */
CPAR__UNROLL
            for (int e = 0; e < V; e++) cpar__row_push<CPAR_ROW_LOGSUMEXP>(acc.a, z[e]);
            continue;
        }
        if (pm > acc.a.m) {
            acc.a.s *= cpar__ex2((acc.a.m - pm) * log2e); /* m = -inf: 0 */
            acc.a.m = pm;
        }
        float s = 0.f;
CPAR__UNROLL
        for (int e = 0; e < V; e++) s += cpar__ex2((z[e] - acc.a.m) * log2e);
        acc.a.s += s;
    }
    return acc;
}

template <bool SMOOTH>
static __device__ __forceinline__ cpar__xent_acc cpar__xent_warp_reduce(cpar__xent_acc acc) {
    acc.a = cpar__row_warp_reduce<CPAR_ROW_LOGSUMEXP>(acc.a);
    if (SMOOTH) acc.zsum = cpar__xent_warp_sum(acc.zsum);
    return acc;
}

/* Writes a row's results (called by one thread per row). */
template <bool SMOOTH, typename T, typename I>
static __device__ __forceinline__ void cpar__xent_local_store(cpar__xent_acc acc, const T *row, const I *target,
                                                              int64_t r, int64_t rows, int64_t cols, int64_t first,
                                                              int64_t vocab, float *m_loc, float *part) {
    const int64_t t = cpar__xent_target(target, r);
    m_loc[r] = acc.a.m;
    part[r] = acc.a.s;
    part[rows + r] = (t < 0 || t >= vocab) ? NAN : (t >= first && t < first + cols) ? cpar__widen(row[t - first]) : 0.f;
    if (SMOOTH) part[2 * rows + r] = acc.zsum;
}

/* Short rows (cols <= CPAR__ROW_WARP_MAX): one warp per row, 8 rows per
 * 256-thread block step, grid-stride over rows. logits [rows, cols] T
 * row-major, target [rows] I; m_loc [rows], part [2 or 3, rows] f32. V = 16 /
 * sizeof(T) when logits is 16-byte aligned and cols % V == 0, else 1. Moves
 * rows * (cols * sizeof(T) + sizeof(I) + 12 or 16) bytes. */
template <typename T, typename I, int V, bool SMOOTH>
static __global__ void cpar__xent_local_warp_kernel(const T *__restrict__ logits, const I *__restrict__ target,
                                                    int64_t rows, int64_t cols, int64_t first, int64_t vocab,
                                                    float *__restrict__ m_loc, float *__restrict__ part) {
    const int lane = threadIdx.x % 32, warps_per_block = blockDim.x / 32;
    for (int64_t r = (int64_t)blockIdx.x * warps_per_block + threadIdx.x / 32; r < rows;
         r += (int64_t)gridDim.x * warps_per_block) {
        const T *row = logits + r * cols;
        cpar__xent_acc acc = cpar__xent_fold<V, SMOOTH>(row, cols, lane, 32);
        acc = cpar__xent_warp_reduce<SMOOTH>(acc);
        if (lane == 0) cpar__xent_local_store<SMOOTH>(acc, row, target, r, rows, cols, first, vocab, m_loc, part);
    }
}

/* Long rows: one 512-thread block per row (grid-stride over rows); warp
 * butterflies, then warp 0 merges the warp states through shared memory.
 * Layout, vector width and bytes moved as the warp kernel. */
template <typename T, typename I, int V, bool SMOOTH>
static __global__ void cpar__xent_local_block_kernel(const T *__restrict__ logits, const I *__restrict__ target,
                                                     int64_t rows, int64_t cols, int64_t first, int64_t vocab,
                                                     float *__restrict__ m_loc, float *__restrict__ part) {
    __shared__ cpar__xent_acc warp_acc[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *row = logits + r * cols;
        cpar__xent_acc acc = cpar__xent_fold<V, SMOOTH>(row, cols, threadIdx.x, blockDim.x);
        acc = cpar__xent_warp_reduce<SMOOTH>(acc);
        if (lane == 0) warp_acc[warp] = acc;
        __syncthreads();
        if (warp == 0) {
            acc = lane < nwarps ? warp_acc[lane] : cpar__xent_acc{{-INFINITY, 0.f}, 0.f};
            acc = cpar__xent_warp_reduce<SMOOTH>(acc);
            if (lane == 0) cpar__xent_local_store<SMOOTH>(acc, row, target, r, rows, cols, first, vocab, m_loc, part);
        }
        __syncthreads(); /* warp_acc is rewritten for the next row */
    }
}

template <typename T, typename I, int V, bool SMOOTH>
static cudaError_t cpar__launch_xent_local_v(const T *logits, const I *target, int64_t rows, int64_t cols,
                                             int64_t first, int64_t vocab, float *m_loc, float *part, cudaStream_t s) {
    if (cols <= CPAR__ROW_WARP_MAX) {
        auto kernel = cpar__xent_local_warp_kernel<T, I, V, SMOOTH>;
        CPAR_LAUNCH(kernel, cpar__grid(rows, CPAR__BLOCK / 32), CPAR__BLOCK, 0, s)
        (logits, target, rows, cols, first, vocab, m_loc, part);
    } else {
        auto kernel = cpar__xent_local_block_kernel<T, I, V, SMOOTH>;
        CPAR_LAUNCH(kernel, cpar__grid(rows, 1), CPAR__ROW_BLOCK, 0, s)
        (logits, target, rows, cols, first, vocab, m_loc, part);
    }
    return cudaGetLastError();
}

template <typename T, typename I, bool SMOOTH>
static cudaError_t cpar__launch_xent_local(const void *logits, const void *target, int64_t rows, int64_t cols,
                                           int64_t first, int64_t vocab, float *m_loc, float *part, cudaStream_t s) {
    constexpr int V = cpar__vec16<T>;
    const T *z = static_cast<const T *>(logits);
    const I *t = static_cast<const I *>(target);
    if (cpar__aligned(16, logits) && cols % V == 0)
        return cpar__launch_xent_local_v<T, I, V, SMOOTH>(z, t, rows, cols, first, vocab, m_loc, part, s);
    return cpar__launch_xent_local_v<T, I, 1, SMOOTH>(z, t, rows, cols, first, vocab, m_loc, part, s);
}

/* Calls f(I{}) with I the C++ type of an index dtype (I32 or I64, validated by the caller). */
template <typename F> static cudaError_t cpar__with_index_type(cpar_dtype dt, F &&f) {
    if (dt == CPAR_I32) return f(int32_t());
    return f(int64_t());
}

static bool cpar__is_index(cpar_dtype dt) { return dt == CPAR_I32 || dt == CPAR_I64; }

/* The shape and dtype checks of cpar_dev_xent_local and _backward (func:
 * the caller, named in the message); each checks its own pointers. */
static cpar_status cpar__xent_check(const char *func, int64_t rows, int64_t cols, int64_t first, int64_t vocab,
                                    cpar_dtype dt, cpar_dtype tdt) {
    if (rows < 0) return cpar__dev_fail(CPAR_ERR_INVALID, "%s: rows = %lld, expected >= 0", func, (long long)rows);
    if (first < 0) return cpar__dev_fail(CPAR_ERR_INVALID, "%s: first = %lld, expected >= 0", func, (long long)first);
    if (cols < 1) return cpar__dev_fail(CPAR_ERR_INVALID, "%s: cols = %lld, expected >= 1", func, (long long)cols);
    if (vocab < first + cols)
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: vocab = %lld, expected >= first + cols = %lld", func,
                              (long long)vocab, (long long)(first + cols));
    if (!cpar__is_float(dt))
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: dtype %s, expected f32, f16 or bf16", func, cpar__dtype_name(dt));
    if (!cpar__is_index(tdt))
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: target dtype %s, expected i32 or i64", func,
                              cpar__dtype_name(tdt));
    return CPAR_OK;
}

cpar_status cpar_dev_xent_local(const void *logits, cpar_dtype dt, const void *target, cpar_dtype tdt, int64_t rows,
                                int64_t cols, int64_t first, int64_t vocab, bool smooth, float *m_loc, float *part,
                                cpar_dev_stream s) {
    const cpar_status st = cpar__xent_check(__func__, rows, cols, first, vocab, dt, tdt);
    if (st != CPAR_OK) return st;
    CPAR__CHECK_PTR(logits, rows > 0);
    CPAR__CHECK_PTR(target, rows > 0);
    CPAR__CHECK_PTR(m_loc, rows > 0);
    CPAR__CHECK_PTR(part, rows > 0);
    if (rows == 0) return CPAR_OK;
    cudaStream_t cs = cpar__stream(s);
    cudaError_t e = cpar__with_float_type(dt, [&](auto zt) {
        typedef decltype(zt) T;
        return cpar__with_index_type(tdt, [&](auto it) {
            typedef decltype(it) I;
            if (smooth) return cpar__launch_xent_local<T, I, true>(logits, target, rows, cols, first, vocab, m_loc, part, cs);
            return cpar__launch_xent_local<T, I, false>(logits, target, rows, cols, first, vocab, m_loc, part, cs);
        });
    });
    CPAR__TRY_CUDA(e, "xent_local kernel launch (%s, %lld x %lld)", cpar__dtype_name(dt), (long long)rows,
                   (long long)cols);
    return CPAR_OK;
}

/* part [rows] *= exp(m_loc - m), element-wise grid-stride; moves 16 bytes a row. */
static __global__ void cpar__xent_rescale_kernel(float *__restrict__ part, const float *__restrict__ m_loc,
                                                 const float *__restrict__ m, int64_t rows) {
    for (int64_t r = cpar__thread_id(); r < rows; r += cpar__thread_count())
        part[r] *= cpar__exp_below(m_loc[r], m[r]);
}

cpar_status cpar_dev_xent_rescale(float *part, const float *m_loc, const float *m, int64_t rows, cpar_dev_stream s) {
    CPAR__CHECK_COUNT(rows);
    CPAR__CHECK_PTR(part, rows > 0);
    CPAR__CHECK_PTR(m_loc, rows > 0);
    CPAR__CHECK_PTR(m, rows > 0);
    if (rows == 0) return CPAR_OK;
    CPAR_LAUNCH(cpar__xent_rescale_kernel, cpar__grid(rows, CPAR__BLOCK), CPAR__BLOCK, 0, cpar__stream(s))
    (part, m_loc, m, rows);
    CPAR__TRY_CUDA(cudaGetLastError(), "xent_rescale kernel launch (%lld rows)", (long long)rows);
    return CPAR_OK;
}

/* m [rows], part [2 or 3, rows] (reduced over the group) -> loss [rows],
 * stats [rows, 2] = (m, lse). Element-wise grid-stride. */
template <bool SMOOTH>
static __global__ void cpar__xent_finalize_kernel(const float *__restrict__ m, const float *__restrict__ part,
                                                  int64_t rows, float inv_vocab, float s, float *__restrict__ loss,
                                                  float *__restrict__ stats) {
    for (int64_t r = cpar__thread_id(); r < rows; r += cpar__thread_count()) {
        const float mr = m[r], log_sum = logf(part[r]), lse = mr + log_sum;
        const float nll = (mr - part[rows + r]) + log_sum; /* lse - z_t */
        float l = nll;
        if (SMOOTH) l = (1.f - s) * nll - s * (part[2 * rows + r] * inv_vocab - lse);
        loss[r] = l;
        stats[2 * r] = mr;
        stats[2 * r + 1] = lse;
    }
}

cpar_status cpar_dev_xent_finalize(const float *m, const float *part, int64_t rows, int64_t vocab, float s, bool smooth,
                                   float *loss, float *stats, cpar_dev_stream st) {
    CPAR__CHECK_COUNT(rows);
    if (vocab < 1) return CPAR__INVALID("vocab = %lld, expected >= 1", (long long)vocab);
    CPAR__CHECK_PTR(m, rows > 0);
    CPAR__CHECK_PTR(part, rows > 0);
    CPAR__CHECK_PTR(loss, rows > 0);
    CPAR__CHECK_PTR(stats, rows > 0);
    if (rows == 0) return CPAR_OK;
    const unsigned grid = cpar__grid(rows, CPAR__BLOCK);
    const float inv_vocab = (float)(1.0 / (double)vocab);
    if (smooth)
        CPAR_LAUNCH(cpar__xent_finalize_kernel<true>, grid, CPAR__BLOCK, 0, cpar__stream(st))
        (m, part, rows, inv_vocab, s, loss, stats);
    else
        CPAR_LAUNCH(cpar__xent_finalize_kernel<false>, grid, CPAR__BLOCK, 0, cpar__stream(st))
        (m, part, rows, inv_vocab, s, loss, stats);
    CPAR__TRY_CUDA(cudaGetLastError(), "xent_finalize kernel launch (%lld rows)", (long long)rows);
    return CPAR_OK;
}

/* dlogits[r, j] = (exp(z - lse) - s/V - (1-s)[first + j == t]) * dloss[r].
 * logits, dlogits [rows, cols] T (may be the same buffer: each element is
 * read then written by one thread), target [rows], stats [rows, 2], dloss
 * [rows]. Launch: cpar__shape_2d over packs-per-row x rows, grid-stride in
 * both; V = 16 / sizeof(T) when both buffers are 16-byte aligned and cols %
 * V == 0. Moves rows * (2 cols sizeof(T) + 12 + sizeof(I)) bytes. */
template <typename T, typename I, int V>
static __global__ void cpar__xent_backward_kernel(const T *logits, T *dlogits, const I *__restrict__ target,
                                                  const float *__restrict__ stats, const float *__restrict__ dloss,
                                                  int64_t rows, int64_t cols, int64_t first, int64_t vocab,
                                                  float uniform, float hit) {
    const int64_t packs = cols / V, c0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t r = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += (int64_t)gridDim.y * blockDim.y) {
        const int64_t tg = cpar__xent_target(target, r), t = tg - first;
        const float lse = stats[2 * r + 1];
        const float dl = (tg < 0 || tg >= vocab) ? NAN : dloss[r];
        for (int64_t c = c0; c < packs; c += (int64_t)gridDim.x * blockDim.x) {
            cpar__pack<T, V> p = cpar__load<V>(logits + r * cols + c * V);
            for (int e = 0; e < V; e++) {
                const float g = expf(cpar__widen(p.v[e]) - lse) - uniform - (c * V + e == t ? hit : 0.f);
                p.v[e] = cpar__narrow<T>(g * dl);
            }
            cpar__store<V>(dlogits + r * cols + c * V, p);
        }
    }
}

template <typename T, typename I, int V>
static cudaError_t cpar__launch_xent_backward_v(const void *logits, void *dlogits, const void *target,
                                                const float *stats, const float *dloss, int64_t rows, int64_t cols,
                                                int64_t first, int64_t vocab, float uniform, float hit, cudaStream_t s) {
    const cpar__shape sh = cpar__shape_2d(cols / V, rows);
    auto kernel = cpar__xent_backward_kernel<T, I, V>;
    CPAR_LAUNCH(kernel, sh.grid, sh.block, 0, s)
    (static_cast<const T *>(logits), static_cast<T *>(dlogits), static_cast<const I *>(target), stats, dloss, rows,
     cols, first, vocab, uniform, hit);
    return cudaGetLastError();
}

cpar_status cpar_dev_xent_backward(const void *logits, void *dlogits, cpar_dtype dt, const void *target,
                                   cpar_dtype tdt, const float *stats, const float *dloss, int64_t rows, int64_t cols,
                                   int64_t first, int64_t vocab, float s, cpar_dev_stream st) {
    const cpar_status stc = cpar__xent_check(__func__, rows, cols, first, vocab, dt, tdt);
    if (stc != CPAR_OK) return stc;
    CPAR__CHECK_PTR(logits, rows > 0);
    CPAR__CHECK_PTR(dlogits, rows > 0);
    CPAR__CHECK_PTR(target, rows > 0);
    CPAR__CHECK_PTR(stats, rows > 0);
    CPAR__CHECK_PTR(dloss, rows > 0);
    if (rows == 0) return CPAR_OK;
    const float uniform = (float)((double)s / (double)vocab), hit = 1.f - s;
    cudaStream_t cs = cpar__stream(st);
    cudaError_t e = cpar__with_float_type(dt, [&](auto zt) {
        typedef decltype(zt) T;
        constexpr int V = cpar__vec16<T>;
        const bool vec = cpar__aligned(16, logits, dlogits) && cols % V == 0;
        return cpar__with_index_type(tdt, [&](auto it) {
            typedef decltype(it) I;
            if (vec)
                return cpar__launch_xent_backward_v<T, I, V>(logits, dlogits, target, stats, dloss, rows, cols, first,
                                                             vocab, uniform, hit, cs);
            return cpar__launch_xent_backward_v<T, I, 1>(logits, dlogits, target, stats, dloss, rows, cols, first,
                                                         vocab, uniform, hit, cs);
        });
    });
    CPAR__TRY_CUDA(e, "xent_backward kernel launch (%s, %lld x %lld)", cpar__dtype_name(dt), (long long)rows,
                   (long long)cols);
    return CPAR_OK;
}

/* ==== 14. Vocabulary-parallel embedding ======================================
 * The device half of the embedding in cpar.h §10 (host half: cpar.c §16).
 * Token (i, j) of ids [b, s] maps to embedding row i*s + j ([b, s, H]) or
 * j*b + i when seq_first ([s, b, H], the sequence-parallel layout that the
 * reduce-scatter along s needs), so the transpose costs nothing.
 * Uses: 2 (errors), 4 (widen/narrow, launch geometry), 13 (index types). */

static __device__ __forceinline__ int64_t cpar__emb_row(int64_t tok, int64_t b, int64_t s, bool seq_first) {
    return seq_first ? (tok % s) * b + tok / s : tok;
}

/* out [b*s, H] (rows ordered as above) = weight [v_local, H] rows of the
 * owned ids, zero rows otherwise, V elements at a time (16-byte packs when H
 * % V == 0 and both pointers allow). Launch: cpar__shape_2d over H/V x
 * tokens, grid-stride. Moves tokens * (2 H sizeof(T) + sizeof(I)) bytes at most. */
template <typename T, typename I, int V>
static __global__ void cpar__embedding_lookup_kernel(const T *__restrict__ weight, const I *__restrict__ ids,
                                                     int64_t b, int64_t s, int64_t hidden, int64_t first,
                                                     int64_t v_local, bool seq_first, T *__restrict__ out) {
    const int64_t h0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * V, n = b * s;
    cpar__pack<T, V> zero;
    CPAR__UNROLL
    for (int e = 0; e < V; e++) zero.v[e] = cpar__narrow<T>(0.f);
    for (int64_t tok = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; tok < n; tok += (int64_t)gridDim.y * blockDim.y) {
        const int64_t id = (int64_t)ids[tok] - first, row = cpar__emb_row(tok, b, s, seq_first);
        const bool owned = id >= 0 && id < v_local;
        for (int64_t h = h0; h < hidden; h += (int64_t)gridDim.x * blockDim.x * V)
            cpar__store<V>(out + row * hidden + h, owned ? cpar__load<V>(weight + id * hidden + h) : zero);
    }
}

cpar_status cpar_dev_embedding_lookup(const void *weight, cpar_dtype dt, const void *ids, cpar_dtype idt, int64_t b,
                                      int64_t s, int64_t hidden, int64_t first, int64_t v_local, bool seq_first,
                                      void *out, cpar_dev_stream st) {
    CPAR__CHECK_COUNT(b);
    CPAR__CHECK_COUNT(s);
    CPAR__CHECK_COUNT(hidden);
    CPAR__CHECK_COUNT(v_local);
    const bool nonempty = b > 0 && s > 0 && hidden > 0;
    CPAR__CHECK_PTR(weight, nonempty && v_local > 0);
    CPAR__CHECK_PTR(ids, nonempty);
    CPAR__CHECK_PTR(out, nonempty);
    if (!cpar__is_float(dt)) return CPAR__INVALID("dtype %s, expected f32, f16 or bf16", cpar__dtype_name(dt));
    if (!cpar__is_index(idt)) return CPAR__INVALID("ids dtype %s, expected i32 or i64", cpar__dtype_name(idt));
    if (!nonempty) return CPAR_OK;
    cudaStream_t cs = cpar__stream(st);
    cudaError_t e = cpar__with_float_type(dt, [&](auto wt) {
        typedef decltype(wt) T;
        return cpar__with_index_type(idt, [&](auto it) {
            typedef decltype(it) I;
            constexpr int V = cpar__vec16<T>;
            const bool vec = hidden % V == 0 && cpar__aligned(16, weight, out);
            const cpar__shape sh = cpar__shape_2d(vec ? hidden / V : hidden, b * s);
            auto kernel = vec ? cpar__embedding_lookup_kernel<T, I, V> : cpar__embedding_lookup_kernel<T, I, 1>;
            CPAR_LAUNCH(kernel, sh.grid, sh.block, 0, cs)
            (static_cast<const T *>(weight), static_cast<const I *>(ids), b, s, hidden, first, v_local, seq_first,
             static_cast<T *>(out));
            return cudaGetLastError();
        });
    });
    CPAR__TRY_CUDA(e, "embedding_lookup kernel launch (%s, %lld tokens x %lld)", cpar__dtype_name(dt),
                   (long long)(b * s), (long long)hidden);
    return CPAR_OK;
}

/* Atomic: dweight[id - first, h] += dout[row(tok), h] for owned tokens.
 * Launch: cpar__shape_2d over H x tokens, grid-stride. */
template <typename T, typename I>
static __global__ void cpar__embedding_grad_atomic_kernel(const T *__restrict__ dout, const I *__restrict__ ids,
                                                          int64_t b, int64_t s, int64_t hidden, int64_t first,
                                                          int64_t v_local, bool seq_first, float *dweight) {
    const int64_t h0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = b * s;
    for (int64_t tok = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; tok < n; tok += (int64_t)gridDim.y * blockDim.y) {
        const int64_t id = (int64_t)ids[tok] - first, row = cpar__emb_row(tok, b, s, seq_first);
        if (id < 0 || id >= v_local) continue;
        for (int64_t h = h0; h < hidden; h += (int64_t)gridDim.x * blockDim.x)
            atomicAdd(&dweight[id * hidden + h], cpar__widen(dout[row * hidden + h]));
    }
}

/* Deterministic (PyTorch's way: sort, then sum runs): the tokens' 64-bit
 * keys (id - first) << 32 | token (~0 for tokens other ranks own), unique,
 * so every sorting network puts them in the one order; a bitonic sort of the
 * keys (n padded to a power of two with ~0, which sorts last) in scratch;
 * then the first token of each run of equal rows sums the run's dout rows in
 * token order into its dweight row: bitwise reproducible, the very sums of
 * one thread walking the tokens in order. O(n log² n) compare-exchanges on
 * 8-byte keys plus tokens · hidden elements of dout. */
static constexpr int CPAR__EMB_SORT = 1024; /* keys per shared-memory sort block (512 threads) */

static int64_t cpar__emb_sort_len(int64_t n) {
    int64_t m = 1;
    while (m < n) m *= 2;
    return m;
}

template <typename I>
static __global__ void cpar__emb_keys_kernel(const I *__restrict__ ids, int64_t n, int64_t npow, int64_t first,
                                             int64_t v_local, uint64_t *__restrict__ keys) {
    for (int64_t t = cpar__thread_id(); t < npow; t += cpar__thread_count()) {
        uint64_t k = ~0ull;
        if (t < n) {
            const int64_t id = (int64_t)ids[t] - first;
            if (id >= 0 && id < v_local) k = (uint64_t)id << 32 | (uint64_t)t;
        }
        keys[t] = k;
    }
}

/* Compare-exchange of keys i and i + j (i & j == 0) of the bitonic network's
 * merge of size k: ascending where i & k == 0. */
static __device__ __forceinline__ void cpar__emb_cmpx(uint64_t *keys, int64_t i, int64_t j, int64_t k) {
    const uint64_t a = keys[i], b = keys[i + j];
    if ((a > b) == ((i & k) == 0)) keys[i] = b, keys[i + j] = a;
}

/* One step (merge size k, distance j >= the block) over the whole array. */
static __global__ void cpar__emb_sort_step_kernel(uint64_t *keys, int64_t npow, int64_t j, int64_t k) {
    for (int64_t p = cpar__thread_id(); p < npow / 2; p += cpar__thread_count())
        cpar__emb_cmpx(keys, 2 * j * (p / j) + p % j, j, k);
}

/* The steps of merge sizes k_lo .. k_hi (powers of two, at most the block
 * size m) with distances below m, in shared memory: block x owns keys
 * [x·m, (x+1)·m). k_lo = 2, k_hi = m sorts each block (alternating
 * directions); k_lo = k_hi = k > m ends that merge after its global steps. */
static __global__ void cpar__emb_sort_block_kernel(uint64_t *keys, int m, int64_t k_lo, int64_t k_hi) {
    __shared__ uint64_t sk[CPAR__EMB_SORT];
    const int64_t base = (int64_t)blockIdx.x * m;
    for (int i = (int)threadIdx.x; i < m; i += (int)blockDim.x) sk[i] = keys[base + i];
    __syncthreads();
    for (int64_t k = k_lo; k <= k_hi; k *= 2)
        for (int64_t j = (k < m ? k : m) / 2; j > 0; j /= 2) {
            for (int p = (int)threadIdx.x; p < m / 2; p += (int)blockDim.x) {
                const int i = (int)(2 * j * (p / j) + p % j);
                const uint64_t a = sk[i], b = sk[i + j];
                if ((a > b) == (((base + i) & k) == 0)) sk[i] = b, sk[i + j] = a;
            }
            __syncthreads();
        }
    for (int i = (int)threadIdx.x; i < m; i += (int)blockDim.x) keys[base + i] = sk[i];
}

/* Sorts keys [npow] ascending (npow a power of two). */
static cudaError_t cpar__emb_sort(uint64_t *keys, int64_t npow, cudaStream_t cs) {
    const int m = (int)(npow < CPAR__EMB_SORT ? npow : CPAR__EMB_SORT), threads = m > 1 ? m / 2 : 1;
    const unsigned blocks = (unsigned)(npow / m);
    CPAR_LAUNCH(cpar__emb_sort_block_kernel, blocks, threads, 0, cs)(keys, m, 2, m);
    cudaError_t e = cudaGetLastError();
    for (int64_t k = 2 * (int64_t)m; k <= npow && e == cudaSuccess; k *= 2) {
        for (int64_t j = k / 2; j >= m && e == cudaSuccess; j /= 2) {
            CPAR_LAUNCH(cpar__emb_sort_step_kernel, cpar__grid(npow / 2, CPAR__BLOCK), CPAR__BLOCK, 0, cs)(keys, npow, j, k);
            e = cudaGetLastError();
        }
        if (e != cudaSuccess) break;
        CPAR_LAUNCH(cpar__emb_sort_block_kernel, blocks, threads, 0, cs)(keys, m, k, k);
        e = cudaGetLastError();
    }
    return e;
}

/* dweight rows += their runs of the sorted keys: position p starts a run
 * when its row differs from p - 1's; the run's tokens are added in order.
 * Launch: cpar__shape_2d over H x npow (blockIdx.y strides the positions). */
template <typename T>
static __global__ void cpar__emb_grad_runs_kernel(const T *__restrict__ dout, const uint64_t *__restrict__ keys,
                                                  int64_t npow, int64_t b, int64_t s, int64_t hidden, bool seq_first,
                                                  float *__restrict__ dweight) {
    const int64_t h0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t p = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; p < npow; p += (int64_t)gridDim.y * blockDim.y) {
        const uint64_t row = keys[p] >> 32;
        if (keys[p] == ~0ull) break; /* sorted: the rest are other ranks' tokens or padding */
        if (p > 0 && keys[p - 1] >> 32 == row) continue;
        for (int64_t h = h0; h < hidden; h += (int64_t)gridDim.x * blockDim.x) {
            float acc = dweight[(int64_t)row * hidden + h];
            for (int64_t q = p; q < npow && keys[q] >> 32 == row; q++)
                acc += cpar__widen(dout[cpar__emb_row((int64_t)(keys[q] & 0xffffffffu), b, s, seq_first) * hidden + h]);
            dweight[(int64_t)row * hidden + h] = acc;
        }
    }
}

size_t cpar_dev_embedding_grad_scratch_bytes(int64_t tokens) {
    return tokens > 0 ? (size_t)cpar__emb_sort_len(tokens) * sizeof(uint64_t) : 0;
}

cpar_status cpar_dev_embedding_grad(const void *dout, cpar_dtype dt, const void *ids, cpar_dtype idt, int64_t b,
                                    int64_t s, int64_t hidden, int64_t first, int64_t v_local, bool seq_first,
                                    float *dweight, bool deterministic, void *scratch, cpar_dev_stream st) {
    CPAR__CHECK_COUNT(b);
    CPAR__CHECK_COUNT(s);
    CPAR__CHECK_COUNT(hidden);
    CPAR__CHECK_COUNT(v_local);
    const bool nonempty = b > 0 && s > 0 && hidden > 0 && v_local > 0;
    CPAR__CHECK_PTR(dout, nonempty);
    CPAR__CHECK_PTR(ids, nonempty);
    CPAR__CHECK_PTR(dweight, nonempty);
    if (!cpar__is_float(dt)) return CPAR__INVALID("dtype %s, expected f32, f16 or bf16", cpar__dtype_name(dt));
    if (!cpar__is_index(idt)) return CPAR__INVALID("ids dtype %s, expected i32 or i64", cpar__dtype_name(idt));
    if (!nonempty) return CPAR_OK;
    const int64_t n = b * s;
    if (deterministic) { /* the sort keys hold a token in 32 bits and a row below 2^32 - 1 */
        CPAR__CHECK_PTR(scratch, true);
        if (!cpar__aligned(sizeof(uint64_t), scratch))
            return CPAR__INVALID("scratch = %p, expected 8-byte alignment", scratch);
        if (n > INT32_MAX || v_local > INT32_MAX)
            return CPAR__INVALID("b*s = %lld tokens, v_local = %lld: the deterministic gradient takes < 2^31 of each",
                                 (long long)n, (long long)v_local);
    }
    cudaStream_t cs = cpar__stream(st);
    cudaError_t e = cpar__with_float_type(dt, [&](auto wt) {
        typedef decltype(wt) T;
        return cpar__with_index_type(idt, [&](auto it) {
            typedef decltype(it) I;
            const T *d = static_cast<const T *>(dout);
            const I *x = static_cast<const I *>(ids);
            if (deterministic) {
                const int64_t npow = cpar__emb_sort_len(n);
                uint64_t *keys = static_cast<uint64_t *>(scratch);
                auto kkeys = cpar__emb_keys_kernel<I>;
                CPAR_LAUNCH(kkeys, cpar__grid(npow, CPAR__BLOCK), CPAR__BLOCK, 0, cs)(x, n, npow, first, v_local, keys);
                cudaError_t le = cudaGetLastError();
                if (le == cudaSuccess) le = cpar__emb_sort(keys, npow, cs);
                if (le != cudaSuccess) return le;
                const cpar__shape sh = cpar__shape_2d(hidden, npow);
                auto kernel = cpar__emb_grad_runs_kernel<T>;
                CPAR_LAUNCH(kernel, sh.grid, sh.block, 0, cs)(d, keys, npow, b, s, hidden, seq_first, dweight);
            } else {
                const cpar__shape sh = cpar__shape_2d(hidden, b * s);
                auto kernel = cpar__embedding_grad_atomic_kernel<T, I>;
                CPAR_LAUNCH(kernel, sh.grid, sh.block, 0, cs)(d, x, b, s, hidden, first, v_local, seq_first, dweight);
            }
            return cudaGetLastError();
        });
    });
    CPAR__TRY_CUDA(e, "embedding_grad kernel launch (%s, %lld tokens x %lld, %s)", cpar__dtype_name(dt),
                   (long long)(b * s), (long long)hidden, deterministic ? "deterministic" : "atomic");
    return CPAR_OK;
}

#endif /* sections 13-14 */

/* ==== 15. Tensor-core wrappers: mma.sync m16n8k16 and ldmatrix ============
 * The flash-attention kernels reach the tensor cores only through these
 * functions. Under nvcc each is one PTX instruction (sm_80+); in the sim
 * build each is an exact emulation that moves the operands between lanes
 * with warp shuffles in the documented fragment layouts, so the sim tests
 * run the very code path (same fragments, same lane arithmetic) as a GPU,
 * and a fragment mix-up is a wrong result here too.
 *
 * Rules for callers: 1-D blocks whose size is a multiple of 32 (the lane is
 * threadIdx.x & 31); all 32 lanes of the warp call together (the .sync
 * forms); ldmatrix row addresses point into shared memory, 16-byte aligned.
 *
 * Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16", 16-bit
 * types). lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3. A register
 * holds two 16-bit elements, the lower column (A, C) or lower row (B) in its
 * low half.
 *   A (16 x 16, row-major)      a[0]: row g,   cols 2t, 2t+1
 *                               a[1]: row g+8, cols 2t, 2t+1
 *                               a[2]: row g,   cols 2t+8, 2t+9
 *                               a[3]: row g+8, cols 2t+8, 2t+9
 *   B (16 x 8, k x n, "col")    b[0]: rows 2t, 2t+1,   col g
 *                               b[1]: rows 2t+8, 2t+9, col g
 *   C, D (16 x 8, fp32)         c[0], c[1]: row g,   cols 2t, 2t+1
 *                               c[2], c[3]: row g+8, cols 2t, 2t+1
 * ldmatrix (m8n8, .b16): lanes 8m..8m+7 give the addresses of rows 0..7 of
 * matrix m (16 bytes each: 8 elements). r[m] of each lane receives
 *   plain:  row g of matrix m, elements 2t and 2t+1
 *   .trans: elements (row 2t, col g) and (row 2t+1, col g) of matrix m
 * so .x4 of a 16x16 row-major tile whose lane l points at row (l & 15),
 * column 8·(l >> 4) yields exactly the A fragment above, and .trans of a
 * row-major [k][n] tile yields B fragments. .x2 uses lanes 0..15's addresses
 * (the others' are ignored but must be valid pointers). */

/* Two floats -> one register of two T (T = __half or __nv_bfloat16), lo in the low half. */
template <typename T> static __device__ __forceinline__ uint32_t cpar__pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t cpar__pack2<__half>(float lo, float hi) {
    return (uint32_t)__half_as_ushort(__float2half_rn(lo)) | ((uint32_t)__half_as_ushort(__float2half_rn(hi)) << 16);
}
template <> __device__ __forceinline__ uint32_t cpar__pack2<__nv_bfloat16>(float lo, float hi) {
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

/* Wrappers the kernels do not call yet but tests/test_mma.cu checks (the
 * .x2 loads, unpack) are marked so that nvcc does not warn about them. */
#define CPAR__SPARE __attribute__((unused))

/* One register of two T -> float (half = 0: low element, 1: high element). */
template <typename T> static __device__ __forceinline__ CPAR__SPARE float cpar__unpack(uint32_t r, int half);
template <> __device__ __forceinline__ float cpar__unpack<__half>(uint32_t r, int half) {
    return __half2float(__ushort_as_half((unsigned short)(half ? r >> 16 : r & 0xffffu)));
}
template <> __device__ __forceinline__ float cpar__unpack<__nv_bfloat16>(uint32_t r, int half) {
    return __bfloat162float(__ushort_as_bfloat16((unsigned short)(half ? r >> 16 : r & 0xffffu)));
}

#ifndef CPAR_SIM

template <typename T> static __device__ __forceinline__ void cpar__mma_m16n8k16(float d[4], const uint32_t a[4],
                                                                               const uint32_t b[2], const float c[4]);
template <> __device__ __forceinline__ void cpar__mma_m16n8k16<__half>(float d[4], const uint32_t a[4],
                                                                      const uint32_t b[2], const float c[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
                   "f"(c[2]), "f"(c[3]));
}
template <> __device__ __forceinline__ void cpar__mma_m16n8k16<__nv_bfloat16>(float d[4], const uint32_t a[4],
                                                                             const uint32_t b[2], const float c[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
                   "f"(c[2]), "f"(c[3]));
}

static __device__ __forceinline__ uint32_t cpar__smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
static __device__ __forceinline__ void cpar__ldmatrix_x4(uint32_t r[4], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(cpar__smem_addr(row)));
}
static __device__ __forceinline__ void cpar__ldmatrix_x4_trans(uint32_t r[4], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(cpar__smem_addr(row)));
}
static __device__ __forceinline__ CPAR__SPARE void cpar__ldmatrix_x2(uint32_t r[2], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(cpar__smem_addr(row)));
}
static __device__ __forceinline__ CPAR__SPARE void cpar__ldmatrix_x2_trans(uint32_t r[2], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(cpar__smem_addr(row)));
}

#else /* CPAR_SIM: the same operations, each one warp-wide call */

/* Each operation is one cudasim_warp_call: when all 32 lanes have arrived,
 * the last runs the whole warp's operation from every lane's registers (one
 * fiber switch per lane; by shuffles it took one per register exchanged, 16
 * per mma). The fragment layouts are PTX's, as the GPU build's. */
struct cpar__mma_sim_lane {
    float *d;
    const uint32_t *a, *b;
    const float *c;
};
template <typename T> static void cpar__mma_sim_warp(void *const args[32], unsigned) {
    float A[16][16], B[8][16]; /* A[row][k], B[column][k] */
    for (int lane = 0; lane < 32; lane++) {
        const cpar__mma_sim_lane *l = (const cpar__mma_sim_lane *)args[lane];
        const int g = lane >> 2, s = lane & 3;
        for (int e = 0; e < 2; e++) {
            /* lane 4g+s holds A's rows g and g+8 at columns 2s, 2s+1 and 2s+8, 2s+9 */
            A[g][2 * s + e] = cpar__unpack<T>(l->a[0], e);
            A[g + 8][2 * s + e] = cpar__unpack<T>(l->a[1], e);
            A[g][2 * s + 8 + e] = cpar__unpack<T>(l->a[2], e);
            A[g + 8][2 * s + 8 + e] = cpar__unpack<T>(l->a[3], e);
            /* and B's column g at rows 2s, 2s+1 and 2s+8, 2s+9 */
            B[g][2 * s + e] = cpar__unpack<T>(l->b[0], e);
            B[g][2 * s + 8 + e] = cpar__unpack<T>(l->b[1], e);
        }
    }
    for (int lane = 0; lane < 32; lane++) {
        const cpar__mma_sim_lane *l = (const cpar__mma_sim_lane *)args[lane];
        const int g = lane >> 2, t = lane & 3;
        float d[4];
        for (int i = 0; i < 4; i++) { /* d[i]: row g (+8 for i >= 2), column 2t + (i & 1) */
            const float *ar = A[g + 8 * (i >> 1)], *bc = B[2 * t + (i & 1)];
            float acc = 0.0f; /* products of 16-bit values are exact in fp32 */
            for (int k = 0; k < 16; k++) acc += ar[k] * bc[k];
            d[i] = l->c[i] + acc;
        }
        for (int i = 0; i < 4; i++) l->d[i] = d[i]; /* d may be c */
    }
}
template <typename T>
static __device__ __forceinline__ void cpar__mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                         const float c[4]) {
    cpar__mma_sim_lane me = {d, a, b, c};
    cudasim_warp_call(0xffffffffu, cpar__mma_sim_warp<T>, &me, "mma.sync.m16n8k16");
}

/* ldmatrix: lane i (i < 8N) names row i of the N 8x8 matrices; lane 4g+t
 * gets row g's elements 2t, 2t+1 of each (.trans: column g's). */
struct cpar__ldmatrix_sim_lane {
    uint32_t *r;
    const void *row;
};
template <int N, bool TRANS> static void cpar__ldmatrix_sim_warp(void *const args[32], unsigned) {
    const uint16_t *rows[32];
    for (int lane = 0; lane < 32; lane++) rows[lane] = (const uint16_t *)((cpar__ldmatrix_sim_lane *)args[lane])->row;
    for (int lane = 0; lane < 32; lane++) {
        uint32_t *r = ((cpar__ldmatrix_sim_lane *)args[lane])->r;
        const int g = lane >> 2, t = lane & 3;
        for (int m = 0; m < N; m++) {
            if (!TRANS) {
                const uint16_t *p = rows[8 * m + g];
                r[m] = (uint32_t)p[2 * t] | ((uint32_t)p[2 * t + 1] << 16);
            } else {
                const uint16_t *p0 = rows[8 * m + 2 * t], *p1 = rows[8 * m + 2 * t + 1];
                r[m] = (uint32_t)p0[g] | ((uint32_t)p1[g] << 16);
            }
        }
    }
}
template <int N, bool TRANS> static __device__ __forceinline__ void cpar__ldmatrix_sim(uint32_t *r, const void *row) {
    const int lane = (int)(threadIdx.x & 31);
    if (lane < 8 * N && (uintptr_t)row % 16 != 0) { /* a GPU faults (misaligned address) */
        printf("cpar__ldmatrix: lane %d's row address %p is not 16-byte aligned\n", lane, row);
        __trap();
    }
    cpar__ldmatrix_sim_lane me = {r, row};
    cudasim_warp_call(0xffffffffu, cpar__ldmatrix_sim_warp<N, TRANS>, &me, TRANS ? "ldmatrix.trans" : "ldmatrix");
}
static __device__ __forceinline__ void cpar__ldmatrix_x4(uint32_t r[4], const void *row) {
    cpar__ldmatrix_sim<4, false>(r, row);
}
static __device__ __forceinline__ void cpar__ldmatrix_x4_trans(uint32_t r[4], const void *row) {
    cpar__ldmatrix_sim<4, true>(r, row);
}
static __device__ __forceinline__ CPAR__SPARE void cpar__ldmatrix_x2(uint32_t r[2], const void *row) {
    cpar__ldmatrix_sim<2, false>(r, row);
}
static __device__ __forceinline__ CPAR__SPARE void cpar__ldmatrix_x2_trans(uint32_t r[2], const void *row) {
    cpar__ldmatrix_sim<2, true>(r, row);
}

#endif /* CPAR_SIM */

#ifndef CPAR_KERNELS_MMA_ONLY /* section 16 */

/* ==== 16. Local attention: the flash kernels ================================
 * The device half of cpar.h §12's local attention (host half and reference
 * loops: cpar.c §18); the backward kernels follow in this section.
 *
 * FlashAttention-2 forward: softmax(scale · q kᵀ) v and the fp32 natural-log
 * log-sum-exp per query row, without materialising the score matrix.
 *   grid  (ceil(sq / BM), hq, b): one CTA per (BM-row query tile, head,
 *         batch), a head's query tiles side by side as in FlashAttention-2,
 *         so the CTAs in flight share a few heads' K and V in L2 (with the
 *         batch·head index fastest, the order until 2026-12-07 and
 *         cpar_dev_attn's fwd_heads_first, each head's K and V passed
 *         through L2 once per few query tiles); the last query tiles first
 *         (causal: they have the most KV tiles, so the long CTAs start
 *         early and the short ones fill the tail); BM = 128 in the plain
 *         instantiations (FA2's tile), 64 in the general one;
 *   block 128 threads = 4 warps, warp w owns query rows BM/4 · w onwards in
 *         16-row MMA blocks (two in a 128-row tile: every K and V fragment
 *         feeds both).
 * The Q tile is staged through shared memory into A fragments that stay in
 * registers (d 128: Q keeps its shared tile and each KV tile reloads them);
 * K and V tiles of 64 keys are staged in shared memory (rows padded by 16
 * bytes so the 8 row addresses of an ldmatrix hit distinct banks) by
 * cp.async, V(j) overlapping S(j) and K(j+1) overlapping P(j)V(j). Per KV
 * tile: S = Q Kᵀ (mma m16n8k16, B fragments by ldmatrix from K's [key][d]
 * rows), masking, the online softmax in fp32 registers with ex2.approx
 * (cpar__ex2) on log2(e)-prescaled scores (FA2), then O += P V with P re-packed
 * from the S accumulators into A fragments (the C and A layouts line up) and
 * V's B fragments by ldmatrix.trans from its [key][d] rows. Causal (top-left:
 * query i sees keys j <= i) stops at the diagonal tile. Rows past sq and keys
 * past sk are zero-filled (masked keys score -inf), and so are the columns
 * d .. DT-1 of the head-dim tile DT (64 or 128), so any d <= 128 with
 * d % 8 == 0 works; k-steps and output column blocks beyond d are skipped.
 * Tensor cores only through section 15's wrappers, so the sim runs the very
 * fragment code an H100 runs. Reads b·hq·(sq·d + query tiles · KV tiles · 2·64·d)
 * elements, writes b·hq·sq·(d + 1).
 * Packed blocks (a.qp.cu and a.kp.cu set): masked per weight by document
 * and global position (row infos found once per row and tile,
 * cpar__attn_info_sees; the backward kernels likewise), since a ring block's
 * visible pairs interleave along the shard;
 * the KV tiles that hide every weight from the CTA's rows are skipped
 * (cpar__attn_visible: a prefix and a suffix of the tiles, found by binary
 * search). Their weights are exact zeros: the backward's bits do not
 * change, nor the forward's in the sim (g++ does not contract); under nvcc
 * a visited hidden tile rescaled o and l by exp2(fma(m, sl2, -m·sl2)), a
 * rounding step away from 1, which skipping leaves out.
 * Dropout (a.dropout_p > 0): after the online softmax has summed a tile's
 * weights into l, each dropped weight is zeroed before P V (the mask: a
 * weight's word of the Philox block at its global positions, one block per
 * pair of keys, cpar__attn_keep2 below: nothing is stored), and the
 * epilogue scales out by 1/(1-p). Instantiations and registers: §8 of
 * docs/DESIGN.md (cpar__attn_var below).
 * Uses: 2 (errors), 4 (toolkit), 15 (mma.sync, ldmatrix, pack). */

/* CPAR__UNROLL: section 4. */

static constexpr int CPAR__ATTN_BM = 64;      /* query rows per CTA (the backward's; the forward's: FWD_BM) */
static constexpr int CPAR__ATTN_BN = 64;      /* keys per KV tile */
static constexpr int CPAR__ATTN_WARPS = 4;    /* 16 query rows each (the plain forward: 32) */
static constexpr int CPAR__ATTN_THREADS = 32 * CPAR__ATTN_WARPS;
static constexpr float CPAR__LOG2E = 1.4426950408889634f;

/* What an attention kernel knows at compile time (all three kernels take
 * one). A plain instantiation (GENERAL false: no packed sequences, no
 * dropout) knows the head dim exactly (d == DT) and whether it is causal,
 * so every bound on d folds away and no trace of the masks it never applies
 * stays in it (ptxas interleaves the ldmatrix loads with the mma's only
 * then: tools/kernel_report.sh). The general instantiation reads d (any
 * d <= DT, d % 8 == 0), causal, packing and dropout at run time: packed or
 * dropout blocks and head dims other than 64 and 128 take it. */
template <int DT_, bool GENERAL_, bool CAUSAL_ = false> struct cpar__attn_var {
    static constexpr int DT = DT_;
    static constexpr bool GENERAL = GENERAL_;
    /* __launch_bounds__'s minimum CTAs per SM, so registers per thread at
     * most 65536 / (128 · CTAs): the forward in 2 (<= 255: FA2's 128-row
     * tile, which beat 64-row tiles at 3-4 CTAs on an H200), the plain dq
     * kernel at d 64 in 3 (<= 168; at 4 it spilled), the rest in 2; none
     * spills (tools/kernel_report.sh). */
    static constexpr int FWD_CTAS = 2;
    /* The forward's query rows per warp in 16-row MMA blocks: the plain
     * instantiations run FA2's 128-row tiles (each K/V fragment loaded from
     * shared memory feeds two row blocks: half the ldmatrix per mma); the
     * general one keeps 64 rows (its masks' row infos need the registers). */
    static constexpr int FWD_MB = GENERAL ? 1 : 2;
    static constexpr int FWD_BM = 16 * CPAR__ATTN_WARPS * FWD_MB;
    /* Keys per KV tile of the forward. At d 128 with 128 rows, S of 64 keys
     * (64 registers) beside O (128) takes 254 registers (it spilled 60 bytes
     * in the non-causal plain kernel until the tile loads' indices became
     * 32-bit), 32 keys 228; on an H200 (2026-11-28, b 2, h 16, s 8192, bf16)
     * 64 keys ran at 278 / 284 TFLOP/s (non-causal / causal, with the spill)
     * and 32 keys at 237 / 237: half the barriers and twice the K/V fragment
     * reuse. At d 64 the plain kernel takes 128 keys, FA2's 128 x 128 tile
     * for d 64 (254 registers with P packed to the input type before the
     * P V products; 64 keys ran 0.77-0.80 of SDPA's flash backend there). */
    static constexpr int FWD_BN = DT == 64 && !GENERAL ? 2 * CPAR__ATTN_BN : CPAR__ATTN_BN;
    /* Q in its own shared tile, its fragments reloaded per KV tile (FA2's
     * way), where holding them in registers (32 per row block at d 128, 16
     * at d 64) would not leave room beside S and O */
    static constexpr bool FWD_Q_SHARED = DT == 128 || FWD_BN > CPAR__ATTN_BN;
    static constexpr int DQ_CTAS = GENERAL || DT == 128 ? 2 : 3;
    /* dO buffers of the dkdv kernel: two where two CTAs per SM still fit
     * (d 64), one at d 128 (refilled after each step's dV) */
    static constexpr int DKDV_DO_BUFS = DT <= 64 ? 2 : 1;
    /* Q buffers of the dkdv kernel and V buffers of the dq kernel: two (the
     * next tile's copies in flight during this one's work); one in the lean
     * instantiations (cpar__ab_lean) */
    static constexpr int DKDV_Q_BUFS = 2, DQ_V_BUFS = 2;
    /* The slim instantiations' (cpar__ab_slim): Pᵀ∘Z and dSᵀ through one
     * shared buffer in the dkdv kernel, and in the dq kernel two tile
     * buffers whose roles (K, V) swap every key tile */
    static constexpr bool DKDV_PDS_ONE = false, DQ_KV_SWAP = false;
    /* Column passes of the dkdv kernel's dQ (atomic_dq): at d 128 two of
     * 32 x 32 per warp (64 accumulator registers beside dK and dV spilled) */
    static constexpr int DKDV_DQ_PASSES = DT == 128 ? 2 : 1;
    static __device__ __forceinline__ int d(int64_t run_time) { return GENERAL ? (int)run_time : DT; }
    static __device__ __forceinline__ bool causal(bool run_time) { return GENERAL ? run_time : CAUSAL_; }
    static __device__ __forceinline__ bool packed(const cpar_dev_attn_pos &qp, const cpar_dev_attn_pos &kp) {
        return GENERAL && qp.cu != NULL && kp.cu != NULL;
    }
    static __device__ __forceinline__ bool drop(float p) { return GENERAL && p > 0.f; }
};

/* Calls launch(V{}) with the instantiation that fits a: a plain one when
 * nothing but d in {64, 128} and causal matter, else the general one of the
 * smallest tile that holds d. */
template <typename L> static cudaError_t cpar__attn_dispatch(const cpar_dev_attn &a, L &&launch) {
    const bool general = a.qp.cu != NULL || a.kp.cu != NULL || a.dropout_p > 0.f || (a.d != 64 && a.d != 128);
    if (general) return a.d <= 64 ? launch(cpar__attn_var<64, true>{}) : launch(cpar__attn_var<128, true>{});
    if (a.d == 64) return a.causal ? launch(cpar__attn_var<64, false, true>{}) : launch(cpar__attn_var<64, false>{});
    return a.causal ? launch(cpar__attn_var<128, false, true>{}) : launch(cpar__attn_var<128, false>{});
}

/* Asynchronous 16-byte global -> shared copies (cp.async, sm_80+): the K/V
 * tile of the next step is in flight while the tensor cores work on this
 * one. The sim build calls CUDA's pipeline primitives, which the simulator
 * models at their latest: a destination holds NaNs from the issue until the
 * issuing thread's wait covers its group, so a wait too few or a barrier
 * missing before a buffer is reused fails the tests. */
#ifndef CPAR_SIM
static __device__ __forceinline__ void cpar__attn_cp16(void *smem, const void *gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(cpar__smem_addr(smem)), "l"(gmem) : "memory");
}
/* 4 bytes (one float of a row's statistics; .cg takes only 16) */
static __device__ __forceinline__ void cpar__attn_cp4(void *smem, const void *gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(cpar__smem_addr(smem)), "l"(gmem) : "memory");
}
static __device__ __forceinline__ void cpar__attn_cp_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/* Wait until at most N committed groups are still in flight (this thread's). */
template <int N> static __device__ __forceinline__ void cpar__attn_cp_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#else
static __device__ __forceinline__ void cpar__attn_cp16(void *smem, const void *gmem) {
    __pipeline_memcpy_async(smem, gmem, 16);
}
static __device__ __forceinline__ void cpar__attn_cp4(void *smem, const void *gmem) {
    __pipeline_memcpy_async(smem, gmem, 4);
}
static __device__ __forceinline__ void cpar__attn_cp_commit(void) { __pipeline_commit(); }
template <int N> static __device__ __forceinline__ void cpar__attn_cp_wait(void) { __pipeline_wait_prior(N); }
#endif

/* The plain path's tests: whole aligned tiles (CPAR__ATTN_WHOLE) and
 * blocks that need no mask (CPAR__ATTN_EDGE false). tools/kernel_report.sh
 * --hot builds with CPAR_KREPORT_HOT, which fixes them to the common case,
 * so the SASS of a KV tile's or a step's loop holds only what a plain tile
 * executes: the static measure of the hot path (never a build to run). */
#ifdef CPAR_KREPORT_HOT
#define CPAR__ATTN_WHOLE(x) true
#define CPAR__ATTN_EDGE(x) false
#else
#define CPAR__ATTN_WHOLE(x) (x)
#define CPAR__ATTN_EDGE(x) (x)
#endif

/* Rows of the tile of `rows` rows at r0 that lie inside a matrix of n rows
 * (r0 < n): the tile loaders' and the backward's key-bound clamp. */
static __device__ __forceinline__ int cpar__attn_tile_rows(int64_t r0, int64_t n, int rows) {
    return n - r0 < rows ? (int)(n - r0) : rows;
}

/* The loaders' common case: a whole ROWS x DT tile (every row inside the
 * matrix, d == DT) from a 16-byte aligned `first` row. Each of THREADS
 * threads issues ROWS·DT/8 / THREADS cp.async, unrolled, at constant offsets
 * from one shared and one global address (the row stride is DT), where the
 * general loop spends a division, bounds tests and address arithmetic on
 * every 16-byte chunk. The caller commits. */
template <typename T, int DT, int LD, int ROWS, int THREADS>
static __device__ __forceinline__ void cpar__attn_cp_tile(T *tile, const T *first) {
    constexpr int CH = DT / 8, RP = THREADS / CH; /* chunks per row; rows per pass of the block */
    static_assert(THREADS % CH == 0 && ROWS % RP == 0, "the block's passes cover the tile exactly");
    const int r = (int)threadIdx.x / CH, col = (int)threadIdx.x % CH * 8;
    T *dst = tile + r * LD + col;
    const T *src = first + r * DT + col;
    CPAR__UNROLL
    for (int k = 0; k < ROWS / RP; k++) cpar__attn_cp16(dst + k * RP * LD, src + k * RP * DT);
}

/* Stage rows [row0, row0 + ROWS) of a [rows, d] matrix (row stride d
 * elements) into a shared tile of ROWS rows x DT columns, pitch LD, zero-filling
 * rows >= rows and columns >= d. d % 8 == 0, so every 8-element chunk is
 * wholly inside or outside. vec (src 16-byte aligned): asynchronous 16-byte
 * copies, committed as one group; else plain element loads. */
template <typename T, int DT, int LD, int ROWS = CPAR__ATTN_BN>
static __device__ __forceinline__ void cpar__attn_stage(T *tile, const T *src, int64_t row0, int64_t rows, int d,
                                                        bool vec) {
    constexpr int CHUNKS = DT / 8; /* 8-element chunks per tile row */
    /* the tile's rows inside the matrix, and 32-bit unsigned offsets from
     * its first row: no 64-bit index per chunk (the d 128 forward spilled
     * for their registers) */
    const int inside = cpar__attn_tile_rows(row0, rows, ROWS);
    const T *first = src + row0 * d;
    if (CPAR__ATTN_WHOLE(vec && inside == ROWS && d == DT)) {
        cpar__attn_cp_tile<T, DT, LD, ROWS, CPAR__ATTN_THREADS>(tile, first);
        cpar__attn_cp_commit();
        return;
    }
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += CPAR__ATTN_THREADS) {
        const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
        T *dst = tile + r * LD + col;
        cpar__pack<T, 8> v;
        if (r < inside && col < d) {
            const T *p = first + (unsigned)(r * d + col);
            if (vec) {
                cpar__attn_cp16(dst, p);
                continue;
            }
            for (int e = 0; e < 8; e++) v.v[e] = p[e];
        } else {
            for (int e = 0; e < 8; e++) v.v[e] = cpar__narrow<T>(0.f);
        }
        cpar__store<8>(dst, v);
    }
    cpar__attn_cp_commit();
}

/* ---- dropout's mask: twins of cpar.c §18's cpar__attn_pos and cpar__attn_keep ----
 * Whether weight (bh, qpos, kpos) survives: word kpos % 4 of the Philox block
 * of offset rng.offset + kpos / 4 in subsequence (bh + 1)·2^32 + qpos, as a
 * uniform (section 12's u01) compared with p. Integer work and one exact
 * multiply, so every build draws the same mask. */
/* The document whose (padded) local rows hold row i of a packed block's
 * shard (i < cu[n_docs] / P): the last d with cu[d] / P <= i. */
static __device__ __forceinline__ int cpar__attn_slot(const cpar_dev_attn_pos &p, int64_t i) {
    int lo = 0, hi = p.n_docs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (p.cu[mid] / p.P <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Row i's global position, and its document in *doc (packed: -1 for
 * padding; plain: 0); twin of cpar.c §18's cpar__attn_row. */
static __device__ __forceinline__ int64_t cpar__attn_row(const cpar_dev_attn_pos &p, int64_t i, int *doc) {
    if (p.cu == NULL) {
        *doc = 0;
        return i < p.split ? p.off0 + i : p.off1 + (i - p.split);
    }
    const int64_t P = p.P;
    if (i >= p.cu[p.n_docs] / P) { /* past the shard (a partial tile's row): nobody's */
        *doc = -1;
        return i;
    }
    const int lo = cpar__attn_slot(p, i);
    int64_t g = i;
    if (P > 1) {
        const int64_t c = ((int64_t)p.cu[lo + 1] - p.cu[lo]) / (2 * P), o = i - p.cu[lo] / P;
        g = p.cu[lo] + (o < c ? p.rank : 2 * P - 1 - p.rank) * c + o % c;
    }
    *doc = g - p.cu[lo] < (int64_t)p.cu_real[lo + 1] - p.cu_real[lo] ? lo : -1;
    return g;
}

static __device__ __forceinline__ int64_t cpar__attn_pos(const cpar_dev_attn_pos &p, int64_t i) {
    int doc;
    return cpar__attn_row(p, i, &doc);
}

/* Whether query i sees key j of a packed block (both row sets packed): the
 * same document's real rows and, causal, the key's global position not
 * after the query's. Plain blocks use the top-left index rule instead. The
 * kernels apply this rule to row infos found once per tile
 * (cpar__attn_info_sees); tests/test_attn_bwd.cu checks tile skipping
 * against this per-pair form. */
static __device__ __forceinline__ CPAR__SPARE bool cpar__attn_packed_sees(const cpar_dev_attn_pos &qp, const cpar_dev_attn_pos &kp,
                                                              bool causal, int64_t i, int64_t j) {
    int dq, dk;
    const int64_t qpos = cpar__attn_row(qp, i, &dq), kpos = cpar__attn_row(kp, j, &dk);
    return dq >= 0 && dq == dk && (!causal || kpos <= qpos);
}

/* Packed blocks: skip the tiles that hide every weight (read on the host at
 * launch, passed to the kernels). Test hook: the sim suite turns it off to
 * check that the outputs are bit-identical either way. */
static bool cpar__attn_skip_hidden_tiles = true;

/* Rows [0, n) of a packed block that lie in its shard. */
static __device__ __forceinline__ int64_t cpar__attn_rows_in(const cpar_dev_attn_pos &p, int64_t n) {
    const int64_t shard = p.cu[p.n_docs] / p.P;
    return n < shard ? n : shard;
}

/* Packed blocks: the tiles [*lo, *hi) of `ts` rows of the other side (tp,
 * n_t rows) that may show a weight to rows [fa, fb] of this side (fp, rows
 * of the shard, fa <= fb); KEY_TILES: the tiles are keys and [fa, fb]
 * queries, else the reverse. Every tile outside hides all its pairs from
 * all those rows, so skipping it changes no bit (its weights are exact
 * zeros). Along a shard, documents and global positions never decrease
 * (chunk r precedes chunk 2P-1-r within a document), so a tile wholly in
 * earlier documents, wholly in later ones, or (causal) wholly after the last
 * query or before the first key is hidden, and those tiles form a prefix and
 * a suffix: two binary searches, O(log tiles · log n_docs) per CTA. Padding
 * rows count as their document's: that only keeps a tile. */
template <bool KEY_TILES>
static __device__ void cpar__attn_tile_span(const cpar_dev_attn_pos &fp, const cpar_dev_attn_pos &tp, bool causal,
                                            int64_t fa, int64_t fb, int64_t n_t, int ts, int64_t *lo, int64_t *hi) {
    const int64_t tiles = (n_t + ts - 1) / ts;
    const int da = cpar__attn_slot(fp, fa), db = cpar__attn_slot(fp, fb);
    const int64_t pa = cpar__attn_pos(fp, fa), pb = cpar__attn_pos(fp, fb);
    auto before = [&](int64_t t) { /* the tile ends before any row of [fa, fb] can see it */
        const int64_t last = (t + 1) * ts < n_t ? (t + 1) * ts - 1 : n_t - 1;
        return cpar__attn_slot(tp, last) < da || (!KEY_TILES && causal && cpar__attn_pos(tp, last) < pa);
    };
    auto after = [&](int64_t t) { /* the tile starts after every row of [fa, fb] is done with it */
        return cpar__attn_slot(tp, t * ts) > db || (KEY_TILES && causal && cpar__attn_pos(tp, t * ts) > pb);
    };
    int64_t a = 0, b = tiles; /* first tile not before */
    while (a < b) {
        const int64_t m = (a + b) / 2;
        if (before(m)) a = m + 1;
        else b = m;
    }
    *lo = a;
    b = tiles; /* first tile after, from there on */
    while (a < b) {
        const int64_t m = (a + b) / 2;
        if (after(m)) b = m;
        else a = m + 1;
    }
    *hi = a;
}

/* The row range [*r0, *r1) of the other side's tiles of `ts` rows (n_t
 * rows) that rows [a, a + n) of this side (n_f rows) may see: everything
 * unless skip (a packed block, skipping on); empty when none of [a, a + n)
 * is in the shard. */
template <bool KEY_TILES>
static __device__ void cpar__attn_visible(const cpar_dev_attn_pos &fp, const cpar_dev_attn_pos &tp, bool skip,
                                          bool causal, int64_t a, int64_t n, int64_t n_f, int64_t n_t, int ts,
                                          int64_t *r0, int64_t *r1) {
    *r0 = 0, *r1 = n_t;
    if (!skip) return;
    const int64_t fv = cpar__attn_rows_in(fp, n_f), tv = cpar__attn_rows_in(tp, n_t);
    const int64_t fb = (a + n < fv ? a + n : fv) - 1;
    if (fb < a || tv == 0) {
        *r1 = 0;
        return;
    }
    int64_t lo, hi;
    cpar__attn_tile_span<KEY_TILES>(fp, tp, causal, a, fb, tv, ts, &lo, &hi);
    *r0 = lo * ts;
    *r1 = hi * ts < tv ? hi * ts : tv;
    if (*r1 < *r0) *r1 = *r0;
}

/* Word i of a Philox block by selects, not an index: a run-time index into
 * the array would put the block in local memory. */
static __device__ __forceinline__ uint32_t cpar__u4_word(const cpar__u4 &w, uint64_t i) {
    return i == 0 ? w.w[0] : i == 1 ? w.w[1] : i == 2 ? w.w[2] : w.w[3];
}

static __device__ __forceinline__ cpar__u4 cpar__attn_philox(const cpar_rng_state &rng, uint64_t bh, uint64_t qpos,
                                                             uint64_t kpos) {
    return cpar__philox4_sub(rng.seed, rng.offset + (kpos >> 2), ((bh + 1) << 32) + qpos);
}

static __device__ __forceinline__ bool cpar__attn_keep(const cpar_rng_state &rng, float p, uint64_t bh, uint64_t qpos,
                                                       uint64_t kpos) {
    return cpar__rng_u01(cpar__u4_word(cpar__attn_philox(rng, bh, qpos, kpos), kpos & 3)) >= p;
}

/* The mask's (batch, head) index of slice bh of a block with hq heads
 * (cpar_dev_attn's mask_hq, mask_h0: a head shard of a wider attention). */
static __device__ __forceinline__ uint64_t cpar__attn_mask_bh(int64_t bh, int64_t hq, int64_t mask_hq,
                                                              int64_t mask_h0) {
    return mask_hq ? (uint64_t)(bh / hq * mask_hq + mask_h0 + bh % hq) : (uint64_t)bh;
}

/* Whether the weights of one query and two keys survive, with one Philox
 * block for both when the keys share one (the kernels' lanes hold keys in
 * adjacent pairs: almost always). */
static __device__ __forceinline__ void cpar__attn_keep2(const cpar_rng_state &rng, float p, uint64_t bh, uint64_t qpos,
                                                        uint64_t k0, uint64_t k1, bool *keep0, bool *keep1) {
    const cpar__u4 w0 = cpar__attn_philox(rng, bh, qpos, k0);
    const cpar__u4 w1 = k0 >> 2 == k1 >> 2 ? w0 : cpar__attn_philox(rng, bh, qpos, k1);
    *keep0 = cpar__rng_u01(cpar__u4_word(w0, k0 & 3)) >= p;
    *keep1 = cpar__rng_u01(cpar__u4_word(w1, k1 & 3)) >= p;
}

/* What the masks need of one row, found once per row (and tile) instead of
 * per weight: its global position, and its document (packed: -1 for padding
 * and rows past the shard; plain: 0). rows: the side's row count; rows past
 * it get document -2, which no query accepts. */
struct cpar__attn_rowinfo {
    int64_t pos;
    int doc;
};

static __device__ __forceinline__ cpar__attn_rowinfo cpar__attn_info(const cpar_dev_attn_pos &p, bool packed, int64_t i,
                                                                    int64_t rows) {
    cpar__attn_rowinfo r;
    if (i >= rows) r.doc = -2, r.pos = i;
    else if (packed) r.pos = cpar__attn_row(p, i, &r.doc);
    else r.doc = 0, r.pos = cpar__attn_pos(p, i);
    return r;
}

/* Packed blocks: query q sees key k (cpar__attn_packed_sees on the infos). */
static __device__ __forceinline__ bool cpar__attn_info_sees(const cpar__attn_rowinfo &q, const cpar__attn_rowinfo &k,
                                                            bool causal) {
    return q.doc >= 0 && q.doc == k.doc && (!causal || k.pos <= q.pos);
}

/* The forward's 16-byte epilogue: this warp's MB row blocks of O (times
 * inv, per row half) into the shared tile st [BM][DT + 16 / sizeof(O)] (the
 * K/V/Q tiles, free by then), then the CTA's first nrows rows to out_rows
 * (row pitch d, 16-byte aligned rows) in 16-byte stores. */
template <typename O, int DT, int OB, int MB>
static __device__ __forceinline__ void cpar__attn_store_rows(O *st, const float (&o)[MB][OB][4],
                                                             const float (&inv)[MB][2], int d, O *out_rows, int nrows) {
    constexpr int LDO = DT + 16 / (int)sizeof(O), VO = 16 / (int)sizeof(O), BM = 16 * CPAR__ATTN_WARPS * MB;
    const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5), g = lane >> 2, t = lane & 3;
CPAR__UNROLL
    for (int mb = 0; mb < MB; mb++)
CPAR__UNROLL
        for (int h = 0; h < 2; h++)
CPAR__UNROLL
            for (int nb = 0; nb < OB; nb++) {
                const int r = (warp * MB + mb) * 16 + g + 8 * h, col = nb * 8 + 2 * t;
                if (col >= d) continue;
                st[r * LDO + col] = cpar__narrow<O>(o[mb][nb][2 * h] * inv[mb][h]);
                st[r * LDO + col + 1] = cpar__narrow<O>(o[mb][nb][2 * h + 1] * inv[mb][h]);
            }
    __syncthreads();
    const int ch = d / VO; /* 16-byte chunks per row: d % 8 == 0 */
    for (int c = (int)threadIdx.x; c < BM * ch; c += CPAR__ATTN_THREADS) {
        const int r = c / ch, k = c % ch;
        if (r < nrows) cpar__store<VO>(out_rows + (int64_t)r * d + k * VO, cpar__load<VO>(st + r * LDO + k * VO));
    }
}

/* a: the attention (q, k, v at the (b, h) slices' bases below); out (OutT)
 * [b, hq, sq, d] with (b,h) stride o_bh; lse f32 with stride lse_bh. A CTA
 * takes BM = 64·MB query rows: warp w rows [w·16·MB, (w+1)·16·MB) in MB
 * blocks of 16 (MB = 2, FA2's 128-row tile: every K or V fragment a warp
 * loads feeds both blocks' mma's). */
template <typename T, class V>
static __global__ void __launch_bounds__(CPAR__ATTN_THREADS, V::FWD_CTAS)
    cpar__attn_fwd_kernel(const cpar_dev_attn a, void *__restrict__ out, bool out_f32, int64_t o_bh,
                          float *__restrict__ lse, int64_t lse_bh, bool vec, bool ovec, float keep_scale,
                          bool skip_tiles, bool heads_first) {
    constexpr int DT = V::DT, LD = DT + 8; /* +16 bytes: conflict-free ldmatrix rows */
    constexpr int MB = V::FWD_MB, BM = V::FWD_BM, BN = V::FWD_BN;
    constexpr int KSTEPS = DT / 16, NB = BN / 8, OB = DT / 8;
    /* Q's A fragments stay in registers for the whole KV loop in the
     * general d 64 kernel; elsewhere (V::FWD_Q_SHARED) Q stays in its own
     * shared tile and each KV tile reloads the fragments, as FlashAttention-2
     * does (MB more ldmatrix per warp and k-step, against BN / 16 for K and
     * as many for V). */
    constexpr bool Q_SHARED = V::FWD_Q_SHARED;
    static_assert(Q_SHARED || BM <= 2 * BN, "Q is staged over the K and V tiles");
    /* K, V [BN][LD], then Q [BM][LD] when Q_SHARED (else Q is staged over
     * K's and V's), then (GENERAL) the KV tile's row infos [BN] */
    CPAR_DYN_SMEM(unsigned char, smem);
    T *sk = reinterpret_cast<T *>(smem), *sv = sk + BN * LD, *sq = Q_SHARED ? sv + BN * LD : sk;
    cpar__attn_rowinfo *kinfo = reinterpret_cast<cpar__attn_rowinfo *>(sv + BN * LD + (Q_SHARED ? BM * LD : 0));

    const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5), g = lane >> 2, t = lane & 3;
    const int d = V::d(a.d);
    const bool causal = V::causal(a.causal), packed = V::packed(a.qp, a.kp), drop = V::drop(a.dropout_p);
    /* grid (query tiles, hq, b), or (b·hq, query tiles) with heads_first */
    const int64_t bh = heads_first ? (int64_t)blockIdx.x : (int64_t)blockIdx.z * a.hq + blockIdx.y;
    const int64_t bi = bh / a.hq, hi = bh % a.hq, kvh = bi * a.hkv + hi / (a.hq / a.hkv);
    const unsigned tile = heads_first ? blockIdx.y : blockIdx.x, tiles = heads_first ? gridDim.y : gridDim.x;
    /* 32-bit row and key indices (sq, sk < 2^31 - 64: checked at launch) spare registers */
    const int q0 = (int)(tiles - 1 - tile) * BM, wrow = warp * 16 * MB; /* wrow: the warp's first row */
    const T *q = static_cast<const T *>(a.q) + bh * a.q_bh;
    const T *k = static_cast<const T *>(a.k) + kvh * a.kv_bh;
    const T *v = static_cast<const T *>(a.v) + kvh * a.kv_bh;
    const int ksteps = (d + 15) / 16; /* k-steps of 16 that hold any of the d columns */
    const float sl2 = a.scale * CPAR__LOG2E;

    /* the Q tile, and (not Q_SHARED) its A fragments for the whole KV loop */
    cpar__attn_stage<T, DT, LD, BM>(sq, q, q0, a.sq, d, vec);
    cpar__attn_cp_wait<0>();
    __syncthreads();
    const T *qrow = sq + (wrow + (lane & 15)) * LD + 8 * (lane >> 4); /* this lane's ldmatrix row of Q, block 0 */
    uint32_t qf[MB][Q_SHARED ? 1 : KSTEPS][4] = {};
    if constexpr (!Q_SHARED) {
CPAR__UNROLL
        for (int mb = 0; mb < MB; mb++)
CPAR__UNROLL
            for (int kk = 0; kk < KSTEPS; kk++)
                if (kk < ksteps) cpar__ldmatrix_x4(qf[mb][kk], qrow + mb * 16 * LD + kk * 16);
    }

    float o[MB][OB][4];
    float m[MB][2], l[MB][2]; /* rows g and g+8 of each block: raw-score max, partial sum */
    /* the query row of this thread's block mb, half h (g or g + 8), computed
     * where used rather than held (registers are the d 128 tile's limit) */
    const auto row = [&](int mb, int h) { return q0 + wrow + mb * 16 + g + 8 * h; };
CPAR__UNROLL
    for (int mb = 0; mb < MB; mb++) {
CPAR__UNROLL
        for (int nb = 0; nb < OB; nb++) o[mb][nb][0] = o[mb][nb][1] = o[mb][nb][2] = o[mb][nb][3] = 0.f;
        m[mb][0] = m[mb][1] = -INFINITY, l[mb][0] = l[mb][1] = 0.f;
    }
    /* packed or dropout: this thread's query rows' infos, once */
    cpar__attn_rowinfo qinfo[MB][2] = {};
    if (packed || drop)
        for (int mb = 0; mb < MB; mb++)
            for (int h = 0; h < 2; h++) qinfo[mb][h] = cpar__attn_info(a.qp, packed, row(mb, h), a.sq);

    /* Pipeline (FA2's): K(j) and V(j) are separate copy groups; V(j) lands
     * while S(j) is computed, K(j+1) while O += P(j) V(j) is. */
    /* packed: the key tiles that some row of this tile may see (masked per weight within) */
    int kv_begin = 0, kv_end = (int)a.sk;
    if (packed) {
        int64_t r0, r1;
        cpar__attn_visible<true>(a.qp, a.kp, skip_tiles, causal, q0, BM, a.sq, a.sk, BN, &r0, &r1);
        kv_begin = (int)r0, kv_end = (int)r1;
    }
    if (causal && !packed && q0 + BM < kv_end) kv_end = q0 + BM;
    __syncthreads(); /* every warp has its Q fragments: sk (and sv) are free for K and V */
    if (kv_begin < kv_end) cpar__attn_stage<T, DT, LD, BN>(sk, k, kv_begin, a.sk, d, vec);
    /* Two barriers a KV tile, as FA2: the first (K(j) in) also frees sv of
     * P(j-1) V(j-1), the second (V(j) in) frees sk of S(j). */
    for (int j0 = kv_begin; j0 < kv_end; j0 += BN) {
        if (packed || drop) /* the tile's key infos, once; last read before the previous step's second barrier */
            for (int c = (int)threadIdx.x; c < BN; c += CPAR__ATTN_THREADS)
                kinfo[c] = cpar__attn_info(a.kp, packed, (int64_t)j0 + c, a.sk);
        cpar__attn_cp_wait<0>(); /* K(j) has landed */
        __syncthreads();         /* ... for every thread, and no warp reads V(j-1) any more */
        cpar__attn_stage<T, DT, LD, BN>(sv, v, j0, a.sk, d, vec); /* lands while S(j) is computed */

        /* S = Q Kᵀ: 16·MB rows x BN keys per warp, n-blocks of 8 keys */
        float s[MB][NB][4];
CPAR__UNROLL
        for (int mb = 0; mb < MB; mb++)
CPAR__UNROLL
            for (int nb = 0; nb < NB; nb++) s[mb][nb][0] = s[mb][nb][1] = s[mb][nb][2] = s[mb][nb][3] = 0.f;
CPAR__UNROLL
        for (int kk = 0; kk < KSTEPS; kk++) {
            if (kk >= ksteps) continue;
            uint32_t qa[MB][4];
CPAR__UNROLL
            for (int mb = 0; mb < MB; mb++) {
                if constexpr (Q_SHARED) {
                    cpar__ldmatrix_x4(qa[mb], qrow + mb * 16 * LD + kk * 16);
                } else {
CPAR__UNROLL
                    for (int e = 0; e < 4; e++) qa[mb][e] = qf[mb][Q_SHARED ? 0 : kk][e];
                }
            }
CPAR__UNROLL
            for (int nb = 0; nb < NB; nb += 2) { /* keys 8nb .. 8nb+15: one x4 gives two B fragments */
                uint32_t bf[4];
                cpar__ldmatrix_x4(bf, &sk[(nb * 8 + (lane & 7) + 8 * (lane >> 4)) * LD + kk * 16 + 8 * ((lane >> 3) & 1)]);
CPAR__UNROLL
                for (int mb = 0; mb < MB; mb++) {
                    cpar__mma_m16n8k16<T>(s[mb][nb], qa[mb], &bf[0], s[mb][nb]);
                    cpar__mma_m16n8k16<T>(s[mb][nb + 1], qa[mb], &bf[2], s[mb][nb + 1]);
                }
            }
        }

        /* mask keys past sk and, causal, keys after the row (packed: other
         * documents too); the test is the warp's: its rows start at q0 + wrow */
        if (CPAR__ATTN_EDGE(j0 + BN > a.sk || (causal && j0 + BN - 1 > q0 + wrow) || packed)) {
CPAR__UNROLL
            for (int mb = 0; mb < MB; mb++)
CPAR__UNROLL
                for (int nb = 0; nb < NB; nb++)
CPAR__UNROLL
                    for (int r = 0; r < 4; r++) {
                        const int jl = nb * 8 + 2 * t + (r & 1), j = j0 + jl;
                        const bool hidden = packed ? !cpar__attn_info_sees(qinfo[mb][r >> 1], kinfo[jl], causal)
                                                   : causal && j > row(mb, r >> 1);
                        if (j >= a.sk || hidden) s[mb][nb][r] = -INFINITY;
                    }
        }

        /* online softmax: new row max over the quad (the 4 lanes of a row) */
CPAR__UNROLL
        for (int mb = 0; mb < MB; mb++)
CPAR__UNROLL
            for (int h = 0; h < 2; h++) {
                float mx = m[mb][h];
CPAR__UNROLL
                for (int nb = 0; nb < NB; nb++) mx = fmaxf(mx, fmaxf(s[mb][nb][2 * h], s[mb][nb][2 * h + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                /* a row with no key yet keeps max -inf: exponents relative to 0 then give exact zeros */
                const float base = mx == -INFINITY ? 0.f : mx * sl2;
                const float corr = cpar__ex2(m[mb][h] * sl2 - base); /* m = -inf: 0 */
                m[mb][h] = mx;
                l[mb][h] *= corr;
CPAR__UNROLL
                for (int nb = 0; nb < OB; nb++) o[mb][nb][2 * h] *= corr, o[mb][nb][2 * h + 1] *= corr;
CPAR__UNROLL
                for (int nb = 0; nb < NB; nb++)
CPAR__UNROLL
                    for (int e = 0; e < 2; e++) {
                        const float p = cpar__ex2(fmaf(s[mb][nb][2 * h + e], sl2, -base));
                        s[mb][nb][2 * h + e] = p;
                        l[mb][h] += p;
                    }
            }
        /* dropout: l summed every weight (lse is dropout's input); P V takes the kept ones */
        if (drop) { /* keys 2t, 2t+1 of each n-block: one Philox block for the pair */
            const uint64_t mbh = cpar__attn_mask_bh(bh, a.hq, a.mask_hq, a.mask_h0);
CPAR__UNROLL
            for (int mb = 0; mb < MB; mb++)
CPAR__UNROLL
                for (int nb = 0; nb < NB; nb++)
CPAR__UNROLL
                    for (int h = 0; h < 2; h++) {
                        const int jl = nb * 8 + 2 * t;
                        bool k0, k1;
                        cpar__attn_keep2(a.rng, a.dropout_p, mbh, (uint64_t)qinfo[mb][h].pos,
                                         (uint64_t)kinfo[jl].pos, (uint64_t)kinfo[jl + 1].pos, &k0, &k1);
                        if (!k0) s[mb][nb][2 * h] = 0.f; /* keys past sk weigh 0 already */
                        if (!k1) s[mb][nb][2 * h + 1] = 0.f;
                    }
        }

        /* P in the input type, a pair of keys per register (half of S's
         * registers: S dies here, before the wait and the P V products) */
        uint32_t p2[MB][NB][2];
CPAR__UNROLL
        for (int mb = 0; mb < MB; mb++)
CPAR__UNROLL
            for (int nb = 0; nb < NB; nb++)
CPAR__UNROLL
                for (int h = 0; h < 2; h++) p2[mb][nb][h] = cpar__pack2<T>(s[mb][nb][2 * h], s[mb][nb][2 * h + 1]);

        cpar__attn_cp_wait<0>(); /* V(j) has landed */
        __syncthreads();         /* ... for every thread, and no warp reads K(j) any more */
        if (j0 + BN < kv_end) cpar__attn_stage<T, DT, LD, BN>(sk, k, j0 + BN, a.sk, d, vec);

        /* O += P V: P's k-step kk is n-blocks 2kk, 2kk+1 of S, as A fragments */
CPAR__UNROLL
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t pf[MB][4];
CPAR__UNROLL
            for (int mb = 0; mb < MB; mb++) {
                pf[mb][0] = p2[mb][2 * kk][0];
                pf[mb][1] = p2[mb][2 * kk][1];
                pf[mb][2] = p2[mb][2 * kk + 1][0];
                pf[mb][3] = p2[mb][2 * kk + 1][1];
            }
CPAR__UNROLL
            for (int nb = 0; nb < OB; nb += 2) { /* output columns 8nb .. 8nb+15 */
                if (nb * 8 >= d) continue;
                uint32_t bf[4];
                cpar__ldmatrix_x4_trans(bf, &sv[(kk * 16 + (lane & 15)) * LD + nb * 8 + 8 * (lane >> 4)]);
CPAR__UNROLL
                for (int mb = 0; mb < MB; mb++) {
                    cpar__mma_m16n8k16<T>(o[mb][nb], pf[mb], &bf[0], o[mb][nb]);
                    cpar__mma_m16n8k16<T>(o[mb][nb + 1], pf[mb], &bf[2], o[mb][nb + 1]);
                }
            }
        }
    }

    /* epilogue: the row sums over the quad, lse, then out = O / l: through
     * shared memory in 16-byte stores when the output rows allow (ovec), else
     * two elements per store */
    float inv[MB][2];
CPAR__UNROLL
    for (int mb = 0; mb < MB; mb++)
CPAR__UNROLL
        for (int h = 0; h < 2; h++) {
            l[mb][h] += __shfl_xor_sync(0xffffffffu, l[mb][h], 1);
            l[mb][h] += __shfl_xor_sync(0xffffffffu, l[mb][h], 2);
            const bool empty = !(l[mb][h] > 0.f); /* saw no key: out 0, lse -inf */
            inv[mb][h] = empty ? 0.f : 1.f / l[mb][h] * keep_scale;
            if (t == 0 && row(mb, h) < a.sq)
                lse[bh * lse_bh + row(mb, h)] = empty ? -INFINITY : m[mb][h] * a.scale + logf(l[mb][h]);
        }
    if (ovec) {
        __syncthreads(); /* every warp is done with the K/V/Q tiles */
        const int nrows = a.sq - q0 < BM ? (int)(a.sq - q0) : BM;
        const int64_t base = bh * o_bh + (int64_t)q0 * d;
        if (out_f32)
            cpar__attn_store_rows<float, DT, OB, MB>(reinterpret_cast<float *>(smem), o, inv, d,
                                                     static_cast<float *>(out) + base, nrows);
        else
            cpar__attn_store_rows<T, DT, OB, MB>(reinterpret_cast<T *>(smem), o, inv, d, static_cast<T *>(out) + base,
                                                 nrows);
        return;
    }
CPAR__UNROLL
    for (int mb = 0; mb < MB; mb++)
CPAR__UNROLL
        for (int h = 0; h < 2; h++) {
            if (row(mb, h) >= a.sq) continue;
            const int64_t base = bh * o_bh + (int64_t)row(mb, h) * d;
CPAR__UNROLL
            for (int nb = 0; nb < OB; nb++) {
                const int col = nb * 8 + 2 * t;
                if (col >= d) continue;
                const float x0 = o[mb][nb][2 * h] * inv[mb][h], x1 = o[mb][nb][2 * h + 1] * inv[mb][h];
                if (out_f32) {
                    float *po = static_cast<float *>(out) + base + col;
                    po[0] = x0, po[1] = x1;
                } else {
                    T *po = static_cast<T *>(out) + base + col;
                    po[0] = cpar__narrow<T>(x0), po[1] = cpar__narrow<T>(x1);
                }
            }
        }
}

/* The grid: the instantiation's query tiles (x), hq, b, as FlashAttention-2
 * orders its CTAs; with a.fwd_heads_first, or b or hq past a grid
 * dimension's 65535, (b·hq, query tiles). */
template <typename T, class V>
static cudaError_t cpar__launch_attn_fwd(const cpar_dev_attn &a, void *out, bool out_f32, int64_t o_bh, float *lse,
                                         int64_t lse_bh, bool vec, bool ovec, unsigned bh, cudaStream_t s) {
    auto kernel = cpar__attn_fwd_kernel<T, V>;
    const float keep_scale = 1.0f / (1.0f - a.dropout_p); /* on the host: cpar.c's cpar__attn_keep_scale */
    constexpr int BM = V::FWD_BM, BN = V::FWD_BN, LD = V::DT + 8;
    constexpr size_t tiles = (size_t)(2 * BN + (V::FWD_Q_SHARED ? BM : 0)) * LD * sizeof(T) + /* K, V (, Q) */
                             (V::GENERAL ? BN * sizeof(cpar__attn_rowinfo) : 0);           /* key infos */
    const size_t osz = out_f32 ? 4 : sizeof(T), epilogue = ovec ? (size_t)BM * (V::DT + 16 / osz) * osz : 0;
    const size_t smem = tiles > epilogue ? tiles : epilogue;
    if (smem > 48 * 1024) {
        const cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void *>(kernel),
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    const unsigned qtiles = (unsigned)((a.sq + BM - 1) / BM);
    const bool heads_first = a.fwd_heads_first || a.b > 65535 || a.hq > 65535;
    const dim3 grid = heads_first ? dim3(bh, qtiles) : dim3(qtiles, (unsigned)a.hq, (unsigned)a.b);
    CPAR_LAUNCH(kernel, grid, CPAR__ATTN_THREADS, smem, s)
    (a, out, out_f32, o_bh, lse, lse_bh, vec, ovec, keep_scale, cpar__attn_skip_hidden_tiles, heads_first);
    return cudaGetLastError();
}

/* The checks of cpar_dev_attention_fwd/_bwd on the attention description. */
static cpar_status cpar__attn_dev_check(const char *func, const cpar_dev_attn *a) {
    if (a == NULL) return cpar__dev_fail(CPAR_ERR_INVALID, "%s: a is NULL", func);
    if (a->dt != CPAR_F16 && a->dt != CPAR_BF16)
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: a->dt = %s, expected f16 or bf16", func, cpar__dtype_name(a->dt));
    if (a->b < 0 || a->hq < 0 || a->sq < 0 || a->sk < 0)
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: negative size (b %lld, hq %lld, sq %lld, sk %lld)", func,
                              (long long)a->b, (long long)a->hq, (long long)a->sq, (long long)a->sk);
    if (a->hkv < 1 || a->hq % a->hkv)
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: a->hkv = %lld, expected a divisor of a->hq = %lld", func,
                              (long long)a->hkv, (long long)a->hq);
    if (a->d < 8 || a->d > 128 || a->d % 8)
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: a->d = %lld, expected a multiple of 8 in [8, 128]", func,
                              (long long)a->d);
    if (!(a->scale > 0.f) || isinf(a->scale))
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: a->scale = %g, expected finite and > 0", func, (double)a->scale);
    if (!(a->dropout_p >= 0.f && a->dropout_p < 1.f))
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: a->dropout_p = %g, expected 0 <= p < 1", func,
                              (double)a->dropout_p);
    if (a->q_bh < a->sq * a->d || a->kv_bh < a->sk * a->d)
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: a->q_bh = %lld / a->kv_bh = %lld, expected >= sq*d = %lld / sk*d = %lld",
                              func, (long long)a->q_bh, (long long)a->kv_bh, (long long)(a->sq * a->d),
                              (long long)(a->sk * a->d));
    const bool work = a->b > 0 && a->hq > 0 && a->sq > 0;
    if (work && (a->q == NULL || (a->sk > 0 && (a->k == NULL || a->v == NULL))))
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: a->q, a->k or a->v is NULL", func);
    return CPAR_OK;
}

cpar_status cpar_dev_attention_fwd(const cpar_dev_attn *a, void *out, cpar_dtype out_dt, int64_t o_bh, float *lse,
                                   int64_t lse_bh, cpar_dev_stream s) {
    const cpar_status st = cpar__attn_dev_check(__func__, a);
    if (st != CPAR_OK) return st;
    if (out_dt != CPAR_F32 && out_dt != a->dt)
        return CPAR__INVALID("out_dt = %s, expected f32 or a->dt (%s)", cpar__dtype_name(out_dt),
                             cpar__dtype_name(a->dt));
    if (o_bh < a->sq * a->d || lse_bh < a->sq)
        return CPAR__INVALID("o_bh = %lld / lse_bh = %lld, expected >= sq*d = %lld / sq = %lld", (long long)o_bh,
                             (long long)lse_bh, (long long)(a->sq * a->d), (long long)a->sq);
    const int64_t bh = a->b * a->hq, tiles = (a->sq + CPAR__ATTN_BM - 1) / CPAR__ATTN_BM;
    CPAR__CHECK_PTR(out, bh * a->sq > 0);
    CPAR__CHECK_PTR(lse, bh * a->sq > 0);
    if (bh == 0 || a->sq == 0) return CPAR_OK;
    if (bh > INT32_MAX || tiles > 65535)
        return CPAR__INVALID("b*hq = %lld, sq = %lld: grid (b*hq, sq/64) exceeds (2^31-1, 65535)", (long long)bh,
                             (long long)a->sq);
    if (a->sk > INT32_MAX - 2 * CPAR__ATTN_BN) /* the largest KV tile: the plain d 64 forward's */
        return CPAR__INVALID("a->sk = %lld, expected < 2^31 - %d (32-bit key indices)", (long long)a->sk,
                             2 * CPAR__ATTN_BN);
    /* 16-byte staging loads need 16-byte aligned rows: d % 8 == 0 always, so the bases and (b,h) strides decide */
    const bool vec = cpar__aligned(16, a->q, a->k) && cpar__aligned(16, a->v) && a->q_bh % 8 == 0 && a->kv_bh % 8 == 0;
    const bool f32 = out_dt == CPAR_F32;
    /* 16-byte epilogue stores need 16-byte aligned output rows: d % 8 == 0, so the base and the (b,h) stride decide */
    const bool ovec = cpar__aligned(16, out) && o_bh * (f32 ? 4 : 2) % 16 == 0;
    const cudaStream_t cs = cpar__stream(s);
    const cudaError_t e = cpar__attn_dispatch(*a, [&](auto var) {
        typedef decltype(var) V;
        return a->dt == CPAR_F16
                   ? cpar__launch_attn_fwd<__half, V>(*a, out, f32, o_bh, lse, lse_bh, vec, ovec, (unsigned)bh, cs)
                   : cpar__launch_attn_fwd<__nv_bfloat16, V>(*a, out, f32, o_bh, lse, lse_bh, vec, ovec, (unsigned)bh,
                                                            cs);
    });
    CPAR__TRY_CUDA(e, "attention forward kernel launch (%s, b*hq %lld, sq %lld, sk %lld, d %lld, %s)",
                   cpar__dtype_name(a->dt), (long long)bh, (long long)a->sq, (long long)a->sk, (long long)a->d,
                   a->causal ? "causal" : "full");
    return CPAR_OK;
}

/* ---- 16b. Flash attention backward -------------------------------------------
 * cpar_dev_attention_bwd of cpar.h §12: FlashAttention-2's backward on the
 * tensor cores (mma.sync m16n8k16 through the wrappers of k_mma.cu), d <= 128
 * with d % 8 == 0, F16/BF16 inputs, out/dout in F32 or the input dtype,
 * causal (top-left) or not, sq != sk, GQA. Three launches on one stream:
 *   1. dot:  per row, Dsum = Σ_c dout·out and log2(e)·lse (+inf where lse =
 *      -inf) into scratch (fp32), one warp per row, each (batch, head)
 *      slice's rows padded to a multiple of 64 (Dsum 0, lse +inf: P = 0):
 *      the dkdv kernel copies a step's rows to shared memory by cp.async with
 *      its tiles, no branch and no wait on global memory in its steps.
 *   2. dkdv: one CTA per (64-key tile, batch·kv head). K and V stay in shared
 *      memory while the CTA walks the q heads of its GQA group and their
 *      query tiles (causal: from the first tile that sees a key of the block),
 *      recomputing P = exp(scale·q kᵀ - lse) and dS = P∘(dO vᵀ - Dsum);
 *      dV += Pᵀ dO and dK += scale·dSᵀ q stay in fp32 registers and are added
 *      to dk/dv once at the end (one CTA owns each dk/dv row: no atomics).
 *   3. dq:   one CTA per (64-query tile, batch·q head) walks the key tiles
 *      (causal: up to the diagonal) and recomputes P and dS the same way;
 *      dQ += scale·dS k, added to dq at the end.
 * Why a separate dq kernel instead of FA2's fp32 atomicAdd of dS·k from the
 * dkdv CTAs: atomics make dq's summation order (and so its bits) depend on
 * scheduling, and this project keeps results reproducible run to run (the
 * host backend reduces in rank order); the price is recomputing S and dP
 * once more (7 GEMM-equivalents instead of 5), with no extra scratch.
 * cpar_dev_attn's atomic_dq (CPAR_ATTN_DQ=atomic) takes FA2's way instead:
 * the dkdv kernel adds scale·dS k to dq by fp32 atomics from the dSᵀ it
 * already holds in shared memory (cpar__ab_dq_atomic), and launch 3 is
 * skipped: per 64 x 64 block at d 128 and per warp, 320 HMMA and 144 LDSM
 * where the pair takes 256 + 192 and 112 + 88 (sm_90, no spills, 2 CTAs/SM).
 * Dropout recomputes the forward's mask Z (keep / (1-p)) per weight in both
 * kernels: dkdv forms dS = P∘(dP∘Z − Dsum) first, then P∘Z in place of P
 * for dV; dq needs only dS.
 * Tiles: both kernels take FA2's warp layout (2 x 2 warps over each 64 x 64
 * block of S and dP, whose P and dS go through shared memory to the warps
 * that own 32 rows x D/2 columns of dK and dV, or of dQ): every fragment
 * they load from shared memory feeds at least two mma's, 2.2-2.3 per
 * ldmatrix at d 128 where the first layout (a warp's 16 rows against the
 * whole opposite tile, no exchange) fed 1.6-1.7; shared-memory bandwidth,
 * not the tensor cores, bounds mma.sync kernels there (at d 128 the first
 * layout's pair issued 1.9 times FA2's ldmatrix per block, and ran at
 * 0.44-0.46 of SDPA flash on an H200 on 2026-11-28). Shared tiles are
 * zero-filled past the sequence and past d (padded to D = 64 or 128), rows
 * padded by 8 elements so ldmatrix's 8 row addresses hit distinct banks.
 * P and dS are rounded to the input type for the mma (as FA2 does); every sum
 * is fp32. lse = -inf (a row that sees no key) and rows past sq become +inf in
 * the shared lse, so exp gives exactly 0 there. Instantiations: element type
 * × cpar__attn_var (plain d 64 and 128, causal or not; general d <= 64 and
 * <= 128); the dout dtype is a run-time flag.
 * Traffic: dot reads out and dout once; dkdv reads k, v once and q, dout
 * (plus lse, Dsum) once per 64-key tile; dq reads q, dout once and k, v once
 * per 64-query tile (causal: about half of those tiles); dq, dk, dv are read
 * and written once. Global-to-shared copies are cp.async (section 16's
 * cpar__attn_cp16; through registers only for an f32 dout or a misaligned
 * row), double buffered: the dkdv kernel's next (q head, query tile) step and
 * the dq kernel's next key tile are in flight while the current one
 * computes. A step waits for its own copies before its first barrier, and
 * past it issues the next step's into the buffer the previous step read
 * (every warp is done with it there); one more barrier follows the shared
 * P and dS stores, and in the dkdv kernel at d 128, where one dO buffer
 * leaves room for two CTAs per SM, one after dV, past which the next dO
 * comes in. Where a block gets less shared memory than the d 128 kernels
 * take (99 KB on sm_86, sm_89, sm_120) their lean instantiation runs
 * (cpar__ab_lean: one Q buffer in dkdv, refilled after dK; one V buffer
 * in dq, refilled past the dS barrier); where an SM holds 164 KB (sm_80,
 * sm_87) their slim one, two CTAs an SM (cpar__ab_slim: one buffer for Pᵀ
 * then dSᵀ in dkdv; K and V swapping between two tile buffers in dq).
 * Uses: 2 (errors), 4 (widen/narrow, packs), k_mma.cu (tensor-core wrappers). */

/* CPAR__UNROLL: section 16's (full unrolling under nvcc, nothing under g++). */

static constexpr int CPAR__AB_BC = 64;      /* keys per tile (both kernels) */
static constexpr int CPAR__AB_BRQ = 64;     /* queries per tile of the dq kernel */
static constexpr int CPAR__AB_THREADS = 128; /* 4 warps x 16 rows */
static constexpr float CPAR__AB_LOG2E = 1.4426950408889634f;

/* Queries per step of the dkdv kernel (64 at both head dims: FA2's layout
 * keeps S and dP at 32 x 32 per warp, beside the dK/dV accumulators). */
static constexpr int CPAR__AB_BRKV = 64;

/* lse2 and Dsum rows per (batch, q head) slice: sq rounded up to a multiple
 * of every query tile, so a tile never reads past its slice. */
static constexpr int CPAR__AB_ROW_PAD = 64;
static_assert(CPAR__AB_ROW_PAD % CPAR__AB_BRQ == 0 && CPAR__AB_ROW_PAD % CPAR__AB_BRKV == 0,
              "query tiles divide the scratch's row padding");
static int64_t cpar__ab_sq_pad(int64_t sq) { return (sq + CPAR__AB_ROW_PAD - 1) / CPAR__AB_ROW_PAD * CPAR__AB_ROW_PAD; }

/* Everything the two main kernels read, by value. Pointers are the (0,0)
 * elements of cpar_dev_attn's layout; lse2 and dsum are the dot kernel's
 * [b·hq, sq_pad] outputs. */
struct cpar__ab_args {
    const void *q, *k, *v, *dout;
    const float *lse2, *dsum;
    float *dq, *dk, *dv;
    int64_t b, hq, hkv, sq, sk, sq_pad, q_bh, kv_bh, o_bh, dq_bh, dkv_bh;
    int64_t group; /* hq / hkv: from the constant bank, never a register the kernels must keep */
    int d;
    bool dout_f32, causal, skip_tiles; /* skip_tiles: cpar__attn_skip_hidden_tiles at launch */
    float scale, scale_log2; /* scale and scale·log2(e): exp(x) = exp2(x·log2 e) */
    float dropout_p, keep_scale; /* keep_scale = 1 / (1 - p) */
    cpar_rng_state rng;
    cpar_dev_attn_pos qp, kp;
    int64_t mask_hq, mask_h0; /* cpar_dev_attn's */
};

/* The mask Z = keep_scale or 0 of weight (mask index mbh, query q, key k). */
static __device__ __forceinline__ float cpar__ab_keep(const cpar__ab_args &p, uint64_t mbh,
                                                      const cpar__attn_rowinfo &q, const cpar__attn_rowinfo &k) {
    return cpar__attn_keep(p.rng, p.dropout_p, mbh, (uint64_t)q.pos, (uint64_t)k.pos) ? p.keep_scale : 0.f;
}

/* Calls f(mb, nb, e, row, col) for every element acc[mb][nb][e] of this
 * warp's 16·MB x 8·NB m16n8k16 C fragments: tile row m0 + 16·mb + g +
 * 8·(e/2), tile column n0 + nb·8 + 2t + e%2 (g = lane/4, t = lane%4). The one
 * statement of that layout for the passes over S, dP and the accumulators
 * of both kernels. */
template <int MB, int NB, typename F>
static __device__ __forceinline__ void cpar__ab_each(int m0, int n0, F &&f) {
    const int lane = (int)(threadIdx.x & 31), g = lane >> 2, t = lane & 3;
    CPAR__UNROLL
    for (int mb = 0; mb < MB; mb++)
        CPAR__UNROLL
        for (int nb = 0; nb < NB; nb++)
            CPAR__UNROLL
            for (int e = 0; e < 4; e++) f(mb, nb, e, m0 + 16 * mb + g + 8 * (e >> 1), n0 + nb * 8 + 2 * t + (e & 1));
}

/* Whether weight (query row qr of the query tile at i0, key row kr of the
 * key tile at j0) is masked out: packed, by the rows' infos (a query past sq
 * has document -2), else causal's j0 + kr > i0 + qr, that is kr - qr > diag
 * = cpar__ab_diag(i0, j0): tile-relative 32-bit compares, no 64-bit index
 * per weight. */
static __device__ __forceinline__ bool cpar__ab_hidden(bool packed, bool causal, int diag, int qr, int kr,
                                                       const cpar__attn_rowinfo &q, const cpar__attn_rowinfo &k) {
    return packed ? !cpar__attn_info_sees(q, k, causal) : causal && kr - qr > diag;
}

/* i0 - j0 clamped to int (tile rows are < 256 apart, so the clamp keeps
 * every compare of cpar__ab_hidden). */
static __device__ __forceinline__ int cpar__ab_diag(int64_t i0, int64_t j0) {
    const int64_t dl = i0 - j0;
    return dl > 256 ? 256 : dl < -256 ? -256 : (int)dl;
}

/* P = 2^(S · scale_log2 - lse) over a warp's 32 x 32 block of S at rows m0,
 * columns n0 (cpar__ab_each's fragments); KEY_ROWS: the block is Sᵀ (rows
 * are keys, dk/dv's), else S (rows are queries, dq's). lse(mb, e, qr) is
 * query row qr's log2-sum-exp (e: the fragment element). The mask only where
 * the block may hide a weight (keys past `keys`, the causal diagonal,
 * packed): a warp-uniform choice, so plain blocks pay no compare. */
template <bool KEY_ROWS, int NB, typename Lse>
static __device__ __forceinline__ void cpar__ab_probs(float (&s)[2][NB][4], int m0, int n0, float scale_log2,
                                                      Lse lse, bool packed, bool causal, int diag, int keys,
                                                      const cpar__attn_rowinfo *qi, const cpar__attn_rowinfo *ki) {
    const int qb = KEY_ROWS ? n0 : m0, kb = KEY_ROWS ? m0 : n0;
    auto probs = [&](auto masked) {
        cpar__ab_each<2, NB>(m0, n0, [&](int mb, int nb, int e, int r, int c) {
            const int qr = KEY_ROWS ? c : r, kr = KEY_ROWS ? r : c;
            const float x = cpar__ex2(fmaf(s[mb][nb][e], scale_log2, -lse(mb, e, qr)));
            if constexpr (decltype(masked)::value) {
                const bool hidden = kr >= keys || cpar__ab_hidden(packed, causal, diag, qr, kr, qi[qr], ki[kr]);
                s[mb][nb][e] = hidden ? 0.f : x;
            } else {
                s[mb][nb][e] = x;
            }
        });
    };
    if (CPAR__ATTN_EDGE(packed || keys < kb + 32 || (causal && diag < kb + 31 - qb))) probs(std::true_type{});
    else probs(std::false_type{});
}

/* Shared bytes: `rows` tile rows of T (row pitch D + 8) and `floats` floats. */
template <typename T, int D> static constexpr size_t cpar__ab_smem(int rows, int floats) {
    return (size_t)rows * (D + 8) * sizeof(T) + (size_t)floats * sizeof(float);
}

static __device__ __forceinline__ bool cpar__ab_aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* ROWS x D tile of T (row pitch D + 8) <- rows [0, nvalid) x cols [0, d) of
 * src (row pitch d, element T, or float when src_f32), zeros elsewhere.
 * 8-element chunks: from T where the address allows by cp.async (the caller
 * commits the group and waits for it before its barrier), else by 16-byte or
 * element loads through registers (complete on return). */
template <typename T, int D, int ROWS>
static __device__ __forceinline__ void cpar__ab_load_tile(T *s, const void *src, bool src_f32, int64_t nvalid,
                                                          int d) {
    constexpr int LD = D + 8, CH = D / 8;
    /* rows d elements apart with d % 8 == 0: every 8-element chunk is
     * 16-byte aligned when the tile's first is (one test per tile); 32-bit
     * offsets from it. A whole aligned tile of T takes cpar__attn_cp_tile's
     * unrolled copies; the rest (the last tile, d < D, f32 or misaligned
     * sources) this loop, kept rolled: unrolled with its fallbacks it added
     * 40 % to the kernels' code. */
    const bool vec = cpar__ab_aligned16(src);
    const int inside = cpar__attn_tile_rows(0, nvalid, ROWS);
    if (CPAR__ATTN_WHOLE(vec && !src_f32 && inside == ROWS && d == D)) {
        cpar__attn_cp_tile<T, D, LD, ROWS, CPAR__AB_THREADS>(s, static_cast<const T *>(src));
        return;
    }
    CPAR__ROLLED
    for (int c = (int)threadIdx.x; c < ROWS * CH; c += CPAR__AB_THREADS) {
        const int r = c / CH, col = (c % CH) * 8;
        const unsigned off = (unsigned)(r * d + col);
        cpar__pack<T, 8> v;
        if (r < inside && col < d) {
            if (src_f32) {
                const float *p = static_cast<const float *>(src) + off;
                if (vec) {
                    const cpar__pack<float, 4> lo = cpar__load<4>(p), hi = cpar__load<4>(p + 4);
                    CPAR__UNROLL
                    for (int e = 0; e < 4; e++) {
                        v.v[e] = cpar__narrow<T>(lo.v[e]);
                        v.v[4 + e] = cpar__narrow<T>(hi.v[e]);
                    }
                } else {
                    CPAR__UNROLL
                    for (int e = 0; e < 8; e++) v.v[e] = cpar__narrow<T>(p[e]);
                }
            } else {
                const T *p = static_cast<const T *>(src) + off;
                if (vec) {
                    cpar__attn_cp16(s + r * LD + col, p); /* asynchronous: the caller commits and waits */
                    continue;
                }
                CPAR__UNROLL
                for (int e = 0; e < 8; e++) v.v[e] = p[e];
            }
        } else {
            CPAR__UNROLL
            for (int e = 0; e < 8; e++) v.v[e] = cpar__narrow<T>(0.f);
        }
        cpar__store<8>(s + r * LD + col, v);
    }
}

/* Zeros in a warp's N m16n8k16 C fragments (fully unrolled: registers). */
template <int N> static __device__ __forceinline__ void cpar__ab_zero(float (&acc)[N][4]) {
    CPAR__UNROLL
    for (int n = 0; n < N; n++)
        CPAR__UNROLL
        for (int e = 0; e < 4; e++) acc[n][e] = 0.f;
}

/* acc[MB][NB][4] (16·MB x 8·NB, C fragments) = A·Bᵀ over k in [0, KD): A
 * rows [m0, m0 + 16·MB) of sa, B rows [n0, n0 + 8·NB) of sb, both row-major
 * [row][k] with pitch LD (the q·kᵀ pattern: B from an [n][k] tile without
 * .trans). Each B fragment feeds MB mma's, each A fragment NB. k-steps at
 * or past d (zero columns of the padded tile) are skipped. */
template <typename T, int MB, int NB, int KD, int LD>
static __device__ __forceinline__ void cpar__ab_mma_abt(float (&acc)[MB][NB][4], const T *sa, int m0,
                                                               const T *sb, int n0, int d) {
    const int lane = (int)(threadIdx.x & 31);
    CPAR__UNROLL
    for (int mb = 0; mb < MB; mb++) cpar__ab_zero(acc[mb]);
    CPAR__UNROLL
    for (int kk = 0; kk < KD; kk += 16) {
        if (kk >= d) break;
        uint32_t a[MB][4];
        CPAR__UNROLL
        for (int mb = 0; mb < MB; mb++)
            cpar__ldmatrix_x4(a[mb], sa + (m0 + 16 * mb + (lane & 15)) * LD + kk + 8 * (lane >> 4));
        CPAR__UNROLL
        for (int nb = 0; nb < NB; nb += 2) {
            uint32_t b[4]; /* n-block nb in b[0..1], nb+1 in b[2..3] */
            cpar__ldmatrix_x4(b, sb + (n0 + nb * 8 + (lane & 7) + 8 * (lane >> 4)) * LD + kk + 8 * ((lane >> 3) & 1));
            CPAR__UNROLL
            for (int mb = 0; mb < MB; mb++) {
                cpar__mma_m16n8k16<T>(acc[mb][nb], a[mb], b, acc[mb][nb]);
                cpar__mma_m16n8k16<T>(acc[mb][nb + 1], a[mb], b + 2, acc[mb][nb + 1]);
            }
        }
    }
}
/* acc[MB][NB][4] (16·MB x 8·NB) += A·B over k in [0, KD), both operands in
 * shared memory: A rows [m0, m0 + 16·MB) of sa, row-major [m][k] with pitch
 * LDA, or (A_TRANS) stored transposed, [k][m] (ldmatrix .trans gives the
 * same fragments); B columns [n0, n0 + 8·NB) of sb, row-major [k][n] with
 * pitch LDB (.trans). Column blocks at or past ncols are left alone (never
 * stored). Each A fragment feeds NB mma's, each B fragment MB. */
template <typename T, int MB, int NB, int KD, int LDA, int LDB, bool A_TRANS>
static __device__ __forceinline__ void cpar__ab_mma_ab(float (&acc)[MB][NB][4], const T *sa, int m0, const T *sb,
                                                       int n0, int ncols) {
    const int lane = (int)(threadIdx.x & 31);
    CPAR__UNROLL
    for (int kk = 0; kk < KD; kk += 16) {
        uint32_t a[MB][4];
        CPAR__UNROLL
        for (int mb = 0; mb < MB; mb++) {
            if (A_TRANS) /* 8 x 8 matrix lane / 8: rows m + 8·(its bit 0), k + 8·(its bit 1) */
                cpar__ldmatrix_x4_trans(a[mb], sa + (kk + 8 * (lane >> 4) + (lane & 7)) * LDA + m0 + 16 * mb +
                                                   8 * ((lane >> 3) & 1));
            else
                cpar__ldmatrix_x4(a[mb], sa + (m0 + 16 * mb + (lane & 15)) * LDA + kk + 8 * (lane >> 4));
        }
        CPAR__UNROLL
        for (int nb = 0; nb < NB; nb += 2) {
            if (n0 + nb * 8 >= ncols) break;
            uint32_t b[4];
            cpar__ldmatrix_x4_trans(b, sb + (kk + (lane & 15)) * LDB + n0 + nb * 8 + 8 * (lane >> 4));
            CPAR__UNROLL
            for (int mb = 0; mb < MB; mb++) {
                cpar__mma_m16n8k16<T>(acc[mb][nb], a[mb], b, acc[mb][nb]);
                cpar__mma_m16n8k16<T>(acc[mb][nb + 1], a[mb], b + 2, acc[mb][nb + 1]);
            }
        }
    }
}

/* Row r = (bi·hq + h)·sq_pad + i of rows = b·hq·sq_pad: dsum[r] = Σ_c
 * dout[.., i, c] · out[.., i, c] in fp32, and lse2[r] = log2(e)·lse[.., i],
 * +inf where lse = -inf (a row that sees no key) so that exp2 gives exactly
 * 0 there; rows i >= sq (padding) 0 and +inf. One warp per row (lanes stride
 * the columns, then a fixed butterfly: deterministic), grid-stride over rows. */
template <typename O>
static __global__ void cpar__attn_bwd_dot_kernel(const O *__restrict__ out, const O *__restrict__ dout, int64_t o_bh,
                                                 const float *__restrict__ lse, int64_t lse_bh, int64_t rows,
                                                 int64_t sq, int64_t sq_pad, int d, float *__restrict__ dsum,
                                                 float *__restrict__ lse2) {
    const int lane = (int)(threadIdx.x & 31);
    const int64_t nwarps = cpar__thread_count() >> 5;
    for (int64_t r = cpar__thread_id() >> 5; r < rows; r += nwarps) {
        const int64_t bh = r / sq_pad, i = r % sq_pad;
        if (i >= sq) { /* warp-uniform */
            if (lane == 0) {
                dsum[r] = 0.f;
                lse2[r] = INFINITY;
            }
            continue;
        }
        const int64_t off = bh * o_bh + i * d;
        float acc = 0.f;
        for (int c = lane; c < d; c += 32) acc = fmaf(cpar__widen(dout[off + c]), cpar__widen(out[off + c]), acc);
        CPAR__UNROLL
        for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
        if (lane == 0) {
            const float l = lse[bh * lse_bh + i];
            dsum[r] = acc;
            lse2[r] = l == -INFINITY ? INFINITY : l * CPAR__AB_LOG2E;
        }
    }
}

/* FlashAttention-2's dQ from the dkdv step (cpar_dev_attn's atomic_dq):
 * dQ = dS K for the step's BR queries, A fragments from the shared dSᵀ
 * [BC][LDS] (rounded to T, as the dq kernel rounds its own; .trans loads), B
 * from K. Warp w computes queries 32 (w / 2), columns (w % 2) D / 2 (in
 * PASSES column slices: V::DKDV_DQ_PASSES) and adds scale·dQ to dq with
 * fp32 atomics (two adjacent columns in one on sm_90):
 * the order of the CTAs' additions, and so dq's last bits, vary run to run. */
#if defined(CPAR_SIM) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
#define CPAR__AB_PAIR_ATOMICS 1 /* atomicAdd(float2 *) */
#else
#define CPAR__AB_PAIR_ATOMICS 0
#endif
template <typename T, int D, int LDS, int PASSES>
static __device__ __forceinline__ void cpar__ab_dq_atomic(const cpar__ab_args &p, const T *sdS, const T *sK,
                                                          int64_t qbh, int64_t i0, int d) {
    constexpr int BC = CPAR__AB_BC, LD = D + 8, NDW = D / 16 / PASSES;
    const int warp = (int)(threadIdx.x >> 5), r0 = (warp >> 1) * 32;
    float *gq = p.dq + qbh * p.dq_bh;
#if CPAR__AB_PAIR_ATOMICS
    const bool pairs = ((uintptr_t)gq & 7) == 0;
#endif
    /* The warp's 32 rows all inside sq, d the tile's (the plain kernels: a
     * constant): each thread's atomics are one base pointer plus constant
     * offsets, with no per-element bound test or 64-bit index (they took
     * about 10 instructions an atomic, a third of the step's); the pair
     * choice is made once, outside the unrolled loops. */
    const bool whole = CPAR__ATTN_WHOLE(d == D && i0 + r0 + 32 <= p.sq);
    const int lane = (int)(threadIdx.x & 31);
    CPAR__ROLLED
    for (int pass = 0; pass < PASSES; pass++) {
        const int c0 = (warp & 1) * (D / 2) + pass * (D / 2 / PASSES);
        if (c0 >= d) return;
        float acc[2][NDW][4];
        cpar__ab_zero(acc[0]);
        cpar__ab_zero(acc[1]);
        cpar__ab_mma_ab<T, 2, NDW, BC, LDS, LD, true>(acc, sdS, r0, sK, c0, d);
        if (whole) {
            float *base = gq + (i0 + r0 + (lane >> 2)) * D + c0 + 2 * (lane & 3);
            const auto add = [&](auto pair) {
                (void)pair; /* only sm_90 and the simulator have the 8-byte atomic */
                CPAR__UNROLL
                for (int mb = 0; mb < 2; mb++)
                    CPAR__UNROLL
                    for (int h = 0; h < 2; h++)
                        CPAR__UNROLL
                        for (int nd = 0; nd < NDW; nd++) {
                            float *dst = base + (16 * mb + 8 * h) * D + 8 * nd;
                            const float x0 = p.scale * acc[mb][nd][2 * h], x1 = p.scale * acc[mb][nd][2 * h + 1];
#if CPAR__AB_PAIR_ATOMICS
                            if constexpr (decltype(pair)::value) {
                                atomicAdd(reinterpret_cast<float2 *>(dst), make_float2(x0, x1));
                                continue;
                            }
#endif
                            atomicAdd(dst, x0);
                            atomicAdd(dst + 1, x1);
                        }
            };
#if CPAR__AB_PAIR_ATOMICS
            if (pairs) add(std::true_type{});
            else
#endif
                add(std::false_type{});
            continue;
        }
        /* a C fragment's elements e and e + 1 are adjacent columns of one
         * row: one 8-byte atomic for both where the GPU has them (sm_90)
         * and gq is 8-byte aligned (c and d are even) */
        cpar__ab_each<2, NDW>(r0, c0, [&](int mb, int nd, int e, int r, int c) {
            const int64_t i = i0 + r;
            if (i >= p.sq || c >= d) return;
            float *dst = &gq[i * d + c];
#if CPAR__AB_PAIR_ATOMICS
            if (pairs) {
                if (e % 2 == 0)
                    atomicAdd(reinterpret_cast<float2 *>(dst),
                              make_float2(p.scale * acc[mb][nd][e], p.scale * acc[mb][nd][e + 1]));
                return;
            }
#endif
            atomicAdd(dst, p.scale * acc[mb][nd][e]);
        });
    }
}

/* The warp's 16·MB x 8·NB fp32 C fragments x rounded to T, elements e, e + 1
 * (adjacent columns) in one word w[mb][nb][e / 2]. */
template <typename T, int MB, int NB>
static __device__ __forceinline__ void cpar__ab_pack_frags(uint32_t (&w)[MB][NB][2], const float (&x)[MB][NB][4]) {
    CPAR__UNROLL
    for (int mb = 0; mb < MB; mb++)
        CPAR__UNROLL
        for (int nb = 0; nb < NB; nb++)
            CPAR__UNROLL
            for (int h = 0; h < 2; h++) w[mb][nb][h] = cpar__pack2<T>(x[mb][nb][2 * h], x[mb][nb][2 * h + 1]);
}

/* Packed fragments w (cpar__ab_pack_frags) into the shared [row][col] tile s
 * of T and pitch LDS: one 4-byte store per word (rows 4 words apart at LDS =
 * BR + 8: no bank conflicts). */
template <typename T, int MB, int NB, int LDS>
static __device__ __forceinline__ void cpar__ab_store_packed(T *s, const uint32_t (&w)[MB][NB][2], int m0, int n0) {
    cpar__ab_each<MB, NB>(m0, n0, [&](int mb, int nb, int e, int r, int c) {
        if (e % 2 == 0) *reinterpret_cast<uint32_t *>(s + r * LDS + c) = w[mb][nb][e / 2];
    });
}

/* The warp's fp32 C fragments x, rounded to T, into the shared tile s. */
template <typename T, int MB, int NB, int LDS>
static __device__ __forceinline__ void cpar__ab_store_frags(T *s, const float (&x)[MB][NB][4], int m0, int n0) {
    uint32_t w[MB][NB][2];
    cpar__ab_pack_frags<T>(w, x);
    cpar__ab_store_packed<T, MB, NB, LDS>(s, w, m0, n0);
}

/* Shared bytes of the dkdv kernel: K, V [BC][D+8]; Q_BUFS x Q and DO_BUFS x
 * dO [BR][D+8]; Pᵀ∘Z and dSᵀ [BC][BR+8] of T (one buffer for both with
 * DKDV_PDS_ONE); 2 x (lse, Dsum) [BR] fp32; GENERAL: 2 x the query tile's
 * infos and the key tile's. */
template <typename T, class V> static constexpr size_t cpar__ab_dkdv_smem(void) {
    constexpr int BR = CPAR__AB_BRKV, INFO = (int)(sizeof(cpar__attn_rowinfo) / sizeof(float));
    return cpar__ab_smem<T, V::DT>(2 * CPAR__AB_BC + (V::DKDV_Q_BUFS + V::DKDV_DO_BUFS) * BR,
                                   4 * BR + (V::GENERAL ? (2 * BR + CPAR__AB_BC) * INFO : 0)) +
           (size_t)(V::DKDV_PDS_ONE ? 1 : 2) * CPAR__AB_BC * (BR + 8) * sizeof(T);
}

/* Shared bytes of the dq kernel: Q, dO [BR][D+8]; 2 x K and V_BUFS x V
 * [BC][D+8] (with DQ_KV_SWAP two tiles in all); dS [BR][BC+8] of T;
 * GENERAL: the key tile's and the query tile's infos. */
template <typename T, class V> static constexpr size_t cpar__ab_dq_smem(void) {
    constexpr int INFO = (int)(sizeof(cpar__attn_rowinfo) / sizeof(float));
    return cpar__ab_smem<T, V::DT>(2 * CPAR__AB_BRQ + (V::DQ_KV_SWAP ? 2 : 2 + V::DQ_V_BUFS) * CPAR__AB_BC,
                                   V::GENERAL ? (CPAR__AB_BC + CPAR__AB_BRQ) * INFO : 0) +
           (size_t)CPAR__AB_BRQ * (CPAR__AB_BC + 8) * sizeof(T);
}

/* The backward for GPUs whose blocks may opt in to less shared memory than
 * the d 128 kernels take (104 and 111 KB): 99 KB on sm_86, sm_89 and
 * sm_120 (RTX 30xx-50xx, A10, L4, L40S), where those kernels would not
 * launch. One Q buffer in the dkdv kernel, refilled once every warp is done
 * with dK, and one V buffer in the dq kernel, refilled once every warp is
 * done with dP (87 and 94 KB at d 128, 90 and 96 in the general kernels):
 * the copies then overlap less of a step's work, FA2's choice on those GPUs
 * too (no double buffer). cpar__attn_bwd_launch picks it by the device's
 * cudaDevAttrMaxSharedMemoryPerBlockOptin. */
template <class V> struct cpar__ab_lean : V {
    static constexpr int DKDV_Q_BUFS = 1, DQ_V_BUFS = 1;
};

/* The backward for GPUs whose SM holds two of the d 128 kernels' CTAs only
 * below 81 KB each: 164 KB an SM on sm_80 and sm_87 (A100, A30, Orin),
 * where the 104 and 111 KB kernels ran one CTA (4 warps) per SM and
 * FlashAttention-2 runs 8 warps. The lean buffers, and in the dkdv kernel
 * one buffer for Pᵀ∘Z then dSᵀ (dS waits in registers, packed, while
 * the warps read P for dV: one barrier more a step); in the dq kernel two
 * tile buffers in all, K and V swapping between them every key tile (V of
 * tile t lands in the buffer K of t - 1 held, issued at the tile's top and
 * waited for after S; K of t + 1 lands in V of t's, issued once dS is
 * complete: one barrier more a tile). 78 and 77 KB at d 128, 81 and 79 in
 * the general kernels: two CTAs per SM, the copies each CTA exposes hidden
 * by the other's work. cpar__attn_bwd_launch picks it by the device's
 * cudaDevAttrMaxSharedMemoryPerMultiprocessor. */
template <class V> struct cpar__ab_slim : cpar__ab_lean<V> {
    static constexpr bool DKDV_PDS_ONE = true, DQ_KV_SWAP = true;
};

/* The slim kernels launch on compute capability 8.x only (the SMs of 164
 * KB); a device pass for sm_90 or later builds them as a trap, sparing
 * ptxas the dead code (and kernel_report its figures). Under the sim build
 * they run as everywhere. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CPAR__AB_SLIM_TRAP(V)                                                                                          \
    if constexpr (V::DKDV_PDS_ONE || V::DQ_KV_SWAP) {                                                                  \
        __trap();                                                                                                      \
        return;                                                                                                        \
    }
#else
#define CPAR__AB_SLIM_TRAP(V)
#endif

/* dK, dV of one 64-key tile (blockIdx.x) for batch·kv-head slices
 * blockIdx.y, += gridDim.y, in steps of BR = 64 queries (a q head of the GQA
 * group and a query tile; shared memory: cpar__ab_dkdv_smem). The steps
 * alternate between two buffers of Q, lse and Dsum (and dO at d 64), the next
 * step's copies (cp.async) in flight while this one computes; at d 128 one
 * dO buffer (two CTAs per SM: 104 KB each), refilled once every warp is done
 * with dV. FA2's warp layout, 128 threads: for S and dP warp w computes the
 * 32 x 32 block of keys 32 (w / 2), queries 32 (w % 2), so each fragment it
 * loads feeds two mma's, and writes Pᵀ∘Z and dSᵀ to shared memory; for dV +=
 * (P∘Z)ᵀ dO and dK += dSᵀ Q it owns keys 32 (w / 2), columns (w % 2) D / 2
 * (D / 16 mma's per A fragment, two per B). Barriers per step: its top (its
 * copies landed, the previous step's readers done), after the Pᵀ and dSᵀ
 * stores, with one dO buffer after dV, with one Q buffer (lean) after dK,
 * and with one buffer for Pᵀ and dSᵀ (slim) after dV and after the dSᵀ
 * stores. */
template <typename T, class V, bool ADQ>
static __global__ void __launch_bounds__(CPAR__AB_THREADS, 2) cpar__attn_bwd_dkdv_kernel(const cpar__ab_args p) {
    constexpr int D = V::DT, BC = CPAR__AB_BC, BR = CPAR__AB_BRKV, LD = D + 8, LDS = BR + 8, NQ = 4, ND = D / 16;
    CPAR__AB_SLIM_TRAP(V)
    constexpr bool DO2 = V::DKDV_DO_BUFS == 2, Q2 = V::DKDV_Q_BUFS == 2, PDS1 = V::DKDV_PDS_ONE;
    CPAR_DYN_SMEM(unsigned char, smem);
    T *sK = reinterpret_cast<T *>(smem), *sV = sK + BC * LD, *sQb = sV + BC * LD;
    T *sdOb = sQb + V::DKDV_Q_BUFS * BR * LD;
    T *sP = sdOb + V::DKDV_DO_BUFS * BR * LD, *sdS = PDS1 ? sP : sP + BC * LDS;
    float *sLD = reinterpret_cast<float *>(sdS + BC * LDS);
    /* GENERAL: 2 x [BR] query infos, then the tile's [BC] key infos (in
     * shared memory, not registers: at d 128 the general kernel spilled) */
    cpar__attn_rowinfo *sQI = reinterpret_cast<cpar__attn_rowinfo *>(sLD + 4 * BR), *sKI = sQI + 2 * BR;
    const int warp = (int)(threadIdx.x >> 5);
    const int kb = (warp >> 1) * 32, qb = (warp & 1) * 32, cb = (warp & 1) * (D / 2); /* the warp's blocks */
    const int64_t j0 = (int64_t)blockIdx.x * BC, group = p.group;
    const int d = V::d(p.d);
    const bool causal = V::causal(p.causal), packed = V::packed(p.qp, p.kp), drop = V::drop(p.dropout_p);
    const bool skip = causal && !packed;
    int64_t i_first = 0, i_end = p.sq; /* packed: the query tiles that may see a key of this tile */
    if (packed) cpar__attn_visible<false>(p.kp, p.qp, p.skip_tiles, causal, j0, BC, p.sk, p.sq, BR, &i_first, &i_end);
    if (skip) i_first = j0 / BR * BR;  /* earlier query tiles see none of these keys */
    if (skip && i_first >= p.sq) return; /* block-uniform: no query sees them at all */
    const int64_t ntiles = i_end > i_first ? (i_end - i_first + BR - 1) / BR : 0, steps = group * ntiles;
    const size_t osz = p.dout_f32 ? sizeof(float) : sizeof(T);
    const int keys = cpar__attn_tile_rows(j0, p.sk, BC); /* the tile's keys inside sk */
    if (packed || drop) /* read past the slice loop's first barrier */
        for (int c = (int)threadIdx.x; c < BC; c += CPAR__AB_THREADS)
            sKI[c] = cpar__attn_info(p.kp, packed, j0 + c, p.sk);
    for (int64_t bh = blockIdx.y; bh < p.b * p.hkv; bh += gridDim.y) {
        const int64_t bi = bh / p.hkv, hk = bh % p.hkv;
        /* step n: q head hk·group + n / ntiles, query tile i_first + (n % ntiles)·BR;
         * a cursor walks them (no 64-bit division per step) */
        struct cursor {
            int64_t qbh, i0;
        };
        const int64_t i_last = i_first + (ntiles - 1) * BR;
        auto next = [&](cursor c) { return c.i0 < i_last ? cursor{c.qbh, c.i0 + BR} : cursor{c.qbh + 1, i_first}; };
        auto dout_tile = [&](int64_t n) { return sdOb + (DO2 ? (n & 1) * BR * LD : 0); };
        auto q_tile = [&](int64_t n) { return sQb + (Q2 ? (n & 1) * BR * LD : 0); };
        auto stage_dout = [&](int64_t n, cursor c) {
            cpar__ab_load_tile<T, D, BR>(dout_tile(n),
                                         static_cast<const char *>(p.dout) + (size_t)(c.qbh * p.o_bh + c.i0 * d) * osz,
                                         p.dout_f32, p.sq - c.i0, d);
        };
        auto stage_q = [&](int64_t n, cursor c) {
            cpar__ab_load_tile<T, D, BR>(q_tile(n), static_cast<const T *>(p.q) + c.qbh * p.q_bh + c.i0 * d, false,
                                         p.sq - c.i0, d);
        };
        auto stage = [&](int64_t n, cursor c) { /* issue step n's copies (Q's and dO's with two buffers) */
            const int64_t qbh = c.qbh, i0 = c.i0;
            float *l_s = sLD + (n & 1) * 2 * BR;
            if (Q2) stage_q(n, c);
            if (DO2) stage_dout(n, c);
            cpar__attn_rowinfo *qi_s = sQI + (n & 1) * BR;
            static_assert(BR <= CPAR__AB_THREADS, "one thread per query row of the step");
            if (const int r = (int)threadIdx.x; r < BR) {
                /* asynchronous, in the step's group; rows past sq are the
                 * scratch's padding (i0 + BR <= sq_pad: i0 % BR == 0) */
                const int64_t i = i0 + r, row = qbh * p.sq_pad + i;
                cpar__attn_cp4(&l_s[r], &p.lse2[row]);
                cpar__attn_cp4(&l_s[BR + r], &p.dsum[row]);
                if (packed || drop) qi_s[r] = cpar__attn_info(p.qp, packed, i, p.sq);
            }
        };
        __syncthreads(); /* the previous slice's readers are done */
        cpar__ab_load_tile<T, D, BC>(sK, static_cast<const T *>(p.k) + bh * p.kv_bh + j0 * d, false, p.sk - j0, d);
        cpar__ab_load_tile<T, D, BC>(sV, static_cast<const T *>(p.v) + bh * p.kv_bh + j0 * d, false, p.sk - j0, d);
        cursor cur = {bi * p.hq + hk * group, i_first}; /* step 0's rows, then step n's at the loop's top */
        if (steps > 0) {
            stage(0, cur);
            if (!Q2) stage_q(0, cur);
            if (!DO2) stage_dout(0, cur);
        }
        cpar__attn_cp_commit();
        float dk[2][ND][4], dv[2][ND][4];
        for (int mb = 0; mb < 2; mb++) {
            cpar__ab_zero(dk[mb]);
            cpar__ab_zero(dv[mb]);
        }
        for (int64_t n = 0; n < steps; n++) {
            /* past this barrier every thread's copies for step n have landed
             * and every warp is done with step n - 1: its buffers, Pᵀ and dSᵀ
             * take new data */
            cpar__attn_cp_wait<0>();
            __syncthreads();
            const int64_t qbh = cur.qbh, i0 = cur.i0; /* step n's rows */
            cur = next(cur);
            if (n + 1 < steps) stage(n + 1, cur);
            cpar__attn_cp_commit();
            const T *sQ = q_tile(n), *sdO = dout_tile(n);
            [[maybe_unused]] uint32_t dsw[2][NQ][2]; /* PDS1: dSᵀ packed, stored once every warp is done with Pᵀ */
            {
                float s[2][NQ][4], dp[2][NQ][4]; /* Sᵀ then Pᵀ; dPᵀ then dSᵀ: [key][query] */
                const int diag = cpar__ab_diag(i0, j0);
                /* the block's keys are past sk, its queries past sq, or
                 * (causal) every key after every query: P = 0, dS = 0 */
                const bool idle = kb >= keys || i0 + qb >= p.sq || (skip && kb - (qb + 31) > diag);
                if (!idle) {
                    const float *sL = sLD + (n & 1) * 2 * BR, *sD = sL + BR;
                    const cpar__attn_rowinfo *qi_s = sQI + (n & 1) * BR;
                    cpar__ab_mma_abt<T, 2, NQ, D, LD>(s, sK, kb, sQ, qb, d);
                    cpar__ab_probs<true>(s, kb, qb, p.scale_log2, [&](int, int, int r) { return sL[r]; }, packed,
                                         causal, diag, keys, qi_s, sKI);
                    cpar__ab_mma_abt<T, 2, NQ, D, LD>(dp, sV, kb, sdO, qb, d);
                    /* dS = P ∘ (dP ∘ Z − D) needs P itself; then P ∘ Z (in s) for
                     * dV. Without dropout Z = 1: both products are exact, the
                     * bits those of P ∘ (dP − D) and P. */
                    const uint64_t mbh = drop ? cpar__attn_mask_bh(qbh, p.hq, p.mask_hq, p.mask_h0) : 0;
                    cpar__ab_each<2, NQ>(kb, qb, [&](int mb, int nb, int e, int kr, int r) {
                        const float z = drop ? cpar__ab_keep(p, mbh, qi_s[r], sKI[kr]) : 1.f;
                        dp[mb][nb][e] = s[mb][nb][e] * (dp[mb][nb][e] * z - sD[r]);
                        s[mb][nb][e] *= z;
                    });
                } else {
                    for (int mb = 0; mb < 2; mb++) {
                        cpar__ab_zero(s[mb]);
                        cpar__ab_zero(dp[mb]);
                    }
                }
                cpar__ab_store_frags<T, 2, NQ, LDS>(sP, s, kb, qb);
                if constexpr (PDS1) cpar__ab_pack_frags<T>(dsw, dp);
                else cpar__ab_store_frags<T, 2, NQ, LDS>(sdS, dp, kb, qb);
            }
            __syncthreads(); /* Pᵀ (and dSᵀ) complete */
            if constexpr (PDS1) {
                /* dSᵀ waits in 16 registers: dV one rolled k-step (16
                 * queries) at a time, so that ptxas cannot hoist the whole
                 * product's ldmatrix loads above it (unrolled it spilled
                 * 40-72 bytes, in two halves 8-32) */
                CPAR__ROLLED
                for (int h = 0; h < BR; h += 16)
                    cpar__ab_mma_ab<T, 2, ND, 16, LDS, LD, false>(dv, sP + h, kb, sdO + h * LD, cb, d);
            } else {
                cpar__ab_mma_ab<T, 2, ND, BR, LDS, LD, false>(dv, sP, kb, sdO, cb, d);
            }
            if constexpr (!DO2 || PDS1) {
                __syncthreads(); /* every warp is done with dO (and Pᵀ): step n + 1's dO comes in (and dSᵀ) */
                if constexpr (!DO2) {
                    if (n + 1 < steps) stage_dout(n + 1, cur);
                    cpar__attn_cp_commit();
                }
                if constexpr (PDS1) {
                    cpar__ab_store_packed<T, 2, NQ, LDS>(sdS, dsw, kb, qb);
                    __syncthreads(); /* dSᵀ complete */
                }
            }
            cpar__ab_mma_ab<T, 2, ND, BR, LDS, LD, false>(dk, sdS, kb, sQ, cb, d);
            if constexpr (!Q2) {
                __syncthreads(); /* every warp is done with Q: step n + 1's comes in */
                if (n + 1 < steps) stage_q(n + 1, cur);
                cpar__attn_cp_commit();
            }
            if (ADQ) cpar__ab_dq_atomic<T, D, LDS, V::DKDV_DQ_PASSES>(p, sdS, sK, qbh, i0, d);
        }
        cpar__attn_cp_wait<0>(); /* no copy still lands in a buffer the next slice refills */
        float *gk = p.dk + bh * p.dkv_bh, *gv = p.dv + bh * p.dkv_bh;
        cpar__ab_each<2, ND>(kb, cb, [&](int mb, int nd, int e, int kr, int c) {
            const int64_t j = j0 + kr;
            if (j < p.sk && c < d) {
                gk[j * d + c] += p.scale * dk[mb][nd][e];
                gv[j * d + c] += dv[mb][nd][e];
            }
        });
    }
}

/* dQ of one 64-query tile (blockIdx.x) for batch·q-head slices blockIdx.y,
 * += gridDim.y. Shared: Q, dO [BR][D+8] of T; two buffers of K, V [BC][D+8],
 * the key tiles alternating between them, the next tile's copies (cp.async)
 * in flight while this one computes (lean: one V buffer, refilled once dS
 * is complete: every warp is done with dP); dS [BR][BC+8] of T; GENERAL: the key
 * tile's infos (written for the next tile once dS is complete: every warp
 * is done with them then) and the query tile's. The dkdv kernel's warp layout: for S and
 * dP warp w computes the 32 x 32 block of queries 32 (w / 2), keys 32 (w % 2)
 * (its rows' lse and Dsum in registers) and writes dS to shared memory;
 * after a barrier it adds dS K to its 32 queries x D/2 columns (w % 2) of dQ,
 * which stay in registers across the key tiles. */
template <typename T, class V>
static __global__ void __launch_bounds__(CPAR__AB_THREADS, V::DQ_CTAS) cpar__attn_bwd_dq_kernel(const cpar__ab_args p) {
    CPAR__AB_SLIM_TRAP(V)
    constexpr int D = V::DT, BR = CPAR__AB_BRQ, BC = CPAR__AB_BC, LD = D + 8, LDS = BC + 8, NK = 4, ND = D / 16;
    CPAR_DYN_SMEM(unsigned char, smem);
    constexpr bool SWAP = V::DQ_KV_SWAP, V2 = !SWAP && V::DQ_V_BUFS == 2;
    T *sQ = reinterpret_cast<T *>(smem), *sdO = sQ + BR * LD, *sKb = sdO + BR * LD, *sVb = sKb + 2 * BC * LD;
    T *sdS = sVb + (SWAP ? 0 : V::DQ_V_BUFS) * BC * LD;
    /* GENERAL: [BC] key infos, [BR] query infos (in shared memory, not
     * registers: at d 128 the general kernel spilled 88 bytes) */
    cpar__attn_rowinfo *sKI = reinterpret_cast<cpar__attn_rowinfo *>(sdS + BR * LDS), *sQI = sKI + BC;
    const int warp = (int)(threadIdx.x >> 5), g = (int)(threadIdx.x & 31) >> 2, t = (int)(threadIdx.x & 3);
    const int qb = (warp >> 1) * 32, kb = (warp & 1) * 32, cb = (warp & 1) * (D / 2); /* the warp's blocks */
    /* the last query tiles first: causal, they have the most key tiles, so the
     * long CTAs start early and the short ones fill the tail */
    const int64_t i0 = (int64_t)(gridDim.x - 1 - blockIdx.x) * BR, group = p.group;
    const int d = V::d(p.d);
    const bool causal = V::causal(p.causal), packed = V::packed(p.qp, p.kp), drop = V::drop(p.dropout_p);
    const bool skip = causal && !packed;
    int64_t j_begin = 0, j_end = p.sk; /* packed: the key tiles that some query of this tile may see */
    if (packed) cpar__attn_visible<true>(p.qp, p.kp, p.skip_tiles, causal, i0, BR, p.sq, p.sk, BC, &j_begin, &j_end);
    /* causal: keys past the tile's last query are seen by none of its rows */
    if (skip && i0 + BR < j_end) j_end = i0 + BR;
    const size_t osz = p.dout_f32 ? sizeof(float) : sizeof(T);
    if (packed || drop) /* read past the slice loop's first barrier */
        for (int r = (int)threadIdx.x; r < BR; r += CPAR__AB_THREADS)
            sQI[r] = cpar__attn_info(p.qp, packed, i0 + r, p.sq);
    for (int64_t bh = blockIdx.y; bh < p.b * p.hq; bh += gridDim.y) {
        const int64_t kvbh = (bh / p.hq) * p.hkv + (bh % p.hq) / group;
        const uint64_t mbh = drop ? cpar__attn_mask_bh(bh, p.hq, p.mask_hq, p.mask_h0) : 0; /* dropout's bh */
        /* key tile j0's K and V when its buffer index is buf (SWAP: V in the
         * other tile buffer; one V buffer: V in it) */
        auto k_tile = [&](int buf) { return sKb + buf * BC * LD; };
        auto v_tile = [&](int buf) { return SWAP ? sKb + (buf ^ 1) * BC * LD : sVb + (V2 ? buf * BC * LD : 0); };
        auto stage_v = [&](int64_t j0, int buf) {
            cpar__ab_load_tile<T, D, BC>(v_tile(buf), static_cast<const T *>(p.v) + kvbh * p.kv_bh + j0 * d, false,
                                         p.sk - j0, d);
        };
        auto stage = [&](int64_t j0, int buf) { /* issue key tile j0's copies into buffer buf (V's with two) */
            cpar__ab_load_tile<T, D, BC>(k_tile(buf), static_cast<const T *>(p.k) + kvbh * p.kv_bh + j0 * d, false,
                                         p.sk - j0, d);
            if (V2) stage_v(j0, buf);
        };
        auto key_infos = [&](int64_t j0) { /* read past the next barrier at the loop's top */
            if (packed || drop)
                for (int c = (int)threadIdx.x; c < BC; c += CPAR__AB_THREADS)
                    sKI[c] = cpar__attn_info(p.kp, packed, j0 + c, p.sk);
        };
        __syncthreads(); /* the previous slice's readers are done */
        cpar__ab_load_tile<T, D, BR>(sQ, static_cast<const T *>(p.q) + bh * p.q_bh + i0 * d, false, p.sq - i0, d);
        cpar__ab_load_tile<T, D, BR>(sdO, static_cast<const char *>(p.dout) + (size_t)(bh * p.o_bh + i0 * d) * osz,
                                     p.dout_f32, p.sq - i0, d);
        if (j_begin < j_end) {
            stage(j_begin, 0);
            if (!V2 && !SWAP) stage_v(j_begin, 0);
            key_infos(j_begin);
        }
        cpar__attn_cp_commit();
        float l2[2][2], ds[2][2]; /* rows qb + 16 mb + g (+ 8) */
        CPAR__UNROLL
        for (int mb = 0; mb < 2; mb++)
            CPAR__UNROLL
            for (int h = 0; h < 2; h++) {
                const int64_t row = bh * p.sq_pad + i0 + qb + 16 * mb + g + 8 * h;
                l2[mb][h] = p.lse2[row]; /* past sq: the padding's +inf and 0 */
                ds[mb][h] = p.dsum[row];
            }
        float dq[2][ND][4];
        cpar__ab_zero(dq[0]);
        cpar__ab_zero(dq[1]);
        int buf = 0;
        for (int64_t j0 = j_begin; j0 < j_end; j0 += BC, buf ^= 1) {
            /* past this barrier this tile's copies (SWAP: K's) and key infos
             * are in and every warp is done with the previous tile: its
             * buffer takes the next tile's copies (SWAP: this tile's V), and
             * dS this tile's */
            cpar__attn_cp_wait<0>();
            __syncthreads();
            if (SWAP) stage_v(j0, buf);
            else if (j0 + BC < j_end) stage(j0 + BC, buf ^ 1);
            cpar__attn_cp_commit();
            const T *sK = k_tile(buf), *sV = v_tile(buf);
            {
                float s[2][NK][4], dp[2][NK][4]; /* S then P; dP then dS: [query][key] */
                const int diag = cpar__ab_diag(i0, j0), keys = cpar__attn_tile_rows(j0, p.sk, BC);
                /* the block's queries are past sq, its keys past sk, or
                 * (causal) every key after every query: dS = 0 */
                const bool idle = i0 + qb >= p.sq || kb >= keys || (skip && kb - (qb + 31) > diag);
                auto probs = [&] { /* S = Q Kᵀ, then P in s */
                    cpar__ab_mma_abt<T, 2, NK, D, LD>(s, sQ, qb, sK, kb, d);
                    cpar__ab_probs<false>(s, qb, kb, p.scale_log2, [&](int mb, int e, int) { return l2[mb][e >> 1]; },
                                          packed, causal, diag, keys, sQI, sKI);
                };
                if constexpr (SWAP) { /* then V has landed: every thread's copies, then the barrier */
                    if (!idle) probs();
                    cpar__attn_cp_wait<0>();
                    __syncthreads();
                }
                if (!idle) {
                    if constexpr (!SWAP) probs();
                    cpar__ab_mma_abt<T, 2, NK, D, LD>(dp, sdO, qb, sV, kb, d);
                    if (drop) /* dP ∘ Z; keys 2t, 2t+1 of an n-block share one Philox block (cpar__attn_keep2) */
                        CPAR__UNROLL
                        for (int mb = 0; mb < 2; mb++)
                            CPAR__UNROLL
                            for (int nb = 0; nb < NK; nb++)
                                CPAR__UNROLL
                                for (int h = 0; h < 2; h++) {
                                    const int r = qb + 16 * mb + g + 8 * h, kc = kb + nb * 8 + 2 * t;
                                    bool k0, k1;
                                    cpar__attn_keep2(p.rng, p.dropout_p, mbh, (uint64_t)sQI[r].pos,
                                                     (uint64_t)sKI[kc].pos, (uint64_t)sKI[kc + 1].pos, &k0, &k1);
                                    dp[mb][nb][2 * h] *= k0 ? p.keep_scale : 0.f;
                                    dp[mb][nb][2 * h + 1] *= k1 ? p.keep_scale : 0.f;
                                }
                    cpar__ab_each<2, NK>(qb, kb, [&](int mb, int nb, int e, int, int) {
                        dp[mb][nb][e] = s[mb][nb][e] * (dp[mb][nb][e] - ds[mb][e >> 1]);
                    });
                } else {
                    cpar__ab_zero(dp[0]);
                    cpar__ab_zero(dp[1]);
                }
                cpar__ab_store_frags<T, 2, NK, LDS>(sdS, dp, qb, kb);
            }
            __syncthreads(); /* dS complete; every warp is done with the key infos (and V) */
            if (j0 + BC < j_end) key_infos(j0 + BC);
            if constexpr (SWAP) { /* the next K into this V's buffer */
                if (j0 + BC < j_end) stage(j0 + BC, buf ^ 1);
                cpar__attn_cp_commit();
            } else if constexpr (!V2) {
                if (j0 + BC < j_end) stage_v(j0 + BC, 0);
                cpar__attn_cp_commit();
            }
            cpar__ab_mma_ab<T, 2, ND, BC, LDS, LD, false>(dq, sdS, qb, sK, cb, d);
        }
        cpar__attn_cp_wait<0>(); /* no copy still lands in a buffer the next slice refills */
        float *gq = p.dq + bh * p.dq_bh;
        cpar__ab_each<2, ND>(qb, cb, [&](int mb, int nd, int e, int r, int c) {
            const int64_t i = i0 + r;
            if (i < p.sq && c < d) gq[i * d + c] += p.scale * dq[mb][nd][e];
        });
    }
}

/* Grid y: batch·head slices, capped at CUDA's limit (the kernels loop over
 * the rest). The sim test lowers the cap to exercise that loop. */
static int64_t cpar__ab_grid_y_cap = 65535;
static unsigned cpar__ab_grid_y(int64_t slices) {
    return (unsigned)(slices < cpar__ab_grid_y_cap ? slices : cpar__ab_grid_y_cap);
}

template <typename K> static cudaError_t cpar__ab_smem_optin(K kernel, size_t bytes) {
    if (bytes <= 48 * 1024) return cudaSuccess;
    return cudaFuncSetAttribute(reinterpret_cast<const void *>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)bytes);
}

/* The dkdv and dq launches of one element type and instantiation V; with
 * atomic_dq the dkdv kernel adds dq itself (cpar__ab_dq_atomic), no dq
 * launch. */
template <typename T, class V>
static cudaError_t cpar__attn_bwd_run(const cpar__ab_args &p, bool atomic_dq, cudaStream_t cs) {
    auto kv = atomic_dq ? cpar__attn_bwd_dkdv_kernel<T, V, true> : cpar__attn_bwd_dkdv_kernel<T, V, false>;
    constexpr size_t smem_kv = cpar__ab_dkdv_smem<T, V>(), smem_q = cpar__ab_dq_smem<T, V>();
    static_assert(smem_kv <= 113 * 1024, "two dkdv CTAs per SM (228 KB on sm_90, 1 KB reserved by each)");
    static_assert(smem_q <= 113 * 1024, "two dq CTAs per SM");
    cudaError_t e = cpar__ab_smem_optin(kv, smem_kv);
    if (e != cudaSuccess) return e;
    const dim3 grid_kv((unsigned)((p.sk + CPAR__AB_BC - 1) / CPAR__AB_BC), cpar__ab_grid_y(p.b * p.hkv));
    CPAR_LAUNCH(kv, grid_kv, CPAR__AB_THREADS, smem_kv, cs)(p);
    if ((e = cudaGetLastError()) != cudaSuccess || atomic_dq) return e;
    auto qk = cpar__attn_bwd_dq_kernel<T, V>;
    if ((e = cpar__ab_smem_optin(qk, smem_q)) != cudaSuccess) return e;
    const dim3 grid_q((unsigned)((p.sq + CPAR__AB_BRQ - 1) / CPAR__AB_BRQ), cpar__ab_grid_y(p.b * p.hq));
    CPAR_LAUNCH(qk, grid_q, CPAR__AB_THREADS, smem_q, cs)(p);
    return cudaGetLastError();
}

/* The larger of the two kernels' shared bytes for instantiation V. */
template <typename T, class V> static constexpr size_t cpar__ab_smem_need(void) {
    return cpar__ab_dkdv_smem<T, V>() > cpar__ab_dq_smem<T, V>() ? cpar__ab_dkdv_smem<T, V>()
                                                                 : cpar__ab_dq_smem<T, V>();
}

/* V's kernels where two of their CTAs fit an SM; else, on compute
 * capability 8.x, their slim instantiation where two of its fit
 * (cpar__ab_slim: the d 128 kernels on sm_80 and sm_87); else, where a block
 * gets less shared memory than V's take, their lean one (cpar__ab_lean:
 * the d 128 kernels on sm_86, sm_89 and sm_120, one CTA an SM either way). */
template <typename T, class V>
static cudaError_t cpar__attn_bwd_launch(const cpar__ab_args &p, bool atomic_dq, cudaStream_t cs) {
    constexpr size_t need = cpar__ab_smem_need<T, V>(), reserved = 1024; /* CUDA's per CTA */
    if constexpr (2 * (need + reserved) > 164 * 1024) {
        using L = cpar__ab_lean<V>;
        using S = cpar__ab_slim<V>;
        static_assert(cpar__ab_smem_need<T, L>() <= 99 * 1024,
                      "the lean kernels fit sm_86, sm_89 and sm_120 (99 KB a block)");
        static_assert(2 * (cpar__ab_smem_need<T, S>() + reserved) <= 164 * 1024,
                      "two slim CTAs fit an SM of sm_80 and sm_87 (164 KB)");
        int dev = 0, optin = 0, per_sm = 0, major = 0;
        cudaError_t e = cudaGetDevice(&dev);
        if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        if (e == cudaSuccess) e = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
        if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        if (e != cudaSuccess) return e;
        if (2 * (need + reserved) > (size_t)per_sm) {
            if (major == 8 && 2 * (cpar__ab_smem_need<T, S>() + reserved) <= (size_t)per_sm)
                return cpar__attn_bwd_run<T, S>(p, atomic_dq, cs);
            if constexpr (need > 99 * 1024) /* the only kernels a block of some GPU cannot take */
                if ((size_t)optin < need) return cpar__attn_bwd_run<T, L>(p, atomic_dq, cs);
        }
    }
    return cpar__attn_bwd_run<T, V>(p, atomic_dq, cs);
}

/* Query rows b·hq·sq_pad; the scratch is their Dsum, then their
 * log2(e)·lse (fp32 each: the dot kernel's outputs). */
static int64_t cpar__ab_dsum_rows(const cpar_dev_attn *a) { return a->b * a->hq * cpar__ab_sq_pad(a->sq); }

size_t cpar_dev_attention_bwd_scratch_bytes(const cpar_dev_attn *a) {
    if (a == NULL || a->b <= 0 || a->hq <= 0 || a->sq <= 0 || a->sk <= 0 || a->d <= 0) return 0;
    return 2 * (size_t)cpar__ab_dsum_rows(a) * sizeof(float);
}

cpar_status cpar_dev_attention_bwd(const cpar_dev_attn *a, const void *out, const void *dout, cpar_dtype out_dt,
                                   int64_t o_bh, const float *lse, int64_t lse_bh, float *dq, int64_t dq_bh,
                                   float *dk, float *dv, int64_t dkv_bh, void *scratch, cpar_dev_stream s) {
    CPAR__CHECK_PTR(a, true);
    if (a->dt != CPAR_F16 && a->dt != CPAR_BF16)
        return CPAR__INVALID("a->dt = %s, expected f16 or bf16 on devices", cpar__dtype_name(a->dt));
    if (out_dt != CPAR_F32 && out_dt != a->dt)
        return CPAR__INVALID("out_dt = %s, expected f32 or a->dt (%s)", cpar__dtype_name(out_dt),
                             cpar__dtype_name(a->dt));
    const int64_t b = a->b, hq = a->hq, hkv = a->hkv, sq = a->sq, sk = a->sk, d = a->d;
    CPAR__CHECK_COUNT(b);
    CPAR__CHECK_COUNT(hq);
    CPAR__CHECK_COUNT(sq);
    CPAR__CHECK_COUNT(sk);
    if (hkv < 1 || hq % hkv != 0)
        return CPAR__INVALID("a->hkv = %lld, expected >= 1 and dividing a->hq = %lld", (long long)hkv, (long long)hq);
    if (d < 0 || d > 128 || d % 8 != 0)
        return CPAR__INVALID("a->d = %lld, expected a multiple of 8 in [0, 128] on devices", (long long)d);
    if (!(a->scale > 0.f) || !isfinite(a->scale))
        return CPAR__INVALID("a->scale = %g, expected finite and > 0 (resolved)", (double)a->scale);
    if (!(a->dropout_p >= 0.f && a->dropout_p < 1.f))
        return CPAR__INVALID("a->dropout_p = %g, expected 0 <= p < 1", (double)a->dropout_p);
    const bool work = b > 0 && hq > 0 && sq > 0 && sk > 0 && d > 0;
    if (!work) return CPAR_OK;
    CPAR__CHECK_PTR(a->q, true);
    CPAR__CHECK_PTR(a->k, true);
    CPAR__CHECK_PTR(a->v, true);
    CPAR__CHECK_PTR(out, true);
    CPAR__CHECK_PTR(dout, true);
    CPAR__CHECK_PTR(lse, true);
    CPAR__CHECK_PTR(dq, true);
    CPAR__CHECK_PTR(dk, true);
    CPAR__CHECK_PTR(dv, true);
    CPAR__CHECK_PTR(scratch, true);
    /* the (batch, head) slices must not overlap: strides of at least one slice */
    const struct {
        const char *name;
        int64_t got, min;
    } strides[] = {{"a->q_bh", a->q_bh, sq * d}, {"a->kv_bh", a->kv_bh, sk * d}, {"o_bh", o_bh, sq * d},
                   {"lse_bh", lse_bh, sq},       {"dq_bh", dq_bh, sq * d},      {"dkv_bh", dkv_bh, sk * d}};
    for (const auto &st : strides)
        if (st.got < st.min)
            return CPAR__INVALID("%s = %lld, expected >= %lld (one slice: sq = %lld, sk = %lld, d = %lld)", st.name,
                                 (long long)st.got, (long long)st.min, (long long)sq, (long long)sk, (long long)d);
    if (!cpar__aligned(sizeof(float), scratch))
        return CPAR__INVALID("scratch = %p, expected 4-byte alignment", scratch);

    cudaStream_t cs = cpar__stream(s);
    const int64_t rows = cpar__ab_dsum_rows(a);
    float *dsum = static_cast<float *>(scratch), *lse2 = dsum + rows;
    const unsigned dot_grid = cpar__grid(rows, CPAR__BLOCK / 32);
    cudaError_t e = cpar__with_float_type(out_dt, [&](auto zt) {
        typedef decltype(zt) O;
        CPAR_LAUNCH(cpar__attn_bwd_dot_kernel<O>, dot_grid, CPAR__BLOCK, 0, cs)
        (static_cast<const O *>(out), static_cast<const O *>(dout), o_bh, lse, lse_bh, rows, sq, cpar__ab_sq_pad(sq),
         (int)d, dsum, lse2);
        return cudaGetLastError();
    });
    CPAR__TRY_CUDA(e, "attention_bwd dot kernel launch (%s, %lld rows x %lld)", cpar__dtype_name(out_dt),
                   (long long)rows, (long long)d);

    cpar__ab_args p;
    p.q = a->q;
    p.k = a->k;
    p.v = a->v;
    p.dout = dout;
    p.lse2 = lse2;
    p.dsum = dsum;
    p.dq = dq;
    p.dk = dk;
    p.dv = dv;
    p.b = b;
    p.hq = hq;
    p.hkv = hkv;
    p.group = hq / hkv;
    p.sq = sq;
    p.sk = sk;
    p.sq_pad = cpar__ab_sq_pad(sq);
    p.q_bh = a->q_bh;
    p.kv_bh = a->kv_bh;
    p.o_bh = o_bh;
    p.dq_bh = dq_bh;
    p.dkv_bh = dkv_bh;
    p.d = (int)d;
    p.dout_f32 = out_dt == CPAR_F32;
    p.causal = a->causal;
    p.skip_tiles = cpar__attn_skip_hidden_tiles;
    p.scale = a->scale;
    p.scale_log2 = a->scale * CPAR__AB_LOG2E;
    p.dropout_p = a->dropout_p;
    p.keep_scale = 1.0f / (1.0f - a->dropout_p); /* on the host: cpar.c's cpar__attn_keep_scale */
    p.rng = a->rng;
    p.qp = a->qp;
    p.kp = a->kp;
    p.mask_hq = a->mask_hq;
    p.mask_h0 = a->mask_h0;
    e = cpar__with_float_type(a->dt, [&](auto zt) {
        typedef decltype(zt) T;
        if constexpr (std::is_same<T, float>::value) {
            return cudaErrorInvalidValue; /* unreachable: a->dt checked above (no fp32 mma instantiation) */
        } else {
            return cpar__attn_dispatch(
                *a, [&](auto var) { return cpar__attn_bwd_launch<T, decltype(var)>(p, a->atomic_dq, cs); });
        }
    });
    CPAR__TRY_CUDA(e, "attention_bwd kernel launch (%s, b %lld, hq %lld, hkv %lld, sq %lld, sk %lld, d %lld%s)",
                   cpar__dtype_name(a->dt), (long long)b, (long long)hq, (long long)hkv, (long long)sq, (long long)sk,
                   (long long)d, a->causal ? ", causal" : "");
    return CPAR_OK;
}

#endif /* section 16 */

#ifndef CPAR_KERNELS_ATTENTION_ONLY /* sections 17-21 */

/* ==== 17. Ring attention: the fp32 LSE merge ===============================
 * One kernel: the _SDPAMerger step of ring attention (cpar.c §19), which
 * folds one block's fp32 output and log-sum-exp into the running ones. The
 * block attention itself is section 16's. Host twin: cpar__host_ring_merge
 * in cpar.c §19. Uses: 2, 4. */

/* The block's weight w = sigmoid(lb - l) and the merged lse
 * l - logsigmoid(l - lb) of one row, in the overflow-free forms
 * sigmoid(x) = 1/(1+e^-x) or e^x/(1+e^x), logsigmoid(y) = min(y,0) - log1p(e^-|y|).
 * An empty side (lse = -inf) takes the other side as it is. Twin of
 * cpar__ring_merge_coef in cpar.c §19. */
static __device__ __forceinline__ void cpar__ring_merge_coef(float l, float lb, float *w, float *nl) {
    if (lb == -INFINITY) {
        *w = 0.f, *nl = l;
        return;
    }
    if (l == -INFINITY) {
        *w = 1.f, *nl = lb;
        return;
    }
    const float x = lb - l, e = expf(-fabsf(x));
    *w = x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    *nl = l - (fminf(-x, 0.f) - log1pf(e));
}

/* out, out_b: nbh slices of rows rows of d floats ((b,h) stride o_bh); lse,
 * lse_b: the matching [nbh, rows] (stride lse_bh); out and lse updated.
 * Launch: 1-D grid-stride of 256-thread blocks, one warp per row: lane 0
 * reads and rewrites the row's lse and broadcasts the weight, the 32 lanes
 * stride over d (coalesced). Moves 3d + 3 floats per row (fewer for rows the
 * block does not reach). */
static __global__ void cpar__ring_merge_kernel(float *out, float *lse, const float *__restrict__ out_b,
                                               const float *__restrict__ lse_b, int64_t nbh, int64_t rows, int64_t d,
                                               int64_t o_bh, int64_t lse_bh) {
    const int lane = (int)(threadIdx.x & 31);
    const int64_t n = nbh * rows, step = cpar__thread_count() / 32;
    for (int64_t wi = cpar__thread_id() / 32; wi < n; wi += step) {
        const int64_t j = wi / rows, i = wi - j * rows;
        float w = 0.f;
        if (lane == 0) {
            float *l = lse + j * lse_bh + i, nl;
            cpar__ring_merge_coef(*l, lse_b[j * lse_bh + i], &w, &nl);
            *l = nl;
        }
        w = __shfl_sync(0xffffffffu, w, 0);
        if (w == 0.f) continue; /* the same for the whole warp */
        float *o = out + j * o_bh + i * d;
        const float *ob = out_b + j * o_bh + i * d;
        for (int64_t c = lane; c < d; c += 32) o[c] -= w * (o[c] - ob[c]);
    }
}

cpar_status cpar_dev_ring_merge(float *out, float *lse, const float *out_b, const float *lse_b, int64_t nbh,
                                int64_t rows, int64_t d, int64_t o_bh, int64_t lse_bh, cpar_dev_stream s) {
    CPAR__CHECK_COUNT(nbh);
    CPAR__CHECK_COUNT(rows);
    CPAR__CHECK_COUNT(d);
    const bool any = nbh > 0 && rows > 0;
    CPAR__CHECK_PTR(lse, any);
    CPAR__CHECK_PTR(lse_b, any);
    CPAR__CHECK_PTR(out, any && d > 0);
    CPAR__CHECK_PTR(out_b, any && d > 0);
    if (nbh > 1 && (o_bh < rows * d || lse_bh < rows))
        return CPAR__INVALID("strides o_bh = %lld, lse_bh = %lld overlap slices of %lld rows of %lld", (long long)o_bh,
                             (long long)lse_bh, (long long)rows, (long long)d);
    if (!any) return CPAR_OK;
    const int64_t n = nbh * rows;
    CPAR_LAUNCH(cpar__ring_merge_kernel, cpar__grid(n, CPAR__BLOCK / 32), CPAR__BLOCK, 0, cpar__stream(s))(
        out, lse, out_b, lse_b, nbh, rows, d, o_bh, lse_bh);
    CPAR__TRY_CUDA(cudaGetLastError(), "ring_merge kernel launch (%lld rows of %lld)", (long long)n, (long long)d);
    return CPAR_OK;
}

/* ==== 18. Mamba context parallelism =======================================
 *
 * The depthwise causal conv1d of cpar.h §13 on this CP rank's channels,
 * reading the cp = 1 weight and bias through the row mapping
 * (cpar_dev_conv_rows), forward and backward, and the B/C replica-gradient
 * sum of pre_conv_ssm's backward. Activations are sequence first: token
 * (t, bi) is row t*b + bi of x [s*b, x_pitch] (channel c at column c), of y
 * and dy [s*b, C]. All math in fp32; K = d_conv in 2..4. Also the packed
 * (THD) row reorder that packed sharding and packed pre/post conv_ssm share.
 * Uses: 2, 3, 4, 9 (word types). */

static constexpr int CPAR__MCP_KMAX = 4;

/* cp = 1 row of local channel c. */
static __device__ __forceinline__ int64_t cpar__mcp_row(const cpar_dev_conv_rows &r, int64_t c) {
    if (c < r.seg_len[0]) return r.seg_row[0] + c;
    c -= r.seg_len[0];
    if (c < r.seg_len[1]) return r.seg_row[1] + c;
    return r.seg_row[2] + c - r.seg_len[1];
}

/* Pre-activation u[t, bi, c] in the host reference's order (bias, then fmaf
 * over the taps from the oldest input). */
template <typename T, typename P>
static __device__ __forceinline__ float cpar__mcp_u(const T *x, int64_t pitch, const P *w, const P *bias, int64_t row,
                                                   int64_t t, int64_t bi, int64_t b, int64_t c, int k) {
    float acc = bias ? cpar__widen(bias[row]) : 0.f;
    for (int j = 0; j < k; j++) {
        const int64_t tt = t - (k - 1) + j;
        if (tt >= 0) acc = fmaf(cpar__widen(w[row * k + j]), cpar__widen(x[(tt * b + bi) * pitch + c]), acc);
    }
    return acc;
}

static __device__ __forceinline__ float cpar__mcp_sigmoid(float u) { return 1.f / (1.f + expf(-u)); }

/* du = dy * silu'(u), silu'(u) = sigmoid(u) (1 + u (1 - sigmoid(u))); dy when !silu. */
template <typename T, typename P>
static __device__ __forceinline__ float cpar__mcp_du(const T *x, int64_t pitch, const P *w, const P *bias, int64_t row,
                                                    int64_t t, int64_t bi, int64_t b, int64_t c, int k, bool silu,
                                                    const T *dy, int64_t ch) {
    const float g = cpar__widen(dy[(t * b + bi) * ch + c]);
    if (!silu) return g;
    const float u = cpar__mcp_u(x, pitch, w, bias, row, t, bi, b, c, k), sg = cpar__mcp_sigmoid(u);
    return g * (sg * (1.f + u * (1.f - sg)));
}

/* y[tok, c] = silu?(u). Launch: cpar__shape_2d over C x tokens (channels
 * contiguous: coalesced), grid-stride. Reads K x elements per output (cached
 * across neighbouring tokens), moves about 2 tokens C sizeof(T) bytes. */
template <typename T, typename P>
static __global__ void cpar__mcp_conv_fwd_kernel(const T *__restrict__ x, int64_t pitch, const P *__restrict__ w,
                                                 const P *__restrict__ bias, cpar_dev_conv_rows rows, int64_t s,
                                                 int64_t b, int64_t ch, int k, bool silu, T *__restrict__ y) {
    const int64_t c0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = s * b;
    for (int64_t tok = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; tok < n; tok += (int64_t)gridDim.y * blockDim.y)
        for (int64_t c = c0; c < ch; c += (int64_t)gridDim.x * blockDim.x) {
            const int64_t t = tok / b, bi = tok % b;
            const float u = cpar__mcp_u(x, pitch, w, bias, cpar__mcp_row(rows, c), t, bi, b, c, k);
            y[tok * ch + c] = cpar__narrow<T>(silu ? u * cpar__mcp_sigmoid(u) : u);
        }
}

/* dx[tok, c] = sum_j w[row, j] du[t + K-1-j]: du recomputed per tap (K <= 4,
 * so at most 16 x reads per element, all cached). Launch as the forward. */
template <typename T, typename P>
static __global__ void cpar__mcp_conv_dx_kernel(const T *__restrict__ x, int64_t pitch, const P *__restrict__ w,
                                                const P *__restrict__ bias, cpar_dev_conv_rows rows, int64_t s,
                                                int64_t b, int64_t ch, int k, bool silu, const T *__restrict__ dy,
                                                T *__restrict__ dx) {
    const int64_t c0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = s * b;
    for (int64_t tok = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; tok < n; tok += (int64_t)gridDim.y * blockDim.y)
        for (int64_t c = c0; c < ch; c += (int64_t)gridDim.x * blockDim.x) {
            const int64_t t = tok / b, bi = tok % b, row = cpar__mcp_row(rows, c);
            float acc = 0.f;
            for (int j = 0; j < k; j++) {
                const int64_t tt = t + (k - 1) - j;
                if (tt < s)
                    acc = fmaf(cpar__widen(w[row * k + j]),
                               cpar__mcp_du(x, pitch, w, bias, row, tt, bi, b, c, k, silu, dy, ch), acc);
            }
            dx[tok * pitch + c] = cpar__narrow<T>(acc);
        }
}

/* Weight/bias gradient partial sums, deterministic: block (32, 8) covers 32
 * consecutive channels (coalesced) of split blockIdx.y's token range; thread
 * row ty walks tokens ty, ty+8, ...; the 8 rows are then added in row order
 * through shared memory. partial[(p (K+1) + j) C + c]: j < K weight taps,
 * j == K the bias. Reads each token's x and dy once per tap. */
static constexpr int CPAR__MCP_TX = 32, CPAR__MCP_TY = 8;

template <typename T, typename P>
static __global__ void cpar__mcp_conv_dw_kernel(const T *__restrict__ x, int64_t pitch, const P *__restrict__ w,
                                                const P *__restrict__ bias, cpar_dev_conv_rows rows, int64_t s,
                                                int64_t b, int64_t ch, int k, bool silu, const T *__restrict__ dy,
                                                float *__restrict__ partial) {
    __shared__ float red[CPAR__MCP_KMAX + 1][CPAR__MCP_TY][CPAR__MCP_TX];
    const int64_t n = s * b, nsplit = gridDim.y, p = blockIdx.y;
    const int64_t lo = n * p / nsplit, hi = n * (p + 1) / nsplit;
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (int64_t c0 = (int64_t)blockIdx.x * CPAR__MCP_TX; c0 < ch; c0 += (int64_t)gridDim.x * CPAR__MCP_TX) {
        const int64_t c = c0 + tx;
        float acc[CPAR__MCP_KMAX + 1] = {0.f, 0.f, 0.f, 0.f, 0.f};
        if (c < ch) {
            const int64_t row = cpar__mcp_row(rows, c);
            for (int64_t tok = lo + ty; tok < hi; tok += CPAR__MCP_TY) {
                const int64_t t = tok / b, bi = tok % b;
                const float du = cpar__mcp_du(x, pitch, w, bias, row, t, bi, b, c, k, silu, dy, ch);
                acc[CPAR__MCP_KMAX] += du;
                for (int j = 0; j < k; j++) {
                    const int64_t tt = t - (k - 1) + j;
                    if (tt >= 0) acc[j] = fmaf(du, cpar__widen(x[(tt * b + bi) * pitch + c]), acc[j]);
                }
            }
        }
        for (int j = 0; j <= CPAR__MCP_KMAX; j++) red[j][ty][tx] = acc[j];
        __syncthreads();
        if (ty == 0 && c < ch)
            for (int j = 0; j <= k; j++) {
                const int src = j == k ? CPAR__MCP_KMAX : j;
                float sum = 0.f;
                for (int q = 0; q < CPAR__MCP_TY; q++) sum += red[src][q][tx];
                partial[(p * (k + 1) + j) * ch + c] = sum;
            }
        __syncthreads(); /* red is rewritten for the next channel tile */
    }
}

/* dw[row(c), j] += sum over splits in order (j < K); dbias[row(c)] likewise
 * (j == K, when dbias). One thread per (j, c), grid-stride. */
static __global__ void cpar__mcp_conv_dw_finish_kernel(const float *__restrict__ partial, int nsplit, int64_t ch, int k,
                                                       cpar_dev_conv_rows rows, float *__restrict__ dw,
                                                       float *__restrict__ dbias) {
    const int64_t n = (int64_t)(k + 1) * ch;
    for (int64_t i = cpar__thread_id(); i < n; i += cpar__thread_count()) {
        const int64_t j = i / ch, c = i % ch, row = cpar__mcp_row(rows, c);
        if (j == k && !dbias) continue;
        float sum = 0.f;
        for (int p = 0; p < nsplit; p++) sum += partial[((int64_t)p * (k + 1) + j) * ch + c];
        if (j < k) dw[row * k + j] += sum;
        else dbias[row] += sum;
    }
}

static cpar_status cpar__mcp_check_conv(const char *func, const void *x, int64_t pitch, cpar_dtype dt, const void *w,
                                        cpar_dtype pdt, const cpar_dev_conv_rows &rows, int64_t s, int64_t b,
                                        int64_t ch, int k) {
    if (s < 0 || b < 0 || ch < 0)
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: s = %lld, b = %lld, channels = %lld, expected >= 0", func,
                              (long long)s, (long long)b, (long long)ch);
    if (k < 2 || k > CPAR__MCP_KMAX) return cpar__dev_fail(CPAR_ERR_INVALID, "%s: k = %d, expected 2..4", func, k);
    if (pitch < ch) return cpar__dev_fail(CPAR_ERR_INVALID, "%s: x_pitch = %lld, expected >= channels = %lld", func,
                                          (long long)pitch, (long long)ch);
    if (rows.seg_len[0] < 0 || rows.seg_len[1] < 0 || rows.seg_len[2] < 0 ||
        rows.seg_len[0] + rows.seg_len[1] + rows.seg_len[2] != ch)
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: row segments %lld + %lld + %lld, expected to add up to channels = %lld",
                              func, (long long)rows.seg_len[0], (long long)rows.seg_len[1], (long long)rows.seg_len[2],
                              (long long)ch);
    if (!cpar__is_float(dt) || !cpar__is_float(pdt))
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: dtypes %s (activations) and %s (parameters), expected f32, f16 or bf16",
                              func, cpar__dtype_name(dt), cpar__dtype_name(pdt));
    const bool nonempty = s > 0 && b > 0 && ch > 0;
    if (nonempty && (!x || !w)) return cpar__dev_fail(CPAR_ERR_INVALID, "%s: %s is NULL", func, x ? "w" : "x");
    return CPAR_OK;
}

cpar_status cpar_dev_mamba_conv1d_forward(const void *x, int64_t x_pitch, cpar_dtype dt, const void *w,
                                          const void *bias, cpar_dtype pdt, cpar_dev_conv_rows rows, int64_t s,
                                          int64_t b, int64_t channels, int k, bool silu, void *y,
                                          cpar_dev_stream st) {
    cpar_status cs = cpar__mcp_check_conv(__func__, x, x_pitch, dt, w, pdt, rows, s, b, channels, k);
    if (cs != CPAR_OK) return cs;
    if (!(s > 0 && b > 0 && channels > 0)) return CPAR_OK;
    CPAR__CHECK_PTR(y, true);
    const cpar__shape sh = cpar__shape_2d(channels, s * b);
    cudaStream_t cst = cpar__stream(st);
    cudaError_t e = cpar__with_float_type(dt, [&](auto tv) {
        typedef decltype(tv) T;
        return cpar__with_float_type(pdt, [&](auto pv) {
            typedef decltype(pv) P;
            auto kernel = cpar__mcp_conv_fwd_kernel<T, P>;
            CPAR_LAUNCH(kernel, sh.grid, sh.block, 0, cst)
            (static_cast<const T *>(x), x_pitch, static_cast<const P *>(w), static_cast<const P *>(bias), rows, s, b,
             channels, k, silu, static_cast<T *>(y));
            return cudaGetLastError();
        });
    });
    CPAR__TRY_CUDA(e, "mamba conv1d forward kernel launch (%s/%s, %lld tokens x %lld channels)", cpar__dtype_name(dt),
                   cpar__dtype_name(pdt), (long long)(s * b), (long long)channels);
    return CPAR_OK;
}

cpar_status cpar_dev_mamba_conv1d_backward(const void *x, int64_t x_pitch, cpar_dtype dt, const void *w,
                                           const void *bias, cpar_dtype pdt, cpar_dev_conv_rows rows, int64_t s,
                                           int64_t b, int64_t channels, int k, bool silu, const void *dy, void *dx,
                                           float *partial, int nsplit, float *dw, float *dbias, cpar_dev_stream st) {
    cpar_status cs = cpar__mcp_check_conv(__func__, x, x_pitch, dt, w, pdt, rows, s, b, channels, k);
    if (cs != CPAR_OK) return cs;
    if (nsplit < 1) return CPAR__INVALID("nsplit = %d, expected >= 1", nsplit);
    if (!(s > 0 && b > 0 && channels > 0)) return CPAR_OK;
    CPAR__CHECK_PTR(dy, true);
    CPAR__CHECK_PTR(dx, true);
    CPAR__CHECK_PTR(partial, true);
    CPAR__CHECK_PTR(dw, true);
    const cpar__shape sh = cpar__shape_2d(channels, s * b);
    const int64_t tiles = (channels + CPAR__MCP_TX - 1) / CPAR__MCP_TX;
    const dim3 dw_grid((unsigned)(tiles < CPAR__MAX_GRID ? tiles : CPAR__MAX_GRID), (unsigned)nsplit),
        dw_block(CPAR__MCP_TX, CPAR__MCP_TY);
    const unsigned fin_grid = cpar__grid((int64_t)(k + 1) * channels, CPAR__BLOCK);
    cudaStream_t cst = cpar__stream(st);
    cudaError_t e = cpar__with_float_type(dt, [&](auto tv) {
        typedef decltype(tv) T;
        return cpar__with_float_type(pdt, [&](auto pv) {
            typedef decltype(pv) P;
            const T *xt = static_cast<const T *>(x), *dyt = static_cast<const T *>(dy);
            const P *wp = static_cast<const P *>(w), *bp = static_cast<const P *>(bias);
            auto kdx = cpar__mcp_conv_dx_kernel<T, P>;
            CPAR_LAUNCH(kdx, sh.grid, sh.block, 0, cst)(xt, x_pitch, wp, bp, rows, s, b, channels, k, silu, dyt,
                                                         static_cast<T *>(dx));
            cudaError_t le = cudaGetLastError();
            if (le != cudaSuccess) return le;
            auto kdw = cpar__mcp_conv_dw_kernel<T, P>;
            CPAR_LAUNCH(kdw, dw_grid, dw_block, 0, cst)(xt, x_pitch, wp, bp, rows, s, b, channels, k, silu, dyt, partial);
            le = cudaGetLastError();
            if (le != cudaSuccess) return le;
            CPAR_LAUNCH(cpar__mcp_conv_dw_finish_kernel, fin_grid, CPAR__BLOCK, 0, cst)(partial, nsplit, channels, k,
                                                                                        rows, dw, dbias);
            return cudaGetLastError();
        });
    });
    CPAR__TRY_CUDA(e, "mamba conv1d backward kernel launch (%s/%s, %lld tokens x %lld channels, %d splits)",
                   cpar__dtype_name(dt), cpar__dtype_name(pdt), (long long)(s * b), (long long)channels, nsplit);
    return CPAR_OK;
}

/* dst[g, t, c] = sum over q < reps of src[g, q, t, c] (strides in elements).
 * Launch: cpar__shape_2d over cols x (groups*rows), grid-stride. Moves
 * (reps + 1) groups rows cols sizeof(T) bytes. */
template <typename T>
static __global__ void cpar__mcp_sum_replicas_kernel(T *__restrict__ dst, int64_t dst_gs, int64_t dst_pitch,
                                                     const T *__restrict__ src, int64_t src_gs, int64_t rep_stride,
                                                     int64_t src_pitch, int64_t groups, int64_t reps, int64_t rows,
                                                     int64_t cols) {
    const int64_t c0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = groups * rows;
    for (int64_t gt = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; gt < n; gt += (int64_t)gridDim.y * blockDim.y) {
        const int64_t g = gt / rows, t = gt % rows;
        for (int64_t c = c0; c < cols; c += (int64_t)gridDim.x * blockDim.x) {
            float acc = 0.f;
            for (int64_t q = 0; q < reps; q++) acc += cpar__widen(src[g * src_gs + q * rep_stride + t * src_pitch + c]);
            dst[g * dst_gs + t * dst_pitch + c] = cpar__narrow<T>(acc);
        }
    }
}

cpar_status cpar_dev_mamba_sum_replicas(void *dst, int64_t dst_gs, int64_t dst_pitch, const void *src, int64_t src_gs,
                                        int64_t rep_stride, int64_t src_pitch, int64_t groups, int64_t reps,
                                        int64_t rows, int64_t cols, cpar_dtype dt, cpar_dev_stream st) {
    CPAR__CHECK_COUNT(groups);
    CPAR__CHECK_COUNT(reps);
    CPAR__CHECK_COUNT(rows);
    CPAR__CHECK_COUNT(cols);
    const bool nonempty = groups > 0 && rows > 0 && cols > 0;
    CPAR__CHECK_PTR(dst, nonempty);
    CPAR__CHECK_PTR(src, nonempty && reps > 0);
    if (!cpar__is_float(dt)) return CPAR__INVALID("dtype %s, expected f32, f16 or bf16", cpar__dtype_name(dt));
    if (!nonempty) return CPAR_OK;
    const cpar__shape sh = cpar__shape_2d(cols, groups * rows);
    cudaStream_t cst = cpar__stream(st);
    cudaError_t e = cpar__with_float_type(dt, [&](auto tv) {
        typedef decltype(tv) T;
        auto kernel = cpar__mcp_sum_replicas_kernel<T>;
        CPAR_LAUNCH(kernel, sh.grid, sh.block, 0, cst)
        (static_cast<T *>(dst), dst_gs, dst_pitch, static_cast<const T *>(src), src_gs, rep_stride, src_pitch, groups,
         reps, rows, cols);
        return cudaGetLastError();
    });
    CPAR__TRY_CUDA(e, "mamba sum_replicas kernel launch (%s, %lld groups x %lld reps x %lld x %lld)",
                   cpar__dtype_name(dt), (long long)groups, (long long)reps, (long long)rows, (long long)cols);
    return CPAR_OK;
}

/* ---- packed (THD) reorder: the rows of cpar.h §12's packed CP layout ---------
 * Shared by cpar.c §19 (packed shard / unshard) and §20 (packed pre / post
 * conv_ssm). Local row l of rank j's block lies in document i when
 * cu[i] <= l P < cu[i+1] (cu holds multiples of 2P, so local document starts
 * are cu[i] / P); its offset o = l - cu[i]/P picks slot o >= c (c = the
 * document's length / 2P) and the global row cu[i] + chunk c + o % c with
 * chunk j (slot 0) or 2P-1-j (slot 1). The boundaries travel in the kernel's
 * parameters, CPAR__PACKED_DOCS documents per launch (one launch for most
 * batches): no device copy of them, nothing for the caller to keep alive. */

static constexpr int CPAR__PACKED_DOCS = 256;

struct cpar__packed_docs {
    int32_t cu[CPAR__PACKED_DOCS + 1]; /* this launch's boundaries, n + 1 of them */
    int n;
};

/* One thread row per (outer slice o, block k, local row l of this launch's
 * documents, from l0): the document by binary search (empty documents share
 * a start: the largest i with cu[i] <= l P is the non-empty one), then the
 * row's words copied. Pitches, strides and words in W units. Launch:
 * cpar__shape_2d over words x (outer nranks rows), grid-stride in both.
 * Moves 2 outer nranks rows words sizeof(W) bytes. */
template <typename W>
static __global__ void cpar__packed_reorder_kernel(W *nat, int64_t nat_pitch, W *blk, int64_t blk_pitch,
                                                   int64_t blk_stride, int r0, int nranks, int p,
                                                   const cpar__packed_docs docs, int64_t l0, int64_t rows,
                                                   int64_t outer, int64_t words, bool to_blocks) {
    const int64_t c0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = outer * nranks * rows;
    for (int64_t y = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; y < n; y += (int64_t)gridDim.y * blockDim.y) {
        const int64_t l = l0 + y % rows, k = y / rows % nranks, o = y / rows / nranks, key = l * p;
        int lo = 0, hi = docs.n - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (docs.cu[mid] <= key) lo = mid;
            else hi = mid - 1;
        }
        const int64_t start = docs.cu[lo], c = ((int64_t)docs.cu[lo + 1] - start) / (2 * p), off = l - start / p;
        const int64_t slot = off >= c ? 1 : 0, j = r0 + k, chunk = slot ? 2 * (int64_t)p - 1 - j : j;
        W *a = nat + o * nat_pitch + (start + chunk * c + off - slot * c) * words;
        W *b = blk + k * blk_stride + o * blk_pitch + l * words;
        for (int64_t w = c0; w < words; w += (int64_t)gridDim.x * blockDim.x) {
            if (to_blocks) b[w] = a[w];
            else a[w] = b[w];
        }
    }
}

template <int W>
static cudaError_t cpar__launch_packed_reorder(void *nat, size_t nat_pitch, void *blk, size_t blk_pitch,
                                               size_t blk_stride, int r0, int nranks, int p,
                                               const cpar__packed_docs &docs, int64_t l0, int64_t rows, int64_t outer,
                                               size_t row_bytes, bool to_blocks, cudaStream_t s) {
    typedef typename cpar__word_of<W>::type word;
    const int64_t words = (int64_t)(row_bytes / W);
    const cpar__shape sh = cpar__shape_2d(words, outer * nranks * rows);
    auto kernel = cpar__packed_reorder_kernel<word>;
    CPAR_LAUNCH(kernel, sh.grid, sh.block, 0, s)
    (static_cast<word *>(nat), (int64_t)(nat_pitch / W), static_cast<word *>(blk), (int64_t)(blk_pitch / W),
     (int64_t)(blk_stride / W), r0, nranks, p, docs, l0, rows, outer, words, to_blocks);
    return cudaGetLastError();
}

cpar_status cpar_dev_packed_reorder(void *nat, size_t nat_pitch, void *blk, size_t blk_pitch, size_t blk_stride,
                                    int r0, int nranks, int p, const int32_t *cu, int n_docs, int64_t outer,
                                    size_t row_bytes, bool to_blocks, cpar_dev_stream st) {
    CPAR__CHECK_COUNT(outer);
    if (p < 1) return CPAR__INVALID("p = %d, expected >= 1", p);
    if (nranks < 1 || r0 < 0 || r0 + nranks > p)
        return CPAR__INVALID("ranks [%d, %d), expected within [0, %d)", r0, r0 + nranks, p);
    if (n_docs < 1 || !cu) return CPAR__INVALID("n_docs = %d (cu %s), expected >= 1 boundaries", n_docs, cu ? "set" : "NULL");
    const int64_t total = cu[n_docs], L = total / p;
    if (total % (2 * (int64_t)p))
        return CPAR__INVALID("cu[n_docs] = %lld, expected a multiple of 2p = %d", (long long)total, 2 * p);
    const bool nonempty = outer > 0 && L > 0 && row_bytes > 0;
    CPAR__CHECK_PTR(nat, nonempty);
    CPAR__CHECK_PTR(blk, nonempty);
    if (!nonempty) return CPAR_OK;
    if (outer > 1 && nat_pitch < (size_t)total * row_bytes)
        return CPAR__INVALID("nat_pitch = %zu, expected >= total * row_bytes = %zu", nat_pitch, (size_t)total * row_bytes);
    if (outer > 1 && blk_pitch < (size_t)L * row_bytes)
        return CPAR__INVALID("blk_pitch = %zu, expected >= L * row_bytes = %zu", blk_pitch, (size_t)L * row_bytes);
    cudaStream_t cs = cpar__stream(st);
    const size_t common = (uintptr_t)nat | (uintptr_t)blk | nat_pitch | blk_pitch | blk_stride | row_bytes | 16;
    const size_t word = common & (~common + 1); /* lowest set bit: the widest common word */
    for (int d0 = 0; d0 < n_docs; d0 += CPAR__PACKED_DOCS) {
        cpar__packed_docs docs;
        docs.n = n_docs - d0 < CPAR__PACKED_DOCS ? n_docs - d0 : CPAR__PACKED_DOCS;
        for (int i = 0; i <= docs.n; i++) docs.cu[i] = cu[d0 + i];
        const int64_t l0 = docs.cu[0] / p, rows = docs.cu[docs.n] / p - l0;
        if (!rows) continue;
        cudaError_t e;
        switch (word) {
#define CPAR__PR(W)                                                                                                    \
    e = cpar__launch_packed_reorder<W>(nat, nat_pitch, blk, blk_pitch, blk_stride, r0, nranks, p, docs, l0, rows,      \
                                       outer, row_bytes, to_blocks, cs)
        case 1: CPAR__PR(1); break;
        case 2: CPAR__PR(2); break;
        case 4: CPAR__PR(4); break;
        case 8: CPAR__PR(8); break;
        default: CPAR__PR(16); break;
#undef CPAR__PR
        }
        CPAR__TRY_CUDA(e, "packed reorder kernel launch (%lld rows of %zu bytes, documents %d..%d, ranks %d..%d of %d)",
                       (long long)(outer * nranks * rows), row_bytes, d0, d0 + docs.n - 1, r0, r0 + nranks - 1, p);
    }
    return CPAR_OK;
}

/* ==== 19. RMSNorm: forward with an optional fused residual add, backward =====
 * The device half of cpar.h §14 (host half and reference loops: cpar.c §21):
 * TransformerEngine's rmsnorm_fwd as Megatron's inference layers call it
 * (zero_centered_gamma off), the "add + RMSNorm" step of the fused
 * reduce-scatter + add + RMSNorm + all-gather, and the backward for training.
 *   x [rows, h], add [rows, h] or NULL, weight [h], y [rows, h]: one dtype T.
 *   add != NULL: x += add first (rounded to T and stored back: x is the
 *   residual stream), and the norm reads the rounded sum, as PyTorch does.
 *   y[r, j] = x[r, j] * rsqrt(mean_j x[r, j]^2 + eps) * weight[j], fp32 math.
 * One 256-thread block per row (grid-stride over rows): each thread keeps to
 * its own columns j = tid, tid + 256, ..., so the second pass reads back
 * exactly what the same thread wrote (y may alias x when add is NULL); the
 * sum of squares is a warp butterfly, then every thread adds the warp sums
 * in the same order (deterministic). The warp sums alternate between two
 * shared slots by row parity, so one barrier per row suffices: a warp can
 * write slot p again only after the next row's barrier, which every thread
 * reaches after reading slot p. Moves rows * h * (2 or 4) + h elements.
 * Uses: 2, 4. */

static constexpr int CPAR__NORM_BLOCK = 256;

/* V columns per thread step (16-byte packs: h % V == 0 and every pointer
 * 16-byte aligned, so every row's packs are aligned too). */
template <typename T, int V>
static __global__ void cpar__rmsnorm_kernel(T *x, const T *__restrict__ add, const T *__restrict__ w, float eps,
                                           int64_t rows, int64_t h, T *y) {
    __shared__ float warp_sum[2][CPAR__NORM_BLOCK / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    int slot = 0;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x, slot ^= 1) {
        T *xr = x + r * h;
        float ss = 0.f;
        for (int64_t j = (int64_t)threadIdx.x * V; j < h; j += (int64_t)blockDim.x * V) {
            cpar__pack<T, V> xv = cpar__load<V>(xr + j);
            if (add) {
                const cpar__pack<T, V> av = cpar__load<V>(add + r * h + j);
                CPAR__UNROLL
                for (int e = 0; e < V; e++) xv.v[e] = cpar__narrow<T>(cpar__widen(xv.v[e]) + cpar__widen(av.v[e]));
                cpar__store<V>(xr + j, xv);
            }
            CPAR__UNROLL
            for (int e = 0; e < V; e++) ss += cpar__widen(xv.v[e]) * cpar__widen(xv.v[e]);
        }
        for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        if (lane == 0) warp_sum[slot][warp] = ss;
        __syncthreads();
        float total = 0.f;
        for (int i = 0; i < nwarps; i++) total += warp_sum[slot][i];
        const float inv = rsqrtf(total / (float)h + eps);
        for (int64_t j = (int64_t)threadIdx.x * V; j < h; j += (int64_t)blockDim.x * V) {
            const cpar__pack<T, V> xv = cpar__load<V>(xr + j), wv = cpar__load<V>(w + j);
            cpar__pack<T, V> yv;
            CPAR__UNROLL
            for (int e = 0; e < V; e++) yv.v[e] = cpar__narrow<T>(cpar__widen(xv.v[e]) * inv * cpar__widen(wv.v[e]));
            cpar__store<V>(y + r * h + j, yv);
        }
    }
}

/* 16-byte packs of T fit rows of h: h % V == 0 and every pointer aligned. */
template <typename T> static bool cpar__rows_vec(int64_t h, const void *a, const void *b, const void *c = NULL,
                                                 const void *d = NULL) {
    return h % cpar__vec16<T> == 0 && cpar__aligned(16, a, b) && cpar__aligned(16, c, d);
}

/* The size, dtype and eps checks of cpar_dev_rmsnorm and _backward (func:
 * the caller, named in the message); each checks its own pointers. */
static cpar_status cpar__rmsnorm_check(const char *func, int64_t rows, int64_t h, cpar_dtype dt, float eps) {
    if (rows < 0) return cpar__dev_fail(CPAR_ERR_INVALID, "%s: rows = %lld, expected >= 0", func, (long long)rows);
    if (h < 0) return cpar__dev_fail(CPAR_ERR_INVALID, "%s: h = %lld, expected >= 0", func, (long long)h);
    if (!cpar__is_float(dt))
        return cpar__dev_fail(CPAR_ERR_INVALID, "%s: dtype %s, expected f32, f16 or bf16", func, cpar__dtype_name(dt));
    if (!(eps >= 0.f)) return cpar__dev_fail(CPAR_ERR_INVALID, "%s: eps = %g, expected >= 0", func, (double)eps);
    return CPAR_OK;
}

cpar_status cpar_dev_rmsnorm(void *x, const void *add, const void *weight, cpar_dtype dt, int64_t rows, int64_t h,
                             float eps, void *y, cpar_dev_stream s) {
    const cpar_status st = cpar__rmsnorm_check(__func__, rows, h, dt, eps);
    if (st != CPAR_OK) return st;
    const bool nonempty = rows > 0 && h > 0;
    CPAR__CHECK_PTR(x, nonempty);
    CPAR__CHECK_PTR(weight, nonempty);
    CPAR__CHECK_PTR(y, nonempty);
    if (!nonempty) return CPAR_OK;
    cudaStream_t cs = cpar__stream(s);
    cudaError_t e = cpar__with_float_type(dt, [&](auto tv) {
        typedef decltype(tv) T;
        auto kernel = cpar__rows_vec<T>(h, x, add, weight, y) ? cpar__rmsnorm_kernel<T, cpar__vec16<T>>
                                                             : cpar__rmsnorm_kernel<T, 1>;
        CPAR_LAUNCH(kernel, cpar__grid(rows, 1), CPAR__NORM_BLOCK, 0, cs)
        (static_cast<T *>(x), static_cast<const T *>(add), static_cast<const T *>(weight), eps, rows, h,
         static_cast<T *>(y));
        return cudaGetLastError();
    });
    CPAR__TRY_CUDA(e, "rmsnorm kernel launch (%s, %lld x %lld%s)", cpar__dtype_name(dt), (long long)rows,
                   (long long)h, add ? ", residual add" : "");
    return CPAR_OK;
}

/* RMSNorm backward, per row: inv = rsqrt(mean(x^2) + eps), k = inv^3
 * sum_j(dy_j w_j x_j) / h, dx = inv w dy - x k; dweight[j] += sum_r dy[r, j]
 * x[r, j] inv[r] (skipped without dweight), in a fixed order (deterministic):
 * partial sums over chunks of rows (cpar__rmsnorm_chunk_rows), then the
 * chunks' sums in chunk order. dx may overwrite dy.
 * Rows of at most 8 packs per thread (h <= 16384 in bf16, 8192 in fp32; 2048
 * unaligned) take one fused pass (cpar__rmsnorm_bwd_kernel): a block walks a
 * chunk of rows, holds each row's x and dy in registers between its sums and
 * its dx, and its columns' dweight terms in registers across the chunk, so x
 * and dy are read once and dx written once (and chunks x h partials written,
 * 8 / (6 x chunk rows) of that traffic in bf16: 8 % at 16 rows). Wider rows
 * take three passes:
 *   1. per row (one block, as the forward): inv, k -> stats[2r], stats[2r+1];
 *   2. the dweight partials (a 2-D grid: chunk x column, every element read
 *      once, coalesced along the columns), then their sums;
 *   3. dx, element-wise.
 * A row's two sums share one butterfly and the forward's two parity slots
 * (one barrier per row); every thread adds the warp sums in the same order,
 * so both paths give the same bits. */
template <typename T, int V>
static __global__ void cpar__rmsnorm_stats_kernel(const T *__restrict__ x, const T *__restrict__ w,
                                                 const T *__restrict__ dy, float eps, int64_t rows, int64_t h,
                                                 float *__restrict__ stats) {
    __shared__ float warp_sum[2][2][CPAR__NORM_BLOCK / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    int slot = 0;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x, slot ^= 1) {
        float ss = 0.f, c = 0.f;
        for (int64_t j = (int64_t)threadIdx.x * V; j < h; j += (int64_t)blockDim.x * V) {
            const cpar__pack<T, V> xv = cpar__load<V>(x + r * h + j), gv = cpar__load<V>(dy + r * h + j);
            const cpar__pack<T, V> wv = cpar__load<V>(w + j);
            CPAR__UNROLL
            for (int e = 0; e < V; e++) {
                const float v = cpar__widen(xv.v[e]);
                ss += v * v;
                c += cpar__widen(gv.v[e]) * cpar__widen(wv.v[e]) * v;
            }
        }
        for (int off = 16; off > 0; off /= 2) {
            ss += __shfl_xor_sync(0xffffffffu, ss, off);
            c += __shfl_xor_sync(0xffffffffu, c, off);
        }
        if (lane == 0) warp_sum[slot][0][warp] = ss, warp_sum[slot][1][warp] = c;
        __syncthreads();
        if (threadIdx.x == 0) {
            float tss = 0.f, tc = 0.f;
            for (int i = 0; i < nwarps; i++) tss += warp_sum[slot][0][i], tc += warp_sum[slot][1][i];
            const float inv = rsqrtf(tss / (float)h + eps);
            stats[2 * r] = inv;
            stats[2 * r + 1] = inv * inv * inv * tc / (float)h;
        }
    }
}

/* dweight's chunks: at most 1024 of at least 16 rows each (the fused pass
 * runs one block per chunk: 1024 blocks fill an H100 four times over). */
static constexpr int64_t CPAR__NORM_CHUNKS = 1024;
static int64_t cpar__rmsnorm_chunk_rows(int64_t rows) {
    const int64_t per = (rows + CPAR__NORM_CHUNKS - 1) / CPAR__NORM_CHUNKS;
    return per > 16 ? per : 16;
}

/* The fused pass: block b takes rows [b chunk_rows, (b + 1) chunk_rows) in
 * order; thread t owns the packs of V columns at (t + 256 p) V, p < NP. With
 * DW it writes partial[b, j] as pass 2a does. */
template <typename T, int V, int NP, bool DW>
static __global__ void __launch_bounds__(CPAR__NORM_BLOCK)
    cpar__rmsnorm_bwd_kernel(const T *__restrict__ x, const T *__restrict__ w, const T *dy, float eps, int64_t rows,
                             int64_t h, int64_t chunk_rows, T *dx, float *__restrict__ partial) {
    __shared__ float warp_sum[2][2][CPAR__NORM_BLOCK / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    float acc[NP][V];
    CPAR__UNROLL
    for (int p = 0; p < NP; p++)
        CPAR__UNROLL
        for (int e = 0; e < V; e++) acc[p][e] = 0.f;
    const int64_t r0 = (int64_t)blockIdx.x * chunk_rows, r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
    int slot = 0;
    for (int64_t r = r0; r < r1; r++, slot ^= 1) {
        cpar__pack<T, V> xv[NP] = {}, gv[NP] = {}; /* only packs j < h are used */
        float ss = 0.f, c = 0.f;
        CPAR__UNROLL
        for (int p = 0; p < NP; p++) {
            const int64_t j = ((int64_t)threadIdx.x + (int64_t)p * blockDim.x) * V;
            if (j >= h) break;
            xv[p] = cpar__load<V>(x + r * h + j), gv[p] = cpar__load<V>(dy + r * h + j);
            const cpar__pack<T, V> wv = cpar__load<V>(w + j);
            CPAR__UNROLL
            for (int e = 0; e < V; e++) {
                const float v = cpar__widen(xv[p].v[e]);
                ss += v * v;
                c += cpar__widen(gv[p].v[e]) * cpar__widen(wv.v[e]) * v;
            }
        }
        for (int off = 16; off > 0; off /= 2) {
            ss += __shfl_xor_sync(0xffffffffu, ss, off);
            c += __shfl_xor_sync(0xffffffffu, c, off);
        }
        if (lane == 0) warp_sum[slot][0][warp] = ss, warp_sum[slot][1][warp] = c;
        __syncthreads();
        float tss = 0.f, tc = 0.f;
        for (int i = 0; i < nwarps; i++) tss += warp_sum[slot][0][i], tc += warp_sum[slot][1][i];
        const float inv = rsqrtf(tss / (float)h + eps), k = inv * inv * inv * tc / (float)h;
        CPAR__UNROLL
        for (int p = 0; p < NP; p++) {
            const int64_t j = ((int64_t)threadIdx.x + (int64_t)p * blockDim.x) * V;
            if (j >= h) break;
            const cpar__pack<T, V> wv = cpar__load<V>(w + j);
            cpar__pack<T, V> o;
            CPAR__UNROLL
            for (int e = 0; e < V; e++) {
                const float g = cpar__widen(gv[p].v[e]), v = cpar__widen(xv[p].v[e]);
                o.v[e] = cpar__narrow<T>(inv * cpar__widen(wv.v[e]) * g - v * k);
                if (DW) acc[p][e] += g * v * inv;
            }
            cpar__store<V>(dx + r * h + j, o);
        }
    }
    if constexpr (DW) {
        CPAR__UNROLL
        for (int p = 0; p < NP; p++) {
            const int64_t j = ((int64_t)threadIdx.x + (int64_t)p * blockDim.x) * V;
            if (j >= h) break;
            CPAR__UNROLL
            for (int e = 0; e < V; e++) partial[(int64_t)blockIdx.x * h + j + e] = acc[p][e];
        }
    }
}

/* The fused pass's packs per thread for rows of h in packs of v: 1, 2, 4 or
 * 8; 0 when a row needs more (three passes). */
static int cpar__rmsnorm_bwd_packs(int64_t h, int v) {
    const int64_t need = (h + (int64_t)CPAR__NORM_BLOCK * v - 1) / ((int64_t)CPAR__NORM_BLOCK * v);
    for (int np = 1; np <= 8; np *= 2)
        if (need <= np) return np;
    return 0;
}

template <typename T, int V, bool DW>
static cudaError_t cpar__rmsnorm_bwd_launch(int np, int64_t chunk_rows, cudaStream_t cs, const T *x, const T *w,
                                            const T *dy, float eps, int64_t rows, int64_t h, T *dx, float *partial) {
    auto kernel = np == 1   ? cpar__rmsnorm_bwd_kernel<T, V, 1, DW>
                  : np == 2 ? cpar__rmsnorm_bwd_kernel<T, V, 2, DW>
                  : np == 4 ? cpar__rmsnorm_bwd_kernel<T, V, 4, DW>
                            : cpar__rmsnorm_bwd_kernel<T, V, 8, DW>;
    CPAR_LAUNCH(kernel, (unsigned)((rows + chunk_rows - 1) / chunk_rows), CPAR__NORM_BLOCK, 0, cs)
    (x, w, dy, eps, rows, h, chunk_rows, dx, partial);
    return cudaGetLastError();
}

/* Pass 2a: partial[c, j] = sum of column j over chunk c's rows, in order.
 * Launch: grid (columns / 256, chunks), 256 threads; x grid-strides the
 * columns. */
template <typename T>
static __global__ void cpar__rmsnorm_dw_partial_kernel(const T *__restrict__ x, const T *__restrict__ dy,
                                                      const float *__restrict__ stats, int64_t rows, int64_t h,
                                                      int64_t chunk_rows, float *__restrict__ partial) {
    const int64_t r0 = (int64_t)blockIdx.y * chunk_rows, r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < h; j += (int64_t)gridDim.x * blockDim.x) {
        float acc = 0.f;
        for (int64_t r = r0; r < r1; r++) acc += cpar__widen(dy[r * h + j]) * cpar__widen(x[r * h + j]) * stats[2 * r];
        partial[(int64_t)blockIdx.y * h + j] = acc;
    }
}

/* Pass 2b: dw[j] += the chunks' partial sums of column j, in chunk order.
 * Launch: 1-D grid-stride over h. */
static __global__ void cpar__rmsnorm_dw_finish_kernel(const float *__restrict__ partial, int64_t chunks, int64_t h,
                                                     float *__restrict__ dw) {
    for (int64_t j = cpar__thread_id(); j < h; j += cpar__thread_count()) {
        float acc = 0.f;
        for (int64_t c = 0; c < chunks; c++) acc += partial[c * h + j];
        dw[j] += acc;
    }
}

size_t cpar_dev_rmsnorm_backward_scratch_bytes(int64_t rows, int64_t h) {
    if (rows <= 0 || h <= 0) return sizeof(float);
    const int64_t chunks = (rows + cpar__rmsnorm_chunk_rows(rows) - 1) / cpar__rmsnorm_chunk_rows(rows);
    return (size_t)(2 * rows + chunks * h) * sizeof(float);
}

/* Pass 3: 1-D grid-stride over rows * h in packs of V (h % V == 0: a pack
 * stays in one row); dx may alias dy (same elements, same thread). */
template <typename T, int V>
static __global__ void cpar__rmsnorm_dx_kernel(const T *__restrict__ x, const T *__restrict__ w, const T *dy,
                                              const float *__restrict__ stats, int64_t rows, int64_t h, T *dx) {
    for (int64_t i = cpar__thread_id() * V; i < rows * h; i += cpar__thread_count() * V) {
        const int64_t r = i / h, j = i - r * h;
        const cpar__pack<T, V> xv = cpar__load<V>(x + i), wv = cpar__load<V>(w + j), gv = cpar__load<V>(dy + i);
        const float inv = stats[2 * r], k = stats[2 * r + 1];
        cpar__pack<T, V> o;
        CPAR__UNROLL
        for (int e = 0; e < V; e++)
            o.v[e] = cpar__narrow<T>(inv * cpar__widen(wv.v[e]) * cpar__widen(gv.v[e]) - cpar__widen(xv.v[e]) * k);
        cpar__store<V>(dx + i, o);
    }
}

cpar_status cpar_dev_rmsnorm_backward(const void *x, const void *weight, const void *dy, cpar_dtype dt, int64_t rows,
                                      int64_t h, float eps, void *dx, float *dweight, float *scratch,
                                      cpar_dev_stream s) {
    const cpar_status st = cpar__rmsnorm_check(__func__, rows, h, dt, eps);
    if (st != CPAR_OK) return st;
    const bool nonempty = rows > 0 && h > 0;
    CPAR__CHECK_PTR(x, nonempty);
    CPAR__CHECK_PTR(weight, nonempty);
    CPAR__CHECK_PTR(dy, nonempty);
    CPAR__CHECK_PTR(dx, nonempty);
    CPAR__CHECK_PTR(scratch, nonempty);
    if (!nonempty) return CPAR_OK;
    float *stats_scratch = scratch, *partial = scratch + 2 * rows; /* cpar_dev_rmsnorm_backward_scratch_bytes */
    const int64_t chunk_rows = cpar__rmsnorm_chunk_rows(rows), chunks = (rows + chunk_rows - 1) / chunk_rows;
    cudaStream_t cs = cpar__stream(s);
    cudaError_t e = cpar__with_float_type(dt, [&](auto tv) {
        typedef decltype(tv) T;
        const T *xt = static_cast<const T *>(x), *wt = static_cast<const T *>(weight), *dyt = static_cast<const T *>(dy);
        const bool vec = cpar__rows_vec<T>(h, x, weight, dy, dx);
        constexpr int V = cpar__vec16<T>;
        T *dxt = static_cast<T *>(dx);
        cudaError_t le;
        if (const int np = cpar__rmsnorm_bwd_packs(h, vec ? V : 1)) {
            if (dweight) { /* one block per dweight chunk, then the chunks' sums */
                le = vec ? cpar__rmsnorm_bwd_launch<T, V, true>(np, chunk_rows, cs, xt, wt, dyt, eps, rows, h, dxt, partial)
                         : cpar__rmsnorm_bwd_launch<T, 1, true>(np, chunk_rows, cs, xt, wt, dyt, eps, rows, h, dxt, partial);
                if (le != cudaSuccess) return le;
                CPAR_LAUNCH(cpar__rmsnorm_dw_finish_kernel, cpar__grid(h, CPAR__BLOCK), CPAR__BLOCK, 0, cs)
                (partial, chunks, h, dweight);
                return cudaGetLastError();
            }
            const int64_t per = (rows + CPAR__MAX_GRID - 1) / CPAR__MAX_GRID; /* any split: no partials */
            return vec ? cpar__rmsnorm_bwd_launch<T, V, false>(np, per, cs, xt, wt, dyt, eps, rows, h, dxt, NULL)
                       : cpar__rmsnorm_bwd_launch<T, 1, false>(np, per, cs, xt, wt, dyt, eps, rows, h, dxt, NULL);
        }
        auto stats_kernel = vec ? cpar__rmsnorm_stats_kernel<T, V> : cpar__rmsnorm_stats_kernel<T, 1>;
        CPAR_LAUNCH(stats_kernel, cpar__grid(rows, 1), CPAR__NORM_BLOCK, 0, cs)(xt, wt, dyt, eps, rows, h, stats_scratch);
        le = cudaGetLastError();
        if (le != cudaSuccess) return le;
        if (dweight) {
            auto dw_kernel = cpar__rmsnorm_dw_partial_kernel<T>;
            const dim3 grid(cpar__grid(h, CPAR__BLOCK), (unsigned)chunks);
            CPAR_LAUNCH(dw_kernel, grid, CPAR__BLOCK, 0, cs)(xt, dyt, stats_scratch, rows, h, chunk_rows, partial);
            if ((le = cudaGetLastError()) != cudaSuccess) return le;
            CPAR_LAUNCH(cpar__rmsnorm_dw_finish_kernel, cpar__grid(h, CPAR__BLOCK), CPAR__BLOCK, 0, cs)
            (partial, chunks, h, dweight);
            if ((le = cudaGetLastError()) != cudaSuccess) return le;
        }
        auto dx_kernel = vec ? cpar__rmsnorm_dx_kernel<T, V> : cpar__rmsnorm_dx_kernel<T, 1>;
        CPAR_LAUNCH(dx_kernel, cpar__grid(rows * h, (int64_t)CPAR__BLOCK * (vec ? V : 1)), CPAR__BLOCK, 0, cs)
        (xt, wt, dyt, stats_scratch, rows, h, dxt);
        return cudaGetLastError();
    });
    CPAR__TRY_CUDA(e, "rmsnorm backward kernel launch (%s, %lld x %lld)", cpar__dtype_name(dt), (long long)rows,
                   (long long)h);
    return CPAR_OK;
}

/* ==== 20. GeLU (tanh approximation) =========================================
 * Megatron's fused bias_gelu without the bias (PyTorch's
 * F.gelu(approximate="tanh")), fp32 math:
 *   y  = 0.5 x (1 + t),  t = tanh(u),  u = 0.79788456 x (1 + 0.044715 x^2)
 *   dx = dy (0.5 x (1 - t^2)(0.79788456 + 0.1070322243 x^2) + 0.5 (1 + t)),
 * written without t: with e = e^-2|u| and q = 1/(1 + e), 0.5 (1 + t) = q
 * (u >= 0) or e q (u < 0) and 1 - t^2 = 4 e q^2. 1 + t and 1 - t^2 from a
 * rounded tanh cancel to 0 in the tails (gelu'(-5) = -1.04e-6 would come
 * out 0); these keep a few ulp relative. x, y, dy, dx: [n] of one float
 * dtype; y may be x and dx may be dy (element-wise, same thread). Launch:
 * 1-D grid-stride, 256 threads, 16-byte packs when every pointer is 16-byte
 * aligned. Moves 2n (forward) or 3n (backward)
 * elements. Host twin: cpar.c §5 (which clamps |u| at 43; e^-86 no longer
 * moves a result). Uses: 2, 4. */

/* 0.5 (1 + tanh u) in *h; returns e^-2|u| q^2, a quarter of 1 - tanh^2 u.
 * On the SFU: e = 2^(-2 log2(e) |u|) by cpar__ex2 (a multiply and one
 * MUFU.EX2, where expf took eight instructions; 0 below 2^-126, where e
 * no longer moves q and e q is below any result's precision) and q by
 * MUFU.RCP (__fdividef: 1 + e is in [1, 2], so the division's range
 * checks and slow path, six instructions, only cost; 2 ulp at most). */
static __device__ __forceinline__ float cpar__gelu_terms(float x, float *h) {
    const float u = 0.79788456f * x * (1.f + 0.044715f * x * x), e = cpar__ex2(-2.8853900817779268f * fabsf(u));
    const float q = __fdividef(1.f, 1.f + e);
    *h = u >= 0.f ? q : e * q;
    return e * (q * q);
}

static __device__ __forceinline__ float cpar__gelu_fwd1(float v) {
    float h;
    cpar__gelu_terms(v, &h);
    return v * h;
}

static __device__ __forceinline__ float cpar__gelu_bwd1(float v, float dy) {
    float h;
    const float eq2 = cpar__gelu_terms(v, &h);
    return (2.f * v * eq2 * (0.79788456f + 0.1070322243f * v * v) + h) * dy;
}

/* V elements per step (16-byte packs when every pointer allows), then the
 * tail of n % V one by one. */
template <typename T, int V> static __global__ void cpar__gelu_fwd_kernel(const T *x, T *y, int64_t n) {
    const int64_t nv = n / V, step = cpar__thread_count();
    for (int64_t j = cpar__thread_id(); j < nv; j += step) {
        const cpar__pack<T, V> a = cpar__load<V>(x + j * V);
        cpar__pack<T, V> o;
        CPAR__UNROLL
        for (int e = 0; e < V; e++) o.v[e] = cpar__narrow<T>(cpar__gelu_fwd1(cpar__widen(a.v[e])));
        cpar__store<V>(y + j * V, o);
    }
    for (int64_t i = nv * V + cpar__thread_id(); i < n; i += step) y[i] = cpar__narrow<T>(cpar__gelu_fwd1(cpar__widen(x[i])));
}

template <typename T, int V> static __global__ void cpar__gelu_bwd_kernel(const T *x, const T *dy, T *dx, int64_t n) {
    const int64_t nv = n / V, step = cpar__thread_count();
    for (int64_t j = cpar__thread_id(); j < nv; j += step) {
        const cpar__pack<T, V> a = cpar__load<V>(x + j * V), g = cpar__load<V>(dy + j * V);
        cpar__pack<T, V> o;
        CPAR__UNROLL
        for (int e = 0; e < V; e++) o.v[e] = cpar__narrow<T>(cpar__gelu_bwd1(cpar__widen(a.v[e]), cpar__widen(g.v[e])));
        cpar__store<V>(dx + j * V, o);
    }
    for (int64_t i = nv * V + cpar__thread_id(); i < n; i += step)
        dx[i] = cpar__narrow<T>(cpar__gelu_bwd1(cpar__widen(x[i]), cpar__widen(dy[i])));
}

cpar_status cpar_dev_gelu(const void *x, const void *dy, void *out, cpar_dtype dt, int64_t n, cpar_dev_stream s) {
    CPAR__CHECK_COUNT(n);
    CPAR__CHECK_PTR(x, n > 0);
    CPAR__CHECK_PTR(out, n > 0);
    if (!cpar__is_float(dt)) return CPAR__INVALID("dtype %s, expected f32, f16 or bf16", cpar__dtype_name(dt));
    if (n == 0) return CPAR_OK;
    cudaStream_t cs = cpar__stream(s);
    const bool vec = cpar__aligned(16, x, out) && cpar__aligned(16, dy);
    cudaError_t e = cpar__with_float_type(dt, [&](auto tv) {
        typedef decltype(tv) T;
        constexpr int V = cpar__vec16<T>;
        const T *xt = static_cast<const T *>(x), *dyt = static_cast<const T *>(dy);
        T *ot = static_cast<T *>(out);
        if (dy) {
            auto kernel = vec ? cpar__gelu_bwd_kernel<T, V> : cpar__gelu_bwd_kernel<T, 1>;
            CPAR_LAUNCH(kernel, cpar__grid(n, (int64_t)CPAR__BLOCK * (vec ? V : 1)), CPAR__BLOCK, 0, cs)(xt, dyt, ot, n);
        } else {
            auto kernel = vec ? cpar__gelu_fwd_kernel<T, V> : cpar__gelu_fwd_kernel<T, 1>;
            CPAR_LAUNCH(kernel, cpar__grid(n, (int64_t)CPAR__BLOCK * (vec ? V : 1)), CPAR__BLOCK, 0, cs)(xt, ot, n);
        }
        return cudaGetLastError();
    });
    CPAR__TRY_CUDA(e, "gelu %s kernel launch (%s, n = %lld)", dy ? "backward" : "forward", cpar__dtype_name(dt),
                   (long long)n);
    return CPAR_OK;
}

/* ==== 21. Training: AdamW and the sum of squares =================================
 * cpar_dev_adamw: PyTorch's AdamW over n elements in one pass (cpar.h §15),
 *   master, m, v, grad F32 [n]; param [n] of pdt (F32/F16/BF16) or NULL.
 *   Per element: g = grad * scale; w = master * (1 - lr wd); m = b1 m +
 *   (1 - b1) g; v = b2 v + (1 - b2) g^2; w -= step_size m / (sqrt(v) /
 *   sqrt_bc2 + eps) with step_size = lr / bc1; param = w rounded. 1-D
 *   grid-stride, 256 threads; reads 4n and writes 3n (+ n of param) words.
 * cpar_dev_sum_squares: *out += sum x[i]^2 over F32 [n], deterministic: a
 *   fixed grid of at most 256 blocks writes one fp32 partial each (each
 *   thread a grid-stride sum, then a shared-memory tree), and one block adds
 *   the partials in order (per-thread strided sums, then the same tree).
 *   Reads n words. Host twins: cpar.c §22. Uses: 2, 4. */

template <typename P>
static __global__ void cpar__adamw_kernel(float *master, float *m, float *v, const float *grad, P *param, int64_t n,
                                          float decay, float b1, float b2, float eps, float step_size, float sqrt_bc2,
                                          float scale) {
    for (int64_t i = cpar__thread_id(); i < n; i += cpar__thread_count()) {
        const float g = grad[i] * scale;
        const float mi = b1 * m[i] + (1.f - b1) * g, vi = b2 * v[i] + (1.f - b2) * g * g;
        const float w = master[i] * decay - step_size * (mi / (sqrtf(vi) / sqrt_bc2 + eps));
        m[i] = mi, v[i] = vi, master[i] = w;
        if (param) param[i] = cpar__narrow<P>(w);
    }
}

cpar_status cpar_dev_adamw(float *master, float *m, float *v, const float *grad, void *param, cpar_dtype pdt, int64_t n,
                           float lr, float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2,
                           float grad_scale, cpar_dev_stream s) {
    CPAR__CHECK_COUNT(n);
    CPAR__CHECK_PTR(master, n > 0);
    CPAR__CHECK_PTR(m, n > 0);
    CPAR__CHECK_PTR(v, n > 0);
    CPAR__CHECK_PTR(grad, n > 0);
    if (param && !cpar__is_float(pdt))
        return CPAR__INVALID("param dtype %s, expected f32, f16 or bf16", cpar__dtype_name(pdt));
    if (!(bc1 > 0.f && bc2 > 0.f)) return CPAR__INVALID("bias corrections %g and %g, expected > 0", (double)bc1, (double)bc2);
    if (n == 0) return CPAR_OK;
    cudaStream_t cs = cpar__stream(s);
    const float decay = 1.f - lr * weight_decay, step_size = lr / bc1, sqrt_bc2 = sqrtf(bc2);
    cudaError_t e = cpar__with_float_type(param ? pdt : CPAR_F32, [&](auto tv) {
        typedef decltype(tv) P;
        auto kernel = cpar__adamw_kernel<P>;
        CPAR_LAUNCH(kernel, cpar__grid(n, CPAR__BLOCK), CPAR__BLOCK, 0, cs)
        (master, m, v, grad, static_cast<P *>(param), n, decay, beta1, beta2, eps, step_size, sqrt_bc2, grad_scale);
        return cudaGetLastError();
    });
    CPAR__TRY_CUDA(e, "adamw kernel launch (param %s, n = %lld)", param ? cpar__dtype_name(pdt) : "none", (long long)n);
    return CPAR_OK;
}

static constexpr int CPAR__SUMSQ_BLOCKS = 256;

/* Blocks of the partial pass: a fixed function of n (so is the sum's order). */
static unsigned cpar__sumsq_blocks(int64_t n) {
    const unsigned g = cpar__grid(n, 4 * CPAR__BLOCK);
    return g < CPAR__SUMSQ_BLOCKS ? g : CPAR__SUMSQ_BLOCKS;
}

/* The block's threads' values added by a fixed tree; thread 0 gets the sum. */
static __device__ float cpar__block_sum(float t) {
    __shared__ float part[CPAR__BLOCK];
    part[threadIdx.x] = t;
    __syncthreads();
    for (int w = CPAR__BLOCK / 2; w > 0; w /= 2) {
        if ((int)threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    return part[0];
}

static __global__ void cpar__sumsq_partial_kernel(const float *x, int64_t n, float *partial) {
    float t = 0.f;
    for (int64_t i = cpar__thread_id(); i < n; i += cpar__thread_count()) t += x[i] * x[i];
    const float sum = cpar__block_sum(t);
    if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

static __global__ void cpar__sumsq_final_kernel(const float *partial, int nb, float *out) {
    float t = 0.f;
    for (int i = threadIdx.x; i < nb; i += CPAR__BLOCK) t += partial[i];
    const float sum = cpar__block_sum(t);
    if (threadIdx.x == 0) *out += sum;
}

size_t cpar_dev_sum_squares_scratch(int64_t n) { return n > 0 ? (size_t)cpar__sumsq_blocks(n) * sizeof(float) : 0; }

cpar_status cpar_dev_sum_squares(const float *x, int64_t n, float *out, void *scratch, cpar_dev_stream s) {
    CPAR__CHECK_COUNT(n);
    CPAR__CHECK_PTR(x, n > 0);
    CPAR__CHECK_PTR(out, true);
    CPAR__CHECK_PTR(scratch, n > 0);
    if (n == 0) return CPAR_OK;
    cudaStream_t cs = cpar__stream(s);
    const unsigned nb = cpar__sumsq_blocks(n);
    CPAR_LAUNCH(cpar__sumsq_partial_kernel, nb, CPAR__BLOCK, 0, cs)(x, n, static_cast<float *>(scratch));
    CPAR__TRY_CUDA(cudaGetLastError(), "sum of squares kernel launch (n = %lld)", (long long)n);
    CPAR_LAUNCH(cpar__sumsq_final_kernel, 1, CPAR__BLOCK, 0, cs)(static_cast<const float *>(scratch), (int)nb, out);
    CPAR__TRY_CUDA(cudaGetLastError(), "sum of squares final kernel launch (n = %lld)", (long long)n);
    return CPAR_OK;
}

#endif /* sections 17-21 */
