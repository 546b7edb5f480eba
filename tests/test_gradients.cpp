// Tests of the backward passes: linear_attention_backward (attn/linear_attention.hpp) and the
// layer gradients of attn/projection.hpp (Linear, QKVProjection), against torch autograd in
// float64 (tests/reference/generate_gradients.py: autograd through the explicit quadratic
// formulas and F.linear), in double (1e-10) and float (1e-4); central finite differences of
// the library's own forward in long double on tiny problems for every feature map; the
// strided and one-head entry points, chunk sizes, thread counts, NaN, and every error message.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <attn/linear_attention.hpp>
#include <attn/multihead.hpp>
#include <attn/projection.hpp>

#include "support/fixtures.hpp"

using attn::Index;
using attn_test::json;

namespace {

template <class T>
constexpr double gradient_tolerance() {
  return std::is_same_v<T, float> ? 1e-4 : 1e-10;
}

template <class T>
using Ref = Eigen::Ref<const attn::Matrix<T>>;
template <class T>
using Out = Eigen::Ref<attn::Matrix<T>>;

/// The custom map of the fixtures, phi(x) = softmax(x W) over the M features (it mixes a
/// row's coordinates), and its vector-Jacobian product dx = (phi * (dphi - dphi . phi)) W^T.
template <class T>
attn::FeatureMap<T> softmax_map(const attn::Matrix<T>& w) {  // (D, M)
  return attn::FeatureMap<T>::custom(
      [w](const Ref<T>& x, Out<T> phi) {
        phi.noalias() = x * w;
        for (Index r = 0; r < phi.rows(); ++r) {
          phi.row(r).array() = (phi.row(r).array() - phi.row(r).maxCoeff()).exp();
          phi.row(r) /= phi.row(r).sum();
        }
      },
      [w](const Ref<T>&, const Ref<T>& phi, const Ref<T>& dphi, Out<T> dx) {
        const attn::Vector<T> dots = (dphi.array() * phi.array()).rowwise().sum();
        const attn::Matrix<T> dz = (phi.array() * (dphi.colwise() - dots).array()).matrix();
        dx.noalias() = dz * w.transpose();
      },
      w.cols());
}

template <class T>
attn::Vector<T> vector_of(const json& t) {
  const std::vector<T> data = attn_test::values<T>(t);
  return Eigen::Map<const attn::Vector<T>>(data.data(), static_cast<Index>(data.size()));
}

attn::Causal causal_named(const std::string& name) {
  return name == "top_left"       ? attn::Causal::top_left
         : name == "bottom_right" ? attn::Causal::bottom_right
                                  : attn::Causal::none;
}

template <class T>
attn::LinearAttentionOptions<T> options_of(const json& c) {
  attn::LinearAttentionOptions<T> o;
  const std::string fm = c.at("feature_map").get<std::string>();
  if (fm == "relu")
    o.feature_map = attn::FeatureMap<T>::relu();
  else if (fm == "identity")
    o.feature_map = attn::FeatureMap<T>::identity();
  else if (fm == "favor_plus")
    o.feature_map = attn::FeatureMap<T>::favor_plus_from(attn_test::matrix<T>(c.at("omega")));
  else if (fm == "custom")
    o.feature_map = softmax_map<T>(attn_test::matrix<T>(c.at("custom_weight")));
  o.causal = causal_named(c.at("causal").get<std::string>());
  if (!c.at("key_lengths").is_null())
    o.key_lengths = c.at("key_lengths").get<std::vector<Index>>();
  o.eps = static_cast<T>(c.at("eps").get<double>());
  o.chunk = c.at("chunk").get<Index>();
  return o;
}

template <class T, int R>
void require_close(const attn::Tensor<T, R>& actual, const json& expected, double rtol) {
  const std::vector<double> e = attn_test::values<double>(expected);
  ATTN_REQUIRE_CLOSE(actual.data(), actual.size(), e, rtol);
}

template <class T>
void require_close(const attn::Matrix<T>& actual, const json& expected, double rtol) {
  const std::vector<Index> shape = attn_test::shape_of(expected);
  REQUIRE(actual.rows() == shape.at(0));
  REQUIRE(actual.cols() == (shape.size() > 1 ? shape[1] : 1));
  const std::vector<double> e = attn_test::values<double>(expected);
  ATTN_REQUIRE_CLOSE(actual.data(), actual.size(), e, rtol);
}

template <class T>
void require_close(const attn::Vector<T>& actual, const json& expected, double rtol) {
  const std::vector<double> e = attn_test::values<double>(expected);
  ATTN_REQUIRE_CLOSE(actual.data(), actual.size(), e, rtol);
}

/// A copy of a (B, H, L, D) tensor in (B, L, H, D) memory, padded by `pad` columns per row,
/// and the (B, H, L, D) view of it: the strided entry point must not care.
template <class T>
struct Strided {
  std::vector<T> memory;
  attn::HeadsView<T> view;
  explicit Strided(const attn::Tensor<T, 4>& x, Index pad = 3, T fill = T(0)) {
    const Index b = x.dimension(0), h = x.dimension(1), l = x.dimension(2), d = x.dimension(3);
    const Index row = h * d + pad;
    memory.assign(static_cast<std::size_t>(std::max<Index>(b * l * row, 1)), fill);
    view = {memory.data(), b, h, l, d, l * row, d, row};
    for (Index bi = 0; bi < b; ++bi)
      for (Index hi = 0; hi < h; ++hi)
        for (Index li = 0; li < l; ++li)
          for (Index di = 0; di < d; ++di)
            view.head(bi, hi)(li, di) = x(bi, hi, li, di);
  }
  attn::Tensor<T, 4> dense() const {
    attn::Tensor<T, 4> out(view.batch, view.heads, view.length, view.dim);
    for (Index bi = 0; bi < view.batch; ++bi)
      for (Index hi = 0; hi < view.heads; ++hi)
        for (Index li = 0; li < view.length; ++li)
          for (Index di = 0; di < view.dim; ++di)
            out(bi, hi, li, di) = view.head(bi, hi)(li, di);
    return out;
  }
};

template <class T>
attn::Tensor<T, 4> random_tensor(Index b, Index h, Index l, Index d, std::uint32_t seed,
                                 double scale = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, scale);
  attn::Tensor<T, 4> t(b, h, l, d);
  for (Index n = 0; n < t.size(); ++n)
    t.data()[n] = static_cast<T>(normal(rng));
  return t;
}

}  // namespace

// --- linear attention ------------------------------------------------------------------

TEMPLATE_TEST_CASE("linear_attention_backward matches torch autograd",
                   "[gradients][linear_attention_backward]", float, double) {
  using T = TestType;
  const double rtol = gradient_tolerance<T>();
  for (const json& c : ATTN_FIXTURE_CASES("gradients.json", "linear_attention", 35)) {
    SECTION(c.at("name").get<std::string>()) {
      const auto q = attn_test::tensor<T, 4>(c.at("q"));
      const auto k = attn_test::tensor<T, 4>(c.at("k"));
      const auto v = attn_test::tensor<T, 4>(c.at("v"));
      const auto dout = attn_test::tensor<T, 4>(c.at("dout"));
      const attn::LinearAttentionOptions<T> options = options_of<T>(c);
      // The fixture's forward is the library's (its shifts included).
      require_close(attn::linear_attention(q, k, v, options), c.at("out"), rtol);
      const auto grads = attn::linear_attention_backward(q, k, v, dout, options);
      require_close(grads.dq, c.at("dq"), rtol);
      require_close(grads.dk, c.at("dk"), rtol);
      require_close(grads.dv, c.at("dv"), rtol);

      // Strided (B, L, H, D) views with padded rows, outputs pre-filled with garbage.
      const Strided<T> qs(q), ks(k), vs(v), os(dout);
      Strided<T> dq(q, 2, T(7)), dk(k, 1, T(-3)), dv(v, 4, T(9));
      attn::linear_attention_backward_into<T>(qs.view, ks.view, vs.view, os.view, dq.view, dk.view,
                                              dv.view, options);
      require_close(dq.dense(), c.at("dq"), rtol);
      require_close(dk.dense(), c.at("dk"), rtol);
      require_close(dv.dense(), c.at("dv"), rtol);

      // The chunk size only matters to FAVOR+ (which shift each chunk saw).
      if (options_of<T>(c).feature_map.kind() != attn::FeatureKind::favor_plus) {
        for (const Index chunk : {Index(1), Index(3), Index(0)}) {
          attn::LinearAttentionOptions<T> other = options;
          other.chunk = chunk;
          const auto g = attn::linear_attention_backward(q, k, v, dout, other);
          require_close(g.dq, c.at("dq"), rtol);
          require_close(g.dk, c.at("dk"), rtol);
          require_close(g.dv, c.at("dv"), rtol);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("linear_attention_backward on one head as matrices",
                   "[gradients][linear_attention_backward]", float, double) {
  using T = TestType;
  const double rtol = gradient_tolerance<T>();
  int heads = 0;
  for (const json& c : ATTN_FIXTURE_CASES("gradients.json", "linear_attention", 35)) {
    const auto q = attn_test::tensor<T, 4>(c.at("q"));
    if (q.dimension(0) != 1 || q.dimension(1) != 1)
      continue;
    ++heads;
    const auto head = [](const attn::Tensor<T, 4>& t) {
      return attn::Matrix<T>(attn::bhld_view(t).head(0, 0));
    };
    const attn::Matrix<T> qm = head(q), km = head(attn_test::tensor<T, 4>(c.at("k"))),
                          vm = head(attn_test::tensor<T, 4>(c.at("v"))),
                          om = head(attn_test::tensor<T, 4>(c.at("dout")));
    // Column-major inputs and expressions go through the same entry point.
    const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> k_column_major = km;
    const auto g =
        attn::linear_attention_backward(qm, k_column_major, vm, om * T(1), options_of<T>(c));
    const std::vector<Index> qs = attn_test::shape_of(c.at("q")),
                             ks = attn_test::shape_of(c.at("k"));
    REQUIRE(g.dq.rows() == qs[2]);
    REQUIRE(g.dk.rows() == ks[2]);
    for (const auto& [actual, name] : {std::pair<const attn::Matrix<T>*, const char*>{&g.dq, "dq"},
                                       {&g.dk, "dk"},
                                       {&g.dv, "dv"}}) {
      const std::vector<double> expected = attn_test::values<double>(c.at(name));
      ATTN_REQUIRE_CLOSE(actual->data(), actual->size(), expected, rtol);
    }
  }
  REQUIRE(heads == 3);
}

namespace {

using LD = long double;

/// Central differences of sum(linear_attention(q, k, v) * g) in long double, for every
/// element of q, k and v, against linear_attention_backward in long double.
void check_finite_differences(const attn::LinearAttentionOptions<LD>& options, Index hq, Index hkv,
                              Index lq, Index lk, Index d, Index dv, std::uint32_t seed,
                              bool far_first_key = false) {
  attn::Tensor<LD, 4> q = random_tensor<LD>(1, hq, lq, d, seed),
                      k = random_tensor<LD>(1, hkv, lk, d, seed + 1),
                      v = random_tensor<LD>(1, hkv, lk, dv, seed + 2),
                      g = random_tensor<LD>(1, hq, lq, dv, seed + 3);
  if (options.feature_map.kind() == attn::FeatureKind::identity) {  // positive normalisers
    for (attn::Tensor<LD, 4>* t : {&q, &k})
      for (Index n = 0; n < t->size(); ++n)
        t->data()[n] = 0.2L + std::abs(t->data()[n]);
  }
  if (far_first_key) {  // FAVOR+: key 0's largest exponent ~ -40, so key 1 raises the shift
    const attn::Matrix<LD> omega = options.feature_map.projection();
    const attn::Matrix<LD> direction = omega.colwise().sum().normalized();
    for (Index h = 0; h < hkv; ++h)
      for (Index c = 0; c < d; ++c)
        k(0, h, 0, c) = -14.0L * direction(0, c);
  }
  const auto loss = [&](const attn::Tensor<LD, 4>& a, const attn::Tensor<LD, 4>& b,
                        const attn::Tensor<LD, 4>& c) {
    const attn::Tensor<LD, 4> out = attn::linear_attention(a, b, c, options);
    LD sum = 0;
    for (Index n = 0; n < out.size(); ++n)
      sum += out.data()[n] * g.data()[n];
    return sum;
  };
  const auto grads = attn::linear_attention_backward(q, k, v, g, options);
  const LD h = 1e-7L;
  double worst = 0;
  std::string where;
  const auto sweep = [&](attn::Tensor<LD, 4>& x, const attn::Tensor<LD, 4>& dx, const char* name) {
    for (Index n = 0; n < x.size(); ++n) {
      const LD saved = x.data()[n];
      x.data()[n] = saved + h;
      const LD plus = loss(q, k, v);
      x.data()[n] = saved - h;
      const LD minus = loss(q, k, v);
      x.data()[n] = saved;
      const LD numeric = (plus - minus) / (2 * h);
      const double error = static_cast<double>(std::abs(numeric - dx.data()[n]) /
                                               std::max<LD>(1, std::abs(numeric)));
      if (error > worst || !(error == error)) {
        worst = error == error ? error : 1e300;
        where = std::string(name) + "[" + std::to_string(n) + "]: finite differences " +
                std::to_string(static_cast<double>(numeric)) + ", backward " +
                std::to_string(static_cast<double>(dx.data()[n]));
      }
    }
  };
  sweep(q, grads.dq, "dq");
  sweep(k, grads.dk, "dk");
  sweep(v, grads.dv, "dv");
  INFO("worst relative error " << worst << " at " << where);
  REQUIRE(worst < 1e-8);
}

}  // namespace

TEST_CASE("linear_attention_backward agrees with finite differences in long double",
          "[gradients][linear_attention_backward]") {
  attn::Matrix<LD> custom_weight(3, 4);
  custom_weight << 0.5L, -1.0L, 0.25L, 0.8L, -0.3L, 0.7L, 1.1L, -0.6L, 0.9L, 0.2L, -0.4L, 0.1L;
  const std::vector<std::pair<std::string, attn::FeatureMap<LD>>> maps = {
      {"elu_plus_one", attn::FeatureMap<LD>::elu_plus_one()},
      {"relu", attn::FeatureMap<LD>::relu()},
      {"identity", attn::FeatureMap<LD>::identity()},
      {"custom softmax(x W)", softmax_map<LD>(custom_weight)},
      {"favor_plus", attn::favor_plus<LD>(7, 3, 11)},
  };
  for (const auto& [name, map] : maps) {
    for (const attn::Causal causal :
         {attn::Causal::none, attn::Causal::top_left, attn::Causal::bottom_right}) {
      for (const LD eps : {1e-6L, 0.3L}) {
        attn::LinearAttentionOptions<LD> options;
        options.feature_map = map;
        options.causal = causal;
        options.eps = eps;
        options.chunk = 2;
        INFO(name << ", causal " << static_cast<int>(causal) << ", eps "
                  << static_cast<double>(eps));
        check_finite_differences(options, 2, 1, 5, 6, 3, 2, 17u);  // Lq < Lk, GQA
        check_finite_differences(options, 1, 1, 6, 4, 3, 4, 29u);  // Lq > Lk, Dv > D
        if (map.kind() == attn::FeatureKind::favor_plus) {
          check_finite_differences(options, 2, 2, 5, 5, 3, 2, 41u, true);  // shift raised
          options.key_lengths = std::vector<Index>{3};
          check_finite_differences(options, 1, 1, 4, 5, 3, 2, 53u, true);
        }
      }
    }
  }
}

TEST_CASE("linear_attention_backward: padding keys and unseen keys get zero gradients",
          "[gradients][linear_attention_backward]") {
  const auto q = random_tensor<double>(2, 2, 5, 4, 1u), k = random_tensor<double>(2, 1, 8, 4, 2u),
             v = random_tensor<double>(2, 1, 8, 3, 3u), g = random_tensor<double>(2, 2, 5, 3, 4u);
  attn::LinearAttentionOptions<double> options;
  options.key_lengths = std::vector<Index>{6, 0};
  options.causal = attn::Causal::top_left;  // keys 5.. are seen by no query (Lq = 5)
  const auto grads = attn::linear_attention_backward(q, k, v, g, options);
  for (Index j = 0; j < 8; ++j) {
    for (Index c = 0; c < 4; ++c) {
      CHECK((grads.dk(0, 0, j, c) == 0) == (j >= 5));
      CHECK(grads.dk(1, 0, j, c) == 0);
    }
  }
  // Batch entry 1 sees no key: its outputs are 0 whatever q, so dq is 0 too.
  for (Index h = 0; h < 2; ++h)
    for (Index i = 0; i < 5; ++i)
      for (Index c = 0; c < 4; ++c)
        CHECK(grads.dq(1, h, i, c) == 0);
  // Lq = 0: every key gradient is zero, causal or not.
  for (const attn::Causal causal : {attn::Causal::none, attn::Causal::bottom_right}) {
    attn::LinearAttentionOptions<double> empty;
    empty.causal = causal;
    const auto none = attn::linear_attention_backward(
        attn::Tensor<double, 4>(1, 2, 0, 4), random_tensor<double>(1, 1, 3, 4, 5u),
        random_tensor<double>(1, 1, 3, 3, 6u), attn::Tensor<double, 4>(1, 2, 0, 3), empty);
    REQUIRE(none.dq.size() == 0);
    for (Index n = 0; n < none.dk.size(); ++n)
      CHECK(none.dk.data()[n] == 0);
    for (Index n = 0; n < none.dv.size(); ++n)
      CHECK(none.dv.data()[n] == 0);
  }
}

TEMPLATE_TEST_CASE("linear_attention_backward: NaN propagates to what it touches",
                   "[gradients][linear_attention_backward]", float, double) {
  using T = TestType;
  auto q = random_tensor<T>(1, 1, 6, 4, 7u);
  const auto k = random_tensor<T>(1, 1, 6, 4, 8u), v = random_tensor<T>(1, 1, 6, 3, 9u),
             g = random_tensor<T>(1, 1, 6, 3, 10u);
  q(0, 0, 3, 1) = std::numeric_limits<T>::quiet_NaN();
  for (const attn::Causal causal : {attn::Causal::none, attn::Causal::top_left}) {
    attn::LinearAttentionOptions<T> options;
    options.causal = causal;
    options.chunk = 2;
    const auto grads = attn::linear_attention_backward(q, k, v, g, options);
    for (Index i = 0; i < 6; ++i)  // dq of a row depends on that row only (and its keys)
      CHECK(std::isnan(grads.dq(0, 0, i, 0)) == (i == 3));
    for (Index j = 0; j < 6; ++j) {  // keys row 3 sees: all (non-causal), j <= 3 (causal)
      const bool seen = causal == attn::Causal::none || j <= 3;
      CHECK(std::isnan(grads.dk(0, 0, j, 0)) == seen);
      CHECK(std::isnan(grads.dv(0, 0, j, 0)) == seen);
    }
  }
  // NaN in dout: relu's zero derivative does not hide it (products, not selects).
  attn::Tensor<T, 4> q2 = random_tensor<T>(1, 1, 3, 4, 11u), g2 = random_tensor<T>(1, 1, 3, 3, 12u);
  q2(0, 0, 0, 0) = T(-1);  // relu'(q) = 0 there
  g2(0, 0, 0, 0) = std::numeric_limits<T>::quiet_NaN();
  attn::LinearAttentionOptions<T> relu;
  relu.feature_map = attn::FeatureMap<T>::relu();
  const auto grads = attn::linear_attention_backward(q2, random_tensor<T>(1, 1, 3, 4, 13u),
                                                     random_tensor<T>(1, 1, 3, 3, 14u), g2, relu);
  CHECK(std::isnan(grads.dq(0, 0, 0, 0)));
}

#if ATTN_HAS_OPENMP
TEMPLATE_TEST_CASE("linear_attention_backward gives the same bits with 1 and 2 threads",
                   "[gradients][linear_attention_backward][determinism]", float, double) {
  using T = TestType;
  const auto q = random_tensor<T>(2, 4, 150, 16, 21u), k = random_tensor<T>(2, 2, 150, 16, 22u),
             v = random_tensor<T>(2, 2, 150, 12, 23u), g = random_tensor<T>(2, 4, 150, 12, 24u);
  const int saved = omp_get_max_threads();
  for (const attn::Causal causal : {attn::Causal::none, attn::Causal::top_left}) {
    attn::LinearAttentionOptions<T> options;
    options.causal = causal;
    options.feature_map = attn::favor_plus<T>(24, 16, 1);
    omp_set_num_threads(1);
    const auto one = attn::linear_attention_backward(q, k, v, g, options);
    omp_set_num_threads(2);
    const auto two = attn::linear_attention_backward(q, k, v, g, options);
    omp_set_num_threads(saved);
    REQUIRE(std::equal(one.dq.data(), one.dq.data() + one.dq.size(), two.dq.data()));
    REQUIRE(std::equal(one.dk.data(), one.dk.data() + one.dk.size(), two.dk.data()));
    REQUIRE(std::equal(one.dv.data(), one.dv.data() + one.dv.size(), two.dv.data()));
  }
}
#endif  // ATTN_HAS_OPENMP

TEST_CASE("linear_attention_backward rejects what the forward rejects, and more",
          "[gradients][linear_attention_backward][errors]") {
  const auto tensor = [](Index b, Index h, Index l, Index d) {
    attn::Tensor<float, 4> t(b, h, l, d);
    t.setConstant(0.5f);
    return t;
  };
  const auto q = tensor(2, 4, 8, 6), k = tensor(2, 2, 8, 6), v = tensor(2, 2, 8, 5),
             dout = tensor(2, 4, 8, 5);
  using Options = attn::LinearAttentionOptions<float>;
  const auto backward = [](const attn::Tensor<float, 4>& a, const attn::Tensor<float, 4>& b,
                           const attn::Tensor<float, 4>& c, const attn::Tensor<float, 4>& d,
                           const Options& o = {}) {
    return attn::linear_attention_backward(a, b, c, d, o);
  };
  REQUIRE_NOTHROW(backward(q, k, v, dout));
  REQUIRE_THROWS_WITH(backward(q, tensor(2, 2, 8, 4), v, dout),
                      "linear_attention_backward: q is [2, 4, 8, 6], k is [2, 2, 8, 4], v is [2, "
                      "2, 8, 5]: q and k head dims differ");
  REQUIRE_THROWS_WITH(backward(q, tensor(2, 3, 8, 6), tensor(2, 3, 8, 5), dout),
                      "linear_attention_backward: q is [2, 4, 8, 6], k is [2, 3, 8, 6], v is [2, "
                      "3, 8, 5]: query heads (4) must be a multiple of key/value heads (3)");
  REQUIRE_THROWS_WITH(backward(q, k, v, tensor(2, 4, 8, 6)),
                      "linear_attention_backward: dout is [2, 4, 8, 6] but must be [2, 4, 8, 5] "
                      "(B, Hq, Lq, Dv)");
  REQUIRE_THROWS_WITH(backward(q, k, v, tensor(2, 4, 7, 5)),
                      "linear_attention_backward: dout is [2, 4, 7, 5] but must be [2, 4, 8, 5] "
                      "(B, Hq, Lq, Dv)");
  Options options;
  options.key_lengths = std::vector<Index>{8, 9};
  REQUIRE_THROWS_WITH(backward(q, k, v, dout, options),
                      "linear_attention_backward: key_lengths[1] is 9: must lie in [0, Lk] with "
                      "Lk = 8");
  options = {};
  attn::Tensor<bool, 4> keep(2, 1, 8, 8);
  keep.setConstant(true);
  options.keep_mask = keep;
  REQUIRE_THROWS_WITH(backward(q, k, v, dout, options),
                      "linear_attention_backward: keep_mask is [2, 1, 8, 8]: linear attention "
                      "never forms the (Lq, Lk) scores, so it cannot apply a boolean mask (use "
                      "causal and key_lengths, or scaled_dot_product_attention)");
  options = {};
  options.eps = -1.0f;
  REQUIRE_THROWS_WITH(backward(q, k, v, dout, options),
                      "linear_attention_backward: eps is -1.000000: must be finite and >= 0");
  options = {};
  options.chunk = -2;
  REQUIRE_THROWS_WITH(backward(q, k, v, dout, options),
                      "linear_attention_backward: chunk is -2: must be >= 0 (0 = default)");
  options = {};
  options.feature_map = attn::favor_plus<float>(16, 5, 1);
  REQUIRE_THROWS_WITH(backward(q, k, v, dout, options),
                      "linear_attention_backward: the FAVOR+ projection is [16, 5] (m, D) but q "
                      "and k have D = 6");

  // A custom map needs its derivative.
  const auto exp_map = [](const Ref<float>& x, Out<float> phi) { phi = x.array().exp().matrix(); };
  options = {};
  options.feature_map = attn::FeatureMap<float>::custom(exp_map);
  REQUIRE_NOTHROW(attn::linear_attention(q, k, v, options));
  REQUIRE_THROWS_WITH(backward(q, k, v, dout, options),
                      "linear_attention_backward: the custom feature map has no derivative: "
                      "build it with FeatureMap::custom(function, vjp, features)");
  REQUIRE_FALSE(options.feature_map.has_derivative());
  attn::Matrix<float> x(2, 6), dx(2, 6);
  x.setOnes();
  REQUIRE_THROWS_WITH(options.feature_map.vjp(x, x, x, dx),
                      "FeatureMap::vjp: this custom feature map has no derivative: build it with "
                      "FeatureMap::custom(function, vjp, features)");
  REQUIRE_THROWS_WITH(attn::FeatureMap<float>::custom(exp_map, attn::FeatureMap<float>::Vjp(), 3),
                      "FeatureMap::custom: the derivative (vjp) is empty");
  const auto with_vjp = attn::FeatureMap<float>::custom(
      exp_map, [](const Ref<float>&, const Ref<float>& phi, const Ref<float>& dphi, Out<float> d) {
        d = (phi.array() * dphi.array()).matrix();
      });
  REQUIRE(with_vjp.has_derivative());
  REQUIRE(with_vjp.features(6) == 6);

  // The strided entry point: output shapes, and no gradient may overlap an input or another.
  attn::Tensor<float, 4> dq(2, 4, 8, 6), dk(2, 2, 8, 6), dv(2, 2, 8, 5), wrong(2, 2, 8, 6);
  const auto into = [&](const attn::HeadsView<float>& a, const attn::HeadsView<float>& b,
                        const attn::HeadsView<float>& c) {
    attn::linear_attention_backward_into<float>(attn::bhld_view(q), attn::bhld_view(k),
                                                attn::bhld_view(v), attn::bhld_view(dout), a, b, c);
  };
  REQUIRE_NOTHROW(into(attn::bhld_view(dq), attn::bhld_view(dk), attn::bhld_view(dv)));
  REQUIRE_THROWS_WITH(into(attn::bhld_view(dk), attn::bhld_view(dk), attn::bhld_view(dv)),
                      "linear_attention_backward: dq is [2, 2, 8, 6] but must be [2, 4, 8, 6] (B, "
                      "Hq, Lq, D), the shape of q");
  REQUIRE_THROWS_WITH(into(attn::bhld_view(dq), attn::bhld_view(dq), attn::bhld_view(dv)),
                      "linear_attention_backward: dk is [2, 4, 8, 6] but must be [2, 2, 8, 6] (B, "
                      "Hkv, Lk, D), the shape of k");
  REQUIRE_THROWS_WITH(into(attn::bhld_view(dq), attn::bhld_view(dk), attn::bhld_view(wrong)),
                      "linear_attention_backward: dv is [2, 2, 8, 6] but must be [2, 2, 8, 5] (B, "
                      "Hkv, Lk, Dv), the shape of v");
  attn::Tensor<float, 4> q_copy = q;
  const auto in_place = [&] {
    attn::linear_attention_backward_into<float>(
        attn::bhld_view(q_copy), attn::bhld_view(k), attn::bhld_view(v), attn::bhld_view(dout),
        attn::bhld_view(q_copy), attn::bhld_view(dk), attn::bhld_view(dv));
  };
  REQUIRE_THROWS_WITH(in_place(),
                      "linear_attention_backward: dq overlaps q: the gradients must "
                      "share no element with q, k, v, dout or each other");
  // dk and dv as overlapping windows of one buffer.
  std::vector<float> shared(2 * 2 * 8 * 6 + 8, 0.0f);
  const attn::HeadsView<float> dk_view = attn::bhld_view(shared.data(), 2, 2, 8, 6);
  const attn::HeadsView<float> dv_view = attn::bhld_view(shared.data() + 8, 2, 2, 8, 5);
  REQUIRE_THROWS_WITH(into(attn::bhld_view(dq), dk_view, dv_view),
                      "linear_attention_backward: dv overlaps dk: the gradients must share no "
                      "element with q, k, v, dout or each other");

  // The matrix overload names the (1, 1, L, D) shapes.
  const attn::Matrix<double> a = attn::Matrix<double>::Ones(3, 4),
                             b = attn::Matrix<double>::Ones(5, 3);
  REQUIRE_THROWS_WITH(attn::linear_attention_backward(a, b, b, a),
                      "linear_attention_backward: q is [1, 1, 3, 4], k is [1, 1, 5, 3], v is [1, "
                      "1, 5, 3]: q and k head dims differ");
  REQUIRE_THROWS_WITH(attn::linear_attention_backward(a, attn::Matrix<double>::Ones(5, 4), b, a),
                      "linear_attention_backward: dout is [1, 1, 3, 4] but must be [1, 1, 3, 3] "
                      "(B, Hq, Lq, Dv)");
}

// --- layers ------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("Linear::backward matches torch autograd", "[gradients][isa]", float, double) {
  using T = TestType;
  const double rtol = gradient_tolerance<T>();
  for (const json& c : ATTN_FIXTURE_CASES("gradients.json", "linear", 3)) {
    SECTION(c.at("name").get<std::string>()) {
      const attn::Matrix<T> x = attn_test::matrix<T>(c.at("x")),
                            dy = attn_test::matrix<T>(c.at("dy"));
      const bool bias = !c.at("bias").is_null();
      const attn::Linear<T> layer =
          attn::Linear<T>::from_torch(attn_test::matrix<T>(c.at("weight")),
                                      bias ? vector_of<T>(c.at("bias")) : attn::Vector<T>());
      const auto g = layer.backward(x, dy);
      require_close(g.dx, c.at("dx"), rtol);
      require_close(g.dweight, c.at("weight_grad"), rtol);  // (out, in) like torch's
      if (bias)
        require_close(g.dbias, c.at("bias_grad"), rtol);
      else
        REQUIRE(g.dbias.size() == 0);

      // (B, S, in) tensors: the same rows.
      attn::Tensor<T, 3> xt(1, x.rows(), x.cols()), dyt(1, dy.rows(), dy.cols());
      std::copy(x.data(), x.data() + x.size(), xt.data());
      std::copy(dy.data(), dy.data() + dy.size(), dyt.data());
      const auto gt = layer.backward(xt, dyt);
      REQUIRE(gt.dx.dimension(0) == 1);
      require_close(gt.dx, c.at("dx"), rtol);
      require_close(gt.dweight, c.at("weight_grad"), rtol);

      // backward_into: no dx, then accumulated as torch's .grad over two calls.
      attn::Matrix<T> wg;
      attn::Vector<T> bg;
      const attn::ConstRowsMap<T> xr(x.data(), x.rows(), x.cols(), Eigen::OuterStride<>(x.cols()));
      const attn::ConstRowsMap<T> dyr(dy.data(), dy.rows(), dy.cols(),
                                      Eigen::OuterStride<>(dy.cols()));
      layer.backward_into(xr, dyr, nullptr, wg, bg);
      layer.backward_into(xr, dyr, nullptr, wg, bg, true);
      require_close(attn::Matrix<T>(wg / T(2)), c.at("weight_grad"), rtol);
      if (bias)
        require_close(attn::Vector<T>(bg / T(2)), c.at("bias_grad"), rtol);
    }
  }
}

namespace {

template <class T>
attn::QKVProjection<T> projection_of(const json& c) {
  const std::vector<Index> dims = c.at("dims").get<std::vector<Index>>();
  const bool bias = !c.at("in_proj_bias").is_null();
  const attn::Vector<T> b = bias ? vector_of<T>(c.at("in_proj_bias")) : attn::Vector<T>();
  if (c.at("fused").get<bool>()) {
    return attn::QKVProjection<T>::fused_from_torch(attn_test::matrix<T>(c.at("in_proj_weight")), b,
                                                    dims[0], dims[1], dims[2]);
  }
  const auto part = [&](Index first, Index n) {
    return bias ? attn::Vector<T>(b.segment(first, n)) : attn::Vector<T>();
  };
  return attn::QKVProjection<T>(
      attn::Linear<T>::from_torch(attn_test::matrix<T>(c.at("q_proj_weight")), part(0, dims[0])),
      attn::Linear<T>::from_torch(attn_test::matrix<T>(c.at("k_proj_weight")),
                                  part(dims[0], dims[1])),
      attn::Linear<T>::from_torch(attn_test::matrix<T>(c.at("v_proj_weight")),
                                  part(dims[0] + dims[1], dims[2])));
}

template <class T>
void require_parameter_gradients(const attn::QKVProjectionGradients<T>& g, const json& c,
                                 double rtol) {
  if (c.at("fused").get<bool>()) {
    require_close(g.din_proj_weight, c.at("in_proj_weight_grad"), rtol);
    REQUIRE(g.dq_proj_weight.size() == 0);
  } else {
    require_close(g.dq_proj_weight, c.at("q_proj_weight_grad"), rtol);
    require_close(g.dk_proj_weight, c.at("k_proj_weight_grad"), rtol);
    require_close(g.dv_proj_weight, c.at("v_proj_weight_grad"), rtol);
    REQUIRE(g.din_proj_weight.size() == 0);
  }
  if (c.at("in_proj_bias").is_null())
    REQUIRE(g.din_proj_bias.size() == 0);
  else
    require_close(g.din_proj_bias, c.at("in_proj_bias_grad"), rtol);
}

}  // namespace

TEMPLATE_TEST_CASE("QKVProjection::backward matches torch autograd", "[gradients][isa]", float,
                   double) {
  using T = TestType;
  const double rtol = gradient_tolerance<T>();
  for (const json& c : ATTN_FIXTURE_CASES("gradients.json", "qkv", 6)) {
    SECTION(c.at("name").get<std::string>()) {
      const attn::QKVProjection<T> p = projection_of<T>(c);
      const auto x_q = attn_test::tensor<T, 3>(c.at("x_q")),
                 x_k = attn_test::tensor<T, 3>(c.at("x_k")),
                 x_v = attn_test::tensor<T, 3>(c.at("x_v"));
      const auto dq = attn_test::tensor<T, 3>(c.at("dq")), dk = attn_test::tensor<T, 3>(c.at("dk")),
                 dv = attn_test::tensor<T, 3>(c.at("dv"));
      if (c.at("self").get<bool>()) {
        const auto g = p.backward(x_q, dq, dk, dv);
        require_close(g.dx, c.at("dx"), rtol);
        REQUIRE(g.dx_q.size() == 0);
        require_parameter_gradients(g, c, rtol);

        // dq, dk, dv as adjacent column blocks of one (N, Dq + Dk + Dv) buffer, one dx: the
        // one-GEMM path of a fused projection; the same numbers.
        const Index n = x_q.dimension(0) * x_q.dimension(1), dq_w = p.q_dim(), dk_w = p.k_dim(),
                    dv_w = p.v_dim(), total = dq_w + dk_w + dv_w;
        attn::Matrix<T> buffer(n, total);
        buffer.leftCols(dq_w) =
            attn::ConstRowsMap<T>(dq.data(), n, dq_w, Eigen::OuterStride<>(dq_w));
        buffer.middleCols(dq_w, dk_w) =
            attn::ConstRowsMap<T>(dk.data(), n, dk_w, Eigen::OuterStride<>(dk_w));
        buffer.rightCols(dv_w) =
            attn::ConstRowsMap<T>(dv.data(), n, dv_w, Eigen::OuterStride<>(dv_w));
        const auto block = [&](Index first, Index width) {
          return attn::ConstRowsMap<T>(buffer.data() + first, n, width,
                                       Eigen::OuterStride<>(total));
        };
        attn::Tensor<T, 3> dx(x_q.dimension(0), x_q.dimension(1), x_q.dimension(2));
        attn::RowsMap<T> dx_rows(dx.data(), n, dx.dimension(2),
                                 Eigen::OuterStride<>(dx.dimension(2)));
        const attn::ConstRowsMap<T> x_rows(x_q.data(), n, x_q.dimension(2),
                                           Eigen::OuterStride<>(x_q.dimension(2)));
        attn::QKVProjectionGradients<T> g2;
        p.backward_into(x_rows, x_rows, x_rows, block(0, dq_w), block(dq_w, dk_w),
                        block(dq_w + dk_w, dv_w), &dx_rows, &dx_rows, &dx_rows, g2);
        require_close(dx, c.at("dx"), rtol);
        require_parameter_gradients(g2, c, rtol);
        // Accumulated: twice the gradients.
        p.backward_into(x_rows, x_rows, x_rows, block(0, dq_w), block(dq_w, dk_w),
                        block(dq_w + dk_w, dv_w), nullptr, nullptr, nullptr, g2, true);
        const attn::Matrix<T> twice =
            c.at("fused").get<bool>() ? g2.din_proj_weight : g2.dq_proj_weight;
        require_close(
            attn::Matrix<T>(twice / T(2)),
            c.at(c.at("fused").get<bool>() ? "in_proj_weight_grad" : "q_proj_weight_grad"), rtol);
      } else {
        const auto g = p.backward(x_q, x_k, x_v, dq, dk, dv);
        require_close(g.dx_q, c.at("dx_q"), rtol);
        require_close(g.dx_k, c.at("dx_k"), rtol);
        require_close(g.dx_v, c.at("dx_v"), rtol);
        REQUIRE(g.dx.size() == 0);
        require_parameter_gradients(g, c, rtol);
      }
    }
  }
}

TEST_CASE("QKVProjection gradients carry MultiHeadAttention's state_dict names and shapes",
          "[gradients]") {
  // The gradient of each parameter has the shape state_dict() gives it, under the same name.
  for (const bool same_embed : {true, false}) {
    attn::MultiHeadAttentionConfig config;
    config.embed_dim = 8;
    config.num_heads = 4;
    config.num_kv_heads = 2;
    config.kdim = same_embed ? 8 : 5;
    config.vdim = same_embed ? 8 : 3;
    const attn::MultiHeadAttention<double> mha(config);
    const attn::StateDict<double> state = mha.state_dict();
    const attn::QKVProjection<double>& p = mha.in_proj();
    attn::Tensor<double, 3> x_q(2, 3, 8), x_k(2, 4, config.kdim), x_v(2, 4, config.vdim);
    attn::Tensor<double, 3> dq(2, 3, p.q_dim()), dk(2, 4, p.k_dim()), dv(2, 4, p.v_dim());
    for (attn::Tensor<double, 3>* t : {&x_q, &x_k, &x_v, &dq, &dk, &dv})
      t->setRandom();
    const auto g = p.backward(x_q, x_k, x_v, dq, dk, dv);
    const auto shape = [&](const std::string& name) { return state.at(name).shape; };
    const auto matrix_shape = [](const attn::Matrix<double>& m) {
      return std::vector<Index>{m.rows(), m.cols()};
    };
    if (same_embed) {
      REQUIRE(matrix_shape(g.din_proj_weight) == shape("in_proj_weight"));
      REQUIRE(state.count("q_proj_weight") == 0);
    } else {
      REQUIRE(matrix_shape(g.dq_proj_weight) == shape("q_proj_weight"));
      REQUIRE(matrix_shape(g.dk_proj_weight) == shape("k_proj_weight"));
      REQUIRE(matrix_shape(g.dv_proj_weight) == shape("v_proj_weight"));
      REQUIRE(state.count("in_proj_weight") == 0);
    }
    REQUIRE(std::vector<Index>{g.din_proj_bias.size()} == shape("in_proj_bias"));
    // out_proj is a Linear: its weight gradient has out_proj.weight's shape.
    attn::Matrix<double> a = attn::Matrix<double>::Random(6, 8),
                         d = attn::Matrix<double>::Random(6, 8);
    const auto go = mha.out_proj().backward(a, d);
    REQUIRE(matrix_shape(go.dweight) == shape("out_proj.weight"));
    REQUIRE(std::vector<Index>{go.dbias.size()} == shape("out_proj.bias"));
  }
}

TEST_CASE("Linear::backward in 16-bit storage computes in float, rounds once", "[gradients]") {
  const attn::Matrix<float> x = attn::Matrix<float>::Random(9, 6),
                            dy = attn::Matrix<float>::Random(9, 4),
                            w = attn::Matrix<float>::Random(6, 4);
  const attn::Matrix<Eigen::half> xh = x.cast<Eigen::half>(), dyh = dy.cast<Eigen::half>();
  const attn::Linear<Eigen::half> layer(attn::Matrix<Eigen::half>(w.cast<Eigen::half>()),
                                        attn::Vector<Eigen::half>::Zero(4));
  const auto g = layer.backward(xh, dyh);
  // The reference: the same half inputs, widened, in double.
  const Eigen::MatrixXd xd = xh.cast<double>(), dyd = dyh.cast<double>(),
                        wd = layer.weight().cast<double>();
  const Eigen::MatrixXd dx = dyd * wd.transpose(), dw = dyd.transpose() * xd;
  const Eigen::VectorXd db = dyd.colwise().sum().transpose();
  // One rounding to half: relative 2^-11 of the value (plus float's accumulation).
  CHECK(((g.dx.cast<double>() - dx).array().abs() <= 1e-3 * (dx.array().abs() + 1e-2)).all());
  CHECK(((g.dweight.cast<double>() - dw).array().abs() <= 1e-3 * (dw.array().abs() + 1e-2)).all());
  CHECK(((g.dbias.cast<double>() - db).array().abs() <= 1e-3 * (db.array().abs() + 1e-2)).all());
}

TEST_CASE("the layer backwards validate their inputs", "[gradients][errors]") {
  const attn::Linear<float> layer(4, 3, true, 1);
  const attn::Matrix<float> x = attn::Matrix<float>::Ones(5, 4),
                            dy = attn::Matrix<float>::Ones(5, 3);
  REQUIRE_NOTHROW(layer.backward(x, dy));
  REQUIRE_THROWS_WITH(layer.backward(x, attn::Matrix<float>::Ones(5, 2)),
                      "Linear::backward: x is [5, 4] and dy is [5, 2] but the weight (in, out) is "
                      "[4, 3]: need x (N, in) and dy (N, out)");
  REQUIRE_THROWS_WITH(layer.backward(attn::Matrix<float>::Ones(5, 3), dy),
                      "Linear::backward: x is [5, 3] and dy is [5, 3] but the weight (in, out) is "
                      "[4, 3]: need x (N, in) and dy (N, out)");
  REQUIRE_THROWS_WITH(layer.backward(x, attn::Matrix<float>::Ones(4, 3)),
                      "Linear::backward: x is [5, 4] and dy is [4, 3] but the weight (in, out) is "
                      "[4, 3]: need x (N, in) and dy (N, out)");
  REQUIRE_THROWS_WITH(attn::Linear<float>().backward(x, dy),
                      "Linear::backward: the layer is empty (default-constructed)");
  attn::Tensor<float, 3> xt(2, 3, 4), dyt(2, 2, 3);
  REQUIRE_THROWS_WITH(layer.backward(xt, dyt),
                      "Linear::backward: x is [2, 3, 4] and dy is [2, 2, 3] but the weight (in, "
                      "out) is [4, 3]: need x (B, S, in) and dy (B, S, out)");
  const attn::ConstRowsMap<float> xr(x.data(), 5, 4, Eigen::OuterStride<>(4));
  const attn::ConstRowsMap<float> dyr(dy.data(), 5, 3, Eigen::OuterStride<>(3));
  attn::Matrix<float> wg(4, 3), dx(5, 3);  // wg transposed: (in, out) instead of (out, in)
  attn::Vector<float> bg(3);
  REQUIRE_THROWS_WITH(layer.backward_into(xr, dyr, nullptr, wg, bg, true),
                      "Linear::backward_into: weight_grad is [4, 3] but accumulating into it "
                      "needs [3, 4]");
  wg.resize(3, 4);
  bg.resize(2);
  REQUIRE_THROWS_WITH(layer.backward_into(xr, dyr, nullptr, wg, bg, true),
                      "Linear::backward_into: bias_grad is [2, 1] but accumulating into it needs "
                      "[3, 1]");
  attn::RowsMap<float> dx_map(dx.data(), 5, 3, Eigen::OuterStride<>(3));
  REQUIRE_THROWS_WITH(layer.backward_into(xr, dyr, &dx_map, wg, bg),
                      "Linear::backward_into: dx is [5, 3] but x is [5, 4]");

  const auto p = attn::QKVProjection<float>::make(6, 4, 2, 2, true, 3);
  const auto t3 = [](Index b, Index s, Index e) {
    attn::Tensor<float, 3> t(b, s, e);
    t.setConstant(0.25f);
    return t;
  };
  const auto x6 = t3(2, 5, 6);
  REQUIRE_NOTHROW(p.backward(x6, t3(2, 5, 4), t3(2, 5, 2), t3(2, 5, 2)));
  REQUIRE_THROWS_WITH(attn::QKVProjection<float>().backward(x6, x6, x6, x6),
                      "QKVProjection::backward: the projection is empty");
  REQUIRE_THROWS_WITH(p.backward(x6, t3(2, 5, 4), t3(2, 5, 3), t3(2, 5, 2)),
                      "QKVProjection::backward: x_q is [2, 5, 6], x_k is [2, 5, 6], x_v is [2, 5, "
                      "6], dq is [2, 5, 4], dk is [2, 5, 3], dv is [2, 5, 2]: dq, dk and dv must "
                      "be (B, Lq, Dq), (B, Lk, Dk), (B, Lk, Dv) with (Dq, Dk, Dv) = [4, 2, 2]");
  REQUIRE_THROWS_WITH(p.backward(t3(2, 5, 5), t3(2, 5, 4), t3(2, 5, 2), t3(2, 5, 2)),
                      "QKVProjection::backward: x_q is [2, 5, 5], x_k is [2, 5, 5], x_v is [2, 5, "
                      "5], dq is [2, 5, 4], dk is [2, 5, 2], dv is [2, 5, 2]: the input widths "
                      "(q, k, v) are [6, 6, 6]");
  REQUIRE_THROWS_WITH(p.backward(x6, t3(1, 4, 6), x6, t3(2, 5, 4), t3(1, 4, 2), t3(2, 5, 2)),
                      "QKVProjection::backward: x_q is [2, 5, 6], x_k is [1, 4, 6], x_v is [2, 5, "
                      "6], dq is [2, 5, 4], dk is [1, 4, 2], dv is [2, 5, 2]: batch sizes differ");
  REQUIRE_THROWS_WITH(p.backward(x6, t3(2, 4, 6), x6, t3(2, 5, 4), t3(2, 4, 2), t3(2, 5, 2)),
                      "QKVProjection::backward: x_q is [2, 5, 6], x_k is [2, 4, 6], x_v is [2, 5, "
                      "6], dq is [2, 5, 4], dk is [2, 4, 2], dv is [2, 5, 2]: key and value "
                      "lengths differ");
  // The row form.
  const attn::Matrix<float> rows6 = attn::Matrix<float>::Ones(10, 6),
                            rows4 = attn::Matrix<float>::Ones(10, 4),
                            rows2 = attn::Matrix<float>::Ones(10, 2);
  const auto map = [](const attn::Matrix<float>& m) {
    return attn::ConstRowsMap<float>(m.data(), m.rows(), m.cols(), Eigen::OuterStride<>(m.cols()));
  };
  attn::QKVProjectionGradients<float> grads;
  REQUIRE_THROWS_WITH(p.backward_into(map(rows6), map(rows6), map(rows6), map(rows4), map(rows4),
                                      map(rows2), nullptr, nullptr, nullptr, grads),
                      "QKVProjection::backward: x_k is [10, 6] and dk is [10, 4] but must be [10, "
                      "6] and [10, 2] (the projection's input and output widths)");
  attn::Matrix<float> dx_storage(10, 5);
  attn::RowsMap<float> dx_bad(dx_storage.data(), 10, 5, Eigen::OuterStride<>(5));
  REQUIRE_THROWS_WITH(p.backward_into(map(rows6), map(rows6), map(rows6), map(rows4), map(rows2),
                                      map(rows2), nullptr, &dx_bad, nullptr, grads),
                      "QKVProjection::backward: dx_k is [10, 5] but its input is [10, 6]");
  grads.din_proj_weight.resize(2, 2);
  REQUIRE_THROWS_WITH(p.backward_into(map(rows6), map(rows6), map(rows6), map(rows4), map(rows2),
                                      map(rows2), nullptr, nullptr, nullptr, grads, true),
                      "QKVProjection::backward: in_proj_bias is [0, 1] but accumulating into it "
                      "needs [8, 1]");
}
