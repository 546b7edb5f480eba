// Optional results as views (attn/outputs.hpp): strided log-sum-exp, weights and bias
// gradients hold bitwise what the contiguous ones hold and leave the memory between their rows
// alone; the value forms compute exactly what their Return set names; every rule on the
// views throws before anything is written.
#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/attention_backward.hpp>
#include <attn/kv_cache.hpp>

namespace {

using attn::Index;
using attn::Return;

constexpr float sentinel = -12345.0f;

/// Values in [-1, 1] that differ per seed and element.
attn::Tensor<float, 4> filled(Index b, Index h, Index l, Index d, unsigned seed) {
  attn::Tensor<float, 4> t(b, h, l, d);
  for (Index n = 0; n < t.size(); ++n)
    t.data()[n] = static_cast<float>(std::sin(0.37 * double(n + 1) * double(seed)));
  return t;
}

bool same_bits(const float* a, const float* b, Index n) {
  return std::memcmp(a, b, static_cast<std::size_t>(n) * sizeof(float)) == 0;
}

/// Equal to rounding: the naive kernel builds the scores in the weights' memory, and the row
/// softmax's vector loop starts where each row's alignment lets it.
bool close(float a, float b) {
  return std::abs(a - b) <= 1e-6f * (1 + std::abs(b));
}
bool all_close(const float* a, const float* b, Index n) {
  for (Index i = 0; i < n; ++i) {
    if (!close(a[i], b[i]))
      return false;
  }
  return true;
}

}  // namespace

TEST_CASE("strided log-sum-exp and weights views hold the contiguous results", "[outputs]") {
  // B 2, Hq 4, Hkv 2, Lq 5, Lk 7, D 8, Dv 3; naive (weights) and flash (log-sum-exp only).
  const attn::Tensor<float, 4> q = filled(2, 4, 5, 8, 1u), k = filled(2, 2, 7, 8, 2u),
                               v = filled(2, 2, 7, 3, 3u);
  for (const attn::Algorithm algorithm : {attn::Algorithm::naive, attn::Algorithm::flash}) {
    INFO(attn::algorithm_name(algorithm));
    attn::AttentionOptions<float> options;
    options.algorithm = algorithm;
    options.causal = attn::Causal::bottom_right;
    const bool naive = algorithm == attn::Algorithm::naive;
    const auto expected = attn::scaled_dot_product_attention(
        q, k, v, options, naive ? Return::logsumexp | Return::weights : Return::logsumexp);
    // log-sum-exp (B, H, L) with padded strides: batch stride 4 * 6 + 2, head stride 6.
    std::vector<float> lse(52, sentinel);  // 2 batches of 26
    const attn::RowsView<float> lse_view{lse.data(), 2, 4, 5, 26, 6, nullptr};
    // weights in (B, Lq, Hq, Lk) memory, seen as (B, Hq, Lq, Lk).
    std::vector<float> weights(280, sentinel);  // (2, 5, 4, 7)
    attn::Tensor<float, 4> out(2, 4, 5, 3);
    attn::AttentionOutputViews<float> outputs(attn::bhld_view(out), lse_view);
    if (naive)
      outputs.weights = attn::blhd_view(weights.data(), 2, 5, 4, 7);
    attn::scaled_dot_product_attention_into<float>(attn::bhld_view(q), attn::bhld_view(k),
                                                   attn::bhld_view(v), outputs, options);
    // Flash writes the log-sum-exp beside its work: bitwise the same. Naive scores in place.
    CHECK((naive ? all_close(out.data(), expected.out.data(), out.size())
                 : same_bits(out.data(), expected.out.data(), out.size())));
    for (Index b = 0; b < 2; ++b) {
      for (Index h = 0; h < 4; ++h) {
        for (Index i = 0; i < 6; ++i) {  // row 5 of each head is the padding
          const float got = lse[static_cast<std::size_t>(b * 26 + h * 6 + i)];
          if (i == 5)
            CHECK(got == sentinel);
          else if (naive)
            CHECK(close(got, expected.logsumexp(b, h, i)));
          else
            CHECK(same_bits(&got, &expected.logsumexp(b, h, i), 1));
        }
        for (Index i = 0; naive && i < 5; ++i) {
          for (Index j = 0; j < 7; ++j) {
            const float got = weights[static_cast<std::size_t>(((b * 5 + i) * 4 + h) * 7 + j)];
            CHECK(close(got, expected.weights(b, h, i, j)));
          }
        }
      }
      CHECK(lse[static_cast<std::size_t>(b * 26 + 24)] == sentinel);  // the batch padding
      CHECK(lse[static_cast<std::size_t>(b * 26 + 25)] == sentinel);
    }
  }
}

TEST_CASE("the value forms compute what their Return set names", "[outputs]") {
  const attn::Tensor<float, 4> q = filled(1, 2, 3, 4, 4u), k = filled(1, 2, 6, 4, 5u),
                               v = filled(1, 2, 6, 2, 6u);
  const attn::Tensor<float, 4> plain = attn::scaled_dot_product_attention(q, k, v);
  const auto lse_only = attn::scaled_dot_product_attention(q, k, v, {}, Return::logsumexp);
  CHECK(same_bits(lse_only.out.data(), plain.data(), plain.size()));
  CHECK(lse_only.logsumexp.size() == 6);
  CHECK(lse_only.weights.size() == 0);
  const auto both =
      attn::scaled_dot_product_attention(q, k, v, {}, Return::weights | Return::logsumexp);
  CHECK(both.weights.dimensions() == std::array<Index, 4>{1, 2, 3, 6});
  // Every weight row sums to 1 and its log-sum-exp is that of the scaled scores.
  for (Index h = 0; h < 2; ++h) {
    for (Index i = 0; i < 3; ++i) {
      double sum = 0, exp_sum = 0;
      for (Index j = 0; j < 6; ++j) {
        sum += both.weights(0, h, i, j);
        double score = 0;
        for (Index d = 0; d < 4; ++d)
          score += double(q(0, h, i, d)) * double(k(0, h, j, d));
        exp_sum += std::exp(score / 2.0);  // scale 1 / sqrt(4)
      }
      CHECK(sum == Approx(1.0).epsilon(1e-6));
      CHECK(both.logsumexp(0, h, i) == Approx(std::log(exp_sum)).epsilon(1e-6));
    }
  }
  // One head: the same numbers as the batched form.
  const attn::Matrix<float> qm = Eigen::Map<const attn::Matrix<float>>(q.data(), 3, 4);
  const attn::Matrix<float> km = Eigen::Map<const attn::Matrix<float>>(k.data(), 6, 4);
  const attn::Matrix<float> vm = Eigen::Map<const attn::Matrix<float>>(v.data(), 6, 2);
  const auto head = attn::scaled_dot_product_attention(qm, km, vm, {}, Return::weights);
  CHECK(all_close(head.out.data(), plain.data(), 6));
  CHECK(all_close(head.weights.data(), both.weights.data(), 18));
  CHECK(head.logsumexp.size() == 0);

  // The backward's optional gradients only on request.
  attn::AttentionOptions<float> options;
  const attn::Tensor<float, 4> bias = filled(1, 1, 3, 6, 7u);
  options.bias = bias;
  options.sinks = {0.5f, -0.25f};
  const auto forward = attn::scaled_dot_product_attention(q, k, v, options, Return::logsumexp);
  const attn::Tensor<float, 4> dout = filled(1, 2, 3, 2, 8u);
  const auto inputs_only = attn::scaled_dot_product_attention_backward(
      q, k, v, forward.out, forward.logsumexp, dout, options);
  CHECK(inputs_only.dbias.size() == 0);
  CHECK(inputs_only.dsinks.empty());
  const auto all = attn::scaled_dot_product_attention_backward(
      q, k, v, forward.out, forward.logsumexp, dout, options, Return::dbias | Return::dsinks);
  CHECK(same_bits(all.dq.data(), inputs_only.dq.data(), all.dq.size()));
  CHECK(all.dbias.dimensions() == std::array<Index, 4>{1, 1, 3, 6});
  CHECK(all.dsinks.size() == 2);

  // A strided dbias (rows padded to 8) holds the same bits as the contiguous one.
  const auto count = [](const attn::Tensor<float, 4>& t) {
    return static_cast<std::size_t>(t.size());
  };
  std::vector<float> padded(24, sentinel),  // (3, 8)
      dq(count(q)), dk(count(k)), dv(count(v));
  attn::AttentionGradientViews<float> grads{attn::bhld_view(dq.data(), 1, 2, 3, 4),
                                            attn::bhld_view(dk.data(), 1, 2, 6, 4),
                                            attn::bhld_view(dv.data(), 1, 2, 6, 2)};
  grads.dbias = attn::HeadsView<float>{padded.data(), 1, 1, 3, 6, 24, 24, 8, nullptr};
  attn::scaled_dot_product_attention_backward_into<float>(
      attn::bhld_view(q), attn::bhld_view(k), attn::bhld_view(v), attn::bhld_view(forward.out),
      attn::bhl_view(forward.logsumexp), attn::bhld_view(dout), grads, options);
  for (Index i = 0; i < 3; ++i) {
    CHECK(same_bits(&padded[static_cast<std::size_t>(i * 8)], &all.dbias(0, 0, i, 0), 6));
    CHECK(padded[static_cast<std::size_t>(i * 8 + 6)] == sentinel);
    CHECK(padded[static_cast<std::size_t>(i * 8 + 7)] == sentinel);
  }
}

TEST_CASE("optional output views are checked by name before anything is written",
          "[outputs][errors]") {
  const attn::Tensor<float, 4> q = filled(1, 2, 3, 4, 9u), k = filled(1, 1, 5, 4, 10u),
                               v = filled(1, 1, 5, 2, 11u);
  const std::string prefix = "scaled_dot_product_attention: ";
  attn::Tensor<float, 4> out(1, 2, 3, 2);
  out.setConstant(sentinel);
  std::vector<float> lse(6, sentinel), weights(30, sentinel);
  const auto call = [&](const attn::AttentionOutputViews<float>& outputs,
                        const attn::AttentionOptions<float>& options = {}) {
    attn::scaled_dot_product_attention_into<float>(attn::bhld_view(q), attn::bhld_view(k),
                                                   attn::bhld_view(v), outputs, options);
  };
  const auto untouched = [&] {
    for (const float x : lse)
      REQUIRE(x == sentinel);
    for (const float x : weights)
      REQUIRE(x == sentinel);
    for (Index n = 0; n < out.size(); ++n)
      REQUIRE(out.data()[n] == sentinel);
  };
  const attn::HeadsView<float> o = attn::bhld_view(out);
  REQUIRE_THROWS_WITH(call({o, attn::bhl_view(lse.data(), 1, 2, 2)}),
                      prefix + "logsumexp is [1, 2, 2] but must be [1, 2, 3] (B, Hq, Lq)");
  REQUIRE_THROWS_WITH(call({o, attn::bhl_view<float>(nullptr, 1, 2, 3)}),
                      prefix + "logsumexp has no data");
  REQUIRE_THROWS_WITH(call({o, std::nullopt, attn::bhld_view(weights.data(), 1, 2, 3, 4)}),
                      prefix + "weights is [1, 2, 3, 4] but must be [1, 2, 3, 5] (B, Hq, Lq, Lk)");
  REQUIRE_THROWS_WITH(call({o, attn::bhl_view(out.data(), 1, 2, 3)}),
                      prefix +
                          "logsumexp overlaps out: the outputs must share no element with the "
                          "inputs or each other");
  REQUIRE_THROWS_WITH(call({o, attn::bhl_view(const_cast<float*>(k.data()), 1, 2, 3)}),
                      prefix +
                          "logsumexp overlaps k: the outputs must share no element with the "
                          "inputs or each other");
  REQUIRE_THROWS_WITH(call({o, attn::bhl_view(weights.data() + 3, 1, 2, 3),
                            attn::bhld_view(weights.data(), 1, 2, 3, 5)}),
                      prefix +
                          "logsumexp overlaps weights: the outputs must share no element with the "
                          "inputs or each other");
  attn::AttentionOptions<float> flash;
  flash.algorithm = attn::Algorithm::flash;
  REQUIRE_THROWS_WITH(call({o, std::nullopt, attn::bhld_view(weights.data(), 1, 2, 3, 5)}, flash),
                      Catch::Contains("weights were requested with Algorithm::flash"));
  // A packed log-sum-exp with padded q and out.
  const std::vector<Index> cu{0, 3};
  REQUIRE_THROWS_WITH(call({o, attn::packed_view(attn::bhl_view(lse.data(), 1, 2, 3), cu)}),
                      prefix +
                          "logsumexp is a packed view but q is not: pass packed views "
                          "(packed_view()) for all tensors or for none");
  untouched();

  // The value forms refuse the other direction's results.
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(q, k, v, {}, Return::dbias),
                      prefix +
                          "Return::dbias and Return::dsinks are gradients: ask "
                          "scaled_dot_product_attention_backward for them");
  const auto forward = attn::scaled_dot_product_attention(q, k, v, {}, Return::logsumexp);
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention_backward(q, k, v, forward.out, forward.logsumexp,
                                                  forward.out, {}, Return::weights),
      "scaled_dot_product_attention_backward: Return::logsumexp and Return::weights are forward "
      "results: ask scaled_dot_product_attention for them");
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_backward(
                          q, k, v, forward.out, forward.logsumexp, forward.out, {}, Return::dsinks),
                      "scaled_dot_product_attention_backward: Return::dsinks but options.sinks is "
                      "not given");
}

TEST_CASE("optional gradient views are checked by name", "[outputs][errors]") {
  const attn::Tensor<float, 4> q = filled(1, 2, 3, 4, 12u), k = filled(1, 1, 5, 4, 13u),
                               v = filled(1, 1, 5, 2, 14u), bias = filled(1, 2, 1, 5, 15u);
  attn::AttentionOptions<float> options;
  options.bias = bias;
  options.sinks = {0.0f, 1.0f};
  const auto forward = attn::scaled_dot_product_attention(q, k, v, options, Return::logsumexp);
  attn::Tensor<float, 4> dq(1, 2, 3, 4), dk(1, 1, 5, 4), dv(1, 1, 5, 2);
  std::vector<float> dbias(2 * 5 + 1, sentinel), dsinks(3, sentinel);
  const std::string prefix = "scaled_dot_product_attention_backward: ";
  const auto call = [&](const attn::AttentionGradientViews<float>& grads) {
    attn::scaled_dot_product_attention_backward_into<float>(
        attn::bhld_view(q), attn::bhld_view(k), attn::bhld_view(v), attn::bhld_view(forward.out),
        attn::bhl_view(forward.logsumexp), attn::bhld_view(forward.out), grads, options);
  };
  const attn::AttentionGradientViews<float> base{attn::bhld_view(dq), attn::bhld_view(dk),
                                                 attn::bhld_view(dv)};
  auto grads = base;
  grads.dbias = attn::bhld_view(dbias.data(), 1, 2, 5, 1);
  REQUIRE_THROWS_WITH(call(grads), prefix +
                                       "dbias is [1, 2, 5, 1] but must be [1, 2, 1, 5] "
                                       "(options.bias's dims)");
  grads = base;
  grads.dsinks.emplace(dsinks.data(), 3);
  REQUIRE_THROWS_WITH(call(grads), prefix + "dsinks has 3 entries but must have Hq = 2");
  grads = base;
  grads.dbias = attn::bhld_view(const_cast<float*>(q.data()), 1, 2, 1, 5);
  REQUIRE_THROWS_WITH(call(grads), prefix +
                                       "dbias overlaps another argument: the gradients must "
                                       "share no element with the inputs or each other");
  grads = base;
  grads.dbias = attn::bhld_view(dbias.data(), 1, 2, 1, 5);
  grads.dsinks.emplace(dbias.data() + 9, 2);
  REQUIRE_THROWS_WITH(call(grads), prefix +
                                       "dbias overlaps another argument: the gradients must "
                                       "share no element with the inputs or each other");
  grads = base;
  grads.dsinks.emplace(dq.data(), 2);
  REQUIRE_THROWS_WITH(call(grads), prefix +
                                       "dsinks overlaps another argument: the gradients must "
                                       "share no element with the inputs or each other");
  for (const float x : dbias)
    REQUIRE(x == sentinel);
  for (const float x : dsinks)
    REQUIRE(x == sentinel);
}

TEST_CASE("packed_view of per-row values checks its tokens and offsets", "[outputs][errors]") {
  std::vector<float> lse(10);  // (2, 5)
  const std::vector<Index> cu{0, 2, 5}, bad{0, 4, 3};
  const attn::RowsView<float> packed = attn::packed_view(attn::bhl_view(lse.data(), 1, 2, 5), cu);
  CHECK(packed.batch == 2);
  CHECK(packed.length == 3);
  CHECK(packed.head_stride == 5);
  REQUIRE_THROWS_WITH(attn::packed_view(attn::bhl_view(lse.data(), 2, 1, 5), cu),
                      "packed_view: tokens is [2, 1, 5]: it must be the (1, H, T) rows of all "
                      "tokens (e.g. bhl_view(data, 1, H, T))");
  REQUIRE_THROWS_WITH(attn::packed_view(packed, cu),
                      "packed_view: tokens is [2, 2, 3], already packed: it must be the (1, H, T) "
                      "rows of all tokens (e.g. bhl_view(data, 1, H, T))");
  REQUIRE_THROWS_WITH(attn::packed_view(attn::bhl_view(lse.data(), 1, 2, 5), bad),
                      Catch::Contains("offsets must not decrease (entry 2)"));
}

TEST_CASE("KVCache::attend_into fills the optional log-sum-exp", "[outputs]") {
  attn::KVCache<float> cache(1, 1, 4, 2, 8);
  const attn::Tensor<float, 4> k = filled(1, 1, 5, 4, 16u), v = filled(1, 1, 5, 2, 17u),
                               q = filled(1, 2, 1, 4, 18u);
  cache.append(k, v);
  attn::Tensor<float, 4> out(1, 2, 1, 2);
  attn::Tensor<float, 3> lse(1, 2, 1);
  cache.attend_into(attn::bhld_view(q), {attn::bhld_view(out), attn::bhl_view(lse)});
  attn::AttentionOptions<float> causal;
  causal.causal = attn::Causal::bottom_right;
  const auto expected = attn::scaled_dot_product_attention(q, k, v, causal, Return::logsumexp);
  CHECK(same_bits(out.data(), expected.out.data(), out.size()));
  CHECK(same_bits(lse.data(), expected.logsumexp.data(), lse.size()));
}
