#!/usr/bin/env bash
# Builds and runs the differential fuzz target fuzz/fuzz_attention.cpp with clang's
# libFuzzer, AddressSanitizer and UBSan (fuzz/README.md).
#
#   ./scripts/fuzz.sh                 # both builds, 60 s each
#   ./scripts/fuzz.sh 300 portable    # the build without -march, 300 s
#   ./scripts/fuzz.sh 60 native       # the -march=native build
#
# Each build runs flash and decode on every instruction set the CPU has (each forced in
# turn, attn/cpu.hpp); the two builds differ in what the compiler may use outside attn's
# target regions (naive and chunked are Eigen's products, compiled for the build's flags).
#
# The preset ci-asan builds the portable variant in its tree and runs it as the ctest
# fuzz_attention; this script runs either variant alone, for as long as you like.
#
# Builds go to build/fuzz/; each run starts from the committed seed corpus fuzz/corpus/
# (read only: new inputs go to build/fuzz/corpus-<variant>/), prints libFuzzer's final
# statistics and the number of executions. A crash leaves its reproducer in build/fuzz/
# (crash-*) and fails the script: turn it into a Catch2 test in tests/test_robustness.cpp.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# shellcheck source=lib/ensure-packages.sh
source scripts/lib/ensure-packages.sh
attn_ensure_packages clang libclang-rt-14-dev libeigen3-dev

seconds="${1:-60}"
variants=("${@:2}")
if ((${#variants[@]} == 0)); then
  variants=(portable native)
fi
out="build/fuzz"
mkdir -p "$out"
cxx="${ATTN_FUZZ_CXX:-clang++}"

flags_for() {
  local flags=(-std=c++17 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all
    -fno-omit-frame-pointer -isystem /usr/include/eigen3 -I include -I tests -DATTN_COMPILED
    -DEIGEN_MAX_ALIGN_BYTES=64 "-DATTN_FIXTURE_DIR=\"$repo_root/tests/reference\"")
  case "$1" in
    portable) ;;
    native) flags+=(-march=native) ;;
    *)
      echo "fuzz: unknown variant $1 (portable or native)" >&2
      return 2
      ;;
  esac
  printf '%s\n' "${flags[@]}"
}

# The target, attn::compiled's sources (src/) and the tests' helpers (tests/support/), every
# translation unit of every variant two at a time (the machine has 2 cores).
start=$SECONDS
jobs=()
for variant in "${variants[@]}"; do
  mapfile -t flags < <(flags_for "$variant")
  ((${#flags[@]} > 0)) || exit 2
  mkdir -p "$out/$variant"
  for source in fuzz/fuzz_attention.cpp src/*.cpp tests/support/*.cpp; do
    object="$out/$variant/$(basename "$source" .cpp).o"
    case "$source" in
      fuzz/*) extra=(-fsanitize=fuzzer) ;;
      *) extra=(-fsanitize=fuzzer-no-link) ;;
    esac
    jobs+=("$(printf '%q ' "$cxx" "${flags[@]}" "${extra[@]}" -c "$source" -o "$object")")
  done
done
printf '%s\n' "${jobs[@]}" | xargs -d '\n' -P 2 -I {} sh -c '{}'
for variant in "${variants[@]}"; do
  echo "== fuzz: link $out/fuzz_attention_$variant =="
  "$cxx" -fsanitize=fuzzer,address,undefined "$out/$variant"/*.o -o "$out/fuzz_attention_$variant"
done
echo "== fuzz: built in $((SECONDS - start)) s =="
isas="generic"
grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo && isas+=", avx2"
grep -qw avx512f /proc/cpuinfo && isas+=", avx512"
echo "fuzz: flash and decode on every instruction set of this CPU: $isas"

start=$SECONDS
pids=()
for variant in "${variants[@]}"; do
  mkdir -p "$out/corpus-$variant"
  rm -f "$out"/crash-"$variant"-*
  echo "== fuzz: run $variant for $seconds s (log: $out/fuzz-$variant.log) =="
  (cd "$out" && ASAN_OPTIONS="detect_leaks=1" UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
    "./fuzz_attention_$variant" -max_total_time="$seconds" -print_final_stats=1 \
    -artifact_prefix="./crash-$variant-" "corpus-$variant" "$repo_root/fuzz/corpus") \
    >"$out/fuzz-$variant.log" 2>&1 &
  pids+=($!)
done
failed=0
total=0
for n in "${!variants[@]}"; do
  variant="${variants[$n]}"
  status=0
  wait "${pids[$n]}" || status=$?
  log="$out/fuzz-$variant.log"
  grep -E '^stat::|^fuzz_attention:|^  (float|double),|ERROR|SUMMARY' "$log" || true
  runs="$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}' || true)"
  echo "fuzz: $variant: ${runs:-0} executions in $seconds s"
  total=$((total + ${runs:-0}))
  if ((status != 0)); then
    echo "fuzz: $variant FAILED (exit $status); reproducer:" \
      "$(ls "$out"/crash-"$variant"-* 2>/dev/null || echo none)" >&2
    failed=1
  fi
done
echo "fuzz: ${total} executions in total in $((SECONDS - start)) s"
if ((failed)); then
  exit 1
fi
echo "fuzz: no failure"
