/* cpar.h — a minimal C runtime for model parallelism on NVIDIA GPUs.
 *
 * Megatron-style tensor, sequence and context parallelism as one static
 * library on NCCL and cuBLAS: no MPI, no Python. Copy cpar.h, cpar.c and
 * cpar_kernels.cu into a project (or link libcpar.a).
 *
 * Conventions (see README.md and DESIGN.md):
 *  - Every function returns cpar_status; on failure cpar_last_error() gives one
 *    line naming the function, the argument and what was expected.
 *  - Configuration structs are passed by pointer; a zero field means the
 *    documented default (sokol style).
 *  - Tensors are contiguous, row-major, and owned by the caller; outputs are
 *    preallocated by the caller and checked.
 *  - Device work is stream-ordered: cpar_sync(ctx) waits for it.
 *  - The library never exits, aborts or prints unless CPAR_LOG=info|debug.
 *
 * Contents
 *   1. Status codes and errors
 *   2. Data types and tensors
 *   3. Contexts, backends and start-up
 *   4. Groups and the parallel grid
 *   5. Raw collectives and communication statistics
 *   6. Element-wise and layout operations (host reference + CUDA kernels)
 *   7. Device layer (internal: implemented in cpar_kernels.cu, used by cpar.c)
 */
#ifndef CPAR_H
#define CPAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CPAR_VERSION_MAJOR 0
#define CPAR_VERSION_MINOR 1

/* ==== 1. Status codes and errors ======================================== */

typedef enum cpar_status {
    CPAR_OK = 0,
    CPAR_ERR_INVALID,     /* bad argument: NULL, shape, dtype, device, divisibility, group */
    CPAR_ERR_CUDA,        /* a CUDA runtime call failed (or no GPU where one is needed) */
    CPAR_ERR_NCCL,        /* an NCCL call failed or the communicator reported an async error */
    CPAR_ERR_CUBLAS,      /* a cuBLAS call failed */
    CPAR_ERR_SYSTEM,      /* socket, thread, process or file failure (errno in the message) */
    CPAR_ERR_TIMEOUT,     /* a wait passed its deadline; the message names who is missing */
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
int64_t cpar_tensor_numel(const cpar_tensor *t);
size_t cpar_tensor_nbytes(const cpar_tensor *t);

/* Allocate on the context's device (host memory on the host backend,
 * simulated device memory on the sim backend, the rank's GPU on NCCL).
 * The memory is uninitialised. Free with cpar_tensor_free (NULL data is fine). */
cpar_status cpar_tensor_alloc(cpar_ctx *ctx, cpar_dtype dtype, int ndim, const int64_t *shape, cpar_tensor *out);
cpar_status cpar_tensor_free(cpar_ctx *ctx, cpar_tensor *t);

/* dst <- src, any direction (host<->device, device<->device). Same dtype and
 * element count (shapes may differ: a reshape). Stream-ordered on the context's
 * compute stream; a copy into host memory is complete when it returns. */
cpar_status cpar_tensor_copy(cpar_ctx *ctx, const cpar_tensor *src, cpar_tensor *dst);

/* ==== 3. Contexts, backends and start-up ================================= */

typedef enum cpar_backend {
    CPAR_BACKEND_HOST = 0, /* ranks are threads of one process; host memory; shared-memory collectives */
    CPAR_BACKEND_NCCL,     /* one GPU per rank; NCCL communicators; needs a CPAR_CUDA=1 build */
    CPAR_BACKEND_SIM,      /* host backend's communication over simulated device memory (test builds) */
    CPAR_BACKEND_COUNT
} cpar_backend;

const char *cpar_backend_name(cpar_backend b); /* "host", "nccl", "sim" */
/* True when this build can run backend b here (NCCL: built with CUDA and at
 * least one GPU visible; SIM: built with the simulator). */
bool cpar_backend_available(cpar_backend b);

typedef struct cpar_init_config {
    cpar_backend backend;   /* 0 -> CPAR_BACKEND_HOST (cpar_init_from_env: 0 -> NCCL) */
    int timeout_ms;         /* deadline of every wait; 0 -> $CPAR_TIMEOUT_MS or 300000 */
    size_t workspace_bytes; /* initial workspace; 0 -> grows on demand while warming up */
    int device;             /* cpar_init_from_env only: GPU ordinal; 0 -> LOCAL_RANK; -1 -> 0.
                             * (cpar_spawn gives rank r the GPU r.) */
} cpar_init_config;

/* A rank's entry point for cpar_spawn. Return CPAR_OK or the failure. */
typedef cpar_status (*cpar_rank_fn)(cpar_ctx *ctx, void *arg);

/* Single-process mode: run fn(ctx, arg) on nranks threads, each with its own
 * context (rank r of nranks; on NCCL and SIM, device r). Returns CPAR_OK when
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
 * SLURM_NTASKS_PER_NODE; MASTER_ADDR defaults to 127.0.0.1). The rendezvous
 * store listens on CPAR_STORE_PORT when set, else on MASTER_PORT + 1 (torchrun
 * already holds MASTER_PORT with its own store). Rank 0 hosts the store. */
cpar_status cpar_init_from_env(const cpar_init_config *cfg, cpar_ctx **out);

/* The launch environment as cpar_init_from_env reads it. */
typedef struct cpar_env {
    int rank, world_size;             /* RANK, WORLD_SIZE (or SLURM_PROCID, SLURM_NTASKS) */
    int local_rank, local_world_size; /* LOCAL_RANK, LOCAL_WORLD_SIZE (or SLURM_LOCALID, ...) */
    char master_addr[256];            /* MASTER_ADDR; default "127.0.0.1" */
    int master_port;                  /* MASTER_PORT; default 29500 */
    int store_port;                   /* CPAR_STORE_PORT, else master_port + 1 */
    const char *source;               /* "torchrun", "slurm" or "default" (a single rank) */
} cpar_env;
/* Fill *out from the environment. Missing variables give a single-rank
 * world; inconsistent or malformed values are CPAR_ERR_INVALID naming the
 * variable (e.g. "RANK=5 is not below WORLD_SIZE=4"). */
cpar_status cpar_env_read(cpar_env *out);

/* Rendezvous key-value store over TCP (what cpar_init_from_env uses to share
 * NCCL unique ids). One process creates the server (it also gets a client
 * handle), the others connect. Keys are strings of at most 255 bytes, values
 * blobs of at most 1 MiB. Clients retry connecting until the deadline, then
 * check with a handshake that the peer is a cpar store (torchrun's store on
 * MASTER_PORT is refused clearly). The server runs on its own thread, rejects
 * malformed, unknown or oversized frames by closing that connection, drops a
 * client that stalls mid-frame past the deadline, and keeps serving the
 * others. A server that goes away gives its clients CPAR_ERR_PEER. */
typedef struct cpar_store cpar_store;
typedef struct cpar_store_config {
    const char *host; /* server: address to bind (NULL or "" -> all); client: address to reach
                       * (NULL or "" -> 127.0.0.1) */
    int port;         /* required (1..65535) */
    bool is_server;
    int timeout_ms;   /* connect and wait deadline; 0 -> $CPAR_TIMEOUT_MS or 300000 */
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

/* Release everything the context owns (groups, workspace, streams, comms).
 * Contexts made by cpar_spawn are finalised by cpar_spawn itself. */
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
 * accumulate in fp32. Host and sim backends reduce in rank order, so results
 * are bitwise reproducible. Every call is collective over the group: each
 * member must make the same calls in the same order. */

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

/* ==== 7. Device layer (internal) ========================================= */
/* Implemented in cpar_kernels.cu (nvcc for GPUs; g++ with tests/cudasim.h for
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
/* Number of usable GPUs; 0 when there is no driver or no device (never fails). */
int cpar_dev_count(void);
cpar_status cpar_dev_set(int device);
cpar_status cpar_dev_malloc(void **p, size_t bytes);
cpar_status cpar_dev_free(void *p);
cpar_status cpar_dev_memset(void *p, int byte, size_t bytes, cpar_dev_stream s);
/* Asynchronous on s; a D2H copy is complete when cpar_dev_stream_sync(s) returns. */
cpar_status cpar_dev_memcpy(void *dst, const void *src, size_t bytes, cpar_copy_kind kind, cpar_dev_stream s);
/* Pitched copy of rows rows of row_bytes bytes (any kind); what split and
 * concatenation along any dimension reduce to. Runs as a kernel for D2D. */
cpar_status cpar_dev_copy_2d(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t row_bytes,
                             size_t rows, cpar_copy_kind kind, cpar_dev_stream s);
cpar_status cpar_dev_sync(void); /* cudaDeviceSynchronize */

cpar_status cpar_dev_stream_create(cpar_dev_stream *s);
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

/* ==== 8. Tensor-parallel mappings and utilities (in progress) ============ */
#include "wip/mappings.h"
/* ==== 9. RNG, dropout and activation checkpointing (in progress) ========= */
#include "wip/rng.h"
/* ==== 10. Vocabulary-parallel embedding and cross entropy (in progress) == */
#include "wip/xent.h"

#ifdef __cplusplus
}
#endif
#endif /* CPAR_H */
