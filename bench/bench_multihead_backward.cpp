// bench/bench_multihead_backward.cpp: MultiHeadAttention's training step, forward and
// backward, beside the plain forward.
//
// Shape: B = 4, S = 256, E = 512, H = 8 (D = 64), float, self-attention, not causal and
// causal (the second argument: 0, 1).
//   mha_forward        forward_into with a reused workspace (inference)
//   mha_forward_train  forward_train (the forward plus the copies the context keeps)
//   mha_backward       backward(context, doutput) of one forward_train made outside the loop
// The figure that matters is mha_backward's time over mha_forward's (docs/training.md).
//
// ATTN_BENCH_SMOKE=1 (set by ctest) shrinks the problem to B = 1, S = 16, E = 32, H = 4.
// Threads: OMP_NUM_THREADS (the figure in the docs is from one thread).
#include <benchmark/benchmark.h>

#include <random>
#include <string>
#include <utility>

#include "attn/multihead.hpp"

#include "common.hpp"

namespace {

using attn::Index;
using T = float;

struct Shape {
  Index batch, seq, embed, heads;
};

Shape shape() {
  if (attn_bench::smoke())
    return {1, 16, 32, 4};
  return {4, 256, 512, 8};
}

attn::Tensor<T, 3> random_tensor(const Shape& s, unsigned seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<T> normal(0, 1);
  attn::Tensor<T, 3> x(s.batch, s.seq, s.embed);
  for (Index i = 0; i < x.size(); ++i)
    x.data()[i] = normal(engine);
  return x;
}

attn::MultiHeadAttention<T> make_mha(const Shape& s) {
  attn::MultiHeadAttentionConfig c;
  c.embed_dim = s.embed;
  c.num_heads = s.heads;
  c.seed = 3;
  return attn::MultiHeadAttention<T>(c);
}

void label(benchmark::State& state, const Shape& s) {
  state.SetLabel("B=" + std::to_string(s.batch) + " S=" + std::to_string(s.seq) +
                 " E=" + std::to_string(s.embed) + " H=" + std::to_string(s.heads) +
                 (state.range(0) != 0 ? " causal" : "") +
                 " threads=" + std::to_string(attn::detail::max_threads()));
}

attn::MultiHeadForwardOptions<T> options(const benchmark::State& state) {
  attn::MultiHeadForwardOptions<T> o;
  o.is_causal = state.range(0) != 0;
  return o;
}

void mha_forward(benchmark::State& state) {
  const Shape s = shape();
  const auto mha = make_mha(s);
  const attn::Tensor<T, 3> x = random_tensor(s, 1);
  attn::MultiHeadAttentionOutput<T> out;
  attn::MultiHeadWorkspace<T> ws;
  const auto o = options(state);
  for (auto _ : state) {
    mha.forward_into(x, x, x, o, out, ws);
    benchmark::DoNotOptimize(out.output.data());
  }
  label(state, s);
}

void mha_forward_train(benchmark::State& state) {
  const Shape s = shape();
  const auto mha = make_mha(s);
  const attn::Tensor<T, 3> x = random_tensor(s, 1);
  const auto o = options(state);
  for (auto _ : state) {
    auto train = mha.forward_train(x, o);
    benchmark::DoNotOptimize(train.output.data());
  }
  label(state, s);
}

void mha_backward(benchmark::State& state) {
  const Shape s = shape();
  const auto mha = make_mha(s);
  const attn::Tensor<T, 3> x = random_tensor(s, 1), dy = random_tensor(s, 2);
  const auto train = mha.forward_train(x, options(state));
  for (auto _ : state) {
    auto g = mha.backward(train.context, dy);
    benchmark::DoNotOptimize(g.dquery.data());
  }
  label(state, s);
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, [] {
    attn_bench::register_fma_peak();
    for (const auto& [name, fn] : {std::pair{"mha_forward", &mha_forward},
                                   std::pair{"mha_forward_train", &mha_forward_train},
                                   std::pair{"mha_backward", &mha_backward}}) {
      benchmark::RegisterBenchmark(name, fn)
          ->Arg(0)
          ->Arg(1)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  });
}
