#!/usr/bin/env bash
# The cost of one attention call in a user's translation unit (docs/compile-time.md): the
# README's one-call example (scripts/compile_time/one_call.cpp) compiled against the headers
# alone (attn::attn) and against attn::compiled (ATTN_COMPILED, as that target's users are
# compiled), beside the same attention written on Eigen alone (eigen_only.cpp), in one run,
# the three interleaved, `runs` times each (default 3): median user CPU seconds, peak memory,
# object size, and the functions the object defines (those of an AVX2 or AVX-512 namespace).
#
#   ./scripts/compile_time.sh [runs] [json]   # CXX=clang++ for clang; OPT=-O2 by default
#
# With a second argument it also writes every run's figures there as JSON: the committed
# results/compile_time.json, from which scripts/perf_tables.py writes the tables of
# docs/compile-time.md and the README (its entry in results/runs.json names the CPU).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
runs="${1:-3}"
json="${2:-}"
cxx="${CXX:-g++}"
opt="${OPT:--O2}"
out="build/compile_time"
mkdir -p "$out"

base=(-std=c++17 "$opt" -isystem /usr/include/eigen3)
declare -A flags sources
flags[eigen]="${base[*]}"
sources[eigen]=scripts/compile_time/eigen_only.cpp
flags[header_only]="${base[*]} -I include"
sources[header_only]=scripts/compile_time/one_call.cpp
flags[compiled]="${base[*]} -I include -DATTN_COMPILED -DEIGEN_MAX_ALIGN_BYTES=64 -fopenmp"
sources[compiled]=scripts/compile_time/one_call.cpp
variants=(eigen header_only compiled)

declare -A seconds memory
start_date="$(date -u +%Y-%m-%dT%H:%M:%S)"
read -r load_1 _ </proc/loadavg
for ((run = 0; run < runs; ++run)); do
  for variant in "${variants[@]}"; do
    # shellcheck disable=SC2086  # the flags are words
    /usr/bin/time -f "%U %M" -o "$out/time" "$cxx" ${flags[$variant]} -c "${sources[$variant]}" \
      -o "$out/$variant.o"
    read -r user kb <"$out/time"
    seconds[$variant]+="$user "
    memory[$variant]+="$kb "
  done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
echo "$("$cxx" --version | head -n 1), $opt; $cpu; $(date -u +%Y-%m-%d); median of $runs runs"
echo
echo "| translation unit | user CPU | peak memory | object | functions (AVX2 / AVX-512) |"
echo "|---|---|---|---|---|"
# The functions each object defines, and those of an AVX2 or AVX-512 namespace (the table
# and the JSON both read these).
declare -A functions avx2_functions avx512_functions
for variant in "${variants[@]}"; do
  defined="$(nm -C --defined-only "$out/$variant.o" | grep -E ' [TtWw] ' || true)"
  functions[$variant]="$(grep -c . <<<"$defined" || true)"
  avx2_functions[$variant]="$(grep -c 'detail::avx2::' <<<"$defined" || true)"
  avx512_functions[$variant]="$(grep -c 'detail::avx512::' <<<"$defined" || true)"
done
eigen_seconds="$(echo "${seconds[eigen]}" | median)"
for variant in "${variants[@]}"; do
  s="$(echo "${seconds[$variant]}" | median)"
  mb=$(($(echo "${memory[$variant]}" | median) / 1024))
  kib=$(($(stat -c %s "$out/$variant.o") / 1024))
  case "$variant" in
    eigen) name="the same attention on Eigen alone" ;;
    header_only) name="the README's one call, header-only (\`attn::attn\`)" ;;
    compiled) name="the same, against \`attn::compiled\`" ;;
  esac
  ratio="$(awk -v a="$s" -v b="$eigen_seconds" 'BEGIN {printf "%.2f", a / b}')"
  echo "| $name | $s s (${ratio}x) | $mb MB | $kib KiB | ${functions[$variant]} (${avx2_functions[$variant]} / ${avx512_functions[$variant]}) |"
done

if [[ -n "$json" ]]; then
  # words of a bash list as a JSON array of numbers
  numbers() { echo "[$(echo "$1" | xargs | tr ' ' ',')]"; }
  {
    echo "{"
    echo "  \"context\": {\"date\": \"$start_date\", \"compiler\": \"$("$cxx" --version | head -n 1)\","
    echo "              \"flags\": \"$opt\", \"runs\": $runs, \"load_avg\": [$load_1]},"
    echo "  \"units\": {"
    for variant in "${variants[@]}"; do
      echo "    \"$variant\": {\"user_seconds\": $(numbers "${seconds[$variant]}"),"
      echo "      \"peak_kib\": $(numbers "${memory[$variant]}"),"
      echo "      \"object_bytes\": $(stat -c %s "$out/$variant.o"),"
      echo "      \"functions\": ${functions[$variant]},"
      echo "      \"avx2_functions\": ${avx2_functions[$variant]},"
      echo "      \"avx512_functions\": ${avx512_functions[$variant]}}$([[ "$variant" == "${variants[-1]}" ]] || echo ,)"
    done
    echo "  }"
    echo "}"
  } >"$json"
  python3 -m json.tool "$json" >/dev/null
  echo
  echo "wrote $json"
fi
