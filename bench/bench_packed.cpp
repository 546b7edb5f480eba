// bench/bench_packed.cpp: packed variable-length batches and ragged KV caches.
//
//   packed   q, k, v (T, H, D) float, k documents of T / k tokens each, causal within each
//            document; H = 4, D = 64
//
// Families (ratios are read between rows of one run):
//   documents/<form>/k:<k>        the same k-document problem at T = 8192 as
//                                 form 0: one packed call (scaled_dot_product_attention_into
//                                         on packed_view()s)
//                                 form 1: one call with a dense (T, T) keep-mask of the
//                                         documents and Causal::top_left (what attn offered
//                                         before: T^2 bytes, every tile on the diagonal band
//                                         computed and masked element by element)
//                                 form 2: k separate calls, one per document
//   documents_backward/<form>/k:<k>  the backward of the same problem:
//                                 form 0: one packed call (the backward on packed_view()s)
//                                 form 2: k separate backward calls, one per document
//   kv_ragged/<form>/Lq:<Lq>      KVCache::attend over B = 8 sequences of 100 .. 4000 tokens
//                                 (Hq = 8, Hkv = 2, D = 128), 2 threads:
//                                 form 0: one call (per-sequence bottom-right alignment)
//                                 form 1: the loop it replaces, one call per sequence
// FLOPs are counted for the visible scores only (4 * D per visible (query, key) pair), so the
// forms of one problem report the same useful work. Each benchmark checks its result against
// the packed call before timing.
//
//   build/dev/bench/bench_packed --benchmark_filter=documents
// ATTN_BENCH_SMOKE=1 (ctest) shrinks every size.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/attention_backward.hpp>
#include <attn/kv_cache.hpp>

#include "common.hpp"

namespace {

using attn::Index;
using attn_bench::set_threads;
using attn_bench::smoke;

/// cu_seqlens of `documents` documents of `per_document` tokens each.
std::vector<Index> document_offsets(Index documents, Index per_document) {
  std::vector<Index> offsets{0};
  for (Index d = 0; d < documents; ++d)
    offsets.push_back(offsets.back() + per_document);
  return offsets;
}

/// (T, H, D) tokens as the packed view of the documents `offsets` describes (const vectors
/// give views of const float).
template <class Vector>
auto packed_tokens(Vector& x, Index heads, Index dim, const std::vector<Index>& offsets) {
  return attn::packed_view(attn::blhd_view(x.data(), 1, offsets.back(), heads, dim), offsets);
}

enum class DocumentForm : std::int64_t { packed = 0, dense_keep_mask = 1, per_document = 2 };

void BM_documents(benchmark::State& state) {
  const auto form = static_cast<DocumentForm>(state.range(0));
  const Index documents = state.range(1);
  const Index tokens = smoke() ? 512 : 8192, heads = 4, dim = 64;
  const Index per_document = tokens / documents;
  set_threads(1);
  std::vector<float> q(static_cast<std::size_t>(tokens * heads * dim)), k(q.size()), v(q.size()),
      out(q.size()), expected(q.size());
  attn_bench::fill_normal(q, 1u);
  attn_bench::fill_normal(k, 2u);
  attn_bench::fill_normal(v, 3u);
  const std::vector<Index> offsets = document_offsets(documents, per_document);
  const auto all = [&](const std::vector<float>& x) {
    return attn::blhd_view(x.data(), 1, tokens, heads, dim);
  };
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::bottom_right;  // within each document
  const auto packed = [&](auto& x) { return packed_tokens(x, heads, dim, offsets); };
  attn::scaled_dot_product_attention_into<float>(packed(q), packed(k), packed(v), packed(expected),
                                                 options);

  attn::Tensor<bool, 4> keep;  // (1, 1, T, T): same document
  attn::AttentionOptions<float> dense;
  if (form == DocumentForm::dense_keep_mask) {
    keep.resize(1, 1, tokens, tokens);
    for (Index i = 0; i < tokens; ++i)
      for (Index j = 0; j < tokens; ++j)
        keep(0, 0, i, j) = i / per_document == j / per_document;
    dense.keep_mask = keep;
    dense.causal = attn::Causal::top_left;
  }
  const auto run = [&] {
    const auto out_view = attn::blhd_view(out.data(), 1, tokens, heads, dim);
    switch (form) {
      case DocumentForm::packed:
        attn::scaled_dot_product_attention_into<float>(packed(q), packed(k), packed(v), packed(out),
                                                       options);
        break;
      case DocumentForm::dense_keep_mask:
        attn::scaled_dot_product_attention_into<float>(all(q), all(k), all(v), out_view, dense);
        break;
      case DocumentForm::per_document:
        for (Index d = 0; d < documents; ++d) {
          const auto part = [&](auto* data) {
            return attn::blhd_view(data + d * per_document * heads * dim, 1, per_document, heads,
                                   dim);
          };
          attn::scaled_dot_product_attention_into<float>(
              part(static_cast<const float*>(q.data())), part(static_cast<const float*>(k.data())),
              part(static_cast<const float*>(v.data())), part(out.data()), options);
        }
        break;
    }
  };
  run();
  const float error = attn_bench::max_abs_diff(out.data(), expected.data(), out.size());
  if (!(error <= 1e-4f)) {
    attn_bench::fail_check(state, ("differs from the packed call by " + std::to_string(error)));
    return;
  }
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(out.data());
  }
  const double pairs = static_cast<double>(documents) * static_cast<double>(per_document) *
                       static_cast<double>(per_document + 1) / 2;
  state.counters["FLOPS"] = benchmark::Counter(4.0 * static_cast<double>(dim * heads) * pairs,
                                               benchmark::Counter::kIsIterationInvariantRate);
}

void BM_documents_backward(benchmark::State& state) {
  const bool one_packed_call = state.range(0) == 0;
  const Index documents = state.range(1);
  const Index tokens = smoke() ? 512 : 8192, heads = 4, dim = 64;
  const Index per_document = tokens / documents;
  const auto size = static_cast<std::size_t>(tokens * heads * dim);
  set_threads(1);
  std::vector<float> q(size), k(size), v(size), dout(size), out(size), lse(size / dim);
  std::vector<float> dq(size), dk(size), dv(size), expected_dq(size), expected_dk(size),
      expected_dv(size), document_lse(size / dim);
  attn_bench::fill_normal(q, 1u);
  attn_bench::fill_normal(k, 2u);
  attn_bench::fill_normal(v, 3u);
  attn_bench::fill_normal(dout, 4u);
  const std::vector<Index> offsets = document_offsets(documents, per_document);
  // Document d's rows of a (T, H, D) tensor, and its (1, H, n) log-sum-exp.
  const auto part = [&](auto* data, Index d) {
    return attn::blhd_view(data + d * per_document * heads * dim, 1, per_document, heads, dim);
  };
  const auto cpart = [&](const std::vector<float>& x, Index d) { return part(x.data(), d); };
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::bottom_right;  // within each document
  const auto packed = [&](auto& x) { return packed_tokens(x, heads, dim, offsets); };
  const attn::RowsView<float> packed_lse =
      attn::packed_view(attn::bhl_view(lse.data(), 1, heads, tokens), offsets);
  attn::scaled_dot_product_attention_into<float>(packed(q), packed(k), packed(v),
                                                 {packed(out), packed_lse}, options);
  const auto document_rows = [&](Index d) {  // (1, H, n)
    return attn::bhl_view(document_lse.data() + d * heads * per_document, 1, heads, per_document);
  };
  for (Index d = 0; d < documents; ++d) {  // the per-document forward's own log-sum-exp
    std::vector<float> scratch(static_cast<std::size_t>(per_document * heads * dim));
    attn::scaled_dot_product_attention_into<float>(
        cpart(q, d), cpart(k, d), cpart(v, d),
        {attn::blhd_view(scratch.data(), 1, per_document, heads, dim), document_rows(d)}, options);
  }
  const auto run = [&](std::vector<float>& gq, std::vector<float>& gk, std::vector<float>& gv,
                       bool as_packed) {
    if (as_packed) {
      attn::scaled_dot_product_attention_backward_into<float>(
          packed(q), packed(k), packed(v), packed(out), packed_lse, packed(dout),
          {packed(gq), packed(gk), packed(gv)}, options);
      return;
    }
    for (Index d = 0; d < documents; ++d) {
      attn::scaled_dot_product_attention_backward_into<float>(
          cpart(q, d), cpart(k, d), cpart(v, d), cpart(out, d), document_rows(d), cpart(dout, d),
          {part(gq.data(), d), part(gk.data(), d), part(gv.data(), d)}, options);
    }
  };
  run(expected_dq, expected_dk, expected_dv, false);
  run(dq, dk, dv, one_packed_call);
  const float error = std::max({attn_bench::max_abs_diff(dq.data(), expected_dq.data(), size),
                                attn_bench::max_abs_diff(dk.data(), expected_dk.data(), size),
                                attn_bench::max_abs_diff(dv.data(), expected_dv.data(), size)});
  if (!(error <= 1e-4f)) {
    attn_bench::fail_check(state,
                           ("differs from the per-document backward by " + std::to_string(error)));
    return;
  }
  for (auto _ : state) {
    run(dq, dk, dv, one_packed_call);
    benchmark::DoNotOptimize(dq.data());
  }
  const double pairs = static_cast<double>(documents) * static_cast<double>(per_document) *
                       static_cast<double>(per_document + 1) / 2;
  state.counters["FLOPS"] = benchmark::Counter(10.0 * static_cast<double>(dim * heads) * pairs,
                                               benchmark::Counter::kIsIterationInvariantRate);
}

enum class CacheForm : std::int64_t { one_call = 0, per_sequence = 1 };

void BM_kv_ragged(benchmark::State& state) {
  const auto form = static_cast<CacheForm>(state.range(0));
  const Index q_length = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  const Index batch = 8, q_heads = 8, kv_heads = 2, dim = 128;
  const Index shortest = smoke() ? 20 : 100, longest = smoke() ? 400 : 4000;
  set_threads(threads);
  std::vector<Index> lengths;
  for (Index b = 0; b < batch; ++b)
    lengths.push_back(shortest + (longest - shortest) * b / (batch - 1));
  attn::KVCache<float> cache(batch, kv_heads, dim, dim, longest);
  std::vector<float> k(static_cast<std::size_t>(batch * kv_heads * longest * dim)), v(k.size());
  attn_bench::fill_normal(k, 4u);
  attn_bench::fill_normal(v, 5u);
  cache.append(attn::bhld_view(static_cast<const float*>(k.data()), batch, kv_heads, longest, dim),
               attn::bhld_view(static_cast<const float*>(v.data()), batch, kv_heads, longest, dim),
               lengths);
  std::vector<float> q(static_cast<std::size_t>(batch * q_heads * q_length * dim)), out(q.size()),
      expected(q.size());
  attn_bench::fill_normal(q, 6u);
  const auto q_view =
      attn::bhld_view(static_cast<const float*>(q.data()), batch, q_heads, q_length, dim);
  cache.attend_into(q_view, attn::bhld_view(expected.data(), batch, q_heads, q_length, dim));
  const auto run = [&] {
    const auto out_view = attn::bhld_view(out.data(), batch, q_heads, q_length, dim);
    if (form == CacheForm::one_call) {
      cache.attend_into(q_view, out_view);
      return;
    }
    attn::AttentionOptions<float> options;
    options.causal = attn::Causal::bottom_right;
    for (Index b = 0; b < batch; ++b) {
      const auto one = [&](auto view, Index length) {
        view.data += b * view.batch_stride;
        view.batch = 1;
        view.length = length;
        return view;
      };
      const Index n = lengths[static_cast<std::size_t>(b)];
      attn::scaled_dot_product_attention_into<float>(
          one(q_view, q_length), one(cache.keys_view(), n), one(cache.values_view(), n),
          one(out_view, q_length), options);
    }
  };
  run();
  const float error = attn_bench::max_abs_diff(out.data(), expected.data(), out.size());
  if (!(error <= 1e-4f)) {
    attn_bench::fail_check(state, ("differs from the one-call result by " + std::to_string(error)));
    return;
  }
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(out.data());
  }
  double keys = 0;
  for (const Index n : lengths)
    keys += static_cast<double>(n);
  state.counters["FLOPS"] =
      benchmark::Counter(4.0 * static_cast<double>(dim * q_heads * q_length) * keys,
                         benchmark::Counter::kIsIterationInvariantRate);
  set_threads(1);
}

void register_all() {
  attn_bench::register_fma_peak();
  const std::vector<std::int64_t> documents =
      smoke() ? std::vector<std::int64_t>{4} : std::vector<std::int64_t>{4, 16};
  benchmark::RegisterBenchmark("documents", BM_documents)
      ->ArgNames({"form", "k"})
      ->ArgsProduct({{0, 1, 2}, documents})
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  benchmark::RegisterBenchmark("documents_backward", BM_documents_backward)
      ->ArgNames({"form", "k"})
      ->ArgsProduct({{0, 2}, documents})
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  benchmark::RegisterBenchmark("kv_ragged", BM_kv_ragged)
      ->ArgNames({"form", "Lq", "threads"})
      ->ArgsProduct({{0, 1}, {1, 16}, {2}})
      ->Unit(benchmark::kMicrosecond)
      ->UseRealTime();
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, register_all);
}
