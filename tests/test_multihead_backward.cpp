// Tests of MultiHeadAttention::forward_train / backward (attn/multihead.hpp) and of
// RotaryEmbedding::apply_backward (attn/rope.hpp): torch autograd in float64
// (tests/reference/generate_mha_backward.py: nn.MultiheadAttention itself, or the explicit
// formula in torch for grouped-query and rotary cases, each cross-checked there by finite
// differences), double within 1e-10 and float within 1e-4 of each gradient's largest entry;
// finite differences of the module's own double forward with dropout; the adjoint identity
// of the rotation; every error message.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <attn/multihead.hpp>
#include <attn/rope.hpp>

#include "support/fixtures.hpp"

using attn::Index;
using attn_test::json;

namespace {

/// The largest |a - b| over the largest |b| (or 1 when b is tiny).
template <class A>
double relative_error(const A* a, const std::vector<double>& b) {
  double worst = 0, scale = 1e-300;
  for (const double y : b)
    scale = std::max(scale, std::abs(y));
  for (std::size_t i = 0; i < b.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
  return worst / std::max(scale, 1.0);
}

template <class T>
struct BackwardCase {
  std::string name;
  attn::MultiHeadAttentionConfig config;
  bool self = false;
  attn::Tensor<T, 3> query, key, value, doutput;
  attn::Tensor<bool, 2> kpm, mask2;
  attn::Tensor<bool, 3> mask3;
  attn::Tensor<T, 2> fmask2;
  attn::MultiHeadForwardOptions<T> options;
  attn::StateDict<T> state;
  const json* c;

  explicit BackwardCase(const json& j) : name(j.at("name").get<std::string>()), c(&j) {
    const json& cfg = j.at("config");
    config.embed_dim = cfg.at("embed_dim").get<Index>();
    config.num_heads = cfg.at("num_heads").get<Index>();
    config.num_kv_heads = cfg.at("num_kv_heads").get<Index>();
    config.kdim = cfg.at("kdim").get<Index>();
    config.vdim = cfg.at("vdim").get<Index>();
    config.bias = cfg.at("bias").get<bool>();
    config.add_bias_kv = cfg.at("add_bias_kv").get<bool>();
    config.add_zero_attn = cfg.at("add_zero_attn").get<bool>();
    if (!cfg.at("rotary").is_null()) {
      attn::RopeConfig rope;
      rope.base = cfg.at("rotary").at("base").get<double>();
      rope.pairing = cfg.at("rotary").at("pairing").get<std::string>() == "interleaved"
                         ? attn::RopePairing::interleaved
                         : attn::RopePairing::half_split;
      rope.max_positions = 16;
      config.rotary = rope;
    }
    self = j.at("self").get<bool>();
    query = attn_test::tensor<T, 3>(j.at("query"));
    if (!self) {
      key = attn_test::tensor<T, 3>(j.at("key"));
      value = attn_test::tensor<T, 3>(j.at("value"));
    }
    doutput = attn_test::tensor<T, 3>(j.at("d_output"));
    if (!j.at("key_padding_mask").is_null()) {
      kpm = attn_test::tensor<bool, 2>(j.at("key_padding_mask"));
      options.key_padding_mask = kpm;
    }
    const json& m = j.at("attn_mask");
    if (!m.is_null()) {
      const bool is_bool = m.contains("dtype");
      if (is_bool && attn_test::shape_of(m).size() == 2) {
        mask2 = attn_test::tensor<bool, 2>(m);
        options.attn_mask = mask2;
      } else if (is_bool) {
        mask3 = attn_test::tensor<bool, 3>(m);
        options.attn_mask = mask3;
      } else {
        fmask2 = attn_test::tensor<T, 2>(m);
        options.float_attn_mask = fmask2;
      }
    }
    options.is_causal = j.at("is_causal").get<bool>();
    for (const auto& [n, t] : j.at("state_dict").items())
      state[n] = {attn_test::shape_of(t), attn_test::values<T>(t)};
  }
  const attn::Tensor<T, 3>& k() const { return self ? query : key; }
  const attn::Tensor<T, 3>& v() const { return self ? query : value; }
};

template <class T>
constexpr double backward_tolerance() {
  return std::is_same_v<T, float> ? 1e-4 : 1e-10;
}

}  // namespace

TEMPLATE_TEST_CASE("MultiHeadAttention::backward matches torch autograd", "[multihead_backward]",
                   float, double) {
  using T = TestType;
  const double tol = backward_tolerance<T>();
  for (const json& j : ATTN_FIXTURE_CASES("mha_backward.json", "cases", 11)) {
    BackwardCase<T> tc(j);
    INFO("case " << tc.name);
    const attn::MultiHeadAttention<T> mha =
        attn::MultiHeadAttention<T>::from_state_dict(tc.config, tc.state);
    auto train = mha.forward_train(tc.query, tc.k(), tc.v(), tc.options);
    CHECK(relative_error(train.output.data(), attn_test::values_of(j.at("output"))) <= tol);
    // The context owns copies: the caller's masks may change before the backward.
    tc.kpm.setConstant(true);
    tc.mask2.setConstant(true);
    tc.mask3.setConstant(true);
    tc.fmask2.setConstant(T(-1000));
    const attn::MultiHeadAttentionGradients<T> g = mha.backward(train.context, tc.doutput);
    const json& want = j.at("grads");
    CHECK(relative_error(g.dquery.data(), attn_test::values_of(want.at("query"))) <= tol);
    if (tc.self) {
      CHECK(g.dkey.size() == 0);
      CHECK(g.dvalue.size() == 0);
    } else {
      CHECK(relative_error(g.dkey.data(), attn_test::values_of(want.at("key"))) <= tol);
      CHECK(relative_error(g.dvalue.data(), attn_test::values_of(want.at("value"))) <= tol);
    }
    // Exactly state_dict()'s names and shapes, each equal to torch's .grad.
    const attn::StateDict<T> names = mha.state_dict();
    REQUIRE(g.parameters.size() == names.size());
    for (const auto& [n, t] : names) {
      INFO("parameter " << n);
      REQUIRE(g.parameters.count(n) == 1);
      const attn::StateTensor<T>& grad = g.parameters.at(n);
      CHECK(grad.shape == t.shape);
      REQUIRE(grad.data.size() == t.data.size());
      CHECK(relative_error(grad.data.data(), attn_test::values_of(want.at(n))) <= tol);
    }
  }
}

TEST_CASE("MultiHeadAttention::backward with dropout agrees with finite differences",
          "[multihead_backward]") {
  using T = double;
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 8;
  config.num_heads = 2;
  config.num_kv_heads = 1;
  config.add_bias_kv = true;
  config.seed = 3;
  attn::MultiHeadAttention<T> mha(config);
  std::mt19937_64 engine(11);
  std::normal_distribution<double> normal;
  attn::Tensor<T, 3> x(2, 5, 8), dy(2, 5, 8);
  for (Index i = 0; i < x.size(); ++i) {
    x.data()[i] = normal(engine);
    dy.data()[i] = normal(engine);
  }
  attn::StateDict<T> state = mha.state_dict();
  for (auto& [n, t] : state) {  // non-zero biases
    for (double& w : t.data)
      w += 0.1 * normal(engine);
  }
  mha.load_state_dict(state);
  attn::MultiHeadForwardOptions<T> options;
  options.is_causal = true;
  options.attention.dropout_p = 0.3;
  options.attention.dropout_seed = 42;
  const auto loss = [&](const attn::MultiHeadAttention<T>& m, const attn::Tensor<T, 3>& in) {
    const attn::Tensor<T, 3> y = m.forward(in, options).output;
    double sum = 0;
    for (Index i = 0; i < y.size(); ++i)
      sum += y.data()[i] * dy.data()[i];
    return sum;
  };
  auto train = mha.forward_train(x, options);
  const attn::Tensor<T, 3> plain = mha.forward(x, options).output;
  for (Index i = 0; i < plain.size(); ++i)
    REQUIRE(train.output.data()[i] == plain.data()[i]);
  const attn::MultiHeadAttentionGradients<T> g = mha.backward(train.context, dy);
  const double h = 1e-6;
  for (Index i = 0; i < x.size(); i += 7) {
    attn::Tensor<T, 3> xp = x, xm = x;
    xp.data()[i] += h;
    xm.data()[i] -= h;
    const double fd = (loss(mha, xp) - loss(mha, xm)) / (2 * h);
    CHECK(std::abs(fd - g.dquery.data()[i]) <= 1e-7 * (1 + std::abs(fd)));
  }
  for (const auto& [n, t] : state) {
    INFO("parameter " << n);
    for (std::size_t i = 0; i < t.data.size(); i += 5) {
      attn::StateDict<T> sp = state, sm = state;
      sp[n].data[i] += h;
      sm[n].data[i] -= h;
      const double fd = (loss(attn::MultiHeadAttention<T>::from_state_dict(config, sp), x) -
                         loss(attn::MultiHeadAttention<T>::from_state_dict(config, sm), x)) /
                        (2 * h);
      CHECK(std::abs(fd - g.parameters.at(n).data[i]) <= 1e-7 * (1 + std::abs(fd)));
    }
  }
}

TEST_CASE("RotaryEmbedding::apply_backward is the transpose of apply",
          "[multihead_backward][rope]") {
  std::mt19937_64 engine(5);
  std::normal_distribution<double> normal;
  for (const auto pairing : {attn::RopePairing::half_split, attn::RopePairing::interleaved}) {
    for (const bool yarn : {false, true}) {
      attn::RopeConfig config;
      config.dim = 8;
      config.rotary_dim = 6;  // features 6, 7 pass through
      config.pairing = pairing;
      config.max_positions = 32;
      if (yarn) {
        config.scaling = attn::RopeScaling::yarn;
        config.factor = 4;
        config.original_max_positions = 8;
      }
      const attn::RotaryEmbedding<double> rope(config);
      attn::Tensor<double, 4> x(2, 3, 5, 8), y(2, 3, 5, 8);
      for (Index i = 0; i < x.size(); ++i) {
        x.data()[i] = normal(engine);
        y.data()[i] = normal(engine);
      }
      const std::vector<Index> offsets{3, 20};
      attn::Tensor<double, 4> rx = x, ry = y;
      rope.apply(rx, offsets);
      rope.apply_backward(ry, offsets);
      // <R x, y> = <x, R^T y>
      double left = 0, right = 0;
      for (Index i = 0; i < x.size(); ++i) {
        left += rx.data()[i] * y.data()[i];
        right += x.data()[i] * ry.data()[i];
      }
      CHECK(std::abs(left - right) <= 1e-12 * (1 + std::abs(left)));
      // R^T R = attention_factor^2 (the identity without YaRN)
      rope.apply_backward(rx, offsets);
      const double f2 = rope.attention_factor() * rope.attention_factor();
      for (Index i = 0; i < x.size(); ++i) {
        const bool rotated = i % 8 < 6;
        CHECK(rx.data()[i] == Approx(x.data()[i] * (rotated ? f2 : 1.0)).margin(1e-13));
      }
      if (!yarn)
        CHECK(f2 == 1.0);
    }
  }
  attn::RopeConfig config;
  config.dim = 4;
  config.max_positions = 4;
  const attn::RotaryEmbedding<double> rope(config);
  attn::Tensor<double, 4> x(1, 1, 3, 4);
  x.setConstant(1.0);
  REQUIRE_THROWS_WITH(rope.apply_backward(x, {2}),
                      "RotaryEmbedding::apply_backward: offsets[0] is 2: the 3 tokens of sequence "
                      "0 of x [1, 1, 3, 4] need positions [2, 5) but the table holds [0, 4)");
  for (Index i = 0; i < x.size(); ++i)
    CHECK(x.data()[i] == 1.0);  // left as it was
  attn::Tensor<double, 4> wrong(1, 1, 3, 6);
  REQUIRE_THROWS_WITH(rope.apply_backward(wrong),
                      "RotaryEmbedding::apply_backward: x is [1, 1, 3, 6] but the table's head "
                      "dim is 4");
}

TEST_CASE("MultiHeadAttention::forward_train and backward validate their inputs",
          "[multihead_backward]") {
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 8;
  config.num_heads = 2;
  const attn::MultiHeadAttention<float> mha(config), other(config);
  attn::Tensor<float, 3> x(2, 3, 8);
  x.setConstant(0.5f);
  attn::MultiHeadForwardOptions<float> options;
  options.need_weights = true;
  REQUIRE_THROWS_WITH(mha.forward_train(x, options),
                      "MultiHeadAttention::forward_train: need_weights must be false: the "
                      "attention weights are not differentiated (call forward() for them)");
  options.need_weights = false;
  options.attention.dropout_p = 1.0;
  REQUIRE_THROWS_WITH(mha.forward_train(x, options),
                      "MultiHeadAttention::forward_train: options.attention.dropout_p is 1: must "
                      "lie in [0, 1)");
  REQUIRE_THROWS_WITH(mha.forward(x, options),
                      "MultiHeadAttention::forward: options.attention.dropout_p is 1: must lie in "
                      "[0, 1)");
  attn::Tensor<float, 3> bad(2, 3, 6);
  REQUIRE_THROWS_WITH(mha.forward_train(bad),
                      Catch::StartsWith("MultiHeadAttention::forward_train: "
                                        "query is [2, 3, 6]"));
  const auto train = mha.forward_train(x);
  REQUIRE_THROWS_WITH(mha.backward(attn::MultiHeadAttentionContext<float>(), x),
                      "MultiHeadAttention::backward: the context is empty: pass the context "
                      "forward_train filled");
  REQUIRE_THROWS_WITH(other.backward(train.context, x),
                      "MultiHeadAttention::backward: the context comes from another module (or "
                      "from this one before it was copied or moved): pass the context of this "
                      "module's forward_train");
  attn::Tensor<float, 3> dy(2, 4, 8);
  REQUIRE_THROWS_WITH(mha.backward(train.context, dy),
                      "MultiHeadAttention::backward: doutput is [2, 4, 8] but the forward's "
                      "output is [2, 3, 8] (B, L, E)");
}

TEST_CASE("MultiHeadAttention::backward: key and value as one tensor, and a reused context",
          "[multihead_backward]") {
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 8;
  config.num_heads = 2;
  config.seed = 9;
  const attn::MultiHeadAttention<double> mha(config);
  std::mt19937_64 engine(2);
  std::normal_distribution<double> normal;
  attn::Tensor<double, 3> q(2, 3, 8), kv(2, 5, 8), dy(2, 3, 8);
  for (attn::Tensor<double, 3>* t : {&q, &kv, &dy}) {
    for (Index i = 0; i < t->size(); ++i)
      t->data()[i] = normal(engine);
  }
  const attn::Tensor<double, 3> kv_copy = kv;
  // One tensor takes the forward's [Wk | Wv] one-GEMM path; a copy takes the separate one.
  const auto one = mha.forward_train(q, kv, kv);
  const auto two = mha.forward_train(q, kv, kv_copy);
  const attn::MultiHeadAttentionGradients<double> g1 = mha.backward(one.context, dy);
  const attn::MultiHeadAttentionGradients<double> g2 = mha.backward(two.context, dy);
  const attn::MultiHeadAttentionGradients<double> again = mha.backward(one.context, dy);
  for (Index i = 0; i < g1.dkey.size(); ++i) {
    CHECK(g1.dkey.data()[i] == Approx(g2.dkey.data()[i]).margin(1e-13));
    CHECK(g1.dvalue.data()[i] == Approx(g2.dvalue.data()[i]).margin(1e-13));
    CHECK(again.dkey.data()[i] == g1.dkey.data()[i]);  // the context is left unchanged
  }
  for (const auto& [name, t] : g1.parameters) {
    for (std::size_t i = 0; i < t.data.size(); ++i) {
      CHECK(t.data[i] == Approx(g2.parameters.at(name).data[i]).margin(1e-13));
      CHECK(again.parameters.at(name).data[i] == t.data[i]);
    }
  }
}

TEST_CASE("MultiHeadAttention::backward_into accumulates like torch's .grad",
          "[multihead_backward]") {
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 8;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.seed = 4;
  const attn::MultiHeadAttention<double> mha(config);
  std::mt19937_64 engine(8);
  std::normal_distribution<double> normal;
  attn::Tensor<double, 3> x(2, 4, 8), dy(2, 4, 8);
  for (Index i = 0; i < x.size(); ++i) {
    x.data()[i] = normal(engine);
    dy.data()[i] = normal(engine);
  }
  attn::MultiHeadForwardOptions<double> options;
  options.is_causal = true;
  const attn::MultiHeadAttentionGradients<double> whole =
      mha.backward(mha.forward_train(x, options).context, dy);
  // The two sequences one call each, the second accumulated: the batch's gradients.
  attn::MultiHeadAttentionGradients<double> parts;
  for (Index b = 0; b < 2; ++b) {
    attn::Tensor<double, 3> xb(1, 4, 8), dyb(1, 4, 8);
    std::copy(x.data() + b * 32, x.data() + (b + 1) * 32, xb.data());
    std::copy(dy.data() + b * 32, dy.data() + (b + 1) * 32, dyb.data());
    mha.backward_into(mha.forward_train(xb, options).context, dyb, parts, b > 0);
    for (Index i = 0; i < 32; ++i)
      CHECK(parts.dquery.data()[i] == Approx(whole.dquery.data()[b * 32 + i]).margin(1e-13));
  }
  REQUIRE(parts.parameters.size() == whole.parameters.size());
  for (const auto& [name, t] : whole.parameters) {
    INFO("parameter " << name);
    for (std::size_t i = 0; i < t.data.size(); ++i)
      CHECK(parts.parameters.at(name).data[i] == Approx(t.data[i]).margin(1e-13));
  }
  attn::MultiHeadAttentionGradients<double> fresh;
  const auto train = mha.forward_train(x, options);
  REQUIRE_THROWS_WITH(mha.backward_into(train.context, dy, fresh, true),
                      "MultiHeadAttention::backward_into: accumulate is true but "
                      "grads.parameters has no [16] \"in_proj_bias\": accumulate into the "
                      "gradients of an earlier call");
  parts.parameters["extra"] = {{1}, {0.0}};
  REQUIRE_THROWS_WITH(mha.backward_into(train.context, dy, parts, true),
                      "MultiHeadAttention::backward_into: accumulate is true but "
                      "grads.parameters has names state_dict() does not have");
}
