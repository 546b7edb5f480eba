// attn/distributed/ring_backward.hpp: ring attention, the backward: the gradients of a
// sequence split across the ranks of a communicator.
//
//   q, dq      (B, Hq,  lq, D)    this rank's queries and their gradient
//   k, dk      (B, Hkv, lk, D)    this rank's keys and theirs
//   v, dv      (B, Hkv, lk, Dv)
//   out, dout  (B, Hq,  lq, Dv)   this rank's rows of the forward's result and dL/dout
//   logsumexp  (B, Hq,  lq)       their global log-sum-exp (ring_attention's)
//
// ring-flash-attention's scheme: the K/V blocks go round as in the forward; at step s rank
// r computes the gradients of its queries against the block of rank r - s, piece by piece
// (block_pieces.hpp) with attn's backward, whose probabilities exp(s - lse) from the global
// log-sum-exp are the global ones, so each piece gives exact partial gradients. dq adds up
// locally; the block's dk and dv partials add to the sum that arrived from rank r - 1 (which
// computed on the same block one step earlier) and travel on to r + 1, so that after P
// steps each block's dk and dv come home to their owner. The sum of a block's gradient runs
// in ring order from its owner, the same every run: deterministic for a fixed number of
// ranks and any number of threads. Each rank sends P - 1 K/V blocks and P dk/dv blocks;
// a dk/dv sum travels while the next step computes.
//
// Extra memory per rank: two K/V blocks and three dk/dv blocks of the largest rank, one
// block of piece gradients and one (B, Hq, lq, D) of dq pieces.
#pragma once

#include <mpi.h>

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attn/attention_backward.hpp"
#include "attn/config.hpp"
#include "attn/distributed/agreement.hpp"
#include "attn/distributed/ring_blocks.hpp"
#include "attn/distributed/ring_transfer.hpp"
#include "attn/options.hpp"
#include "attn/outputs.hpp"
#include "attn/tensor.hpp"

namespace attn::distributed {

namespace detail {

/// Adds src to dst, both (B, H, L, D) views of one shape.
template <class T>
void add_heads(const HeadsView<T>& dst, const HeadsView<const T>& src) {
  for (Index b = 0; b < dst.batch; ++b)
    for (Index h = 0; h < dst.heads; ++h)
      dst.head(b, h) += src.head(b, h);
}

/// The gradients' K and V parts of a contiguous block of `rows` keys.
template <class T>
std::pair<HeadsView<T>, HeadsView<T>> kv_views(T* block, const RingLayout& layout, Index rows) {
  const Index B = layout.batch, Hkv = layout.kv_heads;
  return {bhld_view(block, B, Hkv, rows, layout.dim),
          bhld_view(block + B * Hkv * rows * layout.dim, B, Hkv, rows, layout.value_dim)};
}

/// The inputs of a ring backward on this rank.
template <class T>
struct RingBackwardInputs {
  HeadsView<const T> q, k, v, out, dout;  // (B, Hq, lq, D) ... (B, Hq, lq, Dv)
  RowsView<const T> lse;                  // (B, Hq, lq)
};

/// One step's gradients of this rank's queries against the K/V block `current` of rank
/// `source`: dq adds up into `dq`, the block's dk and dv into `mine` (zeroed first).
template <class T>
int backward_step(const char* function, const RingLayout& layout, int source, const T* current,
                  const RingBackwardInputs<T>& in, const HeadsView<T>& dq, T* mine,
                  std::vector<T>& dq_piece, std::vector<T>& dkv_piece,
                  const AttentionOptions<T>& options, std::vector<RingTransfer<T>*> transfers) {
  const Index lk = layout.k_rows[static_cast<std::size_t>(source)];
  const Index count = layout.kv_elements(source);
  std::fill(mine, mine + count, T(0));
  // Named views, not structured bindings: C++17 lambdas cannot capture those.
  const std::pair<HeadsView<T>, HeadsView<T>> block = kv_views(const_cast<T*>(current), layout, lk);
  const std::pair<HeadsView<T>, HeadsView<T>> sums = kv_views(mine, layout, lk);
  const std::pair<HeadsView<T>, HeadsView<T>> piece = kv_views(dkv_piece.data(), layout, lk);
  const HeadsView<T> dq_pieces =
      bhld_view(dq_piece.data(), layout.batch, layout.q_heads, in.q.length, layout.dim);
  (void)function;
  return for_each_piece(layout, source, options, [&](const PieceCall<T>& c) {
    const auto rows = [&](const auto& x) { return sub_view(x, c.b0, c.nb, c.q_row, c.rows); };
    const auto keys = [&](const auto& x) { return sub_view(x, c.b0, c.nb, c.k_row, c.keys); };
    const AttentionGradientViews<T> grads{rows(dq_pieces), keys(piece.first), keys(piece.second)};
    attn::detail::attention_backward_into<T>(rows(in.q), keys(HeadsView<const T>(block.first)),
                                             keys(HeadsView<const T>(block.second)), rows(in.out),
                                             sub_rows(in.lse, c.b0, c.nb, c.q_row, c.rows),
                                             rows(in.dout), grads, c.options);
    add_heads(rows(dq), HeadsView<const T>(grads.dq));
    add_heads(keys(sums.first), HeadsView<const T>(grads.dk));
    add_heads(keys(sums.second), HeadsView<const T>(grads.dv));
    for (RingTransfer<T>* t : transfers)
      t->progress();
  });
}

/// The learned sinks' gradient over every rank's rows, dsinks_h = -sum over b and the valid
/// rows i of exp(z_h - lse_i) (dout_i . out_i) (docs/training.md), into `dsinks` (Hq) when
/// given. Each rank sums its own rows in double; one MPI_Allgather of the Hq sums and their
/// sum in rank order give every rank the same bits. Collective whenever options.sinks is
/// given (agreed), whether or not this rank asked for dsinks.
template <class T>
void sink_gradients_across_ranks(const char* function, MPI_Comm comm, const RingLayout& layout,
                                 const AttentionOptions<T>& options,
                                 const HeadsView<const T>& out,   // (B, Hq, lq, Dv)
                                 const HeadsView<const T>& dout,  // (B, Hq, lq, Dv)
                                 const RowsView<const T>& lse,    // (B, Hq, lq)
                                 const std::optional<Eigen::Map<Vector<T>>>& dsinks) {
  if (options.sinks.empty())
    return;
  const Index Hq = layout.q_heads;
  std::vector<double> mine(static_cast<std::size_t>(Hq), 0.0);
  for (Index b = 0; b < layout.batch; ++b) {
    const Index valid = options.query_lengths.empty()
                            ? layout.q_length
                            : options.query_lengths[static_cast<std::size_t>(b)];
    for (Index h = 0; h < Hq; ++h) {
      const auto z = static_cast<double>(options.sinks[static_cast<std::size_t>(h)]);
      for (const TokenRun& run : layout.q_runs[static_cast<std::size_t>(layout.rank)]) {
        for (Index i = run.begin; i < std::min(run.end, valid); ++i) {
          const Index row = run.local_begin + i - run.begin;
          const double delta = (dout.head(b, h).row(row).template cast<double>().array() *
                                out.head(b, h).row(row).template cast<double>().array())
                                   .sum();
          const auto l =
              static_cast<double>(lse.data[b * lse.batch_stride + h * lse.head_stride + row]);
          mine[static_cast<std::size_t>(h)] -= std::exp(z - l) * delta;
        }
      }
    }
  }
  std::vector<double> all(mine.size() * static_cast<std::size_t>(layout.ranks));
  check_mpi(function,
            MPI_Allgather(mine.data(), static_cast<int>(Hq), MPI_DOUBLE, all.data(),
                          static_cast<int>(Hq), MPI_DOUBLE, comm),
            "MPI_Allgather of the sinks' gradients");
  if (!dsinks)
    return;
  Eigen::Map<Vector<T>> out_sinks = *dsinks;  // a map of the caller's memory
  for (Index h = 0; h < Hq; ++h) {
    double sum = 0;
    for (int r = 0; r < layout.ranks; ++r)
      sum += all[static_cast<std::size_t>(r * Hq + h)];
    out_sinks[h] = static_cast<T>(sum);
  }
}

/// The ring of the backward, on validated arguments and the agreed layout.
template <class T>
void run_ring_backward(const char* function, MPI_Comm comm, const RingLayout& layout,
                       const RingBackwardInputs<T>& in, const AttentionGradientViews<T>& grads,
                       const AttentionOptions<T>& options, RingStats* stats) {
  const auto block = static_cast<std::size_t>(layout.max_kv_elements());
  std::vector<T> blocks[2] = {std::vector<T>(block), std::vector<T>(block)};
  pack_heads(in.v, pack_heads(in.k, blocks[0].data()));
  // dk/dv sums: arriving, in flight to the next rank, and this step's own.
  std::vector<T> arriving(block), leaving(block), mine(block), dkv_piece(block);
  std::vector<T> dq_piece(
      static_cast<std::size_t>(layout.batch * layout.q_heads * in.q.length * layout.dim));
  for (Index b = 0; b < grads.dq.batch; ++b)
    for (Index h = 0; h < grads.dq.heads; ++h)
      grads.dq.head(b, h).setZero();
  RingTransfer<T> kv(function, comm, 100), dkv_in(function, comm, 200),
      dkv_out(function, comm, 200);
  for (int step = 0; step < layout.ranks; ++step) {
    const int source = (layout.rank + layout.ranks - step) % layout.ranks;
    const int incoming = (source + layout.ranks - 1) % layout.ranks;
    const Index count = layout.kv_elements(source);
    if (step + 1 < layout.ranks) {
      kv.start(blocks[step % 2].data(), count, layout.next(), blocks[(step + 1) % 2].data(),
               layout.kv_elements(incoming), layout.previous(), stats);
    }
    if (step > 0)  // the sum of this block's gradients from the ranks before
      dkv_in.start(nullptr, 0, -1, arriving.data(), count, layout.previous(), stats);
    const double start = MPI_Wtime();
    const int calls =
        backward_step(function, layout, source, blocks[step % 2].data(), in, grads.dq, mine.data(),
                      dq_piece, dkv_piece, options, {&kv, &dkv_in, &dkv_out});
    if (stats != nullptr) {
      stats->compute_seconds += MPI_Wtime() - start;
      stats->blocks_computed += calls > 0 ? 1 : 0;
      stats->steps += 1;
    }
    if (step > 0) {
      dkv_in.wait(stats);
      for (Index n = 0; n < count; ++n)  // in ring order: the earlier ranks' sum, then ours
        mine[static_cast<std::size_t>(n)] =
            arriving[static_cast<std::size_t>(n)] + mine[static_cast<std::size_t>(n)];
    }
    dkv_out.wait(stats);
    std::swap(leaving, mine);
    dkv_out.start(leaving.data(), count, layout.next(), nullptr, 0, -1, stats);
    kv.wait(stats);
  }
  // This rank's own block comes home from the rank before, complete.
  dkv_in.start(nullptr, 0, -1, arriving.data(), layout.kv_elements(layout.rank), layout.previous(),
               stats);
  dkv_in.wait(stats);
  dkv_out.wait(stats);
  const std::pair<HeadsView<T>, HeadsView<T>> home = kv_views(arriving.data(), layout, in.k.length);
  for (Index b = 0; b < layout.batch; ++b) {
    for (Index h = 0; h < layout.kv_heads; ++h) {
      grads.dk.head(b, h) = home.first.head(b, h);
      grads.dv.head(b, h) = home.second.head(b, h);
    }
  }
}

}  // namespace detail

/// The gradients of ring_attention on this rank's rows, written into grads.dq (B, Hq, lq, D),
/// grads.dk (B, Hkv, lk, D) and grads.dv (B, Hkv, lk, Dv): `out` and `logsumexp` as
/// ring_attention returned them for the same inputs, options and split. Collective, with the
/// same agreement as the forward (every rank throws alike, before anything is written).
/// With learned sinks, grads.dsinks (Hq) when given: the sinks' gradient over the whole
/// sequence, the same on every rank. dbias is not available (bias is refused).
template <class T>
void ring_attention_backward_into(
    const HeadsView<const T>& q,                                       // (B, Hq, lq, D)
    const HeadsView<const T>& k,                                       // (B, Hkv, lk, D)
    const HeadsView<const T>& v,                                       // (B, Hkv, lk, Dv)
    const HeadsView<const T>& out,                                     // (B, Hq, lq, Dv)
    const RowsView<const T>& logsumexp,                                // (B, Hq, lq)
    const HeadsView<const T>& dout,                                    // (B, Hq, lq, Dv)
    const attn::detail::identity_t<AttentionGradientViews<T>>& grads,  // dq, dk, dv
    const attn::detail::identity_t<AttentionOptions<T>>& options, const RingOptions& ring,
    MPI_Comm comm) {
  constexpr const char* function = "ring_attention_backward";
  const double start = MPI_Wtime();
  std::string error = detail::local_ring_error(function, q, k, v, options);
  if (error.empty()) {
    try {
      if (grads.dbias)
        attn::detail::throw_invalid_argument(function, "grads.dbias is not available from a ring");
      attn::detail::check_backward_arguments(function, q, k, v, out, logsumexp, dout, grads,
                                             options);
    } catch (const std::invalid_argument& e) {
      error = e.what();
    }
  }
  detail::RingLayout layout = detail::agree_on_ring(function, comm, q, k, v, options, ring, error);
  layout.query_chunk = std::max(Index(0), ring.query_chunk);
  if (ring.stats != nullptr)
    *ring.stats = RingStats{};
  detail::run_ring_backward<T>(function, comm, layout, {q, k, v, out, dout, logsumexp}, grads,
                               options, ring.stats);
  detail::sink_gradients_across_ranks(function, comm, layout, options, out, dout, logsumexp,
                                      grads.dsinks);
  if (ring.stats != nullptr)
    ring.stats->total_seconds = MPI_Wtime() - start;
}

/// ring_attention_backward_into on rank-4 row-major tensors: returns dq, dk and dv, and with
/// Return::dsinks the learned sinks' gradient (Hq).
template <class T>
AttentionGradients<T> ring_attention_backward(const Tensor<T, 4>& q,          // (B, Hq, lq, D)
                                              const Tensor<T, 4>& k,          // (B, Hkv, lk, D)
                                              const Tensor<T, 4>& v,          // (B, Hkv, lk, Dv)
                                              const Tensor<T, 4>& out,        // (B, Hq, lq, Dv)
                                              const Tensor<T, 3>& logsumexp,  // (B, Hq, lq)
                                              const Tensor<T, 4>& dout,       // (B, Hq, lq, Dv)
                                              const AttentionOptions<T>& options,
                                              const RingOptions& ring, MPI_Comm comm,
                                              Return returns = Return::nothing_else) {
  AttentionGradients<T> g;
  g.dq.resize(q.dimension(0), q.dimension(1), q.dimension(2), q.dimension(3));
  g.dk.resize(k.dimension(0), k.dimension(1), k.dimension(2), k.dimension(3));
  g.dv.resize(v.dimension(0), v.dimension(1), v.dimension(2), v.dimension(3));
  AttentionGradientViews<T> views{bhld_view(g.dq), bhld_view(g.dk), bhld_view(g.dv)};
  if (attn::detail::wants(returns, Return::dsinks)) {  // checked collectively with the rest
    g.dsinks.resize(options.sinks.size());
    views.dsinks.emplace(g.dsinks.data(), static_cast<Index>(g.dsinks.size()));
  }
  ring_attention_backward_into<T>(bhld_view(q), bhld_view(k), bhld_view(v), bhld_view(out),
                                  bhl_view(logsumexp), bhld_view(dout), views, options, ring, comm);
  return g;
}

}  // namespace attn::distributed
