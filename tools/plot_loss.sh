#!/bin/sh
# SPDX-License-Identifier: MIT
# tools/plot_loss.sh LOG PNG — the main job's loss curve (train loss per step,
# validation loss every --eval-every steps) from build/train's output. Uses
# gnuplot when installed, else python3 with matplotlib; says what is missing
# otherwise.
set -e
log=${1:?usage: plot_loss.sh LOG PNG}
png=${2:?usage: plot_loss.sh LOG PNG}
mkdir -p "$(dirname "$png")"
dat=$(mktemp) val=$(mktemp)
trap 'rm -f "$dat" "$val"' EXIT
# "step    12/1000 | loss 3.9298 | ..." and "step   100 | validation loss 2.3774"
awk '/^step +[0-9]+\/[0-9]+ \| loss / { split($2, s, "/"); print s[1], $5 }' "$log" > "$dat"
awk '/^step +[0-9]+ \| validation loss / { print $2, $6 }' "$log" > "$val"
[ -s "$dat" ] || { echo "plot_loss.sh: no training steps in $log" >&2; exit 1; }
if command -v gnuplot >/dev/null 2>&1; then
    vplot=""
    [ -s "$val" ] && vplot=", '$val' using 1:2 with linespoints title 'validation'"
    gnuplot -e "set terminal png size 800,500; set output '$png'; set xlabel 'step'; \
set ylabel 'loss (nats per byte)'; set title 'cpar main job'; plot '$dat' using 1:2 with lines title 'train'$vplot"
elif command -v python3 >/dev/null 2>&1 && python3 -c 'import matplotlib' 2>/dev/null; then
    python3 - "$dat" "$val" "$png" <<'PY'
import sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
def load(path):
    rows = [line.split() for line in open(path) if line.strip()]
    return [int(r[0]) for r in rows], [float(r[1]) for r in rows]
plt.figure(figsize=(8, 5))
x, y = load(sys.argv[1])
plt.plot(x, y, label="train")
vx, vy = load(sys.argv[2])
if vx:
    plt.plot(vx, vy, marker="o", label="validation")
plt.xlabel("step")
plt.ylabel("loss (nats per byte)")
plt.title("cpar main job")
plt.legend()
plt.savefig(sys.argv[3])
PY
else
    echo "plot_loss.sh: needs gnuplot or python3 with matplotlib (apt-get install gnuplot-nox, or pip install matplotlib); the log is $log" >&2
    exit 1
fi
echo "wrote $png"
