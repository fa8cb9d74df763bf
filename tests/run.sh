#!/bin/sh
# SPDX-License-Identifier: MIT
# Run cpar's Check suites: host backend (and the portable build's, named in
# PORTABLE_SUITES), sim (the device backend on the CUDA simulator), nccl-sim (the NCCL backend over the NCCL
# simulator), then the GPU suite, then the drop-in and install checks named
# in PKG_CHECKS (tests/check_*.sh).
# Prints one line per suite as it finishes ("[12/48] nccl-sim/ring 59 passed
# 8.1 s"; a failed one's failing checks and last lines too), the whole
# output into $B/test.log (CPAR_TEST_LOG), and a closing "N passed, N
# failed" line over all tests; exits non-zero when any suite fails.
#
# The suites are independent programs: up to CPAR_TEST_JOBS of them (default:
# the number of cores) run at once, each into a file of its own, and their
# outputs are printed whole, in the order above, as soon as every suite before
# them has finished. CPAR_TEST_JOBS=1 runs them one after another.
# CPAR_TEST_TIMES=FILE appends one line per suite to FILE: its name, wall
# seconds and CPU seconds (user + system, its processes and theirs).
B=${B:-build}
export B
# HOST_FLAVOUR=asan: the host suites from build/asan (make test-sanitize).
HOST_FLAVOUR=${HOST_FLAVOUR:-host}
unset CPAR_GPU_SUITE # set below for the nccl-sim suites only
jobs=${CPAR_TEST_JOBS:-$(nproc 2> /dev/null || getconf _NPROCESSORS_ONLN 2> /dev/null || echo 2)}
case $jobs in '' | *[!0-9]* | 0) echo "run.sh: CPAR_TEST_JOBS must be a positive number, not '$jobs'" >&2; exit 2 ;; esac
passed=0
failed=0
bad=""

# The full output of every suite goes to $LOG (default $B/test.log); the
# terminal gets one line per suite as it finishes, and a failed suite's
# failing checks and last lines. CPAR_TEST_VERBOSE=1 prints every output.
LOG=${CPAR_TEST_LOG:-$B/test.log}
# The failed suites' whole output also goes to $LOG with -failed before .log.
FAILED_LOG=${LOG%.log}-failed.log
[ "$FAILED_LOG" != "$LOG" ] || FAILED_LOG=$LOG.failed
mkdir -p "$(dirname "$LOG")" && : > "$LOG" && : > "$FAILED_LOG" || { echo "run.sh: cannot write $LOG" >&2; exit 2; }

# Account for one suite's output and exit status.
report() { # index, name, output, rc, wall ms
    { echo "== $2"; printf '%s\n' "$3"; } >> "$LOG"
    # Check prints "100%: Checks: 12, Failures: 0, Errors: 0".
    line=$(printf '%s\n' "$3" | grep -E '^[0-9]+%: Checks: [0-9]+' | tail -n 1)
    if [ -n "$line" ]; then
        n=$(echo "$line" | sed -E 's/.*Checks: ([0-9]+).*/\1/')
        f=$(echo "$line" | sed -E 's/.*Failures: ([0-9]+).*/\1/')
        e=$(echo "$line" | sed -E 's/.*Errors: ([0-9]+).*/\1/')
        what="$((n - f - e)) passed"
        [ $((f + e)) -eq 0 ] || what="$what, $((f + e)) FAILED"
        passed=$((passed + n - f - e))
        failed=$((failed + f + e))
    elif [ "$4" -ne 0 ]; then
        what="FAILED (exit $4)"
        failed=$((failed + 1))
    else
        what="ok"
        passed=$((passed + 1)) # a program without Check: its exit status is its one result
    fi
    [ "$4" -eq 0 ] || bad="$bad $2"
    printf '[%d/%d] %-26s %s %6.1f s\n' "$1" "$count" "$2" "$what" "$(echo "$5" | awk '{ print $1 / 1000 }')"
    if [ "${CPAR_TEST_VERBOSE:-0}" = 1 ]; then
        printf '%s\n' "$3" | sed 's/^/    /'
    fi
    if [ "$4" -ne 0 ]; then
        excerpt=$({ printf '%s\n' "$3" | grep -E ':[FE]:' | head -n 20; printf '%s\n' "$3" | tail -n 15; } | sed 's/^/    /')
        [ "${CPAR_TEST_VERBOSE:-0}" = 1 ] || printf '%s\n' "$excerpt"
        # again at the end, where a viewer of the output's tail (CI's) sees it
        printf '== %s (exit %s)\n%s\n' "$2" "$4" "$excerpt" >> "$tmp/failures"
        { echo "== $2 (exit $4)"; printf '%s\n' "$3"; } >> "$FAILED_LOG"
    fi
}

tmp=$(mktemp -d)
# On an interrupt, end the suites' runners before removing their files.
trap 'for p in $pids; do kill "$p" 2> /dev/null; done; rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM

# ---- the list of suites ------------------------------------------------------
# Suite i has $tmp/i.name (its name in the report) and $tmp/i.cmd (a command
# for eval, with the functions and variables of this script).
count=0
add() { # name, command
    count=$((count + 1))
    printf '%s\n' "$1" > "$tmp/$count.name"
    printf '%s\n' "$1" >> "$tmp/names"
    printf '%s\n' "$2" > "$tmp/$count.cmd"
}
suite() { # name, binary, backend[, VAR=value ...]
    n=$1 bin=$2 be=$3
    shift 3
    add "$n" "$* CPAR_TEST_BACKEND=$be \"$bin\""
}

# The simulators' stream modes (below): the seed of random changes per run.
seed=${CPAR_TEST_SEED:-$(($(date +%s) % 100000 + 1))}
case $seed in '' | *[!0-9]*) echo "run.sh: CPAR_TEST_SEED must be a number, not '$seed'" >&2; exit 2 ;; esac
if [ -n "$SIM_SUITES$NCCLSIM_SUITES" ]; then
    echo "streams: sim lazy, nccl-sim random:$seed, NAME@MODE the other (CPAR_TEST_SEED=$seed repeats this run)"
fi

# The fault suites spend their time waiting for deadlines, not computing: the
# three flavours' copies start at once, beside the others and not counted
# among the CPAR_TEST_JOBS.
case " $HOST_SUITES " in *" faults "*) suite "$HOST_FLAVOUR/faults" "\$B/$HOST_FLAVOUR/test_faults" host ;; esac
case " $SIM_SUITES " in *" faults "*)
    suite "sim/faults" "\$B/sim/test_faults" device CUDASIM_STREAMS=lazy CUDASIM_DEVICES=1
    suite "sim/faults@2gpu" "\$B/sim/test_faults" device CUDASIM_STREAMS=random:$seed CUDASIM_DEVICES=2 ;;
esac
case " $NCCLSIM_SUITES " in *" faults "*)
    suite "nccl-sim/faults" "\$B/ncclsim/test_faults" nccl CUDASIM_STREAMS=random:$seed ;;
esac
# make test-tsan: nccl-sim suites built with ThreadSanitizer (build/tsan/ncclsim)
for s in ${TSAN_NCCL_SUITES:-}; do
    suite "tsan/nccl-sim/$s" "\$B/tsan/ncclsim/test_$s" nccl CUDASIM_STREAMS=random:$seed
done
# make test-sanitize: sim-only suites built with ASan and UBSan (build/asan/sim)
for s in ${SAN_SIM_SUITES:-}; do
    suite "asan/sim/$s" "\$B/asan/sim/test_$s" device CUDASIM_STREAMS=lazy
done
without_faults() { for s in "$@"; do [ "$s" = faults ] || printf '%s ' "$s"; done; }
HOST_SUITES=$(without_faults $HOST_SUITES)
SIM_SUITES=$(without_faults $SIM_SUITES)
NCCLSIM_SUITES=$(without_faults $NCCLSIM_SUITES)

# lm_check: a small LM on a synthetic language, tp x cp against 1 rank (one
# result per flavour; bf16 on the simulated devices, every kernel on the CPU).
for s in $HOST_SUITES; do suite "$HOST_FLAVOUR/$s" "\$B/$HOST_FLAVOUR/test_$s" host; done
[ -z "$HOST_SUITES" ] || [ "$HOST_FLAVOUR" != host ] || suite "host/lm_check" "\$B/host/lm_check" host CPAR_LM_BACKEND=host
# The portable build (plain C, no intrinsics or AVX2 twins) on the host backend.
for s in ${PORTABLE_SUITES:-}; do suite "portable/$s" "\$B/portable/test_$s" host; done
# bench --csv/--json: a tiny sweep of the collectives (a second or two) must
# give files every row of which parses, with the columns a plot needs.
bench_check() { # directory for the files
    CPAR_BENCH_ONLY=coll "$B/host/bench" -b 8 -e 64K -f 8 -n 2 --csv "$1/bench.csv" --json "$1/bench.json" \
        > /dev/null || { echo "bench failed"; return 1; }
    awk -F, 'NR == 1 { n = NF; if ($1 != "section" || $0 !~ /,busbw_gbps(,|$)/ || $0 !~ /,bytes(,|$)/) { print "bad header: " $0; bad = 1 } next }
             NF != n { print "line " NR " has " NF " fields, the header " n; bad = 1 }
             $1 == "collectives" { rows++ }
             $1 == "meta" { meta++ }
             END { if (rows < 20) { print "only " rows + 0 " collective rows"; bad = 1 }
                   if (meta != 1) { print meta + 0 " meta rows (version, commit, date, machine), expected 1"; bad = 1 }
                   exit bad }' "$1/bench.csv" || return 1
    if command -v python3 > /dev/null 2>&1; then
        python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); assert len(r) >= 20 and all("busbw_gbps" in x for x in r if x["section"] == "collectives") and r[0]["section"] == "meta" and r[0]["version"] and r[0]["date"], r[:2]' \
            "$1/bench.json" || return 1
    fi
    # one table per section beside it, with that section's columns only (none empty in its rows)
    for sec in meta collectives; do
        awk -F, -v s="$sec" 'NR == 1 { n = NF; next } $1 != s || NF != n { print "'"$1"'/bench-" s ".csv line " NR ": " $0; bad = 1 }
             { for (i = 1; i <= NF; i++) if ($i == "") { print "bench-" s ".csv line " NR " has an empty column " i; bad = 1 } }
             END { if (NR < 2) { print "bench-" s ".csv has no rows"; bad = 1 } exit bad }' "$1/bench-$sec.csv" || return 1
    done
    echo "bench --csv: $(($(wc -l < "$1/bench.csv") - 1)) rows, a table per section, --json parses"
}
# bench's context-parallel attention rows: the four comm types at cp 2 and 4,
# each receiving exactly its minimum forward and backward (one iteration).
bench_attn_check() {
    CPAR_BENCH_ONLY=attn "$B/host/bench" -n 1 --csv "$tmp/attn.csv" > /dev/null || { echo "bench failed"; return 1; }
    awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
             $1 == "attention" && $col["ranks"] > 1 {
                 t[$col["cp_comm"]]++
                 if ($col["recv_fwd_bytes"] != $col["min_recv_fwd_bytes"] || $col["recv_bwd_bytes"] != $col["min_recv_bwd_bytes"]) {
                     print "row " NR " (" $col["name"] ", cp " $col["ranks"] "): received " $col["recv_fwd_bytes"] " / " \
                         $col["recv_bwd_bytes"] ", minimum " $col["min_recv_fwd_bytes"] " / " $col["min_recv_bwd_bytes"]; bad = 1 } }
             END { if (t["all_gather"] < 4 || t["p2p"] < 4 || t["a2a"] < 4 || t["a2a+p2p"] < 2) {
                       print "comm types missing: " t["all_gather"] + 0 " all_gather, " t["p2p"] + 0 " p2p, " t["a2a"] + 0 \
                           " a2a, " t["a2a+p2p"] + 0 " a2a+p2p rows"; bad = 1 }
                   exit bad }' "$tmp/attn.csv" || return 1
    echo "bench: $(grep -c '^attention,.*,cp ' "$tmp/attn.csv") context-parallel attention rows, every one at its minimum"
}
if [ -x "$B/host/bench" ] && [ "$HOST_FLAVOUR" = host ] && [ -n "$HOST_SUITES" ]; then
    add "host/bench-csv" 'mkdir "$tmp/bench" && bench_check "$tmp/bench"'
    add "host/bench-attn" 'bench_attn_check'
fi
# Two nodes on one machine: network namespaces over a veth pair, one cparrun
# in each, the rendezvous between them (skipped in one line without root).
[ -z "$HOST_SUITES" ] || [ "$HOST_FLAVOUR" != host ] || add "host/netns" 'sh tests/check_netns.sh "$B"'
# The README: at most 200 lines, every relative link in it and docs/ resolves,
# its complete program builds as written and runs (tools/check_docs.sh).
[ -z "$HOST_SUITES" ] || [ "$HOST_FLAVOUR" != host ] || add "docs/readme" 'sh tools/check_docs.sh "$tmp"'

# The simulators run stream work late (tests/cudasim.h section 9): the sim
# suites under lazy (work runs only when a host call forces it), the nccl-sim
# suites under random (ready work of every stream interleaved by a seed that
# changes per run; CPAR_TEST_SEED fixes it), and the suites that overlap
# streams under the other mode too, so a missing stream wait or host
# synchronisation gives a wrong value. A failure names its mode and seed.
# The sim build's suites run on the device backend with more ranks than
# simulated GPUs (up to 4 ranks): one GPU under lazy, two under random (the
# simulator's own suites choose their devices).
OVERLAP_SUITES="coll linear ring mamba train"
for s in $SIM_SUITES; do
    case $s in cudasim | devlayer) gpus= ;; *) gpus=CUDASIM_DEVICES=1 ;; esac
    suite "sim/$s" "\$B/sim/test_$s" device CUDASIM_STREAMS=lazy $gpus
done
[ -z "$SIM_SUITES" ] || suite "sim/lm_check" "\$B/sim/lm_check" device CPAR_LM_BACKEND=device CUDASIM_STREAMS=lazy \
    CUDASIM_DEVICES=1
# The device layer's kernels again under the warps schedule (each warp runs
# to its next barrier before the next starts): a barrier missing between
# warps that meet the same warp collectives shows only there (the attention
# kernels' suite, attn_bwd, takes it as one of its schedules).
case " $SIM_SUITES " in *" devlayer "*)
    suite "sim/devlayer@warps" "\$B/sim/test_devlayer" device CUDASIM_SCHEDULE=warps ;;
esac
for s in $SIM_SUITES; do
    case " $OVERLAP_SUITES " in *" $s "*)
        suite "sim/$s@random" "\$B/sim/test_$s" device CUDASIM_STREAMS=random:$seed CUDASIM_DEVICES=2 ;;
    esac
done
# The other backend suites on two simulated GPUs too (ranks on both, peer
# reads); not attn, whose kernels are rank-local, nor the sim-only suites.
for s in $SIM_SUITES; do
    case " $OVERLAP_SUITES attn cudasim devlayer mma attn_bwd trainjob " in *" $s "*) ;; *)
        suite "sim/$s@2gpu" "\$B/sim/test_$s" device CUDASIM_STREAMS=lazy CUDASIM_DEVICES=2 ;;
    esac
done
# Two simulated GPUs without peer access (consumer cards over PCIe): the
# ranks spread over both all the same, their reductions staging the other
# GPU's slices through copies; the simulator fails a kernel that touches the
# other GPU's memory.
for s in $SIM_SUITES; do
    case " coll core mappings ring " in *" $s "*)
        suite "sim/$s@nopeer" "\$B/sim/test_$s" device CUDASIM_STREAMS=random:$seed CUDASIM_DEVICES=2 CUDASIM_PEER=0 ;;
    esac
done
# nccl-sim: the production path (cpar.c as built for GPUs, NCCL calls) on the
# CUDA and NCCL simulators. The GPU suite runs here on simulated GPUs, with
# its smaller sizes (CPAR_GPU_SUITE=quick): its kernels run on the CPU here.
# lm_check runs 16 steps here, not 30: every step makes the same calls, and
# sim's run has the long curve (by steps 12-15 the loss averages under a tenth
# of the first step's, and lm_check asks for half).
for s in $NCCLSIM_SUITES; do
    suite "nccl-sim/$s" "\$B/ncclsim/test_$s" nccl CPAR_GPU_SUITE=quick CUDASIM_STREAMS=random:$seed
done
[ -z "$NCCLSIM_SUITES" ] || suite "nccl-sim/lm_check" "\$B/ncclsim/lm_check" nccl CPAR_LM_BACKEND=nccl \
    CPAR_LM_STEPS=16 CUDASIM_STREAMS=random:$seed
for s in $NCCLSIM_SUITES; do
    case " $OVERLAP_SUITES " in *" $s "*) suite "nccl-sim/$s@lazy" "\$B/ncclsim/test_$s" nccl CUDASIM_STREAMS=lazy ;; esac
done
# The GPU suite's collectives as a one-GPU machine runs them: NCCL on one
# rank, the device backend on 2 and 4 ranks sharing the GPU.
case " $NCCLSIM_SUITES " in *" gpu "*)
    suite "nccl-sim/gpu@1gpu" "\$B/ncclsim/test_gpu" nccl CPAR_GPU_SUITE=quick CK_RUN_CASE=collectives \
        CUDASIM_DEVICES=1 CUDASIM_STREAMS=random:$seed ;;
esac
# The bench's device-backend table, as a one-GPU machine prints it: every
# collective at 2 and 4 ranks, each receiving exactly the algorithm's minimum.
bench_device_check() {
    CUDASIM_DEVICES=1 CPAR_BENCH_ONLY=coll "$B/ncclsim/bench" -b 8 -e 4K -f 8 -n 2 --csv "$tmp/device.csv" \
        > /dev/null || { echo "bench failed"; return 1; }
    awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; r = col["recv_bytes"]; m = col["min_recv_bytes"]; next }
             $1 == "device" { rows++; if (!r || !m || $r != $m) { print "row " NR ": " $0 ": received " $r ", minimum " $m; bad = 1 } }
             END { if (rows < 40) { print "only " rows + 0 " device rows"; bad = 1 } exit bad }' "$tmp/device.csv" || return 1
    echo "bench: $(grep -c '^device,' "$tmp/device.csv") device-backend rows, every one at the minimum volume"
}
if [ -x "$B/ncclsim/bench" ] && [ -n "$NCCLSIM_SUITES" ]; then
    add "nccl-sim/bench-device" 'bench_device_check'
fi
# tools/gpu_check.sh --rehearse: every step of the one-shot GPU check on the
# simulator builds at small sizes, so the script a lent GPU runs cannot rot.
if [ -n "$SIM_SUITES" ] && [ -n "$NCCLSIM_SUITES" ]; then
    add "sim/gpu-check" 'OUT="$tmp/gpu-check" sh tools/gpu_check.sh --rehearse'
fi
if [ -n "$GPU_TEST" ]; then
    suite "gpu" "\$GPU_TEST" nccl
fi
# The README's ways to build a program (make check-dropin, make check-install).
for c in ${PKG_CHECKS:-}; do add "pkg/$c" "sh \"tests/check_$c.sh\""; done

# ---- running them --------------------------------------------------------------
# The longest suites start first, so that the last to finish is a short one;
# the rest start in the report's order. By CPU time measured on 2 cores (the
# drop-in check first: its compiles of cpar.c are one long chain); the
# sanitizer builds' (asan/, tsan/) after them, for make test-sanitize and
# make test-tsan. (A name not here only starts later.)
LONG_FIRST="pkg/dropin nccl-sim/trainjob sim/trainjob nccl-sim/linear sim/linear sim/gpu-check nccl-sim/linear@lazy
            sim/linear@random host/linear sim/inference nccl-sim/ring@lazy sim/inference@2gpu nccl-sim/inference
            sim/lm_check sim/devlayer sim/ring@random sim/devlayer@warps nccl-sim/ring sim/ring host/coll sim/attn
            sim/attn_bwd nccl-sim/attn nccl-sim/lm_check host/hostmp host/attn nccl-sim/gpu host/trainjob
            asan/linear asan/attn asan/sim/attn_bwd asan/ring asan/coll asan/mappings asan/fuzz asan/rng
            tsan/trainjob tsan/ring tsan/nccl-sim/coll tsan/coll tsan/store tsan/mappings tsan/rng tsan/inference"

# Suite i runs in the background into $tmp/i.out, .rc and .time; then its
# runner writes i to the pipe on fd 3, where this shell waits for it.
mkfifo "$tmp/done" && exec 3<> "$tmp/done" || { echo "run.sh: cannot make a pipe in $tmp" >&2; exit 2; }
pids=""
now_ns() { d=$(date +%s%N); case $d in *[!0-9]*) d=$(($(date +%s) * 1000000000)) ;; esac; echo "$d"; }
start() { # index
    (
        t0=$(now_ns)
        (eval "$(cat "$tmp/$1.cmd")") > "$tmp/$1.out" 2>&1 3>&-
        echo $? > "$tmp/$1.rc"
        t1=$(now_ns)
        # times: this subshell's own CPU time, then its children's (into a
        # file: in a pipe it would run in a child of its own and count none).
        times > "$tmp/$1.times"
        cpu=$(sed -n 2p "$tmp/$1.times" | awk '{ s = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); s += a[1] * 60 + a[2] } print s }')
        echo "$(cat "$tmp/$1.name") $(((t1 - t0) / 1000000)) $cpu" > "$tmp/$1.time"
        echo "$1" >&3
    ) &
    pids="$pids $!"
}

# Print every finished suite whose predecessors are all printed.
next=1
flush() {
    while [ $next -le $count ] && [ -f "$tmp/$next.done" ]; do
        report "$next" "$(cat "$tmp/$next.name")" "$(cat "$tmp/$next.out")" "$(cat "$tmp/$next.rc")" \
            "$(cut -d' ' -f2 "$tmp/$next.time")"
        if [ -n "${CPAR_TEST_TIMES:-}" ]; then
            awk '{ printf "%-24s %8.1f %8.1f\n", $1, $2 / 1000, $3 }' "$tmp/$next.time" >> "$CPAR_TEST_TIMES"
        fi
        next=$((next + 1))
    done
}

# Wait for one suite to finish, and print what can be printed.
running=0 # suites running that count against CPAR_TEST_JOBS
left=$count
finish_one() {
    read -r d <&3
    : > "$tmp/$d.done"
    left=$((left - 1))
    [ -f "$tmp/$d.outside" ] || running=$((running - 1))
    flush
}

# The order to start them in: the long ones that exist, then the rest.
order=$(awk -v long="$LONG_FIRST" '{ name[NR] = $0 }
    END { n = split(long, l); for (k = 1; k <= n; k++) for (i = 1; i <= NR; i++) if (name[i] == l[k]) { printf "%d ", i; used[i] = 1 }
          for (i = 1; i <= NR; i++) if (!used[i]) printf "%d ", i }' "$tmp/names")

# The fault suites start first, outside the count.
for i in $order; do
    case $(sed -n "${i}p" "$tmp/names") in */faults | */faults@*) : > "$tmp/$i.outside" && start $i ;; esac
done
for i in $order; do
    [ ! -f "$tmp/$i.outside" ] || continue
    while [ $running -ge "$jobs" ]; do finish_one; done
    start $i
    running=$((running + 1))
done
while [ $left -gt 0 ]; do finish_one; done
wait

echo
[ ! -f "$tmp/failures" ] || cat "$tmp/failures"
[ -z "$bad" ] || echo "failed suites:$bad (streams: sim lazy, nccl-sim random:$seed; CPAR_TEST_SEED=$seed repeats it)"
echo "$passed passed, $failed failed (every suite's output: $LOG${bad:+; the failed ones': $FAILED_LOG})"
[ -z "$bad" ]
