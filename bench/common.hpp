// bench/common.hpp: helpers shared by the bench/*.cpp executables.
//
//   smoke()            true when ATTN_BENCH_SMOKE=1 (ctest's smoke runs): use tiny sizes
//   set_threads(n)     OpenMP and Eigen thread counts, together
//   fill_normal(v, s)  N(0, 1) floats from a fixed seed
//   max_abs_diff(a, b) worst |a - b| of two equally long float sequences
//   linear_attention_quadratic  linear attention's O(L^2) reference form, in double
//   register_fma_peak  the FMA peak probe, "fma_peak/threads:{1,2}": every binary that
//                      reports a fraction of peak registers this same probe, so that the
//                      ceiling and the figure come from one run and one piece of code.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <Eigen/Core>

#include <attn/config.hpp>

namespace attn_bench {

inline bool smoke() {
  const char* s = std::getenv("ATTN_BENCH_SMOKE");
  return s != nullptr && std::string(s) == "1";
}

inline void set_threads(int threads) {
#if ATTN_HAS_OPENMP
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
  Eigen::setNbThreads(threads);
}

inline void fill_normal(std::vector<float>& values, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : values)
    x = normal(rng);
}

inline float max_abs_diff(const float* a, const float* b, std::size_t n) {
  float worst = 0;
  for (std::size_t i = 0; i < n; ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

using MatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Linear attention (elu + 1 features, eps 1e-6) for the first `rows` queries of one head in
/// its quadratic form, the reference the benchmarks check against before timing:
/// A = phi(q) phi(k)^T with keys j > i hidden when causal, rows normalised, times v.
inline MatrixD linear_attention_quadratic(const MatrixD& q,                  // (L, D)
                                          const MatrixD& k,                  // (L, D)
                                          const MatrixD& v,                  // (L, Dv)
                                          bool causal, Eigen::Index rows) {  // -> (rows, Dv)
  const auto phi = [](const MatrixD& x) {
    return MatrixD(x.unaryExpr([](double t) { return t > 0 ? t + 1 : std::exp(t); }));
  };
  MatrixD a = phi(q.topRows(rows)) * phi(k).transpose();  // (rows, L)
  if (causal) {
    for (Eigen::Index i = 0; i < rows; ++i)
      a.row(i).tail(a.cols() - i - 1).setZero();
  }
  const Eigen::VectorXd denominator = a.rowwise().sum().array() + 1e-6;
  return denominator.cwiseInverse().asDiagonal() * (a * v);
}

// --- FMA peak -------------------------------------------------------------------------
// 12 independent accumulators of the widest vector: enough to hide the FMA latency (4
// cycles) on two pipes, all register-resident. FLOPs = 2 per lane per FMA.
inline double fma_kernel(std::int64_t iterations) {
#if defined(__AVX512F__)
  __m512 acc[12];
  for (int r = 0; r < 12; ++r)
    acc[r] = _mm512_set1_ps(static_cast<float>(r) * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (std::int64_t n = 0; n < iterations; ++n) {
    for (int r = 0; r < 12; ++r)
      acc[r] = _mm512_fmadd_ps(acc[r], a, b);
  }
  __m512 sum = acc[0];
  for (int r = 1; r < 12; ++r)
    sum = _mm512_add_ps(sum, acc[r]);
  return static_cast<double>(_mm512_reduce_add_ps(sum));
#elif defined(__AVX2__)
  __m256 acc[12];
  for (int r = 0; r < 12; ++r)
    acc[r] = _mm256_set1_ps(static_cast<float>(r) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (std::int64_t n = 0; n < iterations; ++n) {
    for (int r = 0; r < 12; ++r)
      acc[r] = _mm256_fmadd_ps(acc[r], a, b);
  }
  float lanes[8];
  __m256 sum = acc[0];
  for (int r = 1; r < 12; ++r)
    sum = _mm256_add_ps(sum, acc[r]);
  _mm256_storeu_ps(lanes, sum);
  double total = 0;
  for (float x : lanes)
    total += static_cast<double>(x);
  return total;
#else
  float acc[12];
  for (int r = 0; r < 12; ++r)
    acc[r] = static_cast<float>(r) * 1e-3f;
  for (std::int64_t n = 0; n < iterations; ++n) {
    for (float& x : acc)
      x = std::fma(x, 0.999999f, 1e-7f);
  }
  double total = 0;
  for (float x : acc)
    total += static_cast<double>(x);
  return total;
#endif
}

constexpr double fma_lanes() {
#if defined(__AVX512F__)
  return 16;
#elif defined(__AVX2__)
  return 8;
#else
  return 1;
#endif
}

inline void BM_fma_peak(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const std::int64_t iterations = smoke() ? (1 << 12) : (1 << 22);
  for (auto _ : state) {
    double result = 0;
#if ATTN_HAS_OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : result)
#endif
    result += fma_kernel(iterations);
    benchmark::DoNotOptimize(result);
  }
  state.counters["FLOPS"] =
      benchmark::Counter(2.0 * 12 * fma_lanes() * static_cast<double>(iterations) * threads,
                         benchmark::Counter::kIsIterationInvariantRate);
}

/// Registers "fma_peak/threads:1" and "fma_peak/threads:2".
inline void register_fma_peak() {
  benchmark::RegisterBenchmark("fma_peak", BM_fma_peak)
      ->ArgNames({"threads"})
      ->Arg(1)
      ->Arg(2)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

}  // namespace attn_bench
