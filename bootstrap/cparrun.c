/* SPDX-License-Identifier: MIT */
/* cparrun — start the local ranks of a cpar job, torchrun style.
 *
 *   cparrun -n N [--nnodes M --node-rank R --master-addr HOST --master-port PORT]
 *           [--store-port P] [--log-dir DIR [--tee]] prog args...
 *
 * It also takes the spellings of torchrun and mpirun (-np, --nproc_per_node,
 * --master_addr, --standalone, --rdzv-endpoint, ...), so a command line
 * written for either runs unchanged; options it does not have are refused
 * with the spelling to use instead.
 *
 * For each local rank it forks and execs prog with the rendezvous environment
 * (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
 * GROUP_RANK, NODE_RANK, CPAR_JOB_TOKEN and, when given, CPAR_STORE_PORT), prefixes every line
 * a rank writes with "[rank] " (or writes it to the rank's file under
 * --log-dir), forwards SIGINT/SIGTERM/SIGHUP, and when one
 * rank fails it stops the others (SIGTERM, then SIGKILL after a grace period)
 * and exits with the failing rank's status. Standalone POSIX C11: it does not
 * link cpar (cpar.h only gives it the version). See bootstrap/README.md.
 *
 * One thread, one poll() loop over a self-pipe (signals) and every rank's
 * stdout and stderr pipes. Each rank runs in its own process group, so a
 * signal reaches everything it started; on Linux each rank also gets
 * SIGTERM if cparrun itself dies (PR_SET_PDEATHSIG). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* POSIX and Linux APIs under -std=c11, as in cpar.c */
#endif
#include <dirent.h>
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
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "../cpar.h" /* CPAR_VERSION_MAJOR/MINOR only: cparrun links nothing of cpar */

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
    "options (--opt=value and --opt value both work; torchrun's _ spellings too):\n"
    "  -n, -np, --nproc-per-node N|gpu|auto\n"
    "                          ranks on this node (required); gpu and auto: one per\n"
    "                          visible GPU (CUDA_VISIBLE_DEVICES, else /dev/nvidiaN;\n"
    "                          1 when none is found)\n"
    "  --nnodes M              nodes in the job (default 1)\n"
    "  --node-rank R           this node's index, 0..M-1 (default 0)\n"
    "  --master-addr HOST      node 0's address, reachable from every node; required\n"
    "                          when M > 1. Default on one node: 127.0.0.1\n"
    "  --master-port PORT      its port (default 29500 with --master-addr; on one\n"
    "                          node without either, a free port)\n"
    "  --master HOST:PORT      both at once ([v6addr]:PORT for IPv6)\n"
    "  --rdzv-endpoint HOST[:PORT]  the same (port default 29400, as torchrun's)\n"
    "  --standalone            one node, 127.0.0.1 and a free port (the default)\n"
    "  --store-port P          port of cpar's store (default MASTER_PORT+1)\n"
    "  --log-dir DIR           write rank R's output to DIR/rank_R.log (both streams,\n"
    "                          unprefixed) instead of the terminal; DIR is created\n"
    "  --tee [0-3]             with --log-dir, also print to the terminal: 3 (the\n"
    "                          default) both streams, 1 stdout, 2 stderr, 0 neither\n"
    "  --no-python             accepted for torchrun compatibility (prog is always\n"
    "                          executed directly)\n"
    "  --version               print cparrun's version\n"
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
    int log_fd;  /* --log-dir: the rank's file (shared by both streams), else -1 */
    bool term;   /* lines also go to the terminal, prefixed */
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
    if (s->log_fd >= 0) { /* the file is the rank's own: no prefix */
        struct iovec iov[2] = {{(void *)p, n}, {"\n", 1}};
        if (!write_all(s->log_fd, iov, 2))
            s->log_fd = -1; /* a full disk must not stop the job: the terminal still gets it */
    }
    if ((!s->term && s->log_fd >= 0) || out_broken[s->out])
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

/* The host backend's shared-memory segments are named
 * "cpar-<FNV-1a of the job token>-<pid>-<n>" (cpar.c, section 8) and unlinked
 * as soon as every member has mapped one; only a rank killed in that moment
 * leaves one behind. When the job ends, remove whatever this job left. */
static void sweep_segments(const char *token)
{
    if (!token || !*token)
        return;
    uint32_t h = 2166136261u;
    for (const char *p = token; *p; p++)
        h = (h ^ (unsigned char)*p) * 16777619u;
    char prefix[32], path[300];
    snprintf(prefix, sizeof prefix, "cpar-%08x-", h);
    DIR *d = opendir("/dev/shm");
    if (!d)
        return;
    for (struct dirent *e; (e = readdir(d));)
        if (!strncmp(e->d_name, prefix, strlen(prefix))) {
            snprintf(path, sizeof path, "/dev/shm/%s", e->d_name);
            unlink(path);
        }
    closedir(d);
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

/* ---- the command line ------------------------------------------------------ */

enum opt_id { O_NPROC, O_NNODES, O_NODE_RANK, O_MASTER, O_MASTER_ADDR, O_MASTER_PORT, O_RDZV, O_STANDALONE,
              O_STORE_PORT, O_LOG_DIR, O_TEE, O_NO_PYTHON, O_VERSION, O_HELP };

/* Every accepted spelling. Long names are matched with '_' read as '-', so
 * torchrun's --nproc_per_node and --master_addr are the same entries. */
static const struct {
    const char *name;
    enum opt_id id;
    int value; /* 0: a flag; 1: takes a value; 2: an optional value (--tee) */
} options[] = {
    {"-n", O_NPROC, 1},               {"-np", O_NPROC, 1},           {"--nproc-per-node", O_NPROC, 1},
    {"--nnodes", O_NNODES, 1},        {"--node-rank", O_NODE_RANK, 1}, {"--master", O_MASTER, 1},
    {"--master-addr", O_MASTER_ADDR, 1}, {"--master-port", O_MASTER_PORT, 1}, {"--rdzv-endpoint", O_RDZV, 1},
    {"--standalone", O_STANDALONE, 0}, {"--store-port", O_STORE_PORT, 1}, {"--log-dir", O_LOG_DIR, 1},
    {"--tee", O_TEE, 2},              {"--no-python", O_NO_PYTHON, 0}, {"--version", O_VERSION, 0},
    {"-h", O_HELP, 0},                {"--help", O_HELP, 0},
};
#define N_OPTIONS (int)(sizeof options / sizeof options[0])

/* Options of torchrun and mpirun that cparrun does not have, with what to
 * write instead: a user's command line from either should fail with advice. */
static const struct {
    const char *name, *advice;
} foreign[] = {
    {"--nproc", "use -n N (or --nproc-per-node N)"},
    {"--npernode", "use -n N: cparrun starts N ranks on the node it runs on"},
    {"-npernode", "use -n N: cparrun starts N ranks on the node it runs on"},
    {"-N", "use -n N: cparrun starts N ranks on the node it runs on"},
    {"-H", "run one cparrun per node with --nnodes M --node-rank R --master-addr HOST"},
    {"--host", "run one cparrun per node with --nnodes M --node-rank R --master-addr HOST"},
    {"--hostfile", "run one cparrun per node with --nnodes M --node-rank R --master-addr HOST"},
    {"--rdzv-backend", "ranks meet at cpar's own store; give --master-addr HOST --master-port PORT"},
    {"--rdzv-id", "export CPAR_JOB_TOKEN=ID instead (it separates jobs on one port)"},
    {"--max-restarts", "cparrun does not restart ranks (it stops the job when one fails)"},
    {"--redirects", "use --log-dir DIR (rank R's output goes to DIR/rank_R.log)"},
    {"--output-filename", "use --log-dir DIR (rank R's output goes to DIR/rank_R.log)"},
    {"-x", "export the variable in cparrun's environment instead (ranks inherit it)"},
    {"--bind-to", "put taskset or numactl in front of the program instead"},
    {"--map-by", "use -n N on each node"},
};

/* "--master_addr" -> "--master-addr": torchrun takes both. */
static void normalise(char *name)
{
    if (name[0] == '-' && name[1] == '-')
        for (char *p = name + 2; *p; p++)
            if (*p == '_')
                *p = '-';
}

/* Levenshtein distance, for "did you mean" (names are short). */
static int edit_distance(const char *a, const char *b)
{
    int la = (int)strlen(a), lb = (int)strlen(b), row[64];
    if (la > 63 || lb > 63)
        return 99;
    for (int j = 0; j <= lb; j++)
        row[j] = j;
    for (int i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= lb; j++) {
            int up = row[j], best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            diag = up;
            row[j] = best;
        }
    }
    return row[lb];
}

#if defined(__GNUC__)
__attribute__((noreturn))
#endif
static void die_unknown(const char *arg, const char *name)
{
    for (size_t i = 0; i < sizeof foreign / sizeof *foreign; i++)
        if (!strcmp(name, foreign[i].name))
            die_usage("%s is not a cparrun option: %s", arg, foreign[i].advice);
    int best = -1, dist = 99;
    for (int i = 0; i < N_OPTIONS; i++) {
        int d = edit_distance(name, options[i].name);
        if (d < dist)
            dist = d, best = i;
    }
    if (best >= 0 && dist <= 3)
        die_usage("unknown option %s; did you mean %s?", arg, options[best].name);
    die_usage("unknown option %s", arg);
}

/* GPUs this node shows its ranks, without linking CUDA: the entries of
 * CUDA_VISIBLE_DEVICES when it is set (CUDA stops at the first invalid one,
 * "-1" included), else the /dev/nvidiaN device nodes. 0 when none is found. */
static long visible_gpus(void)
{
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    if (cvd) {
        long n = 0;
        for (const char *p = cvd; *p;) {
            const char *end = strchr(p, ',');
            size_t len = end ? (size_t)(end - p) : strlen(p);
            while (len && *p == ' ')
                p++, len--;
            if (len == 0 || *p == '-')
                break;
            n++;
            if (!end)
                break;
            p = end + 1;
        }
        return n;
    }
    long n = 0;
    DIR *d = opendir("/dev");
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        if (!strncmp(e->d_name, "nvidia", 6) && e->d_name[6] >= '0' && e->d_name[6] <= '9' &&
            strspn(e->d_name + 6, "0123456789") == strlen(e->d_name + 6))
            n++;
    if (d)
        closedir(d);
    return n;
}

/* HOST:PORT ("[v6addr]:PORT" for IPv6) into addr and *port; a missing port
 * is dflt_port, or an error when dflt_port is 0. */
static void parse_endpoint(const char *opt, const char *s, char *addr, size_t cap, long *port, long dflt_port)
{
    const char *colon;
    if (s[0] == '[') { /* [v6addr] or [v6addr]:PORT */
        const char *close = strchr(s, ']');
        if (!close || (close[1] != '\0' && close[1] != ':'))
            die_usage("%s expects HOST:PORT or [IPv6]:PORT, got \"%s\"", opt, s);
        colon = close[1] == ':' ? close + 1 : NULL;
    } else {
        colon = strrchr(s, ':');
        if (colon && strchr(s, ':') != colon)
            colon = NULL; /* a bare IPv6 address: no port */
    }
    if (!colon && !dflt_port)
        die_usage("%s expects HOST:PORT, got \"%s\"", opt, s);
    if (colon && (colon == s || colon[1] == '\0'))
        die_usage("%s expects HOST:PORT, got \"%s\"", opt, s);
    char what[64];
    snprintf(what, sizeof what, "%s's port", opt);
    *port = colon ? parse_int(what, colon + 1, 1, 65535) : dflt_port;
    const char *h = s;
    size_t hl = colon ? (size_t)(colon - s) : strlen(s);
    if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']')
        h++, hl -= 2;
    if (hl == 0 || hl >= cap)
        die_usage("%s has an empty or too long host: \"%s\"", opt, s);
    memcpy(addr, h, hl);
    addr[hl] = '\0';
}

/* mkdir -p: the log directory may be new, with new parents. */
static int make_dirs(const char *path)
{
    char p[PATH_MAX];
    if (snprintf(p, sizeof p, "%s", path) >= (int)sizeof p)
        return errno = ENAMETOOLONG, -1;
    for (char *s = p + 1; *s; s++)
        if (*s == '/') {
            *s = '\0';
            if (mkdir(p, 0755) != 0 && errno != EEXIST)
                return -1;
            *s = '/';
        }
    return mkdir(p, 0755) != 0 && errno != EEXIST ? -1 : 0;
}

int main(int argc, char **argv)
{
    long nproc = 0, nnodes = 1, node_rank = 0, store_port = 0;
    const char *master = NULL, *master_addr_opt = NULL, *master_port_opt = NULL, *rdzv = NULL, *log_dir = NULL;
    bool standalone = false;
    int tee = -1; /* -1: no --tee; else bits: 1 stdout, 2 stderr */
    int argi = 1;
    for (; argi < argc; argi++) {
        char *a = argv[argi], *val = NULL;
        if (!strcmp(a, "--")) {
            argi++;
            break;
        }
        if (a[0] != '-' || a[1] == '\0')
            break;
        /* --opt=value, --opt value, -np N, -nN, -n N */
        char name[64];
        char *eq = strchr(a, '=');
        if (a[1] == '-' && eq) {
            snprintf(name, sizeof name, "%.*s", (int)(eq - a) < 63 ? (int)(eq - a) : 63, a);
            val = eq + 1;
        } else {
            snprintf(name, sizeof name, "%.63s", a);
        }
        normalise(name);
        int k = 0;
        while (k < N_OPTIONS && strcmp(name, options[k].name))
            k++;
        if (k == N_OPTIONS && a[1] != '-' && !strncmp(a, "-n", 2) && a[2] >= '0' && a[2] <= '9') {
            snprintf(name, sizeof name, "-n"); /* -n4 */
            val = a + 2;
            k = 0;
        }
        if (k == N_OPTIONS)
            die_unknown(a, name);
        if (options[k].value == 0 && val)
            die_usage("%s takes no value, got \"%s\"", name, a);
        if (options[k].value == 1 && !val) {
            if (argi + 1 >= argc)
                die_usage("%s needs a value", name);
            val = argv[++argi];
        }
        if (options[k].value == 2 && !val && argi + 1 < argc && argv[argi + 1][0] >= '0' &&
            argv[argi + 1][0] <= '3' && argv[argi + 1][1] == '\0')
            val = argv[++argi]; /* torchrun's "--tee 3" */
        switch (options[k].id) {
        case O_NPROC:
            if (!strcmp(val, "gpu") || !strcmp(val, "auto")) {
                nproc = visible_gpus();
                if (nproc == 0)
                    nproc = 1; /* no GPU found: one rank, as torchrun's "auto" on a CPU machine */
            } else {
                nproc = parse_int(name, val, 1, 65536);
            }
            break;
        case O_NNODES: {
            /* torchrun's elastic "MIN:MAX" is fine when MIN == MAX */
            const char *colon = strchr(val, ':');
            if (colon) {
                char lo[32];
                snprintf(lo, sizeof lo, "%.*s", (int)(colon - val) < 31 ? (int)(colon - val) : 31, val);
                if (strcmp(lo, colon + 1))
                    die_usage("--nnodes %s: cparrun has no elastic jobs; give one number (--nnodes N)", val);
                val = (char *)colon + 1;
            }
            nnodes = parse_int("--nnodes", val, 1, 1 << 20);
            break;
        }
        case O_NODE_RANK: node_rank = parse_int("--node-rank", val, 0, 1 << 20); break;
        case O_MASTER: master = val; break;
        case O_MASTER_ADDR: master_addr_opt = val; break;
        case O_MASTER_PORT: master_port_opt = val; break;
        case O_RDZV: rdzv = val; break;
        case O_STANDALONE: standalone = true; break;
        case O_STORE_PORT: store_port = parse_int("--store-port", val, 1, 65535); break;
        case O_LOG_DIR:
            if (!*val)
                die_usage("--log-dir needs a directory");
            log_dir = val;
            break;
        case O_TEE:
            if (!val)
                tee = 3;
            else if (val[0] >= '0' && val[0] <= '3' && val[1] == '\0')
                tee = val[0] - '0';
            else
                die_usage("--tee expects 0, 1, 2 or 3 (stdout 1, stderr 2, both 3), got \"%s\"", val);
            break;
        case O_NO_PYTHON: break;
        case O_VERSION:
            printf("cparrun (cpar) %d.%d.%d\n", CPAR_VERSION_MAJOR, CPAR_VERSION_MINOR, CPAR_VERSION_PATCH);
            return 0;
        case O_HELP: fputs(usage_text, stdout); return 0;
        }
    }
    if (nproc == 0)
        die_usage("-n N is required (also -np N, --nproc-per-node N|gpu|auto)");
    if (argi >= argc)
        die_usage("no program to run");
    if ((master != NULL) + (rdzv != NULL) + (master_addr_opt || master_port_opt) > 1)
        die_usage("give node 0's address once: --master HOST:PORT, --rdzv-endpoint HOST:PORT or "
                  "--master-addr HOST --master-port PORT");
    if (standalone && (nnodes > 1 || master || rdzv || master_addr_opt || master_port_opt))
        die_usage("--standalone is a single-node job on 127.0.0.1 and a free port: drop it, or drop --nnodes "
                  "and the master address");
    if (node_rank >= nnodes)
        die_usage("--node-rank %ld is not below --nnodes %ld", node_rank, nnodes);
    if (nnodes > 1 && !master && !rdzv && !master_addr_opt)
        die_usage("--nnodes %ld needs --master-addr HOST (and --master-port PORT, default 29500), node 0's "
                  "address, the same on every node", nnodes);
    if (nproc * nnodes > INT_MAX)
        die_usage("world size %ld x %ld is too large", nproc, nnodes);
    if (tee >= 0 && !log_dir)
        die_usage("--tee copies the --log-dir files to the terminal: give --log-dir DIR too");

    /* MASTER_ADDR/MASTER_PORT: from HOST:PORT, from the two options (port
     * 29500 by default, as torchrun), or on one node 127.0.0.1 and a port
     * found free. */
    char master_addr[256] = "127.0.0.1", port_str[16];
    long master_port = 0;
    if (master)
        parse_endpoint("--master", master, master_addr, sizeof master_addr, &master_port, 0);
    else if (rdzv)
        parse_endpoint("--rdzv-endpoint", rdzv, master_addr, sizeof master_addr, &master_port, 29400);
    else if (master_addr_opt || master_port_opt) {
        if (master_addr_opt) {
            if (!*master_addr_opt || strlen(master_addr_opt) >= sizeof master_addr)
                die_usage("--master-addr has an empty or too long host: \"%s\"", master_addr_opt);
            snprintf(master_addr, sizeof master_addr, "%s", master_addr_opt);
        }
        master_port = master_port_opt ? parse_int("--master-port", master_port_opt, 1, 65535) : 29500;
    } else if (!(master_port = pick_free_port_pair())) {
        fprintf(stderr, "cparrun: cannot find a free port for MASTER_PORT; pass --master-port PORT\n");
        return 1;
    }
    snprintf(port_str, sizeof port_str, "%ld", master_port);
    if (log_dir && make_dirs(log_dir) != 0) {
        fprintf(stderr, "cparrun: cannot create --log-dir %s: %s\n", log_dir, strerror(errno));
        return 1;
    }

    /* The job token: the user's when exported (the same on every node), else
     * on one node a fresh random one, so two jobs never share a store. The
     * nodes of a multi-node job cannot agree on a random one: under SLURM the
     * ranks take its job id, else the user must export one (cpar has no
     * default token: see bootstrap/README.md). */
    char token[64] = "";
    const char *user_token = getenv("CPAR_JOB_TOKEN"), *slurm_job = getenv("SLURM_JOB_ID");
    if (!(user_token && *user_token) && nnodes == 1 && !draw_job_token(token, sizeof token)) {
        fprintf(stderr, "cparrun: cannot draw a random job token: %s; export CPAR_JOB_TOKEN\n", strerror(errno));
        return 1;
    }
    if (!(user_token && *user_token) && nnodes > 1 && !(slurm_job && *slurm_job)) {
        fprintf(stderr, "cparrun: --nnodes %ld needs CPAR_JOB_TOKEN: the nodes cannot agree on a random token, so "
                "export the same secret on every node (e.g. CPAR_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | "
                "tr -d ' \\n') on one, the same value on the others)\n", nnodes);
        return 2;
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
    for (int i = 0; i < n; i++)
        ranks[i].s[0].log_fd = ranks[i].s[1].log_fd = -1;
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
            r->s[k].term = !log_dir || (tee > 0 && (tee & (k + 1)));
        }
        if (exit_status >= 0)
            break;
        if (log_dir) {
            char path[PATH_MAX];
            snprintf(path, sizeof path, "%s/rank_%d.log", log_dir, r->rank);
            int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
            if (fd < 0) {
                fprintf(stderr, "cparrun: cannot start rank %d: cannot open %s: %s\n", r->rank, path,
                        strerror(errno));
                exit_status = 1;
                break;
            }
            r->s[0].log_fd = r->s[1].log_fd = fd;
        }
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
        /* Reap: SIGCHLD only wakes us; waitpid says who. Everyone who has
         * exited is reaped before the failure is chosen: waitpid returns the
         * zombies in no particular order, and a rank that died by a signal
         * is the likelier cause of its peers' failing exits (they notice it
         * and give up, often before we run), so within one batch it wins. */
        int st;
        pid_t pid;
        rank_proc *first_failed = NULL;
        while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
            for (int i = 0; i < n; i++) {
                rank_proc *r = &ranks[i];
                if (r->pid != pid)
                    continue;
                r->pid = 0, r->status = st;
                running--;
                bool failed = !WIFEXITED(st) || WEXITSTATUS(st) != 0;
                if (failed && (!first_failed || (WIFSIGNALED(st) && !WIFSIGNALED(first_failed->status))))
                    first_failed = r;
            }
            if (running == 0)
                quiet_since = now_ms();
        }
        /* A rank that exits with an error may be reacting to a peer still
         * dying (a peer's death is visible to the others a moment before it
         * is a zombie): give such a peer 50 ms to turn up before choosing. */
        for (int wait = 0; first_failed && exit_status < 0 && kill_at == 0 && !WIFSIGNALED(first_failed->status) &&
                           running > 0 && wait < 5;
             wait++) {
            struct timespec ts = {0, 10 * 1000000L};
            nanosleep(&ts, NULL);
            while ((pid = waitpid(-1, &st, WNOHANG)) > 0)
                for (int i = 0; i < n; i++)
                    if (ranks[i].pid == pid) {
                        ranks[i].pid = 0, ranks[i].status = st;
                        running--;
                        if (WIFSIGNALED(st) && !WIFSIGNALED(first_failed->status))
                            first_failed = &ranks[i];
                    }
            if (running == 0)
                quiet_since = now_ms();
        }
        if (first_failed && exit_status < 0) {
            rank_proc *r = first_failed;
            exit_status = exit_code(r->status);
            if (kill_at == 0) { /* the first failure, not fallout of our own teardown */
                if (WIFSIGNALED(r->status))
                    fprintf(stderr, "cparrun: rank %d was killed by signal %d (%s); stopping the others\n", r->rank,
                            WTERMSIG(r->status), strsignal(WTERMSIG(r->status)));
                else
                    fprintf(stderr, "cparrun: rank %d exited with status %d; stopping the others\n", r->rank,
                            WEXITSTATUS(r->status));
                signal_ranks(ranks, n, SIGTERM);
                kill_at = now_ms() + grace_ms;
            }
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

    sweep_segments(token[0] ? token : user_token);

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
    for (int i = 0; i < n; i++) /* both streams share it; a failed write left -1 in one */
        if (ranks[i].s[0].log_fd >= 0 || ranks[i].s[1].log_fd >= 0)
            close(ranks[i].s[0].log_fd >= 0 ? ranks[i].s[0].log_fd : ranks[i].s[1].log_fd);
    free(ranks);
    free(pfd);
    if (exit_status >= 0)
        return exit_status;
    return user_signal ? 128 + user_signal : 0;
}
