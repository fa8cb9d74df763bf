/* SPDX-License-Identifier: MIT */
/* tests/ncclsim/ncclsim_cudasim.cc — what the NCCL simulator asks of the CUDA
 * simulator: the calling thread's current device, whether a buffer is live
 * device memory (and on which device), and whether a stream is live.
 *
 * cudasim.h keeps its registry in function-local statics of inline
 * functions, so this translation unit sees the same allocations and streams
 * as cpar_kernels.cu compiled with it. Built with the C++ compiler:
 *     g++ -std=c++17 -DCPAR_SIM -I. -x c++ -c tests/ncclsim/ncclsim_cudasim.cc */
#include "tests/cudasim.h"

#include "ncclsim_hooks.h"

extern "C" int ncclsim_dev_current(void) {
    int d = -1;
    if (cudaGetDevice(&d) != cudaSuccess) {
        (void)cudaGetLastError(); /* leave no error behind for the program */
        return -1;
    }
    return d;
}

extern "C" int ncclsim_dev_buffer(const void *p, size_t bytes, int *device, size_t *alloc_bytes, size_t *offset) {
    using namespace cudasim::detail;
    Global &g = global();
    std::lock_guard<std::mutex> lock(g.mu);
    auto a = find_alloc(g, p);
    if (!a) return NCCLSIM_BUF_NOT_DEVICE;
    *device = a->second.device;
    *alloc_bytes = a->second.size;
    *offset = (uintptr_t)p - a->first;
    if (a->second.pinned) return NCCLSIM_BUF_NOT_DEVICE;
    return *offset + bytes > a->second.size ? NCCLSIM_BUF_PAST_END : NCCLSIM_BUF_OK;
}

extern "C" int ncclsim_dev_stream(cudaStream_t s, int *device) {
    using namespace cudasim::detail;
    if (!s || s == cudaStreamLegacy || s == cudaStreamPerThread) {
        *device = -1; /* the default stream of whatever device is current */
        return 1;
    }
    if (!stream_ok(s)) return 0;
    *device = s->device;
    return 1;
}
