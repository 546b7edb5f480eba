// bench/bench_softmax.cpp: row softmax and log-sum-exp, float, R x C with R, C in
// {64, 256, 1024, 4096}. Both are memory- or exp-bound, so they report bytes and elements,
// not FLOPs:
//
//   softmax_rows/R/C       attn::softmax_rows(x): the public call, which returns a new matrix
//                          (its allocation is part of what a caller pays, so it is timed)
//   softmax_in_place/R/C   attn::detail::softmax_in_place on each row of a preallocated
//                          matrix: the kernel every attention path calls, no allocation
//   logsumexp_rows/R/C     attn::logsumexp_rows(x) -> (R)
//
// Counters (rates per second of real time):
//   bytes     softmax: R * C * 4 read + R * C * 4 written; log-sum-exp: R * C * 4 read
//             + R * 4 written. The minimum traffic of the operation, not what a given
//             implementation moves (softmax_rows also copies its input first).
//   elements  R * C
// Every benchmark first checks its result against a scalar double-precision reference
// (max-subtracted exp, sum, divide) once, on its own input.
//
//   build/dev/bench/bench_softmax
//   build/dev/bench/bench_softmax --benchmark_out=results/softmax.json --benchmark_out_format=json
// ATTN_BENCH_SMOKE=1 (ctest) keeps only 64 x 64 and 64 x 256.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <attn/softmax.hpp>

#include "common.hpp"

namespace {

using attn::Index;
using Mat = attn::Matrix<float>;

Mat random_logits(Index rows, Index cols) {  // N(0, 3^2): a spread like attention scores
  std::vector<float> values(static_cast<std::size_t>(rows * cols));
  attn_bench::fill_normal(values, 7);
  Mat x = Eigen::Map<const Mat>(values.data(), rows, cols);
  x *= 3.0f;
  return x;
}

/// Scalar reference for one row in double: its softmax into `out` and its log-sum-exp.
double reference_row(const float* row, Index n, std::vector<double>& out) {
  double max = -std::numeric_limits<double>::infinity();
  for (Index j = 0; j < n; ++j)
    max = std::max(max, static_cast<double>(row[j]));
  double sum = 0;
  out.resize(static_cast<std::size_t>(n));
  for (Index j = 0; j < n; ++j) {
    out[static_cast<std::size_t>(j)] = std::exp(static_cast<double>(row[j]) - max);
    sum += out[static_cast<std::size_t>(j)];
  }
  for (double& y : out)
    y /= sum;
  return max + std::log(sum);
}

/// Worst |softmax - reference| over every row of y = softmax(x).
double softmax_error(const Mat& x, const Mat& y) {
  std::vector<double> expected;
  double worst = 0;
  for (Index r = 0; r < x.rows(); ++r) {
    reference_row(x.row(r).data(), x.cols(), expected);
    for (Index j = 0; j < x.cols(); ++j)
      worst = std::max(
          worst, std::abs(static_cast<double>(y(r, j)) - expected[static_cast<std::size_t>(j)]));
  }
  return worst;
}

/// Worst |lse - reference| / max(1, |reference|) over the rows of x.
double logsumexp_error(const Mat& x, const attn::Vector<float>& lse) {
  std::vector<double> scratch;
  double worst = 0;
  for (Index r = 0; r < x.rows(); ++r) {
    const double expected = reference_row(x.row(r).data(), x.cols(), scratch);
    worst = std::max(worst, std::abs(static_cast<double>(lse(r)) - expected) /
                                std::max(1.0, std::abs(expected)));
  }
  return worst;
}

void set_counters(benchmark::State& state, double elements, double bytes) {
  state.counters["bytes"] =  // GB/s, 10^9
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["elements"] =
      benchmark::Counter(elements, benchmark::Counter::kIsIterationInvariantRate);
}

constexpr double kTolerance = 1e-6;  // float exp and sum against double, values in [0, 1]

void BM_softmax_rows(benchmark::State& state) {
  const Index rows = state.range(0), cols = state.range(1);
  const Mat x = random_logits(rows, cols);
  const double error = softmax_error(x, attn::softmax_rows(x));
  if (!(error <= kTolerance)) {
    attn_bench::fail_check(state,
                           ("softmax_rows differs from the reference by " + std::to_string(error)));
    return;
  }
  for (auto _ : state) {
    Mat y = attn::softmax_rows(x);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  const auto n = static_cast<double>(rows * cols);
  set_counters(state, n, 2.0 * n * sizeof(float));
}

void BM_softmax_in_place(benchmark::State& state) {
  const Index rows = state.range(0), cols = state.range(1);
  const Mat x = random_logits(rows, cols);
  Mat y = x;
  for (Index r = 0; r < rows; ++r)
    attn::detail::softmax_in_place(y.row(r).data(), cols);
  const double error = softmax_error(x, y);
  if (!(error <= kTolerance)) {
    attn_bench::fail_check(
        state, ("softmax_in_place differs from the reference by " + std::to_string(error)));
    return;
  }
  // Repeated softmax of rows that are already probabilities: same work per element
  // (max, subtract, exp, sum, scale), values stay in [0, 1].
  for (auto _ : state) {
    for (Index r = 0; r < rows; ++r)
      attn::detail::softmax_in_place(y.row(r).data(), cols);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  const auto n = static_cast<double>(rows * cols);
  set_counters(state, n, 2.0 * n * sizeof(float));
}

void BM_logsumexp_rows(benchmark::State& state) {
  const Index rows = state.range(0), cols = state.range(1);
  const Mat x = random_logits(rows, cols);
  const double error = logsumexp_error(x, attn::logsumexp_rows(x));
  if (!(error <= kTolerance)) {
    attn_bench::fail_check(
        state, ("logsumexp_rows differs from the reference by " + std::to_string(error)));
    return;
  }
  for (auto _ : state) {
    attn::Vector<float> lse = attn::logsumexp_rows(x);
    benchmark::DoNotOptimize(lse.data());
    benchmark::ClobberMemory();
  }
  const auto n = static_cast<double>(rows * cols);
  set_counters(state, n, (n + static_cast<double>(rows)) * sizeof(float));
}

void register_all() {
  const std::vector<std::int64_t> sizes = attn_bench::smoke()
                                              ? std::vector<std::int64_t>{64, 256}
                                              : std::vector<std::int64_t>{64, 256, 1024, 4096};
  const std::vector<std::int64_t> rows =
      attn_bench::smoke() ? std::vector<std::int64_t>{64} : sizes;
  for (const auto& [name, function] :
       {std::pair<const char*, void (*)(benchmark::State&)>{"softmax_rows", BM_softmax_rows},
        {"softmax_in_place", BM_softmax_in_place},
        {"logsumexp_rows", BM_logsumexp_rows}}) {
    benchmark::RegisterBenchmark(name, function)
        ->ArgNames({"R", "C"})
        ->ArgsProduct({rows, sizes})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, register_all);
}
