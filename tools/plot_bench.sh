#!/bin/sh
# tools/plot_bench.sh CSV OUTDIR — bus bandwidth against message size, one PNG
# per collective with a line per group size, from build/bench --csv output
# (a sweep: build/bench -b 8K -e 64M -f 2 --csv FILE). Uses gnuplot when
# installed, else python3 with matplotlib; says what is missing otherwise.
#   tools/plot_bench.sh --check   exit 0 when a plotting tool is there, else
#                                 1 naming the install (make plots runs this
#                                 before it builds or runs anything)
set -e
need="plot_bench.sh: make plots needs gnuplot or python3 with matplotlib (apt-get install gnuplot-nox, or pip install matplotlib)"
have_plotter() {
    command -v gnuplot > /dev/null 2>&1 ||
        { command -v python3 > /dev/null 2>&1 && python3 -c 'import matplotlib' 2> /dev/null; }
}
if [ "${1:-}" = --check ]; then
    have_plotter && exit 0
    echo "$need" >&2
    exit 1
fi
csv=${1:?usage: plot_bench.sh CSV OUTDIR}
out=${2:?usage: plot_bench.sh CSV OUTDIR}
mkdir -p "$out"
if command -v gnuplot >/dev/null 2>&1; then
    # The columns by name, so the CSV may gain columns without breaking this.
    hdr=$(head -n 1 "$csv")
    col() { echo "$hdr" | tr ',' '\n' | grep -n -x "$1" | cut -d: -f1; }
    cn=$(col name) cr=$(col ranks) cb=$(col bytes) cw=$(col busbw_gbps)
    for op in $(awk -F, -v c="$cn" 'NR > 1 && $1 == "collectives" { print $c }' "$csv" | sort -u); do
        dat="$out/$op.dat"
        awk -F, -v c="$cn" -v r="$cr" -v b="$cb" -v w="$cw" -v op="$op" \
            'NR > 1 && $1 == "collectives" && $c == op { print $r, $b, $w }' "$csv" | sort -n -k1,1 -k2,2 > "$dat"
        plots=""
        for n in $(cut -d' ' -f1 "$dat" | sort -un); do
            plots="$plots${plots:+, }'$dat' using (\$1==$n?\$2:1/0):3 with linespoints title '$n ranks'"
        done
        gnuplot -e "set terminal png size 800,500; set output '$out/$op.png'; set logscale x 2; \
set xlabel 'message size (bytes)'; set ylabel 'bus bandwidth (GB/s)'; set title 'cpar $op'; set key left top; \
plot $plots"
        rm -f "$dat"
        echo "wrote $out/$op.png"
    done
elif command -v python3 >/dev/null 2>&1 && python3 -c 'import matplotlib' 2>/dev/null; then
    python3 - "$csv" "$out" <<'PY'
import csv, sys, collections
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["section"] == "collectives"]
ops = collections.OrderedDict()
for r in rows:
    ops.setdefault(r["name"], collections.defaultdict(list))[int(r["ranks"])].append(
        (int(r["bytes"]), float(r["busbw_gbps"])))
for op, by_n in ops.items():
    plt.figure(figsize=(8, 5))
    for n, pts in sorted(by_n.items()):
        pts.sort()
        plt.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{n} ranks")
    plt.xscale("log", base=2)
    plt.xlabel("message size (bytes)")
    plt.ylabel("bus bandwidth (GB/s)")
    plt.title(f"cpar {op}")
    plt.legend()
    path = f"{sys.argv[2]}/{op}.png"
    plt.savefig(path)
    print("wrote", path)
PY
else
    echo "plot_bench.sh: needs gnuplot or python3 with matplotlib (apt-get install gnuplot-nox, or pip install matplotlib); the data is in $csv" >&2
    exit 1
fi
