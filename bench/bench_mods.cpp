// bench/bench_mods.cpp: programmable attention (attn/mods.hpp) against the built-in options
// and the dense masks it replaces, in one run.
//
//   q, k, v  (1, H, L, 64) float, flash, one thread unless said
//
// Families (ratios are read between rows of one run):
//   causal/<form>/L:<L>          H = 8. form 0: the option Causal::top_left; 1: the
//                                gallery's causal mask_mod with a BlockMask; 2: the same
//                                mask_mod without a block mask (every tile evaluated)
//   document/<form>/docs:<k>     T = 8192, H = 2, k equal documents. form 0: a dense (T, T)
//                                keep-mask; 1: the gallery's document mask_mod with a
//                                BlockMask; 2: packed sequences (packed_view()), for comparison
//   bias/<form>/L:<L>            H = 8. form 0: no mod; 1: a score_mod adding a per-head
//                                table bias by relative position (T5's, 32 buckets);
//                                2: ALiBi as a score_mod; 3: the option alibi_slopes
//   block_mask/L:<L>             building the causal BlockMask (128 x 128 blocks) once
//   tile_loop/<mod>/<loop>       one 128 x 256 column-major tile of scores through a mod
//                                (mod 0: T5's table bias, 1: ALiBi), items = scores. loop 0:
//                                ScoreMod::apply, the loop of the active instruction set;
//                                1: the same, forced generic; 2: a plain loop compiled
//                                with this file's flags (the callable inlined); 3: one
//                                std::function call per score
// FLOPS counts the visible pairs' two products (4 D per pair), so forms compare directly.
//
//   build/dev/bench/bench_mods --benchmark_filter=document
// ATTN_BENCH_SMOKE=1 (ctest) shrinks every size.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/block_mask.hpp>
#include <attn/cpu.hpp>
#include <attn/mod_gallery.hpp>

#include "common.hpp"

namespace {

using attn::Index;
using attn_bench::smoke;

constexpr Index dim = 64;

struct Problem {
  Index heads, length;
  std::vector<float> q, k, v, out;
  Problem(Index h, Index l)
      : heads(h),
        length(l),
        q(static_cast<std::size_t>(h * l * dim)),
        k(q.size()),
        v(q.size()),
        out(q.size()) {
    attn_bench::fill_normal(q, 1u);
    attn_bench::fill_normal(k, 2u);
    attn_bench::fill_normal(v, 3u);
  }
  attn::HeadsView<const float> view(const std::vector<float>& x) const {
    return attn::bhld_view(x.data(), 1, heads, length, dim);
  }
  void run(const attn::AttentionOptions<float>& options) {
    attn::scaled_dot_product_attention_into<float>(
        view(q), view(k), view(v), attn::bhld_view(out.data(), 1, heads, length, dim), options);
  }
};

void time(benchmark::State& state, Problem& p, const attn::AttentionOptions<float>& options,
          double visible_pairs_per_head) {
  p.run(options);  // the first touch of every buffer outside the timing
  for (auto _ : state) {
    p.run(options);
    benchmark::DoNotOptimize(p.out.data());
  }
  state.counters["FLOPS"] =
      benchmark::Counter(4.0 * dim * visible_pairs_per_head * static_cast<double>(p.heads),
                         benchmark::Counter::kIsIterationInvariantRate);
}

void BM_causal(benchmark::State& state) {
  const int form = static_cast<int>(state.range(0));
  const Index length = state.range(1);
  Problem p(8, length);
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  if (form == 0)
    options.causal = attn::Causal::top_left;
  else if (form == 1)
    options.block_mask =
        attn::BlockMask(attn::MaskMod(attn::gallery::causal()), 1, 1, length, length);
  else
    options.mask_mod = attn::MaskMod(attn::gallery::causal());
  const double l = static_cast<double>(length);
  time(state, p, options, l * (l + 1) / 2);
}

void BM_document(benchmark::State& state) {
  const int form = static_cast<int>(state.range(0));
  const Index documents = state.range(1), length = smoke() ? 512 : 8192;
  const Index document_length = length / documents;
  Problem p(2, length);
  std::vector<Index> ids(static_cast<std::size_t>(length));
  for (Index i = 0; i < length; ++i)
    ids[static_cast<std::size_t>(i)] = i / document_length;
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  attn::Tensor<bool, 2> keep;
  if (form == 0) {
    keep.resize(length, length);
    for (Index i = 0; i < length; ++i)
      for (Index j = 0; j < length; ++j)
        keep(i, j) = ids[static_cast<std::size_t>(i)] == ids[static_cast<std::size_t>(j)];
    options.keep_mask = keep;
  } else if (form == 1) {
    options.block_mask =
        attn::BlockMask(attn::MaskMod(attn::gallery::document(ids)), 1, 1, length, length);
  }
  const double visible = static_cast<double>(documents) * static_cast<double>(document_length) *
                         static_cast<double>(document_length);
  if (form == 2) {  // the documents as packed sequences
    std::vector<Index> offsets;
    for (Index d = 0; d <= documents; ++d)
      offsets.push_back(d * document_length);
    const auto in = [&](const std::vector<float>& x) {  // (T, H, D) as a packed view
      return attn::packed_view(attn::blhd_view(x.data(), 1, length, p.heads, dim), offsets);
    };
    const auto out =
        attn::packed_view(attn::blhd_view(p.out.data(), 1, length, p.heads, dim), offsets);
    const auto run = [&] {
      attn::scaled_dot_product_attention_into<float>(in(p.q), in(p.k), in(p.v), out, options);
    };
    run();
    for (auto _ : state) {
      run();
      benchmark::DoNotOptimize(p.out.data());
    }
    state.counters["FLOPS"] = benchmark::Counter(4.0 * dim * visible * static_cast<double>(p.heads),
                                                 benchmark::Counter::kIsIterationInvariantRate);
    return;
  }
  time(state, p, options, visible);
}

void BM_bias(benchmark::State& state) {
  const int form = static_cast<int>(state.range(0));
  const Index length = state.range(1), heads = 8;
  Problem p(heads, length);
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  const std::vector<float> slopes = attn::alibi_slopes<float>(heads);
  if (form == 1) {
    std::vector<float> table(static_cast<std::size_t>(32 * heads));
    attn_bench::fill_normal(table, 5u);
    options.score_mod = attn::ScoreMod<float>(
        attn::gallery::t5_relative_bias<float>(table, heads, length, /*bidirectional=*/true));
  } else if (form == 2) {
    options.score_mod = attn::ScoreMod<float>(attn::gallery::alibi<float>(slopes));
  } else if (form == 3) {
    options.alibi_slopes = slopes;
  }
  const double l = static_cast<double>(length);
  time(state, p, options, l * l);
}

void BM_block_mask(benchmark::State& state) {
  const Index length = state.range(0);
  for (auto _ : state) {
    attn::BlockMask m(attn::MaskMod(attn::gallery::causal()), 1, 1, length, length);
    benchmark::DoNotOptimize(&m);
  }
}

void BM_tile_loop(benchmark::State& state) {
  const int mod = static_cast<int>(state.range(0)), loop = static_cast<int>(state.range(1));
  const Index rows = 128, cols = 256, heads = 8, length = 4096;
  std::vector<float> table(static_cast<std::size_t>(32 * heads));
  attn_bench::fill_normal(table, 5u);
  const auto t5 = attn::gallery::t5_relative_bias<float>(table, heads, length, true);
  const auto alibi = attn::gallery::alibi<float>(attn::alibi_slopes<float>(heads));
  const std::function<float(float, Index, Index, Index, Index)> f =
      mod == 0 ? std::function<float(float, Index, Index, Index, Index)>(t5)
               : std::function<float(float, Index, Index, Index, Index)>(alibi);
  const attn::ScoreMod<float> score_mod =
      mod == 0 ? attn::ScoreMod<float>(t5) : attn::ScoreMod<float>(alibi);
  std::vector<float> scores(static_cast<std::size_t>(rows * cols));
  attn_bench::fill_normal(scores, 6u);
  std::optional<attn::ScopedIsa> forced;
  if (loop == 1)
    forced.emplace(attn::Isa::generic);
  Index step = 0;
  const auto plain = [&](const auto& g, Index h, Index i0, Index j0) {
    for (Index c = 0; c < cols; ++c) {
      float* column = scores.data() + c * rows;
      for (Index r = 0; r < rows; ++r)
        column[r] = g(column[r], 0, h, i0 + r, j0 + c);
    }
  };
  for (auto _ : state) {
    const Index h = step % heads, i0 = 1024 + (step % 5) * 128, j0 = 1024 + (step % 7) * 64;
    ++step;
    if (loop <= 1) {
      score_mod.apply(attn::ScoreTile<float>{scores.data(), rows, cols, 1, rows, 0, h, i0, j0});
    } else if (loop == 2) {
      if (mod == 0)
        plain(t5, h, i0, j0);
      else
        plain(alibi, h, i0, j0);
    } else {
      plain(f, h, i0, j0);
    }
    benchmark::DoNotOptimize(scores.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * rows * cols);
}

void register_all() {
  attn_bench::register_fma_peak();
  const std::int64_t l = smoke() ? 256 : 4096;
  benchmark::RegisterBenchmark("causal", BM_causal)
      ->ArgNames({"form", "L"})
      ->ArgsProduct({{0, 1, 2}, {l}})
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  benchmark::RegisterBenchmark("document", BM_document)
      ->ArgNames({"form", "docs"})
      ->ArgsProduct({{0, 1, 2},
                     smoke() ? std::vector<std::int64_t>{4} : std::vector<std::int64_t>{4, 16, 64}})
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  benchmark::RegisterBenchmark("bias", BM_bias)
      ->ArgNames({"form", "L"})
      ->ArgsProduct({{0, 1, 2, 3}, {smoke() ? 256 : 2048}})
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  benchmark::RegisterBenchmark("tile_loop", BM_tile_loop)
      ->ArgNames({"mod", "loop"})
      ->ArgsProduct({{0, 1}, {0, 1, 2, 3}});
  benchmark::RegisterBenchmark("block_mask", BM_block_mask)
      ->ArgNames({"L"})
      ->Args({smoke() ? 256 : 8192})
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, register_all);
}
