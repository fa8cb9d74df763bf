#!/bin/sh
# SPDX-License-Identifier: MIT
# mutate_waits.sh — proof that the tests see every stream ordering in cpar.c.
#
# For each stream wait or stream/event/device synchronisation in cpar.c's
# device paths (cpar_dev_stream_wait_event, cpar_dev_stream_sync,
# cpar_dev_event_sync, cpar_dev_sync, and the polling cpar__stream_wait),
# builds the sim and nccl-sim test
# suites with that one call replaced by CPAR_OK, runs the suites that
# exercise device streams under the simulators' lazy and random stream modes
# (tests/cudasim.h section 9), and prints which suite caught the removal:
#
#   tests/mutate_waits.sh --list          the sites, numbered
#   tests/mutate_waits.sh [N ...]         mutate sites N (default: all); a table last
#
# Needs make test-build first (it reuses build/obj and the sim kernels). Each
# site costs two compiles of cpar.c and the suites' runs until the first
# failure: about 2-4 minutes on 2 cores. It writes only under a temporary
# directory (MUTATE_DIR to keep it).
set -u
cd "$(dirname "$0")/.." || exit 2
B=${B:-build}
CC=${CC:-cc}
CXX=${CXX:-g++}
PATTERN='cpar_dev_(stream_wait_event|stream_sync|event_sync)\([^()]*\)|cpar_dev_sync\(\)|cpar__stream_wait(_quiet)?\([^()]*\)|cpar__hc_wait_peers\([^()]*\)'
SUITES=${MUTATE_SUITES:-"linear ring coll mappings mamba inference xent train"}
SEEDS=${MUTATE_SEEDS:-"1 2"}

# Sites: line numbers of cpar.c whose code (not a comment or a stub) calls one.
sites() {
    grep -nE "$PATTERN" cpar.c | grep -v 'CPAR__STUB' | grep -vE '^[0-9]+: *(/\*|\*|static )' | cut -d: -f1
}
if [ "${1:-}" = --list ]; then
    i=0
    for l in $(sites); do
        i=$((i + 1))
        printf '%3d  cpar.c:%-6s %s\n' $i "$l" "$(sed -n "${l}p" cpar.c | sed 's/^ *//' | cut -c1-100)"
    done
    exit 0
fi
for f in $B/obj/test_linear.o $B/sim/cpar_kernels.o $B/ncclsim/ncclsim.o $B/ncclsim/ncclsim_cudasim.o; do
    [ -f "$f" ] || { echo "mutate_waits.sh: $f missing: run make test-build first" >&2; exit 2; }
done
all=$(sites)
want=${*:-$(seq 1 "$(echo "$all" | wc -l)")}
dir=${MUTATE_DIR:-$(mktemp -d)}
mkdir -p "$dir"
CFLAGS_ALL="-std=c11 -O1 -g -pthread -I. -w"
LIBS="$(pkg-config --libs check 2> /dev/null || echo -lcheck -lsubunit) -pthread -lm -lrt"
table=""

for n in $want; do
    line=$(echo "$all" | sed -n "${n}p")
    [ -n "$line" ] || { echo "mutate_waits.sh: no site $n (see --list)" >&2; exit 2; }
    what=$(sed -n "${line}p" cpar.c | sed 's/^ *//' | cut -c1-70)
    echo "== site $n, cpar.c:$line: $what"
    # The call on that line becomes cpar__mutant_ok(): a sync or wait that did nothing.
    { echo 'static int cpar__mutant_ok(void) { return 0; }'; sed -E "${line}s/$PATTERN/cpar__mutant_ok()/" cpar.c; } \
        > "$dir/cpar.c"
    if cmp -s "$dir/cpar.c" cpar.c; then echo "  (nothing replaced)"; continue; fi
    cp cpar.h "$dir/cpar.h"
    $CC $CFLAGS_ALL -DCPAR_WITH_DEVICE -DCPAR_SIM -I"$dir" -c "$dir/cpar.c" -o "$dir/sim_cpar.o" &
    $CC $CFLAGS_ALL -DCPAR_WITH_DEVICE -DCPAR_WITH_NCCL -Itests/ncclsim -I"$dir" -c "$dir/cpar.c" -o "$dir/nccl_cpar.o"
    wait
    caught=""
    for s in $SUITES; do
        $CXX "$B/obj/test_$s.o" "$dir/sim_cpar.o" "$B/sim/cpar_kernels.o" -o "$dir/sim_$s" $LIBS || exit 1
        $CXX "$B/obj/test_$s.o" "$dir/nccl_cpar.o" "$B/sim/cpar_kernels.o" "$B/ncclsim/ncclsim.o" \
            "$B/ncclsim/ncclsim_cudasim.o" -o "$dir/nccl_$s" $LIBS || exit 1
        for mode in lazy $(for sd in $SEEDS; do echo "random:$sd"; done); do
            for be in sim nccl; do
                [ -z "$caught" ] || break 3
                if ! CUDASIM_STREAMS=$mode CPAR_TEST_BACKEND=$be CPAR_GPU_SUITE=quick CK_VERBOSITY=silent \
                    timeout 600 "$dir/${be}_$s" > "$dir/out" 2>&1; then
                    caught="$be/$s@$mode"
                    grep -m1 -E ':[FE]:' "$dir/out" | cut -c1-160 | sed 's/^/  /'
                fi
            done
        done
    done
    echo "  caught by: ${caught:-NOTHING}"
    table="$table$(printf '%-5s %-8s %-26s %s' "$n" "$line" "${caught:-NOT CAUGHT}" "$what")
"
done
echo
echo "site  line     caught by                  the call removed"
printf '%s' "$table"
case $table in *"NOT CAUGHT"*) exit 1 ;; esac
exit 0
