// bench/bench_plan.cpp: the plan's automatic choice against every explicit algorithm.
//
//   q    (1, Hq, Lq, D)     float
//   k, v (1, Hkv, Lk, D)    float or Eigen::half (half:1), Hkv = 8, D = 128
//   out  (1, Hq, Lq, D)     float
//
// Family plan_sweep/<isa>/Lq/Lk/Hq/half/threads: every iteration is one round that calls
// automatic, naive, chunked, flash and decode once each on the same inputs (the order
// rotates from round to round, so that no algorithm always runs on a cache its predecessor
// warmed), each timed on its own. The counters are each algorithm's median time over the
// rounds (t_<algorithm>, microseconds) and `auto_over_best`: automatic's median over the
// smallest explicit median, 1.0 when the plan picks the fastest; the label names the plan's
// choice and the fastest explicit algorithm. Medians of interleaved calls, because the
// machines these run on drift by +-10% over minutes.
//
// Lq 1 to 64, Lk 64 to 32768, Hq = Hkv = 8 and grouped-query 32/8, bottom-right causal (the
// new queries see every earlier key, as in decoding and chunked prefill), the products of
// each instruction set this CPU has forced in turn (attn/cpu.hpp). Every algorithm is
// validated against naive before timing. The constants of the plan's cost model
// (attn/plan.hpp) come from this family (docs/performance.md, "How the plan chooses").
//
//   build/dev/bench/bench_plan --benchmark_filter='plan_sweep/avx512/'
// ATTN_BENCH_SMOKE=1 (ctest) shrinks every size.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/cpu.hpp>

#include "common.hpp"

namespace {

using attn::Algorithm;
using attn::Index;
using attn_bench::set_threads;
using attn_bench::smoke;

constexpr std::array<Algorithm, 5> algorithms{Algorithm::automatic, Algorithm::naive,
                                              Algorithm::chunked, Algorithm::flash,
                                              Algorithm::decode};
constexpr Index kv_heads = 8, dim = 128;

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const std::size_t n = x.size();
  return n % 2 == 1 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

/// One shape, every algorithm, K and V stored as KV (float or Eigen::half).
template <class KV>
void sweep(benchmark::State& state, attn::Isa isa) {
  const Index q_length = state.range(0), k_length = state.range(1), q_heads = state.range(2);
  const int threads = static_cast<int>(state.range(4));
  const attn::ScopedIsa forced(isa);
  set_threads(threads);
  const auto elements = [](Index n) { return static_cast<std::size_t>(n); };
  std::vector<float> q(elements(q_heads * q_length * dim)), k(elements(kv_heads * k_length * dim)),
      v(k.size()), reference(q.size()), out(q.size());
  attn_bench::fill_normal(q, 1u);
  attn_bench::fill_normal(k, 2u);
  attn_bench::fill_normal(v, 3u);
  const std::vector<KV> k_kv(k.begin(), k.end()), v_kv(v.begin(), v.end());
  const auto qv = attn::bhld_view(static_cast<const float*>(q.data()), 1, q_heads, q_length, dim);
  const auto kv = attn::bhld_view(k_kv.data(), 1, kv_heads, k_length, dim);
  const auto vv = attn::bhld_view(v_kv.data(), 1, kv_heads, k_length, dim);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::bottom_right;
  const auto run = [&](std::vector<float>& result, Algorithm algorithm) {
    options.algorithm = algorithm;
    attn::scaled_dot_product_attention_into<float, KV>(
        qv, kv, vv, attn::bhld_view(result.data(), 1, q_heads, q_length, dim), options);
  };
  run(reference, Algorithm::naive);
  for (const Algorithm algorithm : algorithms) {
    run(out, algorithm);
    const float worst = attn_bench::max_abs_diff(out.data(), reference.data(), out.size());
    if (!(worst < 1e-4f)) {
      attn_bench::fail_check(state, (std::string(attn::algorithm_name(algorithm)) +
                                     " differs from naive by " + std::to_string(worst)));
      return;
    }
  }
  std::array<std::vector<double>, algorithms.size()> times;
  std::size_t round = 0;
  for (auto _ : state) {
    for (std::size_t n = 0; n < algorithms.size(); ++n) {
      const std::size_t a = (n + round) % algorithms.size();
      const auto start = std::chrono::steady_clock::now();
      run(out, algorithms[a]);
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
      const std::chrono::duration<double, std::micro> took =
          std::chrono::steady_clock::now() - start;
      times[a].push_back(took.count());
    }
    ++round;
  }
  double best = 0;
  std::size_t best_index = 1;
  for (std::size_t a = 0; a < algorithms.size(); ++a) {
    const double t = median(times[a]);
    state.counters[std::string("t_") + attn::algorithm_name(algorithms[a])] = t;
    if (a > 0 && (a == 1 || t < best)) {
      best = t;
      best_index = a;
    }
  }
  state.counters["auto_over_best"] = median(times[0]) / best;
  options.algorithm = Algorithm::automatic;
  const attn::KernelPlan plan = attn::plan_attention<float>(
      {1, q_heads, kv_heads, q_length, k_length, dim, dim, Index(sizeof(KV))}, options);
  state.SetLabel(std::string(attn::isa_name(isa)) +
                 " auto=" + attn::algorithm_name(plan.algorithm) +
                 " best=" + attn::algorithm_name(algorithms[best_index]));
  set_threads(1);
}

/// Rounds per shape: about half a second of calls in all, at least 3 rounds (the median), at
/// most 100; one in a smoke run.
std::int64_t rounds_for(std::int64_t q_length, std::int64_t k_length, std::int64_t q_heads) {
  if (smoke())
    return 1;
  const double flops = 4.0 * static_cast<double>(q_heads * q_length * k_length * dim);
  const double round_seconds = 5 * flops / 2e10;  // five calls at a pessimistic 20 GFLOP/s
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(0.5 / round_seconds), 3, 100);
}

void register_all() {
  const bool tiny = smoke();
  const std::vector<std::int64_t> q_lengths =
      tiny ? std::vector<std::int64_t>{1, 16} : std::vector<std::int64_t>{1, 2, 4, 8, 16, 32, 64};
  const std::vector<std::int64_t> k_lengths =
      tiny ? std::vector<std::int64_t>{64, 256}
           : std::vector<std::int64_t>{64, 256, 1024, 4096, 16384, 32768};
  for (const attn::Isa isa : attn::all_isas) {
    if (!attn::isa_supported(isa))
      continue;
    const std::string name = std::string("plan_sweep/") + attn::isa_name(isa);
    for (const std::int64_t half : {0, 1}) {
      for (const std::int64_t q_heads : {8, 32}) {
        for (const std::int64_t q_length : q_lengths) {
          for (const std::int64_t k_length : k_lengths) {
            const auto function = half != 0 ? sweep<Eigen::half> : sweep<float>;
            benchmark::RegisterBenchmark(name.c_str(), function, isa)
                ->ArgNames({"Lq", "Lk", "Hq", "half", "threads"})
                ->Args({q_length, k_length, q_heads, half, 1})
                ->Iterations(rounds_for(q_length, k_length, q_heads))
                ->Unit(benchmark::kMicrosecond);
          }
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, register_all);
}
