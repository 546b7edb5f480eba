// bench/bench_gemm.cpp: the ceilings. Eigen's float GEMM at every shape the attention and
// multi-head benchmarks use, beside the FMA peak probe (common.hpp, the same code that
// bench_attention registers), so each figure reads as a fraction of this machine's peak.
//
//   fma_peak/threads:T                    register-resident FMAs: the arithmetic ceiling
//   gemm_scores/L/D/threads   (L x D) (D x L) -> (L x L)   one head's q k^T
//   gemm_pv/L/D/threads       (L x L) (L x D) -> (L x D)   one head's p v
//   gemm_proj/N/K/M/threads   (N x K) (K x M) -> (N x M)   MHA projections, N = B * S = 4096:
//                             K = 768, M = 2304 (fused QKV) and M = 768 (output)
//
// Beside them, attn's own GEMM (kernels/gemm.hpp), dispatched by instruction set, at the same
// shapes in the same binary (these benchmarks are built with -march=native, so Eigen above is
// Eigen compiled for this CPU: the comparison that counts):
//   fma_peak_isa/I/threads:T              the FMA peak of instruction set I (common.hpp)
//   attn_gemm_proj/I/N/K/M/threads        (N x K) (K x M) -> (N x M) on instruction set I
//   attn_gemm_scores/I/L/D/threads, attn_gemm_pv/I/L/D/threads   L = 512, D = 64
// I in {generic, avx2, avx512} as this CPU supports them; each checks its product against
// Eigen's before its timed loop.
//
// All matrices are row-major float (attn::Matrix), one product per iteration,
// FLOPs = 2 * rows * depth * cols, reported as the "FLOPS" rate counter. L in {128 .. 8192},
// D in {64, 128}, threads in {1, 2}.
//
// Before anything is timed, main() checks Eigen's product against a naive triple loop in
// double at small sizes of every shape family; each benchmark then checks a sample of its
// own product's entries against double dot products once before its timed loop.
//
//   build/dev/bench/bench_gemm --benchmark_filter='gemm_scores/L:4096'
//   build/dev/bench/bench_gemm --benchmark_out=results/gemm.json --benchmark_out_format=json
// ATTN_BENCH_SMOKE=1 (ctest) shrinks every size.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <attn/cpu.hpp>
#include <attn/kernels/dispatch.hpp>
#include <attn/tensor.hpp>

#include "common.hpp"

namespace {

using attn::Index;
using attn_bench::set_threads;
using attn_bench::smoke;
using Mat = attn::Matrix<float>;

Mat random_matrix(Index rows, Index cols, unsigned seed) {
  std::vector<float> values(static_cast<std::size_t>(rows * cols));
  attn_bench::fill_normal(values, seed);
  return Eigen::Map<const Mat>(values.data(), rows, cols);
}

/// Entry (i, j) of a * b in double.
double dot(const Mat& a, const Mat& b, Index i, Index j) {
  double sum = 0;
  for (Index k = 0; k < a.cols(); ++k)
    sum += static_cast<double>(a(i, k)) * static_cast<double>(b(k, j));
  return sum;
}

/// Worst relative error of c = a * b over every entry (naive triple loop).
double full_error(const Mat& a, const Mat& b, const Mat& c) {
  double worst = 0;
  for (Index i = 0; i < c.rows(); ++i)
    for (Index j = 0; j < c.cols(); ++j) {
      const double expected = dot(a, b, i, j);
      worst = std::max(worst, std::abs(static_cast<double>(c(i, j)) - expected) /
                                  std::max(1.0, std::abs(expected)));
    }
  return worst;
}

/// Worst relative error of c = a * b over 64 entries spread across c, the last corner
/// included.
double sampled_error(const Mat& a, const Mat& b, const Mat& c) {
  double worst = 0;
  for (Index s = 0; s < 64; ++s) {
    const Index i = s == 63 ? c.rows() - 1 : (s * 7919) % c.rows();
    const Index j = s == 63 ? c.cols() - 1 : (s * 104729 + s / 8) % c.cols();
    const double expected = dot(a, b, i, j);
    worst = std::max(worst, std::abs(static_cast<double>(c(i, j)) - expected) /
                                std::max(1.0, std::abs(expected)));
  }
  return worst;
}

// float accumulation over a depth of k: a few hundred ulps of the largest partial sums.
double tolerance(Index depth) {
  return 1e-5 * std::sqrt(static_cast<double>(depth)) * 8;
}

/// One product (rows x depth) (depth x cols), timed.
void run_gemm(benchmark::State& state, Index rows, Index depth, Index cols, int threads) {
  set_threads(threads);
  const Mat a = random_matrix(rows, depth, 1), b = random_matrix(depth, cols, 2);
  Mat c(rows, cols);
  c.noalias() = a * b;
  const double error = sampled_error(a, b, c);
  if (!(error <= tolerance(depth))) {
    attn_bench::fail_check(
        state, ("product differs from double dot products by " + std::to_string(error)));
    set_threads(1);
    return;
  }
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] = benchmark::Counter(
      2.0 * static_cast<double>(rows) * static_cast<double>(depth) * static_cast<double>(cols),
      benchmark::Counter::kIsIterationInvariantRate);
  set_threads(1);
}

void BM_gemm_scores(benchmark::State& state) {  // (L x D) (D x L)
  const Index length = state.range(0), dim = state.range(1);
  run_gemm(state, length, dim, length, static_cast<int>(state.range(2)));
}

void BM_gemm_pv(benchmark::State& state) {  // (L x L) (L x D)
  const Index length = state.range(0), dim = state.range(1);
  run_gemm(state, length, length, dim, static_cast<int>(state.range(2)));
}

void BM_gemm_proj(benchmark::State& state) {  // (N x K) (K x M)
  run_gemm(state, state.range(0), state.range(1), state.range(2), static_cast<int>(state.range(3)));
}

/// attn::detail::gemm on `isa`, (rows x depth) (depth x cols), timed; checked against
/// Eigen's product and against double dot products first.
void run_attn_gemm(benchmark::State& state, attn::Isa isa, Index rows, Index depth, Index cols,
                   int threads) {
  set_threads(threads);
  const Mat a = random_matrix(rows, depth, 1), b = random_matrix(depth, cols, 2);
  Mat expected(rows, cols), c(rows, cols);
  expected.noalias() = a * b;
  const auto product = [&] {
    attn::detail::gemm(isa, rows, cols, depth, a.data(), depth, b.data(), cols, c.data(), cols);
  };
  product();
  const double to_eigen = static_cast<double>((c - expected).cwiseAbs().maxCoeff()) /
                          std::max(1.0, static_cast<double>(expected.cwiseAbs().maxCoeff()));
  const double error = sampled_error(a, b, c);
  if (!(error <= tolerance(depth)) || !(to_eigen <= tolerance(depth))) {
    attn_bench::fail_check(state, ("product differs from Eigen's by " + std::to_string(to_eigen) +
                                   " and from double dot products by " + std::to_string(error)));
    set_threads(1);
    return;
  }
  for (auto _ : state) {
    product();
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] = benchmark::Counter(
      2.0 * static_cast<double>(rows) * static_cast<double>(depth) * static_cast<double>(cols),
      benchmark::Counter::kIsIterationInvariantRate);
  set_threads(1);
}

void BM_attn_gemm_proj(benchmark::State& state, attn::Isa isa) {  // (N x K) (K x M)
  run_attn_gemm(state, isa, state.range(0), state.range(1), state.range(2),
                static_cast<int>(state.range(3)));
}

void BM_attn_gemm_scores(benchmark::State& state, attn::Isa isa) {  // (L x D) (D x L)
  run_attn_gemm(state, isa, state.range(0), state.range(1), state.range(0),
                static_cast<int>(state.range(2)));
}

void BM_attn_gemm_pv(benchmark::State& state, attn::Isa isa) {  // (L x L) (L x D)
  run_attn_gemm(state, isa, state.range(0), state.range(0), state.range(1),
                static_cast<int>(state.range(2)));
}

/// Eigen's product against a naive triple loop at small, odd sizes of every family.
void validate() {
  struct Case {
    Index rows, depth, cols;
  };
  for (const Case& c : std::vector<Case>{{37, 64, 37}, {37, 37, 64}, {41, 96, 70}}) {
    const Mat a = random_matrix(c.rows, c.depth, 3), b = random_matrix(c.depth, c.cols, 4);
    const Mat product = a * b;
    const double error = full_error(a, b, product);
    if (!(error <= tolerance(c.depth))) {
      std::fprintf(stderr, "bench_gemm: (%td x %td)(%td x %td) differs from the naive loop by %g\n",
                   c.rows, c.depth, c.depth, c.cols, error);
      std::exit(EXIT_FAILURE);
    }
  }
}

void register_all() {
  const bool tiny = smoke();
  const std::vector<std::int64_t> lengths =
      tiny ? std::vector<std::int64_t>{128}
           : std::vector<std::int64_t>{128, 256, 512, 1024, 2048, 4096, 8192};
  const std::vector<std::int64_t> dims =
      tiny ? std::vector<std::int64_t>{64} : std::vector<std::int64_t>{64, 128};
  const std::vector<std::int64_t> thread_counts{1, 2};
  const std::int64_t tokens = tiny ? 64 : 4096, embed = tiny ? 64 : 768;

  attn_bench::register_fma_peak();
  benchmark::RegisterBenchmark("gemm_scores", BM_gemm_scores)
      ->ArgNames({"L", "D", "threads"})
      ->ArgsProduct({lengths, dims, thread_counts})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("gemm_pv", BM_gemm_pv)
      ->ArgNames({"L", "D", "threads"})
      ->ArgsProduct({lengths, dims, thread_counts})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("gemm_proj", BM_gemm_proj)
      ->ArgNames({"N", "K", "M", "threads"})
      ->ArgsProduct({{tokens}, {embed}, {3 * embed, embed}, thread_counts})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);

  attn_bench::register_fma_peak_isas();
  const std::int64_t head_length = tiny ? 128 : 512, head_dim = 64;
  for (const attn::Isa isa : attn::all_isas) {
    if (!attn::isa_supported(isa))
      continue;
    const std::string suffix = std::string("/") + attn::isa_name(isa);
    benchmark::RegisterBenchmark(("attn_gemm_proj" + suffix).c_str(), BM_attn_gemm_proj, isa)
        ->ArgNames({"N", "K", "M", "threads"})
        ->ArgsProduct({{tokens}, {embed}, {3 * embed, embed}, thread_counts})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("attn_gemm_scores" + suffix).c_str(), BM_attn_gemm_scores, isa)
        ->ArgNames({"L", "D", "threads"})
        ->ArgsProduct({{head_length}, {head_dim}, thread_counts})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("attn_gemm_pv" + suffix).c_str(), BM_attn_gemm_pv, isa)
        ->ArgNames({"L", "D", "threads"})
        ->ArgsProduct({{head_length}, {head_dim}, thread_counts})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, [] {
    validate();
    register_all();
  });
}
