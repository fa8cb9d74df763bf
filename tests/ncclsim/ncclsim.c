/* SPDX-License-Identifier: MIT */
/* tests/ncclsim/ncclsim.c — an NCCL simulator: the subset of NCCL's API that
 * cpar calls (tests/ncclsim/nccl.h), running on the CPU over the CUDA
 * simulator's device memory (tests/cudasim.h).
 *
 * It exists so that the code GPU users run — cpar.c built for the NCCL
 * backend — runs in `make test` on a machine without a GPU. It reproduces the
 * semantics cpar depends on, and checks the ones a real NCCL would punish with
 * a hang or garbage:
 *   - ranks are threads of one process or separate processes: every
 *     communicator is one POSIX shared-memory segment named by its unique id;
 *   - non-blocking communicators (config.blocking = 0): init, group ends
 *     and collectives return ncclInProgress until the host's part is done
 *     (under eager: the whole operation), and ncclCommGetAsyncError drives
 *     them; a split returns ncclSuccess while its parent is in progress and
 *     fills *newcomm when the parent's state leaves it, as NCCL does; a
 *     rank that never joins leaves the others in progress until the caller's
 *     own deadline;
 *   - ncclGroupStart/End defer every operation until the group ends, so a
 *     ring shift inside a group completes while the same sends outside a
 *     group wait for their receivers (and may deadlock, as on a GPU);
 *   - collectives are ordered per communicator; several communicators (split)
 *     progress independently;
 *   - ncclCommAbort, ncclCommDestroy with a peer still waiting, and a dead
 *     process make the peers' pending operations fail with ncclRemoteError;
 *     ranks that disagree on a collective (kind, count, type, op, root) or a
 *     send/receive pair (count, type) fail with ncclInvalidUsage naming both;
 *   - buffers must be live device memory of the communicator's device and
 *     streams live streams of that device (ncclInvalidArgument otherwise);
 *   - reductions add in rank order with fp32 accumulation for fp16/bf16, so
 *     integer results equal a single-threaded reference bit for bit.
 *
 * Execution model. Under the CUDA simulator's eager stream mode an operation
 * runs at issue: it stages its inputs, and the exchange happens from the
 * host, in the call or in the polls that finish it. Under the deferred modes
 * (lazy, random: tests/cudasim.h section 9) it runs in stream order, as on a
 * GPU: the call numbers the batch and returns (ncclSuccess: the host's part
 * is done), and a staging queued on its stream copies the inputs into the
 * rank's area when the stream reaches it, so a write that runs before then
 * (a missing fork, or a reuse of the buffer that a GPU would race with) is
 * what gets sent. A batch issued while the one before is in flight has that
 * one's staging run at once and waits behind it (the call is in progress
 * until it ends; the caller polls, as cpar does). Outputs land in a buffer of
 * the operation's own; a copy queued on its stream moves that to the output
 * buffer when the stream reaches it, so a consumer that misses its wait reads
 * the old bytes; a send's stream likewise waits for its receiver. A stream
 * that reaches an unfinished operation waits for it (the issuing thread
 * drives the communicator meanwhile; a synchronisation from elsewhere waits
 * until NCCLSIM_TIMEOUT_MS and fails the stream), but a query does not wait:
 * it reports the stream not ready, so the caller's deadline and failure
 * checks run, as on a GPU. After a failure or an abort the copy moves
 * nothing and the communicator reports the error. Every rank stages what it
 * sends in its own area of the segment, publishes a descriptor, and reads the
 * peers' areas; an operation completes for a rank once its output is written
 * and every peer has finished reading its area (so the area can be reused).
 * Waiting never blocks inside a non-blocking call: it is polling, with the
 * caller's deadline. A blocking communicator polls inside the call, up to
 * NCCLSIM_TIMEOUT_MS (default 300000), and then fails instead of hanging.
 *
 * Not modelled: performance, the real transports, multiple nodes,
 * ncclCommRegister, user-defined reduction ops, ncclCommShrink/Revoke.
 *
 * Environment: NCCLSIM_AREA_MB (staging bytes per rank and communicator,
 * default 512, at most 16 GiB per communicator), NCCLSIM_TIMEOUT_MS.
 *
 * Contents
 *   1. Utilities: time, errors, environment
 *   2. Data types and reductions
 *   3. The shared segment
 *   4. Communicator handles: create, join, free
 *   5. Enqueueing: argument checks, groups, posting a batch
 *   6. Progress: collectives, point-to-point, split, peer failures
 *   7. Public API */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "nccl.h"
#include "ncclsim_hooks.h"

#include <dirent.h>
#include <pthread.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2,
               "the shared segment needs lock-free atomics (they work across processes)");

#define NS_MAX_RANKS 256
#define NS_COLL_RING 512  /* collectives one group may hold */
#define NS_P2P_RING 32    /* sends one group may make to one peer */
#define NS_MSG_LEN 512
#define NS_ID_MAGIC "ncclsim"
#define NS_NAME_PREFIX "/ncclsim-" /* then the id maker's pid, "-" and the id's token */
#define NS_READY 0x6e63636c73696d31ull /* "ncclsim1" */

/* ==== 1. Utilities ======================================================== */

static int64_t ns_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void ns_pause(void) {
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
}

static int64_t ns_env_int(const char *name, int64_t dflt, int64_t lo, int64_t hi) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    long long x = strtoll(v, &end, 10);
    return (*end || x < lo || x > hi) ? dflt : (int64_t)x;
}

/* ncclGetLastError's line: per thread, as each rank polls its own handles. */
static _Thread_local char ns_last_error[NS_MSG_LEN];

static ncclResult_t ns_error(ncclResult_t r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ns_last_error, sizeof ns_last_error, fmt, ap);
    va_end(ap);
    return r;
}

/* ==== 2. Data types and reductions ======================================== */

static size_t ns_type_size(ncclDataType_t t) {
    static const size_t size[ncclNumTypes] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    return (unsigned)t < ncclNumTypes ? size[t] : 0;
}

static const char *ns_type_name(int t) {
    static const char *const names[ncclNumTypes] = {"ncclInt8",   "ncclUint8",   "ncclInt32",   "ncclUint32",
                                                    "ncclInt64",  "ncclUint64",  "ncclFloat16", "ncclFloat32",
                                                    "ncclFloat64", "ncclBfloat16"};
    return (unsigned)t < ncclNumTypes ? names[t] : "ncclDataType?";
}

static const char *ns_op_name(int op) {
    static const char *const names[ncclNumOps] = {"ncclSum", "ncclProd", "ncclMax", "ncclMin", "ncclAvg"};
    return (unsigned)op < ncclNumOps ? names[op] : "ncclRedOp?";
}

static float ns_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t ns_f32_to_f16(float f) { /* round to nearest even */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((ax >> 13) & 0x3ff));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* overflows to inf */
    if (ax < 0x38800000u) {                                  /* subnormal or zero */
        if (ax < 0x33000000u) return (uint16_t)sign;
        uint32_t e = ax >> 23, man = (ax & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t h = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((ax >> 13) - (112u << 10)), rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

static float ns_bf16_to_f32(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t ns_f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

/* dst[i] = srcs[0][i] op srcs[1][i] op ... in rank order, i < count.
 * Integers wrap (unsigned arithmetic); fp16/bf16 accumulate in fp32 and
 * round once; ncclAvg is the sum divided by nsrc. */
#define NS_COMBINE(acc, x, op)                                                                               \
    ((op) == ncclProd ? (acc) * (x) : (op) == ncclMax ? ((x) > (acc) ? (x) : (acc))                          \
                                      : (op) == ncclMin ? ((x) < (acc) ? (x) : (acc)) : (acc) + (x))
#define NS_REDUCE_INT(T, UT)                                                                                 \
    for (size_t i = 0; i < count; i++) {                                                                     \
        T acc = ((const T *)srcs[0])[i];                                                                     \
        for (int j = 1; j < nsrc; j++) {                                                                     \
            T x = ((const T *)srcs[j])[i];                                                                   \
            acc = (op == ncclSum || op == ncclAvg) ? (T)((UT)acc + (UT)x)                                    \
                  : op == ncclProd                 ? (T)((UT)acc * (UT)x)                                    \
                                                   : NS_COMBINE(acc, x, op);                                 \
        }                                                                                                    \
        ((T *)dst)[i] = op == ncclAvg ? (T)(acc / (T)nsrc) : acc;                                            \
    }
#define NS_REDUCE_FLOAT(T, ACC, LOAD, STORE)                                                                 \
    for (size_t i = 0; i < count; i++) {                                                                     \
        ACC acc = LOAD(((const T *)srcs[0])[i]);                                                             \
        for (int j = 1; j < nsrc; j++) {                                                                     \
            ACC x = LOAD(((const T *)srcs[j])[i]);                                                           \
            acc = op == ncclAvg ? acc + x : NS_COMBINE(acc, x, op);                                          \
        }                                                                                                    \
        ((T *)dst)[i] = STORE(op == ncclAvg ? acc / (ACC)nsrc : acc);                                        \
    }
#define NS_SAME(x) (x)

static void ns_reduce(void *dst, const void *const *srcs, int nsrc, size_t count, ncclDataType_t t, ncclRedOp_t op) {
    switch (t) {
    case ncclInt8: NS_REDUCE_INT(int8_t, uint8_t) break;
    case ncclUint8: NS_REDUCE_INT(uint8_t, uint8_t) break;
    case ncclInt32: NS_REDUCE_INT(int32_t, uint32_t) break;
    case ncclUint32: NS_REDUCE_INT(uint32_t, uint32_t) break;
    case ncclInt64: NS_REDUCE_INT(int64_t, uint64_t) break;
    case ncclUint64: NS_REDUCE_INT(uint64_t, uint64_t) break;
    case ncclFloat16: NS_REDUCE_FLOAT(uint16_t, float, ns_f16_to_f32, ns_f32_to_f16) break;
    case ncclFloat32: NS_REDUCE_FLOAT(float, float, NS_SAME, NS_SAME) break;
    case ncclFloat64: NS_REDUCE_FLOAT(double, double, NS_SAME, NS_SAME) break;
    case ncclBfloat16: NS_REDUCE_FLOAT(uint16_t, float, ns_bf16_to_f32, ns_f32_to_bf16) break;
    default: break;
    }
}

/* ==== 3. The shared segment ===============================================
 * One segment per communicator, named by its unique id's token:
 *   ns_shared | ns_member[nranks] | ns_chan[nranks * nranks] | areas
 * Rank 0 creates it; the others open it; it is unlinked as soon as every rank
 * has joined (or by the first rank that aborts), so a killed job leaves no
 * name behind once it has started. Every field another rank reads is an
 * atomic or is written before an atomic release that publishes it. */

enum { NS_ABSENT = 0, NS_JOINED, NS_LEFT, NS_ABORTED };

typedef enum {
    NS_ALLREDUCE, NS_BROADCAST, NS_REDUCE, NS_ALLGATHER, NS_REDUCESCATTER, NS_SPLIT, /* collectives */
    NS_SEND, NS_RECV
} ns_kind;

static const char *ns_kind_name(int k) {
    static const char *const names[] = {"ncclAllReduce", "ncclBroadcast", "ncclReduce",     "ncclAllGather",
                                        "ncclReduceScatter", "ncclCommSplit", "ncclSend", "ncclRecv"};
    return (unsigned)k <= NS_RECV ? names[k] : "?";
}

typedef struct ns_desc { /* one collective as a member posted it */
    int32_t kind, type, op, root;
    uint64_t count;
    uint64_t offset;     /* its staged data in the member's area */
    int32_t color, key;  /* NS_SPLIT */
} ns_desc;

typedef struct ns_msg { /* one send */
    uint64_t offset, count;
    int32_t type;
    _Atomic int32_t rejected; /* set by the receiver when count or type differ */
} ns_msg;

typedef struct ns_chan { /* sends from one rank to another, in order */
    _Atomic uint64_t posted, consumed;
    ns_msg msg[NS_P2P_RING];
} ns_chan;

typedef struct ns_member {
    _Atomic int32_t state;
    int32_t pid, device;
    char why[256];           /* an aborting member's own error, if it had one */
    _Atomic uint64_t posted; /* collectives posted (their descriptors are in desc) */
    _Atomic uint64_t done;   /* collectives whose inputs this member has finished reading */
    ns_desc desc[NS_COLL_RING];
} ns_member;

typedef struct ns_shared {
    _Atomic uint64_t ready;
    uint64_t token, area_bytes, areas_offset;
    int32_t nranks;
    _Atomic int32_t joined, unlinked, aborted_by;
} ns_shared;

static size_t ns_align(size_t x, size_t a) { return (x + a - 1) / a * a; }

static size_t ns_members_offset(void) { return ns_align(sizeof(ns_shared), 64); }
static size_t ns_chans_offset(int n) { return ns_align(ns_members_offset() + (size_t)n * sizeof(ns_member), 64); }
static size_t ns_areas_offset(int n) { return ns_align(ns_chans_offset(n) + (size_t)n * (size_t)n * sizeof(ns_chan), 4096); }

static ns_member *ns_member_at(ns_shared *sh, int r) {
    return (ns_member *)((char *)sh + ns_members_offset()) + r;
}
static ns_chan *ns_chan_at(ns_shared *sh, int from, int to) {
    return (ns_chan *)((char *)sh + ns_chans_offset(sh->nranks)) + (size_t)from * (size_t)sh->nranks + (size_t)to;
}
static unsigned char *ns_area_at(ns_shared *sh, int r) {
    return (unsigned char *)sh + sh->areas_offset + (size_t)r * sh->area_bytes;
}

static size_t ns_area_bytes_for(int n) {
    size_t want = (size_t)ns_env_int("NCCLSIM_AREA_MB", 512, 1, 1 << 20) << 20, cap = ((size_t)16 << 30) / (size_t)n;
    return ns_align(want < cap ? want : cap, 4096);
}

/* ==== 4. Communicator handles ============================================= */

/* Where an operation's output lands in stream order (see the execution
 * model): the operation writes buf; when its stream reaches it, a queued copy
 * moves buf to dst. Shared by the communicator (until the operation ends)
 * and the queued copy (until the simulator drops it, after it ran): the last
 * of the two frees it. */
struct ns_landing {
    void *dst, *buf;
    size_t bytes;
    ncclComm_t comm;  /* valid while state is PENDING */
    pthread_t thread; /* the issuing thread: only it drives the communicator */
    atomic_int state; /* NCCLSIM_LAND_PENDING, _DONE or _FAILED */
    atomic_int refs;
};

/* A batch's inputs, staged when its stream reaches the batch (see the
 * execution model): shared by the communicator (until the batch ends) and
 * the queued staging (until the simulator drops it, after it ran); the last
 * of the two frees it. */
struct ns_stage {
    pthread_mutex_t mu; /* held while staging, and by the communicator to let go */
    ncclComm_t comm;    /* NULL once the communicator let go (the batch ended or failed) */
    atomic_int posted;  /* the batch has its numbers and area (it may wait behind the one before) */
    atomic_int refs;
    pthread_t thread;    /* the issuing thread: only it drives the communicator */
    cudaStream_t stream; /* where the staging is queued, and its place there */
    uint64_t seq;
};

typedef struct ns_op {
    ncclComm_t comm;
    cudaStream_t stream;
    ns_landing *land; /* NULL: no output, or not yet staged */
    ns_kind kind;
    ncclDataType_t type;
    ncclRedOp_t op;
    int peer; /* root, or the peer of a send/receive */
    const void *sendbuff;
    void *recvbuff;
    size_t count;
    uint64_t seq;    /* collective number, or the message's number on its channel */
    uint64_t offset; /* staged data in this rank's area */
    int color, key;  /* NS_SPLIT */
    bool child_blocking;
    bool done;
} ns_op;

struct ncclComm {
    int rank, nranks, device;
    bool blocking;
    uint64_t token;
    int32_t owner; /* the pid that made the unique id: part of the name (ncclsim_leftover_segments) */
    char name[48];
    int fd;
    ns_shared *sh;
    size_t map_bytes;
    size_t area_bytes, area_reserved;
    ncclResult_t state; /* ncclInProgress while something is pending; an error sticks */
    char msg[NS_MSG_LEN];
    bool init_pending, finalized;
    bool slot_taken;         /* this handle holds member[rank] of the segment */
    uint64_t colls;          /* collectives posted */
    uint64_t *sent, *taken;  /* [nranks] sends posted to / receives matched from each peer */
    ns_op *ops;              /* the pending batch */
    int nops;
    bool device_batch;       /* it was issued to a stream: the host need not wait for it */
    ns_stage *stage;         /* its staging (deferred stream modes), or NULL */
    ns_op *next;             /* a batch issued while that one is in flight, posted when it ends */
    int nnext;
    ns_stage *next_stage;
    uint64_t last_coll;      /* the batch's last collective, 0 if none */
    ncclComm_t child;        /* a split in progress: the new communicator (NULL: no color) */
    ncclComm_t *split_out;
    int64_t next_pid_check_us;
};

/* A failure that sticks to the communicator: every later poll reports it. */
static ncclResult_t ns_progress(ncclComm_t c);

void ncclsim_land_release(ns_landing *l) {
    if (atomic_fetch_sub_explicit(&l->refs, 1, memory_order_acq_rel) == 1) {
        free(l->buf);
        free(l);
    }
}
int ncclsim_land_state(ns_landing *l) { return atomic_load_explicit(&l->state, memory_order_acquire); }
/* On the issuing thread (the communicator's user), one pass of progress; 0 elsewhere. */
int ncclsim_land_drive(ns_landing *l) {
    if (!pthread_equal(l->thread, pthread_self()) || ncclsim_land_state(l) != NCCLSIM_LAND_PENDING) return 0;
    ns_progress(l->comm);
    return 1;
}
void ncclsim_land_parts(ns_landing *l, void **dst, const void **buf, size_t *bytes) {
    *dst = l->dst;
    *buf = l->buf;
    *bytes = l->bytes;
}

/* The communicator lets go of an operation's landing: DONE (its output is
 * in buf) or FAILED (the queued copy moves nothing). */
static void ns_land_end(ns_op *op, int state) {
    if (!op->land) return;
    atomic_store_explicit(&op->land->state, state, memory_order_release);
    ncclsim_land_release(op->land);
    op->land = NULL;
}
static void ns_stage_let_go(ns_stage **pst);
/* Every operation the communicator holds (the pending batch and the one
 * waiting behind it) fails; their queued stagings do nothing. */
static void ns_land_end_all(ncclComm_t c, int state) {
    for (int i = 0; i < c->nops; i++) ns_land_end(&c->ops[i], state);
    for (int i = 0; i < c->nnext; i++) ns_land_end(&c->next[i], state);
    ns_stage_let_go(&c->stage);
    ns_stage_let_go(&c->next_stage);
}

static ncclResult_t ns_comm_fail(ncclComm_t c, ncclResult_t r, const char *fmt, ...) {
    ns_land_end_all(c, NCCLSIM_LAND_FAILED);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->msg, sizeof c->msg, fmt, ap);
    va_end(ap);
    snprintf(ns_last_error, sizeof ns_last_error, "%s", c->msg);
    c->state = r;
    return r;
}

static uint64_t ns_mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static ncclComm_t ns_comm_new(uint64_t token, int32_t owner, int nranks, int rank, int device, bool blocking) {
    ncclComm_t c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->sent = calloc((size_t)nranks, sizeof *c->sent);
    c->taken = calloc((size_t)nranks, sizeof *c->taken);
    if (!c->sent || !c->taken) {
        free(c->sent);
        free(c->taken);
        free(c);
        return NULL;
    }
    c->token = token;
    c->owner = owner;
    c->nranks = nranks;
    c->rank = rank;
    c->device = device;
    c->blocking = blocking;
    c->fd = -1;
    c->area_bytes = ns_area_bytes_for(nranks);
    c->state = ncclInProgress;
    c->init_pending = true;
    snprintf(c->name, sizeof c->name, NS_NAME_PREFIX "%" PRId32 "-%016" PRIx64, owner, token);
    return c;
}

static void ns_unlink_once(ncclComm_t c) {
    int zero = 0;
    if (c->sh && atomic_compare_exchange_strong(&c->sh->unlinked, &zero, 1)) shm_unlink(c->name);
}

/* Leave the segment as state (NS_LEFT or NS_ABORTED) and free the handle. */
static void ns_comm_free(ncclComm_t c, int state) {
    if (!c) return;
    if (c->child) ns_comm_free(c->child, NS_ABORTED);
    if (c->sh) {
        if (c->slot_taken) {
            ns_member *m = ns_member_at(c->sh, c->rank);
            if (state == NS_ABORTED) {
                /* Say why, so the peers can name the cause and not only us. */
                const char *why = c->state != ncclSuccess && c->state != ncclInProgress ? c->msg : "";
                snprintf(m->why, sizeof m->why, "%.*s", (int)sizeof m->why - 1, why);
                int none = -1;
                atomic_compare_exchange_strong(&c->sh->aborted_by, &none, c->rank);
            }
            int joined = NS_JOINED;
            atomic_compare_exchange_strong(&m->state, &joined, state);
        }
        /* The creator's name must not outlive a job that never completed its start. */
        if (state == NS_ABORTED || c->init_pending) ns_unlink_once(c);
        munmap(c->sh, c->map_bytes);
    } else if (c->rank == 0 && c->fd >= 0) {
        shm_unlink(c->name);
    }
    if (c->fd >= 0) close(c->fd);
    ns_land_end_all(c, NCCLSIM_LAND_FAILED);
    free(c->ops);
    free(c->next);
    free(c->sent);
    free(c->taken);
    free(c);
}

static ncclResult_t ns_map(ncclComm_t c, size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, c->fd, 0);
    if (p == MAP_FAILED)
        return ns_comm_fail(c, ncclSystemError, "ncclsim: cannot map %s (%zu bytes): %s", c->name, bytes, strerror(errno));
    c->sh = p;
    c->map_bytes = bytes;
    return ncclSuccess;
}

/* One attempt to attach to the segment (rank 0 creates it); then, once every
 * rank has joined, the communicator is ready. */
static ncclResult_t ns_try_join(ncclComm_t c) {
    size_t total = ns_areas_offset(c->nranks) + (size_t)c->nranks * c->area_bytes;
    if (!c->sh && c->rank == 0) {
        c->fd = shm_open(c->name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (c->fd < 0)
            return ns_comm_fail(c, errno == EEXIST ? ncclInvalidUsage : ncclSystemError,
                                "ncclsim: rank 0 cannot create %s: %s (was this unique id used twice?)", c->name,
                                strerror(errno));
        if (ftruncate(c->fd, (off_t)total) != 0)
            return ns_comm_fail(c, ncclSystemError, "ncclsim: cannot size %s to %zu bytes: %s", c->name, total,
                                strerror(errno));
        if (ns_map(c, total) != ncclSuccess) return c->state;
        c->sh->token = c->token;
        c->sh->area_bytes = c->area_bytes;
        c->sh->areas_offset = ns_areas_offset(c->nranks);
        c->sh->nranks = c->nranks;
        atomic_store(&c->sh->aborted_by, -1);
        atomic_store_explicit(&c->sh->ready, NS_READY, memory_order_release);
    } else if (!c->sh) {
        if (c->fd < 0) c->fd = shm_open(c->name, O_RDWR, 0600);
        if (c->fd < 0) {
            if (errno == ENOENT) return ncclInProgress; /* rank 0 has not created it yet */
            return ns_comm_fail(c, ncclSystemError, "ncclsim: cannot open %s: %s", c->name, strerror(errno));
        }
        struct stat st;
        if (fstat(c->fd, &st) != 0 || (size_t)st.st_size < sizeof(ns_shared)) return ncclInProgress;
        ns_shared *head = mmap(NULL, sizeof(ns_shared), PROT_READ, MAP_SHARED, c->fd, 0);
        if (head == MAP_FAILED)
            return ns_comm_fail(c, ncclSystemError, "ncclsim: cannot map %s: %s", c->name, strerror(errno));
        bool ready = atomic_load_explicit(&head->ready, memory_order_acquire) == NS_READY;
        int32_t n = head->nranks;
        uint64_t area = head->area_bytes;
        munmap(head, sizeof(ns_shared));
        if (!ready) return ncclInProgress;
        if (n != c->nranks)
            return ns_comm_fail(c, ncclInvalidUsage, "ncclsim: rank %d was given nranks %d, rank 0 created the "
                                "communicator with nranks %d", c->rank, c->nranks, (int)n);
        if (area != c->area_bytes)
            return ns_comm_fail(c, ncclInvalidUsage, "ncclsim: NCCLSIM_AREA_MB differs between rank 0 and rank %d",
                                c->rank);
        if (ns_map(c, total) != ncclSuccess) return c->state;
    }
    ns_shared *sh = c->sh;
    ns_member *me = ns_member_at(sh, c->rank);
    if (!c->slot_taken) {
        /* Claim the slot first, then fill it: peers read pid and device only
         * after counting every rank in. */
        int absent = NS_ABSENT;
        if (!atomic_compare_exchange_strong(&me->state, &absent, NS_JOINED))
            return ns_comm_fail(c, ncclInvalidUsage, "ncclsim: two ranks joined %s as rank %d (pids %d and %d)",
                                c->name, c->rank, (int)me->pid, (int)getpid());
        c->slot_taken = true;
        me->pid = (int32_t)getpid();
        me->device = c->device;
        atomic_fetch_add(&sh->joined, 1);
    }
    if (atomic_load(&sh->joined) < c->nranks) {
        if (atomic_load(&sh->aborted_by) < 0) return ncclInProgress;
        return ns_comm_fail(c, ncclRemoteError, "ncclsim: rank %d aborted the communicator during its start",
                            (int)atomic_load(&sh->aborted_by));
    }
    /* Once every rank is in, each reaches the same verdict below; an abort
     * from now on shows in the first operation. */
    /* Every rank is in: one GPU per rank of a process, as NCCL requires. */
    for (int r = 0; r < c->nranks; r++) {
        ns_member *m = ns_member_at(sh, r);
        if (r != c->rank && m->pid == me->pid && m->device == me->device)
            return ns_comm_fail(c, ncclInvalidUsage, "ncclsim: ranks %d and %d of one process both use device %d",
                                r < c->rank ? r : c->rank, r < c->rank ? c->rank : r, c->device);
    }
    ns_unlink_once(c);
    c->init_pending = false;
    c->state = ncclSuccess;
    return ncclSuccess;
}

/* Make the first `bytes` of this rank's area real memory, so a full
 * /dev/shm is an error here rather than a SIGBUS in a copy. */
static ncclResult_t ns_area_reserve(ncclComm_t c, size_t bytes) {
    if (bytes <= c->area_reserved) return ncclSuccess;
    if (bytes > c->area_bytes)
        return ns_error(ncclInvalidUsage, "ncclsim: one group stages %zu bytes on rank %d, more than the %zu of its "
                        "area (raise NCCLSIM_AREA_MB)", bytes, c->rank, c->area_bytes);
    size_t want = ns_align(bytes, (size_t)1 << 20);
    if (want > c->area_bytes) want = c->area_bytes;
    off_t at = (off_t)(c->sh->areas_offset + (size_t)c->rank * c->area_bytes);
    int e = posix_fallocate(c->fd, at, (off_t)want);
    if (e) return ns_error(ncclSystemError, "ncclsim: cannot stage %zu bytes in /dev/shm: %s", want, strerror(e));
    c->area_reserved = want;
    return ncclSuccess;
}

/* ==== 5. Enqueueing ======================================================= */

/* Operations of the current group (thread-local, as in NCCL). */
static _Thread_local struct {
    int depth;
    ns_op *ops;
    int n, cap;
    ncclResult_t err;
} ns_group;

static ncclResult_t ns_check_comm(const char *fn, ncclComm_t c) {
    if (!c) return ns_error(ncclInvalidArgument, "%s: comm is NULL", fn);
    if (c->state != ncclSuccess && c->state != ncclInProgress) {
        snprintf(ns_last_error, sizeof ns_last_error, "%s", c->msg);
        return c->state;
    }
    if (c->init_pending)
        return ns_error(ncclInvalidUsage, "%s: the communicator's initialisation is still in progress (poll "
                        "ncclCommGetAsyncError until ncclSuccess first)", fn);
    if (c->finalized) return ns_error(ncclInvalidUsage, "%s: the communicator was finalized", fn);
    return ncclSuccess;
}

static ncclResult_t ns_check_buffer(const char *fn, ncclComm_t c, const char *name, const void *p, size_t bytes) {
    if (!bytes) return ncclSuccess;
    int dev = -1;
    size_t alloc = 0, off = 0;
    switch (ncclsim_dev_buffer(p, bytes, &dev, &alloc, &off)) {
    case NCCLSIM_BUF_NOT_DEVICE:
        return ns_error(ncclInvalidArgument, "%s: %s=%p is not device memory (no live cudaMalloc holds it)", fn, name, p);
    case NCCLSIM_BUF_PAST_END:
        return ns_error(ncclInvalidArgument, "%s: %s=%p + %zu bytes runs past the end of its allocation (%zu bytes, "
                        "offset %zu)", fn, name, p, bytes, alloc, off);
    default: break;
    }
    if (dev != c->device)
        return ns_error(ncclInvalidArgument, "%s: %s is on device %d, the communicator's device is %d", fn, name, dev,
                        c->device);
    return ncclSuccess;
}

/* A non-blocking communicator takes one operation (or group) at a time:
 * the caller polls ncclCommGetAsyncError until ncclSuccess in between. (A
 * batch issued to a stream in a deferred stream mode is the host's business
 * no longer once it is posted: the next may be issued behind it.) */
static bool ns_busy(ncclComm_t c) { return c->state == ncclInProgress || (c->nops && !c->device_batch); }
static ncclResult_t ns_busy_error(const char *fn) {
    return ns_error(ncclInvalidUsage, "%s: issued while an earlier operation on the communicator is in progress "
                    "(poll ncclCommGetAsyncError until ncclSuccess first)", fn);
}

/* Checks one operation and adds it to the group (an implicit group of one
 * outside ncclGroupStart/End). */
static ncclResult_t ns_submit(ns_op *ops, int n);

static ncclResult_t ns_enqueue(const char *fn, const ns_op *op, cudaStream_t stream) {
    ncclComm_t c = op->comm;
    ncclResult_t r = ns_check_comm(fn, c);
    if (r == ncclSuccess && !ns_type_size(op->type))
        r = ns_error(ncclInvalidArgument, "%s: datatype is %d, expected an ncclDataType_t", fn, (int)op->type);
    if (r == ncclSuccess && (unsigned)op->op >= ncclNumOps)
        r = ns_error(ncclInvalidArgument, "%s: op is %d, expected an ncclRedOp_t", fn, (int)op->op);
    if (r == ncclSuccess && (op->peer < 0 || op->peer >= c->nranks))
        r = ns_error(ncclInvalidArgument, "%s: %s is %d, expected 0..%d", fn,
                     op->kind == NS_SEND || op->kind == NS_RECV ? "peer" : "root", op->peer, c->nranks - 1);
    if (r == ncclSuccess) {
        int sdev = -1;
        if (!ncclsim_dev_stream(stream, &sdev))
            r = ns_error(ncclInvalidArgument, "%s: stream %p is not a live stream", fn, (void *)stream);
        else if (sdev >= 0 && sdev != c->device)
            r = ns_error(ncclInvalidArgument, "%s: stream is on device %d, the communicator's device is %d", fn, sdev,
                         c->device);
    }
    if (r == ncclSuccess) {
        size_t es = ns_type_size(op->type), n = (size_t)c->nranks, cnt = op->count, in = 0, out = 0;
        bool root = c->rank == op->peer;
        switch (op->kind) {
        case NS_ALLREDUCE: in = out = cnt; break;
        case NS_BROADCAST: in = root ? cnt : 0; out = cnt; break;
        case NS_REDUCE: in = cnt; out = root ? cnt : 0; break;
        case NS_ALLGATHER: in = cnt; out = cnt * n; break;
        case NS_REDUCESCATTER: in = cnt * n; out = cnt; break;
        case NS_SEND: in = cnt; break;
        case NS_RECV: out = cnt; break;
        default: break;
        }
        r = ns_check_buffer(fn, c, "sendbuff", op->sendbuff, in * es);
        if (r == ncclSuccess) r = ns_check_buffer(fn, c, "recvbuff", op->recvbuff, out * es);
    }
    if (r == ncclSuccess && ns_busy(c)) r = ns_busy_error(fn);
    if (ns_group.depth == 0) {
        if (r != ncclSuccess) return r;
        ns_op one = *op;
        one.stream = stream;
        return ns_submit(&one, 1);
    }
    if (r != ncclSuccess) { /* NCCL reports it here and again from ncclGroupEnd */
        if (ns_group.err == ncclSuccess) ns_group.err = r;
        return r;
    }
    if (ns_group.n == ns_group.cap) {
        int cap = ns_group.cap ? 2 * ns_group.cap : 16;
        ns_op *p = realloc(ns_group.ops, (size_t)cap * sizeof *p);
        if (!p) {
            ns_group.err = ncclSystemError;
            return ns_error(ncclSystemError, "%s: out of memory", fn);
        }
        ns_group.ops = p;
        ns_group.cap = cap;
    }
    ns_group.ops[ns_group.n] = *op;
    ns_group.ops[ns_group.n++].stream = stream;
    return ncclSuccess;
}

/* Bytes this rank stages for op. */
static size_t ns_staged_bytes(ncclComm_t c, const ns_op *op) {
    size_t es = ns_type_size(op->type), cnt = op->count;
    switch (op->kind) {
    case NS_ALLREDUCE: case NS_REDUCE: case NS_ALLGATHER: case NS_SEND: return cnt * es;
    case NS_BROADCAST: return c->rank == op->peer ? cnt * es : 0;
    case NS_REDUCESCATTER: return cnt * (size_t)c->nranks * es;
    default: return 0;
    }
}

/* Give c's operations their numbers, descriptors and places in its area
 * (the batch is then c's pending one). Their inputs are staged and
 * published by ns_stage_inputs: at once, or when their stream reaches them. */
static ncclResult_t ns_reserve(ncclComm_t c, const ns_op *ops, int n, bool device_batch) {
    size_t total = 0;
    int colls = 0, *to_peer = calloc((size_t)c->nranks, sizeof(int));
    if (!to_peer) return ns_error(ncclSystemError, "ncclsim: out of memory");
    for (int i = 0; i < n; i++) {
        total += ns_align(ns_staged_bytes(c, &ops[i]), 64);
        if (ops[i].kind <= NS_SPLIT) colls++;
        if (ops[i].kind == NS_SEND) to_peer[ops[i].peer]++;
    }
    int busiest = 0;
    for (int p = 0; p < c->nranks; p++) busiest = to_peer[p] > busiest ? to_peer[p] : busiest;
    free(to_peer);
    if (colls > NS_COLL_RING || busiest > NS_P2P_RING)
        return ns_error(ncclInvalidUsage, "ncclsim: a group holds %d collectives and %d sends to one peer; the "
                        "simulator takes at most %d and %d", colls, busiest, NS_COLL_RING, NS_P2P_RING);
    ncclResult_t r = ns_area_reserve(c, total);
    if (r != ncclSuccess) return r;
    c->ops = malloc((size_t)n * sizeof *c->ops);
    if (!c->ops) return ns_error(ncclSystemError, "ncclsim: out of memory");
    memcpy(c->ops, ops, (size_t)n * sizeof *ops);
    c->nops = n;
    c->device_batch = device_batch;
    c->last_coll = 0;
    ns_member *me = ns_member_at(c->sh, c->rank);
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        ns_op *op = &c->ops[i];
        op->offset = at;
        op->done = false;
        at += ns_align(ns_staged_bytes(c, op), 64);
        if (op->kind <= NS_SPLIT) {
            op->seq = ++c->colls;
            c->last_coll = op->seq;
            ns_desc *d = &me->desc[op->seq % NS_COLL_RING];
            *d = (ns_desc){.kind = op->kind, .type = op->type, .op = op->op, .root = op->peer,
                           .count = op->count, .offset = op->offset};
            d->color = op->color;
            d->key = op->key;
        } else if (op->kind == NS_SEND) {
            ns_chan *ch = ns_chan_at(c->sh, c->rank, op->peer);
            op->seq = c->sent[op->peer]++;
            ns_msg *m = &ch->msg[op->seq % NS_P2P_RING];
            m->offset = op->offset;
            m->count = op->count;
            m->type = op->type;
            atomic_store(&m->rejected, 0);
        } else {
            op->seq = c->taken[op->peer]++;
        }
    }
    if (!device_batch) c->state = ncclInProgress;
    return ncclSuccess;
}

/* Copy the pending batch's inputs into c's area and publish them to the
 * peers: the moment the operations read their send buffers. */
static void ns_stage_inputs(ncclComm_t c) {
    unsigned char *area = ns_area_at(c->sh, c->rank);
    for (int i = 0; i < c->nops; i++) {
        const ns_op *op = &c->ops[i];
        size_t bytes = ns_staged_bytes(c, op);
        if (bytes) memcpy(area + op->offset, op->sendbuff, bytes);
        if (op->kind == NS_SEND)
            atomic_store_explicit(&ns_chan_at(c->sh, c->rank, op->peer)->posted, op->seq + 1, memory_order_release);
    }
    if (c->last_coll) atomic_store_explicit(&ns_member_at(c->sh, c->rank)->posted, c->last_coll, memory_order_release);
}

/* Post and stage at once (eager stream mode, and calls without a stream). */
static ncclResult_t ns_post(ncclComm_t c, const ns_op *ops, int n) {
    if (ns_busy(c)) return ns_busy_error(ns_kind_name(ops[0].kind));
    ncclResult_t r = ns_reserve(c, ops, n, false);
    if (r == ncclSuccess) ns_stage_inputs(c);
    return r;
}

void ncclsim_stage_release(ns_stage *st) {
    if (atomic_fetch_sub_explicit(&st->refs, 1, memory_order_acq_rel) == 1) {
        pthread_mutex_destroy(&st->mu);
        free(st);
    }
}

/* The communicator lets go of a staging: a queued staging that has not run
 * yet then does nothing (the batch ended without needing it, or failed). */
static void ns_stage_let_go(ns_stage **pst) {
    ns_stage *st = *pst;
    if (!st) return;
    *pst = NULL;
    pthread_mutex_lock(&st->mu);
    st->comm = NULL;
    pthread_mutex_unlock(&st->mu);
    ncclsim_stage_release(st);
}

int ncclsim_stage_ready(ns_stage *st) {
    pthread_mutex_lock(&st->mu);
    ncclComm_t c = st->comm;
    int posted = atomic_load(&st->posted);
    pthread_mutex_unlock(&st->mu);
    if (!c || posted) return 1;
    if (pthread_equal(st->thread, pthread_self())) ns_progress(c); /* only this thread frees c */
    return atomic_load(&st->posted);
}

void ncclsim_stage_run(ns_stage *st) {
    int64_t limit = ns_env_int("NCCLSIM_TIMEOUT_MS", 300000, 1, INT32_MAX), until = ns_now_us() + limit * 1000;
    pthread_mutex_lock(&st->mu);
    /* A batch behind another is posted by the issuing thread's polls (this
     * thread's own, when it is that thread). */
    while (st->comm && !atomic_load(&st->posted) && ns_now_us() < until) {
        ncclComm_t c = st->comm;
        pthread_mutex_unlock(&st->mu);
        if (pthread_equal(st->thread, pthread_self())) ns_progress(c);
        else ns_pause();
        pthread_mutex_lock(&st->mu);
    }
    if (st->comm && atomic_load(&st->posted)) ns_stage_inputs(st->comm);
    pthread_mutex_unlock(&st->mu);
}

/* Run the pending device batch's staging on this thread (its stream's work
 * before it first). */
static void ns_stage_force(ncclComm_t c) {
    if (c->stage) ncclsim_dev_stream_force(c->stage->stream, c->stage->seq);
}

/* ==== 6. Progress ========================================================= */

static bool ns_pid_dead(int32_t pid) {
    if (pid <= 0 || pid == (int32_t)getpid()) return false;
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return true;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = 0;
    const char *close_paren = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return close_paren && (close_paren[2] == 'Z' || close_paren[2] == 'X');
}

/* What this rank waits in, for messages: "ncclAllReduce #5", "ncclSend to rank 2". */
static const char *ns_op_what(const ns_op *op, uint64_t seq, char *buf, size_t cap) {
    if (!op) snprintf(buf, cap, "collective #%" PRIu64, seq);
    else if (op->kind == NS_SEND || op->kind == NS_RECV)
        snprintf(buf, cap, "%s %s rank %d", ns_kind_name(op->kind), op->kind == NS_SEND ? "to" : "from", op->peer);
    else snprintf(buf, cap, "%s #%" PRIu64, ns_kind_name(op->kind), op->seq);
    return buf;
}

/* Fails c if the communicator is aborted or member m is gone (destroyed its
 * handle, or its process died) while this rank waits for it in op (NULL:
 * for it to finish reading collective #seq), the wait being for m's counter
 * *progress to reach need. The caller read that counter before calling; m
 * publishes its progress before it leaves, so a departure seen here is
 * checked against a second read: m may have done its part (taken our send,
 * say), finished and left in between, and then it is not to blame. */
static ncclResult_t ns_check_member(ncclComm_t c, int m, const ns_op *op, uint64_t seq, bool check_pid,
                                    const _Atomic uint64_t *progress, uint64_t need) {
    ns_shared *sh = c->sh;
    int who = atomic_load(&sh->aborted_by);
    char what[96];
    if (who >= 0) {
        const char *why = ns_member_at(sh, who)->why;
        return ns_comm_fail(c, ncclRemoteError, "ncclsim: rank %d aborted the communicator (ncclCommAbort)%s%s%s "
                            "while rank %d's %s was pending", who, *why ? " after: \"" : "", why, *why ? "\"" : "",
                            c->rank, ns_op_what(op, seq, what, sizeof what));
    }
    ns_member *mem = ns_member_at(sh, m);
    bool left = atomic_load(&mem->state) == NS_LEFT, died = !left && check_pid && ns_pid_dead(mem->pid);
    if ((!left && !died) || atomic_load(progress) >= need) return ncclSuccess;
    if (left)
        return ns_comm_fail(c, ncclRemoteError, "ncclsim: rank %d destroyed its communicator while rank %d's %s "
                            "was pending", m, c->rank, ns_op_what(op, seq, what, sizeof what));
    return ns_comm_fail(c, ncclRemoteError, "ncclsim: rank %d (pid %d) died while rank %d's %s was pending", m,
                            (int)mem->pid, c->rank, ns_op_what(op, seq, what, sizeof what));
    return ncclSuccess;
}

static void ns_describe(const ns_desc *d, int nranks, char *buf, size_t cap) {
    switch (d->kind) {
    case NS_SPLIT: snprintf(buf, cap, "ncclCommSplit"); break;
    case NS_ALLGATHER:
        snprintf(buf, cap, "ncclAllGather(sendcount %" PRIu64 ", %s)", d->count, ns_type_name(d->type));
        break;
    case NS_REDUCESCATTER:
        snprintf(buf, cap, "ncclReduceScatter(recvcount %" PRIu64 ", %s, %s)", d->count, ns_type_name(d->type),
                 ns_op_name(d->op));
        break;
    case NS_BROADCAST:
        snprintf(buf, cap, "ncclBroadcast(count %" PRIu64 ", %s, root %d)", d->count, ns_type_name(d->type), d->root);
        break;
    case NS_REDUCE:
        snprintf(buf, cap, "ncclReduce(count %" PRIu64 ", %s, %s, root %d)", d->count, ns_type_name(d->type),
                 ns_op_name(d->op), d->root);
        break;
    default:
        snprintf(buf, cap, "ncclAllReduce(count %" PRIu64 ", %s, %s)", d->count, ns_type_name(d->type),
                 ns_op_name(d->op));
        break;
    }
    (void)nranks;
}

static bool ns_desc_agree(const ns_desc *a, const ns_desc *b) {
    if (a->kind != b->kind) return false;
    if (a->kind == NS_SPLIT) return true;
    bool reduces = a->kind == NS_ALLREDUCE || a->kind == NS_REDUCE || a->kind == NS_REDUCESCATTER;
    bool rooted = a->kind == NS_BROADCAST || a->kind == NS_REDUCE;
    return a->type == b->type && a->count == b->count && (!reduces || a->op == b->op) && (!rooted || a->root == b->root);
}

/* Run collective op once every member has posted it: check agreement, then
 * compute this rank's output from the members' staged inputs. */
static ncclResult_t ns_run_collective(ncclComm_t c, ns_op *op) {
    ns_shared *sh = c->sh;
    int n = c->nranks;
    const ns_desc *mine = &ns_member_at(sh, c->rank)->desc[op->seq % NS_COLL_RING];
    const ns_desc *d0 = &ns_member_at(sh, 0)->desc[op->seq % NS_COLL_RING];
    for (int m = 1; m < n; m++) {
        const ns_desc *dm = &ns_member_at(sh, m)->desc[op->seq % NS_COLL_RING];
        if (!ns_desc_agree(d0, dm)) {
            char a[160], b[160];
            ns_describe(d0, n, a, sizeof a);
            ns_describe(dm, n, b, sizeof b);
            return ns_comm_fail(c, ncclInvalidUsage, "ncclsim: the ranks disagree on collective #%" PRIu64 ": rank 0 "
                                "called %s, rank %d called %s", op->seq, a, m, b);
        }
    }
    size_t es = ns_type_size(op->type), cnt = op->count, bytes = cnt * es;
    const void *srcs[NS_MAX_RANKS];
    for (int m = 0; m < n; m++) srcs[m] = ns_area_at(sh, m) + ns_member_at(sh, m)->desc[op->seq % NS_COLL_RING].offset;
    switch (op->kind) {
    case NS_ALLREDUCE: ns_reduce(op->recvbuff, srcs, n, cnt, op->type, op->op); break;
    case NS_REDUCE:
        if (c->rank == op->peer) ns_reduce(op->recvbuff, srcs, n, cnt, op->type, op->op);
        break;
    case NS_REDUCESCATTER:
        for (int m = 0; m < n; m++) srcs[m] = (const char *)srcs[m] + (size_t)c->rank * bytes;
        ns_reduce(op->recvbuff, srcs, n, cnt, op->type, op->op);
        break;
    case NS_BROADCAST:
        if (bytes) memcpy(op->recvbuff, srcs[op->peer], bytes);
        break;
    case NS_ALLGATHER:
        for (int m = 0; m < n; m++)
            if (bytes) memcpy((char *)op->recvbuff + (size_t)m * bytes, srcs[m], bytes);
        break;
    case NS_SPLIT: {
        /* Members of my color ordered by (key, parent rank); the new
         * communicator's name comes from the parent's token, the split's
         * number and the color, so every member derives the same one. */
        if (mine->color == NCCL_SPLIT_NOCOLOR) break;
        int size = 0, rank = 0;
        for (int m = 0; m < n; m++) {
            const ns_desc *dm = &ns_member_at(sh, m)->desc[op->seq % NS_COLL_RING];
            if (dm->color != mine->color) continue;
            size++;
            if (dm->key < mine->key || (dm->key == mine->key && m < c->rank)) rank++;
        }
        uint64_t token = ns_mix(c->token ^ ns_mix(op->seq * 0x100000001b3ull + (uint64_t)(uint32_t)mine->color));
        c->child = ns_comm_new(token, c->owner, size, rank, c->device, op->child_blocking);
        if (!c->child) return ns_comm_fail(c, ncclSystemError, "ncclCommSplit: out of memory");
        break;
    }
    default: break;
    }
    return ncclSuccess;
}

/* What the host sees while the pending batch is unfinished: in progress,
 * unless the batch went to a stream (then only a batch waiting behind it
 * keeps the host's call in progress). */
static ncclResult_t ns_unfinished(ncclComm_t c) { return c->device_batch ? c->state : ncclInProgress; }

static ncclResult_t ns_post_next(ncclComm_t c);

/* One pass over c's pending work. */
static ncclResult_t ns_progress(ncclComm_t c) {
    if (c->state != ncclInProgress && c->state != ncclSuccess) return c->state;
    if (c->init_pending) return ns_try_join(c);
    if (!c->nops) return c->state;
    ns_shared *sh = c->sh;
    int n = c->nranks;
    bool all_done = true, coll_blocked = false, check_pid = false;
    int64_t now = ns_now_us();
    if (now >= c->next_pid_check_us) {
        check_pid = true;
        c->next_pid_check_us = now + 20000;
    }
    for (int i = 0; i < c->nops; i++) {
        ns_op *op = &c->ops[i];
        if (op->done) continue;
        if (op->kind <= NS_SPLIT) {
            if (coll_blocked) { all_done = false; continue; }
            bool posted = true;
            for (int m = 0; m < n && posted; m++)
                posted = atomic_load_explicit(&ns_member_at(sh, m)->posted, memory_order_acquire) >= op->seq;
            if (!posted) {
                for (int m = 0; m < n; m++)
                    if (atomic_load(&ns_member_at(sh, m)->posted) < op->seq &&
                        ns_check_member(c, m, op, 0, check_pid, &ns_member_at(sh, m)->posted, op->seq) != ncclSuccess)
                        return c->state;
                coll_blocked = true;
                all_done = false;
                continue;
            }
            if (ns_run_collective(c, op) != ncclSuccess) return c->state;
            atomic_store_explicit(&ns_member_at(sh, c->rank)->done, op->seq, memory_order_release);
            op->done = true;
        } else if (op->kind == NS_SEND) {
            ns_chan *ch = ns_chan_at(sh, c->rank, op->peer);
            if (atomic_load_explicit(&ch->consumed, memory_order_acquire) > op->seq) {
                if (atomic_load(&ch->msg[op->seq % NS_P2P_RING].rejected))
                    return ns_comm_fail(c, ncclInvalidUsage, "ncclsim: rank %d's ncclSend(count %zu, %s) does not "
                                        "match rank %d's ncclRecv", c->rank, op->count, ns_type_name(op->type), op->peer);
                op->done = true;
            } else {
                if (ns_check_member(c, op->peer, op, 0, check_pid, &ch->consumed, op->seq + 1) != ncclSuccess)
                    return c->state;
                all_done = false;
            }
        } else { /* NS_RECV: in order per peer */
            bool earlier = false;
            for (int j = 0; j < i && !earlier; j++)
                earlier = !c->ops[j].done && c->ops[j].kind == NS_RECV && c->ops[j].peer == op->peer;
            ns_chan *ch = ns_chan_at(sh, op->peer, c->rank);
            if (earlier || atomic_load_explicit(&ch->posted, memory_order_acquire) <= op->seq) {
                /* An earlier receive from the same peer waits for it first. */
                if (!earlier && ns_check_member(c, op->peer, op, 0, check_pid, &ch->posted, op->seq + 1) != ncclSuccess)
                    return c->state;
                all_done = false;
                continue;
            }
            ns_msg *m = &ch->msg[op->seq % NS_P2P_RING];
            if (m->count != op->count || m->type != (int32_t)op->type) {
                atomic_store(&m->rejected, 1);
                atomic_store_explicit(&ch->consumed, op->seq + 1, memory_order_release);
                return ns_comm_fail(c, ncclInvalidUsage, "ncclsim: rank %d sent ncclSend(count %" PRIu64 ", %s), "
                                    "rank %d posted ncclRecv(count %zu, %s)", op->peer, m->count,
                                    ns_type_name(m->type), c->rank, op->count, ns_type_name(op->type));
            }
            size_t bytes = op->count * ns_type_size(op->type);
            if (bytes) memcpy(op->recvbuff, ns_area_at(sh, op->peer) + m->offset, bytes);
            atomic_store_explicit(&ch->consumed, op->seq + 1, memory_order_release);
            op->done = true;
        }
    }
    if (!all_done) return ns_unfinished(c);
    /* My area is free again once every member has read it. */
    if (c->last_coll) {
        for (int m = 0; m < n; m++) {
            if (atomic_load_explicit(&ns_member_at(sh, m)->done, memory_order_acquire) >= c->last_coll) continue;
            if (ns_check_member(c, m, NULL, c->last_coll, check_pid, &ns_member_at(sh, m)->done, c->last_coll) !=
                ncclSuccess)
                return c->state;
            return ns_unfinished(c);
        }
    }
    if (c->child) { /* a split: done when the new communicator is */
        ncclResult_t r = ns_progress(c->child);
        if (r == ncclInProgress) return r;
        if (r != ncclSuccess) {
            ncclResult_t cr = ns_comm_fail(c, r, "%s", c->child->msg);
            ns_comm_free(c->child, NS_ABORTED);
            c->child = NULL;
            return cr;
        }
    }
    if (c->split_out) *c->split_out = c->child;
    c->split_out = NULL;
    c->child = NULL;
    for (int i = 0; i < c->nops; i++) ns_land_end(&c->ops[i], NCCLSIM_LAND_DONE);
    ns_stage_let_go(&c->stage);
    free(c->ops);
    c->ops = NULL;
    c->nops = 0;
    c->device_batch = false;
    c->last_coll = 0;
    c->state = ncclSuccess;
    return c->next ? ns_post_next(c) : ncclSuccess;
}

/* The batch that waited behind the one that just ended becomes the pending
 * one; its queued staging may now run. */
static ncclResult_t ns_post_next(ncclComm_t c) {
    ns_op *ops = c->next;
    int n = c->nnext;
    c->next = NULL;
    c->nnext = 0;
    c->stage = c->next_stage;
    c->next_stage = NULL;
    ncclResult_t r = ns_reserve(c, ops, n, true);
    if (r != ncclSuccess) {
        for (int i = 0; i < n; i++) ns_land_end(&ops[i], NCCLSIM_LAND_FAILED);
        free(ops);
        return ns_comm_fail(c, r, "%s", ns_last_error);
    }
    free(ops);
    atomic_store(&c->stage->posted, 1);
    return ncclSuccess;
}

/* Progress for a little while: most operations finish within the call. */
static ncclResult_t ns_settle(ncclComm_t c) {
    int64_t until = ns_now_us() + 100;
    while (ns_progress(c) == ncclInProgress && ns_now_us() <= until) sched_yield();
    return c->state;
}

/* A blocking communicator waits inside the call, but never forever. */
static ncclResult_t ns_wait(ncclComm_t c) {
    int64_t limit = ns_env_int("NCCLSIM_TIMEOUT_MS", 300000, 1, INT32_MAX), until = ns_now_us() + limit * 1000;
    while (ns_progress(c) == ncclInProgress) {
        if (ns_now_us() > until)
            return ns_comm_fail(c, ncclSystemError, "ncclsim: a blocking call is still in progress after %lld ms "
                                "(NCCLSIM_TIMEOUT_MS); a real NCCL would hang here", (long long)limit);
        ns_pause();
    }
    return c->state;
}

static void ns_land_drop(ns_op *ops, int n);

/* Output bytes of op on this rank. */
static size_t ns_out_bytes(ncclComm_t c, const ns_op *op) {
    size_t es = ns_type_size(op->type), cnt = op->count;
    switch (op->kind) {
    case NS_ALLREDUCE: case NS_BROADCAST: case NS_REDUCESCATTER: case NS_RECV: return cnt * es;
    case NS_REDUCE: return c->rank == op->peer ? cnt * es : 0;
    case NS_ALLGATHER: return cnt * es * (size_t)c->nranks;
    default: return 0;
    }
}

/* Points each output of ops at a landing buffer of its own (not when the
 * CUDA simulator runs stream work at issue: the output is written at once). */
static ncclResult_t ns_land_prepare(ncclComm_t c, ns_op *ops, int n) {
    bool deferred = ncclsim_dev_streams_deferred();
    for (int i = 0; i < n; i++) {
        size_t bytes = ns_out_bytes(c, &ops[i]);
        ops[i].land = NULL;
        /* A send lands nothing, but its stream waits for it to end (for its
         * receiver), as a GPU's does. */
        if (!deferred || (!bytes && ops[i].kind != NS_SEND)) continue;
        ns_landing *l = malloc(sizeof *l);
        void *buf = bytes ? malloc(bytes) : NULL;
        if (!l || (bytes && !buf)) {
            free(l);
            free(buf);
            ns_land_drop(ops, i);
            return ns_error(ncclSystemError, "ncclsim: out of memory");
        }
        l->dst = ops[i].recvbuff;
        l->buf = buf;
        l->comm = c;
        l->thread = pthread_self();
        l->bytes = bytes;
        atomic_init(&l->state, NCCLSIM_LAND_PENDING);
        atomic_init(&l->refs, 2);
        ops[i].land = l;
        ops[i].recvbuff = buf;
    }
    return ncclSuccess;
}
/* The landings of ops that were never posted. */
static void ns_land_drop(ns_op *ops, int n) {
    for (int i = 0; i < n; i++)
        if (ops[i].land) {
            free(ops[i].land->buf);
            free(ops[i].land);
            ops[i].land = NULL;
        }
}

/* A batch issued to a stream in a deferred stream mode: numbered now (or,
 * behind a batch still in flight, when that one ends), staged when its
 * stream reaches it. The batch before has its staging run now, on this
 * thread, so the wait behind it is for the peers alone. */
static ncclResult_t ns_post_deferred(ncclComm_t c, ns_op *ops, int n) {
    if (ns_busy(c)) return ns_busy_error(ns_kind_name(ops[0].kind));
    /* One staging per batch, on its first operation's stream: the work
     * queued on the others runs now. */
    for (int i = 1; i < n; i++)
        if (ops[i].stream != ops[0].stream) ncclsim_dev_stream_flush(ops[i].stream);
    if (c->nops) {
        ns_stage_force(c);
        ncclResult_t r = ns_progress(c);
        if (r != ncclSuccess) return r;
    }
    const bool behind = c->nops != 0; /* waits for the batch in flight */
    ns_stage *st = calloc(1, sizeof *st);
    ns_op *next = behind ? malloc((size_t)n * sizeof *ops) : NULL;
    ncclResult_t r = !st || (behind && !next) ? ns_error(ncclSystemError, "ncclsim: out of memory")
                     : behind                 ? ncclSuccess
                                              : ns_reserve(c, ops, n, true);
    if (r != ncclSuccess) {
        free(st);
        free(next);
        return r;
    }
    pthread_mutex_init(&st->mu, NULL);
    st->comm = c;
    st->thread = pthread_self();
    atomic_init(&st->refs, 2);
    atomic_init(&st->posted, !behind);
    if (behind) {
        memcpy(next, ops, (size_t)n * sizeof *ops);
        c->next = next;
        c->nnext = n;
        c->next_stage = st;
        c->state = ncclInProgress; /* the host polls until the batch before ends */
    } else {
        c->stage = st;
    }
    st->seq = ncclsim_dev_stream_stage(ops[0].stream, st, c->next_stage == st, &st->stream);
    return c->state;
}

/* A call without a stream (split, finalize) first lets the pending device
 * batch end: its staging runs now, then the peers are waited for, up to
 * NCCLSIM_TIMEOUT_MS. */
static ncclResult_t ns_drain(ncclComm_t c) {
    if (!c->device_batch) return c->state;
    int64_t limit = ns_env_int("NCCLSIM_TIMEOUT_MS", 300000, 1, INT32_MAX), until = ns_now_us() + limit * 1000;
    while (c->nops && c->device_batch) {
        ns_stage_force(c);
        ncclResult_t r = ns_progress(c);
        if (r != ncclSuccess && r != ncclInProgress) return r;
        if (!c->nops) break;
        if (ns_now_us() > until)
            return ns_comm_fail(c, ncclSystemError, "ncclsim: operations issued to a stream are still in progress "
                                "after %lld ms (NCCLSIM_TIMEOUT_MS)", (long long)limit);
        ns_pause();
    }
    return c->state;
}

/* Post every communicator's share of ops, in order of first appearance. */
static ncclResult_t ns_submit(ns_op *ops, int n) {
    bool deferred = ncclsim_dev_streams_deferred();
    ncclResult_t first = ncclSuccess;
    bool pending = false;
    int nland = 0;
    ns_op *mine = malloc((size_t)n * sizeof *mine), *land = malloc((size_t)n * sizeof *land);
    if (!mine || !land) {
        free(mine);
        free(land);
        return ns_error(ncclSystemError, "ncclsim: out of memory");
    }
    for (int i = 0; i < n; i++) {
        ncclComm_t c = ops[i].comm;
        bool seen = false;
        for (int j = 0; j < i && !seen; j++) seen = ops[j].comm == c;
        if (seen) continue;
        int k = 0;
        for (int j = i; j < n; j++)
            if (ops[j].comm == c) mine[k++] = ops[j];
        ncclResult_t r = ns_land_prepare(c, mine, k);
        if (r == ncclSuccess) r = deferred ? ns_post_deferred(c, mine, k) : ns_post(c, mine, k);
        if (r != ncclSuccess && r != ncclInProgress) ns_land_drop(mine, k);
        else
            for (int j = 0; j < k; j++)
                if (mine[j].land) land[nland++] = mine[j];
        if (r == ncclSuccess && !deferred) r = c->blocking ? ns_wait(c) : ns_settle(c);
        else if (r == ncclInProgress && c->blocking) r = ns_wait(c);
        if (r == ncclInProgress) pending = true;
        else if (r != ncclSuccess && first == ncclSuccess) first = r;
    }
    /* Every communicator of the group posted: the outputs' landings go on
     * their streams (eager runs them now, finishing the operations). */
    for (int j = 0; j < nland; j++) ncclsim_dev_stream_land(land[j].stream, land[j].land);
    free(land);
    free(mine);
    return first != ncclSuccess ? first : pending ? ncclInProgress : ncclSuccess;
}

/* ==== 7. Public API ======================================================= */

ncclResult_t ncclGetVersion(int *version) {
    if (!version) return ns_error(ncclInvalidArgument, "ncclGetVersion: version is NULL");
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (!id) return ns_error(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
    static _Atomic uint64_t counter;
    uint64_t token = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &token, sizeof token) != (ssize_t)sizeof token) token = 0;
        close(fd);
    }
    token ^= ns_mix((uint64_t)ns_now_us() ^ ((uint64_t)getpid() << 32) ^ atomic_fetch_add(&counter, 1));
    memset(id, 0, sizeof *id);
    memcpy(id->internal, NS_ID_MAGIC, sizeof NS_ID_MAGIC);
    memcpy(id->internal + 8, &token, sizeof token);
    int32_t owner = (int32_t)getpid();
    memcpy(id->internal + 16, &owner, sizeof owner);
    return ncclSuccess;
}

/* When this process started (the program's load): a segment older than
 * that is no leftover of its own. */
static struct timespec ns_process_start;
__attribute__((constructor)) static void ns_note_start(void) { clock_gettime(CLOCK_REALTIME, &ns_process_start); }

/* A segment is a leftover when its id's maker is this process, or has ended
 * after this process started (a job it ran): a live process's segments are a
 * job in progress (another suite's, when suites run side by side), and an
 * older one's were left by an earlier run (killed, or halted by a
 * sanitizer), not by this one. */
int ncclsim_leftover_segments(void) {
    DIR *d = opendir("/dev/shm");
    if (!d) return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        long pid;
        if (sscanf(e->d_name, "ncclsim-%ld-", &pid) != 1) continue;
        if (pid == (long)getpid()) {
            n++;
            continue;
        }
        char path[300];
        struct stat st;
        snprintf(path, sizeof path, "/dev/shm/%s", e->d_name);
        /* a second's margin: files' times come from a coarse clock, a tick behind */
        const bool older = stat(path, &st) == 0 && st.st_ctim.tv_sec < ns_process_start.tv_sec - 1;
        if (!older && kill((pid_t)pid, 0) != 0 && errno == ESRCH) n++;
    }
    closedir(d);
    return n;
}

static ncclResult_t ns_read_config(const char *fn, const ncclConfig_t *cfg, bool dflt, bool *blocking) {
    *blocking = dflt;
    if (!cfg) return ncclSuccess;
    if (cfg->size != sizeof(ncclConfig_t) || cfg->magic != NCCLSIM_CONFIG_MAGIC || cfg->version != NCCL_VERSION_CODE)
        return ns_error(ncclInvalidArgument, "%s: config was not initialised with NCCL_CONFIG_INITIALIZER", fn);
    if (cfg->blocking != NCCL_CONFIG_UNDEF_INT) {
        if (cfg->blocking != 0 && cfg->blocking != 1)
            return ns_error(ncclInvalidArgument, "%s: config.blocking is %d, expected 0 or 1", fn, cfg->blocking);
        *blocking = cfg->blocking == 1;
    }
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config) {
    static const char fn[] = "ncclCommInitRankConfig";
    if (!comm) return ns_error(ncclInvalidArgument, "%s: comm is NULL", fn);
    *comm = NULL;
    if (nranks < 1 || nranks > NS_MAX_RANKS)
        return ns_error(ncclInvalidArgument, "%s: nranks is %d, expected 1..%d", fn, nranks, NS_MAX_RANKS);
    if (rank < 0 || rank >= nranks)
        return ns_error(ncclInvalidArgument, "%s: rank is %d, expected 0..%d", fn, rank, nranks - 1);
    if (memcmp(id.internal, NS_ID_MAGIC, sizeof NS_ID_MAGIC))
        return ns_error(ncclInvalidArgument, "%s: commId did not come from ncclGetUniqueId", fn);
    bool blocking;
    ncclResult_t r = ns_read_config(fn, config, true, &blocking);
    if (r != ncclSuccess) return r;
    int dev = ncclsim_dev_current();
    if (dev < 0) return ns_error(ncclUnhandledCudaError, "%s: no CUDA device is current (cudaGetDevice failed)", fn);
    uint64_t token;
    int32_t owner;
    memcpy(&token, id.internal + 8, sizeof token);
    memcpy(&owner, id.internal + 16, sizeof owner);
    ncclComm_t c = ns_comm_new(token, owner, nranks, rank, dev, blocking);
    if (!c) return ns_error(ncclSystemError, "%s: out of memory", fn);
    *comm = c;
    r = blocking ? ns_wait(c) : ns_settle(c);
    return r;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    return ncclCommInitRankConfig(comm, nranks, id, rank, NULL);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
    static const char fn[] = "ncclCommSplit";
    ncclResult_t r = ns_check_comm(fn, comm);
    if (r != ncclSuccess) return r;
    if (!newcomm) return ns_error(ncclInvalidArgument, "%s: newcomm is NULL", fn);
    *newcomm = NULL;
    if (color < NCCL_SPLIT_NOCOLOR)
        return ns_error(ncclInvalidArgument, "%s: color is %d, expected >= 0 or NCCL_SPLIT_NOCOLOR", fn, color);
    if (ns_group.depth) return ns_error(ncclInvalidUsage, "%s: the simulator does not split inside a group", fn);
    bool blocking;
    r = ns_read_config(fn, config, comm->blocking, &blocking);
    if (r != ncclSuccess) return r;
    /* A collective on the parent whose descriptor carries color and key. */
    ns_op op = {.comm = comm, .kind = NS_SPLIT, .type = ncclUint8, .color = color, .key = key,
                .child_blocking = blocking};
    r = ns_drain(comm);
    if (r == ncclSuccess) r = ns_post(comm, &op, 1);
    if (r != ncclSuccess) return r;
    comm->split_out = newcomm;
    if (comm->blocking) return ns_wait(comm);
    /* As NCCL 2.28 does: a non-blocking split returns ncclSuccess while the
     * parent is still in progress (the call returns its own result, not its
     * group's), and *newcomm stays NULL until the parent's state leaves
     * ncclInProgress. A caller that trusts the return value finds no
     * communicator, and its next call on the parent fails ("Attempt to use
     * communicator before the previous operation returned ncclSuccess"):
     * seen on an H200, 2026-11-28. NCCL runs the split on a thread even
     * for one rank, so nothing is settled here: the polls do it. */
    return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    if (!comm) return ns_error(ncclInvalidArgument, "ncclCommFinalize: comm is NULL");
    if (comm->state != ncclSuccess && comm->state != ncclInProgress) {
        snprintf(ns_last_error, sizeof ns_last_error, "%s", comm->msg);
        return comm->state;
    }
    ncclResult_t r = ns_drain(comm);
    if (r != ncclSuccess) return r;
    comm->finalized = true; /* nothing of ours is in flight once pending work completes */
    return comm->blocking ? ns_wait(comm) : ns_settle(comm);
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ns_error(ncclInvalidArgument, "ncclCommDestroy: comm is NULL");
    /* Pending work that can never finish now: the peers see an abort. */
    ns_comm_free(comm, comm->state == ncclSuccess ? NS_LEFT : NS_ABORTED);
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    ns_comm_free(comm, NS_ABORTED);
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    if (!comm || !asyncError) return ns_error(ncclInvalidArgument, "ncclCommGetAsyncError: %s is NULL",
                                              comm ? "asyncError" : "comm");
    *asyncError = ns_progress(comm);
    if (*asyncError != ncclSuccess && *asyncError != ncclInProgress)
        snprintf(ns_last_error, sizeof ns_last_error, "%s", comm->msg);
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    if (!comm || !count) return ns_error(ncclInvalidArgument, "ncclCommCount: %s is NULL", comm ? "count" : "comm");
    *count = comm->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    if (!comm || !rank) return ns_error(ncclInvalidArgument, "ncclCommUserRank: %s is NULL", comm ? "rank" : "comm");
    *rank = comm->rank;
    return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
    if (!comm || !device) return ns_error(ncclInvalidArgument, "ncclCommCuDevice: %s is NULL", comm ? "device" : "comm");
    *device = comm->device;
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

/* As in NCCL, comm is not used: the line is the calling thread's last. */
const char *ncclGetLastError(ncclComm_t comm) {
    (void)comm;
    return ns_last_error;
}

ncclResult_t ncclGroupStart(void) {
    if (ns_group.depth == 0) {
        ns_group.n = 0;
        ns_group.err = ncclSuccess;
    }
    ns_group.depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
    if (ns_group.depth == 0) return ns_error(ncclInvalidUsage, "ncclGroupEnd: not inside ncclGroupStart");
    if (--ns_group.depth) return ncclSuccess;
    ncclResult_t r = ns_group.err;
    if (r == ncclSuccess && ns_group.n) r = ns_submit(ns_group.ops, ns_group.n);
    else if (r != ncclSuccess) { /* NCCL drops the whole group */
        char first[NS_MSG_LEN];
        snprintf(first, sizeof first, "%s", ns_last_error);
        ns_error(r, "ncclGroupEnd: an operation of the group failed: %s", first);
    }
    free(ns_group.ops);
    ns_group.ops = NULL;
    ns_group.n = ns_group.cap = 0;
    return r;
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
    ns_op o = {.comm = comm, .kind = NS_ALLREDUCE, .type = datatype, .op = op, .sendbuff = sendbuff,
               .recvbuff = recvbuff, .count = count};
    return ns_enqueue("ncclAllReduce", &o, stream);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    ns_op o = {.comm = comm, .kind = NS_BROADCAST, .type = datatype, .peer = root, .sendbuff = sendbuff,
               .recvbuff = recvbuff, .count = count};
    return ns_enqueue("ncclBroadcast", &o, stream);
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
    ns_op o = {.comm = comm, .kind = NS_REDUCE, .type = datatype, .op = op, .peer = root, .sendbuff = sendbuff,
               .recvbuff = recvbuff, .count = count};
    return ns_enqueue("ncclReduce", &o, stream);
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
    ns_op o = {.comm = comm, .kind = NS_ALLGATHER, .type = datatype, .sendbuff = sendbuff, .recvbuff = recvbuff,
               .count = sendcount};
    return ns_enqueue("ncclAllGather", &o, stream);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    ns_op o = {.comm = comm, .kind = NS_REDUCESCATTER, .type = datatype, .op = op, .sendbuff = sendbuff,
               .recvbuff = recvbuff, .count = recvcount};
    return ns_enqueue("ncclReduceScatter", &o, stream);
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    ns_op o = {.comm = comm, .kind = NS_SEND, .type = datatype, .peer = peer, .sendbuff = sendbuff, .count = count};
    return ns_enqueue("ncclSend", &o, stream);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    ns_op o = {.comm = comm, .kind = NS_RECV, .type = datatype, .peer = peer, .recvbuff = recvbuff, .count = count};
    return ns_enqueue("ncclRecv", &o, stream);
}
