// attn/distributed/ring_backward.hpp: the ring's dq, dk and dv on every rank equal the
// single-process backward on the gathered tensors and the long double reference's gradients
// within twice the plain loops' error, for every case of ring_cases.hpp and both splits; the
// same bits on every run and for any number of threads; bad input refused by every rank.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include <attn/attention_backward.hpp>
#include <attn/distributed/ring.hpp>
#include <attn/distributed/ring_backward.hpp>

#include "distributed/ring_cases.hpp"
#include "distributed/support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using attn::Index;
using attn::distributed::SequenceSplit;
using attn::distributed::token_runs;
using namespace attn_dist_test;

void check_backward(const RingCase& c, SequenceSplit split, Index query_chunk) {
  const int P = comm_size(), rank = comm_rank();
  const auto q = random_tensor<float>(c.B, c.Hq, c.Lq, c.D, 11);
  const auto k = random_tensor<float>(c.B, c.Hkv, c.Lk, c.D, 12);
  const auto v = random_tensor<float>(c.B, c.Hkv, c.Lk, c.Dv, 13);
  const auto dout = random_tensor<float>(c.B, c.Hq, c.Lq, c.Dv, 14);
  const auto q_runs = token_runs(split, c.Lq, P, rank);
  const auto k_runs = token_runs(split, c.Lk, P, rank);
  const attn::distributed::RingOptions ring{split, nullptr, query_chunk};
  const bool sinks = !c.options.sinks.empty();
  const auto lq = local_rows(q, q_runs), lk = local_rows(k, k_runs), lv = local_rows(v, k_runs);
  const auto forward = attn::distributed::ring_attention<float>(
      lq, lk, lv, c.options, ring, MPI_COMM_WORLD, attn::Return::logsumexp);
  const auto grads = attn::distributed::ring_attention_backward<float>(
      lq, lk, lv, forward.out, forward.logsumexp, local_rows(dout, q_runs), c.options, ring,
      MPI_COMM_WORLD, sinks ? attn::Return::dsinks : attn::Return::nothing_else);
  const auto single =
      attn::scaled_dot_product_attention(q, k, v, c.options, attn::Return::logsumexp);
  const auto single_grads = attn::scaled_dot_product_attention_backward(
      q, k, v, single.out, single.logsumexp, dout, c.options,
      sinks ? attn::Return::dsinks : attn::Return::nothing_else);
  const ref::Problem p = reference_problem(c.options, c.B, c.Hq, c.Hkv, c.Lq, c.Lk, c.D, c.Dv);
  const auto truth = ref::gradients<long double>(p, as_long_double(q), as_long_double(k),
                                                 as_long_double(v), as_long_double(dout));
  const auto plain = ref::gradients<float>(p, as_long_double(q), as_long_double(k),
                                           as_long_double(v), as_long_double(dout));
  INFO(c.name << ", " << attn::distributed::split_name(split) << ", query chunk " << query_chunk
              << ", rank " << rank << " of " << P);
  const auto check = [&](const char* name, const auto& actual, const auto& true_values,
                         const auto& plain_values, const auto& single_values, Index heads,
                         Index length, Index width, const auto& runs) {
    const double bound = error_bound<float>(max_error(plain_values, true_values));
    const auto mine = [&](const auto& global) {
      return local_values(global, c.B, heads, length, width, runs);
    };
    const double error = max_error(as_vector(actual), mine(true_values));
    const double from_single = max_error(as_vector(actual), mine(as_vector(single_values)));
    INFO(name << ": error " << error << ", against the single-process call " << from_single
              << ", bound " << bound);
    CHECK(error <= bound);
    CHECK(from_single <= bound);
  };
  check("dq", grads.dq, truth.dq, plain.dq, single_grads.dq, c.Hq, c.Lq, c.D, q_runs);
  check("dk", grads.dk, truth.dk, plain.dk, single_grads.dk, c.Hkv, c.Lk, c.D, k_runs);
  check("dv", grads.dv, truth.dv, plain.dv, single_grads.dv, c.Hkv, c.Lk, c.Dv, k_runs);
  if (sinks) {  // the same (Hq) on every rank: the whole sequence's
    const double bound = error_bound<float>(max_error(plain.dsinks, truth.dsinks));
    const double error = max_error(grads.dsinks, truth.dsinks);
    const double from_single = max_error(grads.dsinks, single_grads.dsinks);
    INFO("dsinks: error " << error << ", against one process " << from_single << ", bound "
                          << bound);
    CHECK(error <= bound);
    CHECK(from_single <= bound);
  }
}

}  // namespace

TEST_CASE("ring attention's backward equals the single-process backward for every option",
          "[distributed][ring][backward]") {
  for (const RingCase& c : ring_cases()) {
    for (const Index chunk : {Index(0), Index(5)}) {  // whole runs, and calls of 5 query rows
      check_backward(c, SequenceSplit::contiguous, chunk);
      check_backward(c, SequenceSplit::zigzag, chunk);
    }
  }
}

TEST_CASE("ring attention's backward gives the same bits on every run and any thread count",
          "[distributed][ring][backward]") {
  const int P = comm_size(), rank = comm_rank();
  const Index B = 1, H = 4, L = 200, D = 16;
  const auto runs = token_runs(SequenceSplit::zigzag, L, P, rank);
  const auto q = local_rows(random_tensor<float>(B, H, L, D, 15), runs);
  const auto k = local_rows(random_tensor<float>(B, 2, L, D, 16), runs);
  const auto v = local_rows(random_tensor<float>(B, 2, L, D, 17), runs);
  const auto dout = local_rows(random_tensor<float>(B, H, L, D, 18), runs);
  attn::AttentionOptions<float> o;
  o.causal = attn::Causal::top_left;
  const attn::distributed::RingOptions ring{SequenceSplit::zigzag};
  const auto forward = attn::distributed::ring_attention<float>(q, k, v, o, ring, MPI_COMM_WORLD,
                                                                attn::Return::logsumexp);
  const auto run = [&] {
    return attn::distributed::ring_attention_backward<float>(
        q, k, v, forward.out, forward.logsumexp, dout, o, ring, MPI_COMM_WORLD);
  };
  const auto first = run();
  const auto second = run();
  CHECK(same_bits(first.dq, second.dq));
  CHECK(same_bits(first.dk, second.dk));
  CHECK(same_bits(first.dv, second.dv));
#if defined(_OPENMP)
  const int threads = omp_get_max_threads();
  omp_set_num_threads(2);
  const auto two = run();
  omp_set_num_threads(threads);
  CHECK(same_bits(first.dq, two.dq));
  CHECK(same_bits(first.dk, two.dk));
  CHECK(same_bits(first.dv, two.dv));
#endif
}

TEST_CASE("ring attention's backward: every rank throws when one rank's arguments are wrong",
          "[distributed][ring][backward][errors]") {
  const int P = comm_size(), rank = comm_rank();
  const Index L = 24, D = 8;
  const auto runs = token_runs(SequenceSplit::contiguous, L, P, rank);
  const auto x = local_rows(random_tensor<float>(1, 2, L, D, 19), runs);
  attn::Tensor<float, 3> lse(1, 2, x.dimension(2));
  lse.setZero();
  attn::AttentionOptions<float> o;
  const attn::distributed::RingOptions ring{SequenceSplit::contiguous};
  // dout of the wrong length on rank 0 only.
  const auto dout = rank == 0 ? random_tensor<float>(1, 2, x.dimension(2) + 1, D, 20) : x;
  CHECK_THROWS_WITH(attn::distributed::ring_attention_backward<float>(x, x, x, x, lse, dout, o,
                                                                      ring, MPI_COMM_WORLD),
                    Catch::Contains("ring_attention_backward: rank 0: dout is"));
  if (P < 2)
    return;
  attn::AttentionOptions<float> mine = o;
  if (rank == 1)
    mine.window = {3, -1};
  CHECK_THROWS_WITH(attn::distributed::ring_attention_backward<float>(x, x, x, x, lse, x, mine,
                                                                      ring, MPI_COMM_WORLD),
                    Catch::Contains("options.window.left is -1 on rank 0 but 3 on rank 1"));
}

TEST_CASE("ring attention in double: forward and backward within the double bound",
          "[distributed][ring][backward]") {
  const int P = comm_size(), rank = comm_rank();
  const Index Hq = 4, Hkv = 2, L = 45, D = 8;
  const auto q = random_tensor<double>(1, Hq, L, D, 51);
  const auto k = random_tensor<double>(1, Hkv, L, D, 52);
  const auto v = random_tensor<double>(1, Hkv, L, D, 53);
  const auto dout = random_tensor<double>(1, Hq, L, D, 54);
  attn::AttentionOptions<double> o;
  o.causal = attn::Causal::top_left;
  o.window = {9, -1};
  const auto runs = token_runs(SequenceSplit::zigzag, L, P, rank);
  const attn::distributed::RingOptions ring{SequenceSplit::zigzag, nullptr, 7};
  const auto lq = local_rows(q, runs), lk = local_rows(k, runs), lv = local_rows(v, runs);
  const auto forward = attn::distributed::ring_attention<double>(
      lq, lk, lv, o, ring, MPI_COMM_WORLD, attn::Return::logsumexp);
  const auto grads = attn::distributed::ring_attention_backward<double>(
      lq, lk, lv, forward.out, forward.logsumexp, local_rows(dout, runs), o, ring, MPI_COMM_WORLD);
  ref::Problem p;
  p.q_heads = Hq;
  p.kv_heads = Hkv;
  p.q_length = p.k_length = L;
  p.dim = p.value_dim = D;
  p.causal = ref::Causal::top_left;
  p.window_left = 9;
  const auto qe = as_long_double(q), ke = as_long_double(k), ve = as_long_double(v),
             de = as_long_double(dout);
  const auto truth = ref::attention<long double>(p, qe, ke, ve);
  const auto plain = ref::attention<double>(p, qe, ke, ve);
  const auto truth_g = ref::gradients<long double>(p, qe, ke, ve, de);
  const auto plain_g = ref::gradients<double>(p, qe, ke, ve, de);
  const auto within = [&](const auto& actual, const auto& t, const auto& pl, Index heads,
                          Index width) {
    const double bound = error_bound<double>(max_error(pl, t));
    const double error = max_error(as_vector(actual), local_values(t, 1, heads, L, width, runs));
    INFO("error " << error << ", bound " << bound);
    CHECK(error <= bound);
  };
  within(forward.out, truth.out, plain.out, Hq, D);
  within(forward.logsumexp, truth.lse, plain.lse, Hq, 1);
  within(grads.dq, truth_g.dq, plain_g.dq, Hq, D);
  within(grads.dk, truth_g.dk, plain_g.dk, Hkv, D);
  within(grads.dv, truth_g.dv, plain_g.dv, Hkv, D);
}
