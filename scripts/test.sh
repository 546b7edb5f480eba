#!/usr/bin/env bash
# Configures, builds and runs the whole attn test suite with a CMake preset.
#
#   ./scripts/test.sh               # "ci" when CI=true, else preset "dev"
#   ./scripts/test.sh ci            # the CI trees: presets ci-asan, ci-release, ci-tsan in turn
#   ./scripts/test.sh ci-asan       # any preset from CMakePresets.json
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

packages=(cmake g++ make libeigen3-dev catch2 nlohmann-json3-dev libtinyxml2-dev libbenchmark-dev
  pkg-config python3 libopenmpi-dev openmpi-bin)
case "$preset" in
  ci | ci-asan | ci-tsan) packages+=(clang libomp-dev libclang-rt-14-dev ninja-build) ;;  # sanitizers, libFuzzer, OpenMP
  ci-release) packages+=(ninja-build) ;;
  clang) packages+=(clang libomp-dev) ;;
esac
attn_ensure_packages "${packages[@]}"

step() {
  local name="$1" start=$SECONDS status=0
  shift
  echo "== attn: $name (preset $current) =="
  "$@" || status=$?
  echo "== attn: $name (preset $current) in $((SECONDS - start)) s =="
  return "$status"
}
# One build tree per preset, each with one set of flags (docs/testing.md).
presets=("$preset")
if [[ "$preset" == "ci" ]]; then
  presets=(ci-asan ci-release ci-tsan)
fi
start=$SECONDS
status=0
for current in "${presets[@]}"; do
  step configure cmake --preset "$current"
  step build cmake --build --preset "$current"
  if ! step test ctest --preset "$current" "$@"; then
    echo "== attn: tests failed (preset $current) =="
    status=1
  fi
done
if ((status != 0)); then
  echo "== attn: preset $preset FAILED after $((SECONDS - start)) s =="
  exit 1
fi
echo "== attn: preset $preset passed in $((SECONDS - start)) s =="
