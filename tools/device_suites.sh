#!/bin/sh
# SPDX-License-Identifier: MIT
# device_suites.sh — the device backend with more ranks than GPUs, as
# tools/gpu_check.sh runs it on a lent GPU (and rehearses it on the simulator):
#
#   tools/device_suites.sh DIR SUITE[:CASE]...
#
# runs DIR/test_SUITE (only its test case CASE when given: each test forks
# and makes a CUDA context, about a second on a GPU) for each argument on
# CPAR_BACKEND_DEVICE (the backend suites' multi-rank bodies: ring attention
# cp 2 and 4, the linear layers' overlapped collectives, Mamba CP, training,
# the collectives), then
# DIR/train's tp 2 x cp 2 grid checked against one rank (--verify) with
# $DEVICE_TRAIN's extra flags. Prints each suite's last lines; exits
# non-zero when any failed.
set -u
dir=$1
shift
rc=0
out=$(mktemp)
for a in "$@"; do
    s=${a%%:*}
    case $a in *:*) c=${a#*:} ;; *) c= ;; esac
    echo "-- test_$s${c:+, case $c,} on the device backend"
    if ! env CPAR_TEST_BACKEND=device ${c:+CK_RUN_CASE=$c} "$dir/test_$s" > "$out" 2>&1; then rc=1; fi
    tail -n 6 "$out"
done
rm -f "$out"
echo "-- train --backend device --tp 2 --cp 2"
# shellcheck disable=SC2086 # DEVICE_TRAIN is a list of flags
"$dir/train" --backend device --tp 2 --cp 2 --dp 1 ${DEVICE_TRAIN:-} --sample 0 --verify 3 --dtype bf16 || rc=1
exit $rc
