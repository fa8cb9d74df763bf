/* ==== N. Launch environment and rendezvous store ===========================
 * Defines cpar_env_read (torchrun, SLURM or single-rank variables) and the TCP
 * key-value store cpar_store_* that rank 0 hosts for rendezvous.
 *
 * Server: one background thread that owns the table and runs a poll() loop
 * over the listening socket, every client and a self-pipe (shutdown). Its
 * sockets are non-blocking with per-connection buffers, so a slow, stalled or
 * hostile client never blocks the others; a frame that fails validation
 * closes that connection only, and a connection that holds a half-sent frame
 * (or leaves a reply unread) for longer than the store's timeout is dropped.
 * Client: one request in flight per handle; every wait is a poll() with a
 * deadline. The hosting process reaches its own server through an ordinary
 * loopback client, so the server thread is the only one touching the table
 * and the table needs no lock.
 *
 * Wire format, integers big-endian. Requests and replies share a 12-byte
 * header, then the key bytes, then the value bytes:
 *     u32 magic "CPST" | u8 version | u8 op (reply: status) |
 *     u16 key length (reply: 0) | u32 value length
 *   PING  -          -> OK                  handshake: "is this a cpar store?"
 *   SET   key value  -> OK | NOMEM
 *   GET   key        -> OK value | MISSING  never waits; clients poll
 *   ADD   key i64    -> OK i64 | BADVALUE | NOMEM
 * ADD keeps its counter as decimal text, so GET on a counter reads "3".
 * Uses: 1 (cpar__fail, cpar__now_ms, cpar__default_timeout_ms).            */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

/* ---- launch environment ------------------------------------------------ */

/* Strict decimal: strtol alone takes " 7", "+7", "7abc" and "" for numbers. */
static bool cpar__env_parse_long(const char *s, long *out)
{
    const char *digits = (*s == '-') ? s + 1 : s;
    if (*digits < '0' || *digits > '9')
        return false;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || *end != '\0')
        return false;
    *out = v;
    return true;
}

/* Read the integer variable var into *out when it is set (*set says so). */
static cpar_status cpar__env_int(const char *var, long lo, long hi, int *out, bool *set)
{
    const char *s = getenv(var);
    *set = (s != NULL);
    if (!s)
        return CPAR_OK;
    long v;
    if (!cpar__env_parse_long(s, &v))
        return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: %s=\"%.64s\" is not an integer", var, s);
    if (v < lo || v > hi)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: %s=%ld is out of range, expected %ld..%ld",
                          var, v, lo, hi);
    *out = (int)v;
    return CPAR_OK;
}

/* Entry `node` of SLURM's compressed per-node task list ("4(x2),3" is 4,4,3).
 * The whole list is validated, not just the entry asked for. */
static bool cpar__env_slurm_tasks(const char *s, long node, int *out)
{
    bool found = false;
    for (;;) {
        if (*s < '0' || *s > '9')
            return false;
        char *end;
        errno = 0;
        long count = strtol(s, &end, 10), reps = 1;
        if (errno != 0 || count < 1 || count > INT_MAX)
            return false;
        s = end;
        if (*s == '(') {
            if (s[1] != 'x' || s[2] < '0' || s[2] > '9')
                return false;
            reps = strtol(s + 2, &end, 10);
            if (errno != 0 || reps < 1 || *end != ')')
                return false;
            s = end + 1;
        }
        if (!found && node < reps) {
            *out = (int)count;
            found = true;
        }
        node -= reps;
        if (*s == '\0')
            return found;
        if (*s++ != ',')
            return false;
    }
}

/* Local world size under SLURM. SLURM_NTASKS_PER_NODE (set by
 * --ntasks-per-node) is uniform: its first number. SLURM_TASKS_PER_NODE
 * (always set by srun) may differ per node: the entry for SLURM_NODEID. */
static cpar_status cpar__env_slurm_local_world(int *out, bool *set)
{
    const char *var = "SLURM_NTASKS_PER_NODE";
    const char *s = getenv(var);
    int node = 0;
    if (!s) {
        var = "SLURM_TASKS_PER_NODE";
        s = getenv(var);
        bool has_node;
        cpar_status st = cpar__env_int("SLURM_NODEID", 0, INT_MAX, &node, &has_node);
        if (st != CPAR_OK)
            return st;
    }
    *set = (s != NULL);
    if (s && !cpar__env_slurm_tasks(s, node, out))
        return cpar__fail(NULL, CPAR_ERR_INVALID,
                          "cpar_env_read: %s=\"%.64s\" is not a task list like \"4(x2),3\" with an entry for node %d",
                          var, s, node);
    return CPAR_OK;
}

cpar_status cpar_env_read(cpar_env *out)
{
    if (!out)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: out is NULL");
    cpar_env e;
    memset(&e, 0, sizeof e);
    e.world_size = e.local_world_size = 1;
    e.master_port = 29500;
    snprintf(e.master_addr, sizeof e.master_addr, "127.0.0.1");
    e.source = "default";

    /* torchrun wins over SLURM: torchrun inside an allocation sets both. */
    const char *v_rank = "RANK", *v_world = "WORLD_SIZE";
    const char *v_lrank = "LOCAL_RANK", *v_lworld = "LOCAL_WORLD_SIZE";
    bool slurm = false;
    if (getenv("RANK") || getenv("WORLD_SIZE")) {
        e.source = "torchrun";
    } else if (getenv("SLURM_PROCID")) {
        e.source = "slurm";
        slurm = true;
        v_rank = "SLURM_PROCID";
        v_world = (!getenv("SLURM_NTASKS") && getenv("SLURM_NPROCS")) ? "SLURM_NPROCS" : "SLURM_NTASKS";
        v_lrank = "SLURM_LOCALID";
        v_lworld = getenv("SLURM_NTASKS_PER_NODE") ? "SLURM_NTASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
    }

    cpar_status st;
    if (strcmp(e.source, "default") != 0) {
        bool has_rank, has_world, has_lrank, has_lworld;
        if ((st = cpar__env_int(v_rank, 0, INT_MAX, &e.rank, &has_rank)) != CPAR_OK ||
            (st = cpar__env_int(v_world, 1, INT_MAX, &e.world_size, &has_world)) != CPAR_OK ||
            (st = cpar__env_int(v_lrank, 0, INT_MAX, &e.local_rank, &has_lrank)) != CPAR_OK)
            return st;
        st = slurm ? cpar__env_slurm_local_world(&e.local_world_size, &has_lworld)
                   : cpar__env_int(v_lworld, 1, INT_MAX, &e.local_world_size, &has_lworld);
        if (st != CPAR_OK)
            return st;
        if (!has_rank || !has_world)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: %s is set but %s is not (a launcher sets both)",
                              has_rank ? v_rank : v_world, has_rank ? v_world : v_rank);
        /* Launched by hand without the local variables: assume one node
         * holding every rank, ranks numbered node by node. */
        if (!has_lworld) {
            e.local_world_size = e.world_size;
            v_lworld = v_world;
        }
        if (!has_lrank)
            e.local_rank = e.rank % e.local_world_size;
        if (e.rank >= e.world_size)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: %s=%d is not below %s=%d", v_rank, e.rank,
                              v_world, e.world_size);
        if (e.local_world_size > e.world_size)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: %s=%d is larger than %s=%d", v_lworld,
                              e.local_world_size, v_world, e.world_size);
        if (e.local_rank >= e.local_world_size)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: %s=%d is not below %s=%d", v_lrank,
                              e.local_rank, v_lworld, e.local_world_size);
    }

    const char *addr = getenv("MASTER_ADDR");
    if (addr) {
        size_t n = strlen(addr);
        if (n == 0)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: MASTER_ADDR is empty, expected a host name or address");
        if (n >= sizeof e.master_addr)
            return cpar__fail(NULL, CPAR_ERR_INVALID, "cpar_env_read: MASTER_ADDR is %zu characters, expected at most %zu",
                              n, sizeof e.master_addr - 1);
        memcpy(e.master_addr, addr, n + 1);
    }
    bool has_mport, has_sport;
    if ((st = cpar__env_int("MASTER_PORT", 1, 65535, &e.master_port, &has_mport)) != CPAR_OK ||
        (st = cpar__env_int("CPAR_STORE_PORT", 1, 65535, &e.store_port, &has_sport)) != CPAR_OK)
        return st;
    /* torchrun's own TCPStore already listens on MASTER_PORT. */
    if (!has_sport) {
        if (e.master_port == 65535)
            return cpar__fail(NULL, CPAR_ERR_INVALID,
                              "cpar_env_read: MASTER_PORT=65535 leaves no port for the store (MASTER_PORT+1); set CPAR_STORE_PORT");
        e.store_port = e.master_port + 1;
    }
    *out = e;
    return CPAR_OK;
}

/* ---- store: protocol ---------------------------------------------------- */

#define CPAR__STORE_MAGIC 0x43505354u /* "CPST" */
#define CPAR__STORE_VERSION 1
#define CPAR__STORE_HDR 12
#define CPAR__STORE_KEY_MAX 255
#define CPAR__STORE_VALUE_MAX ((size_t)1 << 20)
#define CPAR__STORE_LINGER_MS 2000 /* destroy: longest wait for clients to leave */
#define CPAR__STORE_BUF_KEEP ((size_t)64 << 10) /* larger per-connection buffers are freed after use */

enum { CPAR__STORE_PING = 1, CPAR__STORE_SET, CPAR__STORE_GET, CPAR__STORE_ADD };
enum { CPAR__STORE_OK = 0, CPAR__STORE_MISSING, CPAR__STORE_BADVALUE, CPAR__STORE_NOMEM };

#ifdef MSG_NOSIGNAL
#define CPAR__STORE_NOSIGNAL MSG_NOSIGNAL
#else
#define CPAR__STORE_NOSIGNAL 0 /* BSD/macOS: SO_NOSIGPIPE is set on each socket instead */
#endif

static void cpar__store_put32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24), p[1] = (unsigned char)(v >> 16), p[2] = (unsigned char)(v >> 8), p[3] = (unsigned char)v;
}
static uint32_t cpar__store_get32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static void cpar__store_put64(unsigned char *p, int64_t v)
{
    cpar__store_put32(p, (uint32_t)((uint64_t)v >> 32));
    cpar__store_put32(p + 4, (uint32_t)v);
}
static int64_t cpar__store_get64(const unsigned char *p)
{
    return (int64_t)((uint64_t)cpar__store_get32(p) << 32 | cpar__store_get32(p + 4));
}

static void cpar__store_put_hdr(unsigned char *p, unsigned op, size_t klen, size_t vlen)
{
    cpar__store_put32(p, CPAR__STORE_MAGIC);
    p[4] = CPAR__STORE_VERSION;
    p[5] = (unsigned char)op;
    p[6] = (unsigned char)(klen >> 8), p[7] = (unsigned char)klen;
    cpar__store_put32(p + 8, (uint32_t)vlen);
}

/* The only frames a server accepts: anything else closes the connection. */
static bool cpar__store_hdr_valid(const unsigned char *p, size_t *klen, size_t *vlen)
{
    if (cpar__store_get32(p) != CPAR__STORE_MAGIC || p[4] != CPAR__STORE_VERSION)
        return false;
    *klen = (size_t)p[6] << 8 | p[7];
    *vlen = cpar__store_get32(p + 8);
    switch (p[5]) {
    case CPAR__STORE_PING: return *klen == 0 && *vlen == 0;
    case CPAR__STORE_SET: return *klen >= 1 && *klen <= CPAR__STORE_KEY_MAX && *vlen <= CPAR__STORE_VALUE_MAX;
    case CPAR__STORE_GET: return *klen >= 1 && *klen <= CPAR__STORE_KEY_MAX && *vlen == 0;
    case CPAR__STORE_ADD: return *klen >= 1 && *klen <= CPAR__STORE_KEY_MAX && *vlen == 8;
    default: return false;
    }
}

static const char *cpar__store_errstr(int err, char *buf, size_t n)
{
#if defined(__GLIBC__) && defined(_GNU_SOURCE)
    return strerror_r(err, buf, n); /* the GNU variant returns the string */
#else
    if (strerror_r(err, buf, n) != 0)
        snprintf(buf, n, "errno %d", err);
    return buf;
#endif
}

/* Every store socket: close-on-exec (children of a rank must not inherit
 * it), non-blocking (all waits are poll() with a deadline), no SIGPIPE. */
static int cpar__store_fd_setup(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0)
        return -1;
#ifdef SO_NOSIGPIPE
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof one);
#endif
    return 0;
}

static void cpar__store_sleep_ms(int64_t ms)
{
    if (ms > 0)
        (void)poll(NULL, 0, ms > INT_MAX ? INT_MAX : (int)ms);
}

static int cpar__store_ms_left(int64_t deadline)
{
    int64_t left = deadline - cpar__now_ms();
    return left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
}

/* "host:port", bracketing IPv6 literals. */
static void cpar__store_addr_str(char *buf, size_t n, const char *host, int port)
{
    snprintf(buf, n, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
}

static bool cpar__store_host_is_any(const char *host)
{
    return !host || !*host || !strcmp(host, "0.0.0.0") || !strcmp(host, "::");
}

/* ---- store: server ------------------------------------------------------ */

typedef struct cpar__store_entry {
    struct cpar__store_entry *next;
    unsigned char *val;
    size_t vlen;
    uint32_t hash;
    uint16_t klen;
    char key[]; /* not NUL-terminated */
} cpar__store_entry;

typedef struct cpar__store_conn {
    int fd;
    unsigned char *in;  /* the frame being received */
    size_t in_have, in_need, in_cap;
    unsigned char *out; /* the reply not yet sent */
    size_t out_off, out_len, out_cap;
    int64_t last_progress; /* for dropping clients that stall mid-frame */
} cpar__store_conn;

typedef struct cpar__store_server {
    int listen_fd;
    int wake[2]; /* self-pipe: cpar_store_destroy writes the shutdown deadline */
    pthread_t thread;
    int stall_ms;
    cpar__store_entry **buckets;
    size_t nbuckets, nentries;
    cpar__store_conn *conns;
    size_t nconns, cap_conns;
    struct pollfd *pfds;
    size_t cap_pfds;
    int64_t accept_paused_until; /* after EMFILE: stop spinning on the listener */
} cpar__store_server;

static uint32_t cpar__store_hash(const char *key, size_t n)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)key[i]) * 16777619u;
    return h;
}

static cpar__store_entry *cpar__store_find(cpar__store_server *srv, const char *key, size_t klen, uint32_t h)
{
    for (cpar__store_entry *e = srv->buckets[h & (srv->nbuckets - 1)]; e; e = e->next)
        if (e->hash == h && e->klen == klen && memcmp(e->key, key, klen) == 0)
            return e;
    return NULL;
}

/* Insert or overwrite; false when out of memory (the table is unchanged). */
static bool cpar__store_put(cpar__store_server *srv, const char *key, size_t klen, const void *val, size_t vlen)
{
    uint32_t h = cpar__store_hash(key, klen);
    cpar__store_entry *e = cpar__store_find(srv, key, klen, h);
    unsigned char *copy = malloc(vlen ? vlen : 1);
    if (!copy)
        return false;
    if (vlen)
        memcpy(copy, val, vlen);
    if (e) {
        free(e->val);
        e->val = copy, e->vlen = vlen;
        return true;
    }
    if (srv->nentries >= srv->nbuckets) { /* keep chains short: grow at load 1 */
        size_t nb = srv->nbuckets * 2;
        cpar__store_entry **b = calloc(nb, sizeof *b);
        if (b) {
            for (size_t i = 0; i < srv->nbuckets; i++)
                for (cpar__store_entry *x = srv->buckets[i], *next; x; x = next) {
                    next = x->next;
                    x->next = b[x->hash & (nb - 1)];
                    b[x->hash & (nb - 1)] = x;
                }
            free(srv->buckets);
            srv->buckets = b, srv->nbuckets = nb;
        } /* else: keep the old table, just longer chains */
    }
    e = malloc(sizeof *e + klen);
    if (!e) {
        free(copy);
        return false;
    }
    memcpy(e->key, key, klen);
    e->klen = (uint16_t)klen, e->hash = h, e->val = copy, e->vlen = vlen;
    e->next = srv->buckets[h & (srv->nbuckets - 1)];
    srv->buckets[h & (srv->nbuckets - 1)] = e;
    srv->nentries++;
    return true;
}

/* Queue a reply on c; false when out of memory (the caller drops c). */
static bool cpar__store_reply(cpar__store_conn *c, unsigned status, const void *val, size_t vlen)
{
    size_t need = CPAR__STORE_HDR + vlen;
    if (need > c->out_cap) {
        unsigned char *p = realloc(c->out, need);
        if (!p)
            return false;
        c->out = p, c->out_cap = need;
    }
    cpar__store_put_hdr(c->out, status, 0, vlen);
    if (vlen)
        memcpy(c->out + CPAR__STORE_HDR, val, vlen);
    c->out_off = 0, c->out_len = need;
    return true;
}

/* Execute the complete, validated frame in c->in and queue its reply. */
static bool cpar__store_execute(cpar__store_server *srv, cpar__store_conn *c)
{
    const unsigned char *p = c->in;
    size_t klen = (size_t)p[6] << 8 | p[7], vlen = cpar__store_get32(p + 8);
    const char *key = (const char *)p + CPAR__STORE_HDR;
    const unsigned char *val = p + CPAR__STORE_HDR + klen;
    switch (p[5]) {
    case CPAR__STORE_PING:
        return cpar__store_reply(c, CPAR__STORE_OK, NULL, 0);
    case CPAR__STORE_SET:
        return cpar__store_reply(c, cpar__store_put(srv, key, klen, val, vlen) ? CPAR__STORE_OK : CPAR__STORE_NOMEM,
                                 NULL, 0);
    case CPAR__STORE_GET: {
        cpar__store_entry *e = cpar__store_find(srv, key, klen, cpar__store_hash(key, klen));
        return e ? cpar__store_reply(c, CPAR__STORE_OK, e->val, e->vlen)
                 : cpar__store_reply(c, CPAR__STORE_MISSING, NULL, 0);
    }
    case CPAR__STORE_ADD: {
        cpar__store_entry *e = cpar__store_find(srv, key, klen, cpar__store_hash(key, klen));
        int64_t sum = cpar__store_get64(val);
        if (e) {
            /* The counter is decimal text: parse it strictly, add without overflow. */
            char text[24];
            long long cur;
            char *end;
            if (e->vlen == 0 || e->vlen >= sizeof text)
                return cpar__store_reply(c, CPAR__STORE_BADVALUE, NULL, 0);
            memcpy(text, e->val, e->vlen);
            text[e->vlen] = '\0';
            errno = 0;
            cur = strtoll(text, &end, 10);
            if (errno != 0 || *end != '\0' || !((text[0] >= '0' && text[0] <= '9') || text[0] == '-') ||
                (sum > 0 && cur > INT64_MAX - sum) || (sum < 0 && cur < INT64_MIN - sum))
                return cpar__store_reply(c, CPAR__STORE_BADVALUE, NULL, 0);
            sum += (int64_t)cur;
        }
        char text[24];
        int n = snprintf(text, sizeof text, "%" PRId64, sum);
        unsigned char be[8];
        cpar__store_put64(be, sum);
        if (!cpar__store_put(srv, key, klen, text, (size_t)n))
            return cpar__store_reply(c, CPAR__STORE_NOMEM, NULL, 0);
        return cpar__store_reply(c, CPAR__STORE_OK, be, sizeof be);
    }
    default:
        return false; /* unreachable: the header was validated */
    }
}

/* Send what the socket takes of the pending reply. false: drop c. */
static bool cpar__store_conn_flush(cpar__store_conn *c, int64_t now)
{
    while (c->out_off < c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, CPAR__STORE_NOSIGNAL);
        if (n > 0) {
            c->out_off += (size_t)n;
            c->last_progress = now;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else {
            return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
        }
    }
    c->out_off = c->out_len = 0;
    if (c->out_cap > CPAR__STORE_BUF_KEEP) { /* one big GET must not pin 1 MiB per client */
        free(c->out);
        c->out = NULL, c->out_cap = 0;
    }
    return true;
}

/* Read frames until the socket is drained, a reply is waiting to be sent (no
 * pipelining past an unsent reply), or a fairness bound. false: drop c. */
static bool cpar__store_conn_read(cpar__store_server *srv, cpar__store_conn *c, int64_t now)
{
    for (int frames = 0; frames < 16 && c->out_off == c->out_len;) {
        ssize_t n = recv(c->fd, c->in + c->in_have, c->in_need - c->in_have, 0);
        if (n == 0)
            return false; /* peer closed; mid-frame or not, the connection is done */
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno == EAGAIN || errno == EWOULDBLOCK;
        }
        c->in_have += (size_t)n;
        c->last_progress = now;
        if (c->in_have == CPAR__STORE_HDR && c->in_need == CPAR__STORE_HDR) {
            /* Validate before reading the body: a bogus length never allocates. */
            size_t klen, vlen;
            if (!cpar__store_hdr_valid(c->in, &klen, &vlen))
                return false;
            c->in_need = CPAR__STORE_HDR + klen + vlen;
            if (c->in_need > c->in_cap) {
                unsigned char *p = realloc(c->in, c->in_need);
                if (!p)
                    return false;
                c->in = p, c->in_cap = c->in_need;
            }
        }
        if (c->in_have < c->in_need)
            continue;
        bool ok = cpar__store_execute(srv, c);
        c->in_have = 0, c->in_need = CPAR__STORE_HDR;
        if (c->in_cap > CPAR__STORE_BUF_KEEP) {
            unsigned char *p = realloc(c->in, CPAR__STORE_HDR + CPAR__STORE_KEY_MAX);
            if (p)
                c->in = p, c->in_cap = CPAR__STORE_HDR + CPAR__STORE_KEY_MAX;
        }
        if (!ok || !cpar__store_conn_flush(c, now))
            return false;
        frames++;
    }
    return true;
}

static void cpar__store_conn_close(cpar__store_conn *c)
{
    close(c->fd);
    free(c->in);
    free(c->out);
    c->fd = -1, c->in = c->out = NULL;
}

static void cpar__store_accept(cpar__store_server *srv, int64_t now)
{
    for (int i = 0; i < 64; i++) { /* bounded: clients already connected get served too */
        int fd = accept(srv->listen_fd, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO)
                continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                srv->accept_paused_until = now + 100; /* the listener would stay readable: don't spin */
            return;
        }
        int one = 1;
        unsigned char *in = malloc(CPAR__STORE_HDR + CPAR__STORE_KEY_MAX);
        if (!in || cpar__store_fd_setup(fd) < 0 || (srv->nconns == srv->cap_conns && srv->cap_conns > SIZE_MAX / 4)) {
            free(in);
            close(fd);
            continue;
        }
        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (srv->nconns == srv->cap_conns) {
            size_t cap = srv->cap_conns ? srv->cap_conns * 2 : 16;
            cpar__store_conn *cs = realloc(srv->conns, cap * sizeof *cs);
            struct pollfd *ps = cs ? realloc(srv->pfds, (cap + 2) * sizeof *ps) : NULL;
            if (cs)
                srv->conns = cs;
            if (!cs || !ps) {
                free(in);
                close(fd);
                return;
            }
            srv->pfds = ps, srv->cap_conns = cap, srv->cap_pfds = cap + 2;
        }
        srv->conns[srv->nconns++] = (cpar__store_conn){
            .fd = fd, .in = in, .in_need = CPAR__STORE_HDR, .in_cap = CPAR__STORE_HDR + CPAR__STORE_KEY_MAX,
            .last_progress = now};
    }
}

/* The server thread. It stops when the wake pipe carries a deadline and
 * either every client has gone or that deadline has passed. */
static void *cpar__store_serve(void *arg)
{
    cpar__store_server *srv = arg;
    bool stopping = false;
    int64_t stop_at = 0;
    for (;;) {
        int64_t now = cpar__now_ms();
        if (stopping && (srv->nconns == 0 || now >= stop_at))
            break;
        /* [0] wake pipe, [1] listener (unless paused), then one per client. */
        struct pollfd *pf = srv->pfds;
        size_t np = 0;
        pf[np++] = (struct pollfd){.fd = srv->wake[0], .events = POLLIN};
        bool listening = now >= srv->accept_paused_until;
        pf[np++] = (struct pollfd){.fd = listening ? srv->listen_fd : -1, .events = POLLIN};
        int64_t wake_at = stopping ? stop_at : listening ? INT64_MAX : srv->accept_paused_until;
        for (size_t i = 0; i < srv->nconns; i++) {
            cpar__store_conn *c = &srv->conns[i];
            bool sending = c->out_off < c->out_len;
            pf[np++] = (struct pollfd){.fd = c->fd, .events = sending ? POLLOUT : POLLIN};
            if ((sending || c->in_have > 0) && c->last_progress + srv->stall_ms < wake_at)
                wake_at = c->last_progress + srv->stall_ms;
        }
        int timeout = wake_at == INT64_MAX ? -1 : cpar__store_ms_left(wake_at);
        int r = poll(pf, np, timeout);
        if (r < 0) {
            if (errno != EINTR)
                cpar__store_sleep_ms(10); /* ENOMEM: transient, retry */
            continue;
        }
        now = cpar__now_ms();
        if (pf[0].revents) {
            unsigned char msg[8];
            if (read(srv->wake[0], msg, sizeof msg) == (ssize_t)sizeof msg) {
                stopping = true;
                stop_at = cpar__store_get64(msg);
            }
        }
        if (pf[1].revents)
            cpar__store_accept(srv, now); /* appends after the entries polled below */
        for (size_t i = 0; i + 2 < np; i++) {
            cpar__store_conn *c = &srv->conns[i];
            short ev = pf[i + 2].revents;
            bool keep = true;
            if (ev & (POLLOUT | POLLERR | POLLHUP | POLLNVAL))
                keep = (ev & POLLNVAL) == 0 && cpar__store_conn_flush(c, now);
            if (keep && c->out_off == c->out_len && (ev & (POLLIN | POLLERR | POLLHUP)))
                keep = cpar__store_conn_read(srv, c, now);
            if (keep && (c->in_have > 0 || c->out_off < c->out_len) && now - c->last_progress >= srv->stall_ms)
                keep = false; /* half a frame (or an unread reply) for a whole timeout: give up on it */
            if (!keep)
                cpar__store_conn_close(c);
        }
        size_t live = 0;
        for (size_t i = 0; i < srv->nconns; i++)
            if (srv->conns[i].fd >= 0)
                srv->conns[live++] = srv->conns[i];
        srv->nconns = live;
    }
    for (size_t i = 0; i < srv->nconns; i++)
        cpar__store_conn_close(&srv->conns[i]);
    srv->nconns = 0;
    return NULL;
}

static void cpar__store_server_free(cpar__store_server *srv)
{
    if (!srv)
        return;
    for (size_t i = 0; i < srv->nconns; i++)
        cpar__store_conn_close(&srv->conns[i]);
    for (size_t i = 0; i < srv->nbuckets; i++)
        for (cpar__store_entry *e = srv->buckets[i], *next; e; e = next) {
            next = e->next;
            free(e->val);
            free(e);
        }
    if (srv->listen_fd >= 0)
        close(srv->listen_fd);
    if (srv->wake[0] >= 0)
        close(srv->wake[0]);
    if (srv->wake[1] >= 0)
        close(srv->wake[1]);
    free(srv->buckets);
    free(srv->conns);
    free(srv->pfds);
    free(srv);
}

/* Bind and listen. host NULL/"" means every interface: IPv6 dual-stack when
 * the kernel has IPv6, else IPv4. Returns the fd, or -1 with *err set. */
static int cpar__store_listen(const char *host, int port, int *err)
{
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV}, *res = NULL;
    bool any = !host || !*host;
    if (any)
        hints.ai_family = AF_INET6;
    int gai = getaddrinfo(any ? NULL : host, portstr, &hints, &res);
    if (gai != 0 && any) { /* no IPv6 here */
        hints.ai_family = AF_INET;
        gai = getaddrinfo(NULL, portstr, &hints, &res);
    }
    if (gai != 0) {
        *err = gai == EAI_SYSTEM ? errno : EADDRNOTAVAIL;
        return -1;
    }
    int fd = -1;
    *err = EADDRNOTAVAIL;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
        if (fd < 0) {
            *err = errno;
            continue;
        }
        /* SO_REUSEADDR: a previous job's TIME_WAIT sockets must not block the
         * port. Never SO_REUSEPORT: two live servers must collide loudly. */
        int one = 1, zero = 0;
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (ai->ai_family == AF_INET6 && any)
            (void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        if (cpar__store_fd_setup(fd) == 0 && bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 4096) == 0)
            break; /* the backlog is clamped by net.core.somaxconn */
        *err = errno;
        close(fd);
        fd = -1;
        if (*err == EADDRINUSE)
            break;
    }
    freeaddrinfo(res);
    if (fd < 0 && any && *err != EADDRINUSE && hints.ai_family == AF_INET6) {
        /* IPv6 resolvable but unusable (disabled in the kernel): plain IPv4. */
        struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                                  .sin_addr.s_addr = htonl(INADDR_ANY)};
        int one = 1;
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd >= 0) {
            (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
            if (cpar__store_fd_setup(fd) != 0 || bind(fd, (struct sockaddr *)&sin, sizeof sin) != 0 ||
                listen(fd, 4096) != 0) {
                *err = errno;
                close(fd);
                fd = -1;
            }
        } else {
            *err = errno;
        }
    }
    return fd;
}

/* ---- store: client ------------------------------------------------------ */

struct cpar_store {
    int fd;                 /* connection to the server; also on the hosting process */
    int timeout_ms;
    bool broken;            /* a reply was lost or the server left: the stream is out of sync */
    pthread_mutex_t mu;     /* one request in flight per handle */
    char addr[300];         /* "host:port" for messages */
    cpar__store_server *server; /* non-NULL on the process hosting the server */
};

/* I/O results of the client helpers. */
enum { CPAR__STORE_IO_OK = 0, CPAR__STORE_IO_TIMEOUT = -1, CPAR__STORE_IO_CLOSED = -2 };

/* Wait for ev on fd until the deadline: 1 ready, 0 deadline passed, -1 error. */
static int cpar__store_wait(int fd, short ev, int64_t deadline)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = ev};
        int r = poll(&p, 1, cpar__store_ms_left(deadline));
        if (r > 0)
            return 1; /* also on POLLERR/POLLHUP: the next send/recv reports it */
        if (r == 0 && cpar__now_ms() >= deadline)
            return 0;
        if (r < 0 && errno != EINTR)
            return -1;
    }
}

/* Send every byte of iov[0..n). Returns CPAR__STORE_IO_* or an errno > 0. */
static int cpar__store_send_iov(int fd, struct iovec *iov, int n, int64_t deadline)
{
    while (n > 0) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t r = sendmsg(fd, &m, CPAR__STORE_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EPIPE || errno == ECONNRESET)
                return CPAR__STORE_IO_CLOSED;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                return errno;
            int w = cpar__store_wait(fd, POLLOUT, deadline);
            if (w <= 0)
                return w == 0 ? CPAR__STORE_IO_TIMEOUT : errno;
            continue;
        }
        size_t done = (size_t)r; /* partial send: advance through the iovecs */
        while (n > 0 && done >= iov->iov_len) {
            done -= iov->iov_len;
            iov++, n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + done;
            iov->iov_len -= done;
        }
    }
    return CPAR__STORE_IO_OK;
}

/* Receive exactly len bytes into buf (NULL: read and drop them). */
static int cpar__store_recv_all(int fd, void *buf, size_t len, int64_t deadline)
{
    unsigned char sink[4096];
    size_t got = 0;
    while (got < len) {
        void *dst = buf ? (unsigned char *)buf + got : sink;
        size_t want = buf ? len - got : (len - got < sizeof sink ? len - got : sizeof sink);
        ssize_t r = recv(fd, dst, want, 0);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        if (r == 0 || errno == ECONNRESET)
            return CPAR__STORE_IO_CLOSED;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return errno;
        int w = cpar__store_wait(fd, POLLIN, deadline);
        if (w <= 0)
            return w == 0 ? CPAR__STORE_IO_TIMEOUT : errno;
    }
    return CPAR__STORE_IO_OK;
}

/* Turn an I/O failure into a status. The stream is out of sync afterwards
 * (part of a request or a reply may be in flight), so the handle is broken. */
static cpar_status cpar__store_io_fail(cpar_store *s, const char *fn, int io)
{
    char eb[128];
    s->broken = true;
    if (io == CPAR__STORE_IO_TIMEOUT)
        return cpar__fail(NULL, CPAR_ERR_TIMEOUT, "%s: store at %s did not answer within %d ms", fn, s->addr,
                          s->timeout_ms);
    if (io == CPAR__STORE_IO_CLOSED)
        return cpar__fail(NULL, CPAR_ERR_PEER, "%s: store at %s closed the connection (did rank 0 exit?)", fn,
                          s->addr);
    return cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: talking to store at %s: %s", fn, s->addr,
                      cpar__store_errstr(io, eb, sizeof eb));
}

/* One round trip. The reply value lands in buf when it fits in cap; a larger
 * one is read and dropped (keeping the stream in sync) and *rlen still says
 * its size. *rstatus gets the server's status. Call with s->mu held. */
static cpar_status cpar__store_call(cpar_store *s, const char *fn, unsigned op, const char *key, const void *val,
                                    size_t vlen, unsigned *rstatus, void *buf, size_t cap, size_t *rlen)
{
    if (s->broken)
        return cpar__fail(NULL, CPAR_ERR_PEER, "%s: the connection to the store at %s failed earlier", fn, s->addr);
    int64_t deadline = cpar__now_ms() + s->timeout_ms;
    size_t klen = key ? strlen(key) : 0;
    unsigned char head[CPAR__STORE_HDR + CPAR__STORE_KEY_MAX];
    cpar__store_put_hdr(head, op, klen, vlen);
    memcpy(head + CPAR__STORE_HDR, key ? key : "", klen);
    struct iovec iov[2] = {{.iov_base = head, .iov_len = CPAR__STORE_HDR + klen},
                           {.iov_base = (void *)val, .iov_len = vlen}};
    int io = cpar__store_send_iov(s->fd, iov, vlen ? 2 : 1, deadline);
    if (io == CPAR__STORE_IO_OK)
        io = cpar__store_recv_all(s->fd, head, CPAR__STORE_HDR, deadline);
    if (io != CPAR__STORE_IO_OK)
        return cpar__store_io_fail(s, fn, io);
    size_t n = cpar__store_get32(head + 8);
    if (cpar__store_get32(head) != CPAR__STORE_MAGIC || head[4] != CPAR__STORE_VERSION || n > CPAR__STORE_VALUE_MAX) {
        s->broken = true;
        return cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: %s sent a reply that is not a cpar store's (version %d)", fn,
                          s->addr, CPAR__STORE_VERSION);
    }
    io = cpar__store_recv_all(s->fd, n <= cap ? buf : NULL, n, deadline);
    if (io != CPAR__STORE_IO_OK)
        return cpar__store_io_fail(s, fn, io);
    *rstatus = head[5];
    if (rlen)
        *rlen = n;
    if (*rstatus == CPAR__STORE_NOMEM)
        return cpar__fail(NULL, CPAR_ERR_OOM, "%s: store at %s is out of memory (key \"%s\", %zu bytes)", fn, s->addr,
                          key ? key : "", vlen);
    return CPAR_OK;
}

/* Connect to host:port, retrying until the deadline: ECONNREFUSED is normal
 * while rank 0 is still starting. Then a PING checks it is a cpar store. */
static cpar_status cpar__store_connect(cpar_store *s, const char *host, int port, int64_t deadline)
{
    const char *fn = "cpar_store_create";
    char portstr[16], eb[128];
    snprintf(portstr, sizeof portstr, "%d", port);
    int last_err = ECONNREFUSED, backoff = 10;
    for (;;) {
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
        struct addrinfo *res = NULL;
        int gai = getaddrinfo(host, portstr, &hints, &res);
        if (gai != 0 && gai != EAI_AGAIN)
            return cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: cannot resolve store host \"%s\": %s", fn, host,
                              gai == EAI_SYSTEM ? cpar__store_errstr(errno, eb, sizeof eb) : gai_strerror(gai));
        if (gai == EAI_AGAIN)
            last_err = EAGAIN;
        for (struct addrinfo *ai = res; ai && s->fd < 0; ai = ai->ai_next) {
            int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
            if (fd < 0 || cpar__store_fd_setup(fd) < 0) {
                last_err = errno;
                if (fd >= 0)
                    close(fd);
                continue;
            }
            int err = 0;
            if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0) {
                err = errno;
                /* Bound one attempt so a blackholed address leaves time for the next. */
                int64_t attempt = cpar__now_ms() + 5000;
                if (err == EINPROGRESS || err == EINTR) {
                    int w = cpar__store_wait(fd, POLLOUT, attempt < deadline ? attempt : deadline);
                    socklen_t sl = sizeof err;
                    if (w <= 0)
                        err = w == 0 ? ETIMEDOUT : errno;
                    else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl) < 0)
                        err = errno;
                }
            }
            if (err == 0) {
                int one = 1;
                (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                s->fd = fd;
            } else {
                last_err = err;
                close(fd);
            }
        }
        if (res)
            freeaddrinfo(res);
        if (s->fd >= 0)
            break;
        int64_t now = cpar__now_ms();
        if (now >= deadline)
            return cpar__fail(NULL, CPAR_ERR_TIMEOUT, "%s: no store at %s after %d ms (is rank 0 running?): %s", fn,
                              s->addr, s->timeout_ms, cpar__store_errstr(last_err, eb, sizeof eb));
        cpar__store_sleep_ms(backoff < deadline - now ? backoff : deadline - now);
        backoff = backoff * 2 > 500 ? 500 : backoff * 2;
    }
    unsigned rstatus;
    cpar_status st = cpar__store_call(s, fn, CPAR__STORE_PING, NULL, NULL, 0, &rstatus, NULL, 0, NULL);
    if (st == CPAR_ERR_PEER)
        return cpar__fail(NULL, CPAR_ERR_SYSTEM,
                          "%s: %s closed the connection at the handshake: not a cpar store of version %d "
                          "(torchrun's store on MASTER_PORT? see CPAR_STORE_PORT)", fn, s->addr, CPAR__STORE_VERSION);
    if (st == CPAR_OK && rstatus != CPAR__STORE_OK)
        return cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: %s refused the handshake (status %u)", fn, s->addr, rstatus);
    return st;
}

static cpar_status cpar__store_check_key(const char *fn, const char *key)
{
    if (!key)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: key is NULL", fn);
    size_t n = strnlen(key, CPAR__STORE_KEY_MAX + 1);
    if (n == 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: key is empty", fn);
    if (n > CPAR__STORE_KEY_MAX)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: key is %zu bytes, expected at most %d (key \"%.32s...\")", fn,
                          strlen(key), CPAR__STORE_KEY_MAX, key);
    return CPAR_OK;
}

/* Stop the server thread: it serves until every client has gone or the
 * deadline (now + linger_ms) passes, then exits. */
static void cpar__store_server_stop(cpar__store_server *srv, int64_t linger_ms)
{
    unsigned char msg[8];
    cpar__store_put64(msg, cpar__now_ms() + linger_ms);
    while (write(srv->wake[1], msg, sizeof msg) < 0 && errno == EINTR) {
    }
    pthread_join(srv->thread, NULL);
}

cpar_status cpar_store_destroy(cpar_store *s)
{
    if (!s)
        return CPAR_OK;
    if (s->fd >= 0)
        close(s->fd); /* first: the server must not wait for its own client */
    if (s->server) {
        /* Linger until the other ranks have disconnected, so one still
         * polling the last barrier is not cut off when rank 0 is quicker.
         * Bounded, so a rank 0 that is failing still fails its peers fast. */
        cpar__store_server_stop(s->server, s->timeout_ms < CPAR__STORE_LINGER_MS ? s->timeout_ms : CPAR__STORE_LINGER_MS);
        cpar__store_server_free(s->server);
    }
    pthread_mutex_destroy(&s->mu);
    free(s);
    return CPAR_OK;
}

cpar_status cpar_store_create(const cpar_store_config *cfg, cpar_store **out)
{
    const char *fn = "cpar_store_create";
    if (!out)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: out is NULL", fn);
    *out = NULL;
    if (!cfg)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cfg is NULL", fn);
    if (cfg->port < 1 || cfg->port > 65535)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cfg->port is %d, expected 1..65535", fn, cfg->port);
    if (cfg->timeout_ms < 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cfg->timeout_ms is %d, expected >= 0 (0: default)", fn,
                          cfg->timeout_ms);
    if (cfg->host && strnlen(cfg->host, 256) > 255)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: cfg->host is longer than 255 characters", fn);

    cpar_store *s = calloc(1, sizeof *s);
    if (!s)
        return cpar__fail(NULL, CPAR_ERR_OOM, "%s: cannot allocate %zu bytes", fn, sizeof *s);
    s->fd = -1;
    s->timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : cpar__default_timeout_ms();
    if (pthread_mutex_init(&s->mu, NULL) != 0) {
        free(s);
        return cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: cannot create a mutex", fn);
    }
    int64_t deadline = cpar__now_ms() + s->timeout_ms;
    char eb[128];
    cpar_status st;

    /* The hosting process reaches its server over loopback when bound to all interfaces. */
    const char *host = cfg->host && *cfg->host ? cfg->host : "127.0.0.1";
    if (cfg->is_server && cpar__store_host_is_any(cfg->host))
        host = (cfg->host && !strcmp(cfg->host, "::")) ? "::1" : "127.0.0.1";
    cpar__store_addr_str(s->addr, sizeof s->addr, host, cfg->port);

    if (cfg->is_server) {
        cpar__store_server *srv = calloc(1, sizeof *srv);
        if (!srv) {
            st = cpar__fail(NULL, CPAR_ERR_OOM, "%s: cannot allocate %zu bytes", fn, sizeof *srv);
            goto fail;
        }
        srv->listen_fd = srv->wake[0] = srv->wake[1] = -1;
        srv->stall_ms = s->timeout_ms;
        srv->nbuckets = 64;
        srv->buckets = calloc(srv->nbuckets, sizeof *srv->buckets);
        srv->pfds = calloc(2, sizeof *srv->pfds);
        srv->cap_pfds = 2;
        if (!srv->buckets || !srv->pfds) {
            cpar__store_server_free(srv);
            st = cpar__fail(NULL, CPAR_ERR_OOM, "%s: cannot allocate the store table", fn);
            goto fail;
        }
        int err = 0;
        srv->listen_fd = cpar__store_listen(cpar__store_host_is_any(cfg->host) ? NULL : cfg->host, cfg->port, &err);
        if (srv->listen_fd < 0) {
            char where[300];
            cpar__store_addr_str(where, sizeof where, cpar__store_host_is_any(cfg->host) ? "0.0.0.0" : cfg->host,
                                 cfg->port);
            cpar__store_server_free(srv);
            st = cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: cannot listen on %s: %s%s", fn, where,
                            cpar__store_errstr(err, eb, sizeof eb),
                            err == EADDRINUSE ? " (another job? set CPAR_STORE_PORT)" : "");
            goto fail;
        }
        if (pipe(srv->wake) != 0 || cpar__store_fd_setup(srv->wake[0]) != 0 || cpar__store_fd_setup(srv->wake[1]) != 0) {
            st = cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: cannot create a pipe: %s", fn,
                            cpar__store_errstr(errno, eb, sizeof eb));
            cpar__store_server_free(srv);
            goto fail;
        }
        /* Signals are the application's business: keep them off the server thread. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        int rc = pthread_create(&srv->thread, NULL, cpar__store_serve, srv);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rc != 0) {
            cpar__store_server_free(srv);
            st = cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: cannot start the server thread: %s", fn,
                            cpar__store_errstr(rc, eb, sizeof eb));
            goto fail;
        }
        s->server = srv;
    }
    if ((st = cpar__store_connect(s, host, cfg->port, deadline)) != CPAR_OK)
        goto fail;
    *out = s;
    return CPAR_OK;

fail:
    if (s->fd >= 0)
        close(s->fd);
    if (s->server) {
        cpar__store_server_stop(s->server, 0);
        cpar__store_server_free(s->server);
    }
    pthread_mutex_destroy(&s->mu);
    free(s);
    return st;
}

cpar_status cpar_store_set(cpar_store *s, const char *key, const void *value, size_t len)
{
    const char *fn = "cpar_store_set";
    cpar_status st;
    if (!s)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: s is NULL", fn);
    if ((st = cpar__store_check_key(fn, key)) != CPAR_OK)
        return st;
    if (!value && len > 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: value is NULL with len %zu", fn, len);
    if (len > CPAR__STORE_VALUE_MAX)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: value of key \"%s\" is %zu bytes, expected at most %zu (1 MiB)",
                          fn, key, len, CPAR__STORE_VALUE_MAX);
    unsigned rstatus;
    pthread_mutex_lock(&s->mu);
    st = cpar__store_call(s, fn, CPAR__STORE_SET, key, value, len, &rstatus, NULL, 0, NULL);
    pthread_mutex_unlock(&s->mu);
    return st;
}

cpar_status cpar_store_get(cpar_store *s, const char *key, void *value, size_t cap, size_t *len)
{
    const char *fn = "cpar_store_get";
    cpar_status st;
    if (!s)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: s is NULL", fn);
    if ((st = cpar__store_check_key(fn, key)) != CPAR_OK)
        return st;
    if (!value && cap > 0)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: value is NULL with cap %zu", fn, cap);
    int64_t deadline = cpar__now_ms() + s->timeout_ms;
    int64_t backoff = 1; /* ms: quick for keys that are nearly there, 50 ms at most to spare the server */
    for (;;) {
        unsigned rstatus;
        size_t n = 0;
        pthread_mutex_lock(&s->mu);
        st = cpar__store_call(s, fn, CPAR__STORE_GET, key, NULL, 0, &rstatus, value, cap, &n);
        pthread_mutex_unlock(&s->mu);
        if (st != CPAR_OK)
            return st;
        if (rstatus == CPAR__STORE_OK) {
            if (len)
                *len = n;
            if (n > cap)
                return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: key \"%s\" holds %zu bytes, more than cap=%zu", fn, key,
                                  n, cap);
            return CPAR_OK;
        }
        int64_t now = cpar__now_ms();
        if (now >= deadline)
            return cpar__fail(NULL, CPAR_ERR_TIMEOUT, "%s: key \"%s\" not set within %d ms (store at %s)", fn, key,
                              s->timeout_ms, s->addr);
        cpar__store_sleep_ms(backoff < deadline - now ? backoff : deadline - now);
        backoff = backoff * 2 > 50 ? 50 : backoff * 2;
    }
}

static cpar_status cpar__store_add(cpar_store *s, const char *fn, const char *key, int64_t delta, int64_t *result)
{
    unsigned char be[8], reply[8];
    unsigned rstatus;
    size_t n = 0;
    cpar__store_put64(be, delta);
    pthread_mutex_lock(&s->mu);
    cpar_status st = cpar__store_call(s, fn, CPAR__STORE_ADD, key, be, sizeof be, &rstatus, reply, sizeof reply, &n);
    pthread_mutex_unlock(&s->mu);
    if (st != CPAR_OK)
        return st;
    if (rstatus == CPAR__STORE_BADVALUE)
        return cpar__fail(NULL, CPAR_ERR_INVALID,
                          "%s: key \"%s\" holds a value that is not a decimal int64 (or adding %" PRId64 " overflows)",
                          fn, key, delta);
    if (rstatus != CPAR__STORE_OK || n != sizeof reply) {
        pthread_mutex_lock(&s->mu);
        s->broken = true;
        pthread_mutex_unlock(&s->mu);
        return cpar__fail(NULL, CPAR_ERR_SYSTEM, "%s: store at %s sent a malformed reply to ADD", fn, s->addr);
    }
    if (result)
        *result = cpar__store_get64(reply);
    return CPAR_OK;
}

cpar_status cpar_store_add(cpar_store *s, const char *key, int64_t delta, int64_t *result)
{
    const char *fn = "cpar_store_add";
    cpar_status st;
    if (!s)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: s is NULL", fn);
    if ((st = cpar__store_check_key(fn, key)) != CPAR_OK)
        return st;
    return cpar__store_add(s, fn, key, delta, result);
}

/* After a barrier timed out: name the ranks whose arrival key for this
 * generation is missing. Stops once it has found all `missing` of them (the
 * counter says how many), so the common case of one absent rank is cheap. */
static cpar_status cpar__store_barrier_report(cpar_store *s, const char *name, int nranks, int64_t gen,
                                              int64_t missing)
{
    const char *fn = "cpar_store_barrier";
    char list[160] = "", key[CPAR__STORE_KEY_MAX + 1];
    size_t used = 0;
    int64_t named = 0, found = 0;
    for (int r = 0; r < nranks && found < missing; r++) {
        char val[24];
        size_t n = 0;
        unsigned rstatus;
        snprintf(key, sizeof key, "%s/%d", name, r);
        pthread_mutex_lock(&s->mu);
        cpar_status st = cpar__store_call(s, fn, CPAR__STORE_GET, key, NULL, 0, &rstatus, val, sizeof val - 1, &n);
        pthread_mutex_unlock(&s->mu);
        if (st != CPAR_OK)
            return st;
        long v = -1;
        if (rstatus == CPAR__STORE_OK && n < sizeof val) {
            val[n] = '\0';
            if (!cpar__env_parse_long(val, &v))
                v = -1;
        }
        if (v >= gen)
            continue;
        found++;
        int w = snprintf(list + used, sizeof list - used, "%s%d", named ? "," : "", r);
        if (w > 0 && (size_t)w < sizeof list - used - 16) /* keep room for the tail */
            used += (size_t)w, named++;
        else
            list[used] = '\0';
    }
    if (found < missing) /* arrivals raced the scan; the counter is authoritative */
        found = missing;
    char more[48] = "";
    if (found > named)
        snprintf(more, sizeof more, "%s%" PRId64 " more", named ? " and " : "", found - named);
    return cpar__fail(NULL, CPAR_ERR_TIMEOUT, "%s: barrier \"%s\" timed out after %d ms: rank%s %s%s of %d missing",
                      fn, name, s->timeout_ms, found == 1 ? "" : "s", list, more, nranks);
}

/* Arrival: add 1 to "<name>/count"; the result n puts this call in
 * generation g = (n-1)/nranks, so a name can be reused for successive
 * barriers; record "<name>/<rank>" = g for the timeout report, then poll the
 * counter until it reaches (g+1)*nranks. No rank can enter generation g+1
 * before generation g is full, so the counts never mix. */
cpar_status cpar_store_barrier(cpar_store *s, const char *name, int rank, int nranks)
{
    const char *fn = "cpar_store_barrier";
    char key[CPAR__STORE_KEY_MAX + 1], count_key[CPAR__STORE_KEY_MAX + 1], text[24];
    if (!s)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: s is NULL", fn);
    if (!name || !*name)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: name is %s", fn, name ? "empty" : "NULL");
    size_t nlen = strnlen(name, CPAR__STORE_KEY_MAX + 1);
    if (nlen > CPAR__STORE_KEY_MAX - 11) /* room for "/count" and "/<rank>" */
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: name is %zu bytes, expected at most %d", fn, strlen(name),
                          CPAR__STORE_KEY_MAX - 11);
    if (nranks < 1)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: nranks is %d, expected >= 1", fn, nranks);
    if (rank < 0 || rank >= nranks)
        return cpar__fail(NULL, CPAR_ERR_INVALID, "%s: rank is %d, expected 0..%d (nranks=%d)", fn, rank, nranks - 1,
                          nranks);
    int64_t deadline = cpar__now_ms() + s->timeout_ms;
    snprintf(count_key, sizeof count_key, "%s/count", name);
    snprintf(key, sizeof key, "%s/%d", name, rank);

    int64_t n;
    cpar_status st = cpar__store_add(s, fn, count_key, 1, &n);
    if (st != CPAR_OK)
        return st;
    int64_t gen = (n - 1) / nranks, target = (gen + 1) * nranks;
    int tl = snprintf(text, sizeof text, "%" PRId64, gen);
    unsigned rstatus;
    pthread_mutex_lock(&s->mu);
    st = cpar__store_call(s, fn, CPAR__STORE_SET, key, text, (size_t)tl, &rstatus, NULL, 0, NULL);
    pthread_mutex_unlock(&s->mu);
    if (st != CPAR_OK)
        return st;
    int64_t backoff = 1;
    while (n < target) {
        int64_t now = cpar__now_ms();
        if (now >= deadline)
            return cpar__store_barrier_report(s, name, nranks, gen, target - n);
        cpar__store_sleep_ms(backoff < deadline - now ? backoff : deadline - now);
        backoff = backoff * 2 > 50 ? 50 : backoff * 2;
        if ((st = cpar__store_add(s, fn, count_key, 0, &n)) != CPAR_OK)
            return st;
    }
    return CPAR_OK;
}
