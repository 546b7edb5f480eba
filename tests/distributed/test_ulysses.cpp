// attn/distributed/ulysses.hpp: all-to-all heads, forward and backward, equal the
// single-process calls and the long double reference within twice the plain loops' error
// (both splits, lengths that do not divide, ranks without tokens, ALiBi and learned sinks cut
// to each rank's heads); heads that do not divide by the ranks refused by every rank.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include <attn/attention_backward.hpp>
#include <attn/distributed/ulysses.hpp>
#include <attn/score_modifiers.hpp>

#include "distributed/support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using attn::Index;
using attn::distributed::SequenceSplit;
using attn::distributed::token_runs;
using namespace attn_dist_test;

void check_ulysses(const std::string& name, Index B, Index Lq, Index Lk,
                   const attn::AttentionOptions<float>& o, SequenceSplit split) {
  const int P = comm_size(), rank = comm_rank();
  const Index Hq = 8, Hkv = 4, D = 8, Dv = 6;
  const auto q = random_tensor<float>(B, Hq, Lq, D, 31);
  const auto k = random_tensor<float>(B, Hkv, Lk, D, 32);
  const auto v = random_tensor<float>(B, Hkv, Lk, Dv, 33);
  const auto dout = random_tensor<float>(B, Hq, Lq, Dv, 34);
  const auto q_runs = token_runs(split, Lq, P, rank), k_runs = token_runs(split, Lk, P, rank);
  const auto lq = local_rows(q, q_runs), lk = local_rows(k, k_runs), lv = local_rows(v, k_runs);
  attn::Tensor<float, 4> out(B, Hq, lq.dimension(2), Dv);
  attn::Tensor<float, 3> lse(B, Hq, lq.dimension(2));
  attn::distributed::ulysses_attention_into<float>(
      attn::bhld_view(lq), attn::bhld_view(lk), attn::bhld_view(lv),
      {attn::bhld_view(out), attn::bhl_view(lse)}, o, split, MPI_COMM_WORLD);
  attn::AttentionGradients<float> g;
  g.dq.resize(lq.dimensions());
  g.dk.resize(lk.dimensions());
  g.dv.resize(lv.dimensions());
  const auto ldout = local_rows(dout, q_runs);
  attn::AttentionGradientViews<float> views{attn::bhld_view(g.dq), attn::bhld_view(g.dk),
                                            attn::bhld_view(g.dv)};
  const bool sinks = !o.sinks.empty();
  if (sinks) {
    g.dsinks.resize(o.sinks.size());
    views.dsinks.emplace(g.dsinks.data(), static_cast<Index>(g.dsinks.size()));
  }
  attn::distributed::ulysses_attention_backward_into<float>(
      attn::bhld_view(lq), attn::bhld_view(lk), attn::bhld_view(lv), attn::bhld_view(out),
      attn::bhl_view(lse), attn::bhld_view(ldout), views, o, split, MPI_COMM_WORLD);
  const auto single = attn::scaled_dot_product_attention(q, k, v, o, attn::Return::logsumexp);
  const auto single_grads = attn::scaled_dot_product_attention_backward(
      q, k, v, single.out, single.logsumexp, dout, o,
      sinks ? attn::Return::dsinks : attn::Return::nothing_else);
  ref::Problem p = reference_problem(o, B, Hq, Hkv, Lq, Lk, D, Dv);
  for (const float slope : o.alibi_slopes)
    p.alibi_slopes.push_back(slope);
  const auto qe = as_long_double(q), ke = as_long_double(k), ve = as_long_double(v),
             de = as_long_double(dout);
  const auto truth = ref::attention<long double>(p, qe, ke, ve);
  const auto plain = ref::attention<float>(p, qe, ke, ve);
  const auto truth_grads = ref::gradients<long double>(p, qe, ke, ve, de);
  const auto plain_grads = ref::gradients<float>(p, qe, ke, ve, de);
  INFO(name << ", " << attn::distributed::split_name(split) << ", rank " << rank << " of " << P);
  const auto check = [&](const char* what, const auto& actual, const auto& true_values,
                         const auto& plain_values, const auto& single_values, Index heads,
                         Index length, Index width, const auto& runs) {
    const double bound = error_bound<float>(max_error(plain_values, true_values));
    const auto mine = [&](const auto& global) {
      return local_values(global, B, heads, length, width, runs);
    };
    const double error = max_error(as_vector(actual), mine(true_values));
    const double from_single = max_error(as_vector(actual), mine(as_vector(single_values)));
    INFO(what << ": error " << error << ", against one process " << from_single << ", bound "
              << bound);
    CHECK(error <= bound);
    CHECK(from_single <= bound);
  };
  check("out", out, truth.out, plain.out, single.out, Hq, Lq, Dv, q_runs);
  check("lse", lse, truth.lse, plain.lse, single.logsumexp, Hq, Lq, 1, q_runs);
  check("dq", g.dq, truth_grads.dq, plain_grads.dq, single_grads.dq, Hq, Lq, D, q_runs);
  check("dk", g.dk, truth_grads.dk, plain_grads.dk, single_grads.dk, Hkv, Lk, D, k_runs);
  check("dv", g.dv, truth_grads.dv, plain_grads.dv, single_grads.dv, Hkv, Lk, Dv, k_runs);
  if (sinks) {
    const double bound = error_bound<float>(max_error(plain_grads.dsinks, truth_grads.dsinks));
    INFO("dsinks: bound " << bound);
    CHECK(max_error(g.dsinks, truth_grads.dsinks) <= bound);
    CHECK(max_error(g.dsinks, single_grads.dsinks) <= bound);
  }
}

}  // namespace

TEST_CASE("all-to-all heads equals the single-process forward and backward",
          "[distributed][ulysses]") {
  if (4 % comm_size() != 0) {  // Hkv = 4 heads, split over the ranks
    WARN("all-to-all heads needs 1, 2 or 4 ranks here: skipped");
    return;
  }
  for (const SequenceSplit split : {SequenceSplit::contiguous, SequenceSplit::zigzag}) {
    attn::AttentionOptions<float> o;
    check_ulysses("no mask, L 37", 1, 37, 37, o, split);
    o.causal = attn::Causal::top_left;
    check_ulysses("causal top-left, L 3 (ranks without tokens)", 1, 3, 3, o, split);
    o.causal = attn::Causal::bottom_right;
    o.key_lengths = {30, 12};
    o.query_lengths = {21, 5};
    check_ulysses("causal bottom-right, ragged, Lq 21 Lk 30", 2, 21, 30, o, split);
    attn::AttentionOptions<float> w;
    w.window = {4, 2};
    w.sink_tokens = 2;
    w.alibi_slopes = attn::alibi_slopes<float>(8);
    w.sinks = {0.1f, 0.2f, -0.3f, 0.4f, 0.5f, -0.6f, 0.7f, 0.0f};
    check_ulysses("window, sink tokens, ALiBi, learned sinks", 1, 29, 29, w, split);
  }
}

TEST_CASE("all-to-all heads: heads that do not divide by the ranks are refused by every rank",
          "[distributed][ulysses][errors]") {
  const int P = comm_size(), rank = comm_rank();
  if (P < 2)
    return;
  const auto runs = token_runs(SequenceSplit::contiguous, 16, P, rank);
  const auto q = local_rows(random_tensor<float>(1, 3, 16, 8, 35), runs);
  const auto kv = local_rows(random_tensor<float>(1, 1, 16, 8, 36), runs);
  attn::Tensor<float, 4> out(1, 3, q.dimension(2), 8);
  CHECK_THROWS_WITH(attn::distributed::ulysses_attention_into<float>(
                        attn::bhld_view(q), attn::bhld_view(kv), attn::bhld_view(kv),
                        attn::bhld_view(out), {}, SequenceSplit::contiguous, MPI_COMM_WORLD),
                    Catch::Contains("ulysses_attention: Hq = 3 and Hkv = 1 must both be "
                                    "multiples of the number of ranks, " +
                                    std::to_string(P)));
}

TEST_CASE("all-to-all heads gives the same bits on every run and for any thread count",
          "[distributed][ulysses]") {
  const int P = comm_size(), rank = comm_rank();
  const Index L = 150, Hq = 8, Hkv = 4, D = 16;
  if (Hkv % P != 0) {
    WARN("all-to-all heads needs 1, 2 or 4 ranks here: skipped");
    return;
  }
  const auto runs = token_runs(SequenceSplit::zigzag, L, P, rank);
  const auto q = local_rows(random_tensor<float>(1, Hq, L, D, 37), runs);
  const auto kv = local_rows(random_tensor<float>(1, Hkv, L, D, 38), runs);
  attn::AttentionOptions<float> o;
  o.causal = attn::Causal::top_left;
  const auto run = [&] {
    attn::Tensor<float, 4> out(1, Hq, q.dimension(2), D);
    attn::distributed::ulysses_attention_into<float>(attn::bhld_view(q), attn::bhld_view(kv),
                                                     attn::bhld_view(kv), attn::bhld_view(out), o,
                                                     SequenceSplit::zigzag, MPI_COMM_WORLD);
    return out;
  };
  const auto first = run();
  CHECK(same_bits(first, run()));
#if defined(_OPENMP)
  const int threads = omp_get_max_threads();
  omp_set_num_threads(2);
  const auto two = run();
  omp_set_num_threads(threads);
  CHECK(same_bits(first, two));
#endif
}
