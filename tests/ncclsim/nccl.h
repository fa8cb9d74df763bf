/* SPDX-License-Identifier: MIT */
/* tests/ncclsim/nccl.h — the NCCL API subset that cpar uses, for the NCCL
 * simulator (tests/ncclsim/ncclsim.c).
 *
 * The nccl-sim build puts tests/ncclsim ahead of the system include path, so
 * `#include <nccl.h>` in cpar.c finds this header and cpar.c compiles exactly
 * as in the CUDA build (CPAR_WITH_DEVICE, CPAR_WITH_NCCL). The declarations
 * are written from NCCL's documented API (the user guide's "Types",
 * "Communicator Creation and Management", "Collective Communication",
 * "Group Calls" and "Point-To-Point" pages); enum values are the documented
 * ones. It declares nothing the simulator does not implement.
 *
 * cudaStream_t is the CUDA simulator's (tests/cudasim.h): an opaque pointer
 * to struct CUstream_st, declared here so that C code needs no CUDA header. */
#ifndef NCCLSIM_NCCL_H
#define NCCLSIM_NCCL_H

#include <limits.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 0
#define NCCL_VERSION(X, Y, Z) (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))
#define NCCL_VERSION_CODE NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)
#define NCCLSIM 1 /* tells the simulator apart from the real library */

struct CUstream_st;
typedef struct CUstream_st *cudaStream_t;

typedef struct ncclComm *ncclComm_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
    ncclNumResults = 8
} ncclResult_t;

typedef enum {
    ncclInt8 = 0, ncclChar = 0,
    ncclUint8 = 1,
    ncclInt32 = 2, ncclInt = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6, ncclHalf = 6,
    ncclFloat32 = 7, ncclFloat = 7,
    ncclFloat64 = 8, ncclDouble = 8,
    ncclBfloat16 = 9,
    ncclNumTypes = 10
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5 } ncclRedOp_t;

/* Communicator options. A config must start from NCCL_CONFIG_INITIALIZER;
 * fields left undefined take NCCL's defaults (blocking = 1). The simulator
 * reads `blocking` and checks size, magic and version; the performance hints
 * are accepted and ignored. */
#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_UNDEF_PTR NULL
#define NCCL_SPLIT_NOCOLOR (-1)
typedef struct ncclConfig_v22800 {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cgaClusterSize;
    int minCTAs;
    int maxCTAs;
    const char *netName;
    int splitShare;
} ncclConfig_t;
#define NCCLSIM_CONFIG_MAGIC 0xcafebeefu
#define NCCL_CONFIG_INITIALIZER                                                                              \
    {                                                                                                        \
        sizeof(ncclConfig_t), NCCLSIM_CONFIG_MAGIC, NCCL_VERSION_CODE, NCCL_CONFIG_UNDEF_INT,               \
            NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_PTR,      \
            NCCL_CONFIG_UNDEF_INT                                                                            \
    }

/* ---- communicators ---- */
ncclResult_t ncclGetVersion(int *version);
ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t *config);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank);
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device);
const char *ncclGetErrorString(ncclResult_t result);
const char *ncclGetLastError(ncclComm_t comm);

/* ---- collectives ---- */
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);

/* ---- point to point ---- */
ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream);

/* ---- groups ---- */
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

/* ---- the simulator's own (tests) ---- */
/* How many of the simulator's segments in /dev/shm ("ncclsim-<pid>-<token>",
 * pid: the process that made the unique id) are left over: made by this
 * process or by one that has ended. Other processes' live jobs do not count. */
int ncclsim_leftover_segments(void);

#ifdef __cplusplus
}
#endif
#endif /* NCCLSIM_NCCL_H */
