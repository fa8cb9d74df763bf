/* SPDX-License-Identifier: MIT */
/* tests/ncclsim/ncclsim_hooks.h — the CUDA simulator's answers the NCCL
 * simulator needs (defined in ncclsim_cudasim.cc). */
#ifndef NCCLSIM_HOOKS_H
#define NCCLSIM_HOOKS_H

#include <stddef.h>
#include <stdint.h>

#include "nccl.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { NCCLSIM_BUF_OK = 0, NCCLSIM_BUF_NOT_DEVICE = 1, NCCLSIM_BUF_PAST_END = 2 };

/* The calling thread's current device, -1 when there is none. */
int ncclsim_dev_current(void);
/* Is [p, p + bytes) inside one live device allocation? Fills the device, the
 * allocation's size and p's offset in it when p is in one. */
int ncclsim_dev_buffer(const void *p, size_t bytes, int *device, size_t *alloc_bytes, size_t *offset);
/* 1 if s is a live stream (or a default stream, device -1), else 0. */
int ncclsim_dev_stream(cudaStream_t s, int *device);
/* Runs the work queued on s so far (the CUDA simulator may defer it). */
void ncclsim_dev_stream_flush(cudaStream_t s);
/* Runs s's queue on this thread until its operation number seq has run. */
void ncclsim_dev_stream_force(cudaStream_t s, uint64_t seq);

/* 1 when stream work runs later than its issue (lazy, random), 0 (eager). */
int ncclsim_dev_streams_deferred(void);
/* An operation's output, landing in stream order (ncclsim.c). */
typedef struct ns_landing ns_landing;
enum { NCCLSIM_LAND_PENDING = 0, NCCLSIM_LAND_DONE = 1, NCCLSIM_LAND_FAILED = 2 };
/* Queues on s the copy of l's buffer to its destination, which waits for the
 * operation to end (ncclsim_land_* below). The queued copy holds one
 * reference to l, dropped when the simulator drops the copy and every
 * closure of it (a query's `ready` may still be running when another
 * thread has run the copy). */
void ncclsim_dev_stream_land(cudaStream_t s, ns_landing *l);
/* A batch's staging of its inputs (ncclsim.c). */
typedef struct ns_stage ns_stage;
/* Queues on s the staging of st's batch; *where gets the stream that holds it
 * (s resolved) and the return value its number there. Other threads' random
 * progress may run it (it takes st's lock) unless `waits`: the batch waits
 * behind another. The queued staging holds one reference to st, as the
 * copy does to its landing. */
uint64_t ncclsim_dev_stream_stage(cudaStream_t s, ns_stage *st, int waits, cudaStream_t *where);
/* The queued staging's body: waits (up to NCCLSIM_TIMEOUT_MS) until the
 * batch is posted, stages its inputs and publishes them. */
void ncclsim_stage_run(ns_stage *st);
/* Drops one reference to st; the last frees it. */
void ncclsim_stage_release(ns_stage *st);
/* May the staging run without waiting (the batch is posted, or was let go)?
 * On the issuing thread it first drives the communicator once. */
int ncclsim_stage_ready(ns_stage *st);
/* Drops one reference to l; the last frees it. */
void ncclsim_land_release(ns_landing *l);
/* l's fields, for the copy. */
int ncclsim_land_state(ns_landing *l);
/* One pass of progress on l's communicator when called on the thread that
 * issued the operation (1), else nothing (0). */
int ncclsim_land_drive(ns_landing *l);
void ncclsim_land_parts(ns_landing *l, void **dst, const void **buf, size_t *bytes);

#ifdef __cplusplus
}
#endif
#endif
