#!/usr/bin/env bash
# Configures, builds and runs the whole attn test suite with a CMake preset.
#
#   ./scripts/test.sh               # preset "ci" when CI=true, else "dev"
#   ./scripts/test.sh asan          # any preset from CMakePresets.json
#   ./scripts/test.sh dev -R mask   # arguments after the preset go to ctest
#
# Installs the Debian packages it needs when run as root (otherwise prints the
# apt-get command). Exits non-zero when the build or any test fails.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# shellcheck source=lib/ensure-packages.sh
source scripts/lib/ensure-packages.sh

if (($# > 0)); then
  preset="$1"
  shift
elif [[ "${CI:-}" == "true" ]]; then
  preset="ci"
else
  preset="dev"
fi

packages=(cmake g++ make libeigen3-dev catch2 nlohmann-json3-dev libtinyxml2-dev ccache python3)
case "$preset" in
  asan) ;;                                   # benchmarks are off in this preset
  clang) packages+=(libbenchmark-dev clang libomp-dev) ;;
  *) packages+=(libbenchmark-dev) ;;
esac
attn_ensure_packages "${packages[@]}"

if [[ "$preset" == "asan" ]]; then
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"
fi

start=$SECONDS
echo "== attn: configure (preset $preset) =="
cmake --preset "$preset"
echo "== attn: build (preset $preset) =="
cmake --build --preset "$preset"
echo "== attn: test (preset $preset) =="
ctest --preset "$preset" "$@"
echo "== attn: preset $preset passed in $((SECONDS - start)) s =="
