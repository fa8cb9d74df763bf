/* SPDX-License-Identifier: MIT */
/* packed.h — the packings the packed-sequence (THD) suites share
 * (test_packed.c: sharding; test_mamba.c: Mamba CP on packed batches), and
 * the reference owner of a packed row, computed from the global side. */
#ifndef CPAR_TESTS_PACKED_H
#define CPAR_TESTS_PACKED_H

#include <stdbool.h>
#include <stdint.h>

#include "cpar.h"

#define MAX_DOCS 320 /* documents in a packing (test_packed's many_docs: more than one kernel launch takes) */
#define N_PACKINGS 3 /* make_packings' count */

typedef struct {
    const char *name;
    int n;
    int32_t cu[MAX_DOCS + 1], cu_pad[MAX_DOCS + 1];
    bool padded;
} packing;

/* The packings for cp = P, u = 2P the chunk unit. */
static inline int make_packings(int P, packing *out) {
    const int32_t u = 2 * P;
    int k = 0;
    { /* uneven documents, the first exactly 2P long */
        const int32_t len[4] = {u, 3 * u, 2 * u, 5 * u};
        packing *q = &out[k++];
        q->name = "uneven", q->n = 4, q->padded = false;
        q->cu[0] = 0;
        for (int i = 0; i < 4; i++) q->cu[i + 1] = q->cu[i] + len[i];
    }
    { /* one long document */
        packing *q = &out[k++];
        q->name = "single", q->n = 1, q->padded = false;
        q->cu[0] = 0, q->cu[1] = 7 * u;
    }
    { /* padded: real lengths rounded up to a multiple of 2P; document 3 empty;
       * document 5 padded a whole chunk unit beyond its rounding */
        const int32_t real[6] = {u - 1, 1, 2 * u, 0, (3 * u) / 2 + 2, 2};
        const int32_t pad[6] = {u, u, 2 * u, 0, ((3 * u) / 2 + 2 + u - 1) / u * u, 2 * u};
        packing *q = &out[k++];
        q->name = "padded", q->n = 6, q->padded = true;
        q->cu[0] = q->cu_pad[0] = 0;
        for (int i = 0; i < 6; i++) q->cu[i + 1] = q->cu[i] + real[i], q->cu_pad[i + 1] = q->cu_pad[i] + pad[i];
    }
    return k;
}

static inline cpar_packed_seqs seqs_of(const packing *q) {
    cpar_packed_seqs s = {.n_docs = q->n, .cu_seqlens = q->cu, .cu_seqlens_padded = q->padded ? q->cu_pad : NULL};
    return s;
}

static inline int64_t total_of(const packing *q) { return q->padded ? q->cu_pad[q->n] : q->cu[q->n]; }

/* The rank and local row holding global packed row g (the reference). */
static inline void owner_of(const packing *q, int P, int64_t g, int *rank, int64_t *local) {
    const int32_t *cu = q->padded ? q->cu_pad : q->cu;
    int i = 0;
    while (!(g >= cu[i] && g < cu[i + 1])) i++; /* the document holding g (empty ones never do) */
    int64_t o = g - cu[i], c = (cu[i + 1] - cu[i]) / (2 * P), chunk = o / c;
    int slot = chunk < P ? 0 : 1;
    *rank = slot == 0 ? (int)chunk : (int)(2 * P - 1 - chunk);
    *local = cu[i] / P + slot * c + o % c;
}

#endif /* CPAR_TESTS_PACKED_H */
