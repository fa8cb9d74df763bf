/* SPDX-License-Identifier: MIT */
/* tests/test_mp.c — multi-process jobs on the production path (nccl-sim):
 * mp_prog ranks go through cpar_init_from_env, the TCP store, the unique id
 * and NCCL communicator creation, then a tp x cp grid with collectives and a
 * sequence-parallel MLP against a 1-rank reference (tests/mp_prog.c).
 *
 * Launched by cparrun, and by this test with torchrun's variables (RANK,
 * WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) so the
 * peers' own exit codes and messages can be read. Faults: a rank killed
 * mid-collective and a rank that never starts end the job with a clear error
 * within the deadline, cparrun returns the failing status, and no
 * shared-memory segment is left behind.
 *
 * Paths come from the environment (B: the build directory, exported by
 * tests/run.sh): CPARRUN [$B/cparrun], MP_PROG [$B/ncclsim/mp_prog]. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "testutil.h"
#include "proc.h"

#define NP 4

PROC_PATH_FN(prog_path, "MP_PROG", "ncclsim/mp_prog")

/* The NCCL simulator's segments in /dev/shm left by this suite's jobs (not
 * those of a suite running beside it): tests/ncclsim/nccl.h, whose header
 * this object, shared with the sim build, is compiled without. */
int ncclsim_leftover_segments(void);
static int shm_leftovers(void) { return ncclsim_leftover_segments(); }

/* ---- under cparrun ------------------------------------------------------------ */

START_TEST(test_cparrun_job) {
    cparrun_job_ok(prog_path(), NP, (const char *const[]){"ok", NULL}, NULL);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

START_TEST(test_cparrun_rank_dies) {
    cparrun_rank_dies(cparrun_path(), prog_path(), 4, 2);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

START_TEST(test_cparrun_rank_never_starts) {
    proc p;
    proc_run(&p, cparrun_path(), prog_path(), (const char *const[]){"-n", "4", "PROG", "nostart", "3", NULL},
             (const char *const[]){"CPAR_TIMEOUT_MS=1500", NULL}, 60000);
    ASSERT_OUT(&p, p.status == 1);
    ASSERT_OUT(&p, strstr(p.text[1], "CPAR_ERR_TIMEOUT") && strstr(p.text[1], "rank 3 of 4 missing"));
    ck_assert_int_lt(p.end - p.start, 10000);
    proc_free(&p);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* ---- launched here with torchrun's variables ------------------------------------ */

/* Starts np ranks of mp_prog (mode, k) as torchrun would, on a port of our own. */
static void mp_start_n(proc *ps, int np, const char *mode, const char *k, const char *timeout) {
    torchrun_start(ps, np, np, prog_path(), (const char *const[]){mode, k, NULL}, timeout);
}
static void mp_start(proc *ps, const char *mode, const char *k, const char *timeout) {
    mp_start_n(ps, NP, mode, k, timeout);
}

START_TEST(test_torchrun_job) {
    proc ps[NP];
    mp_start(ps, "ok", "-1", "60000");
    for (int r = 0; r < NP; r++) proc_finish(&ps[r], 120000);
    for (int r = 0; r < NP; r++) {
        ASSERT_OUT(&ps[r], ps[r].status == 0);
        ASSERT_OUT(&ps[r], strstr(ps[r].text[0], "ok\n") != NULL);
        proc_free(&ps[r]);
    }
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* The peers of a killed rank fail fast, naming it, though their deadline is
 * far away: the failure is detected, not timed out. */
START_TEST(test_torchrun_rank_dies) {
    proc ps[NP];
    mp_start(ps, "die", "2", "30000");
    torchrun_rank_died(ps, NP, 2, 1);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* A rank's all-reduce fails its own checks while its peers wait in theirs:
 * they fail at once with CPAR_ERR_PEER naming it and its message (through
 * the store), though it stays alive for 5 s more (issue 29). */
START_TEST(test_torchrun_rank_fails_check) {
    proc ps[NP];
    mp_start(ps, "badarg", "2", "30000");
    for (int r = 0; r < NP; r++) proc_finish(&ps[r], 40000);
    for (int r = 0; r < NP; r++) {
        ASSERT_OUT(&ps[r], ps[r].status == 1);
        if (r == 2) {
            ASSERT_OUT(&ps[r], strstr(ps[r].text[0], "CPAR_ERR_INVALID") && strstr(ps[r].text[0], "out has shape"));
            continue;
        }
        ASSERT_OUT(&ps[r], strstr(ps[r].text[0], "CPAR_ERR_PEER") && strstr(ps[r].text[0], "rank 2 gave up") &&
                               strstr(ps[r].text[0], "out has shape"));
        const char *after = strstr(ps[r].text[0], "(after ");
        long ms = -1;
        ck_assert_msg(after && sscanf(after, "(after %ld ms)", &ms) == 1 && ms < 1000,
                      "rank %d's all-reduce took %ld ms to learn of rank 2's failure:\n%s", r, ms, ps[r].text[0]);
    }
    for (int r = 0; r < NP; r++) proc_free(&ps[r]);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* The others' cpar_finalize times out on an all-reduce rank 0 joins too
 * late (cpar_finalize's error is not returned: a quiet wait). Rank 0's call
 * finds the communicator aborted and fails at once, naming the cause that
 * the process which timed out published in the store (rank 0 is its server:
 * still there), not only NCCL's "aborted the communicator". */
START_TEST(test_torchrun_rank_leaves_work_queued) {
    /* a collective is queued only when streams run in order, as on a GPU
     * (make test sets random:SEED; eager would run it in the call) */
    if (!getenv("CUDASIM_STREAMS")) setenv("CUDASIM_STREAMS", "lazy", 1);
    const int np = _i; /* 2-4 ranks: one or several time out at once */
    proc ps[NP];
    mp_start_n(ps, np, "queued", "0", "1500");
    for (int r = 0; r < np; r++) proc_finish(&ps[r], 30000);
    for (int r = 1; r < np; r++) ASSERT_OUT(&ps[r], ps[r].status == 0 && strstr(ps[r].text[0], "all_reduce: CPAR_OK"));
    ASSERT_OUT(&ps[0], ps[0].status == 1);
    ASSERT_OUT(&ps[0], strstr(ps[0].text[0], "all_reduce: CPAR_ERR_PEER") &&
                           strstr(ps[0].text[0], " timed out (cpar_finalize: device work unfinished after 1500 ms"));
    for (int r = 0; r < np; r++) proc_free(&ps[r]);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* Rank 0's all-reduce is queued and it waits on its stream; the others call
 * cpar_abort instead of joining. The wait finds the communicator failed and
 * names the cause the aborting process published, not NCCL's abort. */
START_TEST(test_torchrun_peer_aborts_queued_work) {
    if (!getenv("CUDASIM_STREAMS")) setenv("CUDASIM_STREAMS", "lazy", 1); /* queued, as on a GPU */
    const int np = _i; /* 2-4 ranks: one or several abort at once */
    proc ps[NP];
    mp_start_n(ps, np, "abort", "0", "30000");
    for (int r = 0; r < np; r++) proc_finish(&ps[r], 40000);
    for (int r = 1; r < np; r++) ASSERT_OUT(&ps[r], ps[r].status == 0);
    ASSERT_OUT(&ps[0], ps[0].status == 1);
    ASSERT_OUT(&ps[0], strstr(ps[0].text[0], "all_reduce: CPAR_ERR_PEER") &&
                           strstr(ps[0].text[0], " aborted (cpar_abort); NCCL communicators aborted"));
    ck_assert_int_lt(ps[0].end - ps[0].start, 15000); /* the abort, not the 30 s deadline */
    for (int r = 0; r < np; r++) proc_free(&ps[r]);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

START_TEST(test_torchrun_rank_never_starts) {
    proc ps[NP];
    mp_start(ps, "nostart", "1", "1500");
    for (int r = 0; r < NP; r++) proc_finish(&ps[r], 20000);
    ASSERT_OUT(&ps[1], ps[1].status == 0);
    for (int r = 0; r < NP; r++) {
        if (r == 1) continue;
        ASSERT_OUT(&ps[r], ps[r].status == 1);
        ASSERT_OUT(&ps[r], strstr(ps[r].text[1], "CPAR_ERR_TIMEOUT") && strstr(ps[r].text[1], "rank 1"));
        ck_assert_int_lt(ps[r].end - ps[r].start, 10000);
    }
    for (int r = 0; r < NP; r++) proc_free(&ps[r]);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* Two processes claim rank 0 on one host: the second finds the store port
 * taken, joins the first's store as a client, and every rank fails at once
 * naming both (not "address in use" on one and a timeout on the others). */
START_TEST(test_torchrun_duplicate_rank0) {
    static char vars[3][7][64];
    static const int ranks[3] = {0, 0, 1};
    proc ps[3];
    int port = 20000 + (int)(getpid() % 10000) * 2;
    for (int i = 0; i < 3; i++) {
        snprintf(vars[i][0], 64, "RANK=%d", ranks[i]);
        snprintf(vars[i][1], 64, "LOCAL_RANK=%d", i);
        snprintf(vars[i][2], 64, "WORLD_SIZE=3");
        snprintf(vars[i][3], 64, "MASTER_ADDR=127.0.0.1");
        snprintf(vars[i][4], 64, "MASTER_PORT=%d", port);
        snprintf(vars[i][5], 64, "CPAR_TIMEOUT_MS=30000");
        snprintf(vars[i][6], 64, "CPAR_JOB_TOKEN=dup0-%d", (int)getpid());
        const char *env[] = {vars[i][0], vars[i][1], vars[i][2], vars[i][3], vars[i][4], vars[i][5], vars[i][6], NULL};
        proc_start(&ps[i], prog_path(), NULL, (const char *const[]){"ok", "-1", NULL}, env);
    }
    for (int i = 0; i < 3; i++) proc_finish(&ps[i], 40000);
    for (int i = 0; i < 3; i++) {
        ASSERT_OUT(&ps[i], ps[i].status == 1);
        ASSERT_OUT(&ps[i], strstr(ps[i].text[1], "cpar_init_from_env: rank 0 (pid ") != NULL);
        ASSERT_OUT(&ps[i], strstr(ps[i].text[1], "both claim rank 0") != NULL);
        ck_assert_int_lt(ps[i].end - ps[i].start, 15000);
        proc_free(&ps[i]);
    }
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

int main(void) {
    if (access(cparrun_path(), X_OK) != 0 || access(prog_path(), X_OK) != 0) {
        fprintf(stderr, "test_mp: need CPARRUN (%s) and MP_PROG (%s)\n", cparrun_path(), prog_path());
        return EXIT_FAILURE;
    }
    Suite *s = suite_create("mp: multi-process jobs on the NCCL backend (nccl-sim)");
    TCase *tc = tcase_create("cparrun");
    tcase_add_test(tc, test_cparrun_job);
    tcase_add_test(tc, test_cparrun_rank_dies);
    tcase_add_test(tc, test_cparrun_rank_never_starts);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    tc = tcase_create("torchrun");
    tcase_add_test(tc, test_torchrun_job);
    tcase_add_test(tc, test_torchrun_rank_dies);
    tcase_add_test(tc, test_torchrun_rank_fails_check);
    tcase_add_loop_test(tc, test_torchrun_rank_leaves_work_queued, 2, NP + 1);
    tcase_add_loop_test(tc, test_torchrun_peer_aborts_queued_work, 2, NP + 1);
    tcase_add_test(tc, test_torchrun_rank_never_starts);
    tcase_add_test(tc, test_torchrun_duplicate_rank0);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
