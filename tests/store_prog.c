/* SPDX-License-Identifier: MIT */
/* tests/store_prog.c — one rank of a multi-process store test, run under
 * cparrun (see tests/test_cparrun.c):
 *
 *   store_prog [ok]        rendezvous: cpar_store_join, 128-byte blobs all-to-all, barriers, a counter
 *   store_prog wait-go     as ok, but after the join every rank says "joined" and waits for
 *                          the key "go" (set by the test, which holds the job token)
 *   store_prog nojoin K    rank K exits 0 at once; the others must time out naming it
 *   store_prog fail K      rank K exits 3; the others sleep (cparrun must kill them)
 *   store_prog signal K    rank K dies by SIGUSR1; the others sleep
 *   store_prog sleep       every rank says "ready" and waits for a signal, which it reports
 *   store_prog ignore-term every rank ignores SIGTERM and sleeps (cparrun must SIGKILL it)
 *
 * Exit status: 0 on success, 1 when a store call failed (the error on stderr). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* POSIX and Linux APIs under -std=c11, as in cpar.c */
#endif
#include "cpar.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BLOB 128 /* sizeof(ncclUniqueId) */

static int rank = -1;

static int fail(const char *what, cpar_status st)
{
    fprintf(stderr, "store_prog: rank %d: %s failed: %s: %s\n", rank, what, cpar_status_string(st),
            cpar_thread_last_error());
    return 1;
}

static void blob_fill(unsigned char *b, int r)
{
    for (int i = 0; i < BLOB; i++)
        b[i] = (unsigned char)(r * 31 + i * 7 + 1);
}

static void on_signal(int sig)
{
    char line[64];
    int n = snprintf(line, sizeof line, "rank %d got signal %d\n", rank, sig);
    (void)!write(1, line, (size_t)n);
    _exit(0);
}

static void sleep_s(int s)
{
    struct timespec ts = {s, 0};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "ok";
    int k = argc > 2 ? atoi(argv[2]) : -1;
    cpar_env env;
    cpar_status st = cpar_env_read(&env);
    if (st != CPAR_OK)
        return fail("cpar_env_read", st);
    rank = env.rank;
    setvbuf(stdout, NULL, _IOLBF, 0);

    if (!strcmp(mode, "fail") || !strcmp(mode, "signal")) {
        if (rank == k) {
            fprintf(stderr, "rank %d failing on purpose\n", rank);
            if (!strcmp(mode, "signal"))
                raise(SIGUSR1);
            return 3;
        }
        printf("rank %d sleeping\n", rank);
        sleep_s(60);
        return 0;
    }
    if (!strcmp(mode, "sleep") || !strcmp(mode, "ignore-term")) {
        signal(SIGINT, on_signal);
        signal(SIGTERM, !strcmp(mode, "sleep") ? on_signal : SIG_IGN);
        printf("rank %d ready\n", rank);
        sleep_s(60);
        return 0;
    }
    if (!strcmp(mode, "nojoin") && rank == k) {
        printf("rank %d not joining\n", rank);
        return 0;
    }

    printf("rank %d of %d (%s), local %d of %d, store %s:%d\n", rank, env.world_size, env.source, env.local_rank,
           env.local_world_size, env.master_addr, env.store_port);
    printf("rank %d token from %s (%zu bytes), store bound to %s\n", rank, env.job_token_source,
           strlen(env.job_token), env.store_bind);
    /* As cpar_init_from_env does it: rank 0 listens on store_bind, the token is the environment's. */
    cpar_store_config cfg = {.host = rank == 0 ? env.store_bind : env.master_addr, .port = env.store_port,
                             .is_server = rank == 0};
    cpar_store *s = NULL;
    if ((st = cpar_store_create(&cfg, &s)) != CPAR_OK)
        return fail("cpar_store_create", st);
    if ((st = cpar_store_join(s, &env)) != CPAR_OK)
        return fail("cpar_store_join", st);
    if (!strcmp(mode, "wait-go")) {
        printf("rank %d joined\n", rank);
        char go[8];
        if ((st = cpar_store_get(s, "go", go, sizeof go, NULL)) != CPAR_OK)
            return fail("cpar_store_get", st);
    }

    unsigned char mine[BLOB], theirs[BLOB], want[BLOB];
    char key[64];
    blob_fill(mine, rank);
    snprintf(key, sizeof key, "blob/%d", rank);
    if ((st = cpar_store_set(s, key, mine, BLOB)) != CPAR_OK)
        return fail("cpar_store_set", st);
    for (int j = 0; j < env.world_size; j++) {
        size_t len = 0;
        snprintf(key, sizeof key, "blob/%d", j);
        if ((st = cpar_store_get(s, key, theirs, sizeof theirs, &len)) != CPAR_OK)
            return fail("cpar_store_get", st);
        blob_fill(want, j);
        if (len != BLOB || memcmp(theirs, want, BLOB) != 0) {
            fprintf(stderr, "store_prog: rank %d: blob of rank %d is wrong (%zu bytes)\n", rank, j, len);
            return 1;
        }
    }
    if ((st = cpar_store_add(s, "sum", rank + 1, NULL)) != CPAR_OK)
        return fail("cpar_store_add", st);
    for (int i = 0; i < 3; i++) /* one name, several generations */
        if ((st = cpar_store_barrier(s, "loop", rank, env.world_size)) != CPAR_OK)
            return fail("cpar_store_barrier", st);
    int64_t sum = 0;
    if ((st = cpar_store_add(s, "sum", 0, &sum)) != CPAR_OK)
        return fail("cpar_store_add", st);
    if (sum != (int64_t)env.world_size * (env.world_size + 1) / 2) {
        fprintf(stderr, "store_prog: rank %d: sum is %lld\n", rank, (long long)sum);
        return 1;
    }
    /* The last barrier: rank 0's destroy waits for the others to disconnect. */
    if ((st = cpar_store_barrier(s, "end", rank, env.world_size)) != CPAR_OK)
        return fail("cpar_store_barrier", st);
    cpar_store_destroy(s);
    fprintf(stderr, "rank %d stderr line\n", rank);
    printf("rank %d ok\n", rank);
    printf("bye from %d", rank); /* no newline: cparrun must still print it */
    return 0;
}
