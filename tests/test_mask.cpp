// Tests for attn/mask.hpp: visibility against the PyTorch fixtures, tile classification
// against brute force, mask application, and every validation error.
#include <catch2/catch.hpp>

#include <random>
#include <string>
#include <utility>

#include <attn/problem.hpp>

#include "support/fixtures.hpp"

using attn::Causal;
using attn::Index;
using attn::TileVisibility;

namespace {

Causal causal_from(const std::string& name) {
  if (name == "top_left")
    return Causal::top_left;
  if (name == "bottom_right")
    return Causal::bottom_right;
  return Causal::none;
}

}  // namespace

TEST_CASE("mask visibility equals the fixtures' nonzero weights", "[mask]") {
  for (const auto& c : ATTN_FIXTURE_CASES("sdpa.json", "cases", attn_test::sdpa_case_count)) {
    const std::string name = c.at("name").get<std::string>();
    // With no bias and no huge logit gaps, a weight is nonzero exactly when its key is visible.
    if (!c.at("bias").is_null() || name.rfind("large_logits", 0) == 0)
      continue;
    SECTION(name) {
      const std::vector<Index> q_shape = attn_test::shape_of(c.at("q"));
      const Index lk = attn_test::shape_of(c.at("k"))[2];
      const Index batch = q_shape[0], heads = q_shape[1], lq = q_shape[2];
      attn::Tensor<bool, 4> keep;
      attn::Broadcast<bool> keep_view;
      if (!c.at("keep_mask").is_null()) {
        keep = attn_test::tensor<bool, 4>(c.at("keep_mask"));
        keep_view = keep;
      }
      const std::vector<Index> key_lengths = c.at("key_lengths").is_null()
                                                 ? std::vector<Index>{}
                                                 : c.at("key_lengths").get<std::vector<Index>>();
      const auto window = c.at("window").get<std::vector<Index>>();
      attn::VisibilityOptions options;
      options.causal = causal_from(c.at("causal"));
      options.window = {window[0], window[1]};
      options.key_lengths = key_lengths;
      options.keep_mask = keep_view;
      if (!c.at("query_lengths").is_null())
        options.query_lengths = c.at("query_lengths").get<std::vector<Index>>();
      options.sink_tokens = c.at("sink_tokens").get<Index>();
      const attn::Mask mask("test", batch, heads, lq, lk, options);
      const std::vector<double> weights = attn_test::values<double>(c.at("weights"));
      for (Index b = 0; b < batch; ++b) {
        for (Index h = 0; h < heads; ++h) {
          for (Index i = 0; i < lq; ++i) {
            for (Index j = 0; j < lk; ++j) {
              const double w =
                  weights[static_cast<std::size_t>(((b * heads + h) * lq + i) * lk + j)];
              INFO("b " << b << " h " << h << " i " << i << " j " << j);
              REQUIRE(mask.visible(b, h, i, j) == (w > 0));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("tile classification agrees with element-wise visibility", "[mask]") {
  std::mt19937 rng(2024);
  std::uniform_int_distribution<Index> length(1, 9), side(-1, 4), coin(0, 1);
  for (int trial = 0; trial < 300; ++trial) {
    const Index lq = length(rng), lk = length(rng), batch = 2;
    const auto causal = static_cast<Causal>(trial % 3);
    const attn::Window window{side(rng), side(rng)};
    std::vector<Index> key_lengths;
    if (coin(rng) == 1)
      key_lengths = std::vector<Index>{std::uniform_int_distribution<Index>(0, lk)(rng), lk};
    attn::Tensor<bool, 4> keep(1, 1, lq, lk);
    const bool with_keep = trial % 5 == 0;
    for (Index n = 0; n < keep.size(); ++n)
      keep.data()[n] = coin(rng) == 1;
    const attn::Mask mask("test", batch, 1, lq, lk, causal, window, key_lengths,
                          with_keep ? attn::Broadcast<bool>(keep) : attn::Broadcast<bool>());
    const Index tile_q = length(rng) % 4 + 1, tile_k = length(rng) % 4 + 1;
    for (Index b = 0; b < batch; ++b) {
      for (Index i0 = 0; i0 < lq; i0 += tile_q) {
        for (Index j0 = 0; j0 < lk; j0 += tile_k) {
          const Index i1 = std::min(lq, i0 + tile_q), j1 = std::min(lk, j0 + tile_k);
          Index visible = 0;
          for (Index i = i0; i < i1; ++i) {
            for (Index j = j0; j < j1; ++j)
              visible += mask.visible(b, 0, i, j) ? 1 : 0;
          }
          const TileVisibility kind = mask.classify(b, 0, i0, i1, j0, j1);
          INFO("trial " << trial << " tile [" << i0 << ", " << i1 << ") x [" << j0 << ", " << j1
                        << ") visible " << visible);
          if (kind == TileVisibility::hidden)
            REQUIRE(visible == 0);
          if (kind == TileVisibility::visible)
            REQUIRE(visible == (i1 - i0) * (j1 - j0));
          // Without a keep-mask the classification is exact, not merely safe.
          if (!with_keep && kind == TileVisibility::partial) {
            REQUIRE(visible > 0);
            REQUIRE(visible < (i1 - i0) * (j1 - j0));
          }
          if (with_keep)
            REQUIRE(kind != TileVisibility::visible);

          // key_range is the smallest interval holding every structurally visible key.
          const auto [first, last] = mask.key_range(b, i0, i1);
          Index lowest = lk, highest = -1;
          for (Index i = i0; i < i1; ++i) {
            const auto [lo, hi] = mask.key_interval(b, i);
            REQUIRE(0 <= lo);
            REQUIRE(lo <= hi);
            REQUIRE(hi <= lk);
            for (Index j = lo; j < hi; ++j) {
              lowest = std::min(lowest, j);
              highest = std::max(highest, j);
            }
          }
          if (highest < 0) {
            REQUIRE(first == last);
          } else {
            REQUIRE(first == lowest);
            REQUIRE(last == highest + 1);
          }
        }
      }
    }
  }
}

TEST_CASE("causal alignments agree when Lq == Lk, and window (-1, 0) is bottom-right causal",
          "[mask]") {
  const attn::Mask top("t", 1, 1, 6, 6, Causal::top_left, {});
  const attn::Mask bottom("t", 1, 1, 6, 6, Causal::bottom_right, {});
  const attn::Mask window("t", 1, 1, 4, 7, Causal::none, {-1, 0});
  const attn::Mask bottom_47("t", 1, 1, 4, 7, Causal::bottom_right, {});
  for (Index i = 0; i < 6; ++i) {
    for (Index j = 0; j < 7; ++j) {
      if (j < 6)
        REQUIRE(top.visible(0, 0, i, j) == bottom.visible(0, 0, i, j));
      if (j < 6)
        REQUIRE(top.visible(0, 0, i, j) == (j <= i));
      if (i < 4)
        REQUIRE(window.visible(0, 0, i, j) == bottom_47.visible(0, 0, i, j));
      if (i < 4)
        REQUIRE(bottom_47.visible(0, 0, i, j) == (j <= i + 3));
    }
  }
}

TEST_CASE("AttentionProblem::apply adds the broadcast bias, then the mask hides with -inf",
          "[mask]") {
  attn::Tensor<double, 4> bias(1, 2, 1, 1);  // per-head constant
  bias.setValues({{{{0.5}}, {{-1.0}}}});
  attn::ProblemOptions<double> options;
  options.causal = Causal::top_left;
  options.bias = bias;
  const attn::AttentionProblem<double> problem("t", 1, 2, 3, 4, options);
  REQUIRE(problem.modifies_scores());
  REQUIRE_FALSE(problem.is_trivial());
  attn::Matrix<double> scores = attn::Matrix<double>::Constant(3, 4, 2.0);
  problem.apply(0, 1, 0, 0, scores);
  const double inf = std::numeric_limits<double>::infinity();
  attn::Matrix<double> expected(3, 4);
  expected << 1, -inf, -inf, -inf,  //
      1, 1, -inf, -inf,             //
      1, 1, 1, -inf;
  REQUIRE(scores == expected);

  // A tile at an offset: queries 1..2, keys 2..3.
  attn::Matrix<double> tile = attn::Matrix<double>::Zero(2, 2);
  problem.apply(0, 0, 1, 2, tile);
  attn::Matrix<double> expected_tile(2, 2);
  expected_tile << -inf, -inf, 0.5, -inf;
  REQUIRE(tile == expected_tile);

  // The mask alone hides and changes nothing else; a hidden +inf bias cannot leak.
  attn::Matrix<double> visible = attn::Matrix<double>::Constant(3, 4, 2.0);
  problem.mask().hide(0, 1, 0, 0, visible);
  expected << 2, -inf, -inf, -inf,  //
      2, 2, -inf, -inf,             //
      2, 2, 2, -inf;
  REQUIRE(visible == expected);
  attn::Matrix<double> infinite = attn::Matrix<double>::Constant(3, 4, inf);
  problem.mask().hide(0, 1, 0, 0, infinite);
  REQUIRE(infinite(0, 1) == -inf);
  REQUIRE(infinite(2, 2) == inf);
  // A visible tile is not evaluated by the mask at all.
  attn::Matrix<double> untouched = attn::Matrix<double>::Constant(3, 4, 2.0);
  problem.mask().hide(0, 1, 0, 0, untouched, attn::TileVisibility::visible);
  REQUIRE(untouched == attn::Matrix<double>::Constant(3, 4, 2.0));
}

TEST_CASE("a problem with no rules and no modifiers is trivial", "[mask]") {
  attn::ProblemOptions<double> options;
  options.sinks = {0.5, -0.5};
  options.dropout_p = 0.25;
  const attn::AttentionProblem<double> problem("t", 1, 2, 3, 4, options);
  REQUIRE(problem.is_trivial());  // sinks and dropout are not masks
  REQUIRE(problem.mask().hides_nothing());
  REQUIRE(*problem.sink(1) == -0.5);
  REQUIRE(problem.dropout().active());
  options.softcap = 30.0;
  REQUIRE_FALSE(attn::AttentionProblem<double>("t", 1, 2, 3, 4, options).is_trivial());
}

TEST_CASE("Mask rejects bad windows, key lengths and broadcast shapes", "[mask][errors]") {
  const auto make = [](attn::Window w, std::vector<Index> lengths, attn::Broadcast<bool> keep,
                       attn::Broadcast<float> bias) {
    attn::ProblemOptions<float> options;
    options.window = w;
    options.key_lengths = std::move(lengths);
    options.keep_mask = keep;
    options.bias = bias;
    return attn::AttentionProblem<float>("scaled_dot_product_attention", 2, 3, 4, 5, options);
  };
  REQUIRE_THROWS_WITH(make({-2, 0}, {}, {}, {}),
                      "scaled_dot_product_attention: window is (-2, 0): each side must be >= -1 "
                      "(-1 = unbounded)");
  REQUIRE_THROWS_WITH(make({0, -3}, {}, {}, {}),
                      "scaled_dot_product_attention: window is (0, -3): each side must be >= -1 "
                      "(-1 = unbounded)");
  REQUIRE_THROWS_WITH(make({}, {5}, {}, {}),
                      "scaled_dot_product_attention: key_lengths has 1 entries but the batch "
                      "size is 2");
  REQUIRE_THROWS_WITH(make({}, {5, 6}, {}, {}),
                      "scaled_dot_product_attention: key_lengths[1] is 6: must lie in [0, Lk] "
                      "with Lk = 5");
  REQUIRE_THROWS_WITH(make({}, {-1, 0}, {}, {}),
                      "scaled_dot_product_attention: key_lengths[0] is -1: must lie in [0, Lk] "
                      "with Lk = 5");
  attn::Tensor<bool, 4> keep(2, 2, 4, 5);
  keep.setConstant(true);
  REQUIRE_THROWS_WITH(make({}, {}, keep, {}),
                      "scaled_dot_product_attention: keep_mask is [2, 2, 4, 5] but the scores "
                      "are [2, 3, 4, 5]: each dimension must be 1 or equal (broadcasting)");
  attn::Tensor<float, 2> bias(5, 4);
  bias.setZero();
  REQUIRE_THROWS_WITH(make({}, {}, {}, bias),
                      "scaled_dot_product_attention: bias is [1, 1, 5, 4] but the scores are "
                      "[2, 3, 4, 5]: each dimension must be 1 or equal (broadcasting)");
  attn::Tensor<float, 4> good_bias(2, 1, 1, 5);
  good_bias.setZero();
  REQUIRE_NOTHROW(make({3, 0}, {5, 0}, {}, good_bias));
}
