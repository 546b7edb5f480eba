// bench/bench_backward.cpp: the attention backward against the forward at the same shapes.
//
//   q, k, v, out, dout  (1, 8, L, D) float: B * H = 8, D = 64 or 128, L = 1024 .. 8192
//
// Families (ratios are read between rows of one run):
//   attention/<pass>/D:<D>/L:<L>/causal:<c>/threads:<t>
//       pass 0: the flash forward (scaled_dot_product_attention_into, with logsumexp)
//       pass 1: the flash backward (scaled_dot_product_attention_backward_into)
//       pass 2: the naive backward (materialised probabilities), L <= 2048
//   backward_over_forward/D:<D>/L:<L>/causal:<c>/threads:<t>
//       each iteration runs the flash forward, then the flash backward, and times both: the
//       counter `ratio` is the median over the iterations of backward time / forward time,
//       the two halves of each pair run back to back, so that the drift of a shared
//       machine's speed over minutes (which moves separately timed families by 10% and more)
//       cancels
//   bf16_speedup/<pass>/D:<D>/L:<L>/causal:<c>/threads:<t>
//       ComputePrecision::bf16 against fp32 (float inputs; bf16 dot products on a CPU with
//       AVX512-BF16, label "bf16 products", else fp32 both): each iteration runs the pass
//       (0 forward, 1 backward) with fp32 products, then with bf16 products; the counter
//       `speedup` is the median of fp32 time / bf16 time, paired as backward_over_forward
// FLOPs: the forward's two products 4 L^2 D per head, the backward's five 10 L^2 D (the
// counts FlashAttention reports); halved under the causal mask. So "backward time over
// forward time" is 2.5 * (forward FLOP/s) / (backward FLOP/s), and the share of the FMA peak
// (fma_peak of the same run) is FLOPS / peak. The backward is checked against the naive
// backward on a small problem before timing.
//
//   build/dev/bench/bench_backward --benchmark_filter='attention/[01]/D:64'
// ATTN_BENCH_SMOKE=1 (ctest) shrinks every size.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/attention_backward.hpp>

#include "common.hpp"

namespace {

using attn::Index;
using attn_bench::set_threads;
using attn_bench::smoke;

constexpr Index heads = 8;

struct Problem {
  Index length, dim;
  std::vector<float> q, k, v, out, dout, lse, dq, dk, dv;
  Problem(Index l, Index d)
      : length(l),
        dim(d),
        q(static_cast<std::size_t>(heads * l * d)),
        k(q.size()),
        v(q.size()),
        out(q.size()),
        dout(q.size()),
        lse(static_cast<std::size_t>(heads * l)),
        dq(q.size()),
        dk(q.size()),
        dv(q.size()) {
    attn_bench::fill_normal(q, 1u);
    attn_bench::fill_normal(k, 2u);
    attn_bench::fill_normal(v, 3u);
    attn_bench::fill_normal(dout, 4u);
  }
  attn::HeadsView<const float> view(const std::vector<float>& x) const {
    return attn::bhld_view(x.data(), 1, heads, length, dim);
  }
  attn::HeadsView<float> view(std::vector<float>& x) const {
    return attn::bhld_view(x.data(), 1, heads, length, dim);
  }
  void forward(const attn::AttentionOptions<float>& options) {
    attn::scaled_dot_product_attention_into<float>(
        view(q), view(k), view(v),
        attn::AttentionOutputViews{view(out), attn::bhl_view(lse.data(), 1, heads, length)},
        options);
  }
  void backward(const attn::AttentionOptions<float>& options) {
    attn::scaled_dot_product_attention_backward_into<float>(
        view(q), view(k), view(v), view(static_cast<const std::vector<float>&>(out)),
        attn::bhl_view(lse.data(), 1, heads, length),
        view(static_cast<const std::vector<float>&>(dout)), {view(dq), view(dk), view(dv)},
        options);
  }
};

/// The flash backward against the naive one on a small causal problem: "" or what differs.
std::string check_flash_backward(Index dim) {
  Problem p(300, dim);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::top_left;
  p.forward(options);
  options.algorithm = attn::Algorithm::naive;
  p.backward(options);
  const std::vector<float> dq = p.dq, dk = p.dk, dv = p.dv;
  options.algorithm = attn::Algorithm::flash;
  p.backward(options);
  const float error = std::max({attn_bench::max_abs_diff(dq.data(), p.dq.data(), dq.size()),
                                attn_bench::max_abs_diff(dk.data(), p.dk.data(), dk.size()),
                                attn_bench::max_abs_diff(dv.data(), p.dv.data(), dv.size())});
  return error <= 1e-3f ? "" : "flash and naive backward differ by " + std::to_string(error);
}

/// The benchmarks' shared start: `threads` set, the flash backward checked (false: the
/// state skips with what differs), and options causal or not.
bool prepare(benchmark::State& state, Index dim, bool causal, Index threads,
             attn::AttentionOptions<float>& options) {
  set_threads(static_cast<int>(threads));
  if (const std::string problem = check_flash_backward(dim); !problem.empty()) {
    attn_bench::fail_check(state, problem);
    return false;
  }
  options.causal = causal ? attn::Causal::top_left : attn::Causal::none;
  return true;
}

void BM_attention(benchmark::State& state) {
  const int pass = static_cast<int>(state.range(0));
  const Index dim = state.range(1), length = state.range(2);
  const bool causal = state.range(3) != 0;
  attn::AttentionOptions<float> options;
  if (!prepare(state, dim, causal, state.range(4), options))
    return;
  Problem p(length, dim);
  p.forward(options);
  options.algorithm = pass == 2 ? attn::Algorithm::naive : attn::Algorithm::flash;
  const auto run = [&] {
    if (pass == 0)
      p.forward(options);
    else
      p.backward(options);
  };
  run();  // the first touch of every buffer outside the timing
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(p.dq.data());
    benchmark::DoNotOptimize(p.out.data());
  }
  const double pairs = static_cast<double>(length) * static_cast<double>(length) *
                       (causal ? 0.5 : 1.0) * static_cast<double>(heads);
  const double products = pass == 0 ? 2 : 5;
  state.counters["FLOPS"] = benchmark::Counter(2.0 * products * static_cast<double>(dim) * pairs,
                                               benchmark::Counter::kIsIterationInvariantRate);
  set_threads(1);
}

/// Times `first` then `second` back to back in every iteration of `state` (the pair is the
/// iteration's time) and returns the median over the iterations of second's time over first's
/// (with `first_over_second`, first's over second's): the drift of a shared machine's speed
/// over minutes cancels in each pair.
template <class First, class Second>
double paired_median_ratio(benchmark::State& state, Problem& p, First first, Second second,
                           bool first_over_second = false) {
  std::vector<double> ratios;
  using Clock = std::chrono::steady_clock;
  for (auto _ : state) {
    const auto start = Clock::now();
    first();
    const auto middle = Clock::now();
    second();
    const auto end = Clock::now();
    benchmark::DoNotOptimize(p.dq.data());
    benchmark::DoNotOptimize(p.out.data());
    const double ratio = std::chrono::duration<double>(end - middle).count() /
                         std::chrono::duration<double>(middle - start).count();
    ratios.push_back(first_over_second ? 1.0 / ratio : ratio);
    state.SetIterationTime(std::chrono::duration<double>(end - start).count());
  }
  std::sort(ratios.begin(), ratios.end());
  return ratios.empty() ? 0.0 : ratios[ratios.size() / 2];
}

void BM_backward_over_forward(benchmark::State& state) {
  const Index dim = state.range(0), length = state.range(1);
  const bool causal = state.range(2) != 0;
  attn::AttentionOptions<float> options;
  if (!prepare(state, dim, causal, state.range(3), options))
    return;
  Problem p(length, dim);
  p.forward(options);
  p.backward(options);  // the first touch of every buffer outside the timing
  state.counters["ratio"] = paired_median_ratio(
      state, p, [&] { p.forward(options); }, [&] { p.backward(options); });
  set_threads(1);
}

/// The bf16 backward against the naive fp32 one on a small causal problem: "" or what
/// differs. Its products round q, k, v, dout, p and ds to bfloat16 (8 bits): 2e-2 of each
/// gradient's largest entry.
std::string check_bf16_backward(Index dim) {
  Problem p(300, dim);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::top_left;
  p.forward(options);
  options.algorithm = attn::Algorithm::naive;
  p.backward(options);
  const std::vector<float> expected[] = {p.dq, p.dk, p.dv};
  options.algorithm = attn::Algorithm::flash;
  options.compute = attn::ComputePrecision::bf16;
  p.backward(options);
  const std::vector<float>* got[] = {&p.dq, &p.dk, &p.dv};
  for (int g = 0; g < 3; ++g) {
    float largest = 0;
    for (const float x : expected[g])
      largest = std::max(largest, std::abs(x));
    const float error =
        attn_bench::max_abs_diff(expected[g].data(), got[g]->data(), expected[g].size());
    if (!(error <= 2e-2f * largest))
      return "bf16 and naive backward differ by " + std::to_string(error);
  }
  return "";
}

void BM_bf16_speedup(benchmark::State& state) {
  const int pass = static_cast<int>(state.range(0));
  const Index dim = state.range(1), length = state.range(2);
  const bool causal = state.range(3) != 0;
  attn::AttentionOptions<float> options;
  if (!prepare(state, dim, causal, state.range(4), options))
    return;
  if (const std::string problem = check_bf16_backward(dim); !problem.empty()) {
    attn_bench::fail_check(state, problem);
    return;
  }
  Problem p(length, dim);
  attn::AttentionOptions<float> bf16 = options;
  bf16.compute = attn::ComputePrecision::bf16;
  const auto run = [&](const attn::AttentionOptions<float>& o) {
    if (pass == 0)
      p.forward(o);
    else
      p.backward(o);
  };
  p.forward(options);
  run(options);  // the first touch of every buffer outside the timing
  run(bf16);
  state.counters["speedup"] = paired_median_ratio(
      state, p, [&] { run(options); }, [&] { run(bf16); }, true);
  attn::AttentionShape shape{1, heads, heads, length, length, dim, dim};
  shape.bf16_readable_kv = true;  // float inputs
  const bool products = pass == 0 ? attn::plan_attention<float>(shape, bf16).bf16_products
                                  : attn::plan_backward<float>(shape, bf16).bf16_products;
  state.SetLabel(products ? "bf16 products" : "fp32 (no bf16 products here)");
  set_threads(1);
}

void register_all() {
  attn_bench::register_fma_peak();
  attn_bench::register_bf16_dot_peak();  // the ceiling of bf16_speedup's bf16 half
  const std::vector<std::int64_t> lengths =
      smoke() ? std::vector<std::int64_t>{256} : std::vector<std::int64_t>{1024, 2048, 4096, 8192};
  for (const std::int64_t pass : {0, 1, 2}) {
    for (const std::int64_t length : lengths) {
      if (pass == 2 && length > 2048)
        continue;  // the naive backward's (L, L) matrices per thread
      benchmark::RegisterBenchmark("attention", BM_attention)
          ->ArgNames({"pass", "D", "L", "causal", "threads"})
          ->ArgsProduct({{pass}, {64, 128}, {length}, {0, 1}, {1, 2}})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  auto* paired = benchmark::RegisterBenchmark("backward_over_forward", BM_backward_over_forward)
                     ->ArgNames({"D", "L", "causal", "threads"})
                     ->ArgsProduct({{64, 128}, lengths, {0, 1}, {1, 2}})
                     ->Unit(benchmark::kMillisecond)
                     ->UseManualTime();
  auto* bf16 = benchmark::RegisterBenchmark("bf16_speedup", BM_bf16_speedup)
                   ->ArgNames({"pass", "D", "L", "causal", "threads"})
                   ->ArgsProduct({{0, 1}, {64, 128}, lengths, {0, 1}, {1}})
                   ->Unit(benchmark::kMillisecond)
                   ->UseManualTime();
  if (!smoke()) {
    paired->MinTime(2.0);  // several pairs at L = 1024 .. 2048
    bf16->MinTime(2.0);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, register_all);
}
