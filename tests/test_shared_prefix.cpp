// shared_prefix_attend: a shared prefix attended once and each suffix separately, merged,
// against one KVCache holding prefix + suffix for every sequence and the long double
// reference; every storage format, rotation, sinks, softcap, and every refusal.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <attn/kv_cache.hpp>
#include <attn/quantized.hpp>
#include <attn/shared_prefix.hpp>

#include "support/heads.hpp"
#include "support/reference.hpp"

namespace {

using attn::Index;
using attn_test::Heads;
namespace ref = attn_test::reference;

/// Rows [first, first + count) of every head: a strided view of the same memory.
attn::HeadsView<const float> rows_of(const Heads<float>& x, Index first, Index count) {
  attn::HeadsView<const float> view = x.cview();
  view.data += first * view.row_stride;
  view.length = count;
  return view;
}

/// One problem: a prefix of N tokens, B suffixes (tokens n_b after it), Lq queries each.
struct Case {
  Index batch = 3, q_heads = 8, kv_heads = 2, dim = 32, value_dim = 32, prefix = 50, q_length = 1;
  std::vector<Index> suffix{7, 1, 12};
  attn::KVRotation rotation = attn::KVRotation::none;
};

template <class S, class SV>
struct Built {
  attn::KVCache<S, SV> prefix, suffixes, whole;
  Heads<float> q, k, v;  // k, v (B, Hkv, N + max n_b, .): the prefix then each suffix
};

template <class S, class SV>
Built<S, SV> build(const Case& c, std::mt19937& rng) {
  const Index longest = *std::max_element(c.suffix.begin(), c.suffix.end());
  const Index total = c.prefix + longest;
  Built<S, SV> r{{1, c.kv_heads, c.dim, c.value_dim, 0, true, c.rotation},
                 {c.batch, c.kv_heads, c.dim, c.value_dim, 0, true, c.rotation},
                 {c.batch, c.kv_heads, c.dim, c.value_dim, 0, true, c.rotation},
                 attn_test::random_heads<float>(c.batch, c.q_heads, c.q_length, c.dim, rng),
                 attn_test::random_heads<float>(c.batch, c.kv_heads, total, c.dim, rng),
                 attn_test::random_heads<float>(c.batch, c.kv_heads, total, c.value_dim, rng)};
  // Every sequence's first N rows are the same prefix.
  for (Index b = 1; b < c.batch; ++b) {
    for (Index h = 0; h < c.kv_heads; ++h) {
      for (Index j = 0; j < c.prefix; ++j) {
        const auto row = [&](Index sequence, Index width) {
          return static_cast<std::size_t>(((sequence * c.kv_heads + h) * total + j) * width);
        };
        std::copy_n(r.k.data.begin() + static_cast<std::ptrdiff_t>(row(0, c.dim)), c.dim,
                    r.k.data.begin() + static_cast<std::ptrdiff_t>(row(b, c.dim)));
        std::copy_n(r.v.data.begin() + static_cast<std::ptrdiff_t>(row(0, c.value_dim)),
                    c.value_dim,
                    r.v.data.begin() + static_cast<std::ptrdiff_t>(row(b, c.value_dim)));
      }
    }
  }
  attn::HeadsView<const float> prefix_k = rows_of(r.k, 0, c.prefix);
  attn::HeadsView<const float> prefix_v = rows_of(r.v, 0, c.prefix);
  prefix_k.batch = prefix_v.batch = 1;
  r.prefix.append(prefix_k, prefix_v);
  r.suffixes.append(rows_of(r.k, c.prefix, longest), rows_of(r.v, c.prefix, longest), c.suffix);
  std::vector<Index> whole_counts;
  for (const Index n : c.suffix)
    whole_counts.push_back(c.prefix + n);
  r.whole.append(r.k.cview(), r.v.cview(), whole_counts);
  return r;
}

template <class S, class SV>
void check_against_whole(const Case& c, const attn::AttentionOptions<float>& options,
                         double tolerance, std::mt19937& rng) {
  const Built<S, SV> built = build<S, SV>(c, rng);
  Heads<float> out(c.batch, c.q_heads, c.q_length, c.value_dim);
  Heads<float> expected(c.batch, c.q_heads, c.q_length, c.value_dim);
  std::vector<float> lse(static_cast<std::size_t>(c.batch * c.q_heads * c.q_length));
  std::vector<float> expected_lse(lse.size());
  attn::shared_prefix_attend_into(
      built.prefix, built.suffixes, built.q.cview(),
      {out.view(), attn::bhl_view(lse.data(), c.batch, c.q_heads, c.q_length)}, options);
  built.whole.attend_into(
      built.q.cview(),
      {expected.view(), attn::bhl_view(expected_lse.data(), c.batch, c.q_heads, c.q_length)},
      options);
  for (std::size_t n = 0; n < out.data.size(); ++n) {
    INFO("element " << n);
    REQUIRE(std::abs(out.data[n] - expected.data[n]) <= tolerance);
  }
  for (std::size_t n = 0; n < lse.size(); ++n)
    REQUIRE(std::abs(lse[n] - expected_lse[n]) <= tolerance * std::max(1.0f, std::abs(lse[n])));
  // Without a logsumexp output, the same out.
  Heads<float> out_only(c.batch, c.q_heads, c.q_length, c.value_dim);
  attn::shared_prefix_attend_into(built.prefix, built.suffixes, built.q.cview(), out_only.view(),
                                  options);
  REQUIRE(out_only.data == out.data);
}

}  // namespace

TEST_CASE("a shared prefix attended once equals the long double reference", "[shared_prefix]") {
  std::mt19937 rng(8);
  for (const Index q_length : {1, 3}) {
    Case c;
    c.dim = 16;
    c.value_dim = 8;
    c.q_length = q_length;
    c.suffix = {q_length + 6, q_length, q_length + 11};
    const Built<float, float> built = build<float, float>(c, rng);
    attn::AttentionOptions<float> options;
    options.sinks = {0.5f, -1, 0, 2, 1, -0.5f, 0.25f, 3};
    options.softcap = 4.0f;
    const attn::Tensor<float, 4> q_tensor = [&] {
      attn::Tensor<float, 4> t(c.batch, c.q_heads, c.q_length, c.dim);
      std::copy(built.q.data.begin(), built.q.data.end(), t.data());
      return t;
    }();
    const attn::Tensor<float, 4> out =
        attn::shared_prefix_attend(built.prefix, built.suffixes, q_tensor, options);
    ref::Problem p;
    p.batch = c.batch, p.q_heads = c.q_heads, p.kv_heads = c.kv_heads, p.q_length = c.q_length;
    p.k_length = built.k.l, p.dim = c.dim, p.value_dim = c.value_dim;
    p.causal = ref::Causal::bottom_right;
    for (const Index n : c.suffix)
      p.key_lengths.push_back(c.prefix + n);
    p.sinks = {options.sinks.begin(), options.sinks.end()};
    p.softcap = 4.0L;
    const auto widen = [](const std::vector<float>& x) {
      return std::vector<long double>(x.begin(), x.end());
    };
    const auto truth = ref::attention<long double>(p, widen(built.q.data), widen(built.k.data),
                                                   widen(built.v.data));
    for (Index n = 0; n < out.size(); ++n) {
      INFO("Lq " << q_length << " element " << n);
      REQUIRE(std::abs(double(out.data()[n]) - double(truth.out[static_cast<std::size_t>(n)])) <=
              2e-6);
    }
  }
}

TEST_CASE("shared_prefix_attend equals one cache holding prefix + suffix", "[shared_prefix]") {
  std::mt19937 rng(21);
  attn::AttentionOptions<float> plain, modified;
  modified.sinks = {0.5f, -1, 0, 2, 1, -0.5f, 0.25f, 3};
  modified.softcap = 6.0f;
  modified.scale = 0.3f;
  for (const Index q_length : {1, 4}) {
    Case c;
    c.q_length = q_length;
    c.suffix = {q_length + 9, q_length, q_length + 30};
    for (const auto* options : {&plain, &modified}) {
      INFO("Lq " << q_length << (options == &plain ? " plain" : " sinks, softcap, scale"));
      check_against_whole<float, float>(c, *options, 2e-6, rng);
      check_against_whole<Eigen::half, Eigen::half>(c, *options, 2e-6, rng);
      check_against_whole<Eigen::bfloat16, Eigen::bfloat16>(c, *options, 2e-6, rng);
      check_against_whole<attn::BlockQ8_0, attn::BlockQ8_0>(c, *options, 2e-6, rng);
      check_against_whole<attn::BlockQ8_0, attn::BlockQ4_0>(c, *options, 2e-6, rng);
      Case rotated = c;
      rotated.rotation = attn::KVRotation::hadamard;
      check_against_whole<attn::BlockQ4_0, attn::BlockQ4_0>(rotated, *options, 2e-6, rng);
    }
  }
  SECTION("a prefix of no tokens is the suffixes alone") {
    Case c;
    c.prefix = 0;
    check_against_whole<float, float>(c, modified, 0, rng);
  }
  SECTION("grouped-query heads of one kv head, a long prefix through flash tiles") {
    Case c;
    c.batch = 5, c.q_heads = 8, c.kv_heads = 1, c.prefix = 700, c.suffix = {3, 60, 1, 9, 130};
    check_against_whole<float, float>(c, plain, 2e-6, rng);
  }
}

TEST_CASE("shared_prefix_attend refuses what it cannot share, changing nothing",
          "[shared_prefix][errors]") {
  std::mt19937 rng(4);
  Case c;
  Built<float, float> built = build<float, float>(c, rng);
  Heads<float> out(c.batch, c.q_heads, c.q_length, c.value_dim);
  std::fill(out.data.begin(), out.data.end(), 7.0f);
  const std::vector<float> untouched = out.data;
  const auto call = [&](const attn::KVCache<float>& prefix, const attn::KVCache<float>& suffixes,
                        const attn::AttentionOptions<float>& options) {
    attn::shared_prefix_attend_into(prefix, suffixes, built.q.cview(), out.view(), options);
  };
  const std::string name = "shared_prefix_attend: ";
  attn::KVCache<float> two(2, c.kv_heads, c.dim, c.value_dim, 4);
  REQUIRE_THROWS_WITH(call(two, built.suffixes, {}),
                      name +
                          "the prefix cache holds 2 sequences: it must hold one, the shared "
                          "prefix");
  attn::KVCache<float> narrow(1, c.kv_heads, 16, c.value_dim, 4);
  REQUIRE_THROWS_WITH(call(narrow, built.suffixes, {}),
                      name +
                          "the prefix cache is (Hkv, D, Dv) = [2, 16, 32] and the suffix cache "
                          "[2, 32, 32]: the two must agree");
  const auto refused = [&](const char* what,
                           const std::function<void(attn::AttentionOptions<float>&)>& set) {
    attn::AttentionOptions<float> o;
    set(o);
    REQUIRE_THROWS_WITH(call(built.prefix, built.suffixes, o),
                        name + "options." + what +
                            " is not supported: the prefix pass is shared by every sequence and "
                            "has no per-sequence positions");
  };
  attn::Tensor<float, 4> bias(1, 1, 1, 1);
  attn::Tensor<bool, 4> keep(1, 1, 1, 1);
  refused("window", [](auto& o) { o.window = {4, 0}; });
  refused("sink_tokens", [](auto& o) { o.sink_tokens = 2; });
  refused("alibi_slopes", [](auto& o) { o.alibi_slopes = attn::alibi_slopes<float>(8); });
  refused("keep_mask", [&](auto& o) { o.keep_mask = keep; });
  refused("bias", [&](auto& o) { o.bias = bias; });
  refused("score_mod", [](auto& o) {
    o.score_mod = attn::ScoreMod<float>([](float s, Index, Index, Index, Index) { return s; });
  });
  refused("mask_mod (or block_mask)", [](auto& o) {
    o.mask_mod = attn::MaskMod([](Index, Index, Index, Index) { return true; });
  });
  refused("dropout_p", [](auto& o) { o.dropout_p = 0.1f; });
  attn::AttentionOptions<float> causal;
  causal.causal = attn::Causal::top_left;
  REQUIRE_THROWS_WITH(call(built.prefix, built.suffixes, causal),
                      name +
                          "options.causal, options.key_lengths and options.query_lengths "
                          "must be unset: the caches' lengths and the bottom-right causal rule "
                          "decide them");
  {
    Heads<float> q4(c.batch, c.q_heads, 2, c.dim);
    built.suffixes.clear();
    built.suffixes.append(rows_of(built.k, c.prefix, 1), rows_of(built.v, c.prefix, 1));
    REQUIRE_THROWS_WITH(
        attn::shared_prefix_attend_into(
            built.prefix, built.suffixes, q4.cview(),
            attn::bhld_view(out.data.data(), c.batch, c.q_heads, 2, c.value_dim), {}),
        name +
            "q has 2 queries but the suffix of sequence 0 holds only 1 tokens: the queries' "
            "tokens must be appended to the suffixes first");
  }
  {
    Heads<float> q_two(2, c.q_heads, c.q_length, c.dim);
    REQUIRE_THROWS_WITH(attn::shared_prefix_attend_into(built.prefix, built.suffixes, q_two.cview(),
                                                        out.view(), {}),
                        name + "q is [2, 8, 1, 32] but the suffix cache holds 3 sequences");
  }
  std::vector<float> weights(static_cast<std::size_t>(c.batch * c.q_heads * 64));
  attn::AttentionOutputViews<float> with_weights(out.view());
  with_weights.weights = attn::bhld_view(weights.data(), c.batch, c.q_heads, c.q_length, 64);
  REQUIRE_THROWS_WITH(attn::shared_prefix_attend_into(built.prefix, built.suffixes, built.q.cview(),
                                                      with_weights, {}),
                      name + "outputs.weights was given: a merged call forms no weights");
  REQUIRE(out.data == untouched);
}

TEST_CASE("KVCache::attend_all_into: every query sees every cached token of its sequence",
          "[shared_prefix][kv_cache]") {
  std::mt19937 rng(31);
  constexpr Index B = 2, Hq = 4, Hkv = 2, Lq = 12, L = 9, D = 8, Dv = 6;
  const Heads<float> q = attn_test::random_heads<float>(B, Hq, Lq, D, rng);
  const Heads<float> k = attn_test::random_heads<float>(B, Hkv, L, D, rng);
  const Heads<float> v = attn_test::random_heads<float>(B, Hkv, L, Dv, rng);
  attn::KVCache<float> cache(B, Hkv, D, Dv, 0);
  const std::vector<Index> lengths{5, 9};
  cache.append(k.cview(), v.cview(), lengths);
  Heads<float> out(B, Hq, Lq, Dv);
  std::vector<float> lse(static_cast<std::size_t>(B * Hq * Lq));
  // More queries than tokens: nothing needs to be appended for a cross-attention.
  cache.attend_all_into(q.cview(), {out.view(), attn::bhl_view(lse.data(), B, Hq, Lq)});
  ref::Problem p;
  p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_length = Lq, p.k_length = L, p.dim = D;
  p.value_dim = Dv;
  p.key_lengths = lengths;
  const auto widen = [](const std::vector<float>& x) {
    return std::vector<long double>(x.begin(), x.end());
  };
  const auto truth = ref::attention<long double>(p, widen(q.data), widen(k.data), widen(v.data));
  for (std::size_t n = 0; n < out.data.size(); ++n)
    REQUIRE(std::abs(double(out.data[n]) - double(truth.out[n])) <= 1e-6);
  for (std::size_t n = 0; n < lse.size(); ++n)
    REQUIRE(std::abs(double(lse[n]) - double(truth.lse[n])) <= 1e-6);

  attn::AttentionOptions<float> causal;
  causal.causal = attn::Causal::bottom_right;
  REQUIRE_THROWS_WITH(cache.attend_all_into(q.cview(), out.view(), causal),
                      "KVCache::attend_all: options.causal, options.key_lengths and "
                      "options.query_lengths must be unset: the cache applies its own lengths "
                      "(every query sees every cached token)");

  SECTION("an empty cache: zeros and -inf, or the sink") {
    const attn::KVCache<float> empty(B, Hkv, D, Dv, 4);
    attn::AttentionOptions<float> sinks;
    sinks.sinks = {0.5f, 1, 2, 3};
    empty.attend_all_into(q.cview(), {out.view(), attn::bhl_view(lse.data(), B, Hq, Lq)}, sinks);
    REQUIRE(out.data == std::vector<float>(out.data.size(), 0.0f));
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < Hq; ++h)
        for (Index i = 0; i < Lq; ++i)
          REQUIRE(lse[static_cast<std::size_t>((b * Hq + h) * Lq + i)] ==
                  sinks.sinks[static_cast<std::size_t>(h)]);
  }
}
