// Tests for rotary position embeddings where models use them: KVCache::append with a
// RotaryEmbedding (keys rotated once, at lengths[b] + t, ragged sequences included) and
// MultiHeadAttention's config.rotary in forward, forward_packed and forward_incremental,
// against the torch float64 fixtures of tests/reference/generate_rope.py ("attention_cases")
// and against plain long double loops written from the formulas; every new error message.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <attn/kv_cache.hpp>
#include <attn/multihead.hpp>
#include <attn/rope.hpp>

#include "support/fixtures.hpp"
#include "support/isa_cases.hpp"

using attn::Index;
using attn_test::json;
using Catch::Matchers::Contains;

namespace {

using LD = long double;

/// Row x (D) rotated at position p with no scaling, from the formula: pair i of the first
/// R features (i, i + R/2 for half_split; 2i, 2i + 1 for interleaved) turns by p base^(-2i/R).
std::vector<LD> rotated_row(const std::vector<LD>& x, Index p, Index rotary_dim, double base,
                            attn::RopePairing pairing) {
  std::vector<LD> out = x;
  const Index half = rotary_dim / 2;
  for (Index i = 0; i < half; ++i) {
    const LD angle =
        static_cast<LD>(p) * std::pow(static_cast<LD>(base), -static_cast<LD>(2 * i) / rotary_dim);
    const bool split = pairing == attn::RopePairing::half_split;
    const auto j0 = static_cast<std::size_t>(split ? i : 2 * i);
    const auto j1 = static_cast<std::size_t>(split ? i + half : 2 * i + 1);
    out[j0] = x[j0] * std::cos(angle) - x[j1] * std::sin(angle);
    out[j1] = x[j1] * std::cos(angle) + x[j0] * std::sin(angle);
  }
  return out;
}

/// softmax(q k^T / sqrt(D)) v over keys [0, visible) of one head, in long double.
std::vector<LD> attend_row(const std::vector<LD>& q, const std::vector<std::vector<LD>>& keys,
                           const std::vector<std::vector<LD>>& values, std::size_t visible) {
  std::vector<LD> scores(visible);
  LD top = -INFINITY;
  for (std::size_t j = 0; j < visible; ++j) {
    LD s = 0;
    for (std::size_t d = 0; d < q.size(); ++d)
      s += q[d] * keys[j][d];
    scores[j] = s / std::sqrt(static_cast<LD>(q.size()));
    top = std::max(top, scores[j]);
  }
  LD total = 0;
  for (LD& s : scores) {
    s = std::exp(s - top);
    total += s;
  }
  std::vector<LD> out(values.at(0).size(), 0);
  for (std::size_t j = 0; j < visible; ++j)
    for (std::size_t d = 0; d < out.size(); ++d)
      out[d] += scores[j] / total * values[j][d];
  return out;
}

template <class T>
attn::Tensor<T, 4> random_tensor(Index b, Index h, Index l, Index d, std::mt19937& rng) {
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  attn::Tensor<T, 4> t(b, h, l, d);
  for (Index n = 0; n < t.size(); ++n)
    t.data()[n] = static_cast<T>(uniform(rng));
  return t;
}

template <class T>
std::vector<LD> row_of(const attn::Tensor<T, 4>& t, Index b, Index h, Index l) {
  std::vector<LD> row(static_cast<std::size_t>(t.dimension(3)));
  for (Index d = 0; d < t.dimension(3); ++d)
    row[static_cast<std::size_t>(d)] = static_cast<LD>(static_cast<double>(t(b, h, l, d)));
  return row;
}

// ---------------------------------------------------------------------------------------
// KVCache::append with a RotaryEmbedding
// ---------------------------------------------------------------------------------------

/// A ragged prompt (counts), then single tokens: every cache row j of sequence b must be
/// the raw key rotated once at position j, across growth, with values untouched.
template <class S>
void check_cache_keys_rotated_once(attn::RopePairing pairing, Index rotary_dim) {
  using C = typename attn::KVCache<S>::compute_type;
  const Index batch = 2, kv_heads = 2, dim = 8, value_dim = 6, prompt = 5, steps = 3;
  attn::RopeConfig rc;
  rc.dim = dim;
  rc.rotary_dim = rotary_dim;
  rc.pairing = pairing;
  rc.max_positions = 16;
  const attn::RotaryEmbedding<C> rope(rc);
  attn::KVCache<S> cache(batch, kv_heads, dim, value_dim, 2);  // grows twice on the way
  std::mt19937 rng(3);
  const std::vector<Index> counts{5, 3};
  // raw[b][h][j]: the key of cache row j before rotation
  std::vector<std::vector<std::vector<std::vector<LD>>>> raw(
      2, std::vector<std::vector<std::vector<LD>>>(2));
  std::vector<std::vector<std::vector<std::vector<LD>>>> raw_values = raw;
  const auto record = [&](const attn::Tensor<C, 4>& k, const attn::Tensor<C, 4>& v,
                          const std::vector<Index>& n) {
    for (Index b = 0; b < batch; ++b)
      for (Index h = 0; h < kv_heads; ++h)
        for (Index t = 0; t < n[static_cast<std::size_t>(b)]; ++t) {
          raw[static_cast<std::size_t>(b)][static_cast<std::size_t>(h)].push_back(
              row_of(k, b, h, t));
          raw_values[static_cast<std::size_t>(b)][static_cast<std::size_t>(h)].push_back(
              row_of(v, b, h, t));
        }
  };
  const attn::Tensor<C, 4> k0 = random_tensor<C>(batch, kv_heads, prompt, dim, rng);
  const attn::Tensor<C, 4> v0 = random_tensor<C>(batch, kv_heads, prompt, value_dim, rng);
  const attn::Tensor<C, 4> k0_copy = k0;
  cache.append(k0, v0, rope, counts);
  record(k0, v0, counts);
  // the caller's keys are not rotated in place
  REQUIRE(std::equal(k0.data(), k0.data() + k0.size(), k0_copy.data()));
  for (Index step = 0; step < steps; ++step) {
    const attn::Tensor<C, 4> k = random_tensor<C>(batch, kv_heads, 1, dim, rng);
    const attn::Tensor<C, 4> v = random_tensor<C>(batch, kv_heads, 1, value_dim, rng);
    cache.append(k, v, rope);
    record(k, v, {1, 1});
  }
  REQUIRE(cache.lengths() == std::vector<Index>{prompt + steps, 3 + steps});
  REQUIRE(cache.capacity() >= prompt + steps);
  // float: one rounding of a rotated |x| < 1.5; double: the table's; 16-bit: one rounding
  const double tol = std::is_same_v<S, double>        ? 1e-14
                     : std::is_same_v<S, float>       ? 1e-6
                     : std::is_same_v<S, Eigen::half> ? 1e-3
                                                      : 8e-3;
  const attn::HeadsView<const S> keys = cache.keys_view();
  const attn::HeadsView<const S> values = cache.values_view();
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < kv_heads; ++h) {
      for (Index j = 0; j < cache.lengths()[static_cast<std::size_t>(b)]; ++j) {
        const auto& r = raw[static_cast<std::size_t>(b)][static_cast<std::size_t>(h)];
        const std::vector<LD> want =
            rotated_row(r[static_cast<std::size_t>(j)], j, rope.rotary_dim(), 10000.0, pairing);
        for (Index d = 0; d < dim; ++d) {
          const double got = static_cast<double>(keys.head(b, h)(j, d));
          INFO("b " << b << " h " << h << " row " << j << " d " << d);
          REQUIRE(std::abs(got - static_cast<double>(want[static_cast<std::size_t>(d)])) <= tol);
          if (d >= rope.rotary_dim())  // the tail is copied, not rotated
            REQUIRE(got == static_cast<double>(static_cast<S>(static_cast<C>(
                               r[static_cast<std::size_t>(j)][static_cast<std::size_t>(d)]))));
        }
        for (Index d = 0; d < value_dim; ++d) {
          const LD v = raw_values[static_cast<std::size_t>(b)][static_cast<std::size_t>(h)]
                                 [static_cast<std::size_t>(j)][static_cast<std::size_t>(d)];
          REQUIRE(static_cast<double>(values.head(b, h)(j, d)) ==
                  static_cast<double>(static_cast<S>(static_cast<C>(v))));
        }
      }
    }
  }
}

/// Ragged prompts then decode steps, the queries rotated at lengths() before each append:
/// KVCache::attend must equal long double causal attention on the rotated sequences (GQA).
template <class T>
void rotary_decode_equals_attention_on_rotated_sequences() {
  const Index batch = 2, heads = 4, kv_heads = 2, dim = 8, prompt = 6, steps = 4;
  attn::RopeConfig rc;
  rc.dim = dim;
  rc.max_positions = 32;
  const attn::RotaryEmbedding<T> rope(rc);
  attn::KVCache<T> cache(batch, kv_heads, dim, dim, 4);
  std::mt19937 rng(11);
  const std::vector<Index> counts{6, 2};
  std::vector<std::vector<std::vector<std::vector<LD>>>> keys(
      2, std::vector<std::vector<std::vector<LD>>>(2));
  std::vector<std::vector<std::vector<std::vector<LD>>>> values = keys;
  const auto record = [&](const attn::Tensor<T, 4>& k, const attn::Tensor<T, 4>& v,
                          const std::vector<Index>& n) {
    for (Index b = 0; b < batch; ++b)
      for (Index h = 0; h < kv_heads; ++h)
        for (Index t = 0; t < n[static_cast<std::size_t>(b)]; ++t) {
          auto& kb = keys[static_cast<std::size_t>(b)][static_cast<std::size_t>(h)];
          kb.push_back(rotated_row(row_of(k, b, h, t), static_cast<Index>(kb.size()), dim, 10000.0,
                                   attn::RopePairing::half_split));
          values[static_cast<std::size_t>(b)][static_cast<std::size_t>(h)].push_back(
              row_of(v, b, h, t));
        }
  };
  const attn::Tensor<T, 4> k0 = random_tensor<T>(batch, kv_heads, prompt, dim, rng);
  const attn::Tensor<T, 4> v0 = random_tensor<T>(batch, kv_heads, prompt, dim, rng);
  cache.append(k0, v0, rope, counts);
  record(k0, v0, counts);
  const double rtol = std::is_same_v<T, float> ? 2e-6 : 1e-13;
  for (Index step = 0; step < steps; ++step) {
    attn::Tensor<T, 4> q = random_tensor<T>(batch, heads, 1, dim, rng);
    const attn::Tensor<T, 4> q_raw = q;
    const attn::Tensor<T, 4> k = random_tensor<T>(batch, kv_heads, 1, dim, rng);
    const attn::Tensor<T, 4> v = random_tensor<T>(batch, kv_heads, 1, dim, rng);
    const std::vector<Index> positions = cache.lengths();
    rope.apply(q, positions);
    cache.append(k, v, rope);
    record(k, v, {1, 1});
    const attn::Tensor<T, 4> out = cache.attend(q);
    for (Index b = 0; b < batch; ++b) {
      for (Index h = 0; h < heads; ++h) {
        const std::size_t g = static_cast<std::size_t>(attn::kv_head_for(h, heads, kv_heads));
        const Index p = positions[static_cast<std::size_t>(b)];
        const std::vector<LD> qr =
            rotated_row(row_of(q_raw, b, h, 0), p, dim, 10000.0, attn::RopePairing::half_split);
        const std::vector<LD> want =
            attend_row(qr, keys[static_cast<std::size_t>(b)][g],
                       values[static_cast<std::size_t>(b)][g], static_cast<std::size_t>(p + 1));
        for (Index d = 0; d < dim; ++d) {
          const double e = static_cast<double>(want[static_cast<std::size_t>(d)]);
          INFO("step " << step << " b " << b << " h " << h << " d " << d);
          REQUIRE(std::abs(static_cast<double>(out(b, h, 0, d)) - e) <=
                  rtol * std::max(std::abs(e), 1.0));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// MultiHeadAttention with config.rotary
// ---------------------------------------------------------------------------------------

const json& attention_cases() {
  return ATTN_FIXTURE_CASES("rope.json", "attention_cases", 4);
}

attn::RopeConfig rope_config_of(const json& c) {
  attn::RopeConfig rc;
  rc.dim = c.at("dim").get<Index>();
  rc.rotary_dim = c.at("rotary_dim").get<Index>();
  rc.base = c.at("base").get<double>();
  rc.pairing = c.at("pairing") == "interleaved" ? attn::RopePairing::interleaved
                                                : attn::RopePairing::half_split;
  rc.max_positions = c.at("max_positions").get<Index>();
  const std::string scaling = c.at("scaling").get<std::string>();
  REQUIRE((scaling == "none" || scaling == "yarn"));
  rc.scaling = scaling == "yarn" ? attn::RopeScaling::yarn : attn::RopeScaling::none;
  rc.factor = c.at("factor").get<double>();
  rc.original_max_positions = c.at("original_max_positions").get<Index>();
  rc.beta_fast = c.at("beta_fast").get<double>();
  rc.beta_slow = c.at("beta_slow").get<double>();
  rc.truncate = c.at("truncate").get<bool>();
  return rc;
}

template <class T>
attn::MultiHeadAttention<T> module_of(const json& c) {
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = c.at("embed_dim").get<Index>();
  config.num_heads = c.at("num_heads").get<Index>();
  config.num_kv_heads = c.at("num_kv_heads").get<Index>();
  config.bias = c.at("bias").get<bool>();
  config.rotary = rope_config_of(c);
  attn::StateDict<T> state;
  for (const auto& [name, t] : c.at("state_dict").items())
    state[name] = {attn_test::shape_of(t), attn_test::values<T>(t)};
  return attn::MultiHeadAttention<T>::from_state_dict(config, state);
}

template <class T>
void multihead_rotary_matches_the_torch_fixtures() {
  for (const json& c : attention_cases()) {
    SECTION(c.at("name").get<std::string>()) {
      const attn::MultiHeadAttention<T> mha = module_of<T>(c);
      REQUIRE(mha.has_rotary());
      const std::vector<double> expected = attn_test::values_of(c.at("output"));
      const double rtol = attn_test::tolerance<T>();
      if (c.contains("cu_seqlens")) {
        const attn::Tensor<T, 2> x = attn_test::tensor<T, 2>(c.at("x"));
        const auto cu = c.at("cu_seqlens").get<std::vector<Index>>();
        attn::AttentionOptions<T> causal;
        causal.causal = c.at("causal").get<bool>() ? attn::Causal::top_left : attn::Causal::none;
        const attn::Tensor<T, 2> y = mha.forward_packed(x, cu, causal);
        ATTN_REQUIRE_CLOSE(y.data(), y.size(), expected, rtol);
        // each sequence alone through forward() gives the same rows
        for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
          const Index n = cu[b + 1] - cu[b], e = x.dimension(1);
          attn::Tensor<T, 3> seq(1, n, e);
          std::copy(x.data() + cu[b] * e, x.data() + cu[b + 1] * e, seq.data());
          attn::MultiHeadForwardOptions<T> options;
          options.is_causal = c.at("causal").get<bool>();
          const attn::Tensor<T, 3> alone = mha.forward(seq, options).output;
          const std::vector<double> rows(expected.begin() + cu[b] * e,
                                         expected.begin() + cu[b + 1] * e);
          ATTN_REQUIRE_CLOSE(alone.data(), alone.size(), rows, rtol);
        }
      } else {
        const attn::Tensor<T, 3> query = attn_test::tensor<T, 3>(c.at("query"));
        attn::MultiHeadForwardOptions<T> options;
        options.is_causal = c.at("causal").get<bool>();
        attn::Tensor<T, 3> y;
        if (c.at("key").is_null()) {
          y = mha.forward(query, options).output;
        } else {
          const attn::Tensor<T, 3> key = attn_test::tensor<T, 3>(c.at("key"));
          const attn::Tensor<T, 3> value = attn_test::tensor<T, 3>(c.at("value"));
          y = mha.forward(query, key, value, options).output;
        }
        ATTN_REQUIRE_CLOSE(y.data(), y.size(), expected, rtol);
      }
    }
  }
}

attn::MultiHeadAttentionConfig gqa_rotary_config() {
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 32;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.seed = 5;
  attn::RopeConfig rc;  // dim 0: the head dim
  rc.max_positions = 64;
  config.rotary = rc;
  return config;
}

template <class T>
attn::Tensor<T, 3> random_input(Index batch, Index length, Index width, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  attn::Tensor<T, 3> x(batch, length, width);
  for (Index n = 0; n < x.size(); ++n)
    x.data()[n] = static_cast<T>(normal(rng));
  return x;
}

/// Chunks of a sequence through forward_incremental (prompt, single tokens, a chunk) equal
/// the causal forward of the whole sequence: each key rotated once, at its position.
template <class T>
void rotary_incremental_decoding_equals_the_causal_forward() {
  const attn::MultiHeadAttention<T> mha(gqa_rotary_config());
  REQUIRE(mha.rotary().dim() == 8);
  const Index batch = 2, length = 10;
  const attn::Tensor<T, 3> x = random_input<T>(batch, length, 32, 21);
  attn::MultiHeadForwardOptions<T> causal;
  causal.is_causal = true;
  const attn::Tensor<T, 3> expected = mha.forward(x, causal).output;
  // float: the two paths sum in different orders (GEMM shapes, decode vs flash kernels)
  const double rtol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  attn::KVCache<T> cache(batch, 2, 8, 8, 4);
  Index t0 = 0;
  for (const Index n : {Index(5), Index(1), Index(1), Index(3)}) {
    attn::Tensor<T, 3> chunk(batch, n, 32);
    for (Index b = 0; b < batch; ++b)
      for (Index t = 0; t < n; ++t)
        for (Index e = 0; e < 32; ++e)
          chunk(b, t, e) = x(b, t0 + t, e);
    const attn::Tensor<T, 3> y = mha.forward_incremental(chunk, cache);
    std::vector<double> want;
    for (Index b = 0; b < batch; ++b)
      for (Index t = 0; t < n; ++t)
        for (Index e = 0; e < 32; ++e)
          want.push_back(static_cast<double>(expected(b, t0 + t, e)));
    attn::Tensor<T, 3> got_bte = y;  // (B, n, E) row-major, the order of want
    INFO("chunk at " << t0);
    ATTN_REQUIRE_CLOSE(got_bte.data(), got_bte.size(), want, rtol);
    t0 += n;
  }
  REQUIRE(cache.lengths() == std::vector<Index>{length, length});
  // The cache holds the keys rotated once: the projection of x rotated at its position.
  const attn::ConstRowsMap<T> w = mha.in_proj().fused_weight();  // (E, E + 2*Ekv)
  const attn::Vector<T>& bias = mha.in_proj().bias();
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < 2; ++h)
      for (Index j = 0; j < length; ++j) {
        std::vector<LD> k(8);
        for (Index d = 0; d < 8; ++d) {
          LD s = static_cast<LD>(bias(32 + h * 8 + d));
          for (Index e = 0; e < 32; ++e)
            s += static_cast<LD>(x(b, j, e)) * static_cast<LD>(w(e, 32 + h * 8 + d));
          k[static_cast<std::size_t>(d)] = s;
        }
        const std::vector<LD> want = rotated_row(k, j, 8, 10000.0, attn::RopePairing::half_split);
        for (Index d = 0; d < 8; ++d) {
          const double e = static_cast<double>(want[static_cast<std::size_t>(d)]);
          REQUIRE(std::abs(static_cast<double>(cache.keys_view().head(b, h)(j, d)) - e) <=
                  rtol * std::max(std::abs(e), 1.0));
        }
      }
}

}  // namespace

TEST_CASE("KVCache::append with rotary rotates each key once, at lengths[b] + t",
          "[rope][kv_cache]") {
  SECTION("float, half_split") {
    check_cache_keys_rotated_once<float>(attn::RopePairing::half_split, 8);
  }
  SECTION("float, partial interleaved") {
    check_cache_keys_rotated_once<float>(attn::RopePairing::interleaved, 6);
  }
  SECTION("double, partial half_split") {
    check_cache_keys_rotated_once<double>(attn::RopePairing::half_split, 4);
  }
  SECTION("half, rotated in float and rounded once") {
    check_cache_keys_rotated_once<Eigen::half>(attn::RopePairing::half_split, 8);
  }
  SECTION("bfloat16, rotated in float and rounded once") {
    check_cache_keys_rotated_once<Eigen::bfloat16>(attn::RopePairing::interleaved, 8);
  }
}

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "rotary decode with ragged prompts and GQA equals attention on the rotated sequences",
    "[rope][kv_cache]", rotary_decode_equals_attention_on_rotated_sequences)

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("MultiHeadAttention with rotary matches the torch fixtures",
                                    "[rope][multihead]",
                                    multihead_rotary_matches_the_torch_fixtures)

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "rotary forward_incremental in chunks equals the causal forward (GQA)", "[rope][multihead]",
    rotary_incremental_decoding_equals_the_causal_forward)

TEST_CASE("rotary forward_incremental with 16-bit caches and a half module",
          "[rope][multihead][isa]") {
  const attn::MultiHeadAttention<float> mha(gqa_rotary_config());
  const attn::Tensor<float, 3> x = random_input<float>(1, 6, 32, 4);
  attn::MultiHeadForwardOptions<float> causal;
  causal.is_causal = true;
  const attn::Tensor<float, 3> expected = mha.forward(x, causal).output;
  attn::KVCache<Eigen::half> half_cache(1, 2, 8, 8, 8);
  attn::KVCache<Eigen::bfloat16> bf16_cache(1, 2, 8, 8, 8);
  const attn::Tensor<float, 3> y_half = mha.forward_incremental(x, half_cache);
  const attn::Tensor<float, 3> y_bf16 = mha.forward_incremental(x, bf16_cache);
  for (Index n = 0; n < y_half.size(); ++n) {
    REQUIRE(std::abs(y_half.data()[n] - expected.data()[n]) <= 5e-3f);  // 11 significant bits
    REQUIRE(std::abs(y_bf16.data()[n] - expected.data()[n]) <= 3e-2f);  // 8 significant bits
  }
  // A half module: its forward and its incremental decoding agree within half's rounding.
  const attn::MultiHeadAttention<Eigen::half> half_mha =
      attn::MultiHeadAttention<Eigen::half>::from_state_dict(gqa_rotary_config(), [&] {
        attn::StateDict<Eigen::half> sd;
        for (const auto& [name, t] : mha.state_dict()) {
          std::vector<Eigen::half> data(t.data.size());
          std::transform(t.data.begin(), t.data.end(), data.begin(),
                         [](float v) { return Eigen::half(v); });
          sd[name] = {t.shape, data};
        }
        return sd;
      }());
  const attn::Tensor<Eigen::half, 3> xh = x.cast<Eigen::half>();
  attn::MultiHeadForwardOptions<Eigen::half> half_causal;
  half_causal.is_causal = true;
  const attn::Tensor<Eigen::half, 3> full = half_mha.forward(xh, half_causal).output;
  attn::KVCache<float> float_cache(1, 2, 8, 8, 8);
  const attn::Tensor<Eigen::half, 3> step = half_mha.forward_incremental(xh, float_cache);
  for (Index n = 0; n < full.size(); ++n) {
    REQUIRE(std::abs(static_cast<float>(full.data()[n]) - expected.data()[n]) <= 2e-2f);
    REQUIRE(std::abs(static_cast<float>(step.data()[n]) - static_cast<float>(full.data()[n])) <=
            1e-2f);
  }
}

TEST_CASE("rotary errors name the function and the offending values", "[rope][errors]") {
  SECTION("MultiHeadAttention config") {
    attn::MultiHeadAttentionConfig config = gqa_rotary_config();
    config.rotary->dim = 16;
    REQUIRE_THROWS_WITH(attn::MultiHeadAttention<float>(config),
                        "MultiHeadAttention: rotary->dim 16 differs from the head dim 8 (embed_dim "
                        "32 / num_heads 4; 0 means the head dim)");
    config.rotary->dim = 0;
    config.rotary->rotary_dim = 10;
    REQUIRE_THROWS_WITH(attn::MultiHeadAttention<float>(config),
                        "MultiHeadAttention: rotary: RotaryEmbedding: rotary_dim 10 must be even "
                        "and in [2, dim] (dim 8)");
    config.rotary->rotary_dim = 0;
    config.add_bias_kv = true;
    REQUIRE_THROWS_WITH(attn::MultiHeadAttention<float>(config),
                        "MultiHeadAttention: rotary cannot be combined with add_bias_kv or "
                        "add_zero_attn: the appended key rows have no position");
  }
  attn::MultiHeadAttentionConfig config = gqa_rotary_config();
  config.rotary->max_positions = 6;
  const attn::MultiHeadAttention<float> mha(config);
  SECTION("forward beyond the table") {
    const attn::Tensor<float, 3> x = random_input<float>(1, 7, 32, 1);
    REQUIRE_THROWS_WITH(mha.forward(x),
                        "MultiHeadAttention::forward: query is [1, 7, 32] and key "
                        "is [1, 7, 32] but the rotary table holds positions [0, "
                        "6) (config.rotary->max_positions)");
  }
  SECTION("forward_incremental beyond the table leaves the cache unchanged") {
    attn::KVCache<float> cache(1, 2, 8, 8, 8);
    REQUIRE_NOTHROW(mha.forward_incremental(random_input<float>(1, 4, 32, 2), cache));
    REQUIRE_THROWS_WITH(mha.forward_incremental(random_input<float>(1, 3, 32, 3), cache),
                        "MultiHeadAttention::forward_incremental: sequence 0 holds 4 tokens: its "
                        "3 new tokens need rotary positions [4, 7) but the table holds [0, 6) "
                        "(config.rotary->max_positions)");
    REQUIRE(cache.lengths() == std::vector<Index>{4});
  }
  SECTION("forward_packed: offsets and lengths") {
    const attn::Tensor<float, 2> x(9, 32);
    REQUIRE_THROWS_WITH(mha.forward_packed(x, {0, 2, 9}),
                        "MultiHeadAttention::forward_packed: sequence 1 has 7 tokens but the "
                        "rotary table holds positions [0, 6) (config.rotary->max_positions)");
    REQUIRE_THROWS_WITH(mha.forward_packed(x, {0, 5, 8}),
                        "MultiHeadAttention::forward_packed: cu_seqlens is [0, 5, 8]: its last "
                        "entry must equal the number of tokens, 9");
    REQUIRE_THROWS_WITH(mha.forward_packed(x, {0, 5, 4, 9}),
                        Contains("MultiHeadAttention::forward_packed: cu_seqlens is [0, 5, 4, 9]: "
                                 "offsets must not decrease"));
  }
  SECTION("KVCache::append") {
    attn::KVCache<float> cache(2, 2, 8, 8, 4);
    std::mt19937 rng(1);
    const attn::Tensor<float, 4> k = random_tensor<float>(2, 2, 3, 8, rng);
    attn::RopeConfig rc;
    rc.dim = 4;
    rc.max_positions = 4;
    REQUIRE_THROWS_WITH(cache.append(k, k, attn::RotaryEmbedding<float>(rc)),
                        "KVCache::append: the rotary embedding's head dim is 4 but the cache's "
                        "key head dim D is 8");
    REQUIRE_THROWS_WITH(cache.append(k, k, attn::RotaryEmbedding<float>()),
                        "KVCache::append: the rotary embedding is empty (default-constructed)");
    rc.dim = 8;
    const attn::RotaryEmbedding<float> rope(rc);
    cache.append(k, k, rope, {3, 1});
    REQUIRE_THROWS_WITH(cache.append(k, k, rope, {2, 0}),
                        "KVCache::append: sequence 0 holds 3 tokens: its 2 new keys need "
                        "positions [3, 5) but the rotary table holds [0, 4)");
    REQUIRE(cache.lengths() == std::vector<Index>{3, 1});
    REQUIRE_THROWS_WITH(cache.append(k, k, rope, {1}),
                        "KVCache::append: counts has 1 entries but the batch size is 2");
  }
}
