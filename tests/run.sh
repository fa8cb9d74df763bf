#!/bin/sh
# SPDX-License-Identifier: MIT
# Run cpar's Check suites: host backend, sim backend, nccl-sim (the NCCL
# backend over the NCCL simulator), then the GPU suite, then the drop-in and
# install checks named in PKG_CHECKS (tests/check_*.sh).
# Prints each suite's Check summary and a closing "N passed, N failed" line
# over all tests; exits non-zero when any suite fails.
B=${B:-build}
export B
# HOST_FLAVOUR=asan: the host suites from build/asan (make test-sanitize).
HOST_FLAVOUR=${HOST_FLAVOUR:-host}
passed=0
failed=0
bad=""

# Account for one suite's output and exit status.
report() { # name, output, rc
    echo "== $1"
    printf '%s\n' "$2"
    # Check prints "100%: Checks: 12, Failures: 0, Errors: 0".
    line=$(printf '%s\n' "$2" | grep -E '^[0-9]+%: Checks: [0-9]+' | tail -n 1)
    if [ -n "$line" ]; then
        n=$(echo "$line" | sed -E 's/.*Checks: ([0-9]+).*/\1/')
        f=$(echo "$line" | sed -E 's/.*Failures: ([0-9]+).*/\1/')
        e=$(echo "$line" | sed -E 's/.*Errors: ([0-9]+).*/\1/')
        passed=$((passed + n - f - e))
        failed=$((failed + f + e))
    elif [ "$3" -ne 0 ]; then
        failed=$((failed + 1))
    else
        passed=$((passed + 1)) # a program without Check: its exit status is its one result
    fi
    [ "$3" -eq 0 ] || bad="$bad $1"
}

run() { # name, binary, backend
    out=$(CPAR_TEST_BACKEND=$3 "$2" 2>&1)
    report "$1" "$out" $?
}

# The fault suites spend their time waiting for deadlines, not computing: the
# three flavours' copies run side by side first, then everything else in turn.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
waiting=""
for flavour in host sim ncclsim; do
    case $flavour in
    host) list=$HOST_SUITES be=host dir=$HOST_FLAVOUR ;; sim) list=$SIM_SUITES be=sim dir=sim ;; *) list=$NCCLSIM_SUITES be=nccl dir=ncclsim ;;
    esac
    case " $list " in *" faults "*)
        (CPAR_TEST_BACKEND=$be "$B/$dir/test_faults" > "$tmp/$flavour.out" 2>&1; echo $? > "$tmp/$flavour.rc") &
        waiting="$waiting $flavour" ;;
    esac
done
wait
for flavour in $waiting; do
    name=$([ $flavour = ncclsim ] && echo nccl-sim || { [ $flavour = host ] && echo $HOST_FLAVOUR; } || echo $flavour)/faults
    report "$name" "$(cat "$tmp/$flavour.out")" "$(cat "$tmp/$flavour.rc")"
done
without_faults() { for s in "$@"; do [ "$s" = faults ] || printf '%s ' "$s"; done; }
HOST_SUITES=$(without_faults $HOST_SUITES)
SIM_SUITES=$(without_faults $SIM_SUITES)
NCCLSIM_SUITES=$(without_faults $NCCLSIM_SUITES)

# lm_check: a small LM on a synthetic language, tp x cp against 1 rank (one
# result per flavour; bf16 on the simulated devices, every kernel on the CPU).
for s in $HOST_SUITES; do run "$HOST_FLAVOUR/$s" "$B/$HOST_FLAVOUR/test_$s" host; done
[ -z "$HOST_SUITES" ] || [ "$HOST_FLAVOUR" != host ] || CPAR_LM_BACKEND=host run "host/lm_check" "$B/host/lm_check" host
# bench --csv/--json: a tiny sweep of the collectives (a second or two) must
# give files every row of which parses, with the columns a plot needs.
bench_check() {
    CPAR_BENCH_ONLY=coll "$B/host/bench" -b 8 -e 64K -f 8 -n 2 --csv "$tmp/bench.csv" --json "$tmp/bench.json" \
        > /dev/null || { echo "bench failed"; return 1; }
    awk -F, 'NR == 1 { n = NF; if ($1 != "section" || $0 !~ /,busbw_gbps(,|$)/ || $0 !~ /,bytes(,|$)/) { print "bad header: " $0; bad = 1 } next }
             NF != n { print "line " NR " has " NF " fields, the header " n; bad = 1 }
             $1 == "collectives" { rows++ }
             END { if (rows < 20) { print "only " rows + 0 " collective rows"; bad = 1 } exit bad }' "$tmp/bench.csv" || return 1
    if command -v python3 > /dev/null 2>&1; then
        python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); assert len(r) >= 20 and all("busbw_gbps" in x for x in r if x["section"] == "collectives"), r[:2]' \
            "$tmp/bench.json" || return 1
    fi
    echo "bench --csv: $(($(wc -l < "$tmp/bench.csv") - 1)) rows, --json parses"
}
if [ -x "$B/host/bench" ] && [ "$HOST_FLAVOUR" = host ] && [ -n "$HOST_SUITES" ]; then
    out=$(bench_check 2>&1)
    report "host/bench-csv" "$out" $?
fi
for s in $SIM_SUITES; do run "sim/$s" "$B/sim/test_$s" sim; done
[ -z "$SIM_SUITES" ] || CPAR_LM_BACKEND=sim run "sim/lm_check" "$B/sim/lm_check" sim
# nccl-sim: the production path (cpar.c as built for GPUs, NCCL calls) on the
# CUDA and NCCL simulators. The GPU suite runs here on simulated GPUs.
export CPAR_GPU_SUITE=quick # the GPU suite's smaller sizes: its kernels run on the CPU here
for s in $NCCLSIM_SUITES; do run "nccl-sim/$s" "$B/ncclsim/test_$s" nccl; done
unset CPAR_GPU_SUITE
[ -z "$NCCLSIM_SUITES" ] || CPAR_LM_BACKEND=nccl run "nccl-sim/lm_check" "$B/ncclsim/lm_check" nccl
if [ -n "$GPU_TEST" ]; then
    run "gpu" "$GPU_TEST" nccl
fi
# The README's ways to build a program (make check-dropin, make check-install).
for c in ${PKG_CHECKS:-}; do
    out=$(sh "tests/check_$c.sh" 2>&1)
    report "pkg/$c" "$out" $?
done

echo
[ -z "$bad" ] || echo "failed suites:$bad"
echo "$passed passed, $failed failed"
[ -z "$bad" ]
