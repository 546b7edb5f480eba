// bench/bench_decode_phases.cpp: the three phases of decode's work on one key block, each
// alone and from L1, per instruction set: where a call's arithmetic goes.
//
//   q    (R, D)        R = G * Lq query rows of one kv head: 1 (Hq = Hkv) or 4 (GQA 32/8)
//   k, v (64, D)       one key block (decode_key_block) of K and V, stored as float, half,
//                      q8_0 or q4_0 (format 0..3), D = 128
//   s    (R, 64)       scores, then weights; acc (R, D) the weighted sum
//
// Families (args rows, format; one thread; "ns_per_key" is the time per key of the block, that
// is per key and kv head, the unit of docs/performance.md's decomposition):
//   decode_phase_scores/<isa>       s = q k^T with k widened to float in registers (dot_scores)
//   decode_phase_scores_int8        the same on int8 products (Int8KeyScores: the query
//                                   quantized per block once, outside the loop), q8_0 and q4_0,
//                                   where the CPU has avx512_vnni
//   decode_phase_softmax/<isa>      the row maxima and exp(s - max) with the row sums
//                                   (row_maxima, exp_rows), format-free (format 0 only)
//   decode_phase_values/<isa>       acc = alpha acc + p v (weighted_sum)
//   fma_peak, int8_dot_peak         the arithmetic ceilings of the same run (common.hpp)
// Each phase reads the same block again and again, so memory plays no part: a cold call's time
// over the sum of these says how far the memory stream adds to the arithmetic. Each phase's
// result is checked against a double reference on the stored values before timing.
//
//   build/dev/bench/bench_decode_phases --benchmark_filter='avx512'
// ATTN_BENCH_SMOKE=1 (ctest) runs each once.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <attn/cpu.hpp>
#include <attn/kernels/int8_decode.hpp>
#include <attn/kernels/online_softmax.hpp>
#include <attn/kernels/workspace.hpp>
#include <attn/plan.hpp>
#include <attn/quantized.hpp>

#include "common.hpp"

namespace {

using attn::Index;
using attn_bench::smoke;

constexpr Index block_keys = attn::decode_key_block;  // one block of a decode split
constexpr Index dim = 128;

/// One key block of K or V stored as S, from N(0, 1) floats; `values` the stored values
/// widened to double, for the references.
template <class S>
struct StoredRows {
  std::vector<S> rows;
  std::vector<double> values;
  Index stride = 0;  // in S

  explicit StoredRows(unsigned seed) {
    std::vector<float> x(static_cast<std::size_t>(block_keys * dim));
    attn_bench::fill_normal(x, seed);
    std::vector<float> widened(x.size());
    if constexpr (attn::is_quantized_v<S>) {
      rows = attn::quantize_blocks<S>(x);
      attn::dequantize_blocks(rows.data(), static_cast<Index>(rows.size()), widened.data());
      stride = dim / attn::quantized_block_values;
    } else {
      for (const float value : x)
        rows.push_back(static_cast<S>(value));
      for (std::size_t n = 0; n < x.size(); ++n)
        widened[n] = static_cast<float>(rows[n]);
      stride = dim;
    }
    values.assign(widened.begin(), widened.end());
  }
};

/// The worst |got - want| over the largest |want|.
double relative_error(const float* got, const std::vector<double>& want) {
  double worst = 0, largest = 0;
  for (std::size_t n = 0; n < want.size(); ++n) {
    worst = std::max(worst, std::abs(static_cast<double>(got[n]) - want[n]));
    largest = std::max(largest, std::abs(want[n]));
  }
  return worst / largest;
}

/// s = q k^T in double: (rows, 64).
std::vector<double> reference_scores(const std::vector<float>& q, Index rows,
                                     const std::vector<double>& k) {
  std::vector<double> s(static_cast<std::size_t>(rows * block_keys));
  for (Index r = 0; r < rows; ++r) {
    for (Index j = 0; j < block_keys; ++j) {
      double sum = 0;
      for (Index d = 0; d < dim; ++d)
        sum += static_cast<double>(q[static_cast<std::size_t>(r * dim + d)]) *
               k[static_cast<std::size_t>(j * dim + d)];
      s[static_cast<std::size_t>(r * block_keys + j)] = sum;
    }
  }
  return s;
}

/// Weights p of a softmax row, positive and summing to about 1: (rows, 64).
std::vector<float> weights(Index rows) {
  std::vector<float> p(static_cast<std::size_t>(rows * block_keys));
  for (Index n = 0; n < rows * block_keys; ++n)
    p[static_cast<std::size_t>(n)] = std::exp(-0.05f * static_cast<float>(n % block_keys)) / 20;
  return p;
}

void report(benchmark::State& state, attn::Isa isa) {
  state.SetLabel(attn::isa_name(isa));
  state.counters["ns_per_key"] = benchmark::Counter(
      static_cast<double>(block_keys) * 1e-9,
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

#if ATTN_X86_DISPATCH
namespace avx2_phases {
namespace simd = attn::detail::avx2;
#include "decode_phases.inl"  // NOLINT(readability-duplicate-include): once per instruction set
}  // namespace avx2_phases

namespace avx512_phases {
namespace simd = attn::detail::avx512;
#include "decode_phases.inl"  // NOLINT(readability-duplicate-include): once per instruction set
}  // namespace avx512_phases
#endif

template <class S, class Phases>
void BM_scores(benchmark::State& state) {
  const Index rows = state.range(0);
  const StoredRows<S> k(2);
  std::vector<float> q(static_cast<std::size_t>(rows * dim));
  attn_bench::fill_normal(q, 1);
  std::vector<float> s(static_cast<std::size_t>(rows * block_keys));
  Phases::scores(q.data(), rows, k.rows.data(), k.stride, s.data());
  if (relative_error(s.data(), reference_scores(q, rows, k.values)) > 1e-5) {
    attn_bench::fail_check(state, "scores differ from the double reference");
    return;
  }
  for (auto _ : state) {
    Phases::scores(q.data(), rows, k.rows.data(), k.stride, s.data());
    benchmark::ClobberMemory();
  }
  report(state, Phases::isa);
}

template <class S, class Phases>
void BM_values(benchmark::State& state) {
  const Index rows = state.range(0);
  const StoredRows<S> v(3);
  const std::vector<float> p = weights(rows);
  const std::vector<float> alpha(static_cast<std::size_t>(rows), 1.0f);
  std::vector<float> acc(static_cast<std::size_t>(rows * dim), 0.0f);
  Phases::values(p.data(), rows, v.rows.data(), v.stride, alpha.data(), acc.data());
  std::vector<double> want(acc.size());
  for (Index r = 0; r < rows; ++r) {
    for (Index j = 0; j < block_keys; ++j) {
      for (Index d = 0; d < dim; ++d)
        want[static_cast<std::size_t>(r * dim + d)] +=
            static_cast<double>(p[static_cast<std::size_t>(r * block_keys + j)]) *
            v.values[static_cast<std::size_t>(j * dim + d)];
    }
  }
  if (relative_error(acc.data(), want) > 1e-5) {
    attn_bench::fail_check(state, "the weighted sum differs from the double reference");
    return;
  }
  for (auto _ : state) {  // alpha = 1: acc grows by the same sum each call
    Phases::values(p.data(), rows, v.rows.data(), v.stride, alpha.data(), acc.data());
    benchmark::ClobberMemory();
  }
  report(state, Phases::isa);
}

template <class Phases>
void BM_softmax(benchmark::State& state) {
  const Index rows = state.range(0);
  std::vector<float> scores(static_cast<std::size_t>(rows * block_keys));
  attn_bench::fill_normal(scores, 4);
  std::vector<float> s = scores, maxima(static_cast<std::size_t>(rows)),
                     sums(static_cast<std::size_t>(rows));
  Phases::softmax(s.data(), rows, maxima.data(), sums.data());
  std::vector<double> want(s.size());
  for (Index r = 0; r < rows; ++r) {
    double largest = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j < block_keys; ++j)
      largest = std::max(largest,
                         static_cast<double>(scores[static_cast<std::size_t>(r * block_keys + j)]));
    for (Index j = 0; j < block_keys; ++j) {
      const auto n = static_cast<std::size_t>(r * block_keys + j);
      want[n] = std::exp(static_cast<double>(scores[n]) - largest);
    }
  }
  if (relative_error(s.data(), want) > 1e-5) {
    attn_bench::fail_check(state, "the exponentials differ from the double reference");
    return;
  }
  for (auto _ : state) {  // (exp of exp: every value stays in [exp(-1), 1])
    Phases::softmax(s.data(), rows, maxima.data(), sums.data());
    benchmark::ClobberMemory();
  }
  report(state, Phases::isa);
}

#if ATTN_X86_DISPATCH
/// Int8KeyScores (kernels/int8_decode.hpp): the query quantized once, the scores timed.
template <class Block>
void BM_scores_int8(benchmark::State& state) {
  using Scores = attn::detail::avx512_vnni::Int8KeyScores<Block>;
  const Index rows = state.range(0);
  const StoredRows<Block> k(2);
  std::vector<float> q(static_cast<std::size_t>(rows * dim));
  attn_bench::fill_normal(q, 1);
  std::vector<float> s(static_cast<std::size_t>(rows * block_keys));
  attn::detail::Workspace<float> workspace;
  Scores::prepare(q.data(), rows, dim, workspace);
  const auto call = [&] {
    Scores::scores(q.data(), rows, k.rows.data(), k.stride, block_keys, dim, s.data(), block_keys,
                   k.rows.data(), nullptr, workspace);
  };
  call();
  // The query's quantization error: about 1/254 of its largest value per block.
  if (relative_error(s.data(), reference_scores(q, rows, k.values)) > 2e-2) {
    attn_bench::fail_check(state, "int8 scores differ from the double reference");
    return;
  }
  for (auto _ : state) {
    call();
    benchmark::ClobberMemory();
  }
  report(state, attn::Isa::avx512_vnni);
}
#endif

/// Registers `name` for one and four query rows of one K/V format.
void add(const std::string& name, void (*run)(benchmark::State&), std::int64_t format) {
  auto* b = benchmark::RegisterBenchmark(name.c_str(), run)
                ->ArgNames({"rows", "format"})
                ->ArgsProduct({{1, 4}, {format}});
  if (smoke())
    b->Iterations(1);
}

/// The families of one vector instruction set, where this CPU has it.
template <class Phases>
void register_isa() {
  if (!attn::isa_supported(Phases::isa))
    return;
  const std::string isa = std::string("/") + attn::isa_name(Phases::isa);
  add("decode_phase_scores" + isa, BM_scores<float, Phases>, 0);
  add("decode_phase_scores" + isa, BM_scores<Eigen::half, Phases>, 1);
  add("decode_phase_scores" + isa, BM_scores<attn::BlockQ8_0, Phases>, 2);
  add("decode_phase_scores" + isa, BM_scores<attn::BlockQ4_0, Phases>, 3);
  add("decode_phase_softmax" + isa, BM_softmax<Phases>, 0);
  add("decode_phase_values" + isa, BM_values<float, Phases>, 0);
  add("decode_phase_values" + isa, BM_values<Eigen::half, Phases>, 1);
  add("decode_phase_values" + isa, BM_values<attn::BlockQ8_0, Phases>, 2);
  add("decode_phase_values" + isa, BM_values<attn::BlockQ4_0, Phases>, 3);
}

void register_all() {
#if ATTN_X86_DISPATCH
  register_isa<avx2_phases::Phases>();
  register_isa<avx512_phases::Phases>();
  if (attn::isa_supported(attn::Isa::avx512_vnni)) {
    add("decode_phase_scores_int8", BM_scores_int8<attn::BlockQ8_0>, 2);
    add("decode_phase_scores_int8", BM_scores_int8<attn::BlockQ4_0>, 3);
  }
#endif
  attn_bench::register_fma_peak();
  attn_bench::register_int8_dot_peak();
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, register_all);
}
