#!/bin/sh
# Builds fa_decode (into /tmp/ggml-bench) against ggml's sources in /tmp/ggml-src and its
# static libraries in /tmp/ggml-build (README.md).
set -e
SRC=/tmp/ggml-src
BLD=/tmp/ggml-build
OUT=/tmp/ggml-bench
HERE="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$OUT"
# link order: ggml (registry) -> ggml-cpu -> ggml-base; g++ for libstdc++, -fopenmp for libgomp
gcc -O2 -march=native -I"$SRC/include" -c "$HERE/fa_decode.c" -o "$OUT/fa_decode.o"
g++ -O2 "$OUT/fa_decode.o" -o "$OUT/fa_decode" \
    "$BLD/src/libggml.a" "$BLD/src/libggml-cpu.a" "$BLD/src/libggml-base.a" \
    -fopenmp -lpthread -lm
echo built "$OUT/fa_decode"
