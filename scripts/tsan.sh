#!/usr/bin/env bash
# ThreadSanitizer run of the thread-safety test (tests/test_threads.cpp, tag [threads]):
# several std::threads call scaled_dot_product_attention, linear_attention and one shared
# const MultiHeadAttention at once.
#
#   ./scripts/tsan.sh            # clang++ (default); ATTN_TSAN_CXX=g++ for GCC
#
# The preset ci-tsan builds and runs the same test in its tree (attn_tests_tsan, ctest
# tsan_threads, with tests/test_dispatch.cpp beside it); this script is the same thing alone.
#
# Built WITHOUT OpenMP: libgomp is not built with TSan, so its barriers look like races
# (false positives). The attention code under test is the same; only the per-call OpenMP
# loop over heads and tiles runs on one thread. Every report is then a real one: the run
# fails on the first (halt_on_error=1).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# shellcheck source=lib/ensure-packages.sh
source scripts/lib/ensure-packages.sh
attn_ensure_packages clang libclang-rt-14-dev libeigen3-dev catch2

cxx="${ATTN_TSAN_CXX:-clang++}"
out="build/tsan"
mkdir -p "$out"
flags=(-std=c++17 -O1 -g -fsanitize=thread -fno-omit-frame-pointer -isystem /usr/include/eigen3
  -I include -I tests)
start=$SECONDS
echo "== tsan: build $out/attn_tests_tsan with $cxx (no OpenMP) =="
"$cxx" "${flags[@]}" -c tests/main.cpp -o "$out/main.o" &
main_pid=$!
"$cxx" "${flags[@]}" -c tests/test_threads.cpp -o "$out/test_threads.o"
wait "$main_pid"
"$cxx" -fsanitize=thread "$out/main.o" "$out/test_threads.o" -o "$out/attn_tests_tsan"
echo "== tsan: built in $((SECONDS - start)) s =="
TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" \
  "$out/attn_tests_tsan" "[threads]"
echo "== tsan: no data race reported =="
