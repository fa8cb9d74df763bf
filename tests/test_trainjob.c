/* SPDX-License-Identifier: MIT */
/* tests/test_trainjob.c — the main job (examples/train.c) end to end, as a
 * user runs it: build/train on the host backend, build/sim/train (every
 * kernel on the CPU) and build/ncclsim/train (the NCCL path, also as one
 * process per rank under cparrun). The flavour comes from CPAR_TEST_BACKEND
 * (host, device or its old name sim, nccl) as for the other suites.
 *
 * Host: the grid computes the losses of one rank (tp, cp and dp, so the
 * loader's sharding too); a seed gives the same run twice; a run stopped and
 * resumed from its checkpoint continues bit for bit; a checkpoint saved on
 * tp 2 x cp 2 resumes on tp 4 and on one rank; bad flags are refused. Sim
 * and nccl-sim: a short bf16 training whose loss falls, checked against one
 * rank; on nccl-sim the same under cparrun -n 4; on sim the device
 * backend's tp 2 x cp 2 against the host backend's.
 *
 * Paths from the environment (B: the build directory): CPARRUN [$B/cparrun],
 * TRAIN [$B/train, $B/sim/train or $B/ncclsim/train], HOST_TRAIN [$B/train]. Runs from the
 * repository's root (the job's default data). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "testutil.h"
#include "proc.h"

#include <sys/stat.h> /* mkdir */

static const char *flavour(void) {
    const char *v = getenv("CPAR_TEST_BACKEND");
    return v && *v ? v : "host";
}

/* The sim build's flavour: the device backend on the CUDA simulator. */
static bool device_flavour(void) { return !strcmp(flavour(), "device") || !strcmp(flavour(), "sim"); }

static const char *train_path(void) {
    static char buf[4096];
    const char *f = flavour();
    return path_from_env("TRAIN", device_flavour() ? "sim/train" : !strcmp(f, "nccl") ? "ncclsim/train" : "train",
                         buf, sizeof buf);
}

#define ASSERT_RUN(p, cond)                                                                                  \
    ck_assert_msg((cond), "%s\nstatus %d\nstdout:\n%s\nstderr:\n%s", #cond, (p)->status, (p)->text[0], (p)->text[1])

/* The small model every test trains (seconds on the host). */
#define SMALL "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "32", "--batch", "2", "--eval-every", "0", \
              "--sample", "0"

static void run_train(proc *p, const char *const *args) {
    proc_run(p, train_path(), NULL, args, NULL, 300000);
}

/* The losses printed on "step N/M | loss X" lines, in order; returns how many. */
static int losses(const char *out, double *l, int cap) {
    int n = 0;
    for (const char *s = out; (s = strstr(s, "step ")) && n < cap; s++) {
        long long step, total;
        double loss;
        if (sscanf(s, "step %lld/%lld | loss %lf", &step, &total, &loss) == 3) l[n++] = loss;
    }
    return n;
}

static double final_value(const char *out, const char *key) {
    const char *s = strstr(out, key);
    return s ? atof(s + strlen(key)) : NAN;
}

/* ---- host ---------------------------------------------------------------------- */

START_TEST(test_grid_matches_one_rank) {
    /* tp x cp x dp against one rank on the same global batch (the job's own --verify) */
    static const char *const grids[][6] = {
        {"--tp", "2", "--cp", "2", "--dp", "1"},
        {"--tp", "1", "--cp", "1", "--dp", "2"},
        {"--tp", "2", "--cp", "1", "--dp", "2"},
        {"--tp", "1", "--cp", "4", "--dp", "1"},
    };
    const char *const *g = grids[_i];
    proc p;
    run_train(&p, (const char *const[]){g[0], g[1], g[2], g[3], g[4], g[5], SMALL, "--steps", "4", "--verify", "4",
                                        NULL});
    ASSERT_RUN(&p, p.status == 0);
    ASSERT_RUN(&p, strstr(p.text[0], "match (") != NULL);
    proc_free(&p);
}
END_TEST

/* Every comm type of context-parallel attention on the same tp 1 x cp 4 grid:
 * each matches one rank (--verify) and gives p2p's losses; and a2a at
 * tp 2 x cp 2. */
START_TEST(test_cp_comm_types) {
    static const char *const runs[][6] = {
        {"--cp-comm", "p2p", "--tp", "1", "--cp", "4"},         {"--cp-comm", "all_gather", "--tp", "1", "--cp", "4"},
        {"--cp-comm", "a2a", "--tp", "1", "--cp", "4"},         {"--cp-comm", "a2a+p2p", "--tp", "1", "--cp", "4"},
        {"--cp-comm", "a2a", "--tp", "2", "--cp", "2"},
    };
    double ref[8];
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        const char *const *g = runs[r];
        const bool hier = !strcmp(g[1], "a2a+p2p"); /* inner groups of 2, a ring of 2 across them */
        proc p;
        run_train(&p, (const char *const[]){g[0], g[1], g[2], g[3], g[4], g[5], SMALL, "--steps", "4", "--verify", "4",
                                            hier ? "--hierarchical-cp" : NULL, "2", NULL});
        ASSERT_RUN(&p, p.status == 0);
        ASSERT_RUN(&p, strstr(p.text[0], "match (") != NULL);
        double l[8];
        ASSERT_RUN(&p, losses(p.text[0], l, 8) == 4);
        for (int i = 0; i < 4; i++) {
            if (r == 0) ref[i] = l[i];
            ck_assert_msg(fabs(l[i] - ref[i]) <= 1e-5 * fabs(ref[i]), "--cp-comm %s --tp %s --cp %s: step %d loss "
                          "%.7f, p2p's %.7f", g[1], g[3], g[5], i + 1, l[i], ref[i]);
        }
        proc_free(&p);
    }
}
END_TEST

START_TEST(test_seed_repeats) {
    proc a, b, c;
    const char *const args[] = {SMALL, "--steps", "5", "--verify", "0", "--seed", "7", NULL};
    run_train(&a, args);
    run_train(&b, args);
    run_train(&c, (const char *const[]){SMALL, "--steps", "5", "--verify", "0", "--seed", "8", NULL});
    double la[8], lb[8], lc[8];
    ASSERT_RUN(&a, a.status == 0 && losses(a.text[0], la, 8) == 5);
    ASSERT_RUN(&b, b.status == 0 && losses(b.text[0], lb, 8) == 5);
    ASSERT_RUN(&c, c.status == 0 && losses(c.text[0], lc, 8) == 5);
    for (int i = 0; i < 5; i++) ck_assert_msg(la[i] == lb[i], "step %d: %.6f then %.6f with the same seed", i, la[i], lb[i]);
    ck_assert_msg(la[4] != lc[4], "seeds 7 and 8 gave the same loss");
    proc_free(&a), proc_free(&b), proc_free(&c);
}
END_TEST

/* Run 8 steps saving at 4; resume from step 4 on the same grid (bit for bit)
 * and on other grids (the same losses within fp32 rounding). */
START_TEST(test_resume) {
    char dir[] = "/tmp/cpar_trainjob_XXXXXX", ck[256];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(ck, sizeof ck, "%s/step_000004", dir);
    proc full;
    run_train(&full, (const char *const[]){SMALL, "--steps", "8", "--verify", "0", "--save", dir, "--save-every", "4",
                                           NULL});
    double lf[16];
    ASSERT_RUN(&full, full.status == 0 && losses(full.text[0], lf, 16) == 8);
    ASSERT_RUN(&full, strstr(full.text[0], "saved") && access(ck, F_OK) == 0);
    static const char *const grids[][4] = {{"--tp", "2", "--cp", "2"}, {"--tp", "4", "--cp", "1"}, {"--tp", "1", "--cp", "1"}};
    for (int g = 0; g < 3; g++) {
        proc r;
        run_train(&r, (const char *const[]){grids[g][0], grids[g][1], grids[g][2], grids[g][3], SMALL, "--steps", "8",
                                            "--verify", "0", "--resume", ck, NULL});
        double lr[16];
        ASSERT_RUN(&r, r.status == 0 && losses(r.text[0], lr, 16) == 4);
        ASSERT_RUN(&r, strstr(r.text[0], "resumed from") != NULL);
        for (int i = 0; i < 4; i++) {
            const double want = lf[4 + i], tol = g == 0 ? 0.0 : 2e-5 * fabs(want);
            ck_assert_msg(fabs(lr[i] - want) <= tol, "%s %s %s %s: resumed step %d has loss %.7f, the full run %.7f",
                          grids[g][0], grids[g][1], grids[g][2], grids[g][3], 5 + i, lr[i], want);
        }
        proc_free(&r);
    }
    /* a checkpoint of another model shape is refused with the reason */
    proc bad;
    run_train(&bad, (const char *const[]){"--layers", "3", "--hidden", "32", "--heads", "4", "--seq", "32", "--batch",
                                          "2", "--steps", "6", "--verify", "0", "--resume", ck, NULL});
    ASSERT_RUN(&bad, bad.status != 0 && strstr(bad.text[1], "layers 2, this run has 3"));
    proc_free(&bad), proc_free(&full);
    /* the --save folder itself: its latest complete step (8; an empty step 12 is no checkpoint) */
    char late[300], want[300], empty[300];
    snprintf(late, sizeof late, "%s/step_000012", dir);
    ck_assert_int_eq(mkdir(late, 0700), 0);
    snprintf(late, sizeof late, "%s/step_000012/model.safetensors", dir);
    FILE *f = fopen(late, "w");
    ck_assert_ptr_nonnull(f);
    fclose(f);
    snprintf(want, sizeof want, "resume: %s/step_000008, the latest of 2 complete checkpoints in %s", dir, dir);
    proc folder;
    run_train(&folder, (const char *const[]){SMALL, "--steps", "10", "--verify", "0", "--resume", dir, NULL});
    double lt[16];
    ASSERT_RUN(&folder, folder.status == 0 && strstr(folder.text[0], want) && losses(folder.text[0], lt, 16) == 2);
    proc_free(&folder);
    snprintf(empty, sizeof empty, "%s/none", dir);
    ck_assert_int_eq(mkdir(empty, 0700), 0);
    run_train(&folder, (const char *const[]){SMALL, "--steps", "10", "--verify", "0", "--resume", empty, NULL});
    ASSERT_RUN(&folder, folder.status != 0 && strstr(folder.text[1], "no checkpoint there"));
    proc_free(&folder);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

/* ---- crafted checkpoints: each refused with its reason, none crashes ---- */

static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)size + 1);
    ck_assert(b && fread(b, 1, (size_t)size, f) == (size_t)size);
    fclose(f);
    b[size] = 0;
    *n = (size_t)size;
    return b;
}

static void spit(const char *path, const void *b, size_t n) {
    FILE *f = fopen(path, "wb");
    ck_assert_msg(f && fwrite(b, 1, n, f) == n && fclose(f) == 0, "cannot write %s", path);
}

/* A re-save of an existing step killed halfway through (issue 29): the
 * step's previous files are untouched, bit for bit, and --resume on the save
 * folder continues from them. The job dies by SIGKILL while writing the
 * model file's temporary copy (TRAIN_TEST_KILL_IN_SAVE, train.c's fault
 * injection); another seed makes the second run's weights differ. */
START_TEST(test_kill_during_resave) {
    char dir[] = "/tmp/cpar_resave_XXXXXX", model[300], optim[300], cmd[340];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(model, sizeof model, "%s/step_000004/model.safetensors", dir);
    snprintf(optim, sizeof optim, "%s/step_000004/optimizer.safetensors", dir);
    proc a;
    run_train(&a, (const char *const[]){SMALL, "--steps", "4", "--verify", "0", "--save", dir, NULL});
    ASSERT_RUN(&a, a.status == 0 && access(model, F_OK) == 0);
    proc_free(&a);
    size_t nm, no;
    char *m0 = slurp(model, &nm), *o0 = slurp(optim, &no);
    proc k;
    proc_run(&k, train_path(), NULL,
             (const char *const[]){SMALL, "--steps", "4", "--verify", "0", "--seed", "99", "--save", dir, NULL},
             (const char *const[]){"TRAIN_TEST_KILL_IN_SAVE=step_000004/model", NULL}, 300000);
    ASSERT_RUN(&k, k.status == 128 + SIGKILL);
    proc_free(&k);
    size_t nm1, no1;
    char *m1 = slurp(model, &nm1), *o1 = slurp(optim, &no1);
    ck_assert_msg(nm1 == nm && !memcmp(m0, m1, nm), "the killed re-save changed %s", model);
    ck_assert_msg(no1 == no && !memcmp(o0, o1, no), "the killed re-save changed %s", optim);
    proc r;
    run_train(&r, (const char *const[]){SMALL, "--steps", "6", "--verify", "0", "--resume", dir, NULL});
    ASSERT_RUN(&r, r.status == 0 && strstr(r.text[0], "resumed from") && strstr(r.text[0], "step_000004"));
    proc_free(&r);
    free(m0), free(o0), free(m1), free(o1);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

/* dir/model.safetensors with header h (the original data after it) and the
 * original optimizer file beside it. */
static void craft(const char *dir, const char *h, const char *data, size_t data_n, const char *opt, size_t opt_n) {
    char path[512];
    ck_assert_int_eq(mkdir(dir, 0700), 0);
    size_t hl = strlen(h);
    char *b = malloc(8 + hl + data_n);
    ck_assert_ptr_nonnull(b);
    for (int i = 0; i < 8; i++) b[i] = (char)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, h, hl);
    memcpy(b + 8 + hl, data, data_n);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    spit(path, b, 8 + hl + data_n);
    snprintf(path, sizeof path, "%s/optimizer.safetensors", dir);
    spit(path, opt, opt_n);
    free(b);
}

/* A copy of s with the first occurrence of from replaced by to. */
static char *replaced(const char *s, const char *from, const char *to) {
    const char *at = strstr(s, from);
    ck_assert_msg(at != NULL, "\"%s\" not in the header", from);
    size_t n = strlen(s) - strlen(from) + strlen(to);
    char *r = malloc(n + 1);
    ck_assert_ptr_nonnull(r);
    snprintf(r, n + 1, "%.*s%s%s", (int)(at - s), s, to, at + strlen(from));
    return r;
}

START_TEST(test_bad_checkpoints) {
    char dir[] = "/tmp/cpar_badck_XXXXXX", path[512], ck[256];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    proc p;
    run_train(&p, (const char *const[]){SMALL, "--steps", "2", "--verify", "0", "--save", dir, NULL});
    ASSERT_RUN(&p, p.status == 0);
    proc_free(&p);
    size_t mn, on;
    snprintf(path, sizeof path, "%s/step_000002/model.safetensors", dir);
    char *model = slurp(path, &mn);
    snprintf(path, sizeof path, "%s/step_000002/optimizer.safetensors", dir);
    char *opt = slurp(path, &on);
    size_t hl = 0;
    for (int i = 0; i < 8; i++) hl |= (size_t)(unsigned char)model[i] << (8 * i);
    char *h = strndup(model + 8, hl), *data = model + 8 + hl;
    const size_t dn = mn - 8 - hl;
    /* the first tensor's offsets [0, n] and the second's [n, m] */
    const char *o1 = strstr(strstr(h, "\"data_offsets\":[0,"), "[0,");
    long long n1 = atoll(o1 + 3);
    const char *o2 = strstr(o1 + 1, "\"data_offsets\":[");
    char first[64], second[96], neg[64], dup[96], crc[32];
    snprintf(first, sizeof first, "[0,%lld]", n1);
    snprintf(neg, sizeof neg, "[-16,%lld]", n1 - 16);
    snprintf(second, sizeof second, "%.*s", (int)(strchr(o2, ']') - o2 + 1), o2);
    long long m2 = atoll(strchr(o2, ',') + 1); /* the second's [n1, m2], moved 4 bytes into the first */
    snprintf(dup, sizeof dup, "\"data_offsets\":[%lld,%lld]", n1 - 4, m2 - 4);
    const char *c = strstr(h, "\"data_crc32\":\"");
    ck_assert_ptr_nonnull(c);
    snprintf(crc, sizeof crc, "%.23s", c); /* "data_crc32":"xxxxxxxx" */
    char *deep = malloc(300010);
    ck_assert_ptr_nonnull(deep);
    memset(deep, '[', 300000);
    snprintf(deep + 300000, 10, "%s", "");
    char *deep_h = malloc(strlen(h) + 300100);
    ck_assert_ptr_nonnull(deep_h);
    snprintf(deep_h, strlen(h) + 300100, "{\"x\":%s,%s", deep, h + 1);
    char *unterminated = strdup(h);
    *strrchr(unterminated, '}') = ' ';
    char *huge = replaced(h, "\"step\":\"2\"", "\"step\":\"99999999999999999999\"");
    char *flipped = malloc(dn);
    ck_assert_ptr_nonnull(flipped);
    memcpy(flipped, data, dn);
    flipped[dn / 2] ^= 0x10;
    /* NaN weights in a file whose checksum is gone (a file of another tool) */
    char *nan_data = malloc(dn), nocrc[32];
    ck_assert_ptr_nonnull(nan_data);
    memcpy(nan_data, data, dn);
    const float qnan = NAN;
    for (size_t i = 0; i < (size_t)n1 / 4; i++) memcpy(nan_data + i * 4, &qnan, 4); /* the whole embedding */
    snprintf(nocrc, sizeof nocrc, "\"data_crcXX\":\"%.8s\"", crc + 14);
    struct {
        const char *name;
        char *header;
        const char *bytes;
        size_t nbytes;
        const char *want;
    } cases[] = {
        {"negative", replaced(h, first, neg), data, dn, "bad data_offsets"},
        {"overlap", replaced(h, second, dup), data, dn, "two tensors share data"},
        {"deep", deep_h, data, dn, "is not one JSON object"},
        {"unterminated", unterminated, data, dn, "is not one JSON object"},
        {"huge_step", huge, data, dn, "has step \"99999999999999999999\""},
        {"flipped_bit", h, flipped, dn, "is damaged"},
        {"nan_weights", replaced(h, crc, nocrc), nan_data, dn, "stopping"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        snprintf(ck, sizeof ck, "%s/%s", dir, cases[k].name);
        craft(ck, cases[k].header, cases[k].bytes, cases[k].nbytes, opt, on);
        proc r;
        run_train(&r, (const char *const[]){SMALL, "--steps", "4", "--verify", "0", "--resume", ck, NULL});
        ck_assert_msg(r.status > 0 && r.status < 128 && strstr(r.text[1], cases[k].want),
                      "%s: status %d, stderr lacks \"%s\":\n%s\nstdout:\n%s", cases[k].name, r.status, cases[k].want,
                      r.text[1], r.text[0]);
        proc_free(&r);
    }
    /* a directory where the model file should be */
    snprintf(ck, sizeof ck, "%s/directory", dir);
    ck_assert_int_eq(mkdir(ck, 0700), 0);
    snprintf(path, sizeof path, "%s/model.safetensors", ck);
    ck_assert_int_eq(mkdir(path, 0700), 0);
    proc r;
    run_train(&r, (const char *const[]){SMALL, "--steps", "4", "--verify", "0", "--resume", ck, NULL});
    ASSERT_RUN(&r, r.status > 0 && r.status < 128 && strstr(r.text[1], "is not a regular file"));
    proc_free(&r);
    free(cases[0].header), free(cases[1].header), free(cases[6].header);
    free(deep), free(deep_h), free(unterminated), free(huge), free(flipped), free(nan_data), free(h), free(model), free(opt);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

/* Step lines every --log-every steps, and the first and the last. */
START_TEST(test_log_every) {
    proc p;
    run_train(&p, (const char *const[]){SMALL, "--steps", "25", "--verify", "0", "--log-every", "10", NULL});
    double l[32];
    ASSERT_RUN(&p, p.status == 0 && losses(p.text[0], l, 32) == 4);
    ASSERT_RUN(&p, strstr(p.text[0], "step     1/25 |") && strstr(p.text[0], "step    10/25 |") &&
                       strstr(p.text[0], "step    20/25 |") && strstr(p.text[0], "step    25/25 |"));
    proc_free(&p);
}
END_TEST

START_TEST(test_bad_flags) {
    static const char *const cases[][3] = {
        {"--tp", "3", "--heads 4 is not divisible by --tp 3"},
        {"--seq", "30", "not divisible by 2*cp*tp"},
        {"--dtype", "f64", "--dtype expects f32, bf16 or f16"},
        {"--lr", "abc", "--lr expects a number"},
        {"--frobnicate", "1", "unknown flag"},
        {"--data", "/nonexistent/file", "cannot open /nonexistent/file"},
        {"--backend", "mpi", "--backend expects host, nccl or device"},
        {"--log-every", "0", "--log-every expects an integer in [1,"},
        /* named, never a silent fall-back to host (no GPU where make test runs) */
        {"--backend", "nccl", "--backend nccl is not available here"},
        {"--cp-comm", "ring", "--cp-comm expects p2p, all_gather, a2a or a2a+p2p"},
        {"--cp-comm", "a2a+p2p", "needs --hierarchical-cp A dividing --cp 2"},
        {"--hierarchical-cp", "2", "--hierarchical-cp sizes --cp-comm a2a+p2p's groups"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        proc p;
        run_train(&p, (const char *const[]){cases[i][0], cases[i][1], NULL});
        ASSERT_RUN(&p, p.status != 0 && strstr(p.text[1], cases[i][2]) != NULL);
        proc_free(&p);
    }
    proc h;
    run_train(&h, (const char *const[]){"--help", NULL});
    ASSERT_RUN(&h, h.status == 0 && strstr(h.text[0], "--resume DIR"));
    proc_free(&h);
}
END_TEST

/* ---- sim and nccl-sim -------------------------------------------------------------- */

/* A short bf16 run on simulated GPUs: the grid against one rank, and the
 * loss falls. _i = 0: the default tp 2 x cp 2 (p2p); 1: tp 1 x cp 4 with
 * a2a+p2p (all-to-all in pairs, a ring of 2 across them). */
START_TEST(test_device_training) {
    const char *be = !strcmp(flavour(), "nccl") ? "nccl" : "device";
    const char *const hier[] = {"--tp", "1", "--cp", "4", "--cp-comm", "a2a+p2p", "--hierarchical-cp", "2"};
    proc p;
    run_train(&p, (const char *const[]){"--backend", be, "--dtype", "bf16", SMALL, "--steps", "12", "--lr", "1e-2",
                                        "--warmup", "2", "--verify", "2", _i ? hier[0] : NULL, hier[1], hier[2],
                                        hier[3], hier[4], hier[5], hier[6], hier[7], NULL});
    ASSERT_RUN(&p, p.status == 0 && strstr(p.text[0], "match ("));
    double l[16];
    ASSERT_RUN(&p, losses(p.text[0], l, 16) == 12);
    ASSERT_RUN(&p, l[11] < l[0] - 0.5);
    ASSERT_RUN(&p, final_value(p.text[0], "validation loss ") < 5.3);
    proc_free(&p);
}
END_TEST

/* One process per rank: cparrun -> cpar_init_from_env -> store -> NCCL. */
START_TEST(test_cparrun_training) {
    proc p;
    proc_run(&p, cparrun_path(), train_path(),
             (const char *const[]){"-n", "4", "PROG", "--backend", "nccl", "--dtype", "bf16", "--tp", "2", "--cp", "2",
                                   SMALL, "--steps", "6", "--lr", "1e-2", "--warmup", "2", NULL},
             NULL, 300000);
    ASSERT_RUN(&p, p.status == 0);
    ASSERT_RUN(&p, strstr(p.text[0], "[0] done: 6 steps") != NULL);
    proc_free(&p);
}
END_TEST

/* The device backend's tp 2 x cp 2 (4 ranks on the GPUs the simulator
 * shows: one under make test) against the host backend's run of the same
 * grid, flags and dtype: the same losses within bf16 rounding. */
START_TEST(test_device_matches_host) {
    static char host_train[4096];
    path_from_env("HOST_TRAIN", "train", host_train, sizeof host_train);
    const char *const flags[] = {"--tp", "2", "--cp", "2", "--dtype", "bf16", SMALL, "--steps", "6", "--lr", "1e-2",
                                 "--warmup", "2", "--verify", "0", "--backend", NULL, NULL};
    const char *dev[sizeof flags / sizeof *flags], *host[sizeof flags / sizeof *flags];
    memcpy(dev, flags, sizeof flags);
    memcpy(host, flags, sizeof flags);
    size_t last = sizeof flags / sizeof *flags - 2;
    dev[last] = "device";
    host[last] = "host";
    proc d, h;
    proc_run(&d, train_path(), NULL, dev, NULL, 300000);
    ASSERT_RUN(&d, d.status == 0 && strstr(d.text[0], "on the device backend"));
    proc_run(&h, host_train, NULL, host, NULL, 300000);
    ASSERT_RUN(&h, h.status == 0);
    double ld[8], lh[8];
    ASSERT_RUN(&d, losses(d.text[0], ld, 8) == 6);
    ASSERT_RUN(&h, losses(h.text[0], lh, 8) == 6);
    for (int i = 0; i < 6; i++)
        ck_assert_msg(fabs(ld[i] - lh[i]) <= 2e-3 * fabs(lh[i]), "step %d: loss %.5f on the device backend, %.5f on "
                      "the host backend\ndevice:\n%s\nhost:\n%s", i + 1, ld[i], lh[i], d.text[0], h.text[0]);
    proc_free(&d);
    proc_free(&h);
}
END_TEST

int main(void) {
    if (access(train_path(), X_OK) != 0) {
        fprintf(stderr, "test_trainjob: need TRAIN (%s)\n", train_path());
        return EXIT_FAILURE;
    }
    Suite *s = suite_create("trainjob: the main job end to end");
    TCase *tc = tcase_create(flavour());
    if (!strcmp(flavour(), "host")) {
        tcase_add_loop_test(tc, test_grid_matches_one_rank, 0, 4);
        tcase_add_test(tc, test_cp_comm_types);
        tcase_add_test(tc, test_seed_repeats);
        tcase_add_test(tc, test_resume);
        tcase_add_test(tc, test_kill_during_resave);
        tcase_add_test(tc, test_bad_checkpoints);
        tcase_add_test(tc, test_log_every);
        tcase_add_test(tc, test_bad_flags);
    } else {
        tcase_add_loop_test(tc, test_device_training, 0, 2);
        if (!strcmp(flavour(), "nccl")) tcase_add_test(tc, test_cparrun_training);
        if (device_flavour()) tcase_add_test(tc, test_device_matches_host);
    }
    tcase_set_timeout(tc, 600);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
