/* SPDX-License-Identifier: MIT */
/* lm_check.c — a test program (make test runs it on every flavour): train a
 * small transformer language model on a synthetic language with tensor,
 * sequence and context parallelism, and check that the parallel run matches
 * the single-rank run step for step and that the loss fell. (It was cpar's
 * first main job; examples/train.c is the real one.)
 *
 * The model is a pre-norm decoder (Megatron's layer order, RMSNorm, no
 * biases, no position embedding: causal attention alone orders the tokens):
 *
 *   ids -> VocabParallelEmbedding -> LAYERS x [ x += proj(attn(qkv(norm1(x))))
 *                                               x += fc2(gelu(fc1(norm2(x)))) ]
 *       -> norm_f -> output layer (column-parallel over the vocabulary)
 *       -> vocab-parallel cross entropy, mean over the sequence
 *
 * and it learns a synthetic language: every sequence follows
 * t[i+1] = (7 t[i] + 3) mod V from a random first token.
 *
 * The same code runs two jobs from the same master weights and data:
 *   reference  1 rank: tp = 1, cp = 1;
 *   parallel   4 ranks: tp = 2 x cp = 2 (threads on the host backend, one
 *              GPU each through NCCL when four GPUs are visible, else
 *              sharing the GPUs on the device backend).
 * In the parallel job the sequence is sharded over cp with causal load
 * balancing (rank r holds chunks r and 2cp-1-r), and within a cp rank over
 * tp by sequence parallelism: the residual stream of a rank is
 * [S/(cp tp), 1, H]. Column-parallel layers all-gather it along the
 * sequence, row-parallel layers reduce-scatter back; attention heads are
 * split over tp and the sequence over cp (ring attention). Gradients of
 * TP-sharded weights are summed over cp (the dp x cp group), those of the
 * replicated norm weights over every rank; SGD with momentum updates the
 * weights. The job prints both loss curves and fails (exit 1) unless they
 * agree and the loss fell.
 *
 * Environment: CPAR_LM_STEPS (default 30), CPAR_LM_LR (default 0.1),
 * CPAR_LM_BACKEND (host, nccl or device; default: nccl when four GPUs are
 * visible, device with fewer, host with none), CPAR_LM_DTYPE (f32, bf16 or f16;
 * default bf16 on devices, whose attention kernels take 16-bit inputs, f32
 * on the host). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpar.h"

enum {
    V = 64,       /* vocabulary */
    H = 64,       /* hidden size */
    HEADS = 4,    /* attention heads */
    D = H / HEADS,
    FFN = 4 * H,  /* MLP hidden size */
    LAYERS = 2,
    S = 64,       /* sequence length (global) */
    NRANKS = 4,   /* the parallel job: tp x cp */
    TP = 2,
    CP = 2,
    MAX_STEPS = 200,
    MAX_PARAMS = 6 * LAYERS + 3
};

#define TRY(call)                                                                                            \
    do {                                                                                                     \
        cpar_status st_ = (call);                                                                            \
        if (st_ != CPAR_OK) return st_;                                                                      \
    } while (0)

/* ---- master weights and data (host, fp32, the same for both jobs) ----------------- */

typedef struct {
    float *emb, *out, *norm_f;                          /* [V, H], [V, H], [H] */
    float *qkv[LAYERS], *proj[LAYERS], *fc1[LAYERS], *fc2[LAYERS];
    float *norm1[LAYERS], *norm2[LAYERS];
} master_weights;

static uint64_t next_u64(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* n values uniform in [center - half, center + half). */
static float *master_tensor(int64_t n, float center, float half, uint64_t seed) {
    float *p = malloc(sizeof(float) * (size_t)n);
    uint64_t s = seed;
    for (int64_t i = 0; i < n; i++)
        p[i] = center + half * (2.0f * (float)((double)(next_u64(&s) >> 11) / 9007199254740992.0) - 1.0f);
    return p;
}

static void master_init(master_weights *m) {
    const float w = 0.08f, o = 0.04f; /* weight spreads; outputs of residual branches smaller */
    m->emb = master_tensor(V * H, 0.f, 1.0f, 1);
    m->out = master_tensor(V * H, 0.f, w, 2);
    m->norm_f = master_tensor(H, 1.f, 0.1f, 3);
    for (int l = 0; l < LAYERS; l++) {
        m->qkv[l] = master_tensor(3 * H * H, 0.f, w, 10 + 10 * (uint64_t)l); /* [Wq; Wk; Wv] */
        m->proj[l] = master_tensor(H * H, 0.f, o, 11 + 10 * (uint64_t)l);
        m->fc1[l] = master_tensor(FFN * H, 0.f, w, 12 + 10 * (uint64_t)l);
        m->fc2[l] = master_tensor(H * FFN, 0.f, o, 13 + 10 * (uint64_t)l);
        m->norm1[l] = master_tensor(H, 1.f, 0.1f, 14 + 10 * (uint64_t)l);
        m->norm2[l] = master_tensor(H, 1.f, 0.1f, 15 + 10 * (uint64_t)l);
    }
}

static void master_free(master_weights *m) {
    free(m->emb), free(m->out), free(m->norm_f);
    for (int l = 0; l < LAYERS; l++)
        free(m->qkv[l]), free(m->proj[l]), free(m->fc1[l]), free(m->fc2[l]), free(m->norm1[l]), free(m->norm2[l]);
}

/* The sequence of step `step`: ids[0..S) as input, ids[1..S] as targets. */
static void make_sequence(int step, int64_t *ids) {
    uint64_t s = 1000 + (uint64_t)step;
    ids[0] = (int64_t)(next_u64(&s) % V);
    for (int i = 1; i <= S; i++) ids[i] = (7 * ids[i - 1] + 3) % V;
}

/* ---- the model on one rank ------------------------------------------------------------ */

typedef struct {
    cpar_linear *qkv, *proj, *fc1, *fc2;
    cpar_tensor norm1, norm2, dnorm1, dnorm2;
    /* activations kept for backward: [Sl,1,H] x a1 x2 a2; [Sc,1,3H/tp] qkv_out;
     * [3 hl, Sc, D] heads (q | k | v); [hl, Sc, D] o; [1, hl, Sc] lse;
     * [Sc,1,H/tp] attn; [Sl,1,H] p f; [Sc,1,FFN/tp] m g */
    cpar_tensor x, a1, qkv_out, heads, o, lse, attn, p, x2, a2, m, g;
} layer;

typedef struct {
    cpar_ctx *ctx;
    cpar_group *tp, *cp, *dp_cp, *world;
    cpar_dtype dt;
    int ntp, ncp, tpr;
    int64_t Sc, Sl, hl; /* tokens per cp rank, per (cp, tp) rank; heads per tp rank */
    cpar_embedding *emb;
    layer L[LAYERS];
    cpar_linear *out;
    cpar_tensor norm_f, dnorm_f;
    cpar_tensor xf, af, logits, loss, stats, dloss, loss_sum, ids, tgt;
    /* backward scratch */
    cpar_tensor dres, dtmp, dM, dA, dOh, dheads, dqkv;
    /* optimizer: one momentum buffer (F32) per parameter, and a cast buffer */
    int nparams;
    cpar_tensor w_view[MAX_PARAMS], g_view[MAX_PARAMS], mom[MAX_PARAMS], tmp32;
    bool replicated[MAX_PARAMS]; /* norm weights: the same on every rank */
} model;

static cpar_status alloc3(model *md, cpar_tensor *t, cpar_dtype dt, int64_t a, int64_t b, int64_t c) {
    const int64_t s[3] = {a, b, c};
    return cpar_tensor_alloc(md->ctx, dt, 3, s, t);
}

/* A host fp32 master array [n] into a tensor of the model's dtype on the device. */
static cpar_status upload_master(model *md, const float *src, int ndim, const int64_t *shape, cpar_tensor *t) {
    TRY(cpar_tensor_alloc(md->ctx, md->dt, ndim, shape, t));
    const int64_t n = cpar_tensor_numel(t);
    void *buf = malloc((size_t)n * cpar_dtype_size(md->dt));
    if (!buf) return CPAR_ERR_OOM;
    for (int64_t i = 0; i < n; i++) {
        if (md->dt == CPAR_F32) ((float *)buf)[i] = src[i];
        else ((uint16_t *)buf)[i] = md->dt == CPAR_BF16 ? cpar_f32_to_bf16(src[i]) : cpar_f32_to_f16(src[i]);
    }
    cpar_tensor h = cpar_tensor_make(buf, md->dt, ndim, shape, CPAR_HOST);
    cpar_status st = cpar_tensor_copy(md->ctx, &h, t);
    if (st == CPAR_OK) st = cpar_sync(md->ctx); /* buf is read asynchronously on GPUs */
    free(buf);
    return st;
}

static cpar_status make_linear(model *md, bool row, int64_t in, int64_t out, int stride, const float *master,
                               cpar_linear **l) {
    cpar_linear_config cfg = {.input_size = in, .output_size = out, .dtype = md->dt, .sequence_parallel = true,
                              .input_is_parallel = row, .stride = stride};
    TRY(row ? cpar_row_parallel_linear_create(md->tp, &cfg, l) : cpar_column_parallel_linear_create(md->tp, &cfg, l));
    const int64_t ms[2] = {out, in};
    cpar_tensor mt = cpar_tensor_make((void *)master, CPAR_F32, 2, ms, CPAR_HOST);
    return cpar_linear_init_from_master(*l, &mt, NULL);
}

static void add_param(model *md, cpar_tensor w, cpar_tensor g, bool replicated) {
    md->w_view[md->nparams] = w;
    md->g_view[md->nparams] = g;
    md->replicated[md->nparams] = replicated;
    md->nparams++;
}

static cpar_status model_create(cpar_ctx *ctx, cpar_dtype dt, const master_weights *mw, model *md) {
    memset(md, 0, sizeof *md);
    md->ctx = ctx, md->dt = dt;
    md->tp = cpar_grid_group(ctx, CPAR_GROUP_TP), md->cp = cpar_grid_group(ctx, CPAR_GROUP_CP);
    md->dp_cp = cpar_grid_group(ctx, CPAR_GROUP_DP_CP), md->world = cpar_grid_group(ctx, CPAR_GROUP_WORLD);
    md->ntp = cpar_group_size(md->tp), md->ncp = cpar_group_size(md->cp), md->tpr = cpar_group_rank(md->tp);
    md->Sc = S / md->ncp, md->Sl = md->Sc / md->ntp, md->hl = HEADS / md->ntp;
    const int64_t Sc = md->Sc, Sl = md->Sl, hl = md->hl, n = md->ntp, hs = H;

    cpar_embedding_config ec = {.num_embeddings = V, .embedding_dim = H, .dtype = dt,
                                .reduce_scatter_embeddings = true, .deterministic = true};
    TRY(cpar_embedding_create(md->tp, &ec, &md->emb));
    const int64_t es[2] = {V, H};
    cpar_tensor em = cpar_tensor_make(mw->emb, CPAR_F32, 2, es, CPAR_HOST);
    TRY(cpar_embedding_init_from_master(md->emb, &em));
    add_param(md, cpar_embedding_weight(md->emb), cpar_embedding_weight_grad(md->emb), false);

    for (int l = 0; l < LAYERS; l++) {
        layer *y = &md->L[l];
        /* stride 3: rank r's rows of [Wq; Wk; Wv] are its heads' q, k and v */
        TRY(make_linear(md, false, H, 3 * H, 3, mw->qkv[l], &y->qkv));
        TRY(make_linear(md, true, H, H, 1, mw->proj[l], &y->proj));
        TRY(make_linear(md, false, H, FFN, 1, mw->fc1[l], &y->fc1));
        TRY(make_linear(md, true, FFN, H, 1, mw->fc2[l], &y->fc2));
        TRY(upload_master(md, mw->norm1[l], 1, &hs, &y->norm1));
        TRY(upload_master(md, mw->norm2[l], 1, &hs, &y->norm2));
        TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &hs, &y->dnorm1));
        TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &hs, &y->dnorm2));
        cpar_linear *ls[4] = {y->qkv, y->proj, y->fc1, y->fc2};
        for (int i = 0; i < 4; i++) add_param(md, cpar_linear_weight(ls[i]), cpar_linear_weight_grad(ls[i]), false);
        add_param(md, y->norm1, y->dnorm1, true);
        add_param(md, y->norm2, y->dnorm2, true);
        TRY(alloc3(md, &y->x, dt, Sl, 1, H));
        TRY(alloc3(md, &y->a1, dt, Sl, 1, H));
        TRY(alloc3(md, &y->qkv_out, dt, Sc, 1, 3 * H / n));
        TRY(alloc3(md, &y->heads, dt, 3 * hl, Sc, D));
        TRY(alloc3(md, &y->o, dt, hl, Sc, D));
        TRY(alloc3(md, &y->lse, CPAR_F32, 1, hl, Sc));
        TRY(alloc3(md, &y->attn, dt, Sc, 1, H / n));
        TRY(alloc3(md, &y->p, dt, Sl, 1, H));
        TRY(alloc3(md, &y->x2, dt, Sl, 1, H));
        TRY(alloc3(md, &y->a2, dt, Sl, 1, H));
        TRY(alloc3(md, &y->m, dt, Sc, 1, FFN / n));
        TRY(alloc3(md, &y->g, dt, Sc, 1, FFN / n));
    }
    TRY(make_linear(md, false, H, V, 1, mw->out, &md->out));
    add_param(md, cpar_linear_weight(md->out), cpar_linear_weight_grad(md->out), false);
    TRY(upload_master(md, mw->norm_f, 1, &hs, &md->norm_f));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &hs, &md->dnorm_f));
    add_param(md, md->norm_f, md->dnorm_f, true);

    TRY(alloc3(md, &md->xf, dt, Sl, 1, H));
    TRY(alloc3(md, &md->af, dt, Sl, 1, H));
    TRY(alloc3(md, &md->logits, dt, Sc, 1, V / n));
    TRY(alloc3(md, &md->stats, CPAR_F32, Sc, 1, 2));
    const int64_t tok[2] = {Sc, 1}, ids_shape[2] = {1, Sc}, one = 1;
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 2, tok, &md->loss));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 2, tok, &md->dloss));
    TRY(cpar_tensor_alloc(ctx, CPAR_F32, 1, &one, &md->loss_sum));
    TRY(cpar_tensor_alloc(ctx, CPAR_I64, 2, ids_shape, &md->ids));
    TRY(cpar_tensor_alloc(ctx, CPAR_I64, 2, tok, &md->tgt));
    TRY(cpar_fill(ctx, &md->dloss, 1.0 / S)); /* d(mean over the S tokens) */

    TRY(alloc3(md, &md->dres, dt, Sl, 1, H));
    TRY(alloc3(md, &md->dtmp, dt, Sl, 1, H));
    TRY(alloc3(md, &md->dM, dt, Sc, 1, FFN / n));
    TRY(alloc3(md, &md->dA, dt, Sc, 1, H / n));
    TRY(alloc3(md, &md->dOh, dt, hl, Sc, D));
    TRY(alloc3(md, &md->dheads, dt, 3 * hl, Sc, D));
    TRY(alloc3(md, &md->dqkv, dt, Sc, 1, 3 * H / n));

    int64_t biggest = 0;
    for (int i = 0; i < md->nparams; i++) {
        const cpar_tensor *w = &md->w_view[i];
        TRY(cpar_tensor_alloc(ctx, CPAR_F32, w->ndim, w->shape, &md->mom[i]));
        TRY(cpar_fill(ctx, &md->mom[i], 0.0));
        if (cpar_tensor_numel(w) > biggest) biggest = cpar_tensor_numel(w);
    }
    return cpar_tensor_alloc(ctx, CPAR_F32, 1, &biggest, &md->tmp32);
}

static void model_destroy(model *md) {
    cpar_ctx *ctx = md->ctx;
    cpar_embedding_destroy(md->emb);
    cpar_linear_destroy(md->out);
    for (int l = 0; l < LAYERS; l++) {
        layer *y = &md->L[l];
        cpar_linear_destroy(y->qkv), cpar_linear_destroy(y->proj);
        cpar_linear_destroy(y->fc1), cpar_linear_destroy(y->fc2);
        cpar_tensor *ts[] = {&y->norm1, &y->norm2, &y->dnorm1, &y->dnorm2, &y->x, &y->a1, &y->qkv_out, &y->heads,
                             &y->o, &y->lse, &y->attn, &y->p, &y->x2, &y->a2, &y->m, &y->g};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) cpar_tensor_free(ctx, ts[i]);
    }
    cpar_tensor *ts[] = {&md->norm_f, &md->dnorm_f, &md->xf, &md->af, &md->logits, &md->loss, &md->stats,
                         &md->dloss, &md->loss_sum, &md->ids, &md->tgt, &md->dres, &md->dtmp, &md->dM, &md->dA,
                         &md->dOh, &md->dheads, &md->dqkv, &md->tmp32};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) cpar_tensor_free(ctx, ts[i]);
    for (int i = 0; i < md->nparams; i++) cpar_tensor_free(ctx, &md->mom[i]);
}

/* ---- heads: [Sc, 1, k hl D] <-> [k hl, Sc, D] with cpar_split / cpar_concat ---------------
 * The columns of a token row are k hl heads of D features; splitting along
 * the head dim into pieces placed one after another in `heads` is the
 * transpose attention needs ([b = 1, heads, s, d]). */
static cpar_status heads_split_concat(model *md, cpar_tensor *rows, cpar_tensor *heads, int64_t nh, bool split) {
    cpar_tensor view = *rows, pieces[3 * HEADS], *pp[3 * HEADS];
    view.ndim = 3, view.shape[0] = md->Sc, view.shape[1] = nh, view.shape[2] = D;
    const size_t piece_bytes = (size_t)(md->Sc * D) * cpar_dtype_size(md->dt);
    for (int64_t i = 0; i < nh; i++) {
        const int64_t ps[3] = {md->Sc, 1, D};
        pieces[i] = cpar_tensor_make((char *)heads->data + (size_t)i * piece_bytes, md->dt, 3, ps, heads->device);
        pp[i] = &pieces[i];
    }
    return split ? cpar_split(md->ctx, &view, 1, (int)nh, pp) : cpar_concat(md->ctx, pp, (int)nh, 1, &view);
}

/* [1, hl, Sc, D] views of q, k, v (or dq, dk, dv) inside a [3 hl, Sc, D] buffer. */
static cpar_tensor head_block(const model *md, const cpar_tensor *buf, int which) {
    const int64_t s[4] = {1, md->hl, md->Sc, D};
    const size_t off = (size_t)which * (size_t)(md->hl * md->Sc * D) * cpar_dtype_size(md->dt);
    return cpar_tensor_make((char *)buf->data + off, md->dt, 4, s, buf->device);
}

static cpar_tensor as4(const cpar_tensor *t) { /* [hl, Sc, D] as [1, hl, Sc, D] */
    const int64_t s[4] = {1, t->shape[0], t->shape[1], t->shape[2]};
    return cpar_tensor_make(t->data, t->dtype, 4, s, t->device);
}

static const cpar_ring_attention_config ring_cfg = {.causal = true, .load_balance = true,
                                                    .comm_type = CPAR_CP_P2P};
#define NORM_EPS 1e-5f

/* dst = a + b (residual add). */
static cpar_status residual_add(cpar_ctx *ctx, const cpar_tensor *a, const cpar_tensor *b, cpar_tensor *dst) {
    TRY(cpar_tensor_copy(ctx, a, dst));
    return cpar_axpby(ctx, 1.f, b, 1.f, dst);
}

/* ---- one training step ------------------------------------------------------------------ */

static cpar_status forward(model *md, float *loss_out) {
    cpar_ctx *ctx = md->ctx;
    TRY(cpar_embedding_layer_forward(md->emb, &md->ids, &md->L[0].x));
    for (int l = 0; l < LAYERS; l++) {
        layer *y = &md->L[l];
        cpar_tensor *next = l + 1 < LAYERS ? &md->L[l + 1].x : &md->xf;
        TRY(cpar_rmsnorm_forward(ctx, &y->x, &y->norm1, NORM_EPS, &y->a1));
        TRY(cpar_linear_forward(y->qkv, &y->a1, &y->qkv_out, NULL));
        TRY(heads_split_concat(md, &y->qkv_out, &y->heads, 3 * md->hl, true));
        cpar_tensor q = head_block(md, &y->heads, 0), k = head_block(md, &y->heads, 1);
        cpar_tensor v = head_block(md, &y->heads, 2), o = as4(&y->o);
        TRY(cpar_ring_attention_forward(md->cp, &ring_cfg, &q, &k, &v, &o, &y->lse));
        TRY(heads_split_concat(md, &y->attn, &y->o, md->hl, false));
        TRY(cpar_linear_forward(y->proj, &y->attn, &y->p, NULL));
        TRY(residual_add(ctx, &y->x, &y->p, &y->x2));
        TRY(cpar_rmsnorm_forward(ctx, &y->x2, &y->norm2, NORM_EPS, &y->a2));
        TRY(cpar_linear_forward(y->fc1, &y->a2, &y->m, NULL));
        TRY(cpar_gelu_forward(ctx, &y->m, &y->g));
        TRY(cpar_linear_forward(y->fc2, &y->g, &y->p, NULL));
        TRY(residual_add(ctx, &y->x2, &y->p, next));
    }
    TRY(cpar_rmsnorm_forward(ctx, &md->xf, &md->norm_f, NORM_EPS, &md->af));
    TRY(cpar_linear_forward(md->out, &md->af, &md->logits, NULL));
    TRY(cpar_vocab_parallel_cross_entropy_forward(md->tp, &md->logits, &md->tgt, 0.f, &md->loss, &md->stats));
    /* mean over the sequence: this cp rank's tokens, then the sum over cp */
    const int64_t row[2] = {1, md->Sc};
    cpar_tensor flat = cpar_tensor_make(md->loss.data, CPAR_F32, 2, row, md->loss.device);
    TRY(cpar_row_reduce(ctx, &flat, CPAR_ROW_SUM, &md->loss_sum));
    TRY(cpar_all_reduce(md->cp, &md->loss_sum, &md->loss_sum, CPAR_SUM));
    float sum;
    cpar_tensor h = cpar_tensor_make(&sum, CPAR_F32, 1, md->loss_sum.shape, CPAR_HOST);
    TRY(cpar_tensor_copy(ctx, &md->loss_sum, &h));
    TRY(cpar_sync(ctx));
    *loss_out = sum / S;
    return CPAR_OK;
}

static cpar_status backward(model *md) {
    cpar_ctx *ctx = md->ctx;
    TRY(cpar_vocab_parallel_cross_entropy_backward(md->tp, &md->logits, &md->tgt, 0.f, &md->stats, &md->dloss,
                                                   &md->logits)); /* dlogits in place */
    TRY(cpar_linear_backward(md->out, &md->logits, &md->dtmp));
    TRY(cpar_rmsnorm_backward(ctx, &md->xf, &md->norm_f, NORM_EPS, &md->dtmp, &md->dres, &md->dnorm_f));
    for (int l = LAYERS - 1; l >= 0; l--) {
        layer *y = &md->L[l];
        /* MLP: dres is d(x3) = d(x2) through the residual */
        TRY(cpar_linear_backward(y->fc2, &md->dres, &md->dM));
        TRY(cpar_gelu_backward(ctx, &y->m, &md->dM, &md->dM));
        TRY(cpar_linear_backward(y->fc1, &md->dM, &md->dtmp));
        TRY(cpar_rmsnorm_backward(ctx, &y->x2, &y->norm2, NORM_EPS, &md->dtmp, &md->dtmp, &y->dnorm2));
        TRY(cpar_axpby(ctx, 1.f, &md->dtmp, 1.f, &md->dres));
        /* attention */
        TRY(cpar_linear_backward(y->proj, &md->dres, &md->dA));
        TRY(heads_split_concat(md, &md->dA, &md->dOh, md->hl, true));
        cpar_tensor q = head_block(md, &y->heads, 0), k = head_block(md, &y->heads, 1);
        cpar_tensor v = head_block(md, &y->heads, 2), o = as4(&y->o), dO = as4(&md->dOh);
        cpar_tensor dq = head_block(md, &md->dheads, 0), dk = head_block(md, &md->dheads, 1);
        cpar_tensor dv = head_block(md, &md->dheads, 2);
        TRY(cpar_ring_attention_backward(md->cp, &ring_cfg, &q, &k, &v, &o, &dO, &y->lse, &dq, &dk, &dv));
        TRY(heads_split_concat(md, &md->dqkv, &md->dheads, 3 * md->hl, false));
        TRY(cpar_linear_backward(y->qkv, &md->dqkv, &md->dtmp));
        TRY(cpar_rmsnorm_backward(ctx, &y->x, &y->norm1, NORM_EPS, &md->dtmp, &md->dtmp, &y->dnorm1));
        TRY(cpar_axpby(ctx, 1.f, &md->dtmp, 1.f, &md->dres));
    }
    return cpar_embedding_layer_backward(md->emb, &md->ids, &md->dres);
}

/* Sum the gradients over the ranks that saw other tokens, then SGD with
 * momentum: m = mu m + g; w -= lr m (through fp32 when w is 16-bit). */
static cpar_status optimizer_step(model *md, float lr, float mu) {
    cpar_ctx *ctx = md->ctx;
    for (int i = 0; i < md->nparams; i++) {
        cpar_tensor *w = &md->w_view[i], *g = &md->g_view[i], *m = &md->mom[i];
        /* norm weights are replicated on every tp rank too (pp = 1: the world) */
        TRY(cpar_all_reduce(md->replicated[i] ? md->world : md->dp_cp, g, g, CPAR_SUM));
        TRY(cpar_axpby(ctx, 1.f, g, mu, m));
        if (w->dtype == CPAR_F32) {
            TRY(cpar_axpby(ctx, -lr, m, 1.f, w));
            continue;
        }
        cpar_tensor t = cpar_tensor_make(md->tmp32.data, CPAR_F32, w->ndim, w->shape, w->device);
        TRY(cpar_cast(ctx, w, &t));
        TRY(cpar_axpby(ctx, -lr, m, 1.f, &t));
        TRY(cpar_cast(ctx, &t, w));
    }
    return CPAR_OK;
}

static cpar_status zero_grads(model *md) {
    for (int i = 0; i < md->nparams; i++) TRY(cpar_fill(md->ctx, &md->g_view[i], 0.0));
    return CPAR_OK;
}

/* This rank's inputs and targets of the step's sequence: the cp shard (load
 * balanced) of ids [1, S] and of targets [S, 1]. */
static cpar_status load_batch(model *md, int step) {
    int64_t seq[S + 1];
    make_sequence(step, seq);
    const int64_t is[2] = {1, S}, ts[2] = {S, 1};
    cpar_tensor ids = cpar_tensor_make(seq, CPAR_I64, 2, is, CPAR_HOST);
    cpar_tensor tgt = cpar_tensor_make(seq + 1, CPAR_I64, 2, ts, CPAR_HOST);
    TRY(cpar_cp_shard(md->cp, &ids, 1, true, &md->ids));
    TRY(cpar_cp_shard(md->cp, &tgt, 0, true, &md->tgt));
    return cpar_sync(md->ctx); /* seq lives on this stack frame */
}

/* ---- the two jobs ----------------------------------------------------------------------- */

typedef struct {
    const master_weights *mw;
    int tp, cp, steps;
    float lr;
    cpar_dtype dt;
    float loss[MAX_STEPS];
    cpar_comm_stats tp_stats, cp_stats, world_stats; /* rank 0, whole run */
} job;

static cpar_status rank_main(cpar_ctx *ctx, void *arg) {
    job *j = arg;
    TRY(cpar_grid_init(ctx, &(cpar_grid_config){.tp = j->tp, .cp = j->cp}));
    model md;
    cpar_status st = model_create(ctx, j->dt, j->mw, &md);
    for (int step = 0; st == CPAR_OK && step < j->steps; step++) {
        float loss = 0.f;
        st = load_batch(&md, step);
        if (st == CPAR_OK) st = zero_grads(&md);
        if (st == CPAR_OK) st = forward(&md, &loss);
        if (st == CPAR_OK) st = backward(&md);
        if (st == CPAR_OK) st = optimizer_step(&md, j->lr, 0.9f);
        if (st == CPAR_OK && cpar_rank(ctx) == 0) j->loss[step] = loss;
    }
    if (st == CPAR_OK) st = cpar_sync(ctx);
    if (st == CPAR_OK && cpar_rank(ctx) == 0) {
        cpar_group_stats(md.tp, &j->tp_stats);
        cpar_group_stats(md.cp, &j->cp_stats);
        cpar_group_stats(md.world, &j->world_stats);
    }
    model_destroy(&md);
    return st;
}

static int env_int(const char *name, int dflt) {
    const char *v = getenv(name);
    return v && atoi(v) > 0 ? atoi(v) : dflt;
}

static uint64_t recv_total(const cpar_comm_stats *s) {
    uint64_t r = 0;
    for (int k = 0; k < CPAR_COLL_KIND_COUNT; k++) r += s->kind[k].bytes_recv;
    return r;
}

int main(void) {
    const int steps = env_int("CPAR_LM_STEPS", 30) < MAX_STEPS ? env_int("CPAR_LM_STEPS", 30) : MAX_STEPS;
    const char *lr_env = getenv("CPAR_LM_LR");
    const float lr = lr_env && atof(lr_env) > 0 ? (float)atof(lr_env) : 0.1f;
    const int ngpu = cpar_device_count();
    cpar_backend backend = !cpar_backend_available(CPAR_BACKEND_NCCL) || ngpu == 0 ? CPAR_BACKEND_HOST
                         : ngpu >= NRANKS ? CPAR_BACKEND_NCCL : CPAR_BACKEND_DEVICE; /* fewer GPUs: shared */
    const char *be = getenv("CPAR_LM_BACKEND");
    if (be) {
        if (cpar_backend_parse(be) < 0) {
            fprintf(stderr, "lm_check: CPAR_LM_BACKEND=%s, expected host, nccl or device\n", be);
            return 1;
        }
        const cpar_backend want = (cpar_backend)cpar_backend_parse(be);
        if (!cpar_backend_available(want)) {
            fprintf(stderr, "lm_check: the %s backend is not available in this build\n", be);
            return 1;
        }
        backend = want;
    }
    /* the flash kernels take 16-bit inputs; the host backend trains in fp32 */
    cpar_dtype dt = backend == CPAR_BACKEND_HOST ? CPAR_F32 : CPAR_BF16;
    const char *dts = getenv("CPAR_LM_DTYPE");
    if (dts) {
        if (!strcmp(dts, "f32")) dt = CPAR_F32;
        else if (!strcmp(dts, "bf16")) dt = CPAR_BF16;
        else if (!strcmp(dts, "f16")) dt = CPAR_F16;
        else {
            fprintf(stderr, "lm_check: CPAR_LM_DTYPE=%s, expected f32, bf16 or f16\n", dts);
            return 1;
        }
    }
    printf("lm_check: a %d-layer transformer LM (V=%d, H=%d, %d heads, FFN=%d, S=%d tokens), %d steps of SGD "
           "(lr %.3g, momentum 0.9), %s on the %s backend (%d GPU%s visible)\n",
           LAYERS, V, H, HEADS, FFN, S, steps, (double)lr, cpar_dtype_name(dt), cpar_backend_name(backend), ngpu,
           ngpu == 1 ? "" : "s");
    fflush(stdout);

    master_weights mw;
    master_init(&mw);
    static job ref, par;
    ref = (job){.mw = &mw, .tp = 1, .cp = 1, .steps = steps, .lr = lr, .dt = dt};
    par = (job){.mw = &mw, .tp = TP, .cp = CP, .steps = steps, .lr = lr, .dt = dt};
    cpar_status st = cpar_spawn(1, backend, rank_main, &ref);
    if (st == CPAR_OK) st = cpar_spawn(NRANKS, backend, rank_main, &par);
    master_free(&mw);
    if (st != CPAR_OK) {
        fprintf(stderr, "lm_check failed: %s: %s\n", cpar_status_string(st), cpar_thread_last_error());
        return 1;
    }

    const double tol = dt == CPAR_F32 ? 1e-4 : 3e-2;
    double worst = 0.0;
    printf("\n%5s %14s %22s %10s\n", "step", "loss (1 rank)", "loss (tp=2 x cp=2)", "rel. diff");
    for (int s = 0; s < steps; s++) {
        /* relative, with a floor so that a loss near zero does not magnify rounding */
        const double d = fabs((double)par.loss[s] - (double)ref.loss[s]) / fmax(fabs((double)ref.loss[s]), 0.05);
        if (!(d <= worst)) worst = d; /* NaN counts as worst */
        printf("%5d %14.6f %22.6f %10.2e\n", s, (double)ref.loss[s], (double)par.loss[s], d);
    }
    const uint64_t tp_b = recv_total(&par.tp_stats), cp_b = recv_total(&par.cp_stats), w_b = recv_total(&par.world_stats);
    printf("\nrank 0 received per step: %llu bytes on its tp group (sequence-parallel gathers and scatters, the "
           "vocab-parallel loss), %llu on its cp group (ring attention, gradient sums), %llu on the world "
           "(norm-weight gradients)\n",
           (unsigned long long)(tp_b / (uint64_t)steps), (unsigned long long)(cp_b / (uint64_t)steps),
           (unsigned long long)(w_b / (uint64_t)steps));
    /* one sequence per step makes single losses noisy: judge the last quarter's mean */
    const int tail = steps / 4 > 0 ? steps / 4 : 1;
    double late = 0.0;
    for (int s = steps - tail; s < steps; s++) late += ref.loss[s] / tail;
    const bool match = worst <= tol, learned = late < 0.5 * ref.loss[0];
    printf("\nparallel vs single rank: max relative difference %.2e (tolerance %.0e): %s\n", worst, tol,
           match ? "match" : "MISMATCH");
    printf("loss %.4f at the first step, %.4f on average over the last %d: %s\n", (double)ref.loss[0], late, tail,
           learned ? "learned" : "DID NOT LEARN");
    return match && learned ? 0 : 1;
}
