/* SPDX-License-Identifier: MIT */
/* tests/ncclsim/ncclsim_hooks.h — the CUDA simulator's answers the NCCL
 * simulator needs (defined in ncclsim_cudasim.cc). */
#ifndef NCCLSIM_HOOKS_H
#define NCCLSIM_HOOKS_H

#include <stddef.h>

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

#ifdef __cplusplus
}
#endif
#endif
