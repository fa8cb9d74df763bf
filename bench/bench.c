/* SPDX-License-Identifier: MIT */
/* bench.c — cpar's benchmarks (make bench).
 *
 * Collectives: for each operation, group size and message size, the median
 * time per call, the bytes each rank received (from cpar's communication
 * statistics) against the algorithm's minimum, and the bus bandwidth (the
 * nccl-tests definition: algbw * 2(n-1)/n for all-reduce, (n-1)/n for the
 * gathers and scatters) as a fraction of a ceiling measured in the same run:
 * single-thread memcpy on the host backend, device-to-device copy on GPUs.
 *
 * Environment: CPAR_BENCH_ITERS (default 10), CPAR_BENCH_MAX_MIB (default 16),
 * CPAR_BENCH_ONLY (comma-separated sections: coll, procs, map, xent, gemm, mlp,
 * attn, mamba, mb; default all). procs: the host backend with ranks as
 * processes (as under cparrun without GPUs) against its threads, at 2 and 4
 * ranks, for all-reduce, all-gather and reduce-scatter; the tensors come from
 * cpar_tensor_alloc, so they lie in the ranks' arenas and the collectives
 * move them in place (CPAR_HOST_ARENA=0 measures the path staged through
 * the shared segment instead). CPAR_BENCH_MB: only the mb rows whose kernel
 * name contains it.
 *
 * Flags (build/bench --help): --csv FILE and --json FILE write every row of
 * every table, with its section, for plots and regression tracking; -b, -e,
 * -f sweep the collectives' message size as nccl-tests do (-b 8K -e 64M -f 2:
 * 8 KiB to 64 MiB, doubling); -n sets the iterations per case.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <time.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cpar.h"

#ifdef CPAR_BENCH_CBLAS /* make found OpenBLAS or BLIS: the host GEMM's ceiling */
#include <cblas.h>
#undef I /* OpenBLAS's header pulls in <complex.h> */
#endif

#define TRY(call)                                                                                            \
    do {                                                                                                     \
        cpar_status st_ = (call);                                                                            \
        if (st_ != CPAR_OK) return st_;                                                                      \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The calling thread's CPU time: on a shared machine the time slices other
 * processes take stretch the wall clock of a long call (the ceiling's GEMM)
 * more than that of a short one, which the CPU time does not see. */
static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int env_int(const char *name, int dflt) {
    const char *v = getenv(name);
    return v && atoi(v) > 0 ? atoi(v) : dflt;
}

/* Is section name selected by CPAR_BENCH_ONLY (unset: every section)? */
static bool want(const char *name) {
    const char *only = getenv("CPAR_BENCH_ONLY");
    if (!only || !*only) return true;
    size_t n = strlen(name);
    for (const char *p = only; (p = strstr(p, name)); p += n)
        if ((p == only || p[-1] == ',') && (p[n] == ',' || p[n] == '\0')) return true;
    return false;
}

/* ---- machine-readable output: every printed row is also recorded ---------------------------------
 * rec_begin(section) starts a row; rec_s/rec_i/rec_f add a column (units in
 * the column name: time_ms, busbw_gbps). At exit the rows go to --csv (one
 * header: "section" and the union of every section's columns, in the order
 * first seen; a column a section lacks is empty; and beside it one table per
 * section, FILE-SECTION.csv, with its own columns only) and --json (an array
 * of objects). */
#define REC_COLS 24
typedef struct {
    char section[48];
    int n;
    char name[REC_COLS][32];
    char val[REC_COLS][64];
    bool num[REC_COLS];
} rec_row;
static rec_row *rec_rows;
static int rec_n, rec_cap;

static void rec_begin(const char *section) {
    if (rec_n == rec_cap) {
        rec_cap = rec_cap ? 2 * rec_cap : 64;
        rec_rows = realloc(rec_rows, (size_t)rec_cap * sizeof *rec_rows);
        if (!rec_rows) { fprintf(stderr, "bench: out of memory\n"); exit(1); }
    }
    rec_row *r = &rec_rows[rec_n++];
    memset(r, 0, sizeof *r);
    snprintf(r->section, sizeof r->section, "%s", section);
}

static void rec_put(const char *name, bool num, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void rec_put(const char *name, bool num, const char *fmt, ...) {
    rec_row *r = &rec_rows[rec_n - 1];
    if (r->n == REC_COLS) return;
    snprintf(r->name[r->n], sizeof r->name[0], "%s", name);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->val[r->n], sizeof r->val[0], fmt, ap);
    va_end(ap);
    r->num[r->n++] = num;
}
static void rec_s(const char *name, const char *v) { rec_put(name, false, "%s", v); }
static void rec_i(const char *name, long long v) { rec_put(name, true, "%lld", v); }
static void rec_f(const char *name, double v) {
    if (isfinite(v)) rec_put(name, true, "%.6g", v);
    else rec_put(name, false, "%s", ""); /* JSON has no NaN: an empty string, an empty CSV field */
}

static void csv_field(FILE *f, const char *s) {
    if (!strpbrk(s, ",\"\n")) { fputs(s, f); return; }
    fputc('"', f);
    for (; *s; s++) { if (*s == '"') fputc('"', f); fputc(*s, f); }
    fputc('"', f);
}

/* The rows of section only (NULL: every row) as CSV at path: a "section"
 * column, then the union of those rows' columns. */
static int rec_write_csv_rows(const char *path, const char *only) {
    FILE *f = fopen(path, "w");
    if (!f) { fprintf(stderr, "bench: cannot write %s\n", path); return 1; }
    static char cols[256][32];
    int nc = 0;
    for (int i = 0; i < rec_n; i++)
        for (int j = 0; j < rec_rows[i].n && !(only && strcmp(rec_rows[i].section, only)); j++) {
            int k = 0;
            while (k < nc && strcmp(cols[k], rec_rows[i].name[j])) k++;
            if (k == nc && nc < 256) snprintf(cols[nc++], sizeof cols[0], "%s", rec_rows[i].name[j]);
        }
    fputs("section", f);
    for (int k = 0; k < nc; k++) fprintf(f, ",%s", cols[k]);
    fputc('\n', f);
    for (int i = 0; i < rec_n; i++) {
        if (only && strcmp(rec_rows[i].section, only)) continue;
        csv_field(f, rec_rows[i].section);
        for (int k = 0; k < nc; k++) {
            fputc(',', f);
            for (int j = 0; j < rec_rows[i].n; j++)
                if (!strcmp(rec_rows[i].name[j], cols[k])) { csv_field(f, rec_rows[i].val[j]); break; }
        }
        fputc('\n', f);
    }
    return fclose(f) ? 1 : 0;
}

/* --csv FILE: FILE holds every row (one header for all: the columns a
 * section lacks are empty), and FILE's name with "-SECTION" before ".csv"
 * one table per section with only its own columns (the meta row is the
 * "-meta" table: version, commit, date, machine). */
static int rec_write_csv(const char *path) {
    int rc = rec_write_csv_rows(path, NULL);
    const char *dot = strrchr(path, '.'), *slash = strrchr(path, '/');
    const size_t stem = dot && (!slash || dot > slash) ? (size_t)(dot - path) : strlen(path);
    for (int i = 0; i < rec_n; i++) {
        int first = 0;
        while (first < i && strcmp(rec_rows[first].section, rec_rows[i].section)) first++;
        if (first < i) continue; /* written with its section's first row */
        char one[4200];
        snprintf(one, sizeof one, "%.*s-%s.csv", (int)stem, path, rec_rows[i].section);
        rc |= rec_write_csv_rows(one, rec_rows[i].section);
    }
    return rc;
}

static void json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fputc('\\', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

static int rec_write_json(const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) { fprintf(stderr, "bench: cannot write %s\n", path); return 1; }
    fputs("[\n", f);
    for (int i = 0; i < rec_n; i++) {
        fputs("  {\"section\": ", f);
        json_str(f, rec_rows[i].section);
        for (int j = 0; j < rec_rows[i].n; j++) {
            fputs(", ", f);
            json_str(f, rec_rows[i].name[j]);
            fputs(": ", f);
            if (rec_rows[i].num[j]) fputs(rec_rows[i].val[j], f);
            else json_str(f, rec_rows[i].val[j]);
        }
        fputs(i + 1 < rec_n ? "},\n" : "}\n", f);
    }
    fputs("]\n", f);
    return fclose(f) ? 1 : 0;
}

/* "8", "8K", "64M", "1G" (binary multiples) -> bytes; 0 when malformed. */
static size_t parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    size_t mult = 1;
    if (*end == 'K' || *end == 'k') mult = (size_t)1 << 10, end++;
    else if (*end == 'M' || *end == 'm') mult = (size_t)1 << 20, end++;
    else if (*end == 'G' || *end == 'g') mult = (size_t)1 << 30, end++;
    if (*end == 'B' || *end == 'b') end++;
    if (end == s || *end || !(v >= 1) || v * (double)mult > 1e13) return 0;
    return (size_t)(v * (double)mult);
}

/* 8 B, 64 KiB, 16 MiB: the table's size column. */
static const char *fmt_size(size_t bytes, char *buf, size_t n) {
    if (bytes >= ((size_t)1 << 30) && bytes % ((size_t)1 << 30) == 0) snprintf(buf, n, "%zu GiB", bytes >> 30);
    else if (bytes >= ((size_t)1 << 20) && bytes % ((size_t)1 << 20) == 0) snprintf(buf, n, "%zu MiB", bytes >> 20);
    else if (bytes >= 1024 && bytes % 1024 == 0) snprintf(buf, n, "%zu KiB", bytes >> 10);
    else snprintf(buf, n, "%zu B", bytes);
    return buf;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

enum { OP_ALL_REDUCE, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_ALL_TO_ALL, OP_BROADCAST, OP_COUNT };
static const char *const op_names[OP_COUNT] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                               "broadcast"};
static const cpar_coll_kind op_kinds[OP_COUNT] = {CPAR_COLL_ALL_REDUCE, CPAR_COLL_ALL_GATHER,
                                                   CPAR_COLL_REDUCE_SCATTER, CPAR_COLL_ALL_TO_ALL,
                                                   CPAR_COLL_BROADCAST};

typedef struct {
    int op, iters;
    size_t bytes;      /* message size: the full tensor of the operation */
    double seconds;    /* median per call, rank 0 */
    uint64_t recv;     /* bytes received per call by rank 0 */
} coll_case;

static cpar_status run_case(cpar_ctx *ctx, void *arg) {
    coll_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g);
    int64_t elems = (int64_t)(c->bytes / sizeof(float)) / n * n, part = elems / n;
    cpar_tensor full, shard;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &elems, &full));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &part, &shard));
    TRY(cpar_fill(ctx, &full, 1.0));
    TRY(cpar_fill(ctx, &shard, 1.0));
    cpar_tensor out;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &elems, &out));
    double *t = malloc(sizeof(double) * (size_t)c->iters);
    for (int it = -1; it < c->iters; it++) { /* iteration -1 warms up */
        TRY(cpar_barrier(g));
        if (it == 0) TRY(cpar_group_stats_reset(g));
        double t0 = now_s();
        switch (c->op) {
        case OP_ALL_REDUCE: TRY(cpar_all_reduce(g, &full, &full, CPAR_SUM)); break;
        case OP_ALL_GATHER: TRY(cpar_all_gather(g, &shard, &out, NULL)); break;
        case OP_REDUCE_SCATTER: TRY(cpar_reduce_scatter(g, &full, &shard, CPAR_SUM, NULL)); break;
        case OP_ALL_TO_ALL: TRY(cpar_all_to_all_single(g, &full, &out, NULL, NULL)); break;
        default: TRY(cpar_broadcast(g, &full, 0)); break;
        }
        TRY(cpar_sync(ctx));
        if (it >= 0) t[it] = now_s() - t0;
    }
    if (cpar_rank(ctx) == 0) {
        qsort(t, (size_t)c->iters, sizeof *t, cmp_double);
        c->seconds = t[c->iters / 2];
        cpar_comm_stats s;
        TRY(cpar_group_stats(g, &s));
        c->recv = s.kind[op_kinds[c->op]].bytes_recv / (uint64_t)c->iters;
    }
    free(t);
    TRY(cpar_tensor_free(ctx, &full));
    TRY(cpar_tensor_free(ctx, &shard));
    return cpar_tensor_free(ctx, &out);
}

/* The host backend across processes: n forked ranks join through the store
 * (torchrun's variables, a store port of their own) and run run_case as the
 * threads do; rank 0 hands its figures back through a pipe. Returns 0 on
 * success. */
static int run_case_procs(int n, coll_case *c) {
    int fds[2];
    if (pipe(fds) != 0) return 1;
    /* a free port for the store: the kernel picks one, the job then binds it */
    int port = 0, sock = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    if (sock >= 0 && bind(sock, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(sock, (struct sockaddr *)&a, &alen) == 0)
        port = ntohs(a.sin_port);
    if (sock >= 0) close(sock);
    if (!port) return 1;
    static unsigned job;
    job++;
    fflush(stdout);
    pid_t pids[64];
    for (int r = 0; r < n; r++) {
        pids[r] = fork();
        if (pids[r] < 0) return 1;
        if (pids[r] == 0) {
            char v[64];
            snprintf(v, sizeof v, "%d", r), setenv("RANK", v, 1), setenv("LOCAL_RANK", v, 1);
            snprintf(v, sizeof v, "%d", n), setenv("WORLD_SIZE", v, 1), setenv("LOCAL_WORLD_SIZE", v, 1);
            snprintf(v, sizeof v, "%d", port), setenv("CPAR_STORE_PORT", v, 1);
            snprintf(v, sizeof v, "bench-%ld-%u", (long)getppid(), job), setenv("CPAR_JOB_TOKEN", v, 1);
            setenv("MASTER_ADDR", "127.0.0.1", 1);
            cpar_init_config cfg = {.backend = CPAR_BACKEND_HOST};
            cpar_ctx *ctx = NULL;
            cpar_status st = cpar_init_from_env(&cfg, &ctx);
            if (st == CPAR_OK) st = run_case(ctx, c);
            if (st != CPAR_OK) fprintf(stderr, "bench: rank %d: %s\n", r, cpar_thread_last_error());
            if (st == CPAR_OK && r == 0 && write(fds[1], c, sizeof *c) != (ssize_t)sizeof *c) st = CPAR_ERR_SYSTEM;
            if (ctx) cpar_finalize(ctx);
            _exit(st == CPAR_OK ? 0 : 1);
        }
    }
    close(fds[1]);
    int bad = 0;
    for (int r = 0; r < n; r++) {
        int ws = 0;
        waitpid(pids[r], &ws, 0);
        bad |= !WIFEXITED(ws) || WEXITSTATUS(ws) != 0;
    }
    bad |= read(fds[0], c, sizeof *c) != (ssize_t)sizeof *c;
    close(fds[0]);
    return bad;
}

/* Bytes rank 0 must receive at least, and the bus-bandwidth factor. */
static uint64_t min_recv(int op, int n, size_t bytes, double *bus_factor) {
    size_t part = bytes / (size_t)n;
    switch (op) {
    case OP_ALL_REDUCE: *bus_factor = 2.0 * (n - 1) / n; return (uint64_t)(bytes - part + (size_t)(n - 1) * part);
    case OP_BROADCAST: *bus_factor = 1.0; return 0; /* rank 0 is the root */
    default: *bus_factor = (double)(n - 1) / n; return (uint64_t)(bytes - part);
    }
}

typedef struct {
    size_t bytes;
    double gbps;
} copy_case;

/* The ceiling: one copy of bytes on the rank's device (median of 5). With
 * more ranks (threads of one host job) every rank copies its own buffer
 * between two barriers, as a collective is timed: GB/s copied by all of
 * them together. */
static cpar_status run_copy(cpar_ctx *ctx, void *arg) {
    copy_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int64_t elems = (int64_t)(c->bytes / sizeof(float));
    cpar_tensor a, b;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &elems, &a));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &elems, &b));
    TRY(cpar_fill(ctx, &a, 1.0));
    TRY(cpar_fill(ctx, &b, 2.0));
    double t[5];
    for (int it = -1; it < 5; it++) {
        TRY(cpar_sync(ctx));
        TRY(cpar_barrier(g));
        double t0 = now_s();
        TRY(cpar_tensor_copy(ctx, &a, &b));
        TRY(cpar_sync(ctx));
        TRY(cpar_barrier(g));
        if (it >= 0) t[it] = now_s() - t0;
    }
    qsort(t, 5, sizeof *t, cmp_double);
    if (cpar_rank(ctx) == 0) c->gbps = (double)c->bytes * cpar_group_size(g) / t[2] / 1e9;
    TRY(cpar_tensor_free(ctx, &a));
    return cpar_tensor_free(ctx, &b);
}

/* Bytes a host collective must copy at least, counted as memcpy counts them
 * (a copy of N bytes reads N and writes N): all-reduce, all-gather and
 * all-to-all read n buffers of bytes and write n; reduce-scatter reads n
 * and writes one; broadcast reads and writes n - 1. */
static double host_copy_bytes(int op, int n, size_t bytes) {
    switch (op) {
    case OP_REDUCE_SCATTER: return (double)bytes * (n + 1) / 2.0;
    case OP_BROADCAST: return (double)bytes * (n - 1);
    default: return (double)bytes * n;
    }
}

/* ---- tensor-parallel mappings ----------------------------------------------
 * Activations [s, b, h] in fp32; rank 0's time per call and received bytes. */
enum { MAP_GATHER_SP, MAP_RS_SP, MAP_GATHER_TP, MAP_SP2HP, MAP_COUNT };
static const char *const map_names[MAP_COUNT] = {"gather_from_sp fwd", "reduce_scatter_to_sp fwd",
                                                 "gather_from_tp fwd", "all_to_all_sp2hp"};

typedef struct {
    int op, iters;
    int64_t s, b, h; /* the full activation */
    double seconds;
    uint64_t recv;
} map_case;

static cpar_status run_map(cpar_ctx *ctx, void *arg) {
    map_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g);
    int64_t full[3] = {c->s, c->b, c->h}, seq[3] = {c->s / n, c->b, c->h}, hid[3] = {c->s, c->b, c->h / n};
    int64_t t_sp[2] = {c->s * c->b / n, c->h}, t_hp[2] = {c->s * c->b, c->h / n};
    const int64_t *in_shape = full, *out_shape = full;
    int in_nd = 3, out_nd = 3;
    switch (c->op) {
    case MAP_GATHER_SP: in_shape = seq; break;
    case MAP_RS_SP: out_shape = seq; break;
    case MAP_GATHER_TP: in_shape = hid; break;
    default: in_shape = t_sp; out_shape = t_hp; in_nd = out_nd = 2; break;
    }
    cpar_tensor in, out;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, in_nd, in_shape, &in));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, out_nd, out_shape, &out));
    TRY(cpar_fill(ctx, &in, 1.0));
    double *t = malloc(sizeof(double) * (size_t)c->iters);
    for (int it = -1; it < c->iters; it++) {
        TRY(cpar_barrier(g));
        if (it == 0) TRY(cpar_group_stats_reset(g));
        double t0 = now_s();
        switch (c->op) {
        case MAP_GATHER_SP: TRY(cpar_gather_from_sp_region(g, &in, &out, CPAR_FWD, true, NULL)); break;
        case MAP_RS_SP: TRY(cpar_reduce_scatter_to_sp_region(g, &in, &out, CPAR_FWD, NULL)); break;
        case MAP_GATHER_TP: TRY(cpar_gather_from_tp_region(g, &in, &out, CPAR_FWD)); break;
        default: TRY(cpar_all_to_all_sp2hp(g, &in, &out, CPAR_FWD)); break;
        }
        TRY(cpar_sync(ctx));
        if (it >= 0) t[it] = now_s() - t0;
    }
    if (cpar_rank(ctx) == 0) {
        qsort(t, (size_t)c->iters, sizeof *t, cmp_double);
        c->seconds = t[c->iters / 2];
        cpar_comm_stats st;
        TRY(cpar_group_stats(g, &st));
        uint64_t recv = 0;
        for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++) recv += st.kind[k].bytes_recv;
        c->recv = recv / (uint64_t)c->iters;
    }
    free(t);
    TRY(cpar_tensor_free(ctx, &in));
    return cpar_tensor_free(ctx, &out);
}

/* ---- vocabulary-parallel cross entropy ----------------------------------------
 * tokens x vocab/tp logits in fp32; forward, then backward in place. */
typedef struct {
    int iters;
    int64_t tokens, vocab;
    double fwd, bwd;
    uint64_t recv;
} xent_case;

static cpar_status run_xent(cpar_ctx *ctx, void *arg) {
    xent_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g);
    int64_t lshape[2] = {c->tokens, c->vocab / n}, tshape[1] = {c->tokens}, sshape[2] = {c->tokens, 2};
    cpar_tensor logits, target, loss, stats, dloss;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 2, lshape, &logits));
    TRY(cpar_tensor_alloc(ctx, CPAR_I64, 1, tshape, &target));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, tshape, &loss));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 2, sshape, &stats));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, tshape, &dloss));
    TRY(cpar_fill(ctx, &target, 7.0));
    TRY(cpar_fill(ctx, &dloss, 1.0));
    double *tf = malloc(sizeof(double) * (size_t)c->iters), *tb = malloc(sizeof(double) * (size_t)c->iters);
    for (int it = -1; it < c->iters; it++) {
        TRY(cpar_rng_uniform(ctx, &logits, -4.0f, 4.0f));
        TRY(cpar_barrier(g));
        if (it == 0) TRY(cpar_group_stats_reset(g));
        double t0 = now_s();
        TRY(cpar_vocab_parallel_cross_entropy_forward(g, &logits, &target, 0.0f, &loss, &stats));
        TRY(cpar_sync(ctx));
        double t1 = now_s();
        TRY(cpar_vocab_parallel_cross_entropy_backward(g, &logits, &target, 0.0f, &stats, &dloss, &logits));
        TRY(cpar_sync(ctx));
        if (it >= 0) {
            tf[it] = t1 - t0;
            tb[it] = now_s() - t1;
        }
    }
    if (cpar_rank(ctx) == 0) {
        qsort(tf, (size_t)c->iters, sizeof *tf, cmp_double);
        qsort(tb, (size_t)c->iters, sizeof *tb, cmp_double);
        c->fwd = tf[c->iters / 2];
        c->bwd = tb[c->iters / 2];
        cpar_comm_stats st;
        TRY(cpar_group_stats(g, &st));
        c->recv = st.kind[CPAR_COLL_ALL_REDUCE].bytes_recv / (uint64_t)c->iters;
    }
    free(tf);
    free(tb);
    cpar_tensor *ts[] = {&logits, &target, &loss, &stats, &dloss};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) TRY(cpar_tensor_free(ctx, ts[i]));
    return CPAR_OK;
}

/* ---- linear layers -------------------------------------------------------------
 * Megatron's MLP block: column-parallel [h -> 4h] then row-parallel [4h -> h]
 * on activations [s, b, h], forward + backward (dgrad and wgrad), fp32. The
 * ceiling is the FLOP rate of one plain GEMM of the same per-rank work on
 * this backend, measured in this run (a 1-rank layer forward). */
typedef struct {
    int iters;
    bool sp;
    int64_t s, b, h;
    double seconds;
    uint64_t recv;
} mlp_case;

static cpar_status run_mlp(cpar_ctx *ctx, void *arg) {
    mlp_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g);
    int64_t s_loc = c->sp ? c->s / n : c->s;
    int64_t xs[3] = {s_loc, c->b, c->h}, ms[3] = {c->s, c->b, 4 * c->h / n};
    cpar_linear_config col = {.input_size = c->h, .output_size = 4 * c->h, .bias = true, .sequence_parallel = c->sp};
    cpar_linear_config row = {.input_size = 4 * c->h, .output_size = c->h, .bias = true, .input_is_parallel = true,
                              .sequence_parallel = c->sp};
    cpar_linear *l1, *l2;
    TRY(cpar_model_parallel_manual_seed(ctx, 1234, cpar_group_rank(g), 0, 0));
    TRY(cpar_column_parallel_linear_create(g, &col, &l1));
    TRY(cpar_row_parallel_linear_create(g, &row, &l2));
    TRY(cpar_linear_init_random(l1, 0.02f));
    TRY(cpar_linear_init_random(l2, 0.02f));
    cpar_tensor x, dx, m, dm, y, dy;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 3, xs, &x));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 3, xs, &dx));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 3, ms, &m));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 3, ms, &dm));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 3, xs, &y));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 3, xs, &dy));
    TRY(cpar_rng_uniform(ctx, &x, -1.0f, 1.0f));
    TRY(cpar_rng_uniform(ctx, &dy, -1.0f, 1.0f));
    double *t = malloc(sizeof(double) * (size_t)c->iters);
    for (int it = -1; it < c->iters; it++) {
        TRY(cpar_barrier(g));
        if (it == 0) TRY(cpar_group_stats_reset(g));
        double t0 = now_s();
        TRY(cpar_linear_forward(l1, &x, &m, NULL));
        TRY(cpar_linear_forward(l2, &m, &y, NULL));
        TRY(cpar_linear_backward(l2, &dy, &dm));
        TRY(cpar_linear_backward(l1, &dm, &dx));
        TRY(cpar_sync(ctx));
        if (it >= 0) t[it] = now_s() - t0;
    }
    if (cpar_rank(ctx) == 0) {
        qsort(t, (size_t)c->iters, sizeof *t, cmp_double);
        c->seconds = t[c->iters / 2];
        cpar_comm_stats st;
        TRY(cpar_group_stats(g, &st));
        uint64_t recv = 0;
        for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++)
            if (k != CPAR_COLL_BARRIER) recv += st.kind[k].bytes_recv;
        c->recv = recv / (uint64_t)c->iters;
    }
    free(t);
    cpar_tensor *ts[] = {&x, &dx, &m, &dm, &y, &dy};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) TRY(cpar_tensor_free(ctx, ts[i]));
    TRY(cpar_linear_destroy(l1));
    return cpar_linear_destroy(l2);
}

/* A 1-rank linear forward [tokens, k] x [k, n]: cpar's GEMM on the backend. */
typedef struct {
    int iters;
    int64_t tokens, k, n;
    cpar_dtype dt; /* F32 (0), F16 or BF16 */
    double flops;
} gemm_case;

static cpar_status run_gemm(cpar_ctx *ctx, void *arg) {
    gemm_case *c = arg;
    int64_t xs[2] = {c->tokens, c->k}, ys[2] = {c->tokens, c->n};
    cpar_linear_config cfg = {.input_size = c->k, .output_size = c->n, .dtype = c->dt};
    cpar_linear *l;
    TRY(cpar_model_parallel_manual_seed(ctx, 1, 0, 0, 0));
    TRY(cpar_column_parallel_linear_create(cpar_world_group(ctx), &cfg, &l));
    TRY(cpar_linear_init_random(l, 0.02f));
    cpar_tensor x, y;
    TRY(cpar_tensor_alloc(ctx, c->dt, 2, xs, &x));
    TRY(cpar_tensor_alloc(ctx, c->dt, 2, ys, &y));
    TRY(cpar_rng_uniform(ctx, &x, -1.0f, 1.0f));
    double *t = malloc(sizeof(double) * (size_t)c->iters);
    for (int it = -1; it < c->iters; it++) {
        TRY(cpar_sync(ctx));
        double t0 = now_s();
        TRY(cpar_linear_forward(l, &x, &y, NULL));
        TRY(cpar_sync(ctx));
        if (it >= 0) t[it] = now_s() - t0;
    }
    qsort(t, (size_t)c->iters, sizeof *t, cmp_double);
    c->flops = 2.0 * (double)(c->tokens * c->k * c->n) / t[c->iters / 2];
    free(t);
    TRY(cpar_tensor_free(ctx, &x));
    TRY(cpar_tensor_free(ctx, &y));
    return cpar_linear_destroy(l);
}

/* ---- the host GEMM against OpenBLAS ----------------------------------------------
 * Row-major Y[T,N] = X[T,K] W[N,K]^T (the linear layer's forward; attention's
 * q kᵀ and p v have the same form). The ceiling a user would accept is a
 * tuned BLAS: single-threaded OpenBLAS (or BLIS) cblas_sgemm on the same
 * shape in the same run, when make found one; otherwise cpar's built-in
 * kernel, which then is its own ceiling (and says so). cpar is measured
 * through a 1-rank column-parallel linear forward on the host backend, once
 * with its built-in kernel (CPAR_HOST_GEMM=builtin) and, when libcpar was
 * built with a CBLAS, once on that path. */
static double blas_sgemm_flops(int iters, int64_t T, int64_t K, int64_t N, int threads, double *cpu_flops) {
    if (cpu_flops) *cpu_flops = 0.0; /* over the median thread CPU time; 0 without a BLAS */
#ifdef CPAR_BENCH_CBLAS
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(threads); /* 1: a single-threaded ceiling for a single-threaded rank */
#else
    if (threads != 1) return 0.0; /* another CBLAS: its thread count is not ours to set */
#endif
    float *x = malloc(sizeof(float) * (size_t)(T * K)), *w = malloc(sizeof(float) * (size_t)(N * K));
    float *y = malloc(sizeof(float) * (size_t)(T * N));
    for (int64_t i = 0; i < T * K; i++) x[i] = (float)((i * 7919) % 1000) * 1e-3f - 0.5f;
    for (int64_t i = 0; i < N * K; i++) w[i] = (float)((i * 104729) % 1000) * 1e-3f - 0.5f;
    double *t = malloc(sizeof(double) * (size_t)iters), *tc = malloc(sizeof(double) * (size_t)iters);
    for (int it = -1; it < iters; it++) {
        double t0 = now_s(), c0 = cpu_s();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)N, (int)K, 1.f, x, (int)K, w, (int)K, 0.f,
                    y, (int)N);
        if (it >= 0) t[it] = now_s() - t0, tc[it] = cpu_s() - c0;
    }
    qsort(t, (size_t)iters, sizeof *t, cmp_double);
    qsort(tc, (size_t)iters, sizeof *tc, cmp_double);
    double flops = 2.0 * (double)(T * K * N) / t[iters / 2];
    if (cpu_flops) *cpu_flops = 2.0 * (double)(T * K * N) / tc[iters / 2];
    free(x), free(w), free(y), free(t), free(tc);
    return flops;
#else
    (void)iters, (void)T, (void)K, (void)N, (void)threads;
    return 0.0; /* no BLAS to compare with */
#endif
}

/* cpar's host GEMM on the shape (host backend, one rank): its built-in kernel,
 * or the CBLAS path when libcpar has one, with CPAR_HOST_THREADS = threads.
 * 0 when the run failed. */
static double cpar_gemm_flops_threads(int iters, int64_t T, int64_t K, int64_t N, cpar_dtype dt, bool builtin,
                                      int threads) {
    gemm_case c = {.iters = iters, .tokens = T, .k = K, .n = N, .dt = dt};
    char tv[16];
    snprintf(tv, sizeof tv, "%d", threads);
    setenv("CPAR_HOST_GEMM", builtin ? "builtin" : "default", 1); /* read when the context is made */
    setenv("CPAR_HOST_THREADS", tv, 1);
    cpar_status st = cpar_spawn(1, CPAR_BACKEND_HOST, run_gemm, &c);
    unsetenv("CPAR_HOST_GEMM");
    unsetenv("CPAR_HOST_THREADS");
    if (st != CPAR_OK) fprintf(stderr, "bench: host GEMM: %s\n", cpar_thread_last_error());
    return st == CPAR_OK ? c.flops : 0.0;
}

static double cpar_gemm_flops(int iters, int64_t T, int64_t K, int64_t N, cpar_dtype dt, bool builtin) {
    return cpar_gemm_flops_threads(iters, T, K, N, dt, builtin, 1);
}

typedef struct {
    const char *what;
    int64_t T, K, N;
} gemm_shape;

/* The GEMM table: every shape against its ceiling, built-in and CBLAS paths. */
static void bench_host_gemm(int iters) {
    static const gemm_shape shapes[] = {
        {"linear, large", 256, 1024, 4096},
        {"linear, small", 256, 128, 512},
        {"square", 1024, 1024, 1024},
        {"attention q k^T", 1024, 64, 1024},
        {"attention p v", 1024, 1024, 64},
    };
#ifdef CPAR_BENCH_CBLAS
    const char *ceiling = "OpenBLAS/BLIS cblas_sgemm, 1 thread";
#else
    const char *ceiling = "cpar's built-in kernel (no CBLAS installed)";
#endif
#ifdef CPAR_WITH_CBLAS
    const bool cblas = true;
#else
    const bool cblas = false;
#endif
    printf("\nhost GEMM, row-major [T,K] x [N,K]^T, 1 rank; ceiling: %s in this run\n", ceiling);
    printf("%-18s %18s %12s %12s %7s %12s %7s %12s %7s\n", "shape", "T x K x N", "ceiling", "built-in", "/ceil",
           "CBLAS path", "/ceil", "built-in bf16", "/ceil");
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const gemm_shape *g = &shapes[i];
        double mine = cpar_gemm_flops(iters, g->T, g->K, g->N, CPAR_F32, true);
        double blas = blas_sgemm_flops(iters, g->T, g->K, g->N, 1, NULL);
        double ceil = blas > 0 ? blas : mine;
        double via = cblas ? cpar_gemm_flops(iters, g->T, g->K, g->N, CPAR_F32, false) : 0.0;
        double half = cpar_gemm_flops(iters, g->T, g->K, g->N, CPAR_BF16, true);
        char shape[40], viab[16] = "-", viar[16] = "-";
        snprintf(shape, sizeof shape, "%lldx%lldx%lld", (long long)g->T, (long long)g->K, (long long)g->N);
        if (cblas) {
            snprintf(viab, sizeof viab, "%.1f GF/s", via / 1e9);
            snprintf(viar, sizeof viar, "%.2f", via / ceil);
        }
        printf("%-18s %18s %7.1f GF/s %7.1f GF/s %7.2f %12s %7s %7.1f GF/s %7.2f\n", g->what, shape, ceil / 1e9,
               mine / 1e9, mine / ceil, viab, viar, half / 1e9, half / ceil);
        rec_begin("host_gemm");
        rec_s("name", g->what);
        rec_i("T", g->T), rec_i("K", g->K), rec_i("N", g->N);
        rec_f("ceiling_gflops", ceil / 1e9), rec_f("builtin_gflops", mine / 1e9), rec_f("builtin_per_ceiling", mine / ceil);
        if (cblas) rec_f("cblas_path_gflops", via / 1e9), rec_f("cblas_path_per_ceiling", via / ceil);
        rec_f("builtin_bf16_gflops", half / 1e9), rec_f("builtin_bf16_per_ceiling", half / ceil);
    }
    /* CPAR_HOST_THREADS: one rank's product on 2 threads against 1, and
     * against OpenBLAS on 2 threads (run on a quiet machine: every thread
     * wants a core of its own) */
    printf("\nhost GEMM with CPAR_HOST_THREADS=2 (built-in kernel, f32), 1 rank\n");
    printf("%-18s %18s %12s %12s %7s %12s %12s %7s\n", "shape", "T x K x N", "1 thread", "2 threads", "2/1",
           "OpenBLAS 1", "OpenBLAS 2", "2/OB2");
    for (size_t i = 0; i < 2; i++) {
        const gemm_shape *g = &shapes[i];
        double one = cpar_gemm_flops_threads(iters, g->T, g->K, g->N, CPAR_F32, true, 1);
        double two = cpar_gemm_flops_threads(iters, g->T, g->K, g->N, CPAR_F32, true, 2);
        double ob1 = blas_sgemm_flops(iters, g->T, g->K, g->N, 1, NULL), ob2 = blas_sgemm_flops(iters, g->T, g->K, g->N, 2, NULL);
        char shape[40], b1[16] = "-", b2[16] = "-", r2[16] = "-";
        snprintf(shape, sizeof shape, "%lldx%lldx%lld", (long long)g->T, (long long)g->K, (long long)g->N);
        if (ob1 > 0) snprintf(b1, sizeof b1, "%.1f GF/s", ob1 / 1e9);
        if (ob2 > 0) snprintf(b2, sizeof b2, "%.1f GF/s", ob2 / 1e9), snprintf(r2, sizeof r2, "%.2f", two / ob2);
        printf("%-18s %18s %7.1f GF/s %7.1f GF/s %7.2f %12s %12s %7s\n", g->what, shape, one / 1e9, two / 1e9,
               one > 0 ? two / one : 0.0, b1, b2, r2);
        rec_begin("host_gemm_threads");
        rec_s("name", g->what);
        rec_i("T", g->T), rec_i("K", g->K), rec_i("N", g->N);
        rec_f("builtin_1_thread_gflops", one / 1e9), rec_f("builtin_2_threads_gflops", two / 1e9);
        if (ob1 > 0) rec_f("openblas_1_thread_gflops", ob1 / 1e9);
        if (ob2 > 0) rec_f("openblas_2_threads_gflops", ob2 / 1e9), rec_f("builtin_2_per_openblas_2", two / ob2);
    }
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(1); /* back to the single-threaded ceiling */
#endif
}

/* The f32 GEMM ceiling of one shape: OpenBLAS when installed, else cpar's
 * own; *cpu_flops (may be NULL) as blas_sgemm_flops. */
static double gemm_ceiling(int iters, int64_t T, int64_t K, int64_t N, double *cpu_flops) {
    double blas = blas_sgemm_flops(iters, T, K, N, 1, cpu_flops);
    return blas > 0 ? blas : cpar_gemm_flops(iters, T, K, N, CPAR_F32, true);
}

/* What rank 0 must receive at least for one MLP forward + backward: without
 * SP two all-reduces of the [s, b, h] activation (row forward, column dgrad);
 * with SP five (n-1)/n shares of it (gather x, reduce-scatter y, gather dy,
 * re-gather x, reduce-scatter dx). */
static uint64_t mlp_min_recv(int n, bool sp, int64_t elems) {
    if (n == 1) return 0;
    uint64_t bytes = (uint64_t)elems * sizeof(float), share = bytes / (uint64_t)n;
    if (sp) return 5 * (bytes - share);
    int64_t lo = 0, hi = (elems + n - 1) / n; /* rank 0's even share of the elements */
    uint64_t mine = (uint64_t)(hi - lo) * sizeof(float);
    return 2 * ((bytes - mine) + (uint64_t)(n - 1) * mine);
}

/* ---- attention ---------------------------------------------------------------
 * Local attention forward and backward on one rank, then ring attention per
 * cp size. FLOPs as FlashAttention counts them: forward 4·b·h·sq·sk·d (two
 * GEMMs), halved when causal; backward 2.5x the forward (five GEMMs, one of
 * them the recomputed q kᵀ). Ceiling: a GEMM of the same dtype measured in this run. Host
 * backend: fp32 host reference; GPUs: bf16 flash kernels. The host's local
 * rows also give f+b over thread CPU times (attention's and the ceiling's,
 * "cpu f+b"): on a loaded machine the wall clock of the ceiling's long GEMM
 * loses more to other processes than a short attention call does. */
typedef struct {
    int iters;
    bool causal, load_balance;
    cpar_cp_comm_type comm;
    int a2a_size;
    int64_t b, h, s, d; /* s: the global sequence */
    cpar_dtype dt;
    double fwd, bwd, fwd_cpu, bwd_cpu; /* medians: wall clock, rank 0's thread CPU time */
    uint64_t recv_fwd, recv_bwd;
} attn_case;

static cpar_status run_attn(cpar_ctx *ctx, void *arg) {
    attn_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g);
    int64_t qs[4] = {c->b, c->h, c->s / n, c->d}, ls[3] = {c->b, c->h, c->s / n};
    cpar_tensor q, k, v, o, lse, dout, dq, dk, dv;
    cpar_tensor *ts[] = {&q, &k, &v, &o, &dout, &dq, &dk, &dv};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) TRY(cpar_tensor_alloc(ctx, c->dt, 4, qs, ts[i]));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 3, ls, &lse));
    TRY(cpar_model_parallel_manual_seed(ctx, 99, 0, 0, 0));
    cpar_tensor *ins[] = {&q, &k, &v, &dout};
    for (size_t i = 0; i < 4; i++) TRY(cpar_rng_uniform(ctx, ins[i], -1.0f, 1.0f));
    cpar_ring_attention_config cfg = {.causal = c->causal, .load_balance = c->load_balance, .comm_type = c->comm,
                                      .a2a_size = c->a2a_size};
    double *tf = malloc(sizeof(double) * (size_t)c->iters), *tb = malloc(sizeof(double) * (size_t)c->iters);
    double *cf = malloc(sizeof(double) * (size_t)c->iters), *cb = malloc(sizeof(double) * (size_t)c->iters);
    cpar_comm_stats after_fwd = {0};
    for (int it = -1; it < c->iters; it++) {
        TRY(cpar_barrier(g));
        if (it == 0) TRY(cpar_group_stats_reset(g));
        double t0 = now_s(), c0 = cpu_s();
        if (n == 1) TRY(cpar_attention_forward(ctx, &q, &k, &v, c->causal, 0.0f, &o, &lse));
        else TRY(cpar_ring_attention_forward(g, &cfg, &q, &k, &v, &o, &lse));
        TRY(cpar_sync(ctx));
        double t1 = now_s(), c1 = cpu_s();
        if (it == 0) TRY(cpar_group_stats(g, &after_fwd));
        if (n == 1) TRY(cpar_attention_backward(ctx, &q, &k, &v, &o, &dout, &lse, c->causal, 0.0f, &dq, &dk, &dv));
        else TRY(cpar_ring_attention_backward(g, &cfg, &q, &k, &v, &o, &dout, &lse, &dq, &dk, &dv));
        TRY(cpar_sync(ctx));
        if (it >= 0) {
            tf[it] = t1 - t0, cf[it] = c1 - c0;
            tb[it] = now_s() - t1, cb[it] = cpu_s() - c1;
        }
        if (it == 0 && cpar_rank(ctx) == 0) {
            cpar_comm_stats st;
            TRY(cpar_group_stats(g, &st));
            c->recv_fwd = c->recv_bwd = 0;
            for (int kind = 0; kind < CPAR_COLL_KIND_COUNT; kind++) {
                c->recv_fwd += after_fwd.kind[kind].bytes_recv;
                c->recv_bwd += st.kind[kind].bytes_recv - after_fwd.kind[kind].bytes_recv;
            }
        }
    }
    if (cpar_rank(ctx) == 0) {
        qsort(tf, (size_t)c->iters, sizeof *tf, cmp_double);
        qsort(tb, (size_t)c->iters, sizeof *tb, cmp_double);
        qsort(cf, (size_t)c->iters, sizeof *cf, cmp_double);
        qsort(cb, (size_t)c->iters, sizeof *cb, cmp_double);
        c->fwd = tf[c->iters / 2];
        c->bwd = tb[c->iters / 2];
        c->fwd_cpu = cf[c->iters / 2];
        c->bwd_cpu = cb[c->iters / 2];
    }
    free(tf);
    free(tb);
    free(cf);
    free(cb);
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) TRY(cpar_tensor_free(ctx, ts[i]));
    return cpar_tensor_free(ctx, &lse);
}

/* ---- Mamba all-to-all context parallelism ----------------------------------------
 * pre_conv_ssm and post_conv_ssm of one Mamba-2 mixer, forward then
 * backward, on the backend's float type. The bytes rank 0 must receive are
 * (n-1)/n of the tensor on the "whole sequence" side of each call (pre: out,
 * post: in); the forward and the backward each move that once. */
typedef struct {
    int iters;
    int64_t s, b, d_inner, nheads, ngroups, d_state;
    cpar_dtype dt;
    double pre_f, pre_b, post_f, post_b;
    uint64_t recv_pre, recv_post, bytes_pre, bytes_post; /* per call; bytes: the whole-sequence tensor */
} mamba_case;

static double median_of(double *t, int n) {
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    return t[n / 2];
}

static uint64_t recv_total(cpar_group *g) {
    cpar_comm_stats st;
    if (cpar_group_stats(g, &st) != CPAR_OK) return 0;
    uint64_t r = 0;
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++)
        if (k != CPAR_COLL_BARRIER) r += st.kind[k].bytes_recv;
    return r;
}

static cpar_status run_mamba(cpar_ctx *ctx, void *arg) {
    mamba_case *c = arg;
    cpar_group *g = cpar_world_group(ctx);
    int n = cpar_group_size(g);
    cpar_mamba_cp_config cfg = {.d_inner_local_tp = c->d_inner, .nheads_local_tp = c->nheads,
                                .ngroups_local_tp = c->ngroups, .d_state = c->d_state};
    cpar_mamba_cp *m;
    cpar_mamba_cp_info info;
    TRY(cpar_mamba_cp_create(g, &cfg, &m));
    TRY(cpar_mamba_cp_get_info(m, &info));
    int64_t in_s[3] = {c->s / n, c->b, info.in_width}, out_s[3] = {c->s, c->b, info.out_width};
    int64_t y_s[3] = {c->s, c->b, info.d_inner_local_tpcp}, z_s[3] = {c->s / n, c->b, c->d_inner};
    cpar_tensor in, out, din, dout, y, z, dy, dz;
    cpar_tensor *ts[] = {&in, &out, &din, &dout, &y, &z, &dy, &dz};
    const int64_t *shapes[] = {in_s, out_s, in_s, out_s, y_s, z_s, y_s, z_s};
    for (int i = 0; i < 8; i++) TRY(cpar_tensor_alloc(ctx, c->dt, 3, shapes[i], ts[i]));
    TRY(cpar_model_parallel_manual_seed(ctx, 7, 0, 0, 0));
    TRY(cpar_rng_uniform(ctx, &in, -1.0f, 1.0f));
    TRY(cpar_rng_uniform(ctx, &dout, -1.0f, 1.0f));
    TRY(cpar_rng_uniform(ctx, &y, -1.0f, 1.0f));
    TRY(cpar_rng_uniform(ctx, &dz, -1.0f, 1.0f));
    double *t[4];
    for (int i = 0; i < 4; i++) t[i] = malloc(sizeof(double) * (size_t)c->iters);
    uint64_t recv_pre = 0, recv_post = 0;
    for (int it = -1; it < c->iters; it++) {
        double t0, t1;
        /* pre_conv_ssm forward + backward */
        TRY(cpar_barrier(g));
        TRY(cpar_group_stats_reset(g));
        t0 = now_s();
        TRY(cpar_mamba_cp_pre_conv_ssm(m, &in, &out, CPAR_FWD));
        TRY(cpar_sync(ctx));
        t1 = now_s();
        TRY(cpar_mamba_cp_pre_conv_ssm(m, &dout, &din, CPAR_BWD));
        TRY(cpar_sync(ctx));
        if (it >= 0) t[0][it] = t1 - t0, t[1][it] = now_s() - t1;
        recv_pre = recv_total(g);
        /* post_conv_ssm forward + backward */
        TRY(cpar_barrier(g));
        TRY(cpar_group_stats_reset(g));
        t0 = now_s();
        TRY(cpar_mamba_cp_post_conv_ssm(m, &y, &z, CPAR_FWD));
        TRY(cpar_sync(ctx));
        t1 = now_s();
        TRY(cpar_mamba_cp_post_conv_ssm(m, &dz, &dy, CPAR_BWD));
        TRY(cpar_sync(ctx));
        if (it >= 0) t[2][it] = t1 - t0, t[3][it] = now_s() - t1;
        recv_post = recv_total(g);
    }
    if (cpar_rank(ctx) == 0) {
        c->pre_f = median_of(t[0], c->iters), c->pre_b = median_of(t[1], c->iters);
        c->post_f = median_of(t[2], c->iters), c->post_b = median_of(t[3], c->iters);
        c->recv_pre = recv_pre / 2, c->recv_post = recv_post / 2; /* forward and backward move the same */
        c->bytes_pre = cpar_tensor_nbytes(&out), c->bytes_post = cpar_tensor_nbytes(&y);
    }
    for (int i = 0; i < 4; i++) free(t[i]);
    for (int i = 0; i < 8; i++) TRY(cpar_tensor_free(ctx, ts[i]));
    return cpar_mamba_cp_destroy(m);
}

/* ---- memory-bound kernels on host tensors ------------------------------------
 * The host backend's element-wise and row kernels on one rank (cp2hp/hp2cp
 * and pre_conv_ssm on two, so the packing around their all-to-all runs).
 * Each row: the median time per call, the bytes the kernel must move (every
 * input read once, every output written once; data that stays in cache, such
 * as the RMSNorm weight, not counted) and that rate against the single-thread
 * host memcpy ceiling counted the same way (a copy of N bytes moves 2N). The
 * machine's memory bandwidth drifts (other jobs share it), so every
 * iteration also times a memcpy of CPAR_BENCH_MAX_MIB on rank 0 right
 * before the kernel, and a row's ratio uses the median of those. Cross
 * entropy and GeLU also against a glibc loop over as many elements (expf;
 * tanhf), timed here: one transcendental per element may bound them below
 * memcpy. /cached: the same call on the first 16 rows of every operand,
 * cache-resident, over the full call, per element: the kernel's compute
 * rate as a ceiling. Near 1, the row runs at its exp/tanh-bound speed and
 * memory is not what holds it below /memcpy 0.5. */
enum { MB_FILL, MB_CAST, MB_AXPBY, MB_GELU, MB_NORM, MB_XENT, MB_LB_UNDO, MB_LB_REDO, MB_CP2HP, MB_PRE_SSM };

typedef struct {
    int kind, ranks;
    cpar_dtype dt, dt2; /* cast: dt -> dt2 */
    float beta;         /* axpby */
    int64_t rows, cols; /* the [rows, cols] operand of rank 0; 0: the default */
    const char *name;
} mb_row;

typedef struct {
    int iters;
    const mb_row *row;
    int64_t rows, cols;  /* the row's, or the defaults */
    size_t copy_bytes;   /* the ceiling's memcpy */
    int nt;              /* timed phases: 1, or 2 (forward, backward) */
    double t[2];         /* median seconds per call */
    double bytes[2];     /* bytes one call must move on rank 0 */
    double copy_gbps;    /* the interleaved memcpy, GB/s copied (median) */
    double libm_s;       /* xent, gelu: the glibc loop over rows * cols elements */
    double cached_s[2];  /* xent, gelu: seconds per element from cache (mb_cached) */
} mb_case;

/* A glibc expf (tanh: tanhf) over x[0..n), four independent sums so the adds never bound it; median of 5. */
static double mb_libm_loop(const float *x, int64_t n, bool tanh_) {
    double t[5];
    for (int r = 0; r < 5; r++) {
        double t0 = now_s();
        float s[4] = {0.f, 0.f, 0.f, 0.f};
        for (int64_t i = 0; i + 4 <= n; i += 4)
            for (int k = 0; k < 4; k++) s[k] += tanh_ ? tanhf(x[i + k]) : expf(x[i + k]);
        volatile float sink = s[0] + s[1] + s[2] + s[3];
        (void)sink;
        t[r] = now_s() - t0;
    }
    return median_of(t, 5);
}

/* t[*nt] = a new tensor, *out = its address. */
static cpar_status mb_alloc(cpar_ctx *ctx, cpar_tensor *t, int *nt, cpar_dtype dt, int nd, const int64_t *sh,
                            cpar_tensor **out) {
    TRY(cpar_tensor_alloc(ctx, dt, nd, sh, &t[*nt]));
    *out = &t[(*nt)++];
    return CPAR_OK;
}

/* One call of row w's operation, phase ph (0 forward, 1 backward). */
static cpar_status mb_call(cpar_ctx *ctx, const mb_row *w, int ph, cpar_tensor *a, cpar_tensor *b, cpar_tensor *d,
                           cpar_tensor *e, cpar_tensor *f, cpar_tensor *h, cpar_mamba_cp *m) {
    cpar_group *g = cpar_world_group(ctx);
    switch (w->kind) {
    case MB_FILL: return cpar_fill(ctx, a, 0.5);
    case MB_CAST: return cpar_cast(ctx, a, b);
    case MB_AXPBY: return cpar_axpby(ctx, 1.5f, a, w->beta, b);
    case MB_GELU: return ph ? cpar_gelu_backward(ctx, a, b, d) : cpar_gelu_forward(ctx, a, b);
    case MB_NORM: return ph ? cpar_rmsnorm_backward(ctx, a, f, 1e-5f, b, d, e) : cpar_rmsnorm_forward(ctx, a, f, 1e-5f, b);
    case MB_XENT:
        return ph ? cpar_vocab_parallel_cross_entropy_backward(g, a, b, 0.0f, e, f, h)
                  : cpar_vocab_parallel_cross_entropy_forward(g, a, b, 0.0f, d, e);
    case MB_LB_UNDO: return cpar_undo_attention_load_balancing(ctx, 2, a, b);
    case MB_LB_REDO: return cpar_redo_attention_load_balancing(ctx, 2, a, b);
    case MB_CP2HP: return cpar_all_to_all_cp2hp(g, ph ? b : a, ph ? d : b, ph ? CPAR_BWD : CPAR_FWD);
    default: return cpar_mamba_cp_pre_conv_ssm(m, ph ? b : a, ph ? d : b, ph ? CPAR_BWD : CPAR_FWD);
    }
}

/* The seconds per element of phase ph on the first MB_CACHED_ROWS rows of
 * every operand (views, cache-resident after the first call): the kernel's
 * own compute rate, memory out of the way. Median of 15 calls. */
enum { MB_CACHED_ROWS = 16 };
static cpar_status mb_cached(cpar_ctx *ctx, const mb_row *w, int ph, int64_t rows, int64_t cols, cpar_tensor *t, int nt,
                             double *out) {
    cpar_tensor v[10];
    cpar_tensor *p[10] = {NULL};
    for (int i = 0; i < nt; i++) {
        v[i] = t[i];
        if (v[i].ndim >= 1 && v[i].shape[0] == rows) v[i].shape[0] = MB_CACHED_ROWS;
        p[i] = &v[i];
    }
    /* t[0], t[1] are the memcpy buffers; then a and the row's own, as run_mb allocates them */
    cpar_tensor *a = p[2], *b = p[3], *d = p[4], *e = p[5], *f = p[6], *h = p[7];
    if (w->kind == MB_GELU) e = f = h = NULL;
    double ts[15];
    for (int r = -1; r < 15; r++) {
        double t0 = now_s();
        TRY(mb_call(ctx, w, ph, a, b, d, e, f, h, NULL));
        if (r >= 0) ts[r] = now_s() - t0;
    }
    *out = median_of(ts, 15) / (double)(MB_CACHED_ROWS * cols);
    return CPAR_OK;
}

static cpar_status run_mb(cpar_ctx *ctx, void *arg) {
    mb_case *c = arg;
    const mb_row *w = c->row;
    cpar_group *g = cpar_world_group(ctx);
    int p = cpar_group_size(g);
    bool r0 = cpar_rank(ctx) == 0;
    int64_t rows = c->rows, cols = c->cols, n = rows * cols, shape[2] = {rows, cols}, wshape[1] = {cols};
    int64_t cshape[1] = {(int64_t)(c->copy_bytes / sizeof(float))};
    double es = (double)cpar_dtype_size(w->dt), nb = (double)n * es;
    cpar_tensor t[10];
    int nt = 0;
    TRY(cpar_model_parallel_manual_seed(ctx, 5, cpar_group_rank(g), 0, 0));
#define MB_ALLOC(p_, dt, nd, sh) TRY(mb_alloc(ctx, t, &nt, (dt), (nd), (sh), &(p_)))
    cpar_tensor *a = NULL, *b = NULL, *d = NULL, *e = NULL, *f = NULL, *h = NULL, *ca = NULL, *cb = NULL;
    MB_ALLOC(ca, CPAR_F32, 1, cshape); /* the ceiling's memcpy */
    MB_ALLOC(cb, CPAR_F32, 1, cshape);
    TRY(cpar_fill(ctx, ca, 1.0));
    TRY(cpar_fill(ctx, cb, 2.0));
    if (w->kind != MB_PRE_SSM) {
        MB_ALLOC(a, w->dt, 2, shape);
        TRY(cpar_rng_uniform(ctx, a, -4.0f, 4.0f));
    }
    cpar_mamba_cp *m = NULL;
    c->nt = 1;
    switch (w->kind) {
    case MB_FILL: c->bytes[0] = nb; break;
    case MB_CAST:
        MB_ALLOC(b, w->dt2, 2, shape);
        c->bytes[0] = nb + (double)n * (double)cpar_dtype_size(w->dt2);
        break;
    case MB_AXPBY:
        MB_ALLOC(b, w->dt, 2, shape);
        TRY(cpar_rng_uniform(ctx, b, -1.0f, 1.0f));
        c->bytes[0] = (w->beta != 0.0f ? 3 : 2) * nb;
        break;
    case MB_GELU: /* forward x -> b; backward (x, dy = b) -> d */
        MB_ALLOC(b, w->dt, 2, shape);
        MB_ALLOC(d, w->dt, 2, shape);
        c->nt = 2, c->bytes[0] = 2 * nb, c->bytes[1] = 3 * nb;
        break;
    case MB_NORM: /* forward x -> b; backward (x, dy = b) -> d, dweight e */
        MB_ALLOC(b, w->dt, 2, shape);
        MB_ALLOC(d, w->dt, 2, shape);
        MB_ALLOC(f, w->dt, 1, wshape);
        MB_ALLOC(e, CPAR_F32, 1, wshape);
        TRY(cpar_rng_uniform(ctx, f, 0.5f, 1.5f));
        TRY(cpar_fill(ctx, e, 0.0));
        c->nt = 2, c->bytes[0] = 2 * nb, c->bytes[1] = 3 * nb;
        break;
    case MB_XENT: { /* logits a; target b, loss d, stats e, dloss f; dlogits h */
        int64_t sshape[2] = {rows, 2};
        MB_ALLOC(b, CPAR_I64, 1, &rows);
        MB_ALLOC(d, CPAR_F32, 1, &rows);
        MB_ALLOC(e, CPAR_F32, 2, sshape);
        MB_ALLOC(f, CPAR_F32, 1, &rows);
        MB_ALLOC(h, w->dt, 2, shape);
        TRY(cpar_fill(ctx, b, 7.0));
        TRY(cpar_fill(ctx, f, 1.0));
        c->nt = 2, c->bytes[0] = nb, c->bytes[1] = 2 * nb;
        break;
    }
    case MB_LB_UNDO:
    case MB_LB_REDO:
        MB_ALLOC(b, w->dt, 2, shape);
        c->bytes[0] = 2 * nb;
        break;
    case MB_CP2HP: { /* a viewed as in [rows, 1, cols] -> out [p rows, 1, cols/p]; backward back into d */
        int64_t is[3] = {rows, 1, cols}, os[3] = {p * rows, 1, cols / p};
        MB_ALLOC(b, w->dt, 3, os);
        MB_ALLOC(d, w->dt, 3, is);
        a->ndim = 3, a->shape[0] = rows, a->shape[1] = 1, a->shape[2] = cols;
        /* pack (read in, write scratch), all-to-all (read scratch, write out); backward mirrored */
        c->nt = 2, c->bytes[0] = c->bytes[1] = 4 * nb;
        break;
    }
    case MB_PRE_SSM: { /* rows = s, cols = d_inner; nheads d_inner/64, 2 groups, d_state 128 */
        cpar_mamba_cp_config cfg = {.d_inner_local_tp = cols, .nheads_local_tp = cols / 64, .ngroups_local_tp = 2,
                                    .d_state = 128};
        cpar_mamba_cp_info info;
        TRY(cpar_mamba_cp_create(g, &cfg, &m));
        TRY(cpar_mamba_cp_get_info(m, &info));
        int64_t is[3] = {rows / p, 1, info.in_width}, os[3] = {rows, 1, info.out_width};
        MB_ALLOC(a, w->dt, 3, is);
        MB_ALLOC(b, w->dt, 3, os);
        MB_ALLOC(d, w->dt, 3, is);
        TRY(cpar_rng_uniform(ctx, a, -1.0f, 1.0f));
        double in_b = (double)cpar_tensor_nbytes(a), out_b = (double)cpar_tensor_nbytes(b);
        /* pack (in once, out's bytes written), all-to-all, undo the load balancing: 2 in + 4 out */
        c->nt = 2, c->bytes[0] = c->bytes[1] = 2 * in_b + 4 * out_b;
        break;
    }
    }
#undef MB_ALLOC
    if (r0 && (w->kind == MB_XENT || w->kind == MB_GELU)) {
        cpar_tensor xf; /* the libm loop's input: as the kernel's, in fp32 */
        TRY(cpar_tensor_alloc(ctx, CPAR_F32, 2, shape, &xf));
        TRY(cpar_rng_uniform(ctx, &xf, -4.0f, 4.0f));
        c->libm_s = mb_libm_loop(xf.data, n, w->kind == MB_GELU);
        TRY(cpar_tensor_free(ctx, &xf));
    }
    double *ts[3];
    for (int i = 0; i < 3; i++) ts[i] = malloc(sizeof(double) * (size_t)c->iters);
    for (int it = -1; it < c->iters; it++) { /* iteration -1 warms up (workspace, page faults) */
        if (p > 1) TRY(cpar_barrier(g));
        if (r0) {
            double t0 = now_s();
            TRY(cpar_tensor_copy(ctx, ca, cb));
            if (it >= 0) ts[2][it] = now_s() - t0;
        }
        for (int ph = 0; ph < c->nt; ph++) {
            if (p > 1) TRY(cpar_barrier(g));
            double t0 = now_s();
            TRY(mb_call(ctx, w, ph, a, b, d, e, f, h, m));
            TRY(cpar_sync(ctx));
            if (it >= 0) ts[ph][it] = now_s() - t0;
        }
    }
    for (int ph = 0; ph < c->nt; ph++) c->t[ph] = median_of(ts[ph], c->iters);
    if (r0 && p == 1 && (w->kind == MB_XENT || w->kind == MB_GELU))
        for (int ph = 0; ph < c->nt; ph++) TRY(mb_cached(ctx, w, ph, rows, cols, t, nt, &c->cached_s[ph]));
    if (r0) c->copy_gbps = (double)c->copy_bytes / median_of(ts[2], c->iters) / 1e9;
    for (int i = 0; i < 3; i++) free(ts[i]);
    if (m) TRY(cpar_mamba_cp_destroy(m));
    for (int i = 0; i < nt; i++) TRY(cpar_tensor_free(ctx, &t[i]));
    return CPAR_OK;
}

/* The rows, then one table. */
static int bench_memory_bound(int iters, int max_mib) {
    const int64_t R = 1024, H = (int64_t)max_mib * 256; /* [R, H] fp32 = max_mib MiB */
    static const mb_row rows[] = {
        {MB_FILL, 1, CPAR_F32, 0, 0, 0, 0, "fill"},
        {MB_FILL, 1, CPAR_BF16, 0, 0, 0, 0, "fill"},
        {MB_CAST, 1, CPAR_F32, CPAR_BF16, 0, 0, 0, "cast"},
        {MB_CAST, 1, CPAR_BF16, CPAR_F32, 0, 0, 0, "cast"},
        {MB_CAST, 1, CPAR_F32, CPAR_F16, 0, 0, 0, "cast"},
        {MB_CAST, 1, CPAR_F16, CPAR_F32, 0, 0, 0, "cast"},
        {MB_AXPBY, 1, CPAR_F32, 0, -0.5f, 0, 0, "axpby beta != 0"},
        {MB_AXPBY, 1, CPAR_F32, 0, 0.0f, 0, 0, "axpby beta = 0"},
        {MB_AXPBY, 1, CPAR_BF16, 0, -0.5f, 0, 0, "axpby beta != 0"},
        {MB_GELU, 1, CPAR_F32, 0, 0, 0, 0, "gelu"},
        {MB_GELU, 1, CPAR_BF16, 0, 0, 0, 0, "gelu"},
        {MB_NORM, 1, CPAR_F32, 0, 0, 0, 0, "rmsnorm"},
        {MB_NORM, 1, CPAR_BF16, 0, 0, 0, 0, "rmsnorm"},
        {MB_XENT, 1, CPAR_F32, 0, 0, 1024, 8192, "vocab_parallel_xent"},
        {MB_XENT, 1, CPAR_BF16, 0, 0, 1024, 8192, "vocab_parallel_xent"},
        {MB_LB_UNDO, 1, CPAR_F32, 0, 0, 0, 0, "undo_load_balancing cp=2"},
        {MB_LB_REDO, 1, CPAR_F32, 0, 0, 0, 0, "redo_load_balancing cp=2"},
        {MB_CP2HP, 2, CPAR_F32, 0, 0, 0, 0, "cp2hp / hp2cp"},
        {MB_PRE_SSM, 2, CPAR_F32, 0, 0, 4096, 1024, "mamba pre_conv_ssm"},
    };
    printf("\nmemory-bound kernels on host tensors; ceiling: a host memcpy of %d MiB timed before every call "
           "(GB/s copied; it moves twice that)\n",
           max_mib);
    printf("%-26s %5s %-10s %12s %5s %10s %12s %10s %10s %8s %6s %7s\n", "kernel", "ranks", "dtype", "[rows,cols]", "dir",
           "time", "bytes moved", "GB/s", "memcpy", "/memcpy", "/libm", "/cached");
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        const mb_row *w = &rows[i];
        const char *pick = getenv("CPAR_BENCH_MB"); /* rows whose name contains it (unset: all) */
        if (pick && *pick && !strstr(w->name, pick)) continue;
        mb_case c = {.iters = iters, .row = w, .rows = w->rows ? w->rows : R, .cols = w->rows ? w->cols : H,
                     .copy_bytes = (size_t)max_mib << 20};
        if (cpar_spawn(w->ranks, CPAR_BACKEND_HOST, run_mb, &c) != CPAR_OK) {
            fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
            return 1;
        }
        char dts[24];
        if (w->kind == MB_CAST) snprintf(dts, sizeof dts, "%s->%s", cpar_dtype_name(w->dt), cpar_dtype_name(w->dt2));
        else snprintf(dts, sizeof dts, "%s", cpar_dtype_name(w->dt));
        for (int ph = 0; ph < c.nt; ph++) {
            double gbs = c.bytes[ph] / c.t[ph] / 1e9;
            char lm[16] = "", cs[16] = "";
            const double cached = c.cached_s[ph] * (double)(c.rows * c.cols) / c.t[ph];
            if (c.libm_s > 0) snprintf(lm, sizeof lm, "%6.2f", c.libm_s / c.t[ph]);
            if (c.cached_s[ph] > 0) snprintf(cs, sizeof cs, "%7.2f", cached);
            printf("%-26s %5d %-10s %5lldx%-6lld %5s %7.3f ms %12.0f %5.2f GB/s %5.2f GB/s %8.2f %6s %7s\n", w->name,
                   w->ranks, dts, (long long)c.rows, (long long)c.cols, c.nt == 1 ? "" : ph ? "bwd" : "fwd",
                   c.t[ph] * 1e3, c.bytes[ph], gbs, c.copy_gbps, gbs / (2 * c.copy_gbps), lm, cs);
            rec_begin("memory_bound");
            rec_s("name", w->name), rec_i("ranks", w->ranks), rec_s("dtype", dts);
            rec_i("rows", c.rows), rec_i("cols", c.cols), rec_s("dir", c.nt == 1 ? "" : ph ? "bwd" : "fwd");
            rec_f("time_ms", c.t[ph] * 1e3), rec_f("bytes", c.bytes[ph]), rec_f("gbps", gbs);
            rec_f("copy_gbps", c.copy_gbps), rec_f("per_ceiling", gbs / (2 * c.copy_gbps));
            if (c.libm_s > 0) rec_f("speedup_vs_libm", c.libm_s / c.t[ph]);
            if (c.cached_s[ph] > 0) rec_f("per_cached", cached);
        }
    }
    return 0;
}

static const char usage[] =
    "usage: bench [-b SIZE -e SIZE -f FACTOR] [-n ITERS] [--csv FILE] [--json FILE]\n"
    "  -b, -e, -f   sweep the collectives from -b to -e bytes, multiplying by -f (nccl-tests'\n"
    "               flags; sizes take K, M, G); default: 1, 4 and 16 MiB (up to CPAR_BENCH_MAX_MIB)\n"
    "  -n ITERS     timed iterations per case (default CPAR_BENCH_ITERS or 10)\n"
    "  --csv FILE   every row of every table as CSV: a section column, then every column\n"
    "               (units in the names: time_ms, busbw_gbps, ...), empty where a section has none;\n"
    "               the first row (section meta): version, commit, date, host, cpu, cpus; and beside\n"
    "               it one table per section with its own columns, FILE-SECTION.csv (FILE-meta.csv, ...)\n"
    "  --json FILE  the same rows as a JSON array of objects\n"
    "CPAR_BENCH_ONLY=coll,procs,map,xent,gemm,mlp,attn,mamba,mb picks sections; CPAR_BENCH_MB=NAME the\n"
    "mb rows whose kernel name contains NAME.\n";

static int run_benches(int iters, int max_mib, size_t sweep_b, size_t sweep_e, size_t sweep_f);

/* What a figure was measured on, as the first row (section "meta") of the
 * CSV and JSON and one line on stdout: cpar's version, the git commit of the
 * working directory (when it is a repository), the date (UTC), the host,
 * its CPU model and count. */
static void rec_meta(void) {
    char commit[48] = "", model[96] = "", host[64] = "", date[32];
    FILE *p = popen("git rev-parse --short=12 HEAD 2> /dev/null", "r");
    if (p) {
        if (fgets(commit, sizeof commit, p)) commit[strcspn(commit, "\n")] = 0;
        pclose(p);
    }
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
            snprintf(model, sizeof model, "%s", strchr(line, ':') + 2);
            model[strcspn(model, "\n")] = 0;
            for (char *c = model; *c; c++)
                if (*c == ',') *c = ' '; /* a plain CSV field for awk -F, */
            break;
        }
    if (f) fclose(f);
    if (gethostname(host, sizeof host)) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = 0;
    const time_t now = time(NULL);
    struct tm tm;
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&now, &tm));
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    rec_begin("meta");
    rec_s("version", cpar_version());
    rec_s("commit", commit);
    rec_s("date", date);
    rec_s("host", host);
    rec_s("cpu", model);
    rec_i("cpus", cpus);
    printf("cpar %s%s%s, %s, %s, %ld x %s\n", cpar_version(), *commit ? " at " : "", commit, date, host, cpus,
           *model ? model : "unknown CPU");
}

int main(int argc, char **argv) {
    int iters = env_int("CPAR_BENCH_ITERS", 10), max_mib = env_int("CPAR_BENCH_MAX_MIB", 16);
    size_t sweep_b = 0, sweep_e = 0, sweep_f = 2;
    const char *csv = NULL, *json = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { fputs(usage, stdout); return 0; }
        const char *v = strchr(a, '=');
        char name[32];
        snprintf(name, sizeof name, "%.*s", v ? (int)(v - a) < 31 ? (int)(v - a) : 31 : 31, a);
        if (v) v++;
        else if (i + 1 < argc) v = argv[++i];
        else { fprintf(stderr, "bench: %s needs a value\n%s", a, usage); return 2; }
        if (!strcmp(name, "-b") || !strcmp(name, "--minbytes")) sweep_b = parse_size(v);
        else if (!strcmp(name, "-e") || !strcmp(name, "--maxbytes")) sweep_e = parse_size(v);
        else if (!strcmp(name, "-f") || !strcmp(name, "--stepfactor")) sweep_f = parse_size(v);
        else if (!strcmp(name, "-n") || !strcmp(name, "--iters")) iters = atoi(v);
        else if (!strcmp(name, "--csv")) csv = v;
        else if (!strcmp(name, "--json")) json = v;
        else { fprintf(stderr, "bench: unknown option %s\n%s", a, usage); return 2; }
        if ((!strcmp(name, "-b") && !sweep_b) || (!strcmp(name, "-e") && !sweep_e) ||
            (!strcmp(name, "-f") && sweep_f < 2) || (!strcmp(name, "-n") && iters < 1)) {
            fprintf(stderr, "bench: %s expects %s, got \"%s\"\n", name,
                    !strcmp(name, "-f") ? "an integer >= 2" : !strcmp(name, "-n") ? "an integer >= 1"
                                                                                   : "a size such as 8, 8K or 64M", v);
            return 2;
        }
    }
    if ((sweep_b != 0) != (sweep_e != 0) || sweep_b > sweep_e) {
        fprintf(stderr, "bench: a sweep needs -b SIZE and -e SIZE with -b <= -e\n");
        return 2;
    }
    rec_meta();
    int rc = run_benches(iters, max_mib, sweep_b, sweep_e, sweep_f);
    if (csv) rc |= rec_write_csv(csv);
    if (json) rc |= rec_write_json(json);
    free(rec_rows);
    return rc;
}

/* One table of collectives on backend: every op, 2..max_ranks ranks
 * (doubling), sizes first..last (times factor); rows of section. */
static int coll_rows(const char *section, cpar_backend backend, int max_ranks, int iters, size_t first, size_t last,
                     size_t factor, double ceiling_gbps, const double *all_gbps, long cpus) {
    printf("\n%-15s %5s %9s %11s %12s %12s %9s %9s %8s %8s\n", "collective", "ranks", "size", "time/call", "recv/rank",
           "minimum", "algbw", "busbw", "busbw/ceil", "/traffic");
    for (int op = 0; op < OP_COUNT; op++)
        for (int n = 2; n <= max_ranks; n *= 2)
            for (size_t size = first; size <= last; size *= factor) {
                /* at least one float per rank: nccl-tests' smallest sizes round up likewise */
                size_t asked = size < (size_t)n * sizeof(float) ? (size_t)n * sizeof(float) : size;
                coll_case c = {.op = op, .iters = iters, .bytes = asked};
                if (cpar_spawn(n, backend, run_case, &c) != CPAR_OK) {
                    fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
                    return 1;
                }
                double bus;
                size_t bytes = c.bytes / sizeof(float) / (size_t)n * (size_t)n * sizeof(float);
                uint64_t min = min_recv(op, n, bytes, &bus);
                double algbw = (double)bytes / c.seconds / 1e9;
                char sz[24], traffic[16] = "-";
                double bw = all_gbps[n < cpus ? n : cpus > 8 ? 8 : cpus];
                if (bw > 0) snprintf(traffic, sizeof traffic, "%.2f", host_copy_bytes(op, n, bytes) / bw / 1e9 / c.seconds);
                printf("%-15s %5d %9s %9.3f ms %12llu %12llu %6.2f GB/s %6.2f GB/s %7.2f %8s\n", op_names[op], n,
                       fmt_size(bytes, sz, sizeof sz), c.seconds * 1e3, (unsigned long long)c.recv,
                       (unsigned long long)min, algbw, algbw * bus, algbw * bus / ceiling_gbps, traffic);
                rec_begin(section);
                rec_s("name", op_names[op]), rec_i("ranks", n), rec_i("bytes", (long long)bytes);
                rec_f("time_ms", c.seconds * 1e3), rec_i("recv_bytes", (long long)c.recv);
                rec_i("min_recv_bytes", (long long)min), rec_f("algbw_gbps", algbw), rec_f("busbw_gbps", algbw * bus);
                rec_f("busbw_per_ceiling", algbw * bus / ceiling_gbps);
                if (bw > 0) rec_f("traffic_bound_per_time", host_copy_bytes(op, n, bytes) / bw / 1e9 / c.seconds);
            }
    return 0;
}

static int run_benches(int iters, int max_mib, size_t sweep_b, size_t sweep_e, size_t sweep_f) {
    cpar_backend backend = cpar_backend_available(CPAR_BACKEND_NCCL) ? CPAR_BACKEND_NCCL : CPAR_BACKEND_HOST;
    int max_ranks = backend == CPAR_BACKEND_NCCL ? cpar_device_count() : 4;
    if (max_ranks > 8) max_ranks = 8;

    copy_case ceiling = {.bytes = (size_t)max_mib << 20};
    cpar_status st = cpar_spawn(1, backend, run_copy, &ceiling);
    if (st != CPAR_OK) {
        fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
        return 1;
    }
    printf("cpar bench: %s backend, %d iterations per case, ceiling = %s copy of %d MiB: %.2f GB/s\n",
           cpar_backend_name(backend), iters, backend == CPAR_BACKEND_NCCL ? "device-to-device" : "memcpy", max_mib,
           ceiling.gbps);
    /* Host: the traffic bound of every row, from the copy bandwidth of
     * min(ranks, processors) threads copying at once, measured here. */
    double all_gbps[9] = {0};
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (backend == CPAR_BACKEND_HOST && want("coll")) {
        printf("host copy bandwidth, every thread copying %d MiB at once:", max_mib);
        for (int t = 1; t <= max_ranks && t <= cpus; t++) {
            copy_case cc = {.bytes = (size_t)max_mib << 20};
            if (cpar_spawn(t, backend, run_copy, &cc) != CPAR_OK) {
                fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
                return 1;
            }
            all_gbps[t] = cc.gbps;
            printf(" %d thread%s %.2f GB/s%s", t, t > 1 ? "s" : "", cc.gbps, t < max_ranks && t < cpus ? "," : "\n");
        }
        printf("/traffic: the time the row's least traffic (host_copy_bytes: what its ranks must read and write,\n"
               "counted as memcpy counts a copy) takes at that bandwidth with min(ranks, %ld processors) threads, "
               "over the row's time\n", cpus);
    }
    size_t first = sweep_b ? sweep_b : (size_t)1 << 20, last = sweep_b ? sweep_e : (size_t)max_mib << 20;
    size_t factor = sweep_b ? sweep_f : 4;
    if (want("coll") && coll_rows("collectives", backend, max_ranks, iters, first, last, factor, ceiling.gbps,
                                  all_gbps, cpus))
        return 1;
    /* The device backend on a GPU: 2 and 4 ranks sharing the visible GPUs,
     * collectives by device copies and reduction kernels, over the same
     * device-to-device copy bandwidth. */
    if (want("coll") && backend == CPAR_BACKEND_NCCL && cpar_backend_available(CPAR_BACKEND_DEVICE)) {
        printf("\ndevice backend: ranks as threads sharing %d GPU%s", cpar_device_count(),
               cpar_device_count() == 1 ? "" : "s");
        if (coll_rows("device", CPAR_BACKEND_DEVICE, 4, iters, first, last, factor, ceiling.gbps, all_gbps, cpus))
            return 1;
    }

    /* The host backend across processes (cparrun without GPUs) against its
     * threads: the same collectives and sizes, the bus bandwidth of each. */
    if (want("procs")) {
        printf("\n%-15s %5s %9s %14s %14s %10s\n", "host: procs", "ranks", "size", "threads busbw", "procs busbw",
               "procs/thr");
        for (int op = 0; op <= OP_REDUCE_SCATTER; op++)
            for (int n = 2; n <= 4; n *= 2)
                for (size_t size = first; size <= last; size *= factor) {
                    size_t asked = size < (size_t)n * sizeof(float) ? (size_t)n * sizeof(float) : size;
                    coll_case ct = {.op = op, .iters = iters, .bytes = asked}, cp = ct;
                    if (cpar_spawn(n, CPAR_BACKEND_HOST, run_case, &ct) != CPAR_OK) {
                        fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
                        return 1;
                    }
                    if (run_case_procs(n, &cp)) {
                        fprintf(stderr, "bench: the %d-process %s job failed\n", n, op_names[op]);
                        return 1;
                    }
                    double bus;
                    size_t bytes = asked / sizeof(float) / (size_t)n * (size_t)n * sizeof(float);
                    min_recv(op, n, bytes, &bus);
                    double bt = (double)bytes / ct.seconds / 1e9 * bus, bp = (double)bytes / cp.seconds / 1e9 * bus;
                    char sz[24];
                    printf("%-15s %5d %9s %9.2f GB/s %9.2f GB/s %10.2f\n", op_names[op], n, fmt_size(bytes, sz, sizeof sz),
                           bt, bp, bp / bt);
                    rec_begin("procs");
                    rec_s("name", op_names[op]), rec_i("ranks", n), rec_i("bytes", (long long)bytes);
                    rec_f("threads_busbw_gbps", bt), rec_f("procs_busbw_gbps", bp), rec_f("procs_per_threads", bp / bt);
                    rec_i("recv_bytes", (long long)cp.recv);
                }
    }

    /* Mappings: the bytes any algorithm must receive are (n-1)/n of the
     * gathered or scattered activation (sp2hp: of the local one). */
    int64_t s_len = 1024, b = 2, h = 1024 * (int64_t)max_mib / 8;
    printf("\n%-26s %5s %14s %11s %12s %12s %9s %8s\n", "mapping [s,b,h] fp32", "ranks", "activation", "time/call",
           "recv/rank", "minimum", "busbw", "busbw/ceil");
    for (int op = 0; op < MAP_COUNT && want("map"); op++)
        for (int n = 2; n <= max_ranks; n *= 2) {
            map_case c = {.op = op, .iters = iters, .s = s_len, .b = b, .h = h};
            if (cpar_spawn(n, backend, run_map, &c) != CPAR_OK) {
                fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
                return 1;
            }
            uint64_t bytes = (uint64_t)(s_len * b * h) * sizeof(float);
            uint64_t min = op == MAP_SP2HP ? bytes / (uint64_t)n * (uint64_t)(n - 1) / (uint64_t)n
                                           : bytes / (uint64_t)n * (uint64_t)(n - 1);
            double busbw = (double)min / c.seconds / 1e9;
            printf("%-26s %5d %8lldx%lldx%lld %8.3f ms %12llu %12llu %6.2f GB/s %7.2f\n", map_names[op], n,
                   (long long)s_len, (long long)b, (long long)h, c.seconds * 1e3, (unsigned long long)c.recv,
                   (unsigned long long)min, busbw, busbw / ceiling.gbps);
            rec_begin("mappings");
            rec_s("name", map_names[op]), rec_i("ranks", n), rec_i("s", s_len), rec_i("b", b), rec_i("h", h);
            rec_f("time_ms", c.seconds * 1e3), rec_i("recv_bytes", (long long)c.recv), rec_i("min_recv_bytes", (long long)min);
            rec_f("busbw_gbps", busbw), rec_f("busbw_per_ceiling", busbw / ceiling.gbps);
        }

    /* Cross entropy: the forward reads the logits once and the backward reads
     * and writes them once; the all-reduces carry 3 floats per token. */
    /* The host backend runs the fp64 reference loops: a smaller problem. */
    int64_t tokens = backend == CPAR_BACKEND_NCCL ? 8192 : 1024, vocab = backend == CPAR_BACKEND_NCCL ? 131072 : 8192;
    printf("\n%-26s %5s %14s %11s %11s %12s %12s %10s %10s\n", "cross entropy fp32", "ranks", "tokens x V/tp",
           "forward", "backward", "recv/rank", "minimum", "fwd/ceil", "bwd/ceil");
    for (int n = 1; n <= max_ranks && want("xent"); n *= 2) {
        xent_case c = {.iters = iters, .tokens = tokens, .vocab = vocab};
        if (cpar_spawn(n, backend, run_xent, &c) != CPAR_OK) {
            fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
            return 1;
        }
        double local = (double)(tokens * (vocab / n)) * sizeof(float);
        uint64_t part = (uint64_t)tokens * sizeof(float), min = 0;
        if (n > 1) /* three all-reduces of [tokens] floats: 2(n-1)/n each */
            for (int k = 0; k < 3; k++) {
                uint64_t mine = part / (uint64_t)n;
                min += (part - mine) + (uint64_t)(n - 1) * mine;
            }
        /* fwd/ceil: a read of the local logits at the copy ceiling (a copy
         * moves 2 bytes per byte); bwd/ceil: a read + write of them. */
        printf("%-26s %5d %8lld x %-5lld %8.3f ms %8.3f ms %12llu %12llu %10.2f %10.2f\n", "vocab_parallel_xent", n,
               (long long)tokens, (long long)(vocab / n), c.fwd * 1e3, c.bwd * 1e3, (unsigned long long)c.recv,
               (unsigned long long)min, local / c.fwd / 1e9 / (2 * ceiling.gbps),
               2 * local / c.bwd / 1e9 / (2 * ceiling.gbps));
        rec_begin("cross_entropy");
        rec_s("name", "vocab_parallel_xent"), rec_i("ranks", n), rec_i("tokens", tokens), rec_i("vocab_local", vocab / n);
        rec_f("fwd_ms", c.fwd * 1e3), rec_f("bwd_ms", c.bwd * 1e3);
        rec_i("recv_bytes", (long long)c.recv), rec_i("min_recv_bytes", (long long)min);
        rec_f("fwd_per_ceiling", local / c.fwd / 1e9 / (2 * ceiling.gbps));
        rec_f("bwd_per_ceiling", 2 * local / c.bwd / 1e9 / (2 * ceiling.gbps));
    }

    /* The host GEMM (every backend's products on host tensors). */
    if (want("gemm")) bench_host_gemm(iters);

    /* Linear layers: FLOP rate per rank of the MLP forward + backward (6
     * GEMM-equivalents of 2*T*h*4h each, split over n ranks) against the
     * single-rank GEMM ceiling: cuBLAS through the layer on GPUs; on the host,
     * OpenBLAS's sgemm when installed (else cpar's built-in kernel). */
    bool nccl = backend == CPAR_BACKEND_NCCL;
    int64_t ms_len = nccl ? 4096 : 128, mb = 2, mh = nccl ? 4096 : 1024;
    gemm_case gc = {.iters = iters, .tokens = ms_len * mb, .k = mh, .n = 4 * mh};
    if (!want("mlp")) {
        /* not asked for: no ceiling to measure */
    } else if (nccl) {
        if (cpar_spawn(1, backend, run_gemm, &gc) != CPAR_OK) {
            fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
            return 1;
        }
    } else {
        gc.flops = gemm_ceiling(iters, gc.tokens, gc.k, gc.n, NULL);
    }
    printf("\nMLP [s,b,h]=[%lld,%lld,%lld] fp32, column h->4h then row 4h->h; GEMM ceiling (%s [%lld x %lld] x "
           "[%lld x %lld]): %.2f GFLOP/s\n",
           (long long)ms_len, (long long)mb, (long long)mh, nccl ? "1-rank layer forward" : "host sgemm",
           (long long)(ms_len * mb), (long long)mh, (long long)mh, (long long)(4 * mh), gc.flops / 1e9);
    printf("%-26s %5s %4s %11s %12s %12s %14s %9s\n", "linear fwd+bwd", "ranks", "sp", "time", "recv/rank", "minimum",
           "GFLOP/s/rank", "/ceiling");
    for (int n = 1; n <= max_ranks && want("mlp"); n *= 2)
        for (int sp = 0; sp <= (n > 1); sp++) {
            mlp_case c = {.iters = iters, .sp = sp, .s = ms_len, .b = mb, .h = mh};
            if (cpar_spawn(n, backend, run_mlp, &c) != CPAR_OK) {
                fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
                return 1;
            }
            double flops = 6.0 * 2.0 * (double)(ms_len * mb * mh * 4 * mh) / n / c.seconds;
            printf("%-26s %5d %4s %8.3f ms %12llu %12llu %14.2f %9.2f\n", "column -> row MLP", n, sp ? "yes" : "no",
                   c.seconds * 1e3, (unsigned long long)c.recv,
                   (unsigned long long)mlp_min_recv(n, sp, ms_len * mb * mh), flops / 1e9, flops / gc.flops);
            rec_begin("mlp");
            rec_s("name", "column -> row MLP"), rec_i("ranks", n), rec_s("sp", sp ? "yes" : "no");
            rec_i("s", ms_len), rec_i("b", mb), rec_i("h", mh), rec_f("time_ms", c.seconds * 1e3);
            rec_i("recv_bytes", (long long)c.recv), rec_i("min_recv_bytes", (long long)mlp_min_recv(n, sp, ms_len * mb * mh));
            rec_f("gflops_per_rank", flops / 1e9), rec_f("per_ceiling", flops / gc.flops);
        }

    /* Attention: per rank FLOP rate against the GEMM ceiling; context
     * parallelism's bytes against each comm type's minimum (the rows below). */
    int64_t ab = 1, ah = nccl ? 16 : 2, as = nccl ? 8192 : 1024, ad = nccl ? 128 : 64;
    cpar_dtype adt = nccl ? CPAR_BF16 : CPAR_F32;
    gemm_case ag = {.iters = iters, .tokens = nccl ? 8192 : 1024, .k = nccl ? 8192 : 1024, .n = nccl ? 8192 : 1024,
                    .dt = adt};
    double ag_cpu = 0.0; /* the host ceiling over its thread CPU time */
    if (!want("attn")) {
        /* not asked for: no ceiling to measure */
    } else if (nccl) {
        if (cpar_spawn(1, backend, run_gemm, &ag) != CPAR_OK) {
            fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
            return 1;
        }
    } else {
        ag.flops = gemm_ceiling(iters, ag.tokens, ag.k, ag.n, &ag_cpu);
    }
    printf("\nattention [b,h,s,d]=[%lld,%lld,%lld,%lld] %s, causal; cp rows: round-robin load balancing, their own s and h; GEMM ceiling "
           "(%s [%lld x %lld] x [%lld x %lld]): %.2f GFLOP/s\n",
           (long long)ab, (long long)ah, (long long)as, (long long)ad, cpar_dtype_name(adt), cpar_dtype_name(adt),
           (long long)ag.tokens, (long long)ag.k, (long long)ag.k, (long long)ag.n, ag.flops / 1e9);
    printf("%-26s %5s %6s %4s %10s %10s %12s %12s %12s %12s %9s %9s %9s %9s\n", "attention", "ranks", "s", "h",
           "forward", "backward", "recv fwd", "min fwd", "recv bwd", "min bwd", "fwd/ceil", "bwd/ceil", "f+b/ceil",
           "cpu f+b");
    /* one rank at several lengths (the host target: s = 512..2048, d = 64),
     * then context parallelism: each comm type at cp 2 and 4 (a2a+p2p as
     * 2 x 2) for two (s, h) shapes, heads divisible by cp */
    typedef struct {
        int n, a; /* ranks, all-to-all size */
        cpar_cp_comm_type comm;
        int64_t s, h;
    } attn_row;
    attn_row rows[64];
    int nrows = 0;
    const int64_t local_s[] = {nccl ? as : 512, nccl ? as : 1024, nccl ? as : 2048};
    for (int i = 0; i < (nccl ? 1 : 3); i++) rows[nrows++] = (attn_row){1, 1, CPAR_CP_P2P, local_s[i], ah};
    const int64_t cp_shape[2][2] = {{as, nccl ? 16 : 4}, {nccl ? 4 * as : as / 2, nccl ? 32 : 8}};
    for (int sh = 0; sh < 2; sh++)
        for (int n = 2; n <= 4 && n <= max_ranks; n *= 2)
            for (int t = 0; t < CPAR_CP_COMM_TYPE_COUNT; t++) {
                const int a = t == CPAR_CP_A2A ? n : t == CPAR_CP_A2A_P2P ? 2 : 1;
                if (t == CPAR_CP_A2A_P2P && a == n) continue; /* a2a+p2p at cp 2 is a2a */
                rows[nrows++] = (attn_row){n, a, (cpar_cp_comm_type)t, cp_shape[sh][0], cp_shape[sh][1]};
            }
    for (int row = 0; want("attn") && row < nrows; row++) {
        const attn_row *r = &rows[row];
        const int n = r->n;
        const int64_t s_row = r->s, h_row = r->h;
        attn_case c = {.iters = iters, .causal = true, .load_balance = n > 1, .comm = r->comm,
                       .a2a_size = r->comm == CPAR_CP_A2A_P2P ? r->a : 0, .b = ab, .h = h_row, .s = s_row, .d = ad,
                       .dt = adt};
        if (cpar_spawn(n, backend, run_attn, &c) != CPAR_OK) {
            fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
            return 1;
        }
        double fl = 4.0 * (double)(ab * h_row * s_row) * (double)s_row * (double)ad / 2.0 / n;
        /* the minimum bytes a rank receives (cpar.h's cpar_cp_comm_type): q (out, dout, dq) and k (v, dk, dv)
         * shards of qb and kb bytes, lse of lb; the ring over p = n/a ranks moves p-1 KV blocks of 2 kb
         * (backward: again, plus p travelling fp32 dK/dV accumulators); the all-to-alls (a-1)/a of each
         * tensor: q, k, v in and out, lse back (backward: q, k, v, out, dout, lse in; dq, dk, dv back) */
        const uint64_t es = cpar_dtype_size(adt), a = (uint64_t)r->a, p = (uint64_t)(n / r->a);
        const uint64_t kb = (uint64_t)(ab * h_row * s_row / n * ad) * es, qb = kb, lb = kb / es / (uint64_t)ad * 4;
        uint64_t min_f = (p - 1) * 2 * kb, min_b = min_f + (p > 1 ? p * 2 * (kb / es) * 4 : 0);
        if (a > 1) min_f += (2 * qb + 2 * kb + lb) / a * (a - 1), min_b += (4 * qb + 4 * kb + lb) / a * (a - 1);
        /* one rank on the host: f+b over the thread CPU times of both (a ring's ranks wait for each other) */
        const bool by_cpu = n == 1 && !nccl && ag_cpu > 0.0;
        const double cpu_fb = by_cpu ? 3.5 * fl / (c.fwd_cpu + c.bwd_cpu) / ag_cpu : 0.0;
        char cpu_col[16] = "-", name[40];
        if (by_cpu) snprintf(cpu_col, sizeof cpu_col, "%.2f", cpu_fb);
        if (n == 1) snprintf(name, sizeof name, "local (flash)");
        else if (r->comm == CPAR_CP_A2A_P2P) snprintf(name, sizeof name, "cp a2a+p2p (%d x %d)", r->a, n / r->a);
        else snprintf(name, sizeof name, "cp %s", cpar_cp_comm_type_name(r->comm));
        printf("%-26s %5d %6lld %4lld %7.3f ms %7.3f ms %12llu %12llu %12llu %12llu %9.2f %9.2f %9.2f %9s\n", name, n,
               (long long)s_row, (long long)h_row, c.fwd * 1e3, c.bwd * 1e3, (unsigned long long)c.recv_fwd,
               (unsigned long long)(n > 1 ? min_f : 0), (unsigned long long)c.recv_bwd,
               (unsigned long long)(n > 1 ? min_b : 0), fl / c.fwd / ag.flops, 2.5 * fl / c.bwd / ag.flops,
               3.5 * fl / (c.fwd + c.bwd) / ag.flops, cpu_col);
        rec_begin("attention");
        rec_s("name", name);
        rec_i("ranks", n), rec_i("b", ab), rec_i("h", h_row), rec_i("s", s_row), rec_i("d", ad);
        rec_s("dtype", cpar_dtype_name(adt)), rec_s("cp_comm", n > 1 ? cpar_cp_comm_type_name(r->comm) : "-");
        rec_i("a2a_size", r->a);
        rec_f("fwd_ms", c.fwd * 1e3), rec_f("bwd_ms", c.bwd * 1e3);
        rec_i("recv_fwd_bytes", (long long)c.recv_fwd), rec_i("min_recv_fwd_bytes", (long long)(n > 1 ? min_f : 0));
        rec_i("recv_bwd_bytes", (long long)c.recv_bwd), rec_i("min_recv_bwd_bytes", (long long)(n > 1 ? min_b : 0));
        rec_f("fwd_per_ceiling", fl / c.fwd / ag.flops), rec_f("bwd_per_ceiling", 2.5 * fl / c.bwd / ag.flops);
        rec_f("fwd_bwd_per_ceiling", 3.5 * fl / (c.fwd + c.bwd) / ag.flops);
        if (by_cpu) rec_f("fwd_bwd_per_ceiling_cpu", cpu_fb);
    }
    /* Mamba CP: busbw = the minimum bytes over the time, against the copy ceiling. */
    mamba_case mc0 = {.iters = iters, .s = nccl ? 8192 : 1024, .b = nccl ? 2 : 1, .d_inner = nccl ? 4096 : 1024,
                      .nheads = nccl ? 64 : 16, .ngroups = nccl ? 8 : 2, .d_state = 128, .dt = adt};
    printf("\nMamba CP %s: s=%lld b=%lld d_inner=%lld nheads=%lld ngroups=%lld d_state=%lld (in-projection width "
           "%lld)\n",
           cpar_dtype_name(adt), (long long)mc0.s, (long long)mc0.b, (long long)mc0.d_inner, (long long)mc0.nheads,
           (long long)mc0.ngroups, (long long)mc0.d_state,
           (long long)(2 * mc0.d_inner + 2 * mc0.ngroups * mc0.d_state + mc0.nheads));
    printf("%-26s %5s %10s %10s %12s %12s %9s %8s\n", "mamba cp", "ranks", "forward", "backward", "recv/call",
           "minimum", "busbw", "busbw/ceil");
    for (int n = 1; n <= max_ranks && want("mamba"); n *= 2) {
        mamba_case c = mc0;
        if (cpar_spawn(n, backend, run_mamba, &c) != CPAR_OK) {
            fprintf(stderr, "bench: %s\n", cpar_thread_last_error());
            return 1;
        }
        const char *names[2] = {"pre_conv_ssm", "post_conv_ssm"};
        double fw[2] = {c.pre_f, c.post_f}, bw[2] = {c.pre_b, c.post_b};
        uint64_t recv[2] = {c.recv_pre, c.recv_post}, bytes[2] = {c.bytes_pre, c.bytes_post};
        for (int k = 0; k < 2; k++) {
            uint64_t min = bytes[k] / (uint64_t)n * (uint64_t)(n - 1);
            double busbw = (double)min / fw[k] / 1e9;
            printf("%-26s %5d %7.3f ms %7.3f ms %12llu %12llu %4.2f GB/s %8.2f\n", names[k], n, fw[k] * 1e3,
                   bw[k] * 1e3, (unsigned long long)recv[k], (unsigned long long)min, busbw, busbw / ceiling.gbps);
            rec_begin("mamba_cp");
            rec_s("name", names[k]), rec_i("ranks", n), rec_f("fwd_ms", fw[k] * 1e3), rec_f("bwd_ms", bw[k] * 1e3);
            rec_i("recv_bytes", (long long)recv[k]), rec_i("min_recv_bytes", (long long)min);
            rec_f("busbw_gbps", busbw), rec_f("busbw_per_ceiling", busbw / ceiling.gbps);
        }
    }
    return want("mb") ? bench_memory_bound(iters, max_mib) : 0;
}
