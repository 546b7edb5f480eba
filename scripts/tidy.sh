#!/usr/bin/env bash
# Runs clang-tidy (checks in .clang-tidy) over the project's own translation
# units, using the compile_commands.json of a preset's build tree (GCC's flags
# are fine: clang ignores the warning options it does not know), and prints a
# count per check. Headers under include/attn/ are checked through them.
#
#   ./scripts/tidy.sh           # preset dev (configured first if needed)
#   ./scripts/tidy.sh ci-asan   # a tree that `scripts/test.sh ci` built
#   ./scripts/tidy.sh ci-asan --strict   # exit non-zero on any warning
#   ATTN_TIDY_FILES="tests/test_init.cpp" ./scripts/tidy.sh ci-asan   # only these files
#
# Without --strict it fails only when clang-tidy itself errors (e.g. cannot parse a file)
# and reports the warnings; with --strict (as CI runs it) any warning fails.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# shellcheck source=lib/ensure-packages.sh
source scripts/lib/ensure-packages.sh

preset="${1:-dev}"
strict=0
if [[ "${2:-}" == "--strict" ]]; then
  strict=1
fi

# libomp-dev: clang's omp.h, needed when the tree was configured with OpenMP.
attn_ensure_packages clang-tidy libomp-dev cmake g++ make libeigen3-dev catch2 libtinyxml2-dev \
  nlohmann-json3-dev libbenchmark-dev

build_dir="build/$preset"
if [[ ! -f "$build_dir/compile_commands.json" ]]; then
  cmake --preset "$preset"
fi

# The project's own sources (not the generated header checks in the build tree).
mapfile -t files < <(grep -oE '"file": "[^"]+"' "$build_dir/compile_commands.json" |
  cut -d'"' -f4 | grep -E "^$repo_root/(src|tests|examples|bench)/" | sort -u)
# ATTN_TIDY_FILES: only these files (repo-relative, space-separated), e.g. in CI.
if [[ -n "${ATTN_TIDY_FILES:-}" ]]; then
  selected=()
  for file in "${files[@]}"; do
    for wanted in $ATTN_TIDY_FILES; do
      if [[ "$file" == "$repo_root/$wanted" ]]; then
        selected+=("$file")
      fi
    done
  done
  files=("${selected[@]}")
fi
if ((${#files[@]} == 0)); then
  echo "tidy: no sources in $build_dir/compile_commands.json" >&2
  exit 1
fi

log="$build_dir/clang-tidy.log"
echo "tidy: clang-tidy on ${#files[@]} files with $build_dir/compile_commands.json (log: $log)"
status=0
printf '%s\n' "${files[@]}" |
  xargs -P 2 -n 1 clang-tidy -p "$build_dir" --quiet \
    --extra-arg=-Wno-unknown-warning-option >"$log" 2>&1 || status=$?

# A header's warning repeats in every file that includes it: count it once.
warnings="$( (grep -E ': warning: .*\[[a-z0-9.,-]+\]$' "$log" || true) | sort -u | wc -l)"
errors="$(grep -cE '(^|: )error: |^Error while processing' "$log" || true)"
(grep -E '(^|: )(warning|error): |^Error while processing' "$log" || true) | sort -u
echo
echo "tidy: per check (unique locations):"
(grep -E ': warning: .*\[[a-z0-9.,-]+\]$' "$log" || true) | sort -u |
  (grep -oE '\[[a-z0-9.,-]+\]$' || true) | sort | uniq -c | sort -rn
echo "tidy: ${warnings} warnings, ${errors} errors"

if ((status != 0 || errors > 0)); then
  echo "tidy: clang-tidy failed (exit ${status})" >&2
  exit 1
fi
if ((strict && warnings > 0)); then
  exit 1
fi
