// bench/bench_multihead.cpp: MultiHeadAttention forward beside the GEMMs it is made of.
//
// Shapes (the QKV-projection tutorial's batch): B = 8, S = 512, E = 768, H = 12, D = 64.
//   fma_peak         the FMA probe of the widest instruction set the CPU has (common.hpp)
//   mha_forward      the whole forward (self-attention, fused QKV, no weights returned)
//   qkv_gemm         (B*S, E) x (E, 3E) = (4096 x 768) x (768 x 2304), as in pass 1: attn's
//                    GEMM on the instruction set chosen at run time (kernels/gemm.hpp)
//   attention_only   scaled_dot_product_attention_into on the strided head views of a fused
//                    (B, S, 3E) buffer, writing (B, S, E): pass 2
//   out_proj_gemm    (B*S, E) x (E, E) = (4096 x 768) x (768 x 768): pass 3, attn's GEMM
//   eigen_qkv_gemm, eigen_out_proj_gemm   the same products with Eigen's GEMM, compiled for
//                    this binary's flags (what the projections ran before attn had its own)
// All report FLOP/s (kIsIterationInvariantRate); buffers are allocated outside the timed
// loop. Before timing, the forward is checked against the composition of the three parts.
// The fraction of time in projections vs attention is (qkv_gemm + out_proj_gemm) vs
// attention_only, compared with mha_forward.
//
// ATTN_BENCH_SMOKE=1 (set by ctest) shrinks the problem to B = 2, S = 32, E = 64, H = 4.
// Threads: OMP_NUM_THREADS (Eigen's GEMM and the attention loop both use OpenMP).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "attn/attention.hpp"
#include "attn/cpu.hpp"
#include "attn/kernels/dispatch.hpp"
#include "attn/multihead.hpp"
#include "attn/projection.hpp"

#include "common.hpp"

namespace {

using attn::Index;
using T = float;

struct Shape {
  Index batch, seq, embed, heads;
  Index head_dim() const { return embed / heads; }
  double rows() const { return static_cast<double>(batch * seq); }
  double qkv_flops() const { return 2.0 * rows() * static_cast<double>(embed * 3 * embed); }
  double attention_flops() const {  // q k^T and p v
    return 4.0 * static_cast<double>(batch * heads * seq * seq * head_dim());
  }
  double out_flops() const { return 2.0 * rows() * static_cast<double>(embed * embed); }
};

Shape shape() {
  const char* smoke = std::getenv("ATTN_BENCH_SMOKE");
  if (smoke != nullptr && std::string(smoke) == "1")
    return {2, 32, 64, 4};
  return {8, 512, 768, 12};
}

attn::Tensor<T, 3> random_input(const Shape& s) {
  std::mt19937 engine(1);
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

/// The parts, exactly as timed below: QKV GEMM, attention on views, output GEMM.
void compose(const attn::MultiHeadAttention<T>& mha, const attn::Tensor<T, 3>& x,
             attn::Matrix<T>& qkv, attn::Matrix<T>& attn_out, attn::Matrix<T>& y, const Shape& s) {
  const Index n = s.batch * s.seq, e = s.embed, d = s.head_dim();
  const attn::ConstRowsMap<T> xr(x.data(), n, e, Eigen::OuterStride<>(e));
  qkv.noalias() = xr * mha.in_proj().fused_weight();  // biases are zero
  const auto view = [&](Index offset) {
    return attn::HeadsView<const T>{qkv.data() + offset, s.batch, s.heads, s.seq, d,
                                    s.seq * 3 * e,       d,       3 * e};
  };
  attn::scaled_dot_product_attention_into<T>(
      view(0), view(e), view(2 * e), attn::blhd_view(attn_out.data(), s.batch, s.seq, s.heads, d));
  y.noalias() = attn_out * mha.out_proj().weight();
}

void validate(const Shape& s) {
  const auto mha = make_mha(s);
  const attn::Tensor<T, 3> x = random_input(s);
  const auto out = mha.forward(x);
  const Index n = s.batch * s.seq;
  attn::Matrix<T> qkv(n, 3 * s.embed), attn_out(n, s.embed), y(n, s.embed);
  compose(mha, x, qkv, attn_out, y, s);
  double worst = 0;
  for (Index i = 0; i < y.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(out.output.data()[i] - y.data()[i])) /
                                std::max(1.0, static_cast<double>(std::abs(y.data()[i]))));
  }
  if (!(worst <= 1e-4)) {
    std::fprintf(stderr, "bench_multihead: forward and its parts disagree (%g)\n", worst);
    std::exit(EXIT_FAILURE);
  }
}

void label(benchmark::State& state, const Shape& s, double flops) {
  state.counters["FLOPS"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel("B=" + std::to_string(s.batch) + " S=" + std::to_string(s.seq) +
                 " E=" + std::to_string(s.embed) + " H=" + std::to_string(s.heads) +
                 " threads=" + std::to_string(attn::detail::max_threads()));
}

void mha_forward(benchmark::State& state) {
  const Shape s = shape();
  const auto mha = make_mha(s);
  const attn::Tensor<T, 3> x = random_input(s);
  attn::MultiHeadForwardOptions<T> options;
  attn::MultiHeadAttentionOutput<T> result;
  attn::MultiHeadWorkspace<T> workspace;
  mha.forward_into(x, x, x, options, result, workspace);  // sizes the buffers
  for (auto _ : state) {
    mha.forward_into(x, x, x, options, result, workspace);
    benchmark::DoNotOptimize(result.output.data());
    benchmark::ClobberMemory();
  }
  label(state, s, s.qkv_flops() + s.attention_flops() + s.out_flops());
}

/// (B*S, E) x (E, cols): attn's GEMM (on the active instruction set) or Eigen's.
void projection_gemm(benchmark::State& state, Index cols, bool eigen, double flops) {
  const Shape s = shape();
  const Index n = s.batch * s.seq;
  const attn::Matrix<T> x = attn::Matrix<T>::Random(n, s.embed);
  const attn::Matrix<T> w = attn::Matrix<T>::Random(s.embed, cols);
  attn::Matrix<T> y(n, cols);
  const attn::Isa isa = attn::active_isa();
  for (auto _ : state) {
    if (eigen)
      y.noalias() = x * w;
    else
      attn::detail::gemm(isa, n, cols, s.embed, x.data(), s.embed, w.data(), cols, y.data(), cols);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  label(state, s, flops);
}

void qkv_gemm(benchmark::State& state) {
  projection_gemm(state, 3 * shape().embed, false, shape().qkv_flops());
}
void eigen_qkv_gemm(benchmark::State& state) {
  projection_gemm(state, 3 * shape().embed, true, shape().qkv_flops());
}

void attention_only(benchmark::State& state) {
  const Shape s = shape();
  const Index n = s.batch * s.seq, e = s.embed, d = s.head_dim();
  const attn::Matrix<T> qkv = attn::Matrix<T>::Random(n, 3 * e);
  attn::Matrix<T> out(n, e);
  const auto view = [&](Index offset) {
    return attn::HeadsView<const T>{qkv.data() + offset, s.batch, s.heads, s.seq, d,
                                    s.seq * 3 * e,       d,       3 * e};
  };
  const attn::HeadsView<T> out_view = attn::blhd_view(out.data(), s.batch, s.seq, s.heads, d);
  for (auto _ : state) {
    attn::scaled_dot_product_attention_into<T>(view(0), view(e), view(2 * e), out_view);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  label(state, s, s.attention_flops());
}

void out_proj_gemm(benchmark::State& state) {
  projection_gemm(state, shape().embed, false, shape().out_flops());
}
void eigen_out_proj_gemm(benchmark::State& state) {
  projection_gemm(state, shape().embed, true, shape().out_flops());
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, [] {
    validate(shape());  // the forward must equal its parts before anything is timed
    attn_bench::register_fma_peak();
    benchmark::RegisterBenchmark("mha_forward", mha_forward)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("qkv_gemm", qkv_gemm)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("attention_only", attention_only)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("out_proj_gemm", out_proj_gemm)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("eigen_qkv_gemm", eigen_qkv_gemm)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("eigen_out_proj_gemm", eigen_out_proj_gemm)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  });
}
