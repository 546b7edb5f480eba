// Tests for examples/walkthrough.cpp and examples/numpy_random.hpp against the NumPy
// replay of the self-attention tutorial, tests/reference/walkthrough.json (see generate.py):
//   - numpy_random reproduces np.random.seed(42) + randn, bit for bit;
//   - the library reproduces every stage of the tutorial (Q, K, V, scores, weights,
//     output, causal weights and output) to 1e-12 relative;
//   - the tutorial's mistakes are real: its linear_attention differs from the normalised
//     one, and its -1e9 masking of a fully masked row gives uniform (float32) or unmasked
//     (float64) weights where the library gives zeros.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <attn/attn.hpp>

#include "../examples/numpy_random.hpp"
#include "support/results.hpp"

namespace {

using attn::Index;
using Mat = attn::Matrix<double>;
using json = nlohmann::json;

/// tests/reference/walkthrough.json, parsed once.
const json& walkthrough_fixture() {
  static const json fixture = [] {
    const std::string path = std::string(ATTN_FIXTURE_DIR) + "/walkthrough.json";
    std::ifstream in(path);
    if (!in) {
      throw std::runtime_error("cannot open fixture " + path);
    }
    return json::parse(in);
  }();
  return fixture;
}

/// A fixture entry {"shape": [R, C], "data": [...]} as an (R, C) matrix.
Mat fixture_matrix(const std::string& name) {
  const json& t = walkthrough_fixture().at(name);
  const auto shape = t.at("shape").get<std::vector<Index>>();
  REQUIRE(shape.size() == 2);
  Mat m(shape[0], shape[1]);
  const json& data = t.at("data");
  REQUIRE(static_cast<Index>(data.size()) == m.size());
  for (Index i = 0; i < m.size(); ++i) {
    m.data()[i] = data.at(static_cast<std::size_t>(i)).get<double>();
  }
  return m;
}

/// Worst relative error of `actual` against `expected` and where it is: |a - e| / |e|, or
/// |a| / max|expected| where e is 0 (a masked weight; its exactness is tested on its own).
struct Comparison {
  double worst = 0.0;
  std::string where;
};

Comparison compare_relative(const Mat& actual, const Mat& expected) {
  Comparison result;
  std::ostringstream where;
  where.precision(17);
  if (actual.rows() != expected.rows() || actual.cols() != expected.cols()) {
    where << "shapes (" << actual.rows() << ", " << actual.cols() << ") and (" << expected.rows()
          << ", " << expected.cols() << ") differ";
    result.worst = std::numeric_limits<double>::infinity();
    result.where = where.str();
    return result;
  }
  const double scale = expected.cwiseAbs().maxCoeff();
  for (Index i = 0; i < actual.rows(); ++i) {
    for (Index j = 0; j < actual.cols(); ++j) {
      const double a = actual(i, j);
      const double e = expected(i, j);
      const double error = !std::isfinite(a) ? std::numeric_limits<double>::infinity()
                           : e != 0.0        ? std::abs(a - e) / std::abs(e)
                                             : std::abs(a) / scale;
      if (error > result.worst || (i == 0 && j == 0)) {
        result.worst = error;
        where.str("");
        where << "worst relative error " << error << " at (" << i << ", " << j << "): actual " << a
              << ", expected " << e;
        result.where = where.str();
      }
    }
  }
  return result;
}

#define REQUIRE_RELATIVE(actual, expected_name, bound)                                        \
  do {                                                                                        \
    const Comparison comparison_ = compare_relative((actual), fixture_matrix(expected_name)); \
    INFO((expected_name) << ": " << comparison_.where << " (bound " << (bound) << ")");       \
    REQUIRE(comparison_.worst <= (bound));                                                    \
  } while (false)

constexpr double kRelative = 1e-12;

/// Every digit of a double, for messages (Catch's own expansion rounds 5e-309 to 0.0).
std::string exact(double x) {
  std::ostringstream s;
  s.precision(17);
  s << x;
  return s.str();
}

/// phi(x) = elu(x) + 1, the feature map of linear attention.
Mat elu_plus_one(const Mat& x) {
  return x.unaryExpr([](double v) { return v > 0.0 ? v + 1.0 : std::exp(v); });
}

}  // namespace

TEST_CASE("numpy_random replays np.random.seed + randn bit for bit",
          "[walkthrough][numpy_random]") {
  // Values printed by NumPy 1.24 (repr, which round-trips exactly).
  SECTION("the first draws of seed 42") {
    attn_examples::numpy_random rng(42);
    const Mat x = rng.randn(1, 4);  // (1, 4)
    CHECK(x(0, 0) == 0.4967141530112327);
    CHECK(x(0, 1) == -0.13826430117118466);
    CHECK(x(0, 2) == 0.6476885381006925);
    CHECK(x(0, 3) == 1.5230298564080254);
  }
  SECTION("draw 1000 of seed 42") {
    attn_examples::numpy_random rng(42);
    for (int i = 0; i < 1000; ++i) {
      rng.standard_normal();
    }
    CHECK(rng.standard_normal() == 1.3993554365860021);
  }
  SECTION("seeds 0 and 2^32 - 1") {
    attn_examples::numpy_random zero(0);
    CHECK(zero.standard_normal() == 1.764052345967664);
    CHECK(zero.standard_normal() == 0.4001572083672233);
    attn_examples::numpy_random top(4294967295U);
    CHECK(top.standard_normal() == 0.6484086742306527);
    CHECK(top.standard_normal() == 0.6693235306338161);
  }
  SECTION("random_sample, and the cached normal survives uniform draws") {
    attn_examples::numpy_random rng(42);
    CHECK(rng.random_sample() == 0.3745401188473625);
    CHECK(rng.random_sample() == 0.9507143064099162);
    rng.seed(42);
    CHECK(rng.standard_normal() == 0.4967141530112327);  // caches the pair's other value
    CHECK(rng.random_sample() == 0.7319939418114051);
    CHECK(rng.standard_normal() == -0.13826430117118466);  // the cached one
  }
  SECTION("seed() drops the cached normal, as np.random.seed does") {
    attn_examples::numpy_random rng(42);
    rng.standard_normal();
    rng.seed(42);
    CHECK(rng.standard_normal() == 0.4967141530112327);
  }
}

TEST_CASE("numpy_random draws the walkthrough's X, Wq, Wk, Wv", "[walkthrough][numpy_random]") {
  // The tutorial: np.random.seed(42); X = randn(3, 4); Wq, Wk, Wv = randn(4, 3) in order.
  // The fixture rounds each to float32, so ours are rounded the same way before comparing.
  attn_examples::numpy_random rng(42);
  const char* const names[] = {"X", "Wq", "Wk", "Wv"};
  const Index rows[] = {3, 4, 4, 4};
  const Index cols[] = {4, 3, 3, 3};
  for (int n = 0; n < 4; ++n) {
    const Mat drawn = rng.randn(rows[n], cols[n]);
    const Mat rounded =
        drawn.unaryExpr([](double v) { return static_cast<double>(static_cast<float>(v)); });
    const Mat expected = fixture_matrix(names[n]);
    INFO(names[n] << " ours (rounded to float32):\n" << rounded << "\nfixture:\n" << expected);
    REQUIRE(expected.rows() == rows[n]);
    REQUIRE(expected.cols() == cols[n]);
    CHECK(rounded == expected);  // exactly
  }
}

TEST_CASE("the library reproduces every stage of the walkthrough", "[walkthrough]") {
  // From the fixture's (float32-rounded) inputs, like generate.py.
  const Mat X = fixture_matrix("X");    // (L, E) = (3, 4)
  const Mat Wq = fixture_matrix("Wq");  // (E, D) = (4, 3)
  const Mat Wk = fixture_matrix("Wk");  // (E, D)
  const Mat Wv = fixture_matrix("Wv");  // (E, Dv)

  const Mat Q = X * Wq;  // (L, D)
  const Mat K = X * Wk;  // (L, D)
  const Mat V = X * Wv;  // (L, Dv)
  REQUIRE_RELATIVE(Q, "Q", kRelative);
  REQUIRE_RELATIVE(K, "K", kRelative);
  REQUIRE_RELATIVE(V, "V", kRelative);

  const Mat scores = Q * K.transpose();  // (L, L)
  REQUIRE_RELATIVE(scores, "scores", kRelative);
  const Mat scaled = scores / std::sqrt(3.0);  // (L, L)
  REQUIRE_RELATIVE(scaled, "scaled_scores", kRelative);

  SECTION("step by step with softmax_rows") {
    const Mat weights = attn::softmax_rows(scaled);  // (L, L)
    REQUIRE_RELATIVE(weights, "weights", kRelative);
    const Mat output = weights * V;  // (L, Dv)
    REQUIRE_RELATIVE(output, "output", kRelative);
  }

  SECTION("one call, no mask") {
    Mat weights;  // (L, L)
    const Mat output =
        attn_test::out_of(attn::scaled_dot_product_attention(Q, K, V, {}, attn::Return::weights),
                          &weights, nullptr);  // (L, Dv)
    REQUIRE_RELATIVE(weights, "weights", kRelative);
    REQUIRE_RELATIVE(output, "output", kRelative);
  }

  SECTION("causal (top-left): the mask, step by step and in one call") {
    const attn::Mask mask("test", 1, 1, 3, 3, attn::Causal::top_left, attn::Window{});
    const Mat expected_mask = fixture_matrix("causal_mask");  // (L, L) of 1/0
    for (Index i = 0; i < 3; ++i) {
      for (Index j = 0; j < 3; ++j) {
        INFO("query " << i << ", key " << j);
        CHECK(mask.visible(0, 0, i, j) == (expected_mask(i, j) == 1.0));
      }
    }

    Mat masked = scaled;  // (L, L)
    mask.hide(0, 0, 0, 0, masked);
    const Mat step_weights = attn::softmax_rows(masked);  // (L, L)
    REQUIRE_RELATIVE(step_weights, "causal_weights", kRelative);
    REQUIRE_RELATIVE(Mat(step_weights * V), "causal_output", kRelative);

    attn::AttentionOptions<double> options;
    options.causal = attn::Causal::top_left;
    Mat weights;  // (L, L)
    const Mat output = attn_test::out_of(
        attn::scaled_dot_product_attention(Q, K, V, options, attn::Return::weights), &weights,
        nullptr);
    REQUIRE_RELATIVE(weights, "causal_weights", kRelative);
    REQUIRE_RELATIVE(output, "causal_output", kRelative);
    // No row is fully masked here, so in float64 the tutorial's -1e9 gives the same weights.
    REQUIRE_RELATIVE(weights, "tutorial_minus_1e9_causal_weights", kRelative);
  }
}

TEST_CASE("masked keys of the walkthrough get weight exactly 0", "[walkthrough][mask]") {
  // softmax.hpp: "entries equal to -inf get weight 0"; the fixture's causal weights hold
  // exact zeros. (A tiny nonzero weight is not harmless: times an inf or NaN in a masked
  // value row, e.g. padding, it poisons the output.)
  const Mat Q = fixture_matrix("Q");                      // (L, D)
  const Mat K = fixture_matrix("K");                      // (L, D)
  const Mat V = fixture_matrix("V");                      // (L, Dv)
  const Mat expected = fixture_matrix("causal_weights");  // (L, L)
  attn::AttentionOptions<double> options;
  options.causal = attn::Causal::top_left;
  Mat weights;  // (L, L)
  attn_test::out_of(attn::scaled_dot_product_attention(Q, K, V, options, attn::Return::weights),
                    &weights, nullptr);
  Mat masked = fixture_matrix("scaled_scores");  // (L, L)
  const attn::Mask mask("test", 1, 1, 3, 3, attn::Causal::top_left, attn::Window{});
  mask.hide(0, 0, 0, 0, masked);
  const Mat step_weights = attn::softmax_rows(masked);  // (L, L)
  for (Index i = 0; i < 3; ++i) {
    for (Index j = i + 1; j < 3; ++j) {
      INFO("query " << i << ", key " << j << ": step-by-step weight " << exact(step_weights(i, j))
                    << ", one-call weight " << exact(weights(i, j)));
      REQUIRE(expected(i, j) == 0.0);
      CHECK(masked(i, j) == -std::numeric_limits<double>::infinity());
      CHECK(step_weights(i, j) == 0.0);
      CHECK(weights(i, j) == 0.0);
    }
  }
}

TEST_CASE("the tutorial's linear_attention is not normalised over the keys",
          "[walkthrough][linear]") {
  const Mat Q = fixture_matrix("Q");  // (L, D)
  const Mat K = fixture_matrix("K");  // (L, D)
  const Mat V = fixture_matrix("V");  // (L, Dv)

  // Tutorial: KV = K^T V; Z = 1 / (sum(Q, axis=1) + 1e-8); out = Z * (Q KV).
  const Eigen::VectorXd z = (Q.rowwise().sum().array() + 1e-8).inverse();  // (L)
  const Mat tutorial = z.asDiagonal() * (Q * (K.transpose() * V));         // (L, Dv)
  REQUIRE_RELATIVE(tutorial, "tutorial_linear_attention_output", kRelative);

  // phi = elu + 1; out_i = phi(q_i) (phi(K)^T V) / (phi(q_i) . sum_j phi(k_j) + 1e-6).
  const Mat phi_q = elu_plus_one(Q);  // (L, D)
  const Mat phi_k = elu_plus_one(K);  // (L, D)
  const Eigen::VectorXd normaliser = (phi_q * phi_k.colwise().sum().transpose()).array() + 1e-6;
  const Mat correct = normaliser.cwiseInverse().asDiagonal() * (phi_q * (phi_k.transpose() * V));
  REQUIRE_RELATIVE(correct, "correct_linear_attention_output", kRelative);

  const Mat tutorial_expected = fixture_matrix("tutorial_linear_attention_output");
  const Mat correct_expected = fixture_matrix("correct_linear_attention_output");
  CHECK((tutorial_expected - correct_expected).cwiseAbs().maxCoeff() > 1e-3);
  // The normalised version is an average of V's rows: every entry within V's column range.
  for (Index c = 0; c < V.cols(); ++c) {
    CHECK(correct_expected.col(c).maxCoeff() <= V.col(c).maxCoeff());
    CHECK(correct_expected.col(c).minCoeff() >= V.col(c).minCoeff());
  }
  // The tutorial's is not (its row 1 is far outside).
  CHECK(tutorial_expected.row(1).minCoeff() < V.minCoeff());
}

TEST_CASE("a fully masked row: -1e9 gives uniform or unmasked weights, attn gives zeros",
          "[walkthrough][mask]") {
  const Mat row = fixture_matrix("minus_1e9_fully_masked_scores");  // (1, Lk) = (1, 3)
  REQUIRE(row.rows() == 1);
  REQUIRE(row.cols() == 3);

  SECTION("float32: every score rounds to -1e9, the weights are uniform") {
    const attn::Matrix<float> minus_1e9 = (row.cast<float>().array() - 1e9F).matrix();  // (1, 3)
    const attn::Matrix<float> weights = attn::softmax_rows(minus_1e9);                  // (1, 3)
    const Mat expected = fixture_matrix("minus_1e9_fully_masked_weights_float32");
    for (Index j = 0; j < 3; ++j) {
      CHECK(expected(0, j) == static_cast<double>(1.0F / 3.0F));
      CHECK(static_cast<double>(weights(0, j)) == expected(0, j));
    }
  }

  SECTION("float64: the mask is a shared shift, the weights are the unmasked ones") {
    const Mat minus_1e9 = (row.array() - 1e9).matrix();  // (1, 3)
    const Mat weights = attn::softmax_rows(minus_1e9);   // (1, 3)
    REQUIRE_RELATIVE(weights, "minus_1e9_fully_masked_weights", kRelative);
    const Mat unmasked = fixture_matrix("weights").topRows(1);  // (1, 3)
    CHECK((weights - unmasked).cwiseAbs().maxCoeff() < 1e-6);
    CHECK(weights.minCoeff() > 0.0);
  }

  SECTION("attn: a keep-mask with row 0 all false gives zero weights and output") {
    const Mat Q = fixture_matrix("Q");  // (L, D)
    const Mat K = fixture_matrix("K");  // (L, D)
    const Mat V = fixture_matrix("V");  // (L, Dv)
    attn::Matrix<bool> keep(3, 3);      // (L, L)
    keep.setConstant(true);
    keep.row(0).setConstant(false);
    attn::AttentionOptions<double> options;
    options.keep_mask = keep;
    Mat weights;  // (L, L)
    const Mat output = attn_test::out_of(
        attn::scaled_dot_product_attention(Q, K, V, options, attn::Return::weights), &weights,
        nullptr);
    for (Index j = 0; j < 3; ++j) {
      CHECK(weights(0, j) == 0.0);
      CHECK(output(0, j) == 0.0);
    }
    CHECK_FALSE(output.hasNaN());
    // The other rows see every key: unchanged.
    const Comparison rest =
        compare_relative(weights.bottomRows(2), fixture_matrix("weights").bottomRows(2));
    INFO(rest.where);
    CHECK(rest.worst <= kRelative);
  }
}

TEST_CASE("attn/attn.hpp includes the mod gallery: gallery::causal() equals Causal::top_left",
          "[walkthrough][mods]") {
  attn::Tensor<double, 4> q(1, 2, 5, 4), k(1, 2, 7, 4), v(1, 2, 7, 3);
  std::mt19937 rng(3u);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (attn::Tensor<double, 4>* t : {&q, &k, &v})
    for (Index n = 0; n < t->size(); ++n)
      t->data()[n] = normal(rng);
  attn::AttentionOptions<double> by_mod, by_option;
  by_mod.mask_mod = attn::MaskMod(attn::gallery::causal());
  by_option.causal = attn::Causal::top_left;
  const attn::Tensor<double, 4> a = attn::scaled_dot_product_attention(q, k, v, by_mod);
  const attn::Tensor<double, 4> b = attn::scaled_dot_product_attention(q, k, v, by_option);
  for (Index n = 0; n < a.size(); ++n)
    REQUIRE(std::abs(a.data()[n] - b.data()[n]) <= 1e-15);
}
