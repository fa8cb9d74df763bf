/* SPDX-License-Identifier: MIT */
/* cpar.c — the amalgamated host implementation of cpar (pure C11).
 *
 * Device work goes through the cpar_dev_* layer (cpar.h §16, cpar_kernels.cu);
 * this file never includes a CUDA header. NCCL calls live behind
 * CPAR_WITH_NCCL. Build flags:
 *   (none)                          host-only build: host backend
 *   -DCPAR_WITH_DEVICE -DCPAR_SIM   sim build: + device backend on the CUDA simulator (kernels on the CPU)
 *   -DCPAR_WITH_DEVICE -DCPAR_WITH_NCCL   CUDA build: + NCCL and device backends
 *
 * Table of contents (later sections call earlier ones, never the reverse)
 *    1. Platform and utilities      time, random bytes, logging, aligned host memory, the shared host arena
 *    2. Errors                      status names, last-error lines, argument checks
 *    3. Data types and tensors      dtype table, fp16/bf16 bits, tensor helpers
 *    4. Device dispatch             host-only device layer, workspace, copies, stream waits
 *    5. Host reference kernels      vector blocks, expf, row max/scale/softmax-gradient, streaming copy,
 *                                   GEMM (CPAR_HOST_THREADS pool); fill, cast, axpby, reduce, gelu (+ table)
 *    6. Element-wise and layout ops cpar_fill/cast/axpby/split/concat/row_reduce/gelu
 *    7. Rendezvous store and env    launch environment, TCP key-value store (job token, limits), join
 *    8. Host backend                rendezvous with deadlines; every rank moves its share of a collective;
 *                                   the members' calls compared (call tags); a call refused by its own checks
 *                                   releases the peers; ranks as processes: shared-memory segments, futex waits,
 *                                   dead-peer checks, peers' arenas mapped and read in place
 *    9. NCCL backend                communicators, async-error polling, abort; a call refused by its own
 *                                   checks releases the peers (job or store), an abort's cause reaches
 *                                   other processes (store); CPAR_CHECK_CALLS compares calls
 *   10. Groups                      world group, split, destroy, statistics
 *   11. Collectives                 argument checks, byte accounting, dispatch
 *   12. Contexts and start-up       spawn, init_from_env, finalize, abort, sync
 *   13. Grid                        Megatron's tp/cp/dp/pp groups
 *   14. Mappings and utilities      region mappings, vocab ranges, views, broadcast_data
 *   15. RNG, dropout, checkpointing Philox tracker, random fills, dropout, recompute
 *   16. Embedding, cross entropy    vocab-parallel embedding and loss
 *   17. Linear layers               column/row-parallel linear, init, fwd/bwd, wgrad deferral and drain
 *   18. Local attention             flash-style attention fwd/bwd with dropout, host reference, blocks
 *   19. Ring attention, sharding    cp_shard/unshard (plain, packed), CP attention fwd/bwd (all_gather, p2p,
 *                                   a2a, a2a+p2p; the hierarchical groups), the LSE merge
 *   20. Mamba context parallelism   cp2hp/hp2cp, load balancing, pre/post conv_ssm (plain, packed), conv1d
 *   21. Inference layers            RMSNorm fwd/bwd, inference column/row linear, fused rs+add+norm+ag
 *   22. Training                    AdamW step, gradient norm and clipping, coalesced gradient all-reduce
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#define CPAR_INTERNAL /* the device layer's declarations (cpar.h §16) */
#include "cpar.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#if defined(CPAR_WITH_DEVICE) && !defined(CPAR_SIM) && !defined(CPAR_WITH_NCCL)
#define CPAR_WITH_NCCL 1
#endif
#ifdef CPAR_WITH_NCCL
#include <nccl.h>
#endif
#ifdef CPAR_WITH_CBLAS
#include <cblas.h>
#undef I /* OpenBLAS's header pulls in <complex.h>, whose I would shadow cpar's names */
#endif
/* x86-64 intrinsics: the host GEMM's AVX2 micro-kernel and attention's exp
 * (chosen at run time), streaming stores, the spin-wait pause. -DCPAR_PORTABLE
 * builds plain C alone, what other CPUs run (make test runs it too). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(CPAR_PORTABLE)
#include <immintrin.h>
#define CPAR__X86_KERNELS 1
#endif

#define CPAR_ERR_LEN 512
#define CPAR_ALIGN 64
#define CPAR_DEFAULT_TIMEOUT_MS 300000
#define CPAR__TAG_LEN 96 /* a collective's caller description: "cpar_all_to_all_sp2hp(fwd, bf16)" */

/* Runtime objects shared by the sections below (their behaviour lives in
 * sections 8-13; they are defined here so every section can read them). */
typedef struct cpar__job cpar__job;     /* host/device: shared state of one cpar_spawn */
typedef struct cpar__hcomm cpar__hcomm; /* host/device: shared state of one group */
typedef struct cpar__pcomm cpar__pcomm; /* host, ranks as processes: one group's shared-memory segment */

struct cpar_group {
    cpar_ctx *ctx;
    int rank, size;
    int *world_ranks;     /* [size], world rank of each group rank */
    cpar__hcomm *hc;      /* host and device backends, ranks as threads */
    cpar__pcomm *pc;      /* host backend, ranks as processes (cpar_init_from_env) */
#ifdef CPAR_WITH_NCCL
    ncclComm_t nccl;
#endif
    /* NCCL: batches (collectives, send/recv groups) enqueued on this group
     * by this rank, and its calls that failed their own checks, the two
     * positions cpar__nccl_give_up publishes and cpar__nccl_gave_up_check
     * compares; uid names the group alike on every member (the world 1, a
     * split child from its parent, the parent's split count and the color) */
    uint64_t seq, gave_ups, uid;
    uint32_t nsplits;
    int64_t *splits;      /* [2*size] all-to-all split scratch, so no call allocates */
    cpar_comm_stats stats;
    /* hierarchical context parallelism (section 19): the inner (all-to-all)
     * and outer (ring) groups split from this one for an inner size, kept
     * until this group is freed; a child points back at its parent */
    cpar_group *cp_inner, *cp_outer, *cp_parent;
    int cp_inner_size;
    cpar_group *next;     /* the context's list of live groups */
};

struct cpar_ctx {
    int rank, world;
    cpar_backend backend;
    int device;           /* CPAR_HOST on the host backend */
    int timeout_ms;
    cpar__job *job;       /* host and device backends */
    bool owns_job;        /* a single-rank job made by cpar_init_from_env */
    cpar_store *store;    /* multi-process start-up */
    cpar_group *world_group, *groups;
    cpar_group *grid[CPAR_GROUP_KIND_COUNT];
    int grid_size[CPAR_GROUP_KIND_COUNT], grid_rank[CPAR_GROUP_KIND_COUNT];
    void *ws;             /* workspace on the context's device (Megatron's global memory buffer) */
    size_t ws_bytes;
    void *coll_ws;        /* the host/device collectives' accumulator, apart from ws so a */
    size_t coll_ws_bytes; /* caller may keep scratch in ws across a collective */
    void *coll_stage;     /* device backend: peers' slices copied here where this GPU has no */
    size_t coll_stage_bytes; /* peer access to theirs (cpar__reduce_rows_staged) */
    uint64_t dev_reach;   /* device backend: GPUs (bit d: GPU d) whose memory its kernels may touch */
    void *gemm_ws;        /* host memory: the host GEMM's packed panels (section 5) */
    size_t gemm_ws_bytes;
    bool gemm_builtin;    /* CPAR_HOST_GEMM=builtin (or a kernel's name): never the CBLAS (section 5) */
    int gemm_force;       /* CPAR_HOST_GEMM's kernel, CPAR__GEMM_AUTO when none is named (section 5) */
    int host_threads;     /* CPAR_HOST_THREADS: threads per host GEMM, >= 1 (section 5) */
    struct cpar__pool *gemm_pool; /* its worker threads, made at the first big product (section 5) */
    cpar_dev_stream compute, comm;
    /* device contexts: a failure elsewhere that dooms waiting (a failed peer,
     * an NCCL asynchronous error), asked while polling (section 12) */
    cpar_status (*async_check)(cpar_ctx *ctx, const char *fn);
    /* the public call the next collective on tag_group serves: its slot
     * carries the hash and text, which the members compare (section 8) */
    cpar_group *tag_group;
    uint64_t tag;
    char tag_text[CPAR__TAG_LEN];
    /* the collective call under way, before its collective (cpar__coll_pending):
     * a local failure of pending_fn's checks tells pending_group's members at
     * once through give_up (section 8) instead of leaving them to the deadline */
    cpar_group *pending_group;
    const char *pending_fn;
    void (*give_up)(cpar_group *g, const char *why);
    int64_t gave_up_poll_ms; /* NCCL across processes: the next poll of the peers' give-ups (section 9) */
    bool check_calls;     /* CPAR_CHECK_CALLS=1: NCCL compares every collective's call (section 9) */
    bool attn_atomic_dq;  /* CPAR_ATTN_DQ=atomic: the device attention backward's dq by atomics (cpar.h §12) */
    bool attn_fwd_heads_first; /* CPAR_ATTN_FWD_GRID=heads: the device forward's CTAs in batch·head order */
    cpar_dev_stream coll_stream; /* where the collectives enqueue: NULL = compute; set only
                                  * between cpar__on_comm_stream and cpar__on_compute_stream */
    cpar_dev_blas blas;
    struct cpar__rng *rng; /* RNG tracker (section 15); NULL until first use */
    cpar_dev_event ring_ev[3]; /* ring attention's stream fork/join (section 19); created on first use */
    struct cpar__arena *arena; /* ranks as processes: where large host buffers live (section 1) */
    char **arena_peer;    /* [world] the peers' arenas mapped here (section 8); NULL: not mapped */
    size_t *arena_peer_bytes; /* [world] their sizes */
    bool arena_all;       /* every peer's arena is mapped: collectives may read peers' buffers directly */
    bool aborted;
    /* NCCL: the last communication queued ("cpar_recv's ncclRecv (the receive
     * from rank 1)"), which a stream wait past its deadline names (section 9) */
    char last_comm[160];
    char err[CPAR_ERR_LEN];
};

/* ==== 1. Platform and utilities ==========================================
 * Monotonic time, random bytes, the CPAR_LOG switch and aligned host
 * allocation. Uses: nothing. */

static int64_t cpar__now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t cpar__now_ms(void) { return cpar__now_ns() / 1000000; }

/* n random bytes from the kernel's generator; -1 (errno set) if it fails. */
static int cpar__random_bytes(void *out, size_t n) {
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)out + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fd);
    if (got < n) errno = errno ? errno : EIO;
    return got < n ? -1 : 0;
}

/* Absolute CLOCK_REALTIME deadline for pthread_cond_timedwait. */
static struct timespec cpar__abs_deadline(int64_t ms_from_now) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += (time_t)(ms_from_now / 1000);
    ts.tv_nsec += (long)(ms_from_now % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    return ts;
}

static int cpar__getenv_positive(const char *name, int dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    long x = strtol(v, &end, 10);
    return (*end || x <= 0 || x > 1L << 30) ? dflt : (int)x;
}

static int cpar__default_timeout_ms(void) {
    return cpar__getenv_positive("CPAR_TIMEOUT_MS", CPAR_DEFAULT_TIMEOUT_MS);
}

/* ---- logging: CPAR_LOG and CPAR_LOG_FILE, as NCCL_DEBUG and NCCL_DEBUG_FILE ----
 * CPAR_LOG = warn | info | debug, any case; unset, "", off, none, quiet or 0:
 * nothing. Any other value ("1", "verbose") is warned about once on stderr
 * and logs warnings. CPAR_LOG_FILE is a path in which %h, %p and %r are the
 * host, the pid and the rank (%% a percent sign); a pattern with %r sends a
 * line whose rank is not known yet to stderr. Every line reads
 *   cpar[RANK] HOST:PID LEVEL message
 * The rank is the caller's context's, else the calling thread's (a
 * cpar_spawn rank, or the store thread of a rank), else the launch
 * environment's (RANK, SLURM_PROCID); "-" when none is known. The settings
 * (CPAR_LOG, CPAR_LOG_FILE, CPAR_WAIT_REPORT_S) are read at the first line
 * and again at every cpar_spawn, cpar_init_from_env and cpar_store_create, so
 * a program (or a test) may change them between jobs. */
/* WAIT: the progress lines of long waits (cpar__progress), printed unless
 * CPAR_LOG is off; the others only when CPAR_LOG asks for them. */
enum { CPAR__LOG_OFF = -2, CPAR__LOG_WAIT = 0, CPAR__LOG_WARN = 1, CPAR__LOG_INFO = 2, CPAR__LOG_DEBUG = 3 };
#define CPAR__LOG_FILES 64 /* ranks of one process with a file open at once; more share stderr */

static atomic_int cpar__log_lvl = -1;          /* -1: not read yet */
static _Atomic int64_t cpar__wait_every_ms = 10000; /* CPAR_WAIT_REPORT_S, read with CPAR_LOG */
static _Thread_local int cpar__tls_rank = -1;  /* this thread's rank */
static atomic_int cpar__proc_rank = -1;        /* the launch environment's rank */
static pthread_mutex_t cpar__log_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    char pattern[256]; /* CPAR_LOG_FILE; "" -> stderr */
    char host[64];
    int nfiles;
    struct { int rank; FILE *f; } files[CPAR__LOG_FILES];
    bool warned_level, warned_file;
} cpar__logs;

static void cpar__log_load(void) {
    const char *v = getenv("CPAR_LOG");
    int l = 0;
    if (v && *v) {
        if (!strcasecmp(v, "debug") || !strcasecmp(v, "trace")) l = CPAR__LOG_DEBUG;
        else if (!strcasecmp(v, "info")) l = CPAR__LOG_INFO;
        else if (!strcasecmp(v, "warn") || !strcasecmp(v, "warning")) l = CPAR__LOG_WARN;
        else if (!strcasecmp(v, "off") || !strcasecmp(v, "none") || !strcasecmp(v, "quiet") || !strcmp(v, "0"))
            l = CPAR__LOG_OFF;
        else {
            l = CPAR__LOG_WARN; /* someone asked for logs: give them the warnings */
            pthread_mutex_lock(&cpar__log_mu);
            if (!cpar__logs.warned_level)
                fprintf(stderr, "cpar: CPAR_LOG=%.64s is not a level: use warn, info or debug (any case); "
                                "logging warnings only\n", v);
            cpar__logs.warned_level = true;
            pthread_mutex_unlock(&cpar__log_mu);
        }
    }
    const char *every = getenv("CPAR_WAIT_REPORT_S");
    double e = every && *every ? atof(every) : 10.0; /* 0 or less: never */
    atomic_store(&cpar__wait_every_ms, e > 0 && e < 1e9 ? (int64_t)(e * 1000.0) + (e * 1000.0 < 1.0) : INT64_MAX / 4);
    const char *f = getenv("CPAR_LOG_FILE");
    pthread_mutex_lock(&cpar__log_mu);
    if (strcmp(cpar__logs.pattern, f ? f : "")) { /* a new pattern: the old files are done */
        for (int i = 0; i < cpar__logs.nfiles; i++) fclose(cpar__logs.files[i].f);
        cpar__logs.nfiles = 0;
        snprintf(cpar__logs.pattern, sizeof cpar__logs.pattern, "%s", f ? f : "");
    }
    if (!cpar__logs.host[0] && gethostname(cpar__logs.host, sizeof cpar__logs.host - 1) != 0)
        snprintf(cpar__logs.host, sizeof cpar__logs.host, "?");
    pthread_mutex_unlock(&cpar__log_mu);
    atomic_store(&cpar__log_lvl, l);
}

static int cpar__log_level(void) {
    int l = atomic_load(&cpar__log_lvl);
    if (l == -1) { /* not read yet */
        cpar__log_load();
        l = atomic_load(&cpar__log_lvl);
    }
    return l;
}

/* The rank a line is about when the caller passes -1. */
static int cpar__log_rank(int rank) {
    if (rank >= 0) return rank;
    if (cpar__tls_rank >= 0) return cpar__tls_rank;
    return atomic_load(&cpar__proc_rank);
}

/* Where rank's lines go (the caller holds cpar__log_mu). */
static FILE *cpar__log_stream(int rank) {
    const char *pat = cpar__logs.pattern;
    if (!pat[0] || (rank < 0 && strstr(pat, "%r"))) return stderr;
    for (int i = 0; i < cpar__logs.nfiles; i++)
        if (cpar__logs.files[i].rank == rank) return cpar__logs.files[i].f;
    if (cpar__logs.nfiles == CPAR__LOG_FILES) return stderr;
    char path[512];
    size_t n = 0;
    for (const char *p = pat; *p && n < sizeof path - 1; p++) {
        int w = 0;
        size_t room = sizeof path - n;
        if (p[0] == '%' && p[1] == 'h') w = snprintf(path + n, room, "%s", cpar__logs.host), p++;
        else if (p[0] == '%' && p[1] == 'p') w = snprintf(path + n, room, "%ld", (long)getpid()), p++;
        else if (p[0] == '%' && p[1] == 'r') w = snprintf(path + n, room, "%d", rank), p++;
        else if (p[0] == '%' && p[1] == '%') path[n] = '%', w = 1, p++;
        else path[n] = *p, w = 1;
        n += (size_t)w < room ? (size_t)w : room - 1;
    }
    path[n] = '\0';
    FILE *f = fopen(path, "w");
    if (!f) {
        if (!cpar__logs.warned_file)
            fprintf(stderr, "cpar: CPAR_LOG_FILE: cannot open %s: %s; logging to stderr\n", path, strerror(errno));
        cpar__logs.warned_file = true;
        return stderr;
    }
    cpar__logs.files[cpar__logs.nfiles].rank = rank;
    cpar__logs.files[cpar__logs.nfiles++].f = f;
    return f;
}

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static void cpar__log(int level, int rank, const char *fmt, ...) {
    if (cpar__log_level() < level) return;
    static const char *const names[] = {"WAIT", "WARN", "INFO", "DEBUG"};
    char line[CPAR_ERR_LEN], who[16] = "-";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    rank = cpar__log_rank(rank);
    if (rank >= 0) snprintf(who, sizeof who, "%d", rank);
    pthread_mutex_lock(&cpar__log_mu);
    FILE *f = cpar__log_stream(rank);
    fprintf(f, "cpar[%s] %s:%ld %s %s\n", who, cpar__logs.host, (long)getpid(), names[level], line);
    fflush(f);
    pthread_mutex_unlock(&cpar__log_mu);
}

/* No silent waits: a wait that may last (the store, a peer, the GPU) calls
 * cpar__progress_tick on every turn, which prints one WAIT line every
 * CPAR_WAIT_REPORT_S seconds (default 10; 0: never) saying what it waits
 * for, for how long of its deadline, and the likely cause. */
typedef struct cpar__progress {
    int64_t start_ms, next_ms, every_ms;
} cpar__progress;

static cpar__progress cpar__progress_start(void) {
    (void)cpar__log_level(); /* the settings read */
    int64_t now = cpar__now_ms(), every = atomic_load(&cpar__wait_every_ms);
    return (cpar__progress){now, now + every, every};
}

#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
static void cpar__progress_tick(cpar__progress *p, int rank, int64_t deadline_ms, const char *fmt, ...) {
    int64_t now = cpar__now_ms();
    if (now < p->next_ms) return;
    p->next_ms = now + p->every_ms;
    char what[CPAR_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    cpar__log(CPAR__LOG_WAIT, rank, "%s; waited %.0f s, %.0f s left before the deadline", what,
              (double)(now - p->start_ms) / 1000.0, (double)(deadline_ms > now ? deadline_ms - now : 0) / 1000.0);
}

static void *cpar__host_alloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, CPAR_ALIGN, bytes ? bytes : CPAR_ALIGN)) return NULL;
    return p;
}

static int64_t cpar__min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t cpar__max64(int64_t a, int64_t b) { return a > b ? a : b; }
static size_t cpar__max_size(size_t a, size_t b) { return a > b ? a : b; }

static size_t cpar__round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* ---- the shared host arena (host backend, ranks as processes) -------------
 * A process-mode context (section 12) allocates its host tensors and its
 * workspace of at least CPAR__ARENA_MIN bytes from one memfd of
 * CPAR__ARENA_BYTES, sparse (pages exist once touched), which its peers map
 * through /proc/<pid>/fd (section 8): a collective on such buffers reads and
 * writes the peers' memory directly, as the threaded backend does. A memfd
 * has no name in /dev/shm, so nothing is ever left there. Blocks are whole
 * pages, first fit over a sorted list of holes; a freed block's pages go back
 * to the kernel at once (a hole punched in the file, which also drops them
 * from the peers' mappings). The mapping is not inherited across fork
 * (MADV_DONTFORK): a forked child writing its parent's tensors would write
 * into the job's memory. Arenas are found by address (cpar__mem_free has no
 * context), in a list under one lock; one retired by cpar_finalize lives on
 * until its last block is freed. */

#ifndef CPAR__ARENA_BYTES
#define CPAR__ARENA_BYTES ((size_t)64 << 30) /* address space per rank; memory is what is touched */
#endif
#define CPAR__ARENA_MIN ((size_t)16 << 10)   /* smaller allocations stay on the heap (a page each would waste) */
#define CPAR__PAGE ((size_t)4096)

typedef struct cpar__extent {
    size_t off, len;
} cpar__extent;

typedef struct cpar__arena {
    int fd;
    char *base;
    size_t cap, top;             /* the mapping's size; the end of the highest block */
    cpar__extent *holes, *live;  /* free extents below top, by offset; the blocks handed out */
    size_t nholes, nlive, holes_cap, live_cap;
    bool retired;                /* its context is gone: destroyed with its last block */
    struct cpar__arena *next;
} cpar__arena;

static pthread_mutex_t cpar__arena_mu = PTHREAD_MUTEX_INITIALIZER;
static cpar__arena *cpar__arenas;

/* Room for one more entry in a table (under the lock). */
static bool cpar__extent_reserve(cpar__extent **v, size_t n, size_t *cap) {
    if (n < *cap) return true;
    size_t want = *cap ? *cap * 2 : 64;
    cpar__extent *p = realloc(*v, want * sizeof *p);
    if (!p) return false;
    *v = p, *cap = want;
    return true;
}

/* A new arena of cap bytes, or NULL (the context then allocates on the heap
 * and its collectives stage through the segment). */
static cpar__arena *cpar__arena_create(size_t cap) {
#ifdef __linux__
    cpar__arena *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    a->fd = (int)syscall(SYS_memfd_create, "cpar-arena", 1u /* MFD_CLOEXEC */);
    if (a->fd < 0 || ftruncate(a->fd, (off_t)cap) != 0 ||
        (a->base = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, a->fd, 0)) == MAP_FAILED) {
        if (a->fd >= 0) close(a->fd);
        free(a);
        return NULL;
    }
    madvise(a->base, cap, MADV_DONTFORK);
    a->cap = cap;
    pthread_mutex_lock(&cpar__arena_mu);
    a->next = cpar__arenas;
    cpar__arenas = a;
    pthread_mutex_unlock(&cpar__arena_mu);
    return a;
#else
    (void)cap;
    return NULL;
#endif
}

/* Unlink a (lock held) and release it. */
static void cpar__arena_destroy_locked(cpar__arena *a) {
    for (cpar__arena **p = &cpar__arenas; *p; p = &(*p)->next)
        if (*p == a) {
            *p = a->next;
            break;
        }
    munmap(a->base, a->cap);
    close(a->fd);
    free(a->holes);
    free(a->live);
    free(a);
}

/* bytes (rounded up to pages) from a, or NULL when no hole or the space above
 * the top fits them. */
static void *cpar__arena_alloc(cpar__arena *a, size_t bytes) {
    size_t len = cpar__round_up(bytes ? bytes : 1, CPAR__PAGE), off = SIZE_MAX;
    pthread_mutex_lock(&cpar__arena_mu);
    if (cpar__extent_reserve(&a->live, a->nlive, &a->live_cap)) {
        for (size_t i = 0; i < a->nholes && off == SIZE_MAX; i++)
            if (a->holes[i].len >= len) {
                off = a->holes[i].off;
                a->holes[i].off += len, a->holes[i].len -= len;
                if (!a->holes[i].len) memmove(&a->holes[i], &a->holes[i + 1], (a->nholes-- - i - 1) * sizeof *a->holes);
            }
        if (off == SIZE_MAX && len <= a->cap - a->top) off = a->top, a->top += len;
        if (off != SIZE_MAX) a->live[a->nlive++] = (cpar__extent){off, len};
    }
    pthread_mutex_unlock(&cpar__arena_mu);
    return off == SIZE_MAX ? NULL : a->base + off;
}

/* Give p back if an arena handed it out (true), punching its pages out of the
 * file and merging its extent with the holes around it. */
static bool cpar__arena_free(void *p) {
    bool found = false;
    pthread_mutex_lock(&cpar__arena_mu);
    for (cpar__arena *a = cpar__arenas; a && !found; a = a->next) {
        if ((char *)p < a->base || (char *)p >= a->base + a->top) continue;
        size_t off = (size_t)((char *)p - a->base), i = 0;
        while (i < a->nlive && a->live[i].off != off) i++;
        if (i == a->nlive) break; /* inside the arena but not a block: not ours to free */
        found = true;
        cpar__extent e = a->live[i];
        a->live[i] = a->live[--a->nlive];
#ifdef __linux__
        fallocate(a->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)e.off, (off_t)e.len);
#endif
        size_t h = 0; /* the first hole after e */
        while (h < a->nholes && a->holes[h].off < e.off) h++;
        if (h > 0 && a->holes[h - 1].off + a->holes[h - 1].len == e.off) { /* merge into the one before */
            e.off = a->holes[h - 1].off, e.len += a->holes[h - 1].len;
            memmove(&a->holes[h - 1], &a->holes[h], (a->nholes-- - h) * sizeof *a->holes);
            h--;
        }
        if (h < a->nholes && e.off + e.len == a->holes[h].off) { /* and the one after */
            e.len += a->holes[h].len;
            memmove(&a->holes[h], &a->holes[h + 1], (a->nholes-- - h - 1) * sizeof *a->holes);
        }
        if (e.off + e.len == a->top) a->top = e.off; /* the top comes down instead of a hole there */
        else if (cpar__extent_reserve(&a->holes, a->nholes, &a->holes_cap)) {
            memmove(&a->holes[h + 1], &a->holes[h], (a->nholes - h) * sizeof *a->holes);
            a->holes[h] = e, a->nholes++;
        } /* else the extent is lost to later allocations (its pages are released all the same) */
        if (a->retired && !a->nlive) cpar__arena_destroy_locked(a);
    }
    pthread_mutex_unlock(&cpar__arena_mu);
    return found;
}

/* Its context is finalized: destroy a now, or with its last live block. */
static void cpar__arena_retire(cpar__arena *a) {
    if (!a) return;
    pthread_mutex_lock(&cpar__arena_mu);
    a->retired = true;
    if (!a->nlive) cpar__arena_destroy_locked(a);
    pthread_mutex_unlock(&cpar__arena_mu);
}

/* Where [p, p + bytes) lies in a's mapping (its offset), or -1 when it does
 * not. The whole mapping, not just below the top: the peers map all of it,
 * and the top may move under another thread's allocation. */
static int64_t cpar__arena_offset(const cpar__arena *a, const void *p, size_t bytes) {
    if (!a || !p || (const char *)p < a->base) return -1;
    size_t off = (size_t)((const char *)p - a->base);
    return off <= a->cap && bytes <= a->cap - off ? (int64_t)off : -1;
}

/* ==== 2. Errors ==========================================================
 * Every failure leaves one line in the thread's last error and, when a
 * context is known, in the context's. Argument checks build messages that
 * name the function, the argument, what it got and what was expected.
 * Uses: 1. */

static _Thread_local char cpar__tls_err[CPAR_ERR_LEN];

const char *cpar_status_string(cpar_status st) {
    static const char *const names[CPAR_STATUS_COUNT] = {
        "CPAR_OK",          "CPAR_ERR_INVALID", "CPAR_ERR_CUDA",        "CPAR_ERR_NCCL",
        "CPAR_ERR_CUBLAS",  "CPAR_ERR_SYSTEM",  "CPAR_ERR_TIMEOUT",     "CPAR_ERR_PEER",
        "CPAR_ERR_OOM",     "CPAR_ERR_UNSUPPORTED",
    };
    return ((unsigned)st < CPAR_STATUS_COUNT) ? names[st] : "CPAR_ERR_UNKNOWN";
}

const char *cpar_thread_last_error(void) { return cpar__tls_err; }

const char *cpar_last_error(const cpar_ctx *ctx) { return ctx ? ctx->err : cpar__tls_err; }

#define CPAR__STR_(x) #x
#define CPAR__STR(x) CPAR__STR_(x)
const char *cpar_version(void) {
    return CPAR__STR(CPAR_VERSION_MAJOR) "." CPAR__STR(CPAR_VERSION_MINOR) "." CPAR__STR(CPAR_VERSION_PATCH);
}
int cpar_version_code(void) { return CPAR_VERSION_CODE; }

static void cpar__set_error(cpar_ctx *ctx, const char *msg) {
    if (msg != cpar__tls_err) snprintf(cpar__tls_err, sizeof cpar__tls_err, "%s", msg);
    if (ctx && msg != ctx->err) snprintf(ctx->err, sizeof ctx->err, "%s", msg);
}

/* Record "fmt..." as the last error and return st. By convention the message
 * begins with the public function's name. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static cpar_status cpar__fail(cpar_ctx *ctx, cpar_status st, const char *fmt, ...) {
    char line[CPAR_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    cpar__set_error(ctx, line);
    if (ctx) ctx->tag_group = NULL; /* a failed call reaches no collective: its tag must not outlive it */
    /* A collective call that fails its own checks (this rank's arguments or
     * memory) tells its group's members, who would otherwise wait for it. The
     * message must be that call's: a later failure elsewhere is not. */
    if (ctx && ctx->pending_group && ctx->give_up &&
        (st == CPAR_ERR_INVALID || st == CPAR_ERR_OOM || st == CPAR_ERR_UNSUPPORTED)) {
        const size_t n = strlen(ctx->pending_fn);
        cpar_group *g = ctx->pending_group;
        ctx->pending_group = NULL;
        if (!strncmp(line, ctx->pending_fn, n) && line[n] == ':') {
            ctx->give_up(g, line);
            cpar__set_error(ctx, line); /* giving up may have used the store, which records its own errors */
        }
    }
    /* A timeout is the failure a user most needs to see; the rest is detail. */
    cpar__log(st == CPAR_ERR_TIMEOUT ? CPAR__LOG_WARN : CPAR__LOG_DEBUG, ctx ? ctx->rank : -1, "%s: %s",
              cpar_status_string(st), line);
    return st;
}

/* Add the calling public function's name in front of an error a lower layer
 * recorded (e.g. the device layer's line), keeping the status. */
static cpar_status cpar__wrap(cpar_ctx *ctx, cpar_status st, const char *fn, const char *detail) {
    if (st == CPAR_OK) return st;
    return cpar__fail(ctx, st, "%s: %s", fn, detail && *detail ? detail : cpar_status_string(st));
}

/* The status of a public function called from inside another one (call it
 * as cpar__as(ctx, fn, cpar_all_gather(...))): on failure the message names
 * the function the user called, with the inner function's line after it
 * ("cpar_cp_unshard: cpar_all_gather: ..."). */
static cpar_status cpar__as(cpar_ctx *ctx, const char *fn, cpar_status st) {
    return cpar__wrap(ctx, st, fn, cpar_thread_last_error());
}

#define CPAR_TRY(call)                                                                                       \
    do {                                                                                                     \
        cpar_status st_ = (call);                                                                            \
        if (st_ != CPAR_OK) return st_;                                                                      \
    } while (0)
#define CPAR_TRY_GOTO(call, st, label)                                                                       \
    do {                                                                                                     \
        (st) = (call);                                                                                       \
        if ((st) != CPAR_OK) goto label;                                                                     \
    } while (0)

/* ==== 3. Data types and tensors ==========================================
 * The dtype table, bit-exact fp16/bf16 conversions shared by the host
 * reference kernels, and tensor construction and description.
 * Uses: 1, 2. */

static const struct {
    const char *name;
    size_t size;
} cpar__dtypes[CPAR_DTYPE_COUNT] = {
    {"f32", 4}, {"f16", 2}, {"bf16", 2}, {"i32", 4}, {"i64", 8}, {"u8", 1},
};

static bool cpar__dtype_valid(cpar_dtype dt) { return (unsigned)dt < CPAR_DTYPE_COUNT; }
size_t cpar_dtype_size(cpar_dtype dt) { return cpar__dtype_valid(dt) ? cpar__dtypes[dt].size : 0; }
const char *cpar_dtype_name(cpar_dtype dt) { return cpar__dtype_valid(dt) ? cpar__dtypes[dt].name : "?"; }
bool cpar_dtype_is_float(cpar_dtype dt) { return dt == CPAR_F32 || dt == CPAR_F16 || dt == CPAR_BF16; }

/* Hot helpers that must inline into the vector loops of section 5 (and into
 * their AVX2 twins there, which a plain static inline may not). */
#if defined(__GNUC__)
#define CPAR__INLINE static inline __attribute__((always_inline))
#else
#define CPAR__INLINE static inline
#endif

CPAR__INLINE uint32_t cpar__f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
CPAR__INLINE float cpar__bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* c ? a : b as a bit mask. gcc does not if-convert a ?: whose arm holds
 * fp arithmetic (it might trap), so the conversions below, which must
 * vectorise, compute every case and pick with masks; the public functions
 * below are these. */
CPAR__INLINE uint32_t cpar__pick(bool c, uint32_t a, uint32_t b) {
    uint32_t m = 0u - (uint32_t)c;
    return (a & m) | (b & ~m);
}
CPAR__INLINE float cpar__bf16_value(uint16_t b) { return cpar__bits_f32((uint32_t)b << 16); }

CPAR__INLINE uint16_t cpar__bf16_bits(float f) {
    /* all in 32-bit lanes with one shift at the end, and a signed compare
     * (both sides are below 2^31), which AVX2 has, unlike an unsigned one */
    uint32_t u = cpar__f32_bits(f);
    uint32_t nan = u | 0x400000u;                 /* quiet NaN, sign kept */
    uint32_t rne = u + 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(cpar__pick((int32_t)(u & 0x7fffffffu) > 0x7f800000, nan, rne) >> 16);
}

CPAR__INLINE float cpar__f16_value(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t special = sign | 0x7f800000u | (man << 13);                                   /* inf / NaN */
    uint32_t sub = sign | cpar__f32_bits((float)(int32_t)man * 5.9604644775390625e-08f); /* man * 2^-24 */
    uint32_t normal = sign | ((exp + 112u) << 23) | (man << 13);
    return cpar__bits_f32(cpar__pick(exp == 0x1fu, special, cpar__pick(exp == 0, sub, normal)));
}

CPAR__INLINE uint16_t cpar__f16_bits(float f) {
    uint32_t u = cpar__f32_bits(f), a = u & 0x7fffffffu;
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu); /* NaN stays NaN */
    /* half subnormal: value * 2^24 rounded to nearest even is the mantissa;
     * fp32 addition of 0.5 (magic) does exactly that rounding */
    uint32_t sub = cpar__f32_bits(cpar__bits_f32(a) + 0.5f) - cpar__f32_bits(0.5f);
    /* rebias the exponent (-112 << 23) and round to nearest even */
    uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
    /* a < 2^31: signed compares, which AVX2 has (unsigned ones take two instructions) */
    const int32_t sa = (int32_t)a;
    uint32_t r = cpar__pick(sa < 0x38800000, sub, normal);
    r = cpar__pick(sa >= 0x477ff000, 0x7c00u, r); /* rounds to inf */
    return (uint16_t)(sign | cpar__pick(sa > 0x7f800000, nan, r));
}

float cpar_bf16_to_f32(uint16_t b) { return cpar__bf16_value(b); }
uint16_t cpar_f32_to_bf16(float f) { return cpar__bf16_bits(f); }
float cpar_f16_to_f32(uint16_t h) { return cpar__f16_value(h); }
uint16_t cpar_f32_to_f16(float f) { return cpar__f16_bits(f); }

cpar_tensor cpar_tensor_make(void *data, cpar_dtype dtype, int ndim, const int64_t *shape, int device) {
    cpar_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dtype;
    t.ndim = ndim < 0 ? 0 : ndim > CPAR_MAX_DIMS ? CPAR_MAX_DIMS : ndim;
    for (int i = 0; i < t.ndim && shape; i++) t.shape[i] = shape[i];
    t.device = device;
    return t;
}

/* Checked int64 arithmetic for every size computed from user input: false
 * (and *out unspecified) when the exact result does not fit, so no signed
 * overflow is reachable from the public API. */
static bool cpar__mul64(int64_t a, int64_t b, int64_t *out) {
#if defined(__GNUC__) || defined(__clang__)
    return !__builtin_mul_overflow(a, b, out);
#else
    if (a > 0 ? (b > 0 ? a > INT64_MAX / b : b < INT64_MIN / a)
              : (b > 0 ? a < INT64_MIN / b : a != 0 && b < INT64_MAX / a))
        return false;
    *out = a * b;
    return true;
#endif
}

static bool cpar__add64(int64_t a, int64_t b, int64_t *out) {
#if defined(__GNUC__) || defined(__clang__)
    return !__builtin_add_overflow(a, b, out);
#else
    if (b > 0 ? a > INT64_MAX - b : a < INT64_MIN - b) return false;
    *out = a + b;
    return true;
#endif
}

/* The largest byte count a tensor may have: it must fit int64 (offsets are
 * int64) and a size_t with room to spare for pointer differences. */
#define CPAR__MAX_BYTES ((int64_t)((uint64_t)PTRDIFF_MAX < (uint64_t)INT64_MAX ? (uint64_t)PTRDIFF_MAX : (uint64_t)INT64_MAX))

typedef enum { CPAR__SHAPE_OK, CPAR__SHAPE_NDIM, CPAR__SHAPE_NEG, CPAR__SHAPE_OVERFLOW } cpar__shape_verdict;

/* Validate a shape before any loop over it: ndim in 0..CPAR_MAX_DIMS, no
 * negative dim, and the dims multiplied together with zeros counted as 1,
 * times es bytes, within CPAR__MAX_BYTES. Counting zeros as 1 makes every
 * partial product of the dims (the row sizes later sections compute) and
 * its byte size fit as well. *numel gets the element count; *bad_dim the
 * negative dim. */
static cpar__shape_verdict cpar__shape_check(int ndim, const int64_t *shape, size_t es, int64_t *numel, int *bad_dim) {
    if (ndim < 0 || ndim > CPAR_MAX_DIMS) return CPAR__SHAPE_NDIM;
    int64_t n = 1, extent = es ? (int64_t)es : 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            if (bad_dim) *bad_dim = i;
            return CPAR__SHAPE_NEG;
        }
        if (shape[i] == 0) n = 0;
        else if (!cpar__mul64(extent, shape[i], &extent) || extent > CPAR__MAX_BYTES) return CPAR__SHAPE_OVERFLOW;
        else n *= shape[i]; /* no overflow: |n| <= extent */
    }
    if (numel) *numel = n;
    return CPAR__SHAPE_OK;
}

int64_t cpar_tensor_numel(const cpar_tensor *t) {
    if (!t) return 0;
    int64_t n;
    return cpar__shape_check(t->ndim, t->shape, cpar_dtype_size(t->dtype), &n, NULL) == CPAR__SHAPE_OK ? n : -1;
}

size_t cpar_tensor_nbytes(const cpar_tensor *t) {
    int64_t n = cpar_tensor_numel(t);
    return n > 0 ? (size_t)n * cpar_dtype_size(t->dtype) : 0; /* fits: checked against CPAR__MAX_BYTES */
}

/* "[8,2,16]" into buf. */
static const char *cpar__shape_str(const cpar_tensor *t, char *buf, size_t cap) {
    size_t n = 0;
    n += (size_t)snprintf(buf + n, cap - n, "[");
    int nd = t->ndim < 0 ? 0 : t->ndim > CPAR_MAX_DIMS ? CPAR_MAX_DIMS : t->ndim;
    for (int i = 0; i < nd && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? "," : "", (long long)t->shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
    return buf;
}

static const char *cpar__device_str(int device, char *buf, size_t cap) {
    if (device == CPAR_HOST) snprintf(buf, cap, "host");
    else snprintf(buf, cap, "device %d", device);
    return buf;
}

/* The structural checks every tensor argument gets: not NULL, valid dtype and
 * rank, non-negative dims, data present when non-empty, on the expected
 * device (expect_device < -1 skips that check). */
static cpar_status cpar__check_tensor(cpar_ctx *ctx, const char *fn, const char *name, const cpar_tensor *t,
                                      int expect_device) {
    if (!t) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is NULL", fn, name);
    if (!cpar__dtype_valid(t->dtype))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has invalid dtype %d", fn, name, (int)t->dtype);
    int64_t numel = 0;
    int bad = 0;
    switch (cpar__shape_check(t->ndim, t->shape, cpar_dtype_size(t->dtype), &numel, &bad)) {
    case CPAR__SHAPE_NDIM:
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has ndim %d, expected 0..%d", fn, name, t->ndim,
                          CPAR_MAX_DIMS);
    case CPAR__SHAPE_NEG:
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has negative dim %d (%lld)", fn, name, bad,
                          (long long)t->shape[bad]);
    case CPAR__SHAPE_OVERFLOW: {
        char got[160];
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has shape %s of %s, whose size overflows (expected at "
                          "most %lld bytes)", fn, name, cpar__shape_str(t, got, sizeof got), cpar_dtype_name(t->dtype),
                          (long long)CPAR__MAX_BYTES);
    }
    default: break;
    }
    if (!t->data && numel > 0)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has NULL data and %lld elements", fn, name,
                          (long long)numel);
    if (expect_device >= CPAR_HOST && t->device != expect_device) {
        char got[32], want[32];
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is on %s, expected %s (the context's device)", fn, name,
                          cpar__device_str(t->device, got, sizeof got),
                          cpar__device_str(expect_device, want, sizeof want));
    }
    return CPAR_OK;
}

static cpar_status cpar__check_dtype(cpar_ctx *ctx, const char *fn, const char *name, const cpar_tensor *t,
                                     cpar_dtype want) {
    if (t->dtype == want) return CPAR_OK;
    return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has dtype %s, expected %s", fn, name,
                      cpar_dtype_name(t->dtype), cpar_dtype_name(want));
}

static cpar_status cpar__check_float(cpar_ctx *ctx, const char *fn, const char *name, const cpar_tensor *t) {
    if (cpar_dtype_is_float(t->dtype)) return CPAR_OK;
    return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has dtype %s, expected f32, f16 or bf16", fn, name,
                      cpar_dtype_name(t->dtype));
}

/* "name has shape [..], expected [..] (why)" */
static cpar_status cpar__fail_shape(cpar_ctx *ctx, const char *fn, const char *name, const cpar_tensor *t,
                                    const int64_t *want, int want_ndim, const char *why) {
    char got[128], exp[128];
    cpar_tensor w = cpar_tensor_make(NULL, t->dtype, want_ndim, want, t->device);
    return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has shape %s, expected %s%s%s%s", fn, name,
                      cpar__shape_str(t, got, sizeof got), cpar__shape_str(&w, exp, sizeof exp), why ? " (" : "",
                      why ? why : "", why ? ")" : "");
}

static cpar_status cpar__check_shape(cpar_ctx *ctx, const char *fn, const char *name, const cpar_tensor *t,
                                     const int64_t *want, int want_ndim, const char *why) {
    bool same = t->ndim == want_ndim;
    for (int i = 0; same && i < want_ndim; i++) same = t->shape[i] == want[i];
    return same ? CPAR_OK : cpar__fail_shape(ctx, fn, name, t, want, want_ndim, why);
}

static bool cpar__ranges_overlap(const void *a, size_t na, const void *b, size_t nb) {
    const char *pa = (const char *)a, *pb = (const char *)b;
    return na && nb && pa < pb + nb && pb < pa + na;
}

/* ==== 4. Device dispatch =================================================
 * The bridge to cpar_kernels.cu. In a host-only build the device layer below
 * reports that this build has no device support (cpar_dev_count() is 0), so
 * the rest of the file needs no #ifdefs. Also: the per-context workspace and
 * byte copies between any two memories, and cpar__stream_wait, the polling
 * wait for a stream (ctx->async_check, set in section 12, names a failure
 * elsewhere). Uses: 1, 2, 3. */

#ifndef CPAR_WITH_DEVICE
/* A program that links this file built without -DCPAR_WITH_DEVICE together
 * with cpar_kernels.cu (the easy mistake when copying the three files into a
 * CUDA project) would otherwise get one "multiple definition" per cpar_dev_*
 * function and no hint. The stubs are weak, so the linker's only complaint is
 * this variable, defined in cpar_kernels.cu too, whose name says the fix. */
#if defined(__GNUC__)
#define CPAR__STUB __attribute__((weak))
#else
#define CPAR__STUB
#endif
int cpar_link_error_cpar_c_built_without_CPAR_WITH_DEVICE = 1;
static const char cpar__no_device_msg[] =
    "this build has no device support (cpar.c compiled without -DCPAR_WITH_DEVICE, e.g. make CPAR_CUDA=0)";
CPAR__STUB const char *cpar_dev_last_error(void) { return cpar__no_device_msg; }
CPAR__STUB int cpar_dev_count(void) { return 0; }
#define CPAR__NODEV(...) { (void)0; return CPAR_ERR_UNSUPPORTED; }
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#endif
CPAR__STUB cpar_status cpar_dev_set(int device) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_peer_access(int peer) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_peer_query(int device, int peer, bool *can) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_malloc(void **p, size_t bytes) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_free(void *p) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_host_alloc(void **p, size_t bytes) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_host_free(void *p) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_memset(void *p, int byte, size_t bytes, cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_memcpy(void *dst, const void *src, size_t bytes, cpar_copy_kind kind, cpar_dev_stream s)
    CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_copy_2d(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t row_bytes,
                             size_t rows, cpar_copy_kind kind, cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_sync(void) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_stream_create(cpar_dev_stream *s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_stream_destroy(cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_stream_sync(cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_stream_query(cpar_dev_stream s, bool *done) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_event_create(cpar_dev_event *e) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_event_destroy(cpar_dev_event e) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_event_record(cpar_dev_event e, cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_stream_wait_event(cpar_dev_stream s, cpar_dev_event e) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_event_sync(cpar_dev_event e) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_blas_create(cpar_dev_blas *h) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_blas_destroy(cpar_dev_blas h) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_gemm(cpar_dev_blas h, cpar_dev_stream s, int transa, int transb, int m, int n, int k,
                          float alpha, const void *A, cpar_dtype ab_dtype, int lda, int64_t stride_a,
                          const void *B, int ldb, int64_t stride_b, float beta, void *C, cpar_dtype c_dtype,
                          int ldc, int64_t stride_c, int batch) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_fill(void *p, cpar_dtype dt, int64_t n, double value, cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_cast(void *dst, cpar_dtype dst_dt, const void *src, cpar_dtype src_dt, int64_t n,
                          cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_axpby(float alpha, const void *x, float beta, void *y, cpar_dtype dt, int64_t n,
                           cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_reduce_into(void *acc, const void *src, cpar_dtype src_dt, int64_t n, cpar_reduce_op op,
                                 cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_row_reduce(float *out, const void *in, cpar_dtype dt, int64_t rows, int64_t cols,
                                cpar_row_op op, cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_gelu(const void *x, const void *dy, void *out, cpar_dtype dt, int64_t n, cpar_dev_stream s)
    CPAR__NODEV()
/* the sections' own kernels (cpar.h §16): RNG and dropout (for §9) */
CPAR__STUB cpar_status cpar_dev_rng_uniform(void *p, cpar_dtype dt, int64_t n, uint64_t seed, uint64_t offset, float lo,
                                 float hi, cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_rng_normal(void *p, cpar_dtype dt, int64_t n, uint64_t seed, uint64_t offset, float mean,
                                float std, cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_dropout_forward(const void *x, void *y, uint8_t *mask, cpar_dtype dt, int64_t n, float p,
                                     float scale, uint64_t seed, uint64_t offset, cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_dropout_backward(const void *dy, void *dx, const uint8_t *mask, cpar_dtype dt, int64_t n,
                                      float p, float scale, uint64_t seed, uint64_t offset, cpar_dev_stream s)
    CPAR__NODEV()
/* cross entropy and embedding (cpar.h §10) */
CPAR__STUB cpar_status cpar_dev_xent_local(const void *logits, cpar_dtype dt, const void *target, cpar_dtype tdt, int64_t rows,
                                int64_t cols, int64_t first, int64_t vocab, bool smooth, float *m_loc, float *part,
                                cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_xent_rescale(float *part, const float *m_loc, const float *m, int64_t rows, cpar_dev_stream s)
    CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_xent_finalize(const float *m, const float *part, int64_t rows, int64_t vocab, float s, bool smooth,
                                   float *loss, float *stats, cpar_dev_stream st) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_xent_backward(const void *logits, void *dlogits, cpar_dtype dt, const void *target,
                                   cpar_dtype tdt, const float *stats, const float *dloss, int64_t rows, int64_t cols,
                                   int64_t first, int64_t vocab, float s, cpar_dev_stream st) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_embedding_lookup(const void *weight, cpar_dtype dt, const void *ids, cpar_dtype idt, int64_t b,
                                      int64_t s, int64_t hidden, int64_t first, int64_t v_local, bool seq_first,
                                      void *out, cpar_dev_stream st) CPAR__NODEV()
CPAR__STUB size_t cpar_dev_embedding_grad_scratch_bytes(int64_t tokens) { (void)tokens; return 0; }
CPAR__STUB cpar_status cpar_dev_embedding_grad(const void *dout, cpar_dtype dt, const void *ids, cpar_dtype idt, int64_t b,
                                    int64_t s, int64_t hidden, int64_t first, int64_t v_local, bool seq_first,
                                    float *dweight, bool deterministic, void *scratch, cpar_dev_stream st) CPAR__NODEV()
/* attention and the ring merge (cpar.h §12) */
CPAR__STUB cpar_status cpar_dev_attention_fwd(const cpar_dev_attn *a, void *out, cpar_dtype out_dt, int64_t o_bh, float *lse,
                                   int64_t lse_bh, cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_attention_bwd(const cpar_dev_attn *a, const void *out, const void *dout, cpar_dtype out_dt,
                                   int64_t o_bh, const float *lse, int64_t lse_bh, float *dq, int64_t dq_bh,
                                   float *dk, float *dv, int64_t dkv_bh, void *scratch, cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB size_t cpar_dev_attention_bwd_scratch_bytes(const cpar_dev_attn *a) { return 0; }
CPAR__STUB cpar_status cpar_dev_ring_merge(float *out, float *lse, const float *out_b, const float *lse_b, int64_t nbh,
                                int64_t rows, int64_t d, int64_t o_bh, int64_t lse_bh, cpar_dev_stream s) CPAR__NODEV()
/* Mamba context parallelism (cpar.h §13) */
CPAR__STUB cpar_status cpar_dev_mamba_conv1d_forward(const void *x, int64_t x_pitch, cpar_dtype dt, const void *w,
                                          const void *bias, cpar_dtype pdt, cpar_dev_conv_rows rows, int64_t s,
                                          int64_t b, int64_t channels, int k, bool silu, void *y,
                                          cpar_dev_stream st) CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_mamba_conv1d_backward(const void *x, int64_t x_pitch, cpar_dtype dt, const void *w,
                                           const void *bias, cpar_dtype pdt, cpar_dev_conv_rows rows, int64_t s,
                                           int64_t b, int64_t channels, int k, bool silu, const void *dy, void *dx,
                                           float *partial, int nsplit, float *dw, float *dbias, cpar_dev_stream st)
    CPAR__NODEV()
CPAR__STUB cpar_status cpar_dev_mamba_sum_replicas(void *dst, int64_t dst_gs, int64_t dst_pitch, const void *src, int64_t src_gs,
                                        int64_t rep_stride, int64_t src_pitch, int64_t groups, int64_t reps,
                                        int64_t rows, int64_t cols, cpar_dtype dt, cpar_dev_stream st) CPAR__NODEV()
/* packed sequences (cpar.h §12, §13) */
CPAR__STUB cpar_status cpar_dev_packed_reorder(void *nat, size_t nat_pitch, void *blk, size_t blk_pitch, size_t blk_stride,
                                    int r0, int nranks, int p, const int32_t *cu, int n_docs, int64_t outer,
                                    size_t row_bytes, bool to_blocks, cpar_dev_stream st) CPAR__NODEV()
/* RMSNorm (cpar.h §14; GeLU, cpar.h §6, is above) */
CPAR__STUB cpar_status cpar_dev_rmsnorm(void *x, const void *add, const void *weight, cpar_dtype dt, int64_t rows, int64_t h,
                             float eps, void *y, cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB size_t cpar_dev_rmsnorm_backward_scratch_bytes(int64_t rows, int64_t h) { (void)rows, (void)h; return 0; }
CPAR__STUB cpar_status cpar_dev_rmsnorm_backward(const void *x, const void *weight, const void *dy, cpar_dtype dt, int64_t rows,
                                      int64_t h, float eps, void *dx, float *dweight, float *scratch,
                                      cpar_dev_stream s) CPAR__NODEV()
/* Training (cpar.h §15) */
CPAR__STUB cpar_status cpar_dev_adamw(float *master, float *m, float *v, const float *grad, void *param, cpar_dtype pdt, int64_t n,
                           float lr, float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2,
                           float grad_scale, cpar_dev_stream s) CPAR__NODEV()
CPAR__STUB size_t cpar_dev_sum_squares_scratch(int64_t n) { return (void)n, 0; }
CPAR__STUB cpar_status cpar_dev_sum_squares(const float *x, int64_t n, float *out, void *scratch, cpar_dev_stream s) CPAR__NODEV()
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#undef CPAR__NODEV
#undef CPAR__STUB
#endif /* !CPAR_WITH_DEVICE */

/* The public face of cpar_dev_count (cpar.h §7): programs size their NCCL
 * jobs with it without reaching into the internal device layer. */
int cpar_device_count(void) { return cpar_dev_count(); }

/* A device-layer failure seen from public function fn. */
static cpar_status cpar__dev_fail(cpar_ctx *ctx, cpar_status st, const char *fn) {
    return cpar__wrap(ctx, st, fn, cpar_dev_last_error());
}
#define CPAR_DEV_TRY(ctx, fn, call)                                                                          \
    do {                                                                                                     \
        cpar_status dst_ = (call);                                                                           \
        if (dst_ != CPAR_OK) return cpar__dev_fail((ctx), dst_, (fn));                                       \
    } while (0)

static bool cpar__on_device(int device) { return device != CPAR_HOST; }

static cpar_copy_kind cpar__copy_kind(int dst_device, int src_device) {
    if (cpar__on_device(dst_device)) return cpar__on_device(src_device) ? CPAR_COPY_D2D : CPAR_COPY_H2D;
    return cpar__on_device(src_device) ? CPAR_COPY_D2H : CPAR_COPY_H2H;
}

/* The stream the collectives enqueue on (sections 8, 9, 11): the compute
 * stream, or the communication stream between cpar__on_comm_stream and
 * cpar__on_compute_stream. The caller of the pair orders the communication
 * stream after the compute work it depends on (events) and joins it back
 * before anything on compute consumes the result; the pair is never left
 * set across a return to the user, so the public collectives keep their
 * compute-stream behaviour. Host tensors: both are no-ops. */
static cpar_dev_stream cpar__coll_stream(const cpar_ctx *ctx) {
    return ctx->coll_stream ? ctx->coll_stream : ctx->compute;
}
static void cpar__on_comm_stream(cpar_ctx *ctx) {
    if (cpar__on_device(ctx->device)) ctx->coll_stream = ctx->comm;
}
static void cpar__on_compute_stream(cpar_ctx *ctx) { ctx->coll_stream = NULL; }

/* Waits for the work queued on s. A device context polls (the stream, then
 * ctx->async_check) with its deadline instead of blocking: a dead peer
 * leaves an NCCL kernel spinning, and a blocking synchronize would never
 * return. A failed communicator fails the wait even once the stream is done
 * (an NCCL kernel ended by an abort lets the stream go on); a failed peer
 * elsewhere fails only work that has not finished. */
static cpar_status cpar__comm_errors_named(cpar_ctx *ctx, const char *fn); /* section 12 */
static void cpar__comms_abort(cpar_ctx *ctx);
static void cpar__abort_why(cpar_ctx *ctx, cpar_status st, const char *why); /* section 12 */

static cpar_status cpar__stream_wait(cpar_ctx *ctx, const char *fn, cpar_dev_stream s) {
    /* Without a context (no caller makes one wait so) there is nothing to
     * ask but the stream, and the default deadline. */
    const bool checks = ctx && ctx->async_check;
    int64_t deadline = cpar__now_ms() + (ctx ? ctx->timeout_ms : cpar__default_timeout_ms());
    cpar__progress progress = cpar__progress_start();
    for (;;) {
        bool done = false;
        CPAR_DEV_TRY(ctx, fn, cpar_dev_stream_query(s, &done));
        /* Done, the communicators are still asked (an aborted NCCL kernel
         * lets the stream go on). */
        if (done) return checks ? cpar__comm_errors_named(ctx, fn) : CPAR_OK;
        cpar_status st = checks ? cpar__comm_errors_named(ctx, fn) : CPAR_OK;
        if (st != CPAR_OK) return st;
        st = checks ? ctx->async_check(ctx, fn) : CPAR_OK;
        if (st != CPAR_OK) {
            CPAR_DEV_TRY(ctx, fn, cpar_dev_stream_query(s, &done));
            if (done) return CPAR_OK;
            /* The work waits for a failed peer: end its NCCL kernels, or a
             * later free (which synchronises the device) would hang. */
            cpar__comms_abort(ctx);
            return st;
        }
        if (cpar__now_ms() > deadline) {
            if (!ctx) return cpar__fail(NULL, CPAR_ERR_TIMEOUT, "%s: device work unfinished after %d ms", fn,
                                        cpar__default_timeout_ms());
            /* The job learns why before the abort reaches a peer (as in
             * cpar__nccl_wait), even from a wait whose error nobody reads
             * (cpar__stream_wait_quiet): cpar_spawn reports it. */
            cpar_status st = cpar__fail(ctx, CPAR_ERR_TIMEOUT, "%s: device work unfinished after %d ms%s%s%s; "
                                        "communicators aborted", fn, ctx->timeout_ms,
                                        *ctx->last_comm ? " (the last communication queued: " : "", ctx->last_comm,
                                        *ctx->last_comm ? ")" : "");
            char why[CPAR_ERR_LEN];
            snprintf(why, sizeof why, "timed out (%.400s)", ctx->err);
            cpar__abort_why(ctx, st, why);
            return st;
        }
        cpar__progress_tick(&progress, ctx ? ctx->rank : -1, deadline, "%s: waiting for the GPU%s%s%s", fn,
                            ctx && *ctx->last_comm ? " (the last communication queued: " : "",
                            ctx ? ctx->last_comm : "", ctx && *ctx->last_comm ? "; are the peers making it?)" : "");
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
}

/* cpar__stream_wait for calls that report nothing (freeing, finalizing):
 * the context's last error stays the one the user will read. */
static void cpar__stream_wait_quiet(cpar_ctx *ctx, const char *fn, cpar_dev_stream s) {
    char saved[CPAR_ERR_LEN];
    memcpy(saved, ctx->err, sizeof saved);
    (void)cpar__stream_wait(ctx, fn, s);
    memcpy(ctx->err, saved, sizeof saved);
}

/* rows of row_bytes between device memory and anything, on stream s. A copy
 * into host memory is complete on return: into pageable memory it blocks
 * until the stream's earlier work ran, so that wait polls first (a dead
 * peer's NCCL kernel never ends); into pinned memory (cpar_pinned_alloc) it
 * is asynchronous, so the stream is waited for after it too. */
static cpar_status cpar__dev_copy(cpar_ctx *ctx, const char *fn, cpar_dev_stream s, cpar_copy_kind kind, void *dst,
                                  size_t dst_pitch, const void *src, size_t src_pitch, size_t row_bytes, size_t rows) {
    if (kind == CPAR_COPY_D2H) CPAR_TRY(cpar__stream_wait(ctx, fn, s));
    CPAR_DEV_TRY(ctx, fn, rows == 1 ? cpar_dev_memcpy(dst, src, row_bytes, kind, s)
                                    : cpar_dev_copy_2d(dst, dst_pitch, src, src_pitch, row_bytes, rows, kind, s));
    return kind == CPAR_COPY_D2H ? cpar__stream_wait(ctx, fn, s) : CPAR_OK;
}

/* Copy bytes between any two memories, stream-ordered on stream s; a copy
 * into host memory is complete on return. */
static cpar_status cpar__copy_bytes_on(cpar_ctx *ctx, const char *fn, cpar_dev_stream s, void *dst, int dst_device,
                                       const void *src, int src_device, size_t bytes) {
    if (!bytes || dst == src) return CPAR_OK;
    cpar_copy_kind kind = cpar__copy_kind(dst_device, src_device);
    if (kind == CPAR_COPY_H2H) {
        memmove(dst, src, bytes);
        return CPAR_OK;
    }
    return cpar__dev_copy(ctx, fn, s, kind, dst, bytes, src, bytes, bytes, 1);
}

/* Copy bytes between any two memories, stream-ordered on the compute stream;
 * a copy into host memory is complete on return. */
static cpar_status cpar__copy_bytes(cpar_ctx *ctx, const char *fn, void *dst, int dst_device, const void *src,
                                    int src_device, size_t bytes) {
    return cpar__copy_bytes_on(ctx, fn, ctx ? ctx->compute : NULL, dst, dst_device, src, src_device, bytes);
}

/* Pitched 2-D copy (rows of row_bytes) between any two memories. */
static cpar_status cpar__copy_2d(cpar_ctx *ctx, const char *fn, void *dst, size_t dst_pitch, int dst_device,
                                 const void *src, size_t src_pitch, int src_device, size_t row_bytes, size_t rows) {
    if (!row_bytes || !rows) return CPAR_OK;
    cpar_copy_kind kind = cpar__copy_kind(dst_device, src_device);
    if (kind == CPAR_COPY_H2H) {
        for (size_t r = 0; r < rows; r++)
            memmove((char *)dst + r * dst_pitch, (const char *)src + r * src_pitch, row_bytes);
        return CPAR_OK;
    }
    return cpar__dev_copy(ctx, fn, ctx->compute, kind, dst, dst_pitch, src, src_pitch, row_bytes, rows);
}

/* Both of the context's streams have run everything queued on them: waiting
 * for compute suffices, because every call joins comm back into compute
 * before it returns and grows its buffers before it forks onto comm
 * (tests/mutate_waits.sh found a comm wait here, in cpar_sync and in
 * cpar_finalize never needed; the simulator refuses a cudaMalloc or cudaFree
 * with NCCL work queued, so a path that broke this would fail a test). */
static cpar_status cpar__streams_quiet(cpar_ctx *ctx, const char *fn) {
    return cpar__stream_wait(ctx, fn, ctx->compute);
}

static cpar_status cpar__mem_alloc(cpar_ctx *ctx, const char *fn, int device, size_t bytes, void **out) {
    *out = NULL;
    if (!cpar__on_device(device)) {
        /* A process-mode context's peers read its arena: large buffers go there. */
        if (ctx && ctx->arena && bytes >= CPAR__ARENA_MIN && (*out = cpar__arena_alloc(ctx->arena, bytes))) return CPAR_OK;
        *out = cpar__host_alloc(bytes);
        if (!*out) return cpar__fail(ctx, CPAR_ERR_OOM, "%s: host allocation of %zu bytes failed", fn, bytes);
        return CPAR_OK;
    }
    /* cudaMalloc takes a device-wide lock: never with this rank's NCCL work
     * in flight (it may wait for peers whose launches the lock holds up). */
    if (ctx && ctx->compute) CPAR_TRY(cpar__streams_quiet(ctx, fn));
    CPAR_DEV_TRY(ctx, fn, cpar_dev_malloc(out, bytes ? bytes : 1));
    return CPAR_OK;
}

/* Frees p; a device free the runtime refused (a bad pointer, or work still
 * queued where that is not allowed) is reported. */
static cpar_status cpar__mem_free(int device, void *p) {
    if (!p) return CPAR_OK;
    if (cpar__on_device(device)) return cpar_dev_free(p);
    if (!cpar__arena_free(p)) free(p);
    return CPAR_OK;
}

cpar_status cpar_pinned_alloc(cpar_ctx *ctx, size_t bytes, void **out) {
    static const char fn[] = "cpar_pinned_alloc";
    if (!out) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    *out = NULL;
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    if (bytes > (size_t)PTRDIFF_MAX)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: bytes is %zu, expected at most PTRDIFF_MAX", fn, bytes);
    if (bytes == 0) return CPAR_OK;
    if (!cpar__on_device(ctx->device)) {
        if (!(*out = cpar__host_alloc(bytes)))
            return cpar__fail(ctx, CPAR_ERR_OOM, "%s: host allocation of %zu bytes failed", fn, bytes);
        return CPAR_OK;
    }
    CPAR_TRY(cpar__streams_quiet(ctx, fn)); /* as cpar__mem_alloc */
    CPAR_DEV_TRY(ctx, fn, cpar_dev_set(ctx->device));
    CPAR_DEV_TRY(ctx, fn, cpar_dev_host_alloc(out, bytes));
    return CPAR_OK;
}

cpar_status cpar_pinned_free(cpar_ctx *ctx, void *p) {
    static const char fn[] = "cpar_pinned_free";
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    if (!p) return CPAR_OK;
    if (!cpar__on_device(ctx->device)) {
        free(p);
        return CPAR_OK;
    }
    CPAR_TRY(cpar__streams_quiet(ctx, fn));
    CPAR_DEV_TRY(ctx, fn, cpar_dev_host_free(p));
    return CPAR_OK;
}

/* At least bytes of a growing buffer on the context's device. It only grows
 * (while warming up); growing waits for queued work on both streams that may
 * still use the old buffer. */
static cpar_status cpar__grow_buffer(cpar_ctx *ctx, const char *fn, void **buf, size_t *have, size_t bytes) {
    if (bytes > *have) {
        size_t want = bytes + bytes / 4 + 4096;
        if (*buf && cpar__on_device(ctx->device)) CPAR_TRY(cpar__streams_quiet(ctx, fn));
        cpar_status fs = cpar__mem_free(ctx->device, *buf);
        *buf = NULL;
        if (fs != CPAR_OK) return cpar__dev_fail(ctx, fs, fn);
        *have = 0;
        CPAR_TRY(cpar__mem_alloc(ctx, fn, ctx->device, want, buf));
        *have = want;
        cpar__log(CPAR__LOG_DEBUG, ctx->rank, "%s: buffer grown to %zu bytes", fn, want);
    }
    return CPAR_OK;
}

/* The context workspace: temporaries of one operation at a time, carved by
 * the caller. The collectives never use it, so scratch kept here stays valid
 * across a collective. */
static cpar_status cpar__workspace(cpar_ctx *ctx, const char *fn, size_t bytes, void **out) {
    CPAR_TRY(cpar__grow_buffer(ctx, fn, &ctx->ws, &ctx->ws_bytes, bytes));
    *out = ctx->ws;
    return CPAR_OK;
}

cpar_status cpar_tensor_alloc(cpar_ctx *ctx, cpar_dtype dtype, int ndim, const int64_t *shape, cpar_tensor *out) {
    static const char fn[] = "cpar_tensor_alloc";
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    if (!out) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    if (ndim < 0 || ndim > CPAR_MAX_DIMS)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: ndim is %d, expected 0..%d", fn, ndim, CPAR_MAX_DIMS);
    if (ndim > 0 && !shape) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: shape is NULL with ndim %d", fn, ndim);
    if (!cpar__dtype_valid(dtype)) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dtype is %d, not a cpar_dtype", fn, (int)dtype);
    int bad = 0;
    switch (cpar__shape_check(ndim, shape, cpar_dtype_size(dtype), NULL, &bad)) {
    case CPAR__SHAPE_NEG:
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: shape[%d] is %lld, expected >= 0", fn, bad, (long long)shape[bad]);
    case CPAR__SHAPE_OVERFLOW: {
        char got[160];
        cpar_tensor t = cpar_tensor_make(NULL, dtype, ndim, shape, ctx->device);
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: shape %s of %s overflows (expected at most %lld bytes)", fn,
                          cpar__shape_str(&t, got, sizeof got), cpar_dtype_name(dtype), (long long)CPAR__MAX_BYTES);
    }
    default: break;
    }
    *out = cpar_tensor_make(NULL, dtype, ndim, shape, ctx->device);
    return cpar__mem_alloc(ctx, fn, ctx->device, cpar_tensor_nbytes(out), &out->data);
}

cpar_status cpar_tensor_free(cpar_ctx *ctx, cpar_tensor *t) {
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_tensor_free: ctx is NULL");
    if (!t) return cpar__fail(ctx, CPAR_ERR_INVALID, "cpar_tensor_free: t is NULL");
    /* cudaFree synchronises the device: never with NCCL work queued (see
     * cpar__mem_alloc). Compute suffices: every call joins comm back into
     * compute before it returns (tests/mutate_waits.sh: a comm wait here was
     * never needed). */
    if (t->data && cpar__on_device(t->device)) cpar__stream_wait_quiet(ctx, "cpar_tensor_free", ctx->compute);
    cpar_status st = cpar__mem_free(t->device, t->data);
    t->data = NULL;
    return st == CPAR_OK ? CPAR_OK : cpar__dev_fail(ctx, st, "cpar_tensor_free");
}

cpar_status cpar_tensor_copy(cpar_ctx *ctx, const cpar_tensor *src, cpar_tensor *dst) {
    static const char fn[] = "cpar_tensor_copy";
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    CPAR_TRY(cpar__check_tensor(ctx, fn, "src", src, -2));
    CPAR_TRY(cpar__check_tensor(ctx, fn, "dst", dst, -2));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "dst", dst, src->dtype));
    if (cpar_tensor_numel(dst) != cpar_tensor_numel(src))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dst has %lld elements, expected %lld (as src)", fn,
                          (long long)cpar_tensor_numel(dst), (long long)cpar_tensor_numel(src));
    for (int i = 0; i < 2; i++) {
        int d = i ? dst->device : src->device;
        if (d != CPAR_HOST && d != ctx->device) {
            char got[32];
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is on %s, expected host or the context's device %d",
                              fn, i ? "dst" : "src", cpar__device_str(d, got, sizeof got), ctx->device);
        }
    }
    return cpar__copy_bytes(ctx, fn, dst->data, dst->device, src->data, src->device, cpar_tensor_nbytes(src));
}

/* ==== 5. Host reference kernels ==========================================
 * The loops that define what each CUDA kernel must compute; they run the
 * host backend and are the references of the sim tests. Float math in fp32
 * (row reductions accumulate in fp64 here, or in fp32 runs added in fp64:
 * the reference must be at least as accurate as the kernel). The
 * memory-bound ones (fill, cast, axpby, gelu, whose 16-bit form looks its
 * results up in a table; sections 16 and 21 reuse the machinery) make one
 * pass over memory at machine speed: CPAR__BLOCKS cuts the data into
 * L1-sized blocks, a 16-bit block is widened into an fp32 stack buffer once
 * per block (no per-element dtype switch), the math runs in fixed-count
 * loops that gcc -O2 vectorises, and results are narrowed on the way out.
 * On x86-64 the kernels that gain from it (exp, fmaf) also come in an
 * AVX2+FMA twin chosen at run time (CPAR__VARIANTS); it computes the same
 * bits, except that its exp evaluates its polynomial with FMAs
 * (cpar__exp_reduced: the last bit may differ, within the same error
 * bound). Uses: 3. */

static float cpar__load_f(const void *p, cpar_dtype dt, int64_t i) {
    switch (dt) {
    case CPAR_F32: return ((const float *)p)[i];
    case CPAR_F16: return cpar__f16_value(((const uint16_t *)p)[i]);
    case CPAR_BF16: return cpar__bf16_value(((const uint16_t *)p)[i]);
    case CPAR_I32: return (float)((const int32_t *)p)[i];
    case CPAR_I64: return (float)((const int64_t *)p)[i];
    default: return (float)((const uint8_t *)p)[i];
    }
}

static void cpar__store_f(void *p, cpar_dtype dt, int64_t i, float v) {
    switch (dt) {
    case CPAR_F32: ((float *)p)[i] = v; break;
    case CPAR_F16: ((uint16_t *)p)[i] = cpar__f16_bits(v); break;
    case CPAR_BF16: ((uint16_t *)p)[i] = cpar__bf16_bits(v); break;
    case CPAR_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case CPAR_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    default: ((uint8_t *)p)[i] = (uint8_t)v; break;
    }
}

/* ---- vector building blocks ----------------------------------------------------
 * gcc -O2 vectorises a loop only when the vector width divides its trip
 * count (the "very cheap" cost model) and it needs no run-time alias check.
 * So the kernels run over blocks of CPAR__BLK elements: CPAR__BLOCKS
 * expands its body twice, once with the block length a constant (full
 * blocks: vectorised), once for the short tail. An F32 operand is used in
 * place (a copy into a buffer costs as much as the kernel); a 16-bit one
 * is widened into an fp32 stack buffer of 2 KiB (a few stay in L1) and an
 * output narrowed from one. The math loops carry CPAR__IVDEP: their inputs
 * and output are the same memory (in place) or disjoint, which the public
 * functions' overlap checks ensure, so no iteration feeds another. Sums run
 * in a fixed order (cpar__blk_sum): the same bits on every ISA. */
#define CPAR__BLK 512
#define CPAR__LANES 16

/* Keep a * b + c two roundings in every kernel twin: gcc's -std=c11 never
 * contracts it into an FMA; clang does unless told. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#if defined(__clang__)
#define CPAR__IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define CPAR__IVDEP _Pragma("GCC ivdep")
#else
#define CPAR__IVDEP
#endif

/* Run the statements over [0, total) in blocks: i0 the block's first
 * element, n its length (CPAR__BLK, a constant, except in the last one). */
#define CPAR__BLOCKS(total, i0, n, ...)                                                                      \
    for (int64_t i0 = 0; i0 < (total); i0 += CPAR__BLK) {                                                    \
        if ((total) - i0 >= CPAR__BLK) {                                                                     \
            const int n = CPAR__BLK;                                                                         \
            __VA_ARGS__                                                                                      \
        } else {                                                                                             \
            const int n = (int)((total) - i0);                                                               \
            __VA_ARGS__                                                                                      \
        }                                                                                                    \
    }

/* d[0..n) = elements [i0, i0 + n) of the 16-bit tensor p (F16 or BF16) as fp32. */
CPAR__INLINE void cpar__blk_widen(float *d, const void *p, cpar_dtype dt, int64_t i0, int n) {
    const uint16_t *s = (const uint16_t *)p + i0;
    if (dt == CPAR_BF16)
        for (int k = 0; k < n; k++) d[k] = cpar__bf16_value(s[k]);
    else
        for (int k = 0; k < n; k++) d[k] = cpar__f16_value(s[k]);
}

/* Elements [i0, i0 + n) of the 16-bit tensor p (F16 or BF16) = s[0..n), rounded to nearest even. */
CPAR__INLINE void cpar__blk_narrow(void *p, cpar_dtype dt, int64_t i0, const float *s, int n) {
    uint16_t *d = (uint16_t *)p + i0;
    if (dt == CPAR_BF16)
        for (int k = 0; k < n; k++) d[k] = cpar__bf16_bits(s[k]);
    else
        for (int k = 0; k < n; k++) d[k] = cpar__f16_bits(s[k]);
}

/* Elements [i0, i0 + n) of p (F32, F16 or BF16) as fp32: p's own memory
 * for F32, else buf after widening. */
CPAR__INLINE const float *cpar__blk_in(float *buf, const void *p, cpar_dtype dt, int64_t i0, int n) {
    if (dt == CPAR_F32) return (const float *)p + i0;
    cpar__blk_widen(buf, p, dt, i0, n);
    return buf;
}

/* Where a kernel writes elements [i0, ...) of p: p's own memory for F32,
 * else buf, which cpar__blk_out then narrows into p. */
CPAR__INLINE float *cpar__blk_dst(float *buf, void *p, cpar_dtype dt, int64_t i0) {
    return dt == CPAR_F32 ? (float *)p + i0 : buf;
}
CPAR__INLINE void cpar__blk_out(void *p, cpar_dtype dt, int64_t i0, const float *buf, int n) {
    if (dt != CPAR_F32) cpar__blk_narrow(p, dt, i0, buf, n);
}

/* Ask for elements [i0, i0 + n) of p (dtype dt) to be brought into the
 * cache: a row kernel calls it for the next row while its second pass
 * computes from cache, so the next first pass does not start cold. */
CPAR__INLINE void cpar__blk_prefetch(const void *p, cpar_dtype dt, int64_t i0, int n) {
    const size_t es = dt == CPAR_F32 ? 4 : 2;
    const char *c = (const char *)p + (size_t)i0 * es;
    for (size_t b = 0; b < (size_t)n * es; b += 64) __builtin_prefetch(c + b);
}

/* acc[0..CPAR__LANES) += the sum of a[k] * b[k] (b NULL: of a[k]), k < n,
 * term k into lane k mod CPAR__LANES, in order: a fixed order that
 * vectorises, the same bits on every ISA (no fma). A full block adds each
 * lane's terms in fp32 in runs of CPAR__RUN, then each run into the lane's
 * fp64 sum, the lanes as two local 8-lane halves, which gcc keeps in
 * registers (one 16-lane array stays in memory, its adds chained through
 * stores); the tail adds in fp64 directly. Its callers' sums (a norm's, a
 * cross entropy's, attention's D) are made in fp32 by the kernels, a
 * thread's terms in turn and then a tree: this is at least as accurate (a
 * run of 8 non-negative terms is within 8 ulps). A term costs an fp32
 * multiply and add; widening each to fp64 made a norm's backward 1.25x and
 * a cross entropy's forward 1.1x slower. */
#define CPAR__RUN 8
CPAR__INLINE void cpar__blk_sum(double *acc, const float *a, const float *b, int n) {
    if (n == CPAR__BLK) {
        for (int p = 0; p < CPAR__BLK; p += CPAR__RUN * CPAR__LANES) {
            float l0[8] = {0}, l1[8] = {0};
            if (b)
                for (int k = p; k < p + CPAR__RUN * CPAR__LANES; k += 16) {
                    for (int j = 0; j < 8; j++) l0[j] += a[k + j] * b[k + j];
                    for (int j = 0; j < 8; j++) l1[j] += a[k + 8 + j] * b[k + 8 + j];
                }
            else
                for (int k = p; k < p + CPAR__RUN * CPAR__LANES; k += 16) {
                    for (int j = 0; j < 8; j++) l0[j] += a[k + j];
                    for (int j = 0; j < 8; j++) l1[j] += a[k + 8 + j];
                }
            for (int j = 0; j < 8; j++) acc[j] += l0[j], acc[8 + j] += l1[j];
        }
        return;
    }
    for (int k = 0; k < n; k++) acc[k % CPAR__LANES] += b ? (double)a[k] * (double)b[k] : (double)a[k];
}

/* cpar__blk_sum(s, a, a, n) and cpar__blk_sum(c, gw, a, n) in one
 * pass (a is loaded once), gw[k] = g[k] * w[k] rounded to fp32: the
 * backward of a norm. */
CPAR__INLINE void cpar__blk_sum2(double *s, double *c, const float *a, const float *g, const float *w, int n) {
    if (n == CPAR__BLK) {
        for (int p = 0; p < CPAR__BLK; p += CPAR__RUN * CPAR__LANES) {
            float s0[8] = {0}, s1[8] = {0}, c0[8] = {0}, c1[8] = {0};
            for (int k = p; k < p + CPAR__RUN * CPAR__LANES; k += 16) {
                for (int j = 0; j < 8; j++) s0[j] += a[k + j] * a[k + j], c0[j] += g[k + j] * w[k + j] * a[k + j];
                for (int j = 8; j < 16; j++) s1[j - 8] += a[k + j] * a[k + j], c1[j - 8] += g[k + j] * w[k + j] * a[k + j];
            }
            for (int j = 0; j < 8; j++) s[j] += s0[j], s[8 + j] += s1[j], c[j] += c0[j], c[8 + j] += c1[j];
        }
        return;
    }
    for (int k = 0; k < n; k++) {
        const double v = a[k];
        s[k % CPAR__LANES] += v * v, c[k % CPAR__LANES] += (double)(g[k] * w[k]) * v;
    }
}

CPAR__INLINE double cpar__lanes_sum(const double *acc) {
    double s = 0.0;
    for (int l = 0; l < CPAR__LANES; l++) s += acc[l];
    return s;
}

#ifdef CPAR__X86_KERNELS
/* The CPU features the x86 kernels are chosen by, each probed once (every
 * thread computes the same answer):
 *   AVX2        AVX2+FMA: the kernels' twins, the GEMM's 16 x 6 micro-kernel
 *               and packing, attention's row passes;
 *   AVX512      AVX-512F: the GEMM's 32 x 12 fp32 micro-kernel;
 *   AVX512BF16  vdpbf16ps: its 32 x 12 bf16 micro-kernel (and the AMX
 *               kernel's rounding of C, vcvtne2ps2bf16);
 *   AMX         AMX bf16 tiles this process may use: the CPU has them and
 *               Linux granted the tile data state (arch_prctl
 *               ARCH_REQ_XCOMP_PERM, asked once; forked children inherit it);
 *               the AMX kernel also needs AVX512BF16 (every AMX CPU has it). */
typedef enum { CPAR__CPU_AVX2, CPAR__CPU_AVX512, CPAR__CPU_AVX512BF16, CPAR__CPU_AMX, CPAR__CPU_COUNT } cpar__cpu_feature;

static bool cpar__cpu_has(cpar__cpu_feature f);

static bool cpar__cpu_probe(cpar__cpu_feature f) {
    switch (f) {
    case CPAR__CPU_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CPAR__CPU_AVX512: return __builtin_cpu_supports("avx512f") && cpar__cpu_has(CPAR__CPU_AVX2);
    case CPAR__CPU_AVX512BF16: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
    case CPAR__CPU_AMX:
#if defined(__linux__) && defined(SYS_arch_prctl)
        return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
               syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
        return false;
#endif
    default: return false;
    }
}

static bool cpar__cpu_has(cpar__cpu_feature f) {
    static atomic_int known[CPAR__CPU_COUNT]; /* 0: not probed yet, 1: no, 2: yes */
    int a = atomic_load_explicit(&known[f], memory_order_relaxed);
    if (!a) {
        a = cpar__cpu_probe(f) ? 2 : 1;
        atomic_store_explicit(&known[f], a, memory_order_relaxed);
    }
    return a == 2;
}

static bool cpar__cpu_avx2(void) { return cpar__cpu_has(CPAR__CPU_AVX2); }
static bool cpar__cpu_avx512(void) { return cpar__cpu_has(CPAR__CPU_AVX512); }
static bool cpar__cpu_avx512bf16(void) { return cpar__cpu_has(CPAR__CPU_AVX512BF16); }
static bool cpar__cpu_amx(void) { return cpar__cpu_has(CPAR__CPU_AMX); }
#endif

/* A kernel `name` from the always-inline `name##_body`: on x86-64 gcc/clang
 * also compiled for AVX2+FMA and picked per call from the CPU's features
 * (-DCPAR_PORTABLE builds the baseline alone). The twin gives the
 * same bits: floating-point contraction is off (above), so FMA appears only
 * where the code calls fmaf. params and args: parenthesised lists. */
#ifdef CPAR__X86_KERNELS
#define CPAR__VARIANTS(name, params, args)                                                                   \
    static void name##_base params { name##_body args; }                                                     \
    __attribute__((target("avx2,fma"))) static void name##_avx2 params { name##_body args; }                \
    static void name params {                                                                                \
        if (cpar__cpu_avx2()) name##_avx2 args;                                                              \
        else name##_base args;                                                                               \
    }
#else
#define CPAR__VARIANTS(name, params, args) static void name params { name##_body args; }
#endif

/* CPAR__VARIANTS for a body whose last parameter is `bool fused`: false in
 * the baseline, true in the AVX2+FMA twin (where a C fma is one
 * instruction; the baseline's would be a libm call). */
#define CPAR__UNPAREN(...) __VA_ARGS__
#ifdef CPAR__X86_KERNELS
#define CPAR__VARIANTS_FMA(name, params, args)                                                               \
    static void name##_base params { name##_body(CPAR__UNPAREN args, false); }                              \
    __attribute__((target("avx2,fma"))) static void name##_avx2 params {                                     \
        name##_body(CPAR__UNPAREN args, true);                                                               \
    }                                                                                                        \
    static void name params {                                                                                \
        if (cpar__cpu_avx2()) name##_avx2 args;                                                              \
        else name##_base args;                                                                               \
    }
#else
#define CPAR__VARIANTS_FMA(name, params, args) static void name params { name##_body(CPAR__UNPAREN args, false); }
#endif

/* a b + c for the exp polynomials: one FMA (one rounding) where fused (the
 * AVX2+FMA twin, a constant there), else a product and a sum. */
#define CPAR__MADF(fused, a, b, c) ((fused) ? __builtin_fmaf((a), (b), (c)) : (a) * (b) + (c))

/* e^x = y 2^n for a clamped x: y = e^r, the reduced argument's polynomial
 * (cpar__expf and cpar__exp_m2abs scale it as their ranges need). fused: every
 * a b + c one FMA, which shortens the dependency chain by a third (the
 * AVX2 twins run exp 1.4-1.5x faster); its result may then differ from the
 * unfused one in the last bit. */
CPAR__INLINE float cpar__exp_reduced(float x, int32_t *n, bool fused) {
    const float magic = 0x1.8p23f;
    const float fn = CPAR__MADF(fused, x, 1.44269504088896341f, magic); /* round(x / ln2) in the low mantissa bits */
    *n = (int32_t)(cpar__f32_bits(fn) - cpar__f32_bits(magic));
    const float nf = fn - magic;
    const float r = CPAR__MADF(fused, nf, 2.12194440e-4f, CPAR__MADF(fused, nf, -0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = CPAR__MADF(fused, p, r, 1.3981999507e-3f);
    p = CPAR__MADF(fused, p, r, 8.3334519073e-3f);
    p = CPAR__MADF(fused, p, r, 4.1665795894e-2f);
    p = CPAR__MADF(fused, p, r, 1.6666665459e-1f);
    p = CPAR__MADF(fused, p, r, 5.0000001201e-1f);
    return CPAR__MADF(fused, p, r * r, r) + 1.0f;
}

/* e^x in fp32 for the vector loops (glibc's expf does not vectorise at -O2):
 * x = n ln2 + r with |r| <= ln2/2 (Cody-Waite, ln2 in two parts), Cephes'
 * degree-6 polynomial for e^r, then 2^n as two exact power-of-two factors,
 * so overflow (x > 88.72: +inf) and underflow (x < -87.34: subnormal, then
 * 0) happen in the last multiply as for expf. Max relative error wherever
 * the result is normal, measured against exp over every float: 8.2e-8,
 * fused 8.5e-8. x is first clamped to [-110, 89] as integers (the float's
 * bits ordered as signed for positives, unsigned for negatives: two min
 * operations; a float ?: stays a branch, since a compare may trap, and the
 * loop would not vectorise), which would turn NaN into a number, so NaN in
 * gives an all-ones NaN out. */
CPAR__INLINE float cpar__expf(float x, bool fused) {
    const uint32_t u = cpar__f32_bits(x), lo = 0xc2dc0000u /* -110 */, hi = 0x42b20000u /* 89 */;
    const int32_t c1 = (int32_t)u < (int32_t)hi ? (int32_t)u : (int32_t)hi; /* positives */
    const float xc = cpar__bits_f32((uint32_t)c1 < lo ? (uint32_t)c1 : lo);  /* negatives */
    int32_t n;
    const float y = cpar__exp_reduced(xc, &n, fused);
    const int32_t n1 = n >> 1; /* n in [-159, 128]: both factors are normal floats */
    const float e = y * cpar__bits_f32((uint32_t)(n1 + 127) << 23) * cpar__bits_f32((uint32_t)(n - n1 + 127) << 23);
    /* |x|'s bits above infinity's: NaN (a signed compare, as |x| < 2^31) */
    return cpar__bits_f32(cpar__f32_bits(e) | (0u - (uint32_t)((int32_t)(u & 0x7fffffffu) > 0x7f800000)));
}

/* e^-2|u|, the exp that GeLU's tanh(u) = sign(u) (1 - e)/(1 + e) needs: |u|
 * is clamped to 43 as an integer, so e^x (x in [-86, 0]) is the polynomial
 * times one power of two and never subnormal, and e is 0 past 43 (NaN and
 * infinity included: GeLU's v carries them), where e^-86 < 2^-124 no
 * longer moves an fp32 GeLU or its gradient. */
CPAR__INLINE float cpar__exp_m2abs(float u, bool fused) {
    const uint32_t ab = cpar__f32_bits(u) & 0x7fffffffu, top = 0x422c0000u; /* 43 */
    int32_t n; /* in [-124, 0] */
    const float e = cpar__exp_reduced(-2.0f * cpar__bits_f32(ab < top ? ab : top), &n, fused) *
                    cpar__bits_f32((uint32_t)(n + 127) << 23);
    return cpar__bits_f32(cpar__f32_bits(e) & (0u - (uint32_t)(ab < top)));
}

/* p[0..n) = v for 2-, 4- or 8-byte elements (a repeated byte, 0 say: memset). */
static void cpar__fill_bits(void *p, size_t es, int64_t n, uint64_t v) {
    uint64_t b = v & 0xff;
    if (v == b * (es == 2 ? 0x0101u : es == 4 ? 0x01010101u : 0x0101010101010101u)) {
        memset(p, (int)b, (size_t)n * es);
        return;
    }
    switch (es) {
    case 2: { uint16_t *q = p; CPAR__BLOCKS(n, i0, m, for (int k = 0; k < m; k++) q[i0 + k] = (uint16_t)v;) break; }
    case 4: { uint32_t *q = p; CPAR__BLOCKS(n, i0, m, for (int k = 0; k < m; k++) q[i0 + k] = (uint32_t)v;) break; }
    default: { uint64_t *q = p; CPAR__BLOCKS(n, i0, m, for (int k = 0; k < m; k++) q[i0 + k] = v;) break; }
    }
}

static void cpar__host_fill(void *p, cpar_dtype dt, int64_t n, double value) {
    if (n <= 0) return; /* an empty tensor may have NULL data */
    switch (dt) {
    case CPAR_F32: cpar__fill_bits(p, 4, n, cpar__f32_bits((float)value)); break;
    case CPAR_F16: cpar__fill_bits(p, 2, n, cpar__f16_bits((float)value)); break;
    case CPAR_BF16: cpar__fill_bits(p, 2, n, cpar__bf16_bits((float)value)); break;
    case CPAR_I32: cpar__fill_bits(p, 4, n, (uint32_t)(int32_t)value); break;
    case CPAR_I64: cpar__fill_bits(p, 8, n, (uint64_t)(int64_t)value); break;
    default: memset(p, (uint8_t)value, (size_t)n); break;
    }
}

/* Float to float of different dtypes: one loop from F32 or into F32, else
 * through an fp32 block. */
CPAR__INLINE void cpar__host_cast_fp_body(void *dst, cpar_dtype dd, const void *src, cpar_dtype sd, int64_t n) {
    float buf[CPAR__BLK];
    if (sd == CPAR_F32) {
        CPAR__BLOCKS(n, i0, m, cpar__blk_narrow(dst, dd, i0, (const float *)src + i0, m);)
    } else if (dd == CPAR_F32) {
        CPAR__BLOCKS(n, i0, m, cpar__blk_widen((float *)dst + i0, src, sd, i0, m);)
    } else {
        CPAR__BLOCKS(n, i0, m, cpar__blk_widen(buf, src, sd, i0, m); cpar__blk_narrow(dst, dd, i0, buf, m);)
    }
}
CPAR__VARIANTS(cpar__host_cast_fp, (void *dst, cpar_dtype dd, const void *src, cpar_dtype sd, int64_t n),
               (dst, dd, src, sd, n))

static void cpar__host_cast(void *dst, cpar_dtype dd, const void *src, cpar_dtype sd, int64_t n) {
    if (n <= 0) return; /* an empty tensor may have NULL data, which memmove must not see */
    if (dd == sd) memmove(dst, src, (size_t)n * cpar_dtype_size(sd));
    else if (cpar_dtype_is_float(dd) && cpar_dtype_is_float(sd)) cpar__host_cast_fp(dst, dd, src, sd, n);
    else for (int64_t i = 0; i < n; i++) cpar__store_f(dst, dd, i, cpar__load_f(src, sd, i));
}

/* Copy with non-temporal stores, for destinations nobody reads before they
 * would have left the cache anyway (large collective outputs): the stores
 * skip the read-for-ownership of every destination line and leave the cache
 * to the working set, which makes out-of-cache copies about twice memcpy's
 * rate here. The stores are weakly ordered: call cpar__host_stream_fence
 * before another thread may read dst. SSE2 is part of x86-64, so there is no
 * run-time dispatch; elsewhere this is memcpy. dst and src do not overlap. */
static void cpar__host_stream_copy(void *dst, const void *src, size_t bytes) {
#ifdef CPAR__X86_KERNELS
    char *d = dst;
    const char *s = src;
    size_t head = (size_t)(-(uintptr_t)d & 15); /* to 16-byte alignment, as _mm_stream_si128 needs */
    if (head > bytes) head = bytes;
    memcpy(d, s, head);
    d += head, s += head, bytes -= head;
    size_t body = bytes & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i)), b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32)), e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + body, s + body, bytes - body);
#else
    memcpy(dst, src, bytes);
#endif
}

static void cpar__host_stream_fence(void) {
#ifdef CPAR__X86_KERNELS
    _mm_sfence();
#endif
}

/* fmaf as the kernel does, so host and device agree bit for bit (the AVX2
 * twin makes it one instruction; the baseline calls libm's); beta 0 never
 * reads y (it may hold NaN). x may be y. */
CPAR__INLINE void cpar__host_axpby_body(float alpha, const void *x, float beta, void *y, cpar_dtype dt, int64_t n) {
    float xb[CPAR__BLK], yb[CPAR__BLK], ob[CPAR__BLK];
    if (beta != 0.0f) {
        CPAR__BLOCKS(n, i0, m, const float *xp = cpar__blk_in(xb, x, dt, i0, m), *yp = cpar__blk_in(yb, y, dt, i0, m);
                     float *o = cpar__blk_dst(ob, y, dt, i0);
                     CPAR__IVDEP for (int k = 0; k < m; k++) o[k] = fmaf(beta, yp[k], alpha * xp[k]);
                     cpar__blk_out(y, dt, i0, o, m);)
    } else {
        CPAR__BLOCKS(n, i0, m, const float *xp = cpar__blk_in(xb, x, dt, i0, m); float *o = cpar__blk_dst(ob, y, dt, i0);
                     CPAR__IVDEP for (int k = 0; k < m; k++) o[k] = alpha * xp[k];
                     cpar__blk_out(y, dt, i0, o, m);)
    }
}
CPAR__VARIANTS(cpar__host_axpby, (float alpha, const void *x, float beta, void *y, cpar_dtype dt, int64_t n),
               (alpha, x, beta, y, dt, n))

/* fmaxf/fminf semantics (a NaN operand loses), as the kernels use. */
static float cpar__reduce_f(float a, float b, cpar_reduce_op op) {
    return op == CPAR_SUM ? a + b : op == CPAR_MAX ? fmaxf(a, b) : fminf(a, b);
}
#define CPAR__REDUCE_INT(a, b, op) ((op) == CPAR_SUM ? (a) + (b) : (op) == CPAR_MAX ? ((a) > (b) ? (a) : (b)) : ((a) < (b) ? (a) : (b)))

/* acc = op(acc, src) for n elements: float dtypes into an fp32 acc; integers in their own type. */
static void cpar__host_reduce_into(void *acc, const void *src, cpar_dtype dt, int64_t n, cpar_reduce_op op) {
    switch (dt) {
    case CPAR_I32:
        for (int64_t i = 0; i < n; i++) {
            int32_t a = ((int32_t *)acc)[i], b = ((const int32_t *)src)[i];
            ((int32_t *)acc)[i] = (int32_t)CPAR__REDUCE_INT((int64_t)a, (int64_t)b, op);
        }
        break;
    case CPAR_I64:
        for (int64_t i = 0; i < n; i++) {
            uint64_t a = (uint64_t)((int64_t *)acc)[i], b = (uint64_t)((const int64_t *)src)[i];
            int64_t sa = ((int64_t *)acc)[i], sb = ((const int64_t *)src)[i];
            ((int64_t *)acc)[i] = op == CPAR_SUM ? (int64_t)(a + b) : CPAR__REDUCE_INT(sa, sb, op); /* wraps */
        }
        break;
    case CPAR_U8:
        for (int64_t i = 0; i < n; i++) {
            int a = ((uint8_t *)acc)[i], b = ((const uint8_t *)src)[i];
            ((uint8_t *)acc)[i] = (uint8_t)CPAR__REDUCE_INT(a, b, op);
        }
        break;
    case CPAR_F32: { /* the hot case: op hoisted out of the loop so it vectorises */
        float *restrict a = acc;
        const float *restrict b = src;
        if (op == CPAR_SUM) for (int64_t i = 0; i < n; i++) a[i] += b[i];
        else if (op == CPAR_MAX) for (int64_t i = 0; i < n; i++) a[i] = fmaxf(a[i], b[i]);
        else for (int64_t i = 0; i < n; i++) a[i] = fminf(a[i], b[i]);
        break;
    }
    default:
        for (int64_t i = 0; i < n; i++) ((float *)acc)[i] = cpar__reduce_f(((float *)acc)[i], cpar__load_f(src, dt, i), op);
        break;
    }
}

static void cpar__host_row_reduce(float *out, const void *in, cpar_dtype dt, int64_t rows, int64_t cols,
                                  cpar_row_op op) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * cols;
        double acc = op == CPAR_ROW_SUM ? 0.0 : -INFINITY;
        for (int64_t c = 0; c < cols; c++) {
            double v = cpar__load_f(in, dt, base + c);
            acc = op == CPAR_ROW_SUM ? acc + v : (v > acc ? v : acc);
        }
        if (op == CPAR_ROW_LOGSUMEXP && isfinite(acc)) { /* -inf row: -inf; +inf: +inf (as PyTorch) */
            double m = acc, s = 0.0;
            for (int64_t c = 0; c < cols; c++) s += exp((double)cpar__load_f(in, dt, base + c) - m);
            acc = m + log(s);
        }
        out[r] = (float)acc;
    }
}

/* GeLU (tanh approximation) and its gradient, cpar_kernels.cu §20's fp32
 * formulas, which are written without tanh: with e = e^-2|u| and
 * q = 1/(1 + e), 0.5 (1 + tanh u) = q (u >= 0) or e q (u < 0), and
 * 1 - tanh^2 u = 4 e q^2. 1 + tanh u and 1 - tanh^2 u computed from a
 * rounded tanh lose all accuracy in the tails (gelu'(-5) = -1.0e-6 comes
 * out 0); these keep a few ulp relative everywhere. dy == NULL: out =
 * gelu(x); else out = dy gelu'(x). out may be x (forward) or dy (backward). */
/* 0.5 (1 + tanh u) in *h for u = 0.79788456 v (1 + 0.044715 v^2); returns
 * e q^2, a quarter of 1 - tanh^2 u (as cpar_kernels.cu's cpar__gelu_terms). */
CPAR__INLINE float cpar__gelu_terms(float v, bool fused, float *h) {
    const float u = 0.79788456f * v * (1.f + 0.044715f * v * v), e = cpar__exp_m2abs(u, fused), q = 1.f / (1.f + e);
    const uint32_t neg = 0u - (cpar__f32_bits(u) >> 31); /* the factor e where u < 0, else 1 */
    *h = q * cpar__bits_f32((cpar__f32_bits(e) & neg) | (0x3f800000u & ~neg));
    return e * (q * q);
}

CPAR__INLINE void cpar__host_gelu_body(const void *x, const void *dy, void *out, cpar_dtype dt, int64_t n, bool fused) {
    float xb[CPAR__BLK], gb[CPAR__BLK], ob[CPAR__BLK];
    if (!dy) {
        CPAR__BLOCKS(n, i0, m, const float *xp = cpar__blk_in(xb, x, dt, i0, m); float *o = cpar__blk_dst(ob, out, dt, i0);
                     CPAR__IVDEP for (int k = 0; k < m; k++) {
                         float h;
                         cpar__gelu_terms(xp[k], fused, &h);
                         o[k] = xp[k] * h;
                     }
                     cpar__blk_out(out, dt, i0, o, m);)
        return;
    }
    CPAR__BLOCKS(n, i0, m, const float *xp = cpar__blk_in(xb, x, dt, i0, m), *gp = cpar__blk_in(gb, dy, dt, i0, m);
                 float *o = cpar__blk_dst(ob, out, dt, i0);
                 CPAR__IVDEP for (int k = 0; k < m; k++) {
                     const float v = xp[k];
                     float h;
                     const float eq2 = cpar__gelu_terms(v, fused, &h);
                     const float d = 2.f * v * eq2 * (0.79788456f + 0.1070322243f * v * v) + h;
                     o[k] = d * gp[k];
                 }
                 cpar__blk_out(out, dt, i0, o, m);)
}
CPAR__VARIANTS_FMA(cpar__host_gelu, (const void *x, const void *dy, void *out, cpar_dtype dt, int64_t n),
               (x, dy, out, dt, n))

/* GeLU of a 16-bit tensor by table (ggml keeps one for fp16): for each of
 * the dtype's 65536 values x, gelu(x) rounded to the dtype and gelu'(x) in
 * fp32, made once per process by cpar__host_gelu from the fp32 value it
 * widens x to, so a lookup gives the very bits of the computation: the
 * forward's output, and the backward's dy * gelu'(x) rounded. It saves the
 * exp and the division that bound a 16-bit call at a quarter of memory
 * speed. 384 KiB per dtype, zero pages until that dtype's GeLU first runs
 * on the host. The first caller builds it (0.7 ms); a caller that finds
 * it being built computes directly instead, with the same bits: no lock,
 * no wait, and a child forked mid-build computes directly for good. */
#define CPAR__GELU_LUT (1 << 16)
typedef struct {
    uint16_t y[CPAR__GELU_LUT + 2]; /* + 2: a gather of 32 bits at the last entry */
    float d[CPAR__GELU_LUT];
} cpar__gelu_lut;
static cpar__gelu_lut cpar__gelu_luts[2]; /* BF16, F16 */
static atomic_int cpar__gelu_lut_state[2]; /* 0 none, 1 being built, 2 ready */

/* dt's table, or NULL while another thread builds it. */
static const cpar__gelu_lut *cpar__gelu_lut_get(cpar_dtype dt) {
    const int i = dt == CPAR_F16;
    cpar__gelu_lut *t = &cpar__gelu_luts[i];
    int state = atomic_load_explicit(&cpar__gelu_lut_state[i], memory_order_acquire);
    if (state == 2) return t;
    if (state != 0 || !atomic_compare_exchange_strong(&cpar__gelu_lut_state[i], &state, 1)) return NULL;
    for (int v = 0; v < CPAR__GELU_LUT; v++) t->y[v] = (uint16_t)v;
    cpar__host_gelu(t->y, NULL, t->y, dt, CPAR__GELU_LUT);
    float xb[CPAR__BLK], ones[CPAR__BLK];
    for (int k = 0; k < CPAR__BLK; k++) ones[k] = 1.f;
    for (int v0 = 0; v0 < CPAR__GELU_LUT; v0 += CPAR__BLK) { /* gelu'(x) = 1 * gelu'(x), exactly */
        for (int k = 0; k < CPAR__BLK; k++) {
            const uint16_t v = (uint16_t)(v0 + k);
            xb[k] = dt == CPAR_BF16 ? cpar__bf16_value(v) : cpar__f16_value(v);
        }
        cpar__host_gelu(xb, ones, t->d + v0, CPAR_F32, CPAR__BLK);
    }
    atomic_store_explicit(&cpar__gelu_lut_state[i], 2, memory_order_release);
    return t;
}

/* o16[k] = y[x[k]] for k < n (o16 may be x). The AVX2 version gathers 8
 * entries an instruction, 1.4x the scalar loop's rate here; it returns how
 * many it did, a multiple of 16, and the caller does the rest. (A gather
 * of fp32 entries was slower than the scalar loads that gcc vectorises
 * the backward's lookups into.) */
#ifdef CPAR__X86_KERNELS
__attribute__((target("avx2"))) static int64_t cpar__lut16_avx2(const uint16_t *y, const uint16_t *x, uint16_t *o16,
                                                                int64_t n) {
    const __m256i low = _mm256_set1_epi32(0xffff);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) { /* 32 bits at y + x[k], the low half kept (y has a spare entry at its end) */
        const __m256i i0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + i)));
        const __m256i i1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + i + 8)));
        const __m256i g0 = _mm256_and_si256(_mm256_i32gather_epi32((const int *)(const void *)y, i0, 2), low);
        const __m256i g1 = _mm256_and_si256(_mm256_i32gather_epi32((const int *)(const void *)y, i1, 2), low);
        _mm256_storeu_si256((__m256i *)(o16 + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(g0, g1), 0xd8));
    }
    return i;
}
#endif
static void cpar__lut16(const uint16_t *y, const uint16_t *x, uint16_t *o16, int64_t n) {
    int64_t i = 0;
#ifdef CPAR__X86_KERNELS
    if (cpar__cpu_avx2()) i = cpar__lut16_avx2(y, x, o16, n);
#endif
    for (; i < n; i++) o16[i] = y[x[i]];
}

/* cpar__host_gelu of a 16-bit tensor through its table t. */
CPAR__INLINE void cpar__host_gelu_lut_body(const cpar__gelu_lut *t, const void *x, const void *dy, void *out,
                                           cpar_dtype dt, int64_t n) {
    if (!dy) {
        cpar__lut16(t->y, x, out, n);
        return;
    }
    float db[CPAR__BLK], gb[CPAR__BLK], ob[CPAR__BLK];
    const uint16_t *x16 = x;
    CPAR__BLOCKS(n, i0, m, for (int k = 0; k < m; k++) db[k] = t->d[x16[i0 + k]];
                 const float *gp = cpar__blk_in(gb, dy, dt, i0, m);
                 CPAR__IVDEP for (int k = 0; k < m; k++) ob[k] = db[k] * gp[k];
                 cpar__blk_out(out, dt, i0, ob, m);)
}
CPAR__VARIANTS(cpar__host_gelu_lut,
               (const cpar__gelu_lut *t, const void *x, const void *dy, void *out, cpar_dtype dt, int64_t n),
               (t, x, dy, out, dt, n))

/* ---- GEMM on host memory ---------------------------------------------------
 * C (m x n, column-major, ldc) = alpha op(A) op(B) + beta C, cuBLAS's argument
 * semantics (op(A) is m x k: A, or A^T when ta), A and B F32, F16 or BF16, C
 * F32, F16 or BF16, fp32 accumulation; beta 0 never reads C (it may be NaN).
 * The BLIS loop order: KC-deep, NC-wide panels of op(B) are packed into
 * NR-wide slivers, MC-tall panels of op(A) into MR-tall slivers (16-bit
 * operands widened to fp32 while packing), and an MR x NR register-blocked
 * micro-kernel runs over them, C += alpha a·b. The micro-kernel is AVX-512F
 * (32 x 12) or AVX2+FMA (16 x 6), chosen at run time where the CPU has it
 * (the two run the same FMAs in the same order: the same bits), else
 * portable C (8 x 4).
 * Every element of C adds its k products in order p = 0..k-1 whatever the
 * blocking, so a result does not depend on m, n or on how a caller splits
 * them. bf16 x bf16 products on a CPU with AVX512-BF16 run a 32 x 12 kernel
 * of vdpbf16ps instead: the panels keep the bf16 values, two of k per 32-bit
 * word (the pair (2q, 2q+1) of every row, the odd k's last pair padded with
 * a zero), and each instruction adds both products of a pair to an fp32
 * accumulator (exact products, odd then even, rounded to nearest, bf16 and
 * fp32 subnormals flushed), so every element of C still adds its products in
 * one order whatever the blocking. f16 keeps the widening path (f16 does not
 * fit bf16 exactly). CPAR_HOST_GEMM names a kernel to force it: amx and
 * avx512bf16 (bf16 products), avx512, avx2, c (every product; each implies
 * builtin). A 16-bit C is accumulated in an fp32 copy and rounded once,
 * except a bf16 C with beta 0 and k within one block: each micro-tile is
 * rounded from a buffer in L1 straight into C (the fp32 copy's write and
 * read cost more than the products at k 64); AMX stores a C above 1 MiB by
 * non-temporal stores, which do not read its lines first. AMX reads op(B)
 * where it lies when its k is contiguous (x in the linear layer's forward)
 * and the block's k is whole tiles: no packing; then k up to 4096 is one
 * block. With a CBLAS (built with CPAR_WITH_CBLAS: OpenBLAS, BLIS), all-F32
 * products go to cblas_sgemm. The packed panels live in ctx->gemm_ws (host
 * memory, grown once). */

enum {
    CPAR__GEMM_MC = 144, CPAR__GEMM_MC_AMX = 256, CPAR__GEMM_KC = 256, CPAR__GEMM_KC_WHOLE = 4096, CPAR__GEMM_NC = 3072,
    CPAR__GEMM_MAX_TILE = 32 * 32,
    CPAR__GEMM_STREAM_BYTES = 1 << 20, /* a bf16 C above this is stored past the caches (cpar__gemm_blocked) */
    CPAR__GEMM_L1_BYTES = 48 << 10     /* a data cache of the CPUs with AMX (Sapphire Rapids and later) */
};

/* c (mr x nr, column-major, ldc) = alpha * sum_p a[p*mr + i] b[p*nr + j]
 * + beta c; beta 0 never reads c. kw: 32-bit words per row of a sliver (kc
 * floats; with bf16 pairs ceil(kc / 2) pairs). */
typedef void (*cpar__gemm_ukernel)(int64_t kw, const void *a, const void *b, float *c, int64_t ldc, float alpha,
                                   float beta);

/* op(B)'s sliver for one micro-tile: packed (ldb 0) or where it lies. */
typedef struct {
    const void *p;
    int64_t ldb;
} cpar__gemm_sliver;

/* A whole 32 x 32 fp32 tile (column j at t + 32 j) to round into a bf16 C;
 * stream: by non-temporal stores where a column's 64 bytes are a whole
 * cache line (cpar__gemm_blocked says when). */
typedef struct {
    const float *t;
    uint16_t *c;
    int64_t ldc;
    bool stream;
} cpar__gemm_rounding;

/* AMX: lines fetched into L2 among a tile's products, per_tile of them a
 * tile, a few each k-step: rows of lines_per_row lines, ld bytes apart from
 * base; next counts those fetched, up to end. */
typedef struct {
    const char *base;
    int64_t ld, lines_per_row, next, end, per_tile;
} cpar__gemm_prefetch;

typedef struct cpar__gemm_kernel {
    int mr, nr;
    bool bf16_pairs; /* panels of bf16 pairs (cpar__gemm_pack_bf16), not fp32 */
    bool b_tiles;    /* AMX: op(B)'s panel in rows of 16 pairs (cpar__gemm_pack_bf16_rows), kw a multiple of 16 */
    void (*enter)(void), (*leave)(void); /* or NULL: around a thread's run of the kernel (AMX's tile state) */
    cpar__gemm_ukernel run;
    /* or (AMX) run with op(B)'s sliver packed or where it lies (k
     * contiguous, columns ldb apart, whole k tiles), rounding r (or NULL),
     * the previous tile's, and fetching pf's next lines (or NULL) among
     * its tile products; a_far: op(A)'s panel outgrows L1 */
    void (*run_amx)(int64_t kw, const void *a, bool a_far, cpar__gemm_sliver b, float *c, int64_t ldc, float alpha,
                    float beta, const cpar__gemm_rounding *r, cpar__gemm_prefetch *pf);
    const char *name;
} cpar__gemm_kernel;

/* CPAR_HOST_GEMM's kernel choice (ctx->gemm_force). */
enum {
    CPAR__GEMM_AUTO = 0, CPAR__GEMM_FORCE_AMX, CPAR__GEMM_FORCE_BF16, CPAR__GEMM_FORCE_AVX512, CPAR__GEMM_FORCE_AVX2,
    CPAR__GEMM_FORCE_C
};

/* 32-bit words per sliver row for kc of k: kc floats, or ceil(kc / 2) bf16
 * pairs (AMX: rounded up to whole tiles of 16 pairs, padded with zeros). */
static int64_t cpar__gemm_kw(const cpar__gemm_kernel *K, int64_t kc) {
    if (!K->bf16_pairs) return kc;
    return K->b_tiles ? (kc + 31) / 32 * 16 : (kc + 1) / 2;
}

static void cpar__gemm_ukernel_c(int64_t kc, const void *av, const void *bv, float *c, int64_t ldc, float alpha,
                                 float beta) {
    const float *a = av, *b = bv;
    float acc[4][8] = {{0}};
    for (int64_t p = 0; p < kc; p++)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 8; i++) acc[j][i] += a[8 * p + i] * b[4 * p + j];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 8; i++)
            c[i + j * ldc] = alpha * acc[j][i] + (beta == 0.f ? 0.f : beta * c[i + j * ldc]);
}

#ifdef CPAR__X86_KERNELS
/* 16 x 6: twelve accumulators, two A loads and six broadcasts per p, all in
 * the sixteen ymm registers. a is 32-byte aligned (packed panels). */
__attribute__((target("avx2,fma"))) static void cpar__gemm_ukernel_avx2(int64_t kc, const void *av, const void *bv,
                                                                       float *c, int64_t ldc, float alpha, float beta) {
    const float *a = av, *b = bv;
    __m256 lo[6], hi[6];
#pragma GCC unroll 6
    for (int j = 0; j < 6; j++) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int64_t p = 0; p < kc; p++) {
        const __m256 a0 = _mm256_load_ps(a + 16 * p), a1 = _mm256_load_ps(a + 16 * p + 8);
#pragma GCC unroll 6
        for (int j = 0; j < 6; j++) {
            const __m256 bj = _mm256_broadcast_ss(b + 6 * p + j);
            lo[j] = _mm256_fmadd_ps(a0, bj, lo[j]);
            hi[j] = _mm256_fmadd_ps(a1, bj, hi[j]);
        }
    }
    const __m256 al = _mm256_set1_ps(alpha), be = _mm256_set1_ps(beta);
    if (beta == 0.f) {
#pragma GCC unroll 6
        for (int j = 0; j < 6; j++) {
            _mm256_storeu_ps(c + j * ldc, _mm256_mul_ps(al, lo[j]));
            _mm256_storeu_ps(c + j * ldc + 8, _mm256_mul_ps(al, hi[j]));
        }
        return;
    }
#pragma GCC unroll 6
    for (int j = 0; j < 6; j++) {
        float *cj = c + j * ldc;
        _mm256_storeu_ps(cj, _mm256_fmadd_ps(al, lo[j], _mm256_mul_ps(be, _mm256_loadu_ps(cj))));
        _mm256_storeu_ps(cj + 8, _mm256_fmadd_ps(al, hi[j], _mm256_mul_ps(be, _mm256_loadu_ps(cj + 8))));
    }
}
#endif

#ifdef CPAR__X86_KERNELS
/* The 32 x 12 kernels' epilogue: c (column j at c + j*ldc) = alpha (lo, hi)
 * + beta c; beta 0 never reads c. Inlined, so the accumulators stay in
 * registers. */
__attribute__((target("avx512f"), always_inline)) static inline void
cpar__gemm_store_32x12(float *c, int64_t ldc, float alpha, float beta, const __m512 *lo, const __m512 *hi) {
    const __m512 al = _mm512_set1_ps(alpha), be = _mm512_set1_ps(beta);
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) {
        float *cj = c + j * ldc;
        if (beta == 0.f) {
            _mm512_storeu_ps(cj, _mm512_mul_ps(al, lo[j]));
            _mm512_storeu_ps(cj + 16, _mm512_mul_ps(al, hi[j]));
        } else {
            _mm512_storeu_ps(cj, _mm512_fmadd_ps(al, lo[j], _mm512_mul_ps(be, _mm512_loadu_ps(cj))));
            _mm512_storeu_ps(cj + 16, _mm512_fmadd_ps(al, hi[j], _mm512_mul_ps(be, _mm512_loadu_ps(cj + 16))));
        }
    }
}

/* 32 x 12 on fp32 with AVX-512: 24 zmm accumulators, two A loads and twelve
 * broadcasts per p, the AVX2 kernel's arithmetic in twice the lanes (the
 * same FMAs in the same order: the same bits). */
__attribute__((target("avx512f"))) static void cpar__gemm_ukernel_avx512(int64_t kc, const void *av, const void *bv,
                                                                        float *c, int64_t ldc, float alpha,
                                                                        float beta) {
    const float *a = av, *b = bv;
    __m512 lo[12], hi[12];
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) lo[j] = hi[j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kc; p++) {
        const __m512 a0 = _mm512_loadu_ps(a + 32 * p), a1 = _mm512_loadu_ps(a + 32 * p + 16);
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) {
            const __m512 bj = _mm512_set1_ps(b[12 * p + j]);
            lo[j] = _mm512_fmadd_ps(a0, bj, lo[j]);
            hi[j] = _mm512_fmadd_ps(a1, bj, hi[j]);
        }
    }
    cpar__gemm_store_32x12(c, ldc, alpha, beta, lo, hi);
}
#endif

#ifdef CPAR__X86_KERNELS
/* One sliver of an F32 matrix whose rows are contiguous (a row-major tile, or
 * a transposed operand): h <= w rows r of `cols` floats at src + r*rs go to
 * dst[c*w + r], rows h..w-1 as zeros; w is a micro-kernel's mr or nr (16, 6,
 * 32, 12). 8 x 8 blocks are transposed in registers: the scalar loop's
 * strided stores made packing cost as much as the product in attention's
 * tiles. */
__attribute__((target("avx2,fma"))) static void cpar__gemm_pack_rows_avx2(float *dst, const float *src, int64_t rs,
                                                                         int64_t h, int64_t cols, int w) {
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(w % 8), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    int64_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8)
        for (int half = 0; half < (w + 7) / 8; half++) {
            __m256 r[8], t[8], u[8];
            for (int i = 0; i < 8; i++) {
                const int64_t row = half * 8 + i;
                r[i] = row < h && row < w ? _mm256_loadu_ps(src + row * rs + c0) : _mm256_setzero_ps();
            }
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
                u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
            }
            for (int c = 0; c < 4; c++) { /* column c0 + c and c0 + c + 4: rows half*8 .. half*8 + 7 */
                const __m256 lo = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20), hi = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
                float *d0 = dst + (c0 + c) * w + half * 8, *d1 = dst + (c0 + c + 4) * w + half * 8;
                if (half * 8 + 8 <= w) {
                    _mm256_storeu_ps(d0, lo);
                    _mm256_storeu_ps(d1, hi);
                } else { /* the sliver's last w % 8 rows */
                    _mm256_maskstore_ps(d0, tail, lo);
                    _mm256_maskstore_ps(d1, tail, hi);
                }
            }
        }
    for (; c0 < cols; c0++) /* the last columns one by one */
        for (int i = 0; i < w; i++) dst[c0 * w + i] = i < h ? src[i * rs + c0] : 0.f;
}
#endif

#ifdef CPAR__X86_KERNELS
/* 32 x 12 on bf16 pairs: 24 zmm accumulators, two A loads and twelve pair
 * broadcasts per pair of k, 24 vdpbf16ps. a and b: kw pairs of 32 and 12
 * rows (cpar__gemm_pack_bf16). */
__attribute__((target("avx512f,avx512bf16"))) static void cpar__gemm_ukernel_bf16(int64_t kw, const void *av,
                                                                                 const void *bv, float *c,
                                                                                 int64_t ldc, float alpha,
                                                                                 float beta) {
    const uint32_t *a = av, *b = bv;
    __m512 lo[12], hi[12];
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) lo[j] = hi[j] = _mm512_setzero_ps();
    for (int64_t q = 0; q < kw; q++) {
        const __m512bh a0 = (__m512bh)_mm512_loadu_si512(a + 32 * q), a1 = (__m512bh)_mm512_loadu_si512(a + 32 * q + 16);
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) {
            const __m512bh bj = (__m512bh)_mm512_set1_epi32((int)b[12 * q + j]);
            lo[j] = _mm512_dpbf16_ps(lo[j], a0, bj);
            hi[j] = _mm512_dpbf16_ps(hi[j], a1, bj);
        }
    }
    cpar__gemm_store_32x12(c, ldc, alpha, beta, lo, hi);
}

/* AMX, 32 x 32: C's transpose in four 16 x 16 fp32 tiles (a tile row is 16
 * floats of one column of C, so tiles load and store C in place), each
 * k-step of 32 four TDPBF16PS of two "A" tiles (op(B)'s panel: 16 columns
 * of C by 32 k, cpar__gemm_pack_bf16_rows) and two "B" tiles (op(A)'s panel
 * of pairs: 16 pairs of k by 16 rows of C, rows of 128 bytes). alpha 1 with
 * beta 0 or 1 (every block of the blocked product but a scaled one) goes
 * straight to c; otherwise through a buffer. The tile configuration (eight
 * tiles of 16 rows of 64 bytes) is loaded when a thread starts its part of
 * a product and released when it ends it: the tiles hold nothing between
 * calls. */
typedef struct cpar__amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} cpar__amx_cfg;

/* A constant in memory: the compiler does not see LDTILECFG read all 64
 * bytes, so a configuration built on the stack lost its zeroing stores. */
static const cpar__amx_cfg cpar__amx_tiles = {.palette = 1,
                                              .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                              .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

__attribute__((target("amx-tile"))) static void cpar__gemm_amx_enter(void) { _tile_loadconfig(&cpar__amx_tiles); }

__attribute__((target("amx-tile"))) static void cpar__gemm_amx_leave(void) { _tile_release(); }

/* 16 fp32 at t rounded to bf16 at c, as cpar__bf16_bits rounds them (to
 * nearest even; a NaN quieted, its sign kept). */
__attribute__((target("avx512f"), always_inline)) static inline void cpar__gemm_round16(uint16_t *c, const float *t) {
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(t));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rne = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i r = _mm512_mask_or_epi32(rne, nan, u, _mm512_set1_epi32(0x400000));
    _mm256_storeu_si256((__m256i *)c, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

/* 32 fp32 tile outputs at t rounded to bf16 at c by one VCVTNE2PS2BF16:
 * round to nearest even, a NaN quieted with its sign kept, as
 * cpar__bf16_bits, except that it flushes subnormal inputs, which tile
 * products never are (TDPBF16PS flushes subnormal results to zero).
 * stream: a non-temporal store when c is a whole cache line. */
__attribute__((target("avx512f,avx512bf16"), always_inline)) static inline void
cpar__gemm_round32_tile(uint16_t *c, const float *t, bool stream) {
    const __m512bh r = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(t + 16), _mm512_loadu_ps(t));
    if (stream && ((uintptr_t)c & 63) == 0) _mm512_stream_si512((void *)c, (__m512i)r);
    else _mm512_storeu_si512(c, (__m512i)r);
}

/* op(B)'s tiles: a packed sliver (b.ldb 0: k-step q / 16 at word 32 q,
 * columns 16..31 256 words on, rows 64 bytes apart) or where it lies (word
 * q, 8 ldb words on, rows 2 ldb bytes apart). r: a previous tile's
 * rounding, a column after each k-step's products (the rest after the
 * last): the vector unit's work then overlaps the tile unit's, where
 * rounding each tile after its products cost a sixth of the time at k
 * 1024. a_far: op(A)'s tiles by TILELOADDT1, not kept in L1. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16"))) static void
cpar__gemm_ukernel_amx(int64_t kw, const void *av, bool a_far, cpar__gemm_sliver bs, float *c, int64_t ldc, float alpha,
                       float beta, const cpar__gemm_rounding *r, cpar__gemm_prefetch *pf) {
    const bool direct = alpha == 1.f && (beta == 0.f || beta == 1.f);
    const size_t ldb = (size_t)ldc * sizeof(float);
    if (direct && beta == 1.f) {
        _tile_loadd(0, c, ldb);
        _tile_loadd(1, c + 16, ldb);
        _tile_loadd(2, c + 16 * ldc, ldb);
        _tile_loadd(3, c + 16 + 16 * ldc, ldb);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    const uint32_t *a = av, *b = bs.p;
    const int64_t b_step = bs.ldb ? 1 : 32, b_half = bs.ldb ? 8 * bs.ldb : 16 * 16, b_row = bs.ldb ? 2 * bs.ldb : 64;
    int v = r ? 0 : 32; /* columns of r done */
    int64_t pf_end = 0, pf_step = 0;
    if (pf) pf_end = cpar__min64(pf->end, pf->next + pf->per_tile), pf_step = (pf->per_tile + kw / 16 - 1) / (kw / 16);
    for (int64_t q = 0; q < kw; q += 16) {
        if (pf)
            for (int64_t e = cpar__min64(pf->next + pf_step, pf_end); pf->next < e; pf->next++) {
                const int64_t row = pf->next / pf->lines_per_row, col = pf->next % pf->lines_per_row;
                _mm_prefetch(pf->base + row * pf->ld + col * 64, _MM_HINT_T1);
            }
        _tile_loadd(4, b + q * b_step, b_row);          /* columns 0..15 of C, k-step q / 16 */
        _tile_loadd(5, b + q * b_step + b_half, b_row); /* columns 16..31 */
        if (a_far) {
            _tile_stream_loadd(6, a + q * 32, 128);      /* rows 0..15 of C: 16 pairs of k */
            _tile_stream_loadd(7, a + q * 32 + 16, 128); /* rows 16..31 */
        } else {
            _tile_loadd(6, a + q * 32, 128);
            _tile_loadd(7, a + q * 32 + 16, 128);
        }
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (v < 32) cpar__gemm_round32_tile(r->c + v * r->ldc, r->t + 32 * v, r->stream), v++;
    }
    for (; v < 32; v++) cpar__gemm_round32_tile(r->c + v * r->ldc, r->t + 32 * v, r->stream);
    if (direct) {
        _tile_stored(0, c, ldb);
        _tile_stored(1, c + 16, ldb);
        _tile_stored(2, c + 16 * ldc, ldb);
        _tile_stored(3, c + 16 + 16 * ldc, ldb);
    } else {
        _Alignas(64) float t[32 * 32]; /* column j of C at t + 32 j */
        _tile_stored(0, t, 128);
        _tile_stored(1, t + 16, 128);
        _tile_stored(2, t + 16 * 32, 128);
        _tile_stored(3, t + 16 + 16 * 32, 128);
        const __m512 al = _mm512_set1_ps(alpha), be = _mm512_set1_ps(beta);
        for (int j = 0; j < 32; j++)
            for (int h = 0; h < 32; h += 16) {
                float *cj = c + j * ldc + h;
                const __m512 x = _mm512_mul_ps(al, _mm512_loadu_ps(t + 32 * j + h));
                _mm512_storeu_ps(cj, beta == 0.f ? x : _mm512_fmadd_ps(be, _mm512_loadu_ps(cj), x));
            }
    }
}

/* Sixteen rows' pairs q0 .. q0+nq-1 from rows rs elements apart whose pairs
 * are adjacent (k contiguous): dst[q*w + i] = word q of row i. Sixteen
 * pairs at a time: a 64-byte load per row and a 16 x 16 transpose of words
 * in registers (four rounds of swapping the off-diagonal blocks of 8, 4, 2
 * and 1: 64 two-source permutes per 1 KB, where a gather per q made 256
 * loads of 4 bytes; the linear shape ran 3 % faster); the rest by gathers. */
__attribute__((target("avx512f"))) static void cpar__gemm_rows16_avx512(uint32_t *dst, const uint16_t *row0,
                                                                       int64_t rs, int64_t nq, int w) {
    int64_t q = 0;
    if (nq >= 16) {
        __m512i lo[4], hi[4]; /* round b: lane j of a row pair's first row from lo, of the second from hi */
        for (int r = 0, b = 8; r < 4; r++, b /= 2) {
            int32_t l[16], h[16];
            for (int j = 0; j < 16; j++) {
                l[j] = (j / b) % 2 == 0 ? j : 16 + j - b;
                h[j] = (j / b) % 2 == 0 ? j + b : 16 + j;
            }
            lo[r] = _mm512_loadu_si512(l);
            hi[r] = _mm512_loadu_si512(h);
        }
        for (; q + 16 <= nq; q += 16) {
            __m512i v[16]; /* fully unrolled: in registers */
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) v[i] = _mm512_loadu_si512(row0 + i * rs + 2 * q);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) { /* the pair (i, i + b) */
                    const int b = 8 >> r, i = t / b * 2 * b + t % b;
                    const __m512i x = v[i], y = v[i + b];
                    v[i] = _mm512_permutex2var_epi32(x, lo[r], y);
                    v[i + b] = _mm512_permutex2var_epi32(x, hi[r], y);
                }
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + (q + i) * w, v[i]);
        }
    }
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)(rs * 2)));
    for (; q < nq; q++)
        _mm512_storeu_si512(dst + q * w, _mm512_i32gather_epi32(idx, (const void *)(row0 + 2 * q), 1));
}

/* Sixteen rows' bf16 pairs from two strided columns (k = 2q and 2q + 1, c1
 * NULL: past k, zeros): dst[i] = c0[i] | c1[i] << 16. */
__attribute__((target("avx512f"))) static void cpar__gemm_pairs16_avx512(uint32_t *dst, const uint16_t *c0,
                                                                        const uint16_t *c1) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)c0));
    const __m512i hi = c1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)c1)) : _mm512_setzero_si512();
    _mm512_storeu_si512(dst, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
}

/* cpar__gemm_round_bf16 for mm a multiple of 16. */
__attribute__((target("avx512f"))) static void cpar__gemm_round_bf16_avx512(uint16_t *c, int64_t ldc, const float *t,
                                                                           int mr, int64_t mm, int64_t nn) {
    for (int64_t j = 0; j < nn; j++)
        for (int64_t i = 0; i < mm; i += 16) cpar__gemm_round16(c + i + j * ldc, t + i + j * mr);
}
#endif

/* rows x cols (cols = kc) of a bf16 matrix whose element (r, c) is at
 * src[r*rs + c*cs], as slivers of w rows of bf16 pairs along c: word
 * dst[s*w*kw + q*w + i] = element (s*w + i, 2q) | element (s*w + i, 2q+1) << 16,
 * kw = ceil(cols / 2); rows past the matrix and the odd cols' last half are
 * zeros. */
static void cpar__gemm_pack_bf16(uint32_t *dst, const uint16_t *src, int64_t rs, int64_t cs, int64_t rows,
                                 int64_t cols, int64_t kw, int w) {
    for (int64_t r0 = 0; r0 < rows; r0 += w) {
        const int64_t h = cpar__min64(w, rows - r0);
        uint32_t *d = dst + r0 * kw;
        const uint16_t *s0 = src + r0 * rs;
        if (cs == 1) { /* pairs are adjacent in a row: whole words */
            int64_t i0 = 0;
#ifdef CPAR__X86_KERNELS
            if (rs * 2 * 15 < INT32_MAX && cpar__cpu_avx512bf16()) /* byte offsets of 16 rows fit the gather */
                for (; i0 + 16 <= h; i0 += 16) cpar__gemm_rows16_avx512(d + i0, s0 + i0 * rs, rs, cols / 2, w);
#endif
            for (int64_t i = 0; i < h; i++) {
                if (i < i0 && cols % 2 == 0) continue; /* gathered */
                const uint16_t *row = s0 + i * rs;
                for (int64_t q = i < i0 ? cols / 2 : 0; q < cols / 2; q++) {
                    uint32_t x;
                    memcpy(&x, row + 2 * q, sizeof x);
                    d[q * w + i] = x;
                }
                if (cols % 2) d[(cols / 2) * w + i] = row[cols - 1];
            }
        } else {
            for (int64_t q = 0; q < (cols + 1) / 2; q++) {
                const uint16_t *c0 = s0 + 2 * q * cs, *c1 = 2 * q + 1 < cols ? c0 + cs : NULL;
                int64_t i = 0;
#ifdef CPAR__X86_KERNELS
                if (rs == 1 && cpar__cpu_avx512bf16())
                    for (; i + 16 <= h; i += 16) cpar__gemm_pairs16_avx512(d + q * w + i, c0 + i, c1 ? c1 + i : NULL);
#endif
                for (; i < h; i++) d[q * w + i] = c0[i * rs] | (c1 ? (uint32_t)c1[i * rs] << 16 : 0u);
            }
        }
        for (int64_t q = 0; h < w && q < kw; q++) /* the last sliver's padding rows */
            for (int64_t i = h; i < w; i++) d[q * w + i] = 0;
        for (int64_t q = (cols + 1) / 2; q < kw; q++) /* AMX: pairs up to a whole tile */
            for (int64_t i = 0; i < w; i++) d[q * w + i] = 0;
    }
}

/* op(B)'s panel for AMX: rows x cols (cols = kc) of a bf16 matrix whose
 * element (r, c) is at src[r*rs + c*cs], as slivers of w rows, each tile
 * rows of 16 pairs: word dst[s*w*kw + ((q/16)*w + i)*16 + q%16] = element
 * (s*w + i, 2q) | element (s*w + i, 2q+1) << 16 for q < kw (kw a multiple of
 * 16); past the matrix, zeros. */
static void cpar__gemm_pack_bf16_rows(uint32_t *dst, const uint16_t *src, int64_t rs, int64_t cs, int64_t rows,
                                      int64_t cols, int64_t kw, int w) {
    const int64_t pairs = cols / 2; /* whole pairs; an odd cols' last one is half a pair */
    for (int64_t r0 = 0; r0 < rows; r0 += w) {
        const int64_t h = cpar__min64(w, rows - r0);
        uint32_t *d = dst + r0 * kw;
        for (int64_t i = 0; i < w; i++) {
            const uint16_t *row = src + (r0 + i) * rs;
            for (int64_t q0 = 0; q0 < kw; q0 += 16) {
                uint32_t *o = d + ((q0 / 16) * w + i) * 16;
                int64_t q = q0;
                if (i < h && cs == 1 && q0 + 16 <= pairs) { /* a whole run of 16 pairs: 64 bytes */
                    memcpy(o, row + 2 * q0, 64);
                    continue;
                }
                for (; q < q0 + 16; q++) {
                    uint32_t x = 0;
                    if (i < h && q < pairs) x = row[2 * q * cs] | (uint32_t)row[(2 * q + 1) * cs] << 16;
                    else if (i < h && q == pairs && cols % 2) x = row[2 * q * cs];
                    o[q - q0] = x;
                }
            }
        }
    }
}

/* The micro-kernel for a product of adt x bdt on this CPU, as CPAR_HOST_GEMM
 * (force) allows; a forced kernel the CPU lacks was refused with the context. */
static cpar__gemm_kernel cpar__gemm_kernel_pick(int force, cpar_dtype adt, cpar_dtype bdt) {
    (void)adt, (void)bdt;
#ifdef CPAR__X86_KERNELS
    const bool bf16 = adt == CPAR_BF16 && bdt == CPAR_BF16;
    if ((force == CPAR__GEMM_AUTO || force == CPAR__GEMM_FORCE_AMX) && bf16 && cpar__cpu_amx() && cpar__cpu_avx512bf16())
        return (cpar__gemm_kernel){32, 32, true, true, cpar__gemm_amx_enter, cpar__gemm_amx_leave,
                                   NULL, cpar__gemm_ukernel_amx, "amx-bf16 32x32"};
    if ((force == CPAR__GEMM_AUTO || force == CPAR__GEMM_FORCE_BF16) && bf16 && cpar__cpu_avx512bf16())
        return (cpar__gemm_kernel){32, 12, true, false, NULL, NULL, cpar__gemm_ukernel_bf16, NULL, "avx512-bf16 32x12"};
    if (force != CPAR__GEMM_FORCE_AVX2 && force != CPAR__GEMM_FORCE_C && cpar__cpu_avx512())
        return (cpar__gemm_kernel){32, 12, false, false, NULL, NULL, cpar__gemm_ukernel_avx512, NULL, "avx512f 32x12"};
    if (force != CPAR__GEMM_FORCE_C && cpar__cpu_avx2())
        return (cpar__gemm_kernel){16, 6, false, false, NULL, NULL, cpar__gemm_ukernel_avx2, NULL, "avx2+fma 16x6"};
#else
    (void)force;
#endif
    return (cpar__gemm_kernel){8, 4, false, false, NULL, NULL, cpar__gemm_ukernel_c, NULL, "portable C 8x4"};
}

/* rows x cols of a matrix whose element (r, c) is at src[r*rs + c*cs], widened
 * to fp32, into slivers of w rows (zero-padded): dst[s*w*cols + c*w + i] is
 * element (s*w + i, c). The dtype switch is outside the loops. */
static void cpar__gemm_pack(float *dst, const void *src, cpar_dtype dt, int64_t rs, int64_t cs, int64_t rows,
                            int64_t cols, int w) {
    /* Read along whichever of rows and columns is contiguous in src. */
    const bool by_row = rs != 1 && cs == 1;
#ifdef CPAR__X86_KERNELS
    if (cpar__cpu_avx2() && by_row && dt == CPAR_F32 && (w % 8 == 0 || w == 6 || w == 12)) {
        for (int64_t r0 = 0; r0 < rows; r0 += w)
            cpar__gemm_pack_rows_avx2(dst + r0 * cols, (const float *)src + r0 * rs, rs, cpar__min64(w, rows - r0), cols, w);
        return;
    }
#endif
    if (!by_row && rs == 1 && dt == CPAR_F32) { /* contiguous columns: copies of w floats */
        for (int64_t r0 = 0; r0 < rows; r0 += w) {
            const int64_t h = cpar__min64(w, rows - r0);
            float *d = dst + r0 * cols;
            const float *sp = (const float *)src + r0;
            for (int64_t c = 0; c < cols; c++, d += w) {
                if (h == w) memcpy(d, sp + c * cs, sizeof(float) * (size_t)w);
                else for (int64_t i = 0; i < w; i++) d[i] = i < h ? sp[c * cs + i] : 0.f;
            }
        }
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += w) {
        const int64_t h = cpar__min64(w, rows - r0);
        float *d = dst + r0 * cols;
        for (int64_t a = 0; a < (by_row ? h : cols); a++) {
            /* by_row: row i = a along every column; else column c = a along h rows */
            const int64_t base = r0 * rs + (by_row ? a * rs : a * cs), len = by_row ? cols : h;
            const int64_t step = by_row ? 1 : rs;
            float *o = by_row ? d + a : d + a * w;
            const int64_t ostep = by_row ? w : 1;
            switch (dt) {
            case CPAR_F32:
                for (int64_t i = 0; i < len; i++) o[i * ostep] = ((const float *)src)[base + i * step];
                break;
            case CPAR_F16:
                for (int64_t i = 0; i < len; i++) o[i * ostep] = cpar_f16_to_f32(((const uint16_t *)src)[base + i * step]);
                break;
            default:
                for (int64_t i = 0; i < len; i++) o[i * ostep] = cpar_bf16_to_f32(((const uint16_t *)src)[base + i * step]);
                break;
            }
        }
        if (h < w) /* zero the padding rows of the last sliver */
            for (int64_t c = 0; c < cols; c++)
                for (int64_t i = h; i < w; i++) d[c * w + i] = 0.f;
    }
}

/* The depth of k packed at a time: CPAR__GEMM_KC, four times that for AMX
 * (a tile product is 32 deep: fewer round trips of C through its tiles),
 * and for AMX all of k up to CPAR__GEMM_KC_WHOLE when op(B) is read where
 * it lies (not tb, whole k tiles): C then never leaves the tiles between k
 * blocks, and a bf16 C is rounded from each tile, not from an fp32 copy
 * (256 x 2048 x 8192 ran 27-32 % faster, 1024 x 4096 x 1024 7-13 %; at
 * 8192 the panels get too thin, 8-12 % slower). */
static int64_t cpar__gemm_kc(const cpar__gemm_kernel *K, int tb, int64_t k) {
    if (K->b_tiles && !tb && k % 32 == 0 && k > 0 && k <= CPAR__GEMM_KC_WHOLE) return k;
    return K->b_tiles ? 4 * CPAR__GEMM_KC : CPAR__GEMM_KC;
}

/* The rows of op(A) packed at a time in a product of n columns and depth
 * k: whole slivers, at most CPAR__GEMM_MC. AMX: CPAR__GEMM_MC_AMX, twice
 * that when op(B)'s block outgrows half of L2 (above 1 MiB): each sliver
 * of op(B) fetched from L3 then serves 16 tiles, not 8 (1024^3 ran 4 %
 * faster than at 256 rows, 9 % than at 128; the linear layer's 256 x 1024 x
 * 4096, whose x stays in L2, 10 % slower at 512). A block deeper than
 * 4 CPAR__GEMM_KC has proportionally fewer rows (whole slivers, at least
 * one): the panel keeps its bytes. */
static int64_t cpar__gemm_mc(const cpar__gemm_kernel *K, int tb, int64_t n, int64_t k) {
    if (!K->b_tiles) return CPAR__GEMM_MC / K->mr * K->mr;
    const int64_t kc = cpar__min64(k, cpar__gemm_kc(K, tb, k)), b_bytes = cpar__min64(n, CPAR__GEMM_NC) * kc * 2;
    const int64_t mc = b_bytes > (1 << 20) ? 2 * CPAR__GEMM_MC_AMX : CPAR__GEMM_MC_AMX;
    return kc <= 4 * CPAR__GEMM_KC ? mc : cpar__max64(K->mr, mc * 4 * CPAR__GEMM_KC / kc / K->mr * K->mr);
}

static inline void cpar__gemm_run(const cpar__gemm_kernel *K, int64_t kw, const void *a, bool a_far, cpar__gemm_sliver b,
                                  float *c, int64_t ldc, float alpha, float beta, cpar__gemm_prefetch *pf) {
    if (K->run_amx) K->run_amx(kw, a, a_far, b, c, ldc, alpha, beta, NULL, pf);
    else K->run(kw, a, b.p, c, ldc, alpha, beta);
}

/* A micro-tile's fp32 result (column j at t + j * mr) rounded into a bf16
 * C: mm x nn of it, each element as cpar_f32_to_bf16 rounds it. */
static void cpar__gemm_round_bf16(uint16_t *c, int64_t ldc, const float *t, int mr, int64_t mm, int64_t nn) {
    int64_t j = 0;
#ifdef CPAR__X86_KERNELS
    if (mm % 16 == 0 && cpar__cpu_avx512()) j = nn, cpar__gemm_round_bf16_avx512(c, ldc, t, mr, mm, nn);
#endif
    for (; j < nn; j++)
        for (int64_t i = 0; i < mm; i++) c[i + j * ldc] = cpar__bf16_bits(t[i + j * mr]);
}

/* The blocked product into an fp32 C, or with cb a bf16 C (ldc its
 * stride; then beta is 0 and k one block: each micro-tile is computed into
 * a buffer and rounded once, never stored in fp32). beta applies in the
 * first KC block. */
static void cpar__gemm_blocked(const cpar__gemm_kernel *K, int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                               const void *A, cpar_dtype adt, int64_t lda, const void *B, cpar_dtype bdt, int64_t ldb,
                               float beta, float *C, uint16_t *cb, int64_t ldc, float *ap, float *bp) {
    /* op(A)(i, p) = A[i*ars + p*acs]; op(B)(p, j) = B[p*brs + j*bcs]; B is
     * packed as op(B)^T so that its slivers are nr columns wide. */
    const int64_t ars = ta ? lda : 1, acs = ta ? 1 : lda, brs = tb ? ldb : 1, bcs = tb ? 1 : ldb;
    _Alignas(64) float tile[CPAR__GEMM_MAX_TILE]; /* AMX stores it by rows of 128 bytes */
    _Alignas(64) float piped[2][32 * 32];         /* AMX, bf16 C: a tile rounded while the next is computed */
    cpar__gemm_rounding pend = {NULL, NULL, 0, false};
    /* A bf16 C larger than half of L2 (this product's share of it, per
     * thread) is not in cache when the next product reads it, and writing
     * its lines the usual way reads each first: AMX rounds it into C by
     * non-temporal stores (1024^3 ran 7-10 % faster, the linear layer's
     * 256 x 1024 x 4096 5 %; a C of 256 KB ran slower, one of 128 KB the
     * same). */
    const bool stream = cb && K->run_amx && (double)m * (double)n * 2.0 > (double)CPAR__GEMM_STREAM_BYTES;
    int64_t npiped = 0;
    if (K->enter) K->enter();
    for (int64_t jc = 0; jc < n; jc += CPAR__GEMM_NC) {
        const int64_t nc = cpar__min64(CPAR__GEMM_NC, n - jc);
        for (int64_t pc = 0; pc < k; pc += cpar__gemm_kc(K, tb, k)) {
            const int64_t kc = cpar__min64(cpar__gemm_kc(K, tb, k), k - pc), kw = cpar__gemm_kw(K, kc);
            const float b0 = pc == 0 ? beta : 1.f;
            const void *bsrc = (const char *)B + (size_t)(pc * brs + jc * bcs) * cpar_dtype_size(bdt);
            /* AMX reads op(B)'s whole slivers where they lie when its k is
             * contiguous and this block's k whole tiles; the rest is packed */
            const int64_t n_in_place = K->run_amx && brs == 1 && kc % 32 == 0 ? nc / K->nr * K->nr : 0;
            if (K->b_tiles) /* the slivers not read in place, from bp's start */
                cpar__gemm_pack_bf16_rows((uint32_t *)bp, (const uint16_t *)bsrc + n_in_place * bcs, bcs, brs,
                                          nc - n_in_place, kc, kw, K->nr);
            else if (K->bf16_pairs) cpar__gemm_pack_bf16((uint32_t *)bp, bsrc, bcs, brs, nc, kc, kw, K->nr);
            else cpar__gemm_pack(bp, bsrc, bdt, bcs, brs, nc, kc, K->nr);
            for (int64_t ic = 0; ic < m; ic += cpar__gemm_mc(K, tb, n, k)) {
                const int64_t mc = cpar__min64(cpar__gemm_mc(K, tb, n, k), m - ic);
                const void *asrc = (const char *)A + (size_t)(ic * ars + pc * acs) * cpar_dtype_size(adt);
                if (K->bf16_pairs) cpar__gemm_pack_bf16((uint32_t *)ap, asrc, ars, acs, mc, kc, kw, K->mr);
                else cpar__gemm_pack(ap, asrc, adt, ars, acs, mc, kc, K->mr);
                /* AMX: a panel larger than L1 is read from L2 whatever
                 * happens; its tiles are loaded with the hint not to keep
                 * them in L1 (TILELOADDT1), which leaves L1 to op(B)'s
                 * sliver, read by every tile of the column (1024^3 0-10 %
                 * faster, most where the VM is fast; a panel that fits L1
                 * at k 64 ran 5 % slower so) */
                const bool a_far = (double)mc * (double)kw * 4.0 > (double)CPAR__GEMM_L1_BYTES;
                /* op(B) read in place and too big to stay in L2 (x at 1024
                 * tokens): the next column's sliver, which its first tile
                 * would fetch from memory, is fetched into L2 over this
                 * column's tiles after the first (1024^3 and 2048 x 1024 x
                 * 1024 2-5 % faster; where x stays in L2, 1-3 % slower) */
                const bool b_far = (double)nc * (double)kc * 2.0 > (double)(1 << 20);
                cpar__gemm_prefetch pfj = {NULL, 0, 0, 0, 0, 0};
                for (int64_t jr = 0; jr < nc; jr += K->nr) {
                    const bool xpf = b_far && jr + 2 * K->nr <= n_in_place && mc > K->mr;
                    if (xpf) {
                        const int64_t lpr = kc * 2 / 64, tiles = (mc + K->mr - 1) / K->mr - 1;
                        pfj = (cpar__gemm_prefetch){(const char *)((const uint16_t *)bsrc + (jr + K->nr) * bcs), bcs * 2, lpr, 0,
                                                    K->nr * lpr, (K->nr * lpr + tiles - 1) / tiles};
                    }
                    for (int64_t ir = 0; ir < mc; ir += K->mr) {
                        cpar__gemm_prefetch *pf = xpf && ir > 0 ? &pfj : NULL;
                        const int64_t mm = cpar__min64(K->mr, mc - ir), nn = cpar__min64(K->nr, nc - jr);
                        const cpar__gemm_sliver b = {jr < n_in_place ? (const void *)((const uint16_t *)bsrc + jr * bcs)
                                                                     : (const void *)(bp + (jr - n_in_place) * kw),
                                                     jr < n_in_place ? bcs : 0};
                        if (cb) {
                            uint16_t *dst = cb + (ic + ir) + (jc + jr) * ldc;
                            if (K->run_amx && alpha == 1.f && mm == K->mr && nn == K->nr) {
                                float *t = piped[npiped++ & 1];
                                K->run_amx(kw, ap + ir * kw, a_far, b, t, K->mr, 1.f, 0.f, pend.c ? &pend : NULL, pf);
                                pend = (cpar__gemm_rounding){t, dst, ldc, stream};
                                continue;
                            }
                            cpar__gemm_run(K, kw, ap + ir * kw, a_far, b, tile, K->mr, alpha, 0.f, pf);
                            cpar__gemm_round_bf16(dst, ldc, tile, K->mr, mm, nn);
                            continue;
                        }
                        float *c = C + (ic + ir) + (jc + jr) * ldc;
                        if (mm == K->mr && nn == K->nr) {
                            cpar__gemm_run(K, kw, ap + ir * kw, a_far, b, c, ldc, alpha, b0, pf);
                            continue;
                        }
                        cpar__gemm_run(K, kw, ap + ir * kw, a_far, b, tile, K->mr, alpha, 0.f, pf); /* an edge tile */
                        for (int64_t j = 0; j < nn; j++)
                            for (int64_t i = 0; i < mm; i++)
                                c[i + j * ldc] = tile[i + j * K->mr] + (b0 == 0.f ? 0.f : b0 * c[i + j * ldc]);
                    }
                }
            }
        }
    }
    if (pend.c) cpar__gemm_round_bf16(pend.c, pend.ldc, pend.t, 32, 32, 32); /* the last tile's */
#ifdef CPAR__X86_KERNELS
    if (stream) _mm_sfence(); /* the non-temporal stores ordered before whatever tells a reader C is done */
#endif
    if (K->leave) K->leave();
}

/* At least bytes of host scratch in *buf (grown, never shrunk). */
static cpar_status cpar__grow_host(cpar_ctx *ctx, const char *fn, void **buf, size_t *have, size_t bytes) {
    if (bytes <= *have) return CPAR_OK;
    size_t want = bytes + bytes / 4 + 4096;
    void *p = cpar__host_alloc(want);
    if (!p) return cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate %zu bytes of host GEMM scratch", fn, want);
    free(*buf);
    *buf = p;
    *have = want;
    return CPAR_OK;
}

/* ---- CPAR_HOST_THREADS: a rank's worker threads for big host GEMMs ------------
 * With ctx->host_threads = N > 1 the GEMM driver splits its outer loop (the
 * larger of op(B)'s columns and op(A)'s rows) into N chunks, whole
 * micro-tiles each, run by the calling thread and a pool of N - 1 workers
 * the context owns. A chunk is the serial product's own sub-problem: every
 * element of C is computed by one thread, with the same tiles (chunk edges
 * fall on micro-tile edges, as the serial MC and NC blocks do) and the same
 * k order, so the result is bit-identical to N = 1. Each thread packs into
 * its own slot of ctx->gemm_ws. The pool is made at the first product big
 * enough to gain (CPAR__GEMM_POOL_MIN multiply-adds) and joined by
 * cpar_finalize; a call allocates nothing. Chunks are claimed from one
 * counter that carries the job's generation, so a worker that wakes late
 * claims nothing of a finished job; the caller claims chunks too and then
 * waits only for the ones in flight. Fork: the pool remembers the pid that
 * made it; a child (whose copy has no threads) drops it and makes its own. */

enum { CPAR__POOL_MAX = 256 };
#define CPAR__GEMM_POOL_MIN ((int64_t)1 << 23)

typedef void (*cpar__pool_fn)(void *job, int64_t chunk, int slot);

typedef struct cpar__pool {
    pid_t pid;                  /* the process whose threads these are */
    int nworkers;               /* threads made (slots 1..nworkers) */
    bool stop, stuck;           /* stuck: a wait timed out; the threads are left running */
    pthread_mutex_t mu;
    pthread_cond_t go, done;    /* a new job; the job's last chunk finished */
    uint32_t gen;               /* the current job's generation */
    cpar__pool_fn fn;
    void *job;
    int64_t nchunks;
    _Atomic uint64_t claim;     /* gen << 32 | next chunk to claim */
    _Atomic int64_t finished;   /* chunks of the current job done */
    pthread_t threads[];
} cpar__pool;

typedef struct {
    cpar__pool *pool;
    int slot;
} cpar__pool_worker;

/* The next chunk of job generation gen, or -1 when none is left. */
static int64_t cpar__pool_claim(cpar__pool *p, uint32_t gen, int64_t nchunks) {
    uint64_t c = atomic_load(&p->claim);
    for (;;) {
        if ((uint32_t)(c >> 32) != gen || (int64_t)(c & 0xffffffffu) >= nchunks) return -1;
        if (atomic_compare_exchange_weak(&p->claim, &c, c + 1)) return (int64_t)(c & 0xffffffffu);
    }
}

/* Run chunks of job generation gen until none is left. */
static void cpar__pool_work(cpar__pool *p, uint32_t gen, cpar__pool_fn fn, void *job, int64_t nchunks, int slot) {
    for (int64_t c; (c = cpar__pool_claim(p, gen, nchunks)) >= 0;) {
        fn(job, c, slot);
        if (atomic_fetch_add(&p->finished, 1) + 1 == nchunks) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

static void *cpar__pool_main(void *arg) {
    cpar__pool_worker *w = arg;
    cpar__pool *p = w->pool;
    const int slot = w->slot;
    free(w);
    pthread_mutex_lock(&p->mu);
    uint32_t seen = p->gen;
    for (;;) {
        while (p->gen == seen && !p->stop) pthread_cond_wait(&p->go, &p->mu); /* idle: no deadline to keep */
        if (p->stop) break;
        seen = p->gen;
        cpar__pool_fn fn = p->fn;
        void *job = p->job;
        const int64_t nchunks = p->nchunks;
        pthread_mutex_unlock(&p->mu);
        cpar__pool_work(p, seen, fn, job, nchunks, slot);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* Stop and join the workers and free the pool. A forked child's copy has no
 * threads and may hold a locked mutex: only its memory is freed. A stuck
 * pool's threads may still touch it: it is left to them (leaked). */
static void cpar__pool_destroy(cpar__pool *p) {
    if (!p) return;
    if (p->pid != getpid()) {
        free(p);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    if (p->stuck) {
        for (int i = 0; i < p->nworkers; i++) pthread_detach(p->threads[i]);
        return;
    }
    for (int i = 0; i < p->nworkers; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
    free(p);
}

/* ctx's pool of ctx->host_threads - 1 workers in this process, made now if
 * needed; NULL (run single-threaded) when no thread could be made. The
 * workers block every signal (signals stay with the rank's own threads)
 * and are named "cpar-gemm". */
static cpar__pool *cpar__pool_get(cpar_ctx *ctx) {
    cpar__pool *p = ctx->gemm_pool;
    if (p && p->pid == getpid()) return p->stuck || p->nworkers == 0 ? NULL : p;
    if (p) cpar__pool_destroy(p); /* inherited through fork: its threads are the parent's */
    ctx->gemm_pool = NULL;
    const int want = ctx->host_threads - 1;
    p = calloc(1, sizeof *p + sizeof(pthread_t) * (size_t)want);
    if (!p) return NULL;
    p->pid = getpid();
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (int i = 0; i < want; i++) {
        cpar__pool_worker *w = malloc(sizeof *w);
        if (!w) break;
        *w = (cpar__pool_worker){p, i + 1};
        if (pthread_create(&p->threads[i], NULL, cpar__pool_main, w) != 0) {
            free(w);
            break;
        }
#ifdef __linux__
        pthread_setname_np(p->threads[i], "cpar-gemm"); /* what top, gdb and the tests see */
#endif
        p->nworkers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (p->nworkers < want)
        cpar__log(CPAR__LOG_WARN, ctx->rank, "CPAR_HOST_THREADS=%d: only %d of %d worker threads could be made",
                  ctx->host_threads, p->nworkers, want);
    ctx->gemm_pool = p;
    return p->nworkers ? p : NULL;
}

/* fn(job, c, slot) for every chunk c < nchunks, on the calling thread (slot
 * 0) and p's workers (slots 1..), each chunk once; returns when all are done.
 * The wait has the context's deadline; past it the pool is marked stuck
 * (later products run on the calling thread alone) and the scratch the
 * workers write is left to them. */
static cpar_status cpar__pool_run(cpar_ctx *ctx, const char *fn_name, cpar__pool *p, cpar__pool_fn fn, void *job,
                                  int64_t nchunks) {
    pthread_mutex_lock(&p->mu);
    const uint32_t gen = ++p->gen;
    p->fn = fn, p->job = job, p->nchunks = nchunks;
    atomic_store(&p->finished, 0);
    atomic_store(&p->claim, (uint64_t)gen << 32);
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    cpar__pool_work(p, gen, fn, job, nchunks, 0);
    const struct timespec dl = cpar__abs_deadline(ctx->timeout_ms);
    int rc = 0;
    pthread_mutex_lock(&p->mu);
    while (atomic_load(&p->finished) < nchunks && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&p->done, &p->mu, &dl);
    const bool late = atomic_load(&p->finished) < nchunks;
    if (late) p->stuck = true;
    pthread_mutex_unlock(&p->mu);
    if (!late) return CPAR_OK;
    ctx->gemm_ws = NULL, ctx->gemm_ws_bytes = 0; /* still the workers' scratch: never freed */
    return cpar__fail(ctx, CPAR_ERR_TIMEOUT,
                      "%s: the host GEMM's worker threads (CPAR_HOST_THREADS=%d) did not finish within %d ms", fn_name,
                      ctx->host_threads, ctx->timeout_ms);
}

/* One product cut into chunks of `step` columns of op(B) and C (split_n)
 * or rows of op(A) and C, each a multiple of the micro-tile. */
typedef struct {
    const cpar__gemm_kernel *K;
    int ta, tb;
    bool split_n;
    int64_t m, n, k, step, ldc, lda, ldb;
    float alpha, beta;
    const void *A, *B;
    cpar_dtype adt, bdt;
    float *C;
    uint16_t *cb;      /* or a bf16 C (cpar__gemm_blocked) */
    float *ws;         /* slot s packs into ws + s * slot_floats */
    int64_t slot_floats, acap; /* a slot: acap floats of A panel, then B's */
} cpar__gemm_job;

static void cpar__gemm_chunk(void *arg, int64_t chunk, int slot) {
    const cpar__gemm_job *g = arg;
    const int64_t lo = chunk * g->step, len = cpar__min64(g->step, (g->split_n ? g->n : g->m) - lo);
    float *ap = g->ws + slot * g->slot_floats, *bp = ap + g->acap;
    const size_t ae = cpar_dtype_size(g->adt), be = cpar_dtype_size(g->bdt);
    if (g->split_n) /* op(B)(p, j) = B[p*brs + j*bcs], bcs = tb ? 1 : ldb */
        cpar__gemm_blocked(g->K, g->ta, g->tb, g->m, len, g->k, g->alpha, g->A, g->adt, g->lda,
                           (const char *)g->B + (size_t)(lo * (g->tb ? 1 : g->ldb)) * be, g->bdt, g->ldb, g->beta,
                           g->cb ? NULL : g->C + lo * g->ldc, g->cb ? g->cb + lo * g->ldc : NULL, g->ldc, ap, bp);
    else /* op(A)(i, p) = A[i*ars + p*acs], ars = ta ? lda : 1 */
        cpar__gemm_blocked(g->K, g->ta, g->tb, len, g->n, g->k, g->alpha,
                           (const char *)g->A + (size_t)(lo * (g->ta ? g->lda : 1)) * ae, g->adt, g->lda, g->B, g->bdt,
                           g->ldb, g->beta, g->cb ? NULL : g->C + lo, g->cb ? g->cb + lo : NULL, g->ldc, ap, bp);
}

#ifdef CPAR_WITH_CBLAS
/* cpar's ranks are the parallelism: a multi-threaded OpenBLAS inside each
 * rank oversubscribes the cores (and spins in sched_yield between small
 * products). Unless the user chose (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS),
 * OpenBLAS runs CPAR_HOST_THREADS threads per call (default 1). Its count is
 * the process's, not a context's: the first context to run a product sets
 * it. Another CBLAS (BLIS) is left as it is. */
static void cpar__blas_threads_once(int n) {
#ifdef OPENBLAS_VERSION
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static _Atomic bool done;
    if (atomic_load(&done)) return;
    pthread_mutex_lock(&mu);
    if (!done && !getenv("OPENBLAS_NUM_THREADS") && !getenv("OMP_NUM_THREADS")) openblas_set_num_threads(n);
    done = true;
    pthread_mutex_unlock(&mu);
#else
    (void)n;
#endif
}
#endif

static cpar_status cpar__host_gemm(cpar_ctx *ctx, const char *fn, int ta, int tb, int64_t m, int64_t n, int64_t k,
                                   float alpha, const void *A, cpar_dtype adt, int64_t lda, const void *B,
                                   cpar_dtype bdt, int64_t ldb, float beta, void *C, cpar_dtype cdt, int64_t ldc) {
    if (m <= 0 || n <= 0) return CPAR_OK;
#ifdef CPAR_WITH_CBLAS
    if (!ctx->gemm_builtin && adt == CPAR_F32 && bdt == CPAR_F32 && cdt == CPAR_F32 && m <= INT_MAX && n <= INT_MAX && k <= INT_MAX &&
        lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX) {
        cpar__blas_threads_once(ctx->host_threads);
        cblas_sgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)m, (int)n,
                    (int)k, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
        return CPAR_OK;
    }
#endif
    /* Picked per call (an atomic load). A static set lazily on first use was
     * a data race between ranks: one could see the kernel's pointer before
     * its tile sizes and divide by a zero mr. */
    const cpar__gemm_kernel K = cpar__gemm_kernel_pick(ctx->gemm_force, adt, bdt);
    const int64_t mcap = cpar__min64(cpar__gemm_mc(&K, tb, n, k), (m + K.mr - 1) / K.mr * K.mr);
    /* AMX reads op(B) where it lies (not tb, every block whole k tiles)
     * but for a last partial sliver: its panel holds that one */
    const bool b_in_place = K.run_amx && !tb && k % 32 == 0;
    const int64_t ncap = b_in_place ? K.nr : cpar__min64(CPAR__GEMM_NC, (n + K.nr - 1) / K.nr * K.nr);
    const int64_t kc0 = cpar__min64(cpar__gemm_kc(&K, tb, k), k), kcap = cpar__max64(kc0, cpar__gemm_kw(&K, kc0));
    /* CPAR_HOST_THREADS: chunks of whole micro-tiles along the larger of m and n */
    const bool split_n = n >= m;
    const int64_t tile = split_n ? K.nr : K.mr, tiles = ((split_n ? n : m) + tile - 1) / tile;
    cpar__pool *pool = NULL;
    int64_t step = 0, nchunks = 1;
    if (ctx->host_threads > 1 && k > 0 && tiles > 1 && (double)m * (double)n * (double)k >= (double)CPAR__GEMM_POOL_MIN &&
        (pool = cpar__pool_get(ctx)) != NULL) {
        const int64_t nt = cpar__min64(pool->nworkers + 1, tiles);
        step = (tiles + nt - 1) / nt * tile;
        nchunks = ((split_n ? n : m) + step - 1) / step;
    }
    const int64_t slot_floats = ((mcap + ncap) * kcap + 15) / 16 * 16; /* 64-byte slots: the A panel stays aligned */
    const size_t panels = (size_t)(slot_floats * (pool ? pool->nworkers + 1 : 1)) * sizeof(float);
    /* A bf16 C written once, with no k blocks to carry between (beta 0, k
     * within one block): each micro-tile rounds into it. Otherwise a 16-bit
     * C accumulates in an fp32 copy, rounded at the end. */
    const bool round_c = cdt == CPAR_BF16 && beta == 0.f && k > 0 && k <= cpar__gemm_kc(&K, tb, k);
    const bool wide_c = cdt != CPAR_F32 && !round_c;
    CPAR_TRY(cpar__grow_host(ctx, fn, &ctx->gemm_ws, &ctx->gemm_ws_bytes,
                             panels + (wide_c ? (size_t)(m * n) * sizeof(float) : 0)));
    float *ap = ctx->gemm_ws, *bp = ap + mcap * kcap, *c = (float *)C, *wc = NULL;
    int64_t ldw = ldc;
    if (wide_c) {
        wc = (float *)((char *)ctx->gemm_ws + panels);
        ldw = m;
    }
    float *cf = wide_c ? wc : round_c ? NULL : c;
    uint16_t *cb = round_c ? (uint16_t *)C : NULL;
    const size_t ces = cpar_dtype_size(cdt);
    if (wide_c && beta != 0.f) /* beta 0: C is never read (it may hold NaN) */
        for (int64_t j = 0; j < n; j++) cpar__host_cast(wc + j * ldw, CPAR_F32, (char *)C + (size_t)(j * ldc) * ces, cdt, m);
    if (pool && nchunks > 1) {
        cpar__gemm_job job = {.K = &K, .ta = ta, .tb = tb, .split_n = split_n, .m = m, .n = n, .k = k, .step = step,
                              .ldc = ldw, .lda = lda, .ldb = ldb, .alpha = alpha, .beta = beta, .A = A, .B = B,
                              .adt = adt, .bdt = bdt, .C = cf, .cb = cb, .ws = ap, .slot_floats = slot_floats,
                              .acap = mcap * kcap};
        CPAR_TRY(cpar__pool_run(ctx, fn, pool, cpar__gemm_chunk, &job, nchunks));
    } else if (k > 0) {
        cpar__gemm_blocked(&K, ta, tb, m, n, k, alpha, A, adt, lda, B, bdt, ldb, beta, cf, cb, ldw, ap, bp);
    } else { /* no product: C = beta C */
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < m; i++) cf[i + j * ldw] = beta == 0.f ? 0.f : beta * cf[i + j * ldw];
    }
    if (wide_c) /* one rounding per element, a column at a time in vector lanes */
        for (int64_t j = 0; j < n; j++) cpar__host_cast((char *)C + (size_t)(j * ldc) * ces, cdt, wc + j * ldw, CPAR_F32, m);
    return CPAR_OK;
}

/* ---- exp over a row ---------------------------------------------------------
 * p[i] = exp(p[i] - sub), returning the sum of the results: the softmax step
 * of the host attention. sub >= max p, so every argument is <= 0. AVX2+FMA
 * where the CPU has it (x = n ln2 + r, |r| <= ln2/2, a degree-7 Taylor
 * polynomial: relative error below 2e-7; arguments below -87.3 give 0),
 * else libm's expf. */
#ifdef CPAR__X86_KERNELS
__attribute__((target("avx2,fma"))) static float cpar__exp_sub_sum_avx2(float *p, int64_t n, float sub) {
    const __m256 vsub = _mm256_set1_ps(sub), log2e = _mm256_set1_ps(1.44269504f), lo = _mm256_set1_ps(-87.3f);
    const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    static const float c[8] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_sub_ps(_mm256_loadu_ps(p + i), vsub);
        const __m256 dead = _mm256_cmp_ps(x, lo, _CMP_LT_OQ); /* also -inf: masked scores */
        x = _mm256_max_ps(x, lo);
        const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 r = _mm256_fnmadd_ps(k, ln2_lo, _mm256_fnmadd_ps(k, ln2_hi, x));
        __m256 y = _mm256_set1_ps(c[7]);
        for (int d = 6; d >= 0; d--) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c[d]));
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        y = _mm256_andnot_ps(dead, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
        _mm256_storeu_ps(p + i, y);
        sum = _mm256_add_ps(sum, y);
    }
    float lanes[8], total = 0.f;
    _mm256_storeu_ps(lanes, sum);
    for (int k = 0; k < 8; k++) total += lanes[k];
    for (; i < n; i++) total += p[i] = expf(p[i] - sub);
    return total;
}
#endif

static float cpar__exp_sub_sum(float *p, int64_t n, float sub) {
#ifdef CPAR__X86_KERNELS
    if (cpar__cpu_avx2()) return cpar__exp_sub_sum_avx2(p, n, sub);
#endif
    float total = 0.f;
    for (int64_t i = 0; i < n; i++) total += p[i] = expf(p[i] - sub);
    return total;
}

/* ---- attention's row passes ---------------------------------------------------
 * The host attention's per-row steps around its GEMMs (section 18): the row
 * maximum, a row scaled in place, and the softmax gradient ds = p (ds - D).
 * Element-wise or a maximum, so the AVX2 twins give the same bits as the
 * plain loops (no FMA: a subtract, then a multiply); gcc -O2 vectorises
 * neither plain loop (their lengths vary), and in attention's tiles they
 * cost as much as the GEMM's packing. */
#ifdef CPAR__X86_KERNELS
__attribute__((target("avx2,fma"))) static float cpar__row_max_avx2(const float *p, int64_t n, float init) {
    __m256 a = _mm256_set1_ps(init), b = a;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a = _mm256_max_ps(_mm256_loadu_ps(p + i), a); /* (x > a ? x : a), as the plain loop */
        b = _mm256_max_ps(_mm256_loadu_ps(p + i + 8), b);
    }
    float lanes[8], mx = init;
    _mm256_storeu_ps(lanes, _mm256_max_ps(a, b));
    for (int k = 0; k < 8; k++) mx = lanes[k] > mx ? lanes[k] : mx;
    for (; i < n; i++) mx = p[i] > mx ? p[i] : mx;
    return mx;
}

__attribute__((target("avx2,fma"))) static void cpar__row_scale_avx2(float *p, int64_t n, float s) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, _mm256_mul_ps(_mm256_loadu_ps(p + i), vs));
    for (; i < n; i++) p[i] *= s;
}

__attribute__((target("avx2,fma"))) static void cpar__row_dsoftmax_avx2(float *ds, const float *p, int64_t n, float D) {
    const __m256 vd = _mm256_set1_ps(D);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(ds + i, _mm256_mul_ps(_mm256_loadu_ps(p + i), _mm256_sub_ps(_mm256_loadu_ps(ds + i), vd)));
    for (; i < n; i++) ds[i] = p[i] * (ds[i] - D);
}
#endif

/* The maximum of init and p[0..n) (no NaN among them). */
static float cpar__row_max(const float *p, int64_t n, float init) {
#ifdef CPAR__X86_KERNELS
    if (cpar__cpu_avx2()) return cpar__row_max_avx2(p, n, init);
#endif
    float mx = init;
    for (int64_t i = 0; i < n; i++) mx = p[i] > mx ? p[i] : mx; /* fmaxf is a call */
    return mx;
}

/* p[0..n) *= s. */
static void cpar__row_scale(float *p, int64_t n, float s) {
#ifdef CPAR__X86_KERNELS
    if (cpar__cpu_avx2()) {
        cpar__row_scale_avx2(p, n, s);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) p[i] *= s;
}

/* ds[i] = p[i] * (ds[i] - D), i < n: softmax's backward through one row. */
static void cpar__row_dsoftmax(float *ds, const float *p, int64_t n, float D) {
#ifdef CPAR__X86_KERNELS
    if (cpar__cpu_avx2()) {
        cpar__row_dsoftmax_avx2(ds, p, n, D);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) ds[i] = p[i] * (ds[i] - D);
}

/* ==== 6. Element-wise and layout operations ==============================
 * Public ops that run the host reference on host tensors and the device
 * layer's kernels on device tensors. Split and concat reduce to one pitched
 * 2-D copy per piece: [outer, len_i * inner] rows inside [outer, D * inner].
 * Uses: 2, 3, 4, 5. */

static cpar_status cpar__check_op_tensor(cpar_ctx *ctx, const char *fn, const char *name, const cpar_tensor *t) {
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    return cpar__check_tensor(ctx, fn, name, t, t && t->device == CPAR_HOST ? CPAR_HOST : ctx->device);
}

cpar_status cpar_fill(cpar_ctx *ctx, cpar_tensor *t, double value) {
    static const char fn[] = "cpar_fill";
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "t", t));
    if (!cpar_dtype_is_float(t->dtype)) {
        double lo = t->dtype == CPAR_U8 ? 0.0 : t->dtype == CPAR_I32 ? -2147483648.0 : -9223372036854775808.0;
        double hi = t->dtype == CPAR_U8 ? 255.0 : t->dtype == CPAR_I32 ? 2147483647.0 : 9223372036854774784.0;
        if (!(value >= lo && value <= hi))
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: value %g does not fit dtype %s", fn, value,
                              cpar_dtype_name(t->dtype));
    }
    int64_t n = cpar_tensor_numel(t);
    if (!cpar__on_device(t->device)) cpar__host_fill(t->data, t->dtype, n, value);
    else CPAR_DEV_TRY(ctx, fn, cpar_dev_fill(t->data, t->dtype, n, value, ctx->compute));
    return CPAR_OK;
}

static cpar_status cpar__check_same_place(cpar_ctx *ctx, const char *fn, const char *name, const cpar_tensor *t,
                                          const char *ref_name, const cpar_tensor *ref) {
    if (t->device != ref->device)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is on device %d, expected device %d (as %s)", fn, name,
                          t->device, ref->device, ref_name);
    if (cpar_tensor_numel(t) != cpar_tensor_numel(ref))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has %lld elements, expected %lld (as %s)", fn, name,
                          (long long)cpar_tensor_numel(t), (long long)cpar_tensor_numel(ref), ref_name);
    return CPAR_OK;
}

cpar_status cpar_cast(cpar_ctx *ctx, const cpar_tensor *src, cpar_tensor *dst) {
    static const char fn[] = "cpar_cast";
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "src", src));
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "dst", dst));
    CPAR_TRY(cpar__check_same_place(ctx, fn, "dst", dst, "src", src));
    if (src->dtype != dst->dtype) {
        CPAR_TRY(cpar__check_float(ctx, fn, "src", src));
        CPAR_TRY(cpar__check_float(ctx, fn, "dst", dst));
    }
    int64_t n = cpar_tensor_numel(src);
    if (!cpar__on_device(src->device)) cpar__host_cast(dst->data, dst->dtype, src->data, src->dtype, n);
    else CPAR_DEV_TRY(ctx, fn, cpar_dev_cast(dst->data, dst->dtype, src->data, src->dtype, n, ctx->compute));
    return CPAR_OK;
}

cpar_status cpar_axpby(cpar_ctx *ctx, float alpha, const cpar_tensor *x, float beta, cpar_tensor *y) {
    static const char fn[] = "cpar_axpby";
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "x", x));
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "y", y));
    CPAR_TRY(cpar__check_float(ctx, fn, "x", x));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "y", y, x->dtype));
    CPAR_TRY(cpar__check_same_place(ctx, fn, "y", y, "x", x));
    int64_t n = cpar_tensor_numel(x);
    if (!cpar__on_device(x->device)) cpar__host_axpby(alpha, x->data, beta, y->data, x->dtype, n);
    else CPAR_DEV_TRY(ctx, fn, cpar_dev_axpby(alpha, x->data, beta, y->data, x->dtype, n, ctx->compute));
    return CPAR_OK;
}

/* Checks shared by split and concat: the whole tensor `whole` and n pieces
 * that equal it except at dim, whose sizes add up to whole.shape[dim]. */
static cpar_status cpar__check_pieces(cpar_ctx *ctx, const char *fn, const char *whole_name, const cpar_tensor *whole,
                                      const char *pieces_name, cpar_tensor *const *pieces, int n, int *dim) {
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, whole_name, whole));
    if (whole->ndim < 1)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is a scalar, expected at least 1 dimension", fn, whole_name);
    if (*dim < -whole->ndim || *dim >= whole->ndim)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dim is %d, expected -%d..%d", fn, *dim, whole->ndim,
                          whole->ndim - 1);
    if (*dim < 0) *dim += whole->ndim;
    if (n < 1) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: n is %d, expected >= 1", fn, n);
    if (!pieces) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is NULL", fn, pieces_name);
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        char name[48];
        snprintf(name, sizeof name, "%s[%d]", pieces_name, i);
        CPAR_TRY(cpar__check_tensor(ctx, fn, name, pieces[i], whole->device));
        CPAR_TRY(cpar__check_dtype(ctx, fn, name, pieces[i], whole->dtype));
        int64_t want[CPAR_MAX_DIMS];
        memcpy(want, whole->shape, sizeof want);
        want[*dim] = pieces[i]->ndim == whole->ndim ? pieces[i]->shape[*dim] : 0;
        CPAR_TRY(cpar__check_shape(ctx, fn, name, pieces[i], want, whole->ndim, "equal to the whole except at dim"));
        total += pieces[i]->shape[*dim];
    }
    if (total != whole->shape[*dim])
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s sizes along dim %d add up to %lld, expected %lld", fn,
                          pieces_name, *dim, (long long)total, (long long)whole->shape[*dim]);
    return CPAR_OK;
}

/* Move pieces to (to_pieces) or from the whole tensor along dim. */
static cpar_status cpar__split_concat(cpar_ctx *ctx, const char *fn, const cpar_tensor *whole, int dim,
                                      cpar_tensor *const *pieces, int n, bool to_pieces) {
    size_t es = cpar_dtype_size(whole->dtype);
    int64_t outer = 1, inner = 1;
    for (int i = 0; i < dim; i++) outer *= whole->shape[i];
    for (int i = dim + 1; i < whole->ndim; i++) inner *= whole->shape[i];
    size_t whole_pitch = (size_t)(whole->shape[dim] * inner) * es, off = 0;
    for (int i = 0; i < n; i++) {
        size_t row = (size_t)(pieces[i]->shape[dim] * inner) * es;
        char *w = (char *)whole->data + off;
        if (to_pieces)
            CPAR_TRY(cpar__copy_2d(ctx, fn, pieces[i]->data, row, pieces[i]->device, w, whole_pitch, whole->device,
                                   row, (size_t)outer));
        else
            CPAR_TRY(cpar__copy_2d(ctx, fn, w, whole_pitch, whole->device, pieces[i]->data, row, pieces[i]->device,
                                   row, (size_t)outer));
        off += row;
    }
    return CPAR_OK;
}

cpar_status cpar_split(cpar_ctx *ctx, const cpar_tensor *in, int dim, int n, cpar_tensor *const *out) {
    static const char fn[] = "cpar_split";
    CPAR_TRY(cpar__check_pieces(ctx, fn, "in", in, "out", out, n, &dim));
    for (int i = 0; i < n; i++)
        if (cpar__ranges_overlap(out[i]->data, cpar_tensor_nbytes(out[i]), in->data, cpar_tensor_nbytes(in)))
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out[%d] overlaps in", fn, i);
    return cpar__split_concat(ctx, fn, in, dim, out, n, true);
}

cpar_status cpar_concat(cpar_ctx *ctx, cpar_tensor *const *in, int n, int dim, cpar_tensor *out) {
    static const char fn[] = "cpar_concat";
    CPAR_TRY(cpar__check_pieces(ctx, fn, "out", out, "in", in, n, &dim));
    for (int i = 0; i < n; i++)
        if (cpar__ranges_overlap(in[i]->data, cpar_tensor_nbytes(in[i]), out->data, cpar_tensor_nbytes(out)))
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in[%d] overlaps out", fn, i);
    return cpar__split_concat(ctx, fn, out, dim, in, n, false);
}

cpar_status cpar_row_reduce(cpar_ctx *ctx, const cpar_tensor *in, cpar_row_op op, cpar_tensor *out) {
    static const char fn[] = "cpar_row_reduce";
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "in", in));
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "out", out));
    CPAR_TRY(cpar__check_float(ctx, fn, "in", in));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "out", out, CPAR_F32));
    if ((unsigned)op > CPAR_ROW_LOGSUMEXP)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: op is %d, expected CPAR_ROW_SUM, _MAX or _LOGSUMEXP", fn, (int)op);
    if (in->ndim < 1 || in->shape[in->ndim - 1] < 1)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in needs a last dimension of at least 1", fn);
    if (out->device != in->device)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out is on device %d, expected device %d (as in)", fn,
                          out->device, in->device);
    int64_t cols = in->shape[in->ndim - 1], rows = cpar_tensor_numel(in) / cols;
    if (cpar_tensor_numel(out) != rows)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out has %lld elements, expected %lld (rows of in)", fn,
                          (long long)cpar_tensor_numel(out), (long long)rows);
    if (!cpar__on_device(in->device)) cpar__host_row_reduce(out->data, in->data, in->dtype, rows, cols, op);
    else CPAR_DEV_TRY(ctx, fn, cpar_dev_row_reduce(out->data, in->data, in->dtype, rows, cols, op, ctx->compute));
    return CPAR_OK;
}

/* GeLU forward (dy NULL) or backward: in, dy, out of one float dtype and numel, in one place. */
static cpar_status cpar__gelu(cpar_ctx *ctx, const char *fn, const cpar_tensor *x, const cpar_tensor *dy,
                              cpar_tensor *out, const char *out_name) {
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "x", x));
    CPAR_TRY(cpar__check_float(ctx, fn, "x", x));
    const cpar_tensor *ts[2] = {dy, out};
    const char *names[2] = {"dy", out_name};
    for (int i = dy ? 0 : 1; i < 2; i++) {
        CPAR_TRY(cpar__check_tensor(ctx, fn, names[i], ts[i], x->device));
        CPAR_TRY(cpar__check_dtype(ctx, fn, names[i], ts[i], x->dtype));
        CPAR_TRY(cpar__check_same_place(ctx, fn, names[i], ts[i], "x", x));
    }
    const int64_t n = cpar_tensor_numel(x);
    const void *src = dy ? dy->data : x->data; /* what out may alias */
    if (out->data != src && cpar__ranges_overlap(out->data, cpar_tensor_nbytes(out), src, cpar_tensor_nbytes(x)))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s overlaps %s without being it", fn, out_name, dy ? "dy" : "x");
    if (dy && out->data != x->data && cpar__ranges_overlap(out->data, cpar_tensor_nbytes(out), x->data, cpar_tensor_nbytes(x)))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s overlaps x", fn, out_name);
    if (dy && out->data == x->data && x->data != dy->data)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is x (backward may write over dy, not x)", fn, out_name);
    const cpar__gelu_lut *lut;
    if (cpar__on_device(x->device))
        CPAR_DEV_TRY(ctx, fn, cpar_dev_gelu(x->data, dy ? dy->data : NULL, out->data, x->dtype, n, ctx->compute));
    else if (x->dtype != CPAR_F32 && (lut = cpar__gelu_lut_get(x->dtype)))
        cpar__host_gelu_lut(lut, x->data, dy ? dy->data : NULL, out->data, x->dtype, n);
    else cpar__host_gelu(x->data, dy ? dy->data : NULL, out->data, x->dtype, n);
    return CPAR_OK;
}

cpar_status cpar_gelu_forward(cpar_ctx *ctx, const cpar_tensor *x, cpar_tensor *y) {
    return cpar__gelu(ctx, "cpar_gelu_forward", x, NULL, y, "y");
}

cpar_status cpar_gelu_backward(cpar_ctx *ctx, const cpar_tensor *x, const cpar_tensor *dy, cpar_tensor *dx) {
    static const char fn[] = "cpar_gelu_backward";
    if (!dy) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dy is NULL", fn);
    return cpar__gelu(ctx, fn, x, dy, dx, "dx");
}

/* ==== 7. Rendezvous store and launch environment ==========================
 * Defines cpar_env_read (torchrun, SLURM or single-rank variables, the job
 * token, where the store listens), the TCP key-value store cpar_store_* that
 * rank 0 hosts for rendezvous, and cpar_store_join, the checked start.
 *
 * Server: one background thread that owns the table and runs a poll() loop
 * over the listening socket, every client and a self-pipe (shutdown). Its
 * sockets are non-blocking with per-connection buffers, so a slow, stalled or
 * hostile client never blocks the others; a frame that fails validation
 * closes that connection only, and a connection that holds a half-sent frame
 * (or leaves a reply unread) for longer than the store's timeout is dropped.
 * Client: one request in flight per handle; every wait is a poll() with a
 * deadline. The hosting process reaches its own server through an ordinary
 * loopback client, so the server thread is the only one touching the table
 * and the table needs no lock.
 *
 * Wire format, integers big-endian. Requests and replies share a 12-byte
 * header, then the key bytes, then the value bytes:
 *     u32 magic "CPST" | u8 version | u8 op (reply: 0x80 | status) |
 *     u16 key length (reply: 0) | u32 value length
 *   HELLO -   token  -> OK | DENIED           handshake: "is this a cpar store of my job?"
 *   SET   key value  -> OK | NOMEM | TOOBIG, KEYLIMIT, BYTELIMIT (value: the u64 limit)
 *   GET   key        -> OK value | MISSING    never waits; clients poll
 *   ADD   key i64    -> OK i64 | BADVALUE | NOMEM | KEYLIMIT, BYTELIMIT
 * A connection must open with a HELLO carrying the server's job token; any
 * other first frame closes it, and DENIED is followed by the close, so no key
 * is ever read or written by a connection of another job. ADD keeps its
 * counter as decimal text, so GET on a counter reads "3".
 *
 * Join (cpar_store_join) uses keys under "cpar/join/": "claim/<r>" counts
 * the ranks claiming rank r, "who/<r>" holds the first claimant's
 * "world local pid host", "failed" and "why" carry the first failure to the
 * ranks waiting at the barrier "cpar/join".
 * Uses: 1, 2.                                                              */

/* ---- launch environment ------------------------------------------------ */

/* Strict decimal: strtol alone takes " 7", "+7", "7abc" and "" for numbers. */
static bool cpar__env_parse_long(const char *s, long *out)
{
    const char *digits = (*s == '-') ? s + 1 : s;
    if (*digits < '0' || *digits > '9')
        return false;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || *end != '\0')
        return false;
    *out = v;
    return true;
}

/* Read the integer variable var into *out when it is set (*set says so). */
static cpar_status cpar__env_int(const char *var, long lo, long hi, int *out, bool *set)
{
    const char *s = getenv(var);
    *set = (s != NULL);
    if (!s)
        return CPAR_OK;
    long v;
    if (!cpar__env_parse_long(s, &v))
        return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: %s=\"%.64s\" is not an integer", var, s);
    if (v < lo || v > hi)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: %s=%ld is out of range, expected %ld..%ld",
                          var, v, lo, hi);
    *out = (int)v;
    return CPAR_OK;
}

/* Entry `node` of SLURM's compressed per-node task list ("4(x2),3" is 4,4,3).
 * The whole list is validated, not just the entry asked for. */
static bool cpar__env_slurm_tasks(const char *s, long node, int *out)
{
    bool found = false;
    for (;;) {
        if (*s < '0' || *s > '9')
            return false;
        char *end;
        errno = 0;
        long count = strtol(s, &end, 10), reps = 1;
        if (errno != 0 || count < 1 || count > INT_MAX)
            return false;
        s = end;
        if (*s == '(') {
            if (s[1] != 'x' || s[2] < '0' || s[2] > '9')
                return false;
            reps = strtol(s + 2, &end, 10);
            if (errno != 0 || reps < 1 || *end != ')')
                return false;
            s = end + 1;
        }
        if (!found && node < reps) {
            *out = (int)count;
            found = true;
        }
        node -= reps;
        if (*s == '\0')
            return found;
        if (*s++ != ',')
            return false;
    }
}

/* Local world size under SLURM. SLURM_NTASKS_PER_NODE (set by
 * --ntasks-per-node) is uniform: its first number. SLURM_TASKS_PER_NODE
 * (always set by srun) may differ per node: the entry for SLURM_NODEID. */
static cpar_status cpar__env_slurm_local_world(int *out, bool *set)
{
    const char *var = "SLURM_NTASKS_PER_NODE";
    const char *s = getenv(var);
    int node = 0;
    if (!s) {
        var = "SLURM_TASKS_PER_NODE";
        s = getenv(var);
        bool has_node;
        cpar_status st = cpar__env_int("SLURM_NODEID", 0, INT_MAX, &node, &has_node);
        if (st != CPAR_OK)
            return st;
    }
    *set = (s != NULL);
    if (s && !cpar__env_slurm_tasks(s, node, out))
        return cpar__fail(NULL, CPAR_ERR_INVALID,
                          "cpar_env_read: %s=\"%.64s\" is not a task list like \"4(x2),3\" with an entry for node %d",
                          var, s, node);
    return CPAR_OK;
}

/* First host of a SLURM host list, validating the whole list: "node[01-04,07]"
 * gives "node01", "a1,b[2-3]" gives "a1", "r[1-2]-n[08-09]" gives "r1-n08".
 * Zero padding is kept as written. false: malformed, or too long for out. */
static bool cpar__env_slurm_first_host(const char *s, char *out, size_t n)
{
    size_t used = 0;
    bool first = true;
    for (;;) { /* one host expression per iteration, up to a ',' outside brackets */
        bool any = false;
        while (*s && *s != ',') {
            if (*s == '[') {
                s++;
                for (bool first_range = true;; first_range = false) {
                    const char *a = s;
                    while (*s >= '0' && *s <= '9')
                        s++;
                    size_t alen = (size_t)(s - a);
                    if (alen == 0 || alen > 18) /* 18 digits: the bounds compare in 64 bits */
                        return false;
                    if (*s == '-') {
                        const char *b = ++s;
                        while (*s >= '0' && *s <= '9')
                            s++;
                        if (s == b || s - b > 18 || strtoull(a, NULL, 10) > strtoull(b, NULL, 10))
                            return false;
                    }
                    if (first && first_range) {
                        if (used + alen >= n)
                            return false;
                        memcpy(out + used, a, alen);
                        used += alen;
                    }
                    if (*s == ']')
                        break;
                    if (*s++ != ',')
                        return false;
                }
                s++;
            } else {
                char c = *s++;
                bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
                          c == '.' || c == '_';
                if (!ok)
                    return false;
                if (first) {
                    if (used + 1 >= n)
                        return false;
                    out[used++] = c;
                }
            }
            any = true;
        }
        if (!any)
            return false;
        first = false;
        if (*s == '\0')
            break;
        s++; /* ',' */
    }
    out[used] = '\0';
    return true;
}

/* On a SLURM step over several nodes without MASTER_ADDR: rank 0's host is the
 * first of the step's node list (SLURM's block and cyclic distributions put
 * task 0 there). Anything else fails now, saying what to set: waiting for a
 * store on 127.0.0.1 would only time out. */
static cpar_status cpar__env_slurm_master(const cpar_env *e, char *out, size_t n)
{
    static const char *const vars[] = {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"};
    static const char hint[] = "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)";
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
        const char *list = getenv(vars[i]);
        if (!list)
            continue;
        if (!cpar__env_slurm_first_host(list, out, n))
            return cpar__fail(NULL, CPAR_ERR_INVALID,
                              "cpar_env_read: %s=\"%.96s\" is not a node list like \"node[01-04,07]\" and "
                              "MASTER_ADDR is not set: %s", vars[i], list, hint);
        return CPAR_OK;
    }
    return cpar__fail(NULL, CPAR_ERR_INVALID,
                      "cpar_env_read: a SLURM step of %d tasks with %d on this node spans several nodes, but neither "
                      "MASTER_ADDR nor SLURM_JOB_NODELIST is set: %s", e->world_size, e->local_world_size, hint);
}

/* Every address host resolves to is a loopback one (127/8, ::1, or 127/8
 * mapped into IPv6). false also when it does not resolve. */
static bool cpar__env_host_is_loopback(const char *host)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    if (getaddrinfo(host, NULL, &hints, &res) != 0)
        return false;
    bool all = res != NULL;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        if (ai->ai_family == AF_INET) {
            const struct sockaddr_in *a = (const void *)ai->ai_addr;
            all = all && (ntohl(a->sin_addr.s_addr) >> 24) == 127;
        } else if (ai->ai_family == AF_INET6) {
            const struct in6_addr *a = &((const struct sockaddr_in6 *)(const void *)ai->ai_addr)->sin6_addr;
            all = all && (IN6_IS_ADDR_LOOPBACK(a) || (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127));
        } else {
            all = false;
        }
    }
    freeaddrinfo(res);
    return all;
}

#define CPAR__STORE_TOKEN_MAX 255

/* The job token: see cpar_env.job_token for the order. The launchers' ids are
 * the same on every rank of one job and differ between jobs (SLURM's step id
 * separates two srun steps of one allocation). None of them: an empty token
 * and the source "none", which a store refuses (no default: any local user
 * could join a job by a token everyone knows). */
static cpar_status cpar__env_job_token(const char *fn, char *out, size_t n, const char **source)
{
    const char *tok = getenv("CPAR_JOB_TOKEN"), *v;
    int w;
    if (tok) {
        size_t len = strlen(tok);
        if (len == 0 || len > CPAR__STORE_TOKEN_MAX || len >= n)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: CPAR_JOB_TOKEN is %zu bytes, expected 1..%d", fn, len,
                              CPAR__STORE_TOKEN_MAX);
        memcpy(out, tok, len + 1);
        *source = "CPAR_JOB_TOKEN";
        return CPAR_OK;
    }
    if ((v = getenv("TORCHELASTIC_RUN_ID")) && *v && strcmp(v, "none") != 0) {
        w = snprintf(out, n, "torchelastic:%s", v);
        *source = "torchelastic";
    } else if ((v = getenv("SLURM_JOB_ID")) && *v) {
        const char *step = getenv("SLURM_STEP_ID");
        w = snprintf(out, n, "slurm:%s.%s", v, step ? step : "");
        *source = "slurm";
    } else {
        out[0] = 0;
        *source = "none";
        return CPAR_OK;
    }
    if (w < 0 || (size_t)w >= n || w > CPAR__STORE_TOKEN_MAX)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: the %s job id is longer than %d bytes: set CPAR_JOB_TOKEN",
                          fn, *source, CPAR__STORE_TOKEN_MAX - 16);
    return CPAR_OK;
}

cpar_status cpar_env_read(cpar_env *out)
{
    if (!out)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: out is NULL");
    cpar_env e;
    memset(&e, 0, sizeof e);
    e.world_size = e.local_world_size = 1;
    e.master_port = 29500;
    snprintf(e.master_addr, sizeof e.master_addr, "127.0.0.1");
    e.source = "default";

    /* torchrun wins over SLURM: torchrun inside an allocation sets both.
     * SLURM exports no master address: on several nodes the user exports
     * MASTER_ADDR (e.g. the first of `scontrol show hostnames`). */
    const char *v_rank = "RANK", *v_world = "WORLD_SIZE";
    const char *v_lrank = "LOCAL_RANK", *v_lworld = "LOCAL_WORLD_SIZE";
    bool slurm = false;
    if (getenv("RANK") || getenv("WORLD_SIZE")) {
        e.source = "torchrun";
    } else if (getenv("SLURM_PROCID")) {
        e.source = "slurm";
        slurm = true;
        v_rank = "SLURM_PROCID";
        v_world = (!getenv("SLURM_NTASKS") && getenv("SLURM_NPROCS")) ? "SLURM_NPROCS" : "SLURM_NTASKS";
        v_lrank = "SLURM_LOCALID";
        v_lworld = getenv("SLURM_NTASKS_PER_NODE") ? "SLURM_NTASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
    }

    cpar_status st;
    if (strcmp(e.source, "default") != 0) {
        bool has_rank, has_world, has_lrank, has_lworld;
        if ((st = cpar__env_int(v_rank, 0, INT_MAX, &e.rank, &has_rank)) != CPAR_OK ||
            (st = cpar__env_int(v_world, 1, INT_MAX, &e.world_size, &has_world)) != CPAR_OK ||
            (st = cpar__env_int(v_lrank, 0, INT_MAX, &e.local_rank, &has_lrank)) != CPAR_OK)
            return st;
        st = slurm ? cpar__env_slurm_local_world(&e.local_world_size, &has_lworld)
                   : cpar__env_int(v_lworld, 1, INT_MAX, &e.local_world_size, &has_lworld);
        if (st != CPAR_OK)
            return st;
        if (!has_rank || !has_world)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: %s is set but %s is not (a launcher sets both)",
                              has_rank ? v_rank : v_world, has_rank ? v_world : v_rank);
        /* Launched by hand without the local variables: assume one node
         * holding every rank, ranks numbered node by node. */
        if (!has_lworld) {
            e.local_world_size = e.world_size;
            v_lworld = v_world;
        }
        if (!has_lrank)
            e.local_rank = e.rank % e.local_world_size;
        if (e.rank >= e.world_size)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: %s=%d is not below %s=%d", v_rank, e.rank,
                              v_world, e.world_size);
        if (e.local_world_size > e.world_size)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: %s=%d is larger than %s=%d", v_lworld,
                              e.local_world_size, v_world, e.world_size);
        if (e.local_rank >= e.local_world_size)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: %s=%d is not below %s=%d", v_lrank,
                              e.local_rank, v_lworld, e.local_world_size);
    }

    const char *addr = getenv("MASTER_ADDR");
    if (addr) {
        size_t n = strlen(addr);
        if (n == 0)
            return cpar__fail(NULL, CPAR_ERR_INVALID,
                              "cpar_env_read: MASTER_ADDR is empty, expected a host name or address");
        if (n >= sizeof e.master_addr)
            return cpar__fail(NULL, CPAR_ERR_INVALID,
                              "cpar_env_read: MASTER_ADDR is %zu characters, expected at most %zu", n,
                              sizeof e.master_addr - 1);
        memcpy(e.master_addr, addr, n + 1);
    } else if (slurm) {
        /* Several nodes: the step's node count when srun says it, else fewer tasks here than in all. */
        int nnodes = 1;
        bool has_nnodes;
        if ((st = cpar__env_int("SLURM_STEP_NUM_NODES", 1, INT_MAX, &nnodes, &has_nnodes)) != CPAR_OK)
            return st;
        if (has_nnodes ? nnodes > 1 : e.local_world_size < e.world_size)
            CPAR_TRY(cpar__env_slurm_master(&e, e.master_addr, sizeof e.master_addr));
    }

    const char *bind = getenv("CPAR_STORE_BIND");
    if (bind) {
        size_t n = strlen(bind);
        if (n == 0 || n >= sizeof e.store_bind)
            return cpar__fail(NULL, CPAR_ERR_INVALID,
                              "cpar_env_read: CPAR_STORE_BIND is %zu characters, expected 1..%zu (\"*\" for every "
                              "interface, or an address of this host)", n, sizeof e.store_bind - 1);
        memcpy(e.store_bind, bind, n + 1);
    } else if (e.rank == 0 && e.local_world_size < e.world_size && cpar__env_host_is_loopback(e.master_addr)) {
        /* Several nodes, yet MASTER_ADDR is loopback here (e.g. the hostname's
         * 127.0.1.1 in /etc/hosts): a loopback store would be unreachable. */
        snprintf(e.store_bind, sizeof e.store_bind, "*");
    } else {
        memcpy(e.store_bind, e.master_addr, sizeof e.store_bind);
    }
    CPAR_TRY(cpar__env_job_token("cpar_env_read", e.job_token, sizeof e.job_token, &e.job_token_source));
    bool has_mport, has_sport;
    if ((st = cpar__env_int("MASTER_PORT", 1, 65535, &e.master_port, &has_mport)) != CPAR_OK ||
        (st = cpar__env_int("CPAR_STORE_PORT", 1, 65535, &e.store_port, &has_sport)) != CPAR_OK)
        return st;
    /* torchrun's own TCPStore already listens on MASTER_PORT. */
    if (!has_sport) {
        if (e.master_port == 65535)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: MASTER_PORT=65535 leaves no port for "
                              "the store (MASTER_PORT+1); set CPAR_STORE_PORT");
        e.store_port = e.master_port + 1;
    }
    if (strcmp(e.source, "default")) /* a launched process: its log lines carry this rank */
        atomic_store(&cpar__proc_rank, e.rank);
    *out = e;
    return CPAR_OK;
}

/* ---- store: protocol ---------------------------------------------------- */

#define CPAR__STORE_MAGIC 0x43505354u /* "CPST" */
#define CPAR__STORE_VERSION 2         /* 2: HELLO with the job token replaced PING */
#define CPAR__STORE_HDR 12
#define CPAR__STORE_KEY_MAX 255
#define CPAR__STORE_VALUE_MAX ((size_t)1 << 20)
#define CPAR__STORE_LINGER_MS 2000 /* destroy: longest wait for clients to leave */
#define CPAR__STORE_BUF_KEEP ((size_t)64 << 10) /* larger per-connection buffers are freed after use */
#define CPAR__STORE_HELLO_MS 10000 /* longest a connection may take to show its token */
/* Defaults of the per-connection limits (cpar_store_config). Keys: a rank uses a
 * handful per barrier name; bytes: 64 full 1 MiB values. */
#define CPAR__STORE_MAX_KEYS 65536
#define CPAR__STORE_MAX_BYTES ((size_t)64 << 20)
#define CPAR__STORE_MAX_IDLE 256

enum { CPAR__STORE_HELLO = 1, CPAR__STORE_SET, CPAR__STORE_GET, CPAR__STORE_ADD };
enum {
    CPAR__STORE_OK = 0, CPAR__STORE_MISSING, CPAR__STORE_BADVALUE, CPAR__STORE_NOMEM,
    CPAR__STORE_DENIED, CPAR__STORE_TOOBIG, CPAR__STORE_KEYLIMIT, CPAR__STORE_BYTELIMIT
};
#define CPAR__STORE_REPLY 0x80 /* set in a reply's op byte: an echo of a request is never a reply */

#ifdef MSG_NOSIGNAL
#define CPAR__STORE_NOSIGNAL MSG_NOSIGNAL
#else
#define CPAR__STORE_NOSIGNAL 0 /* BSD/macOS: SO_NOSIGPIPE is set on each socket instead */
#endif

static void cpar__store_put32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24), p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8), p[3] = (unsigned char)v;
}
static uint32_t cpar__store_get32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static void cpar__store_put64(unsigned char *p, int64_t v)
{
    cpar__store_put32(p, (uint32_t)((uint64_t)v >> 32));
    cpar__store_put32(p + 4, (uint32_t)v);
}
static int64_t cpar__store_get64(const unsigned char *p)
{
    return (int64_t)((uint64_t)cpar__store_get32(p) << 32 | cpar__store_get32(p + 4));
}

static void cpar__store_put_hdr(unsigned char *p, unsigned op, size_t klen, size_t vlen)
{
    cpar__store_put32(p, CPAR__STORE_MAGIC);
    p[4] = CPAR__STORE_VERSION;
    p[5] = (unsigned char)op;
    p[6] = (unsigned char)(klen >> 8), p[7] = (unsigned char)klen;
    cpar__store_put32(p + 8, (uint32_t)vlen);
}

/* The only frames a server accepts: anything else closes the connection. */
static bool cpar__store_hdr_valid(const unsigned char *p, size_t *klen, size_t *vlen)
{
    if (cpar__store_get32(p) != CPAR__STORE_MAGIC || p[4] != CPAR__STORE_VERSION)
        return false;
    *klen = (size_t)p[6] << 8 | p[7];
    *vlen = cpar__store_get32(p + 8);
    switch (p[5]) {
    case CPAR__STORE_HELLO: return *klen == 0 && *vlen >= 1 && *vlen <= CPAR__STORE_TOKEN_MAX;
    case CPAR__STORE_SET: return *klen >= 1 && *klen <= CPAR__STORE_KEY_MAX && *vlen <= CPAR__STORE_VALUE_MAX;
    case CPAR__STORE_GET: return *klen >= 1 && *klen <= CPAR__STORE_KEY_MAX && *vlen == 0;
    case CPAR__STORE_ADD: return *klen >= 1 && *klen <= CPAR__STORE_KEY_MAX && *vlen == 8;
    default: return false;
    }
}

static const char *cpar__store_errstr(int err, char *buf, size_t n)
{
#if defined(__GLIBC__) && defined(_GNU_SOURCE)
    return strerror_r(err, buf, n); /* the GNU variant returns the string */
#else
    if (strerror_r(err, buf, n) != 0)
        snprintf(buf, n, "errno %d", err);
    return buf;
#endif
}

/* Every store socket: close-on-exec (children of a rank must not inherit
 * it), non-blocking (all waits are poll() with a deadline), no SIGPIPE. */
static int cpar__store_fd_setup(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0)
        return -1;
#ifdef SO_NOSIGPIPE
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof one);
#endif
    return 0;
}

static void cpar__store_sleep_ms(int64_t ms)
{
    if (ms > 0)
        (void)poll(NULL, 0, ms > INT_MAX ? INT_MAX : (int)ms);
}

static int cpar__store_ms_left(int64_t deadline)
{
    int64_t left = deadline - cpar__now_ms();
    return left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
}

/* "host:port", bracketing IPv6 literals. */
static void cpar__store_addr_str(char *buf, size_t n, const char *host, int port)
{
    snprintf(buf, n, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
}

/* A server host meaning "every interface"; only ever asked for explicitly. */
static bool cpar__store_host_is_any(const char *host)
{
    return host && (!strcmp(host, "*") || !strcmp(host, "0.0.0.0") || !strcmp(host, "::"));
}

/* Equal tokens, in a time that does not depend on where they differ. */
static bool cpar__store_token_eq(const unsigned char *a, size_t alen, const unsigned char *b, size_t blen)
{
    unsigned diff = alen != blen;
    for (size_t i = 0; i < CPAR__STORE_TOKEN_MAX; i++)
        diff |= (unsigned)((i < alen ? a[i] : 0) ^ (i < blen ? b[i] : 0));
    return diff == 0;
}

/* ---- store: server ------------------------------------------------------ */

typedef struct cpar__store_entry {
    struct cpar__store_entry *next;
    unsigned char *val;
    size_t vlen;
    uint32_t hash;
    uint16_t klen;
    char key[]; /* not NUL-terminated */
} cpar__store_entry;

typedef struct cpar__store_conn {
    int fd;
    unsigned char *in;  /* the frame being received */
    size_t in_have, in_need, in_cap;
    unsigned char *out; /* the reply not yet sent */
    size_t out_off, out_len, out_cap;
    int64_t last_progress; /* for dropping clients that stall mid-frame */
    int64_t opened;        /* accept time: the handshake must complete within hello_ms */
    bool authed;           /* showed the job token: may use the key space */
    bool closing;          /* refused: close once the reply is sent */
    int64_t keys, bytes;   /* keys this connection created, value bytes it added (net) */
} cpar__store_conn;

typedef struct cpar__store_server {
    int log_rank;           /* the creating thread's rank, for the server thread's log lines */
    int listen_fd;
    int wake[2]; /* self-pipe: cpar_store_destroy writes the shutdown deadline */
    pthread_t thread;
    int stall_ms;
    cpar__store_entry **buckets;
    size_t nbuckets, nentries;
    cpar__store_conn *conns;
    size_t nconns, cap_conns;
    struct pollfd *pfds; /* room for cap_conns + 2 */
    int64_t accept_paused_until; /* after EMFILE: stop spinning on the listener */
    unsigned char token[CPAR__STORE_TOKEN_MAX];
    size_t token_len;
    size_t max_value, max_bytes; /* limits, cpar_store_config's defaults applied */
    int64_t max_keys;
    size_t max_idle, nidle;      /* nidle: connections that have not shown the token yet */
    int hello_ms;
    _Atomic int refused_token;   /* clients refused for another job token (the barrier's report) */
    char refused_from[96];       /* the last one: "rank N at ADDR:PORT" (server thread only) */
} cpar__store_server;

static uint32_t cpar__store_hash(const char *key, size_t n)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)key[i]) * 16777619u;
    return h;
}

static cpar__store_entry *cpar__store_find(cpar__store_server *srv, const char *key, size_t klen, uint32_t h)
{
    for (cpar__store_entry *e = srv->buckets[h & (srv->nbuckets - 1)]; e; e = e->next)
        if (e->hash == h && e->klen == klen && memcmp(e->key, key, klen) == 0)
            return e;
    return NULL;
}

/* Insert or overwrite; false when out of memory (the table is unchanged). */
static bool cpar__store_put(cpar__store_server *srv, const char *key, size_t klen, const void *val, size_t vlen)
{
    uint32_t h = cpar__store_hash(key, klen);
    cpar__store_entry *e = cpar__store_find(srv, key, klen, h);
    unsigned char *copy = malloc(vlen ? vlen : 1);
    if (!copy)
        return false;
    if (vlen)
        memcpy(copy, val, vlen);
    if (e) {
        free(e->val);
        e->val = copy, e->vlen = vlen;
        return true;
    }
    if (srv->nentries >= srv->nbuckets) { /* keep chains short: grow at load 1 */
        size_t nb = srv->nbuckets * 2;
        cpar__store_entry **b = calloc(nb, sizeof *b);
        if (b) {
            for (size_t i = 0; i < srv->nbuckets; i++)
                for (cpar__store_entry *x = srv->buckets[i], *next; x; x = next) {
                    next = x->next;
                    x->next = b[x->hash & (nb - 1)];
                    b[x->hash & (nb - 1)] = x;
                }
            free(srv->buckets);
            srv->buckets = b, srv->nbuckets = nb;
        } /* else: keep the old table, just longer chains */
    }
    e = malloc(sizeof *e + klen);
    if (!e) {
        free(copy);
        return false;
    }
    memcpy(e->key, key, klen);
    e->klen = (uint16_t)klen, e->hash = h, e->val = copy, e->vlen = vlen;
    e->next = srv->buckets[h & (srv->nbuckets - 1)];
    srv->buckets[h & (srv->nbuckets - 1)] = e;
    srv->nentries++;
    return true;
}

/* Queue a reply on c; false when out of memory (the caller drops c). */
static bool cpar__store_reply(cpar__store_conn *c, unsigned status, const void *val, size_t vlen)
{
    size_t need = CPAR__STORE_HDR + vlen;
    if (need > c->out_cap) {
        unsigned char *p = realloc(c->out, need);
        if (!p)
            return false;
        c->out = p, c->out_cap = need;
    }
    cpar__store_put_hdr(c->out, CPAR__STORE_REPLY | status, 0, vlen);
    if (vlen)
        memcpy(c->out + CPAR__STORE_HDR, val, vlen);
    c->out_off = 0, c->out_len = need;
    return true;
}

/* Refuse a request over a limit; the reply carries the limit. */
static bool cpar__store_reply_limit(cpar__store_conn *c, unsigned status, uint64_t limit)
{
    unsigned char be[8];
    cpar__store_put64(be, (int64_t)limit);
    return cpar__store_reply(c, status, be, sizeof be);
}

/* Would storing vlen bytes under a key (e: its entry, NULL when new) break
 * c's limits? Returns the refusing status, or OK. */
static unsigned cpar__store_over_limit(cpar__store_server *srv, cpar__store_conn *c, cpar__store_entry *e,
                                       size_t vlen, uint64_t *limit)
{
    int64_t grow = (int64_t)vlen - (e ? (int64_t)e->vlen : 0);
    if (!e && c->keys >= srv->max_keys) {
        *limit = (uint64_t)srv->max_keys;
        return CPAR__STORE_KEYLIMIT;
    }
    if (grow > 0 && c->bytes + grow > (int64_t)srv->max_bytes) {
        *limit = srv->max_bytes;
        return CPAR__STORE_BYTELIMIT;
    }
    return CPAR__STORE_OK;
}

static void cpar__store_charge(cpar__store_conn *c, cpar__store_entry *e, size_t vlen)
{
    c->keys += e == NULL;
    c->bytes += (int64_t)vlen - (e ? (int64_t)e->vlen : 0);
}

/* Execute the complete, validated frame in c->in and queue its reply. */
static bool cpar__store_execute(cpar__store_server *srv, cpar__store_conn *c)
{
    const unsigned char *p = c->in;
    size_t klen = (size_t)p[6] << 8 | p[7], vlen = cpar__store_get32(p + 8);
    const char *key = (const char *)p + CPAR__STORE_HDR;
    const unsigned char *val = p + CPAR__STORE_HDR + klen;
    if (p[5] == CPAR__STORE_HELLO) {
        /* the token, then (from a launched rank) "\0rank N": who was refused */
        size_t tl = 0;
        while (tl < vlen && val[tl]) tl++;
        bool ok = tl <= CPAR__STORE_TOKEN_MAX && cpar__store_token_eq(val, tl, srv->token, srv->token_len);
        c->authed = c->authed || ok; /* the server recounts its idle connections after each round */
        c->closing = !ok;
        if (!ok) { /* said at once: a rank of this job started with another token waits for nothing */
            struct sockaddr_storage sa;
            socklen_t sl = sizeof sa;
            char host[48] = "?", port[8] = "?";
            if (getpeername(c->fd, (struct sockaddr *)&sa, &sl) == 0)
                (void)getnameinfo((struct sockaddr *)&sa, sl, host, sizeof host, port, sizeof port,
                                  NI_NUMERICHOST | NI_NUMERICSERV);
            char who[32] = "";
            if (tl + 1 < vlen) { /* "rank N" as the client said it (printable characters only) */
                size_t n = 0;
                for (size_t i = tl + 1; i < vlen && n + 1 < sizeof who; i++)
                    if (val[i] >= 0x20 && val[i] < 0x7f) who[n++] = (char)val[i];
                who[n] = '\0';
            }
            snprintf(srv->refused_from, sizeof srv->refused_from, "%s%s%s:%s", who, who[0] ? " at " : "", host,
                     port);
            atomic_fetch_add(&srv->refused_token, 1);
            cpar__log(CPAR__LOG_WARN, srv->log_rank, "store: refused a client, %s: it showed another job token "
                      "(a rank started with another CPAR_JOB_TOKEN, or another job's process on this port?)",
                      srv->refused_from);
        }
        return cpar__store_reply(c, ok ? CPAR__STORE_OK : CPAR__STORE_DENIED, NULL, 0);
    }
    if (!c->authed)
        return false; /* the key space is for token holders only: drop it */
    uint64_t limit = 0;
    unsigned refuse;
    switch (p[5]) {
    case CPAR__STORE_SET: {
        if (vlen > srv->max_value)
            return cpar__store_reply_limit(c, CPAR__STORE_TOOBIG, srv->max_value);
        cpar__store_entry *e = cpar__store_find(srv, key, klen, cpar__store_hash(key, klen));
        if ((refuse = cpar__store_over_limit(srv, c, e, vlen, &limit)) != CPAR__STORE_OK)
            return cpar__store_reply_limit(c, refuse, limit);
        int64_t keys = c->keys, bytes = c->bytes;
        cpar__store_charge(c, e, vlen);
        if (!cpar__store_put(srv, key, klen, val, vlen)) {
            c->keys = keys, c->bytes = bytes;
            return cpar__store_reply(c, CPAR__STORE_NOMEM, NULL, 0);
        }
        return cpar__store_reply(c, CPAR__STORE_OK, NULL, 0);
    }
    case CPAR__STORE_GET: {
        cpar__store_entry *e = cpar__store_find(srv, key, klen, cpar__store_hash(key, klen));
        return e ? cpar__store_reply(c, CPAR__STORE_OK, e->val, e->vlen)
                 : cpar__store_reply(c, CPAR__STORE_MISSING, NULL, 0);
    }
    case CPAR__STORE_ADD: {
        cpar__store_entry *e = cpar__store_find(srv, key, klen, cpar__store_hash(key, klen));
        int64_t sum = cpar__store_get64(val);
        if (e) {
            /* The counter is decimal text: parse it strictly, add without overflow. */
            char text[24];
            long long cur;
            char *end;
            if (e->vlen == 0 || e->vlen >= sizeof text)
                return cpar__store_reply(c, CPAR__STORE_BADVALUE, NULL, 0);
            memcpy(text, e->val, e->vlen);
            text[e->vlen] = '\0';
            errno = 0;
            cur = strtoll(text, &end, 10);
            if (errno != 0 || *end != '\0' || !((text[0] >= '0' && text[0] <= '9') || text[0] == '-') ||
                (sum > 0 && cur > INT64_MAX - sum) || (sum < 0 && cur < INT64_MIN - sum))
                return cpar__store_reply(c, CPAR__STORE_BADVALUE, NULL, 0);
            sum += (int64_t)cur;
        }
        char text[24];
        int n = snprintf(text, sizeof text, "%" PRId64, sum);
        unsigned char be[8];
        cpar__store_put64(be, sum);
        if ((refuse = cpar__store_over_limit(srv, c, e, (size_t)n, &limit)) != CPAR__STORE_OK)
            return cpar__store_reply_limit(c, refuse, limit);
        int64_t keys = c->keys, bytes = c->bytes;
        cpar__store_charge(c, e, (size_t)n);
        if (!cpar__store_put(srv, key, klen, text, (size_t)n)) {
            c->keys = keys, c->bytes = bytes;
            return cpar__store_reply(c, CPAR__STORE_NOMEM, NULL, 0);
        }
        return cpar__store_reply(c, CPAR__STORE_OK, be, sizeof be);
    }
    default:
        return false; /* unreachable: the header was validated */
    }
}

/* Send what the socket takes of the pending reply. false: drop c. */
static bool cpar__store_conn_flush(cpar__store_conn *c, int64_t now)
{
    while (c->out_off < c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, CPAR__STORE_NOSIGNAL);
        if (n > 0) {
            c->out_off += (size_t)n;
            c->last_progress = now;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else {
            return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
        }
    }
    c->out_off = c->out_len = 0;
    if (c->out_cap > CPAR__STORE_BUF_KEEP) { /* one big GET must not pin 1 MiB per client */
        free(c->out);
        c->out = NULL, c->out_cap = 0;
    }
    return true;
}

/* Read frames until the socket is drained, a reply is waiting to be sent (no
 * pipelining past an unsent reply), or a fairness bound. false: drop c. */
static bool cpar__store_conn_read(cpar__store_server *srv, cpar__store_conn *c, int64_t now)
{
    for (int frames = 0; frames < 16 && c->out_off == c->out_len && !c->closing;) {
        ssize_t n = recv(c->fd, c->in + c->in_have, c->in_need - c->in_have, 0);
        if (n == 0)
            return false; /* peer closed; mid-frame or not, the connection is done */
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno == EAGAIN || errno == EWOULDBLOCK;
        }
        c->in_have += (size_t)n;
        c->last_progress = now;
        if (c->in_have == CPAR__STORE_HDR && c->in_need == CPAR__STORE_HDR) {
            /* Validate before reading the body: a bogus length never allocates. */
            size_t klen, vlen;
            if (!cpar__store_hdr_valid(c->in, &klen, &vlen))
                return false;
            if (!c->authed && c->in[5] != CPAR__STORE_HELLO)
                return false; /* before the token, nothing else: not even a buffer for its body */
            c->in_need = CPAR__STORE_HDR + klen + vlen;
            if (c->in_need > c->in_cap) {
                unsigned char *p = realloc(c->in, c->in_need);
                if (!p)
                    return false;
                c->in = p, c->in_cap = c->in_need;
            }
        }
        if (c->in_have < c->in_need)
            continue;
        bool ok = cpar__store_execute(srv, c);
        c->in_have = 0, c->in_need = CPAR__STORE_HDR;
        if (c->in_cap > CPAR__STORE_BUF_KEEP) {
            unsigned char *p = realloc(c->in, CPAR__STORE_HDR + CPAR__STORE_KEY_MAX);
            if (p)
                c->in = p, c->in_cap = CPAR__STORE_HDR + CPAR__STORE_KEY_MAX;
        }
        if (!ok || !cpar__store_conn_flush(c, now))
            return false;
        if (c->closing && c->out_off == c->out_len)
            return false; /* refused, and the refusal is sent */
        frames++;
    }
    return true;
}

static void cpar__store_conn_close(cpar__store_conn *c)
{
    close(c->fd);
    free(c->in);
    free(c->out);
    c->fd = -1, c->in = c->out = NULL;
}

static void cpar__store_accept(cpar__store_server *srv, int64_t now)
{
    /* Bounded: clients already connected get served too. Past max_idle
     * connections without a token, the rest wait in the kernel's backlog. */
    for (int i = 0; i < 64 && srv->nidle < srv->max_idle; i++) {
        int fd = accept(srv->listen_fd, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO)
                continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                srv->accept_paused_until = now + 100; /* the listener would stay readable: don't spin */
            return;
        }
        int one = 1;
        unsigned char *in = malloc(CPAR__STORE_HDR + CPAR__STORE_KEY_MAX);
        if (!in || cpar__store_fd_setup(fd) < 0) {
            free(in);
            close(fd);
            continue;
        }
        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (srv->nconns == srv->cap_conns) {
            size_t cap = srv->cap_conns ? srv->cap_conns * 2 : 16;
            cpar__store_conn *cs = realloc(srv->conns, cap * sizeof *cs);
            struct pollfd *ps = cs ? realloc(srv->pfds, (cap + 2) * sizeof *ps) : NULL;
            if (cs)
                srv->conns = cs;
            if (!cs || !ps) {
                free(in);
                close(fd);
                return;
            }
            srv->pfds = ps, srv->cap_conns = cap;
        }
        srv->conns[srv->nconns++] = (cpar__store_conn){
            .fd = fd, .in = in, .in_need = CPAR__STORE_HDR, .in_cap = CPAR__STORE_HDR + CPAR__STORE_KEY_MAX,
            .last_progress = now, .opened = now};
        srv->nidle++;
    }
}

/* The server thread. It stops when the wake pipe carries a deadline and
 * either every client has gone or that deadline has passed. */
static void *cpar__store_serve(void *arg)
{
    cpar__store_server *srv = arg;
    cpar__tls_rank = srv->log_rank;
    bool stopping = false;
    int64_t stop_at = 0;
    for (;;) {
        int64_t now = cpar__now_ms();
        if (stopping && (srv->nconns == 0 || now >= stop_at))
            break;
        /* [0] wake pipe, [1] listener (unless paused), then one per client. */
        struct pollfd *pf = srv->pfds;
        size_t np = 0;
        pf[np++] = (struct pollfd){.fd = srv->wake[0], .events = POLLIN};
        bool listening = now >= srv->accept_paused_until && srv->nidle < srv->max_idle;
        pf[np++] = (struct pollfd){.fd = listening ? srv->listen_fd : -1, .events = POLLIN};
        int64_t wake_at = stopping ? stop_at : listening ? INT64_MAX : srv->accept_paused_until;
        for (size_t i = 0; i < srv->nconns; i++) {
            cpar__store_conn *c = &srv->conns[i];
            bool sending = c->out_off < c->out_len;
            pf[np++] = (struct pollfd){.fd = c->fd, .events = sending ? POLLOUT : POLLIN};
            if ((sending || c->in_have > 0) && c->last_progress + srv->stall_ms < wake_at)
                wake_at = c->last_progress + srv->stall_ms;
            if (!c->authed && c->opened + srv->hello_ms < wake_at)
                wake_at = c->opened + srv->hello_ms;
        }
        int timeout = wake_at == INT64_MAX ? -1 : cpar__store_ms_left(wake_at);
        int r = poll(pf, np, timeout);
        if (r < 0) {
            if (errno != EINTR)
                cpar__store_sleep_ms(10); /* ENOMEM: transient, retry */
            continue;
        }
        now = cpar__now_ms();
        if (pf[0].revents) {
            unsigned char msg[8];
            if (read(srv->wake[0], msg, sizeof msg) == (ssize_t)sizeof msg) {
                stopping = true;
                stop_at = cpar__store_get64(msg);
            }
        }
        for (size_t i = 0; i + 2 < np; i++) {
            cpar__store_conn *c = &srv->conns[i];
            short ev = pf[i + 2].revents;
            bool keep = true;
            if (ev & (POLLOUT | POLLERR | POLLHUP | POLLNVAL))
                keep = (ev & POLLNVAL) == 0 && cpar__store_conn_flush(c, now);
            if (keep && c->out_off == c->out_len && (ev & (POLLIN | POLLERR | POLLHUP)))
                keep = cpar__store_conn_read(srv, c, now);
            if (keep && (c->in_have > 0 || c->out_off < c->out_len) && now - c->last_progress >= srv->stall_ms)
                keep = false; /* half a frame (or an unread reply) for a whole timeout: give up on it */
            if (keep && c->closing && c->out_off == c->out_len)
                keep = false; /* refused at the handshake, and told so */
            if (keep && !c->authed && now - c->opened >= srv->hello_ms) {
                keep = false; /* an idle connection must not hold a slot for ever */
                cpar__log(CPAR__LOG_INFO, -1, "cpar store: dropped a client that sent no job token within %d ms",
                          srv->hello_ms);
            }
            if (!keep)
                cpar__store_conn_close(c);
        }
        size_t live = 0;
        srv->nidle = 0;
        for (size_t i = 0; i < srv->nconns; i++)
            if (srv->conns[i].fd >= 0) {
                srv->nidle += !srv->conns[i].authed;
                srv->conns[live++] = srv->conns[i];
            }
        srv->nconns = live;
        if (pf[1].revents) /* last: accepting may grow conns and pfds */
            cpar__store_accept(srv, now);
    }
    for (size_t i = 0; i < srv->nconns; i++)
        cpar__store_conn_close(&srv->conns[i]);
    srv->nconns = 0;
    return NULL;
}

static void cpar__store_server_free(cpar__store_server *srv)
{
    if (!srv)
        return;
    for (size_t i = 0; i < srv->nconns; i++)
        cpar__store_conn_close(&srv->conns[i]);
    for (size_t i = 0; i < srv->nbuckets; i++)
        for (cpar__store_entry *e = srv->buckets[i], *next; e; e = next) {
            next = e->next;
            free(e->val);
            free(e);
        }
    if (srv->listen_fd >= 0)
        close(srv->listen_fd);
    if (srv->wake[0] >= 0)
        close(srv->wake[0]);
    if (srv->wake[1] >= 0)
        close(srv->wake[1]);
    free(srv->buckets);
    free(srv->conns);
    free(srv->pfds);
    free(srv);
}

/* One listening socket on sa, or -1 with *err set. SO_REUSEADDR: a previous
 * job's TIME_WAIT sockets must not block the port. Never SO_REUSEPORT: two
 * live servers on one port must collide loudly. */
static int cpar__store_bind(const struct sockaddr *sa, socklen_t len, int *err)
{
    int fd = socket(sa->sa_family, SOCK_STREAM, 0), one = 1, zero = 0;
    if (fd < 0) {
        *err = errno;
        return -1;
    }
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (sa->sa_family == AF_INET6) /* "::" takes IPv4 clients too */
        (void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    /* The backlog is clamped by net.core.somaxconn; thousands of ranks may knock at once. */
    if (cpar__store_fd_setup(fd) == 0 && bind(fd, sa, len) == 0 && listen(fd, 4096) == 0)
        return fd;
    *err = errno;
    close(fd);
    return -1;
}

/* Listen on host:port; host NULL means every interface: IPv6 dual-stack,
 * or IPv4 where the kernel has no IPv6. Returns the fd, or -1 with *err. */
static int cpar__store_listen(const char *host, int port, int *err)
{
    if (!host) {
        struct sockaddr_in6 a6;
        memset(&a6, 0, sizeof a6);
        a6.sin6_family = AF_INET6, a6.sin6_port = htons((uint16_t)port), a6.sin6_addr = in6addr_any;
        int fd = cpar__store_bind((const struct sockaddr *)&a6, sizeof a6, err);
        if (fd >= 0 || *err == EADDRINUSE)
            return fd;
        struct sockaddr_in a4;
        memset(&a4, 0, sizeof a4);
        a4.sin_family = AF_INET, a4.sin_port = htons((uint16_t)port), a4.sin_addr.s_addr = htonl(INADDR_ANY);
        return cpar__store_bind((const struct sockaddr *)&a4, sizeof a4, err);
    }
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV}, *res = NULL;
    int gai = getaddrinfo(host, portstr, &hints, &res), fd = -1;
    *err = gai == 0 ? EADDRNOTAVAIL : gai == EAI_SYSTEM ? errno : EADDRNOTAVAIL;
    for (struct addrinfo *ai = gai == 0 ? res : NULL; ai && fd < 0 && *err != EADDRINUSE; ai = ai->ai_next)
        fd = cpar__store_bind(ai->ai_addr, ai->ai_addrlen, err);
    if (res)
        freeaddrinfo(res);
    return fd;
}

/* ---- store: client ------------------------------------------------------ */

struct cpar_store {
    int fd;                 /* connection to the server; also on the hosting process */
    int timeout_ms;
    bool broken;            /* a reply was lost or the server left: the stream is out of sync */
    pthread_mutex_t mu;     /* one request in flight per handle */
    char addr[300];         /* "host:port" for messages */
    cpar__store_server *server; /* non-NULL on the process hosting the server */
    char token[CPAR__STORE_TOKEN_MAX + 1]; /* the job token this handle shows */
};

/* I/O results of the client helpers. */
enum { CPAR__STORE_IO_OK = 0, CPAR__STORE_IO_TIMEOUT = -1, CPAR__STORE_IO_CLOSED = -2 };

/* Wait for ev on fd until the deadline: 1 ready, 0 deadline passed, -1 error. */
static int cpar__store_wait(int fd, short ev, int64_t deadline)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = ev};
        int r = poll(&p, 1, cpar__store_ms_left(deadline));
        if (r > 0)
            return 1; /* also on POLLERR/POLLHUP: the next send/recv reports it */
        if (r == 0 && cpar__now_ms() >= deadline)
            return 0;
        if (r < 0 && errno != EINTR)
            return -1;
    }
}

/* Send every byte of iov[0..n). Returns CPAR__STORE_IO_* or an errno > 0. */
static int cpar__store_send_iov(int fd, struct iovec *iov, int n, int64_t deadline)
{
    while (n > 0) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t r = sendmsg(fd, &m, CPAR__STORE_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EPIPE || errno == ECONNRESET)
                return CPAR__STORE_IO_CLOSED;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                return errno;
            int w = cpar__store_wait(fd, POLLOUT, deadline);
            if (w <= 0)
                return w == 0 ? CPAR__STORE_IO_TIMEOUT : errno;
            continue;
        }
        size_t done = (size_t)r; /* partial send: advance through the iovecs */
        while (n > 0 && done >= iov->iov_len) {
            done -= iov->iov_len;
            iov++, n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + done;
            iov->iov_len -= done;
        }
    }
    return CPAR__STORE_IO_OK;
}

/* Receive exactly len bytes into buf (NULL: read and drop them). */
static int cpar__store_recv_all(int fd, void *buf, size_t len, int64_t deadline)
{
    unsigned char sink[4096];
    size_t got = 0;
    while (got < len) {
        void *dst = buf ? (unsigned char *)buf + got : sink;
        size_t want = buf ? len - got : (len - got < sizeof sink ? len - got : sizeof sink);
        ssize_t r = recv(fd, dst, want, 0);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        if (r == 0 || errno == ECONNRESET)
            return CPAR__STORE_IO_CLOSED;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return errno;
        int w = cpar__store_wait(fd, POLLIN, deadline);
        if (w <= 0)
            return w == 0 ? CPAR__STORE_IO_TIMEOUT : errno;
    }
    return CPAR__STORE_IO_OK;
}

/* Turn an I/O failure into a status. The stream is out of sync afterwards
 * (part of a request or a reply may be in flight), so the handle is broken. */
static cpar_status cpar__store_io_fail(cpar_store *s, const char *fn, int io)
{
    char eb[128];
    s->broken = true;
    if (io == CPAR__STORE_IO_TIMEOUT)
        return cpar__fail(NULL, CPAR_ERR_TIMEOUT, "%s: store at %s did not answer within %d ms", fn, s->addr,
                          s->timeout_ms);
    if (io == CPAR__STORE_IO_CLOSED)
        return cpar__fail(NULL, CPAR_ERR_PEER, "%s: store at %s closed the connection (did rank 0 exit?)", fn,
                          s->addr);
    return cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: talking to store at %s: %s", fn, s->addr,
                      cpar__store_errstr(io, eb, sizeof eb));
}

/* One round trip. The reply value lands in buf when it fits in cap; a larger
 * one is read and dropped (keeping the stream in sync) and *rlen still says
 * its size. *rstatus gets the server's status. Call with s->mu held. */
static cpar_status cpar__store_call(cpar_store *s, const char *fn, unsigned op, const char *key, const void *val,
                                    size_t vlen, unsigned *rstatus, void *buf, size_t cap, size_t *rlen)
{
    if (s->broken)
        return cpar__fail(NULL, CPAR_ERR_PEER, "%s: the connection to the store at %s failed earlier", fn, s->addr);
    int64_t deadline = cpar__now_ms() + s->timeout_ms;
    size_t klen = key ? strlen(key) : 0;
    unsigned char head[CPAR__STORE_HDR + CPAR__STORE_KEY_MAX];
    cpar__store_put_hdr(head, op, klen, vlen);
    memcpy(head + CPAR__STORE_HDR, key ? key : "", klen);
    struct iovec iov[2] = {{.iov_base = head, .iov_len = CPAR__STORE_HDR + klen},
                           {.iov_base = (void *)val, .iov_len = vlen}};
    int io = cpar__store_send_iov(s->fd, iov, vlen ? 2 : 1, deadline);
    if (io == CPAR__STORE_IO_OK)
        io = cpar__store_recv_all(s->fd, head, CPAR__STORE_HDR, deadline);
    if (io != CPAR__STORE_IO_OK)
        return cpar__store_io_fail(s, fn, io);
    size_t n = cpar__store_get32(head + 8);
    if (cpar__store_get32(head) != CPAR__STORE_MAGIC || head[4] != CPAR__STORE_VERSION ||
        !(head[5] & CPAR__STORE_REPLY) || n > CPAR__STORE_VALUE_MAX) {
        s->broken = true;
        return cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: %s sent a reply that is not a cpar store's (version %d)", fn,
                          s->addr, CPAR__STORE_VERSION);
    }
    *rstatus = head[5] & ~CPAR__STORE_REPLY;
    bool limited = *rstatus == CPAR__STORE_TOOBIG || *rstatus == CPAR__STORE_KEYLIMIT ||
                   *rstatus == CPAR__STORE_BYTELIMIT;
    unsigned char lim[8];
    io = cpar__store_recv_all(s->fd, limited && n == sizeof lim ? lim : n <= cap ? buf : NULL, n, deadline);
    if (io != CPAR__STORE_IO_OK)
        return cpar__store_io_fail(s, fn, io);
    if (rlen)
        *rlen = n;
    if (*rstatus == CPAR__STORE_NOMEM)
        return cpar__fail(NULL, CPAR_ERR_OOM, "%s: store at %s is out of memory (key \"%s\", %zu bytes)", fn, s->addr,
                          key ? key : "", vlen);
    if (limited) {
        int64_t limit = n == sizeof lim ? cpar__store_get64(lim) : -1;
        if (*rstatus == CPAR__STORE_TOOBIG)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: value of key \"%s\" is %zu bytes, more than the limit of "
                              "the store at %s (max_value_bytes=%" PRId64 ")", fn, key ? key : "", vlen, s->addr, limit);
        if (*rstatus == CPAR__STORE_KEYLIMIT)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cannot create key \"%s\": this client has created "
                              "max_keys_per_client=%" PRId64 " keys in the store at %s", fn, key ? key : "", limit,
                              s->addr);
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cannot store %zu bytes under key \"%s\": this client would "
                          "hold more than max_bytes_per_client=%" PRId64 " value bytes in the store at %s", fn, vlen,
                          key ? key : "", limit, s->addr);
    }
    return CPAR_OK;
}

/* TCP "simultaneous open" to a local port nobody listens on: the kernel may
 * pick that very port as our source port and connect the socket to itself.
 * The store's ports come from the ephemeral range, so retries can hit it. */
static bool cpar__store_self_connected(int fd)
{
    struct sockaddr_storage a, b;
    socklen_t la = sizeof a, lb = sizeof b;
    if (getsockname(fd, (struct sockaddr *)&a, &la) != 0 || getpeername(fd, (struct sockaddr *)&b, &lb) != 0)
        return false;
    if (a.ss_family != b.ss_family)
        return false;
    if (a.ss_family == AF_INET) {
        const struct sockaddr_in *x = (const void *)&a, *y = (const void *)&b;
        return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
    }
    if (a.ss_family == AF_INET6) {
        const struct sockaddr_in6 *x = (const void *)&a, *y = (const void *)&b;
        return x->sin6_port == y->sin6_port && !memcmp(&x->sin6_addr, &y->sin6_addr, sizeof x->sin6_addr);
    }
    return false;
}

/* Connect to host:port, retrying until the deadline: ECONNREFUSED is normal
 * while rank 0 is still starting. Then a HELLO checks that it is a cpar store
 * and shows the job token. A store of another job is an error at once, not a
 * retry: it will not change hands before our deadline, and its own job must
 * not be disturbed. */
static cpar_status cpar__store_connect(cpar_store *s, const char *host, int port, int64_t deadline)
{
    const char *fn = "cpar_store_create";
    char portstr[16], eb[128];
    snprintf(portstr, sizeof portstr, "%d", port);
    int last_err = ECONNREFUSED, backoff = 10;
    cpar__progress progress = cpar__progress_start();
    for (;;) {
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
        struct addrinfo *res = NULL;
        int gai = getaddrinfo(host, portstr, &hints, &res);
        if (gai != 0 && gai != EAI_AGAIN)
            return cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: cannot resolve store host \"%s\": %s", fn, host,
                              gai == EAI_SYSTEM ? cpar__store_errstr(errno, eb, sizeof eb) : gai_strerror(gai));
        if (gai == EAI_AGAIN)
            last_err = EAGAIN;
        for (struct addrinfo *ai = res; ai && s->fd < 0; ai = ai->ai_next) {
            int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
            if (fd < 0 || cpar__store_fd_setup(fd) < 0) {
                last_err = errno;
                if (fd >= 0)
                    close(fd);
                continue;
            }
            int err = 0;
            if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0) {
                err = errno;
                /* Bound one attempt so a blackholed address leaves time for the next. */
                int64_t attempt = cpar__now_ms() + 5000;
                if (err == EINPROGRESS || err == EINTR) {
                    int w = cpar__store_wait(fd, POLLOUT, attempt < deadline ? attempt : deadline);
                    socklen_t sl = sizeof err;
                    if (w <= 0)
                        err = w == 0 ? ETIMEDOUT : errno;
                    else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl) < 0)
                        err = errno;
                }
            }
            if (err == 0 && cpar__store_self_connected(fd))
                err = ECONNREFUSED;
            if (err == 0) {
                int one = 1;
                (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                s->fd = fd;
            } else {
                last_err = err;
                close(fd);
            }
        }
        if (res)
            freeaddrinfo(res);
        if (s->fd >= 0)
            break;
        int64_t now = cpar__now_ms();
        if (now >= deadline)
            return cpar__fail(NULL, CPAR_ERR_TIMEOUT, "%s: no store at %s after %d ms (is rank 0 running?): %s", fn,
                              s->addr, s->timeout_ms, cpar__store_errstr(last_err, eb, sizeof eb));
        cpar__progress_tick(&progress, -1, deadline, "%s: no store at %s yet (%s): is rank 0 running, and is "
                            "MASTER_ADDR its address?", fn, s->addr, cpar__store_errstr(last_err, eb, sizeof eb));
        cpar__store_sleep_ms(backoff < deadline - now ? backoff : deadline - now);
        backoff = backoff * 2 > 500 ? 500 : backoff * 2;
    }
    unsigned rstatus;
    /* the token, and the rank the launcher gave this process, so a refusing
     * server can say which rank it turned away */
    char hello[CPAR__STORE_TOKEN_MAX + 1], tail[24] = "";
    size_t hlen = strlen(s->token), tlen = 0;
    memcpy(hello, s->token, hlen);
    const char *rank = getenv("RANK") ? getenv("RANK") : getenv("SLURM_PROCID");
    long r;
    if (rank && cpar__env_parse_long(rank, &r) && r >= 0 && r < INT_MAX)
        tlen = (size_t)snprintf(tail, sizeof tail, "%crank %ld", 0, r);
    if (tlen && hlen + tlen <= CPAR__STORE_TOKEN_MAX) { /* the frame's limit: a long token goes alone */
        memcpy(hello + hlen, tail, tlen);
        hlen += tlen;
    }
    cpar_status st = cpar__store_call(s, fn, CPAR__STORE_HELLO, NULL, hello, hlen, &rstatus, NULL, 0, NULL);
    if (st == CPAR_ERR_PEER)
        return cpar__fail(NULL, CPAR_ERR_SYSTEM,
                          "%s: %s closed the connection at the handshake: not a cpar store of version %d "
                          "(torchrun's store on MASTER_PORT? see CPAR_STORE_PORT)", fn, s->addr, CPAR__STORE_VERSION);
    if (st == CPAR_OK && rstatus == CPAR__STORE_DENIED)
        return cpar__fail(NULL, CPAR_ERR_SYSTEM,
                          "%s: the store at %s belongs to another job: its job token differs from this rank's "
                          "(every rank of a job needs the same CPAR_JOB_TOKEN; two jobs need different store ports)",
                          fn, s->addr);
    if (st == CPAR_OK && rstatus != CPAR__STORE_OK)
        return cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: %s refused the handshake (status %u)", fn, s->addr, rstatus);
    return st;
}

static cpar_status cpar__store_check_key(const char *fn, const char *key)
{
    if (!key)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: key is NULL", fn);
    size_t n = strnlen(key, CPAR__STORE_KEY_MAX + 1);
    if (n == 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: key is empty", fn);
    if (n > CPAR__STORE_KEY_MAX)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: key is %zu bytes, expected at most %d (key \"%.32s...\")", fn,
                          strlen(key), CPAR__STORE_KEY_MAX, key);
    return CPAR_OK;
}

/* Stop the server thread: it serves until every client has gone or the
 * deadline (now + linger_ms) passes, then exits. */
static void cpar__store_server_stop(cpar__store_server *srv, int64_t linger_ms)
{
    unsigned char msg[8];
    cpar__store_put64(msg, cpar__now_ms() + linger_ms);
    while (write(srv->wake[1], msg, sizeof msg) < 0 && errno == EINTR) {
    }
    pthread_join(srv->thread, NULL);
}

cpar_status cpar_store_destroy(cpar_store *s)
{
    if (!s)
        return CPAR_OK;
    if (s->fd >= 0)
        close(s->fd); /* first: the server must not wait for its own client */
    if (s->server) {
        /* Linger until the other ranks have disconnected, so one still
         * polling the last barrier is not cut off when rank 0 is quicker.
         * Bounded, so a rank 0 that is failing still fails its peers fast. */
        cpar__store_server_stop(s->server, s->timeout_ms < CPAR__STORE_LINGER_MS ? s->timeout_ms
                                                                                 : CPAR__STORE_LINGER_MS);
        cpar__store_server_free(s->server);
    }
    pthread_mutex_destroy(&s->mu);
    free(s);
    return CPAR_OK;
}

/* cpar_store_create; *listen_err (may be NULL) gets the errno of a failed
 * listen, so cpar_init_from_env can tell a port in use from other failures. */
static cpar_status cpar__store_create(const char *fn, const cpar_store_config *cfg, cpar_store **out, int *listen_err)
{
    if (listen_err)
        *listen_err = 0;
    if (!out)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    *out = NULL;
    if (!cfg)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cfg is NULL", fn);
    if (cfg->port < 1 || cfg->port > 65535)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cfg->port is %d, expected 1..65535", fn, cfg->port);
    if (cfg->timeout_ms < 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cfg->timeout_ms is %d, expected >= 0 (0: default)", fn,
                          cfg->timeout_ms);
    if (cfg->host && strnlen(cfg->host, 256) > 255)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cfg->host is longer than 255 characters", fn);
    if (cfg->token && (!*cfg->token || strnlen(cfg->token, CPAR__STORE_TOKEN_MAX + 1) > CPAR__STORE_TOKEN_MAX))
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cfg->token is %zu bytes, expected 1..%d (NULL: from the "
                          "environment)", fn, strlen(cfg->token), CPAR__STORE_TOKEN_MAX);
    if (cfg->max_value_bytes > CPAR__STORE_VALUE_MAX)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cfg->max_value_bytes is %zu, expected at most %zu (1 MiB; 0: "
                          "default)", fn, cfg->max_value_bytes, CPAR__STORE_VALUE_MAX);
    if (cfg->max_keys_per_client < 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cfg->max_keys_per_client is %d, expected >= 0 (0: default)",
                          fn, cfg->max_keys_per_client);
    if (cfg->max_idle_conns < 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cfg->max_idle_conns is %d, expected >= 0 (0: default)", fn,
                          cfg->max_idle_conns);

    cpar_store *s = calloc(1, sizeof *s);
    if (!s)
        return cpar__fail(NULL, CPAR_ERR_OOM, "%s: cannot allocate %zu bytes", fn, sizeof *s);
    s->fd = -1;
    s->timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : cpar__default_timeout_ms();
    const char *token_source = "cfg->token";
    cpar_status st = CPAR_OK;
    if (cfg->token)
        snprintf(s->token, sizeof s->token, "%s", cfg->token);
    else
        st = cpar__env_job_token(fn, s->token, sizeof s->token, &token_source);
    if (st == CPAR_OK && !s->token[0])
        st = cpar__fail(NULL, CPAR_ERR_INVALID, "%s: no job token: ranks started by hand need CPAR_JOB_TOKEN, the "
                        "same secret on every rank (e.g. export CPAR_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | "
                        "tr -d ' \\n')); cparrun draws one, torchrun --standalone (or --rdzv-id) and srun give one",
                        fn);
    if (st != CPAR_OK) {
        free(s);
        return st;
    }
    if (pthread_mutex_init(&s->mu, NULL) != 0) {
        free(s);
        return cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: cannot create a mutex", fn);
    }
    int64_t deadline = cpar__now_ms() + s->timeout_ms;
    char eb[128];

    /* A server listens on loopback unless told otherwise, and reaches itself
     * over loopback when it listens on every interface. */
    const char *host = cfg->host && *cfg->host ? cfg->host : "127.0.0.1";
    bool any = cfg->is_server && cpar__store_host_is_any(host);
    if (any)
        host = !strcmp(host, "::") ? "::1" : "127.0.0.1";
    cpar__store_addr_str(s->addr, sizeof s->addr, host, cfg->port);

    if (cfg->is_server) {
        cpar__store_server *srv = calloc(1, sizeof *srv);
        if (!srv) {
            st = cpar__fail(NULL, CPAR_ERR_OOM, "%s: cannot allocate %zu bytes", fn, sizeof *srv);
            goto fail;
        }
        srv->listen_fd = srv->wake[0] = srv->wake[1] = -1;
        srv->log_rank = cpar__log_rank(-1);
        srv->stall_ms = s->timeout_ms;
        srv->hello_ms = s->timeout_ms < CPAR__STORE_HELLO_MS ? s->timeout_ms : CPAR__STORE_HELLO_MS;
        srv->token_len = strlen(s->token);
        memcpy(srv->token, s->token, srv->token_len);
        srv->max_value = cfg->max_value_bytes ? cfg->max_value_bytes : CPAR__STORE_VALUE_MAX;
        srv->max_keys = cfg->max_keys_per_client ? cfg->max_keys_per_client : CPAR__STORE_MAX_KEYS;
        srv->max_bytes = cfg->max_bytes_per_client ? cfg->max_bytes_per_client : CPAR__STORE_MAX_BYTES;
        srv->max_idle = cfg->max_idle_conns ? (size_t)cfg->max_idle_conns : CPAR__STORE_MAX_IDLE;
        srv->nbuckets = 64;
        srv->buckets = calloc(srv->nbuckets, sizeof *srv->buckets);
        srv->pfds = calloc(2, sizeof *srv->pfds);
        if (!srv->buckets || !srv->pfds) {
            cpar__store_server_free(srv);
            st = cpar__fail(NULL, CPAR_ERR_OOM, "%s: cannot allocate the store table", fn);
            goto fail;
        }
        int err = 0;
        srv->listen_fd = cpar__store_listen(any ? NULL : host, cfg->port, &err);
        if (srv->listen_fd < 0) {
            char where[300];
            cpar__store_addr_str(where, sizeof where, any ? "*" : host, cfg->port);
            cpar__store_server_free(srv);
            if (listen_err)
                *listen_err = err;
            st = cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: cannot listen on %s: %s%s", fn, where,
                            cpar__store_errstr(err, eb, sizeof eb),
                            err == EADDRINUSE      ? " (another job? set CPAR_STORE_PORT)"
                            : err == EADDRNOTAVAIL ? " (not an address of this host? CPAR_STORE_BIND=* listens on "
                                                     "every interface)"
                                                   : "");
            goto fail;
        }
        if (pipe(srv->wake) != 0 || cpar__store_fd_setup(srv->wake[0]) != 0 ||
            cpar__store_fd_setup(srv->wake[1]) != 0) {
            st = cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: cannot create a pipe: %s", fn,
                            cpar__store_errstr(errno, eb, sizeof eb));
            cpar__store_server_free(srv);
            goto fail;
        }
        /* Signals are the application's business: keep them off the server thread. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        int rc = pthread_create(&srv->thread, NULL, cpar__store_serve, srv);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rc != 0) {
            cpar__store_server_free(srv);
            st = cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: cannot start the server thread: %s", fn,
                            cpar__store_errstr(rc, eb, sizeof eb));
            goto fail;
        }
        s->server = srv;
        if (any)
            cpar__log(CPAR__LOG_INFO, -1, "store: listening on every interface, port %d (job token from %s)",
                      cfg->port, token_source);
        else
            cpar__log(CPAR__LOG_INFO, -1, "store: listening on %s (job token from %s)", s->addr,
                      token_source);
    }
    if ((st = cpar__store_connect(s, host, cfg->port, deadline)) != CPAR_OK)
        goto fail;
    cpar__log(CPAR__LOG_INFO, -1, "store: connected to %s", s->addr);
    *out = s;
    return CPAR_OK;

fail:
    if (s->fd >= 0)
        close(s->fd);
    if (s->server) {
        cpar__store_server_stop(s->server, 0);
        cpar__store_server_free(s->server);
    }
    pthread_mutex_destroy(&s->mu);
    free(s);
    return st;
}

cpar_status cpar_store_create(const cpar_store_config *cfg, cpar_store **out)
{
    cpar__log_load(); /* CPAR_LOG and CPAR_LOG_FILE as they are now: its waits may report */
    return cpar__store_create("cpar_store_create", cfg, out, NULL);
}

cpar_status cpar_store_set(cpar_store *s, const char *key, const void *value, size_t len)
{
    const char *fn = "cpar_store_set";
    cpar_status st;
    if (!s)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: s is NULL", fn);
    if ((st = cpar__store_check_key(fn, key)) != CPAR_OK)
        return st;
    if (!value && len > 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: value is NULL with len %zu", fn, len);
    if (len > CPAR__STORE_VALUE_MAX)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: value of key \"%s\" is %zu bytes, expected at most %zu (1 MiB)",
                          fn, key, len, CPAR__STORE_VALUE_MAX);
    unsigned rstatus;
    pthread_mutex_lock(&s->mu);
    st = cpar__store_call(s, fn, CPAR__STORE_SET, key, value, len, &rstatus, NULL, 0, NULL);
    pthread_mutex_unlock(&s->mu);
    return st;
}

cpar_status cpar_store_get(cpar_store *s, const char *key, void *value, size_t cap, size_t *len)
{
    const char *fn = "cpar_store_get";
    cpar_status st;
    if (!s)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: s is NULL", fn);
    if ((st = cpar__store_check_key(fn, key)) != CPAR_OK)
        return st;
    if (!value && cap > 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: value is NULL with cap %zu", fn, cap);
    int64_t deadline = cpar__now_ms() + s->timeout_ms;
    int64_t backoff = 1; /* ms: quick for keys that are nearly there, 50 ms at most to spare the server */
    for (;;) {
        unsigned rstatus;
        size_t n = 0;
        pthread_mutex_lock(&s->mu);
        st = cpar__store_call(s, fn, CPAR__STORE_GET, key, NULL, 0, &rstatus, value, cap, &n);
        pthread_mutex_unlock(&s->mu);
        if (st != CPAR_OK)
            return st;
        if (rstatus == CPAR__STORE_OK) {
            if (len)
                *len = n;
            if (n > cap)
                return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: key \"%s\" holds %zu bytes, more than cap=%zu", fn, key,
                                  n, cap);
            return CPAR_OK;
        }
        int64_t now = cpar__now_ms();
        if (now >= deadline)
            return cpar__fail(NULL, CPAR_ERR_TIMEOUT, "%s: key \"%s\" not set within %d ms (store at %s)", fn, key,
                              s->timeout_ms, s->addr);
        cpar__store_sleep_ms(backoff < deadline - now ? backoff : deadline - now);
        backoff = backoff * 2 > 50 ? 50 : backoff * 2;
    }
}

static cpar_status cpar__store_add(cpar_store *s, const char *fn, const char *key, int64_t delta, int64_t *result)
{
    unsigned char be[8], reply[8];
    unsigned rstatus;
    size_t n = 0;
    cpar__store_put64(be, delta);
    pthread_mutex_lock(&s->mu);
    cpar_status st = cpar__store_call(s, fn, CPAR__STORE_ADD, key, be, sizeof be, &rstatus, reply, sizeof reply, &n);
    pthread_mutex_unlock(&s->mu);
    if (st != CPAR_OK)
        return st;
    if (rstatus == CPAR__STORE_BADVALUE)
        return cpar__fail(NULL, CPAR_ERR_INVALID,
                          "%s: key \"%s\" holds a value that is not a decimal int64 (or adding %" PRId64 " overflows)",
                          fn, key, delta);
    if (rstatus != CPAR__STORE_OK || n != sizeof reply) {
        pthread_mutex_lock(&s->mu);
        s->broken = true;
        pthread_mutex_unlock(&s->mu);
        return cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: store at %s sent a malformed reply to ADD", fn, s->addr);
    }
    if (result)
        *result = cpar__store_get64(reply);
    return CPAR_OK;
}

cpar_status cpar_store_add(cpar_store *s, const char *key, int64_t delta, int64_t *result)
{
    const char *fn = "cpar_store_add";
    cpar_status st;
    if (!s)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: s is NULL", fn);
    if ((st = cpar__store_check_key(fn, key)) != CPAR_OK)
        return st;
    return cpar__store_add(s, fn, key, delta, result);
}

/* After a barrier timed out: name the ranks whose arrival key for this
 * generation is missing. Stops once it has found all `missing` of them (the
 * counter says how many), so the common case of one absent rank is cheap. */
static cpar_status cpar__store_barrier_report(cpar_store *s, const char *fn, const char *name, int nranks,
                                              int64_t gen, int64_t missing)
{
    char list[160] = "", key[CPAR__STORE_KEY_MAX + 1];
    size_t used = 0;
    int64_t named = 0, found = 0;
    for (int r = 0; r < nranks && found < missing; r++) {
        char val[24];
        size_t n = 0;
        unsigned rstatus;
        snprintf(key, sizeof key, "%s/%d", name, r);
        pthread_mutex_lock(&s->mu);
        cpar_status st = cpar__store_call(s, fn, CPAR__STORE_GET, key, NULL, 0, &rstatus, val, sizeof val - 1, &n);
        pthread_mutex_unlock(&s->mu);
        if (st != CPAR_OK)
            return st;
        long v = -1;
        if (rstatus == CPAR__STORE_OK && n < sizeof val) {
            val[n] = '\0';
            if (!cpar__env_parse_long(val, &v))
                v = -1;
        }
        if (v >= gen)
            continue;
        found++;
        int w = snprintf(list + used, sizeof list - used, "%s%d", named ? "," : "", r);
        if (w > 0 && used + (size_t)w + 16 < sizeof list) /* keep room for the tail; never overrun */
            used += (size_t)w, named++;
        else
            list[used] = '\0';
    }
    if (named == 0) /* they arrived while we looked: only the count is known */
        return cpar__fail(NULL, CPAR_ERR_TIMEOUT,
                          "%s: barrier \"%s\" timed out after %d ms: %" PRId64 " of %d ranks missing", fn, name,
                          s->timeout_ms, missing, nranks);
    char more[48] = "", refused[240] = "";
    if (found > named)
        snprintf(more, sizeof more, " and %" PRId64 " more", found - named);
    const int nrefused = s->server ? atomic_load(&s->server->refused_token) : 0;
    if (nrefused)
        snprintf(refused, sizeof refused, "; the store refused %d client%s with another job token (the last from %s): "
                 "started with another CPAR_JOB_TOKEN?", nrefused, nrefused == 1 ? "" : "s", s->server->refused_from);
    return cpar__fail(NULL, CPAR_ERR_TIMEOUT, "%s: barrier \"%s\" timed out after %d ms: rank%s %s%s of %d missing%s",
                      fn, name, s->timeout_ms, found == 1 ? "" : "s", list, more, nranks, refused);
}

/* A failure published by a rank of the job at the join (see cpar_store_join):
 * once "cpar/join/failed" is non-zero, every rank waiting there fails with
 * the message in "cpar/join/why". */
#define CPAR__JOIN_FAILED "cpar/join/failed"
#define CPAR__JOIN_WHY "cpar/join/why"

/* The failure some rank published, as this rank's error. */
static cpar_status cpar__store_join_failed(cpar_store *s, const char *fn)
{
    char why[CPAR_ERR_LEN];
    size_t n = 0;
    cpar_status st = cpar_store_get(s, CPAR__JOIN_WHY, why, sizeof why - 1, &n); /* set right after the count */
    if (st != CPAR_OK)
        return st;
    why[n < sizeof why ? n : sizeof why - 1] = '\0';
    return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: %s", fn, why);
}

/* Arrival: add 1 to "<name>/count"; the result n puts this call in
 * generation g = (n-1)/nranks, so a name can be reused for successive
 * barriers; record "<name>/<rank>" = g for the timeout report, then poll the
 * counter until it reaches (g+1)*nranks. No rank can enter generation g+1
 * before generation g is full, so the counts never mix. With watch_join, each
 * poll also looks for a failure published at the join. */
static cpar_status cpar__store_barrier(cpar_store *s, const char *fn, const char *name, int rank, int nranks,
                                       bool watch_join)
{
    char key[CPAR__STORE_KEY_MAX + 1], count_key[CPAR__STORE_KEY_MAX + 1], text[24];
    int64_t deadline = cpar__now_ms() + s->timeout_ms;
    snprintf(count_key, sizeof count_key, "%s/count", name);
    snprintf(key, sizeof key, "%s/%d", name, rank);

    int64_t n;
    cpar_status st = cpar__store_add(s, fn, count_key, 1, &n);
    if (st != CPAR_OK)
        return st;
    int64_t gen = (n - 1) / nranks, target = (gen + 1) * nranks;
    int tl = snprintf(text, sizeof text, "%" PRId64, gen);
    unsigned rstatus;
    pthread_mutex_lock(&s->mu);
    st = cpar__store_call(s, fn, CPAR__STORE_SET, key, text, (size_t)tl, &rstatus, NULL, 0, NULL);
    pthread_mutex_unlock(&s->mu);
    if (st != CPAR_OK)
        return st;
    int64_t backoff = 1;
    cpar__progress progress = cpar__progress_start();
    while (n < target) {
        int64_t now = cpar__now_ms();
        if (now >= deadline)
            return cpar__store_barrier_report(s, fn, name, nranks, gen, target - n);
        cpar__progress_tick(&progress, rank, deadline, "%s: %" PRId64 " of %d ranks at barrier \"%s\": are the "
                            "others started, with the same WORLD_SIZE and job token?", fn, n - gen * nranks, nranks,
                            name);
        cpar__store_sleep_ms(backoff < deadline - now ? backoff : deadline - now);
        backoff = backoff * 2 > 50 ? 50 : backoff * 2;
        if ((st = cpar__store_add(s, fn, count_key, 0, &n)) != CPAR_OK)
            return st;
        int64_t failed = 0;
        if (watch_join && (st = cpar__store_add(s, fn, CPAR__JOIN_FAILED, 0, &failed)) != CPAR_OK)
            return st;
        if (failed > 0)
            return cpar__store_join_failed(s, fn);
    }
    return CPAR_OK;
}

cpar_status cpar_store_barrier(cpar_store *s, const char *name, int rank, int nranks)
{
    const char *fn = "cpar_store_barrier";
    if (!s)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: s is NULL", fn);
    if (!name || !*name)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: name is %s", fn, name ? "empty" : "NULL");
    size_t nlen = strnlen(name, CPAR__STORE_KEY_MAX + 1);
    if (nlen > CPAR__STORE_KEY_MAX - 11) /* room for "/count" and "/<rank>" */
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: name is %zu bytes, expected at most %d", fn, strlen(name),
                          CPAR__STORE_KEY_MAX - 11);
    if (nranks < 1)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: nranks is %d, expected >= 1", fn, nranks);
    if (rank < 0 || rank >= nranks)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: rank is %d, expected 0..%d (nranks=%d)", fn, rank, nranks - 1,
                          nranks);
    return cpar__store_barrier(s, fn, name, rank, nranks, false);
}

/* ---- store: join -------------------------------------------------------- */

/* A rank as the join records it: "world local pid host". */
typedef struct {
    int world, local;
    long pid;
    char host[72];
} cpar__join_rec;

static bool cpar__join_parse(const char *text, cpar__join_rec *r)
{
    int used = 0;
    return sscanf(text, "%d %d %ld %n", &r->world, &r->local, &r->pid, &used) == 3 && used > 0 &&
           snprintf(r->host, sizeof r->host, "%s", text + used) >= 0;
}

/* Publish why the job cannot start (the first failure wins), and fail. */
static cpar_status cpar__join_fail(cpar_store *s, const char *fn, const char *why)
{
    int64_t n = 0;
    cpar_status st = cpar__store_add(s, fn, CPAR__JOIN_FAILED, 1, &n);
    if (st == CPAR_OK && n == 1)
        st = cpar_store_set(s, CPAR__JOIN_WHY, why, strlen(why));
    if (st != CPAR_OK)
        return st;
    return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: %s", fn, why);
}

/* Read the record of rank r's first claimant into *rec (it writes it right
 * after its claim, so this waits at most a moment). */
static cpar_status cpar__join_get(cpar_store *s, int r, cpar__join_rec *rec)
{
    char key[64], text[128];
    size_t n = 0;
    snprintf(key, sizeof key, "cpar/join/who/%d", r);
    CPAR_TRY(cpar_store_get(s, key, text, sizeof text - 1, &n));
    text[n] = '\0';
    if (!cpar__join_parse(text, rec))
        return cpar__fail(NULL, CPAR_ERR_SYSTEM, "cpar_store_join: key \"%s\" holds \"%.64s\", not a join record", key,
                          text);
    return CPAR_OK;
}

/* The registration and the start barrier of cpar_store_join (fn: the public
 * function the user called). A rank that finds a conflict publishes it and
 * never arrives at the barrier, so the ranks waiting there see the failure
 * instead of a full count. */
static cpar_status cpar__store_join_once(cpar_store *s, const char *fn, int rank, int world, int local)
{
    cpar__join_rec me = {.world = world, .local = local, .pid = (long)getpid()};
    if (gethostname(me.host, sizeof me.host - 1) != 0 || !me.host[0])
        snprintf(me.host, sizeof me.host, "?");
    me.host[sizeof me.host - 1] = '\0';
    char key[64], text[128], why[CPAR_ERR_LEN - 64];
    snprintf(key, sizeof key, "cpar/join/claim/%d", rank);
    int64_t claims = 0;
    CPAR_TRY(cpar__store_add(s, fn, key, 1, &claims));
    if (claims == 1) {
        snprintf(key, sizeof key, "cpar/join/who/%d", rank);
        int n = snprintf(text, sizeof text, "%d %d %ld %s", me.world, me.local, me.pid, me.host);
        CPAR_TRY(cpar_store_set(s, key, text, (size_t)n));
    } else {
        cpar__join_rec first;
        CPAR_TRY(cpar__join_get(s, rank, &first));
        snprintf(why, sizeof why, "rank %d (pid %ld on host %s) and rank %d (pid %ld on host %s) both claim rank %d",
                 rank, first.pid, first.host, rank, me.pid, me.host, rank);
        return cpar__join_fail(s, fn, why);
    }
    if (rank != 0) {
        /* Rank 0 hosts the store, so it registers first; its world size is the job's. */
        cpar__join_rec zero;
        CPAR_TRY(cpar__join_get(s, 0, &zero));
        if (zero.world != world) {
            snprintf(why, sizeof why, "rank 0 (pid %ld on host %s) has world size %d but rank %d (pid %ld on host %s) "
                     "has world size %d", zero.pid, zero.host, zero.world, rank, me.pid, me.host, world);
            return cpar__join_fail(s, fn, why);
        }
    }
    return cpar__store_barrier(s, fn, "cpar/join", rank, world, true);
}

static cpar_status cpar__store_join(cpar_store *s, const char *fn, int rank, int world, int local)
{
    cpar_status st = cpar__store_join_once(s, fn, rank, world, local);
    int64_t failed = 0, told = 0;
    if (st == CPAR_OK || cpar__store_add(s, fn, CPAR__JOIN_FAILED, 0, &failed) != CPAR_OK || failed == 0)
        return st;
    /* The job cannot start. Count the ranks that know why; the host of the
     * store keeps it up a little while for those still on their way, so they
     * get the reason rather than "rank 0 exited". */
    char msg[CPAR_ERR_LEN];
    snprintf(msg, sizeof msg, "%s", cpar__tls_err);
    if (cpar__store_add(s, fn, "cpar/join/told", 1, &told) == CPAR_OK && s->server) {
        int64_t deadline = cpar__now_ms() + (s->timeout_ms < 5000 ? s->timeout_ms : 5000);
        while (told < world && cpar__now_ms() < deadline) {
            cpar__store_sleep_ms(20);
            if (cpar__store_add(s, fn, "cpar/join/told", 0, &told) != CPAR_OK)
                break;
        }
    }
    cpar__set_error(NULL, msg);
    return st;
}

cpar_status cpar_store_join(cpar_store *s, const cpar_env *env)
{
    const char *fn = "cpar_store_join";
    if (!s)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: s is NULL", fn);
    if (!env)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: env is NULL", fn);
    if (env->world_size < 1)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: env->world_size is %d, expected >= 1", fn, env->world_size);
    if (env->rank < 0 || env->rank >= env->world_size)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: env->rank is %d, expected 0..%d (world_size=%d)", fn, env->rank,
                          env->world_size - 1, env->world_size);
    if (env->local_rank < 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: env->local_rank is %d, expected >= 0", fn, env->local_rank);
    return cpar__store_join(s, fn, env->rank, env->world_size, env->local_rank);
}

/* ==== 8. Host backend ====================================================
 * Ranks are threads of one process (cpar_spawn), or processes of one node
 * (cpar_init_from_env: the second part of this section). A job holds one mutex and
 * condition variable; every group has an hcomm with a slot per member and a
 * mailbox per ordered pair. A collective posts its slot, meets the others at
 * a rendezvous, moves data by pulling from the peers' posted buffers, and
 * meets them again so no buffer is released while a peer still reads it.
 * Every wait has the context's deadline; a failed, aborted or finished rank
 * releases its waiting peers with CPAR_ERR_PEER, and so does a rank whose
 * collective call fails its own checks (cpar__group_give_up). Each slot
 * carries the public call it serves (cpar__tag_set), compared with the rest
 * of the members' descriptors before any data moves. The device backend uses the
 * same code with device pointers (its copies and reductions go through
 * section 4), ordered on the GPUs with events (cpar__hc_collective).
 * Uses: 1-6; the process part also 7 (the store). */

struct cpar__job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int nranks;
    atomic_bool failed;    /* a rank failed, timed out or aborted: set under mu after the fields below, which
                            * then never change, so a reader without mu that sees it set reads them whole */
    int failed_rank;
    cpar_status failed_status;
    bool failed_root;      /* failed_rank's own failure, not a CPAR_ERR_PEER it was given */
    char failed_msg[CPAR_ERR_LEN]; /* why, when no rank's own message says it */
    atomic_bool *exited;   /* [nranks] the rank's function returned (set under mu; NCCL's checks read it without) */
    struct cpar__gave_up *gave_up; /* NCCL backend: calls that failed their own checks (section 9) */
    atomic_bool any_gave_up;       /* ... whether there are any: the waits' check without the lock */
};

/* A member's latest give-up on an NCCL group (threads: the job keeps them;
 * processes: the store, section 9). */
typedef struct cpar__gave_up {
    struct cpar__gave_up *next;
    uint64_t uid, at, count; /* the group, the batch it will not enqueue, how many give-ups */
    int world_rank;
    char msg[CPAR_ERR_LEN];
} cpar__gave_up;

typedef struct cpar__slot {    /* one member's description of the current collective */
    int kind;                  /* cpar_coll_kind, or CPAR__KIND_EXCHANGE */
    cpar_dtype dtype;
    int op, root;
    int64_t rows, row_elems;   /* dim 0 of the input and elements per row */
    const void *in;
    void *out;
    int device;                /* the member's device (-1: host), set when posted */
    const int64_t *sizes;      /* all-gather / reduce-scatter per-rank rows, or NULL */
    const int64_t *in_splits, *out_splits;
    uint64_t tag;              /* the public call it serves (cpar__tag_set), 0: a raw collective */
    char tag_text[CPAR__TAG_LEN];
} cpar__slot;
#define CPAR__KIND_EXCHANGE CPAR_COLL_KIND_COUNT

/* Tagging: a public call that reaches a collective through others (a
 * mapping, the cross entropy, CP attention) names itself and the arguments
 * its ranks must agree on beyond what the collective shows (direction,
 * dtypes, the comm type); its first collective on g carries that, and the
 * members' slots are compared (cpar__slots_validate) before any data moves:
 * rank 0 in cpar_all_to_all_sp2hp(fwd) and rank 1 in its bwd (the same
 * counts) fail on both. A local argument failure (cpar__fail) drops the
 * tag; a call that reaches no collective leaves it to the next collective
 * on g, the same on every rank that made the same calls. */
static void cpar__tag_set(cpar_group *g, const char *fmt, ...) {
    cpar_ctx *ctx = g->ctx;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->tag_text, sizeof ctx->tag_text, fmt, ap);
    va_end(ap);
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (const char *p = ctx->tag_text; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
    ctx->tag = h | 1u;
    ctx->tag_group = g;
}

/* fn (a public call) is collective over g and has not reached its
 * collective yet: until it does, a failure of its own checks gives up on g
 * (cpar__fail, ctx->give_up). */
static void cpar__coll_pending(cpar_group *g, const char *fn) {
    g->ctx->pending_group = g;
    g->ctx->pending_fn = fn;
}

/* The tag a collective on g carries, taken (once) into its slot; the call
 * has reached its collective. */
static void cpar__tag_take(cpar_group *g, cpar__slot *s) {
    cpar_ctx *ctx = g->ctx;
    if (ctx->pending_group == g) ctx->pending_group = NULL;
    if (ctx->tag_group != g) return;
    s->tag = ctx->tag;
    memcpy(s->tag_text, ctx->tag_text, sizeof s->tag_text);
    ctx->tag_group = NULL;
}

typedef struct cpar__mailbox {
    const void *ptr;
    size_t bytes;
    cpar_dtype dtype;           /* what the sender sends, checked by the receiver before it reads */
    int64_t numel;
    bool rejected;              /* the receiver refused the last message: it wanted want_numel of want_dtype */
    cpar_dtype want_dtype;
    int64_t want_numel;
    uint64_t posted, taken;
    cpar_dev_event sent_ev;     /* device backend: the sender's work up to the send (recorded by it) */
    cpar_dev_event taken_ev;    /* device backend: the receiver's copy (recorded by it; made at its first) */
} cpar__mailbox;

struct cpar__hcomm {
    cpar__job *job;
    int n;
    int *world_ranks;          /* [n] */
    uint64_t *entered;         /* [n] rendezvous entered by each member */
    uint64_t gen;              /* completed rendezvous */
    int count;                 /* members waiting in the current one */
    cpar__slot *slot;          /* [n] */
    /* A member that failed its own checks in a collective call: the
     * rendezvous it will not enter (gave_up_at), how many times it has given
     * up on this group (gave_ups: members that failed alike have equal
     * counts, so an old mark never fails a later call) and its message. */
    uint64_t *gave_up_at, *gave_ups;
    char (*gave_up_msg)[CPAR_ERR_LEN];
    cpar__mailbox *box;        /* [n*n], box[src*n + dst] */
    /* Device backend: each member's events, made by it at its first
     * collective or send (on its GPU), published under job->mu and never
     * changed; they live as long as the hcomm, so a peer may wait on one
     * after its owner left the group. */
    cpar_dev_event *ev_ready;  /* [n] recorded after the work that produces the member's inputs */
    cpar_dev_event *ev_done;   /* [n] recorded after the member's share of the data movement */
    atomic_int refs;
};

static cpar__job *cpar__job_create(int nranks) {
    cpar__job *job = calloc(1, sizeof *job);
    if (!job) return NULL;
    job->exited = calloc((size_t)nranks, sizeof *job->exited);
    if (!job->exited) { free(job); return NULL; }
    for (int r = 0; r < nranks; r++) atomic_init(&job->exited[r], false);
    pthread_mutex_init(&job->mu, NULL);
    pthread_cond_init(&job->cv, NULL);
    job->nranks = nranks;
    job->failed_rank = -1;
    atomic_init(&job->failed, false);
    return job;
}

static void cpar__job_destroy(cpar__job *job) {
    if (!job) return;
    while (job->gave_up) {
        cpar__gave_up *next = job->gave_up->next;
        free(job->gave_up);
        job->gave_up = next;
    }
    pthread_mutex_destroy(&job->mu);
    pthread_cond_destroy(&job->cv);
    free(job->exited);
    free(job);
}

/* Mark the job failed by rank with st (the first failure stays), with msg
 * saying why when the rank itself cannot (NULL: its own error says it), and
 * wake every waiter. root: the failure is the rank's own (an error, an
 * abort, a rank that left), not a CPAR_ERR_PEER it got from waiting on
 * another. _locked: the caller holds job->mu. */
static void cpar__job_fail_locked(cpar__job *job, int rank, cpar_status st, bool root, const char *msg) {
    if (!job->failed) {
        job->failed_rank = rank;
        job->failed_status = st;
        job->failed_root = root;
        if (msg) snprintf(job->failed_msg, sizeof job->failed_msg, "%s", msg);
        atomic_store(&job->failed, true); /* last: publishes the fields to readers without mu */
    }
    pthread_cond_broadcast(&job->cv);
}
static void cpar__job_fail_why(cpar__job *job, int rank, cpar_status st, bool root, const char *msg) {
    pthread_mutex_lock(&job->mu);
    cpar__job_fail_locked(job, rank, st, root, msg);
    pthread_mutex_unlock(&job->mu);
}

static void cpar__job_fail(cpar__job *job, int rank, cpar_status st) {
    cpar__job_fail_why(job, rank, st, st != CPAR_ERR_PEER, NULL);
}

static void cpar__job_exit(cpar__job *job, int rank) {
    pthread_mutex_lock(&job->mu);
    job->exited[rank] = true;
    pthread_cond_broadcast(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

static cpar__hcomm *cpar__hcomm_create(cpar__job *job, int n, const int *world_ranks) {
    cpar__hcomm *hc = calloc(1, sizeof *hc);
    if (!hc) return NULL;
    hc->world_ranks = malloc((size_t)n * sizeof *hc->world_ranks);
    hc->entered = calloc((size_t)n, sizeof *hc->entered);
    hc->slot = calloc((size_t)n, sizeof *hc->slot);
    hc->box = calloc((size_t)n * (size_t)n, sizeof *hc->box);
    hc->ev_ready = calloc((size_t)n, sizeof *hc->ev_ready);
    hc->ev_done = calloc((size_t)n, sizeof *hc->ev_done);
    hc->gave_up_at = calloc((size_t)n, sizeof *hc->gave_up_at);
    hc->gave_ups = calloc((size_t)n, sizeof *hc->gave_ups);
    hc->gave_up_msg = calloc((size_t)n, sizeof *hc->gave_up_msg);
    if (!hc->world_ranks || !hc->entered || !hc->slot || !hc->box || !hc->ev_ready || !hc->ev_done ||
        !hc->gave_up_at || !hc->gave_ups || !hc->gave_up_msg) {
        free(hc->world_ranks); free(hc->entered); free(hc->slot); free(hc->box);
        free(hc->ev_ready); free(hc->ev_done); free(hc->gave_up_at); free(hc->gave_ups); free(hc->gave_up_msg);
        free(hc);
        return NULL;
    }
    memcpy(hc->world_ranks, world_ranks, (size_t)n * sizeof *hc->world_ranks);
    hc->job = job;
    hc->n = n;
    atomic_init(&hc->refs, n);
    return hc;
}

static void cpar__hcomm_release(cpar__hcomm *hc) {
    if (!hc || atomic_fetch_sub(&hc->refs, 1) != 1) return;
    /* Destroying an event that a stream still waits on is legal: CUDA
     * releases it once the wait is done. */
    for (int m = 0; m < hc->n; m++) {
        cpar_dev_event_destroy(hc->ev_ready[m]);
        cpar_dev_event_destroy(hc->ev_done[m]);
    }
    for (size_t b = 0; b < (size_t)hc->n * (size_t)hc->n; b++) {
        cpar_dev_event_destroy(hc->box[b].sent_ev);
        cpar_dev_event_destroy(hc->box[b].taken_ev);
    }
    free(hc->world_ranks); free(hc->entered); free(hc->slot); free(hc->box);
    free(hc->ev_ready); free(hc->ev_done); free(hc->gave_up_at); free(hc->gave_ups); free(hc->gave_up_msg);
    free(hc);
}

/* What a waiter waits for; all fields read under job->mu. */
typedef enum { CPAR__WAIT_RENDEZVOUS, CPAR__WAIT_MAIL, CPAR__WAIT_TAKEN } cpar__wait_kind;
typedef struct cpar__wait {
    cpar__wait_kind kind;
    int peer;        /* mail: the sender; taken: the receiver */
    uint64_t target; /* rendezvous: generation to leave; mail/taken: count to reach */
} cpar__wait;

static bool cpar__wait_done(const cpar__hcomm *hc, int me, const cpar__wait *w) {
    switch (w->kind) {
    case CPAR__WAIT_RENDEZVOUS: return hc->gen >= w->target;
    case CPAR__WAIT_MAIL: return hc->box[(size_t)w->peer * (size_t)hc->n + (size_t)me].posted >= w->target;
    default: return hc->box[(size_t)me * (size_t)hc->n + (size_t)w->peer].taken >= w->target;
    }
}

/* Is group member m among those this wait still needs? */
static bool cpar__wait_needs(const cpar__hcomm *hc, int me, const cpar__wait *w, int m) {
    if (w->kind != CPAR__WAIT_RENDEZVOUS) return m == w->peer;
    return m != me && hc->entered[m] < hc->entered[me];
}

/* Block (job->mu held) until w is done, the job fails, a needed member has
 * exited, or the deadline passes. */
/* The world ranks w still needs, "1,3" into who; returns how many. */
static int cpar__wait_who(const cpar_group *g, const cpar__wait *w, char *who, size_t cap) {
    const cpar__hcomm *hc = g->hc;
    size_t len = 0;
    int missing = 0;
    who[0] = 0;
    for (int m = 0; m < hc->n && len + 16 < cap; m++)
        if (cpar__wait_needs(hc, g->rank, w, m))
            len += (size_t)snprintf(who + len, cap - len, "%s%d", missing++ ? "," : "", hc->world_ranks[m]);
    return missing;
}

static cpar_status cpar__wait_locked(cpar_group *g, const char *fn, const cpar__wait *w, int64_t deadline) {
    cpar__hcomm *hc = g->hc;
    cpar__job *job = hc->job;
    cpar_ctx *ctx = g->ctx;
    const char *what = w->kind == CPAR__WAIT_RENDEZVOUS ? "collective" : w->kind == CPAR__WAIT_MAIL ? "receive" : "send";
    cpar__progress progress = cpar__progress_start();
    for (;;) {
        if (cpar__wait_done(hc, g->rank, w)) return CPAR_OK;
        /* A needed rank that has returned is the cause, whoever saw it first:
         * record it as the job's failure so every peer names the same rank. */
        for (int m = 0; m < hc->n; m++)
            if (cpar__wait_needs(hc, g->rank, w, m) && job->exited[hc->world_ranks[m]]) {
                cpar_status st = cpar__fail(ctx, CPAR_ERR_PEER, "%s: rank %d returned from its function without "
                                            "joining the %s", fn, hc->world_ranks[m], what);
                /* the rank that left is the cause (root) */
                cpar__job_fail_locked(job, hc->world_ranks[m], CPAR_ERR_PEER, true, ctx->err);
                return st;
            }
        if (job->failed) {
            int fr = job->failed_rank;
            cpar_status fs = job->failed_status;
            return cpar__fail(ctx, CPAR_ERR_PEER, "%s: rank %d failed (%s); abandoning the %s", fn, fr,
                              cpar_status_string(fs), what);
        }
        /* A needed member that gave up on this very rendezvous, more often
         * than this rank has (so not a failure both share) */
        for (int m = 0; w->kind == CPAR__WAIT_RENDEZVOUS && m < hc->n; m++)
            if (cpar__wait_needs(hc, g->rank, w, m) && hc->gave_up_at[m] == hc->entered[g->rank] &&
                hc->gave_ups[m] > hc->gave_ups[g->rank])
                return cpar__fail(ctx, CPAR_ERR_PEER, "%s: rank %d gave up on this %s, failing its own checks: %s", fn,
                                  hc->world_ranks[m], what, hc->gave_up_msg[m]);
        int64_t left = deadline - cpar__now_ms();
        if (left > 0) {
            if (cpar__now_ms() >= progress.next_ms) {
                char who[256];
                cpar__wait_who(g, w, who, sizeof who);
                cpar__progress_tick(&progress, ctx->rank, deadline, "%s: waiting for rank %s in the %s: is every "
                                    "rank making the same calls?", fn, who, what);
            }
            struct timespec ts = cpar__abs_deadline(left < 100 ? left : 100);
            pthread_cond_timedwait(&job->cv, &job->mu, &ts);
            continue;
        }
        char who[256];
        int missing = cpar__wait_who(g, w, who, sizeof who);
        /* A timed-out job is broken: release the peers that are still waiting. */
        cpar__job_fail_locked(job, ctx->rank, CPAR_ERR_TIMEOUT, false, NULL); /* not root: a rank that never came is */
        return cpar__fail(ctx, CPAR_ERR_TIMEOUT, "%s: %s timed out after %d ms waiting for rank%s %s", fn, what,
                          ctx->timeout_ms, missing == 1 ? "" : "s", who);
    }
}

/* Processors this process may run on (cached; 1 when unknown). */
static int cpar__online_cpus(void) {
    static atomic_int cpus;
    int n = atomic_load_explicit(&cpus, memory_order_relaxed);
    if (!n) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n = c > 0 && c < INT_MAX ? (int)c : 1;
        atomic_store_explicit(&cpus, n, memory_order_relaxed);
    }
    return n;
}

/* Wait for rendezvous generation target by polling, for at most ~50 us: when
 * every member has its own core, the last one usually arrives within that,
 * and a sleeping waiter would pay a futex wake-up (~20 us here) per meeting.
 * The caller then waits on the condition variable as usual (which also
 * notices failures and deadlines). */
static void cpar__hc_spin(const cpar__hcomm *hc, uint64_t target) {
    int64_t until = cpar__now_ns() + 50000;
    for (unsigned i = 1; __atomic_load_n(&hc->gen, __ATOMIC_ACQUIRE) < target; i++) {
#ifdef CPAR__X86_KERNELS
        _mm_pause();
#endif
        if (!(i & 63) && cpar__now_ns() > until) return;
    }
}

/* Meet every member of g. */
static cpar_status cpar__hc_rendezvous(cpar_group *g, const char *fn) {
    cpar__hcomm *hc = g->hc;
    cpar__job *job = hc->job;
    int64_t deadline = cpar__now_ms() + g->ctx->timeout_ms;
    pthread_mutex_lock(&job->mu);
    cpar_status st = CPAR_OK;
    if (job->failed) {
        cpar__wait none = {CPAR__WAIT_RENDEZVOUS, -1, UINT64_MAX};
        st = cpar__wait_locked(g, fn, &none, deadline); /* reports the failure */
    } else {
        hc->entered[g->rank]++;
        cpar__wait w = {CPAR__WAIT_RENDEZVOUS, -1, hc->gen + 1};
        if (++hc->count == hc->n) {
            hc->count = 0;
            __atomic_store_n(&hc->gen, hc->gen + 1, __ATOMIC_RELEASE);
            pthread_cond_broadcast(&job->cv);
        } else {
            if (hc->n <= cpar__online_cpus()) { /* everyone has a core: the others are about to arrive */
                pthread_mutex_unlock(&job->mu);
                cpar__hc_spin(hc, w.target);
                pthread_mutex_lock(&job->mu);
            }
            st = cpar__wait_locked(g, fn, &w, deadline);
        }
    }
    pthread_mutex_unlock(&job->mu);
    return st;
}

/* Post this member's slot. The rendezvous that follows publishes it. */
static void cpar__hc_post(cpar_group *g, const cpar__slot *s) {
    pthread_mutex_lock(&g->hc->job->mu);
    g->hc->slot[g->rank] = *s;
    g->hc->slot[g->rank].device = g->ctx->device;
    pthread_mutex_unlock(&g->hc->job->mu);
}

static cpar_status cpar__hc_validate(cpar_group *g, const char *fn);

/* Every member contributes bytes of host memory; all[] gets them in group
 * rank order (used by group split). No peer's buffer is read before every
 * member's descriptor is checked: a peer in another collective (or one
 * exchanging another size) posted a buffer of another size. */
static cpar_status cpar__pc_collective(cpar_group *g, const char *fn, const cpar__slot *mine);

static cpar_status cpar__hc_exchange(cpar_group *g, const char *fn, const void *mine, size_t bytes, void *all) {
    cpar__slot s = {.kind = CPAR__KIND_EXCHANGE, .dtype = CPAR_U8, .rows = (int64_t)bytes, .row_elems = 1, .in = mine,
                    .out = all};
    cpar__tag_take(g, &s);
    if (g->size == 1) {
        memcpy(all, mine, bytes);
        return CPAR_OK;
    }
    if (g->pc) return cpar__pc_collective(g, fn, &s); /* ranks as processes: an all-gather of bytes */
    cpar__hc_post(g, &s);
    CPAR_TRY(cpar__hc_rendezvous(g, fn));
    cpar_status st = cpar__hc_validate(g, fn);
    for (int m = 0; m < g->size && st == CPAR_OK; m++)
        memcpy((char *)all + (size_t)m * bytes, g->hc->slot[m].in, bytes);
    cpar_status st2 = cpar__hc_rendezvous(g, fn); /* as every member: the peers meet here either way */
    return st != CPAR_OK ? st : st2;
}

/* Even share [lo, hi) of n items for member r of size members. */
static void cpar__even_share(int64_t n, int size, int r, int64_t *lo, int64_t *hi) {
    int64_t q = n / size, rem = n % size;
    *lo = r * q + cpar__min64(r, rem);
    *hi = *lo + q + (r < rem);
}

/* acc = ins[0] + ins[1] + ... (f32, in rank order) over one block of m
 * elements from off: the all-reduce's common case, vectorised. Up to four
 * inputs in a pass, then up to three more per pass: a pass per input reads
 * a 16 MiB reduce-scatter of four at 0.55-0.85 of this speed (prefetch works
 * on fewer streams at once). The sum's order, and so its bits, is the same. */
CPAR__INLINE void cpar__blk_sum_f32(float *restrict acc, const void *const *ins, int nin, int64_t off, int m) {
    const float *restrict x = (const float *)ins[0] + off, *restrict y, *restrict z, *restrict w;
    switch (nin) {
    case 1: memcpy(acc, x, (size_t)m * sizeof *acc); return;
    case 2:
        y = (const float *)ins[1] + off;
        CPAR__IVDEP for (int k = 0; k < m; k++) acc[k] = x[k] + y[k];
        return;
    case 3:
        y = (const float *)ins[1] + off, z = (const float *)ins[2] + off;
        CPAR__IVDEP for (int k = 0; k < m; k++) acc[k] = (x[k] + y[k]) + z[k];
        return;
    default:
        y = (const float *)ins[1] + off, z = (const float *)ins[2] + off, w = (const float *)ins[3] + off;
        CPAR__IVDEP for (int k = 0; k < m; k++) acc[k] = ((x[k] + y[k]) + z[k]) + w[k];
    }
    int j = 4;
    for (; j + 3 <= nin; j += 3) {
        x = (const float *)ins[j] + off, y = (const float *)ins[j + 1] + off, z = (const float *)ins[j + 2] + off;
        CPAR__IVDEP for (int k = 0; k < m; k++) acc[k] = ((acc[k] + x[k]) + y[k]) + z[k];
    }
    for (; j < nin; j++) {
        x = (const float *)ins[j] + off;
        CPAR__IVDEP for (int k = 0; k < m; k++) acc[k] += x[k];
    }
}

#ifdef CPAR__X86_KERNELS
/* dst[i] = ins[0][off + i] + ins[1][off + i] + ... (f32, rank order, the
 * same bits as cpar__blk_sum_f32), i < n, each sum streamed from its
 * register past the cache: a large reduce-scatter's one output, with no
 * block buffer between (dst 32-byte aligned). */
__attribute__((target("avx2"))) static void cpar__host_stream_sum_f32(float *dst, const void *const *ins, int nin,
                                                                      int64_t off, int64_t n) {
    const float *in[256];
    for (int j = 0; j < nin; j++) in[j] = (const float *)ins[j] + off;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(in[0] + i);
        for (int j = 1; j < nin; j++) a = _mm256_add_ps(a, _mm256_loadu_ps(in[j] + i));
        _mm256_stream_ps(dst + i, a);
    }
    for (; i < n; i++) {
        float a = in[0][i];
        for (int j = 1; j < nin; j++) a += in[j][i];
        dst[i] = a;
    }
}
#endif

/* outs[k][out_off + i] = op over j of ins[j][in_off + i], i < count, in rank
 * order with fp32 accumulation of float types. On host memory it works in
 * blocks through a stack accumulator (a streamed f32 sum into one aligned
 * output goes straight from registers: cpar__host_stream_sum_f32); on
 * device memory through an fp32 (or integer) accumulator in ctx->coll_ws
 * and the reduce/cast kernels, on the stream the collective runs on
 * (cpar__coll_stream). */
static cpar_status cpar__reduce_rows(cpar_ctx *ctx, const char *fn, cpar_dtype dt, cpar_reduce_op op, int device,
                                     const void *const *ins, int nin, int64_t in_off, void *const *outs, int nout,
                                     int64_t out_off, int64_t count, bool stream) {
    if (count <= 0) return CPAR_OK;
    size_t es = cpar_dtype_size(dt);
    bool isf = cpar_dtype_is_float(dt);
    cpar_dtype acc_dt = isf ? CPAR_F32 : dt;
    size_t acc_es = cpar_dtype_size(acc_dt);
    if (!cpar__on_device(device)) {
        int64_t acc[CPAR__BLK]; /* one block's accumulator, aligned for every accumulator type */
        uint16_t nar[CPAR__BLK]; /* the block narrowed back to a 16-bit dtype, to stream out */
        bool f32_sum = dt == CPAR_F32 && op == CPAR_SUM;
#ifdef CPAR__X86_KERNELS
        float *dst0 = (float *)outs[0] + out_off;
        if (f32_sum && stream && nout == 1 && nin <= 256 && !((uintptr_t)dst0 & 31) && cpar__cpu_avx2()) {
            cpar__host_stream_sum_f32(dst0, ins, nin, in_off, count);
            cpar__host_stream_fence();
            return CPAR_OK;
        }
#endif
        CPAR__BLOCKS(count, b, len,
            if (f32_sum) {
                cpar__blk_sum_f32((float *)acc, ins, nin, in_off + b, len);
            } else {
                cpar__host_cast(acc, acc_dt, (const char *)ins[0] + (size_t)(in_off + b) * es, dt, len);
                for (int j = 1; j < nin; j++)
                    cpar__host_reduce_into(acc, (const char *)ins[j] + (size_t)(in_off + b) * es, dt, len, op);
            }
            const void *blk = acc;
            if (stream && dt != acc_dt) {
                cpar__host_cast(nar, dt, acc, acc_dt, len);
                blk = nar;
            }
            for (int k = 0; k < nout; k++) {
                void *dst = (char *)outs[k] + (size_t)(out_off + b) * es;
                if (stream) cpar__host_stream_copy(dst, blk, (size_t)len * es);
                else cpar__host_cast(dst, dt, acc, acc_dt, len);
            })
        if (stream) cpar__host_stream_fence();
        return CPAR_OK;
    }
    CPAR_TRY(cpar__grow_buffer(ctx, fn, &ctx->coll_ws, &ctx->coll_ws_bytes, (size_t)count * acc_es));
    void *acc = ctx->coll_ws;
    cpar_dev_stream s = cpar__coll_stream(ctx);
    CPAR_DEV_TRY(ctx, fn, cpar_dev_cast(acc, acc_dt, (const char *)ins[0] + (size_t)in_off * es, dt, count, s));
    for (int j = 1; j < nin; j++)
        CPAR_DEV_TRY(ctx, fn, cpar_dev_reduce_into(acc, (const char *)ins[j] + (size_t)in_off * es, dt, count, op, s));
    for (int k = 0; k < nout; k++)
        CPAR_DEV_TRY(ctx, fn, cpar_dev_cast((char *)outs[k] + (size_t)out_off * es, dt, acc, acc_dt, count, s));
    return CPAR_OK;
}

/* Describe a slot for mismatch messages: "all_gather(f16, 24 rows x 3)". */
static const char *cpar__slot_str(const cpar__slot *s, char *buf, size_t cap) {
    if (s->kind == CPAR__KIND_EXCHANGE) snprintf(buf, cap, "group split (%lld bytes)", (long long)s->rows);
    else {
        static const char *const ops[CPAR_REDUCE_OP_COUNT] = {"sum", "max", "min"};
        bool reduces = s->kind == CPAR_COLL_ALL_REDUCE || s->kind == CPAR_COLL_REDUCE_SCATTER;
        char extra[32] = "";
        if (reduces) snprintf(extra, sizeof extra, ", %s", (unsigned)s->op < CPAR_REDUCE_OP_COUNT ? ops[s->op] : "?");
        if (s->kind == CPAR_COLL_BROADCAST) snprintf(extra, sizeof extra, ", root %d", s->root);
        snprintf(buf, cap, "%s(%s, %lld rows x %lld%s)", cpar_coll_kind_name((cpar_coll_kind)s->kind),
                 cpar_dtype_name(s->dtype), (long long)s->rows, (long long)s->row_elems, extra);
    }
    return buf;
}

/* Every member sees every slot, so every member reaches the same verdict
 * (sl: the members' slots in group rank order, from either transport). */
static cpar_status cpar__slots_validate(cpar_group *g, const char *fn, const cpar__slot *sl) {
    const cpar__slot *a = &sl[0];
    int n = g->size;
    for (int m = 1; m < n; m++) /* the calls first: their names say more than the collectives */
        if (sl[m].tag != a->tag)
            return cpar__fail(g->ctx, CPAR_ERR_INVALID,
                              "%s: group members disagree on the call: rank %d called %s, rank %d called %s", fn,
                              g->world_ranks[0], a->tag ? a->tag_text : "a raw collective", g->world_ranks[m],
                              sl[m].tag ? sl[m].tag_text : "a raw collective");
    for (int m = 1; m < n; m++) {
        const cpar__slot *b = &sl[m];
        bool same = a->kind == b->kind && a->dtype == b->dtype && a->op == b->op && a->root == b->root &&
                    a->row_elems == b->row_elems && (a->sizes == NULL) == (b->sizes == NULL);
        /* Row counts may differ only where each rank has its own: all-to-all
         * and all-gather with explicit sizes (checked against sizes below). */
        bool own_rows = a->kind == CPAR_COLL_ALL_TO_ALL || (a->kind == CPAR_COLL_ALL_GATHER && a->sizes);
        if (same && !own_rows) same = a->rows == b->rows;
        for (int r = 0; same && a->sizes && r < n; r++) same = a->sizes[r] == b->sizes[r];
        if (!same) {
            char sa[128], sb[128];
            const char *field = a->kind != b->kind ? "the collective" : a->dtype != b->dtype ? "the dtype"
                                : a->op != b->op ? "the op" : a->root != b->root ? "the root"
                                : (a->sizes == NULL) != (b->sizes == NULL) ? "whether sizes are given"
                                : a->sizes && a->row_elems == b->row_elems ? "the sizes" : "the count";
            return cpar__fail(g->ctx, CPAR_ERR_INVALID,
                              "%s: group members disagree on %s: rank %d called %s, rank %d called %s", fn, field,
                              g->world_ranks[0], cpar__slot_str(a, sa, sizeof sa), g->world_ranks[m],
                              cpar__slot_str(b, sb, sizeof sb));
        }
    }
    if (a->kind == CPAR_COLL_ALL_TO_ALL)
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++)
                if (sl[i].in_splits[j] != sl[j].out_splits[i])
                    return cpar__fail(g->ctx, CPAR_ERR_INVALID,
                                      "%s: rank %d sends %lld rows to rank %d, which expects %lld from it", fn,
                                      g->world_ranks[i], (long long)sl[i].in_splits[j], g->world_ranks[j],
                                      (long long)sl[j].out_splits[i]);
    return CPAR_OK;
}

static cpar_status cpar__hc_validate(cpar_group *g, const char *fn) { return cpar__slots_validate(g, fn, g->hc->slot); }

/* Collectives whose members together write at least this many bytes stream
 * their host stores past the cache (cpar__host_stream_copy): half of a 32 MiB
 * last-level cache, beyond which the outputs would not stay cached anyway.
 * Below it the outputs stay in cache for their next reader. */
#ifndef CPAR__HC_STREAM_BYTES
#define CPAR__HC_STREAM_BYTES ((size_t)16 << 20)
#endif

/* One piece of a collective's data movement into host or device memory. */
static cpar_status cpar__hc_copy(cpar_ctx *ctx, const char *fn, void *dst, const void *src, size_t bytes,
                                 bool stream) {
    if (!cpar__on_device(ctx->device) && stream && dst != src) {
        cpar__host_stream_copy(dst, src, bytes);
        return CPAR_OK;
    }
    int dev = ctx->device;
    return cpar__copy_bytes_on(ctx, fn, cpar__coll_stream(ctx), dst, dev, src, dev, bytes);
}

/* Device backend: whether this context's kernels may touch memory on GPU
 * d: its own, or one it enabled peer access to at start-up. */
static bool cpar__dev_reaches(const cpar_ctx *ctx, int d) {
    return d == ctx->device || (d >= 0 && d < 64 && (ctx->dev_reach >> d & 1u));
}

/* cpar__reduce_rows where some inputs or outputs lie on GPUs this one has no
 * peer access to (consumer cards; in_dev, out_dev: their GPUs). A kernel
 * touches only memory it reaches: each such input's slice is first copied
 * into ctx->coll_stage (CUDA copies between GPUs without peer access, through
 * the host), and each such output gets a copy of a reached output's result
 * afterwards; one reached output at least (the caller's own). All on the
 * collectives' stream, in order, so the stage is free for the next call. */
static cpar_status cpar__reduce_rows_staged(cpar_ctx *ctx, const char *fn, cpar_dtype dt, cpar_reduce_op op,
                                            const void *const *ins, const int *in_dev, int nin, int64_t in_off,
                                            void *const *outs, const int *out_dev, int nout, int64_t out_off,
                                            int64_t count, bool stream) {
    if (count <= 0) return CPAR_OK;
    const size_t es = cpar_dtype_size(dt), bytes = (size_t)count * es;
    size_t staged = 0;
    for (int j = 0; j < nin; j++) staged += !cpar__dev_reaches(ctx, in_dev[j]);
    CPAR_TRY(cpar__grow_buffer(ctx, fn, &ctx->coll_stage, &ctx->coll_stage_bytes, staged * bytes));
    const void *src[256];
    void *reached[256] = {NULL}, *far[256];
    int nreached = 0, nfar = 0;
    char *stage = ctx->coll_stage;
    for (int j = 0; j < nin && j < 256; j++) {
        const char *p = (const char *)ins[j] + (size_t)in_off * es;
        if (cpar__dev_reaches(ctx, in_dev[j])) {
            src[j] = p;
            continue;
        }
        CPAR_TRY(cpar__hc_copy(ctx, fn, stage, p, bytes, false));
        src[j] = stage;
        stage += bytes;
    }
    for (int j = 0; j < nout && j < 256; j++) {
        char *p = (char *)outs[j] + (size_t)out_off * es;
        if (cpar__dev_reaches(ctx, out_dev[j])) reached[nreached++] = p;
        else far[nfar++] = p;
    }
    CPAR_TRY(cpar__reduce_rows(ctx, fn, dt, op, ctx->device, src, nin, 0, reached, nreached, 0, count, stream));
    for (int j = 0; j < nfar; j++) CPAR_TRY(cpar__hc_copy(ctx, fn, far[j], reached[0], bytes, false));
    return CPAR_OK;
}

/* Move this member's share of a collective whose members' slots sl (every
 * buffer addressable here, descriptors validated) are published: every
 * member moves its own part in parallel with the others. All-reduce and
 * reduce-scatter reduce a 1/n share each (in rank order, so every member and
 * every run sums the same way), all-gather, all-to-all and broadcast pull
 * what the member receives. Ranks as threads and ranks as processes whose
 * buffers are in arenas (cpar__pc_collective) share it, so both give the
 * same bits. */
static cpar_status cpar__hc_move(cpar_group *g, const char *fn, const cpar__slot *mine, const cpar__slot *sl) {
    cpar_ctx *ctx = g->ctx;
    int n = g->size, me = g->rank, dev = ctx->device;
    cpar_status st = CPAR_OK;
    size_t es = cpar_dtype_size(mine->dtype), row = (size_t)mine->row_elems * es;
    const void *ins[256];
    void *outs[256];
    int devs[256];
    bool staged = false; /* a member's buffers on a GPU this one has no peer access to */
    for (int m = 0; m < n && m < 256; m++) {
        ins[m] = sl[m].in;
        outs[m] = sl[m].out;
        devs[m] = sl[m].device;
        staged |= cpar__on_device(dev) && !cpar__dev_reaches(ctx, devs[m]);
    }
    /* Bytes the whole group writes, which decides whether stores stream. */
    size_t total = (size_t)mine->rows * row * (size_t)n;
    if (mine->kind == CPAR_COLL_REDUCE_SCATTER) total = (size_t)mine->rows * row;
    if (mine->kind == CPAR_COLL_ALL_GATHER || mine->kind == CPAR_COLL_ALL_TO_ALL) {
        total = 0; /* every member gathers all inputs; all-to-all moves each input once */
        for (int m = 0; m < n; m++) total += (size_t)sl[m].rows * row;
        if (mine->kind == CPAR_COLL_ALL_GATHER) total *= (size_t)n;
    }
    bool stream = total >= CPAR__HC_STREAM_BYTES;
    if (st == CPAR_OK) switch (mine->kind) {
    case CPAR_COLL_ALL_REDUCE: {
        /* Member me reduces its even share of the elements and writes it into
         * every member's output: nobody else touches those elements, so
         * in-place (out == in) is safe without a scratch copy. */
        int64_t lo, hi;
        cpar__even_share(mine->rows * mine->row_elems, n, me, &lo, &hi);
        /* In place, the stores hit lines the loads just brought in: keep them cached. */
        bool in_place = false;
        for (int m = 0; m < n; m++) in_place |= sl[m].in == sl[m].out;
        if (staged)
            st = cpar__reduce_rows_staged(ctx, fn, mine->dtype, (cpar_reduce_op)mine->op, ins, devs, n, lo, outs,
                                          devs, n, lo, hi - lo, stream && !in_place);
        else
            st = cpar__reduce_rows(ctx, fn, mine->dtype, (cpar_reduce_op)mine->op, dev, ins, n, lo, outs, n, lo,
                                   hi - lo, stream && !in_place);
        break;
    }
    case CPAR_COLL_REDUCE_SCATTER: {
        int64_t off = 0;
        for (int m = 0; m < me; m++) off += mine->sizes ? mine->sizes[m] : sl[m].rows / n;
        int64_t rows = mine->sizes ? mine->sizes[me] : mine->rows / n;
        if (staged)
            st = cpar__reduce_rows_staged(ctx, fn, mine->dtype, (cpar_reduce_op)mine->op, ins, devs, n,
                                          off * mine->row_elems, &mine->out, &dev, 1, 0, rows * mine->row_elems,
                                          stream);
        else
            st = cpar__reduce_rows(ctx, fn, mine->dtype, (cpar_reduce_op)mine->op, dev, ins, n,
                                   off * mine->row_elems, &mine->out, 1, 0, rows * mine->row_elems, stream);
        break;
    }
    case CPAR_COLL_ALL_GATHER: {
        size_t off = 0;
        for (int m = 0; m < n && st == CPAR_OK; m++) {
            size_t bytes = (size_t)sl[m].rows * row;
            st = cpar__hc_copy(ctx, fn, (char *)mine->out + off, sl[m].in, bytes, stream);
            off += bytes;
        }
        break;
    }
    case CPAR_COLL_ALL_TO_ALL: {
        size_t off = 0;
        for (int m = 0; m < n && st == CPAR_OK; m++) {
            int64_t src_row = 0;
            for (int j = 0; j < me; j++) src_row += sl[m].in_splits[j];
            size_t bytes = (size_t)mine->out_splits[m] * row;
            st = cpar__hc_copy(ctx, fn, (char *)mine->out + off, (const char *)sl[m].in + (size_t)src_row * row,
                               bytes, stream);
            off += bytes;
        }
        break;
    }
    case CPAR_COLL_BROADCAST:
        if (me != mine->root)
            st = cpar__hc_copy(ctx, fn, mine->out, sl[mine->root].in, (size_t)mine->rows * row, stream);
        break;
    default: break;
    }
    if (stream && !cpar__on_device(dev)) cpar__host_stream_fence();
    return st;
}

/* Device backend: make this member's event *ev on first use (on its GPU)
 * and publish it under the job's mutex; only this member writes it. */
static cpar_status cpar__hc_event(cpar_group *g, const char *fn, cpar_dev_event *ev) {
    if (*ev) return CPAR_OK;
    cpar_dev_event e;
    CPAR_DEV_TRY(g->ctx, fn, cpar_dev_event_create(&e));
    pthread_mutex_lock(&g->hc->job->mu);
    *ev = e;
    pthread_mutex_unlock(&g->hc->job->mu);
    return CPAR_OK;
}

/* Device backend: the collectives' stream waits for every peer's evs[m]
 * (read after a rendezvous, which publishes them). */
static cpar_status cpar__hc_wait_peers(cpar_group *g, const char *fn, cpar_dev_event *evs) {
    const cpar_dev_stream cs = cpar__coll_stream(g->ctx);
    for (int m = 0; m < g->size; m++)
        if (m != g->rank && evs[m]) CPAR_DEV_TRY(g->ctx, fn, cpar_dev_stream_wait_event(cs, evs[m]));
    return CPAR_OK;
}

/* Post, meet, check agreement, move this member's share (cpar__hc_move),
 * meet again. On a device the host never waits for the GPU: each member
 * records ev_ready after the work queued before the collective (what makes
 * its inputs), its stream waits for every peer's before it reads their
 * buffers, records ev_done after its share, and waits for every peer's
 * after the second meeting, so nothing it queues later (a reuse of its
 * input, a read of its output) runs before the peers' reads and writes. */
static cpar_status cpar__hc_collective(cpar_group *g, const char *fn, const cpar__slot *mine) {
    cpar_ctx *ctx = g->ctx;
    cpar__hcomm *hc = g->hc;
    const bool dev = cpar__on_device(ctx->device);
    const cpar_dev_stream cs = cpar__coll_stream(ctx);
    if (dev) {
        CPAR_TRY(cpar__hc_event(g, fn, &hc->ev_ready[g->rank]));
        CPAR_TRY(cpar__hc_event(g, fn, &hc->ev_done[g->rank]));
        CPAR_DEV_TRY(ctx, fn, cpar_dev_event_record(hc->ev_ready[g->rank], cs));
    }
    cpar__hc_post(g, mine);
    CPAR_TRY(cpar__hc_rendezvous(g, fn));
    cpar_status st = cpar__hc_validate(g, fn);
    if (st == CPAR_OK && dev) st = cpar__hc_wait_peers(g, fn, hc->ev_ready);
    if (st == CPAR_OK) st = cpar__hc_move(g, fn, mine, hc->slot);
    if (st == CPAR_OK && dev) {
        cpar_status ds = cpar_dev_event_record(hc->ev_done[g->rank], cs);
        if (ds != CPAR_OK) st = cpar__dev_fail(ctx, ds, fn);
    }
    cpar_status st2 = cpar__hc_rendezvous(g, fn);
    if (st == CPAR_OK && st2 == CPAR_OK && dev) st = cpar__hc_wait_peers(g, fn, hc->ev_done);
    return st != CPAR_OK ? st : st2;
}

/* Pairwise exchange through the mailboxes: post the send, take the receive,
 * then wait until the receiver took ours (our buffer stays valid until then).
 * The mailbox carries the send's dtype and element count; a receiver that
 * expects others refuses the message without reading it and says so in the
 * mailbox, so both sides fail with CPAR_ERR_INVALID. */
static cpar_status cpar__hc_sendrecv(cpar_group *g, const char *fn, const void *send, cpar_dtype send_dt,
                                     int64_t send_numel, int to, void *recv, cpar_dtype recv_dt, int64_t recv_numel,
                                     int from) {
    size_t send_bytes = (size_t)send_numel * cpar_dtype_size(send_dt);
    size_t recv_bytes = (size_t)recv_numel * cpar_dtype_size(recv_dt);
    cpar__hcomm *hc = g->hc;
    cpar__job *job = hc->job;
    cpar_ctx *ctx = g->ctx;
    int me = g->rank, n = hc->n;
    const cpar_dev_stream cs = cpar__coll_stream(ctx);
    const bool dev = cpar__on_device(ctx->device);
    /* Device backend, as in cpar__hc_collective: the receiver's stream waits
     * for sent_ev (our work up to the send) before it copies, ours for its
     * taken_ev before anything after the send. */
    cpar__mailbox *out_box = to >= 0 ? &hc->box[(size_t)me * (size_t)n + (size_t)to] : NULL;
    cpar__mailbox *in_box = from >= 0 ? &hc->box[(size_t)from * (size_t)n + (size_t)me] : NULL;
    if (dev && out_box) {
        CPAR_TRY(cpar__hc_event(g, fn, &out_box->sent_ev));
        CPAR_DEV_TRY(ctx, fn, cpar_dev_event_record(out_box->sent_ev, cs));
    }
    if (dev && in_box) CPAR_TRY(cpar__hc_event(g, fn, &in_box->taken_ev));
    int64_t deadline = cpar__now_ms() + ctx->timeout_ms;
    cpar_status st = CPAR_OK;
    pthread_mutex_lock(&job->mu);
    uint64_t sent_no = 0;
    if (job->failed) {
        cpar__wait none = {CPAR__WAIT_RENDEZVOUS, -1, UINT64_MAX};
        st = cpar__wait_locked(g, fn, &none, deadline);
        pthread_mutex_unlock(&job->mu);
        return st;
    }
    if (to >= 0) {
        cpar__mailbox *b = &hc->box[(size_t)me * (size_t)n + (size_t)to];
        b->ptr = send;
        b->bytes = send_bytes;
        b->dtype = send_dt;
        b->numel = send_numel;
        b->rejected = false;
        sent_no = ++b->posted;
        pthread_cond_broadcast(&job->cv);
    }
    if (from >= 0) {
        cpar__mailbox *b = &hc->box[(size_t)from * (size_t)n + (size_t)me];
        cpar__wait w = {CPAR__WAIT_MAIL, from, b->taken + 1};
        st = cpar__wait_locked(g, fn, &w, deadline);
        if (st == CPAR_OK) {
            const void *src = b->ptr;
            size_t bytes = b->bytes;
            bool refuse = b->dtype != recv_dt || b->numel != recv_numel || bytes != recv_bytes;
            if (refuse) {
                b->rejected = true;
                b->want_dtype = recv_dt;
                b->want_numel = recv_numel;
            }
            cpar_dtype sdt = b->dtype;
            int64_t sn = b->numel;
            cpar_dev_event sent = b->sent_ev;
            pthread_mutex_unlock(&job->mu);
            if (refuse)
                st = cpar__fail(ctx, CPAR_ERR_INVALID, "%s: rank %d sent %lld elements of %s, the receive buffer "
                                "has %lld elements of %s", fn, hc->world_ranks[from], (long long)sn,
                                cpar_dtype_name(sdt), (long long)recv_numel,
                                cpar_dtype_name(recv_dt));
            else {
                if (dev) {
                    cpar_status ds = cpar_dev_stream_wait_event(cs, sent);
                    if (ds != CPAR_OK) st = cpar__dev_fail(ctx, ds, fn);
                }
                if (st == CPAR_OK) st = cpar__copy_bytes_on(ctx, fn, cs, recv, ctx->device, src, ctx->device, bytes);
                if (st == CPAR_OK && dev) {
                    cpar_status ds = cpar_dev_event_record(b->taken_ev, cs);
                    if (ds != CPAR_OK) st = cpar__dev_fail(ctx, ds, fn);
                }
            }
            pthread_mutex_lock(&job->mu);
            b->taken++;
            pthread_cond_broadcast(&job->cv);
        }
    }
    /* Our send stays readable until the receiver took it, even when this
     * rank refused its own receive (CPAR_ERR_INVALID): the receiver may be
     * copying from it right now. */
    if ((st == CPAR_OK || st == CPAR_ERR_INVALID) && to >= 0) {
        cpar__wait w = {CPAR__WAIT_TAKEN, to, sent_no};
        cpar_status ws = cpar__wait_locked(g, fn, &w, deadline);
        const cpar__mailbox *b = &hc->box[(size_t)me * (size_t)n + (size_t)to];
        if (st == CPAR_OK || ws != CPAR_OK) st = ws; /* a failed wait says why last */
        if (st == CPAR_OK && b->rejected)
            st = cpar__fail(ctx, CPAR_ERR_INVALID, "%s: rank %d expected %lld elements of %s, this rank sent it %lld "
                            "elements of %s", fn, hc->world_ranks[to], (long long)b->want_numel,
                            cpar_dtype_name(b->want_dtype), (long long)send_numel, cpar_dtype_name(send_dt));
    }
    cpar_dev_event taken = st == CPAR_OK && dev && out_box ? out_box->taken_ev : NULL;
    pthread_mutex_unlock(&job->mu);
    if (taken) CPAR_DEV_TRY(ctx, fn, cpar_dev_stream_wait_event(cs, taken));
    return st;
}

/* ---- host backend, ranks as processes ----------------------------------
 * cpar_init_from_env on the host backend: every rank is a process of one
 * node, tensors live in each process's own memory, and every group of two or
 * more members shares one POSIX shared-memory segment, made through the store
 * (section 7): its first member creates it, publishes the name, every member
 * maps it and says so, and the creator unlinks it at once, so nothing is left
 * in /dev/shm even when a rank is killed (the mappings live on until the
 * processes end).
 *
 * When every member's buffers lie in its arena (section 1), which every
 * member maps at start-up, a collective runs the threaded backend's data
 * movement on the peers' buffers in place (cpar__pc_direct). Otherwise the
 * algorithms are the threaded ones, with a staging area between: each
 * member has a slot of two halves of `chunk` bytes (used in turn, stage after
 * stage), cut into one sub-slot per member where the data has a destination.
 * A stage copies this member's pieces into its slot, meets the others, then
 * pulls: all-reduce and reduce-scatter reduce this member's share over every
 * slot in rank order (the same order, so the same bits, as the threaded
 * backend), all-gather, all-to-all and broadcast copy what this member
 * receives. All-reduce meets once more and copies the others' reduced shares.
 * Since stage s fills the half that stage s-2 used, and every member had
 * finished reading it before meeting at stage s-1, no stage waits for
 * readers; a collective bigger than a half runs in several stages.
 * Point-to-point goes through a mailbox per ordered pair (two halves too).
 *
 * Waits spin briefly when every member has a core, then sleep on a futex in
 * the segment; every wait has the context's deadline and notices a member
 * that died (its pid is gone) or finalized, and a failure any member
 * recorded in the segment, so peers fail fast, naming the rank. Uses: 1-7. */

#define CPAR__PC_MAX 256                       /* members of a group (bounds the stack tables) */
#define CPAR__PC_MAGIC 0x316d687372617063ull   /* "cparshm1" */
#ifndef CPAR__PC_CHUNK
#define CPAR__PC_CHUNK ((size_t)1 << 20)       /* default bytes per member per stage */
#endif

typedef struct cpar__pc_hdr {
    uint64_t magic;
    int32_t n, pad;
    uint64_t chunk, box_chunk, bytes;  /* stage half per member, mailbox half, segment size */
    _Atomic uint32_t gen, count;      /* barriers completed (a futex word), members in the current one */
    _Atomic int32_t fail_claim, failed; /* the first failure claims the record, then publishes it */
    char failed_msg[CPAR_ERR_LEN];      /* which rank failed and how, e.g. "rank 2 (pid 42) died ..." */
} cpar__pc_hdr;

typedef struct cpar__pc_member {
    _Atomic int64_t pid;        /* 0 until the member has mapped the segment */
    _Atomic uint64_t entered;   /* barriers this member entered */
    _Atomic int32_t exited;     /* finalized */
    _Atomic uint32_t bell;      /* bumped when a mailbox of this member changes (a futex word) */
    int32_t arena_fd, pad;      /* its arena's descriptor in its process (-1: none), which peers open */
    uint64_t arena_bytes;       /* through /proc/<pid>/fd, and its size */
    _Atomic uint64_t gave_up_at, gave_ups; /* as cpar__hcomm's: a collective call that failed its own checks */
    char pad2[8];
    char gave_up_msg[CPAR_ERR_LEN];
} cpar__pc_member;

typedef struct cpar__pc_desc {  /* a member's cpar__slot without its pointers */
    int32_t kind, dtype, op, root, has_sizes;
    int32_t direct;             /* its in (and an all-reduce's out) lie in its arena, and it mapped every peer's */
    int64_t rows, row_elems;
    int64_t in_off, out_off;    /* where in its arena */
    uint64_t tag;               /* the slot's caller (cpar__tag_set) */
    char tag_text[CPAR__TAG_LEN];
} cpar__pc_desc;

typedef struct cpar__pc_box {   /* mailbox src -> dst */
    _Atomic uint64_t posted, taken; /* chunks written by the sender, read by the receiver */
    int32_t dtype, want_dtype;      /* the message's, and what a refusing receiver wanted */
    int64_t numel, want_numel;
    _Atomic int32_t rejected;       /* the receiver refused the message; the sender clears it */
    char pad[20];
} cpar__pc_box;

struct cpar__pcomm {
    int n;
    uint64_t key;               /* names the group's store keys (world: 1) */
    void *base;                 /* the mapping; NULL for a group of one */
    size_t bytes, chunk, sub, box_chunk;
    cpar__pc_hdr *hdr;
    cpar__pc_member *mem;       /* [n] */
    cpar__pc_desc *desc;        /* [2][n], by collective parity */
    int64_t *splits;            /* [2][n][3n]: sizes, in_splits, out_splits */
    cpar__pc_box *box;          /* [n*n], box[src*n + dst] */
    char *data, *boxdata;       /* [n][2][chunk], [n*n][2][box_chunk] */
    uint64_t stages, colls;     /* so far, the same on every member */
    cpar__slot *sl;             /* [n] the members' descriptors as slots, for validation */
};

/* The segment of pc's n members and chunk sizes: its size, and (base set)
 * pc's tables pointed into the mapping. */
static size_t cpar__pc_layout(cpar__pcomm *pc) {
    size_t n = (size_t)pc->n, off[7];
    off[0] = cpar__round_up(sizeof(cpar__pc_hdr), 64);                          /* members */
    off[1] = off[0] + n * sizeof(cpar__pc_member);                              /* descriptors */
    off[2] = cpar__round_up(off[1] + 2 * n * sizeof(cpar__pc_desc), 64);        /* splits */
    off[3] = cpar__round_up(off[2] + 2 * n * 3 * n * sizeof(int64_t), 64);      /* mailboxes */
    off[4] = cpar__round_up(off[3] + n * n * sizeof(cpar__pc_box), 4096);       /* stage slots */
    off[5] = off[4] + 2 * n * pc->chunk;                                        /* mailbox data */
    off[6] = off[5] + 2 * n * n * pc->box_chunk;
    if (pc->base) {
        char *b = pc->base;
        pc->hdr = pc->base;
        pc->mem = (cpar__pc_member *)(b + off[0]);
        pc->desc = (cpar__pc_desc *)(b + off[1]);
        pc->splits = (int64_t *)(b + off[2]);
        pc->box = (cpar__pc_box *)(b + off[3]);
        pc->data = b + off[4];
        pc->boxdata = b + off[5];
    }
    return off[6];
}

static char *cpar__pc_slot(const cpar__pcomm *pc, int m, uint64_t stage) {
    return pc->data + ((size_t)m * 2 + (size_t)(stage & 1)) * pc->chunk;
}

static char *cpar__pc_boxbuf(const cpar__pcomm *pc, int src, int dst, uint64_t chunk_no) {
    return pc->boxdata + (((size_t)src * (size_t)pc->n + (size_t)dst) * 2 + (size_t)(chunk_no & 1)) * pc->box_chunk;
}

static void cpar__futex_wait(_Atomic uint32_t *w, uint32_t seen, int64_t ms) {
#ifdef __linux__
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000};
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, seen, &ts, NULL, 0);
#else
    (void)w, (void)seen;
    struct timespec ts = {0, (long)(ms < 1 ? ms : 1) * 1000000};
    nanosleep(&ts, NULL);
#endif
}

static void cpar__futex_wake(_Atomic uint32_t *w) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#else
    (void)w;
#endif
}

static void cpar__pc_ring(cpar__pcomm *pc, int m) {
    atomic_fetch_add(&pc->mem[m].bell, 1);
    cpar__futex_wake(&pc->mem[m].bell);
}

/* Has process pid ended? A zombie (killed, not yet reaped by its launcher)
 * has. 0 is a member that has not mapped the segment yet. */
static bool cpar__pid_gone(int64_t pid) {
    if (pid <= 0) return false;
    if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    ssize_t len = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (len <= 0) return false;
    buf[len] = 0;
    const char *p = strrchr(buf, ')'); /* "pid (comm) S ...": comm may hold spaces */
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

/* Record in one segment why the job failed (msg names the rank; the first
 * record wins) and wake every waiter. */
static void cpar__pc_record(cpar__pcomm *pc, const char *msg) {
    if (!pc || !pc->base) return;
    cpar__pc_hdr *h = pc->hdr;
    int32_t free_ = 0;
    if (atomic_compare_exchange_strong(&h->fail_claim, &free_, 1)) {
        snprintf(h->failed_msg, sizeof h->failed_msg, "%s", msg);
        atomic_store(&h->failed, 1);
    }
    cpar__futex_wake(&h->gen);
    for (int m = 0; m < pc->n; m++) cpar__pc_ring(pc, m);
}

/* The failure reaches every group of this process, as the job's failure does
 * on the threaded backend: a peer blocked on another group learns of it. */
static void cpar__pc_record_all(cpar_ctx *ctx, const char *msg) {
    for (cpar_group *g = ctx->groups; g; g = g->next) cpar__pc_record(g->pc, msg);
}

static cpar_status cpar__pc_failed(cpar_group *g, const char *fn, const char *what) {
    const cpar__pc_hdr *h = g->pc->hdr;
    return cpar__fail(g->ctx, CPAR_ERR_PEER, "%s: %s; abandoning the %s", fn, h->failed_msg, what);
}

typedef bool (*cpar__pc_ready)(const cpar__pcomm *pc, const void *arg);

/* Is member m one this wait needs? peers >= 0: the two given (-1: none);
 * a barrier (peer_a == -2): every member that has not entered it yet. */
static bool cpar__pc_needs(const cpar__pcomm *pc, int me, int peer_a, int peer_b, int m) {
    if (m == me) return false;
    if (peer_a == -2) return atomic_load(&pc->mem[m].entered) < atomic_load(&pc->mem[me].entered);
    return m == peer_a || m == peer_b;
}

/* ctx->give_up on the host and device backends: this member failed its own
 * checks in a collective call on g and will not enter the rendezvous (the
 * barrier, across processes) its peers wait in: it marks that one, and
 * counts, in the group's shared state, and wakes them (cpar__wait_locked,
 * cpar__pc_wait fail with why). */
static void cpar__group_give_up(cpar_group *g, const char *why) {
    if (g->size < 2) return;
    if (g->pc) {
        cpar__pc_member *me = &g->pc->mem[g->rank];
        snprintf(me->gave_up_msg, sizeof me->gave_up_msg, "%s", why);
        atomic_store(&me->gave_up_at, atomic_load(&me->entered) + 1);
        atomic_fetch_add(&me->gave_ups, 1); /* after the message and the mark: a reader checks it first */
        cpar__futex_wake(&g->pc->hdr->gen);
        return;
    }
    cpar__hcomm *hc = g->hc;
    if (!hc) return;
    pthread_mutex_lock(&hc->job->mu);
    hc->gave_up_at[g->rank] = hc->entered[g->rank] + 1;
    hc->gave_ups[g->rank]++;
    snprintf(hc->gave_up_msg[g->rank], sizeof hc->gave_up_msg[g->rank], "%s", why);
    pthread_cond_broadcast(&hc->job->cv);
    pthread_mutex_unlock(&hc->job->mu);
}

/* Wait until ready(pc, arg), sleeping on *word; fail on a recorded failure,
 * on a needed member that died or finalized, or at the deadline. */
static cpar_status cpar__pc_wait(cpar_group *g, const char *fn, const char *what, _Atomic uint32_t *word,
                                 cpar__pc_ready ready, const void *arg, int peer_a, int peer_b, int64_t deadline) {
    cpar__pcomm *pc = g->pc;
    cpar_ctx *ctx = g->ctx;
    int me = g->rank;
    bool spin = pc->n <= cpar__online_cpus();
    int64_t spin_until = cpar__now_ns() + 50000;
    /* Whether a process is gone takes system calls (kill, /proc): asked once
     * a wait has lasted a sleep slice, then once a slice, not at every wake-up
     * (a meeting of more ranks than cores would pay them every time). */
    int64_t probe_at = cpar__now_ms() + 10;
    for (unsigned i = 1;; i++) {
        uint32_t seen = atomic_load(word);
        if (ready(pc, arg)) return CPAR_OK;
        if (spin) {
#ifdef CPAR__X86_KERNELS
            _mm_pause();
#endif
            if ((i & 63) || cpar__now_ns() < spin_until) continue;
            spin = false;
        }
        if (atomic_load(&pc->hdr->failed)) return cpar__pc_failed(g, fn, what);
        /* a needed member that gave up on this barrier (more often than this one: not a shared refusal) */
        for (int m = 0; peer_a == -2 && m < pc->n; m++)
            if (cpar__pc_needs(pc, me, peer_a, peer_b, m) &&
                atomic_load(&pc->mem[m].gave_ups) > atomic_load(&pc->mem[me].gave_ups) &&
                atomic_load(&pc->mem[m].gave_up_at) == atomic_load(&pc->mem[me].entered))
                return cpar__fail(ctx, CPAR_ERR_PEER, "%s: rank %d gave up on this %s, failing its own checks: %.400s",
                                  fn, g->world_ranks[m], what, pc->mem[m].gave_up_msg);
        char msg[CPAR_ERR_LEN];
        int64_t now = cpar__now_ms();
        bool probe = now >= probe_at;
        if (probe) probe_at = now + 10;
        for (int m = 0; m < pc->n; m++) {
            if (!cpar__pc_needs(pc, me, peer_a, peer_b, m)) continue;
            int64_t pid = atomic_load(&pc->mem[m].pid);
            bool exited = atomic_load(&pc->mem[m].exited), gone = !exited && probe && cpar__pid_gone(pid);
            if (!exited && !gone) continue;
            /* It may have done its part, then left, since ready() was read. */
            if (ready(pc, arg)) return CPAR_OK;
            if (exited)
                snprintf(msg, sizeof msg, "rank %d left the group (finalized or destroyed it) without joining the %s",
                         g->world_ranks[m], what);
            else snprintf(msg, sizeof msg, "rank %d (pid %lld) died during the %s", g->world_ranks[m], (long long)pid, what);
            cpar__pc_record_all(ctx, msg);
            return cpar__fail(ctx, CPAR_ERR_PEER, "%s: %s", fn, msg);
        }
        int64_t left = deadline - cpar__now_ms();
        if (left <= 0) {
            char who[256];
            size_t len = 0;
            int missing = 0;
            who[0] = 0;
            for (int m = 0; m < pc->n && len < sizeof who - 16; m++)
                if (cpar__pc_needs(pc, me, peer_a, peer_b, m))
                    len += (size_t)snprintf(who + len, sizeof who - len, "%s%d", missing++ ? "," : "", g->world_ranks[m]);
            cpar_status st = cpar__fail(ctx, CPAR_ERR_TIMEOUT, "%s: %s timed out after %d ms waiting for rank%s %s", fn,
                                        what, ctx->timeout_ms, missing == 1 ? "" : "s", who);
            snprintf(msg, sizeof msg, "rank %d timed out (%.400s)", ctx->rank, ctx->err);
            cpar__pc_record_all(ctx, msg);
            return st;
        }
        /* Short sleeps: a peer's death wakes nobody, so it is looked for this often. */
        cpar__futex_wait(word, seen, left < 10 ? left : 10);
    }
}

static bool cpar__pc_gen_moved(const cpar__pcomm *pc, const void *arg) {
    return atomic_load(&pc->hdr->gen) != *(const uint32_t *)arg;
}

/* Meet every member of g. */
static cpar_status cpar__pc_barrier(cpar_group *g, const char *fn, int64_t deadline) {
    cpar__pcomm *pc = g->pc;
    cpar__pc_hdr *h = pc->hdr;
    if (atomic_load(&h->failed)) return cpar__pc_failed(g, fn, "collective");
    uint32_t gen = atomic_load(&h->gen); /* cannot move before this member arrives */
    atomic_fetch_add(&pc->mem[g->rank].entered, 1);
    if (atomic_fetch_add(&h->count, 1) == (uint32_t)pc->n - 1) {
        atomic_store(&h->count, 0);
        atomic_fetch_add(&h->gen, 1);
        cpar__futex_wake(&h->gen);
        return CPAR_OK;
    }
    return cpar__pc_wait(g, fn, "collective", &h->gen, cpar__pc_gen_moved, &gen, -2, -1, deadline);
}

/* [lo, lo + len) of an item range [0, total) that stage s of pieces of cap covers. */
static int64_t cpar__pc_piece(int64_t total, int64_t cap, uint64_t s, int64_t *lo) {
    *lo = (int64_t)s * cap;
    return total > *lo ? cpar__min64(total - *lo, cap) : 0;
}

/* Member me's rows of a reduce-scatter: its offset and count. */
static void cpar__pc_rs_rows(const cpar__slot *c, int n, int me, int64_t *off, int64_t *rows) {
    *off = 0;
    for (int m = 0; m < me; m++) *off += c->sizes ? c->sizes[m] : c->rows / n;
    *rows = c->sizes ? c->sizes[me] : c->rows / n;
}

/* Stage s of this member's data into its slot (from its own descriptor only:
 * the first stage is posted before the descriptors are compared). */
static void cpar__pc_post(cpar__pcomm *pc, const cpar__slot *c, int me, uint64_t s, uint64_t stage) {
    int n = pc->n;
    size_t es = cpar_dtype_size(c->dtype), row = (size_t)c->row_elems * es;
    char *slot = cpar__pc_slot(pc, me, stage);
    int64_t lo, len;
    switch (c->kind) {
    case CPAR_COLL_ALL_REDUCE:
    case CPAR_COLL_REDUCE_SCATTER: {
        int64_t cap = (int64_t)(pc->sub / es);
        for (int d = 0; d < n; d++) {
            if (d == me) continue; /* this member reduces its own share straight from its input */
            int64_t a, cnt;
            if (c->kind == CPAR_COLL_ALL_REDUCE) {
                int64_t hi;
                cpar__even_share(c->rows * c->row_elems, n, d, &a, &hi);
                cnt = hi - a;
            } else {
                cpar__pc_rs_rows(c, n, d, &a, &cnt);
                a *= c->row_elems, cnt *= c->row_elems;
            }
            len = cpar__pc_piece(cnt, cap, s, &lo);
            if (len) memcpy(slot + (size_t)d * pc->sub, (const char *)c->in + (size_t)(a + lo) * es, (size_t)len * es);
        }
        break;
    }
    case CPAR_COLL_ALL_GATHER:
    case CPAR__KIND_EXCHANGE:
        /* every member reads it: the whole slot is one piece */
        len = cpar__pc_piece(c->rows * (int64_t)row, (int64_t)pc->chunk, s, &lo);
        if (len) memcpy(slot, (const char *)c->in + lo, (size_t)len);
        break;
    case CPAR_COLL_ALL_TO_ALL: {
        int64_t src = 0;
        for (int d = 0; d < n; d++) {
            int64_t bytes = c->in_splits[d] * (int64_t)row;
            len = d == me ? 0 : cpar__pc_piece(bytes, (int64_t)pc->sub, s, &lo);
            if (len) memcpy(slot + (size_t)d * pc->sub, (const char *)c->in + src + lo, (size_t)len);
            src += bytes;
        }
        break;
    }
    case CPAR_COLL_BROADCAST:
        len = me == c->root ? cpar__pc_piece(c->rows * (int64_t)es, (int64_t)pc->chunk, s, &lo) : 0;
        if (len) memcpy(slot, (const char *)c->in + lo, (size_t)len);
        break;
    default: break;
    }
}

/* Stages the collective takes, from every member's descriptor (validated). */
static uint64_t cpar__pc_stages(const cpar__pcomm *pc, const cpar__slot *sl) {
    const cpar__slot *c = &sl[0];
    int n = pc->n;
    size_t es = cpar_dtype_size(c->dtype), row = (size_t)c->row_elems * es;
    int64_t most = 0, cap = 1;
    switch (c->kind) {
    case CPAR_COLL_ALL_REDUCE:
        most = (c->rows * c->row_elems + n - 1) / n, cap = (int64_t)(pc->sub / es);
        break;
    case CPAR_COLL_REDUCE_SCATTER:
        for (int d = 0; d < n; d++) {
            int64_t off, rows;
            cpar__pc_rs_rows(c, n, d, &off, &rows);
            most = rows > most ? rows : most;
        }
        most *= c->row_elems, cap = (int64_t)(pc->sub / es);
        break;
    case CPAR_COLL_ALL_GATHER:
    case CPAR__KIND_EXCHANGE:
        for (int m = 0; m < n; m++) most = sl[m].rows > most ? sl[m].rows : most;
        most *= (int64_t)row, cap = (int64_t)pc->chunk;
        break;
    case CPAR_COLL_ALL_TO_ALL:
        for (int m = 0; m < n; m++)
            for (int d = 0; d < n; d++) most = sl[m].in_splits[d] > most ? sl[m].in_splits[d] : most;
        most *= (int64_t)row, cap = (int64_t)pc->sub;
        break;
    case CPAR_COLL_BROADCAST: most = c->rows * (int64_t)es, cap = (int64_t)pc->chunk; break;
    default: break;
    }
    uint64_t stages = (uint64_t)((most + cap - 1) / cap);
    return stages ? stages : 1;
}

/* A collective whose members' buffers all lie in their arenas (every member
 * mapped every peer's): the threaded backend's data movement on the peers'
 * buffers as this process maps them, then a meeting so no member frees or
 * reuses a buffer a peer still reads. The descriptors are validated. */
static cpar_status cpar__pc_direct(cpar_group *g, const char *fn, const cpar__slot *mine, int par, int64_t deadline) {
    cpar_ctx *ctx = g->ctx;
    cpar__pcomm *pc = g->pc;
    int n = pc->n;
    size_t es = cpar_dtype_size(mine->dtype);
    for (int m = 0; m < n; m++) {
        const cpar__pc_desc *e = &pc->desc[par * n + m];
        int w = g->world_ranks[m];
        char *base = ctx->arena_peer[w];
        size_t cap = ctx->arena_peer_bytes[w], bytes = (size_t)e->rows * (size_t)e->row_elems * es;
        /* The offsets come from another process: trust them only inside its arena. */
        bool in_ok = (uint64_t)e->in_off <= cap && bytes <= cap - (size_t)e->in_off;
        bool out_ok = e->out_off >= 0 && (uint64_t)e->out_off <= cap && bytes <= cap - (size_t)e->out_off;
        if (!in_ok) {
            char msg[CPAR_ERR_LEN];
            snprintf(msg, sizeof msg, "rank %d described a buffer outside its arena", w);
            cpar__pc_record_all(ctx, msg);
            return cpar__fail(ctx, CPAR_ERR_PEER, "%s: %s", fn, msg);
        }
        pc->sl[m].in = m == g->rank ? mine->in : base + e->in_off;
        pc->sl[m].out = m == g->rank ? mine->out : out_ok ? base + e->out_off : NULL;
    }
    cpar_status st = cpar__hc_move(g, fn, mine, pc->sl);
    cpar_status st2 = cpar__pc_barrier(g, fn, deadline); /* as every member: the peers meet here either way */
    return st != CPAR_OK ? st : st2;
}

/* Post, meet, compare descriptors, then either move the data in place
 * (cpar__pc_direct: every member's buffers are in its arena) or stage after
 * stage pull this member's part (module comment above). mine->in and
 * mine->out are this process's. */
static cpar_status cpar__pc_collective(cpar_group *g, const char *fn, const cpar__slot *mine) {
    cpar_ctx *ctx = g->ctx;
    cpar__pcomm *pc = g->pc;
    int n = pc->n, me = g->rank;
    int64_t deadline = cpar__now_ms() + ctx->timeout_ms;
    if (atomic_load(&pc->hdr->failed)) return cpar__pc_failed(g, fn, "collective");
    int par = (int)(pc->colls++ & 1);
    cpar__pc_desc *d = &pc->desc[par * n + me];
    /* Buffers in the arena are read (and an all-reduce's written) by the
     * peers in place; then nothing is staged. */
    size_t in_bytes = (size_t)mine->rows * (size_t)mine->row_elems * cpar_dtype_size(mine->dtype);
    int64_t in_off = cpar__arena_offset(ctx->arena, mine->in, in_bytes);
    int64_t out_off = cpar__arena_offset(ctx->arena, mine->out, in_bytes);
    bool direct = ctx->arena_all && mine->kind != CPAR__KIND_EXCHANGE && in_off >= 0 && in_bytes > 0 &&
                  (mine->kind != CPAR_COLL_ALL_REDUCE || out_off >= 0);
    *d = (cpar__pc_desc){.kind = mine->kind, .dtype = (int32_t)mine->dtype, .op = mine->op, .root = mine->root,
                         .has_sizes = mine->sizes != NULL, .direct = direct, .rows = mine->rows,
                         .row_elems = mine->row_elems, .in_off = in_off, .out_off = out_off, .tag = mine->tag};
    memcpy(d->tag_text, mine->tag_text, sizeof d->tag_text);
    int64_t *sp = pc->splits + ((size_t)par * (size_t)n + (size_t)me) * 3 * (size_t)n;
    if (mine->sizes) memcpy(sp, mine->sizes, (size_t)n * sizeof *sp);
    if (mine->in_splits) memcpy(sp + n, mine->in_splits, (size_t)n * sizeof *sp);
    if (mine->out_splits) memcpy(sp + 2 * n, mine->out_splits, (size_t)n * sizeof *sp);
    uint64_t stage = pc->stages++;
    if (!direct) cpar__pc_post(pc, mine, me, 0, stage);
    CPAR_TRY(cpar__pc_barrier(g, fn, deadline));
    int ndirect = 0;
    for (int m = 0; m < n; m++) {
        const cpar__pc_desc *e = &pc->desc[par * n + m];
        const int64_t *ms = pc->splits + ((size_t)par * (size_t)n + (size_t)m) * 3 * (size_t)n;
        pc->sl[m] = (cpar__slot){.kind = e->kind, .dtype = (cpar_dtype)e->dtype, .op = e->op, .root = e->root,
                                 .rows = e->rows, .row_elems = e->row_elems, .sizes = e->has_sizes ? ms : NULL,
                                 .in_splits = ms + n, .out_splits = ms + 2 * n, .tag = e->tag};
        memcpy(pc->sl[m].tag_text, e->tag_text, sizeof pc->sl[m].tag_text);
        ndirect += e->direct != 0;
    }
    CPAR_TRY(cpar__slots_validate(g, fn, pc->sl));
    if (ndirect == n) return cpar__pc_direct(g, fn, mine, par, deadline);
    if (ndirect) {
        /* Some members skipped staging for nothing: they stage now, and everyone meets again. */
        if (direct) cpar__pc_post(pc, mine, me, 0, stage);
        CPAR_TRY(cpar__pc_barrier(g, fn, deadline));
    }
    const cpar__slot *sl = pc->sl;
    uint64_t stages = cpar__pc_stages(pc, sl);
    size_t es = cpar_dtype_size(mine->dtype), row = (size_t)mine->row_elems * es;
    /* Whether output stores stream past the cache: as on the threaded backend. */
    size_t total = (size_t)mine->rows * row * (size_t)n;
    if (mine->kind == CPAR_COLL_REDUCE_SCATTER) total = (size_t)mine->rows * row;
    bool stream = total >= CPAR__HC_STREAM_BYTES && mine->in != mine->out;
    cpar_status st = CPAR_OK;
    const void *ins[CPAR__PC_MAX];
    for (uint64_t s = 0; s < stages && st == CPAR_OK; s++) {
        if (s) {
            stage = pc->stages++;
            cpar__pc_post(pc, mine, me, s, stage);
            CPAR_TRY(cpar__pc_barrier(g, fn, deadline));
        }
        int64_t lo, len;
        switch (mine->kind) {
        case CPAR_COLL_ALL_REDUCE: {
            int64_t cap = (int64_t)(pc->sub / es), N = mine->rows * mine->row_elems, a, hi;
            cpar__even_share(N, n, me, &a, &hi);
            len = cpar__pc_piece(hi - a, cap, s, &lo);
            for (int m = 0; m < n; m++)
                ins[m] = m == me ? (const char *)mine->in + (size_t)(a + lo) * es : cpar__pc_slot(pc, m, stage) + (size_t)me * pc->sub;
            void *outs[2] = {(char *)mine->out + (size_t)(a + lo) * es, cpar__pc_slot(pc, me, stage) + (size_t)me * pc->sub};
            st = cpar__reduce_rows(ctx, fn, mine->dtype, (cpar_reduce_op)mine->op, CPAR_HOST, ins, n, 0, outs, 2, 0, len,
                                   false);
            if (st == CPAR_OK) st = cpar__pc_barrier(g, fn, deadline);
            for (int m = 0; m < n && st == CPAR_OK; m++) {
                if (m == me) continue;
                cpar__even_share(N, n, m, &a, &hi);
                len = cpar__pc_piece(hi - a, cap, s, &lo);
                if (len)
                    st = cpar__hc_copy(ctx, fn, (char *)mine->out + (size_t)(a + lo) * es,
                                       cpar__pc_slot(pc, m, stage) + (size_t)m * pc->sub, (size_t)len * es, stream);
            }
            break;
        }
        case CPAR_COLL_REDUCE_SCATTER: {
            int64_t cap = (int64_t)(pc->sub / es), off, rows;
            cpar__pc_rs_rows(mine, n, me, &off, &rows);
            len = cpar__pc_piece(rows * mine->row_elems, cap, s, &lo);
            for (int m = 0; m < n; m++)
                ins[m] = m == me ? (const char *)mine->in + (size_t)(off * mine->row_elems + lo) * es
                                 : cpar__pc_slot(pc, m, stage) + (size_t)me * pc->sub;
            void *out = (char *)mine->out + (size_t)lo * es;
            st = cpar__reduce_rows(ctx, fn, mine->dtype, (cpar_reduce_op)mine->op, CPAR_HOST, ins, n, 0, &out, 1, 0, len,
                                   stream);
            break;
        }
        case CPAR_COLL_ALL_GATHER:
        case CPAR__KIND_EXCHANGE: {
            size_t off = 0;
            for (int m = 0; m < n && st == CPAR_OK; m++) {
                int64_t bytes = sl[m].rows * (int64_t)row;
                len = cpar__pc_piece(bytes, (int64_t)pc->chunk, s, &lo);
                const char *src = m == me ? (const char *)mine->in + lo : cpar__pc_slot(pc, m, stage);
                if (len) st = cpar__hc_copy(ctx, fn, (char *)mine->out + off + (size_t)lo, src, (size_t)len, stream);
                off += (size_t)bytes;
            }
            break;
        }
        case CPAR_COLL_ALL_TO_ALL: {
            size_t off = 0;
            int64_t src_me = 0;
            for (int j = 0; j < me; j++) src_me += mine->in_splits[j];
            for (int m = 0; m < n && st == CPAR_OK; m++) {
                int64_t bytes = mine->out_splits[m] * (int64_t)row;
                len = cpar__pc_piece(bytes, (int64_t)pc->sub, s, &lo);
                const char *src = m == me ? (const char *)mine->in + (size_t)src_me * row + (size_t)lo
                                          : cpar__pc_slot(pc, m, stage) + (size_t)me * pc->sub;
                if (len) st = cpar__hc_copy(ctx, fn, (char *)mine->out + off + (size_t)lo, src, (size_t)len, stream);
                off += (size_t)bytes;
            }
            break;
        }
        case CPAR_COLL_BROADCAST:
            len = me == mine->root ? 0 : cpar__pc_piece(mine->rows * (int64_t)es, (int64_t)pc->chunk, s, &lo);
            if (len) st = cpar__hc_copy(ctx, fn, (char *)mine->out + lo, cpar__pc_slot(pc, mine->root, stage),
                                        (size_t)len, stream);
            break;
        default: break;
        }
    }
    if (stream) cpar__host_stream_fence();
    return st;
}

/* Is mailbox progress possible? (bell moved since the snapshot) */
static bool cpar__pc_bell_moved(const cpar__pcomm *pc, const void *arg) {
    const uint32_t *a = arg; /* {member, snapshot} */
    return atomic_load(&pc->mem[a[0]].bell) != a[1];
}

/* Point-to-point through the mailboxes: the send goes out in chunks (two in
 * flight) while the receive is taken, so a ring of sendrecvs never waits on
 * itself. The sender returns once the receiver has taken everything, as on
 * the threaded backend; the first chunk carries the dtype and count, and a
 * receiver that expects others refuses it unread, so both sides fail with
 * CPAR_ERR_INVALID. */
static cpar_status cpar__pc_sendrecv(cpar_group *g, const char *fn, const void *send, cpar_dtype send_dt,
                                     int64_t send_numel, int to, void *recv, cpar_dtype recv_dt, int64_t recv_numel,
                                     int from) {
    cpar_ctx *ctx = g->ctx;
    cpar__pcomm *pc = g->pc;
    int me = g->rank, n = pc->n;
    int64_t deadline = cpar__now_ms() + ctx->timeout_ms;
    const char *what = to >= 0 && from >= 0 ? "send/receive" : to >= 0 ? "send" : "receive";
    if (atomic_load(&pc->hdr->failed)) return cpar__pc_failed(g, fn, what);
    size_t bc = pc->box_chunk;
    size_t sbytes = (size_t)send_numel * cpar_dtype_size(send_dt), rbytes = (size_t)recv_numel * cpar_dtype_size(recv_dt);
    cpar__pc_box *sb = to >= 0 ? &pc->box[(size_t)me * (size_t)n + (size_t)to] : NULL;
    cpar__pc_box *rb = from >= 0 ? &pc->box[(size_t)from * (size_t)n + (size_t)me] : NULL;
    uint64_t s_chunks = sb ? (sbytes + bc - 1) / bc : 0, r_chunks = rb ? (rbytes + bc - 1) / bc : 0;
    if (sb && !s_chunks) s_chunks = 1; /* an empty message still carries its header */
    if (rb && !r_chunks) r_chunks = 1;
    uint64_t s_done = 0, r_done = 0, s_base = sb ? atomic_load(&sb->posted) : 0;
    if (sb) {
        sb->dtype = (int32_t)send_dt;
        sb->numel = send_numel;
    }
    /* A refused message fails this call, but the other half still completes:
     * the peer on it must not be left waiting. */
    cpar_status err = CPAR_OK;
    char msg[CPAR_ERR_LEN] = "";
    bool refusing = false; /* this rank refused the receive and waits for the sender's acknowledgement */
    for (;;) {
        uint32_t snap[2] = {(uint32_t)me, atomic_load(&pc->mem[me].bell)};
        bool moved = false;
        if (sb && atomic_load(&sb->rejected)) {
            /* Drop the refused message (the mailbox is empty again) and release the receiver. */
            s_done = s_chunks;
            atomic_store(&sb->taken, atomic_load(&sb->posted));
            if (err == CPAR_OK) {
                err = CPAR_ERR_INVALID;
                snprintf(msg, sizeof msg, "%s: rank %d expected %lld elements of %s, this rank sent it %lld elements "
                         "of %s", fn, g->world_ranks[to], (long long)sb->want_numel,
                         cpar_dtype_name((cpar_dtype)sb->want_dtype), (long long)send_numel, cpar_dtype_name(send_dt));
            }
            atomic_store(&sb->rejected, 0);
            cpar__pc_ring(pc, to);
            moved = true;
        }
        if (s_done < s_chunks && atomic_load(&sb->posted) - atomic_load(&sb->taken) < 2) {
            uint64_t no = s_base + s_done;
            size_t lo = (size_t)s_done * bc, len = sbytes > lo ? (sbytes - lo < bc ? sbytes - lo : bc) : 0;
            if (len) memcpy(cpar__pc_boxbuf(pc, me, to, no), (const char *)send + lo, len);
            atomic_store(&sb->posted, no + 1);
            cpar__pc_ring(pc, to);
            s_done++;
            moved = true;
        }
        if (refusing && !atomic_load(&rb->rejected)) {
            refusing = false;
            r_done = r_chunks;
            moved = true;
        }
        if (!refusing && r_done < r_chunks && atomic_load(&rb->posted) > atomic_load(&rb->taken)) {
            uint64_t no = atomic_load(&rb->taken);
            if (r_done == 0 && (rb->dtype != (int32_t)recv_dt || rb->numel != recv_numel)) {
                if (err == CPAR_OK) {
                    err = CPAR_ERR_INVALID;
                    snprintf(msg, sizeof msg, "%s: rank %d sent %lld elements of %s, the receive buffer has %lld "
                             "elements of %s", fn, g->world_ranks[from], (long long)rb->numel,
                             cpar_dtype_name((cpar_dtype)rb->dtype), (long long)recv_numel, cpar_dtype_name(recv_dt));
                }
                rb->want_dtype = (int32_t)recv_dt;
                rb->want_numel = recv_numel;
                atomic_store(&rb->rejected, 1);
                refusing = true;
                cpar__pc_ring(pc, from);
            } else {
                size_t lo = (size_t)r_done * bc, len = rbytes > lo ? (rbytes - lo < bc ? rbytes - lo : bc) : 0;
                if (len) memcpy((char *)recv + lo, cpar__pc_boxbuf(pc, from, me, no), len);
                atomic_store(&rb->taken, no + 1);
                cpar__pc_ring(pc, from);
                r_done++;
            }
            moved = true;
        }
        bool sent = !sb || (s_done == s_chunks && atomic_load(&sb->taken) >= s_base + s_chunks);
        if (sent && r_done == r_chunks) return err == CPAR_OK ? CPAR_OK : cpar__fail(ctx, err, "%s", msg);
        if (moved) continue;
        int pa = sb && !sent ? to : -1, pb = r_done < r_chunks ? from : -1;
        CPAR_TRY(cpar__pc_wait(g, fn, what, &pc->mem[me].bell, cpar__pc_bell_moved, snap, pa, pb, deadline));
    }
}

/* 32-bit FNV-1a: names a job's segments after its token ("cpar-<hash>-..."),
 * so cparrun can sweep a job's leftovers (bootstrap/cparrun.c hashes alike). */
static uint32_t cpar__fnv32(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

#define CPAR__PC_NAME 96 /* a segment's name as it travels: "/cpar-...", or "!" and why there is none */

/* g's shared state, without a segment yet (a group of one never has one). */
static cpar_status cpar__pc_new(cpar_group *g, const char *fn, uint64_t key) {
    cpar_ctx *ctx = g->ctx;
    if (g->size > CPAR__PC_MAX)
        return cpar__fail(ctx, CPAR_ERR_UNSUPPORTED, "%s: a group of %d processes; the host backend takes at most %d",
                          fn, g->size, CPAR__PC_MAX);
    cpar__pcomm *pc = calloc(1, sizeof *pc);
    if (pc) pc->sl = calloc((size_t)g->size, sizeof *pc->sl);
    if (!pc || !pc->sl) {
        free(pc);
        return cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate the group's shared state", fn);
    }
    pc->n = g->size;
    pc->key = key;
    g->pc = pc;
    return CPAR_OK;
}

/* Every member's part once the segment is mapped: its tables, its pid. */
static void cpar__pc_mapped(cpar_group *g) {
    cpar__pcomm *pc = g->pc;
    cpar__pc_layout(pc);
    pc->sub = (pc->chunk / (size_t)pc->n) & ~(size_t)63;
    const cpar__arena *a = g->ctx->arena;
    pc->mem[g->rank].arena_fd = a ? a->fd : -1;
    pc->mem[g->rank].arena_bytes = a ? a->cap : 0;
    atomic_store(&pc->mem[g->rank].pid, (int64_t)getpid());
}

/* g's first member makes the segment: text gets its name, or "!" and why
 * not (so the others fail at once rather than at the deadline). */
static cpar_status cpar__pc_create(cpar_group *g, const char *fn, const char *token, char *text) {
    cpar_ctx *ctx = g->ctx;
    cpar__pcomm *pc = g->pc;
    static atomic_uint serial;
    /* After the token's hash (cparrun sweeps a job's leftovers by it), a
     * nonce: the launchers' ids are public, and a name nobody can foresee
     * (the peers learn it through the parent's exchange) is one no other
     * local user can take first. */
    uint64_t nonce = 0;
    if (cpar__random_bytes(&nonce, sizeof nonce) != 0) {
        cpar_status st = cpar__fail(ctx, CPAR_ERR_SYSTEM, "%s: cannot draw a random segment name: %s", fn,
                                    strerror(errno));
        snprintf(text, CPAR__PC_NAME, "!%.90s", strerror(errno));
        return st;
    }
    snprintf(text, CPAR__PC_NAME, "/cpar-%08x-%ld-%u-%016llx", cpar__fnv32(token), (long)getpid(),
             atomic_fetch_add(&serial, 1), (unsigned long long)nonce);
    /* Stage halves: CPAR_HOST_CHUNK bytes (tests make it small), at least 64 per member. */
    size_t chunk = (size_t)cpar__getenv_positive("CPAR_HOST_CHUNK", (int)CPAR__PC_CHUNK);
    chunk = cpar__round_up(chunk < (size_t)64 * (size_t)pc->n ? (size_t)64 * (size_t)pc->n : chunk, 4096);
    /* Mailbox halves: 16 MiB for all pairs together, 64 KiB to a chunk each.
     * Pages exist only once touched, but /dev/shm may be small (64 MiB in a
     * container by default), and a touch past its end is SIGBUS. */
    size_t box = ((size_t)16 << 20) / (2 * (size_t)pc->n * (size_t)pc->n);
    box = cpar__round_up(box < ((size_t)64 << 10) ? (size_t)64 << 10 : box > chunk ? chunk : box, 4096);
    pc->chunk = chunk, pc->box_chunk = box;
    pc->bytes = cpar__pc_layout(pc);
    int fd = shm_open(text, O_CREAT | O_EXCL | O_RDWR, 0600);
    /* The file is sparse: pages exist once a stage or a mailbox touches them. */
    if (fd < 0 || ftruncate(fd, (off_t)pc->bytes) != 0 ||
        (pc->base = mmap(NULL, pc->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        pc->base = NULL;
        cpar_status st = cpar__fail(ctx, CPAR_ERR_SYSTEM, "%s: cannot make the shared-memory segment %s of %zu bytes: %s",
                                    fn, text, pc->bytes, strerror(errno));
        if (fd >= 0) {
            close(fd);
            shm_unlink(text);
        }
        snprintf(text, CPAR__PC_NAME, "!%.90s", strerror(errno));
        return st;
    }
    close(fd);
    cpar__pc_hdr *h = pc->base;
    h->magic = CPAR__PC_MAGIC;
    h->n = pc->n;
    h->chunk = chunk, h->box_chunk = box, h->bytes = pc->bytes;
    cpar__pc_mapped(g);
    return CPAR_OK;
}

/* Every other member maps the segment text names. */
static cpar_status cpar__pc_map(cpar_group *g, const char *fn, const char *text) {
    cpar_ctx *ctx = g->ctx;
    cpar__pcomm *pc = g->pc;
    if (text[0] != '/')
        return cpar__fail(ctx, CPAR_ERR_PEER, "%s: rank %d could not make the group's shared memory (%.90s)", fn,
                          g->world_ranks[0], text[0] == '!' ? text + 1 : "no name");
    struct stat sb;
    int fd = shm_open(text, O_RDWR, 0600);
    if (fd < 0 || fstat(fd, &sb) != 0 ||
        (pc->base = mmap(NULL, (size_t)sb.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        pc->base = NULL;
        cpar_status st = cpar__fail(ctx, CPAR_ERR_SYSTEM, "%s: cannot map the shared-memory segment %s of rank %d: %s",
                                    fn, text, g->world_ranks[0], strerror(errno));
        if (fd >= 0) close(fd);
        return st;
    }
    close(fd);
    const cpar__pc_hdr *h = pc->base;
    pc->bytes = (size_t)sb.st_size;
    if (h->magic != CPAR__PC_MAGIC || h->n != pc->n || h->bytes != pc->bytes) {
        munmap(pc->base, pc->bytes);
        pc->base = NULL;
        return cpar__fail(ctx, CPAR_ERR_SYSTEM, "%s: shared-memory segment %s is not this group's (%d members expected)",
                          fn, text, pc->n);
    }
    pc->chunk = h->chunk, pc->box_chunk = h->box_chunk;
    cpar__pc_mapped(g);
    return CPAR_OK;
}

/* Map every peer's arena through /proc/<pid>/fd/<fd> (w is the world group,
 * whose segment names them, every member having published its own before
 * the barrier that precedes this). ctx->arena_all says whether every one is
 * mapped; where one is not (a peer without an arena, a /proc this process
 * may not open), collectives stage through the segment as before. */
static void cpar__pc_arenas_map(cpar_ctx *ctx, cpar_group *w) {
    cpar__pcomm *pc = w->pc;
    int n = w->size;
    if (!ctx->arena || !pc || !pc->base) return;
    ctx->arena_peer = calloc((size_t)n, sizeof *ctx->arena_peer);
    ctx->arena_peer_bytes = calloc((size_t)n, sizeof *ctx->arena_peer_bytes);
    if (!ctx->arena_peer || !ctx->arena_peer_bytes) return;
    bool all = true;
    for (int m = 0; m < n; m++) {
        if (m == w->rank) {
            ctx->arena_peer[m] = ctx->arena->base, ctx->arena_peer_bytes[m] = ctx->arena->cap;
            continue;
        }
        int32_t fd = pc->mem[m].arena_fd;
        int64_t pid = atomic_load(&pc->mem[m].pid);
        size_t bytes = (size_t)pc->mem[m].arena_bytes;
        char path[64];
        snprintf(path, sizeof path, "/proc/%lld/fd/%d", (long long)pid, (int)fd);
        int f = fd >= 0 && pid > 0 ? open(path, O_RDWR | O_CLOEXEC) : -1;
        struct stat sb;
        void *p = MAP_FAILED;
        if (f >= 0 && fstat(f, &sb) == 0 && (uint64_t)sb.st_size == (uint64_t)bytes)
            p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, f, 0);
        if (f >= 0) close(f);
        if (p == MAP_FAILED) {
            cpar__log(CPAR__LOG_INFO, ctx->rank, "cannot map rank %d's arena (%s): collectives stage through shared "
                      "memory", m, fd < 0 ? "it has none" : strerror(errno));
            all = false;
            continue;
        }
#ifdef __linux__
        madvise(p, bytes, MADV_DONTFORK);
#endif
        ctx->arena_peer[m] = p, ctx->arena_peer_bytes[m] = bytes;
    }
    ctx->arena_all = all;
}

/* Unmap the peers' arenas (cpar_finalize). */
static void cpar__pc_arenas_unmap(cpar_ctx *ctx) {
    for (int m = 0; ctx->arena_peer && m < ctx->world; m++)
        if (m != ctx->rank && ctx->arena_peer[m]) munmap(ctx->arena_peer[m], ctx->arena_peer_bytes[m]);
    free(ctx->arena_peer);
    free(ctx->arena_peer_bytes);
    ctx->arena_peer = NULL, ctx->arena_peer_bytes = NULL;
    ctx->arena_all = false;
}

/* The world group's shared state, through the store (the only channel there
 * is yet): rank 0 creates the segment and publishes its name under the job
 * token's store, the others map it, everyone arrives at a store barrier, and
 * rank 0 unlinks the name. */
static cpar_status cpar__pc_open_world(cpar_group *g, const char *fn, cpar_store *store) {
    CPAR_TRY(cpar__pc_new(g, fn, 1));
    if (g->size == 1) return CPAR_OK;
    char text[CPAR__PC_NAME];
    size_t len = 0;
    cpar_status st;
    if (g->rank == 0) {
        st = cpar__pc_create(g, fn, store->token, text);
        cpar_status ss = cpar_store_set(store, "cpar/shm/world", text, strlen(text));
        if (st == CPAR_OK) st = ss;
    } else {
        st = cpar_store_get(store, "cpar/shm/world", text, sizeof text - 1, &len);
        if (st == CPAR_OK) {
            text[len] = 0;
            st = cpar__pc_map(g, fn, text);
        }
    }
    /* Every member says it has mapped the segment (or failed: the others
     * then fail at their first wait on it), so its creator can unlink it. */
    cpar_status bs = cpar__store_barrier(store, fn, "cpar/shm/world/mapped", g->rank, g->size, false);
    if (g->rank == 0 && g->pc->base) shm_unlink(text);
    if (st == CPAR_OK && bs == CPAR_OK) cpar__pc_arenas_map(g->ctx, g);
    return st != CPAR_OK ? st : bs;
}

/* Release g's shared state; peers waiting for this member see it finalized. */
static void cpar__pc_close(cpar_group *g) {
    cpar__pcomm *pc = g->pc;
    if (!pc) return;
    if (pc->base) {
        atomic_store(&pc->mem[g->rank].exited, 1);
        cpar__futex_wake(&pc->hdr->gen);
        for (int m = 0; m < pc->n; m++) cpar__pc_ring(pc, m);
        munmap(pc->base, pc->bytes);
    }
    free(pc->sl);
    free(pc);
    g->pc = NULL;
}

/* ==== 9. NCCL backend ====================================================
 * One communicator per group, created non-blocking (blocking = 0) and polled
 * with ncclCommGetAsyncError against the context's deadline; on a failure or
 * a timeout the communicator is aborted (and forgotten: the group then says
 * it was aborted) so no rank hangs in a kernel. In single-process mode a
 * failed peer (cpar__job) also aborts the wait, and on every launch a peer
 * whose collective call failed its own checks (cpar__nccl_give_up). `make
 * test` runs all of this against the NCCL simulator (tests/ncclsim, the
 * nccl-sim build).
 * Uses: 1-4, 7 (the store: give-ups across processes), 8 (job state). */

#ifdef CPAR_WITH_NCCL
static ncclDataType_t cpar__nccl_dtype(cpar_dtype dt) {
    switch (dt) {
    case CPAR_F32: return ncclFloat32;
    case CPAR_F16: return ncclFloat16;
    case CPAR_BF16: return ncclBfloat16;
    case CPAR_I32: return ncclInt32;
    case CPAR_I64: return ncclInt64;
    default: return ncclUint8;
    }
}

static ncclRedOp_t cpar__nccl_op(cpar_reduce_op op) { return op == CPAR_SUM ? ncclSum : op == CPAR_MAX ? ncclMax : ncclMin; }

/* NCCL's result as a cpar status: a peer's failure is CPAR_ERR_PEER, a call
 * the ranks disagree on (or a bad argument NCCL caught) is CPAR_ERR_INVALID. */
static cpar_status cpar__nccl_status(ncclResult_t r) {
    switch (r) {
    case ncclRemoteError: return CPAR_ERR_PEER;
    case ncclInvalidArgument:
    case ncclInvalidUsage: return CPAR_ERR_INVALID;
    default: return CPAR_ERR_NCCL;
    }
}

/* call is the NCCL call as written ("ncclAllReduce(buf, ...)"); messages
 * name the function alone. */
static int cpar__nccl_name_len(const char *call) { return (int)strcspn(call, "("); }

/* note, when not NULL, ends the line in parentheses. */
static cpar_status cpar__nccl_fail_note(cpar_ctx *ctx, const char *fn, const char *call, ncclResult_t r,
                                        const char *note) {
    const char *detail = ncclGetLastError(NULL); /* NCCL ignores its argument */
    return cpar__fail(ctx, cpar__nccl_status(r), "%s: %.*s failed: %s%s%s%s%s%s", fn, cpar__nccl_name_len(call), call,
                      ncclGetErrorString(r), detail && *detail ? ": " : "", detail ? detail : "", note ? " (" : "",
                      note ? note : "", note ? ")" : "");
}
static cpar_status cpar__nccl_fail(cpar_ctx *ctx, const char *fn, const char *call, ncclResult_t r) {
    return cpar__nccl_fail_note(ctx, fn, call, r, NULL);
}

/* Abort *comm and forget it, so no later call (cpar_finalize included) uses
 * the freed handle; the group then reports itself aborted. */
static void cpar__nccl_abort(ncclComm_t *comm) {
    if (*comm) ncclCommAbort(*comm);
    *comm = NULL;
}

/* A member of g (g may be NULL) whose function has returned in this
 * single-process job, or -1. Asked only once NCCL has failed: a peer that
 * returned after finishing its part of a collective is no fault. */
static int cpar__nccl_exited_member(const cpar_ctx *ctx, const cpar_group *g) {
    if (!ctx->job || !g) return -1;
    for (int m = 0; m < g->size; m++)
        if (m != g->rank && ctx->job->exited[g->world_ranks[m]]) return g->world_ranks[m];
    return -1;
}

/* ---- A collective call that failed its own checks (issue 29) ----
 * Its rank never enqueues the batch its peers did, and NCCL would leave them
 * waiting for it until the deadline. It publishes (the group's uid, the batch
 * it skips, how often it has given up on the group, its message): in the job
 * when the ranks are threads, in the store when they are processes. A
 * waiting rank (cpar__nccl_gave_up_check, from cpar__nccl_wait and the stream
 * waits) fails at once with CPAR_ERR_PEER when a member has given up more
 * often than itself, on a batch it has enqueued. A refusal every member
 * shares leaves the counts equal, so it never fails a later call. */

/* The job's count of give-ups on every group: one round trip tells a
 * waiting rank that there is nothing to look at (the common case). */
#define CPAR__GAVE_UP_ANY "cpar/gaveup/any"

static void cpar__nccl_gave_up_key(char *key, size_t cap, uint64_t uid, int world_rank, uint64_t count) {
    if (count) snprintf(key, cap, "cpar/gaveup/%016llx/%d/%llu", (unsigned long long)uid, world_rank,
                        (unsigned long long)count);
    else snprintf(key, cap, "cpar/gaveup/%016llx/%d", (unsigned long long)uid, world_rank);
}

/* ctx->give_up on the NCCL backend (cpar__fail calls it). */
static void cpar__nccl_give_up(cpar_group *g, const char *why) {
    cpar_ctx *ctx = g->ctx;
    if (g->size < 2 || !g->nccl) return;
    const uint64_t count = ++g->gave_ups, at = g->seq + 1;
    if (ctx->store) { /* processes: the message under its count, then the count (a reader sees it first) */
        char key[96], val[CPAR_ERR_LEN + 24];
        const int len = snprintf(val, sizeof val, "%llu %s", (unsigned long long)at, why);
        cpar__nccl_gave_up_key(key, sizeof key, g->uid, ctx->rank, count);
        int64_t now;
        if (cpar_store_set(ctx->store, key, val, (size_t)len + 1) == CPAR_OK) {
            cpar__nccl_gave_up_key(key, sizeof key, g->uid, ctx->rank, 0);
            if (cpar_store_add(ctx->store, key, 1, &now) == CPAR_OK)
                (void)cpar_store_add(ctx->store, CPAR__GAVE_UP_ANY, 1, &now);
        }
        return;
    }
    cpar__job *job = ctx->job;
    if (!job) return;
    pthread_mutex_lock(&job->mu);
    cpar__gave_up *e = job->gave_up;
    while (e && !(e->uid == g->uid && e->world_rank == ctx->rank)) e = e->next;
    if (!e && (e = calloc(1, sizeof *e)) != NULL) {
        e->uid = g->uid, e->world_rank = ctx->rank;
        e->next = job->gave_up, job->gave_up = e;
    }
    if (e) {
        e->at = at, e->count = count;
        snprintf(e->msg, sizeof e->msg, "%s", why);
        atomic_store(&job->any_gave_up, true);
    }
    pthread_mutex_unlock(&job->mu);
}

/* World rank wr's latest give-up on g: false when it has none (or the store
 * cannot say). */
static bool cpar__nccl_gave_up_read(cpar_ctx *ctx, const cpar_group *g, int wr, uint64_t *at, uint64_t *count,
                                    char *msg, size_t cap) {
    if (ctx->store) {
        char key[96], val[CPAR_ERR_LEN + 24], keep[CPAR_ERR_LEN];
        snprintf(keep, sizeof keep, "%s", cpar__tls_err); /* a failed poll must not replace the caller's error */
        int64_t n = 0;
        size_t len = 0;
        unsigned long long a = 0;
        int off = 0;
        cpar__nccl_gave_up_key(key, sizeof key, g->uid, wr, 0);
        bool ok = cpar_store_add(ctx->store, key, 0, &n) == CPAR_OK && n > 0;
        if (ok) {
            cpar__nccl_gave_up_key(key, sizeof key, g->uid, wr, (uint64_t)n);
            ok = cpar_store_get(ctx->store, key, val, sizeof val - 1, &len) == CPAR_OK;
            val[ok ? len : 0] = 0;
            ok = ok && sscanf(val, "%llu %n", &a, &off) == 1;
        }
        snprintf(cpar__tls_err, sizeof cpar__tls_err, "%s", keep);
        if (!ok) return false;
        *at = a, *count = (uint64_t)n;
        snprintf(msg, cap, "%s", val + off);
        return true;
    }
    cpar__job *job = ctx->job;
    if (!job || !atomic_load(&job->any_gave_up)) return false;
    bool found = false;
    pthread_mutex_lock(&job->mu);
    for (const cpar__gave_up *e = job->gave_up; e && !found; e = e->next)
        if (e->uid == g->uid && e->world_rank == wr) {
            *at = e->at, *count = e->count;
            snprintf(msg, cap, "%s", e->msg);
            found = true;
        }
    pthread_mutex_unlock(&job->mu);
    return found;
}

/* A member of one of ctx's NCCL groups gave up on a batch this rank has
 * enqueued (and more often than this rank did): CPAR_ERR_PEER naming it and
 * its message. Across processes the store is asked at most every 20 ms
 * unless forced (an NCCL error is being explained: the give-up is its root
 * cause, a peer's abort on learning of it only a consequence). */
static cpar_status cpar__nccl_gave_up_check(cpar_ctx *ctx, const char *fn, bool force) {
    if (ctx->store) {
        const int64_t now = cpar__now_ms();
        if (now < ctx->gave_up_poll_ms && !force) return CPAR_OK;
        ctx->gave_up_poll_ms = now + 20;
        char keep[CPAR_ERR_LEN];
        snprintf(keep, sizeof keep, "%s", cpar__tls_err); /* a failed poll must not replace the caller's error */
        int64_t any = 0;
        const bool asked = cpar_store_add(ctx->store, CPAR__GAVE_UP_ANY, 0, &any) == CPAR_OK;
        snprintf(cpar__tls_err, sizeof cpar__tls_err, "%s", keep);
        if (!asked || any == 0) return CPAR_OK;
    } else if (!ctx->job) {
        return CPAR_OK;
    }
    char msg[CPAR_ERR_LEN];
    for (cpar_group *g = ctx->groups; g; g = g->next) {
        if (!g->nccl || g->size < 2 || g->seq == 0) continue;
        for (int m = 0; m < g->size; m++) {
            uint64_t at, count;
            if (m == g->rank || !cpar__nccl_gave_up_read(ctx, g, g->world_ranks[m], &at, &count, msg, sizeof msg))
                continue;
            if (count > g->gave_ups && at <= g->seq)
                return cpar__fail(ctx, CPAR_ERR_PEER, "%s: rank %d gave up on this collective (a call this rank joined), "
                                  "failing its own checks: %.400s", fn, g->world_ranks[m], msg);
        }
    }
    return CPAR_OK;
}

/* ---- An abort across processes ----
 * Between threads the job records a rank's abort and its cause, and a peer
 * whose NCCL call then fails on the aborted communicators names that cause
 * (cpar__nccl_wait, cpar__comm_errors_named). Between processes the store
 * does: cpar__abort_why publishes "rank N <why>" under the order of its
 * claim (several ranks may abort at once, and the first to claim need not be
 * the first to finish writing), then marks it ready; a peer reads the
 * earliest ready one only once NCCL has failed, so no healthy call pays a
 * round trip. */
#define CPAR__ABORTED_CLAIM "cpar/aborted/claim"

static void cpar__nccl_abort_key(char *key, size_t cap, const char *what, int64_t n) {
    snprintf(key, cap, "cpar/aborted/%s/%lld", what, (long long)n);
}

static void cpar__nccl_abort_publish(cpar_ctx *ctx, const char *msg) {
    if (!ctx->store) return;
    char keep[CPAR_ERR_LEN], val[CPAR_ERR_LEN + 16], key[64];
    snprintf(keep, sizeof keep, "%s", cpar__tls_err); /* a failed store call must not replace the cause */
    const int len = snprintf(val, sizeof val, "%d %s", ctx->rank, msg);
    int64_t n = 0, one = 0;
    if (cpar_store_add(ctx->store, CPAR__ABORTED_CLAIM, 1, &n) == CPAR_OK) {
        cpar__nccl_abort_key(key, sizeof key, "msg", n);
        if (cpar_store_set(ctx->store, key, val, (size_t)len + 1) == CPAR_OK) {
            cpar__nccl_abort_key(key, sizeof key, "ready", n); /* readers look for the message after this */
            (void)cpar_store_add(ctx->store, key, 1, &one);
        }
    }
    snprintf(cpar__tls_err, sizeof cpar__tls_err, "%s", keep);
}

/* Another process's published abort ("rank N <why>"), the earliest ready
 * one, into msg: false when there is none but this rank's own, or the store
 * cannot say. */
static bool cpar__nccl_abort_read(cpar_ctx *ctx, char *msg, size_t cap) {
    if (!ctx->store) return false;
    char keep[CPAR_ERR_LEN], val[CPAR_ERR_LEN + 16], key[64];
    snprintf(keep, sizeof keep, "%s", cpar__tls_err);
    int64_t claims = 0;
    bool found = false;
    if (cpar_store_add(ctx->store, CPAR__ABORTED_CLAIM, 0, &claims) == CPAR_OK)
        for (int64_t n = 1; n <= claims && !found; n++) {
            int64_t ready = 0;
            size_t len = 0;
            int who = -1, off = 0;
            cpar__nccl_abort_key(key, sizeof key, "ready", n);
            if (cpar_store_add(ctx->store, key, 0, &ready) != CPAR_OK) break;
            if (ready == 0) continue;
            cpar__nccl_abort_key(key, sizeof key, "msg", n);
            if (cpar_store_get(ctx->store, key, val, sizeof val - 1, &len) != CPAR_OK) break;
            val[len] = 0;
            if (sscanf(val, "%d %n", &who, &off) == 1 && who != ctx->rank) {
                snprintf(msg, cap, "%s", val + off);
                found = true;
            }
        }
    snprintf(cpar__tls_err, sizeof cpar__tls_err, "%s", keep);
    return found;
}

/* Poll *comm until the operation `call` (r: what it returned) settles. On a
 * failure, a failed peer (single-process jobs) or the deadline, *comm is
 * aborted so no rank hangs in a kernel. `what` (or NULL) says what was
 * waited for, e.g. "the send to rank 1": NCCL cannot tell which peer a
 * collective waits for, but cpar knows for point-to-point. g is the group
 * the call runs on (NULL while its communicator is being made). */
static cpar_status cpar__nccl_wait(cpar_ctx *ctx, const cpar_group *g, const char *fn, const char *call,
                                   const char *what, ncclComm_t *comm, ncclResult_t r) {
    int64_t deadline = cpar__now_ms() + ctx->timeout_ms;
    /* A call's ncclSuccess does not mean its communicator is ready: NCCL's
     * non-blocking ncclCommSplit returns ncclSuccess with the parent still in
     * progress (seen on an H200 with NCCL 2.28). The state says. */
    if (r == ncclSuccess && *comm) {
        ncclResult_t q = ncclCommGetAsyncError(*comm, &r);
        if (q != ncclSuccess) r = q;
    }
    for (;;) {
        /* In a single-process job a failed rank is the cause, whatever NCCL
         * reports: its peers' aborts follow from it. */
        if (r != ncclSuccess && ctx->job && ctx->job->failed) {
            cpar__nccl_abort(comm);
            return cpar__fail(ctx, CPAR_ERR_PEER, "%s: rank %d failed (%s); NCCL communicator aborted", fn,
                              ctx->job->failed_rank, cpar_status_string(ctx->job->failed_status));
        }
        if (r != ncclInProgress) break;
        cpar_status gave = cpar__nccl_gave_up_check(ctx, fn, false);
        if (gave != CPAR_OK) {
            cpar__nccl_abort(comm);
            return gave;
        }
        if (cpar__now_ms() > deadline) {
            /* The job learns of the timeout before the abort can reach a
             * peer, so a peer that sees the abort blames this rank's timeout
             * (CPAR_ERR_PEER) rather than reporting an NCCL error first. */
            if (ctx->job) cpar__job_fail(ctx->job, ctx->rank, CPAR_ERR_TIMEOUT);
            cpar__nccl_abort(comm);
            return cpar__fail(ctx, CPAR_ERR_TIMEOUT, "%s: %.*s%s%s%s still in progress after %d ms; communicator "
                              "aborted", fn, cpar__nccl_name_len(call), call, what ? " (" : "", what ? what : "",
                              what ? ")" : "", ctx->timeout_ms);
        }
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
        ncclResult_t q = ncclCommGetAsyncError(*comm, &r);
        if (q != ncclSuccess) r = q;
    }
    if (r == ncclSuccess) {
        /* Queued: it runs when its stream gets there (a wait names it). */
        snprintf(ctx->last_comm, sizeof ctx->last_comm, "%s's %.*s%s%s%s", fn, cpar__nccl_name_len(call), call,
                 what ? " (" : "", what ? what : "", what ? ")" : "");
        return CPAR_OK;
    }
    cpar_status st = r == ncclRemoteError ? cpar__nccl_gave_up_check(ctx, fn, true) : CPAR_OK;
    if (st != CPAR_OK) {
        cpar__nccl_abort(comm);
        return st;
    }
    char why[CPAR_ERR_LEN];
    if (cpar__nccl_abort_read(ctx, why, sizeof why)) { /* processes: a peer's abort is the cause */
        cpar__nccl_abort(comm);
        return cpar__fail(ctx, CPAR_ERR_PEER, "%s: %.480s; NCCL communicator aborted", fn, why);
    }
    int gone = r == ncclRemoteError ? cpar__nccl_exited_member(ctx, g) : -1;
    if (gone >= 0) { /* as on the host backend: name the rank that left, for every peer */
        st = cpar__fail(ctx, CPAR_ERR_PEER, "%s: rank %d returned from its function without joining %s", fn, gone,
                        what ? what : "the collective");
        cpar__job_fail_why(ctx->job, gone, CPAR_ERR_PEER, true, ctx->err);
    } else {
        st = cpar__nccl_fail(ctx, fn, call, r);
    }
    cpar__nccl_abort(comm);
    return st;
}

/* Issue `call` on g's communicator *pcomm and wait for it (see above). */
#define CPAR_NCCL_TRY(g, fn, what, pcomm, call)                                                              \
    do {                                                                                                     \
        ncclResult_t r_ = (call);                                                                            \
        CPAR_TRY(cpar__nccl_wait((g)->ctx, (g), (fn), #call, (what), (pcomm), r_));                          \
    } while (0)

/* The calls inside ncclGroupStart/End: the first failure is kept while the
 * group still ends (NCCL needs the end), then reported naming that call. */
typedef struct cpar__nccl_group {
    ncclResult_t r;
    const char *call;
} cpar__nccl_group;
#define CPAR_NCCL_GROUP_CALL(grp, expr)                                                                      \
    do {                                                                                                     \
        ncclResult_t r_ = (expr);                                                                            \
        if (r_ != ncclSuccess && r_ != ncclInProgress && (grp).r == ncclSuccess) (grp).r = r_, (grp).call = #expr; \
    } while (0)
static cpar_status cpar__nccl_wait(cpar_ctx *ctx, const cpar_group *g, const char *fn, const char *call,
                                   const char *what, ncclComm_t *comm, ncclResult_t r);
static cpar_status cpar__nccl_group_end(cpar_group *g, const char *fn, const char *what, ncclComm_t *pc,
                                        cpar__nccl_group grp) {
    ncclResult_t r = ncclGroupEnd();
    if (grp.r != ncclSuccess) return cpar__nccl_wait(g->ctx, g, fn, grp.call, what, pc, grp.r);
    return cpar__nccl_wait(g->ctx, g, fn, "ncclGroupEnd()", what, pc, r);
}

/* Does g communicate through NCCL? (Its communicator may since have been
 * aborted: cpar__nccl_comm says so.) */
static bool cpar__group_is_nccl(const cpar_group *g) { return g->ctx->backend == CPAR_BACKEND_NCCL; }

/* g's communicator, or the reason it has none: an earlier failure or
 * cpar_abort aborted it. */
static cpar_status cpar__nccl_comm(cpar_group *g, const char *fn, ncclComm_t **out) {
    if (!g->nccl)
        return cpar__fail(g->ctx, CPAR_ERR_PEER, "%s: the group's NCCL communicator was aborted (an earlier failure "
                          "or cpar_abort); the job cannot continue", fn);
    *out = &g->nccl;
    return CPAR_OK;
}

static ncclConfig_t cpar__nccl_config(void) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0; /* every call returns; cpar polls with a deadline */
    return cfg;
}

static cpar_status cpar__nccl_comm_init(cpar_ctx *ctx, const char *fn, const void *id128, ncclComm_t *out) {
    ncclUniqueId id;
    memcpy(&id, id128, sizeof id);
    ncclConfig_t cfg = cpar__nccl_config();
    ncclResult_t r = ncclCommInitRankConfig(out, ctx->world, id, ctx->rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        cpar_status st = cpar__nccl_fail(ctx, fn, "ncclCommInitRankConfig", r);
        cpar__nccl_abort(out);
        return st;
    }
    return cpar__nccl_wait(ctx, NULL, fn, "ncclCommInitRankConfig", "every rank to join", out, r);
}

/* NCCL's non-blocking split completes on the parent: *out stays NULL until
 * the parent's state leaves ncclInProgress, whatever the call returned
 * (cpar__nccl_wait asks the state). */
static cpar_status cpar__nccl_split(cpar_group *parent, const char *fn, int color, int key, ncclComm_t *out) {
    ncclConfig_t cfg = cpar__nccl_config();
    ncclComm_t *pc = NULL;
    *out = NULL;
    CPAR_TRY(cpar__nccl_comm(parent, fn, &pc));
    ncclResult_t r = ncclCommSplit(*pc, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, out, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        cpar_status st = cpar__nccl_fail(parent->ctx, fn, "ncclCommSplit", r);
        cpar__nccl_abort(pc);
        return st;
    }
    CPAR_TRY(cpar__nccl_wait(parent->ctx, parent, fn, "ncclCommSplit", NULL, pc, r));
    /* The new communicator is non-blocking too: it is ready when its own
     * state leaves ncclInProgress, which NCCL does not promise by the
     * parent's. */
    if (color < 0) return CPAR_OK;
    if (!*out)
        return cpar__fail(parent->ctx, CPAR_ERR_NCCL, "%s: ncclCommSplit settled on the parent without a new "
                          "communicator (color %d)", fn, color);
    ncclResult_t state = ncclInProgress;
    if (ncclCommGetAsyncError(*out, &state) != ncclSuccess) state = ncclInternalError;
    return cpar__nccl_wait(parent->ctx, parent, fn, "ncclCommSplit (the new communicator)", NULL, out, state);
}

static void cpar__nccl_destroy(ncclComm_t comm, bool aborted) {
    if (!comm) return;
    if (aborted) {
        ncclCommAbort(comm);
        return;
    }
    ncclResult_t r = ncclCommFinalize(comm);
    ncclResult_t state = r;
    int64_t deadline = cpar__now_ms() + 10000;
    while (state == ncclInProgress && cpar__now_ms() < deadline) {
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
        if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
    }
    if (state == ncclSuccess) ncclCommDestroy(comm);
    else ncclCommAbort(comm);
}

/* CPAR_CHECK_CALLS=1 (every rank): the members' descriptions of each NCCL
 * collective (the public call's tag, kind, dtype, op, root, counts, sizes
 * and splits) are all-gathered and compared as the host backends compare
 * their slots (cpar__slots_validate), before the collective is enqueued:
 * a disagreement is CPAR_ERR_INVALID on every rank, naming both ranks'
 * calls. It costs an all-gather and a host round trip per collective (as
 * TORCH_DISTRIBUTED_DEBUG=DETAIL does), so it is off by default. */
static cpar_status cpar__nccl_validate(cpar_group *g, const char *fn, const cpar__slot *c, ncclComm_t *pc) {
    cpar_ctx *ctx = g->ctx;
    const int n = g->size;
    const size_t wire = sizeof(cpar__pc_desc) + 3 * (size_t)n * sizeof(int64_t);
    char *host = malloc(wire * (size_t)(n + 1) + (size_t)n * sizeof(cpar__slot));
    if (!host) return cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate %zu bytes to compare the call", fn, wire * n);
    cpar__pc_desc *mine = (cpar__pc_desc *)(void *)host;
    memset(host, 0, wire);
    *mine = (cpar__pc_desc){.kind = c->kind, .dtype = c->dtype, .op = c->op, .root = c->root,
                            .has_sizes = c->sizes != NULL, .rows = c->rows, .row_elems = c->row_elems, .tag = c->tag};
    memcpy(mine->tag_text, c->tag_text, sizeof mine->tag_text);
    int64_t *arrays = (int64_t *)(void *)(host + sizeof *mine);
    for (int r = 0; r < n; r++) {
        arrays[r] = c->sizes ? c->sizes[r] : 0;
        arrays[n + r] = c->in_splits ? c->in_splits[r] : 0;
        arrays[2 * n + r] = c->out_splits ? c->out_splits[r] : 0;
    }
    cpar_status st = cpar__grow_buffer(ctx, fn, &ctx->coll_ws, &ctx->coll_ws_bytes, wire * (size_t)(n + 1));
    char *ws = ctx->coll_ws, *all = host + wire;
    if (st == CPAR_OK && (st = cpar_dev_memcpy(ws, host, wire, CPAR_COPY_H2D, ctx->compute)) != CPAR_OK)
        st = cpar__dev_fail(ctx, st, fn);
    if (st == CPAR_OK) {
        g->seq++;
        st = cpar__nccl_wait(ctx, g, fn, "ncclAllGather", "the members' calls, to compare them", pc,
                             ncclAllGather(ws, ws + wire, wire, ncclUint8, *pc, (cudaStream_t)ctx->compute));
    }
    if (st == CPAR_OK) st = cpar__copy_bytes(ctx, fn, all, CPAR_HOST, ws + wire, ctx->device, wire * (size_t)n);
    if (st == CPAR_OK) {
        cpar__slot *sl = (cpar__slot *)(void *)(all + wire * (size_t)n);
        for (int m = 0; m < n; m++) {
            const cpar__pc_desc *d = (const cpar__pc_desc *)(const void *)(all + wire * (size_t)m);
            const int64_t *a = (const int64_t *)(const void *)(all + wire * (size_t)m + sizeof *d);
            sl[m] = (cpar__slot){.kind = d->kind, .dtype = (cpar_dtype)d->dtype, .op = d->op, .root = d->root,
                                 .rows = d->rows, .row_elems = d->row_elems, .sizes = d->has_sizes ? a : NULL,
                                 .in_splits = a + n, .out_splits = a + 2 * n, .tag = d->tag};
            memcpy(sl[m].tag_text, d->tag_text, sizeof sl[m].tag_text);
        }
        st = cpar__slots_validate(g, fn, sl);
    }
    free(host);
    return st;
}

/* Enqueue one collective described by the caller's slot on the collectives'
 * stream (cpar__coll_stream: compute unless a caller switched to comm). */
static cpar_status cpar__nccl_collective(cpar_group *g, const char *fn, const cpar__slot *c) {
    cpar_ctx *ctx = g->ctx;
    ncclComm_t *pc = NULL;
    CPAR_TRY(cpar__nccl_comm(g, fn, &pc));
    if (ctx->check_calls && g->size > 1) CPAR_TRY(cpar__nccl_validate(g, fn, c, pc));
    g->seq++;
    ncclComm_t comm = *pc;
    cudaStream_t s = (cudaStream_t)cpar__coll_stream(ctx);
    ncclDataType_t dt = cpar__nccl_dtype(c->dtype);
    size_t es = cpar_dtype_size(c->dtype), row = (size_t)c->row_elems * es;
    int n = g->size, me = g->rank;
    switch (c->kind) {
    case CPAR_COLL_ALL_REDUCE:
        CPAR_NCCL_TRY(g, fn, NULL, pc, ncclAllReduce(c->in, c->out, (size_t)(c->rows * c->row_elems), dt,
                                                    cpar__nccl_op((cpar_reduce_op)c->op), comm, s));
        return CPAR_OK;
    case CPAR_COLL_BROADCAST:
        CPAR_NCCL_TRY(g, fn, NULL, pc, ncclBroadcast(c->in, c->out, (size_t)(c->rows * c->row_elems), dt, c->root, comm, s));
        return CPAR_OK;
    case CPAR_COLL_ALL_GATHER:
        if (!c->sizes) {
            CPAR_NCCL_TRY(g, fn, NULL, pc, ncclAllGather(c->in, c->out, (size_t)(c->rows * c->row_elems), dt, comm, s));
            return CPAR_OK;
        }
        { /* Uneven: every rank broadcasts its rows into its place, in one group call. */
            CPAR_NCCL_TRY(g, fn, NULL, pc, ncclGroupStart());
            cpar__nccl_group grp = {ncclSuccess, NULL};
            for (int64_t r = 0, off = 0; r < n; off += c->sizes[r], r++) {
                char *dst = (char *)c->out + (size_t)off * row;
                CPAR_NCCL_GROUP_CALL(grp, ncclBroadcast(r == me ? c->in : dst, dst,
                                                        (size_t)(c->sizes[r] * c->row_elems), dt, (int)r, comm, s));
            }
            return cpar__nccl_group_end(g, fn, NULL, pc, grp);
        }
    case CPAR_COLL_REDUCE_SCATTER:
        if (!c->sizes) {
            CPAR_NCCL_TRY(g, fn, NULL, pc, ncclReduceScatter(c->in, c->out, (size_t)(c->rows / n * c->row_elems), dt,
                                                            cpar__nccl_op((cpar_reduce_op)c->op), comm, s));
            return CPAR_OK;
        }
        { /* Uneven: one reduce per rank, rooted at the owner of the rows. */
            CPAR_NCCL_TRY(g, fn, NULL, pc, ncclGroupStart());
            cpar__nccl_group grp = {ncclSuccess, NULL};
            for (int64_t r = 0, off = 0; r < n; off += c->sizes[r], r++) {
                const char *src = (const char *)c->in + (size_t)off * row;
                CPAR_NCCL_GROUP_CALL(grp, ncclReduce(src, r == me ? c->out : (void *)src,
                                                     (size_t)(c->sizes[r] * c->row_elems), dt,
                                                     cpar__nccl_op((cpar_reduce_op)c->op), (int)r, comm, s));
            }
            return cpar__nccl_group_end(g, fn, NULL, pc, grp);
        }
    case CPAR_COLL_ALL_TO_ALL: {
        CPAR_NCCL_TRY(g, fn, NULL, pc, ncclGroupStart());
        cpar__nccl_group grp = {ncclSuccess, NULL};
        size_t soff = 0, roff = 0;
        for (int r = 0; r < n; r++) {
            size_t sb = (size_t)c->in_splits[r] * row, rb = (size_t)c->out_splits[r] * row;
            if (sb) CPAR_NCCL_GROUP_CALL(grp, ncclSend((const char *)c->in + soff, sb, ncclUint8, r, comm, s));
            if (rb) CPAR_NCCL_GROUP_CALL(grp, ncclRecv((char *)c->out + roff, rb, ncclUint8, r, comm, s));
            soff += sb;
            roff += rb;
        }
        return cpar__nccl_group_end(g, fn, NULL, pc, grp);
    }
    default: return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: unknown collective kind %d", fn, c->kind);
    }
}

/* Typed: NCCL is given the dtype and element count (not bytes), so where
 * NCCL checks a pair (the NCCL simulator does; NCCL itself checks neither)
 * a dtype or count mismatch fails on both sides. */
static cpar_status cpar__nccl_sendrecv(cpar_group *g, const char *fn, const void *send, cpar_dtype send_dt,
                                       int64_t send_numel, int to, void *recv, cpar_dtype recv_dt, int64_t recv_numel,
                                       int from) {
    cpar_ctx *ctx = g->ctx;
    cudaStream_t s = (cudaStream_t)cpar__coll_stream(ctx);
    ncclComm_t *pc = NULL;
    CPAR_TRY(cpar__nccl_comm(g, fn, &pc));
    g->seq++;
    char what[96];
    int n = 0;
    if (to >= 0) n += snprintf(what + n, sizeof what - (size_t)n, "the send to rank %d", g->world_ranks[to]);
    if (from >= 0)
        snprintf(what + n, sizeof what - (size_t)n, "%sthe receive from rank %d", n ? " and " : "",
                 g->world_ranks[from]);
    CPAR_NCCL_TRY(g, fn, what, pc, ncclGroupStart());
    cpar__nccl_group grp = {ncclSuccess, NULL};
    if (to >= 0) CPAR_NCCL_GROUP_CALL(grp, ncclSend(send, (size_t)send_numel, cpar__nccl_dtype(send_dt), to, *pc, s));
    if (from >= 0)
        CPAR_NCCL_GROUP_CALL(grp, ncclRecv(recv, (size_t)recv_numel, cpar__nccl_dtype(recv_dt), from, *pc, s));
    return cpar__nccl_group_end(g, fn, what, pc, grp);
}

/* Poll every communicator of ctx for asynchronous errors (a peer died). */
static cpar_status cpar__nccl_check(cpar_ctx *ctx, const char *fn) {
    for (cpar_group *g = ctx->groups; g; g = g->next) {
        ncclResult_t state = ncclSuccess;
        if (!g->nccl || ncclCommGetAsyncError(g->nccl, &state) != ncclSuccess) continue;
        if (state != ncclSuccess && state != ncclInProgress) {
            char note[sizeof ctx->last_comm + 40];
            snprintf(note, sizeof note, "the last communication queued: %s", ctx->last_comm);
            cpar_status st = state == ncclRemoteError ? cpar__nccl_gave_up_check(ctx, fn, true) : CPAR_OK;
            const int gone = st == CPAR_OK && state == ncclRemoteError ? cpar__nccl_exited_member(ctx, g) : -1;
            if (gone >= 0) { /* as cpar__nccl_wait says it: the rank that left is the cause, for every peer */
                st = cpar__fail(ctx, CPAR_ERR_PEER, "%s: rank %d returned from its function without joining the "
                                "collective%s%s%s", fn, gone, *ctx->last_comm ? " (" : "", *ctx->last_comm ? note : "",
                                *ctx->last_comm ? ")" : "");
                /* not as a root cause: this message, which names the call, stays this rank's */
                cpar__job_fail_why(ctx->job, gone, CPAR_ERR_PEER, false, ctx->err);
            } else if (st == CPAR_OK) {
                st = cpar__nccl_fail_note(ctx, fn, "ncclCommGetAsyncError", state, *ctx->last_comm ? note : NULL);
            }
            cpar__nccl_abort(&g->nccl);
            return st;
        }
    }
    return CPAR_OK;
}
#endif /* CPAR_WITH_NCCL */

/* ==== 10. Groups =========================================================
 * A group is a rank's handle on a communicator: its rank, size and world
 * ranks, the backend's shared state, and its communication statistics.
 * Split is collective over the parent; on the host backend the members
 * exchange (color, key) and the new group's first member publishes the
 * shared state; on NCCL it is ncclCommSplit. Uses: 1-3, 8, 9. */

static cpar_status cpar__group_new(cpar_ctx *ctx, const char *fn, int rank, int size, const int *world_ranks,
                                   cpar_group **out) {
    cpar_group *g = calloc(1, sizeof *g);
    int *wr = malloc((size_t)size * sizeof *wr);
    int64_t *splits = malloc(2 * (size_t)size * sizeof *splits);
    if (!g || !wr || !splits) {
        free(g);
        free(wr);
        free(splits);
        return cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate a group of %d ranks", fn, size);
    }
    memcpy(wr, world_ranks, (size_t)size * sizeof *wr);
    g->ctx = ctx;
    g->rank = rank;
    g->size = size;
    g->world_ranks = wr;
    g->splits = splits;
    g->uid = 1; /* the world's; a split sets its child's */
    g->next = ctx->groups;
    ctx->groups = g;
    *out = g;
    return CPAR_OK;
}

static void cpar__group_free(cpar_group *g) {
    cpar_ctx *ctx = g->ctx;
    if (g->cp_inner) cpar__group_free(g->cp_inner); /* each clears its parent's pointer */
    if (g->cp_outer) cpar__group_free(g->cp_outer);
    if (g->cp_parent) {
        cpar_group *p = g->cp_parent;
        if (p->cp_inner == g) p->cp_inner = NULL;
        if (p->cp_outer == g) p->cp_outer = NULL;
    }
    for (cpar_group **p = &ctx->groups; *p; p = &(*p)->next)
        if (*p == g) {
            *p = g->next;
            break;
        }
    for (int k = 0; k < CPAR_GROUP_KIND_COUNT; k++)
        if (ctx->grid[k] == g) ctx->grid[k] = NULL;
    if (ctx->world_group == g) ctx->world_group = NULL;
    cpar__hcomm_release(g->hc);
    cpar__pc_close(g);
#ifdef CPAR_WITH_NCCL
    cpar__nccl_destroy(g->nccl, ctx->aborted || (ctx->job && ctx->job->failed));
#endif
    free(g->world_ranks);
    free(g->splits);
    free(g);
}

static cpar_status cpar__check_group(const cpar_group *g, const char *fn) {
    if (!g) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: group is NULL", fn);
    return CPAR_OK;
}

cpar_group *cpar_world_group(cpar_ctx *ctx) { return ctx ? ctx->world_group : NULL; }
int cpar_group_rank(const cpar_group *g) { return g ? g->rank : -1; }
int cpar_group_size(const cpar_group *g) { return g ? g->size : 0; }
int cpar_group_world_rank(const cpar_group *g, int r) { return g && r >= 0 && r < g->size ? g->world_ranks[r] : -1; }
cpar_ctx *cpar_group_ctx(const cpar_group *g) { return g ? g->ctx : NULL; }

typedef struct cpar__color_key {
    int color, key, parent_rank;
} cpar__color_key;

/* h with a and b mixed in (two splitmix64 steps): a split child's name from
 * its parent's, the split's number and the color, alike on every member. */
static uint64_t cpar__mix2(uint64_t h, uint64_t a, uint64_t b) {
    const uint64_t parts[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        h += parts[i] + 0x9e3779b97f4a7c15ull;
        h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
        h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
        h ^= h >> 31;
    }
    return h;
}

static int cpar__color_key_cmp(const void *a, const void *b) {
    const cpar__color_key *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return (x->parent_rank > y->parent_rank) - (x->parent_rank < y->parent_rank);
}

/* The parent's (color, key) of every member, in parent rank order. */
static cpar_status cpar__split_exchange(cpar_group *parent, const char *fn, const cpar__color_key *mine,
                                        cpar__color_key *all) {
#ifdef CPAR_WITH_NCCL
    if (cpar__group_is_nccl(parent)) {
        cpar_ctx *ctx = parent->ctx;
        size_t bytes = sizeof *mine;
        ncclComm_t *pc = NULL;
        CPAR_TRY(cpar__nccl_comm(parent, fn, &pc));
        /* Device scratch apart from the workspace, which callers may hold. */
        CPAR_TRY(cpar__grow_buffer(ctx, fn, &ctx->coll_ws, &ctx->coll_ws_bytes, bytes * (size_t)(parent->size + 1)));
        char *ws = ctx->coll_ws, *d_all = ws + bytes;
        CPAR_DEV_TRY(ctx, fn, cpar_dev_memcpy(ws, mine, bytes, CPAR_COPY_H2D, ctx->compute));
        parent->seq++;
        CPAR_NCCL_TRY(parent, fn, NULL, pc, ncclAllGather(ws, d_all, bytes, ncclUint8, *pc, (cudaStream_t)ctx->compute));
        return cpar__copy_bytes(ctx, fn, all, CPAR_HOST, d_all, ctx->device, bytes * (size_t)parent->size);
    }
#endif
    return cpar__hc_exchange(parent, fn, mine, sizeof *mine, all);
}

cpar_status cpar_group_split(cpar_group *parent, int color, int key, cpar_group **out) {
    static const char fn[] = "cpar_group_split";
    CPAR_TRY(cpar__check_group(parent, fn));
    cpar__coll_pending(parent, fn);
    const uint32_t split_no = parent->nsplits++; /* every member counts every split: the child's uid */
    cpar_ctx *ctx = parent->ctx;
    if (!out) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    *out = NULL;
    if (color < CPAR_SPLIT_NOCOLOR)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: color is %d, expected >= 0 or CPAR_SPLIT_NOCOLOR", fn, color);
    int n = parent->size;
    cpar__color_key mine = {color, key, parent->rank}, *all = malloc((size_t)n * sizeof *all);
    int *wr = malloc((size_t)n * sizeof *wr);
    cpar_status st = CPAR_OK;
    if (!all || !wr) {
        st = cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate %d entries", fn, n);
        goto done;
    }
    CPAR_TRY_GOTO(cpar__split_exchange(parent, fn, &mine, all), st, done);
    /* Members of my color ordered by (key, parent rank). */
    int size = 0, rank = -1;
    cpar__color_key *mem = all; /* compacted in place: entries of other colors are not needed again */
    for (int i = 0; i < n; i++)
        if (color >= 0 && all[i].color == color) mem[size++] = all[i];
    qsort(mem, (size_t)size, sizeof *mem, cpar__color_key_cmp);
    for (int i = 0; i < size; i++) {
        wr[i] = parent->world_ranks[mem[i].parent_rank];
        if (mem[i].parent_rank == parent->rank) rank = i;
    }
#ifdef CPAR_WITH_NCCL
    if (cpar__group_is_nccl(parent)) {
        ncclComm_t comm = NULL;
        CPAR_TRY_GOTO(cpar__nccl_split(parent, fn, color, key, &comm), st, done);
        if (color >= 0) {
            st = cpar__group_new(ctx, fn, rank, size, wr, out);
            if (st != CPAR_OK) cpar__nccl_destroy(comm, false);
            else (*out)->nccl = comm;
        }
        goto done;
    }
#endif
    if (parent->pc) {
        /* Ranks as processes: each new group's first member makes its segment
         * and the names travel through the parent (an exchange every parent
         * member joins); after a second exchange, when every member has
         * mapped its segment, the creators unlink them. The key (parent's,
         * split count, color) is the same on every member. */
        uint64_t key = cpar__mix2(parent->pc->key, split_no, (uint64_t)(uint32_t)color);
        char text[CPAR__PC_NAME] = "", *names = malloc((size_t)n * CPAR__PC_NAME);
        if (!names) {
            st = cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate %d names", fn, n);
            goto done;
        }
        if (color >= 0 && (st = cpar__group_new(ctx, fn, rank, size, wr, out)) == CPAR_OK &&
            (st = cpar__pc_new(*out, fn, key)) == CPAR_OK && size > 1 && rank == 0)
            st = cpar__pc_create(*out, fn, ctx->store->token, text);
        if (st != CPAR_OK && rank == 0 && text[0] != '!') snprintf(text, sizeof text, "!%.90s", ctx->err);
        cpar_status xs = cpar__hc_exchange(parent, fn, text, sizeof text, names);
        if (st == CPAR_OK) st = xs;
        if (st == CPAR_OK && color >= 0 && size > 1 && rank != 0) {
            char *lead = names + (size_t)mem[0].parent_rank * CPAR__PC_NAME;
            lead[CPAR__PC_NAME - 1] = 0;
            st = cpar__pc_map(*out, fn, lead);
        }
        char ok = st == CPAR_OK, *oks = names; /* the names are no longer needed */
        xs = cpar__hc_exchange(parent, fn, &ok, 1, oks);
        if (rank == 0 && *out && (*out)->pc && (*out)->pc->base) shm_unlink(text);
        if (st == CPAR_OK) st = xs;
        free(names);
        if (st != CPAR_OK && *out) {
            cpar__group_free(*out);
            *out = NULL;
        }
        goto done;
    }
    {
        /* The new group's rank 0 creates the shared state and publishes it. */
        cpar__hcomm *hc = NULL;
        if (rank == 0) {
            hc = cpar__hcomm_create(parent->hc->job, size, wr);
            if (!hc) st = cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate the group state", fn);
        }
        uint64_t ptrs_mine = (uint64_t)(uintptr_t)hc, *ptrs = malloc((size_t)n * sizeof *ptrs);
        if (!ptrs) {
            cpar__hcomm_release(hc);
            st = cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate %d entries", fn, n);
            goto done;
        }
        /* Exchange even after a local failure so the peers are not left waiting. */
        cpar_status xs = cpar__hc_exchange(parent, fn, &ptrs_mine, sizeof ptrs_mine, ptrs);
        if (st == CPAR_OK) st = xs;
        if (st == CPAR_OK && color >= 0) {
            int leader = mem[0].parent_rank;
            hc = (cpar__hcomm *)(uintptr_t)ptrs[leader];
            if (!hc) st = cpar__fail(ctx, CPAR_ERR_PEER, "%s: rank %d could not create the group", fn, wr[0]);
            else if ((st = cpar__group_new(ctx, fn, rank, size, wr, out)) == CPAR_OK) (*out)->hc = hc;
            else cpar__hcomm_release(hc);
        }
        free(ptrs);
    }
done:
    if (st == CPAR_OK && *out) {
        (*out)->uid = cpar__mix2(parent->uid, split_no, (uint64_t)(uint32_t)color);
    }
    if (st == CPAR_OK && *out && cpar__log_level() >= CPAR__LOG_INFO) {
        char list[160];
        size_t used = 0;
        const cpar_group *g = *out;
        for (int i = 0; i < g->size && used < sizeof list - 16; i++)
            used += (size_t)snprintf(list + used, sizeof list - used, "%s%d", i ? "," : "", g->world_ranks[i]);
        if (used >= sizeof list - 16) snprintf(list + used, sizeof list - used, ",...");
        cpar__log(CPAR__LOG_INFO, ctx->rank, "group: split color %d key %d: rank %d of %d, world ranks %s%s", color,
                  key, g->rank, g->size, list, g->ctx->backend == CPAR_BACKEND_NCCL ? " (ncclCommSplit)" : "");
    }
    free(all);
    free(wr);
    return st;
}

cpar_status cpar_group_destroy(cpar_group *g) {
    CPAR_TRY(cpar__check_group(g, "cpar_group_destroy"));
    if (g == g->ctx->world_group)
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "cpar_group_destroy: g is the world group (freed by cpar_finalize)");
    cpar__group_free(g);
    return CPAR_OK;
}

cpar_status cpar_group_stats(const cpar_group *g, cpar_comm_stats *out) {
    CPAR_TRY(cpar__check_group(g, "cpar_group_stats"));
    if (!out) return cpar__fail(g->ctx, CPAR_ERR_INVALID, "cpar_group_stats: out is NULL");
    *out = g->stats;
    /* hierarchical CP's groups move this group's traffic (cpar.h §12) */
    const cpar_group *sub[2] = {g->cp_inner, g->cp_outer};
    for (int i = 0; i < 2; i++)
        for (int k = 0; sub[i] && k < CPAR_COLL_KIND_COUNT; k++) {
            out->kind[k].calls += sub[i]->stats.kind[k].calls;
            out->kind[k].bytes_sent += sub[i]->stats.kind[k].bytes_sent;
            out->kind[k].bytes_recv += sub[i]->stats.kind[k].bytes_recv;
        }
    return CPAR_OK;
}

cpar_status cpar_group_stats_reset(cpar_group *g) {
    CPAR_TRY(cpar__check_group(g, "cpar_group_stats_reset"));
    memset(&g->stats, 0, sizeof g->stats);
    if (g->cp_inner) memset(&g->cp_inner->stats, 0, sizeof g->stats);
    if (g->cp_outer) memset(&g->cp_outer->stats, 0, sizeof g->stats);
    return CPAR_OK;
}

/* ==== 11. Collectives ====================================================
 * The public collectives: argument checks (the same on every backend), the
 * byte accounting of cpar.h §5, then the backend. A group of size 1 is a
 * local copy. Uses: 2-4, 8-10. */

const char *cpar_coll_kind_name(cpar_coll_kind k) {
    static const char *const names[CPAR_COLL_KIND_COUNT] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                                             "broadcast",  "send_recv",  "barrier"};
    return (unsigned)k < CPAR_COLL_KIND_COUNT ? names[k] : "?";
}

static void cpar__count(cpar_group *g, cpar_coll_kind k, uint64_t sent, uint64_t recv) {
    g->stats.kind[k].calls++;
    g->stats.kind[k].bytes_sent += sent;
    g->stats.kind[k].bytes_recv += recv;
}

/* Checks every collective's tensor gets: group, then tensor structure on the
 * context's device, then dtype agreement with the first tensor. */
static cpar_status cpar__coll_tensor(cpar_group *g, const char *fn, const char *name, const cpar_tensor *t,
                                     const cpar_tensor *like) {
    CPAR_TRY(cpar__check_tensor(g->ctx, fn, name, t, g->ctx->device));
    if (like) CPAR_TRY(cpar__check_dtype(g->ctx, fn, name, t, like->dtype));
    return CPAR_OK;
}

static int64_t cpar__row_elems(const cpar_tensor *t) {
    int64_t r = 1;
    for (int i = 1; i < t->ndim; i++) r *= t->shape[i];
    return r;
}

static cpar_status cpar__check_dim0(cpar_group *g, const char *fn, const char *name, const cpar_tensor *t) {
    if (t->ndim >= 1) return CPAR_OK;
    return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: %s is a scalar, expected at least 1 dimension (dim 0 is split)",
                      fn, name);
}

/* Shape of `like` with dim 0 set to rows. */
static void cpar__shape_rows(const cpar_tensor *like, int64_t rows, int64_t *shape) {
    memcpy(shape, like->shape, sizeof like->shape);
    shape[0] = rows;
}

static cpar_status cpar__check_sizes(cpar_group *g, const char *fn, const char *name, const int64_t *sizes,
                                     int64_t *total) {
    *total = 0;
    for (int r = 0; r < g->size; r++) {
        if (sizes[r] < 0)
            return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: %s[%d] is %lld, expected >= 0", fn, name, r,
                              (long long)sizes[r]);
        if (!cpar__add64(*total, sizes[r], total))
            return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: %s add up past INT64_MAX", fn, name);
    }
    return CPAR_OK;
}

/* The local copy of a group of size 1 (or a send to self), on the stream the
 * collectives run on. */
static cpar_status cpar__coll_copy(cpar_group *g, const char *fn, void *dst, int dst_device, const void *src,
                                   int src_device, size_t bytes) {
    return cpar__copy_bytes_on(g->ctx, fn, cpar__coll_stream(g->ctx), dst, dst_device, src, src_device, bytes);
}

static cpar_status cpar__run_collective(cpar_group *g, const char *fn, const cpar__slot *c) {
    cpar__slot t = *c;
    cpar__tag_take(g, &t);
#ifdef CPAR_WITH_NCCL
    if (cpar__group_is_nccl(g)) return cpar__nccl_collective(g, fn, &t);
#endif
    if (g->pc) return cpar__pc_collective(g, fn, &t);
    return cpar__hc_collective(g, fn, &t);
}

static cpar_status cpar__check_op(cpar_group *g, const char *fn, cpar_reduce_op op, const cpar_tensor *t) {
    if ((unsigned)op >= CPAR_REDUCE_OP_COUNT)
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: op is %d, expected CPAR_SUM, CPAR_MAX or CPAR_MIN", fn, (int)op);
    if (t->dtype == CPAR_U8 && op == CPAR_SUM)
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: u8 supports CPAR_MAX and CPAR_MIN, not CPAR_SUM", fn);
    return CPAR_OK;
}

cpar_status cpar_all_reduce(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_reduce_op op) {
    static const char fn[] = "cpar_all_reduce";
    CPAR_TRY(cpar__check_group(g, fn));
    cpar__coll_pending(g, fn);
    CPAR_TRY(cpar__coll_tensor(g, fn, "in", in, NULL));
    CPAR_TRY(cpar__coll_tensor(g, fn, "out", out, in));
    CPAR_TRY(cpar__check_op(g, fn, op, in));
    CPAR_TRY(cpar__check_shape(g->ctx, fn, "out", out, in->shape, in->ndim, "as in"));
    if (out->data != in->data && cpar__ranges_overlap(in->data, cpar_tensor_nbytes(in), out->data, cpar_tensor_nbytes(out)))
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: out partially overlaps in (only out == in is allowed)", fn);
    int n = g->size;
    int64_t numel = cpar_tensor_numel(in), lo, hi;
    size_t es = cpar_dtype_size(in->dtype), bytes = (size_t)numel * es;
    cpar__even_share(numel, n, g->rank, &lo, &hi);
    uint64_t moved = n > 1 ? (uint64_t)(bytes - (size_t)(hi - lo) * es) + (uint64_t)(n - 1) * (uint64_t)(hi - lo) * es : 0;
    cpar__count(g, CPAR_COLL_ALL_REDUCE, moved, moved);
    if (n == 1) return cpar__coll_copy(g, fn, out->data, out->device, in->data, in->device, bytes);
    cpar__slot c = {.kind = CPAR_COLL_ALL_REDUCE, .dtype = in->dtype, .op = op, .rows = numel, .row_elems = 1,
                    .in = in->data, .out = out->data};
    return cpar__run_collective(g, fn, &c);
}

cpar_status cpar_all_gather(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, const int64_t *sizes) {
    static const char fn[] = "cpar_all_gather";
    CPAR_TRY(cpar__check_group(g, fn));
    cpar__coll_pending(g, fn);
    CPAR_TRY(cpar__coll_tensor(g, fn, "in", in, NULL));
    CPAR_TRY(cpar__coll_tensor(g, fn, "out", out, in));
    CPAR_TRY(cpar__check_dim0(g, fn, "in", in));
    int n = g->size;
    int64_t total = 0, want[CPAR_MAX_DIMS];
    if (!sizes && !cpar__mul64(in->shape[0], n, &total))
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: in has %lld rows; %d ranks' rows overflow int64", fn,
                          (long long)in->shape[0], n);
    if (sizes) {
        CPAR_TRY(cpar__check_sizes(g, fn, "sizes", sizes, &total));
        if (in->shape[0] != sizes[g->rank])
            return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: in has %lld rows, expected sizes[%d] = %lld", fn,
                              (long long)in->shape[0], g->rank, (long long)sizes[g->rank]);
    }
    cpar__shape_rows(in, total, want);
    char why[64];
    snprintf(why, sizeof why, "%d ranks' rows along dim 0", n);
    CPAR_TRY(cpar__check_shape(g->ctx, fn, "out", out, want, in->ndim, why));
    if (cpar__ranges_overlap(in->data, cpar_tensor_nbytes(in), out->data, cpar_tensor_nbytes(out)))
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: out overlaps in", fn);
    size_t own = cpar_tensor_nbytes(in);
    cpar__count(g, CPAR_COLL_ALL_GATHER, own * (size_t)(n - 1), cpar_tensor_nbytes(out) - own);
    if (n == 1) return cpar__coll_copy(g, fn, out->data, out->device, in->data, in->device, own);
    cpar__slot c = {.kind = CPAR_COLL_ALL_GATHER, .dtype = in->dtype, .rows = in->shape[0],
                    .row_elems = cpar__row_elems(in), .in = in->data, .out = out->data, .sizes = sizes};
    return cpar__run_collective(g, fn, &c);
}

cpar_status cpar_reduce_scatter(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_reduce_op op,
                                const int64_t *sizes) {
    static const char fn[] = "cpar_reduce_scatter";
    CPAR_TRY(cpar__check_group(g, fn));
    cpar__coll_pending(g, fn);
    CPAR_TRY(cpar__coll_tensor(g, fn, "in", in, NULL));
    CPAR_TRY(cpar__coll_tensor(g, fn, "out", out, in));
    CPAR_TRY(cpar__check_dim0(g, fn, "in", in));
    CPAR_TRY(cpar__check_op(g, fn, op, in));
    int n = g->size;
    int64_t mine, want[CPAR_MAX_DIMS];
    if (sizes) {
        int64_t total;
        CPAR_TRY(cpar__check_sizes(g, fn, "sizes", sizes, &total));
        if (total != in->shape[0])
            return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: sizes add up to %lld, expected in.shape[0] = %lld", fn,
                              (long long)total, (long long)in->shape[0]);
        mine = sizes[g->rank];
    } else {
        if (in->shape[0] % n)
            return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: in.shape[0] = %lld is not divisible by the group size %d",
                              fn, (long long)in->shape[0], n);
        mine = in->shape[0] / n;
    }
    cpar__shape_rows(in, mine, want);
    CPAR_TRY(cpar__check_shape(g->ctx, fn, "out", out, want, in->ndim, "this rank's rows of in"));
    if (cpar__ranges_overlap(in->data, cpar_tensor_nbytes(in), out->data, cpar_tensor_nbytes(out)))
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: out overlaps in", fn);
    size_t own = cpar_tensor_nbytes(out);
    cpar__count(g, CPAR_COLL_REDUCE_SCATTER, cpar_tensor_nbytes(in) - own, own * (size_t)(n - 1));
    if (n == 1) return cpar__coll_copy(g, fn, out->data, out->device, in->data, in->device, own);
    cpar__slot c = {.kind = CPAR_COLL_REDUCE_SCATTER, .dtype = in->dtype, .op = op, .rows = in->shape[0],
                    .row_elems = cpar__row_elems(in), .in = in->data, .out = out->data, .sizes = sizes};
    return cpar__run_collective(g, fn, &c);
}

cpar_status cpar_all_to_all_single(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, const int64_t *out_splits,
                                   const int64_t *in_splits) {
    static const char fn[] = "cpar_all_to_all_single";
    CPAR_TRY(cpar__check_group(g, fn));
    cpar__coll_pending(g, fn);
    CPAR_TRY(cpar__coll_tensor(g, fn, "in", in, NULL));
    CPAR_TRY(cpar__coll_tensor(g, fn, "out", out, in));
    CPAR_TRY(cpar__check_dim0(g, fn, "in", in));
    CPAR_TRY(cpar__check_dim0(g, fn, "out", out));
    int n = g->size;
    int64_t *ins = g->splits, *outs = ins + n, in_total = 0, out_total = 0, want[CPAR_MAX_DIMS];
    cpar_status st = CPAR_OK;
    const char *const names[2] = {"in_splits", "out_splits"};
    const cpar_tensor *ts[2] = {in, out};
    const int64_t *given[2] = {in_splits, out_splits};
    int64_t *use[2] = {ins, outs}, *total[2] = {&in_total, &out_total};
    for (int k = 0; k < 2 && st == CPAR_OK; k++) {
        if (given[k]) {
            st = cpar__check_sizes(g, fn, names[k], given[k], total[k]);
            memcpy(use[k], given[k], (size_t)n * sizeof *ins);
        } else if (ts[k]->shape[0] % n) {
            st = cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: %s.shape[0] = %lld is not divisible by the group size %d "
                            "(pass %s)", fn, k ? "out" : "in", (long long)ts[k]->shape[0], n, names[k]);
        } else {
            for (int r = 0; r < n; r++) use[k][r] = ts[k]->shape[0] / n;
            *total[k] = ts[k]->shape[0];
        }
        if (st == CPAR_OK && *total[k] != ts[k]->shape[0])
            st = cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: %s add up to %lld, expected %s.shape[0] = %lld", fn, names[k],
                            (long long)*total[k], k ? "out" : "in", (long long)ts[k]->shape[0]);
    }
    if (st == CPAR_OK) {
        cpar__shape_rows(in, out_total, want);
        st = cpar__check_shape(g->ctx, fn, "out", out, want, in->ndim, "out_splits rows, other dims as in");
    }
    if (st == CPAR_OK && cpar__ranges_overlap(in->data, cpar_tensor_nbytes(in), out->data, cpar_tensor_nbytes(out)))
        st = cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: out overlaps in", fn);
    if (st == CPAR_OK) {
        size_t row = (size_t)cpar__row_elems(in) * cpar_dtype_size(in->dtype);
        cpar__count(g, CPAR_COLL_ALL_TO_ALL, (size_t)(in_total - ins[g->rank]) * row,
                    (size_t)(out_total - outs[g->rank]) * row);
        if (n == 1) {
            st = cpar__coll_copy(g, fn, out->data, out->device, in->data, in->device, cpar_tensor_nbytes(in));
        } else {
            cpar__slot c = {.kind = CPAR_COLL_ALL_TO_ALL, .dtype = in->dtype, .rows = in->shape[0],
                            .row_elems = cpar__row_elems(in), .in = in->data, .out = out->data,
                            .in_splits = ins, .out_splits = outs};
            st = cpar__run_collective(g, fn, &c);
        }
    }
    return st;
}

cpar_status cpar_broadcast(cpar_group *g, cpar_tensor *buf, int root) {
    static const char fn[] = "cpar_broadcast";
    CPAR_TRY(cpar__check_group(g, fn));
    cpar__coll_pending(g, fn);
    CPAR_TRY(cpar__coll_tensor(g, fn, "buf", buf, NULL));
    int n = g->size;
    if (root < 0 || root >= n)
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: root is %d, expected a group rank in 0..%d", fn, root, n - 1);
    size_t bytes = cpar_tensor_nbytes(buf);
    if (g->rank == root) cpar__count(g, CPAR_COLL_BROADCAST, bytes * (size_t)(n - 1), 0);
    else cpar__count(g, CPAR_COLL_BROADCAST, 0, bytes);
    if (n == 1) return CPAR_OK;
    cpar__slot c = {.kind = CPAR_COLL_BROADCAST, .dtype = buf->dtype, .root = root, .rows = cpar_tensor_numel(buf),
                    .row_elems = 1, .in = buf->data, .out = buf->data};
    return cpar__run_collective(g, fn, &c);
}

/* Send/receive under the calling public function's name. */
static cpar_status cpar__sendrecv(cpar_group *g, const char *fn, const cpar_tensor *send, int send_to, cpar_tensor *recv,
                                  int recv_from) {
    CPAR_TRY(cpar__check_group(g, fn));
    int n = g->size;
    if ((send == NULL) != (send_to < 0) || (recv == NULL) != (recv_from < 0))
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: give a tensor with a peer for each half (send %s with send_to "
                          "%d, recv %s with recv_from %d)", fn, send ? "set" : "NULL", send_to, recv ? "set" : "NULL",
                          recv_from);
    if (send_to >= n)
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: send_to is %d, expected a group rank 0..%d", fn, send_to, n - 1);
    if (recv_from >= n)
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: recv_from is %d, expected a group rank 0..%d", fn, recv_from,
                          n - 1);
    if (send) CPAR_TRY(cpar__coll_tensor(g, fn, "send", send, NULL));
    if (recv) CPAR_TRY(cpar__coll_tensor(g, fn, "recv", recv, NULL));
    if (send && recv && send->data != recv->data &&
        cpar__ranges_overlap(send->data, cpar_tensor_nbytes(send), recv->data, cpar_tensor_nbytes(recv)))
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: recv overlaps send", fn);
    size_t sb = send ? cpar_tensor_nbytes(send) : 0, rb = recv ? cpar_tensor_nbytes(recv) : 0;
    bool self_send = send_to == g->rank, self_recv = recv_from == g->rank;
    if (self_send != self_recv || (self_send && (sb != rb || send->dtype != recv->dtype)))
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: a send to oneself needs a matching receive of the same dtype "
                          "and size", fn);
    if (send && recv && send->data == recv->data && !self_send)
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: send and recv are the same buffer", fn);
    cpar__count(g, CPAR_COLL_SEND_RECV, self_send ? 0 : sb, self_recv ? 0 : rb);
    if (self_send) return cpar__coll_copy(g, fn, recv->data, recv->device, send->data, send->device, sb);
    const void *sp = send ? send->data : NULL;
    void *rp = recv ? recv->data : NULL;
    cpar_dtype sdt = send ? send->dtype : CPAR_U8, rdt = recv ? recv->dtype : CPAR_U8;
    int64_t sn = send ? cpar_tensor_numel(send) : 0, rn = recv ? cpar_tensor_numel(recv) : 0;
#ifdef CPAR_WITH_NCCL
    if (cpar__group_is_nccl(g)) return cpar__nccl_sendrecv(g, fn, sp, sdt, sn, send_to, rp, rdt, rn, recv_from);
#endif
    if (g->pc) return cpar__pc_sendrecv(g, fn, sp, sdt, sn, send_to, rp, rdt, rn, recv_from);
    return cpar__hc_sendrecv(g, fn, sp, sdt, sn, send_to, rp, rdt, rn, recv_from);
}

cpar_status cpar_sendrecv(cpar_group *g, const cpar_tensor *send, int send_to, cpar_tensor *recv, int recv_from) {
    return cpar__sendrecv(g, "cpar_sendrecv", send, send_to, recv, recv_from);
}

cpar_status cpar_send(cpar_group *g, const cpar_tensor *t, int to) {
    CPAR_TRY(cpar__check_group(g, "cpar_send"));
    if (!t) return cpar__fail(g->ctx, CPAR_ERR_INVALID, "cpar_send: t is NULL");
    if (to < 0 || to >= g->size)
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "cpar_send: to is %d, expected a group rank 0..%d", to, g->size - 1);
    return cpar__sendrecv(g, "cpar_send", t, to, NULL, -1);
}

cpar_status cpar_recv(cpar_group *g, cpar_tensor *t, int from) {
    CPAR_TRY(cpar__check_group(g, "cpar_recv"));
    if (!t) return cpar__fail(g->ctx, CPAR_ERR_INVALID, "cpar_recv: t is NULL");
    if (from < 0 || from >= g->size)
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "cpar_recv: from is %d, expected a group rank 0..%d", from,
                          g->size - 1);
    return cpar__sendrecv(g, "cpar_recv", NULL, -1, t, from);
}

cpar_status cpar_ring_shift(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, int shift) {
    static const char fn[] = "cpar_ring_shift";
    CPAR_TRY(cpar__check_group(g, fn));
    CPAR_TRY(cpar__coll_tensor(g, fn, "in", in, NULL));
    CPAR_TRY(cpar__coll_tensor(g, fn, "out", out, in));
    CPAR_TRY(cpar__check_shape(g->ctx, fn, "out", out, in->shape, in->ndim, "as in"));
    if (cpar__ranges_overlap(in->data, cpar_tensor_nbytes(in), out->data, cpar_tensor_nbytes(out)))
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: out overlaps in", fn);
    int n = g->size, s = ((shift % n) + n) % n;
    return cpar__sendrecv(g, fn, in, (g->rank + s) % n, out, (g->rank - s + n) % n);
}

cpar_status cpar_barrier(cpar_group *g) {
    static const char fn[] = "cpar_barrier";
    CPAR_TRY(cpar__check_group(g, fn));
    cpar__coll_pending(g, fn);
    cpar__count(g, CPAR_COLL_BARRIER, 0, 0);
    if (g->size == 1) return CPAR_OK;
#ifdef CPAR_WITH_NCCL
    if (cpar__group_is_nccl(g)) {
        /* One-element all-reduce, then wait for it: what torch.distributed
         * does. Its scratch is the collectives' own, not the workspace a
         * caller may hold. */
        cpar_ctx *ctx = g->ctx;
        ncclComm_t *pc = NULL;
        CPAR_TRY(cpar__nccl_comm(g, fn, &pc));
        CPAR_TRY(cpar__grow_buffer(ctx, fn, &ctx->coll_ws, &ctx->coll_ws_bytes, sizeof(float)));
        CPAR_NCCL_TRY(g, fn, NULL, pc, ncclAllReduce(ctx->coll_ws, ctx->coll_ws, 1, ncclFloat32, ncclSum, *pc,
                                                       (cudaStream_t)ctx->compute));
        return cpar_sync(ctx);
    }
#endif
    cpar__slot c = {.kind = CPAR_COLL_BARRIER};
    return cpar__run_collective(g, fn, &c);
}

/* ==== 12. Contexts and start-up ==========================================
 * A context is one rank: its backend, device, streams, cuBLAS handle,
 * workspace, groups and last error. cpar_spawn runs ranks as threads;
 * cpar_init_from_env joins a multi-process job through the store.
 * Uses: 1-11. */

#define CPAR__MAX_SPAWN 256 /* threads per process; also bounds the host backend's peer tables */
#define CPAR__NCCL_ID_BYTES 128

const char *cpar_backend_name(cpar_backend b) {
    static const char *const names[CPAR_BACKEND_COUNT] = {"host", "nccl", "device"};
    return (unsigned)b < CPAR_BACKEND_COUNT ? names[b] : "?";
}

int cpar_backend_parse(const char *s) {
    if (!s) return -1;
    for (int k = 0; k < CPAR_BACKEND_COUNT; k++)
        if (!strcasecmp(s, cpar_backend_name((cpar_backend)k))) return k;
    return !strcasecmp(s, "sim") ? CPAR_BACKEND_DEVICE : -1; /* the device backend's old name */
}

bool cpar_backend_available(cpar_backend b) {
    switch (b) {
    case CPAR_BACKEND_HOST: return true;
#ifdef CPAR_WITH_NCCL
    case CPAR_BACKEND_NCCL: return cpar_dev_count() > 0;
#endif
#ifdef CPAR_WITH_DEVICE
    case CPAR_BACKEND_DEVICE: return cpar_dev_count() > 0;
#endif
    default: return false;
    }
}

static cpar_status cpar__check_backend(const char *fn, cpar_backend b, int nranks) {
    if ((unsigned)b >= CPAR_BACKEND_COUNT)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: backend is %d, expected CPAR_BACKEND_HOST, _NCCL or _DEVICE", fn, (int)b);
    if (!cpar_backend_available(b)) {
#if defined(CPAR_WITH_DEVICE)
        char why[CPAR_ERR_LEN];
        if (cpar_dev_count() == 0) /* its reason: no driver, no device, or one below sm_80 */
            snprintf(why, sizeof why, "no usable GPU (%s): use the host backend", cpar_dev_last_error());
        else
            snprintf(why, sizeof why, "this build has the device backend on the CUDA simulator, not NCCL (CPAR_SIM)");
#else
        const char *why = "this build has no CUDA (cpar.c compiled without -DCPAR_WITH_DEVICE, e.g. make "
                          "CPAR_CUDA=0): use the host backend";
#endif
        return cpar__fail(NULL, CPAR_ERR_UNSUPPORTED, "%s: backend %s is not available: %s", fn, cpar_backend_name(b), why);
    }
    if (b == CPAR_BACKEND_NCCL && nranks > cpar_dev_count())
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: nranks is %d, but only %d GPU%s visible (NCCL takes one per "
                          "rank; the device backend runs any number of ranks on them)", fn,
                          nranks, cpar_dev_count(), cpar_dev_count() == 1 ? " is" : "s are");
    return CPAR_OK;
}

cpar_status cpar_finalize(cpar_ctx *ctx) {
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_finalize: ctx is NULL");
    if (cpar__on_device(ctx->device)) {
        cpar_dev_set(ctx->device);
        cpar__stream_wait_quiet(ctx, "cpar_finalize", ctx->compute); /* comm joins it: cpar__streams_quiet */
    }
    while (ctx->groups) cpar__group_free(ctx->groups);
    cpar__pc_arenas_unmap(ctx);
    /* A refused free (work still queued: see cpar__mem_alloc) is the one
     * failure reported, after everything else is released. */
    char why[CPAR_ERR_LEN] = "";
    cpar_status fs = cpar__mem_free(ctx->device, ctx->ws), fs2 = cpar__mem_free(ctx->device, ctx->coll_ws),
                fs3 = cpar__mem_free(ctx->device, ctx->coll_stage);
    if (fs == CPAR_OK) fs = fs2;
    if (fs == CPAR_OK) fs = fs3;
    if (fs != CPAR_OK) snprintf(why, sizeof why, "%s", cpar_dev_last_error());
    cpar__arena_retire(ctx->arena); /* tensors still allocated keep it until they are freed */
    cpar__pool_destroy(ctx->gemm_pool); /* before its scratch goes */
    free(ctx->gemm_ws);
    if (ctx->blas) cpar_dev_blas_destroy(ctx->blas);
    for (int i = 0; i < 3; i++)
        if (ctx->ring_ev[i]) cpar_dev_event_destroy(ctx->ring_ev[i]);
    if (ctx->compute) cpar_dev_stream_destroy(ctx->compute);
    if (ctx->comm) cpar_dev_stream_destroy(ctx->comm);
    if (ctx->store) cpar_store_destroy(ctx->store);
    if (ctx->owns_job) cpar__job_destroy(ctx->job);
    free(ctx->rng);
    free(ctx);
    if (fs != CPAR_OK)
        return cpar__fail(NULL, fs, "cpar_finalize: freeing the context's device buffers failed: %s", why);
    return CPAR_OK;
}

/* A context for rank of world on backend; device state ready, no groups. */
/* An asynchronous error of one of the context's communicators (NCCL). */
static cpar_status cpar__comm_errors(cpar_ctx *ctx, const char *fn) {
#ifdef CPAR_WITH_NCCL
    if (ctx->backend == CPAR_BACKEND_NCCL) return cpar__nccl_check(ctx, fn);
#endif
    (void)ctx, (void)fn;
    return CPAR_OK;
}
/* Abort the context's NCCL communicators (their groups then say so). */
static void cpar__comms_abort(cpar_ctx *ctx) {
#ifdef CPAR_WITH_NCCL
    for (cpar_group *g = ctx->groups; g; g = g->next) cpar__nccl_abort(&g->nccl);
#endif
    (void)ctx;
}
/* A failed peer of the job (a rank of this process), CPAR_ERR_PEER naming it. */
static cpar_status cpar__job_failure(cpar_ctx *ctx, const char *fn) {
    if (ctx->job && ctx->job->failed)
        return cpar__fail(ctx, CPAR_ERR_PEER, "%s: rank %d failed (%s)", fn, ctx->job->failed_rank,
                          cpar_status_string(ctx->job->failed_status));
    return CPAR_OK;
}
/* The communicators' asynchronous errors; when a peer of the job failed
 * first of its own accord (failed_root: not a CPAR_ERR_PEER it was given),
 * that failure instead: it is the root cause, and another rank may only
 * have aborted a communicator because of it. */
static cpar_status cpar__comm_errors_named(cpar_ctx *ctx, const char *fn) {
    cpar_status st = cpar__comm_errors(ctx, fn);
#ifdef CPAR_WITH_NCCL
    char why[CPAR_ERR_LEN]; /* processes: a peer's published abort (section 9) */
    if (st != CPAR_OK && cpar__nccl_abort_read(ctx, why, sizeof why))
        return cpar__fail(ctx, CPAR_ERR_PEER, "%s: %.480s; NCCL communicators aborted", fn, why);
#endif
    if (st == CPAR_OK || !ctx->job || !ctx->job->failed || !ctx->job->failed_root) return st;
    return cpar__job_failure(ctx, fn);
}
/* ctx->async_check of device contexts: a communicator's error (named by the
 * job's root cause: cpar__comm_errors_named), or a failed peer of the job. */
static cpar_status cpar__ctx_async_check(cpar_ctx *ctx, const char *fn) {
    CPAR_TRY(cpar__comm_errors_named(ctx, fn));
#ifdef CPAR_WITH_NCCL
    if (ctx->backend == CPAR_BACKEND_NCCL) CPAR_TRY(cpar__nccl_gave_up_check(ctx, fn, false));
#endif
    return cpar__job_failure(ctx, fn);
}

/* A switch read from the environment: unset, empty or `off` is false, `on`
 * true, anything else CPAR_ERR_INVALID naming it (`choices` describes the
 * two). */
static cpar_status cpar__env_switch(const char *fn, const char *name, const char *off, const char *on,
                                    const char *choices, bool *value) {
    const char *v = getenv(name);
    *value = v && !strcmp(v, on);
    if (v && *v && !*value && strcmp(v, off) != 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: %s=\"%.32s\", expected %s", fn, name, v, choices);
    return CPAR_OK;
}

static cpar_status cpar__ctx_create(const char *fn, const cpar_init_config *cfg, int rank, int world, int device,
                                    cpar_ctx **out) {
    cpar_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_OOM, "%s: cannot allocate a context", fn);
    ctx->rank = rank;
    ctx->world = world;
    ctx->backend = cfg->backend;
    ctx->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : cpar__default_timeout_ms();
    const char *check = getenv("CPAR_CHECK_CALLS");
    ctx->check_calls = check && *check && strcmp(check, "0") != 0;
    cpar_status est = cpar__env_switch(fn, "CPAR_ATTN_DQ", "kernel", "atomic",
                                       "kernel (a separate dq kernel, reproducible; the default) or atomic (fp32 "
                                       "atomics from the dk/dv kernel)", &ctx->attn_atomic_dq);
    if (est == CPAR_OK)
        est = cpar__env_switch(fn, "CPAR_ATTN_FWD_GRID", "tiles", "heads",
                               "tiles (a head's query tiles side by side; the default) or heads (batch·head order)",
                               &ctx->attn_fwd_heads_first);
    if (est != CPAR_OK) {
        free(ctx);
        return est;
    }
    const char *gemm = getenv("CPAR_HOST_GEMM"), *threads = getenv("CPAR_HOST_THREADS");
    if (gemm && *gemm) {
        static const char *const names[] = {"auto", "amx", "avx512bf16", "avx2", "c", "builtin", "default", "avx512"};
        static const int forces[] = {CPAR__GEMM_AUTO, CPAR__GEMM_FORCE_AMX, CPAR__GEMM_FORCE_BF16,
                                     CPAR__GEMM_FORCE_AVX2, CPAR__GEMM_FORCE_C, CPAR__GEMM_AUTO, CPAR__GEMM_AUTO,
                                     CPAR__GEMM_FORCE_AVX512};
        static const char *const needs[] = {"", "AMX-BF16", "AVX512-BF16", "AVX2+FMA", "", "", "", "AVX-512F"};
        int which = -1;
        for (int i = 0; i < 8; i++)
            if (!strcmp(gemm, names[i])) which = i;
        if (which == 6) which = 0; /* "default": auto */
        if (which < 0) {
            free(ctx);
            return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: CPAR_HOST_GEMM=\"%.32s\", expected auto, builtin (never the "
                              "CBLAS), or a micro-kernel to force: amx, avx512bf16, avx512, avx2 or c", fn, gemm);
        }
        bool missing;
#ifdef CPAR__X86_KERNELS
        missing = (which == 1 && !(cpar__cpu_amx() && cpar__cpu_avx512bf16())) ||
                  (which == 2 && !cpar__cpu_avx512bf16()) || (which == 3 && !cpar__cpu_avx2()) ||
                  (which == 7 && !cpar__cpu_avx512());
#else
        missing = (which >= 1 && which <= 3) || which == 7; /* the portable build has the C kernel only */
#endif
        if (missing) {
            free(ctx);
            return cpar__fail(NULL, CPAR_ERR_UNSUPPORTED, "%s: CPAR_HOST_GEMM=%s, but this %s has no %s kernel", fn, gemm,
#ifdef CPAR__X86_KERNELS
                              "CPU",
#else
                              "build (CPAR_PORTABLE)",
#endif
                              needs[which]);
        }
        ctx->gemm_builtin = which > 0;
        ctx->gemm_force = forces[which];
    }
    long nthreads = 1;
    if (threads && *threads && (!cpar__env_parse_long(threads, &nthreads) || nthreads < 1 || nthreads > CPAR__POOL_MAX)) {
        free(ctx);
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: CPAR_HOST_THREADS=\"%.32s\", expected an integer from 1 to %d (threads per host GEMM)",
                          fn, threads, CPAR__POOL_MAX);
    }
    ctx->host_threads = (int)nthreads;
    ctx->device = cfg->backend == CPAR_BACKEND_HOST ? CPAR_HOST : device;
    /* the host and device backends share their groups' state (threads, or a
     * segment across processes): a failed check is told there (NCCL: not
     * yet; its peers wait for the deadline) */
#ifdef CPAR_WITH_NCCL
    ctx->give_up = cfg->backend == CPAR_BACKEND_NCCL ? cpar__nccl_give_up : cpar__group_give_up;
#else
    ctx->give_up = cpar__group_give_up;
#endif
    cpar_status st = CPAR_OK;
    if (cpar__on_device(ctx->device)) {
        st = cpar_dev_set(ctx->device);
        if (st == CPAR_OK) st = cpar_dev_stream_create(&ctx->compute);
        if (st == CPAR_OK) st = cpar_dev_stream_create(&ctx->comm);
        if (st == CPAR_OK) st = cpar_dev_blas_create(&ctx->blas);
        if (st != CPAR_OK) st = cpar__dev_fail(ctx, st, fn);
        ctx->async_check = cpar__ctx_async_check;
    }
    if (st == CPAR_OK && cfg->workspace_bytes) {
        void *ws;
        st = cpar__workspace(ctx, fn, cfg->workspace_bytes, &ws);
    }
    if (st != CPAR_OK) {
        char msg[CPAR_ERR_LEN];
        snprintf(msg, sizeof msg, "%s", ctx->err);
        cpar_finalize(ctx);
        cpar__set_error(NULL, msg);
        return st;
    }
    *out = ctx;
    return CPAR_OK;
}

/* The info banner, once per rank when its context is ready (NCCL's "NCCL
 * INFO" start-up lines): what a user checks first when a job misbehaves. */
static void cpar__log_banner(const cpar_ctx *ctx, int local_rank, const char *how) {
    if (cpar__log_level() < CPAR__LOG_INFO) return;
    char dev[32] = "host memory", nccl[48] = "";
    if (cpar__on_device(ctx->device)) snprintf(dev, sizeof dev, "GPU %d", ctx->device);
#ifdef CPAR_WITH_NCCL
    int v = 0;
    if (ctx->backend == CPAR_BACKEND_NCCL && ncclGetVersion(&v) == ncclSuccess)
        snprintf(nccl, sizeof nccl, ", NCCL %d.%d.%d", v / 10000, v / 100 % 100, v % 100);
#endif
    cpar__log(CPAR__LOG_INFO, ctx->rank, "cpar %s: rank %d of %d (local %d, %s), backend %s, %s%s, timeout %d ms",
              cpar_version(), ctx->rank, ctx->world, local_rank, how,
              cpar_backend_name(ctx->backend), dev, nccl, ctx->timeout_ms);
}

typedef struct cpar__spawn_rank {
    int rank, nranks;
    const cpar_init_config *cfg;
    cpar__job *job;
    cpar__hcomm *world_hc;
    const unsigned char *nccl_id;
    cpar_rank_fn fn;
    void *arg;
    cpar_status st;
    char err[CPAR_ERR_LEN];
} cpar__spawn_rank;

/* The device backend's GPUs: the visible ones, as many as there are ranks.
 * Where two have peer access the reductions read the members' buffers in
 * place; consumer cards over PCIe have none, and there the reductions stage
 * through copies (cpar__reduce_rows_staged; until 2026-12-07 their ranks all
 * shared GPU 0). Every rank computes the same list; rank 0 names the first
 * pair without access at CPAR_LOG=info. Returns the count: 0 without GPUs
 * (cpar__ctx_create then fails naming it). */
static int cpar__device_backend_gpus(int rank, int nranks, int *gpus, int cap) {
    const int visible = cpar_dev_count();
    int n = 0;
    while (n < visible && n < cap && n < nranks) gpus[n] = n, n++;
    for (int i = 0; rank == 0 && i < n; i++)
        for (int j = 0; j < n; j++) {
            bool can = true;
            if (i != j && cpar_dev_peer_query(i, j, &can) == CPAR_OK && !can) {
                cpar__log(CPAR__LOG_INFO, rank, "cpar_spawn: GPU %d has no peer access to GPU %d: the device "
                          "backend's reductions between their ranks go through copies", i, j);
                return n;
            }
        }
    return n;
}

static cpar_status cpar__spawn_rank_run(cpar__spawn_rank *r, cpar_ctx **pctx) {
    static const char fn[] = "cpar_spawn";
    /* NCCL: one GPU per rank. Device backend: the ranks share the visible
     * GPUs (rank r on the (r mod n)-th). */
    const bool shared = r->cfg->backend == CPAR_BACKEND_DEVICE;
    int gpus[64], n = 0;
    if (shared) n = cpar__device_backend_gpus(r->rank, r->nranks, gpus, (int)(sizeof gpus / sizeof gpus[0]));
    CPAR_TRY(cpar__ctx_create(fn, r->cfg, r->rank, r->nranks, shared ? (n ? gpus[r->rank % n] : 0) : r->rank, pctx));
    cpar_ctx *ctx = *pctx;
    ctx->job = r->job;
    /* Peer access where the GPUs have it (kernels then read the peers'
     * buffers in place); without it the reductions stage through copies
     * (cpar__reduce_rows_staged). */
    for (int i = 0; i < n; i++) {
        bool can = false;
        cpar_status ps = cpar_dev_peer_query(ctx->device, gpus[i], &can);
        if (ps == CPAR_OK && can && gpus[i] != ctx->device) ps = cpar_dev_peer_access(gpus[i]);
        if (ps != CPAR_OK)
            return cpar__fail(ctx, ps, "%s: peer access from GPU %d to GPU %d: %s", fn, ctx->device, gpus[i],
                              cpar_dev_last_error());
        if (can && gpus[i] < 64) ctx->dev_reach |= 1ull << gpus[i];
    }
    int *ranks = malloc((size_t)r->nranks * sizeof *ranks);
    if (!ranks) return cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate the world group", fn);
    for (int i = 0; i < r->nranks; i++) ranks[i] = i;
    cpar_status st = cpar__group_new(ctx, fn, r->rank, r->nranks, ranks, &ctx->world_group);
    free(ranks);
    CPAR_TRY(st);
#ifdef CPAR_WITH_NCCL
    if (r->cfg->backend == CPAR_BACKEND_NCCL) {
        /* Every rank's communicator is ready before any rank's function runs. */
        CPAR_TRY(cpar__nccl_comm_init(ctx, fn, r->nccl_id, &ctx->world_group->nccl));
        cpar__log_banner(ctx, r->rank, "cpar_spawn thread");
        return r->fn(ctx, r->arg);
    }
#endif
    ctx->world_group->hc = r->world_hc;
    atomic_fetch_add(&r->world_hc->refs, 1); /* the job keeps its own reference */
    cpar__log_banner(ctx, r->rank, "cpar_spawn thread");
    return r->fn(ctx, r->arg);
}

static void *cpar__spawn_thread(void *p) {
    cpar__spawn_rank *r = p;
    cpar_ctx *ctx = NULL;
    cpar__tls_rank = r->rank; /* log lines without a context still name the rank */
    r->st = cpar__spawn_rank_run(r, &ctx);
    if (r->st != CPAR_OK) {
        const char *msg = ctx && ctx->err[0] ? ctx->err : cpar__tls_err;
        snprintf(r->err, sizeof r->err, "%s", msg[0] ? msg : cpar_status_string(r->st));
        cpar__job_fail(r->job, r->rank, r->st);
    }
    cpar__job_exit(r->job, r->rank);
    if (ctx) cpar_finalize(ctx);
    return NULL;
}

cpar_status cpar_spawn_with(int nranks, const cpar_init_config *cfg, cpar_rank_fn fn, void *arg) {
    static const char fnn[] = "cpar_spawn";
    cpar_init_config c = cfg ? *cfg : (cpar_init_config){0};
    if (nranks < 1 || nranks > CPAR__MAX_SPAWN)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: nranks is %d, expected 1..%d", fnn, nranks, CPAR__MAX_SPAWN);
    if (!fn) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: fn is NULL", fnn);
    if (c.timeout_ms < 0) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: timeout_ms is %d, expected >= 0", fnn, c.timeout_ms);
    cpar__log_load(); /* CPAR_LOG and CPAR_LOG_FILE as they are now */
    CPAR_TRY(cpar__check_backend(fnn, c.backend, nranks));
    cpar__job *job = cpar__job_create(nranks);
    cpar__spawn_rank *ranks = calloc((size_t)nranks, sizeof *ranks);
    pthread_t *threads = calloc((size_t)nranks, sizeof *threads);
    int *ids = malloc((size_t)nranks * sizeof *ids);
    cpar__hcomm *world_hc = NULL;
    unsigned char nccl_id[CPAR__NCCL_ID_BYTES] = {0};
    cpar_status st = CPAR_OK;
    int started = 0;
    if (!job || !ranks || !threads || !ids) {
        st = cpar__fail(NULL, CPAR_ERR_OOM, "%s: cannot allocate %d ranks", fnn, nranks);
        goto done;
    }
    for (int i = 0; i < nranks; i++) ids[i] = i;
    world_hc = cpar__hcomm_create(job, nranks, ids);
    if (!world_hc) {
        st = cpar__fail(NULL, CPAR_ERR_OOM, "%s: cannot allocate the world group", fnn);
        goto done;
    }
    atomic_store(&world_hc->refs, 1); /* each rank adds its own */
#ifdef CPAR_WITH_NCCL
    if (c.backend == CPAR_BACKEND_NCCL) {
        ncclUniqueId id;
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) {
            st = cpar__fail(NULL, CPAR_ERR_NCCL, "%s: ncclGetUniqueId failed: %s", fnn, ncclGetErrorString(r));
            goto done;
        }
        memcpy(nccl_id, &id, sizeof id < sizeof nccl_id ? sizeof id : sizeof nccl_id);
    }
#endif
    for (int i = 0; i < nranks; i++) {
        ranks[i] = (cpar__spawn_rank){.rank = i, .nranks = nranks, .cfg = &c, .job = job, .world_hc = world_hc,
                                      .nccl_id = nccl_id, .fn = fn, .arg = arg};
        if (pthread_create(&threads[i], NULL, cpar__spawn_thread, &ranks[i])) {
            st = cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: cannot start the thread of rank %d: %s", fnn, i, strerror(errno));
            cpar__job_fail(job, i, CPAR_ERR_SYSTEM);
            for (int k = i; k < nranks; k++) cpar__job_exit(job, k);
            break;
        }
        started++;
    }
    for (int i = 0; i < started; i++) pthread_join(threads[i], NULL);
    /* Report the rank that failed first: the others' failures (CPAR_ERR_PEER)
     * are its consequences. */
    if (st == CPAR_OK && job->failed) {
        int fr = job->failed_rank;
        st = ranks[fr].st != CPAR_OK ? ranks[fr].st : job->failed_status;
        const char *why = ranks[fr].err[0] ? ranks[fr].err : job->failed_msg[0] ? job->failed_msg : cpar_status_string(st);
        cpar__fail(NULL, st, "rank %d: %s", fr, why);
    }
done:
    cpar__hcomm_release(world_hc);
    cpar__job_destroy(job);
    free(ranks);
    free(threads);
    free(ids);
    return st;
}

cpar_status cpar_spawn(int nranks, cpar_backend backend, cpar_rank_fn fn, void *arg) {
    cpar_init_config c = {.backend = backend};
    return cpar_spawn_with(nranks, &c, fn, arg);
}

/* Rank 0 hosts the store where env->store_bind says (loopback for one
 * node), every rank joins it (the job token is the environment's,
 * cpar_store_create's default) and passes the start barrier: a mismatched
 * launch fails here, and a rank that never started is named. */
static cpar_status cpar__init_store(cpar_ctx *ctx, const char *fn, const cpar_env *env) {
    cpar_store_config sc = {.host = env->rank == 0 ? env->store_bind : env->master_addr, .port = env->store_port,
                            .is_server = env->rank == 0, .timeout_ms = ctx->timeout_ms};
    /* A world of one without a launcher's token: its store serves no other
     * process, so a random token of its own (ranks started by hand, more
     * than one, need CPAR_JOB_TOKEN: cpar_store_create says so). */
    char lone[33];
    if (env->world_size == 1 && !env->job_token[0]) {
        uint8_t b[16];
        if (cpar__random_bytes(b, sizeof b) != 0)
            return cpar__fail(ctx, CPAR_ERR_SYSTEM, "%s: cannot draw a job token: %s", fn, strerror(errno));
        for (int i = 0; i < 16; i++) snprintf(lone + 2 * i, 3, "%02x", b[i]);
        sc.token = lone;
    }
    int listen_err = 0;
    cpar_status st = cpar__store_create("cpar_store_create", &sc, &ctx->store, &listen_err);
    if (st != CPAR_OK && listen_err == EADDRINUSE && env->world_size > 1) {
        /* Two processes that both claim rank 0 on one host: the second
         * finds the port taken. If the store there is this job's, join it
         * so that both parties are named to every rank; else (another
         * job's, or none) report the port in use. */
        char msg[CPAR_ERR_LEN];
        snprintf(msg, sizeof msg, "%s", cpar__tls_err);
        cpar_store_config cc = {.host = env->master_addr, .port = env->store_port,
                                .timeout_ms = ctx->timeout_ms < 2000 ? ctx->timeout_ms : 2000};
        if (cpar_store_create(&cc, &ctx->store) == CPAR_OK) {
            ctx->store->timeout_ms = ctx->timeout_ms;
            st = cpar__store_join(ctx->store, fn, env->rank, env->world_size, env->local_rank);
            if (st == CPAR_OK) /* unreachable: rank 0 is claimed already */
                st = cpar__fail(ctx, CPAR_ERR_SYSTEM, "%s", msg);
            return st;
        }
        return cpar__fail(ctx, CPAR_ERR_SYSTEM, "%s", msg);
    }
    CPAR_TRY(st);
    return cpar__store_join(ctx->store, fn, env->rank, env->world_size, env->local_rank);
}

/* The host backend across processes is single-node: every rank's join
 * record (section 7) must name rank 0's host. Every rank compares the same
 * records, so all of them fail alike. */
static cpar_status cpar__check_one_node(cpar_ctx *ctx, const char *fn, int world) {
    cpar__join_rec zero, r;
    CPAR_TRY(cpar__join_get(ctx->store, 0, &zero));
    for (int i = 1; i < world; i++) {
        CPAR_TRY(cpar__join_get(ctx->store, i, &r));
        if (strcmp(r.host, zero.host))
            return cpar__fail(ctx, CPAR_ERR_UNSUPPORTED, "%s: the host backend is single-node (its ranks share memory), "
                              "but rank 0 runs on host %s and rank %d on host %s: use the NCCL backend across nodes",
                              fn, zero.host, i, r.host);
    }
    return CPAR_OK;
}

/* The backend cpar_init_from_env uses: CPAR_BACKEND when set, else the
 * program's, except that NCCL without a visible GPU becomes host (one info
 * line says so), so a program written for GPUs runs on any machine. */
static cpar_status cpar__env_backend(const char *fn, const cpar_env *env, cpar_backend *b) {
    const char *v = getenv("CPAR_BACKEND");
    if (v && *v) {
        int k = cpar_backend_parse(v);
        if (k >= 0) {
            *b = (cpar_backend)k;
            return CPAR_OK;
        }
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: CPAR_BACKEND is \"%.64s\", expected host, nccl or device", fn, v);
    }
    if (*b == CPAR_BACKEND_NCCL && !cpar_backend_available(CPAR_BACKEND_NCCL)) {
        *b = CPAR_BACKEND_HOST;
        cpar__log(CPAR__LOG_INFO, env->rank, "%s: no usable GPU (%s; or no NCCL in this build): using the host "
                  "backend%s", fn, cpar_dev_last_error(), env->world_size > 1 ? ", ranks as processes sharing memory" : "");
    }
    return CPAR_OK;
}

cpar_status cpar_init_from_env(const cpar_init_config *cfg, cpar_ctx **out) {
    static const char fn[] = "cpar_init_from_env";
    if (!out) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    *out = NULL;
    cpar_init_config c = cfg ? *cfg : (cpar_init_config){0};
    if (!cfg) c.backend = CPAR_BACKEND_NCCL;
    cpar__log_load(); /* CPAR_LOG and CPAR_LOG_FILE as they are now */
    cpar_env env;
    CPAR_TRY(cpar_env_read(&env));
    cpar__tls_rank = env.rank;
    CPAR_TRY(cpar__env_backend(fn, &env, &c.backend));
    if (c.backend == CPAR_BACKEND_DEVICE && env.world_size > 1)
        return cpar__fail(NULL, CPAR_ERR_UNSUPPORTED, "%s: WORLD_SIZE is %d but the device backend runs ranks as threads of "
                          "one process: use cpar_spawn, or the host or NCCL backend for a multi-process job", fn,
                          env.world_size);
    bool procs = c.backend == CPAR_BACKEND_HOST && env.world_size > 1; /* host backend, ranks as processes */
    if (procs && env.local_world_size != env.world_size)
        return cpar__fail(NULL, CPAR_ERR_UNSUPPORTED, "%s: the host backend is single-node (its ranks share memory), "
                          "but WORLD_SIZE is %d and LOCAL_WORLD_SIZE %d (several nodes): use the NCCL backend across "
                          "nodes", fn, env.world_size, env.local_world_size);
    if (procs && env.world_size > CPAR__PC_MAX)
        return cpar__fail(NULL, CPAR_ERR_UNSUPPORTED, "%s: WORLD_SIZE is %d; the host backend takes at most %d processes",
                          fn, env.world_size, CPAR__PC_MAX);
    CPAR_TRY(cpar__check_backend(fn, c.backend, 1));
    int device = c.device > 0 ? c.device : c.device < 0 ? 0 : env.local_rank;
    if (c.backend != CPAR_BACKEND_HOST && device >= cpar_dev_count())
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: device %d (LOCAL_RANK %d) is not visible: %d GPU%s", fn, device,
                          env.local_rank, cpar_dev_count(), cpar_dev_count() == 1 ? "" : "s");
    cpar_ctx *ctx;
    CPAR_TRY(cpar__ctx_create(fn, &c, env.rank, env.world_size, device, &ctx));
    cpar_status st = CPAR_OK;
    int ranks0 = 0, *ranks = malloc((size_t)env.world_size * sizeof *ranks);
    if (!ranks) {
        st = cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate the world group", fn);
        goto fail;
    }
    for (int i = 0; i < env.world_size; i++) ranks[i] = i;
    st = cpar__group_new(ctx, fn, env.rank, env.world_size, ranks, &ctx->world_group);
    free(ranks);
    if (st != CPAR_OK) goto fail;
    if (procs) {
        /* Ranks as processes: the arena its peers will map (CPAR_HOST_ARENA=0:
         * none), the store, then the world's shared memory. */
        const char *arena = getenv("CPAR_HOST_ARENA");
        if (!arena || strcmp(arena, "0")) ctx->arena = cpar__arena_create(CPAR__ARENA_BYTES);
        CPAR_TRY_GOTO(cpar__init_store(ctx, fn, &env), st, fail);
        CPAR_TRY_GOTO(cpar__check_one_node(ctx, fn, env.world_size), st, fail);
        CPAR_TRY_GOTO(cpar__pc_open_world(ctx->world_group, fn, ctx->store), st, fail);
        cpar__log_banner(ctx, env.local_rank, env.source);
        *out = ctx;
        return CPAR_OK;
    }
    if (c.backend != CPAR_BACKEND_NCCL) {
        /* A single rank on the host or device backend: its own one-member job. */
        ctx->job = cpar__job_create(1);
        ctx->owns_job = ctx->job != NULL;
        ctx->world_group->hc = ctx->job ? cpar__hcomm_create(ctx->job, 1, &ranks0) : NULL;
        if (!ctx->world_group->hc) st = cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate the world group", fn);
        if (st != CPAR_OK) goto fail;
        cpar__log_banner(ctx, env.local_rank, env.source);
        *out = ctx;
        return CPAR_OK;
    }
#ifdef CPAR_WITH_NCCL
    {
        unsigned char id[CPAR__NCCL_ID_BYTES];
        size_t len = 0;
        /* Everyone registers and passes the start barrier before the unique id
         * is published: a mismatched launch never reaches NCCL, and a rank
         * that never started is named here (NCCL's init could only time out). */
        CPAR_TRY_GOTO(cpar__init_store(ctx, fn, &env), st, fail);
        if (env.rank == 0) {
            ncclUniqueId uid;
            ncclResult_t r = ncclGetUniqueId(&uid);
            if (r != ncclSuccess) {
                st = cpar__fail(ctx, CPAR_ERR_NCCL, "%s: ncclGetUniqueId failed: %s", fn, ncclGetErrorString(r));
                goto fail;
            }
            memcpy(id, &uid, sizeof id);
            CPAR_TRY_GOTO(cpar_store_set(ctx->store, "cpar/nccl_id/world", id, sizeof id), st, fail);
        }
        CPAR_TRY_GOTO(cpar_store_get(ctx->store, "cpar/nccl_id/world", id, sizeof id, &len), st, fail);
        CPAR_TRY_GOTO(cpar__nccl_comm_init(ctx, fn, id, &ctx->world_group->nccl), st, fail);
        cpar__log_banner(ctx, env.local_rank, env.source);
        *out = ctx;
        return CPAR_OK;
    }
#endif
fail: {
    char msg[CPAR_ERR_LEN];
    snprintf(msg, sizeof msg, "%s", ctx->err[0] ? ctx->err : cpar__tls_err);
    if (ctx->job) {
        cpar__hcomm *hc = ctx->world_group ? ctx->world_group->hc : NULL;
        if (ctx->world_group) ctx->world_group->hc = NULL;
        cpar__hcomm_release(hc);
    }
    cpar_finalize(ctx); /* destroys a job the context owns */
    cpar__set_error(NULL, msg);
    return st;
}
}

/* Ends this rank's part in the job: the job fails with st, this rank the
 * root cause ("rank N <why>" says what happened, for cpar_spawn and for
 * the other processes' members), and its NCCL communicators are aborted so
 * no peer waits on them. The first failure recorded stays. */
static void cpar__abort_why(cpar_ctx *ctx, cpar_status st, const char *why) {
    ctx->aborted = true;
    if (ctx->job) cpar__job_fail_why(ctx->job, ctx->rank, st, true, why);
    char msg[CPAR_ERR_LEN];
    snprintf(msg, sizeof msg, "rank %d %.480s", ctx->rank, why);
    cpar__pc_record_all(ctx, msg);
#ifdef CPAR_WITH_NCCL
    if (ctx->backend == CPAR_BACKEND_NCCL) cpar__nccl_abort_publish(ctx, msg); /* processes: through the store */
    for (cpar_group *g = ctx->groups; g; g = g->next)
        if (g->nccl) {
            ncclCommAbort(g->nccl);
            g->nccl = NULL;
        }
#endif
}

cpar_status cpar_abort(cpar_ctx *ctx) {
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_abort: ctx is NULL");
    cpar__abort_why(ctx, CPAR_ERR_PEER, "aborted (cpar_abort)");
    return CPAR_OK;
}

cpar_status cpar_sync(cpar_ctx *ctx) {
    static const char fn[] = "cpar_sync";
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    if (!cpar__on_device(ctx->device)) return CPAR_OK;
    return cpar__streams_quiet(ctx, fn);
}

int cpar_rank(const cpar_ctx *ctx) { return ctx ? ctx->rank : -1; }
int cpar_world_size(const cpar_ctx *ctx) { return ctx ? ctx->world : 0; }
int cpar_device(const cpar_ctx *ctx) { return ctx ? ctx->device : CPAR_HOST; }
cpar_backend cpar_ctx_backend(const cpar_ctx *ctx) { return ctx ? ctx->backend : CPAR_BACKEND_HOST; }
int cpar_timeout_ms(const cpar_ctx *ctx) { return ctx ? ctx->timeout_ms : 0; }

cpar_status cpar_set_timeout_ms(cpar_ctx *ctx, int ms) {
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_set_timeout_ms: ctx is NULL");
    if (ms <= 0) return cpar__fail(ctx, CPAR_ERR_INVALID, "cpar_set_timeout_ms: ms is %d, expected > 0", ms);
    if (ms != ctx->timeout_ms)
        cpar__log(CPAR__LOG_INFO, ctx->rank, "timeout: %d ms (was %d ms)", ms, ctx->timeout_ms);
    ctx->timeout_ms = ms;
    return CPAR_OK;
}

/* ==== 13. Grid ===========================================================
 * Megatron's parallel state: tp fastest, then cp, dp, pp, i.e.
 * rank = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank)). Each group is a
 * split of the world whose color is the coordinates the group does not span,
 * keyed by world rank (Megatron lists group members in rank order).
 * Uses: 2, 10, 12. */

cpar_status cpar_grid_init(cpar_ctx *ctx, const cpar_grid_config *cfg) {
    static const char fn[] = "cpar_grid_init";
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    if (!cfg) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg is NULL", fn);
    int tp = cfg->tp ? cfg->tp : 1, cp = cfg->cp ? cfg->cp : 1, pp = cfg->pp ? cfg->pp : 1, world = ctx->world;
    if (tp < 0 || cp < 0 || pp < 0)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: sizes tp=%d cp=%d pp=%d, expected positive (0 means 1)", fn,
                          cfg->tp, cfg->cp, cfg->pp);
    if ((int64_t)tp * cp * pp > world || world % (tp * cp * pp))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: tp*cp*pp = %d*%d*%d = %lld does not divide the world size %d", fn,
                          tp, cp, pp, (long long)tp * cp * pp, world);
    int dp = world / (tp * cp * pp), r = ctx->rank;
    int t = r % tp, c = r / tp % cp, d = r / (tp * cp) % dp, p = r / (tp * cp * dp);
    for (int k = 1; k < CPAR_GROUP_KIND_COUNT; k++)
        if (ctx->grid[k]) cpar__group_free(ctx->grid[k]);
    int color[CPAR_GROUP_KIND_COUNT] = {
        [CPAR_GROUP_TP] = c + cp * (d + dp * p), [CPAR_GROUP_CP] = t + tp * (d + dp * p),
        [CPAR_GROUP_DP] = t + tp * (c + cp * p), [CPAR_GROUP_PP] = t + tp * (c + cp * d),
        [CPAR_GROUP_TP_CP] = d + dp * p,         [CPAR_GROUP_DP_CP] = t + tp * p,
    };
    ctx->grid[CPAR_GROUP_WORLD] = ctx->world_group;
    for (int k = 1; k < CPAR_GROUP_KIND_COUNT; k++)
        CPAR_TRY(cpar__as(ctx, fn, cpar_group_split(ctx->world_group, color[k], r, &ctx->grid[k])));
    for (int k = 0; k < CPAR_GROUP_KIND_COUNT; k++) {
        ctx->grid_size[k] = ctx->grid[k]->size;
        ctx->grid_rank[k] = ctx->grid[k]->rank;
    }
    cpar__log(CPAR__LOG_INFO, ctx->rank, "grid: tp %d x cp %d x dp %d x pp %d; this rank is tp %d, cp %d, dp %d, pp %d",
              tp, cp, dp, pp, t, c, d, p);
    return CPAR_OK;
}

cpar_group *cpar_grid_group(cpar_ctx *ctx, cpar_group_kind kind) {
    return ctx && (unsigned)kind < CPAR_GROUP_KIND_COUNT ? ctx->grid[kind] : NULL;
}

int cpar_grid_size(const cpar_ctx *ctx, cpar_group_kind kind) {
    return ctx && (unsigned)kind < CPAR_GROUP_KIND_COUNT && ctx->grid[kind] ? ctx->grid_size[kind] : 0;
}

int cpar_grid_rank(const cpar_ctx *ctx, cpar_group_kind kind) {
    return ctx && (unsigned)kind < CPAR_GROUP_KIND_COUNT && ctx->grid[kind] ? ctx->grid_rank[kind] : -1;
}

/* ==== 14. Mappings and utilities =========================================
 * Megatron's tensor-parallel region mappings (seed mappings.py), one public
 * function per autograd Function with cpar_dir choosing forward or backward;
 * the utilities divide / VocabUtility / _vocab_size_with_padding /
 * split_tensor_along_last_dim (as views); and broadcast_data (seed data.py).
 * Every mapping reduces to one primitive (copy, all-reduce, split or gather
 * or reduce-scatter along the first or last dim, all-to-all) that checks all
 * arguments before it communicates. Last-dim layouts are moved with one
 * pitched 2-D copy per chunk (cpar__copy_2d: what cpar_split/cpar_concat do
 * per piece, a kernel on device memory) into or out of workspace scratch.
 * Uses: 2 (errors, tensor checks), 3, 4 (copies, workspace, allocation),
 * 10 (groups), 11 (collectives and their checks). */

/* The primitive a mapping direction runs. */
typedef enum cpar__map_op {
    CPAR__MAP_COPY = 0,    /* identity */
    CPAR__MAP_ALL_REDUCE,  /* sum over the group */
    CPAR__MAP_SPLIT_LAST,  /* keep columns [r*H/n, (r+1)*H/n) */
    CPAR__MAP_GATHER_LAST, /* all-gather along dim 0, chunks concatenated along the last dim */
    CPAR__MAP_RS_LAST,     /* column chunks stacked along dim 0, reduce-scatter */
    CPAR__MAP_SPLIT_FIRST, /* keep this rank's rows */
    CPAR__MAP_GATHER_FIRST,
    CPAR__MAP_RS_FIRST
} cpar__map_op;

/* An inner call failed: put the mapping's name in front of its message. */
#define CPAR__MAP_TRY(ctx, fn, call)                                                                         \
    do {                                                                                                     \
        cpar_status mst_ = (call);                                                                           \
        if (mst_ != CPAR_OK) return cpar__wrap((ctx), mst_, (fn), cpar_thread_last_error());                 \
    } while (0)

#define CPAR__WRAP_GOTO(ctx, fn, call, st, label)                                                            \
    do {                                                                                                     \
        (st) = (call);                                                                                       \
        if ((st) != CPAR_OK) {                                                                               \
            (st) = cpar__wrap((ctx), (st), (fn), cpar_thread_last_error());                                  \
            goto label;                                                                                      \
        }                                                                                                    \
    } while (0)

static void *cpar__ptr_at(const void *p, size_t off) { return p ? (char *)p + off : NULL; }

/* [rows, cols] view of data on device. */
static cpar_tensor cpar__view2(const void *data, cpar_dtype dt, int64_t rows, int64_t cols, int device) {
    int64_t shape[2] = {rows, cols};
    return cpar_tensor_make((void *)data, dt, 2, shape, device);
}

/* Product of all but the last dimension (1 for rank 1). */
static int64_t cpar__outer(const cpar_tensor *t) {
    int64_t o = 1;
    for (int i = 0; i + 1 < t->ndim; i++) o *= t->shape[i];
    return o;
}

/* Workspace scratch of bytes (it stays valid across the collectives, which
 * keep their own accumulator). *out is NULL when nothing is needed. */
static cpar_status cpar__map_scratch(cpar_ctx *ctx, const char *fn, size_t bytes, void **out) {
    *out = NULL;
    if (!bytes) return CPAR_OK;
    return cpar__workspace(ctx, fn, bytes, out);
}

/* dst: n blocks [rows, w] one after another; block j = columns [j*w, (j+1)*w)
 * of src [rows, n*w] (the seed's torch.cat(torch.split(x, w, dim=1), dim=0)). */
static cpar_status cpar__stack_last(cpar_ctx *ctx, const char *fn, void *dst, const void *src, int64_t rows,
                                    int64_t w, int n, size_t es) {
    int dev = ctx->device;
    size_t wb = (size_t)w * es;
    for (int j = 0; j < n; j++)
        CPAR_TRY(cpar__copy_2d(ctx, fn, cpar__ptr_at(dst, (size_t)j * (size_t)rows * wb), wb, dev,
                               cpar__ptr_at(src, (size_t)j * wb), (size_t)n * wb, dev, wb, (size_t)rows));
    return CPAR_OK;
}

/* The inverse: dst [rows, n*w] <- n blocks [rows, w] stored one after another
 * at src (torch.cat(x.chunk(n, dim=0), dim=-1)). */
static cpar_status cpar__unstack_last(cpar_ctx *ctx, const char *fn, void *dst, const void *src, int64_t rows,
                                      int64_t w, int n, size_t es) {
    int dev = ctx->device;
    size_t wb = (size_t)w * es;
    for (int j = 0; j < n; j++)
        CPAR_TRY(cpar__copy_2d(ctx, fn, cpar__ptr_at(dst, (size_t)j * wb), (size_t)n * wb, dev,
                               cpar__ptr_at(src, (size_t)j * (size_t)rows * wb), wb, dev, wb, (size_t)rows));
    return CPAR_OK;
}

/* Checks every mapping starts with: group, dir, in and out on the context's
 * device with in's dtype, in of rank >= 1. */
static cpar_status cpar__map_begin(cpar_group *g, const char *fn, const cpar_tensor *in, const cpar_tensor *out,
                                   cpar_dir dir) {
    CPAR_TRY(cpar__check_group(g, fn));
    cpar__coll_pending(g, fn);
    if ((unsigned)dir > (unsigned)CPAR_BWD)
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: dir is %d, expected CPAR_FWD or CPAR_BWD", fn, (int)dir);
    CPAR_TRY(cpar__coll_tensor(g, fn, "in", in, NULL));
    CPAR_TRY(cpar__coll_tensor(g, fn, "out", out, in));
    if (in->ndim < 1)
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: in is a scalar, expected at least 1 dimension", fn);
    cpar__tag_set(g, "%s(%s, %s)", fn, dir == CPAR_FWD ? "fwd" : "bwd", cpar_dtype_name(in->dtype));
    return CPAR_OK;
}

/* out == in is allowed when `same_ok` (the shapes are already known equal);
 * any other overlap is not. */
static cpar_status cpar__map_overlap(cpar_group *g, const char *fn, const cpar_tensor *in, const cpar_tensor *out,
                                     bool same_ok) {
    size_t ib = cpar_tensor_nbytes(in), ob = cpar_tensor_nbytes(out);
    if (same_ok && in->data == out->data) return CPAR_OK;
    if (cpar__ranges_overlap(in->data, ib, out->data, ob))
        return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: out overlaps in%s", fn,
                          same_ok ? " (only out == in is allowed)" : " (out may not alias in here)");
    return CPAR_OK;
}

/* "in has last dim 10, not divisible by the group size 4" (pre, v, post). */
static cpar_status cpar__map_divisible(cpar_group *g, const char *fn, const char *pre, int64_t v, const char *post) {
    if (v % g->size == 0) return CPAR_OK;
    return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: in has %s%lld%s, not divisible by the group size %d", fn, pre,
                      (long long)v, post, g->size);
}

/* Reductions sum: every dtype but u8. */
static cpar_status cpar__map_summable(cpar_group *g, const char *fn, const cpar_tensor *in) {
    if (in->dtype != CPAR_U8) return CPAR_OK;
    return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: in has dtype u8, which this direction sums; expected f32, f16, "
                      "bf16, i32 or i64", fn);
}

/* Split sizes of a first-dim op: non-negative, *total their sum, *off and
 * *mine this rank's first row and row count. */
static cpar_status cpar__map_sizes(cpar_group *g, const char *fn, const int64_t *sizes, int64_t *total,
                                   int64_t *off, int64_t *mine) {
    CPAR_TRY(cpar__check_sizes(g, fn, "split_sizes", sizes, total));
    *off = 0;
    for (int j = 0; j < g->rank; j++) *off += sizes[j];
    *mine = sizes[g->rank];
    return CPAR_OK;
}

/* Check out's shape and the op's conditions, then run op from in to out. */
static cpar_status cpar__map_run(cpar_group *g, const char *fn, cpar__map_op op, const cpar_tensor *in,
                                 cpar_tensor *out, const int64_t *sizes) {
    cpar_ctx *ctx = g->ctx;
    int n = g->size, r = g->rank, nd = in->ndim, last = nd - 1, dev = ctx->device;
    size_t es = cpar_dtype_size(in->dtype);
    int64_t want[CPAR_MAX_DIMS], off = 0, mine = 0, total = 0;
    char why[96];
    memcpy(want, in->shape, sizeof want);
    why[0] = 0;
    switch (op) {
    case CPAR__MAP_COPY:
    case CPAR__MAP_ALL_REDUCE:
        snprintf(why, sizeof why, "as in");
        break;
    case CPAR__MAP_SPLIT_LAST:
    case CPAR__MAP_RS_LAST:
        CPAR_TRY(cpar__map_divisible(g, fn, "last dim ", in->shape[last], ""));
        want[last] = in->shape[last] / n;
        snprintf(why, sizeof why, "in's last dim %lld / %d ranks", (long long)in->shape[last], n);
        break;
    case CPAR__MAP_GATHER_LAST:
        want[last] = in->shape[last] * n;
        snprintf(why, sizeof why, "%d ranks' in along the last dim", n);
        break;
    case CPAR__MAP_SPLIT_FIRST:
    case CPAR__MAP_RS_FIRST:
        if (sizes) {
            CPAR_TRY(cpar__map_sizes(g, fn, sizes, &total, &off, &mine));
            if (total != in->shape[0])
                return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: split_sizes add up to %lld, expected in.shape[0] = %lld",
                                  fn, (long long)total, (long long)in->shape[0]);
        } else {
            CPAR_TRY(cpar__map_divisible(g, fn, "", in->shape[0], " rows (dim 0)"));
            mine = in->shape[0] / n;
            off = mine * r;
        }
        want[0] = mine;
        snprintf(why, sizeof why, "this rank's rows of in");
        break;
    case CPAR__MAP_GATHER_FIRST:
        if (sizes) {
            CPAR_TRY(cpar__map_sizes(g, fn, sizes, &total, &off, &mine));
            if (in->shape[0] != mine)
                return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in has %lld rows, expected split_sizes[%d] = %lld", fn,
                                  (long long)in->shape[0], r, (long long)mine);
            want[0] = total;
        } else {
            want[0] = in->shape[0] * n;
        }
        snprintf(why, sizeof why, "%d ranks' rows along dim 0", n);
        break;
    }
    CPAR_TRY(cpar__check_shape(ctx, fn, "out", out, want, nd, why));
    if (op == CPAR__MAP_ALL_REDUCE || op == CPAR__MAP_RS_FIRST || op == CPAR__MAP_RS_LAST)
        CPAR_TRY(cpar__map_summable(g, fn, in));
    CPAR_TRY(cpar__map_overlap(g, fn, in, out, op == CPAR__MAP_COPY || op == CPAR__MAP_ALL_REDUCE || n == 1));

    /* The seed bypasses a group of one: the result is the input. */
    if (n == 1 || op == CPAR__MAP_COPY)
        return cpar__copy_bytes(ctx, fn, out->data, dev, in->data, dev, cpar_tensor_nbytes(in));

    int64_t outer = cpar__outer(in), cols = in->shape[last];
    switch (op) {
    case CPAR__MAP_ALL_REDUCE: CPAR__MAP_TRY(ctx, fn, cpar_all_reduce(g, in, out, CPAR_SUM)); break;
    case CPAR__MAP_SPLIT_LAST: {
        size_t wb = (size_t)(cols / n) * es;
        if (cpar_tensor_nbytes(out))
            CPAR_TRY(cpar__copy_2d(ctx, fn, out->data, wb, dev, cpar__ptr_at(in->data, (size_t)r * wb), (size_t)n * wb,
                                   dev, wb, (size_t)outer));
        break;
    }
    case CPAR__MAP_SPLIT_FIRST: {
        size_t row = (size_t)cpar__row_elems(in) * es;
        CPAR_TRY(cpar__copy_bytes(ctx, fn, out->data, dev, cpar__ptr_at(in->data, (size_t)off * row), dev,
                                  (size_t)mine * row));
        break;
    }
    case CPAR__MAP_GATHER_FIRST: CPAR__MAP_TRY(ctx, fn, cpar_all_gather(g, in, out, sizes)); break;
    case CPAR__MAP_RS_FIRST: CPAR__MAP_TRY(ctx, fn, cpar_reduce_scatter(g, in, out, CPAR_SUM, sizes)); break;
    case CPAR__MAP_GATHER_LAST: {
        /* all-gather along dim 0: [n*outer, cols], rank j's rows in block j;
         * with one row per rank that already is out's layout. */
        cpar_tensor gin = cpar__view2(in->data, in->dtype, outer, cols, dev), gathered;
        void *s = out->data;
        if (outer > 1) CPAR_TRY(cpar__map_scratch(ctx, fn, (size_t)n * cpar_tensor_nbytes(in), &s));
        gathered = cpar__view2(s, in->dtype, (int64_t)n * outer, cols, dev);
        CPAR__MAP_TRY(ctx, fn, cpar_all_gather(g, &gin, &gathered, NULL));
        if (outer > 1) CPAR_TRY(cpar__unstack_last(ctx, fn, out->data, s, outer, cols, n, es));
        break;
    }
    case CPAR__MAP_RS_LAST: {
        int64_t w = cols / n;
        const void *s = in->data;
        if (outer > 1) {
            void *scratch;
            CPAR_TRY(cpar__map_scratch(ctx, fn, cpar_tensor_nbytes(in), &scratch));
            CPAR_TRY(cpar__stack_last(ctx, fn, scratch, in->data, outer, w, n, es));
            s = scratch;
        }
        cpar_tensor stacked = cpar__view2(s, in->dtype, (int64_t)n * outer, w, dev);
        cpar_tensor mine2 = cpar__view2(out->data, in->dtype, outer, w, dev);
        CPAR__MAP_TRY(ctx, fn, cpar_reduce_scatter(g, &stacked, &mine2, CPAR_SUM, NULL));
        break;
    }
    default: break;
    }
    return CPAR_OK;
}

/* The two primitives of a mapping, forward and backward. */
static cpar_status cpar__map(cpar_group *g, const char *fn, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir,
                             cpar__map_op fwd, cpar__map_op bwd, const int64_t *sizes) {
    CPAR_TRY(cpar__map_begin(g, fn, in, out, dir));
    return cpar__map_run(g, fn, dir == CPAR_FWD ? fwd : bwd, in, out, sizes);
}

cpar_status cpar_copy_to_tp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir) {
    return cpar__map(g, "cpar_copy_to_tp_region", in, out, dir, CPAR__MAP_COPY, CPAR__MAP_ALL_REDUCE, NULL);
}

cpar_status cpar_reduce_from_tp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir) {
    return cpar__map(g, "cpar_reduce_from_tp_region", in, out, dir, CPAR__MAP_ALL_REDUCE, CPAR__MAP_COPY, NULL);
}

cpar_status cpar_scatter_to_tp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir) {
    return cpar__map(g, "cpar_scatter_to_tp_region", in, out, dir, CPAR__MAP_SPLIT_LAST, CPAR__MAP_GATHER_LAST, NULL);
}

cpar_status cpar_gather_from_tp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir) {
    return cpar__map(g, "cpar_gather_from_tp_region", in, out, dir, CPAR__MAP_GATHER_LAST, CPAR__MAP_SPLIT_LAST, NULL);
}

cpar_status cpar_scatter_to_sp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir) {
    return cpar__map(g, "cpar_scatter_to_sp_region", in, out, dir, CPAR__MAP_SPLIT_FIRST, CPAR__MAP_GATHER_FIRST,
                     NULL);
}

cpar_status cpar_gather_from_sp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir,
                                       bool tp_output_grad, const int64_t *split_sizes) {
    return cpar__map(g, "cpar_gather_from_sp_region", in, out, dir, CPAR__MAP_GATHER_FIRST,
                     tp_output_grad ? CPAR__MAP_RS_FIRST : CPAR__MAP_SPLIT_FIRST, split_sizes);
}

cpar_status cpar_reduce_scatter_to_sp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir,
                                             const int64_t *split_sizes) {
    return cpar__map(g, "cpar_reduce_scatter_to_sp_region", in, out, dir, CPAR__MAP_RS_FIRST, CPAR__MAP_GATHER_FIRST,
                     split_sizes);
}

cpar_status cpar_all_gather_last_dim_from_tp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out,
                                                    cpar_dir dir) {
    return cpar__map(g, "cpar_all_gather_last_dim_from_tp_region", in, out, dir, CPAR__MAP_GATHER_LAST,
                     CPAR__MAP_RS_LAST, NULL);
}

cpar_status cpar_reduce_scatter_last_dim_to_tp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out,
                                                      cpar_dir dir) {
    return cpar__map(g, "cpar_reduce_scatter_last_dim_to_tp_region", in, out, dir, CPAR__MAP_RS_LAST,
                     CPAR__MAP_GATHER_LAST, NULL);
}

/* Rows of one side of an all-to-all: given splits must add up to rows; NULL
 * means equal rows (divisible by n). *self = the rows this rank keeps. */
static cpar_status cpar__a2a_side(cpar_group *g, const char *fn, const char *tname, int64_t rows, const char *sname,
                                  const int64_t *splits, int64_t *self) {
    if (splits) {
        int64_t total;
        CPAR_TRY(cpar__check_sizes(g, fn, sname, splits, &total));
        if (total != rows)
            return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: %s add up to %lld, expected %s.shape[0] = %lld", fn, sname,
                              (long long)total, tname, (long long)rows);
        *self = splits[g->rank];
    } else {
        if (rows % g->size)
            return cpar__fail(g->ctx, CPAR_ERR_INVALID, "%s: %s has %lld rows (dim 0), not divisible by the group size "
                              "%d (pass %s)", fn, tname, (long long)rows, g->size, sname);
        *self = rows / g->size;
    }
    return CPAR_OK;
}

cpar_status cpar_all_to_all(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir,
                            const int64_t *out_splits, const int64_t *in_splits) {
    static const char fn[] = "cpar_all_to_all";
    CPAR_TRY(cpar__map_begin(g, fn, in, out, dir));
    cpar_ctx *ctx = g->ctx;
    /* Backward sends the gradient back: the forward's splits swapped. Names
     * in messages stay the caller's argument names. */
    bool bwd = dir == CPAR_BWD;
    const int64_t *send = bwd ? out_splits : in_splits, *recv = bwd ? in_splits : out_splits;
    const char *send_name = bwd ? "out_splits" : "in_splits", *recv_name = bwd ? "in_splits" : "out_splits";
    int64_t send_self = 0, recv_self = 0, out_rows = in->shape[0], want[CPAR_MAX_DIMS];
    CPAR_TRY(cpar__a2a_side(g, fn, "in", in->shape[0], send_name, send, &send_self));
    if (recv) {
        CPAR_TRY(cpar__check_sizes(g, fn, recv_name, recv, &out_rows));
        recv_self = recv[g->rank];
    } else {
        CPAR_TRY(cpar__a2a_side(g, fn, "in", in->shape[0], recv_name, NULL, &recv_self));
    }
    if (send_self != recv_self)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s[%d] = %lld rows to this rank itself, but %s[%d] = %lld", fn,
                          send_name, g->rank, (long long)send_self, recv_name, g->rank, (long long)recv_self);
    memcpy(want, in->shape, sizeof want);
    want[0] = out_rows;
    CPAR_TRY(cpar__check_shape(ctx, fn, "out", out, want, in->ndim,
                               recv ? "the received rows, other dims as in" : "as in"));
    CPAR_TRY(cpar__map_overlap(g, fn, in, out, true));
    if (g->size == 1) return cpar__copy_bytes(ctx, fn, out->data, ctx->device, in->data, ctx->device, cpar_tensor_nbytes(in));
    cpar_tensor src = *in;
    if (in->data == out->data && cpar_tensor_nbytes(in)) { /* in place: stage the input */
        CPAR_TRY(cpar__map_scratch(ctx, fn, cpar_tensor_nbytes(in), &src.data));
        CPAR_TRY(cpar__copy_bytes(ctx, fn, src.data, ctx->device, in->data, ctx->device, cpar_tensor_nbytes(in)));
    }
    CPAR__MAP_TRY(ctx, fn, cpar_all_to_all_single(g, &src, out, recv, send));
    return CPAR_OK;
}

/* out must hold rows x cols: last dim cols, leading dims multiplying to rows. */
static cpar_status cpar__check_rows_cols(cpar_ctx *ctx, const char *fn, const cpar_tensor *out, int64_t rows,
                                         int64_t cols, const char *why) {
    if (out->ndim >= 1 && out->shape[out->ndim - 1] == cols && cpar__outer(out) == rows) return CPAR_OK;
    int64_t want[2] = {rows, cols};
    char w2[128];
    snprintf(w2, sizeof w2, "%s; any leading dims multiplying to %lld", why, (long long)rows);
    return cpar__fail_shape(ctx, fn, "out", out, want, 2, w2);
}

/* sp2hp (to_hp) or hp2sp of in into out, as the seed's all_to_all_sp2hp/_hp2sp. */
static cpar_status cpar__a2a_sp_hp(cpar_group *g, const char *fn, const cpar_tensor *in, cpar_tensor *out,
                                   bool to_hp) {
    cpar_ctx *ctx = g->ctx;
    int n = g->size, dev = ctx->device;
    size_t es = cpar_dtype_size(in->dtype);
    int64_t cols = in->shape[in->ndim - 1], rows = cpar__outer(in);
    if (cols < 1)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in has last dim %lld, expected >= 1 (the hidden size)", fn,
                          (long long)cols);
    char why[96];
    if (to_hp) { /* [rows, cols] -> [n*rows, cols/n] */
        CPAR_TRY(cpar__map_divisible(g, fn, "last dim ", cols, " (the hidden size)"));
        snprintf(why, sizeof why, "[T, H/n] with T = %d x %lld tokens, H = %lld", n, (long long)rows, (long long)cols);
        CPAR_TRY(cpar__check_rows_cols(ctx, fn, out, rows * n, cols / n, why));
    } else { /* [rows, cols] -> [rows/n, n*cols] */
        if (rows % n)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in has %lld tokens (the product of all but the last dim), "
                              "not divisible by the group size %d", fn, (long long)rows, n);
        snprintf(why, sizeof why, "[T/n, n*h] with T = %lld tokens, h = %lld", (long long)rows, (long long)cols);
        CPAR_TRY(cpar__check_rows_cols(ctx, fn, out, rows / n, cols * n, why));
    }
    CPAR_TRY(cpar__map_overlap(g, fn, in, out, n == 1));
    size_t bytes = cpar_tensor_nbytes(in);
    if (n == 1) return cpar__copy_bytes(ctx, fn, out->data, dev, in->data, dev, bytes);
    if (to_hp) {
        /* Column chunks stacked along dim 0 (one token: already so), then an
         * equal all-to-all: rank j gets chunk j of every rank's tokens. */
        int64_t w = cols / n;
        const void *s = in->data;
        if (rows > 1) {
            void *scratch;
            CPAR_TRY(cpar__map_scratch(ctx, fn, bytes, &scratch));
            CPAR_TRY(cpar__stack_last(ctx, fn, scratch, in->data, rows, w, n, es));
            s = scratch;
        }
        cpar_tensor a = cpar__view2(s, in->dtype, rows * n, w, dev), b = cpar__view2(out->data, in->dtype, rows * n, w, dev);
        CPAR__MAP_TRY(ctx, fn, cpar_all_to_all_single(g, &a, &b, NULL, NULL));
    } else {
        /* Equal all-to-all, then the n received [rows/n, cols] blocks side by
         * side (one token per rank: already so). */
        int64_t t = rows / n;
        void *s = out->data;
        if (t > 1) CPAR_TRY(cpar__map_scratch(ctx, fn, bytes, &s));
        cpar_tensor a = cpar__view2(in->data, in->dtype, rows, cols, dev), b = cpar__view2(s, in->dtype, rows, cols, dev);
        CPAR__MAP_TRY(ctx, fn, cpar_all_to_all_single(g, &a, &b, NULL, NULL));
        if (t > 1) CPAR_TRY(cpar__unstack_last(ctx, fn, out->data, s, t, cols, n, es));
    }
    return CPAR_OK;
}

cpar_status cpar_all_to_all_sp2hp(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir) {
    static const char fn[] = "cpar_all_to_all_sp2hp";
    CPAR_TRY(cpar__map_begin(g, fn, in, out, dir));
    return cpar__a2a_sp_hp(g, fn, in, out, dir == CPAR_FWD);
}

cpar_status cpar_all_to_all_hp2sp(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir) {
    static const char fn[] = "cpar_all_to_all_hp2sp";
    CPAR_TRY(cpar__map_begin(g, fn, in, out, dir));
    return cpar__a2a_sp_hp(g, fn, in, out, dir == CPAR_BWD);
}

/* ---- Utilities ------------------------------------------------------------------ */

cpar_status cpar_divide(int64_t num, int64_t den, int64_t *out) {
    static const char fn[] = "cpar_divide";
    if (!out) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    if (den == 0) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: den is 0, expected a non-zero denominator", fn);
    /* The one quotient of two int64 that is not an int64 (and traps on x86). */
    if (num == INT64_MIN && den == -1)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: %lld / -1 overflows int64", fn, (long long)num);
    if (num % den)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: %lld is not divisible by %lld", fn, (long long)num,
                          (long long)den);
    *out = num / den;
    return CPAR_OK;
}

cpar_status cpar_vocab_range(int64_t global_vocab, int rank, int world, int64_t *first, int64_t *last) {
    static const char fn[] = "cpar_vocab_range";
    if (!first || !last) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: %s is NULL", fn, first ? "last" : "first");
    if (world < 1) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: world is %d, expected >= 1", fn, world);
    if (rank < 0 || rank >= world)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: rank is %d, expected 0..%d", fn, rank, world - 1);
    if (global_vocab < 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: global_vocab is %lld, expected >= 0", fn,
                          (long long)global_vocab);
    if (global_vocab % world)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: global_vocab %lld is not divisible by world %d", fn,
                          (long long)global_vocab, world);
    int64_t per = global_vocab / world;
    *first = per * rank;
    *last = *first + per;
    return CPAR_OK;
}

cpar_status cpar_pad_vocab_size(int64_t vocab, int64_t multiple, int tp, int64_t *out) {
    static const char fn[] = "cpar_pad_vocab_size";
    if (!out) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    if (vocab < 0) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: vocab is %lld, expected >= 0", fn, (long long)vocab);
    if (multiple < 1)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: multiple is %lld, expected >= 1", fn, (long long)multiple);
    if (tp < 1) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: tp is %d, expected >= 1", fn, tp);
    if (multiple > INT64_MAX / tp)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: multiple %lld x tp %d overflows int64", fn, (long long)multiple, tp);
    int64_t m = multiple * tp, q = vocab / m + (vocab % m != 0);
    if (q > INT64_MAX / m)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: vocab %lld padded to a multiple of %lld overflows int64", fn,
                          (long long)vocab, (long long)m);
    *out = q * m;
    return CPAR_OK;
}

/* Checks of the two view functions: t, n, i, view, and the split dim. */
static cpar_status cpar__check_view(const char *fn, const cpar_tensor *t, int n, int i, const cpar_tensor *view,
                                    int dim, const char *dim_name) {
    CPAR_TRY(cpar__check_tensor(NULL, fn, "t", t, -2));
    if (!view) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: view is NULL", fn);
    if (t->ndim < 1) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: t is a scalar, expected at least 1 dimension", fn);
    if (n < 1) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: n is %d, expected >= 1", fn, n);
    if (i < 0 || i >= n) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: i is %d, expected 0..%d", fn, i, n - 1);
    int d = dim < 0 ? t->ndim - 1 : dim;
    if (t->shape[d] % n)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: t has %s %lld, not divisible by n = %d", fn, dim_name,
                          (long long)t->shape[d], n);
    return CPAR_OK;
}

cpar_status cpar_split_last_dim_view(const cpar_tensor *t, int n, int i, cpar_tensor *view, int64_t *row_stride) {
    CPAR_TRY(cpar__check_view("cpar_split_last_dim_view", t, n, i, view, -1, "last dim"));
    int last = t->ndim - 1;
    int64_t len = t->shape[last], w = len / n;
    cpar_tensor v = *t;
    v.shape[last] = w;
    v.data = cpar__ptr_at(t->data, (size_t)(i * w) * cpar_dtype_size(t->dtype));
    *view = v;
    if (row_stride) *row_stride = len;
    return CPAR_OK;
}

cpar_status cpar_split_first_dim_view(const cpar_tensor *t, int n, int i, cpar_tensor *view) {
    CPAR_TRY(cpar__check_view("cpar_split_first_dim_view", t, n, i, view, 0, "dim 0"));
    int64_t rows = t->shape[0] / n;
    cpar_tensor v = *t;
    v.shape[0] = rows;
    v.data = cpar__ptr_at(t->data, (size_t)(i * rows * cpar__row_elems(t)) * cpar_dtype_size(t->dtype));
    *view = v;
    return CPAR_OK;
}

/* ---- broadcast_data --------------------------------------------------------------- */

enum { CPAR__BCAST_HDR = 2 }; /* status word, rejected key index; then CPAR_BROADCAST_MAX_DIMS per key */

/* Rank 0's checks of its input; on failure *bad is the key (-1: in itself). */
static cpar_status cpar__bcast_check_in(cpar_ctx *ctx, const char *fn, int nkeys, const char *const *keys,
                                        const cpar_tensor *in, cpar_dtype dtype, int *bad) {
    *bad = -1;
    if (!in) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in is NULL on group rank 0, expected %d tensors", fn, nkeys);
    for (int i = 0; i < nkeys; i++) {
        char name[96];
        const cpar_tensor *t = &in[i];
        *bad = i;
        snprintf(name, sizeof name, "in[%d] (key \"%.60s\")", i, keys[i]);
        CPAR_TRY(cpar__check_tensor(ctx, fn, name, t, -2));
        if (t->device != CPAR_HOST && t->device != ctx->device) {
            char got[32];
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is on %s, expected host or the context's device %d", fn,
                              name, cpar__device_str(t->device, got, sizeof got), ctx->device);
        }
        CPAR_TRY(cpar__check_dtype(ctx, fn, name, t, dtype));
        if (t->ndim > CPAR_BROADCAST_MAX_DIMS)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has %d dims, expected at most %d (CPAR_BROADCAST_MAX_DIMS)",
                              fn, name, t->ndim, CPAR_BROADCAST_MAX_DIMS);
    }
    *bad = -1;
    return CPAR_OK;
}

static void cpar__bcast_free_outs(cpar_ctx *ctx, int nkeys, cpar_tensor *out) {
    for (int i = 0; i < nkeys; i++) cpar_tensor_free(ctx, &out[i]);
}

cpar_status cpar_broadcast_data(cpar_group *tp, int nkeys, const char *const *keys, const cpar_tensor *in,
                                cpar_dtype dtype, cpar_tensor *out) {
    static const char fn[] = "cpar_broadcast_data";
    CPAR_TRY(cpar__check_group(tp, fn));
    cpar_ctx *ctx = tp->ctx;
    int dev = ctx->device;
    if (nkeys < 0 || nkeys > (INT_MAX - CPAR__BCAST_HDR) / CPAR_BROADCAST_MAX_DIMS)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: nkeys is %d, expected >= 0", fn, nkeys);
    if (nkeys && !keys) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: keys is NULL", fn);
    for (int i = 0; i < nkeys; i++)
        if (!keys[i]) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: keys[%d] is NULL", fn, i);
    if (nkeys && !out) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    for (int i = 0; i < nkeys; i++) out[i] = cpar_tensor_make(NULL, dtype, 0, NULL, dev);
    if (!cpar__dtype_valid(dtype))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dtype is %d, not a cpar_dtype", fn, (int)dtype);
    if (!nkeys) return CPAR_OK;

    /* 1. The shapes, with rank 0's verdict on its input, so that a rejected
     *    input fails every rank instead of leaving the others waiting. */
    bool root = tp->rank == 0;
    int bad = -1;
    cpar_status mine = root ? cpar__bcast_check_in(ctx, fn, nkeys, keys, in, dtype, &bad) : CPAR_OK;
    int64_t nhdr = CPAR__BCAST_HDR + (int64_t)nkeys * CPAR_BROADCAST_MAX_DIMS;
    int64_t *hdr = malloc((size_t)nhdr * sizeof *hdr);
    if (!hdr) return cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate %lld shape words", fn, (long long)nhdr);
    for (int64_t k = 0; k < nhdr; k++) hdr[k] = -1;
    hdr[0] = mine;
    hdr[1] = bad;
    for (int i = 0; root && mine == CPAR_OK && i < nkeys; i++)
        for (int d = 0; d < in[i].ndim; d++) hdr[CPAR__BCAST_HDR + i * CPAR_BROADCAST_MAX_DIMS + d] = in[i].shape[d];
    cpar_status st;
    void *ws;
    cpar_tensor hdr_t = cpar_tensor_make(NULL, CPAR_I64, 1, &nhdr, dev);
    CPAR_TRY_GOTO(cpar__workspace(ctx, fn, (size_t)nhdr * sizeof *hdr, &ws), st, done);
    hdr_t.data = ws;
    CPAR_TRY_GOTO(cpar__copy_bytes(ctx, fn, ws, dev, hdr, CPAR_HOST, (size_t)nhdr * sizeof *hdr), st, done);
    CPAR__WRAP_GOTO(ctx, fn, cpar_broadcast(tp, &hdr_t, 0), st, done);
    CPAR_TRY_GOTO(cpar__copy_bytes(ctx, fn, hdr, CPAR_HOST, ws, dev, (size_t)nhdr * sizeof *hdr), st, done);
    if (mine != CPAR_OK) {
        st = mine; /* rank 0: its own message stays the last error */
        goto done;
    }
    if (hdr[0] != CPAR_OK) {
        int k = (int)hdr[1];
        if (k >= 0 && k < nkeys)
            st = cpar__fail(ctx, CPAR_ERR_PEER, "%s: group rank 0 (world rank %d) rejected its in[%d] (key \"%.60s\"): "
                            "%s", fn, tp->world_ranks[0], k, keys[k], cpar_status_string((cpar_status)hdr[0]));
        else
            st = cpar__fail(ctx, CPAR_ERR_PEER, "%s: group rank 0 (world rank %d) rejected its input: %s", fn,
                            tp->world_ranks[0], cpar_status_string((cpar_status)hdr[0]));
        goto done;
    }

    /* 2. The data: concatenated on rank 0, one broadcast, split on every rank. */
    size_t es = cpar_dtype_size(dtype), total = 0;
    int64_t shape[CPAR_BROADCAST_MAX_DIMS];
    for (int i = 0; i < nkeys; i++) {
        const int64_t *s = hdr + CPAR__BCAST_HDR + i * CPAR_BROADCAST_MAX_DIMS;
        int nd = 0;
        while (nd < CPAR_BROADCAST_MAX_DIMS && s[nd] >= 0) nd++;
        out[i] = cpar_tensor_make(NULL, dtype, nd, s, dev);
        total += cpar_tensor_nbytes(&out[i]);
    }
    int64_t nelem = (int64_t)(total / es);
    cpar_tensor flat = cpar_tensor_make(NULL, dtype, 1, &nelem, dev);
    CPAR_TRY_GOTO(cpar__workspace(ctx, fn, total, &ws), st, done);
    flat.data = total ? ws : NULL;
    if (root) {
        size_t off = 0;
        for (int i = 0; i < nkeys; i++) {
            size_t b = cpar_tensor_nbytes(&in[i]);
            CPAR_TRY_GOTO(cpar__copy_bytes(ctx, fn, cpar__ptr_at(ws, off), dev, in[i].data, in[i].device, b), st, done);
            off += b;
        }
    }
    CPAR__WRAP_GOTO(ctx, fn, cpar_broadcast(tp, &flat, 0), st, done);
    size_t off = 0;
    for (int i = 0; i < nkeys; i++) {
        cpar_tensor shape_only = out[i];
        int nd = shape_only.ndim;
        memcpy(shape, shape_only.shape, (size_t)nd * sizeof *shape);
        CPAR__WRAP_GOTO(ctx, fn, cpar_tensor_alloc(ctx, dtype, nd, shape, &out[i]), st, done);
        size_t b = cpar_tensor_nbytes(&out[i]);
        CPAR_TRY_GOTO(cpar__copy_bytes(ctx, fn, out[i].data, dev, cpar__ptr_at(ws, off), dev, b), st, done);
        off += b;
    }
    st = CPAR_OK;
done:
    free(hdr);
    if (st != CPAR_OK) cpar__bcast_free_outs(ctx, nkeys, out);
    return st;
}

/* ==== 15. RNG, dropout and checkpointing ==================================
 * Owns cpar.h §9: Philox4x32-10 and the float transforms built on it (the
 * host twin of the device core in cpar_kernels.cu: the same operations in
 * the same order, so both give the same bits), the per-context RNG tracker
 * (cpar_rng_*, cpar_model_parallel_manual_seed), random fills, dropout,
 * activation checkpointing and the 1-D chunk split/gather. Host tensors run
 * the reference loops below; device tensors one kernel each
 * (cpar_dev_rng_*, cpar_dev_dropout_*).
 * Uses: 2 (errors, argument checks), 3 (tensors, fp16/bf16 bits), 4 (device
 * dispatch, copies, allocation), 5 (element load/store), 6 (op tensor
 * checks), 10-11 (groups, all-gather), 13 (grid rank). */

/* ---- Philox4x32-10 and the float transforms (host twin of the device core) --
 * Everything here is exact integer work or single correctly rounded fp32
 * operations (+ - * / sqrt and explicit fmaf), evaluated in a fixed order.
 * The device copy spells the same operations with __fmul_rn & co. so nvcc
 * cannot contract them into different FMAs; this file relies on ISO C's
 * default of no contraction (-std=c11; GNU modes contract only on targets
 * with FMA instructions, e.g. -march=native, which would break bit equality
 * with the GPU by an ulp). */

#define CPAR__PHILOX_M0 0xD2511F53u
#define CPAR__PHILOX_M1 0xCD9E8D57u
#define CPAR__PHILOX_W0 0x9E3779B9u
#define CPAR__PHILOX_W1 0xBB67AE85u
#define CPAR__RNG_2POW_M24 5.9604644775390625e-08f /* 2^-24 */

static void cpar__philox(const uint32_t ctr[4], uint32_t k0, uint32_t k1, uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    for (int r = 0; r < 10; r++) {
        if (r) {
            k0 += CPAR__PHILOX_W0;
            k1 += CPAR__PHILOX_W1;
        }
        uint64_t p0 = (uint64_t)CPAR__PHILOX_M0 * c0, p1 = (uint64_t)CPAR__PHILOX_M1 * c2;
        uint32_t h0 = (uint32_t)(p0 >> 32), l0 = (uint32_t)p0, h1 = (uint32_t)(p1 >> 32), l1 = (uint32_t)p1;
        c0 = h1 ^ c1 ^ k0;
        c1 = l1;
        c2 = h0 ^ c3 ^ k1;
        c3 = l0;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

void cpar_philox4x32_10_block(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
    if (!counter || !key || !out) return;
    cpar__philox(counter, key[0], key[1], out);
}

void cpar_philox4x32_10(uint64_t seed, uint64_t counter, uint32_t out[4]) {
    if (!out) return;
    uint32_t ctr[4] = {(uint32_t)counter, (uint32_t)(counter >> 32), 0, 0};
    cpar__philox(ctr, (uint32_t)seed, (uint32_t)(seed >> 32), out);
}

/* The block of group g (elements 4g..4g+3) of a draw from (seed, offset). */
static void cpar__rng_block(uint64_t seed, uint64_t offset, int64_t g, uint32_t w[4]) {
    cpar_philox4x32_10(seed, offset + (uint64_t)g, w);
}

/* u in [0, 1): the top 24 bits of w times 2^-24 (exact). */
static float cpar__rng_u01(uint32_t w) { return (float)(w >> 8) * CPAR__RNG_2POW_M24; }

/* ln x for a normal float x > 0 (fdlibm's logf reduction and polynomial,
 * FMAs made explicit): < 1 ulp on the inputs Box-Muller feeds it. */
static float cpar__rng_log(float x) {
    uint32_t ix = cpar__f32_bits(x);
    int k = (int)(ix >> 23) - 127;
    ix &= 0x007fffffu;
    uint32_t i = (ix + (0x95f64u << 3)) & 0x800000u; /* mantissa into [sqrt(2)/2, sqrt(2)) */
    float m = cpar__bits_f32(ix | (i ^ 0x3f800000u));
    k += (int)(i >> 23);
    float f = m - 1.0f;
    float s = f / (2.0f + f);
    float z = s * s;
    float w = z * z;
    float t1 = w * fmaf(w, 2.4279078841e-01f, 4.0000972152e-01f);
    float t2 = z * fmaf(w, 2.8498786688e-01f, 6.6666662693e-01f);
    float r = t2 + t1;
    float hfsq = (0.5f * f) * f;
    float dk = (float)k;
    float inner = fmaf(dk, 9.0580006145e-06f, s * (hfsq + r));
    return fmaf(dk, 6.9313812256e-01f, -((hfsq - inner) - f));
}

/* sin and cos of x in [0, pi/4] (Cephes' sinf/cosf polynomials). */
static void cpar__rng_sincos_poly(float x, float *sn, float *cs) {
    float z = x * x;
    float ps = fmaf(fmaf(-1.9515295891e-4f, z, 8.3321608736e-3f), z, -1.6666654611e-1f);
    *sn = fmaf(z * ps, x, x);
    float pc = fmaf(fmaf(2.443315711809948e-5f, z, -1.388731625493765e-3f), z, 4.166664568298827e-2f);
    *cs = fmaf(z * pc, z, fmaf(-0.5f, z, 1.0f));
}

/* sin and cos of 2 pi j / 2^24 for a 24-bit j, < 2 ulp: the octant (top 3
 * bits) is exact, the angle within it is reduced to [0, pi/4] exactly. */
static void cpar__rng_sincos2pi(uint32_t j, float *sn, float *cs) {
    uint32_t o = j >> 21, r = j & 0x1fffffu;
    float x = (float)((o & 1u) ? 0x200000u - r : r) * (0.785398163397448309616f * 4.76837158203125e-07f);
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

/* The four standard normals of one block: Box-Muller on (w0, w1) and (w2, w3). */
static void cpar__rng_normal4(const uint32_t w[4], float z[4]) {
    for (int p = 0; p < 2; p++) {
        float u1 = (float)((w[2 * p] >> 8) + 1u) * CPAR__RNG_2POW_M24; /* (0, 1] */
        float r = sqrtf(-2.0f * cpar__rng_log(u1));
        float sn, cs;
        cpar__rng_sincos2pi(w[2 * p + 1] >> 8, &sn, &cs);
        z[2 * p] = r * cs;
        z[2 * p + 1] = r * sn;
    }
}

/* lo + (hi - lo) * u, kept below hi. */
static float cpar__rng_scale_uniform(uint32_t w, float lo, float hi) {
    float v = fmaf(cpar__rng_u01(w), hi - lo, lo);
    return v < hi ? v : lo;
}

/* ---- host reference kernels ----------------------------------------------- */

static void cpar__host_rng_uniform(void *p, cpar_dtype dt, int64_t n, uint64_t seed, uint64_t offset, float lo,
                                   float hi) {
    for (int64_t g = 0; g * 4 < n; g++) {
        uint32_t w[4];
        cpar__rng_block(seed, offset, g, w);
        for (int e = 0; e < 4 && g * 4 + e < n; e++) cpar__store_f(p, dt, g * 4 + e, cpar__rng_scale_uniform(w[e], lo, hi));
    }
}

static void cpar__host_rng_normal(void *p, cpar_dtype dt, int64_t n, uint64_t seed, uint64_t offset, float mean,
                                  float std) {
    for (int64_t g = 0; g * 4 < n; g++) {
        uint32_t w[4];
        float z[4];
        cpar__rng_block(seed, offset, g, w);
        cpar__rng_normal4(w, z);
        for (int e = 0; e < 4 && g * 4 + e < n; e++) cpar__store_f(p, dt, g * 4 + e, fmaf(z[e], std, mean));
    }
}

/* out = (in * keep) * scale; keep from mask_in when given, else u >= p;
 * mask_out (may be NULL) gets keep. in may equal out. */
static void cpar__host_dropout(const void *in, void *out, const uint8_t *mask_in, uint8_t *mask_out, cpar_dtype dt,
                               int64_t n, float p, float scale, uint64_t seed, uint64_t offset) {
    for (int64_t g = 0; g * 4 < n; g++) {
        uint32_t w[4] = {0, 0, 0, 0};
        if (!mask_in) cpar__rng_block(seed, offset, g, w);
        for (int e = 0; e < 4 && g * 4 + e < n; e++) {
            int64_t i = g * 4 + e;
            int keep = mask_in ? mask_in[i] != 0 : cpar__rng_u01(w[e]) >= p;
            cpar__store_f(out, dt, i, (cpar__load_f(in, dt, i) * (float)keep) * scale);
            if (mask_out) mask_out[i] = (uint8_t)keep;
        }
    }
}

/* ---- the tracker --------------------------------------------------------------
 * struct cpar__rng is plain memory (no pointers): the snapshot plus the stack
 * of open forks. */

typedef struct cpar__rng_fork {
    char name[CPAR_RNG_NAME_MAX]; /* the forked state */
    cpar_rng_state outer;         /* the current state fork replaced */
} cpar__rng_fork;

struct cpar__rng {
    cpar_rng_snapshot s;
    int depth;
    cpar__rng_fork forks[CPAR_RNG_MAX_FORK_DEPTH];
};

/* ctx's tracker, created on first use with current = (default seed, 0);
 * NULL (with the error recorded) when ctx is NULL or memory runs out. */
static struct cpar__rng *cpar__rng_of(cpar_ctx *ctx, const char *fn) {
    if (!ctx) {
        cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
        return NULL;
    }
    if (!ctx->rng) {
        ctx->rng = calloc(1, sizeof *ctx->rng);
        if (!ctx->rng) {
            cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate the RNG tracker (%zu bytes)", fn, sizeof *ctx->rng);
            return NULL;
        }
        ctx->rng->s.current = (cpar_rng_state){CPAR_RNG_DEFAULT_SEED, 0};
    }
    return ctx->rng;
}

/* Declare rng as ctx's tracker or return the failure. */
#define CPAR__RNG_OF(rng, ctx, fn)                                                                           \
    struct cpar__rng *rng = cpar__rng_of((ctx), (fn));                                                       \
    if (!rng) return (ctx) ? CPAR_ERR_OOM : CPAR_ERR_INVALID

static cpar_status cpar__rng_check_name(cpar_ctx *ctx, const char *fn, const char *name) {
    if (!name) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: name is NULL", fn);
    size_t len = strnlen(name, CPAR_RNG_NAME_MAX);
    if (len == 0) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: name is empty, expected 1..%d chars", fn, CPAR_RNG_NAME_MAX - 1);
    if (len >= CPAR_RNG_NAME_MAX)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: name \"%.20s...\" is longer than %d chars", fn, name,
                          CPAR_RNG_NAME_MAX - 1);
    return CPAR_OK;
}

static int cpar__rng_find(const cpar_rng_snapshot *s, const char *name) {
    for (int i = 0; i < s->count; i++)
        if (!strcmp(s->names[i], name)) return i;
    return -1;
}

static cpar_status cpar__rng_unknown(cpar_ctx *ctx, const char *fn, const char *name) {
    return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: name \"%s\" is not a tracked RNG state (cpar_rng_add it first)", fn,
                      name);
}

/* tracker.add with the calling public function's name in messages. */
static cpar_status cpar__rng_add(cpar_ctx *ctx, const char *fn, struct cpar__rng *rng, const char *name,
                                 uint64_t seed) {
    CPAR_TRY(cpar__rng_check_name(ctx, fn, name));
    cpar_rng_snapshot *s = &rng->s;
    for (int i = 0; i < s->count; i++)
        if (s->states[i].seed == seed)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: seed %" PRIu64 " already exists (state \"%s\")", fn, seed,
                              s->names[i]);
    if (cpar__rng_find(s, name) >= 0)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: name \"%s\" already exists", fn, name);
    if (s->count == CPAR_RNG_MAX_STATES)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cannot add \"%s\": the tracker already holds %d states (the limit)",
                          fn, name, CPAR_RNG_MAX_STATES);
    snprintf(s->names[s->count], CPAR_RNG_NAME_MAX, "%s", name);
    s->states[s->count] = (cpar_rng_state){seed, 0};
    s->count++;
    return CPAR_OK;
}

/* Advance the current state past a draw of n elements; returns the state used. */
static cpar_rng_state cpar__rng_draw(struct cpar__rng *rng, int64_t n) {
    cpar_rng_state used = rng->s.current;
    rng->s.current.offset += (uint64_t)((n + 3) / 4);
    return used;
}

cpar_status cpar_rng_manual_seed(cpar_ctx *ctx, uint64_t seed) {
    CPAR__RNG_OF(rng, ctx, "cpar_rng_manual_seed");
    rng->s.current = (cpar_rng_state){seed, 0};
    return CPAR_OK;
}

cpar_status cpar_rng_reset(cpar_ctx *ctx) {
    CPAR__RNG_OF(rng, ctx, "cpar_rng_reset");
    memset(rng->s.names, 0, sizeof rng->s.names);
    memset(rng->s.states, 0, sizeof rng->s.states);
    rng->s.count = 0;
    return CPAR_OK;
}

cpar_status cpar_rng_add(cpar_ctx *ctx, const char *name, uint64_t seed) {
    static const char fn[] = "cpar_rng_add";
    CPAR__RNG_OF(rng, ctx, fn);
    return cpar__rng_add(ctx, fn, rng, name, seed);
}

cpar_status cpar_rng_fork(cpar_ctx *ctx, const char *name) {
    static const char fn[] = "cpar_rng_fork";
    CPAR__RNG_OF(rng, ctx, fn);
    CPAR_TRY(cpar__rng_check_name(ctx, fn, name));
    int i = cpar__rng_find(&rng->s, name);
    if (i < 0) return cpar__rng_unknown(ctx, fn, name);
    if (rng->depth == CPAR_RNG_MAX_FORK_DEPTH)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cannot fork \"%s\": %d forks are open (the limit)", fn, name,
                          CPAR_RNG_MAX_FORK_DEPTH);
    /* Megatron HEAD (test_double_fork_cuda_rng_states_tracker): the open
     * fork's state is saved before switching, so re-forking its name inside
     * continues the in-flight sequence instead of repeating draws. */
    if (rng->depth > 0) {
        int open = cpar__rng_find(&rng->s, rng->forks[rng->depth - 1].name);
        if (open >= 0) rng->s.states[open] = rng->s.current;
    }
    cpar__rng_fork *f = &rng->forks[rng->depth++];
    snprintf(f->name, sizeof f->name, "%s", name);
    f->outer = rng->s.current;
    rng->s.current = rng->s.states[i];
    return CPAR_OK;
}

cpar_status cpar_rng_unfork(cpar_ctx *ctx) {
    static const char fn[] = "cpar_rng_unfork";
    CPAR__RNG_OF(rng, ctx, fn);
    if (rng->depth == 0) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: no fork is open (cpar_rng_fork first)", fn);
    cpar__rng_fork *f = &rng->forks[rng->depth - 1];
    int i = cpar__rng_find(&rng->s, f->name);
    if (i < 0) { /* removed by reset/set_states while forked: the seed's dict assignment re-adds it */
        if (rng->s.count == CPAR_RNG_MAX_STATES)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cannot store \"%s\" back: the tracker holds %d states (the limit)",
                              fn, f->name, CPAR_RNG_MAX_STATES);
        i = rng->s.count++;
        memcpy(rng->s.names[i], f->name, CPAR_RNG_NAME_MAX); /* both NUL-padded arrays */
    }
    rng->s.states[i] = rng->s.current;
    rng->s.current = f->outer;
    rng->depth--;
    memset(f, 0, sizeof *f);
    if (rng->depth > 0) { /* back into the open fork, which inner forks of its name may have advanced */
        int open = cpar__rng_find(&rng->s, rng->forks[rng->depth - 1].name);
        if (open >= 0) rng->s.current = rng->s.states[open];
    }
    return CPAR_OK;
}

cpar_status cpar_rng_get_state(cpar_ctx *ctx, const char *name, cpar_rng_state *out) {
    static const char fn[] = "cpar_rng_get_state";
    CPAR__RNG_OF(rng, ctx, fn);
    if (!out) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    if (!name) {
        *out = rng->s.current;
        return CPAR_OK;
    }
    CPAR_TRY(cpar__rng_check_name(ctx, fn, name));
    int i = cpar__rng_find(&rng->s, name);
    if (i < 0) return cpar__rng_unknown(ctx, fn, name);
    *out = rng->s.states[i];
    return CPAR_OK;
}

cpar_status cpar_rng_set_state(cpar_ctx *ctx, const char *name, const cpar_rng_state *state) {
    static const char fn[] = "cpar_rng_set_state";
    CPAR__RNG_OF(rng, ctx, fn);
    if (!state) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: state is NULL", fn);
    if (!name) {
        rng->s.current = *state;
        return CPAR_OK;
    }
    CPAR_TRY(cpar__rng_check_name(ctx, fn, name));
    int i = cpar__rng_find(&rng->s, name);
    if (i < 0) return cpar__rng_unknown(ctx, fn, name);
    rng->s.states[i] = *state;
    return CPAR_OK;
}

cpar_status cpar_rng_reserve(cpar_ctx *ctx, uint64_t blocks, cpar_rng_state *used) {
    static const char fn[] = "cpar_rng_reserve";
    CPAR__RNG_OF(rng, ctx, fn);
    if (!used) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: used is NULL", fn);
    /* a wrapped offset would hand out blocks that earlier draws used */
    if (blocks > UINT64_MAX - rng->s.current.offset)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: blocks = %llu, expected <= %llu (the current offset %llu would wrap past 2^64)", fn,
                          (unsigned long long)blocks, (unsigned long long)(UINT64_MAX - rng->s.current.offset),
                          (unsigned long long)rng->s.current.offset);
    *used = rng->s.current;
    rng->s.current.offset += blocks;
    return CPAR_OK;
}

cpar_status cpar_rng_get_states(cpar_ctx *ctx, cpar_rng_snapshot *out) {
    static const char fn[] = "cpar_rng_get_states";
    CPAR__RNG_OF(rng, ctx, fn);
    if (!out) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    *out = rng->s;
    return CPAR_OK;
}

static cpar_status cpar__rng_check_snapshot(cpar_ctx *ctx, const char *fn, const char *arg,
                                            const cpar_rng_snapshot *s) {
    if (!s) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is NULL", fn, arg);
    if (s->count < 0 || s->count > CPAR_RNG_MAX_STATES)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has count %d, expected 0..%d", fn, arg, s->count,
                          CPAR_RNG_MAX_STATES);
    for (int i = 0; i < s->count; i++) {
        size_t len = strnlen(s->names[i], CPAR_RNG_NAME_MAX);
        if (len == 0 || len == CPAR_RNG_NAME_MAX)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s names[%d] is %s, expected 1..%d chars", fn, arg, i,
                              len ? "not NUL-terminated" : "empty", CPAR_RNG_NAME_MAX - 1);
        for (int j = 0; j < i; j++)
            if (!strcmp(s->names[i], s->names[j]))
                return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s names[%d] and names[%d] are both \"%s\"", fn, arg, j,
                                  i, s->names[i]);
    }
    return CPAR_OK;
}

/* Replace the snapshot part of the tracker (names normalised: bytes after
 * each NUL cleared, unused slots zeroed, so snapshots compare with memcmp). */
static void cpar__rng_put(struct cpar__rng *rng, const cpar_rng_snapshot *s) {
    cpar_rng_snapshot t;
    memset(&t, 0, sizeof t);
    t.current = s->current;
    t.count = s->count;
    for (int i = 0; i < s->count; i++) {
        snprintf(t.names[i], CPAR_RNG_NAME_MAX, "%s", s->names[i]);
        t.states[i] = s->states[i];
    }
    rng->s = t;
}

cpar_status cpar_rng_set_states(cpar_ctx *ctx, const cpar_rng_snapshot *snapshot) {
    static const char fn[] = "cpar_rng_set_states";
    CPAR__RNG_OF(rng, ctx, fn);
    CPAR_TRY(cpar__rng_check_snapshot(ctx, fn, "snapshot", snapshot));
    cpar__rng_put(rng, snapshot);
    return CPAR_OK;
}

cpar_status cpar_model_parallel_manual_seed(cpar_ctx *ctx, uint64_t seed, int tp_rank, int ep_rank, int etp_rank) {
    static const char fn[] = "cpar_model_parallel_manual_seed";
    CPAR__RNG_OF(rng, ctx, fn);
    if (tp_rank < 0) {
        tp_rank = cpar_grid_rank(ctx, CPAR_GROUP_TP);
        if (tp_rank < 0) tp_rank = 0;
    }
    if (ep_rank < 0) ep_rank = 0;
    if (etp_rank < 0) etp_rank = 0;
    CPAR_TRY(cpar_rng_reset(ctx));
    rng->s.current = (cpar_rng_state){seed, 0};
    CPAR_TRY(cpar__rng_add(ctx, fn, rng, CPAR_RNG_DATA_PARALLEL, seed));
    CPAR_TRY(cpar__rng_add(ctx, fn, rng, CPAR_RNG_MODEL_PARALLEL, seed + 2718u + (uint64_t)tp_rank));
    return cpar__rng_add(ctx, fn, rng, CPAR_RNG_EXPERT_PARALLEL,
                         seed + 1024u + 100u * (uint64_t)ep_rank + (uint64_t)etp_rank);
}

/* ---- random fills ---------------------------------------------------------------- */

static cpar_status cpar__rng_fill_tensor(cpar_ctx *ctx, const char *fn, cpar_tensor *t, struct cpar__rng **rng) {
    if (!(*rng = cpar__rng_of(ctx, fn))) return ctx ? CPAR_ERR_OOM : CPAR_ERR_INVALID;
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "t", t));
    return cpar__check_float(ctx, fn, "t", t);
}

cpar_status cpar_rng_uniform(cpar_ctx *ctx, cpar_tensor *t, float lo, float hi) {
    static const char fn[] = "cpar_rng_uniform";
    struct cpar__rng *rng;
    CPAR_TRY(cpar__rng_fill_tensor(ctx, fn, t, &rng));
    if (!isfinite(lo) || !isfinite(hi) || !(lo <= hi) || !isfinite(hi - lo))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: lo = %g, hi = %g, expected finite lo <= hi with hi - lo finite",
                          fn, (double)lo, (double)hi);
    int64_t n = cpar_tensor_numel(t);
    cpar_rng_state st = rng->s.current;
    if (!cpar__on_device(t->device)) cpar__host_rng_uniform(t->data, t->dtype, n, st.seed, st.offset, lo, hi);
    else CPAR_DEV_TRY(ctx, fn, cpar_dev_rng_uniform(t->data, t->dtype, n, st.seed, st.offset, lo, hi, ctx->compute));
    cpar__rng_draw(rng, n);
    return CPAR_OK;
}

cpar_status cpar_rng_normal(cpar_ctx *ctx, cpar_tensor *t, float mean, float std) {
    static const char fn[] = "cpar_rng_normal";
    struct cpar__rng *rng;
    CPAR_TRY(cpar__rng_fill_tensor(ctx, fn, t, &rng));
    if (!isfinite(mean)) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: mean is %g, expected a finite value", fn, (double)mean);
    if (!isfinite(std) || !(std >= 0.0f))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: std is %g, expected finite and >= 0", fn, (double)std);
    int64_t n = cpar_tensor_numel(t);
    cpar_rng_state st = rng->s.current;
    if (!cpar__on_device(t->device)) cpar__host_rng_normal(t->data, t->dtype, n, st.seed, st.offset, mean, std);
    else CPAR_DEV_TRY(ctx, fn, cpar_dev_rng_normal(t->data, t->dtype, n, st.seed, st.offset, mean, std, ctx->compute));
    cpar__rng_draw(rng, n);
    return CPAR_OK;
}

/* ---- dropout ----------------------------------------------------------------------- */

static cpar_status cpar__check_dropout_p(cpar_ctx *ctx, const char *fn, float p) {
    if (p >= 0.0f && p < 1.0f) return CPAR_OK;
    return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: p is %g, expected 0 <= p < 1", fn, (double)p);
}

/* in/out pair (x, y or dy, dx) and the optional mask: float dtype, same
 * dtype, device and element count; out == in or disjoint; mask U8,
 * disjoint from both. */
static cpar_status cpar__check_dropout_args(cpar_ctx *ctx, const char *fn, const char *in_name, const cpar_tensor *in,
                                            const char *out_name, const cpar_tensor *out, const cpar_tensor *mask) {
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, in_name, in));
    CPAR_TRY(cpar__check_float(ctx, fn, in_name, in));
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, out_name, out));
    CPAR_TRY(cpar__check_dtype(ctx, fn, out_name, out, in->dtype));
    CPAR_TRY(cpar__check_same_place(ctx, fn, out_name, out, in_name, in));
    size_t nb = cpar_tensor_nbytes(in);
    if (out->data != in->data && cpar__ranges_overlap(in->data, nb, out->data, nb))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s partially overlaps %s (only %s == %s is allowed)", fn, out_name,
                          in_name, out_name, in_name);
    if (mask) {
        CPAR_TRY(cpar__check_op_tensor(ctx, fn, "mask", mask));
        CPAR_TRY(cpar__check_dtype(ctx, fn, "mask", mask, CPAR_U8));
        CPAR_TRY(cpar__check_same_place(ctx, fn, "mask", mask, in_name, in));
        size_t mb = cpar_tensor_nbytes(mask);
        if (cpar__ranges_overlap(mask->data, mb, in->data, nb) || cpar__ranges_overlap(mask->data, mb, out->data, nb))
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: mask overlaps %s or %s", fn, in_name, out_name);
    }
    return CPAR_OK;
}

cpar_status cpar_dropout_forward(cpar_ctx *ctx, float p, const cpar_tensor *x, cpar_tensor *y, cpar_tensor *mask,
                                 cpar_rng_state *used) {
    static const char fn[] = "cpar_dropout_forward";
    CPAR__RNG_OF(rng, ctx, fn);
    CPAR_TRY(cpar__check_dropout_p(ctx, fn, p));
    CPAR_TRY(cpar__check_dropout_args(ctx, fn, "x", x, "y", y, mask));
    int64_t n = cpar_tensor_numel(x);
    float scale = 1.0f / (1.0f - p);
    cpar_rng_state st = rng->s.current;
    uint8_t *m = mask ? mask->data : NULL;
    if (!cpar__on_device(x->device)) cpar__host_dropout(x->data, y->data, NULL, m, x->dtype, n, p, scale, st.seed, st.offset);
    else
        CPAR_DEV_TRY(ctx, fn, cpar_dev_dropout_forward(x->data, y->data, m, x->dtype, n, p, scale, st.seed, st.offset,
                                                       ctx->compute));
    if (p > 0.0f) cpar__rng_draw(rng, n); /* p == 0 keeps everything: nothing drawn, as torch */
    if (used) *used = st;
    return CPAR_OK;
}

cpar_status cpar_dropout_backward(cpar_ctx *ctx, float p, const cpar_tensor *dy, cpar_tensor *dx,
                                  const cpar_tensor *mask, const cpar_rng_state *state) {
    static const char fn[] = "cpar_dropout_backward";
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    CPAR_TRY(cpar__check_dropout_p(ctx, fn, p));
    CPAR_TRY(cpar__check_dropout_args(ctx, fn, "dy", dy, "dx", dx, mask));
    if (!mask && !state && p > 0.0f)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: mask and state are both NULL (one is needed to know what was kept)", fn);
    int64_t n = cpar_tensor_numel(dy);
    float scale = 1.0f / (1.0f - p);
    cpar_rng_state st = state ? *state : (cpar_rng_state){0, 0};
    const uint8_t *m = mask ? mask->data : NULL;
    if (!cpar__on_device(dy->device)) cpar__host_dropout(dy->data, dx->data, m, NULL, dy->dtype, n, p, scale, st.seed, st.offset);
    else
        CPAR_DEV_TRY(ctx, fn, cpar_dev_dropout_backward(dy->data, dx->data, m, dy->dtype, n, p, scale, st.seed,
                                                        st.offset, ctx->compute));
    return CPAR_OK;
}

/* ---- 1-D chunks (distribute_saved_activations) --------------------------------- */

cpar_status cpar_split_1d_chunk(cpar_group *g, const cpar_tensor *in, cpar_tensor *out) {
    static const char fn[] = "cpar_split_1d_chunk";
    CPAR_TRY(cpar__check_group(g, fn));
    cpar_ctx *ctx = g->ctx;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "in", in, ctx->device));
    CPAR_TRY(cpar__check_tensor(ctx, fn, "out", out, ctx->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "out", out, in->dtype));
    int64_t n = cpar_tensor_numel(in), m = n / g->size;
    if (n % g->size)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in has %lld elements, not divisible by the group size %d", fn,
                          (long long)n, g->size);
    if (cpar_tensor_numel(out) != m)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out has %lld elements, expected %lld (numel(in) %lld / group size %d)",
                          fn, (long long)cpar_tensor_numel(out), (long long)m, (long long)n, g->size);
    size_t es = cpar_dtype_size(in->dtype), bytes = (size_t)m * es;
    const char *src = (const char *)in->data + (size_t)(g->rank * m) * es;
    if (out->data != src && cpar__ranges_overlap(src, bytes, out->data, bytes))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out overlaps this rank's chunk of in", fn);
    return cpar__copy_bytes(ctx, fn, out->data, out->device, src, in->device, bytes);
}

cpar_status cpar_gather_1d_chunks(cpar_group *g, const cpar_tensor *chunk, cpar_tensor *out) {
    static const char fn[] = "cpar_gather_1d_chunks";
    CPAR_TRY(cpar__check_group(g, fn));
    cpar_ctx *ctx = g->ctx;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "chunk", chunk, ctx->device));
    CPAR_TRY(cpar__check_tensor(ctx, fn, "out", out, ctx->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "out", out, chunk->dtype));
    int64_t m = cpar_tensor_numel(chunk), total = 0;
    if (!cpar__mul64(m, g->size, &total))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: chunk has %lld elements; %d ranks' chunks overflow int64", fn,
                          (long long)m, g->size);
    if (cpar_tensor_numel(out) != total)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out has %lld elements, expected %lld (group size %d x %lld)", fn,
                          (long long)cpar_tensor_numel(out), (long long)total, g->size, (long long)m);
    if (cpar__ranges_overlap(chunk->data, cpar_tensor_nbytes(chunk), out->data, cpar_tensor_nbytes(out)))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out overlaps chunk", fn);
    cpar_tensor in1 = cpar_tensor_make(chunk->data, chunk->dtype, 1, &m, chunk->device);
    cpar_tensor out1 = cpar_tensor_make(out->data, out->dtype, 1, &total, out->device);
    return cpar__as(ctx, fn, cpar_all_gather(g, &in1, &out1, NULL));
}

/* ---- activation checkpointing ---------------------------------------------------- */

static cpar_status cpar__ckpt_args(cpar_ctx *ctx, const char *fn, const cpar_checkpoint *ck, struct cpar__rng **rng) {
    if (!(*rng = cpar__rng_of(ctx, fn))) return ctx ? CPAR_ERR_OOM : CPAR_ERR_INVALID;
    if (!ck) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: ck is NULL", fn);
    return CPAR_OK;
}

cpar_status cpar_checkpoint_forward(cpar_ctx *ctx, cpar_checkpoint *ck, cpar_checkpoint_fn fn, void *arg) {
    static const char name[] = "cpar_checkpoint_forward";
    struct cpar__rng *rng;
    CPAR_TRY(cpar__ckpt_args(ctx, name, ck, &rng));
    if (!fn) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: fn is NULL", name);
    ck->rng = rng->s;
    ck->fork_depth = rng->depth; /* the recomputation runs inside the same forks */
    for (int i = 0; i < rng->depth; i++) memcpy(ck->forks[i], rng->forks[i].name, CPAR_RNG_NAME_MAX);
    ck->recorded = true;
    ck->distributed = false; /* a new step: a chunk left from the last one is stale */
    return fn(ctx, arg);
}

cpar_status cpar_checkpoint_recompute(cpar_ctx *ctx, cpar_checkpoint *ck, cpar_checkpoint_fn fn, void *arg) {
    static const char name[] = "cpar_checkpoint_recompute";
    struct cpar__rng *rng;
    CPAR_TRY(cpar__ckpt_args(ctx, name, ck, &rng));
    if (!fn) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: fn is NULL", name);
    if (!ck->recorded)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: ck holds no recorded states (run cpar_checkpoint_forward first)",
                          name);
    if (ck->distributed)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: ck's activation is still distributed (run cpar_checkpoint_gather first)", name);
    CPAR_TRY(cpar__rng_check_snapshot(ctx, name, "ck->rng", &ck->rng));
    if (ck->fork_depth < 0 || ck->fork_depth > CPAR_RNG_MAX_FORK_DEPTH)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: ck->fork_depth is %d, expected 0..%d (ck was not recorded "
                          "by cpar_checkpoint_forward)", name, ck->fork_depth, CPAR_RNG_MAX_FORK_DEPTH);
    struct cpar__rng saved = *rng; /* _fork_rng: every state and the open forks */
    cpar__rng_put(rng, &ck->rng);
    /* The forks open at the forward are open again (a nested fork inside fn
     * saves and resumes them by name, as it did then). */
    rng->depth = ck->fork_depth;
    for (int i = 0; i < ck->fork_depth; i++) {
        snprintf(rng->forks[i].name, CPAR_RNG_NAME_MAX, "%.*s", CPAR_RNG_NAME_MAX - 1, ck->forks[i]);
        rng->forks[i].outer = ck->rng.current;
    }
    cpar_status st = fn(ctx, arg);
    *rng = saved;
    return st;
}

cpar_status cpar_checkpoint_distribute(cpar_ctx *ctx, cpar_checkpoint *ck, cpar_group *g,
                                       const cpar_tensor *activation) {
    static const char fn[] = "cpar_checkpoint_distribute";
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    if (!ck) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: ck is NULL", fn);
    if (!g) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: g is NULL", fn);
    if (g->ctx != ctx) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: g belongs to another context", fn);
    CPAR_TRY(cpar__check_tensor(ctx, fn, "activation", activation, ctx->device));
    int64_t n = cpar_tensor_numel(activation), m = n / g->size;
    if (n % g->size)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: activation has %lld elements, not divisible by the group size %d",
                          fn, (long long)n, g->size);
    size_t bytes = (size_t)m * cpar_dtype_size(activation->dtype);
    if (ck->chunk && (ck->chunk_cap < bytes || ck->chunk_device != ctx->device)) {
        if (cpar__on_device(ck->chunk_device)) CPAR_TRY(cpar__streams_quiet(ctx, fn));
        CPAR_DEV_TRY(ctx, fn, cpar__mem_free(ck->chunk_device, ck->chunk));
        ck->chunk = NULL;
        ck->chunk_cap = 0;
    }
    if (!ck->chunk) {
        CPAR_TRY(cpar__mem_alloc(ctx, fn, ctx->device, bytes, &ck->chunk));
        ck->chunk_cap = bytes;
        ck->chunk_device = ctx->device;
    }
    cpar_tensor view = cpar_tensor_make(ck->chunk, activation->dtype, 1, &m, ctx->device);
    CPAR_TRY(cpar_split_1d_chunk(g, activation, &view));
    ck->distributed = true;
    ck->dtype = activation->dtype;
    ck->numel = n;
    ck->group_size = g->size;
    return CPAR_OK;
}

cpar_status cpar_checkpoint_gather(cpar_ctx *ctx, cpar_checkpoint *ck, cpar_group *g, cpar_tensor *activation) {
    static const char fn[] = "cpar_checkpoint_gather";
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    if (!ck) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: ck is NULL", fn);
    if (!g) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: g is NULL", fn);
    if (g->ctx != ctx) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: g belongs to another context", fn);
    if (!ck->distributed)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: ck holds no distributed activation (cpar_checkpoint_distribute first)",
                          fn);
    if (g->size != ck->group_size)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: g has %d ranks, expected %d (the group that distributed)", fn,
                          g->size, ck->group_size);
    CPAR_TRY(cpar__check_tensor(ctx, fn, "activation", activation, ctx->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "activation", activation, ck->dtype));
    if (cpar_tensor_numel(activation) != ck->numel)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: activation has %lld elements, expected %lld (as distributed)", fn,
                          (long long)cpar_tensor_numel(activation), (long long)ck->numel);
    int64_t m = ck->numel / ck->group_size;
    cpar_tensor view = cpar_tensor_make(ck->chunk, ck->dtype, 1, &m, ck->chunk_device);
    CPAR_TRY(cpar_gather_1d_chunks(g, &view, activation));
    ck->distributed = false;
    return CPAR_OK;
}

cpar_status cpar_checkpoint_release(cpar_ctx *ctx, cpar_checkpoint *ck) {
    static const char fn[] = "cpar_checkpoint_release";
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    if (!ck) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: ck is NULL", fn);
    if (ck->chunk) {
        if (cpar__on_device(ck->chunk_device)) CPAR_TRY(cpar__streams_quiet(ctx, fn));
        CPAR_DEV_TRY(ctx, fn, cpar__mem_free(ck->chunk_device, ck->chunk));
    }
    memset(ck, 0, sizeof *ck);
    return CPAR_OK;
}

/* ==== 16. Embedding and cross entropy =====================================
 * Owns cpar.h §10: the vocabulary-parallel embedding (masked lookup, then
 * all-reduce or transpose + reduce-scatter; backward: all-gather when
 * sequence parallel, then a deterministic or atomic scatter-add into the fp32
 * main grad) and the vocabulary-parallel cross entropy (forward: one pass
 * over the local logits, an all-reduce MAX and one packed all-reduce SUM, then
 * an element-wise finish; backward: one element-wise pass, no communication).
 * Host tensors run the reference loops below (fp64 accumulation), device
 * tensors the cpar_dev_xent_* kernels of cpar_kernels.cu. Scratch comes from
 * the context workspace. Also the cpar_embedding layer object: weight and
 * main grad allocated at create, init from a master table or under the
 * model-parallel RNG fork, forward/backward through the functional calls.
 * Uses: 2 (errors, argument checks), 3 (tensors), 4 (device dispatch,
 * workspace), 5 (element load/store), 6 (cpar_fill, cpar_cast), 10-11
 * (groups, all-reduce), 14 (cpar_vocab_range), 15 (RNG fork, normal fills). */

/* Workspace scratch of `bytes`; it stays valid across the collectives, which
 * keep their own accumulator. */
static cpar_status cpar__xent_scratch(cpar_ctx *ctx, const char *fn, size_t bytes, void **out) {
    return cpar__workspace(ctx, fn, bytes, out);
}

static int64_t cpar__xent_target_at(const void *t, cpar_dtype dt, int64_t i) {
    return dt == CPAR_I32 ? (int64_t)((const int32_t *)t)[i] : ((const int64_t *)t)[i];
}

/* The checks forward and backward share; *rows = tokens, *cols = v_local,
 * *first = this rank's first vocabulary index, *vocab = V, *s = the scaled
 * smoothing a V / (V - 1). */
static cpar_status cpar__xent_check(cpar_group *tp, const char *fn, const cpar_tensor *logits,
                                    const cpar_tensor *target, float label_smoothing, int64_t *rows, int64_t *cols,
                                    int64_t *first, int64_t *vocab, float *s) {
    CPAR_TRY(cpar__check_group(tp, fn));
    cpar__coll_pending(tp, fn);
    cpar_ctx *ctx = tp->ctx;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "logits", logits, ctx->device));
    CPAR_TRY(cpar__check_tensor(ctx, fn, "target", target, ctx->device));
    CPAR_TRY(cpar__check_float(ctx, fn, "logits", logits));
    if (target->dtype != CPAR_I32 && target->dtype != CPAR_I64)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: target has dtype %s, expected i32 or i64", fn,
                          cpar_dtype_name(target->dtype));
    if (logits->ndim < 1 || logits->shape[logits->ndim - 1] < 1) {
        char got[128];
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: logits has shape %s, expected [..., v_local] with v_local >= 1",
                          fn, cpar__shape_str(logits, got, sizeof got));
    }
    CPAR_TRY(cpar__check_shape(ctx, fn, "target", target, logits->shape, logits->ndim - 1, "logits' shape without its last dim"));
    if (!(label_smoothing >= 0.f && label_smoothing < 1.f))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: label_smoothing is %g, expected in [0, 1)", fn,
                          (double)label_smoothing);
    *cols = logits->shape[logits->ndim - 1];
    *rows = cpar_tensor_numel(target);
    *vocab = *cols * tp->size;
    *first = *cols * tp->rank;
    if (label_smoothing > 0.f && *vocab < 2)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: label_smoothing is %g with a vocabulary of %lld, expected >= 2 entries",
                          fn, (double)label_smoothing, (long long)*vocab);
    *s = label_smoothing > 0.f ? (float)((double)label_smoothing * (double)*vocab / (double)(*vocab - 1)) : 0.f;
    /* Host tensors: targets outside [0, V) are an error (device: NaN loss, see cpar.h §10). */
    if (!cpar__on_device(target->device))
        for (int64_t i = 0; i < *rows; i++) {
            int64_t t = cpar__xent_target_at(target->data, target->dtype, i);
            if (t < 0 || t >= *vocab)
                return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: target[%lld] is %lld, expected in [0, %lld) (the global vocab)",
                                  fn, (long long)i, (long long)t, (long long)*vocab);
        }
    cpar__tag_set(tp, "%s(logits %s, target %s, label_smoothing %g)", fn, cpar_dtype_name(logits->dtype),
                  cpar_dtype_name(target->dtype), (double)*s);
    return CPAR_OK;
}

/* Host reference of cpar_dev_xent_local, one pass over the logits: each
 * L1-sized block of a row gives its max, the running max m moves up to it
 * (the sum so far rescaled by e^(m_old - m) in fp64), then the block adds
 * e^(z - m) (cpar__expf; a logit equal to m adds exactly 1, also when m is
 * infinite) into lanes (cpar__blk_sum), and z into the label-smoothing
 * sum. NaN logits never become the max (fmaxf's rule) and make the sum NaN. */
CPAR__INLINE void cpar__host_xent_local_body(const void *logits, cpar_dtype dt, const void *target, cpar_dtype tdt,
                                             int64_t rows, int64_t cols, int64_t first, int64_t vocab, bool smooth,
                                             float *m_loc, float *part, bool fused) {
    float zb[CPAR__BLK], eb[CPAR__BLK];
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * cols, t = cpar__xent_target_at(target, tdt, r);
        float m = -INFINITY;
        double sum[CPAR__LANES] = {0}, zsum[CPAR__LANES] = {0};
        CPAR__BLOCKS(cols, j0, n, const float *z = cpar__blk_in(zb, logits, dt, base + j0, n);
                     float mx[CPAR__LANES];
                     for (int l = 0; l < CPAR__LANES; l++) mx[l] = -INFINITY;
                     int k = 0;
                     for (; k + CPAR__LANES <= n; k += CPAR__LANES)
                         for (int l = 0; l < CPAR__LANES; l++) mx[l] = z[k + l] > mx[l] ? z[k + l] : mx[l];
                     for (; k < n; k++) mx[0] = z[k] > mx[0] ? z[k] : mx[0];
                     float bm = m;
                     for (int l = 0; l < CPAR__LANES; l++) bm = mx[l] > bm ? mx[l] : bm;
                     if (bm > m) {
                         const double f = exp((double)m - (double)bm);
                         for (int l = 0; l < CPAR__LANES; l++) sum[l] *= f;
                         m = bm;
                     }
                     if (isfinite(m))
                         for (int j = 0; j < n; j++) eb[j] = cpar__expf(z[j] - m, fused);
                     else /* z - m is NaN where z == m = inf; the select as a mask: see cpar__pick */
                         for (int j = 0; j < n; j++) {
                             const float e = cpar__expf(z[j] - m, fused);
                             eb[j] = cpar__bits_f32(cpar__pick(z[j] == m, cpar__f32_bits(1.0f), cpar__f32_bits(e)));
                         }
                     cpar__blk_sum(sum, eb, NULL, n);
                     if (smooth) cpar__blk_sum(zsum, z, NULL, n);)
        m_loc[r] = m;
        part[r] = (float)cpar__lanes_sum(sum);
        part[rows + r] = t < 0 || t >= vocab ? NAN : t >= first && t < first + cols ? cpar__load_f(logits, dt, base + t - first) : 0.f;
        if (smooth) part[2 * rows + r] = (float)cpar__lanes_sum(zsum);
    }
}
CPAR__VARIANTS_FMA(cpar__host_xent_local,
               (const void *logits, cpar_dtype dt, const void *target, cpar_dtype tdt, int64_t rows, int64_t cols,
                int64_t first, int64_t vocab, bool smooth, float *m_loc, float *part),
               (logits, dt, target, tdt, rows, cols, first, vocab, smooth, m_loc, part))

static void cpar__host_xent_finalize(const float *m, const float *part, int64_t rows, int64_t vocab, float s,
                                     bool smooth, float *loss, float *stats) {
    for (int64_t r = 0; r < rows; r++) {
        double log_sum = log((double)part[r]), lse = (double)m[r] + log_sum;
        double nll = ((double)m[r] - (double)part[rows + r]) + log_sum; /* lse - z_t */
        double l = nll;
        if (smooth) l = (1.0 - s) * nll - s * ((double)part[2 * rows + r] / (double)vocab - lse);
        loss[r] = (float)l;
        stats[2 * r] = m[r];
        stats[2 * r + 1] = (float)lse;
    }
}

cpar_status cpar_vocab_parallel_cross_entropy_forward(cpar_group *tp, const cpar_tensor *logits,
                                                      const cpar_tensor *target, float label_smoothing,
                                                      cpar_tensor *loss, cpar_tensor *stats) {
    static const char fn[] = "cpar_vocab_parallel_cross_entropy_forward";
    int64_t rows, cols, first, vocab;
    float s;
    CPAR_TRY(cpar__xent_check(tp, fn, logits, target, label_smoothing, &rows, &cols, &first, &vocab, &s));
    cpar_ctx *ctx = tp->ctx;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "loss", loss, ctx->device));
    CPAR_TRY(cpar__check_tensor(ctx, fn, "stats", stats, ctx->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "loss", loss, CPAR_F32));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "stats", stats, CPAR_F32));
    CPAR_TRY(cpar__check_shape(ctx, fn, "loss", loss, target->shape, target->ndim, "target's shape"));
    int64_t sshape[CPAR_MAX_DIMS];
    memcpy(sshape, target->shape, sizeof sshape);
    sshape[target->ndim] = 2; /* target->ndim < CPAR_MAX_DIMS: it is logits' ndim - 1 */
    CPAR_TRY(cpar__check_shape(ctx, fn, "stats", stats, sshape, target->ndim + 1, "target's shape + [2]: max, lse"));
    if (rows == 0) return CPAR_OK;

    const bool smooth = s > 0.f, dev = cpar__on_device(ctx->device);
    const int64_t k = smooth ? 3 : 2;
    /* scratch: m_loc [rows] | m [rows] | part [k, rows] */
    float *m_loc, *m, *part;
    void *scratch;
    CPAR_TRY(cpar__xent_scratch(ctx, fn, (size_t)((2 + k) * rows) * sizeof(float), &scratch));
    m_loc = scratch;
    m = m_loc + rows;
    part = m + rows;
    if (dev)
        CPAR_DEV_TRY(ctx, fn, cpar_dev_xent_local(logits->data, logits->dtype, target->data, target->dtype, rows, cols,
                                                  first, vocab, smooth, m_loc, part, ctx->compute));
    else
        cpar__host_xent_local(logits->data, logits->dtype, target->data, target->dtype, rows, cols, first, vocab,
                              smooth, m_loc, part);
    cpar_tensor t_mloc = cpar_tensor_make(m_loc, CPAR_F32, 1, &rows, ctx->device);
    cpar_tensor t_m = cpar_tensor_make(m, CPAR_F32, 1, &rows, ctx->device);
    int64_t pshape[2] = {k, rows};
    cpar_tensor t_part = cpar_tensor_make(part, CPAR_F32, 2, pshape, ctx->device);
    CPAR_TRY(cpar__as(ctx, fn, cpar_all_reduce(tp, &t_mloc, &t_m, CPAR_MAX)));
    if (dev) {
        CPAR_DEV_TRY(ctx, fn, cpar_dev_xent_rescale(part, m_loc, m, rows, ctx->compute));
    } else {
        for (int64_t r = 0; r < rows; r++)
            if (m_loc[r] != m[r]) part[r] = (float)((double)part[r] * exp((double)m_loc[r] - (double)m[r]));
    }
    CPAR_TRY(cpar__as(ctx, fn, cpar_all_reduce(tp, &t_part, &t_part, CPAR_SUM)));
    if (dev)
        CPAR_DEV_TRY(ctx, fn, cpar_dev_xent_finalize(m, part, rows, vocab, s, smooth, loss->data, stats->data, ctx->compute));
    else
        cpar__host_xent_finalize(m, part, rows, vocab, s, smooth, loss->data, stats->data);
    return CPAR_OK;
}

/* One read and one write of the logits: dz = (e^(z - lse) - s/V) dl in fp32
 * (cpar__expf), except the target's entry, which subtracts 1 - s in fp64
 * from its logit read before the row is written (dlogits may be logits). */
CPAR__INLINE void cpar__host_xent_backward_body(const void *logits, void *dlogits, cpar_dtype dt, const void *target,
                                                cpar_dtype tdt, const float *stats, const float *dloss, int64_t rows,
                                                int64_t cols, int64_t first, int64_t vocab, float s, bool fused) {
    const double uniform = (double)s / (double)vocab, hit = 1.0 - (double)s;
    const float uf = (float)uniform;
    float zb[CPAR__BLK], ob[CPAR__BLK];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = cpar__xent_target_at(target, tdt, r) - first, base = r * cols;
        const float lse = stats[2 * r + 1], dl = dloss[r];
        const bool mine = t >= 0 && t < cols;
        double dt_hit = 0.0;
        if (mine) dt_hit = (exp((double)cpar__load_f(logits, dt, base + t) - (double)lse) - uniform - hit) * (double)dl;
        CPAR__BLOCKS(cols, j0, n, const float *z = cpar__blk_in(zb, logits, dt, base + j0, n);
                     float *o = cpar__blk_dst(ob, dlogits, dt, base + j0);
                     CPAR__IVDEP for (int k = 0; k < n; k++) o[k] = (cpar__expf(z[k] - lse, fused) - uf) * dl;
                     cpar__blk_out(dlogits, dt, base + j0, o, n);)
        if (mine) cpar__store_f(dlogits, dt, base + t, (float)dt_hit);
    }
}
CPAR__VARIANTS_FMA(cpar__host_xent_backward,
               (const void *logits, void *dlogits, cpar_dtype dt, const void *target, cpar_dtype tdt,
                const float *stats, const float *dloss, int64_t rows, int64_t cols, int64_t first, int64_t vocab,
                float s),
               (logits, dlogits, dt, target, tdt, stats, dloss, rows, cols, first, vocab, s))

cpar_status cpar_vocab_parallel_cross_entropy_backward(cpar_group *tp, const cpar_tensor *logits,
                                                       const cpar_tensor *target, float label_smoothing,
                                                       const cpar_tensor *stats, const cpar_tensor *dloss,
                                                       cpar_tensor *dlogits) {
    static const char fn[] = "cpar_vocab_parallel_cross_entropy_backward";
    int64_t rows, cols, first, vocab;
    float s;
    CPAR_TRY(cpar__xent_check(tp, fn, logits, target, label_smoothing, &rows, &cols, &first, &vocab, &s));
    cpar_ctx *ctx = tp->ctx;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "stats", stats, ctx->device));
    CPAR_TRY(cpar__check_tensor(ctx, fn, "dloss", dloss, ctx->device));
    CPAR_TRY(cpar__check_tensor(ctx, fn, "dlogits", dlogits, ctx->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "stats", stats, CPAR_F32));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "dloss", dloss, CPAR_F32));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "dlogits", dlogits, logits->dtype));
    int64_t sshape[CPAR_MAX_DIMS];
    memcpy(sshape, target->shape, sizeof sshape);
    sshape[target->ndim] = 2;
    CPAR_TRY(cpar__check_shape(ctx, fn, "stats", stats, sshape, target->ndim + 1, "target's shape + [2], from forward"));
    CPAR_TRY(cpar__check_shape(ctx, fn, "dloss", dloss, target->shape, target->ndim, "target's shape"));
    CPAR_TRY(cpar__check_shape(ctx, fn, "dlogits", dlogits, logits->shape, logits->ndim, "logits' shape"));
    size_t nb = cpar_tensor_nbytes(logits);
    if (dlogits->data != logits->data && cpar__ranges_overlap(logits->data, nb, dlogits->data, nb))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dlogits partially overlaps logits (only dlogits == logits is allowed)", fn);
    if (rows == 0) return CPAR_OK;
    if (cpar__on_device(ctx->device))
        CPAR_DEV_TRY(ctx, fn, cpar_dev_xent_backward(logits->data, dlogits->data, logits->dtype, target->data,
                                                     target->dtype, stats->data, dloss->data, rows, cols, first, vocab,
                                                     s, ctx->compute));
    else
        cpar__host_xent_backward(logits->data, dlogits->data, logits->dtype, target->data, target->dtype, stats->data,
                                 dloss->data, rows, cols, first, vocab, s);
    return CPAR_OK;
}

/* ---- vocabulary-parallel embedding ------------------------------------------------------ */

/* Checks shared by forward and backward: ids [b, s] I32/I64 on the context's
 * device (host ids: every value in [0, V)). */
static cpar_status cpar__emb_check_ids(cpar_group *tp, const char *fn, const cpar_tensor *ids, int64_t v_local,
                                       bool rs, int64_t *b, int64_t *s) {
    cpar_ctx *ctx = tp->ctx;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "ids", ids, ctx->device));
    if (ids->dtype != CPAR_I32 && ids->dtype != CPAR_I64)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: ids has dtype %s, expected i32 or i64", fn,
                          cpar_dtype_name(ids->dtype));
    if (ids->ndim != 2) {
        char got[128];
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: ids has shape %s, expected [b, s]", fn,
                          cpar__shape_str(ids, got, sizeof got));
    }
    *b = ids->shape[0], *s = ids->shape[1];
    if (rs && *s % tp->size)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: sequence length s = %lld (ids.shape[1]) is not divisible by the tensor-parallel size %d "
                          "(reduce_scatter_embeddings)", fn, (long long)*s, tp->size);
    int64_t vocab = v_local * tp->size, n = *b * *s;
    if (!cpar__on_device(ids->device))
        for (int64_t i = 0; i < n; i++) {
            int64_t id = cpar__xent_target_at(ids->data, ids->dtype, i);
            if (id < 0 || id >= vocab)
                return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: ids[%lld] is %lld, expected in [0, %lld) (the global vocab)",
                                  fn, (long long)i, (long long)id, (long long)vocab);
        }
    return CPAR_OK;
}

/* Embedding row of token (i, j) of ids [b, s]. */
static int64_t cpar__emb_row(int64_t i, int64_t j, int64_t b, int64_t s, bool seq_first) {
    return seq_first ? j * b + i : i * s + j;
}

static void cpar__host_embedding_lookup(const void *weight, cpar_dtype dt, const void *ids, cpar_dtype idt, int64_t b,
                                        int64_t s, int64_t hidden, int64_t first, int64_t v_local, bool seq_first,
                                        void *out) {
    size_t es = cpar_dtype_size(dt), row = (size_t)hidden * es;
    for (int64_t i = 0; i < b; i++)
        for (int64_t j = 0; j < s; j++) {
            int64_t id = cpar__xent_target_at(ids, idt, i * s + j) - first;
            char *dst = (char *)out + (size_t)cpar__emb_row(i, j, b, s, seq_first) * row;
            if (id >= 0 && id < v_local) memcpy(dst, (const char *)weight + (size_t)id * row, row);
            else memset(dst, 0, row); /* +0.0 in every float dtype */
        }
}

static void cpar__host_embedding_grad(const void *dout, cpar_dtype dt, const void *ids, cpar_dtype idt, int64_t b,
                                      int64_t s, int64_t hidden, int64_t first, int64_t v_local, bool seq_first,
                                      float *dweight) {
    for (int64_t i = 0; i < b; i++)
        for (int64_t j = 0; j < s; j++) {
            int64_t id = cpar__xent_target_at(ids, idt, i * s + j) - first;
            if (id < 0 || id >= v_local) continue;
            int64_t src = cpar__emb_row(i, j, b, s, seq_first) * hidden;
            for (int64_t h = 0; h < hidden; h++) dweight[id * hidden + h] += cpar__load_f(dout, dt, src + h);
        }
}

/* The functional forward and backward, with fn naming the public entry point
 * in messages (the functional call or the cpar_embedding layer's). */
static cpar_status cpar__emb_forward(cpar_group *tp, const char *fn, const cpar_tensor *weight, const cpar_tensor *ids,
                                     cpar_tensor *out, bool reduce_scatter_embeddings) {
    CPAR_TRY(cpar__check_group(tp, fn));
    cpar_ctx *ctx = tp->ctx;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "weight", weight, ctx->device));
    CPAR_TRY(cpar__check_float(ctx, fn, "weight", weight));
    if (weight->ndim != 2) {
        char got[128];
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: weight has shape %s, expected [v_local, H]", fn,
                          cpar__shape_str(weight, got, sizeof got));
    }
    int64_t vl = weight->shape[0], H = weight->shape[1], b, s;
    const bool rs = reduce_scatter_embeddings;
    CPAR_TRY(cpar__emb_check_ids(tp, fn, ids, vl, rs, &b, &s));
    CPAR_TRY(cpar__check_tensor(ctx, fn, "out", out, ctx->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "out", out, weight->dtype));
    int64_t want[3] = {b, s, H};
    if (rs) want[0] = s / tp->size, want[1] = b;
    CPAR_TRY(cpar__check_shape(ctx, fn, "out", out, want, 3,
                               rs ? "[s/tp, b, H]: reduce_scatter_embeddings" : "[b, s, H]"));
    const int64_t first = vl * tp->rank;
    const bool dev = cpar__on_device(ctx->device);
    void *partial = out->data;
    if (rs) { /* [s, b, H] partial in the workspace */
        size_t bytes = (size_t)(s * b * H) * cpar_dtype_size(weight->dtype);
        CPAR_TRY(cpar__xent_scratch(ctx, fn, bytes, &partial));
    }
    if (dev)
        CPAR_DEV_TRY(ctx, fn, cpar_dev_embedding_lookup(weight->data, weight->dtype, ids->data, ids->dtype, b, s, H,
                                                        first, vl, rs, partial, ctx->compute));
    else
        cpar__host_embedding_lookup(weight->data, weight->dtype, ids->data, ids->dtype, b, s, H, first, vl, rs,
                                    partial);
    if (!rs) return cpar__as(ctx, fn, cpar_all_reduce(tp, out, out, CPAR_SUM));
    int64_t pshape[3] = {s, b, H};
    cpar_tensor t_partial = cpar_tensor_make(partial, weight->dtype, 3, pshape, ctx->device);
    return cpar__as(ctx, fn, cpar_reduce_scatter(tp, &t_partial, out, CPAR_SUM, NULL));
}

cpar_status cpar_embedding_forward(cpar_group *tp, const cpar_tensor *weight, const cpar_tensor *ids, cpar_tensor *out,
                                   bool reduce_scatter_embeddings) {
    return cpar__emb_forward(tp, "cpar_embedding_forward", weight, ids, out, reduce_scatter_embeddings);
}

static cpar_status cpar__emb_backward(cpar_group *tp, const char *fn, const cpar_tensor *ids, const cpar_tensor *dout,
                                      bool reduce_scatter_embeddings, cpar_tensor *dweight, bool deterministic) {
    CPAR_TRY(cpar__check_group(tp, fn));
    cpar_ctx *ctx = tp->ctx;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "dweight", dweight, ctx->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "dweight", dweight, CPAR_F32));
    if (dweight->ndim != 2) {
        char got[128];
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dweight has shape %s, expected [v_local, H]", fn,
                          cpar__shape_str(dweight, got, sizeof got));
    }
    int64_t vl = dweight->shape[0], H = dweight->shape[1], b, s;
    const bool rs = reduce_scatter_embeddings;
    CPAR_TRY(cpar__emb_check_ids(tp, fn, ids, vl, rs, &b, &s));
    CPAR_TRY(cpar__check_tensor(ctx, fn, "dout", dout, ctx->device));
    CPAR_TRY(cpar__check_float(ctx, fn, "dout", dout));
    int64_t want[3] = {b, s, H};
    if (rs) want[0] = s / tp->size, want[1] = b;
    CPAR_TRY(cpar__check_shape(ctx, fn, "dout", dout, want, 3,
                               rs ? "[s/tp, b, H]: reduce_scatter_embeddings" : "[b, s, H]"));
    const int64_t first = vl * tp->rank;
    const bool dev = cpar__on_device(ctx->device);
    const void *full = dout->data;
    /* workspace: the gathered dout (reduce_scatter_embeddings), then the
     * deterministic gradient's sort keys (8-byte aligned after it) */
    const size_t gbytes = rs ? (size_t)(s * b * H) * cpar_dtype_size(dout->dtype) : 0, kofs = (gbytes + 15) / 16 * 16;
    const size_t kbytes = dev && deterministic ? cpar_dev_embedding_grad_scratch_bytes(b * s) : 0;
    void *ws = NULL;
    if (gbytes + kbytes) CPAR_TRY(cpar__workspace(ctx, fn, kofs + kbytes, &ws));
    if (rs) { /* all-gather along s into [s, b, H] */
        void *gathered = ws;
        int64_t gshape[3] = {s, b, H};
        cpar_tensor t_g = cpar_tensor_make(gathered, dout->dtype, 3, gshape, ctx->device);
        CPAR_TRY(cpar__as(ctx, fn, cpar_all_gather(tp, dout, &t_g, NULL)));
        full = gathered;
    }
    if (dev)
        CPAR_DEV_TRY(ctx, fn, cpar_dev_embedding_grad(full, dout->dtype, ids->data, ids->dtype, b, s, H, first, vl, rs,
                                                      dweight->data, deterministic, kbytes ? (char *)ws + kofs : NULL,
                                                      ctx->compute));
    else
        cpar__host_embedding_grad(full, dout->dtype, ids->data, ids->dtype, b, s, H, first, vl, rs, dweight->data);
    return CPAR_OK;
}

cpar_status cpar_embedding_backward(cpar_group *tp, const cpar_tensor *ids, const cpar_tensor *dout,
                                    bool reduce_scatter_embeddings, cpar_tensor *dweight, bool deterministic) {
    return cpar__emb_backward(tp, "cpar_embedding_backward", ids, dout, reduce_scatter_embeddings, dweight,
                              deterministic);
}

/* ---- the embedding layer (cpar_embedding) ------------------------------------------------
 * Owns the weight rows [first, last) and the fp32 main grad; forward and
 * backward are the functional calls above with the layer's settings. */

struct cpar_embedding {
    cpar_group *tp;
    cpar_ctx *ctx;
    cpar_embedding_config cfg;
    int64_t first, last; /* this rank's vocabulary rows */
    cpar_tensor w, dw;   /* [last - first, H]: cfg dtype, F32 */
};

cpar_status cpar_embedding_create(cpar_group *tp, const cpar_embedding_config *cfg, cpar_embedding **out) {
    static const char fn[] = "cpar_embedding_create";
    CPAR_TRY(cpar__check_group(tp, fn));
    cpar_ctx *ctx = tp->ctx;
    if (!out) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    *out = NULL;
    if (!cfg) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg is NULL", fn);
    const cpar_embedding_config c = *cfg;
    if (c.num_embeddings <= 0 || c.embedding_dim <= 0)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg num_embeddings %lld and embedding_dim %lld must be > 0", fn,
                          (long long)c.num_embeddings, (long long)c.embedding_dim);
    if (!cpar_dtype_is_float(c.dtype))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg dtype is %s, expected f32, f16 or bf16", fn,
                          cpar_dtype_name(c.dtype));
    if (c.num_embeddings % tp->size)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: cfg num_embeddings %lld is not divisible by the tensor-parallel size %d (pad the "
                          "vocabulary with cpar_pad_vocab_size)",
                          fn, (long long)c.num_embeddings, tp->size);
    int64_t first, last;
    CPAR_TRY(cpar_vocab_range(c.num_embeddings, tp->rank, tp->size, &first, &last));
    cpar_embedding *e = calloc(1, sizeof *e);
    if (!e) return cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate %zu bytes", fn, sizeof *e);
    e->tp = tp, e->ctx = ctx, e->cfg = c, e->first = first, e->last = last;
    int64_t wshape[2] = {last - first, c.embedding_dim};
    cpar_status st;
    CPAR_TRY_GOTO(cpar_tensor_alloc(ctx, c.dtype, 2, wshape, &e->w), st, fail);
    CPAR_TRY_GOTO(cpar_tensor_alloc(ctx, CPAR_F32, 2, wshape, &e->dw), st, fail);
    CPAR_TRY_GOTO(cpar_fill(ctx, &e->w, 0.0), st, fail);
    CPAR_TRY_GOTO(cpar_embedding_zero_grad(e), st, fail);
    *out = e;
    return CPAR_OK;
fail:
    cpar_embedding_destroy(e);
    return st;
}

cpar_status cpar_embedding_destroy(cpar_embedding *e) {
    if (!e) return CPAR_OK;
    if (e->w.data) cpar_tensor_free(e->ctx, &e->w);
    if (e->dw.data) cpar_tensor_free(e->ctx, &e->dw);
    free(e);
    return CPAR_OK;
}

cpar_tensor cpar_embedding_weight(const cpar_embedding *e) { return e ? e->w : (cpar_tensor){0}; }
cpar_tensor cpar_embedding_weight_grad(const cpar_embedding *e) { return e ? e->dw : (cpar_tensor){0}; }

cpar_status cpar_embedding_zero_grad(cpar_embedding *e) {
    if (!e) return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_embedding_zero_grad: e is NULL");
    return cpar_fill(e->ctx, &e->dw, 0.0);
}

cpar_status cpar_embedding_init_from_master(cpar_embedding *e, const cpar_tensor *master) {
    static const char fn[] = "cpar_embedding_init_from_master";
    if (!e) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: e is NULL", fn);
    cpar_ctx *ctx = e->ctx;
    const int64_t H = e->cfg.embedding_dim, vl = e->last - e->first;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "master", master, CPAR_HOST));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "master", master, CPAR_F32));
    int64_t mshape[2] = {e->cfg.num_embeddings, H}, lshape[2] = {vl, H};
    CPAR_TRY(cpar__check_shape(ctx, fn, "master", master, mshape, 2, "[num_embeddings, embedding_dim]"));
    /* rows [first, last) of the master are contiguous: cast them straight in on
     * the host; on a device, stage them (F32) in the workspace, then cast */
    cpar_tensor src = cpar_tensor_make((float *)master->data + e->first * H, CPAR_F32, 2, lshape, CPAR_HOST);
    if (!cpar__on_device(ctx->device)) return cpar_cast(ctx, &src, &e->w);
    void *stage;
    CPAR_TRY(cpar__workspace(ctx, fn, (size_t)(vl * H) * sizeof(float), &stage));
    cpar_tensor t_stage = cpar_tensor_make(stage, CPAR_F32, 2, lshape, ctx->device);
    CPAR_TRY(cpar__copy_bytes(ctx, fn, stage, ctx->device, src.data, CPAR_HOST, cpar_tensor_nbytes(&src)));
    CPAR_TRY(cpar_cast(ctx, &t_stage, &e->w));
    /* the host-to-device copy may still read the caller's master */
    CPAR_TRY(cpar__stream_wait(ctx, fn, ctx->compute));
    return CPAR_OK;
}

cpar_status cpar_embedding_init_random(cpar_embedding *e, float std) {
    static const char fn[] = "cpar_embedding_init_random";
    if (!e) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: e is NULL", fn);
    cpar_ctx *ctx = e->ctx;
    if (!(std >= 0.f) || isinf(std))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: std is %g, expected finite and >= 0", fn, (double)std);
    cpar_rng_state s;
    if (cpar_rng_get_state(ctx, CPAR_RNG_MODEL_PARALLEL, &s) != CPAR_OK)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: the RNG tracker has no \"%s\" state (call cpar_model_parallel_manual_seed first)", fn,
                          CPAR_RNG_MODEL_PARALLEL);
    CPAR_TRY(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
    cpar_status st = cpar_rng_normal(ctx, &e->w, 0.f, std);
    cpar_status su = cpar_rng_unfork(ctx);
    return st != CPAR_OK ? st : su;
}

cpar_status cpar_embedding_layer_forward(cpar_embedding *e, const cpar_tensor *ids, cpar_tensor *out) {
    static const char fn[] = "cpar_embedding_layer_forward";
    if (!e) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: e is NULL", fn);
    return cpar__emb_forward(e->tp, fn, &e->w, ids, out, e->cfg.reduce_scatter_embeddings);
}

cpar_status cpar_embedding_layer_backward(cpar_embedding *e, const cpar_tensor *ids, const cpar_tensor *dout) {
    static const char fn[] = "cpar_embedding_layer_backward";
    if (!e) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: e is NULL", fn);
    return cpar__emb_backward(e->tp, fn, ids, dout, e->cfg.reduce_scatter_embeddings, &e->dw, e->cfg.deterministic);
}

/* ==== 17. Linear layers ===================================================
 * Owns cpar.h §11: cpar_linear (Megatron's ColumnParallelLinear,
 * RowParallelLinear, LinearWithFrozenWeight and the linear autograd function
 * with gradient-accumulation fusion into fp32 or 16-bit main grads, or
 * param-dtype grads without it, and sequence parallelism), its
 * initialisation from a master weight (with partition stride) or under the
 * model-parallel RNG fork, forward (a supplied weight for tied embeddings,
 * runtime_gather_output), backward, the deferred output-layer weight
 * gradients and their drain, and zero_grad.
 * Every product is one column-major GEMM with cuBLAS's argument semantics
 * (cpar__lin_gemm): cpar_dev_gemm on device tensors, the host GEMM of section
 * 5 (fp32 accumulation) on host tensors, so both paths use the same operand
 * mapping. Row-major Y[T,N] = X[T,K] W[N,K]^T is column-major
 * Y^T(NxT) = op_T(W as KxN) X^T(KxT); see the cpar__lin_* wrappers.
 * Temporaries: one workspace carve per call; collectives are the raw ones of
 * §11 (they never touch the workspace).
 * Uses: 2 (errors, argument checks), 3 (tensors), 4 (device dispatch,
 * workspace, copies), 5 (element load/store, host fill), 6 (cpar_fill),
 * 10-11 (groups, collectives), 15 (RNG fork, normal fills). */

/* One deferred micro-batch (Megatron's embedding_activation_buffer and
 * grad_output_buffer entries, held side by side): what its forward used and,
 * once its backward ran, the dy it deferred. References, not copies. */
typedef struct cpar__lin_deferred {
    cpar_tensor x;     /* forward's input (the local shard with sequence parallelism) */
    void *dw;          /* the weight gradient that forward's weight accumulates into */
    const void *dy;    /* backward's dy columns of this rank (set by the backward) */
    int64_t ldy, T;    /* dy's row stride and token count */
} cpar__lin_deferred;

struct cpar_linear {
    cpar_group *tp;
    cpar_ctx *ctx;
    bool row;                /* RowParallelLinear, else ColumnParallelLinear */
    cpar_linear_config cfg;  /* defaults applied */
    cpar_dtype gdt;          /* grad dtype: main_grad_dtype with fusion, else the layer's dtype */
    int n, r;                /* tp size and rank */
    int64_t out_l, in_l;     /* local weight [out_l, in_l] */
    cpar_tensor w, b, dw, db;
    /* what forward keeps for backward (Megatron's save_for_backward) */
    bool have_x;             /* forward ran: x below is the input backward uses */
    cpar_tensor x;           /* forward's x as passed (a reference, not a copy) */
    const void *fw;          /* the weight forward used: l->w or a supplied one */
    void *fdw;               /* its gradient (NULL: frozen) */
    bool fgo;                /* forward gathered y (gather_output or runtime_gather_output) */
    /* defer_embedding_wgrad_compute: pairs [0, n_act) have their forward's
     * input, pairs [0, n_grad) their backward's dy too (n_grad <= n_act) */
    cpar__lin_deferred *defer;
    int n_act, n_grad, cap_defer;
    /* Column backward's stream fork/join (device contexts only, else NULL):
     * ev_compute is recorded on compute for comm to wait on, ev_comm on comm
     * for compute to wait on. Re-recording is fine: a wait uses the record
     * that precedes it. */
    cpar_dev_event ev_compute, ev_comm;
};

/* ---- the GEMM: cuBLAS column-major semantics on the device or the host ----
 * C(m x n) = op(A) op(B) + beta C, op(A) m x k, op(B) k x n, alpha = 1. */
static cpar_status cpar__lin_gemm(cpar_ctx *ctx, const char *fn, int ta, int tb, int64_t m, int64_t n, int64_t k,
                                  const void *A, int64_t lda, const void *B, int64_t ldb, cpar_dtype abt, float beta,
                                  void *C, cpar_dtype ct, int64_t ldc) {
    if (m == 0 || n == 0) return CPAR_OK;
    if (cpar__on_device(ctx->device)) {
        const int64_t dims[6] = {m, n, k, lda, ldb, ldc};
        for (int i = 0; i < 6; i++)
            if (dims[i] > INT_MAX)
                return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: GEMM dimension %lld exceeds INT_MAX (cuBLAS)", fn,
                                  (long long)dims[i]);
        CPAR_DEV_TRY(ctx, fn, cpar_dev_gemm(ctx->blas, ctx->compute, ta, tb, (int)m, (int)n, (int)k, 1.f, A, abt,
                                            (int)lda, 0, B, (int)ldb, 0, beta, C, ct, (int)ldc, 0, 1));
        return CPAR_OK;
    }
    return cpar__host_gemm(ctx, fn, ta, tb, m, n, k, 1.f, A, abt, lda, B, abt, ldb, beta, C, ct, ldc);
}

/* Y[T,N] (row stride ldy) = X[T,K] (row stride ldx) W[N,K]^T + beta Y, W the
 * weight of this forward (l->fw). */
static cpar_status cpar__lin_fwd(cpar_linear *l, const char *fn, const void *X, int64_t ldx, int64_t T, int64_t K,
                                 int64_t N, void *Y, int64_t ldy) {
    return cpar__lin_gemm(l->ctx, fn, 1, 0, N, T, K, l->fw, K, X, ldx, l->cfg.dtype, 0.f, Y, l->cfg.dtype, ldy);
}
/* dX[T,K] (ldx) = dY[T,N] (ldy) W[N,K], W the weight forward used. */
static cpar_status cpar__lin_dgrad(cpar_linear *l, const char *fn, const void *dY, int64_t ldy, int64_t T, int64_t N,
                                   int64_t K, void *dX, int64_t ldx) {
    return cpar__lin_gemm(l->ctx, fn, 0, 0, K, T, N, l->fw, K, dY, ldy, l->cfg.dtype, 0.f, dX, l->cfg.dtype, ldx);
}
/* dW[N,K] (grad dtype) += dY[T,N]^T X[T,K], summed in fp32: with fusion the
 * main grad (wgrad_gemm_accum_fp32 / _fp16), without it the param-dtype grad. */
static cpar_status cpar__lin_wgrad(cpar_linear *l, const char *fn, const void *dY, int64_t ldy, const void *X,
                                   int64_t ldx, int64_t T, int64_t N, int64_t K, void *dW) {
    return cpar__lin_gemm(l->ctx, fn, 0, 1, K, N, T, X, ldx, dY, ldy, l->cfg.dtype, 1.f, dW, l->gdt, K);
}
/* Y[T,N] (ldy) += 1_T b^T: a k = 1 rank-one update. ones: T ones. */
static cpar_status cpar__lin_bias_add(cpar_linear *l, const char *fn, void *Y, int64_t ldy, int64_t T, int64_t N,
                                      const void *ones) {
    return cpar__lin_gemm(l->ctx, fn, 0, 0, N, T, 1, l->b.data, N, ones, 1, l->cfg.dtype, 1.f, Y, l->cfg.dtype, ldy);
}
/* db[N] (grad dtype) += dY[T,N]^T 1_T. */
static cpar_status cpar__lin_bias_grad(cpar_linear *l, const char *fn, const void *dY, int64_t ldy, int64_t T,
                                       int64_t N, const void *ones) {
    return cpar__lin_gemm(l->ctx, fn, 0, 0, N, 1, T, dY, ldy, ones, T, l->cfg.dtype, 1.f, l->db.data, l->gdt, N);
}

/* ---- workspace carving: one cpar__workspace call per public call ---- */
typedef struct cpar__lin_ws {
    size_t need;
    size_t size[6];
    void *ptr[6];
    int count;
} cpar__lin_ws;

/* Reserve bytes; returns the slot index. */
static int cpar__lin_ws_add(cpar__lin_ws *w, size_t bytes) {
    w->size[w->count] = (bytes + 255) & ~(size_t)255;
    w->need += w->size[w->count];
    return w->count++;
}

static cpar_status cpar__lin_ws_carve(cpar_ctx *ctx, const char *fn, cpar__lin_ws *w) {
    if (!w->need) return CPAR_OK;
    void *base;
    CPAR_TRY(cpar__workspace(ctx, fn, w->need, &base));
    size_t off = 0;
    for (int i = 0; i < w->count; i++) {
        w->ptr[i] = w->size[i] ? (char *)base + off : NULL;
        off += w->size[i];
    }
    return CPAR_OK;
}

static cpar_status cpar__lin_ones(cpar_linear *l, const char *fn, void *p, int64_t n) {
    if (cpar__on_device(l->ctx->device))
        CPAR_DEV_TRY(l->ctx, fn, cpar_dev_fill(p, l->cfg.dtype, n, 1.0, l->ctx->compute));
    else cpar__host_fill(p, l->cfg.dtype, n, 1.0);
    return CPAR_OK;
}

/* ---- creation ---- */

/* Room for cap deferred micro-batches: host bookkeeping only, grown while
 * warming up (wgrad_deferral_limit 0) or sized once at create. */
static cpar_status cpar__lin_defer_reserve(cpar_linear *l, const char *fn, int cap) {
    if (cap <= l->cap_defer) return CPAR_OK;
    if (cap > INT_MAX / 2)
        return cpar__fail(l->ctx, CPAR_ERR_INVALID, "%s: %d deferred micro-batches exceed the list's limit", fn, cap);
    cpar__lin_deferred *d = realloc(l->defer, sizeof *d * (size_t)cap);
    if (!d) return cpar__fail(l->ctx, CPAR_ERR_OOM, "%s: cannot allocate %zu bytes", fn, sizeof *d * (size_t)cap);
    l->defer = d, l->cap_defer = cap;
    return CPAR_OK;
}

static cpar_status cpar__lin_create(cpar_group *tp, const cpar_linear_config *cfg, bool row, cpar_linear **out) {
    const char *fn = row ? "cpar_row_parallel_linear_create" : "cpar_column_parallel_linear_create";
    CPAR_TRY(cpar__check_group(tp, fn));
    cpar_ctx *ctx = tp->ctx;
    if (!out) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    *out = NULL;
    if (!cfg) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg is NULL", fn);
    cpar_linear_config c = *cfg;
    if (c.stride == 0) c.stride = 1;
    if (c.input_size <= 0 || c.output_size <= 0)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg input_size %lld and output_size %lld must be > 0", fn,
                          (long long)c.input_size, (long long)c.output_size);
    if (!cpar_dtype_is_float(c.dtype))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg dtype is %s, expected f32, f16 or bf16", fn,
                          cpar_dtype_name(c.dtype));
    if (c.stride < 1) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg stride is %d, expected >= 1", fn, c.stride);
    if (row && c.sequence_parallel && !c.input_is_parallel)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg sequence_parallel requires input_is_parallel", fn);
    /* the output-layer options exist on Megatron's ColumnParallelLinear only */
    if (row && (c.skip_weight_param_allocation || c.defer_embedding_wgrad_compute))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg %s is a ColumnParallelLinear option (the row layer has none)",
                          fn, c.skip_weight_param_allocation ? "skip_weight_param_allocation" : "defer_embedding_wgrad_compute");
    if (c.wgrad_deferral_limit < 0)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg wgrad_deferral_limit is %d, expected >= 0 (0: no limit)", fn,
                          c.wgrad_deferral_limit);
    if (c.wgrad_deferral_limit && !c.defer_embedding_wgrad_compute)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: cfg wgrad_deferral_limit is %d but defer_embedding_wgrad_compute is false", fn,
                          c.wgrad_deferral_limit);
    if (c.defer_embedding_wgrad_compute && c.disable_gradient_accumulation_fusion)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: cfg defer_embedding_wgrad_compute requires gradient accumulation fusion "
                          "(disable_gradient_accumulation_fusion is true), as in Megatron", fn);
    if (c.defer_embedding_wgrad_compute && c.frozen)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: cfg defer_embedding_wgrad_compute with frozen: a frozen weight has no gradient to defer", fn);
    if (c.main_grad_dtype != CPAR_F32 && c.main_grad_dtype != c.dtype)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: cfg main_grad_dtype is %s, expected f32 or the layer's dtype %s (the fused wgrad GEMM "
                          "accumulates in fp32 or in its input's dtype)",
                          fn, cpar_dtype_name(c.main_grad_dtype), cpar_dtype_name(c.dtype));
    if (c.main_grad_dtype != CPAR_F32 && c.disable_gradient_accumulation_fusion)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: cfg main_grad_dtype %s needs gradient accumulation fusion (without it the gradients "
                          "are the param-dtype .grad)", fn, cpar_dtype_name(c.main_grad_dtype));
    const int n = tp->size;
    const int64_t part = row ? c.input_size : c.output_size, div = (int64_t)n * c.stride;
    if (part % div)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg %s %lld is not divisible by tp*stride = %lld (tp=%d, stride=%d)",
                          fn, row ? "input_size" : "output_size", (long long)part, (long long)div, n, c.stride);
    cpar_linear *l = calloc(1, sizeof *l);
    if (!l) return cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate %zu bytes", fn, sizeof *l);
    l->tp = tp, l->ctx = ctx, l->row = row, l->cfg = c, l->n = n, l->r = tp->rank;
    l->gdt = c.disable_gradient_accumulation_fusion ? c.dtype : c.main_grad_dtype;
    l->out_l = row ? c.output_size : c.output_size / n;
    l->in_l = row ? c.input_size / n : c.input_size;
    int64_t wshape[2] = {l->out_l, l->in_l}, bshape[1] = {l->out_l};
    cpar_status st;
    if (!c.skip_weight_param_allocation) { /* else every forward passes the weight (and its gradient) */
        CPAR_TRY_GOTO(cpar_tensor_alloc(ctx, c.dtype, 2, wshape, &l->w), st, fail);
        CPAR_TRY_GOTO(cpar_fill(ctx, &l->w, 0.0), st, fail);
        if (!c.frozen) CPAR_TRY_GOTO(cpar_tensor_alloc(ctx, l->gdt, 2, wshape, &l->dw), st, fail);
    }
    if (c.bias) {
        CPAR_TRY_GOTO(cpar_tensor_alloc(ctx, c.dtype, 1, bshape, &l->b), st, fail);
        /* LinearWithFrozenWeight's backward returns no bias gradient either */
        if (!c.frozen) CPAR_TRY_GOTO(cpar_tensor_alloc(ctx, l->gdt, 1, bshape, &l->db), st, fail);
    }
    /* the layer's own weight until a forward supplies another (section 21
     * runs cpar__lin_fwd on a wrapped layer without calling forward) */
    l->fw = l->w.data, l->fdw = l->dw.data;
    if (c.defer_embedding_wgrad_compute && c.wgrad_deferral_limit > 0) { /* the whole list, now */
        CPAR_TRY_GOTO(cpar__lin_defer_reserve(l, fn, c.wgrad_deferral_limit), st, fail);
    }
    if (!row && cpar__on_device(ctx->device)) {
        cpar_status es = cpar_dev_event_create(&l->ev_compute);
        if (es == CPAR_OK) es = cpar_dev_event_create(&l->ev_comm);
        if (es != CPAR_OK) {
            st = cpar__dev_fail(ctx, es, fn);
            goto fail;
        }
    }
    if (c.bias) CPAR_TRY_GOTO(cpar_fill(ctx, &l->b, 0.0), st, fail);
    CPAR_TRY_GOTO(cpar_linear_zero_grad(l), st, fail);
    *out = l;
    return CPAR_OK;
fail:
    cpar_linear_destroy(l);
    return st;
}

cpar_status cpar_column_parallel_linear_create(cpar_group *tp, const cpar_linear_config *cfg, cpar_linear **out) {
    return cpar__lin_create(tp, cfg, false, out);
}

cpar_status cpar_row_parallel_linear_create(cpar_group *tp, const cpar_linear_config *cfg, cpar_linear **out) {
    return cpar__lin_create(tp, cfg, true, out);
}

cpar_status cpar_linear_destroy(cpar_linear *l) {
    if (!l) return CPAR_OK;
    cpar_tensor *all[] = {&l->w, &l->b, &l->dw, &l->db};
    for (int i = 0; i < 4; i++)
        if (all[i]->data) cpar_tensor_free(l->ctx, all[i]);
    /* backward joined comm into compute before returning */
    if (l->ev_compute) cpar_dev_event_destroy(l->ev_compute);
    if (l->ev_comm) cpar_dev_event_destroy(l->ev_comm);
    free(l->defer);
    free(l);
    return CPAR_OK;
}

static cpar_tensor cpar__lin_view(const cpar_tensor *t) {
    return *t; /* data NULL (zeroed struct) when absent */
}
cpar_tensor cpar_linear_weight(const cpar_linear *l) { return l ? cpar__lin_view(&l->w) : (cpar_tensor){0}; }
cpar_tensor cpar_linear_bias(const cpar_linear *l) { return l ? cpar__lin_view(&l->b) : (cpar_tensor){0}; }
cpar_tensor cpar_linear_weight_grad(const cpar_linear *l) { return l ? cpar__lin_view(&l->dw) : (cpar_tensor){0}; }
cpar_tensor cpar_linear_bias_grad(const cpar_linear *l) { return l ? cpar__lin_view(&l->db) : (cpar_tensor){0}; }

cpar_status cpar_linear_deferred(const cpar_linear *l, int *n_activations, int *n_grad_outputs) {
    if (!l) return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_linear_deferred: l is NULL");
    if (n_activations) *n_activations = l->n_act;
    if (n_grad_outputs) *n_grad_outputs = l->n_grad;
    return CPAR_OK;
}

cpar_status cpar_linear_zero_grad(cpar_linear *l) {
    if (!l) return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_linear_zero_grad: l is NULL");
    if (l->dw.data) CPAR_TRY(cpar_fill(l->ctx, &l->dw, 0.0));
    if (l->db.data) CPAR_TRY(cpar_fill(l->ctx, &l->db, 0.0));
    return CPAR_OK;
}

/* ---- initialisation ---- */

/* Global index of local index i along the partition dim: chunks of per
 * elements, rank r holds chunks r, r + n, r + 2n, ... in order. */
static int64_t cpar__lin_global(int64_t i, int64_t per, int r, int n) {
    return ((int64_t)r + (i / per) * n) * per + i % per;
}

cpar_status cpar_linear_init_from_master(cpar_linear *l, const cpar_tensor *master_weight,
                                         const cpar_tensor *master_bias) {
    static const char fn[] = "cpar_linear_init_from_master";
    if (!l) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: l is NULL", fn);
    cpar_ctx *ctx = l->ctx;
    const int64_t O = l->cfg.output_size, I = l->cfg.input_size;
    const bool has_w = l->w.data != NULL;
    if (!has_w && master_weight)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: master_weight given but cfg skip_weight_param_allocation is true (the layer has no weight)", fn);
    if (has_w) {
        CPAR_TRY(cpar__check_tensor(ctx, fn, "master_weight", master_weight, CPAR_HOST));
        CPAR_TRY(cpar__check_dtype(ctx, fn, "master_weight", master_weight, CPAR_F32));
        int64_t wshape[2] = {O, I};
        CPAR_TRY(cpar__check_shape(ctx, fn, "master_weight", master_weight, wshape, 2, "[output_size, input_size]"));
    }
    if (master_bias) {
        CPAR_TRY(cpar__check_tensor(ctx, fn, "master_bias", master_bias, CPAR_HOST));
        CPAR_TRY(cpar__check_dtype(ctx, fn, "master_bias", master_bias, CPAR_F32));
        CPAR_TRY(cpar__check_shape(ctx, fn, "master_bias", master_bias, &O, 1, "[output_size]"));
        if (!l->cfg.bias)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: master_bias given but the layer has no bias", fn);
    }
    const cpar_dtype dt = l->cfg.dtype;
    const int64_t per = (l->row ? l->in_l : l->out_l) / l->cfg.stride;
    const float *mw = has_w ? master_weight->data : NULL;
    size_t wbytes = has_w ? cpar_tensor_nbytes(&l->w) : 0, bbytes = l->b.data ? cpar_tensor_nbytes(&l->b) : 0;
    char *buf = malloc(wbytes + bbytes + 1);
    if (!buf) return cpar__fail(ctx, CPAR_ERR_OOM, "%s: host allocation of %zu bytes failed", fn, wbytes + bbytes);
    for (int64_t i = 0; i < l->out_l && has_w; i++)
        for (int64_t j = 0; j < l->in_l; j++) {
            int64_t gi = l->row ? i : cpar__lin_global(i, per, l->r, l->n);
            int64_t gj = l->row ? cpar__lin_global(j, per, l->r, l->n) : j;
            cpar__store_f(buf, dt, i * l->in_l + j, mw[gi * I + gj]);
        }
    if (bbytes)
        for (int64_t i = 0; i < l->out_l; i++) {
            int64_t gi = l->row ? i : cpar__lin_global(i, per, l->r, l->n);
            cpar__store_f(buf + wbytes, dt, i, master_bias ? ((const float *)master_bias->data)[gi] : 0.f);
        }
    cpar_status st = has_w ? cpar__copy_bytes(ctx, fn, l->w.data, l->w.device, buf, CPAR_HOST, wbytes) : CPAR_OK;
    if (st == CPAR_OK && bbytes) st = cpar__copy_bytes(ctx, fn, l->b.data, l->b.device, buf + wbytes, CPAR_HOST, bbytes);
    /* buf is pageable: a copy from it has read it when the call returns (CUDA
     * stages pageable sources), so it may go now */
    free(buf);
    return st;
}

cpar_status cpar_linear_init_random(cpar_linear *l, float std) {
    static const char fn[] = "cpar_linear_init_random";
    if (!l) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: l is NULL", fn);
    cpar_ctx *ctx = l->ctx;
    if (!(std >= 0.f) || isinf(std))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: std is %g, expected finite and >= 0", fn, (double)std);
    if (!l->w.data) /* skip_weight_param_allocation: nothing to draw */
        return l->b.data ? cpar_fill(ctx, &l->b, 0.0) : CPAR_OK;
    cpar_rng_state s;
    if (cpar_rng_get_state(ctx, CPAR_RNG_MODEL_PARALLEL, &s) != CPAR_OK)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: the RNG tracker has no \"%s\" state (call cpar_model_parallel_manual_seed first)", fn,
                          CPAR_RNG_MODEL_PARALLEL);
    CPAR_TRY(cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL));
    cpar_status st = cpar_rng_normal(ctx, &l->w, 0.f, std);
    cpar_status su = cpar_rng_unfork(ctx);
    if (st != CPAR_OK) return st;
    if (su != CPAR_OK) return su;
    if (l->b.data) CPAR_TRY(cpar_fill(ctx, &l->b, 0.0));
    return CPAR_OK;
}

/* ---- argument checks ---- */

/* t: on the context's device, the layer's dtype, at least 2 dims. */
static cpar_status cpar__lin_check_act(cpar_linear *l, const char *fn, const char *name, const cpar_tensor *t) {
    CPAR_TRY(cpar__check_tensor(l->ctx, fn, name, t, l->ctx->device));
    CPAR_TRY(cpar__check_dtype(l->ctx, fn, name, t, l->cfg.dtype));
    if (t->ndim < 2) {
        char got[128];
        return cpar__fail(l->ctx, CPAR_ERR_INVALID, "%s: %s has shape %s, expected [tokens..., features] (>= 2 dims)",
                          fn, name, cpar__shape_str(t, got, sizeof got));
    }
    return CPAR_OK;
}

/* Last dim of t == want, else "t has shape [..], expected [*,*,want] (why)". */
static cpar_status cpar__lin_check_last(cpar_linear *l, const char *fn, const char *name, const cpar_tensor *t,
                                        int64_t want, const char *why) {
    if (t->shape[t->ndim - 1] == want) return CPAR_OK;
    char got[128], exp[128];
    size_t k = 0;
    k += (size_t)snprintf(exp + k, sizeof exp - k, "[");
    for (int i = 0; i < t->ndim - 1 && k < sizeof exp; i++) k += (size_t)snprintf(exp + k, sizeof exp - k, "*,");
    if (k < sizeof exp) snprintf(exp + k, sizeof exp - k, "%lld]", (long long)want);
    return cpar__fail(l->ctx, CPAR_ERR_INVALID, "%s: %s has shape %s, expected %s (%s with tp=%d)", fn, name,
                      cpar__shape_str(t, got, sizeof got), exp, why, l->n);
}

/* The input x: feature dim, and dim 0 divisible by tp where it is split. */
static cpar_status cpar__lin_check_x(cpar_linear *l, const char *fn, const char *name, const cpar_tensor *x) {
    CPAR_TRY(cpar__lin_check_act(l, fn, name, x));
    if (!l->row) CPAR_TRY(cpar__lin_check_last(l, fn, name, x, l->in_l, "input_size"));
    else if (l->cfg.input_is_parallel) CPAR_TRY(cpar__lin_check_last(l, fn, name, x, l->in_l, "input_size/tp"));
    else CPAR_TRY(cpar__lin_check_last(l, fn, name, x, l->cfg.input_size, "input_size: input_is_parallel is false"));
    if (l->row && l->cfg.sequence_parallel && x->shape[0] % l->n)
        return cpar__fail(l->ctx, CPAR_ERR_INVALID,
                          "%s: %s has %lld rows in dim 0, not divisible by tp=%d (sequence_parallel reduce-scatters "
                          "the output along dim 0)",
                          fn, name, (long long)x->shape[0], l->n);
    return CPAR_OK;
}

/* The output shape forward writes for input x; go: the column layer gathers y. */
static void cpar__lin_y_shape(const cpar_linear *l, const cpar_tensor *x, bool go, int64_t *shape, const char **why) {
    memcpy(shape, x->shape, sizeof x->shape);
    const bool sp = l->cfg.sequence_parallel;
    int last = x->ndim - 1;
    if (!l->row) {
        if (sp) shape[0] *= l->n;
        shape[last] = go ? l->cfg.output_size : l->out_l;
        *why = sp && go ? "[s*tp, ..., output_size]: sequence_parallel, gather_output"
               : sp     ? "[s*tp, ..., output_size/tp]: sequence_parallel"
               : go     ? "[s, ..., output_size]: gather_output"
                        : "[s, ..., output_size/tp]";
    } else {
        if (sp) shape[0] /= l->n;
        shape[last] = l->cfg.output_size;
        *why = sp ? "[s/tp, ..., output_size]: sequence_parallel" : "[s, ..., output_size]";
    }
}

static int64_t cpar__lin_tokens(const cpar_tensor *t) { return cpar_tensor_numel(t) / t->shape[t->ndim - 1]; }

/* ---- forward ---- */

static cpar_status cpar__lin_column_forward(cpar_linear *l, const char *fn, const cpar_tensor *x, cpar_tensor *y) {
    cpar_ctx *ctx = l->ctx;
    const cpar_dtype dt = l->cfg.dtype;
    const size_t es = cpar_dtype_size(dt);
    const int n = l->n;
    const bool sp = l->cfg.sequence_parallel && n > 1, go = l->fgo && n > 1;
    const bool add_bias = l->b.data && !l->cfg.skip_bias_add;
    const int64_t T = cpar__lin_tokens(x) * (sp ? n : 1), K = l->in_l, N = l->out_l;
    cpar__lin_ws w = {0};
    int s_xg = cpar__lin_ws_add(&w, sp ? (size_t)(T * K) * es : 0);
    int s_yl = cpar__lin_ws_add(&w, go ? (size_t)(T * N) * es : 0);
    int s_st = cpar__lin_ws_add(&w, go ? (size_t)(T * N * n) * es : 0);
    int s_one = cpar__lin_ws_add(&w, add_bias ? (size_t)T * es : 0);
    CPAR_TRY(cpar__lin_ws_carve(ctx, fn, &w));
    const void *X = x->data;
    if (sp) { /* gather_from_sequence_parallel_region */
        cpar_tensor xg = *x;
        xg.shape[0] *= n;
        xg.data = w.ptr[s_xg];
        CPAR_TRY(cpar__as(ctx, fn, cpar_all_gather(l->tp, x, &xg, NULL)));
        X = xg.data;
    }
    void *Y = go ? w.ptr[s_yl] : y->data;
    CPAR_TRY(cpar__lin_fwd(l, fn, X, K, T, K, N, Y, N));
    if (add_bias) {
        CPAR_TRY(cpar__lin_ones(l, fn, w.ptr[s_one], T));
        CPAR_TRY(cpar__lin_bias_add(l, fn, Y, N, T, N, w.ptr[s_one]));
    }
    if (go) { /* gather_from_tensor_model_parallel_region: along dim 0, then interleave */
        int64_t ls[2] = {T, N}, gs[2] = {T * n, N};
        cpar_tensor yl = cpar_tensor_make(Y, dt, 2, ls, ctx->device), st = cpar_tensor_make(w.ptr[s_st], dt, 2, gs, ctx->device);
        CPAR_TRY(cpar__as(ctx, fn, cpar_all_gather(l->tp, &yl, &st, NULL)));
        for (int j = 0; j < n; j++)
            CPAR_TRY(cpar__copy_2d(ctx, fn, (char *)y->data + (size_t)(j * N) * es, (size_t)(N * n) * es, ctx->device,
                                   (const char *)st.data + (size_t)(j * T * N) * es, (size_t)N * es, ctx->device,
                                   (size_t)N * es, (size_t)T));
    }
    return CPAR_OK;
}

static cpar_status cpar__lin_row_forward(cpar_linear *l, const char *fn, const cpar_tensor *x, cpar_tensor *y) {
    cpar_ctx *ctx = l->ctx;
    const cpar_dtype dt = l->cfg.dtype;
    const size_t es = cpar_dtype_size(dt);
    const int n = l->n;
    const bool sp = l->cfg.sequence_parallel && n > 1, iip = l->cfg.input_is_parallel;
    const bool add_bias = l->b.data && !l->cfg.skip_bias_add;
    const int64_t T = cpar__lin_tokens(x), K = l->in_l, N = l->out_l, Ty = cpar__lin_tokens(y);
    cpar__lin_ws w = {0};
    int s_part = cpar__lin_ws_add(&w, sp ? (size_t)(T * N) * es : 0);
    int s_one = cpar__lin_ws_add(&w, add_bias ? (size_t)Ty * es : 0);
    CPAR_TRY(cpar__lin_ws_carve(ctx, fn, &w));
    /* scatter_to_tensor_model_parallel_region: this rank's columns, read in place */
    const void *X = iip ? x->data : (const char *)x->data + (size_t)(l->r * K) * es;
    const int64_t ldx = iip ? K : l->cfg.input_size;
    void *P = sp ? w.ptr[s_part] : y->data;
    CPAR_TRY(cpar__lin_fwd(l, fn, X, ldx, T, K, N, P, N));
    if (sp) { /* reduce_scatter_to_sequence_parallel_region */
        cpar_tensor part = *x;
        part.shape[x->ndim - 1] = N;
        part.data = P;
        CPAR_TRY(cpar__as(ctx, fn, cpar_reduce_scatter(l->tp, &part, y, CPAR_SUM, NULL)));
    } else if (n > 1) { /* reduce_from_tensor_model_parallel_region */
        CPAR_TRY(cpar__as(ctx, fn, cpar_all_reduce(l->tp, y, y, CPAR_SUM)));
    }
    if (add_bias) {
        CPAR_TRY(cpar__lin_ones(l, fn, w.ptr[s_one], Ty));
        CPAR_TRY(cpar__lin_bias_add(l, fn, y->data, N, Ty, N, w.ptr[s_one]));
    }
    return CPAR_OK;
}

/* Megatron's checks of forward(weight=..., runtime_gather_output=...): sets
 * *w / *dw (the weight and gradient this call uses) and *go. */
static cpar_status cpar__lin_check_args(cpar_linear *l, const char *fn, const cpar_linear_forward_args *a,
                                        const void **w, void **dw, bool *go) {
    cpar_ctx *ctx = l->ctx;
    const cpar_linear_forward_args none = {0};
    if (!a) a = &none;
    if (l->row && (a->weight || a->weight_grad || a->runtime_gather_output != CPAR_RUNTIME_GATHER_NONE))
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: args->%s is given but a row-parallel layer takes no per-call weight or gather "
                          "(Megatron's RowParallelLinear.forward has neither)",
                          fn, a->weight ? "weight" : a->weight_grad ? "weight_grad" : "runtime_gather_output");
    if ((unsigned)a->runtime_gather_output > CPAR_RUNTIME_GATHER_FALSE)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: args->runtime_gather_output is %d, expected CPAR_RUNTIME_GATHER_NONE, _TRUE or _FALSE", fn,
                          (int)a->runtime_gather_output);
    *go = a->runtime_gather_output == CPAR_RUNTIME_GATHER_NONE ? l->cfg.gather_output
                                                               : a->runtime_gather_output == CPAR_RUNTIME_GATHER_TRUE;
    if (!a->weight) {
        if (!l->w.data)
            return cpar__fail(ctx, CPAR_ERR_INVALID,
                              "%s: no weight was supplied and cfg skip_weight_param_allocation is true (pass "
                              "args->weight, e.g. the tied embedding's, with cpar_linear_forward_ex)", fn);
        if (a->weight_grad)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: args->weight_grad is given without args->weight", fn);
        *w = l->w.data, *dw = l->dw.data;
        return CPAR_OK;
    }
    const int64_t wshape[2] = {l->out_l, l->in_l};
    CPAR_TRY(cpar__check_tensor(ctx, fn, "args->weight", a->weight, ctx->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "args->weight", a->weight, l->cfg.dtype));
    CPAR_TRY(cpar__check_shape(ctx, fn, "args->weight", a->weight, wshape, 2, "[output_size/tp, input_size]"));
    if (l->cfg.frozen) {
        if (a->weight_grad)
            return cpar__fail(ctx, CPAR_ERR_INVALID,
                              "%s: args->weight_grad is given but cfg frozen is true (a frozen weight gets no gradient)", fn);
    } else {
        if (!a->weight_grad)
            return cpar__fail(ctx, CPAR_ERR_INVALID,
                              "%s: args->weight_grad is NULL: a supplied weight needs its gradient buffer (e.g. the "
                              "tied embedding's main grad), or cfg frozen", fn);
        CPAR_TRY(cpar__check_tensor(ctx, fn, "args->weight_grad", a->weight_grad, ctx->device));
        CPAR_TRY(cpar__check_dtype(ctx, fn, "args->weight_grad", a->weight_grad, l->gdt));
        CPAR_TRY(cpar__check_shape(ctx, fn, "args->weight_grad", a->weight_grad, wshape, 2,
                                   "[output_size/tp, input_size], args->weight's"));
        if (cpar__ranges_overlap(a->weight->data, cpar_tensor_nbytes(a->weight), a->weight_grad->data,
                                 cpar_tensor_nbytes(a->weight_grad)))
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: args->weight_grad overlaps args->weight", fn);
    }
    *w = a->weight->data, *dw = l->cfg.frozen ? NULL : a->weight_grad->data;
    return CPAR_OK;
}

cpar_status cpar_linear_forward_ex(cpar_linear *l, const cpar_tensor *x, cpar_tensor *y, cpar_tensor *bias_out,
                                   const cpar_linear_forward_args *args) {
    static const char fn_plain[] = "cpar_linear_forward", fn_ex[] = "cpar_linear_forward_ex";
    const char *fn = args ? fn_ex : fn_plain;
    if (!l) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: l is NULL", fn);
    cpar_ctx *ctx = l->ctx;
    const void *w = NULL;
    void *dw = NULL;
    bool go = false;
    CPAR_TRY(cpar__lin_check_args(l, fn, args, &w, &dw, &go));
    CPAR_TRY(cpar__lin_check_x(l, fn, "x", x));
    CPAR_TRY(cpar__lin_check_act(l, fn, "y", y));
    int64_t want[CPAR_MAX_DIMS];
    const char *why;
    cpar__lin_y_shape(l, x, go, want, &why);
    CPAR_TRY(cpar__check_shape(ctx, fn, "y", y, want, x->ndim, why));
    if (cpar__ranges_overlap(x->data, cpar_tensor_nbytes(x), y->data, cpar_tensor_nbytes(y)))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: y overlaps x", fn);
    if (args && args->weight &&
        cpar__ranges_overlap(args->weight->data, cpar_tensor_nbytes(args->weight), y->data, cpar_tensor_nbytes(y)))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: y overlaps args->weight", fn);
    const bool give_bias = l->b.data && l->cfg.skip_bias_add;
    if (give_bias) {
        CPAR_TRY(cpar__check_tensor(ctx, fn, "bias_out", bias_out, ctx->device));
        CPAR_TRY(cpar__check_dtype(ctx, fn, "bias_out", bias_out, l->cfg.dtype));
        CPAR_TRY(cpar__check_shape(ctx, fn, "bias_out", bias_out, l->b.shape, 1,
                                   l->row ? "[output_size]" : "[output_size/tp]"));
    }
    /* Megatron appends input_parallel to embedding_activation_buffer before
     * the GEMM; the slot is taken here, filled once the forward succeeded */
    const int lim = l->cfg.wgrad_deferral_limit;
    const bool defer = l->cfg.defer_embedding_wgrad_compute && (lim == 0 || l->n_act < lim);
    if (defer && l->n_act == l->cap_defer) /* only without a limit (else sized at create) */
        CPAR_TRY(cpar__lin_defer_reserve(l, fn, l->cap_defer ? 2 * l->cap_defer : 8));
    l->have_x = false;
    l->fw = w, l->fdw = dw, l->fgo = go;
    CPAR_TRY(l->row ? cpar__lin_row_forward(l, fn, x, y) : cpar__lin_column_forward(l, fn, x, y));
    if (give_bias)
        CPAR_TRY(cpar__copy_bytes(ctx, fn, bias_out->data, bias_out->device, l->b.data, l->b.device,
                                  cpar_tensor_nbytes(&l->b)));
    l->x = *x;
    l->have_x = true;
    if (defer) l->defer[l->n_act++] = (cpar__lin_deferred){.x = *x, .dw = dw};
    return CPAR_OK;
}

cpar_status cpar_linear_forward(cpar_linear *l, const cpar_tensor *x, cpar_tensor *y, cpar_tensor *bias_out) {
    return cpar_linear_forward_ex(l, x, y, bias_out, NULL);
}

/* ---- backward ----
 * Issue order is Megatron's overlapped schedule (column layer; the row
 * layer's communication is outside its linear autograd function in Megatron
 * and stays sequential here). On device tensors with tp > 1:
 *   compute: record ev_compute                 comm: wait ev_compute
 *   compute: dgrad GEMM -> dX                  comm: SP all-gather x -> xg
 *   compute: record ev_compute                 comm: wait ev_compute,
 *                                                    record ev_comm (gathered)
 *   compute: wait ev_comm (xg ready)           comm: reduce-scatter dX -> dx
 *                                                    (no SP: all-reduce dx)
 *   compute: wgrad GEMM, bias grad             comm: record ev_comm
 *   compute: wait ev_comm (join), return
 * The GEMMs (one cuBLAS handle) stay on compute; only the collectives move
 * (cpar__on_comm_stream). The workspace is carved once, into disjoint slots:
 * xg (written by comm, read by compute), dX (written by compute, read by
 * comm), the ones vector (compute); the host/device accumulator coll_ws is used
 * on comm only. The final join keeps the public contract: everything is
 * stream-ordered on compute when the call returns. Host tensors: the same
 * order, sequentially; the device backend runs this very code with identical
 * results, on the simulator with its streams queued (lazy or random in make test), so a missing
 * fork or join there reads stale data. */

/* Record ev on stream from and make stream to wait for it (device only). */
static cpar_status cpar__lin_order(cpar_linear *l, const char *fn, cpar_dev_event ev, cpar_dev_stream from,
                                   cpar_dev_stream to) {
    if (!ev) return CPAR_OK;
    CPAR_DEV_TRY(l->ctx, fn, cpar_dev_event_record(ev, from));
    CPAR_DEV_TRY(l->ctx, fn, cpar_dev_stream_wait_event(to, ev));
    return CPAR_OK;
}

/* dW: the weight gradient to accumulate now, NULL for none (frozen, or
 * deferred: then x is not re-gathered either). */
static cpar_status cpar__lin_column_backward(cpar_linear *l, const char *fn, const cpar_tensor *dy, cpar_tensor *dx,
                                             void *dW) {
    cpar_ctx *ctx = l->ctx;
    const cpar_dtype dt = l->cfg.dtype;
    const size_t es = cpar_dtype_size(dt);
    const int n = l->n;
    const bool sp = l->cfg.sequence_parallel && n > 1, go = l->fgo && n > 1;
    const bool wgrad = dW != NULL, bgrad = l->db.data != NULL;
    const bool gather = sp && wgrad, reduce = dx && (sp || (n > 1 && !l->cfg.disable_grad_reduce));
    const cpar_tensor *x = &l->x;
    const int64_t T = cpar__lin_tokens(dy), K = l->in_l, N = l->out_l;
    /* two streams only when there is communication to overlap */
    const bool overlap = l->ev_compute && cpar__on_device(ctx->device) && (gather || reduce);
    cpar_dev_event ev_cp = overlap ? l->ev_compute : NULL, ev_cm = overlap ? l->ev_comm : NULL;
    cpar__lin_ws w = {0};
    int s_xg = cpar__lin_ws_add(&w, gather ? (size_t)(T * K) * es : 0);
    int s_dx = cpar__lin_ws_add(&w, sp && dx ? (size_t)(T * K) * es : 0);
    int s_one = cpar__lin_ws_add(&w, bgrad ? (size_t)T * es : 0);
    CPAR_TRY(cpar__lin_ws_carve(ctx, fn, &w));
    /* with gather_output, this rank's columns of dy (split of the last dim), read in place */
    const void *dY = go ? (const char *)dy->data + (size_t)(l->r * N) * es : dy->data;
    const int64_t ldy = go ? N * n : N;
    const void *X = x->data;
    cpar_status st = CPAR_OK;
    bool forked = false;
    /* fork: comm starts after everything already queued on compute (x, dy,
     * dx and the workspace are free to use) */
    CPAR_TRY(cpar__lin_order(l, fn, ev_cp, ctx->compute, ctx->comm));
    forked = overlap;
    if (gather) { /* re-gather the input on comm, overlapped with the dgrad GEMM */
        cpar_tensor xg = *x;
        xg.shape[0] *= n;
        xg.data = w.ptr[s_xg];
        if (overlap) cpar__on_comm_stream(ctx);
        st = cpar__as(ctx, fn, cpar_all_gather(l->tp, x, &xg, NULL));
        cpar__on_compute_stream(ctx);
        if (st != CPAR_OK) goto join;
        X = xg.data;
    }
    if (gather && dx && ev_cm) { /* comm: mark the gather, before the dgrad reduction is queued behind it */
        st = cpar_dev_event_record(ev_cm, ctx->comm);
        if (st != CPAR_OK) { st = cpar__dev_fail(ctx, st, fn); goto join; }
    }
    if (dx) {
        void *dX = sp ? w.ptr[s_dx] : dx->data;
        st = cpar__lin_dgrad(l, fn, dY, ldy, T, N, K, dX, K);
        if (st != CPAR_OK) goto join;
        if (reduce) { /* dgrad reduction on comm (after the GEMM), overlapped with the wgrad GEMM */
            st = cpar__lin_order(l, fn, ev_cp, ctx->compute, ctx->comm);
            if (st != CPAR_OK) goto join;
            if (overlap) cpar__on_comm_stream(ctx);
            if (sp) {
                cpar_tensor full = *x;
                full.shape[0] *= n;
                full.data = dX;
                st = cpar__as(ctx, fn, cpar_reduce_scatter(l->tp, &full, dx, CPAR_SUM, NULL));
            } else {
                st = cpar__as(ctx, fn, cpar_all_reduce(l->tp, dx, dx, CPAR_SUM));
            }
            cpar__on_compute_stream(ctx);
            if (st != CPAR_OK) goto join;
        }
    } else if (gather && ev_cm) {
        st = cpar_dev_event_record(ev_cm, ctx->comm);
        if (st != CPAR_OK) { st = cpar__dev_fail(ctx, st, fn); goto join; }
    }
    if (wgrad) {
        if (gather && ev_cm) { /* compute: the gathered input is ready */
            st = cpar_dev_stream_wait_event(ctx->compute, ev_cm);
            if (st != CPAR_OK) { st = cpar__dev_fail(ctx, st, fn); goto join; }
        }
        st = cpar__lin_wgrad(l, fn, dY, ldy, X, K, T, N, K, dW);
        if (st != CPAR_OK) goto join;
    }
    if (bgrad) {
        st = cpar__lin_ones(l, fn, w.ptr[s_one], T);
        if (st == CPAR_OK) st = cpar__lin_bias_grad(l, fn, dY, ldy, T, N, w.ptr[s_one]);
    }
join: /* compute waits for everything queued on comm, also after a failure */
    if (forked) {
        cpar_status js = cpar__lin_order(l, fn, ev_cm, ctx->comm, ctx->compute);
        if (st == CPAR_OK) st = js;
    }
    return st;
}

static cpar_status cpar__lin_row_backward(cpar_linear *l, const char *fn, const cpar_tensor *dy, cpar_tensor *dx) {
    cpar_ctx *ctx = l->ctx;
    const cpar_dtype dt = l->cfg.dtype;
    const size_t es = cpar_dtype_size(dt);
    const int n = l->n;
    const bool sp = l->cfg.sequence_parallel && n > 1, iip = l->cfg.input_is_parallel;
    const bool wgrad = l->fdw != NULL, bgrad = l->db.data != NULL;
    const bool gather_dx = dx && !iip && n > 1;
    const cpar_tensor *x = &l->x;
    const int64_t T = cpar__lin_tokens(x), K = l->in_l, N = l->out_l;
    cpar__lin_ws w = {0};
    int s_dy = cpar__lin_ws_add(&w, sp ? (size_t)(T * N) * es : 0);
    int s_dxl = cpar__lin_ws_add(&w, gather_dx ? (size_t)(T * K) * es : 0);
    int s_st = cpar__lin_ws_add(&w, gather_dx ? (size_t)(T * K * n) * es : 0);
    int s_one = cpar__lin_ws_add(&w, bgrad ? (size_t)T * es : 0);
    CPAR_TRY(cpar__lin_ws_carve(ctx, fn, &w));
    const void *dY = dy->data;
    if (sp) { /* backward of reduce_scatter_to_sequence_parallel_region */
        cpar_tensor g = *dy;
        g.shape[0] *= n;
        g.data = w.ptr[s_dy];
        CPAR_TRY(cpar__as(ctx, fn, cpar_all_gather(l->tp, dy, &g, NULL)));
        dY = g.data;
    }
    const void *X = iip ? x->data : (const char *)x->data + (size_t)(l->r * K) * es;
    const int64_t ldx = iip ? K : l->cfg.input_size;
    if (dx) {
        void *dX = gather_dx ? w.ptr[s_dxl] : dx->data;
        CPAR_TRY(cpar__lin_dgrad(l, fn, dY, N, T, N, K, dX, K));
        if (gather_dx) { /* backward of scatter_to_tp_region: all-gather of the last dim */
            int64_t ls[2] = {T, K}, gs[2] = {T * n, K};
            cpar_tensor xl = cpar_tensor_make(dX, dt, 2, ls, ctx->device);
            cpar_tensor st = cpar_tensor_make(w.ptr[s_st], dt, 2, gs, ctx->device);
            CPAR_TRY(cpar__as(ctx, fn, cpar_all_gather(l->tp, &xl, &st, NULL)));
            for (int j = 0; j < n; j++)
                CPAR_TRY(cpar__copy_2d(ctx, fn, (char *)dx->data + (size_t)(j * K) * es, (size_t)(K * n) * es,
                                       ctx->device, (const char *)st.data + (size_t)(j * T * K) * es, (size_t)K * es,
                                       ctx->device, (size_t)K * es, (size_t)T));
        }
    }
    if (wgrad) CPAR_TRY(cpar__lin_wgrad(l, fn, dY, N, X, ldx, T, N, K, l->fdw));
    if (bgrad) {
        CPAR_TRY(cpar__lin_ones(l, fn, w.ptr[s_one], T));
        CPAR_TRY(cpar__lin_bias_grad(l, fn, dY, N, T, N, w.ptr[s_one]));
    }
    return CPAR_OK;
}

cpar_status cpar_linear_backward(cpar_linear *l, const cpar_tensor *dy, cpar_tensor *dx) {
    static const char fn[] = "cpar_linear_backward";
    if (!l) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: l is NULL", fn);
    cpar_ctx *ctx = l->ctx;
    if (!l->have_x)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: no forward input is kept (call cpar_linear_forward first)", fn);
    CPAR_TRY(cpar__lin_check_act(l, fn, "dy", dy));
    int64_t want[CPAR_MAX_DIMS];
    const char *why;
    cpar__lin_y_shape(l, &l->x, l->fgo, want, &why);
    CPAR_TRY(cpar__check_shape(ctx, fn, "dy", dy, want, l->x.ndim, why));
    if (dx) {
        CPAR_TRY(cpar__lin_check_act(l, fn, "dx", dx));
        CPAR_TRY(cpar__check_shape(ctx, fn, "dx", dx, l->x.shape, l->x.ndim, "as forward's x"));
        if (cpar__ranges_overlap(dx->data, cpar_tensor_nbytes(dx), dy->data, cpar_tensor_nbytes(dy)))
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dx overlaps dy", fn);
        if (cpar__ranges_overlap(dx->data, cpar_tensor_nbytes(dx), l->x.data, cpar_tensor_nbytes(&l->x)))
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dx overlaps forward's x (still needed for the weight gradient)", fn);
    }
    if (l->row) return cpar__lin_row_backward(l, fn, dy, dx);
    /* Megatron's grad_output_buffer: dy is kept (and the wgrad skipped) while
     * the list holds fewer than the limit; the i-th dy pairs with the i-th
     * forward input, which must be this backward's forward */
    const int lim = l->cfg.wgrad_deferral_limit;
    const bool defer = l->cfg.defer_embedding_wgrad_compute && (lim == 0 || l->n_grad < lim);
    if (defer && (l->n_act != l->n_grad + 1 || l->defer[l->n_grad].x.data != l->x.data))
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: the deferral lists are out of step (%d activations, %d grad outputs; expected one "
                          "more activation, from this backward's forward): run one backward per forward, in order",
                          fn, l->n_act, l->n_grad);
    CPAR_TRY(cpar__lin_column_backward(l, fn, dy, dx, defer ? NULL : l->fdw));
    if (defer) {
        cpar__lin_deferred *d = &l->defer[l->n_grad++];
        const bool go = l->fgo && l->n > 1; /* this rank's columns of a gathered dy, as the backward read them */
        d->dy = go ? (const char *)dy->data + (size_t)(l->r * l->out_l) * cpar_dtype_size(l->cfg.dtype) : dy->data;
        d->ldy = go ? l->out_l * l->n : l->out_l;
        d->T = cpar__lin_tokens(dy);
    }
    return CPAR_OK;
}

/* ---- deferred weight gradients (Megatron's drain_embedding_wgrad_compute) ----
 * Pairs in order; with sequence parallelism the inputs are all-gathered
 * again into two workspace buffers used in turn: on device tensors the
 * gather of pair i+1 runs on the communication stream while pair i's GEMM
 * runs on compute (Megatron's double buffer of async all-gathers):
 *   comm: gather 0 -> buf0, record ev_comm      compute: wait ev_comm
 *   comm: wait ev_compute, gather 1 -> buf1     compute: GEMM 0 (buf0), record ev_compute
 *   comm: record ev_comm                        compute: wait ev_comm
 *   comm: wait ev_compute (GEMM 0 is done with buf0), gather 2 -> buf0   compute: GEMM 1 ...
 * then compute joins comm. Host tensors: the same order, sequentially. */
/* All-gather the deferred input d->x along dim 0 into buf (on the
 * communication stream when on_comm). */
static cpar_status cpar__lin_drain_gather(cpar_linear *l, const char *fn, const cpar__lin_deferred *d, void *buf,
                                          bool on_comm) {
    cpar_tensor xg = d->x;
    xg.shape[0] *= l->n;
    xg.data = buf;
    if (on_comm) cpar__on_comm_stream(l->ctx);
    cpar_status st = cpar__as(l->ctx, fn, cpar_all_gather(l->tp, &d->x, &xg, NULL));
    cpar__on_compute_stream(l->ctx);
    return st;
}

cpar_status cpar_linear_drain_wgrad(cpar_linear *l) {
    static const char fn[] = "cpar_linear_drain_wgrad";
    if (!l) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: l is NULL", fn);
    cpar_ctx *ctx = l->ctx;
    if (!l->cfg.defer_embedding_wgrad_compute)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg defer_embedding_wgrad_compute is false: nothing is deferred", fn);
    if (l->n_act != l->n_grad)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: %d activations but %d grad outputs are deferred (Megatron: the lengths of the "
                          "activation and gradient buffers need to be equal): run every forward's backward first",
                          fn, l->n_act, l->n_grad);
    const int count = l->n_grad;
    if (count == 0) return CPAR_OK;
    const size_t es = cpar_dtype_size(l->cfg.dtype);
    const int n = l->n;
    const bool sp = l->cfg.sequence_parallel && n > 1;
    const int64_t K = l->in_l, N = l->out_l;
    int64_t Tmax = 0;
    for (int i = 0; i < count; i++) Tmax = l->defer[i].T > Tmax ? l->defer[i].T : Tmax;
    const bool overlap = sp && l->ev_compute && cpar__on_device(ctx->device);
    cpar_dev_event ev_cp = overlap ? l->ev_compute : NULL, ev_cm = overlap ? l->ev_comm : NULL;
    cpar__lin_ws w = {0};
    int s_buf[2];
    s_buf[0] = cpar__lin_ws_add(&w, sp ? (size_t)(Tmax * K) * es : 0);
    s_buf[1] = cpar__lin_ws_add(&w, sp && count > 1 ? (size_t)(Tmax * K) * es : 0);
    l->n_act = l->n_grad = 0; /* emptied, also on failure */
    CPAR_TRY(cpar__lin_ws_carve(ctx, fn, &w));
    cpar_status st = CPAR_OK;
    /* fork: comm starts after everything queued on compute (the inputs, and
     * whatever used the workspace before) */
    CPAR_TRY(cpar__lin_order(l, fn, ev_cp, ctx->compute, ctx->comm));
    if (sp) st = cpar__lin_drain_gather(l, fn, &l->defer[0], w.ptr[s_buf[0]], overlap);
    for (int i = 0; i < count && st == CPAR_OK; i++) {
        const cpar__lin_deferred *d = &l->defer[i];
        if (ev_cm) { /* compute: gather i (the last one queued on comm) is done */
            st = cpar__lin_order(l, fn, ev_cm, ctx->comm, ctx->compute);
            if (st != CPAR_OK) break;
        }
        if (sp && i + 1 < count) { /* gather i + 1 into the buffer GEMM i - 1 read */
            if (ev_cp && i >= 1) {
                st = cpar_dev_stream_wait_event(ctx->comm, ev_cp); /* recorded after GEMM i - 1 */
                if (st != CPAR_OK) { st = cpar__dev_fail(ctx, st, fn); break; }
            }
            st = cpar__lin_drain_gather(l, fn, &l->defer[i + 1], w.ptr[s_buf[(i + 1) % 2]], overlap);
            if (st != CPAR_OK) break;
        }
        st = cpar__lin_wgrad(l, fn, d->dy, d->ldy, sp ? w.ptr[s_buf[i % 2]] : d->x.data, K, d->T, N, K, d->dw);
        if (st == CPAR_OK && ev_cp) {
            st = cpar_dev_event_record(ev_cp, ctx->compute);
            if (st != CPAR_OK) st = cpar__dev_fail(ctx, st, fn);
        }
    }
    /* compute waits for everything queued on comm, also after a failure */
    cpar_status js = cpar__lin_order(l, fn, ev_cm, ctx->comm, ctx->compute);
    return st != CPAR_OK ? st : js;
}

/* ==== 18. Local attention ==================================================
 * Owns cpar.h §12's local attention: cpar_attention_forward/_backward (and
 * their _cfg forms with dropout) on one rank, attention dropout's mask (host
 * twin of the kernels'), and the block functions below that the ring
 * attention of section 19 calls once per KV block. Host tensors run FlashAttention-2's tiled loops on
 * the host GEMM (fp32 accumulation, online softmax); device tensors run the
 * flash kernels of cpar_kernels.cu §16 through cpar_dev_attention_fwd / _bwd.
 * Scratch: one workspace carve per call (the GEMM's panels are its own).
 * Uses: 2 (errors, argument checks), 3 (tensors, fp16/bf16 bits), 4 (device
 * dispatch, workspace), 5 (element load/store, host GEMM, exp).
 *
 * Contract shared with section 19 (ring attention) — do not change the
 * signatures without telling the ring attention's author:
 *
 * One block of attention on raw buffers: host memory when !on_device
 * (the host reference), device memory otherwise (the flash kernels).
 * Layout and strides as cpar_dev_attn (cpar.h §12): a sub-range of the
 * sequence (e.g. the second half of q) is a pointer offset with the parent's
 * strides. */
typedef cpar_dev_attn cpar__attn_io; /* cpar.h §12 device layer: the same description on host memory */

/* out [b, hq, sq, d] of dtype out_dt (F32 or io->dt) with (b,h) stride o_bh,
 * lse F32 with (b,h) stride lse_bh: both overwritten. A row that sees no key:
 * lse = -inf, out row = 0. Stream-ordered on ctx's compute stream. */
static cpar_status cpar__attn_fwd(cpar_ctx *ctx, const char *fn, bool on_device, const cpar__attn_io *io,
                                  void *out, cpar_dtype out_dt, int64_t o_bh, float *lse, int64_t lse_bh,
                                  void *scratch);

/* Accumulate (+=) this block's gradients in fp32: dq [b,hq,sq,d] (stride dq_bh),
 * dk, dv [b,hkv,sk,d] (stride dkv_bh). out/dout (dtype out_dt, stride o_bh)
 * and lse (stride lse_bh) are those of the whole attention this block is part
 * of (for the ring: the merged output and lse), so P = exp(scale·qkᵀ - lse)
 * and D_i = rowsum(dout_i ∘ out_i). A row with lse = -inf contributes nothing.
 * The caller zeroes dq/dk/dv before the first block. */
static cpar_status cpar__attn_bwd(cpar_ctx *ctx, const char *fn, bool on_device, const cpar__attn_io *io,
                                  const void *out, const void *dout, cpar_dtype out_dt, int64_t o_bh,
                                  const float *lse, int64_t lse_bh, float *dq, int64_t dq_bh, float *dk, float *dv,
                                  int64_t dkv_bh, void *scratch);

/* Neither block function touches ctx->ws: the caller owns the workspace and
 * passes scratch of at least this many bytes (on the block's memory: device
 * or host), 256-byte aligned. Zero is a valid answer. */
static size_t cpar__attn_scratch_bytes(const cpar__attn_io *io, bool backward);

/* ---- packed sequences (cpar.h §12): the check sections 18-20 share ---------- */

/* A validated cpar_packed_seqs: the boundaries the buffer is cut at. */
typedef struct cpar__packing {
    int n_docs;
    const int32_t *cu; /* the padded boundaries (cu_seqlens where there is no padding) */
    int64_t total;     /* cu[n_docs]: the packed buffer's length */
} cpar__packing;

/* Check seqs for P ranks (cpar.h §12's rules) and resolve it into *pk. Each
 * failure names the array, the index and the document. P = 0: one unsharded
 * buffer (local attention), whose documents may have any lengths. */
static cpar_status cpar__packed_check(cpar_ctx *ctx, const char *fn, const cpar_packed_seqs *seqs, int P,
                                      cpar__packing *pk) {
    if (!seqs) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: seqs is NULL (the packed sequences)", fn);
    if (seqs->n_docs < 1)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: seqs->n_docs is %d, expected >= 1", fn, seqs->n_docs);
    const int32_t *arr[2] = {seqs->cu_seqlens, seqs->cu_seqlens_padded};
    static const char *names[2] = {"cu_seqlens", "cu_seqlens_padded"};
    if (!arr[0]) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: seqs->cu_seqlens is NULL", fn);
    const int n = seqs->n_docs;
    for (int a = 0; a < 2; a++) {
        if (!arr[a]) continue;
        if (arr[a][0] != 0)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: seqs->%s[0] is %ld, expected 0", fn, names[a],
                              (long)arr[a][0]);
        for (int i = 0; i < n; i++)
            if (arr[a][i + 1] < arr[a][i])
                return cpar__fail(ctx, CPAR_ERR_INVALID,
                                  "%s: seqs->%s decreases at document %d: %s[%d] = %ld < %s[%d] = %ld (expected "
                                  "non-decreasing)", fn, names[a], i, names[a], i + 1, (long)arr[a][i + 1], names[a],
                                  i, (long)arr[a][i]);
    }
    const int32_t *cu = arr[1] ? arr[1] : arr[0];
    const char *cn = names[arr[1] ? 1 : 0];
    const int64_t chunks = 2 * (int64_t)P;
    for (int i = 0; i < n; i++) {
        const int64_t len = (int64_t)cu[i + 1] - cu[i];
        if (arr[1] && len < (int64_t)arr[0][i + 1] - arr[0][i])
            return cpar__fail(ctx, CPAR_ERR_INVALID,
                              "%s: document %d has padded length %lld (cu_seqlens_padded[%d] - [%d]) < its length "
                              "%lld (cu_seqlens[%d] - [%d])", fn, i, (long long)len, i + 1, i,
                              (long long)((int64_t)arr[0][i + 1] - arr[0][i]), i + 1, i);
        if (P > 0 && len % chunks)
            return cpar__fail(ctx, CPAR_ERR_INVALID,
                              "%s: document %d has %slength %lld (%s[%d] - [%d]), not divisible by 2*cp = %lld (each "
                              "document is cut into 2*cp chunks)", fn, i, arr[1] ? "padded " : "", (long long)len, cn,
                              i + 1, i, (long long)chunks);
    }
    pk->n_docs = n;
    pk->cu = cu;
    pk->total = cu[n];
    return CPAR_OK;
}

/* ---- the host reference ------------------------------------------------------ */

#define CPAR__ATTN_ALIGN ((size_t)256)

static size_t cpar__attn_round(size_t bytes) { return (bytes + CPAR__ATTN_ALIGN - 1) / CPAR__ATTN_ALIGN * CPAR__ATTN_ALIGN; }

/* FlashAttention-2's loop order on host memory, every product on the host
 * GEMM of section 5 (16-bit operands widened while it packs them, fp32
 * accumulation). Forward, per (b, h) and BQ-row tile of queries: for each
 * BK-key tile it may see, S = scale Q Kᵀ, the online softmax (running row max
 * m and sum l; the exponentials by cpar__exp_sub_sum), O = O·corr + P V; then
 * out = O / l and lse = m + log l. Backward, per (b, h) and key tile, for
 * each query tile that sees it: P = exp(scale Q Kᵀ − lse) recomputed,
 * dV += Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − D) with D = rowsum(dO ∘ O), dQ +=
 * scale dS K, dK += scale dSᵀ Q. Tiles skip what causality hides; a tile on
 * the diagonal runs in strips (cpar__attn_strip) whose products stop at the
 * strip's last row, and each row's keys past its diagonal are zeroed, never
 * exponentiated. The S / P and dP tiles stay in cache. Dropout: forward
 * zeroes the dropped weights after l has summed them (lse is dropout's
 * input) and scales out by 1/(1-p); backward builds the tile's mask
 * Z = keep/(1-p) once, dV += (P∘Z)ᵀ dO and dS = P ∘ (dP∘Z − D). */
enum { CPAR__HATTN_BQ = 128, CPAR__HATTN_BK = 128, CPAR__HATTN_STRIP = 32 };

/* Scratch floats of the host path (see cpar__attn_scratch_bytes). */
static size_t cpar__host_attn_floats(const cpar__attn_io *io, bool backward) {
    const size_t tile = (size_t)CPAR__HATTN_BQ * CPAR__HATTN_BK;
    const size_t drop = io->dropout_p > 0.f ? tile : 0; /* backward: the tile's mask Z / (1 - p) */
    return backward ? 2 * tile + drop + (size_t)io->sq : tile + (size_t)CPAR__HATTN_BQ * (size_t)(io->d + 2);
}

/* ---- dropout's mask (host twin of cpar_kernels.cu §16's cpar__attn_keep) ---- */

/* Row i of p (cpar_dev_attn_pos): its global position, and its document in
 * *doc (packed rows: -1 for padding; plain rows: 0). A packed shard's local
 * row i lies in the last document d with cu[d] / P <= i (an empty document
 * never: the next one starts at the same row), in its slot 0 (chunk rank)
 * or slot 1 (chunk 2P-1-rank). Twin of cpar_kernels.cu §16's cpar__attn_row;
 * cpar__attn_slot finds d. */
static int cpar__attn_slot(const cpar_dev_attn_pos *p, int64_t i) {
    int lo = 0, hi = p->n_docs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (p->cu[mid] / p->P <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static int64_t cpar__attn_row(const cpar_dev_attn_pos *p, int64_t i, int *doc) {
    if (!p->cu) {
        *doc = 0;
        return i < p->split ? p->off0 + i : p->off1 + (i - p->split);
    }
    const int32_t *cu = p->cu;
    const int64_t P = p->P;
    if (i >= cu[p->n_docs] / P) { /* past the shard: nobody's */
        *doc = -1;
        return i;
    }
    const int lo = cpar__attn_slot(p, i);
    int64_t g = i;
    if (P > 1) {
        const int64_t c = ((int64_t)cu[lo + 1] - cu[lo]) / (2 * P), o = i - cu[lo] / P;
        g = cu[lo] + (o < c ? p->rank : 2 * P - 1 - p->rank) * c + o % c;
    }
    *doc = g - cu[lo] < (int64_t)p->cu_real[lo + 1] - p->cu_real[lo] ? lo : -1;
    return g;
}

static int64_t cpar__attn_pos(const cpar_dev_attn_pos *p, int64_t i) {
    int doc;
    return cpar__attn_row(p, i, &doc);
}

/* The positions of rows [a, ...) of plain rows p, as a description of their own. */
static cpar_dev_attn_pos cpar__attn_pos_sub(cpar_dev_attn_pos p, int64_t a) {
    if (a >= p.split) return (cpar_dev_attn_pos){.split = 0, .off0 = 0, .off1 = p.off1 + (a - p.split)};
    return (cpar_dev_attn_pos){.split = p.split - a, .off0 = p.off0 + a, .off1 = p.off1};
}

/* Packed blocks (both row sets packed) mask by document and, causal, by
 * global position; plain ones by the top-left index rule. */
static bool cpar__attn_is_packed(const cpar__attn_io *io) { return io->qp.cu && io->kp.cu; }

/* -inf where query q0 + i does not see key k0 + j of a packed block. */
static void cpar__attn_mask_packed(const cpar__attn_io *io, float *S, int64_t bq, int64_t bk, int64_t q0, int64_t k0) {
    for (int64_t i = 0; i < bq; i++) {
        int dq, dk;
        const int64_t qpos = cpar__attn_row(&io->qp, q0 + i, &dq);
        for (int64_t j = 0; j < bk; j++) {
            const int64_t kpos = cpar__attn_row(&io->kp, k0 + j, &dk);
            if (!(dq >= 0 && dq == dk && (!io->causal || kpos <= qpos))) S[i * bk + j] = -INFINITY;
        }
    }
}

/* Whether a packed block's tile, query rows [q0, q0 + bq) by keys [k0,
 * k0 + bk), hides every weight (twin of the kernels' cpar__attn_tile_span).
 * Along a shard documents and global positions never decrease (chunk r
 * precedes chunk 2P-1-r within a document), so the tile is hidden when its
 * keys all lie in earlier documents than its first query, in later ones than
 * its last, or (causal) after its last query; rows past a shard are nobody's.
 * A hidden tile's weights are exact zeros: skipping it changes no bit. */
static bool cpar__attn_tile_hidden(const cpar__attn_io *io, int64_t q0, int64_t bq, int64_t k0, int64_t bk) {
    const int64_t q1 = cpar__min64(q0 + bq, io->qp.cu[io->qp.n_docs] / io->qp.P) - 1; /* last row in the shard */
    const int64_t k1 = cpar__min64(k0 + bk, io->kp.cu[io->kp.n_docs] / io->kp.P) - 1;
    if (q1 < q0 || k1 < k0) return true;
    if (cpar__attn_slot(&io->kp, k1) < cpar__attn_slot(&io->qp, q0)) return true;
    if (cpar__attn_slot(&io->kp, k0) > cpar__attn_slot(&io->qp, q1)) return true;
    return io->causal && cpar__attn_pos(&io->kp, k0) > cpar__attn_pos(&io->qp, q1);
}

/* Whether attention weight (bh, qpos, kpos) survives dropout p (cpar.h §12). */
static bool cpar__attn_keep(const cpar_rng_state *rng, float p, uint64_t bh, uint64_t qpos, uint64_t kpos) {
    const uint64_t c = rng->offset + (kpos >> 2), sub = ((bh + 1) << 32) + qpos;
    const uint32_t ctr[4] = {(uint32_t)c, (uint32_t)(c >> 32), (uint32_t)sub, (uint32_t)(sub >> 32)};
    uint32_t w[4];
    cpar__philox(ctr, (uint32_t)rng->seed, (uint32_t)(rng->seed >> 32), w);
    return cpar__rng_u01(w[kpos & 3]) >= p;
}

/* The kept weights' factor 1 / (1 - p) in fp32 (1 without dropout); the
 * device launchers compute the same expression on the host. */
static float cpar__attn_keep_scale(const cpar__attn_io *io) { return 1.0f / (1.0f - io->dropout_p); }

/* Row i0 + i, key k0 + j of S [bq, bk] (row-major): multiply each element by
 * its mask value (0 or keep_scale) into Z, or zero the dropped ones in place
 * when Z is NULL. */
static void cpar__attn_drop_tile(const cpar__attn_io *io, int64_t bh, int64_t i0, int64_t k0, int64_t bq, int64_t bk,
                                 float *S, float *Z, float keep_scale) {
    if (io->mask_hq) bh = bh / io->hq * io->mask_hq + io->mask_h0 + bh % io->hq; /* a head shard's mask */
    for (int64_t i = 0; i < bq; i++) {
        const uint64_t qpos = (uint64_t)cpar__attn_pos(&io->qp, i0 + i);
        for (int64_t j = 0; j < bk; j++) {
            const bool keep = cpar__attn_keep(&io->rng, io->dropout_p, (uint64_t)bh, qpos,
                                              (uint64_t)cpar__attn_pos(&io->kp, k0 + j));
            if (Z) Z[i * bk + j] = keep ? keep_scale : 0.f;
            else if (!keep) S[i * bk + j] = 0.f;
        }
    }
}

/* S [bq, bk] (row-major) = alpha · A[bq rows of d] · B[bk rows of d]ᵀ: the
 * GEMM's column-major Sᵀ = op_T(B) A. */
static cpar_status cpar__attn_qkt(cpar_ctx *ctx, const char *fn, float alpha, const void *A, cpar_dtype adt,
                                  const void *B, cpar_dtype bdt, int64_t bq, int64_t bk, int64_t d, float *S) {
    return cpar__host_gemm(ctx, fn, 1, 0, bk, bq, d, alpha, B, bdt, d, A, adt, d, 0.f, S, CPAR_F32, bk);
}

static const void *cpar__attn_at(const void *p, cpar_dtype dt, int64_t off) {
    return (const char *)p + (size_t)off * cpar_dtype_size(dt);
}

static int64_t cpar__attn_pos0(int64_t x) { return x > 0 ? x : 0; }

/* A plain causal tile [q0, q0 + bq) x [k0, k0 + bk) that crosses the
 * diagonal runs in strips of CPAR__HATTN_STRIP query rows, each strip's
 * products stopping at its last row's diagonal, so the GEMMs skip most of the
 * hidden triangle (whole 128-key tiles would compute a quarter more than
 * causal attention's work at s = 512); the rows from the first that sees
 * every key of the tile on run as one strip. For the strip that starts at
 * tile row r: returns its row count and sets *kn to the keys [k0, k0 + *kn)
 * its rows may see (0: none). */
static int64_t cpar__attn_strip(const cpar__attn_io *io, bool packed, int64_t q0, int64_t bq, int64_t r, int64_t k0,
                                int64_t bk, int64_t *kn) {
    if (!io->causal || packed || k0 + bk - 1 <= q0 + r) { /* every key of the tile is visible to every row */
        *kn = bk;
        return bq - r;
    }
    const int64_t rows = cpar__min64(CPAR__HATTN_STRIP, bq - r);
    *kn = cpar__min64(bk, cpar__attn_pos0(q0 + r + rows - k0)); /* top-left: key k0 + j sees query rows >= k0 + j */
    return rows;
}

/* How many of a strip's n keys from k0 query row q sees: a plain causal
 * row those up to its own position, any other row all n (a packed block's
 * hidden keys are -inf in S). */
static int64_t cpar__attn_row_keys(const cpar__attn_io *io, bool packed, int64_t q, int64_t k0, int64_t n) {
    return io->causal && !packed ? cpar__min64(n, cpar__attn_pos0(q - k0 + 1)) : n;
}

static cpar_status cpar__host_attn_fwd(cpar_ctx *ctx, const char *fn, const cpar__attn_io *io, void *out,
                                       cpar_dtype out_dt, int64_t o_bh, float *lse, int64_t lse_bh, float *scratch) {
    const int64_t d = io->d, group = io->hq / io->hkv;
    float *S = scratch, *O = S + CPAR__HATTN_BQ * CPAR__HATTN_BK, *m = O + CPAR__HATTN_BQ * d, *l = m + CPAR__HATTN_BQ;
    const bool drop = io->dropout_p > 0.f, packed = cpar__attn_is_packed(io);
    const float keep_scale = cpar__attn_keep_scale(io);
    for (int64_t bi = 0; bi < io->b; bi++)
        for (int64_t hi = 0; hi < io->hq; hi++) {
            const int64_t bh = bi * io->hq + hi, qbase = bh * io->q_bh, obase = bh * o_bh;
            const int64_t kvbase = (bi * io->hkv + hi / group) * io->kv_bh;
            for (int64_t q0 = 0; q0 < io->sq; q0 += CPAR__HATTN_BQ) {
                const int64_t bq = cpar__min64(CPAR__HATTN_BQ, io->sq - q0);
                /* plain causal: the tile's last row sees keys < kend; packed: hidden tiles are skipped below */
                const int64_t kend = io->causal && !packed ? cpar__min64(io->sk, q0 + bq) : io->sk;
                for (int64_t i = 0; i < bq; i++) m[i] = -INFINITY, l[i] = 0.f;
                memset(O, 0, sizeof(float) * (size_t)(bq * d));
                for (int64_t k0 = 0; k0 < kend; k0 += CPAR__HATTN_BK) {
                    const int64_t bk = cpar__min64(CPAR__HATTN_BK, kend - k0);
                    if (packed && cpar__attn_tile_hidden(io, q0, bq, k0, bk)) continue;
                    int64_t kn;
                    for (int64_t r = 0, rows; r < bq; r += rows) {
                        rows = cpar__attn_strip(io, packed, q0, bq, r, k0, bk, &kn);
                        if (kn == 0) continue; /* the strip's rows see none of these keys */
                        /* S [rows, kn] (row stride kn) = scale Q Kᵀ */
                        CPAR_TRY(cpar__attn_qkt(ctx, fn, io->scale, cpar__attn_at(io->q, io->dt, qbase + (q0 + r) * d),
                                                io->dt, cpar__attn_at(io->k, io->dt, kvbase + k0 * d), io->dt, rows,
                                                kn, d, S));
                        if (packed) cpar__attn_mask_packed(io, S, rows, kn, q0 + r, k0);
                        for (int64_t i = 0; i < rows; i++) {
                            /* the online softmax over the keys the row sees; P = 0 past them */
                            float *srow = S + i * kn, *mi = m + r + i, *li = l + r + i;
                            const int64_t nv = cpar__attn_row_keys(io, packed, q0 + r + i, k0, kn);
                            const float mx = cpar__row_max(srow, nv, *mi);
                            if (mx == -INFINITY) { /* nothing visible yet: P = 0 */
                                memset(srow, 0, sizeof(float) * (size_t)kn);
                                continue;
                            }
                            const float corr = *mi == -INFINITY ? 0.f : expf(*mi - mx);
                            *li = *li * corr + cpar__exp_sub_sum(srow, nv, mx);
                            if (nv < kn) memset(srow + nv, 0, sizeof(float) * (size_t)(kn - nv));
                            *mi = mx;
                            if (corr != 1.f) cpar__row_scale(O + (r + i) * d, d, corr);
                        }
                        /* l summed the weights before dropout (lse is dropout's input); P V uses the kept ones */
                        if (drop) cpar__attn_drop_tile(io, bh, q0 + r, k0, rows, kn, S, NULL, 0.f);
                        /* O [rows, d] += P [rows, kn] V [kn, d]: column-major Oᵀ += Vᵀ Pᵀ */
                        CPAR_TRY(cpar__host_gemm(ctx, fn, 0, 0, d, rows, kn, 1.f,
                                                 cpar__attn_at(io->v, io->dt, kvbase + k0 * d), io->dt, d, S, CPAR_F32,
                                                 kn, 1.f, O + r * d, CPAR_F32, d));
                    }
                }
                for (int64_t i = 0; i < bq; i++) {
                    float *orow = O + i * d;
                    lse[bh * lse_bh + q0 + i] = l[i] > 0.f ? m[i] + logf(l[i]) : -INFINITY;
                    cpar__row_scale(orow, d, l[i] > 0.f ? keep_scale / l[i] : 0.f); /* l = 0: the row saw no key */
                    if (out_dt == CPAR_F32) memcpy((float *)out + obase + (q0 + i) * d, orow, sizeof(float) * (size_t)d);
                    else cpar__blk_narrow(out, out_dt, obase + (q0 + i) * d, orow, (int)d);
                }
            }
        }
    return CPAR_OK;
}

/* D_i = dout_i · out_i (sums in cpar__blk_sum's fixed order) for the
 * n rows of d elements at off (16-bit rows widened a block at a time). */
static void cpar__attn_bwd_delta(const void *out, const void *dout, cpar_dtype dt, int64_t off, int64_t n, int64_t d,
                                 float *D) {
    float ba[CPAR__BLK], bb[CPAR__BLK];
    for (int64_t i = 0; i < n; i++) {
        double acc[CPAR__LANES] = {0};
        const int64_t row = off + i * d;
        CPAR__BLOCKS(d, c0, len,
                     cpar__blk_sum(acc, cpar__blk_in(ba, dout, dt, row + c0, len),
                                   cpar__blk_in(bb, out, dt, row + c0, len), len);)
        D[i] = (float)cpar__lanes_sum(acc);
    }
}

static cpar_status cpar__host_attn_bwd(cpar_ctx *ctx, const char *fn, const cpar__attn_io *io, const void *out,
                                       const void *dout, cpar_dtype out_dt, int64_t o_bh, const float *lse,
                                       int64_t lse_bh, float *dq, int64_t dq_bh, float *dk, float *dv, int64_t dkv_bh,
                                       float *scratch) {
    const int64_t d = io->d, group = io->hq / io->hkv;
    const float scale = io->scale;
    const bool drop = io->dropout_p > 0.f, packed = cpar__attn_is_packed(io), skip = io->causal && !packed;
    float *P = scratch, *dP = P + CPAR__HATTN_BQ * CPAR__HATTN_BK, *D = dP + CPAR__HATTN_BQ * CPAR__HATTN_BK;
    float *Z = drop ? D : NULL; /* the mask tile, then D */
    if (drop) D += CPAR__HATTN_BQ * CPAR__HATTN_BK;
    for (int64_t bi = 0; bi < io->b; bi++)
        for (int64_t hi = 0; hi < io->hq; hi++) {
            const int64_t bh = bi * io->hq + hi, hk = bi * io->hkv + hi / group;
            const int64_t qbase = bh * io->q_bh, obase = bh * o_bh, kvbase = hk * io->kv_bh;
            const float *L = lse + bh * lse_bh;
            cpar__attn_bwd_delta(out, dout, out_dt, obase, io->sq, d, D);
            for (int64_t k0 = 0; k0 < io->sk; k0 += CPAR__HATTN_BK) {
                const int64_t bk = cpar__min64(CPAR__HATTN_BK, io->sk - k0);
                const void *Kt = cpar__attn_at(io->k, io->dt, kvbase + k0 * d), *Vt = cpar__attn_at(io->v, io->dt, kvbase + k0 * d);
                float *dKt = dk + hk * dkv_bh + k0 * d, *dVt = dv + hk * dkv_bh + k0 * d;
                /* causal: query rows before k0 see none of these keys */
                for (int64_t q0 = skip ? k0 / CPAR__HATTN_BQ * CPAR__HATTN_BQ : 0; q0 < io->sq; q0 += CPAR__HATTN_BQ) {
                    const int64_t bq = cpar__min64(CPAR__HATTN_BQ, io->sq - q0);
                    if (skip && q0 + bq - 1 < k0) continue;
                    if (packed && cpar__attn_tile_hidden(io, q0, bq, k0, bk)) continue;
                    int64_t kn;
                    for (int64_t r = 0, rows; r < bq; r += rows) {
                        rows = cpar__attn_strip(io, packed, q0, bq, r, k0, bk, &kn);
                        if (kn == 0) continue;
                        const int64_t q = q0 + r, e = rows * kn; /* the strip: rows q.., keys k0 .. k0 + kn - 1 */
                        const void *Qt = cpar__attn_at(io->q, io->dt, qbase + q * d);
                        const void *dOt = cpar__attn_at(dout, out_dt, obase + q * d);
                        CPAR_TRY(cpar__attn_qkt(ctx, fn, scale, Qt, io->dt, Kt, io->dt, rows, kn, d, P));
                        if (packed) cpar__attn_mask_packed(io, P, rows, kn, q, k0);
                        for (int64_t i = 0; i < rows; i++) {
                            float *prow = P + i * kn;
                            const int64_t nv = L[q + i] == -INFINITY ? 0 /* saw no key */
                                                                     : cpar__attn_row_keys(io, packed, q + i, k0, kn);
                            cpar__exp_sub_sum(prow, nv, L[q + i]);
                            if (nv < kn) memset(prow + nv, 0, sizeof(float) * (size_t)(kn - nv));
                        }
                        /* dV [kn, d] += (P ∘ Z)ᵀ dO: column-major dVᵀ += dOᵀ (P ∘ Z); with dropout P ∘ Z
                         * (Z = mask / (1 - p)) is built in dP, which is free until dP = dO Vᵀ below */
                        const float *PZ = P;
                        if (drop) {
                            cpar__attn_drop_tile(io, bh, q, k0, rows, kn, NULL, Z, cpar__attn_keep_scale(io));
                            for (int64_t x = 0; x < e; x++) dP[x] = P[x] * Z[x];
                            PZ = dP;
                        }
                        CPAR_TRY(cpar__host_gemm(ctx, fn, 0, 1, d, kn, rows, 1.f, dOt, out_dt, d, PZ, CPAR_F32, kn, 1.f,
                                                 dVt, CPAR_F32, d));
                        CPAR_TRY(cpar__attn_qkt(ctx, fn, 1.f, dOt, out_dt, Vt, io->dt, rows, kn, d, dP)); /* dP = dO Vᵀ */
                        /* dS = P ∘ (dP ∘ Z − D): the gradient reaches the weight before dropout through the mask */
                        if (drop)
                            for (int64_t x = 0; x < e; x++) dP[x] *= Z[x];
                        for (int64_t i = 0; i < rows; i++) cpar__row_dsoftmax(dP + i * kn, P + i * kn, kn, D[q + i]);
                        /* dQ [rows, d] += scale dS K: column-major dQᵀ += Kᵀ dSᵀ */
                        CPAR_TRY(cpar__host_gemm(ctx, fn, 0, 0, d, rows, kn, scale, Kt, io->dt, d, dP, CPAR_F32, kn,
                                                 1.f, dq + bh * dq_bh + q * d, CPAR_F32, d));
                        /* dK [kn, d] += scale dSᵀ Q: column-major dKᵀ += Qᵀ dS */
                        CPAR_TRY(cpar__host_gemm(ctx, fn, 0, 1, d, kn, rows, scale, Qt, io->dt, d, dP, CPAR_F32, kn,
                                                 1.f, dKt, CPAR_F32, d));
                    }
                }
            }
        }
    return CPAR_OK;
}

/* ---- the block functions (contract above) ------------------------------------ */

static size_t cpar__attn_scratch_bytes(const cpar__attn_io *io, bool backward) {
    /* The host path needs its tiles (and the backward D per query row); the
     * device forward none. The memory kind is the caller's, so the answer
     * covers both paths. */
    const size_t host = cpar__host_attn_floats(io, backward) * sizeof(float);
    const size_t dev = backward ? cpar_dev_attention_bwd_scratch_bytes(io) : 0;
    return cpar__attn_round(host > dev ? host : dev);
}

static cpar_status cpar__attn_fwd(cpar_ctx *ctx, const char *fn, bool on_device, const cpar__attn_io *io,
                                  void *out, cpar_dtype out_dt, int64_t o_bh, float *lse, int64_t lse_bh,
                                  void *scratch) {
    if (io->b == 0 || io->hq == 0 || io->sq == 0) return CPAR_OK;
    if (on_device) {
        cpar__attn_io fio = *io;
        fio.fwd_heads_first = ctx->attn_fwd_heads_first;
        CPAR_DEV_TRY(ctx, fn, cpar_dev_attention_fwd(&fio, out, out_dt, o_bh, lse, lse_bh, ctx->compute));
    } else
        CPAR_TRY(cpar__host_attn_fwd(ctx, fn, io, out, out_dt, o_bh, lse, lse_bh, scratch));
    return CPAR_OK;
}

static cpar_status cpar__attn_bwd(cpar_ctx *ctx, const char *fn, bool on_device, const cpar__attn_io *io,
                                  const void *out, const void *dout, cpar_dtype out_dt, int64_t o_bh,
                                  const float *lse, int64_t lse_bh, float *dq, int64_t dq_bh, float *dk, float *dv,
                                  int64_t dkv_bh, void *scratch) {
    if (io->b == 0 || io->hq == 0 || io->sq == 0 || io->sk == 0) return CPAR_OK;
    if (on_device) {
        cpar__attn_io dio = *io;
        dio.atomic_dq = ctx->attn_atomic_dq;
        CPAR_DEV_TRY(ctx, fn, cpar_dev_attention_bwd(&dio, out, dout, out_dt, o_bh, lse, lse_bh, dq, dq_bh, dk, dv,
                                                     dkv_bh, scratch, ctx->compute));
    } else
        CPAR_TRY(cpar__host_attn_bwd(ctx, fn, io, out, dout, out_dt, o_bh, lse, lse_bh, dq, dq_bh, dk, dv, dkv_bh,
                                     scratch));
    return CPAR_OK;
}

/* ---- public functions ------------------------------------------------------------ */

/* t is on `device` (q's), or an error naming t and q's memory. */
static cpar_status cpar__attn_check_device(cpar_ctx *ctx, const char *fn, const char *name, const cpar_tensor *t,
                                           int device) {
    if (t->device == device) return CPAR_OK;
    char got[32], want[32];
    return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is on %s, expected %s (as q)", fn, name,
                      cpar__device_str(t->device, got, sizeof got), cpar__device_str(device, want, sizeof want));
}

/* A tensor like q (or k) on q's memory with q's dtype and the given shape. */
static cpar_status cpar__attn_check_like(cpar_ctx *ctx, const char *fn, const char *name, const cpar_tensor *t,
                                         const cpar_tensor *q, const int64_t *shape, int ndim, const char *why) {
    CPAR_TRY(cpar__check_tensor(ctx, fn, name, t, -2));
    CPAR_TRY(cpar__attn_check_device(ctx, fn, name, t, q->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, name, t, q->dtype));
    return cpar__check_shape(ctx, fn, name, t, shape, ndim, why);
}

/* The lse tensor: F32 [b, hq, sq] on q's memory. */
static cpar_status cpar__attn_check_lse(cpar_ctx *ctx, const char *fn, const cpar_tensor *lse, const cpar_tensor *q) {
    CPAR_TRY(cpar__check_tensor(ctx, fn, "lse", lse, -2));
    CPAR_TRY(cpar__attn_check_device(ctx, fn, "lse", lse, q->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "lse", lse, CPAR_F32));
    return cpar__check_shape(ctx, fn, "lse", lse, q->shape, 3, "[b, hq, sq] of q");
}

/* p is a dropout probability attention takes (name: how the caller spelled it). */
static cpar_status cpar__attn_check_dropout(cpar_ctx *ctx, const char *fn, const char *name, float p) {
    if (p >= 0.f && p < 1.f) return CPAR_OK;
    return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is %g, expected 0 <= p < 1 (p = 1 would drop every weight)", fn,
                      name, (double)p);
}

/* Dropout's positions are Philox counter words: below 2^32. */
static cpar_status cpar__attn_check_positions(cpar_ctx *ctx, const char *fn, float p, int64_t sq, int64_t sk) {
    if (p == 0.f || (sq <= (int64_t)UINT32_MAX && sk <= (int64_t)UINT32_MAX)) return CPAR_OK;
    return cpar__fail(ctx, CPAR_ERR_INVALID,
                      "%s: global sequence lengths %lld (queries) and %lld (keys), expected below 2^32 with dropout",
                      fn, (long long)sq, (long long)sk);
}

/* Checks of q, k, v and the configuration shared by forward and backward
 * (pre: "" for the bool/float functions, "cfg->" for the _cfg ones); fills
 * the block description of the whole attention (contiguous strides). */
static cpar_status cpar__attn_check_qkv(cpar_ctx *ctx, const char *fn, const char *pre,
                                        const cpar_attention_config *cfg, const cpar_tensor *q, const cpar_tensor *k,
                                        const cpar_tensor *v, cpar__attn_io *io) {
    const float scale = cfg->scale;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "q", q, -2));
    if (q->device != CPAR_HOST && q->device != ctx->device) {
        char got[32], want[32];
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: q is on %s, expected host or the context's %s", fn,
                          cpar__device_str(q->device, got, sizeof got), cpar__device_str(ctx->device, want, sizeof want));
    }
    CPAR_TRY(cpar__check_float(ctx, fn, "q", q));
    if (q->ndim != 4) {
        char got[128];
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: q has shape %s, expected [b, hq, sq, d]", fn,
                          cpar__shape_str(q, got, sizeof got));
    }
    CPAR_TRY(cpar__check_tensor(ctx, fn, "k", k, -2));
    CPAR_TRY(cpar__attn_check_device(ctx, fn, "k", k, q->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "k", k, q->dtype));
    if (k->ndim != 4) {
        char got[128];
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: k has shape %s, expected [b, hkv, sk, d]", fn,
                          cpar__shape_str(k, got, sizeof got));
    }
    const int64_t b = q->shape[0], hq = q->shape[1], sq = q->shape[2], d = q->shape[3];
    const int64_t hkv = k->shape[1], sk = k->shape[2];
    const int64_t kshape[4] = {b, hkv, sk, d};
    CPAR_TRY(cpar__check_shape(ctx, fn, "k", k, kshape, 4, "[b, hkv, sk, d] with q's b and d"));
    CPAR_TRY(cpar__attn_check_like(ctx, fn, "v", v, q, k->shape, 4, "as k"));
    if (hkv < 1 || hq % hkv)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: k has %lld heads, expected a divisor of q's %lld heads (grouped-query attention)", fn,
                          (long long)hkv, (long long)hq);
    if (d < 1) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: q has head dim d = %lld, expected >= 1", fn, (long long)d);
    if (!isfinite(scale) || scale < 0.f)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %sscale is %g, expected finite and >= 0 (0: 1/sqrt(d))", fn, pre,
                          (double)scale);
    char pname[32];
    snprintf(pname, sizeof pname, "%sdropout_p", pre);
    CPAR_TRY(cpar__attn_check_dropout(ctx, fn, pname, cfg->dropout_p));
    CPAR_TRY(cpar__attn_check_positions(ctx, fn, cfg->dropout_p, sq, sk));
    if (cpar__on_device(q->device)) {
        if (q->dtype == CPAR_F32)
            return cpar__fail(ctx, CPAR_ERR_UNSUPPORTED,
                              "%s: q has dtype f32 on device %d; device attention takes f16 or bf16 (f32 runs on "
                              "host tensors)", fn, q->device);
        if (d % 8 || d > 128)
            return cpar__fail(ctx, CPAR_ERR_INVALID,
                              "%s: q has head dim d = %lld, expected a multiple of 8 up to 128 on devices", fn,
                              (long long)d);
    }
    memset(io, 0, sizeof *io);
    io->dt = q->dtype;
    io->b = b, io->hq = hq, io->hkv = hkv, io->sq = sq, io->sk = sk, io->d = d;
    io->q = q->data, io->k = k->data, io->v = v->data;
    io->q_bh = sq * d, io->kv_bh = sk * d;
    io->causal = cfg->causal;
    io->scale = scale > 0.f ? scale : (float)(1.0 / sqrt((double)d));
    io->dropout_p = cfg->dropout_p;
    io->rng = cfg->dropout_state;
    if (cfg->packed) {
        cpar__packing pk;
        CPAR_TRY(cpar__packed_check(ctx, fn, cfg->packed, 0, &pk));
        if (b != 1)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: q has batch %lld, expected 1 with %spacked (a THD batch)", fn,
                              (long long)b, pre);
        if (sq != pk.total || sk != pk.total)
            return cpar__fail(ctx, CPAR_ERR_INVALID,
                              "%s: q and k have lengths %lld and %lld, expected %lld (the packed length of %spacked)",
                              fn, (long long)sq, (long long)sk, (long long)pk.total, pre);
        io->qp = (cpar_dev_attn_pos){.cu = pk.cu, .cu_real = cfg->packed->cu_seqlens, .n_docs = pk.n_docs, .P = 1};
        io->kp = io->qp;
    }
    return CPAR_OK;
}

/* Device bytes for a packed block's boundaries (cu and cu_real of n_docs
 * documents); 0 for plain rows or host memory. */
static size_t cpar__attn_packed_bytes(const cpar__attn_io *io, bool dev) {
    return dev && io->qp.cu ? cpar__attn_round(2 * (size_t)(io->qp.n_docs + 1) * sizeof(int32_t)) : 0;
}

/* On devices the kernels read the packing's boundaries from device memory:
 * copy them (host arrays) to `where` (cpar__attn_packed_bytes) and point the
 * block's row descriptions there. */
static cpar_status cpar__attn_packed_upload(cpar_ctx *ctx, const char *fn, cpar__attn_io *io, void *where) {
    if (!cpar__attn_packed_bytes(io, true)) return CPAR_OK;
    const size_t n = (size_t)(io->qp.n_docs + 1);
    int32_t *cu = where, *real = cu + n;
    CPAR_TRY(cpar__copy_bytes(ctx, fn, cu, ctx->device, io->qp.cu, CPAR_HOST, n * sizeof(int32_t)));
    CPAR_TRY(cpar__copy_bytes(ctx, fn, real, ctx->device, io->qp.cu_real, CPAR_HOST, n * sizeof(int32_t)));
    io->qp.cu = io->kp.cu = cu;
    io->qp.cu_real = io->kp.cu_real = real;
    return CPAR_OK;
}

/* Error when two of the n tensors (the first `outputs` of them written)
 * overlap, an output with anything. */
static cpar_status cpar__attn_check_overlap(cpar_ctx *ctx, const char *fn, const cpar_tensor *const *t,
                                            const char *const *names, int n, int outputs) {
    for (int i = 0; i < outputs; i++)
        for (int j = 0; j < n; j++)
            if (j != i && cpar__ranges_overlap(t[i]->data, cpar_tensor_nbytes(t[i]), t[j]->data, cpar_tensor_nbytes(t[j])))
                return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s overlaps %s", fn, names[i], names[j]);
    return CPAR_OK;
}

/* Scratch of `bytes` on the tensors' memory: the context workspace, except
 * for host tensors on a device context (the reference path there, never a
 * hot path), which take a host allocation returned in *owned for the caller
 * to free. */
static cpar_status cpar__attn_scratch(cpar_ctx *ctx, const char *fn, int device, size_t bytes, void **out,
                                      void **owned) {
    *owned = NULL;
    if (device == ctx->device) return cpar__workspace(ctx, fn, bytes, out);
    CPAR_TRY(cpar__mem_alloc(ctx, fn, CPAR_HOST, bytes, owned));
    *out = *owned;
    return CPAR_OK;
}

/* ctx and cfg are there (pre as cpar__attn_check_qkv). */
static cpar_status cpar__attn_check_cfg(cpar_ctx *ctx, const char *fn, const char *pre,
                                        const cpar_attention_config *cfg) {
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    if (*pre && !cfg) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg is NULL", fn);
    return CPAR_OK;
}

static cpar_status cpar__attention_forward(cpar_ctx *ctx, const char *fn, const char *pre,
                                           const cpar_attention_config *cfg, const cpar_tensor *q,
                                           const cpar_tensor *k, const cpar_tensor *v, cpar_tensor *out,
                                           cpar_tensor *lse) {
    CPAR_TRY(cpar__attn_check_cfg(ctx, fn, pre, cfg));
    cpar__attn_io io;
    CPAR_TRY(cpar__attn_check_qkv(ctx, fn, pre, cfg, q, k, v, &io));
    CPAR_TRY(cpar__attn_check_like(ctx, fn, "out", out, q, q->shape, 4, "as q"));
    CPAR_TRY(cpar__attn_check_lse(ctx, fn, lse, q));
    const cpar_tensor *all[5] = {out, lse, q, k, v};
    static const char *const names[5] = {"out", "lse", "q", "k", "v"};
    CPAR_TRY(cpar__attn_check_overlap(ctx, fn, all, names, 5, 2));

    const bool dev = cpar__on_device(q->device);
    const int64_t rows = io.b * io.hq * io.sq;
    if (rows == 0) return CPAR_OK;
    if (io.sk == 0) { /* no key at all: every row is empty */
        if (dev) {
            CPAR_DEV_TRY(ctx, fn, cpar_dev_fill(out->data, out->dtype, rows * io.d, 0.0, ctx->compute));
            CPAR_DEV_TRY(ctx, fn, cpar_dev_fill(lse->data, CPAR_F32, rows, -INFINITY, ctx->compute));
        } else {
            cpar__host_fill(out->data, out->dtype, rows * io.d, 0.0);
            cpar__host_fill(lse->data, CPAR_F32, rows, -INFINITY);
        }
        return CPAR_OK;
    }
    void *scratch = NULL, *owned = NULL; /* the device forward needs none but a packing's boundaries */
    if (!dev) CPAR_TRY(cpar__attn_scratch(ctx, fn, q->device, cpar__attn_scratch_bytes(&io, false), &scratch, &owned));
    else if (cpar__attn_packed_bytes(&io, true)) {
        CPAR_TRY(cpar__workspace(ctx, fn, cpar__attn_packed_bytes(&io, true), &scratch));
        CPAR_TRY(cpar__attn_packed_upload(ctx, fn, &io, scratch));
    }
    cpar_status st = cpar__attn_fwd(ctx, fn, dev, &io, out->data, out->dtype, io.q_bh, lse->data, io.sq, scratch);
    free(owned);
    return st;
}

cpar_status cpar_attention_forward(cpar_ctx *ctx, const cpar_tensor *q, const cpar_tensor *k, const cpar_tensor *v,
                                   bool causal, float scale, cpar_tensor *out, cpar_tensor *lse) {
    const cpar_attention_config cfg = {.causal = causal, .scale = scale};
    return cpar__attention_forward(ctx, "cpar_attention_forward", "", &cfg, q, k, v, out, lse);
}

cpar_status cpar_attention_forward_cfg(cpar_ctx *ctx, const cpar_attention_config *cfg, const cpar_tensor *q,
                                       const cpar_tensor *k, const cpar_tensor *v, cpar_tensor *out,
                                       cpar_tensor *lse) {
    return cpar__attention_forward(ctx, "cpar_attention_forward_cfg", "cfg->", cfg, q, k, v, out, lse);
}

static cpar_status cpar__attention_backward(cpar_ctx *ctx, const char *fn, const char *pre,
                                            const cpar_attention_config *cfg, const cpar_tensor *q,
                                            const cpar_tensor *k, const cpar_tensor *v, const cpar_tensor *out,
                                            const cpar_tensor *dout, const cpar_tensor *lse, cpar_tensor *dq,
                                            cpar_tensor *dk, cpar_tensor *dv) {
    CPAR_TRY(cpar__attn_check_cfg(ctx, fn, pre, cfg));
    cpar__attn_io io;
    CPAR_TRY(cpar__attn_check_qkv(ctx, fn, pre, cfg, q, k, v, &io));
    CPAR_TRY(cpar__attn_check_like(ctx, fn, "out", out, q, q->shape, 4, "as q, from forward"));
    CPAR_TRY(cpar__attn_check_like(ctx, fn, "dout", dout, q, q->shape, 4, "as q"));
    CPAR_TRY(cpar__attn_check_lse(ctx, fn, lse, q));
    CPAR_TRY(cpar__attn_check_like(ctx, fn, "dq", dq, q, q->shape, 4, "as q"));
    CPAR_TRY(cpar__attn_check_like(ctx, fn, "dk", dk, q, k->shape, 4, "as k"));
    CPAR_TRY(cpar__attn_check_like(ctx, fn, "dv", dv, q, k->shape, 4, "as v"));
    const cpar_tensor *all[9] = {dq, dk, dv, q, k, v, out, dout, lse};
    static const char *const names[9] = {"dq", "dk", "dv", "q", "k", "v", "out", "dout", "lse"};
    CPAR_TRY(cpar__attn_check_overlap(ctx, fn, all, names, 9, 3));

    const bool dev = cpar__on_device(q->device), f32 = q->dtype == CPAR_F32;
    const int64_t nq = cpar_tensor_numel(dq), nkv = cpar_tensor_numel(dk);
    /* fp32 accumulators: the outputs themselves when they are F32, else
     * scratch cast into them at the end. Layout: dq | dk | dv | block scratch. */
    const size_t acc_q = f32 ? 0 : cpar__attn_round((size_t)nq * sizeof(float));
    const size_t acc_kv = f32 ? 0 : cpar__attn_round((size_t)nkv * sizeof(float));
    const size_t block = cpar__attn_scratch_bytes(&io, true), pack = cpar__attn_packed_bytes(&io, dev);
    void *scratch, *owned;
    CPAR_TRY(cpar__attn_scratch(ctx, fn, q->device, acc_q + 2 * acc_kv + block + pack, &scratch, &owned));
    float *gq = f32 ? dq->data : scratch;
    float *gk = f32 ? dk->data : (float *)((char *)scratch + acc_q);
    float *gv = f32 ? dv->data : (float *)((char *)scratch + acc_q + acc_kv);
    void *bscratch = (char *)scratch + acc_q + 2 * acc_kv;
    cpar_status st = CPAR_OK;
    if (pack) CPAR_TRY_GOTO(cpar__attn_packed_upload(ctx, fn, &io, (char *)bscratch + block), st, done);
    if (dev) {
        CPAR_DEV_TRY(ctx, fn, cpar_dev_memset(gq, 0, (size_t)nq * sizeof(float), ctx->compute));
        CPAR_DEV_TRY(ctx, fn, cpar_dev_memset(gk, 0, (size_t)nkv * sizeof(float), ctx->compute));
        CPAR_DEV_TRY(ctx, fn, cpar_dev_memset(gv, 0, (size_t)nkv * sizeof(float), ctx->compute));
    } else {
        memset(gq, 0, (size_t)nq * sizeof(float));
        memset(gk, 0, (size_t)nkv * sizeof(float));
        memset(gv, 0, (size_t)nkv * sizeof(float));
    }
    CPAR_TRY_GOTO(cpar__attn_bwd(ctx, fn, dev, &io, out->data, dout->data, out->dtype, io.q_bh, lse->data, io.sq, gq,
                                 io.q_bh, gk, gv, io.kv_bh, bscratch),
                  st, done);
    if (!f32) {
        if (dev) {
            CPAR_DEV_TRY(ctx, fn, cpar_dev_cast(dq->data, dq->dtype, gq, CPAR_F32, nq, ctx->compute));
            CPAR_DEV_TRY(ctx, fn, cpar_dev_cast(dk->data, dk->dtype, gk, CPAR_F32, nkv, ctx->compute));
            CPAR_DEV_TRY(ctx, fn, cpar_dev_cast(dv->data, dv->dtype, gv, CPAR_F32, nkv, ctx->compute));
        } else {
            cpar__host_cast(dq->data, dq->dtype, gq, CPAR_F32, nq);
            cpar__host_cast(dk->data, dk->dtype, gk, CPAR_F32, nkv);
            cpar__host_cast(dv->data, dv->dtype, gv, CPAR_F32, nkv);
        }
    }
done:
    free(owned);
    return st;
}

cpar_status cpar_attention_backward(cpar_ctx *ctx, const cpar_tensor *q, const cpar_tensor *k, const cpar_tensor *v,
                                    const cpar_tensor *out, const cpar_tensor *dout, const cpar_tensor *lse,
                                    bool causal, float scale, cpar_tensor *dq, cpar_tensor *dk, cpar_tensor *dv) {
    const cpar_attention_config cfg = {.causal = causal, .scale = scale};
    return cpar__attention_backward(ctx, "cpar_attention_backward", "", &cfg, q, k, v, out, dout, lse, dq, dk, dv);
}

cpar_status cpar_attention_backward_cfg(cpar_ctx *ctx, const cpar_attention_config *cfg, const cpar_tensor *q,
                                        const cpar_tensor *k, const cpar_tensor *v, const cpar_tensor *out,
                                        const cpar_tensor *dout, const cpar_tensor *lse, cpar_tensor *dq,
                                        cpar_tensor *dk, cpar_tensor *dv) {
    return cpar__attention_backward(ctx, "cpar_attention_backward_cfg", "cfg->", cfg, q, k, v, out, dout, lse, dq,
                                    dk, dv);
}

/* ==== 19. Ring attention and CP sharding ===================================
 * Owns cpar.h §12's context parallelism for attention: cpar_cp_shard and
 * cpar_cp_unshard (PyTorch's _SequentialSharder / _RoundRobinLoadBalancer and
 * context_parallel_unshard), their packed (THD) twins and the partitioned
 * indices of a packing, cpar_ring_attention_forward / _backward
 * (_templated_ring_attention and its backward, _SDPAMerger, the all-gather
 * and all-to-all rotaters; Megatron's cp_comm_type: the all-to-all of heads
 * on an inner group in front of the ring on the outer one, below). Each ring
 * step is one call of section 18's block functions on pointer-offset
 * sub-ranges of the shards, with the rows' global positions (dropout's mask
 * coordinates; packed batches: the packing and the rank holding the rows,
 * each step one whole masked block); the fp32 merge is cpar_dev_ring_merge
 * (cpar_kernels.cu §17) or its host twin below. Scratch: one carve of the
 * context workspace per call (the collectives never touch it, so it stays
 * valid across them).
 * Uses: 2 (errors, checks), 3 (tensors), 4 (device dispatch, workspace,
 * copies), 5 (host cast, reduce), 10 (group split), 11 (all-gather, ring
 * shift, all-to-all), 18 (block attention). */

/* ---- sequence sharding --------------------------------------------------------- */

/* ---- packed sequences (THD) ----------------------------------------------------
 * Document i occupies global rows [cu[i], cu[i+1]) of the packed buffer (cu =
 * cu_seqlens_padded, or cu_seqlens without padding) and local rows
 * [cu[i]/P, cu[i+1]/P) of every shard: chunk r of its 2P, then chunk 2P-1-r
 * (each (cu[i+1]-cu[i])/2P rows). Sections 19 and 20 check a packing with
 * cpar__packed_check (section 18, which packed attention shares) and move rows
 * with cpar__cp_packed_copy (below the plain chunk copies; cpar_dev_packed_reorder,
 * cpar_kernels.cu §18, on device memory), so sharding, attention and Mamba
 * agree on the layout. */

/* Checks of the group, the whole and the sharded tensor shared by shard and
 * unshard (packed or not); resolves seq_dim and gives the layout [outer, S,
 * inner] of full (S along seq_dim) and the chunk length c (S / (2P) with load
 * balancing, else S / P). dev_only: both tensors on the context's device (a
 * collective). seqs: packed sequences (NULL: none), checked and resolved
 * into *pk; S must then be their packed length. */
static cpar_status cpar__cp_check(const char *fn, cpar_group *cp, const char *full_name, const cpar_tensor *full,
                                  const char *local_name, const cpar_tensor *local, int *seq_dim, bool load_balance,
                                  bool dev_only, const cpar_packed_seqs *seqs, cpar__packing *pk, int64_t *outer,
                                  int64_t *inner, int64_t *c) {
    if (!cp) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cp is NULL (the context-parallel group)", fn);
    cpar_ctx *ctx = cp->ctx;
    const int P = cp->size;
    const cpar_tensor *t[2] = {full, local};
    const char *names[2] = {full_name, local_name};
    for (int i = 0; i < 2; i++) {
        CPAR_TRY(cpar__check_tensor(ctx, fn, names[i], t[i], dev_only ? ctx->device : -2));
        if (!dev_only && t[i]->device != CPAR_HOST && t[i]->device != ctx->device) {
            char got[32], want[32];
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is on %s, expected host or the context's %s", fn,
                              names[i], cpar__device_str(t[i]->device, got, sizeof got),
                              cpar__device_str(ctx->device, want, sizeof want));
        }
    }
    CPAR_TRY(cpar__check_dtype(ctx, fn, local_name, local, full->dtype));
    if (full->ndim < 1)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is a scalar, expected a sequence dimension", fn, full_name);
    const int nd = full->ndim;
    if (*seq_dim < -nd || *seq_dim >= nd)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: seq_dim is %d, expected -%d..%d (dims of %s)", fn, *seq_dim, nd,
                          nd - 1, full_name);
    if (*seq_dim < 0) *seq_dim += nd;
    const int sd = *seq_dim;
    const int64_t S = full->shape[sd], chunks = load_balance ? 2 * (int64_t)P : P;
    if (seqs) {
        CPAR_TRY(cpar__packed_check(ctx, fn, seqs, P, pk));
        if (S != pk->total)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has length %lld along seq_dim %d, expected %lld (the "
                              "packed length, seqs->%s[%d])", fn, full_name, (long long)S, sd, (long long)pk->total,
                              seqs->cu_seqlens_padded ? "cu_seqlens_padded" : "cu_seqlens", pk->n_docs);
    } else if (S % chunks)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: %s has length %lld along seq_dim %d, not divisible by %lld (%s with cp = %d)", fn,
                          full_name, (long long)S, sd, (long long)chunks,
                          load_balance ? "2 * cp chunks for load balancing" : "cp chunks", P);
    int64_t want[CPAR_MAX_DIMS];
    memcpy(want, full->shape, sizeof want);
    want[sd] = S / P;
    char why[96];
    snprintf(why, sizeof why, "%s with dim %d divided by cp = %d", full_name, sd, P);
    CPAR_TRY(cpar__check_shape(ctx, fn, local_name, local, want, nd, why));
    if (cpar__ranges_overlap(full->data, cpar_tensor_nbytes(full), local->data, cpar_tensor_nbytes(local)))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s overlaps %s", fn, local_name, full_name);
    *outer = 1, *inner = 1;
    for (int i = 0; i < sd; i++) *outer *= full->shape[i];
    for (int i = sd + 1; i < nd; i++) *inner *= full->shape[i];
    *c = S / chunks;
    return CPAR_OK;
}

/* The global chunk held in slot `slot` of rank r's shard: r (sequential), or
 * r and 2P-1-r (load balancing). */
static int64_t cpar__cp_chunk_of(int P, int r, bool load_balance, int slot) {
    return !load_balance ? r : slot == 0 ? r : 2 * (int64_t)P - 1 - r;
}

/* Copy c sequence rows between the whole tensor (layout [outer, S, inner],
 * memory full, rows from g0) and one shard ([outer, S/P, inner], memory
 * local, rows from l0), either way: one pitched copy over outer. */
static cpar_status cpar__cp_copy_rows(cpar_ctx *ctx, const char *fn, void *full, int full_dev, void *local,
                                      int local_dev, int64_t outer, int64_t S, int64_t inner, size_t es, int P,
                                      int64_t g0, int64_t l0, int64_t c, bool to_local) {
    if (!c || !outer || !inner) return CPAR_OK;
    const size_t row = (size_t)(c * inner) * es, full_pitch = (size_t)(S * inner) * es;
    const size_t local_pitch = (size_t)(S / P * inner) * es;
    char *f = (char *)full + (size_t)(g0 * inner) * es, *l = (char *)local + (size_t)(l0 * inner) * es;
    if (to_local) return cpar__copy_2d(ctx, fn, l, local_pitch, local_dev, f, full_pitch, full_dev, row, (size_t)outer);
    return cpar__copy_2d(ctx, fn, f, full_pitch, full_dev, l, local_pitch, local_dev, row, (size_t)outer);
}

/* Copy rank r's chunks between the whole tensor (layout [outer, S, inner],
 * memory full) and one shard ([outer, S/P, inner], memory local), either way. */
static cpar_status cpar__cp_copy(cpar_ctx *ctx, const char *fn, void *full, int full_dev, void *local, int local_dev,
                                 int64_t outer, int64_t S, int64_t inner, int64_t c, size_t es, int P, int r,
                                 bool load_balance, bool to_local) {
    for (int slot = 0; slot < (load_balance ? 2 : 1); slot++)
        CPAR_TRY(cpar__cp_copy_rows(ctx, fn, full, full_dev, local, local_dev, outer, S, inner, es, P,
                                    cpar__cp_chunk_of(P, r, load_balance, slot) * c, slot * c, c, to_local));
    return CPAR_OK;
}

/* Ranks [r0, r0 + nranks)'s chunks of every document between the packed
 * whole ([outer, S, inner], memory full) and their shards ([outer, S/P,
 * inner] each; rank r0 + k's at blocks + k * stride bytes), either way. Both
 * on the device: one cpar_dev_packed_reorder (the boundaries go by value,
 * no device copy of them); otherwise 2 pitched copies per document and rank. */
static cpar_status cpar__cp_packed_copy(cpar_ctx *ctx, const char *fn, const cpar__packing *pk, void *full,
                                        int full_dev, void *blocks, int blocks_dev, size_t stride, int r0, int nranks,
                                        int64_t outer, int64_t inner, size_t es, int P, bool to_local) {
    if (cpar__on_device(full_dev) && cpar__on_device(blocks_dev)) {
        const size_t row = (size_t)inner * es;
        CPAR_DEV_TRY(ctx, fn, cpar_dev_packed_reorder(full, (size_t)pk->total * row, blocks,
                                                      (size_t)(pk->total / P) * row, stride, r0, nranks, P, pk->cu,
                                                      pk->n_docs, outer, row, to_local, ctx->compute));
        return CPAR_OK;
    }
    for (int k = 0; k < nranks; k++) {
        char *local = (char *)blocks + (size_t)k * stride;
        for (int i = 0; i < pk->n_docs; i++) {
            const int64_t start = pk->cu[i], c = ((int64_t)pk->cu[i + 1] - start) / (2 * P);
            for (int slot = 0; slot < 2; slot++)
                CPAR_TRY(cpar__cp_copy_rows(ctx, fn, full, full_dev, local, blocks_dev, outer, pk->total, inner, es,
                                            P, start + cpar__cp_chunk_of(P, r0 + k, true, slot) * c,
                                            start / P + slot * c, c, to_local));
        }
    }
    return CPAR_OK;
}

/* cpar_cp_shard and cpar_cp_shard_packed (seqs != NULL). */
static cpar_status cpar__cp_shard(cpar_group *cp, const char *fn, const cpar_packed_seqs *seqs,
                                  const cpar_tensor *full, int seq_dim, bool load_balance, cpar_tensor *local) {
    int64_t outer, inner, c;
    cpar__packing pk;
    CPAR_TRY(cpar__cp_check(fn, cp, "full", full, "local", local, &seq_dim, load_balance, false, seqs, &pk, &outer,
                            &inner, &c));
    cpar_ctx *ctx = cp->ctx;
    const size_t es = cpar_dtype_size(full->dtype);
    if (!seqs)
        return cpar__cp_copy(ctx, fn, full->data, full->device, local->data, local->device, outer,
                             full->shape[seq_dim], inner, c, es, cp->size, cp->rank, load_balance, true);
    return cpar__cp_packed_copy(ctx, fn, &pk, full->data, full->device, local->data, local->device, 0, cp->rank, 1,
                                outer, inner, es, cp->size, true);
}

/* cpar_cp_unshard and cpar_cp_unshard_packed (seqs != NULL): one all-gather
 * of the shards, then every rank's share put in place. */
static cpar_status cpar__cp_unshard(cpar_group *cp, const char *fn, const cpar_packed_seqs *seqs,
                                    const cpar_tensor *local, int seq_dim, bool load_balance, cpar_tensor *full) {
    int64_t outer, inner, c;
    cpar__packing pk;
    CPAR_TRY(cpar__cp_check(fn, cp, "full", full, "local", local, &seq_dim, load_balance, true, seqs, &pk, &outer,
                            &inner, &c));
    cpar_ctx *ctx = cp->ctx;
    const int P = cp->size;
    const int64_t n = cpar_tensor_numel(local);
    const int64_t in_shape[2] = {1, n}, out_shape[2] = {P, n};
    cpar_tensor in = cpar_tensor_make(local->data, local->dtype, 2, in_shape, local->device);
    /* a sequential shard of the outermost dimension is already in place in
     * the rank-ordered gather: gather straight into full */
    if (!seqs && !load_balance && outer == 1) {
        cpar_tensor out = cpar_tensor_make(full->data, full->dtype, 2, out_shape, full->device);
        return cpar__as(ctx, fn, cpar_all_gather(cp, &in, &out, NULL));
    }
    void *ws;
    CPAR_TRY(cpar__workspace(ctx, fn, cpar_tensor_nbytes(full) ? cpar_tensor_nbytes(full) : 1, &ws));
    cpar_tensor gathered = cpar_tensor_make(ws, local->dtype, 2, out_shape, ctx->device);
    CPAR_TRY(cpar__as(ctx, fn, cpar_all_gather(cp, &in, &gathered, NULL)));
    const size_t es = cpar_dtype_size(full->dtype);
    if (seqs) /* every rank's block in one pass */
        return cpar__cp_packed_copy(ctx, fn, &pk, full->data, full->device, ws, ctx->device, (size_t)n * es, 0, P,
                                    outer, inner, es, P, false);
    for (int j = 0; j < P; j++)
        CPAR_TRY(cpar__cp_copy(ctx, fn, full->data, full->device, (char *)ws + (size_t)(j * n) * es, ctx->device,
                               outer, full->shape[seq_dim], inner, c, es, P, j, load_balance, false));
    return CPAR_OK;
}

cpar_status cpar_cp_shard(cpar_group *cp, const cpar_tensor *full, int seq_dim, bool load_balance,
                          cpar_tensor *local) {
    return cpar__cp_shard(cp, "cpar_cp_shard", NULL, full, seq_dim, load_balance, local);
}

cpar_status cpar_cp_unshard(cpar_group *cp, const cpar_tensor *local, int seq_dim, bool load_balance,
                            cpar_tensor *full) {
    return cpar__cp_unshard(cp, "cpar_cp_unshard", NULL, local, seq_dim, load_balance, full);
}

cpar_status cpar_cp_shard_packed(cpar_group *cp, const cpar_packed_seqs *seqs, const cpar_tensor *full, int seq_dim,
                                 cpar_tensor *local) {
    static const char fn[] = "cpar_cp_shard_packed";
    if (!seqs) return cpar__fail(cp ? cp->ctx : NULL, CPAR_ERR_INVALID, "%s: seqs is NULL (the packed sequences)", fn);
    return cpar__cp_shard(cp, fn, seqs, full, seq_dim, true, local);
}

cpar_status cpar_cp_unshard_packed(cpar_group *cp, const cpar_packed_seqs *seqs, const cpar_tensor *local,
                                   int seq_dim, cpar_tensor *full) {
    static const char fn[] = "cpar_cp_unshard_packed";
    if (!seqs) return cpar__fail(cp ? cp->ctx : NULL, CPAR_ERR_INVALID, "%s: seqs is NULL (the packed sequences)", fn);
    return cpar__cp_unshard(cp, fn, seqs, local, seq_dim, true, full);
}

cpar_status cpar_cp_packed_indices(const cpar_packed_seqs *seqs, int cp_size, int cp_rank, int64_t *indices,
                                   int64_t n) {
    static const char fn[] = "cpar_cp_packed_indices";
    if (cp_size < 1) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cp_size is %d, expected >= 1", fn, cp_size);
    if (cp_rank < 0 || cp_rank >= cp_size)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cp_rank is %d, expected 0..%d (cp_size %d)", fn, cp_rank,
                          cp_size - 1, cp_size);
    cpar__packing pk;
    CPAR_TRY(cpar__packed_check(NULL, fn, seqs, cp_size, &pk));
    if (n != pk.total / cp_size)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: n is %lld, expected %lld (the packed length %lld / cp_size %d)",
                          fn, (long long)n, (long long)(pk.total / cp_size), (long long)pk.total, cp_size);
    if (n && !indices) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: indices is NULL", fn);
    for (int i = 0; i < pk.n_docs; i++) {
        const int64_t start = pk.cu[i], c = ((int64_t)pk.cu[i + 1] - start) / (2 * cp_size);
        int64_t *out = indices + start / cp_size;
        for (int slot = 0; slot < 2; slot++)
            for (int64_t k = 0; k < c; k++)
                out[slot * c + k] = start + cpar__cp_chunk_of(cp_size, cp_rank, true, slot) * c + k;
    }
    return CPAR_OK;
}

/* ---- the merge (host twin of cpar_kernels.cu §17) ---------------------------------- */

/* Twin of the device cpar__ring_merge_coef: the block's weight
 * w = sigmoid(lb - l) and the merged lse l - logsigmoid(l - lb), overflow
 * free; an empty side (lse = -inf) takes the other side as it is. */
static void cpar__ring_merge_coef(float l, float lb, float *w, float *nl) {
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

/* cpar_dev_ring_merge on host memory (same arguments). */
static void cpar__host_ring_merge(float *out, float *lse, const float *out_b, const float *lse_b, int64_t nbh,
                                  int64_t rows, int64_t d, int64_t o_bh, int64_t lse_bh) {
    for (int64_t j = 0; j < nbh; j++)
        for (int64_t i = 0; i < rows; i++) {
            float w, *l = lse + j * lse_bh + i;
            cpar__ring_merge_coef(*l, lse_b[j * lse_bh + i], &w, l);
            if (w == 0.f) continue;
            float *o = out + j * o_bh + i * d;
            const float *ob = out_b + j * o_bh + i * d;
            for (int64_t c = 0; c < d; c++) o[c] -= w * (o[c] - ob[c]);
        }
}

/* ---- comm types and hierarchical groups --------------------------------------------- */

static const char *const cpar__cp_comm_names[CPAR_CP_COMM_TYPE_COUNT] = {"all_gather", "p2p", "a2a", "a2a+p2p"};

const char *cpar_cp_comm_type_name(cpar_cp_comm_type t) {
    return (unsigned)t < (unsigned)CPAR_CP_COMM_TYPE_COUNT ? cpar__cp_comm_names[t] : "?";
}

cpar_status cpar_cp_comm_type_parse(const char *name, cpar_cp_comm_type *out) {
    static const char fn[] = "cpar_cp_comm_type_parse";
    if (!out) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    if (!name) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: name is NULL", fn);
    for (int t = 0; t < CPAR_CP_COMM_TYPE_COUNT; t++)
        if (!strcmp(name, cpar__cp_comm_names[t])) {
            *out = (cpar_cp_comm_type)t;
            return CPAR_OK;
        }
    return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: name is \"%.64s\", expected all_gather, p2p, a2a or a2a+p2p", fn,
                      name);
}

/* A2A_P2P's groups of cp = a x p: inner, the a consecutive ranks sharing
 * rank / a (Megatron's hierarchical_context_parallel_sizes [a, p]: a node's
 * ranks first), and outer, the p ranks sharing rank % a; ordered by cp rank,
 * so this rank is rank % a of its inner group and rank / a of its outer one.
 * Made by two splits of cp (collective) on the first call with this a, kept
 * with cp (freed with it) and remade when a changes. Ranks disagreeing on a
 * get groups of other sizes: refused here on each rank. */
static cpar_status cpar__cp_hier_groups(cpar_group *cp, const char *fn, int a, cpar_group **inner,
                                        cpar_group **outer) {
    cpar_ctx *ctx = cp->ctx;
    if (cp->cp_inner_size != a || !cp->cp_inner || !cp->cp_outer) {
        if (cp->cp_inner) cpar__group_free(cp->cp_inner);
        if (cp->cp_outer) cpar__group_free(cp->cp_outer);
        cp->cp_inner_size = 0;
        cpar_group *in = NULL, *out = NULL;
        cpar__tag_set(cp, "%s(a2a+p2p, a2a_size %d)", fn, a); /* the split compares it: ranks disagreeing fail here */
        cpar_status st = cpar__as(ctx, fn, cpar_group_split(cp, cp->rank / a, cp->rank, &in));
        cpar_status so = cpar__as(ctx, fn, cpar_group_split(cp, cp->rank % a, cp->rank, &out));
        if (st == CPAR_OK) st = so;
        if (st == CPAR_OK && (in->size != a || out->size != cp->size / a))
            st = cpar__fail(ctx, CPAR_ERR_INVALID,
                            "%s: cfg->a2a_size is %d here, but the ranks of cp disagree (groups of %d and %d ranks "
                            "formed, expected %d and %d)", fn, a, in->size, out->size, a, cp->size / a);
        if (st != CPAR_OK) {
            if (in) cpar__group_free(in);
            if (out) cpar__group_free(out);
            return st;
        }
        in->cp_parent = out->cp_parent = cp;
        cp->cp_inner = in, cp->cp_outer = out, cp->cp_inner_size = a;
    }
    *inner = cp->cp_inner, *outer = cp->cp_outer;
    return CPAR_OK;
}

/* ---- ring attention ------------------------------------------------------------------ */

/* What step i of rank r computes (the seed's _is_causal_behavior plus its
 * load-balancing branches). */
typedef enum cpar__ring_kind {
    CPAR__RING_SKIP = 0, /* causal, no load balancing, i > r: the block is all in the future */
    CPAR__RING_CAUSAL,   /* causal step 0: the local block, top-left causal */
    CPAR__RING_FULL,     /* every query sees every key */
    CPAR__RING_KV_HALF,  /* load balancing, i <= r: all queries, the first half of the keys */
    CPAR__RING_Q_HALF,   /* load balancing, i > r: the second half of the queries, every key */
    CPAR__RING_PACKED    /* packed sequences: every query against every key, masked by document
                          * and (causal) global position: each document's chunk pairs follow the
                          * load-balanced rule above, but they interleave along the shard */
} cpar__ring_kind;

static cpar__ring_kind cpar__ring_step_kind(const cpar_ring_attention_config *cfg, int r, int i) {
    if (cfg->packed) return CPAR__RING_PACKED;
    if (!cfg->causal) return CPAR__RING_FULL;
    if (i == 0) return CPAR__RING_CAUSAL;
    if (!cfg->load_balance) return i <= r ? CPAR__RING_FULL : CPAR__RING_SKIP;
    return i <= r ? CPAR__RING_KV_HALF : CPAR__RING_Q_HALF;
}

#define CPAR__RING_ALIGN ((size_t)256)
#define CPAR__RING_SLOTS 24

/* The state of one ring call. Streams on devices:
 *   compute: every block, merge, zeroing and cast;
 *   comm:    the KV rotation (all-gather once, or one ring shift per step
 *            issued before the step's block so the next block's transfer
 *            overlaps this block) and the dK/dV ring shifts of backward.
 * Events: ev_cp (compute -> comm: the buffers a transfer reads or
 * overwrites are done with), ev_kv (the next KV block arrived), ev_dkv (the
 * travelling dK/dV accumulator arrived). A compute wait is issued before the
 * event is recorded again, so every wait sees the record it means. Host
 * tensors: the same order, sequentially; the simulator runs this very
 * schedule with its streams queued (lazy or random in make test). */
typedef struct cpar__ring {
    cpar_ctx *ctx;
    cpar_group *g;
    const char *fn;
    const cpar_ring_attention_config *cfg;
    cpar__attn_io io; /* this rank's q against its own KV shard (strides of the whole shards) */
    int P, r;
    bool dev;
    size_t es;
    int64_t nkv; /* elements of k (and of v) */
    /* workspace carve */
    size_t off[CPAR__RING_SLOTS], total;
    int nslots;
    void *ptr[CPAR__RING_SLOTS];
    /* rotation: ALLGATHER: kvg [P][k | v] gathered from the local [k | v]
     * packed in buf[0] (one collective, as PyTorch's _AllGatherRotater);
     * ALLTOALL: buf[2] = [k | v] blocks */
    void *kvg, *buf[2];
    bool allgather; /* the rotation: ALL_GATHER, else ring send/recv (P2P) */
    cpar_dev_event ev_cp, ev_kv, ev_dkv;
    bool forked; /* comm holds work compute has not waited for */
    /* all-to-all CP (A2A, A2A_P2P: A > 1): the caller's tensors go through
     * the inner group ga (A ranks, this one ar) into the head layout, and
     * g, P, r and io above are the outer ring's (A2A: P = 1) */
    cpar_group *ga;
    int A, ar;
    int64_t b, hq, hkv, sq, sk; /* the caller's shapes */
    cpar__packing pk;           /* cfg->packed, checked for the whole cp group */
} cpar__ring;

static int cpar__ring_slot(cpar__ring *R, size_t bytes) {
    R->off[R->nslots] = R->total;
    R->total += (bytes + CPAR__RING_ALIGN - 1) / CPAR__RING_ALIGN * CPAR__RING_ALIGN;
    R->ptr[R->nslots] = NULL;
    return R->nslots++;
}

/* One workspace carve for every slot; empty slots stay NULL. */
static cpar_status cpar__ring_carve(cpar__ring *R) {
    void *base;
    CPAR_TRY(cpar__workspace(R->ctx, R->fn, R->total ? R->total : 1, &base));
    for (int i = 0; i < R->nslots; i++)
        R->ptr[i] = (i + 1 < R->nslots ? R->off[i + 1] : R->total) > R->off[i] ? (char *)base + R->off[i] : NULL;
    return CPAR_OK;
}

/* The rotation's slots: ALLGATHER every rank's [k | v] and the local one;
 * ALLTOALL two [k | v] blocks. None for P = 1. */
static void cpar__ring_rot_slots(cpar__ring *R, int *a, int *b) {
    const size_t blk = (size_t)R->nkv * R->es;
    *a = *b = -1;
    if (R->P == 1) return;
    if (R->allgather) {
        *a = cpar__ring_slot(R, 2 * blk * (size_t)R->P);
        *b = cpar__ring_slot(R, 2 * blk);
    } else {
        *a = cpar__ring_slot(R, 2 * blk);
        *b = cpar__ring_slot(R, 2 * blk);
    }
}

static void cpar__ring_rot_bind(cpar__ring *R, int a, int b) {
    if (a < 0) return;
    if (R->allgather) R->kvg = R->ptr[a], R->buf[0] = R->ptr[b];
    else R->buf[0] = R->ptr[a], R->buf[1] = R->ptr[b];
}

/* Events exist only on devices with P > 1. The context creates its three on
 * the first such call and keeps them until cpar_finalize (no allocation per
 * call); every call records before it waits, so reuse across calls is safe. */
static cpar_status cpar__ring_events(cpar__ring *R) {
    if (!R->dev || R->P == 1) return CPAR_OK;
    cpar_ctx *ctx = R->ctx;
    for (int i = 0; i < 3 && !ctx->ring_ev[2]; i++) {
        cpar_status st = cpar_dev_event_create(&ctx->ring_ev[i]);
        if (st != CPAR_OK) {
            for (int j = 0; j < i; j++) cpar_dev_event_destroy(ctx->ring_ev[j]), ctx->ring_ev[j] = NULL;
            return cpar__dev_fail(ctx, st, R->fn);
        }
    }
    R->ev_cp = ctx->ring_ev[0], R->ev_kv = ctx->ring_ev[1], R->ev_dkv = ctx->ring_ev[2];
    return CPAR_OK;
}

/* After a failure, compute waits for everything queued on comm, so the call
 * leaves both streams ordered. A call that succeeded needs no join: each
 * exchange it queued on comm is waited for by a later step (cpar__ring_wait
 * of ev_kv at the next block, of ev_dkv after the last), so compute is
 * already behind all of comm (tests/mutate_waits.sh found an unconditional
 * join here removable, docs/DESIGN.md section 10). */
static cpar_status cpar__ring_finish(cpar__ring *R, cpar_status st) {
    cpar__on_compute_stream(R->ctx);
    if (st != CPAR_OK && R->forked && R->ev_kv && cpar_dev_event_record(R->ev_kv, R->ctx->comm) == CPAR_OK)
        (void)cpar_dev_stream_wait_event(R->ctx->compute, R->ev_kv); /* st, the first failure, is the one reported */
    return st;
}

/* Comm starts after everything queued on compute so far. */
static cpar_status cpar__ring_fork(cpar__ring *R) {
    if (!R->ev_cp) return CPAR_OK;
    CPAR_DEV_TRY(R->ctx, R->fn, cpar_dev_event_record(R->ev_cp, R->ctx->compute));
    CPAR_DEV_TRY(R->ctx, R->fn, cpar_dev_stream_wait_event(R->ctx->comm, R->ev_cp));
    R->forked = true;
    cpar__on_comm_stream(R->ctx);
    return CPAR_OK;
}

/* Back on compute; ev marks the end of the comm work just issued. */
static cpar_status cpar__ring_unfork(cpar__ring *R, cpar_dev_event ev) {
    cpar__on_compute_stream(R->ctx);
    if (ev) CPAR_DEV_TRY(R->ctx, R->fn, cpar_dev_event_record(ev, R->ctx->comm));
    return CPAR_OK;
}

static cpar_status cpar__ring_wait(cpar__ring *R, cpar_dev_event ev) {
    if (ev) CPAR_DEV_TRY(R->ctx, R->fn, cpar_dev_stream_wait_event(R->ctx->compute, ev));
    return CPAR_OK;
}

/* Start the KV rotation: pack the local [k | v] into buf[0]; ALLGATHER then
 * gathers every rank's [k | v] on comm in one collective (overlapped with
 * step 0, which uses the local shard); for ALLTOALL buf[0] is the block the
 * first ring shift sends. */
static cpar_status cpar__ring_start(cpar__ring *R) {
    if (R->P == 1) return CPAR_OK;
    cpar_ctx *ctx = R->ctx;
    const size_t blk = (size_t)R->nkv * R->es;
    CPAR_TRY(cpar__copy_bytes(ctx, R->fn, R->buf[0], ctx->device, R->io.k, ctx->device, blk));
    CPAR_TRY(cpar__copy_bytes(ctx, R->fn, (char *)R->buf[0] + blk, ctx->device, R->io.v, ctx->device, blk));
    if (!R->allgather) return CPAR_OK;
    const int64_t in_shape[2] = {1, 2 * R->nkv}, out_shape[2] = {R->P, 2 * R->nkv};
    cpar_tensor in = cpar_tensor_make(R->buf[0], R->io.dt, 2, in_shape, ctx->device);
    cpar_tensor out = cpar_tensor_make(R->kvg, R->io.dt, 2, out_shape, ctx->device);
    CPAR_TRY(cpar__ring_fork(R));
    cpar_status st = cpar__as(R->ctx, R->fn, cpar_all_gather(R->g, &in, &out, NULL));
    cpar_status us = cpar__ring_unfork(R, R->ev_kv);
    return st != CPAR_OK ? st : us;
}

/* Before step i's block: the KV block of rank (r - i) mod P in *kp, *vp
 * (compute ordered after its arrival) and, for ALLTOALL, the ring shift of
 * this block to the next rank (which receives it for step i + 1) issued on
 * comm, so it overlaps step i's block. */
static cpar_status cpar__ring_next(cpar__ring *R, int i, const void **kp, const void **vp) {
    *kp = R->io.k, *vp = R->io.v;
    if (R->P == 1) return CPAR_OK;
    const size_t blk = (size_t)R->nkv * R->es;
    if (R->allgather) {
        if (i == 1) CPAR_TRY(cpar__ring_wait(R, R->ev_kv));
        if (i > 0) {
            const size_t src = (size_t)((R->r - i + R->P) % R->P);
            *kp = (const char *)R->kvg + 2 * src * blk, *vp = (const char *)R->kvg + (2 * src + 1) * blk;
        }
        return CPAR_OK;
    }
    if (i > 0) {
        CPAR_TRY(cpar__ring_wait(R, R->ev_kv)); /* block i, shifted during step i - 1 */
        *kp = R->buf[i % 2], *vp = (const char *)R->buf[i % 2] + blk;
    }
    if (i < R->P - 1) {
        /* buf[(i+1) % 2] was last read by step i - 1's block: the fork orders after it */
        const int64_t shape[1] = {2 * R->nkv};
        cpar_tensor send = cpar_tensor_make(R->buf[i % 2], R->io.dt, 1, shape, R->ctx->device);
        cpar_tensor recv = cpar_tensor_make(R->buf[(i + 1) % 2], R->io.dt, 1, shape, R->ctx->device);
        CPAR_TRY(cpar__ring_fork(R));
        cpar_status st = cpar__as(R->ctx, R->fn, cpar_ring_shift(R->g, &send, &recv, 1));
        cpar_status us = cpar__ring_unfork(R, R->ev_kv);
        if (st != CPAR_OK) return st;
        CPAR_TRY(us);
    }
    return CPAR_OK;
}

/* The global positions of rank x's shard of n rows: chunk x of P
 * (sequential) or chunks x and 2P-1-x of 2P (load balancing, n even). */
static cpar_dev_attn_pos cpar__ring_pos(const cpar__ring *R, int x, int64_t n) {
    if (!R->cfg->load_balance) return (cpar_dev_attn_pos){.split = n, .off0 = x * n};
    const int64_t c = n / 2;
    return (cpar_dev_attn_pos){.split = c, .off0 = x * c, .off1 = (2 * (int64_t)R->P - 1 - x) * c};
}

/* The block of step `kind` (KV from rank src) with KV (kp, vp): io's sub-ranges, and the row
 * offset of the queries it covers (the second half for CPAR__RING_Q_HALF). */
static cpar__attn_io cpar__ring_block_io(const cpar__ring *R, cpar__ring_kind kind, int src, const void *kp,
                                         const void *vp, int64_t *q0) {
    cpar__attn_io io = R->io;
    io.k = kp, io.v = vp;
    *q0 = 0;
    if (kind == CPAR__RING_PACKED) { /* the sender's shard of the packing */
        io.kp.rank = src;
        return io;
    }
    io.kp = cpar__ring_pos(R, src, R->io.sk); /* dropout's coordinates: the sender's rows */
    io.causal = kind == CPAR__RING_CAUSAL;
    *q0 = 0;
    if (kind == CPAR__RING_KV_HALF) io.sk = R->io.sk / 2;
    if (kind == CPAR__RING_Q_HALF) {
        *q0 = R->io.sq / 2;
        io.sq = R->io.sq - *q0;
        io.q = (const char *)R->io.q + (size_t)(*q0 * R->io.d) * R->es;
        io.qp = cpar__attn_pos_sub(R->io.qp, *q0);
    }
    return io;
}

/* Checks shared by forward and backward: group, cfg, q, k, v (on the
 * context's device); fills R and its io (the whole local attention). */
static cpar_status cpar__ring_check(cpar__ring *R, const char *fn, cpar_group *cp,
                                    const cpar_ring_attention_config *cfg, const cpar_tensor *q, const cpar_tensor *k,
                                    const cpar_tensor *v) {
    memset(R, 0, sizeof *R);
    if (!cp) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cp is NULL (the context-parallel group)", fn);
    cpar_ctx *ctx = cp->ctx;
    cpar__coll_pending(cp, fn);
    if (!cfg) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg is NULL", fn);
    CPAR_TRY(cpar__attn_check_dropout(ctx, fn, "cfg->dropout_p", cfg->dropout_p));
    if ((unsigned)cfg->comm_type >= (unsigned)CPAR_CP_COMM_TYPE_COUNT)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: cfg->comm_type is %d, expected CPAR_CP_ALL_GATHER, CPAR_CP_P2P, CPAR_CP_A2A or "
                          "CPAR_CP_A2A_P2P", fn, (int)cfg->comm_type);
    const int A = cfg->comm_type == CPAR_CP_A2A ? cp->size : cfg->comm_type == CPAR_CP_A2A_P2P ? cfg->a2a_size : 1;
    if (cfg->comm_type == CPAR_CP_A2A_P2P && (cfg->a2a_size < 1 || cp->size % cfg->a2a_size))
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: cfg->a2a_size is %d, expected a divisor of the cp size %d (a2a+p2p's all-to-all group)",
                          fn, cfg->a2a_size, cp->size);
    if (cfg->comm_type != CPAR_CP_A2A_P2P && cfg->a2a_size && cfg->a2a_size != A)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg->a2a_size is %d with comm type %s, expected 0 (it sizes "
                          "a2a+p2p's all-to-all group)", fn, cfg->a2a_size, cpar_cp_comm_type_name(cfg->comm_type));
    if (!isfinite(cfg->scale) || cfg->scale < 0.f)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg->scale is %g, expected finite and >= 0 (0: 1/sqrt(d))", fn,
                          (double)cfg->scale);
    CPAR_TRY(cpar__check_tensor(ctx, fn, "q", q, ctx->device));
    CPAR_TRY(cpar__check_float(ctx, fn, "q", q));
    if (q->ndim != 4) {
        char got[128];
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: q has shape %s, expected [b, hq, s_local, d]", fn,
                          cpar__shape_str(q, got, sizeof got));
    }
    const int64_t b = q->shape[0], hq = q->shape[1], sq = q->shape[2], d = q->shape[3];
    const cpar_tensor *kv[2] = {k, v};
    const char *kvn[2] = {"k", "v"};
    for (int i = 0; i < 2; i++) {
        CPAR_TRY(cpar__check_tensor(ctx, fn, kvn[i], kv[i], ctx->device));
        CPAR_TRY(cpar__check_dtype(ctx, fn, kvn[i], kv[i], q->dtype));
        if (kv[i]->ndim != 4) {
            char got[128];
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has shape %s, expected [b, hkv, s_local_kv, d]", fn,
                              kvn[i], cpar__shape_str(kv[i], got, sizeof got));
        }
        const int64_t want[4] = {b, k->shape[1], k->shape[2], d};
        CPAR_TRY(cpar__check_shape(ctx, fn, kvn[i], kv[i], want, 4,
                                   i ? "as k" : "[b, hkv, s_local_kv, d] with q's b and d"));
    }
    const int64_t hkv = k->shape[1], sk = k->shape[2];
    if (hkv < 1 || hq % hkv)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: k has %lld heads, expected a divisor of q's %lld heads (grouped-query attention)", fn,
                          (long long)hkv, (long long)hq);
    if (d < 1) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: q has head dim d = %lld, expected >= 1", fn, (long long)d);
    if (cfg->causal && sk != sq)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: k has s_local %lld, expected q's %lld (causal ring attention needs equal query and "
                          "key shards)", fn, (long long)sk, (long long)sq);
    if (cfg->causal && cfg->load_balance && sq % 2)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: q has s_local = %lld, expected an even length (load balancing holds two chunks)", fn,
                          (long long)sq);
    if (cfg->dropout_p > 0.f && cfg->load_balance && (sq % 2 || sk % 2))
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: q and k have s_local %lld and %lld, expected even lengths (dropout's positions with "
                          "load balancing: two chunks)", fn, (long long)sq, (long long)sk);
    if (A > 1 && (hq % A || hkv % A))
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: q has %lld heads and k %lld, expected both divisible by the all-to-all size %d (%s "
                          "scatters the heads; with fewer KV heads repeat them to %d, or use p2p)", fn, (long long)hq,
                          (long long)hkv, A, cpar_cp_comm_type_name(cfg->comm_type), A);
    if (A > 1 && cfg->load_balance && (sq % 2 || sk % 2))
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: q and k have s_local %lld and %lld, expected even lengths (%s reorders the two "
                          "load-balanced chunks)", fn, (long long)sq, (long long)sk,
                          cpar_cp_comm_type_name(cfg->comm_type));
    CPAR_TRY(cpar__attn_check_positions(ctx, fn, cfg->dropout_p, sq * cp->size, sk * cp->size));
    if (cpar__on_device(ctx->device)) {
        if (q->dtype == CPAR_F32)
            return cpar__fail(ctx, CPAR_ERR_UNSUPPORTED,
                              "%s: q has dtype f32 on device %d; device attention takes f16 or bf16 (f32 runs on "
                              "the host backend)", fn, q->device);
        if (d % 8 || d > 128)
            return cpar__fail(ctx, CPAR_ERR_INVALID,
                              "%s: q has head dim d = %lld, expected a multiple of 8 up to 128 on devices", fn,
                              (long long)d);
    }
    if (cfg->packed) {
        CPAR_TRY(cpar__packed_check(ctx, fn, cfg->packed, cp->size, &R->pk));
        if (!cfg->load_balance)
            return cpar__fail(ctx, CPAR_ERR_INVALID,
                              "%s: cfg->packed needs cfg->load_balance (the THD layout: rank r holds chunks r and "
                              "2*cp-1-r of every document)", fn);
        if (b != 1)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: q has batch %lld, expected 1 with cfg->packed (a THD batch)",
                              fn, (long long)b);
        if (sq * cp->size != R->pk.total || sk != sq)
            return cpar__fail(ctx, CPAR_ERR_INVALID,
                              "%s: q and k have s_local %lld and %lld, expected %lld (the packed length %lld / cp = %d)",
                              fn, (long long)sq, (long long)sk, (long long)(R->pk.total / cp->size),
                              (long long)R->pk.total, cp->size);
    }
    /* every local check passed: the groups (a collective the first time) */
    cpar_group *ring = cp;
    R->ga = cp;
    if (A > 1 && A < cp->size) CPAR_TRY(cpar__cp_hier_groups(cp, fn, A, &R->ga, &ring));
    R->ctx = ctx, R->g = ring, R->fn = fn, R->cfg = cfg;
    R->A = A, R->ar = cp->rank % A;
    R->P = cp->size / A, R->r = cp->rank / A;
    R->allgather = cfg->comm_type == CPAR_CP_ALL_GATHER;
    /* the ranks must agree on the scheme and the shapes (equal shards): the
     * first collective compared (all-gather or all-to-all; the ring's
     * send/recv compare their counts) carries the call */
    if (R->allgather || A > 1)
        cpar__tag_set(A > 1 ? R->ga : cp, "%s(%s%s%.0d, %scausal, %sload-balanced, %s%s [%lld,%lld,%lld,%lld] kv "
                      "[%lld,%lld])", fn, cpar_cp_comm_type_name(cfg->comm_type), A > 1 ? " a=" : "", A > 1 ? A : 0,
                      cfg->causal ? "" : "non-", cfg->load_balance ? "" : "not ", cpar_dtype_name(q->dtype),
                      cfg->packed ? " packed" : "", (long long)b, (long long)hq, (long long)sq, (long long)d,
                      (long long)hkv, (long long)sk);
    R->dev = cpar__on_device(ctx->device);
    R->es = cpar_dtype_size(q->dtype);
    R->nkv = cpar_tensor_numel(k);
    R->b = b, R->hq = hq, R->hkv = hkv, R->sq = sq, R->sk = sk;
    /* the ring's attention: the caller's shards, or (A > 1) the inner
     * group's head shard of its whole sequence shard (pointers set once the
     * all-to-alls have run) */
    cpar__attn_io *io = &R->io;
    io->dt = q->dtype;
    io->b = b, io->hq = hq / A, io->hkv = hkv / A, io->sq = sq * A, io->sk = sk * A, io->d = d;
    io->q = q->data, io->k = k->data, io->v = v->data;
    io->q_bh = io->sq * d, io->kv_bh = io->sk * d;
    io->causal = cfg->causal;
    io->scale = cfg->scale > 0.f ? cfg->scale : (float)(1.0 / sqrt((double)d));
    io->dropout_p = cfg->dropout_p;
    io->rng = cfg->dropout_state;
    if (A > 1) io->mask_hq = hq, io->mask_h0 = R->ar * (hq / A); /* the mask of the global heads */
    io->qp = cpar__ring_pos(R, R->r, io->sq);
    if (cfg->packed) {
        io->qp = (cpar_dev_attn_pos){.cu = R->pk.cu, .cu_real = cfg->packed->cu_seqlens, .n_docs = R->pk.n_docs,
                                     .P = R->P, .rank = R->r};
        io->kp = io->qp;
    }
    return CPAR_OK;
}

/* name like q (dtype, device, shape as ref_shape). */
static cpar_status cpar__ring_check_like(cpar__ring *R, const char *name, const cpar_tensor *t,
                                         const int64_t *shape, int ndim, cpar_dtype dt, const char *why) {
    CPAR_TRY(cpar__check_tensor(R->ctx, R->fn, name, t, R->ctx->device));
    CPAR_TRY(cpar__check_dtype(R->ctx, R->fn, name, t, dt));
    return cpar__check_shape(R->ctx, R->fn, name, t, shape, ndim, why);
}

/* Error when one of the first `outputs` tensors overlaps any other. */
static cpar_status cpar__ring_check_overlap(cpar__ring *R, const cpar_tensor *const *t, const char *const *names,
                                            int n, int outputs) {
    for (int i = 0; i < outputs; i++)
        for (int j = 0; j < n; j++)
            if (j != i && cpar__ranges_overlap(t[i]->data, cpar_tensor_nbytes(t[i]), t[j]->data, cpar_tensor_nbytes(t[j])))
                return cpar__fail(R->ctx, CPAR_ERR_INVALID, "%s: %s overlaps %s", R->fn, names[i], names[j]);
    return CPAR_OK;
}

static cpar_status cpar__ring_zero(cpar__ring *R, void *p, size_t bytes) {
    if (!bytes) return CPAR_OK;
    if (R->dev) CPAR_DEV_TRY(R->ctx, R->fn, cpar_dev_memset(p, 0, bytes, R->ctx->compute));
    else memset(p, 0, bytes);
    return CPAR_OK;
}

/* dst (dtype dt) = src (F32), n elements, on compute. */
static cpar_status cpar__ring_cast(cpar__ring *R, void *dst, cpar_dtype dt, const float *src, int64_t n) {
    if ((const void *)dst == (const void *)src) return CPAR_OK;
    if (R->dev) CPAR_DEV_TRY(R->ctx, R->fn, cpar_dev_cast(dst, dt, src, CPAR_F32, n, R->ctx->compute));
    else cpar__host_cast(dst, dt, src, CPAR_F32, n);
    return CPAR_OK;
}

/* out (b,h-stride o_bh, lse_bh) <- merge with the block's (same strides). */
static cpar_status cpar__ring_merge(cpar__ring *R, float *out, float *lse, const float *out_b, const float *lse_b,
                                    int64_t rows) {
    const int64_t nbh = R->io.b * R->io.hq, d = R->io.d, o_bh = R->io.sq * d, lse_bh = R->io.sq;
    if (R->dev)
        CPAR_DEV_TRY(R->ctx, R->fn,
                     cpar_dev_ring_merge(out, lse, out_b, lse_b, nbh, rows, d, o_bh, lse_bh, R->ctx->compute));
    else
        cpar__host_ring_merge(out, lse, out_b, lse_b, nbh, rows, d, o_bh, lse_bh);
    return CPAR_OK;
}

/* ---- all-to-all (Ulysses) context parallelism ------------------------------------------
 * A2A and A2A_P2P turn each input [b, h, s, inner] (this rank's sequence
 * shard) into [b, h/A, A·s, inner]: head group j of every inner-group rank
 * goes to rank j (one all-to-all, (A-1)/A of the tensor each way), and the A
 * shards received are placed where cpar_cp_unshard would place them over A
 * ranks. That is the outer ring's shard: with load balancing over cp = A·p,
 * outer rank o's chunks o and 2p-1-o of 2p are the cp chunks o·A .. o·A+A-1
 * and their mirrors, so the inner ranks' chunks r and 2cp-1-r (r = o·A + j)
 * are the load-balanced chunks j and 2A-1-j of that shard; sequentially,
 * chunk j of it; packed, the same per document. The ring then runs on the
 * outer group as it does on cp (A2A: one rank, the whole sequence), and the
 * outputs take the way back. Dropout's mask uses the global heads
 * (cpar_dev_attn's mask_hq, mask_h0). */

/* Move the inner ranks' shards (rank j's at blocks + j·stride, each [outer,
 * s, inner]) into or out of y ([outer, A·s, inner]) in the outer shard's
 * layout (to_blocks: out of y). Packed: the packing of the outer shard, whose
 * documents are the global ones divided by p (through a few hundred
 * boundaries at a time on the stack: no allocation). */
static cpar_status cpar__a2a_place(cpar__ring *R, void *y, void *blocks, size_t stride, int64_t outer, int64_t s,
                                   int64_t inner, size_t es, bool to_blocks) {
    const int A = R->A, dev = R->ctx->device;
    if (!R->cfg->packed) {
        const bool lb = R->cfg->load_balance;
        for (int j = 0; j < A; j++)
            CPAR_TRY(cpar__cp_copy(R->ctx, R->fn, y, dev, (char *)blocks + (size_t)j * stride, dev, outer, A * s,
                                   inner, lb ? s / 2 : s, es, A, j, lb, to_blocks));
        return CPAR_OK;
    }
    enum { DOCS = 256 };
    int32_t cu[DOCS + 1];
    for (int d0 = 0; d0 < R->pk.n_docs; d0 += DOCS) {
        const int n = R->pk.n_docs - d0 < DOCS ? R->pk.n_docs - d0 : DOCS;
        for (int i = 0; i <= n; i++) cu[i] = (int32_t)(R->pk.cu[d0 + i] / R->P);
        const cpar__packing part = {.n_docs = n, .cu = cu, .total = R->pk.total / R->P};
        CPAR_TRY(cpar__cp_packed_copy(R->ctx, R->fn, &part, y, dev, blocks, dev, stride, 0, A, outer, inner, es, A,
                                      to_blocks));
    }
    return CPAR_OK;
}

/* x [b, h, s, inner] (dtype dt, this rank's shard) -> y [b, h/A, A·s, inner]
 * over the inner group. send and recv: scratch of nbytes(x) (send unused
 * when b = 1: x's head groups are its all-to-all blocks already). */
static cpar_status cpar__a2a_to_heads(cpar__ring *R, const void *x, cpar_dtype dt, int64_t h, int64_t s,
                                      int64_t inner, void *y, void *send, void *recv) {
    cpar_ctx *ctx = R->ctx;
    const int A = R->A;
    const size_t es = cpar_dtype_size(dt), grp = (size_t)(h / A * s * inner) * es;
    const int64_t blk = R->b * (h / A) * s * inner; /* elements per peer */
    const void *src = x;
    if (R->b > 1) { /* [b][A][grp] -> [A][b][grp] */
        for (int j = 0; j < A; j++)
            CPAR_TRY(cpar__copy_2d(ctx, R->fn, (char *)send + (size_t)j * (size_t)blk * es, grp, ctx->device,
                                   (const char *)x + (size_t)j * grp, (size_t)A * grp, ctx->device, grp,
                                   (size_t)R->b));
        src = send;
    }
    const int64_t shape[2] = {A, blk};
    const cpar_tensor in = cpar_tensor_make((void *)src, dt, 2, shape, ctx->device);
    cpar_tensor out = cpar_tensor_make(recv, dt, 2, shape, ctx->device);
    CPAR_TRY(cpar__as(ctx, R->fn, cpar_all_to_all_single(R->ga, &in, &out, NULL, NULL)));
    return cpar__a2a_place(R, y, recv, (size_t)blk * es, R->b * (h / A), s, inner, es, false);
}

/* The way back: y [b, h/A, A·s, inner] -> x [b, h, s, inner]. send: scratch
 * of nbytes(x); recv too when b > 1 (else the all-to-all lands in x). */
static cpar_status cpar__a2a_to_seq(cpar__ring *R, const void *y, cpar_dtype dt, int64_t h, int64_t s, int64_t inner,
                                    void *x, void *send, void *recv) {
    cpar_ctx *ctx = R->ctx;
    const int A = R->A;
    const size_t es = cpar_dtype_size(dt), grp = (size_t)(h / A * s * inner) * es;
    const int64_t blk = R->b * (h / A) * s * inner;
    CPAR_TRY(cpar__a2a_place(R, (void *)y, send, (size_t)blk * es, R->b * (h / A), s, inner, es, true));
    const int64_t shape[2] = {A, blk};
    const cpar_tensor in = cpar_tensor_make(send, dt, 2, shape, ctx->device);
    cpar_tensor out = cpar_tensor_make(R->b > 1 ? recv : x, dt, 2, shape, ctx->device);
    CPAR_TRY(cpar__as(ctx, R->fn, cpar_all_to_all_single(R->ga, &in, &out, NULL, NULL)));
    if (R->b > 1) /* [A][b][grp] -> [b][A][grp] */
        for (int j = 0; j < A; j++)
            CPAR_TRY(cpar__copy_2d(ctx, R->fn, (char *)x + (size_t)j * grp, (size_t)A * grp, ctx->device,
                                   (const char *)recv + (size_t)j * (size_t)blk * es, grp, ctx->device, grp,
                                   (size_t)R->b));
    return CPAR_OK;
}

/* The ring of the forward, after the checks and with the workspace bound:
 * acc (F32 [b,hq,sq,d]) and lse receive the merged result. */
static cpar_status cpar__ring_forward_steps(cpar__ring *R, float *acc, float *lse, float *bo, float *bl,
                                            void *scratch) {
    const int64_t d = R->io.d;
    for (int i = 0; i < R->P; i++) {
        const void *kp, *vp;
        CPAR_TRY(cpar__ring_next(R, i, &kp, &vp));
        const cpar__ring_kind kind = cpar__ring_step_kind(R->cfg, R->r, i);
        if (kind == CPAR__RING_SKIP) continue;
        int64_t q0;
        const cpar__attn_io io = cpar__ring_block_io(R, kind, (R->r - i + R->P) % R->P, kp, vp, &q0);
        /* step 0 (always computed) writes the accumulators themselves */
        float *o = i == 0 ? acc : bo, *l = i == 0 ? lse : bl;
        CPAR_TRY(cpar__attn_fwd(R->ctx, R->fn, R->dev, &io, o + q0 * d, CPAR_F32, R->io.q_bh, l + q0, R->io.sq,
                                scratch));
        if (i > 0) CPAR_TRY(cpar__ring_merge(R, acc + q0 * d, lse + q0, bo + q0 * d, bl + q0, io.sq));
    }
    return CPAR_OK;
}

cpar_status cpar_ring_attention_forward(cpar_group *cp, const cpar_ring_attention_config *cfg,
                                        const cpar_tensor *q, const cpar_tensor *k, const cpar_tensor *v,
                                        cpar_tensor *out, cpar_tensor *lse) {
    static const char fn[] = "cpar_ring_attention_forward";
    cpar__ring R;
    CPAR_TRY(cpar__ring_check(&R, fn, cp, cfg, q, k, v));
    CPAR_TRY(cpar__ring_check_like(&R, "out", out, q->shape, 4, q->dtype, "as q"));
    CPAR_TRY(cpar__ring_check_like(&R, "lse", lse, q->shape, 3, CPAR_F32, "[b, hq, s_local] of q"));
    const cpar_tensor *all[5] = {out, lse, q, k, v};
    static const char *const names[5] = {"out", "lse", "q", "k", "v"};
    CPAR_TRY(cpar__ring_check_overlap(&R, all, names, 5, 2));

    cpar_ctx *ctx = R.ctx;
    const int64_t rows = R.io.b * R.io.hq * R.io.sq, nq = rows * R.io.d;
    if (rows == 0) return CPAR_OK; /* the same on every rank: shards are equal */
    if (R.io.sk == 0 || R.io.hkv * R.io.b == 0) { /* no key anywhere: every row is empty */
        if (R.dev) {
            CPAR_DEV_TRY(ctx, fn, cpar_dev_fill(out->data, out->dtype, nq, 0.0, ctx->compute));
            CPAR_DEV_TRY(ctx, fn, cpar_dev_fill(lse->data, CPAR_F32, rows, -INFINITY, ctx->compute));
        } else {
            cpar__host_fill(out->data, out->dtype, nq, 0.0);
            cpar__host_fill(lse->data, CPAR_F32, rows, -INFINITY);
        }
        return CPAR_OK;
    }
    /* workspace: all-to-all (A > 1: q, k, v, out and lse in the head layout,
     * send and receive buffers) | rotation | fp32 output accumulator (the
     * output itself when F32) | one block's fp32 out and lse | the block
     * function's scratch */
    const bool a2a = R.A > 1, f32 = out->dtype == CPAR_F32, merge = R.P > 1;
    const size_t qb = cpar_tensor_nbytes(q), kb = cpar_tensor_nbytes(k);
    const size_t xb = cpar__max_size(cpar__max_size(qb, kb), (size_t)rows * sizeof(float)); /* lse's too */
    const int s_q = cpar__ring_slot(&R, a2a ? qb : 0), s_k = cpar__ring_slot(&R, a2a ? kb : 0);
    const int s_v = cpar__ring_slot(&R, a2a ? kb : 0), s_o = cpar__ring_slot(&R, a2a ? cpar_tensor_nbytes(out) : 0);
    const int s_l = cpar__ring_slot(&R, a2a ? (size_t)rows * sizeof(float) : 0);
    const int s_send = cpar__ring_slot(&R, a2a ? xb : 0), s_recv = cpar__ring_slot(&R, a2a ? xb : 0);
    int ra, rb;
    cpar__ring_rot_slots(&R, &ra, &rb);
    const int s_acc = cpar__ring_slot(&R, f32 ? 0 : (size_t)nq * sizeof(float));
    const int s_bo = cpar__ring_slot(&R, merge ? (size_t)nq * sizeof(float) : 0);
    const int s_bl = cpar__ring_slot(&R, merge ? (size_t)rows * sizeof(float) : 0);
    const int s_scr = cpar__ring_slot(&R, cpar__attn_scratch_bytes(&R.io, false));
    const int s_pk = cpar__ring_slot(&R, cpar__attn_packed_bytes(&R.io, R.dev));
    CPAR_TRY(cpar__ring_carve(&R));
    cpar__ring_rot_bind(&R, ra, rb);
    void *o = a2a ? R.ptr[s_o] : out->data; /* the ring's out and lse */
    float *l = a2a ? R.ptr[s_l] : lse->data, *acc = f32 ? o : R.ptr[s_acc];
    void *send = R.ptr[s_send], *recv = R.ptr[s_recv];

    cpar_status st = CPAR_OK;
    if (a2a) {
        const int64_t d = R.io.d;
        st = cpar__a2a_to_heads(&R, q->data, q->dtype, R.hq, R.sq, d, R.ptr[s_q], send, recv);
        if (st == CPAR_OK) st = cpar__a2a_to_heads(&R, k->data, k->dtype, R.hkv, R.sk, d, R.ptr[s_k], send, recv);
        if (st == CPAR_OK) st = cpar__a2a_to_heads(&R, v->data, v->dtype, R.hkv, R.sk, d, R.ptr[s_v], send, recv);
        R.io.q = R.ptr[s_q], R.io.k = R.ptr[s_k], R.io.v = R.ptr[s_v];
    }
    if (st == CPAR_OK && R.ptr[s_pk]) st = cpar__attn_packed_upload(ctx, fn, &R.io, R.ptr[s_pk]);
    if (st == CPAR_OK) st = cpar__ring_events(&R);
    if (st == CPAR_OK) st = cpar__ring_start(&R);
    if (st == CPAR_OK) st = cpar__ring_forward_steps(&R, acc, l, R.ptr[s_bo], R.ptr[s_bl], R.ptr[s_scr]);
    if (st == CPAR_OK && !f32) st = cpar__ring_cast(&R, o, out->dtype, acc, nq);
    st = cpar__ring_finish(&R, st);
    if (st == CPAR_OK && a2a) st = cpar__a2a_to_seq(&R, o, out->dtype, R.hq, R.sq, R.io.d, out->data, send, recv);
    if (st == CPAR_OK && a2a) st = cpar__a2a_to_seq(&R, l, CPAR_F32, R.hq, R.sq, 1, lse->data, send, recv);
    return st;
}

/* The ring of the backward: gq (F32 like q) accumulates dq; the dK/dV
 * accumulator of each KV block ([dk | dv] F32) travels with it: step i adds
 * this rank's share of block (r - i) into the accumulator received from rank
 * r - 1 and passes it on, so after P shifts each rank holds its own block's.
 * Returns that final accumulator in *fin. */
static cpar_status cpar__ring_backward_steps(cpar__ring *R, const void *out, const void *dout, cpar_dtype out_dt,
                                             const float *lse, float *gq, float *acc[2], float *tmp, void *scratch,
                                             float **fin) {
    const int64_t d = R->io.d, nkv = R->nkv;
    const size_t acc_bytes = (size_t)(2 * nkv) * sizeof(float);
    const size_t oes = cpar_dtype_size(out_dt);
    for (int i = 0; i < R->P; i++) {
        const void *kp, *vp;
        CPAR_TRY(cpar__ring_next(R, i, &kp, &vp));
        const cpar__ring_kind kind = cpar__ring_step_kind(R->cfg, R->r, i);
        float *a = acc[i % 2];
        if (kind != CPAR__RING_SKIP) {
            /* step 0 accumulates into the (zeroed) travelling buffer itself;
             * later steps into tmp, added once the accumulator has arrived,
             * so its transfer overlaps this block */
            float *g = i == 0 ? a : tmp;
            if (i > 0) CPAR_TRY(cpar__ring_zero(R, tmp, acc_bytes));
            int64_t q0;
            const cpar__attn_io io = cpar__ring_block_io(R, kind, (R->r - i + R->P) % R->P, kp, vp, &q0);
            const size_t qoff = (size_t)(q0 * d);
            CPAR_TRY(cpar__attn_bwd(R->ctx, R->fn, R->dev, &io, (const char *)out + qoff * oes,
                                    (const char *)dout + qoff * oes, out_dt, R->io.q_bh, lse + q0, R->io.sq,
                                    gq + qoff, R->io.q_bh, g, g + nkv, R->io.kv_bh, scratch));
        }
        if (R->P == 1) break;
        if (i > 0) {
            CPAR_TRY(cpar__ring_wait(R, R->ev_dkv)); /* a arrived during this step */
            if (kind != CPAR__RING_SKIP) {
                if (R->dev)
                    CPAR_DEV_TRY(R->ctx, R->fn,
                                 cpar_dev_reduce_into(a, tmp, CPAR_F32, 2 * nkv, CPAR_SUM, R->ctx->compute));
                else
                    cpar__host_reduce_into(a, tmp, CPAR_F32, 2 * nkv, CPAR_SUM);
            }
        }
        const int64_t shape[1] = {2 * nkv};
        cpar_tensor send = cpar_tensor_make(a, CPAR_F32, 1, shape, R->ctx->device);
        cpar_tensor recv = cpar_tensor_make(acc[(i + 1) % 2], CPAR_F32, 1, shape, R->ctx->device);
        CPAR_TRY(cpar__ring_fork(R));
        cpar_status st = cpar__as(R->ctx, R->fn, cpar_ring_shift(R->g, &send, &recv, 1));
        cpar_status us = cpar__ring_unfork(R, R->ev_dkv);
        if (st != CPAR_OK) return st;
        CPAR_TRY(us);
    }
    if (R->P > 1) CPAR_TRY(cpar__ring_wait(R, R->ev_dkv));
    *fin = acc[R->P == 1 ? 0 : R->P % 2];
    return CPAR_OK;
}

cpar_status cpar_ring_attention_backward(cpar_group *cp, const cpar_ring_attention_config *cfg,
                                         const cpar_tensor *q, const cpar_tensor *k, const cpar_tensor *v,
                                         const cpar_tensor *out, const cpar_tensor *dout, const cpar_tensor *lse,
                                         cpar_tensor *dq, cpar_tensor *dk, cpar_tensor *dv) {
    static const char fn[] = "cpar_ring_attention_backward";
    cpar__ring R;
    CPAR_TRY(cpar__ring_check(&R, fn, cp, cfg, q, k, v));
    CPAR_TRY(cpar__ring_check_like(&R, "out", out, q->shape, 4, q->dtype, "as q, from forward"));
    CPAR_TRY(cpar__ring_check_like(&R, "dout", dout, q->shape, 4, q->dtype, "as q"));
    CPAR_TRY(cpar__ring_check_like(&R, "lse", lse, q->shape, 3, CPAR_F32, "[b, hq, s_local] of q, from forward"));
    CPAR_TRY(cpar__ring_check_like(&R, "dq", dq, q->shape, 4, q->dtype, "as q"));
    CPAR_TRY(cpar__ring_check_like(&R, "dk", dk, k->shape, 4, q->dtype, "as k"));
    CPAR_TRY(cpar__ring_check_like(&R, "dv", dv, k->shape, 4, q->dtype, "as v"));
    const cpar_tensor *all[9] = {dq, dk, dv, q, k, v, out, dout, lse};
    static const char *const names[9] = {"dq", "dk", "dv", "q", "k", "v", "out", "dout", "lse"};
    CPAR_TRY(cpar__ring_check_overlap(&R, all, names, 9, 3));

    const int64_t nq = cpar_tensor_numel(q), nkv = R.nkv;
    const bool f32 = dq->dtype == CPAR_F32;
    if (nkv == 0) /* no key anywhere (the same on every rank): dq = 0, all-zero bytes in every float dtype */
        return cpar__ring_zero(&R, dq->data, cpar_tensor_nbytes(dq));
    /* workspace: all-to-all (A > 1: q, k, v, out, dout, lse in the head
     * layout, send and receive buffers, dq, dk, dv in the head layout unless
     * F32, when the accumulators are sent) | rotation | dq accumulator (dq
     * itself when F32 and A = 1) | two travelling [dk | dv] accumulators and
     * one block's (one accumulator when P = 1) | the block function's scratch */
    const bool a2a = R.A > 1, ring = R.P > 1;
    const int64_t rows = nq / R.io.d;
    const size_t qb = cpar_tensor_nbytes(q), kb = cpar_tensor_nbytes(k);
    const size_t xb = cpar__max_size(cpar__max_size(qb, kb), (size_t)rows * sizeof(float)); /* lse's too */
    const int s_q = cpar__ring_slot(&R, a2a ? qb : 0), s_k = cpar__ring_slot(&R, a2a ? kb : 0);
    const int s_v = cpar__ring_slot(&R, a2a ? kb : 0), s_o = cpar__ring_slot(&R, a2a ? qb : 0);
    const int s_do = cpar__ring_slot(&R, a2a ? qb : 0);
    const int s_l = cpar__ring_slot(&R, a2a ? (size_t)rows * sizeof(float) : 0);
    const int s_send = cpar__ring_slot(&R, a2a ? xb : 0), s_recv = cpar__ring_slot(&R, a2a ? xb : 0);
    const int s_dq = cpar__ring_slot(&R, a2a && !f32 ? qb : 0), s_dk = cpar__ring_slot(&R, a2a && !f32 ? kb : 0);
    const int s_dv = cpar__ring_slot(&R, a2a && !f32 ? kb : 0);
    int ra, rb;
    cpar__ring_rot_slots(&R, &ra, &rb);
    const size_t acc_bytes = (size_t)(2 * nkv) * sizeof(float);
    const int s_gq = cpar__ring_slot(&R, f32 && !a2a ? 0 : (size_t)nq * sizeof(float));
    const int s_a0 = cpar__ring_slot(&R, acc_bytes);
    const int s_a1 = cpar__ring_slot(&R, ring ? acc_bytes : 0);
    const int s_tmp = cpar__ring_slot(&R, ring ? acc_bytes : 0);
    const int s_scr = cpar__ring_slot(&R, cpar__attn_scratch_bytes(&R.io, true));
    const int s_pk = cpar__ring_slot(&R, cpar__attn_packed_bytes(&R.io, R.dev));
    CPAR_TRY(cpar__ring_carve(&R));
    cpar__ring_rot_bind(&R, ra, rb);
    float *gq = f32 && !a2a ? dq->data : R.ptr[s_gq], *acc[2] = {R.ptr[s_a0], R.ptr[s_a1]}, *fin = NULL;
    const void *o = out->data, *dO = dout->data;
    const float *l = lse->data;
    void *send = R.ptr[s_send], *recv = R.ptr[s_recv];

    cpar_status st = CPAR_OK;
    if (a2a) {
        const int64_t d = R.io.d;
        st = cpar__a2a_to_heads(&R, q->data, q->dtype, R.hq, R.sq, d, R.ptr[s_q], send, recv);
        if (st == CPAR_OK) st = cpar__a2a_to_heads(&R, k->data, k->dtype, R.hkv, R.sk, d, R.ptr[s_k], send, recv);
        if (st == CPAR_OK) st = cpar__a2a_to_heads(&R, v->data, v->dtype, R.hkv, R.sk, d, R.ptr[s_v], send, recv);
        if (st == CPAR_OK) st = cpar__a2a_to_heads(&R, o, out->dtype, R.hq, R.sq, d, R.ptr[s_o], send, recv);
        if (st == CPAR_OK) st = cpar__a2a_to_heads(&R, dO, dout->dtype, R.hq, R.sq, d, R.ptr[s_do], send, recv);
        if (st == CPAR_OK) st = cpar__a2a_to_heads(&R, l, CPAR_F32, R.hq, R.sq, 1, R.ptr[s_l], send, recv);
        R.io.q = R.ptr[s_q], R.io.k = R.ptr[s_k], R.io.v = R.ptr[s_v];
        o = R.ptr[s_o], dO = R.ptr[s_do], l = R.ptr[s_l];
    }
    if (st == CPAR_OK && R.ptr[s_pk]) st = cpar__attn_packed_upload(R.ctx, fn, &R.io, R.ptr[s_pk]);
    if (st == CPAR_OK) st = cpar__ring_events(&R);
    if (st == CPAR_OK) st = cpar__ring_zero(&R, gq, (size_t)nq * sizeof(float));
    if (st == CPAR_OK) st = cpar__ring_zero(&R, acc[0], acc_bytes);
    if (st == CPAR_OK) st = cpar__ring_start(&R);
    if (st == CPAR_OK)
        st = cpar__ring_backward_steps(&R, o, dO, out->dtype, l, gq, acc, R.ptr[s_tmp], R.ptr[s_scr], &fin);
    /* the gradients in dq, dk, dv's dtype: the outputs, or (A > 1) what the all-to-alls send back */
    void *gd[3] = {dq->data, dk->data, dv->data};
    if (st == CPAR_OK && a2a) {
        if (f32) gd[0] = gq, gd[1] = fin, gd[2] = fin + nkv;
        else gd[0] = R.ptr[s_dq], gd[1] = R.ptr[s_dk], gd[2] = R.ptr[s_dv];
    }
    if (st == CPAR_OK) st = cpar__ring_cast(&R, gd[0], dq->dtype, gq, nq);
    if (st == CPAR_OK) st = cpar__ring_cast(&R, gd[1], dk->dtype, fin, nkv);
    if (st == CPAR_OK) st = cpar__ring_cast(&R, gd[2], dv->dtype, fin + nkv, nkv);
    st = cpar__ring_finish(&R, st);
    if (st == CPAR_OK && a2a) {
        const int64_t d = R.io.d;
        st = cpar__a2a_to_seq(&R, gd[0], dq->dtype, R.hq, R.sq, d, dq->data, send, recv);
        if (st == CPAR_OK) st = cpar__a2a_to_seq(&R, gd[1], dk->dtype, R.hkv, R.sk, d, dk->data, send, recv);
        if (st == CPAR_OK) st = cpar__a2a_to_seq(&R, gd[2], dv->dtype, R.hkv, R.sk, d, dv->data, send, recv);
    }
    return st;
}

/* ==== 20. Mamba context parallelism =======================================
 *
 * Owns cpar.h §13: Megatron's MambaContextParallel (seed 000). The module
 * functions cp2hp / hp2cp reuse section 14's sp2hp machinery (they are the
 * same all-to-all on a 3-D view); undo / redo of the load balancing are 2P
 * chunk copies. pre_conv_ssm packs z, x, B, C (group-repeated) and dt for
 * every destination into one workspace buffer (pitched 2-D copies on device
 * tensors; row by row on host ones, one ordered pass over in), runs a
 * single equal all-to-all (the seed runs five; the bytes are the same), then
 * undoes the load balancing into out; its backward runs the same steps in
 * reverse and sums the B/C replica gradients (cpar_dev_mamba_sum_replicas).
 * post_conv_ssm is redo + all-to-all + unstack. The _packed twins undo and
 * redo per document of a cpar_packed_seqs (section 19's validator and row
 * mover: the layout attention's packed shards have), the rest unchanged.
 * Parameter slices are at most
 * three contiguous row ranges of the cp = 1 tensors, copied or accumulated
 * with section 4/5 machinery. The conv1d reads the cp = 1 weight and bias
 * through the row mapping (host loops below, cpar_dev_mamba_conv1d_* on
 * device tensors). Scratch comes from the context workspace, carved once per
 * call. Uses: 2 (errors, checks), 3, 4 (copies, workspace), 5 (element
 * load/store, reduce_into), 10-11 (groups, all-to-all), 14 (mapping helpers). */

struct cpar_mamba_cp {
    cpar_group *cp;
    cpar_ctx *ctx;
    cpar_mamba_cp_info info;
};

/* ---- load balancing ----------------------------------------------------------
 * Chunk k of out (of 2P chunks of chunk_bytes) is chunk order(k) of in:
 * undo order = [0, 2, ..., 2P-2, 2P-1, ..., 3, 1]; redo order = [0, 2P-1, 1,
 * 2P-2, ...] (its inverse). */
static int64_t cpar__mcp_lb_src(int p, int64_t k, bool undo) {
    int64_t n = 2 * (int64_t)p;
    if (undo) return k < p ? 2 * k : 2 * (n - 1 - k) + 1;
    return k % 2 == 0 ? k / 2 : n - 1 - k / 2;
}

static cpar_status cpar__mcp_lb(cpar_ctx *ctx, const char *fn, void *dst, int dst_dev, const void *src, int src_dev,
                                size_t chunk_bytes, int p, bool undo) {
    for (int64_t k = 0; k < 2 * (int64_t)p; k++)
        CPAR_TRY(cpar__copy_bytes(ctx, fn, cpar__ptr_at(dst, (size_t)k * chunk_bytes), dst_dev,
                                  cpar__ptr_at(src, (size_t)cpar__mcp_lb_src(p, k, undo) * chunk_bytes), src_dev,
                                  chunk_bytes));
    return CPAR_OK;
}

static cpar_status cpar__mcp_lb_public(cpar_ctx *ctx, const char *fn, int cp_size, const cpar_tensor *in,
                                       cpar_tensor *out, bool undo) {
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "in", in));
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "out", out));
    if (cp_size < 1) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cp_size is %d, expected >= 1", fn, cp_size);
    if (in->ndim < 1)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in is a scalar, expected at least 1 dimension (dim 0 is the "
                          "sequence)", fn);
    CPAR_TRY(cpar__check_dtype(ctx, fn, "out", out, in->dtype));
    CPAR_TRY(cpar__check_shape(ctx, fn, "out", out, in->shape, in->ndim, "as in"));
    if (out->device != in->device)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out is on device %d, expected device %d (as in)", fn, out->device,
                          in->device);
    int64_t chunks = 2 * (int64_t)cp_size; /* int64: cp_size may be INT_MAX */
    if (in->shape[0] % chunks)
        return cpar__fail(ctx, CPAR_ERR_INVALID,
                          "%s: in has %lld rows (dim 0, the sequence), not divisible by 2*cp_size = %lld", fn,
                          (long long)in->shape[0], (long long)chunks);
    if (cpar__ranges_overlap(in->data, cpar_tensor_nbytes(in), out->data, cpar_tensor_nbytes(out)))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out overlaps in", fn);
    size_t chunk = cpar_tensor_nbytes(in) / (size_t)chunks;
    if (!chunk) return CPAR_OK; /* empty: no 2*cp_size copies of nothing */
    return cpar__mcp_lb(ctx, fn, out->data, out->device, in->data, in->device, chunk, cp_size, undo);
}

cpar_status cpar_undo_attention_load_balancing(cpar_ctx *ctx, int cp_size, const cpar_tensor *in, cpar_tensor *out) {
    return cpar__mcp_lb_public(ctx, "cpar_undo_attention_load_balancing", cp_size, in, out, true);
}

cpar_status cpar_redo_attention_load_balancing(cpar_ctx *ctx, int cp_size, const cpar_tensor *in, cpar_tensor *out) {
    return cpar__mcp_lb_public(ctx, "cpar_redo_attention_load_balancing", cp_size, in, out, false);
}

/* Between the natural order (nat: [s, b, w] on the context's device) and the
 * P rank blocks of an all-to-all buffer (blocks: block j = rank j's
 * load-balanced shard, sl = s/P rows of [b, w]): undo (blocks -> nat) or redo
 * (nat -> blocks). pk NULL: the seed's 2P chunk copies of the whole
 * sequence; else every document's chunks r and 2P-1-r (section 19's packed
 * layout: undo is unshard's placement of each rank's block, redo shard's;
 * one kernel on a device). */
static cpar_status cpar__mcp_order(cpar_ctx *ctx, const char *fn, const cpar__packing *pk, void *nat, void *blocks,
                                   int64_t sl, int64_t b, int64_t w, size_t es, int p, bool undo) {
    int dev = ctx->device;
    if (!pk) {
        size_t chunk = (size_t)(sl / 2 * b * w) * es; /* one of the 2P sequence chunks */
        return undo ? cpar__mcp_lb(ctx, fn, nat, dev, blocks, dev, chunk, p, true)
                    : cpar__mcp_lb(ctx, fn, blocks, dev, nat, dev, chunk, p, false);
    }
    return cpar__cp_packed_copy(ctx, fn, pk, nat, dev, blocks, dev, (size_t)(sl * b * w) * es, 0, p, 1, b * w, es, p,
                                !undo);
}

/* ---- cp2hp / hp2cp -------------------------------------------------------------- */

/* to_hp: in [sl, b, h] -> out [P sl, b, h/P]; else in [s, b, h] -> out [s/P, b, P h]. */
static cpar_status cpar__mcp_a2a(cpar_group *g, const char *fn, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir,
                                 bool to_hp) {
    CPAR_TRY(cpar__map_begin(g, fn, in, out, dir));
    cpar_ctx *ctx = g->ctx;
    int n = g->size;
    char got[128];
    if (in->ndim != 3)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in has shape %s, expected 3 dimensions [s, b, h]", fn,
                          cpar__shape_str(in, got, sizeof got));
    int64_t want[3] = {in->shape[0], in->shape[1], in->shape[2]};
    char why[96];
    if (to_hp) {
        if (in->shape[2] % n)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in has hidden size %lld (dim 2), not divisible by the group "
                              "size %d", fn, (long long)in->shape[2], n);
        want[0] *= n;
        want[2] /= n;
        snprintf(why, sizeof why, "[s, b, h/cp] with cp = %d", n);
    } else {
        if (in->shape[0] % n)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in has sequence length %lld (dim 0), not divisible by the "
                              "group size %d", fn, (long long)in->shape[0], n);
        want[0] /= n;
        want[2] *= n;
        snprintf(why, sizeof why, "[s/cp, b, h*cp] with cp = %d", n);
    }
    CPAR_TRY(cpar__check_shape(ctx, fn, "out", out, want, 3, why));
    if (in->shape[2] == 0) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in has hidden size 0, expected >= 1", fn);
    return cpar__a2a_sp_hp(g, fn, in, out, to_hp);
}

cpar_status cpar_all_to_all_cp2hp(cpar_group *cp, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir) {
    return cpar__mcp_a2a(cp, "cpar_all_to_all_cp2hp", in, out, dir, dir == CPAR_FWD);
}

cpar_status cpar_all_to_all_hp2cp(cpar_group *cp, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir) {
    return cpar__mcp_a2a(cp, "cpar_all_to_all_hp2cp", in, out, dir, dir == CPAR_BWD);
}

/* ---- the object -------------------------------------------------------------------- */

cpar_status cpar_mamba_cp_create(cpar_group *cp, const cpar_mamba_cp_config *cfg, cpar_mamba_cp **out) {
    static const char fn[] = "cpar_mamba_cp_create";
    CPAR_TRY(cpar__check_group(cp, fn));
    cpar_ctx *ctx = cp->ctx;
    if (!out) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    *out = NULL;
    if (!cfg) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg is NULL", fn);
    const struct { const char *name; int64_t v; } sizes[] = {
        {"d_inner_local_tp", cfg->d_inner_local_tp}, {"nheads_local_tp", cfg->nheads_local_tp},
        {"ngroups_local_tp", cfg->ngroups_local_tp}, {"d_state", cfg->d_state}};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (sizes[i].v < 1)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg->%s is %lld, expected >= 1", fn, sizes[i].name,
                              (long long)sizes[i].v);
    int k = cfg->d_conv ? cfg->d_conv : 4;
    if (k < 2 || k > 4)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg->d_conv is %d, expected 2..4 (0 -> 4)", fn, cfg->d_conv);
    int64_t di = cfg->d_inner_local_tp, nh = cfg->nheads_local_tp, ng = cfg->ngroups_local_tp, ds = cfg->d_state;
    int p = cp->size;
    /* The seed's checks, in its order (none at cp_size 1), then the one rule
     * cpar adds: d_inner divisible by cp_size, which the seed gets from
     * d_inner = nheads * headdim and cpar's all-to-all needs explicitly. */
    int64_t rep = 1, ngc = ng;
    if (p > 1) {
        if (nh % p)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: nheads_local_tp %lld is not divisible by cp_size %d (nheads "
                              "must be evenly divisible by tp_size * cp_size)", fn, (long long)nh, p);
        if (ng < p) {
            if (p % ng)
                return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cp_size %d is not divisible by ngroups_local_tp %lld "
                                  "(cp_size must be evenly divisible by ngroups/tp_size)", fn, p, (long long)ng);
            rep = p / ng;
            ngc = 1;
        } else {
            if (ng % p)
                return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: ngroups_local_tp %lld is not divisible by cp_size %d "
                                  "(ngroups must be evenly divisible by tp_size * cp_size)", fn, (long long)ng, p);
            ngc = ng / p;
        }
        if (di % p)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: d_inner_local_tp %lld is not divisible by cp_size %d (x and z "
                              "are split over cp by channels)", fn, (long long)di, p);
    }
    cpar_mamba_cp *m = calloc(1, sizeof *m);
    if (!m) return cpar__fail(ctx, CPAR_ERR_OOM, "%s: allocation of %zu bytes failed", fn, sizeof *m);
    m->cp = cp;
    m->ctx = ctx;
    cpar_mamba_cp_info *in = &m->info;
    in->cp_size = p;
    in->cp_rank = cp->rank;
    in->d_inner_local_tp = di, in->nheads_local_tp = nh, in->ngroups_local_tp = ng, in->d_state = ds;
    in->d_conv = k;
    in->D_has_hdim = cfg->D_has_hdim;
    in->d_inner_local_tpcp = di / p;
    in->nheads_local_tpcp = nh / p;
    in->ngroups_local_tpcp = ngc;
    in->group_repeat_count = rep;
    in->conv1d_channels = di / p + 2 * ngc * ds;
    in->conv_dim = di + 2 * ng * ds;
    in->in_width = 2 * di + 2 * ng * ds + nh;
    in->out_width = 2 * (di / p) + 2 * ngc * ds + nh / p;
    in->vector_len = nh / p;
    in->D_len = cfg->D_has_hdim ? di / p : nh / p;
    *out = m;
    return CPAR_OK;
}

cpar_status cpar_mamba_cp_destroy(cpar_mamba_cp *m) {
    free(m);
    return CPAR_OK;
}

static cpar_status cpar__mcp_check(const cpar_mamba_cp *m, const char *fn) {
    if (!m) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: m is NULL", fn);
    return CPAR_OK;
}

cpar_status cpar_mamba_cp_get_info(const cpar_mamba_cp *m, cpar_mamba_cp_info *out) {
    static const char fn[] = "cpar_mamba_cp_get_info";
    CPAR_TRY(cpar__mcp_check(m, fn));
    if (!out) return cpar__fail(m->ctx, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    *out = m->info;
    return CPAR_OK;
}

int64_t cpar_mamba_cp_conv1d_channels(const cpar_mamba_cp *m) { return m ? m->info.conv1d_channels : 0; }

/* ---- pre_conv_ssm / post_conv_ssm ---------------------------------------------- */

/* The five pieces of the in-projection output (z, x, B, C, dt): where piece p
 * starts in in's row, its width per destination rank, and where it starts in
 * out's row. Destination j's columns of piece p begin at in column
 * cpar__mcp_src_col(m, p, j). */
enum { CPAR__MCP_PIECES = 5 };

static void cpar__mcp_pieces(const cpar_mamba_cp_info *in, int64_t start[5], int64_t width[5], int64_t off[5]) {
    int64_t di = in->d_inner_local_tp, gs = in->ngroups_local_tp * in->d_state;
    int64_t w[5] = {in->d_inner_local_tpcp, in->d_inner_local_tpcp, in->ngroups_local_tpcp * in->d_state,
                    in->ngroups_local_tpcp * in->d_state, in->nheads_local_tpcp};
    int64_t s[5] = {0, di, 2 * di, 2 * di + gs, 2 * di + 2 * gs};
    int64_t o = 0;
    for (int p = 0; p < 5; p++) {
        start[p] = s[p];
        width[p] = w[p];
        off[p] = o;
        o += w[p];
    }
}

/* B and C (pieces 2, 3): destination j gets the groups [g0, g0 + ng_tpcp),
 * g0 = (j / R) ng_tpcp: the seed's repeat "(g n) -> (g r n)" then chunk j. */
static int64_t cpar__mcp_src_col(const cpar_mamba_cp_info *in, const int64_t start[5], const int64_t width[5], int p,
                                 int j) {
    if (p == 2 || p == 3) return start[p] + (j / in->group_repeat_count) * in->ngroups_local_tpcp * in->d_state;
    return start[p] + (int64_t)j * width[p];
}

/* Host reference of cpar_dev_mamba_sum_replicas. */
static void cpar__mcp_host_sum_replicas(void *dst, int64_t dst_gs, int64_t dst_pitch, const void *src, int64_t src_gs,
                                        int64_t rep_stride, int64_t src_pitch, int64_t groups, int64_t reps,
                                        int64_t rows, int64_t cols, cpar_dtype dt) {
    for (int64_t g = 0; g < groups; g++)
        for (int64_t t = 0; t < rows; t++)
            for (int64_t c = 0; c < cols; c++) {
                float acc = 0.f;
                for (int64_t q = 0; q < reps; q++)
                    acc += cpar__load_f(src, dt, g * src_gs + q * rep_stride + t * src_pitch + c);
                cpar__store_f(dst, dt, g * dst_gs + t * dst_pitch + c, acc);
            }
}

/* Host tensors: packed [P, t, w] <-> whole [t, in_width] (pack: whole to
 * packed) row by row, every (destination, piece) slab of a row in turn, so
 * the whole side is walked once in order; one 2-D copy per slab instead
 * would sweep it 5P times with strides (most of the call's time). skip_bc:
 * leave B and C to the replica sum. */
static void cpar__mcp_host_pack(const cpar_mamba_cp_info *mi, const int64_t start[5], const int64_t width[5],
                                const int64_t off[5], char *packed, void *whole, int64_t t, int64_t w, size_t es,
                                bool pack, bool skip_bc) {
    int64_t hin = mi->in_width;
    for (int64_t r = 0; r < t; r++)
        for (int j = 0; j < mi->cp_size; j++)
            for (int q = 0; q < CPAR__MCP_PIECES; q++) {
                if (skip_bc && (q == 2 || q == 3)) continue;
                char *a = packed + (size_t)(((int64_t)j * t + r) * w + off[q]) * es;
                char *b = (char *)whole + (size_t)(r * hin + cpar__mcp_src_col(mi, start, width, q, j)) * es;
                if (pack) memcpy(a, b, (size_t)width[q] * es);
                else memcpy(b, a, (size_t)width[q] * es);
            }
}

/* "in has s/cp = 5 rows ..." when the global sequence does not cut into 2P chunks. */
static cpar_status cpar__mcp_check_seq(cpar_mamba_cp *m, const char *fn, const char *name, int64_t rows, bool local) {
    int p = m->info.cp_size;
    if (p == 1) return CPAR_OK;
    int64_t s = local ? rows * p : rows;
    if (s % (2 * (int64_t)p) == 0) return CPAR_OK;
    if (local)
        return cpar__fail(m->ctx, CPAR_ERR_INVALID, "%s: %s has %lld rows (s/cp), so s = %lld is not divisible by "
                          "2*cp = %d (the load balancing cuts 2*cp chunks)", fn, name, (long long)rows, (long long)s, 2 * p);
    return cpar__fail(m->ctx, CPAR_ERR_INVALID, "%s: %s has %lld rows (s), not divisible by 2*cp = %d (the load "
                      "balancing cuts 2*cp chunks)", fn, name, (long long)s, 2 * p);
}

/* The sequence checks of pre and post: without seqs (*pkp = NULL) s divides
 * into 2P chunks; with seqs, the packing is valid for P and s is its packed
 * length (*pkp = pk). rows: in's rows, s/P when local. */
static cpar_status cpar__mcp_check_packing(cpar_mamba_cp *m, const char *fn, const cpar_packed_seqs *seqs,
                                           cpar__packing *pk, const cpar__packing **pkp, const char *name,
                                           int64_t rows, bool local) {
    *pkp = NULL;
    if (!seqs) return cpar__mcp_check_seq(m, fn, name, rows, local);
    int p = m->info.cp_size;
    CPAR_TRY(cpar__packed_check(m->ctx, fn, seqs, p, pk));
    int64_t s = local ? rows * p : rows;
    if (s != pk->total) {
        if (local)
            return cpar__fail(m->ctx, CPAR_ERR_INVALID, "%s: %s has %lld rows (s/cp), so s = %lld, expected %lld (the "
                              "packed length) with cp = %d", fn, name, (long long)rows, (long long)s,
                              (long long)pk->total, p);
        return cpar__fail(m->ctx, CPAR_ERR_INVALID, "%s: %s has %lld rows (s), expected %lld (the packed length)", fn,
                          name, (long long)s, (long long)pk->total);
    }
    *pkp = pk;
    return CPAR_OK;
}

/* The checks pre and post share: m, dir, in and out 3-D on the context's
 * device with in's dtype, in's last dim in_last (< 0: any >= 1). */
static cpar_status cpar__mcp_io(cpar_mamba_cp *m, const char *fn, const cpar_tensor *in, const cpar_tensor *out,
                                cpar_dir dir, int64_t in_last) {
    CPAR_TRY(cpar__mcp_check(m, fn));
    CPAR_TRY(cpar__map_begin(m->cp, fn, in, out, dir));
    char got[128];
    if (in->ndim != 3 || (in_last >= 0 && in->shape[2] != in_last) || (in_last < 0 && in->shape[2] < 1)) {
        if (in_last >= 0)
            return cpar__fail(m->ctx, CPAR_ERR_INVALID, "%s: in has shape %s, expected [*, *, %lld]", fn,
                              cpar__shape_str(in, got, sizeof got), (long long)in_last);
        return cpar__fail(m->ctx, CPAR_ERR_INVALID, "%s: in has shape %s, expected [s, b, h] with h >= 1", fn,
                          cpar__shape_str(in, got, sizeof got));
    }
    return CPAR_OK;
}

/* pre_conv_ssm, packed (seqs) or not (NULL). */
static cpar_status cpar__mcp_pre(cpar_mamba_cp *m, const char *fn, const cpar_packed_seqs *seqs, const cpar_tensor *in,
                                 cpar_tensor *out, cpar_dir dir) {
    const cpar_mamba_cp_info *mi = m ? &m->info : NULL;
    bool fwd = dir == CPAR_FWD;
    CPAR_TRY(cpar__mcp_io(m, fn, in, out, dir, mi ? (fwd ? mi->in_width : mi->out_width) : 0));
    cpar_ctx *ctx = m->ctx;
    cpar_group *g = m->cp;
    int p = mi->cp_size, dev = ctx->device;
    cpar__packing pk;
    const cpar__packing *pkp;
    CPAR_TRY(cpar__mcp_check_packing(m, fn, seqs, &pk, &pkp, "in", in->shape[0], fwd));
    int64_t b = in->shape[1], sl = fwd ? in->shape[0] : in->shape[0] / p;
    int64_t want[3] = {fwd ? sl * p : sl, b, fwd ? mi->out_width : mi->in_width};
    char why[128];
    snprintf(why, sizeof why, fwd ? "[s, b, 2 d_inner/cp + 2 ngroups_tpcp d_state + nheads/cp] with cp = %d"
                                  : "[s/cp, b, 2 d_inner + 2 ngroups d_state + nheads] with cp = %d", p);
    CPAR_TRY(cpar__check_shape(ctx, fn, "out", out, want, 3, why));
    if (!fwd && mi->group_repeat_count > 1 && !cpar_dtype_is_float(in->dtype))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in has dtype %s; the backward sums the B/C replica gradients, "
                          "expected f32, f16 or bf16", fn, cpar_dtype_name(in->dtype));
    CPAR_TRY(cpar__map_overlap(g, fn, in, out, p == 1));
    if (p == 1) return cpar__copy_bytes(ctx, fn, out->data, dev, in->data, dev, cpar_tensor_nbytes(in));

    /* The packed layout [P, T, W]: block j = what rank j gets from this
     * rank's T = s/P * b tokens (forward); after the all-to-all block i holds
     * rank i's tokens, i.e. the sequence in load-balanced chunk order. */
    size_t es = cpar_dtype_size(in->dtype);
    int64_t t = sl * b, w = mi->out_width, hin = mi->in_width, numel = (int64_t)p * t * w;
    if (!numel) return CPAR_OK;
    size_t half = ((size_t)numel * es + 255) & ~(size_t)255;
    void *ws;
    CPAR_TRY(cpar__map_scratch(ctx, fn, 2 * half, &ws));
    char *send = ws, *recv = (char *)ws + half;
    int64_t start[5], width[5], off[5];
    cpar__mcp_pieces(mi, start, width, off);
    cpar_tensor a = cpar__view2(send, in->dtype, (int64_t)p * t, w, dev);
    cpar_tensor r = cpar__view2(recv, in->dtype, (int64_t)p * t, w, dev);
    if (fwd) {
        if (!cpar__on_device(dev))
            cpar__mcp_host_pack(mi, start, width, off, send, in->data, t, w, es, true, false);
        else
            for (int j = 0; j < p; j++)
                for (int q = 0; q < CPAR__MCP_PIECES; q++)
                    CPAR_TRY(cpar__copy_2d(ctx, fn, send + (size_t)((int64_t)j * t * w + off[q]) * es, (size_t)w * es,
                                           dev, (const char *)in->data + (size_t)cpar__mcp_src_col(mi, start, width, q, j) * es,
                                           (size_t)hin * es, dev, (size_t)width[q] * es, (size_t)t));
        CPAR__MAP_TRY(ctx, fn, cpar_all_to_all_single(g, &a, &r, NULL, NULL));
        return cpar__mcp_order(ctx, fn, pkp, out->data, recv, sl, b, w, es, p, true);
    }
    /* Backward: back to load-balanced order, the reverse all-to-all, unpack. */
    CPAR_TRY(cpar__mcp_order(ctx, fn, pkp, in->data, send, sl, b, w, es, p, false));
    CPAR__MAP_TRY(ctx, fn, cpar_all_to_all_single(g, &a, &r, NULL, NULL));
    int64_t rep = mi->group_repeat_count, tw = t * w;
    if (!cpar__on_device(dev)) cpar__mcp_host_pack(mi, start, width, off, recv, out->data, t, w, es, false, rep > 1);
    for (int q = 0; q < CPAR__MCP_PIECES; q++) {
        if ((q == 2 || q == 3) && rep > 1) { /* ng_tpcp = 1: block j holds a replica of group j / R */
            int64_t ds = mi->d_state, ng = mi->ngroups_local_tp;
            char *dst = (char *)out->data + (size_t)start[q] * es;
            const char *src = recv + (size_t)off[q] * es;
            if (!cpar__on_device(dev))
                cpar__mcp_host_sum_replicas(dst, ds, hin, src, rep * tw, tw, w, ng, rep, t, ds, in->dtype);
            else
                CPAR_DEV_TRY(ctx, fn, cpar_dev_mamba_sum_replicas(dst, ds, hin, src, rep * tw, tw, w, ng, rep, t, ds,
                                                                  in->dtype, ctx->compute));
            continue;
        }
        if (cpar__on_device(dev))
            for (int j = 0; j < p; j++)
                CPAR_TRY(cpar__copy_2d(ctx, fn, (char *)out->data + (size_t)cpar__mcp_src_col(mi, start, width, q, j) * es,
                                       (size_t)hin * es, dev, recv + (size_t)((int64_t)j * tw + off[q]) * es,
                                       (size_t)w * es, dev, (size_t)width[q] * es, (size_t)t));
    }
    return CPAR_OK;
}

/* post_conv_ssm, packed (seqs) or not (NULL). */
static cpar_status cpar__mcp_post(cpar_mamba_cp *m, const char *fn, const cpar_packed_seqs *seqs,
                                  const cpar_tensor *in, cpar_tensor *out, cpar_dir dir) {
    bool fwd = dir == CPAR_FWD;
    CPAR_TRY(cpar__mcp_io(m, fn, in, out, dir, -1));
    cpar_ctx *ctx = m->ctx;
    cpar_group *g = m->cp;
    int p = m->info.cp_size, dev = ctx->device;
    cpar__packing pk;
    const cpar__packing *pkp;
    CPAR_TRY(cpar__mcp_check_packing(m, fn, seqs, &pk, &pkp, "in", in->shape[0], !fwd));
    int64_t b = in->shape[1];
    if (!fwd && in->shape[2] % p)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: in has hidden size %lld (dim 2), not divisible by cp = %d", fn,
                          (long long)in->shape[2], p);
    int64_t sl = fwd ? in->shape[0] / p : in->shape[0], h = fwd ? in->shape[2] : in->shape[2] / p;
    int64_t want[3] = {fwd ? sl : sl * p, b, fwd ? h * p : h};
    char why[96];
    snprintf(why, sizeof why, fwd ? "[s/cp, b, cp*h] with cp = %d" : "[s, b, h/cp] with cp = %d", p);
    CPAR_TRY(cpar__check_shape(ctx, fn, "out", out, want, 3, why));
    CPAR_TRY(cpar__map_overlap(g, fn, in, out, p == 1));
    if (p == 1) return cpar__copy_bytes(ctx, fn, out->data, dev, in->data, dev, cpar_tensor_nbytes(in));

    size_t es = cpar_dtype_size(in->dtype);
    int64_t t = sl * b;
    if (!t) return CPAR_OK;
    size_t bytes = cpar_tensor_nbytes(in), half = (bytes + 255) & ~(size_t)255;
    void *ws;
    CPAR_TRY(cpar__map_scratch(ctx, fn, 2 * half, &ws));
    char *send = ws, *recv = (char *)ws + half;
    cpar_tensor a = cpar__view2(send, in->dtype, (int64_t)p * t, h, dev);
    cpar_tensor r = cpar__view2(recv, in->dtype, (int64_t)p * t, h, dev);
    if (fwd) { /* redo, then hp2cp: block j (rank j's chunks) to rank j, blocks side by side */
        CPAR_TRY(cpar__mcp_order(ctx, fn, pkp, in->data, send, sl, b, h, es, p, false));
        CPAR__MAP_TRY(ctx, fn, cpar_all_to_all_single(g, &a, &r, NULL, NULL));
        return cpar__unstack_last(ctx, fn, out->data, recv, t, h, p, es);
    }
    /* backward: cp2hp (column chunk j to rank j), then undo */
    CPAR_TRY(cpar__stack_last(ctx, fn, send, in->data, t, h, p, es));
    CPAR__MAP_TRY(ctx, fn, cpar_all_to_all_single(g, &a, &r, NULL, NULL));
    return cpar__mcp_order(ctx, fn, pkp, out->data, recv, sl, b, h, es, p, true);
}

cpar_status cpar_mamba_cp_pre_conv_ssm(cpar_mamba_cp *m, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir) {
    return cpar__mcp_pre(m, "cpar_mamba_cp_pre_conv_ssm", NULL, in, out, dir);
}

cpar_status cpar_mamba_cp_post_conv_ssm(cpar_mamba_cp *m, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir) {
    return cpar__mcp_post(m, "cpar_mamba_cp_post_conv_ssm", NULL, in, out, dir);
}

/* The packed twins: seqs is required (the unpacked calls above take none). */
cpar_status cpar_mamba_cp_pre_conv_ssm_packed(cpar_mamba_cp *m, const cpar_packed_seqs *seqs, const cpar_tensor *in,
                                              cpar_tensor *out, cpar_dir dir) {
    static const char fn[] = "cpar_mamba_cp_pre_conv_ssm_packed";
    CPAR_TRY(cpar__mcp_check(m, fn));
    if (!seqs) return cpar__fail(m->ctx, CPAR_ERR_INVALID, "%s: seqs is NULL (the packed sequences)", fn);
    return cpar__mcp_pre(m, fn, seqs, in, out, dir);
}

cpar_status cpar_mamba_cp_post_conv_ssm_packed(cpar_mamba_cp *m, const cpar_packed_seqs *seqs, const cpar_tensor *in,
                                               cpar_tensor *out, cpar_dir dir) {
    static const char fn[] = "cpar_mamba_cp_post_conv_ssm_packed";
    CPAR_TRY(cpar__mcp_check(m, fn));
    if (!seqs) return cpar__fail(m->ctx, CPAR_ERR_INVALID, "%s: seqs is NULL (the packed sequences)", fn);
    return cpar__mcp_post(m, fn, seqs, in, out, dir);
}

/* ---- parameter slices -------------------------------------------------------------- */

/* This rank's conv1d rows as three (local start, count, cp = 1 row) segments. */
static cpar_dev_conv_rows cpar__mcp_conv_rows(const cpar_mamba_cp_info *in) {
    int64_t gsc = in->ngroups_local_tpcp * in->d_state, gs = in->ngroups_local_tp * in->d_state;
    int64_t g0 = (in->cp_rank / in->group_repeat_count) * gsc;
    cpar_dev_conv_rows r = {{in->d_inner_local_tpcp, gsc, gsc},
                            {in->cp_rank * in->d_inner_local_tpcp, in->d_inner_local_tp + g0,
                             in->d_inner_local_tp + gs + g0}};
    return r;
}

/* t is [rows, K] or [rows, 1, K] ("name has shape ..., expected ..."). */
static cpar_status cpar__mcp_check_weight(cpar_ctx *ctx, const char *fn, const char *name, const cpar_tensor *t,
                                          int64_t rows, int k, const char *why) {
    int64_t want2[2] = {rows, k}, want3[3] = {rows, 1, k};
    if (t->ndim == 3) return cpar__check_shape(ctx, fn, name, t, want3, 3, why);
    return cpar__check_shape(ctx, fn, name, t, want2, 2, why);
}

/* Which parameter a slice function handles. */
typedef enum { CPAR__MCP_WEIGHT = 0, CPAR__MCP_BIAS, CPAR__MCP_VEC, CPAR__MCP_D } cpar__mcp_param;

/* Check param (cp = 1 shape) and slice (this rank's shape) and describe the
 * slice as n segments of rows: local row lrow[i], cp = 1 row crow[i], count
 * cnt[i], each row row_elems elements. grad: slice is F32/F16/BF16 and param
 * F32 (accumulate); else same dtype (get). */
static cpar_status cpar__mcp_slice_args(cpar_mamba_cp *m, const char *fn, cpar__mcp_param kind, const char *pname,
                                        const cpar_tensor *param, const char *sname, const cpar_tensor *slice,
                                        bool grad, int *n, int64_t lrow[3], int64_t crow[3], int64_t cnt[3],
                                        int64_t *row_elems) {
    CPAR_TRY(cpar__mcp_check(m, fn));
    cpar_ctx *ctx = m->ctx;
    const cpar_mamba_cp_info *mi = &m->info;
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, pname, param));
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, sname, slice));
    if (grad) {
        CPAR_TRY(cpar__check_float(ctx, fn, sname, slice));
        CPAR_TRY(cpar__check_dtype(ctx, fn, pname, param, CPAR_F32));
    } else {
        CPAR_TRY(cpar__check_dtype(ctx, fn, sname, slice, param->dtype));
    }
    if (slice->device != param->device)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is on device %d, expected device %d (as %s)", fn, sname,
                          slice->device, param->device, pname);
    *row_elems = 1;
    if (kind == CPAR__MCP_WEIGHT || kind == CPAR__MCP_BIAS) {
        if (kind == CPAR__MCP_WEIGHT) {
            CPAR_TRY(cpar__mcp_check_weight(ctx, fn, pname, param, mi->conv_dim, mi->d_conv,
                                            "cp=1 conv1d weight [conv_dim, d_conv]"));
            CPAR_TRY(cpar__mcp_check_weight(ctx, fn, sname, slice, mi->conv1d_channels, mi->d_conv,
                                            "[conv1d_channels, d_conv]"));
            *row_elems = mi->d_conv;
        } else {
            CPAR_TRY(cpar__check_shape(ctx, fn, pname, param, &mi->conv_dim, 1, "cp=1 conv1d bias [conv_dim]"));
            CPAR_TRY(cpar__check_shape(ctx, fn, sname, slice, &mi->conv1d_channels, 1, "[conv1d_channels]"));
        }
        cpar_dev_conv_rows r = cpar__mcp_conv_rows(mi);
        *n = 3;
        for (int i = 0; i < 3; i++) {
            lrow[i] = i ? lrow[i - 1] + cnt[i - 1] : 0;
            crow[i] = r.seg_row[i];
            cnt[i] = r.seg_len[i];
        }
        return CPAR_OK;
    }
    bool hdim = kind == CPAR__MCP_D && mi->D_has_hdim;
    int64_t full = hdim ? mi->d_inner_local_tp : mi->nheads_local_tp;
    int64_t part = hdim ? mi->d_inner_local_tpcp : mi->nheads_local_tpcp;
    CPAR_TRY(cpar__check_shape(ctx, fn, pname, param, &full, 1, hdim ? "cp=1 [d_inner] (D_has_hdim)" : "cp=1 [nheads]"));
    CPAR_TRY(cpar__check_shape(ctx, fn, sname, slice, &part, 1, hdim ? "[d_inner/cp] (D_has_hdim)" : "[nheads/cp]"));
    *n = 1;
    lrow[0] = 0, crow[0] = mi->cp_rank * part, cnt[0] = part;
    return CPAR_OK;
}

static cpar_status cpar__mcp_get(cpar_mamba_cp *m, const char *fn, cpar__mcp_param kind, const cpar_tensor *param,
                                 cpar_tensor *out) {
    int n;
    int64_t lrow[3], crow[3], cnt[3], re;
    CPAR_TRY(cpar__mcp_slice_args(m, fn, kind, "param", param, "out", out, false, &n, lrow, crow, cnt, &re));
    if (cpar__ranges_overlap(param->data, cpar_tensor_nbytes(param), out->data, cpar_tensor_nbytes(out)))
        return cpar__fail(m->ctx, CPAR_ERR_INVALID, "%s: out overlaps param", fn);
    size_t rb = (size_t)re * cpar_dtype_size(param->dtype);
    for (int i = 0; i < n; i++)
        CPAR_TRY(cpar__copy_bytes(m->ctx, fn, (char *)out->data + (size_t)lrow[i] * rb, out->device,
                                  (const char *)param->data + (size_t)crow[i] * rb, param->device, (size_t)cnt[i] * rb));
    return CPAR_OK;
}

static cpar_status cpar__mcp_accumulate(cpar_mamba_cp *m, const char *fn, cpar__mcp_param kind, const cpar_tensor *grad,
                                        cpar_tensor *grad_cp1) {
    int n;
    int64_t lrow[3], crow[3], cnt[3], re;
    CPAR_TRY(cpar__mcp_slice_args(m, fn, kind, "grad_cp1", grad_cp1, "grad", grad, true, &n, lrow, crow, cnt, &re));
    if (cpar__ranges_overlap(grad->data, cpar_tensor_nbytes(grad), grad_cp1->data, cpar_tensor_nbytes(grad_cp1)))
        return cpar__fail(m->ctx, CPAR_ERR_INVALID, "%s: grad overlaps grad_cp1", fn);
    size_t es = cpar_dtype_size(grad->dtype);
    for (int i = 0; i < n; i++) {
        float *acc = (float *)grad_cp1->data + crow[i] * re;
        const void *src = (const char *)grad->data + (size_t)(lrow[i] * re) * es;
        int64_t cnt_el = cnt[i] * re;
        if (!cnt_el) continue;
        if (!cpar__on_device(grad->device)) cpar__host_reduce_into(acc, src, grad->dtype, cnt_el, CPAR_SUM);
        else CPAR_DEV_TRY(m->ctx, fn, cpar_dev_reduce_into(acc, src, grad->dtype, cnt_el, CPAR_SUM, m->ctx->compute));
    }
    return CPAR_OK;
}

cpar_status cpar_mamba_cp_get_conv1d_weight(cpar_mamba_cp *m, const cpar_tensor *param, cpar_tensor *out) {
    return cpar__mcp_get(m, "cpar_mamba_cp_get_conv1d_weight", CPAR__MCP_WEIGHT, param, out);
}
cpar_status cpar_mamba_cp_get_conv1d_bias(cpar_mamba_cp *m, const cpar_tensor *param, cpar_tensor *out) {
    return cpar__mcp_get(m, "cpar_mamba_cp_get_conv1d_bias", CPAR__MCP_BIAS, param, out);
}
cpar_status cpar_mamba_cp_get_dt_bias(cpar_mamba_cp *m, const cpar_tensor *param, cpar_tensor *out) {
    return cpar__mcp_get(m, "cpar_mamba_cp_get_dt_bias", CPAR__MCP_VEC, param, out);
}
cpar_status cpar_mamba_cp_get_A_log(cpar_mamba_cp *m, const cpar_tensor *param, cpar_tensor *out) {
    return cpar__mcp_get(m, "cpar_mamba_cp_get_A_log", CPAR__MCP_VEC, param, out);
}
cpar_status cpar_mamba_cp_get_D(cpar_mamba_cp *m, const cpar_tensor *param, cpar_tensor *out) {
    return cpar__mcp_get(m, "cpar_mamba_cp_get_D", CPAR__MCP_D, param, out);
}

cpar_status cpar_mamba_cp_accumulate_conv1d_weight_grad(cpar_mamba_cp *m, const cpar_tensor *grad,
                                                        cpar_tensor *grad_cp1) {
    return cpar__mcp_accumulate(m, "cpar_mamba_cp_accumulate_conv1d_weight_grad", CPAR__MCP_WEIGHT, grad, grad_cp1);
}
cpar_status cpar_mamba_cp_accumulate_conv1d_bias_grad(cpar_mamba_cp *m, const cpar_tensor *grad,
                                                      cpar_tensor *grad_cp1) {
    return cpar__mcp_accumulate(m, "cpar_mamba_cp_accumulate_conv1d_bias_grad", CPAR__MCP_BIAS, grad, grad_cp1);
}
cpar_status cpar_mamba_cp_accumulate_dt_bias_grad(cpar_mamba_cp *m, const cpar_tensor *grad, cpar_tensor *grad_cp1) {
    return cpar__mcp_accumulate(m, "cpar_mamba_cp_accumulate_dt_bias_grad", CPAR__MCP_VEC, grad, grad_cp1);
}
cpar_status cpar_mamba_cp_accumulate_A_log_grad(cpar_mamba_cp *m, const cpar_tensor *grad, cpar_tensor *grad_cp1) {
    return cpar__mcp_accumulate(m, "cpar_mamba_cp_accumulate_A_log_grad", CPAR__MCP_VEC, grad, grad_cp1);
}
cpar_status cpar_mamba_cp_accumulate_D_grad(cpar_mamba_cp *m, const cpar_tensor *grad, cpar_tensor *grad_cp1) {
    return cpar__mcp_accumulate(m, "cpar_mamba_cp_accumulate_D_grad", CPAR__MCP_D, grad, grad_cp1);
}

cpar_status cpar_mamba_cp_vector_view(const cpar_mamba_cp *m, const cpar_tensor *param, bool has_hdim,
                                      cpar_tensor *view) {
    static const char fn[] = "cpar_mamba_cp_vector_view";
    CPAR_TRY(cpar__mcp_check(m, fn));
    cpar_ctx *ctx = m->ctx;
    if (!view) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: view is NULL", fn);
    CPAR_TRY(cpar__check_tensor(ctx, fn, "param", param, -2));
    const cpar_mamba_cp_info *mi = &m->info;
    int64_t full = has_hdim ? mi->d_inner_local_tp : mi->nheads_local_tp;
    int64_t part = has_hdim ? mi->d_inner_local_tpcp : mi->nheads_local_tpcp;
    CPAR_TRY(cpar__check_shape(ctx, fn, "param", param, &full, 1, has_hdim ? "cp=1 [d_inner] (has_hdim)" : "cp=1 [nheads]"));
    *view = *param;
    view->shape[0] = part;
    view->data = cpar__ptr_at(param->data, (size_t)(mi->cp_rank * part) * cpar_dtype_size(param->dtype));
    return CPAR_OK;
}

/* ---- conv1d -------------------------------------------------------------------------- */

static int64_t cpar__mcp_row_of(const cpar_dev_conv_rows *r, int64_t c) {
    if (c < r->seg_len[0]) return r->seg_row[0] + c;
    c -= r->seg_len[0];
    if (c < r->seg_len[1]) return r->seg_row[1] + c;
    return r->seg_row[2] + c - r->seg_len[1];
}

/* Pre-activation u of token (t, bi), channel c (fp32, the kernel's order). */
static float cpar__mcp_host_u(const void *x, int64_t pitch, cpar_dtype dt, const void *w, const void *bias,
                              cpar_dtype pdt, int64_t row, int64_t t, int64_t bi, int64_t b, int64_t c, int k) {
    float acc = bias ? cpar__load_f(bias, pdt, row) : 0.f;
    for (int j = 0; j < k; j++) {
        int64_t tt = t - (k - 1) + j;
        if (tt >= 0) acc = fmaf(cpar__load_f(w, pdt, row * k + j), cpar__load_f(x, dt, (tt * b + bi) * pitch + c), acc);
    }
    return acc;
}

static float cpar__mcp_sigmoid(float u) { return 1.f / (1.f + expf(-u)); }

/* Host reference of cpar_dev_mamba_conv1d_forward. */
static void cpar__mcp_host_conv_fwd(const void *x, int64_t pitch, cpar_dtype dt, const void *w, const void *bias,
                                    cpar_dtype pdt, const cpar_dev_conv_rows *rows, int64_t s, int64_t b, int64_t ch,
                                    int k, bool silu, void *y) {
    for (int64_t c = 0; c < ch; c++) {
        int64_t row = cpar__mcp_row_of(rows, c);
        for (int64_t t = 0; t < s; t++)
            for (int64_t bi = 0; bi < b; bi++) {
                float u = cpar__mcp_host_u(x, pitch, dt, w, bias, pdt, row, t, bi, b, c, k);
                cpar__store_f(y, dt, (t * b + bi) * ch + c, silu ? u * cpar__mcp_sigmoid(u) : u);
            }
    }
}

/* du = dy * silu'(u) (or dy). */
static float cpar__mcp_host_du(const void *x, int64_t pitch, cpar_dtype dt, const void *w, const void *bias,
                               cpar_dtype pdt, int64_t row, int64_t t, int64_t bi, int64_t b, int64_t c, int k,
                               bool silu, const void *dy, int64_t ch) {
    float g = cpar__load_f(dy, dt, (t * b + bi) * ch + c);
    if (!silu) return g;
    float u = cpar__mcp_host_u(x, pitch, dt, w, bias, pdt, row, t, bi, b, c, k), sg = cpar__mcp_sigmoid(u);
    return g * (sg * (1.f + u * (1.f - sg)));
}

/* Host backward: dx overwritten, dw/dbias += (fp64 sums per channel). */
static void cpar__mcp_host_conv_bwd(const void *x, int64_t pitch, cpar_dtype dt, const void *w, const void *bias,
                                    cpar_dtype pdt, const cpar_dev_conv_rows *rows, int64_t s, int64_t b, int64_t ch,
                                    int k, bool silu, const void *dy, void *dx, float *dw, float *dbias) {
    for (int64_t c = 0; c < ch; c++) {
        int64_t row = cpar__mcp_row_of(rows, c);
        double gw[4] = {0, 0, 0, 0}, gb = 0.0;
        for (int64_t t = 0; t < s; t++)
            for (int64_t bi = 0; bi < b; bi++) {
                float du = cpar__mcp_host_du(x, pitch, dt, w, bias, pdt, row, t, bi, b, c, k, silu, dy, ch);
                gb += du;
                for (int j = 0; j < k; j++) {
                    int64_t tt = t - (k - 1) + j;
                    if (tt >= 0) gw[j] += (double)du * cpar__load_f(x, dt, (tt * b + bi) * pitch + c);
                }
                float acc = 0.f; /* dx[t] = sum_j w[j] du[t + (K-1) - j] */
                for (int j = 0; j < k; j++) {
                    int64_t tt = t + (k - 1) - j;
                    if (tt < s)
                        acc = fmaf(cpar__load_f(w, pdt, row * k + j),
                                   cpar__mcp_host_du(x, pitch, dt, w, bias, pdt, row, tt, bi, b, c, k, silu, dy, ch), acc);
                }
                cpar__store_f(dx, dt, (t * b + bi) * pitch + c, acc);
            }
        for (int j = 0; j < k; j++) dw[row * k + j] += (float)gw[j];
        if (dbias) dbias[row] += (float)gb;
    }
}

/* Checks forward and backward share. */
static cpar_status cpar__mcp_conv_args(cpar_mamba_cp *m, const char *fn, const cpar_tensor *x, int64_t x_col,
                                       const cpar_tensor *weight, const cpar_tensor *bias) {
    CPAR_TRY(cpar__mcp_check(m, fn));
    cpar_ctx *ctx = m->ctx;
    const cpar_mamba_cp_info *mi = &m->info;
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "x", x));
    CPAR_TRY(cpar__check_float(ctx, fn, "x", x));
    char got[128];
    if (x->ndim != 3)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: x has shape %s, expected 3 dimensions [s, b, W]", fn,
                          cpar__shape_str(x, got, sizeof got));
    if (x_col < 0 || x_col + mi->conv1d_channels > x->shape[2])
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: x_col is %lld: channels [%lld, %lld) do not fit x's last dim %lld "
                          "(conv1d_channels = %lld)", fn, (long long)x_col, (long long)x_col,
                          (long long)(x_col + mi->conv1d_channels), (long long)x->shape[2], (long long)mi->conv1d_channels);
    CPAR_TRY(cpar__check_tensor(ctx, fn, "weight", weight, x->device));
    CPAR_TRY(cpar__check_float(ctx, fn, "weight", weight));
    CPAR_TRY(cpar__mcp_check_weight(ctx, fn, "weight", weight, mi->conv_dim, mi->d_conv, "cp=1 [conv_dim, d_conv]"));
    if (bias) {
        CPAR_TRY(cpar__check_tensor(ctx, fn, "bias", bias, x->device));
        CPAR_TRY(cpar__check_dtype(ctx, fn, "bias", bias, weight->dtype));
        CPAR_TRY(cpar__check_shape(ctx, fn, "bias", bias, &mi->conv_dim, 1, "cp=1 [conv_dim]"));
    }
    return CPAR_OK;
}

/* "name has shape .., expected [s, b, C]" for y and dy. */
static cpar_status cpar__mcp_check_y(cpar_mamba_cp *m, const char *fn, const char *name, const cpar_tensor *t,
                                     const cpar_tensor *x) {
    CPAR_TRY(cpar__check_tensor(m->ctx, fn, name, t, x->device));
    CPAR_TRY(cpar__check_dtype(m->ctx, fn, name, t, x->dtype));
    int64_t want[3] = {x->shape[0], x->shape[1], m->info.conv1d_channels};
    return cpar__check_shape(m->ctx, fn, name, t, want, 3, "[s, b, conv1d_channels]");
}

cpar_status cpar_mamba_cp_conv1d_forward(cpar_mamba_cp *m, const cpar_tensor *x, int64_t x_col,
                                         const cpar_tensor *weight, const cpar_tensor *bias, bool silu, cpar_tensor *y) {
    static const char fn[] = "cpar_mamba_cp_conv1d_forward";
    CPAR_TRY(cpar__mcp_conv_args(m, fn, x, x_col, weight, bias));
    CPAR_TRY(cpar__mcp_check_y(m, fn, "y", y, x));
    if (cpar__ranges_overlap(x->data, cpar_tensor_nbytes(x), y->data, cpar_tensor_nbytes(y)))
        return cpar__fail(m->ctx, CPAR_ERR_INVALID, "%s: y overlaps x", fn);
    const cpar_mamba_cp_info *mi = &m->info;
    cpar_dev_conv_rows rows = cpar__mcp_conv_rows(mi);
    int64_t s = x->shape[0], b = x->shape[1], pitch = x->shape[2];
    const void *xc = cpar__ptr_at(x->data, (size_t)x_col * cpar_dtype_size(x->dtype));
    const void *bd = bias ? bias->data : NULL;
    if (!cpar_tensor_numel(y)) return CPAR_OK;
    if (!cpar__on_device(x->device))
        cpar__mcp_host_conv_fwd(xc, pitch, x->dtype, weight->data, bd, weight->dtype, &rows, s, b, mi->conv1d_channels,
                                mi->d_conv, silu, y->data);
    else
        CPAR_DEV_TRY(m->ctx, fn, cpar_dev_mamba_conv1d_forward(xc, pitch, x->dtype, weight->data, bd, weight->dtype,
                                                               rows, s, b, mi->conv1d_channels, mi->d_conv, silu,
                                                               y->data, m->ctx->compute));
    return CPAR_OK;
}

/* Token splits of the device backward's weight-gradient reduction: enough
 * blocks to fill a GPU (about 64 tokens per split), at most 64 splits. */
static int cpar__mcp_nsplit(int64_t tokens) {
    int64_t n = tokens / 64;
    return (int)(n < 1 ? 1 : n > 64 ? 64 : n);
}

cpar_status cpar_mamba_cp_conv1d_backward(cpar_mamba_cp *m, const cpar_tensor *x, int64_t x_col,
                                          const cpar_tensor *weight, const cpar_tensor *bias, bool silu,
                                          const cpar_tensor *dy, cpar_tensor *dx, cpar_tensor *dweight,
                                          cpar_tensor *dbias) {
    static const char fn[] = "cpar_mamba_cp_conv1d_backward";
    CPAR_TRY(cpar__mcp_conv_args(m, fn, x, x_col, weight, bias));
    cpar_ctx *ctx = m->ctx;
    const cpar_mamba_cp_info *mi = &m->info;
    CPAR_TRY(cpar__mcp_check_y(m, fn, "dy", dy, x));
    CPAR_TRY(cpar__check_tensor(ctx, fn, "dx", dx, x->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "dx", dx, x->dtype));
    CPAR_TRY(cpar__check_shape(ctx, fn, "dx", dx, x->shape, 3, "as x"));
    CPAR_TRY(cpar__check_tensor(ctx, fn, "dweight", dweight, x->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "dweight", dweight, CPAR_F32));
    CPAR_TRY(cpar__mcp_check_weight(ctx, fn, "dweight", dweight, mi->conv_dim, mi->d_conv, "cp=1 [conv_dim, d_conv]"));
    if (bias && !dbias) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dbias is NULL but bias is given", fn);
    if (!bias && dbias) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dbias is given but bias is NULL", fn);
    if (dbias) {
        CPAR_TRY(cpar__check_tensor(ctx, fn, "dbias", dbias, x->device));
        CPAR_TRY(cpar__check_dtype(ctx, fn, "dbias", dbias, CPAR_F32));
        CPAR_TRY(cpar__check_shape(ctx, fn, "dbias", dbias, &mi->conv_dim, 1, "cp=1 [conv_dim]"));
    }
    const struct { const char *name; const cpar_tensor *t; } ins[] = {
        {"x", x}, {"dy", dy}, {"weight", weight}, {"bias", bias}, {"dweight", dweight}, {"dbias", dbias}};
    for (size_t i = 0; i < sizeof ins / sizeof ins[0]; i++)
        if (ins[i].t && cpar__ranges_overlap(dx->data, cpar_tensor_nbytes(dx), ins[i].t->data, cpar_tensor_nbytes(ins[i].t)))
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dx overlaps %s", fn, ins[i].name);
    if (cpar__ranges_overlap(dweight->data, cpar_tensor_nbytes(dweight), dy->data, cpar_tensor_nbytes(dy)) ||
        (dbias && cpar__ranges_overlap(dbias->data, cpar_tensor_nbytes(dbias), dy->data, cpar_tensor_nbytes(dy))))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dweight or dbias overlaps dy", fn);
    cpar_dev_conv_rows rows = cpar__mcp_conv_rows(mi);
    int64_t s = x->shape[0], b = x->shape[1], pitch = x->shape[2], ch = mi->conv1d_channels;
    size_t es = cpar_dtype_size(x->dtype);
    const void *xc = cpar__ptr_at(x->data, (size_t)x_col * es);
    void *dxc = cpar__ptr_at(dx->data, (size_t)x_col * es);
    const void *bd = bias ? bias->data : NULL;
    float *dbd = dbias ? dbias->data : NULL;
    if (!s || !b) return CPAR_OK;
    if (!cpar__on_device(x->device)) {
        cpar__mcp_host_conv_bwd(xc, pitch, x->dtype, weight->data, bd, weight->dtype, &rows, s, b, ch, mi->d_conv, silu,
                                dy->data, dxc, dweight->data, dbd);
        return CPAR_OK;
    }
    int nsplit = cpar__mcp_nsplit(s * b);
    void *partial;
    CPAR_TRY(cpar__workspace(ctx, fn, (size_t)nsplit * (size_t)(mi->d_conv + 1) * (size_t)ch * sizeof(float), &partial));
    CPAR_DEV_TRY(ctx, fn, cpar_dev_mamba_conv1d_backward(xc, pitch, x->dtype, weight->data, bd, weight->dtype, rows, s, b,
                                                         ch, mi->d_conv, silu, dy->data, dxc, partial, nsplit,
                                                         dweight->data, dbd, ctx->compute));
    return CPAR_OK;
}

/* ==== 21. Inference layers ================================================
 * Owns cpar.h §14: RMSNorm forward and backward (host reference loops here,
 * cpar_dev_rmsnorm / _backward on device tensors) and Megatron's inference
 * linear layers on the NCCL path
 * of the seed: RMSNorm -> all-gather -> GEMM (column), GEMM ->
 * reduce-scatter (row), and the fused reduce-scatter + residual add +
 * RMSNorm + all-gather. A layer wraps a frozen, bias-free cpar_linear
 * (section 17) for its weight, master-weight slicing and GEMM operand
 * mapping (cpar__lin_fwd), and owns the norm weight. Scratch: one carve of
 * the context workspace per call (the collectives never touch it).
 * Uses: 2 (errors, checks), 3 (tensors), 4 (device dispatch, workspace,
 * copies), 5 (element load/store), 6 (cpar_fill), 10-11 (groups,
 * all-gather, reduce-scatter), 17 (cpar_linear and its GEMM wrapper). */

#define CPAR__NORM_EPS 1e-5f

/* ---- RMSNorm ---------------------------------------------------------------- */

/* The host twin of cpar_dev_rmsnorm: the same rounding points (the residual
 * sum is rounded to dt before the norm reads it), fp32 math except the row's
 * sum of squares, in fp32 runs added in fp64 (cpar__blk_sum): a
 * sequential fp32 sum of h terms drifts by ~sqrt(h) ulps, more than the
 * kernel's tree of partial sums does. Two passes over a row, the second
 * from cache. A 16-bit row of at most CPAR__ROW elements is widened once:
 * the first pass keeps it in xr and the weight is widened once per call
 * into wr (stack: 40 KiB), which halves the conversions of a bf16 norm;
 * wider rows re-widen per block. */
#define CPAR__ROW 4096
CPAR__INLINE void cpar__host_rmsnorm_body(void *x, const void *add, const void *w, cpar_dtype dt, int64_t rows,
                                          int64_t h, float eps, void *y) {
    float xb[CPAR__BLK], ab[CPAR__BLK], wb[CPAR__BLK], ob[CPAR__BLK], xr[CPAR__ROW], wr[CPAR__ROW];
    const bool cached = dt != CPAR_F32 && h <= CPAR__ROW;
    if (cached) CPAR__BLOCKS(h, j0, n, cpar__blk_widen(wr + j0, w, dt, j0, n);)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t r0 = r * h;
        double ss[CPAR__LANES] = {0};
        CPAR__BLOCKS(h, j0, n, float *xw = cached ? xr + j0 : xb; /* where a 16-bit block is widened */
                     const float *xp = cpar__blk_in(xw, x, dt, r0 + j0, n);
                     if (add) { /* x += add, then read back what dt holds */
                         const float *ap = cpar__blk_in(ab, add, dt, r0 + j0, n);
                         float *o = cpar__blk_dst(ob, x, dt, r0 + j0);
                         CPAR__IVDEP for (int k = 0; k < n; k++) o[k] = xp[k] + ap[k];
                         cpar__blk_out(x, dt, r0 + j0, o, n);
                         xp = cpar__blk_in(xw, x, dt, r0 + j0, n);
                     }
                     cpar__blk_sum(ss, xp, xp, n);)
        const float inv = 1.f / sqrtf((float)(cpar__lanes_sum(ss) / (double)h) + eps);
        CPAR__BLOCKS(h, j0, n, const float *xp = cached ? xr + j0 : cpar__blk_in(xb, x, dt, r0 + j0, n);
                     const float *wp = cached ? wr + j0 : cpar__blk_in(wb, w, dt, j0, n);
                     if (r + 1 < rows) cpar__blk_prefetch(x, dt, r0 + h + j0, n);
                     if (dt == CPAR_BF16) { /* rounded in the same loop, as in the backward */
                         uint16_t *y16 = (uint16_t *)y + r0 + j0;
                         CPAR__IVDEP for (int k = 0; k < n; k++) y16[k] = cpar__bf16_bits(xp[k] * inv * wp[k]);
                         continue;
                     }
                     float *o = cpar__blk_dst(ob, y, dt, r0 + j0);
                     CPAR__IVDEP for (int k = 0; k < n; k++) o[k] = xp[k] * inv * wp[k];
                     cpar__blk_out(y, dt, r0 + j0, o, n);)
    }
}
CPAR__VARIANTS(cpar__host_rmsnorm,
               (void *x, const void *add, const void *w, cpar_dtype dt, int64_t rows, int64_t h, float eps, void *y),
               (x, add, w, dt, rows, h, eps, y))

/* x [rows, h] on `device` (host or the context's): y = rmsnorm(x (+= add)). */
static cpar_status cpar__rmsnorm(cpar_ctx *ctx, const char *fn, int device, void *x, const void *add, const void *w,
                                 cpar_dtype dt, int64_t rows, int64_t h, float eps, void *y) {
    if (cpar__on_device(device))
        CPAR_DEV_TRY(ctx, fn, cpar_dev_rmsnorm(x, add, w, dt, rows, h, eps, y, ctx->compute));
    else cpar__host_rmsnorm(x, add, w, dt, rows, h, eps, y);
    return CPAR_OK;
}

static cpar_status cpar__check_eps(cpar_ctx *ctx, const char *fn, float eps) {
    if (isfinite(eps) && eps >= 0.f) return CPAR_OK;
    return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: eps is %g, expected finite and >= 0", fn, (double)eps);
}

/* weight: [h] of dtype dt on device. */
static cpar_status cpar__check_norm_weight(cpar_ctx *ctx, const char *fn, const char *name, const cpar_tensor *w,
                                           int device, cpar_dtype dt, int64_t h) {
    CPAR_TRY(cpar__check_tensor(ctx, fn, name, w, device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, name, w, dt));
    return cpar__check_shape(ctx, fn, name, w, &h, 1, "[hidden], the last dim");
}

/* x [..., h] a float tensor on the host or ctx's device, weight [h] beside it; *h out. */
static cpar_status cpar__check_norm_input(cpar_ctx *ctx, const char *fn, const cpar_tensor *x,
                                          const cpar_tensor *weight, int64_t *h) {
    CPAR_TRY(cpar__check_op_tensor(ctx, fn, "x", x));
    CPAR_TRY(cpar__check_float(ctx, fn, "x", x));
    if (x->ndim < 1) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: x has ndim 0, expected [..., hidden]", fn);
    *h = x->shape[x->ndim - 1];
    return cpar__check_norm_weight(ctx, fn, "weight", weight, x->device, x->dtype, *h);
}

cpar_status cpar_rmsnorm_forward(cpar_ctx *ctx, const cpar_tensor *x, const cpar_tensor *weight, float eps,
                                 cpar_tensor *y) {
    static const char fn[] = "cpar_rmsnorm_forward";
    int64_t h;
    CPAR_TRY(cpar__check_norm_input(ctx, fn, x, weight, &h));
    CPAR_TRY(cpar__check_tensor(ctx, fn, "y", y, x->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "y", y, x->dtype));
    CPAR_TRY(cpar__check_shape(ctx, fn, "y", y, x->shape, x->ndim, "x's shape"));
    CPAR_TRY(cpar__check_eps(ctx, fn, eps));
    if (y->data != x->data && cpar__ranges_overlap(x->data, cpar_tensor_nbytes(x), y->data, cpar_tensor_nbytes(y)))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: y overlaps x without being x", fn);
    const int64_t rows = h ? cpar_tensor_numel(x) / h : 0;
    /* the norm never writes x without an add, so the const is only shed here */
    return cpar__rmsnorm(ctx, fn, x->device, (void *)x->data, NULL, weight->data, x->dtype, rows, h, eps, y->data);
}

/* The host twin of cpar_dev_rmsnorm_backward (same formulas, fp32; the two
 * row sums as in the forward, cpar__blk_sum2). A row's first pass makes the
 * sums, its second (from cache) dx and dweight. 16-bit rows of at most
 * CPAR__ROW elements: x and dy widened once into xr and gr, the weight once
 * per call into wr (stack: 56 KiB), as in the forward. */
CPAR__INLINE void cpar__host_rmsnorm_backward_body(const void *x, const void *w, const void *dy, cpar_dtype dt,
                                                   int64_t rows, int64_t h, float eps, void *dx, float *dw) {
    float xb[CPAR__BLK], gb[CPAR__BLK], wb[CPAR__BLK], ob[CPAR__BLK], xr[CPAR__ROW], gr[CPAR__ROW], wr[CPAR__ROW];
    const bool cached = dt != CPAR_F32 && h <= CPAR__ROW;
    if (cached) CPAR__BLOCKS(h, j0, n, cpar__blk_widen(wr + j0, w, dt, j0, n);)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t r0 = r * h;
        double ss[CPAR__LANES] = {0}, c[CPAR__LANES] = {0};
        CPAR__BLOCKS(h, j0, n, const float *xp = cpar__blk_in(cached ? xr + j0 : xb, x, dt, r0 + j0, n);
                     const float *gp = cpar__blk_in(cached ? gr + j0 : gb, dy, dt, r0 + j0, n);
                     const float *wp = cached ? wr + j0 : cpar__blk_in(wb, w, dt, j0, n);
                     cpar__blk_sum2(ss, c, xp, gp, wp, n);)
        const float inv = 1.f / sqrtf((float)(cpar__lanes_sum(ss) / (double)h) + eps);
        const float kk = inv * inv * inv * (float)cpar__lanes_sum(c) / (float)h;
        CPAR__BLOCKS(h, j0, n, const float *xp = cached ? xr + j0 : cpar__blk_in(xb, x, dt, r0 + j0, n);
                     const float *gp = cached ? gr + j0 : cpar__blk_in(gb, dy, dt, r0 + j0, n);
                     const float *wp = cached ? wr + j0 : cpar__blk_in(wb, w, dt, j0, n);
                     if (r + 1 < rows) cpar__blk_prefetch(x, dt, r0 + h + j0, n), cpar__blk_prefetch(dy, dt, r0 + h + j0, n);
                     /* dx may be dy: each element read before written. A bf16 dx is
                      * rounded in the same loop (no fp32 block to store and reload). */
                     if (dt == CPAR_BF16) {
                         uint16_t *d16 = (uint16_t *)dx + r0 + j0;
                         if (dw) {
                             CPAR__IVDEP for (int k = 0; k < n; k++) {
                                 dw[j0 + k] += gp[k] * xp[k] * inv;
                                 d16[k] = cpar__bf16_bits(inv * wp[k] * gp[k] - xp[k] * kk);
                             }
                         } else {
                             CPAR__IVDEP for (int k = 0; k < n; k++) d16[k] = cpar__bf16_bits(inv * wp[k] * gp[k] - xp[k] * kk);
                         }
                         continue;
                     }
                     if (dw) {
                         CPAR__IVDEP for (int k = 0; k < n; k++) dw[j0 + k] += gp[k] * xp[k] * inv;
                     }
                     {
                         float *o = cpar__blk_dst(ob, dx, dt, r0 + j0);
                         CPAR__IVDEP for (int k = 0; k < n; k++) o[k] = inv * wp[k] * gp[k] - xp[k] * kk;
                         cpar__blk_out(dx, dt, r0 + j0, o, n);
                     })
    }
}
CPAR__VARIANTS(cpar__host_rmsnorm_backward,
               (const void *x, const void *w, const void *dy, cpar_dtype dt, int64_t rows, int64_t h, float eps,
                void *dx, float *dw),
               (x, w, dy, dt, rows, h, eps, dx, dw))

cpar_status cpar_rmsnorm_backward(cpar_ctx *ctx, const cpar_tensor *x, const cpar_tensor *weight, float eps,
                                  const cpar_tensor *dy, cpar_tensor *dx, cpar_tensor *dweight) {
    static const char fn[] = "cpar_rmsnorm_backward";
    int64_t h;
    CPAR_TRY(cpar__check_norm_input(ctx, fn, x, weight, &h));
    const cpar_tensor *ts[2] = {dy, dx};
    const char *names[2] = {"dy", "dx"};
    for (int i = 0; i < 2; i++) {
        CPAR_TRY(cpar__check_tensor(ctx, fn, names[i], ts[i], x->device));
        CPAR_TRY(cpar__check_dtype(ctx, fn, names[i], ts[i], x->dtype));
        CPAR_TRY(cpar__check_shape(ctx, fn, names[i], ts[i], x->shape, x->ndim, "x's shape"));
    }
    if (dweight) {
        CPAR_TRY(cpar__check_tensor(ctx, fn, "dweight", dweight, x->device));
        CPAR_TRY(cpar__check_dtype(ctx, fn, "dweight", dweight, CPAR_F32));
        CPAR_TRY(cpar__check_shape(ctx, fn, "dweight", dweight, &h, 1, "[hidden] main grad"));
    }
    CPAR_TRY(cpar__check_eps(ctx, fn, eps));
    if (cpar__ranges_overlap(dx->data, cpar_tensor_nbytes(dx), x->data, cpar_tensor_nbytes(x)))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dx overlaps x", fn);
    if (dx->data != dy->data && cpar__ranges_overlap(dx->data, cpar_tensor_nbytes(dx), dy->data, cpar_tensor_nbytes(dy)))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: dx overlaps dy without being dy", fn);
    const int64_t rows = h ? cpar_tensor_numel(x) / h : 0;
    float *dw = dweight ? dweight->data : NULL;
    if (!cpar__on_device(x->device)) {
        cpar__host_rmsnorm_backward(x->data, weight->data, dy->data, x->dtype, rows, h, eps, dx->data, dw);
        return CPAR_OK;
    }
    void *stats;
    CPAR_TRY(cpar__workspace(ctx, fn, cpar_dev_rmsnorm_backward_scratch_bytes(rows, h), &stats));
    CPAR_DEV_TRY(ctx, fn, cpar_dev_rmsnorm_backward(x->data, weight->data, dy->data, x->dtype, rows, h, eps, dx->data,
                                                   dw, stats, ctx->compute));
    return CPAR_OK;
}

/* ---- the fused reduce-scatter + add + RMSNorm + all-gather ------------------ */

/* partial [T, h] (T = tokens of the whole sequence) -> residual [T/n, h] +=
 * reduce-scatter, out [T, h] = all-gather(rmsnorm(residual)). rs and nl:
 * [T/n, h] scratch (unused and may be NULL when n == 1: residual += partial
 * directly). Shapes checked by the caller. */
static cpar_status cpar__rs_add_norm_ag(cpar_group *tp, const char *fn, const cpar_tensor *partial,
                                        cpar_tensor *residual, const void *w, float eps, cpar_tensor *out, void *rs,
                                        void *nl) {
    cpar_ctx *ctx = tp->ctx;
    const cpar_dtype dt = residual->dtype;
    const int64_t h = residual->ndim ? residual->shape[residual->ndim - 1] : 1;
    const int64_t rows = h ? cpar_tensor_numel(residual) / h : 0;
    if (tp->size == 1)
        return cpar__rmsnorm(ctx, fn, ctx->device, residual->data, partial->data, w, dt, rows, h, eps, out->data);
    cpar_tensor rst = *residual, nlt = *residual;
    rst.data = rs, nlt.data = nl;
    CPAR_TRY(cpar__as(ctx, fn, cpar_reduce_scatter(tp, partial, &rst, CPAR_SUM, NULL)));
    CPAR_TRY(cpar__rmsnorm(ctx, fn, ctx->device, residual->data, rs, w, dt, rows, h, eps, nl));
    return cpar__as(ctx, fn, cpar_all_gather(tp, &nlt, out, NULL));
}

/* Checks for partial / residual / out of the fused step: the same dtype as
 * partial (checked by the caller), on the context's device, out shaped full
 * [s, ..., h], residual [s/n, ..., h], no two overlapping. */
static cpar_status cpar__check_rs_add_norm_ag(cpar_ctx *ctx, const char *fn, int n, const char *pname,
                                              const cpar_tensor *partial, const cpar_tensor *residual,
                                              const char *oname, const cpar_tensor *out, const int64_t *full) {
    int64_t want[CPAR_MAX_DIMS];
    memcpy(want, full, sizeof want);
    if (full[0] % n)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s has %lld rows along dim 0, not divisible by tp=%d", fn,
                          pname, (long long)full[0], n);
    want[0] = full[0] / n;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "residual", residual, ctx->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "residual", residual, partial->dtype));
    CPAR_TRY(cpar__check_shape(ctx, fn, "residual", residual, want, partial->ndim, "[s/tp, ..., hidden]"));
    CPAR_TRY(cpar__check_tensor(ctx, fn, oname, out, ctx->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, oname, out, partial->dtype));
    CPAR_TRY(cpar__check_shape(ctx, fn, oname, out, full, partial->ndim, "[s, ..., hidden]"));
    const cpar_tensor *ts[3] = {partial, residual, out};
    const char *names[3] = {pname, "residual", oname};
    for (int i = 0; i < 3; i++)
        for (int j = i + 1; j < 3; j++)
            if (cpar__ranges_overlap(ts[i]->data, cpar_tensor_nbytes(ts[i]), ts[j]->data, cpar_tensor_nbytes(ts[j])))
                return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s overlaps %s", fn, names[j], names[i]);
    return CPAR_OK;
}

cpar_status cpar_inference_rs_add_rmsnorm_ag(cpar_group *tp, const cpar_tensor *partial, cpar_tensor *residual,
                                             const cpar_tensor *weight, float eps, cpar_tensor *out) {
    static const char fn[] = "cpar_inference_rs_add_rmsnorm_ag";
    if (!tp) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: tp is NULL (the tensor-parallel group)", fn);
    cpar_ctx *ctx = tp->ctx;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "partial", partial, ctx->device));
    CPAR_TRY(cpar__check_float(ctx, fn, "partial", partial));
    if (partial->ndim < 2)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: partial has ndim %d, expected [s, ..., hidden]", fn,
                          partial->ndim);
    CPAR_TRY(cpar__check_rs_add_norm_ag(ctx, fn, tp->size, "partial", partial, residual, "out", out, partial->shape));
    CPAR_TRY(cpar__check_norm_weight(ctx, fn, "weight", weight, ctx->device, partial->dtype,
                                     partial->shape[partial->ndim - 1]));
    CPAR_TRY(cpar__check_eps(ctx, fn, eps));
    void *base = NULL;
    const size_t half = (cpar_tensor_nbytes(residual) + 255) & ~(size_t)255;
    if (tp->size > 1) CPAR_TRY(cpar__workspace(ctx, fn, 2 * half, &base));
    return cpar__rs_add_norm_ag(tp, fn, partial, residual, weight->data, eps, out, base,
                                base ? (char *)base + half : NULL);
}

/* ---- the layers --------------------------------------------------------------- */

struct cpar_inference_linear {
    cpar_linear *lin;     /* frozen, bias-free: the weight and its GEMM */
    cpar_tensor norm_w;   /* column: [input_size], the layer's dtype; row: none */
    float eps;
    bool skip_norm_and_all_gather;
};

static cpar_status cpar__inf_create(cpar_group *tp, const cpar_inference_linear_config *cfg, bool row,
                                    cpar_inference_linear **out) {
    const char *fn = row ? "cpar_inference_row_create" : "cpar_inference_column_create";
    if (!tp) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: tp is NULL (the tensor-parallel group)", fn);
    cpar_ctx *ctx = tp->ctx;
    if (!out) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    *out = NULL;
    if (!cfg) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg is NULL", fn);
    if (cfg->input_size <= 0 || cfg->output_size <= 0)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg input_size %lld and output_size %lld must be > 0", fn,
                          (long long)cfg->input_size, (long long)cfg->output_size);
    if (!cpar_dtype_is_float(cfg->dtype))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg dtype is %s, expected f32, f16 or bf16", fn,
                          cpar_dtype_name(cfg->dtype));
    const int64_t part = row ? cfg->input_size : cfg->output_size;
    if (part % tp->size)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg %s %lld is not divisible by tp=%d", fn,
                          row ? "input_size" : "output_size", (long long)part, tp->size);
    const float eps = cfg->eps == 0.f ? CPAR__NORM_EPS : cfg->eps;
    CPAR_TRY(cpar__check_eps(ctx, fn, eps));
    cpar_inference_linear *l = calloc(1, sizeof *l);
    if (!l) return cpar__fail(ctx, CPAR_ERR_OOM, "%s: cannot allocate %zu bytes", fn, sizeof *l);
    l->eps = eps;
    const cpar_linear_config lc = {.input_size = cfg->input_size, .output_size = cfg->output_size,
                                   .dtype = cfg->dtype, .input_is_parallel = row, .frozen = true};
    cpar_status st = row ? cpar_row_parallel_linear_create(tp, &lc, &l->lin)
                         : cpar_column_parallel_linear_create(tp, &lc, &l->lin);
    if (st == CPAR_OK && !row) {
        st = cpar_tensor_alloc(ctx, cfg->dtype, 1, &cfg->input_size, &l->norm_w);
        if (st == CPAR_OK) st = cpar_fill(ctx, &l->norm_w, 1.0);
    }
    if (st != CPAR_OK) {
        cpar_inference_destroy(l);
        return st;
    }
    *out = l;
    return CPAR_OK;
}

cpar_status cpar_inference_column_create(cpar_group *tp, const cpar_inference_linear_config *cfg,
                                         cpar_inference_linear **out) {
    return cpar__inf_create(tp, cfg, false, out);
}

cpar_status cpar_inference_row_create(cpar_group *tp, const cpar_inference_linear_config *cfg,
                                      cpar_inference_linear **out) {
    return cpar__inf_create(tp, cfg, true, out);
}

cpar_status cpar_inference_destroy(cpar_inference_linear *l) {
    if (!l) return CPAR_OK;
    cpar_status st = CPAR_OK;
    if (l->norm_w.data) st = cpar_tensor_free(l->lin->ctx, &l->norm_w);
    cpar_status ls = cpar_linear_destroy(l->lin);
    free(l);
    return st != CPAR_OK ? st : ls;
}

cpar_tensor cpar_inference_weight(const cpar_inference_linear *l) {
    return l ? cpar_linear_weight(l->lin) : cpar_tensor_make(NULL, CPAR_F32, 0, NULL, CPAR_HOST);
}

cpar_tensor cpar_inference_norm_weight(const cpar_inference_linear *l) {
    if (!l || !l->norm_w.data) return cpar_tensor_make(NULL, l ? l->lin->cfg.dtype : CPAR_F32, 0, NULL, CPAR_HOST);
    return l->norm_w;
}

cpar_status cpar_inference_set_skip_norm_and_all_gather(cpar_inference_linear *l, bool skip) {
    static const char fn[] = "cpar_inference_set_skip_norm_and_all_gather";
    if (!l) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: l is NULL", fn);
    if (l->lin->row)
        return cpar__fail(l->lin->ctx, CPAR_ERR_INVALID, "%s: l is a row layer; the flag belongs to column layers",
                          fn);
    l->skip_norm_and_all_gather = skip;
    return CPAR_OK;
}

cpar_status cpar_inference_init_from_master(cpar_inference_linear *l, const cpar_tensor *master_weight,
                                            const cpar_tensor *master_norm_weight) {
    static const char fn[] = "cpar_inference_init_from_master";
    if (!l) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: l is NULL", fn);
    cpar_linear *lin = l->lin;
    cpar_ctx *ctx = lin->ctx;
    const int64_t wshape[2] = {lin->cfg.output_size, lin->cfg.input_size};
    CPAR_TRY(cpar__check_tensor(ctx, fn, "master_weight", master_weight, CPAR_HOST));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "master_weight", master_weight, CPAR_F32));
    CPAR_TRY(cpar__check_shape(ctx, fn, "master_weight", master_weight, wshape, 2, "[output_size, input_size]"));
    if (master_norm_weight) {
        if (lin->row)
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: master_norm_weight given for a row layer (it has no norm)",
                              fn);
        CPAR_TRY(cpar__check_tensor(ctx, fn, "master_norm_weight", master_norm_weight, CPAR_HOST));
        CPAR_TRY(cpar__check_dtype(ctx, fn, "master_norm_weight", master_norm_weight, CPAR_F32));
        CPAR_TRY(cpar__check_shape(ctx, fn, "master_norm_weight", master_norm_weight, &wshape[1], 1,
                                   "[input_size]"));
    }
    CPAR_TRY(cpar_linear_init_from_master(lin, master_weight, NULL));
    if (!master_norm_weight) return CPAR_OK;
    const int64_t h = wshape[1];
    const size_t bytes = cpar_tensor_nbytes(&l->norm_w);
    char *buf = malloc(bytes);
    if (!buf) return cpar__fail(ctx, CPAR_ERR_OOM, "%s: host allocation of %zu bytes failed", fn, bytes);
    cpar__host_cast(buf, lin->cfg.dtype, master_norm_weight->data, CPAR_F32, h);
    cpar_status st = cpar__copy_bytes(ctx, fn, l->norm_w.data, l->norm_w.device, buf, CPAR_HOST, bytes);
    free(buf); /* pageable: the copy has read it (see cpar_linear_init_from_master) */
    return st;
}

/* x's expected shape: want[0..nd) from x's leading dims, dim 0 scaled by
 * num/den, last dim `last`. */
static void cpar__inf_shape(const cpar_tensor *x, int64_t num, int64_t den, int64_t last, int64_t *want) {
    for (int i = 0; i < x->ndim; i++) want[i] = x->shape[i];
    want[0] = x->shape[0] * num / den;
    want[x->ndim - 1] = last;
}

/* x: an activation of the layer's dtype on the context's device, >= 2 dims,
 * last dim `in` (with `why`); dim 0 divisible by div. */
static cpar_status cpar__inf_check_x(cpar_inference_linear *l, const char *fn, const cpar_tensor *x, int64_t in,
                                     const char *why, int div) {
    cpar_ctx *ctx = l->lin->ctx;
    CPAR_TRY(cpar__check_tensor(ctx, fn, "x", x, ctx->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, "x", x, l->lin->cfg.dtype));
    if (x->ndim < 2)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: x has ndim %d, expected [s, ..., hidden]", fn, x->ndim);
    if (x->shape[x->ndim - 1] != in) {
        int64_t want[CPAR_MAX_DIMS];
        cpar__inf_shape(x, 1, 1, in, want);
        return cpar__fail_shape(ctx, fn, "x", x, want, x->ndim, why);
    }
    if (x->shape[0] % div)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: x has %lld rows along dim 0, not divisible by tp=%d", fn,
                          (long long)x->shape[0], div);
    return CPAR_OK;
}

static cpar_status cpar__inf_check_y(cpar_inference_linear *l, const char *fn, const char *name,
                                     const cpar_tensor *y, const int64_t *want, int nd, const char *why,
                                     const cpar_tensor *x) {
    cpar_ctx *ctx = l->lin->ctx;
    CPAR_TRY(cpar__check_tensor(ctx, fn, name, y, ctx->device));
    CPAR_TRY(cpar__check_dtype(ctx, fn, name, y, l->lin->cfg.dtype));
    CPAR_TRY(cpar__check_shape(ctx, fn, name, y, want, nd, why));
    if (cpar__ranges_overlap(x->data, cpar_tensor_nbytes(x), y->data, cpar_tensor_nbytes(y)))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s overlaps x", fn, name);
    return CPAR_OK;
}

/* InferenceLayerNormColumnParallelLinear.forward */
static cpar_status cpar__inf_column_forward(cpar_inference_linear *l, const char *fn, const cpar_tensor *x,
                                            cpar_tensor *y) {
    cpar_linear *lin = l->lin;
    cpar_ctx *ctx = lin->ctx;
    const int n = lin->n;
    const bool skip = l->skip_norm_and_all_gather;
    const int64_t K = lin->in_l, N = lin->out_l;
    CPAR_TRY(cpar__inf_check_x(l, fn, x, K, "input_size", 1));
    int64_t want[CPAR_MAX_DIMS];
    cpar__inf_shape(x, skip ? 1 : n, 1, N, want);
    CPAR_TRY(cpar__inf_check_y(l, fn, "y", y, want, x->ndim, "[s, ..., output_size/tp]", x));
    const int64_t T = cpar_tensor_numel(y) / N;
    if (skip) return cpar__lin_fwd(lin, fn, x->data, K, T, K, N, y->data, N);
    /* RMSNorm of this rank's shard, then gather_from_sequence_parallel_region */
    const size_t es = cpar_dtype_size(lin->cfg.dtype);
    const size_t nb = (cpar_tensor_nbytes(x) + 255) & ~(size_t)255;
    void *base;
    CPAR_TRY(cpar__workspace(ctx, fn, nb + (n > 1 ? (size_t)(T * K) * es : 0), &base));
    CPAR_TRY(cpar__rmsnorm(ctx, fn, ctx->device, (void *)x->data, NULL, l->norm_w.data, lin->cfg.dtype,
                           cpar_tensor_numel(x) / K, K, l->eps, base));
    const void *X = base;
    if (n > 1) {
        cpar_tensor xl = *x, xg = *x;
        xl.data = base;
        xg.shape[0] *= n;
        xg.data = (char *)base + nb;
        CPAR_TRY(cpar__as(ctx, fn, cpar_all_gather(lin->tp, &xl, &xg, NULL)));
        X = xg.data;
    }
    return cpar__lin_fwd(lin, fn, X, K, T, K, N, y->data, N);
}

/* InferenceRowParallelLinear.forward: the GEMM into scratch (tp > 1) and a
 * reduce-scatter into y. */
static cpar_status cpar__inf_row_forward(cpar_inference_linear *l, const char *fn, const cpar_tensor *x,
                                         cpar_tensor *y) {
    cpar_linear *lin = l->lin;
    const int n = lin->n;
    const int64_t K = lin->in_l, N = lin->out_l;
    CPAR_TRY(cpar__inf_check_x(l, fn, x, K, "input_size/tp", n));
    const int64_t T = cpar_tensor_numel(x) / K;
    int64_t want[CPAR_MAX_DIMS];
    cpar__inf_shape(x, 1, n, N, want);
    CPAR_TRY(cpar__inf_check_y(l, fn, "y", y, want, x->ndim, "[s/tp, ..., output_size]", x));
    if (n == 1) return cpar__lin_fwd(lin, fn, x->data, K, T, K, N, y->data, N);
    void *P;
    CPAR_TRY(cpar__workspace(lin->ctx, fn, (size_t)(T * N) * cpar_dtype_size(lin->cfg.dtype), &P));
    CPAR_TRY(cpar__lin_fwd(lin, fn, x->data, K, T, K, N, P, N));
    cpar_tensor part = *x;
    part.shape[x->ndim - 1] = N;
    part.data = P;
    return cpar__as(lin->ctx, fn, cpar_reduce_scatter(lin->tp, &part, y, CPAR_SUM, NULL));
}

cpar_status cpar_inference_forward(cpar_inference_linear *l, const cpar_tensor *x, cpar_tensor *y) {
    static const char fn[] = "cpar_inference_forward";
    if (!l) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: l is NULL", fn);
    return l->lin->row ? cpar__inf_row_forward(l, fn, x, y) : cpar__inf_column_forward(l, fn, x, y);
}

cpar_status cpar_inference_row_forward_fused(cpar_inference_linear *l, const cpar_tensor *x, cpar_tensor *residual,
                                             const cpar_tensor *next_norm_weight, float eps, cpar_tensor *normed) {
    static const char fn[] = "cpar_inference_row_forward_fused";
    if (!l) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: l is NULL", fn);
    cpar_linear *lin = l->lin;
    cpar_ctx *ctx = lin->ctx;
    if (!lin->row)
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: l is a column layer, expected a row layer", fn);
    const int n = lin->n;
    const int64_t K = lin->in_l, N = lin->out_l;
    CPAR_TRY(cpar__inf_check_x(l, fn, x, K, "input_size/tp", n));
    const int64_t T = cpar_tensor_numel(x) / K;
    int64_t full[CPAR_MAX_DIMS];
    cpar__inf_shape(x, 1, 1, N, full);
    cpar_tensor part = *x; /* the GEMM's output: x's shape with output_size last */
    part.shape[x->ndim - 1] = N;
    part.data = NULL;
    /* x stands in for the partial sums in the shared checks: dtype, rank, no overlap */
    CPAR_TRY(cpar__check_rs_add_norm_ag(ctx, fn, n, "x", x, residual, "normed", normed, full));
    CPAR_TRY(cpar__check_norm_weight(ctx, fn, "next_norm_weight", next_norm_weight, ctx->device, lin->cfg.dtype, N));
    if (eps == 0.f) eps = CPAR__NORM_EPS;
    CPAR_TRY(cpar__check_eps(ctx, fn, eps));
    const size_t es = cpar_dtype_size(lin->cfg.dtype);
    const size_t pb = ((size_t)(T * N) * es + 255) & ~(size_t)255, hb = (cpar_tensor_nbytes(residual) + 255) & ~(size_t)255;
    void *base;
    CPAR_TRY(cpar__workspace(ctx, fn, pb + (n > 1 ? 2 * hb : 0), &base));
    part.data = base;
    CPAR_TRY(cpar__lin_fwd(lin, fn, x->data, K, T, K, N, base, N));
    return cpar__rs_add_norm_ag(lin->tp, fn, &part, residual, next_norm_weight->data, eps, normed,
                                n > 1 ? (char *)base + pb : NULL, n > 1 ? (char *)base + pb + hb : NULL);
}

/* ==== 22. Training ==========================================================
 * Owns cpar.h §15: the AdamW step, the global gradient norm and its
 * clipping, and the coalesced gradient all-reduce. Host tensors run the
 * loops here (the twins of cpar_kernels.cu §21); device tensors the fused
 * AdamW kernel and the deterministic sum of squares. Scratch: the context
 * workspace. Uses: 2-4 (errors, tensors, device dispatch, workspace), 6
 * (cpar_axpby), 10-11 (groups, all-reduce). */

/* grad, master, m, v (and param) of cpar_adamw_step: F32 (param: a float
 * dtype) with grad's shape, all on grad's memory (host, or the context's
 * device), none overlapping except param == master. */
static cpar_status cpar__check_adamw_tensors(cpar_ctx *ctx, const char *fn, const cpar_tensor *const *ts,
                                             const char *const *names, int n) {
    const cpar_tensor *grad = ts[0];
    for (int i = 0; i < n; i++) {
        if (!ts[i]) {
            if (i == n - 1) continue; /* param may be NULL */
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is NULL", fn, names[i]);
        }
        CPAR_TRY(cpar__check_tensor(ctx, fn, names[i], ts[i], -2));
        if (i < n - 1) CPAR_TRY(cpar__check_dtype(ctx, fn, names[i], ts[i], CPAR_F32));
        else CPAR_TRY(cpar__check_float(ctx, fn, names[i], ts[i]));
        if (ts[i]->device != CPAR_HOST && ts[i]->device != ctx->device) {
            char got[32];
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is on %s, expected host memory or the context's device %d",
                              fn, names[i], cpar__device_str(ts[i]->device, got, sizeof got), ctx->device);
        }
        if (ts[i]->device != grad->device) {
            char got[32], want[32];
            return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s is on %s, expected %s (as grad)", fn, names[i],
                              cpar__device_str(ts[i]->device, got, sizeof got),
                              cpar__device_str(grad->device, want, sizeof want));
        }
        if (i) CPAR_TRY(cpar__check_shape(ctx, fn, names[i], ts[i], grad->shape, grad->ndim, "grad's shape"));
        for (int j = 0; j < i; j++) {
            if (!ts[j] || (i == n - 1 && j == 1 && ts[i]->data == ts[j]->data && ts[i]->dtype == CPAR_F32)) continue;
            if (cpar__ranges_overlap(ts[i]->data, cpar_tensor_nbytes(ts[i]), ts[j]->data, cpar_tensor_nbytes(ts[j])))
                return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: %s overlaps %s", fn, names[i], names[j]);
        }
    }
    return CPAR_OK;
}

cpar_status cpar_adamw_step(cpar_ctx *ctx, const cpar_adamw_config *cfg, int64_t step, float grad_scale,
                            const cpar_tensor *grad, cpar_tensor *master, cpar_tensor *m, cpar_tensor *v,
                            cpar_tensor *param) {
    static const char fn[] = "cpar_adamw_step";
    if (!ctx) return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: ctx is NULL", fn);
    if (!cfg) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg is NULL", fn);
    const float b1 = cfg->beta1 != 0.f ? cfg->beta1 : 0.9f, b2 = cfg->beta2 != 0.f ? cfg->beta2 : 0.999f;
    const float eps = cfg->eps != 0.f ? cfg->eps : 1e-8f, lr = cfg->lr, wd = cfg->weight_decay;
    if (step < 1) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: step is %lld, expected >= 1 (1-based)", fn, (long long)step);
    if (!(lr >= 0.f) || !isfinite(lr)) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg.lr is %g, expected >= 0", fn, (double)lr);
    if (!(b1 > 0.f && b1 < 1.f)) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg.beta1 is %g, expected in (0, 1)", fn, (double)b1);
    if (!(b2 > 0.f && b2 < 1.f)) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg.beta2 is %g, expected in (0, 1)", fn, (double)b2);
    if (!(eps > 0.f) || !isfinite(eps)) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg.eps is %g, expected > 0", fn, (double)eps);
    if (!(wd >= 0.f) || !isfinite(wd))
        return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: cfg.weight_decay is %g, expected >= 0", fn, (double)wd);
    if (!isfinite(grad_scale)) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: grad_scale is %g, expected a finite number", fn, (double)grad_scale);
    const cpar_tensor *ts[5] = {grad, master, m, v, param};
    static const char *const names[5] = {"grad", "master", "m", "v", "param"};
    CPAR_TRY(cpar__check_adamw_tensors(ctx, fn, ts, names, 5));
    if (param && param->data == master->data) param = NULL; /* the parameter is the master itself */
    /* PyTorch's order: bias corrections in double, the element math in fp32 */
    const float bc1 = (float)(1.0 - pow((double)b1, (double)step)), bc2 = (float)(1.0 - pow((double)b2, (double)step));
    const int64_t n = cpar_tensor_numel(grad);
    if (cpar__on_device(grad->device)) {
        CPAR_DEV_TRY(ctx, fn, cpar_dev_adamw(master->data, m->data, v->data, grad->data, param ? param->data : NULL,
                                             param ? param->dtype : CPAR_F32, n, lr, b1, b2, eps, wd, bc1, bc2,
                                             grad_scale, ctx->compute));
        return CPAR_OK;
    }
    const float decay = 1.f - lr * wd, step_size = lr / bc1, sqrt_bc2 = sqrtf(bc2);
    float *w = master->data, *mm = m->data, *vv = v->data;
    const float *g = grad->data;
    for (int64_t i = 0; i < n; i++) {
        const float gi = g[i] * grad_scale;
        const float mi = b1 * mm[i] + (1.f - b1) * gi, vi = b2 * vv[i] + (1.f - b2) * gi * gi;
        mm[i] = mi, vv[i] = vi;
        w[i] = w[i] * decay - step_size * (mi / (sqrtf(vi) / sqrt_bc2 + eps));
    }
    if (param) cpar__host_cast(param->data, param->dtype, w, CPAR_F32, n);
    return CPAR_OK;
}

/* grads[i] of a gradient list: F32 on the context's device. */
static cpar_status cpar__check_grads(cpar_ctx *ctx, const char *fn, const cpar_tensor *const *grads, int n) {
    if (n < 0) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: n is %d, expected >= 0", fn, n);
    if (n > 0 && !grads) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: grads is NULL with n = %d", fn, n);
    for (int i = 0; i < n; i++) {
        char name[32];
        snprintf(name, sizeof name, "grads[%d]", i);
        CPAR_TRY(cpar__check_tensor(ctx, fn, name, grads[i], ctx->device));
        CPAR_TRY(cpar__check_dtype(ctx, fn, name, grads[i], CPAR_F32));
    }
    return CPAR_OK;
}

/* The norm under the name of the public function fn. */
static cpar_status cpar__grad_norm(cpar_group *tp, const char *fn, const cpar_tensor *const *grads,
                                   const bool *tp_duplicate, int n, float *norm) {
    CPAR_TRY(cpar__check_group(tp, fn));
    cpar_ctx *ctx = tp->ctx;
    if (!norm) return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: norm is NULL", fn);
    CPAR_TRY(cpar__check_grads(ctx, fn, grads, n));
    /* The running sum lives in the workspace (the all-reduce never touches
     * it), followed by the device kernel's partial sums. */
    size_t scratch = 0;
    for (int i = 0; i < n; i++) {
        const size_t b = cpar_dev_sum_squares_scratch(cpar_tensor_numel(grads[i]));
        scratch = b > scratch ? b : scratch;
    }
    void *ws;
    CPAR_TRY(cpar__workspace(ctx, fn, 256 + scratch, &ws));
    const int64_t one = 1;
    cpar_tensor total = cpar_tensor_make(ws, CPAR_F32, 1, &one, ctx->device);
    double host_sum = 0.0;
    if (cpar__on_device(ctx->device)) CPAR_DEV_TRY(ctx, fn, cpar_dev_fill(ws, CPAR_F32, 1, 0.0, ctx->compute));
    for (int i = 0; i < n; i++) {
        if (tp_duplicate && tp_duplicate[i] && tp->rank != 0) continue; /* counted on tp rank 0 */
        const int64_t k = cpar_tensor_numel(grads[i]);
        if (cpar__on_device(ctx->device)) {
            CPAR_DEV_TRY(ctx, fn, cpar_dev_sum_squares(grads[i]->data, k, ws, (char *)ws + 256, ctx->compute));
            continue;
        }
        const float *g = grads[i]->data;
        for (int64_t j = 0; j < k; j++) host_sum += (double)g[j] * g[j];
    }
    if (!cpar__on_device(ctx->device)) *(float *)ws = (float)host_sum;
    CPAR_TRY(cpar__as(ctx, fn, cpar_all_reduce(tp, &total, &total, CPAR_SUM)));
    float sum;
    CPAR_TRY(cpar__copy_bytes(ctx, fn, &sum, CPAR_HOST, ws, ctx->device, sizeof sum)); /* complete on return */
    *norm = sqrtf(sum);
    return CPAR_OK;
}

cpar_status cpar_grad_norm(cpar_group *tp, const cpar_tensor *const *grads, const bool *tp_duplicate, int n,
                           float *norm) {
    return cpar__grad_norm(tp, "cpar_grad_norm", grads, tp_duplicate, n, norm);
}

cpar_status cpar_clip_grad_norm(cpar_group *tp, cpar_tensor *const *grads, const bool *tp_duplicate, int n,
                                float max_norm, float *norm, float *coef) {
    static const char fn[] = "cpar_clip_grad_norm";
    CPAR_TRY(cpar__check_group(tp, fn));
    if (!(max_norm > 0.f) || !isfinite(max_norm))
        return cpar__fail(tp->ctx, CPAR_ERR_INVALID, "%s: max_norm is %g, expected > 0", fn, (double)max_norm);
    CPAR_TRY(cpar__grad_norm(tp, fn, (const cpar_tensor *const *)grads, tp_duplicate, n, norm));
    /* Megatron's coefficient; a non-finite norm scales nothing (the caller sees it) */
    const float c = max_norm / (*norm + 1e-6f);
    const bool clip = isfinite(*norm) && c < 1.f;
    for (int i = 0; clip && i < n; i++) CPAR_TRY(cpar__as(tp->ctx, fn, cpar_axpby(tp->ctx, c, grads[i], 0.f, grads[i])));
    if (coef) *coef = clip ? c : 1.f;
    return CPAR_OK;
}

cpar_status cpar_grads_all_reduce(cpar_group *g, cpar_tensor *const *grads, int n, bool average) {
    static const char fn[] = "cpar_grads_all_reduce";
    CPAR_TRY(cpar__check_group(g, fn));
    cpar_ctx *ctx = g->ctx;
    CPAR_TRY(cpar__check_grads(ctx, fn, (const cpar_tensor *const *)grads, n));
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < i; j++)
            if (cpar__ranges_overlap(grads[i]->data, cpar_tensor_nbytes(grads[i]), grads[j]->data,
                                     cpar_tensor_nbytes(grads[j])))
                return cpar__fail(ctx, CPAR_ERR_INVALID, "%s: grads[%d] overlaps grads[%d]", fn, i, j);
        total += cpar_tensor_numel(grads[i]);
    }
    /* One flat buffer: pack, one all-reduce, unpack (the statistics show one call of all the bytes). */
    void *ws;
    CPAR_TRY(cpar__workspace(ctx, fn, (size_t)total * sizeof(float), &ws));
    cpar_tensor flat = cpar_tensor_make(ws, CPAR_F32, 1, &total, ctx->device);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        const size_t b = cpar_tensor_nbytes(grads[i]);
        CPAR_TRY(cpar__copy_bytes(ctx, fn, (char *)ws + off, ctx->device, grads[i]->data, ctx->device, b));
        off += b;
    }
    CPAR_TRY(cpar__as(ctx, fn, cpar_all_reduce(g, &flat, &flat, CPAR_SUM)));
    if (average && g->size > 1) CPAR_TRY(cpar__as(ctx, fn, cpar_axpby(ctx, 1.f / (float)g->size, &flat, 0.f, &flat)));
    off = 0;
    for (int i = 0; i < n; i++) {
        const size_t b = cpar_tensor_nbytes(grads[i]);
        CPAR_TRY(cpar__copy_bytes(ctx, fn, grads[i]->data, ctx->device, (char *)ws + off, ctx->device, b));
        off += b;
    }
    return CPAR_OK;
}
