// attn/distributed/split_cache.hpp: decoding against a cache split across the ranks equals
// the single-process KVCache::attend over all the tokens and the long double reference,
// with tokens dealt round-robin or in runs, ragged sequences and ranks holding none; the
// same bits on every rank; bad input refused by every rank.
#include <catch2/catch.hpp>

#include <vector>

#include <attn/distributed/sequence_split.hpp>
#include <attn/distributed/split_cache.hpp>
#include <attn/kv_cache.hpp>

#include "distributed/support.hpp"

namespace {

using attn::Index;
using namespace attn_dist_test;

/// The cache of the tokens `mine(b, t)` chooses of global k, v (B, Hkv, L, D), with n[b]
/// tokens in sequence b.
template <class Mine>
attn::KVCache<float> part_of(const attn::Tensor<float, 4>& k, const attn::Tensor<float, 4>& v,
                             const std::vector<Index>& n, const Mine& mine) {
  const Index B = k.dimension(0), H = k.dimension(1), L = k.dimension(2);
  attn::Tensor<float, 4> kp(B, H, L, k.dimension(3)), vp(B, H, L, v.dimension(3));
  kp.setZero();
  vp.setZero();
  std::vector<Index> counts(static_cast<std::size_t>(B), 0);
  for (Index b = 0; b < B; ++b) {
    for (Index t = 0; t < n[static_cast<std::size_t>(b)]; ++t) {
      if (!mine(b, t))
        continue;
      const Index row = counts[static_cast<std::size_t>(b)]++;
      for (Index h = 0; h < H; ++h) {
        for (Index e = 0; e < k.dimension(3); ++e)
          kp(b, h, row, e) = k(b, h, t, e);
        for (Index e = 0; e < v.dimension(3); ++e)
          vp(b, h, row, e) = v(b, h, t, e);
      }
    }
  }
  attn::KVCache<float> cache(B, H, k.dimension(3), v.dimension(3), L);
  cache.append(kp, vp, counts);
  return cache;
}

void check_split_cache(Index Lq, const std::vector<Index>& n, bool round_robin,
                       const attn::AttentionOptions<float>& options) {
  const int P = comm_size(), rank = comm_rank();
  const Index B = static_cast<Index>(n.size()), Hq = 4, Hkv = 2, D = 8, Dv = 6;
  const Index L = *std::max_element(n.begin(), n.end());
  const auto q = random_tensor<float>(B, Hq, Lq, D, 21);
  const auto k = random_tensor<float>(B, Hkv, L, D, 22);
  const auto v = random_tensor<float>(B, Hkv, L, Dv, 23);
  const auto mine = [&](Index b, Index t) {
    if (round_robin)
      return t % P == rank;
    const Index nb = n[static_cast<std::size_t>(b)];
    return t >= rank * nb / P && t < (rank + 1) * nb / P;  // contiguous runs
  };
  const attn::KVCache<float> part = part_of(k, v, n, mine);
  attn::Tensor<float, 4> out(B, Hq, Lq, Dv);
  attn::Tensor<float, 3> lse(B, Hq, Lq);
  attn::distributed::SplitCacheOptions split;
  split.newest_rank = Lq > 1 ? P - 1 : -1;  // runs: the last rank holds the newest tokens
  attn::distributed::split_cache_attend_into(part, attn::bhld_view(q),
                                             {attn::bhld_view(out), attn::bhl_view(lse)}, options,
                                             split, MPI_COMM_WORLD);
  // One process: every token in one cache.
  const attn::KVCache<float> whole = part_of(k, v, n, [](Index, Index) { return true; });
  attn::Tensor<float, 4> single(B, Hq, Lq, Dv);
  attn::Tensor<float, 3> single_lse(B, Hq, Lq);
  whole.attend_into(attn::bhld_view(q), {attn::bhld_view(single), attn::bhl_view(single_lse)},
                    options);
  ref::Problem p;
  p.batch = B;
  p.q_heads = Hq;
  p.kv_heads = Hkv;
  p.q_length = Lq;
  p.k_length = L;
  p.dim = D;
  p.value_dim = Dv;
  p.causal = ref::Causal::bottom_right;
  p.key_lengths = n;
  if (options.softcap)
    p.softcap = *options.softcap;
  for (const float z : options.sinks)
    p.sinks.push_back(z);
  const auto truth =
      ref::attention<long double>(p, as_long_double(q), as_long_double(k), as_long_double(v));
  const auto plain =
      ref::attention<float>(p, as_long_double(q), as_long_double(k), as_long_double(v));
  const double out_bound = error_bound<float>(max_error(plain.out, truth.out));
  const double lse_bound = error_bound<float>(max_error(plain.lse, truth.lse));
  INFO("Lq " << Lq << (round_robin ? ", round-robin" : ", runs") << ", rank " << rank << " of "
             << P);
  CHECK(max_error(as_vector(out), truth.out) <= out_bound);
  CHECK(max_error(as_vector(lse), truth.lse) <= lse_bound);
  CHECK(max_error(as_vector(out), as_vector(single)) <= out_bound);
  CHECK(max_error(as_vector(lse), as_vector(single_lse)) <= lse_bound);
  // Every rank holds the same bits.
  std::vector<float> all(static_cast<std::size_t>(out.size() * P));
  MPI_Allgather(out.data(), static_cast<int>(out.size()), MPI_FLOAT, all.data(),
                static_cast<int>(out.size()), MPI_FLOAT, MPI_COMM_WORLD);
  bool same = true;
  for (int r = 0; r < P; ++r)
    same = same && std::memcmp(all.data() + r * out.size(), out.data(),
                               static_cast<std::size_t>(out.size()) * sizeof(float)) == 0;
  CHECK(same);
}

}  // namespace

TEST_CASE("decoding against a split cache equals one process over all the tokens",
          "[distributed][split_cache]") {
  attn::AttentionOptions<float> plain;
  attn::AttentionOptions<float> sinks;
  sinks.sinks = {0.3f, -0.5f, 1.0f, 0.0f};
  sinks.softcap = 5.0f;
  for (const bool round_robin : {true, false}) {
    check_split_cache(1, {37, 20, 2}, round_robin, plain);  // sequence 2: ranks without tokens
    check_split_cache(1, {37, 20, 2}, round_robin, sinks);
  }
  check_split_cache(1, {1}, true, plain);        // ranks whose whole part is empty
  check_split_cache(3, {41, 25}, false, plain);  // the newest rank's causal mask
  check_split_cache(3, {41, 25}, false, sinks);
}

TEST_CASE("a split cache: every rank throws when one rank's arguments are wrong",
          "[distributed][split_cache][errors]") {
  const int P = comm_size(), rank = comm_rank();
  attn::KVCache<float> part(1, 2, 8, 8, 16);
  const auto kv = random_tensor<float>(1, 2, 4, 8, 24);
  part.append(kv, kv);
  const auto q = random_tensor<float>(1, 2, rank == P - 1 ? 2 : 1, 8, 25);
  attn::Tensor<float, 4> out(1, 2, q.dimension(2), 8);
  attn::AttentionOptions<float> o;
  if (P > 1) {
    CHECK_THROWS_WITH(
        attn::distributed::split_cache_attend_into(part, attn::bhld_view(q), attn::bhld_view(out),
                                                   o, {}, MPI_COMM_WORLD),
        Catch::Contains(
            "split_cache_attend: the ranks' arguments differ: Lq is 1 on rank 0 but 2"));
  }
  o.window = {3, -1};
  CHECK_THROWS_WITH(attn::distributed::split_cache_attend_into(
                        part, attn::bhld_view(q), attn::bhld_view(out), o, {}, MPI_COMM_WORLD),
                    Catch::Contains("options.window is given"));
}
