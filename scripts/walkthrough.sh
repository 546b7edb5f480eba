#!/usr/bin/env bash
# Builds and runs examples/walkthrough.cpp, the tour of attn.
#
#   ./scripts/walkthrough.sh
#
# Needs only a compiler, CMake and Eigen (installed here if missing and run as
# root; otherwise the apt-get command to run is printed). Builds in
# build/walkthrough without the tests and benchmarks.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# shellcheck source=lib/ensure-packages.sh
source scripts/lib/ensure-packages.sh

attn_ensure_packages cmake g++ make libeigen3-dev

build_dir="build/walkthrough"
cmake -S . -B "$build_dir" \
  -DCMAKE_BUILD_TYPE=Release \
  -DATTN_BUILD_EXAMPLES=ON \
  -DATTN_BUILD_TESTS=OFF \
  -DATTN_BUILD_BENCHMARKS=OFF
cmake --build "$build_dir" --target walkthrough -j 2

echo
echo "== running $build_dir/examples/walkthrough (in $build_dir/examples) =="
cd "$build_dir/examples"
./walkthrough
