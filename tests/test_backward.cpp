// Tests for attn/attention_backward.hpp: the gradients of attention against torch autograd
// (tests/reference/backward.json, float64, every sdpa.json case), against the long double
// loops of support/reference.hpp over every mask kind and sizes around the tiles, and against
// finite differences of the reference forward in long double; determinism, 16-bit storage,
// strided views and every error message.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <attn/attention_backward.hpp>

#include "support/fixtures.hpp"
#include "support/heads.hpp"
#include "support/isa_cases.hpp"
#include "support/masked_problem.hpp"
#include "support/results.hpp"
#include "support/sdpa_case.hpp"

#if ATTN_HAS_OPENMP
#include <omp.h>
#endif

namespace {

using attn::Index;
using attn_test::Heads;

/// max |actual - expected| / max(1, max |expected|): an error relative to the tensor's scale.
template <class A>
double scaled_error(const std::vector<A>& actual, const std::vector<double>& expected) {
  double scale = 1;
  for (const double e : expected)
    scale = std::max(scale, std::abs(e));
  return attn_test::max_error(actual, expected) / scale;
}

template <class T, int R>
std::vector<T> flat(const attn::Tensor<T, R>& t) {
  return std::vector<T>(t.data(), t.data() + t.size());
}

/// A backward kernel and its tiles (0 = default).
struct BackwardRun {
  attn::Algorithm algorithm;
  Index query_tile, key_tile;
};

/// The runs a comparison makes: naive, flash with default tiles, flash with tiles of
/// query_tile x key_tile (not whole vectors).
std::array<BackwardRun, 3> backward_runs(Index query_tile, Index key_tile) {
  return {BackwardRun{attn::Algorithm::naive, 0, 0}, BackwardRun{attn::Algorithm::flash, 0, 0},
          BackwardRun{attn::Algorithm::flash, query_tile, key_tile}};
}

const attn_test::json& backward_case(const std::string& name) {
  for (const auto& c : attn_test::fixture("backward.json").at("cases")) {
    if (c.at("name").get<std::string>() == name)
      return c;
  }
  FAIL("no backward.json case named " << name);
  throw std::logic_error("unreachable");
}

/// Every sdpa.json case: the forward, then the backward with each algorithm (flash also with
/// tiles that are not whole vectors), against autograd: double within 1e-10, float 1e-4,
/// relative to each gradient's largest entry. Logits of magnitude |z| carry a rounding of
/// eps |z| in T, which is the probabilities' relative error (1e-3 in float for the cases with
/// logits of 1e4): the bound grows to 8 eps max |lse| when that is larger.
template <class T>
void fixtures_match_autograd() {
  const double base_tolerance = std::is_same_v<T, double> ? 1e-10 : 1e-4;
  const auto& cases = ATTN_FIXTURE_CASES("sdpa.json", "cases", attn_test::sdpa_case_count);
  REQUIRE(attn_test::fixture("backward.json").at("cases").size() == cases.size());
  for (const auto& c : cases) {
    attn_test::SdpaCase<T> s(c);
    const auto& expected = backward_case(s.name);
    INFO(s.name);
    attn::Tensor<T, 3> lse;
    const attn::Tensor<T, 4> out = attn_test::out_of(
        attn::scaled_dot_product_attention(s.q, s.k, s.v, s.options, attn::Return::logsumexp),
        nullptr, &lse);
    const attn::Tensor<T, 4> dout = attn_test::tensor<T, 4>(expected.at("dout"));
    double largest_lse = 0;
    for (const double x : s.lse) {
      if (std::isfinite(x))
        largest_lse = std::max(largest_lse, std::abs(x));
    }
    const double tolerance = std::max(
        base_tolerance, 8 * static_cast<double>(std::numeric_limits<T>::epsilon()) * largest_lse);
    for (const BackwardRun run : backward_runs(3, 2)) {
      INFO(attn::algorithm_name(run.algorithm)
           << ", tiles " << run.query_tile << " x " << run.key_tile);
      attn::AttentionOptions<T> options = s.options;
      options.algorithm = run.algorithm;
      options.query_tile = run.query_tile;
      options.key_tile = run.key_tile;
      const bool with_bias = !options.bias.empty();
      const attn::Return gradients =
          (with_bias ? attn::Return::dbias : attn::Return::nothing_else) |
          (options.sinks.empty() ? attn::Return::nothing_else : attn::Return::dsinks);
      const attn::AttentionGradients<T> g = attn::scaled_dot_product_attention_backward(
          s.q, s.k, s.v, out, lse, dout, options, gradients);
      CHECK(scaled_error(flat(g.dq), attn_test::values_of(expected.at("dq"))) <= tolerance);
      CHECK(scaled_error(flat(g.dk), attn_test::values_of(expected.at("dk"))) <= tolerance);
      CHECK(scaled_error(flat(g.dv), attn_test::values_of(expected.at("dv"))) <= tolerance);
      if (with_bias) {
        REQUIRE(std::vector<Index>{g.dbias.dimension(0), g.dbias.dimension(1), g.dbias.dimension(2),
                                   g.dbias.dimension(3)} ==
                attn_test::shape_of(expected.at("dbias")));
        CHECK(scaled_error(flat(g.dbias), attn_test::values_of(expected.at("dbias"))) <= tolerance);
      }
      if (!options.sinks.empty()) {
        CHECK(scaled_error(g.dsinks, expected.at("dsinks").template get<std::vector<double>>()) <=
              tolerance);
      } else {
        CHECK(g.dsinks.empty());
      }
    }
  }
}

/// The bias's gradient from the reference's full (B, Hq, Lq, Lk) one: summed over the
/// dimensions the bias broadcasts along.
std::vector<long double> reduce_to_bias(const std::vector<long double>& full,
                                        const attn_test::reference::Problem& p) {
  const auto& dims = p.bias.dims;
  std::vector<long double> r(static_cast<std::size_t>(dims[0] * dims[1] * dims[2] * dims[3]), 0);
  for (Index b = 0; b < p.batch; ++b)
    for (Index h = 0; h < p.q_heads; ++h)
      for (Index i = 0; i < p.q_length; ++i)
        for (Index j = 0; j < p.k_length; ++j) {
          const Index at = ((((dims[0] == 1 ? 0 : b) * dims[1] + (dims[1] == 1 ? 0 : h)) * dims[2] +
                             (dims[2] == 1 ? 0 : i)) *
                                dims[3] +
                            (dims[3] == 1 ? 0 : j));
          r[static_cast<std::size_t>(at)] += full[static_cast<std::size_t>(
              ((b * p.q_heads + h) * p.q_length + i) * p.k_length + j)];
        }
  return r;
}

template <class T>
std::vector<long double> as_long_double(const std::vector<T>& x) {
  return std::vector<long double>(x.begin(), x.end());
}

/// Random q, k, v and dout of problem p (drawn in that order), and the reference's forward
/// and gradients of their exact values: in long double (the truth) and in T (the plain
/// loops, whose error sets the bounds).
template <class T>
struct ReferenceProblem {
  Heads<T> q, k, v, dout;
  attn_test::reference::Result<long double> forward_truth;
  attn_test::reference::Result<T> forward_plain;
  attn_test::reference::Gradients<long double> truth;
  attn_test::reference::Gradients<T> plain;

  ReferenceProblem(const attn_test::reference::Problem& p, std::mt19937& rng)
      : q(attn_test::random_heads<T>(p.batch, p.q_heads, p.q_length, p.dim, rng)),
        k(attn_test::random_heads<T>(p.batch, p.kv_heads, p.k_length, p.dim, rng)),
        v(attn_test::random_heads<T>(p.batch, p.kv_heads, p.k_length, p.value_dim, rng)),
        dout(attn_test::random_heads<T>(p.batch, p.q_heads, p.q_length, p.value_dim, rng)) {
    const auto qe = attn_test::exact(q), ke = attn_test::exact(k), ve = attn_test::exact(v),
               de = attn_test::exact(dout);
    forward_truth = attn_test::reference::attention<long double>(p, qe, ke, ve);
    forward_plain = attn_test::reference::attention<T>(p, qe, ke, ve);
    truth = attn_test::reference::gradients<long double>(p, qe, ke, ve, de);
    plain = attn_test::reference::gradients<T>(p, qe, ke, ve, de);
  }
};

/// FlashAttention's rule: the error of `actual` against the truth at most twice the plain
/// loops' (attn_test::error_bound).
template <class T, class A, class E, class P>
void check_within_plain_bound(const char* name, const A& actual, const E& expected,
                              const P& plain) {
  const double error = attn_test::max_error(actual, expected);
  const double bound = attn_test::error_bound<T>(attn_test::max_error(plain, expected));
  INFO(name << ": error " << error << ", bound " << bound);
  CHECK(error <= bound);
}

/// One problem: the backward of each algorithm against the long double reference; each
/// gradient's error at most twice the plain loops' in T (FlashAttention's rule).
template <class T>
void check_against_reference(attn_test::reference::Problem p, int kind, std::mt19937& rng,
                             Index query_tile, Index key_tile) {
  attn_test::round_numbers_to<T>(p);
  INFO(attn_test::describe(p, kind) << ", query_tile " << query_tile << ", key_tile " << key_tile);
  const ReferenceProblem<T> r(p, rng);
  const Heads<T>& q = r.q;
  const Heads<T>& k = r.k;
  const Heads<T>& v = r.v;
  const Heads<T>& dout = r.dout;
  const auto& truth = r.truth;
  const auto& plain = r.plain;
  const bool with_bias = !p.bias.empty();
  const std::vector<long double> truth_dbias =
      with_bias ? reduce_to_bias(truth.dbias, p) : std::vector<long double>{};
  const std::vector<long double> plain_dbias =
      with_bias ? reduce_to_bias(as_long_double(plain.dbias), p) : std::vector<long double>{};

  attn_test::AttnOptions<T> o(p);
  Heads<T> out(p.batch, p.q_heads, p.q_length, p.value_dim);
  std::vector<T> lse(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length));
  for (const attn::Algorithm algorithm : {attn::Algorithm::naive, attn::Algorithm::flash}) {
    INFO(attn::algorithm_name(algorithm));
    o.options.algorithm = algorithm;
    o.options.query_tile = query_tile;
    o.options.key_tile = key_tile;
    // The forward of the same algorithm (with dropout, its mask is the one the backward
    // regenerates).
    attn::scaled_dot_product_attention_into<T>(
        q.cview(), k.cview(), v.cview(),
        attn::AttentionOutputViews{out.view(),
                                   attn::bhl_view(lse.data(), p.batch, p.q_heads, p.q_length)},
        o.options);
    check_within_plain_bound<T>("out", out.data, r.forward_truth.out, r.forward_plain.out);
    Heads<T> dq(p.batch, p.q_heads, p.q_length, p.dim), dk(p.batch, p.kv_heads, p.k_length, p.dim),
        dv(p.batch, p.kv_heads, p.k_length, p.value_dim);
    std::vector<T> dbias(truth_dbias.size()), dsinks(p.sinks.size());
    attn::AttentionGradientViews<T> grads{dq.view(), dk.view(), dv.view()};
    if (with_bias) {
      const std::array<Index, 4>& d = o.options.bias.dims();
      grads.dbias = attn::bhld_view(dbias.data(), d[0], d[1], d[2], d[3]);
    }
    if (!p.sinks.empty())
      grads.dsinks.emplace(dsinks.data(), static_cast<Index>(dsinks.size()));
    attn::scaled_dot_product_attention_backward_into<T>(
        q.cview(), k.cview(), v.cview(), out.cview(),
        attn::bhl_view(lse.data(), p.batch, p.q_heads, p.q_length), dout.cview(), grads, o.options);
    check_within_plain_bound<T>("dq", dq.data, truth.dq, plain.dq);
    check_within_plain_bound<T>("dk", dk.data, truth.dk, plain.dk);
    check_within_plain_bound<T>("dv", dv.data, truth.dv, plain.dv);
    if (with_bias)
      check_within_plain_bound<T>("dbias", dbias, truth_dbias, plain_dbias);
    if (!p.sinks.empty())
      check_within_plain_bound<T>("dsinks", dsinks, truth.dsinks, plain.dsinks);
  }
}

/// Lengths around the tiles, GQA and MQA, every mask kind.
template <class T>
void sweep_against_reference() {
  std::mt19937 rng(20261201u);
  const Index shapes[4][3] = {{1, 1, 1}, {2, 3, 3}, {2, 4, 2}, {1, 3, 1}};
  const Index lengths[] = {1, 7, 16, 17, 53};
  int n = 0;
  for (const Index q_length : lengths) {
    for (const Index k_length : lengths) {
      const int kind = n % attn_test::mask_kinds;
      const Index* shape = shapes[n % 4];
      const Index dim = (n % 3 == 0) ? 8 : 16, value_dim = (n % 2 == 0) ? dim : 24;
      attn_test::reference::Problem p = attn_test::masked_problem(
          shape[0], shape[1], shape[2], q_length, k_length, dim, value_dim, kind, rng);
      if (n % 2 == 1) {  // every other problem with dropout
        p.dropout_p = 0.25L;
        p.dropout_seed = static_cast<std::uint64_t>(n) * 1000003u;
      }
      ++n;
      check_against_reference<T>(p, kind, rng, 16, 16);
    }
  }
  for (int kind = 0; kind < attn_test::mask_kinds; ++kind) {
    check_against_reference<T>(attn_test::masked_problem(3, 4, 2, 37, 91, 8, 8, kind, rng), kind,
                               rng, 5, 7);
    check_against_reference<T>(attn_test::masked_problem(1, 2, 1, 70, 130, 64, 40, kind, rng), kind,
                               rng, 0, 0);
    attn_test::reference::Problem dropped =
        attn_test::masked_problem(2, 2, 2, 70, 90, 16, 16, kind, rng);
    dropped.dropout_p = 0.5L;
    dropped.dropout_seed = std::uint64_t{0xFFFFFFFFFF} + static_cast<std::uint64_t>(kind);
    check_against_reference<T>(dropped, kind, rng, 32, 16);
  }
}

/// (B, H, L, D) padded values -> (T, H, D) tokens: sequence b's first rows, from offsets.
template <class V>
std::vector<V> pack_rows(const std::vector<V>& padded, Index heads, Index length, Index dim,
                         const std::vector<Index>& offsets) {
  std::vector<V> tokens(static_cast<std::size_t>(offsets.back() * heads * dim));
  for (std::size_t b = 0; b + 1 < offsets.size(); ++b)
    for (Index i = 0; i < offsets[b + 1] - offsets[b]; ++i)
      for (Index h = 0; h < heads; ++h)
        for (Index e = 0; e < dim; ++e)
          tokens[static_cast<std::size_t>(((offsets[b] + i) * heads + h) * dim + e)] =
              padded[static_cast<std::size_t>(
                  ((static_cast<Index>(b) * heads + h) * length + i) * dim + e)];
  return tokens;
}

/// Packed sequences (packed views through scaled_dot_product_attention_backward_into) against the
/// long double reference of the same sequences padded with query and key lengths: the options of
/// the packed forward, each within its sequence (dropout and a mask_mod that reads b see the
/// sequence's index); each gradient's error at most twice the plain loops'.
template <class T>
void packed_against_reference() {
  using attn_test::reference::Problem;
  using RefCausal = attn_test::reference::Causal;
  std::mt19937 rng(20261203u);
  const auto mod = [](Index b, Index h, Index i, Index j) {
    return (b + h + i + 2 * j) % 5 != 0 && j <= i + 4;
  };
  struct Case {
    std::vector<Index> q_lengths, k_lengths;
    Index q_heads, kv_heads, dim, value_dim;
    int variant;
  };
  const Case cases[] = {
      {{5, 0, 17, 33}, {5, 0, 17, 33}, 2, 1, 8, 8, 0},  // causal, GQA, an empty sequence
      {{3, 9, 1}, {12, 20, 7}, 4, 2, 16, 24, 1},        // bottom-right causal, D != Dv
      {{40, 6}, {70, 6}, 2, 2, 8, 8, 2},                // window, sink tokens, learned sinks
      {{21, 13, 2}, {21, 30, 2}, 3, 1, 16, 16, 3},      // softcap, ALiBi, dropout
      {{33, 18}, {50, 18}, 2, 1, 8, 16, 4},             // a mask_mod that reads b
      // D = 128: the default tiles are then 128 x 256 on AVX-512 (128 x 128 causal), and
      // 300 rows cut both into a whole tile and a part
      {{300, 20}, {300, 41}, 3, 1, 128, 128, 3},  // softcap, ALiBi, dropout: not causal
      {{300}, {300}, 2, 1, 128, 128, 0},          // causal
  };
  for (const Case& c : cases) {
    Problem p;
    p.batch = static_cast<Index>(c.q_lengths.size());
    p.q_heads = c.q_heads;
    p.kv_heads = c.kv_heads;
    p.q_length = *std::max_element(c.q_lengths.begin(), c.q_lengths.end());
    p.k_length = *std::max_element(c.k_lengths.begin(), c.k_lengths.end());
    p.dim = c.dim;
    p.value_dim = c.value_dim;
    p.query_lengths = c.q_lengths;
    p.key_lengths = c.k_lengths;
    if (c.variant == 0) {
      p.causal = RefCausal::top_left;
    } else if (c.variant == 1) {
      p.causal = RefCausal::bottom_right;
    } else if (c.variant == 2) {
      p.window_left = 5;
      p.window_right = 2;
      p.sink_tokens = 2;
      p.sinks = {0.5L, -1.0L};
    } else if (c.variant == 3) {
      p.softcap = 3.0L;
      p.alibi_slopes = {0.5L, 0.25L, 0.125L};
      p.dropout_p = 0.3L;
      p.dropout_seed = 99;
    } else {
      p.mask_mod = mod;
    }
    attn_test::round_numbers_to<T>(p);
    INFO("case " << c.variant);
    std::vector<Index> cu_q{0}, cu_k{0};
    for (Index b = 0; b < p.batch; ++b) {
      cu_q.push_back(cu_q.back() + c.q_lengths[static_cast<std::size_t>(b)]);
      cu_k.push_back(cu_k.back() + c.k_lengths[static_cast<std::size_t>(b)]);
    }
    const ReferenceProblem<T> r(p, rng);
    const auto& truth = r.truth;
    const auto& plain = r.plain;

    const auto pack_q = [&](const auto& x, Index dim) {
      return pack_rows(x, p.q_heads, p.q_length, dim, cu_q);
    };
    const auto pack_k = [&](const auto& x, Index dim) {
      return pack_rows(x, p.kv_heads, p.k_length, dim, cu_k);
    };
    const std::vector<T> qt = pack_q(r.q.data, p.dim), kt = pack_k(r.k.data, p.dim),
                         vt = pack_k(r.v.data, p.value_dim), dt = pack_q(r.dout.data, p.value_dim);
    const Index tq = cu_q.back(), tk = cu_k.back();
    const auto cview = [](const std::vector<T>& x, Index t, Index h, Index d,
                          const std::vector<Index>& cu) {
      return attn::packed_view(attn::blhd_view(x.data(), 1, t, h, d), cu);
    };
    const auto view = [](std::vector<T>& x, Index t, Index h, Index d,
                         const std::vector<Index>& cu) {
      return attn::packed_view(attn::blhd_view(x.data(), 1, t, h, d), cu);
    };
    attn_test::AttnOptions<T> o(p);
    o.options.key_lengths.clear();
    o.options.query_lengths.clear();
    if (p.mask_mod)
      o.options.mask_mod = attn::MaskMod(mod);
    for (const BackwardRun run : backward_runs(5, 7)) {
      INFO(attn::algorithm_name(run.algorithm)
           << ", tiles " << run.query_tile << " x " << run.key_tile);
      o.options.algorithm = run.algorithm;
      o.options.query_tile = run.query_tile;
      o.options.key_tile = run.key_tile;
      std::vector<T> out(static_cast<std::size_t>(tq * p.q_heads * p.value_dim)),
          lse(static_cast<std::size_t>(p.q_heads * tq));
      attn::scaled_dot_product_attention_into<T>(
          cview(qt, tq, p.q_heads, p.dim, cu_q), cview(kt, tk, p.kv_heads, p.dim, cu_k),
          cview(vt, tk, p.kv_heads, p.value_dim, cu_k),
          attn::AttentionOutputViews{
              view(out, tq, p.q_heads, p.value_dim, cu_q),
              attn::packed_view(attn::bhl_view(lse.data(), 1, p.q_heads, tq), cu_q)},
          o.options);
      check_within_plain_bound<T>("out", out, pack_q(r.forward_truth.out, p.value_dim),
                                  pack_q(r.forward_plain.out, p.value_dim));
      std::vector<T> dq(qt.size()), dk(kt.size()), dv(vt.size()), dsinks(p.sinks.size());
      attn::scaled_dot_product_attention_backward_into<T>(
          cview(qt, tq, p.q_heads, p.dim, cu_q), cview(kt, tk, p.kv_heads, p.dim, cu_k),
          cview(vt, tk, p.kv_heads, p.value_dim, cu_k),
          cview(out, tq, p.q_heads, p.value_dim, cu_q),
          attn::packed_view(attn::bhl_view(static_cast<const T*>(lse.data()), 1, p.q_heads, tq),
                            cu_q),
          cview(dt, tq, p.q_heads, p.value_dim, cu_q),
          {view(dq, tq, p.q_heads, p.dim, cu_q), view(dk, tk, p.kv_heads, p.dim, cu_k),
           view(dv, tk, p.kv_heads, p.value_dim, cu_k), std::nullopt,
           p.sinks.empty() ? std::nullopt
                           : std::optional<Eigen::Map<attn::Vector<T>>>(
                                 std::in_place, dsinks.data(), static_cast<Index>(dsinks.size()))},
          o.options);
      check_within_plain_bound<T>("dq", dq, pack_q(truth.dq, p.dim), pack_q(plain.dq, p.dim));
      check_within_plain_bound<T>("dk", dk, pack_k(truth.dk, p.dim), pack_k(plain.dk, p.dim));
      check_within_plain_bound<T>("dv", dv, pack_k(truth.dv, p.value_dim),
                                  pack_k(plain.dv, p.value_dim));
      if (!p.sinks.empty())
        check_within_plain_bound<T>("dsinks", dsinks, truth.dsinks, plain.dsinks);
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("the backward matches torch autograd on every sdpa fixture",
                                    "[backward]", fixtures_match_autograd)
ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("the backward agrees with a long double reference",
                                    "[backward]", sweep_against_reference)
ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("the packed backward agrees with a long double reference",
                                    "[backward][packed]", packed_against_reference)

TEST_CASE("the reference gradients agree with finite differences in long double", "[backward]") {
  // L = sum(out * dout) of the reference forward, differentiated by central differences in
  // long double: checks the reference loops the sweeps trust, and attn's double backward,
  // for every mask kind (softcap and learned sinks among them).
  std::mt19937 rng(11u);
  for (int kind = 0; kind < attn_test::mask_kinds; ++kind) {
    attn_test::reference::Problem p = attn_test::masked_problem(2, 2, 1, 5, 6, 3, 2, kind, rng);
    attn_test::round_numbers_to<double>(p);
    INFO(attn_test::describe(p, kind));
    const Heads<double> q = attn_test::random_heads<double>(2, 2, 5, 3, rng);
    const Heads<double> k = attn_test::random_heads<double>(2, 1, 6, 3, rng);
    const Heads<double> v = attn_test::random_heads<double>(2, 1, 6, 2, rng);
    const Heads<double> dout = attn_test::random_heads<double>(2, 2, 5, 2, rng);
    auto qe = attn_test::exact(q), ke = attn_test::exact(k), ve = attn_test::exact(v);
    const auto de = attn_test::exact(dout);
    const auto loss = [&] {
      const auto r = attn_test::reference::attention<long double>(p, qe, ke, ve);
      long double sum = 0;
      for (std::size_t n = 0; n < r.out.size(); ++n)
        sum += r.out[n] * de[n];
      return sum;
    };
    const auto reference = attn_test::reference::gradients<long double>(p, qe, ke, ve, de);
    attn_test::AttnOptions<double> o(p);
    Heads<double> out(2, 2, 5, 2), dq(2, 2, 5, 3), dk(2, 1, 6, 3), dv(2, 1, 6, 2);
    std::vector<double> lse(2 * 2 * 5);
    attn::scaled_dot_product_attention_into<double>(
        q.cview(), k.cview(), v.cview(),
        attn::AttentionOutputViews{out.view(), attn::bhl_view(lse.data(), q.b, q.h, q.l)},
        o.options);
    attn::scaled_dot_product_attention_backward_into<double>(
        q.cview(), k.cview(), v.cview(), out.cview(), attn::bhl_view(lse.data(), q.b, q.h, q.l),
        dout.cview(), {dq.view(), dk.view(), dv.view()}, o.options);
    const long double h = 1e-7L;
    const auto differentiate = [&](std::vector<long double>& x, const std::vector<long double>& g,
                                   const std::vector<double>& attn_g, const char* name) {
      for (std::size_t n = 0; n < x.size(); ++n) {
        const long double saved = x[n];
        x[n] = saved + h;
        const long double up = loss();
        x[n] = saved - h;
        const long double down = loss();
        x[n] = saved;
        const long double numeric = (up - down) / (2 * h);
        INFO(name << "[" << n << "]: finite difference " << static_cast<double>(numeric)
                  << ", reference " << static_cast<double>(g[n]) << ", attn " << attn_g[n]);
        CHECK(std::abs(numeric - g[n]) <= 1e-9L * (1 + std::abs(g[n])));
        CHECK(std::abs(static_cast<long double>(attn_g[n]) - g[n]) <=
              1e-12L * (1 + std::abs(g[n])));
      }
    };
    differentiate(qe, reference.dq, dq.data, "dq");
    differentiate(ke, reference.dk, dk.data, "dk");
    differentiate(ve, reference.dv, dv.data, "dv");
    if (!p.sinks.empty()) {
      for (std::size_t h_index = 0; h_index < p.sinks.size(); ++h_index) {
        const long double saved = p.sinks[h_index];
        p.sinks[h_index] = saved + h;
        const long double up = loss();
        p.sinks[h_index] = saved - h;
        const long double down = loss();
        p.sinks[h_index] = saved;
        CHECK(std::abs((up - down) / (2 * h) - reference.dsinks[h_index]) <=
              1e-9L * (1 + std::abs(reference.dsinks[h_index])));
      }
    }
  }
}

#if ATTN_HAS_OPENMP
namespace {

template <class T>
void same_bits_for_one_and_two_threads() {
  std::mt19937 rng(5u);
  const Heads<T> q = attn_test::random_heads<T>(2, 4, 200, 64, rng);
  const Heads<T> k = attn_test::random_heads<T>(2, 2, 180, 64, rng);
  const Heads<T> v = attn_test::random_heads<T>(2, 2, 180, 48, rng);
  const Heads<T> dout = attn_test::random_heads<T>(2, 4, 200, 48, rng);
  attn::Tensor<T, 4> bias(1, 4, 1, 180);
  bias.setRandom();
  const int saved = omp_get_max_threads();
  for (const attn::Algorithm algorithm : {attn::Algorithm::naive, attn::Algorithm::flash}) {
    attn::AttentionOptions<T> options;
    options.algorithm = algorithm;
    options.causal = attn::Causal::bottom_right;
    options.bias = bias;
    Heads<T> out(2, 4, 200, 48);
    std::vector<T> lse(2 * 4 * 200);
    attn::scaled_dot_product_attention_into<T>(
        q.cview(), k.cview(), v.cview(),
        attn::AttentionOutputViews{out.view(), attn::bhl_view(lse.data(), q.b, q.h, q.l)}, options);
    std::vector<T> results[2];
    for (int threads = 1; threads <= 2; ++threads) {
      omp_set_num_threads(threads);
      Heads<T> dq(2, 4, 200, 64), dk(2, 2, 180, 64), dv(2, 2, 180, 48);
      std::vector<T> dbias(4 * 180);
      attn::scaled_dot_product_attention_backward_into<T>(
          q.cview(), k.cview(), v.cview(), out.cview(), attn::bhl_view(lse.data(), q.b, q.h, q.l),
          dout.cview(),
          {dq.view(), dk.view(), dv.view(), attn::bhld_view(dbias.data(), 1, 4, 1, 180)}, options);
      for (const auto* x : {&dq.data, &dk.data, &dv.data, &dbias})
        results[threads - 1].insert(results[threads - 1].end(), x->begin(), x->end());
    }
    omp_set_num_threads(saved);
    REQUIRE(std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(T)) == 0);
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("the backward gives the same bits with 1 and 2 threads",
                                    "[backward][determinism]", same_bits_for_one_and_two_threads)
#endif  // ATTN_HAS_OPENMP

TEMPLATE_TEST_CASE("the backward of 16-bit storage is the float backward of the same values",
                   "[backward][isa]", Eigen::half, Eigen::bfloat16) {
  // The arithmetic runs in float on the widened values; only the stored gradients round.
  using S = TestType;
  std::mt19937 rng(3u);
  const Heads<S> q = attn_test::random_heads<S>(1, 2, 70, 32, rng);
  const Heads<S> k = attn_test::random_heads<S>(1, 1, 90, 32, rng);
  const Heads<S> v = attn_test::random_heads<S>(1, 1, 90, 16, rng);
  const Heads<S> dout = attn_test::random_heads<S>(1, 2, 70, 16, rng);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::bottom_right;
  Heads<S> out(1, 2, 70, 16);
  std::vector<float> lse(2 * 70);
  attn::scaled_dot_product_attention_into<S>(
      q.cview(), k.cview(), v.cview(),
      attn::AttentionOutputViews{out.view(), attn::bhl_view(lse.data(), q.b, q.h, q.l)}, options);
  const Heads<float> qf = q.template cast<float>(), kf = k.template cast<float>(),
                     vf = v.template cast<float>(), of = out.template cast<float>(),
                     df = dout.template cast<float>();
  for (const attn::Algorithm algorithm : {attn::Algorithm::naive, attn::Algorithm::flash}) {
    INFO(attn::algorithm_name(algorithm));
    options.algorithm = algorithm;
    Heads<S> dq(1, 2, 70, 32), dk(1, 1, 90, 32), dv(1, 1, 90, 16);
    attn::scaled_dot_product_attention_backward_into<S>(
        q.cview(), k.cview(), v.cview(), out.cview(), attn::bhl_view(lse.data(), q.b, q.h, q.l),
        dout.cview(), {dq.view(), dk.view(), dv.view()}, options);
    Heads<float> dqf(1, 2, 70, 32), dkf(1, 1, 90, 32), dvf(1, 1, 90, 16);
    attn::scaled_dot_product_attention_backward_into<float>(
        qf.cview(), kf.cview(), vf.cview(), of.cview(), attn::bhl_view(lse.data(), q.b, q.h, q.l),
        df.cview(), {dqf.view(), dkf.view(), dvf.view()}, options);
    const auto narrowed = [](const Heads<float>& x) {
      std::vector<S> r(x.data.size());
      std::transform(x.data.begin(), x.data.end(), r.begin(), [](float e) { return S(e); });
      return r;
    };
    // Bitwise where the summation order is the same; float products may differ from the
    // float call's only by the flash kernel's widening, which is exact.
    const std::vector<S> expected_dq = narrowed(dqf), expected_dk = narrowed(dkf),
                         expected_dv = narrowed(dvf);
    REQUIRE(std::memcmp(dq.data.data(), expected_dq.data(), expected_dq.size() * sizeof(S)) == 0);
    REQUIRE(std::memcmp(dk.data.data(), expected_dk.data(), expected_dk.size() * sizeof(S)) == 0);
    REQUIRE(std::memcmp(dv.data.data(), expected_dv.data(), expected_dv.size() * sizeof(S)) == 0);
  }
}

TEST_CASE("the backward reads and writes strided (B, L, H, D) views", "[backward][isa]") {
  std::mt19937 rng(9u);
  const Index B = 2, H = 3, L = 40, D = 16;
  const Heads<float> q = attn_test::random_heads<float>(B, L, H, D, rng);  // (B, L, H, D) memory
  const Heads<float> k = attn_test::random_heads<float>(B, L, H, D, rng);
  const Heads<float> v = attn_test::random_heads<float>(B, L, H, D, rng);
  const Heads<float> dout = attn_test::random_heads<float>(B, L, H, D, rng);
  const auto blhd = [&](const Heads<float>& x) {
    return attn::blhd_view(x.data.data(), B, L, H, D);
  };
  Heads<float> out(B, L, H, D), dq(B, L, H, D), dk(B, L, H, D), dv(B, L, H, D);
  std::vector<float> lse(static_cast<std::size_t>(B * H * L));
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::top_left;
  attn::scaled_dot_product_attention_into<float>(
      blhd(q), blhd(k), blhd(v),
      attn::AttentionOutputViews{attn::blhd_view(out.data.data(), B, L, H, D),
                                 attn::bhl_view(lse.data(), B, H, L)},
      options);
  attn::scaled_dot_product_attention_backward_into<float>(
      blhd(q), blhd(k), blhd(v), blhd(out), attn::bhl_view(lse.data(), B, H, L), blhd(dout),
      {attn::blhd_view(dq.data.data(), B, L, H, D), attn::blhd_view(dk.data.data(), B, L, H, D),
       attn::blhd_view(dv.data.data(), B, L, H, D)},
      options);
  // The same problem in (B, H, L, D) tensors.
  const auto transposed = [&](const Heads<float>& x) {
    attn::Tensor<float, 4> t(B, H, L, D);
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h)
        for (Index i = 0; i < L; ++i)
          for (Index d = 0; d < D; ++d)
            t(b, h, i, d) = x.data[static_cast<std::size_t>(((b * L + i) * H + h) * D + d)];
    return t;
  };
  attn::Tensor<float, 3> lse_t;
  const attn::Tensor<float, 4> qt = transposed(q), kt = transposed(k), vt = transposed(v);
  const attn::Tensor<float, 4> out_t = attn_test::out_of(
      attn::scaled_dot_product_attention(qt, kt, vt, options, attn::Return::logsumexp), nullptr,
      &lse_t);
  const attn::AttentionGradients<float> g = attn::scaled_dot_product_attention_backward(
      qt, kt, vt, out_t, lse_t, transposed(dout), options);
  const attn::Tensor<float, 4> dq_t = transposed(dq), dk_t = transposed(dk), dv_t = transposed(dv);
  REQUIRE(std::memcmp(dq_t.data(), g.dq.data(),
                      sizeof(float) * static_cast<std::size_t>(dq_t.size())) == 0);
  REQUIRE(std::memcmp(dk_t.data(), g.dk.data(),
                      sizeof(float) * static_cast<std::size_t>(dk_t.size())) == 0);
  REQUIRE(std::memcmp(dv_t.data(), g.dv.data(),
                      sizeof(float) * static_cast<std::size_t>(dv_t.size())) == 0);
}

TEST_CASE("the backward gives zero gradients to rows that see no key and keys no query sees",
          "[backward]") {
  // Query 0 of sequence 1 sees nothing (query length 0); keys >= 3 of sequence 0 are padding.
  attn::Tensor<double, 4> q(2, 1, 4, 3), k(2, 1, 5, 3), v(2, 1, 5, 2), dout(2, 1, 4, 2);
  for (auto* t : {&q, &k, &v, &dout})
    t->setRandom();
  attn::AttentionOptions<double> options;
  options.key_lengths = {3, 5};
  options.query_lengths = {4, 0};
  attn::Tensor<double, 3> lse;
  const attn::Tensor<double, 4> out = attn_test::out_of(
      attn::scaled_dot_product_attention(q, k, v, options, attn::Return::logsumexp), nullptr, &lse);
  for (const attn::Algorithm algorithm : {attn::Algorithm::naive, attn::Algorithm::flash}) {
    options.algorithm = algorithm;
    const auto g = attn::scaled_dot_product_attention_backward(q, k, v, out, lse, dout, options);
    for (Index i = 0; i < 4; ++i)
      for (Index d = 0; d < 3; ++d)
        REQUIRE(g.dq(1, 0, i, d) == 0.0);
    for (Index j = 3; j < 5; ++j)
      for (Index d = 0; d < 3; ++d)
        REQUIRE((g.dk(0, 0, j, d) == 0.0 && g.dv(0, 0, j, d % 2) == 0.0));
    for (Index j = 0; j < 5; ++j)
      REQUIRE((g.dk(1, 0, j, 0) == 0.0 && g.dv(1, 0, j, 0) == 0.0));
    REQUIRE(g.dq(0, 0, 2, 1) != 0.0);
  }
}

TEST_CASE("NaN in dout reaches the gradients of its row", "[backward]") {
  attn::Tensor<float, 4> q(1, 1, 3, 4), k(1, 1, 6, 4), v(1, 1, 6, 4), dout(1, 1, 3, 4);
  for (auto* t : {&q, &k, &v, &dout})
    t->setRandom();
  attn::Tensor<float, 3> lse;
  const attn::Tensor<float, 4> out = attn_test::out_of(
      attn::scaled_dot_product_attention(q, k, v, {}, attn::Return::logsumexp), nullptr, &lse);
  dout(0, 0, 1, 2) = std::numeric_limits<float>::quiet_NaN();
  for (const attn::Algorithm algorithm : {attn::Algorithm::naive, attn::Algorithm::flash}) {
    attn::AttentionOptions<float> options;
    options.algorithm = algorithm;
    const auto g = attn::scaled_dot_product_attention_backward(q, k, v, out, lse, dout, options);
    REQUIRE(std::isnan(g.dq(0, 0, 1, 0)));
    REQUIRE(std::isfinite(g.dq(0, 0, 0, 0)));
    REQUIRE(std::isnan(g.dv(0, 0, 0, 2)));
    REQUIRE(std::isnan(g.dk(0, 0, 0, 0)));
  }
}

TEST_CASE("the backward rejects bad shapes and options by name", "[backward][errors]") {
  attn::Tensor<float, 4> q(1, 2, 3, 4), k(1, 1, 5, 4), v(1, 1, 5, 2), out(1, 2, 3, 2),
      dout(1, 2, 3, 2);
  for (auto* t : {&q, &k, &v, &out, &dout})
    t->setRandom();
  attn::Tensor<float, 3> lse(1, 2, 3);
  lse.setZero();
  const std::string prefix = "scaled_dot_product_attention_backward: ";
  attn::Tensor<float, 4> wrong(1, 2, 3, 3);
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_backward(q, k, v, wrong, lse, dout),
                      prefix + "out is [1, 2, 3, 3] but must be [1, 2, 3, 2] (B, Hq, Lq, Dv)");
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_backward(q, k, v, out, lse, wrong),
                      prefix + "dout is [1, 2, 3, 3] but must be [1, 2, 3, 2] (B, Hq, Lq, Dv)");
  attn::Tensor<float, 3> bad_lse(1, 2, 4);
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_backward(q, k, v, out, bad_lse, dout),
                      prefix + "logsumexp is [1, 2, 4] but must be [1, 2, 3] (B, Hq, Lq)");
  attn::Tensor<float, 4> k3(1, 1, 5, 3);
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_backward(q, k3, v, out, lse, dout),
                      Catch::Contains("q and k head dims differ"));
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention_backward(q, k, v, out, lse, dout, {}, attn::Return::dbias),
      prefix + "Return::dbias but options.bias is not given");
  attn::AttentionOptions<float> options;
  options.window = {-2, 0};
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_backward(q, k, v, out, lse, dout, options),
                      Catch::Contains("window is (-2, 0)"));
  options = {};
  options.query_tile = -1;
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_backward(q, k, v, out, lse, dout, options),
                      prefix +
                          "query_tile is -1 and key_tile is 0: tile sizes must be >= 0 (0 = "
                          "default)");
  options = {};
  options.scale = std::numeric_limits<float>::infinity();
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_backward(q, k, v, out, lse, dout, options),
                      prefix + "scale is inf: must be finite");

  // The _into form: output shapes, null logsumexp, aliasing, dbias / dsinks without their input.
  const auto view = [](attn::Tensor<float, 4>& t) { return attn::bhld_view(t); };
  const auto cview = [](const attn::Tensor<float, 4>& t) { return attn::detail::as_heads_view(t); };
  attn::Tensor<float, 4> dq(1, 2, 3, 4), dk(1, 1, 5, 4), dv(1, 1, 5, 2);
  const auto call = [&](const attn::HeadsView<float>& dq_view,
                        const attn::HeadsView<float>& dk_view,
                        const attn::HeadsView<float>& dv_view, const float* lse_data,
                        const attn::AttentionOptions<float>& o, float* dbias, float* dsinks) {
    attn::AttentionGradientViews<float> grads{dq_view, dk_view, dv_view};
    if (dbias != nullptr)
      grads.dbias = attn::bhld_view(dbias, 1, 1, 1, 1);
    if (dsinks != nullptr)
      grads.dsinks.emplace(dsinks, 2);
    attn::scaled_dot_product_attention_backward_into<float>(
        cview(q), cview(k), cview(v), cview(out), attn::bhl_view(lse_data, 1, 2, 3), cview(dout),
        grads, o);
  };
  REQUIRE_NOTHROW(call(view(dq), view(dk), view(dv), lse.data(), {}, nullptr, nullptr));
  REQUIRE_THROWS_WITH(call(view(dk), view(dk), view(dv), lse.data(), {}, nullptr, nullptr),
                      prefix +
                          "dq is [1, 1, 5, 4] but must be [1, 2, 3, 4] (B, Hq, Lq, D), q's "
                          "shape");
  REQUIRE_THROWS_WITH(call(view(dq), view(dq), view(dv), lse.data(), {}, nullptr, nullptr),
                      prefix +
                          "dk is [1, 2, 3, 4] but must be [1, 1, 5, 4] (B, Hkv, Lk, D), k's "
                          "shape");
  REQUIRE_THROWS_WITH(call(view(dq), view(dk), view(dq), lse.data(), {}, nullptr, nullptr),
                      prefix +
                          "dv is [1, 2, 3, 4] but must be [1, 1, 5, 2] (B, Hkv, Lk, Dv), v's "
                          "shape");
  REQUIRE_THROWS_WITH(call(view(dq), view(dk), view(dv), nullptr, {}, nullptr, nullptr),
                      prefix + "logsumexp has no data");
  REQUIRE_THROWS_WITH(call(view(q), view(dk), view(dv), lse.data(), {}, nullptr, nullptr),
                      prefix +
                          "dq overlaps q: the gradients must share no element with the "
                          "inputs");
  attn::Tensor<float, 4> shared(1, 1, 5, 4);
  attn::HeadsView<float> dv_in_dk = view(shared);
  dv_in_dk.dim = 2;
  REQUIRE_THROWS_WITH(call(view(dq), view(shared), dv_in_dk, lse.data(), {}, nullptr, nullptr),
                      prefix + "dk overlaps dv: the gradients must not overlap");
  float scratch[4] = {};
  REQUIRE_THROWS_WITH(call(view(dq), view(dk), view(dv), lse.data(), {}, scratch, nullptr),
                      prefix + "dbias was requested but options.bias is not given");
  REQUIRE_THROWS_WITH(call(view(dq), view(dk), view(dv), lse.data(), {}, nullptr, scratch),
                      prefix + "dsinks was requested but options.sinks is not given");
  const std::vector<Index> offsets = {0, 3};
  const attn::HeadsView<const float> packed = attn::packed_view(cview(q), offsets);
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention_backward_into<float>(
                          packed, cview(k), cview(v), cview(out), attn::bhl_view(lse), cview(dout),
                          {view(dq), view(dk), view(dv)}),
                      prefix +
                          "q is a packed view but out is not: pass packed views (packed_view()) "
                          "for all tensors or for none");
}

TEST_CASE("the packed backward rejects bad tokens, offsets and options by name",
          "[backward][packed][errors]") {
  // Two sequences of 2 and 3 query tokens, 4 and 1 keys; Hq = 2, Hkv = 1, D = 4, Dv = 2.
  attn::Tensor<float, 3> q(5, 2, 4), k(5, 1, 4), v(5, 1, 2), out(5, 2, 2), dout(5, 2, 2);
  for (auto* t : {&q, &k, &v, &out, &dout})
    t->setRandom();
  attn::Tensor<float, 2> lse(2, 5);
  lse.setZero();
  const std::vector<Index> cu_q{0, 2, 5}, cu_k{0, 4, 5}, cu_other{0, 3, 5};
  const std::string prefix = "scaled_dot_product_attention_backward: ";
  attn::Tensor<float, 3> dq(5, 2, 4), dk(5, 1, 4), dv(5, 1, 2);
  using attn::packed_view;
  const auto call = [&](const attn::HeadsView<const float>& dout_view, const float* lse_data,
                        const attn::AttentionOptions<float>& options = {},
                        float* dsinks = nullptr) {
    attn::AttentionGradientViews<float> grads{packed_view(dq, cu_q), packed_view(dk, cu_k),
                                              packed_view(dv, cu_k)};
    if (dsinks != nullptr)
      grads.dsinks.emplace(dsinks, 2);
    attn::scaled_dot_product_attention_backward_into<float>(
        packed_view(q, cu_q), packed_view(k, cu_k), packed_view(v, cu_k), packed_view(out, cu_q),
        packed_view(attn::bhl_view(lse_data, 1, 2, 5), cu_q), dout_view, grads, options);
  };
  CHECK_NOTHROW(call(packed_view(dout, cu_q), lse.data()));
  attn::Tensor<float, 3> wrong(5, 2, 3);
  REQUIRE_THROWS_WITH(call(packed_view(wrong, cu_q), lse.data()),
                      prefix + "dout is [2, 2, 3, 3] but must be [2, 2, 3, 2] (B, Hq, Lq, Dv)");
  REQUIRE_THROWS_WITH(call(packed_view(dout, cu_other), lse.data()),
                      prefix +
                          "dout holds other sequences than q ([0, 3, 5] against [0, 2, 5]): pack "
                          "it with q's cu_seqlens");
  REQUIRE_THROWS_WITH(
      call(attn::blhd_view(static_cast<const float*>(dout.data()), 1, 5, 2, 2), lse.data()),
      prefix +
          "q is a packed view but dout is not: pass packed views (packed_view()) "
          "for all tensors or for none");
  attn::AttentionOptions<float> options;
  options.key_lengths = {4, 1};
  REQUIRE_THROWS_WITH(call(packed_view(dout, cu_q), lse.data(), options),
                      prefix +
                          "options.key_lengths and options.query_lengths must be empty on packed "
                          "views: their row offsets give the lengths");
  options = {};
  attn::Tensor<float, 4> bias(1, 1, 1, 1);
  bias.setZero();
  options.bias = bias;
  REQUIRE_THROWS_WITH(call(packed_view(dout, cu_q), lse.data(), options),
                      Catch::Contains("options.keep_mask and options.bias are not supported on "
                                      "packed views"));
  options = {};
  options.score_mod =
      attn::ScoreMod<float>([](float score, Index, Index, Index, Index) { return score; });
  REQUIRE_THROWS_WITH(call(packed_view(dout, cu_q), lse.data(), options),
                      Catch::Contains("options.score_mod is forward only"));
  REQUIRE_THROWS_WITH(call(packed_view(dout, cu_q), nullptr), prefix + "logsumexp has no data");
  float scratch[2] = {};
  REQUIRE_THROWS_WITH(call(packed_view(dout, cu_q), lse.data(), {}, scratch),
                      prefix + "dsinks was requested but options.sinks is not given");
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention_backward_into<float>(
          packed_view(q, cu_q), packed_view(k, cu_k), packed_view(v, cu_k), packed_view(out, cu_q),
          packed_view(lse, cu_q), packed_view(dout, cu_q),
          {packed_view(dq, cu_q), packed_view(attn::blhd_view(dq.data(), 1, 5, 1, 4), cu_k),
           packed_view(dv, cu_k)}),
      prefix + "dq overlaps dk: the gradients must not overlap");
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention_backward_into<float>(
          packed_view(q, cu_q), packed_view(k, cu_k), packed_view(v, cu_k), packed_view(out, cu_q),
          packed_view(lse, cu_q), packed_view(dout, cu_q),
          {packed_view(q, cu_q), packed_view(dk, cu_k), packed_view(dv, cu_k)}),
      prefix + "dq overlaps q: the gradients must share no element with the inputs");
}

TEST_CASE("the backward of empty problems gives empty or zero gradients", "[backward]") {
  // (B, Hq, Lq, Lk, Dv): no batch, no queries, no keys (every query sees nothing), no value dim.
  const Index sizes[4][5] = {{0, 2, 3, 4, 2}, {1, 2, 0, 4, 2}, {1, 2, 3, 0, 2}, {1, 2, 3, 4, 0}};
  for (const auto& z : sizes) {
    INFO("B " << z[0] << ", Lq " << z[2] << ", Lk " << z[3] << ", Dv " << z[4]);
    attn::Tensor<float, 4> q(z[0], z[1], z[2], 3), k(z[0], 1, z[3], 3), v(z[0], 1, z[3], z[4]),
        dout(z[0], z[1], z[2], z[4]);
    for (auto* t : {&q, &k, &v, &dout})
      t->setRandom();
    attn::Tensor<float, 3> lse;
    const attn::Tensor<float, 4> out = attn_test::out_of(
        attn::scaled_dot_product_attention(q, k, v, {}, attn::Return::logsumexp), nullptr, &lse);
    for (const attn::Algorithm algorithm : {attn::Algorithm::naive, attn::Algorithm::flash}) {
      attn::AttentionOptions<float> options;
      options.algorithm = algorithm;
      const auto g = attn::scaled_dot_product_attention_backward(q, k, v, out, lse, dout, options);
      REQUIRE(g.dq.dimensions() == q.dimensions());
      REQUIRE(g.dk.dimensions() == k.dimensions());
      REQUIRE(g.dv.dimensions() == v.dimensions());
      for (const auto* t : {&g.dq, &g.dk, &g.dv})
        for (Index n = 0; n < t->size(); ++n)
          REQUIRE(t->data()[n] == 0.0f);
    }
  }
}

namespace {

/// backward.json's dropout cases (their own inputs; the mask from docs/training.md's rule,
/// re-implemented in Python): the forward's out and the gradients of both algorithms.
template <class T>
void dropout_fixtures_match_autograd() {
  const double tolerance = std::is_same_v<T, double> ? 1e-10 : 1e-4;
  const auto& cases = ATTN_FIXTURE_CASES("backward.json", "dropout_cases", 3);
  for (const auto& c : cases) {
    INFO(c.at("name").template get<std::string>());
    const attn::Tensor<T, 4> q = attn_test::tensor<T, 4>(c.at("q"));
    const attn::Tensor<T, 4> k = attn_test::tensor<T, 4>(c.at("k"));
    const attn::Tensor<T, 4> v = attn_test::tensor<T, 4>(c.at("v"));
    const attn::Tensor<T, 4> dout = attn_test::tensor<T, 4>(c.at("dout"));
    attn::Tensor<T, 4> bias;
    attn::AttentionOptions<T> options;
    const std::string causal = c.at("causal").template get<std::string>();
    options.causal = causal == "top_left"       ? attn::Causal::top_left
                     : causal == "bottom_right" ? attn::Causal::bottom_right
                                                : attn::Causal::none;
    if (!c.at("bias").is_null()) {
      bias = attn_test::tensor<T, 4>(c.at("bias"));
      options.bias = bias;
    }
    if (!c.at("sinks").is_null()) {
      for (const double x : c.at("sinks").template get<std::vector<double>>())
        options.sinks.push_back(static_cast<T>(x));
    }
    options.dropout_p = static_cast<T>(c.at("dropout_p").template get<double>());
    options.dropout_seed = c.at("dropout_seed").template get<std::uint64_t>();
    for (const attn::Algorithm algorithm : {attn::Algorithm::naive, attn::Algorithm::flash}) {
      INFO(attn::algorithm_name(algorithm));
      options.algorithm = algorithm;
      attn::Tensor<T, 3> lse;
      const attn::Tensor<T, 4> out = attn_test::out_of(
          attn::scaled_dot_product_attention(q, k, v, options, attn::Return::logsumexp), nullptr,
          &lse);
      CHECK(scaled_error(flat(out), attn_test::values_of(c.at("out"))) <= tolerance);
      const auto g = attn::scaled_dot_product_attention_backward(
          q, k, v, out, lse, dout, options,
          (options.bias.empty() ? attn::Return::nothing_else : attn::Return::dbias) |
              (options.sinks.empty() ? attn::Return::nothing_else : attn::Return::dsinks));
      CHECK(scaled_error(flat(g.dq), attn_test::values_of(c.at("dq"))) <= tolerance);
      CHECK(scaled_error(flat(g.dk), attn_test::values_of(c.at("dk"))) <= tolerance);
      CHECK(scaled_error(flat(g.dv), attn_test::values_of(c.at("dv"))) <= tolerance);
      if (!options.bias.empty())
        CHECK(scaled_error(flat(g.dbias), attn_test::values_of(c.at("dbias"))) <= tolerance);
      if (!options.sinks.empty()) {
        CHECK(scaled_error(g.dsinks, c.at("dsinks").template get<std::vector<double>>()) <=
              tolerance);
      }
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("dropout matches torch autograd with the documented mask",
                                    "[backward][dropout]", dropout_fixtures_match_autograd)

TEST_CASE("dropout drops weights at its rate and scales the others", "[backward][dropout]") {
  // One head, 512 x 512 visible weights: the dropped share within 5 standard deviations of p,
  // and every kept weight equal to the undropped one times 1 / (1 - p).
  const attn::Matrix<double> q = attn::Matrix<double>::Random(512, 8);
  const attn::Matrix<double> k = attn::Matrix<double>::Random(512, 8);
  const attn::Matrix<double> v = attn::Matrix<double>::Random(512, 4);
  attn::Matrix<double> weights, dropped_weights;
  attn_test::out_of(attn::scaled_dot_product_attention(q, k, v, {}, attn::Return::weights),
                    &weights, nullptr);
  for (const double p : {0.1, 0.3, 0.7}) {
    INFO("p " << p);
    attn::AttentionOptions<double> options;
    options.dropout_p = p;
    options.dropout_seed = 42;
    attn_test::out_of(attn::scaled_dot_product_attention(q, k, v, options, attn::Return::weights),
                      &dropped_weights, nullptr);
    Index dropped = 0;
    double worst = 0;  // relative error of the kept weights against weights / (1 - p)
    for (Index i = 0; i < 512; ++i) {
      for (Index j = 0; j < 512; ++j) {
        if (dropped_weights(i, j) == 0.0) {
          ++dropped;
        } else {
          const double expected = weights(i, j) / (1 - p);
          worst = std::max(worst, std::abs(dropped_weights(i, j) - expected) / expected);
        }
      }
    }
    CHECK(worst <= 1e-14);
    const double rate = static_cast<double>(dropped) / (512.0 * 512.0);
    CHECK(std::abs(rate - p) <= 5 * std::sqrt(p * (1 - p) / (512.0 * 512.0)));
    // The same seed gives the same mask; another seed another one.
    attn::Matrix<double> again, other;
    attn_test::out_of(attn::scaled_dot_product_attention(q, k, v, options, attn::Return::weights),
                      &again, nullptr);
    REQUIRE(again == dropped_weights);
    options.dropout_seed = 43;
    attn_test::out_of(attn::scaled_dot_product_attention(q, k, v, options, attn::Return::weights),
                      &other, nullptr);
    REQUIRE(other != dropped_weights);
  }
}

TEST_CASE("dropout's mask does not depend on tiles or the kernel", "[backward][dropout][isa]") {
  std::mt19937 rng(17u);
  const Heads<float> q = attn_test::random_heads<float>(2, 2, 150, 32, rng);
  const Heads<float> k = attn_test::random_heads<float>(2, 2, 170, 32, rng);
  const Heads<float> v = attn_test::random_heads<float>(2, 2, 170, 32, rng);
  attn::AttentionOptions<float> options;
  options.dropout_p = 0.4f;
  options.dropout_seed = 5;
  options.algorithm = attn::Algorithm::naive;
  Heads<float> expected(2, 2, 150, 32), out(2, 2, 150, 32);
  attn::scaled_dot_product_attention_into<float>(q.cview(), k.cview(), v.cview(), expected.view(),
                                                 options);
  options.algorithm = attn::Algorithm::flash;
  for (const Index tile : {Index(0), Index(7), Index(64)}) {
    options.query_tile = tile;
    options.key_tile = tile == 7 ? 5 : tile;
    attn::scaled_dot_product_attention_into<float>(q.cview(), k.cview(), v.cview(), out.view(),
                                                   options);
    INFO("tiles " << tile);
    CHECK(attn_test::max_error(out.data, expected.data) <= 1e-5);
  }
}

TEST_CASE("dropout is validated and refused by chunked and decode", "[backward][dropout][errors]") {
  attn::Tensor<float, 4> q(1, 1, 4, 2), k(1, 1, 4, 2), v(1, 1, 4, 2);
  q.setRandom();
  k.setRandom();
  v.setRandom();
  attn::AttentionOptions<float> options;
  for (const float p : {1.0f, -0.1f, std::numeric_limits<float>::quiet_NaN()}) {
    options.dropout_p = p;
    REQUIRE_THROWS_WITH(
        attn::scaled_dot_product_attention(q, k, v, options),
        "scaled_dot_product_attention: dropout_p is " + std::to_string(p) + ": must lie in [0, 1)");
  }
  options.dropout_p = 0.5f;
  for (const attn::Algorithm algorithm : {attn::Algorithm::chunked, attn::Algorithm::decode}) {
    options.algorithm = algorithm;
    REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(q, k, v, options),
                        std::string("scaled_dot_product_attention: dropout was asked of "
                                    "Algorithm::") +
                            attn::algorithm_name(algorithm) +
                            ": only naive and flash (or automatic) apply it");
  }
}
