// Tests for attn/projection.hpp, attn/heads.hpp and attn/multihead.hpp: every
// torch.nn.MultiheadAttention fixture (tests/reference/mha.json, written by
// generate_mha.py), fused vs separate projections, split/merge heads, the QKV-projection tutorial's
// traps, grouped-query attention and every validation error, in float and double.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/heads.hpp>
#include <attn/multihead.hpp>
#include <attn/projection.hpp>

#include "support/fixtures.hpp"
#include "support/isa_cases.hpp"
#include "support/results.hpp"

using attn::Index;
using attn_test::json;

namespace {

/// MHA tolerances against torch (relative, absolute below 1), as docs/testing.md states them.
template <class T>
constexpr double mha_tolerance() {
  return std::is_same_v<T, float> ? 1e-5 : 1e-10;
}

template <class T>
attn::Tensor<T, 3> random_tensor(Index b, Index s, Index e, unsigned seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  attn::Tensor<T, 3> x(b, s, e);
  for (Index i = 0; i < x.size(); ++i)
    x.data()[i] = static_cast<T>(normal(engine));
  return x;
}

template <class T>
attn::Matrix<T> random_matrix(Index rows, Index cols, unsigned seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  attn::Matrix<T> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i)
    m.data()[i] = static_cast<T>(normal(engine));
  return m;
}

template <class T, int R>
std::vector<double> flat(const attn::Tensor<T, R>& t) {
  return {t.data(), t.data() + t.size()};
}

/// Largest |a - b| / max(|b|, 1) over two equally sized tensors.
template <class A, class B>
double max_error(const A& a, const B& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (Index i = 0; i < static_cast<Index>(a.size()); ++i) {
    const double x = static_cast<double>(a.data()[i]), y = static_cast<double>(b.data()[i]);
    worst = std::max(worst, std::abs(x - y) / std::max(std::abs(y), 1.0));
  }
  return worst;
}

/// One mha.json case in scalar type T.
template <class T>
struct MhaCase {
  std::string name;
  attn::MultiHeadAttentionConfig config;
  bool self = false;
  attn::Tensor<T, 3> query, key, value;
  attn::Tensor<bool, 2> kpm;
  attn::Tensor<bool, 2> mask2;
  attn::Tensor<bool, 3> mask3;
  attn::Tensor<T, 2> fmask2;
  attn::Tensor<T, 3> fmask3;
  attn::MultiHeadForwardOptions<T> options;
  attn::StateDict<T> state;
  std::vector<double> output, weights_avg, weights_heads;

  explicit MhaCase(const json& c) : name(c.at("name").get<std::string>()) {
    const json& cfg = c.at("config");
    config.embed_dim = cfg.at("embed_dim").get<Index>();
    config.num_heads = cfg.at("num_heads").get<Index>();
    config.kdim = cfg.at("kdim").get<Index>();
    config.vdim = cfg.at("vdim").get<Index>();
    config.bias = cfg.at("bias").get<bool>();
    config.add_bias_kv = cfg.at("add_bias_kv").get<bool>();
    config.add_zero_attn = cfg.at("add_zero_attn").get<bool>();
    self = c.at("self").get<bool>();
    query = attn_test::tensor<T, 3>(c.at("query"));
    if (!self) {
      key = attn_test::tensor<T, 3>(c.at("key"));
      value = attn_test::tensor<T, 3>(c.at("value"));
    }
    if (!c.at("key_padding_mask").is_null()) {
      kpm = attn_test::tensor<bool, 2>(c.at("key_padding_mask"));
      options.key_padding_mask = kpm;
    }
    const json& m = c.at("attn_mask");
    if (!m.is_null()) {
      const bool is_bool = m.contains("dtype");
      const std::size_t rank = attn_test::shape_of(m).size();
      if (is_bool && rank == 2) {
        mask2 = attn_test::tensor<bool, 2>(m);
        options.attn_mask = mask2;
      } else if (is_bool) {
        mask3 = attn_test::tensor<bool, 3>(m);
        options.attn_mask = mask3;
      } else if (rank == 2) {
        fmask2 = attn_test::tensor<T, 2>(m);
        options.float_attn_mask = fmask2;
      } else {
        fmask3 = attn_test::tensor<T, 3>(m);
        options.float_attn_mask = fmask3;
      }
    }
    options.is_causal = c.at("is_causal").get<bool>();
    for (const auto& [key_name, t] : c.at("state_dict").items()) {
      state[key_name] = {attn_test::shape_of(t), attn_test::values<T>(t)};
    }
    output = attn_test::values<double>(c.at("output"));
    weights_avg = attn_test::values<double>(c.at("weights_avg"));
    weights_heads = attn_test::values<double>(c.at("weights_heads"));
  }
  MhaCase(const MhaCase&) = delete;
  MhaCase& operator=(const MhaCase&) = delete;

  const attn::Tensor<T, 3>& k() const { return self ? query : key; }
  const attn::Tensor<T, 3>& v() const { return self ? query : value; }
};

}  // namespace

namespace {

template <class TestType>
void multiheadattention_matches_torch_nn_multiheadattention() {
  using T = TestType;
  const double rtol = mha_tolerance<T>();
  for (const json& c : ATTN_FIXTURE_CASES("mha.json", "cases", 21)) {
    const MhaCase<T> tc(c);
    SECTION(tc.name) {
      const auto mha = attn::MultiHeadAttention<T>::from_state_dict(tc.config, tc.state);

      // Output and head-averaged weights (torch's defaults).
      auto options = tc.options;
      options.need_weights = true;
      const auto avg = mha.forward(tc.query, tc.k(), tc.v(), options);
      ATTN_REQUIRE_CLOSE(avg.output.data(), avg.output.size(), tc.output, rtol);
      REQUIRE(avg.averaged_weights.dimension(0) == tc.query.dimension(0));
      REQUIRE(avg.averaged_weights.dimension(1) == tc.query.dimension(1));
      REQUIRE(avg.weights.size() == 0);
      ATTN_REQUIRE_CLOSE(avg.averaged_weights.data(), avg.averaged_weights.size(), tc.weights_avg,
                         rtol);

      // Per-head weights; the output does not depend on it.
      options.average_attn_weights = false;
      const auto per_head = mha.forward(tc.query, tc.k(), tc.v(), options);
      ATTN_REQUIRE_CLOSE(per_head.weights.data(), per_head.weights.size(), tc.weights_heads, rtol);
      REQUIRE(flat(per_head.output) == flat(avg.output));

      // Without weights: same output, no weights.
      options.need_weights = false;
      const auto plain = mha.forward(tc.query, tc.k(), tc.v(), options);
      REQUIRE(plain.weights.size() == 0);
      REQUIRE(plain.averaged_weights.size() == 0);
      ATTN_REQUIRE_CLOSE(plain.output.data(), plain.output.size(), tc.output, rtol);

      // Self-attention cases: distinct copies of the input take the unfused path.
      if (tc.self) {
        const attn::Tensor<T, 3> k_copy = tc.query, v_copy = tc.query;
        const auto unfused = mha.forward(tc.query, k_copy, v_copy, options);
        ATTN_REQUIRE_CLOSE(unfused.output.data(), unfused.output.size(), tc.output, rtol);
      }

      // is_causal equals torch's explicit triu mask (true = not allowed).
      if (tc.options.is_causal) {
        const Index L = tc.query.dimension(1), S = tc.k().dimension(1);
        attn::Tensor<bool, 2> triu(L, S);
        for (Index i = 0; i < L; ++i) {
          for (Index j = 0; j < S; ++j)
            triu(i, j) = j > i;
        }
        auto explicit_mask = options;
        explicit_mask.is_causal = false;
        explicit_mask.attn_mask = triu;
        const auto masked = mha.forward(tc.query, tc.k(), tc.v(), explicit_mask);
        ATTN_REQUIRE_CLOSE(masked.output.data(), masked.output.size(), tc.output, rtol);
      }

      // The weights round-trip through state_dict() exactly.
      const attn::StateDict<T> exported = mha.state_dict();
      REQUIRE(exported.size() == tc.state.size());
      for (const auto& [key_name, t] : tc.state) {
        INFO(key_name);
        REQUIRE(exported.count(key_name) == 1);
        REQUIRE(exported.at(key_name).shape == t.shape);
        REQUIRE(exported.at(key_name).data == t.data);
      }
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("MultiHeadAttention matches torch.nn.MultiheadAttention",
                                    "[multihead]",
                                    multiheadattention_matches_torch_nn_multiheadattention)

namespace {

template <class TestType>
void fused_and_separate_qkv_projections_agree() {
  using T = TestType;
  const Index E = 48, B = 3, S = 11;
  const auto fused = attn::QKVProjection<T>::make(E, E, E, E, /*bias=*/true, /*seed=*/7);
  REQUIRE(fused.is_fused());
  const attn::QKVProjection<T> separate = fused.separated();
  REQUIRE_FALSE(separate.is_fused());
  const attn::Tensor<T, 3> x = random_tensor<T>(B, S, E, 1);

  const attn::QKV<T> a = fused(x);  // one GEMM
  const attn::QKV<T> b = separate(x);
  REQUIRE(a.is_fused());
  REQUIRE_FALSE(b.is_fused());
  // q, k and v of the fused result are column blocks of one buffer: zero-copy views.
  REQUIRE(a.k().data() == a.q().data() + E);
  REQUIRE(a.v().data() == a.q().data() + 2 * E);
  REQUIRE(a.q().outerStride() == 3 * E);
  REQUIRE(a.v().outerStride() == 3 * E);
  // The separate result's blocks are contiguous, one after another.
  REQUIRE(b.q().outerStride() == E);
  REQUIRE(b.k().data() == b.q().data() + B * S * E);
  REQUIRE(b.v().data() == b.k().data() + B * S * E);
  CHECK(max_error(attn::Matrix<T>(a.q()), attn::Matrix<T>(b.q())) <= 1e-6);
  CHECK(max_error(attn::Matrix<T>(a.k()), attn::Matrix<T>(b.k())) <= 1e-6);
  CHECK(max_error(attn::Matrix<T>(a.v()), attn::Matrix<T>(b.v())) <= 1e-6);

  // Round trip separate -> fused gives the same weights, and each block is x * W.
  const attn::QKVProjection<T> refused = separate.fused_form();
  REQUIRE(attn::Matrix<T>(refused.fused_weight()) == attn::Matrix<T>(fused.fused_weight()));
  const attn::Matrix<T> xr = attn::ConstRowsMap<T>(x.data(), B * S, E, Eigen::OuterStride<>(E));
  CHECK(max_error(attn::Matrix<T>(a.k()), attn::Matrix<T>(xr * attn::Matrix<T>(fused.wk()))) <=
        1e-6);

  // Head views of the fused buffer read the same numbers as split_heads of q.
  const attn::HeadsView<const T> qh = a.q_heads(4);
  attn::Tensor<T, 3> q3(B, S, E);
  attn::RowsMap<T>(q3.data(), B * S, E, Eigen::OuterStride<>(E)) = a.q();
  const attn::Tensor<T, 4> split = attn::split_heads(q3, 4);
  for (Index bb = 0; bb < B; ++bb) {
    for (Index h = 0; h < 4; ++h) {
      for (Index s = 0; s < S; ++s) {
        for (Index d = 0; d < E / 4; ++d)
          REQUIRE(qh.head(bb, h)(s, d) == split(bb, h, s, d));
      }
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("fused and separate QKV projections agree", "[projection]",
                                    fused_and_separate_qkv_projections_agree)

namespace {

template <class TestType>
void qkvprojection_with_different_widths_cross_attention() {
  using T = TestType;
  // Dk = 8 differs from Dv = 12 and from the input widths 20 / 24 / 28.
  const auto p = attn::QKVProjection<T>::make(20, 8, 8, 12, true, 3, 24, 28);
  REQUIRE_FALSE(p.is_fused());
  const attn::Tensor<T, 3> xq = random_tensor<T>(2, 5, 20, 1), xk = random_tensor<T>(2, 7, 24, 2),
                           xv = random_tensor<T>(2, 7, 28, 3);
  const attn::QKV<T> r = p(xq, xk, xv);
  REQUIRE(r.q().rows() == 10);
  REQUIRE(r.q().cols() == 8);
  REQUIRE(r.k().rows() == 14);
  REQUIRE(r.v().cols() == 12);
  REQUIRE(r.v_heads(3).dim == 4);
  REQUIRE_THROWS_WITH(p(xq),
                      Catch::Contains("QKVProjection") &&
                          Catch::Contains("but the input widths (q, k, v) are [20, 24, 28]"));
  REQUIRE_THROWS_WITH(p.fused_form(),
                      "QKVProjection::fused_form: input widths (q, k, v) are "
                      "[20, 24, 28]: fusing needs one input width");
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("QKVProjection with different widths (cross-attention)",
                                    "[projection]",
                                    qkvprojection_with_different_widths_cross_attention)

namespace {

template <class TestType>
void linear_on_a_matrix_and_on_a() {
  using T = TestType;
  const attn::Matrix<T> w = random_matrix<T>(6, 5, 4);
  attn::Vector<T> b(5);
  b << 1, 2, 3, 4, 5;
  const attn::Linear<T> lin(w, b);
  const attn::Tensor<T, 3> x = random_tensor<T>(2, 3, 6, 5);
  const attn::Tensor<T, 3> y = lin(x);
  const attn::Matrix<T> xr = attn::ConstRowsMap<T>(x.data(), 6, 6, Eigen::OuterStride<>(6));
  const attn::Matrix<T> expected = (xr * w).rowwise() + b.transpose();
  CHECK(max_error(attn::ConstRowsMap<T>(y.data(), 6, 5, Eigen::OuterStride<>(5)), expected) <=
        1e-6);
  CHECK(max_error(lin(xr), expected) <= 1e-6);
  // A column-major or expression input works too.
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> col_major = xr;
  CHECK(max_error(lin(col_major), expected) <= 1e-6);

  // Default initialisation: xavier_uniform bound, zero bias, reproducible from the seed.
  const attn::Linear<T> fresh(64, 32, true, 9), again(64, 32, true, 9);
  REQUIRE(fresh.weight() == again.weight());
  REQUIRE(fresh.bias().isZero());
  CHECK(fresh.weight().cwiseAbs().maxCoeff() <= static_cast<T>(std::sqrt(6.0 / 96.0)));
  const attn::Linear<T> no_bias(4, 3, false);
  REQUIRE_FALSE(no_bias.has_bias());
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("Linear on a matrix and on a (B, S, in) batch", "[projection]",
                                    linear_on_a_matrix_and_on_a)

TEMPLATE_TEST_CASE(
    "the QKV-projection tutorial's einsum trap: X @ W.T is not X @ W; from_torch transposes",
    "[projection]", float, double) {
  using T = TestType;
  const attn::Matrix<T> x = random_matrix<T>(4, 8, 11);
  const attn::Matrix<T> w = random_matrix<T>(8, 8, 12);  // square, not symmetric
  REQUIRE((w - w.transpose()).cwiseAbs().maxCoeff() > T(0.1));
  // einsum('bsd,hd->bsh', X, W) contracts d with W's second index: X @ W.T.
  attn::Matrix<T> einsum(4, 8);
  for (Index s = 0; s < 4; ++s) {
    for (Index h = 0; h < 8; ++h) {
      T acc = 0;
      for (Index d = 0; d < 8; ++d)
        acc += x(s, d) * w(h, d);
      einsum(s, h) = acc;
    }
  }
  const attn::Matrix<T> x_wt = x * w.transpose();
  const attn::Matrix<T> x_w = x * w;
  CHECK(max_error(einsum, x_wt) <= 1e-5);
  CHECK(max_error(einsum, x_w) > 0.1);  // the tutorial's "equivalent" is not

  // A PyTorch weight (out x in) is meant as X @ W.T: from_torch does exactly that.
  const attn::Matrix<T> w_torch = random_matrix<T>(5, 8, 13);  // (out, in)
  const attn::Linear<T> lin = attn::Linear<T>::from_torch(w_torch);
  REQUIRE(lin.in_features() == 8);
  REQUIRE(lin.out_features() == 5);
  CHECK(max_error(lin(x), attn::Matrix<T>(x * w_torch.transpose())) <= 1e-6);
  REQUIRE(lin.torch_weight() == w_torch);
}

TEMPLATE_TEST_CASE("split_heads then merge_heads is the identity; views match", "[heads]", float,
                   double) {
  using T = TestType;
  for (const auto& [heads, dim] : std::vector<std::pair<Index, Index>>{{1, 5}, {3, 4}, {12, 64}}) {
    const attn::Tensor<T, 3> x = random_tensor<T>(2, 7, heads * dim, 21);
    const attn::Tensor<T, 4> split = attn::split_heads(x, heads);  // (B, H, S, D)
    REQUIRE(split.dimension(1) == heads);
    REQUIRE(split.dimension(2) == 7);
    const attn::Tensor<T, 3> merged = attn::merge_heads(split);
    REQUIRE(flat(merged) == flat(x));                                  // bitwise
    const attn::HeadsView<const T> view = attn::heads_view(x, heads);  // zero copy
    REQUIRE(view.data == x.data());
    for (Index b = 0; b < 2; ++b) {
      for (Index h = 0; h < heads; ++h) {
        for (Index s = 0; s < 7; ++s) {
          for (Index d = 0; d < dim; ++d) {
            REQUIRE(view.head(b, h)(s, d) == split(b, h, s, d));
            REQUIRE(split(b, h, s, d) == x(b, s, h * dim + d));
          }
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE(
    "the QKV-projection tutorial's mistake two: reshape straight to (B, H, S, D) is wrong",
    "[heads]", float, double) {
  using T = TestType;
  // The tutorial's shapes: batch 2, seq 10, hidden 768, 12 heads of 64.
  const Index B = 2, S = 10, H = 12, D = 64;
  const attn::Tensor<T, 3> q = random_tensor<T>(B, S, H * D, 31);
  const attn::Tensor<T, 4> right = attn::split_heads(q, H);  // reshape (B,S,H,D) + transpose
  const std::array<Index, 4> bhsd{B, H, S, D};
  const attn::Tensor<T, 4> wrong = q.reshape(bhsd);  // the mistake: same shape...
  REQUIRE(wrong.dimensions() == right.dimensions());
  REQUIRE(flat(wrong) != flat(right));  // ...different numbers
  // Head 1 of the wrong tensor is not feature block 1 of each token.
  CHECK(wrong(0, 1, 0, 0) != q(0, 0, D));
  CHECK(right(0, 1, 0, 0) == q(0, 0, D));
  // And attention on the wrong heads gives a different result.
  const attn::Tensor<T, 4> out_right = attn::scaled_dot_product_attention(right, right, right);
  const attn::Tensor<T, 4> out_wrong = attn::scaled_dot_product_attention(wrong, wrong, wrong);
  CHECK(max_error(attn::merge_heads(out_right), attn::merge_heads(out_wrong)) > 1e-2);
}

TEMPLATE_TEST_CASE("GQA with num_kv_heads = num_heads is plain MHA", "[multihead][gqa]", float,
                   double) {
  using T = TestType;
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 32;
  config.num_heads = 4;
  config.seed = 5;
  const attn::MultiHeadAttention<T> plain(config);
  config.num_kv_heads = 4;
  const auto gqa = attn::MultiHeadAttention<T>::from_state_dict(config, plain.state_dict());
  const attn::Tensor<T, 3> x = random_tensor<T>(2, 9, 32, 41);
  attn::MultiHeadForwardOptions<T> options;
  options.need_weights = true;
  options.average_attn_weights = false;
  const auto a = plain.forward(x, options);
  const auto b = gqa.forward(x, options);
  REQUIRE(flat(a.output) == flat(b.output));
  REQUIRE(flat(a.weights) == flat(b.weights));
}

TEMPLATE_TEST_CASE("GQA equals attention on explicitly repeated kv heads", "[multihead][gqa]",
                   float, double) {
  using T = TestType;
  const double rtol = mha_tolerance<T>();
  for (const Index kv_heads : {Index(1), Index(2), Index(3)}) {
    attn::MultiHeadAttentionConfig config;
    config.embed_dim = 48;
    config.num_heads = 6;
    config.num_kv_heads = kv_heads;
    config.seed = static_cast<std::uint64_t>(kv_heads);
    const attn::MultiHeadAttention<T> mha(config);
    REQUIRE(mha.kv_width() == kv_heads * 8);
    const Index B = 2, L = 5, S = 7;
    const attn::Tensor<T, 3> q_in = random_tensor<T>(B, L, 48, 51);
    const attn::Tensor<T, 3> kv_in = random_tensor<T>(B, S, 48, 52);
    attn::MultiHeadForwardOptions<T> options;
    options.need_weights = true;
    options.average_attn_weights = false;
    const auto got = mha.forward(q_in, kv_in, kv_in, options);

    // Reference: project, split heads, repeat each kv head, SDPA, merge, out-project.
    const attn::QKV<T> p = mha.in_proj().separated()(q_in, kv_in, kv_in);
    const auto to3 = [&](const attn::ConstRowsMap<T>& m, Index len) {
      attn::Tensor<T, 3> t(B, len, m.cols());
      attn::RowsMap<T>(t.data(), B * len, m.cols(), Eigen::OuterStride<>(m.cols())) = m;
      return t;
    };
    const attn::Tensor<T, 4> q = attn::split_heads(to3(p.q(), L), 6);
    const Index group = 6 / kv_heads;
    const attn::Tensor<T, 4> k =
        attn::repeat_kv_heads(attn::split_heads(to3(p.k(), S), kv_heads), group);
    const attn::Tensor<T, 4> v =
        attn::repeat_kv_heads(attn::split_heads(to3(p.v(), S), kv_heads), group);
    REQUIRE(k.dimension(1) == 6);
    for (Index h = 0; h < 6; ++h)
      REQUIRE(attn::kv_head_for(h, 6, kv_heads) == h / group);
    attn::Tensor<T, 4> weights;
    const attn::Tensor<T, 4> heads = attn_test::out_of(
        attn::scaled_dot_product_attention(q, k, v, {}, attn::Return::weights), &weights, nullptr);
    const attn::Tensor<T, 3> merged = attn::merge_heads(heads);
    const attn::Tensor<T, 3> expected = mha.out_proj()(merged);
    CHECK(max_error(got.output, expected) <= rtol);
    CHECK(max_error(got.weights, weights) <= rtol);
  }
}

TEMPLATE_TEST_CASE("MultiHeadAttention: key_padding_mask polarity and fully masked rows",
                   "[multihead]", float, double) {
  using T = TestType;
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 16;
  config.num_heads = 2;
  const attn::MultiHeadAttention<T> mha(config);
  const attn::Tensor<T, 3> x = random_tensor<T>(1, 4, 16, 61);
  attn::Tensor<bool, 2> kpm(1, 4);
  kpm.setValues({{false, false, true, true}});  // true = IGNORE keys 2 and 3
  attn::MultiHeadForwardOptions<T> options;
  options.key_padding_mask = kpm;
  options.need_weights = true;
  const auto r = mha.forward(x, options);
  for (Index i = 0; i < 4; ++i) {
    CHECK(r.averaged_weights(0, i, 2) == T(0));  // ignored keys get exactly zero weight
    CHECK(r.averaged_weights(0, i, 3) == T(0));
    CHECK(std::abs(r.averaged_weights(0, i, 0) + r.averaged_weights(0, i, 1) - T(1)) < T(1e-5));
  }
  // Every key ignored: the library's rule is zero attention, so the output is out_proj's
  // bias (zero here), where torch returns NaN.
  kpm.setConstant(true);
  const auto all = mha.forward(x, options);
  for (Index i = 0; i < all.output.size(); ++i)
    REQUIRE(all.output.data()[i] == T(0));
}

TEMPLATE_TEST_CASE("projection, heads and multihead reject bad input by message", "[errors]", float,
                   double) {
  using T = TestType;
  using attn::MultiHeadAttention;
  using Catch::Contains;
  attn::MultiHeadAttentionConfig c;
  c.embed_dim = 30;
  c.num_heads = 4;
  REQUIRE_THROWS_AS(MultiHeadAttention<T>(c), std::invalid_argument);
  REQUIRE_THROWS_WITH(MultiHeadAttention<T>(c),
                      "MultiHeadAttention: embed_dim 30 is not divisible by num_heads 4");
  c.embed_dim = 0;
  REQUIRE_THROWS_WITH(MultiHeadAttention<T>(c), "MultiHeadAttention: embed_dim 0 must be positive");
  c.embed_dim = 32;
  c.num_heads = 0;
  REQUIRE_THROWS_WITH(MultiHeadAttention<T>(c), "MultiHeadAttention: num_heads 0 must be positive");
  c.num_heads = 4;
  c.num_kv_heads = 3;
  REQUIRE_THROWS_WITH(MultiHeadAttention<T>(c),
                      "MultiHeadAttention: num_heads 4 is not a multiple of num_kv_heads 3");
  c.num_kv_heads = 0;
  c.kdim = -2;
  REQUIRE_THROWS_WITH(MultiHeadAttention<T>(c),
                      "MultiHeadAttention: kdim -2 and vdim 32 must be positive");
  c.kdim = 24;
  c.vdim = 20;
  const MultiHeadAttention<T> mha(c);

  const attn::Tensor<T, 3> q = random_tensor<T>(2, 5, 32, 1), k = random_tensor<T>(2, 7, 24, 2),
                           v = random_tensor<T>(2, 7, 20, 3);
  const attn::Tensor<T, 3> k3 = random_tensor<T>(3, 7, 24, 2), v6 = random_tensor<T>(2, 6, 20, 3),
                           k_wide = random_tensor<T>(2, 7, 25, 2);
  REQUIRE_THROWS_WITH(mha.forward(q, k3, v),
                      "MultiHeadAttention::forward: query is [2, 5, 32], key is [3, 7, 24], "
                      "value is [2, 7, 20]: batch sizes differ");
  REQUIRE_THROWS_WITH(mha.forward(q, k, v6),
                      "MultiHeadAttention::forward: query is [2, 5, 32], key is [2, 7, 24], "
                      "value is [2, 6, 20]: key and value lengths differ");
  REQUIRE_THROWS_WITH(mha.forward(q, k_wide, v),
                      "MultiHeadAttention::forward: query is [2, 5, 32], key is [2, 7, 25], "
                      "value is [2, 7, 20] but (embed_dim, kdim, vdim) is [32, 24, 20]: widths "
                      "differ");
  REQUIRE_THROWS_WITH(mha.forward(q), Contains("widths differ"));  // kdim 24 != 32

  attn::MultiHeadForwardOptions<T> o;
  attn::Tensor<bool, 2> kpm(2, 5);
  o.key_padding_mask = kpm;
  REQUIRE_THROWS_WITH(mha.forward(q, k, v, o),
                      Contains("MultiHeadAttention::forward: key_padding_mask is [2, 5] but must "
                               "be [2, 7] (B, S)"));
  o = {};
  attn::Tensor<bool, 2> m2(7, 5);
  o.attn_mask = m2;
  REQUIRE_THROWS_WITH(mha.forward(q, k, v, o),
                      Contains("MultiHeadAttention::forward: attn_mask is [7, 5] but must be "
                               "[5, 7] (L, S) or [8, 5, 7] (B*H, L, S)"));
  o = {};
  attn::Tensor<T, 3> f3(4, 5, 7);
  o.float_attn_mask = f3;
  REQUIRE_THROWS_WITH(mha.forward(q, k, v, o),
                      Contains("MultiHeadAttention::forward: float_attn_mask is [4, 5, 7] but "
                               "must be [5, 7] (L, S) or [8, 5, 7] (B*H, L, S)"));

  // State dict: missing, unexpected and misshapen entries.
  attn::StateDict<T> sd = mha.state_dict();
  sd.erase("k_proj_weight");
  REQUIRE_THROWS_WITH(attn::MultiHeadAttention<T>::from_state_dict(c, sd),
                      "MultiHeadAttention::load_state_dict: missing \"k_proj_weight\"");
  sd = mha.state_dict();
  sd["in_proj_weight"] = {{96, 32}, std::vector<T>(96 * 32)};
  REQUIRE_THROWS_WITH(attn::MultiHeadAttention<T>::from_state_dict(c, sd),
                      "MultiHeadAttention::load_state_dict: unexpected \"in_proj_weight\"");
  sd = mha.state_dict();
  sd["out_proj.weight"] = {{32, 31}, std::vector<T>(32 * 31)};
  REQUIRE_THROWS_WITH(attn::MultiHeadAttention<T>::from_state_dict(c, sd),
                      Contains("MultiHeadAttention::load_state_dict: \"out_proj.weight\" is "
                               "[32, 31] but must be [32, 32] (embed_dim 32, num_heads 4"));

  // Projection and heads.
  REQUIRE_THROWS_WITH(attn::Linear<T>(0, 3),
                      "Linear: shape (in, out) is [0, 3]: both must be positive");
  attn::Vector<T> b4(4);
  REQUIRE_THROWS_WITH(attn::Linear<T>(attn::Matrix<T>(3, 5), b4),
                      "Linear: weight (in, out) is [3, 5] but bias is [4]: the bias needs one "
                      "entry per output");
  REQUIRE_THROWS_WITH(attn::Linear<T>::from_torch(attn::Matrix<T>(5, 3), b4),
                      "Linear::from_torch: weight (out, in) is [5, 3] but bias is [4]: the bias "
                      "needs one entry per output (weight rows)");
  const attn::Linear<T> lin(attn::Matrix<T>(3, 5));
  REQUIRE_THROWS_WITH(lin(attn::Matrix<T>(2, 4)),
                      "Linear: x is [2, 4] but the weight (in, out) is [3, 5]: x needs one column "
                      "per input feature");
  REQUIRE_THROWS_WITH(lin(attn::Tensor<T, 3>(2, 2, 4)),
                      "Linear: x is [2, 2, 4] but the weight (in, out) is [3, 5]: the last "
                      "dimension must equal in");
  REQUIRE_THROWS_WITH(
      attn::QKVProjection<T>::fused(attn::Matrix<T>(8, 20), attn::Vector<T>(), 8, 8, 8),
      "QKVProjection::fused: weight (E, Dq + Dk + Dv) is [8, 20] but (Dq, Dk, Dv) "
      "is [8, 8, 8]: need positive widths and Dq + Dk + Dv columns");
  REQUIRE_THROWS_WITH(attn::QKVProjection<T>(attn::Linear<T>(4, 8), attn::Linear<T>(4, 6, false),
                                             attn::Linear<T>(4, 6)),
                      "QKVProjection: q, k and v must all have a bias or all have none");
  const auto p = attn::QKVProjection<T>::make(8, 8, 8, 8, true);
  REQUIRE_THROWS_WITH(
      p(attn::Tensor<T, 3>(2, 3, 8), attn::Tensor<T, 3>(1, 3, 8), attn::Tensor<T, 3>(2, 3, 8)),
      "QKVProjection: x_q is [2, 3, 8], x_k is [1, 3, 8], x_v is [2, 3, 8]: batch "
      "sizes differ");
  REQUIRE_THROWS_WITH(p(attn::Tensor<T, 3>(2, 3, 8)).q_heads(3),
                      "QKV::q_heads: width 8 is not divisible by heads 3");
  REQUIRE_THROWS_WITH(attn::split_heads(attn::Tensor<T, 3>(2, 3, 10), 4),
                      "split_heads: x is [2, 3, 10]: the width 10 is not divisible by heads 4");
  REQUIRE_THROWS_WITH(attn::heads_view(attn::Tensor<T, 3>(2, 3, 10), 3),
                      "heads_view: x is [2, 3, 10]: the width 10 is not divisible by heads 3");
  REQUIRE_THROWS_WITH(attn::kv_head_for(0, 6, 4),
                      "kv_head_for: num_heads 6 is not a multiple of num_kv_heads 4");
  REQUIRE_THROWS_WITH(attn::kv_head_for(6, 6, 3), "kv_head_for: q_head 6 is outside [0, 6)");
  REQUIRE_THROWS_WITH(attn::repeat_kv_heads(attn::Tensor<T, 4>(1, 2, 3, 4), 0),
                      "repeat_kv_heads: repeats is 0: must be >= 1");
  float dummy = 0;
  REQUIRE_THROWS_WITH(attn::strided_heads_view(&dummy, 1, 2, 3, 4, 11),
                      "strided_heads_view: (B, S, H, D) is [1, 2, 3, 4] with row stride 11: need "
                      "H, D >= 1 and a row stride of at least H*D");
}
