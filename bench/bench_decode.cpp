// bench/bench_decode.cpp: decoding, one new query against a KV length of 512 to 32768.
//
//   q    (B, Hq, 1, D)      the new token's queries
//   k, v (B, Hkv, Lk, D)    the keys and values seen so far (a KV cache), float
//   out  (B, Hq, 1, D)
//
// Decoding is memory-bound: every call streams K and V once and does 4 * Hq * Lk * D FLOPs
// against 2 * Hkv * Lk * D * 4 bytes. The counter that matters is "KV_bytes", the bytes of
// K and V a call must read (once per kv head, however many query heads share it), as a rate;
// "bandwidth" is a plain streaming probe (the sum of a 512 MiB float array, one pass per
// iteration) in the same binary, the ceiling to read it against.
//
// Shapes: Hq = Hkv = 8 and grouped-query Hq = 32, Hkv = 8; D = 64 and 128; B = 1; bottom-right
// causal (the new token sees every key); the default automatic algorithm (flash, whose query
// tiles here hold one row: a decode-specific kernel that splits the keys across threads is
// the next step). Validated against naive once before timing.
//
//   build/dev/bench/bench_decode
// ATTN_BENCH_SMOKE=1 (ctest) shrinks every size.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <attn/attention.hpp>

#include "common.hpp"

namespace {

using attn::Index;
using attn_bench::set_threads;
using attn_bench::smoke;

void BM_bandwidth(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  set_threads(threads);
  const std::size_t n = smoke() ? (std::size_t{1} << 20) : (std::size_t{1} << 27);  // 512 MiB
  std::vector<float> data(n);
  attn_bench::fill_normal(data, 3u);
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

void BM_decode(benchmark::State& state) {
  const Index k_length = state.range(0), q_heads = state.range(1), kv_heads = state.range(2),
              dim = state.range(3);
  const int threads = static_cast<int>(state.range(4));
  set_threads(threads);
  std::vector<float> q(static_cast<std::size_t>(q_heads * dim)),
      k(static_cast<std::size_t>(kv_heads * k_length * dim)),
      v(static_cast<std::size_t>(kv_heads * k_length * dim)),
      out(static_cast<std::size_t>(q_heads * dim)), reference(out.size());
  attn_bench::fill_normal(q, 1u);
  attn_bench::fill_normal(k, 2u);
  attn_bench::fill_normal(v, 3u);
  const auto qv =
      attn::bhld_view(static_cast<const float*>(q.data()), Index(1), q_heads, Index(1), dim);
  const auto kv =
      attn::bhld_view(static_cast<const float*>(k.data()), Index(1), kv_heads, k_length, dim);
  const auto vv =
      attn::bhld_view(static_cast<const float*>(v.data()), Index(1), kv_heads, k_length, dim);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::bottom_right;
  const auto run = [&](std::vector<float>& result, attn::Algorithm algorithm) {
    options.algorithm = algorithm;
    attn::scaled_dot_product_attention_into<float>(
        qv, kv, vv, attn::bhld_view(result.data(), Index(1), q_heads, Index(1), dim), options);
  };
  run(reference, attn::Algorithm::naive);
  run(out, attn::Algorithm::automatic);
  const float worst = attn_bench::max_abs_diff(out.data(), reference.data(), out.size());
  if (!(worst < 1e-4f)) {
    state.SkipWithError(("differs from naive by " + std::to_string(worst)).c_str());
    return;
  }
  for (auto _ : state) {
    run(out, attn::Algorithm::automatic);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double kv_bytes = 2.0 * static_cast<double>(kv_heads * k_length * dim) * sizeof(float);
  state.counters["KV_bytes"] = benchmark::Counter(
      kv_bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
  state.counters["FLOPS"] = benchmark::Counter(4.0 * static_cast<double>(q_heads * k_length * dim),
                                               benchmark::Counter::kIsIterationInvariantRate);
  set_threads(1);
}

void register_all() {
  const bool tiny = smoke();
  benchmark::RegisterBenchmark("bandwidth", BM_bandwidth)
      ->ArgNames({"threads"})
      ->Arg(1)
      ->Arg(2)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  const std::vector<std::int64_t> lengths =
      tiny ? std::vector<std::int64_t>{512} : std::vector<std::int64_t>{512, 2048, 8192, 32768};
  for (const auto& [q_heads, kv_heads] : {std::pair<std::int64_t, std::int64_t>{8, 8},
                                          std::pair<std::int64_t, std::int64_t>{32, 8}}) {
    benchmark::RegisterBenchmark("decode", BM_decode)
        ->ArgNames({"Lk", "Hq", "Hkv", "D", "threads"})
        ->ArgsProduct({lengths, {q_heads}, {kv_heads}, {64, 128}, {1, 2}})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv))
    return 1;
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
