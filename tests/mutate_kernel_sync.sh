#!/bin/sh
# SPDX-License-Identifier: MIT
# mutate_kernel_sync.sh — proof that the simulator sees every barrier and
# every cp.async wait of the attention kernels.
#
# For each __syncthreads() and cpar__attn_cp_wait<N>() in cpar_kernels.cu's
# section 16 (the flash kernels), builds tests/test_attn_bwd.cu, which
# includes the kernels, with that one barrier removed or that wait one group
# short (wait<N + 1>: the latest copy group may still be in flight), runs it
# (forward, reverse, warps and shuffle fiber schedules; tests/cudasim.h lands
# cp.async at the latest moment PTX allows and fills the destination with
# NaNs until then), stops at the first failed check and prints it:
#
#   tests/mutate_kernel_sync.sh --list          the sites, numbered
#   tests/mutate_kernel_sync.sh [N ...]         mutate sites N (default: all); a table last
#
# A mutant no check kills is SURVIVED: either a test is missing, or the
# barrier or wait guards nothing (a wait with no copy in flight there: say so
# beside it in the source). About 35 s a site on 2 cores (a compile of
# the attention sections, then the suite until its first failure); it writes
# only under a temporary directory (MUTATE_DIR to keep it).
set -u
cd "$(dirname "$0")/.." || exit 2
CXX=${CXX:-g++}
PATTERN='__syncthreads\(\);|cpar__attn_cp_wait<[0-9]+>\(\);'

# Sites: line numbers in section 16 whose code (not a comment) is a barrier or a wait.
sites() {
    first=$(grep -n '^/\* ==== 16\. ' cpar_kernels.cu | cut -d: -f1)
    last=$(grep -n '^/\* ==== 17\. ' cpar_kernels.cu | cut -d: -f1)
    if [ -z "$first" ] || [ -z "$last" ]; then
        echo "mutate_kernel_sync.sh: sections 16 and 17 of cpar_kernels.cu not found" >&2
        return 1
    fi
    grep -nE "$PATTERN" cpar_kernels.cu | grep -vE '^[0-9]+: *(/\*|\*)' | cut -d: -f1 |
        awk -v a="$first" -v b="$last" '$1 > a && $1 < b'
}
all=$(sites) || exit 2
if [ "${1:-}" = --list ]; then
    i=0
    for l in $all; do
        i=$((i + 1))
        printf '%3d  cpar_kernels.cu:%-6s %s\n' $i "$l" "$(sed -n "${l}p" cpar_kernels.cu | sed 's/^ *//' | cut -c1-90)"
    done
    exit 0
fi
want=${*:-$(seq 1 "$(echo "$all" | wc -l)")}
dir=${MUTATE_DIR:-$(mktemp -d)}
mkdir -p "$dir"
LIBS="$(pkg-config --libs check 2> /dev/null || echo -lcheck -lsubunit) -pthread -lm -lrt"
table=""

for n in $want; do
    line=$(echo "$all" | sed -n "${n}p")
    [ -n "$line" ] || { echo "mutate_kernel_sync.sh: no site $n (see --list)" >&2; exit 2; }
    what=$(sed -n "${line}p" cpar_kernels.cu | sed 's/^ *//' | cut -c1-60)
    echo "== site $n, cpar_kernels.cu:$line: $what"
    # The barrier goes; the wait lets one more group stay in flight (its
    # count follows the 19 characters of "cpar__attn_cp_wait<").
    awk -v l="$line" 'NR == l {
            if (sub(/__syncthreads\(\);/, ";")) { print; next }
            if (match($0, /cpar__attn_cp_wait<[0-9]+>/)) {
                n = substr($0, RSTART + 19, RLENGTH - 20) + 1
                $0 = substr($0, 1, RSTART - 1) "cpar__attn_cp_wait<" n ">" substr($0, RSTART + RLENGTH)
            }
        }
        { print }' cpar_kernels.cu > "$dir/cpar_kernels.cu" || exit 2
    if cmp -s "$dir/cpar_kernels.cu" cpar_kernels.cu; then echo "  (nothing replaced)"; continue; fi
    echo "  -> $(sed -n "${line}p" "$dir/cpar_kernels.cu" | sed 's/^ *//' | cut -c1-60)"
    # test_attn_bwd.cu's #include "cpar_kernels.cu" finds the mutant first
    if ! $CXX -std=c++17 -O1 -g -pthread -I"$dir" -I. -DCPAR_SIM -w -x c++ tests/test_attn_bwd.cu \
        -o "$dir/test_attn_bwd" $LIBS > "$dir/build.log" 2>&1; then
        echo "  (the mutant does not compile: $dir/build.log)"
        table="$table$(printf '%3d  %-6s %-10s %s' "$n" "$line" "no build" "$what")
"
        continue
    fi
    caught=$(CK_TAP_LOG_FILE_NAME=/dev/stdout timeout 300 "$dir/test_attn_bwd" 2> /dev/null |
        awk '/^not ok/ { sub(/^not ok [0-9]+ - /, ""); print substr($0, 1, 110); exit }')
    if [ -n "$caught" ]; then
        echo "  caught: $caught"
        table="$table$(printf '%3d  %-6s %-10s %s' "$n" "$line" caught "$what")
"
    else
        echo "  SURVIVED: every check passed"
        table="$table$(printf '%3d  %-6s %-10s %s' "$n" "$line" SURVIVED "$what")
"
    fi
done
echo
echo "== mutate_kernel_sync.sh: site, line, outcome (mutants in $dir)"
printf '%s' "$table"
case $table in *SURVIVED* | *"no build"*) exit 1 ;; esac
exit 0
