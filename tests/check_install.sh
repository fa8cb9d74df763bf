#!/bin/sh
# SPDX-License-Identifier: MIT
# make check-install: make install into a temporary DESTDIR, static and then
# with SHARED=1, check the installed files, build tests/pkg_prog.c with
# `pkg-config --cflags --libs cpar` alone and run it (and it under the
# installed cparrun). The make is the caller's: MAKE, and MAKEFLAGS with its
# variables (CPAR_CUDA, CUDA_ARCH, ...), come from the environment.
# Prints one line per variant; a failing step prints its output.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
MAKE=${MAKE:-make}
CC=${CC:-cc}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=/opt/cpar

fail() { echo "check-install: $*"; exit 1; }
command -v pkg-config > /dev/null || fail "pkg-config not found (apt-get install -y pkg-config)"

for shared in 0 1; do
    dest=$tmp/dest$shared
    lib=$dest$prefix/lib
    if ! $MAKE -C "$root" install DESTDIR="$dest" PREFIX=$prefix SHARED=$shared > "$tmp/make.log" 2>&1; then
        cat "$tmp/make.log"
        fail "make install SHARED=$shared failed"
    fi
    want="$dest$prefix/include/cpar.h $lib/libcpar.a $lib/pkgconfig/cpar.pc $dest$prefix/bin/cparrun"
    [ $shared = 0 ] || want="$want $lib/libcpar.so"
    for f in $want; do [ -e "$f" ] || fail "SHARED=$shared: make install did not install ${f#$dest}"; done

    # The .pc file names the final prefix; point it into DESTDIR (a sysroot
    # would also move the CUDA library paths).
    flags=$(PKG_CONFIG_PATH=$lib/pkgconfig pkg-config --define-variable=prefix="$dest$prefix" --cflags --libs cpar) ||
        fail "SHARED=$shared: pkg-config --cflags --libs cpar failed"
    # shellcheck disable=SC2086 # flags are words
    $CC -std=c11 -Wall -Wextra -Wpedantic -Werror "$root/tests/pkg_prog.c" -o "$tmp/prog$shared" $flags \
        > "$tmp/cc.log" 2>&1 || { cat "$tmp/cc.log"; fail "SHARED=$shared: cc pkg_prog.c \$(pkg-config --cflags --libs cpar) failed: $flags"; }
    if [ $shared = 1 ]; then
        readelf -d "$tmp/prog1" 2>/dev/null | grep -q 'NEEDED.*libcpar\.so' ||
            fail "SHARED=1: the program is not linked with libcpar.so"
    fi
    # The rpath points at the final prefix, which is not there yet.
    out=$(LD_LIBRARY_PATH=$lib "$tmp/prog$shared" 2>&1) || { echo "$out"; fail "SHARED=$shared: the program failed"; }
    run=$(LD_LIBRARY_PATH=$lib "$dest$prefix/bin/cparrun" -n 2 "$tmp/prog$shared" 2>&1) ||
        { echo "$run"; fail "SHARED=$shared: cparrun -n 2 failed"; }
    echo "check-install: SHARED=$shared: installed, built with pkg-config ($flags); $out"
done
