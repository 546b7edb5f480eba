// 16-bit storage (Eigen::half, Eigen::bfloat16) in every attention algorithm: errors against
// the long double reference (support/reference.hpp) on the same 16-bit values, bounded by
// twice the error of a plain 16-bit implementation that accumulates in float; widening tile by tile
// gives the bits of widening first; a long-context case where an fp16 accumulator visibly fails.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include <attn/attention.hpp>
#include <attn/kv_cache.hpp>
#include <attn/multihead.hpp>
#include <attn/precision.hpp>
#include <attn/projection.hpp>
#include <attn/score_modifiers.hpp>

#include "support/heads.hpp"
#include "support/masked_problem.hpp"
#include "support/results.hpp"

namespace {

using attn::Index;
using attn_test::Heads;
using attn_test::max_error;
using attn_test::random_heads;
using attn_test::reference::Problem;

/// The mask sets of these tests: none; causal bottom-right; window (7, 3) with 5 padding
/// keys; causal top-left with ALiBi and softcap 5.
Problem masked(int kind, Index batch, Index q_heads, Index kv_heads, Index q_length, Index k_length,
               Index dim, Index value_dim) {
  Problem p =
      attn_test::sized_problem(batch, q_heads, kv_heads, q_length, k_length, dim, value_dim);
  switch (kind) {
    case 1:
      p.causal = attn_test::reference::Causal::bottom_right;
      break;
    case 2:
      p.window_left = 7;
      p.window_right = 3;
      p.key_lengths.assign(static_cast<std::size_t>(batch), k_length - 5);
      break;
    case 3:
      p.causal = attn_test::reference::Causal::top_left;
      for (const float slope : attn::alibi_slopes<float>(q_heads))
        p.alibi_slopes.push_back(slope);
      p.softcap = 5;
      break;
    default:
      break;
  }
  attn_test::round_numbers_to<float>(p);
  return p;
}

template <class SQ, class SKV>
Problem masked(int kind, const Heads<SQ>& q, const Heads<SKV>& k, const Heads<SKV>& v) {
  return masked(kind, q.b, q.h, k.h, q.l, k.l, q.d, v.d);
}

/// What a plain 16-bit implementation computes: scores and softmax in float from the S
/// values, the probabilities stored as S, P V accumulated in float, the output stored as S.
template <class S>
std::vector<float> plain_16bit_attention(const Problem& p, const Heads<S>& q, const Heads<S>& k,
                                         const Heads<S>& v) {
  const auto to_s = [](float x) { return static_cast<float>(S(x)); };
  return attn_test::reference::attention<float>(p, attn_test::exact(q), attn_test::exact(k),
                                                attn_test::exact(v), {nullptr, to_s, to_s})
      .out;
}

/// The exact result on the same (already 16-bit) values.
template <class SQ, class SKV>
std::vector<long double> exact_attention(const Problem& p, const Heads<SQ>& q, const Heads<SKV>& k,
                                         const Heads<SKV>& v) {
  return attn_test::reference::attention<long double>(p, attn_test::exact(q), attn_test::exact(k),
                                                      attn_test::exact(v))
      .out;
}

constexpr attn::Algorithm all_algorithms[] = {attn::Algorithm::naive, attn::Algorithm::chunked,
                                              attn::Algorithm::flash, attn::Algorithm::decode};

template <class S>
void check_16bit_storage(const char* type_name) {
  std::mt19937 rng(2024);
  // GQA 4/2, odd lengths and dims so that partial tiles and vectors are exercised.
  const Index batch = 2, q_heads = 4, kv_heads = 2, q_length = 37, k_length = 300, dim = 72,
              value_dim = 40;
  const Heads<S> q = random_heads<S>(batch, q_heads, q_length, dim, rng, 1.5);
  const Heads<S> k = random_heads<S>(batch, kv_heads, k_length, dim, rng, 1.5);
  const Heads<S> v = random_heads<S>(batch, kv_heads, k_length, value_dim, rng);
  for (int mask_kind = 0; mask_kind < 4; ++mask_kind) {
    const Problem p = masked(mask_kind, q, k, v);
    const std::vector<long double> reference = exact_attention(p, q, k, v);
    attn_test::AttnOptions<float> o(p);
    attn::AttentionOptions<float>& options = o.options;
    const double plain_error = max_error(plain_16bit_attention(p, q, k, v), reference);
    // The same problem in float: the part of the error that is not 16-bit rounding.
    // (ComputePrecision::fp32, the default: bf16 products are tests/test_bf16_compute.cpp's)
    for (const attn::Algorithm algorithm : all_algorithms) {
      INFO(type_name << ", mask kind " << mask_kind << ", " << algorithm_name(algorithm)
                     << ", plain 16-bit error " << plain_error);
      options.algorithm = algorithm;
      options.query_tile = 16;  // several query and key tiles, a partial last one
      options.key_tile = 64;
      Heads<S> out(batch, q_heads, q_length, value_dim);
      attn::scaled_dot_product_attention_into<S>(q.cview(), k.cview(), v.cview(), out.view(),
                                                 options);
      const double error = max_error(out.data, reference);
      INFO("error " << error);
      CHECK(error <= 2.0 * plain_error + 1e-6);
      CHECK(plain_error > 0.0);  // the bound is not vacuous: 16-bit rounding is visible

      // Output requested in float: the error is then far below the 16-bit rounding.
      Heads<float> out_float(batch, q_heads, q_length, value_dim);
      attn::scaled_dot_product_attention_into<S, S, float>(q.cview(), k.cview(), v.cview(),
                                                           out_float.view(), options);
      const double error_float = max_error(out_float.data, reference);
      INFO("float output error " << error_float);
      CHECK(error_float <= 1e-5);

      // Widening tile by tile computes exactly what widening everything first does.
      const Heads<float> qf = q.template cast<float>(), kf = k.template cast<float>(),
                         vf = v.template cast<float>();
      Heads<float> out_widened(batch, q_heads, q_length, value_dim);
      attn::scaled_dot_product_attention_into<float>(qf.cview(), kf.cview(), vf.cview(),
                                                     out_widened.view(), options);
      CHECK(out_float.data == out_widened.data);
    }
  }
}

/// Machine epsilon of a 16-bit type: 2^-10 for half, 2^-7 for bfloat16 (Eigen 3.4's
/// numeric_limits<half>::epsilon() returns 2^-13, so it is spelled out here).
template <class S>
constexpr double epsilon16() {
  return std::is_same_v<S, Eigen::half> ? 0x1p-10 : 0x1p-7;
}

/// The module of the 16-bit MultiHeadAttention tests: E = 32, 4 heads sharing 2 kv heads.
attn::MultiHeadAttentionConfig small_gqa_config(std::uint64_t seed) {
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 32;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.seed = seed;
  return config;
}

/// A fresh float module's weights rounded to S, stored as U: S itself, or float holding the
/// rounded values (the float reference on the same weights).
template <class S, class U = S>
attn::StateDict<U> rounded_state(const attn::MultiHeadAttentionConfig& config) {
  attn::StateDict<U> state;
  for (const auto& [name, tensor] : attn::MultiHeadAttention<float>(config).state_dict()) {
    state[name].shape = tensor.shape;
    for (const float value : tensor.data)
      state[name].data.push_back(static_cast<U>(S(value)));
  }
  return state;
}

}  // namespace

TEST_CASE("half storage: every algorithm within twice the plain 16-bit error", "[precision][isa]") {
  check_16bit_storage<Eigen::half>("half");
}

TEST_CASE("bfloat16 storage: every algorithm within twice the plain 16-bit error",
          "[precision][isa][bf16]") {
  check_16bit_storage<Eigen::bfloat16>("bfloat16");
}

TEST_CASE("float queries against half keys and values (decoding from a 16-bit cache)",
          "[precision][isa]") {
  std::mt19937 rng(7);
  const Index batch = 1, q_heads = 8, kv_heads = 2, k_length = 513, dim = 64;
  for (const Index q_length : {Index(1), Index(5), Index(130)}) {
    const Heads<float> q = random_heads<float>(batch, q_heads, q_length, dim, rng);
    const Heads<Eigen::half> k = random_heads<Eigen::half>(batch, kv_heads, k_length, dim, rng);
    const Heads<Eigen::half> v = random_heads<Eigen::half>(batch, kv_heads, k_length, dim, rng);
    const Problem p = masked(1, q, k, v);
    const std::vector<long double> reference = exact_attention(p, q, k, v);
    for (const attn::Algorithm algorithm : all_algorithms) {
      INFO("Lq " << q_length << ", " << algorithm_name(algorithm));
      attn_test::AttnOptions<float> o(p);
      attn::AttentionOptions<float>& options = o.options;
      options.algorithm = algorithm;
      Heads<float> out(batch, q_heads, q_length, dim);
      std::vector<float> lse(static_cast<std::size_t>(batch * q_heads * q_length));
      attn::scaled_dot_product_attention_into<float, Eigen::half>(
          q.cview(), k.cview(), v.cview(),
          attn::AttentionOutputViews{out.view(),
                                     attn::bhl_view(lse.data(), batch, q_heads, q_length)},
          options);
      CHECK(max_error(out.data, reference) <= 1e-5);
      for (const float value : lse)
        CHECK(std::isfinite(value));
    }
  }
}

TEST_CASE("tensor API: half inputs, half or float output", "[precision][isa]") {
  std::mt19937 rng(11);
  attn::Tensor<Eigen::half, 4> q(1, 2, 9, 16), k(1, 2, 20, 16), v(1, 2, 20, 8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto* t : {&q, &k, &v}) {
    for (Index i = 0; i < t->size(); ++i)
      t->data()[i] = Eigen::half(normal(rng));
  }
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::top_left;
  attn::Tensor<float, 3> lse;
  const attn::Tensor<Eigen::half, 4> out_half = attn_test::out_of(
      attn::scaled_dot_product_attention(q, k, v, options, attn::Return::logsumexp), nullptr, &lse);
  const attn::Tensor<float, 4> out_float =
      attn::scaled_dot_product_attention<float>(q, k, v, options);
  REQUIRE(out_half.dimension(3) == 8);
  REQUIRE(lse.dimension(2) == 9);
  for (Index i = 0; i < out_half.size(); ++i) {
    // the half output is the float output rounded to nearest
    CHECK(out_half.data()[i] == Eigen::half(out_float.data()[i]));
  }
  // row 0 of a top-left causal mask sees only key 0: its output is v[0] exactly
  for (Index e = 0; e < 8; ++e)
    CHECK(out_half(0, 0, 0, e) == v(0, 0, 0, e));
}

TEST_CASE("long context: float accumulation stays accurate where fp16 accumulation fails",
          "[precision][isa]") {
  // One query against 16384 half keys and values. The softmax denominator grows to
  // thousands, where fp16's spacing exceeds 1, and the weighted value sum loses its low
  // digits: an fp16 accumulator (what a 16-bit-only kernel does) is visibly wrong.
  std::mt19937 rng(5);
  const Index k_length = 16384, dim = 64;
  const Heads<Eigen::half> q = random_heads<Eigen::half>(1, 1, 4, dim, rng, 0.2);
  const Heads<Eigen::half> k = random_heads<Eigen::half>(1, 1, k_length, dim, rng, 0.2);
  Heads<Eigen::half> v = random_heads<Eigen::half>(1, 1, k_length, dim, rng);
  for (Eigen::half& value : v.data)  // a common offset, as real values have
    value = Eigen::half(static_cast<float>(value) + 2.0f);
  Problem p = masked(0, q, k, v);
  p.scale = 1.0L / 8;
  const std::vector<long double> reference = exact_attention(p, q, k, v);

  // fp16 accumulation: running max, sum and output all kept in half.
  std::vector<double> fp16(reference.size());
  const float scale = 1.0f / 8.0f;
  for (Index i = 0; i < 4; ++i) {
    std::vector<float> scores(static_cast<std::size_t>(k_length));
    float max = -INFINITY;
    for (Index j = 0; j < k_length; ++j) {
      float s = 0.0f;
      for (Index d = 0; d < dim; ++d) {
        s += static_cast<float>(q.data[static_cast<std::size_t>(i * dim + d)]) *
             static_cast<float>(k.data[static_cast<std::size_t>(j * dim + d)]);
      }
      scores[static_cast<std::size_t>(j)] = s * scale;
      max = std::max(max, s * scale);
    }
    Eigen::half sum(0.0f);
    std::vector<Eigen::half> acc(static_cast<std::size_t>(dim), Eigen::half(0.0f));
    for (Index j = 0; j < k_length; ++j) {
      const Eigen::half w(std::exp(scores[static_cast<std::size_t>(j)] - max));
      sum = sum + w;
      for (Index e = 0; e < dim; ++e)
        acc[static_cast<std::size_t>(e)] += w * v.data[static_cast<std::size_t>(j * dim + e)];
    }
    for (Index e = 0; e < dim; ++e) {
      fp16[static_cast<std::size_t>(i * dim + e)] =
          static_cast<float>(acc[static_cast<std::size_t>(e)]) / static_cast<float>(sum);
    }
  }
  const double fp16_error = max_error(fp16, reference);

  attn::AttentionOptions<float> options;
  options.scale = scale;
  options.algorithm = attn::Algorithm::flash;
  const double plain_error = max_error(plain_16bit_attention(p, q, k, v), reference);
  Heads<Eigen::half> out(1, 1, 4, dim);
  attn::scaled_dot_product_attention_into<Eigen::half>(q.cview(), k.cview(), v.cview(), out.view(),
                                                       options);
  const double error = max_error(out.data, reference);
  INFO("fp16 accumulator error " << fp16_error << ", ours " << error << ", plain 16-bit "
                                 << plain_error);
  CHECK(error <= 2.0 * plain_error + 1e-6);
  CHECK(error <= 2e-3);  // half rounding of outputs near 2 is 1e-3
  CHECK(fp16_error > 20 * error);
}

TEMPLATE_TEST_CASE("widen: every 16-bit pattern converts exactly", "[precision][isa]", Eigen::half,
                   Eigen::bfloat16) {
  // All 65536 bit patterns (zeros, subnormals, infinities, NaNs), at an odd offset so that
  // the vector loop and the scalar tail both run on unaligned data.
  std::vector<TestType> source(65536 + 3);
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    source[bits + 3] = Eigen::numext::bit_cast<TestType>(static_cast<std::uint16_t>(bits));
  }
  for (const attn::Isa isa : attn::all_isas) {
    if (!attn::isa_supported(isa))
      continue;
    INFO(attn::isa_name(isa));
    std::vector<float> widened(source.size());
    attn::detail::widen(isa, source.data() + 3, widened.data() + 3, 65536);
    std::size_t wrong = 0;
    for (std::size_t i = 3; i < source.size(); ++i) {
      const float expected = static_cast<float>(source[i]);
      const bool same = std::isnan(expected) ? std::isnan(widened[i])
                                             : widened[i] == expected && std::signbit(widened[i]) ==
                                                                             std::signbit(expected);
      wrong += same ? 0 : 1;
    }
    CHECK(wrong == 0);
  }
}

TEMPLATE_TEST_CASE("Linear with 16-bit weights: a float GEMM, rounded once", "[precision][isa]",
                   Eigen::half, Eigen::bfloat16) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const Index rows = 37, in = 72, out = 40;
  attn::Matrix<TestType> w(in, out), x(rows, in);
  attn::Vector<TestType> b(out);
  for (Index i = 0; i < w.size(); ++i)
    w.data()[i] = TestType(0.1f * normal(rng));
  for (Index i = 0; i < x.size(); ++i)
    x.data()[i] = TestType(normal(rng));
  for (Index i = 0; i < b.size(); ++i)
    b.data()[i] = TestType(normal(rng));
  const attn::Linear<TestType> narrow(w, b);
  const attn::Linear<float> wide(w.template cast<float>(), b.template cast<float>());
  const attn::Matrix<float> expected = wide(x.template cast<float>());
  const attn::Matrix<TestType> y = narrow(x);
  REQUIRE(y.rows() == rows);
  REQUIRE(y.cols() == out);
  // The float result rounded once: a half GEMM rounding each partial sum would not match.
  CHECK(y == expected.template cast<TestType>());

  attn::Tensor<TestType, 3> batch(1, rows, in);
  std::copy(x.data(), x.data() + x.size(), batch.data());
  const attn::Tensor<TestType, 3> y_batch = narrow(batch);
  CHECK(std::equal(y.data(), y.data() + y.size(), y_batch.data()));

  // Wrong shapes are reported as for float.
  CHECK_THROWS_AS(narrow(attn::Matrix<TestType>(rows, in + 1)), std::invalid_argument);
}

TEMPLATE_TEST_CASE("MultiHeadAttention with 16-bit weights and activations", "[precision][isa]",
                   Eigen::half, Eigen::bfloat16) {
  // The float layer on the same (16-bit) weights and inputs is the reference; the 16-bit
  // layer rounds its projections, attention output and result to 16 bits, so it may differ
  // by a few 16-bit roundings, no more.
  const double eps = epsilon16<TestType>();
  const attn::MultiHeadAttentionConfig config = small_gqa_config(5);
  const auto narrow =
      attn::MultiHeadAttention<TestType>::from_state_dict(config, rounded_state<TestType>(config));
  const auto wide = attn::MultiHeadAttention<float>::from_state_dict(
      config, rounded_state<TestType, float>(config));

  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const Index batch = 2, q_length = 9, k_length = 13, e = 32;
  attn::Tensor<TestType, 3> query(batch, q_length, e), key(batch, k_length, e);
  for (auto* t : {&query, &key}) {
    for (Index i = 0; i < t->size(); ++i)
      t->data()[i] = TestType(normal(rng));
  }
  const attn::Tensor<float, 3> query_wide = query.template cast<float>();
  const attn::Tensor<float, 3> key_wide = key.template cast<float>();
  attn::Tensor<bool, 2> padding(batch, k_length);
  padding.setConstant(false);
  padding(1, 12) = padding(1, 11) = true;  // the second sequence has 11 keys
  attn::Tensor<TestType, 2> float_mask(q_length, k_length);
  for (Index i = 0; i < float_mask.size(); ++i)
    float_mask.data()[i] = TestType(0.5f * normal(rng));
  const attn::Tensor<float, 2> float_mask_wide = float_mask.template cast<float>();

  for (const bool per_head : {false, true}) {
    INFO("per-head weights " << per_head);
    attn::MultiHeadForwardOptions<TestType> options;
    options.key_padding_mask = padding;
    options.float_attn_mask = float_mask;
    options.need_weights = true;
    options.average_attn_weights = !per_head;
    attn::MultiHeadForwardOptions<float> options_wide;
    options_wide.key_padding_mask = padding;
    options_wide.float_attn_mask = float_mask_wide;
    options_wide.need_weights = true;
    options_wide.average_attn_weights = !per_head;
    const auto result = narrow.forward(query, key, key, options);
    const auto expected = wide.forward(query_wide, key_wide, key_wide, options_wide);
    REQUIRE(result.output.size() == expected.output.size());
    double worst = 0.0;
    for (Index i = 0; i < result.output.size(); ++i) {
      const double ref = expected.output.data()[i];
      worst = std::max(worst, std::abs(static_cast<float>(result.output.data()[i]) - ref) /
                                  (1.0 + std::abs(ref)));
    }
    INFO("worst relative difference " << worst << ", 16-bit eps " << eps);
    CHECK(worst <= 8 * eps);
    CHECK(worst > 0.0);  // it really ran in 16 bits

    // Weights (per head or averaged) within a few 16-bit roundings; padded keys get 0.
    const TestType* weights = per_head ? result.weights.data() : result.averaged_weights.data();
    const float* weights_wide =
        per_head ? expected.weights.data() : expected.averaged_weights.data();
    const Index count = per_head ? result.weights.size() : result.averaged_weights.size();
    REQUIRE(count == (per_head ? batch * 4 : batch) * q_length * k_length);
    for (Index i = 0; i < count; ++i)
      CHECK(std::abs(static_cast<float>(weights[i]) - weights_wide[i]) <= 8 * eps);
    CHECK(static_cast<float>(weights[count - 1]) == 0.0f);  // batch 1's last key is padding
  }
}

TEST_CASE("mixed storage: an output overlapping an input of another scalar is refused",
          "[precision][isa]") {
  // float q and a half out over the same bytes: no kernel can compute that in place.
  std::vector<float> q(2 * 8, 0.5f);
  const std::vector<Eigen::half> k(3 * 8, Eigen::half(0.25f)), v(3 * 8, Eigen::half(1.0f));
  const auto q_view = attn::bhld_view(static_cast<const float*>(q.data()), 1, 1, 2, 8);
  const auto k_view = attn::bhld_view(k.data(), 1, 1, 3, 8);
  const auto v_view = attn::bhld_view(v.data(), 1, 1, 3, 8);
  const auto out_over_q = attn::bhld_view(reinterpret_cast<Eigen::half*>(q.data()), 1, 1, 2, 8);
  CHECK_THROWS_WITH((attn::scaled_dot_product_attention_into<float, Eigen::half, Eigen::half>(
                        q_view, k_view, v_view, out_over_q)),
                    Catch::Matchers::Contains("scaled_dot_product_attention") &&
                        Catch::Matchers::Contains("out overlaps q"));
  // A separate output is fine: every query sees equal scores, so the output is v's 1.0.
  std::vector<Eigen::half> out(2 * 8);
  attn::scaled_dot_product_attention_into<float, Eigen::half, Eigen::half>(
      q_view, k_view, v_view, attn::bhld_view(out.data(), 1, 1, 2, 8));
  for (const Eigen::half value : out)
    CHECK(static_cast<float>(value) == 1.0f);
}

TEMPLATE_TEST_CASE("a 16-bit MultiHeadAttention decodes token by token like its causal forward",
                   "[precision][kv_cache][multihead][isa]", Eigen::half, Eigen::bfloat16) {
  // Same 16-bit module both ways: the projections and the attention output are rounded to
  // 16 bits once each either way, so the two may differ only where a float sum in another
  // order (decode or flash, GEMMs of other sizes) rounds to a neighbouring 16-bit value.
  using T = TestType;
  const double eps = epsilon16<T>();
  const attn::MultiHeadAttentionConfig config = small_gqa_config(9);
  const auto mha = attn::MultiHeadAttention<T>::from_state_dict(config, rounded_state<T>(config));
  const Index batch = 2, length = 10, e = 32;
  std::mt19937 rng(23);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  attn::Tensor<T, 3> x(batch, length, e);
  for (Index n = 0; n < x.size(); ++n)
    x.data()[n] = T(normal(rng));
  attn::MultiHeadForwardOptions<T> causal;
  causal.is_causal = true;
  const attn::Tensor<T, 3> expected = mha.forward(x, causal).output;
  double magnitude = 1;
  for (Index n = 0; n < expected.size(); ++n)
    magnitude = std::max(magnitude, std::abs(static_cast<double>(expected.data()[n])));

  const auto decode = [&](auto cache, Index chunk) {
    double worst = 0;
    for (Index t0 = 0; t0 < length; t0 += chunk) {
      const Index n = std::min(chunk, length - t0);
      attn::Tensor<T, 3> part(batch, n, e);
      for (Index b = 0; b < batch; ++b)
        for (Index t = 0; t < n; ++t)
          for (Index c = 0; c < e; ++c)
            part(b, t, c) = x(b, t0 + t, c);
      const attn::Tensor<T, 3> y = mha.forward_incremental(part, cache);
      for (Index b = 0; b < batch; ++b)
        for (Index t = 0; t < n; ++t)
          for (Index c = 0; c < e; ++c)
            worst = std::max(worst, std::abs(static_cast<double>(y(b, t, c)) -
                                             static_cast<double>(expected(b, t0 + t, c))));
    }
    REQUIRE(cache.lengths() == std::vector<Index>{length, length});
    return worst;
  };
  for (const Index chunk : {1, 4}) {
    INFO("chunk " << chunk);
    const double same_type = decode(attn::KVCache<T>(batch, 2, 8, 8, 4), chunk);
    const double float_cache = decode(attn::KVCache<float>(batch, 2, 8, 8, 4), chunk);
    CAPTURE(magnitude, same_type, float_cache);
    // A float cache holds the same (16-bit) keys and values exactly.
    REQUIRE(same_type <= 4 * eps * magnitude);
    REQUIRE(float_cache <= 4 * eps * magnitude);
  }
}
