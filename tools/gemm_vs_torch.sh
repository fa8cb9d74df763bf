#!/bin/sh
# SPDX-License-Identifier: MIT
# gemm_vs_torch.sh — cpar's host bf16 GEMM beside torch's, in one process,
# one thread each: a bf16 linear forward y = x wᵀ (cpar_linear_forward,
# through tools/gemm_vs_torch.c and ctypes) against torch's x @ w.t()
# (oneDNN), calls alternating, so that both see the same machine at the same
# moment and each follows a call of the other (which leaves the caches in
# the same state for both). This shared VM switches between a fast and a
# slow state from one second to the next; separate processes, or several
# calls of one library in a row, measured that more than the libraries.
# Prints per shape the median call of each and the median of the per-pair
# ratios (cpar's speed over torch's) with its quartiles.
#
#   tools/gemm_vs_torch.sh                    a venv with torch in build/gemmvs/venv (PyPI, ~5 GB, once)
#   tools/gemm_vs_torch.sh --python PY        an interpreter that has torch
#   tools/gemm_vs_torch.sh --pairs N          N pairs of calls per shape (default 200)
#
# Shapes [T, K] x [N, K]ᵀ: 1024 x 1024 x 1024 and the linear layer's 256 x
# 1024 x 4096 (issue 31), the smaller ones of make bench's table, then an
# MLP's two products at hidden size 2048 (k 2048 and 8192).
set -eu
cd "$(dirname "$0")/.."

py= pairs=200
while [ $# -gt 0 ]; do
    case $1 in
        --python) py=${2:?--python needs an interpreter}; shift 2 ;;
        --pairs) pairs=${2:?--pairs needs a number}; shift 2 ;;
        *) echo "gemm_vs_torch.sh: unknown argument '$1' (--python PY, --pairs N)" >&2; exit 2 ;;
    esac
done
case $pairs in '' | *[!0-9]* | 0) echo "gemm_vs_torch.sh: --pairs must be a positive number, not '$pairs'" >&2; exit 2 ;; esac

out=build/gemmvs
mkdir -p "$out"
CC=${CC:-cc}
# cpar.c as the library builds it (make's flags), position-independent.
$CC -std=c11 -Wall -Wextra -Wpedantic -O2 -pthread -fPIC -I. -c cpar.c -o "$out/cpar.o"
$CC -std=c11 -Wall -Wextra -Wpedantic -O2 -fPIC -I. -c tools/gemm_vs_torch.c -o "$out/gemm_vs_torch.o"
$CC -shared -o "$out/libgemmvs.so" "$out/gemm_vs_torch.o" "$out/cpar.o" -pthread -lm -lrt

if [ -z "$py" ]; then
    py=$out/venv/bin/python
    if ! "$py" -c 'import torch' 2> /dev/null; then
        python3 -m venv "$out/venv"
        "$out/venv/bin/pip" install -q torch
    fi
fi

"$py" - "$out/libgemmvs.so" "$pairs" << 'EOF'
import ctypes, datetime, platform, statistics, sys, time
import torch

torch.set_num_threads(1)
lib = ctypes.CDLL(sys.argv[1])
lib.gemm_vs_make.restype, lib.gemm_vs_make.argtypes = ctypes.c_void_p, [ctypes.c_long] * 3
lib.gemm_vs_call.restype, lib.gemm_vs_call.argtypes = ctypes.c_double, [ctypes.c_void_p]
pairs = int(sys.argv[2])
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu}, torch {torch.__version__}, "
      f"one thread each, {pairs} alternating pairs of calls per shape")
print(f"{'T x K x N':>16} {'torch GF/s':>11} {'cpar GF/s':>10} {'cpar/torch':>11} {'quartiles':>14}")
for t, k, n in [(1024, 1024, 1024), (256, 1024, 4096), (256, 128, 512), (1024, 64, 1024), (1024, 1024, 64),
                (256, 2048, 8192), (256, 8192, 2048)]:
    c = lib.gemm_vs_make(t, k, n)
    if not c:
        sys.exit(1)
    x = torch.rand(t, k).mul(2).sub(1).bfloat16()
    w = torch.randn(n, k).mul(0.02).bfloat16()
    tt, tc = [], []
    for i in range(pairs + 5):  # the first 5 pairs warm up
        t0 = time.perf_counter()
        x @ w.t()
        t1 = time.perf_counter()
        s = lib.gemm_vs_call(c)
        if s < 0:
            sys.exit(1)
        if i >= 5:
            tt.append(t1 - t0)
            tc.append(s)
    flop = 2.0 * t * k * n / 1e9
    r = sorted(a / b for a, b in zip(tt, tc))
    print(f"{t:>5}x{k}x{n:<5} {flop / statistics.median(tt):>11.0f} {flop / statistics.median(tc):>10.0f} "
          f"{r[len(r) // 2]:>11.3f} {r[len(r) // 4]:>6.3f}-{r[3 * len(r) // 4]:.3f}")
EOF
