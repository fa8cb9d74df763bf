#!/bin/sh
# SPDX-License-Identifier: MIT
# The front door stays true (make test): every relative link in README.md and
# docs/*.md names a file or folder of the repository (and a #fragment a
# heading of it), the README is at most 200 lines, and its complete program
# builds against cpar.c as written and runs (4 ranks on the host backend).
# Usage: tools/check_docs.sh [BUILD_DIR]   (scratch in BUILD_DIR/docs-check)
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/build}/docs-check
mkdir -p "$out"
fail() { echo "check-docs: $*" >&2; exit 1; }

lines=$(wc -l < "$root/README.md")
[ "$lines" -le 200 ] || fail "README.md has $lines lines, expected at most 200 (the reference lives in docs/)"

# ](target) links that are not URLs; fragments checked against the target's headings
links=0
for md in "$root/README.md" "$root"/docs/*.md; do
    dir=$(dirname "$md")
    { grep -o '](\([^)#][^)]*\|#[^)]*\))' "$md" || true; } | sed 's/^](//; s/)$//' > "$out/links"
    while IFS= read -r l; do
        case $l in http://* | https://* | mailto:*) continue ;; esac
        links=$((links + 1))
        path=${l%%#*}
        frag=
        case $l in *'#'*) frag=${l#*#} ;; esac
        target=$md
        [ -z "$path" ] || target=$dir/$path
        [ -e "$target" ] || fail "$(basename "$md"): link ($l) names $target, which does not exist"
        if [ -n "$frag" ] && [ -f "$target" ]; then
            # GitHub's anchors: headings lowercased, spaces to -, punctuation dropped
            grep '^#' "$target" | sed 's/^#* *//' | tr 'A-Z' 'a-z' | sed 's/[^a-z0-9 _-]//g; s/ /-/g' |
                grep -qx "$frag" || fail "$(basename "$md"): link ($l): no heading #$frag in $target"
        fi
    done < "$out/links"
done

# the README's complete program: the first ```c block
awk '/^```c$/ { on = 1; next } on && /^```$/ { exit } on { print }' "$root/README.md" > "$out/readme_prog.c"
[ -s "$out/readme_prog.c" ] || fail "README.md has no \`\`\`c block (its complete program)"
cc -std=c11 -O1 -Wall -Wextra -Werror -pthread -I"$root" "$out/readme_prog.c" "$root/cpar.c" -o "$out/readme_prog" \
    -lm -lrt || fail "README.md's program does not build (above)"
CPAR_BACKEND=host "$out/readme_prog" || fail "README.md's program failed (above)"
echo "check-docs: README.md $lines lines, $links relative links resolve, its program builds and runs"
