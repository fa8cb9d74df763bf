#!/bin/sh
# SPDX-License-Identifier: MIT
# gpu_check.sh — the one-shot device check (make gpu-check): everything a
# short lease of one GPU should tell, in one command.
#
#   tools/gpu_check.sh             on the GPU machine: probe, build for its
#                                  architecture, the GPU suite, a short
#                                  training run (f32 and bf16), the bench
#                                  beside torch; a summary last
#   tools/gpu_check.sh --prepare   on this side, before the lease: .gpu/
#                                  (git-ignored) with Check's header and
#                                  static libraries, which the GPU image
#                                  lacks, and the kernels prebuilt for sm_90;
#                                  the device call carries it (carry: .gpu)
#   tools/gpu_check.sh --prepare --baseline REV
#                                  the same, and the sources of commit REV
#                                  with their kernels prebuilt, in
#                                  .gpu/baseline: the GPU mode then times
#                                  REV's attention beside this tree's (A/B
#                                  on the same GPU, in the same call)
#   tools/gpu_check.sh --rehearse  every step on this machine, on the
#                                  simulator builds at small sizes (make test
#                                  runs it, so the script cannot rot)
#
# The device call: run(command="sh tools/gpu_check.sh", carry=[".gpu"],
# timeout_s=540). Logs, the bench's CSV and the summary go to $OUT (the
# device tool's folder; else build/gpu-check), at most 8 files; the summary
# prints last, since the reply carries only the output's tail.
#
# Time budget (GPU mode), 8 minutes in all, build included; every step has
# its own limit, so the summary always comes:
#   probe 10 s; build 120 s with the carried kernels (nvcc's pass over
#   cpar_kernels.cu for one architecture takes 3-4 minutes of one core, so
#   without them it has 300 s and the bench what is left); GPU suite 100 s;
#   the device backend's suites and tp 2 x cp 2 run 120 s; training 2 x 45
#   s; bench the rest, at most 150 s of cases (the quick sections first:
#   memory-bound, GEMM, cross entropy, then attention) and 30 s for the case
#   under way, less the 150 s kept for the attention at s 8192 three ways
#   (bench_attn.log, a table of the three in the summary): as built, with
#   dq by atomics (CPAR_ATTN_DQ=atomic; its forward rows with the CTAs in
#   batch·head order, CPAR_ATTN_FWD_GRID=heads, the order before 2026-12-07),
#   and the carried baseline's (its
#   library built here from the carried kernels, 60 s). Here nvcc takes
#   1-2.5 minutes for sm_90, and carrying its object (a few MiB) takes no
#   time, so the script uses the carried one whenever it was built from the
#   same sources by the same nvcc. Measured on an H200 (2026-11-28): machine
#   start about 35 s, probe 6-9 s, build 16-20 s, GPU suite 19-22 s, device
#   backend 34-40 s, training 9 s each; the whole bench needs about 4
#   minutes (GPU_CHECK_BENCH=mem,gemm,xent runs the other sections alone:
#   51 s; GPU_BENCH_ARGS adds gpu_bench.py options, e.g. "--attn-s 8192
#   --attn-d 128").
set -u
cd "$(dirname "$0")/.." || exit 2

mode=gpu
baseline=""
case ${1:-} in
    "") ;;
    --prepare) mode=prepare ;;
    --rehearse) mode=rehearse ;;
    -h | --help) sed -n '2,49p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (--prepare, --rehearse or none)" >&2; exit 2 ;;
esac
case $mode:${2:-}:${3:-} in
    *::) [ $# -le 1 ] || { echo "gpu_check.sh: unexpected arguments after $1" >&2; exit 2; } ;;
    prepare:--baseline:?*)
        [ $# -eq 3 ] || { echo "gpu_check.sh: unexpected arguments after --baseline $3" >&2; exit 2; }
        baseline=$3 ;;
    prepare:--baseline:) echo "gpu_check.sh: --baseline needs a commit (e.g. --baseline a8d7189)" >&2; exit 2 ;;
    *) echo "gpu_check.sh: '${2:-}${3:+ $3}' after $1: only --prepare takes one, --baseline REV" >&2; exit 2 ;;
esac

CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${NVCC:-$CUDA_HOME/bin/nvcc}
PYTHON=${PYTHON:-python3}
CARRY=.gpu
ARCH=${GPU_CHECK_ARCH:-90} # H100, H200; the GPU mode reads the GPU's own
# The version in DIR/cpar.h, which names its shared library.
version_of() { awk '/^#define CPAR_VERSION_(MAJOR|MINOR|PATCH) / { printf "%s%s", s, $3; s = "." }' "$1/cpar.h"; }
VERSION=$(version_of .)
t_start=$(date +%s)
summary=""

note() { summary="$summary$1
"; }
elapsed() { echo $(($(date +%s) - t_start)); }

# Run a step with a time limit, its output in a log; record the outcome.
# step NAME LIMIT_S LOG COMMAND...
step() {
    s_name=$1 s_limit=$2 s_log=$3
    shift 3
    s_t0=$(date +%s)
    echo "== $s_name (limit ${s_limit} s, log $s_log)"
    case $(command -v "$1") in
        */*) timeout --kill-after=5 "$s_limit" "$@" > "$s_log" 2>&1 ;;
        *) ("$@") > "$s_log" 2>&1 ;; # a function of this script: quick, no limit
    esac
    s_rc=$?
    s_dt=$(($(date +%s) - s_t0))
    tail -n 15 "$s_log" | sed 's/^/  /' # indented: a log's Check summary is not this script's
    case $s_rc in
        0) s_st=ok ;;
        124 | 137) s_st="TIMEOUT after ${s_limit} s" ;;
        *) s_st="FAILED (exit $s_rc)" ;;
    esac
    note "$(printf '%-22s %-24s %5d s' "$s_name" "$s_st" "$s_dt")"
    [ $s_rc -eq 0 ]
}

# The source of the kernels' object: sources, build rules and the compiler.
kernels_stamp() {
    printf 'arch %s\n%s\n' "$ARCH" "$("$NVCC" --version 2> /dev/null | tail -n 1)"
    cat cpar_kernels.cu cpar.h Makefile | sha256sum | cut -c1-16
}

# Check's header and static libraries, for a machine without Check.
prepare_check() { # destination directory
    mkdir -p "$1/include" "$1/lib"
    inc=$(printf '#include <check.h>\n' | ${CC:-cc} -E -x c - 2> /dev/null | sed -n 's/^# [0-9]* "\(.*\/check\.h\)".*/\1/p' | head -n 1)
    [ -n "$inc" ] || { echo "gpu_check.sh: check.h not found here (apt-get install -y check)"; return 1; }
    cp "$inc" "$(dirname "$inc")/check_stdint.h" "$1/include/" || return 1
    for l in check subunit; do
        a=$(${CC:-cc} -print-file-name="lib$l.a")
        [ -f "$a" ] || { echo "gpu_check.sh: lib$l.a not found (apt-get install -y check libsubunit-dev)"; return 1; }
        cp "$a" "$1/lib/"
    done
    echo "Check: $inc and its static libraries into $1"
}

# The carry's Check, prepared as --prepare does, links and runs a suite.
rehearse_check() { # directory
    prepare_check "$1/check" || return 1
    printf '%s\n' '#include <check.h>' 'START_TEST(t) { ck_assert_int_eq(1, 1); }' 'END_TEST' \
        'int main(void) { Suite *s = suite_create("carried"); TCase *c = tcase_create("c"); tcase_add_test(c, t);' \
        '    suite_add_tcase(s, c); SRunner *r = srunner_create(s); srunner_run_all(r, CK_NORMAL);' \
        '    return srunner_ntests_failed(r) != 0; }' > "$1/carried.c"
    ${CC:-cc} -I"$1/check/include" "$1/carried.c" "$1/check/lib/libcheck.a" "$1/check/lib/libsubunit.a" \
        -lrt -lm -pthread -o "$1/carried" && "$1/carried"
}

# The sources of commit REV, for the A/B: DIR/BASELINE names the commit.
baseline_unpack() { # rev dir
    git rev-parse --verify -q "$1^{commit}" > /dev/null ||
        { echo "gpu_check.sh: '$1' is not a commit of this repository"; return 1; }
    rm -rf "$2" && mkdir -p "$2" || return 1
    git archive --format=tar "$1" | tar -x -C "$2" || return 1
    git log -1 --format='%h %cs %s' "$1" | cut -c1-90 > "$2/BASELINE"
    echo "baseline: $(cat "$2/BASELINE")"
}

# ---- --prepare -------------------------------------------------------------------
# Kernels for sm_$ARCH, built in DIR, into $CARRY/cpar_kernels_sm$ARCH.o with
# the stamp of their sources (DIR is this tree or the baseline's).
prepare_kernels() { # dir carry-dir
    echo "kernels of $1 for sm_$ARCH (nvcc, one architecture: about 2.5 minutes of one core here)"
    t0=$(date +%s) kb=$PWD/$2/kbuild
    (cd "$1" && make --no-print-directory B="$kb" CPAR_CUDA=1 CUDA_ARCH="$ARCH" "$kb/cuda/cpar_kernels.o") || return 1
    mv "$kb/cuda/cpar_kernels.o" "$2/cpar_kernels_sm$ARCH.o" &&
        (cd "$1" && kernels_stamp) > "$2/cpar_kernels_sm$ARCH.stamp" || return 1
    rm -rf "$kb"
    echo "built in $(($(date +%s) - t0)) s"
}
if [ $mode = prepare ]; then
    prepare_check "$CARRY/check" || exit 1
    rm -rf "$CARRY/baseline"
    [ -z "$baseline" ] || baseline_unpack "$baseline" "$CARRY/baseline" || exit 1
    if [ -x "$NVCC" ]; then
        prepare_kernels . "$CARRY" || exit 1
        [ -z "$baseline" ] || prepare_kernels "$CARRY/baseline" "$CARRY/baseline" || exit 1
    else
        echo "no nvcc at $NVCC: the device will compile the kernels itself (3-4 minutes of its budget)"
        [ -z "$baseline" ] || echo "(and, without them, skip the baseline: its kernels would take as long again)"
    fi
    du -sh "$CARRY"
    echo "carry it: run(command=\"sh tools/gpu_check.sh\", carry=[\"$CARRY\"], timeout_s=540)"
    exit 0
fi

if [ $mode = rehearse ]; then
    OUT=${OUT:-$(mktemp -d)}
else
    OUT=${OUT:-build/gpu-check}
fi
mkdir -p "$OUT"
B=${B:-build}

# ---- 1. probe ----------------------------------------------------------------------
probe() {
    date -u '+%Y-%m-%d %H:%M:%S UTC'
    uname -srm
    if command -v nvidia-smi > /dev/null 2>&1; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.max.sm --format=csv 2>&1
    else
        echo "nvidia-smi: not found"
    fi
    echo "nvcc: $("$NVCC" --version 2> /dev/null | tail -n 1 || echo none)"
    for f in "$CUDA_HOME/include/nccl.h" "$CUDA_HOME/include/cublas_v2.h"; do
        [ -f "$f" ] && echo "found $f" || echo "no $f"
    done
    "$PYTHON" - << 'EOF'
import importlib.util, os
spec = importlib.util.find_spec("nvidia")
for p in (list(spec.submodule_search_locations) if spec else []):
    for sub in ("nccl", "cu13"):
        if os.path.isdir(os.path.join(p, sub)):
            print("wheel:", os.path.join(p, sub), sorted(os.listdir(os.path.join(p, sub, "lib")))[:6])
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
        q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
        for name, b in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(b):
                    torch.nn.functional.scaled_dot_product_attention(q, q, q)
                print("sdpa", name, "available")
            except RuntimeError as e:
                print("sdpa", name, "unavailable:", str(e).splitlines()[0][:100])
except ImportError:
    print("torch: not importable")
EOF
}
echo "== probe"
probe > "$OUT/probe.log" 2>&1
cat "$OUT/probe.log"
note "$(printf '%-22s %-24s %5d s' probe ok "$(elapsed)")"

# Where NCCL and cuBLAS come from: NCCL_HOME and CUBLAS_HOME when set, the
# CUDA toolkit, else the pip wheels under the python that holds torch
# (nvidia-nccl-cu13's nvidia/nccl, nvidia-cublas's nvidia/cu13).
wheel_dir() { # nccl | cu13
    "$PYTHON" -c "import importlib.util, os, sys
s = importlib.util.find_spec('nvidia')
for p in (s.submodule_search_locations if s else []):
    if os.path.isdir(os.path.join(p, sys.argv[1], 'include')): print(os.path.join(p, sys.argv[1])); break" "$1" 2> /dev/null
}
NCCL_DIR=${NCCL_HOME:-}
if [ -z "$NCCL_DIR" ] && [ ! -f "$CUDA_HOME/include/nccl.h" ] && [ ! -f /usr/include/nccl.h ]; then
    NCCL_DIR=$(wheel_dir nccl)
fi
CUBLAS_DIR=${CUBLAS_HOME:-}
if [ -z "$CUBLAS_DIR" ] && [ ! -f "$CUDA_HOME/include/cublas_v2.h" ]; then CUBLAS_DIR=$(wheel_dir cu13); fi

# The make variables of the GPU build as quoted words (CHECK_LIBS holds
# spaces): eval "set -- $(make_vars)".
make_vars() {
    set -- CPAR_CUDA=1 CUDA_ARCH="$ARCH"
    [ -n "$NCCL_DIR" ] && set -- "$@" NCCL_HOME="$NCCL_DIR"
    [ -n "$CUBLAS_DIR" ] && set -- "$@" CUBLAS_HOME="$CUBLAS_DIR"
    if ! pkg-config --exists check 2> /dev/null && [ -f "$CARRY/check/include/check.h" ]; then
        set -- "$@" CHECK_FLAGS="-I$PWD/$CARRY/check/include" \
            CHECK_LIBS="$PWD/$CARRY/check/lib/libcheck.a $PWD/$CARRY/check/lib/libsubunit.a -lrt -lm -pthread"
    fi
    for a in "$@"; do printf "'%s' " "$(printf '%s' "$a" | sed "s/'/'\\\\''/g")"; done
}

loss_fell() { # log: the last validation loss under 0.85 x the first step's loss
    awk '/^step +1\/[0-9]+ \| loss/ { first = $5 } /validation loss/ { last = $NF }
         END { if (first == "" || last == "") { print "no losses in the log"; exit 1 }
               printf "loss %.4f -> validation %.4f\n", first, last; exit !(last < 0.85 * first) }' "$1"
}

# ---- the attention three ways (GPU mode's 5b; rehearsed on the simulator) ----
# attn_ab LIB BASE_LIB BASE_PY LABEL GPU_BENCH_OPTION...: gpu_bench.py's
# attention section as built, with dq by atomics, and with the baseline's
# library and its own gpu_bench.py (BASE_LIB empty: none), each a step
# while AB_END (this script's seconds) allows; logs into bench_attn.log and
# the three side by side in the summary.
attn_ab() {
    a_lib=$1 a_blib=$2 a_bpy=$3 a_label=$4
    shift 4
    AB=$B/gpu-check-ab
    rm -rf "$AB" && mkdir -p "$AB" && : > "$AB/now.csv" && : > "$AB/atomic.csv" && : > "$AB/base.csv" || return 1
    for pass in now atomic base; do
        a_env="" a_py=tools/gpu_bench.py a_use=$a_lib
        case $pass in
            atomic) a_env="CPAR_ATTN_DQ=atomic CPAR_ATTN_FWD_GRID=heads" ;; # the forward rows: the old CTA order
            base) a_py=$a_bpy a_use=$a_blib ;;
        esac
        [ -n "$a_use" ] || continue
        if [ $((AB_END - $(elapsed))) -lt 45 ]; then
            note "$(printf '%-22s %-24s' "attn $pass" "skipped: no time left")"
            continue
        fi
        step "attn $pass" 60 "$AB/$pass.log" env $a_env "$PYTHON" "$a_py" --lib "$a_use" --budget-s 30 \
            --only attn --csv "$AB/$pass.csv" "$@"
        cat "$AB/$pass.log" >> "$OUT/bench_attn.log"
    done
    if attn_ab_table "$a_label" "$AB/now.csv" "$AB/atomic.csv" "$AB/base.csv" > "$AB/table.txt"; then
        summary="$summary$(cat "$AB/table.txt")
"
    else
        note "$(printf '%-22s %-24s' "attn table" "FAILED (no rows)")"
    fi
    cat "$AB/table.txt" >> "$OUT/bench_attn.log"
}

# The passes' CSVs side by side: per case each one's time and speed against
# the reference (SDPA flash on a GPU, where the rows have it; else the first
# reference seen), and the baseline's time over this tree's.
attn_ab_table() { # label now.csv atomic.csv base.csv
    awk -F, -v label="$1" '
        function cell(f, k) {
            if (!((f, k) in ms)) return sprintf("%16s", "-")
            return sprintf("%8.3f ms %5s", ms[f, k], sp[f, k] == "" ? "-" : sprintf("%.2f", sp[f, k]))
        }
        BEGIN { for (i = 1; i < ARGC; i++) file[ARGV[i]] = i }
        { f = file[FILENAME] }
        $1 != "attn" || $4 == "" { next }
        { k = $2 " " $3; if (!(k in seen)) { seen[k] = 1; order[++n] = k } }
        $5 == "flash" || !((f, k) in ms) { ms[f, k] = $4; sp[f, k] = $7; if ($5 == "flash") ref = "SDPA flash" }
        END {
            if (!n) { print "attention A/B: no rows"; exit 1 }
            printf "attention, ms and speed (%s time / cpar time); %s/now = time ratio\n", ref ? ref : "reference", label
            printf "%-32s %16s %16s %16s %s\n", "case", "as built", "atomic|heads", label, label "/now"
            for (i = 1; i <= n; i++) {
                k = order[i]
                r = ((1, k) in ms) && ((3, k) in ms) ? sprintf("%.2f", ms[3, k] / ms[1, k]) : "-"
                printf "%-32s %s %s %s %s\n", k, cell(1, k), cell(2, k), cell(3, k), r
            }
        }' "$2" "$3" "$4"
}

# ---- 2-5: rehearsal ------------------------------------------------------------------
if [ $mode = rehearse ]; then
    # 2. The GPU build: the make line GPU mode would run, as a dry run (no nvcc).
    if [ -x "$NVCC" ]; then
        eval "set -- $(make_vars)"
        step "build (dry run)" 60 "$OUT/build.log" env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -n --no-print-directory "$@" B="$OUT/build" \
            "$OUT/build/cuda/test_gpu" "$OUT/build/cuda/train" "$OUT/build/cuda/libcpar.so.$VERSION"
    else
        note "$(printf '%-22s %-24s' "build (dry run)" "skipped: no nvcc")"
    fi
    step "carried Check" 60 "$OUT/check.log" rehearse_check "$OUT/carry"
    # 3. The GPU suite's bodies on nccl-sim (one case: make test runs them all).
    step "GPU suite (nccl-sim)" 300 "$OUT/suite.log" env CPAR_GPU_SUITE=quick CK_RUN_CASE=ops "$B/ncclsim/test_gpu"
    # 3b. The device backend, more ranks than (simulated) GPUs: one small
    # suite here (make test runs them all on it).
    step "device backend (sim)" 300 "$OUT/device.log" env CUDASIM_DEVICES=1 \
        DEVICE_TRAIN="--layers 1 --hidden 32 --heads 2 --seq 32 --batch 2 --steps 6 --eval-every 6" \
        sh tools/device_suites.sh "$B/sim" grid ring:ring_merge_kernel
    # 4. The main job, short, on simulated GPUs.
    for dt in bf16 f16; do
        step "train $dt (sim)" 300 "$OUT/train_$dt.log" "$B/sim/train" --backend device --tp 1 --cp 1 --dp 1 \
            --layers 1 --hidden 32 --heads 2 --seq 32 --batch 2 --steps 30 --eval-every 15 --sample 0 --verify 2 \
            --dtype $dt && step "train $dt: loss fell" 5 "$OUT/loss_$dt.log" loss_fell "$OUT/train_$dt.log"
    done
    # 5. The bench beside torch (on the CPU, when torch is importable here).
    step "bench (sim)" 300 "$OUT/bench.log" "$PYTHON" tools/gpu_bench.py --lib "$B/sim/libcpar_sim.so" \
        --backend device --quick --csv "$OUT/bench.csv"
    # 5b. The attention three ways. HEAD's sources stand in for a carried
    # baseline (unpacked, its library's build line as a dry run, its own
    # gpu_bench.py), and this tree's simulator library for its library.
    base_lib="" base_py=""
    if git rev-parse --verify -q HEAD > /dev/null 2>&1 &&
        step "baseline sources" 60 "$OUT/baseline.log" baseline_unpack HEAD "$OUT/baseline"; then
        if [ -x "$NVCC" ]; then
            eval "set -- $(make_vars)"
            step "baseline (dry run)" 60 "$OUT/baseline_build.log" env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL \
                make -n -C "$OUT/baseline" --no-print-directory "$@" B=kbuild -o kbuild/cuda/cpar_kernels.o \
                "kbuild/cuda/libcpar.so.$(version_of "$OUT/baseline")"
        fi
        base_lib=$B/sim/libcpar_sim.so base_py=$OUT/baseline/tools/gpu_bench.py
    fi
    AB_END=$(($(elapsed) + 900))
    attn_ab "$B/sim/libcpar_sim.so" "$base_lib" "$base_py" HEAD --backend device --quick
    echo
    sed -n '/^== gpu_bench summary/,$p' "$OUT/bench.log"
    echo "== gpu_check.sh --rehearse: summary ($(elapsed) s)"
    printf '%s' "$summary"
    case $summary in *FAILED* | *TIMEOUT*) exit 1 ;; esac
    exit 0
fi

# ---- 2. build ------------------------------------------------------------------------
# The architecture of the GPU here, else sm_90 (H100, H200).
cap=$(command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2> /dev/null | head -n 1 | tr -d ". ")
case $cap in [0-9][0-9] | [0-9][0-9][0-9]) ARCH=$cap ;; esac
eval "set -- $(make_vars)"
set -- "$@" B="$B"
if ! pkg-config --exists check 2> /dev/null && [ ! -f "$CARRY/check/include/check.h" ]; then
    echo "no Check here and none carried: the GPU suite is skipped (run tools/gpu_check.sh --prepare, carry .gpu)"
fi
build_limit=300
if [ -f "$CARRY/cpar_kernels_sm$ARCH.o" ] && [ "$(kernels_stamp)" = "$(cat "$CARRY/cpar_kernels_sm$ARCH.stamp" 2> /dev/null)" ]; then
    echo "kernels: the carried $CARRY/cpar_kernels_sm$ARCH.o (same sources and nvcc)"
    mkdir -p "$B/cuda"
    cp "$CARRY/cpar_kernels_sm$ARCH.o" "$B/cuda/cpar_kernels.o"
    set -- "$@" -o "$B/cuda/cpar_kernels.o"
    build_limit=120
else
    echo "kernels: compiled here for sm_$ARCH (none carried, or from other sources or another nvcc)"
fi
jobs=$(nproc 2> /dev/null || echo 8)
targets="$B/cuda/train $B/cuda/libcpar.so.$VERSION"
DEVICE_SUITES="ring:ring_causal_load_balanced linear:backward_overlap linear:mlp_reference mamba:pipeline
               train:grads_all_reduce"
if pkg-config --exists check 2> /dev/null || [ -f "$CARRY/check/include/check.h" ]; then
    targets="$B/cuda/test_gpu $targets"
    for s in ring linear mamba train; do targets="$targets $B/cuda/test_$s"; done
fi
step build $build_limit "$OUT/build.log" make --no-print-directory -j"$jobs" "$@" $targets || {
    printf '%s' "$summary"
    exit 1
}
# The wheels' libraries are found through the rpath; their own dependencies
# (libcublasLt next to libcublas) through this.
for d in "$NCCL_DIR" "$CUBLAS_DIR"; do
    [ -n "$d" ] && LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
export LD_LIBRARY_PATH

# ---- 3. the GPU suite -------------------------------------------------------------------
if [ -x "$B/cuda/test_gpu" ]; then
    step "GPU suite" 100 "$OUT/suite.log" "$B/cuda/test_gpu"
fi

# ---- 3b. the device backend: multi-rank paths on this one GPU ----------------------------------
# (its log joins the suite's: the device call brings back 8 files)
if [ -x "$B/cuda/test_gpu" ]; then
    step "device backend" 120 "$OUT/device.log" env DEVICE_TRAIN="--steps 60 --eval-every 60" \
        sh tools/device_suites.sh "$B/cuda" $DEVICE_SUITES
    cat "$OUT/device.log" >> "$OUT/suite.log" && rm -f "$OUT/device.log"
fi

# ---- 4. the main job, briefly: 200 steps on one GPU, verified against one rank -------------
for dt in bf16 f16; do
    step "train $dt" 45 "$OUT/train_$dt.log" "$B/cuda/train" --backend nccl --tp 1 --cp 1 --dp 1 --steps 200 \
        --eval-every 100 --sample 0 --verify 5 --dtype $dt &&
        step "train $dt: loss fell" 5 "$OUT/loss_$dt.log" loss_fell "$OUT/train_$dt.log"
    cat "$OUT/train_$dt.log" >> "$OUT/train.log" # one file (8 come back); the losses are in the summary
    rm -f "$OUT/train_$dt.log" "$OUT/loss_$dt.log"
done

# ---- 5. the bench beside torch ------------------------------------------------------------
# (150 s kept for 5b)
left=$((470 - $(elapsed) - 150))
[ $left -gt 150 ] && left=150
if [ $left -gt 20 ]; then
    # the limit leaves the case under way when the budget runs out time to end
    step bench $((left + 30)) "$OUT/bench.log" "$PYTHON" tools/gpu_bench.py --lib "$B/cuda/libcpar.so.$VERSION" \
        --backend nccl --budget-s $left --only "${GPU_CHECK_BENCH:-mem,gemm,xent,attn}" ${GPU_BENCH_ARGS:-} --csv "$OUT/bench.csv"
else
    note "bench                  skipped: no time left"
fi

# ---- 5b. the attention at s 8192 three ways: as built, dq by atomics, the baseline ----------
# The baseline (tools/gpu_check.sh --prepare --baseline REV) when carried
# with its kernels for this GPU: its library is built here, with the
# carried object (the same make line as step 2, in its sources).
AB_END=$((470 - 10))
base=$CARRY/baseline base_lib="" base_label=baseline
if [ -f "$base/BASELINE" ]; then
    base_label=$(cut -d' ' -f1 "$base/BASELINE")
    echo "baseline: $(cat "$base/BASELINE")"
    if [ -f "$base/cpar_kernels_sm$ARCH.o" ] &&
        [ "$(cd "$base" && kernels_stamp)" = "$(cat "$base/cpar_kernels_sm$ARCH.stamp" 2> /dev/null)" ]; then
        mkdir -p "$base/kbuild/cuda" && cp "$base/cpar_kernels_sm$ARCH.o" "$base/kbuild/cuda/cpar_kernels.o"
        eval "set -- $(make_vars)"
        bver=$(version_of "$base")
        step "build $base_label" 90 "$B/gpu-check-base.log" make -C "$base" --no-print-directory -j"$jobs" "$@" \
            B=kbuild -o kbuild/cuda/cpar_kernels.o "kbuild/cuda/libcpar.so.$bver" &&
            base_lib=$PWD/$base/kbuild/cuda/libcpar.so.$bver
        cat "$B/gpu-check-base.log" >> "$OUT/build.log"
    else
        note "$(printf '%-22s %-24s' "build $base_label" "skipped: no kernels for sm_$ARCH from its sources")"
    fi
fi
attn_ab "$B/cuda/libcpar.so.$VERSION" "$base_lib" "$base/tools/gpu_bench.py" "$base_label" --backend nccl \
    --attn-s 8192 ${GPU_BENCH_ARGS:-}

echo
sed -n '/^== gpu_bench summary/,$p' "$OUT/bench.log" 2> /dev/null
echo
echo "== gpu_check.sh: summary ($(elapsed) s; logs and bench.csv in $OUT)"
printf '%s' "$summary" | tee "$OUT/summary.txt"
case $summary in *FAILED* | *TIMEOUT*) exit 1 ;; esac
exit 0
