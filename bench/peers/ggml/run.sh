#!/bin/sh
# usage: run.sh [THREADS] [fa_decode options: -T F16|Q8_0|Q4_0, -c (cold caches), -m MIN_MS,
# -n MIN_REPS]. One line per configuration on stdout; repetition counts, minima and maxima on
# stderr. Exit status 2: the F16 reference check failed (README.md: ggml's fp16 sums).
BIN=/tmp/ggml-bench/fa_decode
[ -x "$BIN" ] || { echo "missing $BIN: run $(dirname "$0")/build.sh first" >&2; exit 1; }
ARGS=""
if [ $# -gt 0 ]; then
    case "$1" in
        all) shift ;;
        [0-9]*) ARGS="-t $1"; shift ;;
    esac
fi
exec "$BIN" $ARGS "$@"
