// bench/common.hpp: helpers shared by the bench/*.cpp executables.
//
//   smoke()            true when ATTN_BENCH_SMOKE=1 (ctest's smoke runs): use tiny sizes
//   set_threads(n)     OpenMP and Eigen thread counts, together
//   fill_normal(v, s)  N(0, 1) floats from a fixed seed
//   max_abs_diff(a, b) worst |a - b| of two equally long float sequences
//   evict_caches()     reads a 512 MiB buffer (4 MiB under smoke()), so that what a call
//                      reads next comes from memory, not from a last-level cache that may hold
//                      tens of MiB (the Xeon's 480 MiB L3 kept a 38 MB q4_0 cache warm)
//   linear_attention_quadratic  linear attention's O(L^2) reference form, in double
//   register_fma_peak  the FMA peak probe, "fma_peak/threads:{1,2}", of the widest
//                      instruction set the CPU has, whatever the binary's flags: every binary
//                      that reports a fraction of peak registers this same probe, so that
//                      the ceiling and the figure come from one run and one piece of code.
//   run(argc, argv, register_benchmarks)  a bench's main: parse Google Benchmark's flags,
//                      register (after parsing, so smoke() sizes apply), run; 1 if any
//                      benchmark called fail_check
//   fail_check(state, what)  skip a benchmark whose result differs from its reference and
//                      fail the process (and so the smoke test); SkipWithError alone is for
//                      what this CPU cannot run
//   register_fma_peak_isas  the same probe per instruction set, "fma_peak_isa/{avx2,avx512}/
//                      threads:{1,2}", for the dispatched kernels (the CPU's sets only).
//   register_bf16_dot_peak  the bf16 dot-product probe, "bf16_dot_peak/threads:{1,2}"
//                      (vdpbf16ps), where the CPU has it: the ceiling of bf16 products.
//   register_int8_dot_peak  the int8 dot-product probe, "int8_dot_peak/threads:{1,2}"
//                      (vpdpbusd, 2 operations per multiply-add), where the CPU has it.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include <attn/cache/huge_pages.hpp>
#include <attn/config.hpp>
#include <attn/cpu.hpp>
#include <attn/kernels/simd/target.hpp>

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

/// N(0, 1) floats from a fixed seed: Box-Muller on mt19937's 32-bit outputs. Not
/// std::normal_distribution: libstdc++'s generate_canonical takes two long double logarithms
/// of constants on every draw, which clang does not fold, and the smoke runs (ctest) of the
/// clang CI tree spent 90% of their time there, filling inputs before timing.
template <class Allocator>
void fill_normal(std::vector<float, Allocator>& values, unsigned seed) {
  std::mt19937 rng(seed);
  const auto uniform = [&rng] { return (static_cast<double>(rng()) + 0.5) * 0x1p-32; };  // (0, 1)
  constexpr double two_pi = 6.283185307179586;
  for (std::size_t n = 0; n < values.size(); n += 2) {
    const double radius = std::sqrt(-2.0 * std::log(uniform()));
    const double angle = two_pi * uniform();
    values[n] = static_cast<float>(radius * std::cos(angle));
    if (n + 1 < values.size())
      values[n + 1] = static_cast<float>(radius * std::sin(angle));
  }
}

/// Memory for the large arrays of a benchmark: the buffers of attn's caches
/// (attn/cache/huge_pages.hpp), so a benchmark's K, V and probe array sit on the pages a
/// cache's would. Blocks of 2 MiB and more are 2 MiB-aligned mappings, marked for transparent
/// huge pages if the switch is on when they are allocated (attn::CacheHugePagesScope).
template <class T>
using PageVector = attn::detail::CacheBuffer<T>;

/// The streaming probe (arg: threads): a 512 MiB float array summed, one pass an iteration
/// (4 MiB under ATTN_BENCH_SMOKE); its "bytes" rate is the ceiling of memory-bound calls.
/// BM_bandwidth_huge_pages: the same array on huge pages (attn::CacheHugePagesScope).
/// Floats of the streaming probe's array and of evict_caches' buffer: 512 MiB (4 MiB under
/// smoke()).
inline std::size_t streaming_floats() {
  return smoke() ? (std::size_t{1} << 20) : (std::size_t{1} << 27);
}

inline void streaming_probe(benchmark::State& state, bool huge_pages) {
  const int threads = static_cast<int>(state.range(0));
  set_threads(threads);
  const std::size_t n = streaming_floats();
  const PageVector<float> data = [&] {
    const attn::CacheHugePagesScope pages(huge_pages);
    PageVector<float> filled(n);
    fill_normal(filled, 3u);
    return filled;
  }();
  const auto length = static_cast<std::int64_t>(n);
  for (auto _ : state) {
    double total = 0;
#if ATTN_HAS_OPENMP
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
#endif
    for (std::int64_t block = 0; block < length; block += 4096) {
      const Eigen::Map<const Eigen::ArrayXf> part(data.data() + block,
                                                  std::min<std::int64_t>(4096, length - block));
      total += static_cast<double>(part.sum());
    }
    benchmark::DoNotOptimize(total);
  }
  state.counters["bytes"] = benchmark::Counter(static_cast<double>(n * sizeof(float)),
                                               benchmark::Counter::kIsIterationInvariantRate,
                                               benchmark::Counter::kIs1024);
  set_threads(1);
}

inline void BM_bandwidth(benchmark::State& state) {
  streaming_probe(state, false);
}
inline void BM_bandwidth_huge_pages(benchmark::State& state) {
  streaming_probe(state, true);
}

/// Reads a 512 MiB buffer (4 MiB under smoke()), once per call: the caches then hold it, not
/// what the timed call reads next. Allocated and filled on the first call.
inline void evict_caches() {
  static std::vector<float> buffer(streaming_floats(), 1.0f);
  const Eigen::Map<const Eigen::ArrayXf> all(buffer.data(),
                                             static_cast<Eigen::Index>(buffer.size()));
  benchmark::DoNotOptimize(all.sum());
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
// 12 independent accumulators of one instruction set's vectors per thread: enough to hide
// the FMA latency on two pipes, all register-resident, FLOPs = 2 per lane per FMA. The
// vector probes are compiled for AVX2 and AVX-512 by target regions
// (attn/kernels/simd/target.hpp), like the dispatched kernels, so that the ceiling does not
// depend on this binary's -march; the 12 chains are unrolled by a fold so that they stay in
// registers at any -O level.
#if ATTN_X86_DISPATCH
ATTN_BEGIN_TARGET_AVX2
namespace avx2_probe {
template <std::size_t... I>
inline double fma_kernel(std::int64_t iterations, std::index_sequence<I...>) {
  __m256 acc[sizeof...(I)] = {_mm256_set1_ps(static_cast<float>(I) * 1e-3f)...};
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (std::int64_t n = 0; n < iterations; ++n)
    ((acc[I] = _mm256_fmadd_ps(acc[I], a, b)), ...);
  __m256 sum = _mm256_setzero_ps();
  ((sum = _mm256_add_ps(sum, acc[I])), ...);
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  double total = 0;
  for (const float x : lanes)
    total += static_cast<double>(x);
  return total;
}
}  // namespace avx2_probe
ATTN_END_TARGET

ATTN_BEGIN_TARGET_AVX512
namespace avx512_probe {
template <std::size_t... I>
inline double fma_kernel(std::int64_t iterations, std::index_sequence<I...>) {
  __m512 acc[sizeof...(I)] = {_mm512_set1_ps(static_cast<float>(I) * 1e-3f)...};
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (std::int64_t n = 0; n < iterations; ++n)
    ((acc[I] = _mm512_fmadd_ps(acc[I], a, b)), ...);
  float lanes[16];
  __m512 sum = _mm512_setzero_ps();
  ((sum = _mm512_add_ps(sum, acc[I])), ...);
  _mm512_storeu_ps(lanes, sum);
  double total = 0;
  for (const float x : lanes)
    total += static_cast<double>(x);
  return total;
}
}  // namespace avx512_probe
ATTN_END_TARGET

ATTN_BEGIN_TARGET_AVX512_BF16
namespace bf16_probe {
/// 12 chains of vdpbf16ps: each adds 16 lanes x 2 products of bfloat16 pairs.
template <std::size_t... I>
inline double dot_kernel(std::int64_t iterations, std::index_sequence<I...>) {
  __m512 acc[sizeof...(I)] = {_mm512_set1_ps(static_cast<float>(I) * 1e-3f)...};
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-4f), _mm512_set1_ps(1e-4f));
  for (std::int64_t n = 0; n < iterations; ++n)
    ((acc[I] = _mm512_dpbf16_ps(acc[I], a, b)), ...);
  float lanes[16];
  __m512 sum = _mm512_setzero_ps();
  ((sum = _mm512_add_ps(sum, acc[I])), ...);
  _mm512_storeu_ps(lanes, sum);
  double total = 0;
  for (const float x : lanes)
    total += static_cast<double>(x);
  return total;
}
}  // namespace bf16_probe
ATTN_END_TARGET

ATTN_BEGIN_TARGET_AVX512_VNNI
namespace int8_probe {
/// 12 chains of vpdpbusd: each adds 16 lanes x 4 products of unsigned and signed bytes.
template <std::size_t... I>
inline double dot_kernel(std::int64_t iterations, std::index_sequence<I...>) {
  __m512i acc[sizeof...(I)] = {_mm512_set1_epi32(static_cast<int>(I))...};
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (std::int64_t n = 0; n < iterations; ++n)
    ((acc[I] = _mm512_dpbusd_epi32(acc[I], a, b)), ...);
  alignas(64) std::int32_t lanes[16];
  __m512i sum = _mm512_setzero_si512();
  ((sum = _mm512_add_epi32(sum, acc[I])), ...);
  _mm512_store_si512(lanes, sum);
  double total = 0;
  for (const std::int32_t x : lanes)
    total += static_cast<double>(x);
  return total;
}
}  // namespace int8_probe
ATTN_END_TARGET
#endif

/// Scalar multiply-adds (the only probe where target regions do not apply): 2 FLOPs each.
inline double scalar_fma_kernel(std::int64_t iterations) {
  float acc[12];
  for (int r = 0; r < 12; ++r)
    acc[r] = static_cast<float>(r) * 1e-3f;
  for (std::int64_t n = 0; n < iterations; ++n) {
    for (float& x : acc)
      x = x * 0.999999f + 1e-7f;
  }
  double total = 0;
  for (const float x : acc)
    total += static_cast<double>(x);
  return total;
}

/// Floats per vector of `isa` (1 for the scalar probe of Isa::generic).
inline double fma_lanes(attn::Isa isa) {
  isa = attn::float_kernels_isa(isa);
  return isa == attn::Isa::avx512 ? 16 : isa == attn::Isa::avx2 ? 8 : 1;
}

inline double fma_kernel(attn::Isa isa, std::int64_t iterations) {
  isa = attn::float_kernels_isa(isa);  // (avx512_bf16's float arithmetic is avx512's)
#if ATTN_X86_DISPATCH
  if (isa == attn::Isa::avx512)
    return avx512_probe::fma_kernel(iterations, std::make_index_sequence<12>());
  if (isa == attn::Isa::avx2)
    return avx2_probe::fma_kernel(iterations, std::make_index_sequence<12>());
#endif
  (void)isa;
  return scalar_fma_kernel(iterations);
}

/// 12 FMA chains of `isa` per thread, on state.range(0) threads.
inline void BM_fma_peak_isa(benchmark::State& state, attn::Isa isa) {
  const int threads = static_cast<int>(state.range(0));
  const std::int64_t iterations = smoke() ? (1 << 12) : (1 << 22);
  for (auto _ : state) {
    double result = 0;
#if ATTN_HAS_OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : result)
#endif
    result += fma_kernel(isa, iterations);
    benchmark::DoNotOptimize(result);
  }
  state.counters["FLOPS"] =
      benchmark::Counter(2.0 * 12 * fma_lanes(isa) * static_cast<double>(iterations) * threads,
                         benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(attn::isa_name(isa));
}

/// A dot-product probe: kernel(iterations, 12 chains) on each of the threads, reported as the
/// counter `counter` of `per_instruction` operations per instruction.
template <class Kernel>
inline void run_dot_peak(benchmark::State& state, const Kernel& kernel, double per_instruction,
                         const char* counter) {
  const int threads = static_cast<int>(state.range(0));
  const std::int64_t iterations = smoke() ? (1 << 12) : (1 << 22);
  for (auto _ : state) {
    double result = 0;
#if ATTN_HAS_OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : result)
#endif
    result += kernel(iterations);
    benchmark::DoNotOptimize(result);
  }
  state.counters[counter] =
      benchmark::Counter(per_instruction * 12 * static_cast<double>(iterations) * threads,
                         benchmark::Counter::kIsIterationInvariantRate);
}

/// The bf16 dot-product probe: 12 chains of vdpbf16ps per thread (64 FLOPs each: 16 lanes,
/// two multiply-adds of bfloat16 pairs), the ceiling of the flash kernel on bf16 products.
inline void BM_bf16_dot_peak(benchmark::State& state) {
  run_dot_peak(
      state,
      [](std::int64_t iterations) {
#if ATTN_X86_DISPATCH
        return bf16_probe::dot_kernel(iterations, std::make_index_sequence<12>());
#else
        (void)iterations;  // (registered only where the CPU has the instruction)
        return 0.0;
#endif
      },
      2.0 * 2 * 16, "FLOPS");
}

/// The int8 dot-product probe: 12 chains of vpdpbusd per thread (128 operations each: 16
/// lanes, four multiply-adds of bytes), the ceiling of q k^T on int8 products.
inline void BM_int8_dot_peak(benchmark::State& state) {
  run_dot_peak(
      state,
      [](std::int64_t iterations) {
#if ATTN_X86_DISPATCH
        return int8_probe::dot_kernel(iterations, std::make_index_sequence<12>());
#else
        (void)iterations;  // (registered only where the CPU has the instruction)
        return 0.0;
#endif
      },
      2.0 * 4 * 16, "OPS");
}

/// A probe's runs, "<name>/threads:{1,2}", in milliseconds of real time.
inline void on_one_and_two_threads(benchmark::internal::Benchmark* probe) {
  probe->ArgNames({"threads"})->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
}

/// Registers "<name>/threads:{1,2}" for `probe` where the CPU has `isa`.
inline void register_dot_peak(const char* name, void (*probe)(benchmark::State&), attn::Isa isa) {
  if (!attn::isa_supported(isa))
    return;
  on_one_and_two_threads(benchmark::RegisterBenchmark(name, probe));
}

/// Registers "bf16_dot_peak/threads:{1,2}" where the CPU has bf16 dot products.
inline void register_bf16_dot_peak() {
  register_dot_peak("bf16_dot_peak", BM_bf16_dot_peak, attn::Isa::avx512_bf16);
}

/// Registers "int8_dot_peak/threads:{1,2}" where the CPU has int8 dot products.
inline void register_int8_dot_peak() {
  register_dot_peak("int8_dot_peak", BM_int8_dot_peak, attn::Isa::avx512_vnni);
}

/// Registers "fma_peak/threads:{1,2}": the probe of the widest instruction set this CPU has
/// (attn::best_isa()), the machine's arithmetic ceiling whatever this binary's flags.
inline void register_fma_peak() {
  on_one_and_two_threads(
      benchmark::RegisterBenchmark("fma_peak", BM_fma_peak_isa, attn::best_isa()));
}

/// Registers "fma_peak_isa/<isa>/threads:{1,2}" for avx2 and avx512 as this CPU has them.
inline void register_fma_peak_isas() {
  for (const attn::Isa isa : {attn::Isa::avx2, attn::Isa::avx512}) {
    if (!attn::isa_supported(isa))
      continue;
    on_one_and_two_threads(benchmark::RegisterBenchmark(
        (std::string("fma_peak_isa/") + attn::isa_name(isa)).c_str(), BM_fma_peak_isa, isa));
  }
}

/// Whether a benchmark's result failed its check (fail_check) in this process.
inline std::atomic<bool>& check_failed() {
  static std::atomic<bool> failed{false};
  return failed;
}

/// Skips a benchmark whose result failed its check against a reference, and makes run() return
/// 1, so that the smoke tests fail: a skip alone would pass them. What this CPU cannot run is
/// skipped with SkipWithError alone.
inline void fail_check(benchmark::State& state, const std::string& what) {
  check_failed() = true;
  state.SkipWithError(what.c_str());
}

/// The main of every bench/*.cpp: Google Benchmark's flags first, then the benchmarks
/// `register_benchmarks()` registers, then the run. Returns main's exit code: 1 if a
/// benchmark called fail_check.
template <class Register>
int run(int argc, char** argv, const Register& register_benchmarks) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv))
    return 1;
  register_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (check_failed()) {
    std::fprintf(stderr, "a benchmark's result failed its check (ERROR OCCURRED above)\n");
    return 1;
  }
  return 0;
}

}  // namespace attn_bench
