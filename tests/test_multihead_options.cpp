// Tests of MultiHeadForwardOptions::attention (attn/multihead/arguments.hpp): the attention's
// own options (window, ALiBi, softcap, learned sinks, mask_mod, scale, dropout) applied
// through MultiHeadAttention. The forward against the module written out in long double
// (projections, then tests/support/reference.hpp's attention, then out_proj; no attn code),
// the backward (and dsinks) against finite differences of the module's own double forward,
// and every option the module refuses.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <attn/multihead.hpp>

#include "support/reference.hpp"

using attn::Index;
namespace ref = attn_test::reference;

namespace {

constexpr Index kBatch = 2, kLength = 7, kEmbed = 16, kHeads = 4, kKvHeads = 2;
constexpr Index kDim = kEmbed / kHeads, kKvWidth = kKvHeads * kDim;

attn::MultiHeadAttentionConfig grouped_config() {
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = kEmbed;
  config.num_heads = kHeads;
  config.num_kv_heads = kKvHeads;
  config.seed = 9;
  return config;
}

/// A module with non-zero biases, and its input x (B, L, E).
struct Setup {
  attn::MultiHeadAttention<double> mha{grouped_config()};
  attn::StateDict<double> state;
  attn::Tensor<double, 3> x{kBatch, kLength, kEmbed};
  attn::Tensor<bool, 2> key_padding{kBatch, kLength};  // TRUE = ignore

  Setup() {
    std::mt19937_64 engine(21);
    std::normal_distribution<double> normal;
    for (Index i = 0; i < x.size(); ++i)
      x.data()[i] = normal(engine);
    state = mha.state_dict();
    for (auto& [name, t] : state) {
      for (double& w : t.data)
        w += 0.1 * normal(engine);
    }
    mha.load_state_dict(state);
    key_padding.setConstant(false);
    key_padding(1, kLength - 1) = true;  // sequence 1 ignores its last key
  }
};

/// The options under test: a causal window, ALiBi, a softcap, learned sinks, a mask_mod
/// hiding key 2 from head 1, a scale, on top of key_padding_mask.
attn::MultiHeadForwardOptions<double> rich_options(const Setup& s) {
  attn::MultiHeadForwardOptions<double> options;
  options.key_padding_mask = s.key_padding;
  attn::AttentionOptions<double>& a = options.attention;
  a.causal = attn::Causal::bottom_right;
  a.window = {3, -1};
  a.alibi_slopes = {0.5, 0.25, 0.125, 0.0625};
  a.softcap = 4.0;
  a.sinks = {0.3, -0.7, 1.1, 0.0};
  a.mask_mod = attn::MaskMod([](Index, Index h, Index, Index j) { return !(h == 1 && j == 2); });
  a.scale = 0.4;
  return options;
}

/// y = x W^T + b for one (out, in) torch weight block, in long double: (B*L, out).
std::vector<long double> project(const attn::Tensor<double, 3>& x,
                                 const attn::StateTensor<double>& weight,  // (rows, E)
                                 const attn::StateTensor<double>& bias, Index first, Index out) {
  const Index tokens = kBatch * kLength, in = kEmbed;
  std::vector<long double> y(static_cast<std::size_t>(tokens * out));
  for (Index t = 0; t < tokens; ++t) {
    for (Index o = 0; o < out; ++o) {
      long double sum = bias.data[static_cast<std::size_t>(first + o)];
      for (Index i = 0; i < in; ++i) {
        sum += static_cast<long double>(x.data()[t * in + i]) *
               weight.data[static_cast<std::size_t>((first + o) * in + i)];
      }
      y[static_cast<std::size_t>(t * out + o)] = sum;
    }
  }
  return y;
}

/// (B*L, H*D) token rows -> (B, H, L, D) heads.
std::vector<long double> split(const std::vector<long double>& rows, Index heads) {
  std::vector<long double> out(rows.size());
  for (Index b = 0; b < kBatch; ++b)
    for (Index h = 0; h < heads; ++h)
      for (Index l = 0; l < kLength; ++l)
        for (Index d = 0; d < kDim; ++d) {
          out[static_cast<std::size_t>(((b * heads + h) * kLength + l) * kDim + d)] =
              rows[static_cast<std::size_t>((b * kLength + l) * heads * kDim + h * kDim + d)];
        }
  return out;
}

/// MultiHeadAttention's forward with rich_options(), written out in long double.
std::vector<long double> reference_forward(const Setup& s) {
  const attn::StateTensor<double>& w = s.state.at("in_proj_weight");
  const attn::StateTensor<double>& bias = s.state.at("in_proj_bias");
  const std::vector<long double> q = split(project(s.x, w, bias, 0, kEmbed), kHeads);
  const std::vector<long double> k = split(project(s.x, w, bias, kEmbed, kKvWidth), kKvHeads);
  const std::vector<long double> v =
      split(project(s.x, w, bias, kEmbed + kKvWidth, kKvWidth), kKvHeads);
  ref::Problem p;
  p.batch = kBatch;
  p.q_heads = kHeads;
  p.kv_heads = kKvHeads;
  p.q_length = p.k_length = kLength;
  p.dim = p.value_dim = kDim;
  p.scale = 0.4L;
  p.causal = ref::Causal::bottom_right;
  p.window_left = 3;
  p.alibi_slopes = {0.5L, 0.25L, 0.125L, 0.0625L};
  p.softcap = 4.0L;
  p.sinks = {0.3L, -0.7L, 1.1L, 0.0L};
  p.mask_mod = [](Index, Index h, Index, Index j) { return !(h == 1 && j == 2); };
  p.keep.dims = {kBatch, 1, 1, kLength};
  for (Index b = 0; b < kBatch; ++b)
    for (Index j = 0; j < kLength; ++j)
      p.keep.data.push_back(!s.key_padding(b, j));
  const std::vector<long double> heads = ref::attention<long double>(p, q, k, v).out;
  // (B, H, L, D) -> (B*L, E), then out_proj.
  const attn::StateTensor<double>& wo = s.state.at("out_proj.weight");
  const attn::StateTensor<double>& bo = s.state.at("out_proj.bias");
  std::vector<long double> y(static_cast<std::size_t>(kBatch * kLength * kEmbed));
  for (Index b = 0; b < kBatch; ++b)
    for (Index l = 0; l < kLength; ++l)
      for (Index o = 0; o < kEmbed; ++o) {
        long double sum = bo.data[static_cast<std::size_t>(o)];
        for (Index h = 0; h < kHeads; ++h)
          for (Index d = 0; d < kDim; ++d) {
            sum += heads[static_cast<std::size_t>(((b * kHeads + h) * kLength + l) * kDim + d)] *
                   wo.data[static_cast<std::size_t>(o * kEmbed + h * kDim + d)];
          }
        y[static_cast<std::size_t>((b * kLength + l) * kEmbed + o)] = sum;
      }
  return y;
}

}  // namespace

TEST_CASE("MultiHeadForwardOptions::attention applies the attention's own options",
          "[multihead_options]") {
  const Setup s;
  const std::vector<long double> want = reference_forward(s);
  attn::MultiHeadForwardOptions<double> options = rich_options(s);
  for (const attn::Algorithm algorithm : {attn::Algorithm::naive, attn::Algorithm::flash}) {
    INFO("algorithm " << attn::algorithm_name(algorithm));
    options.attention.algorithm = algorithm;
    const attn::Tensor<double, 3> y = s.mha.forward(s.x, options).output;
    REQUIRE(static_cast<std::size_t>(y.size()) == want.size());
    double worst = 0;
    for (std::size_t i = 0; i < want.size(); ++i)
      worst = std::max(worst, std::abs(y.data()[i] - static_cast<double>(want[i])));
    CHECK(worst <= 1e-12);
  }
  // forward_train returns the same output.
  options.attention.algorithm = attn::Algorithm::automatic;
  const attn::Tensor<double, 3> y = s.mha.forward(s.x, options).output;
  const attn::Tensor<double, 3> trained = s.mha.forward_train(s.x, options).output;
  for (Index i = 0; i < y.size(); ++i)
    REQUIRE(trained.data()[i] == y.data()[i]);
  // Without the options the result differs (the test can fail).
  attn::MultiHeadForwardOptions<double> plain;
  plain.key_padding_mask = s.key_padding;
  const attn::Tensor<double, 3> other = s.mha.forward(s.x, plain).output;
  double change = 0;
  for (Index i = 0; i < y.size(); ++i)
    change = std::max(change, std::abs(other.data()[i] - y.data()[i]));
  CHECK(change > 1e-3);
}

TEST_CASE("MultiHeadAttention::backward differentiates options.attention, sinks included",
          "[multihead_options]") {
  const Setup s;
  attn::MultiHeadForwardOptions<double> options = rich_options(s);
  options.attention.dropout_p = 0.2;
  options.attention.dropout_seed = 17;
  std::mt19937_64 engine(4);
  std::normal_distribution<double> normal;
  attn::Tensor<double, 3> dy(kBatch, kLength, kEmbed);
  for (Index i = 0; i < dy.size(); ++i)
    dy.data()[i] = normal(engine);
  const auto loss = [&](const attn::MultiHeadAttention<double>& m,
                        const attn::MultiHeadForwardOptions<double>& o,
                        const attn::Tensor<double, 3>& in) {
    const attn::Tensor<double, 3> y = m.forward(in, o).output;
    double sum = 0;
    for (Index i = 0; i < y.size(); ++i)
      sum += y.data()[i] * dy.data()[i];
    return sum;
  };
  const auto train = s.mha.forward_train(s.x, options);
  const attn::MultiHeadAttentionGradients<double> g = s.mha.backward(train.context, dy);
  const double h = 1e-6;
  for (Index i = 0; i < s.x.size(); i += 5) {
    attn::Tensor<double, 3> xp = s.x, xm = s.x;
    xp.data()[i] += h;
    xm.data()[i] -= h;
    const double fd = (loss(s.mha, options, xp) - loss(s.mha, options, xm)) / (2 * h);
    CHECK(std::abs(fd - g.dquery.data()[i]) <= 1e-7 * (1 + std::abs(fd)));
  }
  for (const std::string name : {"in_proj_weight", "out_proj.weight", "in_proj_bias"}) {
    INFO("parameter " << name);
    for (std::size_t i = 0; i < s.state.at(name).data.size(); i += 7) {
      attn::StateDict<double> sp = s.state, sm = s.state;
      sp[name].data[i] += h;
      sm[name].data[i] -= h;
      const auto module = [&](const attn::StateDict<double>& st) {
        return attn::MultiHeadAttention<double>::from_state_dict(grouped_config(), st);
      };
      const double fd = (loss(module(sp), options, s.x) - loss(module(sm), options, s.x)) / (2 * h);
      CHECK(std::abs(fd - g.parameters.at(name).data[i]) <= 1e-7 * (1 + std::abs(fd)));
    }
  }
  REQUIRE(g.dsinks.size() == 4);
  for (std::size_t head = 0; head < 4; ++head) {
    attn::MultiHeadForwardOptions<double> op = options, om = options;
    op.attention.sinks[head] += h;
    om.attention.sinks[head] -= h;
    const double fd = (loss(s.mha, op, s.x) - loss(s.mha, om, s.x)) / (2 * h);
    CHECK(std::abs(fd - g.dsinks[head]) <= 1e-7 * (1 + std::abs(fd)));
    CHECK(std::abs(fd) > 1e-6);  // each sink matters
  }
  // accumulate adds dsinks like the parameters; a mismatched grads.dsinks is refused.
  attn::MultiHeadAttentionGradients<double> sum = g;
  s.mha.backward_into(train.context, dy, sum, true);
  for (std::size_t head = 0; head < 4; ++head)
    CHECK(sum.dsinks[head] == Approx(2 * g.dsinks[head]).epsilon(1e-14));
  attn::MultiHeadAttentionGradients<double> wrong = g;
  wrong.dsinks.pop_back();
  const attn::StateDict<double> before = wrong.parameters;
  REQUIRE_THROWS_WITH(s.mha.backward_into(train.context, dy, wrong, true),
                      "MultiHeadAttention::backward_into: accumulate is true but grads.dsinks "
                      "has 3 entries and the forward had 4 sinks");
  CHECK(wrong.parameters.at("in_proj_weight").data == before.at("in_proj_weight").data);
  CHECK(wrong.dsinks.size() == 3);
}

TEST_CASE("MultiHeadForwardOptions::attention refuses what the module's masks say",
          "[multihead_options]") {
  const Setup s;
  const bool keep[1] = {true};
  const double bias[1] = {0.0};
  const std::string forward = "MultiHeadAttention::forward: options.attention.";
  const auto refused = [&](const auto& set, const std::string& message) {
    attn::MultiHeadForwardOptions<double> options;
    set(options.attention);
    INFO(message);
    CHECK_THROWS_WITH(s.mha.forward(s.x, options), forward + message);
  };
  const char* masks = "give key_padding_mask, attn_mask or float_attn_mask instead";
  refused(
      [&](auto& a) {
        a.keep_mask = attn::Broadcast<bool>(keep, {1, 1, 1, 1});
      },
      std::string("keep_mask is set: ") + masks);
  refused(
      [&](auto& a) {
        a.bias = attn::Broadcast<double>(bias, {1, 1, 1, 1});
      },
      std::string("bias is set: ") + masks);
  refused(
      [](auto& a) {
        a.key_lengths = {7, 5};
      },
      "key_lengths is set: give key_padding_mask instead");
  refused(
      [](auto& a) {
        a.query_lengths = {7, 5};
      },
      "query_lengths is set: the module attends every query row (mask the loss instead)");
  refused([](auto& a) { a.dropout_p = 1.0; }, "dropout_p is 1: must lie in [0, 1)");
  refused([](auto& a) { a.dropout_p = -0.5; }, "dropout_p is -0.5: must lie in [0, 1)");

  attn::MultiHeadForwardOptions<double> both;
  both.is_causal = true;
  both.attention.causal = attn::Causal::top_left;
  CHECK_THROWS_WITH(s.mha.forward(s.x, both),
                    forward + "causal is set: is_causal is set too: give one of them");

  attn::MultiHeadForwardOptions<double> mod;
  mod.attention.score_mod =
      attn::ScoreMod<double>([](double x, Index, Index, Index, Index) { return x; });
  CHECK_NOTHROW(s.mha.forward(s.x, mod));  // forward only
  CHECK_THROWS_WITH(s.mha.forward_train(s.x, mod),
                    "MultiHeadAttention::forward_train: options.attention.score_mod is set: a "
                    "score_mod is forward only (no backward)");

  // With appended keys, the options that see key positions.
  attn::MultiHeadAttentionConfig config = grouped_config();
  config.add_zero_attn = true;
  const attn::MultiHeadAttention<double> appended(config);
  const std::string why =
      " is set: add_bias_kv or add_zero_attn appends keys it would see as positions (use "
      "attn_mask)";
  const auto refused_appended = [&](const auto& set, const std::string& name) {
    attn::MultiHeadForwardOptions<double> options;
    set(options.attention);
    INFO(name);
    CHECK_THROWS_WITH(appended.forward(s.x, options), forward + name + why);
  };
  refused_appended([](auto& a) { a.causal = attn::Causal::bottom_right; }, "causal");
  refused_appended([](auto& a) { a.window = {2, -1}; }, "window");
  refused_appended([](auto& a) { a.sink_tokens = 1; }, "sink_tokens");
  refused_appended([](auto& a) { a.alibi_slopes = {1, 1, 1, 1}; }, "alibi_slopes");
  refused_appended([&](auto& a) { a.score_mod = mod.attention.score_mod; }, "score_mod");
  refused_appended(
      [](auto& a) { a.mask_mod = attn::MaskMod([](Index, Index, Index, Index) { return true; }); },
      "mask_mod");
  refused_appended(
      [](auto& a) {
        a.block_mask =
            attn::BlockMask(attn::MaskMod([](Index, Index, Index, Index) { return true; }), kBatch,
                            kHeads, kLength, kLength + 1);
      },
      "block_mask");
  // What does not see positions still works with appended keys: softcap, sinks, scale.
  attn::MultiHeadForwardOptions<double> fine;
  fine.attention.softcap = 3.0;
  fine.attention.sinks = {0, 0, 0, 0};
  fine.attention.scale = 0.3;
  CHECK_NOTHROW(appended.forward(s.x, fine));
}
