/* SPDX-License-Identifier: MIT */
/* tests/pkg_prog.c — a program as a user of cpar writes it, built the ways
 * the README tells users to: from the three copied files (make check-dropin,
 * tests/check_dropin.sh) and against an installed cpar through pkg-config
 * (make check-install, tests/check_install.sh). It all-reduces each rank's
 * number and checks the sum, so a build that links but computes nothing
 * fails. Only cpar.h's public API; no test framework.
 *
 *   pkg_prog            2 ranks as threads on the host backend
 *   pkg_prog nccl N     N ranks on the NCCL backend, one GPU each */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpar.h"

static cpar_status rank_main(cpar_ctx *ctx, void *arg) {
    (void)arg;
    cpar_group *world = cpar_world_group(ctx);
    int rank = cpar_group_rank(world), n = cpar_group_size(world);
    int64_t shape[1] = {4};
    cpar_tensor x;
    float host[4];
    cpar_tensor h = cpar_tensor_make(host, CPAR_F32, 1, shape, CPAR_HOST);
    cpar_status st = cpar_tensor_alloc(ctx, CPAR_F32, 1, shape, &x); /* on the rank's device */
    if (st != CPAR_OK) return st;
    if ((st = cpar_fill(ctx, &x, rank + 1.0)) == CPAR_OK && (st = cpar_all_reduce(world, &x, &x, CPAR_SUM)) == CPAR_OK)
        st = cpar_tensor_copy(ctx, &x, &h);
    cpar_tensor_free(ctx, &x);
    if (st != CPAR_OK) return st;
    for (int i = 0; i < 4; i++)
        if (host[i] != n * (n + 1) / 2.0f) {
            fprintf(stderr, "pkg_prog: rank %d: element %d is %g, expected %g\n", rank, i, host[i], n * (n + 1) / 2.0);
            return CPAR_ERR_INVALID;
        }
    return CPAR_OK;
}

int main(int argc, char **argv) {
    bool nccl = argc > 1 && !strcmp(argv[1], "nccl");
    int n = nccl ? (argc > 2 ? atoi(argv[2]) : 1) : 2;
    /* The header and the linked library must agree: a stale library shows here. */
    if (cpar_version_code() != CPAR_VERSION_CODE) {
        fprintf(stderr, "pkg_prog: cpar.h is version %d, the library %d (%s)\n", CPAR_VERSION_CODE,
                cpar_version_code(), cpar_version());
        return 1;
    }
    cpar_status st = cpar_spawn(n, nccl ? CPAR_BACKEND_NCCL : CPAR_BACKEND_HOST, rank_main, NULL);
    if (st != CPAR_OK) {
        fprintf(stderr, "pkg_prog: %s\n", cpar_thread_last_error());
        return 1;
    }
    printf("pkg_prog: cpar %s: all-reduce over %d ranks on the %s backend: ok\n", cpar_version(), n,
           nccl ? "NCCL" : "host");
    return 0;
}
