/* SPDX-License-Identifier: MIT */
/* tests/test_store.c — the rendezvous store and the launch environment.
 *
 * Everything runs in one process on 127.0.0.1: a server, client threads, and
 * raw sockets that misbehave on purpose. Ports are picked free by the kernel
 * (bind port 0), so suites may run in parallel. Worker threads never call
 * ck_assert: they record what they saw and the test's main thread checks. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* POSIX and Linux APIs under -std=c11, as in cpar.c */
#endif
#include "testutil.h"
#include "net.h"

#include <arpa/inet.h>
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ---- helpers ------------------------------------------------------------ */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* A port the kernel just handed out: free unless someone races us. */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

#define ASSERT_MSG_HAS(needle)                                                                                \
    ck_assert_msg(strstr(cpar_thread_last_error(), (needle)) != NULL, "error \"%s\" lacks \"%s\"",            \
                  cpar_thread_last_error(), (needle))

/* A server on a fresh port (retrying if another suite took the port first). */
static cpar_store *start_server(int *port, int timeout_ms)
{
    for (int attempt = 0; attempt < 20; attempt++) {
        *port = free_port();
        cpar_store_config cfg = {.host = "127.0.0.1", .port = *port, .is_server = true, .timeout_ms = timeout_ms};
        cpar_store *s = NULL;
        cpar_status st = cpar_store_create(&cfg, &s);
        if (st == CPAR_OK)
            return s;
        ck_assert_msg(strstr(cpar_thread_last_error(), "in use") != NULL, "server: %s", cpar_thread_last_error());
    }
    ck_abort_msg("no free port after 20 attempts");
    return NULL;
}

static cpar_store *connect_client(int port, int timeout_ms)
{
    cpar_store_config cfg = {.host = "127.0.0.1", .port = port, .timeout_ms = timeout_ms};
    cpar_store *s = NULL;
    cpar_status st = cpar_store_create(&cfg, &s);
    ck_assert_msg(st == CPAR_OK, "client: %s", cpar_thread_last_error());
    return s;
}

static int raw_connect(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

static void raw_send(int fd, const void *p, size_t n)
{
    ck_assert_int_eq(send(fd, p, n, MSG_NOSIGNAL), (ssize_t)n);
}

/* True when the peer closes fd within ms (EOF or reset). */
static bool closed_within(int fd, int ms)
{
    int64_t end = now_ms() + ms;
    char buf[256];
    for (;;) {
        int left = (int)(end - now_ms());
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (left <= 0 || poll(&p, 1, left) <= 0)
            return false;
        ssize_t r = recv(fd, buf, sizeof buf, 0);
        if (r == 0 || (r < 0 && errno == ECONNRESET))
            return true;
    }
}

/* A header as the wire format defines it (big-endian). */
static void put_hdr(unsigned char *p, uint32_t magic, unsigned version, unsigned op, unsigned klen, uint32_t vlen)
{
    p[0] = (unsigned char)(magic >> 24), p[1] = (unsigned char)(magic >> 16);
    p[2] = (unsigned char)(magic >> 8), p[3] = (unsigned char)magic;
    p[4] = (unsigned char)version, p[5] = (unsigned char)op;
    p[6] = (unsigned char)(klen >> 8), p[7] = (unsigned char)klen;
    p[8] = (unsigned char)(vlen >> 24), p[9] = (unsigned char)(vlen >> 16);
    p[10] = (unsigned char)(vlen >> 8), p[11] = (unsigned char)vlen;
}

/* Send a frame the server must refuse on fd, then check it hung up. */
static void send_refused(int fd, const void *frame, size_t n)
{
    raw_send(fd, frame, n);
    ck_assert(closed_within(fd, 2000));
    close(fd);
}
#define MAGIC 0x43505354u
#define VERSION 2
#define TOKEN "test-job" /* main() exports it as CPAR_JOB_TOKEN: the configs without a token use it */
enum { OP_HELLO = 1, OP_SET, OP_GET, OP_ADD };
enum { ST_OK = 0, ST_DENIED = 4 };

/* Receive exactly n bytes within ms; false on EOF, error or timeout. */
static bool recv_exact(int fd, void *buf, size_t n, int ms)
{
    int64_t end = now_ms() + ms;
    size_t got = 0;
    while (got < n) {
        int left = (int)(end - now_ms());
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (left <= 0 || poll(&p, 1, left) <= 0)
            return false;
        ssize_t r = recv(fd, (char *)buf + got, n - got, 0);
        if (r <= 0)
            return false;
        got += (size_t)r;
    }
    return true;
}

/* Send a HELLO with token on fd; returns the reply's status, or -1 when none came. */
static int raw_hello(int fd, const char *token)
{
    unsigned char h[12 + 256], r[12];
    size_t n = strlen(token);
    put_hdr(h, MAGIC, VERSION, OP_HELLO, 0, (uint32_t)n);
    memcpy(h + 12, token, n);
    raw_send(fd, h, 12 + n);
    return recv_exact(fd, r, 12, 2000) ? (r[5] & 0x7f) : -1;
}

/* A raw connection that has shown the job token. */
static int raw_connect_hello(int port)
{
    int fd = raw_connect(port);
    ck_assert_int_eq(raw_hello(fd, TOKEN), ST_OK);
    return fd;
}

/* The server still answers a well-behaved client. */
static void check_store_works(int port, const char *tag)
{
    cpar_store *c = connect_client(port, 2000);
    char buf[64];
    size_t len = 0;
    ck_assert_int_eq(cpar_store_set(c, tag, tag, strlen(tag)), CPAR_OK);
    ck_assert_int_eq(cpar_store_get(c, tag, buf, sizeof buf, &len), CPAR_OK);
    ck_assert_uint_eq(len, strlen(tag));
    ck_assert(memcmp(buf, tag, len) == 0);
    cpar_store_destroy(c);
}

/* ---- basic operations --------------------------------------------------- */

START_TEST(test_set_get_add)
{
    int port;
    cpar_store *srv = start_server(&port, 5000);
    cpar_store *c = connect_client(port, 5000);
    char buf[64];
    size_t len = 99;

    ck_assert_int_eq(cpar_store_set(srv, "greeting", "hello", 5), CPAR_OK);
    ck_assert_int_eq(cpar_store_get(c, "greeting", buf, sizeof buf, &len), CPAR_OK);
    ck_assert_uint_eq(len, 5);
    ck_assert(memcmp(buf, "hello", 5) == 0);

    ck_assert_int_eq(cpar_store_set(c, "greeting", "hi", 2), CPAR_OK); /* overwrite */
    ck_assert_int_eq(cpar_store_get(srv, "greeting", buf, sizeof buf, &len), CPAR_OK);
    ck_assert_uint_eq(len, 2);

    ck_assert_int_eq(cpar_store_set(c, "empty", NULL, 0), CPAR_OK); /* empty values exist */
    ck_assert_int_eq(cpar_store_get(c, "empty", NULL, 0, &len), CPAR_OK);
    ck_assert_uint_eq(len, 0);

    int64_t r = 0;
    ck_assert_int_eq(cpar_store_add(c, "ctr", 5, &r), CPAR_OK);
    ck_assert_int_eq(r, 5);
    ck_assert_int_eq(cpar_store_add(srv, "ctr", -7, &r), CPAR_OK);
    ck_assert_int_eq(r, -2);
    ck_assert_int_eq(cpar_store_add(c, "ctr", 0, NULL), CPAR_OK);
    ck_assert_int_eq(cpar_store_get(c, "ctr", buf, sizeof buf, &len), CPAR_OK); /* counters are decimal text */
    ck_assert_uint_eq(len, 2);
    ck_assert(memcmp(buf, "-2", 2) == 0);
    ck_assert_int_eq(cpar_store_add(c, "big", INT64_MAX, &r), CPAR_OK);
    ck_assert_int_eq(cpar_store_add(c, "big", 1, &r), CPAR_ERR_INVALID); /* overflow */
    ck_assert_int_eq(cpar_store_add(c, "greeting", 1, &r), CPAR_ERR_INVALID); /* "hi" is no integer */
    ASSERT_MSG_HAS("greeting");

    /* Too small a buffer: INVALID, the size is still reported, the handle still works. */
    ck_assert_int_eq(cpar_store_set(c, "long", "0123456789", 10), CPAR_OK);
    ck_assert_int_eq(cpar_store_get(c, "long", buf, 4, &len), CPAR_ERR_INVALID);
    ck_assert_uint_eq(len, 10);
    ASSERT_MSG_HAS("cap=4");
    ck_assert_int_eq(cpar_store_get(c, "long", buf, sizeof buf, NULL), CPAR_OK);
    ck_assert(memcmp(buf, "0123456789", 10) == 0);

    cpar_store_destroy(c);
    cpar_store_destroy(srv);
}
END_TEST

START_TEST(test_value_sizes)
{
    int port;
    cpar_store *srv = start_server(&port, 10000);
    cpar_store *c = connect_client(port, 10000);
    unsigned char id[128], back[128];
    size_t len;
    for (int i = 0; i < 128; i++)
        id[i] = (unsigned char)(i * 7 + 3);
    ck_assert_int_eq(cpar_store_set(srv, "nccl/0", id, sizeof id), CPAR_OK);
    ck_assert_int_eq(cpar_store_get(c, "nccl/0", back, sizeof back, &len), CPAR_OK);
    ck_assert_uint_eq(len, 128);
    ck_assert(memcmp(id, back, 128) == 0);

    size_t mib = (size_t)1 << 20;
    unsigned char *big = malloc(mib + 1), *got = malloc(mib);
    ck_assert_ptr_nonnull(big);
    ck_assert_ptr_nonnull(got);
    for (size_t i = 0; i <= mib; i++)
        big[i] = (unsigned char)(i * 2654435761u >> 24);
    ck_assert_int_eq(cpar_store_set(c, "big", big, mib), CPAR_OK);
    ck_assert_int_eq(cpar_store_get(srv, "big", got, mib, &len), CPAR_OK);
    ck_assert_uint_eq(len, mib);
    ck_assert(memcmp(big, got, mib) == 0);

    ck_assert_int_eq(cpar_store_set(c, "toobig", big, mib + 1), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("1048577");
    ck_assert_int_eq(cpar_store_get(c, "nccl/0", back, sizeof back, &len), CPAR_OK); /* refused before sending */
    free(big);
    free(got);
    cpar_store_destroy(c);
    cpar_store_destroy(srv);
}
END_TEST

typedef struct {
    int port, delay_ms;
} setter_arg;

static void *set_later(void *p)
{
    setter_arg *a = p;
    cpar_store_config cfg = {.host = "127.0.0.1", .port = a->port, .timeout_ms = 5000};
    cpar_store *c = NULL;
    sleep_ms(a->delay_ms);
    if (cpar_store_create(&cfg, &c) == CPAR_OK) {
        cpar_store_set(c, "late", "value", 5);
        cpar_store_destroy(c);
    }
    return NULL;
}

START_TEST(test_get_waits)
{
    int port;
    cpar_store *srv = start_server(&port, 5000);
    setter_arg a = {port, 300};
    pthread_t t;
    pthread_create(&t, NULL, set_later, &a);
    char buf[16];
    size_t len;
    int64_t t0 = now_ms();
    ck_assert_msg(cpar_store_get(srv, "late", buf, sizeof buf, &len) == CPAR_OK, "%s", cpar_thread_last_error());
    int64_t dt = now_ms() - t0;
    ck_assert_int_ge(dt, 250);
    ck_assert_int_lt(dt, 2000);
    ck_assert(len == 5 && memcmp(buf, "value", 5) == 0);
    pthread_join(t, NULL);
    cpar_store_destroy(srv);
}
END_TEST

START_TEST(test_get_timeout)
{
    int port;
    cpar_store *srv = start_server(&port, 300);
    char buf[16];
    int64_t t0 = now_ms();
    ck_assert_int_eq(cpar_store_get(srv, "nccl/never", buf, sizeof buf, NULL), CPAR_ERR_TIMEOUT);
    int64_t dt = now_ms() - t0;
    ck_assert_int_ge(dt, 290);
    ck_assert_int_lt(dt, 1500);
    ASSERT_MSG_HAS("cpar_store_get: key \"nccl/never\" not set within 300 ms");
    ck_assert_int_eq(cpar_store_set(srv, "after", "x", 1), CPAR_OK); /* a timeout does not break the handle */
    cpar_store_destroy(srv);
}
END_TEST

typedef struct {
    int port, rank, nranks, rounds, timeout_ms;
    atomic_int *arrived; /* per round: ranks that entered the barrier */
    cpar_status st;
    int64_t sum_seen;
    bool early; /* someone left a barrier before everyone arrived */
    char err[512];
} rank_arg;

static void *add_worker(void *p)
{
    rank_arg *a = p;
    cpar_store_config cfg = {.host = "127.0.0.1", .port = a->port, .timeout_ms = 10000};
    cpar_store *c = NULL;
    a->st = cpar_store_create(&cfg, &c);
    for (int i = 0; i < a->rounds && a->st == CPAR_OK; i++) {
        int64_t r;
        a->st = cpar_store_add(c, "shared", 1, &r);
        a->sum_seen += r;
    }
    cpar_store_destroy(c);
    return NULL;
}

START_TEST(test_add_concurrent)
{
    enum { T = 8, N = 200 };
    int port;
    cpar_store *srv = start_server(&port, 10000);
    rank_arg a[T];
    pthread_t t[T];
    for (int i = 0; i < T; i++) {
        a[i] = (rank_arg){.port = port, .rounds = N};
        pthread_create(&t[i], NULL, add_worker, &a[i]);
    }
    int64_t total = 0;
    for (int i = 0; i < T; i++) {
        pthread_join(t[i], NULL);
        ck_assert_int_eq(a[i].st, CPAR_OK);
        total += a[i].sum_seen;
    }
    /* Atomic adds hand out 1..T*N exactly once each. */
    ck_assert_int_eq(total, (int64_t)T * N * (T * N + 1) / 2);
    int64_t r;
    ck_assert_int_eq(cpar_store_add(srv, "shared", 0, &r), CPAR_OK);
    ck_assert_int_eq(r, T * N);
    cpar_store_destroy(srv);
}
END_TEST

/* ---- barrier ------------------------------------------------------------ */

static void *barrier_worker(void *p)
{
    rank_arg *a = p;
    cpar_store_config cfg = {.host = "127.0.0.1", .port = a->port, .timeout_ms = a->timeout_ms};
    cpar_store *c = NULL;
    a->st = cpar_store_create(&cfg, &c);
    for (int i = 0; i < a->rounds && a->st == CPAR_OK; i++) {
        if (a->rank == i % a->nranks)
            sleep_ms(20); /* someone is always late */
        atomic_fetch_add(&a->arrived[i], 1);
        /* One name, reused every round: generations keep them apart. */
        a->st = cpar_store_barrier(c, "step", a->rank, a->nranks);
        if (a->st == CPAR_OK && atomic_load(&a->arrived[i]) != a->nranks)
            a->early = true;
    }
    if (a->st != CPAR_OK)
        snprintf(a->err, sizeof a->err, "%s", cpar_thread_last_error());
    cpar_store_destroy(c);
    return NULL;
}

START_TEST(test_barrier)
{
    enum { R = 4, ROUNDS = 6 };
    int port;
    cpar_store *srv = start_server(&port, 10000);
    atomic_int arrived[ROUNDS];
    for (int i = 0; i < ROUNDS; i++)
        atomic_init(&arrived[i], 0);
    rank_arg a[R];
    pthread_t t[R];
    for (int i = 0; i < R; i++) {
        a[i] = (rank_arg){.port = port, .rank = i, .nranks = R, .rounds = ROUNDS, .timeout_ms = 10000,
                          .arrived = arrived};
        pthread_create(&t[i], NULL, barrier_worker, &a[i]);
    }
    for (int i = 0; i < R; i++) {
        pthread_join(t[i], NULL);
        ck_assert_msg(a[i].st == CPAR_OK, "rank %d: %s", i, a[i].err);
        ck_assert_msg(!a[i].early, "rank %d left a barrier early", i);
    }
    ck_assert_int_eq(cpar_store_barrier(srv, "solo", 0, 1), CPAR_OK); /* one rank: no wait */
    cpar_store_destroy(srv);
}
END_TEST

/* Ranks listed in absent never come; the others must time out naming them. */
static void run_barrier_missing(const int *absent, int nabsent, const char *expect)
{
    enum { R = 4 };
    int port;
    cpar_store *srv = start_server(&port, 10000);
    atomic_int arrived[1];
    atomic_init(&arrived[0], 0);
    rank_arg a[R];
    pthread_t t[R];
    bool skip[R] = {false};
    for (int i = 0; i < nabsent; i++)
        skip[absent[i]] = true;
    int64_t t0 = now_ms();
    for (int i = 0; i < R; i++)
        if (!skip[i]) {
            a[i] = (rank_arg){.port = port, .rank = i, .nranks = R, .rounds = 1, .timeout_ms = 500,
                              .arrived = arrived};
            pthread_create(&t[i], NULL, barrier_worker, &a[i]);
        }
    for (int i = 0; i < R; i++)
        if (!skip[i]) {
            pthread_join(t[i], NULL);
            ck_assert_msg(a[i].st == CPAR_ERR_TIMEOUT, "rank %d: status %d", i, a[i].st);
            ck_assert_msg(strstr(a[i].err, expect) != NULL, "rank %d: \"%s\" lacks \"%s\"", i, a[i].err, expect);
            ck_assert_msg(strstr(a[i].err, "barrier \"step\"") != NULL, "%s", a[i].err);
        }
    ck_assert_int_lt(now_ms() - t0, 3000);
    cpar_store_destroy(srv);
}

START_TEST(test_barrier_missing_rank)
{
    run_barrier_missing((const int[]){2}, 1, "rank 2 of 4 missing");
}
END_TEST

START_TEST(test_barrier_missing_ranks)
{
    run_barrier_missing((const int[]){1, 3}, 2, "ranks 1,3 of 4 missing");
}
END_TEST

/* ---- a hostile or broken peer never takes the server down --------------- */

START_TEST(test_garbage_frames)
{
    int port;
    cpar_store *srv = start_server(&port, 5000);
    unsigned char h[256] = {0};

    int fd = raw_connect(port); /* plain garbage: a wrong magic */
    send_refused(fd, "GET / HTTP/1.1\r\nHost: x\r\n\r\n", 27);
    check_store_works(port, "after-garbage");

    fd = raw_connect(port); /* right magic, wrong version */
    put_hdr(h, MAGIC, 99, OP_HELLO, 0, 0);
    send_refused(fd, h, 12);

    fd = raw_connect_hello(port); /* unknown opcode */
    put_hdr(h, MAGIC, VERSION, 77, 1, 0);
    send_refused(fd, h, 12);

    fd = raw_connect_hello(port); /* value length field of 2 GiB: refused at the header */
    put_hdr(h, MAGIC, VERSION, OP_SET, 3, 0x80000000u);
    send_refused(fd, h, 12);

    fd = raw_connect_hello(port); /* 1 MiB + 1 */
    put_hdr(h, MAGIC, VERSION, OP_SET, 3, (1u << 20) + 1);
    send_refused(fd, h, 12);

    fd = raw_connect_hello(port); /* key length 256 and 0 */
    put_hdr(h, MAGIC, VERSION, OP_GET, 256, 0);
    send_refused(fd, h, 12);
    fd = raw_connect_hello(port);
    put_hdr(h, MAGIC, VERSION, OP_GET, 0, 0);
    send_refused(fd, h, 12);

    fd = raw_connect_hello(port); /* ADD whose operand is not 8 bytes */
    put_hdr(h, MAGIC, VERSION, OP_ADD, 1, 4);
    memcpy(h + 12, "k1234", 5);
    send_refused(fd, h, 17);

    fd = raw_connect_hello(port); /* a truncated frame, then the peer closes */
    put_hdr(h, MAGIC, VERSION, OP_SET, 5, 100);
    memcpy(h + 12, "trunc", 5);
    raw_send(fd, h, 12 + 5 + 10);
    close(fd);
    check_store_works(port, "after-truncated");

    fd = raw_connect(port); /* a HELLO whose token is too long (256 bytes) or empty */
    put_hdr(h, MAGIC, VERSION, OP_HELLO, 0, 256);
    send_refused(fd, h, 12);
    fd = raw_connect(port);
    put_hdr(h, MAGIC, VERSION, OP_HELLO, 0, 0);
    send_refused(fd, h, 12);

    /* A valid raw SET is accepted: the test's idea of the format is the server's. */
    fd = raw_connect_hello(port);
    put_hdr(h, MAGIC, VERSION, OP_SET, 3, 2);
    memcpy(h + 12, "rawok", 5);
    raw_send(fd, h, 17);
    ck_assert(!closed_within(fd, 200));
    close(fd);
    char buf[8];
    size_t len;
    cpar_store *c = connect_client(port, 2000);
    ck_assert_int_eq(cpar_store_get(c, "raw", buf, sizeof buf, &len), CPAR_OK);
    ck_assert(len == 2 && memcmp(buf, "ok", 2) == 0);
    cpar_store_destroy(c);
    cpar_store_destroy(srv);
}
END_TEST

START_TEST(test_stalled_client)
{
    int port;
    cpar_store *srv = start_server(&port, 600); /* the stall limit is the store's timeout */
    unsigned char h[256] = {0};
    int stalled = raw_connect_hello(port);
    put_hdr(h, MAGIC, VERSION, OP_SET, 5, 1000);
    raw_send(stalled, h, 7); /* half a header, then nothing */
    int stalled_body = raw_connect_hello(port);
    memcpy(h + 12, "stall", 5);
    raw_send(stalled_body, h, 12 + 5 + 100); /* a header and part of its value */

    /* A reader that never reads its 1 MiB reply must not block anyone either. */
    size_t mib = (size_t)1 << 20;
    unsigned char *big = calloc(1, mib);
    cpar_store *c = connect_client(port, 2000);
    ck_assert_int_eq(cpar_store_set(c, "big", big, mib), CPAR_OK);
    free(big);
    int deaf = raw_connect_hello(port);
    put_hdr(h, MAGIC, VERSION, OP_GET, 3, 0);
    memcpy(h + 12, "big", 3);
    raw_send(deaf, h, 15);

    int64_t t0 = now_ms();
    check_store_works(port, "while-stalled"); /* served at once, not after the stalls */
    ck_assert_int_lt(now_ms() - t0, 300);

    ck_assert(closed_within(stalled, 3000));     /* dropped after ~600 ms without progress */
    ck_assert(closed_within(stalled_body, 3000));
    close(stalled);
    close(stalled_body);
    close(deaf);
    check_store_works(port, "after-stalled");
    cpar_store_destroy(c);
    cpar_store_destroy(srv);
}
END_TEST

typedef struct {
    int listen_fd;
    const char *reply; /* NULL: accept and close */
} fake_arg;

static void *fake_server(void *p)
{
    fake_arg *a = p;
    int fd = accept(a->listen_fd, NULL, NULL);
    if (fd >= 0) {
        char buf[64];
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (a->reply && !strcmp(a->reply, "ECHO")) /* what a socket connected to itself sees */
            (void)!send(fd, buf, n > 0 ? (size_t)n : 0, MSG_NOSIGNAL);
        else if (a->reply)
            (void)!send(fd, a->reply, strlen(a->reply), MSG_NOSIGNAL);
        sleep_ms(100);
        close(fd);
    }
    return NULL;
}

static int listen_on(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    ck_assert_int_eq(listen(fd, 8), 0);
    return fd;
}

START_TEST(test_not_a_store)
{
    const char *replies[] = {"HTTP/1.1 400 Bad Request\r\n\r\n", "ECHO", NULL};
    const char *expect[] = {"not a cpar store", "not a cpar store", "closed the connection at the handshake"};
    for (int i = 0; i < 3; i++) {
        int port = free_port();
        fake_arg a = {listen_on(port), replies[i]};
        pthread_t t;
        pthread_create(&t, NULL, fake_server, &a);
        cpar_store_config cfg = {.host = "127.0.0.1", .port = port, .timeout_ms = 2000};
        cpar_store *c = NULL;
        ck_assert_int_eq(cpar_store_create(&cfg, &c), CPAR_ERR_SYSTEM);
        ck_assert_ptr_null(c);
        ASSERT_MSG_HAS(expect[i]);
        pthread_join(t, NULL);
        close(a.listen_fd);
    }
}
END_TEST

/* ---- connection set-up errors ------------------------------------------- */

START_TEST(test_port_in_use)
{
    int port = free_port();
    int holder = listen_on(port);
    char portstr[16];
    snprintf(portstr, sizeof portstr, ":%d", port);
    const char *hosts[] = {"127.0.0.1", NULL};
    for (int i = 0; i < 2; i++) {
        cpar_store_config cfg = {.host = hosts[i], .port = port, .is_server = true, .timeout_ms = 1000};
        cpar_store *s = NULL;
        ck_assert_int_eq(cpar_store_create(&cfg, &s), CPAR_ERR_SYSTEM);
        ck_assert_ptr_null(s);
        ASSERT_MSG_HAS(portstr);
        ASSERT_MSG_HAS("cpar_store_create: cannot listen on ");
        ASSERT_MSG_HAS("CPAR_STORE_PORT");
    }
    close(holder);
    /* Two cpar servers on one port: the second fails the same way. */
    int p2;
    cpar_store *first = start_server(&p2, 1000);
    cpar_store_config cfg = {.port = p2, .is_server = true, .timeout_ms = 1000};
    cpar_store *second = NULL;
    ck_assert_int_eq(cpar_store_create(&cfg, &second), CPAR_ERR_SYSTEM);
    ASSERT_MSG_HAS("in use");
    cpar_store_destroy(first);
}
END_TEST

START_TEST(test_no_server)
{
    int port = free_port();
    cpar_store_config cfg = {.host = "127.0.0.1", .port = port, .timeout_ms = 400};
    cpar_store *c = NULL;
    int64_t t0 = now_ms();
    ck_assert_int_eq(cpar_store_create(&cfg, &c), CPAR_ERR_TIMEOUT);
    int64_t dt = now_ms() - t0;
    ck_assert_ptr_null(c);
    ck_assert_int_ge(dt, 390);
    ck_assert_int_lt(dt, 2000);
    char where[64];
    snprintf(where, sizeof where, "no store at 127.0.0.1:%d after 400 ms", port);
    ASSERT_MSG_HAS(where);
    ASSERT_MSG_HAS("Connection refused");
}
END_TEST

/* No silent waits: while the store is not there, a WAIT line every
 * CPAR_WAIT_REPORT_S seconds says so and why it may be; CPAR_LOG=off
 * silences them. */
static int wait_lines(const char *path, const char *needle) {
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof line, f))
        if (strstr(line, " WAIT ") && strstr(line, needle)) n++;
    fclose(f);
    return n;
}

START_TEST(test_wait_reports)
{
    char log[] = "/tmp/cpar_waitlog_XXXXXX", needle[96];
    int fd = mkstemp(log);
    ck_assert_int_ge(fd, 0);
    close(fd);
    int port = free_port();
    snprintf(needle, sizeof needle, "cpar_store_create: no store at 127.0.0.1:%d yet", port);
    cpar_store_config cfg = {.host = "127.0.0.1", .port = port, .timeout_ms = 700};
    cpar_store *c = NULL;
    setenv("CPAR_WAIT_REPORT_S", "0.2", 1);
    setenv("CPAR_LOG_FILE", log, 1);
    unsetenv("CPAR_LOG");
    ck_assert_int_eq(cpar_store_create(&cfg, &c), CPAR_ERR_TIMEOUT);
    int n = wait_lines(log, needle);
    ck_assert_msg(n >= 2 && n <= 4, "%d WAIT lines naming the store in %s, expected 2-4", n, log);
    ck_assert_int_ge(wait_lines(log, "is rank 0 running"), 2);
    setenv("CPAR_LOG", "off", 1);
    ck_assert_int_eq(cpar_store_create(&cfg, &c), CPAR_ERR_TIMEOUT);
    ck_assert_int_eq(wait_lines(log, needle), n); /* none more */
    unsetenv("CPAR_LOG");
    unsetenv("CPAR_LOG_FILE");
    unsetenv("CPAR_WAIT_REPORT_S");
    remove(log);
}
END_TEST

static void *server_later(void *p)
{
    setter_arg *a = p;
    cpar_store_config cfg = {.host = "127.0.0.1", .port = a->port, .is_server = true, .timeout_ms = 5000};
    cpar_store *s = NULL;
    sleep_ms(a->delay_ms);
    if (cpar_store_create(&cfg, &s) == CPAR_OK) {
        cpar_store_set(s, "up", "1", 1);
        sleep_ms(300);
        cpar_store_destroy(s);
    } else {
        fprintf(stderr, "server_later: %s\n", cpar_thread_last_error());
    }
    return NULL;
}

/* A free port below the ephemeral range, so no retrying client can be given
 * it as its own source port (a self-connection) before the server binds. */
static int free_port_below_ephemeral(void)
{
    unsigned seed = (unsigned)getpid() ^ (unsigned)now_ms();
    for (int attempt = 0; attempt < 256; attempt++) {
        int port = 20000 + (int)(rand_r(&seed) % 12000u);
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        a.sin_port = htons((uint16_t)port);
        int ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
        if (fd >= 0)
            close(fd);
        if (ok)
            return port;
    }
    ck_abort_msg("no free port below 32000");
    return 0;
}

START_TEST(test_client_before_server)
{
    setter_arg a = {free_port_below_ephemeral(), 400};
    pthread_t t;
    pthread_create(&t, NULL, server_later, &a);
    cpar_store *c = connect_client(a.port, 5000); /* retries through ECONNREFUSED */
    char buf[4];
    ck_assert_int_eq(cpar_store_get(c, "up", buf, sizeof buf, NULL), CPAR_OK);
    cpar_store_destroy(c);
    pthread_join(t, NULL);
}
END_TEST

START_TEST(test_server_gone)
{
    int port;
    cpar_store *srv = start_server(&port, 300); /* destroy lingers at most 300 ms for c */
    cpar_store *c = connect_client(port, 2000);
    ck_assert_int_eq(cpar_store_set(c, "k", "v", 1), CPAR_OK);
    int64_t t0 = now_ms();
    cpar_store_destroy(srv);
    ck_assert_int_lt(now_ms() - t0, 1500);
    ck_assert_int_eq(cpar_store_set(c, "k", "v", 1), CPAR_ERR_PEER);
    ASSERT_MSG_HAS("closed the connection");
    ck_assert_int_eq(cpar_store_get(c, "k", NULL, 0, NULL), CPAR_ERR_PEER); /* fails fast from now on */
    ASSERT_MSG_HAS("failed earlier");
    cpar_store_destroy(c);
}
END_TEST

/* Many clients at once, each with its own keys. */
static void *busy_worker(void *p)
{
    rank_arg *a = p;
    cpar_store_config cfg = {.host = "127.0.0.1", .port = a->port, .timeout_ms = 10000};
    cpar_store *c = NULL;
    char key[32], val[32], back[32];
    a->st = cpar_store_create(&cfg, &c);
    for (int i = 0; i < 50 && a->st == CPAR_OK; i++) {
        size_t len = 0;
        snprintf(key, sizeof key, "w%d/%d", a->rank, i);
        int n = snprintf(val, sizeof val, "v%d.%d", a->rank, i);
        if ((a->st = cpar_store_set(c, key, val, (size_t)n)) == CPAR_OK &&
            (a->st = cpar_store_get(c, key, back, sizeof back, &len)) == CPAR_OK &&
            (len != (size_t)n || memcmp(val, back, len) != 0))
            a->early = true; /* reused as "wrong value" */
    }
    if (a->st == CPAR_OK)
        a->st = cpar_store_barrier(c, "busy", a->rank, a->nranks);
    if (a->st != CPAR_OK)
        snprintf(a->err, sizeof a->err, "%s", cpar_thread_last_error());
    cpar_store_destroy(c);
    return NULL;
}

START_TEST(test_many_clients)
{
    enum { T = 48 };
    int port;
    cpar_store *srv = start_server(&port, 10000);
    rank_arg a[T];
    pthread_t t[T];
    for (int i = 0; i < T; i++) {
        a[i] = (rank_arg){.port = port, .rank = i, .nranks = T};
        pthread_create(&t[i], NULL, busy_worker, &a[i]);
    }
    for (int i = 0; i < T; i++) {
        pthread_join(t[i], NULL);
        ck_assert_msg(a[i].st == CPAR_OK, "worker %d: %s", i, a[i].err);
        ck_assert_msg(!a[i].early, "worker %d read a wrong value", i);
    }
    cpar_store_destroy(srv);
}
END_TEST

/* ---- bad arguments ------------------------------------------------------ */

START_TEST(test_bad_args)
{
    cpar_store *s = NULL;
    cpar_store_config cfg = {.host = "127.0.0.1", .port = 0};
    ck_assert_int_eq(cpar_store_create(NULL, &s), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_create: cfg is NULL");
    ck_assert_int_eq(cpar_store_create(&cfg, NULL), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_create: out is NULL");
    ck_assert_int_eq(cpar_store_create(&cfg, &s), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cfg->port is 0, expected 1..65535");
    cfg.port = 70000;
    ck_assert_int_eq(cpar_store_create(&cfg, &s), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cfg->port is 70000");
    cfg.port = 1234;
    cfg.timeout_ms = -1;
    ck_assert_int_eq(cpar_store_create(&cfg, &s), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cfg->timeout_ms is -1");
    ck_assert_ptr_null(s);
    ck_assert_int_eq(cpar_store_destroy(NULL), CPAR_OK);

    char buf[8], longkey[300];
    memset(longkey, 'k', sizeof longkey - 1);
    longkey[sizeof longkey - 1] = '\0';
    ck_assert_int_eq(cpar_store_set(NULL, "k", "v", 1), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_set: s is NULL");

    int port;
    s = start_server(&port, 2000);
    ck_assert_int_eq(cpar_store_set(s, NULL, "v", 1), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_set: key is NULL");
    ck_assert_int_eq(cpar_store_set(s, "", "v", 1), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("key is empty");
    ck_assert_int_eq(cpar_store_set(s, longkey, "v", 1), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("key is 299 bytes, expected at most 255");
    longkey[255] = '\0'; /* exactly 255 is fine */
    ck_assert_int_eq(cpar_store_set(s, longkey, "v", 1), CPAR_OK);
    ck_assert_int_eq(cpar_store_get(s, longkey, buf, sizeof buf, NULL), CPAR_OK);
    ck_assert_int_eq(cpar_store_set(s, "k", NULL, 3), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_set: value is NULL with len 3");
    ck_assert_int_eq(cpar_store_get(NULL, "k", buf, sizeof buf, NULL), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_get: s is NULL");
    ck_assert_int_eq(cpar_store_get(s, NULL, buf, sizeof buf, NULL), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_get: key is NULL");
    ck_assert_int_eq(cpar_store_get(s, "k", NULL, 8, NULL), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_get: value is NULL with cap 8");
    ck_assert_int_eq(cpar_store_add(NULL, "k", 1, NULL), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_add: s is NULL");
    ck_assert_int_eq(cpar_store_add(s, NULL, 1, NULL), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_add: key is NULL");
    ck_assert_int_eq(cpar_store_barrier(NULL, "b", 0, 1), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_barrier: s is NULL");
    ck_assert_int_eq(cpar_store_barrier(s, NULL, 0, 1), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_barrier: name is NULL");
    ck_assert_int_eq(cpar_store_barrier(s, "b", 4, 4), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("rank is 4, expected 0..3");
    ck_assert_int_eq(cpar_store_barrier(s, "b", -1, 4), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("rank is -1");
    ck_assert_int_eq(cpar_store_barrier(s, "b", 0, 0), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("nranks is 0");
    ck_assert_int_eq(cpar_store_barrier(s, longkey, 0, 1), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("name is 255 bytes");
    cpar_store_destroy(s);
}
END_TEST

/* ---- launch environment ------------------------------------------------- */

static const char *const env_vars[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                       "MASTER_PORT", "CPAR_STORE_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                                       "SLURM_NPROCS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
                                       "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_STEP_NUM_NODES",
                                       "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
                                       "SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "CPAR_STORE_BIND"};

static void env_clear(void)
{
    for (size_t i = 0; i < sizeof env_vars / sizeof *env_vars; i++)
        unsetenv(env_vars[i]);
}

/* setenv from "NAME=value" pairs, NULL-terminated. */
static void env_set(const char *const *kv)
{
    env_clear();
    for (; *kv; kv++) {
        char name[64];
        const char *eq = strchr(*kv, '=');
        snprintf(name, sizeof name, "%.*s", (int)(eq - *kv), *kv);
        setenv(name, eq + 1, 1);
    }
}

START_TEST(test_env_default)
{
    cpar_env e;
    env_clear();
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.source, "default");
    ck_assert(e.rank == 0 && e.world_size == 1 && e.local_rank == 0 && e.local_world_size == 1);
    ck_assert_str_eq(e.master_addr, "127.0.0.1");
    ck_assert_int_eq(e.master_port, 29500);
    ck_assert_int_eq(e.store_port, 29501);
    ck_assert_int_eq(cpar_env_read(NULL), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_env_read: out is NULL");
}
END_TEST

START_TEST(test_env_torchrun)
{
    cpar_env e;
    env_set((const char *const[]){"RANK=5", "WORLD_SIZE=8", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=4",
                                  "MASTER_ADDR=node17.cluster", "MASTER_PORT=12345",
                                  "SLURM_PROCID=0", "SLURM_NTASKS=2", NULL}); /* torchrun wins */
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.source, "torchrun");
    ck_assert(e.rank == 5 && e.world_size == 8 && e.local_rank == 1 && e.local_world_size == 4);
    ck_assert_str_eq(e.master_addr, "node17.cluster");
    ck_assert_int_eq(e.master_port, 12345);
    ck_assert_int_eq(e.store_port, 12346);
    setenv("CPAR_STORE_PORT", "40000", 1);
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_int_eq(e.store_port, 40000);

    /* Without the local variables: one node holding every rank. */
    env_set((const char *const[]){"RANK=3", "WORLD_SIZE=4", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert(e.local_rank == 3 && e.local_world_size == 4);
    env_set((const char *const[]){"RANK=6", "WORLD_SIZE=8", "LOCAL_WORLD_SIZE=4", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_int_eq(e.local_rank, 2);
}
END_TEST

START_TEST(test_env_slurm)
{
    cpar_env e;
    env_set((const char *const[]){"SLURM_PROCID=6", "SLURM_NTASKS=8", "SLURM_LOCALID=2",
                                  "SLURM_NTASKS_PER_NODE=4(x2)", "SLURM_JOB_NODELIST=gpu[07-08]", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.source, "slurm");
    ck_assert(e.rank == 6 && e.world_size == 8 && e.local_rank == 2 && e.local_world_size == 4);
    ck_assert_str_eq(e.master_addr, "gpu07"); /* two nodes, no MASTER_ADDR: the node list's first */
    ck_assert_int_eq(e.store_port, 29501);
    env_set((const char *const[]){"SLURM_PROCID=1", "SLURM_NTASKS=4", "SLURM_NTASKS_PER_NODE=4", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.master_addr, "127.0.0.1"); /* one node: loopback */

    /* Uneven nodes: srun's SLURM_TASKS_PER_NODE, entry SLURM_NODEID. */
    env_set((const char *const[]){"SLURM_PROCID=6", "SLURM_NTASKS=7", "SLURM_LOCALID=0", "SLURM_NODEID=3",
                                  "SLURM_TASKS_PER_NODE=2(x3),1", "MASTER_ADDR=10.0.0.1", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert(e.rank == 6 && e.world_size == 7 && e.local_rank == 0 && e.local_world_size == 1);
    ck_assert_str_eq(e.master_addr, "10.0.0.1");
    env_set((const char *const[]){"SLURM_PROCID=1", "SLURM_NPROCS=2", "SLURM_LOCALID=1", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert(e.world_size == 2 && e.local_world_size == 2);
}
END_TEST

typedef struct {
    const char *vars[8];
    const char *expect;
} env_bad_case;

START_TEST(test_env_malformed)
{
    static const env_bad_case cases[] = {
        {{"RANK=abc", "WORLD_SIZE=4"}, "RANK=\"abc\" is not an integer"},
        {{"RANK= 1", "WORLD_SIZE=4"}, "RANK=\" 1\" is not an integer"},
        {{"RANK=1x", "WORLD_SIZE=4"}, "RANK=\"1x\" is not an integer"},
        {{"RANK=", "WORLD_SIZE=4"}, "RANK=\"\" is not an integer"},
        {{"RANK=+1", "WORLD_SIZE=4"}, "RANK=\"+1\" is not an integer"},
        {{"RANK=99999999999999999999", "WORLD_SIZE=4"}, "is not an integer"},
        {{"RANK=-1", "WORLD_SIZE=4"}, "RANK=-1 is out of range"},
        {{"RANK=5", "WORLD_SIZE=4"}, "cpar_env_read: RANK=5 is not below WORLD_SIZE=4"},
        {{"RANK=0", "WORLD_SIZE=0"}, "WORLD_SIZE=0 is out of range"},
        {{"RANK=1"}, "RANK is set but WORLD_SIZE is not"},
        {{"WORLD_SIZE=2"}, "WORLD_SIZE is set but RANK is not"},
        {{"RANK=1", "WORLD_SIZE=4", "LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"},
         "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"},
        {{"RANK=1", "WORLD_SIZE=4", "LOCAL_WORLD_SIZE=8"}, "LOCAL_WORLD_SIZE=8 is larger than WORLD_SIZE=4"},
        {{"RANK=1", "WORLD_SIZE=4", "LOCAL_RANK=4"}, "LOCAL_RANK=4 is not below WORLD_SIZE=4"},
        {{"MASTER_PORT=70000"}, "MASTER_PORT=70000 is out of range, expected 1..65535"},
        {{"MASTER_PORT=0"}, "MASTER_PORT=0 is out of range"},
        {{"MASTER_PORT=port"}, "MASTER_PORT=\"port\" is not an integer"},
        {{"MASTER_PORT=65535"}, "MASTER_PORT=65535 leaves no port for the store"},
        {{"CPAR_STORE_PORT=0"}, "CPAR_STORE_PORT=0 is out of range"},
        {{"MASTER_ADDR="}, "MASTER_ADDR is empty"},
        {{"SLURM_PROCID=0"}, "SLURM_PROCID is set but SLURM_NTASKS is not"},
        {{"SLURM_PROCID=4", "SLURM_NTASKS=4"}, "SLURM_PROCID=4 is not below SLURM_NTASKS=4"},
        {{"SLURM_PROCID=0", "SLURM_NTASKS=4", "SLURM_LOCALID=x"}, "SLURM_LOCALID=\"x\" is not an integer"},
        {{"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_NTASKS_PER_NODE=4(x"},
         "SLURM_NTASKS_PER_NODE=\"4(x\" is not a task list"},
        {{"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_NTASKS_PER_NODE=4"},
         "spans several nodes, but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set: export MASTER_ADDR="},
        {{"SLURM_PROCID=0", "SLURM_NTASKS=2", "SLURM_STEP_NUM_NODES=2"}, "neither MASTER_ADDR nor"},
        {{"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_NTASKS_PER_NODE=4", "SLURM_JOB_NODELIST=node[04-01]"},
         "SLURM_JOB_NODELIST=\"node[04-01]\" is not a node list like \"node[01-04,07]\" and MASTER_ADDR is not set"},
        {{"CPAR_STORE_BIND="}, "CPAR_STORE_BIND is 0 characters"},
        {{"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_TASKS_PER_NODE=4(x2)", "SLURM_NODEID=2", "MASTER_ADDR=h"},
         "SLURM_TASKS_PER_NODE=\"4(x2)\" is not a task list like \"4(x2),3\" with an entry for node 2"},
        {{"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_TASKS_PER_NODE=4,,4"}, "is not a task list"},
        {{"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_LOCALID=3", "SLURM_NTASKS_PER_NODE=2", "MASTER_ADDR=h"},
         "SLURM_LOCALID=3 is not below SLURM_NTASKS_PER_NODE=2"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const char *kv[9] = {0};
        for (int j = 0; j < 8 && cases[i].vars[j]; j++)
            kv[j] = cases[i].vars[j];
        env_set(kv);
        cpar_env e = {.rank = 42};
        ck_assert_msg(cpar_env_read(&e) == CPAR_ERR_INVALID, "case %zu (%s) was accepted", i, cases[i].expect);
        ck_assert_msg(strstr(cpar_thread_last_error(), cases[i].expect) != NULL, "case %zu: \"%s\" lacks \"%s\"", i,
                      cpar_thread_last_error(), cases[i].expect);
        ck_assert_msg(strncmp(cpar_thread_last_error(), "cpar_env_read: ", 15) == 0, "%s", cpar_thread_last_error());
        ck_assert_int_eq(e.rank, 42); /* *out untouched on failure */
    }
}
END_TEST

/* ---- job token ---------------------------------------------------------- */

static cpar_store *start_server_token(int *port, int timeout_ms, const char *token)
{
    for (int attempt = 0; attempt < 20; attempt++) {
        *port = free_port();
        cpar_store_config cfg = {.port = *port, .is_server = true, .timeout_ms = timeout_ms, .token = token};
        cpar_store *s = NULL;
        if (cpar_store_create(&cfg, &s) == CPAR_OK)
            return s;
        ck_assert_msg(strstr(cpar_thread_last_error(), "in use") != NULL, "server: %s", cpar_thread_last_error());
    }
    ck_abort_msg("no free port after 20 attempts");
    return NULL;
}

/* The host of the store hears of a refused client at once (a WARN line) and
 * its barrier's timeout names the refusal: a rank started with another job
 * token is otherwise just "missing". */
START_TEST(test_token_refusal_reported)
{
    int port;
    cpar_store *srv = start_server_token(&port, 400, "job-A");
    cpar_store_config other = {.host = "127.0.0.1", .port = port, .timeout_ms = 400, .token = "job-B"};
    cpar_store *c = NULL;
    setenv("RANK", "1", 1); /* what a launcher sets: the client shows it after its token */
    ck_assert_int_eq(cpar_store_create(&other, &c), CPAR_ERR_SYSTEM);
    unsetenv("RANK");
    ck_assert_int_eq(cpar_store_barrier(srv, "start", 0, 2), CPAR_ERR_TIMEOUT);
    ASSERT_MSG_HAS("rank 1 of 2 missing; the store refused 1 client with another job token (the last from rank 1 "
                   "at 127.0.0.1:");
    ASSERT_MSG_HAS("started with another CPAR_JOB_TOKEN?");
    cpar_store_destroy(srv);
}
END_TEST

START_TEST(test_token_mismatch)
{
    int port;
    cpar_store *srv = start_server_token(&port, 5000, "job-A");
    ck_assert_int_eq(cpar_store_set(srv, "cpar/nccl_id/world", "secret", 6), CPAR_OK);

    /* Another job's client: refused at once (not after its 5 s deadline), clearly. */
    cpar_store_config other = {.host = "127.0.0.1", .port = port, .timeout_ms = 5000, .token = "job-B"};
    cpar_store *c = NULL;
    int64_t t0 = now_ms();
    ck_assert_int_eq(cpar_store_create(&other, &c), CPAR_ERR_SYSTEM);
    ck_assert_int_lt(now_ms() - t0, 2500); /* half the deadline: slack for a loaded machine */
    ck_assert_ptr_null(c);
    char want[128];
    snprintf(want, sizeof want, "cpar_store_create: the store at 127.0.0.1:%d belongs to another job", port);
    ASSERT_MSG_HAS(want);
    other.token = "job-A-"; /* a prefix or an extension is another token too */
    ck_assert_int_eq(cpar_store_create(&other, &c), CPAR_ERR_SYSTEM);
    other.token = "job-";
    ck_assert_int_eq(cpar_store_create(&other, &c), CPAR_ERR_SYSTEM);
    ASSERT_MSG_HAS("belongs to another job");

    /* Raw: a wrong token pipelined with a SET is denied and closed, the SET never runs. */
    unsigned char h[512], r[64];
    int fd = raw_connect(port);
    put_hdr(h, MAGIC, VERSION, OP_HELLO, 0, 5);
    memcpy(h + 12, "job-B", 5);
    put_hdr(h + 17, MAGIC, VERSION, OP_SET, 4, 1);
    memcpy(h + 29, "evilx", 5);
    raw_send(fd, h, 34);
    ck_assert(recv_exact(fd, r, 12, 2000));
    ck_assert_int_eq(r[5], 0x80 | ST_DENIED);
    ck_assert(closed_within(fd, 2000));
    close(fd);
    /* No HELLO at all: a GET of the NCCL id is dropped without a reply. */
    fd = raw_connect(port);
    put_hdr(h, MAGIC, VERSION, OP_GET, 18, 0);
    memcpy(h + 12, "cpar/nccl_id/world", 18);
    raw_send(fd, h, 30);
    ck_assert(!recv_exact(fd, r, 12, 2000)); /* EOF, no header */
    close(fd);
    fd = raw_connect(port); /* nor a SET */
    put_hdr(h, MAGIC, VERSION, OP_SET, 4, 1);
    memcpy(h + 12, "evily", 5);
    raw_send(fd, h, 17);
    ck_assert(closed_within(fd, 2000));
    close(fd);

    /* The owner's job is unaffected, and saw none of those keys. */
    cpar_store_config mine = {.host = "127.0.0.1", .port = port, .timeout_ms = 300, .token = "job-A"};
    ck_assert_int_eq(cpar_store_create(&mine, &c), CPAR_OK);
    char buf[16];
    size_t len = 0;
    ck_assert_int_eq(cpar_store_get(c, "cpar/nccl_id/world", buf, sizeof buf, &len), CPAR_OK);
    ck_assert(len == 6 && !memcmp(buf, "secret", 6));
    ck_assert_int_eq(cpar_store_get(c, "evil", buf, sizeof buf, NULL), CPAR_ERR_TIMEOUT);
    cpar_store_destroy(c);
    cpar_store_destroy(srv);
}
END_TEST

START_TEST(test_token_from_env)
{
    cpar_env e;
    env_clear();
    unsetenv("CPAR_JOB_TOKEN");
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.job_token_source, "none"); /* no default token */
    ck_assert_str_eq(e.job_token, "");
    setenv("TORCHELASTIC_RUN_ID", "none", 1); /* torchrun's default id says nothing */
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.job_token_source, "none");
    /* ... and a store without one refuses to start, server or client, saying what to set */
    for (int server = 1; server >= 0; server--) {
        cpar_store_config nc = {.host = "127.0.0.1", .port = 1, .is_server = server, .timeout_ms = 2000};
        cpar_store *none = (cpar_store *)&e; /* must be overwritten */
        ck_assert_int_eq(cpar_store_create(&nc, &none), CPAR_ERR_INVALID);
        ck_assert_ptr_null(none);
        ASSERT_MSG_HAS("cpar_store_create: no job token: ranks started by hand need CPAR_JOB_TOKEN");
        ASSERT_MSG_HAS("torchrun --standalone");
    }
    unsetenv("TORCHELASTIC_RUN_ID");
    setenv("SLURM_JOB_ID", "4711", 1);
    setenv("SLURM_STEP_ID", "2", 1);
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.job_token_source, "slurm");
    ck_assert_str_eq(e.job_token, "slurm:4711.2");
    setenv("SLURM_STEP_ID", "3", 1); /* another step of the allocation: another job */
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.job_token, "slurm:4711.3");
    setenv("TORCHELASTIC_RUN_ID", "none", 1); /* torchrun's default id says nothing */
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.job_token_source, "slurm");
    setenv("TORCHELASTIC_RUN_ID", "run-9", 1);
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.job_token, "torchelastic:run-9");
    setenv("CPAR_JOB_TOKEN", "0123abcd", 1);
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.job_token_source, "CPAR_JOB_TOKEN");
    ck_assert_str_eq(e.job_token, "0123abcd");
    setenv("CPAR_JOB_TOKEN", "", 1);
    ck_assert_int_eq(cpar_env_read(&e), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_env_read: CPAR_JOB_TOKEN is 0 bytes, expected 1..255");

    /* A store's token defaults to the environment's, on both sides. */
    setenv("CPAR_JOB_TOKEN", "env-token", 1);
    int port;
    cpar_store *srv = start_server(&port, 2000); /* cfg.token NULL */
    cpar_store_config cfg = {.host = "127.0.0.1", .port = port, .timeout_ms = 2000, .token = "env-token"};
    cpar_store *c = NULL;
    ck_assert_int_eq(cpar_store_create(&cfg, &c), CPAR_OK);
    cpar_store_destroy(c);
    setenv("CPAR_JOB_TOKEN", "other-env-token", 1);
    cfg.token = NULL;
    ck_assert_int_eq(cpar_store_create(&cfg, &c), CPAR_ERR_SYSTEM);
    ASSERT_MSG_HAS("belongs to another job");
    cpar_store_destroy(srv);
}
END_TEST

/* Two jobs meet on one port: the second's server cannot bind, its clients are
 * refused, and the first job goes on as if nothing happened. */
START_TEST(test_two_jobs_one_port)
{
    int port;
    cpar_store *a0 = start_server_token(&port, 5000, "job-A");
    cpar_store_config ca = {.host = "127.0.0.1", .port = port, .timeout_ms = 5000, .token = "job-A"};
    cpar_store *a1 = NULL;
    ck_assert_int_eq(cpar_store_create(&ca, &a1), CPAR_OK);
    ck_assert_int_eq(cpar_store_add(a1, "count", 1, NULL), CPAR_OK);

    cpar_store_config sb = {.port = port, .is_server = true, .timeout_ms = 5000, .token = "job-B"};
    cpar_store *b0 = NULL, *b1 = NULL;
    ck_assert_int_eq(cpar_store_create(&sb, &b0), CPAR_ERR_SYSTEM);
    ASSERT_MSG_HAS("in use");
    cpar_store_config cb = {.host = "127.0.0.1", .port = port, .timeout_ms = 5000, .token = "job-B"};
    int64_t t0 = now_ms();
    ck_assert_int_eq(cpar_store_create(&cb, &b1), CPAR_ERR_SYSTEM);
    ck_assert_int_lt(now_ms() - t0, 2500); /* half the deadline */
    ASSERT_MSG_HAS("belongs to another job");

    int64_t n = 0;
    ck_assert_int_eq(cpar_store_add(a0, "count", 1, &n), CPAR_OK);
    ck_assert_int_eq(n, 2); /* only job A's two adds */
    cpar_store_destroy(a1);
    cpar_store_destroy(a0);
}
END_TEST

/* ---- where the server listens -------------------------------------------- */


/* An IPv4 address of this host that is not loopback, or false. */
static bool non_loopback_ipv4(struct in_addr *out)
{
    struct ifaddrs *ifs = NULL;
    bool found = false;
    if (getifaddrs(&ifs) != 0)
        return false;
    for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next)
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET) {
            struct in_addr a = ((struct sockaddr_in *)(void *)i->ifa_addr)->sin_addr;
            if ((ntohl(a.s_addr) >> 24) != 127) {
                *out = a;
                found = true;
            }
        }
    freeifaddrs(ifs);
    return found;
}

/* 1 connected, 0 refused (or unreachable), to addr:port. */
static int try_connect(struct in_addr addr, int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port), .sin_addr = addr};
    int ok = connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

START_TEST(test_bind_address)
{
    if (access("/proc/net/tcp", R_OK) != 0)
        return; /* not Linux: the connect checks below need an address, the listing needs /proc */
    struct in_addr ext;
    bool has_ext = non_loopback_ipv4(&ext);
    char where[256];

    /* Default (host NULL), as for a single-node job: 127.0.0.1 only. */
    int port;
    cpar_store *srv = start_server_token(&port, 2000, TOKEN);
    tu_listening_on(port, where, sizeof where);
    ck_assert_msg(!strcmp(where, "0100007F"), "port %d listens on \"%s\", expected 127.0.0.1 only", port, where);
    if (has_ext)
        ck_assert_msg(!try_connect(ext, port), "the loopback store answered on %s", inet_ntoa(ext));
    cpar_store_destroy(srv);

    /* "*": every interface, when asked. */
    for (int attempt = 0; attempt < 20; attempt++) {
        port = free_port();
        cpar_store_config cfg = {.host = "*", .port = port, .is_server = true, .timeout_ms = 2000};
        if (cpar_store_create(&cfg, &srv) == CPAR_OK)
            break;
        srv = NULL;
    }
    ck_assert_ptr_nonnull(srv);
    tu_listening_on(port, where, sizeof where);
    ck_assert_msg(!strcmp(where, "00000000") || !strcmp(where, "00000000000000000000000000000000"),
                  "\"*\" listens on \"%s\"", where);
    if (has_ext)
        ck_assert(try_connect(ext, port));
    cpar_store_destroy(srv);

    /* An address of another host cannot be bound: a clear error, at once. */
    cpar_store_config bad = {.host = "192.0.2.1", .port = free_port(), .is_server = true, .timeout_ms = 2000};
    ck_assert_int_eq(cpar_store_create(&bad, &srv), CPAR_ERR_SYSTEM);
    ASSERT_MSG_HAS("cannot listen on 192.0.2.1:");
    ASSERT_MSG_HAS("CPAR_STORE_BIND=*");
}
END_TEST

START_TEST(test_env_store_bind)
{
    cpar_env e;
    env_clear();
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.store_bind, "127.0.0.1"); /* single node: loopback */
    env_set((const char *const[]){"RANK=0", "WORLD_SIZE=8", "LOCAL_WORLD_SIZE=4", "MASTER_ADDR=10.1.2.3", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.store_bind, "10.1.2.3"); /* the interface of MASTER_ADDR */
    env_set((const char *const[]){"RANK=0", "WORLD_SIZE=8", "LOCAL_WORLD_SIZE=4", "MASTER_ADDR=127.0.1.1", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.store_bind, "*"); /* several nodes, loopback name: others could not reach it */
    env_set((const char *const[]){"RANK=0", "WORLD_SIZE=4", "MASTER_ADDR=localhost", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.store_bind, "localhost"); /* one node: stays loopback */
    env_set((const char *const[]){"RANK=0", "WORLD_SIZE=4", "CPAR_STORE_BIND=*", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.store_bind, "*");
    env_set((const char *const[]){"RANK=0", "WORLD_SIZE=8", "LOCAL_WORLD_SIZE=4", "MASTER_ADDR=127.0.1.1",
                                  "CPAR_STORE_BIND=127.0.0.1", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.store_bind, "127.0.0.1"); /* asked for: obeyed */
}
END_TEST

/* ---- per-connection limits ------------------------------------------------ */

START_TEST(test_limits)
{
    int port = 0;
    cpar_store *srv = NULL;
    for (int attempt = 0; attempt < 20 && !srv; attempt++) {
        port = free_port();
        cpar_store_config cfg = {.port = port, .is_server = true, .timeout_ms = 5000, .max_value_bytes = 1000,
                                 .max_keys_per_client = 5, .max_bytes_per_client = 2500};
        if (cpar_store_create(&cfg, &srv) != CPAR_OK)
            srv = NULL;
    }
    ck_assert_ptr_nonnull(srv);
    cpar_store *c = connect_client(port, 5000), *d = connect_client(port, 5000);
    char val[1001], buf[1001], key[16];
    memset(val, 'v', sizeof val);
    size_t len = 0;

    ck_assert_int_eq(cpar_store_set(c, "big", val, 1001), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_set: value of key \"big\" is 1001 bytes, more than the limit");
    ASSERT_MSG_HAS("max_value_bytes=1000");
    ck_assert_int_eq(cpar_store_set(c, "k0", val, 1000), CPAR_OK); /* still usable; exactly the limit is fine */
    ck_assert_int_eq(cpar_store_set(c, "k1", val, 1000), CPAR_OK);
    ck_assert_int_eq(cpar_store_set(c, "k2", val, 600), CPAR_ERR_INVALID); /* 2600 > 2500 */
    ASSERT_MSG_HAS("max_bytes_per_client=2500");
    ck_assert_int_eq(cpar_store_set(c, "k1", val, 100), CPAR_OK); /* shrinking gives room back */
    ck_assert_int_eq(cpar_store_set(c, "k2", val, 600), CPAR_OK);
    ck_assert_int_eq(cpar_store_set(c, "k0", val, 1000), CPAR_OK); /* an overwrite of the same size: no growth */
    for (int i = 3; i < 5; i++) {
        snprintf(key, sizeof key, "k%d", i);
        ck_assert_int_eq(cpar_store_set(c, key, "x", 1), CPAR_OK);
    }
    ck_assert_int_eq(cpar_store_set(c, "k5", "x", 1), CPAR_ERR_INVALID); /* a sixth key */
    ASSERT_MSG_HAS("cannot create key \"k5\"");
    ASSERT_MSG_HAS("max_keys_per_client=5");
    ck_assert_int_eq(cpar_store_add(c, "ctr", 1, NULL), CPAR_ERR_INVALID); /* ADD creates keys too */
    ASSERT_MSG_HAS("max_keys_per_client=5");
    ck_assert_int_eq(cpar_store_set(c, "k4", "yy", 2), CPAR_OK); /* existing keys stay writable */
    ck_assert_int_eq(cpar_store_get(c, "k0", buf, sizeof buf, &len), CPAR_OK);
    ck_assert_uint_eq(len, 1000);
    cpar_store *e = connect_client(port, 200);
    ck_assert_int_eq(cpar_store_get(e, "k5", buf, 0, NULL), CPAR_ERR_TIMEOUT); /* never created */
    cpar_store_destroy(e);
    /* Another client has its own budget. */
    ck_assert_int_eq(cpar_store_set(d, "d0", val, 1000), CPAR_OK);
    ck_assert_int_eq(cpar_store_add(d, "ctr", 1, NULL), CPAR_OK);
    cpar_store_destroy(d);
    cpar_store_destroy(c);
    cpar_store_destroy(srv);
}
END_TEST

static int open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (!d)
        return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

/* Idle connections (no token shown) are held only max_idle_conns at a time
 * and dropped after the handshake deadline; a real client still gets in. */
START_TEST(test_idle_conns)
{
    enum { IDLE = 24, MAX_IDLE = 4 };
    if (open_fds() < 0)
        return;
    int port = 0;
    cpar_store *srv = NULL;
    for (int attempt = 0; attempt < 20 && !srv; attempt++) {
        port = free_port();
        cpar_store_config cfg = {.port = port, .is_server = true, .timeout_ms = 300, .max_idle_conns = MAX_IDLE};
        if (cpar_store_create(&cfg, &srv) != CPAR_OK)
            srv = NULL;
    }
    ck_assert_ptr_nonnull(srv);
    int before = open_fds(), fds[IDLE];
    for (int i = 0; i < IDLE; i++)
        fds[i] = raw_connect(port);
    sleep_ms(100);
    int held = open_fds() - before - IDLE; /* the server's side of our idle connections */
    ck_assert_msg(held <= MAX_IDLE, "the server holds %d idle connections, at most %d expected", held, MAX_IDLE);
    cpar_store *c = connect_client(port, 10000); /* waits its turn behind the idle ones */
    ck_assert_int_eq(cpar_store_set(c, "k", "v", 1), CPAR_OK);
    for (int i = 0; i < IDLE; i++) {
        ck_assert_msg(closed_within(fds[i], 8000), "idle connection %d was not dropped", i);
        close(fds[i]);
    }
    ck_assert_int_eq(cpar_store_set(c, "k", "w", 1), CPAR_OK); /* a client that showed its token stays */
    cpar_store_destroy(c);
    cpar_store_destroy(srv);
}
END_TEST

/* ---- join: registration and the start barrier ------------------------------ */

typedef struct {
    int port, rank, world, timeout_ms;
    cpar_status st;
    char err[512];
} join_arg;

static void *join_worker(void *p)
{
    join_arg *a = p;
    cpar_store_config cfg = {.host = "127.0.0.1", .port = a->port, .timeout_ms = a->timeout_ms};
    cpar_store *c = NULL;
    a->st = cpar_store_create(&cfg, &c);
    if (a->st == CPAR_OK) {
        cpar_env env = {.rank = a->rank, .world_size = a->world, .local_rank = a->rank};
        a->st = cpar_store_join(c, &env);
    }
    if (a->st != CPAR_OK)
        snprintf(a->err, sizeof a->err, "%s", cpar_thread_last_error());
    cpar_store_destroy(c);
    return NULL;
}

/* Ranks ranks[i] with world sizes worlds[i] join one store; every one must
 * end with want (and, when failing, a message containing expect). Rank 0
 * starts first, as the host of the store does. */
static void run_join(int n, const int *ranks, const int *worlds, cpar_status want, const char *expect)
{
    int port;
    cpar_store *srv = start_server(&port, 10000);
    join_arg a[8];
    pthread_t t[8];
    int64_t t0 = now_ms();
    for (int i = 0; i < n; i++) {
        a[i] = (join_arg){.port = port, .rank = ranks[i], .world = worlds[i], .timeout_ms = 8000};
        pthread_create(&t[i], NULL, join_worker, &a[i]);
        if (i == 0)
            sleep_ms(50);
    }
    for (int i = 0; i < n; i++) {
        pthread_join(t[i], NULL);
        ck_assert_msg(a[i].st == want, "member %d (rank %d): status %d, %s", i, ranks[i], a[i].st, a[i].err);
        if (expect)
            ck_assert_msg(strstr(a[i].err, expect) != NULL, "member %d: \"%s\" lacks \"%s\"", i, a[i].err, expect);
    }
    ck_assert_int_lt(now_ms() - t0, 4000); /* well before the 8 s deadline */
    cpar_store_destroy(srv);
}

START_TEST(test_join)
{
    run_join(4, (const int[]){0, 1, 2, 3}, (const int[]){4, 4, 4, 4}, CPAR_OK, NULL);
}
END_TEST

START_TEST(test_join_duplicate_rank)
{
    char expect[160];
    snprintf(expect, sizeof expect, "cpar_store_join: rank 2 (pid %ld on host ", (long)getpid());
    run_join(4, (const int[]){0, 1, 2, 2}, (const int[]){4, 4, 4, 4}, CPAR_ERR_INVALID, expect);
    run_join(4, (const int[]){0, 1, 2, 2}, (const int[]){4, 4, 4, 4}, CPAR_ERR_INVALID, ") both claim rank 2");
    run_join(3, (const int[]){0, 0, 1}, (const int[]){3, 3, 3}, CPAR_ERR_INVALID, "both claim rank 0");
}
END_TEST

START_TEST(test_join_world_mismatch)
{
    /* One rank says 4, the others 3 (and 3 ranks came): every one fails, naming both. */
    run_join(3, (const int[]){0, 1, 2}, (const int[]){3, 3, 4}, CPAR_ERR_INVALID,
             "has world size 3 but rank 2 (pid ");
    /* Rank 0 is the odd one. */
    run_join(3, (const int[]){0, 1, 2}, (const int[]){4, 3, 3}, CPAR_ERR_INVALID, "rank 0 (pid ");
    run_join(3, (const int[]){0, 1, 2}, (const int[]){4, 3, 3}, CPAR_ERR_INVALID, "has world size 4 but rank ");
}
END_TEST

START_TEST(test_join_missing_rank)
{
    int port;
    cpar_store *srv = start_server(&port, 10000);
    join_arg a[2];
    pthread_t t[2];
    for (int i = 0; i < 2; i++) {
        a[i] = (join_arg){.port = port, .rank = i, .world = 3, .timeout_ms = 500};
        pthread_create(&t[i], NULL, join_worker, &a[i]);
    }
    for (int i = 0; i < 2; i++) {
        pthread_join(t[i], NULL);
        ck_assert_int_eq(a[i].st, CPAR_ERR_TIMEOUT);
        ck_assert_msg(strstr(a[i].err, "cpar_store_join: barrier \"cpar/join\" timed out after 500 ms: rank 2 of 3 "
                                       "missing"), "%s", a[i].err);
    }
    cpar_env env = {.rank = 0, .world_size = 1};
    ck_assert_int_eq(cpar_store_join(NULL, &env), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_join: s is NULL");
    ck_assert_int_eq(cpar_store_join(srv, NULL), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_join: env is NULL");
    env.rank = 1;
    ck_assert_int_eq(cpar_store_join(srv, &env), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("cpar_store_join: env->rank is 1, expected 0..0 (world_size=1)");
    env.rank = 0, env.world_size = 0;
    ck_assert_int_eq(cpar_store_join(srv, &env), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("env->world_size is 0");
    env.world_size = 1, env.local_rank = -1;
    ck_assert_int_eq(cpar_store_join(srv, &env), CPAR_ERR_INVALID);
    ASSERT_MSG_HAS("env->local_rank is -1");
    cpar_store_destroy(srv);
}
END_TEST

/* ---- SLURM node lists ------------------------------------------------------ */

START_TEST(test_env_slurm_nodelist)
{
    static const struct {
        const char *list, *first; /* first NULL: malformed */
    } cases[] = {
        {"node01", "node01"},
        {"node[01-04,07]", "node01"},
        {"node[07,01-04]", "node07"},
        {"a1,b[2-3]", "a1"},
        {"b[2-3],a1", "b2"},
        {"gpu[001-128]", "gpu001"},
        {"rack[1-2]-node[08-09]", "rack1-node08"},
        {"n[5]", "n5"},
        {"login.cluster-x_1", "login.cluster-x_1"},
        {"", NULL},
        {"node[", NULL},
        {"node[1-", NULL},
        {"node[]", NULL},
        {"node[3-1]", NULL},
        {"node[1,]", NULL},
        {"node1]", NULL},
        {"a,,b", NULL},
        {"a,", NULL},
        {",a", NULL},
        {"node 1", NULL},
        {"node[1-2]x[", NULL},
        {"n[a-b]", NULL},
        {"n[1-9999999999999999999]", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char var[300];
        snprintf(var, sizeof var, "SLURM_JOB_NODELIST=%s", cases[i].list);
        env_set((const char *const[]){"SLURM_PROCID=3", "SLURM_NTASKS=8", "SLURM_NTASKS_PER_NODE=4", var, NULL});
        cpar_env e;
        cpar_status st = cpar_env_read(&e);
        if (cases[i].first) {
            ck_assert_msg(st == CPAR_OK, "\"%s\": %s", cases[i].list, cpar_thread_last_error());
            ck_assert_msg(!strcmp(e.master_addr, cases[i].first), "\"%s\" gave \"%s\", expected \"%s\"",
                          cases[i].list, e.master_addr, cases[i].first);
        } else {
            ck_assert_msg(st == CPAR_ERR_INVALID, "\"%s\" was accepted (\"%s\")", cases[i].list, e.master_addr);
            ASSERT_MSG_HAS("is not a node list like");
            ASSERT_MSG_HAS("export MASTER_ADDR=");
        }
    }
    /* The step's own list wins over the job's; MASTER_ADDR wins over both;
     * one node needs no list; SLURM_STEP_NUM_NODES decides when present. */
    env_set((const char *const[]){"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_NTASKS_PER_NODE=4",
                                  "SLURM_JOB_NODELIST=a[1-4]", "SLURM_STEP_NODELIST=a[3-4]", NULL});
    cpar_env e;
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.master_addr, "a3");
    setenv("MASTER_ADDR", "10.0.0.9", 1);
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.master_addr, "10.0.0.9");
    env_set((const char *const[]){"SLURM_PROCID=0", "SLURM_NTASKS=2", "SLURM_JOB_NODELIST=a[1-4]", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.master_addr, "127.0.0.1");
    env_set((const char *const[]){"SLURM_PROCID=0", "SLURM_NTASKS=2", "SLURM_STEP_NUM_NODES=2",
                                  "SLURM_NODELIST=z[9-10]", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.master_addr, "z9");
    char longlist[400];
    memset(longlist, 'n', sizeof longlist - 1);
    longlist[sizeof longlist - 1] = '\0';
    setenv("SLURM_NODELIST", longlist, 1); /* a host name longer than master_addr holds */
    ck_assert_int_eq(cpar_env_read(&e), CPAR_ERR_INVALID);
}
END_TEST

static Suite *store_suite(void)
{
    Suite *s = suite_create("store");
    TCase *basic = tcase_create("basic");
    tcase_set_timeout(basic, 20);
    tcase_add_test(basic, test_set_get_add);
    tcase_add_test(basic, test_value_sizes);
    tcase_add_test(basic, test_get_waits);
    tcase_add_test(basic, test_get_timeout);
    tcase_add_test(basic, test_add_concurrent);
    tcase_add_test(basic, test_many_clients);
    tcase_add_test(basic, test_bad_args);
    suite_add_tcase(s, basic);

    TCase *barrier = tcase_create("barrier");
    tcase_set_timeout(barrier, 20);
    tcase_add_test(barrier, test_barrier);
    tcase_add_test(barrier, test_barrier_missing_rank);
    tcase_add_test(barrier, test_barrier_missing_ranks);
    suite_add_tcase(s, barrier);

    TCase *faults = tcase_create("faults");
    tcase_set_timeout(faults, 20);
    tcase_add_test(faults, test_garbage_frames);
    tcase_add_test(faults, test_stalled_client);
    tcase_add_test(faults, test_not_a_store);
    tcase_add_test(faults, test_port_in_use);
    tcase_add_test(faults, test_no_server);
    tcase_add_test(faults, test_wait_reports);
    tcase_add_test(faults, test_client_before_server);
    tcase_add_test(faults, test_server_gone);
    suite_add_tcase(s, faults);

    TCase *job = tcase_create("job");
    tcase_set_timeout(job, 30);
    tcase_add_test(job, test_token_mismatch);
    tcase_add_test(job, test_token_refusal_reported);
    tcase_add_test(job, test_token_from_env);
    tcase_add_test(job, test_two_jobs_one_port);
    tcase_add_test(job, test_bind_address);
    tcase_add_test(job, test_limits);
    tcase_add_test(job, test_idle_conns);
    tcase_add_test(job, test_join);
    tcase_add_test(job, test_join_duplicate_rank);
    tcase_add_test(job, test_join_world_mismatch);
    tcase_add_test(job, test_join_missing_rank);
    suite_add_tcase(s, job);

    TCase *env = tcase_create("env");
    tcase_set_timeout(env, 10);
    tcase_add_test(env, test_env_default);
    tcase_add_test(env, test_env_torchrun);
    tcase_add_test(env, test_env_slurm);
    tcase_add_test(env, test_env_malformed);
    tcase_add_test(env, test_env_store_bind);
    tcase_add_test(env, test_env_slurm_nodelist);
    suite_add_tcase(s, env);
    return s;
}

int main(void)
{
    /* One job token for every store of this suite unless a test says otherwise. */
    setenv("CPAR_JOB_TOKEN", TOKEN, 1);
    unsetenv("CPAR_STORE_BIND");
    return tu_run_suite(store_suite());
}
