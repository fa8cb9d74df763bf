/* SPDX-License-Identifier: MIT */
/* tests/rank_prog.h — what the programs a multi-process test launches share
 * (tests/mp_prog.c, tests/hostmp_prog.c): this process's rank, TRY and CHECK
 * that report and return, and deterministic data. Define RANK_PROG ("name")
 * before including it, once. */
#ifndef CPAR_TESTS_RANK_PROG_H
#define CPAR_TESTS_RANK_PROG_H

#include <stdint.h>
#include <stdio.h>

#include "cpar.h"

static int rank = -1; /* set once cpar_init_from_env returns */

/* A cpar call that must succeed: otherwise report it and return 1. */
#define TRY(call)                                                                                            \
    do {                                                                                                     \
        cpar_status st_ = (call);                                                                            \
        if (st_ != CPAR_OK) {                                                                                \
            fprintf(stderr, RANK_PROG ": rank %d: %s -> %s: %s\n", rank, #call, cpar_status_string(st_),       \
                    cpar_thread_last_error());                                                               \
            return 1;                                                                                        \
        }                                                                                                    \
    } while (0)

/* A result check: otherwise report it and return 2. */
#define CHECK(cond, ...)                                                                                     \
    do {                                                                                                     \
        if (!(cond)) {                                                                                       \
            fprintf(stderr, RANK_PROG ": rank %d: check failed: ", rank);                                     \
            fprintf(stderr, __VA_ARGS__);                                                                    \
            fprintf(stderr, "\n");                                                                           \
            return 2;                                                                                        \
        }                                                                                                    \
    } while (0)

/* Deterministic data: value i of stream `seed`, in [-1, 1). */
static double value(uint64_t seed, int64_t i) {
    uint64_t z = seed * 0x9e3779b97f4a7c15ull + (uint64_t)i * 0xbf58476d1ce4e5b9ull + 1;
    z ^= z >> 31;
    z *= 0x94d049bb133111ebull;
    z ^= z >> 29;
    return (double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

#endif
