#!/bin/sh
# SPDX-License-Identifier: MIT
# make check-dropin: the README's "Use cpar in your project" command lines,
# run as written on a copy of the three files in a temporary directory, so
# the README stays true. The blocks are the fenced code after the lines
# "<!-- check-dropin: host -->" and "<!-- check-dropin: cuda -->" in
# README.md; my_prog.c is tests/pkg_prog.c.
#   host: build and run.
#   cuda: (with nvcc and nccl.h, unless CPAR_CUDA=0) build; run on a GPU when
#         there is one, else on the host backend (the CUDA libraries must
#         still load). Then the easy mistake (cpar.c without -DCPAR_WITH_DEVICE
#         linked with cpar_kernels.o) must fail on the one symbol that names
#         the define.
# The block's nvcc line is the one slow step (minutes). With DROPIN_KERNELS
# (make passes its own build of cpar_kernels.cu, made by nvcc from the same
# file for a superset of the architectures), nvcc checks the line instead:
# --dryrun must accept its options and -gencode pairs, and its preprocessing
# pass must find the copy's headers; the object then stands in for the
# line's output, and every other line runs as written. CPAR_DROPIN_NVCC=1
# runs the nvcc line as written too.
# Environment (the Makefile passes it): CC, CUDA_HOME, CPAR_CUDA, DROPIN_ARCH
# (the GPU architecture to put in the block's ARCH= line), DROPIN_KERNELS.
# Prints one line per step; a failing step prints its commands and output.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
CC=${CC:-cc}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export CC CUDA_HOME
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fail() { echo "check-dropin: $*"; exit 1; }

# The fenced block after the marker line for $1.
block() {
    awk -v m="<!-- check-dropin: $1 -->" '
        $0 == m { f = 1; next }
        f == 1 && /^```/ { f = 2; next }
        f == 2 && /^```/ { exit }
        f == 2 { print }' "$root/README.md"
}

# A fresh directory $tmp/$1 with the three files and my_prog.c.
fresh() {
    mkdir "$tmp/$1" && cp "$root/cpar.h" "$root/cpar.c" "$root/cpar_kernels.cu" "$tmp/$1/" &&
        cp "$root/tests/pkg_prog.c" "$tmp/$1/my_prog.c" || fail "cannot set up $tmp/$1"
}

# The stand-in for the README's nvcc line (see above), prepended to the
# cuda block's script: the line's options go to nvcc --dryrun and, without
# -c and -o, to a preprocessing pass; DROPIN_KERNELS becomes the -o file.
nvcc_stand_in='dropin_nvcc() {
    "$CUDA_HOME/bin/nvcc" --dryrun "$@" > nvcc-dryrun.log 2>&1 || { cat nvcc-dryrun.log; return 1; }
    out= skip=
    for a; do
        shift
        if [ -n "$skip" ]; then out=$a skip=; continue; fi
        case $a in -o) skip=1 ;; -c) ;; *) set -- "$@" "$a" ;; esac
    done
    [ -n "$out" ] || { echo "the nvcc line has no -o FILE"; return 1; }
    "$CUDA_HOME/bin/nvcc" "$@" -E -o /dev/null && cp "$DROPIN_KERNELS" "$out"
}'

# Run README block $1 in $tmp/$1 (as a script: a failing command stops it).
run_block() {
    block "$1" > "$tmp/$1.sh"
    [ -s "$tmp/$1.sh" ] || fail "README.md has no block after '<!-- check-dropin: $1 -->'"
    [ -z "${2:-}" ] || sed -i "s/^ARCH=[0-9]*/ARCH=$2/" "$tmp/$1.sh"
    if [ "$1" = cuda ] && [ -n "${DROPIN_KERNELS:-}" ] && [ "${CPAR_DROPIN_NVCC:-0}" != 1 ]; then
        [ -r "$DROPIN_KERNELS" ] || fail "DROPIN_KERNELS=$DROPIN_KERNELS is not a readable file"
        grep -q '^"\$CUDA_HOME/bin/nvcc" ' "$tmp/$1.sh" ||
            fail "cuda: no line of README.md's block starts with \"\$CUDA_HOME/bin/nvcc\" (the stand-in's mark)"
        { printf '%s\n' "$nvcc_stand_in"; sed 's|^"\$CUDA_HOME/bin/nvcc" |dropin_nvcc |' "$tmp/$1.sh"; } > "$tmp/$1.sh.new" &&
            mv "$tmp/$1.sh.new" "$tmp/$1.sh" || fail "cannot write $tmp/$1.sh"
        export DROPIN_KERNELS
    fi
    fresh "$1"
    if ! (cd "$tmp/$1" && sh -ex "$tmp/$1.sh") > "$tmp/$1.log" 2>&1; then
        cat "$tmp/$1.log"
        fail "$1: the README's command lines failed (above)"
    fi
}

run_block host
out=$(cd "$tmp/host" && ./my_prog 2>&1) || { echo "$out"; fail "host: my_prog failed"; }
echo "check-dropin: host: README commands built my_prog; it ran: $out"

nvcc=$CUDA_HOME/bin/nvcc
if [ "${CPAR_CUDA:-1}" = 0 ]; then
    echo "check-dropin: cuda: skipped (CPAR_CUDA=0)"
    exit 0
fi
if [ ! -x "$nvcc" ] || ! { [ -f "$CUDA_HOME/include/nccl.h" ] || [ -f /usr/include/nccl.h ] || [ -f /usr/local/include/nccl.h ]; }; then
    echo "check-dropin: cuda: skipped (no nvcc at $nvcc, or no nccl.h)"
    exit 0
fi
run_block cuda "${DROPIN_ARCH:-}"
nvcc_how=
[ ! -f "$tmp/cuda/nvcc-dryrun.log" ] || nvcc_how=" (its nvcc line checked by nvcc --dryrun and -E, make's cpar_kernels.o standing in for the object)"
if nvidia-smi -L > /dev/null 2>&1; then
    out=$(cd "$tmp/cuda" && ./my_prog nccl 1 2>&1) || { echo "$out"; fail "cuda: my_prog nccl 1 failed"; }
    echo "check-dropin: cuda: README commands built my_prog$nvcc_how; it ran on a GPU: $out"
else
    # No GPU: the host backend still shows that the CUDA libraries load (rpath).
    out=$(cd "$tmp/cuda" && ./my_prog 2>&1) || { echo "$out"; fail "cuda: my_prog (host backend) failed"; }
    echo "check-dropin: cuda: README commands built my_prog$nvcc_how; no GPU here, so it ran on the host backend: $out"
fi

# The mistake the link guard exists for: its only error must name the define.
# (-O0: optimisation plays no part in which symbols the object defines.)
cd "$tmp/cuda" || fail "no $tmp/cuda"
$CC -std=c11 -O0 -pthread -c cpar.c -o cpar_host.o || fail "cuda: cc -c cpar.c failed"
if $CC my_prog.c cpar_host.o cpar_kernels.o -o wrong -L"$CUDA_HOME/lib64" -lnccl -lcublas -lcudart -lstdc++ -lm -lrt \
    -pthread > wrong.log 2>&1; then
    fail "linking cpar.c built without -DCPAR_WITH_DEVICE with cpar_kernels.o succeeded; it must fail"
fi
n=$(grep -c 'multiple definition' wrong.log)
if [ "$n" -ne 1 ] || ! grep -q 'cpar_link_error_cpar_c_built_without_CPAR_WITH_DEVICE' wrong.log; then
    cat wrong.log
    fail "the wrong link gave $n 'multiple definition' errors; expected one, naming CPAR_WITH_DEVICE"
fi
echo "check-dropin: cuda: cpar.c without -DCPAR_WITH_DEVICE fails to link with one error naming the define"
