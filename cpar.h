/* SPDX-License-Identifier: MIT */
/* cpar.h — a minimal C runtime for model parallelism on NVIDIA GPUs.
 *
 * Megatron-style tensor, sequence and context parallelism as one static
 * library on NCCL and cuBLAS: no MPI, no Python. Copy cpar.h, cpar.c and
 * cpar_kernels.cu into a project (or link libcpar.a).
 *
 * Conventions (see README.md and docs/DESIGN.md):
 *  - Every function returns cpar_status; on failure cpar_last_error() gives one
 *    line naming the function, the argument and what was expected.
 *  - Configuration structs are passed by pointer; a zero field means the
 *    documented default (sokol style).
 *  - Tensors are contiguous, row-major, and owned by the caller; outputs are
 *    preallocated by the caller and checked.
 *  - Device work is stream-ordered: cpar_sync(ctx) waits for it.
 *  - The library never exits or aborts, and prints nothing but WAIT lines unless
 *    CPAR_LOG=warn|info|debug (any case; like NCCL_DEBUG) asks for more: a
 *    WAIT line every CPAR_WAIT_REPORT_S seconds (default 10; 0: never) while
 *    a wait goes on (for the store, a peer or the GPU: what it waits for,
 *    for how long of its deadline, the likely cause), which CPAR_LOG=off
 *    silences; info adds one banner per rank (version, backend, rank/world,
 *    device, NCCL version, timeout), groups, the store's address; debug adds
 *    every failure. Lines go to stderr, or to CPAR_LOG_FILE, where %h, %p
 *    and %r are the host, pid and rank (one file per rank with %r). Each line
 *    starts "cpar[RANK] HOST:PID LEVEL".
 *  - Products on host tensors (every backend) use cpar's own blocked GEMM
 *    (AVX-512 or AVX2+FMA where the CPU has it; bf16 x bf16 on AMX tiles,
 *    else AVX512-BF16, where it has those), or a CBLAS for F32 when the
 *    build found one (OpenBLAS or BLIS; `make CPAR_BLAS=0` turns that off,
 *    and CPAR_HOST_GEMM=builtin at context creation picks cpar's own anyway;
 *    CPAR_HOST_GEMM=amx, avx512bf16, avx512, avx2 or c forces that
 *    micro-kernel, an unknown name or one the CPU lacks failing context
 *    creation).
 *  - CPAR_HOST_THREADS=N (read at context creation; default 1) lets one rank
 *    use N threads for its host GEMMs, for when ranks < cores (1-rank
 *    reference runs gain most): cpar's GEMM splits the larger of C's
 *    dimensions over the caller and a pool of N - 1 worker threads
 *    ("cpar-gemm") the context owns, made at its first product of 2^23
 *    multiply-adds or more and joined by cpar_finalize. Results are
 *    bit-identical to N = 1 (each element of C is computed by one thread in
 *    the same order); no call allocates after warm-up; a forked child makes
 *    its own pool. The CBLAS path gives OpenBLAS N threads (its count is the
 *    process's: the first context to run a product sets it, and
 *    OPENBLAS_NUM_THREADS or OMP_NUM_THREADS, when set, win); BLIS stays as
 *    configured. Device products ignore it. A value other than an integer in
 *    1..256 fails context creation (cpar_spawn, cpar_init_from_env) with
 *    CPAR_ERR_INVALID naming the variable.
 *
 * Contents
 *   1. Status codes and errors
 *   2. Data types and tensors
 *   3. Contexts, backends and start-up
 *   4. Groups and the parallel grid
 *   5. Raw collectives and communication statistics
 *   6. Element-wise and layout operations (host reference + CUDA kernels)
 *   7. Devices (cpar_device_count; the device layer itself is internal, §16)
 *   8. Tensor-parallel mappings and utilities
 *   9. RNG, dropout and activation checkpointing
 *  10. Vocabulary-parallel embedding and cross entropy
 *  11. Linear layers (column- and row-parallel)
 *  12. Attention and context parallelism (local flash attention, ring attention, sharding)
 *  13. Mamba context parallelism
 *  14. Inference layers (RMSNorm forward and backward, inference column/row-parallel linear)
 *  15. Training: AdamW, gradient norm and clipping, data-parallel gradient reduction
 *  16. Internal: the device layer (only under CPAR_INTERNAL; not API)
 */
#ifndef CPAR_H
#define CPAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this header. The code orders versions as integers, like
 * NCCL_VERSION_CODE: #if CPAR_VERSION_CODE >= CPAR_VERSION(0, 2, 0). */
#define CPAR_VERSION_MAJOR 0
#define CPAR_VERSION_MINOR 1
#define CPAR_VERSION_PATCH 0
#define CPAR_VERSION(major, minor, patch) ((major) * 10000 + (minor) * 100 + (patch))
#define CPAR_VERSION_CODE CPAR_VERSION(CPAR_VERSION_MAJOR, CPAR_VERSION_MINOR, CPAR_VERSION_PATCH)

/* ==== 1. Status codes and errors ======================================== */

typedef enum cpar_status {
    CPAR_OK = 0,
    CPAR_ERR_INVALID,     /* bad argument: NULL, shape, dtype, device, divisibility, group; also
                           * ranks calling different collectives, and a call NCCL rejects as
                           * ncclInvalidArgument / ncclInvalidUsage */
    CPAR_ERR_CUDA,        /* a CUDA runtime call failed (or no GPU where one is needed) */
    CPAR_ERR_NCCL,        /* an NCCL call failed or the communicator reported an async error
                           * (ncclRemoteError is CPAR_ERR_PEER) */
    CPAR_ERR_CUBLAS,      /* a cuBLAS call failed */
    CPAR_ERR_SYSTEM,      /* socket, thread, process or file failure (errno in the message) */
    CPAR_ERR_TIMEOUT,     /* a wait passed its deadline; the message names who is missing (on
                           * NCCL: the call still in progress, and the peer of a send/receive) */
    CPAR_ERR_PEER,        /* another rank failed, exited early or called cpar_abort */
    CPAR_ERR_OOM,         /* an allocation failed; the message gives the size */
    CPAR_ERR_UNSUPPORTED, /* valid request this build or backend cannot do */
    CPAR_STATUS_COUNT
} cpar_status;

typedef struct cpar_ctx cpar_ctx;
typedef struct cpar_group cpar_group;

/* Name of a status code ("CPAR_ERR_INVALID"); never NULL. */
const char *cpar_status_string(cpar_status st);

/* One line describing the last failure on ctx, e.g.
 *   "cpar_all_gather: out has shape [6,3], expected [8,3] (4 ranks x [2,3])".
 * With ctx == NULL: the last failure on the calling thread (usable before a
 * context exists, e.g. after cpar_init_from_env failed). "" when none. */
const char *cpar_last_error(const cpar_ctx *ctx);
const char *cpar_thread_last_error(void);

/* The version of the library that was linked, which may differ from the
 * header a program was compiled with (a shared libcpar.so upgraded under
 * it): cpar_version() is "MAJOR.MINOR.PATCH" ("0.1.0"), never NULL;
 * cpar_version_code() is its CPAR_VERSION_CODE (100 for 0.1.0). A program
 * can compare cpar_version_code() with CPAR_VERSION_CODE at start-up. */
const char *cpar_version(void);
int cpar_version_code(void);

/* ==== 2. Data types and tensors ========================================== */

typedef enum cpar_dtype {
    CPAR_F32 = 0, /* the default of every zero-initialised config */
    CPAR_F16,
    CPAR_BF16,
    CPAR_I32,
    CPAR_I64,
    CPAR_U8,
    CPAR_DTYPE_COUNT
} cpar_dtype;

size_t cpar_dtype_size(cpar_dtype dt);        /* 0 for an invalid dtype */
const char *cpar_dtype_name(cpar_dtype dt);   /* "f32", "bf16", ...; "?" when invalid */
bool cpar_dtype_is_float(cpar_dtype dt);      /* F32, F16, BF16 */

/* IEEE half and bfloat16 conversions (round to nearest even), bit patterns. */
float cpar_f16_to_f32(uint16_t h);
uint16_t cpar_f32_to_f16(float f);
float cpar_bf16_to_f32(uint16_t b);
uint16_t cpar_f32_to_bf16(float f);

#define CPAR_MAX_DIMS 8
#define CPAR_HOST (-1) /* tensor.device for host memory; otherwise a GPU ordinal */

typedef struct cpar_tensor {
    void *data;
    cpar_dtype dtype;
    int ndim;
    int64_t shape[CPAR_MAX_DIMS];
    int device;
} cpar_tensor;

/* A view of caller-owned memory. ndim in [0, CPAR_MAX_DIMS]; ndim 0 is a scalar. */
cpar_tensor cpar_tensor_make(void *data, cpar_dtype dtype, int ndim, const int64_t *shape, int device);
/* Element count and byte size. Every size is checked: a tensor whose ndim is
 * outside 0..CPAR_MAX_DIMS, that has a negative dim, or whose dims (zeros
 * counted as 1) times the dtype size exceed PTRDIFF_MAX bytes is invalid;
 * numel returns -1 for it and nbytes 0 (both return 0 for NULL), and every
 * function given one returns CPAR_ERR_INVALID naming the argument. */
int64_t cpar_tensor_numel(const cpar_tensor *t);
size_t cpar_tensor_nbytes(const cpar_tensor *t);

/* Allocate on the context's device (host memory on the host backend,
 * the rank's GPU on NCCL and DEVICE: simulated device memory on the simulator).
 * The memory is uninitialised. Free with cpar_tensor_free (NULL data is fine).
 * With ranks as processes (cpar_init_from_env on the host backend), tensors
 * of 16 KiB or more come from the rank's shared arena, which its peers map:
 * collectives on them read the peers' tensors in place, as threads do (see
 * cpar_init_from_env). A process forked from a rank does not inherit the
 * arena (as it would not inherit GPU memory). */
cpar_status cpar_tensor_alloc(cpar_ctx *ctx, cpar_dtype dtype, int ndim, const int64_t *shape, cpar_tensor *out);
cpar_status cpar_tensor_free(cpar_ctx *ctx, cpar_tensor *t);

/* dst <- src, any direction (host<->device, device<->device). Same dtype and
 * element count (shapes may differ: a reshape). Stream-ordered on the context's
 * compute stream; a copy into host memory is complete when it returns. A
 * copy from pinned host memory (cpar_pinned_alloc) may still read it until
 * cpar_sync returns (torch's non_blocking=True); from other host memory it
 * has read it on return. */
cpar_status cpar_tensor_copy(cpar_ctx *ctx, const cpar_tensor *src, cpar_tensor *dst);

/* ==== 3. Contexts, backends and start-up ================================= */

typedef enum cpar_backend {
    CPAR_BACKEND_HOST = 0, /* host memory; ranks are threads of one process (cpar_spawn) or processes
                            * of one node (cpar_init_from_env); shared-memory collectives */
    CPAR_BACKEND_NCCL,     /* one GPU per rank; NCCL communicators; needs a CPAR_CUDA=1 build */
    CPAR_BACKEND_DEVICE,   /* ranks as threads sharing the visible GPUs (rank r on GPU r mod n, so one
                            * GPU runs any grid; n: the visible GPUs); collectives by device copies and
                            * reduction kernels, ordered with events, staged through copies between
                            * GPUs without peer access; no NCCL. On the CUDA simulator in test builds. */
    CPAR_BACKEND_COUNT
} cpar_backend;
#define CPAR_BACKEND_SIM CPAR_BACKEND_DEVICE /* its name before it ran on GPUs */

/* "host", "nccl", "device" (cpar_backend_parse also takes "sim" for device) */
const char *cpar_backend_name(cpar_backend b);
/* The backend named s (case-insensitive), or -1. */
int cpar_backend_parse(const char *s);
/* True when this build can run backend b here (NCCL and DEVICE: built with
 * CUDA, or the simulator, and at least one GPU visible). */
bool cpar_backend_available(cpar_backend b);

typedef struct cpar_init_config {
    cpar_backend backend;   /* 0 -> CPAR_BACKEND_HOST (cpar_init_from_env: 0 -> NCCL) */
    int timeout_ms;         /* deadline of every wait; 0 -> $CPAR_TIMEOUT_MS or 300000 */
    size_t workspace_bytes; /* initial workspace; 0 -> grows on demand while warming up */
    int device;             /* cpar_init_from_env only: GPU ordinal; 0 -> LOCAL_RANK; -1 -> 0.
                             * (cpar_spawn gives rank r the GPU r, or r mod n of n on DEVICE.) */
} cpar_init_config;

/* A rank's entry point for cpar_spawn. Return CPAR_OK or the failure. */
typedef cpar_status (*cpar_rank_fn)(cpar_ctx *ctx, void *arg);

/* Single-process mode: run fn(ctx, arg) on nranks threads, each with its own
 * context (rank r of nranks; on NCCL device r, nranks at most the GPUs
 * visible, and every rank's communicator is ready before any fn runs; on
 * DEVICE device r mod n, any nranks up to 256: more ranks than GPUs share
 * them, each rank with its own streams; n counts the visible GPUs, and
 * between GPUs without peer access, consumer cards over PCIe, the reductions
 * stage through copies). Returns CPAR_OK when
 * every rank returned CPAR_OK, else the status of the rank that failed first
 * in time (the root cause: the peers it released fail with CPAR_ERR_PEER),
 * with "rank N: <its message>" in cpar_thread_last_error() on the caller.
 * A rank that fails (returns non-OK) aborts the job: peers blocked in a
 * collective return CPAR_ERR_PEER. The process stays usable afterwards. */
cpar_status cpar_spawn(int nranks, cpar_backend backend, cpar_rank_fn fn, void *arg);
cpar_status cpar_spawn_with(int nranks, const cpar_init_config *cfg, cpar_rank_fn fn, void *arg);

/* Multi-process mode (one process per GPU, started by cparrun, torchrun or
 * SLURM). Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
 * the store port (falls back to SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
 * SLURM_NTASKS_PER_NODE; MASTER_ADDR defaults to 127.0.0.1, or on a SLURM
 * step over several nodes to the first host of its node list). The rendezvous
 * store listens on CPAR_STORE_PORT when set, else on MASTER_PORT + 1 (torchrun
 * already holds MASTER_PORT with its own store). Rank 0 hosts the store, bound
 * to cpar_env.store_bind (loopback for a single-node job). Every rank then
 * joins it with cpar_store_join, which proves the job token and names a
 * world-size mismatch or a duplicate rank, before the NCCL unique id is shared.
 *
 * The backend: CPAR_BACKEND (host, nccl or device, any case) when set, overriding
 * cfg's; else cfg's, except that NCCL with no GPU visible (or a build without
 * NCCL) becomes host, with one CPAR_LOG=info line saying so. On the host
 * backend with WORLD_SIZE > 1 every rank is a process of one node (ranks on
 * several hosts, or LOCAL_WORLD_SIZE below WORLD_SIZE: CPAR_ERR_UNSUPPORTED),
 * tensors live in host memory, and each group of two or more ranks shares a
 * POSIX shared-memory segment whose name travels through the store; it is
 * unlinked as soon as every member has mapped it, so no segment outlives the
 * job. Collectives give the threaded host backend's results bit for bit and
 * its byte statistics. Every rank also has an arena: one anonymous memfd
 * (never in /dev/shm), sparse, that its peers map through /proc/<pid>/fd,
 * from which cpar_tensor_alloc and the workspace take buffers of 16 KiB or
 * more. A collective whose members' buffers all lie in their arenas moves
 * the data in place exactly as the threaded backend does; any other is
 * staged through the segment in pieces of CPAR_HOST_CHUNK bytes per rank
 * (default 1 MiB). CPAR_HOST_ARENA=0 turns the arena off (every collective
 * stages); a rank that cannot map a peer's arena stages likewise, with one
 * CPAR_LOG=info line saying why. A rank that dies makes its
 * peers fail with CPAR_ERR_PEER naming it, well before the deadline. The
 * device backend runs ranks as threads only (WORLD_SIZE > 1:
 * CPAR_ERR_UNSUPPORTED): use cpar_spawn. */
cpar_status cpar_init_from_env(const cpar_init_config *cfg, cpar_ctx **out);

/* The launch environment as cpar_init_from_env reads it. */
typedef struct cpar_env {
    int rank, world_size;             /* RANK, WORLD_SIZE (or SLURM_PROCID, SLURM_NTASKS) */
    int local_rank, local_world_size; /* LOCAL_RANK, LOCAL_WORLD_SIZE (or SLURM_LOCALID, ...) */
    char master_addr[256];            /* MASTER_ADDR; default "127.0.0.1"; under SLURM on several
                                       * nodes the first host of SLURM_STEP_NODELIST (or
                                       * SLURM_JOB_NODELIST), e.g. "node01" of "node[01-04,07]" */
    int master_port;                  /* MASTER_PORT; default 29500 */
    int store_port;                   /* CPAR_STORE_PORT, else master_port + 1 */
    const char *source;               /* "torchrun", "slurm" or "default" (a single rank) */
    /* Where rank 0's store listens: CPAR_STORE_BIND ("*" = every interface, or
     * an address of this host), else master_addr: loopback when it resolves to
     * loopback, else the interface that owns that address. Exception: on
     * several nodes, a master_addr that resolves to loopback on rank 0 (the
     * 127.0.1.1 hostname entry of Debian's /etc/hosts) gives "*", since the
     * other nodes could not reach a loopback store. */
    char store_bind[256];
    /* The job token every rank proves to the store (see cpar_store_config):
     * CPAR_JOB_TOKEN (cparrun draws a random one per job), else torchrun's
     * TORCHELASTIC_RUN_ID unless it is "none" (torchrun --standalone draws
     * one), else SLURM_JOB_ID and SLURM_STEP_ID, else none: "" (a store then
     * refuses to start, saying to set CPAR_JOB_TOKEN; no default token that
     * any local user could present). */
    char job_token[256];
    const char *job_token_source;     /* "CPAR_JOB_TOKEN", "torchelastic", "slurm" or "none" */
} cpar_env;
/* Fill *out from the environment. Missing variables give a single-rank
 * world; inconsistent or malformed values are CPAR_ERR_INVALID naming the
 * variable (e.g. "RANK=5 is not below WORLD_SIZE=4"). A SLURM step over
 * several nodes without MASTER_ADDR and without a usable node list fails here
 * at once, saying what to set, rather than waiting out the timeout on
 * 127.0.0.1. */
cpar_status cpar_env_read(cpar_env *out);

/* Rendezvous key-value store over TCP (what cpar_init_from_env uses to share
 * NCCL unique ids). One process creates the server (it also gets a client
 * handle), the others connect. Keys are strings of at most 255 bytes, values
 * blobs of at most 1 MiB. Clients retry connecting until the deadline, then
 * check with a handshake that the peer is a cpar store (torchrun's store on
 * MASTER_PORT is refused clearly) of the same job. The server runs on its own
 * thread, rejects malformed, unknown or oversized frames by closing that
 * connection, drops a client that stalls mid-frame past the deadline, and
 * keeps serving the others. A server that goes away gives its clients
 * CPAR_ERR_PEER.
 *
 * Job token. The server admits a connection to the key space only after it
 * has shown the server's token (compared in constant time); another token is
 * refused at the handshake ("the store at H:P belongs to another job") and
 * never reads or writes a key, so two jobs that meet on one port cannot
 * exchange a key, and the NCCL unique id is only served to the job's ranks.
 * The token separates jobs; it is not a secret against someone who can read
 * a rank's environment or the traffic: it travels in clear text, and nothing
 * is encrypted.
 *
 * Limits (each violation is CPAR_ERR_INVALID naming the limit; the connection
 * stays usable): a value of at most max_value_bytes; a connection may create
 * at most max_keys_per_client keys and grow the table by at most
 * max_bytes_per_client value bytes (overwrites count the difference). At most
 * max_idle_conns connections that have not completed the handshake are held
 * at once (more wait in the kernel's backlog), and each has min(timeout, 10 s)
 * to complete it before it is dropped. */
typedef struct cpar_store cpar_store;
typedef struct cpar_store_config {
    const char *host; /* server: address to bind: NULL or "" -> 127.0.0.1 (loopback only);
                       * "*", "0.0.0.0" or "::" -> every interface; else a name or address of
                       * this host. Client: address to reach (NULL or "" -> 127.0.0.1) */
    int port;         /* required (1..65535) */
    bool is_server;
    int timeout_ms;   /* connect and wait deadline; 0 -> $CPAR_TIMEOUT_MS or 300000 */
    const char *token; /* the job token (1..255 bytes): the server's, or the one a client
                        * shows; NULL -> cpar_env_read's job_token (CPAR_JOB_TOKEN, ...) */
    /* Server only; 0 -> the default. */
    size_t max_value_bytes;      /* largest value; 0 -> 1 MiB (also the most allowed) */
    int max_keys_per_client;     /* keys one connection may create; 0 -> 65536 */
    size_t max_bytes_per_client; /* value bytes one connection may add; 0 -> 64 MiB */
    int max_idle_conns;          /* connections held before their handshake; 0 -> 256 */
} cpar_store_config;
cpar_status cpar_store_create(const cpar_store_config *cfg, cpar_store **out);
/* Server: keeps serving until the other clients disconnect, at most
 * min(timeout, 2 s), so the last rank leaving a final barrier is not cut off. */
cpar_status cpar_store_destroy(cpar_store *s);
cpar_status cpar_store_set(cpar_store *s, const char *key, const void *value, size_t len);
/* Wait until key exists (or the deadline), then copy its value: *len (may be
 * NULL) gets its size, also when it is larger than cap, which is
 * CPAR_ERR_INVALID; value may be NULL when cap is 0. */
cpar_status cpar_store_get(cpar_store *s, const char *key, void *value, size_t cap, size_t *len);
/* Atomically add delta to the integer under key (missing = 0); *result (may be
 * NULL) gets the sum. Counters are stored as decimal text ("3"). */
cpar_status cpar_store_add(cpar_store *s, const char *key, int64_t delta, int64_t *result);
/* All nranks ranks call it with the same name (at most 244 bytes; it may be
 * reused); returns when all arrived, or CPAR_ERR_TIMEOUT naming the ranks that
 * did not ("ranks 2,3 of 4 missing"). Uses the keys "<name>/count" and
 * "<name>/<rank>". */
cpar_status cpar_store_barrier(cpar_store *s, const char *name, int rank, int nranks);
/* The start of a job: every rank calls it once with its launch environment
 * (env->rank, world_size, local_rank; cpar_init_from_env does). It registers
 * (rank, world size, local rank, host, pid) and waits until all world_size
 * ranks have registered. Two ranks claiming one rank, or a world size that
 * differs from rank 0's, fail every rank waiting here with CPAR_ERR_INVALID
 * naming both parties ("rank 2 (pid 123 on host h) and rank 2 (pid 456 on
 * host h) both claim rank 2"); a rank that never comes is named at the
 * deadline ("rank 3 of 4 missing"). A process that arrives after the others
 * have all passed still fails itself with such a message. Uses keys under
 * "cpar/join/". */
cpar_status cpar_store_join(cpar_store *s, const cpar_env *env);

/* Release everything the context owns (groups, workspace, streams, comms).
 * Contexts made by cpar_spawn are finalised by cpar_spawn itself. Everything
 * is released either way; a device free the runtime refused is reported
 * (CPAR_ERR_CUDA, read with cpar_thread_last_error: the context is gone). */
cpar_status cpar_finalize(cpar_ctx *ctx);

/* Mark the job failed: every peer blocked in (or entering) a collective
 * returns CPAR_ERR_PEER; NCCL communicators are aborted. Idempotent. */
cpar_status cpar_abort(cpar_ctx *ctx);

/* Wait until all device work queued by this context is complete. */
cpar_status cpar_sync(cpar_ctx *ctx);

int cpar_rank(const cpar_ctx *ctx);        /* -1 when ctx is NULL */
int cpar_world_size(const cpar_ctx *ctx);  /* 0 when ctx is NULL */
int cpar_device(const cpar_ctx *ctx);      /* CPAR_HOST on the host backend */
cpar_backend cpar_ctx_backend(const cpar_ctx *ctx);
int cpar_timeout_ms(const cpar_ctx *ctx);
/* Change this rank's deadline (ms > 0). Every rank should use the same value. */
cpar_status cpar_set_timeout_ms(cpar_ctx *ctx, int ms);

/* ==== 4. Groups and the parallel grid ==================================== */

cpar_group *cpar_world_group(cpar_ctx *ctx);
int cpar_group_rank(const cpar_group *g);            /* -1 when g is NULL */
int cpar_group_size(const cpar_group *g);            /* 0 when g is NULL */
int cpar_group_world_rank(const cpar_group *g, int group_rank); /* -1 when out of range */
cpar_ctx *cpar_group_ctx(const cpar_group *g);

#define CPAR_SPLIT_NOCOLOR (-1)
/* Collective over parent: ranks passing the same color form a new group,
 * ordered by (key, parent rank). color == CPAR_SPLIT_NOCOLOR: *out = NULL.
 * The group belongs to the context (freed by cpar_finalize) unless destroyed
 * earlier with cpar_group_destroy (collective over the new group's members
 * is not required). On NCCL this is ncclCommSplit. */
cpar_status cpar_group_split(cpar_group *parent, int color, int key, cpar_group **out);
cpar_status cpar_group_destroy(cpar_group *g);

typedef struct cpar_grid_config {
    int tp; /* tensor-parallel size; 0 -> 1 */
    int cp; /* context-parallel size; 0 -> 1 */
    int pp; /* pipeline-parallel size; 0 -> 1 */
} cpar_grid_config;

typedef enum cpar_group_kind {
    CPAR_GROUP_WORLD = 0,
    CPAR_GROUP_TP,
    CPAR_GROUP_CP,
    CPAR_GROUP_DP,
    CPAR_GROUP_PP,
    CPAR_GROUP_TP_CP, /* ranks sharing dp and pp (tensor x context) */
    CPAR_GROUP_DP_CP, /* ranks sharing tp and pp (data x context): gradient reduction with CP */
    CPAR_GROUP_KIND_COUNT
} cpar_group_kind;

/* Collective over the world: build Megatron's groups with dp = world/(tp*cp*pp)
 * and rank = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank)). Calling it
 * again replaces the grid. Sizes that do not divide the world are
 * CPAR_ERR_INVALID with the numbers in the message. */
cpar_status cpar_grid_init(cpar_ctx *ctx, const cpar_grid_config *cfg);
cpar_group *cpar_grid_group(cpar_ctx *ctx, cpar_group_kind kind); /* NULL before cpar_grid_init */
int cpar_grid_size(const cpar_ctx *ctx, cpar_group_kind kind);    /* 0 before cpar_grid_init */
int cpar_grid_rank(const cpar_ctx *ctx, cpar_group_kind kind);    /* -1 before cpar_grid_init */

/* ==== 5. Raw collectives and communication statistics ==================== */
/* All tensors of a collective live on the context's device (tensor.device ==
 * cpar_device(ctx)) and have the same dtype. Float reductions of F16/BF16
 * accumulate in fp32. Host and device backends reduce in rank order, so results
 * are bitwise reproducible. Every call is collective over the group: each
 * member must make the same calls in the same order.
 *
 * What is checked where. Every backend checks each rank's own arguments.
 * Host and device backends also compare the members' calls before any peer's
 * buffer is read: kind (group split included), dtype, element count or
 * split sizes, op and root, and the public call a collective serves with
 * what its ranks must agree on beyond those (a mapping's direction and
 * dtype, the cross entropy's logits and target dtypes and smoothing, CP
 * attention's comm type and shapes): rank 0 in cpar_all_to_all_sp2hp(FWD)
 * and rank 1 in its BWD (the same counts) both fail. A disagreement is
 * CPAR_ERR_INVALID on every member, naming two ranks and the field (or
 * both calls). On the host and device backends (threads or processes), a
 * member whose collective call fails its own argument checks releases the
 * peers waiting for it at once (CPAR_ERR_PEER with its message). Send/receive carry the dtype and
 * element count: a receiver expecting others refuses without reading, and
 * both sides return CPAR_ERR_INVALID. On NCCL, cpar passes typed counts;
 * NCCL does not compare calls across ranks (the nccl-sim test build does),
 * and cpar adds no round trip to do it, so a disagreement there is
 * undefined as in NCCL. Ranks calling on different groups are not detected
 * by any backend: they wait until the deadline (CPAR_ERR_TIMEOUT). */

typedef enum cpar_reduce_op { CPAR_SUM = 0, CPAR_MAX, CPAR_MIN, CPAR_REDUCE_OP_COUNT } cpar_reduce_op;

/* out = op over ranks of in. out may equal in (in place). Same shape. */
cpar_status cpar_all_reduce(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_reduce_op op);

/* Concatenate every rank's in along dim 0 into out. sizes == NULL: every rank
 * has in.shape[0] rows and out.shape[0] = size * in.shape[0]. Otherwise
 * sizes[r] (r < group size) gives rank r's rows: in.shape[0] == sizes[rank] and
 * out.shape[0] == sum(sizes). Other dims equal. */
cpar_status cpar_all_gather(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, const int64_t *sizes);

/* Reduce every rank's in and keep this rank's slice of dim 0 in out. sizes ==
 * NULL: in.shape[0] divisible by the group size; out.shape[0] = in.shape[0]/size.
 * Otherwise out.shape[0] == sizes[rank] and in.shape[0] == sum(sizes). */
cpar_status cpar_reduce_scatter(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_reduce_op op,
                                const int64_t *sizes);

/* PyTorch's all_to_all_single on dim 0: the in_splits[j] rows starting at
 * sum(in_splits[:j]) go to rank j, which stores them at its out row offset
 * sum(out_splits[:i]) for source i. NULL splits: dim 0 divided equally. */
cpar_status cpar_all_to_all_single(cpar_group *g, const cpar_tensor *in, cpar_tensor *out,
                                   const int64_t *out_splits, const int64_t *in_splits);

/* buf on group rank root is copied into buf on every other rank. */
cpar_status cpar_broadcast(cpar_group *g, cpar_tensor *buf, int root);

/* Send send to group rank send_to and receive recv from group rank recv_from,
 * together (deadlock free for any permutation). Either half may be omitted
 * with a NULL tensor / -1 rank. Sizes and dtypes must match the peer's. */
cpar_status cpar_sendrecv(cpar_group *g, const cpar_tensor *send, int send_to, cpar_tensor *recv, int recv_from);
cpar_status cpar_send(cpar_group *g, const cpar_tensor *t, int to);
cpar_status cpar_recv(cpar_group *g, cpar_tensor *t, int from);
/* Ring shift: out on rank r receives in from rank (r - shift) mod size
 * (shift = +1: pass to the next rank). out may not equal in. */
cpar_status cpar_ring_shift(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, int shift);

cpar_status cpar_barrier(cpar_group *g);

typedef enum cpar_coll_kind {
    CPAR_COLL_ALL_REDUCE = 0,
    CPAR_COLL_ALL_GATHER,
    CPAR_COLL_REDUCE_SCATTER,
    CPAR_COLL_ALL_TO_ALL,
    CPAR_COLL_BROADCAST,
    CPAR_COLL_SEND_RECV,
    CPAR_COLL_BARRIER,
    CPAR_COLL_KIND_COUNT
} cpar_coll_kind;

const char *cpar_coll_kind_name(cpar_coll_kind k); /* "all_reduce", ... */

/* Per group and kind: calls made and payload bytes this rank sent to / received
 * from other ranks, counted at the algorithm's minimum (what any algorithm
 * must move), independent of the backend's actual schedule:
 *   all-reduce of N bytes over n ranks, chunk c_r = rank r's even share of the
 *     elements: sent = recv = (N - c_r) + (n-1)*c_r (= 2N(n-1)/n when n | N);
 *   all-gather: sent = own*(n-1), recv = total - own;
 *   reduce-scatter: sent = N - own, recv = own*(n-1);
 *   all-to-all: bytes addressed to / from other ranks;
 *   broadcast of N bytes: root sent N*(n-1), others recv N;
 *   send/recv: the bytes; barrier: calls only. A group of size 1 moves 0. */
typedef struct cpar_comm_counter {
    uint64_t calls;
    uint64_t bytes_sent;
    uint64_t bytes_recv;
} cpar_comm_counter;

typedef struct cpar_comm_stats {
    cpar_comm_counter kind[CPAR_COLL_KIND_COUNT];
} cpar_comm_stats;

/* A cp group's statistics include the groups a2a+p2p attention split from it
 * (cpar_cp_comm_type); reset clears theirs too. */
cpar_status cpar_group_stats(const cpar_group *g, cpar_comm_stats *out);
cpar_status cpar_group_stats_reset(cpar_group *g);

/* ==== 6. Element-wise and layout operations ============================== */
/* Each runs the host reference on host tensors and a CUDA kernel on device
 * tensors (the sim build runs the same kernels on the CPU). Stream-ordered on
 * the context's compute stream. */

/* Every element of t = value (converted to t's dtype). */
cpar_status cpar_fill(cpar_ctx *ctx, cpar_tensor *t, double value);
/* dst = (dst.dtype) src, between F32, F16 and BF16 (and identical dtypes). */
cpar_status cpar_cast(cpar_ctx *ctx, const cpar_tensor *src, cpar_tensor *dst);
/* y = alpha * x + beta * y (fp32 arithmetic), F32/F16/BF16, same dtype and numel. */
cpar_status cpar_axpby(cpar_ctx *ctx, float alpha, const cpar_tensor *x, float beta, cpar_tensor *y);

/* Cut in along dimension dim into n pieces out[i] (shapes equal to in except
 * at dim, whose sizes sum to in.shape[dim]). Negative dim counts from the end. */
cpar_status cpar_split(cpar_ctx *ctx, const cpar_tensor *in, int dim, int n, cpar_tensor *const *out);
/* Inverse of cpar_split: out = concatenation of in[0..n) along dim. */
cpar_status cpar_concat(cpar_ctx *ctx, cpar_tensor *const *in, int n, int dim, cpar_tensor *out);

typedef enum cpar_row_op { CPAR_ROW_SUM = 0, CPAR_ROW_MAX, CPAR_ROW_LOGSUMEXP } cpar_row_op;
/* Reduce the last dimension: in [..., c] (F32/F16/BF16) -> out F32 [...]
 * (numel(out) == numel(in)/c). Accumulates in fp32. */
cpar_status cpar_row_reduce(cpar_ctx *ctx, const cpar_tensor *in, cpar_row_op op, cpar_tensor *out);

/* GeLU, tanh approximation (Megatron's fused bias_gelu without the bias;
 * PyTorch's F.gelu(approximate="tanh")), fp32 math:
 *   y = 0.5 x (1 + tanh(0.79788456 x (1 + 0.044715 x^2))).
 * x, y: F32/F16/BF16, the same dtype and numel, both on the host or both on
 * the context's device; y may be x. */
cpar_status cpar_gelu_forward(cpar_ctx *ctx, const cpar_tensor *x, cpar_tensor *y);
/* dx = dy * gelu'(x) with forward's x; dy and dx like x; dx may be dy. */
cpar_status cpar_gelu_backward(cpar_ctx *ctx, const cpar_tensor *x, const cpar_tensor *dy, cpar_tensor *dx);

/* ==== 7. Devices ==========================================================
 * The device layer cpar runs on (cpar_kernels.cu: memory, streams, kernels)
 * is internal (§16, compiled only under CPAR_INTERNAL); this is what a
 * program needs to know about devices. */

/* Number of GPUs this process can use: 0 in a build without CUDA, and 0
 * (not a failure) where there is no driver or no device; CUDA's devices up
 * to the first below compute capability 8.0 (a T4, a V100: the kernels need
 * sm_80), so 0 there too, cpar_dev_last_error() saying why. Use it to choose
 * how many ranks to run with CPAR_BACKEND_NCCL (CPAR_BACKEND_DEVICE runs any
 * number of ranks on them). */
int cpar_device_count(void);

/* Page-locked ("pinned") host memory on ctx's GPU, as torch's pin_memory:
 * copies between it and the device run at full bus speed. Wrap it in a host
 * tensor (cpar_tensor_make(p, dtype, ndim, shape, CPAR_HOST)); cpar treats
 * it as host memory: a copy into it is complete when the call returns, a
 * copy from it (cpar_tensor_copy) is asynchronous until cpar_sync, and the
 * layers' init_from_master calls have read it when they return. On a context
 * without a device it is plain host memory (64-byte aligned). Free it with
 * cpar_pinned_free on the same context. Both wait for the rank's queued
 * work first (pinning, like cudaMalloc, can stall a device's launches). */
cpar_status cpar_pinned_alloc(cpar_ctx *ctx, size_t bytes, void **out);
cpar_status cpar_pinned_free(cpar_ctx *ctx, void *p);

/* ==== 8. Tensor-parallel mappings and utilities ========================== */
/* Megatron's region mappings (megatron/core/tensor_parallel/mappings.py): one
 * function per autograd Function. dir == CPAR_FWD runs the seed's forward on
 * the activation, CPAR_BWD the seed's backward on the gradient (pass the same
 * group and split sizes as the forward). In the table n is the group size and
 * r this rank's group rank; "[..., H]" keeps every leading dimension.
 *
 *   function                                  CPAR_FWD                  CPAR_BWD
 *   cpar_copy_to_tp_region                    identity                  all-reduce
 *   cpar_reduce_from_tp_region                all-reduce                identity
 *   cpar_scatter_to_tp_region                 split last dim            all-gather last dim
 *   cpar_gather_from_tp_region                all-gather last dim       split last dim
 *   cpar_scatter_to_sp_region                 split first dim           all-gather first dim
 *   cpar_gather_from_sp_region                all-gather first dim      reduce-scatter first dim
 *                                                                       (split when !tp_output_grad)
 *   cpar_reduce_scatter_to_sp_region          reduce-scatter first dim  all-gather first dim
 *   cpar_all_gather_last_dim_from_tp_region   all-gather last dim       reduce-scatter last dim
 *   cpar_reduce_scatter_last_dim_to_tp_region reduce-scatter last dim   all-gather last dim
 *   cpar_all_to_all                           all-to-all(v) on dim 0    the same, splits swapped
 *   cpar_all_to_all_sp2hp                     [T/n, H] -> [T, H/n]      [T, H/n] -> [T/n, H]
 *   cpar_all_to_all_hp2sp                     [T, H/n] -> [T/n, H]      [T/n, H] -> [T, H/n]
 *
 * Shapes (out is preallocated by the caller and checked):
 *   split last dim     in [..., H] -> out [..., H/n], columns [r*H/n, (r+1)*H/n)
 *   all-gather last    in [..., h] -> out [..., n*h], rank j's in in columns [j*h, (j+1)*h)
 *   reduce-scatter last in [..., H] -> out [..., H/n], sum over ranks of columns [r*H/n, ...)
 *   split first dim    in [R, ...] -> out [R/n, ...] (or split_sizes[r] rows at sum(split_sizes[:r]))
 *   all-gather first   in [R, ...] -> out [n*R, ...] (or sum(split_sizes) rows)
 *   reduce-scatter first in [R, ...] -> out [R/n, ...] (or split_sizes[r] rows)
 * The last-dim collectives follow the seed's layout: the all-gather gathers
 * along dim 0 into workspace and concatenates the n chunks along the last dim;
 * the reduce-scatter stacks the n column chunks along dim 0 in workspace and
 * reduce-scatters that.
 *
 * Rules shared by every mapping:
 *  - in and out: contiguous, at least 1 dimension, on the context's device
 *    (cpar_device(cpar_group_ctx(g))), the same dtype. Data movement takes any
 *    dtype; reductions sum F32/F16/BF16 (fp32 accumulation), I32 and I64.
 *  - out may equal in (the same data pointer) where the shapes are equal: the
 *    identity and all-reduce directions, every mapping on a group of size 1,
 *    and cpar_all_to_all with out shaped like in (staged through the
 *    workspace). Any other overlap of out and in is CPAR_ERR_INVALID.
 *  - A group of size 1 copies in to out (nothing when out == in) and
 *    communicates nothing, as the seed bypasses it.
 *  - Collective over g (except the identity and split directions, which are
 *    local): every member calls with matching shapes. Bytes moved are the
 *    collective's minimum (see cpar_comm_stats); temporaries come from the
 *    context workspace, so after warm-up nothing is allocated.
 *  - Bad arguments (NULL, dtype, shape, device, divisibility, dir, split sizes)
 *    are CPAR_ERR_INVALID with one line naming the function and the argument,
 *    detected before any communication. */

typedef enum cpar_dir {
    CPAR_FWD = 0, /* the seed's forward, on the activation */
    CPAR_BWD      /* the seed's backward, on the gradient */
} cpar_dir;

cpar_status cpar_copy_to_tp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir);
cpar_status cpar_reduce_from_tp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir);
cpar_status cpar_scatter_to_tp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir);
cpar_status cpar_gather_from_tp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir);
cpar_status cpar_scatter_to_sp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir);

/* Megatron's gather_from_sequence_parallel_region(tensor_parallel_output_grad,
 * output_split_sizes). split_sizes (n entries, or NULL for equal rows): rank
 * j's rows; in has split_sizes[r] rows and out their sum (forward). Backward:
 * reduce-scatter of the gradient [sum, ...] to [split_sizes[r], ...] when
 * tp_output_grad, else this rank's rows are cut out of it (no communication;
 * Megatron asserts split_sizes is None there, cpar takes the uneven rows).
 * tp_output_grad is ignored in the forward. */
cpar_status cpar_gather_from_sp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir,
                                       bool tp_output_grad, const int64_t *split_sizes);

/* Megatron's reduce_scatter_to_sequence_parallel_region(input_split_sizes):
 * forward in [sum(split_sizes), ...] -> out [split_sizes[r], ...] (NULL: equal
 * rows, in.shape[0] divisible by n); backward all-gathers with the same sizes. */
cpar_status cpar_reduce_scatter_to_sp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir,
                                             const int64_t *split_sizes);

cpar_status cpar_all_gather_last_dim_from_tp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out,
                                                    cpar_dir dir);
cpar_status cpar_reduce_scatter_last_dim_to_tp_region(cpar_group *g, const cpar_tensor *in, cpar_tensor *out,
                                                      cpar_dir dir);

/* Megatron's all_to_all(group, input, output_split_sizes, input_split_sizes):
 * torch's all_to_all_single on dim 0 (see cpar_all_to_all_single). Forward:
 * the in_splits[j] rows starting at sum(in_splits[:j]) go to rank j; out has
 * sum(out_splits) rows, the out_splits[i] received from rank i in rank order.
 * NULL splits: equal rows (dim 0 divisible by n; a NULL out_splits means out
 * has in's rows, as torch's empty_like). Backward: pass the forward's splits
 * unchanged; the gradient [sum(out_splits), ...] goes back to
 * [sum(in_splits), ...] with the splits swapped. */
cpar_status cpar_all_to_all(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir,
                            const int64_t *out_splits, const int64_t *in_splits);

/* Megatron's all_to_all_sp2hp: in [..., H] is read as [T/n, H] (T/n = numel/H
 * tokens of this rank's sequence shard, H divisible by n); out is [T, H/n]:
 * every rank's tokens in rank order, columns [r*H/n, (r+1)*H/n). Seed layout:
 * the H/n column chunks of in are stacked along dim 0 ([n*T/n, H/n]), then an
 * equal all-to-all. out's last dim must be H/n and its leading dims multiply
 * to T (e.g. [T, H/n] or [s, b, H/n]). Backward: hp2sp of the gradient. */
cpar_status cpar_all_to_all_sp2hp(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir);
/* Megatron's all_to_all_hp2sp, the inverse: in [..., h] read as [T, h] (T
 * divisible by n) -> out [T/n, n*h] (leading dims multiplying to T/n): an
 * equal all-to-all, then the n received [T/n, h] blocks concatenated along the
 * last dim. Backward: sp2hp of the gradient. */
cpar_status cpar_all_to_all_hp2sp(cpar_group *g, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir);

/* ---- Utilities (megatron/core/tensor_parallel/utils.py, megatron.core.utils) ---- */

/* *out = num / den; CPAR_ERR_INVALID unless den divides num
 * ("cpar_divide: 10 is not divisible by 4"), for den == 0, and for
 * INT64_MIN / -1 (not an int64). Defined for every pair. Megatron's divide(). */
cpar_status cpar_divide(int64_t num, int64_t den, int64_t *out);

/* VocabUtility.vocab_range_from_global_vocab_size: rank's half-open slice
 * [*first, *last) of a vocabulary of global_vocab entries split evenly over
 * world ranks; a global_vocab not divisible by world is CPAR_ERR_INVALID
 * naming both numbers. */
cpar_status cpar_vocab_range(int64_t global_vocab, int rank, int world, int64_t *first, int64_t *last);

/* Megatron's _vocab_size_with_padding: vocab rounded up to a multiple of
 * multiple * tp (make_vocab_size_divisible_by x tensor-parallel size), so every
 * TP rank gets an equal, aligned slice. vocab >= 0, multiple >= 1, tp >= 1. */
cpar_status cpar_pad_vocab_size(int64_t vocab, int64_t multiple, int tp, int64_t *out);

/* split_tensor_along_last_dim(t, n)[i] as a view, no copy: *view aliases t's
 * memory, starting at chunk i of the first row, with shape [..., L/n] where L
 * is t's last dim (divisible by n); *row_stride (may be NULL) gets L, the
 * element distance between consecutive rows of the view. Such a view is a
 * plain contiguous tensor, usable by every cpar function, only when the outer
 * dims multiply to at most 1 (or n == 1); otherwise it is for strided
 * consumers that take a leading dimension, such as GEMMs (lda = row_stride).
 * cpar_split copies the chunks into contiguous tensors instead. */
cpar_status cpar_split_last_dim_view(const cpar_tensor *t, int n, int i, cpar_tensor *view, int64_t *row_stride);
/* Chunk i of n along dim 0 as a contiguous view (rows divisible by n). */
cpar_status cpar_split_first_dim_view(const cpar_tensor *t, int n, int i, cpar_tensor *view);

/* ---- broadcast_data (megatron/core/tensor_parallel/data.py) ---- */

#define CPAR_BROADCAST_MAX_DIMS 5 /* the seed's _MAX_DATA_DIM */

/* Megatron's broadcast_data(keys, data, datatype): group rank 0 of tp holds
 * nkeys tensors in[0..nkeys) (host or the context's device, each of dtype
 * dtype, at most CPAR_BROADCAST_MAX_DIMS dims; zero-sized dims and scalars
 * are fine); the other ranks pass in = NULL (ignored there). On return every
 * rank, rank 0 included, has out[i] allocated with cpar_tensor_alloc on the
 * context's device, with key i's shape and values (free each with
 * cpar_tensor_free). keys name the tensors in messages; every rank passes the
 * same nkeys, keys and dtype. Two broadcasts, as the seed: the shapes (one I64
 * tensor of 2 + 5*nkeys: a status word, the index of a rejected key, then 5
 * dims per key, unused ones -1), then all the data flattened and concatenated
 * in key order in one broadcast of dtype. When rank 0 rejects its input
 * (wrong dtype, too many dims, NULL) it still sends the shapes with the status
 * set and returns CPAR_ERR_INVALID naming the key; the other ranks return
 * CPAR_ERR_PEER instead of waiting. On failure out[i].data is NULL. */
cpar_status cpar_broadcast_data(cpar_group *tp, int nkeys, const char *const *keys, const cpar_tensor *in,
                                cpar_dtype dtype, cpar_tensor *out);

/* ==== 9. RNG, dropout and activation checkpointing ======================
 * Megatron's CudaRNGStatesTracker, model_parallel_cuda_manual_seed,
 * dropout, checkpoint / CheckpointWithoutOutput and the 1-D activation
 * split/gather of distribute_saved_activations (seed 001, random.py and
 * utils.py), with a counter-based generator so the host and the GPU draw
 * the same numbers from the same state.
 *
 * Generator: Philox4x32-10 (Salmon et al., SC'11; curand's and PyTorch's
 * constants). A state is (seed, offset). Element i of a draw from state s
 * is word i % 4 of
 *     philox(counter = {lo32(c), hi32(c), 0, 0}, key = {lo32(s.seed), hi32(s.seed)}),
 *     c = s.offset + i / 4,
 * and a draw of n elements advances s.offset by ceil(n / 4). (These are the
 * words curand's Philox4_32_10 gives for that seed, subsequence 0 and
 * offset 4c.) From a 32-bit word w:
 *     uniform u  = (w >> 8) * 2^-24                          in [0, 1)
 *     normal     = Box-Muller on the words of pairs (i, i ^ 1):
 *                  u1 = ((w_even >> 8) + 1) * 2^-24 in (0, 1], u2 from w_odd,
 *                  r = sqrt(-2 ln u1); element even = r cos(2 pi u2),
 *                  element odd = r sin(2 pi u2).
 * ln, cos and sin are cpar's own few-ulp polynomials written with explicit
 * fused multiply-adds and correctly rounded operations, so the host
 * reference, the simulator and real GPUs agree bit for bit for every op of
 * this section (uniform, normal, dropout masks and outputs).
 *
 * The tracker (one per context, like torch's default CUDA generator plus
 * Megatron's tracker): a "current" state, which every draw uses and
 * advances, plus up to CPAR_RNG_MAX_STATES named states. Before any seeding
 * the current state is (CPAR_RNG_DEFAULT_SEED, 0) and there are no named
 * states. Draws are stream-ordered like every other op; the state update is
 * a host-side counter, so snapshots are cheap and never synchronise. */

#define CPAR_RNG_MAX_STATES 16     /* named states per tracker */
#define CPAR_RNG_NAME_MAX 64       /* bytes of a name including its NUL: names of 1..63 chars */
#define CPAR_RNG_MAX_FORK_DEPTH 8  /* nested cpar_rng_fork calls */
#define CPAR_RNG_DEFAULT_SEED 67280421310721ull /* torch's default CUDA seed */

/* Megatron's tracker names (set by cpar_model_parallel_manual_seed). */
#define CPAR_RNG_DATA_PARALLEL "data-parallel-rng"
#define CPAR_RNG_MODEL_PARALLEL "model-parallel-rng"
#define CPAR_RNG_EXPERT_PARALLEL "expert-parallel-rng"

typedef struct cpar_rng_state {
    uint64_t seed;   /* Philox key */
    uint64_t offset; /* next unused 128-bit Philox block (4 words) */
} cpar_rng_state;

/* Every state of a tracker: Megatron's _get_all_rng_states (the default
 * generator's state and the tracker's dictionary). Plain data: copy it,
 * store it, compare it. */
typedef struct cpar_rng_snapshot {
    cpar_rng_state current;
    int count;                                          /* named states in use, 0..CPAR_RNG_MAX_STATES */
    char names[CPAR_RNG_MAX_STATES][CPAR_RNG_NAME_MAX]; /* in the order they were added */
    cpar_rng_state states[CPAR_RNG_MAX_STATES];         /* states[i] belongs to names[i] */
} cpar_rng_snapshot;

/* The raw Philox4x32-10 block function in Random123's word order:
 * counter[0] and key[0] are the least significant words. E.g. counter
 * {0,0,0,0}, key {0,0} gives {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}. */
void cpar_philox4x32_10_block(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);
/* The block that elements 4c..4c+3 of a draw from (seed, offset = c) use:
 * counter {lo32(c), hi32(c), 0, 0}, key {lo32(seed), hi32(seed)}. */
void cpar_philox4x32_10(uint64_t seed, uint64_t counter, uint32_t out[4]);

/* ---- the tracker (CudaRNGStatesTracker) ---------------------------------
 * Errors are CPAR_ERR_INVALID (bad argument, unknown or duplicate name,
 * duplicate seed, fork depth) or CPAR_ERR_OOM (the tracker's first use
 * allocates it). */

/* torch.cuda.manual_seed: current = (seed, 0). Named states are kept. */
cpar_status cpar_rng_manual_seed(cpar_ctx *ctx, uint64_t seed);
/* Forget every named state (the current state is kept), as tracker.reset(). */
cpar_status cpar_rng_reset(cpar_ctx *ctx);
/* tracker.add(name, seed): a new named state (seed, 0). Errors, checked in
 * the seed's order: "seed 1234 already exists" when a named state has that
 * seed, "name \"x\" already exists", a name that is NULL, empty or longer
 * than 63 chars, or a full tracker. The current state is not touched. */
cpar_status cpar_rng_add(cpar_ctx *ctx, const char *name, uint64_t seed);
/* tracker.fork(name) as two calls: fork pushes the current state and makes
 * the named state current; unfork stores the current state back into that
 * named state (re-adding it if cpar_rng_reset/set_states removed it meanwhile,
 * as the seed's dictionary assignment does) and pops the pushed state back
 * into current. Forks nest up to CPAR_RNG_MAX_FORK_DEPTH. Forking an unknown
 * name, forking too deep and unforking with no fork open are errors.
 * Nested forks follow Megatron HEAD rather than the seed: forking saves the
 * open fork's in-flight state under its name first, and unforking back into
 * it resumes from that name's state, so fork(a) { fork(b) { fork(a) } }
 * draws one continuous sequence from a (the seed restarts the inner fork of
 * a from a's stored state and repeats its draws). */
cpar_status cpar_rng_fork(cpar_ctx *ctx, const char *name);
cpar_status cpar_rng_unfork(cpar_ctx *ctx);
/* Read or replace one state: name NULL means the current state. */
cpar_status cpar_rng_get_state(cpar_ctx *ctx, const char *name, cpar_rng_state *out);
cpar_status cpar_rng_set_state(cpar_ctx *ctx, const char *name, const cpar_rng_state *state);
/* The Philox state for a consumer that draws its numbers itself (a fused
 * kernel: attention dropout, §12): *used = the current state, whose offset
 * then advances by `blocks` (128-bit Philox blocks per subsequence), as
 * PyTorch's generator hands a fused kernel (seed, offset) and advances its
 * offset (philox_cuda_state(increment)). Draws after it never reuse those
 * offsets; under a fork the forked state advances. blocks may be 0; blocks
 * that would wrap the offset past 2^64 (a state set far along its stream)
 * are CPAR_ERR_INVALID and advance nothing. */
cpar_status cpar_rng_reserve(cpar_ctx *ctx, uint64_t blocks, cpar_rng_state *used);
/* _get_all_rng_states / _set_all_rng_states: every state at once. set_states
 * replaces the current state and the whole set of named states with the
 * snapshot's (validated: count in range, names 1..63 chars, NUL-terminated,
 * distinct); open forks stay open. Duplicate-seed checks of later adds see
 * the snapshot's seeds (the seed's separate seeds_ set is not kept). */
cpar_status cpar_rng_get_states(cpar_ctx *ctx, cpar_rng_snapshot *out);
cpar_status cpar_rng_set_states(cpar_ctx *ctx, const cpar_rng_snapshot *snapshot);

/* model_parallel_cuda_manual_seed: reset the tracker, current = (seed, 0),
 * then add CPAR_RNG_DATA_PARALLEL = seed, CPAR_RNG_MODEL_PARALLEL =
 * seed + 2718 + tp_rank and CPAR_RNG_EXPERT_PARALLEL = seed + 1024 +
 * 100 * ep_rank + etp_rank (mod 2^64). tp_rank < 0: the context's grid TP
 * rank (cpar_grid_rank(ctx, CPAR_GROUP_TP)), or 0 before cpar_grid_init;
 * ep_rank, etp_rank < 0: 0 (cpar has no expert grid yet). Seeds that collide
 * are the add error. */
cpar_status cpar_model_parallel_manual_seed(cpar_ctx *ctx, uint64_t seed, int tp_rank, int ep_rank, int etp_rank);

/* ---- random fills (from the current state, advancing it) -----------------
 * t: F32, F16 or BF16, on the host or the context's device (host loop or one
 * kernel). Values are computed in fp32 and rounded to t's dtype. */

/* t = lo + (hi - lo) * u, u uniform in [0, 1) (one fmaf), in [lo, hi) in
 * fp32 (a value that rounds up to hi becomes lo); after rounding to F16/BF16
 * a value may equal hi. Needs finite lo <= hi with hi - lo finite. */
cpar_status cpar_rng_uniform(cpar_ctx *ctx, cpar_tensor *t, float lo, float hi);
/* t = mean + std * z, z standard normal (Box-Muller, above). Needs finite
 * mean and std >= 0. */
cpar_status cpar_rng_normal(cpar_ctx *ctx, cpar_tensor *t, float mean, float std);

/* ---- dropout ---------------------------------------------------------------
 * x, y (and dy, dx): same float dtype and element count, on the host or the
 * context's device, all on the same one; mask: U8 with the same element
 * count there too (1 = kept, 0 = dropped). Element i is kept when its uniform
 * u_i >= p (a draw of numel(x) elements from the state), and
 *     y = (x * keep) * scale,  scale = 1 / (1 - p) in fp32,
 * exactly PyTorch's fused dropout expression, so a dropped inf/NaN gives NaN
 * as it does there. p in [0, 1); p == 0 copies x (mask all ones) and draws
 * nothing. One kernel launch per call. */

/* Draws from the current state and advances it by ceil(numel / 4). y may
 * equal x (in place; no other overlap). mask may be NULL (not stored: use
 * the state to recompute); *used (may be NULL) receives the state the draw
 * used, which cpar_dropout_backward can regenerate the decisions from. */
cpar_status cpar_dropout_forward(cpar_ctx *ctx, float p, const cpar_tensor *x, cpar_tensor *y, cpar_tensor *mask,
                                 cpar_rng_state *used);
/* dx = (dy * keep) * scale. keep from mask when it is given, else
 * regenerated from *state (the forward's *used): no mask memory, same bits.
 * dx may equal dy. The tracker is not touched. */
cpar_status cpar_dropout_backward(cpar_ctx *ctx, float p, const cpar_tensor *dy, cpar_tensor *dx,
                                  const cpar_tensor *mask, const cpar_rng_state *state);

/* ---- activation checkpointing --------------------------------------------
 * checkpoint(fn, distribute_saved_activations, *args) in C: the caller owns
 * a zero-initialised cpar_checkpoint and its inputs.
 *   forward:   cpar_checkpoint_forward(ctx, &ck, fn, arg) records every RNG
 *              state (the snapshot) and runs fn(ctx, arg);
 *              optionally cpar_checkpoint_distribute(ctx, &ck, tp, input)
 *              keeps only this rank's 1/size of the saved input (the caller
 *              may then reuse the input's memory);
 *   backward:  cpar_checkpoint_gather(ctx, &ck, tp, input) refills the
 *              input; cpar_checkpoint_recompute(ctx, &ck, fn, arg) saves the
 *              tracker, restores the recorded states, runs fn again (same
 *              dropout masks, bit for bit) and restores the saved tracker
 *              (the seed's _fork_rng), then the caller runs its backward;
 *   finally:   cpar_checkpoint_release(ctx, &ck) frees the chunk buffer (the
 *              struct may be reused for the next step without releasing:
 *              the buffer is kept and reused when large enough).
 * CheckpointWithoutOutput maps onto the same calls: run fn under
 * cpar_checkpoint_forward, then free or reuse the output's storage; before
 * the backward that needs it, reallocate it (same shape, anywhere fn writes
 * it) and call cpar_checkpoint_recompute, which refills it. No extra API:
 * C has no storage-resize hooks, fn simply writes its outputs again. */

typedef cpar_status (*cpar_checkpoint_fn)(cpar_ctx *ctx, void *arg);

typedef struct cpar_checkpoint {
    /* Private: read through the functions below; zero-initialise. */
    cpar_rng_snapshot rng;   /* states recorded by cpar_checkpoint_forward */
    int fork_depth;          /* forks open at cpar_checkpoint_forward, innermost last */
    char forks[CPAR_RNG_MAX_FORK_DEPTH][CPAR_RNG_NAME_MAX];
    bool recorded;           /* cpar_checkpoint_forward ran */
    bool distributed;        /* the input lives only as chunks until cpar_checkpoint_gather */
    void *chunk;             /* this rank's chunk, on chunk_device (owned) */
    size_t chunk_cap;        /* bytes allocated at chunk */
    int chunk_device;
    cpar_dtype dtype;        /* of the distributed input */
    int64_t numel;           /* of the distributed input */
    int group_size;          /* of the distributing group */
} cpar_checkpoint;

/* Record the RNG snapshot, then return fn(ctx, arg). */
cpar_status cpar_checkpoint_forward(cpar_ctx *ctx, cpar_checkpoint *ck, cpar_checkpoint_fn fn, void *arg);
/* Run fn(ctx, arg) under the recorded states; afterwards every RNG state and
 * open fork of the tracker is what it was before the call (also when fn
 * fails, whose status is returned). Needs a prior cpar_checkpoint_forward,
 * and cpar_checkpoint_gather after a distribute. */
cpar_status cpar_checkpoint_recompute(cpar_ctx *ctx, cpar_checkpoint *ck, cpar_checkpoint_fn fn, void *arg);
/* Keep this rank's chunk (cpar_split_1d_chunk) of activation in ck's buffer
 * (allocated on the context's device once and reused). Collective-free; g is
 * the group the chunks are gathered over (the seed's TP group). */
cpar_status cpar_checkpoint_distribute(cpar_ctx *ctx, cpar_checkpoint *ck, cpar_group *g,
                                       const cpar_tensor *activation);
/* All-gather the chunks over g into activation (same dtype and element count
 * as distributed, any shape). Collective over g. */
cpar_status cpar_checkpoint_gather(cpar_ctx *ctx, cpar_checkpoint *ck, cpar_group *g, cpar_tensor *activation);
/* Free ck's buffer and clear it (zero state). NULL-safe on a zeroed ck. */
cpar_status cpar_checkpoint_release(cpar_ctx *ctx, cpar_checkpoint *ck);

/* split_tensor_into_1d_equal_chunks: out = elements [r*m, (r+1)*m) of the
 * flattened in, m = numel(in) / size, r = the group rank. numel(in) must be
 * divisible by the group size; out has m elements (any shape), in's dtype,
 * and both live on the group's context device. Local copy, no communication. */
cpar_status cpar_split_1d_chunk(cpar_group *g, const cpar_tensor *in, cpar_tensor *out);
/* gather_split_1d_tensor: out (any shape, size * numel(chunk) elements,
 * chunk's dtype, not overlapping chunk) = the ranks' chunks in rank order.
 * Collective over g (an all-gather). */
cpar_status cpar_gather_1d_chunks(cpar_group *g, const cpar_tensor *chunk, cpar_tensor *out);


/* ==== 10. Vocabulary-parallel embedding and cross entropy =============== */
/* ---- vocabulary-parallel cross entropy (Megatron's vocab_parallel_cross_entropy, seed 001) ----
 *
 * The vocabulary is split evenly over the tensor-parallel group tp: rank r of
 * tp (size P) holds logits for the vocabulary entries [r*v_local, (r+1)*v_local)
 * of a global vocabulary V = P * v_local. Every tensor lives on the context's
 * device (host memory on the host backend). The token layout is free (any
 * leading shape, [s, b] in Megatron); every TP rank passes the same target.
 *
 * Loss of a token with logits z (global) and target t:
 *     lse  = log(sum_j exp(z_j))                        (over the global vocab)
 *     loss = lse - z_t                                  (label_smoothing == 0)
 *     loss = (1 - s) (lse - z_t) - s mean_j(z_j - lse)  with s = a V / (V - 1)
 * for label_smoothing a in [0, 1): the global mean over all V entries, so the
 * loss is identical on every rank and equals the tp = 1 loss (the seed's local
 * mean differs between ranks, Megatron issues #7452/#7464). Log-probabilities
 * are formed as z - lse, never log(softmax): a probability that underflows
 * leaves the loss finite. All arithmetic accumulates in fp32 (on the host
 * path, runs of 8 fp32 terms added in fp64).
 *
 * Target values outside [0, V): on host tensors CPAR_ERR_INVALID naming
 * target (checked before any communication, so every rank of tp fails the
 * same way). On device tensors the values are not inspected by the host (that
 * would need a synchronisation); such a token's loss is NaN on every rank and
 * its dlogits row is NaN, so a bad label shows up instead of silently training
 * towards nothing.
 *
 * Communication (forward only; backward needs none): an all-reduce MAX of
 * [tokens] floats (the global max), then one all-reduce SUM of [2, tokens]
 * floats (exp-sum rescaled to the global max, and the target's logit), or
 * [3, tokens] with label smoothing (plus the sum of the logits). The logits
 * are read once: each rank computes its local max and local exp-sum in one
 * pass (online softmax) and rescales the exp-sum after the MAX. */

/* logits: [..., v_local] F32/F16/BF16 (this rank's vocabulary slice);
 * target: [...] I32 or I64, global vocabulary indices; loss: [...] F32 out;
 * stats: [..., 2] F32 out, per token (global max, global log-sum-exp): all
 * that backward needs (no fp32 copy of the logits is kept). Scratch comes
 * from the context workspace. */
cpar_status cpar_vocab_parallel_cross_entropy_forward(cpar_group *tp, const cpar_tensor *logits,
                                                      const cpar_tensor *target, float label_smoothing,
                                                      cpar_tensor *loss, cpar_tensor *stats);

/* dlogits = (softmax(z) - (1 - s) onehot(t) - s / V) * dloss on this rank's
 * vocabulary slice, with softmax = exp(z - lse) from forward's stats. logits
 * and target as in forward (the same values), stats forward's output, dloss
 * [...] F32; dlogits has logits' shape and dtype and may equal logits (in
 * place, as the seed writes the gradient into the logits buffer). No
 * communication. */
cpar_status cpar_vocab_parallel_cross_entropy_backward(cpar_group *tp, const cpar_tensor *logits,
                                                       const cpar_tensor *target, float label_smoothing,
                                                       const cpar_tensor *stats, const cpar_tensor *dloss,
                                                       cpar_tensor *dlogits);


/* ---- vocabulary-parallel embedding (Megatron's VocabParallelEmbedding, seed 001) ----
 * weight: this rank's rows [v_local, H] (F32/F16/BF16) of a global table of
 * V = tp * v_local rows; rank r owns ids [r v_local, (r+1) v_local). ids:
 * [b, s] I32/I64, the same on every rank of tp. Ids outside [0, V): on host
 * tensors CPAR_ERR_INVALID naming ids; on device tensors (not inspected by
 * the host) they select no rank's rows, so their embedding is a zero row and
 * they get no gradient.
 *
 * Forward: masked lookup of the local range (other ids give zero rows), then
 *  - reduce_scatter_embeddings == false: all-reduce SUM -> out [b, s, H];
 *  - true (sequence parallelism): the partial [b, s, H] is transposed to
 *    [s, b, H] and reduce-scattered along s -> out [s/tp, b, H] (s must be
 *    divisible by tp, else CPAR_ERR_INVALID naming both).
 * out has weight's dtype. Scratch from the context workspace. */
cpar_status cpar_embedding_forward(cpar_group *tp, const cpar_tensor *weight, const cpar_tensor *ids, cpar_tensor *out,
                                   bool reduce_scatter_embeddings);

/* The gradient of forward accumulated (+=) in fp32 into dweight [v_local, H]
 * F32 (the main-grad buffer). dout: forward's out shape and dtype ([b, s, H],
 * the full gradient every rank holds, or [s/tp, b, H], all-gathered along s
 * first). deterministic: no atomics, each row sums its tokens in token order
 * (bitwise reproducible; O(v_local x tokens) id comparisons on a GPU);
 * otherwise one atomicAdd per owned token element. The host path is always
 * deterministic. */
cpar_status cpar_embedding_backward(cpar_group *tp, const cpar_tensor *ids, const cpar_tensor *dout,
                                    bool reduce_scatter_embeddings, cpar_tensor *dweight, bool deterministic);


/* ---- the embedding layer: cpar_embedding (VocabParallelEmbedding as an object) ----
 * Owns this rank's weight rows and their fp32 main grad, like cpar_linear
 * (§11), and runs the functional calls above on them. Naming: the object's
 * forward and backward are cpar_embedding_layer_forward / _backward because
 * cpar_embedding_forward / _backward are the functional calls above (which
 * take the weight as an argument); everything else is cpar_embedding_*.
 *
 * The global vocabulary V is split evenly over tp (size P, rank r): the layer
 * holds rows [first, last) = cpar_vocab_range(V, r, P) of the [V, H] table.
 * V must be divisible by P (pad it with cpar_pad_vocab_size). ids, out and
 * dout are exactly as for cpar_embedding_forward / _backward, with the
 * layer's reduce_scatter_embeddings and deterministic settings. All memory
 * (weight and main grad) is allocated by _create on tp's context; forward
 * and backward take their scratch from the context workspace. Bad arguments
 * are CPAR_ERR_INVALID naming the function and the argument. */

typedef struct cpar_embedding_config {
    int64_t num_embeddings, embedding_dim; /* global vocabulary V and hidden H, > 0 */
    cpar_dtype dtype;                      /* weight and out: F32 (0), F16, BF16 */
    bool reduce_scatter_embeddings;        /* sequence-parallel output [s/tp, b, H] */
    bool deterministic;                    /* backward without atomics */
} cpar_embedding_config;

typedef struct cpar_embedding cpar_embedding;

/* Create the layer on tp's context: weight uninitialised (call an init; it
 * is zero-filled meanwhile), main grad zero. num_embeddings not divisible by
 * tp: CPAR_ERR_INVALID naming both sizes and pointing at cpar_pad_vocab_size.
 * Collective-free. */
cpar_status cpar_embedding_create(cpar_group *tp, const cpar_embedding_config *cfg, cpar_embedding **out);
/* Frees everything the layer owns. NULL is fine. */
cpar_status cpar_embedding_destroy(cpar_embedding *e);

/* Views on the context's device (zeroed struct for a NULL layer); the caller
 * may read and write through them (e.g. an optimizer step). */
cpar_tensor cpar_embedding_weight(const cpar_embedding *e);      /* [V/tp, H] cfg dtype: vocabulary rows [first, last) */
cpar_tensor cpar_embedding_weight_grad(const cpar_embedding *e); /* F32 main grad, weight's shape */

/* master: host F32 [V, H] (the same on every rank); this rank takes rows
 * [first, last), rounded to the layer's dtype. No communication. */
cpar_status cpar_embedding_init_from_master(cpar_embedding *e, const cpar_tensor *master);
/* Megatron's _initialize_affine_weight_gpu with normal(0, std), as
 * cpar_linear_init_random: drawn under a fork of CPAR_RNG_MODEL_PARALLEL, so
 * each TP rank draws from its own state, reproducibly for a fixed
 * cpar_model_parallel_manual_seed (missing state: CPAR_ERR_INVALID saying so). */
cpar_status cpar_embedding_init_random(cpar_embedding *e, float std);

/* cpar_embedding_forward on the layer's weight: ids [b, s]; out [b, s, H], or
 * [s/tp, b, H] with reduce_scatter_embeddings, in the layer's dtype. */
cpar_status cpar_embedding_layer_forward(cpar_embedding *e, const cpar_tensor *ids, cpar_tensor *out);
/* cpar_embedding_backward into the layer's main grad (accumulates, +=):
 * ids as in forward, dout forward's out shape and dtype. */
cpar_status cpar_embedding_layer_backward(cpar_embedding *e, const cpar_tensor *ids, const cpar_tensor *dout);
/* Main grad = 0. */
cpar_status cpar_embedding_zero_grad(cpar_embedding *e);


/* ==== 11. Linear layers ====================================================
 * Megatron's ColumnParallelLinear, RowParallelLinear, LinearWithFrozenWeight
 * and linear_with_grad_accumulation_and_async_allreduce (seed 001, layers.py)
 * as one object, cpar_linear. Y = X W^T + b, row-major, tokens first:
 *
 *   column: weight [out/tp, in], bias [out/tp] (partitioned)
 *     x [s, b, in]           (sequence_parallel: [s/tp, b, in], all-gathered
 *                             along dim 0 into the context workspace first)
 *     y [s, b, out/tp]       (gather_output: [s, b, out], all-gathered along
 *                             the last dim; not with sequence_parallel)
 *     backward: dx = dy W, then all-reduce over tp (sequence_parallel:
 *       reduce-scatter along dim 0 into [s/tp, b, in]; disable_grad_reduce:
 *       neither with tp > 1 and no sequence parallelism: dx is this rank's
 *       partial sum, as Megatron's allreduce_dgrad == False);
 *       with gather_output dy is [s, b, out] and its last dim is split first.
 *   row: weight [out, in/tp], bias [out] (not partitioned)
 *     x [s, b, in/tp] with input_is_parallel, else x [s, b, in] of which this
 *       rank uses columns [r in/tp, (r+1) in/tp) (scatter_to_tp_region; read
 *       in place through the GEMM's leading dimension, no copy)
 *     y = all-reduce(x W^T) [s, b, out], or with sequence_parallel (requires
 *       input_is_parallel) reduce-scatter along dim 0 into [s/tp, b, out];
 *       then + bias (after the reduction) unless skip_bias_add
 *     backward: dy (sequence_parallel: [s/tp, b, out], all-gathered along dim
 *       0 first), dx = dy W [s, b, in/tp]; without input_is_parallel dx is
 *       [s, b, in]: the ranks' slices all-gathered along the last dim (the
 *       backward of scatter_to_tp_region).
 *
 * x and y may have any number of leading dims ([s, b, h] or [T, h]); the
 * last dim is the feature dim and dim 0 the sequence (split by sequence
 * parallelism, so it must be divisible by tp there). Every activation has
 * the layer's dtype and lives on the context's device (host memory on the
 * host backend). F32 accumulation everywhere: on device tensors the GEMMs are
 * cuBLAS (cpar_dev_gemm, fp32 compute), on host tensors a loop reference with
 * the same operand mapping.
 *
 * Gradients: weight and bias gradients accumulate (+=) into gradient
 * buffers owned by the layer; cpar_linear_zero_grad clears them. Their dtype,
 * the layer's grad dtype, follows Megatron's gradient_accumulation_fusion:
 *  - fusion (the default, a zero config): the wgrad GEMM accumulates into the
 *    weight's main grad with beta = 1 (fused_weight_gradient_mlp_cuda), in
 *    fp32 (main_grad_dtype F32, 0: wgrad_gemm_accum_fp32) or in the layer's
 *    own 16-bit dtype (main_grad_dtype == dtype, F16 or BF16:
 *    wgrad_gemm_accum_fp16; the product is summed in fp32 and rounded once
 *    into the 16-bit main grad). The bias gradient (a GEMM of dy with a ones
 *    vector, beta = 1) lands in a buffer of the same dtype, as Megatron's DDP
 *    adds it to the bias's main grad of the shared grad buffer.
 *  - disable_gradient_accumulation_fusion: no main grad; the gradients are
 *    the weight's and bias's own .grad in the parameter dtype (the layer's
 *    dtype): dW = dy^T x is summed in fp32 and accumulated into the dtype
 *    buffer, as autograd accumulates .grad (autograd rounds the product and
 *    then the sum; cpar rounds once).
 * frozen: no weight and no bias gradient (LinearWithFrozenWeight's
 * backward returns only dx; no main grads are allocated). skip_bias_add: the
 * caller adds the bias it receives to y, so d(bias) = sum over tokens of dy
 * and backward accumulates it all the same. Row + sequence_parallel: the bias
 * gradient is summed over the all-gathered dy, so it is the full gradient on
 * every rank (Megatron marks that bias sequence_parallel and all-reduces its
 * partial gradient in finalize_model_grads; cpar needs no extra step).
 *
 * Forward keeps a reference to x (not a copy; with sequence parallelism the
 * local shard, re-gathered in backward): the caller keeps x alive and
 * unchanged until the matching backward. Temporaries come from the context
 * workspace (one carve per call); nothing is allocated after warm-up.
 * Collective calls are over tp, in the same order on every member. Bytes
 * moved are the minimum of each mapping (see cpar_comm_stats):
 *   column fwd: SP all-gather of x; gather_output all-gather of y. Nothing else.
 *   column bwd: SP all-gather of x + reduce-scatter of dx; else all-reduce of
 *               dx (none with disable_grad_reduce). A deferred weight
 *               gradient skips the all-gather; cpar_linear_drain_wgrad makes
 *               it later (the same bytes).
 *   row fwd:    all-reduce of y (SP: reduce-scatter).
 *   row bwd:    SP all-gather of dy; !input_is_parallel all-gather of dx.
 * A group of size 1 moves nothing. The column backward overlaps as Megatron
 * does on device tensors: the SP all-gather of x runs on the context's
 * communication stream while the dgrad GEMM runs on the compute stream, then
 * the dgrad reduce-scatter (all-reduce without SP) runs on the communication
 * stream while the wgrad GEMM runs; events order the two, and the call joins
 * the communication stream back into the compute stream before it returns
 * (everything stays stream-ordered on compute for the caller). Host tensors
 * run the same order sequentially.
 *
 * Column-layer options for the output layer of a language model (Megatron's
 * ColumnParallelLinear; a row layer refuses them with CPAR_ERR_INVALID):
 *  - skip_weight_param_allocation: the layer allocates no weight (and no
 *    weight gradient): every forward passes one in args->weight, with its
 *    gradient buffer in args->weight_grad (cpar_linear_forward_ex). Tied
 *    embeddings: the output layer uses the embedding's weight [V/tp, H]
 *    (cpar_embedding_weight, whose vocabulary rows are exactly a column
 *    layer's output rows for input_size = H, output_size = V, stride 1) and
 *    its weight gradient accumulates into the embedding's F32 main grad
 *    (cpar_embedding_weight_grad), as Megatron's autograd adds both uses
 *    into weight.main_grad. The bias is unaffected (allocated when bias).
 *  - forward(weight=...): any column layer may be given a weight per call
 *    (shape [output_size/tp, input_size] checked); its gradient then goes to
 *    args->weight_grad, not to the layer's own, as autograd sends a
 *    gradient to the tensor that was used. Backward uses the weight of the
 *    forward that preceded it (kept by reference: keep it alive and
 *    unchanged until backward).
 *  - runtime_gather_output (args->runtime_gather_output): overrides
 *    gather_output for one forward and its backward (y and dy [.., output_size]
 *    when gathering, [.., output_size/tp] otherwise).
 *  - defer_embedding_wgrad_compute with wgrad_deferral_limit L (0: no limit):
 *    Megatron's embedding_activation_buffer / grad_output_buffer. A forward
 *    appends its input (the local shard with sequence parallelism) to the
 *    layer's activation list while the list holds fewer than L (or L == 0);
 *    a backward appends dy to the grad-output list while that holds fewer
 *    than L and then skips the weight-gradient GEMM (and, with sequence
 *    parallelism, the all-gather of x, which only the wgrad needs); dx and
 *    the bias gradient are computed as usual. Once the limit is reached a
 *    backward computes its weight gradient at once, as without deferral.
 *    cpar_linear_drain_wgrad (Megatron's drain_embedding_wgrad_compute in
 *    its pipeline schedules) then runs the deferred GEMMs in order, each into
 *    the gradient its forward used, all-gathering each input again with
 *    sequence parallelism (the next gather overlapped with the current GEMM
 *    on device tensors, double-buffered), and empties both lists. The lists
 *    hold references: the caller keeps every deferred x and dy alive and
 *    unchanged until the drain (Megatron's lists keep the tensors alive). As
 *    in Megatron, deferral requires gradient-accumulation fusion and a
 *    trainable weight (not frozen). The lists pair the i-th forward with the
 *    i-th backward, so a deferred layer runs one backward per forward, in
 *    order; a backward that would pair with the wrong forward is refused.
 *    The lists' bookkeeping (a few pointers per micro-batch) grows on the
 *    host while warming up when L == 0 and is allocated at create otherwise.
 *
 * Bad arguments are CPAR_ERR_INVALID naming the function and the argument
 * with the tp numbers, e.g.
 *   "cpar_linear_forward: x has shape [8,2,1024], expected [*,*,512] (input_size/tp with tp=2)". */

typedef struct cpar_linear_config {
    int64_t input_size, output_size; /* global sizes (Megatron's), > 0 */
    cpar_dtype dtype;                /* weights and activations: F32 (0), F16 or BF16 */
    bool bias;                       /* has a bias */
    bool gather_output;              /* column: all-gather y along the last dim */
    bool input_is_parallel;          /* row: x already split along the last dim */
    bool skip_bias_add;              /* forward returns the bias in bias_out instead of adding it */
    bool sequence_parallel;          /* see above; column: with gather_output too (y [s*tp, ..., output_size]); row: needs input_is_parallel */
    bool disable_grad_reduce;        /* column: no all-reduce of dx (ignored with sequence_parallel) */
    bool frozen;                     /* no weight or bias gradient (LinearWithFrozenWeight) */
    int stride;                      /* 0 -> 1: partition stride of the master weight (init_from_master) */
    bool skip_weight_param_allocation; /* column: no weight of its own; every forward passes one (tied embeddings) */
    bool defer_embedding_wgrad_compute; /* column: weight gradients deferred to cpar_linear_drain_wgrad */
    int wgrad_deferral_limit;        /* with defer_embedding_wgrad_compute: micro-batches deferred at most; 0: no limit */
    bool disable_gradient_accumulation_fusion; /* grads are the param-dtype .grad, not main grads */
    cpar_dtype main_grad_dtype;      /* with fusion: F32 (0), or the layer's dtype (F16/BF16 main grads) */
} cpar_linear_config;

/* Megatron's runtime_gather_output: Optional[bool]. */
typedef enum cpar_runtime_gather {
    CPAR_RUNTIME_GATHER_NONE = 0, /* None: the layer's gather_output */
    CPAR_RUNTIME_GATHER_TRUE,     /* gather y along the last dim for this call */
    CPAR_RUNTIME_GATHER_FALSE,    /* leave y partitioned for this call */
} cpar_runtime_gather;

/* The per-call arguments of Megatron's ColumnParallelLinear.forward(input_,
 * weight, runtime_gather_output). A zeroed struct (or NULL) is
 * cpar_linear_forward. */
typedef struct cpar_linear_forward_args {
    const cpar_tensor *weight;     /* NULL: the layer's weight (required with skip_weight_param_allocation);
                                    * else [output_size/tp, input_size] in the layer's dtype on the device */
    cpar_tensor *weight_grad;      /* weight's gradient, weight's shape in the grad dtype (e.g. the tied
                                    * embedding's F32 main grad); required with weight unless frozen, else NULL */
    cpar_runtime_gather runtime_gather_output; /* column only */
} cpar_linear_forward_args;

typedef struct cpar_linear cpar_linear;

/* Create a layer on tp's context: the weight (uninitialised: call an init),
 * zero bias, zero gradients. output_size (column) or input_size (row) must
 * be divisible by tp * stride. The options of the column layer above
 * (skip_weight_param_allocation, defer_embedding_wgrad_compute) on a row
 * layer, a wgrad_deferral_limit < 0 or without deferral, deferral without
 * fusion or with frozen, a main_grad_dtype other than F32 or the layer's
 * dtype (Megatron's fused kernels accumulate in fp32 or in the input's
 * dtype), or a 16-bit main_grad_dtype without fusion: CPAR_ERR_INVALID.
 * Collective-free. */
cpar_status cpar_column_parallel_linear_create(cpar_group *tp, const cpar_linear_config *cfg, cpar_linear **out);
cpar_status cpar_row_parallel_linear_create(cpar_group *tp, const cpar_linear_config *cfg, cpar_linear **out);
/* Frees everything the layer owns. NULL is fine. */
cpar_status cpar_linear_destroy(cpar_linear *l);

/* Views of the layer's tensors on the context's device (data NULL when the
 * layer has none: no bias, frozen for both grads, or no weight and no weight
 * grad with skip_weight_param_allocation). The caller may read and write
 * through them (e.g. an optimizer step). */
cpar_tensor cpar_linear_weight(const cpar_linear *l);      /* [out/tp, in] or [out, in/tp], cfg dtype */
cpar_tensor cpar_linear_bias(const cpar_linear *l);        /* [out/tp] or [out], cfg dtype */
cpar_tensor cpar_linear_weight_grad(const cpar_linear *l); /* weight's shape, grad dtype (F32 main grad by default) */
cpar_tensor cpar_linear_bias_grad(const cpar_linear *l);   /* bias's shape, grad dtype */

/* Megatron's _initialize_affine_weight_cpu: master_weight host F32
 * [output_size, input_size] (the same on every rank); the partition dim (0
 * column, 1 row) is cut into tp * stride equal chunks and rank r takes chunks
 * r, r + tp, r + 2 tp, ... in order, rounded to the layer's dtype.
 * master_bias host F32 [output_size] or NULL (then the bias is zero):
 * column takes its rows the same way, row keeps it whole. With
 * skip_weight_param_allocation master_weight must be NULL (there is no
 * weight; only the bias is set). No communication. */
cpar_status cpar_linear_init_from_master(cpar_linear *l, const cpar_tensor *master_weight,
                                         const cpar_tensor *master_bias);
/* Megatron's _initialize_affine_weight_gpu with init_method normal(0, std):
 * the local weight is drawn (cpar_rng_normal) under a fork of
 * CPAR_RNG_MODEL_PARALLEL, so each TP rank draws from its own state and the
 * result is reproducible for a fixed cpar_model_parallel_manual_seed. The
 * tracker must have that state (else CPAR_ERR_INVALID saying so). Bias zero. */
cpar_status cpar_linear_init_random(cpar_linear *l, float std);
/* (With skip_weight_param_allocation init_random draws nothing and leaves
 * the RNG state alone: it zeroes the bias.) */

/* y (and bias_out) preallocated with the shapes above; bias_out [out/tp]
 * (column) or [out] (row) in the layer's dtype receives the bias when
 * skip_bias_add and the layer has one; it is ignored (may be NULL) otherwise. */
cpar_status cpar_linear_forward(cpar_linear *l, const cpar_tensor *x, cpar_tensor *y, cpar_tensor *bias_out);
/* cpar_linear_forward with Megatron's per-call arguments (args may be NULL):
 * a supplied weight and its gradient buffer, runtime_gather_output. The
 * weight, its gradient target and the gather choice hold for the matching
 * backward. y must not overlap args->weight. */
cpar_status cpar_linear_forward_ex(cpar_linear *l, const cpar_tensor *x, cpar_tensor *y, cpar_tensor *bias_out,
                                   const cpar_linear_forward_args *args);
/* dy shaped like forward's y; dx shaped like forward's x, or NULL: no input
 * gradient (no dgrad GEMM and no dgrad communication). Accumulates the
 * gradients (into forward's args->weight_grad when it supplied a weight;
 * deferred with defer_embedding_wgrad_compute, see above). Needs a prior
 * forward (whose x the caller kept alive). */
cpar_status cpar_linear_backward(cpar_linear *l, const cpar_tensor *dy, cpar_tensor *dx);
/* Megatron's drain_embedding_wgrad_compute: the deferred weight-gradient
 * GEMMs, in order, each accumulated into its forward's weight gradient; both
 * lists are emptied (also on failure). Empty lists: nothing to do. A layer
 * without defer_embedding_wgrad_compute, or lists of unequal length (a
 * forward whose backward has not run): CPAR_ERR_INVALID. Collective over tp
 * with sequence parallelism (one all-gather of x per deferred micro-batch,
 * the same bytes backward would have moved); none otherwise. */
cpar_status cpar_linear_drain_wgrad(cpar_linear *l);
/* The lengths of the deferral lists (Megatron's len(embedding_activation_buffer),
 * len(grad_output_buffer)); either pointer may be NULL. */
cpar_status cpar_linear_deferred(const cpar_linear *l, int *n_activations, int *n_grad_outputs);
/* Gradients = 0 (the deferral lists are left alone: their GEMMs still add
 * when drained, as Megatron's zero_grad leaves its lists). */
cpar_status cpar_linear_zero_grad(cpar_linear *l);


/* ==== 12. Attention and context parallelism ===============================
 *
 * ---- local attention (one rank) -------------------------------------------
 * Flash-style scaled dot-product attention: softmax(scale · q kᵀ [+ mask]) v
 * without materialising the score matrix, plus the fp32 log-sum-exp per query
 * row that backward (and the ring merge of §12) needs.
 *   q   [b, hq,  sq, d]     F32, F16 or BF16 (all of q, k, v, out, dout, dq, dk, dv share it)
 *   k,v [b, hkv, sk, d]     hq % hkv == 0 (grouped-query attention: q head h
 *                           reads kv head h / (hq/hkv), PyTorch's enable_gqa)
 *   out [b, hq,  sq, d]     q's dtype
 *   lse [b, hq,  sq]        F32, natural log; -inf for a row that sees no key
 *                           (its out row is 0, never NaN)
 * d ≤ 128 and a multiple of 8 on devices (any d ≥ 1 on the host).
 * causal: top-left aligned as PyTorch's SDPA is_causal: query i sees keys
 * j ≤ i (so with sq > sk every row still sees key 0).
 * scale: 0 means 1/sqrt(d); otherwise must be finite and > 0.
 * Every tensor on the host, or every one on the context's device. Host
 * tensors run the host reference (fp32 accumulation, two-pass exact
 * softmax; on a device context too, with host scratch allocated per call);
 * device tensors run the flash kernels of cpar_kernels.cu, F16/BF16 only (F32
 * on a device is CPAR_ERR_UNSUPPORTED). sk = 0: out 0 and lse -inf. Temporaries
 * come from the context workspace. Stream-ordered on the compute stream. */
cpar_status cpar_attention_forward(cpar_ctx *ctx, const cpar_tensor *q, const cpar_tensor *k, const cpar_tensor *v,
                                   bool causal, float scale, cpar_tensor *out, cpar_tensor *lse);
/* Gradients of forward: dq like q, dk and dv like k and v (overwritten, not
 * accumulated; with GQA dk/dv sum over the q heads sharing a kv head). out and
 * lse are forward's outputs; dout like out. Gradients accumulate in fp32
 * (workspace scratch for F16/BF16, cast into dq/dk/dv at the end). */
cpar_status cpar_attention_backward(cpar_ctx *ctx, const cpar_tensor *q, const cpar_tensor *k, const cpar_tensor *v,
                                    const cpar_tensor *out, const cpar_tensor *dout, const cpar_tensor *lse,
                                    bool causal, float scale, cpar_tensor *dq, cpar_tensor *dk, cpar_tensor *dv);

/* ---- attention dropout -------------------------------------------------------
 * As PyTorch's SDPA / flash-attn dropout_p: after the softmax every attention
 * weight A_ij is zeroed with probability p and the kept ones are scaled by
 * 1 / (1 - p), so out = (A ∘ Z) v / (1 - p); lse stays the log-sum-exp before
 * dropout, and backward applies the same mask Z. Z is a pure function of the
 * Philox state (seed, offset), the (batch, head) index bh = bi·hq + hi and
 * the GLOBAL query and key positions (qpos, kpos; for ring attention the
 * positions in the whole sequence, so a ring at any cp draws exactly the mask
 * of one-rank attention over the whole sequence): with
 *     c = offset + kpos / 4,   sub = (bh + 1) · 2^32 + qpos,
 *     w = word kpos % 4 of philox(counter = {lo32(c), hi32(c), lo32(sub), hi32(sub)},
 *                                 key = {lo32(seed), hi32(seed)}),
 * A_ij is kept when u = (w >> 8) · 2^-24 >= p (cpar_dropout's rule). In
 * curand's terms that is subsequence sub, offset 4c: the tracker's own draws
 * (random fills, cpar_dropout) use subsequence 0, so they never share a
 * number with attention dropout. One call consumes ceil(S_k / 4) offsets of
 * every subsequence, S_k the global key length (sk; cp · s_local_kv for the
 * ring): take the state with cpar_rng_reserve(ctx, (S_k + 3) / 4, &state)
 * (cpar.h §9), under the fork Megatron uses for attention dropout:
 *     cpar_rng_fork(ctx, CPAR_RNG_MODEL_PARALLEL);
 *     cpar_rng_reserve(ctx, (S_k + 3) / 4, &cfg.dropout_state);
 *     cpar_rng_unfork(ctx);
 * and pass the same state to backward (and to a checkpoint's recompute,
 * which replays the tracker and so reserves the same state again). The host
 * reference, the sim and GPUs draw the same mask bit for bit. p in [0, 1):
 * p = 1 is refused as cpar_dropout_forward refuses it (PyTorch returns
 * zeros); p = 0 is exactly the attention without dropout. Positions must be
 * below 2^32. */

typedef struct cpar_packed_seqs cpar_packed_seqs; /* a THD batch: "packed sequences" below */

typedef struct cpar_attention_config {
    bool causal;                 /* top-left: query i sees keys j <= i */
    float scale;                 /* 0: 1/sqrt(d); else finite and > 0 */
    float dropout_p;             /* 0: no dropout; else in (0, 1) */
    cpar_rng_state dropout_state; /* the Philox (seed, offset) of the mask (see above) */
    const cpar_packed_seqs *packed; /* NULL, or a THD batch (below): b = 1, sq = sk = its packed length */
} cpar_attention_config;

/* cpar_attention_forward / _backward with a configuration (NULL cfg is an
 * error; a zeroed one is non-causal attention at 1/sqrt(d) without dropout):
 * the same tensors, checks and memory rules. The positions of the dropout
 * mask are qpos = i, kpos = j. With cfg->packed (a THD batch, see "packed
 * sequences" below; documents of any lengths here) query i sees key j only
 * when both lie in the same document's real rows, and causal means j <= i
 * within it; padding rows get out 0, lse -inf and zero gradients. cpar_attention_forward(..., causal, scale, ...)
 * is cpar_attention_forward_cfg with { causal, scale } and no dropout. */
cpar_status cpar_attention_forward_cfg(cpar_ctx *ctx, const cpar_attention_config *cfg, const cpar_tensor *q,
                                       const cpar_tensor *k, const cpar_tensor *v, cpar_tensor *out,
                                       cpar_tensor *lse);
cpar_status cpar_attention_backward_cfg(cpar_ctx *ctx, const cpar_attention_config *cfg, const cpar_tensor *q,
                                        const cpar_tensor *k, const cpar_tensor *v, const cpar_tensor *out,
                                        const cpar_tensor *dout, const cpar_tensor *lse, cpar_tensor *dq,
                                        cpar_tensor *dk, cpar_tensor *dv);


/* ---- ring attention and sequence sharding for context parallelism ----------
 * PyTorch's _templated_ring_attention (+ backward), _SDPAMerger,
 * _RoundRobinLoadBalancer / _SequentialSharder, set_rotate_method and
 * context_parallel_unshard on a CP group of size P, rank r.
 *
 * Per step i = 0..P-1 rank r attends to the KV shard of rank (r - i) mod P.
 * With causal attention (the seed's _is_causal_behavior):
 *   step 0: the local block, causal (top-left on the local shard; with load
 *     balancing the two local chunks r and 2P-1-r are in global order, so
 *     that mask is exactly right);
 *   no load balancing: blocks from ranks < r in full, from ranks > r skipped;
 *   load balancing: i <= r: all of q against the first half (chunk r - i) of
 *     the received KV; i > r: the second half of q (chunk 2P-1-r) against the
 *     whole received KV, merged into those rows only.
 * Non-causal attention uses every block in full, with either sharding (the
 * seed refuses that combination with load balancing; nothing requires it).
 * Packed sequences (cfg->packed, load balancing, b = 1): every step is the
 * whole block masked by document and global position (a document's chunk
 * pairs follow the load-balanced rule above, interleaved along the shard);
 * the communication is the plain ring's. On devices the flash kernels skip
 * the tiles (64 rows of queries by 64 keys) whose every pair is hidden (in
 * different documents or, causal, every key after every query): their
 * weights are exact zeros, so the work follows the documents' blocks
 * instead of the whole shard and the gradients keep every bit (the
 * forward too in the simulator; on a GPU a visited hidden tile could only
 * nudge the running softmax sum by the rounding of nvcc's fused rescale).
 * The host loop skips its hidden 128 x 128 tiles the same way (no bit changes).
 * Block results are merged in fp32 as _SDPAMerger does:
 *   out <- out - sigmoid(lse_b - lse) (out - out_b),  lse <- lse - logsigmoid(lse - lse_b)
 * (a row no block reaches keeps lse = -inf and out = 0). */

/* How the context-parallel group communicates (Megatron's cp_comm_type,
 * Transformer Engine's names). Per rank, for one layer's forward with a
 * sequence shard of n = s/cp tokens, hq query and hkv key/value heads of d:
 *   ALL_GATHER  one all-gather of K and V up front: receives (cp-1)·2n·hkv·d;
 *   P2P         ring send/recv of one KV block per step, overlapped with the
 *               step's block on GPUs (PyTorch's "alltoall" rotate method):
 *               cp-1 transfers of 2n·hkv·d;
 *   A2A         DeepSpeed-Ulysses: all-to-alls turn [b, h, n, d] into
 *               [b, h/cp, s, d] (heads scattered, the whole sequence
 *               gathered), one local attention over the whole sequence, and
 *               an all-to-all of out (and lse) back: (cp-1)/cp of q, k, v
 *               and out, i.e. (cp-1)/cp·n·(2hq + 2hkv)·d; needs hq and hkv
 *               divisible by cp (GQA with hkv < cp is refused: repeat the KV
 *               heads to cp, as Transformer Engine does, or use P2P);
 *   A2A_P2P     hierarchical: cp = a · p; an all-to-all inside each inner
 *               group of a consecutive ranks (a2a_size; typically one node's
 *               NVLink domain), then the P2P ring across the p outer groups
 *               (ranks a apart) on [b, h/a, a·n, d], then the all-to-alls back:
 *               (a-1)/a of A2A's tensors plus p-1 ring steps of 2n·hkv·d.
 *               a = cp is A2A, a = 1 is P2P; hq and hkv divisible by a.
 * A2A and A2A_P2P make their inner and outer groups on the first call (a
 * split of cp, collective) and keep them with cp until it is destroyed;
 * cpar_group_stats(cp) counts the traffic of those groups too. Backward
 * moves, besides forward's q, k, v: out, dout (all-to-all) and the gradients
 * back (all-to-all of dq, dk, dv); lse travels with out (fp32, 1/d of it). */
typedef enum cpar_cp_comm_type {
    CPAR_CP_ALL_GATHER = 0, /* "all_gather": the seed's default (PyTorch's "allgather" rotate method) */
    CPAR_CP_P2P,            /* "p2p" */
    CPAR_CP_A2A,            /* "a2a" */
    CPAR_CP_A2A_P2P,        /* "a2a+p2p" (with a2a_size) */
    CPAR_CP_COMM_TYPE_COUNT
} cpar_cp_comm_type;

/* "all_gather", "p2p", "a2a", "a2a+p2p"; "?" when invalid. */
const char *cpar_cp_comm_type_name(cpar_cp_comm_type t);
/* The type of one of those names (CPAR_ERR_INVALID naming the choices otherwise). */
cpar_status cpar_cp_comm_type_parse(const char *name, cpar_cp_comm_type *out);

typedef struct cpar_ring_attention_config {
    bool causal;
    bool load_balance;         /* the sequence was sharded round-robin: rank r holds chunks r and 2P-1-r */
    cpar_cp_comm_type comm_type;
    int a2a_size;              /* A2A_P2P: the inner (all-to-all) group size a, dividing cp; else 0 */
    float scale;               /* 0: 1/sqrt(d); else finite and > 0 */
    float dropout_p;           /* 0: none; else in (0, 1), the mask of the whole sequence's */
    cpar_rng_state dropout_state; /* attention (see "attention dropout"; S_k = cp · s_local_kv) */
    const cpar_packed_seqs *packed; /* NULL, or a THD batch (below) in its CP layout: needs
                                     * load_balance, b = 1, s_local = s_local_kv = packed length / cp */
} cpar_ring_attention_config;

/* q [b, hq, s_local, d], k, v [b, hkv, s_local_kv, d] this rank's shard of
 * the sequence (dtypes, head dims and GQA as cpar_attention_forward), all on
 * the context's device; causal needs s_local_kv == s_local, and with load
 * balancing an even s_local (and s_local_kv: A2A and A2A_P2P with a > 1
 * always, as they reorder the two chunks). out like q, lse F32 [b, hq,
 * s_local]: exactly the rows of full-sequence attention this rank holds.
 * Communication on cp (bytes in cpar_cp_comm_type above): ALL_GATHER: one
 * all-gather of [k | v]; P2P: P-1 ring send/recvs of this rank's K and V;
 * A2A: one all-to-all each of q, k, v, out and lse; A2A_P2P: those on the
 * inner groups and P2P's on the outer. Scratch: one carve of the context
 * workspace. */
cpar_status cpar_ring_attention_forward(cpar_group *cp, const cpar_ring_attention_config *cfg,
                                        const cpar_tensor *q, const cpar_tensor *k, const cpar_tensor *v,
                                        cpar_tensor *out, cpar_tensor *lse);
/* dq like q, dk, dv like k, v (overwritten): this rank's rows of the
 * full-sequence gradients. out, lse from forward, dout like out. The KV
 * rotation is forward's (again); the fp32 dK/dV accumulators travel around
 * the ring with their KV block (P send/recvs of 2 * numel(k) floats) and
 * arrive at their owner; dq accumulates locally in fp32. A2A (and A2A_P2P's
 * inner groups): one all-to-all each of q, k, v, out, dout, lse in and of
 * dq, dk, dv back. */
cpar_status cpar_ring_attention_backward(cpar_group *cp, const cpar_ring_attention_config *cfg,
                                         const cpar_tensor *q, const cpar_tensor *k, const cpar_tensor *v,
                                         const cpar_tensor *out, const cpar_tensor *dout, const cpar_tensor *lse,
                                         cpar_tensor *dq, cpar_tensor *dk, cpar_tensor *dv);

/* full: the whole sequence along dim seq_dim (negative counts from the end);
 * local: the same shape and dtype with seq_dim divided by P. Sequential: rank
 * r takes chunk r of P. load_balance: rank r takes chunks r and 2P-1-r of 2P,
 * in that order (the length must divide by 2P, else by P). Each of full and
 * local on the host or the context's device. No communication. */
cpar_status cpar_cp_shard(cpar_group *cp, const cpar_tensor *full, int seq_dim, bool load_balance,
                          cpar_tensor *local);
/* Inverse of cpar_cp_shard on every rank: all-gather the shards and restore
 * the sequence order. local and full on the context's device. Scratch: the
 * context workspace (P * nbytes(local)), except for a sequential shard along
 * an outermost dimension, which is gathered in place. */
cpar_status cpar_cp_unshard(cpar_group *cp, const cpar_tensor *local, int seq_dim, bool load_balance,
                            cpar_tensor *full);

/* ---- packed sequences (THD) -------------------------------------------------
 * Megatron's PackedSeqParams with qkv_format "thd": a batch of documents
 * packed back to back along one sequence dimension (b = 1), as real training
 * data is. Document i holds the real tokens [cu_seqlens[i], cu_seqlens[i+1])
 * of the unpadded packing; with cu_seqlens_padded, the packed buffer holds
 * document i at [cu_seqlens_padded[i], cu_seqlens_padded[i+1]), real tokens
 * first and padding after them (padding rows attend to nothing and get zero
 * output and gradients). Attention never crosses a document boundary and is
 * causal within a document.
 *
 * Context parallelism over P ranks (Megatron's THD partitioned indices):
 * every (padded) document length divides by 2P, the document is cut into 2P
 * equal chunks and rank r holds chunks r and 2P-1-r of EVERY document, in
 * document order: [doc0 chunk r | doc0 chunk 2P-1-r | doc1 chunk r | ...].
 * The local packed length is the total padded length / P. The arrays are
 * host memory, the same on every rank, and describe the global (unsharded)
 * packing. */
struct cpar_packed_seqs {
    int n_docs;                        /* >= 1 */
    const int32_t *cu_seqlens;         /* [n_docs + 1], cu_seqlens[0] = 0, non-decreasing */
    const int32_t *cu_seqlens_padded;  /* [n_docs + 1] or NULL (no padding: the same as cu_seqlens);
                                        * each padded length >= the real one */
};

/* cpar_cp_shard / cpar_cp_unshard for a packed buffer: full holds the whole
 * packing along dim seq_dim (negative counts from the end), so its length
 * there is cu_seqlens_padded[n_docs] (cu_seqlens[n_docs] without padding);
 * local the same shape and dtype with that dim divided by P, in the layout
 * above (rank r: chunks r and 2P-1-r of every document, document after
 * document; padding rows travel with their document). Any dtype, any other
 * dims (THD [t, h, d], or [b, h, t, d] with seq_dim 2). seqs is checked
 * first: n_docs >= 1, cu_seqlens (and cu_seqlens_padded) starting at 0 and
 * non-decreasing, each padded length >= its real one and divisible by 2P
 * (the failing document is named). Shard: each of full and local on the
 * host or the context's device, no communication; both on the device: one
 * reorder kernel (the boundaries passed by value, no device copy of them),
 * else 2 pitched copies per document. */
cpar_status cpar_cp_shard_packed(cpar_group *cp, const cpar_packed_seqs *seqs, const cpar_tensor *full, int seq_dim,
                                 cpar_tensor *local);
/* Inverse of cpar_cp_shard_packed on every rank: one all-gather of the
 * shards ((P-1)/P of full received, the minimum), then each rank's chunks put
 * in place (one reorder kernel on a device). local and full on the
 * context's device. Scratch: the context workspace (nbytes(full)). */
cpar_status cpar_cp_unshard_packed(cpar_group *cp, const cpar_packed_seqs *seqs, const cpar_tensor *local,
                                   int seq_dim, cpar_tensor *full);
/* The layout as an index map (Megatron / Transformer Engine's
 * thd_get_partitioned_indices): indices[l] = the global packed position of
 * local row l of rank cp_rank of cp_size, for n = total / cp_size rows
 * (total = the packed length above); local row l of document i's slot s
 * (s = 0, 1) is global row cu_padded[i] + chunk * c_i + k with chunk r (s = 0)
 * or 2P-1-r (s = 1), c_i = the padded length / 2P, k < c_i. seqs checked as
 * cpar_cp_shard_packed does; indices host memory. Needs no context. */
cpar_status cpar_cp_packed_indices(const cpar_packed_seqs *seqs, int cp_size, int cp_rank, int64_t *indices,
                                   int64_t n);


/* ==== 13. Mamba context parallelism =======================================
 *
 * Megatron's MambaContextParallel and its helpers
 * (megatron/core/ssm/mamba_context_parallel.py, seed 000): "all-to-all"
 * context parallelism for Mamba-2 mixers. Outside the mixer the sequence is
 * sharded over the CP group (size P, rank r) with attention's load balancing
 * (round-robin: the sequence is cut into 2P chunks and rank r holds chunks r
 * and 2P-1-r, in that order); inside, every rank sees the whole sequence for
 * 1/P of the heads, so the causal conv1d and the SSM scan run unchanged.
 *
 * Sizes are those of one TP rank ("_local_tp"), as the seed takes them:
 *   dI = d_inner_local_tp, nh = nheads_local_tp, ng = ngroups_local_tp,
 *   ds = d_state, K = d_conv. With P > 1 the seed's checks in its order,
 *   then dI % P == 0, which the seed gets from dI = nh * headdim and cpar's
 *   all-to-all needs (nothing asks nh % ng == 0: 16 groups over 4 heads at
 *   P = 4 is accepted, as the seed accepts it):
 *     nheads_local_tpcp  = nh / P              (nh % P == 0)
 *     d_inner_local_tpcp = dI / P              (dI % P == 0)
 *     ng < P: group_repeat_count R = P / ng (P % ng == 0), ngroups_local_tpcp = 1
 *     else:   R = 1, ngroups_local_tpcp = ng / P             (ng % P == 0)
 *     conv1d_channels    = d_inner_local_tpcp + 2 ngroups_local_tpcp ds
 *   P == 1: the _tpcp sizes equal the _tp ones and R = 1.
 *
 * Activations are sequence first, [s, b, h] (s the global sequence length,
 * b the micro-batch), row-major, any dtype for pure data movement (F32, F16
 * or BF16 where something is summed or computed).
 *
 *   pre_conv_ssm  CPAR_FWD: in  [s/P, b, 2 dI + 2 ng ds + nh]  (the in-projection
 *                           output, columns z | x | B | C | dt, load-balanced shard)
 *                      ->   out [s, b, 2 dI/P + 2 ng_tpcp ds + nh/P]
 *                           (columns z | x | B | C | dt of this rank's heads, the
 *                           whole sequence in natural order)
 *                 Each of z, x, B, C, dt goes through cp2hp (B and C first
 *                 repeated group-major, "l b (g n) -> l b (g r n)", when R > 1,
 *                 so the replicas of a group land on consecutive ranks with
 *                 that group's heads), the pieces are concatenated along the
 *                 hidden dim and the load balancing is undone. cpar packs all
 *                 five pieces into one all-to-all (the seed makes five): the
 *                 bytes moved are the same, (P-1)/P of out, in one call.
 *                 CPAR_BWD: in = d(out) [s, b, ...] -> out = d(in) [s/P, b, ...];
 *                 the gradients of the R replicas of a B or C group are summed
 *                 (fp32, rounded once).
 *   post_conv_ssm CPAR_FWD: in [s, b, h] (any h, e.g. the SSM output of this
 *                           rank's heads) -> out [s/P, b, P h]: load balancing
 *                           redone, then hp2cp. CPAR_BWD: the inverse.
 *   With P == 1 both copy in to out (the seed returns its input).
 *   s must be divisible by 2P (P > 1): the load balancing cuts 2P chunks.
 *
 * Parameters stay those of the cp = 1 mixer (the seed's conv1d_cp1,
 * dt_bias_cp1, A_log_cp1, D_cp1); this object owns none. The conv1d weight
 * is [conv_dim, K] with conv_dim = dI + 2 ng ds (PyTorch's Conv1d weight
 * [conv_dim, 1, K] is accepted too: the same memory), bias [conv_dim], rows
 * x | B | C. This rank's conv1d rows: x rows [r dI/P, (r+1) dI/P), then the
 * B rows and the C rows of groups [g0, g0 + ng_tpcp), g0 = (r / R) ng_tpcp,
 * i.e. rows [g0 ds, (g0 + ng_tpcp) ds) of each. dt_bias, A_log [nh] and D
 * [nh] (or [dI] with D_has_hdim) take elements [r n, (r+1) n), n = nh/P (or
 * dI/P). The get functions copy those rows into caller tensors; the
 * accumulate functions add (+=) a slice's gradient into the matching rows of
 * an F32 gradient buffer shaped like the cp = 1 parameter, so after summing
 * over the CP group (the data-parallel x context-parallel gradient all-reduce
 * Megatron does) the cp = 1 parameters get their full gradients.
 *
 * The conv1d (mamba_ssm's causal_conv1d, Megatron's conv1d with padding
 * K-1 and the output cut to the first s steps): depthwise over this rank's
 * conv1d_channels channels, reading the cp = 1 weight and bias through the
 * row mapping above (no sliced copy is made), so backward accumulates the
 * gradients straight into the cp = 1 rows:
 *     u[t, c] = bias[row(c)] + sum_k w[row(c), k] x[t - (K-1) + k, c]  (x[t < 0] = 0)
 *     y = silu(u) = u sigmoid(u) when silu, else u.
 * Layout: sequence first, the layout pre_conv_ssm produces (Megatron
 * transposes to [b, c, s] for torch's conv; cpar convolves in place along
 * dim 0 instead): x [s, b, W] whose channels are columns [x_col, x_col + C)
 * of the last dim, C = conv1d_channels. x_col = 0 for a plain [s, b, C]
 * tensor, or d_inner_local_tpcp to read the x | B | C columns of
 * pre_conv_ssm's output without a copy. y [s, b, C] (x's dtype). fp32 math.
 *
 * Errors: CPAR_ERR_INVALID with one line naming the function, the argument
 * and the numbers, e.g. "cpar_mamba_cp_create: nheads_local_tp 6 is not
 * divisible by cp_size 4 (nheads must be evenly divisible by tp_size *
 * cp_size)", detected before any communication. */

/* ---- all-to-all and load balancing (the seed's module functions) ---------- */

/* _all_to_all_cp2hp over cp (size P): in [s/P, b, h] -> out [s, b, h/P]
 * (h divisible by P): column chunk j of every rank's in goes to rank j, which
 * stacks the chunks of ranks 0..P-1 along dim 0 (the seed: flatten [s/P * b,
 * h], cut h into P chunks stacked along dim 0, equal all-to-all, reshape).
 * CPAR_BWD is hp2cp of the gradient (in [s, b, h/P] -> out [s/P, b, h]).
 * Exactly 3-dimensional tensors on the context's device, the same dtype;
 * out may not overlap in (P == 1: a copy, out == in allowed). One all-to-all
 * moving (P-1)/P of in's bytes each way. */
cpar_status cpar_all_to_all_cp2hp(cpar_group *cp, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir);
/* _all_to_all_hp2cp: in [s, b, h] -> out [s/P, b, P h] (s divisible by P):
 * row block j of in (its s/P * b rows) goes to rank j, which concatenates the
 * blocks of ranks 0..P-1 along the last dim. CPAR_BWD is cp2hp. */
cpar_status cpar_all_to_all_hp2cp(cpar_group *cp, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir);

/* _undo_attention_load_balancing(input, cp_size): in [s, ...] cut along dim 0
 * into 2 cp_size equal chunks (s divisible by 2 cp_size) holding sequence
 * chunks 0, 2P-1, 1, 2P-2, ... (P = cp_size; what an all-gather of the
 * load-balanced shards gives; for P = 3 the order 1,6,2,5,3,4) -> out in
 * natural order 1..2P: out chunk k = in chunk order[k], order = [0, 2, 4, ...,
 * 2P-2, 2P-1, ..., 3, 1]. _redo is the inverse (1..6 -> 1,6,2,5,3,4). in and
 * out: the same shape and dtype, host or the context's device (both on the
 * same), not overlapping. Local copies (2P of them), no communication. */
cpar_status cpar_undo_attention_load_balancing(cpar_ctx *ctx, int cp_size, const cpar_tensor *in, cpar_tensor *out);
cpar_status cpar_redo_attention_load_balancing(cpar_ctx *ctx, int cp_size, const cpar_tensor *in, cpar_tensor *out);

/* ---- the MambaContextParallel object --------------------------------------- */

typedef struct cpar_mamba_cp_config {
    int64_t d_inner_local_tp; /* > 0 */
    int64_t nheads_local_tp;  /* > 0 (d_inner_local_tp / headdim in Mamba-2) */
    int64_t ngroups_local_tp; /* > 0 */
    int64_t d_state;          /* > 0 */
    int d_conv;               /* conv1d kernel size: 0 -> 4; 2..4 */
    bool D_has_hdim;          /* D is [d_inner] (per channel) rather than [nheads] */
} cpar_mamba_cp_config;

/* Everything the object derived (readable without the object's internals). */
typedef struct cpar_mamba_cp_info {
    int cp_size, cp_rank;
    int64_t d_inner_local_tp, nheads_local_tp, ngroups_local_tp, d_state;
    int d_conv;
    bool D_has_hdim;
    int64_t d_inner_local_tpcp, nheads_local_tpcp, ngroups_local_tpcp;
    int64_t group_repeat_count; /* R */
    int64_t conv1d_channels;    /* d_inner_local_tpcp + 2 ngroups_local_tpcp d_state */
    int64_t conv_dim;           /* rows of the cp = 1 conv1d params: d_inner_local_tp + 2 ngroups_local_tp d_state */
    int64_t in_width;           /* pre_conv_ssm in's last dim: 2 dI + 2 ng ds + nh (the _tp sizes) */
    int64_t out_width;          /* pre_conv_ssm out's last dim: 2 dI/P + 2 ngroups_local_tpcp ds + nh/P */
    int64_t vector_len;         /* dt_bias / A_log slice: nheads_local_tpcp */
    int64_t D_len;              /* D slice: d_inner_local_tpcp with D_has_hdim, else nheads_local_tpcp */
} cpar_mamba_cp_info;

typedef struct cpar_mamba_cp cpar_mamba_cp;

/* Check the sizes against cp's size and derive the rest. Collective-free;
 * allocates only the small object. Errors name the sizes (the seed's
 * messages in parentheses). */
cpar_status cpar_mamba_cp_create(cpar_group *cp, const cpar_mamba_cp_config *cfg, cpar_mamba_cp **out);
cpar_status cpar_mamba_cp_destroy(cpar_mamba_cp *m); /* NULL is fine */
cpar_status cpar_mamba_cp_get_info(const cpar_mamba_cp *m, cpar_mamba_cp_info *out);
/* The seed's conv1d_channels(); 0 for NULL. */
int64_t cpar_mamba_cp_conv1d_channels(const cpar_mamba_cp *m);

/* pre_conv_ssm / post_conv_ssm with the shapes of the section comment. in
 * and out on the context's device, the same dtype, not overlapping (with
 * P == 1, out == in is allowed). Scratch from the context workspace. */
cpar_status cpar_mamba_cp_pre_conv_ssm(cpar_mamba_cp *m, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir);
cpar_status cpar_mamba_cp_post_conv_ssm(cpar_mamba_cp *m, const cpar_tensor *in, cpar_tensor *out, cpar_dir dir);
/* The same for a packed batch (seqs: §12's cpar_packed_seqs, required;
 * Megatron's PackedSeqParams). Outside the mixer the sequence dim 0 holds
 * this rank's shard in §12's packed layout (chunks r and 2P-1-r of EVERY
 * document, what cpar_cp_shard_packed makes and packed attention reads);
 * inside, out of pre (in of post) holds the whole packing, documents back to
 * back with their padding, in natural order: the undo/redo is done per
 * document instead of over the whole sequence. s is the packed length
 * (cu_seqlens_padded[n_docs], or cu_seqlens[n_docs] without padding) instead
 * of a multiple of 2P; every document's (padded) length divides by 2P
 * (errors name the document). Every batch column (dim 1) shares the packing
 * (Megatron's THD has b = 1). Communication as the unpacked calls: one
 * all-to-all of (P-1)/P of the buffer; the reorder is one kernel on a
 * device, 2 copies per document and rank on the host. A packing of one
 * unpadded document is the unpacked call. The conv1d below treats the
 * sequence as one: a caller whose documents must not see each other's
 * tokens runs it per document (mamba_ssm's seq_idx), on row ranges of pre's
 * output (views at the document's boundaries; the gradients accumulate). */
cpar_status cpar_mamba_cp_pre_conv_ssm_packed(cpar_mamba_cp *m, const cpar_packed_seqs *seqs, const cpar_tensor *in,
                                              cpar_tensor *out, cpar_dir dir);
cpar_status cpar_mamba_cp_post_conv_ssm_packed(cpar_mamba_cp *m, const cpar_packed_seqs *seqs, const cpar_tensor *in,
                                               cpar_tensor *out, cpar_dir dir);

/* The seed's get_conv1d_weight / _bias / get_dt_bias / get_A_log / get_D:
 * copy this rank's slice of the cp = 1 parameter param into out (same dtype;
 * host or the context's device, both on the same). Shapes: weight
 * [conv_dim, K] (or [conv_dim, 1, K]) -> [conv1d_channels, K] (or [.., 1, K]);
 * bias [conv_dim] -> [conv1d_channels]; dt_bias, A_log [nh] -> [nh/P]; D [nh]
 * -> [nh/P] or, with D_has_hdim, [dI] -> [dI/P]. */
cpar_status cpar_mamba_cp_get_conv1d_weight(cpar_mamba_cp *m, const cpar_tensor *param, cpar_tensor *out);
cpar_status cpar_mamba_cp_get_conv1d_bias(cpar_mamba_cp *m, const cpar_tensor *param, cpar_tensor *out);
cpar_status cpar_mamba_cp_get_dt_bias(cpar_mamba_cp *m, const cpar_tensor *param, cpar_tensor *out);
cpar_status cpar_mamba_cp_get_A_log(cpar_mamba_cp *m, const cpar_tensor *param, cpar_tensor *out);
cpar_status cpar_mamba_cp_get_D(cpar_mamba_cp *m, const cpar_tensor *param, cpar_tensor *out);
/* The vector slices are contiguous: *view aliases param's elements (no
 * copy; a gradient buffer's view is where that slice's gradient goes).
 * has_hdim: the D_has_hdim layout (length dI) instead of per head. */
cpar_status cpar_mamba_cp_vector_view(const cpar_mamba_cp *m, const cpar_tensor *param, bool has_hdim,
                                      cpar_tensor *view);

/* grad_cp1 (F32, shaped like the cp = 1 parameter) += grad (this rank's
 * slice, shaped like the get function's out, F32/F16/BF16), at the slice's
 * rows; other rows untouched. Host or the context's device, both on the
 * same. Local, no communication. */
cpar_status cpar_mamba_cp_accumulate_conv1d_weight_grad(cpar_mamba_cp *m, const cpar_tensor *grad,
                                                        cpar_tensor *grad_cp1);
cpar_status cpar_mamba_cp_accumulate_conv1d_bias_grad(cpar_mamba_cp *m, const cpar_tensor *grad,
                                                      cpar_tensor *grad_cp1);
cpar_status cpar_mamba_cp_accumulate_dt_bias_grad(cpar_mamba_cp *m, const cpar_tensor *grad, cpar_tensor *grad_cp1);
cpar_status cpar_mamba_cp_accumulate_A_log_grad(cpar_mamba_cp *m, const cpar_tensor *grad, cpar_tensor *grad_cp1);
cpar_status cpar_mamba_cp_accumulate_D_grad(cpar_mamba_cp *m, const cpar_tensor *grad, cpar_tensor *grad_cp1);

/* The seed's conv1d on this rank's channels (section comment): x [s, b, W]
 * (F32/F16/BF16, channels at columns [x_col, x_col + C)), weight the cp = 1
 * [conv_dim, K] (or [conv_dim, 1, K]), bias the cp = 1 [conv_dim] or NULL
 * (none); weight and bias F32, F16 or BF16 (the same dtype, independent of
 * x's); y [s, b, C] in x's dtype, not overlapping x. Every tensor on the host
 * or the context's device, all on the same. */
cpar_status cpar_mamba_cp_conv1d_forward(cpar_mamba_cp *m, const cpar_tensor *x, int64_t x_col,
                                         const cpar_tensor *weight, const cpar_tensor *bias, bool silu, cpar_tensor *y);
/* Backward of the forward with the same x, x_col, weight, bias, silu (the
 * pre-activation is recomputed, nothing is kept): dy [s, b, C] (x's dtype);
 * dx shaped like x (x's dtype): only its columns [x_col, x_col + C) are
 * written (overwritten), so dx may be the whole pre_conv_ssm gradient whose
 * z and dt columns the caller fills; dweight [conv_dim, K] (or [conv_dim, 1,
 * K]) and dbias [conv_dim] F32 += at this rank's rows (dbias NULL when bias
 * is). Deterministic: no atomics, per-channel sums in a fixed order; scratch
 * from the context workspace. */
cpar_status cpar_mamba_cp_conv1d_backward(cpar_mamba_cp *m, const cpar_tensor *x, int64_t x_col,
                                          const cpar_tensor *weight, const cpar_tensor *bias, bool silu,
                                          const cpar_tensor *dy, cpar_tensor *dx, cpar_tensor *dweight,
                                          cpar_tensor *dbias);


/* ==== 14. Inference layers ================================================
 * Megatron's InferenceLayerNormColumnParallelLinear and
 * InferenceRowParallelLinear (seed 001, inference_layer.py) and the
 * RMSNorm they run. The seed builds them on TransformerEngine layers and
 * uses NVLS multimem collectives on symmetric memory when it can (bf16,
 * Hopper, enough symmetric memory), else TE's NCCL gather / reduce-scatter;
 * cpar implements the NCCL path with the same results on every backend.
 * Forward only, no bias (the seed's forward never adds one), sequence
 * parallel whenever tp > 1 (the seed asserts it):
 *
 *   column (InferenceLayerNormColumnParallelLinear), weight [out/tp, in],
 *     norm weight [in]:
 *     x [s/tp, b, in] -> RMSNorm -> all-gather along dim 0 -> [s, b, in]
 *       -> y = x W^T [s, b, out/tp]          (tp = 1: x [s, b, in])
 *     skip_norm_and_all_gather (the seed's externally toggled flag, set when
 *     the previous row layer ran the fused reduce-scatter + add + RMSNorm +
 *     all-gather): x is that already normed, gathered [s, b, in].
 *   row (InferenceRowParallelLinear), weight [out, in/tp]:
 *     x [s, b, in/tp] -> x W^T [s, b, out] -> reduce-scatter along dim 0
 *       -> y [s/tp, b, out]                  (tp = 1: y [s, b, out])
 *     fused with the next layer's norm (_set_next_layer_norm_weights and
 *     _set_residual): residual [s/tp, b, out] += reduce-scatter(x W^T),
 *     normed [s, b, out] = all-gather(RMSNorm(residual, next_norm_weight)).
 *
 * Leading dims are free ([s, b, h] or [T, h]); dim 0 is the sequence and
 * must divide by tp where it is split. Every activation has the layer's
 * dtype and lives on the context's device. GEMMs in fp32 accumulation
 * (cuBLAS on devices), RMSNorm in fp32. Temporaries: one workspace carve per
 * call. Bytes moved (cpar_comm_stats): column, an all-gather of the normed x
 * ((tp-1)/tp of [s, b, in]); row, a reduce-scatter of [s, b, out]; fused,
 * that reduce-scatter plus an all-gather of [s, b, out]. */

/* RMSNorm over the last dim (TransformerEngine's rmsnorm_fwd, zero-centered
 * gamma off): y = x / sqrt(mean(x^2) + eps) * weight, fp32 math. x [..., h]
 * F32/F16/BF16; weight [h] and y (x's shape) of x's dtype; y may be x (in
 * place). eps >= 0 and finite. All on the host, or all on the context's
 * device. */
cpar_status cpar_rmsnorm_forward(cpar_ctx *ctx, const cpar_tensor *x, const cpar_tensor *weight, float eps,
                                 cpar_tensor *y);
/* Its gradient (for training; the inference layers need none): with forward's
 * x, weight and eps and dy like x, dx (like x; may be dy) =
 * inv w dy - x inv^3 sum(dy w x) / h per row, inv = 1/sqrt(mean(x^2) + eps);
 * dweight F32 [h] += sum over rows of dy x inv (NULL: not wanted; rows are
 * summed in order, no atomics). Same placement rules as forward; scratch:
 * two floats per row from the context workspace. */
cpar_status cpar_rmsnorm_backward(cpar_ctx *ctx, const cpar_tensor *x, const cpar_tensor *weight, float eps,
                                  const cpar_tensor *dy, cpar_tensor *dx, cpar_tensor *dweight);

typedef struct cpar_inference_linear_config {
    int64_t input_size, output_size; /* global sizes, > 0; column: output_size % tp == 0, row: input_size % tp == 0 */
    cpar_dtype dtype;                /* weights and activations: F32 (0), F16 or BF16 */
    float eps;                       /* column: the RMSNorm epsilon (layernorm_epsilon); 0 -> 1e-5 */
} cpar_inference_linear_config;

typedef struct cpar_inference_linear cpar_inference_linear;

/* Create on tp's context: weight zero, norm weight one (column). Collective-free. */
cpar_status cpar_inference_column_create(cpar_group *tp, const cpar_inference_linear_config *cfg,
                                         cpar_inference_linear **out);
cpar_status cpar_inference_row_create(cpar_group *tp, const cpar_inference_linear_config *cfg,
                                      cpar_inference_linear **out);
cpar_status cpar_inference_destroy(cpar_inference_linear *l); /* NULL is fine */

/* master_weight: host F32 [output_size, input_size], the same on every rank;
 * this rank takes its rows (column) or columns (row), rounded to the dtype.
 * master_norm_weight (column only; NULL keeps ones, must be NULL for a row
 * layer): host F32 [input_size]. No communication. */
cpar_status cpar_inference_init_from_master(cpar_inference_linear *l, const cpar_tensor *master_weight,
                                            const cpar_tensor *master_norm_weight);
/* Views on the context's device (norm weight: data NULL for a row layer). */
cpar_tensor cpar_inference_weight(const cpar_inference_linear *l);
cpar_tensor cpar_inference_norm_weight(const cpar_inference_linear *l);
/* The seed's skip_norm_and_all_gather flag (column layers; false at creation). */
cpar_status cpar_inference_set_skip_norm_and_all_gather(cpar_inference_linear *l, bool skip);

/* The forward of either layer with the shapes of the section comment. y may
 * not overlap x. */
cpar_status cpar_inference_forward(cpar_inference_linear *l, const cpar_tensor *x, cpar_tensor *y);
/* Row layers: the forward fused with the next layer's RMSNorm. residual
 * [s/tp, b, out] is updated in place; next_norm_weight [out]; normed
 * [s, b, out] (the next column layer's input with skip_norm_and_all_gather).
 * eps: 0 -> 1e-5. No two of x, residual, normed may overlap. */
cpar_status cpar_inference_row_forward_fused(cpar_inference_linear *l, const cpar_tensor *x, cpar_tensor *residual,
                                             const cpar_tensor *next_norm_weight, float eps, cpar_tensor *normed);
/* The fused collective on its own (fused_multimem_rs_add_norm_ag's result):
 * partial [s, b, h] this rank's partial sums; residual [s/tp, b, h] +=
 * reduce-scatter(partial) along dim 0; out [s, b, h] = all-gather along dim
 * 0 of RMSNorm(residual, weight [h], eps). Same dtype, the context's device;
 * no two of partial, residual, out may overlap. */
cpar_status cpar_inference_rs_add_rmsnorm_ag(cpar_group *tp, const cpar_tensor *partial, cpar_tensor *residual,
                                             const cpar_tensor *weight, float eps, cpar_tensor *out);


/* ==== 15. Training: AdamW, gradient norm and clipping, gradient reduction ====
 * What every training loop does between the backward and the next forward
 * (torch.optim.AdamW, torch.nn.utils.clip_grad_norm_, Megatron's
 * DistributedDataParallel grad buffer and get_grad_norm_fp32), on every
 * backend: host loops on host tensors, one fused kernel per tensor on
 * devices. Gradients are the layers' F32 main grads. */

typedef struct cpar_adamw_config {
    float lr;           /* this step's learning rate (the caller's schedule), >= 0 */
    float beta1, beta2; /* 0 -> 0.9 and 0.999 (PyTorch's defaults); else in (0, 1) */
    float eps;          /* 0 -> 1e-8 */
    float weight_decay; /* decoupled, >= 0: master *= 1 - lr * weight_decay first; 0: none */
} cpar_adamw_config;

/* One AdamW step on one parameter, in one pass over it (PyTorch's formula):
 *   g = grad * grad_scale                 (grad_scale: 1, or a clipping factor)
 *   master *= 1 - lr * weight_decay
 *   m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g^2
 *   master -= lr / (1 - beta1^step) * m / (sqrt(v / (1 - beta2^step)) + eps)
 *   param = master rounded to param's dtype
 * grad, master, m, v: F32 of one shape; param: that shape in F32, F16 or BF16,
 * or NULL (the parameter is master itself). step: the 1-based step t of the
 * bias corrections. All tensors on the context's device, or all on the host;
 * none may overlap except param == master. Non-finite values are not checked
 * (cpar_grad_norm reports them). */
cpar_status cpar_adamw_step(cpar_ctx *ctx, const cpar_adamw_config *cfg, int64_t step, float grad_scale,
                            const cpar_tensor *grad, cpar_tensor *master, cpar_tensor *m, cpar_tensor *v,
                            cpar_tensor *param);

/* The global L2 norm of a model's gradients spread over the grid, each
 * parameter counted exactly once: grads[i] (F32, this rank's piece) is a
 * shard of a tensor split over tp, summed over tp, unless tp_duplicate[i]
 * (the tensor is replicated over tp, e.g. a norm weight: counted on tp rank
 * 0 only, Megatron's param_is_not_tensor_parallel_duplicate). Call it after
 * the data-parallel reduction (cpar_grads_all_reduce over dp x cp): replicas
 * over cp and dp then hold the same sums, so nothing is summed over them.
 * tp_duplicate may be NULL (nothing replicated). Every rank gets the same
 * *norm (NaN or inf when a gradient is not finite). Sums of squares in fp64
 * per tensor; one all-reduce of one value over tp. */
cpar_status cpar_grad_norm(cpar_group *tp, const cpar_tensor *const *grads, const bool *tp_duplicate, int n,
                           float *norm);
/* torch.nn.utils.clip_grad_norm_ (Megatron's clip_grad_norm_fp32): *norm as
 * cpar_grad_norm, then when max_norm / (norm + 1e-6) < 1 every gradient is
 * multiplied by it; *coef (may be NULL) gets the factor applied (1 when
 * none). Alternatively pass that factor to cpar_adamw_step as grad_scale
 * after cpar_grad_norm and skip this pass over the gradients. max_norm > 0.
 * A non-finite norm (a NaN or inf gradient) scales nothing: *norm reports it
 * (NaN or inf), *coef is 1 and the call returns CPAR_OK, so the caller
 * decides, as Megatron's optimizer does (skip the step, or stop: build/train
 * stops with the step and the value). */
cpar_status cpar_clip_grad_norm(cpar_group *tp, cpar_tensor *const *grads, const bool *tp_duplicate, int n,
                                float max_norm, float *norm, float *coef);

/* Sum (average: divide by the group size) gradients over g, usually
 * cpar_grid_group(ctx, CPAR_GROUP_DP_CP), as one flat buffer: the tensors
 * are packed into the context workspace, all-reduced in a single collective
 * and unpacked (Megatron's coalesced DDP grad buffer), so the statistics show
 * one all-reduce of the total bytes, not one per tensor. F32 tensors on the
 * context's device, none overlapping. A group of size 1 changes nothing but
 * still averages by 1. */
cpar_status cpar_grads_all_reduce(cpar_group *g, cpar_tensor *const *grads, int n, bool average);


/* ==== 16. Internal: the device layer =========================================
 * Compiled only where CPAR_INTERNAL is defined before cpar.h is included:
 * cpar.c, cpar_kernels.cu and the tests that drive kernels directly define it.
 * Not part of the user API: names and signatures change between versions
 * without notice. A program that needs a device count calls cpar_device_count
 * (§7). The blocks below follow the sections whose operations they serve. */
#ifdef CPAR_INTERNAL

/* ---- conventions, memory, streams, events, GEMM, element-wise kernels (for §2-§6) ----
 * Implemented in cpar_kernels.cu (nvcc for GPUs; g++ with tests/cudasim.h for
 * the sim build). cpar.c reaches the GPU only through these functions, so it
 * never includes a CUDA header. Not part of the user API: signatures may
 * change between versions. Pointers are device pointers unless named h_*.
 * Streams may be NULL (the legacy default stream). On failure each returns
 * CPAR_ERR_CUDA / CPAR_ERR_CUBLAS / CPAR_ERR_OOM / CPAR_ERR_INVALID and leaves
 * one line in cpar_dev_last_error() (thread-local). */

typedef struct cpar_dev_stream_s *cpar_dev_stream; /* cudaStream_t */
typedef struct cpar_dev_event_s *cpar_dev_event;   /* cudaEvent_t */
typedef struct cpar_dev_blas_s *cpar_dev_blas;     /* cublasHandle_t */

typedef enum cpar_copy_kind { CPAR_COPY_H2D = 0, CPAR_COPY_D2H, CPAR_COPY_D2D, CPAR_COPY_H2H } cpar_copy_kind;

const char *cpar_dev_last_error(void);
/* Number of usable GPUs (cpar_device_count's); 0 when there is no driver, no
 * device or none of compute capability 8.0 or newer (never fails; the reason
 * stays in cpar_dev_last_error()). */
int cpar_dev_count(void);
cpar_status cpar_dev_set(int device);
cpar_status cpar_dev_peer_access(int peer); /* kernels on the current device reach peer's memory */
/* *can: whether kernels on device may reach peer's memory (cudaDeviceCanAccessPeer; true for peer == device) */
cpar_status cpar_dev_peer_query(int device, int peer, bool *can);
cpar_status cpar_dev_malloc(void **p, size_t bytes);
cpar_status cpar_dev_free(void *p);
cpar_status cpar_dev_host_alloc(void **p, size_t bytes); /* cudaMallocHost */
cpar_status cpar_dev_host_free(void *p);                 /* cudaFreeHost */
cpar_status cpar_dev_memset(void *p, int byte, size_t bytes, cpar_dev_stream s);
/* Asynchronous on s; a D2H copy is complete when cpar_dev_stream_sync(s) returns. */
cpar_status cpar_dev_memcpy(void *dst, const void *src, size_t bytes, cpar_copy_kind kind, cpar_dev_stream s);
/* Pitched copy of rows rows of row_bytes bytes (any kind); what split and
 * concatenation along any dimension reduce to. Runs as a kernel for D2D. */
cpar_status cpar_dev_copy_2d(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t row_bytes,
                             size_t rows, cpar_copy_kind kind, cpar_dev_stream s);
cpar_status cpar_dev_sync(void); /* cudaDeviceSynchronize */

cpar_status cpar_dev_stream_create(cpar_dev_stream *s); /* non-blocking: not ordered with the legacy NULL stream */
cpar_status cpar_dev_stream_destroy(cpar_dev_stream s);
cpar_status cpar_dev_stream_sync(cpar_dev_stream s);
/* *done = whether all work queued on s has completed (cudaStreamQuery); lets
 * cpar_sync wait with a deadline and watch NCCL for asynchronous errors. */
cpar_status cpar_dev_stream_query(cpar_dev_stream s, bool *done);
cpar_status cpar_dev_event_create(cpar_dev_event *e);
cpar_status cpar_dev_event_destroy(cpar_dev_event e);
cpar_status cpar_dev_event_record(cpar_dev_event e, cpar_dev_stream s);
cpar_status cpar_dev_stream_wait_event(cpar_dev_stream s, cpar_dev_event e);
cpar_status cpar_dev_event_sync(cpar_dev_event e);

cpar_status cpar_dev_blas_create(cpar_dev_blas *h);
cpar_status cpar_dev_blas_destroy(cpar_dev_blas h);
/* cublasGemmStridedBatchedEx semantics, column-major:
 *   C_i = alpha * op(A_i) * op(B_i) + beta * C_i,  i < batch,
 * op(A) is m x k, op(B) is k x n, C is m x n; trans* nonzero = transpose.
 * A and B share a dtype (F32, F16 or BF16); C is F32 or A's dtype; compute is
 * fp32 (CUBLAS_COMPUTE_32F). */
cpar_status cpar_dev_gemm(cpar_dev_blas h, cpar_dev_stream s, int transa, int transb, int m, int n, int k,
                          float alpha, const void *A, cpar_dtype ab_dtype, int lda, int64_t stride_a,
                          const void *B, int ldb, int64_t stride_b, float beta, void *C, cpar_dtype c_dtype,
                          int ldc, int64_t stride_c, int batch);

/* Kernels (one launch each, bounds-checked, odd sizes fine). n = element count. */
cpar_status cpar_dev_fill(void *p, cpar_dtype dt, int64_t n, double value, cpar_dev_stream s);
/* dst = src converted; float dtypes (F32/F16/BF16) in any pair, or equal dtypes. */
cpar_status cpar_dev_cast(void *dst, cpar_dtype dst_dt, const void *src, cpar_dtype src_dt, int64_t n,
                          cpar_dev_stream s);
/* y = alpha*x + beta*y in fp32; x, y of dtype dt (F32/F16/BF16). */
cpar_status cpar_dev_axpby(float alpha, const void *x, float beta, void *y, cpar_dtype dt, int64_t n,
                           cpar_dev_stream s);
/* acc = op(acc, src) elementwise, MAX/MIN with fmaxf/fminf semantics (a NaN
 * loses to a number, as in NCCL). For float src dtypes acc is F32 (fp32
 * accumulation of F16/BF16 inputs); for I32/I64/U8 acc has src's dtype. */
cpar_status cpar_dev_reduce_into(void *acc, const void *src, cpar_dtype src_dt, int64_t n, cpar_reduce_op op,
                                 cpar_dev_stream s);
/* out[r] = op over the last dimension of in [rows, cols] (float dtype), fp32 out. */
cpar_status cpar_dev_row_reduce(float *out, const void *in, cpar_dtype dt, int64_t rows, int64_t cols,
                                cpar_row_op op, cpar_dev_stream s);
/* dy == NULL: out = gelu(x); else out = dy * gelu'(x). [n] of dt (F32/F16/BF16). */
cpar_status cpar_dev_gelu(const void *x, const void *dy, void *out, cpar_dtype dt, int64_t n, cpar_dev_stream s);

/* ---- for §9: RNG and dropout -----------------------------------------------
 * dt is F32, F16 or BF16; (seed, offset) the state of the draw; n elements. */
cpar_status cpar_dev_rng_uniform(void *p, cpar_dtype dt, int64_t n, uint64_t seed, uint64_t offset, float lo,
                                 float hi, cpar_dev_stream s);
cpar_status cpar_dev_rng_normal(void *p, cpar_dtype dt, int64_t n, uint64_t seed, uint64_t offset, float mean,
                                float std, cpar_dev_stream s);
/* y = (x * keep) * scale, keep = u_i >= p; mask (may be NULL) = keep as 0/1. */
cpar_status cpar_dev_dropout_forward(const void *x, void *y, uint8_t *mask, cpar_dtype dt, int64_t n, float p,
                                     float scale, uint64_t seed, uint64_t offset, cpar_dev_stream s);
/* dx = (dy * keep) * scale, keep = mask[i] != 0 when mask, else u_i >= p. */
cpar_status cpar_dev_dropout_backward(const void *dy, void *dx, const uint8_t *mask, cpar_dtype dt, int64_t n,
                                      float p, float scale, uint64_t seed, uint64_t offset, cpar_dev_stream s);

/* ---- for §10: the cross entropy --------------------------------------------
 * rows tokens, cols = v_local, first = this rank's first vocabulary index,
 * vocab = V. Targets tdt I32/I64. All float buffers F32 on the device. */

/* One pass over logits [rows, cols] (dt): m_loc[r] = local max; part[r] =
 * sum_j exp(z_j - m_loc[r]); part[rows + r] = z[t - first] when this rank owns
 * t, 0 when another rank does, NaN when t is outside [0, vocab); with smooth,
 * part[2 rows + r] = sum_j z_j. */
cpar_status cpar_dev_xent_local(const void *logits, cpar_dtype dt, const void *target, cpar_dtype tdt, int64_t rows,
                                int64_t cols, int64_t first, int64_t vocab, bool smooth, float *m_loc, float *part,
                                cpar_dev_stream s);
/* After the MAX all-reduce (m = global max): part[r] *= exp(m_loc[r] - m[r]). */
cpar_status cpar_dev_xent_rescale(float *part, const float *m_loc, const float *m, int64_t rows, cpar_dev_stream s);
/* After the SUM all-reduce: lse = m + log(part[r]); loss[r] = (m - part[rows+r]
 * + log part[r]) scaled as above with s (smooth: using part[2 rows + r]);
 * stats[2r] = m, stats[2r+1] = lse. */
cpar_status cpar_dev_xent_finalize(const float *m, const float *part, int64_t rows, int64_t vocab, float s, bool smooth,
                                   float *loss, float *stats, cpar_dev_stream st);
/* dlogits[r, j] = (exp(z - lse) - (1-s)[first + j == t] - s/vocab) * dloss[r]
 * (NaN rows for t outside [0, vocab)); dlogits may equal logits. */
cpar_status cpar_dev_xent_backward(const void *logits, void *dlogits, cpar_dtype dt, const void *target,
                                   cpar_dtype tdt, const float *stats, const float *dloss, int64_t rows, int64_t cols,
                                   int64_t first, int64_t vocab, float s, cpar_dev_stream st);

/* ---- for §10: the embedding ------------------------------------------------
 * Token (i, j) of ids [b, s] has its embedding row at i*s + j, or at j*b + i
 * when seq_first ([s, b, H] layout). */
/* out row of token = weight[id - first] when first <= id < first + v_local, else 0. */
cpar_status cpar_dev_embedding_lookup(const void *weight, cpar_dtype dt, const void *ids, cpar_dtype idt, int64_t b,
                                      int64_t s, int64_t hidden, int64_t first, int64_t v_local, bool seq_first,
                                      void *out, cpar_dev_stream st);
/* dweight [v_local, hidden] f32 += dout rows of the tokens each row owns:
 * by atomics, or (deterministic) by sorting the tokens by row once and
 * summing each row's tokens in order (scratch: 8-byte aligned, of
 * cpar_dev_embedding_grad_scratch_bytes(b * s); unused by atomics). */
size_t cpar_dev_embedding_grad_scratch_bytes(int64_t tokens);
cpar_status cpar_dev_embedding_grad(const void *dout, cpar_dtype dt, const void *ids, cpar_dtype idt, int64_t b,
                                    int64_t s, int64_t hidden, int64_t first, int64_t v_local, bool seq_first,
                                    float *dweight, bool deterministic, void *scratch, cpar_dev_stream st);

/* ---- for §11: the linear layers --------------------------------------------
 * None: the linear layers need no kernels of their own. The GEMMs, the bias
 * add (a k = 1 rank-one update y += bias 1^T) and the bias-grad column sums
 * (db += dy^T 1) are cpar_dev_gemm calls; the ones vector is cpar_dev_fill. */

/* ---- for §12: local attention ----------------------------------------------
 * One block of attention on device buffers, as cpar.c §18 describes:
 * rows of d contiguous elements; (batch, head) slices q_bh / kv_bh / o_bh /
 * lse_bh / dq_bh / dkv_bh elements apart, so a sub-range of the sequence is a
 * pointer offset with the parent's strides. Element (batch bi, head hi, row i,
 * col c) of q is at (bi*hq + hi)*q_bh + i*d + c; of k and v at
 * (bi*hkv + hi/(hq/hkv))*kv_bh + j*d + c; of lse at (bi*hq + hi)*lse_bh + i. */
/* The global sequence positions of a block's rows (queries or keys).
 * Plain (cu NULL): rows [0, split) are at off0, off0 + 1, ..., rows
 * [split, n) at off1, off1 + 1, ... — two segments, as a load-balanced CP
 * shard holds two chunks; a sub-range of the rows is cpar.c's
 * cpar__attn_pos_sub. Zeroed: position = row index.
 * Packed (cu set, cpar.h §12 "packed sequences"): the rows are rank `rank`'s
 * shard of the packing cu (the padded boundaries, n_docs + 1 of them, device
 * memory on devices) among P ranks (P = 1: the whole packed buffer), cu_real
 * the real boundaries (cu itself without padding). Each row has a global
 * position and a document (padding rows none). When both q and k rows are
 * packed, query i sees key j only in the same document, and causal compares
 * their global positions (the ring's blocks pair any two shards). */
typedef struct cpar_dev_attn_pos {
    int64_t split, off0, off1;
    const int32_t *cu, *cu_real;
    int n_docs, P, rank;
} cpar_dev_attn_pos;

typedef struct cpar_dev_attn {
    cpar_dtype dt;                  /* q, k, v: F16 or BF16 on devices (F32 too on the host path) */
    int64_t b, hq, hkv, sq, sk, d;  /* hq % hkv == 0; sq, sk >= 1; d <= 128, d % 8 == 0 on devices */
    const void *q, *k, *v;
    int64_t q_bh, kv_bh;
    bool causal;                    /* top-left: query i sees keys j <= i */
    float scale;                    /* > 0, already resolved */
    /* dropout (cpar.h §12 "attention dropout"): p in [0, 1), 0 = none; the
     * mask of element (bh, i, j) from rng, bh and the global positions
     * qpos(i), kpos(j) of qp and kp; bh is the (batch, head) index of the
     * whole attention (this block's bi·hq + hi) */
    float dropout_p;
    cpar_rng_state rng;
    cpar_dev_attn_pos qp, kp;
    /* the mask's (batch, head) index when this block holds heads [mask_h0,
     * mask_h0 + hq) of an attention with mask_hq heads (the all-to-all CP's
     * head shard): bh = bi·mask_hq + mask_h0 + hi; mask_hq 0: bi·hq + hi */
    int64_t mask_hq, mask_h0;
    /* backward only: dq added by fp32 atomics from the dk/dv kernel
     * (FlashAttention-2's single pass: 5 GEMM-equivalents, not 7), dq's last
     * bits then vary run to run; false: a separate dq kernel, reproducible.
     * cpar's layers set it from CPAR_ATTN_DQ=atomic. */
    bool atomic_dq;
    /* forward only: its CTAs in batch·head order, each head's query tiles
     * far apart (cpar's order until 2026-12-07); false: a head's query
     * tiles side by side, as FlashAttention-2 orders them, so the CTAs in
     * flight share a few heads' K and V in L2. cpar's layers set it from
     * CPAR_ATTN_FWD_GRID=heads. */
    bool fwd_heads_first;
} cpar_dev_attn;

/* out (dtype out_dt: F32 or a->dt, stride o_bh) and lse (F32, stride lse_bh)
 * overwritten. A row that sees no key: lse = -inf, out row 0. */
cpar_status cpar_dev_attention_fwd(const cpar_dev_attn *a, void *out, cpar_dtype out_dt, int64_t o_bh, float *lse,
                                   int64_t lse_bh, cpar_dev_stream s);
/* Device scratch cpar_dev_attention_bwd needs (bytes; 0 is valid). */
size_t cpar_dev_attention_bwd_scratch_bytes(const cpar_dev_attn *a);
/* Accumulate (+=) in fp32: dq [b,hq,sq,d] (stride dq_bh), dk and dv
 * [b,hkv,sk,d] (stride dkv_bh). out and dout (dtype out_dt, stride o_bh) and
 * lse (stride lse_bh) are those of the whole attention this block belongs
 * to: P = exp(scale·q kᵀ - lse), D_i = rowsum(dout_i ∘ out_i); a row with
 * lse = -inf contributes nothing. scratch: cpar_dev_attention_bwd_scratch_bytes. */
cpar_status cpar_dev_attention_bwd(const cpar_dev_attn *a, const void *out, const void *dout, cpar_dtype out_dt,
                                   int64_t o_bh, const float *lse, int64_t lse_bh, float *dq, int64_t dq_bh,
                                   float *dk, float *dv, int64_t dkv_bh, void *scratch, cpar_dev_stream s);

/* ---- for §12: the ring's merge ---------------------------------------------
 * The _SDPAMerger step for rows blocks of d floats: for each (batch, head)
 * slice j < nbh and row i < rows, with o = out + j*o_bh + i*d,
 * ob = out_b + j*o_bh + i*d, l = lse[j*lse_bh + i], lb = lse_b[j*lse_bh + i]:
 *   lb == -inf: nothing; l == -inf: o = ob, l = lb; else
 *   o -= sigmoid(lb - l) (o - ob), l -= logsigmoid(l - lb).
 * A partial merge (second half of the rows) is a pointer offset. All fp32. */
cpar_status cpar_dev_ring_merge(float *out, float *lse, const float *out_b, const float *lse_b, int64_t nbh,
                                int64_t rows, int64_t d, int64_t o_bh, int64_t lse_bh, cpar_dev_stream s);

/* ---- for §13: Mamba CP -----------------------------------------------------
 * The channel -> cp = 1 row mapping of the conv1d: local channel c lies in
 * segment i (seg_len[0..2]: x, B, C, in that order) at offset o, and reads
 * row seg_row[i] + o of weight [conv_dim, K] and bias [conv_dim]. */
typedef struct cpar_dev_conv_rows {
    int64_t seg_len[3], seg_row[3];
} cpar_dev_conv_rows;

/* y [s*b, C] (dt) = conv of x (dt, row pitch x_pitch elements, channel c at
 * column c of each row: the caller offsets x by x_col) as above; w, bias
 * (bias may be NULL) of dtype pdt. tokens = s*b; token (t, bi) is row t*b+bi. */
cpar_status cpar_dev_mamba_conv1d_forward(const void *x, int64_t x_pitch, cpar_dtype dt, const void *w,
                                          const void *bias, cpar_dtype pdt, cpar_dev_conv_rows rows, int64_t s,
                                          int64_t b, int64_t channels, int k, bool silu, void *y,
                                          cpar_dev_stream st);
/* dx (row pitch x_pitch, offset like x) = the input gradient; partial F32
 * [nsplit, K+1, C] scratch: split p holds the weight (j < K) and bias (j == K)
 * gradient sums of its share of the tokens; then dw[row(c), j] += sum over p
 * in order, dbias[row(c)] += likewise (dbias may be NULL). nsplit >= 1. */
cpar_status cpar_dev_mamba_conv1d_backward(const void *x, int64_t x_pitch, cpar_dtype dt, const void *w,
                                           const void *bias, cpar_dtype pdt, cpar_dev_conv_rows rows, int64_t s,
                                           int64_t b, int64_t channels, int k, bool silu, const void *dy, void *dx,
                                           float *partial, int nsplit, float *dw, float *dbias, cpar_dev_stream st);
/* dst[g*dst_gs + t*dst_pitch + c] = sum_{q < reps} src[g*src_gs + q*rep_stride
 * + t*src_pitch + c] for g < groups, t < rows, c < cols (elements of dt,
 * F32/F16/BF16; fp32 sum in q order, rounded once): the B/C replica gradients. */
cpar_status cpar_dev_mamba_sum_replicas(void *dst, int64_t dst_gs, int64_t dst_pitch, const void *src, int64_t src_gs,
                                        int64_t rep_stride, int64_t src_pitch, int64_t groups, int64_t reps,
                                        int64_t rows, int64_t cols, cpar_dtype dt, cpar_dev_stream st);

/* ---- for §12 and §13: packed sequences (THD) --------------------------------
 * Rows of row_bytes between the natural packing nat (outer slices nat_pitch
 * bytes apart, each total = cu[n_docs] rows) and the blocks of ranks
 * [r0, r0 + nranks) of p (block k at blk + k blk_stride: outer slices
 * blk_pitch bytes apart, each total/p rows in §12's packed layout: chunks r
 * and 2p-1-r of every document). cu: HOST int32 [n_docs + 1], the (padded)
 * boundaries, already validated (each document's length a multiple of 2p);
 * read during the call and passed to the kernel by value (256 documents per
 * launch). to_blocks: nat -> blocks (shard, redo), else blocks -> nat
 * (unshard, undo). Nothing else is touched. */
cpar_status cpar_dev_packed_reorder(void *nat, size_t nat_pitch, void *blk, size_t blk_pitch, size_t blk_stride,
                                    int r0, int nranks, int p, const int32_t *cu, int n_docs, int64_t outer,
                                    size_t row_bytes, bool to_blocks, cpar_dev_stream st);

/* ---- for §14: RMSNorm (cpar_kernels.cu §19) --------------------------------
 * x, add (NULL: none), weight [h], y: elements of dt (F32/F16/BF16), rows of
 * h. With add: x += add (rounded to dt, stored back), then the norm of the
 * sum. y = x * rsqrt(mean(x^2) + eps) * weight; y may be x only without add. */
cpar_status cpar_dev_rmsnorm(void *x, const void *add, const void *weight, cpar_dtype dt, int64_t rows, int64_t h,
                             float eps, void *y, cpar_dev_stream s);
/* dx (may be dy) from x, weight, dy; scratch (F32,
 * cpar_dev_rmsnorm_backward_scratch_bytes): dweight's partial column sums
 * over chunks of rows and, for rows too wide for the fused kernel, each row's
 * 1/rms and dx coefficient; dweight (F32 [h], NULL: skipped) += column sums
 * of dy x inv, read before dx is written. */
size_t cpar_dev_rmsnorm_backward_scratch_bytes(int64_t rows, int64_t h);
cpar_status cpar_dev_rmsnorm_backward(const void *x, const void *weight, const void *dy, cpar_dtype dt, int64_t rows,
                                      int64_t h, float eps, void *dx, float *dweight, float *scratch,
                                      cpar_dev_stream s);

/* ---- for §15: training (cpar_kernels.cu §21) -------------------------------
 * cpar_dev_adamw: the formula of cpar_adamw_step over n elements; bc1, bc2
 * are 1 - beta1^t and 1 - beta2^t; param of pdt or NULL.
 * cpar_dev_sum_squares: *out (device F32) += sum of x[i]^2, x F32 [n],
 * deterministic (a fixed tree of block sums, no atomics); scratch holds
 * cpar_dev_sum_squares_scratch(n) bytes of device memory. */
cpar_status cpar_dev_adamw(float *master, float *m, float *v, const float *grad, void *param, cpar_dtype pdt, int64_t n,
                           float lr, float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2,
                           float grad_scale, cpar_dev_stream s);
size_t cpar_dev_sum_squares_scratch(int64_t n);
cpar_status cpar_dev_sum_squares(const float *x, int64_t n, float *out, void *scratch, cpar_dev_stream s);

#endif /* CPAR_INTERNAL */

#ifdef __cplusplus
}
#endif
#endif /* CPAR_H */
