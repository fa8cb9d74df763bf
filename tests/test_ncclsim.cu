/* SPDX-License-Identifier: MIT */
/* tests/test_ncclsim.cu — the NCCL simulator (tests/ncclsim) against the
 * semantics cpar relies on: non-blocking init and split, group deferral,
 * stream order, collectives bit-identical to a single-threaded reference,
 * aborts, dead processes and disagreeing ranks failing instead of hanging,
 * argument checks, and no /dev/shm leftovers.
 *
 * C++ only because it uses the CUDA simulator (cudaMalloc, streams) directly;
 * it links the simulator and nothing of cpar. Ranks are threads (one device
 * each) or processes forked by the test. */
#include <check.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/cudasim.h"
#include "tests/suite.h"
#include "nccl.h"

#define MAXR 8

/* ---- helpers ------------------------------------------------------------- */

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts)) {
    }
}

static uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Segments of the simulator in /dev/shm: every test ends with none of its
 * own (another suite's running beside it do not count). */
static int shm_leftovers(void) { return ncclsim_leftover_segments(); }

static ncclUniqueId g_id; /* the test's communicator id, made before its ranks start */

static ncclConfig_t nb_config(void) {
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    c.blocking = 0;
    return c;
}

/* Poll c until r leaves ncclInProgress or ms pass. */
static ncclResult_t poll_for(ncclComm_t c, ncclResult_t r, int ms) {
    int64_t until = now_ms() + ms;
    while (r == ncclInProgress && now_ms() < until) {
        ck_assert_int_eq(ncclCommGetAsyncError(c, &r), ncclSuccess);
        if (r == ncclInProgress) sched_yield();
    }
    return r;
}

#define NB_OK(c, call)                                                                                       \
    do {                                                                                                     \
        ncclResult_t r_ = poll_for((c), (call), 20000);                                                      \
        ck_assert_msg(r_ == ncclSuccess, "%s -> %s: %s", #call, ncclGetErrorString(r_), ncclGetLastError(NULL)); \
    } while (0)

static ncclComm_t init_nb(int n, int rank) {
    ncclConfig_t cfg = nb_config();
    ncclComm_t c = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&c, n, g_id, rank, &cfg);
    ck_assert_ptr_nonnull(c);
    NB_OK(c, r);
    return c;
}

typedef void (*rank_fn)(int rank, int n, void *arg);
typedef struct {
    int rank, n;
    rank_fn fn;
    void *arg;
} rank_thread;

static void *rank_main(void *p) {
    rank_thread *t = (rank_thread *)p;
    ck_assert_int_eq(cudaSetDevice(t->rank % 8), cudaSuccess);
    t->fn(t->rank, t->n, t->arg);
    return NULL;
}

/* n ranks as threads, one simulated GPU each, on a fresh id. */
static void run_threads(int n, rank_fn fn, void *arg) {
    pthread_t th[MAXR];
    rank_thread t[MAXR];
    ck_assert_int_eq(ncclGetUniqueId(&g_id), ncclSuccess);
    for (int r = 0; r < n; r++) {
        t[r] = (rank_thread){r, n, fn, arg};
        ck_assert_int_eq(pthread_create(&th[r], NULL, rank_main, &t[r]), 0);
    }
    for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
}

/* n ranks as processes; returns how many exited 0. fn runs in each child,
 * whose exit status is 0 unless a check failed. */
static int run_processes(int n, rank_fn fn, void *arg, int *status) {
    pid_t pid[MAXR];
    ck_assert_int_eq(ncclGetUniqueId(&g_id), ncclSuccess);
    fflush(NULL);
    for (int r = 0; r < n; r++) {
        pid[r] = fork();
        ck_assert_int_ge(pid[r], 0);
        if (pid[r] == 0) {
            if (cudaSetDevice(r) != cudaSuccess) _exit(90);
            fn(r, n, arg);
            _exit(0);
        }
    }
    int ok = 0;
    for (int r = 0; r < n; r++) {
        int st = 0;
        ck_assert_int_eq(waitpid(pid[r], &st, 0), pid[r]);
        status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        ok += status[r] == 0;
    }
    return ok;
}

static void *dev_alloc(size_t bytes) {
    void *p = NULL;
    ck_assert_int_eq(cudaMalloc(&p, bytes ? bytes : 1), cudaSuccess);
    return p;
}

static void *dev_upload(const void *host, size_t bytes) {
    void *p = dev_alloc(bytes);
    if (bytes) ck_assert_int_eq(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    return p;
}

static void download(void *host, const void *dev, size_t bytes) {
    if (bytes) ck_assert_int_eq(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

/* ---- data and the single-threaded reference ------------------------------- */

static const ncclDataType_t all_types[] = {ncclInt8,   ncclUint8,   ncclInt32,   ncclUint32,  ncclInt64,
                                           ncclUint64, ncclFloat16, ncclFloat32, ncclFloat64, ncclBfloat16};
#define N_TYPES 10
static const size_t type_size[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};

/* Element i of rank r's data for call k: floats in [-1, 1), integers small
 * enough that sums and products of a few ranks stay interesting. */
static void fill(void *p, ncclDataType_t t, size_t n, uint64_t seed) {
    for (size_t i = 0; i < n; i++) {
        uint64_t z = mix(seed * 1000003u + i);
        double u = (double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0;
        int v = (int)(z % 13) - 6;
        switch (t) {
        case ncclInt8: ((int8_t *)p)[i] = (int8_t)v; break;
        case ncclUint8: ((uint8_t *)p)[i] = (uint8_t)(z % 7); break;
        case ncclInt32: ((int32_t *)p)[i] = v * 1000; break;
        case ncclUint32: ((uint32_t *)p)[i] = (uint32_t)(z % 100000); break;
        case ncclInt64: ((int64_t *)p)[i] = (int64_t)v * 100000007; break;
        case ncclUint64: ((uint64_t *)p)[i] = z; break;
        case ncclFloat16: ((__half *)p)[i] = __float2half_rn((float)u); break;
        case ncclFloat32: ((float *)p)[i] = (float)u; break;
        case ncclFloat64: ((double *)p)[i] = u; break;
        default: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn((float)u); break;
        }
    }
}

/* out[i] = x[0][i] op ... op x[n-1][i], in rank order; integers wrap, 16-bit
 * floats accumulate in fp32 and round once (cudasim's own conversions). */
template <class T, class A> static A load(T v) { return (A)v; }
template <> float load<__half, float>(__half v) { return __half2float(v); }
template <> float load<__nv_bfloat16, float>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T, class A> static T store(A v) { return (T)v; }
template <> __half store<__half, float>(float v) { return __float2half_rn(v); }
template <> __nv_bfloat16 store<__nv_bfloat16, float>(float v) { return __float2bfloat16_rn(v); }

template <class T, class A, bool Int>
static void reference_t(void *out, void *const *x, int n, size_t count, ncclRedOp_t op) {
    for (size_t i = 0; i < count; i++) {
        A acc = load<T, A>(((T *)x[0])[i]);
        for (int r = 1; r < n; r++) {
            A v = load<T, A>(((T *)x[r])[i]);
            if (op == ncclMax) acc = v > acc ? v : acc;
            else if (op == ncclMin) acc = v < acc ? v : acc;
            else if (op == ncclProd) acc = Int ? (A)(T)((uint64_t)acc * (uint64_t)v) : acc * v;
            else acc = Int ? (A)(T)((uint64_t)acc + (uint64_t)v) : acc + v;
        }
        if (op == ncclAvg) acc = Int ? (A)((T)acc / (T)n) : acc / (A)n;
        ((T *)out)[i] = store<T, A>(acc);
    }
}

static void reference(void *out, void *const *x, int n, size_t count, ncclDataType_t t, ncclRedOp_t op) {
    switch (t) {
    case ncclInt8: reference_t<int8_t, int8_t, true>(out, x, n, count, op); break;
    case ncclUint8: reference_t<uint8_t, uint8_t, true>(out, x, n, count, op); break;
    case ncclInt32: reference_t<int32_t, int32_t, true>(out, x, n, count, op); break;
    case ncclUint32: reference_t<uint32_t, uint32_t, true>(out, x, n, count, op); break;
    case ncclInt64: reference_t<int64_t, int64_t, true>(out, x, n, count, op); break;
    case ncclUint64: reference_t<uint64_t, uint64_t, true>(out, x, n, count, op); break;
    case ncclFloat16: reference_t<__half, float, false>(out, x, n, count, op); break;
    case ncclFloat32: reference_t<float, float, false>(out, x, n, count, op); break;
    case ncclFloat64: reference_t<double, double, false>(out, x, n, count, op); break;
    default: reference_t<__nv_bfloat16, float, false>(out, x, n, count, op); break;
    }
}

/* ---- collectives against the reference ------------------------------------ */

#define COUNT 37
enum { K_ALLREDUCE, K_ALLREDUCE_INPLACE, K_REDUCE, K_REDUCESCATTER, K_ALLGATHER, K_ALLGATHER_INPLACE, K_BROADCAST,
       K_BROADCAST_INPLACE, K_COUNT };

/* Every rank computes every rank's inputs (same seeds), so it can check its
 * own output against the reference bit for bit. */
static void rank_collectives(int rank, int n, void *arg) {
    (void)arg;
    ncclComm_t c = init_nb(n, rank);
    for (int ti = 0; ti < N_TYPES; ti++)
        for (int op = 0; op < ncclNumOps; op++)
            for (int k = 0; k < K_COUNT; k++) {
                bool reduces = k <= K_REDUCESCATTER;
                if (!reduces && op > 0) continue;
                ncclDataType_t t = all_types[ti];
                size_t es = type_size[ti], in_n = k == K_REDUCESCATTER ? COUNT * (size_t)n : COUNT;
                size_t out_n = k == K_ALLGATHER || k == K_ALLGATHER_INPLACE ? COUNT * (size_t)n : COUNT;
                uint64_t seed = (uint64_t)(ti * 100 + op * 10 + k) * 31;
                void *x[MAXR];
                for (int r = 0; r < n; r++) {
                    x[r] = malloc(in_n * es);
                    fill(x[r], t, in_n, seed + (uint64_t)r);
                }
                char want[COUNT * MAXR * 8], got[COUNT * MAXR * 8];
                int root = n / 2;
                switch (k) {
                case K_REDUCESCATTER: {
                    void *xs[MAXR];
                    for (int r = 0; r < n; r++) xs[r] = (char *)x[r] + (size_t)rank * COUNT * es;
                    reference(want, xs, n, COUNT, t, (ncclRedOp_t)op);
                    break;
                }
                case K_ALLGATHER: case K_ALLGATHER_INPLACE:
                    for (int r = 0; r < n; r++) memcpy(want + (size_t)r * COUNT * es, x[r], COUNT * es);
                    break;
                case K_BROADCAST: case K_BROADCAST_INPLACE: memcpy(want, x[root], COUNT * es); break;
                default: reference(want, x, n, COUNT, t, (ncclRedOp_t)op); break;
                }
                /* outputs start as 0xFF so an unwritten element shows */
                memset(got, 0xff, sizeof got);
                void *out = dev_upload(got, out_n * es), *in = NULL;
                const void *send;
                if (k == K_ALLREDUCE_INPLACE || k == K_BROADCAST_INPLACE) {
                    ck_assert_int_eq(cudaMemcpy(out, x[rank], COUNT * es, cudaMemcpyHostToDevice), cudaSuccess);
                    send = out;
                } else if (k == K_ALLGATHER_INPLACE) {
                    char *slot = (char *)out + (size_t)rank * COUNT * es;
                    ck_assert_int_eq(cudaMemcpy(slot, x[rank], COUNT * es, cudaMemcpyHostToDevice), cudaSuccess);
                    send = slot;
                } else {
                    send = in = dev_upload(x[rank], in_n * es);
                }
                switch (k) {
                case K_ALLREDUCE: case K_ALLREDUCE_INPLACE:
                    NB_OK(c, ncclAllReduce(send, out, COUNT, t, (ncclRedOp_t)op, c, 0));
                    break;
                case K_REDUCE: NB_OK(c, ncclReduce(send, out, COUNT, t, (ncclRedOp_t)op, root, c, 0)); break;
                case K_REDUCESCATTER: NB_OK(c, ncclReduceScatter(send, out, COUNT, t, (ncclRedOp_t)op, c, 0)); break;
                case K_ALLGATHER: case K_ALLGATHER_INPLACE: NB_OK(c, ncclAllGather(send, out, COUNT, t, c, 0)); break;
                default: NB_OK(c, ncclBroadcast(send, out, COUNT, t, root, c, 0)); break;
                }
                download(got, out, out_n * es);
                if (k == K_REDUCE && rank != root) { /* non-roots' recvbuff is not written */
                    memset(want, 0xff, out_n * es);
                }
                ck_assert_msg(!memcmp(got, want, out_n * es), "n %d rank %d: kind %d type %d op %d differs", n,
                              rank, k, (int)t, op);
                cudaFree(out);
                if (in) cudaFree(in);
                for (int r = 0; r < n; r++) free(x[r]);
            }
    ck_assert_int_eq(ncclCommDestroy(c), ncclSuccess);
}

START_TEST(test_collectives) {
    run_threads(_i + 1, rank_collectives, NULL);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* The uneven all-gather cpar builds from one broadcast per rank in a group. */
static void rank_grouped_broadcasts(int rank, int n, void *arg) {
    (void)arg;
    ncclComm_t c = init_nb(n, rank);
    int32_t rows[MAXR], off[MAXR], total = 0;
    for (int r = 0; r < n; r++) {
        rows[r] = r % 3 == 1 ? 0 : r + 2;
        off[r] = total;
        total += rows[r];
    }
    int32_t host[64];
    for (int i = 0; i < total; i++) host[i] = -1;
    for (int i = 0; i < rows[rank]; i++) host[off[rank] + i] = rank * 100 + i;
    int32_t *buf = (int32_t *)dev_upload(host, sizeof host);
    NB_OK(c, ncclGroupStart());
    for (int r = 0; r < n; r++) ncclBroadcast(buf + off[r], buf + off[r], (size_t)rows[r], ncclInt32, r, c, 0);
    NB_OK(c, ncclGroupEnd());
    download(host, buf, sizeof host);
    for (int r = 0; r < n; r++)
        for (int i = 0; i < rows[r]; i++) ck_assert_int_eq(host[off[r] + i], r * 100 + i);
    cudaFree(buf);
    ncclCommDestroy(c);
}

START_TEST(test_grouped_broadcasts) { run_threads(_i + 1, rank_grouped_broadcasts, NULL); }
END_TEST

/* ---- non-blocking init ------------------------------------------------------- */

typedef struct {
    int late;       /* this rank joins late (or never, with never) */
    bool never;
    pthread_barrier_t held; /* every rank records its state before any aborts (an abort ends the others' wait) */
    ncclResult_t early[MAXR]; /* state of each on-time rank while the late one is away */
    ncclResult_t final_[MAXR];
} join_arg;

static void rank_join(int rank, int n, void *p) {
    join_arg *a = (join_arg *)p;
    if (rank == a->late) {
        if (a->never) return;
        sleep_ms(150);
    }
    ncclConfig_t cfg = nb_config();
    ncclComm_t c = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&c, n, g_id, rank, &cfg);
    ck_assert_ptr_nonnull(c);
    if (rank != a->late) {
        a->early[rank] = poll_for(c, r, 80); /* the late rank is still away */
        r = a->early[rank];
    }
    a->final_[rank] = poll_for(c, r, a->never ? 200 : 5000);
    pthread_barrier_wait(&a->held);
    if (a->final_[rank] == ncclSuccess) ncclCommDestroy(c);
    else ncclCommAbort(c);
}

START_TEST(test_init_waits_for_every_rank) {
    /* _i: which rank is late (0 creates the segment; 2 joins it) */
    join_arg a = {};
    a.late = _i ? 2 : 0;
    pthread_barrier_init(&a.held, NULL, 3);
    run_threads(3, rank_join, &a);
    pthread_barrier_destroy(&a.held);
    for (int r = 0; r < 3; r++) {
        if (r != a.late) ck_assert_int_eq(a.early[r], ncclInProgress);
        ck_assert_int_eq(a.final_[r], ncclSuccess);
    }
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

START_TEST(test_init_rank_never_joins) {
    join_arg a = {};
    a.late = _i ? 2 : 0;
    a.never = true;
    pthread_barrier_init(&a.held, NULL, 2);
    run_threads(3, rank_join, &a);
    pthread_barrier_destroy(&a.held);
    for (int r = 0; r < 3; r++)
        if (r != a.late) ck_assert_int_eq(a.final_[r], ncclInProgress); /* until the caller gives up */
    ck_assert_int_eq(shm_leftovers(), 0); /* the aborts removed the name */
}
END_TEST

/* ---- groups: deferral of point-to-point ------------------------------------------ */

typedef struct {
    bool grouped;
    ncclResult_t st[MAXR];
    pthread_barrier_t held; /* all record their state before any aborts */
} ring_arg;

static void rank_ring_shift(int rank, int n, void *p) {
    ring_arg *a = (ring_arg *)p;
    ncclComm_t c = init_nb(n, rank);
    int32_t mine[5], got[5];
    for (int i = 0; i < 5; i++) mine[i] = rank * 10 + i;
    void *s = dev_upload(mine, sizeof mine), *r = dev_alloc(sizeof got);
    int to = (rank + 1) % n, from = (rank + n - 1) % n;
    ncclResult_t st;
    if (a->grouped) {
        ncclGroupStart();
        ncclSend(s, 5, ncclInt32, to, c, 0);
        ncclRecv(r, 5, ncclInt32, from, c, 0);
        st = poll_for(c, ncclGroupEnd(), 5000);
    } else { /* every rank sends first: each waits for a receiver that is itself sending */
        st = poll_for(c, ncclSend(s, 5, ncclInt32, to, c, 0), 200);
    }
    a->st[rank] = st;
    pthread_barrier_wait(&a->held);
    if (st == ncclSuccess) {
        download(got, r, sizeof got);
        for (int i = 0; i < 5; i++) ck_assert_int_eq(got[i], from * 10 + i);
        ncclCommDestroy(c);
    } else {
        ncclCommAbort(c);
    }
    cudaFree(s);
    cudaFree(r);
}

START_TEST(test_ring_shift_in_group) {
    ring_arg a = {true, {}, {}};
    pthread_barrier_init(&a.held, NULL, _i + 2);
    run_threads(_i + 2, rank_ring_shift, &a);
    pthread_barrier_destroy(&a.held);
    for (int r = 0; r < _i + 2; r++) ck_assert_int_eq(a.st[r], ncclSuccess);
}
END_TEST

START_TEST(test_ring_shift_outside_group_waits) {
    ring_arg a = {false, {}, {}};
    pthread_barrier_init(&a.held, NULL, _i + 2);
    run_threads(_i + 2, rank_ring_shift, &a);
    pthread_barrier_destroy(&a.held);
    for (int r = 0; r < _i + 2; r++) ck_assert_int_eq(a.st[r], ncclInProgress);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* ---- split, and two communicators at once ------------------------------------------ */

static void rank_split(int rank, int n, void *arg) {
    (void)arg;
    ncclComm_t w = init_nb(n, rank);
    /* colors: {0, 1} -> 0, {2} -> 1, {3} -> none; keys reverse the order */
    int color = rank < 2 ? 0 : rank == 2 ? 1 : NCCL_SPLIT_NOCOLOR;
    ncclComm_t s = (ncclComm_t)&g_id; /* must be overwritten */
    ncclConfig_t cfg = nb_config();
    /* As NCCL 2.28: ncclSuccess while the parent is still in progress, *s
     * NULL until its state leaves in-progress (the caller polls the parent) */
    ncclResult_t r = ncclCommSplit(w, color, -rank, &s, &cfg);
    ck_assert_int_eq(r, ncclSuccess);
    ck_assert_ptr_null(s);
    NB_OK(w, ncclInProgress);
    if (color == NCCL_SPLIT_NOCOLOR) {
        ck_assert_ptr_null(s);
    } else {
        int cnt = 0, me = -1;
        ncclCommCount(s, &cnt);
        ncclCommUserRank(s, &me);
        ck_assert_int_eq(cnt, color == 0 ? 2 : 1);
        ck_assert_int_eq(me, color == 0 ? 1 - rank : 0);
    }
    /* Both communicators in flight at once: issue on w, then on s before
     * polling w (the world waits for rank 3, which joins late). */
    if (rank == 3) sleep_ms(50);
    int32_t one[4] = {rank + 1, rank + 1, rank + 1, rank + 1}, got[4];
    int32_t *wb = (int32_t *)dev_upload(one, sizeof one), *sb = (int32_t *)dev_upload(one, sizeof one);
    ncclResult_t rw = ncclAllReduce(wb, wb, 4, ncclInt32, ncclSum, w, 0);
    if (s) NB_OK(s, ncclAllReduce(sb, sb, 4, ncclInt32, ncclSum, s, 0));
    NB_OK(w, rw);
    download(got, wb, sizeof got);
    ck_assert_int_eq(got[0], n * (n + 1) / 2);
    if (s) {
        download(got, sb, sizeof got);
        ck_assert_int_eq(got[3], 3); /* color 0: ranks 0 and 1 give 1 + 2; color 1: rank 2 alone gives 3 */
        NB_OK(s, ncclCommFinalize(s));
        ncclCommDestroy(s);
    }
    cudaFree(wb);
    cudaFree(sb);
    ncclCommDestroy(w);
}

START_TEST(test_split_and_concurrent_comms) {
    run_threads(4, rank_split, NULL);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* ---- stream order -------------------------------------------------------------------- */

static void rank_stream(int rank, int n, void *arg) {
    (void)arg;
    ncclComm_t c = init_nb(n, rank);
    cudaStream_t st;
    ck_assert_int_eq(cudaStreamCreate(&st), cudaSuccess);
    float host[8], got[8];
    for (int i = 0; i < 8; i++) host[i] = (float)(rank + i);
    float *buf = (float *)dev_alloc(sizeof host);
    /* produce the input, reduce it and read the result, all on one stream */
    ck_assert_int_eq(cudaMemcpyAsync(buf, host, sizeof host, cudaMemcpyHostToDevice, st), cudaSuccess);
    NB_OK(c, ncclAllReduce(buf, buf, 8, ncclFloat32, ncclSum, c, st));
    ck_assert_int_eq(cudaMemcpyAsync(got, buf, sizeof got, cudaMemcpyDeviceToHost, st), cudaSuccess);
    ck_assert_int_eq(cudaStreamSynchronize(st), cudaSuccess);
    for (int i = 0; i < 8; i++) ck_assert_float_eq(got[i], (float)(n * (n - 1) / 2 + n * i));
    cudaStreamDestroy(st);
    cudaFree(buf);
    ncclCommDestroy(c);
}

START_TEST(test_stream_order) { run_threads(3, rank_stream, NULL); }
END_TEST

/* Under a deferred stream mode an operation reads its send buffer when its
 * stream reaches it, not when it is issued: a write on another stream that
 * runs in between (a race on a GPU; here, under lazy, forced to happen
 * first) is what the operation sends. */
static void rank_late_read(int rank, int n, void *arg) {
    (void)arg;
    ncclComm_t c = init_nb(n, rank);
    cudaStream_t s, t;
    ck_assert_int_eq(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    ck_assert_int_eq(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking), cudaSuccess);
    float first[4], later[4], got[4];
    for (int i = 0; i < 4; i++) first[i] = (float)(rank + i), later[i] = (float)(100 * (rank + 1) + i);
    float *in = (float *)dev_upload(first, sizeof first), *out = (float *)dev_alloc(sizeof got);
    NB_OK(c, ncclAllReduce(in, out, 4, ncclFloat32, ncclSum, c, s));
    ck_assert_int_eq(cudaMemcpyAsync(in, later, sizeof later, cudaMemcpyHostToDevice, t), cudaSuccess);
    ck_assert_int_eq(cudaStreamSynchronize(t), cudaSuccess);
    ck_assert_int_eq(cudaMemcpyAsync(got, out, sizeof got, cudaMemcpyDeviceToHost, s), cudaSuccess);
    ck_assert_int_eq(cudaStreamSynchronize(s), cudaSuccess);
    for (int i = 0; i < 4; i++) ck_assert_float_eq(got[i], (float)(100 * n * (n + 1) / 2 + n * i));
    cudaStreamDestroy(s);
    cudaStreamDestroy(t);
    cudaFree(in);
    cudaFree(out);
    ncclCommDestroy(c);
}

START_TEST(test_inputs_read_at_stream_time) {
    cudasim_set_streams(CUDASIM_STREAMS_LAZY, 0);
    run_threads(2, rank_late_read, NULL);
    cudasim_set_streams(CUDASIM_STREAMS_EAGER, 0);
}
END_TEST

/* ---- failures: abort, destroy, disagreement ------------------------------------------------ */

typedef struct {
    int victim;
    bool destroy; /* the victim destroys its communicator instead of aborting */
    ncclResult_t st[MAXR];
    char msg[MAXR][512];
    int64_t ms[MAXR];
} fail_arg;

static void rank_victim(int rank, int n, void *p) {
    fail_arg *a = (fail_arg *)p;
    ncclComm_t c = init_nb(n, rank);
    float *buf = (float *)dev_alloc(64);
    NB_OK(c, ncclAllReduce(buf, buf, 16, ncclFloat32, ncclSum, c, 0)); /* a healthy start */
    if (rank == a->victim) {
        sleep_ms(100); /* the peers are waiting by now */
        if (a->destroy) {
            NB_OK(c, ncclCommFinalize(c));
            ncclCommDestroy(c);
        } else {
            ncclCommAbort(c);
        }
        cudaFree(buf);
        return;
    }
    int64_t t0 = now_ms();
    a->st[rank] = poll_for(c, ncclAllReduce(buf, buf, 16, ncclFloat32, ncclSum, c, 0), 5000);
    a->ms[rank] = now_ms() - t0;
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", ncclGetLastError(NULL));
    ncclCommAbort(c);
    cudaFree(buf);
}

START_TEST(test_peer_abort_or_destroy) {
    fail_arg a = {};
    a.victim = 1;
    a.destroy = _i == 1;
    run_threads(3, rank_victim, &a);
    for (int r = 0; r < 3; r++) {
        if (r == a.victim) continue;
        ck_assert_msg(a.st[r] == ncclRemoteError, "rank %d: %s (%s)", r, ncclGetErrorString(a.st[r]), a.msg[r]);
        ck_assert_msg(strstr(a.msg[r], "rank 1") && strstr(a.msg[r], a.destroy ? "destroyed" : "aborted"),
                      "rank %d: \"%s\"", r, a.msg[r]);
        ck_assert_int_lt(a.ms[r], 2000);
    }
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

typedef struct {
    int what;
    ncclResult_t st[MAXR];
    char msg[MAXR][512];
} mismatch_arg;

static const char *const mismatch_needles[][2] = {
    {"ncclAllReduce", "ncclAllGather"}, {"ncclFloat32", "ncclFloat16"}, {"count 8", "count 9"},
    {"ncclSum", "ncclMax"},             {"root 0", "root 1"},           {"ncclSend(count 8", "ncclRecv(count 9"},
};

static void rank_mismatch(int rank, int n, void *p) {
    mismatch_arg *a = (mismatch_arg *)p;
    ncclComm_t c = init_nb(n, rank);
    void *buf = dev_alloc(1024);
    bool odd = rank == 1;
    ncclResult_t r = ncclSuccess;
    switch (a->what) {
    case 0: r = odd ? ncclAllGather(buf, (char *)buf + 64, 8, ncclFloat32, c, 0)
                    : ncclAllReduce(buf, buf, 8, ncclFloat32, ncclSum, c, 0); break;
    case 1: r = ncclAllReduce(buf, buf, 8, odd ? ncclFloat16 : ncclFloat32, ncclSum, c, 0); break;
    case 2: r = ncclAllReduce(buf, buf, odd ? 9 : 8, ncclFloat32, ncclSum, c, 0); break;
    case 3: r = ncclAllReduce(buf, buf, 8, ncclFloat32, odd ? ncclMax : ncclSum, c, 0); break;
    case 4: r = ncclBroadcast(buf, buf, 8, ncclFloat32, odd ? 1 : 0, c, 0); break;
    default: /* 0 sends 8 floats to 1, which expects 9 */
        if (rank > 1) { ncclCommDestroy(c); cudaFree(buf); return; }
        ncclGroupStart();
        if (rank == 0) ncclSend(buf, 8, ncclFloat32, 1, c, 0);
        else ncclRecv(buf, 9, ncclFloat32, 0, c, 0);
        r = ncclGroupEnd();
        break;
    }
    a->st[rank] = poll_for(c, r, 5000);
    snprintf(a->msg[rank], sizeof a->msg[rank], "%s", ncclGetLastError(NULL));
    ncclCommAbort(c);
    cudaFree(buf);
}

START_TEST(test_mismatch) {
    mismatch_arg a = {};
    a.what = _i;
    run_threads(3, rank_mismatch, &a);
    for (int r = 0; r < (_i == 5 ? 2 : 3); r++) {
        ck_assert_msg(a.st[r] == ncclInvalidUsage, "case %d rank %d: %s (%s)", _i, r, ncclGetErrorString(a.st[r]),
                      a.msg[r]);
        if (_i == 5 && r == 0) continue; /* the sender learns only that its send was rejected */
        for (int k = 0; k < 2; k++)
            ck_assert_msg(strstr(a.msg[r], mismatch_needles[_i][k]), "case %d rank %d: \"%s\" lacks \"%s\"", _i, r,
                          a.msg[r], mismatch_needles[_i][k]);
    }
}
END_TEST

/* ---- processes ------------------------------------------------------------------------ */

/* A small job: all-reduce, broadcast and a grouped ring shift, checked. Exit
 * codes tell the parent which check failed. */
static void proc_job(int rank, int n, void *arg) {
    int victim = arg ? *(int *)arg : -1;
    ncclConfig_t cfg = nb_config();
    ncclComm_t c = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&c, n, g_id, rank, &cfg);
    if (poll_for(c, r, 10000) != ncclSuccess) _exit(10);
    int64_t x[16], got[16];
    for (int i = 0; i < 16; i++) x[i] = (int64_t)(rank + 1) * (i + 1);
    int64_t *b = (int64_t *)dev_upload(x, sizeof x), *rb = (int64_t *)dev_alloc(sizeof x);
    if (poll_for(c, ncclAllReduce(b, rb, 16, ncclInt64, ncclSum, c, 0), 10000) != ncclSuccess) _exit(11);
    download(got, rb, sizeof got);
    for (int i = 0; i < 16; i++)
        if (got[i] != (int64_t)n * (n + 1) / 2 * (i + 1)) _exit(12);
    if (rank == victim) raise(SIGKILL); /* dies with the communicator alive */
    int64_t t0 = now_ms();
    r = ncclAllReduce(b, rb, 16, ncclInt64, ncclSum, c, 0);
    r = poll_for(c, r, 10000);
    if (victim >= 0) { /* the peers: a clear error, well before our own deadline */
        if (r != ncclRemoteError || !strstr(ncclGetLastError(NULL), "died") || now_ms() - t0 > 3000) _exit(20);
        ncclCommAbort(c);
        _exit(0);
    }
    if (r != ncclSuccess) _exit(13);
    if (poll_for(c, ncclBroadcast(b, rb, 16, ncclInt64, n - 1, c, 0), 10000) != ncclSuccess) _exit(14);
    download(got, rb, sizeof got);
    for (int i = 0; i < 16; i++)
        if (got[i] != (int64_t)n * (i + 1)) _exit(15);
    ncclGroupStart();
    ncclSend(b, 16, ncclInt64, (rank + 1) % n, c, 0);
    ncclRecv(rb, 16, ncclInt64, (rank + n - 1) % n, c, 0);
    if (poll_for(c, ncclGroupEnd(), 10000) != ncclSuccess) _exit(16);
    download(got, rb, sizeof got);
    for (int i = 0; i < 16; i++)
        if (got[i] != (int64_t)((rank + n - 1) % n + 1) * (i + 1)) _exit(17);
    if (poll_for(c, ncclCommFinalize(c), 10000) != ncclSuccess) _exit(18);
    ncclCommDestroy(c);
}

START_TEST(test_processes) {
    int st[MAXR], n = _i + 1;
    int ok = run_processes(n, proc_job, NULL, st);
    for (int r = 0; r < n; r++) ck_assert_msg(st[r] == 0, "process rank %d exited with %d", r, st[r]);
    ck_assert_int_eq(ok, n);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

START_TEST(test_process_dies) {
    int st[MAXR], victim = 1;
    run_processes(3, proc_job, &victim, st);
    ck_assert_int_eq(st[1], 128 + SIGKILL);
    ck_assert_msg(st[0] == 0 && st[2] == 0, "peers exited with %d and %d", st[0], st[2]);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* ---- blocking communicators, limits, argument checks ------------------------------------- */

typedef struct {
    ncclResult_t st[MAXR];
    char msg[MAXR][512];
    pthread_barrier_t held; /* ranks 1 and 2 record their errors before either aborts */
} block_arg;

static void rank_blocking(int rank, int n, void *p) {
    block_arg *a = (block_arg *)p;
    ncclComm_t c = NULL;
    ck_assert_int_eq(ncclCommInitRank(&c, n, g_id, rank), ncclSuccess);
    float *buf = (float *)dev_alloc(16);
    ck_assert_int_eq(ncclAllReduce(buf, buf, 4, ncclFloat32, ncclSum, c, 0), ncclSuccess);
    if (rank == 0) { /* never comes to the second all-reduce */
        sleep_ms(600);
    } else {
        a->st[rank] = ncclAllReduce(buf, buf, 4, ncclFloat32, ncclSum, c, 0);
        snprintf(a->msg[rank], sizeof a->msg[rank], "%s", ncclGetLastError(NULL));
        pthread_barrier_wait(&a->held);
    }
    ncclCommAbort(c);
    cudaFree(buf);
}

START_TEST(test_blocking_never_hangs) {
    setenv("NCCLSIM_TIMEOUT_MS", "300", 1);
    block_arg a = {};
    pthread_barrier_init(&a.held, NULL, 2);
    run_threads(3, rank_blocking, &a);
    pthread_barrier_destroy(&a.held);
    for (int r = 1; r < 3; r++) {
        ck_assert_int_eq(a.st[r], ncclSystemError);
        ck_assert_msg(strstr(a.msg[r], "NCCLSIM_TIMEOUT_MS"), "\"%s\"", a.msg[r]);
    }
    unsetenv("NCCLSIM_TIMEOUT_MS");
}
END_TEST

#define EXPECT_FAIL(call, want, needle)                                                                      \
    do {                                                                                                     \
        ncclResult_t r_ = (call);                                                                            \
        ck_assert_msg(r_ == (want), "%s -> %s, expected %s", #call, ncclGetErrorString(r_),                  \
                      ncclGetErrorString(want));                                                             \
        ck_assert_msg(strstr(ncclGetLastError(NULL), (needle)), "%s: \"%s\" lacks \"%s\"", #call,            \
                      ncclGetLastError(NULL), (needle));                                                     \
    } while (0)

START_TEST(test_bad_arguments) {
    ck_assert_int_eq(cudaSetDevice(0), cudaSuccess);
    ck_assert_int_eq(ncclGetUniqueId(&g_id), ncclSuccess);
    ncclComm_t c = init_nb(1, 0);
    float *dev = (float *)dev_alloc(64), host[16];
    ck_assert_int_eq(cudaSetDevice(1), cudaSuccess);
    float *other = (float *)dev_alloc(64);
    cudaStream_t dead, wrong_dev;
    ck_assert_int_eq(cudaStreamCreate(&wrong_dev), cudaSuccess);
    ck_assert_int_eq(cudaSetDevice(0), cudaSuccess);
    ck_assert_int_eq(cudaStreamCreate(&dead), cudaSuccess);
    ck_assert_int_eq(cudaStreamDestroy(dead), cudaSuccess);

    EXPECT_FAIL(ncclAllReduce(host, dev, 16, ncclFloat32, ncclSum, c, 0), ncclInvalidArgument, "not device memory");
    EXPECT_FAIL(ncclAllReduce(dev, dev, 17, ncclFloat32, ncclSum, c, 0), ncclInvalidArgument, "past the end");
    EXPECT_FAIL(ncclAllReduce(other, dev, 16, ncclFloat32, ncclSum, c, 0), ncclInvalidArgument, "device 1");
    EXPECT_FAIL(ncclAllReduce(dev, dev, 16, ncclFloat32, ncclSum, c, dead), ncclInvalidArgument, "not a live stream");
    EXPECT_FAIL(ncclAllReduce(dev, dev, 16, ncclFloat32, ncclSum, c, wrong_dev), ncclInvalidArgument,
                "stream is on device 1");
    EXPECT_FAIL(ncclAllReduce(dev, dev, 16, (ncclDataType_t)42, ncclSum, c, 0), ncclInvalidArgument, "datatype");
    EXPECT_FAIL(ncclAllReduce(dev, dev, 16, ncclFloat32, (ncclRedOp_t)42, c, 0), ncclInvalidArgument, "op");
    EXPECT_FAIL(ncclBroadcast(dev, dev, 16, ncclFloat32, 1, c, 0), ncclInvalidArgument, "root");
    EXPECT_FAIL(ncclSend(dev, 16, ncclFloat32, -1, c, 0), ncclInvalidArgument, "peer");
    EXPECT_FAIL(ncclAllReduce(dev, dev, 16, ncclFloat32, ncclSum, NULL, 0), ncclInvalidArgument, "comm");
    EXPECT_FAIL(ncclGroupEnd(), ncclInvalidUsage, "ncclGroupStart");
    /* a bad call inside a group fails there, and the group with it */
    ncclGroupStart();
    ck_assert_int_eq(ncclAllReduce(dev, dev, 16, ncclFloat32, ncclSum, c, 0), ncclSuccess);
    ck_assert_int_eq(ncclAllReduce(host, dev, 16, ncclFloat32, ncclSum, c, 0), ncclInvalidArgument);
    EXPECT_FAIL(ncclGroupEnd(), ncclInvalidArgument, "not device memory");
    NB_OK(c, ncclAllReduce(dev, dev, 16, ncclFloat32, ncclSum, c, 0)); /* still usable */
    /* configs */
    ncclConfig_t zero;
    memset(&zero, 0, sizeof zero);
    ncclComm_t c2 = NULL;
    EXPECT_FAIL(ncclCommInitRankConfig(&c2, 1, g_id, 0, &zero), ncclInvalidArgument, "NCCL_CONFIG_INITIALIZER");
    ncclConfig_t cfg = nb_config();
    EXPECT_FAIL(ncclCommInitRankConfig(&c2, 2, g_id, 2, &cfg), ncclInvalidArgument, "rank");
    EXPECT_FAIL(ncclCommInitRankConfig(NULL, 1, g_id, 0, &cfg), ncclInvalidArgument, "comm");
    ncclUniqueId junk;
    memset(&junk, 7, sizeof junk);
    EXPECT_FAIL(ncclCommInitRankConfig(&c2, 1, junk, 0, &cfg), ncclInvalidArgument, "ncclGetUniqueId");
    EXPECT_FAIL(ncclCommSplit(c, -5, 0, &c2, NULL), ncclInvalidArgument, "color");
    /* work on a communicator still being made */
    ncclUniqueId id2;
    ncclGetUniqueId(&id2);
    ck_assert_int_eq(ncclCommInitRankConfig(&c2, 2, id2, 0, &cfg), ncclInProgress);
    EXPECT_FAIL(ncclAllReduce(dev, dev, 16, ncclFloat32, ncclSum, c2, 0), ncclInvalidUsage, "in progress");
    ncclCommAbort(c2);
    cudaFree(dev);
    cudaFree(other);
    cudaStreamDestroy(wrong_dev);
    ncclCommDestroy(c);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* Issuing on a communicator whose last operation is still in progress. */
static void rank_busy(int rank, int n, void *arg) {
    (void)arg;
    ncclComm_t c = init_nb(n, rank);
    float *buf = (float *)dev_alloc(64);
    if (rank == 0) {
        ck_assert_int_eq(ncclAllReduce(buf, buf, 16, ncclFloat32, ncclSum, c, 0), ncclInProgress);
        EXPECT_FAIL(ncclAllReduce(buf, buf, 16, ncclFloat32, ncclSum, c, 0), ncclInvalidUsage, "in progress");
        sleep_ms(50);
    } else {
        sleep_ms(100);
    }
    NB_OK(c, rank == 0 ? ncclInProgress : ncclAllReduce(buf, buf, 16, ncclFloat32, ncclSum, c, 0));
    ncclCommDestroy(c);
    cudaFree(buf);
}

START_TEST(test_busy_communicator) { run_threads(2, rank_busy, NULL); }
END_TEST

static void rank_same_device(int rank, int n, void *arg) {
    (void)arg;
    ck_assert_int_eq(cudaSetDevice(0), cudaSuccess); /* both ranks on GPU 0 */
    ncclConfig_t cfg = nb_config();
    ncclComm_t c = NULL;
    ncclResult_t r = poll_for(c, ncclCommInitRankConfig(&c, n, g_id, rank, &cfg), 5000);
    ck_assert_int_eq(r, ncclInvalidUsage);
    ck_assert_msg(strstr(ncclGetLastError(NULL), "both use device 0"), "\"%s\"", ncclGetLastError(NULL));
    ncclCommAbort(c);
}

START_TEST(test_one_gpu_per_rank) { run_threads(2, rank_same_device, NULL); }
END_TEST

static void rank_area(int rank, int n, void *arg) {
    (void)arg;
    ncclComm_t c = init_nb(n, rank);
    size_t bytes = (size_t)2 << 20;
    void *buf = dev_alloc(bytes);
    EXPECT_FAIL(ncclAllReduce(buf, buf, bytes / 4, ncclFloat32, ncclSum, c, 0), ncclInvalidUsage, "NCCLSIM_AREA_MB");
    NB_OK(c, ncclAllReduce(buf, buf, 1000, ncclFloat32, ncclSum, c, 0)); /* smaller ones still work */
    ncclCommDestroy(c);
    cudaFree(buf);
}

START_TEST(test_area_limit) {
    setenv("NCCLSIM_AREA_MB", "1", 1);
    run_threads(2, rank_area, NULL);
    unsetenv("NCCLSIM_AREA_MB");
}
END_TEST

Suite *suite(void) {
    Suite *s = suite_create("ncclsim: the NCCL simulator");
    TCase *tc = tcase_create("collectives");
    tcase_add_loop_test(tc, test_collectives, 0, 4); /* 1..4 ranks */
    tcase_add_loop_test(tc, test_grouped_broadcasts, 0, 4);
    tcase_add_test(tc, test_stream_order);
    tcase_add_test(tc, test_inputs_read_at_stream_time);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    tc = tcase_create("semantics");
    tcase_add_loop_test(tc, test_init_waits_for_every_rank, 0, 2);
    tcase_add_loop_test(tc, test_init_rank_never_joins, 0, 2);
    tcase_add_loop_test(tc, test_ring_shift_in_group, 0, 3);
    tcase_add_loop_test(tc, test_ring_shift_outside_group_waits, 0, 3);
    tcase_add_test(tc, test_split_and_concurrent_comms);
    tcase_add_test(tc, test_busy_communicator);
    tcase_set_timeout(tc, 60);
    suite_add_tcase(s, tc);
    tc = tcase_create("failures");
    tcase_add_loop_test(tc, test_peer_abort_or_destroy, 0, 2);
    tcase_add_loop_test(tc, test_mismatch, 0, 6);
    tcase_add_test(tc, test_blocking_never_hangs);
    tcase_add_test(tc, test_bad_arguments);
    tcase_add_test(tc, test_one_gpu_per_rank);
    tcase_add_test(tc, test_area_limit);
    tcase_set_timeout(tc, 60);
    suite_add_tcase(s, tc);
    tc = tcase_create("processes");
    tcase_add_loop_test(tc, test_processes, 0, 4);
    tcase_add_test(tc, test_process_dies);
    tcase_set_timeout(tc, 60);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    /* The host-visible semantics below (a call in progress until its peers
     * join, errors returned by the polls) are those of work run at issue;
     * test_inputs_read_at_stream_time and the cpar suites under lazy and
     * random cover the deferred stream modes. */
    cudasim_set_streams(CUDASIM_STREAMS_EAGER, 0);
    return tu_run_suite(suite());
}
