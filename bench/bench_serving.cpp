// bench/bench_serving.cpp: the serving state around the kernel: one decoding step of many
// sequences that share a prompt, and of many sequences held in pages.
//
//   q         (B, Hq, 1, D)      one new token per sequence, float
//   prefix    KVCache, batch 1   the shared prompt, N tokens
//   suffixes  KVCache, batch B   each sequence's own tokens after it, n tokens
//   whole     KVCache, batch B   prefix + suffix copied into every sequence (what a server
//                                without prefix sharing holds)
//
// Families (args B, N, n, threads; Hq 32, Hkv 8, D = Dv = 128, float):
//   shared_prefix   shared_prefix_attend_into: the prefix once for all B sequences (flash,
//                   the G B queries of a kv head as rows), each suffix by the decode kernel,
//                   merged (attn/shared_prefix.hpp)
//   per_sequence    KVCache::attend_into over `whole`: the decode kernel reads the prefix
//                   once per sequence
//   paged           PagedKVCache::attend_into, B sequences of N tokens each in pages of P
//                   (args B, N, P, threads), the pages of the B sequences interleaved in
//                   the pool (appended P tokens at a time, every sequence in turn)
//   contiguous      KVCache::attend_into over the same tokens (args B, N, 0, threads)
//   bandwidth       the streaming probe (a 512 MiB float array summed, one pass an
//                   iteration), the ceiling of per_sequence
//   fma_peak        the FMA probe (common.hpp), the ceiling of the prefix pass
// Counters: KV_bytes, the K/V bytes each call must read (the prefix once for shared_prefix,
// B times for per_sequence) as a rate; both results are checked against each other first
// (paged against contiguous likewise, bit for bit when P is a multiple of 64).
//
//   build/dev/bench/bench_serving --benchmark_filter='shared_prefix|per_sequence'
// ATTN_BENCH_SMOKE=1 (ctest) shrinks every size.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <attn/kv_cache.hpp>
#include <attn/paged_kv_cache.hpp>
#include <attn/shared_prefix.hpp>

#include "common.hpp"

namespace {

using attn::Index;
using attn_bench::BM_bandwidth;
using attn_bench::set_threads;
using attn_bench::smoke;

constexpr Index q_heads = 32, kv_heads = 8, dim = 128;

/// The caches of one problem, the same prefix in `prefix` and in every sequence of `whole`.
struct Serving {
  attn::KVCache<float> prefix, suffixes, whole;
  std::vector<float> q, out;
  Index batch;

  Serving(Index b, Index n_prefix, Index n_suffix)
      : prefix(1, kv_heads, dim, dim, n_prefix),
        suffixes(b, kv_heads, dim, dim, n_suffix),
        whole(b, kv_heads, dim, dim, n_prefix + n_suffix),
        q(static_cast<std::size_t>(b * q_heads * dim)),
        out(q.size()),
        batch(b) {
    std::vector<float> pk(static_cast<std::size_t>(kv_heads * n_prefix * dim)), pv(pk.size());
    std::vector<float> sk(static_cast<std::size_t>(b * kv_heads * n_suffix * dim)), sv(sk.size());
    attn_bench::fill_normal(pk, 1u);
    attn_bench::fill_normal(pv, 2u);
    attn_bench::fill_normal(sk, 3u);
    attn_bench::fill_normal(sv, 4u);
    attn_bench::fill_normal(q, 5u);
    const auto view = [](const std::vector<float>& x, Index sequences, Index length) {
      return attn::bhld_view(x.data(), sequences, kv_heads, length, dim);
    };
    prefix.append(view(pk, 1, n_prefix), view(pv, 1, n_prefix));
    suffixes.append(view(sk, b, n_suffix), view(sv, b, n_suffix));
    attn::HeadsView<const float> k = view(pk, 1, n_prefix), v = view(pv, 1, n_prefix);
    k.batch = v.batch = b;
    k.batch_stride = v.batch_stride = 0;  // every sequence copies the one prefix
    whole.append(k, v);
    whole.append(view(sk, b, n_suffix), view(sv, b, n_suffix));
  }

  attn::HeadsView<const float> queries() const {
    return attn::bhld_view(q.data(), batch, q_heads, 1, dim);
  }
  attn::HeadsView<float> output() { return attn::bhld_view(out.data(), batch, q_heads, 1, dim); }
};

void set_counters(benchmark::State& state, double kv_bytes) {
  state.counters["KV_bytes"] = benchmark::Counter(
      kv_bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
}

/// The sizes of a run: B, N, n (shrunk under ATTN_BENCH_SMOKE).
struct Sizes {
  Index batch, prefix, suffix;
};
Sizes sizes_of(const benchmark::State& state) {
  if (smoke())
    return {2, 64, 8};
  return {state.range(0), state.range(1), state.range(2)};
}

/// Throws unless the two ways agree (run once, before timing).
void check_agreement(Serving& s) {
  std::vector<float> expected(s.out.size());
  s.whole.attend_into(s.queries(), attn::bhld_view(expected.data(), s.batch, q_heads, 1, dim));
  attn::shared_prefix_attend_into(s.prefix, s.suffixes, s.queries(), s.output());
  float worst = 0;
  for (std::size_t n = 0; n < expected.size(); ++n)
    worst = std::max(worst, std::abs(expected[n] - s.out[n]));
  if (!(worst <= 1e-5f))
    throw std::runtime_error("bench_serving: shared_prefix and per_sequence disagree");
}

void BM_shared_prefix(benchmark::State& state) {
  const Sizes z = sizes_of(state);
  set_threads(static_cast<int>(state.range(3)));
  Serving s(z.batch, z.prefix, z.suffix);
  check_agreement(s);
  for (auto _ : state) {
    attn::shared_prefix_attend_into(s.prefix, s.suffixes, s.queries(), s.output());
    benchmark::ClobberMemory();
  }
  set_counters(state, 2.0 * kv_heads * dim * sizeof(float) *
                          static_cast<double>(z.prefix + z.batch * z.suffix));
}

void BM_per_sequence(benchmark::State& state) {
  const Sizes z = sizes_of(state);
  set_threads(static_cast<int>(state.range(3)));
  Serving s(z.batch, z.prefix, z.suffix);
  check_agreement(s);
  for (auto _ : state) {
    s.whole.attend_into(s.queries(), s.output());
    benchmark::ClobberMemory();
  }
  set_counters(state, 2.0 * kv_heads * dim * sizeof(float) *
                          static_cast<double>(z.batch * (z.prefix + z.suffix)));
}

/// B sequences of N tokens, in a KVCache and in a PagedKVCache with pages of P (P = 0: none).
struct Decoding {
  attn::KVCache<float> contiguous;
  attn::PagedKVCache<float> paged;
  std::vector<Index> ids;
  std::vector<float> q, out;
  Index batch;

  Decoding(Index b, Index length, Index page_size)
      : contiguous(b, kv_heads, dim, dim, page_size == 0 ? length : 0),
        paged(kv_heads, dim, dim, std::max(page_size, Index(1)),
              page_size == 0 ? 0 : b * ((length + page_size - 1) / page_size)),
        q(static_cast<std::size_t>(b * q_heads * dim)),
        out(q.size()),
        batch(b) {
    std::vector<float> k(static_cast<std::size_t>(b * kv_heads * length * dim)), v(k.size());
    attn_bench::fill_normal(k, 6u);
    attn_bench::fill_normal(v, 7u);
    attn_bench::fill_normal(q, 8u);
    const attn::HeadsView<const float> all_k = attn::bhld_view(k.data(), b, kv_heads, length, dim);
    const attn::HeadsView<const float> all_v = attn::bhld_view(v.data(), b, kv_heads, length, dim);
    if (page_size == 0) {
      contiguous.append(all_k, all_v);
      return;
    }
    for (Index s = 0; s < b; ++s)
      ids.push_back(paged.add_sequence());
    for (Index t = 0; t < length; t += page_size) {  // P tokens of every sequence in turn
      attn::HeadsView<const float> kt = all_k, vt = all_v;
      kt.data += t * dim;
      vt.data += t * dim;
      kt.length = vt.length = std::min(page_size, length - t);
      paged.append(ids, kt, vt);
    }
    if (smoke())  // the two agree (checked once, on the small sizes)
      contiguous.append(all_k, all_v);
  }

  attn::HeadsView<const float> queries() const {
    return attn::bhld_view(q.data(), batch, q_heads, 1, dim);
  }
  attn::HeadsView<float> output() { return attn::bhld_view(out.data(), batch, q_heads, 1, dim); }
};

void BM_decoding(benchmark::State& state) {
  const bool paged = state.range(2) > 0;
  const Index batch = smoke() ? 2 : state.range(0), length = smoke() ? 300 : state.range(1);
  const Index page_size = smoke() && paged ? 64 : state.range(2);
  set_threads(static_cast<int>(state.range(3)));
  Decoding d(batch, length, page_size);
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::decode;
  if (paged && smoke()) {
    std::vector<float> expected(d.out.size());
    d.contiguous.attend_into(d.queries(), attn::bhld_view(expected.data(), batch, q_heads, 1, dim),
                             options);
    d.paged.attend_into(d.ids, d.queries(), d.output(), options);
    if (expected != d.out)
      throw std::runtime_error("bench_serving: paged and contiguous decoding differ");
  }
  for (auto _ : state) {
    if (paged)
      d.paged.attend_into(d.ids, d.queries(), d.output(), options);
    else
      d.contiguous.attend_into(d.queries(), d.output(), options);
    benchmark::ClobberMemory();
  }
  set_counters(state, 2.0 * kv_heads * dim * sizeof(float) * static_cast<double>(batch * length));
}

void register_benchmarks() {
  attn_bench::register_fma_peak();
  benchmark::RegisterBenchmark("bandwidth", BM_bandwidth)
      ->ArgName("threads")
      ->Arg(1)
      ->Arg(2)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  for (const auto& [name, function] : {std::pair{"shared_prefix", &BM_shared_prefix},
                                       std::pair{"per_sequence", &BM_per_sequence}}) {
    auto* b = benchmark::RegisterBenchmark(name, function)
                  ->ArgNames({"B", "N", "n", "threads"})
                  ->UseRealTime()
                  ->Unit(benchmark::kMillisecond);
    for (const int threads : {1, 2}) {
      for (const Index suffix : {64, 512})
        b->Args({16, 4096, suffix, threads});
    }
  }
  for (const char* name : {"contiguous", "paged"}) {
    auto* b = benchmark::RegisterBenchmark(name, BM_decoding)
                  ->ArgNames({"B", "N", "P", "threads"})
                  ->UseRealTime()
                  ->Unit(benchmark::kMillisecond);
    for (const int threads : {1, 2}) {
      if (name == std::string("contiguous")) {
        b->Args({16, 4096, 0, threads});
      } else {
        for (const Index page_size : {16, 64, 128})
          b->Args({16, 4096, page_size, threads});
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, register_benchmarks);
}
