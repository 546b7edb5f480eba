// attn/distributed/ring.hpp: ring attention, the forward: one sequence split across the
// ranks of a communicator, each rank keeping its queries while the K/V blocks go round.
//
//   q          (B, Hq,  lq, D)    this rank's queries (its runs of Lq; sequence_split.hpp)
//   k          (B, Hkv, lk, D)    this rank's keys (its runs of Lk)
//   v          (B, Hkv, lk, Dv)
//   out        (B, Hq,  lq, Dv)   this rank's rows of the global result
//   logsumexp  (B, Hq,  lq)       optional: their global log-sum-exp (for the backward)
//
// P steps: at step s rank r holds the K/V block of rank r - s, posts MPI_Isend of it to
// r + 1 and MPI_Irecv of the next from r - 1, computes its queries against the block it
// holds (the block's pieces, block_pieces.hpp; a block no query sees is skipped), merges the
// partial (out, lse) states into its running result with merge_attention_states, and waits
// for the transfer. Learned sinks join once, in a last merge. Every rank sends P - 1 blocks
// of B Hkv lk (D + Dv) elements. Deterministic: for a fixed number of ranks the same bits on
// every run and for any number of threads per rank (the kernels' own guarantee; the merges
// go in step order). The result equals scaled_dot_product_attention over the gathered
// tensors with the same options within the kernels' error bound (tests/distributed/).
//
// Extra memory per rank: two K/V blocks of the largest rank (double buffering), one
// (B, Hq, lq, Dv) state and its (B, Hq, lq) log-sum-exp (the latter only when `logsumexp`
// is not asked for).
#pragma once

#include <mpi.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attn/attention.hpp"
#include "attn/config.hpp"
#include "attn/distributed/agreement.hpp"
#include "attn/distributed/ring_blocks.hpp"
#include "attn/distributed/ring_transfer.hpp"
#include "attn/merge.hpp"
#include "attn/options.hpp"
#include "attn/outputs.hpp"
#include "attn/tensor.hpp"

namespace attn::distributed {

namespace detail {

/// The local checks of the forward's outputs, as a message ("" when fine).
template <class T>
std::string local_forward_error(const char* function,
                                const HeadsView<const T>& q,  // (B, Hq, lq, D)
                                const HeadsView<const T>& k,  // (B, Hkv, lk, D)
                                const HeadsView<const T>& v,  // (B, Hkv, lk, Dv)
                                const AttentionOutputViews<T>& outputs) {
  try {
    attn::detail::check_output_shape(function, q, v.dim, outputs.out);
    if (outputs.weights)
      attn::detail::throw_invalid_argument(function, "weights are not available from a ring");
    // Unlike one call, q is read at every step: out may not even be q itself.
    const HeadsView<const T> out(outputs.out);
    for (const auto& [name, input] : {std::pair{"q", q}, std::pair{"k", k}, std::pair{"v", v}}) {
      if (attn::detail::views_may_overlap(out, input)) {
        attn::detail::throw_invalid_argument(
            function,
            std::string("out overlaps ") + name + ": a ring reads its inputs at every step");
      }
    }
    attn::detail::check_optional_outputs(function, q, k, v, outputs);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return {};
}

/// The ring itself, on validated arguments and the agreed layout.
template <class T>
void run_ring_forward(const char* function, MPI_Comm comm, const RingLayout& layout,
                      const HeadsView<const T>& q,  // (B, Hq, lq, D)
                      const HeadsView<const T>& k,  // (B, Hkv, lk, D)
                      const HeadsView<const T>& v,  // (B, Hkv, lk, Dv)
                      const HeadsView<T>& out,      // (B, Hq, lq, Dv)
                      const RowsView<T>& lse,       // (B, Hq, lq)
                      const AttentionOptions<T>& options, RingStats* stats) {
  const Index B = layout.batch, Hq = layout.q_heads, Hkv = layout.kv_heads;
  const Index D = layout.dim, Dv = layout.value_dim, lq = q.length;
  // The running state starts empty: out 0, lse -inf.
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < Hq; ++h) {
      out.head(b, h).setZero();
      for (Index i = 0; i < lq; ++i)
        lse.data[b * lse.batch_stride + h * lse.head_stride + i] =
            -std::numeric_limits<T>::infinity();
    }
  }
  // K/V blocks, double buffered: (B, Hkv, lk_r, D) then (B, Hkv, lk_r, Dv).
  std::vector<T> blocks[2] = {std::vector<T>(static_cast<std::size_t>(layout.max_kv_elements())),
                              std::vector<T>(static_cast<std::size_t>(layout.max_kv_elements()))};
  pack_heads(v, pack_heads(k, blocks[0].data()));
  // One block's partial state, (B, Hq, lq, Dv) and (B, Hq, lq).
  std::vector<T> part_out(static_cast<std::size_t>(B * Hq * lq * Dv));
  std::vector<T> part_lse(static_cast<std::size_t>(B * Hq * lq));
  const HeadsView<T> part_out_view = bhld_view(part_out.data(), B, Hq, lq, Dv);
  const RowsView<T> part_lse_view = bhl_view(part_lse.data(), B, Hq, lq);
  RingTransfer<T> transfer(function, comm, 100);
  for (int step = 0; step < layout.ranks; ++step) {
    const int source = (layout.rank + layout.ranks - step) % layout.ranks;
    const int incoming = (source + layout.ranks - 1) % layout.ranks;
    T* current = blocks[step % 2].data();
    if (step + 1 < layout.ranks) {
      transfer.start(current, layout.kv_elements(source), layout.next(),
                     blocks[(step + 1) % 2].data(), layout.kv_elements(incoming), layout.previous(),
                     stats);
    }
    const Index lk = layout.k_rows[static_cast<std::size_t>(source)];
    const HeadsView<const T> kb = bhld_view<const T>(current, B, Hkv, lk, D);
    const HeadsView<const T> vb = bhld_view<const T>(current + B * Hkv * lk * D, B, Hkv, lk, Dv);
    const double start = MPI_Wtime();
    const int calls = for_each_piece(layout, source, options, [&](const PieceCall<T>& c) {
      const HeadsView<T> piece_out = sub_view(part_out_view, c.b0, c.nb, c.q_row, c.rows);
      const RowsView<T> piece_lse = sub_rows(part_lse_view, c.b0, c.nb, c.q_row, c.rows);
      attn::detail::attention_into<T, T, T>(
          function, sub_view(q, c.b0, c.nb, c.q_row, c.rows),
          sub_view(kb, c.b0, c.nb, c.k_row, c.keys), sub_view(vb, c.b0, c.nb, c.k_row, c.keys),
          AttentionOutputViews<T>(piece_out, piece_lse), c.options);
      const HeadsView<T> run_out = sub_view(out, c.b0, c.nb, c.q_row, c.rows);
      const RowsView<T> run_lse = sub_rows(lse, c.b0, c.nb, c.q_row, c.rows);
      merge_attention_states<T>({{run_out, run_lse}, {piece_out, piece_lse}},
                                AttentionOutputViews<T>(run_out, run_lse));
      transfer.progress();
    });
    if (stats != nullptr) {
      stats->compute_seconds += MPI_Wtime() - start;
      stats->blocks_computed += calls > 0 ? 1 : 0;
      stats->steps += 1;
    }
    transfer.wait(stats);
  }
  if (!options.sinks.empty())  // the sink belongs to the softmax once
    merge_attention_states<T>({{out, lse}}, AttentionOutputViews<T>(out, lse), options.sinks);
}

}  // namespace detail

/// Ring attention over the ranks of `comm` (any communicator: a sub-communicator of a
/// data-parallel x context-parallel grid works the same), written into outputs.out
/// (B, Hq, lq, Dv) and, when given, outputs.logsumexp (B, Hq, lq): this rank's rows of
/// attention over the whole sequence. Collective: every rank of `comm` calls it with the
/// same shapes, options and split, its own runs of queries and keys. Throws
/// std::invalid_argument on every rank, before anything is written or sent, when one rank's
/// arguments are wrong or the ranks disagree (attn/distributed/agreement.hpp). float or
/// double.
template <class T>
void ring_attention_into(const HeadsView<const T>& q,  // (B, Hq, lq, D)
                         const HeadsView<const T>& k,  // (B, Hkv, lk, D)
                         const HeadsView<const T>& v,  // (B, Hkv, lk, Dv)
                         const attn::detail::identity_t<AttentionOutputViews<T>>& outputs,
                         const attn::detail::identity_t<AttentionOptions<T>>& options,
                         const RingOptions& ring, MPI_Comm comm) {
  constexpr const char* function = "ring_attention";
  const double start = MPI_Wtime();
  std::string error = detail::local_ring_error(function, q, k, v, options);
  if (error.empty())
    error = detail::local_forward_error(function, q, k, v, outputs);
  detail::RingLayout layout = detail::agree_on_ring(function, comm, q, k, v, options, ring, error);
  layout.query_chunk = std::max(Index(0), ring.query_chunk);
  std::vector<T> own_lse;
  RowsView<T> lse;
  if (outputs.logsumexp) {
    lse = *outputs.logsumexp;
  } else {
    own_lse.resize(static_cast<std::size_t>(q.batch * q.heads * q.length));
    lse = bhl_view(own_lse.data(), q.batch, q.heads, q.length);
  }
  if (ring.stats != nullptr)
    *ring.stats = RingStats{};
  detail::run_ring_forward(function, comm, layout, q, k, v, outputs.out, lse, options, ring.stats);
  if (ring.stats != nullptr)
    ring.stats->total_seconds = MPI_Wtime() - start;
}

/// ring_attention_into on rank-4 row-major tensors: returns out (B, Hq, lq, Dv) and, with
/// Return::logsumexp, the log-sum-exp (B, Hq, lq) (Return::weights is refused).
template <class T>
AttentionOutputs<T> ring_attention(const Tensor<T, 4>& q,  // (B, Hq, lq, D)
                                   const Tensor<T, 4>& k,  // (B, Hkv, lk, D)
                                   const Tensor<T, 4>& v,  // (B, Hkv, lk, Dv)
                                   const AttentionOptions<T>& options, const RingOptions& ring,
                                   MPI_Comm comm, Return returns = Return::nothing_else) {
  AttentionOutputs<T> result;
  result.out.resize(q.dimension(0), q.dimension(1), q.dimension(2), v.dimension(3));
  AttentionOutputViews<T> views(bhld_view(result.out));
  if (attn::detail::wants(returns, Return::logsumexp)) {
    result.logsumexp.resize(q.dimension(0), q.dimension(1), q.dimension(2));
    views.logsumexp = bhl_view(result.logsumexp);
  }
  if (attn::detail::wants(returns, Return::weights))  // refused on every rank, collectively
    views.weights = bhld_view(result.weights);
  ring_attention_into<T>(bhld_view(q), bhld_view(k), bhld_view(v), views, options, ring, comm);
  return result;
}

}  // namespace attn::distributed
