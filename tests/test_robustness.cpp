// Robustness: edge cases every kernel must define, inputs laid out in unusual ways, the
// error paths other test files leave out, regression tests for what the differential fuzzer
// (fuzz/fuzz_attention.cpp) found, and determinism (thread safety: test_threads.cpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/heads.hpp>
#include <attn/linear_attention.hpp>
#include <attn/multihead.hpp>
#include <attn/projection.hpp>
#include <attn/softmax.hpp>

#include "support/isa_cases.hpp"
#include "support/random_tensor.hpp"
#include "support/results.hpp"

using attn::Index;
using Catch::Matchers::Contains;

namespace {

using attn_test::random_tensor;

constexpr attn::Algorithm all_algorithms[] = {attn::Algorithm::naive, attn::Algorithm::chunked,
                                              attn::Algorithm::flash};

template <class T>
attn::Matrix<T> random_matrix(Index rows, Index cols, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  attn::Matrix<T> m(rows, cols);
  for (Index n = 0; n < m.size(); ++n)
    m.data()[n] = static_cast<T>(normal(rng));
  return m;
}

template <class T>
attn::AttentionOptions<T> with(attn::Algorithm algorithm, Index query_tile = 0,
                               Index key_tile = 0) {
  attn::AttentionOptions<T> o;
  o.algorithm = algorithm;
  o.query_tile = query_tile;
  o.key_tile = key_tile;
  return o;
}

template <class T>
bool same_bits(const T* a, const T* b, Index n) {
  return std::memcmp(a, b, static_cast<std::size_t>(n) * sizeof(T)) == 0;
}

}  // namespace

namespace {

template <class TestType>
void fuzz_regression_a_key_the_keep_mask() {
  // Found by fuzz_attention: the keep-mask wrote -inf and the bias was added after it, so a
  // hidden key with a +inf (or NaN) bias turned the score into NaN and the row into NaN.
  using T = TestType;
  const T inf = std::numeric_limits<T>::infinity();
  const attn::Matrix<T> q = random_matrix<T>(3, 4, 1u), k = random_matrix<T>(5, 4, 2u),
                        v = random_matrix<T>(5, 2, 3u);
  attn::Matrix<bool> keep = attn::Matrix<bool>::Constant(3, 5, true);
  attn::Matrix<T> bias = attn::Matrix<T>::Zero(3, 5);
  keep(0, 1) = false;
  bias(0, 1) = inf;  // hidden by the keep-mask: must not matter
  keep(1, 2) = false;
  bias(1, 2) = std::numeric_limits<T>::quiet_NaN();
  keep.row(2).setConstant(false);  // row 2 sees nothing, one of its biases is +inf
  bias(2, 4) = inf;
  // The same problem without the hidden keys' biases.
  attn::Matrix<T> clean_bias = bias;
  clean_bias(0, 1) = clean_bias(1, 2) = clean_bias(2, 4) = T(0);
  for (const attn::Algorithm algorithm : all_algorithms) {
    INFO(attn::algorithm_name(algorithm));
    attn::AttentionOptions<T> options = with<T>(algorithm, 2, 2);
    options.keep_mask = keep;
    options.bias = bias;
    attn::Vector<T> lse;
    const attn::Matrix<T> out = attn_test::out_of(
        attn::scaled_dot_product_attention(q, k, v, options, attn::Return::logsumexp), nullptr,
        &lse);
    options.bias = clean_bias;
    const attn::Matrix<T> expected = attn::scaled_dot_product_attention(q, k, v, options);
    REQUIRE(out.allFinite());
    REQUIRE(out == expected);
    REQUIRE(out.row(2).isZero(0));
    REQUIRE(lse(2) == -inf);
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "fuzz regression: a key the keep-mask hides is excluded whatever its bias",
    "[robustness][fuzz]", fuzz_regression_a_key_the_keep_mask)

namespace {

template <class TestType>
void empty_batches_queries_keys_and_value_dims() {
  using T = TestType;
  const T minus_inf = -std::numeric_limits<T>::infinity();
  for (const attn::Algorithm algorithm : all_algorithms) {
    INFO(attn::algorithm_name(algorithm));
    const attn::AttentionOptions<T> options = with<T>(algorithm, 3, 2);
    attn::Tensor<T, 3> lse;
    // B = 0: an empty result of the right shape.
    attn::Tensor<T, 4> out =
        attn_test::out_of(attn::scaled_dot_product_attention(
                              random_tensor<T>(0, 2, 3, 4, 1u), random_tensor<T>(0, 1, 5, 4, 2u),
                              random_tensor<T>(0, 1, 5, 6, 3u), options, attn::Return::logsumexp),
                          nullptr, &lse);
    REQUIRE(out.dimension(0) == 0);
    REQUIRE(out.dimension(1) == 2);
    REQUIRE(out.dimension(2) == 3);
    REQUIRE(out.dimension(3) == 6);
    REQUIRE(lse.size() == 0);
    // Lq = 0.
    out = attn::scaled_dot_product_attention(random_tensor<T>(2, 2, 0, 4, 1u),
                                             random_tensor<T>(2, 1, 5, 4, 2u),
                                             random_tensor<T>(2, 1, 5, 6, 3u), options);
    REQUIRE(out.size() == 0);
    REQUIRE(out.dimension(3) == 6);
    // Lk = 0, with a causal mask and key lengths: zeros and lse -inf.
    attn::AttentionOptions<T> masked = options;
    masked.causal = attn::Causal::bottom_right;
    masked.key_lengths.assign(2, 0);
    out = attn_test::out_of(attn::scaled_dot_product_attention(
                                random_tensor<T>(2, 2, 3, 4, 1u), random_tensor<T>(2, 1, 0, 4, 2u),
                                random_tensor<T>(2, 1, 0, 6, 3u), masked, attn::Return::logsumexp),
                            nullptr, &lse);
    REQUIRE(out.size() == 2 * 2 * 3 * 6);
    for (Index n = 0; n < out.size(); ++n)
      REQUIRE(out.data()[n] == T(0));
    for (Index n = 0; n < lse.size(); ++n)
      REQUIRE(lse.data()[n] == minus_inf);
    // Dv = 0: nothing to write, but the log-sum-exp is still computed.
    out = attn_test::out_of(
        attn::scaled_dot_product_attention(
            random_tensor<T>(1, 1, 3, 4, 1u), attn::Tensor<T, 4>(1, 1, 2, 4).setZero(),
            random_tensor<T>(1, 1, 2, 0, 3u), options, attn::Return::logsumexp),
        nullptr, &lse);
    REQUIRE(out.size() == 0);
    for (Index i = 0; i < 3; ++i)  // two keys with score 0: log(2)
      REQUIRE_THAT(static_cast<double>(lse(0, 0, i)),
                   Catch::Matchers::WithinAbs(std::log(2.0), 1e-6));
  }
  // linear_attention: B = 0 and Dv = 0 as well.
  REQUIRE(attn::linear_attention(random_tensor<T>(0, 2, 3, 4, 1u), random_tensor<T>(0, 1, 5, 4, 2u),
                                 random_tensor<T>(0, 1, 5, 6, 3u))
              .size() == 0);
  REQUIRE(attn::linear_attention(random_tensor<T>(1, 2, 3, 4, 1u), random_tensor<T>(1, 1, 5, 4, 2u),
                                 random_tensor<T>(1, 1, 5, 0, 3u))
              .size() == 0);
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "empty batches, queries, keys and value dims are defined in every kernel", "[robustness][edge]",
    empty_batches_queries_keys_and_value_dims)

namespace {

template <class TestType>
void d_1_matches_the_closed_form() {
  // One query q = 2 against keys 0 and 1 (scale 1): weights 1 / (1 + e^2) and e^2 / (1 + e^2).
  using T = TestType;
  attn::Matrix<T> q(1, 1), k(2, 1), v(2, 2);
  q << T(2);
  k << T(0), T(1);
  v << T(1), T(-1), T(3), T(5);
  const double w1 = std::exp(2.0) / (1 + std::exp(2.0)), w0 = 1 - w1;
  for (const attn::Algorithm algorithm : all_algorithms) {
    INFO(attn::algorithm_name(algorithm));
    attn::AttentionOptions<T> options = with<T>(algorithm);
    options.scale = T(1);
    attn::Vector<T> lse;
    const attn::Matrix<T> out = attn_test::out_of(
        attn::scaled_dot_product_attention(q, k, v, options, attn::Return::logsumexp), nullptr,
        &lse);
    const double tolerance = 8 * static_cast<double>(std::numeric_limits<T>::epsilon());
    REQUIRE_THAT(static_cast<double>(out(0, 0)),
                 Catch::Matchers::WithinAbs(w0 + 3 * w1, 4 * tolerance));
    REQUIRE_THAT(static_cast<double>(out(0, 1)),
                 Catch::Matchers::WithinAbs(-w0 + 5 * w1, 8 * tolerance));
    REQUIRE_THAT(static_cast<double>(lse(0)),
                 Catch::Matchers::WithinAbs(std::log(1 + std::exp(2.0)), 4 * tolerance));
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("D = 1 matches the closed form", "[robustness][edge]",
                                    d_1_matches_the_closed_form)

namespace {

template <class TestType>
void a_single_query_against_100000_keys() {
  using T = TestType;
  constexpr Index keys = 100000;
  const attn::Matrix<T> v = random_matrix<T>(keys, 3, 5u);
  attn::Matrix<T> k = attn::Matrix<T>::Zero(keys, 4);
  attn::Matrix<T> q = attn::Matrix<T>::Ones(1, 4);
  // Equal logits: uniform weights, out = the mean of v; lse = log(Lk) exactly up to rounding.
  Eigen::RowVectorXd mean = v.template cast<double>().colwise().mean();
  // One key far above the rest (logit 40 higher): out is that key's value row.
  attn::Matrix<T> k_peak = k;
  k_peak.row(keys - 7).setConstant(T(20));  // q . k = 80, scale 1/2: logit 40
  for (const attn::Algorithm algorithm : all_algorithms) {
    INFO(attn::algorithm_name(algorithm));
    const attn::AttentionOptions<T> options = with<T>(algorithm);
    attn::Vector<T> lse;
    attn::Matrix<T> out = attn_test::out_of(
        attn::scaled_dot_product_attention(q, k, v, options, attn::Return::logsumexp), nullptr,
        &lse);
    const double tolerance = std::is_same_v<T, float> ? 1e-4 : 1e-12;
    for (Index e = 0; e < 3; ++e)
      REQUIRE_THAT(static_cast<double>(out(0, e)), Catch::Matchers::WithinAbs(mean(e), tolerance));
    REQUIRE_THAT(static_cast<double>(lse(0)),
                 Catch::Matchers::WithinRel(std::log(static_cast<double>(keys)), tolerance));
    out = attn::scaled_dot_product_attention(q, k_peak, v, options);
    for (Index e = 0; e < 3; ++e) {
      // The other keys together weigh (Lk - 1) e^-40 = 4.2e-13.
      REQUIRE_THAT(static_cast<double>(out(0, e)),
                   Catch::Matchers::WithinAbs(static_cast<double>(v(keys - 7, e)), tolerance));
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("a single query against 100000 keys", "[robustness][edge]",
                                    a_single_query_against_100000_keys)

namespace {

template <class TestType>
void misaligned_and_strided_views_give_the_contiguous() {
  using T = TestType;
  const Index B = 2, H = 2, L = 37, D = 9, Dv = 5, pad = 3;
  const attn::Tensor<T, 4> q = random_tensor<T>(B, H, L, D, 11u),
                           k = random_tensor<T>(B, H, L, D, 12u),
                           v = random_tensor<T>(B, H, L, Dv, 13u);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  // Copies of q, k, v one element past the start of a buffer (misaligned for every vector
  // width), rows padded to D + pad with NaN, which must never be read.
  const auto strided = [&](const attn::Tensor<T, 4>& t, std::vector<T>& buffer) {
    const Index d = t.dimension(3), row = d + pad;
    buffer.assign(static_cast<std::size_t>(1 + B * H * L * row), nan);
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h)
        for (Index l = 0; l < L; ++l)
          for (Index e = 0; e < d; ++e)
            buffer[static_cast<std::size_t>(1 + ((b * H + h) * L + l) * row + e)] = t(b, h, l, e);
    return attn::HeadsView<const T>{buffer.data() + 1, B, H, L, d, H * L * row, L * row, row};
  };
  std::vector<T> qb, kb, vb;
  const attn::HeadsView<const T> qs = strided(q, qb), ks = strided(k, kb), vs = strided(v, vb);
  for (const attn::Algorithm algorithm : all_algorithms) {
    INFO(attn::algorithm_name(algorithm));
    attn::AttentionOptions<T> options = with<T>(algorithm, 8, 16);
    options.causal = attn::Causal::top_left;
    const attn::Tensor<T, 4> expected = attn::scaled_dot_product_attention(q, k, v, options);
    // Output: misaligned too, (B, L, H, Dv) memory with padded rows left untouched.
    std::vector<T> out(static_cast<std::size_t>(1 + B * L * H * Dv + pad), T(-7));
    const attn::HeadsView<T> out_view{out.data() + 1, B, H, L, Dv, L * H * Dv, Dv, H * Dv};
    attn::scaled_dot_product_attention_into<T>(qs, ks, vs, out_view, options);
    REQUIRE(out.front() == T(-7));
    REQUIRE(out.back() == T(-7));
    const double tolerance = 16 * static_cast<double>(std::numeric_limits<T>::epsilon());
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h)
        for (Index l = 0; l < L; ++l)
          for (Index e = 0; e < Dv; ++e) {
            REQUIRE_THAT(
                static_cast<double>(out_view.head(b, h)(l, e)),
                Catch::Matchers::WithinAbs(static_cast<double>(expected(b, h, l, e)), tolerance));
          }
    // The batched overload accepts the HeadsView directly.
    const attn::Tensor<T, 4> from_views = attn::scaled_dot_product_attention(qs, ks, vs, options);
    REQUIRE(from_views.size() == expected.size());
    REQUIRE(same_bits(from_views.data(), expected.data(), expected.size()));
  }
  // linear_attention on the same views.
  const attn::Tensor<T, 4> expected = attn::linear_attention(q, k, v);
  const attn::Tensor<T, 4> actual = attn::linear_attention(qs, ks, vs);
  for (Index n = 0; n < expected.size(); ++n) {
    REQUIRE_THAT(static_cast<double>(actual.data()[n]),
                 Catch::Matchers::WithinAbs(static_cast<double>(expected.data()[n]), 1e-5));
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("misaligned and strided views give the contiguous result",
                                    "[robustness][layout]",
                                    misaligned_and_strided_views_give_the_contiguous)

namespace {

template <class TestType>
void output_aliasing_in_place_over_q_works() {
  using T = TestType;
  const Index B = 2, H = 4, Hkv = 2, L = 21, D = 8;
  const attn::Tensor<T, 4> q = random_tensor<T>(B, H, L, D, 21u),
                           k = random_tensor<T>(B, Hkv, L, D, 22u),
                           v = random_tensor<T>(B, Hkv, L, D, 23u);
  for (const attn::Algorithm algorithm : all_algorithms) {
    INFO(attn::algorithm_name(algorithm));
    attn::AttentionOptions<T> options = with<T>(algorithm, 4, 8);
    options.causal = attn::Causal::top_left;
    const attn::Tensor<T, 4> expected = attn::scaled_dot_product_attention(q, k, v, options);
    attn::Tensor<T, 4> in_place = q;
    attn::scaled_dot_product_attention_into<T>(attn::bhld_view(in_place), attn::bhld_view(k),
                                               attn::bhld_view(v), attn::bhld_view(in_place),
                                               options);
    REQUIRE(same_bits(in_place.data(), expected.data(), expected.size()));

    // The output one row below q in the same buffer: rows would be overwritten before
    // they are read.
    std::vector<T> shifted(static_cast<std::size_t>(q.size() + D));
    std::copy(q.data(), q.data() + q.size(), shifted.begin());
    REQUIRE_THROWS_WITH(
        attn::scaled_dot_product_attention_into<T>(
            attn::bhld_view<const T>(shifted.data(), B, H, L, D), attn::bhld_view(k),
            attn::bhld_view(v), attn::bhld_view(shifted.data() + D, B, H, L, D), options),
        "scaled_dot_product_attention: out overlaps q: out must be q itself (in place) or "
        "share no element with q, k and v");
  }
  // Disjoint column blocks of one buffer, (B, L, 3 E) as a fused QKV projection writes it,
  // with the output in a fourth block: allowed.
  const Index E = H * D;
  std::vector<T> fused(static_cast<std::size_t>(B * L * 4 * E));
  std::mt19937 rng(5u);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (T& x : fused)
    x = static_cast<T>(normal(rng));
  const auto block = [&](Index column) {
    return attn::HeadsView<T>{fused.data() + column, B, H, L, D, L * 4 * E, D, 4 * E};
  };
  REQUIRE_NOTHROW(
      attn::scaled_dot_product_attention_into<T>(block(0), block(E), block(2 * E), block(3 * E)));
  // The output over the value block, or over half of the key block: rejected.
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention_into<T>(block(0), block(E), block(2 * E), block(2 * E)),
      Contains("out overlaps v"));
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention_into<T>(block(0), block(E), block(2 * E), block(E + D)),
      Contains("out overlaps k"));
  // linear_attention: the same rule.
  const attn::Tensor<T, 4> linear_expected = attn::linear_attention(q, k, v);
  attn::Tensor<T, 4> linear_in_place = q;
  attn::linear_attention_into<T>(attn::bhld_view(linear_in_place), attn::bhld_view(k),
                                 attn::bhld_view(v), attn::bhld_view(linear_in_place));
  REQUIRE(same_bits(linear_in_place.data(), linear_expected.data(), linear_expected.size()));
  REQUIRE_THROWS_WITH(
      attn::linear_attention_into<T>(block(0), block(E), block(2 * E), block(2 * E)),
      "linear_attention: out overlaps v: out must be q itself (in place) or share no element "
      "with q, k and v");
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "output aliasing: in place over q works, any other overlap throws", "[robustness][aliasing]",
    output_aliasing_in_place_over_q_works)

namespace {

template <class TestType>
void subnormal_inputs_and_all_equal_logits() {
  using T = TestType;
  const T tiny = std::numeric_limits<T>::denorm_min() * T(3);
  for (const attn::Algorithm algorithm : all_algorithms) {
    INFO(attn::algorithm_name(algorithm));
    const attn::AttentionOptions<T> options = with<T>(algorithm, 2, 3);
    // Subnormal q and k: logits (about 0) equal, weights exactly uniform over 4 keys (1/4 is
    // exact), out the mean of v; subnormal v passes through as the mean of subnormals.
    attn::Matrix<T> q = attn::Matrix<T>::Constant(3, 5, tiny);
    attn::Matrix<T> k = attn::Matrix<T>::Constant(4, 5, tiny);
    attn::Matrix<T> v(4, 2);
    v << T(1), tiny, T(2), tiny, T(3), tiny, T(6), tiny;
    attn::Matrix<T> weights;
    const attn::AttentionOptions<T> naive = with<T>(attn::Algorithm::naive);
    attn_test::out_of(attn::scaled_dot_product_attention(q, k, v, naive, attn::Return::weights),
                      &weights, nullptr);
    REQUIRE((weights.array() == T(0.25)).all());
    const attn::Matrix<T> out = attn::scaled_dot_product_attention(q, k, v, options);
    for (Index i = 0; i < 3; ++i) {
      REQUIRE(out(i, 0) == T(3));  // (1 + 2 + 3 + 6) / 4, exact in every summation order
      REQUIRE(out(i, 1) >= T(0));
      REQUIRE(out(i, 1) <= 2 * tiny);  // each tiny / 4 rounds up to a whole denormal
    }
    // All-equal logits from equal keys: each weight exactly 1/8 and out = mean exactly.
    attn::Matrix<T> k_equal = random_matrix<T>(1, 5, 7u).replicate(8, 1);
    attn::Matrix<T> v8(8, 1);
    v8 << T(1), T(2), T(3), T(4), T(5), T(6), T(7), T(8);
    const attn::Matrix<T> uniform =
        attn::scaled_dot_product_attention(random_matrix<T>(6, 5, 8u), k_equal, v8, options);
    REQUIRE((uniform.array() == T(4.5)).all());
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("subnormal inputs and all-equal logits", "[robustness][edge]",
                                    subnormal_inputs_and_all_equal_logits)

namespace {

template <class TestType>
void infinities_in_q_or_k_inf_logits() {
  // The rule (README, "Error contract"): a logit of -inf hides its key like a mask; a logit
  // of +inf or NaN (inf * 0, inf - inf) makes the row NaN; rows not reached stay finite.
  using T = TestType;
  const T inf = std::numeric_limits<T>::infinity();
  attn::Matrix<T> q(3, 2), k(3, 2), v(3, 1);
  q << T(1), T(1),   // row 0: logits (1, 1, -inf)
      inf, T(1),     // row 1: logit +inf for key 0: NaN
      T(0.5), T(2);  // row 2: logits (0.5, 2, -inf)
  k << T(1), T(0),   //
      T(0), T(1),    //
      T(-2), -inf;   // key 2: -2 q_0 - inf q_1 = -inf for rows 0 and 2
  v << T(10), T(20), T(30);
  for (const attn::Algorithm algorithm : all_algorithms) {
    INFO(attn::algorithm_name(algorithm));
    attn::AttentionOptions<T> options = with<T>(algorithm, 2, 2);
    options.scale = T(1);
    const attn::Matrix<T> out = attn::scaled_dot_product_attention(q, k, v, options);
    // Row 0: key 2 is hidden by its -inf logit; keys 0 and 1 weigh 1/2 each.
    REQUIRE_THAT(static_cast<double>(out(0, 0)), Catch::Matchers::WithinRel(15.0, 1e-6));
    REQUIRE(std::isnan(out(1, 0)));  // +inf - +inf = NaN
    const double e05 = std::exp(0.5), e2 = std::exp(2.0);
    REQUIRE_THAT(static_cast<double>(out(2, 0)),
                 Catch::Matchers::WithinRel((10 * e05 + 20 * e2) / (e05 + e2), 1e-6));
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "infinities in q or k: -inf logits hide keys, +inf and inf - inf give NaN", "[robustness][nan]",
    infinities_in_q_or_k_inf_logits)

TEST_CASE("wrong shapes: every public entry point names itself and the shapes",
          "[robustness][errors][isa]") {
  // The gaps left by the per-header test files (which test most messages exactly).
  const attn::Matrix<float> a = attn::Matrix<float>::Ones(3, 4),
                            b = attn::Matrix<float>::Ones(5, 3);
  // The one-head matrix overloads.
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention(a, b, b),
      Contains("scaled_dot_product_attention: q is [1, 1, 3, 4], k is [1, 1, 5, 3]") &&
          Contains("q and k head dims differ"));
  REQUIRE_THROWS_WITH(attn::linear_attention(a, b, b),
                      Contains("linear_attention: q is [1, 1, 3, 4], k is [1, 1, 5, 3]") &&
                          Contains("q and k head dims differ"));
  REQUIRE_THROWS_WITH(
      attn::linear_attention(a, attn::Matrix<float>::Ones(5, 4), attn::Matrix<float>::Ones(6, 2)),
      Contains("linear_attention:") && Contains("v is [1, 1, 6, 2]") &&
          Contains("k and v lengths differ"));
  // HeadsView inputs to the batched overload.
  std::vector<float> buffer(64, 1.0f);
  const auto view = [&](Index bb, Index h, Index l, Index d) {
    return attn::bhld_view<const float>(buffer.data(), bb, h, l, d);
  };
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention(view(1, 3, 2, 2), view(1, 2, 2, 2), view(1, 2, 2, 2)),
      Contains("scaled_dot_product_attention: q is [1, 3, 2, 2]") &&
          Contains("query heads (3) must be a multiple of key/value heads (2)"));
  REQUIRE_THROWS_WITH(
      attn::linear_attention(view(2, 1, 2, 2), view(1, 1, 2, 2), view(1, 1, 2, 2)),
      Contains("linear_attention: q is [2, 1, 2, 2]") && Contains("batch sizes differ"));
  // The output view of scaled_dot_product_attention_into.
  std::vector<float> out(64);
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_into<float>(
                          view(1, 1, 2, 2), view(1, 1, 3, 2), view(1, 1, 3, 2),
                          attn::bhld_view(out.data(), 1, 1, 3, 2)),
                      "scaled_dot_product_attention: out is [1, 1, 3, 2] but must be [1, 1, 2, 2] "
                      "(B, Hq, Lq, Dv)");
  // Linear::apply_into.
  const attn::Linear<float> linear(4, 3);
  attn::Matrix<float> x = attn::Matrix<float>::Ones(2, 4), y(2, 2);
  REQUIRE_THROWS_WITH(
      linear.apply_into(attn::ConstRowsMap<float>(x.data(), 2, 4, Eigen::OuterStride<>(4)),
                        attn::RowsMap<float>(y.data(), 2, 2, Eigen::OuterStride<>(2))),
      "Linear::apply_into: x is [2, 4], y is [2, 2] and the weight (in, out) is [4, 3]: need x "
      "(N, in) and y (N, out)");
  // split_heads with zero heads, heads_view with a width that does not divide.
  REQUIRE_THROWS_WITH(attn::split_heads(attn::Tensor<float, 3>(2, 3, 8), 0),
                      "split_heads: x is [2, 3, 8]: the width 8 is not divisible by heads 0");
  // MultiHeadAttention: a query of the wrong width.
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 8;
  config.num_heads = 2;
  const attn::MultiHeadAttention<float> mha(config);
  attn::Tensor<float, 3> wrong(1, 3, 6);
  wrong.setZero();
  REQUIRE_THROWS_WITH(mha.forward(wrong),
                      Contains("MultiHeadAttention::forward") && Contains("[1, 3, 6]"));
}

TEST_CASE("the build has OpenMP when it was asked for", "[robustness][determinism]") {
  // The thread-count tests below exist only with OpenMP; a build configured with ATTN_OPENMP
  // that lost it (the wrong flags, the wrong compiler) fails here instead of skipping them.
  CHECK(ATTN_HAS_OPENMP == ATTN_TEST_EXPECT_OPENMP);
}

#if ATTN_HAS_OPENMP
namespace {

template <class TestType>
void same_inputs_same_bits_repeated_calls_and() {
  // test_kernels.cpp checks chunked and flash (and test_linear_attention.cpp linear
  // attention) with 1 and 2 threads on one shape; this adds naive, repeated calls, masks
  // with a bias and GQA, for every kernel.
  using T = TestType;
  const attn::Tensor<T, 4> q = random_tensor<T>(2, 4, 130, 24, 41u),
                           k = random_tensor<T>(2, 2, 150, 24, 42u),
                           v = random_tensor<T>(2, 2, 150, 20, 43u);
  attn::Tensor<T, 4> bias = random_tensor<T>(1, 4, 130, 150, 44u);
  const auto results = [&] {
    std::vector<attn::Tensor<T, 4>> r;
    for (const attn::Algorithm algorithm : all_algorithms) {
      attn::AttentionOptions<T> options = with<T>(algorithm, 32, 64);
      options.causal = attn::Causal::bottom_right;
      options.bias = bias;
      options.key_lengths = std::vector<Index>{150, 97};
      r.push_back(attn::scaled_dot_product_attention(q, k, v, options));
    }
    attn::LinearAttentionOptions<T> linear;
    linear.causal = attn::Causal::bottom_right;
    r.push_back(attn::linear_attention(q, k, v, linear));
    return r;
  };
  const std::vector<attn::Tensor<T, 4>> first = results();
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<attn::Tensor<T, 4>> one = results();
  omp_set_num_threads(2);
  const std::vector<attn::Tensor<T, 4>> two = results();
  omp_set_num_threads(saved);
  const std::vector<attn::Tensor<T, 4>> again = results();
  for (std::size_t n = 0; n < first.size(); ++n) {
    INFO("kernel " << n << " (naive, chunked, flash, linear)");
    const Index size = first[n].size();
    REQUIRE(same_bits(first[n].data(), again[n].data(), size));
    REQUIRE(same_bits(one[n].data(), two[n].data(), size));
    REQUIRE(same_bits(first[n].data(), one[n].data(), size));
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "same inputs, same bits: repeated calls and 1 or 2 OpenMP threads", "[robustness][determinism]",
    same_inputs_same_bits_repeated_calls_and)
#endif  // ATTN_HAS_OPENMP
