/* SPDX-License-Identifier: MIT */
/* tests/test_cparrun.c — the launcher, end to end: cparrun runs store_prog
 * ranks on 127.0.0.1 and we check exit codes, output prefixes, timing of the
 * teardown and signal forwarding.
 *
 * Paths come from the environment (defaults in brackets; B is the build
 * directory, exported by tests/run.sh):
 *   CPARRUN     the launcher              [$B/cparrun]
 *   STORE_PROG  the rank program          [$B/host/store_prog] */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* POSIX and Linux APIs under -std=c11, as in cpar.c */
#endif
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"
#include "proc.h"
#include "net.h"

/* "MAJOR.MINOR.PATCH" from cpar.h, as cparrun --version prints it */
#define CPAR__TEST_STR2(x) #x
#define CPAR__TEST_STR(x) CPAR__TEST_STR2(x)
#define CPAR__TEST_VERSION                                                                                   \
    CPAR__TEST_STR(CPAR_VERSION_MAJOR) "." CPAR__TEST_STR(CPAR_VERSION_MINOR) "." CPAR__TEST_STR(CPAR_VERSION_PATCH) "\n"

PROC_PATH_FN(prog_path, "STORE_PROG", "host/store_prog")

/* cparrun with args ("PROG": store_prog). */
static void start(proc *p, const char *const *args, const char *const *env)
{
    proc_start(p, cparrun_path(), prog_path(), args, env);
}

static void run(proc *p, const char *const *args, const char *const *env, int ms)
{
    proc_run(p, cparrun_path(), prog_path(), args, env, ms);
}

/* Every line is "[r] ..." with 0 <= r < world. */
static void assert_prefixed(const char *text, int world)
{
    for (const char *line = text; *line;) {
        const char *nl = strchr(line, '\n');
        int r = -1, used = 0;
        ck_assert_msg(sscanf(line, "[%d] %n", &r, &used) == 1 && used > 0 && r >= 0 && r < world,
                      "unprefixed line: %.*s", (int)(nl ? nl - line : (long)strlen(line)), line);
        ck_assert_msg(nl != NULL, "last line has no newline: %s", line);
        line = nl + 1;
    }
}

/* ---- tests ---------------------------------------------------------------- */

START_TEST(test_success)
{
    proc p;
    run(&p, (const char *const[]){"-n", "4", "PROG", "ok", NULL}, NULL, 30000);
    ck_assert_msg(p.status == 0, "status %d\nstdout:\n%s\nstderr:\n%s", p.status, p.text[0], p.text[1]);
    assert_prefixed(p.text[0], 4);
    assert_prefixed(p.text[1], 4);
    char want[128];
    for (int r = 0; r < 4; r++) {
        snprintf(want, sizeof want, "[%d] rank %d ok\n", r, r);
        ASSERT_HAS(p.text[0], want);
        snprintf(want, sizeof want, "[%d] bye from %d\n", r, r); /* a partial last line, completed */
        ASSERT_HAS(p.text[0], want);
        snprintf(want, sizeof want, "[%d] rank %d stderr line\n", r, r);
        ASSERT_HAS(p.text[1], want);
        snprintf(want, sizeof want, "[%d] rank %d of 4 (torchrun), local %d of 4", r, r, r);
        ASSERT_HAS(p.text[0], want);
        /* cparrun's random 128-bit token, in hex; a single-node store on loopback */
        snprintf(want, sizeof want, "[%d] rank %d token from CPAR_JOB_TOKEN (32 bytes), store bound to 127.0.0.1\n", r,
                 r);
        ASSERT_HAS(p.text[0], want);
    }
    proc_free(&p);
}
END_TEST

START_TEST(test_rank_never_joins)
{
    proc p;
    run(&p, (const char *const[]){"-n", "4", "PROG", "nojoin", "2", NULL},
        (const char *const[]){"CPAR_TIMEOUT_MS=2000", NULL}, 30000);
    ck_assert_msg(p.status == 1, "status %d\nstderr:\n%s", p.status, p.text[1]);
    ASSERT_HAS(p.text[1], "CPAR_ERR_TIMEOUT");
    ASSERT_HAS(p.text[1], "cpar_store_join: barrier \"cpar/join\" timed out after 2000 ms: rank 2 of 4 missing");
    ck_assert_int_lt(p.end - p.start, 10000);
    proc_free(&p);
}
END_TEST

START_TEST(test_master_never_starts)
{
    proc p;
    run(&p, (const char *const[]){"-n", "3", "PROG", "nojoin", "0", NULL},
        (const char *const[]){"CPAR_TIMEOUT_MS=1500", NULL}, 30000);
    ck_assert_int_eq(p.status, 1);
    ASSERT_HAS(p.text[1], "CPAR_ERR_TIMEOUT");
    ASSERT_HAS(p.text[1], "(is rank 0 running?)");
    proc_free(&p);
}
END_TEST

START_TEST(test_failing_rank)
{
    proc p;
    run(&p, (const char *const[]){"-n", "4", "PROG", "fail", "3", NULL}, NULL, 30000);
    ck_assert_msg(p.status == 3, "status %d\nstderr:\n%s", p.status, p.text[1]);
    ck_assert_msg(p.end - p.start < 3000, "the sleeping ranks lived %lld ms", (long long)(p.end - p.start));
    ASSERT_HAS(p.text[1], "cparrun: rank 3 exited with status 3; stopping the others");
    ASSERT_HAS(p.text[1], "[3] rank 3 failing on purpose");
    proc_free(&p);
}
END_TEST

START_TEST(test_rank_killed_by_signal)
{
    proc p;
    run(&p, (const char *const[]){"-n", "3", "PROG", "signal", "1", NULL}, NULL, 30000);
    ck_assert_int_eq(p.status, 128 + SIGUSR1); /* as a shell reports it */
    ck_assert_int_lt(p.end - p.start, 3000);
    ASSERT_HAS(p.text[1], "cparrun: rank 1 was killed by signal");
    proc_free(&p);
}
END_TEST

START_TEST(test_sigterm_forwarded)
{
    proc p;
    start(&p, (const char *const[]){"-n", "3", "PROG", "sleep", NULL}, NULL);
    proc_read(&p, 10000, "ready", 3);
    ASSERT_HAS(p.text[0], "[2] rank 2 ready");
    int64_t t0 = now_ms();
    kill(p.pid, SIGTERM);
    proc_finish(&p, 10000);
    ck_assert_int_lt(p.end - t0, 3000);
    ck_assert_int_eq(p.status, 128 + SIGTERM); /* the ranks exited 0, but the job was interrupted */
    for (int r = 0; r < 3; r++) {
        char want[64];
        snprintf(want, sizeof want, "[%d] rank %d got signal %d\n", r, r, SIGTERM);
        ASSERT_HAS(p.text[0], want);
    }
    proc_free(&p);
}
END_TEST

START_TEST(test_sigint_forwarded)
{
    proc p;
    start(&p, (const char *const[]){"-n", "2", "PROG", "sleep", NULL}, NULL);
    proc_read(&p, 10000, "ready", 2);
    kill(p.pid, SIGINT);
    proc_finish(&p, 10000);
    ck_assert_int_eq(p.status, 128 + SIGINT);
    ASSERT_HAS(p.text[0], "[1] rank 1 got signal 2\n");
    proc_free(&p);
}
END_TEST

START_TEST(test_sigkill_after_grace)
{
    proc p;
    start(&p, (const char *const[]){"-n", "2", "PROG", "ignore-term", NULL},
               (const char *const[]){"CPARRUN_GRACE_MS=500", NULL});
    proc_read(&p, 10000, "ready", 2);
    int64_t t0 = now_ms();
    kill(p.pid, SIGTERM);
    proc_finish(&p, 10000);
    ck_assert_int_ge(p.end - t0, 450);
    ck_assert_int_lt(p.end - t0, 3000);
    ck_assert_int_eq(p.status, 128 + SIGKILL);
    ASSERT_HAS(p.text[1], "sending SIGKILL");
    proc_free(&p);
}
END_TEST

static int free_port_pair(void)
{
    for (;;) {
        int a = socket(AF_INET, SOCK_STREAM, 0), b = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY)};
        socklen_t len = sizeof sa;
        int port = 0;
        if (bind(a, (struct sockaddr *)&sa, sizeof sa) == 0 && getsockname(a, (struct sockaddr *)&sa, &len) == 0) {
            port = ntohs(sa.sin_port);
            sa.sin_port = htons((uint16_t)(port + 1));
            if (port >= 65535 || bind(b, (struct sockaddr *)&sa, sizeof sa) != 0)
                port = 0;
        }
        close(a);
        close(b);
        if (port)
            return port;
    }
}

/* Two "nodes" on one machine: two cparrun with --nnodes 2, one store. */
START_TEST(test_two_nodes)
{
    char master[32];
    snprintf(master, sizeof master, "127.0.0.1:%d", free_port_pair());
    proc n0, n1;
    char token[64];
    snprintf(token, sizeof token, "CPAR_JOB_TOKEN=two-nodes-%d", (int)getpid());
    start(&n1, (const char *const[]){"-n", "2", "--nnodes", "2", "--node-rank", "1", "--master", master,
                                          "PROG", NULL}, (const char *const[]){token, NULL}); /* node 1 first */
    start(&n0, (const char *const[]){"-n", "2", "--nnodes=2", "--node-rank=0", "--master", master, "PROG",
                                          NULL}, (const char *const[]){token, NULL});
    proc_finish(&n0, 30000);
    proc_finish(&n1, 30000);
    ck_assert_msg(n0.status == 0, "node 0: %d\n%s", n0.status, n0.text[1]);
    ck_assert_msg(n1.status == 0, "node 1: %d\n%s", n1.status, n1.text[1]);
    ASSERT_HAS(n0.text[0], "[1] rank 1 of 4 (torchrun), local 1 of 2");
    ASSERT_HAS(n1.text[0], "[2] rank 2 of 4 (torchrun), local 0 of 2");
    ASSERT_HAS(n1.text[0], "[3] rank 3 ok");
    ASSERT_HAS(n0.text[0], "[0] rank 0 token from CPAR_JOB_TOKEN");
    assert_prefixed(n1.text[0], 4);
    proc_free(&n0);
    proc_free(&n1);
}
END_TEST

/* Several nodes without CPAR_JOB_TOKEN (and not under SLURM): refused at once
 * on every node, saying what to export; no rank starts. */
START_TEST(test_two_nodes_need_a_token)
{
    char master[32];
    snprintf(master, sizeof master, "127.0.0.1:%d", free_port_pair());
    proc n1;
    unsetenv("CPAR_JOB_TOKEN");
    unsetenv("SLURM_JOB_ID");
    start(&n1, (const char *const[]){"-n", "2", "--nnodes", "2", "--node-rank", "1", "--master", master,
                                          "PROG", NULL}, NULL);
    proc_finish(&n1, 10000);
    ck_assert_msg(n1.status == 2, "status %d\n%s", n1.status, n1.text[1]);
    ASSERT_HAS(n1.text[1], "cparrun: --nnodes 2 needs CPAR_JOB_TOKEN");
    ASSERT_HAS(n1.text[1], "export the same secret on every node");
    ck_assert_msg(!strstr(n1.text[0], "rank"), "a rank started:\n%s", n1.text[0]);
    proc_free(&n1);
}
END_TEST

START_TEST(test_store_port)
{
    int port = free_port_pair();
    char ps[16], want[64];
    snprintf(ps, sizeof ps, "%d", port);
    snprintf(want, sizeof want, "store 127.0.0.1:%d\n", port);
    proc p;
    run(&p, (const char *const[]){"-n", "2", "--store-port", ps, "PROG", NULL}, NULL, 30000);
    ck_assert_msg(p.status == 0, "status %d\n%s", p.status, p.text[1]);
    ASSERT_HAS(p.text[0], want);
    proc_free(&p);
}
END_TEST


/* Two jobs on one store port: job 1 (token chosen here) joins and waits; job 2
 * (cparrun's own random token) fails fast and cleanly; job 1 then finishes
 * untouched. Job 1's store listens on 127.0.0.1 only. */
START_TEST(test_two_jobs_one_port)
{
    int port = free_port_pair();
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    proc j1, j2;
    start(&j1, (const char *const[]){"-n", "2", "--store-port", ps, "PROG", "wait-go", NULL},
          (const char *const[]){"CPAR_JOB_TOKEN=first-job-token", NULL});
    proc_read(&j1, 20000, "joined", 2);
    ASSERT_HAS(j1.text[0], "[1] rank 1 joined");

    char where[256];
    tu_listening_on(port, where, sizeof where);
    if (access("/proc/net/tcp", R_OK) == 0)
        ck_assert_msg(!strcmp(where, "0100007F"), "job 1's store listens on \"%s\", expected 127.0.0.1 only", where);

    proc_run(&j2, cparrun_path(), prog_path(), (const char *const[]){"-n", "2", "--store-port", ps, "PROG", NULL},
             (const char *const[]){"CPAR_TIMEOUT_MS=20000", NULL}, 30000);
    ck_assert_msg(j2.status == 1, "job 2: status %d\n%s", j2.status, j2.text[1]);
    ck_assert_msg(j2.end - j2.start < 5000, "job 2 took %lld ms to fail", (long long)(j2.end - j2.start));
    /* Its rank 0 finds the port taken, its rank 1 finds another job's store;
     * whichever fails first, cparrun stops the other before it may speak. */
    ck_assert_msg(strstr(j2.text[1], "Address already in use") || strstr(j2.text[1], "belongs to another job"),
                  "job 2:\n%s", j2.text[1]);
    /* Ranks of another job whose rank 0 is elsewhere (node 1 of a two-node
     * job): refused at the handshake, at once. */
    proc j3;
    char master[64];
    snprintf(master, sizeof master, "127.0.0.1:%d", port - 1);
    proc_run(&j3, cparrun_path(), prog_path(),
             (const char *const[]){"-n", "2", "--nnodes", "2", "--node-rank", "1", "--master", master, "PROG", NULL},
             (const char *const[]){"CPAR_TIMEOUT_MS=20000", "CPAR_JOB_TOKEN=third-job-token", NULL}, 30000);
    ck_assert_msg(j3.status == 1, "job 3: status %d\n%s", j3.status, j3.text[1]);
    ck_assert_msg(j3.end - j3.start < 5000, "job 3 took %lld ms to fail", (long long)(j3.end - j3.start));
    char want[128];
    snprintf(want, sizeof want, "the store at 127.0.0.1:%d belongs to another job", port);
    ASSERT_HAS(j3.text[1], want);
    proc_free(&j3);

    /* Job 1 is unaffected: the test, holding its token, lets it go on. */
    cpar_store_config cfg = {.host = "127.0.0.1", .port = port, .timeout_ms = 5000, .token = "first-job-token"};
    cpar_store *s = NULL;
    ck_assert_msg(cpar_store_create(&cfg, &s) == CPAR_OK, "%s", cpar_thread_last_error());
    ck_assert_int_eq(cpar_store_set(s, "go", "1", 1), CPAR_OK);
    cpar_store_destroy(s);
    proc_finish(&j1, 30000);
    ck_assert_msg(j1.status == 0, "job 1: status %d\n%s", j1.status, j1.text[1]);
    ASSERT_HAS(j1.text[0], "[0] rank 0 ok");
    ASSERT_HAS(j1.text[0], "[1] rank 1 ok");
    proc_free(&j1);
    proc_free(&j2);
}
END_TEST

/* Ranks started by hand with torchrun's variables (ranks[i], worlds[i]); every
 * one must fail within a second or two (the deadline is 20 s) with expect. */
static void run_mislaunched(int n, const int *ranks, const int *worlds, const char *expect)
{
    static char vars[8][6][64];
    proc ps[8];
    int port = free_port_pair();
    for (int i = 0; i < n; i++) {
        snprintf(vars[i][0], 64, "RANK=%d", ranks[i]);
        snprintf(vars[i][1], 64, "WORLD_SIZE=%d", worlds[i]);
        snprintf(vars[i][2], 64, "MASTER_ADDR=127.0.0.1");
        snprintf(vars[i][3], 64, "MASTER_PORT=%d", port);
        snprintf(vars[i][4], 64, "CPAR_TIMEOUT_MS=20000");
        snprintf(vars[i][5], 64, "CPAR_JOB_TOKEN=mislaunched");
        const char *env[] = {vars[i][0], vars[i][1], vars[i][2], vars[i][3], vars[i][4], vars[i][5], NULL};
        proc_start(&ps[i], prog_path(), NULL, (const char *const[]){"ok", NULL}, env);
        if (i == 0) /* rank 0 first: a duplicate rank 0 would find the port taken, not a store */
            proc_read(&ps[0], 5000, "store bound", 1);
    }
    for (int i = 0; i < n; i++) {
        proc_finish(&ps[i], 15000);
        ck_assert_msg(ps[i].status == 1, "member %d: status %d\n%s", i, ps[i].status, ps[i].text[1]);
        ck_assert_msg(ps[i].end - ps[i].start < 8000, "member %d took %lld ms", i,
                      (long long)(ps[i].end - ps[i].start));
        ASSERT_HAS(ps[i].text[1], "cpar_store_join: ");
        ASSERT_HAS(ps[i].text[1], expect);
    }
    for (int i = 0; i < n; i++)
        proc_free(&ps[i]);
}

START_TEST(test_duplicate_rank)
{
    run_mislaunched(4, (const int[]){0, 1, 1, 2}, (const int[]){4, 4, 4, 4}, ") both claim rank 1");
}
END_TEST

START_TEST(test_world_size_mismatch)
{
    run_mislaunched(3, (const int[]){0, 1, 2}, (const int[]){3, 4, 3}, "has world size 3 but rank 1 (pid ");
}
END_TEST

/* torchrun's and mpirun's spellings start the same job as -n. */
START_TEST(test_spellings)
{
    static const char *const forms[][4] = {
        {"-np", "2", NULL},
        {"--nproc_per_node=2", NULL},
        {"--nproc-per-node", "2", "--standalone", NULL},
        {"-n2", "--no-python", NULL},
    };
    for (size_t i = 0; i < sizeof forms / sizeof *forms; i++) {
        const char *args[8];
        int k = 0;
        for (int j = 0; forms[i][j]; j++)
            args[k++] = forms[i][j];
        args[k++] = "PROG";
        args[k] = NULL;
        proc p;
        run(&p, args, NULL, 30000);
        ck_assert_msg(p.status == 0, "form %zu: status %d\n%s", i, p.status, p.text[1]);
        ASSERT_HAS(p.text[0], "[1] rank 1 of 2 (torchrun), local 1 of 2");
        ASSERT_HAS(p.text[0], "[0] rank 0 ok\n");
        proc_free(&p);
    }
}
END_TEST

/* --nproc-per-node gpu/auto: one rank per visible GPU; none visible: 1. */
START_TEST(test_nproc_auto)
{
    proc p;
    run(&p, (const char *const[]){"--nproc-per-node=auto", "PROG", NULL},
        (const char *const[]){"CUDA_VISIBLE_DEVICES=0,1,2", NULL}, 30000);
    ck_assert_msg(p.status == 0, "status %d\n%s", p.status, p.text[1]);
    ASSERT_HAS(p.text[0], "[2] rank 2 of 3 (torchrun), local 2 of 3");
    proc_free(&p);
    run(&p, (const char *const[]){"--nproc_per_node", "gpu", "PROG", NULL},
        (const char *const[]){"CUDA_VISIBLE_DEVICES=", NULL}, 30000);
    ck_assert_msg(p.status == 0, "status %d\n%s", p.status, p.text[1]);
    ASSERT_HAS(p.text[0], "[0] rank 0 of 1 (torchrun), local 0 of 1");
    proc_free(&p);
}
END_TEST

/* --master-addr/--master-port and --rdzv-endpoint, in both value forms. */
START_TEST(test_master_addr_port)
{
    int port = free_port_pair();
    char ps[16], ep[48], want[64];
    snprintf(ps, sizeof ps, "%d", port);
    snprintf(want, sizeof want, "store 127.0.0.1:%d\n", port + 1);
    proc p;
    run(&p, (const char *const[]){"-n", "2", "--master_addr=127.0.0.1", "--master-port", ps, "PROG", NULL}, NULL,
        30000);
    ck_assert_msg(p.status == 0, "status %d\n%s", p.status, p.text[1]);
    ASSERT_HAS(p.text[0], want);
    proc_free(&p);
    port = free_port_pair();
    snprintf(ep, sizeof ep, "127.0.0.1:%d", port);
    snprintf(want, sizeof want, "store 127.0.0.1:%d\n", port + 1);
    run(&p, (const char *const[]){"-n", "2", "--rdzv_endpoint", ep, "PROG", NULL}, NULL, 30000);
    ck_assert_msg(p.status == 0, "status %d\n%s", p.status, p.text[1]);
    ASSERT_HAS(p.text[0], want);
    proc_free(&p);
}
END_TEST

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    static char buf[65536];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* --log-dir: one file per rank, unprefixed, nothing on the terminal;
 * --tee 1 copies stdout back to the terminal. */
START_TEST(test_log_dir)
{
    char dir[] = "/tmp/cparrun_logs_XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char sub[64], path[128], want[64];
    snprintf(sub, sizeof sub, "%s/new/dir", dir); /* created with its parents */
    proc p;
    run(&p, (const char *const[]){"-n", "2", "--log-dir", sub, "PROG", NULL}, NULL, 30000);
    ck_assert_msg(p.status == 0, "status %d\n%s", p.status, p.text[1]);
    ck_assert_msg(!strstr(p.text[0], "rank 0 ok"), "ranks' output on the terminal:\n%s", p.text[0]);
    for (int r = 0; r < 2; r++) {
        snprintf(path, sizeof path, "%s/rank_%d.log", sub, r);
        const char *text = slurp(path);
        ck_assert_msg(text != NULL, "no %s", path);
        snprintf(want, sizeof want, "rank %d ok\n", r);
        ASSERT_HAS(text, want);
        snprintf(want, sizeof want, "rank %d stderr line\n", r); /* both streams */
        ASSERT_HAS(text, want);
        ck_assert_msg(text[0] != '[', "prefixed file:\n%s", text);
        unlink(path);
    }
    proc_free(&p);
    run(&p, (const char *const[]){"-n", "2", "--log-dir=" , sub, "PROG", NULL}, NULL, 30000);
    ck_assert_int_eq(p.status, 2); /* an empty directory name */
    proc_free(&p);
    run(&p, (const char *const[]){"-n", "2", "--log-dir", sub, "--tee", "1", "PROG", NULL}, NULL, 30000);
    ck_assert_msg(p.status == 0, "status %d\n%s", p.status, p.text[1]);
    ASSERT_HAS(p.text[0], "[1] rank 1 ok\n");
    ck_assert_msg(!strstr(p.text[1], "stderr line"), "stderr teed with --tee 1:\n%s", p.text[1]);
    for (int r = 0; r < 2; r++) {
        snprintf(path, sizeof path, "%s/rank_%d.log", sub, r);
        ASSERT_HAS(slurp(path) ? slurp(path) : "", "stderr line");
        unlink(path);
    }
    proc_free(&p);
    snprintf(path, sizeof path, "%s/new/dir", dir);
    rmdir(path);
    snprintf(path, sizeof path, "%s/new", dir);
    rmdir(path);
    rmdir(dir);
}
END_TEST

START_TEST(test_exec_failure)
{
    proc p;
    run(&p, (const char *const[]){"-n", "2", "/nonexistent/prog", NULL}, NULL, 10000);
    ck_assert_int_eq(p.status, 127);
    ASSERT_HAS(p.text[1], "cannot run /nonexistent/prog");
    proc_free(&p);
}
END_TEST

START_TEST(test_usage_errors)
{
    static const struct {
        const char *args[10];
        int status;
        const char *expect;
    } cases[] = {
        {{"--help"}, 0, "usage: cparrun -n N"},
        {{NULL}, 2, "-n N is required"},
        {{"-n", "2"}, 2, "no program to run"},
        {{"-n", "0", "true"}, 2, "-n expects an integer in 1..65536, got \"0\""},
        {{"-n", "two", "true"}, 2, "got \"two\""},
        {{"--bogus", "true"}, 2, "unknown option --bogus"},
        {{"-n", "2", "--nnodes", "2", "true"}, 2, "needs --master-addr HOST"},
        {{"--version"}, 0, "cparrun (cpar) " CPAR__TEST_VERSION},
        {{"-np"}, 2, "-np needs a value"},
        {{"--nproc_per_node=x", "true"}, 2, "--nproc-per-node expects an integer"},
        {{"--nproc", "2", "true"}, 2, "--nproc is not a cparrun option: use -n N"},
        {{"--nnproc-per-node=2", "true"}, 2, "did you mean --nproc-per-node?"},
        {{"--max_restarts=3", "-n", "2", "true"}, 2, "cparrun does not restart ranks"},
        {{"-H", "a,b", "true"}, 2, "one cparrun per node"},
        {{"-n", "2", "--standalone", "--nnodes", "2", "true"}, 2, "--standalone is a single-node job"},
        {{"-n", "2", "--master", "h:1", "--master-addr", "h", "true"}, 2, "give node 0's address once"},
        {{"-n", "2", "--rdzv-endpoint", "[::1", "true"}, 2, "--rdzv-endpoint expects HOST:PORT or [IPv6]:PORT"},
        {{"-n", "2", "--tee", "true"}, 2, "give --log-dir DIR too"},
        {{"-n", "2", "--standalone=1", "true"}, 2, "--standalone takes no value"},
        {{"-n", "2", "--nnodes", "2:4", "true"}, 2, "cparrun has no elastic jobs"},
        {{"-n", "2", "--nnodes", "2", "--node-rank", "2", "--master", "h:1", "true"}, 2, "--node-rank 2 is not below"},
        {{"-n", "2", "--master", "nohostport", "true"}, 2, "--master expects HOST:PORT"},
        {{"-n", "2", "--master", "h:99999", "true"}, 2, "port expects an integer in 1..65535"},
        {{"-n", "2", "--store-port", "0", "true"}, 2, "--store-port expects"},
        {{"-n"}, 2, "-n needs a value"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        proc p;
        run(&p, cases[i].args, NULL, 10000);
        ck_assert_msg(p.status == cases[i].status, "case %zu: status %d", i, p.status);
        ASSERT_HAS(cases[i].status ? p.text[1] : p.text[0], cases[i].expect);
        proc_free(&p);
    }
}
END_TEST

int main(void)
{
    if (access(cparrun_path(), X_OK) != 0 || access(prog_path(), X_OK) != 0) {
        fprintf(stderr, "test_cparrun: need CPARRUN (%s) and STORE_PROG (%s)\n", cparrun_path(), prog_path());
        return EXIT_FAILURE;
    }
    unsetenv("CPAR_STORE_PORT"); /* the tests choose ports themselves */
    unsetenv("CPAR_JOB_TOKEN");  /* cparrun draws one per job */
    unsetenv("CPAR_STORE_BIND");
    unsetenv("CPARRUN_GRACE_MS");
    unsetenv("CPAR_TIMEOUT_MS");
    Suite *s = suite_create("cparrun");
    TCase *tc = tcase_create("launch");
    tcase_set_timeout(tc, 40);
    tcase_add_test(tc, test_success);
    tcase_add_test(tc, test_rank_never_joins);
    tcase_add_test(tc, test_master_never_starts);
    tcase_add_test(tc, test_failing_rank);
    tcase_add_test(tc, test_rank_killed_by_signal);
    tcase_add_test(tc, test_sigterm_forwarded);
    tcase_add_test(tc, test_sigint_forwarded);
    tcase_add_test(tc, test_sigkill_after_grace);
    tcase_add_test(tc, test_two_nodes);
    tcase_add_test(tc, test_two_nodes_need_a_token);
    tcase_add_test(tc, test_store_port);
    tcase_add_test(tc, test_two_jobs_one_port);
    tcase_add_test(tc, test_duplicate_rank);
    tcase_add_test(tc, test_world_size_mismatch);
    tcase_add_test(tc, test_exec_failure);
    tcase_add_test(tc, test_usage_errors);
    tcase_add_test(tc, test_spellings);
    tcase_add_test(tc, test_nproc_auto);
    tcase_add_test(tc, test_master_addr_port);
    tcase_add_test(tc, test_log_dir);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
