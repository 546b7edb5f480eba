// Tests for attn/attention.hpp: every PyTorch fixture case through every entry point, in
// float and double, plus NaN propagation and every validation error.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>

#include <attn/attention.hpp>

#include "support/fixtures.hpp"
#include "support/isa_cases.hpp"
#include "support/results.hpp"
#include "support/sdpa_case.hpp"

using attn::Index;
using attn_test::json;

namespace {

/// The (Lq, Lk) slice at (b, h) of a tensor broadcastable to (B, H, Lq, Lk).
template <class T>
attn::Matrix<T> broadcast_slice(const attn::Tensor<T, 4>& t, Index b, Index h, Index lq, Index lk) {
  attn::Matrix<T> m(lq, lk);
  for (Index i = 0; i < lq; ++i) {
    for (Index j = 0; j < lk; ++j) {
      m(i, j) = t(t.dimension(0) == 1 ? 0 : b, t.dimension(1) == 1 ? 0 : h,
                  t.dimension(2) == 1 ? 0 : i, t.dimension(3) == 1 ? 0 : j);
    }
  }
  return m;
}

template <class T>
std::vector<double> slice(const std::vector<double>& flat, Index offset, Index count) {
  return {flat.begin() + offset, flat.begin() + offset + count};
}

}  // namespace

namespace {

template <class TestType>
void batched_attention_matches_the_pytorch_fixtures() {
  using T = TestType;
  const double rtol = attn_test::tolerance<T>();
  for (const json& c : ATTN_FIXTURE_CASES("sdpa.json", "cases", attn_test::sdpa_case_count)) {
    SECTION(c.at("name").get<std::string>()) {
      const attn_test::SdpaCase<T> fx(c);
      attn::Tensor<T, 4> weights;
      attn::Tensor<T, 3> lse;
      const attn::Tensor<T, 4> out = attn_test::out_of(
          attn::scaled_dot_product_attention(fx.q, fx.k, fx.v, fx.options,
                                             attn::Return::weights | attn::Return::logsumexp),
          &weights, &lse);
      ATTN_REQUIRE_CLOSE(out.data(), out.size(), fx.out, rtol);
      ATTN_REQUIRE_CLOSE(weights.data(), weights.size(), fx.weights, rtol);
      ATTN_REQUIRE_CLOSE(lse.data(), lse.size(), fx.lse, rtol);
      // Hidden keys get exactly zero weight, not a denormal (Eigen's exp clamps -inf).
      if (fx.name.rfind("large_logits", 0) != 0) {
        for (std::size_t n = 0; n < fx.weights.size(); ++n) {
          if (fx.weights[n] == 0.0)
            REQUIRE(weights.data()[n] == T(0));
        }
      }

      // Without the optional outputs it matches too, and TensorMaps give the same bits.
      const attn::Tensor<T, 4> out_plain =
          attn::scaled_dot_product_attention(fx.q, fx.k, fx.v, fx.options);
      ATTN_REQUIRE_CLOSE(out_plain.data(), out_plain.size(), fx.out, rtol);
      const attn::TensorMap<const T, 4> q_map(fx.q.data(), fx.q.dimensions());
      const attn::TensorMap<const T, 4> k_map(fx.k.data(), fx.k.dimensions());
      const attn::Tensor<T, 4> out_map =
          attn::scaled_dot_product_attention(q_map, k_map, fx.v, fx.options);
      REQUIRE(std::equal(out_plain.data(), out_plain.data() + out_plain.size(), out_map.data()));
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("batched attention matches the PyTorch fixtures", "[attention]",
                                    batched_attention_matches_the_pytorch_fixtures)

namespace {

template <class TestType>
void b_l_h_d_memory_through_strided() {
  using T = TestType;
  for (const json& c : ATTN_FIXTURE_CASES("sdpa.json", "cases", attn_test::sdpa_case_count)) {
    SECTION(c.at("name").get<std::string>()) {
      const attn_test::SdpaCase<T> fx(c);
      // Transpose q, k, v to (B, L, H, D) storage, as a projection writes them.
      const Eigen::array<Index, 4> to_blhd{0, 2, 1, 3};
      const attn::Tensor<T, 4> q = fx.q.shuffle(to_blhd);
      const attn::Tensor<T, 4> k = fx.k.shuffle(to_blhd);
      const attn::Tensor<T, 4> v = fx.v.shuffle(to_blhd);
      const Index batch = fx.q.dimension(0), hq = fx.q.dimension(1), lq = fx.q.dimension(2);
      const Index dv = fx.v.dimension(3);
      attn::Tensor<T, 4> out(batch, lq, hq, dv);  // (B, Lq, Hq, Dv): heads already merged
      attn::scaled_dot_product_attention_into<T>(
          attn::blhd_view(q.data(), batch, lq, hq, fx.q.dimension(3)),
          attn::blhd_view(k.data(), batch, fx.k.dimension(2), fx.k.dimension(1), fx.k.dimension(3)),
          attn::blhd_view(v.data(), batch, fx.v.dimension(2), fx.v.dimension(1), dv),
          attn::blhd_view(out.data(), batch, lq, hq, dv), fx.options);
      const attn::Tensor<T, 4> out_bhld = out.shuffle(to_blhd);
      ATTN_REQUIRE_CLOSE(out_bhld.data(), out_bhld.size(), fx.out, attn_test::tolerance<T>());
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "(B, L, H, D) memory through strided views matches the fixtures", "[attention]",
    b_l_h_d_memory_through_strided)

namespace {

template <class TestType>
void the_one_head_matrix_overload_matches_the() {
  using T = TestType;
  const double rtol = attn_test::tolerance<T>();
  for (const json& c : ATTN_FIXTURE_CASES("sdpa.json", "cases", attn_test::sdpa_case_count)) {
    SECTION(c.at("name").get<std::string>()) {
      const attn_test::SdpaCase<T> fx(c);
      const Index batch = fx.q.dimension(0), hq = fx.q.dimension(1), lq = fx.q.dimension(2);
      const Index hkv = fx.k.dimension(1), lk = fx.k.dimension(2), dv = fx.v.dimension(3);
      for (Index b = 0; b < batch; ++b) {
        for (Index h = 0; h < hq; ++h) {
          const Index g = h / (hq / hkv);
          const auto q = attn::bhld_view(fx.q).head(b, h);
          const auto k = attn::bhld_view(fx.k).head(b, g);
          // v as a column-major matrix: the overload accepts any Eigen matrix.
          const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> v =
              attn::bhld_view(fx.v).head(b, g);
          attn::AttentionOptions<T> options;
          options.scale = fx.options.scale;
          options.causal = fx.options.causal;
          options.window = fx.options.window;
          options.softcap = fx.options.softcap;
          if (!fx.options.alibi_slopes.empty())
            options.alibi_slopes.assign(1, fx.options.alibi_slopes[std::size_t(h)]);
          if (!fx.options.key_lengths.empty())
            options.key_lengths.assign(1, fx.options.key_lengths[std::size_t(b)]);
          if (!fx.options.query_lengths.empty())
            options.query_lengths.assign(1, fx.options.query_lengths[std::size_t(b)]);
          if (!fx.options.sinks.empty())
            options.sinks.assign(1, fx.options.sinks[std::size_t(h)]);
          options.sink_tokens = fx.options.sink_tokens;
          attn::Matrix<bool> keep;
          attn::Matrix<T> bias;
          if (fx.keep_mask.size() > 0) {
            keep = broadcast_slice(fx.keep_mask, b, h, lq, lk);
            options.keep_mask = keep;
          }
          if (fx.bias.size() > 0) {
            bias = broadcast_slice(fx.bias, b, h, lq, lk);
            options.bias = bias;
          }
          attn::Matrix<T> weights;
          attn::Vector<T> lse;
          const attn::Matrix<T> out = attn_test::out_of(
              attn::scaled_dot_product_attention(q, k, v, options,
                                                 attn::Return::weights | attn::Return::logsumexp),
              &weights, &lse);
          INFO("batch " << b << " head " << h);
          const Index item = b * hq + h;
          ATTN_REQUIRE_CLOSE(out.data(), out.size(), slice<T>(fx.out, item * lq * dv, lq * dv),
                             rtol);
          ATTN_REQUIRE_CLOSE(weights.data(), weights.size(),
                             slice<T>(fx.weights, item * lq * lk, lq * lk), rtol);
          ATTN_REQUIRE_CLOSE(lse.data(), lse.size(), slice<T>(fx.lse, item * lq, lq), rtol);
        }
      }
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "the one-head matrix overload matches the fixtures head by head", "[attention]",
    the_one_head_matrix_overload_matches_the)

namespace {

template <class TestType>
void nan_in_q_k_or_v_propagates() {
  using T = TestType;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  attn::Matrix<T> q = attn::Matrix<T>::Random(4, 8), k = attn::Matrix<T>::Random(5, 8),
                  v = attn::Matrix<T>::Random(5, 3);
  attn::AttentionOptions<T> causal;
  causal.causal = attn::Causal::top_left;

  SECTION("NaN in query row 2 reaches only output row 2") {
    q(2, 5) = nan;
    const attn::Matrix<T> out = attn::scaled_dot_product_attention(q, k, v, causal);
    for (Index i = 0; i < 4; ++i)
      REQUIRE(out.row(i).array().isNaN().all() == (i == 2));
  }
  SECTION("NaN in key 1 reaches every query that sees key 1 (causal: rows 1..3)") {
    k(1, 0) = nan;
    const attn::Matrix<T> out = attn::scaled_dot_product_attention(q, k, v, causal);
    REQUIRE(out.row(0).allFinite());
    for (Index i = 1; i < 4; ++i)
      REQUIRE(out.row(i).array().isNaN().all());
  }
  SECTION("NaN in a value reaches every output in its column") {
    v(3, 1) = nan;
    const attn::Matrix<T> out = attn::scaled_dot_product_attention(q, k, v);
    REQUIRE(out.col(1).array().isNaN().all());
    REQUIRE(out.col(0).allFinite());
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("NaN in q, k or v propagates to the rows it reaches",
                                    "[attention]", nan_in_q_k_or_v_propagates)

namespace {

template <class TestType>
void empty_problems_are_defined() {
  using T = TestType;
  attn::Tensor<T, 4> q(2, 2, 0, 4), k(2, 2, 3, 4), v(2, 2, 3, 5);
  k.setConstant(1);
  v.setConstant(1);
  REQUIRE(attn::scaled_dot_product_attention(q, k, v).size() == 0);

  // No keys: every row attends to nothing, so outputs are zero and lse is -inf.
  attn::Tensor<T, 4> q1(1, 1, 2, 4), k0(1, 1, 0, 4), v0(1, 1, 0, 5);
  q1.setConstant(1);
  attn::Tensor<T, 3> lse;
  const attn::Tensor<T, 4> out = attn_test::out_of(
      attn::scaled_dot_product_attention(q1, k0, v0, {}, attn::Return::logsumexp), nullptr, &lse);
  REQUIRE(out.dimension(3) == 5);
  for (Index n = 0; n < out.size(); ++n)
    REQUIRE(out.data()[n] == T(0));
  REQUIRE(lse(0, 0, 1) == -std::numeric_limits<T>::infinity());
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("empty problems are defined", "[attention]",
                                    empty_problems_are_defined)

TEST_CASE("scaled_dot_product_attention rejects inconsistent shapes and options",
          "[attention][errors][isa]") {
  const auto tensor = [](Index b, Index h, Index l, Index d) {
    attn::Tensor<float, 4> t(b, h, l, d);
    t.setConstant(0.5f);
    return t;
  };
  const auto q = tensor(2, 8, 16, 64), k = tensor(2, 8, 16, 64), v = tensor(2, 8, 16, 32);
  const auto sdpa = [](const attn::Tensor<float, 4>& a, const attn::Tensor<float, 4>& b,
                       const attn::Tensor<float, 4>& c,
                       const attn::AttentionOptions<float>& o = {}) {
    return attn::scaled_dot_product_attention(a, b, c, o);
  };
  REQUIRE_NOTHROW(sdpa(q, k, v));
  REQUIRE_THROWS_WITH(sdpa(q, tensor(2, 8, 16, 32), v),
                      "scaled_dot_product_attention: q is [2, 8, 16, 64], k is [2, 8, 16, 32], v "
                      "is [2, 8, 16, 32]: q and k head dims differ");
  REQUIRE_THROWS_WITH(sdpa(tensor(3, 8, 16, 64), k, v),
                      "scaled_dot_product_attention: q is [3, 8, 16, 64], k is [2, 8, 16, 64], v "
                      "is [2, 8, 16, 32]: batch sizes differ");
  REQUIRE_THROWS_WITH(sdpa(q, k, tensor(2, 4, 16, 32)),
                      "scaled_dot_product_attention: q is [2, 8, 16, 64], k is [2, 8, 16, 64], v "
                      "is [2, 4, 16, 32]: k and v head counts differ");
  REQUIRE_THROWS_WITH(sdpa(q, k, tensor(2, 8, 15, 32)),
                      "scaled_dot_product_attention: q is [2, 8, 16, 64], k is [2, 8, 16, 64], v "
                      "is [2, 8, 15, 32]: k and v lengths differ");
  REQUIRE_THROWS_WITH(
      sdpa(q, tensor(2, 3, 16, 64), tensor(2, 3, 16, 32)),
      "scaled_dot_product_attention: q is [2, 8, 16, 64], k is [2, 3, 16, 64], v "
      "is [2, 3, 16, 32]: query heads (8) must be a multiple of key/value heads (3)");
  REQUIRE_THROWS_WITH(sdpa(tensor(2, 8, 16, 0), tensor(2, 8, 16, 0), v),
                      "scaled_dot_product_attention: q is [2, 8, 16, 0], k is [2, 8, 16, 0], v "
                      "is [2, 8, 16, 32]: the head dim must be positive");

  attn::AttentionOptions<float> options;
  options.scale = std::numeric_limits<float>::infinity();
  REQUIRE_THROWS_WITH(sdpa(q, k, v, options),
                      "scaled_dot_product_attention: scale is inf: must be finite");
  options = {};
  options.window = {0, -2};
  REQUIRE_THROWS_WITH(sdpa(q, k, v, options),
                      "scaled_dot_product_attention: window is (0, -2): each side must be >= -1 "
                      "(-1 = unbounded)");
  options = {};
  options.key_lengths =
      std::vector<Index>{16, 17};  // not "= {..}": GCC 12 -Wnonnull false positive
  REQUIRE_THROWS_WITH(sdpa(q, k, v, options),
                      "scaled_dot_product_attention: key_lengths[1] is 17: must lie in [0, Lk] "
                      "with Lk = 16");
  options = {};
  attn::Tensor<bool, 4> keep(2, 1, 16, 8);
  keep.setConstant(true);
  options.keep_mask = keep;
  REQUIRE_THROWS_WITH(sdpa(q, k, v, options),
                      "scaled_dot_product_attention: keep_mask is [2, 1, 16, 8] but the scores "
                      "are [2, 8, 16, 16]: each dimension must be 1 or equal (broadcasting)");
  options = {};
  options.alibi_slopes = attn::alibi_slopes<float>(4);
  REQUIRE_THROWS_WITH(sdpa(q, k, v, options),
                      "scaled_dot_product_attention: alibi_slopes has 4 entries but there are 8 "
                      "query heads");
  options.alibi_slopes = attn::alibi_slopes<float>(8);
  options.alibi_slopes[2] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(sdpa(q, k, v, options),
                      "scaled_dot_product_attention: alibi_slopes[2] is nan: must be finite");
  options = {};
  for (const float cap : {0.0f, -1.0f, std::numeric_limits<float>::infinity()}) {
    options.softcap = cap;
    REQUIRE_THROWS_WITH(sdpa(q, k, v, options), "scaled_dot_product_attention: softcap is " +
                                                    std::to_string(cap) +
                                                    ": must be finite and > 0");
  }

  // The strided entry point also checks its output view.
  attn::Tensor<float, 4> out(2, 8, 16, 64);
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention_into<float>(attn::bhld_view(q), attn::bhld_view(k),
                                                     attn::bhld_view(v), attn::bhld_view(out)),
      "scaled_dot_product_attention: out is [2, 8, 16, 64] but must be [2, 8, 16, "
      "32] (B, Hq, Lq, Dv)");

  // The matrix overload reports the same rules with (1, 1, L, D) shapes.
  const attn::Matrix<double> a = attn::Matrix<double>::Ones(3, 4),
                             b = attn::Matrix<double>::Ones(5, 3);
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(a, b, b),
                      "scaled_dot_product_attention: q is [1, 1, 3, 4], k is [1, 1, 5, 3], v is "
                      "[1, 1, 5, 3]: q and k head dims differ");
}

TEST_CASE("alibi_slopes follows the ALiBi authors' schedule", "[attention][isa]") {
  const json& schedules = ATTN_FIXTURE_CASES("sdpa.json", "alibi_schedules", 16);
  for (Index heads = 1; heads <= 16; ++heads) {
    INFO(heads << " heads");
    const auto expected = schedules.at(std::to_string(heads)).get<std::vector<double>>();
    const std::vector<double> slopes = attn::alibi_slopes<double>(heads);
    REQUIRE(slopes.size() == expected.size());
    for (std::size_t h = 0; h < slopes.size(); ++h)
      CHECK(static_cast<float>(slopes[h]) == static_cast<float>(expected[h]));
  }
  REQUIRE_THROWS_WITH(attn::alibi_slopes<float>(0), "alibi_slopes: heads is 0: must be positive");
}
