/* SPDX-License-Identifier: MIT */
/* tests/proc.h — child processes with captured output, for the suites that
 * launch programs (test_cparrun: cparrun and store_prog; test_mp and
 * test_hostmp: cparrun and torchrun-style jobs of mp_prog and hostmp_prog;
 * test_trainjob: the main job). Include once, after testutil.h. */
#ifndef CPAR_TESTS_PROC_H
#define CPAR_TESTS_PROC_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* $NAME, else $B/default (B: the build directory, as tests/run.sh exports it). */
static const char *path_from_env(const char *name, const char *dflt, char *buf, size_t n)
{
    const char *p = getenv(name), *b = getenv("B");
    if (p && *p)
        return p;
    snprintf(buf, n, "%s/%s", b && *b ? b : "build", dflt);
    return buf;
}

/* A function fn() returning $VAR, else $B/dflt (path_from_env), for the
 * programs a suite launches. */
#define PROC_PATH_FN(fn, var, dflt)                                                                          \
    static const char *fn(void) {                                                                            \
        static char buf_[4096];                                                                              \
        return path_from_env(var, dflt, buf_, sizeof buf_);                                                  \
    }

/* $CPARRUN, else $B/cparrun. */
static inline const char *cparrun_path(void)
{
    static char buf[4096];
    return path_from_env("CPARRUN", "cparrun", buf, sizeof buf);
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- a child process with captured stdout and stderr --------------------- */

typedef struct {
    pid_t pid;
    int fd[2];     /* stdout, stderr read ends; -1 at EOF */
    char *text[2]; /* everything read so far, NUL-terminated */
    size_t len[2];
    int status;    /* exit code, or 128+signal */
    const char *exe;
    int64_t start, end;
} proc;

/* Runs exe with args (an argument "PROG" is replaced by prog) and env
 * ("NAME=value" pairs added to ours). */
static void proc_start(proc *p, const char *exe, const char *prog, const char *const *args, const char *const *env)
{
    int out[2], err[2];
    memset(p, 0, sizeof *p);
    p->exe = exe;
    ck_assert_int_eq(pipe(out), 0);
    ck_assert_int_eq(pipe(err), 0);
    int nargs = 0;
    while (args[nargs]) nargs++;
    ck_assert_msg(nargs < 63, "proc_start: %d arguments, at most 62", nargs); /* the child's argv below */
    p->start = now_ms();
    p->pid = fork();
    ck_assert_int_ge(p->pid, 0);
    if (p->pid == 0) {
        dup2(out[1], 1);
        dup2(err[1], 2);
        close(out[0]), close(out[1]), close(err[0]), close(err[1]);
        for (; env && *env; env++)
            putenv((char *)*env);
        char *argv[64];
        int n = 0;
        argv[n++] = (char *)exe;
        for (; *args && n < 63; args++)
            argv[n++] = strcmp(*args, "PROG") ? (char *)*args : (char *)prog;
        argv[n] = NULL;
        execv(argv[0], argv);
        _exit(99);
    }
    close(out[1]), close(err[1]);
    p->fd[0] = out[0], p->fd[1] = err[0];
    for (int k = 0; k < 2; k++) {
        p->text[k] = calloc(1, 1);
        fcntl(p->fd[k], F_SETFL, O_NONBLOCK);
    }
}

/* Read output for up to ms, or until `until` appears `count` times on stdout. */
static void proc_read(proc *p, int ms, const char *until, int count)
{
    int64_t end = now_ms() + ms;
    for (;;) {
        if (until) {
            int seen = 0;
            for (const char *s = p->text[0]; (s = strstr(s, until)); s++)
                seen++;
            if (seen >= count)
                return;
        }
        struct pollfd pf[2];
        int np = 0;
        for (int k = 0; k < 2; k++)
            if (p->fd[k] >= 0)
                pf[np++] = (struct pollfd){.fd = p->fd[k], .events = POLLIN};
        int left = (int)(end - now_ms());
        if (np == 0 || left <= 0)
            return;
        int ready = poll(pf, (nfds_t)np, left);
        if (ready < 0 && errno == EINTR)
            continue; /* a signal is no reason to stop reading */
        if (ready <= 0)
            return;
        for (int k = 0; k < 2; k++) {
            if (p->fd[k] < 0)
                continue;
            char buf[4096];
            ssize_t r = read(p->fd[k], buf, sizeof buf);
            if (r == 0) {
                close(p->fd[k]);
                p->fd[k] = -1;
            } else if (r > 0) {
                p->text[k] = realloc(p->text[k], p->len[k] + (size_t)r + 1);
                memcpy(p->text[k] + p->len[k], buf, (size_t)r);
                p->len[k] += (size_t)r;
                p->text[k][p->len[k]] = '\0';
            }
        }
    }
}

/* Wait for exit (SIGKILL and fail after ms), collecting all output. Its
 * output's end comes before its exit status: up to 10 s more for that, as a
 * loaded machine may stall an exiting process that long (a few ms usually). */
static void proc_finish(proc *p, int ms)
{
    proc_read(p, ms, NULL, 0);
    int st;
    int64_t end = now_ms() + 10000;
    pid_t r;
    while ((r = waitpid(p->pid, &st, WNOHANG)) == 0 && now_ms() < end) {
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    if (r == 0) {
        kill(p->pid, SIGKILL);
        waitpid(p->pid, &st, 0);
        ck_abort_msg("%s did not finish in time; stdout:\n%s\nstderr:\n%s", p->exe, p->text[0], p->text[1]);
    }
    p->end = now_ms();
    p->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    for (int k = 0; k < 2; k++)
        if (p->fd[k] >= 0)
            close(p->fd[k]);
}

static void proc_free(proc *p)
{
    free(p->text[0]);
    free(p->text[1]);
}

static void proc_run(proc *p, const char *exe, const char *prog, const char *const *args, const char *const *env,
                     int ms)
{
    proc_start(p, exe, prog, args, env);
    proc_finish(p, ms);
}

#define ASSERT_HAS(text, needle)                                                                              \
    ck_assert_msg(strstr((text), (needle)) != NULL, "\"%s\" not in output:\n%s", (needle), (text))

/* cond about a finished proc p, with its status and output when it fails. */
#define ASSERT_OUT(p, cond)                                                                                  \
    ck_assert_msg((cond), "%s\nstatus %d\nstdout:\n%s\nstderr:\n%s", #cond, (p)->status, (p)->text[0], (p)->text[1])

/* cparrun -n np prog args... with env (NULL: none) succeeds, and every rank
 * prints "[R] rank R ok" (cparrun's "[R] " prefix, then the program's line). */
static inline void cparrun_job_ok(const char *prog, int np, const char *const *args, const char *const *env)
{
    const char *argv[16] = {"-n", NULL, "PROG"};
    char nps[16];
    snprintf(nps, sizeof nps, "%d", np);
    argv[1] = nps;
    int k = 3;
    for (; args && *args; args++) {
        ck_assert_msg(k < 15, "cparrun_job_ok: more than 12 arguments");
        argv[k++] = *args;
    }
    argv[k] = NULL;
    proc p;
    proc_run(&p, cparrun_path(), prog, argv, env, 120000);
    ASSERT_OUT(&p, p.status == 0);
    char want[48];
    for (int r = 0; r < np; r++) {
        snprintf(want, sizeof want, "[%d] rank %d ok\n", r, r);
        ASSERT_OUT(&p, strstr(p.text[0], want) != NULL);
    }
    proc_free(&p);
}

/* cparrun -n np prog die K, where rank K kills itself mid-collective: the
 * job ends within 10 s (not at the 20 s deadline) with that rank's status,
 * and cparrun names it. */
static inline void cparrun_rank_dies(const char *cparrun, const char *prog, int np, int victim)
{
    char n[16], k[16], want[64];
    snprintf(n, sizeof n, "%d", np), snprintf(k, sizeof k, "%d", victim);
    snprintf(want, sizeof want, "rank %d was killed by signal 9", victim);
    proc p;
    proc_run(&p, cparrun, prog, (const char *const[]){"-n", n, "PROG", "die", k, NULL},
             (const char *const[]){"CPAR_TIMEOUT_MS=20000", NULL}, 60000);
    ASSERT_OUT(&p, p.status == 128 + SIGKILL);
    ASSERT_OUT(&p, strstr(p.text[1], want) != NULL);
    ck_assert_int_lt(p.end - p.start, 10000);
    proc_free(&p);
}

/* After torchrun_start of np ranks in which rank victim kills itself
 * mid-collective: it died by SIGKILL, and every peer exited 1 within 10 s
 * (the death is detected, not timed out), its output on stream (0 stdout, 1
 * stderr) saying CPAR_ERR_PEER, "rank <victim>" and "died". Frees ps. */
static inline void torchrun_rank_died(proc *ps, int np, int victim, int stream)
{
    char who[32];
    snprintf(who, sizeof who, "rank %d", victim);
    for (int r = 0; r < np; r++)
        proc_finish(&ps[r], 40000);
    ASSERT_OUT(&ps[victim], ps[victim].status == 128 + SIGKILL);
    for (int r = 0; r < np; r++) {
        if (r == victim)
            continue;
        const char *t = ps[r].text[stream];
        ASSERT_OUT(&ps[r], ps[r].status == 1);
        ASSERT_OUT(&ps[r], strstr(t, "CPAR_ERR_PEER") && strstr(t, who) && strstr(t, "died"));
        ck_assert_int_lt(ps[r].end - ps[r].start, 10000);
    }
    for (int r = 0; r < np; r++)
        proc_free(&ps[r]);
}

/* Starts np ranks of prog with args as torchrun would (local_world ranks per
 * node, LOCAL_RANK = rank % local_world, TORCHELASTIC_RUN_ID the job's: as
 * torchrun --standalone draws one), on a store port of this test's own,
 * each with CPAR_TIMEOUT_MS=timeout. np <= 8. */
static inline void torchrun_start(proc *ps, int np, int local_world, const char *prog, const char *const *args,
                                  const char *timeout)
{
    static char vars[8][8][64];
    int port = 20000 + (int)(getpid() % 10000) * 2;
    ck_assert_int_le(np, 8);
    for (int r = 0; r < np; r++) {
        snprintf(vars[r][0], 64, "RANK=%d", r);
        snprintf(vars[r][1], 64, "LOCAL_RANK=%d", r % local_world);
        snprintf(vars[r][2], 64, "WORLD_SIZE=%d", np);
        snprintf(vars[r][3], 64, "LOCAL_WORLD_SIZE=%d", local_world);
        snprintf(vars[r][4], 64, "MASTER_ADDR=127.0.0.1");
        snprintf(vars[r][5], 64, "MASTER_PORT=%d", port);
        snprintf(vars[r][6], 64, "CPAR_TIMEOUT_MS=%s", timeout);
        snprintf(vars[r][7], 64, "TORCHELASTIC_RUN_ID=test-%d", (int)getpid());
        const char *env[] = {vars[r][0], vars[r][1], vars[r][2], vars[r][3], vars[r][4], vars[r][5], vars[r][6],
                             vars[r][7], NULL};
        proc_start(&ps[r], prog, NULL, args, env);
    }
}

#endif
