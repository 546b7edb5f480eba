// Benchmarks of linear attention (attn/linear_attention.hpp) against flash SDPA at the same
// shapes, in one binary so that the crossover length is read from one run.
//
//   B * H = 8 heads (B = 1, H = 8), float, Lq = Lk = L, D = Dv = 64, phi = elu + 1.
//   FLOPs counted are those the algorithm executes in its GEMMs (feature maps not counted):
//     linear non-causal  8 * (4 L M Dv + 4 L M): S and z, then phi(Q) S and phi(Q) z
//     linear causal      the same plus the intra-chunk products, 8 * L * C * (2 M + 2 Dv + 1)
//                        (C = chunk rows; the full (C, C) block is computed)
//     flash              4 * 8 * D * (visible (query, key) pairs), as bench_attention.cpp
//     linear backward    8 * (12 L M Dv + 6 L M): S and z again, then per query row out, d phi(q)
//                        and R, r, per key d phi(k) and dv (about 3x the forward), causal
//                        plus 8 * L * C * (8 M + 8 Dv) for the masked blocks of both passes
//   time(L = 65536) / time(L = 4096) is the scaling figure (16 is linear).
//   linear_backward / linear at the same (L, causal) is the backward's cost in forwards.
//   The recurrent step: one LinearAttentionState per head, 8 steps per iteration, timed
//   after `position` tokens have been absorbed.
//
// Run everything:           OMP_NUM_THREADS=1 build/dev/bench/bench_linear
// ATTN_BENCH_SMOKE=1 shrinks to the smallest sizes (ctest's smoke test).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <attn/attention.hpp>
#include <attn/linear_attention.hpp>

#include "common.hpp"

namespace {

using attn::Index;
using attn_bench::set_threads;
using attn_bench::smoke;

constexpr Index kHeads = 8;  // B * H
constexpr Index kDim = 64;   // D = Dv

struct Inputs {
  std::vector<float> q, k, v, out;  // (1, 8, L, D) each
  Index length;
  explicit Inputs(Index l) : length(l) {
    const auto n = static_cast<std::size_t>(kHeads * l * kDim);
    q.resize(n);
    k.resize(n);
    v.resize(n);
    out.assign(n, 0.0f);
    attn_bench::fill_normal(q, 1u);
    attn_bench::fill_normal(k, 2u);
    attn_bench::fill_normal(v, 3u);
  }
  attn::HeadsView<const float> view(const std::vector<float>& t) const {
    return attn::bhld_view(t.data(), Index(1), kHeads, length, kDim);
  }
  attn::HeadsView<float> out_view() {
    return attn::bhld_view(out.data(), Index(1), kHeads, length, kDim);
  }
};

// Head 0 against a float64 reference: the linear form for non-causal (all rows), the
// quadratic form on the first 256 rows for causal. Returns the worst relative error.
double validate(const Inputs& in, bool causal) {
  const auto head0 = [&](const std::vector<float>& t) {
    return attn::Matrix<double>(
        attn::bhld_view(t.data(), Index(1), kHeads, in.length, kDim).head(0, 0).cast<double>());
  };
  const attn::Matrix<double> q = head0(in.q), k = head0(in.k), v = head0(in.v), out = head0(in.out);
  attn::Matrix<double> expected;
  Index rows = in.length;
  if (!causal) {
    const auto phi = [](const attn::Matrix<double>& x) {  // elu + 1
      return attn::Matrix<double>(
          x.unaryExpr([](double t) { return t > 0 ? t + 1 : std::exp(t); }));
    };
    const attn::Matrix<double> phi_q = phi(q), phi_k = phi(k);
    const attn::Matrix<double> s = phi_k.transpose() * v;              // (D, Dv)
    const Eigen::VectorXd z = phi_k.colwise().sum().transpose();       // (D)
    const Eigen::VectorXd denominator = (phi_q * z).array() + 1e-6;    // (L)
    expected = denominator.cwiseInverse().asDiagonal() * (phi_q * s);  // (L, Dv)
  } else {
    rows = std::min<Index>(in.length, 256);
    expected = attn_bench::linear_attention_quadratic(q, k, v, true, rows);
  }
  double worst = 0;
  for (Index i = 0; i < rows; ++i)
    for (Index c = 0; c < kDim; ++c)
      worst = std::max(
          worst, std::abs(out(i, c) - expected(i, c)) / std::max(1.0, std::abs(expected(i, c))));
  return worst;
}

double linear_flops(Index l, bool causal, Index chunk) {
  const double ld = static_cast<double>(l), m = kDim, dv = kDim;
  double per_head = 4 * ld * m * dv + 4 * ld * m;
  if (causal)
    per_head += ld * static_cast<double>(chunk) * (2 * m + 2 * dv + 1);
  return static_cast<double>(kHeads) * per_head;
}

void BM_linear(benchmark::State& state) {
  const Index length = state.range(0);
  const bool causal = state.range(1) != 0;
  const Index chunk = state.range(2);
  set_threads(1);
  Inputs inputs(length);
  attn::LinearAttentionOptions<float> options;
  options.causal = causal ? attn::Causal::top_left : attn::Causal::none;
  options.chunk = chunk;
  const auto run = [&] {
    attn::linear_attention_into<float>(inputs.view(inputs.q), inputs.view(inputs.k),
                                       inputs.view(inputs.v), inputs.out_view(), options);
  };
  run();  // validate once before timing
  const double worst = validate(inputs, causal);
  if (!(worst < 1e-4)) {
    attn_bench::fail_check(state,
                           ("differs from the float64 reference by " + std::to_string(worst)));
    return;
  }
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(inputs.out.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] = benchmark::Counter(linear_flops(length, causal, chunk),
                                               benchmark::Counter::kIsIterationInvariantRate);
}

double linear_backward_flops(Index l, bool causal, Index chunk) {
  const double ld = static_cast<double>(l), m = kDim, dv = kDim;
  double per_head = 12 * ld * m * dv + 6 * ld * m;
  if (causal)
    per_head += ld * static_cast<double>(chunk) * (8 * m + 8 * dv);
  return static_cast<double>(kHeads) * per_head;
}

// The backward at the forward's shapes, dout ~ N(0, 1); before timing, head 0's dq, dk and dv
// against the double-precision backward of the same inputs (which the tests check against
// torch autograd).
void BM_linear_backward(benchmark::State& state) {
  const Index length = state.range(0);
  const bool causal = state.range(1) != 0;
  set_threads(1);
  Inputs inputs(length);
  std::vector<float> dout(inputs.q.size()), dq(inputs.q.size()), dk(inputs.q.size()),
      dv(inputs.q.size());
  attn_bench::fill_normal(dout, 4u);
  attn::LinearAttentionOptions<float> options;
  options.causal = causal ? attn::Causal::top_left : attn::Causal::none;
  const auto view = [&](std::vector<float>& t) {
    return attn::bhld_view(t.data(), Index(1), kHeads, length, kDim);
  };
  const auto run = [&] {
    attn::linear_attention_backward_into<float>(inputs.view(inputs.q), inputs.view(inputs.k),
                                                inputs.view(inputs.v), inputs.view(dout), view(dq),
                                                view(dk), view(dv), options);
  };
  run();
  {
    const auto head0 = [&](const std::vector<float>& t) {
      return attn::Matrix<double>(
          attn::bhld_view(t.data(), Index(1), kHeads, length, kDim).head(0, 0).cast<double>());
    };
    attn::LinearAttentionOptions<double> reference;
    reference.causal = options.causal;
    const auto expected = attn::linear_attention_backward(head0(inputs.q), head0(inputs.k),
                                                          head0(inputs.v), head0(dout), reference);
    double worst = 0;
    for (const auto& [actual, wanted] :
         {std::pair<attn::Matrix<double>, const attn::Matrix<double>*>{head0(dq), &expected.dq},
          {head0(dk), &expected.dk},
          {head0(dv), &expected.dv}}) {
      worst = std::max(
          worst, ((actual - *wanted).array().abs() / wanted->array().abs().max(1.0)).maxCoeff());
    }
    if (!(worst < 1e-3)) {
      attn_bench::fail_check(state,
                             ("differs from the float64 backward by " + std::to_string(worst)));
      return;
    }
  }
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(dq.data());
    benchmark::DoNotOptimize(dk.data());
    benchmark::DoNotOptimize(dv.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] =
      benchmark::Counter(linear_backward_flops(length, causal, attn::default_linear_chunk),
                         benchmark::Counter::kIsIterationInvariantRate);
}

void BM_flash(benchmark::State& state) {
  const Index length = state.range(0);
  const bool causal = state.range(1) != 0;
  set_threads(1);
  Inputs inputs(length);
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  options.causal = causal ? attn::Causal::top_left : attn::Causal::none;
  for (auto _ : state) {
    attn::scaled_dot_product_attention_into<float>(inputs.view(inputs.q), inputs.view(inputs.k),
                                                   inputs.view(inputs.v), inputs.out_view(),
                                                   options);
    benchmark::DoNotOptimize(inputs.out.data());
    benchmark::ClobberMemory();
  }
  const auto ld = static_cast<double>(length);
  const double pairs = causal ? ld * (ld + 1) / 2 : ld * ld;
  state.counters["FLOPS"] = benchmark::Counter(4.0 * kHeads * pairs * kDim,
                                               benchmark::Counter::kIsIterationInvariantRate);
}

// One decoding step for each of the 8 heads, after `position` tokens.
void BM_step(benchmark::State& state) {
  const Index position = state.range(0);
  set_threads(1);
  std::vector<attn::LinearAttentionState<float>> heads(
      static_cast<std::size_t>(kHeads), attn::LinearAttentionState<float>(kDim, kDim));
  const attn::Matrix<float> tokens = attn::Matrix<float>::Random(256, kDim);  // (256, D)
  for (auto& head : heads) {
    for (Index p = 0; p < position; ++p)
      head.update(tokens.row(p % 256), tokens.row((p + 1) % 256));
  }
  attn::Vector<float> out(kDim);
  Index n = 0;
  for (auto _ : state) {
    for (auto& head : heads) {
      head.step_into(tokens.row(n % 256), tokens.row((n + 7) % 256), tokens.row((n + 3) % 256),
                     out);
      benchmark::DoNotOptimize(out.data());
    }
    ++n;
  }
  state.counters["FLOPS"] =
      benchmark::Counter(static_cast<double>(kHeads) * (4.0 * kDim * kDim + 4.0 * kDim),
                         benchmark::Counter::kIsIterationInvariantRate);
  state.counters["position"] = static_cast<double>(position);
}

void register_all() {
  const bool tiny = smoke();
  const std::vector<std::int64_t> lengths =
      tiny ? std::vector<std::int64_t>{128}
           : std::vector<std::int64_t>{16,   32,   64,   128,   256,   512,  1024,
                                       2048, 4096, 8192, 16384, 32768, 65536};
  // flash is quadratic: 8192 already takes seconds per call.
  const std::int64_t flash_max = 8192;
  std::vector<std::int64_t> flash_lengths;
  for (const std::int64_t l : lengths)
    if (l <= flash_max)
      flash_lengths.push_back(l);

  benchmark::RegisterBenchmark("linear", BM_linear)
      ->ArgNames({"L", "causal", "chunk"})
      ->ArgsProduct({lengths, {0, 1}, {attn::default_linear_chunk}})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("linear_backward", BM_linear_backward)
      ->ArgNames({"L", "causal"})
      ->ArgsProduct({tiny ? std::vector<std::int64_t>{128}
                          : std::vector<std::int64_t>{256, 1024, 4096, 16384, 65536},
                     {0, 1}})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  if (!tiny) {  // the chunk size of the causal form
    benchmark::RegisterBenchmark("linear_chunk", BM_linear)
        ->ArgNames({"L", "causal", "chunk"})
        ->ArgsProduct({{16384}, {0, 1}, {8, 16, 32, 64, 128, 256}})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("flash", BM_flash)
      ->ArgNames({"L", "causal"})
      ->ArgsProduct({flash_lengths, {0, 1}})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("step", BM_step)
      ->ArgNames({"position"})
      ->ArgsProduct({tiny ? std::vector<std::int64_t>{0, 16}
                          : std::vector<std::int64_t>{0, 1024, 16384, 65536}})
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, register_all);
}
