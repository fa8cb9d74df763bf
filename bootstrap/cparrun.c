/* SPDX-License-Identifier: MIT */
/* cparrun — start the local ranks of a cpar job, torchrun style.
 *
 *   cparrun -n N [--nnodes M --node-rank R --master HOST:PORT] [--store-port P] prog args...
 *
 * For each local rank it forks and execs prog with the rendezvous environment
 * (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
 * GROUP_RANK, NODE_RANK, CPAR_JOB_TOKEN and, when given, CPAR_STORE_PORT), prefixes every line
 * a rank writes with "[rank] ", forwards SIGINT/SIGTERM/SIGHUP, and when one
 * rank fails it stops the others (SIGTERM, then SIGKILL after a grace period)
 * and exits with the failing rank's status. Standalone POSIX C11: it does not
 * link cpar. See bootstrap/README.md.
 *
 * One thread, one poll() loop over a self-pipe (signals) and every rank's
 * stdout and stderr pipes. Each rank runs in its own process group, so a
 * signal reaches everything it started; on Linux each rank also gets
 * SIGTERM if cparrun itself dies (PR_SET_PDEATHSIG). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* POSIX and Linux APIs under -std=c11, as in cpar.c */
#endif
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#define LINE_CAP (64 * 1024) /* a longer line is cut into pieces of this size */
#define DRAIN_MS 1000        /* after the last rank exits: wait this long for output of its children */

static const char usage_text[] =
    "usage: cparrun -n N [options] prog [args...]\n"
    "\n"
    "Start N local ranks of prog with the environment cpar_init_from_env reads:\n"
    "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,\n"
    "GROUP_RANK and NODE_RANK (and CPAR_STORE_PORT with --store-port), and\n"
    "CPAR_JOB_TOKEN: kept when set, else on one node a random token for this job\n"
    "(on several nodes export the same CPAR_JOB_TOKEN on every node).\n"
    "\n"
    "options:\n"
    "  -n, --nproc-per-node N  ranks on this node (required)\n"
    "  --nnodes M              nodes in the job (default 1)\n"
    "  --node-rank R           this node's index, 0..M-1 (default 0)\n"
    "  --master HOST:PORT      node 0's address; required when M > 1. Default on\n"
    "                          one node: 127.0.0.1 and a free port\n"
    "  --store-port P          port of cpar's store (default MASTER_PORT+1)\n"
    "  -h, --help              this text\n"
    "\n"
    "Every output line is prefixed with \"[rank] \". When a rank fails, the others\n"
    "get SIGTERM, then SIGKILL after CPARRUN_GRACE_MS (default 5000) ms, and\n"
    "cparrun exits with the failing rank's status (128+signal for a signal).\n";

/* ---- small utilities ------------------------------------------------------ */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

#if defined(__GNUC__)
__attribute__((format(printf, 1, 2), noreturn))
#endif
static void die_usage(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("cparrun: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs("\n(cparrun --help for usage)\n", stderr);
    va_end(ap);
    exit(2);
}

/* Strict integer in lo..hi, or a usage error naming the option. */
static long parse_int(const char *opt, const char *s, long lo, long hi)
{
    char *end;
    errno = 0;
    long v = (*s >= '0' && *s <= '9') ? strtol(s, &end, 10) : 0;
    if (!(*s >= '0' && *s <= '9') || errno != 0 || *end != '\0' || v < lo || v > hi)
        die_usage("%s expects an integer in %ld..%ld, got \"%s\"", opt, lo, hi, s);
    return v;
}

/* Write everything, retrying short writes; false when the reader is gone. */
static bool write_all(int fd, struct iovec *iov, int n)
{
    while (n > 0) {
        ssize_t w = writev(fd, iov, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN) {
                struct pollfd p = {.fd = fd, .events = POLLOUT};
                poll(&p, 1, 100);
                continue;
            }
            return false;
        }
        size_t done = (size_t)w;
        while (n > 0 && done >= iov->iov_len)
            done -= iov->iov_len, iov++, n--;
        if (n > 0)
            iov->iov_base = (char *)iov->iov_base + done, iov->iov_len -= done;
    }
    return true;
}

static void set_cloexec(int fd) { fcntl(fd, F_SETFD, FD_CLOEXEC); }
static void set_nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

/* Lowest port the kernel hands out for outgoing connections (Linux's
 * ip_local_port_range; 32768 by default). */
static int ephemeral_port_floor(void)
{
    int lo = 32768, hi = 0;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f) {
        if (fscanf(f, "%d %d", &lo, &hi) != 2 || lo < 2048)
            lo = 32768;
        fclose(f);
    }
    return lo;
}

/* A port P such that P and P+1 are both free now: MASTER_PORT and the
 * store's default MASTER_PORT+1. P is drawn below the ephemeral range: a rank
 * that retries connecting before rank 0 listens could otherwise be given P+1
 * as its own source port, connect to itself and keep the store from binding.
 * A random start keeps concurrent jobs on one machine apart. */
static int pick_free_port_pair(void)
{
    int floor = ephemeral_port_floor(), base = 20000, span = floor - 1 - base;
    if (span < 64) {
        base = 1024;
        span = floor - 1 - base;
    }
    unsigned seed = (unsigned)getpid() * 2654435761u ^ (unsigned)time(NULL);
    for (int attempt = 0; attempt < 256; attempt++) {
        int port = base + (int)(rand_r(&seed) % (unsigned)span);
        int a = socket(AF_INET, SOCK_STREAM, 0), b = socket(AF_INET, SOCK_STREAM, 0), ok = 0;
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY)};
        sa.sin_port = htons((uint16_t)port);
        if (a >= 0 && b >= 0 && bind(a, (struct sockaddr *)&sa, sizeof sa) == 0) {
            sa.sin_port = htons((uint16_t)(port + 1));
            ok = bind(b, (struct sockaddr *)&sa, sizeof sa) == 0;
        }
        if (a >= 0)
            close(a);
        if (b >= 0)
            close(b);
        if (ok)
            return port;
    }
    return 0;
}

/* A random 128-bit job token in hex: the store admits only this job's ranks.
 * false when the kernel has no randomness to give. */
static bool draw_job_token(char *hex, size_t n)
{
    unsigned char b[16];
    size_t got = 0;
    while (got < sizeof b) {
        ssize_t r = getrandom(b + got, sizeof b - got, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    if (got < sizeof b) { /* no getrandom (old kernel): the same source through the device */
        int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
        got = 0;
        while (fd >= 0 && got < sizeof b) {
            ssize_t r = read(fd, b + got, sizeof b - got);
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0)
                break;
            got += (size_t)r;
        }
        if (fd >= 0)
            close(fd);
    }
    if (got < sizeof b || n < 2 * sizeof b + 1)
        return false;
    for (size_t i = 0; i < sizeof b; i++)
        snprintf(hex + 2 * i, 3, "%02x", b[i]);
    return true;
}

/* ---- signals: the handler only writes the signal number to a pipe --------- */

static int sig_pipe[2] = {-1, -1};

static void on_signal(int sig)
{
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    (void)!write(sig_pipe[1], &b, 1); /* full pipe: a wake-up is already pending */
    errno = saved;
}

static void install_handlers(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    signal(SIGPIPE, SIG_IGN); /* our stdout may go away; we keep managing the ranks */
}

/* ---- ranks and their output -------------------------------------------------- */

typedef struct {
    int fd;      /* read end of the rank's pipe; -1 once at EOF */
    int out;     /* where its lines go: 1 or 2 */
    char *buf;   /* the unfinished line */
    size_t len;
} stream;

typedef struct {
    pid_t pid;   /* also its process group id; 0 once reaped */
    int rank;    /* global rank */
    int status;  /* wait status once reaped */
    stream s[2]; /* stdout, stderr */
} rank_proc;

static bool out_broken[3]; /* writing to fd 1/2 failed: keep draining, drop the text */

static void emit(stream *s, int rank, const char *p, size_t n)
{
    if (out_broken[s->out])
        return;
    char prefix[24];
    int pl = snprintf(prefix, sizeof prefix, "[%d] ", rank);
    struct iovec iov[3] = {{prefix, (size_t)pl}, {(void *)p, n}, {"\n", 1}};
    if (!write_all(s->out, iov, 3))
        out_broken[s->out] = true;
}

/* Read what is there; emit whole lines; at EOF emit the partial last line. */
static void pump(stream *s, int rank)
{
    for (;;) {
        ssize_t r = read(s->fd, s->buf + s->len, LINE_CAP - s->len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (r <= 0) { /* EOF (or an error, treated alike) */
            if (s->len)
                emit(s, rank, s->buf, s->len);
            s->len = 0;
            close(s->fd);
            s->fd = -1;
            return;
        }
        s->len += (size_t)r;
        size_t start = 0;
        for (size_t i = s->len - (size_t)r; i < s->len; i++)
            if (s->buf[i] == '\n') {
                emit(s, rank, s->buf + start, i - start);
                start = i + 1;
            }
        memmove(s->buf, s->buf + start, s->len - start);
        s->len -= start;
        if (s->len == LINE_CAP) { /* no newline in 64 KiB: cut it here */
            emit(s, rank, s->buf, s->len);
            s->len = 0;
        }
    }
}

static void exec_rank(char **argv, const char *const *env, int out_fd, int err_fd, pid_t parent)
{
    setpgid(0, 0);
#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGTERM); /* cparrun killed with SIGKILL: don't leave orphans */
    if (getppid() != parent)
        _exit(1);
#else
    (void)parent;
#endif
    int devnull = open("/dev/null", O_RDONLY); /* ranks live in background process groups: no tty reads */
    if (devnull >= 0) {
        dup2(devnull, 0);
        close(devnull);
    }
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    /* exec keeps ignored signals and the mask: give prog the defaults. */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    for (; *env; env += 2)
        setenv(env[0], env[1], 1);
    execvp(argv[0], argv);
    int err = errno;
    dprintf(2, "cparrun: cannot run %s: %s\n", argv[0], strerror(err));
    _exit(err == ENOENT ? 127 : 126); /* as a shell does */
}

static int exit_code(int status)
{
    return WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1;
}

static void signal_ranks(rank_proc *ranks, int n, int sig)
{
    for (int i = 0; i < n; i++)
        if (ranks[i].pid > 0)
            kill(-ranks[i].pid, sig);
}

int main(int argc, char **argv)
{
    long nproc = 0, nnodes = 1, node_rank = 0, store_port = 0;
    const char *master = NULL;
    int argi = 1;
    for (; argi < argc; argi++) {
        char *a = argv[argi], *val = NULL;
        if (!strcmp(a, "--")) {
            argi++;
            break;
        }
        if (a[0] != '-')
            break;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(usage_text, stdout);
            return 0;
        }
        /* --opt=value, --opt value, -nN, -n N */
        char name[32];
        char *eq = strchr(a, '=');
        if (a[1] != '-' && a[1] != '\0' && a[2] != '\0') {
            snprintf(name, sizeof name, "%.2s", a);
            val = a + 2;
        } else if (eq && a[1] == '-') {
            snprintf(name, sizeof name, "%.*s", (int)(eq - a) < 31 ? (int)(eq - a) : 31, a);
            val = eq + 1;
        } else {
            snprintf(name, sizeof name, "%.31s", a);
        }
        bool known = !strcmp(name, "-n") || !strcmp(name, "--nproc-per-node") || !strcmp(name, "--nnodes") ||
                     !strcmp(name, "--node-rank") || !strcmp(name, "--master") || !strcmp(name, "--store-port");
        if (!known)
            die_usage("unknown option %s", a);
        if (!val) {
            if (argi + 1 >= argc)
                die_usage("%s needs a value", name);
            val = argv[++argi];
        }
        if (!strcmp(name, "-n") || !strcmp(name, "--nproc-per-node"))
            nproc = parse_int(name, val, 1, 65536);
        else if (!strcmp(name, "--nnodes"))
            nnodes = parse_int(name, val, 1, 1 << 20);
        else if (!strcmp(name, "--node-rank"))
            node_rank = parse_int(name, val, 0, 1 << 20);
        else if (!strcmp(name, "--store-port"))
            store_port = parse_int(name, val, 1, 65535);
        else
            master = val;
    }
    if (nproc == 0)
        die_usage("-n N is required");
    if (argi >= argc)
        die_usage("no program to run");
    if (node_rank >= nnodes)
        die_usage("--node-rank %ld is not below --nnodes %ld", node_rank, nnodes);
    if (nnodes > 1 && !master)
        die_usage("--nnodes %ld needs --master HOST:PORT, node 0's address, the same on every node", nnodes);
    if (nproc * nnodes > INT_MAX)
        die_usage("world size %ld x %ld is too large", nproc, nnodes);

    /* MASTER_ADDR/MASTER_PORT from HOST:PORT ("[v6addr]:PORT" for IPv6). */
    char master_addr[256] = "127.0.0.1", port_str[16];
    long master_port = 0;
    if (master) {
        const char *colon = strrchr(master, ':');
        if (!colon || colon == master || colon[1] == '\0')
            die_usage("--master expects HOST:PORT, got \"%s\"", master);
        master_port = parse_int("--master's port", colon + 1, 1, 65535);
        const char *h = master;
        size_t hl = (size_t)(colon - master);
        if (h[0] == '[' && colon[-1] == ']')
            h++, hl -= 2;
        if (hl == 0 || hl >= sizeof master_addr)
            die_usage("--master has an empty or too long host: \"%s\"", master);
        memcpy(master_addr, h, hl);
        master_addr[hl] = '\0';
    } else if (!(master_port = pick_free_port_pair())) {
        fprintf(stderr, "cparrun: cannot find a free port for MASTER_PORT; pass --master 127.0.0.1:PORT\n");
        return 1;
    }
    snprintf(port_str, sizeof port_str, "%ld", master_port);

    /* The job token: the user's when exported (the same on every node), else
     * on one node a fresh random one, so two jobs never share a store. The
     * nodes of a multi-node job cannot agree on a random one: the ranks fall back
     * to the launcher's job id or cpar's default (see bootstrap/README.md). */
    char token[64] = "";
    const char *user_token = getenv("CPAR_JOB_TOKEN");
    if (!(user_token && *user_token) && nnodes == 1 && !draw_job_token(token, sizeof token)) {
        fprintf(stderr, "cparrun: cannot draw a random job token: %s; export CPAR_JOB_TOKEN\n", strerror(errno));
        return 1;
    }

    int64_t grace_ms = 5000;
    const char *g = getenv("CPARRUN_GRACE_MS");
    if (g && *g)
        grace_ms = parse_int("CPARRUN_GRACE_MS", g, 0, INT_MAX);

    /* Two pipes per rank: make room when the soft fd limit is low. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        rl.rlim_cur < (rlim_t)(4 * nproc + 64)) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }

    if (pipe(sig_pipe) != 0) {
        perror("cparrun: pipe");
        return 1;
    }
    for (int i = 0; i < 2; i++)
        set_cloexec(sig_pipe[i]), set_nonblock(sig_pipe[i]);
    install_handlers();

    int n = (int)nproc;
    rank_proc *ranks = calloc((size_t)n, sizeof *ranks);
    struct pollfd *pfd = calloc((size_t)(2 * n + 1), sizeof *pfd);
    if (!ranks || !pfd) {
        fprintf(stderr, "cparrun: out of memory\n");
        return 1;
    }
    int exit_status = -1;     /* the first failing rank's code */
    int user_signal = 0;      /* a signal we were sent and forwarded */
    int64_t kill_at = 0;      /* SIGKILL whoever is left at this time (0: not tearing down) */
    int running = 0;

    for (int lr = 0; lr < n; lr++) {
        rank_proc *r = &ranks[lr];
        r->rank = (int)(node_rank * nproc + lr);
        int p[2][2];
        for (int k = 0; k < 2; k++) {
            r->s[k].buf = malloc(LINE_CAP);
            if (!r->s[k].buf || pipe(p[k]) != 0) {
                fprintf(stderr, "cparrun: cannot start rank %d: %s\n", r->rank, strerror(errno));
                exit_status = 1;
                break;
            }
            set_cloexec(p[k][0]), set_cloexec(p[k][1]);
            r->s[k].fd = p[k][0];
            r->s[k].out = k + 1;
        }
        if (exit_status >= 0)
            break;
        char rank_s[24], world_s[24], lrank_s[24], lworld_s[24], node_s[24], store_s[24];
        snprintf(rank_s, sizeof rank_s, "%d", r->rank);
        snprintf(world_s, sizeof world_s, "%ld", nproc * nnodes);
        snprintf(lrank_s, sizeof lrank_s, "%d", lr);
        snprintf(lworld_s, sizeof lworld_s, "%ld", nproc);
        snprintf(node_s, sizeof node_s, "%ld", node_rank);
        snprintf(store_s, sizeof store_s, "%ld", store_port);
        /* Name/value pairs; the optional pairs come last (a NULL name ends the list). */
        const char *env[24] = {"RANK", rank_s, "WORLD_SIZE", world_s, "LOCAL_RANK", lrank_s,
                               "LOCAL_WORLD_SIZE", lworld_s, "GROUP_RANK", node_s, "NODE_RANK", node_s,
                               "MASTER_ADDR", master_addr, "MASTER_PORT", port_str};
        int ne = 16;
        if (store_port)
            env[ne++] = "CPAR_STORE_PORT", env[ne++] = store_s;
        if (token[0])
            env[ne++] = "CPAR_JOB_TOKEN", env[ne++] = token;
        env[ne] = NULL;
        pid_t parent = getpid();
        fflush(NULL);
        pid_t pid = fork();
        if (pid == 0)
            exec_rank(argv + argi, env, p[0][1], p[1][1], parent);
        close(p[0][1]);
        close(p[1][1]);
        set_nonblock(p[0][0]), set_nonblock(p[1][0]);
        if (pid < 0) {
            fprintf(stderr, "cparrun: cannot start rank %d: fork: %s\n", r->rank, strerror(errno));
            exit_status = 1;
            break;
        }
        setpgid(pid, pid); /* also here: no window where a signal misses the new group */
        r->pid = pid;
        running++;
    }
    if (exit_status >= 0) { /* could not start them all: stop the started ones */
        signal_ranks(ranks, n, SIGTERM);
        kill_at = now_ms() + grace_ms;
    }

    int64_t quiet_since = 0; /* all ranks reaped: when output last arrived */
    for (;;) {
        /* Reap: SIGCHLD only wakes us; waitpid says who. */
        int st;
        pid_t pid;
        while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
            for (int i = 0; i < n; i++) {
                rank_proc *r = &ranks[i];
                if (r->pid != pid)
                    continue;
                r->pid = 0, r->status = st;
                running--;
                bool failed = !WIFEXITED(st) || WEXITSTATUS(st) != 0;
                if (failed && exit_status < 0) {
                    exit_status = exit_code(st);
                    if (kill_at == 0) { /* the first failure, not fallout of our own teardown */
                        if (WIFSIGNALED(st))
                            fprintf(stderr, "cparrun: rank %d was killed by signal %d (%s); stopping the others\n",
                                    r->rank, WTERMSIG(st), strsignal(WTERMSIG(st)));
                        else
                            fprintf(stderr, "cparrun: rank %d exited with status %d; stopping the others\n",
                                    r->rank, WEXITSTATUS(st));
                        signal_ranks(ranks, n, SIGTERM);
                        kill_at = now_ms() + grace_ms;
                    }
                }
            }
            if (running == 0)
                quiet_since = now_ms();
        }

        int64_t now = now_ms();
        if (kill_at && now >= kill_at && running > 0) {
            fprintf(stderr, "cparrun: %d rank%s still running %lld ms after SIGTERM; sending SIGKILL\n", running,
                    running == 1 ? "" : "s", (long long)grace_ms);
            signal_ranks(ranks, n, SIGKILL);
            kill_at = INT64_MAX;
        }

        /* Who is still talking? */
        int np = 0;
        pfd[np++] = (struct pollfd){.fd = sig_pipe[0], .events = POLLIN};
        for (int i = 0; i < n; i++)
            for (int k = 0; k < 2; k++)
                if (ranks[i].s[k].fd >= 0)
                    pfd[np++] = (struct pollfd){.fd = ranks[i].s[k].fd, .events = POLLIN};
        if (running == 0 && (np == 1 || now - quiet_since >= DRAIN_MS))
            break; /* done; output left open by a rank's own children is not waited for */

        int timeout = -1;
        if (kill_at && kill_at != INT64_MAX && running > 0)
            timeout = (int)(kill_at - now);
        if (running == 0)
            timeout = (int)(quiet_since + DRAIN_MS - now);
        if (poll(pfd, (nfds_t)np, timeout < 0 && timeout != -1 ? 0 : timeout) < 0 && errno != EINTR) {
            perror("cparrun: poll");
            signal_ranks(ranks, n, SIGKILL);
            return 1;
        }

        if (pfd[0].revents) {
            unsigned char sigs[64];
            ssize_t k;
            while ((k = read(sig_pipe[0], sigs, sizeof sigs)) > 0)
                for (ssize_t j = 0; j < k; j++) {
                    if (sigs[j] == SIGCHLD)
                        continue;
                    if (user_signal) { /* asked twice: stop waiting */
                        signal_ranks(ranks, n, SIGKILL);
                        kill_at = INT64_MAX;
                        continue;
                    }
                    user_signal = sigs[j];
                    signal_ranks(ranks, n, sigs[j]);
                    if (kill_at == 0)
                        kill_at = now_ms() + grace_ms;
                }
        }
        for (int i = 0, j = 1; i < n; i++)
            for (int k = 0; k < 2; k++)
                if (ranks[i].s[k].fd >= 0) {
                    if (pfd[j].fd == ranks[i].s[k].fd && pfd[j].revents) {
                        pump(&ranks[i].s[k], ranks[i].rank);
                        if (running == 0)
                            quiet_since = now_ms();
                    }
                    j++;
                }
    }

    /* A rank's children may still hold its pipes: flush what we have. */
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 2; k++) {
            stream *s = &ranks[i].s[k];
            if (s->fd >= 0) {
                if (s->len)
                    emit(s, ranks[i].rank, s->buf, s->len);
                close(s->fd);
            }
            free(s->buf);
        }
    free(ranks);
    free(pfd);
    if (exit_status >= 0)
        return exit_status;
    return user_signal ? 128 + user_signal : 0;
}
