/* SPDX-License-Identifier: MIT */
/* train.c — cpar's main job (make demo): train a GPT on text, with tensor,
 * sequence, context and data parallelism, AdamW, gradient clipping,
 * checkpoints in safetensors and sampling.
 *
 * The model is a byte-level GPT (vocabulary 256): learned token and position
 * embeddings, `layers` pre-norm blocks (RMSNorm, causal multi-head attention,
 * RMSNorm, GeLU MLP), a final RMSNorm and an output layer; no biases. On a
 * grid of tp x cp x dp ranks (cpar_grid_init: tp fastest):
 *   - tp: the embedding tables and the output layer are split over the
 *     vocabulary (positions for the position table), q/k/v/fc1 by columns,
 *     proj/fc2 by rows, attention heads over tp; between them the residual
 *     stream is split along the sequence (sequence parallelism);
 *   - cp: each sequence is cut into 2cp chunks and rank r holds chunks r and
 *     2cp-1-r (causal load balancing); attention is the ring over cp;
 *   - dp: each dp rank trains on its own micro-batch.
 * Gradients: norm weights (replicated over tp, fed by sequence-parallel
 * shards) are summed over tp, then every gradient over dp x cp in one
 * coalesced all-reduce; the global norm is clipped; AdamW updates fp32
 * masters (the parameters themselves in f32).
 *
 * Data: any file of bytes (default: the repository's README.md, cpar.h and
 * cpar.c, concatenated); the last 10 % is the validation split. The batch of
 * step t on dp rank d is a pure function of (seed, t, d), so a resumed run
 * sees the same data as an uninterrupted one.
 *
 * Single process (the default): ranks are threads, on the host backend, one
 * GPU each (NCCL) or sharing fewer GPUs (the device backend). Before training it checks, for a few steps, that the
 * parallel run computes the same losses as one rank. Under cparrun, torchrun
 * or SLURM (WORLD_SIZE set) every process is one rank (cpar_init_from_env).
 *
 * Run `train --help` for the flags. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* clock_gettime, strdup under -std=c11 */
#endif
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cpar.h"

#define VOCAB 256
#define MAX_LAYERS 64
#define NORM_EPS 1e-5f

#define TRY(call)                                                                                            \
    do {                                                                                                     \
        cpar_status st_ = (call);                                                                            \
        if (st_ != CPAR_OK) return st_;                                                                      \
    } while (0)

/* A failure of the program itself (not of a cpar call): the message goes to
 * the thread's error line like cpar's own, so rank threads report it. */
static cpar_status fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return CPAR_ERR_INVALID;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t mix64(uint64_t z) { /* splitmix64's finaliser */
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* ==== options =============================================================== */

typedef struct {
    const char *data, *save, *resume, *prompt, *backend_name;
    int tp, cp, dp, layers, hidden, heads, seq, batch, steps, warmup, eval_every, eval_batches, sample, save_every;
    int verify, top_k, log_every; /* log_every 0: 1 up to 100 steps, else 10 */
    cpar_cp_comm_type cp_comm;    /* how context-parallel attention communicates */
    int hier_cp;                  /* a2a+p2p: the all-to-all group size */
    float lr, weight_decay, clip, temperature;
    uint64_t seed;
    cpar_dtype dtype;
    cpar_backend backend;
} options;

static void usage(FILE *f) {
    fprintf(f,
            "usage: train [flags]   (make demo runs it with the defaults)\n"
            "Trains a byte-level GPT with tensor (tp), context (cp) and data (dp) parallelism.\n"
            "  --data FILE          text to train on (default: README.md, cpar.h and cpar.c here)\n"
            "  --tp N --cp N --dp N the grid; world = tp*cp*dp (default 2 x 2 x 1; fewer GPUs: 2 x 1, 1 x 1)\n"
            "  --cp-comm TYPE       context-parallel attention: p2p (ring, the default), all_gather, a2a\n"
            "                       (all-to-all of heads; heads/tp divisible by cp) or a2a+p2p (with\n"
            "                       --hierarchical-cp A: all-to-all in groups of A ranks, ring across them)\n"
            "  --layers N           transformer blocks (default 4; 8 on GPUs)\n"
            "  --hidden N           model width (default 128; 512 on GPUs)\n"
            "  --heads N            attention heads, divisible by tp (default 4; 8 on GPUs)\n"
            "  --seq N              sequence length, divisible by 2*cp*tp (default 128; 512 on GPUs)\n"
            "  --batch N            sequences per dp rank and step (default 8)\n"
            "  --steps N            training steps in all (default 1000)\n"
            "  --lr X --warmup N    peak learning rate and warm-up steps (default 3e-3, 20; cosine to lr/10)\n"
            "  --weight-decay X     AdamW's decoupled weight decay on matrices (default 0.1)\n"
            "  --clip X             clip the global gradient norm to X; 0: off (default 1.0)\n"
            "  --dtype f32|bf16|f16 parameters and activations (default f32 on the host, bf16 on GPUs)\n"
            "  --eval-every N       validation loss every N steps (default 100)\n"
            "  --log-every N        a step line every N steps, and the first and last (default 1 up to 100\n"
            "                       steps, else 10)\n"
            "  --save DIR           write checkpoints to DIR/step_NNNNNN (at the end, and every --save-every)\n"
            "  --save-every N       also checkpoint every N steps\n"
            "  --resume DIR         continue from a checkpoint (any grid): DIR/step_NNNNNN, or a --save\n"
            "                       folder, whose latest complete step it takes\n"
            "  --sample N           print N sampled bytes after training (default 200; 0: none)\n"
            "  --prompt TEXT        the sample's prompt (default \"cpar_\")\n"
            "  --temperature X --top-k N   sampling (default 0.8, 40)\n"
            "  --seed N             weights, data and sampling (default 1337)\n"
            "  --backend host|nccl|device   (default: nccl with a GPU per rank, device with fewer\n"
            "                       GPUs than ranks (they share them), host with none)\n"
            "  --verify N           first check N steps of the grid against 1 rank (default 5; 0: skip)\n"
            "  --help               this text\n"
            "Under cparrun, torchrun or SLURM (WORLD_SIZE set) each process is one rank.\n");
}

static int parse_int(const char *flag, const char *v, int lo, int hi, bool *bad) {
    char *end;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || *end || x < lo || x > hi) {
        fprintf(stderr, "train: %s expects an integer in [%d, %d], got \"%s\"\n", flag, lo, hi, v ? v : "");
        *bad = true;
    }
    return (int)x;
}

static float parse_float(const char *flag, const char *v, float lo, float hi, bool *bad) {
    char *end;
    double x = v ? strtod(v, &end) : 0;
    if (!v || *end || !(x >= lo && x <= hi)) {
        fprintf(stderr, "train: %s expects a number in [%g, %g], got \"%s\"\n", flag, (double)lo, (double)hi,
                v ? v : "");
        *bad = true;
    }
    return (float)x;
}

/* 0: run; 1: printed help; 2: bad flags (already reported). */
static int parse_options(int argc, char **argv, options *o) {
    bool bad = false, gpu = false;
    *o = (options){.tp = 2, .cp = 2, .dp = 1, .cp_comm = CPAR_CP_P2P, .batch = 8, .steps = 1000, .warmup = 20, .eval_every = 100,
                   .eval_batches = 8, .sample = 200, .verify = 5, .top_k = 40, .lr = 3e-3f, .weight_decay = 0.1f,
                   .clip = 1.0f, .temperature = 0.8f, .seed = 1337, .prompt = "cpar_", .dtype = (cpar_dtype)-1,
                   .backend = (cpar_backend)-1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char name[64];
        const char *eq = strchr(a, '=');
        if (eq && eq - a < (long)sizeof name) { /* --flag=value */
            memcpy(name, a, (size_t)(eq - a));
            name[eq - a] = 0;
            a = name;
            v = eq + 1;
        } else if (strcmp(a, "--help") && strcmp(a, "-h")) {
            i++; /* every other flag takes a value */
        }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 1;
        } else if (!strcmp(a, "--data")) o->data = v;
        else if (!strcmp(a, "--tp")) o->tp = parse_int(a, v, 1, 64, &bad);
        else if (!strcmp(a, "--cp")) o->cp = parse_int(a, v, 1, 64, &bad);
        else if (!strcmp(a, "--dp")) o->dp = parse_int(a, v, 1, 1024, &bad);
        else if (!strcmp(a, "--layers")) o->layers = parse_int(a, v, 1, MAX_LAYERS, &bad);
        else if (!strcmp(a, "--hidden")) o->hidden = parse_int(a, v, 8, 1 << 16, &bad);
        else if (!strcmp(a, "--heads")) o->heads = parse_int(a, v, 1, 1024, &bad);
        else if (!strcmp(a, "--seq")) o->seq = parse_int(a, v, 2, 1 << 20, &bad);
        else if (!strcmp(a, "--batch")) o->batch = parse_int(a, v, 1, 1 << 16, &bad);
        else if (!strcmp(a, "--steps")) o->steps = parse_int(a, v, 0, 1 << 30, &bad);
        else if (!strcmp(a, "--lr")) o->lr = parse_float(a, v, 0.f, 10.f, &bad);
        else if (!strcmp(a, "--warmup")) o->warmup = parse_int(a, v, 0, 1 << 30, &bad);
        else if (!strcmp(a, "--weight-decay")) o->weight_decay = parse_float(a, v, 0.f, 10.f, &bad);
        else if (!strcmp(a, "--clip")) o->clip = parse_float(a, v, 0.f, 1e9f, &bad);
        else if (!strcmp(a, "--eval-every")) o->eval_every = parse_int(a, v, 0, 1 << 30, &bad);
        else if (!strcmp(a, "--log-every")) o->log_every = parse_int(a, v, 1, 1 << 30, &bad);
        else if (!strcmp(a, "--save")) o->save = v;
        else if (!strcmp(a, "--save-every")) o->save_every = parse_int(a, v, 0, 1 << 30, &bad);
        else if (!strcmp(a, "--resume")) o->resume = v;
        else if (!strcmp(a, "--sample")) o->sample = parse_int(a, v, 0, 1 << 20, &bad);
        else if (!strcmp(a, "--prompt")) o->prompt = v ? v : "";
        else if (!strcmp(a, "--temperature")) o->temperature = parse_float(a, v, 0.f, 100.f, &bad);
        else if (!strcmp(a, "--top-k")) o->top_k = parse_int(a, v, 0, VOCAB, &bad);
        else if (!strcmp(a, "--seed")) o->seed = (uint64_t)parse_int(a, v, 0, 1 << 30, &bad);
        else if (!strcmp(a, "--verify")) o->verify = parse_int(a, v, 0, 1000, &bad);
        else if (!strcmp(a, "--hierarchical-cp")) o->hier_cp = parse_int(a, v, 1, 64, &bad);
        else if (!strcmp(a, "--cp-comm")) {
            if (cpar_cp_comm_type_parse(v ? v : "", &o->cp_comm) != CPAR_OK)
                bad = true, fprintf(stderr, "train: --cp-comm expects p2p, all_gather, a2a or a2a+p2p, got \"%s\"\n",
                                    v ? v : "");
        }
        else if (!strcmp(a, "--dtype")) {
            o->dtype = v && !strcmp(v, "f32") ? CPAR_F32 : v && !strcmp(v, "bf16") ? CPAR_BF16
                     : v && !strcmp(v, "f16") ? CPAR_F16 : (cpar_dtype)-2;
            if ((int)o->dtype == -2) bad = true, fprintf(stderr, "train: --dtype expects f32, bf16 or f16\n");
        } else if (!strcmp(a, "--backend")) {
            o->backend_name = v;
            o->backend = cpar_backend_parse(v) >= 0 ? (cpar_backend)cpar_backend_parse(v) : (cpar_backend)-2;
            if ((int)o->backend == -2) bad = true, fprintf(stderr, "train: --backend expects host, nccl or device\n");
        } else {
            fprintf(stderr, "train: unknown flag \"%s\" (see --help)\n", argv[i - (eq ? 0 : 1)]);
            bad = true;
        }
        if (eq) continue;
        if (!v && strcmp(a, "--help")) {
            fprintf(stderr, "train: %s needs a value\n", a);
            bad = true;
        }
    }
    if (bad) return 2;
    const bool launched = getenv("WORLD_SIZE") || getenv("SLURM_NTASKS"); /* one process per rank */
    if ((int)o->backend == -1) {
        /* GPUs when there are any: NCCL when every rank has its own, else the
         * device backend, whose ranks share the GPUs (one process only). */
        const int ngpu = cpar_backend_available(CPAR_BACKEND_NCCL) ? cpar_device_count() : 0;
        const int nranks = o->tp * o->cp * o->dp;
        o->backend = ngpu == 0 ? CPAR_BACKEND_HOST
                   : launched || ngpu >= nranks ? CPAR_BACKEND_NCCL : CPAR_BACKEND_DEVICE;
        if (o->backend == CPAR_BACKEND_DEVICE)
            fprintf(stderr, "train: %d ranks but %d GPU%s visible: the device backend runs them on %s (ranks as "
                    "threads sharing the GPUs%s; --backend nccl needs one GPU per rank)\n", nranks, ngpu,
                    ngpu == 1 ? " is" : "s are", ngpu == 1 ? "it" : "them",
                    ngpu == 1 ? "" : ", with or without peer access between them");
    }
    if ((int)o->backend >= 0 && !cpar_backend_available(o->backend)) {
        /* named on the command line: fail with the reason, never fall back */
        const int ngpu = cpar_device_count();
        fprintf(stderr, "train: --backend %s is not available here: %s (leave --backend out to run on what there "
                "is)\n", cpar_backend_name(o->backend),
                ngpu == 0 ? "no usable GPU is visible (compute capability 8.0 or newer), or this build has no CUDA"
                          : "this build has no NCCL");
        return 2;
    }
    gpu = o->backend != CPAR_BACKEND_HOST;
    if ((int)o->dtype == -1) o->dtype = gpu ? CPAR_BF16 : CPAR_F32; /* the flash kernels take 16-bit inputs */
    if (!o->layers) o->layers = gpu && o->backend == CPAR_BACKEND_NCCL ? 8 : 4;
    if (!o->hidden) o->hidden = gpu && o->backend == CPAR_BACKEND_NCCL ? 512 : 128;
    if (!o->heads) o->heads = gpu && o->backend == CPAR_BACKEND_NCCL ? 8 : 4;
    if (!o->seq) o->seq = gpu && o->backend == CPAR_BACKEND_NCCL ? 512 : 128;
    if (o->hidden % o->heads) bad = true, fprintf(stderr, "train: --hidden %d is not divisible by --heads %d\n", o->hidden, o->heads);
    if (o->heads % o->tp) bad = true, fprintf(stderr, "train: --heads %d is not divisible by --tp %d\n", o->heads, o->tp);
    const int a2a = o->cp_comm == CPAR_CP_A2A ? o->cp : o->cp_comm == CPAR_CP_A2A_P2P ? o->hier_cp : 1;
    if (o->cp_comm == CPAR_CP_A2A_P2P && (!o->hier_cp || o->cp % o->hier_cp))
        bad = true, fprintf(stderr, "train: --cp-comm a2a+p2p needs --hierarchical-cp A dividing --cp %d (got %d)\n",
                            o->cp, o->hier_cp);
    else if (o->cp_comm != CPAR_CP_A2A_P2P && o->hier_cp)
        bad = true, fprintf(stderr, "train: --hierarchical-cp sizes --cp-comm a2a+p2p's groups (comm type is %s)\n",
                            cpar_cp_comm_type_name(o->cp_comm));
    else if (o->heads % o->tp == 0 && (o->heads / o->tp) % a2a)
        bad = true, fprintf(stderr, "train: --cp-comm %s scatters each rank's %d heads (--heads / --tp) over %d "
                                    "ranks: not divisible\n", cpar_cp_comm_type_name(o->cp_comm), o->heads / o->tp, a2a);
    if (o->seq % (2 * o->cp * o->tp))
        bad = true, fprintf(stderr, "train: --seq %d is not divisible by 2*cp*tp = %d (load-balanced chunks, then "
                                    "sequence parallelism)\n", o->seq, 2 * o->cp * o->tp);
    if (o->dtype == CPAR_F32 && gpu)
        bad = true, fprintf(stderr, "train: the device attention kernels take 16-bit inputs: --dtype bf16 or f16\n");
    return bad ? 2 : 0;
}

/* ==== data ================================================================== */

typedef struct {
    uint8_t *bytes;
    int64_t n, ntrain; /* [0, ntrain): training split; [ntrain, n): validation */
} dataset;

static cpar_status append_file(const char *path, dataset *d) {
    FILE *f = fopen(path, "rb");
    if (!f) return fail("train: cannot open %s: %s%s", path, strerror(errno),
                        errno == ENOENT ? " (run from the repository's root, or pass --data FILE)" : "");
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = len > 0 ? realloc(d->bytes, (size_t)(d->n + len)) : d->bytes;
    if (len > 0 && (!p || fread(p + d->n, 1, (size_t)len, f) != (size_t)len)) {
        fclose(f);
        if (p) d->bytes = p;
        return fail("train: cannot read %s", path);
    }
    fclose(f);
    d->bytes = p;
    d->n += len > 0 ? len : 0;
    return CPAR_OK;
}

static cpar_status data_load(const options *o, dataset *d) {
    memset(d, 0, sizeof *d);
    if (o->data) TRY(append_file(o->data, d));
    else {
        static const char *const own[] = {"README.md", "cpar.h", "cpar.c"};
        for (int i = 0; i < 3; i++) TRY(append_file(own[i], d));
    }
    d->ntrain = d->n - d->n / 10;
    if (d->ntrain < o->seq + 1 || d->n - d->ntrain < o->seq + 1)
        return fail("train: %lld bytes of data are too few for sequences of %d (need %d in each split)",
                    (long long)d->n, o->seq, o->seq + 1);
    return CPAR_OK;
}

/* First byte of global training sequence g (= dp rank * batch + b) of step t:
 * a pure function of (seed, t, g), so every grid and every resumed run reads
 * the same batches. */
static int64_t train_offset(const dataset *d, uint64_t seed, int64_t step, int64_t g, int seq) {
    uint64_t h = mix64(seed ^ mix64(0x5eedull + (uint64_t)step * 0x9e3779b97f4a7c15ull) ^ mix64((uint64_t)g + 77));
    return (int64_t)(h % (uint64_t)(d->ntrain - seq));
}

/* Validation window w of nwin: evenly spaced over the validation split. */
static int64_t val_offset(const dataset *d, int64_t w, int64_t nwin, int seq) {
    const int64_t span = d->n - d->ntrain - seq - 1;
    return d->ntrain + (nwin > 1 ? span * w / (nwin - 1) : 0);
}

/* ==== parameters and their shards ============================================ */

typedef struct {
    char name[48];
    int64_t rows, cols;      /* the full tensor: [rows, cols], or [rows] (cols 0) */
    int dim, stride;         /* split over tp along dim in tp*stride chunks (rank r: r, r+tp, ...); -1: whole */
    bool decay;              /* AdamW weight decay (the matrices) */
    bool sp_grad;            /* replicated over tp but fed by sequence-parallel shards: grads summed over tp */
    cpar_tensor w, g;        /* the parameter (model dtype) and its F32 main grad, as the owner holds them */
    cpar_tensor master, m, v;/* F32 optimizer state; master is w itself in f32 */
    bool own_w, own_g, own_master;
} param;

static int64_t full_numel(const param *p) { return p->rows * (p->cols ? p->cols : 1); }

/* Rank r's shard of a full fp32 tensor (Megatron's partition with stride:
 * along dim, tp*stride equal chunks, rank r takes r, r + tp, ...), or the
 * inverse (place: shard -> full). */
static void shard_copy(const param *p, int tp, int r, float *full, float *shard, bool place) {
    const int64_t C = p->cols ? p->cols : 1;
    if (p->dim < 0 || tp == 1) {
        if (place) memcpy(full, shard, sizeof(float) * (size_t)full_numel(p));
        else memcpy(shard, full, sizeof(float) * (size_t)full_numel(p));
        return;
    }
    const int64_t nchunk = (int64_t)tp * p->stride;
    if (p->dim == 0) {
        const int64_t cr = p->rows / nchunk; /* rows per chunk */
        for (int k = 0; k < p->stride; k++) {
            float *f = full + (r + (int64_t)k * tp) * cr * C, *s = shard + k * cr * C;
            if (place) memcpy(f, s, sizeof(float) * (size_t)(cr * C));
            else memcpy(s, f, sizeof(float) * (size_t)(cr * C));
        }
        return;
    }
    const int64_t cc = p->cols / nchunk, sc = p->cols / tp; /* columns per chunk, per shard row */
    for (int64_t i = 0; i < p->rows; i++)
        for (int k = 0; k < p->stride; k++) {
            float *f = full + i * p->cols + (r + (int64_t)k * tp) * cc, *s = shard + i * sc + k * cc;
            if (place) memcpy(f, s, sizeof(float) * (size_t)cc);
            else memcpy(s, f, sizeof(float) * (size_t)cc);
        }
}

/* Host fp32 values into t (any float dtype), or t's values out as fp32. */
static cpar_status host_to_tensor(cpar_ctx *ctx, const float *src, cpar_tensor *t) {
    const int64_t n = cpar_tensor_numel(t);
    void *buf = t->dtype == CPAR_F32 ? (void *)src : malloc((size_t)n * 2 + 1);
    if (!buf) return CPAR_ERR_OOM;
    for (int64_t i = 0; t->dtype != CPAR_F32 && i < n; i++)
        ((uint16_t *)buf)[i] = t->dtype == CPAR_BF16 ? cpar_f32_to_bf16(src[i]) : cpar_f32_to_f16(src[i]);
    cpar_tensor h = cpar_tensor_make(buf, t->dtype, t->ndim, t->shape, CPAR_HOST);
    cpar_status st = cpar_tensor_copy(ctx, &h, t);
    if (st == CPAR_OK) st = cpar_sync(ctx); /* buf may be read asynchronously on GPUs */
    if (buf != src) free(buf);
    return st;
}

static cpar_status tensor_to_host(cpar_ctx *ctx, const cpar_tensor *t, float *dst) {
    if (t->dtype != CPAR_F32) return fail("train: tensor_to_host expects f32");
    cpar_tensor h = cpar_tensor_make(dst, CPAR_F32, t->ndim, t->shape, CPAR_HOST);
    TRY(cpar_tensor_copy(ctx, t, &h));
    return cpar_sync(ctx);
}

/* n normal(0, std) values of tensor `id` (the same on every grid). */
static void init_normal(float *p, int64_t n, float std, uint64_t seed, uint64_t id) {
    for (int64_t i = 0; i < n; i += 2) {
        uint64_t a = mix64(seed * 1000003u + id * 0x100000001b3ull + (uint64_t)i), b = mix64(a ^ 0xabcdefull);
        double u1 = ((double)(a >> 11) + 0.5) / 9007199254740992.0, u2 = (double)(b >> 11) / 9007199254740992.0;
        double r = sqrt(-2.0 * log(u1));
        p[i] = (float)(std * r * cos(6.283185307179586 * u2));
        if (i + 1 < n) p[i + 1] = (float)(std * r * sin(6.283185307179586 * u2));
    }
}

/* ==== the model on one rank ================================================== */

/* Activations of one forward (kept for the backward) for a micro-batch of B:
 * per block [Sl,B,H] x a1 x2 a2 p; [Sc,B,3H/tp] qkv_out; [3,B,hl,Sc,D] heads
 * (q | k | v in attention's layout); [B,hl,Sc,D] o; [B,hl,Sc] lse;
 * [Sc,B,H/tp] attn; [Sc,B,F/tp] m g. Sl = Sc/tp rows of the residual stream. */
typedef struct {
    cpar_tensor x, a1, qkv_out, heads, o, lse, attn, p, x2, a2, m, g;
} block_acts;

typedef struct {
    int64_t B;
    block_acts L[MAX_LAYERS];
    cpar_tensor pos_emb, xf, af, logits, loss, stats, dloss, loss_sum, ids, pos, tgt;
    cpar_tensor dres, dtmp, dM, dA, dOh, dheads, dqkv; /* backward scratch */
    cpar_tensor **qkv_pieces, *qkv_piece; /* head split/concat views (B * 3 * hl) */
} acts;

typedef struct {
    cpar_linear *qkv, *proj, *fc1, *fc2;
    int ln1, ln2; /* parameter indices of the norm weights */
} block;

#define MAX_PARAMS (6 * MAX_LAYERS + 5)

typedef struct {
    cpar_ctx *ctx;
    const options *o;
    cpar_group *tp, *cp, *dp_cp, *world;
    int ntp, tpr, ncp, ndp, dpr;
    int64_t S, H, NH, D, F, Sc, Sl, hl;
    cpar_dtype dt;
    cpar_embedding *wte, *wpe;
    block L[MAX_LAYERS];
    int lnf;
    cpar_linear *head;
    param P[MAX_PARAMS];
    int np;
    int64_t nparams_total; /* the full model's parameter count */
    acts train, gen;       /* micro-batch B, and one sequence for sampling */
} model;

static cpar_status alloc_t(model *md, cpar_tensor *t, cpar_dtype dt, int nd, int64_t a, int64_t b, int64_t c,
                           int64_t d, int64_t e) {
    const int64_t s[5] = {a, b, c, d, e};
    return cpar_tensor_alloc(md->ctx, dt, nd, s, t);
}

static void free_t(model *md, cpar_tensor *t) {
    if (t->data) cpar_tensor_free(md->ctx, t);
}

static cpar_status acts_create(model *md, acts *a, int64_t B) {
    const cpar_dtype dt = md->dt;
    const int64_t Sc = md->Sc, Sl = md->Sl, H = md->H, hl = md->hl, D = md->D, n = md->ntp, F = md->F;
    memset(a, 0, sizeof *a);
    a->B = B;
    for (int l = 0; l < md->o->layers; l++) {
        block_acts *y = &a->L[l];
        TRY(alloc_t(md, &y->x, dt, 3, Sl, B, H, 0, 0));
        TRY(alloc_t(md, &y->a1, dt, 3, Sl, B, H, 0, 0));
        TRY(alloc_t(md, &y->qkv_out, dt, 3, Sc, B, 3 * H / n, 0, 0));
        TRY(alloc_t(md, &y->heads, dt, 5, 3, B, hl, Sc, D));
        TRY(alloc_t(md, &y->o, dt, 4, B, hl, Sc, D, 0));
        TRY(alloc_t(md, &y->lse, CPAR_F32, 3, B, hl, Sc, 0, 0));
        TRY(alloc_t(md, &y->attn, dt, 3, Sc, B, H / n, 0, 0));
        TRY(alloc_t(md, &y->p, dt, 3, Sl, B, H, 0, 0));
        TRY(alloc_t(md, &y->x2, dt, 3, Sl, B, H, 0, 0));
        TRY(alloc_t(md, &y->a2, dt, 3, Sl, B, H, 0, 0));
        TRY(alloc_t(md, &y->m, dt, 3, Sc, B, F / n, 0, 0));
        TRY(alloc_t(md, &y->g, dt, 3, Sc, B, F / n, 0, 0));
    }
    TRY(alloc_t(md, &a->pos_emb, dt, 3, Sl, B, H, 0, 0));
    TRY(alloc_t(md, &a->xf, dt, 3, Sl, B, H, 0, 0));
    TRY(alloc_t(md, &a->af, dt, 3, Sl, B, H, 0, 0));
    TRY(alloc_t(md, &a->logits, dt, 3, Sc, B, VOCAB / n, 0, 0));
    TRY(alloc_t(md, &a->stats, CPAR_F32, 3, Sc, B, 2, 0, 0));
    TRY(alloc_t(md, &a->loss, CPAR_F32, 2, Sc, B, 0, 0, 0));
    TRY(alloc_t(md, &a->dloss, CPAR_F32, 2, Sc, B, 0, 0, 0));
    TRY(alloc_t(md, &a->loss_sum, CPAR_F32, 1, 1, 0, 0, 0, 0));
    TRY(alloc_t(md, &a->ids, CPAR_I64, 2, B, Sc, 0, 0, 0));
    TRY(alloc_t(md, &a->pos, CPAR_I64, 2, B, Sc, 0, 0, 0));
    TRY(alloc_t(md, &a->tgt, CPAR_I64, 2, Sc, B, 0, 0, 0));
    /* the loss is the mean over every token of the global batch (dp ranks x B x S) */
    TRY(cpar_fill(md->ctx, &a->dloss, 1.0 / ((double)md->S * (double)B * md->ndp)));
    TRY(alloc_t(md, &a->dres, dt, 3, Sl, B, H, 0, 0));
    TRY(alloc_t(md, &a->dtmp, dt, 3, Sl, B, H, 0, 0));
    TRY(alloc_t(md, &a->dM, dt, 3, Sc, B, F / n, 0, 0));
    TRY(alloc_t(md, &a->dA, dt, 3, Sc, B, H / n, 0, 0));
    TRY(alloc_t(md, &a->dOh, dt, 4, B, hl, Sc, D, 0));
    TRY(alloc_t(md, &a->dheads, dt, 5, 3, B, hl, Sc, D));
    TRY(alloc_t(md, &a->dqkv, dt, 3, Sc, B, 3 * H / n, 0, 0));
    /* Head layout: a row [Sc, B, k hl D] viewed as [Sc, B k hl, D] splits along
     * dim 1 into B k hl pieces [Sc, 1, D]; piece (b, j) of head j of kind
     * j / hl (q, k or v) goes to [kind, b, j % hl] of the [k, B, hl, Sc, D]
     * buffer, which is attention's [B, hl, Sc, D] per kind. The pointers are
     * filled per call (the buffer differs); here only the arrays. */
    const int64_t np3 = B * 3 * hl;
    a->qkv_pieces = calloc((size_t)np3, sizeof *a->qkv_pieces);
    a->qkv_piece = calloc((size_t)np3, sizeof *a->qkv_piece);
    if (!a->qkv_pieces || !a->qkv_piece) return CPAR_ERR_OOM;
    return CPAR_OK;
}

static void acts_destroy(model *md, acts *a) {
    for (int l = 0; l < md->o->layers; l++) {
        block_acts *y = &a->L[l];
        cpar_tensor *ts[] = {&y->x, &y->a1, &y->qkv_out, &y->heads, &y->o, &y->lse, &y->attn, &y->p, &y->x2,
                             &y->a2, &y->m, &y->g};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) free_t(md, ts[i]);
    }
    cpar_tensor *ts[] = {&a->pos_emb, &a->xf, &a->af, &a->logits, &a->loss, &a->stats, &a->dloss, &a->loss_sum,
                         &a->ids, &a->pos, &a->tgt, &a->dres, &a->dtmp, &a->dM, &a->dA, &a->dOh, &a->dheads,
                         &a->dqkv};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) free_t(md, ts[i]);
    free(a->qkv_pieces);
    free(a->qkv_piece);
}

/* rows [Sc, B, k hl D] <-> heads [k, B, hl, Sc, D] (split: rows -> heads). */
static cpar_status heads_move(model *md, acts *a, cpar_tensor *rows, cpar_tensor *heads, int k, bool split) {
    const int64_t B = a->B, hl = md->hl, Sc = md->Sc, D = md->D, n = B * k * hl;
    const size_t es = cpar_dtype_size(md->dt), piece = (size_t)(Sc * D) * es;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < k * hl; j++) {
            const int64_t kind = j / hl, h = j % hl, i = b * k * hl + j;
            const int64_t ps[3] = {Sc, 1, D};
            a->qkv_piece[i] = cpar_tensor_make((char *)heads->data + (size_t)((kind * B + b) * hl + h) * piece,
                                               md->dt, 3, ps, heads->device);
            a->qkv_pieces[i] = &a->qkv_piece[i];
        }
    cpar_tensor view = *rows;
    view.ndim = 3, view.shape[0] = Sc, view.shape[1] = n, view.shape[2] = D;
    return split ? cpar_split(md->ctx, &view, 1, (int)n, a->qkv_pieces)
                 : cpar_concat(md->ctx, a->qkv_pieces, (int)n, 1, &view);
}

/* [B, hl, Sc, D] view of kind `which` (q, k or v) inside a [3, B, hl, Sc, D] buffer. */
static cpar_tensor head_kind(const model *md, const acts *a, const cpar_tensor *buf, int which) {
    const int64_t s[4] = {a->B, md->hl, md->Sc, md->D};
    const size_t off = (size_t)which * (size_t)(a->B * md->hl * md->Sc * md->D) * cpar_dtype_size(md->dt);
    return cpar_tensor_make((char *)buf->data + off, md->dt, 4, s, buf->device);
}

/* Causal, load-balanced context-parallel attention with the chosen comm
 * type (a one-rank cp group: plain p2p, which then moves nothing). */
static cpar_ring_attention_config ring_config(const model *md) {
    const bool one = md->ncp == 1;
    return (cpar_ring_attention_config){.causal = true, .load_balance = true,
                                        .comm_type = one ? CPAR_CP_P2P : md->o->cp_comm,
                                        .a2a_size = one ? 0 : md->o->hier_cp};
}

/* ---- parameters ---- */

static param *add_param(model *md, const char *name, int64_t rows, int64_t cols, int dim, int stride, bool decay) {
    param *p = &md->P[md->np++];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name);
    p->rows = rows, p->cols = cols, p->dim = dim, p->stride = stride, p->decay = decay;
    md->nparams_total += full_numel(p);
    return p;
}

/* The optimizer state of p: fp32 master (w itself in f32), moments m and v. */
static cpar_status param_state(model *md, param *p) {
    const cpar_tensor *w = &p->w;
    if (w->dtype == CPAR_F32) p->master = *w;
    else {
        TRY(cpar_tensor_alloc(md->ctx, CPAR_F32, w->ndim, w->shape, &p->master));
        p->own_master = true;
    }
    TRY(cpar_tensor_alloc(md->ctx, CPAR_F32, w->ndim, w->shape, &p->m));
    TRY(cpar_tensor_alloc(md->ctx, CPAR_F32, w->ndim, w->shape, &p->v));
    TRY(cpar_fill(md->ctx, &p->m, 0.0));
    return cpar_fill(md->ctx, &p->v, 0.0);
}

/* Set p (and its fp32 master) from its full fp32 values: this rank's shard. */
static cpar_status param_load(model *md, param *p, float *full) {
    const int64_t n = cpar_tensor_numel(&p->w);
    float *shard = malloc(sizeof(float) * (size_t)n);
    if (!shard) return CPAR_ERR_OOM;
    shard_copy(p, md->ntp, md->tpr, full, shard, false);
    cpar_status st = host_to_tensor(md->ctx, shard, &p->w);
    if (st == CPAR_OK && p->own_master) st = host_to_tensor(md->ctx, shard, &p->master);
    free(shard);
    return st;
}

static cpar_status linear_param(model *md, const char *name, bool row, int64_t in, int64_t out, int stride,
                                cpar_linear **l) {
    cpar_linear_config cfg = {.input_size = in, .output_size = out, .dtype = md->dt, .sequence_parallel = true,
                              .input_is_parallel = row, .stride = stride};
    TRY(row ? cpar_row_parallel_linear_create(md->tp, &cfg, l) : cpar_column_parallel_linear_create(md->tp, &cfg, l));
    param *p = add_param(md, name, out, in, row ? 1 : 0, stride, true);
    p->w = cpar_linear_weight(*l);
    p->g = cpar_linear_weight_grad(*l);
    return param_state(md, p);
}

static cpar_status norm_param(model *md, const char *name, int *index) {
    *index = md->np;
    param *p = add_param(md, name, md->H, 0, -1, 1, false);
    p->sp_grad = true;
    TRY(cpar_tensor_alloc(md->ctx, md->dt, 1, &md->H, &p->w));
    TRY(cpar_tensor_alloc(md->ctx, CPAR_F32, 1, &md->H, &p->g));
    p->own_w = p->own_g = true;
    return param_state(md, p);
}

static cpar_status embedding_param(model *md, const char *name, int64_t rows, cpar_embedding **e) {
    cpar_embedding_config ec = {.num_embeddings = rows, .embedding_dim = md->H, .dtype = md->dt,
                                .reduce_scatter_embeddings = true, .deterministic = true};
    TRY(cpar_embedding_create(md->tp, &ec, e));
    param *p = add_param(md, name, rows, md->H, 0, 1, true);
    p->w = cpar_embedding_weight(*e);
    p->g = cpar_embedding_weight_grad(*e);
    return param_state(md, p);
}

/* The initial weights (GPT-2's scheme: normal(0, 0.02), residual outputs
 * scaled by 1/sqrt(2 layers), position table 0.01, norms 1), the same full
 * tensors on every grid, each rank keeping its shard. */
static cpar_status model_init_weights(model *md) {
    const float resid = 0.02f / sqrtf(2.f * (float)md->o->layers);
    for (int i = 0; i < md->np; i++) {
        param *p = &md->P[i];
        const int64_t n = full_numel(p);
        float *full = malloc(sizeof(float) * (size_t)n);
        if (!full) return CPAR_ERR_OOM;
        if (p->dim < 0 && !p->cols) for (int64_t k = 0; k < n; k++) full[k] = 1.f; /* a norm weight */
        else {
            const bool out = strstr(p->name, "proj") || strstr(p->name, "fc2");
            init_normal(full, n, !strcmp(p->name, "wpe") ? 0.01f : out ? resid : 0.02f, md->o->seed, (uint64_t)i);
        }
        cpar_status st = param_load(md, p, full);
        free(full);
        TRY(st);
    }
    return CPAR_OK;
}

static cpar_status model_create(cpar_ctx *ctx, const options *o, model *md) {
    memset(md, 0, sizeof *md);
    md->ctx = ctx, md->o = o, md->dt = o->dtype;
    md->tp = cpar_grid_group(ctx, CPAR_GROUP_TP), md->cp = cpar_grid_group(ctx, CPAR_GROUP_CP);
    md->dp_cp = cpar_grid_group(ctx, CPAR_GROUP_DP_CP), md->world = cpar_grid_group(ctx, CPAR_GROUP_WORLD);
    md->ntp = cpar_group_size(md->tp), md->tpr = cpar_group_rank(md->tp), md->ncp = cpar_group_size(md->cp);
    md->ndp = cpar_grid_size(ctx, CPAR_GROUP_DP), md->dpr = cpar_grid_rank(ctx, CPAR_GROUP_DP);
    md->S = o->seq, md->H = o->hidden, md->NH = o->heads, md->D = o->hidden / o->heads, md->F = 4 * o->hidden;
    md->Sc = md->S / md->ncp, md->Sl = md->Sc / md->ntp, md->hl = md->NH / md->ntp;
    const int64_t H = md->H;
    char name[48];
    TRY(embedding_param(md, "wte", VOCAB, &md->wte));
    TRY(embedding_param(md, "wpe", md->S, &md->wpe)); /* positions: a table split over tp like the vocabulary */
    for (int l = 0; l < o->layers; l++) {
        block *y = &md->L[l];
        snprintf(name, sizeof name, "h.%d.ln_1", l);
        TRY(norm_param(md, name, &y->ln1));
        /* stride 3: rank r's rows of [Wq; Wk; Wv] are its heads' q, k and v */
        snprintf(name, sizeof name, "h.%d.attn.qkv", l);
        TRY(linear_param(md, name, false, H, 3 * H, 3, &y->qkv));
        snprintf(name, sizeof name, "h.%d.attn.proj", l);
        TRY(linear_param(md, name, true, H, H, 1, &y->proj));
        snprintf(name, sizeof name, "h.%d.ln_2", l);
        TRY(norm_param(md, name, &y->ln2));
        snprintf(name, sizeof name, "h.%d.mlp.fc1", l);
        TRY(linear_param(md, name, false, H, md->F, 1, &y->fc1));
        snprintf(name, sizeof name, "h.%d.mlp.fc2", l);
        TRY(linear_param(md, name, true, md->F, H, 1, &y->fc2));
    }
    TRY(norm_param(md, "ln_f", &md->lnf));
    TRY(linear_param(md, "lm_head", false, H, VOCAB, 1, &md->head));
    TRY(model_init_weights(md));
    return acts_create(md, &md->train, o->batch);
}

static void model_destroy(model *md) {
    acts_destroy(md, &md->train);
    if (md->gen.B) acts_destroy(md, &md->gen);
    for (int i = 0; i < md->np; i++) {
        param *p = &md->P[i];
        if (p->own_w) free_t(md, &p->w);
        if (p->own_g) free_t(md, &p->g);
        if (p->own_master) free_t(md, &p->master);
        free_t(md, &p->m);
        free_t(md, &p->v);
    }
    cpar_embedding_destroy(md->wte);
    cpar_embedding_destroy(md->wpe);
    cpar_linear_destroy(md->head);
    for (int l = 0; l < md->o->layers; l++) {
        block *y = &md->L[l];
        cpar_linear_destroy(y->qkv), cpar_linear_destroy(y->proj);
        cpar_linear_destroy(y->fc1), cpar_linear_destroy(y->fc2);
    }
}

/* ==== forward, backward, optimizer ============================================ */

/* Logits of a's tokens (and, with targets, the per-token loss). */
static cpar_status forward(model *md, acts *a, bool with_loss) {
    cpar_ctx *ctx = md->ctx;
    TRY(cpar_embedding_layer_forward(md->wte, &a->ids, &a->L[0].x));
    TRY(cpar_embedding_layer_forward(md->wpe, &a->pos, &a->pos_emb));
    TRY(cpar_axpby(ctx, 1.f, &a->pos_emb, 1.f, &a->L[0].x));
    const cpar_ring_attention_config rcfg = ring_config(md);
    for (int l = 0; l < md->o->layers; l++) {
        const block *y = &md->L[l];
        block_acts *z = &a->L[l];
        cpar_tensor *next = l + 1 < md->o->layers ? &a->L[l + 1].x : &a->xf;
        TRY(cpar_rmsnorm_forward(ctx, &z->x, &md->P[y->ln1].w, NORM_EPS, &z->a1));
        TRY(cpar_linear_forward(y->qkv, &z->a1, &z->qkv_out, NULL));
        TRY(heads_move(md, a, &z->qkv_out, &z->heads, 3, true));
        cpar_tensor q = head_kind(md, a, &z->heads, 0), k = head_kind(md, a, &z->heads, 1);
        cpar_tensor v = head_kind(md, a, &z->heads, 2);
        TRY(cpar_ring_attention_forward(md->cp, &rcfg, &q, &k, &v, &z->o, &z->lse));
        TRY(heads_move(md, a, &z->attn, &z->o, 1, false));
        TRY(cpar_linear_forward(y->proj, &z->attn, &z->p, NULL));
        TRY(cpar_tensor_copy(ctx, &z->x, &z->x2));
        TRY(cpar_axpby(ctx, 1.f, &z->p, 1.f, &z->x2));
        TRY(cpar_rmsnorm_forward(ctx, &z->x2, &md->P[y->ln2].w, NORM_EPS, &z->a2));
        TRY(cpar_linear_forward(y->fc1, &z->a2, &z->m, NULL));
        TRY(cpar_gelu_forward(ctx, &z->m, &z->g));
        TRY(cpar_linear_forward(y->fc2, &z->g, &z->p, NULL));
        TRY(cpar_tensor_copy(ctx, &z->x2, next));
        TRY(cpar_axpby(ctx, 1.f, &z->p, 1.f, next));
    }
    TRY(cpar_rmsnorm_forward(ctx, &a->xf, &md->P[md->lnf].w, NORM_EPS, &a->af));
    TRY(cpar_linear_forward(md->head, &a->af, &a->logits, NULL));
    if (!with_loss) return CPAR_OK;
    return cpar_vocab_parallel_cross_entropy_forward(md->tp, &a->logits, &a->tgt, 0.f, &a->loss, &a->stats);
}

/* The global mean loss of the step (every rank gets it). */
static cpar_status mean_loss(model *md, acts *a, double *out) {
    const int64_t row[2] = {1, md->Sc * a->B};
    cpar_tensor flat = cpar_tensor_make(a->loss.data, CPAR_F32, 2, row, a->loss.device);
    TRY(cpar_row_reduce(md->ctx, &flat, CPAR_ROW_SUM, &a->loss_sum));
    TRY(cpar_all_reduce(md->dp_cp, &a->loss_sum, &a->loss_sum, CPAR_SUM));
    float sum;
    TRY(tensor_to_host(md->ctx, &a->loss_sum, &sum));
    *out = sum / ((double)md->S * (double)a->B * md->ndp);
    return CPAR_OK;
}

static cpar_status backward(model *md, acts *a) {
    cpar_ctx *ctx = md->ctx;
    TRY(cpar_vocab_parallel_cross_entropy_backward(md->tp, &a->logits, &a->tgt, 0.f, &a->stats, &a->dloss,
                                                   &a->logits)); /* dlogits in place */
    TRY(cpar_linear_backward(md->head, &a->logits, &a->dtmp));
    TRY(cpar_rmsnorm_backward(ctx, &a->xf, &md->P[md->lnf].w, NORM_EPS, &a->dtmp, &a->dres, &md->P[md->lnf].g));
    const cpar_ring_attention_config rcfg = ring_config(md);
    for (int l = md->o->layers - 1; l >= 0; l--) {
        const block *y = &md->L[l];
        block_acts *z = &a->L[l];
        /* MLP: dres is d(out) = d(x2) through the residual */
        TRY(cpar_linear_backward(y->fc2, &a->dres, &a->dM));
        TRY(cpar_gelu_backward(ctx, &z->m, &a->dM, &a->dM));
        TRY(cpar_linear_backward(y->fc1, &a->dM, &a->dtmp));
        TRY(cpar_rmsnorm_backward(ctx, &z->x2, &md->P[y->ln2].w, NORM_EPS, &a->dtmp, &a->dtmp, &md->P[y->ln2].g));
        TRY(cpar_axpby(ctx, 1.f, &a->dtmp, 1.f, &a->dres));
        /* attention */
        TRY(cpar_linear_backward(y->proj, &a->dres, &a->dA));
        TRY(heads_move(md, a, &a->dA, &a->dOh, 1, true));
        cpar_tensor q = head_kind(md, a, &z->heads, 0), k = head_kind(md, a, &z->heads, 1);
        cpar_tensor v = head_kind(md, a, &z->heads, 2);
        cpar_tensor dq = head_kind(md, a, &a->dheads, 0), dk = head_kind(md, a, &a->dheads, 1);
        cpar_tensor dv = head_kind(md, a, &a->dheads, 2);
        TRY(cpar_ring_attention_backward(md->cp, &rcfg, &q, &k, &v, &z->o, &a->dOh, &z->lse, &dq, &dk, &dv));
        TRY(heads_move(md, a, &a->dqkv, &a->dheads, 3, false));
        TRY(cpar_linear_backward(y->qkv, &a->dqkv, &a->dtmp));
        TRY(cpar_rmsnorm_backward(ctx, &z->x, &md->P[y->ln1].w, NORM_EPS, &a->dtmp, &a->dtmp, &md->P[y->ln1].g));
        TRY(cpar_axpby(ctx, 1.f, &a->dtmp, 1.f, &a->dres));
    }
    TRY(cpar_embedding_layer_backward(md->wpe, &a->pos, &a->dres));
    return cpar_embedding_layer_backward(md->wte, &a->ids, &a->dres);
}

static cpar_status zero_grads(model *md) {
    for (int i = 0; i < md->np; i++) TRY(cpar_fill(md->ctx, &md->P[i].g, 0.0));
    return CPAR_OK;
}

/* Linear warm-up to lr, then a cosine to lr / 10 at the last step. */
static float lr_at(const options *o, int64_t step) {
    if (step < o->warmup) return o->lr * (float)(step + 1) / (float)o->warmup;
    const double t = o->steps > o->warmup ? (double)(step - o->warmup) / (double)(o->steps - o->warmup) : 1.0;
    return (float)(o->lr * (0.1 + 0.45 * (1.0 + cos(3.141592653589793 * (t < 1.0 ? t : 1.0)))));
}

/* Reduce the gradients (norm weights over tp: their sequence-parallel shards
 * saw different tokens; everything over dp x cp in one coalesced
 * all-reduce), clip the global norm and take the AdamW step. */
static cpar_status optimizer_step(model *md, int64_t step, float *lr_out, float *norm_out) {
    cpar_tensor *grads[MAX_PARAMS], *sp[MAX_PARAMS];
    bool dup[MAX_PARAMS];
    int nsp = 0;
    for (int i = 0; i < md->np; i++) {
        grads[i] = &md->P[i].g;
        dup[i] = md->P[i].sp_grad;
        if (md->P[i].sp_grad) sp[nsp++] = &md->P[i].g;
    }
    if (md->ntp > 1) TRY(cpar_grads_all_reduce(md->tp, sp, nsp, false));
    if (cpar_group_size(md->dp_cp) > 1) TRY(cpar_grads_all_reduce(md->dp_cp, grads, md->np, false));
    float norm, coef = 1.f;
    TRY(cpar_grad_norm(md->tp, (const cpar_tensor *const *)grads, dup, md->np, &norm));
    if (md->o->clip > 0.f && md->o->clip / (norm + 1e-6f) < 1.f) coef = md->o->clip / (norm + 1e-6f);
    const float lr = lr_at(md->o, step);
    for (int i = 0; i < md->np; i++) {
        param *p = &md->P[i];
        cpar_adamw_config cfg = {.lr = lr, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                                 .weight_decay = p->decay ? md->o->weight_decay : 0.f};
        TRY(cpar_adamw_step(md->ctx, &cfg, step + 1, coef, &p->g, &p->master, &p->m, &p->v,
                            p->own_master ? &p->w : NULL));
    }
    *lr_out = lr;
    *norm_out = norm;
    return CPAR_OK;
}

/* ---- batches ---- */

/* ids [B, S], positions [B, S] and targets [S, B] of sequences starting at
 * off[b], sharded over cp (load-balanced: the ring's layout). */
static cpar_status load_sequences(model *md, acts *a, const dataset *d, const int64_t *off) {
    const int64_t B = a->B, S = md->S;
    int64_t *buf = malloc(sizeof(int64_t) * (size_t)(3 * B * S));
    if (!buf) return CPAR_ERR_OOM;
    int64_t *ids = buf, *pos = buf + B * S, *tgt = buf + 2 * B * S;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < S; i++) {
            ids[b * S + i] = d->bytes[off[b] + i];
            pos[b * S + i] = i;
            tgt[i * B + b] = d->bytes[off[b] + i + 1];
        }
    const int64_t bs[2] = {B, S}, sb[2] = {S, B};
    cpar_tensor hi = cpar_tensor_make(ids, CPAR_I64, 2, bs, CPAR_HOST), hp = cpar_tensor_make(pos, CPAR_I64, 2, bs, CPAR_HOST);
    cpar_tensor ht = cpar_tensor_make(tgt, CPAR_I64, 2, sb, CPAR_HOST);
    cpar_status st = cpar_cp_shard(md->cp, &hi, 1, true, &a->ids);
    if (st == CPAR_OK) st = cpar_cp_shard(md->cp, &hp, 1, true, &a->pos);
    if (st == CPAR_OK) st = cpar_cp_shard(md->cp, &ht, 0, true, &a->tgt);
    if (st == CPAR_OK) st = cpar_sync(md->ctx); /* buf is read asynchronously on GPUs */
    free(buf);
    return st;
}

static cpar_status load_train_batch(model *md, const dataset *d, int64_t step) {
    int64_t off[4096];
    if (md->train.B > 4096) return fail("train: --batch above 4096");
    for (int64_t b = 0; b < md->train.B; b++)
        off[b] = train_offset(d, md->o->seed, step, md->dpr * md->train.B + b, md->o->seq);
    return load_sequences(md, &md->train, d, off);
}

/* Mean loss over the validation windows: dp rank r takes windows r, r + dp,
 * ...; a short last batch repeats window 0 with weight 0. */
static cpar_status evaluate(model *md, const dataset *d, double *out) {
    acts *a = &md->train;
    const int64_t nval = d->n - d->ntrain - md->S - 1, nwin = nval < 64 ? (nval > 1 ? nval : 1) : 64;
    const int64_t mine = (nwin + md->ndp - 1) / md->ndp, batches = (mine + a->B - 1) / a->B;
    double sum = 0.0, count = 0.0;
    float *loss = malloc(sizeof(float) * (size_t)(md->Sc * a->B));
    if (!loss) return CPAR_ERR_OOM;
    cpar_status st = CPAR_OK;
    for (int64_t bt = 0; bt < batches && st == CPAR_OK; bt++) {
        int64_t off[4096];
        bool use[4096];
        for (int64_t b = 0; b < a->B; b++) {
            const int64_t w = (bt * a->B + b) * md->ndp + md->dpr;
            use[b] = w < nwin;
            off[b] = val_offset(d, use[b] ? w : 0, nwin, (int)md->S);
        }
        st = load_sequences(md, a, d, off);
        if (st == CPAR_OK) st = forward(md, a, true);
        if (st == CPAR_OK) st = tensor_to_host(md->ctx, &a->loss, loss);
        for (int64_t i = 0; st == CPAR_OK && i < md->Sc; i++)
            for (int64_t b = 0; b < a->B; b++)
                if (use[b]) sum += loss[i * a->B + b], count += 1.0;
    }
    free(loss);
    TRY(st);
    /* tp ranks hold the same losses: add over dp x cp only */
    float host[2] = {(float)sum, (float)count};
    const int64_t two = 2;
    cpar_tensor t;
    TRY(cpar_tensor_alloc(md->ctx, CPAR_F32, 1, &two, &t));
    st = host_to_tensor(md->ctx, host, &t);
    if (st == CPAR_OK) st = cpar_all_reduce(md->dp_cp, &t, &t, CPAR_SUM);
    if (st == CPAR_OK) st = tensor_to_host(md->ctx, &t, host);
    cpar_tensor_free(md->ctx, &t);
    *out = host[0] / (host[1] > 0 ? host[1] : 1);
    return st;
}

/* ==== sampling ================================================================ */

/* The cp rank and local row that hold global position p of the
 * load-balanced sequence (rank r holds chunks r and 2cp-1-r). */
static void position_owner(const model *md, int64_t p, int *cp_rank, int64_t *row) {
    const int64_t chunk = md->S / (2 * md->ncp), c = p / chunk;
    const int r = c < md->ncp ? (int)c : (int)(2 * md->ncp - 1 - c);
    *cp_rank = r;
    *row = (c == r ? 0 : chunk) + p % chunk;
}

/* Append n sampled bytes to text (len bytes so far): each byte is one
 * forward of the last S bytes through the whole grid; the tp ranks of the cp
 * rank holding the last position gather its vocabulary-parallel logits, the
 * first of them samples (temperature, top-k), and a broadcast over the world
 * tells everyone. */
static cpar_status sample(model *md, char *text, int64_t len, int n, uint64_t seed) {
    const options *o = md->o;
    acts *a = &md->gen;
    if (!a->B) TRY(acts_create(md, a, 1));
    const int64_t vl = VOCAB / md->ntp, one = 1, gshape[2] = {md->ntp, vl}, S = md->S;
    cpar_tensor row_all, tok;
    TRY(cpar_tensor_alloc(md->ctx, md->dt, 2, gshape, &row_all));
    TRY(cpar_tensor_alloc(md->ctx, CPAR_I64, 1, &one, &tok));
    float *logits = malloc(sizeof(float) * VOCAB);
    void *raw = malloc(cpar_dtype_size(md->dt) * VOCAB);
    cpar_status st = logits && raw ? CPAR_OK : CPAR_ERR_OOM;
    for (int i = 0; i < n && st == CPAR_OK; i++) {
        const int64_t start = len > S ? len - S : 0, used = len - start; /* the last S bytes (at least 1) */
        int64_t off = 0;
        dataset window = {.bytes = (uint8_t *)text + start, .n = used, .ntrain = used};
        /* the window's bytes padded with zeros: positions >= used are never seen by position used-1 */
        uint8_t padded[1 << 16];
        if (S + 1 > (int64_t)sizeof padded) { st = fail("train: --seq above 65535 cannot sample"); break; }
        memset(padded, 0, (size_t)S + 1);
        memcpy(padded, window.bytes, (size_t)used);
        window.bytes = padded;
        st = load_sequences(md, a, &window, &off);
        if (st == CPAR_OK) st = forward(md, a, false);
        int owner;
        int64_t row;
        position_owner(md, used - 1, &owner, &row);
        const int root = md->ntp * owner; /* world rank of (tp 0, cp owner, dp 0) */
        if (st == CPAR_OK && cpar_grid_rank(md->ctx, CPAR_GROUP_CP) == owner) {
            const int64_t rs[2] = {1, vl};
            cpar_tensor r = cpar_tensor_make((char *)a->logits.data + (size_t)(row * vl) * cpar_dtype_size(md->dt),
                                             md->dt, 2, rs, a->logits.device);
            st = cpar_all_gather(md->tp, &r, &row_all, NULL);
            if (st == CPAR_OK && cpar_rank(md->ctx) == root) {
                cpar_tensor h = cpar_tensor_make(raw, md->dt, 2, gshape, CPAR_HOST);
                st = cpar_tensor_copy(md->ctx, &row_all, &h);
                if (st == CPAR_OK) st = cpar_sync(md->ctx);
                for (int v = 0; v < VOCAB; v++)
                    logits[v] = md->dt == CPAR_F32   ? ((float *)raw)[v]
                                : md->dt == CPAR_BF16 ? cpar_bf16_to_f32(((uint16_t *)raw)[v])
                                                      : cpar_f16_to_f32(((uint16_t *)raw)[v]);
                /* temperature and top-k (k = 0: all), then draw */
                int64_t pick = 0;
                for (int v = 1; v < VOCAB; v++)
                    if (logits[v] > logits[pick]) pick = v;
                if (o->temperature > 0.f) {
                    float thr = -INFINITY, sorted[VOCAB];
                    memcpy(sorted, logits, sizeof sorted);
                    if (o->top_k > 0 && o->top_k < VOCAB) { /* the k-th largest by partial selection */
                        for (int k = 0; k < o->top_k; k++) {
                            int best = k;
                            for (int v = k + 1; v < VOCAB; v++)
                                if (sorted[v] > sorted[best]) best = v;
                            float t = sorted[k];
                            sorted[k] = sorted[best], sorted[best] = t;
                        }
                        thr = sorted[o->top_k - 1];
                    }
                    double p[VOCAB], total = 0.0;
                    for (int v = 0; v < VOCAB; v++) {
                        p[v] = logits[v] >= thr ? exp((logits[v] - logits[pick]) / o->temperature) : 0.0;
                        total += p[v];
                    }
                    double u = (double)(mix64(seed ^ mix64((uint64_t)len)) >> 11) / 9007199254740992.0 * total;
                    for (pick = 0; pick < VOCAB - 1 && (u -= p[pick]) > 0.0; pick++) {}
                }
                cpar_tensor ht = cpar_tensor_make(&pick, CPAR_I64, 1, &one, CPAR_HOST);
                if (st == CPAR_OK) st = cpar_tensor_copy(md->ctx, &ht, &tok);
                if (st == CPAR_OK) st = cpar_sync(md->ctx);
            }
        }
        if (st == CPAR_OK) st = cpar_broadcast(md->world, &tok, root);
        int64_t got = 0;
        cpar_tensor ht = cpar_tensor_make(&got, CPAR_I64, 1, &one, CPAR_HOST);
        if (st == CPAR_OK) st = cpar_tensor_copy(md->ctx, &tok, &ht);
        if (st == CPAR_OK) st = cpar_sync(md->ctx);
        text[len++] = (char)got;
    }
    text[len] = 0;
    free(logits);
    free(raw);
    cpar_tensor_free(md->ctx, &row_all);
    cpar_tensor_free(md->ctx, &tok);
    return st;
}

#define LATEST_MARKER "latest_checkpointed_iteration.txt" /* as Megatron's, in the --save folder */

/* ==== checkpoints: safetensors ================================================
 * DIR/step_NNNNNN/model.safetensors holds the full (unsharded) fp32 master
 * weights as "<name>.weight" ([rows, cols] or [rows]); optimizer.safetensors
 * the AdamW moments as "exp_avg.<name>" and "exp_avg_sq.<name>". Both carry
 * the step and the model's shape in "__metadata__". The format is
 * safetensors' (an 8-byte little-endian header length, a JSON header, the
 * raw data), so torch / Hugging Face tools read it. Saving gathers the tp
 * shards; resuming gives every rank its shard of the full tensors, so a
 * checkpoint resumes on any grid. */

typedef struct {
    char name[80];
    int64_t shape[2];
    int ndim;
    const float *data;
} st_tensor;

/* CRC-32 (IEEE, as zlib's crc32) of n bytes, continuing from crc: each
 * file's data carries it in the metadata ("data_crc32"), checked on load.
 * The ranks' threads check their files at once: the table is filled once,
 * under pthread_once (filled lazily without it, a rank could read entries
 * another was still writing and call a sound file damaged). */
static uint32_t crc32_table[256];

static void crc32_table_fill(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc32_table[i] = c;
    }
}

static uint32_t crc32_update(uint32_t crc, const void *data, size_t n) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, crc32_table_fill);
    const unsigned char *p = data;
    crc = ~crc;
    for (size_t i = 0; i < n; i++) crc = crc32_table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return ~crc;
}

/* fsync the directory holding path, so a rename in it survives a crash. */
static void sync_parent(const char *path) {
    char dir[4200];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    else snprintf(dir, sizeof dir, ".");
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

/* Write path crash-safely: into path.tmp, flushed to disk, then renamed over
 * path (a crash leaves the old file or the new one, never a mix). */
static cpar_status st_write(const char *path, const st_tensor *t, int n, const char *meta) {
    uint32_t crc = 0;
    for (int i = 0; i < n; i++)
        crc = crc32_update(crc, t[i].data, sizeof(float) * (size_t)t[i].shape[0] * (size_t)(t[i].ndim > 1 ? t[i].shape[1] : 1));
    size_t cap = 4096 + (size_t)n * 160 + strlen(meta), len = 0;
    char *h = malloc(cap), tmp[4200];
    if (!h) return CPAR_ERR_OOM;
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    uint64_t off = 0;
    len += (size_t)snprintf(h + len, cap - len, "{\"__metadata__\":{%s,\"data_crc32\":\"%08x\"}", meta, crc);
    for (int i = 0; i < n; i++) {
        uint64_t bytes = sizeof(float) * (uint64_t)t[i].shape[0] * (uint64_t)(t[i].ndim > 1 ? t[i].shape[1] : 1);
        len += (size_t)snprintf(h + len, cap - len, ",\"%s\":{\"dtype\":\"F32\",\"shape\":[%lld", t[i].name,
                                (long long)t[i].shape[0]);
        if (t[i].ndim > 1) len += (size_t)snprintf(h + len, cap - len, ",%lld", (long long)t[i].shape[1]);
        len += (size_t)snprintf(h + len, cap - len, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", off, off + bytes);
        off += bytes;
    }
    len += (size_t)snprintf(h + len, cap - len, "}");
    while (len % 8) h[len++] = ' '; /* the data starts 8-byte aligned */
    FILE *f = fopen(tmp, "wb");
    cpar_status st = f ? CPAR_OK : fail("train: cannot write %s: %s", tmp, strerror(errno));
    unsigned char le[8];
    for (int i = 0; i < 8; i++) le[i] = (unsigned char)((uint64_t)len >> (8 * i));
    if (f && (fwrite(le, 1, 8, f) != 8 || fwrite(h, 1, len, f) != len)) st = fail("train: cannot write %s", tmp);
    /* A test's fault injection: die by SIGKILL halfway through writing a file
     * whose path contains $TRAIN_TEST_KILL_IN_SAVE (tests/test_trainjob.c: a
     * re-save killed midway leaves the previous checkpoint whole). */
    const char *kill_in = getenv("TRAIN_TEST_KILL_IN_SAVE");
    for (int i = 0; f && st == CPAR_OK && i < n; i++) {
        size_t count = (size_t)t[i].shape[0] * (size_t)(t[i].ndim > 1 ? t[i].shape[1] : 1);
        if (fwrite(t[i].data, sizeof(float), count, f) != count) st = fail("train: cannot write %s", tmp);
        if (kill_in && *kill_in && strstr(path, kill_in) && i == n / 2) {
            fflush(f);
            raise(SIGKILL);
        }
    }
    if (f && st == CPAR_OK && (fflush(f) != 0 || fsync(fileno(f)) != 0))
        st = fail("train: cannot write %s: %s", tmp, strerror(errno));
    if (f && fclose(f) != 0 && st == CPAR_OK) st = fail("train: cannot write %s: %s", tmp, strerror(errno));
    if (st == CPAR_OK && rename(tmp, path) != 0)
        st = fail("train: cannot rename %s to %s: %s", tmp, path, strerror(errno));
    if (st == CPAR_OK) sync_parent(path);
    else if (f) remove(tmp);
    free(h);
    return st;
}

/* A safetensors file read whole: its JSON header and where the data starts. */
typedef struct {
    char *buf;
    size_t size;
    const char *json, *json_end;
    const unsigned char *data;
} st_file;

static cpar_status st_check(const char *path, st_file *f);

/* Read path whole and check it (st_check) before anything trusts it. */
static cpar_status st_read(const char *path, st_file *f) {
    memset(f, 0, sizeof *f);
    struct stat sb;
    if (stat(path, &sb) != 0) return fail("train: cannot open %s: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode)) return fail("train: %s is not a regular file", path);
    if (sb.st_size < 16 || (uint64_t)sb.st_size > ((uint64_t)1 << 40))
        return fail("train: %s is not a safetensors file (%lld bytes)", path, (long long)sb.st_size);
    FILE *fp = fopen(path, "rb");
    if (!fp) return fail("train: cannot open %s: %s", path, strerror(errno));
    const size_t size = (size_t)sb.st_size;
    f->buf = malloc(size + 1);
    if (!f->buf || fread(f->buf, 1, size, fp) != size) {
        fclose(fp);
        free(f->buf);
        f->buf = NULL;
        return fail("train: cannot read %s", path);
    }
    fclose(fp);
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++) hl |= (uint64_t)(unsigned char)f->buf[i] << (8 * i);
    /* safetensors bounds the header at 100 MB */
    if (hl < 2 || hl > (uint64_t)100 << 20 || hl > (uint64_t)size - 8) {
        free(f->buf);
        f->buf = NULL;
        return fail("train: %s is not a safetensors file (header of %llu bytes in a file of %zu)", path,
                    (unsigned long long)hl, size);
    }
    f->size = size;
    f->json = f->buf + 8, f->json_end = f->json + hl;
    f->data = (const unsigned char *)f->json_end;
    cpar_status st = st_check(path, f);
    if (st != CPAR_OK) {
        free(f->buf);
        f->buf = NULL;
    }
    return st;
}

/* ---- a small JSON reader for the header: objects of strings, numbers, arrays ---- */

static const char *js_ws(const char *p, const char *e) {
    while (p < e && (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r')) p++;
    return p;
}

/* A string at p into out (escapes kept as the character after '\\'); returns past it, or NULL. */
static const char *js_string(const char *p, const char *e, char *out, size_t cap) {
    size_t n = 0;
    if (p >= e || *p != '"') return NULL;
    for (p++; p < e && *p != '"'; p++) {
        if (*p == '\\' && p + 1 < e) p++;
        if (n + 1 < cap) out[n++] = *p;
    }
    if (cap) out[n] = 0;
    return p < e ? p + 1 : NULL;
}

/* Skip one value (string, number, array, object, literal), nested at most
 * JS_DEPTH deep: iterative, so no header can exhaust the stack. */
#define JS_DEPTH 64
static const char *js_skip(const char *p, const char *e) {
    char open[JS_DEPTH]; /* the brackets still open */
    int depth = 0;
    for (;;) {
        p = js_ws(p, e);
        if (p >= e) return NULL;
        if (depth && *p == (open[depth - 1] == '{' ? '}' : ']')) { /* the container ends */
            p++;
            depth--;
        } else {
            if (depth && open[depth - 1] == '{') { /* a member: "key": value */
                if (!(p = js_string(p, e, NULL, 0))) return NULL;
                p = js_ws(p, e);
                if (p >= e || *p != ':') return NULL;
                p = js_ws(p + 1, e);
                if (p >= e) return NULL;
            }
            if (*p == '{' || *p == '[') {
                if (depth == JS_DEPTH) return NULL;
                open[depth++] = *p++;
                continue;
            }
            if (*p == '"') {
                if (!(p = js_string(p, e, NULL, 0))) return NULL;
            } else {
                const char *v = p;
                while (p < e && *p != ',' && *p != '}' && *p != ']' && *p != ' ' && *p != '\n' && *p != '\t' &&
                       *p != '\r')
                    p++;
                if (p == v) return NULL; /* an empty value */
            }
        }
        if (!depth) return p;
        p = js_ws(p, e);
        if (p < e && *p == ',') {
            p = js_ws(p + 1, e);
            if (p < e && (*p == '}' || *p == ']')) return NULL; /* a trailing comma */
        } else if (p >= e || *p != (open[depth - 1] == '{' ? '}' : ']')) {
            return NULL;
        }
    }
}

/* The value of key in the object at p (or NULL). */
static const char *js_find(const char *p, const char *e, const char *key) {
    p = js_ws(p, e);
    if (p >= e || *p != '{') return NULL;
    for (p = js_ws(p + 1, e); p < e && *p != '}';) {
        char k[128];
        if (!(p = js_string(p, e, k, sizeof k))) return NULL;
        p = js_ws(p, e);
        if (p >= e || *p != ':') return NULL;
        p = js_ws(p + 1, e);
        if (!strcmp(k, key)) return p;
        if (!(p = js_skip(p, e))) return NULL;
        p = js_ws(p, e);
        if (p < e && *p == ',') p = js_ws(p + 1, e);
    }
    return NULL;
}

/* An array of up to cap integers at p; returns their number, -1 if malformed. */
static int js_ints(const char *p, const char *e, int64_t *out, int cap) {
    int n = 0;
    p = js_ws(p, e);
    if (!p || p >= e || *p != '[') return -1;
    for (p = js_ws(p + 1, e); p < e && *p != ']';) {
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || n == cap) return -1;
        out[n++] = v;
        p = js_ws(end, e);
        if (p < e && *p == ',') p = js_ws(p + 1, e);
    }
    return p < e ? n : -1;
}

/* Metadata value of key (a string) into out; false when absent. */
static bool st_meta(const st_file *f, const char *key, char *out, size_t cap) {
    const char *m = js_find(f->json, f->json_end, "__metadata__");
    const char *v = m ? js_find(m, f->json_end, key) : NULL;
    return v && js_string(v, f->json_end, out, cap);
}

/* Bytes per element of a safetensors dtype, 0 for one it does not define. */
static int st_dtype_size(const char *dt) {
    static const struct { const char *name; int size; } t[] = {
        {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},
        {"U64", 8}, {"U32", 4}, {"U16", 2}, {"U8", 1}, {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(dt, t[i].name)) return t[i].size;
    return 0;
}

typedef struct {
    uint64_t begin, end;
} st_span;

static int st_span_cmp(const void *a, const void *b) {
    const st_span *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* Every promise of the header kept, before anything reads the data: one
 * JSON object spanning the header (nested at most JS_DEPTH deep; trailing
 * spaces allowed), each tensor with a known dtype, a shape of 0-8
 * non-negative dims and data_offsets [begin, end] with begin <= end <= the
 * data's size and end - begin the dtype's size times the shape's product,
 * no two tensors overlapping, and the data's CRC-32 equal to the metadata's
 * data_crc32 when it has one (cpar's files do). */
static cpar_status st_check(const char *path, st_file *f) {
    const char *e = f->json_end, *p = js_ws(f->json, e), *end = js_skip(p, e);
    if (!end || *p != '{' || js_ws(end, e) != e)
        return fail("train: %s: the header is not one JSON object (unterminated, nested over %d deep, or followed by "
                    "other bytes)", path, JS_DEPTH);
    const uint64_t data_size = (uint64_t)(f->size - 8 - (size_t)(e - f->json));
    st_span *spans = NULL;
    int nspans = 0, cap = 0;
    cpar_status st = CPAR_OK;
    for (p = js_ws(p + 1, e); st == CPAR_OK && p < e && *p != '}';) {
        char key[160], dt[16] = "";
        p = js_ws(js_string(p, e, key, sizeof key), e) + 1; /* the ':' (the header parsed above) */
        const char *v = js_ws(p, e);
        p = js_ws(js_skip(v, e), e);
        if (*p == ',') p = js_ws(p + 1, e);
        if (!strcmp(key, "__metadata__")) continue;
        const char *d = js_find(v, e, "dtype");
        int64_t shape[8], offs[2];
        int nd = js_ints(js_find(v, e, "shape"), e, shape, 8), es = d && js_string(d, e, dt, sizeof dt) ? st_dtype_size(dt) : 0;
        uint64_t numel = 1;
        for (int i = 0; i < nd; i++) {
            if (shape[i] < 0 || (shape[i] && numel > data_size / (uint64_t)shape[i])) nd = -1;
            else numel *= (uint64_t)shape[i];
        }
        if (!es) st = fail("train: %s: tensor \"%s\" has dtype \"%s\", not a safetensors dtype", path, key, dt);
        else if (nd < 0) st = fail("train: %s: tensor \"%s\" has a bad shape", path, key);
        else if (js_ints(js_find(v, e, "data_offsets"), e, offs, 2) != 2 || offs[0] < 0 || offs[1] < offs[0] ||
                 (uint64_t)offs[1] > data_size || (uint64_t)(offs[1] - offs[0]) != numel * (uint64_t)es)
            st = fail("train: %s: tensor \"%s\" has bad data_offsets (outside the %llu bytes of data, or not its "
                      "size)", path, key, (unsigned long long)data_size);
        if (st == CPAR_OK && nspans == cap) {
            cap = cap ? 2 * cap : 64;
            st_span *grown = realloc(spans, (size_t)cap * sizeof *spans);
            if (!grown) st = CPAR_ERR_OOM;
            else spans = grown;
        }
        if (st == CPAR_OK) spans[nspans++] = (st_span){(uint64_t)offs[0], (uint64_t)offs[1]};
    }
    if (st == CPAR_OK && nspans) {
        qsort(spans, (size_t)nspans, sizeof *spans, st_span_cmp);
        for (int i = 1; i < nspans && st == CPAR_OK; i++)
            if (spans[i].begin < spans[i - 1].end) st = fail("train: %s: two tensors share data", path);
    }
    free(spans);
    char want[16];
    if (st == CPAR_OK && st_meta(f, "data_crc32", want, sizeof want)) {
        char got[16];
        snprintf(got, sizeof got, "%08x", crc32_update(0, f->data, (size_t)data_size));
        if (strcmp(got, want))
            st = fail("train: %s is damaged: its data's CRC-32 is %s, the header says %s", path, got, want);
    }
    return st;
}

/* Tensor name as fp32 of the expected numel into out (copied: the file's data need not be aligned). */
static cpar_status st_get(const st_file *f, const char *path, const char *name, int64_t rows, int64_t cols, float *out) {
    const char *t = js_find(f->json, f->json_end, name);
    const char *dt = t ? js_find(t, f->json_end, "dtype") : NULL;
    char dts[16] = "";
    int64_t shape[4], offs[2];
    int nd = t ? js_ints(js_find(t, f->json_end, "shape"), f->json_end, shape, 4) : -1;
    if (!t) return fail("train: %s has no tensor \"%s\"", path, name);
    if (!dt || !js_string(dt, f->json_end, dts, sizeof dts) || strcmp(dts, "F32"))
        return fail("train: %s: \"%s\" has dtype %s, expected F32", path, name, dts);
    const bool shape_ok = cols ? nd == 2 && shape[0] == rows && shape[1] == cols : nd == 1 && shape[0] == rows;
    if (!shape_ok)
        return fail("train: %s: \"%s\" has shape [%lld%s%lld], expected [%lld%s%lld] (another model size?)", path,
                    name, nd > 0 ? (long long)shape[0] : -1LL, nd > 1 ? "," : "", nd > 1 ? (long long)shape[1] : 0LL,
                    (long long)rows, cols ? "," : "", (long long)cols);
    const size_t bytes = sizeof(float) * (size_t)rows * (size_t)(cols ? cols : 1);
    if (js_ints(js_find(t, f->json_end, "data_offsets"), f->json_end, offs, 2) != 2 || offs[0] < 0 ||
        offs[1] < offs[0] || offs[1] - offs[0] != (int64_t)bytes ||
        (size_t)offs[1] > f->size - (size_t)(f->data - (const unsigned char *)f->buf))
        return fail("train: %s: \"%s\" has bad data offsets", path, name);
    memcpy(out, f->data + offs[0], bytes);
    return CPAR_OK;
}

/* This rank's piece of every tensor gathered over tp into full host arrays. */
static cpar_status gather_full(model *md, const param *p, const cpar_tensor *local, float *full) {
    const int64_t n = cpar_tensor_numel(local);
    if (p->dim < 0 || md->ntp == 1) return tensor_to_host(md->ctx, local, full);
    const int64_t gn = n * md->ntp;
    cpar_tensor flat = cpar_tensor_make(local->data, CPAR_F32, 1, &n, local->device), all;
    TRY(cpar_tensor_alloc(md->ctx, CPAR_F32, 1, &gn, &all));
    float *buf = malloc(sizeof(float) * (size_t)gn);
    cpar_status st = buf ? cpar_all_gather(md->tp, &flat, &all, NULL) : CPAR_ERR_OOM;
    if (st == CPAR_OK) st = tensor_to_host(md->ctx, &all, buf);
    for (int r = 0; st == CPAR_OK && r < md->ntp; r++) shard_copy(p, md->ntp, r, full, buf + (int64_t)r * n, true);
    free(buf);
    cpar_tensor_free(md->ctx, &all);
    return st;
}

static void meta_string(const model *md, int64_t step, char *out, size_t cap) {
    const options *o = md->o;
    snprintf(out, cap, "\"format\":\"cpar-gpt\",\"step\":\"%lld\",\"layers\":\"%d\",\"hidden\":\"%d\",\"heads\":\"%d\","
             "\"seq\":\"%d\",\"vocab\":\"%d\",\"seed\":\"%llu\"", (long long)step, o->layers, o->hidden, o->heads, o->seq,
             VOCAB, (unsigned long long)o->seed);
}

static cpar_status make_dir(const char *path) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            mkdir(tmp, 0755);
            *p = '/';
        }
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return fail("train: cannot create %s: %s", path, strerror(errno));
    return CPAR_OK;
}

/* Every rank takes part (the gathers); world rank 0 writes. *where gets the directory. */
static cpar_status checkpoint_save(model *md, int64_t step, char *where, size_t cap) {
    const bool writer = cpar_rank(md->ctx) == 0;
    st_tensor *w = calloc((size_t)md->np, sizeof *w), *mv = calloc(2 * (size_t)md->np, sizeof *mv);
    float **bufs = calloc(3 * (size_t)md->np, sizeof *bufs);
    cpar_status st = w && mv && bufs ? CPAR_OK : CPAR_ERR_OOM;
    for (int i = 0; st == CPAR_OK && i < md->np; i++) {
        const param *p = &md->P[i];
        const cpar_tensor *src[3] = {&p->master, &p->m, &p->v};
        st_tensor *dst[3] = {&w[i], &mv[2 * i], &mv[2 * i + 1]};
        static const char *const prefix[3] = {"", "exp_avg.", "exp_avg_sq."};
        for (int k = 0; k < 3 && st == CPAR_OK; k++) {
            bufs[3 * i + k] = malloc(sizeof(float) * (size_t)full_numel(p));
            if (!bufs[3 * i + k]) st = CPAR_ERR_OOM;
            else st = gather_full(md, p, src[k], bufs[3 * i + k]);
            snprintf(dst[k]->name, sizeof dst[k]->name, "%s%s.weight", prefix[k], p->name);
            dst[k]->shape[0] = p->rows, dst[k]->shape[1] = p->cols, dst[k]->ndim = p->cols ? 2 : 1;
            dst[k]->data = bufs[3 * i + k];
        }
    }
    snprintf(where, cap, "%s/step_%06lld", md->o->save, (long long)step);
    if (st == CPAR_OK && writer) {
        char meta[512], path[4200];
        meta_string(md, step, meta, sizeof meta);
        st = make_dir(where);
        snprintf(path, sizeof path, "%s/model.safetensors", where);
        if (st == CPAR_OK) st = st_write(path, w, md->np, meta);
        snprintf(path, sizeof path, "%s/optimizer.safetensors", where);
        if (st == CPAR_OK) st = st_write(path, mv, 2 * md->np, meta);
        /* Megatron's marker of the latest complete checkpoint, written last */
        char tmp[4300];
        snprintf(path, sizeof path, "%s/" LATEST_MARKER, md->o->save);
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        FILE *f = st == CPAR_OK ? fopen(tmp, "w") : NULL;
        if (st == CPAR_OK && (!f || fprintf(f, "%lld\n", (long long)step) < 0 || fflush(f) || fsync(fileno(f))))
            st = fail("train: cannot write %s: %s", tmp, strerror(errno));
        if (f && fclose(f) != 0 && st == CPAR_OK) st = fail("train: cannot write %s: %s", tmp, strerror(errno));
        if (st == CPAR_OK && rename(tmp, path) != 0) st = fail("train: cannot rename %s: %s", tmp, strerror(errno));
        if (st == CPAR_OK) sync_parent(path);
    }
    for (int i = 0; bufs && i < 3 * md->np; i++) free(bufs[i]);
    free(bufs), free(w), free(mv);
    return st;
}

/* Load dir's checkpoint into every rank's shards; *step: the steps it had done. */
static cpar_status checkpoint_load(model *md, const char *dir, int64_t *step) {
    char path[2][4200], val[64];
    st_file f[2];
    snprintf(path[0], sizeof path[0], "%s/model.safetensors", dir);
    snprintf(path[1], sizeof path[1], "%s/optimizer.safetensors", dir);
    TRY(st_read(path[0], &f[0]));
    cpar_status st = st_read(path[1], &f[1]);
    if (st != CPAR_OK) {
        free(f[0].buf);
        return st;
    }
    const options *o = md->o;
    const struct { const char *key; long long want; } shape[] = {
        {"layers", o->layers}, {"hidden", o->hidden}, {"heads", o->heads}, {"seq", o->seq}, {"vocab", VOCAB}};
    for (size_t k = 0; st == CPAR_OK && k < sizeof shape / sizeof shape[0]; k++)
        if (!st_meta(&f[0], shape[k].key, val, sizeof val) || atoll(val) != shape[k].want)
            st = fail("train: %s was saved with %s %s, this run has %lld: pass the same --%s", path[0], shape[k].key,
                      st_meta(&f[0], shape[k].key, val, sizeof val) ? val : "(missing)", shape[k].want, shape[k].key);
    if (st == CPAR_OK && !st_meta(&f[0], "step", val, sizeof val)) st = fail("train: %s has no step", path[0]);
    if (st == CPAR_OK) {
        char *endp;
        errno = 0;
        long long v = strtoll(val, &endp, 10);
        if (errno || endp == val || *endp || v < 0 || v > (1LL << 40))
            st = fail("train: %s has step \"%s\", expected a number from 0 to 2^40", path[0], val);
        else if (v >= o->steps)
            st = fail("train: %s was saved after step %lld: --steps %d leaves nothing to train (raise --steps)",
                      path[0], v, o->steps);
        else *step = v;
    }
    for (int i = 0; st == CPAR_OK && i < md->np; i++) {
        param *p = &md->P[i];
        const int64_t n = full_numel(p), ln = cpar_tensor_numel(&p->w);
        float *full = malloc(sizeof(float) * (size_t)n), *shard = malloc(sizeof(float) * (size_t)ln);
        char name[96];
        st = full && shard ? CPAR_OK : CPAR_ERR_OOM;
        snprintf(name, sizeof name, "%s.weight", p->name);
        if (st == CPAR_OK) st = st_get(&f[0], path[0], name, p->rows, p->cols, full);
        if (st == CPAR_OK) st = param_load(md, p, full);
        cpar_tensor *moments[2] = {&p->m, &p->v};
        static const char *const prefix[2] = {"exp_avg.", "exp_avg_sq."};
        for (int k = 0; k < 2 && st == CPAR_OK; k++) {
            snprintf(name, sizeof name, "%s%s.weight", prefix[k], p->name);
            st = st_get(&f[1], path[1], name, p->rows, p->cols, full);
            if (st == CPAR_OK) {
                shard_copy(p, md->ntp, md->tpr, full, shard, false);
                st = host_to_tensor(md->ctx, shard, moments[k]);
            }
        }
        free(full), free(shard);
    }
    free(f[0].buf), free(f[1].buf);
    return st;
}

/* ==== the job ==================================================================== */

typedef struct {
    const options *o;
    const dataset *d;
    int64_t first, last; /* run steps [first, last) of a schedule o->steps long */
    bool check;          /* the verification: train only, print nothing, record losses */
    double *losses;      /* [o->steps] the losses (rank 0) */
} job;

static void print_header(const model *md, cpar_ctx *ctx) {
    const options *o = md->o;
    printf("model: %d layers, hidden %d, %d heads, sequence %d, vocabulary %d bytes: %.2fM parameters\n", o->layers,
           o->hidden, o->heads, o->seq, VOCAB, (double)md->nparams_total / 1e6);
    printf("grid: tp %d x cp %d x dp %d = %d ranks on the %s backend (%s), %s; %lld tokens per step "
           "(%d sequences x %d)\n", md->ntp, md->ncp, md->ndp, cpar_world_size(ctx),
           cpar_backend_name(cpar_ctx_backend(ctx)), cpar_device(ctx) == CPAR_HOST ? "host memory" : "GPUs",
           cpar_dtype_name(md->dt), (long long)(md->S * md->train.B * md->ndp), (int)(md->train.B * md->ndp), o->seq);
    if (md->ncp > 1) {
        const cpar_ring_attention_config rc = ring_config(md);
        printf("context parallelism: %s", cpar_cp_comm_type_name(rc.comm_type));
        if (rc.comm_type == CPAR_CP_A2A_P2P)
            printf(" (all-to-all in groups of %d ranks, a ring of %d across them)", rc.a2a_size, md->ncp / rc.a2a_size);
        printf(", causal, load-balanced\n");
    }
    printf("optimizer: AdamW (0.9, 0.95), lr %g, warm-up %d, cosine to %g over %d steps, weight decay %g, clip %g\n",
           (double)o->lr, o->warmup, (double)o->lr / 10, o->steps, (double)o->weight_decay, (double)o->clip);
}

static cpar_status rank_main(cpar_ctx *ctx, void *arg) {
    job *j = arg;
    const options *o = j->o;
    cpar_grid_config gc = {.tp = o->tp, .cp = o->cp};
    TRY(cpar_grid_init(ctx, &gc));
    if (cpar_grid_size(ctx, CPAR_GROUP_DP) != o->dp)
        return fail("train: %d ranks make dp %d with tp %d x cp %d, but --dp is %d", cpar_world_size(ctx),
                    cpar_grid_size(ctx, CPAR_GROUP_DP), o->tp, o->cp, o->dp);
    model md;
    cpar_status st = model_create(ctx, o, &md);
    const bool talk = !j->check && cpar_rank(ctx) == 0;
    const bool gpu = cpar_ctx_backend(ctx) == CPAR_BACKEND_NCCL; /* model FLOP/s: a GPU figure */
    int64_t first = j->first;
    if (st == CPAR_OK && o->resume && !j->check) {
        st = checkpoint_load(&md, o->resume, &first);
        if (st == CPAR_OK && talk) printf("resumed from %s after step %lld\n", o->resume, (long long)first);
    }
    if (st == CPAR_OK && talk) print_header(&md, ctx);
    const double tokens = (double)(md.S * md.train.B * md.ndp);
    /* training FLOPs per token: 6 per parameter plus attention's 6 * 2 * layers * seq * hidden (causal half) */
    const double flops_per_token = 6.0 * (double)md.nparams_total + 6.0 * o->layers * o->seq * o->hidden;
    double t_train = 0.0, last_loss = 0.0, last_val = NAN;
    int64_t done = 0;
    for (int64_t step = first; st == CPAR_OK && step < j->last; step++) {
        const double t0 = now_s();
        double loss = 0.0;
        float lr = 0.f, norm = 0.f;
        st = load_train_batch(&md, j->d, step);
        if (st == CPAR_OK) st = zero_grads(&md);
        if (st == CPAR_OK) st = forward(&md, &md.train, true);
        if (st == CPAR_OK) st = mean_loss(&md, &md.train, &loss);
        if (st == CPAR_OK) st = backward(&md, &md.train);
        if (st == CPAR_OK) st = optimizer_step(&md, step, &lr, &norm);
        if (st == CPAR_OK) st = cpar_sync(ctx);
        /* Megatron's check: a non-finite loss or gradient norm stops the run
         * (every rank holds the same reduced values, so all stop together) */
        static atomic_flag said = ATOMIC_FLAG_INIT; /* the first rank to stop says why */
        if (st == CPAR_OK && (!isfinite(loss) || !isfinite(norm))) {
            st = CPAR_ERR_INVALID;
            if (!atomic_flag_test_and_set(&said))
                fail("train: step %lld: the loss is %g and the gradient norm %g: stopping (a learning rate too high, "
                     "or non-finite weights in the checkpoint?)", (long long)step + 1, loss, (double)norm);
        }
        const double dt = now_s() - t0;
        t_train += dt, done++, last_loss = loss;
        if (st == CPAR_OK && cpar_rank(ctx) == 0 && j->losses) j->losses[step] = loss;
        const int every = o->log_every ? o->log_every : o->steps <= 100 ? 1 : 10;
        const bool line = step == first || step + 1 == j->last || (step + 1) % every == 0;
        if (st == CPAR_OK && talk && line) {
            printf("step %5lld/%d | loss %.4f | lr %.2e | grad norm %6.3f | %7.1f ms | %8.0f tok/s", (long long)step + 1,
                   o->steps, loss, (double)lr, (double)norm, dt * 1e3, tokens / dt);
            if (gpu) printf(" | %.1f TFLOP/s", flops_per_token * tokens / dt / 1e12);
            printf("\n");
        }
        if (st == CPAR_OK && !j->check && o->eval_every && (step + 1) % o->eval_every == 0 && step + 1 < j->last) {
            st = evaluate(&md, j->d, &last_val);
            if (st == CPAR_OK && talk) printf("step %5lld | validation loss %.4f\n", (long long)step + 1, last_val);
        }
        if (st == CPAR_OK && !j->check && o->save && o->save_every && (step + 1) % o->save_every == 0 &&
            step + 1 < j->last) {
            char where[4096];
            st = checkpoint_save(&md, step + 1, where, sizeof where);
            if (st == CPAR_OK && talk) printf("step %5lld | saved %s\n", (long long)step + 1, where);
        }
    }
    if (st == CPAR_OK && !j->check) {
        st = evaluate(&md, j->d, &last_val);
        if (st == CPAR_OK && talk) printf("step %5lld | validation loss %.4f\n", (long long)j->last, last_val);
        if (st == CPAR_OK && o->save) {
            char where[4096];
            st = checkpoint_save(&md, j->last, where, sizeof where);
            if (st == CPAR_OK && talk) printf("step %5lld | saved %s\n", (long long)j->last, where);
        }
        if (st == CPAR_OK && o->sample > 0) {
            const size_t plen = strlen(o->prompt);
            char *text = malloc(plen + (size_t)o->sample + 2);
            st = text ? CPAR_OK : CPAR_ERR_OOM;
            if (st == CPAR_OK) {
                memcpy(text, o->prompt, plen + 1);
                if (!plen) text[0] = '\n'; /* an empty prompt starts at a line */
                st = sample(&md, text, plen ? (int64_t)plen : 1, o->sample, o->seed);
            }
            if (st == CPAR_OK && talk) printf("sample (temperature %g, top-k %d):\n---\n%s\n---\n", (double)o->temperature,
                                              o->top_k, text);
            free(text);
        }
        if (st == CPAR_OK && talk && done > 0)
            printf("done: %lld steps in %.1f s (%.1f ms/step, %.0f tokens/s); train loss %.4f, validation loss %.4f\n",
                   (long long)done, t_train, t_train / (double)done * 1e3, tokens * (double)done / t_train, last_loss,
                   last_val);
    }
    model_destroy(&md);
    return st;
}

/* The grid for a few steps against one rank on the same global batch: the
 * same losses (relative 1e-5 in f32) or the parallel code has a bug. */
static int verify(const options *o, const dataset *d) {
    const int steps = o->verify < o->steps ? o->verify : o->steps;
    options one = *o;
    one.tp = one.cp = one.dp = 1, one.batch = o->batch * o->dp;
    double *ref = calloc((size_t)o->steps + 1, sizeof *ref), *par = calloc((size_t)o->steps + 1, sizeof *par);
    job jr = {.o = &one, .d = d, .first = 0, .last = steps, .check = true, .losses = ref};
    job jp = {.o = o, .d = d, .first = 0, .last = steps, .check = true, .losses = par};
    const double t0 = now_s();
    cpar_status st = cpar_spawn(1, o->backend, rank_main, &jr);
    if (st == CPAR_OK) st = cpar_spawn(o->tp * o->cp * o->dp, o->backend, rank_main, &jp);
    if (st != CPAR_OK) {
        fprintf(stderr, "train: verification failed: %s\n", cpar_thread_last_error());
        free(ref), free(par);
        return 1;
    }
    const double tol = o->dtype == CPAR_F32 ? 1e-5 : 3e-2;
    double worst = 0.0;
    for (int s = 0; s < steps; s++) worst = fmax(worst, fabs(par[s] - ref[s]) / fabs(ref[s]));
    printf("verify: tp %d x cp %d x dp %d against 1 rank, %d steps: losses", o->tp, o->cp, o->dp, steps);
    for (int s = 0; s < steps; s++) printf(" %.6f/%.6f", par[s], ref[s]);
    printf("; max relative difference %.2e (tolerance %.0e): %s (%.1f s)\n\n", worst, tol,
           worst <= tol ? "match" : "MISMATCH", now_s() - t0);
    free(ref), free(par);
    return worst <= tol ? 0 : 1;
}

/* --resume DIR: a checkpoint (DIR/model.safetensors), or a --save folder:
 * the step its latest_checkpointed_iteration.txt names (written after the
 * step's files, as Megatron's), else its latest complete step_NNNNNN (both
 * files there, neither empty), as Megatron's --load. 0, or 1 with the
 * reason printed. */
static int resume_resolve(options *o) {
    static char found[4200];
    struct stat sb;
    char path[4400];
    snprintf(path, sizeof path, "%s/model.safetensors", o->resume);
    if (stat(path, &sb) == 0) return 0;
    DIR *dir = opendir(o->resume);
    if (!dir) {
        fprintf(stderr, "train: --resume %s: %s\n", o->resume, strerror(errno));
        return 1;
    }
    long long best = -1, marked = -1;
    int complete = 0;
    snprintf(path, sizeof path, "%s/" LATEST_MARKER, o->resume);
    FILE *mf = fopen(path, "r");
    if (mf) {
        if (fscanf(mf, "%lld", &marked) != 1) marked = -1;
        fclose(mf);
    }
    for (struct dirent *e; (e = readdir(dir));) {
        long long step;
        char tail;
        if (sscanf(e->d_name, "step_%lld%c", &step, &tail) != 1 || step < 0) continue;
        bool ok = true;
        for (int k = 0; k < 2 && ok; k++) {
            snprintf(path, sizeof path, "%s/%s/%s.safetensors", o->resume, e->d_name, k ? "optimizer" : "model");
            ok = stat(path, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size > 0;
        }
        if (!ok) continue;
        complete++;
        if (best == marked) continue; /* the marker names a complete one: that one */
        if (step > best || step == marked) {
            best = step;
            snprintf(found, sizeof found, "%s/%s", o->resume, e->d_name);
        }
    }
    closedir(dir);
    if (best < 0) {
        fprintf(stderr, "train: --resume %s: no checkpoint there (neither model.safetensors nor a step_NNNNNN "
                "folder holding model.safetensors and optimizer.safetensors)\n", o->resume);
        return 1;
    }
    const char *rank = getenv("RANK") ? getenv("RANK") : getenv("SLURM_PROCID");
    if (!rank || !strcmp(rank, "0"))
        printf("resume: %s, the latest of %d complete checkpoint%s in %s\n", found, complete, complete == 1 ? "" : "s",
               o->resume);
    o->resume = found;
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* readable progress through pipes too */
    options o;
    int r = parse_options(argc, argv, &o);
    if (r) return r == 1 ? 0 : 2;
    if (o.resume && resume_resolve(&o)) return 1;
    dataset d;
    if (data_load(&o, &d) != CPAR_OK) return 1;
    double *losses = calloc((size_t)o.steps + 1, sizeof *losses);
    job j = {.o = &o, .d = &d, .first = 0, .last = o.steps, .losses = losses};
    const char *ws = getenv("WORLD_SIZE") ? getenv("WORLD_SIZE") : getenv("SLURM_NTASKS");
    cpar_status st;
    if (ws && atoi(ws) > 1) { /* one rank per process: cparrun, torchrun, SLURM */
        cpar_init_config cfg = {.backend = o.backend};
        cpar_ctx *ctx = NULL;
        st = cpar_init_from_env(&cfg, &ctx);
        if (st == CPAR_OK) {
            st = rank_main(ctx, &j);
            if (st != CPAR_OK) fprintf(stderr, "train: rank %d: %s\n", cpar_rank(ctx), cpar_last_error(ctx));
            cpar_finalize(ctx);
        } else {
            fprintf(stderr, "train: %s\n", cpar_thread_last_error());
        }
    } else {
        if (o.verify > 0 && o.tp * o.cp * o.dp > 1 && !o.resume && verify(&o, &d)) return 1;
        cpar_init_config cfg = {.backend = o.backend};
        st = cpar_spawn_with(o.tp * o.cp * o.dp, &cfg, rank_main, &j);
        if (st != CPAR_OK) fprintf(stderr, "train: %s\n", cpar_thread_last_error());
    }
    free(losses);
    free(d.bytes);
    return st == CPAR_OK ? 0 : 1;
}
