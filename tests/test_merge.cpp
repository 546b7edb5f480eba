// merge_attention_states: the states of attention over segments of the keys, merged, against
// one call over all of them and the long double reference; sinks once, in place, empty and
// NaN rows, base-2 conversion, order independence, and every refusal.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/merge.hpp>

#include "support/heads.hpp"
#include "support/reference.hpp"

namespace {

using attn::Index;
using attn_test::Heads;
namespace ref = attn_test::reference;

template <class T>
struct State {
  Heads<T> out;
  std::vector<T> lse;  // (B, H, L)
  State(Index b, Index h, Index l, Index dv)
      : out(b, h, l, dv), lse(static_cast<std::size_t>(b * h * l)) {}
  attn::AttentionState<T> view() const {
    return {out.cview(), attn::bhl_view(static_cast<const T*>(lse.data()), out.b, out.h, out.l)};
  }
  attn::AttentionOutputViews<T> outputs() {
    return {out.view(), attn::bhl_view(lse.data(), out.b, out.h, out.l)};
  }
};

/// Rows [first, last) of every head of x: a strided view of the same memory.
template <class T>
attn::HeadsView<const T> key_rows(const Heads<T>& x, Index first, Index last) {
  attn::HeadsView<const T> view = x.cview();
  view.data += first * view.row_stride;
  view.length = last - first;
  return view;
}

/// The keep-mask (B, 1, Lq, Lk) restricted to keys [first, last).
attn::Tensor<bool, 4> keep_columns(const attn::Tensor<bool, 4>& keep, Index first, Index last) {
  attn::Tensor<bool, 4> part(keep.dimension(0), 1, keep.dimension(2), last - first);
  for (Index b = 0; b < part.dimension(0); ++b)
    for (Index i = 0; i < part.dimension(2); ++i)
      for (Index j = first; j < last; ++j)
        part(b, 0, i, j - first) = keep(b, 0, i, j);
  return part;
}

std::vector<long double> widen(const std::vector<float>& x) {
  return {x.begin(), x.end()};
}
std::vector<long double> widen(const std::vector<double>& x) {
  return {x.begin(), x.end()};
}

}  // namespace

TEMPLATE_TEST_CASE("merging the states of key segments is attention over all the keys", "[merge]",
                   float, double) {
  using T = TestType;
  constexpr Index B = 2, Hq = 4, Hkv = 2, Lq = 3, Lk = 40, D = 8, Dv = 5;
  const T eps = std::numeric_limits<T>::epsilon();
  std::mt19937 rng(17);
  double worst_ratio = 0;  // |merged - single| in units of eps * max|v|
  for (int trial = 0; trial < 40; ++trial) {
    const Heads<T> q = attn_test::random_heads<T>(B, Hq, Lq, D, rng);
    const Heads<T> k = attn_test::random_heads<T>(B, Hkv, Lk, D, rng, 2.0);
    const Heads<T> v = attn_test::random_heads<T>(B, Hkv, Lk, Dv, rng);
    const int parts = 1 + trial % 6;
    std::vector<Index> cuts{0, Lk};  // random, repeated cuts give empty segments
    std::uniform_int_distribution<Index> point(0, Lk);
    for (int c = 1; c < parts; ++c)
      cuts.push_back(point(rng));
    std::sort(cuts.begin(), cuts.end());
    // A keep-mask that hides a whole segment from some rows: its state is empty there.
    attn::Tensor<bool, 4> keep(B, 1, Lq, Lk);
    std::bernoulli_distribution coin(0.8);
    for (Index n = 0; n < keep.size(); ++n)
      keep.data()[n] = coin(rng);
    for (Index j = cuts[1]; j < cuts[2 % cuts.size()]; ++j)
      keep(1, 0, 0, j) = false;
    const bool with_sinks = trial % 2 == 1;
    const std::vector<T> sinks{T(0.5), T(-1), T(2), T(0)};

    attn::AttentionOptions<T> all;
    all.keep_mask = keep;
    if (with_sinks)
      all.sinks = sinks;
    State<T> single(B, Hq, Lq, Dv);
    attn::scaled_dot_product_attention_into(q.cview(), k.cview(), v.cview(), single.outputs(), all);

    std::vector<State<T>> states;
    std::vector<attn::Tensor<bool, 4>> keeps;
    for (std::size_t s = 0; s + 1 < cuts.size(); ++s) {
      states.emplace_back(B, Hq, Lq, Dv);
      if (cuts[s] == cuts[s + 1]) {  // no keys: attention over nothing is (0, -inf)
        std::fill(states.back().out.data.begin(), states.back().out.data.end(), T(0));
        std::fill(states.back().lse.begin(), states.back().lse.end(),
                  -std::numeric_limits<T>::infinity());
        continue;
      }
      keeps.push_back(keep_columns(keep, cuts[s], cuts[s + 1]));
      attn::AttentionOptions<T> part;
      part.keep_mask = keeps.back();
      part.scale = T(1) / std::sqrt(T(D));
      attn::scaled_dot_product_attention_into(q.cview(), key_rows(k, cuts[s], cuts[s + 1]),
                                              key_rows(v, cuts[s], cuts[s + 1]),
                                              states.back().outputs(), part);
    }
    std::vector<attn::AttentionState<T>> views;
    views.reserve(states.size());
    for (const State<T>& s : states)
      views.push_back(s.view());
    State<T> merged(B, Hq, Lq, Dv);
    attn::merge_attention_states(views, merged.outputs(), with_sinks ? sinks : std::vector<T>{});

    // The truth: one long double call over all the keys.
    ref::Problem p;
    p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_length = Lq, p.k_length = Lk, p.dim = D,
    p.value_dim = Dv;
    p.keep.dims = {B, 1, Lq, Lk};
    p.keep.data.assign(keep.data(), keep.data() + keep.size());
    if (with_sinks)
      p.sinks = {sinks.begin(), sinks.end()};
    const auto truth = ref::attention<long double>(p, widen(q.data), widen(k.data), widen(v.data));
    const T scale = *std::max_element(v.data.begin(), v.data.end(),
                                      [](T a, T b) { return std::abs(a) < std::abs(b); });
    for (std::size_t n = 0; n < merged.out.data.size(); ++n) {
      const double error = std::abs(double(merged.out.data[n]) - double(single.out.data[n]));
      worst_ratio = std::max(worst_ratio, error / double(eps * std::abs(scale)));
      REQUIRE(error <= double(parts + 1) * double(eps) * std::abs(double(scale)));
      REQUIRE(std::abs(double(merged.out.data[n]) - double(truth.out[n])) <=
              4 * double(eps) * std::abs(double(scale)));
    }
    for (std::size_t n = 0; n < merged.lse.size(); ++n) {
      INFO("row " << n);
      REQUIRE(std::abs(double(merged.lse[n]) - double(truth.lse[n])) <=
              8 * double(eps) * std::max(1.0, std::abs(double(truth.lse[n]))));
    }

    // Any order of the states gives the same result, within the rounding of the sums (in
    // double: the final rounding to float hides them; double itself shows a few ulps).
    std::vector<attn::AttentionState<T>> shuffled = views;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    State<T> again(B, Hq, Lq, Dv);
    attn::merge_attention_states(shuffled, again.outputs(), with_sinks ? sinks : std::vector<T>{});
    for (std::size_t n = 0; n < again.out.data.size(); ++n)
      REQUIRE(std::abs(double(again.out.data[n]) - double(merged.out.data[n])) <=
              double(parts) * double(eps) * std::abs(double(scale)));

    // In place, into the first state's own views.
    State<T> first = states.front();
    std::vector<attn::AttentionState<T>> in_place = views;
    in_place.front() = first.view();
    attn::merge_attention_states(in_place, first.outputs(), with_sinks ? sinks : std::vector<T>{});
    REQUIRE(first.out.data == merged.out.data);
    REQUIRE(first.lse == merged.lse);
  }
  WARN("worst |merged - single| = " << worst_ratio << " eps max|v|");
}

TEST_CASE("merging empty states gives zeros and -inf, or the sink", "[merge]") {
  constexpr float inf = std::numeric_limits<float>::infinity();
  State<float> a(1, 2, 1, 3), b(1, 2, 1, 3), merged(1, 2, 1, 3);
  for (State<float>* s : {&a, &b}) {
    std::fill(s->out.data.begin(), s->out.data.end(), 0.0f);
    std::fill(s->lse.begin(), s->lse.end(), -inf);
  }
  attn::merge_attention_states<float>({a.view(), b.view()}, merged.outputs());
  REQUIRE(merged.out.data == std::vector<float>(6, 0.0f));
  REQUIRE(merged.lse == std::vector<float>{-inf, -inf});
  attn::merge_attention_states<float>({a.view(), b.view()}, merged.outputs(), {1.5f, -2.0f});
  REQUIRE(merged.out.data == std::vector<float>(6, 0.0f));
  REQUIRE(merged.lse == std::vector<float>{1.5f, -2.0f});

  // One empty state beside a full one changes nothing; the sink then weighs in by the
  // closed form: out = out_a / (1 + exp(z - lse_a)), lse = log(exp(lse_a) + exp(z)).
  a.out.data = {1, 2, 3, 4, 5, 6};
  a.lse = {0.25f, std::log(3.0f)};
  attn::merge_attention_states<float>({a.view(), b.view()}, merged.outputs());
  REQUIRE(merged.out.data == a.out.data);
  REQUIRE(merged.lse == a.lse);
  attn::merge_attention_states<float>({b.view(), a.view()}, merged.outputs(), {0.0f, 0.0f});
  const double w1 = 1.0 / (1.0 + std::exp(-0.25)), w2 = 3.0 / 4.0;
  const std::vector<double> expected{w1, 2 * w1, 3 * w1, 4 * w2, 5 * w2, 6 * w2};
  for (std::size_t n = 0; n < 6; ++n)
    REQUIRE(merged.out.data[n] == Approx(expected[n]).epsilon(1e-6));
  REQUIRE(merged.lse[0] == Approx(std::log(std::exp(0.25) + 1.0)).epsilon(1e-6));
  REQUIRE(merged.lse[1] == Approx(std::log(4.0)).epsilon(1e-6));
}

TEST_CASE("NaN in a state propagates through the merge", "[merge]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  State<float> a(1, 1, 2, 2), b(1, 1, 2, 2), merged(1, 1, 2, 2);
  a.out.data = {1, 2, 3, 4};
  a.lse = {0, 0};
  b.out.data = {5, 6, 7, 8};
  b.lse = {nan, 1};     // row 0: a NaN log-sum-exp
  b.out.data[3] = nan;  // row 1: a NaN output element
  attn::merge_attention_states<float>({a.view(), b.view()}, merged.outputs());
  REQUIRE(std::isnan(merged.out.data[0]));
  REQUIRE(std::isnan(merged.out.data[1]));
  REQUIRE(std::isnan(merged.lse[0]));
  REQUIRE_FALSE(std::isnan(merged.out.data[2]));
  REQUIRE(std::isnan(merged.out.data[3]));
  REQUIRE(merged.lse[1] == Approx(std::log(1 + std::exp(1.0))));
  // An empty state's NaN output is not hidden by its zero weight.
  b.lse = {-inf, -inf};
  b.out.data = {nan, 0, 0, 0};
  attn::merge_attention_states<float>({a.view(), b.view()}, merged.outputs());
  REQUIRE(std::isnan(merged.out.data[0]));
  REQUIRE(merged.out.data[1] == 2.0f);
}

TEST_CASE("16-bit outputs merge in float", "[merge]") {
  std::mt19937 rng(5);
  const Heads<float> out_a = attn_test::random_heads<float>(2, 2, 3, 4, rng);
  const Heads<float> out_b = attn_test::random_heads<float>(2, 2, 3, 4, rng);
  std::vector<float> lse_a(12), lse_b(12);
  std::normal_distribution<float> normal(0, 3);
  for (std::size_t n = 0; n < 12; ++n)
    lse_a[n] = normal(rng), lse_b[n] = normal(rng);
  const Heads<Eigen::half> half_a = out_a.cast<Eigen::half>(), half_b = out_b.cast<Eigen::half>();
  Heads<Eigen::half> merged(2, 2, 3, 4);
  std::vector<float> lse(12);
  attn::merge_attention_states<Eigen::half>(
      {{half_a.cview(), attn::bhl_view(static_cast<const float*>(lse_a.data()), 2, 2, 3)},
       {half_b.cview(), attn::bhl_view(static_cast<const float*>(lse_b.data()), 2, 2, 3)}},
      {merged.view(), attn::bhl_view(lse.data(), 2, 2, 3)});
  for (std::size_t n = 0; n < merged.data.size(); ++n) {
    const std::size_t row = n / 4;
    const double m = std::max(lse_a[row], lse_b[row]);
    const double wa = std::exp(lse_a[row] - m), wb = std::exp(lse_b[row] - m);
    const double expected = (wa * float(half_a.data[n]) + wb * float(half_b.data[n])) / (wa + wb);
    REQUIRE(float(merged.data[n]) == Approx(expected).margin(1e-3).epsilon(1e-3));
    REQUIRE(lse[row] == Approx(m + std::log(wa + wb)).epsilon(1e-6));
  }
}

TEST_CASE("FlashInfer's base-2 log-sum-exp converts to attn's natural one", "[merge]") {
  // Two equal scores of 0: sum = 2, natural lse ln 2, base-2 lse exactly 1.
  std::vector<double> lse{std::log(2.0), 0.0, -std::numeric_limits<double>::infinity()};
  attn::logsumexp_to_base2(attn::bhl_view(lse.data(), 1, 1, 3));
  REQUIRE(lse[0] == Approx(1.0).epsilon(1e-15));
  REQUIRE(lse[1] == 0.0);
  REQUIRE(lse[2] == -std::numeric_limits<double>::infinity());
  attn::logsumexp_from_base2(attn::bhl_view(lse.data(), 1, 1, 3));
  REQUIRE(lse[0] == Approx(std::log(2.0)).epsilon(1e-15));
  REQUIRE(lse[2] == -std::numeric_limits<double>::infinity());
}

TEST_CASE("merge_attention_states refuses bad states and outputs, changing nothing",
          "[merge][errors]") {
  State<float> a(1, 2, 3, 4), b(1, 2, 3, 4), merged(1, 2, 3, 4), wrong(1, 2, 2, 4);
  std::fill(merged.out.data.begin(), merged.out.data.end(), 7.0f);
  std::fill(merged.lse.begin(), merged.lse.end(), 7.0f);
  std::vector<float> weights(std::size_t{2 * 3 * 5});
  struct Case {
    std::string name;
    std::function<void()> call;
    std::string message;
  };
  const std::vector<Case> cases{
      {"no states", [&] { attn::merge_attention_states<float>({}, merged.outputs()); },
       "merge_attention_states: states is empty: give at least one state to merge"},
      {"weights",
       [&] {
         attn::AttentionOutputViews<float> o = merged.outputs();
         o.weights = attn::bhld_view(weights.data(), 1, 2, 3, 5);
         attn::merge_attention_states<float>({a.view()}, o);
       },
       "merge_attention_states: merged.weights was given: a merge has no weights"},
      {"out shape",
       [&] {
         attn::merge_attention_states<float>({a.view(), wrong.view()}, merged.outputs());
       },
       "merge_attention_states: states[1].out is [1, 2, 2, 4] but must be [1, 2, 3, 4] (B, H, L, "
       "Dv), merged.out's shape"},
      {"lse shape",
       [&] {
         attn::AttentionState<float> s = a.view();
         s.logsumexp.length = 2;
         attn::merge_attention_states<float>({s}, merged.outputs());
       },
       "merge_attention_states: states[0].logsumexp is [1, 2, 2] but must be [1, 2, 3] (B, H, L) "
       "of merged.out"},
      {"sinks count",
       [&] { attn::merge_attention_states<float>({a.view()}, merged.outputs(), {1.0f}); },
       "merge_attention_states: sinks has 1 entries but there are 2 heads"},
      {"sinks finite",
       [&] {
         attn::merge_attention_states<float>({a.view()}, merged.outputs(),
                                             {1.0f, std::numeric_limits<float>::infinity()});
       },
       "merge_attention_states: sinks[1] is inf: must be finite"},
      {"partial overlap",
       [&] {
         attn::AttentionOutputViews<float> o = b.outputs();
         o.out.data += 1;  // b's out shifted by one element
         o.out.length = 2;
         attn::AttentionState<float> s = b.view();
         s.out.length = 2;
         s.logsumexp.length = 2;
         o.logsumexp = std::nullopt;
         attn::merge_attention_states<float>({s}, o);
       },
       "merge_attention_states: merged.out overlaps states[0] without being its out view: merge "
       "in place into one state's own out, or into separate memory"},
      {"lse overlap",
       [&] {
         attn::AttentionOutputViews<float> o = merged.outputs();
         o.logsumexp = attn::bhl_view(b.lse.data() + 1, 1, 2, 2);
         o.out.length = 2;
         attn::AttentionState<float> s = b.view();
         s.out.length = 2;
         s.logsumexp.length = 2;
         attn::merge_attention_states<float>({s}, o);
       },
       "merge_attention_states: merged.logsumexp overlaps states[0] without being its "
       "logsumexp view"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    REQUIRE_THROWS_WITH(c.call(), c.message);
    REQUIRE(merged.out.data == std::vector<float>(24, 7.0f));
    REQUIRE(merged.lse == std::vector<float>(6, 7.0f));
  }
}
