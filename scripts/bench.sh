#!/usr/bin/env bash
# Regenerates the benchmark table and plot: attn beside NumPy and PyTorch.
#
#   ./scripts/bench.sh                      # build/dev, results/ (commit what it writes)
#   ./scripts/bench.sh --threads 1          # arguments go to bench/compare.py
#
# Installs the Debian packages it needs when run as root (otherwise prints the
# apt-get command), configures the "dev" preset (Release, -march=native benchmarks),
# builds the benchmark executables one at a time, runs bench_gemm and bench_softmax
# (results/gemm.json, results/softmax.json) and then bench/compare.py, which runs
# bench_attention and bench_multihead, times NumPy and PyTorch at the same shapes and
# writes results/benchmarks.md, results/attention_gflops.svg and its raw JSON.
# Measure on a quiet machine: the load average is recorded in the table.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# shellcheck source=lib/ensure-packages.sh
source scripts/lib/ensure-packages.sh

attn_ensure_packages cmake g++ make libeigen3-dev catch2 nlohmann-json3-dev libbenchmark-dev \
  python3-numpy python3-torch python3-matplotlib

echo "== attn: configure (preset dev) =="
cmake --preset dev
echo "== attn: build the benchmarks =="
for target in bench_gemm bench_softmax bench_attention bench_multihead; do
  cmake --build build/dev --target "$target" -j2
done
echo "== attn: measure (load average: $(cut -d' ' -f1-3 /proc/loadavg)) =="
mkdir -p results
for family in gemm softmax; do  # the ceilings and the softmax family, JSON only
  echo "+ build/dev/bench/bench_$family --benchmark_out=results/$family.json"
  "build/dev/bench/bench_$family" --benchmark_out="results/$family.json" \
    --benchmark_out_format=json >/dev/null
done
/usr/bin/python3 bench/compare.py --bench-dir build/dev/bench --results results "$@"
echo "== attn: results in $repo_root/results/ (benchmarks.md, attention_gflops.svg, *.json) =="
echo "== attn: give results/runs.json this machine's CPU and build for the files written, then"
echo "   run scripts/perf_tables.py to regenerate the docs' tables from them =="
