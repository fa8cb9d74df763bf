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

#include <memory>
#include <thread>

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

extern "C" void ncclsim_dev_stream_flush(cudaStream_t s) {
    using namespace cudasim::detail;
    force_all(resolve(s));
}

extern "C" void ncclsim_dev_stream_force(cudaStream_t s, uint64_t seq) {
    cudasim::detail::force(s, seq);
}

/* The queued operation's reference to a staging or landing, shared by its
 * `run` and `ready` closures and their copies: a query may still be in a
 * copy of `ready` when another thread has run the operation. */
template <typename T> static std::shared_ptr<T> queued_ref(T *p, void (*release)(T *)) {
    return std::shared_ptr<T>(p, release);
}

/* The staging: runs when the stream reaches the batch, on whichever thread
 * runs the stream then; other threads' random progress too, unless the
 * batch waits behind another (then it could wait for the issuing thread's
 * polls inside that thread's own runtime call). */
extern "C" uint64_t ncclsim_dev_stream_stage(cudaStream_t s, ns_stage *st, int waits, cudaStream_t *where) {
    using namespace cudasim::detail;
    CUstream_st *q = resolve(s);
    *where = q;
    auto ref = queued_ref(st, ncclsim_stage_release);
    return enqueue(q, "ncclsim: an operation's inputs", [ref] { ncclsim_stage_run(ref.get()); }, {}, waits != 0,
                   [ref] { return ncclsim_stage_ready(ref.get()) != 0; });
}

/* The landing copy: runs when the stream reaches the operation; waits for it
 * to end, up to NCCLSIM_TIMEOUT_MS: on the issuing thread (eager: at issue)
 * by driving the communicator, elsewhere by waiting for the host's polls.
 * Never run by another thread's random progress (host_driven). */
extern "C" void ncclsim_dev_stream_land(cudaStream_t s, ns_landing *l) {
    using namespace cudasim::detail;
    auto ref = queued_ref(l, ncclsim_land_release);
    auto ready = [ref] {
        ns_landing *l = ref.get();
        if (ncclsim_land_state(l) == NCCLSIM_LAND_PENDING) ncclsim_land_drive(l);
        return ncclsim_land_state(l) != NCCLSIM_LAND_PENDING;
    };
    enqueue_host_driven(resolve(s), "ncclsim: an operation's output", [ref] {
        ns_landing *l = ref.get();
        const char *e = getenv("NCCLSIM_TIMEOUT_MS");
        long long limit_ms = e && atoll(e) > 0 ? atoll(e) : 300000;
        auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(limit_ms);
        int st;
        while ((st = ncclsim_land_state(l)) == NCCLSIM_LAND_PENDING && std::chrono::steady_clock::now() < until)
            if (!ncclsim_land_drive(l)) std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (st == NCCLSIM_LAND_DONE) {
            void *dst;
            const void *buf;
            size_t bytes;
            ncclsim_land_parts(l, &dst, &buf, &bytes);
            if (bytes) memcpy(dst, buf, bytes);
        } else if (st == NCCLSIM_LAND_PENDING) {
            set_message("ncclsim: the stream reached an NCCL operation that had not finished after %lld ms: "
                        "poll ncclCommGetAsyncError until it has (a real GPU would hang here)", limit_ms);
            op_failed(cudaErrorLaunchTimeout);
        }
    }, ready);
}

extern "C" int ncclsim_dev_streams_deferred(void) { return cudasim::detail::streams_mode() != 0; }
