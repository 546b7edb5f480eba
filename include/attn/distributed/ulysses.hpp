// attn/distributed/ulysses.hpp: all-to-all heads (DeepSpeed-Ulysses), forward and backward.
//
//   q          (B, Hq,  lq, D)    this rank's runs of the Lq rows (sequence_split.hpp)
//   k          (B, Hkv, lk, D)    this rank's runs of the Lk rows
//   v          (B, Hkv, lk, Dv)
//   out        (B, Hq,  lq, Dv)   this rank's rows of the result
//   logsumexp  (B, Hq,  lq)       optional
//
// One all-to-all turns the sequence split into a head split: rank g receives every row of
// query heads [g Hq / P, (g + 1) Hq / P) and of the key/value heads they read (grouped-query
// heads stay together since Hkv divides by P too), runs one ordinary attention call over
// whole sequences with every option of the ring plus ALiBi (slopes and learned sinks cut to
// its heads), and a second all-to-all turns the result back. Hq and Hkv must be multiples of
// P: otherwise every rank throws std::invalid_argument. Each rank sends (P - 1) / P of its
// q, k and v and of its out and log-sum-exp (the backward: of q, k, v, out, dout, lse,
// then dq, dk, dv). Deterministic: one attention call per rank.
//
// Extra memory per rank: the head group's whole-sequence q, k, v, out and lse (the backward
// adds dout, dq, dk, dv), plus the all-to-all buffers.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "attn/attention_backward.hpp"
#include "attn/config.hpp"
#include "attn/distributed/head_exchange.hpp"
#include "attn/distributed/ring.hpp"
#include "attn/distributed/ring_backward.hpp"
#include "attn/distributed/ring_blocks.hpp"
#include "attn/options.hpp"
#include "attn/outputs.hpp"
#include "attn/tensor.hpp"

namespace attn::distributed {

namespace detail {

/// Throws (on every rank alike: the layout is agreed) unless the heads divide by the ranks;
/// returns the options of this rank's head group (sinks and ALiBi slopes cut to it).
template <class T>
AttentionOptions<T> head_group_options(const char* function, const RingLayout& layout,
                                       const AttentionOptions<T>& options) {
  if (layout.q_heads % layout.ranks != 0 || layout.kv_heads % layout.ranks != 0) {
    attn::detail::throw_invalid_argument(
        function, "Hq = " + std::to_string(layout.q_heads) +
                      " and Hkv = " + std::to_string(layout.kv_heads) +
                      " must both be multiples of the number of ranks, " +
                      std::to_string(layout.ranks) + " (all-to-all heads splits the heads)");
  }
  const Index group = layout.q_heads / layout.ranks;
  const auto cut = [&](const std::vector<T>& per_head) {
    if (per_head.empty())
      return per_head;
    const auto first = per_head.begin() + layout.rank * group;
    return std::vector<T>(first, first + group);
  };
  AttentionOptions<T> o = options;
  o.sinks = cut(options.sinks);
  o.alibi_slopes = cut(options.alibi_slopes);
  return o;
}

template <class T>
HeadsView<T> full_view(std::vector<T>& data, const RingLayout& layout, Index heads, Index length,
                       Index dim) {
  return bhld_view(data.data(), layout.batch, heads / layout.ranks, length, dim);
}

}  // namespace detail

/// Attention of this rank's rows over the whole sequence by all-to-all heads, written into
/// outputs.out (B, Hq, lq, Dv) and, when given, outputs.logsumexp (B, Hq, lq). Collective
/// over `comm`, with the ring's agreement (every rank throws alike, before anything is
/// written). float or double.
template <class T>
void ulysses_attention_into(const HeadsView<const T>& q,  // (B, Hq, lq, D)
                            const HeadsView<const T>& k,  // (B, Hkv, lk, D)
                            const HeadsView<const T>& v,  // (B, Hkv, lk, Dv)
                            const attn::detail::identity_t<AttentionOutputViews<T>>& outputs,
                            const attn::detail::identity_t<AttentionOptions<T>>& options,
                            SequenceSplit split, MPI_Comm comm) {
  constexpr const char* function = "ulysses_attention";
  std::string error = detail::local_ring_error(function, q, k, v, options, true);
  if (error.empty())
    error = detail::local_forward_error(function, q, k, v, outputs);
  const detail::RingLayout layout =
      detail::agree_on_ring(function, comm, q, k, v, options, RingOptions{split}, error);
  const AttentionOptions<T> group = detail::head_group_options(function, layout, options);
  std::vector<T> qf = detail::sequence_to_heads(function, comm, q, layout.q_runs, layout.q_length);
  std::vector<T> kf = detail::sequence_to_heads(function, comm, k, layout.k_runs, layout.k_length);
  std::vector<T> vf = detail::sequence_to_heads(function, comm, v, layout.k_runs, layout.k_length);
  const Index Lq = layout.q_length, Lk = layout.k_length, Dv = layout.value_dim;
  std::vector<T> outf(
      static_cast<std::size_t>(layout.batch * layout.q_heads / layout.ranks * Lq * Dv));
  std::vector<T> lsef(static_cast<std::size_t>(layout.batch * layout.q_heads / layout.ranks * Lq));
  const RowsView<T> lse_view =
      bhl_view(lsef.data(), layout.batch, layout.q_heads / layout.ranks, Lq);
  attn::detail::attention_into<T, T, T>(
      function, detail::full_view(qf, layout, layout.q_heads, Lq, layout.dim),
      detail::full_view(kf, layout, layout.kv_heads, Lk, layout.dim),
      detail::full_view(vf, layout, layout.kv_heads, Lk, Dv),
      AttentionOutputViews<T>(detail::full_view(outf, layout, layout.q_heads, Lq, Dv), lse_view),
      group);
  detail::heads_to_sequence(function, comm, outf, outputs.out, layout.q_runs, Lq);
  // Always exchanged, so that the ranks make the same calls whoever asked for it.
  std::vector<T> own_lse;
  HeadsView<T> lse_rows;
  if (outputs.logsumexp) {
    lse_rows = attn::detail::rows_as_heads(*outputs.logsumexp);
  } else {
    own_lse.resize(static_cast<std::size_t>(q.batch * q.heads * q.length));
    lse_rows = attn::detail::rows_as_heads(bhl_view(own_lse.data(), q.batch, q.heads, q.length));
  }
  detail::heads_to_sequence(function, comm, lsef, lse_rows, layout.q_runs, Lq);
}

/// The gradients of ulysses_attention (the same as ring_attention_backward's: `out` and
/// `logsumexp` of the forward), written into grads.dq (B, Hq, lq, D), grads.dk (B, Hkv, lk,
/// D) and grads.dv (B, Hkv, lk, Dv), and grads.dsinks (Hq) when given with learned sinks.
/// Collective over `comm`, with the ring's agreement.
template <class T>
void ulysses_attention_backward_into(
    const HeadsView<const T>& q,                                       // (B, Hq, lq, D)
    const HeadsView<const T>& k,                                       // (B, Hkv, lk, D)
    const HeadsView<const T>& v,                                       // (B, Hkv, lk, Dv)
    const HeadsView<const T>& out,                                     // (B, Hq, lq, Dv)
    const RowsView<const T>& logsumexp,                                // (B, Hq, lq)
    const HeadsView<const T>& dout,                                    // (B, Hq, lq, Dv)
    const attn::detail::identity_t<AttentionGradientViews<T>>& grads,  // dq, dk, dv
    const attn::detail::identity_t<AttentionOptions<T>>& options, SequenceSplit split,
    MPI_Comm comm) {
  constexpr const char* function = "ulysses_attention_backward";
  std::string error = detail::local_ring_error(function, q, k, v, options, true);
  if (error.empty()) {
    try {
      if (grads.dbias) {
        attn::detail::throw_invalid_argument(function,
                                             "grads.dbias is not available from all-to-all heads");
      }
      attn::detail::check_backward_arguments(function, q, k, v, out, logsumexp, dout, grads,
                                             options);
    } catch (const std::invalid_argument& e) {
      error = e.what();
    }
  }
  const detail::RingLayout layout =
      detail::agree_on_ring(function, comm, q, k, v, options, RingOptions{split}, error);
  const AttentionOptions<T> group = detail::head_group_options(function, layout, options);
  const Index Lq = layout.q_length, Lk = layout.k_length, D = layout.dim, Dv = layout.value_dim;
  const Index Hq = layout.q_heads, Hkv = layout.kv_heads;
  const auto to_heads = [&](const HeadsView<const T>& x, bool queries) {
    return detail::sequence_to_heads(function, comm, x, queries ? layout.q_runs : layout.k_runs,
                                     queries ? Lq : Lk);
  };
  std::vector<T> qf = to_heads(q, true), kf = to_heads(k, false), vf = to_heads(v, false);
  std::vector<T> outf = to_heads(out, true), doutf = to_heads(dout, true);
  std::vector<T> lsef = to_heads(attn::detail::rows_as_heads(logsumexp), true);
  std::vector<T> dqf(qf.size()), dkf(kf.size()), dvf(vf.size());
  const AttentionGradientViews<T> full_grads{detail::full_view(dqf, layout, Hq, Lq, D),
                                             detail::full_view(dkf, layout, Hkv, Lk, D),
                                             detail::full_view(dvf, layout, Hkv, Lk, Dv)};
  attn::detail::attention_backward_into<T>(
      detail::full_view(qf, layout, Hq, Lq, D), detail::full_view(kf, layout, Hkv, Lk, D),
      detail::full_view(vf, layout, Hkv, Lk, Dv), detail::full_view(outf, layout, Hq, Lq, Dv),
      bhl_view<const T>(lsef.data(), layout.batch, Hq / layout.ranks, Lq),
      detail::full_view(doutf, layout, Hq, Lq, Dv), full_grads, group);
  detail::heads_to_sequence(function, comm, dqf, grads.dq, layout.q_runs, Lq);
  detail::heads_to_sequence(function, comm, dkf, grads.dk, layout.k_runs, Lk);
  detail::heads_to_sequence(function, comm, dvf, grads.dv, layout.k_runs, Lk);
  // dsinks from this rank's rows of every head, as the ring's backward does.
  detail::sink_gradients_across_ranks(function, comm, layout, options, out, dout, logsumexp,
                                      grads.dsinks);
}

}  // namespace attn::distributed
