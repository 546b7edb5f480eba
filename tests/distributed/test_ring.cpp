// attn/distributed/ring.hpp: ring attention's forward on every rank of MPI_COMM_WORLD equals
// the single-process call on the gathered tensors and the long double reference, within
// twice the plain loops' error, for every option a ring supports and both splits; the same
// bits on every run and for any number of threads; bad input refused by every rank.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include <attn/distributed.hpp>

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

/// The ring's rows of one case against the single-process call and the reference.
void check_forward(const RingCase& c, SequenceSplit split, Index query_chunk) {
  const int P = comm_size(), rank = comm_rank();
  const auto q = random_tensor<float>(c.B, c.Hq, c.Lq, c.D, 1);
  const auto k = random_tensor<float>(c.B, c.Hkv, c.Lk, c.D, 2);
  const auto v = random_tensor<float>(c.B, c.Hkv, c.Lk, c.Dv, 3);
  const auto q_runs = token_runs(split, c.Lq, P, rank);
  const auto k_runs = token_runs(split, c.Lk, P, rank);
  attn::distributed::RingStats stats;
  const auto ring = attn::distributed::ring_attention<float>(
      local_rows(q, q_runs), local_rows(k, k_runs), local_rows(v, k_runs), c.options,
      {split, &stats, query_chunk}, MPI_COMM_WORLD, attn::Return::logsumexp);
  const auto single =
      attn::scaled_dot_product_attention(q, k, v, c.options, attn::Return::logsumexp);
  const ref::Problem p = reference_problem(c.options, c.B, c.Hq, c.Hkv, c.Lq, c.Lk, c.D, c.Dv);
  const auto truth =
      ref::attention<long double>(p, as_long_double(q), as_long_double(k), as_long_double(v));
  const auto plain =
      ref::attention<float>(p, as_long_double(q), as_long_double(k), as_long_double(v));
  const double out_bound = error_bound<float>(max_error(plain.out, truth.out));
  const double lse_bound = error_bound<float>(max_error(plain.lse, truth.lse));
  const auto mine = [&](const auto& global, Index width) {
    return local_values(global, c.B, c.Hq, c.Lq, width, q_runs);
  };
  INFO(c.name << ", " << attn::distributed::split_name(split) << ", query chunk " << query_chunk
              << ", rank " << rank << " of " << P);
  const double out_error = max_error(as_vector(ring.out), mine(truth.out, c.Dv));
  const double lse_error = max_error(as_vector(ring.logsumexp), mine(truth.lse, 1));
  INFO("out error " << out_error << " (bound " << out_bound << "), lse error " << lse_error
                    << " (bound " << lse_bound << ")");
  CHECK(out_error <= out_bound);
  CHECK(lse_error <= lse_bound);
  CHECK(max_error(as_vector(ring.out), mine(as_vector(single.out), c.Dv)) <= out_bound);
  CHECK(max_error(as_vector(ring.logsumexp), mine(as_vector(single.logsumexp), 1)) <= lse_bound);
  CHECK(stats.steps == P);
}

}  // namespace

TEST_CASE("ring attention equals the single-process call for every option and split",
          "[distributed][ring]") {
  for (const RingCase& c : ring_cases()) {
    for (const Index chunk : {Index(0), Index(5)}) {  // whole runs, and calls of 5 query rows
      check_forward(c, SequenceSplit::contiguous, chunk);
      check_forward(c, SequenceSplit::zigzag, chunk);
    }
  }
}

TEST_CASE("ring attention sends P - 1 blocks and skips blocks no query sees",
          "[distributed][ring]") {
  const int P = comm_size(), rank = comm_rank();
  const Index B = 1, H = 2, L = 64, D = 8;
  const auto q = random_tensor<float>(B, H, L, D, 4);
  attn::AttentionOptions<float> o;
  o.causal = attn::Causal::top_left;
  const auto runs = token_runs(SequenceSplit::contiguous, L, P, rank);
  attn::distributed::RingStats stats;
  const auto local = local_rows(q, runs);
  attn::distributed::ring_attention<float>(local, local, local, o,
                                           {SequenceSplit::contiguous, &stats}, MPI_COMM_WORLD);
  CHECK(stats.steps == P);
  // Rank r's queries see the blocks of ranks 0..r only (contiguous and causal).
  CHECK(stats.blocks_computed == rank + 1);
  Index sent = 0;
  for (int s = 0; s + 1 < P; ++s) {
    const int source = (rank - s + P) % P;
    sent += B * H * attn::distributed::local_length(SequenceSplit::contiguous, L, P, source) * 2 *
            D * Index(sizeof(float));
  }
  CHECK(stats.bytes_sent == sent);
}

TEST_CASE("ring attention gives the same bits on every run and for any thread count",
          "[distributed][ring]") {
  const int P = comm_size(), rank = comm_rank();
  const Index B = 1, H = 4, L = 300, D = 16;
  const auto q = random_tensor<float>(B, H, L, D, 5);
  const auto k = random_tensor<float>(B, 2, L, D, 6);
  const auto v = random_tensor<float>(B, 2, L, D, 7);
  attn::AttentionOptions<float> o;
  o.causal = attn::Causal::top_left;
  const auto runs = token_runs(SequenceSplit::zigzag, L, P, rank);
  const auto lq = local_rows(q, runs), lk = local_rows(k, runs), lv = local_rows(v, runs);
  const auto run = [&] {
    return attn::distributed::ring_attention<float>(lq, lk, lv, o, {SequenceSplit::zigzag},
                                                    MPI_COMM_WORLD, attn::Return::logsumexp);
  };
  const auto first = run();
  const auto second = run();
  CHECK(same_bits(first.out, second.out));
  CHECK(same_bits(first.logsumexp, second.logsumexp));
#if defined(_OPENMP)
  const int threads = omp_get_max_threads();
  omp_set_num_threads(2);
  const auto two = run();
  omp_set_num_threads(threads);
  CHECK(same_bits(first.out, two.out));
  CHECK(same_bits(first.logsumexp, two.logsumexp));
#endif
}

TEST_CASE("ring attention: every rank throws when one rank's arguments differ",
          "[distributed][ring][errors]") {
  const int P = comm_size(), rank = comm_rank();
  const Index L = 20;
  const auto runs = token_runs(SequenceSplit::contiguous, L, P, rank);
  const auto local = [&](Index D) { return local_rows(random_tensor<float>(1, 2, L, D, 8), runs); };
  attn::AttentionOptions<float> o;
  const attn::distributed::RingOptions ring{SequenceSplit::contiguous};
  const int last = P - 1;

  if (P < 2)  // the sections below need a second rank to disagree with
    return;
  SECTION("a head dim that differs on the last rank") {
    const auto x = local(rank == last ? 9 : 8);
    CHECK_THROWS_WITH(attn::distributed::ring_attention<float>(x, x, x, o, ring, MPI_COMM_WORLD),
                      Catch::Contains("ring_attention: the ranks' arguments differ: D is 8 on "
                                      "rank 0 but 9 on rank " +
                                      std::to_string(last)));
  }
  SECTION("options that differ on the last rank") {
    const auto x = local(8);
    attn::AttentionOptions<float> mine = o;
    if (rank == last)
      mine.causal = attn::Causal::top_left;
    CHECK_THROWS_WITH(
        attn::distributed::ring_attention<float>(x, x, x, mine, ring, MPI_COMM_WORLD),
        Catch::Contains("options.causal is 0 on rank 0 but 1 on rank " + std::to_string(last)));
    if (rank == last)
      mine.key_lengths = {3};
    else
      mine = o;
    CHECK_THROWS_WITH(attn::distributed::ring_attention<float>(x, x, x, mine, ring, MPI_COMM_WORLD),
                      Catch::Contains("the ranks' arguments differ"));
  }
  SECTION("key lengths whose values differ") {
    const auto x = local(8);
    attn::AttentionOptions<float> mine = o;
    mine.key_lengths = {rank == last ? Index(5) : Index(6)};
    CHECK_THROWS_WITH(attn::distributed::ring_attention<float>(x, x, x, mine, ring, MPI_COMM_WORLD),
                      Catch::Contains("options.key_lengths[b] is 6 on rank 0 but 5 on rank"));
  }
  SECTION("a bad output on rank 0 only, the outputs left unchanged") {
    const auto x = local(8);
    attn::Tensor<float, 4> out(1, 2, x.dimension(2) + (rank == 0 ? 1 : 0), 8);
    out.setConstant(7.0f);
    CHECK_THROWS_WITH(attn::distributed::ring_attention_into<float>(
                          attn::bhld_view(x), attn::bhld_view(x), attn::bhld_view(x),
                          attn::bhld_view(out), o, ring, MPI_COMM_WORLD),
                      Catch::Contains("ring_attention: rank 0: out is"));
    bool unchanged = true;
    for (Index n = 0; n < out.size(); ++n)
      unchanged = unchanged && out.data()[n] == 7.0f;
    CHECK(unchanged);
  }
  SECTION("a rank holding the wrong number of tokens") {
    // Rank 0 holds three rows too many: no split of the total gives it that many.
    const Index mine = attn::distributed::local_length(SequenceSplit::contiguous, L, P, rank);
    const auto x = random_tensor<float>(1, 2, mine + (rank == 0 ? 3 : 0), 8, 8);
    CHECK_THROWS_WITH(attn::distributed::ring_attention<float>(x, x, x, o, ring, MPI_COMM_WORLD),
                      Catch::Contains("but the contiguous split of"));
  }
  SECTION("weights, which a ring cannot give") {
    const auto x = local(8);
    CHECK_THROWS_WITH(attn::distributed::ring_attention<float>(x, x, x, o, ring, MPI_COMM_WORLD,
                                                               attn::Return::weights),
                      Catch::Contains("weights are not available from a ring"));
  }
  SECTION("an option a ring does not support") {
    const auto x = local(8);
    attn::AttentionOptions<float> mine = o;
    mine.alibi_slopes = {0.5f, 0.25f};
    CHECK_THROWS_WITH(attn::distributed::ring_attention<float>(x, x, x, mine, ring, MPI_COMM_WORLD),
                      Catch::Contains("options.alibi_slopes is given"));
  }
}

TEST_CASE("ring attention on a sub-communicator: each half of the ranks its own sequence",
          "[distributed][ring]") {
  const int world_rank = comm_rank();
  // A data-parallel x context-parallel grid: ranks of one colour share one sequence.
  const int colour = comm_size() >= 2 ? world_rank % 2 : 0;
  MPI_Comm half = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, colour, world_rank, &half);
  const int P = comm_size(half), rank = comm_rank(half);
  const Index L = 41, H = 2, D = 8;
  const auto unsigned_colour = static_cast<unsigned>(colour);
  const auto q = random_tensor<float>(1, H, L, D, 60 + unsigned_colour);
  const auto k = random_tensor<float>(1, H, L, D, 62 + unsigned_colour);
  const auto v = random_tensor<float>(1, H, L, D, 64 + unsigned_colour);
  attn::AttentionOptions<float> o;
  o.causal = attn::Causal::top_left;
  const auto runs = token_runs(SequenceSplit::zigzag, L, P, rank);
  const auto ring = attn::distributed::ring_attention<float>(
      local_rows(q, runs), local_rows(k, runs), local_rows(v, runs), o, {SequenceSplit::zigzag},
      half);
  const auto single = attn::scaled_dot_product_attention(q, k, v, o);
  const ref::Problem p = reference_problem(o, 1, H, H, L, L, D, D);
  const auto truth =
      ref::attention<long double>(p, as_long_double(q), as_long_double(k), as_long_double(v));
  const auto plain =
      ref::attention<float>(p, as_long_double(q), as_long_double(k), as_long_double(v));
  const double bound = error_bound<float>(max_error(plain.out, truth.out));
  INFO("colour " << colour << ", rank " << rank << " of " << P);
  CHECK(max_error(as_vector(ring.out), local_values(truth.out, 1, H, L, D, runs)) <= bound);
  CHECK(max_error(as_vector(ring.out), local_values(as_vector(single), 1, H, L, D, runs)) <= bound);
  MPI_Comm_free(&half);
}
