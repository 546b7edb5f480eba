// Tests for per-sequence lengths, packed variable-length batches and sinks
// (packed_view() through scaled_dot_product_attention_into, VisibilityOptions::query_lengths,
// sink_tokens, sinks):
// packed equals each sequence alone bit for bit for every algorithm, and each sequence
// equals the long double reference of support/reference.hpp within the kernels' bound;
// ragged KVCache::attend in one call equals attending each sequence alone;
// MultiHeadAttention::forward_packed equals forward() of each sequence; every malformed
// input is rejected with a message naming it. The PyTorch fixtures of the same options
// (sdpa.json: ragged_*, sinks_*, sink_tokens_*) run through every algorithm in
// test_attention.cpp and test_kernels.cpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <attn/attention.hpp>
#include <attn/kv_cache.hpp>
#include <attn/multihead.hpp>

#include "support/heads.hpp"
#include "support/isa_cases.hpp"
#include "support/masked_problem.hpp"
#include "support/results.hpp"

using attn::Algorithm;
using attn::Causal;
using attn::Index;
using attn_test::Heads;
using Catch::Matchers::Contains;

namespace {

/// Whether a and b have the same bits (NaN payloads and signed zeros included).
template <class T>
bool same_bits(T a, T b) {
  using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  static_assert(sizeof(Bits) == sizeof(T));
  Bits x = 0, y = 0;
  std::memcpy(&x, &a, sizeof(T));
  std::memcpy(&y, &b, sizeof(T));
  return x == y;
}

constexpr Algorithm all_algorithms[] = {Algorithm::naive, Algorithm::chunked, Algorithm::flash,
                                        Algorithm::decode};

/// Packed (T, H, D) tokens of B sequences, with their offsets.
template <class T>
struct Packed {
  std::vector<Index> offsets{0};
  Index heads, dim;
  std::vector<T> data;

  Packed(const std::vector<Index>& lengths, Index heads_, Index dim_, std::mt19937& rng)
      : heads(heads_), dim(dim_) {
    for (const Index n : lengths)
      offsets.push_back(offsets.back() + n);
    std::normal_distribution<double> normal(0.0, 1.0);
    data.resize(static_cast<std::size_t>(offsets.back() * heads * dim));
    for (T& x : data)
      x = static_cast<T>(normal(rng));
  }
  Index tokens() const { return offsets.back(); }
  attn::HeadsView<const T> all() const {
    return attn::blhd_view(static_cast<const T*>(data.data()), 1, tokens(), heads, dim);
  }
  attn::HeadsView<T> all() { return attn::blhd_view(data.data(), 1, tokens(), heads, dim); }
  /// All sequences as one packed view, (B, H, max n_b, D).
  attn::HeadsView<const T> packed() const { return attn::packed_view(all(), offsets); }
  attn::HeadsView<T> packed() { return attn::packed_view(all(), offsets); }
  /// Sequence b alone, (1, H, n_b, D), in the same memory.
  attn::HeadsView<const T> sequence(std::size_t b) const {
    return attn::blhd_view(static_cast<const T*>(data.data()) + offsets[b] * heads * dim, 1,
                           offsets[b + 1] - offsets[b], heads, dim);
  }
  std::vector<long double> sequence_values(std::size_t b) const {  // (1, H, n_b, D)
    const Index n = offsets[b + 1] - offsets[b];
    std::vector<long double> r(static_cast<std::size_t>(heads * n * dim));
    for (Index h = 0; h < heads; ++h)
      for (Index i = 0; i < n; ++i)
        for (Index d = 0; d < dim; ++d)
          r[static_cast<std::size_t>((h * n + i) * dim + d)] = attn_test::exact_value(
              data[static_cast<std::size_t>(((offsets[b] + i) * heads + h) * dim + d)]);
    return r;
  }
};

/// Option sets that each apply per sequence.
template <class T>
std::vector<std::pair<std::string, attn::AttentionOptions<T>>> packed_option_sets(Index q_heads) {
  std::vector<std::pair<std::string, attn::AttentionOptions<T>>> sets;
  attn::AttentionOptions<T> o;
  sets.emplace_back("none", o);
  o.causal = Causal::bottom_right;
  sets.emplace_back("causal bottom-right", o);
  o.causal = Causal::top_left;
  o.window = {5, -1};
  sets.emplace_back("causal top-left + window (5, -1)", o);
  o = {};
  o.causal = Causal::bottom_right;
  o.window = {6, -1};
  o.sink_tokens = 3;
  for (Index h = 0; h < q_heads; ++h)
    o.sinks.push_back(static_cast<T>(0.5 * static_cast<double>(h) - 1.0));
  sets.emplace_back("causal bottom-right + window (6, -1) + 3 sink tokens + learned sinks", o);
  o.alibi_slopes = attn::alibi_slopes<T>(q_heads);
  o.softcap = T(4);
  o.scale = T(0.3);
  sets.emplace_back("... + ALiBi + softcap 4 + scale 0.3", o);
  return sets;
}

template <class T>
void packed_equals_each_sequence_alone() {
  std::mt19937 rng(1701);
  // A long and a short document, one with no queries, one with no keys, one query row.
  const std::vector<Index> q_lengths{150, 9, 0, 4, 1, 70};
  const std::vector<Index> k_lengths{150, 30, 12, 0, 77, 40};
  const Index q_heads = 4, kv_heads = 2, dim = 20, value_dim = 12;
  const Packed<T> q(q_lengths, q_heads, dim, rng);
  const Packed<T> k(k_lengths, kv_heads, dim, rng), v(k_lengths, kv_heads, value_dim, rng);
  for (const auto& [name, base] : packed_option_sets<T>(q_heads)) {
    for (const Algorithm algorithm : all_algorithms) {
      for (const Index tile : {Index(0), Index(7)}) {
        INFO(name << ", " << attn::algorithm_name(algorithm) << ", tiles " << tile);
        attn::AttentionOptions<T> options = base;
        options.algorithm = algorithm;
        options.query_tile = tile;
        options.key_tile = tile;
        Packed<T> out(q_lengths, q_heads, value_dim, rng);
        std::vector<T> lse(static_cast<std::size_t>(q_heads * q.tokens()), T(7));
        attn::scaled_dot_product_attention_into<T>(
            q.packed(), k.packed(), v.packed(),
            attn::AttentionOutputViews{
                out.packed(),
                attn::packed_view(attn::bhl_view(lse.data(), 1, q_heads, q.tokens()), q.offsets)},
            options);
        for (std::size_t b = 0; b < q_lengths.size(); ++b) {
          INFO("sequence " << b << ": Lq " << q_lengths[b] << ", Lk " << k_lengths[b]);
          const Index nq = q_lengths[b], nk = k_lengths[b];
          Packed<T> alone({nq}, q_heads, value_dim, rng);
          std::vector<T> lse_alone(static_cast<std::size_t>(q_heads * nq));
          attn::scaled_dot_product_attention_into<T>(
              q.sequence(b), k.sequence(b), v.sequence(b),
              attn::AttentionOutputViews{alone.all(),
                                         attn::bhl_view(lse_alone.data(), 1, q_heads, nq)},
              options);
          const attn::HeadsView<const T> packed_out = static_cast<const Packed<T>&>(out).all();
          for (Index h = 0; h < q_heads; ++h) {
            for (Index i = 0; i < nq; ++i) {
              for (Index e = 0; e < value_dim; ++e) {
                const T a = packed_out.head(0, h)(q.offsets[b] + i, e);
                const T s = alone.all().head(0, h)(i, e);
                REQUIRE(same_bits(a, s));  // bit for bit
              }
              const T l_packed = lse[static_cast<std::size_t>(h * q.tokens() + q.offsets[b] + i)];
              const T l_alone = lse_alone[static_cast<std::size_t>(h * nq + i)];
              REQUIRE(same_bits(l_packed, l_alone));
            }
          }
          // ... and that sequence against the independent reference.
          attn_test::reference::Problem p =
              attn_test::sized_problem(1, q_heads, kv_heads, nq, nk, dim, value_dim);
          p.causal = options.causal == Causal::top_left ? attn_test::reference::Causal::top_left
                     : options.causal == Causal::bottom_right
                         ? attn_test::reference::Causal::bottom_right
                         : attn_test::reference::Causal::none;
          p.window_left = options.window.left;
          p.window_right = options.window.right;
          p.sink_tokens = options.sink_tokens;
          for (const T x : options.sinks)
            p.sinks.push_back(x);
          for (const T x : options.alibi_slopes)
            p.alibi_slopes.push_back(x);
          if (options.softcap)
            p.softcap = *options.softcap;
          p.scale = options.scale ? static_cast<long double>(*options.scale)
                                  : static_cast<long double>(T(1) / std::sqrt(T(dim)));
          const auto truth = attn_test::reference::attention<long double>(
              p, q.sequence_values(b), k.sequence_values(b), v.sequence_values(b));
          const auto plain = attn_test::reference::attention<T>(
              p, q.sequence_values(b), k.sequence_values(b), v.sequence_values(b));
          std::vector<T> mine = alone.data;  // (1, Lq, Hq, Dv) -> (1, Hq, Lq, Dv)
          for (Index h = 0; h < q_heads; ++h)
            for (Index i = 0; i < nq; ++i)
              for (Index e = 0; e < value_dim; ++e)
                mine[static_cast<std::size_t>((h * nq + i) * value_dim + e)] =
                    alone.all().head(0, h)(i, e);
          const double error = attn_test::max_error(mine, truth.out);
          REQUIRE(error <= attn_test::error_bound<T>(attn_test::max_error(plain.out, truth.out)));
          REQUIRE(attn_test::max_error(lse_alone, truth.lse) <=
                  attn_test::error_bound<T>(attn_test::max_error(plain.lse, truth.lse)));
        }
      }
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "packed sequences equal each sequence alone, bit for bit, for every algorithm", "[packed]",
    packed_equals_each_sequence_alone)

TEST_CASE("packed sequences in 16-bit storage equal each sequence alone", "[packed][isa]") {
  std::mt19937 rng(99);
  const std::vector<Index> q_lengths{33, 0, 5}, k_lengths{40, 3, 5};
  const Packed<Eigen::half> q(q_lengths, 2, 16, rng), k(k_lengths, 1, 16, rng),
      v(k_lengths, 1, 8, rng);
  attn::AttentionOptions<float> options;
  options.causal = Causal::bottom_right;
  options.sinks = {0.5F, -0.5F};
  for (const Algorithm algorithm : all_algorithms) {
    INFO(attn::algorithm_name(algorithm));
    options.algorithm = algorithm;
    Packed<Eigen::half> out(q_lengths, 2, 8, rng);
    attn::scaled_dot_product_attention_into<Eigen::half>(q.packed(), k.packed(), v.packed(),
                                                         out.packed(), options);
    for (std::size_t b = 0; b < q_lengths.size(); ++b) {
      Packed<Eigen::half> alone({q_lengths[b]}, 2, 8, rng);
      attn::scaled_dot_product_attention_into<Eigen::half>(q.sequence(b), k.sequence(b),
                                                           v.sequence(b), alone.all(), options);
      const auto first = out.data.begin() + q.offsets[b] * 2 * 8;
      REQUIRE(
          std::equal(alone.data.begin(), alone.data.end(), first, [](Eigen::half x, Eigen::half y) {
            return Eigen::numext::bit_cast<std::uint16_t>(x) ==
                   Eigen::numext::bit_cast<std::uint16_t>(y);
          }));
    }
  }
}

TEST_CASE("ragged KVCache::attend in one call equals attending each sequence alone",
          "[packed][kv_cache][isa]") {
  std::mt19937 rng(4242);
  const std::vector<Index> lengths{20, 700, 3, 130};
  const Index batch = 4, q_heads = 4, kv_heads = 2, dim = 16, value_dim = 16;
  for (const Index new_tokens : {Index(1), Index(3)}) {
    attn::KVCache<float> cache(batch, kv_heads, dim, value_dim, 8);
    const Index longest = *std::max_element(lengths.begin(), lengths.end());
    const Heads<float> k = attn_test::random_heads<float>(batch, kv_heads, longest, dim, rng);
    const Heads<float> v = attn_test::random_heads<float>(batch, kv_heads, longest, value_dim, rng);
    cache.append(k.cview(), v.cview(), lengths);
    const Heads<float> q = attn_test::random_heads<float>(batch, q_heads, new_tokens, dim, rng);
    for (const Algorithm algorithm : all_algorithms) {
      INFO(attn::algorithm_name(algorithm) << ", Lq " << new_tokens);
      attn::AttentionOptions<float> options;
      options.algorithm = algorithm;
      options.window = {100, -1};
      options.sinks = {0.1F, 0.2F, 0.3F, 0.4F};
      Heads<float> out(batch, q_heads, new_tokens, value_dim);
      cache.attend_into(q.cview(), out.view(), options);
      for (Index b = 0; b < batch; ++b) {
        const auto one = [&](auto view, Index length) {
          view.data += b * view.batch_stride;
          view.batch = 1;
          view.length = length;
          return view;
        };
        Heads<float> alone(1, q_heads, new_tokens, value_dim);
        attn::AttentionOptions<float> o = options;
        o.causal = Causal::bottom_right;
        attn::scaled_dot_product_attention_into<float>(
            one(q.cview(), new_tokens), one(cache.keys_view(), lengths[std::size_t(b)]),
            one(cache.values_view(), lengths[std::size_t(b)]), alone.view(), o);
        const auto first = out.data.begin() + b * q_heads * new_tokens * value_dim;
        REQUIRE(std::equal(alone.data.begin(), alone.data.end(), first));
      }
    }
  }
}

TEST_CASE("key lengths with bottom-right alignment measure each sequence's own diagonal",
          "[packed]") {
  // The KV-cache case the old rule got wrong: query i of sequence b sees j <= n_k(b) - Lq + i.
  attn::VisibilityOptions o;
  o.causal = Causal::bottom_right;
  o.key_lengths = {6, 3};
  const attn::Mask mask("test", 2, 1, 2, 6, o);
  REQUIRE(mask.key_interval(0, 0) == std::array<Index, 2>{0, 5});
  REQUIRE(mask.key_interval(0, 1) == std::array<Index, 2>{0, 6});
  REQUIRE(mask.key_interval(1, 0) == std::array<Index, 2>{0, 2});  // not {0, 3}: 3 is padding
  REQUIRE(mask.key_interval(1, 1) == std::array<Index, 2>{0, 3});
  o.query_lengths = {2, 1};  // sequence 1 has one real query: it sits on key 2
  const attn::Mask ragged("test", 2, 1, 2, 6, o);
  REQUIRE(ragged.key_interval(1, 0) == std::array<Index, 2>{0, 3});
  REQUIRE(ragged.key_interval(1, 1) == std::array<Index, 2>{0, 0});  // a padding query
  o.window = {1, -1};
  o.sink_tokens = 1;
  o.query_lengths = {};
  const attn::Mask streaming("test", 2, 1, 2, 6, o);
  const auto intervals = streaming.key_intervals(0, 1);  // diagonal 5: keys 4, 5 and sink 0
  REQUIRE(intervals.count == 2);
  REQUIRE(intervals.interval[0] == std::array<Index, 2>{0, 1});
  REQUIRE(intervals.interval[1] == std::array<Index, 2>{4, 6});
  REQUIRE(streaming.classify(0, 0, 0, 2, 1, 3) == attn::TileVisibility::hidden);
  REQUIRE(streaming.classify(0, 0, 0, 2, 0, 1) == attn::TileVisibility::visible);
  REQUIRE(streaming.classify(0, 0, 0, 2, 0, 6) == attn::TileVisibility::partial);
}

TEST_CASE("a row that sees no key outputs zeros and the sink as its log-sum-exp", "[packed]") {
  attn::Tensor<float, 4> q(1, 2, 3, 4), k(1, 2, 5, 4), v(1, 2, 5, 4);
  q.setConstant(1.0F);
  k.setConstant(0.5F);
  v.setConstant(2.0F);
  attn::AttentionOptions<float> options;
  options.key_lengths = {0};
  options.sinks = {1.25F, -3.0F};
  for (const Algorithm algorithm : all_algorithms) {
    options.algorithm = algorithm;
    attn::Tensor<float, 3> lse;
    const attn::Tensor<float, 4> out = attn_test::out_of(
        attn::scaled_dot_product_attention(q, k, v, options, attn::Return::logsumexp), nullptr,
        &lse);
    for (Index n = 0; n < out.size(); ++n)
      REQUIRE(out.data()[n] == 0.0F);
    REQUIRE(lse(0, 0, 2) == 1.25F);
    REQUIRE(lse(0, 1, 0) == -3.0F);
  }
  // A sink that dominates so far that every weight underflows to 0: the row still sees its
  // keys, so NaN in a value reaches its column (0 * NaN), in every kernel, as in naive.
  {
    attn::AttentionOptions<float> far;
    attn::Tensor<float, 4> bias(1, 1, 1, 1);
    bias.setConstant(-1e6F);
    far.bias = bias;
    far.sinks = {0.0F, 0.0F};
    attn::Tensor<float, 4> v_nan = v;
    v_nan(0, 0, 3, 1) = std::numeric_limits<float>::quiet_NaN();
    for (const Algorithm algorithm : all_algorithms) {
      INFO(attn::algorithm_name(algorithm));
      far.algorithm = algorithm;
      attn::Tensor<float, 3> lse;
      const attn::Tensor<float, 4> out = attn_test::out_of(
          attn::scaled_dot_product_attention(q, k, v_nan, far, attn::Return::logsumexp), nullptr,
          &lse);
      REQUIRE(out(0, 0, 2, 0) == 0.0F);
      REQUIRE(std::isnan(out(0, 0, 2, 1)));
      REQUIRE(out(0, 1, 2, 1) == 0.0F);  // head 1 reads kv head 1: no NaN
      REQUIRE(lse(0, 0, 2) == 0.0F);
    }
  }
  // Weights: five equal scores s and a sink z give each key exp(s) / (5 exp(s) + exp(z)).
  options.key_lengths = {};
  options.algorithm = Algorithm::naive;
  attn::Tensor<float, 4> weights;
  attn_test::out_of(attn::scaled_dot_product_attention(q, k, v, options, attn::Return::weights),
                    &weights, nullptr);
  const double s = 0.5 * 4 / 2.0;  // q.k * 1/sqrt(D)
  REQUIRE(weights(0, 0, 1, 3) ==
          Approx(std::exp(s) / (5 * std::exp(s) + std::exp(1.25))).epsilon(1e-6));
}

TEST_CASE("packed and per-sequence options reject malformed input with a message naming it",
          "[packed][errors]") {
  std::mt19937 rng(5);
  const Packed<float> q({3, 2}, 2, 4, rng), k({4, 1}, 1, 4, rng), v({4, 1}, 1, 4, rng);
  Packed<float> out({3, 2}, 2, 4, rng);
  const auto call = [&](const std::vector<Index>& cu_q, const std::vector<Index>& cu_k,
                        const attn::AttentionOptions<float>& options = {}) {
    attn::scaled_dot_product_attention_into<float>(
        attn::packed_view(q.all(), cu_q), attn::packed_view(k.all(), cu_k),
        attn::packed_view(v.all(), cu_k), attn::packed_view(out.all(), cu_q), options);
  };
  const std::string f = "scaled_dot_product_attention: ";
  const std::string pv = "packed_view: ";
  REQUIRE_NOTHROW(call({0, 3, 5}, {0, 4, 5}));
  REQUIRE_THROWS_WITH(call({0, 3, 5}, {0, 5}),
                      f + "q is [2, 2, 3, 4], k is [1, 1, 5, 4], v is [1, 1, 5, 4]: batch sizes "
                          "differ");
  REQUIRE_THROWS_WITH(
      call({1, 3, 5}, {0, 4, 5}),
      pv + "cu_seqlens is [1, 3, 5]: it must have B + 1 >= 1 entries starting at 0");
  REQUIRE_THROWS_WITH(call({}, {}), pv + "cu_seqlens is []: it must have B + 1 >= 1 entries "
                                         "starting at 0");
  REQUIRE_THROWS_WITH(call({0, 3, 5}, {0, 5, 4}),
                      pv + "cu_seqlens is [0, 5, 4]: offsets must not decrease (entry 2)");
  REQUIRE_THROWS_WITH(call({0, 3, 6}, {0, 4, 5}),
                      pv + "cu_seqlens is [0, 3, 6]: its last entry must equal the number of "
                           "tokens, 5");
  REQUIRE_THROWS_WITH(call({0, 3, 4}, {0, 4, 5}), Contains("must equal the number of tokens, 5"));
  attn::AttentionOptions<float> o;
  o.key_lengths = {1, 1};
  REQUIRE_THROWS_WITH(call({0, 3, 5}, {0, 4, 5}, o),
                      f + "options.key_lengths and options.query_lengths must be empty on packed "
                          "views: their row offsets give the lengths");
  o = {};
  o.query_lengths = {1, 1};
  REQUIRE_THROWS_WITH(call({0, 3, 5}, {0, 4, 5}, o),
                      Contains("options.key_lengths and options.query_lengths must be empty"));
  o = {};
  attn::Tensor<bool, 4> keep(1, 1, 3, 4);
  o.keep_mask = keep;
  REQUIRE_THROWS_WITH(call({0, 3, 5}, {0, 4, 5}, o),
                      f + "options.keep_mask and options.bias are not supported on packed views: "
                          "pad the sequences, or express the mask with causal, window, sink "
                          "tokens, ALiBi or a mask_mod");
  o = {};
  o.sinks = {1.0F};
  REQUIRE_THROWS_WITH(call({0, 3, 5}, {0, 4, 5}, o),
                      f + "sinks has 1 entries but there are 2 query heads");
  o.sinks = {1.0F, std::numeric_limits<float>::quiet_NaN()};
  REQUIRE_THROWS_WITH(call({0, 3, 5}, {0, 4, 5}, o), f + "sinks[1] is nan: must be finite");
  o.sinks = {1.0F, std::numeric_limits<float>::infinity()};
  REQUIRE_THROWS_WITH(call({0, 3, 5}, {0, 4, 5}, o), f + "sinks[1] is inf: must be finite");
  o = {};
  o.sink_tokens = -1;
  REQUIRE_THROWS_WITH(call({0, 3, 5}, {0, 4, 5}, o), f + "sink_tokens is -1: must be >= 0");

  // packed_view's own rules: the view of all tokens, not a batched or packed one.
  const std::vector<Index> cu_q{0, 3, 5}, cu_k{0, 4, 5}, cu_other{0, 2, 5};
  REQUIRE_THROWS_WITH(attn::packed_view(attn::blhd_view(q.data.data(), 5, 1, 2, 4), cu_q),
                      pv + "tokens is [5, 2, 1, 4]: it must be the (1, H, T, D) view of all "
                           "tokens (e.g. blhd_view(data, 1, T, H, D))");
  REQUIRE_THROWS_WITH(attn::packed_view(q.packed(), cu_q),
                      pv + "tokens is [2, 2, 3, 4], already packed: it must be the (1, H, T, D) "
                           "view of all tokens (e.g. blhd_view(data, 1, T, H, D))");
  // Packed and padded views mixed; the query side on other sequences than out.
  const Packed<float> q1({5}, 2, 4, rng), k1({5}, 1, 4, rng), v1({5}, 1, 4, rng);
  Packed<float> out1({5}, 2, 4, rng);
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_into<float>(q1.packed(), k1.all(),
                                                                     v1.packed(), out1.packed()),
                      f + "q is a packed view but k is not: pass packed views (packed_view()) "
                          "for all tensors or for none");
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention_into<float>(q1.all(), k1.all(), v1.all(), out1.packed()),
      f + "out is a packed view but q is not: pass packed views (packed_view()) "
          "for all tensors or for none");
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention_into<float>(q.packed(), k.packed(), v.packed(),
                                                     attn::packed_view(out.all(), cu_other)),
      f + "out holds other sequences than q ([0, 2, 5] against [0, 3, 5]): pack it with q's "
          "cu_seqlens");
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention_into<float>(
          q.packed(), k.packed(), attn::packed_view(v.all(), cu_other), out.packed()),
      f + "v holds other sequences than k ([0, 2, 5] against [0, 4, 5]): pack it with k's "
          "cu_seqlens");
  // A view built by hand whose offsets are not a packed view's.
  attn::HeadsView<const float> forged = q.packed();
  forged.length = 2;
  attn::HeadsView<float> forged_out = out.packed();
  forged_out.length = 2;
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention_into<float>(forged, k.packed(), v.packed(), forged_out),
      f + "q's row offsets [0, 3, 5] with length 2 are not a packed view's: "
          "build it with packed_view()");
  // Out of the wrong shape, weights, the value form, and out over k's memory.
  Packed<float> narrow({3, 2}, 2, 3, rng);
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_into<float>(q.packed(), k.packed(),
                                                                     v.packed(), narrow.packed()),
                      f + "out is [2, 2, 3, 3] but must be [2, 2, 3, 4] (B, Hq, Lq, Dv)");
  std::vector<float> weights(2 * 2 * 3 * 4);
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_into<float>(
                          q.packed(), k.packed(), v.packed(),
                          attn::AttentionOutputViews{out.packed(), std::nullopt,
                                                     attn::bhld_view(weights.data(), 2, 2, 3, 4)},
                          {}),
                      f + "weights are not available for packed views: pad the sequences");
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(q.packed(), k.packed(), v.packed()),
                      f + "packed views need a packed output: call "
                          "scaled_dot_product_attention_into with packed_view() of the output "
                          "tokens");
  Packed<float> kv_out({5}, 1, 4, rng);  // k and an out over the same memory
  const attn::HeadsView<float> k_memory =
      attn::packed_view(attn::blhd_view(kv_out.data.data(), 1, 5, 1, 4), cu_k);
  const Packed<float> q_one_head({3, 2}, 1, 4, rng);
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_into<float>(
                          q_one_head.packed(), attn::HeadsView<const float>(k_memory), v.packed(),
                          attn::packed_view(attn::blhd_view(kv_out.data.data(), 1, 5, 1, 4), cu_q)),
                      f + "out overlaps k: out must be q itself (in place) or share no element "
                          "with q, k and v");

  // Per-sequence lengths in the padded entry point.
  attn::Tensor<float, 4> q4(2, 2, 3, 4), k4(2, 1, 5, 4), v4(2, 1, 5, 4);
  q4.setZero();
  k4.setZero();
  v4.setZero();
  const std::string g = "scaled_dot_product_attention: ";
  attn::AttentionOptions<float> p;
  p.query_lengths = {3};
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(q4, k4, v4, p),
                      g + "query_lengths has 1 entries but the batch size is 2");
  p.query_lengths = {3, 4};
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(q4, k4, v4, p),
                      g + "query_lengths[1] is 4: must lie in [0, Lq] with Lq = 3");
  p.query_lengths = {};
  p.key_lengths = {-1, 2};
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(q4, k4, v4, p),
                      g + "key_lengths[0] is -1: must lie in [0, Lk] with Lk = 5");
  // KVCache::attend decides the lengths itself.
  attn::KVCache<float> cache(2, 1, 4, 4, 4);
  attn::AttentionOptions<float> c;
  c.query_lengths = {1, 1};
  Heads<float> qc(2, 2, 1, 4), oc(2, 2, 1, 4);
  REQUIRE_THROWS_WITH(cache.attend_into(qc.cview(), oc.view(), c),
                      Contains("options.causal, options.key_lengths and options.query_lengths "
                               "must be unset"));
}

namespace {

template <class T>
void forward_packed_equals_forward_of_each_sequence() {
  const double rtol = std::is_same_v<T, float> ? 2e-5 : 1e-12;
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 32;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.seed = 7;
  const attn::MultiHeadAttention<T> mha(config);
  const std::vector<Index> lengths{5, 0, 12, 1};
  std::vector<Index> offsets{0};
  for (const Index n : lengths)
    offsets.push_back(offsets.back() + n);
  std::mt19937 rng(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  attn::Tensor<T, 2> x(offsets.back(), 32);
  for (Index n = 0; n < x.size(); ++n)
    x.data()[n] = static_cast<T>(normal(rng));
  attn::AttentionOptions<T> causal;
  causal.causal = Causal::top_left;
  const attn::Tensor<T, 2> packed = mha.forward_packed(x, offsets, causal);
  REQUIRE(packed.dimension(0) == offsets.back());
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] == 0)
      continue;
    attn::Tensor<T, 3> one(1, lengths[b], 32);
    for (Index t = 0; t < lengths[b]; ++t)
      for (Index e = 0; e < 32; ++e)
        one(0, t, e) = x(offsets[b] + t, e);
    attn::MultiHeadForwardOptions<T> is_causal;
    is_causal.is_causal = true;
    const attn::Tensor<T, 3> expected = mha.forward(one, is_causal).output;
    for (Index t = 0; t < lengths[b]; ++t)
      for (Index e = 0; e < 32; ++e) {
        INFO("sequence " << b << ", token " << t << ", feature " << e);
        REQUIRE(static_cast<double>(packed(offsets[b] + t, e)) ==
                Approx(static_cast<double>(expected(0, t, e))).epsilon(rtol).margin(rtol));
      }
  }
  attn::Tensor<T, 2> narrow(offsets.back(), 31);
  REQUIRE_THROWS_WITH(mha.forward_packed(narrow, offsets),
                      "MultiHeadAttention::forward_packed: x is [18, 31] but embed_dim is 32: "
                      "widths differ");
  REQUIRE_THROWS_WITH(mha.forward_packed(x, {0, 5, 17}),
                      "MultiHeadAttention::forward_packed: cu_seqlens is [0, 5, 17]: its last "
                      "entry must equal the number of tokens, 18");
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "MultiHeadAttention::forward_packed equals forward() of each "
    "sequence alone",
    "[packed][multihead]", forward_packed_equals_forward_of_each_sequence)
