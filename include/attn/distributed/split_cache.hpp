// attn/distributed/split_cache.hpp: decoding against one cache split across ranks
// (vLLM's decode context parallelism).
//
//   cache      KVCache<S, SV>     this rank's part of every sequence's tokens: (B, Hkv, n_r(b), D)
//   q          (B, Hq, Lq, D)     the new queries, the same on every rank
//   out        (B, Hq, Lq, Dv)    the attention over every rank's part, on every rank
//   logsumexp  (B, Hq, Lq)        optional: its log-sum-exp
//
// Each rank attends its own part with its log-sum-exp (KVCache::attend_all_into: every
// query sees every token of the part; on the rank `newest_rank`, whose part ends with the Lq
// new tokens, KVCache::attend_into with the causal mask among them), then one MPI_Allgather
// of the P states (out, lse) and merge_attention_states in rank order, on every rank, give
// the attention over all the tokens: the same bits on every rank and every run. Learned
// sinks join once, in the merge. A rank's part may be empty for a sequence (its state then
// weighs nothing). Which token lies on which rank does not matter to the result (no option
// here measures positions), so parts may be runs or round-robin tokens alike.
//
// Each rank sends B Hq Lq (Dv + 1) values of the compute type to every other.
// Extra memory per rank: P states of B Hq Lq (Dv + 1) values.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "attn/config.hpp"
#include "attn/distributed/agreement.hpp"
#include "attn/distributed/ring_transfer.hpp"
#include "attn/kv_cache.hpp"
#include "attn/merge.hpp"
#include "attn/options.hpp"
#include "attn/outputs.hpp"
#include "attn/tensor.hpp"

namespace attn::distributed {

/// Which rank's part of the cache ends with the new tokens (the causal mask among the Lq new
/// queries applies there); -1: none does, every query sees every cached token (decoding
/// one token whose keys are already appended somewhere is either).
struct SplitCacheOptions {
  int newest_rank = -1;
};

namespace detail {

/// The local checks of split_cache_attend_into, as a message ("" when fine).
template <class S, class SV, class C>
std::string local_split_cache_error(const char* function, const KVCache<S, SV>& cache,
                                    const HeadsView<const C>& q,  // (B, Hq, Lq, D)
                                    const AttentionOutputViews<C>& outputs,
                                    const AttentionOptions<C>& options, int newest_rank, int rank) {
  try {
    if (q.batch != cache.batch() || q.dim != cache.dim() || q.heads % cache.kv_heads() != 0) {
      attn::detail::throw_invalid_argument(
          function, "q is " + attn::detail::shape_string({q.batch, q.heads, q.length, q.dim}) +
                        " but the cache holds (B, Hkv, D) = " +
                        attn::detail::shape_string({cache.batch(), cache.kv_heads(), cache.dim()}) +
                        ": B and D must match and Hq be a multiple of Hkv");
    }
    attn::detail::check_output_shape(function, q, cache.value_dim(), outputs.out);
    if (outputs.logsumexp)
      attn::detail::check_rows_shape(function, "logsumexp", *outputs.logsumexp, q);
    if (outputs.weights)
      attn::detail::throw_invalid_argument(function, "weights are not available");
    const char* refused = options.causal != Causal::none                          ? "causal"
                          : options.window.left >= 0 || options.window.right >= 0 ? "window"
                          : options.sink_tokens > 0                               ? "sink_tokens"
                          : !options.key_lengths.empty()                          ? "key_lengths"
                          : !options.query_lengths.empty()                        ? "query_lengths"
                          : !options.keep_mask.empty()                            ? "keep_mask"
                          : !options.bias.empty()                                 ? "bias"
                          : !options.alibi_slopes.empty()                         ? "alibi_slopes"
                          : options.mask_mod                                      ? "mask_mod"
                          : !options.block_mask.empty()                           ? "block_mask"
                          : options.score_mod                                     ? "score_mod"
                          : options.dropout_p != 0                                ? "dropout_p"
                                                                                  : nullptr;
    if (refused != nullptr) {
      attn::detail::throw_invalid_argument(
          function, std::string("options.") + refused +
                        " is given: a split cache supports scale, softcap and learned sinks "
                        "(the causal mask is SplitCacheOptions::newest_rank's)");
    }
    if (rank == newest_rank) {
      for (Index b = 0; b < q.batch; ++b) {
        if (cache.lengths()[static_cast<std::size_t>(b)] < q.length) {
          attn::detail::throw_invalid_argument(
              function, "sequence " + std::to_string(b) + " holds " +
                            std::to_string(cache.lengths()[static_cast<std::size_t>(b)]) +
                            " tokens on the newest rank, fewer than the " +
                            std::to_string(q.length) + " new queries");
        }
      }
    }
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return {};
}

}  // namespace detail

/// The attention of q (B, Hq, Lq, D) over every rank's part of the cache, written on every
/// rank into outputs.out (B, Hq, Lq, Dv) and, when given, outputs.logsumexp (B, Hq, Lq).
/// Collective over `comm`: the same q, options and split options on every rank, each its own
/// part. Throws std::invalid_argument on every rank, before anything is written, when one
/// rank's arguments are wrong or the ranks disagree.
template <class S, class SV>
void split_cache_attend_into(
    const KVCache<S, SV>& cache,
    const HeadsView<const typename KVCache<S, SV>::compute_type>& q,             // (B, Hq, Lq, D)
    const AttentionOutputViews<typename KVCache<S, SV>::compute_type>& outputs,  // (B, Hq, Lq, Dv)
    const AttentionOptions<typename KVCache<S, SV>::compute_type>& options,
    const SplitCacheOptions& split, MPI_Comm comm) {
  using C = typename KVCache<S, SV>::compute_type;
  constexpr const char* function = "split_cache_attend";
  int rank = 0, ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  std::string error = detail::local_split_cache_error(function, cache, q, outputs, options,
                                                      split.newest_rank, rank);
  if (error.empty() && (split.newest_rank < -1 || split.newest_rank >= ranks)) {
    error = std::string(function) + ": newest_rank is " + std::to_string(split.newest_rank) +
            ": must be -1 or a rank of the " + std::to_string(ranks);
  }
  const auto i64 = [](auto x) { return static_cast<std::int64_t>(x); };
  std::vector<detail::SignatureField> fields = {
      {"B", i64(q.batch)},
      {"Hq", i64(q.heads)},
      {"Lq", i64(q.length)},
      {"D", i64(q.dim)},
      {"Hkv", i64(cache.kv_heads())},
      {"Dv", i64(cache.value_dim())},
      {"newest_rank", i64(split.newest_rank)},
      {"options.scale given", i64(options.scale.has_value())},
      {"options.scale", detail::double_bits(double(options.scale.value_or(C(0)))), true, true},
      {"options.softcap given", i64(options.softcap.has_value())},
      {"options.softcap", detail::double_bits(double(options.softcap.value_or(C(0)))), true, true},
      {"options.sinks.size()", i64(options.sinks.size())}};
  detail::agree_or_throw(function, comm, fields, error);
  std::vector<detail::SignatureField> sinks;
  for (const C z : options.sinks)
    sinks.push_back({"options.sinks[h]", detail::double_bits(double(z)), true, true});
  detail::agree_or_throw(function, comm, sinks, "");
  // This rank's state, (B, Hq, Lq, Dv) then (B, Hq, Lq), contiguous for the gather.
  const Index B = q.batch, Hq = q.heads, Lq = q.length, Dv = cache.value_dim();
  const Index state_size = B * Hq * Lq * (Dv + 1);
  if (state_size > Index(1) << 30)  // MPI counts are int; the same answer on every rank
    attn::detail::throw_invalid_argument(function, "a state of over 2^30 values");
  std::vector<C> states(static_cast<std::size_t>(state_size * ranks));
  std::vector<C> mine(static_cast<std::size_t>(state_size));
  AttentionOptions<C> part_options = options;
  part_options.sinks.clear();  // once, in the merge
  const AttentionOutputViews<C> part(bhld_view(mine.data(), B, Hq, Lq, Dv),
                                     bhl_view(mine.data() + B * Hq * Lq * Dv, B, Hq, Lq));
  if (rank == split.newest_rank)
    cache.attend_into(q, part, part_options);
  else
    cache.attend_all_into(q, part, part_options);
  detail::check_mpi(
      function,
      MPI_Allgather(mine.data(), static_cast<int>(state_size), detail::mpi_type<C>(), states.data(),
                    static_cast<int>(state_size), detail::mpi_type<C>(), comm),
      "MPI_Allgather of the states");
  std::vector<AttentionState<C>> all;
  for (int r = 0; r < ranks; ++r) {
    C* base = states.data() + r * state_size;
    all.push_back({bhld_view<const C>(base, B, Hq, Lq, Dv),
                   bhl_view<const C>(base + B * Hq * Lq * Dv, B, Hq, Lq)});
  }
  merge_attention_states<C>(all, outputs, options.sinks);
}

}  // namespace attn::distributed
