/* SPDX-License-Identifier: MIT */
/* tests/suite.h — running a Check suite, for every suite (C, and the CUDA
 * dialect's suites compiled as C++): testutil.h includes it. */
#ifndef CPAR_TESTS_SUITE_H
#define CPAR_TESTS_SUITE_H

#include <check.h>
#include <stdlib.h>

/* Run every test of a suite and return the process exit status. */
static inline int tu_run_suite(Suite *s) {
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

#endif /* CPAR_TESTS_SUITE_H */
