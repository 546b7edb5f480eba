// Tests for attn/linear_attention.hpp: the NumPy fixtures (a quadratic reference: phi(Q)
// phi(K)^T masked and row-normalised, times V) through every entry point in float and double,
// the tutorial's formula shown wrong, chunk sizes swept around their boundaries against a
// double-precision quadratic reference, the recurrent state against the causal batch result,
// FAVOR+ against softmax attention, NaN propagation and every validation error.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/linear_attention.hpp>

#include "support/fixtures.hpp"

using attn::Index;
using attn_test::json;

namespace {

using MatD = attn::Matrix<double>;

template <class T>
attn::FeatureMap<T> feature_map_named(const std::string& name) {
  if (name == "relu")
    return attn::FeatureMap<T>::relu();
  if (name == "identity")
    return attn::FeatureMap<T>::identity();
  return attn::FeatureMap<T>::elu_plus_one();
}

attn::Causal causal_named(const std::string& name) {
  return name == "top_left"       ? attn::Causal::top_left
         : name == "bottom_right" ? attn::Causal::bottom_right
                                  : attn::Causal::none;
}

/// One linear.json case in scalar type T.
template <class T>
struct LinearCase {
  attn::Tensor<T, 4> q, k, v;  // (B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv)
  attn::LinearAttentionOptions<T> options;
  std::vector<double> out;  // (B, Hq, Lq, Dv), float64

  explicit LinearCase(const json& c) {
    q = attn_test::tensor<T, 4>(c.at("q"));
    k = attn_test::tensor<T, 4>(c.at("k"));
    v = attn_test::tensor<T, 4>(c.at("v"));
    options.feature_map = feature_map_named<T>(c.at("feature_map").get<std::string>());
    options.causal = causal_named(c.at("causal").get<std::string>());
    if (!c.at("key_lengths").is_null())
      options.key_lengths = c.at("key_lengths").get<std::vector<Index>>();
    options.eps = static_cast<T>(c.at("eps").get<double>());
    out = attn_test::values<double>(c.at("out"));
  }
};

/// Quadratic double-precision reference for one head: A = phi(q) phi(k)^T with the hidden
/// keys zeroed, out = A v / (rowsum(A) + eps). The mask is mask.hpp's visibility rule.
MatD quadratic_reference(const std::function<MatD(const MatD&)>& phi, const MatD& q, const MatD& k,
                         const MatD& v, attn::Causal causal, Index key_length, double eps) {
  MatD a = phi(q) * phi(k).transpose();  // (Lq, Lk)
  const Index lq = q.rows(), lk = k.rows();
  const Index offset = causal == attn::Causal::top_left ? 0 : key_length - lq;  // per sequence
  for (Index i = 0; i < lq; ++i) {
    for (Index j = 0; j < lk; ++j) {
      if (j >= key_length || (causal != attn::Causal::none && j > i + offset))
        a(i, j) = 0;
    }
  }
  const Eigen::VectorXd denominator = a.rowwise().sum().array() + eps;
  return denominator.cwiseInverse().asDiagonal() * (a * v);
}

MatD elu_plus_one_d(const MatD& x) {
  return x.unaryExpr([](double t) { return t > 0 ? t + 1 : std::exp(t); });
}

template <class T>
attn::Matrix<T> random_matrix(Index rows, Index cols, std::uint32_t seed, double scale = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, scale);
  attn::Matrix<T> m(rows, cols);
  for (Index n = 0; n < m.size(); ++n)
    m.data()[n] = static_cast<T>(normal(rng));
  return m;
}

template <class T>
attn_test::Comparison compare_matrix(const attn::Matrix<T>& actual, const MatD& expected,
                                     double rtol) {
  if (actual.rows() != expected.rows() || actual.cols() != expected.cols())
    return {false, 0, "shapes differ"};
  return attn_test::compare(actual.data(), expected.data(), static_cast<std::size_t>(actual.size()),
                            rtol);
}

#define REQUIRE_MATRIX_CLOSE(actual, expected, rtol)                       \
  do {                                                                     \
    const auto linear_cmp_ = compare_matrix((actual), (expected), (rtol)); \
    INFO(linear_cmp_.detail);                                              \
    REQUIRE(linear_cmp_.ok);                                               \
  } while (false)

}  // namespace

TEMPLATE_TEST_CASE("linear attention matches the NumPy quadratic reference", "[linear]", float,
                   double) {
  using T = TestType;
  const double rtol = attn_test::tolerance<T>();
  for (const json& c : ATTN_FIXTURE_CASES("linear.json", "cases", 17)) {
    SECTION(c.at("name").get<std::string>()) {
      LinearCase<T> fx(c);
      // Chunks of 1, 2, 3 and the default: every boundary position of these short cases.
      for (const Index chunk : {Index(0), Index(1), Index(2), Index(3)}) {
        INFO("chunk " << chunk);
        fx.options.chunk = chunk;
        const attn::Tensor<T, 4> out = attn::linear_attention(fx.q, fx.k, fx.v, fx.options);
        ATTN_REQUIRE_CLOSE(out.data(), out.size(), fx.out, rtol);
      }
      fx.options.chunk = 0;

      // TensorMaps give the same bits.
      const attn::Tensor<T, 4> out = attn::linear_attention(fx.q, fx.k, fx.v, fx.options);
      const attn::TensorMap<const T, 4> q_map(fx.q.data(), fx.q.dimensions());
      const attn::TensorMap<const T, 4> v_map(fx.v.data(), fx.v.dimensions());
      const attn::Tensor<T, 4> out_map = attn::linear_attention(q_map, fx.k, v_map, fx.options);
      REQUIRE(std::equal(out.data(), out.data() + out.size(), out_map.data()));

      // (B, L, H, D) memory through strided views, written as (B, Lq, Hq, Dv).
      const Eigen::array<Index, 4> to_blhd{0, 2, 1, 3};
      const attn::Tensor<T, 4> q = fx.q.shuffle(to_blhd);
      const attn::Tensor<T, 4> k = fx.k.shuffle(to_blhd);
      const attn::Tensor<T, 4> v = fx.v.shuffle(to_blhd);
      const Index batch = fx.q.dimension(0), hq = fx.q.dimension(1), lq = fx.q.dimension(2);
      const Index hkv = fx.k.dimension(1), lk = fx.k.dimension(2), dv = fx.v.dimension(3);
      attn::Tensor<T, 4> out_blhd(batch, lq, hq, dv);
      attn::linear_attention_into<T>(attn::blhd_view(q.data(), batch, lq, hq, fx.q.dimension(3)),
                                     attn::blhd_view(k.data(), batch, lk, hkv, fx.k.dimension(3)),
                                     attn::blhd_view(v.data(), batch, lk, hkv, dv),
                                     attn::blhd_view(out_blhd.data(), batch, lq, hq, dv),
                                     fx.options);
      const attn::Tensor<T, 4> out_bhld = out_blhd.shuffle(to_blhd);
      ATTN_REQUIRE_CLOSE(out_bhld.data(), out_bhld.size(), fx.out, rtol);

      // One head at a time through the matrix overload (v column-major).
      for (Index b = 0; b < batch; ++b) {
        for (Index h = 0; h < hq; ++h) {
          const Index g = h / (hq / hkv);
          const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> v_head =
              attn::bhld_view(fx.v).head(b, g);
          attn::LinearAttentionOptions<T> options = fx.options;
          if (!fx.options.key_lengths.empty())
            options.key_lengths.assign(1, fx.options.key_lengths[std::size_t(b)]);
          const attn::Matrix<T> head = attn::linear_attention(
              attn::bhld_view(fx.q).head(b, h), attn::bhld_view(fx.k).head(b, g), v_head, options);
          const Index item = b * hq + h;
          const std::vector<double> expected(fx.out.begin() + item * lq * dv,
                                             fx.out.begin() + (item + 1) * lq * dv);
          INFO("batch " << b << " head " << h);
          ATTN_REQUIRE_CLOSE(head.data(), head.size(), expected, rtol);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("the tutorial's linear_attention differs from the normalised one",
                   "[linear][tutorial]", float, double) {
  using T = TestType;
  const double rtol = attn_test::tolerance<T>();
  const json& tutorial = attn_test::fixture("linear.json").at("tutorial");
  const attn::Matrix<T> q = attn_test::matrix<T>(tutorial.at("Q"));  // (6, 4)
  const attn::Matrix<T> k = attn_test::matrix<T>(tutorial.at("K"));  // (6, 4)
  const attn::Matrix<T> v = attn_test::matrix<T>(tutorial.at("V"));  // (6, 3)
  const std::vector<double> tutorial_out = attn_test::values<double>(tutorial.at("tutorial_out"));
  const std::vector<double> elu_out = attn_test::values<double>(tutorial.at("elu_plus_one_out"));
  const std::vector<double> identity_out = attn_test::values<double>(tutorial.at("identity_out"));

  // attn computes the correct forms ...
  const attn::Matrix<T> elu = attn::linear_attention(q, k, v);
  ATTN_REQUIRE_CLOSE(elu.data(), elu.size(), elu_out, rtol);
  attn::LinearAttentionOptions<T> identity;
  identity.feature_map = attn::FeatureMap<T>::identity();
  const attn::Matrix<T> same_phi = attn::linear_attention(q, k, v, identity);
  ATTN_REQUIRE_CLOSE(same_phi.data(), same_phi.size(), identity_out, rtol);

  // ... and the tutorial's is neither: even with its own (identity) feature map, leaving the
  // keys out of the normaliser changes the numbers.
  const auto worst_difference = [&](const std::vector<double>& other) {
    double worst = 0;
    for (std::size_t n = 0; n < tutorial_out.size(); ++n)
      worst = std::max(worst, std::abs(tutorial_out[n] - other[n]));
    return worst;
  };
  CHECK(worst_difference(elu_out) > 0.1);
  CHECK(worst_difference(identity_out) > 0.1);
  // Its normaliser sum(q_i) is negative for some row: the "weights" are not an average.
  const std::vector<double> tutorial_normaliser =
      attn_test::values<double>(tutorial.at("tutorial_normaliser"));
  CHECK(*std::min_element(tutorial_normaliser.begin(), tutorial_normaliser.end()) < 0);
  // With elu + 1 every output is a convex combination of the values: inside their range.
  for (Index c = 0; c < v.cols(); ++c) {
    CHECK(elu.col(c).maxCoeff() <= v.col(c).maxCoeff());
    CHECK(elu.col(c).minCoeff() >= v.col(c).minCoeff());
  }
}

TEMPLATE_TEST_CASE("chunk sizes around their boundaries match a quadratic reference",
                   "[linear][chunks]", float, double) {
  using T = TestType;
  // Longer sums than the fixtures: allow a few times the fixture bound in float.
  const double rtol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  const Index d = 16, dv = 12;
  for (const Index length : {1, 7, 63, 64, 65, 127, 128, 129, 200}) {
    const attn::Matrix<T> q = random_matrix<T>(length, d, 1u);
    const attn::Matrix<T> k = random_matrix<T>(length, d, 2u);
    const attn::Matrix<T> v = random_matrix<T>(length, dv, 3u);
    const MatD qd = q.template cast<double>(), kd = k.template cast<double>(),
               vd = v.template cast<double>();
    for (const attn::Causal causal : {attn::Causal::none, attn::Causal::top_left}) {
      for (const Index key_length : {length, (length * 2) / 3}) {
        const MatD expected =
            quadratic_reference(elu_plus_one_d, qd, kd, vd, causal, key_length, 1e-6);
        for (const Index chunk : {0, 1, 7, 63, 64, 65}) {
          if (chunk == 1 && length > 65)
            continue;
          INFO("L " << length << " causal " << int(causal) << " key length " << key_length
                    << " chunk " << chunk);
          attn::LinearAttentionOptions<T> options;
          options.causal = causal;
          options.chunk = chunk;
          options.key_lengths.assign(1, key_length);
          REQUIRE_MATRIX_CLOSE(attn::linear_attention(q, k, v, options), expected, rtol);
        }
      }
    }
  }
  // bottom_right with a prefix of keys longer than a chunk, and Lq > Lk.
  for (const auto& [lq, lk] : {std::pair<Index, Index>{70, 200}, {130, 65}, {65, 130}}) {
    const attn::Matrix<T> q = random_matrix<T>(lq, d, 4u);
    const attn::Matrix<T> k = random_matrix<T>(lk, d, 5u);
    const attn::Matrix<T> v = random_matrix<T>(lk, dv, 6u);
    for (const attn::Causal causal : {attn::Causal::top_left, attn::Causal::bottom_right}) {
      const MatD expected =
          quadratic_reference(elu_plus_one_d, q.template cast<double>(), k.template cast<double>(),
                              v.template cast<double>(), causal, lk, 1e-6);
      for (const Index chunk : {0, 7, 64}) {
        INFO("Lq " << lq << " Lk " << lk << " causal " << int(causal) << " chunk " << chunk);
        attn::LinearAttentionOptions<T> options;
        options.causal = causal;
        options.chunk = chunk;
        REQUIRE_MATRIX_CLOSE(attn::linear_attention(q, k, v, options), expected, rtol);
      }
    }
  }
}

TEMPLATE_TEST_CASE(
    "bottom_right with key_lengths measures each sequence's diagonal from its length",
    "[linear][chunks]", float, double) {
  using T = TestType;
  // Closed form: equal scores (q = k = 0, phi = elu + 1 = 1), v_j = j + 1, Lq = 2, Lk = 4,
  // key_lengths {4, 2}. Sequence 1's last query sits on its last real key (mask.hpp), so
  // query 0 sees key 0 alone (1) and query 1 keys 0 and 1 (1.5); sequence 0 sees keys
  // 0..2 (2) and 0..3 (2.5). The padded Lk would give sequence 1 1.5 and 1.5.
  attn::Tensor<T, 4> q(2, 1, 2, 3), k(2, 1, 4, 3), v(2, 1, 4, 1);
  q.setZero();
  k.setZero();
  for (Index b = 0; b < 2; ++b)
    for (Index j = 0; j < 4; ++j)
      v(b, 0, j, 0) = static_cast<T>(j + 1);
  attn::LinearAttentionOptions<T> options;
  options.causal = attn::Causal::bottom_right;
  options.key_lengths = {4, 2};
  options.eps = T(0);
  const attn::Tensor<T, 4> out = attn::linear_attention(q, k, v, options);
  REQUIRE(out(0, 0, 0, 0) == T(2));
  REQUIRE(out(0, 0, 1, 0) == T(2.5));
  REQUIRE(out(1, 0, 0, 0) == T(1));
  REQUIRE(out(1, 0, 1, 0) == T(1.5));
  // The same rule as scaled-dot-product attention, whose equal scores give the same average.
  attn::AttentionOptions<T> sdpa;
  sdpa.causal = attn::Causal::bottom_right;
  sdpa.key_lengths = options.key_lengths;
  const attn::Tensor<T, 4> softmax = attn::scaled_dot_product_attention(q, k, v, sdpa);
  for (Index n = 0; n < out.size(); ++n)
    REQUIRE(std::abs(softmax.data()[n] - out.data()[n]) <= 8 * std::numeric_limits<T>::epsilon());

  // A ragged batch against the double reference per sequence: key lengths shorter and longer
  // than Lq, several chunks, GQA.
  const double rtol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  const Index batch = 4, q_heads = 2, lq = 37, lk = 90, d = 8, dv = 5;
  const std::vector<Index> key_lengths{90, 50, 37, 20};
  attn::Tensor<T, 4> qr(batch, q_heads, lq, d), kr(batch, 1, lk, d), vr(batch, 1, lk, dv);
  std::mt19937 rng(11u);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (attn::Tensor<T, 4>* t : {&qr, &kr, &vr})
    for (Index n = 0; n < t->size(); ++n)
      t->data()[n] = static_cast<T>(normal(rng));
  const auto head = [](const attn::Tensor<T, 4>& t, Index b, Index h) {
    MatD m(t.dimension(2), t.dimension(3));
    for (Index i = 0; i < m.rows(); ++i)
      for (Index c = 0; c < m.cols(); ++c)
        m(i, c) = static_cast<double>(t(b, h, i, c));
    return m;
  };
  for (const Index chunk : {0, 5, 64}) {
    attn::LinearAttentionOptions<T> ragged;
    ragged.causal = attn::Causal::bottom_right;
    ragged.key_lengths = key_lengths;
    ragged.chunk = chunk;
    const attn::Tensor<T, 4> got = attn::linear_attention(qr, kr, vr, ragged);
    for (Index b = 0; b < batch; ++b) {
      for (Index h = 0; h < q_heads; ++h) {
        INFO("chunk " << chunk << " sequence " << b << " head " << h);
        const MatD expected = quadratic_reference(elu_plus_one_d, head(qr, b, h), head(kr, b, 0),
                                                  head(vr, b, 0), attn::Causal::bottom_right,
                                                  key_lengths[static_cast<std::size_t>(b)],
                                                  static_cast<double>(ragged.eps));
        REQUIRE_MATRIX_CLOSE(head(got, b, h).template cast<T>().eval(), expected, rtol);
      }
    }
  }
}

TEMPLATE_TEST_CASE("a custom feature map is applied row by row, with any feature count",
                   "[linear][custom]", float, double) {
  using T = TestType;
  using Ref = Eigen::Ref<const attn::Matrix<T>>;
  using Out = Eigen::Ref<attn::Matrix<T>>;
  const double rtol = attn_test::tolerance<T>();
  const attn::Matrix<T> q = random_matrix<T>(90, 8, 11u), k = random_matrix<T>(90, 8, 12u),
                        v = random_matrix<T>(90, 5, 13u);

  // elu + 1 written by hand gives the built-in's results.
  attn::LinearAttentionOptions<T> mine;
  mine.feature_map = attn::FeatureMap<T>::custom([](const Ref& x, Out phi) {
    phi = x.unaryExpr([](T t) { return t > T(0) ? t + T(1) : std::exp(t); });
  });
  for (const attn::Causal causal : {attn::Causal::none, attn::Causal::top_left}) {
    mine.causal = causal;
    attn::LinearAttentionOptions<T> builtin;
    builtin.causal = causal;
    const attn::Matrix<T> a = attn::linear_attention(q, k, v, mine);
    const attn::Matrix<T> b = attn::linear_attention(q, k, v, builtin);
    REQUIRE_MATRIX_CLOSE(a, b.template cast<double>().eval(), rtol);
  }

  // M = 2 D: phi(x) = [elu(x) + 1, elu(-x) + 1], against the quadratic reference.
  mine.feature_map = attn::FeatureMap<T>::custom(
      [](const Ref& x, Out phi) {
        const Index d = x.cols();
        phi.leftCols(d) = x.unaryExpr([](T t) { return t > T(0) ? t + T(1) : std::exp(t); });
        phi.rightCols(d) = x.unaryExpr([](T t) { return t < T(0) ? T(1) - t : std::exp(-t); });
      },
      16);
  REQUIRE(mine.feature_map.features(8) == 16);
  const auto phi_d = [](const MatD& x) {
    MatD out(x.rows(), 2 * x.cols());
    out << elu_plus_one_d(x), elu_plus_one_d(-x);
    return out;
  };
  for (const attn::Causal causal : {attn::Causal::none, attn::Causal::top_left}) {
    mine.causal = causal;
    mine.chunk = 32;
    const MatD expected =
        quadratic_reference(phi_d, q.template cast<double>(), k.template cast<double>(),
                            v.template cast<double>(), causal, 90, 1e-6);
    REQUIRE_MATRIX_CLOSE(attn::linear_attention(q, k, v, mine), expected, rtol);
  }
}

TEMPLATE_TEST_CASE("the recurrent state gives the causal batch result token by token",
                   "[linear][recurrent]", float, double) {
  using T = TestType;
  // Both sum up to 300 terms in different orders.
  const double rtol = std::is_same_v<T, float> ? 2e-5 : 1e-12;
  const Index d = 16, dv = 8, length = 300;
  const attn::Matrix<T> q = random_matrix<T>(length, d, 21u);
  const attn::Matrix<T> k = random_matrix<T>(length, d, 22u);
  const attn::Matrix<T> v = random_matrix<T>(length, dv, 23u);
  const std::vector<std::pair<std::string, attn::FeatureMap<T>>> maps{
      {"elu_plus_one", attn::FeatureMap<T>::elu_plus_one()},
      {"relu", attn::FeatureMap<T>::relu()},
      {"favor_plus m=64", attn::favor_plus<T>(64, d, 7)},
  };
  for (const auto& [name, map] : maps) {
    attn::LinearAttentionState<T> state(d, dv, map);
    attn::Matrix<T> recurrent(length, dv);  // (L, Dv)
    for (Index i = 0; i < length; ++i) {
      const attn::Vector<T> row = state.step(q.row(i), k.row(i), v.row(i));
      recurrent.row(i) = row.transpose();
    }
    REQUIRE(state.position() == length);
    for (const Index chunk : {0, 1, 16, 63, 64, 65, 299, 300}) {
      INFO(name << ", chunk " << chunk);
      attn::LinearAttentionOptions<T> options;
      options.feature_map = map;
      options.causal = attn::Causal::top_left;
      options.chunk = chunk;
      const attn::Matrix<T> batch = attn::linear_attention(q, k, v, options);
      REQUIRE_MATRIX_CLOSE(batch, recurrent.template cast<double>().eval(), rtol);
    }
  }

  SECTION("update + query_into equal step, and reset forgets") {
    attn::LinearAttentionState<T> a(d, dv), b(d, dv);
    attn::Vector<T> out(dv);
    for (Index i = 0; i < 5; ++i) {
      a.update(k.row(i), v.row(i));
      a.query_into(q.row(i).transpose(), out);  // a column vector works too
      const attn::Vector<T> stepped = b.step(q.row(i), k.row(i), v.row(i));
      REQUIRE(out == stepped);
    }
    a.reset();
    REQUIRE(a.position() == 0);
    REQUIRE(a.state().isZero());
    REQUIRE(a.normaliser().isZero());
    a.query_into(q.row(0), out);
    REQUIRE(out.isZero());  // no key yet: 0 / eps
  }
}

TEST_CASE("FAVOR+ approaches softmax attention as the feature count grows", "[linear][favor]") {
  // Small inputs, one head: D = 8, L = 12. softmax SDPA uses scale 1/sqrt(D), as FAVOR+ does.
  const Index d = 8, dv = 4, length = 12;
  const attn::Matrix<double> q = random_matrix<double>(length, d, 31u, 0.5);
  const attn::Matrix<double> k = random_matrix<double>(length, d, 32u, 0.5);
  const attn::Matrix<double> v = random_matrix<double>(length, dv, 33u);
  for (const attn::Causal causal : {attn::Causal::none, attn::Causal::top_left}) {
    attn::AttentionOptions<double> sdpa_options;
    sdpa_options.causal = causal;
    const attn::Matrix<double> softmax = attn::scaled_dot_product_attention(q, k, v, sdpa_options);
    const auto worst_error = [&](Index m, std::uint64_t seed) {
      attn::LinearAttentionOptions<double> options;
      options.feature_map = attn::favor_plus<double>(m, d, seed);
      options.causal = causal;
      return (attn::linear_attention(q, k, v, options) - softmax).cwiseAbs().maxCoeff();
    };
    const double coarse = worst_error(8, 1), fine = worst_error(4096, 1);
    INFO("causal " << int(causal) << ": worst |favor+ - softmax| m=8 " << coarse << ", m=4096 "
                   << fine);
    // Stated tolerance: with m = 4096 every output is within 0.03 of softmax attention
    // (values ~ N(0, 1); measured 0.014 non-causal, 0.017 causal, about 1/sqrt(m)); with
    // m = 8 the error is several times larger (0.11, 0.19).
    CHECK(fine < 0.03);
    CHECK(coarse > 3 * fine);
  }

  SECTION("with a fixed seed it is reproducible; another seed gives another projection") {
    const attn::FeatureMap<float> a = attn::favor_plus<float>(64, d, 42);
    const attn::FeatureMap<float> b = attn::favor_plus<float>(64, d, 42);
    const attn::FeatureMap<float> c = attn::favor_plus<float>(64, d, 43);
    REQUIRE(a.projection() == b.projection());
    REQUIRE(a.projection() != c.projection());
    REQUIRE(a.projection().rows() == 64);
    REQUIRE(a.projection().cols() == d);
    attn::LinearAttentionOptions<float> options;
    options.feature_map = a;
    const attn::Matrix<float> qf = q.cast<float>(), kf = k.cast<float>(), vf = v.cast<float>();
    const attn::Matrix<float> first = attn::linear_attention(qf, kf, vf, options);
    options.feature_map = b;
    REQUIRE(attn::linear_attention(qf, kf, vf, options) == first);
    // Pinned values of seed 42: the sampler uses std::mt19937_64 (fully specified) and no
    // std distribution, so they hold with any standard library (to libm's last bit).
    const attn::Matrix<double> pinned = attn::favor_plus<double>(2, 2, 42).projection();
    CHECK_THAT(pinned(0, 0), Catch::Matchers::WithinRel(-0.28963674078665952, 1e-12));
    CHECK_THAT(pinned(1, 1), Catch::Matchers::WithinRel(-0.67596713470171599, 1e-12));
  }

  SECTION("each block of D rows is orthogonal") {
    const attn::Matrix<double> omega = attn::favor_plus<double>(20, d, 5).projection();  // (20, 8)
    for (Index block = 0; block < 2; ++block) {
      const attn::Matrix<double> rows = omega.middleRows(block * d, d);
      const attn::Matrix<double> gram = rows * rows.transpose();
      const attn::Matrix<double> off_diagonal =
          gram - attn::Matrix<double>(gram.diagonal().asDiagonal());
      REQUIRE(off_diagonal.cwiseAbs().maxCoeff() < 1e-12 * gram.diagonal().maxCoeff());
    }
  }

  SECTION("large inputs do not overflow: the stabilisers keep exp in range") {
    const attn::Matrix<float> big_q = (q * 40.0).cast<float>(), big_k = (k * 40.0).cast<float>();
    attn::LinearAttentionOptions<float> options;
    options.feature_map = attn::favor_plus<float>(256, d, 3);
    options.causal = attn::Causal::top_left;
    REQUIRE(attn::linear_attention(big_q, big_k, v.cast<float>().eval(), options).allFinite());
  }
}

TEMPLATE_TEST_CASE("linear attention: NaN propagates, empty problems are defined", "[linear][nan]",
                   float, double) {
  using T = TestType;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  attn::Matrix<T> q = random_matrix<T>(6, 4, 41u), k = random_matrix<T>(6, 4, 42u),
                  v = random_matrix<T>(6, 3, 43u);
  attn::LinearAttentionOptions<T> causal;
  causal.causal = attn::Causal::top_left;
  causal.chunk = 4;
  for (const std::string map : {"elu_plus_one", "relu", "identity"}) {
    causal.feature_map = feature_map_named<T>(map);
    INFO(map);
    attn::Matrix<T> q2 = q, k2 = k;
    q2(2, 1) = nan;
    attn::Matrix<T> out = attn::linear_attention(q2, k, v, causal);
    for (Index i = 0; i < 6; ++i)
      REQUIRE(out.row(i).array().isNaN().all() == (i == 2));
    k2(3, 0) = nan;  // reaches the queries that see key 3
    out = attn::linear_attention(q, k2, v, causal);
    for (Index i = 0; i < 6; ++i)
      REQUIRE(out.row(i).array().isNaN().all() == (i >= 3));
  }
  // Lq = 0, and no keys at all: zeros (0 / eps), as SDPA's rows that see nothing.
  attn::Tensor<T, 4> q0(1, 2, 0, 4), k3(1, 1, 3, 4), v3(1, 1, 3, 5);
  k3.setConstant(1);
  v3.setConstant(1);
  REQUIRE(attn::linear_attention(q0, k3, v3).size() == 0);
  attn::Tensor<T, 4> q1(1, 2, 2, 4), k0(1, 1, 0, 4), v0(1, 1, 0, 5);
  q1.setConstant(1);
  for (const attn::Causal c : {attn::Causal::none, attn::Causal::top_left}) {
    attn::LinearAttentionOptions<T> options;
    options.causal = c;
    const attn::Tensor<T, 4> out = attn::linear_attention(q1, k0, v0, options);
    REQUIRE(out.dimension(3) == 5);
    for (Index n = 0; n < out.size(); ++n)
      REQUIRE(out.data()[n] == T(0));
  }
}

TEST_CASE("linear attention rejects what SDPA rejects, and masks it cannot apply",
          "[linear][errors]") {
  const auto tensor = [](Index b, Index h, Index l, Index d) {
    attn::Tensor<float, 4> t(b, h, l, d);
    t.setConstant(0.5f);
    return t;
  };
  const auto q = tensor(2, 8, 16, 64), k = tensor(2, 8, 16, 64), v = tensor(2, 8, 16, 32);
  const auto linear = [](const attn::Tensor<float, 4>& a, const attn::Tensor<float, 4>& b,
                         const attn::Tensor<float, 4>& c,
                         const attn::LinearAttentionOptions<float>& o = {}) {
    return attn::linear_attention(a, b, c, o);
  };
  REQUIRE_NOTHROW(linear(q, k, v));
  REQUIRE_THROWS_WITH(linear(q, tensor(2, 8, 16, 32), v),
                      "linear_attention: q is [2, 8, 16, 64], k is [2, 8, 16, 32], v is [2, 8, 16, "
                      "32]: q and k head dims differ");
  REQUIRE_THROWS_WITH(linear(tensor(3, 8, 16, 64), k, v),
                      "linear_attention: q is [3, 8, 16, 64], k is [2, 8, 16, 64], v is [2, 8, 16, "
                      "32]: batch sizes differ");
  REQUIRE_THROWS_WITH(linear(q, k, tensor(2, 4, 16, 32)),
                      "linear_attention: q is [2, 8, 16, 64], k is [2, 8, 16, 64], v is [2, 4, 16, "
                      "32]: k and v head counts differ");
  REQUIRE_THROWS_WITH(linear(q, k, tensor(2, 8, 15, 32)),
                      "linear_attention: q is [2, 8, 16, 64], k is [2, 8, 16, 64], v is [2, 8, 15, "
                      "32]: k and v lengths differ");
  REQUIRE_THROWS_WITH(linear(q, tensor(2, 3, 16, 64), tensor(2, 3, 16, 32)),
                      "linear_attention: q is [2, 8, 16, 64], k is [2, 3, 16, 64], v is [2, 3, 16, "
                      "32]: query heads (8) must be a multiple of key/value heads (3)");
  REQUIRE_THROWS_WITH(linear(tensor(2, 8, 16, 0), tensor(2, 8, 16, 0), v),
                      "linear_attention: q is [2, 8, 16, 0], k is [2, 8, 16, 0], v is [2, 8, 16, "
                      "32]: the head dim must be positive");

  attn::LinearAttentionOptions<float> options;
  options.key_lengths = std::vector<Index>{16, 17};  // not "= {..}": GCC 12 -Wnonnull
  REQUIRE_THROWS_WITH(linear(q, k, v, options),
                      "linear_attention: key_lengths[1] is 17: must lie in [0, Lk] with Lk = 16");
  options.key_lengths = std::vector<Index>{16};
  REQUIRE_THROWS_WITH(linear(q, k, v, options),
                      "linear_attention: key_lengths has 1 entries but the batch size is 2");

  options = {};
  attn::Tensor<bool, 4> keep(2, 1, 16, 16);
  keep.setConstant(true);
  options.keep_mask = keep;
  REQUIRE_THROWS_WITH(linear(q, k, v, options),
                      "linear_attention: keep_mask is [2, 1, 16, 16]: linear attention never "
                      "forms the (Lq, Lk) scores, so it cannot apply a boolean mask (use causal "
                      "and key_lengths, or scaled_dot_product_attention)");
  options = {};
  attn::Tensor<float, 4> bias(1, 1, 16, 16);
  bias.setZero();
  options.bias = bias;
  REQUIRE_THROWS_WITH(linear(q, k, v, options),
                      "linear_attention: bias is [1, 1, 16, 16]: linear attention never forms "
                      "the (Lq, Lk) scores, so it cannot add a bias to them (use "
                      "scaled_dot_product_attention)");
  options = {};
  options.eps = -1.0f;
  REQUIRE_THROWS_WITH(linear(q, k, v, options),
                      "linear_attention: eps is -1.000000: must be finite and >= 0");
  options.eps = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(linear(q, k, v, options),
                      "linear_attention: eps is nan: must be finite and >= 0");
  options = {};
  options.chunk = -1;
  REQUIRE_THROWS_WITH(linear(q, k, v, options),
                      "linear_attention: chunk is -1: must be >= 0 (0 = default)");
  options = {};
  options.feature_map = attn::favor_plus<float>(128, 32, 1);
  REQUIRE_THROWS_WITH(linear(q, k, v, options),
                      "linear_attention: the FAVOR+ projection is [128, 32] (m, D) but q and k "
                      "have D = 64");

  // The strided entry point also checks its output view.
  attn::Tensor<float, 4> out(2, 8, 16, 64);
  REQUIRE_THROWS_WITH(
      attn::linear_attention_into<float>(attn::bhld_view(q), attn::bhld_view(k), attn::bhld_view(v),
                                         attn::bhld_view(out)),
      "linear_attention: out is [2, 8, 16, 64] but must be [2, 8, 16, 32] (B, Hq, Lq, Dv)");

  // The matrix overload reports the same rules with (1, 1, L, D) shapes.
  const attn::Matrix<double> a = attn::Matrix<double>::Ones(3, 4),
                             b = attn::Matrix<double>::Ones(5, 3);
  REQUIRE_THROWS_WITH(attn::linear_attention(a, b, b),
                      "linear_attention: q is [1, 1, 3, 4], k is [1, 1, 5, 3], v is [1, 1, 5, 3]: "
                      "q and k head dims differ");

  // Feature maps.
  REQUIRE_THROWS_WITH(attn::favor_plus<float>(0, 64, 1),
                      "favor_plus: m is 0 and D is 64: both must be >= 1");
  REQUIRE_THROWS_WITH(attn::FeatureMap<float>::custom(nullptr),
                      "FeatureMap::custom: the function is empty");
  REQUIRE_THROWS_WITH(
      attn::FeatureMap<float>::custom(
          [](const Eigen::Ref<const attn::Matrix<float>>&, Eigen::Ref<attn::Matrix<float>>) {}, -2),
      "FeatureMap::custom: features is -2: must be >= 0 (0 = D)");

  // The recurrent state.
  REQUIRE_THROWS_WITH(attn::LinearAttentionState<float>(0, 4),
                      "LinearAttentionState: D is 0 and Dv is 4: need D >= 1 and Dv >= 0");
  REQUIRE_THROWS_WITH(attn::LinearAttentionState<float>(4, 4, {}, -1.0f),
                      "LinearAttentionState: eps is -1.000000: must be finite and >= 0");
  REQUIRE_THROWS_WITH(attn::LinearAttentionState<float>(4, 4, attn::favor_plus<float>(8, 5, 1)),
                      "LinearAttentionState: the FAVOR+ projection is [8, 5] (m, D) but D = 4");
  attn::LinearAttentionState<float> state(4, 3);
  const attn::Vector<float> x4 = attn::Vector<float>::Ones(4), x3 = attn::Vector<float>::Ones(3);
  REQUIRE_THROWS_WITH(state.step(x4, x3, x3),
                      "LinearAttentionState::update: k is [3, 1] but must be a vector of 4 "
                      "elements (D = 4, Dv = 3)");
  REQUIRE_THROWS_WITH(state.step(x4, x4, x4),
                      "LinearAttentionState::update: v is [4, 1] but must be a vector of 3 "
                      "elements (D = 4, Dv = 3)");
  REQUIRE_THROWS_WITH(state.step(attn::Matrix<float>::Ones(2, 2), x4, x3),
                      "LinearAttentionState::query: q is [2, 2] but must be a vector of 4 "
                      "elements (D = 4, Dv = 3)");
  attn::Vector<float> wrong(4);
  REQUIRE_THROWS_WITH(state.query_into(x4, wrong),
                      "LinearAttentionState::query: out has 4 elements but Dv = 3");
}

TEST_CASE("plan_linear_attention chooses the chunk, the work items and the threads",
          "[linear][plan]") {
  // B 2, Hq 8, Hkv 2, Lq 100, Lk 300, M 32 features, Dv 24.
  attn::LinearAttentionShape shape{2, 8, 2, 100, 300, 32, 24, true};
  const attn::LinearPlan forward = attn::plan_linear_attention(shape, 0);
  CHECK(forward.chunk == attn::default_linear_chunk);
  CHECK(forward.work_items == 4);  // B * Hkv
  CHECK(forward.flops == 4.0 * 16 * 300 * 32 * 25);
  CHECK(forward.parallel == (forward.flops > attn::parallel_flops));
  CHECK(forward.threads == (forward.parallel ? std::min(attn::detail::max_threads(), 4) : 1));
  const attn::LinearPlan backward = attn::plan_linear_attention(shape, 5, true);
  CHECK(backward.chunk == 5);
  CHECK(backward.flops == 2.5 * forward.flops);
  CHECK(backward.describe() ==
        "linear backward (causal): chunks of 5 rows; 4 work items (B * Hkv) on " +
            std::to_string(backward.threads) + (backward.threads == 1 ? " thread" : " threads"));
  // Too small to pay for a parallel region; one item never opens one.
  shape.q_length = shape.k_length = 4;
  CHECK_FALSE(attn::plan_linear_attention(shape, 0).parallel);
  CHECK(attn::plan_linear_attention(shape, 0).threads == 1);
  shape = {1, 64, 1, 4096, 4096, 64, 64, false};
  CHECK_FALSE(attn::plan_linear_attention(shape, 0).parallel);
  CHECK(attn::plan_linear_attention(shape, 0).describe().rfind("linear forward (non-causal)", 0) ==
        0);
  REQUIRE_THROWS_WITH(attn::plan_linear_attention(shape, -3),
                      "plan_linear_attention: chunk is -3: must be >= 0 (0 = default)");

  // linear_attention runs the plan's chunk: chunk 0 gives the bits of default_linear_chunk.
  attn::Tensor<float, 4> q(1, 2, 70, 8), k(1, 1, 70, 8), v(1, 1, 70, 8);
  std::mt19937 rng(3u);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (attn::Tensor<float, 4>* t : {&q, &k, &v})
    for (Index n = 0; n < t->size(); ++n)
      t->data()[n] = normal(rng);
  attn::LinearAttentionOptions<float> options;
  options.causal = attn::Causal::top_left;
  const attn::Tensor<float, 4> by_default = attn::linear_attention(q, k, v, options);
  options.chunk = attn::default_linear_chunk;
  const attn::Tensor<float, 4> named = attn::linear_attention(q, k, v, options);
  options.chunk = 7;
  const attn::Tensor<float, 4> other = attn::linear_attention(q, k, v, options);
  CHECK(std::equal(by_default.data(), by_default.data() + by_default.size(), named.data()));
  CHECK_FALSE(std::equal(by_default.data(), by_default.data() + by_default.size(), other.data()));
}

#if ATTN_HAS_OPENMP
TEMPLATE_TEST_CASE("linear attention gives the same bits with 1 and 2 threads",
                   "[linear][determinism]", float, double) {
  using T = TestType;
  attn::Tensor<T, 4> q(2, 4, 300, 32), k(2, 2, 300, 32), v(2, 2, 300, 24);
  std::mt19937 rng(9u);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (attn::Tensor<T, 4>* t : {&q, &k, &v})
    for (Index n = 0; n < t->size(); ++n)
      t->data()[n] = static_cast<T>(normal(rng));
  const int saved = omp_get_max_threads();
  for (const attn::Causal causal : {attn::Causal::none, attn::Causal::top_left}) {
    attn::LinearAttentionOptions<T> options;
    options.causal = causal;
    options.feature_map = attn::favor_plus<T>(48, 32, 1);
    omp_set_num_threads(1);
    const attn::Tensor<T, 4> one = attn::linear_attention(q, k, v, options);
    omp_set_num_threads(2);
    const attn::Tensor<T, 4> two = attn::linear_attention(q, k, v, options);
    omp_set_num_threads(saved);
    REQUIRE(std::equal(one.data(), one.data() + one.size(), two.data()));
  }
}
#endif  // ATTN_HAS_OPENMP
