/* SPDX-License-Identifier: MIT */
/* test_grid.c — Megatron's parallel grid: cpar_grid_init and the tp, cp,
 * dp, pp, tp-cp and dp-cp groups (cpar.h §4, docs/DESIGN.md §3).
 *
 * For each rank and group kind the expected members are computed here from
 * Megatron's rank order, rank = tp_rank + tp*(cp_rank + cp*(dp_rank +
 * dp*pp_rank)): the ranks whose coordinates equal this rank's on every axis
 * the group does not span, in increasing rank order. Each group then reduces
 * the world rank, and the result must be the sum over those members. */
#include "testutil.h"

#define MAX_WORLD 8

typedef struct {
    int world, tp, cp, pp; /* a zero size means 1 (the config default) */
} grid_case;

static const grid_case grid_cases[] = {
    {8, 2, 2, 1}, {8, 2, 1, 2}, {8, 1, 2, 2}, {8, 2, 2, 2}, {8, 4, 1, 1}, {8, 1, 1, 1}, {8, 1, 4, 1}, {8, 1, 1, 8},
    {6, 3, 1, 1}, {6, 1, 3, 2}, {6, 2, 3, 1}, {6, 1, 1, 2}, {4, 2, 2, 1}, {4, 0, 0, 0}, {3, 1, 3, 1}, {1, 1, 1, 1},
};
#define N_GRID_CASES ((int)(sizeof grid_cases / sizeof grid_cases[0]))

static const char *const kind_names[CPAR_GROUP_KIND_COUNT] = {"world", "tp", "cp", "dp", "pp", "tp_cp", "dp_cp"};

enum { AX_TP, AX_CP, AX_DP, AX_PP, N_AXES };

/* Which axes each group kind spans. */
static const bool spans[CPAR_GROUP_KIND_COUNT][N_AXES] = {
    [CPAR_GROUP_WORLD] = {true, true, true, true},   [CPAR_GROUP_TP] = {true, false, false, false},
    [CPAR_GROUP_CP] = {false, true, false, false},   [CPAR_GROUP_DP] = {false, false, true, false},
    [CPAR_GROUP_PP] = {false, false, false, true},   [CPAR_GROUP_TP_CP] = {true, true, false, false},
    [CPAR_GROUP_DP_CP] = {false, true, true, false},
};

/* Coordinates of rank r, by inverting Megatron's formula digit by digit. */
static void coords(int r, const int size[N_AXES], int c[N_AXES]) {
    for (int ax = 0; ax < N_AXES; ax++) {
        c[ax] = r % size[ax];
        r /= size[ax];
    }
}

static int rank_of(const int c[N_AXES], const int size[N_AXES]) {
    return c[AX_TP] + size[AX_TP] * (c[AX_CP] + size[AX_CP] * (c[AX_DP] + size[AX_DP] * c[AX_PP]));
}

/* Members of rank me's group of kind k, increasing; returns their number. */
static int expected_members(int me, int world, const int size[N_AXES], cpar_group_kind k, int *members) {
    int mine[N_AXES], m = 0;
    coords(me, size, mine);
    ck_assert_int_eq(rank_of(mine, size), me);
    for (int r = 0; r < world; r++) {
        int c[N_AXES];
        coords(r, size, c);
        bool same = true;
        for (int ax = 0; ax < N_AXES; ax++)
            if (!spans[k][ax] && c[ax] != mine[ax]) same = false;
        if (same) members[m++] = r;
    }
    return m;
}

/* After cpar_grid_init(tp, cp, pp): every group of this rank has the expected
 * members, and reduces correctly. */
static void check_grid(cpar_ctx *ctx, int tp, int cp, int pp) {
    int world = cpar_world_size(ctx), me = cpar_rank(ctx);
    tp = tp ? tp : 1;
    cp = cp ? cp : 1;
    pp = pp ? pp : 1;
    int size[N_AXES] = {tp, cp, world / (tp * cp * pp), pp};
    for (int k = 0; k < CPAR_GROUP_KIND_COUNT; k++) {
        int members[MAX_WORLD], m = expected_members(me, world, size, (cpar_group_kind)k, members), pos = -1;
        for (int i = 0; i < m; i++)
            if (members[i] == me) pos = i;
        cpar_group *g = cpar_grid_group(ctx, (cpar_group_kind)k);
        ck_assert_msg(g != NULL, "rank %d: no %s group", me, kind_names[k]);
        ck_assert_msg(cpar_group_size(g) == m && cpar_grid_size(ctx, (cpar_group_kind)k) == m,
                      "rank %d (tp %d cp %d pp %d): %s group has size %d (grid says %d), expected %d", me, tp, cp, pp,
                      kind_names[k], cpar_group_size(g), cpar_grid_size(ctx, (cpar_group_kind)k), m);
        ck_assert_msg(cpar_group_rank(g) == pos && cpar_grid_rank(ctx, (cpar_group_kind)k) == pos,
                      "rank %d: %s group rank %d (grid says %d), expected %d", me, kind_names[k], cpar_group_rank(g),
                      cpar_grid_rank(ctx, (cpar_group_kind)k), pos);
        ck_assert_ptr_eq(cpar_group_ctx(g), ctx);
        for (int i = 0; i < m; i++)
            ck_assert_msg(cpar_group_world_rank(g, i) == members[i],
                          "rank %d (tp %d cp %d pp %d): %s group member %d is world rank %d, expected %d", me, tp, cp,
                          pp, kind_names[k], i, cpar_group_world_rank(g, i), members[i]);
        ck_assert_int_eq(cpar_group_world_rank(g, m), -1);

        /* Reduce {world rank, 1, world rank^2} over the group. */
        int64_t x[3] = {me, 1, (int64_t)me * me}, want[3] = {0, 0, 0}, shape[] = {3};
        for (int i = 0; i < m; i++) {
            want[0] += members[i];
            want[1] += 1;
            want[2] += (int64_t)members[i] * members[i];
        }
        cpar_tensor in = tu_upload(ctx, x, CPAR_I64, 1, shape), out = tu_alloc_poisoned(ctx, CPAR_I64, 1, shape);
        TU_OK(cpar_all_reduce(g, &in, &out, CPAR_SUM));
        int64_t *got = tu_download(ctx, &out);
        for (int i = 0; i < 3; i++)
            ck_assert_msg(got[i] == want[i], "rank %d: all_reduce over the %s group gave %lld at %d, expected %lld",
                          me, kind_names[k], (long long)got[i], i, (long long)want[i]);
        free(got);
        TU_OK(cpar_tensor_free(ctx, &in));
        TU_OK(cpar_tensor_free(ctx, &out));
    }
}

static void expect_no_grid(cpar_ctx *ctx) {
    for (int k = 0; k < CPAR_GROUP_KIND_COUNT; k++) {
        ck_assert_ptr_null(cpar_grid_group(ctx, (cpar_group_kind)k));
        ck_assert_int_eq(cpar_grid_size(ctx, (cpar_group_kind)k), 0);
        ck_assert_int_eq(cpar_grid_rank(ctx, (cpar_group_kind)k), -1);
    }
}

static void expect_bad_kinds(cpar_ctx *ctx) {
    cpar_group_kind bad[] = {CPAR_GROUP_KIND_COUNT, (cpar_group_kind)-1, (cpar_group_kind)42};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ck_assert_ptr_null(cpar_grid_group(ctx, bad[i]));
        ck_assert_int_eq(cpar_grid_size(ctx, bad[i]), 0);
        ck_assert_int_eq(cpar_grid_rank(ctx, bad[i]), -1);
    }
}

static cpar_status rank_grid(cpar_ctx *ctx, void *p) {
    const grid_case *c = p;
    expect_no_grid(ctx); /* before cpar_grid_init */
    cpar_grid_config cfg = {.tp = c->tp, .cp = c->cp, .pp = c->pp};
    TU_OK(cpar_grid_init(ctx, &cfg));
    check_grid(ctx, c->tp, c->cp, c->pp);
    expect_bad_kinds(ctx);
    return CPAR_OK;
}

START_TEST(test_grid) {
    const grid_case *c = &grid_cases[_i];
    TU_OK(tu_spawn(c->world, rank_grid, (void *)c));
}
END_TEST

/* Re-initialising replaces every group (world 8): the new groups follow the
 * new sizes, and the grid can go back to the first layout. */
static cpar_status rank_reinit(cpar_ctx *ctx, void *p) {
    (void)p;
    static const int layouts[][3] = {{2, 2, 1}, {1, 2, 4}, {4, 1, 1}, {2, 2, 1}, {1, 1, 1}};
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        cpar_grid_config cfg = {.tp = layouts[i][0], .cp = layouts[i][1], .pp = layouts[i][2]};
        TU_OK(cpar_grid_init(ctx, &cfg));
        check_grid(ctx, cfg.tp, cfg.cp, cfg.pp);
    }
    return CPAR_OK;
}

START_TEST(test_grid_reinit) { TU_OK(tu_spawn(8, rank_reinit, NULL)); }
END_TEST

/* Sizes that do not divide the world: CPAR_ERR_INVALID with the numbers. */
typedef struct {
    int world, tp, cp, pp;
    const char *needles[3];
} bad_grid;

static const bad_grid bad_grids[] = {
    {6, 4, 1, 1, {"4", "6", "tp"}},  /* 4 does not divide 6 */
    {6, 2, 2, 2, {"8", "6", "tp"}},  /* tp*cp*pp = 8 > 6 */
    {4, 2, 2, 2, {"8", "4", "tp"}},  /* 8 > 4 */
    {4, 1, 3, 1, {"3", "4", "cp"}},  /* cp 3 does not divide 4 */
    {8, 1, 1, 3, {"3", "8", "pp"}},  /* pp 3 does not divide 8 */
    {4, -1, 1, 1, {"-1", "tp", ""}}, /* negative */
    {4, 2, -2, 1, {"-2", "cp", ""}},
    {4, 1, 1, -4, {"-4", "pp", ""}},
};
#define N_BAD_GRIDS ((int)(sizeof bad_grids / sizeof bad_grids[0]))

static cpar_status rank_bad_grid(cpar_ctx *ctx, void *p) {
    const bad_grid *b = p;
    cpar_grid_config cfg = {.tp = b->tp, .cp = b->cp, .pp = b->pp};
    ck_assert_int_eq(cpar_grid_init(ctx, &cfg), CPAR_ERR_INVALID);
    for (int i = 0; i < 3; i++) TU_MSG_HAS(b->needles[i]);
    ck_assert_ptr_nonnull(strstr(cpar_last_error(ctx), "cpar_grid_init"));
    expect_no_grid(ctx); /* a failed init builds nothing */
    TU_FAILS(cpar_grid_init(ctx, NULL), CPAR_ERR_INVALID, "cfg");
    TU_FAILS(cpar_grid_init(NULL, &cfg), CPAR_ERR_INVALID, "ctx");
    /* A valid grid still works afterwards. */
    cpar_grid_config ok = {.tp = cpar_world_size(ctx) % 2 ? 1 : 2};
    TU_OK(cpar_grid_init(ctx, &ok));
    check_grid(ctx, ok.tp, 1, 1);
    /* A bad re-init leaves the valid grid in place. */
    ck_assert_int_eq(cpar_grid_init(ctx, &cfg), CPAR_ERR_INVALID);
    check_grid(ctx, ok.tp, 1, 1);
    return CPAR_OK;
}

START_TEST(test_grid_bad) {
    const bad_grid *b = &bad_grids[_i];
    TU_OK(tu_spawn(b->world, rank_bad_grid, (void *)b));
}
END_TEST

Suite *suite(void) {
    Suite *s = suite_create("grid: Megatron tp/cp/dp/pp groups");
    TCase *tc = tcase_create("layouts");
    tcase_add_loop_test(tc, test_grid, 0, N_GRID_CASES);
    tcase_add_test(tc, test_grid_reinit);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    tc = tcase_create("bad_input");
    tcase_add_loop_test(tc, test_grid_bad, 0, N_BAD_GRIDS);
    tcase_set_timeout(tc, 60);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
