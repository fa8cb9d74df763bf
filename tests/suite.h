/* SPDX-License-Identifier: MIT */
/* tests/suite.h — running a Check suite, for every suite (C, and the CUDA
 * dialect's suites compiled as C++): testutil.h includes it. */
#ifndef CPAR_TESTS_SUITE_H
#define CPAR_TESTS_SUITE_H

#include <check.h>
#include <stdlib.h>

/* Check's ck_assert_msg (every ck_assert_* goes through it) records each
 * passed assertion's place, the "last passed" of a crash report, with a
 * write(2) to the runner under a lock: sim ring's element loops made 3
 * million of them, and its CPU time fell from 17.6 to 11.1 s without them
 * (2026-12-07, 2 cores). Recorded here only when the place
 * differs from this thread's last one, which leaves the report the same (a
 * loop's repeats of one place say nothing new). */
#ifdef __cplusplus
#define TU_THREAD_LOCAL thread_local
#else
#define TU_THREAD_LOCAL _Thread_local
#endif
static inline void tu_mark_point(const char *file, int line) {
    static TU_THREAD_LOCAL const char *last_file;
    static TU_THREAD_LOCAL int last_line;
    if (line == last_line && file == last_file) return;
    last_file = file;
    last_line = line;
    _mark_point(file, line);
}
#undef ck_assert_msg
#define ck_assert_msg(expr, ...)                                                                             \
    ((expr) ? tu_mark_point(__FILE__, __LINE__)                                                              \
            : _ck_assert_failed(__FILE__, __LINE__, "Assertion '" #expr "' failed", __VA_ARGS__))

/* Run every test of a suite and return the process exit status. */
static inline int tu_run_suite(Suite *s) {
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

#endif /* CPAR_TESTS_SUITE_H */
