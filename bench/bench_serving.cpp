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
//   mla/<format>    LatentCache::attend_into, one decoding step of DeepSeek-V2-Lite's
//                   attention (args B, N, threads): H = 16 query heads against one latent kv
//                   head of C = 512 + R = 64 values a token (V the first 512 columns of the
//                   same rows), Lq = 1, pages of 64 filled 64 tokens of every sequence in
//                   turn, stored as float or half; KV_bytes = B N (C + R) sizeof(S), the rows
//                   a call reads (once: V is not read again from memory), and FLOPS =
//                   2 B N H (2 C + R), the decode kernel's multiply-adds
//   mla_step        the same step with the absorbed projections around it (float; P = 128,
//                   Dv = 128): mla_absorb_queries, LatentCache::attend_into,
//                   mla_project_output
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

#include <attn/attention.hpp>
#include <attn/kv_cache.hpp>
#include <attn/latent_cache.hpp>
#include <attn/mla.hpp>
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

// --- MLA ---------------------------------------------------------------------------------

constexpr Index mla_heads = 16, mla_latent = 512, mla_rope = 64, mla_nope = 128, mla_value = 128;

/// B sequences of N tokens in a LatentCache<S> with pages of 64, the pages of the sequences
/// interleaved in the pool, and one new token's absorbed queries (B, 16, 1, C + R).
template <class S>
struct MlaDecoding {
  attn::LatentCache<S> cache;
  std::vector<Index> ids;
  std::vector<float> rows;  // (chunk, C + R): the tokens appended, again and again
  std::vector<float> q, out;
  Index batch, length;
  static constexpr Index page = 64, chunk = 4096;

  MlaDecoding(Index b, Index n)
      : cache(mla_latent, mla_rope, page, b * ((n + page - 1) / page), false),
        rows(static_cast<std::size_t>(chunk * (mla_latent + mla_rope))),
        q(static_cast<std::size_t>(b * mla_heads * (mla_latent + mla_rope))),
        out(static_cast<std::size_t>(b * mla_heads * mla_latent)),
        batch(b),
        length(n) {
    attn_bench::fill_normal(rows, 9u);
    attn_bench::fill_normal(q, 10u);
    for (float& x : q)
      x *= 0.05f;  // scores of a few units: a softmax neither flat nor one-hot
    for (Index s = 0; s < b; ++s)
      ids.push_back(cache.add_sequence());
    for (Index t = 0; t < n; t += page) {  // 64 tokens of every sequence in turn
      const Index count = std::min(page, n - t), first = t % chunk;
      const auto part = [&](Index column, Index width) {
        attn::HeadsView<const float> v =
            attn::bhld_view(rows.data() + first * (mla_latent + mla_rope) + column, Index(1),
                            Index(1), count, width);
        v.row_stride = v.head_stride = mla_latent + mla_rope;
        v.batch = b;
        v.batch_stride = 0;  // every sequence takes the same rows
        return v;
      };
      cache.append(ids, part(0, mla_latent), part(mla_latent, mla_rope));
    }
  }

  attn::HeadsView<const float> queries() const {
    return attn::bhld_view(q.data(), batch, mla_heads, Index(1), mla_latent + mla_rope);
  }
  attn::HeadsView<float> output() {
    return attn::bhld_view(out.data(), batch, mla_heads, Index(1), mla_latent);
  }
  static attn::AttentionOptions<float> options() {
    attn::AttentionOptions<float> o;
    o.scale = 1.0f / std::sqrt(static_cast<float>(mla_nope + mla_rope));
    return o;
  }

  /// Throws unless the cache equals attention over one contiguous buffer of the same rows
  /// whose V is a view of K (bit for bit: pages of 64 cut the decode blocks alike).
  void check() {
    const Index row = mla_latent + mla_rope;
    std::vector<S> k(static_cast<std::size_t>(batch * length * row));
    for (Index s = 0; s < batch; ++s) {
      for (Index t = 0; t < length; ++t) {
        for (Index x = 0; x < row; ++x)
          k[static_cast<std::size_t>((s * length + t) * row + x)] =
              static_cast<S>(rows[static_cast<std::size_t>((t % chunk) * row + x)]);
      }
    }
    const attn::HeadsView<const S> keys = attn::bhld_view(k.data(), batch, Index(1), length, row);
    attn::HeadsView<const S> values = keys;
    values.dim = mla_latent;
    std::vector<float> expected(out.size());
    attn::AttentionOptions<float> o = options();
    o.algorithm = attn::Algorithm::decode;
    attn::scaled_dot_product_attention_into<float, S>(
        queries(), keys, values,
        attn::bhld_view(expected.data(), batch, mla_heads, Index(1), mla_latent), o);
    cache.attend_into(ids, queries(), output(), o);
    if (expected != out)
      throw std::runtime_error("bench_serving: the latent cache and the contiguous buffer differ");
  }
};

void set_mla_counters(benchmark::State& state, Index batch, Index length, double element_bytes) {
  const auto tokens = static_cast<double>(batch * length);
  set_counters(state, tokens * (mla_latent + mla_rope) * element_bytes);
  state.counters["FLOPS"] =
      benchmark::Counter(2.0 * tokens * mla_heads * (2 * mla_latent + mla_rope),
                         benchmark::Counter::kIsIterationInvariantRate);
}

template <class S>
void BM_mla(benchmark::State& state) {
  const Index batch = smoke() ? 2 : state.range(0), length = smoke() ? 300 : state.range(1);
  set_threads(static_cast<int>(state.range(2)));
  MlaDecoding<S> d(batch, length);
  if (smoke())
    d.check();
  const attn::AttentionOptions<float> options = MlaDecoding<S>::options();
  for (auto _ : state) {
    d.cache.attend_into(d.ids, d.queries(), d.output(), options);
    benchmark::ClobberMemory();
  }
  set_mla_counters(state, batch, length, sizeof(S));
}

void BM_mla_step(benchmark::State& state) {
  const Index batch = smoke() ? 2 : state.range(0), length = smoke() ? 300 : state.range(1);
  set_threads(static_cast<int>(state.range(2)));
  MlaDecoding<float> d(batch, length);
  const auto weights = [](Index heads, Index rows, Index cols, unsigned seed) {
    std::vector<float> w(static_cast<std::size_t>(heads * rows * cols));
    attn_bench::fill_normal(w, seed);
    for (float& x : w)
      x /= std::sqrt(static_cast<float>(rows));
    return w;
  };
  const std::vector<float> w_uk = weights(mla_heads, mla_nope, mla_latent, 11u);
  const std::vector<float> w_uv = weights(mla_heads, mla_latent, mla_value, 12u);
  std::vector<float> q_nope(static_cast<std::size_t>(batch * mla_heads * mla_nope));
  std::vector<float> q_rope(static_cast<std::size_t>(batch * mla_heads * mla_rope));
  std::vector<float> out(static_cast<std::size_t>(batch * mla_heads * mla_value));
  attn_bench::fill_normal(q_nope, 13u);
  attn_bench::fill_normal(q_rope, 14u);
  const auto heads = [&](std::vector<float>& x, Index width) {
    return attn::bhld_view(x.data(), batch, mla_heads, Index(1), width);
  };
  const attn::AttentionOptions<float> options = MlaDecoding<float>::options();
  for (auto _ : state) {
    attn::mla_absorb_queries_into<float>(
        heads(q_nope, mla_nope), heads(q_rope, mla_rope),
        attn::TensorMap<const float, 3>(w_uk.data(), mla_heads, mla_nope, mla_latent),
        heads(d.q, mla_latent + mla_rope));
    d.cache.attend_into(d.ids, d.queries(), d.output(), options);
    attn::mla_project_output_into<float>(
        heads(d.out, mla_latent),
        attn::TensorMap<const float, 3>(w_uv.data(), mla_heads, mla_latent, mla_value),
        heads(out, mla_value));
    benchmark::ClobberMemory();
  }
  set_mla_counters(state, batch, length, sizeof(float));
}

void register_mla() {
  for (const auto& [name, function] :
       {std::pair{"mla/float", &BM_mla<float>}, std::pair{"mla/half", &BM_mla<Eigen::half>},
        std::pair{"mla_step", &BM_mla_step}}) {
    auto* b = benchmark::RegisterBenchmark(name, function)
                  ->ArgNames({"B", "N", "threads"})
                  ->UseRealTime()
                  ->Unit(benchmark::kMillisecond);
    for (const int threads : {1, 2}) {
      for (const Index batch : {1, 4}) {
        for (const Index length : {4096, 32768})
          b->Args({batch, length, threads});
      }
    }
  }
}

void register_benchmarks() {
  attn_bench::register_fma_peak();
  attn_bench::on_one_and_two_threads(benchmark::RegisterBenchmark("bandwidth", BM_bandwidth));
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
  register_mla();
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, register_benchmarks);
}
