/* SPDX-License-Identifier: MIT */
/* tests/test_hostmp.c — multi-process jobs on the host backend, no GPU: ranks
 * are processes, collectives go through POSIX shared memory set up through
 * the store (cpar.c section 8).
 *
 * Under cparrun: every collective at 1, 2, 3, 4 and 8 ranks with uneven
 * splits, on the world and on split groups, exact against the rank-order
 * reduction (tests/hostmp_prog.c), also in many small stages, also on
 * tensors in the ranks' arenas (moved in place) and with arenas on some
 * ranks only (staged); the arena under random allocations and frees; ring attention
 * on a tp x cp grid and a tp=2 x cp=2 sequence-parallel MLP (tests/mp_prog.c,
 * with CPAR_BACKEND=host) against one rank; the main job
 * (cparrun -n 4 build/train --tp 2 --cp 2) against the threaded run's losses.
 * Launched here with torchrun's variables: a rank killed mid-collective (on
 * heap buffers and on arena ones), one that calls cpar_abort (likewise) and one that comes late make the others fail within
 * the deadline naming it;
 * several nodes are refused. No job leaves a segment in /dev/shm.
 *
 * Paths come from the environment (B: the build directory, exported by
 * tests/run.sh): CPARRUN [$B/cparrun], HOSTMP_PROG [$B/host/hostmp_prog],
 * MP_PROG [$B/host/mp_prog], TRAIN [$B/host/train]. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <sys/stat.h>

#include "testutil.h"
#include "proc.h"

PROC_PATH_FN(prog_path, "HOSTMP_PROG", "host/hostmp_prog")
PROC_PATH_FN(mp_path, "MP_PROG", "host/mp_prog")
PROC_PATH_FN(train_path, "TRAIN", "host/train")

/* When this process started: a segment made before it is not its leftover. */
static struct timespec process_start;
__attribute__((constructor)) static void note_process_start(void) { clock_gettime(CLOCK_REALTIME, &process_start); }

/* The host backend's segments in /dev/shm ("cpar-<token hash>-<pid>-<n>")
 * whose creator has ended: leftovers. (A live job's, another suite's on this
 * machine perhaps, exists for a moment between its creation and its unlink;
 * one a killed run left before this suite started is not this suite's.) */
static int shm_leftovers(void) {
    DIR *d = opendir("/dev/shm");
    if (!d) return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        unsigned hash;
        long pid;
        if (sscanf(e->d_name, "cpar-%8x-%ld-", &hash, &pid) != 2) continue;
        char path[300];
        struct stat st;
        snprintf(path, sizeof path, "/dev/shm/%s", e->d_name);
        /* a second's margin: files' times come from a coarse clock, a tick behind */
        const bool older = stat(path, &st) == 0 && st.st_ctim.tv_sec < process_start.tv_sec - 1;
        if (!older && kill((pid_t)pid, 0) != 0 && errno == ESRCH) n++;
    }
    closedir(d);
    return n;
}

/* cparrun -n np PROG args... with env; every rank must print "rank R ok",
 * and the job leaves no segment behind. */
static void job_ok(const char *prog, int np, const char *const *args, const char *const *env) {
    cparrun_job_ok(prog, np, args, env);
    ck_assert_int_eq(shm_leftovers(), 0);
}

/* ---- collectives ------------------------------------------------------------ */

static const int sizes[] = {1, 2, 3, 4, 8};

START_TEST(test_coll) {
    job_ok(prog_path(), sizes[_i], (const char *const[]){"coll", NULL},
           (const char *const[]){"CPAR_TIMEOUT_MS=60000", NULL});
}
END_TEST

/* Big tensors through 8 KiB stages and 64 KiB mailboxes: many stages each;
 * the last run with the even ranks' buffers in their arenas, which they do
 * not stage until they see that the odd ranks' are not. */
START_TEST(test_coll_stages) {
    job_ok(prog_path(), _i == 0 ? 3 : 4, (const char *const[]){"coll", NULL},
           (const char *const[]){"CPAR_TIMEOUT_MS=60000", "CPAR_HOST_CHUNK=8192", "HOSTMP_BIG=200000",
                                 _i == 2 ? "HOSTMP_ALLOC=mixed" : "HOSTMP_ALLOC=heap", NULL});
}
END_TEST

/* Tensors from cpar_tensor_alloc: the large ones in the ranks' arenas, which
 * the peers read (and an all-reduce writes) in place; small ones and the
 * mismatch checks' stack buffers still stage. The same exact checks. */
START_TEST(test_coll_arena) {
    job_ok(prog_path(), sizes[_i], (const char *const[]){"coll", NULL},
           (const char *const[]){"CPAR_TIMEOUT_MS=60000", "HOSTMP_BIG=200000", "HOSTMP_ALLOC=tensor", NULL});
}
END_TEST

/* Arena buffers on the even ranks only: the world's collectives stage, the
 * even ranks' split group moves in place. Last: rank 1 without an arena
 * (CPAR_HOST_ARENA=0), so nobody maps every peer's and everything stages. */
START_TEST(test_coll_arena_mixed) {
    job_ok(prog_path(), _i == 1 ? 4 : 3, (const char *const[]){"coll", NULL},
           (const char *const[]){"CPAR_TIMEOUT_MS=60000", "HOSTMP_BIG=200000",
                                 _i == 2 ? "HOSTMP_ALLOC=noarena1" : "HOSTMP_ALLOC=mixed", NULL});
}
END_TEST

/* The arena under random allocations and frees keeps every buffer intact. */
START_TEST(test_arena_churn) {
    job_ok(prog_path(), 2, (const char *const[]){"arena", NULL},
           (const char *const[]){"CPAR_TIMEOUT_MS=60000", "HOSTMP_ALLOC=tensor", NULL});
}
END_TEST

/* ---- layers against one rank ------------------------------------------------ */

/* _i: 4 ranks as tp 2 x cp 2, 3 ranks as cp 3, 4 ranks as cp 4 (a2a+p2p's
 * inner and outer groups split from cp in the processes) */
START_TEST(test_ring_attention) {
    job_ok(prog_path(), _i == 1 ? 3 : 4, (const char *const[]){"ring", NULL},
           (const char *const[]){"CPAR_TIMEOUT_MS=60000", _i == 2 ? "HOSTMP_TP=1" : "HOSTMP_TP=", NULL});
}
END_TEST

/* mp_prog asks for NCCL; CPAR_BACKEND=host overrides the program's choice. */
START_TEST(test_mlp_tp2_cp2) {
    job_ok(mp_path(), 4, (const char *const[]){"ok", NULL},
           (const char *const[]){"CPAR_TIMEOUT_MS=60000", "CPAR_BACKEND=host", NULL});
}
END_TEST

/* The losses "step N/M | loss X" printed by train's rank 0, in order. */
static int losses(const char *text, char out[][16], int cap) {
    int n = 0;
    for (const char *s = text; n < cap && (s = strstr(s, "| loss ")); s++) {
        sscanf(s + 7, "%15s", out[n]);
        n++;
    }
    return n;
}

START_TEST(test_train_matches_threads) {
    const char *const targs[] = {"--tp", "2", "--cp", "2", "--steps", "5", "--verify", "0", "--sample", "0", NULL};
    proc t;
    proc_run(&t, train_path(), NULL, targs, NULL, 300000);
    ASSERT_OUT(&t, t.status == 0);
    proc p;
    const char *const pargs[] = {"-n", "4", "PROG", "--tp", "2", "--cp", "2", "--steps", "5", "--sample", "0", NULL};
    proc_run(&p, cparrun_path(), train_path(), pargs, (const char *const[]){"CPAR_TIMEOUT_MS=120000", NULL}, 300000);
    ASSERT_OUT(&p, p.status == 0);
    ASSERT_OUT(&p, strstr(p.text[0], "[0] grid: tp 2 x cp 2 x dp 1 = 4 ranks on the host backend") != NULL);
    char a[8][16], b[8][16];
    int na = losses(t.text[0], a, 8), nb = losses(p.text[0], b, 8);
    ck_assert_int_eq(na, 5);
    ck_assert_int_eq(nb, 5);
    for (int i = 0; i < 5; i++)
        ck_assert_msg(!strcmp(a[i], b[i]), "step %d: threads %s, processes %s\n%s\n%s", i + 1, a[i], b[i], t.text[0],
                      p.text[0]);
    /* the final validation loss too */
    const char *va = strstr(t.text[0], "validation loss "), *vb = strstr(p.text[0], "validation loss ");
    ck_assert_ptr_nonnull(va);
    ck_assert_ptr_nonnull(vb);
    ck_assert_int_eq(strncmp(va, vb, 22), 0);
    proc_free(&t);
    proc_free(&p);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* ---- faults, launched with torchrun's variables -------------------------------- */

#define NP 4

/* The peers of a killed rank fail fast, naming it, though their deadline is
 * far away: the death is detected, not timed out. */
START_TEST(test_rank_dies) {
    if (_i) setenv("HOSTMP_ALLOC", "tensor", 1); /* the peers wait in an in-place all-reduce */
    proc ps[NP];
    torchrun_start(ps, NP, NP, prog_path(), (const char *const[]){"die", "2", NULL}, "30000");
    torchrun_rank_died(ps, NP, 2, 0); /* "rank 2 (pid N) died during the collective" */
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* Under cparrun: the job ends with the killed rank's status, nothing left over. */
START_TEST(test_cparrun_rank_dies) {
    cparrun_rank_dies(cparrun_path(), prog_path(), 4, 1);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* A rank that joins after the deadline: the others time out naming it (or
 * learn of the timeout from the first that did), and it sees their failure. */
START_TEST(test_rank_late) {
    proc ps[NP];
    torchrun_start(ps, NP, NP, prog_path(), (const char *const[]){"late", "1", NULL}, "1500");
    for (int r = 0; r < NP; r++) proc_finish(&ps[r], 30000);
    int timeouts = 0;
    for (int r = 0; r < NP; r++) {
        ASSERT_OUT(&ps[r], ps[r].status == 1);
        if (r == 1) {
            ASSERT_OUT(&ps[r], strstr(ps[r].text[0], "CPAR_ERR_PEER") && strstr(ps[r].text[0], "timed out"));
            continue;
        }
        timeouts += strstr(ps[r].text[0], "CPAR_ERR_TIMEOUT") != NULL;
        ASSERT_OUT(&ps[r], strstr(ps[r].text[0], "waiting for rank 1") != NULL);
        ck_assert_int_lt(ps[r].end - ps[r].start, 1500 + 8000);
    }
    ck_assert_int_ge(timeouts, 1);
    for (int r = 0; r < NP; r++) proc_free(&ps[r]);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* A segment a rank left behind (killed between creating it and unlinking
 * it) is removed by cparrun when the job ends: it is named after the job's
 * token ("cpar-<FNV-1a of the token>-..."); another job's is kept. */
START_TEST(test_cparrun_sweeps) {
    char token[64], mine[128], other[128];
    snprintf(token, sizeof token, "sweep-%d", (int)getpid());
    uint32_t h = 2166136261u;
    for (const char *p = token; *p; p++) h = (h ^ (unsigned char)*p) * 16777619u;
    snprintf(mine, sizeof mine, "/dev/shm/cpar-%08x-1-0", h);
    snprintf(other, sizeof other, "/dev/shm/cpar-%08x-1-0", h ^ 1u);
    for (int i = 0; i < 2; i++) {
        int fd = open(i ? other : mine, O_CREAT | O_WRONLY, 0600);
        ck_assert_int_ge(fd, 0);
        close(fd);
    }
    char var[96];
    snprintf(var, sizeof var, "CPAR_JOB_TOKEN=%s", token);
    proc p;
    proc_run(&p, cparrun_path(), prog_path(), (const char *const[]){"-n", "2", "PROG", "coll", NULL},
             (const char *const[]){var, NULL}, 60000);
    ASSERT_OUT(&p, p.status == 0);
    proc_free(&p);
    ck_assert_int_ne(access(mine, F_OK), 0);
    ck_assert_int_eq(access(other, F_OK), 0);
    unlink(other);
}
END_TEST

/* cpar_abort on one rank: every rank's call fails with CPAR_ERR_PEER saying
 * which rank aborted, at once. */
START_TEST(test_rank_aborts) {
    if (_i) setenv("HOSTMP_ALLOC", "tensor", 1);
    proc ps[NP];
    torchrun_start(ps, NP, NP, prog_path(), (const char *const[]){"abort", "3", NULL}, "30000");
    for (int r = 0; r < NP; r++) proc_finish(&ps[r], 40000);
    for (int r = 0; r < NP; r++) {
        ASSERT_OUT(&ps[r], ps[r].status == 1);
        ASSERT_OUT(&ps[r], strstr(ps[r].text[0], "CPAR_ERR_PEER") && strstr(ps[r].text[0], "rank 3 aborted"));
        ck_assert_int_lt(ps[r].end - ps[r].start, 10000);
        proc_free(&ps[r]);
    }
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* A rank's all-reduce fails its own checks while its peers wait in theirs:
 * they fail at once with CPAR_ERR_PEER naming it and its message, though it
 * stays alive for 5 s more (issue 29). */
START_TEST(test_rank_fails_check) {
    proc ps[NP];
    torchrun_start(ps, NP, NP, prog_path(), (const char *const[]){"badarg", "2", NULL}, "30000");
    for (int r = 0; r < NP; r++) proc_finish(&ps[r], 40000);
    for (int r = 0; r < NP; r++) {
        ASSERT_OUT(&ps[r], ps[r].status == 1);
        if (r == 2) {
            ASSERT_OUT(&ps[r], strstr(ps[r].text[0], "CPAR_ERR_INVALID") && strstr(ps[r].text[0], "out has shape"));
        } else {
            ASSERT_OUT(&ps[r], strstr(ps[r].text[0], "CPAR_ERR_PEER") && strstr(ps[r].text[0], "rank 2 gave up") &&
                                   strstr(ps[r].text[0], "out has shape"));
            const char *after = strstr(ps[r].text[0], "(after ");
            long ms = -1;
            ck_assert_msg(after && sscanf(after, "(after %ld ms)", &ms) == 1 && ms < 2000,
                          "rank %d's all-reduce took %ld ms to learn of rank 2's failure:\n%s", r, ms, ps[r].text[0]);
        }
    }
    for (int r = 0; r < NP; r++) proc_free(&ps[r]);
    ck_assert_int_eq(shm_leftovers(), 0);
}
END_TEST

/* Two nodes' worth of ranks (LOCAL_WORLD_SIZE < WORLD_SIZE): refused at once. */
START_TEST(test_several_nodes) {
    proc ps[2];
    torchrun_start(ps, 2, 1, prog_path(), (const char *const[]){"coll", NULL}, "5000");
    for (int r = 0; r < 2; r++) {
        proc_finish(&ps[r], 20000);
        ASSERT_OUT(&ps[r], ps[r].status == 1);
        ASSERT_OUT(&ps[r], strstr(ps[r].text[1], "CPAR_ERR_UNSUPPORTED") && strstr(ps[r].text[1], "single-node"));
        ck_assert_int_lt(ps[r].end - ps[r].start, 3000);
        proc_free(&ps[r]);
    }
}
END_TEST

int main(void) {
    const char *need[] = {cparrun_path(), prog_path(), mp_path(), train_path()};
    for (int i = 0; i < 4; i++)
        if (access(need[i], X_OK) != 0) {
            fprintf(stderr, "test_hostmp: need %s (CPARRUN, HOSTMP_PROG, MP_PROG, TRAIN)\n", need[i]);
            return EXIT_FAILURE;
        }
    Suite *s = suite_create("hostmp: multi-process jobs on the host backend (shared memory)");
    TCase *tc = tcase_create("collectives");
    tcase_add_loop_test(tc, test_coll, 0, (int)(sizeof sizes / sizeof *sizes));
    tcase_add_loop_test(tc, test_coll_stages, 0, 3);
    tcase_add_loop_test(tc, test_coll_arena, 1, 4);
    tcase_add_loop_test(tc, test_coll_arena_mixed, 0, 3);
    tcase_add_test(tc, test_arena_churn);
    tcase_set_timeout(tc, 180);
    suite_add_tcase(s, tc);
    tc = tcase_create("layers");
    tcase_add_loop_test(tc, test_ring_attention, 0, 3);
    tcase_add_test(tc, test_mlp_tp2_cp2);
    tcase_add_test(tc, test_train_matches_threads);
    tcase_set_timeout(tc, 600);
    suite_add_tcase(s, tc);
    tc = tcase_create("faults");
    tcase_add_loop_test(tc, test_rank_dies, 0, 2);
    tcase_add_test(tc, test_cparrun_rank_dies);
    tcase_add_test(tc, test_rank_late);
    tcase_add_loop_test(tc, test_rank_aborts, 0, 2);
    tcase_add_test(tc, test_rank_fails_check);
    tcase_add_test(tc, test_several_nodes);
    tcase_add_test(tc, test_cparrun_sweeps);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
