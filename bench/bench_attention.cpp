// Benchmarks of attention: naive, chunked, flash (and flash_isa, flash with each instruction
// set's products forced; flash_tiles, flash with the tiles given; flash_kv_half and
// flash_kv_bfloat16, flash against 16-bit keys and values; flash_bf16 and flash_bf16_fp32,
// bfloat16 q, k, v on bf16 dot products or widened to fp32; flash_int8, q k^T on int8 dot
// products) and linear attention, beside Eigen's
// plain GEMM at the same (Lq x D) x (D x Lk) shape and the FMA peak probe (common.hpp), all in one
// binary so that every figure can be read as a fraction of this machine's measured peak.
//
//   B * H = 8 heads (B = 1, H = 8), float, Lq = Lk = L, D = Dv.
//   FLOPs: non-causal 4 * B * H * Lq * Lk * D (two GEMMs of 2 * Lq * Lk * D each); causal
//   counts only the visible half, 4 * B * H * D * Lq * (Lk + 1) / 2, so that GFLOP/s stay
//   comparable and a causal run that skips hidden tiles shows the same rate, not 2x.
//   The exp, max and sums of the softmax are not counted.
//
// Run everything:           build/dev/bench/bench_attention
// One family:               build/dev/bench/bench_attention --benchmark_filter='flash/L:4096'
// ATTN_BENCH_SMOKE=1 shrinks to the smallest sizes (ctest's smoke test).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/cpu.hpp>
#include <attn/linear_attention.hpp>

#include "common.hpp"

namespace {

using attn::Index;

using attn_bench::set_threads;
using attn_bench::smoke;

// --- SDPA -----------------------------------------------------------------------------
constexpr Index kHeads = 8;  // B * H

struct Inputs {
  std::vector<float> q, k, v, out;  // (1, 8, L, D) each
  Index length, dim;
  Inputs(Index l, Index d) : length(l), dim(d) {
    const auto n = static_cast<std::size_t>(kHeads * l * d);
    q.resize(n);
    k.resize(n);
    v.resize(n);
    out.assign(n, 0.0f);
    std::mt19937 rng(42u);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::vector<float>* t : {&q, &k, &v})
      for (float& x : *t)
        x = normal(rng);
  }
  attn::HeadsView<const float> view(const std::vector<float>& t) const {
    return attn::bhld_view(t.data(), Index(1), kHeads, length, dim);
  }
  /// Tiles of 0: the plan's.
  void run(attn::Algorithm algorithm, bool causal, std::vector<float>& result, Index query_tile = 0,
           Index key_tile = 0) const {
    attn::AttentionOptions<float> options;
    options.algorithm = algorithm;
    options.causal = causal ? attn::Causal::top_left : attn::Causal::none;
    options.query_tile = query_tile;
    options.key_tile = key_tile;
    attn::scaled_dot_product_attention_into<float>(
        view(q), view(k), view(v), attn::bhld_view(result.data(), Index(1), kHeads, length, dim),
        options);
  }
};

double attention_flops(Index l, Index d, bool causal) {
  const auto ld = static_cast<double>(l), dd = static_cast<double>(d);
  const double scores = causal ? ld * (ld + 1) / 2 : ld * ld;  // visible (query, key) pairs
  return 4.0 * static_cast<double>(kHeads) * scores * dd;
}

/// The timed loop of every attention family: `run` writes inputs.out; `flops` per call.
template <class Run>
void time_runs(benchmark::State& state, const Run& run, const Inputs& inputs, double flops) {
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(inputs.out.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  set_threads(1);
}

/// Arguments from state.range(first): L, D, causal, threads.
void BM_sdpa(benchmark::State& state, attn::Algorithm algorithm, std::size_t first = 0) {
  const Index length = state.range(first), dim = state.range(first + 1);
  const bool causal = state.range(first + 2) != 0;
  const int threads = static_cast<int>(state.range(first + 3));
  set_threads(threads);
  Inputs inputs(length, dim);
  // Validate against naive once before timing.
  if (algorithm != attn::Algorithm::naive) {
    std::vector<float> reference(inputs.out.size());
    inputs.run(attn::Algorithm::naive, causal, reference);
    inputs.run(algorithm, causal, inputs.out);
    const float worst =
        attn_bench::max_abs_diff(reference.data(), inputs.out.data(), reference.size());
    if (!(worst < 1e-4f)) {
      attn_bench::fail_check(state, ("differs from naive by " + std::to_string(worst)));
      return;
    }
  }
  time_runs(
      state, [&] { inputs.run(algorithm, causal, inputs.out); }, inputs,
      attention_flops(length, dim, causal));
}

// Flash with the tiles given (0: the plan's), so that the plan's tile sizes can be compared
// with others in one run: "flash_tiles/query_tile:64/key_tile:0/..." against query_tile:0.
void BM_flash_tiles(benchmark::State& state) {
  const Index query_tile = state.range(0), key_tile = state.range(1);
  const Index length = state.range(2), dim = state.range(3);
  const bool causal = state.range(4) != 0;
  set_threads(static_cast<int>(state.range(5)));
  Inputs inputs(length, dim);
  std::vector<float> reference(inputs.out.size());
  inputs.run(attn::Algorithm::naive, causal, reference);
  const auto run = [&] {
    inputs.run(attn::Algorithm::flash, causal, inputs.out, query_tile, key_tile);
  };
  run();
  const float worst =
      attn_bench::max_abs_diff(reference.data(), inputs.out.data(), reference.size());
  if (!(worst < 1e-4f)) {
    attn_bench::fail_check(state, ("differs from naive by " + std::to_string(worst)));
    return;
  }
  time_runs(state, run, inputs, attention_flops(length, dim, causal));
}

// Prefill against 16-bit keys and values: float q and out, k and v stored as S (half or
// bfloat16) and widened tile by tile inside the flash kernel. Same FLOPs as "flash"; the
// widening is the extra cost (docs/performance.md compares it with float at L = 4096).
template <class S>
void BM_flash_kv16(benchmark::State& state) {
  const Index length = state.range(0), dim = state.range(1);
  const bool causal = state.range(2) != 0;
  const int threads = static_cast<int>(state.range(3));
  set_threads(threads);
  Inputs inputs(length, dim);
  std::vector<S> k16(inputs.k.size()), v16(inputs.v.size());
  for (std::size_t i = 0; i < k16.size(); ++i) {
    k16[i] = static_cast<S>(inputs.k[i]);
    v16[i] = static_cast<S>(inputs.v[i]);
    inputs.k[i] = static_cast<float>(k16[i]);  // the float run sees the same values
    inputs.v[i] = static_cast<float>(v16[i]);
  }
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  options.causal = causal ? attn::Causal::top_left : attn::Causal::none;
  const auto view16 = [&](const std::vector<S>& t) {
    return attn::bhld_view(t.data(), Index(1), kHeads, length, dim);
  };
  const auto out = attn::bhld_view(inputs.out.data(), Index(1), kHeads, length, dim);
  const auto run = [&] {
    attn::scaled_dot_product_attention_into<float, S>(inputs.view(inputs.q), view16(k16),
                                                      view16(v16), out, options);
  };
  // Widening tile by tile must give the bits of the float kernel on the widened values.
  std::vector<float> reference(inputs.out.size());
  inputs.run(attn::Algorithm::flash, causal, reference);
  run();
  if (reference != inputs.out) {
    attn_bench::fail_check(state, "16-bit k/v result differs from float flash on the same values");
    return;
  }
  time_runs(state, run, inputs, attention_flops(length, dim, causal));
}

// Flash on bfloat16 q, k and v, float out: ComputePrecision::bf16 runs bf16 dot products where
// the CPU has them (flash_bf16), ComputePrecision::fp32 the widening path (flash_bf16_fp32),
// beside flash on float inputs ("flash") and the bf16 dot-product probe. Checked before timing
// against the fp32 path on the same values: within 2^-6 of the largest output (the
// probabilities are rounded to bfloat16, 2^-8 relative; docs/precision.md).
void BM_flash_bf16(benchmark::State& state, attn::ComputePrecision compute) {
  const Index length = state.range(0), dim = state.range(1);
  const bool causal = state.range(2) != 0;
  set_threads(static_cast<int>(state.range(3)));
  Inputs inputs(length, dim);
  std::vector<Eigen::bfloat16> q(inputs.q.size()), k(q.size()), v(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) {
    q[i] = Eigen::bfloat16(inputs.q[i]);
    k[i] = Eigen::bfloat16(inputs.k[i]);
    v[i] = Eigen::bfloat16(inputs.v[i]);
  }
  const auto view = [&](const std::vector<Eigen::bfloat16>& t) {
    return attn::bhld_view(t.data(), Index(1), kHeads, length, dim);
  };
  const auto out = attn::bhld_view(inputs.out.data(), Index(1), kHeads, length, dim);
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  options.causal = causal ? attn::Causal::top_left : attn::Causal::none;
  options.compute = compute;
  const auto run_with = [&](const attn::AttentionOptions<float>& o) {
    attn::scaled_dot_product_attention_into<Eigen::bfloat16, Eigen::bfloat16, float>(
        view(q), view(k), view(v), out, o);
  };
  attn::AttentionOptions<float> fp32 = options;
  fp32.compute = attn::ComputePrecision::fp32;
  run_with(fp32);
  const std::vector<float> reference = inputs.out;
  run_with(options);
  float largest = 0;
  for (const float x : reference)
    largest = std::max(largest, std::abs(x));
  const float worst =
      attn_bench::max_abs_diff(reference.data(), inputs.out.data(), reference.size());
  if (!(worst <= largest / 64)) {
    attn_bench::fail_check(state, ("differs from the fp32 path by " + std::to_string(worst)));
    return;
  }
  const auto shape = attn::AttentionShape{1,   kHeads, kHeads, length, length, dim,
                                          dim, 2,      false,  false,  causal, true};
  state.SetLabel(attn::plan_attention<float>(shape, options).bf16_products ? "bf16 products"
                                                                           : "fp32");
  time_runs(
      state, [&] { run_with(options); }, inputs, attention_flops(length, dim, causal));
}

// Flash on float q, k and v with q k^T on int8 products where the CPU has them
// (ComputePrecision::int8, kernels/int8_tiles.hpp; P V in fp32), beside "flash" and the int8
// dot-product probe. Checked before timing against the fp32 path on the same values: a
// relative L1 difference under 2^-5 (docs/precision.md measures about 0.01).
void BM_flash_int8(benchmark::State& state) {
  const Index length = state.range(0), dim = state.range(1);
  const bool causal = state.range(2) != 0;
  set_threads(static_cast<int>(state.range(3)));
  Inputs inputs(length, dim);
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  options.causal = causal ? attn::Causal::top_left : attn::Causal::none;
  options.compute = attn::ComputePrecision::int8;
  const auto out = attn::bhld_view(inputs.out.data(), Index(1), kHeads, length, dim);
  const auto run_with = [&](const attn::AttentionOptions<float>& o) {
    attn::scaled_dot_product_attention_into<float, float, float>(
        inputs.view(inputs.q), inputs.view(inputs.k), inputs.view(inputs.v), out, o);
  };
  attn::AttentionOptions<float> fp32 = options;
  fp32.compute = attn::ComputePrecision::fp32;
  run_with(fp32);
  const std::vector<float> reference = inputs.out;
  run_with(options);
  double difference = 0, size = 0;
  for (std::size_t i = 0; i < reference.size(); ++i) {
    difference += std::abs(static_cast<double>(reference[i]) - inputs.out[i]);
    size += std::abs(static_cast<double>(reference[i]));
  }
  if (!(difference <= size / 32)) {
    attn_bench::fail_check(state, ("differs from the fp32 path by " +
                                   std::to_string(difference / size) + " relative L1"));
    return;
  }
  const auto shape =
      attn::AttentionShape{1, kHeads, kHeads, length, length, dim, dim, 4, false, false, causal};
  state.SetLabel(attn::plan_attention<float>(shape, options).int8_products ? "int8 products"
                                                                           : "fp32");
  time_runs(
      state, [&] { run_with(options); }, inputs, attention_flops(length, dim, causal));
}

// Flash with the products of one instruction set forced (attn/cpu.hpp), so that every
// kernel this CPU can run is measured in the same binary and the same run: "flash" is the
// automatic choice, "flash_isa/isa:<n>" the kernel of attn::all_isas[n].
void BM_flash_isa(benchmark::State& state) {
  const attn::Isa isa = attn::all_isas[static_cast<std::size_t>(state.range(0))];
  if (!attn::isa_supported(isa)) {
    state.SkipWithError((std::string(attn::isa_name(isa)) + ": not on this CPU").c_str());
    return;
  }
  const attn::ScopedIsa forced(isa);
  state.SetLabel(attn::isa_name(isa));
  BM_sdpa(state, attn::Algorithm::flash, 1);
}

// Linear attention (elu + 1, attn/linear_attention.hpp) on the same inputs. FLOPs are the
// ones it executes (as in bench_linear.cpp): 4 L D Dv + 4 L D per head, plus the causal
// form's (C, C) intra-chunk blocks; they are not comparable with softmax attention's, the
// times are. Checked once against the quadratic form, phi(q) phi(k)^T row-normalised times
// v, on the first 64 queries of head 0.
void BM_linear(benchmark::State& state) {
  const Index length = state.range(0), dim = state.range(1);
  const bool causal = state.range(2) != 0;
  const int threads = static_cast<int>(state.range(3));
  set_threads(threads);
  Inputs inputs(length, dim);
  attn::LinearAttentionOptions<float> options;
  options.causal = causal ? attn::Causal::top_left : attn::Causal::none;
  const auto run = [&] {
    attn::linear_attention_into<float>(
        inputs.view(inputs.q), inputs.view(inputs.k), inputs.view(inputs.v),
        attn::bhld_view(inputs.out.data(), Index(1), kHeads, length, dim), options);
  };
  run();
  {
    const auto head = [&](const std::vector<float>& t) {
      return attn_bench::MatrixD(inputs.view(t).head(0, 0).cast<double>());
    };
    const Index rows = std::min<Index>(64, length);
    const attn_bench::MatrixD expected = attn_bench::linear_attention_quadratic(
        head(inputs.q), head(inputs.k), head(inputs.v), causal, rows);
    float worst = 0;
    for (Index i = 0; i < rows; ++i) {
      for (Index e = 0; e < dim; ++e) {
        worst = std::max(
            worst, static_cast<float>(std::abs(inputs.out[static_cast<std::size_t>(i * dim + e)] -
                                               expected(i, e))));
      }
    }
    if (!(worst < 1e-4f)) {
      attn_bench::fail_check(state,
                             ("differs from the quadratic form by " + std::to_string(worst)));
      return;
    }
  }
  const auto l = static_cast<double>(length), d = static_cast<double>(dim);
  double per_head = 4 * l * d * d + 4 * l * d;
  if (causal)
    per_head += l * static_cast<double>(attn::default_linear_chunk) * (4 * d + 1);
  time_runs(state, run, inputs, static_cast<double>(kHeads) * per_head);
}

// Eigen's plain GEMM at one head's shape: (Lq x D) x (D x Lk) -> (Lq x Lk), row-major, as
// many times as there are heads, so its FLOPs equal half of the non-causal attention's.
void BM_gemm(benchmark::State& state) {
  const Index length = state.range(0), dim = state.range(1);
  const int threads = static_cast<int>(state.range(3));
  set_threads(threads);
  const attn::Matrix<float> a = attn::Matrix<float>::Random(length, dim);
  const attn::Matrix<float> b = attn::Matrix<float>::Random(dim, length);
  attn::Matrix<float> c(length, length);
  c.setZero();
  for (auto _ : state) {
    for (Index h = 0; h < kHeads; ++h) {
      c.noalias() = a * b;
      benchmark::DoNotOptimize(c.data());
    }
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] =
      benchmark::Counter(2.0 * static_cast<double>(kHeads * length * length * dim),
                         benchmark::Counter::kIsIterationInvariantRate);
  set_threads(1);
}

void register_all() {
  const bool tiny = smoke();
  const std::vector<std::int64_t> lengths =
      tiny ? std::vector<std::int64_t>{128}
           : std::vector<std::int64_t>{128, 512, 1024, 2048, 4096, 8192};
  const std::vector<std::int64_t> dims =
      tiny ? std::vector<std::int64_t>{64} : std::vector<std::int64_t>{64, 128};
  const std::vector<std::int64_t> thread_counts{1, 2};

  attn_bench::register_fma_peak();       // the same probe as bench_gemm's
  attn_bench::register_fma_peak_isas();  // and per instruction set, for flash_isa
  const auto add = [&](const char* name, auto&& function, bool with_causal) {
    benchmark::RegisterBenchmark(name, function)
        ->ArgNames({"L", "D", "causal", "threads"})
        ->ArgsProduct({lengths, dims,
                       with_causal ? std::vector<std::int64_t>{0, 1} : std::vector<std::int64_t>{0},
                       thread_counts})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  };
  add("gemm", BM_gemm, false);
  add(
      "naive", [](benchmark::State& s) { BM_sdpa(s, attn::Algorithm::naive); }, true);
  add(
      "chunked", [](benchmark::State& s) { BM_sdpa(s, attn::Algorithm::chunked); }, true);
  add(
      "flash", [](benchmark::State& s) { BM_sdpa(s, attn::Algorithm::flash); }, true);
  benchmark::RegisterBenchmark("flash_isa", BM_flash_isa)
      ->ArgNames({"isa", "L", "D", "causal", "threads"})
      ->ArgsProduct({{0, 1, 2}, lengths, dims, {0, 1}, thread_counts})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("flash_tiles", BM_flash_tiles)
      ->ArgNames({"query_tile", "key_tile", "L", "D", "causal", "threads"})
      ->ArgsProduct(
          {tiny ? std::vector<std::int64_t>{0, 64} : std::vector<std::int64_t>{0, 32, 64, 128},
           {0},
           lengths,
           dims,
           {0, 1},
           thread_counts})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  attn_bench::register_bf16_dot_peak();  // the ceiling of flash_bf16
  add(
      "flash_bf16", [](benchmark::State& s) { BM_flash_bf16(s, attn::ComputePrecision::bf16); },
      true);
  add(
      "flash_bf16_fp32",
      [](benchmark::State& s) { BM_flash_bf16(s, attn::ComputePrecision::fp32); }, true);
  attn_bench::register_int8_dot_peak();  // the ceiling of flash_int8's q k^T
  add("flash_int8", BM_flash_int8, true);
  add("flash_kv_half", BM_flash_kv16<Eigen::half>, true);
  add("flash_kv_bfloat16", BM_flash_kv16<Eigen::bfloat16>, true);
  add("linear", BM_linear, true);
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, register_all);
}
