// Tests for attn/rope.hpp: every torch fixture case (tests/reference/generate_rope.py) in
// float, double, half and bfloat16, through (B, H, L, D), (B, L, H, D) and packed views;
// the pairings against each other, the untouched tail of partial rotation, the relative
// position property, per-sequence offsets and every validation error.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <attn/rope.hpp>

#include "support/fixtures.hpp"
#include "support/isa_cases.hpp"

using attn::Index;
using attn_test::json;

namespace {

constexpr std::size_t rope_case_count = 10;

const json& rope_cases() {
  return ATTN_FIXTURE_CASES("rope.json", "cases", rope_case_count);
}

const json& rope_case(const std::string& name) {
  for (const json& c : rope_cases()) {
    if (c.at("name") == name)
      return c;
  }
  throw std::runtime_error("no rope case " + name);
}

attn::RopeScaling scaling_of(const std::string& name) {
  for (const attn::RopeScaling s :
       {attn::RopeScaling::none, attn::RopeScaling::linear, attn::RopeScaling::ntk_aware,
        attn::RopeScaling::yarn, attn::RopeScaling::llama3}) {
    if (name == attn::rope_scaling_name(s))
      return s;
  }
  throw std::runtime_error("unknown scaling " + name);
}

attn::RopeConfig config_of(const json& c) {
  attn::RopeConfig config;
  config.dim = c.at("dim").get<Index>();
  config.rotary_dim = c.at("rotary_dim").get<Index>();
  config.base = c.at("base").get<double>();
  config.pairing = c.at("pairing") == "interleaved" ? attn::RopePairing::interleaved
                                                    : attn::RopePairing::half_split;
  config.max_positions = c.at("max_positions").get<Index>();
  config.scaling = scaling_of(c.at("scaling").get<std::string>());
  config.factor = c.at("factor").get<double>();
  config.original_max_positions = c.at("original_max_positions").get<Index>();
  config.beta_fast = c.at("beta_fast").get<double>();
  config.beta_slow = c.at("beta_slow").get<double>();
  config.attention_factor = c.at("attention_factor").get<double>();
  config.mscale = c.at("mscale").get<double>();
  config.mscale_all_dim = c.at("mscale_all_dim").get<double>();
  config.truncate = c.at("truncate").get<bool>();
  config.low_freq_factor = c.at("low_freq_factor").get<double>();
  config.high_freq_factor = c.at("high_freq_factor").get<double>();
  return config;
}

/// The largest position a case uses: the double tolerance grows with it, because the
/// reference rounds the angle p f_i to double (an absolute error of about p * 2^-53).
Index largest_position(const json& c, Index length) {
  Index top = 0;
  if (c.contains("offsets")) {
    for (const json& o : c.at("offsets"))
      top = std::max(top, o.get<Index>() + length - 1);
  } else {
    for (const json& p : c.at("positions"))
      top = std::max(top, p.get<Index>());
  }
  return top;
}

template <class T>
double rope_tolerance(const json& c, Index length) {
  if (std::is_same_v<T, float>)
    return 1e-5;
  if (std::is_same_v<T, double>)
    return std::max(1e-13, 4e-16 * static_cast<double>(largest_position(c, length)));
  // half: the inputs are exact (the fixture's are half values), one rounding of the output
  // (|out| < 4); bfloat16: the inputs are rounded too, and their error turns with the pair
  return std::is_same_v<T, Eigen::half> ? 1e-3 : 1e-2;
}

/// Applies the case's positions (offsets or explicit) to a view of its x.
template <class Table, class S>
void apply_case(const attn::RotaryEmbedding<Table>& rope, const json& c,
                const attn::HeadsView<S>& x) {  // (B, H, L, D)
  if (c.contains("offsets"))
    rope.apply(x, c.at("offsets").get<std::vector<Index>>());
  else
    rope.apply_at(x, c.at("positions").get<std::vector<Index>>());
}

/// (B, H, L, D) -> (B, L, H, D) or back (swap = the middle two dims swapped).
template <class S>
std::vector<S> swap_middle(const std::vector<S>& in, Index b, Index n1, Index n2, Index d) {
  std::vector<S> out(in.size());
  for (Index i = 0; i < b; ++i)
    for (Index j = 0; j < n1; ++j)
      for (Index k = 0; k < n2; ++k)
        for (Index e = 0; e < d; ++e)
          out[static_cast<std::size_t>(((i * n2 + k) * n1 + j) * d + e)] =
              in[static_cast<std::size_t>(((i * n1 + j) * n2 + k) * d + e)];
  return out;
}

/// Every case in storage S with a table of Table, through both layouts.
template <class Table, class S>
void check_fixture_cases() {
  for (const json& c : rope_cases()) {
    SECTION(c.at("name").get<std::string>()) {
      const attn::RotaryEmbedding<Table> rope(config_of(c));
      const std::vector<Index> shape = attn_test::shape_of(c.at("x"));
      const Index batch = shape[0], heads = shape[1], length = shape[2], dim = shape[3];
      const double rtol = rope_tolerance<S>(c, length);
      const std::vector<double> expected = attn_test::values_of(c.at("out"));

      std::vector<S> x = attn_test::values<S>(c.at("x"));
      apply_case(rope, c, attn::bhld_view(x.data(), batch, heads, length, dim));
      ATTN_REQUIRE_CLOSE(x.data(), x.size(), expected, rtol);

      std::vector<S> y = swap_middle(attn_test::values<S>(c.at("x")), batch, heads, length, dim);
      apply_case(rope, c, attn::blhd_view(y.data(), batch, length, heads, dim));
      const std::vector<S> back = swap_middle(y, batch, length, heads, dim);
      REQUIRE(std::equal(back.begin(), back.end(), x.begin()));  // same bits in both layouts
    }
  }
}

template <class T>
void rope_matches_the_torch_fixtures() {
  check_fixture_cases<T, T>();
}

template <class T>
void rope_frequencies_and_table_match_the_fixtures() {
  for (const json& c : rope_cases()) {
    SECTION(c.at("name").get<std::string>()) {
      const attn::RotaryEmbedding<T> rope(config_of(c));
      const std::vector<double> f = attn_test::values_of(c.at("frequencies"));
      REQUIRE(rope.frequencies().size() == f.size());
      std::vector<double> ours(rope.frequencies().begin(), rope.frequencies().end());
      ATTN_REQUIRE_CLOSE(ours.data(), ours.size(), f, 1e-14);
      const double attention = c.at("expected_attention_factor").get<double>();
      REQUIRE(rope.attention_factor() == Approx(attention).epsilon(1e-15));
      // cos and sin at a large position: the table's angle is reduced in long double
      const Index p = rope.max_positions() - 1;
      for (Index i = 0; i < rope.rotary_dim() / 2; ++i) {
        const long double angle =
            static_cast<long double>(p) * rope.frequencies()[static_cast<std::size_t>(i)];
        REQUIRE(static_cast<double>(rope.cos(p, i)) ==
                Approx(attention * static_cast<double>(std::cos(angle))).margin(1e-6));
        REQUIRE(static_cast<double>(rope.sin(p, i)) ==
                Approx(attention * static_cast<double>(std::sin(angle))).margin(1e-6));
      }
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("rope matches the torch fixtures in both layouts", "[rope]",
                                    rope_matches_the_torch_fixtures)

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("rope frequencies and attention factor match the fixtures",
                                    "[rope]", rope_frequencies_and_table_match_the_fixtures)

TEST_CASE("rope on half storage matches the fixtures, rounded once", "[rope][isa]") {
  check_fixture_cases<float, Eigen::half>();
}

TEST_CASE("rope on bfloat16 storage matches the fixtures, rounded once", "[rope][isa]") {
  check_fixture_cases<float, Eigen::bfloat16>();
}

TEST_CASE("rope pairings: half_split and interleaved are different rotations", "[rope]") {
  // The interleaved case's input through the half_split table: its own formula is checked
  // against the fixtures above; here, that the two pairings do not give the same result.
  const json& c = rope_case("interleaved");
  attn::RopeConfig config = config_of(c);
  config.pairing = attn::RopePairing::half_split;
  const attn::RotaryEmbedding<double> half_split(config);
  const std::vector<Index> shape = attn_test::shape_of(c.at("x"));
  attn::Tensor<double, 4> x = attn_test::tensor<double, 4>(c.at("x"));
  half_split.apply(x, c.at("offsets").get<std::vector<Index>>());
  const std::vector<double> interleaved = attn_test::values_of(c.at("out"));
  double largest = 0;
  for (std::size_t n = 0; n < interleaved.size(); ++n)
    largest = std::max(largest, std::abs(x.data()[n] - interleaved[n]));
  REQUIRE(largest > 0.5);
  // ... but at position 0 both are the identity.
  attn::Tensor<double, 4> y = attn_test::tensor<double, 4>(c.at("x"));
  const attn::Tensor<double, 4> y0 = y;
  half_split.apply_at(y, std::vector<Index>(static_cast<std::size_t>(shape[2]), 0));
  REQUIRE(std::equal(y.data(), y.data() + y.size(), y0.data()));
}

TEST_CASE("rope partial rotation leaves features [R, D) untouched, bit for bit", "[rope][isa]") {
  for (const char* name : {"partial_half_split", "partial_interleaved"}) {
    const json& c = rope_case(name);
    const attn::RotaryEmbedding<float> rope(config_of(c));
    const std::vector<Index> shape = attn_test::shape_of(c.at("x"));
    const std::vector<Eigen::half> before = attn_test::values<Eigen::half>(c.at("x"));
    std::vector<Eigen::half> x = before;
    apply_case(rope, c, attn::bhld_view(x.data(), shape[0], shape[1], shape[2], shape[3]));
    const Index dim = shape[3], rotary = rope.rotary_dim();
    Index changed = 0;
    for (std::size_t n = 0; n < x.size(); ++n) {
      if (static_cast<Index>(n) % dim >= rotary)
        REQUIRE(x[n].x == before[n].x);
      else
        changed += x[n].x != before[n].x ? 1 : 0;
    }
    REQUIRE(changed > 0);
  }
}

namespace {

template <class T>
void rope_logits_depend_only_on_the_position_difference() {
  // rot(q, p) . rot(k, m) = q . rot(k, m - p): shifting both positions keeps every logit.
  std::mt19937 gen(7);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  const Index dim = 40, length = 6;
  for (const attn::RopePairing pairing :
       {attn::RopePairing::half_split, attn::RopePairing::interleaved}) {
    for (const attn::RopeScaling scaling : {attn::RopeScaling::none, attn::RopeScaling::yarn}) {
      attn::RopeConfig config;
      config.dim = dim;
      config.rotary_dim = 32;
      config.pairing = pairing;
      config.max_positions = 512;
      config.scaling = scaling;
      if (scaling == attn::RopeScaling::yarn) {
        config.factor = 4;
        config.original_max_positions = 128;
      }
      const attn::RotaryEmbedding<T> rope(config);
      attn::Tensor<T, 4> q(1, 1, length, dim), k(1, 1, length, dim);
      for (Index n = 0; n < q.size(); ++n) {
        q.data()[n] = static_cast<T>(uniform(gen));
        k.data()[n] = static_cast<T>(uniform(gen));
      }
      const auto logits = [&](Index shift) {
        attn::Tensor<T, 4> qs = q, ks = k;
        rope.apply(qs, {shift});
        rope.apply(ks, {shift});
        return attn::Matrix<T>(attn::bhld_view(qs).head(0, 0) *
                               attn::bhld_view(ks).head(0, 0).transpose());
      };
      const attn::Matrix<T> s0 = logits(0);
      for (const Index shift : {Index(1), Index(37), Index(400)}) {
        const attn::Matrix<T> s = logits(shift);
        const double tol = std::is_same_v<T, float> ? 2e-5 : 1e-12;
        REQUIRE((s - s0).cwiseAbs().maxCoeff() <= static_cast<T>(tol * dim));
      }
      // ... and not on the positions only through their sum: rotating k alone changes them
      attn::Tensor<T, 4> ks = k;
      rope.apply(ks, {5});
      const attn::Matrix<T> moved =
          attn::bhld_view(q).head(0, 0) * attn::bhld_view(ks).head(0, 0).transpose();
      const attn::Matrix<T> plain =
          attn::bhld_view(q).head(0, 0) * attn::bhld_view(k).head(0, 0).transpose();
      REQUIRE((moved - plain).cwiseAbs().maxCoeff() > static_cast<T>(0.01));
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("rope logits depend only on the position difference", "[rope]",
                                    rope_logits_depend_only_on_the_position_difference)

TEST_CASE("rope per-sequence offsets, explicit positions and packed views agree", "[rope][isa]") {
  attn::RopeConfig config;
  config.dim = 24;
  config.max_positions = 64;
  const attn::RotaryEmbedding<float> rope(config);
  const Index batch = 2, heads = 3, length = 5, dim = 24;
  const std::vector<Index> offsets = {4, 17};
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  attn::Tensor<float, 4> x(batch, heads, length, dim);
  for (Index n = 0; n < x.size(); ++n)
    x.data()[n] = uniform(gen);

  attn::Tensor<float, 4> by_offsets = x;
  rope.apply(by_offsets, offsets);

  // explicit (B * L) positions
  std::vector<Index> positions;
  for (Index b = 0; b < batch; ++b)
    for (Index t = 0; t < length; ++t)
      positions.push_back(offsets[static_cast<std::size_t>(b)] + t);
  attn::Tensor<float, 4> by_positions = x;
  rope.apply_at(by_positions, positions);
  REQUIRE(
      std::equal(by_offsets.data(), by_offsets.data() + by_offsets.size(), by_positions.data()));

  // each sequence alone, as B = 1 with its offset
  for (Index b = 0; b < batch; ++b) {
    attn::Tensor<float, 4> one(1, heads, length, dim);
    std::copy(x.data() + b * heads * length * dim, x.data() + (b + 1) * heads * length * dim,
              one.data());
    rope.apply(one, {offsets[static_cast<std::size_t>(b)]});
    REQUIRE(std::equal(one.data(), one.data() + one.size(),
                       by_offsets.data() + b * heads * length * dim));
  }

  // shared (L) positions: every sequence at [0, L), the same as no offsets
  attn::Tensor<float, 4> shared = x, from_zero = x;
  rope.apply_at(shared, {0, 1, 2, 3, 4});
  rope.apply(from_zero);
  REQUIRE(std::equal(shared.data(), shared.data() + shared.size(), from_zero.data()));

  // a packed (T, H, D) view of sequences of 2 and 5 tokens: sequence b's rows at offsets[b]
  const std::vector<Index> row_offsets = {0, 2, 7};
  const auto start = [&](Index b) { return row_offsets[static_cast<std::size_t>(b)]; };
  std::vector<float> packed(static_cast<std::size_t>(7 * heads * dim));
  for (Index b = 0; b < batch; ++b)
    for (Index t = 0; t < start(b + 1) - start(b); ++t)
      for (Index h = 0; h < heads; ++h)
        for (Index e = 0; e < dim; ++e)
          packed[static_cast<std::size_t>(((start(b) + t) * heads + h) * dim + e)] = x(b, h, t, e);
  // the public way: all tokens as one (1, H, T, D) sequence, each at its own position
  std::vector<float> tokens = packed;
  std::vector<Index> token_positions;
  for (Index b = 0; b < batch; ++b)
    for (Index t = 0; t < start(b + 1) - start(b); ++t)
      token_positions.push_back(offsets[static_cast<std::size_t>(b)] + t);
  rope.apply_at(attn::blhd_view(tokens.data(), 1, 7, heads, dim), token_positions);
  // a packed view (packed_view(), as attention takes it), with offsets
  rope.apply(attn::packed_view(attn::blhd_view(packed.data(), 1, 7, heads, dim), row_offsets),
             offsets);
  REQUIRE(tokens == packed);
  for (Index b = 0; b < batch; ++b)
    for (Index t = 0; t < start(b + 1) - start(b); ++t)
      for (Index h = 0; h < heads; ++h)
        for (Index e = 0; e < dim; ++e)
          REQUIRE(packed[static_cast<std::size_t>(((start(b) + t) * heads + h) * dim + e)] ==
                  by_offsets(b, h, t, e));
}

TEST_CASE("rope errors name the function and the offending values", "[rope]") {
  attn::RopeConfig good;
  good.dim = 8;
  good.max_positions = 16;
  const auto make = [&](const auto& change) {
    attn::RopeConfig c = good;
    change(c);
    return attn::RotaryEmbedding<double>(c);
  };
  using C = attn::RopeConfig;
  REQUIRE_THROWS_WITH(make([](C& c) { c.dim = 0; }), "RotaryEmbedding: dim 0 must be positive");
  REQUIRE_THROWS_WITH(make([](C& c) { c.rotary_dim = 5; }),
                      "RotaryEmbedding: rotary_dim 5 must be even and in [2, dim] (dim 8)");
  REQUIRE_THROWS_WITH(make([](C& c) { c.rotary_dim = 10; }),
                      "RotaryEmbedding: rotary_dim 10 must be even and in [2, dim] (dim 8)");
  REQUIRE_THROWS_WITH(make([](C& c) { c.base = 1; }),
                      "RotaryEmbedding: base 1 must be finite and > 1");
  REQUIRE_THROWS_WITH(make([](C& c) { c.max_positions = 0; }),
                      "RotaryEmbedding: max_positions 0 must be positive");
  REQUIRE_THROWS_WITH(make([](C& c) { c.factor = 2; }),
                      "RotaryEmbedding: factor is 2 but scaling is none");
  REQUIRE_THROWS_WITH(make([](C& c) {
                        c.scaling = attn::RopeScaling::linear;
                        c.factor = -2;
                      }),
                      "RotaryEmbedding: factor -2 must be finite and > 0 (scaling linear)");
  REQUIRE_THROWS_WITH(make([](C& c) {
                        c.scaling = attn::RopeScaling::ntk_aware;
                        c.factor = 2;
                        c.rotary_dim = 2;
                      }),
                      "RotaryEmbedding: rotary_dim 2 must be at least 4: base is scaled by "
                      "factor^(R / (R - 2)) (scaling ntk_aware)");
  REQUIRE_THROWS_WITH(make([](C& c) {
                        c.scaling = attn::RopeScaling::yarn;
                        c.factor = 4;
                      }),
                      "RotaryEmbedding: original_max_positions 0 must be positive (scaling yarn)");
  REQUIRE_THROWS_WITH(make([](C& c) {
                        c.scaling = attn::RopeScaling::yarn;
                        c.factor = 4;
                        c.original_max_positions = 8;
                        c.beta_fast = 0.5;
                      }),
                      "RotaryEmbedding: beta_fast 0.5 and beta_slow 1 must be finite, > 0 and "
                      "beta_fast >= beta_slow (scaling yarn)");
  REQUIRE_THROWS_WITH(make([](C& c) {
                        c.scaling = attn::RopeScaling::yarn;
                        c.factor = 4;
                        c.original_max_positions = 8;
                        c.mscale = -1;
                      }),
                      "RotaryEmbedding: attention_factor 0, mscale -1 and mscale_all_dim 0 must "
                      "be finite and >= 0 (0: unset) (scaling yarn)");
  REQUIRE_THROWS_WITH(make([](C& c) {
                        c.scaling = attn::RopeScaling::llama3;
                        c.factor = 8;
                        c.original_max_positions = 8;
                        c.high_freq_factor = 1;
                      }),
                      "RotaryEmbedding: low_freq_factor 1 and high_freq_factor 1 must be finite "
                      "with 0 < low_freq_factor < high_freq_factor (scaling llama3)");

  const attn::RotaryEmbedding<double> rope(good);
  attn::Tensor<double, 4> x(2, 1, 4, 8);
  x.setZero();
  REQUIRE_THROWS_WITH(rope.apply(x, {0}),
                      "RotaryEmbedding::apply: offsets has 1 entries but x is [2, 1, 4, 8]: it "
                      "must have B entries or none");
  REQUIRE_THROWS_WITH(rope.apply(x, {0, 13}),
                      "RotaryEmbedding::apply: offsets[1] is 13: the 4 tokens of sequence 1 of x "
                      "[2, 1, 4, 8] need positions [13, 17) but the table holds [0, 16)");
  REQUIRE_THROWS_WITH(rope.apply(x, {-1, 0}),
                      "RotaryEmbedding::apply: offsets[0] is -1: the 4 tokens of sequence 0 of x "
                      "[2, 1, 4, 8] need positions [-1, 3) but the table holds [0, 16)");
  REQUIRE_THROWS_WITH(rope.apply_at(x, {0, 1, 2}),
                      "RotaryEmbedding::apply_at: positions has 3 entries but x is [2, 1, 4, 8]: "
                      "it must have L = 4 or one per row (8)");
  REQUIRE_THROWS_WITH(rope.apply_at(x, {0, 1, 16, 3}),
                      "RotaryEmbedding::apply_at: positions[2] is 16: the table holds positions "
                      "[0, 16)");
  attn::Tensor<double, 4> wrong(1, 1, 4, 6);
  wrong.setZero();
  REQUIRE_THROWS_WITH(rope.apply(wrong),
                      "RotaryEmbedding::apply: x is [1, 1, 4, 6] but the table's head dim is 8");
  REQUIRE_THROWS_WITH(attn::RotaryEmbedding<double>().apply(x),
                      "RotaryEmbedding::apply: the embedding is empty (default-constructed)");
  REQUIRE_THROWS_WITH(rope.cos(16, 0),
                      "RotaryEmbedding::cos/sin: position 16 and pair 0 must be in [0, 16) and "
                      "[0, 4)");
  REQUIRE_THROWS_AS(rope.apply(x, {0, 13}), std::invalid_argument);
  // nothing was rotated by a call that threw
  REQUIRE(std::all_of(x.data(), x.data() + x.size(), [](double v) { return v == 0.0; }));
}
