/* tests/test_store.c — the rendezvous store and the launch environment.
 *
 * Everything runs in one process on 127.0.0.1: a server, client threads, and
 * raw sockets that misbehave on purpose. Ports are picked free by the kernel
 * (bind port 0), so suites may run in parallel. Worker threads never call
 * ck_assert: they record what they saw and the test's main thread checks. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* POSIX and Linux APIs under -std=c11, as in cpar.c */
#endif
#include "cpar.h"

#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
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
#define MAGIC 0x43505354u
enum { OP_PING = 1, OP_SET, OP_GET, OP_ADD };

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
    raw_send(fd, "GET / HTTP/1.1\r\nHost: x\r\n\r\n", 27);
    ck_assert(closed_within(fd, 2000));
    close(fd);
    check_store_works(port, "after-garbage");

    fd = raw_connect(port); /* right magic, wrong version */
    put_hdr(h, MAGIC, 99, OP_PING, 0, 0);
    raw_send(fd, h, 12);
    ck_assert(closed_within(fd, 2000));
    close(fd);

    fd = raw_connect(port); /* unknown opcode */
    put_hdr(h, MAGIC, 1, 77, 1, 0);
    raw_send(fd, h, 12);
    ck_assert(closed_within(fd, 2000));
    close(fd);

    fd = raw_connect(port); /* value length field of 2 GiB: refused at the header */
    put_hdr(h, MAGIC, 1, OP_SET, 3, 0x80000000u);
    raw_send(fd, h, 12);
    ck_assert(closed_within(fd, 2000));
    close(fd);

    fd = raw_connect(port); /* 1 MiB + 1 */
    put_hdr(h, MAGIC, 1, OP_SET, 3, (1u << 20) + 1);
    raw_send(fd, h, 12);
    ck_assert(closed_within(fd, 2000));
    close(fd);

    fd = raw_connect(port); /* key length 256 and 0 */
    put_hdr(h, MAGIC, 1, OP_GET, 256, 0);
    raw_send(fd, h, 12);
    ck_assert(closed_within(fd, 2000));
    close(fd);
    fd = raw_connect(port);
    put_hdr(h, MAGIC, 1, OP_GET, 0, 0);
    raw_send(fd, h, 12);
    ck_assert(closed_within(fd, 2000));
    close(fd);

    fd = raw_connect(port); /* ADD whose operand is not 8 bytes */
    put_hdr(h, MAGIC, 1, OP_ADD, 1, 4);
    memcpy(h + 12, "k1234", 5);
    raw_send(fd, h, 17);
    ck_assert(closed_within(fd, 2000));
    close(fd);

    fd = raw_connect(port); /* a truncated frame, then the peer closes */
    put_hdr(h, MAGIC, 1, OP_SET, 5, 100);
    memcpy(h + 12, "trunc", 5);
    raw_send(fd, h, 12 + 5 + 10);
    close(fd);
    check_store_works(port, "after-truncated");

    /* A valid raw SET is accepted: the test's idea of the format is the server's. */
    fd = raw_connect(port);
    put_hdr(h, MAGIC, 1, OP_SET, 3, 2);
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
    int stalled = raw_connect(port);
    put_hdr(h, MAGIC, 1, OP_SET, 5, 1000);
    raw_send(stalled, h, 7); /* half a header, then nothing */
    int stalled_body = raw_connect(port);
    memcpy(h + 12, "stall", 5);
    raw_send(stalled_body, h, 12 + 5 + 100); /* a header and part of its value */

    /* A reader that never reads its 1 MiB reply must not block anyone either. */
    size_t mib = (size_t)1 << 20;
    unsigned char *big = calloc(1, mib);
    cpar_store *c = connect_client(port, 2000);
    ck_assert_int_eq(cpar_store_set(c, "big", big, mib), CPAR_OK);
    free(big);
    int deaf = raw_connect(port);
    put_hdr(h, MAGIC, 1, OP_GET, 3, 0);
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
                                       "SLURM_TASKS_PER_NODE", "SLURM_NODEID"};

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
                                  "SLURM_NTASKS_PER_NODE=4(x2)", NULL});
    ck_assert_int_eq(cpar_env_read(&e), CPAR_OK);
    ck_assert_str_eq(e.source, "slurm");
    ck_assert(e.rank == 6 && e.world_size == 8 && e.local_rank == 2 && e.local_world_size == 4);
    ck_assert_str_eq(e.master_addr, "127.0.0.1");
    ck_assert_int_eq(e.store_port, 29501);

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
        {{"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_TASKS_PER_NODE=4(x2)", "SLURM_NODEID=2"},
         "SLURM_TASKS_PER_NODE=\"4(x2)\" is not a task list like \"4(x2),3\" with an entry for node 2"},
        {{"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_TASKS_PER_NODE=4,,4"}, "is not a task list"},
        {{"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_LOCALID=3", "SLURM_NTASKS_PER_NODE=2"},
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
    tcase_add_test(faults, test_client_before_server);
    tcase_add_test(faults, test_server_gone);
    suite_add_tcase(s, faults);

    TCase *env = tcase_create("env");
    tcase_set_timeout(env, 10);
    tcase_add_test(env, test_env_default);
    tcase_add_test(env, test_env_torchrun);
    tcase_add_test(env, test_env_slurm);
    tcase_add_test(env, test_env_malformed);
    suite_add_tcase(s, env);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(store_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
