#!/usr/bin/env bash
# Configures, builds and runs the whole attn test suite with a CMake preset.
#
#   ./scripts/test.sh               # preset "ci" when CI=true, else "dev"
#   ./scripts/test.sh ci            # any preset from CMakePresets.json
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
  pkg-config python3)
case "$preset" in
  ci) packages+=(clang libomp-dev libclang-rt-14-dev) ;;  # sanitizers, libFuzzer, OpenMP
  clang) packages+=(clang libomp-dev) ;;
esac
attn_ensure_packages "${packages[@]}"

step() {
  local name="$1" start=$SECONDS
  shift
  echo "== attn: $name (preset $preset) =="
  "$@"
  echo "== attn: $name (preset $preset) in $((SECONDS - start)) s =="
}
start=$SECONDS
step configure cmake --preset "$preset"
step build cmake --build --preset "$preset"
step test ctest --preset "$preset" "$@"
echo "== attn: preset $preset passed in $((SECONDS - start)) s =="
